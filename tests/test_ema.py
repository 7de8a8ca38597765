"""``ShardedEMA``: an average of the weights kept on each rank's FSDP shards. It follows an average of the gathered
weights kept beside the run, validation computes with it and training gets its own weights back bit for bit, and
a sharded checkpoint carries it: a resume in new processes ends with the same average, bit for bit, and one on
another number of ranks reads the same average.

Runs (``support/ema_worker.py``): the Trainer worker's ``Net`` on 2 ranks, 3 epochs of 8 steps, a validation and a
sharded checkpoint after each; decay 0.75, so that every step shows in the average.
"""
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from support.marks import TORCH, needs_async_save, needs_cpu_fsdp, needs_orig_params_optimizer_state, needs_patched_trainer
from support.ranks import ema_worker

pytestmark = [pytest.mark.multirank, needs_cpu_fsdp, needs_patched_trainer]

LAYOUTS = [(0, "root"), (0, "policy"), (1, "root"), (1, "policy")]  # use_orig_params, wrapping
IDS = ["flat-root", "flat-policy", "orig-root", "orig-policy"]


def _run(root: Path, *args, nproc: int = 2) -> str:
    return ema_worker("--out", root / "out", "--ckpt-dir", root / "ckpt", *args, nproc=nproc)


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _identical(expected: dict, actual: dict, what: str) -> None:
    assert sorted(expected) == sorted(actual), what
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{what}: {name}"


def _resumed_as(root: Path, resumed: Path, final: bool) -> None:
    """The run resumed after epoch 0 validated with the same average as the uninterrupted one after epochs 1 and 2,
    bit for bit, and (``final``) ended with the same weights."""
    for epoch in (1, 2):
        _identical(_load(root / "ema" / "out" / f"seen_e{epoch}.pt"), _load(resumed / "out" / f"seen_e{epoch}.pt"),
                   f"the average validated after epoch {epoch}")
    if final:
        _identical(_load(root / "ema" / "out" / "final.pt"), _load(resumed / "out" / "final.pt"), "final weights")


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """Per layout, the uninterrupted run with ShardedEMA (and the reference average) and the same run without it."""
    runs = {}

    def get(use_orig_params: int, wrap: str) -> Path:
        key = (use_orig_params, wrap)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"ema-{use_orig_params}-{wrap}")
            _run(root / "ema", "--use-orig-params", use_orig_params, "--wrap", wrap, "--every-n-steps", 12)
            runs[key] = root
        return runs[key]

    return get


@pytest.mark.parametrize("use_orig_params, wrap", LAYOUTS, ids=IDS)
def test_validation_computes_with_an_average_equal_to_that_of_the_gathered_weights(reference_runs, use_orig_params, wrap):
    out = reference_runs(use_orig_params, wrap) / "ema" / "out"
    for epoch in range(3):
        seen, reference = _load(out / f"seen_e{epoch}.pt"), _load(out / f"reference_e{epoch}.pt")
        assert sorted(seen) == sorted(reference)
        for name in reference:
            torch.testing.assert_close(seen[name], reference[name], rtol=1e-6, atol=1e-7, msg=f"epoch {epoch}: {name}")
        training = _load(out / f"training_e{epoch}.pt")
        assert any(not torch.equal(seen[n], training["before"][n]) for n in seen), "validation ran the training weights"
        _identical(training["before"], training["after"], f"the training weights after validation, epoch {epoch}")


def test_training_with_the_average_runs_the_same_steps_as_without_it(reference_runs, tmp_path):
    root = reference_runs(0, "policy")
    _run(tmp_path / "plain", "--ema", 0, "--reference", 0)
    _identical(_load(tmp_path / "plain" / "out" / "final.pt"), _load(root / "ema" / "out" / "final.pt"), "final weights")


@pytest.mark.parametrize("use_orig_params, wrap", LAYOUTS, ids=IDS)
def test_a_run_resumed_in_new_processes_ends_with_the_same_average_bit_for_bit(reference_runs, tmp_path, use_orig_params, wrap):
    root = reference_runs(use_orig_params, wrap)
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(root / "ema" / "ckpt" / "epoch=0.ckpt", resumed / "ckpt" / "epoch=0.ckpt")
    _run(resumed, "--use-orig-params", use_orig_params, "--wrap", wrap, "--resume", "epoch=0.ckpt", "--reference", 0)
    _resumed_as(root, resumed, final=True)


