"""consolidate: a sharded checkpoint directory becomes one full checkpoint file, in one process.

The refusals and the writing need no run. The rest consolidates the checkpoints of real 2-rank runs
(torchrun, gloo on the CPU), shared by the tests: sharded with use_orig_params=False and one optimizer;
sharded with use_orig_params=True; sharded with two optimizers; and, where the shim saves it, the full
checkpoint of the first configuration, which consolidating must reproduce exactly. They are the
session's ``reference`` runs, which the multi-rank suite makes too. Weights-only output, ``--dtype`` and
safetensors are checked on sharded checkpoints written by hand in this process, then on those runs' and
Fabric's; the safetensors files are read with the ``safetensors`` package.
"""
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from lightning_fsdp_resume._checkpoint import _whole_read
from lightning_fsdp_resume._commands import _consolidate
from lightning_fsdp_resume._commands._consolidate import consolidate
from lightning_fsdp_resume._patching import _torch_compat as compat
from lightning_fsdp_resume._storage import checked, open_path
from lightning_fsdp_resume.testing import disable_cpu_fsdp, enable_cpu_fsdp
from support.flavours import FABRIC_UNDER_TEST, NATIVE, PATCH, VERSION, mode_of
from support.marks import long_runs, needs_consolidate, needs_cpu_fsdp, skip_as, skip_without_optimizer_state
from support.ranks import EPOCHS, FULL_USE_ORIG_PARAMS, MID, config, worker
from support.states import assert_identical, assert_ranks_identical, differences, load


def fake_sharded(directory: Path, files=("meta.pt", ".metadata")) -> Path:
    """A directory that looks like a sharded checkpoint to the checks made before reading."""
    directory.mkdir(parents=True)
    for name in files:
        (directory / name).write_bytes(b"")
    return directory


# --- refusals, writing, progress: no run needed -----------------------------------------------------


@needs_consolidate
def test_missing_source_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"The path '.*nowhere' does not point to a valid checkpoint: it does not exist"):
        consolidate(tmp_path / "nowhere", tmp_path / "out.ckpt")


@needs_consolidate
def test_file_source_is_refused(tmp_path):
    (tmp_path / "full.ckpt").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file, not a sharded checkpoint directory"):
        consolidate(tmp_path / "full.ckpt", tmp_path / "out.ckpt")


@needs_consolidate
@pytest.mark.parametrize("present,missing", [(("x.distcp", ".metadata"), "has no 'meta.pt'"),
                                             (("x.distcp", "meta.pt"), "has no shard index '.metadata'"),
                                             (("x.distcp",), "has neither 'meta.pt' nor the shard index '.metadata'"),
                                             (("meta.pt", ".metadata"), "shard index '.*' cannot be read")])
def test_incomplete_or_damaged_source_is_refused(tmp_path, present, missing):
    src = fake_sharded(tmp_path / "src", present)
    with pytest.raises(ValueError, match=missing):
        consolidate(src, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()


def test_existing_destination_is_kept_without_overwrite(tmp_path):
    src = fake_sharded(tmp_path / "src")
    (tmp_path / "out.ckpt").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="already exists. Pass overwrite=True"):
        consolidate(src, tmp_path / "out.ckpt")
    assert (tmp_path / "out.ckpt").read_bytes() == b"mine"


def test_directory_destination_is_refused(tmp_path):
    src = fake_sharded(tmp_path / "src")
    (tmp_path / "out").mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory; a full checkpoint is one file"):
        consolidate(src, tmp_path / "out", overwrite=True)


def test_destination_inside_the_source_is_refused(tmp_path):
    src = fake_sharded(tmp_path / "src")
    with pytest.raises(ValueError, match="lies inside the sharded checkpoint"):
        consolidate(src, src / "full.ckpt")
    assert sorted(p.name for p in src.iterdir()) == [".metadata", "meta.pt"]


def test_old_torch_is_refused_naming_the_minimum(tmp_path, monkeypatch):
    monkeypatch.setattr(compat, "torch_release", lambda: (2, 1, 2))
    with pytest.raises(NotImplementedError, match=r"needs torch >= 2\.2; this is torch 2\.1\.2"):
        consolidate(fake_sharded(tmp_path / "src"), tmp_path / "out.ckpt")


def test_destination_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    def fail_midway(obj, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    (tmp_path / "out.ckpt").write_bytes(b"old")
    monkeypatch.setattr(torch, "save", fail_midway)
    with pytest.raises(OSError, match="disk full"):
        _consolidate.write_atomically({"state_dict": {}}, open_path(tmp_path / "out.ckpt", "write"))
    assert [p.name for p in tmp_path.iterdir()] == ["out.ckpt"]  # no temporary file left behind
    assert (tmp_path / "out.ckpt").read_bytes() == b"old"


def test_written_file_has_an_ordinary_mode(tmp_path):
    _consolidate.write_atomically({"state_dict": {"w": torch.ones(2)}}, open_path(tmp_path / "sub" / "out.ckpt", "write"))
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "sub" / "out.ckpt").stat().st_mode & 0o777 == 0o666 & ~mask
    assert torch.equal(load(tmp_path / "sub" / "out.ckpt")["state_dict"]["w"], torch.ones(2))


