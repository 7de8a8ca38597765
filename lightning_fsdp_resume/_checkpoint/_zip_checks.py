"""A full checkpoint file's check before it is loaded: the CRC-32 of every record of torch's zip format, read back
from its local headers or descriptors and compared with the central directory's, on a share of the file per process
where they read one copy. No torch. The format and its reasons: docs/behaviour.md, "Damaged checkpoints"."""
import contextlib
import functools
import io
import struct
import warnings
import zipfile
from typing import Any, Callable, Iterator, Optional, Tuple

from ._checksums import CHUNK, DamagedCheckpointError, crc32_function, damaged_file, mapped

_ZIP_MAGIC = b"PK\x03\x04"

def is_zip(head: bytes) -> bool:
    return head.startswith(_ZIP_MAGIC)


def check_torch_file(source: Any, name: str, share: Tuple[int, int] = (0, 1)) -> None:
    """A full checkpoint file (a filename, or a seekable file object at its start) checked before it is loaded: its
    zip records' CRC-32s (``share``: as ``check_zip``); a file in torch's legacy format, which has none, is said to be
    unchecked."""
    if isinstance(source, str):
        with open(source, "rb") as handle:
            head = handle.read(4)
    else:
        head = source.read(4)
        source.seek(-len(head), io.SEEK_CUR)
    if is_zip(head):
        check_zip(source, name, share)
    else:
        unchecked(name)


def unchecked(name: str) -> None:
    """Say once that a checkpoint is read without a check of its bytes: it carries no checksums."""
    warnings.warn(f"lightning_fsdp_resume: the checkpoint {name!r} carries no checksums (native Lightning's, an older"
                  " lightning_fsdp_resume's, or torch's legacy format): its bytes could not be verified.")


def check_zip(source: Any, name: str, share: Tuple[int, int] = (0, 1)) -> None:
    """Every record of a torch checkpoint file (``source``: a filename or a seekable file object) matches the
    CRC-32 its writer stored, the pickle and every tensor, and its local header says what the central directory says
    of it (name, sizes, CRC-32, time). torch's loader checks none of them. ``share``: (k, n), the CRC-32s of the
    records whose data starts in the k-th of n equal spans of the file alone (the headers of all), for ranks that
    check one copy of the file together."""
    crc32 = crc32_function()[0]
    try:
        with zipfile.ZipFile(source) as archive, _whole_view(source) as view:
            raw: Any = archive.fp
            size = raw.seek(0, io.SEEK_END)
            for record in archive.infolist():
                raw.seek(record.header_offset)
                header = struct.unpack(_LOCAL_HEADER, raw.read(struct.calcsize(_LOCAL_HEADER)))
                told = (*_dos_time(record.date_time), record.CRC, record.compress_size, record.file_size)
                _agree(record.filename, header[5:10], told, functools.partial(damaged_file, name), zeroed=bool(header[3] & _DESCRIPTOR))
                local_name = raw.read(header[10]).decode("utf-8" if header[3] & 0x800 else "cp437")
                if local_name != record.orig_filename:
                    raise damaged_file(name, f"the local header of {record.filename!r} names {local_name!r}")
                start = record.header_offset + struct.calcsize(_LOCAL_HEADER) + header[10] + header[11]
                if min(start * share[1] // max(size, 1), share[1] - 1) != share[0]:
                    pass  # another rank's
                elif record.compress_type == zipfile.ZIP_STORED:  # torch's: the bytes as they are
                    if view is not None:
                        data = view[start:start + record.compress_size]  # no copy: the page cache, or the bytes read
                        found = len(data) == record.compress_size and crc32(data) == record.CRC
                        data.release()  # before any raise: a view left would keep the map from closing
                    else:
                        found = _stream_crc32(raw, start, record.compress_size, crc32) == record.CRC
                    if not found:
                        raise damaged_file(name, f"the record {record.filename!r} does not match its CRC-32")
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
                    _agree(record.filename, (0, 0, *descriptor), told, functools.partial(damaged_file, name))
    except zipfile.BadZipFile as error:
        raise damaged_file(name, error) from error
    except (OSError, EOFError, ValueError, NotImplementedError, struct.error, UnicodeDecodeError) as error:
        if isinstance(error, DamagedCheckpointError):
            raise
        raise damaged_file(name, f"its zip records cannot be read ({error})") from error
    finally:
        if hasattr(source, "seek"):
            source.seek(0)


def _stream_crc32(raw: Any, start: int, length: int, crc32: Callable[..., int]) -> Optional[int]:
    """The CRC-32 of ``length`` bytes of ``raw`` from ``start``, read in pieces; None where the file ends before them."""
    raw.seek(start)
    value = 0
    while length:
        data = raw.read(min(length, CHUNK))
        if not data:
            return None
        value, length = crc32(data, value), length - len(data)
    return value


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
        whole = mapped(handle)
        if whole is None:
            yield None
            return
        stack.enter_context(whole)
        view = memoryview(whole)
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


