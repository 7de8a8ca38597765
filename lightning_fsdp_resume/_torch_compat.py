"""What differs between torch releases for FSDP state dicts and ``torch.distributed.checkpoint``.

Each function does one thing the same way on every supported torch, choosing the API that release
expects. torch is imported inside the functions: importing the shim must not import torch.
"""
import functools
import io
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, Optional, Set, Tuple

from . import _format, _remote, _shard_layout
from ._remote import AnyPath

# torch 2.4 deprecates FSDP.state_dict_type() in favour of torch.distributed.checkpoint.state_dict, but
# its version fails on a rank that holds no shard of a parameter ("Only single local shard is
# supported": more ranks than rows, or resharding onto more ranks); torch 2.13's does not. So from 2.5.
_STATE_DICT_API = (2, 5)
# torch 2.2 adds dcp.save()/dcp.load() and deprecates save_state_dict()/load_state_dict().
_DCP_SAVE_LOAD = (2, 2)
# From torch 2.3, dcp.save()/dcp.load() may take no_dist; the signature says whether this release's do (2.4's do not).
_DCP_NO_DIST = (2, 3)
# torch 2.1 adds torch.load(mmap=True): a full checkpoint is then read lazily, shared by all ranks.
_LOAD_MMAP = (2, 1)
# torch 2.0 adds FSDP optimizer state dicts and sharded checkpoints.
_SHARDED = (2, 0)
# Consolidating reads a sharded checkpoint in one process; torch 2.2 is the oldest release it is tested on.
CONSOLIDATE_MIN = (2, 2)
# FSDP over gloo (CPU ranks) from torch 2.2: gloo lacks _allgather_base before.
CPU_FSDP_MIN = (2, 2)
# torch 2.2 alone gathers an optimizer state of use_orig_params=True through torch.cuda calls.
CUDA_ONLY_ORIG_PARAMS_OPTIMIZER_STATE = (2, 2)
# torch 2.3 adds dcp.async_save: a sharded save written in a background thread.
ASYNC_SAVE = (2, 3)


def torch_release() -> Tuple[int, ...]:
    import torch

    from ._versions import parse_release

    return parse_release(torch.__version__)


def supports_sharded_checkpoints() -> bool:
    return torch_release() >= _SHARDED


def _new_api() -> bool:
    return torch_release() >= _STATE_DICT_API


# --- model and optimizer state dicts ------------------------------------------------------------


def _options(full: bool, offload: bool, **extra: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=offload, **extra)


@contextmanager
def _legacy_context(model: Any, full: bool, offload: bool, rank0_only: bool) -> Iterator[None]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.api import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
    )

    if not FSDP.fsdp_modules(model):
        # No FSDP unit (a plain module beside the FSDP one in Fabric's state, or one process without a
        # process group): its own state dict is the full one. FSDP.state_dict_type raises KeyError there.
        yield
        return
    if full:
        kind = StateDictType.FULL_STATE_DICT
        config = FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
        optim_config = FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only)
    else:
        kind = StateDictType.SHARDED_STATE_DICT
        config = ShardedStateDictConfig(offload_to_cpu=offload)
        optim_config = ShardedOptimStateDictConfig(offload_to_cpu=offload)
    with FSDP.state_dict_type(model, kind, config, optim_config):
        yield


def model_state_dict(model: Any, full: bool, offload: bool) -> Dict[str, Any]:
    """Full: the gathered weights on rank 0 and ``{}`` on the other ranks, as native Lightning. Sharded: this rank's shards."""
    if _new_api() and not _rank0_only_needs_legacy(full, offload):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=_options(full, offload))
    with _legacy_context(model, full, offload, rank0_only=True):
        return model.state_dict()


def _rank0_only_needs_legacy(full: bool, offload: bool) -> bool:
    """torch.distributed.checkpoint.state_dict keeps a full state on rank 0 alone only with cpu_offload=True,
    which crashes on CPU parameters: without offloading, every rank would gather the whole model and
    optimizer. FSDP.state_dict_type (deprecated from torch 2.4, still there) takes rank0_only by itself."""
    return full and not offload


