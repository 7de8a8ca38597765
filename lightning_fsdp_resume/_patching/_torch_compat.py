"""Every difference between torch releases (FSDP's state-dict APIs, DCP's calls and storages), by release or signature
(``takes``); the package's release thresholds (``CONSOLIDATE_MIN``, ...), DCP's save planner (its index in state-dict
order), damage raised alike on every rank. torch is imported inside the functions: importing the shim must not.
"""
import inspect
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Tuple

from .._checkpoint import _checksums

# torch 2.4 deprecates FSDP.state_dict_type() in favour of torch.distributed.checkpoint.state_dict, but
# its version fails on a rank that holds no shard of a parameter ("Only single local shard is
# supported": more ranks than rows, or resharding onto more ranks); torch 2.13's does not. So from 2.5.
_STATE_DICT_API = (2, 5)
# torch 2.2 adds dcp.save()/dcp.load() and deprecates save_state_dict()/load_state_dict().
_DCP_SAVE_LOAD = (2, 2)
# From torch 2.3, dcp.save()/dcp.load() may take no_dist; the signature says whether this release's do (2.4's do not).
_DCP_NO_DIST = (2, 3)
# torch 2.1 adds torch.load(mmap=True): a full checkpoint is then read lazily, shared by all ranks.
LOAD_MMAP = (2, 1)
# torch 2.0 adds FSDP optimizer state dicts and sharded checkpoints.
_SHARDED = (2, 0)
# Consolidating reads a sharded checkpoint in one process; torch 2.2 is the oldest release it is tested on.
CONSOLIDATE_MIN = (2, 2)
# FSDP over gloo (CPU ranks) from torch 2.2: gloo lacks _allgather_base before.
CPU_FSDP_MIN = (2, 2)
# torch 2.2 alone gathers an optimizer state of use_orig_params=True through torch.cuda calls.
CUDA_ONLY_ORIG_PARAMS_OPTIMIZER_STATE = (2, 2)
# Saves built from FSDP's flat shards as views (``_shard_views``), loads read straight into them (``_shard_layout``):
# from the oldest release their multi-rank tests run on. Before, FSDP's own state dicts, which gather.
_FLAT_SHARD_IO = CPU_FSDP_MIN
# torch 2.3 adds dcp.async_save, from which release saves are offered in the background (written by a thread of the
# package's own through dcp.save); torch 2.2's DCP opens its files itself, where checksums read each item back.
ASYNC_SAVE = (2, 3)
# torch 2.4 adds torch.serialization.add_safe_globals / get_safe_globals: its own allowlist of pickled names.
_SAFE_GLOBALS = (2, 4)


def torch_release() -> Tuple[int, ...]:
    import torch

    from ._versions import parse_release

    return parse_release(torch.__version__)


def release_text() -> str:
    """This torch's release, as messages name it ("2.4.1")."""
    return ".".join(map(str, torch_release()))


def supports_sharded_checkpoints() -> bool:
    return torch_release() >= _SHARDED


def new_state_dict_api() -> bool:
    """torch >= 2.5: torch.distributed.checkpoint.state_dict's API."""
    return torch_release() >= _STATE_DICT_API


def through_flat_shards() -> bool:
    """Whether sharded saves and loads go straight from and into FSDP's flat shards, gathering nothing (torch >= 2.2)."""
    return torch_release() >= _FLAT_SHARD_IO


def takes(function: Callable, argument: str) -> bool:
    """Whether ``function`` has a parameter named ``argument``: how a release's API is told apart by signature."""
    return argument in inspect.signature(function).parameters


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
    if new_state_dict_api() and not _rank0_only_needs_legacy(full, offload):
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
    if new_state_dict_api() and (strict or not full):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state_dict, options=_options(full, False, strict=strict))
        return
    with _legacy_context(model, full, offload=False, rank0_only=False):
        model.load_state_dict(state_dict, strict=strict)


def optimizer_state_dict(model: Any, optimizer: Any, full: bool, offload: bool) -> Dict[str, Any]:
    """Keyed by parameter name. Full: complete on rank 0, empty elsewhere."""
    if new_state_dict_api() and not _rank0_only_needs_legacy(full, offload):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=_options(full, offload))
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with _legacy_context(model, full, offload, rank0_only=True):
        return FSDP.optim_state_dict(model, optimizer)


