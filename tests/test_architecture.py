"""The package's import graph follows the architecture map in CONTRIBUTING.md: every module is in one layer, no
module imports one from a layer above its own, and no import cycle, counting imports inside functions too."""
import ast
import re
from pathlib import Path
from typing import Dict, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_fsdp_resume"
NAME = PACKAGE.name


def layers() -> Dict[str, int]:
    """Module -> its layer, from the table under CONTRIBUTING.md's "Architecture" heading."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("\n## Architecture\n", 1)[1].split("\n## ", 1)[0]
    found: Dict[str, int] = {}
    for row in re.findall(r"^\| (\d+) [^|]*\| ([^|]*) \|", section, flags=re.MULTILINE):
        for module in re.findall(r"`([\w.]+)`", row[1]):
            found[module] = int(row[0])
    return found


def modules() -> Dict[str, Path]:
    """Every module of the package by its name below the package (``__init__`` for the package itself)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The package's modules that module ``name`` imports, anywhere in it (inside functions too)."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else ([] if name == "__init__" else name.split("."))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names if alias.name.split(".")[0] == NAME]
            found |= {target[len(NAME) + 1:] or "__init__" for target in targets}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if (node.module or "").split(".")[0] != NAME:
                    continue
                base = [part for part in node.module.split(".")[1:]]
            else:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            for alias in node.names:  # `from . import _format` imports a module; `from ._x import f`, module _x
                candidate = ".".join(base + [alias.name])
                found.add(candidate if candidate in known else ".".join(base) or "__init__")
    found.discard(name)
    return found


def test_every_module_the_map_names_exists_and_every_module_is_in_it():
    assert set(layers()) == set(modules())


def test_no_module_imports_one_from_a_layer_above_it():
    layer, known = layers(), modules()
    upward = [
        f"{name} (layer {layer[name]}) imports {target} (layer {layer[target]})"
        for name, path in known.items() for target in imports(name, path, set(known)) if layer[target] > layer[name]
    ]
    assert not upward, upward


def test_the_import_graph_has_no_cycle():
    known = modules()
    graph = {name: imports(name, path, set(known)) for name, path in known.items()}
    done: Set[str] = set()

    def visit(name: str, trail: list) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(name):] + [name]))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_only_the_storage_package_tells_one_store_from_another():
    """Local directory or object store is decided once, when a path is opened: no other module names a store's class."""
    named = [name for name, path in modules().items()
             if not name.startswith("_storage") and re.search(r"\b(LocalLocation|ObjectLocation)\b", path.read_text())]
    assert not named, named
