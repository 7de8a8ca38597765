"""The one way in and out of a checkpoint's bytes: each byte read is checked against its save's checksums, each pickle
unpickled restricted (``_unpickling``) unless the location is trusted, and each byte written hashed into the manifest.
``Location`` is the store beneath: its reads hand out unchecked bytes to this module alone.
"""
import contextlib
import dataclasses
import functools
import io
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

from .._checkpoint import _checksums, _format, _unpickling, _zip_checks
from .._checkpoint._checksums import Range, Sums
from .._patching import _torch_compat as compat
from .._save_load._ranks import agree
from ._location import Location

_ENTRIES_SPAN = 64 * 2**20  # the most bytes read at once for pickled entries, tensors between them included


# --- the manifest -----------------------------------------------------------------------------------------------


def sums(location: Location) -> Optional[Dict[str, Sums]]:
    """The ranges the save of the sharded checkpoint at ``location`` hashed, by file (the manifest closing its
    ``.metadata``), read once; None where it has none (native Lightning's, an older lightning_fsdp_resume's, or one
    another program saved over in place, which rewrites ``.metadata``): those load unverified, said once."""
    return location.once("sums", lambda: _read_sums(location))


def _read_sums(location: Location) -> Optional[Dict[str, Sums]]:
    try:
        data = _whole(location, _format.DCP_METADATA_FILENAME)
    except FileNotFoundError:
        return None
    return _checksums.manifest_of(data, str(location), _format.DCP_METADATA_FILENAME)


def file_sums(location: Location, relative: str) -> Optional[Sums]:
    """The ranges of the file ``relative`` at ``location``; None where the checkpoint has no checksums."""
    found = sums(location)
    if found is None:
        return None
    if relative not in found:
        raise _checksums.DamagedCheckpointError(
            f"The checkpoint file {str(location / relative)!r} is not one its save wrote (its checksums do not list"
            f" it). {_format.RESUME_ELSEWHERE}"
        )
    return found[relative]


def written(location: Location) -> Dict[str, List[Range]]:
    """What torch DCP's writer of the directory at ``location`` wrote on this rank, by file: filled in by its
    ``finish`` (on the rank that writes ``.metadata``)."""
    return location.once("written", dict)


def seal(location: Location, ranges: Dict[str, List[Range]]) -> None:
    """Close the sharded checkpoint at ``location`` with its manifest: what DCP wrote and ``ranges`` (``meta.pt``'s),
    after the pickle of ``.metadata``, whose bytes are checked against what its writer hashed first."""
    files = {**written(location), **ranges}
    name = _format.DCP_METADATA_FILENAME
    if name not in files:
        return  # not the rank whose DCP writer finished: its checkpoint goes without checksums
    index_file = location / name
    data = index_file.read_bytes()
    Sums(str(index_file), files[name]).check(data, 0)
    index_file.write_bytes(_checksums.with_manifest(data, files))


# --- reading ----------------------------------------------------------------------------------------------------


def _whole(location: Location, relative: str) -> bytes:
    """The whole small file ``relative`` at ``location``, read once."""
    return location.once(("whole", relative), lambda: (location / relative).read_bytes())


def read(location: Location, relative: str, start: Optional[int] = None, end: Optional[int] = None) -> bytes:
    """The bytes of the file ``relative`` at ``location`` (those in [start, end); of ``.metadata`` read whole, those
    before its manifest), checked against the checkpoint's checksums where it has them: damage raises
    ``DamagedCheckpointError`` naming the file and the bytes."""
    found = file_sums(location, relative)
    if start is not None or end is not None:
        data = (location / relative).read_bytes(start, end)
    else:
        data = _whole(location, relative)
        if found is not None:
            found.check_size(len(data))
            data = data[:found.hashed]
    if found is not None:
        found.check(data, start or 0)
    return data


def index(location: Location) -> Any:
    """A sharded checkpoint's ``.metadata``, read once per location: every stored entry (``state_dict_metadata``,
    flattened keys with global shapes), where its bytes are (``storage_data``: file, offset, length) and, in
    ``planner_data``, the nested path each flattened key came from. torch's DCP unpickles it with no restriction:
    here it goes through the restricted unpickler unless the location is trusted."""
    name = _format.DCP_METADATA_FILENAME
    return location.once("index", lambda: _unpickling.loads(read(location, name), repr(str(location / name)),
                                                             location.trusted))


