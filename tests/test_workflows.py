"""The workflows around ``fit``, as users run them, with the checkpoints of a real 2-rank FSDP run.

In the same processes after ``fit``: evaluate with the weights a checkpoint names, save after evaluating,
fit on. In one process without FSDP: read a sharded checkpoint wherever Lightning reads a full one. Each test
is one row of the table in docs/resuming.md (``support/workflows.py``); where the Lightning under test fails a row, its
test is an expected failure, strict, so the table cannot go stale.
"""
import re
from pathlib import Path

import pytest
import torch

from lightning_fsdp_resume import DISABLE_ENV
from support.flavours import NATIVE
from support.marks import TORCH, needs_cpu_fsdp, skip_without_optimizer_state
from support.ranks import FULL_USE_ORIG_PARAMS, MID, config, worker
from support.states import assert_identical, assert_ranks_identical, load
from support.workflows import expected

pytestmark = [pytest.mark.multirank, needs_cpu_fsdp]

# After fit(max_epochs=2), with the best checkpoint the first (epoch=0) and last.ckpt the second (epoch=1)
EVALUATE = ["test:best", "save:after-test.ckpt", "test:none", "validate:epoch=1.ckpt", "predict:last"]
# After fit(max_epochs=1): on to 2 epochs with the same Trainer; validate the first epoch's weights; then on to 3
# with a new Trainer from last.ckpt, which holds other weights than the ones validation ran with
FIT_AGAIN = ["fit:last:2", "validate:epoch=0.ckpt", "newfit:last:3"]
SEQUENCES = {"evaluate": (2, EVALUATE), "fit again": (1, FIT_AGAIN)}

# (state_dict_type, use_orig_params, wrap): with a wrap policy (an FSDP unit per nn.Sequential, the head in the root
# unit) and with Lightning's default, no policy, where the root unit holds every weight; FSDP keeps the root's
# gathered weights from one forward to the next when no backward follows (evaluation)
CONFIGS = [("sharded", 0, "policy"), ("sharded", 1, "policy"), ("full", FULL_USE_ORIG_PARAMS, "policy")] + [
    ("sharded", 0, "root"), ("sharded", 1, "root"),
    *(("full", use_orig_params, "root") for use_orig_params in sorted({FULL_USE_ORIG_PARAMS, 1})),
]
STOCK = "stock"  # Lightning 2.0.x with the shim turned off: its own (full) save, no state_dict_type


def _params(configs=CONFIGS):
    return [pytest.param(*c, id=f"{c[0]}-orig{c[1]}-{c[2]}") for c in configs]


_runs = {}


def _sequence(tmp_path_factory, name: str, state_dict_type: str, use_orig_params: int, wrap: str = "policy") -> Path:
    """The run of one sequence in one configuration (once per session): its --out directory. ``fit`` validates
    every epoch, as a ``ModelCheckpoint`` that monitors a validation metric needs."""
    skip_without_optimizer_state(use_orig_params)
    key = (name, state_dict_type, use_orig_params, wrap)
    if key not in _runs:
        root = tmp_path_factory.mktemp(f"sequence-{name.replace(' ', '-')}-{state_dict_type}-{use_orig_params}-{wrap}")
        epochs, steps = SEQUENCES[name]
        args = [*config(root, "full" if state_dict_type == STOCK else state_dict_type, use_orig_params, wrap=wrap),
                "--best-first", "--max-epochs", epochs, "--then", *steps]
        env = None
        if state_dict_type == STOCK:
            args, env = [*args, "--stock"], {DISABLE_ENV: "1"}
        worker(root, *args, env=env)
        _runs[key] = root
    return _runs[key] / "out"


def _step_ok(out: Path, number: int) -> None:
    for rank in range(2):
        outcome = load_json(out / f"steps_rank{rank}.json")[number - 1]
        assert outcome["error"] is None, f"rank {rank}: {outcome['step']} failed: {outcome['error']}"


def load_json(path: Path):
    import json

    return json.loads(path.read_text())


