"""Cross-version checkpoints: patched Lightning 2.0.x and native Lightning 2.1+ resume each other's, with
the Trainer and with Fabric (``fabric.save``/``fabric.load``).

tox runs this module in three ordered steps on one torch release (the ``xver-*`` environments of
tox.ini), so both sides shard and compute alike and "exact" means ``torch.equal``. Each step selects
its tests by marker; all of them share the folder named by ``LIGHTNING_FSDP_RESUME_XVER_DIR``:

1. ``xver_write`` (patched 2.0.x): uninterrupted reference runs of EPOCHS epochs that checkpoint every
   epoch, one per checkpoint format.
2. ``xver_resume_native`` (native 2.1+): resume each from step 1's checkpoint after epoch 1; the
   restored and the final states equal the reference's. This run checkpoints natively, epoch 2 on.
3. ``xver_resume_patched`` (patched 2.0.x): resume from step 2's checkpoint after epoch 2; the restored
   and the final states equal step 1's reference.

Compared bit for bit: every rank's parameter shards and raw optimizer state, and rank 0's gathered
weights and optimizer state (Fabric: the shards and optimizer state; Fabric's steps use the epochs after
epoch 0 and 1 instead of 1 and 2, its worker counting from its first save). Without the variable the module is skipped; with it, missing input fails.
"""
import json
import os
import shutil
from pathlib import Path

import pytest

from support.flavours import TRAINER_UNDER_TEST
from support.ranks import fabric_config, fabric_worker, worker
from support.states import assert_identical, assert_ranks_identical, info, load

DIR_VARIABLE = "LIGHTNING_FSDP_RESUME_XVER_DIR"
if not os.environ.get(DIR_VARIABLE):
    pytest.skip(
        f"cross-version check: {DIR_VARIABLE} is not set; tox sets it in its xver-* environments",
        allow_module_level=True,
    )
ROOT = Path(os.environ[DIR_VARIABLE])

from lightning_fsdp_resume._patching._versions import NATIVE, PATCH  # noqa: E402

EPOCHS = 4
# Native Lightning 2.1.4 cannot save or load a full checkpoint's optimizer state with
# use_orig_params=False ("Each parameter should only map to one parameter name"): full crosses with True.
FORMATS = [("sharded", 0), ("sharded", 1), ("full", 1)]
FORMAT_IDS = [f"{kind}-use_orig_params{flag}" for kind, flag in FORMATS]
WRITER_FILE = "writer.json"


def _here() -> dict:
    """The Lightning flavour the worker runs here, its shim mode and torch."""
    import torch

    package, version, mode = TRAINER_UNDER_TEST
    return {"package": package, "version": version, "mode": mode, "torch": torch.__version__}


def _run_dir(side: str, checkpoint_format) -> Path:
    kind, flag = checkpoint_format
    return ROOT / side / f"{kind}-use_orig_params{flag}"


def _fresh(run: Path) -> Path:
    """An empty run folder: nothing from an earlier tox run can stand in for this one's output."""
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    return run


def _require_mode(mode: str) -> dict:
    here = _here()
    assert here["mode"] == mode, f"this step needs Lightning the shim reports {mode!r}; found {here}"
    return here


def _written_by_the_other_flavour(run: Path, writer_mode: str) -> Path:
    """An earlier step's run folder, checked to come from the other flavour on this torch."""
    record = run / WRITER_FILE
    assert record.is_file(), (
        f"{record} is missing: the step that writes it did not run or failed"
        " (tox runs xver-write-pl209-torch24, xver-resume-lightning214-torch24, xver-resume-pl209-torch24 in order)"
    )
    writer, here = json.loads(record.read_text()), _here()
    assert writer["mode"] == writer_mode and here["mode"] != writer_mode, f"not a cross-version pair: {writer} -> {here}"
    assert writer["torch"] == here["torch"], f"both sides must run one torch release: {writer} -> {here}"
    return run


def _worker_args(run: Path, checkpoint_format, *extra):
    kind, flag = checkpoint_format
    return ["--out", run / "out", "--ckpt-dir", run / "ckpt", "--state-dict-type", kind, "--use-orig-params", flag,
            "--max-epochs", EPOCHS, *extra]


def _resume_matches_reference(reference: Path, checkpoint: Path, run: Path, checkpoint_format, restored_as: str) -> None:
    """Resume from ``checkpoint`` in new processes: the restored states equal the reference's at
    ``restored_as`` and the final states its final ones, bit for bit."""
    kind = checkpoint_format[0]
    assert checkpoint.is_dir() if kind == "sharded" else checkpoint.is_file(), f"{checkpoint} is no {kind} checkpoint"
    worker(run, *_worker_args(run, checkpoint_format, "--ckpt-path", checkpoint))
    for expected, actual in ((restored_as, "start"), ("final", "final")):
        assert_ranks_identical(reference / "out", expected, run / "out", actual, across_flavours=True)
        gathered = load(reference / "out" / f"full_{expected}.pt"), load(run / "out" / f"full_{actual}.pt")
        assert all(state["optim"] for state in gathered), "the gathered optimizer state was not recorded"
        assert_identical(*gathered, f"gathered weights and optimizer state, {expected} vs {actual}")
    assert info(run / "out", "start")["global_step"] == info(reference / "out", restored_as)["global_step"]


def _record_writer(run: Path) -> None:
    (run / WRITER_FILE).write_text(json.dumps(_here()))


