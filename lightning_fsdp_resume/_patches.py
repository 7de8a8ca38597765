"""The one table of what the shim puts on ``FSDPStrategy``.

It applies to Lightning releases in [``_versions.FIRST_PATCHED``, ``_versions.FIRST_NATIVE``), i.e.
2.0.x, of both flavours (``lightning.pytorch`` and ``pytorch_lightning``). Lightning 2.1 and newer
define every one of these itself.
"""
from . import _strategy
from ._patcher import Wrap

FSDP_STRATEGY_PATCHES = {
    # accepts state_dict_type="full" | "sharded" instead of handing it to FSDP
    "__init__": Wrap(_strategy.wrap_init),
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
}
