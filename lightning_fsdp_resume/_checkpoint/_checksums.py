"""Checksums of every byte a save writes (XXH3 ranges, one per DCP item, carried after ``.metadata``'s pickle) and
their check on every read (a full file's CRC-32 records: ``_zip_checks``). A damaged checkpoint is refused, never
trained on. No torch. The format and its reasons: docs/behaviour.md, "Damaged checkpoints"."""
import bisect
import functools
import io
import json
import mmap
import os
import posixpath
import struct
import zlib
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ._format import RESUME_OR_COPY

ALGORITHM = "xxh3_64"
_FORMAT = "lightning_fsdp_resume.checksums"
_VERSION = 2  # 1: checksums.json beside .metadata, with the save's id (not read: such checkpoints load unverified)
# The manifest's place: after the index's pickle, then its length and this mark close ``.metadata``. A native index
# ends with pickle's STOP, which no single flipped bit makes of the mark's last byte; any other ending is damage.
_MARK = b"\nlightning_fsdp_resume.checksums\n"
_LENGTH = struct.Struct(">Q")
_STOP = b"."
CHUNK = 16 * 2**20  # what a whole-file check reads at once
_MISMATCH = "do not match the checksum its save wrote"
# A write of at least LARGE bytes (a tensor's data: torch's zip writer writes each record in one call) is hashed in
# ranges of its own, SPAN bytes at most: a read of the record covers whole ranges, which are checked in the reader's
# own buffer as they arrive, SLICE bytes at a time while they are in the CPU's cache (``Checked``).
LARGE = 2**20
SPAN = 4 * 2**20
SLICE = 256 * 2**10
# A large write's last bytes are a range of their own: a zip reader first reads the last 4 KiB of an item (its
# directory), which would otherwise be checked as part of a whole SPAN, and that SPAN once more by the data's read.
_TAIL = 64 * 2**10


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


@functools.lru_cache(maxsize=None)
def crc32_function() -> Tuple[Callable[..., int], str]:
    """zip's CRC-32 at memory speed where zlib-ng's bindings are installed (a dependency where they have wheels: the
    same CRC, about 6 times the standard library's speed), the standard library's elsewhere; and which it is."""
    try:
        from zlib_ng import zlib_ng
    except ImportError:
        return zlib.crc32, "zlib"
    return zlib_ng.crc32, "zlib-ng"


def digest(data: Any) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def damaged(name: str, start: int, end: int, entry: Optional[str], what: str) -> DamagedCheckpointError:
    held = f" (the entry {entry!r})" if entry else ""
    return DamagedCheckpointError(
        f"The checkpoint file {name!r} is damaged: bytes {start}-{end}{held} {what}. Nothing was loaded from them. "
        + RESUME_OR_COPY
    )


def damaged_file(name: str, what: Any) -> DamagedCheckpointError:
    return DamagedCheckpointError(f"The checkpoint file {name!r} is damaged: {what}. Nothing was loaded from it. {RESUME_OR_COPY}")


class Sums:
    """One file's ranges, as its save hashed them (sorted, back to back from byte 0: every byte is in one)."""

    def __init__(self, name: str, ranges: Sequence[Range], trailer: int = 0) -> None:
        self.name = name
        self.ranges = sorted(ranges)
        self.starts = [r.offset for r in self.ranges]
        self.hashed = self.ranges[-1].offset + self.ranges[-1].length if self.ranges else 0
        self.size = self.hashed + trailer  # the file's: ``.metadata`` goes on with the manifest

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

    def refused(self, r: Range, what: str = _MISMATCH) -> DamagedCheckpointError:
        """The damage of the listed range ``r``: its bytes ``what``."""
        return damaged(self.name, r.offset, r.offset + r.length, r.entry, what)

    def check(self, data: Any, start: int) -> None:
        """``data``, read from ``start``: every range in it hashes as saved."""
        view = memoryview(data)
        for r in self.covering(start, start + len(view)):
            piece = view[r.offset - start:r.offset - start + r.length]
            if digest(piece) != r.digest:
                raise self.refused(r)

    def check_size(self, size: Optional[int]) -> None:
        if size != self.size:
            found = "missing" if size is None else f"{size} bytes"
            raise DamagedCheckpointError(
                f"The checkpoint file {self.name!r} is {found}; its save wrote {self.size} bytes. {RESUME_OR_COPY}"
            )


