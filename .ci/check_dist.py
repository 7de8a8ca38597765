"""Check the sdist and wheel that `tox -e lint` built into DIST (the wheel is built from the sdist).

twine's strict metadata check; ``py.typed`` and ``LICENSE`` in the wheel; and the wheel installed with its
dependencies into a fresh venv (uv, from the lint environment) where ``import lightning_fsdp_resume`` works
without torch or Lightning and imports neither. Exits non-zero, saying what is wrong, otherwise.
"""
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

IMPORT_CHECK = """
import sys
import lightning_fsdp_resume as shim
loaded = sorted(m for m in ("torch", "lightning", "pytorch_lightning") if m in sys.modules)
assert not loaded, f"importing the package imported {loaded}"
print("import lightning_fsdp_resume", shim.__version__, "from", shim.__file__)
"""


def main(dist: Path) -> int:
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {dist}, found {[p.name for p in dist.iterdir()]}")
        return 1
    subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheels[0]), str(sdists[0])], check=True)
    names = zipfile.ZipFile(wheels[0]).namelist()
    missing = [name for name in ("lightning_fsdp_resume/py.typed",) if name not in names]
    if not any(".dist-info/" in name and name.endswith("/LICENSE") for name in names):
        missing.append("*.dist-info/**/LICENSE")
    if missing:
        print(f"{wheels[0].name} lacks {', '.join(missing)}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        env = Path(tmp) / "venv"
        uv = [sys.executable, "-m", "uv"]
        subprocess.run([*uv, "venv", "--quiet", "--python", sys.executable, str(env)], check=True)
        subprocess.run([*uv, "pip", "install", "--quiet", "--python", str(env / "bin" / "python"), str(wheels[0])], check=True)
        # from the temporary folder, so that the source tree is not on sys.path
        subprocess.run([str(env / "bin" / "python"), "-c", IMPORT_CHECK], cwd=tmp, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
