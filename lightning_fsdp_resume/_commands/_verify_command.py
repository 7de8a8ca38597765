"""``lightning-fsdp-resume verify``: every byte of a checkpoint checked against the checksums its save wrote (a
sharded one's manifest, closing its ``.metadata``; a full file's zip CRC-32s), with no model and no process group. Nothing is unpickled and
nothing is written.
"""
import time
from typing import NamedTuple

from .. import _storage
from .._checkpoint import _format, _whole_read
from .._checkpoint._preflight import MissingCheckpointError, listed_size, not_a_checkpoint
from .._storage import checked


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
        if not checked.verify_file(path):
            raise UncheckableError(f"The checkpoint {str(path)!r} is not in torch's zip format: it carries no checksums.")
        return Verified(1, entry.size, time.perf_counter() - started)
    sums = checked.sums(path)
    files = path.listing()
    if sums is None:
        old = f" (its {_format.OLD_CHECKSUMS_FILENAME!r} is an older release's, which this one does not read)"
        raise UncheckableError(
            f"The checkpoint {str(path)!r} carries no checksums: native Lightning's, or an older"
            f" lightning_fsdp_resume's{old if _format.OLD_CHECKSUMS_FILENAME in files else ''}. Its bytes cannot be"
            " verified."
        )
    total = sum(file_sums.hashed for file_sums in sums.values())
    bar = _whole_read.Progress(total, f"checking {str(path)!r}", enabled=progress, command="verify")
    try:
        for relative, file_sums in sorted(sums.items()):
            file_sums.check_size(listed_size(path, files, relative))
            checked.verify_member(path, relative, file_sums, bar.advance)
    finally:
        bar.close()
    return Verified(len(sums), total, time.perf_counter() - started)