def load_model_state_dict(model: Any, state_dict: Dict[str, Any], full: bool, strict: bool = True) -> None:
    """Full: every rank passes the whole state dict. Sharded: every rank passes its shards."""
    # set_model_state_dict(full_state_dict=True, strict=False) of torch 2.5 to 2.13 puts a flat parameter in place
    # of each name the state dict lacks ("size mismatch for ...extra.weight ... torch.Size([40])"); the
    # FSDP.state_dict_type load keeps those parameters as they are.
    if _new_api() and (strict or not full):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state_dict, options=_options(full, False, strict=strict))
        return
    with _legacy_context(model, full, offload=False, rank0_only=False):
        model.load_state_dict(state_dict, strict=strict)


def optimizer_state_dict(model: Any, optimizer: Any, full: bool, offload: bool) -> Dict[str, Any]:
    """Keyed by parameter name. Full: complete on rank 0, empty elsewhere."""
    if _new_api() and not _rank0_only_needs_legacy(full, offload):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_options(full, offload))
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with _legacy_context(model, full, offload, rank0_only=True):
        return FSDP.optim_state_dict(model, optimizer)


def load_optimizer_state_dict(model: Any, optimizer: Any, state: Dict[str, Any], full: bool) -> None:
    """``state`` is keyed by parameter name; full: every rank passes the whole state."""
    if _new_api():
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=_options(full, False))
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with _legacy_context(model, full, offload=False, rank0_only=False):
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state))


def is_shard(value: Any) -> bool:
    """Whether a sharded state dict's entry is a parameter's shards (a ``ShardedTensor``, or from torch 2.4 on
    a ``DTensor``), not a buffer every rank holds whole."""
    return type(value).__name__ in ("ShardedTensor", "DTensor")


def uses_orig_params(model: Any) -> bool:
    """Whether an FSDP-wrapped model was wrapped with ``use_orig_params=True`` (an FSDP attribute since torch 2.0)."""
    return bool(getattr(model, "_use_orig_params", False))


def model_parameter_shapes(model: Any) -> Any:
    """torch >= 2.5: the model's state-dict entries and full shapes when all of them are parameters FSDP
    shards, which ``read_model_into_shards``/``copy_model_into_shards`` then load; else None."""
    return _shard_layout.parameter_shapes(model) if _new_api() else None


def read_model_into_shards(model: Any, path: AnyPath, stored: Dict[str, str]) -> None:
    """Read checkpoint entry ``stored[name]`` into each parameter ``name``'s local shard (a collective).

    get_model_state_dict's template gathers every FSDP unit to re-chunk it, and set_model_state_dict
    gathers them again to copy it in; this reads each rank's elements into its flat parameters.
    """
    _shard_layout.read_model_into_shards(model, path, stored)


def copy_model_into_shards(model: Any, values: Dict[str, Any]) -> None:
    """Copy this rank's part of each full tensor ``values[name]`` into parameter ``name``'s local shard."""
    _shard_layout.copy_model_into_shards(model, values)


def optimizer_parameter_names(model: Any, optimizer: Any) -> list:
    """Each param group's parameter names; for a flat parameter, those of the original parameters in it."""
    found = _shard_layout.layout(model, optimizer) if _new_api() else None
    if found is not None:
        return _shard_layout.names_by_group(found)
    state = optimizer_state_dict(model, optimizer, full=False, offload=False)
    return [list(group["params"]) for group in state["param_groups"]]


def load_full_optimizer_state(model: Any, optimizer: Any, state: Dict[str, Any], prefix: str) -> None:
    """Load a full, name-keyed optimizer state whose names lack the model's ``prefix``; every rank passes it."""
    found = _shard_layout.layout(model, optimizer) if _new_api() else None
    if found is None:
        load_optimizer_state_dict(model, optimizer, _format.add_optimizer_prefix(state, prefix), full=True)
        return
    # torch >= 2.5: set_optimizer_state_dict converts the whole state to FSDP's layout first (twice the
    # memory of native 2.1.4, which uses FSDP.optim_state_dict_to_load); this slices out what the rank holds.
    by_name = {prefix + name: value for name, value in state["state"].items()}
    source = _shard_layout.FullSource(by_name, found.shapes)
    _shard_layout.load_into_shards(optimizer, found, source, state["param_groups"])


