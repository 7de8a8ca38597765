"""Activation checkpointing: ``FSDPStrategy(activation_checkpointing=[nn.Linear])`` (Lightning 2.0.x; native 2.1+
takes ``activation_checkpointing_policy``) on 2 CPU ranks.

Lightning applies torch's ``checkpoint_wrapper`` after FSDP has wrapped the model, which puts
``_checkpoint_wrapped_module`` into module names (and, with ``use_orig_params=True``, into parameter names).
Checkpoints carry none of it, and they resume bit for bit with activation checkpointing switched either way.
On the CPU a run with it trains bit for bit as one without (the recomputed forward is the same arithmetic),
which the key tests check too: that is what makes the full files of the two runs comparable value for value.

Five launches of their own, beside the shared reference runs of test_multirank (conftest's ``reference``):
two uninterrupted runs with activation checkpointing and three resumes.
- sharded, saved with it and resumed without (``use_orig_params=True``: the one layout where the wrapper is in
  the parameter names the optimizer state is gathered by), and saved without and resumed with (flat parameters,
  where the shim maps names through the wrapped module tree itself).
- full, one direction: saved without, resumed with. The other direction needs no resume of its own: the key test
  shows that the full file written with activation checkpointing equals the one written without it, weights and
  optimizer state bit for bit, so resuming it is resuming the plain file (test_multirank's full resume). Its
  ``use_orig_params`` is the one the shared full reference runs use (False where the shim patches, whose id
  numbering of flat parameters follows the module tree).
On torch 2.2 the ``use_orig_params=True`` cases skip (torch cannot gather that optimizer state on the CPU there).
That numbering through wrapper names is checked in one process too, on a module tree where a slip would show.
"""
import functools

import pytest

from lightning_fsdp_resume._save_load import _loading
from lightning_fsdp_resume._storage import checked, open_path
from support.marks import needs_cpu_fsdp, skip_without_optimizer_state
from support.ranks import EPOCHS, FULL_USE_ORIG_PARAMS, MID, config, worker
from support.states import assert_identical, load

ACTIVATION_CHECKPOINTING = "--activation-checkpointing"  # the worker's flag: every nn.Linear wrapped
CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."
# What no stored name may hold: torch's activation-checkpoint and FSDP wrappers, Lightning 2.0.x's module wrapper
WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_forward_module", "_flat_param")


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """Uninterrupted 2-rank runs with activation checkpointing, one per configuration, made on first use."""

    @functools.lru_cache(maxsize=None)
    def run(state_dict_type: str, use_orig_params: int):
        root = tmp_path_factory.mktemp(f"ac-{state_dict_type}-{use_orig_params}")
        worker(root, *config(root, state_dict_type, use_orig_params), "--max-epochs", EPOCHS, ACTIVATION_CHECKPOINTING)
        return root

    return run


def _unwrapped(record: dict) -> dict:
    """A record with torch's checkpoint wrapper left out of its parameter names (``use_orig_params=True`` and the
    full weights, which are named by the LightningModule's own, wrapped, module tree)."""
    return {**record, "params": {name.replace(CHECKPOINT_WRAPPER, ""): t for name, t in record["params"].items()}}


def _assert_same_states(expected_dir, expected_name: str, actual_dir, actual_name: str) -> None:
    """Every rank's parameter shards and raw optimizer state, and the full weights and optimizer state that torch
    gathers on rank 0, bit for bit."""
    pairs = [(f"{expected_name}_rank{rank}.pt", f"{actual_name}_rank{rank}.pt") for rank in (0, 1)]
    pairs.append((f"full_{expected_name}.pt", f"full_{actual_name}.pt"))
    for expected_file, actual_file in pairs:
        expected = _unwrapped(load(expected_dir / expected_file))
        assert expected["params"] and expected["optim"], f"{expected_file} holds no weights or optimizer state"
        assert_identical(expected, _unwrapped(load(actual_dir / actual_file)), f"{expected_file} vs {actual_file}")


def _wrapped_layers(out, name: str) -> bool:
    """Whether the run's layers were wrapped for activation checkpointing (its full weights are named by its
    module tree): a guard against a flag that silently does nothing."""
    return any(CHECKPOINT_WRAPPER in weight for weight in load(out / f"full_{name}.pt")["params"])