def test_progress_without_tqdm_prints_plain_lines(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    progress = _whole_read.Progress(4 * 2**20, "reading 'x'")
    for _ in range(4):
        progress.advance(2**20)
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"consolidate: reading 'x': {25 * mib}% ({mib:.1f} of 4.0 MiB)" for mib in range(5)]


def test_importing_it_imports_neither_torch_nor_lightning():
    import subprocess

    code = "import sys, lightning_fsdp_resume._commands._consolidate, lightning_fsdp_resume.cli;" \
           " print(sorted({'torch', 'lightning', 'pytorch_lightning'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stderr


# --- checkpoints of real 2-rank runs ---------------------------------------------------------------


def _consolidated(reference, tmp_path: Path, use_orig_params: int, optimizers: int = 1, wrap: str = "policy", **options):
    """The sharded run's checkpoint after epoch 1, consolidated (with ``options``); the run's directory and the file."""
    skip_without_optimizer_state(use_orig_params)
    root = reference("sharded", use_orig_params, optimizers, wrap)
    dst = tmp_path / "full.ckpt"
    consolidate(root / "ckpt" / MID, dst, progress=False, **options)
    return root, dst


def _registration_order():
    from support.trainer_worker import Net

    return [name for name, _ in Net().named_parameters()]


# root: no auto_wrap_policy (Lightning's default), the root unit's one flat parameter holds every weight, so each
# rank's shard of it begins and ends inside parameters
SHARDED = [pytest.param(0, 1, "policy", id="flat-params"), pytest.param(1, 1, "policy", id="orig-params"),
           pytest.param(0, 2, "policy", id="two-optimizers"), pytest.param(0, 1, "root", id="flat-params-root-only"),
           pytest.param(1, 1, "root", id="orig-params-root-only")]


@pytest.mark.parametrize("use_orig_params,optimizers,wrap", SHARDED)
@pytest.mark.multirank
@needs_cpu_fsdp
def test_weights_equal_the_runs_gathered_weights(reference, tmp_path, use_orig_params, optimizers, wrap):
    root, dst = _consolidated(reference, tmp_path, use_orig_params, optimizers, wrap)
    state_dict = load(dst)["state_dict"]
    assert list(state_dict) == _registration_order()  # the LightningModule's keys, in its order
    assert_identical(load(root / "out" / "full_epoch1.pt")["params"], state_dict, "weights")


@pytest.mark.parametrize("use_orig_params,optimizers,wrap", SHARDED)
@pytest.mark.multirank
@needs_cpu_fsdp
def test_optimizer_ids_number_each_optimizers_parameters_in_registration_order(
    reference, tmp_path, use_orig_params, optimizers, wrap
):
    """Compared with the optimizer state torch itself gathered in the run, keyed by name."""
    root, dst = _consolidated(reference, tmp_path, use_orig_params, optimizers, wrap)
    gathered = load(root / "out" / "full_epoch1.pt")["optim"]
    states = load(dst)["optimizer_states"]
    assert len(states) == optimizers == len(gathered)
    for index, (expected, state) in enumerate(zip(gathered, states)):
        names = [name for name in _registration_order() if name in expected]
        assert [group["params"] for group in state["param_groups"]] == [list(range(len(names)))]
        assert_identical(expected, {names[i]: value for i, value in state["state"].items()}, f"optimizer {index}")
    assert states[0]["param_groups"][0]["lr"] == 1e-2
    if optimizers == 2:
        assert states[1]["param_groups"][0]["momentum"] == 0.9


@pytest.mark.multirank
@needs_cpu_fsdp
def test_result_equals_our_full_save_of_the_same_run(reference, tmp_path):
    if NATIVE:
        pytest.skip(f"native Lightning {VERSION} cannot save a full checkpoint with use_orig_params=False")
    _, dst = _consolidated(reference, tmp_path, 0, 1)
    full = load(reference("full", 0) / "ckpt" / MID)
    consolidated = load(dst)
    assert_identical(full["state_dict"], consolidated["state_dict"], "state_dict")
    assert_identical(full["optimizer_states"], consolidated["optimizer_states"], "optimizer_states")
    assert set(full) == set(consolidated)


@pytest.mark.multirank
@needs_cpu_fsdp
def test_everything_of_meta_pt_is_kept(reference, tmp_path):
    root, dst = _consolidated(reference, tmp_path, 0, 1)
    meta = load(root / "ckpt" / MID / "meta.pt")
    consolidated = load(dst)
    assert set(consolidated) == set(meta) | {"state_dict", "optimizer_states"}
    assert not differences(meta, {key: consolidated[key] for key in meta})
    assert consolidated["epoch"] == 1 and consolidated["hyper_parameters"] == {"optimizers": 1}


@pytest.mark.multirank
@needs_cpu_fsdp
def test_source_is_never_modified(reference, tmp_path):
    src = reference("sharded", 0) / "ckpt" / MID

    def fingerprint():
        return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in src.iterdir()}

    before = fingerprint()
    assert {"meta.pt", ".metadata"} <= set(before)
    consolidate(src, tmp_path / "full.ckpt", progress=False)
    consolidate(src, tmp_path / "full.ckpt", overwrite=True, progress=False)
    assert fingerprint() == before


