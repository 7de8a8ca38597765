"""What the Trainer's and Fabric's FSDP strategies do alike when loading: the one load routine (``load``) that
takes the path rank 0 names, has rank 0 check the checkpoint, and loads one FSDP module with its optimizers
straight into their shards, from a sharded directory or a full file.

What differs between the two strategies is passed in: which checkpoint entries hold the module and the
optimizers, the module's name prefix, strictness, what else rank 0 checks. Nothing here knows about
patching or about the Trainer or Fabric.
"""
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple

from . import _background, _format, _remote, _shard_layout, _verify
from . import _torch_compat as compat
from ._ranks import broadcast, decided_on_rank_zero, raise_found_on_any_rank, warn_rank_zero
from ._remote import AnyPath


class Restore(NamedTuple):
    """What a load restores: one FSDP-wrapped module and the optimizers over its parameters."""

    module: Any  # the FSDP-wrapped root
    prefix: str  # the module's parameter names before the stored ones (Lightning 2.0.x: ``_forward_module.``)
    module_key: str  # the checkpoint entry holding the module's weights
    optimizers: Dict[str, Any]  # checkpoint entry -> optimizer to restore; empty: the weights only
    strict: bool  # refuse a checkpoint whose weights are not exactly the module's
    use_orig_params: bool  # the optimizers hold the original parameters, not FSDP's flat ones
    leniency: str = _verify.TRAINER_LENIENCY  # how to load anyway, said when ``strict`` refuses
    # restore the optimizers even where the checkpoint lacks weights (Fabric's strict=False: a filter= save
    # of the trainable weights); the Trainer's fit needs every weight the optimizers step
    optimizers_without_weights: bool = False
    # checkpoint entry -> a module without FSDP units beside the FSDP one (Fabric: an EMA copy, say), loaded whole
    modules: Mapping[str, Any] = {}


# rank 0's verdict on a path (and weights_only): the checkpoint's kind and whatever else the strategy checked
Check = Callable[[AnyPath, bool], Tuple[_format.StateDictType, Any]]
# (path, the number of optimizer states the checkpoint holds, the rest of rank 0's verdict) -> what to load
Plan = Callable[[AnyPath, int, Any], Restore]
# a full file's module and optimizer entries, taken out of it under the keys a sharded checkpoint stores them by
Take = Callable[[Dict[str, Any]], Dict[str, Any]]


def load(
    strategy: Any, path: Any, check: Check, plan: Plan, take: Take, required: Optional[str] = None, weights_only: bool = False,
) -> Dict[str, Any]:
    """Load the checkpoint at ``path`` into the module and optimizers that ``plan`` names; returns the rest of
    the checkpoint (a sharded one's ``meta.pt``, a full file less what ``take`` took; ``required``: an entry
    the full file must have). ``weights_only``: unpickle ``meta.pt`` or the full file as ``torch.load`` does
    with it (the shards are read by ``torch.distributed.checkpoint``).

    Every rank loads what rank 0 names, so all shards come from one checkpoint; rank 0 checks the files
    before anything is loaded and every rank raises its verdict, so none waits in a collective.
    """
    _background.wait(strategy)  # a save still writing: it may be the very checkpoint asked for
    target = broadcast(strategy, str(path))
    # rank 0 follows a URL's pointer once: every rank reads that data, even if a save commits another meanwhile
    resolved, kind, verdict = decided_on_rank_zero(strategy, _resolved_and_checked, target, check, weights_only)
    path = _remote.location(resolved, "load")
    if kind == _format.SHARDED:
        shards = compat.read_shard_index(path)
        restore = plan(path, _format.count_saved_optimizers(shards.state_dict_metadata), verdict)
        _shard_layout.drop_gathered_copies(restore.module)
        load_sharded(path, restore, shards)
        rest = _verify.read_meta(path, weights_only)
    else:
        rest = _verify.read_full(path, required, weights_only)
        stored = take(rest)
        restore = plan(path, _format.count_saved_optimizers(stored), verdict)
        optimizer_states = {key: stored[key] for key in restore.optimizers}
        other_states = {key: stored[key] for key in restore.modules}
        _shard_layout.drop_gathered_copies(restore.module)
        load_full(strategy, path, restore, stored[restore.module_key], optimizer_states, other_states)
    _check_in_place(path, restore.module)
    return rest


def _check_in_place(path: AnyPath, module: Any) -> None:
    """After a load, every FSDP unit's next forward computes with the shards it wrote; raised on every rank if not."""
    stale = _shard_layout.units_off_their_shards(module)
    found = None
    if stale:
        units = ", ".join(repr(name) if name else "the root" for name in stale)
        found = (
            f"The checkpoint {str(path)!r} was loaded into this rank's FSDP shards, but FSDP keeps a gathered copy of"
            f" other weights for {units} and would compute with it: the model would not run the checkpoint's weights."
            " Load the checkpoint in new processes (the model has not yet run a forward there), and report this"
            " with your torch release"
        )
    raise_found_on_any_rank(found)


def _resolved_and_checked(target: str, check: Check, weights_only: bool) -> Tuple[str, _format.StateDictType, Any]:
    path = _remote.resolve(_remote.location(target, "load"))
    kind, verdict = check(path, weights_only)
    return str(path), kind, verdict


def checked_kind(path: AnyPath, weights_only: bool) -> Tuple[_format.StateDictType, None]:
    """A ``Check`` that asks only for a complete checkpoint."""
    return _verify.checkpoint_kind(path, weights_only), None