def _strings(tree) -> set:
    """Every string among the keys and values of nested dicts, lists and tuples."""
    if isinstance(tree, dict):
        return {s for key, value in tree.items() for s in _strings(key) | _strings(value)}
    if isinstance(tree, (list, tuple)):
        return {s for value in tree for s in _strings(value)}
    return {tree} if isinstance(tree, str) else set()


def _wrapped(names) -> list:
    return sorted(name for name in names if any(wrapper in name for wrapper in WRAPPER_NAMES))


@pytest.mark.multirank
@needs_cpu_fsdp
@pytest.mark.parametrize("state_dict_type,use_orig_params", [("sharded", 1), ("full", FULL_USE_ORIG_PARAMS)])
def test_checkpoints_carry_no_wrapper_names(reference, checkpointed, state_dict_type, use_orig_params):
    """A checkpoint written with activation checkpointing names everything as one written without: a sharded
    one's index (``.metadata``) lists the same keys, a full file holds the same weights and optimizer state."""
    skip_without_optimizer_state(use_orig_params)
    plain, wrapped = reference(state_dict_type, use_orig_params), checkpointed(state_dict_type, use_orig_params)
    assert _wrapped_layers(wrapped / "out", "epoch1") and not _wrapped_layers(plain / "out", "epoch1")
    _assert_same_states(plain / "out", "epoch1", wrapped / "out", "epoch1")  # the same training
    if state_dict_type == "sharded":
        expected, stored = (set(checked.index(open_path(run / "ckpt" / MID, "load")).state_dict_metadata) for run in (plain, wrapped))
        assert not _wrapped(stored)
        assert stored == expected
        return
    expected, saved = (load(run / "ckpt" / MID) for run in (plain, wrapped))
    assert not _wrapped(_strings({"state_dict": saved["state_dict"], "optimizer_states": saved["optimizer_states"]}))
    assert list(saved["state_dict"]) == list(expected["state_dict"])
    assert_identical(expected["state_dict"], saved["state_dict"], "full weights")
    assert_identical(expected["optimizer_states"], saved["optimizer_states"], "full optimizer states")


@pytest.mark.multirank
@needs_cpu_fsdp
@pytest.mark.parametrize("state_dict_type,use_orig_params,saved_with", [
    pytest.param("sharded", 1, True, id="sharded-saved-with-resumed-without"),
    pytest.param("sharded", 0, False, id="sharded-saved-without-resumed-with"),
    pytest.param("full", FULL_USE_ORIG_PARAMS, False, id="full-saved-without-resumed-with"),
])
def test_resume_across_activation_checkpointing(reference, checkpointed, tmp_path, state_dict_type, use_orig_params, saved_with):
    """Resumed in new processes from the checkpoint after epoch 1 with activation checkpointing switched the
    other way, the restored and final states are the writing run's, bit for bit."""
    skip_without_optimizer_state(use_orig_params)
    writer = (checkpointed if saved_with else reference)(state_dict_type, use_orig_params)
    switched = [] if saved_with else [ACTIVATION_CHECKPOINTING]
    worker(tmp_path, *config(tmp_path, state_dict_type, use_orig_params), "--max-epochs", EPOCHS,
           "--ckpt-path", writer / "ckpt" / MID, *switched)
    assert _wrapped_layers(tmp_path / "out", "start") is not saved_with
    _assert_same_states(writer / "out", "epoch1", tmp_path / "out", "start")
    _assert_same_states(writer / "out", "final", tmp_path / "out", "final")


def test_flat_parameters_are_numbered_through_checkpoint_wrappers():
    """A full checkpoint numbers the optimizer state of flat parameters in module registration order, which the
    shim reads from the module tree; torch's checkpoint wrapper puts ``_checkpoint_wrapped_module`` into it (inside
    an FSDP unit when the checkpointed class is the one FSDP wraps, a transformer block say). Here the wrapped
    block is registered first, so a wrapper name left in the tree would number its parameters last. The 2-rank
    runs cannot show this: their model registers its wrapped layers in an order that hides it."""
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = nn.Module()
    model.block = nn.Sequential(nn.Linear(2, 2))
    model.head = nn.Linear(2, 2)
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, nn.Sequential))
    assert "block._checkpoint_wrapped_module.0" in dict(model.named_modules())
    restore = _loading.Restore(module=model, prefix="", module_key="model", optimizers={}, strict=True)
    flat = [["head.weight", "head.bias", "block.0.weight", "block.0.bias"]]  # FSDP's order: the root unit's first
    assert _loading.names_by_group(restore, flat) == [["block.0.weight", "block.0.bias", "head.weight", "head.bias"]]
