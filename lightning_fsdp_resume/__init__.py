"""Sharded FSDP checkpoints and resume for Lightning 2.0.x, as Lightning 2.1 does them (2.1+ is left untouched).
Importing it patches the Trainer's and Fabric's FSDP checkpointing, now or when Lightning is imported, importing neither
torch nor Lightning; ``LIGHTNING_FSDP_RESUME_DISABLE=1`` skips that. ``patch()``, ``unpatch()``, ``status()``:
docs/compatibility.md.
"""
import os
import sys
from typing import Dict, NamedTuple, Optional, Set, Tuple

from ._patching._patcher import NotOutermostError, Patcher
from ._patching._patches import PatchTable, tables_for
from ._patching._versions import FLAVOURS, NATIVE, PATCH, Flavour, decide, installed_version

__all__ = ["patch", "unpatch", "status", "wait_for_saves", "set_mid_epoch_resume", "FlavourStatus", "DISABLE_ENV", "RankStates", "BackgroundSaveError",
           "add_safe_globals", "UnsafeCheckpointError", "ShardedEMA", "consolidate"]
__version__ = "0.1.0"

DISABLE_ENV = "LIGHTNING_FSDP_RESUME_DISABLE"

_patcher = Patcher()
_wanted = False  # patch() was called more recently than unpatch()
_hooks_registered = False
_refusals_said: Set[str] = set()


class FlavourStatus(NamedTuple):
    """What the shim did with one Lightning flavour.

    ``mode`` is one of: ``"patched"`` (every class and module the flavour has patched: ``FSDPStrategy``,
    ``Fabric`` for Fabric's, and the modules that read full checkpoints), ``"native"``, ``"unsupported"``,
    ``"not installed"``, ``"pending"`` (will be patched when imported), ``"partly patched"``
    (``patched_classes`` says which) or ``"unpatched"`` (patchable, but patching is off). ``patched_classes``
    names classes by name and modules by their path below the flavour's package (``"core.saving"``).
    """

    package: str
    version: Optional[str]
    mode: str
    reason: str
    patched_classes: Tuple[str, ...] = ()


def patch() -> None:
    """Patch every installed Lightning 2.0.x flavour, now if imported, else when it is imported. Idempotent."""
    global _wanted, _hooks_registered
    _wanted = True
    if not _hooks_registered:
        import wrapt

        for flavour in FLAVOURS:
            for table in tables_for(flavour.kind):
                # Runs at once if the module is already imported, else right after its import.
                wrapt.register_post_import_hook(_hook_for(flavour, table), table.module_in(flavour.package))
        _hooks_registered = True
        return
    for flavour in FLAVOURS:
        for table in tables_for(flavour.kind):
            module = sys.modules.get(table.module_in(flavour.package))
            if module is not None:
                _patch_module(flavour, table, module)


def unpatch() -> None:
    """Restore every patched class exactly and stop patching on later imports. Idempotent.

    A class on which another library has since replaced one of the patched attributes stays patched, with a
    warning naming it: restoring it would remove that library's change too."""
    global _wanted
    _wanted = False
    for cls in _patcher.patched_classes():
        try:
            _patcher.revert(cls)
        except NotOutermostError as refused:
            import warnings

            warnings.warn(f"lightning_fsdp_resume.unpatch(): {refused}", RuntimeWarning, stacklevel=2)


def status() -> Dict[str, FlavourStatus]:
    """Per flavour (``"lightning.pytorch"``, ``"pytorch_lightning"``, ``"lightning.fabric"``, ``"lightning_fabric"``):
    patched, native, unsupported, and why."""
    return {flavour.package: _status_of(flavour) for flavour in FLAVOURS}


def _status_of(flavour: Flavour) -> FlavourStatus:
    version = installed_version(flavour)
    if version is None:
        return FlavourStatus(flavour.package, None, "not installed", f"{flavour.distribution} is not installed")
    decision, reason = decide(version)
    if decision != PATCH:
        return FlavourStatus(flavour.package, version, decision, reason)
    tables = {table.name: table for table in tables_for(flavour.kind)}
    modules = {name: table.module_in(flavour.package) for name, table in tables.items()}
    classes = {
        name: tables[name].target_in(sys.modules[module]) if module in sys.modules else None
        for name, module in modules.items()
    }
    patched = tuple(name for name, cls in classes.items() if cls is not None and _patcher.is_patched(cls))
    waiting = [modules[name] for name, cls in classes.items() if cls is None]
    if len(patched) == len(classes):
        return FlavourStatus(flavour.package, version, "patched", reason, patched)
    if _wanted and len(patched) + len(waiting) == len(classes):
        when = f"{reason} when {' and '.join(waiting)} {'is' if len(waiting) == 1 else 'are'} imported"
        return FlavourStatus(flavour.package, version, "pending", when, patched)
    if patched:
        rest = ", ".join(name for name in classes if name not in patched)
        why = (
            f"{', '.join(patched)} patched, {rest} not: unpatch() leaves a class patched when another library has"
            " since replaced one of its patched attributes (see its warning)"
        )
        return FlavourStatus(flavour.package, version, "partly patched", why, patched)
    why = f"patching is off (unpatch() was called, or {DISABLE_ENV} is set)"
    return FlavourStatus(flavour.package, version, "unpatched", why)