def test_a_run_resumed_inside_an_epoch_ends_with_the_same_average_bit_for_bit(reference_runs, tmp_path):
    """From the checkpoint after step 12, half-way through epoch 1: the update of step 12 is in it (ModelCheckpoint runs
    after the other callbacks), and the resumed run goes on with step 13's batch."""
    root = reference_runs(0, "policy")
    shutil.copytree(root / "ema" / "ckpt" / "step=12.ckpt", tmp_path / "ckpt" / "step=12.ckpt")
    _run(tmp_path, "--resume", "step=12.ckpt", "--reference", 0)
    _resumed_as(root, tmp_path, final=True)


@pytest.mark.parametrize("use_orig_params, wrap", [pytest.param(0, "policy", id="flat-policy"),
                                                   pytest.param(1, "root", id="orig-root", marks=needs_orig_params_optimizer_state)])
def test_a_full_checkpoint_carries_the_average_and_a_resume_from_it_ends_with_it_bit_for_bit(
        reference_runs, tmp_path, use_orig_params, wrap):
    root = reference_runs(use_orig_params, wrap)
    layout = ("--use-orig-params", use_orig_params, "--wrap", wrap, "--state-dict-type", "full", "--reference", 0)
    _run(tmp_path / "full", *layout, "--epochs", 1)
    written = torch.load(tmp_path / "full" / "ckpt" / "epoch=0.ckpt", weights_only=False)
    _identical(_load(root / "ema" / "out" / "seen_e0.pt"), written["ema_state_dict"], "the full file's average")
    resumed = tmp_path / "resumed"
    _run(resumed, *layout, "--ckpt-dir", tmp_path / "full" / "ckpt", "--resume", "epoch=0.ckpt")
    _resumed_as(root, resumed, final=True)


@needs_async_save
def test_a_checkpoint_saved_in_the_background_holds_the_average_of_its_step(reference_runs, tmp_path):
    """Saves in the background (AsyncCheckpointIO) copy the average with the weights: the updates after the save
    do not reach the checkpoint, and a resume from it ends as the run saved in the foreground. The average's host
    buffers, like the weights', are made ahead of the first save (after its first update), not by it."""
    root = reference_runs(0, "policy")
    _run(tmp_path, "--async-save", 0.5, "--reference", 0, "--epochs", 2)
    for rank in range(2):
        saves = (tmp_path / "out" / f"saves_rank{rank}.txt").read_text().splitlines()
        buffers = [line for line in saves if line.startswith("host-buffer")]
        assert buffers and set(buffers) == {"host-buffer prepared"}, f"rank {rank}: {buffers}"
    resumed = tmp_path / "resumed"
    _run(resumed, "--ckpt-dir", tmp_path / "ckpt", "--resume", "epoch=0.ckpt", "--reference", 0)
    _resumed_as(root, resumed, final=False)


@pytest.mark.parametrize("nproc", [1, 3])
def test_the_average_is_read_onto_another_number_of_ranks(reference_runs, tmp_path, nproc):
    """On one rank FSDP shards nothing (NO_SHARD): the average is that rank's whole flat parameters."""
    root = reference_runs(0, "policy")
    _run(tmp_path, "--ckpt-dir", root / "ema" / "ckpt", "--validate", "epoch=1.ckpt", "--reference", 0, nproc=nproc)
    _identical(_load(root / "ema" / "out" / "seen_e1.pt"), _load(tmp_path / "out" / "seen_e0.pt"),
               f"the average on {nproc} ranks")


@pytest.mark.parametrize("use_orig_params", [0, 1], ids=["flat", "orig"])
def test_a_run_on_one_rank_averages_its_whole_flat_parameters(tmp_path, use_orig_params):
    _run(tmp_path, "--use-orig-params", use_orig_params, "--wrap", "root", "--epochs", 1, nproc=1)
    seen, reference = _load(tmp_path / "out" / "seen_e0.pt"), _load(tmp_path / "out" / "reference_e0.pt")
    assert sorted(seen) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(seen[name], reference[name], rtol=1e-6, atol=1e-7, msg=name)
    training = _load(tmp_path / "out" / "training_e0.pt")
    _identical(training["before"], training["after"], "the training weights after validation")


