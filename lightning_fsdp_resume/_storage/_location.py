"""What every store answers for a checkpoint's place in it: ``Location``, which ``_local`` and ``_objects`` implement.
Its reads hand out bytes unchecked: everything else reads a checkpoint through ``_checked``."""
import contextlib
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, TypeVar

from .._checkpoint import _format


class Entry(NamedTuple):
    """What one question to the store tells of a path: a directory, or a file of ``size`` bytes."""

    is_dir: bool
    size: int = 0


def not_replaceable(path: Any) -> IsADirectoryError:
    """A save's refusal of a directory at its path that is not a sharded checkpoint this package saved there."""
    return IsADirectoryError(
        f"The checkpoint path exists and is a directory: {path}. It is not a sharded checkpoint this package"
        " saved there, so saving would replace its contents. Choose another path or remove the directory."
    )


_L = TypeVar("_L", bound="Location")


class Location:
    """A path in one store (see ``_storage``). The methods below are what both stores implement."""

    # Whether the pickles read here may name any callable: the user's ``weights_only=False``, for a source they
    # trust. Otherwise (the default) every pickle is read through ``_unpickling``'s restricted unpickler.
    trusted = False

    # Whether the processes of one machine read one copy of a file here (a file system's, through the page cache), so
    # that each can check a share of it for all; at an object store each downloads a copy of its own.
    one_copy = False

    # What ``once`` has read through this location, by key (made at its first read)
    _once: Optional[Dict[Any, Any]] = None

    # --- what a path answers ---
    def __truediv__(self, name: str) -> "Location":
        """The entry ``name`` of this directory: the same location each time it is asked (its ``once`` reads too),
        as trusted as this one."""
        return self.once(("entry", name), lambda: self._entry(name).trusting(self.trusted))

    def trusting(self: _L, trusted: bool) -> _L:
        """This location, its pickles read as ``trusted`` says (set once, when it is opened)."""
        self.trusted = trusted
        return self

    def _entry(self, name: str) -> "Location":
        raise NotImplementedError

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def parent(self) -> "Location":
        raise NotImplementedError

    def exists(self) -> bool:
        raise NotImplementedError

    def is_dir(self) -> bool:
        raise NotImplementedError

    def stat(self) -> Optional[Entry]:
        """What is here, in one question to the store; None where nothing is."""
        raise NotImplementedError

    def listing(self) -> Dict[str, Entry]:
        """This directory's entries by name, listed once per location (one request at a URL)."""
        return self.once("listing", self._list)

    def _list(self) -> Dict[str, Entry]:
        raise NotImplementedError

    def contains(self, other: "Location") -> bool:
        """Whether ``other`` lies inside this directory."""
        raise NotImplementedError

    # --- reading and writing files ---
    def read_bytes(self, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
        """The file's bytes, or those in [start, end)."""
        raise NotImplementedError

    def load_source(self) -> Any:
        """The file as ``torch.load`` reads it: a local filename (memory-mappable), or its bytes in memory (one
        request). Unchecked: ``_checked.load_file`` checks it."""
        raise NotImplementedError

    def writing(self) -> Any:
        """A context manager: a stream into the file, durable (synced, or uploaded) once the block ends."""
        raise NotImplementedError

    def write_bytes(self, data: bytes) -> None:
        """A small file written whole, durable before it is published."""
        raise NotImplementedError

    def mkdir(self) -> None:
        raise NotImplementedError

    def open(self, mode: str = "rb") -> Any:
        """The file as a stream (a single-file checkpoint's writer that streams: ``consolidate``'s safetensors)."""
        raise NotImplementedError

    def dcp_storage_writer(self) -> Any:
        """torch DCP's storage writer into this directory, as the store makes it (``_checked.writer`` hashes it)."""
        raise NotImplementedError

    def dcp_storage_reader(self) -> Any:
        """torch DCP's storage reader of this directory, unchecked (``_checked.reader`` checks it)."""
        raise NotImplementedError

    def once(self, key: Any, read: Callable[[], Any]) -> Any:
        """``read()`` the first time ``key`` is asked of this location, its result after: a load checks a checkpoint
        and then loads it through one location, reading each file once (at a URL, each read is a request)."""
        if self._once is None:
            self._once = {}
        done = self._once
        if key not in done:
            done[key] = read()
        return done[key]

    # --- putting a checkpoint in place, and taking it away ---
    def partial(self, token: str) -> "Location":
        """Where a save to this location writes until it is complete."""
        raise NotImplementedError

    def publish(self, partial: "Location") -> None:
        """Make the complete sharded checkpoint at ``partial`` the one here; the one it replaces becomes a leftover."""
        raise NotImplementedError

    def write_file(self, partial: "Location", write: Callable[["Location"], Any]) -> None:
        """The one writer of single-file checkpoints: ``write(partial)``, then put it here in one step. This location
        keeps what it held until then; a write that fails leaves nothing behind."""
        raise NotImplementedError

    def remove(self) -> None:
        """Remove the checkpoint here, in an order that never leaves a half-removed one readable."""
        raise NotImplementedError

    def remover(self, lightning_remove: Callable[[], None]) -> Callable[[], None]:
        """What removes the checkpoint here for ``ModelCheckpoint``: Lightning's own ``lightning_remove`` (its
        ``CheckpointIO``'s) where that removes it whole, else ``remove``."""
        return self.remove

    def remove_leftovers(self) -> None:
        """Once this checkpoint is published: the one it replaced and unfinished saves beside it go."""
        raise NotImplementedError

    def resolve(self) -> "Location":
        """What to read for the checkpoint here (at a URL, the data its pointer names)."""
        return self

    def check_destination(self, kind: _format.StateDictType) -> None:
        """Refuse a save of ``kind`` that would replace what is not a checkpoint (or, at a URL, create a bucket)."""
        raise NotImplementedError

    def missing(self) -> str:
        """Why nothing is here, beyond "it does not exist", where the store knows more ("" where it does not)."""
        return ""

    @contextlib.contextmanager
    def reported(self) -> Iterator[None]:
        """Around a save: its failure in this store's words, raised on every rank that sees it."""
        yield
