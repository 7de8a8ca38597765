"""Consolidate a sharded checkpoint directory into one full checkpoint file, in one process.

The result is what a full save of the same run writes. A Trainer's checkpoint becomes the Lightning
checkpoint of ``meta.pt`` with the weights under ``state_dict`` and ``optimizer_states`` in standard
PyTorch format (parameters numbered by integer id). A Fabric one becomes Fabric's full file: each module
entry its full state dict, each optimizer entry its FSDP state keyed by parameter name, and every entry of
``meta.pt``. Which of the two it is, ``_format.sharded_checkpoint_writer`` decides. No process group, no
model and no Lightning are needed.

Memory: every tensor of the checkpoint is allocated once, empty, at its full size, and the shards are
read straight into it by ``torch.distributed.checkpoint``; that one copy is then written out. The
parameter numbering comes from the checkpoint alone: see ``_standard_optimizer_state``.

Weights only (``weights_only``, ``dtype``): the model's tensors alone are read, optionally cast. In the
safetensors format they are read, cast and written one at a time (``_safetensors``), so memory stays near
the largest tensor.
"""
import math
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from . import _format, _remote, _safetensors, _saving, _verify
from . import _torch_compat as compat
from ._remote import AnyPath

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


class Summary(NamedTuple):
    """What one consolidation wrote."""

    writer: str  # _format.TRAINER or _format.FABRIC: whose sharded checkpoint it was, so the file's format
    weights: Dict[str, int]  # the file's entries holding weights ("state_dict" for the Trainer's) -> how many
    optimizers: Tuple[str, ...]  # the file's optimizer states: "optimizer_states[i]", or Fabric's entries
    tensor_bytes: int  # bytes of tensor data read from the shards


def consolidate(
    src: Any, dst: Any, overwrite: bool = False, progress: bool = True, *, weights_only: bool = False,
    dtype: Optional[str] = None, format: str = TORCH, module: Optional[str] = None,
) -> Summary:
    """Write the full checkpoint of the sharded checkpoint directory ``src`` to the file ``dst``.

    ``weights_only``: the model's weights without optimizer state or training metadata (see
    ``TRAINER_WEIGHTS_ONLY_KEYS``; Fabric's: its module entries). ``dtype`` (``"bf16"``, ``"fp16"``,
    ``"fp32"``): floating-point weights cast to it, weights-only output only. ``format="safetensors"``:
    one module's weights under its own key names, written tensor by tensor (weights only by nature).
    ``module``: the Fabric module entry to write, for weights-only output.

    ``src`` is only read. ``dst`` appears complete or not at all: it is written to a temporary file
    beside it, then renamed (at a URL: copied in one step). Either may be a URL (``_remote``).
    """
    src, dst = _remote.resolve(_remote.location(src, "read")), _remote.location(dst, "write")
    _check_options(weights_only, dtype, format, module)
    _check_destination(src, dst, overwrite)
    _check_torch()
    _check_source(src)
    if format == SAFETENSORS:
        return _write_safetensors(src, dst, dtype, module, progress)
    if weights_only:
        checkpoint, summary = _read_weights(src, dtype, module, progress)
    else:
        checkpoint, summary = read_full_checkpoint(src, progress)
    _say_writing(dst, progress)
    write_atomically(checkpoint, dst)
    return summary


def read_full_checkpoint(src: AnyPath, progress: bool = False) -> Tuple[Dict[str, Any], Summary]:
    """The full checkpoint held by the sharded directory ``src``, in its writer's full format, and what it holds."""
    metadata = compat.read_shard_index(src)
    flat, tensor_bytes = _read_flat(src, metadata, progress)
    stored = _nest(flat, metadata, src)
    meta = _verify.read_meta(src)
    writer = _format.sharded_checkpoint_writer(stored, meta)
    if writer == _format.TRAINER:
        entries, weights, optimizers = _trainer_entries(stored)
    else:
        entries, weights, optimizers = _fabric_entries(stored, metadata.planner_data)
    return {**meta, **entries}, Summary(writer, weights, optimizers, tensor_bytes)


