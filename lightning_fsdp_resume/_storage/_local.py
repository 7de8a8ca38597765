"""Checkpoints in a local directory (``LocalLocation``), put at their path only once complete: written into a hidden
partial sibling, renamed into place, swapped with the old one atomically where the file system can, else the old one
renamed aside first. Partial names never contain ``last``, which ``ckpt_path="last"`` looks for.
"""
import contextlib
import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from .._checkpoint import _format
from ._location import Entry, Location, not_replaceable

_PARTIAL = ".fsdp-resume-partial-"
_PREVIOUS = ".fsdp-resume-previous-"


def partial_path(path: Path, token: str) -> Path:
    """Where a save to ``path`` writes until it is complete: a hidden sibling, same file system."""
    return path.parent / f"{_PARTIAL}{token}"


def leftovers(directory: Path) -> List[Path]:
    """Partial and previous siblings left in ``directory`` by saves that did not finish."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.startswith(_PARTIAL) or _PREVIOUS in p.name)


def previous_of(path: Path) -> List[Path]:
    """Checkpoints moved aside from ``path`` by a save that stopped between its two renames."""
    return [p for p in leftovers(path.parent) if p.name.startswith(f"{path.name}{_PREVIOUS}")]


def publish(partial: Path, path: Path) -> None:
    """Put the complete ``partial`` at ``path``. A replaced checkpoint is left as a leftover: at ``partial``
    after an exchange, else at a previous sibling."""
    if not os.path.lexists(path):
        os.rename(partial, path)
    elif not path.is_dir() and not partial.is_dir():
        os.replace(partial, path)  # atomic for files
    elif not _exchange(partial, path):
        os.rename(path, path.parent / f"{path.name}{_PREVIOUS}{partial.name[len(_PARTIAL):]}")
        os.rename(partial, path)
    _sync_directory(path.parent)


def write_file(path: Path, partial: Path, write: Callable[[Path], None]) -> None:
    """The one writer of single-file checkpoints: ``write(partial)``, flushed to the disk, then put at ``path``
    by ``publish``. A write that fails leaves nothing behind; ``path`` keeps what it held."""
    path.parent.mkdir(parents=True, exist_ok=True)  # as a sharded save and Lightning's CheckpointIO do
    try:
        write(partial)
        sync_file(partial)
        publish(partial, path)
    except BaseException:
        remove(partial)
        raise


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def sync_file(path: Path) -> None:
    """Flush a written file to the disk, so that a rename never publishes data still in flight."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _sync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every platform opens directories; the rename itself is still atomic
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step; False where the platform or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False  # e.g. NFS: fall back to two renames
    raise OSError(code, os.strerror(code), str(second))


class LocalLocation(Location):
    """A path on this machine's file systems (``file://`` URLs included)."""

    one_copy = True

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def _entry(self, name: str) -> "LocalLocation":
        return LocalLocation(self.path / name)

    def __str__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"LocalLocation({str(self.path)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalLocation) and other.path == self.path

    def __hash__(self) -> int:
        return hash(self.path)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def parent(self) -> "LocalLocation":
        return LocalLocation(self.path.parent)

    def exists(self) -> bool:
        return self.path.exists()

    def is_dir(self) -> bool:
        return self.path.is_dir()

    def stat(self) -> Optional[Entry]:
        if self.path.is_dir():
            return Entry(True)
        return Entry(False, self.path.stat().st_size) if self.path.is_file() else None

    def _list(self) -> Dict[str, Entry]:
        found = {}
        for entry in self.path.iterdir():
            stat = LocalLocation(entry).stat()
            if stat is not None:
                found[entry.name] = stat
        return found

    def contains(self, other: Location) -> bool:
        return isinstance(other, LocalLocation) and self.path.resolve() in other.path.resolve().parents

    def read_bytes(self, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
        with open(self.path, "rb") as handle:
            handle.seek(start or 0)
            return handle.read(-1 if end is None else end - (start or 0))

    def load_source(self) -> Any:
        return str(self.path)  # a str: torch 2.1 and 2.2 memory-map no Path

    @contextlib.contextmanager
    def writing(self) -> Iterator[Any]:
        with open(self.path, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())

    def write_bytes(self, data: bytes) -> None:
        with self.writing() as handle:
            handle.write(data)

    def mkdir(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def open(self, mode: str = "rb") -> Any:
        return open(self.path, mode)

    def dcp_storage_writer(self) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemWriter(str(self.path), single_file_per_rank=True)

    def dcp_storage_reader(self) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.FileSystemReader(str(self.path))

    def partial(self, token: str) -> "LocalLocation":
        return LocalLocation(partial_path(self.path, token))

    def publish(self, partial: Location) -> None:
        publish(_local(partial), self.path)

    def write_file(self, partial: Location, write: Callable[[Location], Any]) -> None:
        write_file(self.path, _local(partial), lambda written: write(LocalLocation(written)))

    def remove(self) -> None:
        remove(self.path)

    def remover(self, lightning_remove: Callable[[], None]) -> Callable[[], None]:
        return lightning_remove  # a file or a directory, removed whole by Lightning's CheckpointIO

    def remove_leftovers(self) -> None:
        for leftover in leftovers(self.path.parent):
            remove(leftover)

    def check_destination(self, kind: _format.StateDictType) -> None:
        if not self.path.is_dir():
            return
        if not (_format.is_replaceable_directory(self.path) and (kind == _format.SHARDED or any(self.path.iterdir()))):
            raise not_replaceable(self)

    def missing(self) -> str:
        moved = previous_of(self.path)
        if not moved:
            return ""
        return (
            f" A save into it stopped between its two renames and left the previous checkpoint at"
            f" {str(moved[-1])!r}: rename that to {str(self.path)!r} to resume from it."
        )


def _local(location: Location) -> Path:
    assert isinstance(location, LocalLocation), location  # a partial is always of its target's store
    return location.path
