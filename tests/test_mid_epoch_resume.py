"""A Trainer run checkpointed inside an epoch (``ModelCheckpoint(every_n_train_steps=4)``) and resumed in new processes
goes on as if it had never stopped: the same steps, each rank training on the same samples in the same order, the
same validations, and every rank's shards and optimizer state at the end equal bit for bit.

Runs: 48 samples in batches of 4, so 6 batches an epoch on each of 2 ranks (12 in one process), 3 epochs, a dropout
layer (each rank's random numbers); checkpoints after steps 4, 8, 12, ... Step 4 is inside epoch 0, step 16 inside
epoch 2 (FSDP) or epoch 1 (one process).
"""
import json
from pathlib import Path

import pytest

from support.flavours import NATIVE, VERSION
from support.marks import needs_cpu_fsdp, raising, require, skip_as
from support.ranks import mid_epoch_worker
from support.states import assert_ranks_identical, info

pytestmark = pytest.mark.multirank


def _run(root: Path, *args, ckpt: str = None, nproc: int = 2) -> Path:
    resume = ("--ckpt-path", root.parent / "ref" / "ckpt" / ckpt) if ckpt else ()
    mid_epoch_worker("--out", root / "out", "--ckpt-dir", root / "ckpt", *args, *resume, nproc=nproc)
    return root / "out"


def _records(out: Path, name: str, rank: int) -> list:
    return json.loads((out / f"{name}_rank{rank}.json").read_text())


def _resumes_exactly(tmp_path: Path, args, at_steps, nproc: int = 2, weights: bool = True, name: str = "step={}.ckpt") -> str:
    """The uninterrupted run, then one resumed from each step of ``at_steps``: from that step on, every rank trains
    the same samples at the same steps and batch indices, validates at the same steps (at the checkpoint's step too,
    unless it was saved at the end of that validation) with the same metric, and ends with the same shards and
    optimizer state (``weights``: else the steps and data alone are compared). Returns
    the resumed runs' output."""
    saved_after_validating = "--at-validation-end" in args
    ref = _run(tmp_path / "ref", *args, nproc=nproc)
    output = ""
    for step in at_steps:
        resumed = tmp_path / f"from{step}" / "out"
        output += mid_epoch_worker("--out", resumed, "--ckpt-dir", resumed.parent / "ckpt", *args, "--ckpt-path",
                                   tmp_path / "ref" / "ckpt" / name.format(step), nproc=nproc)
        for rank in range(max(nproc, 1)):
            expected = [record for record in _records(ref, "trained", rank) if record[0] >= step]
            assert _records(resumed, "trained", rank) == expected, f"rank {rank}, resumed from step {step}"
            validated = [r for r in _records(ref, "validated", rank) if r[0] > step or r[0] == step and not saved_after_validating]
            got = _records(resumed, "validated", rank)
            if not weights:  # the metrics too, where the weights are the same
                got, validated = [r[:2] for r in got], [r[:2] for r in validated]
            assert got == validated, f"rank {rank}, resumed from step {step}"
        assert info(resumed, "final")["global_step"] == info(ref, "final")["global_step"]
        if weights:
            assert_ranks_identical(ref, "final", resumed, "final")
    return output


native_fails = pytest.mark.xfail(
    NATIVE, strict=True, raises=raising(AssertionError, r"^rank \d+, resumed from step \d+\n"),
    reason=f"native Lightning {VERSION} feeds the epoch's first batches again after a resume inside it (2.1: one step more)",
)


@needs_cpu_fsdp
@pytest.mark.parametrize("state_dict_type, wrap, data", [
    pytest.param("sharded", "policy", "shuffle", marks=native_fails),
    pytest.param("full", "root", "user-distributed", marks=pytest.mark.skipif(
        NATIVE, reason=f"native Lightning {VERSION} cannot save a full checkpoint with use_orig_params=False")),
])
def test_a_run_resumed_inside_an_epoch_trains_what_the_uninterrupted_run_did(tmp_path, state_dict_type, wrap, data):
    """A DistributedSampler shuffling by epoch (Lightning's, or the user's own), samples drawn with noise from the
    global generator in the main process, and a validation every 2 batches: one of them due right after the
    checkpoint's batch."""
    args = ["--state-dict-type", state_dict_type, "--wrap", wrap, "--data", data, "--augment", "--val-every", "2"]
    _resumes_exactly(tmp_path, args, at_steps=[4, 16])


@pytest.mark.skipif(NATIVE, reason="the shim's resume after a validation: native Lightning is not patched")
@needs_cpu_fsdp
def test_a_checkpoint_saved_at_the_end_of_a_validation_does_not_validate_again(tmp_path):
    """``ModelCheckpoint(monitor="val_loss")`` saves at the end of each validation, every 2 batches: inside epoch 0
    (step 4) and at the end of epoch 1 (step 12, its last batch). The resumed run goes on with the next batch, and
    runs no validation the uninterrupted run did not (Lightning 2.0.x ran that one again)."""
    args = ["--data", "shuffle", "--val-every", "2", "--at-validation-end", "--state-dict-type", "full"]
    _resumes_exactly(tmp_path, args, at_steps=[4, 12])


