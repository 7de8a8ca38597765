"""``consolidate``: a sharded checkpoint directory into one full checkpoint file (or its weights alone, cast, as
safetensors), in one process with no process group, no model and no Lightning. ``_whole_read`` reads it whole; this
writes it: the file a full save of the same run writes (docs/behaviour.md#consolidate-in-detail).
"""
import math
import sys
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from .. import _storage
from .._checkpoint import _format, _preflight, _reader, _safetensors, _whole_read
from .._checkpoint._whole_read import option, refusal
from .._storage import Location, checked

# Output formats: torch's checkpoint file (what a full save writes), or a safetensors file of the weights.
TORCH, SAFETENSORS = "torch", "safetensors"
FORMATS = (TORCH, SAFETENSORS)
# --dtype's names -> torch dtype names.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# What a weights-only Trainer file keeps beside ``state_dict``: the entries LightningModule's and
# LightningDataModule's load_from_checkpoint read (the version, for its migration; the hyper-parameters),
# and when it was taken. Loops, callbacks, optimizer and scheduler states, precision state and any other
# entry are left out.
TRAINER_WEIGHTS_ONLY_KEYS = (
    "epoch", "global_step", _format.TRAINER_VERSION_KEY,
    "hparams_name", "hyper_parameters", "hparams_type",
    "datamodule_hparams_name", "datamodule_hyper_parameters", "datamodule_hparams_type",
)


def consolidate(
    src: Any, dst: Any, overwrite: bool = False, progress: bool = False, *, weights_only: bool = False,
    dtype: Optional[str] = None, format: str = TORCH, module: Optional[str] = None, trusted: bool = False,
    ema: bool = False,
) -> _whole_read.Summary:
    """Write the full checkpoint of the sharded checkpoint directory ``src`` to the file ``dst``.

    ``weights_only``: the model's weights without optimizer state or training metadata (see
    ``TRAINER_WEIGHTS_ONLY_KEYS``; Fabric's: its module entries). ``dtype`` (``"bf16"``, ``"fp16"``,
    ``"fp32"``): floating-point weights cast to it, weights-only output only. ``format="safetensors"``:
    one module's weights under its own key names, written tensor by tensor (weights only by nature).
    ``module``: the Fabric module entry to write, for weights-only output. ``trusted``: the checkpoint's pickles
    may name any callable, which runs as they are read; by default they are read restricted (``_unpickling``).
    ``ema``: the average of the weights ``ShardedEMA`` saved beside them, in their place (weights only by nature).

    ``src`` is only read. ``dst`` appears complete or not at all: it is written to a temporary file
    beside it, then renamed (at a URL: copied in one step). Either may be a URL (``_storage``).
    """
    src, dst = _storage.open_path(src, "read", trusted).resolve(), _storage.open_path(dst, "write")
    _check_options(weights_only or ema, dtype, format, module)
    _check_destination(src, dst, overwrite)
    _whole_read.check_torch()
    _check_source(src)
    if format == SAFETENSORS:
        return _write_safetensors(src, dst, dtype, module, progress, ema)
    if weights_only or ema:
        checkpoint, summary = _read_weights(src, dtype, module, progress, ema)
    else:
        checkpoint, summary = _whole_read.read_full_checkpoint(src, progress)
    _say_writing(dst, progress)
    write_atomically(checkpoint, dst)
    return summary


def _read_weights(src: Location, dtype: Optional[str], module: Optional[str], progress: bool,
                  ema: bool) -> Tuple[Dict[str, Any], _whole_read.Summary]:
    """The weights-only checkpoint of ``src``, reading the model's tensors (or their average, ``ema``) alone."""
    selected = _whole_read.select_weights(src, module, ema)
    metadata, meta = _reader.index(src), _reader.meta(src)
    flat, tensor_bytes = _whole_read.read_flat(src, metadata, progress, [key for keys in selected.keys.values() for key in keys])
    entries = _whole_read.nest(flat, metadata, src)
    cast = _torch_dtype(dtype)
    for state in entries.values():
        for name in state:
            state[name] = _cast(state[name], cast)  # one at a time: each stored tensor goes as its copy comes
    if selected.writer == _format.TRAINER:
        kept = {key: meta[key] for key in TRAINER_WEIGHTS_ONLY_KEYS if key in meta}
        checkpoint = {**kept, "state_dict": entries.get(_format.EMA_KEY if ema else _format.MODEL_KEY, {})}
    else:
        checkpoint = {entry: entries.get(entry, {}) for entry in selected.keys}
    return checkpoint, _whole_read.Summary(selected.writer, selected.counts(), (), tensor_bytes)