@pytest.mark.parametrize("weights_only", [False, True], ids=["full", "weights-only"])
@pytest.mark.multirank
@needs_cpu_fsdp
def test_result_opens_with_load_from_checkpoint(reference, tmp_path, monkeypatch, weights_only):
    from support.trainer_worker import Net

    # Lightning 2.0.x's loader predates torch 2.6's weights_only default; checkpoints are trusted files.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    root, dst = _consolidated(reference, tmp_path, 0, 1, weights_only=weights_only)
    if weights_only:  # a file for inference: no optimizer state, no training metadata
        assert not {"optimizer_states", "loops", "callbacks", "lr_schedulers"} & set(load(dst))
    model = Net.load_from_checkpoint(dst)
    expected = load(root / "out" / "full_epoch1.pt")["params"]
    assert_identical(expected, {n: p.detach() for n, p in model.named_parameters()}, "weights")
    assert model.hparams.optimizers == 1


@pytest.mark.multirank
@needs_cpu_fsdp
def test_resume_under_fsdp_from_the_consolidated_file_is_bit_exact(reference, tmp_path):
    # Native Lightning cannot load id-keyed optimizer states of flat parameters: it resumes use_orig_params=True.
    root, dst = _consolidated(reference, tmp_path, FULL_USE_ORIG_PARAMS)
    resumed = tmp_path / "resumed"
    worker(resumed, *config(resumed, "full", FULL_USE_ORIG_PARAMS), "--max-epochs", EPOCHS, "--ckpt-path", dst)
    assert_ranks_identical(root / "out", "epoch1", resumed / "out", "start")
    assert_ranks_identical(root / "out", "final", resumed / "out", "final")


@pytest.mark.multirank
@needs_cpu_fsdp
def test_command_line_writes_the_same_file_and_shows_progress(reference, tmp_path):
    import subprocess

    root, dst = _consolidated(reference, tmp_path, 0, 1)
    command = [sys.executable, "-m", "lightning_fsdp_resume", "consolidate", str(root / "ckpt" / MID), str(tmp_path / "cli.ckpt")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Wrote '{tmp_path / 'cli.ckpt'}': 6 state_dict entries, 1 optimizer states")
    assert "100%" in result.stderr and "consolidate: writing" in result.stderr
    expected, written = load(dst), load(tmp_path / "cli.ckpt")
    assert_identical(expected["state_dict"], written["state_dict"], "state_dict")
    assert_identical(expected["optimizer_states"], written["optimizer_states"], "optimizer_states")


# --- Fabric's sharded checkpoints: written by fabric.save on one CPU rank, in this process ------------


class FabricRun(NamedTuple):
    sharded: Path  # fabric.save with state_dict_type="sharded"
    full: Path  # the same state, saved by the same strategy with state_dict_type="full"
    expected: dict  # what the consolidated file must hold, gathered from the live module and optimizers
    use_orig_params: bool


FABRIC_KEYS = ("net", "opt_a", "opt_idle", "sched", "epoch", "note")


def _fabric_namespace():
    if FABRIC_UNDER_TEST is None:
        pytest.skip("no Fabric installed")
    return FABRIC_UNDER_TEST.module()


def _fabric_setup(use_orig_params: bool, seed: int):
    """A Fabric with FSDP on one CPU rank, a nested model (an FSDP unit per Linear), Adam with a scheduler, and
    an optimizer that never steps; the user's keys, not the Trainer's."""
    from torch import nn
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    fabric_ns = _fabric_namespace()
    strategy = fabric_ns.strategies.FSDPStrategy(
        state_dict_type="sharded", auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params
    )
    fabric = fabric_ns.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
    net = fabric.setup_module(net)
    opt_a, opt_idle = fabric.setup_optimizers(torch.optim.Adam(net.parameters(), lr=1e-2),
                                              torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    return fabric, {"net": net, "opt_a": opt_a, "opt_idle": opt_idle, "sched": sched, "epoch": 0, "note": None}


def _full_weights(net):
    """The FSDP module's full weights by the user's parameter names, bit for bit."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(net._forward_module, writeback=False):
        named = net._forward_module.module.named_parameters()
        return {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for name, p in named}


def _full_optimizer_state(net, optimizer):
    """FSDP's own full, name-keyed optimizer state dict (what native Fabric's full save writes)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig, FullStateDictConfig

    root = net._forward_module
    with FSDP.state_dict_type(root, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False),
                              FullOptimStateDictConfig(rank0_only=False)):
        return FSDP.optim_state_dict(root, optimizer.optimizer)