def load_sharded_optimizer_state(
    model: Any, optimizer: Any, model_state: Dict[str, Any], key: str, path: AnyPath, shards: Any, prefix: str
) -> None:
    """Load optimizer ``key`` of a sharded checkpoint into this rank's shards.

    ``model_state`` is the model's sharded state as stored (names without the wrapper prefix), ``shards``
    the checkpoint's index (``read_shard_index``); ``prefix`` is what the model's parameter names have
    before the names the checkpoint stores.
    """
    if _new_api():
        found = _shard_layout.layout(model, optimizer)
        if found is not None:
            # get_optimizer_state_dict's template (below) initialises the optimizer state and re-chunks it
            # per parameter: about 2.6 times the shard. This reads into the state's final layout instead.
            stored = functools.partial(_format.strip_name, prefix=prefix)
            source = _shard_layout.CheckpointSource(path, key, shards, found.shapes, stored)
            if source.readable():
                _shard_layout.load_into_shards(optimizer, found, source, _saved_param_groups(path, key, shards))
                return
        # The new API builds a complete template (it initialises empty optimizer state); load fills it in.
        # Only the tensors go through dcp.load: the param groups' hyperparameters are read as saved and
        # laid over the optimizer's current ones. Loading them into the template fails when a newer torch
        # added a hyperparameter (torch 2.13's Adam ``decoupled_weight_decay``) and when the world size
        # changed (the template then flattens the groups differently from the saved keys).
        template = _format.strip_optimizer_prefix(optimizer_state_dict(model, optimizer, full=False, offload=False), prefix)
        container = {key: {"state": template["state"]}}
        load_distributed(container, path)
        for group, saved in zip(template["param_groups"], _saved_param_groups(path, key, shards)):
            group.update(saved)
        state = {**container[key], "param_groups": template["param_groups"]}
    else:
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

        loaded = load_sharded_optimizer_state_dict(
            model_state_dict=model_state, optimizer_key=key, storage_reader=storage_reader(path)
        )
        state = loaded[key]
    load_optimizer_state_dict(model, optimizer, _format.add_optimizer_prefix(state, prefix), full=False)


def _saved_param_groups(path: AnyPath, key: str, index: Any) -> list:
    """Optimizer ``key``'s param groups as saved: pickled objects, read from the shard files directly."""
    import re

    import torch

    whole = f"{key}.param_groups"
    groups: Dict[int, Dict[str, Any]] = {}
    for entry, info in index.storage_data.items():
        fqn = entry.fqn
        field = re.fullmatch(re.escape(whole) + r"\.(\d+)\.(\w+)", fqn)
        if fqn != whole and not field:
            continue
        value = torch.load(io.BytesIO(_read_range(path / info.relative_path, info.offset, info.length)), weights_only=False)
        if field is None:  # fqn == whole: the groups saved as one entry
            return list(value)
        groups.setdefault(int(field.group(1)), {})[field.group(2)] = value
    return [groups[i] for i in sorted(groups)]


def _read_range(path: AnyPath, offset: int, length: int) -> bytes:
    if isinstance(path, _remote.RemotePath):
        return path.read_bytes(offset, offset + length)  # one request of these bytes, not a read-ahead block
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(length)


# --- torch.distributed.checkpoint and files ------------------------------------------------------


def distributed() -> bool:
    """Whether a process group is up. Without one (a notebook, a unit test) this process is every rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def storage_writer(path: Any) -> Any:
    """torch.distributed.checkpoint's writer into the directory ``path``: a local one, or a URL through fsspec."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(path, _remote.RemotePath):
        return dcp.FileSystemWriter(str(path), single_file_per_rank=True)
    writer = _fsspec_storage("FsspecWriter", path)
    # sync_files (torch 2.4+; torch 2.2's writer never syncs): object stores have nothing to fsync, an object is
    # complete once its upload is
    from ._signature import takes  # here: _signature imports this module

    options = {"sync_files": False} if takes(writer.__init__, "sync_files") else {}
    return writer(str(path), single_file_per_rank=True, **options)


