"""Fabric's ``save``, ``load`` and ``load_raw`` with ``FSDPStrategy`` on real ranks: 2 ranks, gloo on the CPU.

Each test names one behaviour of native Fabric 2.1.4, which the shim gives Fabric 2.0.x. Reference runs
(fabric_worker.py) train 3 epochs and save after each; resumed runs load the checkpoint after epoch 0 in
new processes, so that two epochs run after it (the learning-rate scheduler steps in between), and every
rank's parameter shards and optimizer state must equal the uninterrupted run's bit for bit.
"""
import inspect
import re
from pathlib import Path

import pytest
import torch

from support.flavours import FABRIC_UNDER_TEST
from support.marks import needs_cpu_fsdp, raising

pytestmark = [pytest.mark.multirank, needs_cpu_fsdp]
if FABRIC_UNDER_TEST is None:
    pytest.skip("neither lightning.fabric nor lightning_fabric is installed", allow_module_level=True)

from support.ranks import EPOCHS, fabric_config, fabric_worker  # noqa: E402
from support.states import DIFFER, assert_identical, assert_ranks_identical, file_hashes, info, load  # noqa: E402

NATIVE, VERSION = FABRIC_UNDER_TEST.native, FABRIC_UNDER_TEST.version  # the Fabric the rank program runs
RESUME_EPOCH = 0
RESUME = f"epoch={RESUME_EPOCH}.ckpt"
STEPS_PER_EPOCH = 8  # 64 samples, 4 a rank, 2 ranks
SHARDS_AND_OPTIMIZER = ("params", "buffers", "optim")
# Native Lightning >= 2.1 (2.1.4 to 2.6 at least): a sharded load assigns the scheduler's saved state dict to
# state["scheduler"] (``state[key] = metadata.pop(key)``) instead of calling its load_state_dict; the full
# path restores it in place.
SCHEDULER_BUG = (
    f"native Lightning {VERSION}: Fabric's FSDPStrategy.load_checkpoint of a sharded checkpoint replaces the scheduler"
    " in the caller's state with its saved state dict instead of restoring the scheduler in place"
)


@pytest.fixture(scope="module")
def resumed(fabric_reference, tmp_path_factory):
    """One resume per ``state_dict_type`` from the reference run's checkpoint after epoch 0, shared by the tests
    that read different parts of it."""
    runs = {}

    def get(state_dict_type: str) -> Path:
        if state_dict_type not in runs:
            root = tmp_path_factory.mktemp(f"fabric-resumed-{state_dict_type}")
            checkpoint = fabric_reference(state_dict_type) / "ckpt" / RESUME
            fabric_worker(root, *fabric_config(root, state_dict_type), "--epochs", EPOCHS, "--resume", checkpoint)
            runs[state_dict_type] = root
        return runs[state_dict_type]

    return get


@pytest.fixture(scope="module")
def refusals(fabric_reference, tmp_path_factory):
    """What every rank raised for each call native Fabric refuses (fabric_worker.refusals), per ``state_dict_type``."""
    import json

    runs = {}

    def get(state_dict_type: str, call: str, rank: int) -> dict:
        if state_dict_type not in runs:
            root = tmp_path_factory.mktemp(f"fabric-refusals-{state_dict_type}")
            checkpoint = fabric_reference(state_dict_type) / "ckpt" / RESUME
            fabric_worker(root, *fabric_config(root, state_dict_type), "--errors", checkpoint)
            runs[state_dict_type] = root / "out"
        raised = json.loads((runs[state_dict_type] / f"errors_rank{rank}.json").read_text())[call]
        assert raised is not None, f"{call} ({state_dict_type}) raised nothing on rank {rank}"
        return raised

    get.scratch = lambda state_dict_type: runs[state_dict_type] / "scratch"
    return get


def _assert_refused(refusals, state_dict_type: str, call: str, error: str, words: str) -> None:
    """Every rank raised ``error`` (or a subclass), its message starting with native Fabric 2.1.4's ``words`` (the
    shim may say more after them)."""
    for rank in (0, 1):
        raised = refusals(state_dict_type, call, rank)
        assert error in raised["bases"], f"rank {rank}: {call} raised {raised}"
        assert raised["message"].startswith(words), f"rank {rank}: {call} said {raised['message']!r}"


