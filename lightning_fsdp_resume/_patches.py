"""The tables of what the shim puts on each patched class: the Trainer's ``FSDPStrategy``, Fabric's
``FSDPStrategy`` and ``Fabric``; and on the modules that read full checkpoint files.

They apply to Lightning releases in [``_versions.FIRST_PATCHED``, ``_versions.FIRST_NATIVE``), i.e. 2.0.x,
of every flavour (``lightning.pytorch``, ``pytorch_lightning``, ``lightning.fabric``, ``lightning_fabric``).
Lightning 2.1 and newer define every one of these itself.
"""
from typing import Any, Dict, Tuple

from . import _fabric, _model_checkpoint, _reader, _strategy
from ._patcher import Wrap
from ._versions import FABRIC, TRAINER

FSDP_STRATEGY_PATCHES = {
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
    # each rank's RNG states and buffers, restored as the resumed fit starts training
    "on_train_start": Wrap(_strategy.wrap_on_train_start),
    # AsyncCheckpointIO: the end of fit waits for the save in the background and raises its failure
    "teardown": Wrap(_strategy.wrap_teardown),
}

FABRIC_FSDP_STRATEGY_PATCHES = {
    # accepts state_dict_type="sharded" (default) | "full" instead of handing it to FSDP
    "__init__": Wrap(_fabric.wrap_init),
    # 2.0.x inherits the base strategy's: full model gathered on every rank, rank 0's optimizer shard only
    "save_checkpoint": _fabric.save_checkpoint,
    "load_checkpoint": _fabric.load_checkpoint,
    # 2.0.x accepts a CheckpointIO plugin and ignores it; refused when set, as native
    "checkpoint_io": Wrap(_fabric.refuse_checkpoint_io),
}

FABRIC_PATCHES = {
    # the new arguments (filter=, strict=) reach a strategy that takes them; wrappers are taken off first
    "save": Wrap(_fabric.wrap_save),
    "load": Wrap(_fabric.wrap_load),
    # new in 2.1: a module's own state dict from one file
    "load_raw": _fabric.load_raw,
}

# Lightning's one reader of full checkpoint files reads a sharded directory too (load_from_checkpoint, a
# single-device or DDP ckpt_path, Fabric without FSDP): where it is defined and where modules bind it by name.
CHECKPOINT_READER_PATCHES = {"_load": Wrap(_reader.wrap_load)}
CHECKPOINT_READER_ALIAS_PATCHES = {"pl_load": Wrap(_reader.wrap_load)}
LOAD_FROM_CHECKPOINT_PATCHES = {
    **CHECKPOINT_READER_ALIAS_PATCHES,
    # layers built in configure_sharded_model exist before the weights load
    "_load_state": Wrap(_reader.wrap_load_state),
}

# ckpt_path="last" finds the last checkpoint of a dirpath at a URL
MODEL_CHECKPOINT_PATCHES = {"_find_last_checkpoints": Wrap(_model_checkpoint.wrap_find_last_checkpoints)}

# (flavour kind, Target.label: the class name, or the module's path below the flavour's package) -> table
TABLES: Dict[Tuple[str, str], Dict[str, Any]] = {
    (TRAINER, "FSDPStrategy"): FSDP_STRATEGY_PATCHES,
    (FABRIC, "FSDPStrategy"): FABRIC_FSDP_STRATEGY_PATCHES,
    (FABRIC, "Fabric"): FABRIC_PATCHES,
    (FABRIC, "utilities.cloud_io"): CHECKPOINT_READER_PATCHES,
    (FABRIC, "plugins.io.torch_io"): CHECKPOINT_READER_ALIAS_PATCHES,
    (TRAINER, "core.saving"): LOAD_FROM_CHECKPOINT_PATCHES,
    (TRAINER, "ModelCheckpoint"): MODEL_CHECKPOINT_PATCHES,
}
