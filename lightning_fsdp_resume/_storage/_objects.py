"""Checkpoints at URLs (``s3://``, ``gs://``, ``memory://``: any fsspec protocol; ``ObjectLocation``), crash-safe with
no atomic rename: a sharded save goes under a fresh data prefix, committed by writing a JSON pointer at the URL; a full
one is copied onto the URL server-side. Until then the URL keeps the previous checkpoint, whole.
"""
import contextlib
import io
import json
import posixpath
from typing import Any, Callable, Dict, Iterator, List, Optional

from .._checkpoint import _format
from .._patching import _torch_compat as compat
from .._save_load._ranks import describe
from ._location import Entry, Location, not_replaceable

_DATA = ".fsdp-resume-data-"  # never contains "last": Lightning's ckpt_path="last" must not pick it
POINTER_FORMAT = "lightning_fsdp_resume.pointer"
_POINTER_VERSION = 1
_POINTER_MAX_BYTES = 1024
_POINTER_START = b'{"' + POINTER_FORMAT.encode()


class ObjectLocation(Location):
    """A path at a URL, in the store of fsspec file system ``fs``. ``str()`` is the URL.

    Every question goes to the store: fsspec's listing cache would answer from before another rank's writes.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self.fs = fs
        self.path = path.rstrip("/")

    def _entry(self, name: str) -> "ObjectLocation":
        return ObjectLocation(self.fs, f"{self.path}/{name}")

    def __str__(self) -> str:
        return self.fs.unstrip_protocol(self.path)

    def __repr__(self) -> str:
        return f"ObjectLocation({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectLocation) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> "ObjectLocation":
        return ObjectLocation(self.fs, posixpath.dirname(self.path))

    def _fresh(self) -> Any:
        self.fs.invalidate_cache()
        return self.fs

    def exists(self) -> bool:
        return bool(self._fresh().exists(self.path))

    def is_dir(self) -> bool:
        return bool(self._fresh().isdir(self.path))

    def stat(self) -> Optional[Entry]:
        try:
            info = self._fresh().info(self.path)
        except FileNotFoundError:
            return None
        return _entry_of(info)

    def _list(self) -> Dict[str, Entry]:
        return {posixpath.basename(info["name"].rstrip("/")): _entry_of(info) for info in self._fresh().ls(self.path, detail=True)}

    def contains(self, other: Location) -> bool:
        return isinstance(other, ObjectLocation) and other.path.startswith(self.path + "/")

    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.path, mode)

    def mkdir(self) -> None:
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

    def remove_object(self) -> None:
        """The object or prefix here, whatever it is."""
        if self.exists():
            self.fs.rm(self.path, recursive=True)

    def load_source(self) -> Any:
        return io.BytesIO(self.read_bytes())  # whole, in one request: an object cannot be memory-mapped

    @contextlib.contextmanager
    def writing(self) -> Iterator[Any]:
        """One object: it appears once its upload is complete."""
        with self.fs.open(self.path, "wb") as handle:
            yield handle

    def dcp_storage_writer(self) -> Any:
        return compat.dcp_fsspec_writer(str(self))

    def dcp_storage_reader(self) -> Any:
        # Each rank reads its items in the plan's order, not by offset: s3fs's read-ahead cache then fetches a new
        # block for most items (a 403 MB sharded resume from a local S3 server took 2.2 times as long); a block
        # cache fetches each block once.
        options = {"default_cache_type": "blockcache"} if hasattr(self.fs, "default_cache_type") else {}
        return compat.dcp_fsspec_reader(str(self), **options)

    def partial(self, token: str) -> "ObjectLocation":
        """A fresh sibling prefix (sharded) or object (full)."""
        return self.parent._entry(f"{_DATA}{token}")

    def publish(self, partial: Location) -> None:
        commit(_objects(partial), self)

    def write_file(self, partial: Location, write: Callable[[Location], Any]) -> None:
        write_file(self, _objects(partial), write)

    def remove(self) -> None:
        remove(self)

    def remove_leftovers(self) -> None:
        for leftover in leftovers(self.parent):
            leftover.remove_object()

    def resolve(self) -> "ObjectLocation":
        return resolve(self).trusting(self.trusted)

    def check_destination(self, kind: _format.StateDictType) -> None:
        check_bucket(self)
        if self.is_dir():
            raise not_replaceable(self)

    @contextlib.contextmanager
    def reported(self) -> Iterator[None]:
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            raise save_failed(self, error) from error


def _entry_of(info: Dict[str, Any]) -> Entry:
    if info.get("type") == "directory":
        return Entry(True)
    return Entry(False, int(info.get("size") or 0))


def _objects(location: Location) -> "ObjectLocation":
    assert isinstance(location, ObjectLocation), location  # a partial is always of its target's store
    return location


class RemoteCheckpointError(OSError):
    """A save to a URL that did not complete; nothing of it was committed."""


def check_bucket(path: ObjectLocation) -> None:
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


def save_failed(path: ObjectLocation, error: BaseException) -> RemoteCheckpointError:
    """The error every rank raises for a save to ``path`` that failed with ``error`` (any rank's)."""
    return RemoteCheckpointError(
        f"Could not save the checkpoint {str(path)!r}: {describe(error)}. Nothing of this save was committed: the URL"
        " holds what it held before, and what the save wrote goes with the next save into that directory. Check the"
        " store's permissions, the bucket and the network, then save again."
    )


# --- the commit protocol ----------------------------------------------------------------------------------------


def pointer_data(path: ObjectLocation) -> Optional[ObjectLocation]:
    """The data the pointer at ``path`` names; None where ``path`` is not a pointer."""
    entry = path.stat()
    if entry is None or entry.is_dir:
        return None
    return _named_data(path, entry.size)


def _named_data(path: ObjectLocation, size: int) -> Optional[ObjectLocation]:
    if size > _POINTER_MAX_BYTES:
        return None
    content = path.read_bytes()
    if not content.startswith(_POINTER_START):
        return None
    try:
        pointer = json.loads(content.decode())
        name = pointer["data"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"The checkpoint pointer {str(path)!r} is damaged ({error}). {_format.RESUME_ELSEWHERE}") from error
    if pointer.get(POINTER_FORMAT, 0) > _POINTER_VERSION:
        raise ValueError(
            f"The checkpoint pointer {str(path)!r} is of a newer format ({pointer[POINTER_FORMAT]}) than this"
            f" lightning_fsdp_resume reads ({_POINTER_VERSION}). Upgrade lightning_fsdp_resume."
        )
    return path.parent / name


def resolve(path: ObjectLocation) -> ObjectLocation:
    """What to read for the checkpoint at ``path``: the data its pointer names, else ``path`` itself."""
    data = pointer_data(path)
    if data is None:
        return path
    if not data.exists():
        raise FileNotFoundError(
            f"The checkpoint {str(path)!r} names its data {str(data)!r}, which does not exist: it was removed by"
            f" something other than this package. {_format.RESUME_ELSEWHERE}"
        )
    return data


def commit(data: ObjectLocation, path: ObjectLocation) -> None:
    """Make the complete sharded checkpoint at ``data`` the one at ``path``: write its pointer, then remove the
    data the pointer named before."""
    previous = pointer_data(path)
    pointer = {POINTER_FORMAT: _POINTER_VERSION, "kind": _format.SHARDED, "data": data.name}
    path.write_bytes(json.dumps(pointer).encode())
    if previous is not None and previous != data:
        previous.remove_object()


def write_file(path: ObjectLocation, partial: ObjectLocation, write: Callable[[Location], None]) -> None:
    """The one writer of single-file checkpoints at URLs: ``write(partial)``, then ``publish_file``. ``path`` keeps
    what it held until then; a failed write leaves nothing behind."""
    previous = pointer_data(path)
    try:
        write(partial)
        publish_file(partial, path)
    finally:
        partial.remove_object()
    if previous is not None:  # a sharded checkpoint replaced by a full one: its data
        previous.remove_object()


def publish_file(partial: ObjectLocation, path: ObjectLocation) -> None:
    """One server-side copy: the object at ``path`` is replaced whole or not at all."""
    path.fs.copy(partial.path, path.path)


def remove(path: ObjectLocation) -> None:
    """Remove the checkpoint at ``path``: its pointer first, so that nothing half-removed is ever read."""
    data = pointer_data(path)
    path.remove_object()
    if data is not None:
        data.remove_object()


def leftovers(directory: ObjectLocation) -> List[ObjectLocation]:
    """Data in ``directory`` that no pointer there names: saves that did not finish. One listing, and one read of
    each object small enough to be a pointer."""
    if not directory.is_dir():
        return []
    entries = [(ObjectLocation(directory.fs, info["name"]), info) for info in directory.fs.ls(directory.path, detail=True)]
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