def _assert_resumed_exactly(ref: Path, run: Path, epoch: int = RESUME_EPOCH) -> None:
    """Right after loading every rank holds the shards and optimizer state of the reference at ``epoch``, and it
    ends with the reference's."""
    assert_ranks_identical(ref / "out", f"epoch{epoch}", run / "out", "start", parts=SHARDS_AND_OPTIMIZER)
    assert_ranks_identical(ref / "out", "final", run / "out", "final", parts=SHARDS_AND_OPTIMIZER)


# --- save, load in new processes, continue ----------------------------------------------------------------


@pytest.mark.smoke
def test_sharded_save_load_continue_is_bit_exact(fabric_reference, resumed):
    ref = fabric_reference("sharded")
    assert (ref / "ckpt" / RESUME / "meta.pt").is_file()
    _assert_resumed_exactly(ref, resumed("sharded"))


def test_full_save_load_continue_is_bit_exact(fabric_reference, resumed):
    ref = fabric_reference("full")
    assert (ref / "ckpt" / RESUME).is_file()
    _assert_resumed_exactly(ref, resumed("full"))


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """One run per ``state_dict_type`` and wrapping that evaluates after every epoch (a forward under ``no_grad``),
    then, in the same processes, loads its checkpoint after epoch 0 and trains one more epoch (``--reload``)."""
    runs = {}

    def get(state_dict_type: str, wrap: str) -> Path:
        if (state_dict_type, wrap) not in runs:
            root = tmp_path_factory.mktemp(f"fabric-evaluated-{state_dict_type}-{wrap}")
            fabric_worker(root, *fabric_config(root, state_dict_type, wrap), "--epochs", EPOCHS, "--evaluate",
                          "--reload", RESUME_EPOCH)
            runs[state_dict_type, wrap] = root
        return runs[state_dict_type, wrap]

    return get


WRAPPINGS = [pytest.param("policy", id="policy"), pytest.param("root", id="root")]


@pytest.mark.parametrize("wrap", WRAPPINGS)
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_a_load_after_evaluation_runs_the_loaded_weights(evaluated, state_dict_type, wrap):
    """After a forward with no backward, FSDP keeps the root unit's weights gathered (Fabric's default wraps the root
    alone; with the policy, the head is in the root unit). ``fabric.load`` in the same processes then restores the
    checkpoint's weights as the next forward computes with them, and the epoch after it trains as it did first."""
    out = evaluated(state_dict_type, wrap) / "out"
    after = RESUME_EPOCH + 1
    assert_ranks_identical(out, f"epoch{RESUME_EPOCH}", out, "reloaded", parts=SHARDS_AND_OPTIMIZER)
    assert_identical(load(out / f"full_epoch{RESUME_EPOCH}.pt"), load(out / "full_reloaded.pt"), "the gathered weights")
    assert_ranks_identical(out, f"epoch{after}", out, f"reloaded-epoch{after}", parts=SHARDS_AND_OPTIMIZER)
    assert_identical(load(out / f"full_epoch{after}.pt"), load(out / f"full_reloaded-epoch{after}.pt"), "the epoch after")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_root_only_save_load_continue_is_bit_exact(evaluated, tmp_path, state_dict_type):
    """With FSDPStrategy's default wrapping (the root unit alone), a checkpoint resumes in new processes bit for bit."""
    ref = evaluated(state_dict_type, "root")
    fabric_worker(tmp_path, *fabric_config(tmp_path, state_dict_type, "root"), "--epochs", EPOCHS,
                  "--resume", ref / "ckpt" / RESUME)
    _assert_resumed_exactly(ref, tmp_path)


@pytest.mark.parametrize("net", ["buffered", "dropout"])
@pytest.mark.parametrize("state_dict_type", [
    pytest.param("sharded", marks=pytest.mark.xfail(NATIVE, strict=True, raises=raising(AssertionError, DIFFER), reason=SCHEDULER_BUG.replace(
        "the scheduler", "a stateful object (a RankStates, a scheduler)"))),
    "full",
])
def test_rank_states_resume_every_ranks_buffers_and_random_state(tmp_path, state_dict_type, net):
    """With a ``RankStates`` of the model in the state, a model with dropout (each rank's masks from its random
    number generator) or BatchNorm (each rank's running statistics) resumes on every rank bit for bit."""
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    fabric_worker(ref, *fabric_config(ref, state_dict_type), "--epochs", EPOCHS, "--net", net, "--rank-states")
    fabric_worker(resumed, *fabric_config(resumed, state_dict_type), "--epochs", EPOCHS, "--net", net, "--rank-states",
                  "--resume", ref / "ckpt" / RESUME)
    if net == "buffered":
        saved = [load(ref / "out" / f"epoch{RESUME_EPOCH}_rank{rank}.pt")["buffers"] for rank in (0, 1)]
        assert any(not torch.equal(saved[0][name], saved[1][name]) for name in saved[0]), "buffers should differ by rank"
    _assert_resumed_exactly(ref, resumed)