def _torch_dtype(dtype: Optional[str]) -> Any:
    import torch

    return None if dtype is None else getattr(torch, DTYPES[dtype])


def _cast(value: Any, dtype: Any) -> Any:
    """Floating-point tensors in ``dtype``; integer and bool tensors, and non-tensors, as they are."""
    import torch

    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


# --- safetensors: one tensor at a time -------------------------------------------------------------


def _write_safetensors(src: Location, dst: Location, dtype: Optional[str], module: Optional[str], progress: bool,
                       ema: bool) -> _whole_read.Summary:
    """One module's weights as a safetensors file: the header from the shard index, then each tensor read
    from the shards, cast and written before the next is read."""
    selected = _whole_read.select_weights(src, module, ema)
    metadata, meta = _reader.index(src), _reader.meta(src)
    if len(selected.keys) > 1:
        raise refusal(ValueError,
            f"The Fabric checkpoint {str(src)!r} holds several modules ({_whole_read.quoted_names(list(selected.keys))}); a safetensors"
            f" file holds one module's weights under its own key names. Pass {option('module NAME')}, once per module."
        )
    [(entry, stored_keys)] = selected.keys.items()
    cast = _torch_dtype(dtype)
    found = {key: _tensor_spec(src, key, selected.paths[key], metadata.state_dict_metadata[key], cast) for key in stored_keys}
    # Wider elements first, as safetensors' own writer lays them out: every tensor then starts at a multiple of
    # its element size (the data starts 8-aligned), which zero-copy readers want. The module's order otherwise.
    keys = sorted(stored_keys, key=lambda key: -_written_dtype(metadata.state_dict_metadata[key], cast).itemsize)
    specs = [found[key] for key in keys]
    stored_bytes = sum(_stored_bytes(metadata.state_dict_metadata[key]) for key in keys)
    bar = _whole_read.Progress(stored_bytes, f"reading {str(src)!r}", enabled=progress)

    def chunks() -> Iterator[memoryview]:
        for key in keys:
            tensor = _cast(_whole_read.read_tensor(src, key, metadata.state_dict_metadata[key], bar.advance), cast).contiguous()
            yield _memory_of(tensor)
            del tensor  # freed before the next one is read

    def write(partial: Location) -> None:
        with partial.open("wb") as handle:
            _safetensors.write(handle, specs, _safetensors_metadata(selected.writer, entry, meta), chunks())

    try:
        _say_writing(dst, progress)
        _write_atomically(dst, write)
    finally:
        bar.close()
    return _whole_read.Summary(selected.writer, selected.counts(), (), stored_bytes)


def _tensor_spec(src: Location, key: str, path: Sequence[Any], stored: Any, cast: Any) -> _safetensors.TensorSpec:
    """The header entry of one stored weight; refuses what a safetensors file cannot hold."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = f"{path[1] if len(path) > 1 else key!r} of {str(path[0])!r} in {str(src)!r}"
    if not isinstance(stored, TensorStorageMetadata) or len(path) != 2:
        raise refusal(ValueError,
            f"The weight entry {where} is not a tensor (a module's extra state, pickled); a safetensors file holds"
            f" tensors only. Write the torch format with {option('weights_only')} instead."
        )
    dtype = _written_dtype(stored, cast)
    name = _safetensors.dtype_name(str(dtype))
    if name is None:
        raise refusal(ValueError,
            f"The weight {where} is of {dtype}, which safetensors has no type for. Write the torch format with"
            f" {option('weights_only')} instead."
        )
    shape = tuple(stored.size)
    return _safetensors.TensorSpec(str(path[1]), name, shape, math.prod(shape) * dtype.itemsize)


def _written_dtype(stored: Any, cast: Any) -> Any:
    """A stored tensor's dtype once ``_cast``: ``cast`` for floating point, its own otherwise."""
    dtype = stored.properties.dtype
    return cast if cast is not None and dtype.is_floating_point else dtype


