"""What the Trainer's and Fabric's FSDP strategies do alike: take ``state_dict_type``, put a save in place only
once it is complete, check a checkpoint on rank 0, and load one FSDP module with its optimizers into their
shards.

``strategy`` is either strategy object (``global_rank``, ``broadcast``, ``barrier``); what differs between
the two is passed in: which checkpoint entries hold the module and the optimizers, the module's name
prefix, strictness. Nothing here knows about patching or about the Trainer or Fabric.
"""
import functools
import inspect
import secrets
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, NamedTuple, Optional, Set, Tuple

from . import _atomic, _format, _verify
from . import _torch_compat as compat

STATE_DICT_TYPES = ("full", "sharded")
StateDictType = Literal["full", "sharded"]


def wrap_init(original_init: Callable, default: StateDictType, old_torch_error: Optional[str]) -> Callable:
    """``__init__(..., state_dict_type=default)``; Lightning 2.0.x would pass the argument on to FSDP.

    ``old_torch_error``: the ``NotImplementedError`` message for ``"sharded"`` on torch < 2.0 (None: no check
    here). The wrapper's signature is the original's plus ``state_dict_type``: LightningCLI (jsonargparse),
    ``inspect.signature`` and IDEs read it to learn what the class accepts.
    """

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, state_dict_type: StateDictType = default, **kwargs: Any) -> None:
        if old_torch_error and state_dict_type == "sharded" and not compat.supports_sharded_checkpoints():
            raise NotImplementedError(old_torch_error)
        original_init(self, *args, **kwargs)
        self._state_dict_type = state_dict_type

    signature = inspect.signature(original_init)
    __init__.__signature__ = with_keyword(signature, "state_dict_type", default, StateDictType)  # type: ignore[attr-defined]
    return __init__


def with_keyword(signature: inspect.Signature, name: str, default: Any, annotation: Any) -> inspect.Signature:
    """``signature`` plus the parameter ``name``: keyword-only before ``**kwargs`` where it has them (the
    wrapper takes it by keyword and passes the rest on), else last and positional too."""
    parameters = [p for p in signature.parameters.values() if p.name != name]
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if at is None else inspect.Parameter.KEYWORD_ONLY
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        kind = inspect.Parameter.KEYWORD_ONLY
    at = len(parameters) if at is None else at
    added = inspect.Parameter(name, kind, default=default, annotation=annotation)
    return signature.replace(parameters=[*parameters[:at], added, *parameters[at:]])


def is_full(strategy: Any) -> bool:
    kind = getattr(strategy, "_state_dict_type", "full")
    if kind not in STATE_DICT_TYPES:
        raise ValueError(f"Unknown state_dict_type: {kind}")
    return kind == "full"


def offload(module: Any) -> bool:
    """Offload gathered state to the CPU only from an accelerator: offloading CPU parameters crashes torch."""
    return any(param.device.type != "cpu" for param in module.parameters())


# --- saving: a checkpoint appears at its path only when complete ------------------------------------------


def write_sharded(strategy: Any, filepath: Any, stored: Dict[str, Any], metadata: Dict[str, Any]) -> None:
    """Every rank writes its shards of ``stored`` and rank 0 ``metadata`` (``meta.pt``) into a hidden partial
    sibling; rank 0 puts it at ``filepath`` once every rank has finished.

    Native 2.1.4 writes in place: a crash mid-save leaves a mix of old and new shards that loads. Here the
    previous checkpoint at ``filepath`` stays intact until the new one is complete.
    """
    path, partial = _destination(strategy, filepath)
    partial.mkdir(parents=True, exist_ok=True)
    compat.save_distributed(stored, partial)
    if strategy.global_rank == 0:
        compat.save_file(metadata, partial / _format.METADATA_FILENAME)
    barrier(strategy)  # every rank's shards are on disk
    if strategy.global_rank == 0:
        _publish(partial, path)
    barrier(strategy)