def test_a_torchrun_launch_resumes_the_same_as_the_rank_server(fabric_reference, tmp_path):
    ref = fabric_reference("sharded")
    fabric_worker(tmp_path, *fabric_config(tmp_path, "sharded"), "--epochs", EPOCHS, "--resume", ref / "ckpt" / RESUME,
                  by_torchrun=True)
    _assert_resumed_exactly(ref, tmp_path)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_scheduler_is_restored_in_place(fabric_reference, resumed, state_dict_type):
    if NATIVE and state_dict_type == "sharded":
        pytest.skip(SCHEDULER_BUG)
    ref, run = fabric_reference(state_dict_type), resumed(state_dict_type)
    for rank in (0, 1):
        restored = info(run / "out", "start", rank)
        assert restored["scheduler_type"] == "StepLR" and restored["scheduler_in_place"], restored
        saved = info(ref / "out", f"epoch{RESUME_EPOCH}", rank)
        assert (restored["last_epoch"], restored["last_lr"]) == (saved["last_epoch"], saved["last_lr"])
    assert_ranks_identical(ref / "out", f"epoch{RESUME_EPOCH}", run / "out", "start", parts=["scheduler"])
    assert_ranks_identical(ref / "out", "final", run / "out", "final", parts=["scheduler"])


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_the_optimizer_fabric_returned_sees_the_loaded_state(fabric_reference, resumed, state_dict_type):
    """Fabric loads into the optimizer its wrapper holds; the wrapper, which the scheduler was made on, shows the
    loaded learning rate, and each scheduler step reaches the optimizer that trains."""
    ref, run = fabric_reference(state_dict_type), resumed(state_dict_type)
    for rank in (0, 1):
        saved = load(ref / "out" / f"epoch{RESUME_EPOCH}_rank{rank}.pt")["optim"][0]["param_groups"]
        assert info(run / "out", "start", rank)["fabric_optimizer_lr"] == [group["lr"] for group in saved]
        for epoch in range(RESUME_EPOCH + 1, EPOCHS):
            expected = load(ref / "out" / f"epoch{epoch}_rank{rank}.pt")["optim"][0]["param_groups"]
            actual = load(run / "out" / f"epoch{epoch}_rank{rank}.pt")["optim"][0]["param_groups"]
            assert [g["lr"] for g in actual] == [g["lr"] for g in expected], f"rank {rank}: learning rate after epoch {epoch}"


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_plain_values_are_updated_in_the_callers_dict(resumed, state_dict_type):
    for rank in (0, 1):
        restored = info(resumed(state_dict_type) / "out", "start", rank)
        assert (restored["epoch"], restored["step"]) == (RESUME_EPOCH, (RESUME_EPOCH + 1) * STEPS_PER_EPOCH)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_load_returns_the_keys_not_requested(fabric_reference, resumed, state_dict_type):
    """``loss`` and ``world_size`` were saved (by rank 0) but not asked for: every rank gets rank 0's back."""
    saved = info(fabric_reference(state_dict_type) / "out", f"epoch{RESUME_EPOCH}", 0)
    for rank in (0, 1):
        remainder = info(resumed(state_dict_type) / "out", "start", rank)["remainder"]
        assert remainder == {"loss": saved["loss"], "world_size": 2}


# --- strict ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_not_strict_loads_the_rest_when_a_requested_key_is_missing(fabric_reference, tmp_path, state_dict_type):
    ref = fabric_reference(state_dict_type)
    fabric_worker(tmp_path, *fabric_config(tmp_path, state_dict_type), "--epochs", EPOCHS, "--resume", ref / "ckpt" / RESUME,
                  "--strict", 0, "--request-missing")
    _assert_resumed_exactly(ref, tmp_path)
    for rank in (0, 1):
        restored = info(tmp_path / "out", "start", rank)
        assert restored["missing"] == "kept", "the value of a key the checkpoint lacks was changed"
        assert restored["epoch"] == RESUME_EPOCH


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_strict_refuses_a_requested_key_missing_from_the_checkpoint(refusals, state_dict_type):
    _assert_refused(refusals, state_dict_type, "load-strict-missing-key", "KeyError",
                    "The requested state contains a key 'missing' that does not exist in the loaded checkpoint."
                    " To disable strict loading, set `strict=False`.")


