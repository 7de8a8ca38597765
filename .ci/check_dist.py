"""Check the sdist and wheel that `tox -e lint` built into DIST (the wheel is built from the sdist).

twine's strict metadata check; the Project-URL entries (setup.cfg's project_urls) in both, the README's way to
the repository from the package index; the sdist carrying what a reader needs to check the package (MANIFEST.in:
the documents, every file of docs/, tests/, benchmarks/ and .ci/ in this source tree, and each file a
document's relative link names); the wheel holding the package and its metadata only, with ``py.typed`` and
``LICENSE``; and the wheel installed with its dependencies into a fresh venv (uv, from the lint environment)
where ``import lightning_fsdp_resume`` works without torch or Lightning and imports neither. Exits non-zero,
saying what is wrong, otherwise.
"""
import posixpath
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import List

# the source tree this script belongs to: what the sdist must carry is read from it
ROOT = Path(__file__).resolve().parents[1]
# named by MANIFEST.in or setuptools' defaults; tests/conftest.py is the file setuptools' defaults leave out
SDIST_FILES = ("README.md", "LICENSE", "CONTRIBUTING.md", "tox.ini", "toxfile.py", "setup.cfg", "pyproject.toml", "tests/conftest.py")
# grafted whole by MANIFEST.in (tests/ with support/): each must reach the sdist with every file it has here
SDIST_TREES = ("docs", "tests", "tests/support", "benchmarks", ".ci", ".ci/outcomes")
# where the README's relative links point (docs/, CONTRIBUTING.md) and where to report a problem
PROJECT_URLS = ("Documentation", "Source", "Issues")

IMPORT_CHECK = """
import sys
import lightning_fsdp_resume as shim
loaded = sorted(m for m in ("torch", "lightning", "pytorch_lightning") if m in sys.modules)
assert not loaded, f"importing the package imported {loaded}"
print("import lightning_fsdp_resume", shim.__version__, "from", shim.__file__)
"""


def _source_files(tree: str) -> List[str]:
    """The files of ``tree`` in this source tree, as the sdist names them (MANIFEST.in excludes bytecode)."""
    paths = (p for p in (ROOT / tree).rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"))
    return sorted(p.relative_to(ROOT).as_posix() for p in paths)


def _link_targets(markdown: str) -> List[str]:
    """The relative link targets of a Markdown document, anchors cut off (tests/test_docs.py checks the anchors)."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link.partition("#")[0] for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]


def check_sdist(sdist: Path) -> List[str]:
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers() if m.isfile() and "/" in m.name}
        documents = {name: tar.extractfile(m).read().decode() for name, m in members.items() if name.endswith(".md")}
    problems = [f"lacks {name}" for name in SDIST_FILES if name not in members]
    for tree in SDIST_TREES:
        source = _source_files(tree)
        if not source:
            problems.append(f"{tree}/ has no files in the source tree {ROOT} to check the sdist against")
        elif not any(name.startswith(tree + "/") for name in members):
            problems.append(f"has no {tree}/ (MANIFEST.in grafts it)")
        else:
            problems += [f"lacks {name} ({tree}/ is in it, but not whole)" for name in source if name not in members and name not in SDIST_FILES]
    problems += [f"holds bytecode {name}" for name in sorted(members) if "__pycache__/" in name or name.endswith((".pyc", ".pyo"))]
    for document in ("README.md", "CONTRIBUTING.md", *sorted(n for n in documents if n.startswith("docs/"))):
        targets = {posixpath.normpath(posixpath.join(posixpath.dirname(document), t)) for t in _link_targets(documents.get(document, ""))}
        for name in sorted(targets):
            if name not in members and not any(n.startswith(name + "/") for n in members):
                problems.append(f"lacks {name}, which {document} links to")
    return [f"{sdist.name} {problem}" for problem in problems]


def check_wheel(wheel: Path) -> List[str]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    missing = [name for name in ("lightning_fsdp_resume/py.typed",) if name not in names]
    if not any(".dist-info/" in name and name.endswith("/LICENSE") for name in names):
        missing.append("*.dist-info/**/LICENSE")
    problems = [f"{wheel.name} lacks {', '.join(missing)}"] if missing else []
    # tests/, docs/, benchmarks/ and .ci/ belong to the sdist only
    foreign = sorted(n for n in names if not (n.startswith("lightning_fsdp_resume/") or n.split("/")[0].endswith(".dist-info")))
    if foreign:
        problems.append(f"{wheel.name} holds files outside the package and its metadata: {', '.join(foreign)}")
    return problems


def check_project_urls(artifact: str, metadata: str) -> List[str]:
    """``metadata``: the text of a wheel's METADATA or an sdist's PKG-INFO."""
    entries = Parser().parsestr(metadata).get_all("Project-URL") or []
    urls = dict(entry.split(", ", 1) for entry in entries if ", " in entry)
    problems = [f"{artifact}'s metadata has no Project-URL {label} (setup.cfg: project_urls)" for label in PROJECT_URLS if label not in urls]
    problems += [f"{artifact}'s Project-URL {label} is not an https URL: {url!r}" for label, url in urls.items() if not url.startswith("https://")]
    problems += [f"{artifact}'s Project-URL entry {entry!r} is not 'Label, URL'" for entry in entries if ", " not in entry]
    return problems


def main(dist: Path) -> int:
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {dist}, found {[p.name for p in dist.iterdir()]}")
        return 1
    subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(wheels[0]), str(sdists[0])], check=True)
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel_metadata = next((wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".dist-info/METADATA")), "")
    with tarfile.open(sdists[0]) as tar:
        pkg_info = next((m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")), None)
        sdist_metadata = tar.extractfile(pkg_info).read().decode() if pkg_info else ""
    problems = check_sdist(sdists[0]) + check_wheel(wheels[0])
    problems += check_project_urls(wheels[0].name, wheel_metadata) + check_project_urls(sdists[0].name, sdist_metadata)
    if problems:
        print("\n".join(problems))
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
