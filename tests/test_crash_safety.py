"""Crash-safe saves and refused inputs, with real ranks: one rank SIGKILLed at chosen points of a save,
checkpoints of other models, weights-only checkpoints, ranks that disagree on the path.

The atomic saves are the shim's: native Lightning writes sharded checkpoints in place, so on native
Lightning these tests are skipped with that reason.
"""
import re
from pathlib import Path
from typing import Optional

import pytest

from support.flavours import NATIVE, VERSION
from support.marks import needs_cpu_fsdp
from support.ranks import FULL_USE_ORIG_PARAMS, config, worker
from support.states import assert_identical, assert_ranks_identical, file_hashes, info, load

pytestmark = [
    pytest.mark.multirank,
    needs_cpu_fsdp,
    pytest.mark.skipif(NATIVE, reason=f"native Lightning {VERSION} writes checkpoints in place and does not check them"
                                      " before loading; these are the shim's guarantees"),
]

LAST = "last.ckpt"

# (kill point, rank): one rank is SIGKILLed there while a save overwrites last.ckpt. The first trial
# kills the very first save (there is no previous checkpoint); the last one kills after the new
# checkpoint is in place, before the replaced one is removed.
SHARDED_TRIALS = [
    ("mid-shards", 1),
    ("before-shards", 0),
    ("before-shards", 1),
    ("mid-shards", 0),
    ("mid-shards", 1),
    ("after-shards", 0),
    ("after-shards", 1),
    ("before-publish", 0),
    ("after-publish", 0),
]
FULL_TRIALS = [("mid-file", 0), ("before-publish", 0)]


def _last_candidates(ckpt: Path):
    """What Lightning 2.0.x's ``ckpt_path="last"`` chooses from: every entry whose name contains 'last'."""
    return sorted(p.name for p in ckpt.iterdir() if "last" in p.name) if ckpt.is_dir() else []


def _run_chain(reference, tmp_path: Path, state_dict_type: str, use_orig_params: int, trials, first_save_killed: bool) -> int:
    """Kill one save per launch; each next launch resumes with ckpt_path="last" (every other one by path)
    and must restore exactly the last complete checkpoint. Returns the number of kills."""
    ref = reference(state_dict_type, use_orig_params)
    ckpt = tmp_path / "ckpt"
    saved_epoch: Optional[int] = None  # epoch of the checkpoint at last.ckpt; None: there is none
    for launch, (point, rank) in enumerate(trials):
        run = tmp_path / f"launch{launch}"
        before = file_hashes(ckpt / LAST) if (ckpt / LAST).exists() else None
        args = [*config(run, state_dict_type, use_orig_params), "--ckpt-dir", ckpt, "--last-only", "--max-epochs", 3]
        # Kill the first save when there is a checkpoint to protect (or the chain starts that way);
        # otherwise let one save complete and kill the second.
        save = 1 if saved_epoch is not None or (launch == 0 and first_save_killed) else 2
        if launch > 0:
            args += ["--ckpt-path", "last" if launch % 2 or saved_epoch is None else ckpt / LAST]
        output = worker(run, *args, "--kill", f"{point}:{rank}:{save}", expect_failure=True)
        assert re.search(r"exitcode\s*:\s*-9|SIGKILL", output), f"{point}@rank{rank} was not killed:\n{output[-3000:]}"

        if launch > 0:
            _assert_restored(ref, run, saved_epoch)
        if save == 2:
            saved_epoch = 0  # from scratch, the first save (after epoch 0) completed
        if point == "after-publish":
            saved_epoch = (saved_epoch if saved_epoch is not None else -1) + 1  # the new one was complete
        elif before is not None:
            assert file_hashes(ckpt / LAST) == before, f"{point}@rank{rank}: the previous checkpoint was modified"
        if saved_epoch is None:
            assert not (ckpt / LAST).exists(), f"{point}@rank{rank}: a partial first save became visible"
        assert _last_candidates(ckpt) == ([LAST] if saved_epoch is not None else []), _last_candidates(ckpt)

    final = tmp_path / "final"
    worker(final, *config(final, state_dict_type, use_orig_params), "--ckpt-dir", ckpt, "--last-only",
           "--max-epochs", 3, "--ckpt-path", "last")
    _assert_restored(ref, final, saved_epoch)
    assert_ranks_identical(ref / "out", "final", final / "out", "final")
    assert sorted(p.name for p in ckpt.iterdir()) == [LAST], "leftovers of the killed saves were not removed"
    return len(trials)