def load_optimizer_state_dict(model: Any, optimizer: Any, state: Dict[str, Any], full: bool) -> None:
    """``state`` is keyed by parameter name; full: every rank passes the whole state."""
    if new_state_dict_api():
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
    """Whether the FSDP units in ``model`` (FSDP's root, or a module holding it) were made with ``use_orig_params=True``
    (an FSDP attribute since torch 2.0, the same on every unit of a root); False where it holds none."""
    return bool(next((unit._use_orig_params for unit in model.modules() if hasattr(unit, "_use_orig_params")), False))



# --- torch.distributed.checkpoint ------------------------------------------------------------------


def distributed() -> bool:
    """Whether a process group is up. Without one (a notebook, a unit test) this process is every rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def dcp_fsspec_writer(url: str) -> Any:
    """torch.distributed.checkpoint's writer into the directory at ``url``, through fsspec."""
    writer = _fsspec_storage("FsspecWriter", url)
    # sync_files (torch 2.4+; torch 2.2's writer never syncs): object stores have nothing to fsync, an object is
    # complete once its upload is
    options = {"sync_files": False} if takes(writer.__init__, "sync_files") else {}
    return writer(url, single_file_per_rank=True, **options)


def dcp_fsspec_reader(url: str, **storage_options: Any) -> Any:
    """torch.distributed.checkpoint's reader of the directory at ``url``, through fsspec; ``storage_options`` for the
    file system where the reader takes them (torch 2.13's does; torch 2.4's takes none)."""
    reader = _fsspec_storage("FsspecReader", url)
    parameters = inspect.signature(reader.__init__).parameters.values()
    if storage_options and any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return reader(url, **storage_options)
    return reader(url)


def _fsspec_storage(name: str, url: str) -> Any:
    """torch.distributed.checkpoint's fsspec storage class (torch 2.1 adds it, privately); refused before."""
    try:
        from torch.distributed.checkpoint import _fsspec_filesystem
    except ImportError as error:
        raise RuntimeError(
            f"Sharded checkpoints at URLs ({url!r}) need torch.distributed.checkpoint's fsspec storage, which"
            f" torch {release_text()} does not have (torch 2.1 adds it). Upgrade torch, save"
            " full checkpoints (`state_dict_type='full'`) to the URL, or save to a local directory."
        ) from error
    return getattr(_fsspec_filesystem, name)


def save_distributed(state: Dict[str, Any], writer: Any, group: Any = None) -> None:
    """Every rank writes its part of ``state`` through torch DCP's storage ``writer``, its collectives on ``group``
    (the default group if None)."""
    _run_dcp("save", state, storage_writer=writer, planner=_save_planner(), **({} if group is None else {"process_group": group}))


def _save_planner() -> Any:
    """DCP's save planner, its index (``.metadata``) listing the keys in the coordinator's state-dict order.

    DCP lists a key where the first rank that writes a rectangle of it has it, so a save built from views of the
    flat shards (``_shard_views``), where rank 0 holds no rectangle of some parameters, would list those after all of
    rank 0's; readers that number parameters by the modules' order (``_whole_read``) take it from that list.
    Every rank's state dict names every parameter, so rank 0's order is the state dicts' own."""
    import dataclasses

    from torch.distributed.checkpoint import DefaultSavePlanner

    class InStateDictOrder(DefaultSavePlanner):
        def create_global_plan(self, all_plans: Any) -> Any:
            global_plan, metadata = super().create_global_plan(all_plans)
            stored = metadata.state_dict_metadata
            # the flattened keys of this rank's whole state dict (self.state_dict has lost those of no rectangle here)
            ordered = {key: stored[key] for key in self.mappings if key in stored}
            ordered.update((key, value) for key, value in stored.items() if key not in ordered)
            self.metadata = dataclasses.replace(metadata, state_dict_metadata=ordered)
            return global_plan, self.metadata

    return InStateDictOrder()


