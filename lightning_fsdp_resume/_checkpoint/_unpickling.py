"""Reading pickles from a checkpoint without running what its author may have hidden in them (``os.system``, say): every
pickle the package reads goes through one restricted unpickler, on every torch, unless ``weights_only=False``. What it
admits (``ADMITTED``, ``RULED``, safe globals): docs/behaviour.md#checkpoints-you-did-not-write.
"""
import _compat_pickle
import functools
import io
import pickle
import types
from typing import Any, Dict, Iterable, List, Optional

from .._patching import _torch_compat as compat

# What a checkpoint of Lightning 2.0 to 2.6, of torch's optimizers and schedulers and of this package holds besides
# what torch's own weights_only unpickler admits: plain containers and values, Lightning's hyper-parameter
# containers, the paths callbacks keep, and the callables pickle rebuilds plain objects with (they construct only
# classes that were themselves admitted).
ADMITTED = frozenset({
    "builtins.bool", "builtins.bytearray", "builtins.bytes", "builtins.complex", "builtins.dict", "builtins.float",
    "builtins.frozenset", "builtins.int", "builtins.list", "builtins.object", "builtins.range", "builtins.set",
    "builtins.slice", "builtins.str", "builtins.tuple", "builtins.Ellipsis",
    "_codecs.encode",
    "copyreg._reconstructor", "copyreg.__newobj__", "copyreg.__newobj_ex__",
    "collections.OrderedDict", "collections.defaultdict", "collections.Counter", "collections.deque",
    "argparse.Namespace",
    "pathlib.Path", "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePath", "pathlib.PurePosixPath",
    "pathlib.PureWindowsPath", "pathlib._local.Path", "pathlib._local.PosixPath", "pathlib._local.WindowsPath",
    "pathlib._local.PurePath", "pathlib._local.PurePosixPath", "pathlib._local.PureWindowsPath",
    # save_hyperparameters' container, in each flavour and where older releases defined it
    "lightning.fabric.utilities.data.AttributeDict", "lightning_fabric.utilities.data.AttributeDict",
    "lightning.pytorch.utilities.parsing.AttributeDict", "pytorch_lightning.utilities.parsing.AttributeDict",
    "torch.Size", "torch.device", "torch.Tensor", "torch.nn.parameter.Parameter",
})

# Modules whose names are admitted by what they resolve to (``_ruled``): imported only for a name of theirs.
RULED = (
    "torch",
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint._fsspec_filesystem",  # torch 2.1 to 2.3: the fsspec storage's own _StorageInfo
    "torch.distributed._shard.sharded_tensor.metadata",
    "torch.distributed._shard.metadata",
)

_added: List[Any] = []  # this package's add_safe_globals, for a torch without its own


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint's pickle names a callable that is not admitted: it was refused before anything ran. A
    ``ValueError`` too, as every other refusal of a checkpoint is."""

    def __init__(self, source: str, name: str) -> None:
        self.source, self.name = source, name
        if compat.has_safe_globals():
            admit = f"`torch.serialization.add_safe_globals([{name}])`"
        else:
            admit = f"`lightning_fsdp_resume.add_safe_globals([{name}])`"
        super().__init__(
            f"Refused to unpickle {source}: it names `{name}`, which is none of what Lightning, torch and"
            f" lightning_fsdp_resume put into checkpoints, and unpickling it could run any code. Nothing was loaded."
            f" If you trust the source of this checkpoint, load it with `weights_only=False`; to admit only this"
            f" type, call {admit} before loading.")

    def __reduce__(self) -> Any:  # the other ranks receive it pickled (``_ranks``)
        return type(self), (self.source, self.name)


def add_safe_globals(safe_globals: Iterable[Any]) -> None:
    """Admits these classes or functions (or ``(obj, "module.name")`` pairs) in checkpoints loaded with the default,
    ``weights_only=None``. On torch 2.4+ it is torch's own ``torch.serialization.add_safe_globals``, which this
    package's loads honour as torch's do; older torch has none, and this list serves instead."""
    safe_globals = list(safe_globals)
    import torch

    if compat.has_safe_globals():
        torch.serialization.add_safe_globals(safe_globals)
    else:
        _added.extend(safe_globals)


def _full_name(obj: Any) -> Any:
    if isinstance(obj, tuple):  # (obj, "module.name"), as torch 2.5+ accepts
        return obj[1]
    return f"{obj.__module__}.{obj.__qualname__}"


def _user_admitted() -> Dict[str, Any]:
    """What the user admitted, through torch's allowlist where it has one and through ``add_safe_globals``."""
    import torch

    entries = list(_added)
    if compat.has_safe_globals():
        entries += torch.serialization.get_safe_globals()
    return {_full_name(entry): entry[0] if isinstance(entry, tuple) else entry for entry in entries}