@pytest.mark.xver_write
@pytest.mark.parametrize("checkpoint_format", FORMATS, ids=FORMAT_IDS)
def test_patched_writes_a_checkpoint_every_epoch(checkpoint_format):
    _require_mode(PATCH)
    run = _fresh(_run_dir("patched", checkpoint_format))
    worker(run, *_worker_args(run, checkpoint_format))
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == [f"epoch={e}.ckpt" for e in range(EPOCHS)]
    _record_writer(run)


@pytest.mark.xver_resume_native
@pytest.mark.parametrize("checkpoint_format", FORMATS, ids=FORMAT_IDS)
def test_native_resumes_patched_checkpoint_bit_exact(checkpoint_format):
    _require_mode(NATIVE)
    reference = _written_by_the_other_flavour(_run_dir("patched", checkpoint_format), PATCH)
    run = _fresh(_run_dir("native", checkpoint_format))
    _resume_matches_reference(reference, reference / "ckpt" / "epoch=1.ckpt", run, checkpoint_format, "epoch1")
    _record_writer(run)


@pytest.mark.xver_resume_patched
@pytest.mark.parametrize("checkpoint_format", FORMATS, ids=FORMAT_IDS)
def test_patched_resumes_native_checkpoint_bit_exact(checkpoint_format, tmp_path):
    _require_mode(PATCH)
    native = _written_by_the_other_flavour(_run_dir("native", checkpoint_format), NATIVE)
    reference = _run_dir("patched", checkpoint_format)
    _resume_matches_reference(reference, native / "ckpt" / "epoch=2.ckpt", tmp_path, checkpoint_format, "epoch2")


@pytest.mark.parametrize(
    "side",
    [pytest.param("patched", marks=pytest.mark.xver_resume_native), pytest.param("native", marks=pytest.mark.xver_resume_patched)],
)
@pytest.mark.parametrize("checkpoint_format", FORMATS, ids=FORMAT_IDS)
def test_checkpoint_pickles_no_lightning_class(side, checkpoint_format):
    """What a reader unpickles (``meta.pt`` or the full file) holds plain values, tensors and the path of
    the checkpoint folder (the worker hands ModelCheckpoint a Path): no class of the writer's Lightning."""
    import torch

    run = _written_by_the_other_flavour(_run_dir(side, checkpoint_format), PATCH if side == "patched" else NATIVE)
    checkpoint = run / "ckpt" / "epoch=2.ckpt"
    pickled = checkpoint / "meta.pt" if checkpoint.is_dir() else checkpoint
    torch.serialization.add_safe_globals([type(Path())])
    loaded = torch.load(pickled, map_location="cpu", weights_only=True)  # names any other global it meets
    assert loaded["epoch"] == 2


# --- Fabric: fabric.save of one flavour, fabric.load of the other -------------------------------------------

FABRIC_FORMATS = ["sharded", "full"]
# What Fabric's steps compare: native Lightning >= 2.1's sharded load replaces the scheduler with its state
# dict (test_fabric_multirank.py checks the shim does not), so the scheduler's own record is left out.
FABRIC_PARTS = ("params", "buffers", "optim")


def _fabric_run_dir(side: str, kind: str) -> Path:
    return ROOT / side / f"fabric-{kind}"


def _fabric_resume_matches_reference(reference: Path, checkpoint: Path, run: Path, kind: str, restored_as: str) -> None:
    assert checkpoint.is_dir() if kind == "sharded" else checkpoint.is_file(), f"{checkpoint} is no {kind} checkpoint"
    fabric_worker(run, *fabric_config(run, kind), "--epochs", EPOCHS, "--resume", checkpoint)
    for expected, actual in ((restored_as, "start"), ("final", "final")):
        assert_ranks_identical(reference / "out", expected, run / "out", actual, across_flavours=True, parts=FABRIC_PARTS)


@pytest.mark.xver_write
@pytest.mark.parametrize("kind", FABRIC_FORMATS)
def test_patched_fabric_saves_a_checkpoint_every_epoch(kind):
    _require_mode(PATCH)
    run = _fresh(_fabric_run_dir("patched", kind))
    fabric_worker(run, *fabric_config(run, kind), "--epochs", EPOCHS)
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == [f"epoch={e}.ckpt" for e in range(EPOCHS)]
    _record_writer(run)


@pytest.mark.xver_resume_native
@pytest.mark.parametrize("kind", FABRIC_FORMATS)
def test_native_fabric_loads_patched_checkpoint_bit_exact(kind):
    _require_mode(NATIVE)
    reference = _written_by_the_other_flavour(_fabric_run_dir("patched", kind), PATCH)
    run = _fresh(_fabric_run_dir("native", kind))
    _fabric_resume_matches_reference(reference, reference / "ckpt" / "epoch=0.ckpt", run, kind, "epoch0")
    _record_writer(run)


@pytest.mark.xver_resume_patched
@pytest.mark.parametrize("kind", FABRIC_FORMATS)
def test_patched_fabric_loads_native_checkpoint_bit_exact(kind, tmp_path):
    _require_mode(PATCH)
    native = _written_by_the_other_flavour(_fabric_run_dir("native", kind), NATIVE)
    reference = _fabric_run_dir("patched", kind)
    _fabric_resume_matches_reference(reference, native / "ckpt" / "epoch=1.ckpt", tmp_path, kind, "epoch1")