@pytest.fixture(scope="module", params=[0, 1], ids=["flat-params", "orig-params"])
def fabric_run(request, process_group, tmp_path_factory):
    """A Fabric checkpoint of three steps of training, sharded and full, and what consolidating must give.

    One process: FSDP over a one-rank gloo group (torch then shards nothing, NO_SHARD; the 2-rank test below
    has real shards). enable_cpu_fsdp() stays on for the module's tests, which load into new Fabrics."""
    skip_as(needs_cpu_fsdp, needs_consolidate)
    skip_without_optimizer_state(request.param)
    version = _fabric_namespace().__version__
    if request.param and mode_of(version) == PATCH:
        pytest.skip(f"Fabric {version} refuses optimizers of use_orig_params=True modules in setup_optimizers")
    environ = dict(os.environ)  # Fabric's launch sets MASTER_PORT, WORLD_SIZE, ... for its children
    enable_cpu_fsdp()
    try:
        fabric, state = _fabric_setup(bool(request.param), seed=0)
        data = torch.randn(3, 16, 4, generator=torch.Generator().manual_seed(1))
        for batch in data:
            fabric.backward(state["net"](batch).square().mean())
            state["opt_a"].step()
            state["opt_a"].zero_grad()
            state["sched"].step()
        state.update(epoch=3, note="three steps")
        root = tmp_path_factory.mktemp("fabric")
        fabric.save(root / "sharded.ckpt", state)
        # The same strategy writes the full file: native 2.1+ and the shim read _state_dict_type at each save.
        fabric.strategy._state_dict_type = "full"
        fabric.save(root / "full.ckpt", state)
        fabric.strategy._state_dict_type = "sharded"
        expected = {
            "net": _full_weights(state["net"]),
            "opt_a": _full_optimizer_state(state["net"], state["opt_a"]),
            "opt_idle": _full_optimizer_state(state["net"], state["opt_idle"]),
            "sched": state["sched"].state_dict(), "epoch": 3, "note": "three steps",
        }
        yield FabricRun(root / "sharded.ckpt", root / "full.ckpt", expected, bool(request.param))
    finally:
        disable_cpu_fsdp()
        os.environ.clear()
        os.environ.update(environ)


def _consolidated_fabric(run: FabricRun, tmp_path: Path):
    dst = tmp_path / "fabric-full.ckpt"
    summary = consolidate(run.sharded, dst, progress=False)
    return summary, load(dst)


def test_fabric_checkpoint_becomes_fabrics_full_file_with_the_users_keys(fabric_run, tmp_path):
    summary, consolidated = _consolidated_fabric(fabric_run, tmp_path)
    assert summary.writer == "fabric" and summary.optimizers == ("opt_a", "opt_idle") and summary.weights == {"net": 6}
    assert set(consolidated) == set(FABRIC_KEYS)
    assert "state_dict" not in consolidated and "optimizer_states" not in consolidated


def test_fabric_module_entry_is_the_modules_full_weights(fabric_run, tmp_path):
    _, consolidated = _consolidated_fabric(fabric_run, tmp_path)
    assert list(consolidated["net"]) == list(fabric_run.expected["net"])  # the module's order
    assert_identical(fabric_run.expected["net"], consolidated["net"], "weights")


def test_fabric_optimizer_entries_are_fsdps_full_name_keyed_state(fabric_run, tmp_path):
    _, consolidated = _consolidated_fabric(fabric_run, tmp_path)
    for key in ("opt_a", "opt_idle"):
        assert_identical(fabric_run.expected[key], consolidated[key], key)
    assert set(consolidated["opt_a"]["state"]) == set(fabric_run.expected["net"])  # keyed by parameter name
    # opt_idle never stepped: on torch 2.4 its state is empty and only its groups are stored (consolidate adds
    # the empty state); torch 2.13's FSDP fills it with zero momentum buffers when it is saved.
    assert "state" in consolidated["opt_idle"]


def test_fabric_meta_entries_are_kept(fabric_run, tmp_path):
    _, consolidated = _consolidated_fabric(fabric_run, tmp_path)
    meta = load(fabric_run.sharded / "meta.pt")
    assert set(meta) == {"sched", "epoch", "note"}
    assert_identical(meta, {key: consolidated[key] for key in meta}, "meta.pt entries")
    assert consolidated["sched"] == fabric_run.expected["sched"] and consolidated["epoch"] == 3


def test_fabric_result_equals_the_full_save_of_the_same_state(fabric_run, tmp_path):
    _, consolidated = _consolidated_fabric(fabric_run, tmp_path)
    assert_identical(load(fabric_run.full), consolidated, "the full save and the consolidated file")


def test_fabric_load_of_the_consolidated_file_restores_weights_and_optimizer_exactly(fabric_run, tmp_path):
    """Into a new Fabric and model of the same setup (other initial weights), as a resume does."""
    _consolidated_fabric(fabric_run, tmp_path)
    fabric, state = _fabric_setup(fabric_run.use_orig_params, seed=1)
    assert differences(fabric_run.expected["net"], _full_weights(state["net"]))  # not already equal
    # Native Fabric 2.1.4 cannot load a never-stepped optimizer from a full file (it reads its first state
    # key): leave opt_idle in the checkpoint, which load then returns.
    del state["opt_idle"]
    remainder = fabric.load(tmp_path / "fabric-full.ckpt", state)
    assert_identical(fabric_run.expected["net"], _full_weights(state["net"]), "loaded weights")
    assert_identical(fabric_run.expected["opt_a"], _full_optimizer_state(state["net"], state["opt_a"]), "loaded opt_a")
    assert state["sched"].state_dict() == fabric_run.expected["sched"]
    assert (state["epoch"], state["note"]) == (3, "three steps")
    assert set(remainder) == {"opt_idle"}


def test_fabric_command_line_names_the_entries(fabric_run, tmp_path):
    import subprocess

    command = [sys.executable, "-m", "lightning_fsdp_resume", "consolidate", str(fabric_run.sharded), str(tmp_path / "cli.ckpt")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        f"Wrote '{tmp_path / 'cli.ckpt'}': Fabric checkpoint: modules 'net' (6 entries); optimizers 'opt_a', 'opt_idle',"
    ), result.stdout
    assert_identical(load(fabric_run.full), load(tmp_path / "cli.ckpt"), "the full save and the CLI's file")