@pytest.mark.skipif(NATIVE, reason="the shim's fallback and its log line: native Lightning is not patched")
@needs_cpu_fsdp
def test_a_stream_without_state_is_replayed_to_where_it_stopped_with_a_log_line(tmp_path):
    """An IterableDataset read by 2 workers (each rank's share in an order drawn as it starts, noise drawn per sample,
    in the workers): the batches already trained on are loaded again and dropped, which says so. Step 12 ends epoch 1
    on its last batch."""
    args = ["--data", "iterable", "--workers", "2", "--augment", "--wrap", "root", "--use-orig-params", "1"]
    output = _resumes_exactly(tmp_path, args, at_steps=[4, 12])
    assert "Resumed inside epoch 0: loaded and dropped the 4 batches already trained on" in output
    assert "over _IterableDataset" not in output and "over Stream, whose batches have no index" in output


@pytest.mark.skipif(NATIVE, reason="the shim's modes: native Lightning is not patched")
@needs_cpu_fsdp
@pytest.mark.parametrize("augment, mode", [(False, "skip"), (True, "replay")])
def test_workers_resume_exactly_by_index_or_by_replay_where_they_draw_random_numbers(tmp_path, augment, mode):
    """``num_workers=2``: their seeds come from the epoch's start, so leaving out indices is exact where loading a
    sample draws nothing (persistent workers, which the next epochs reuse); where the workers draw noise,
    ``set_mid_epoch_resume("replay")`` loads the batches again through them and is exact too."""
    args = ["--data", "shuffle", "--workers", "2", "--mode", mode] + (["--augment"] if augment else ["--persistent-workers"])
    _resumes_exactly(tmp_path, args, at_steps=[4])


@pytest.mark.skipif(NATIVE, reason="the shim's fallback: native Lightning is not patched")
@needs_cpu_fsdp
def test_two_train_loaders_combined_are_replayed_exactly(tmp_path):
    """Two loaders that Lightning combines (``max_size_cycle``; the shorter one, 3 batches a rank, starts again inside
    the epoch, after the checkpoint's batch): their batches are loaded again and dropped."""
    output = _resumes_exactly(tmp_path, ["--data", "pair"], at_steps=[4])
    assert "Resumed inside epoch 0: loaded and dropped the 4 batches already trained on" in output
    assert "(2 train dataloaders)" in output


@pytest.mark.skipif(NATIVE, reason="the shim patches Lightning 2.0.x's loop, which native Lightning does not use")
def test_ddp_saved_by_rank_zero_alone_resumes_every_rank_in_place(tmp_path):
    """DDP saves may be made by rank 0 alone (``if trainer.is_global_zero: trainer.save_checkpoint(...)``): no rank
    waits for the others, and the checkpoint's one position serves every rank (the user's DistributedSampler: the
    one Lightning 2.0.0 to 2.0.8 injects draws each epoch's order from the global generator, which DDP in Lightning
    2.0.x does not save). The data and the steps are compared, not the weights (dropout)."""
    args = ["--strategy", "ddp", "--data", "user-distributed", "--save-at-batch", "3", "--rank-zero-saves"]
    _resumes_exactly(tmp_path, args, at_steps=[3], weights=False, name="mid-epoch.ckpt")


@pytest.mark.skipif(NATIVE, reason="the shim's warning: native Lightning is not patched")
@needs_cpu_fsdp
def test_gradient_accumulation_resumes_at_its_steps_and_as_lightning_does_between_them(tmp_path):
    """``accumulate_grad_batches=2``: a checkpoint at an optimizer step resumes exactly; one taken between two steps
    (after batch 3), whose accumulated gradients are in no checkpoint, resumes as Lightning resumes it (its own loop
    tests resume such checkpoints), and rank 0 says so, naming the setting."""
    args = ["--accumulate", "2", "--every", "2", "--save-at-batch", "3", "--state-dict-type", "full"]
    _resumes_exactly(tmp_path, args, at_steps=[2])
    output = mid_epoch_worker("--out", tmp_path / "mid" / "out", "--ckpt-dir", tmp_path / "mid" / "ckpt", *args,
                              "--ckpt-path", tmp_path / "ref" / "ckpt" / "mid-epoch.ckpt")
    assert output.count("The checkpoint was taken after batch 3 of epoch 0, between two optimizer steps of"
                        " `Trainer(accumulate_grad_batches=2)`") == 1
    assert info(tmp_path / "mid" / "out", "final")["epoch"] == info(tmp_path / "ref" / "out", "final")["epoch"]