def _read_weights(src: AnyPath, dtype: Optional[str], module: Optional[str], progress: bool) -> Tuple[Dict[str, Any], Summary]:
    """The weights-only checkpoint of ``src``, reading the model's tensors alone."""
    metadata = compat.read_shard_index(src)
    meta = _verify.read_meta(src)
    selected = _select_weights(src, metadata, meta, module)
    flat, tensor_bytes = _read_flat(src, metadata, progress, [key for keys in selected.keys.values() for key in keys])
    entries = _nest(flat, metadata, src)
    cast = _torch_dtype(dtype)
    for state in entries.values():
        for name in state:
            state[name] = _cast(state[name], cast)  # one at a time: each stored tensor goes as its copy comes
    if selected.writer == _format.TRAINER:
        kept = {key: meta[key] for key in TRAINER_WEIGHTS_ONLY_KEYS if key in meta}
        checkpoint = {**kept, "state_dict": entries.get(_format.MODEL_KEY, {})}
    else:
        checkpoint = {entry: entries.get(entry, {}) for entry in selected.keys}
    return checkpoint, Summary(selected.writer, selected.counts(), (), tensor_bytes)


class _Weights(NamedTuple):
    """The weights a weights-only output holds: per output entry, the stored keys of its tensors."""

    writer: str
    keys: Dict[str, List[str]]  # "state_dict" (the Trainer's) or a Fabric module's key -> keys of .metadata, saved order
    paths: Dict[str, Sequence[Any]]  # each stored key's nested path: (entry, parameter name) for a module's tensor

    def counts(self) -> Dict[str, int]:
        return {entry: len(keys) for entry, keys in self.keys.items()}


def _select_weights(src: AnyPath, metadata: Any, meta: Dict[str, Any], module: Optional[str]) -> _Weights:
    """Which stored keys are the model's weights: the Trainer's ``model`` entry; Fabric's module entries, or
    the one named ``module``."""
    paths = _planner_paths(metadata, src)
    by_entry: Dict[str, List[str]] = {}
    for key in metadata.state_dict_metadata:  # the saved order: each module's keys in state_dict order
        by_entry.setdefault(paths[key][0], []).append(key)
    writer = _format.sharded_checkpoint_writer(by_entry, meta)
    if writer == _format.TRAINER:
        if module is not None:
            raise ValueError(
                f"--module {module!r} picks a module of a Fabric checkpoint, but {str(src)!r} is the Trainer's, whose"
                " weights are its one state_dict. Drop --module."
            )
        return _Weights(writer, {"state_dict": by_entry.get(_format.MODEL_KEY, [])}, paths)
    modules = [
        entry for entry in by_entry
        if not _format.is_optimizer_entry(paths[key] for key in by_entry[entry])
    ]
    if module is not None:
        if module not in modules:
            raise ValueError(
                f"--module {module!r}: the Fabric checkpoint {str(src)!r} has no such module entry; its modules are"
                f" {_names(modules)}. Pass one of them."
            )
        modules = [module]
    if not modules:
        raise ValueError(f"The Fabric checkpoint {str(src)!r} holds no module weights, only optimizer states.")
    return _Weights(writer, {entry: by_entry[entry] for entry in modules}, paths)


def _names(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names)) or "none"


def _torch_dtype(dtype: Optional[str]) -> Any:
    import torch

    return None if dtype is None else getattr(torch, DTYPES[dtype])


def _cast(value: Any, dtype: Any) -> Any:
    """Floating-point tensors in ``dtype``; integer and bool tensors, and non-tensors, as they are."""
    import torch

    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _trainer_entries(stored: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, int], Tuple[str, ...]]:
    """``state_dict`` and, unless the save was weights-only, ``optimizer_states`` (id-keyed)."""
    model_state = stored.get(_format.MODEL_KEY, {})
    entries: Dict[str, Any] = {"state_dict": model_state}
    modules = _format.modules_in_state_dict_order(model_state)
    count = _format.count_saved_optimizers(stored)
    if count:  # none: a weights-only save, which has no "optimizer_states" either
        entries["optimizer_states"] = [
            _standard_optimizer_state(stored[_format.optimizer_key(index)], modules) for index in range(count)
        ]
    return entries, {"state_dict": len(model_state)}, tuple(f"optimizer_states[{index}]" for index in range(count))


