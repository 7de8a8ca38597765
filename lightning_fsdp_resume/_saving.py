"""What the Trainer's and Fabric's FSDP strategies do alike when saving: read ``state_dict_type``, and put a
checkpoint at its path only once it is complete (the previous one stays whole until then).

``strategy`` is either strategy object; what differs between the two (what a checkpoint holds, how a
full one is written) is passed in. Nothing here knows about patching or about the Trainer or Fabric.
"""
import secrets
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from . import _atomic, _format, _verify
from . import _torch_compat as compat
from ._ranks import barrier, broadcast


def is_full(strategy: Any) -> bool:
    kind = getattr(strategy, "_state_dict_type", _format.FULL)
    if kind not in _format.STATE_DICT_TYPES:
        raise ValueError(f"Unknown state_dict_type: {kind}")
    return kind == _format.FULL


def offload(module: Any) -> bool:
    """Offload gathered state to the CPU only from an accelerator: offloading CPU parameters crashes torch."""
    return any(param.device.type != "cpu" for param in module.parameters())


def refuse_storage_options(storage_options: Optional[Any]) -> None:
    """Both strategies save through torch, not through a ``CheckpointIO`` that would take these options."""
    if storage_options is not None:
        raise TypeError(
            "`FSDPStrategy.save_checkpoint(..., storage_options=...)` is not supported because"
            " `FSDPStrategy` does not use the `CheckpointIO`."
        )


def with_rank_zeros_buffers(strategy: Any, model_state: Dict[str, Any]) -> Dict[str, Any]:
    """A sharded model state dict to save, whose buffers (whole on every rank, and they may differ: BatchNorm's
    running statistics) are rank 0's: other ranks leave them out, where torch would pick any rank's."""
    if strategy.global_rank == 0:
        return model_state
    return {name: value for name, value in model_state.items() if compat.is_shard(value)}


def write_sharded(strategy: Any, filepath: Any, stored: Dict[str, Any], metadata: Dict[str, Any]) -> None:
    """Every rank writes its shards of ``stored`` and rank 0 ``metadata`` (``meta.pt``) into a hidden partial
    sibling; rank 0 puts it at ``filepath`` once every rank has finished.

    Native 2.1.4 writes in place: a crash mid-save leaves a mix of old and new shards that loads. Here the
    previous checkpoint at ``filepath`` stays intact until the new one is complete.
    """
    path, partial = _destination(strategy, filepath, full=False)
    partial.mkdir(parents=True, exist_ok=True)
    compat.save_distributed(stored, partial)
    if strategy.global_rank == 0:
        compat.save_file(metadata, partial / _format.METADATA_FILENAME)
    barrier(strategy)  # every rank's shards are on disk
    if strategy.global_rank == 0:
        _atomic.publish(partial, path)
        _remove_leftovers(path)
    barrier(strategy)


def write_full(strategy: Any, filepath: Any, write: Callable[[Path], None]) -> None:
    """Rank 0 ``write``s the whole checkpoint to a hidden partial sibling and puts it at ``filepath``."""
    path, partial = _destination(strategy, filepath, full=True)
    if strategy.global_rank == 0:
        _atomic.write_file(path, partial, write)
        _remove_leftovers(path)
    barrier(strategy)


def _destination(strategy: Any, filepath: Any, full: bool) -> Tuple[Path, Path]:
    """The path rank 0 names and the partial sibling every rank writes into. A full save replaces a sharded
    checkpoint but no other directory, not even an empty one (as native 2.1 refuses)."""
    target, token = broadcast(strategy, (str(filepath), secrets.token_hex(8)))
    _verify.refuse_url(target, "save")
    path = Path(target)
    if path.is_dir() and not (_format.is_replaceable_directory(path) and (not full or any(path.iterdir()))):
        raise IsADirectoryError(
            f"The checkpoint path exists and is a directory: {path}. It is not a sharded checkpoint, so saving"
            " would replace its contents. Choose another path or remove the directory."
        )
    return path, _atomic.partial_path(path, token)


def _remove_leftovers(path: Path) -> None:
    """Rank 0, once ``path`` is published: the checkpoint it replaced and any unfinished saves beside it go."""
    for leftover in _atomic.leftovers(path.parent):
        _atomic.remove(leftover)