def _assert_restored(ref: Path, run: Path, saved_epoch: Optional[int]) -> None:
    if saved_epoch is None:  # nothing to resume: ckpt_path="last" starts from scratch
        assert info(run / "out", "start")["global_step"] == 0
        assert_identical(load(ref / "out" / "start_rank0.pt")["params"], load(run / "out" / "start_rank0.pt")["params"],
                         "initial weights")
        return
    assert info(run / "out", "start")["epoch"] == saved_epoch + 1
    assert_ranks_identical(ref / "out", f"epoch{saved_epoch}", run / "out", "start")


def test_killed_sharded_saves_leave_the_previous_checkpoint_loadable(reference, tmp_path):
    assert _run_chain(reference, tmp_path, "sharded", 0, SHARDED_TRIALS, first_save_killed=True) == 9


@pytest.mark.smoke
def test_killed_full_saves_leave_the_previous_checkpoint_loadable(reference, tmp_path):
    assert _run_chain(reference, tmp_path, "full", FULL_USE_ORIG_PARAMS, FULL_TRIALS, first_save_killed=False) == 2


# --- refused inputs: every rank raises the same clear error, nothing is loaded, no file changes --------


def _refused(tmp_path: Path, ckpt: Path, *args, pattern: str) -> None:
    before = file_hashes(ckpt)
    output = worker(tmp_path, *config(tmp_path, "sharded", 0), "--ckpt-path", ckpt, *args, expect_failure=True)
    assert re.search(pattern, output), output[-4000:]
    assert str(ckpt) in output
    assert not list((tmp_path / "out").glob("*.pt")), "the run went on from a refused checkpoint"
    assert file_hashes(ckpt) == before


def test_checkpoint_of_a_wider_model_is_refused(reference, tmp_path):
    _refused(tmp_path, reference("sharded", 0) / "ckpt" / "epoch=1.ckpt", "--net", "wide",
             pattern=r"RuntimeError: The checkpoint .* does not fit this model\. Error\(s\) in loading state_dict:\s+size mismatch for"
                     r" body\.0\.bias: copying a param with shape torch\.Size\(\[16\]\) from checkpoint, the shape in current"
                     r" model is torch\.Size\(\[32\]\)")


def test_checkpoint_missing_keys_is_refused_when_strict(reference, tmp_path):
    _refused(tmp_path, reference("sharded", 0) / "ckpt" / "epoch=1.ckpt", "--net", "extra", "--fn", "validate",
             pattern=r"does not fit this model\. Error\(s\) in loading state_dict:\s+Missing key\(s\) in state_dict: extra\.0\.bias,"
                     r" extra\.0\.weight")


def test_strict_loading_false_loads_the_keys_both_have(reference, tmp_path):
    ref = reference("sharded", 0)
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--ckpt-path", ref / "ckpt" / "epoch=1.ckpt", "--net", "extra",
           "--strict", 0, "--fn", "validate")
    expected = load(ref / "out" / "full_epoch1.pt")["params"]
    loaded = load(tmp_path / "out" / "full_validate.pt")["params"]
    assert_identical(expected, {k: v for k, v in loaded.items() if not k.startswith("extra.")}, "shared weights")


def test_weights_only_checkpoint_cannot_resume_fit(tmp_path):
    first = tmp_path / "first"
    worker(first, *config(first, "sharded", 0), "--max-epochs", 1, "--weights-only")
    _refused(tmp_path / "second", first / "ckpt" / "epoch=0.ckpt",
             pattern=r"KeyError: .Trying to restore optimizer state but checkpoint contains only the model\. This is probably due"
                     r" to `ModelCheckpoint\.save_weights_only` being set to `True`\. \(Checkpoint: ")


def test_truncated_shard_is_refused_on_every_rank(reference, tmp_path):
    import shutil

    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(reference("sharded", 0) / "ckpt" / "epoch=1.ckpt", damaged)
    shard = sorted(damaged.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    _refused(tmp_path / "run", damaged, pattern=r"ValueError: The shard file .* is truncated: 100 bytes")


def test_rank_zero_path_wins_when_ranks_disagree(reference, tmp_path):
    ref = reference("sharded", 0)
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--max-epochs", 3, "--ckpt-path", ref / "ckpt" / "epoch=1.ckpt",
           "--other-ranks-ckpt-path", tmp_path / "does-not-exist.ckpt")
    assert_ranks_identical(ref / "out", "epoch1", tmp_path / "out", "start")
