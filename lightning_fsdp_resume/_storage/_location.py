"""What every store answers for a checkpoint's place in it: ``Location``, which ``_local`` and ``_objects`` implement."""
import contextlib
import dataclasses
import io
import warnings
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, TypeVar

from .. import _checksums, _format, _unpickling
from .._checksums import Range, Sums


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
            whole = self.read_checked(relative, start, end) if end - start <= _ENTRIES_SPAN else None
            for n in numbers:
                offset, length = infos[n].offset, infos[n].length
                data = self.read_checked(relative, offset, offset + length) if whole is None else whole[offset - start:offset - start + length]
                loaded[n] = _unpickling.torch_load(io.BytesIO(data), trusted=self.trusted, name=f"an entry of {str(shard)!r}")
        return [loaded[n] for n in range(len(infos))]

    def save(self, obj: Any) -> List[Range]:
        """``torch.save`` of ``obj`` into the file, durable before it is published; the ranges hashed as it was written."""
        raise NotImplementedError

    def write_bytes(self, data: bytes) -> None:
        """A small file written whole, durable before it is published."""
        raise NotImplementedError

    # --- checksums (``_checksums``) ---
    def sums(self) -> Optional[Dict[str, Sums]]:
        """The ranges the save of the sharded checkpoint here hashed, by file (its manifest), read once; None where it
        has none (native Lightning's, an older lightning_fsdp_resume's) or where another program saved over it in
        place (native Lightning does), leaving the manifest of an earlier save: both load unverified, said once."""
        return self.once("sums", self._read_sums)

    def _read_sums(self) -> Optional[Dict[str, Sums]]:
        manifest = self / _format.CHECKSUMS_FILENAME
        try:
            data = manifest.read_bytes()
        except FileNotFoundError:
            return None
        found = _checksums.parse_manifest(data, str(manifest), str(self))
        if found.save is not None and self._index_save(found) not in (None, found.save):
            warnings.warn(
                f"lightning_fsdp_resume: {str(manifest)!r} holds the checksums of another save than the checkpoint's"
                " (a program that saves in place, such as native Lightning, saved over it): its bytes could not be"
                " verified."
            )
            return None
        return found.files

    def _index_save(self, manifest: _checksums.Manifest) -> Optional[str]:
        """The save id in ``.metadata`` where its bytes are not those the manifest hashed; None where they are, or
        where it holds none (then the bytes are damaged, and the checks say so)."""
        name = _format.DCP_METADATA_FILENAME
        sums = manifest.files.get(name)
        try:
            data = self._whole(name)
        except FileNotFoundError:
            return None
        if sums is None or (len(data) == sums.size and _checksums.digest(data) == sums.ranges[0].digest and len(sums.ranges) == 1):
            return None
        try:
            index = _unpickling.loads(data, repr(str(self / name)))
        except Exception:
            return None
        return getattr(getattr(index, "storage_meta", None), "save_id", None)

    def _whole(self, relative: str) -> bytes:
        """The whole small file ``relative`` here, read once."""
        return self.once(("whole", relative), lambda: (self / relative).read_bytes())

    def file_sums(self, relative: str) -> Optional[Sums]:
        """The ranges of the file ``relative`` here; None where the checkpoint has no checksums."""
        sums = self.sums()
        if sums is None:
            return None
        if relative not in sums:
            raise _checksums.DamagedCheckpointError(
                f"The checkpoint file {str(self / relative)!r} is not one its save wrote (its checksums do not list it)."
                " Resume from another checkpoint."
            )
        return sums[relative]

    def read_checked(self, relative: str, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
        """The bytes of the file ``relative`` here (those in [start, end)), checked against the checkpoint's
        checksums where it has them: damage raises ``DamagedCheckpointError`` naming the file and the bytes."""
        sums = self.file_sums(relative)
        data = self._whole(relative) if start is None and end is None else (self / relative).read_bytes(start, end)
        if sums is not None:
            if start is None and end is None:
                sums.check_size(len(data))
            sums.check(data, start or 0)
        return data

    def load_checked(self, relative: str) -> Any:
        """``torch.load`` of the small file ``relative`` here (``meta.pt``), its bytes checked first: against the
        checksums, or against its zip records' CRC-32s where the checkpoint has no checksums."""
        member = self / relative

        def read() -> Any:
            data = self.read_checked(relative)
            if self.sums() is None and _checksums.is_zip(data[:4]):
                _checksums.check_zip(io.BytesIO(data), str(member))
            return _unpickling.torch_load(io.BytesIO(data), trusted=self.trusted, name=repr(str(member)))

        return member.once("load", read)

    def written(self) -> Dict[str, List[Range]]:
        """What torch DCP's writer of this directory wrote on this rank, by file: filled in by its ``finish`` (on the
        rank that writes ``.metadata``)."""
        return self.once("written", dict)

    def seal(self, ranges: Dict[str, List[Range]]) -> None:
        """Write the manifest of the sharded checkpoint here: what DCP wrote and ``ranges`` (``meta.pt``'s)."""
        files = {**self.written(), **ranges}
        if _format.DCP_METADATA_FILENAME not in files:
            return  # not the rank whose DCP writer finished: its checkpoint goes without checksums
        save = self.once("save id", dict).get("id")
        (self / _format.CHECKSUMS_FILENAME).write_bytes(_checksums.manifest_bytes(files, save))

    def mkdir(self) -> None:
        raise NotImplementedError

    def open(self, mode: str = "rb") -> Any:
        """The file as a stream (a single-file checkpoint's writer that streams: ``consolidate``'s safetensors)."""
        raise NotImplementedError

    def dcp_writer(self) -> Any:
        """torch DCP's storage writer into this directory, which hashes what every rank writes (in ranges, one per
        item; ``_checksums``) and hands it to the rank that writes ``.metadata`` (``written``) through DCP's own
        gather of the write results."""
        return _summing(self._dcp_writer(), self)

    def _dcp_writer(self) -> Any:
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
        if self.sums() is not None:
            _checking(reader, self)
        if not self.trusted:
            read_data = reader.read_data
            reader.read_data = lambda plan, planner: read_data(plan, _CheckedPlanner(planner, str(self)))
        return reader

    def read_index(self) -> Any:
        """A sharded checkpoint's ``.metadata``, read once per location: every stored entry (``state_dict_metadata``,
        flattened keys with global shapes), where its bytes are (``storage_data``: file, offset, length) and, in
        ``planner_data``, the nested path each flattened key came from. torch's DCP unpickles it with no
        restriction: here it goes through the restricted unpickler unless the location is trusted."""
        name = _format.DCP_METADATA_FILENAME
        index = self / name
        return self.once("index", lambda: _unpickling.loads(self.read_checked(name), repr(str(index)), self.trusted))

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


# --- checksums through torch DCP's writer and reader ---------------------------------------------------------------


class _Summed(NamedTuple):
    """A write result's storage record on its way to the rank that writes ``.metadata``, with its item's ranges."""

    info: Any
    ranges: List[Range]


class _Files:
    """A DCP writer's or reader's file system (torch >= 2.4), whose streams hash what is written (``written``: the
    ranges of each file by name) or check what is read (``location``'s checksums). Everything else is its own."""

    def __init__(self, fs: Any, written: Optional[Dict[str, List[Range]]] = None, location: Optional["Location"] = None) -> None:
        self._fs, self._written, self._location = fs, written, location

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        name = _checksums.relative_name(path)
        with self._fs.create_stream(path, mode) as raw:
            if "w" in mode and self._written is not None:
                hashing = _checksums.Hashing(raw)
                yield hashing
                self._written[name] = hashing.close()
            elif "r" in mode and self._location is not None:
                sums = self._location.file_sums(name)
                if sums is None:
                    yield raw
                else:
                    with contextlib.closing(_checksums.Checked(raw, sums)) as checked:
                        yield checked
            else:
                yield raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def _summing(writer: Any, location: Location) -> Any:
    """``writer``, hashing what it writes. torch < 2.4's local writer opens its files itself: there each item is read
    back once written (from the page cache) to be hashed."""
    written: Dict[str, List[Range]] = {}
    if hasattr(getattr(writer, "fs", None), "create_stream"):
        writer.fs = _Files(writer.fs, written=written)
    write_data, finish = writer.write_data, writer.finish

    def summed_write_data(plan: Any, planner: Any) -> Any:
        import torch

        results = write_data(plan, planner).wait()
        files = {name: Sums(name, ranges) for name, ranges in written.items()}  # once: a rank writes thousands of items
        summed = [dataclasses.replace(result, storage_data=_Summed(result.storage_data, _item_ranges(location, files, result)))
                  for result in results]
        future: Any = torch.futures.Future()
        future.set_result(summed)
        return future

    def summed_finish(metadata: Any, results: List[List[Any]]) -> None:
        files: Dict[str, List[Range]] = {}
        plain = []
        for rank_results in results:
            row = []
            for result in rank_results:
                if isinstance(result.storage_data, _Summed):
                    files.setdefault(result.storage_data.info.relative_path, []).extend(result.storage_data.ranges)
                    result = dataclasses.replace(result, storage_data=result.storage_data.info)
                row.append(result)
            plain.append(row)
        finish(metadata, plain)
        name = _format.DCP_METADATA_FILENAME
        index = [ranges for written_name, ranges in written.items() if written_name.startswith(name)]  # .metadata.tmp
        files[name] = index[-1] if index else _hashed(location / name, 0, None)
        location.written().update(files)
        location.once("save id", dict)["id"] = getattr(getattr(metadata, "storage_meta", None), "save_id", None)

    writer.write_data, writer.finish = summed_write_data, summed_finish
    return writer


def _item_ranges(location: Location, files: Dict[str, Sums], result: Any) -> List[Range]:
    """The ranges of one written item (``result``), named by its entry: as its stream hashed them, or (torch < 2.4)
    hashed from the file now."""
    info, entry = result.storage_data, result.index.fqn
    start, end = info.offset, info.offset + info.length
    if info.relative_path not in files:  # torch < 2.4: read back
        return [r._replace(entry=entry) for r in _hashed(location / info.relative_path, start, end)]
    return [r._replace(entry=entry) for r in files[info.relative_path].covering(start, end)]


def _hashed(file: Location, start: int, end: Optional[int]) -> List[Range]:
    data = file.read_bytes(start, end)
    return [Range(start, len(data), _checksums.digest(data))]


def _checking(reader: Any, location: Location) -> None:
    """``reader`` hands torch DCP only bytes checked against ``location``'s checksums. torch < 2.4's local reader opens
    its files itself: there the ranges a plan reads are checked (read once more) before it reads them."""
    if hasattr(getattr(reader, "fs", None), "create_stream"):
        reader.fs = _Files(reader.fs, location=location)
        return
    read_data = reader.read_data

    def checked_read_data(plan: Any, planner: Any) -> Any:
        for item in plan.items:
            info = reader.storage_data[item.storage_index]
            location.read_checked(info.relative_path, info.offset, info.offset + info.length)
        return read_data(plan, planner)

    reader.read_data = checked_read_data