def load_sharded(path: AnyPath, restore: Restore, shards: Any) -> None:
    """Load ``restore`` from the sharded checkpoint at ``path`` whose index (``.metadata``) is ``shards``."""
    module, prefix, key = restore.module, restore.prefix, restore.module_key
    stored = _verify.stored_model_shapes(shards, key)
    shapes = compat.model_parameter_shapes(module)
    if shapes is not None:
        # Read each rank's elements straight into its flat parameters: no state-dict template.
        keys = _loadable_keys(path, restore, _format.strip_prefix(shapes, prefix), stored)
        compat.read_model_into_shards(module, path, {prefix + name: f"{key}.{name}" for name in keys})
        model_state: Dict[str, Any] = {}  # only the torch < 2.5 optimizer loader reads it
    else:
        model_state = _format.strip_prefix(compat.model_state_dict(module, full=False, offload=False), prefix)
        keys = _loadable_keys(path, restore, _verify.tensor_shapes(model_state), stored)
        container = {key: {name: value for name, value in model_state.items() if name in keys}}
        compat.load_distributed(container, path)
        model_state = container[key]
        compat.load_model_state_dict(module, _format.add_prefix(model_state, prefix), full=False, strict=restore.strict)
    for optimizer_key, optimizer in restore.optimizers.items():
        compat.load_sharded_optimizer_state(module, optimizer, model_state, optimizer_key, path, shards, prefix)
    for other_key, other in restore.modules.items():
        # Saved whole by every rank (torch de-duplicates); every rank reads it whole.
        wanted = other.state_dict()
        keys = _other_module_keys(path, restore, wanted, _verify.stored_model_shapes(shards, other_key))
        container = {other_key: {name: value for name, value in wanted.items() if name in keys}}
        compat.load_distributed(container, path)
        other.load_state_dict(container[other_key], strict=restore.strict)


def load_full(
    strategy: Any, path: AnyPath, restore: Restore, state_dict: Dict[str, Any], optimizer_states: Dict[str, Any],
    other_states: Optional[Dict[str, Any]] = None,
) -> None:
    """Load ``restore`` from a full checkpoint's weights, optimizer states and other modules' state dicts (by
    checkpoint entry), which every rank passes whole (memory-mapped); each rank keeps its part."""
    other_states = other_states or {}
    module, prefix = restore.module, restore.prefix
    shapes = compat.model_parameter_shapes(module)
    direct = shapes is not None  # copy each rank's elements into its flat parameters, gathering nothing
    if not direct:
        # Only the global shapes are wanted: the sharded template goes at once.
        shapes = _verify.tensor_shapes(compat.model_state_dict(module, full=False, offload=False))
    keys = _loadable_keys(path, restore, _format.strip_prefix(shapes, prefix), _verify.tensor_shapes(state_dict))
    state_dict = _format.add_prefix({name: value for name, value in state_dict.items() if name in keys}, prefix)
    if direct:
        compat.copy_model_into_shards(module, state_dict)
    else:
        compat.load_model_state_dict(module, state_dict, full=True, strict=restore.strict)
    for other_key, other in restore.modules.items():
        stored = other_states[other_key]
        keys = _other_module_keys(path, restore, other.state_dict(), _verify.tensor_shapes(stored))
        other.load_state_dict({name: value for name, value in stored.items() if name in keys}, strict=restore.strict)
    if not restore.optimizers:
        return
    if not compat.supports_sharded_checkpoints():
        warn_rank_zero(strategy, "FSDP in Lightning with PyTorch < 2.0 does not support loading the optimizer state.")
        return
    for optimizer_key, optimizer in restore.optimizers.items():
        state = optimizer_states[optimizer_key]
        if _format.is_id_keyed(state):
            # Written by a non-FSDP run or by a full FSDP save: map ids to this optimizer's parameters.
            groups = compat.optimizer_parameter_names(module, optimizer)
            names = [[_format.strip_name(name, prefix) for name in group] for group in groups]
            state = _format.ids_to_names(state, names_by_group(restore, names))
        compat.load_full_optimizer_state(module, optimizer, state, prefix)


def names_by_group(restore: Restore, groups: List[List[str]]) -> List[List[str]]:
    """Parameter names per group, in the order a non-FSDP optimizer over the same parameters numbers them."""
    groups = [list(names) for names in groups]
    if restore.use_orig_params:
        return groups  # the optimizer holds the original parameters in the user's order
    prefix = restore.prefix
    modules = [_format.clean_module_name(name) for name, _ in restore.module.named_modules()]
    modules = [name[len(prefix) :] if name.startswith(prefix) else name for name in modules]
    return [_format.in_module_order(names, modules) for names in groups]


def _other_module_keys(path: AnyPath, restore: Restore, wanted: Dict[str, Any], stored: Dict[str, Any]) -> Set[str]:
    return _verify.loadable_keys(path, _verify.tensor_shapes(wanted), stored, restore.strict, restore.leniency)


def _loadable_keys(path: AnyPath, restore: Restore, expected: Dict[str, Any], stored: Dict[str, Any]) -> Set[str]:
    keys = _verify.loadable_keys(path, expected, stored, restore.strict, restore.leniency)
    missing = sorted(set(expected) - keys)
    if missing and restore.optimizers and not restore.optimizers_without_weights:
        raise RuntimeError(
            f"The checkpoint {str(path)!r} has no weights for {', '.join(missing[:8])}, so the optimizer states"
            " cannot be resumed. Resume with the model the checkpoint was written for."
        )
    return keys