# --- the manifest -----------------------------------------------------------------------------------------------


def with_manifest(index: bytes, files: Mapping[str, Sequence[Range]]) -> bytes:
    """``.metadata``'s bytes (``index``, DCP's pickle) followed by the manifest of a save's ``files`` (name relative to
    the checkpoint -> ranges), which carries a hash of its own."""
    listed = {name: [list(r) for r in sorted(ranges)] for name, ranges in sorted(files.items())}
    manifest = json.dumps({_FORMAT: _VERSION, "algorithm": ALGORITHM, "digest": digest(_canonical(listed)),
                           "files": listed}, separators=(",", ":")).encode()
    return index + manifest + _LENGTH.pack(len(manifest)) + _MARK


def _canonical(listed: Any) -> bytes:
    return json.dumps({"files": listed}, sort_keys=True, separators=(",", ":")).encode()


def manifest_of(data: bytes, directory: str, relative: str) -> Optional[Dict[str, Sums]]:
    """The ranges of every file the manifest closing ``data`` (the bytes of ``.metadata``, ``relative`` to the
    checkpoint ``directory``) lists; None where it ends as DCP writes it (native's, or an older lightning_fsdp_resume's
    checkpoint). A damaged ending or manifest, or one of a newer format, is refused."""
    if data.endswith(_STOP):
        return None
    name = f"{directory}/{relative}"

    def refused(what: str) -> DamagedCheckpointError:
        return damaged_file(name, f"the checksums that close it {what}")

    end = len(data) - len(_MARK) - _LENGTH.size
    if not data.endswith(_MARK) or end < 0 or _LENGTH.unpack_from(data, end)[0] > end:
        raise DamagedCheckpointError(
            f"The checkpoint file {name!r} is damaged. The shard index {name!r} cannot be read: it ends neither as torch"
            f" writes it nor with this package's checksums. Nothing was loaded from it. {RESUME_OR_COPY}")
    start = end - _LENGTH.unpack_from(data, end)[0]
    try:
        manifest = json.loads(data[start:end].decode())
        listed = manifest["files"]
        body = _canonical(listed)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise refused(f"cannot be read ({error})") from error
    if manifest.get(_FORMAT, 0) > _VERSION or manifest.get("algorithm") != ALGORITHM:
        raise refused(f"are of a format this lightning_fsdp_resume does not read ({manifest.get(_FORMAT)},"
                      f" {manifest.get('algorithm')!r}); upgrade it")
    if manifest.get("digest") != digest(body):
        raise refused("do not match their own checksum")
    try:
        files = {relative: Sums(f"{directory}/{relative}", [Range(*r) for r in ranges]) for relative, ranges in listed.items()}
    except TypeError as error:
        raise refused(f"cannot be read ({error})") from error
    index = files.get(relative)
    if index is None or index.hashed != start:
        raise refused("do not cover the index before them")
    files[relative] = Sums(index.name, index.ranges, trailer=len(data) - start)
    return files


# --- hashing what is written, checking what is read ---------------------------------------------------------------


