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
        if parts[-1] == "__init__" and len(parts) > 1 and _only_a_docstring(path):
            continue  # a folder's docstring, saying what its modules know: no module of the map
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _only_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)


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


def _calls(path: Path):
    """Every call in the module at ``path``: (the called name as written, ``a.b.c``, and the call node)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            parts, target = [], node.func
            while isinstance(target, ast.Attribute):
                parts.append(target.attr)
                target = target.value
            parts.append(target.id if isinstance(target, ast.Name) else "<expression>")
            yield ".".join(reversed(parts)), node


# Read without a check, or unpickled without the restriction, anywhere but where the check is made
UNPICKLING = {"torch.load", "pickle.load", "pickle.loads", "pickle.Unpickler"}
UNCHECKED_READS = ("read_bytes", "load_source", "dcp_storage_reader", "dcp_storage_writer", "writing")
DCP_STORAGE = {"dcp.FileSystemReader", "dcp.FileSystemWriter", "FileSystemReader", "FileSystemWriter"}


def test_every_pickle_is_unpickled_by_the_one_restricted_unpickler():
    """No module but ``_unpickling`` calls ``torch.load`` or pickle's loaders: a new read of a checkpoint's pickles
    cannot skip the restriction (``trusted=True`` there is a choice made in the open, at the call)."""
    found = [f"{name}: {called}" for name, path in modules().items() if name != "_checkpoint._unpickling"
             for called, _ in _calls(path) if called in UNPICKLING]
    assert not found, found


def test_every_byte_of_a_checkpoint_is_read_and_written_through_the_checked_layer():
    """Outside ``_storage``, no module reads a location's bytes, opens one for reading, writes a file into one or
    makes torch DCP's storage: ``_storage.checked`` does, checking or hashing each byte. Inside it, the stores
    implement those reads and ``_checked`` alone calls them; ``_zip_checks`` reads the zip records it checks."""
    found = []
    for name, path in modules().items():
        for called, node in _calls(path):
            method = called.rsplit(".", 1)[-1]
            reading = method == "open" and "." in called and not any(
                isinstance(arg, ast.Constant) and "w" in str(arg.value) for arg in node.args)
            if name in ("_storage._local", "_storage._objects", "_storage._location", "_patching._torch_compat", "_checkpoint._checksums",
                        "_checkpoint._zip_checks"):
                continue  # the stores, the DCP storage they make, the zip records the checks read
            if called in DCP_STORAGE or (name != "_storage._checked" and (method in UNCHECKED_READS or reading)):
                found.append(f"{name}: {called}")
    assert not found, found


def test_the_rules_above_see_the_calls_they_forbid(tmp_path):
    """The scans read calls as written: a module that broke each rule would be found."""
    module = tmp_path / "broken.py"
    module.write_text("import pickle, torch\ntorch.load(f)\npickle.loads(b)\nlocation.read_bytes(0, 1)\n"
                      "(location / 'x').open('rb')\n")
    called = [name for name, _ in _calls(module)]
    assert {"torch.load", "pickle.loads"} <= set(called) and "location.read_bytes" in called
    assert any(name.endswith(".open") for name in called)


# Names of torch's features that differ between releases: probing one with hasattr is asking which release this is
TORCH_FEATURES = {"async_save", "add_safe_globals", "get_safe_globals", "load_id", "create_stream", "no_dist", "mmap",
                  "async_stager", "sync_files"}


def _names_in(node: ast.AST) -> Set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


def test_only_torch_compat_tells_torch_releases_apart():
    """No module but ``_torch_compat`` reads torch's release or probes one of torch's features: each question is
    asked there, once, with the release that answers it named."""
    found = []
    for name, path in modules().items():
        if name == "_patching._torch_compat":
            continue
        for called, node in _calls(path):
            if called.rsplit(".", 1)[-1] == "torch_release":
                found.append(f"{name}: {called}()")
            elif called == "hasattr" and len(node.args) == 2:
                probed = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
                if probed in TORCH_FEATURES or _names_in(node.args[0]) & {"torch", "dcp", "dist", "serialization"}:
                    found.append(f"{name}: hasattr(..., {probed!r})")
        versions = [n for n in ast.walk(ast.parse(path.read_text()))
                    if isinstance(n, ast.Attribute) and n.attr == "__version__" and _names_in(n.value) == {"torch"}]
        found += [f"{name}: torch.__version__"] * len(versions)
    assert not found, found


def test_the_release_rule_sees_what_it_forbids(tmp_path):
    module = tmp_path / "probing.py"
    module.write_text("import torch\nif hasattr(torch.serialization, 'add_safe_globals'): pass\ncompat.torch_release()\n")
    calls = dict(_calls(module))
    assert "compat.torch_release" in calls
    assert _names_in(calls["hasattr"].args[0]) & {"torch"}


def _stashes(path: Path):
    """Each place the module at ``path`` writes into an object's ``vars()`` (an item set, ``setdefault``, ``pop``,
    ``update``, ``clear``), rebinds a module global (``global``) or makes a context variable: state no declaration
    shows."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Global):
            yield f"global {', '.join(node.names)}"
        if isinstance(node, ast.Call) and _names_in(node.func) & {"ContextVar"}:
            yield "a context variable"
        written = [t.value for t in getattr(node, "targets", []) if isinstance(t, ast.Subscript)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "setdefault", "pop", "update", "clear", "__setitem__"):
            written.append(node.func.value)
        yield from ("vars() written" for value in written
                    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "vars")