def test_a_checkpoint_without_an_average_starts_one_with_a_log_line(reference_runs, tmp_path):
    plain = tmp_path / "plain"
    _run(plain, "--ema", 0, "--reference", 0, "--epochs", 1)
    output = _run(plain, "--resume", "epoch=0.ckpt", "--epochs", 2)
    assert "holds no average of the weights; it starts anew at the next update" in output
    seen, reference = _load(plain / "out" / "seen_e1.pt"), _load(plain / "out" / "reference_e1.pt")
    for name in reference:
        torch.testing.assert_close(seen[name], reference[name], rtol=1e-6, atol=1e-7, msg=name)


# --- buffers: BatchNorm's running statistics, which each rank updates from its own batches ------------------------


def _buffers(root: Path, epoch: int, rank: int) -> dict:
    return _load(root / "out" / f"buffers_e{epoch}_rank{rank}.pt")


@pytest.fixture(scope="module")
def buffered_run(tmp_path_factory):
    """The uninterrupted run of a model with BatchNorm, use_buffers=True, sharded checkpoints."""
    root = tmp_path_factory.mktemp("ema-buffered")
    _run(root, "--net", "buffered")
    return root


def test_validation_computes_with_each_ranks_average_of_its_own_buffers(buffered_run):
    ranks = [[_buffers(buffered_run, epoch, rank) for rank in (0, 1)] for epoch in range(3)]
    assert any(not torch.equal(ranks[0][0]["before"][n], ranks[0][1]["before"][n]) for n in ranks[0][0]["before"]), \
        "the ranks' batches left them the same statistics: the test would not tell one rank's buffers from another's"
    for epoch, by_rank in enumerate(ranks):
        for rank, buffers in enumerate(by_rank):
            what = f"epoch {epoch}, rank {rank}"
            for name, reference in buffers["reference"].items():
                torch.testing.assert_close(buffers["seen"][name], reference, rtol=1e-6, atol=1e-7, msg=f"{what}: {name}")
            assert not torch.equal(buffers["seen"]["body.1.running_mean"], buffers["before"]["body.1.running_mean"])
            _identical(buffers["before"], buffers["after"], f"the training buffers after validation, {what}")


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_resume_restores_each_ranks_average_of_its_buffers_bit_for_bit(buffered_run, tmp_path, kind):
    """Rank 1's average of its buffers differs from rank 0's: a checkpoint keeps each rank's, sharded or full."""
    source = buffered_run
    if kind == "full":
        source = tmp_path / "full"
        _run(source, "--net", "buffered", "--state-dict-type", "full", "--epochs", 1, "--reference", 0)
        written = torch.load(source / "ckpt" / "epoch=0.ckpt", weights_only=False)["ema_state_dict"]
        _identical({**_load(buffered_run / "out" / "seen_e0.pt"), **_buffers(buffered_run, 0, 0)["seen"]}, written,
                   "the full file's average: of the weights, and of rank 0's buffers")
    resumed = tmp_path / "resumed"
    _run(resumed, "--net", "buffered", "--state-dict-type", kind, "--ckpt-dir", source / "ckpt",
         "--resume", "epoch=0.ckpt", "--reference", 0)
    for epoch in (1, 2):
        for rank in (0, 1):
            _identical(_buffers(buffered_run, epoch, rank)["seen"], _buffers(resumed, epoch, rank)["seen"],
                       f"rank {rank}'s average of its buffers validated after epoch {epoch}")
    _identical(_load(buffered_run / "out" / "seen_e2.pt"), _load(resumed / "out" / "seen_e2.pt"), "the average, epoch 2")


def test_on_three_ranks_each_validates_with_rank_zeros_average_of_the_buffers(buffered_run, tmp_path):
    _run(tmp_path, "--net", "buffered", "--ckpt-dir", buffered_run / "ckpt", "--validate", "epoch=1.ckpt",
         "--reference", 0, nproc=3)
    for rank in range(3):
        _identical(_buffers(buffered_run, 1, 0)["seen"], _buffers(tmp_path, 0, rank)["seen"], f"rank {rank}'s buffers")
    _identical(_load(buffered_run / "out" / "seen_e1.pt"), _load(tmp_path / "out" / "seen_e0.pt"), "the average on 3 ranks")