class Hashing:
    """A stream being written that hashes what passes through it, in ranges cut where the writer asks ``tell()``
    (torch DCP asks before and after each item it writes) and around each large write, in ``SPAN``s. ``close()`` gives
    the ranges; the stream is its owner's to close."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._start = self._length = 0
        self._hash = hasher()
        self._ranges: List[Range] = []

    def write(self, data: Any) -> Any:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")
        view = view[:len(view) if written is None else written]
        if len(view) < LARGE:
            self._hash.update(view)
            self._length += len(view)
            return written
        self._cut()
        cuts = [*range(0, len(view) - _TAIL, SPAN), len(view) - _TAIL, len(view)]
        for start, end in zip(cuts, cuts[1:]):
            self._hash.update(view[start:end])
            self._length += end - start
            self._cut()
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
    """A file being read (torch DCP's stream of a shard file) that hands out only bytes it has checked. A read that
    covers whole ranges (a tensor's data) reads them straight into the reader's buffer and hashes them there as they
    arrive, a slice at a time while in the CPU's cache: each byte is copied once, and the read returns only once they
    match. Any other read checks the whole range around it first and is served from it until a read leaves it: a
    large range of a local file memory-mapped (checked in the page cache, no copy), any other read into memory."""

    def __init__(self, raw: Any, sums: Sums) -> None:
        super().__init__()
        self._raw, self._sums = raw, sums
        self._position = 0
        self._held: Optional[Tuple[int, memoryview]] = None
        self._map: Optional[mmap.mmap] = None  # the held range's map, unmapped when a read leaves it
        self._local = _mappable(raw)

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
            whole = self._whole_range(self._position, len(view) - filled)
            if whole is not None:
                self._read_checked(whole, view[filled:filled + whole.length])
                filled += whole.length
                self._position += whole.length
                continue
            chunk = self._at(self._position)
            if not chunk:
                break
            count = min(len(chunk), len(view) - filled)
            view[filled:filled + count] = chunk[:count]
            chunk.release()
            filled += count
            self._position += count
        return filled

    def _holds(self, position: int) -> bool:
        return self._held is not None and self._held[0] <= position < self._held[0] + len(self._held[1])

    def _whole_range(self, position: int, room: int) -> Optional[Range]:
        """The range starting at ``position``, where it fits in ``room`` bytes and is not held already."""
        if self._holds(position):
            return None
        r = self._sums.containing(position)
        return r if r is not None and r.offset == position and r.length <= room else None

    def _read_checked(self, r: Range, target: memoryview) -> None:
        """The range ``r`` read into ``target`` (its length) and hashed there, a slice at a time while it is in the
        CPU's cache (2 ranks here: 1.14 times an unchecked resume, against 1.38 for a range read whole, then hashed)."""
        running = hasher()
        self._raw.seek(r.offset)
        for at in range(0, r.length, SLICE):
            piece = target[at:at + SLICE]
            if read_into(self._raw, piece) != len(piece):
                raise self._sums.refused(r, "are cut short")
            running.update(piece)
        if running.hexdigest() != r.digest:
            raise self._sums.refused(r)

    def _at(self, position: int) -> memoryview:
        """The checked bytes from ``position`` to the end of its range; empty past the end of the file."""
        if not self._holds(position):
            r = self._sums.containing(position)
            if r is None:
                return memoryview(b"")
            self._release()
            if self._local and r.length >= LARGE:
                # a large range (an item hashed whole: torch < 2.4's saves) is mapped alone, and unmapped once read: the
                # process holds one range of the file at a time; a small one is read, which costs less than a map
                aligned = r.offset - r.offset % mmap.ALLOCATIONGRANULARITY
                self._map = mapped(self._raw, aligned, r.offset + r.length - aligned)
                data = memoryview(self._map)[r.offset - aligned:] if self._map is not None else memoryview(b"")
            else:
                self._raw.seek(r.offset)
                data = memoryview(bytearray(r.length))
                data = data[:read_into(self._raw, data)]
            whole = len(data) == r.length
            try:
                if whole:
                    self._sums.check(data, r.offset)
            except DamagedCheckpointError:
                data.release()
                raise
            if not whole:
                data.release()
                raise self._sums.refused(r, "are cut short")
            self._held = (r.offset, data)
        assert self._held is not None  # held already, or just now
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


def _mappable(raw: Any) -> bool:
    """Whether ``raw`` is a local file ``mapped`` can map (fsspec's streams, say, are not)."""
    try:
        os.fstat(raw.fileno())
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False
    return True


def mapped(raw: Any, offset: int = 0, length: int = 0) -> Optional[mmap.mmap]:
    """``length`` bytes of ``raw`` from ``offset`` (a multiple of the allocation granularity; 0: to the end)
    memory-mapped where it is a local file; None for other streams and past the file's end."""
    try:
        descriptor = raw.fileno()
        size = os.fstat(descriptor).st_size
        if size <= offset:
            return None
        return mmap.mmap(descriptor, min(length or size, size - offset), offset=offset, access=mmap.ACCESS_READ)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


def read_into(stream: Any, view: memoryview) -> int:
    """Fill ``view`` from ``stream``; how many bytes it gave (fewer where it ended)."""
    filled = 0
    while filled < len(view):
        if hasattr(stream, "readinto"):
            count = stream.readinto(view[filled:])
        else:
            part = stream.read(len(view) - filled)
            count = len(part)
            view[filled:filled + count] = part
        if not count:
            break
        filled += count
    return filled


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
                raise sums.refused(r, f"are cut short ({at - r.offset} read)")
            running.update(data)
            at += len(data)
            progress(len(data))
        if running.hexdigest() != r.digest:
            raise sums.refused(r)
    flush()
