"""``lightning-fsdp-resume verify``: every byte of a checkpoint checked against the checksums its save wrote (a
sharded one's manifest; a full file's zip CRC-32s), with no model and no process group. Nothing is unpickled and
nothing is written.
"""
import time
from typing import Any, Callable, NamedTuple

from . import _checksums, _format, _sharded_reader, _storage
from ._verify import MissingCheckpointError, listed_size, not_a_checkpoint


class Verified(NamedTuple):
    """What one ``verify`` checked."""

    files: int
    bytes: int
    seconds: float


class UncheckableError(ValueError):
    """A checkpoint that carries no checksums: its bytes cannot be told whole or damaged."""


def verify(target: str, progress: bool = True) -> Verified:
    """Check every byte of the checkpoint at ``target`` (a path or a URL); raises ``DamagedCheckpointError`` naming
    the first damage, ``UncheckableError`` where there are no checksums to check against."""
    started = time.perf_counter()
    path = _storage.open_path(target, "verify").resolve()
    entry = path.stat()
    if entry is None:
        raise MissingCheckpointError(f"{not_a_checkpoint(path)}: it does not exist.{path.missing()}")
    if not entry.is_dir:
        with path.open("rb") as handle:
            if not _checksums.is_zip(handle.read(4)):
                raise UncheckableError(f"The checkpoint {str(path)!r} is not in torch's zip format: it carries no checksums.")
            handle.seek(0)
            _checksums.check_zip(handle, str(path))
        return Verified(1, entry.size, time.perf_counter() - started)
    sums = path.sums()
    if sums is None:
        raise UncheckableError(
            f"The checkpoint {str(path)!r} carries no checksums (no {_format.CHECKSUMS_FILENAME!r}: native Lightning's"
            " or an older lightning_fsdp_resume's): its bytes cannot be verified."
        )
    files = path.listing()
    total = sum(file_sums.size for file_sums in sums.values())
    bar = _sharded_reader.Progress(total, f"checking {str(path)!r}", enabled=progress, command="verify")
    try:
        for relative, file_sums in sorted(sums.items()):
            file_sums.check_size(listed_size(path, files, relative))
            with (path / relative).open("rb") as handle:
                _checksums.check_file(_reader_into(handle), file_sums, bar.advance)
    finally:
        bar.close()
    return Verified(len(sums), total, time.perf_counter() - started)


def _reader_into(handle: Any) -> Callable[[int, int], memoryview]:
    """``read(start, end)`` of ``handle`` into one buffer, reused: a check reads each byte once, with no new memory."""
    buffer = bytearray(_checksums.CHUNK)

    def read(start: int, end: int) -> memoryview:
        handle.seek(start)
        view = memoryview(buffer)[: end - start]
        filled = 0
        while filled < len(view):
            count = handle.readinto(view[filled:])
            if not count:
                break
            filled += count
        return view[:filled]

    return read
