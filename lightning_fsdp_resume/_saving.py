"""What the Trainer's and Fabric's FSDP strategies do alike when saving: read ``state_dict_type``, and put a
checkpoint at its path only once it is complete (the previous one stays whole until then).

``strategy`` is either strategy object; what differs between the two (what a checkpoint holds, how a
full one is written) is passed in. Nothing here knows about patching or about the Trainer or Fabric.
"""
import contextlib
import functools
import secrets
from concurrent.futures import Future
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple

from . import _atomic, _background, _format, _remote
from . import _torch_compat as compat
from ._ranks import barrier, broadcast, decided_on_rank_zero, warn_rank_zero


def is_full(strategy: Any) -> bool:
    kind = getattr(strategy, "_state_dict_type", _format.FULL)
    if kind not in _format.STATE_DICT_TYPES:
        raise ValueError(f"Unknown state_dict_type: {kind}")
    return kind == _format.FULL


def offload(module: Any) -> bool:
    """Offload gathered state to the CPU only from an accelerator: offloading CPU parameters crashes torch."""
    return any(param.device.type != "cpu" for param in module.parameters())


def refuse_storage_options(storage_options: Optional[Any]) -> None:
    """Both strategies save through torch, not through a ``CheckpointIO`` that would take these options. Nor are
    they taken for a URL: no load takes them, so a checkpoint saved with them could not be resumed."""
    if storage_options is not None:
        raise TypeError(
            "`FSDPStrategy.save_checkpoint(..., storage_options=...)` is not supported because"
            " `FSDPStrategy` does not use the `CheckpointIO`. For a checkpoint at a URL, give the store's"
            " credentials and endpoint to every rank through its environment (for S3: AWS_* or FSSPEC_S3_*"
            " variables), where the loads that resume from it find them too."
        )


def plain_io(strategy: Any) -> Any:
    """The Trainer's ``CheckpointIO`` that writes a full checkpoint when called: ``AsyncCheckpointIO``'s wrapped one.

    ``AsyncCheckpointIO``'s own thread would write the file after it is published and the checkpoint it replaces
    removed. Its request for saves in the background is answered here instead (``in_background``)."""
    io = strategy.checkpoint_io
    wrapped = getattr(io, "checkpoint_io", None)
    return wrapped if asks_for_background(strategy) and wrapped is not None else io


def in_background(strategy: Any, asked: bool) -> bool:
    """Whether a save that ``asked`` to be written in the background can be: a torch with ``dcp.async_save`` and a
    process group (the threads agree over one). Else it is written in the foreground, and rank 0 says why once."""
    if not asked:
        return False
    if compat.saves_in_background() and compat.distributed():
        return True
    release = ".".join(map(str, compat.torch_release()))
    warn_rank_zero(
        strategy,
        f"lightning_fsdp_resume: FSDP checkpoints are saved in the foreground: saving them in the background needs"
        f" torch >= 2.3 (torch.distributed.checkpoint.async_save) and a process group; this is torch {release}"
        f"{'' if compat.distributed() else ', without a process group'}.",
    )
    return False


def asks_for_background(strategy: Any) -> bool:
    """Whether the Trainer's plugins include Lightning's ``AsyncCheckpointIO``."""
    return type(strategy.checkpoint_io).__name__ == "AsyncCheckpointIO"


def training_tensors(module: Any, optimizers: Iterable[Any]) -> Iterator[Any]:
    """What training changes in place: ``module``'s parameters and buffers, and the optimizers' states."""
    import torch

    yield from module.parameters()
    yield from module.buffers()
    for optimizer in optimizers:
        for state in getattr(optimizer, "_optimizer", optimizer).state.values():  # a LightningOptimizer's own
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def with_rank_zeros_buffers(strategy: Any, model_state: Dict[str, Any]) -> Dict[str, Any]:
    """A sharded model state dict to save, whose buffers (whole on every rank, and they may differ: BatchNorm's
    running statistics) are rank 0's: other ranks leave them out, where torch would pick any rank's."""
    if strategy.global_rank == 0:
        return model_state
    return {name: value for name, value in model_state.items() if compat.is_shard(value)}


def write_sharded(strategy: Any, filepath: Any, stored: Dict[str, Any], metadata: Dict[str, Any], background: bool = False,
                  live: Iterable[Any] = ()) -> None:
    """Every rank writes its shards of ``stored`` and rank 0 ``metadata`` (``meta.pt``) into a hidden partial
    sibling; rank 0 puts it at ``filepath`` once every rank has finished.

    Native 2.1.4 writes in place: a crash mid-save leaves a mix of old and new shards that loads. Here the
    previous checkpoint at ``filepath`` stays intact until the new one is complete: on a local disk the partial
    directory is renamed into place, at a URL its pointer is written (``_remote``).

    ``background``: return once the state is in host memory, where training cannot change it: the entries of
    ``stored`` that share the storage of a ``live`` tensor (the module's and optimizers', which training changes)
    are copied, ``metadata`` all; torch's ``async_save`` writes the shards, and rank 0 publishes once every rank's are
    written (``_background``).
    """
    _background.wait(strategy)
    path, partial = _destination(strategy, filepath, full=False)
    if background:
        stored, metadata = compat.host_copy(stored, compat.storages(live)), compat.host_copy(metadata)
        written = _started(lambda: _start_shards(partial, stored, _background.process_group(strategy)))
        _background.start(strategy, path, written.result, functools.partial(_publish_sharded, partial, path, metadata))
        return
    with _reported(path):
        partial.mkdir(parents=True, exist_ok=True)
        compat.save_distributed(stored, partial)
        barrier(strategy)  # every rank's shards are written
        # rank 0 finishes; the others wait for it and raise its error (a store that refused meta.pt, say) with it
        decided_on_rank_zero(strategy, _publish_sharded, partial, path, metadata)


