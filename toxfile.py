"""The matrix's tox plugin: the interpreters its ``py3N-*`` environments ask for, found where pyenv installed them.

tox (through uv) looks for ``python3.N`` on PATH, and uv downloads one where its downloads are reachable. pyenv
installs versions it does not put on PATH; their folders are appended here, after the rest, so ``python3`` stays
what it was. An interpreter found nowhere fails its environment, and the matrix, naming it.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import List

try:
    from tox.plugin import impl
except ImportError:  # imported without tox: tests/test_matrix_summary.py checks interpreter_path
    def impl(function):  # type: ignore[no-redef]
        return function


def _runs(command: str, path: str) -> bool:
    found = shutil.which(command, path=path)
    if found is None:
        return False
    # pyenv's shim of a version that is installed but not selected is on PATH and exits non-zero
    return subprocess.run([found, "--version"], capture_output=True, env={**os.environ, "PATH": path}).returncode == 0


def _pyenv_versions() -> List[Path]:
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    folder = Path(root) / "versions"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def interpreter_path(path: str, minors: List[str]) -> str:
    """``path`` with the bin folder of pyenv's newest ``3.N.x`` appended for each ``3.N`` of ``minors`` not on it."""
    for minor in minors:
        if _runs(f"python{minor}", path):
            continue
        versions = [v for v in _pyenv_versions() if re.fullmatch(rf"{re.escape(minor)}\.\d+", v.name)]
        if versions:
            newest = max(versions, key=lambda v: tuple(int(part) for part in v.name.split(".")))
            path = os.pathsep.join([path, str(newest / "bin")])
    return path


@impl
def tox_add_env_config(env_conf, state) -> None:  # noqa: ARG001  (tox's hook signature)
    minors = [f"3.{factor[3:]}" for factor in env_conf.name.split("-") if re.fullmatch(r"py3\d+", factor)]
    os.environ["PATH"] = interpreter_path(os.environ.get("PATH", ""), minors)