def storage_reader(path: Any) -> Any:
    import torch.distributed.checkpoint as dcp

    if not isinstance(path, _remote.RemotePath):
        return dcp.FileSystemReader(str(path))
    reader = _fsspec_storage("FsspecReader", path)
    if _takes_storage_options(reader) and hasattr(path.fs, "default_cache_type"):
        # Each rank reads its items in the plan's order, not by offset: s3fs's read-ahead cache then fetches a new
        # block for most items (a 403 MB sharded resume from a local S3 server took 2.2 times as long); a block
        # cache fetches each block once. torch 2.13's reader takes storage options; torch 2.4's takes none.
        return reader(str(path), default_cache_type="blockcache")
    return reader(str(path))


def _takes_storage_options(storage_class: Any) -> bool:
    import inspect

    parameters = inspect.signature(storage_class.__init__).parameters.values()
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)


def _fsspec_storage(name: str, path: Any) -> Any:
    """torch.distributed.checkpoint's fsspec storage class (torch 2.1 adds it, privately); refused before."""
    try:
        from torch.distributed.checkpoint import _fsspec_filesystem
    except ImportError as error:
        raise RuntimeError(
            f"Sharded checkpoints at URLs ({str(path)!r}) need torch.distributed.checkpoint's fsspec storage, which"
            f" torch {'.'.join(map(str, torch_release()))} does not have (torch 2.1 adds it). Upgrade torch, save"
            " full checkpoints (`state_dict_type='full'`) to the URL, or save to a local directory."
        ) from error
    return getattr(_fsspec_filesystem, name)


def save_distributed(state: Dict[str, Any], path: Any) -> None:
    _run_dcp("save", state, storage_writer=storage_writer(path))


def saves_in_background() -> bool:
    import torch.distributed.checkpoint as dcp

    return torch_release() >= ASYNC_SAVE and hasattr(dcp, "async_save")


def save_distributed_in_background(state: Dict[str, Any], path: Any, group: Any) -> Any:
    """Start ``dcp.async_save`` of ``state`` (a ``host_copy``, which it writes as it is) into ``path``, its
    collectives on ``group``; returns its future."""
    import torch.distributed.checkpoint as dcp

    from ._signature import takes  # here: _signature imports this module

    writer = storage_writer(path)
    if takes(dcp.async_save, "async_stager"):
        # torch 2.13's async_save takes a stager; its default one copies the state again, doubling a save's memory
        return dcp.async_save(state, storage_writer=writer, process_group=group, async_stager=_AlreadyStaged())
    # torch 2.4's stages through the writer, which moves the state to the CPU, where it already is: no copy
    return dcp.async_save(state, storage_writer=writer, process_group=group)


