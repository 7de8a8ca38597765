"""The tables of what the shim puts on each patched class or module of Lightning 2.0.x, every flavour: both
``FSDPStrategy``s, ``Fabric``, the entry points that load, the full-file readers, ``ModelCheckpoint``, the training
epoch loop, the checkpoint connector; and the one patch put on for a call only (``CallPatch``). Each table names its
target; its rows are built only when a flavour is patched (docs/behaviour.md).
"""
import contextlib
import functools
from typing import Any, Callable, Iterator, List, Mapping, Optional, Tuple

from ._held import LoopHeld, ModuleHeld, StrategyHeld
from ._patcher import Patcher, Wrap
from ._versions import FABRIC, TRAINER

Rows = Mapping[str, Any]  # attribute -> replacement, or a Wrap built from the attribute it replaces


class PatchTable:
    """What the shim puts on one class (or module) of every 2.0.x flavour of one kind."""

    def __init__(self, kind: str, module: str, cls: Optional[str], build: Callable[[], Rows], held: Optional[type] = None) -> None:
        self.kind = kind  # TRAINER or FABRIC: the flavours it applies to
        self.module = module  # below the flavour's package, e.g. "strategies.fsdp"
        self.cls = cls  # e.g. "FSDPStrategy"; None: the module itself, whose functions are patched where it binds them
        self._build = build
        self._rows: Optional[Rows] = None
        self.held = held  # what its patched methods keep on an instance: a dataclass of ``_held``; None: nothing

    @property
    def name(self) -> str:
        """How ``status()`` names it: the class, or the module's path below the flavour's package."""
        return self.cls or self.module

    def module_in(self, package: str) -> str:
        """The module's import name in the flavour ``package``, e.g. ``"lightning.pytorch.strategies.fsdp"``."""
        return f"{package}.{self.module}"

    def target_in(self, module: Any) -> Any:
        """The patched object, given the imported module; None when the module lacks the class."""
        return getattr(module, self.cls, None) if self.cls else module

    @property
    def rows(self) -> Rows:
        """Built once, so a replacement that is not a ``Wrap`` (a property, say) is the same object on every flavour."""
        if self._rows is None:
            self._rows = self._build()
        return self._rows

    def __repr__(self) -> str:
        return f"PatchTable({self.kind}: {self.module}{'.' + self.cls if self.cls else ''})"


TABLES: List[PatchTable] = []  # every table below, in the order status() names them


class CallPatch:
    """Rows put on an object only while one call runs, where the object is known only then (the user's class), and
    taken off exactly as the call returns, however it ends."""

    def __init__(self, target: str, build: Callable[[], Rows]) -> None:
        self.target = target  # what it is put on, in words
        self._build = build

    @contextlib.contextmanager
    def applied(self, target: Any) -> Iterator[None]:
        patcher = Patcher()
        patcher.apply(target, self._build())
        try:
            yield
        finally:
            patcher.revert(target)


def patches(kind: str, module: str, cls: Optional[str] = None, held: Optional[type] = None) -> Callable[[Callable[[], Rows]], PatchTable]:
    """Declares the function below, which builds the rows, as the table of ``module``'s ``cls`` (or of ``module``
    itself) in each flavour of ``kind``, and what its methods keep on an instance of ``cls`` (``held``)."""

    def declare(build: Callable[[], Rows]) -> PatchTable:
        TABLES.append(PatchTable(kind, module, cls, build, held))
        return TABLES[-1]

    return declare


def tables_for(kind: str) -> Tuple[PatchTable, ...]:
    """The tables of every flavour of ``kind`` (``_versions.TRAINER`` or ``_versions.FABRIC``)."""
    return tuple(table for table in TABLES if table.kind == kind)


