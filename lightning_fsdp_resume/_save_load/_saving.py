"""What both FSDP strategies do alike when saving: ``state_dict_type``, the state dicts (views of the shards, or
FSDP's), and the order of a save, foreground or background, that puts a checkpoint at its path only once complete (its
store's publishing is the location's, ``_storage``). Nothing here knows about patching, the Trainer or Fabric.
"""
import functools
import secrets
from typing import Any, Callable, Dict, Iterable, Iterator, NamedTuple, Optional, Tuple

from .. import _participants, _storage
from .._checkpoint import _format
from .._patching import _torch_compat as compat
from .._storage import Location, checked
from . import _background, _shard_layout, _shard_views
from ._ranks import barrier, decided_on_rank_zero, warn_rank_zero


def state_dict_type(strategy: Any) -> _format.StateDictType:
    """The strategy's ``state_dict_type``: what its saves write."""
    kind = getattr(strategy, "_state_dict_type", _format.FULL)
    if kind not in _format.STATE_DICT_TYPES:
        raise ValueError(f"Unknown state_dict_type: {kind}")
    return kind


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


def in_background(strategy: Any, asked: bool) -> bool:
    """Whether a save that ``asked`` to be written in the background can be: torch >= 2.3 (``ASYNC_SAVE``) and a
    process group (the threads agree over one). Else it is written in the foreground, and rank 0 says why once."""
    if not asked:
        return False
    if compat.saves_in_background() and compat.distributed():
        return True
    warn_rank_zero(
        strategy,
        f"lightning_fsdp_resume: FSDP checkpoints are saved in the foreground: saving them in the background needs"
        f" torch >= 2.3 and a process group; this is torch {compat.release_text()}"
        f"{'' if compat.distributed() else ', without a process group'}.",
    )
    return False


def model_state(module: Any, kind: _format.StateDictType, offload: bool) -> Dict[str, Any]:
    """This rank's model state dict, to save. Full: gathered on rank 0. Sharded: views of its flat shards, or FSDP's
    (``_built``; ``offload``: its shards moved to the host)."""
    full = kind == _format.FULL
    build = functools.partial(compat.model_state_dict, module, full=full, offload=offload)
    return build() if full else _built(_shard_views.model_state, (module,), build)


def optimizer_state(module: Any, optimizer: Any, kind: _format.StateDictType, offload: bool) -> Dict[str, Any]:
    """This rank's optimizer state dict, keyed by parameter name, to save, as ``model_state``."""
    full = kind == _format.FULL
    build = functools.partial(compat.optimizer_state_dict, module, optimizer, full=full, offload=offload)
    return build() if full else _built(_shard_views.optimizer_state, (module, optimizer), build)