# --- load_raw and filter -----------------------------------------------------------------------------------


def test_load_raw_puts_full_weights_into_the_sharded_model(fabric_reference, tmp_path):
    """A plain state dict file (a full checkpoint's ``model`` entry) into a fresh FSDP model, on every rank."""
    ref = fabric_reference("full")
    weights = tmp_path / "weights.pt"
    torch.save(load(ref / "ckpt" / RESUME)["model"], weights)
    fabric_worker(tmp_path, *fabric_config(tmp_path, "sharded"), "--epochs", 0, "--load-raw", weights)
    expected = load(ref / "out" / f"full_epoch{RESUME_EPOCH}.pt")["params"]
    assert_identical(expected, load(tmp_path / "out" / "full_start.pt")["params"], "weights after load_raw")
    assert_ranks_identical(ref / "out", f"epoch{RESUME_EPOCH}", tmp_path / "out", "start", parts=["params"])


@pytest.mark.parametrize("how", ["--load-raw", "--load-model"])
def test_not_strict_loads_old_weights_into_a_grown_model(fabric_reference, tmp_path, how):
    """``load_raw`` of a state dict, and ``load`` of a full checkpoint's model, into a model with a layer more: the
    weights both have come from the file, the new layer keeps its own."""
    ref = fabric_reference("full")
    source = ref / "ckpt" / RESUME
    if how == "--load-raw":
        source = tmp_path / "weights.pt"
        torch.save(load(ref / "ckpt" / RESUME)["model"], source)
    fresh, run = tmp_path / "fresh", tmp_path / "loaded"
    fabric_worker(fresh, *fabric_config(fresh, "sharded"), "--epochs", 0, "--grown")
    fabric_worker(run, *fabric_config(run, "sharded"), "--epochs", 0, "--grown", how, source, "--strict", 0)
    saved = load(ref / "out" / f"full_epoch{RESUME_EPOCH}.pt")["params"]
    before, after = load(fresh / "out" / "full_start.pt")["params"], load(run / "out" / "full_start.pt")["params"]
    grown = set(after) - set(saved)
    assert grown and set(saved) < set(after)
    assert_identical(saved, {name: after[name] for name in saved}, "the weights the file holds")
    assert_identical({name: before[name] for name in grown}, {name: after[name] for name in grown}, "the new layer")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_weights_only_loads_a_checkpoint_of_plain_values(fabric_reference, tmp_path, state_dict_type):
    """``fabric.load(..., weights_only=True)`` (Fabric 2.6.1's keyword): the checkpoints hold tensors and plain
    values only, so it resumes as exactly as without."""
    if "weights_only" not in inspect.signature(FABRIC_UNDER_TEST.module().Fabric.load).parameters:
        pytest.skip(f"native Lightning {VERSION}: Fabric.load has no weights_only (new in 2.6.1)")
    ref = fabric_reference(state_dict_type)
    fabric_worker(tmp_path, *fabric_config(tmp_path, state_dict_type), "--epochs", EPOCHS, "--resume", ref / "ckpt" / RESUME,
                  "--weights-only")
    _assert_resumed_exactly(ref, tmp_path)


def test_filter_keeps_only_the_selected_entries_of_a_full_save(fabric_reference, tmp_path):
    fabric_worker(tmp_path, *fabric_config(tmp_path, "full"), "--epochs", 1, "--filter")
    saved = load(tmp_path / "ckpt" / "epoch=0.ckpt")
    weights = load(fabric_reference("full") / "out" / "full_epoch0.pt")["params"]
    assert_identical({k: v for k, v in weights.items() if "weight" in k}, saved["model"], "filtered model entry")
    assert set(saved) == {"model", "optimizer", "scheduler", "epoch", "step", "loss", "world_size"}


def test_filter_is_refused_for_sharded_saves(refusals):
    _assert_refused(refusals, "sharded", "save-sharded-filtered", "NotImplementedError",
                    "FSDP doesn't support loading sharded filtered checkpoints, so saving them is disabled.")


