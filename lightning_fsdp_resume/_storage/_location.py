"""What every store answers for a checkpoint's place in it: ``Location``, which ``_local`` and ``_objects`` implement."""
import contextlib
import io
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, TypeVar

from .. import _format, _unpickling


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
_ENTRIES_SPAN = 64 * 2**20  # the most bytes read at once for pickled entries, tensors between them included


class Location:
    """A path in one store (see ``_storage``). The methods below are what both stores implement."""

    # Whether the pickles read here may name any callable: the user's ``weights_only=False``, for a source they
    # trust. Otherwise (the default) every pickle is read through ``_unpickling``'s restricted unpickler.
    trusted = False

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

    def load(self, lazy: bool = False, map_location: Any = "cpu") -> Any:
        """``torch.load`` of the file (onto the CPU unless ``map_location`` says otherwise), restricted unless the
        location is ``trusted``; ``lazy``: memory-mapped where the store and torch allow."""
        raise NotImplementedError

    def load_items(self, infos: List[Any]) -> List[Any]:
        """Pickled (non-tensor) entries of the sharded checkpoint here, ``infos`` their ``storage_data`` records,
        unpickled as ``load`` unpickles. DCP writes a file's pickled entries before its tensors, so each file's are
        read in one request (at a URL) where they lie within ``_ENTRIES_SPAN`` bytes of each other, else one by one."""
        by_file: Dict[str, List[int]] = {}
        for number, info in enumerate(infos):
            by_file.setdefault(info.relative_path, []).append(number)
        loaded: Dict[int, Any] = {}
        for relative, numbers in by_file.items():
            shard = self / relative
            start, end = min(infos[n].offset for n in numbers), max(infos[n].offset + infos[n].length for n in numbers)
            whole = shard.read_bytes(start, end) if end - start <= _ENTRIES_SPAN else None
            for n in numbers:
                offset, length = infos[n].offset, infos[n].length
                data = shard.read_bytes(offset, offset + length) if whole is None else whole[offset - start:offset - start + length]
                loaded[n] = _unpickling.torch_load(io.BytesIO(data), trusted=self.trusted, name=f"an entry of {str(shard)!r}")
        return [loaded[n] for n in range(len(infos))]

    def save(self, obj: Any) -> None:
        """``torch.save`` of ``obj`` into the file, durable before it is published."""
        raise NotImplementedError

    def mkdir(self) -> None:
        raise NotImplementedError

    def open(self, mode: str = "rb") -> Any:
        """The file as a stream (a single-file checkpoint's writer that streams: ``consolidate``'s safetensors)."""
        raise NotImplementedError

    def dcp_writer(self) -> Any:
        """torch DCP's storage writer into this directory."""
        raise NotImplementedError

    def dcp_reader(self) -> Any:
        """torch DCP's storage reader of this directory, answering with the index ``read_index`` read: every load
        through this location reads ``.metadata`` once (at a URL, each read is a request). Unless the location is
        trusted, each pickled entry it hands a load planner is unpickled by the restricted unpickler first."""
        reader = self._dcp_reader()
        index = self.read_index()

        def read_metadata(*args: Any, **kwargs: Any) -> Any:
            if hasattr(reader, "load_id"):  # torch 2.4+ readers stamp the index they read with this load
                if getattr(index, "storage_meta", None) is None:
                    from torch.distributed.checkpoint.metadata import StorageMeta

                    index.storage_meta = StorageMeta()
                index.storage_meta.load_id = reader.load_id
            return index

        reader.read_metadata = read_metadata
        if not self.trusted:
            read_data = reader.read_data
            reader.read_data = lambda plan, planner: read_data(plan, _CheckedPlanner(planner, str(self)))
        return reader

    def read_index(self) -> Any:
        """A sharded checkpoint's ``.metadata``, read once per location: every stored entry (``state_dict_metadata``,
        flattened keys with global shapes), where its bytes are (``storage_data``: file, offset, length) and, in
        ``planner_data``, the nested path each flattened key came from. torch's DCP unpickles it with no
        restriction: here it goes through the restricted unpickler unless the location is trusted."""
        index = self / _format.DCP_METADATA_FILENAME
        return self.once("index", lambda: _unpickling.loads(index.read_bytes(), repr(str(index)), self.trusted))

    def once(self, key: Any, read: Callable[[], Any]) -> Any:
        """``read()`` the first time ``key`` is asked of this location, its result after: a load checks a checkpoint
        and then loads it through one location, reading each file once (at a URL, each read is a request)."""
        done = vars(self).setdefault("_once", {})
        if key not in done:
            done[key] = read()
        return done[key]

    def _dcp_reader(self) -> Any:
        raise NotImplementedError

    # --- putting a checkpoint in place, and taking it away ---
    def partial(self, token: str) -> "Location":
        """Where a save to this location writes until it is complete."""
        raise NotImplementedError

    def publish(self, partial: "Location") -> None:
        """Make the complete sharded checkpoint at ``partial`` the one here; the one it replaces becomes a leftover."""
        raise NotImplementedError

    def write_file(self, partial: "Location", write: Callable[["Location"], None]) -> None:
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

    def check_destination(self, full: bool) -> None:
        """Refuse a save that would replace what is not a checkpoint (or, at a URL, create a bucket)."""
        raise NotImplementedError

    def missing(self) -> str:
        """Why nothing is here, beyond "it does not exist", where the store knows more ("" where it does not)."""
        return ""

    @contextlib.contextmanager
    def reported(self) -> Iterator[None]:
        """Around a save: its failure in this store's words, raised on every rank that sees it."""
        yield


class _CheckedPlanner:
    """A load planner as a DCP reader sees it, whose pickled entries are first unpickled by the restricted unpickler:
    one that names what it does not admit is refused before the planner unpickles it (with no restriction, as
    torch's planners do). Everything else is the planner's own."""

    def __init__(self, planner: Any, source: str) -> None:
        self._planner, self._source = planner, source

    def load_bytes(self, read_item: Any, value: Any) -> None:
        data = value.read()
        name = f"the entry {read_item.dest_index.fqn!r} of {self._source!r}"
        _unpickling.torch_load(io.BytesIO(data), name=name)
        self._planner.load_bytes(read_item, io.BytesIO(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)
