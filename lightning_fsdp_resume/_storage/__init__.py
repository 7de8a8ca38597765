"""Where a checkpoint lives, decided once: ``open_path`` makes a ``Location`` of its one store, a local directory
(``_local``) or an object store through fsspec (``_objects``). What differs between them is a ``Location`` method;
nothing outside asks which it has. Bytes go through ``checked``. More: docs/behaviour.md#how-the-code-is-laid-out.
"""
from pathlib import Path
from typing import Any

from .._checkpoint import _format
from . import _checked as checked  # noqa: F401  (every checked read and write of the package: `_storage.checked`)
from ._local import LocalLocation
from ._location import Location
from ._objects import ObjectLocation


def open_path(target: Any, action: str, trusted: bool = False) -> Location:
    """The location ``target`` (a path or a URL) names. ``file://`` URLs are local paths; any other URL is opened with
    its fsspec implementation, and one that is not installed is refused with what to install. ``action`` ("save",
    "load", ...) says in that error what could not be done. ``trusted``: the pickles read there may name any
    callable (the user's ``weights_only=False``); otherwise they are read restricted (``Location.trusted``)."""
    if isinstance(target, Location):
        return target
    return _open(target, action).trusting(trusted)


def _open(target: Any, action: str) -> Location:
    text = str(target)
    if not _format.is_url(text):
        return LocalLocation(Path(target))
    try:
        from fsspec.core import url_to_fs

        fs, path = url_to_fs(text)
    except (ImportError, ValueError) as error:
        extra = " (for s3://: pip install 'lightning-fsdp-resume[s3]')" if text.startswith(("s3://", "s3a://")) else ""
        raise ImportError(
            f"Cannot {action} the checkpoint {text!r}: its protocol has no fsspec implementation here ({error})."
            f" Install it{extra} on every node. Nothing was written."
        ) from error
    if is_local(fs):
        return LocalLocation(Path(path))
    return ObjectLocation(fs, path)


def is_local(fs: Any) -> bool:
    """Whether an fsspec file system is the local one (``file://``)."""
    protocol = fs.protocol
    return "file" in ([protocol] if isinstance(protocol, str) else list(protocol))


def may_be_sharded_directory(target: Any) -> bool:
    """Whether ``target`` could name a sharded checkpoint directory, asked before opening it: http(s) URLs are
    Lightning's to download (torch.hub), and asking fsspec's http file system whether one is a directory would
    fetch the whole file as a page of links."""
    return isinstance(target, (str, Path)) and not str(target).startswith("http")