@pytest.mark.parametrize("source", ["consolidated", "sharded"])
def test_fabric_load_leaves_the_scheduler_steering_the_loaded_optimizer(fabric_run, tmp_path, source):
    """A resume goes on stepping the LR scheduler made on Fabric's optimizer: its rates must reach the optimizer
    that was loaded (Fabric 2.0.x's wrapper keeps a copy of the optimizer's groups)."""
    path = fabric_run.sharded
    if source == "consolidated":
        _consolidated_fabric(fabric_run, tmp_path)
        path = tmp_path / "fabric-full.ckpt"
    fabric, state = _fabric_setup(fabric_run.use_orig_params, seed=1)
    del state["opt_idle"]
    optimizer, scheduler = state["opt_a"], state["sched"]
    fabric.load(path, state)
    if state["sched"] is not scheduler:  # native Fabric 2.1 to 2.6's sharded load puts the state dict there
        scheduler.load_state_dict(state["sched"])
    assert optimizer.optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == 5e-3  # 1e-2 halved at step 2
    scheduler.step()  # the 4th: StepLR(step_size=2) halves again
    assert optimizer.optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0] == 2.5e-3
    assert optimizer.param_groups[0]["lr"] == 2.5e-3


@pytest.mark.multirank
@long_runs
@needs_cpu_fsdp
@needs_consolidate
def test_fabric_resume_on_2_ranks_from_the_consolidated_file_is_bit_exact(tmp_path):
    """Real shards: the demo's Fabric loop (model, AdamW, StepLR, epoch, step) on 2 ranks checkpoints, sharded,
    after epoch 0. The file consolidated from it resumes in 2 new ranks through fabric.load (full) and matches
    the uninterrupted run: every loss and the gathered weights at every epoch end, and its last checkpoint, all
    ranks' weights and optimizer state and the scheduler, consolidated, equals the uninterrupted run's."""
    from lightning_fsdp_resume.demo import _compare, _launch, _losses

    run = ["--fabric", "--hidden", "8", "--state-dict-type", "sharded"]
    assert _launch(2, tmp_path / "reference", [*run, "--epochs", "3"], True) == 0
    assert _launch(2, tmp_path / "interrupted", [*run, "--epochs", "1"], True) == 0
    dst = tmp_path / "epoch0.ckpt"
    summary = consolidate(tmp_path / "interrupted" / "ckpt" / "epoch=0.ckpt", dst, progress=False)
    assert (summary.writer, summary.optimizers) == ("fabric", ("optimizer",))
    assert _launch(2, tmp_path / "resumed", [*run, "--epochs", "3", "--ckpt-path", str(dst)], True) == 0

    result = _compare(tmp_path / "reference", tmp_path / "resumed", [1, 2], _losses(tmp_path / "reference"))
    assert result.exact and result.first_step == 17 and set(result.rows) == {1, 2}, result
    last = {name: tmp_path / f"{name}-last.ckpt" for name in ("reference", "resumed")}
    for name, path in last.items():
        consolidate(tmp_path / name / "ckpt" / "epoch=2.ckpt", path, progress=False)
    reference, resumed = load(last["reference"]), load(last["resumed"])
    assert set(reference) == {"model", "optimizer", "scheduler", "epoch", "step"}
    assert reference["optimizer"]["state"] and (reference["epoch"], reference["step"]) == (3, 48)
    assert_identical(reference, resumed, "the last checkpoints, consolidated")


# --- weights only, --dtype, safetensors: hand-made sharded checkpoints, in this process -------------


class Handmade(NamedTuple):
    trainer: Path  # the Trainer's layout: "model" and "optimizer_0" in the shards, its metadata in meta.pt
    extra_state: Path  # the same with a module's extra state (a pickled object) among the weights
    fabric: Path  # Fabric's layout: two modules, "gen" and "disc", and an optimizer "opt"
    weights: dict  # the weights of the Trainer's checkpoints
    fabric_weights: dict  # Fabric's, by module


# Everything a Trainer checkpoint's meta.pt holds, a user's own entry and a precision plugin's state included.
TRAINER_META = {
    "epoch": 2, "global_step": 40, "pytorch-lightning_version": "2.0.9", "loops": {"fit_loop": {"epoch": 2}},
    "callbacks": {"ModelCheckpoint{}": {"best_model_path": "x"}}, "lr_schedulers": [{"last_epoch": 2}],
    "hparams_name": "kwargs", "hyper_parameters": {"width": 3}, "datamodule_hparams_name": "kwargs",
    "datamodule_hyper_parameters": {"batch_size": 4}, "MixedPrecisionPlugin": {"scale": 1.0}, "my_note": "mine",
}
WEIGHTS_ONLY_KEYS = {"state_dict", "epoch", "global_step", "pytorch-lightning_version", "hparams_name",
                     "hyper_parameters", "datamodule_hparams_name", "datamodule_hyper_parameters"}


def _write_sharded(directory: Path, stored: dict, meta: dict) -> Path:
    directory.mkdir(parents=True)
    compat.save_distributed(stored, checked.writer(open_path(directory, "save")))
    checked.save_file(open_path(directory / "meta.pt", "save"), meta)
    return directory


def _optimizer_state(weights: dict) -> dict:
    first = next(iter(weights))
    return {"state": {first: {"exp_avg": weights[first] * 2, "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": list(weights)}]}