def _start_shards(partial: Any, stored: Dict[str, Any], group: Any) -> Future:
    partial.mkdir(parents=True, exist_ok=True)
    return compat.save_distributed_in_background(stored, partial, group)


def _started(start: Callable[[], Future]) -> Future:
    """``start()``'s future, or one holding its error: a rank whose start failed still joins the others' verdict."""
    try:
        return start()
    except Exception as error:
        failed: Future = Future()
        failed.set_exception(error)
        return failed


def _publish_sharded(partial: Any, path: Any, metadata: Dict[str, Any]) -> None:
    compat.save_file(metadata, partial / _format.METADATA_FILENAME)
    if isinstance(path, _remote.RemotePath):
        _remote.commit(partial, path)
    else:
        _atomic.publish(partial, path)
    _remove_leftovers(path)


def write_full(strategy: Any, filepath: Any, state: Dict[str, Any], write: Callable[[Dict[str, Any], Any], None],
               background: bool = False) -> None:
    """Rank 0 ``write``s the whole checkpoint ``state`` to a hidden partial sibling and puts it at ``filepath``; the
    other ranks wait for it, and raise its error with it. ``background``: rank 0 writes a copy of ``state`` in a
    thread, and every rank goes on at once."""
    _background.wait(strategy)
    path, partial = _destination(strategy, filepath, full=True)
    if not background:
        with _reported(path):
            decided_on_rank_zero(strategy, _publish_full, path, partial, functools.partial(write, state))
        return
    on_rank_zero = _nothing
    if strategy.global_rank == 0:  # the only rank that holds the gathered state
        on_rank_zero = functools.partial(_publish_full, path, partial, functools.partial(write, compat.host_copy(state)))
    _background.start(strategy, path, on_rank_zero, _nothing)


def _nothing() -> None:
    pass


@contextlib.contextmanager
def _reported(path: Any) -> Iterator[None]:
    """A failed save to a URL (a refused write, a network gone, on any rank) raises one clear error on every rank."""
    if not isinstance(path, _remote.RemotePath):
        yield
        return
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        raise _remote.save_failed(path, error) from error


def _publish_full(path: Any, partial: Any, write: Callable[[Any], None]) -> None:
    write_file(path, partial, write)
    _remove_leftovers(path)


def write_file(path: Any, partial: Any, write: Callable[[Any], None]) -> None:
    """``write(partial)``, then put it at ``path`` (a local path or a URL) in one step."""
    if isinstance(path, _remote.RemotePath):
        _remote.write_file(path, partial, write)
    else:
        _atomic.write_file(path, partial, write)


def partial_path(path: Any, token: str) -> Any:
    """Where a save to ``path`` writes until it is complete."""
    if isinstance(path, _remote.RemotePath):
        return _remote.data_path(path, token)
    return _atomic.partial_path(path, token)


def _destination(strategy: Any, filepath: Any, full: bool) -> Tuple[Any, Any]:
    """The path rank 0 names and the partial sibling every rank writes into. A full save replaces a sharded
    checkpoint but no other directory, not even an empty one (as native 2.1 refuses); at a URL, no directory."""
    target, token = broadcast(strategy, (str(filepath), secrets.token_hex(8)))
    path = _remote.location(target, "save")
    decided_on_rank_zero(strategy, _check_destination, path, full)
    return path, partial_path(path, token)


def _check_destination(path: Any, full: bool) -> None:
    if isinstance(path, _remote.RemotePath):
        _remote.check_bucket(path)
    if not path.is_dir():
        return
    replaceable = not isinstance(path, _remote.RemotePath) and _format.is_replaceable_directory(path)
    if not (replaceable and (not full or any(path.iterdir()))):
        raise IsADirectoryError(
            f"The checkpoint path exists and is a directory: {path}. It is not a sharded checkpoint this package"
            " saved there, so saving would replace its contents. Choose another path or remove the directory."
        )


def _remove_leftovers(path: Any) -> None:
    """Rank 0, once ``path`` is published: the checkpoint it replaced and any unfinished saves beside it go."""
    if isinstance(path, _remote.RemotePath):
        for remote in _remote.leftovers(path.parent):
            remote.remove()
        return
    for leftover in _atomic.leftovers(path.parent):
        _atomic.remove(leftover)