def _built(from_shards: Callable[..., Dict[str, Any]], args: Tuple[Any, ...], fsdps: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``from_shards(*args)`` where every rank can build it (torch >= 2.2, a layout ``_shard_views`` knows), else
    ``fsdps()``: FSDP's builder, which gathers every flat parameter. The views stay where the shards are: torch's
    writer moves each item to the host as it writes it."""
    if not compat.through_flat_shards():
        return fsdps()
    try:
        return _shard_views.agreed(from_shards, *args)
    except _shard_views.UnknownLayout as unknown:
        import logging

        logging.getLogger(__name__).debug("lightning_fsdp_resume: FSDP builds this sharded state dict: %s.", unknown)
        return fsdps()


def preparing_background_saves(original_optimizer_step: Callable, asked: Callable[[Any], bool],
                               module: Callable[[Any], Any] = lambda strategy: None) -> Callable:
    """A strategy's ``optimizer_step`` that, after each optimizer's first step, where sharded saves are ``asked`` to be
    written in the background and can be, has host buffers for its tensors and the strategy's ``module`` made once,
    and the views of them a save stores (built from the shards), off the training thread (``_background.prepare``)."""

    @functools.wraps(original_optimizer_step)
    def optimizer_step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_optimizer_step(self, optimizer, *args, **kwargs)
        if (asked(self) and state_dict_type(self) == _format.SHARDED and compat.saves_in_background() and compat.distributed()
                and not _background.prepared(self, optimizer)):
            root = module(self)
            ahead = _shard_views.ahead(root, optimizer) if root is not None and compat.through_flat_shards() else None
            _background.prepare(self, optimizer, lambda: training_tensors(root, [optimizer]), ahead)
        return result

    return optimizer_step


def training_tensors(module: Any, optimizers: Iterable[Any]) -> Iterator[Any]:
    """What training changes in place: ``module``'s parameters and buffers, FSDP's flat shards (which a unit keeping
    a gathered copy does not show as its parameters), and the optimizers' parameters and states (``module`` None:
    the optimizers' alone)."""
    import torch

    if module is not None:
        yield from module.parameters()
        yield from module.buffers()
        yield from map(_shard_layout.local_shard, _shard_layout.flat_shards(module) or ())
        for participant in _participants.within(module):  # kept beside the weights (an average, updated after each step)
            yield from participant.live_tensors()
    for optimizer in optimizers:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        for group in inner.param_groups:  # FSDP's flat shards, or views of them
            yield from group["params"]
        for state in inner.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def with_rank_zeros_buffers(strategy: Any, model_state: Dict[str, Any]) -> Dict[str, Any]:
    """A sharded model state dict to save, whose buffers (whole on every rank, and they may differ: BatchNorm's
    running statistics) are rank 0's: other ranks leave them out, where torch would pick any rank's."""
    if strategy.global_rank == 0:
        return model_state
    return {name: value for name, value in model_state.items() if compat.is_shard(value)}


def _save_torch_file(state: Dict[str, Any], path: Location) -> None:
    """A full checkpoint's ``write`` where no ``CheckpointIO`` writes it: ``torch.save``, durable before it is published."""
    checked.save_file(path, state)


class Checkpoint(NamedTuple):
    """What one save writes. Sharded: every rank writes its shards of ``stored`` and rank 0 ``metadata`` (``meta.pt``);
    the buffers of the entries in ``rank_zeros`` (the model's and its participants') are rank 0's
    (``with_rank_zeros_buffers``).
    Full: ``stored`` is the whole checkpoint, gathered on rank 0, which ``write``s it. ``training``: the module and the
    optimizers whose tensors training changes, which a save in the background copies before it returns."""

    kind: _format.StateDictType
    stored: Dict[str, Any]
    metadata: Dict[str, Any]
    training: Tuple[Any, Iterable[Any]]
    write: Callable[[Dict[str, Any], Location], None] = _save_torch_file
    rank_zeros: Tuple[str, ...] = (_format.MODEL_KEY,)


def save(strategy: Any, filepath: Any, checkpoint: Checkpoint, background: bool) -> None:
    """Put ``checkpoint`` at ``filepath`` only once complete: the one save of both strategies. Written in the
    background where it asks to be and can be (``in_background``), else before this returns.

    Native 2.1.4 writes a sharded checkpoint in place: a crash mid-save leaves a mix of old and new shards that loads.
    Here the previous checkpoint at ``filepath`` stays intact until the new one is complete: on a local disk the
    partial sibling is renamed into place, at a URL its pointer is written (``_storage``)."""
    writers = {(_format.SHARDED, False): _write_sharded, (_format.SHARDED, True): _write_sharded_in_background,
               (_format.FULL, False): _write_full, (_format.FULL, True): _write_full_in_background}
    writers[checkpoint.kind, in_background(strategy, background)](strategy, filepath, checkpoint)


def _write_sharded(strategy: Any, filepath: Any, checkpoint: Checkpoint) -> None:
    """Every rank writes its shards into a hidden partial sibling; rank 0 puts it at ``filepath`` once every rank
    has finished."""
    path, partial = _sharded_destination(strategy, filepath, checkpoint)
    with path.reported():
        partial.mkdir()
        compat.save_distributed(checkpoint.stored, checked.writer(partial))
        barrier(strategy)  # every rank's shards are written
        # rank 0 finishes; the others wait for it and raise its error (a store that refused meta.pt, say) with it
        decided_on_rank_zero(strategy, _publish_sharded, partial, path, checkpoint.metadata)


def _write_sharded_in_background(strategy: Any, filepath: Any, checkpoint: Checkpoint) -> None:
    """``_write_sharded``, returning once the state is in host memory, where training cannot change it: the entries
    of ``stored`` that share the storage of a tensor training changes (``training_tensors``) are copied, ``metadata``
    all; a thread writes the shards, and rank 0 publishes once every rank's are written (``_background``)."""
    path, partial = _sharded_destination(strategy, filepath, checkpoint)
    staged = _background.staging(strategy)
    live = _background.Live(training_tensors(*checkpoint.training))
    stored, metadata = _background.host_copy(checkpoint.stored, live, staged), _background.host_copy(checkpoint.metadata)
    group = _background.process_group(strategy)
    _background.start(strategy, path, functools.partial(_write_shards, partial, stored, group),
                      functools.partial(_publish_sharded, partial, path, metadata))


def _sharded_destination(strategy: Any, filepath: Any, checkpoint: Checkpoint) -> Tuple[Location, Location]:
    """Once the previous background save is written: the destination and its partial sibling, with rank 0's buffers
    in the entries ``rank_zeros`` names."""
    _background.wait(strategy)
    stored = checkpoint.stored
    for key in checkpoint.rank_zeros:
        if key in stored:
            stored[key] = with_rank_zeros_buffers(strategy, stored[key])
    return _destination(strategy, filepath, _format.SHARDED)


def _write_shards(partial: Location, stored: Dict[str, Any], group: Any) -> None:
    partial.mkdir()
    compat.save_distributed(stored, checked.writer(partial), group)


def _publish_sharded(partial: Location, path: Location, metadata: Dict[str, Any]) -> None:
    meta = _format.METADATA_FILENAME
    checked.seal(partial, {meta: checked.save_file(partial / meta, metadata)})  # the checksums of every file, written last
    path.publish(partial)
    path.remove_leftovers()


def _write_full(strategy: Any, filepath: Any, checkpoint: Checkpoint) -> None:
    """Rank 0 writes the whole checkpoint to a hidden partial sibling and puts it at ``filepath``; the other ranks wait
    for it, and raise its error with it."""
    _background.wait(strategy)
    path, partial = _destination(strategy, filepath, _format.FULL)
    with path.reported():
        decided_on_rank_zero(strategy, _publish_full, path, partial, functools.partial(checkpoint.write, checkpoint.stored))


def _write_full_in_background(strategy: Any, filepath: Any, checkpoint: Checkpoint) -> None:
    """``_write_full``, where rank 0 writes a copy of the checkpoint in a thread, and every rank goes on at once."""
    _background.wait(strategy)
    path, partial = _destination(strategy, filepath, _format.FULL)
    on_rank_zero = _nothing
    if strategy.global_rank == 0:  # the only rank that holds the gathered state
        write = functools.partial(checkpoint.write, _background.host_copy(checkpoint.stored))
        on_rank_zero = functools.partial(_publish_full, path, partial, write)
    _background.start(strategy, path, on_rank_zero, _nothing)


def _nothing() -> None:
    pass


def _publish_full(path: Location, partial: Location, write: Callable[[Location], None]) -> None:
    path.write_file(partial, write)
    path.remove_leftovers()


def _destination(strategy: Any, filepath: Any, kind: _format.StateDictType) -> Tuple[Location, Location]:
    """The path rank 0 names and the partial sibling every rank writes into. A full save replaces a sharded
    checkpoint but no other directory, not even an empty one (as native 2.1 refuses); at a URL, no directory."""

    def checked() -> Tuple[str, str]:
        target = str(filepath)
        _storage.open_path(target, "save").check_destination(kind)
        return target, secrets.token_hex(8)

    target, token = decided_on_rank_zero(strategy, checked)  # one broadcast: rank 0's path, its verdict, a fresh token
    path = _storage.open_path(target, "save")
    return path, path.partial(token)