def saves_in_background() -> bool:
    return torch_release() >= ASYNC_SAVE


def has_safe_globals() -> bool:
    """torch >= 2.4: ``torch.serialization.add_safe_globals`` and ``get_safe_globals``."""
    return torch_release() >= _SAFE_GLOBALS


def loads_lazily() -> bool:
    """torch >= 2.1: ``torch.load(mmap=True)``, a full checkpoint read lazily and shared by every rank."""
    return torch_release() >= LOAD_MMAP


def streams_through_fs(storage: Any) -> bool:
    """Whether the DCP reader or writer ``storage`` opens its files through its file system's streams, where they can
    be wrapped (torch 2.4's local storage, and the fsspec one); torch < 2.4's local storage opens them itself."""
    return hasattr(getattr(storage, "fs", None), "create_stream")


@contextmanager
def torch_save_without_crc32() -> Iterator[None]:
    """Inside, this thread's ``torch.save`` leaves out the CRC-32 of each zip record it writes, where torch lets one
    thread do that alone: 2.6 added the switch, and only settings kept per thread (torch 2.13's are ContextVars) leave
    another thread's saves as they are; elsewhere nothing changes. No torch release's loader reads those CRC-32s; a
    sharded checkpoint's own checksums cover its files. About 40 % of the writing thread's CPU time (0.4 GB, torch 2.13)."""
    import contextvars

    try:
        from torch.utils.serialization import config

        per_thread = isinstance(config._config["save.compute_crc32"].user_override, contextvars.ContextVar)
    except (ImportError, AttributeError, KeyError):  # torch < 2.6, or settings another release keeps otherwise
        per_thread = False
    if not per_thread:
        yield
        return
    with config.patch({"save.compute_crc32": False}):
        yield


def stamps_load_id(storage: Any) -> bool:
    """Whether the DCP reader ``storage`` stamps the index it reads with its ``load_id`` (torch 2.4 adds it)."""
    return hasattr(storage, "load_id")


def consolidate_supported() -> bool:
    """torch >= 2.2: a sharded checkpoint read whole in one process."""
    return torch_release() >= CONSOLIDATE_MIN


def cpu_fsdp_supported() -> bool:
    """torch >= 2.2: FSDP ranks over gloo on the CPU."""
    return torch_release() >= CPU_FSDP_MIN


def cpu_orig_params_optimizer_state_supported() -> bool:
    """False on torch 2.2 alone, which gathers an optimizer state of ``use_orig_params=True`` through torch.cuda."""
    return torch_release()[:2] != CUDA_ONLY_ORIG_PARAMS_OPTIMIZER_STATE


def import_background_saving() -> None:
    """Import what a save in the background writes with, ahead of its first call (about 0.1 to 0.2 s of imports,
    which a first save in the background would otherwise stall training for)."""
    import torch.distributed.checkpoint  # noqa: F401


def load_distributed(state: Dict[str, Any], reader: Any, planner: Any = None) -> None:
    """Fill ``state`` (a template of the right shapes) in place through torch DCP's storage ``reader``."""
    _run_dcp("load", state, storage_reader=reader, **({} if planner is None else {"planner": planner}))


def read_distributed_in_one_process(state: Dict[str, Any], reader: Any, planner: Any) -> None:
    """Fill the flat ``state`` (keys as the ``.metadata`` lists them) through ``reader`` with no process group."""
    _run_dcp("load", state, one_process=True, storage_reader=reader, planner=planner)


def _run_dcp(verb: str, state: Dict[str, Any], one_process: bool = False, **kwargs: Any) -> None:
    """``dcp.save``/``dcp.load`` (``verb``) of ``state``; in this process alone when asked or when no
    process group is up, as if it were every rank. Damage a reader found on any rank (``_checksums``) is raised as it
    is on every rank, not as torch's ``CheckpointException``."""
    try:
        _call_dcp(verb, state, one_process, **kwargs)
    except BaseException as error:  # torch's CheckpointException is a BaseException
        raise _checksums.damage_in(error) or error


def _call_dcp(verb: str, state: Dict[str, Any], one_process: bool, **kwargs: Any) -> None:
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