@pytest.fixture(scope="module")
def handmade(tmp_path_factory):
    skip_as(needs_consolidate)
    generator = torch.Generator().manual_seed(0)
    weights = {
        "layer.weight": torch.randn(5, 3, generator=generator),
        "layer.bias": torch.randn(5, generator=generator),
        "emb.weight": torch.randn(3, generator=generator).half(),  # 6 bytes: an fp32 tensor after it would be misaligned
        "head.weight": torch.randn(2, 3, generator=generator),
        "scale": torch.randn(2, generator=generator).bfloat16(),
        "norm.num_batches_tracked": torch.tensor(7),
        "mask": torch.tensor([True, False, True]),
    }
    fabric_weights = {"gen": {"body.weight": torch.randn(4, 2, generator=generator), "body.bias": torch.zeros(4)},
                      "disc": {"out.weight": torch.randn(1, 4, generator=generator)}}
    root = tmp_path_factory.mktemp("handmade")
    trainer = {"model": weights, "optimizer_0": _optimizer_state(weights)}
    with_extra = {"model": {**weights, "adapter._extra_state": "version 2"}, "optimizer_0": _optimizer_state(weights)}
    fabric = {**fabric_weights, "opt": _optimizer_state(fabric_weights["gen"])}
    yield Handmade(_write_sharded(root / "trainer", trainer, TRAINER_META),
                   _write_sharded(root / "extra-state", with_extra, TRAINER_META),
                   _write_sharded(root / "fabric", fabric, {"epoch": 1, "note": "two modules"}),
                   weights, fabric_weights)


def _cast(weights: dict, dtype) -> dict:
    return {name: t.to(dtype) if dtype is not None and t.is_floating_point() else t for name, t in weights.items()}


def _bits(weights: dict) -> dict:
    """Each tensor's bytes, so that equality is bit for bit (torch.equal takes -0.0 for 0.0)."""
    return {name: t.contiguous().view(-1).view(torch.uint8) for name, t in weights.items()}


def _safetensors_header(path: Path):
    """The header's length and its JSON, read by hand."""
    import json
    import struct

    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return length, json.loads(handle.read(length))


DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@needs_consolidate
def test_weights_only_keeps_state_dict_and_what_load_from_checkpoint_reads(handmade, tmp_path):
    consolidate(handmade.trainer, tmp_path / "full.ckpt", progress=False)
    summary = consolidate(handmade.trainer, tmp_path / "weights.ckpt", progress=False, weights_only=True)
    weights, full = load(tmp_path / "weights.ckpt"), load(tmp_path / "full.ckpt")
    assert set(weights) == WEIGHTS_ONLY_KEYS  # no optimizer_states, loops, callbacks, lr_schedulers, plugin or user entries
    assert_identical(full["state_dict"], weights["state_dict"], "state_dict")
    assert_identical({key: full[key] for key in WEIGHTS_ONLY_KEYS}, weights, "the entries kept")
    assert (summary.writer, summary.weights, summary.optimizers) == ("trainer", {"state_dict": 7}, ())


@needs_consolidate
def test_weights_only_reads_the_model_tensors_alone(handmade, tmp_path, monkeypatch):
    read = compat.read_distributed_in_one_process
    keys = []

    def recording(state, path, planner):
        keys.extend(state)
        read(state, path, planner)

    monkeypatch.setattr(compat, "read_distributed_in_one_process", recording)
    consolidate(handmade.trainer, tmp_path / "weights.ckpt", progress=False, weights_only=True)
    assert sorted(keys) == sorted(f"model.{name}" for name in handmade.weights)


@needs_consolidate
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_dtype_casts_floating_point_weights_and_keeps_integer_and_bool_ones(handmade, tmp_path, dtype):
    consolidate(handmade.trainer, tmp_path / "weights.ckpt", progress=False, weights_only=True, dtype=dtype)
    state_dict = load(tmp_path / "weights.ckpt")["state_dict"]
    assert_identical(_cast(handmade.weights, DTYPES[dtype]), state_dict, "cast weights")
    assert state_dict["norm.num_batches_tracked"].dtype == torch.int64 and state_dict["mask"].dtype == torch.bool


@needs_consolidate
@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_safetensors_loads_with_safetensors_and_equals_the_consolidated_weights_bit_for_bit(handmade, tmp_path, dtype):
    from safetensors.torch import load_file

    consolidate(handmade.trainer, tmp_path / "full.ckpt", progress=False)
    summary = consolidate(handmade.trainer, tmp_path / "w.safetensors", progress=False, format="safetensors", dtype=dtype)
    expected = _cast(load(tmp_path / "full.ckpt")["state_dict"], DTYPES[dtype])
    loaded = load_file(tmp_path / "w.safetensors")
    assert_identical(_bits(expected), _bits(loaded), "safetensors weights")
    assert {name: t.dtype for name, t in loaded.items()} == {name: t.dtype for name, t in expected.items()}
    assert summary.weights == {"state_dict": 7} and summary.optimizers == ()