def _evaluated_with(out: Path, step: str, ref: Path, epoch: int) -> None:
    """``step`` ran with epoch ``epoch``'s weights, bit for bit: every rank's shards, and the whole weights as FSDP
    gathers them for a forward (a gathered copy FSDP kept from an earlier forward shows here, not in the shards)."""
    assert_ranks_identical(ref / "out", f"epoch{epoch}", out, step, parts=["params", "buffers"])
    assert_identical(load(ref / "out" / f"full_epoch{epoch}.pt")["params"], load(out / f"full_{step}.pt")["params"],
                     f"the weights {step} computed with")


@pytest.mark.parametrize("state_dict_type, use_orig_params, wrap", _params())
@pytest.mark.parametrize("workflow", [pytest.param("test_best", marks=expected("test_best"))])
def test_fit_then_test_best_runs_the_best_weights_and_keeps_the_optimizers(
    reference, tmp_path_factory, state_dict_type, use_orig_params, wrap, workflow
):
    out = _sequence(tmp_path_factory, "evaluate", state_dict_type, use_orig_params, wrap)
    _step_ok(out, 1)
    ref = reference(state_dict_type, use_orig_params, wrap=wrap)
    _evaluated_with(out, "s1-test", ref, 0)
    # the optimizers fit made, with their state after the last epoch: test creates none
    assert_ranks_identical(ref / "out", "epoch1", out, "s1-test", parts=["optim"])


@pytest.mark.parametrize("state_dict_type, use_orig_params, wrap", _params())
@pytest.mark.parametrize("workflow, number, step, epoch", [
    pytest.param("evaluate_none", 3, "s3-test", 0, marks=expected("evaluate_none")),  # the best, loaded by step 1
    pytest.param("evaluate_path", 4, "s4-validate", 1, marks=expected("evaluate_path")),
    pytest.param("evaluate_last", 5, "s5-predict", 1, marks=expected("evaluate_last")),
])
def test_fit_then_evaluate_runs_the_named_weights(
    reference, tmp_path_factory, state_dict_type, use_orig_params, wrap, workflow, number, step, epoch
):
    out = _sequence(tmp_path_factory, "evaluate", state_dict_type, use_orig_params, wrap)
    _step_ok(out, number)
    _evaluated_with(out, step, reference(state_dict_type, use_orig_params, wrap=wrap), epoch)


@pytest.mark.parametrize("state_dict_type, use_orig_params, wrap", _params())
@pytest.mark.parametrize("workflow", [pytest.param("save_after_test", marks=expected("save_after_test"))])
def test_save_after_test_resumes_exactly(tmp_path_factory, tmp_path, state_dict_type, use_orig_params, wrap, workflow):
    """The best weights test ran with, the optimizers' state after fit: what a save then holds and a resume restores."""
    out = _sequence(tmp_path_factory, "evaluate", state_dict_type, use_orig_params, wrap)
    _step_ok(out, 2)
    worker(tmp_path, *config(tmp_path, state_dict_type, use_orig_params, wrap=wrap), "--max-epochs", 3,
           "--ckpt-path", out / "after-test.ckpt")
    assert_ranks_identical(out, "s2-saved", tmp_path / "out", "start")


@pytest.mark.parametrize("state_dict_type, use_orig_params, wrap", _params())
@pytest.mark.parametrize("workflow, number, start, end", [
    pytest.param("fit_again_same_trainer", 1, 0, 1, marks=expected("fit_again_same_trainer")),
    pytest.param("fit_again_new_trainer", 3, 1, 2, marks=expected("fit_again_new_trainer")),
])
def test_fit_again_from_last_continues_exactly(
    reference, tmp_path_factory, state_dict_type, use_orig_params, wrap, workflow, number, start, end
):
    out = _sequence(tmp_path_factory, "fit again", state_dict_type, use_orig_params, wrap)
    _step_ok(out, number)
    ref = reference(state_dict_type, use_orig_params, wrap=wrap)
    if workflow == "fit_again_new_trainer":  # the validation before it ran other weights than last.ckpt's
        _step_ok(out, 2)
        _evaluated_with(out, "s2-validate", ref, 0)
    assert_ranks_identical(ref / "out", f"epoch{start}", out, f"s{number}-start")
    assert_ranks_identical(ref / "out", f"epoch{end}", out, f"s{number}-epoch{end}")


