"""The Lightning packages and the torch under test, read from what is installed and their releases: never from the
package under test, so that a fault in its version logic cannot turn tests into skips (``test_activation`` holds the two to agree).

Of each kind, the Trainer's and Fabric's, the rank programs run the first installed flavour in ``FLAVOURS``'s
order: ``lightning``'s namespace (``lightning.pytorch``, ``lightning.fabric``) where ``lightning`` is installed,
else the standalone package. The tests read its version and what the shim does with it from here too.
Nothing here imports Lightning (``strategy_class`` and ``UnderTest.module`` do, when called).
"""
import importlib
import re
from importlib import metadata
from types import ModuleType
from typing import NamedTuple, Optional, Tuple

TRAINER, FABRIC = "trainer", "fabric"  # the kinds the shim's patch tables are declared for
PATCH, NATIVE_MODE = "patch", "native"  # what the shim is to do with a release: 2.0.x patched, 2.1 and newer native


class Flavour(NamedTuple):
    package: str
    distributions: Tuple[str, ...]  # the first installed one ships it
    kind: str


FLAVOURS = {f.package: f for f in (
    Flavour("lightning.pytorch", ("lightning",), TRAINER),
    Flavour("pytorch_lightning", ("pytorch-lightning",), TRAINER),
    Flavour("lightning.fabric", ("lightning",), FABRIC),
    # the standalone namespace ships in its own distribution and inside pytorch-lightning's
    Flavour("lightning_fabric", ("lightning-fabric", "pytorch-lightning"), FABRIC),
)}


def release(version: str) -> Tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _installed(flavour: Flavour) -> Optional[str]:
    for distribution in flavour.distributions:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def mode_of(version: str) -> Optional[str]:
    """What the shim is to do with a Lightning release: PATCH (2.0.x), NATIVE_MODE (2.1 and newer), or None."""
    return {(2, 0): PATCH}.get(release(version), NATIVE_MODE if release(version) >= (2, 1) else None)


# Read from torch itself, never from the package under test: a fault there must fail tests, not skip them.
TORCH = release(metadata.version("torch"))
# torch 2.2 alone gathers the optimizer state of a use_orig_params=True module (full or sharded) through torch.cuda
# calls, which fail on the CPU: the tests that need that state, and the rank programs' dumps of it, leave it out there.
ORIG_PARAMS_OPTIMIZER_STATE_ON_CPU = TORCH != (2, 2)


def optimizer_state_on_cpu(use_orig_params) -> bool:
    """Whether this torch gathers the optimizer state of CPU FSDP ranks made with ``use_orig_params``."""
    return ORIG_PARAMS_OPTIMIZER_STATE_ON_CPU or not use_orig_params


INSTALLED = {p: v for p, v in ((p, _installed(f)) for p, f in FLAVOURS.items()) if v}
PATCHABLE = [p for p, v in INSTALLED.items() if mode_of(v) == PATCH]
# The Trainer's flavours (lightning.pytorch, pytorch_lightning), for the tests of the Trainer's strategy
TRAINERS = [p for p in INSTALLED if FLAVOURS[p].kind == TRAINER]
PATCHABLE_TRAINERS = [p for p in PATCHABLE if p in TRAINERS]
PATCHABLE_FABRICS = [p for p in PATCHABLE if FLAVOURS[p].kind == FABRIC]


class UnderTest(NamedTuple):
    """One installed flavour, as the rank programs run it."""

    package: str  # "lightning.pytorch", "pytorch_lightning", "lightning.fabric" or "lightning_fabric"
    version: str
    mode: str  # what the shim does with this release: PATCH or NATIVE_MODE

    @property
    def native(self) -> bool:
        return self.mode == NATIVE_MODE

    def module(self, name: str = "") -> ModuleType:
        """The package, or its submodule ``name`` (``"strategies"``), imported."""
        return importlib.import_module(f"{self.package}.{name}" if name else self.package)


def under_test(kind: str) -> Optional[UnderTest]:
    """The flavour of ``kind`` (``TRAINER`` or ``FABRIC``) under test; None if none is installed."""
    package = next((p for p, f in FLAVOURS.items() if f.kind == kind and p in INSTALLED), None)
    if package is None:
        return None
    return UnderTest(package, INSTALLED[package], mode_of(INSTALLED[package]))


TRAINER_UNDER_TEST = under_test(TRAINER)
FABRIC_UNDER_TEST = under_test(FABRIC)
# The Trainer's, which most multi-rank tests run (every environment of the matrix installs one)
PACKAGE, VERSION, MODE = TRAINER_UNDER_TEST
NATIVE = TRAINER_UNDER_TEST.native


def strategy_class(package: str):
    """The Trainer's or Fabric's ``FSDPStrategy`` of ``package``."""
    return importlib.import_module(f"{package}.strategies.fsdp").FSDPStrategy
