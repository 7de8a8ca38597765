"""Activation, gating, patch/unpatch and the strategy's single-process contract.

Import-order behaviour is checked in fresh interpreters; the rest runs in this process and leaves the
shim patched, as the import left it.
"""
import ast
import logging
import subprocess
import sys
import textwrap
import types

import pytest

import lightning_fsdp_resume as shim
from lightning_fsdp_resume._patching import _versions
from lightning_fsdp_resume._patching._patches import FSDP_STRATEGY_PATCHES, TABLES, tables_for
from support.flavours import FLAVOURS, INSTALLED, NATIVE_MODE, PATCHABLE, PATCHABLE_TRAINERS, mode_of, strategy_class

NATIVE = [p for p, v in INSTALLED.items() if mode_of(v) == NATIVE_MODE]
# An attribute the FSDPStrategy of each kind defines itself when patched or native, and not in 2.0.x
MARKER = {_versions.TRAINER: "restore_checkpoint_after_setup", _versions.FABRIC: "load_checkpoint"}


@pytest.fixture
def restore_patch():
    yield
    shim.patch()


ORDERS = ["shim first", "lightning first"]


def _distribution(package: str) -> str:
    """The packages one interpreter probes together: the ``lightning`` umbrella's flavours (one import of it serves
    both), and the standalone ``pytorch_lightning`` with the ``lightning_fabric`` it imports."""
    return "lightning" if package.startswith("lightning.") else "standalone"


def _import_order_probe(packages, order: str) -> str:
    """Each package's mode and whether its FSDPStrategy has the marker, one line each, with the shim imported before
    all of them or after."""
    imports = [f"import {package}.strategies.fsdp" for package in packages]
    imports = ["import lightning_fsdp_resume as shim", *imports] if order == "shim first" else [*imports, "import lightning_fsdp_resume as shim"]
    checks = [f"print(shim.status()[{package!r}].mode, {MARKER[FLAVOURS[package].kind]!r} in vars({package}.strategies.fsdp.FSDPStrategy))"
              for package in packages]
    return "\n".join(imports + checks)


def _untouched_probe(packages) -> str:
    """For each native package, one line: whether importing the shim after it left its FSDPStrategy as it was."""
    imports = "; ".join(f"import {package}.strategies.fsdp" for package in packages)
    return f"""
        import sys
        {imports}
        before = {{p: dict(vars(sys.modules[p + ".strategies.fsdp"].FSDPStrategy)) for p in {list(packages)!r}}}
        import lightning_fsdp_resume as shim
        for package, old in before.items():
            new = dict(vars(sys.modules[package + ".strategies.fsdp"].FSDPStrategy))
            print(old.keys() == new.keys() and all(old[k] is new[k] for k in old), shim.status()[package].mode)
        """


_DISABLED_PROBE = f"""
        import lightning_fsdp_resume as shim
        {"; ".join(f"import {package}" for package in INSTALLED)}
        print(sorted({{s.mode for s in shim.status().values()}}))
        shim.patch()
        print(sorted({{s.mode for s in shim.status().values()}}))
        """

_BARE_PROBE = """
        import sys, lightning_fsdp_resume
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'pytorch_lightning')))
        print(sorted(m for m in sys.modules if m.startswith('lightning_fsdp_resume.')))
        """

# Fresh interpreters, each mostly an import of Lightning: started together, read by the tests below.
_GROUPS = {name: [p for p in sorted(INSTALLED) if _distribution(p) == name] for name in {_distribution(p) for p in INSTALLED}}
PROBES = {
    ("bare",): (_BARE_PROBE, {}),
    **{("order", name, order): (_import_order_probe(packages, order), {}) for name, packages in _GROUPS.items() for order in ORDERS},
    **({("untouched",): (_untouched_probe(NATIVE), {})} if NATIVE else {}),
    ("disabled",): (_DISABLED_PROBE, {shim.DISABLE_ENV: "1"}),
}


def _line_of(out: str, packages, package: str) -> str:
    """A probe's line for ``package``, one of the ``packages`` it probed in that order."""
    lines = out.splitlines()
    assert len(lines) == len(packages), out
    return lines[list(packages).index(package)]


@pytest.fixture(scope="module")
def probe():
    import os

    running = {
        key: subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, **env})
        for key, (code, env) in PROBES.items()
    }
    finished = {key: process.communicate(timeout=300) for key, process in running.items()}
    codes = {key: process.returncode for key, process in running.items()}

    def result(*key) -> str:
        """The probe's stdout, or a test failure with its stderr."""
        assert codes[key] == 0, finished[key][1][-4000:]
        return finished[key][0]

    return result