@pytest.mark.parametrize("call,error,words", [
    ("filter-not-a-dict", "TypeError", "Filter should be a dictionary, given "),
    ("filter-unknown-key", "ValueError", "The filter keys {'nope'} are not present in the state keys {'model'}."),
    ("filter-not-callable", "TypeError", "Expected `fabric.save(filter=...)` for key 'model' to be a callable, given 1"),
], ids=["not-a-dict", "unknown-key", "not-callable"])
def test_save_checks_the_filter(refusals, call, error, words):
    _assert_refused(refusals, "sharded", call, error, words)


# --- refused states and paths --------------------------------------------------------------------------------


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_saving_a_state_without_an_fsdp_model_is_refused(refusals, state_dict_type):
    _assert_refused(refusals, state_dict_type, "save-without-model", "ValueError",
                    "Could not find a FSDP model in the provided checkpoint state. Please provide the model as part of the"
                    " state like so: `save_checkpoint(..., state={'model': model, ...})`. Make sure you set up the model"
                    " (and optimizers if any) through the strategy before saving the checkpoint.")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_loading_into_a_state_without_an_fsdp_model_is_refused(refusals, state_dict_type):
    _assert_refused(refusals, state_dict_type, "load-without-model", "ValueError",
                    "Could not find a FSDP model in the provided checkpoint state. Please provide the model as part of the"
                    " state like so: `load_checkpoint(..., state={'model': model, ...})`. Make sure you set up the model"
                    " (and optimizers if any) through the strategy before loading the checkpoint.")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@pytest.mark.parametrize("call,words", [
    ("save-two-models", "Found multiple FSDP models in the given state. Saving checkpoints with FSDP is currently limited to a"
                        " single model per checkpoint. To save multiple models, call the save method for each model"
                        " separately with a different path."),
    ("load-two-models", "Found multiple FSDP models in the given state. Loading checkpoints with FSDP is currently limited to a"
                        " single model per checkpoint. To load multiple models, call the load method for each model"
                        " separately with a different path."),
], ids=["save", "load"])
def test_several_fsdp_models_are_refused(refusals, state_dict_type, call, words):
    _assert_refused(refusals, state_dict_type, call, "ValueError", words)


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_load_raw_of_an_optimizer_is_refused(refusals, state_dict_type):
    _assert_refused(refusals, state_dict_type, "load-raw-optimizer", "NotImplementedError",
                    "Loading a single optimizer object from a checkpoint is not supported yet with the FSDP strategy.")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@pytest.mark.parametrize("call,given", [("load-empty-state", "{}"), ("load-no-state", "None")])
def test_loading_into_an_empty_state_is_refused(refusals, state_dict_type, call, given):
    # native's words, with its double space
    _assert_refused(refusals, state_dict_type, call, "ValueError",
                    f"Got FSDPStrategy.load_checkpoint(..., state={given}) but a state with at least  a model instance to"
                    " reload is required. Pass it in like so: FSDPStrategy.load_checkpoint(..., state={'model': model, ...})")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@pytest.mark.parametrize("call,name", [("load-missing-path", "does-not-exist.ckpt"), ("load-empty-directory", "empty-dir")])
def test_a_path_that_is_no_checkpoint_is_refused(refusals, state_dict_type, call, name):
    path = re.escape(f"{name}' does not point to a valid checkpoint")
    for rank in (0, 1):
        raised = refusals(state_dict_type, call, rank)
        assert "ValueError" in raised["bases"], raised
        assert re.match(rf"The path '.*{path}", raised["message"]), raised["message"]


def test_load_raw_of_a_sharded_checkpoint_is_refused(refusals):
    _assert_refused(refusals, "sharded", "load-raw-sharded", "ValueError",
                    "Failed to load checkpoint directly into the model. The given path must be a single file containing"
                    " the full state dict: ")


