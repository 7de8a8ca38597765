"""Patching is exactly reversible and never removes another library's patch; status names every patched class."""
import functools
import importlib

import pytest

import lightning_fsdp_resume as shim
from lightning_fsdp_resume._patching._patcher import NotOutermostError, Patcher, Wrap
from support.flavours import PATCHABLE_FABRICS
from support.marks import needs_patched_fabric


class Original:
    def greet(self):
        return "original"


def _loud(method):
    @functools.wraps(method)
    def greet(self):
        return method(self).upper()

    return greet


def test_revert_restores_what_apply_replaced():
    patcher = Patcher()
    before = dict(vars(Original))
    patcher.apply(Original, {"greet": Wrap(_loud), "added": property(lambda self: 1)})
    assert Original().greet() == "ORIGINAL" and Original().added == 1
    assert patcher.get_original(Original, "greet") is before["greet"]
    assert patcher.revert(Original) and not patcher.revert(Original)
    assert dict(vars(Original)) == before


def test_revert_refuses_when_someone_wrapped_on_top_and_changes_nothing():
    patcher = Patcher()
    pristine = Original.__dict__["greet"]
    patcher.apply(Original, {"greet": Wrap(_loud)})
    ours = Original.__dict__["greet"]
    Original.greet = _loud(ours)  # another library's patch, on top of ours
    theirs = Original.__dict__["greet"]
    try:
        with pytest.raises(NotOutermostError, match=r"Original: greet replaced by someone else"):
            patcher.revert(Original)
        assert Original.__dict__["greet"] is theirs and patcher.is_patched(Original)
        Original.greet = ours  # they undo theirs: now ours can go
        assert patcher.revert(Original) and Original.__dict__["greet"] is pristine
    finally:
        Original.greet = pristine


@needs_patched_fabric
class TestFabricStatus:
    @pytest.fixture(autouse=True)
    def fabric(self):
        package = PATCHABLE_FABRICS[0]
        yield importlib.import_module(f"{package}.fabric").Fabric, package
        shim.patch()

    def test_status_names_fabric_itself_among_the_patched_classes(self, fabric):
        _, package = fabric
        status = shim.status()[package]
        assert (status.mode, status.patched_classes) == ("patched", ("FSDPStrategy", "Fabric", "utilities.cloud_io", "plugins.io.torch_io"))

    def test_unpatch_leaves_a_class_someone_patched_on_top_and_says_so(self, fabric):
        cls, package = fabric
        ours = cls.__dict__["load"]
        cls.load = _loud(ours)
        theirs = cls.__dict__["load"]
        try:
            with pytest.warns(RuntimeWarning, match=r"Fabric: load replaced by someone else"):
                shim.unpatch()
            assert cls.__dict__["load"] is theirs
            status = shim.status()[package]
            assert (status.mode, status.patched_classes) == ("partly patched", ("Fabric",))
        finally:
            cls.load = ours
        shim.unpatch()
        assert "load_raw" not in vars(cls) and shim.status()[package].mode == "unpatched"


def test_a_patch_for_one_call_is_on_during_it_and_off_exactly_after_however_it_ends():
    from lightning_fsdp_resume._patching._patches import CallPatch

    class Model:
        def hook(self):
            return "own"

    class Inheriting(Model):
        pass

    patch = CallPatch("a class", lambda: {"hook": Wrap(lambda original: lambda self: "first, then " + original(self))})
    own = vars(Model)["hook"]
    with patch.applied(Model):
        assert Model().hook() == "first, then own"
    assert vars(Model)["hook"] is own
    with pytest.raises(KeyError), patch.applied(Inheriting):
        assert Inheriting().hook() == "first, then own"
        raise KeyError("the call failed")
    assert "hook" not in vars(Inheriting) and Inheriting().hook() == "own"
