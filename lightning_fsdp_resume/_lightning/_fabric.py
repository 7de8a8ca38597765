"""The checkpointing native Fabric 2.1 gave its ``FSDPStrategy`` and ``Fabric``, for Fabric 2.0.x (both flavours), as
methods: ``self`` is the strategy (``save_checkpoint``, ``load_checkpoint``) or the ``Fabric`` (``save``, ``load``,
``load_raw``). Nothing here knows about patching: the tables in ``_patches`` put these on the classes.
"""
import functools
import importlib
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Set, Tuple

from .. import _storage
from .._checkpoint import _format, _preflight, _reader
from .._patching import _signature
from .._patching import _torch_compat as compat
from .._save_load import _loading, _saving
from .._storage import Location
from . import _lightning_reads

# Native Fabric 2.1 refuses FSDP checkpoints on torch < 2.0 at save and load, not in __init__.
OLD_TORCH_ERROR = "Saving and loading checkpoints with the `FSDPStrategy` is not supported in PyTorch < 2.0. Please upgrade `torch`."


def wrap_init(original_init: Callable) -> Callable:
    """``FSDPStrategy(..., state_dict_type="sharded" | "full", async_save=False)``: ``"sharded"`` by default as in
    native Fabric 2.1 (the Trainer's default is ``"full"``); ``async_save=True`` saves in the background (the
    Trainer's switch is Lightning's ``AsyncCheckpointIO``)."""
    return _signature.wrap_init(original_init, default="sharded", old_torch_error=None, async_save=True)


# --- the strategy ------------------------------------------------------------------------------------------


def save_checkpoint(
    self: Any, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
    filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None,
) -> None:
    """Sharded: a directory with each module and optimizer under its key, plus ``meta.pt`` with the rest.
    Full: one file gathered on rank 0. Either appears at ``path`` only once complete."""
    from torch.nn import Module
    from torch.optim import Optimizer

    _refuse_old_torch()
    _storage.open_path(path, "save")  # before the state is checked: a URL no fsspec implementation serves is refused first
    _saving.refuse_storage_options(storage_options)
    kind = _saving.state_dict_type(self)
    full = kind == _format.FULL
    if filter is not None and not full:
        raise NotImplementedError(
            "FSDP doesn't support loading sharded filtered checkpoints, so saving them is disabled."
            " Save with `FSDPStrategy(state_dict_type='full')` to filter."
        )
    module_key, module = _the_fsdp_module(state, "save", path)
    offload = _saving.offload(module) if full else False
    stored: Dict[str, Any] = {}
    metadata: Dict[str, Any] = {}
    for key, obj in state.items():
        if obj is module:
            converted, into = _saving.model_state(obj, kind, offload=offload), stored
        elif isinstance(obj, Module):  # a module without FSDP units beside the FSDP one: its own state dict
            converted, into = compat.model_state_dict(obj, full=full, offload=offload), stored
        elif isinstance(obj, Optimizer):
            converted, into = _saving.optimizer_state(module, obj, kind, offload=offload), stored
        else:
            converted, into = (obj.state_dict() if _is_stateful(obj) else obj), metadata
        _keep(key, (filter or {}).get(key), converted, into)
    optimizers = [obj for obj in state.values() if isinstance(obj, Optimizer)]
    # full: rank 0 alone holds the gathered entries, and only it writes
    saved = (_saving.Checkpoint(kind, {**stored, **metadata}, {}, (module, optimizers)) if full
             else _saving.Checkpoint(kind, stored, metadata, (module, optimizers), rank_zeros=(module_key,)))
    _saving.save(self, path, saved, background=getattr(self, "_async_save", False))


def wrap_optimizer_step(original_optimizer_step: Callable) -> Callable:
    """After an optimizer's first step, where saves are written in the background (``async_save=True``), their host
    buffers are made in a thread."""
    return _saving.preparing_background_saves(original_optimizer_step, lambda self: getattr(self, "_async_save", False))