@functools.lru_cache(maxsize=None)
def _torch_admitted() -> frozenset:
    from torch import _weights_only_unpickler

    return frozenset(_weights_only_unpickler._get_allowed_globals())


def _ruled(obj: Any) -> bool:
    """Whether a name of a ``RULED`` module resolved to something that constructs nothing but itself."""
    import dataclasses
    import enum

    import torch

    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)):
        return True
    return isinstance(obj, type) and obj.__module__.startswith("torch.distributed.") and (
        dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))


class _Restricted(pickle.Unpickler):
    source = "a checkpoint"  # set per load (``module_for``)

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 (torch.save's) names builtins as Python 2 did; pickle maps them the same way (fix_imports)
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        if full in ADMITTED or full in _torch_admitted():
            return super().find_class(module, name)
        user = _user_admitted()
        if full in user:
            return user[full]
        if module in RULED:
            obj = super().find_class(module, name)
            if _ruled(obj):
                return obj
        raise UnsafeCheckpointError(self.source, full)


def module_for(source: str) -> Any:
    """A pickle module for ``torch.load(pickle_module=...)`` whose unpickler admits only the names above, and names
    ``source`` when it refuses one."""
    unpickler = type("Unpickler", (_Restricted,), {"source": source})

    def load(file: Any, **kwargs: Any) -> Any:
        return unpickler(file, **kwargs).load()

    return types.SimpleNamespace(__name__=__name__, Unpickler=unpickler, load=load)


def loads(data: bytes, source: str, trusted: bool = False) -> Any:
    """A plain pickle's object (DCP writes ``.metadata`` with ``pickle.dump``), restricted unless ``trusted``; ``data``
    must be that pickle and nothing more (bytes after it are damage)."""
    stream = io.BytesIO(data)
    loaded = pickle.load(stream) if trusted else module_for(source).load(stream)
    if stream.tell() != len(data):
        raise pickle.UnpicklingError(f"{source} goes on for {len(data) - stream.tell()} bytes after its pickle")
    return loaded


def torch_load(source: Any, lazy: bool = False, trusted: bool = False, name: Optional[str] = None,
               map_location: Any = "cpu") -> Any:
    """``torch.load`` of a Lightning checkpoint (onto the CPU unless ``map_location`` says otherwise), from a filename
    or a file object, through the restricted unpickler unless ``trusted``. ``name`` is what a refusal calls the source
    (default: the filename). ``lazy`` memory-maps a file (a str filename: torch 2.1/2.2 map no Path) where torch
    allows, so ranks share one copy.

    ``weights_only=False`` is passed to torch, explicitly: torch 2.6 changed the default, and its weights-only
    unpickler takes no pickle module. The restriction is this package's, alike on every torch release."""
    import torch

    options: Dict[str, Any] = {"map_location": map_location, "weights_only": False}
    if not trusted:
        options["pickle_module"] = module_for(name or (repr(str(source)) if isinstance(source, str) else "a file"))
    if lazy and isinstance(source, str) and compat.loads_lazily():
        try:
            return torch.load(source, mmap=True, **options)
        except RuntimeError as error:
            # Files in torch's legacy (pre-zip) format cannot be memory-mapped; read them whole.
            if "mmap" not in str(error):
                raise
    return torch.load(source, **options)