@pytest.mark.parametrize("call", ["save-full-onto-directory", "save-full-onto-empty-directory"])
def test_full_save_onto_a_directory_is_refused(refusals, call):
    """A directory holding something that is no checkpoint, and an empty one, as native refuses both."""
    _assert_refused(refusals, "full", call, "IsADirectoryError", "The checkpoint path exists and is a directory: ")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_load_raw_of_a_missing_path_is_refused_in_natives_words(refusals, state_dict_type):
    _assert_refused(refusals, state_dict_type, "load-raw-missing-path", "ValueError",
                    "Failed to load checkpoint directly into the model. The given path must be a single file containing"
                    " the full state dict: ")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_a_checkpoint_io_plugin_is_refused(refusals, state_dict_type):
    """Fabric 2.0.x accepted one and never used it."""
    _assert_refused(refusals, state_dict_type, "set-checkpoint-io", "NotImplementedError",
                    "The `FSDPStrategy` does not support setting a `CheckpointIO` plugin.")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_reading_the_checkpoint_io_is_refused_as_native_refuses_it(refusals, state_dict_type):
    """Fabric 2.0.x answered with a ``TorchCheckpointIO`` it never used."""
    _assert_refused(refusals, state_dict_type, "get-checkpoint-io", "NotImplementedError",
                    "The `FSDPStrategy` does not use the `CheckpointIO` plugin interface")


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_load_raw_of_a_directory_that_is_no_checkpoint_is_refused_in_natives_words(refusals, state_dict_type):
    _assert_refused(refusals, state_dict_type, "load-raw-plain-directory", "ValueError",
                    "Failed to load checkpoint directly into the model. The given path must be a single file containing"
                    " the full state dict: ")


@pytest.mark.skipif(NATIVE, reason="the shim's restricted unpickling: native Fabric's is docs/behaviour.md's column")
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@pytest.mark.parametrize("call,ran", [("load-poisoned", "ran-load"), ("load-raw-poisoned", "ran-load-raw")])
def test_a_checkpoint_whose_pickle_runs_code_is_refused_before_it_runs(refusals, state_dict_type, call, ran):
    """fabric.load of a checkpoint with code hidden in its meta.pt (sharded) or in the file (full), and load_raw of a
    state dict file with code hidden in it: refused on every rank, by default, naming the file and what it names;
    the code never ran (support/poison.py)."""
    for rank in (0, 1):
        raised = refusals(state_dict_type, call, rank)
        assert "UnsafeCheckpointError" in raised["bases"] and "ValueError" in raised["bases"], raised
        assert re.match(r"Refused to unpickle [^']*'[^']*poisoned[^']*': it names `support\.poison\.ran`, .* `weights_only=False`",
                        raised["message"]), raised["message"]
    scratch = refusals.scratch(state_dict_type)
    assert scratch.is_dir() and not (scratch / ran).exists()


@pytest.mark.skipif(NATIVE, reason="the shim's checksums: native Fabric loads damaged bytes (docs/behaviour.md)")
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@pytest.mark.parametrize("call", ["load-damaged", "load-raw-damaged"])
def test_a_damaged_checkpoint_is_refused_on_every_rank(refusals, state_dict_type, call):
    """fabric.load of a checkpoint with one bit flipped in a tensor (rank 1's shard file, found as rank 1 reads it; the
    full file, checked before it loads) and load_raw of a damaged state dict file: every rank raises the damage."""
    for rank in (0, 1):
        raised = refusals(state_dict_type, call, rank)
        assert "DamagedCheckpointError" in raised["bases"] and "ValueError" in raised["bases"], raised
        name = "__1_0.distcp" if (call, state_dict_type) == ("load-damaged", "sharded") else "damaged"
        assert re.match(rf"The checkpoint file '[^']*{name}[^']*' is damaged", raised["message"]), raised["message"]


# --- every kind of entry in the state -------------------------------------------------------------------------

MODULE_BESIDE_BUG = (
    f"native Lightning {VERSION}: a module without FSDP units beside the FSDP one is saved with the shards, and a"
    " sharded load looks for it in meta.pt only (KeyError)"
)