@patches(TRAINER, "strategies.fsdp", "FSDPStrategy", held=StrategyHeld)
def FSDP_STRATEGY_PATCHES() -> Rows:
    from .._lightning import _strategy

    return {
        # accepts state_dict_type="full" (default) | "sharded" instead of handing it to FSDP
        "__init__": Wrap(_strategy.wrap_init),
        # wrap a LightningModule once: fit, then validate/test/predict or fit again in the same processes
        "_setup_model": Wrap(_strategy.wrap_setup_model),
        # optimizers are created for fit only, so a save after validate/test/predict keeps the trained ones
        "setup_optimizers": Wrap(_strategy.wrap_setup_optimizers),
        # restore after the model is wrapped and sharded; optimizers are restored by load_checkpoint
        "restore_checkpoint_after_setup": property(_strategy.restore_checkpoint_after_setup),
        "lightning_restore_optimizer": property(_strategy.lightning_restore_optimizer),
        # save: full (gathered on rank 0) or sharded (each rank's shards)
        "lightning_module_state_dict": _strategy.lightning_module_state_dict,
        "optimizer_state": _strategy.optimizer_state,
        "save_checkpoint": _strategy.save_checkpoint,
        # load: everything happens in load_checkpoint, the two per-part loaders become no-ops
        "load_checkpoint": _strategy.load_checkpoint,
        "load_model_state_dict": _strategy.load_model_state_dict,
        "load_optimizer_state_dict": _strategy.load_optimizer_state_dict,
        # save_top_k at a URL: a sharded checkpoint's pointer, then its data
        "remove_checkpoint": Wrap(_strategy.wrap_remove_checkpoint),
        # the checkpoint entries' last part of a resume as training starts (each rank's random states)
        "on_train_start": Wrap(_strategy.wrap_on_train_start),
        # AsyncCheckpointIO: the end of fit waits for the save in the background and raises its failure
        "teardown": Wrap(_strategy.wrap_teardown),
        # after the first step of a fit that saves in the background: its host buffers made off the training thread
        "optimizer_step": Wrap(_strategy.wrap_optimizer_step),
    }


@patches(FABRIC, "strategies.fsdp", "FSDPStrategy", held=StrategyHeld)
def FABRIC_FSDP_STRATEGY_PATCHES() -> Rows:
    from .._lightning import _fabric

    return {
        # accepts state_dict_type="sharded" (default) | "full" instead of handing it to FSDP
        "__init__": Wrap(_fabric.wrap_init),
        # 2.0.x inherits the base strategy's: full model gathered on every rank, rank 0's optimizer shard only
        "save_checkpoint": _fabric.save_checkpoint,
        "load_checkpoint": _fabric.load_checkpoint,
        # 2.0.x accepts a CheckpointIO plugin and ignores it; refused when set, as native
        "checkpoint_io": Wrap(_fabric.refuse_checkpoint_io),
        # after an optimizer's first step, where saves are written in the background: their host buffers, in a thread
        "optimizer_step": Wrap(_fabric.wrap_optimizer_step),
    }


@patches(FABRIC, "fabric", "Fabric")
def FABRIC_PATCHES() -> Rows:
    from .._lightning import _fabric

    return {
        # the new arguments (filter=, strict=) reach a strategy that takes them; wrappers are taken off first
        "save": Wrap(_fabric.wrap_save),
        "load": Wrap(_fabric.wrap_load),
        # new in 2.1: a module's own state dict from one file
        "load_raw": _fabric.load_raw,
    }


# Lightning's one reader of full checkpoint files reads a sharded directory too (load_from_checkpoint, a
# single-device or DDP ckpt_path, Fabric without FSDP): where it is defined and where modules bind it by name.
@patches(FABRIC, "utilities.cloud_io")
def CHECKPOINT_READER_PATCHES() -> Rows:
    from .._lightning import _lightning_reads

    return {"_load": Wrap(_lightning_reads.wrap_load)}


@patches(FABRIC, "plugins.io.torch_io")
def CHECKPOINT_READER_ALIAS_PATCHES() -> Rows:
    from .._lightning import _lightning_reads

    return {"pl_load": Wrap(_lightning_reads.wrap_load)}


