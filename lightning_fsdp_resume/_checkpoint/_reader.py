"""The one reader of a checkpoint's parts at a location, each read once per location and checked as it is read
(``_storage.checked``): a sharded directory's ``meta.pt`` and index, a full file, the entries either holds. A bad part
raises naming its path and what to do. ``_preflight`` checks a whole checkpoint with it, ``_loading`` loads through it,
``_whole_read`` reads a sharded directory whole from it.
"""
from typing import Any, Dict, Optional, Set

from .._save_load._ranks import describe
from .._storage import Location, checked
from . import _checksums, _format
from ._unpickling import UnsafeCheckpointError


def index(path: Location) -> Any:
    """A sharded checkpoint's index (torch DCP's ``.metadata``), unpickled restricted unless ``path`` is trusted."""
    return checked.index(path)


def meta(path: Location) -> Dict[str, Any]:
    """A sharded checkpoint's ``meta.pt``: everything but the model and optimizer states."""
    name = path / _format.METADATA_FILENAME
    try:
        content = checked.load_member(path, _format.METADATA_FILENAME)
    except (UnsafeCheckpointError, _checksums.DamagedCheckpointError):
        raise
    except Exception as error:
        raise ValueError(f"{str(name)!r} cannot be read ({describe(error)}). The checkpoint is damaged; resume from"
                         " another one.") from error
    if not isinstance(content, dict):
        raise ValueError(f"{str(name)!r} holds a {type(content).__name__}, not a checkpoint's metadata dict.")
    return dict(content)  # the caller's to change; read once per location


def full(path: Location, required: Optional[str] = "state_dict", checked_together: bool = False) -> Dict[str, Any]:
    """A full checkpoint file, memory-mapped where torch allows; ``required``: an entry it must have;
    ``checked_together``: every rank's ``checked.check_file_together`` checked it."""
    try:
        checkpoint = path.once("load", lambda: checked.load_file(path, lazy=True, checked_together=checked_together))
    except (UnsafeCheckpointError, _checksums.DamagedCheckpointError):
        raise
    except Exception as error:
        raise ValueError(
            f"The file {str(path)!r} is not a checkpoint torch can read ({describe(error)}). Pass a checkpoint"
            " written by `Trainer.save_checkpoint`, `ModelCheckpoint` or `Fabric.save`."
        ) from error
    if not isinstance(checkpoint, dict):
        raise ValueError(f"The file {str(path)!r} holds a {type(checkpoint).__name__}, not a checkpoint's dict.")
    if required is not None and required not in checkpoint:
        raise ValueError(
            f"The file {str(path)!r} is not a Lightning checkpoint: it has no {required!r}. Pass the path of a"
            " checkpoint written by `Trainer.save_checkpoint` or `ModelCheckpoint`."
        )
    return dict(checkpoint)  # the caller's to change; read once per location


def entries(path: Location, kind: str) -> Set[Any]:
    """The top-level entries of a complete checkpoint: a full file's keys; a sharded one's stored objects
    (modules and optimizers, from its index) and the keys of its ``meta.pt``."""
    if kind == _format.FULL:
        return set(full(path, required=None))
    shards = index(path)
    paths = getattr(shards, "planner_data", None) or {}
    if paths:  # each flattened key's path of nested keys, from the saved dict down
        stored = {nested[0] for nested in paths.values() if nested}
    else:
        stored = {key.partition(".")[0] for key in shards.state_dict_metadata}
    return stored | set(meta(path))