def test_what_the_package_keeps_on_objects_it_does_not_own_is_declared_in_held():
    """Only ``_held`` writes into an object's ``vars()``: a strategy, the epoch loop and a module each carry one
    dataclass of it, which a patch table declares; the process's settings are ``_held.SETTINGS``, not module globals
    (``__init__`` keeps whether patching is on), and what the user's call asked is ``_held.Asked``, not a context
    variable of each reader's own."""
    found = [f"{name}: {stash}" for name, path in modules().items() if name not in ("_patching._held", "__init__")
             for stash in _stashes(path)]
    assert not found, found
    from lightning_fsdp_resume._patching import _held, _patches

    holders = {cls for cls in vars(_held).values() if isinstance(cls, type) and cls.__module__ == _held.__name__}
    assert {table.held for table in _patches.TABLES if table.held} == holders - {_held.Settings, _held.Asked}


def test_the_stash_rule_sees_what_it_forbids(tmp_path):
    module = tmp_path / "stashing.py"
    module.write_text("def f(obj):\n    global _mode\n    vars(obj)['k'] = 1\n    vars(obj).setdefault('k', {})\n"
                      "    vars(obj).pop('k', None)\n    return vars(obj).get('k')\n_ASKED = contextvars.ContextVar('x')\n")
    assert sorted(_stashes(module)) == ["a context variable", "global _mode", "vars() written", "vars() written", "vars() written"]


def _participant_classes(path: Path) -> Set[str]:
    """The classes the module at ``path`` declares as checkpoint participants (subclasses of ``Participant`` or
    ``Entry``)."""
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
            and any({"Participant", "Entry"} & _names_in(base) for base in node.bases)}


# The readers that pick a participant's entry by the user's option (``--ema``, ``load_from_checkpoint(ema=True)``)
READERS = {"_checkpoint._whole_read", "_commands._consolidate", "_lightning._lightning_reads"}


def test_no_module_outside_the_participants_names_one():
    """Saves and loads know the states kept beside the weights through ``_participants`` alone: a participant's module
    is imported by the entry point that offers it (layer 10) or the table that registers it (layer 9) and by no other
    but participants, and its entries' keys are named by the format, itself and the readers the user asks for it."""
    known, layer = modules(), layers()
    participants = {name for name, path in known.items() if _participant_classes(path)}
    assert participants, "no module declares a Participant"
    importing = [f"{name} imports {target}" for name, path in known.items() if name not in participants and layer[name] < 9
                 for target in imports(name, path, set(known)) & participants]
    assert not importing, importing
    keys = {"EMA_KEY", "EMA_STATE_KEY"}
    naming = [f"{name} names {', '.join(sorted(_names_in(ast.parse(path.read_text())) & keys))}" for name, path in known.items()
              if name not in participants | READERS | {"_checkpoint._format"} and _names_in(ast.parse(path.read_text())) & keys]
    assert not naming, naming


def test_the_participant_rule_sees_what_it_forbids(tmp_path):
    module = tmp_path / "participating.py"
    module.write_text("from . import _participants\nclass Kept(_participants.Participant):\n    key = _format.EMA_KEY\n"
                      "class Place(_participants.Entry):\n    key = 'place'\nclass Other(dict):\n    pass\n")
    assert _participant_classes(module) == {"Kept", "Place"}
    assert "EMA_KEY" in _names_in(ast.parse(module.read_text()))
    assert imports("_lightning._strategy", PACKAGE / "_lightning" / "_strategy.py", set(modules())) & {"_participants"}


# Where a Patcher may be made: the tables' applier, the tables (a patch for one call), the patcher itself, and the test
# helpers' own opt-in patches of torch and Lightning for CPU FSDP (``enable_cpu_fsdp``), which the import never applies
PATCHERS = {"__init__", "_patching._patches", "_patching._patcher", "testing"}


def test_every_patch_the_import_applies_is_declared_in_the_tables():
    """No module but the tables' own makes a ``Patcher``: a patch applied at call time is declared in ``_patches``
    (``CallPatch``) beside the tables, and the code that needs it is handed its ``applied``."""
    found = [name for name, path in modules().items() if name not in PATCHERS and "Patcher" in _names_in(ast.parse(path.read_text()))]
    assert not found, found


def test_the_patch_rule_sees_what_it_forbids(tmp_path):
    module = tmp_path / "patching.py"
    module.write_text("from ._patcher import Wrap\nwith _patcher.Patcher() as p:\n    p.apply(cls, {'f': Wrap(g)})\n")
    assert "Patcher" in _names_in(ast.parse(module.read_text()))
    assert "Patcher" not in _names_in(ast.parse("from ._patcher import Patcher\n"))