def load_checkpoint(
    self: Any, path: Any, state: Any = None, strict: bool = True, weights_only: Optional[bool] = None,
) -> Dict[str, Any]:
    """Restore the module and optimizers of ``state`` into their shards, other stateful entries in place and
    plain values by key; returns what the checkpoint holds beyond ``state``. ``state`` may be a module alone
    (``Fabric.load_raw``): its weights from a full file. ``weights_only`` (Fabric 2.6's): ``False`` trusts the
    checkpoint's pickles to run any code; ``None`` (the default) and ``True`` unpickle every one restricted
    (``_unpickling``), before anything loads."""
    from torch.nn import Module
    from torch.optim import Optimizer

    _refuse_old_torch()
    _storage.open_path(path, "load")
    if not state:
        raise ValueError(
            f"Got FSDPStrategy.load_checkpoint(..., state={state!r}) but a state with at least  a model instance to"
            " reload is required. Pass it in like so: FSDPStrategy.load_checkpoint(..., state={'model': model, ...})"
        )
    if isinstance(state, Module):
        _load_raw_module(self, path, state, strict, weights_only)
        return {}
    if isinstance(state, Optimizer):
        raise NotImplementedError(
            "Loading a single optimizer object from a checkpoint is not supported yet with the FSDP strategy."
            f" Load it with its model: `fabric.load({str(path)!r}, {{'model': model, 'optimizer': optimizer}})`."
        )
    module_key, module = _the_fsdp_module(state, "load", path)
    request = _FabricLoad(state, module_key, module, strict, weights_only)
    remainder = _loading.load(self, path, request)
    for key in request.other_keys:
        if key in remainder:
            _put(state, key, remainder.pop(key))
    return remainder


def _load_raw_module(self: Any, path: Any, module: Any, strict: bool, weights_only: Optional[bool]) -> None:
    """``Fabric.load_raw(path, module)``: a file holding the module's state dict, loaded into its shards."""
    _loading.load(self, path, _RawLoad(module, strict, weights_only))


