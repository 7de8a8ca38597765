"""Checksums of every byte a save writes, and their check on every read: a damaged checkpoint is refused, never
trained on. No torch: the checksums of a sharded checkpoint live in its manifest (``checksums.json``, beside
``.metadata``; native Lightning and torch ignore it), a full file's in torch's zip format itself.

A sharded save hashes each file's bytes as they are written, in *ranges*: one per DCP storage item (a tensor chunk
or a pickled entry) and one per small file, so that a read of any item, on any number of ranks, checks only what
it reads. The hash is xxHash's XXH3 (64 bits, about 20 GB/s a core: a save's cost is the writing, not the hashing).
A reader serves only bytes of ranges it has checked (``Checked``). A full checkpoint file (torch's zip format, any
writer's) is checked against the CRC-32 zip stores for every record, pickle and tensors alike, before it is loaded.
"""
import bisect
import contextlib
import io
import json
import mmap
import os
import posixpath
import struct
import warnings
import zipfile
import zlib
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

ALGORITHM = "xxh3_64"
_FORMAT = "lightning_fsdp_resume.checksums"
_VERSION = 1
_ZIP_MAGIC = b"PK\x03\x04"
CHUNK = 16 * 2**20  # what a whole-file check reads at once


class DamagedCheckpointError(ValueError):
    """A checkpoint whose bytes are not those its save wrote (flipped, truncated, swapped in from another save)."""


class Range(NamedTuple):
    """``length`` bytes of a file from ``offset``, whose hash is ``digest``; ``entry``: the DCP item they hold."""

    offset: int
    length: int
    digest: str
    entry: Optional[str] = None


def hasher() -> Any:
    import xxhash

    return xxhash.xxh3_64()


def digest(data: Any) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def damaged(name: str, start: int, end: int, entry: Optional[str], what: str) -> DamagedCheckpointError:
    held = f" (the entry {entry!r})" if entry else ""
    return DamagedCheckpointError(
        f"The checkpoint file {name!r} is damaged: bytes {start}-{end}{held} {what}. Nothing was loaded from them;"
        " resume from another checkpoint, or copy this one again from where it was saved." + _SAVED_OVER
    )


# What to do where the damage may be another program's save over a sharded checkpoint: torch < 2.4 gives no save id
# to tell the two apart (``Manifest.save``).
_SAVED_OVER = (" If a program that saves in place (native Lightning) saved over this checkpoint, its checksums are of the"
               " earlier save: remove checksums.json beside it to load it unverified.")


class Sums:
    """One file's ranges, as its save hashed them (sorted, back to back from byte 0: every byte is in one)."""

    def __init__(self, name: str, ranges: Sequence[Range]) -> None:
        self.name = name
        self.ranges = sorted(ranges)
        self.starts = [r.offset for r in self.ranges]
        self.size = self.ranges[-1].offset + self.ranges[-1].length if self.ranges else 0

    def covering(self, start: int, end: int) -> List[Range]:
        """The ranges that make up [start, end) exactly; refused where a boundary falls inside one."""
        first = bisect.bisect_left(self.starts, start)
        found, at = [], start
        for r in self.ranges[first:]:
            if at >= end:
                break
            if r.offset != at:
                break
            found.append(r)
            at += r.length
        if at != end or (start < end and not found):
            raise damaged(self.name, start, end, None, "are not ranges its save hashed (the index and the checksums disagree)")
        return found

    def containing(self, position: int) -> Optional[Range]:
        at = bisect.bisect_right(self.starts, position) - 1
        if at < 0 or position >= self.ranges[at].offset + self.ranges[at].length:
            return None
        return self.ranges[at]

    def check(self, data: Any, start: int) -> None:
        """``data``, read from ``start``: every range in it hashes as saved."""
        view = memoryview(data)
        for r in self.covering(start, start + len(view)):
            piece = view[r.offset - start:r.offset - start + r.length]
            if digest(piece) != r.digest:
                raise damaged(self.name, r.offset, r.offset + r.length, r.entry, "do not match the checksum its save wrote")

    def check_size(self, size: Optional[int]) -> None:
        if size != self.size:
            found = "missing" if size is None else f"{size} bytes"
            raise DamagedCheckpointError(
                f"The checkpoint file {self.name!r} is {found}; its save wrote {self.size} bytes. Resume from another"
                " checkpoint, or copy this one again from where it was saved." + _SAVED_OVER
            )


# --- the manifest -----------------------------------------------------------------------------------------------


class Manifest(NamedTuple):
    """A sharded checkpoint's checksums: each file's ranges, and the id torch DCP (>= 2.4) gave the save that wrote
    them (None before), which tells a checkpoint another program saved over in place from a damaged one."""

    files: Dict[str, Sums]
    save: Optional[str]