def write_full(strategy: Any, filepath: Any, write: Callable[[Path], None]) -> None:
    """Rank 0 ``write``s the whole checkpoint to a hidden partial sibling and puts it at ``filepath``."""
    path, partial = _destination(strategy, filepath)
    if strategy.global_rank == 0:
        partial.parent.mkdir(parents=True, exist_ok=True)  # as a sharded save and the Trainer's CheckpointIO do
        write(partial)
        _atomic.sync_file(partial)
        _publish(partial, path)
    barrier(strategy)


def _destination(strategy: Any, filepath: Any) -> Tuple[Path, Path]:
    """The path rank 0 names and the partial sibling every rank writes into."""
    target, token = broadcast(strategy, (str(filepath), secrets.token_hex(8)))
    path = Path(target)
    if path.is_dir() and not _format.is_replaceable_directory(path):
        raise IsADirectoryError(
            f"The checkpoint path exists and is a directory: {path}. It is not a sharded checkpoint, so saving"
            " would replace its contents. Choose another path or remove the directory."
        )
    return path, _atomic.partial_path(path, token)


def _publish(partial: Path, path: Path) -> None:
    """Rank 0: the complete save replaces ``path``; then the replaced checkpoint and any leftovers go."""
    _atomic.publish(partial, path)
    for leftover in _atomic.leftovers(path.parent):  # the replaced checkpoint is one of them
        _atomic.remove(leftover)


# --- loading: one FSDP module and its optimizers, straight into their shards --------------------------------


class Restore(NamedTuple):
    """What a load restores: one FSDP-wrapped module and the optimizers over its parameters."""

    module: Any  # the FSDP-wrapped root
    prefix: str  # the module's parameter names before the stored ones (Lightning 2.0.x: ``_forward_module.``)
    module_key: str  # the checkpoint entry holding the module's weights
    optimizers: Dict[str, Any]  # checkpoint entry -> optimizer to restore; empty: the weights only
    strict: bool  # refuse a checkpoint whose weights are not exactly the module's
    use_orig_params: bool  # the optimizers hold the original parameters, not FSDP's flat ones


def load_sharded(path: Path, restore: Restore, shards: Any) -> None:
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


def load_full(strategy: Any, path: Path, restore: Restore, state_dict: Dict[str, Any], optimizer_states: Dict[str, Any]) -> None:
    """Load ``restore`` from a full checkpoint's weights and optimizer states (by checkpoint entry), which
    every rank passes whole (memory-mapped); each rank keeps its part."""
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


def _loadable_keys(path: Path, restore: Restore, expected: Dict[str, Any], stored: Dict[str, Any]) -> Set[str]:
    keys = _verify.loadable_keys(path, expected, stored, restore.strict)
    missing = sorted(set(expected) - keys)
    if missing and restore.optimizers:
        raise RuntimeError(
            f"The checkpoint {str(path)!r} has no weights for {', '.join(missing[:8])}, so the optimizer states"
            " cannot be resumed. Resume with the model the checkpoint was written for."
        )
    return keys


# --- ranks -------------------------------------------------------------------------------------------------


def decided_on_rank_zero(strategy: Any, check: Callable[..., Any], *args: Any) -> Any:
    """Run ``check`` on rank 0 and give every rank its result, or raise its error on every rank."""
    outcome: Any = (None, None)
    if strategy.global_rank == 0:
        try:
            outcome = (check(*args), None)
        except Exception as raised:  # whatever it is, the other ranks must hear of it rather than wait
            outcome = (None, raised)
    result, error = broadcast(strategy, outcome)
    if error is not None:
        raise error
    return result


def broadcast(strategy: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank. Lightning 2.0.x's ``broadcast`` needs a process group; native 2.1's,
    like this, returns ``obj`` in a process without one (a notebook, a unit test)."""
    return strategy.broadcast(obj) if compat.distributed() else obj


def barrier(strategy: Any) -> None:
    """Lightning 2.0.x's ``barrier`` fails without a process group (its check tests a function, not its result)."""
    if compat.distributed():
        strategy.barrier()


def warn_rank_zero(strategy: Any, message: str) -> None:
    if strategy.global_rank == 0:
        warnings.warn(message)
