"""The Lightning packages under test, chosen once, from the shim's own flavour list (``_versions.FLAVOURS``).

Of each kind, the Trainer's and Fabric's, the rank programs run the first installed flavour in that list's
order: ``lightning``'s namespace (``lightning.pytorch``, ``lightning.fabric``) where ``lightning`` is installed,
else the standalone package. The tests read its version and what the shim does with it from here too.
Nothing here imports Lightning (``strategy_class`` and ``UnderTest.module`` do, when called).
"""
import importlib
from types import ModuleType
from typing import NamedTuple, Optional

from lightning_fsdp_resume import _versions

FLAVOURS = {f.package: f for f in _versions.FLAVOURS}
INSTALLED = {p: v for p, v in ((p, _versions.installed_version(f)) for p, f in FLAVOURS.items()) if v}
PATCHABLE = [p for p, v in INSTALLED.items() if _versions.decide(v)[0] == _versions.PATCH]
# The Trainer's flavours (lightning.pytorch, pytorch_lightning), for the tests of the Trainer's strategy
TRAINERS = [p for p in INSTALLED if FLAVOURS[p].kind == _versions.TRAINER]
PATCHABLE_TRAINERS = [p for p in PATCHABLE if p in TRAINERS]
PATCHABLE_FABRICS = [p for p in PATCHABLE if FLAVOURS[p].kind == _versions.FABRIC]


class UnderTest(NamedTuple):
    """One installed flavour, as the rank programs run it."""

    package: str  # "lightning.pytorch", "pytorch_lightning", "lightning.fabric" or "lightning_fabric"
    version: str
    mode: str  # what the shim does with this release: _versions.PATCH or _versions.NATIVE

    @property
    def native(self) -> bool:
        return self.mode == _versions.NATIVE

    def module(self, name: str = "") -> ModuleType:
        """The package, or its submodule ``name`` (``"strategies"``), imported."""
        return importlib.import_module(f"{self.package}.{name}" if name else self.package)


def under_test(kind: str) -> Optional[UnderTest]:
    """The flavour of ``kind`` (``_versions.TRAINER`` or ``_versions.FABRIC``) under test; None if none is installed."""
    package = next((f.package for f in _versions.FLAVOURS if f.kind == kind and f.package in INSTALLED), None)
    if package is None:
        return None
    return UnderTest(package, INSTALLED[package], _versions.decide(INSTALLED[package])[0])


TRAINER_UNDER_TEST = under_test(_versions.TRAINER)
FABRIC_UNDER_TEST = under_test(_versions.FABRIC)
# The Trainer's, which most multi-rank tests run (every environment of the matrix installs one)
PACKAGE, VERSION, MODE = TRAINER_UNDER_TEST
NATIVE = TRAINER_UNDER_TEST.native


def strategy_class(package: str):
    """The Trainer's or Fabric's ``FSDPStrategy`` of ``package``."""
    return importlib.import_module(f"{package}.strategies.fsdp").FSDPStrategy