def _configure_first_rows() -> Rows:
    from .._lightning import _lightning_reads

    return {"on_load_checkpoint": Wrap(_lightning_reads.configure_first)}


# While load_from_checkpoint builds a LightningModule that builds layers in configure_sharded_model (inside
# core.saving._load_state, below): that hook runs first thing in on_load_checkpoint, before the weights load
CONFIGURE_FIRST = CallPatch("the LightningModule class load_from_checkpoint builds", _configure_first_rows)


@patches(TRAINER, "core.saving")
def LOAD_FROM_CHECKPOINT_PATCHES() -> Rows:
    from .._lightning import _lightning_reads

    return {
        **CHECKPOINT_READER_ALIAS_PATCHES.rows,
        # layers built in configure_sharded_model exist before the weights load (CONFIGURE_FIRST, for that call)
        "_load_state": Wrap(functools.partial(_lightning_reads.wrap_load_state, configure_first=CONFIGURE_FIRST.applied)),
    }


# Lightning 2.6's weights_only on each call that may load a checkpoint: the loads inside it take it.
@patches(TRAINER, "trainer.trainer", "Trainer")
def TRAINER_PATCHES() -> Rows:
    from .._lightning import _strategy

    return {name: Wrap(_strategy.wrap_entry) for name in ("fit", "validate", "test", "predict")}


@patches(TRAINER, "core.module", "LightningModule", held=ModuleHeld)
def MODULE_PATCHES() -> Rows:
    from .._lightning import _strategy

    return {"load_from_checkpoint": Wrap(_strategy.wrap_load_from_checkpoint)}


@patches(TRAINER, "core.datamodule", "LightningDataModule")
def DATAMODULE_PATCHES() -> Rows:
    return MODULE_PATCHES.rows


@patches(TRAINER, "callbacks.model_checkpoint", "ModelCheckpoint")
def MODEL_CHECKPOINT_PATCHES() -> Rows:
    from .._lightning import _model_checkpoint

    # ckpt_path="last" finds the last checkpoint of a dirpath at a URL
    return {"_find_last_checkpoints": Wrap(_model_checkpoint.wrap_find_last_checkpoints)}


# A resume inside an epoch goes on from the batch after the checkpoint's, with any strategy (the loop is shared)
@patches(TRAINER, "loops.training_epoch_loop", "_TrainingEpochLoop", held=LoopHeld)
def EPOCH_LOOP_PATCHES() -> Rows:
    from .._run_state import _epoch_loop

    return {
        # the batch the checkpoint was taken after is done: not trained again, its end (validation) run
        "reset": Wrap(_epoch_loop.wrap_reset),
        "advance": Wrap(_epoch_loop.wrap_advance),
        # a checkpoint saved at the end of a validation inside the epoch: that validation is not run again
        "_should_check_val_fx": Wrap(_epoch_loop.wrap_should_check_val_fx),
        # one saved inside a validation: that validation runs again, and training goes on with the saved random states
        "on_advance_end": Wrap(_epoch_loop.wrap_on_advance_end),
        # the epoch's data iterator made from the epoch's random states, going on after the checkpoint's batch
        "on_run_start": Wrap(_epoch_loop.wrap_on_run_start),
        # a resume on another number of ranks changes the epoch's length for that epoch only
        "run": Wrap(_epoch_loop.wrap_run),
    }


# The states of the run a checkpoint carries under entries of their own (_participants.Entry), any strategy: every
# rank's random states and buffers (the package's FSDP strategy's), its data position and cursor; Lightning's loop
# state stays as Lightning writes it
@patches(TRAINER, "trainer.connectors.checkpoint_connector", "_CheckpointConnector")
def CHECKPOINT_CONNECTOR_PATCHES() -> Rows:
    from .._lightning import _connector
    from .._run_state import _epoch_loop, _rank_states  # noqa: F401  (the entries: each registers as it is imported)

    return {
        "dump_checkpoint": Wrap(_connector.wrap_dump_checkpoint),
        "resume_start": Wrap(_connector.wrap_resume_start),
    }
