"""Version facts: which Lightning flavours exist, what is installed, what the shim does with each (patched:
``FIRST_PATCHED`` to ``FIRST_NATIVE``). Versions come from an imported module or the distribution's metadata, importing
neither torch nor Lightning; only ``import_installed_flavours`` imports the flavours, when called.
"""
import importlib.util
import re
import sys
from typing import NamedTuple, Optional, Tuple

TRAINER, FABRIC = "trainer", "fabric"


class Flavour(NamedTuple):
    """One importable Lightning package whose FSDP checkpointing the shim patches: the Trainer's
    (``FSDPStrategy``) or Fabric's (``FSDPStrategy`` and ``Fabric``). What is patched in it, ``_patches`` says
    by ``kind``."""

    package: str  # the import name whose ``strategies.fsdp`` holds FSDPStrategy
    distribution: str  # the name pip knows it by
    kind: str = TRAINER  # TRAINER or FABRIC
    also_in: Tuple[str, ...] = ()  # other distributions that ship the package


FLAVOURS = (
    Flavour(package="lightning.pytorch", distribution="lightning"),
    Flavour(package="pytorch_lightning", distribution="pytorch-lightning"),
    Flavour(package="lightning.fabric", distribution="lightning", kind=FABRIC),
    # the standalone namespace ships in its own distribution and inside pytorch-lightning's
    Flavour(package="lightning_fabric", distribution="lightning-fabric", kind=FABRIC, also_in=("pytorch-lightning",)),
)

# The support range, declared once: releases in [FIRST_PATCHED, FIRST_NATIVE) get the patch.
FIRST_PATCHED = (2, 0)
FIRST_NATIVE = (2, 1)

PATCH, NATIVE, UNSUPPORTED = "patch", "native", "unsupported"


def parse_release(version: str) -> Tuple[int, ...]:
    """``"2.0.9"`` -> ``(2, 0, 9)``; pre-release and local suffixes are ignored (``"2.1.0rc1"`` -> ``(2, 1, 0)``)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"Cannot read a release number from the version string {version!r}.")
    return tuple(int(part) for part in match.groups(default="0"))


def decide(version: str) -> Tuple[str, str]:
    """What the shim does with a Lightning release: ``(PATCH | NATIVE | UNSUPPORTED, reason)``."""
    release = parse_release(version)[:2]
    if release < FIRST_PATCHED:
        return UNSUPPORTED, (
            f"Lightning {version} predates the 2.0 FSDPStrategy that this shim patches; "
            "use Lightning 2.0.x (patched) or 2.1 and newer (native)"
        )
    if release >= FIRST_NATIVE:
        return NATIVE, f"Lightning {version} saves and loads sharded FSDP checkpoints natively; nothing to patch"
    return PATCH, f"Lightning {version} lacks sharded FSDP checkpoints; the shim adds them"


def installed_version(flavour: Flavour) -> Optional[str]:
    """The flavour's version, or None when it is not installed. Does not import it."""
    module = sys.modules.get(flavour.package)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    top = flavour.package.partition(".")[0]
    try:
        if importlib.util.find_spec(top) is None:
            return None
    except (ImportError, ValueError):
        return None
    from importlib import metadata  # here, not at import: it costs tens of milliseconds

    for distribution in (flavour.distribution, *flavour.also_in):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def import_installed_flavours() -> None:
    """Import every installed flavour (so the shim's hooks run); a flavour that fails to import is skipped."""
    import importlib

    for flavour in FLAVOURS:
        try:
            importlib.import_module(flavour.package)
        except ImportError:
            pass
