"""Checkpoints whose pickles run code when they are unpickled, made as someone with write access to a checkpoint
would make them: a copy of a real checkpoint with one pickle site poisoned. The hidden code makes a directory
(``marker``), a side effect on disk that the tests look for: it exists if and only if the code ran.

The sites are every pickle this package reads: a sharded checkpoint's ``meta.pt``, its DCP index ``.metadata`` and a
pickled (non-tensor) entry of its shards, and a full checkpoint file.
"""
import dataclasses
import io
import os
import pickle
import shutil
from pathlib import Path

import torch

from support.damage import without_checksums

SHARDED_SITES = ("meta.pt", ".metadata", "entry")
FULL_SITE = "full"


def ran(marker: str, value=None):
    """What the hidden code does: make ``marker`` (each time it is unpickled: by every rank, by each read), then stand
    for ``value``, so that a checkpoint loaded with trust works as before. Any callable could stand here."""
    os.makedirs(marker, exist_ok=True)
    return value


class Hidden:
    """Unpickling it calls ``ran(marker, value)``."""

    def __init__(self, marker: Path, value=None) -> None:
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return (ran, (self.marker, self.value))


def poisoned(src: Path, dst: Path, site: str, marker: Path) -> Path:
    """A copy of the checkpoint ``src`` at ``dst`` whose ``site`` runs ``ran(marker)`` when unpickled."""
    if src.is_dir():
        shutil.copytree(src, dst)
        # whoever rewrites a pickle drops the checksums too (they would refuse the rewritten file as damaged first)
        if (dst / ".metadata").is_file():
            without_checksums(dst)
    else:
        shutil.copyfile(src, dst)
    if site in (FULL_SITE, "meta.pt"):
        target = dst if site == FULL_SITE else dst / "meta.pt"
        content = torch.load(target, weights_only=False)
        content["hidden"] = Hidden(marker)
        torch.save(content, target)
    elif site == ".metadata":
        index = pickle.loads((dst / ".metadata").read_bytes())
        index.hidden = Hidden(marker)  # pickled with the index's own attributes
        (dst / ".metadata").write_bytes(pickle.dumps(index))
    elif site == "entry":
        _poison_an_entry(dst, marker)
    else:
        raise ValueError(site)
    return dst


def _poison_an_entry(directory: Path, marker: Path) -> None:
    """The first pickled entry of the shards (an optimizer's param groups, say) replaced by a pickle of ``Hidden``
    standing for the entry's value, appended to its shard file, the index pointing there."""
    index = pickle.loads((directory / ".metadata").read_bytes())
    entry, info = next((entry, info) for entry, info in index.storage_data.items()
                       if not hasattr(index.state_dict_metadata[entry.fqn], "chunks"))
    shard = directory / info.relative_path
    with open(shard, "rb") as handle:
        handle.seek(info.offset)
        value = torch.load(io.BytesIO(handle.read(info.length)), weights_only=False)
    buffer = io.BytesIO()
    torch.save(Hidden(marker, value), buffer)
    offset = shard.stat().st_size
    with open(shard, "ab") as handle:
        handle.write(buffer.getvalue())
    index.storage_data[entry] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    (directory / ".metadata").write_bytes(pickle.dumps(index))