@pytest.mark.skipif(NATIVE, reason="the shim's resume of a StatefulDataLoader: native Lightning is not patched")
@pytest.mark.parametrize("nproc, mode", [(2, "skip"), (0, "replay")])
def test_a_loader_that_says_where_it_is_resumes_exactly(tmp_path, nproc, mode):
    """torchdata's ``StatefulDataLoader``: on 2 ranks (Lightning's DistributedSampler) its trained batches are left out
    by index; in one process with ``replay``, it is restored from the state it saved."""
    require("torchdata", "torchdata.stateful_dataloader")
    if nproc:
        skip_as(needs_cpu_fsdp)
    output = _resumes_exactly(tmp_path, ["--data", "stateful", "--mode", mode], at_steps=[4], nproc=nproc,
                              weights=bool(nproc))
    assert ("restored the loaders' states" in output) == (mode == "replay")


@pytest.mark.skipif(NATIVE, reason="the shim patches Lightning 2.0.x's loop, which native Lightning does not use")
@pytest.mark.parametrize("data", ["generator", "batch-sampler"])
def test_one_process_without_fsdp_resumes_its_loop_and_data_exactly(tmp_path, data):
    """The loop is every strategy's: a RandomSampler with its own generator in epoch 1, and the user's batch sampler
    with drop_last (9 batches of 5). Lightning 2.0.x saves no random states for one device, so the dropout masks
    after the resume differ, as after a resume at an epoch's end: the data and the steps are compared."""
    _resumes_exactly(tmp_path, ["--data", data, "--val-every", "3"], at_steps=[16], nproc=0, weights=False)


@pytest.mark.skipif(NATIVE, reason="the shim's modes: native Lightning is not patched")
def test_lightnings_own_resume_on_request_and_a_checkpoint_without_a_position_warns(tmp_path):
    """``set_mid_epoch_resume("lightning")``: Lightning 2.0.x's own resume, one step more and the epoch's data from
    its start. A checkpoint saved that way has no data position: resumed by the shim, the step count is right, the
    data starts again, and a warning says so."""
    args = ["--data", "sequential", "--max-epochs", "1", "--mode", "lightning"]
    ref = _run(tmp_path / "ref", *args, nproc=0)
    stock = _run(tmp_path / "stock", *args, ckpt="step=4.ckpt", nproc=0)
    trained = _records(ref, "trained", 0)
    assert [r[2:] for r in _records(stock, "trained", 0)] == [[i + 3, r[3]] for i, r in enumerate(trained[:9])]
    assert info(stock, "final")["global_step"] == 13
    output = mid_epoch_worker("--out", tmp_path / "shim" / "out", "--ckpt-dir", tmp_path / "shim" / "ckpt", "--data",
                              "sequential", "--max-epochs", "1", "--ckpt-path", tmp_path / "ref" / "ckpt" / "step=4.ckpt",
                              nproc=0)
    assert "does not say where the data was" in output
    shim = tmp_path / "shim" / "out"
    assert [r[2:] for r in _records(shim, "trained", 0)] == [[i + 4, r[3]] for i, r in enumerate(trained[:8])]
    assert info(shim, "final")["global_step"] == 12


@pytest.mark.skipif(NATIVE, reason="the shim's resume inside a validation: native Lightning is not patched")
@needs_cpu_fsdp
@pytest.mark.parametrize("ranks", [2, 3])
def test_a_failure_inside_a_validation_resumes_by_finishing_that_validation(tmp_path, ranks):
    """A validation every 2 batches (2 batches each), a failure in the second batch of the one after step 4 (inside
    epoch 0), saved by ``OnExceptionCheckpoint``: on 2 ranks the resumed run validates at step 4 with the metric the
    uninterrupted run logged, then trains and validates as it did, to the same weights; on 3 ranks every rank runs
    that validation, then the rest of the epoch."""
    args = ["--data", "shuffle", "--val-every", "2", "--state-dict-type", "sharded", "--max-epochs", "1"]
    ref = _run(tmp_path / "ref", *args)
    failed = tmp_path / "failed"
    mid_epoch_worker("--out", failed / "out", "--ckpt-dir", failed / "ckpt", *args, "--fail-in-validation", 0, 4, 1,
                     expect_failure=True)
    assert "Interrupted: validation batch 1 at step 4" in (failed / "out" / "error_rank0.txt").read_text()
    resumed = tmp_path / "resumed" / "out"
    mid_epoch_worker("--out", resumed, "--ckpt-dir", resumed.parent / "ckpt", *args, "--ckpt-path",
                     failed / "ckpt" / "on-exception.ckpt", nproc=ranks)
    for rank in range(ranks):
        validated = _records(resumed, "validated", rank)
        if ranks == 2:
            assert _records(resumed, "trained", rank) == [r for r in _records(ref, "trained", rank) if r[0] >= 4]
            assert validated == [r for r in _records(ref, "validated", rank) if r[0] >= 4], f"rank {rank}"
        else:
            assert [r[:2] for r in validated] == [[4, 0], [6, 0]], f"rank {rank}"
    if ranks == 2:
        assert_ranks_identical(ref, "final", resumed, "final")
