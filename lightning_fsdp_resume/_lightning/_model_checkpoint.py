"""What the shim changes on Lightning 2.0.x's ``ModelCheckpoint``: finding ``ckpt_path="last"`` at a URL. 2.0.x lists
its ``dirpath`` with fsspec, whose listing drops the protocol (``bucket/run/last.ckpt``), then opens that as a local
path: with ``dirpath="s3://..."``, ``fit(ckpt_path="last")`` found nothing, warned and trained from scratch.
"""
import functools
from typing import Any, Callable, Set

from .. import _storage


def wrap_find_last_checkpoints(original: Callable) -> Callable:
    @functools.wraps(original)
    def _find_last_checkpoints(self: Any, trainer: Any) -> Set[str]:
        found = original(self, trainer)
        fs = getattr(self, "_fs", None)
        if fs is None or _storage.is_local(fs):
            return found
        return {fs.unstrip_protocol(path) for path in found}

    return _find_last_checkpoints
