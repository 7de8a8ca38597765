"""Lightning's own reads of full checkpoint files, wrapped (``cloud_io._load``): a sharded directory reads whole, as
``consolidate`` would write it, and a full file is unpickled restricted unless ``weights_only=False``; and
``load_from_checkpoint`` runs ``configure_sharded_model`` before the weights load (``wrap_load_state``).
"""
import functools
from typing import Any, Callable, Dict, Optional

from .. import _storage
from .._checkpoint import _format, _preflight, _whole_read
from .._patching import _signature
from .._patching._held import asked
from .._save_load import _loading
from .._storage import Location, checked


def _as_asked(checkpoint: Any, where: str) -> Any:
    """``checkpoint``, with the average of the weights in place of them where the call asked for it
    (``load_from_checkpoint(ema=True)``: ``_held.asking(average=True)``)."""
    if not asked().average:
        return checkpoint
    average = checkpoint.pop(_format.EMA_STATE_KEY, None) if isinstance(checkpoint, dict) else None
    if average is None:
        raise ValueError(
            f"load_from_checkpoint(ema=True): the checkpoint {where} holds no average of the weights (ShardedEMA saves"
            " it beside them). Load it without ema=True, or load a checkpoint of a run with ShardedEMA."
        )
    checkpoint["state_dict"] = average
    return checkpoint


def wrap_load(original_load: Callable) -> Callable:
    """``cloud_io._load(path_or_url, map_location=None, weights_only=None)`` (2.6's parameters): a sharded checkpoint
    read whole (a directory, or at a URL the data its pointer names: ``_storage``), and a full file unpickled
    restricted unless ``weights_only=False`` was given to it or to the call it runs in (``_loading.trusted``)."""

    @functools.wraps(original_load)
    def _load(path_or_url: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
        trusted = _loading.trusted(weights_only)
        if hasattr(path_or_url, "read"):  # a file object
            given = "the file object given"
            return _as_asked(checked.load_stream(path_or_url, given, given, trusted, map_location), given)
        if str(path_or_url).startswith("http"):
            url = str(path_or_url)
            return _as_asked(checked.load_stream(_downloaded(url), url, repr(url), trusted, map_location), repr(url))
        source = _storage.open_path(path_or_url, "load", trusted).resolve()
        if source.is_dir():
            return _as_asked(read_whole(source, map_location), repr(str(source)))
        return _as_asked(checked.load_file(source, map_location=map_location), repr(str(source)))

    _load.__signature__ = _signature.with_keyword(original_load, "weights_only", None, Optional[bool])  # type: ignore[attr-defined]
    return _load


def _downloaded(url: str) -> str:
    """The file at an http(s) ``url``, where ``torch.hub.load_state_dict_from_url`` keeps it (downloaded once)."""
    import os
    from urllib.parse import urlparse

    import torch.hub

    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(urlparse(url).path))
    if not os.path.exists(cached):
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        torch.hub.download_url_to_file(url, cached)
    return cached


def sharded_directory(path: Any) -> Optional[Location]:
    """The directory to read whole where ``path`` names one (at a URL: the data its pointer names); None otherwise.
    http(s) URLs are Lightning's to download (torch.hub): asking fsspec's http file system whether one is a
    directory would fetch the whole file as a page of links."""
    if not _storage.may_be_sharded_directory(path):
        return None
    source = _storage.open_path(path, "load").resolve()
    return source if source.is_dir() else None