def test_without_use_buffers_validation_runs_the_buffers_of_the_latest_update(tmp_path):
    _run(tmp_path, "--net", "buffered", "--use-buffers", 0, "--epochs", 1)
    for rank in (0, 1):
        buffers = _buffers(tmp_path, 0, rank)
        _identical(buffers["reference"], buffers["seen"], f"rank {rank}'s buffers copied at the latest update")
        _identical(buffers["before"], buffers["seen"], f"rank {rank}: the latest update followed the last step")
    assert any(not torch.equal(a, b) for a, b in zip(_load(tmp_path / "out" / "seen_e0.pt").values(),
                                                     _load(tmp_path / "out" / "training_e0.pt")["before"].values()))


# --- mixed precision: FSDP computes in bfloat16 from float32 shards --------------------------------------------------


# measured on torch 2.2 and 2.4: the backward of FSDP's mixed precision on CPU stops with "Found dtype BFloat16 but
# expected Float"; 2.13 runs it
NEEDS_CPU_MIXED_PRECISION = pytest.mark.skipif(TORCH[:2] <= (2, 4), reason="torch <= 2.4 cannot run FSDP's mixed"
                                               " precision backward on CPU (Found dtype BFloat16 but expected Float)")


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    """2 epochs under FSDP's MixedPrecision (parameters, reduction and buffers in bfloat16), the plain Net."""
    root = tmp_path_factory.mktemp("ema-mixed")
    _run(root / "ema", "--mixed-precision", "--epochs", 2)
    return root


@NEEDS_CPU_MIXED_PRECISION
def test_under_mixed_precision_the_average_follows_the_float32_shards(mixed_run, reference_runs, tmp_path):
    """Not the bfloat16 copies FSDP computes with: the average of the gathered float32 weights, kept in float32 (as the
    checkpoints store it: what validation sees is gathered from the float32 shards whatever the average is kept in), to
    fp32 rounding; and the run ends with the weights of the same run without the average, bit for bit."""
    out = mixed_run / "ema" / "out"
    for epoch in range(2):
        seen, reference = _load(out / f"seen_e{epoch}.pt"), _load(out / f"reference_e{epoch}.pt")
        stored = dcp.FileSystemReader(str(mixed_run / "ema" / "ckpt" / f"epoch={epoch}.ckpt")).read_metadata().state_dict_metadata
        kept = {key: entry.properties.dtype for key, entry in stored.items() if key.startswith("ema.")}
        assert kept == {f"ema.{name}": torch.float32 for name in reference}, f"epoch {epoch}: the average as saved, {kept}"
        for name in reference:
            torch.testing.assert_close(seen[name], reference[name], rtol=1e-6, atol=1e-7, msg=f"epoch {epoch}: {name}")
    full_precision = _load(reference_runs(0, "policy") / "ema" / "out" / "training_e1.pt")["after"]
    assert any(not torch.equal(full_precision[n], value) for n, value in _load(out / "training_e1.pt")["after"].items()), \
        "the run under mixed precision trained as the float32 one: bfloat16 was not used"
    _run(tmp_path, "--mixed-precision", "--epochs", 2, "--ema", 0, "--reference", 0)
    _identical(_load(out / "final.pt"), _load(tmp_path / "out" / "final.pt"), "final weights with and without the average")


@NEEDS_CPU_MIXED_PRECISION
def test_under_mixed_precision_a_resume_ends_with_the_same_average_bit_for_bit(mixed_run, tmp_path):
    _run(tmp_path, "--mixed-precision", "--epochs", 2, "--ckpt-dir", mixed_run / "ema" / "ckpt", "--resume",
         "epoch=0.ckpt", "--reference", 0)
    expected = mixed_run / "ema" / "out"
    _identical(_load(expected / "seen_e1.pt"), _load(tmp_path / "out" / "seen_e1.pt"), "the average validated after epoch 1")
    _identical(_load(expected / "final.pt"), _load(tmp_path / "out" / "final.pt"), "final weights")


# --- a full file and export: consolidate ---------------------------------------------------------------------------


