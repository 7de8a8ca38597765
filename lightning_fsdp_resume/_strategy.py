"""The checkpointing behaviour native Lightning 2.1 gave ``FSDPStrategy``, for Lightning 2.0.x.

Written as methods: ``self`` is the ``FSDPStrategy`` instance. Nothing here knows about patching; the
table in ``_patches`` puts these on the class. Works for ``lightning.pytorch`` and ``pytorch_lightning``
alike by touching Lightning only through the strategy object.
"""
import functools
import inspect
import secrets
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Set

from . import _atomic, _format, _verify
from . import _torch_compat as compat

_STATE_DICT_TYPES = ("full", "sharded")
StateDictType = Literal["full", "sharded"]


def wrap_init(original_init: Callable) -> Callable:
    """``FSDPStrategy(..., state_dict_type="full" | "sharded")``; Lightning 2.0.x would pass it to FSDP.

    The wrapper's signature is the original's plus ``state_dict_type``: LightningCLI (jsonargparse),
    ``inspect.signature`` and IDEs read it to learn what the class accepts.
    """

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, state_dict_type: StateDictType = "full", **kwargs: Any) -> None:
        if state_dict_type == "sharded" and not compat.supports_sharded_checkpoints():
            raise NotImplementedError(
                "Saving checkpoints with `FSDPStrategy(state_dict_type='sharded')` is not supported in PyTorch < 2.0."
                " Please upgrade `torch`."
            )
        original_init(self, *args, **kwargs)
        self._state_dict_type = state_dict_type

    __init__.__signature__ = _with_state_dict_type(inspect.signature(original_init))  # type: ignore[attr-defined]
    return __init__


def _with_state_dict_type(signature: inspect.Signature) -> inspect.Signature:
    """``signature`` with ``state_dict_type`` as a keyword parameter, before ``**kwargs`` if it has them."""
    added = inspect.Parameter("state_dict_type", inspect.Parameter.KEYWORD_ONLY, default="full", annotation=StateDictType)
    parameters = [p for p in signature.parameters.values() if p.name != "state_dict_type"]
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    return signature.replace(parameters=[*parameters[:at], added, *parameters[at:]])


def restore_checkpoint_after_setup(self: Any) -> bool:
    # Restore into the wrapped, sharded model: the full model is never materialised on every rank.
    return True


def lightning_restore_optimizer(self: Any) -> bool:
    # load_checkpoint() already restored the optimizers into their FSDP shards.
    return False


def load_model_state_dict(self: Any, checkpoint: Any) -> None:
    """Nothing to do: ``load_checkpoint()`` already loaded the weights into the FSDP module."""


def load_optimizer_state_dict(self: Any, checkpoint: Any) -> None:
    """Nothing to do: ``load_checkpoint()`` already loaded the optimizer states."""


def lightning_module_state_dict(self: Any) -> Dict[str, Any]:
    full = _is_full(self)
    state = compat.model_state_dict(self.model, full=full, offload=_offload(self))
    return _format.strip_prefix(state, _prefix(self))


def optimizer_state(self: Any, optimizer: Any) -> Dict[str, Any]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    full = _is_full(self)
    if not compat.supports_sharded_checkpoints():
        _warn_rank_zero(self, "FSDP in Lightning with PyTorch < 2.0 does not support saving the optimizer state.")
        return {}
    state = compat.optimizer_state_dict(self.model, optimizer, full=full, offload=_offload(self))
    state = _format.strip_optimizer_prefix(state, _prefix(self))
    if not full:
        return state
    if self.global_rank != 0 or not state:
        return {}
    # Standard PyTorch format (parameter ids), as a non-FSDP run writes it. Native 2.1.4 uses
    # FSDP.rekey_optim_state_dict here, which fails for flat parameters (use_orig_params=False).
    return _format.names_to_ids(state, _names_by_group(self, [group["params"] for group in state["param_groups"]]))