def wrap_load_state(original_load_state: Callable, configure_first: Callable[[Any], Any]) -> Callable:
    """``load_from_checkpoint``'s ``_load_state(cls, checkpoint, strict, **kwargs)``, running the model's
    ``configure_sharded_model`` hook before the weights load, as Lightning 2.2 runs ``configure_model``: layers the
    hook builds then receive their weights instead of being refused as unexpected keys. Outside a Trainer the hook's
    ``wrap()`` calls wrap nothing. The hook runs first thing in ``on_load_checkpoint``, which ``_load_state`` calls
    between building the model and loading its weights: ``configure_first(cls)`` (``_patches.CONFIGURE_FIRST``) puts
    ``configure_first`` below there for this call only, and takes it off exactly."""

    @functools.wraps(original_load_state)
    def _load_state(cls: Any, checkpoint: Dict[str, Any], strict: Any = None, **kwargs: Any) -> Any:
        if not _builds_in_hook(cls):
            return original_load_state(cls, checkpoint, strict, **kwargs)
        with configure_first(cls):
            return original_load_state(cls, checkpoint, strict, **kwargs)

    return _load_state


def _builds_in_hook(cls: Any) -> bool:
    """Whether a LightningModule class overrides ``configure_sharded_model``: a class below Lightning's, which
    defines it (a datamodule has none), defines it too."""
    return len([klass for klass in getattr(cls, "__mro__", ()) if "configure_sharded_model" in vars(klass)]) > 1


def configure_first(on_load_checkpoint: Any) -> Callable:
    """``on_load_checkpoint`` running ``configure_sharded_model`` first."""
    def hook(self: Any, checkpoint: Dict[str, Any]) -> Any:
        self.configure_sharded_model()
        return on_load_checkpoint(self, checkpoint)

    return hook


def read_whole(path: Location, map_location: Any = None) -> Dict[str, Any]:
    """The full checkpoint held by the sharded directory ``path``, its tensors placed as ``map_location`` says
    (as ``torch.load`` places them; the shards are read onto the CPU first).

    The Trainer's reads as a Lightning checkpoint (``state_dict``, ``optimizer_states`` in PyTorch's format,
    ``hyper_parameters`` and the rest of ``meta.pt``); Fabric's as Fabric's full file, with an optimizer's state
    in PyTorch's format where the checkpoint holds one module, so that a non-FSDP optimizer loads it.
    Memory: each tensor is allocated once; a tensor moved elsewhere by ``map_location`` frees its CPU copy
    before the next moves, so the peak is the full state plus the largest tensor.
    """
    _preflight.checkpoint_kind(path)  # a partial, damaged or foreign directory: the same refusal as everywhere
    _whole_read.check_torch()
    checkpoint, summary = _whole_read.read_full_checkpoint(path)
    if summary.writer == _format.FABRIC and len(summary.weights) == 1:
        (module_key,) = summary.weights
        modules = _format.modules_in_state_dict_order(checkpoint[module_key])
        for key in summary.optimizers:
            checkpoint[key] = _whole_read.standard_optimizer_state(checkpoint[key], modules)
    if map_location is None:
        return checkpoint
    return _placed(checkpoint, functools.partial(_place, map_location=map_location))


def _placed(obj: Any, place: Callable[[Any], Any]) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples replaced by ``place(tensor)``, one at a time."""
    import torch

    if isinstance(obj, torch.Tensor):
        return place(obj)
    if isinstance(obj, dict):
        for key in list(obj):
            obj[key] = _placed(obj[key], place)
        return obj
    if isinstance(obj, list):
        for index, value in enumerate(obj):
            obj[index] = _placed(value, place)
        return obj
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_placed(value, place) for value in obj)
    return obj


def _place(tensor: Any, map_location: Any) -> Any:
    """Where ``torch.load(map_location=...)`` would put a tensor saved on the CPU."""
    import torch

    if callable(map_location):  # (storage, location) -> storage, as torch.load calls it; None: leave it
        storage = map_location(tensor.untyped_storage(), "cpu")
        if storage is None or storage.data_ptr() == tensor.untyped_storage().data_ptr():
            return tensor
        moved = torch.empty(0, dtype=tensor.dtype, device=storage.device)
        return moved.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
    if isinstance(map_location, dict):  # saved location -> location
        map_location = map_location.get("cpu", "cpu")
    return tensor.to(map_location)