@pytest.mark.parametrize("workflow", [pytest.param("test_best", marks=expected("test_best"))])
def test_shard_grad_op_units_evaluate_the_weights_a_load_names(tmp_path, workflow):
    """With ``SHARD_GRAD_OP`` no unit reshards after its forward, so after evaluation every unit keeps its gathered
    weights, not the root alone: ``test(ckpt_path="best")`` after ``fit`` runs the best weights all the same."""
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--sharding-strategy", "SHARD_GRAD_OP", "--best-first",
           "--max-epochs", 2, "--then", "test:best")
    out = tmp_path / "out"
    _step_ok(out, 1)
    _evaluated_with(out, "s1-test", tmp_path, 0)  # the run's own record of epoch 0


@pytest.mark.skipif(NATIVE, reason="the shim's check after a load")
@pytest.mark.skipif(TORCH < (2, 5), reason="torch < 2.5: the shim loads the model through FSDP's own state-dict"
                    " hooks, which write a kept gathered copy and the shards alike")
def test_a_load_the_model_would_not_compute_with_is_refused_on_every_rank(tmp_path):
    """Were the gathered copy FSDP keeps after evaluation left in place (``faults.keep_gathered_copies``), the load
    would not reach the forward: the check after every load refuses it on every rank, naming the checkpoint."""
    worker(tmp_path, *config(tmp_path, "sharded", 0, wrap="root"), "--best-first", "--max-epochs", 2,
           "--keep-gathered-copies", "--then", "test:best")
    for rank in range(2):
        error = load_json(tmp_path / "out" / f"steps_rank{rank}.json")[0]["error"]
        assert error is not None and re.fullmatch(
            r"RuntimeError: The checkpoint '.*epoch=0\.ckpt' was loaded into this rank's FSDP shards, but FSDP keeps a"
            r" gathered copy of other weights for the root and would compute with it: .* \(found on rank 0\)", error
        ), f"rank {rank}: {error}"


# --- stock Lightning 2.0.x, the same sequences with the shim turned off: the table's first column ----------------

# torch >= 2.6 refuses stock 2.0.x's checkpoints before anything else (its weights_only default): the column is
# measured where that does not hide what stock does with FSDP
stock_only = pytest.mark.skipif(NATIVE or TORCH >= (2, 6),
                                reason="the stock column is Lightning 2.0.x without the shim, on torch < 2.6")


@stock_only
@pytest.mark.parametrize("wrap", ["policy", "root"])
@pytest.mark.parametrize("workflow, number, step, epoch", [
    pytest.param("test_best", 1, "s1-test", 0, marks=expected("test_best", stock=True)),
    pytest.param("evaluate_none", 3, "s3-test", 0, marks=expected("evaluate_none", stock=True)),
    pytest.param("evaluate_path", 4, "s4-validate", 1, marks=expected("evaluate_path", stock=True)),
    pytest.param("evaluate_last", 5, "s5-predict", 1, marks=expected("evaluate_last", stock=True)),
])
def test_stock_fit_then_evaluate(reference, tmp_path_factory, workflow, number, step, epoch, wrap):
    out = _sequence(tmp_path_factory, "evaluate", STOCK, 0, wrap)
    _step_ok(out, number)
    _evaluated_with(out, step, reference("full", 0, wrap=wrap), epoch)


@stock_only
@pytest.mark.parametrize("wrap", ["policy", "root"])
@pytest.mark.parametrize("workflow, number, start, end", [
    pytest.param("fit_again_same_trainer", 1, 0, 1, marks=expected("fit_again_same_trainer", stock=True)),
    pytest.param("fit_again_new_trainer", 3, 1, 2, marks=expected("fit_again_new_trainer", stock=True)),
])
def test_stock_fit_again(reference, tmp_path_factory, workflow, number, start, end, wrap):
    out = _sequence(tmp_path_factory, "fit again", STOCK, 0, wrap)
    _step_ok(out, number)
    ref = reference("full", 0, wrap=wrap)
    assert_ranks_identical(ref / "out", f"epoch{start}", out, f"s{number}-start")
    assert_ranks_identical(ref / "out", f"epoch{end}", out, f"s{number}-epoch{end}")