def manifest_bytes(files: Mapping[str, Sequence[Range]], save: Optional[str] = None) -> bytes:
    """The manifest of a save's ``files`` (name relative to the checkpoint -> ranges), with a hash of its own."""
    listed = {name: [list(r) for r in sorted(ranges)] for name, ranges in sorted(files.items())}
    return json.dumps({_FORMAT: _VERSION, "algorithm": ALGORITHM, "digest": digest(_canonical(listed, save)),
                       "save": save, "files": listed}, separators=(",", ":")).encode()


def _canonical(listed: Any, save: Any) -> bytes:
    return json.dumps({"files": listed, "save": save}, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(data: bytes, name: str, directory: str) -> Manifest:
    """The ranges of every file a manifest lists; a damaged manifest, or one of a newer format, is refused."""
    def refused(what: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(f"The checksums {name!r} {what}. Resume from another checkpoint.")

    try:
        manifest = json.loads(data.decode())
        listed, save = manifest["files"], manifest.get("save")
        body = _canonical(listed, save)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise refused(f"are damaged ({error})") from error
    if manifest.get(_FORMAT, 0) > _VERSION or manifest.get("algorithm") != ALGORITHM:
        raise refused(f"are of a format this lightning_fsdp_resume does not read ({manifest.get(_FORMAT)},"
                      f" {manifest.get('algorithm')!r}); upgrade it")
    if manifest.get("digest") != digest(body):
        raise refused("are damaged (their own checksum does not match)")
    try:
        files = {relative: Sums(f"{directory}/{relative}", [Range(*r) for r in ranges]) for relative, ranges in listed.items()}
    except TypeError as error:
        raise refused(f"are damaged ({error})") from error
    return Manifest(files, save if isinstance(save, str) else None)


# --- hashing what is written, checking what is read ---------------------------------------------------------------


class Hashing:
    """A stream being written that hashes what passes through it, in ranges cut where the writer asks ``tell()``
    (torch DCP asks before and after each item it writes). ``close()`` gives the ranges; the stream is its owner's
    to close."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._start = self._length = 0
        self._hash = hasher()
        self._ranges: List[Range] = []

    def write(self, data: Any) -> Any:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")
        count = len(view) if written is None else written
        self._hash.update(view[:count])
        self._length += count
        return written

    def tell(self) -> int:
        self._cut()
        return self._start

    def _cut(self) -> None:
        if self._length:
            self._ranges.append(Range(self._start, self._length, self._hash.hexdigest()))
            self._start += self._length
            self._length = 0
            self._hash = hasher()

    def close(self) -> List[Range]:
        self._cut()
        return list(self._ranges)

    def __getattr__(self, name: str) -> Any:  # flush, fileno (fsync): the stream's own
        return getattr(self._raw, name)


class Checked(io.RawIOBase):
    """A file being read (torch DCP's stream of a shard file) that hands out only bytes it has checked: a read
    anywhere checks the whole range around it against ``sums`` first, and is served from it until a read leaves it.
    A local file is memory-mapped: a range is checked where it lies in the page cache, with no copy, and a read
    copies from there (as a read of the file would); any other stream's range is read into memory first."""

    def __init__(self, raw: Any, sums: Sums) -> None:
        super().__init__()
        self._raw, self._sums = raw, sums
        self._position = 0
        self._held: Optional[Tuple[int, memoryview]] = None
        self._map: Optional[mmap.mmap] = None  # the held range's map, unmapped when a read leaves it
        self._local = _mapped(raw, probe=True) is not None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._sums.size}[whence]
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view):
            chunk = self._at(self._position)
            if not chunk:
                break
            count = min(len(chunk), len(view) - filled)
            view[filled:filled + count] = chunk[:count]
            chunk.release()
            filled += count
            self._position += count
        return filled

    def _at(self, position: int) -> memoryview:
        """The checked bytes from ``position`` to the end of its range; empty past the end of the file."""
        if self._held is None or not self._held[0] <= position < self._held[0] + len(self._held[1]):
            r = self._sums.containing(position)
            if r is None:
                return memoryview(b"")
            self._release()
            if self._local:
                # the range alone is mapped, and unmapped once read: the process holds one range of the file at a time
                aligned = r.offset - r.offset % mmap.ALLOCATIONGRANULARITY
                self._map = _mapped(self._raw, aligned, r.offset + r.length - aligned)
                data = memoryview(self._map)[r.offset - aligned:] if self._map is not None else memoryview(b"")
            else:
                self._raw.seek(r.offset)
                data = memoryview(_read_exactly(self._raw, r.length))
            whole = len(data) == r.length
            try:
                if whole:
                    self._sums.check(data, r.offset)
            except DamagedCheckpointError:
                data.release()
                raise
            if not whole:
                data.release()
                raise damaged(self._sums.name, r.offset, r.offset + r.length, r.entry, "are cut short")
            self._held = (r.offset, data)
        start, held = self._held
        return held[position - start:]

    def _release(self) -> None:
        if self._held is not None:
            self._held[1].release()
            self._held = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view handed out is still alive: the map goes with it
                pass
            self._map = None

    def close(self) -> None:
        self._release()
        super().close()


def _mapped(raw: Any, offset: int = 0, length: int = 0, probe: bool = False) -> Any:
    """``length`` bytes of ``raw`` from ``offset`` (a multiple of the allocation granularity; 0: to the end)
    memory-mapped where it is a local file; None for other streams (fsspec's, say) and past the file's end.
    ``probe``: only whether it can be, without mapping anything (True, or None)."""
    try:
        descriptor = raw.fileno()
        size = os.fstat(descriptor).st_size
        if probe:
            return True
        if size <= offset:
            return None
        return mmap.mmap(descriptor, min(length or size, size - offset), offset=offset, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def _read_exactly(stream: Any, count: int) -> bytes:
    parts, left = [], count
    while left > 0:
        part = stream.read(left)
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def damage_in(error: BaseException) -> Optional[DamagedCheckpointError]:
    """The damage a reader found behind torch DCP's ``CheckpointException`` (each failed rank's error, with its
    traceback), so that every rank raises it as it is; None where there is none."""
    if isinstance(error, DamagedCheckpointError):
        return error
    for failure in (getattr(error, "failures", None) or {}).values():
        found = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(found, DamagedCheckpointError):
            return found
    return None


def relative_name(path: Any) -> str:
    """The file name a DCP stream was opened with, as the manifest lists it (shard files lie at the top)."""
    return posixpath.basename(str(path).replace("\\", "/"))


# --- full files: the CRC-32s of torch's zip format ------------------------------------------------------------------


def is_zip(head: bytes) -> bool:
    return head.startswith(_ZIP_MAGIC)


def check_torch_file(source: Any, name: str) -> None:
    """A full checkpoint file (a filename, or a seekable file object at its start) checked before it is loaded: its
    zip records' CRC-32s; a file in torch's legacy format, which has none, is said to be unchecked."""
    if isinstance(source, str):
        with open(source, "rb") as handle:
            head = handle.read(4)
    else:
        head = source.read(4)
        source.seek(-len(head), io.SEEK_CUR)
    if is_zip(head):
        check_zip(source, name)
    else:
        unchecked(name)


def unchecked(name: str) -> None:
    """Say once that a checkpoint is read without a check of its bytes: it carries no checksums."""
    warnings.warn(f"lightning_fsdp_resume: the checkpoint {name!r} carries no checksums (native Lightning's, an older"
                  " lightning_fsdp_resume's, or torch's legacy format): its bytes could not be verified.")


def check_zip(source: Any, name: str) -> None:
    """Every record of a torch checkpoint file (``source``: a filename or a seekable file object) matches the
    CRC-32 its writer stored, the pickle and every tensor, and its local header says what the central directory says
    of it (name, sizes, CRC-32, time). torch's loader checks none of them."""
    def refused(what: Any) -> DamagedCheckpointError:
        return DamagedCheckpointError(
            f"The checkpoint file {name!r} is damaged: {what}. Nothing was loaded from it; resume from another"
            " checkpoint, or copy this one again from where it was saved."
        )

    try:
        with zipfile.ZipFile(source) as archive, _whole_view(source) as view:
            raw: Any = archive.fp
            for record in archive.infolist():
                raw.seek(record.header_offset)
                header = struct.unpack(_LOCAL_HEADER, raw.read(struct.calcsize(_LOCAL_HEADER)))
                told = (*_dos_time(record.date_time), record.CRC, record.compress_size, record.file_size)
                _agree(record.filename, header[5:10], told, refused, zeroed=bool(header[3] & _DESCRIPTOR))
                local_name = raw.read(header[10]).decode("utf-8" if header[3] & 0x800 else "cp437")
                if local_name != record.orig_filename:
                    raise refused(f"the local header of {record.filename!r} names {local_name!r}")
                start = record.header_offset + struct.calcsize(_LOCAL_HEADER) + header[10] + header[11]
                if view is not None and record.compress_type == zipfile.ZIP_STORED:
                    data = view[start:start + record.compress_size]  # no copy: the page cache, or the bytes read
                    whole = len(data) == record.compress_size and zlib.crc32(data) == record.CRC
                    data.release()  # before any raise: a view left would keep the map from closing
                    if not whole:
                        raise refused(f"the record {record.filename!r} does not match its CRC-32")
                else:
                    with archive.open(record) as stream:
                        while stream.read(CHUNK):
                            pass
                if header[3] & _DESCRIPTOR:  # the CRC-32 and sizes follow the data
                    raw.seek(start + record.compress_size)
                    wide = max(record.compress_size, record.file_size) >= _ZIP64
                    found = raw.read(4)
                    fields = raw.read(20 if wide else 12) if found == _DESCRIPTOR_MAGIC else found + raw.read(16 if wide else 8)
                    descriptor = struct.unpack("<LQQ" if wide else "<LLL", fields)
                    _agree(record.filename, (0, 0, *descriptor), told, refused)
    except zipfile.BadZipFile as error:
        raise refused(error) from error
    except (OSError, EOFError, ValueError, NotImplementedError, struct.error, UnicodeDecodeError) as error:
        if isinstance(error, DamagedCheckpointError):
            raise
        raise refused(f"its zip records cannot be read ({error})") from error
    finally:
        if hasattr(source, "seek"):
            source.seek(0)


@contextlib.contextmanager
def _whole_view(source: Any) -> Iterator[Optional[memoryview]]:
    """The whole file as memory without a copy: a local file (by name or handle) memory-mapped, its pages the page
    cache's; a ``BytesIO``'s buffer; None for other file objects (fsspec's, say)."""
    if isinstance(source, io.BytesIO):
        view = source.getbuffer()
        try:
            yield view
        finally:
            view.release()
        return
    with contextlib.ExitStack() as stack:
        handle = stack.enter_context(open(source, "rb")) if isinstance(source, str) else source
        mapped = _mapped(handle)
        if mapped is None:
            yield None
            return
        stack.enter_context(mapped)
        view = memoryview(mapped)
        try:
            yield view
        finally:
            view.release()


_LOCAL_HEADER = "<4s2B4HL2L2H"  # a zip local file header: signature, versions, flags, method, time, date, CRC, sizes, lengths
_ZIP64 = 0xFFFFFFFF  # a size the zip64 extra field holds instead
_DESCRIPTOR = 0x08  # the flag of a record whose CRC-32 and sizes follow its data (torch's writer sets it)
_DESCRIPTOR_MAGIC = b"PK\x07\x08"


def _agree(record: str, local: Tuple[int, ...], central: Tuple[int, ...], refused: Callable[[str], Exception],
           zeroed: bool = False) -> None:
    """A record's time, date, CRC-32 and sizes as its local header (``zeroed``: one whose descriptor holds the last
    three, which the header leaves 0) or its data descriptor (no time) says them, against the central directory's. A
    size may be 0xFFFFFFFF: zip64's extra field holds it."""
    times_differ = local[:2] != (0, 0) and local[:2] != central[:2]
    allowed = [{0, _ZIP64} if zeroed else {theirs, _ZIP64} for theirs in central[2:]]
    if times_differ or any(mine not in ok for mine, ok in zip(local[2:], allowed)):
        raise refused(f"the local header of {record!r} disagrees with the central directory")


def _dos_time(date_time: Tuple[int, ...]) -> Tuple[int, int]:
    year, month, day, hour, minute, second = date_time
    return (hour << 11) | (minute << 5) | (second // 2), ((year - 1980) << 9) | (month << 5) | day


def check_file(read: Callable[[int, int], Any], sums: Sums, progress: Callable[[int], None]) -> None:
    """Check every range of a file whole (a ``verify``), ``read(start, end)`` giving its bytes: small ranges in
    batches of up to ``CHUNK`` bytes (at a URL each read is a request), large ones in pieces of that size, so that
    memory stays bounded. ``progress`` is told each count of bytes checked."""
    pending: List[Range] = []

    def flush() -> None:
        if pending:
            start, end = pending[0].offset, pending[-1].offset + pending[-1].length
            data = read(start, end)
            if len(data) != end - start:
                raise damaged(sums.name, start, end, pending[0].entry, f"are cut short ({len(data)} read)")
            sums.check(data, start)
            progress(end - start)
            pending.clear()

    for r in sums.ranges:
        if r.length <= CHUNK:
            if pending and r.offset + r.length - pending[0].offset > CHUNK:
                flush()
            pending.append(r)
            continue
        flush()
        running, at, end = hasher(), r.offset, r.offset + r.length
        while at < end:
            data = read(at, min(end, at + CHUNK))
            if not data:
                raise damaged(sums.name, r.offset, end, r.entry, f"are cut short ({at - r.offset} read)")
            running.update(data)
            at += len(data)
            progress(len(data))
        if running.hexdigest() != r.digest:
            raise damaged(sums.name, r.offset, end, r.entry, "do not match the checksum its save wrote")
    flush()