def load_member(location: Location, relative: str) -> Any:
    """``torch.load`` of the small file ``relative`` of the sharded checkpoint at ``location`` (``meta.pt``), its bytes
    checked first: against the checksums, or against its zip records' CRC-32s where the checkpoint has none."""
    member = location / relative

    def load() -> Any:
        data = read(location, relative)
        if sums(location) is None and _zip_checks.is_zip(data[:4]):
            _zip_checks.check_zip(io.BytesIO(data), str(member))
        return _unpickling.torch_load(io.BytesIO(data), trusted=location.trusted, name=repr(str(member)))

    return member.once("load", load)


def load_items(location: Location, infos: List[Any]) -> List[Any]:
    """Pickled (non-tensor) entries of the sharded checkpoint at ``location``, ``infos`` their ``storage_data``
    records, unpickled as ``load_member`` unpickles, each once per location: a load's check (rank 0's) and the load
    itself take the same objects. DCP writes a file's pickled entries before its tensors, so each file's are read in
    one request (at a URL) where they lie within ``_ENTRIES_SPAN`` bytes of each other, else one by one."""
    by_file: Dict[str, List[int]] = {}
    for number, info in enumerate(infos):
        by_file.setdefault(info.relative_path, []).append(number)
    loaded: Dict[int, Any] = {}
    for relative, numbers in by_file.items():
        shard = location / relative
        start, end = min(infos[n].offset for n in numbers), max(infos[n].offset + infos[n].length for n in numbers)
        span: List[bytes] = []  # the entries' bytes, read when the first one not yet unpickled asks

        def entry(offset: int, length: int) -> Any:
            if end - start > _ENTRIES_SPAN:
                data = read(location, relative, offset, offset + length)
            else:
                span[:] = span or [read(location, relative, start, end)]
                data = span[0][offset - start : offset - start + length]
            return _unpickling.torch_load(io.BytesIO(data), trusted=location.trusted, name=f"an entry of {str(shard)!r}")

        for n in numbers:
            offset, length = infos[n].offset, infos[n].length
            loaded[n] = location.once(("entry", relative, offset), functools.partial(entry, offset, length))
    return [loaded[n] for n in range(len(infos))]


def check_file_together(location: Location, share: Tuple[int, int]) -> bool:
    """The full checkpoint file at ``location`` checked by the processes of a machine together, each the CRC-32s of
    its ``share`` (k, n: this process's k of the machine's n) of the records, then agreed on every rank (a
    collective): each byte hashed once a machine, not once a rank. False, with nothing checked, where each process
    reads a copy of its own (``one_copy``): ``load_file`` then checks that whole."""
    error: Optional[BaseException] = None
    if location.one_copy:
        try:
            _zip_checks.check_torch_file(location.load_source(), str(location), share)
        except Exception as found:  # the other ranks must hear of it rather than load
            error = found
    agree(error)
    return location.one_copy


def load_file(location: Location, lazy: bool = False, map_location: Any = "cpu", checked_together: bool = False) -> Any:
    """``torch.load`` of the full checkpoint file at ``location`` (onto the CPU unless ``map_location`` says
    otherwise), its zip records' CRC-32s checked first (``checked_together``: ``check_file_together`` checked them),
    restricted unless the location is trusted; ``lazy``: memory-mapped where the store and torch allow."""
    return load_stream(location.load_source(), str(location), repr(str(location)), location.trusted, map_location, lazy,
                       check=not checked_together)


def load_stream(source: Any, name: str, refusal: str, trusted: bool, map_location: Any, lazy: bool = False,
                check: bool = True) -> Any:
    """``torch.load`` of a full checkpoint given as a file object or a local filename (a location's, or a download),
    checked first where it can be re-read (``check``: unless the caller checked it); ``name`` is what a damage report
    calls it, ``refusal`` what an unpickling refusal does; ``lazy``: a filename memory-mapped where torch allows."""
    if check and (not hasattr(source, "read") or source.seekable()):
        _zip_checks.check_torch_file(source, name)
    return _unpickling.torch_load(source, lazy=lazy, trusted=trusted, name=refusal, map_location=map_location)


def verify_file(location: Location) -> bool:
    """The full checkpoint file at ``location`` checked whole against its zip records' CRC-32s; False where it is not
    in torch's zip format (it carries none)."""
    with location.open("rb") as handle:
        if not _zip_checks.is_zip(handle.read(4)):
            return False
        handle.seek(0)
        _zip_checks.check_zip(handle, str(location))
    return True


def verify_member(location: Location, relative: str, found: Sums, advance: Callable[[int], None]) -> None:
    """Every byte of the file ``relative`` of the sharded checkpoint at ``location`` checked against ``found``, read
    once into one reused buffer."""
    with (location / relative).open("rb") as handle:
        _checksums.check_file(_reader_into(handle), found, advance)


