"""The crash-safety chain shared by the local-disk and the object-storage tests: launch after launch, one rank is
SIGKILLed during a save that overwrites ``last.ckpt``, and each next launch must resume from exactly the last
complete checkpoint. ``store`` (support/stores.py) is where the checkpoints are: a directory or a bucket."""
import re
from pathlib import Path
from typing import Optional

from support.ranks import config, worker
from support.states import assert_identical, assert_ranks_identical, info, load

LAST = "last.ckpt"


def _last_candidates(store):
    """What Lightning 2.0.x's ``ckpt_path="last"`` chooses from: every entry whose name contains 'last'."""
    return [name for name in store.names() if "last" in name]


def run_chain(reference, tmp_path: Path, store, state_dict_type: str, use_orig_params: int, trials, first_save_killed: bool,
              extra=()) -> int:
    """Kill one save per launch (``trials``: (point, rank) pairs); each next launch resumes with ckpt_path="last"
    (every other one by path) and must restore exactly the last complete checkpoint. ``extra``: more worker
    arguments (a store's configuration). Returns the number of kills."""
    ref = reference(state_dict_type, use_orig_params)
    ckpt = store.dir
    saved_epoch: Optional[int] = None  # epoch of the checkpoint at last.ckpt; None: there is none
    for launch, (point, rank) in enumerate(trials):
        run = tmp_path / f"launch{launch}"
        before = store.hashes(LAST) if store.exists(LAST) else None
        args = [*config(run, state_dict_type, use_orig_params), "--ckpt-dir", ckpt, "--last-only", "--max-epochs", 3, *extra]
        # Kill the first save when there is a checkpoint to protect (or the chain starts that way);
        # otherwise let one save complete and kill the second.
        save = 1 if saved_epoch is not None or (launch == 0 and first_save_killed) else 2
        if launch > 0:
            args += ["--ckpt-path", "last" if launch % 2 or saved_epoch is None else ckpt / LAST]
        output = worker(run, *args, "--kill", f"{point}:{rank}:{save}", expect_failure=True)
        assert re.search(r"exitcode\s*:\s*-9|SIGKILL", output), f"{point}@rank{rank} was not killed:\n{output[-3000:]}"

        if launch > 0:
            assert_restored(ref, run, saved_epoch)
        if save == 2:
            saved_epoch = 0  # from scratch, the first save (after epoch 0) completed
        if point == "after-publish":
            saved_epoch = (saved_epoch if saved_epoch is not None else -1) + 1  # the new one was complete
        elif before is not None:
            assert store.hashes(LAST) == before, f"{point}@rank{rank}: the previous checkpoint was modified"
        if saved_epoch is None:
            assert not store.exists(LAST), f"{point}@rank{rank}: a partial first save became visible"
        assert _last_candidates(store) == ([LAST] if saved_epoch is not None else []), _last_candidates(store)

    final = tmp_path / "final"
    worker(final, *config(final, state_dict_type, use_orig_params), "--ckpt-dir", ckpt, "--last-only",
           "--max-epochs", 3, "--ckpt-path", "last", *extra)
    assert_restored(ref, final, saved_epoch)
    assert_ranks_identical(ref / "out", "final", final / "out", "final")
    assert store.names() == [LAST], "leftovers of the killed saves were not removed"
    return len(trials)


def assert_restored(ref: Path, run: Path, saved_epoch: Optional[int]) -> None:
    if saved_epoch is None:  # nothing to resume: ckpt_path="last" starts from scratch
        assert info(run / "out", "start")["global_step"] == 0
        assert_identical(load(ref / "out" / "start_rank0.pt")["params"], load(run / "out" / "start_rank0.pt")["params"],
                         "initial weights")
        return
    assert info(run / "out", "start")["epoch"] == saved_epoch + 1
    assert_ranks_identical(ref / "out", f"epoch{saved_epoch}", run / "out", "start")