def test_consolidate_ema_writes_the_average_in_place_of_the_weights(reference_runs, tmp_path):
    from safetensors.torch import load_file

    from lightning_fsdp_resume._commands._consolidate import consolidate

    root = reference_runs(0, "policy")
    seen = _load(root / "ema" / "out" / "seen_e1.pt")
    consolidate(root / "ema" / "ckpt" / "epoch=1.ckpt", tmp_path / "ema.ckpt", progress=False, ema=True)
    written = torch.load(tmp_path / "ema.ckpt", weights_only=True)
    assert "optimizer_states" not in written and "callbacks" not in written
    _identical(seen, written["state_dict"], "consolidate --ema")
    consolidate(root / "ema" / "ckpt" / "epoch=1.ckpt", tmp_path / "ema.safetensors", progress=False, ema=True,
                format="safetensors", dtype="bf16")
    _identical({name: value.to(torch.bfloat16) for name, value in seen.items()}, load_file(tmp_path / "ema.safetensors"),
               "consolidate --ema --format safetensors --dtype bf16")


def test_a_consolidated_file_carries_the_average_and_a_load_of_it_restores_it(reference_runs, tmp_path):
    from lightning_fsdp_resume._commands._consolidate import consolidate

    root = reference_runs(0, "root")
    consolidate(root / "ema" / "ckpt" / "epoch=1.ckpt", tmp_path / "ckpt" / "full.ckpt", progress=False)
    written = torch.load(tmp_path / "ckpt" / "full.ckpt", weights_only=False)
    _identical(_load(root / "ema" / "out" / "seen_e1.pt"), written["ema_state_dict"], "the full file's average")
    _run(tmp_path, "--wrap", "root", "--validate", "full.ckpt", "--reference", 0)
    _identical(_load(root / "ema" / "out" / "seen_e1.pt"), _load(tmp_path / "out" / "seen_e0.pt"), "the average loaded from the full file")


def test_load_from_checkpoint_with_ema_loads_the_average_in_place_of_the_weights(reference_runs, tmp_path):
    from support.trainer_worker import Net

    root = reference_runs(0, "policy")
    sharded = root / "ema" / "ckpt" / "epoch=1.ckpt"
    averaged = Net.load_from_checkpoint(sharded, ema=True).state_dict()
    _identical(_load(root / "ema" / "out" / "seen_e1.pt"), averaged, "load_from_checkpoint(ema=True)")
    trained = Net.load_from_checkpoint(sharded).state_dict()
    assert any(not torch.equal(trained[name], averaged[name]) for name in trained), "ema=True loaded the weights"
    _run(tmp_path, "--ema", 0, "--reference", 0, "--epochs", 1)
    with pytest.raises(ValueError, match=r"load_from_checkpoint\(ema=True\): the checkpoint '.*epoch=0\.ckpt' holds no"
                                         r" average of the weights"):
        Net.load_from_checkpoint(tmp_path / "ckpt" / "epoch=0.ckpt", ema=True)


def test_consolidate_ema_of_a_checkpoint_without_an_average_is_refused(tmp_path):
    from lightning_fsdp_resume._commands._consolidate import consolidate

    plain = tmp_path / "plain"
    _run(plain, "--ema", 0, "--reference", 0, "--epochs", 1)
    with pytest.raises(ValueError, match=r"ema=True: the checkpoint '.*epoch=0\.ckpt' holds no average of the weights"):
        consolidate(plain / "ckpt" / "epoch=0.ckpt", tmp_path / "ema.ckpt", progress=False, ema=True)
    assert not (tmp_path / "ema.ckpt").exists()


# --- refusals, in one process ----------------------------------------------------------------------------------------


def _fit_one_process(strategy) -> None:
    import lightning_fsdp_resume
    from support.trainer_worker import L, Net, data

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[lightning_fsdp_resume.ShardedEMA()])
    trainer.fit(Net(), train_dataloaders=data())


def test_a_strategy_other_than_the_patched_fsdp_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"ShardedEMA averages the shards of the FSDPStrategy this package patches; this"
                                         r" Trainer runs [\w.]+\.SingleDeviceStrategy, which it has not patched"):
        _fit_one_process("auto")


def test_an_unpatched_fsdp_strategy_is_refused_by_name(process_group, tmp_path):
    import lightning_fsdp_resume as shim
    from lightning_fsdp_resume.testing import enable_cpu_fsdp
    from support.trainer_worker import FSDPStrategy

    enable_cpu_fsdp()
    shim.unpatch()  # what native Lightning's FSDPStrategy is to the callback: not this package's
    try:
        with pytest.raises(ValueError, match=r"this Trainer runs [\w.]+\.FSDPStrategy, which it has not patched"):
            _fit_one_process(FSDPStrategy())
    finally:
        shim.patch()