class _RawLoad(_loading.Request):
    """``load_raw``: one file of a module's state dict."""

    def __init__(self, module: Any, strict: bool, weights_only: Optional[bool]) -> None:
        super().__init__(weights_only)
        self.module, self.strict = module, strict

    def check(self, path: Location) -> Tuple[_format.StateDictType, None]:
        refusal = "Failed to load checkpoint directly into the model. The given path must be a single file containing the full state dict"
        entry = path.stat()
        if entry is None:
            raise _preflight.MissingCheckpointError(f"{refusal}: {path}. It does not exist.")
        if entry.is_dir:
            sharded = any(name in path.listing() for name in (_format.METADATA_FILENAME, _format.DCP_METADATA_FILENAME))
            advice = "load it with `fabric.load(path, {'model': model})` instead" if sharded else "pass the state dict's file"
            raise ValueError(f"{refusal}: {path}. It is a {'sharded checkpoint ' if sharded else ''}directory: {advice}.")
        return super().check(path)

    def plan(self, path: Location, saved_optimizers: int, verdict: Any) -> _loading.Restore:
        return _loading.Restore(
            module=self.module, prefix="", module_key="", optimizers={}, strict=self.strict, leniency=_preflight.FABRIC_LENIENCY,
        )

    def take(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        return {"": checkpoint}


class _FabricLoad(_loading.Request):
    """``fabric.load(path, state)``: the FSDP module under ``module_key``, the optimizers and the modules without FSDP
    units beside it, each under its key; rank 0 checks that the checkpoint holds what ``state`` asks for."""

    def __init__(self, state: Mapping[str, Any], module_key: str, module: Any, strict: bool,
                 weights_only: Optional[bool]) -> None:
        from torch.nn import Module
        from torch.optim import Optimizer

        super().__init__(weights_only)
        self.state, self.module_key, self.module, self.strict = state, module_key, module, strict
        self.optimizer_keys = [key for key, obj in state.items() if isinstance(obj, Optimizer)]
        # modules without FSDP units: a sharded save stores them with the shards, so they are loaded from there too
        self.module_keys = [key for key, obj in state.items() if isinstance(obj, Module) and key != module_key]
        taken = {module_key, *self.optimizer_keys, *self.module_keys}
        self.other_keys = [key for key in state if key not in taken]  # plain values and other stateful entries
        self.requested = self.optimizer_keys + self.module_keys + self.other_keys

    def check(self, path: Location) -> Tuple[_format.StateDictType, Set[str]]:
        """Rank 0: the checkpoint's kind and entries, once it is complete and holds what ``state`` asks for."""
        kind, _ = super().check(path)
        entries = _reader.entries(path, kind)
        module_key = self.module_key
        missing = [key for key in [module_key, *self.requested] if key not in entries]
        if module_key in missing or (self.strict and missing):
            advice = (
                "To disable strict loading, set `strict=False`." if self.strict
                else f"The FSDP model's entry is needed even with `strict=False`: load a checkpoint that holds {module_key!r}."
            )
            raise KeyError(
                f"The requested state contains a key '{missing[0]}' that does not exist in the loaded checkpoint."
                f" {advice} (Checkpoint: {str(path)!r}, which holds {', '.join(sorted(entries))}.)"
            )
        if missing:  # strict=False: said once, on rank 0; an optimizer left as it is resumes from a fresh state
            warnings.warn(
                f"fabric.load(strict=False): the checkpoint {str(path)!r} holds no {', '.join(map(repr, missing))}; left as"
                f" {'it is' if len(missing) == 1 else 'they are'}."
            )
        return kind, entries

    def plan(self, path: Location, saved_optimizers: int, entries: Set[str]) -> _loading.Restore:
        return _loading.Restore(
            module=self.module,
            prefix="",  # Fabric wraps the FSDP module from outside: its names are the user's
            module_key=self.module_key,
            optimizers={key: self.state[key] for key in self.optimizer_keys if key in entries},
            strict=self.strict,
            leniency=_preflight.FABRIC_LENIENCY,
            modules={key: self.state[key] for key in self.module_keys if key in entries},
            optimizers_without_weights=not self.strict,
        )

    def take(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        keys = [self.module_key, *self.optimizer_keys, *self.module_keys]
        return {key: checkpoint.pop(key) for key in keys if key in checkpoint}


def _the_fsdp_module(state: Mapping[str, Any], verb: str, path: Any) -> Tuple[str, Any]:
    """The one entry of ``state`` that is (or holds) an FSDP module, and its key; ``verb``: save or load."""
    doing = {"save": "saving", "load": "loading"}[verb]
    modules = [(key, obj) for key, obj in state.items() if _has_fsdp_modules(obj)]
    if not modules:
        raise ValueError(
            "Could not find a FSDP model in the provided checkpoint state. Please provide the model as"
            f" part of the state like so: `{verb}_checkpoint(..., state={{'model': model, ...}})`. Make sure"
            f" you set up the model (and optimizers if any) through the strategy before {doing} the checkpoint."
            f" (Checkpoint: {str(path)!r}.)"
        )
    if len(modules) > 1:
        raise ValueError(
            f"Found multiple FSDP models in the given state. {doing.capitalize()} checkpoints with FSDP is"
            f" currently limited to a single model per checkpoint. To {verb} multiple models, call the {verb} method"
            " for each model separately with a different path."
            f" (Checkpoint: {str(path)!r}; FSDP models under {', '.join(repr(key) for key, _ in modules)}.)"
        )
    return modules[0]


def _has_fsdp_modules(obj: Any) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn import Module

    return isinstance(obj, Module) and any(isinstance(module, FullyShardedDataParallel) for module in obj.modules())


def _is_stateful(obj: Any) -> bool:
    """Fabric's stateful protocol: ``state_dict()`` and ``load_state_dict()`` (an LR scheduler, say)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _keep(key: str, keep: Optional[Callable[[str, Any], bool]], converted: Any, into: Dict[str, Any]) -> None:
    """``into[key] = converted``, or with ``fabric.save(filter=...)`` only the items of ``converted`` it keeps."""
    if keep is None or not isinstance(converted, dict):
        into[key] = converted
        return
    kept = {name: value for name, value in converted.items() if keep(name, value)}
    if kept:
        into[key] = kept


def _put(state: Dict[str, Any], key: str, value: Any) -> None:
    """Restore a stateful object in place; replace a plain value. (Native 2.1.4's sharded load replaces a
    stateful object, an LR scheduler say, with its state dict.)"""
    if _is_stateful(state.get(key)):
        state[key].load_state_dict(value)
    else:
        state[key] = value


def refuse_checkpoint_io(original: Any) -> property:
    """``checkpoint_io``: Fabric 2.0.x accepted a ``CheckpointIO`` for FSDP and never used it, and answered with a
    ``TorchCheckpointIO`` it never used either; native 2.1 raises on reading it, and refuses one when it is set (by
    ``Fabric(plugins=[...])`` or ``FSDPStrategy(checkpoint_io=...)``, which Fabric sets)."""

    def getter(self: Any) -> Any:
        raise NotImplementedError(
            f"The `{type(self).__name__}` does not use the `CheckpointIO` plugin interface: it saves and loads through"
            " torch.distributed.checkpoint itself."
        )

    def setter(self: Any, io: Any) -> None:
        if io is not None:
            raise NotImplementedError(
                f"The `{type(self).__name__}` does not support setting a `CheckpointIO` plugin. It saves and loads"
                " through torch.distributed.checkpoint itself: remove the plugin."
            )
        original.fset(self, io)

    return property(getter, setter, original.fdel, original.__doc__)


def _refuse_old_torch() -> None:
    if not compat.supports_sharded_checkpoints():
        raise NotImplementedError(OLD_TORCH_ERROR)


# --- Fabric: the new arguments reach a strategy that takes them ------------------------------------------------


def wrap_save(original_save: Callable) -> Callable:
    """``Fabric.save(path, state, filter=None)``: Fabric 2.0.x has no ``filter``."""

    @functools.wraps(original_save)
    def save(self: Any, path: Any, state: Dict[str, Any], filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        _check_filter(filter, state)
        if not compat.takes(self._strategy.save_checkpoint, "filter"):
            if filter is not None:
                raise NotImplementedError(_only_fsdp(self, "save(..., filter=...)"))
            return original_save(self, path, state)
        self._strategy.save_checkpoint(path=path, state=_unwrap(self, state), filter=filter)
        self.barrier()
        return None

    save.__signature__ = _signature.with_keyword(original_save, "filter", None, Optional[Dict[str, Callable[[str, Any], bool]]])  # type: ignore[attr-defined]
    return save


def wrap_load(original_load: Callable) -> Callable:
    """``Fabric.load(path, state=None, strict=True)``: Fabric 2.0.x has no ``strict`` and hands the FSDP
    strategy the wrapped module; non-stateful entries of ``state`` are updated in the caller's dict."""

    @functools.wraps(original_load)
    def load(
        self: Any, path: Any, state: Optional[Dict[str, Any]] = None, strict: bool = True, *, weights_only: Optional[bool] = None,
    ) -> Dict[str, Any]:
        if not compat.takes(self._strategy.load_checkpoint, "strict"):
            _refuse_new_arguments(self, "load", strict, weights_only)
            return original_load(self, path, state)
        unwrapped = _unwrap(self, state)
        given = dict(unwrapped or {})
        remainder = self._strategy.load_checkpoint(path=path, state=unwrapped, strict=strict, weights_only=weights_only)
        self.barrier()
        if state is not None:
            # Unwrapping made a new dict (and new lists, dicts and tuples in it): every value the load put
            # in it goes back into the caller's; the wrappers of what it loaded in place see the change.
            for key, value in unwrapped.items():
                if value is not given[key]:
                    state[key] = value
                else:
                    _refresh_wrapper(state[key])
        return remainder

    with_strict = _signature.with_keyword(original_load, "strict", True, bool)
    load.__signature__ = _signature.with_keyword(with_strict, "weights_only", None, Optional[bool], keyword_only=True)  # type: ignore[attr-defined]
    return load


def load_raw(self: Any, path: Any, obj: Any, strict: bool = True, *, weights_only: Optional[bool] = None) -> None:
    """``Fabric.load_raw``: a module's or optimizer's own state dict from one file (saved without Fabric)."""
    wrapper, obj = obj, _unwrap(self, obj)
    if compat.takes(self._strategy.load_checkpoint, "strict"):
        self._strategy.load_checkpoint(path=path, state=obj, strict=strict, weights_only=weights_only)
        return
    _refuse_new_arguments(self, "load_raw", True, weights_only)
    from torch.nn import Module
    from torch.nn.parallel import DistributedDataParallel

    # other strategies of 2.0.x: what native 2.1's base one does, through the strategy's CheckpointIO
    source = _lightning_reads.sharded_directory(path)
    if source is not None:
        _RawLoad(obj, strict, weights_only).check(source)  # a sharded checkpoint holds no single state dict: refused
    state = self._strategy.checkpoint_io.load_checkpoint(path)
    if isinstance(obj, DistributedDataParallel):
        obj = obj.module  # the state dict is the module's own, without DDP's "module." prefix
    if isinstance(obj, Module):
        obj.load_state_dict(state, strict=strict)
    else:
        obj.load_state_dict(state)
        _refresh_wrapper(wrapper)


def _check_filter(filter: Any, state: Dict[str, Any]) -> None:
    if filter is None:
        return
    if not isinstance(filter, dict):
        raise TypeError(f"Filter should be a dictionary, given {filter!r}")
    if not set(filter).issubset(state):
        raise ValueError(f"The filter keys {filter.keys() - state} are not present in the state keys {set(state)}.")
    for key, keep in filter.items():
        if not callable(keep):
            raise TypeError(f"Expected `fabric.save(filter=...)` for key {key!r} to be a callable, given {keep!r}")


def _refuse_new_arguments(fabric: Any, method: str, strict: bool, weights_only: Optional[bool]) -> None:
    """A strategy other than the patched FSDP one loads as 2.0.x does: it has neither argument."""
    if not strict:
        raise NotImplementedError(_only_fsdp(fabric, f"{method}(..., strict=False)"))
    if weights_only is not None:
        raise NotImplementedError(_only_fsdp(fabric, f"{method}(..., weights_only=...)"))


def _only_fsdp(fabric: Any, call: str) -> str:
    return (
        f"`fabric.{call}` needs Lightning 2.1; on Lightning 2.0.x lightning_fsdp_resume adds it to `FSDPStrategy`"
        f" only, and this Fabric uses `{type(fabric._strategy).__name__}`."
    )


def _unwrap(fabric: Any, obj: Any) -> Any:
    """``obj`` (or a collection of them) without Fabric's wrappers, by the namespace's own ``_unwrap_objects``."""
    for klass in type(fabric).__mro__:
        if klass.__name__ == "Fabric" and klass.__module__.endswith(".fabric"):
            wrappers = importlib.import_module(klass.__module__[: -len("fabric")] + "wrappers")
            return wrappers._unwrap_objects(obj)
    raise TypeError(f"{type(fabric).__qualname__} is not a Fabric")


def _refresh_wrapper(obj: Any) -> None:
    """Fabric 2.0.x's optimizer wrapper holds a copy of the optimizer's attributes. Loading into the optimizer
    itself replaces its ``state`` and ``param_groups``: without this, an LR scheduler made on the wrapper (as
    Fabric's docs do) sets the learning rate of stale groups. 2.0.6 to 2.0.9 renew the copy with ``_refresh``;
    2.0.0 to 2.0.5 have none, so the two attributes are copied here. Fabric 2.1's wrapper delegates every
    attribute and has neither."""
    from torch.optim import Optimizer

    inner = getattr(obj, "_optimizer", None)
    if not isinstance(obj, Optimizer) or not isinstance(inner, Optimizer) or "param_groups" not in vars(obj):
        return
    refresh = getattr(obj, "_refresh", None)
    if callable(refresh):
        refresh()
    else:
        obj.__dict__.update(state=inner.state, param_groups=inner.param_groups)