def wait_for_saves(obj) -> None:
    """Wait for this rank's checkpoint save in the background, if one runs, and raise its failure (as every rank
    does). ``obj``: a ``Fabric`` or a ``Trainer``, or their strategy.

    Saves run in the background with Fabric's ``FSDPStrategy(async_save=True)`` and the Trainer's
    ``AsyncCheckpointIO``. The next save and every load wait by themselves, as the end of the Trainer's ``fit``
    does; a Fabric script calls this where it needs the checkpoint in place: before it ends, or before it
    destroys the process group. Every rank raises the same failure.
    """
    from ._save_load._background import wait

    wait(getattr(obj, "strategy", obj))


def set_mid_epoch_resume(mode: str = "skip", *, other_rank_counts: str = "exact") -> None:
    """How a Trainer run resumed inside an epoch finds its place in the data (Lightning 2.0.x; every strategy).

    ``"skip"`` (the default): leave out the batches already trained on by their indices, loading none of them, where
    the train dataloader is one torch ``DataLoader`` over a map-style dataset; a loader with ``state_dict`` /
    ``load_state_dict`` is restored from its saved state; anything else is ``"replay"``'d, with a log line.
    ``"replay"``: load the trained batches again and drop them (exact where workers draw random numbers too).
    ``"lightning"``: Lightning 2.0.x's own resume (one step more, the epoch's data from its first batch).

    On another number of ranks, one ``DataLoader`` over a map-style dataset drawn by a ``DistributedSampler`` goes on
    with exactly the samples not yet trained in the epoch; any other train data is refused there, unless
    ``other_rank_counts="approximate"``: each rank then leaves out as many batches as it would have trained first.
    """
    from ._run_state._data_position import set_mode

    set_mode(mode, other_rank_counts)


def __getattr__(name: str):
    """``RankStates`` (Fabric: each rank's RNG states and buffers in a checkpoint), ``BackgroundSaveError`` (what
    ``wait_for_saves`` raises), ``UnsafeCheckpointError`` (a checkpoint refused for what its pickles name) and
    ``add_safe_globals`` (admit a type in them: torch's own on torch 2.4+), ``ShardedEMA`` (an average of the weights
    on the shards: imports Lightning), ``consolidate`` (a sharded checkpoint into one full file), imported on first
    use."""
    if name in ("UnsafeCheckpointError", "add_safe_globals"):
        from ._checkpoint import _unpickling

        return getattr(_unpickling, name)
    if name == "BackgroundSaveError":
        from ._save_load._background import BackgroundSaveError

        return BackgroundSaveError
    if name == "ShardedEMA":
        from .ema import ShardedEMA

        return ShardedEMA
    if name == "consolidate":
        from ._commands._consolidate import consolidate

        return consolidate
    if name == "RankStates":
        from ._run_state._rank_states import RankStates

        return RankStates
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _hook_for(flavour: Flavour, table: PatchTable):
    def hook(module) -> None:
        if _wanted:
            _patch_module(flavour, table, module)

    return hook


def _patch_module(flavour: Flavour, table: PatchTable, module) -> None:
    version = installed_version(flavour)
    decision, reason = decide(version) if version else (None, "version unknown")
    if decision == PATCH:
        _patcher.apply(table.target_in(module), table.rows)
    elif decision != NATIVE and flavour.package not in _refusals_said:
        _refusals_said.add(flavour.package)
        import logging  # only when refusing: logging costs more to import than the shim

        logging.getLogger(__name__).warning("lightning_fsdp_resume: not patching %s: %s.", flavour.package, reason)


if os.environ.get(DISABLE_ENV, "").strip().lower() in ("", "0", "false", "no"):
    patch()
