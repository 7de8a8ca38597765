"""Checks made before anything is loaded: a checkpoint that is incomplete, damaged or for another model
is refused with the path, what was found and what to do. Its index and ``meta.pt`` are read by ``_reader``, where
the load then finds them read; nothing here writes to the checkpoint.
"""
from typing import Any, Dict, Iterable, Optional, Set, Tuple

from .._save_load._ranks import describe
from .._storage import Location, checked
from . import _checksums, _format, _reader, _zip_checks
from ._unpickling import UnsafeCheckpointError

SHARDED, FULL = _format.SHARDED, _format.FULL
_INDEX = _format.DCP_METADATA_FILENAME


class MissingCheckpointError(FileNotFoundError, ValueError):
    """A checkpoint path that does not exist. Native Lightning 2.1 raises ``ValueError`` here ("does not
    point to a valid checkpoint"); a ``FileNotFoundError`` says better what happened. It is both."""


def not_a_checkpoint(path: Location) -> str:
    """Native Lightning 2.1's phrase for a path it cannot load, so that code matching it keeps matching."""
    return f"The path {str(path)!r} does not point to a valid checkpoint"


def checkpoint_kind(path: Location) -> _format.StateDictType:
    """``"sharded"`` or ``"full"`` for a complete checkpoint at ``path``; raises otherwise. Unless ``path`` is trusted,
    every pickle of a sharded one (its index, its pickled entries, ``meta.pt``) is unpickled restricted here, before
    anything loads: one that names a callable not admitted raises ``UnsafeCheckpointError``."""
    entry = path.stat()
    if entry is None:
        raise MissingCheckpointError(_missing(path))
    if not entry.is_dir:
        if entry.size == 0:
            raise ValueError(f"The checkpoint file {str(path)!r} is empty. {_format.RESUME_ELSEWHERE}")
        return FULL
    _check_sharded(path)
    return SHARDED


def _missing(path: Location) -> str:
    return f"{not_a_checkpoint(path)}: it does not exist.{path.missing()}"


def _check_sharded(path: Location) -> None:
    index = path / _INDEX
    incomplete = " Its save did not finish or it was damaged; resume from another checkpoint."
    files = path.listing()  # one listing answers for every file below
    if not files:
        raise ValueError(f"{not_a_checkpoint(path)}: it is an empty directory.")
    has_meta, has_index = (_file_size(files.get(name)) is not None for name in (_format.METADATA_FILENAME, _INDEX))
    if not has_meta and not has_index:
        raise ValueError(
            f"{not_a_checkpoint(path)}: the directory has neither {_format.METADATA_FILENAME!r} nor the shard index"
            f" {_INDEX!r}. Pass a sharded checkpoint directory or a full checkpoint file."
        )
    if not has_meta:
        raise ValueError(f"{not_a_checkpoint(path)}: the sharded checkpoint has no {_format.METADATA_FILENAME!r}." + incomplete)
    if not has_index:
        raise ValueError(f"The sharded checkpoint {str(path)!r} has no shard index {_INDEX!r}." + incomplete)
    sums = checked.sums(path)
    if sums is None:
        _zip_checks.unchecked(str(path))
    else:  # every file the save wrote, at the size it wrote: a truncated or swapped one is refused before any read
        for relative, file_sums in sums.items():
            file_sums.check_size(listed_size(path, files, relative))
    try:
        shards = _reader.index(path)
    except (UnsafeCheckpointError, _checksums.DamagedCheckpointError):
        raise
    except Exception as error:
        raise ValueError(f"The shard index {str(index)!r} cannot be read ({describe(error)})." + incomplete) from error
    for relative, needed in _bytes_needed(shards).items():
        shard = path / relative
        size = listed_size(path, files, relative)
        if size is None:
            raise ValueError(f"The shard file {str(shard)!r} is missing." + incomplete)
        if size < needed:
            raise ValueError(f"The shard file {str(shard)!r} is truncated: {size} bytes, {needed} expected." + incomplete)
    if not path.trusted:
        _unpickle_entries(path, shards)
    _reader.meta(path)


