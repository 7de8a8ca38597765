"""Checkpoints at URLs (``s3://``, ``gs://``, ``memory://``: any fsspec protocol), and how a save to one is made
crash-safe where there is no atomic rename. Plain storage work through fsspec: no torch.

Object stores write one object at a time, and an object appears only once its upload is complete; a prefix
("directory") cannot be renamed in one step. So a save never writes at the checkpoint's URL until it is complete:

- a **sharded** checkpoint is written under a fresh data prefix beside its URL (``.fsdp-resume-data-<token>/``,
  an ordinary sharded directory: the shards, ``.metadata``, ``meta.pt``); when every rank has written its part,
  rank 0 writes the checkpoint's URL itself as one small JSON object, the *pointer*, naming that prefix. Writing
  the pointer is the commit. Readers follow it; a prefix no pointer names is a save that did not finish and is
  never read.
- a **full** checkpoint is written as a data object beside the URL, then copied to the URL in one server-side copy
  (atomic on object stores): the URL holds an ordinary checkpoint file that any Lightning reads.

Until the commit the URL keeps the previous checkpoint, whole; after it, the previous data goes. Leftovers of saves
that stopped are removed by the next save into the same directory. A URL may also hold what other tools put there:
a checkpoint file, or a sharded directory uploaded as it is; both read as they are.
"""
import json
import posixpath
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Union

from . import _format

_DATA = ".fsdp-resume-data-"  # never contains "last": Lightning's ckpt_path="last" must not pick it
POINTER_FORMAT = "lightning_fsdp_resume.pointer"
_POINTER_VERSION = 1
_POINTER_MAX_BYTES = 1024
_POINTER_START = b'{"' + POINTER_FORMAT.encode()


class RemotePath:
    """What the checkpoint code asks of a ``pathlib.Path``, at a URL: ``/``, ``name``, ``parent``, ``exists()``,
    ``is_file()``, ``is_dir()``, ``iterdir()``, ``stat().st_size``, ``open()``, ``mkdir()``. ``str()`` is the URL.

    Every question goes to the store: fsspec's listing cache would answer from before another rank's writes.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path.rstrip("/")

    def __truediv__(self, name: str) -> "RemotePath":
        return RemotePath(self.fs, f"{self.path}/{name}")

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(self.fs, posixpath.dirname(self.path))

    def _fresh(self) -> Any:
        self.fs.invalidate_cache()
        return self.fs

    def exists(self) -> bool:
        return bool(self._fresh().exists(self.path))

    def is_file(self) -> bool:
        return bool(self._fresh().isfile(self.path))

    def is_dir(self) -> bool:
        return bool(self._fresh().isdir(self.path))

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator["RemotePath"]:
        for entry in self._fresh().ls(self.path, detail=False):
            yield RemotePath(self.fs, entry)

    def stat(self) -> Any:
        return _Stat(int(self._fresh().size(self.path)))

    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.path, mode)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        if self.bucket() is None:  # an object store has no directories, and its makedirs would create a bucket
            self.fs.makedirs(self.path, exist_ok=True)

    def bucket(self) -> Optional[str]:
        """The bucket (container) of an object store's path; None for file systems without buckets."""
        split = getattr(self.fs, "split_path", None)  # s3fs, gcsfs, adlfs
        return split(self.path)[0] if split is not None else None

    def read_bytes(self, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
        """The object's bytes, or those in [start, end): one request, no read-ahead."""
        return bytes(self._fresh().cat_file(self.path, start=start, end=end))

    def write_bytes(self, data: bytes) -> None:
        """One object in one request: it appears whole or not at all."""
        self.fs.pipe_file(self.path, data)

    def remove(self) -> None:
        if self.exists():
            self.fs.rm(self.path, recursive=True)


class _Stat:
    def __init__(self, size: int) -> None:
        self.st_size = size


AnyPath = Union[Path, RemotePath]


def location(target: Any, action: str) -> AnyPath:
    """The local path or the URL ``target`` names. ``file://`` URLs are local paths; any other URL is opened with
    its fsspec implementation, and one that is not installed is refused with what to install. ``action`` ("save",
    "load", ...) says in the error what could not be done."""
    text = str(target)
    if not _format.is_url(text):
        return Path(target)
    try:
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(text)
    except (ImportError, ValueError) as error:
        extra = " (for s3://: pip install 'lightning-fsdp-resume[s3]')" if text.startswith(("s3://", "s3a://")) else ""
        raise ImportError(
            f"Cannot {action} the checkpoint {text!r}: its protocol has no fsspec implementation here ({error})."
            f" Install it{extra} on every node. Nothing was written."
        ) from error
    if is_local(fs):
        return Path(path)
    return RemotePath(fs, path)


def is_local(fs: Any) -> bool:
    """Whether an fsspec file system is the local one (``file://``)."""
    protocol = fs.protocol
    return "file" in ([protocol] if isinstance(protocol, str) else list(protocol))


class RemoteCheckpointError(OSError):
    """A save to a URL that did not complete; nothing of it was committed."""


def check_bucket(path: RemotePath) -> None:
    """A save never creates a bucket: one that does not exist (or that these credentials cannot see) is refused."""
    bucket = path.bucket()
    if bucket is None:
        return
    try:
        path.fs.ls(bucket)  # needs only the permission to list it; a missing bucket is FileNotFoundError
    except FileNotFoundError:
        raise FileNotFoundError(
            f"Cannot save the checkpoint {str(path)!r}: the bucket {bucket!r} does not exist, or these credentials cannot"
            " see it. Create it, or name another; nothing was written."
        ) from None
    except Exception:
        pass  # not allowed to list, say: the save itself tells what the store refuses


def save_failed(path: RemotePath, error: BaseException) -> RemoteCheckpointError:
    """The error every rank raises for a save to ``path`` that failed with ``error`` (any rank's)."""
    return RemoteCheckpointError(
        f"Could not save the checkpoint {str(path)!r}: {describe_failure(error)}. Nothing of this save was committed: the URL"
        " holds what it held before, and what the save wrote goes with the next save into that directory. Check the"
        " store's permissions, the bucket and the network, then save again."
    )


def describe_failure(error: BaseException) -> str:
    """The first failure behind ``error``: torch.distributed.checkpoint reports every rank's in ``failures``."""
    where = ""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = sorted(failures.items(), key=lambda item: item[0])[0]
        error = failure[0] if isinstance(failure, tuple) else failure
        where = f" (on rank {rank})"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}{where}"