@pytest.fixture(scope="module")
def more_entries(tmp_path_factory):
    """Per ``state_dict_type``: a run that saves a plain module, a list, a nested dict, a tuple and a tensor beside
    the model after epoch 0, and a load of that checkpoint into fresh ones in new processes."""
    runs = {}

    def get(state_dict_type: str):
        if state_dict_type not in runs:
            ref, run = (tmp_path_factory.mktemp(f"fabric-{name}-{state_dict_type}") for name in ("entries", "entries-loaded"))
            fabric_worker(ref, *fabric_config(ref, state_dict_type), "--epochs", 1, "--more-entries")
            fabric_worker(run, *fabric_config(run, state_dict_type), "--epochs", 1, "--more-entries",
                          "--resume", ref / "ckpt" / RESUME)
            runs[state_dict_type] = ref, run
        return runs[state_dict_type]

    return get


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_every_kind_of_entry_comes_back(more_entries, state_dict_type):
    """The plain module is restored in place, bit for bit; lists, dicts, tuples and tensors come back into the
    caller's dict with their type and value (2.0.x's unwrapping copies collections, which were not written back)."""
    if NATIVE and state_dict_type == "sharded":
        pytest.skip(MODULE_BESIDE_BUG)
    ref, run = more_entries(state_dict_type)
    for rank in (0, 1):
        saved, loaded = info(ref / "out", f"epoch{RESUME_EPOCH}", rank), info(run / "out", "start", rank)
        assert loaded["more_entries"] == saved["more_entries"], f"rank {rank}"
        assert loaded["ema_in_place"], f"rank {rank}: the module was replaced, not restored in place"
    assert info(run / "out", "start")["more_entries"] != info(ref / "out", "start")["more_entries"], "nothing to restore"


def test_not_strict_resumes_from_a_filtered_full_save(tmp_path):
    """Only the weights were saved (``filter=``, the trainable-parameters idiom), the optimizer whole: they load,
    the biases keep their values, and the optimizer state is the saved run's."""
    saved, run = tmp_path / "filtered", tmp_path / "resumed"
    fabric_worker(saved, *fabric_config(saved, "full"), "--epochs", 1, "--filter")
    fabric_worker(run, *fabric_config(run, "full"), "--epochs", 1, "--resume", saved / "ckpt" / RESUME, "--strict", 0)
    at_save, fresh = load(saved / "out" / f"full_epoch{RESUME_EPOCH}.pt"), load(saved / "out" / "full_start.pt")
    loaded = load(run / "out" / "full_start.pt")
    weights = {name for name in loaded["params"] if "weight" in name}
    assert weights and len(weights) < len(loaded["params"])
    assert_identical({n: at_save["params"][n] for n in weights}, {n: loaded["params"][n] for n in weights}, "saved weights")
    rest = set(loaded["params"]) - weights
    assert_identical({n: fresh["params"][n] for n in rest}, {n: loaded["params"][n] for n in rest}, "biases not saved")
    assert_identical(at_save["optim"], loaded["optim"], "optimizer state")


# --- a rank killed while saving ------------------------------------------------------------------------------

# (kill point, rank): one rank is SIGKILLed there while a save writes the next epoch's checkpoint. The first
# launch starts from scratch and is killed in its second save; each next one resumes from the newest complete
# checkpoint and is killed in its first save.
SHARD_KILLS = [
    ("mid-shards", 1),
    ("before-shards", 0),
    ("before-shards", 1),
    ("mid-shards", 0),
    ("after-shards", 0),
    ("after-shards", 1),
]
# The shim's atomic publishing: native Lightning writes a sharded checkpoint in place, without these points.
PUBLISH_KILLS = [("before-publish", 0), ("after-publish", 0)]
NO_PUBLISH = f"native Lightning {VERSION} writes sharded checkpoints in place: no publish step to kill"


def _kill_chain(root: Path, kills) -> dict:
    """Kill one save a launch; each next launch resumes from the newest complete checkpoint; a last launch runs to
    the end. Returns what each launch saw, for the tests to judge."""
    ckpt = root / "ckpt"
    newest = None  # epoch of the newest complete checkpoint
    launches = []
    for number, (point, rank) in enumerate(kills):
        run = root / f"launch{number}"
        args = [*fabric_config(run, "sharded"), "--ckpt-dir", ckpt, "--epochs", EPOCHS]
        previous = ckpt / f"epoch={newest}.ckpt"
        if newest is not None:
            args += ["--resume", previous]
            before = file_hashes(previous)
        output = fabric_worker(run, *args, "--kill", f"{point}:{rank}:{1 if newest is not None else 2}", expect_failure=True)
        launch = {"kill": f"{point}@rank{rank}", "run": run, "resumed": newest,
                  "killed": bool(re.search(r"exitcode\s*:\s*-9|SIGKILL", output)), "output": output[-3000:]}
        if newest is not None:
            launch["previous kept"] = previous.exists() and file_hashes(previous) == before
        newest = 0 if newest is None else newest  # from scratch, the first save completed
        launch["path"] = ckpt / f"epoch={newest + 1}.ckpt"  # where the killed save was headed
        launch["exists"] = launch["path"].exists()
        launches.append(launch)
        if not launch["killed"]:
            return {"launches": launches}  # it failed otherwise: nothing to go on from
        if point == "after-publish":
            newest += 1  # the killed save was complete and in place
    final = root / "final"
    fabric_worker(final, *fabric_config(final, "sharded"), "--ckpt-dir", ckpt, "--epochs", EPOCHS,
                  "--resume", ckpt / f"epoch={newest}.ckpt")
    return {"launches": launches, "final": final, "newest": newest, "ckpt": ckpt}