@stock_only
@pytest.mark.parametrize("wrap", ["policy", "root"])
@pytest.mark.parametrize("workflow", [pytest.param("save_after_test", marks=expected("save_after_test", stock=True))])
def test_stock_save_after_test(tmp_path_factory, tmp_path, workflow, wrap):
    out = _sequence(tmp_path_factory, "evaluate", STOCK, 0, wrap)
    _step_ok(out, 2)
    worker(tmp_path, *config(tmp_path, "full", 0, wrap=wrap), "--stock", "--max-epochs", 3,
           "--ckpt-path", out / "after-test.ckpt", env={DISABLE_ENV: "1"})
    assert_ranks_identical(out, "s2-saved", tmp_path / "out", "start")


@stock_only
@pytest.mark.parametrize("workflow", [
    pytest.param("configure_sharded_model_full", marks=expected("configure_sharded_model_full", stock=True)),
])
def test_stock_load_from_checkpoint_of_a_model_built_in_the_hook(tmp_path, workflow):
    """Stock Lightning 2.0.x's own full save, read by its own ``load_from_checkpoint`` (the shim unpatched here)."""
    import lightning_fsdp_resume

    worker(tmp_path, *config(tmp_path, "full", 0), "--stock", "--net", "built", "--max-epochs", 1,
           env={DISABLE_ENV: "1"})
    lightning_fsdp_resume.unpatch()
    try:
        model = _trainer_module().BuiltNet.load_from_checkpoint(tmp_path / "ckpt" / "epoch=0.ckpt")
    finally:
        lightning_fsdp_resume.patch()
    assert_identical(load(tmp_path / "out" / "full_final.pt")["params"], _weights_of(model), "weights")


# --- a sharded checkpoint read whole, in one process, without FSDP ----------------------------------------------


def _trainer_module():
    from support import trainer_worker

    return trainer_worker


def _weights_of(module: torch.nn.Module):
    return {name: value.detach() for name, value in module.named_parameters()}


@pytest.mark.parametrize("workflow", [pytest.param("load_from_checkpoint", marks=expected("load_from_checkpoint"))])
def test_load_from_checkpoint_reads_a_sharded_directory_without_a_process_group(reference, workflow):
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    ref = reference("sharded", 0)
    net = _trainer_module().Net
    model = net.load_from_checkpoint(ref / "ckpt" / MID, map_location=lambda storage, location: storage)
    assert_identical(load(ref / "out" / "full_epoch1.pt")["params"], _weights_of(model), "weights")
    assert dict(model.hparams) == {"optimizers": 1}  # from meta.pt, as from a full file
    moved = net.load_from_checkpoint(ref / "ckpt" / MID, map_location="cpu", strict=True)
    assert_identical(_weights_of(model), _weights_of(moved), "weights with map_location='cpu'")


@pytest.mark.parametrize("workflow", [pytest.param("load_from_checkpoint", marks=expected("load_from_checkpoint"))])
def test_load_from_checkpoint_reads_a_sharded_directory_beside_a_process_group(reference, process_group, workflow):
    """One rank's process group is up (a notebook after training, say): the read does not join it."""
    ref = reference("sharded", 0)
    model = _trainer_module().Net.load_from_checkpoint(ref / "ckpt" / MID)
    assert_identical(load(ref / "out" / "full_epoch1.pt")["params"], _weights_of(model), "weights")


@pytest.mark.skipif(NATIVE, reason="native Lightning reads no sharded directory there")
def test_load_from_checkpoint_refuses_a_partial_directory_with_the_usual_check(reference, tmp_path):
    import shutil

    partial = tmp_path / "partial.ckpt"
    shutil.copytree(reference("sharded", 0) / "ckpt" / MID, partial)
    (partial / "meta.pt").unlink()
    with pytest.raises(ValueError, match=r"partial\.ckpt.*has no 'meta\.pt'.*resume from another"):
        _trainer_module().Net.load_from_checkpoint(partial)