# --- the commit protocol ----------------------------------------------------------------------------------------


def data_path(path: RemotePath, token: str) -> RemotePath:
    """Where a save to ``path`` writes its data: a fresh sibling prefix (sharded) or object (full)."""
    return path.parent / f"{_DATA}{token}"


def pointer_data(path: RemotePath) -> Optional[RemotePath]:
    """The data the pointer at ``path`` names; None where ``path`` is not a pointer."""
    if not path.is_file():
        return None
    return _named_data(path, path.stat().st_size)


def _named_data(path: RemotePath, size: int) -> Optional[RemotePath]:
    if size > _POINTER_MAX_BYTES:
        return None
    content = path.read_bytes()
    if not content.startswith(_POINTER_START):
        return None
    try:
        pointer = json.loads(content.decode())
        name = pointer["data"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"The checkpoint pointer {str(path)!r} is damaged ({error}). Resume from another checkpoint.") from error
    if pointer.get(POINTER_FORMAT, 0) > _POINTER_VERSION:
        raise ValueError(
            f"The checkpoint pointer {str(path)!r} is of a newer format ({pointer[POINTER_FORMAT]}) than this"
            f" lightning_fsdp_resume reads ({_POINTER_VERSION}). Upgrade lightning_fsdp_resume."
        )
    return path.parent / name


def resolve(path: AnyPath) -> AnyPath:
    """What to read for the checkpoint at ``path``: the data its pointer names, else ``path`` itself."""
    if not isinstance(path, RemotePath):
        return path
    data = pointer_data(path)
    if data is None:
        return path
    if not data.exists():
        raise FileNotFoundError(
            f"The checkpoint {str(path)!r} names its data {str(data)!r}, which does not exist: it was removed by"
            " something other than this package. Resume from another checkpoint."
        )
    return data


def commit(data: RemotePath, path: RemotePath) -> None:
    """Make the complete sharded checkpoint at ``data`` the one at ``path``: write its pointer, then remove the
    data the pointer named before."""
    previous = pointer_data(path)
    pointer = {POINTER_FORMAT: _POINTER_VERSION, "kind": _format.SHARDED, "data": data.name}
    path.write_bytes(json.dumps(pointer).encode())
    if previous is not None and previous != data:
        previous.remove()


def write_file(path: RemotePath, partial: RemotePath, write: Callable[[RemotePath], None]) -> None:
    """The one writer of single-file checkpoints at URLs: ``write(partial)``, then ``publish_file``. ``path`` keeps
    what it held until then; a failed write leaves nothing behind."""
    previous = pointer_data(path)
    try:
        write(partial)
        publish_file(partial, path)
    finally:
        partial.remove()
    if previous is not None:  # a sharded checkpoint replaced by a full one: its data
        previous.remove()


def publish_file(partial: RemotePath, path: RemotePath) -> None:
    """One server-side copy: the object at ``path`` is replaced whole or not at all."""
    path.fs.copy(partial.path, path.path)


def remove(path: RemotePath) -> None:
    """Remove the checkpoint at ``path``: its pointer first, so that nothing half-removed is ever read."""
    data = pointer_data(path)
    path.remove()
    if data is not None:
        data.remove()


def leftovers(directory: RemotePath) -> List[RemotePath]:
    """Data in ``directory`` that no pointer there names: saves that did not finish. One listing, and one read of
    each object small enough to be a pointer."""
    if not directory.is_dir():
        return []
    entries = [(RemotePath(directory.fs, info["name"]), info) for info in directory.fs.ls(directory.path, detail=True)]
    named = set()
    for entry, info in entries:
        if info.get("type") == "file" and not entry.name.startswith(_DATA):
            try:
                data = _named_data(entry, int(info.get("size") or 0))
            except ValueError:
                return []  # a damaged pointer may name any of them: remove none
            if data is not None:
                named.add(data.name)
    return [entry for entry, _ in entries if entry.name.startswith(_DATA) and entry.name not in named]
