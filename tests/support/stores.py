"""Where a test's checkpoints are, and what it asks of that place, whether a local directory or a bucket: the
names a user sees, whether one exists, and a hash of everything a checkpoint consists of.

A checkpoint at a URL is read here as docs/saving.md tells a user to read one without the package: a small JSON
pointer whose ``data`` names the sibling prefix that holds the sharded directory, or an ordinary file.
"""
import hashlib
import json
from pathlib import Path
from typing import Dict, List, Optional

from support.s3 import Url
from support.states import file_hashes

POINTER_FORMAT = "lightning_fsdp_resume.pointer"


class LocalStore:
    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def names(self) -> List[str]:
        return sorted(p.name for p in self.dir.iterdir()) if self.dir.is_dir() else []

    def exists(self, name: str) -> bool:
        return (self.dir / name).exists()

    def hashes(self, name: str) -> Dict[str, str]:
        return file_hashes(self.dir / name)


class S3Store:
    """A directory in a bucket, read with s3fs as configured in this process (``fsspec.config.conf``)."""

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.dir = Url(url)
        self.fs, self.path = url_to_fs(url)

    def _entries(self) -> List[str]:
        self.fs.invalidate_cache()
        try:
            return sorted(p.rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False))
        except FileNotFoundError:
            return []

    def pointed(self, name: str) -> Optional[str]:
        """The data prefix the pointer ``name`` names; None where ``name`` is an ordinary file."""
        content = self.fs.cat_file(f"{self.path}/{name}")
        if not content.startswith(b"{"):
            return None
        pointer = json.loads(content)
        assert POINTER_FORMAT in pointer, pointer
        return pointer["data"]

    def names(self) -> List[str]:
        """What a user sees: every entry but the data of the pointers there (leftovers of saves stay listed)."""
        entries = self._entries()
        named = {self.pointed(e) for e in entries if not e.startswith(".") and self.fs.isfile(f"{self.path}/{e}")}
        return [e for e in entries if e not in named]

    def exists(self, name: str) -> bool:
        return name in self._entries()

    def hashes(self, name: str) -> Dict[str, str]:
        """The pointer's (or file's) hash, and those of every object of the data it names."""
        hashes = {name: hashlib.sha256(self.fs.cat_file(f"{self.path}/{name}")).hexdigest()}
        data = self.pointed(name)
        if data is not None:
            for path in sorted(self.fs.find(f"{self.path}/{data}")):
                hashes[path[len(self.path) + 1 :]] = hashlib.sha256(self.fs.cat_file(path)).hexdigest()
        return hashes

    def download(self, name: str, into: Path) -> Path:
        """The checkpoint ``name`` as a local path, read as docs/saving.md says, without the package."""
        data = self.pointed(name)
        if data is None:
            self.fs.get(f"{self.path}/{name}", str(into))
        else:
            self.fs.get(f"{self.path}/{data}/", str(into), recursive=True)
        return into