def _assert_chain_resumed_exactly(ref: Path, chain: dict) -> None:
    """Every kill happened; every resume restored the newest complete checkpoint exactly and left it as it was; the
    last launch ended as the uninterrupted run."""
    for launch in chain["launches"]:
        assert launch["killed"], f"{launch['kill']} was not killed:\n{launch['output']}"
        if launch["resumed"] is not None:
            assert launch["previous kept"], f"{launch['kill']}: the previous checkpoint changed"
            _assert_restored(ref, launch["run"], launch["resumed"])
    _assert_restored(ref, chain["final"], chain["newest"])
    assert_ranks_identical(ref / "out", "final", chain["final"] / "out", "final", parts=SHARDS_AND_OPTIMIZER)


def _assert_restored(ref: Path, run: Path, epoch: int) -> None:
    assert info(run / "out", "start")["epoch"] == epoch
    assert_ranks_identical(ref / "out", f"epoch{epoch}", run / "out", "start", parts=SHARDS_AND_OPTIMIZER)


@pytest.fixture(scope="module")
def shard_kills(tmp_path_factory):
    return _kill_chain(tmp_path_factory.mktemp("fabric-shard-kills"), SHARD_KILLS)


def test_killed_sharded_saves_leave_the_previous_checkpoint_loadable(fabric_reference, shard_kills):
    assert len(shard_kills["launches"]) == len(SHARD_KILLS)
    _assert_chain_resumed_exactly(fabric_reference("sharded"), shard_kills)


def test_a_killed_sharded_save_never_appears_at_its_path(shard_kills):
    if NATIVE:
        pytest.skip(f"native Lightning {VERSION} writes sharded checkpoints in place: a killed save leaves a partial one")
    visible = [(launch["kill"], launch["path"].name) for launch in shard_kills["launches"] if launch["exists"]]
    assert not visible, f"partial checkpoints at their paths: {visible}"


def test_the_next_save_removes_what_killed_saves_left(shard_kills):
    if NATIVE:
        pytest.skip(f"native Lightning {VERSION} writes sharded checkpoints in place and leaves nothing aside")
    assert sorted(p.name for p in shard_kills["ckpt"].iterdir()) == [f"epoch={e}.ckpt" for e in range(EPOCHS)]


def test_killed_publish_leaves_the_previous_checkpoint_loadable(fabric_reference, tmp_path):
    if NATIVE:
        pytest.skip(NO_PUBLISH)
    chain = _kill_chain(tmp_path, PUBLISH_KILLS)
    _assert_chain_resumed_exactly(fabric_reference("sharded"), chain)
    assert [launch["exists"] for launch in chain["launches"]] == [False, True], "before publishing: not in place; after: in place"


# --- other world sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 3])
def test_sharded_checkpoint_from_two_ranks_resumes_on_other_world_sizes(fabric_reference, tmp_path, ranks):
    """Shards differ by world size: right after loading, the gathered weights and optimizer state equal the 2-rank
    run's at the checkpoint."""
    ref = fabric_reference("sharded")
    fabric_worker(tmp_path, *fabric_config(tmp_path, "sharded"), "--epochs", RESUME_EPOCH + 2, "--resume",
                  ref / "ckpt" / RESUME, nproc=ranks)
    expected = load(ref / "out" / f"full_epoch{RESUME_EPOCH}.pt")
    restored = load(tmp_path / "out" / "full_start.pt")
    assert_identical(expected["params"], restored["params"], f"weights on {ranks} ranks")
    assert_identical(expected["optim"], restored["optim"], f"optimizer state on {ranks} ranks")
    assert info(tmp_path / "out", "start")["epoch"] == RESUME_EPOCH