def test_import_imports_neither_torch_nor_lightning(probe):
    assert probe("bare").splitlines()[0] == "[]"


def test_import_registers_the_tables_without_loading_what_they_put(probe):
    """The tables and what they declare (``_held``'s dataclasses) load; the methods they put, not before a flavour is
    patched."""
    loaded = ast.literal_eval(probe("bare").splitlines()[1])
    patching = ("_patching", "_patching._patcher", "_patching._patches", "_patching._versions", "_patching._held")
    assert set(loaded) <= {f"lightning_fsdp_resume.{name}" for name in patching}


def test_each_kind_of_flavour_has_one_table_per_patched_class_or_module():
    assert {t.kind for t in TABLES} == {f.kind for f in _versions.FLAVOURS}
    for kind in (_versions.TRAINER, _versions.FABRIC):
        tables = tables_for(kind)
        assert len({t.name for t in tables}) == len({(t.module, t.cls) for t in tables}) == len(tables), tables


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("package", sorted(INSTALLED))
def test_any_import_order_gives_the_same_result(probe, package, order):
    group = _distribution(package)
    out = _line_of(probe("order", group, order), _GROUPS[group], package)
    marker = MARKER[FLAVOURS[package].kind]
    expected = "patched True" if package in PATCHABLE else "native " + str(marker in vars(strategy_class(package)))
    assert out.split() == expected.split()


@pytest.mark.parametrize("package", NATIVE)
def test_native_lightning_is_left_untouched(probe, package):
    assert _line_of(probe("untouched"), NATIVE, package).split() == ["True", "native"]


def test_environment_variable_disables_the_automatic_patch(probe):
    before, after = (set(ast.literal_eval(line)) for line in probe("disabled").splitlines())
    if PATCHABLE:
        assert "unpatched" in before and "patched" not in before
        assert "patched" in after and "unpatched" not in after
    else:  # native Lightning only: neither the variable nor patch() changes anything
        assert before == after and "native" in before and not {"patched", "unpatched"} & before


def test_the_tests_read_the_installed_releases_as_the_shim_does():
    """The tests decide what runs from the installed releases themselves (support/flavours.py), not from the shim:
    the two readings agree, flavour for flavour."""
    shims = {f.package: _versions.installed_version(f) for f in _versions.FLAVOURS}
    assert {p: v for p, v in shims.items() if v} == INSTALLED
    for package, version in INSTALLED.items():
        decided = _versions.decide(version)[0]
        assert (mode_of(version) or _versions.UNSUPPORTED) == decided, (package, version)
        assert FLAVOURS[package].kind == next(f.kind for f in _versions.FLAVOURS if f.package == package)