def _reader_into(handle: Any) -> Callable[[int, int], memoryview]:
    """``read(start, end)`` of ``handle`` into one buffer, reused: a check reads each byte once, with no new memory."""
    buffer = bytearray(_checksums.CHUNK)

    def read_range(start: int, end: int) -> memoryview:
        handle.seek(start)
        view = memoryview(buffer)[: end - start]
        return view[:_checksums.read_into(handle, view)]

    return read_range


# --- writing ----------------------------------------------------------------------------------------------------


def save_file(location: Location, obj: Any) -> List[Range]:
    """``torch.save`` of ``obj`` into the file at ``location``, durable before it is published; the ranges hashed as
    it was written."""
    import torch

    with location.writing() as handle:
        hashing = _checksums.Hashing(handle)
        torch.save(obj, hashing)
    return hashing.close()


# --- torch DCP's writer and reader --------------------------------------------------------------------------------


def writer(location: Location) -> Any:
    """torch DCP's storage writer into the directory at ``location``, which hashes what every rank writes (in ranges,
    one per item; ``_checksums``) and hands it to the rank that writes ``.metadata`` (``written``) through DCP's own
    gather of the write results."""
    return _summing(location.dcp_storage_writer(), location)


def reader(location: Location) -> Any:
    """torch DCP's storage reader of the directory at ``location``, answering with the index ``index`` read: every
    load through this location reads ``.metadata`` once (at a URL, each read is a request). Unless the location is
    trusted, each pickled entry it hands a load planner is unpickled by the restricted unpickler first."""
    storage = location.dcp_storage_reader()
    found = index(location)

    def read_metadata(*args: Any, **kwargs: Any) -> Any:
        if compat.stamps_load_id(storage):
            if getattr(found, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                found.storage_meta = StorageMeta()
            found.storage_meta.load_id = storage.load_id
        return found

    storage.read_metadata = read_metadata
    if sums(location) is not None:
        _checking(storage, location)
    if not location.trusted:
        read_data = storage.read_data
        storage.read_data = lambda plan, planner: read_data(plan, _CheckedPlanner(planner, str(location)))
    return storage


def load_entry(value: Any) -> Any:
    """A pickled entry a load planner receives from ``reader``'s storage reader: its bytes were checked, and unpickled
    restricted unless its location is trusted, before the planner got them."""
    return _unpickling.torch_load(value, trusted=True)


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


class _Summed(NamedTuple):
    """A write result's storage record on its way to the rank that writes ``.metadata``, with its item's ranges."""

    info: Any
    ranges: List[Range]


class _Files:
    """A DCP writer's or reader's file system (torch >= 2.4), whose streams hash what is written (``written``: the
    ranges of each file by name) or check what is read (``location``'s checksums). Everything else is its own."""

    def __init__(self, fs: Any, written: Optional[Dict[str, List[Range]]] = None, location: Optional[Location] = None) -> None:
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
                found = file_sums(self._location, name)
                if found is None:
                    yield raw
                else:
                    with contextlib.closing(_checksums.Checked(raw, found)) as checked:
                        yield checked
            else:
                yield raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


def _summing(storage: Any, location: Location) -> Any:
    """``storage`` (a DCP writer), hashing what it writes. torch < 2.4's local writer opens its files itself: there
    each item is read back once written (from the page cache) to be hashed."""
    hashed: Dict[str, List[Range]] = {}
    if compat.streams_through_fs(storage):
        storage.fs = _Files(storage.fs, written=hashed)
    write_data, finish = storage.write_data, storage.finish

    def summed_write_data(plan: Any, planner: Any) -> Any:
        import torch

        with compat.torch_save_without_crc32():  # none is read: the checksums cover the files
            results = write_data(plan, planner).wait()
        files = {name: Sums(name, ranges) for name, ranges in hashed.items()}  # once: a rank writes thousands of items
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
        of_index = [ranges for written_name, ranges in hashed.items() if written_name.startswith(name)]  # .metadata.tmp
        files[name] = of_index[-1] if of_index else _hashed(location / name, 0, None)
        written(location).update(files)

    storage.write_data, storage.finish = summed_write_data, summed_finish
    return storage


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


def _checking(storage: Any, location: Location) -> None:
    """``storage`` (a DCP reader) hands torch DCP only bytes checked against ``location``'s checksums. torch < 2.4's
    local reader opens its files itself: there the ranges a plan reads are checked (read once more) before it reads
    them."""
    if compat.streams_through_fs(storage):
        storage.fs = _Files(storage.fs, location=location)
        return
    read_data = storage.read_data

    def checked_read_data(plan: Any, planner: Any) -> Any:
        for item in plan.items:
            info = storage.storage_data[item.storage_index]
            read(location, info.relative_path, info.offset, info.offset + info.length)
        return read_data(plan, planner)

    storage.read_data = checked_read_data