@needs_consolidate
def test_safetensors_header_names_the_format_and_source_and_aligns_every_tensor(handmade, tmp_path):
    consolidate(handmade.trainer, tmp_path / "w.safetensors", progress=False, format="safetensors")
    length, header = _safetensors_header(tmp_path / "w.safetensors")
    assert header.pop("__metadata__") == {"format": "pt", "checkpoint": "trainer", "entry": "state_dict",
                                          "epoch": "2", "global_step": "40"}
    itemsize = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "BOOL": 1}
    spans = sorted(entry["data_offsets"] for entry in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no holes
    assert all(entry["data_offsets"][0] % itemsize[entry["dtype"]] == 0 for entry in header.values())
    assert length % 8 == 0 and (tmp_path / "w.safetensors").stat().st_size == 8 + length + spans[-1][1]


@needs_consolidate
def test_safetensors_reads_one_tensor_at_a_time_and_frees_it_before_the_next(handmade, tmp_path, monkeypatch):
    """Memory stays near the largest tensor: each read holds one tensor, and the one before is gone by then."""
    import weakref

    read = compat.read_distributed_in_one_process
    reads, earlier = [], []

    def one_at_a_time(state, path, planner):
        assert not [ref for ref in earlier if ref() is not None], "a tensor read before is still held"
        reads.append(list(state))
        read(state, path, planner)
        earlier.extend(weakref.ref(tensor) for tensor in state.values())

    monkeypatch.setattr(compat, "read_distributed_in_one_process", one_at_a_time)
    consolidate(handmade.trainer, tmp_path / "w.safetensors", progress=False, format="safetensors", dtype="bf16")
    assert [len(keys) for keys in reads] == [1] * len(handmade.weights)
    assert sorted(key for keys in reads for key in keys) == sorted(f"model.{name}" for name in handmade.weights)


@needs_consolidate
def test_failed_safetensors_write_leaves_the_destination_as_it_was(handmade, tmp_path, monkeypatch):
    read, count = _whole_read.read_tensor, []

    def fail_on_the_third(*args):
        count.append(1)
        if len(count) == 3:
            raise OSError("disk full")
        return read(*args)

    (tmp_path / "w.safetensors").write_bytes(b"old")
    monkeypatch.setattr(_whole_read, "read_tensor", fail_on_the_third)
    with pytest.raises(OSError, match="disk full"):
        consolidate(handmade.trainer, tmp_path / "w.safetensors", overwrite=True, progress=False, format="safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary file left behind
    assert (tmp_path / "w.safetensors").read_bytes() == b"old"


@pytest.mark.parametrize("options,refusal", [
    ({"dtype": "bf16"}, "dtype='bf16' casts the weights of a weights-only file.*Add weights_only=True, or format='safetensors'"),
    ({"module": "net"}, "module='net' writes one module's weights only. Add weights_only=True, or format='safetensors'"),
    ({"weights_only": True, "dtype": "int8"}, r"Unknown dtype 'int8' \(dtype\): choose 'bf16', 'fp16', 'fp32'"),
    ({"format": "onnx"}, r"Unknown output format 'onnx' \(format\): choose 'torch', 'safetensors'"),
])
def test_contradicting_or_unknown_settings_are_refused_before_anything_is_read(tmp_path, options, refusal):
    with pytest.raises(ValueError, match=refusal):
        consolidate(tmp_path / "not-read", tmp_path / "out", **options)
    assert not list(tmp_path.iterdir())


def test_existing_destination_is_kept_for_safetensors_too(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="already exists. Pass overwrite=True"):
        consolidate(fake_sharded(tmp_path / "src"), tmp_path / "w.safetensors", format="safetensors")
    assert (tmp_path / "w.safetensors").read_bytes() == b"mine"


@needs_consolidate
def test_module_of_a_trainer_checkpoint_is_refused(handmade, tmp_path):
    with pytest.raises(ValueError, match="module='net' picks a module of a Fabric checkpoint, but .* is the Trainer's.*Drop module[.]"):
        consolidate(handmade.trainer, tmp_path / "w.safetensors", format="safetensors", module="net")
    assert not (tmp_path / "w.safetensors").exists()


@needs_consolidate
def test_extra_state_is_kept_by_weights_only_and_refused_by_safetensors(handmade, tmp_path):
    consolidate(handmade.extra_state, tmp_path / "weights.ckpt", progress=False, weights_only=True, dtype="bf16")
    state_dict = load(tmp_path / "weights.ckpt")["state_dict"]
    assert state_dict["adapter._extra_state"] == "version 2"
    assert_identical(_cast(handmade.weights, torch.bfloat16), {k: v for k, v in state_dict.items() if k != "adapter._extra_state"}, "weights")
    with pytest.raises(ValueError, match="'adapter._extra_state' of 'model' in .* is not a tensor.*weights_only=True instead"):
        consolidate(handmade.extra_state, tmp_path / "w.safetensors", progress=False, format="safetensors")
    assert not (tmp_path / "w.safetensors").exists()


@needs_consolidate
def test_fabric_with_several_modules_needs_module_for_safetensors(handmade, tmp_path):
    with pytest.raises(ValueError, match=r"holds several modules \('gen', 'disc'\).*Pass module=NAME"):
        consolidate(handmade.fabric, tmp_path / "w.safetensors", progress=False, format="safetensors")
    with pytest.raises(ValueError, match=r"module='opt': .* has no such module entry; its modules are 'gen', 'disc'"):
        consolidate(handmade.fabric, tmp_path / "w.safetensors", progress=False, format="safetensors", module="opt")
    assert not list(tmp_path.iterdir())


@needs_consolidate
def test_fabric_module_picks_one_module_under_its_own_key_names(handmade, tmp_path):
    from safetensors.torch import load_file

    summary = consolidate(handmade.fabric, tmp_path / "gen.safetensors", progress=False, format="safetensors", module="gen")
    assert_identical(handmade.fabric_weights["gen"], load_file(tmp_path / "gen.safetensors"), "gen's weights")
    assert (summary.writer, summary.weights) == ("fabric", {"gen": 2})
    consolidate(handmade.fabric, tmp_path / "disc.ckpt", progress=False, weights_only=True, module="disc")
    assert_identical({"disc": handmade.fabric_weights["disc"]}, load(tmp_path / "disc.ckpt"), "the file")
    consolidate(handmade.fabric, tmp_path / "both.ckpt", progress=False, weights_only=True)
    assert_identical(handmade.fabric_weights, load(tmp_path / "both.ckpt"), "every module entry, nothing else")


@needs_consolidate
def test_command_line_writes_safetensors_and_refuses_contradictions(handmade, tmp_path, capsys):
    import subprocess

    from safetensors.torch import load_file

    from lightning_fsdp_resume.cli import main

    dst = tmp_path / "w.safetensors"
    command = [sys.executable, "-m", "lightning_fsdp_resume", "consolidate", str(handmade.trainer), str(dst),
               "--format", "safetensors", "--dtype", "bf16"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Wrote '{dst}': weights only (safetensors, bf16): 7 state_dict entries"), result.stdout
    assert_identical(_bits(_cast(handmade.weights, torch.bfloat16)), _bits(load_file(dst)), "the CLI's file")

    assert main(["consolidate", str(handmade.trainer), str(tmp_path / "x.ckpt"), "--dtype", "fp16"]) == 1
    assert "error: --dtype fp16 casts the weights of a weights-only file; a checkpoint that resumes keeps its optimizer" \
           " state and the dtypes it was trained in. Add --weights-only, or --format safetensors." in capsys.readouterr().err
    assert main(["consolidate", str(handmade.trainer), str(tmp_path / "x.ckpt"), "--weights-only", "--module", "net"]) == 1
    assert "error: --module 'net' picks a module of a Fabric checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["consolidate", str(handmade.trainer), str(tmp_path / "x.ckpt"), "--dtype", "int8"])
    assert usage.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_the_command_line_names_every_option_a_refusal_can_name_as_its_flag():
    """A refusal marks the options it names; Python's caller reads them as keyword arguments, the command line's as its
    flags: each table says every option, and each flag is one the command line takes."""
    from lightning_fsdp_resume import cli

    assert set(cli.FLAGS) == set(_whole_read.KEYWORDS)
    help_text = subprocess.run([sys.executable, "-m", "lightning_fsdp_resume", "consolidate", "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    for flag in cli.FLAGS.values():
        assert flag.split()[0] in help_text, flag


def test_consolidate_is_public_and_speaks_in_keyword_arguments(tmp_path):
    import lightning_fsdp_resume

    assert lightning_fsdp_resume.consolidate is consolidate and "consolidate" in lightning_fsdp_resume.__all__
    with pytest.raises(ValueError) as refused:
        lightning_fsdp_resume.consolidate(tmp_path / "src", tmp_path / "out", module="net")
    assert "--" not in str(refused.value) and "\x00" not in str(refused.value)


# --- weights only and safetensors of real checkpoints: Fabric's in this process, the Trainer's 2-rank runs ---


def test_fabric_weights_only_holds_the_module_entries_alone(fabric_run, tmp_path):
    summary = consolidate(fabric_run.sharded, tmp_path / "weights.ckpt", progress=False, weights_only=True)
    assert (summary.weights, summary.optimizers) == ({"net": 6}, ())
    assert_identical({"net": fabric_run.expected["net"]}, load(tmp_path / "weights.ckpt"), "the weights-only file")


def test_fabric_safetensors_has_the_modules_own_key_names(fabric_run, tmp_path):
    from safetensors.torch import load_file

    consolidate(fabric_run.sharded, tmp_path / "net.safetensors", progress=False, format="safetensors")
    assert_identical(_bits(fabric_run.expected["net"]), _bits(load_file(tmp_path / "net.safetensors")), "weights")


@pytest.mark.multirank
@needs_cpu_fsdp
def test_safetensors_of_a_2_rank_checkpoint_equals_the_runs_gathered_weights(reference, tmp_path):
    from safetensors.torch import load_file

    root = reference("sharded", 0)
    consolidate(root / "ckpt" / MID, tmp_path / "w.safetensors", progress=False, format="safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    assert_identical(_bits(load(root / "out" / "full_epoch1.pt")["params"]), _bits(loaded), "weights")
    assert set(loaded) == set(_registration_order())


@long_runs
@needs_consolidate
def test_benchmark_reports_consolidate_memory_for_each_output(handmade, tmp_path):
    """Figures are printed, never asserted: only that each output has its row."""
    import subprocess

    benchmark = Path(__file__).parent.parent / "benchmarks" / "resume_benchmark.py"
    result = subprocess.run([sys.executable, str(benchmark), "--consolidate-from", str(handmade.trainer), "--repeats", "1",
                             "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1].strip() for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["consolidate output", "torch, full", "torch, --weights-only", "safetensors", "safetensors, --dtype bf16",
                    "read whole, no file (load_from_checkpoint)"]
    assert "largest weight tensor" in result.stdout and not list(tmp_path.iterdir())