class _AlreadyStaged:
    """torch's ``AsyncStager`` protocol for a state that is already a copy in host memory."""

    should_synchronize_after_execute = False

    def stage(self, state: Dict[str, Any]) -> Dict[str, Any]:
        return state

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def host_copy(obj: Any, live: Optional[Set[int]] = None) -> Any:
    """``obj`` as it is now, for a save that writes it while training goes on: its accelerator tensors copied into
    host memory, its other leaves deep-copied. ``live``: the storages (``storages``) training changes; host tensors
    elsewhere are FSDP's own copies, which nothing changes, and are kept as they are (None: every one is copied)."""
    import copy

    import torch

    if isinstance(obj, dict):
        return type(obj)((key, host_copy(value, live)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(host_copy(value, live) for value in obj)
    if type(obj).__name__ == "ShardedTensor":
        return _sharded_host_copy(obj, live)
    if isinstance(obj, torch.Tensor):
        return _host_tensor(obj, live)
    return copy.deepcopy(obj)


def storages(tensors: Iterable[Any]) -> Set[int]:
    """Where ``tensors`` keep their data, for ``host_copy``'s ``live``."""
    return {tensor.untyped_storage().data_ptr() for tensor in tensors}


def _host_tensor(tensor: Any, live: Optional[Set[int]]) -> Any:
    if tensor.device.type != "cpu" or live is None or tensor.untyped_storage().data_ptr() in live:
        return tensor.detach().to("cpu", copy=True)
    return tensor


def _sharded_host_copy(tensor: Any, live: Optional[Set[int]]) -> Any:
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    shards = tensor.local_shards()
    if any(shard.tensor.device.type != "cpu" for shard in shards):
        return tensor.cpu()  # a copy, its shards' placements moved to the CPU with them
    copies = [Shard(_host_tensor(shard.tensor, live), shard.metadata) for shard in shards]
    if all(copy.tensor is shard.tensor for copy, shard in zip(copies, shards)):
        return tensor
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        copies, tensor.metadata(), process_group=tensor._process_group
    )


def load_distributed(state: Dict[str, Any], path: Any) -> None:
    """Fill ``state`` (a template of the right shapes) in place from the checkpoint at ``path``."""
    _run_dcp("load", state, storage_reader=storage_reader(path))


def read_shard_index(path: Any) -> Any:
    """A sharded checkpoint's ``.metadata``: every stored entry (``state_dict_metadata``, flattened keys
    with global shapes), where its bytes are (``storage_data``: file, offset, length) and, in
    ``planner_data``, the nested path each flattened key came from."""
    return storage_reader(path).read_metadata()


def read_distributed_in_one_process(state: Dict[str, Any], path: Any, planner: Any) -> None:
    """Fill the flat ``state`` (keys as the ``.metadata`` lists them) from ``path`` with no process group."""
    _run_dcp("load", state, one_process=True, storage_reader=storage_reader(path), planner=planner)


def _run_dcp(verb: str, state: Dict[str, Any], one_process: bool = False, **kwargs: Any) -> None:
    """``dcp.save``/``dcp.load`` (``verb``) of ``state``; in this process alone when asked or when no
    process group is up, as if it were every rank."""
    import inspect
    import warnings

    import torch.distributed.checkpoint as dcp

    new, deprecated = getattr(dcp, verb, None), getattr(dcp, f"{verb}_state_dict")  # dcp.save/load: torch 2.2+
    if distributed() and not one_process:
        # torch 2.2 adds dcp.save()/dcp.load() and deprecates save_state_dict()/load_state_dict().
        (new if new is not None and torch_release() >= _DCP_SAVE_LOAD else deprecated)(state, **kwargs)
        return
    with warnings.catch_warnings():
        # "torch.distributed is ... uninitialized, assuming ... a single process": that is the intent.
        warnings.filterwarnings("ignore", message=".*single process")
        if new is not None and torch_release() >= _DCP_NO_DIST and "no_dist" in inspect.signature(new).parameters:
            new(state, no_dist=True, **kwargs)
        else:
            # torch 2.4: dcp.save/load have no no_dist; torch 2.2's gather keys over the missing process
            # group even with it. The deprecated calls take no_dist on both.
            warnings.filterwarnings("ignore", category=FutureWarning)
            deprecated(state, no_dist=True, **kwargs)


def load_file(path: AnyPath, lazy: bool, weights_only: bool = False) -> Any:
    """``torch.load`` a Lightning checkpoint onto the CPU.

    ``weights_only=False`` by default, explicitly, because torch 2.6 changed the default and Lightning
    checkpoints hold more than tensors; ``True`` for a file not trusted to unpickle. ``lazy`` memory-maps the
    file where torch allows, so ranks share one copy.
    """
    import torch

    if isinstance(path, _remote.RemotePath):  # read whole into memory: an object cannot be memory-mapped
        return torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=weights_only)
    filename = str(path)  # torch 2.1/2.2 memory-map only a str filename, not a Path
    if lazy and torch_release() >= _LOAD_MMAP:
        try:
            return torch.load(filename, map_location="cpu", weights_only=weights_only, mmap=True)
        except RuntimeError as error:
            # Files in torch's legacy (pre-zip) format cannot be memory-mapped; read them whole.
            if "mmap" not in str(error):
                raise
    return torch.load(filename, map_location="cpu", weights_only=weights_only)


def save_file(obj: Any, path: Any) -> None:
    """``torch.save`` flushed to the disk: it is about to be published by a rename. At a URL: one object."""
    import torch

    if isinstance(path, _remote.RemotePath):
        with path.open("wb") as handle:
            torch.save(obj, handle)
        return
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
