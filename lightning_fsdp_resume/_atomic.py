"""Putting a checkpoint at its path only once it is complete. Plain file-system work: no torch.

A save writes into a hidden *partial* sibling of the target; when every rank has finished, rank 0
puts it in place with one rename. Replacing an existing checkpoint swaps the two atomically where the
file system can (Linux ``renameat2(RENAME_EXCHANGE)``), so the old one stays intact until the new one
is complete. Where it cannot, the old one is renamed to a *previous* sibling first; a crash between
the two renames leaves it there, named in the error a load of the missing path raises.

Partial names never contain ``last``: Lightning's ``ckpt_path="last"`` takes the newest entry whose
name does, and must never pick a partial save.
"""
import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, List

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