def save_checkpoint(self: Any, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
    """Write into a hidden partial sibling; rank 0 puts it at ``filepath`` once every rank has finished.

    Native 2.1.4 writes in place: a crash mid-save leaves a mix of old and new shards that loads.
    Here the previous checkpoint at ``filepath`` stays intact until the new one is complete.
    """
    if storage_options is not None:
        raise TypeError(
            "`FSDPStrategy.save_checkpoint(..., storage_options=...)` is not supported because"
            " `FSDPStrategy` does not use the `CheckpointIO`."
        )
    full = _is_full(self)
    # Every rank writes where rank 0 says, into the same partial directory.
    target, token = _broadcast(self, (str(filepath), secrets.token_hex(8)))
    path = Path(target)
    if path.is_dir() and not _format.is_replaceable_directory(path):
        raise IsADirectoryError(
            f"The checkpoint path exists and is a directory: {path}. It is not a sharded checkpoint, so saving"
            " would replace its contents. Choose another path or remove the directory."
        )
    partial = _atomic.partial_path(path, token)
    if full:
        if self.global_rank == 0:
            self.checkpoint_io.save_checkpoint(checkpoint, partial)
            _atomic.sync_file(partial)
            _publish(partial, path)
    else:
        partial.mkdir(parents=True, exist_ok=True)
        stored = {_format.MODEL_KEY: checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            stored[_format.optimizer_key(index)] = optimizer_state
        compat.save_distributed(stored, partial)
        if self.global_rank == 0:
            compat.save_file(checkpoint, partial / _format.METADATA_FILENAME)
        _barrier(self)  # every rank's shards are on disk
        if self.global_rank == 0:
            _publish(partial, path)
    _barrier(self)


def _publish(partial: Path, path: Path) -> None:
    """Rank 0: the complete save replaces ``path``; then the replaced checkpoint and any leftovers go."""
    _atomic.publish(partial, path)
    for leftover in _atomic.leftovers(path.parent):  # the replaced checkpoint is one of them
        _atomic.remove(leftover)


def load_checkpoint(self: Any, checkpoint_path: Any) -> Dict[str, Any]:
    # Every rank loads what rank 0 names, so all shards come from one checkpoint.
    path = Path(_broadcast(self, str(checkpoint_path)))
    # Rank 0 checks the files; every rank raises its verdict, so none waits in a collective.
    kind = _decided_on_rank_zero(self, _verify.checkpoint_kind, path)
    if kind == _verify.SHARDED:
        return _load_sharded(self, path)
    return _load_full(self, path)


def _load_sharded(self: Any, path: Path) -> Dict[str, Any]:
    prefix = _prefix(self)
    fitting = _fitting(self)
    shards = compat.read_shard_index(path)
    if fitting:
        _check_optimizer_count(self, _format.count_saved_optimizers(shards.state_dict_metadata), path)
    stored = _verify.stored_model_shapes(shards)
    shapes = compat.model_parameter_shapes(self.model)
    if shapes is not None:
        # Read each rank's elements straight into its flat parameters: no state-dict template.
        keys = _loadable_keys(self, path, _format.strip_prefix(shapes, prefix), stored, fitting)
        compat.read_model_into_shards(self.model, path, {prefix + key: f"{_format.MODEL_KEY}.{key}" for key in keys})
        model_state: Dict[str, Any] = {}  # only the torch < 2.5 optimizer loader reads it
    else:
        model_state = _format.strip_prefix(compat.model_state_dict(self.model, full=False, offload=False), prefix)
        keys = _loadable_keys(self, path, _verify.tensor_shapes(model_state), stored, fitting)
        container = {_format.MODEL_KEY: {key: value for key, value in model_state.items() if key in keys}}
        compat.load_distributed(container, path)
        model_state = container[_format.MODEL_KEY]
        compat.load_model_state_dict(self.model, _format.add_prefix(model_state, prefix), full=False, strict=_strict(self))
    if fitting:
        for index, optimizer in enumerate(self.optimizers):
            key = _format.optimizer_key(index)
            compat.load_sharded_optimizer_state(self.model, optimizer, model_state, key, path, shards, prefix)
    return _verify.read_meta(path)


def _load_full(self: Any, path: Path) -> Dict[str, Any]:
    checkpoint = _verify.read_full(path)
    prefix = _prefix(self)
    fitting = _fitting(self)
    optimizer_states = checkpoint.get("optimizer_states")
    if fitting:
        _check_optimizer_count(self, len(optimizer_states or []), path)
    state_dict = checkpoint.pop("state_dict")
    shapes = compat.model_parameter_shapes(self.model)
    direct = shapes is not None  # copy each rank's elements into its flat parameters, gathering nothing
    if not direct:
        # Only the global shapes are wanted: the sharded template goes at once.
        shapes = _verify.tensor_shapes(compat.model_state_dict(self.model, full=False, offload=False))
    keys = _loadable_keys(self, path, _format.strip_prefix(shapes, prefix), _verify.tensor_shapes(state_dict), fitting)
    state_dict = _format.add_prefix({key: value for key, value in state_dict.items() if key in keys}, prefix)
    if direct:
        compat.copy_model_into_shards(self.model, state_dict)
    else:
        compat.load_model_state_dict(self.model, state_dict, full=True, strict=_strict(self))
    if optimizer_states is None or not fitting:
        # validate/test/predict: weights are all there is to load.
        return checkpoint
    if not compat.supports_sharded_checkpoints():
        _warn_rank_zero(self, "FSDP in Lightning with PyTorch < 2.0 does not support loading the optimizer state.")
        return checkpoint
    for optimizer, state in zip(self.optimizers, optimizer_states):
        if _format.is_id_keyed(state):
            # Written by a non-FSDP run or by a full FSDP save: map ids to this optimizer's parameters.
            names = [[_format.strip_name(name, prefix) for name in group] for group in compat.optimizer_parameter_names(self.model, optimizer)]
            state = _format.ids_to_names(state, _names_by_group(self, names))
        compat.load_full_optimizer_state(self.model, optimizer, state, prefix)
    return checkpoint


# --- small helpers, all read-only ------------------------------------------------------------------


def _is_full(self: Any) -> bool:
    kind = getattr(self, "_state_dict_type", "full")
    if kind not in _STATE_DICT_TYPES:
        raise ValueError(f"Unknown state_dict_type: {kind}")
    return kind == "full"


def _fitting(self: Any) -> bool:
    return self.lightning_module.trainer.state.fn == "fit"


def _offload(self: Any) -> bool:
    """Offload gathered state to the CPU only from an accelerator: offloading CPU parameters crashes torch."""
    return any(param.device.type != "cpu" for param in self.model.parameters())


def _prefix(self: Any) -> str:
    """The name path from the FSDP-wrapped root to the LightningModule (2.0.x: ``_forward_module.``)."""
    for name, module in self.model.named_modules():
        if module is self.lightning_module:
            name = _format.clean_module_name(name)
            return f"{name}." if name else ""
    return ""


def _names_by_group(self: Any, groups: List[List[str]]) -> List[List[str]]:
    """Parameter names per group, in the order a non-FSDP optimizer over the same parameters numbers them."""
    groups = [list(names) for names in groups]
    if self.kwargs.get("use_orig_params", False):
        return groups  # the optimizer holds the original parameters in the user's order
    prefix = _prefix(self)
    modules = [_format.clean_module_name(name) for name, _ in self.model.named_modules()]
    modules = [name[len(prefix) :] if name.startswith(prefix) else name for name in modules]
    return [_format.in_module_order(names, modules) for names in groups]


def _check_optimizer_count(self: Any, saved: int, path: Path) -> None:
    if saved == 0 and self.optimizers:
        raise _verify.weights_only_error(path)
    if saved != len(self.optimizers):
        raise RuntimeError(
            f"You have configured {len(self.optimizers)} optimizers but the checkpoint contains {saved} optimizers"
            " to load. Please resume training with the same number of optimizers or edit the checkpoint manually"
            f" to remove states. (Checkpoint: {str(path)!r}.)"
        )


def _strict(self: Any) -> bool:
    """``LightningModule.strict_loading`` (the name native Lightning 2.2 uses), True unless set."""
    return bool(getattr(self.lightning_module, "strict_loading", True))


def _loadable_keys(self: Any, path: Path, expected: Dict[str, Any], stored: Dict[str, Any], fitting: bool) -> Set[str]:
    keys = _verify.loadable_keys(path, expected, stored, _strict(self))
    missing = sorted(set(expected) - keys)
    if fitting and missing and self.optimizers:
        raise RuntimeError(
            f"The checkpoint {str(path)!r} has no weights for {', '.join(missing[:8])}, so the optimizer states"
            " cannot be resumed. Resume with the model the checkpoint was written for."
        )
    return keys


def _decided_on_rank_zero(self: Any, check: Callable[..., Any], *args: Any) -> Any:
    """Run ``check`` on rank 0 and give every rank its result, or raise its error on every rank."""
    outcome: Any = (None, None)
    if self.global_rank == 0:
        try:
            outcome = (check(*args), None)
        except Exception as raised:  # whatever it is, the other ranks must hear of it rather than wait
            outcome = (None, raised)
    result, error = _broadcast(self, outcome)
    if error is not None:
        raise error
    return result


def _broadcast(self: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank. Lightning 2.0.x's ``broadcast`` needs a process group; native 2.1's,
    like this, returns ``obj`` in a process without one (a notebook, a unit test)."""
    return self.broadcast(obj) if compat.distributed() else obj


def _barrier(self: Any) -> None:
    """Lightning 2.0.x's ``barrier`` fails without a process group (its check tests a function, not its result)."""
    if compat.distributed():
        self.barrier()


def _warn_rank_zero(self: Any, message: str) -> None:
    if self.global_rank == 0:
        warnings.warn(message)