@pytest.mark.skipif(not PATCHABLE, reason="no Lightning 2.0.x installed: nothing to patch")
class TestPatching:
    @pytest.fixture(autouse=True)
    def imported(self):
        for package in PATCHABLE:
            strategy_class(package)

    def test_status_names_mode_and_reason(self):
        for package in PATCHABLE:
            status = shim.status()[package]
            assert (status.mode, status.version) == ("patched", INSTALLED[package])
            assert "lacks sharded FSDP checkpoints" in status.reason

    def test_every_table_entry_is_on_the_class(self):
        import importlib

        for package in PATCHABLE:
            for table in tables_for(FLAVOURS[package].kind):
                cls = table.target_in(importlib.import_module(table.module_in(package)))
                for name, entry in table.rows.items():
                    assert name in vars(cls), (cls, name)
                    if not hasattr(entry, "factory"):
                        assert vars(cls)[name] is entry

    def test_patching_twice_is_a_no_op(self):
        snapshots = {p: dict(vars(strategy_class(p))) for p in PATCHABLE}
        shim.patch()
        shim.patch()
        for package, before in snapshots.items():
            after = dict(vars(strategy_class(package)))
            assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)

    def test_unpatch_restores_the_class_attribute_for_attribute(self, restore_patch):
        cls = strategy_class(PATCHABLE_TRAINERS[0])
        shim.unpatch()
        pristine = dict(vars(cls))
        assert "restore_checkpoint_after_setup" not in pristine
        shim.patch()
        assert vars(cls)["__init__"] is not pristine["__init__"]
        shim.unpatch()
        restored = dict(vars(cls))
        assert pristine.keys() == restored.keys() and all(pristine[k] is restored[k] for k in pristine)
        assert shim.status()[PATCHABLE_TRAINERS[0]].mode == "unpatched"
        shim.unpatch()  # idempotent
        assert dict(vars(cls)).keys() == pristine.keys()

    def test_unpatch_restores_every_patched_class_of_every_flavour(self, restore_patch):
        import importlib

        tables = [(package, table) for package in PATCHABLE for table in tables_for(FLAVOURS[package].kind)]
        classes = [table.target_in(importlib.import_module(table.module_in(package))) for package, table in tables]
        shim.unpatch()
        pristine = {cls: dict(vars(cls)) for cls in classes}
        shim.patch()
        assert all(dict(vars(cls)) != pristine[cls] for cls in classes)
        shim.unpatch()
        for cls, before in pristine.items():
            after = dict(vars(cls))
            assert before.keys() == after.keys() and all(before[k] is after[k] for k in before), cls

    def test_subclasses_get_the_behaviour_unless_they_override_it(self, restore_patch):
        cls = strategy_class(PATCHABLE_TRAINERS[0])
        shim.unpatch()

        class Before(cls):
            pass

        class Overriding(cls):
            @property
            def restore_checkpoint_after_setup(self):
                return "mine"

        shim.patch()

        class After(cls):
            pass

        for sub in (Before, After):
            strategy = sub(state_dict_type="sharded")
            assert strategy.restore_checkpoint_after_setup is True
            assert strategy._state_dict_type == "sharded"
        assert Overriding().restore_checkpoint_after_setup == "mine"
        assert Overriding().lightning_restore_optimizer is False

    def test_contract_properties_and_no_op_loaders(self):
        for package in PATCHABLE_TRAINERS:
            strategy = strategy_class(package)()
            assert strategy._state_dict_type == "full"
            assert strategy.restore_checkpoint_after_setup is True
            assert strategy.lightning_restore_optimizer is False
            checkpoint = {"state_dict": {"w": 1}, "optimizer_states": [{}]}
            assert strategy.load_model_state_dict(checkpoint) is None
            assert strategy.load_optimizer_state_dict(checkpoint) is None
            assert checkpoint == {"state_dict": {"w": 1}, "optimizer_states": [{}]}

    def test_unknown_state_dict_type_fails_at_save(self, tmp_path):
        strategy = strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type="bogus")
        with pytest.raises(ValueError, match="Unknown state_dict_type: bogus"):
            strategy.save_checkpoint({}, tmp_path / "x.ckpt")
        assert not (tmp_path / "x.ckpt").exists()

    def test_storage_options_are_refused(self, tmp_path):
        strategy = strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type="sharded")
        with pytest.raises(TypeError, match="storage_options"):
            strategy.save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})

    def test_sharded_needs_torch_2(self, monkeypatch):
        from lightning_fsdp_resume._patching import _torch_compat

        monkeypatch.setattr(_torch_compat, "torch_release", lambda: (1, 13, 1))
        with pytest.raises(NotImplementedError, match=r"is not supported in PyTorch < 2\.0\. Please upgrade `torch`\."):
            strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type="sharded")
        assert strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type="full")._state_dict_type == "full"


@pytest.mark.parametrize(
    "version,mode",
    [("1.9.5", "unsupported"), ("2.0.0", "patch"), ("2.0.9", "patch"), ("2.0.9.post0", "patch"),
     ("2.1.0rc1", "native"), ("2.1.4", "native"), ("2.6.0", "native"), ("3.0.0", "native")],
)
def test_version_gate(version, mode):
    assert _versions.decide(version)[0] == mode


def test_unsupported_lightning_is_refused_once_with_the_reason(caplog):
    from lightning_fsdp_resume import _patch_module

    flavour = _versions.Flavour(package="old_lightning", distribution="old-lightning")
    strategies = types.ModuleType("old_lightning.strategies.fsdp")
    strategies.FSDPStrategy = type("FSDPStrategy", (), {})
    package = types.ModuleType("old_lightning")
    package.__version__ = "1.9.5"
    sys.modules["old_lightning"] = package
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_fsdp_resume"):
            _patch_module(flavour, FSDP_STRATEGY_PATCHES, strategies)
            _patch_module(flavour, FSDP_STRATEGY_PATCHES, strategies)
    finally:
        del sys.modules["old_lightning"]
    refusals = [r.getMessage() for r in caplog.records if "old_lightning" in r.getMessage()]
    assert len(refusals) == 1 and "1.9.5 predates the 2.0 FSDPStrategy" in refusals[0]
    assert not set(FSDP_STRATEGY_PATCHES.rows) & set(vars(strategies.FSDPStrategy))