@pytest.mark.parametrize("workflow", [pytest.param("single_device_ckpt_path", marks=expected("single_device_ckpt_path"))])
def test_single_device_predict_reads_a_sharded_directory(reference, tmp_path, workflow):
    worker_module = _trainer_module()
    ref = reference("sharded", 0)
    trainer = worker_module.L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                      enable_model_summary=False, default_root_dir=tmp_path)
    model = worker_module.Net()
    trainer.predict(model, worker_module.data(), ckpt_path=ref / "ckpt" / MID)
    assert_identical(load(ref / "out" / "full_epoch1.pt")["params"], _weights_of(model), "weights predict ran with")


@pytest.mark.parametrize("workflow", [pytest.param("ddp_ckpt_path", marks=expected("ddp_ckpt_path"))])
def test_ddp_resumes_from_a_sharded_directory(reference, tmp_path, workflow):
    """Every DDP rank reads the sharded checkpoint whole: weights and optimizer state as FSDP had them."""
    ref = reference("sharded", 0)
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--strategy", "ddp", "--max-epochs", 3,
           "--ckpt-path", ref / "ckpt" / MID)
    expected_state, restored = load(ref / "out" / "full_epoch1.pt"), load(tmp_path / "out" / "full_start.pt")
    assert_identical(expected_state["params"], restored["params"], "weights")
    if expected_state["optim"] is not None:
        assert_identical(expected_state["optim"], restored["optim"], "optimizer state")


@pytest.mark.parametrize("workflow", [pytest.param("fabric_without_fsdp", marks=expected("fabric_without_fsdp"))])
def test_fabric_without_fsdp_loads_a_sharded_directory(fabric_reference, workflow):
    from support import fabric_worker
    from support.flavours import FABRIC_UNDER_TEST

    ref = fabric_reference("sharded")
    fabric = FABRIC_UNDER_TEST.module().Fabric(accelerator="cpu", devices=1)
    model = fabric_worker.Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=fabric_worker.LR)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "epoch": None}
    fabric.load(ref / "ckpt" / "epoch=1.ckpt", state)
    recorded = load(ref / "out" / "full_epoch1.pt")
    assert_identical(recorded["params"], _weights_of(model.module if hasattr(model, "module") else model), "weights")
    # Fabric 2.0.5's optimizer wrapper has no load_state_dict of its own: it loads any state into itself, not into
    # the optimizer (2.0.9 delegates), with or without the shim
    if "load_state_dict" in vars(FABRIC_UNDER_TEST.module("wrappers")._FabricOptimizer):
        names = [name for name, _ in model.named_parameters()]
        restored = {names[index]: value for index, value in optimizer.state_dict()["state"].items()}
        assert_identical(recorded["optim"][0], {n.replace("_forward_module.", ""): v for n, v in restored.items()},
                         "optimizer state")
    assert state["epoch"] == 1
    with pytest.raises(ValueError, match=r"sharded checkpoint directory.*fabric\.load"):
        fabric.load_raw(ref / "ckpt" / "epoch=1.ckpt", model)


@pytest.mark.parametrize("state_dict_type, workflow", [
    pytest.param("sharded", "configure_sharded_model_sharded", marks=expected("configure_sharded_model_sharded")),
    pytest.param("full", "configure_sharded_model_full", marks=expected("configure_sharded_model_full")),
])
def test_load_from_checkpoint_builds_the_hooks_layers_first(tmp_path, monkeypatch, state_dict_type, workflow):
    # Lightning 2.0.x reads a full file with torch.load's default, weights_only since torch 2.6 (docs/safety.md)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    use_orig_params = FULL_USE_ORIG_PARAMS if state_dict_type == "full" else 0
    worker(tmp_path, *config(tmp_path, state_dict_type, use_orig_params), "--net", "built", "--max-epochs", 1)
    model = _trainer_module().BuiltNet.load_from_checkpoint(tmp_path / "ckpt" / "epoch=0.ckpt")
    trained = load(tmp_path / "out" / "full_final.pt")["params"]
    assert any(name.startswith("late.") for name in trained)
    assert_identical(trained, _weights_of(model), "weights")