def _unpickle_entries(path: Location, shards: Any) -> None:
    """Every pickled entry of the index (param groups and the like), unpickled restricted: DCP unpickles them with no
    restriction, after the weights have loaded."""
    checked.load_items(path, [info for entry, info in shards.storage_data.items()
                              if _format.is_pickled_entry(shards.state_dict_metadata[entry.fqn])])


def listed_size(path: Location, files: Dict[str, Any], relative: str) -> Optional[int]:
    """The size of the file ``relative`` in the directory ``path`` whose ``files`` were listed (one listing answers
    for the top level; a file below it is asked alone); None where there is no such file."""
    return _file_size(files.get(relative) if "/" not in relative else (path / relative).stat())


def _file_size(entry: Any) -> Optional[int]:
    """The size of a file a listing or a stat found (a ``_storage`` entry); None where it found no file."""
    return None if entry is None or entry.is_dir else entry.size


def _bytes_needed(shards: Any) -> Dict[str, int]:
    """Per shard file, the smallest size that holds every item the index places in it."""
    needed: Dict[str, int] = {}
    for info in shards.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def stored_model_shapes(shards: Any, key: str = _format.MODEL_KEY) -> Dict[str, Optional[Tuple[int, ...]]]:
    """The entries a sharded checkpoint's index lists under ``key`` (a module's weights), with their global
    shapes (None: not a tensor)."""
    prefix = f"{key}."
    return {
        name[len(prefix) :]: tuple(entry.size) if hasattr(entry, "size") else None
        for name, entry in shards.state_dict_metadata.items()
        if name.startswith(prefix)
    }


def tensor_shapes(state: Dict[str, Any]) -> Dict[str, Optional[Tuple[int, ...]]]:
    """Global shapes of a state dict's entries: sharded tensors report the whole tensor's size."""
    return {key: tuple(value.size()) if hasattr(value, "size") else None for key, value in state.items()}


# How to load the keys a module and its checkpoint both have, by who loads: the Trainer's setting, Fabric's argument.
TRAINER_LENIENCY = "Set `strict_loading = False` on the LightningModule to load the keys both have."
FABRIC_LENIENCY = "Pass `strict=False` to load the keys both have."


def loadable_keys(
    path: Location,
    expected: Dict[str, Optional[Tuple[int, ...]]],
    stored: Dict[str, Optional[Tuple[int, ...]]],
    strict: bool,
    leniency: str = TRAINER_LENIENCY,
) -> Set[str]:
    """The model keys to load; refuses a checkpoint of another model (``strict``: any key difference, with
    ``leniency`` saying how to load the keys both have)."""
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    # Each problem in the words torch's load_state_dict uses, which native Lightning shows for a full checkpoint.
    problems = []
    for key in sorted(set(expected) & set(stored)):
        saved, wanted = stored[key], expected[key]
        if saved is not None and wanted is not None and saved != wanted:
            problems.append(
                f"size mismatch for {key}: copying a param with shape {_size(saved)} from checkpoint, the shape in"
                f" current model is {_size(wanted)}."
            )
    mis_shaped = bool(problems)
    if strict and missing:
        problems.append(f"Missing key(s) in state_dict: {_listing(missing)}.")
    if strict and unexpected:
        problems.append(f"Unexpected key(s) in state_dict: {_listing(unexpected)}.")
    if problems:
        hint = "" if mis_shaped else f"\n{leniency}"
        raise RuntimeError(
            f"The checkpoint {str(path)!r} does not fit this model. Error(s) in loading state_dict:\n\t"
            + "\n\t".join(problems) + hint
        )
    return set(expected) & set(stored)


def weights_only_error(path: Location) -> KeyError:
    return KeyError(
        "Trying to restore optimizer state but checkpoint contains only the model. This is probably due to"
        f" `ModelCheckpoint.save_weights_only` being set to `True`. (Checkpoint: {str(path)!r}.) Load the weights"
        " with `LightningModule.load_from_checkpoint` and call `fit` without `ckpt_path`, or resume from a"
        " checkpoint with optimizer states."
    )


def _size(shape: Tuple[int, ...]) -> str:
    return f"torch.Size({list(shape)})"


def _listing(items: Iterable[str], limit: int = 8) -> str:
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")