def _safetensors_metadata(writer: str, entry: str, meta: Dict[str, Any]) -> Dict[str, str]:
    """The header's ``__metadata__`` (strings only): ``format`` as ``safetensors.torch`` writes it, and where
    the weights came from."""
    found = {"format": "pt", "checkpoint": writer, "entry": entry}
    for key in ("epoch", "global_step"):
        if isinstance(meta.get(key), int):
            found[key] = str(meta[key])
    return found


def _memory_of(tensor: Any) -> memoryview:
    """The bytes of a contiguous tensor in memory order, without a copy (no numpy needed); valid while the
    tensor lives."""
    import ctypes

    assert tensor.is_contiguous()  # else the bytes would not be in the order of its elements
    size = tensor.numel() * tensor.element_size()
    if not size:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


def _stored_bytes(stored: Any) -> int:
    return math.prod(stored.size) * stored.properties.dtype.itemsize


# --- checks and writing -----------------------------------------------------------------------------


def _check_options(weights_only: bool, dtype: Optional[str], format: str, module: Optional[str]) -> None:
    """Settings that contradict each other are refused before anything is read."""
    if format not in FORMATS:
        raise refusal(ValueError, f"Unknown output format {format!r} ({option('format')}): choose {_whole_read.quoted_names(FORMATS)}.")
    if dtype is not None and dtype not in DTYPES:
        raise refusal(ValueError, f"Unknown dtype {dtype!r} ({option('dtype name')}): choose {_whole_read.quoted_names(list(DTYPES))}.")
    weights = weights_only or format == SAFETENSORS
    add = f"Add {option('weights_only')}, or {option('safetensors')}."
    if dtype is not None and not weights:
        raise refusal(ValueError,
            f"{option('dtype', dtype)} casts the weights of a weights-only file; a checkpoint that resumes keeps its"
            f" optimizer state and the dtypes it was trained in. {add}"
        )
    if module is not None and not weights:
        raise refusal(ValueError, f"{option('module', module)} writes one module's weights only. {add}")


def _check_source(src: Location) -> None:
    """Missing, incomplete or damaged sharded checkpoints are refused by the checks a load makes."""
    if _preflight.checkpoint_kind(src) == _preflight.FULL:
        raise ValueError(
            f"{str(src)!r} is a file, not a sharded checkpoint directory: it is a full checkpoint already, or not"
            " a checkpoint. Pass the directory that FSDPStrategy(state_dict_type='sharded') wrote."
        )


def _check_destination(src: Location, dst: Location, overwrite: bool) -> None:
    if dst.is_dir():
        raise IsADirectoryError(f"The destination {str(dst)!r} is a directory; a full checkpoint is one file. Name a file.")
    if src.contains(dst):
        raise ValueError(
            f"The destination {str(dst)!r} lies inside the sharded checkpoint {str(src)!r}, which consolidation"
            " never modifies. Write the file elsewhere."
        )
    if dst.exists() and not overwrite:
        raise refusal(FileExistsError,
            f"The destination {str(dst)!r} already exists. Pass {option('overwrite')} to replace it, or name another file."
        )


def write_atomically(checkpoint: Dict[str, Any], dst: Location) -> None:
    """``torch.save`` into a hidden sibling of ``dst``, flushed to the disk, then renamed over ``dst``."""
    _write_atomically(dst, lambda partial: checked.save_file(partial, checkpoint))


def _write_atomically(dst: Location, write: Callable[[Location], Any]) -> None:
    """``write`` a hidden sibling of ``dst``, flushed to the disk, then renamed over ``dst``; on failure, nothing is left."""
    import secrets

    dst.write_file(dst.partial(secrets.token_hex(8)), write)


def _say_writing(dst: Location, progress: bool) -> None:
    if progress:
        print(f"consolidate: writing {str(dst)!r}", file=sys.stderr, flush=True)