def _fabric_entries(
    stored: Dict[str, Any], paths: Dict[str, Sequence[Any]]
) -> Tuple[Dict[str, Any], Dict[str, int], Tuple[str, ...]]:
    """Every stored entry under its own key: a module's full state dict, an optimizer's name-keyed FSDP state
    (what native Fabric's full save writes, ``FSDP.optim_state_dict`` under a full state-dict context)."""
    optimizers = {key for key in stored if _format.is_optimizer_entry(p for p in paths.values() if p[0] == key)}
    entries = {key: _with_state(value) if key in optimizers else value for key, value in stored.items()}
    weights = {key: len(value) for key, value in entries.items() if key not in optimizers}
    return entries, weights, tuple(key for key in stored if key in optimizers)


def _standard_optimizer_state(state: Dict[str, Any], modules: Sequence[str]) -> Dict[str, Any]:
    """A name-keyed FSDP optimizer state in PyTorch's id-keyed format.

    Ids number each group's parameters in the module's registration order, which a plain
    ``optimizer(module.parameters())`` uses and our full save writes. With ``use_orig_params=False``
    the stored group lists the parameters in flat-parameter order, so the order is not taken from it;
    the module's order is recovered from the model's keys (see ``modules_in_state_dict_order``).
    """
    state = _with_state(state)
    names_by_group = [_format.in_module_order(group["params"], modules) for group in state["param_groups"]]
    return _format.names_to_ids(state, names_by_group)


def _with_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer that never stepped has no stored ``state``; its state dict has an empty one."""
    return {"state": {}, **state}


# --- reading the shards ----------------------------------------------------------------------------


def _read_flat(src: AnyPath, metadata: Any, progress: bool, keys: Optional[Sequence[str]] = None):
    """Every stored key (or those of ``keys``), as ``.metadata`` names it, read into tensors allocated once
    at full size."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors: Dict[str, Any] = {}
    objects: Dict[str, Any] = {}
    for key in metadata.state_dict_metadata if keys is None else keys:
        stored = metadata.state_dict_metadata[key]
        if isinstance(stored, TensorStorageMetadata):
            tensors[key] = torch.empty(stored.size, dtype=stored.properties.dtype)
        else:
            objects[key] = None  # a pickled object: read whole
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    bar = Progress(total, f"reading {str(src)!r}", enabled=progress)
    planner = _planner(objects, bar.advance)
    try:
        compat.read_distributed_in_one_process({**tensors, **objects}, src, planner)
    finally:
        bar.close()
    return {**tensors, **objects}, total


def _planner(objects: Dict[str, Any], advance: Callable[[int], None]) -> Any:
    """A load planner for a flat state dict: pickled objects land in ``objects``, tensors report progress."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class FlatLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            # Kept apart: dcp.load writes its own copy of the state dict's values back at the end.
            objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

        def commit_tensor(self, read_item: Any, tensor: Any) -> None:
            advance(tensor.numel() * tensor.element_size())

    return FlatLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _nest(flat: Dict[str, Any], metadata: Any, src: AnyPath) -> Dict[str, Any]:
    """Rebuild the saved nesting (``{"model": {...}, "optimizer_0": {...}}``) from the flat keys.

    The saver recorded each flat key's path (``("optimizer_0", "state", "body.0.weight", "exp_avg")``)
    in ``planner_data``: parameter names contain dots, so the keys alone are ambiguous.
    """
    paths = _planner_paths(metadata, src)
    root: Dict[str, Any] = {}
    for key in [key for key in metadata.state_dict_metadata if key in flat]:  # the saved order: state_dict order
        _put_at(root, paths[key], flat.pop(key))
    return root


def _planner_paths(metadata: Any, src: AnyPath) -> Dict[str, Sequence[Any]]:
    """Each stored key's nested path, which a sharded save records; refused where it is missing."""
    paths = metadata.planner_data
    if not isinstance(paths, dict) or any(key not in paths for key in metadata.state_dict_metadata):
        raise ValueError(
            f"The sharded checkpoint {str(src)!r} does not record how its keys nest (its"
            f" {_format.DCP_METADATA_FILENAME!r} has no planner_data for them), so it was not written by"
            " FSDPStrategy(state_dict_type='sharded'). Only Lightning's and this package's sharded checkpoints"
            " can be consolidated."
        )
    return paths


def _put_at(root: Dict[str, Any], path: Sequence[Any], value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, making dicts (str steps) and lists (int steps) on the way."""
    node: Any = root
    for step, following in zip(path, path[1:]):
        child = _get(node, step)
        if child is None:
            child = [] if isinstance(following, int) else {}
            _set(node, step, child)
        node = child
    _set(node, path[-1], value)


def _get(node: Any, step: Any) -> Any:
    if isinstance(node, list):
        return node[step] if step < len(node) else None
    return node.get(step)


def _set(node: Any, step: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (step + 1 - len(node)))
    node[step] = value


# --- safetensors: one tensor at a time -------------------------------------------------------------


def _write_safetensors(src: AnyPath, dst: AnyPath, dtype: Optional[str], module: Optional[str], progress: bool) -> Summary:
    """One module's weights as a safetensors file: the header from the shard index, then each tensor read
    from the shards, cast and written before the next is read."""
    metadata = compat.read_shard_index(src)
    meta = _verify.read_meta(src)
    selected = _select_weights(src, metadata, meta, module)
    if len(selected.keys) > 1:
        raise ValueError(
            f"The Fabric checkpoint {str(src)!r} holds several modules ({_names(list(selected.keys))}); a safetensors"
            " file holds one module's weights under its own key names. Pass --module NAME, once per module."
        )
    [(entry, stored_keys)] = selected.keys.items()
    cast = _torch_dtype(dtype)
    found = {key: _tensor_spec(src, key, selected.paths[key], metadata.state_dict_metadata[key], cast) for key in stored_keys}
    # Wider elements first, as safetensors' own writer lays them out: every tensor then starts at a multiple of
    # its element size (the data starts 8-aligned), which zero-copy readers want. The module's order otherwise.
    keys = sorted(stored_keys, key=lambda key: -_written_dtype(metadata.state_dict_metadata[key], cast).itemsize)
    specs = [found[key] for key in keys]
    stored_bytes = sum(_stored_bytes(metadata.state_dict_metadata[key]) for key in keys)
    bar = Progress(stored_bytes, f"reading {str(src)!r}", enabled=progress)

    def chunks() -> Iterator[memoryview]:
        for key in keys:
            tensor = _cast(_read_tensor(src, key, metadata.state_dict_metadata[key], bar.advance), cast).contiguous()
            yield _memory_of(tensor)
            del tensor  # freed before the next one is read

    def write(partial: AnyPath) -> None:
        with partial.open("wb") as handle:
            _safetensors.write(handle, specs, _safetensors_metadata(selected.writer, entry, meta), chunks())

    try:
        _say_writing(dst, progress)
        _write_atomically(dst, write)
    finally:
        bar.close()
    return Summary(selected.writer, selected.counts(), (), stored_bytes)


def _tensor_spec(src: AnyPath, key: str, path: Sequence[Any], stored: Any, cast: Any) -> _safetensors.TensorSpec:
    """The header entry of one stored weight; refuses what a safetensors file cannot hold."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = f"{path[1] if len(path) > 1 else key!r} of {str(path[0])!r} in {str(src)!r}"
    if not isinstance(stored, TensorStorageMetadata) or len(path) != 2:
        raise ValueError(
            f"The weight entry {where} is not a tensor (a module's extra state, pickled); a safetensors file holds"
            " tensors only. Write the torch format with --weights-only instead."
        )
    dtype = _written_dtype(stored, cast)
    name = _safetensors.dtype_name(str(dtype))
    if name is None:
        raise ValueError(
            f"The weight {where} is of {dtype}, which safetensors has no type for. Write the torch format with"
            " --weights-only instead."
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


def _read_tensor(src: AnyPath, key: str, stored: Any, advance: Callable[[int], None]) -> Any:
    """The stored tensor ``key`` alone, read from its shards into one tensor of its full size."""
    import torch

    tensor = torch.empty(stored.size, dtype=stored.properties.dtype)
    if tensor.numel():
        compat.read_distributed_in_one_process({key: tensor}, src, _planner({}, advance))
    return tensor


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
        raise ValueError(f"Unknown output format {format!r} (--format): choose {_names(FORMATS)}.")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r} (--dtype): choose {_names(list(DTYPES))}.")
    weights = weights_only or format == SAFETENSORS
    if dtype is not None and not weights:
        raise ValueError(
            f"--dtype {dtype} casts the weights of a weights-only file; a checkpoint that resumes keeps its optimizer"
            " state and the dtypes it was trained in. Add --weights-only, or --format safetensors."
        )
    if module is not None and not weights:
        raise ValueError(
            f"--module {module!r} writes one module's weights only. Add --weights-only, or --format safetensors."
        )


def _check_torch() -> None:
    release = compat.torch_release()
    if release < compat.CONSOLIDATE_MIN:
        needed = ".".join(map(str, compat.CONSOLIDATE_MIN))
        raise NotImplementedError(
            f"Consolidating a sharded checkpoint needs torch >= {needed}; this is torch"
            f" {'.'.join(map(str, release))}. Install torch>={needed} in any environment (the training one is not"
            " needed) and run the command there."
        )


def _check_source(src: AnyPath) -> None:
    """Missing, incomplete or damaged sharded checkpoints are refused by the checks a load makes."""
    if _verify.checkpoint_kind(src) == _verify.FULL:
        raise ValueError(
            f"{str(src)!r} is a file, not a sharded checkpoint directory: it is a full checkpoint already, or not"
            " a checkpoint. Pass the directory that FSDPStrategy(state_dict_type='sharded') wrote."
        )


def _check_destination(src: AnyPath, dst: AnyPath, overwrite: bool) -> None:
    if dst.is_dir():
        raise IsADirectoryError(f"The destination {str(dst)!r} is a directory; a full checkpoint is one file. Name a file.")
    if isinstance(src, Path) and isinstance(dst, Path) and src.resolve() in dst.resolve().parents:
        raise ValueError(
            f"The destination {str(dst)!r} lies inside the sharded checkpoint {str(src)!r}, which consolidation"
            " never modifies. Write the file elsewhere."
        )
    if dst.exists() and not overwrite:
        raise FileExistsError(
            f"The destination {str(dst)!r} already exists. Pass --overwrite to replace it, or name another file."
        )


def write_atomically(checkpoint: Dict[str, Any], dst: AnyPath) -> None:
    """``torch.save`` into a hidden sibling of ``dst``, flushed to the disk, then renamed over ``dst``."""
    _write_atomically(dst, lambda partial: compat.save_file(checkpoint, partial))


def _write_atomically(dst: AnyPath, write: Callable[[AnyPath], None]) -> None:
    """``write`` a hidden sibling of ``dst``, flushed to the disk, then renamed over ``dst``; on failure, nothing is left."""
    import secrets

    _saving.write_file(dst, _saving.partial_path(dst, secrets.token_hex(8)), write)


def _say_writing(dst: AnyPath, progress: bool) -> None:
    if progress:
        print(f"consolidate: writing {str(dst)!r}", file=sys.stderr, flush=True)


class Progress:
    """Bytes done of ``total``: a tqdm bar where tqdm is installed, else a line on stderr every 10%."""

    def __init__(self, total: int, what: str, enabled: bool = True) -> None:
        self.total, self.what, self.enabled = total, what, enabled
        self.done, self._said = 0, -1
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                self._say()
            else:
                self._bar = tqdm(total=total, desc=f"consolidate: {what}", unit="B", unit_scale=True, file=sys.stderr)

    def advance(self, count: int) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self.enabled:
            self._say()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _say(self) -> None:
        percent = 100 if not self.total else self.done * 100 // self.total
        if percent // 10 > self._said:  # once per tenth crossed
            self._said = percent // 10
            mib = 2**20
            print(f"consolidate: {self.what}: {percent}% ({self.done / mib:.1f} of {self.total / mib:.1f} MiB)",
                  file=sys.stderr, flush=True)
