"""Run Lightning's ``FSDPStrategy`` on the CPU, for tests in CI without GPUs: ``enable_cpu_fsdp()`` lets the Trainer and
Fabric run FSDP with ``accelerator="cpu"`` (over gloo), in this process, until ``disable_cpu_fsdp()``; a plain import
never applies it. How to launch, and limits: "Testing FSDP checkpointing on the CPU" in docs/compatibility.md.
"""
import importlib
from typing import Any, Callable, Iterator, Tuple

from ._patching._patcher import Patcher, Wrap
from ._patching._versions import FABRIC, FLAVOURS

_patcher = Patcher()
# Where each connector refuses FSDP without a GPU, and the words of its refusal. Trainer 2.0.x: "... but GPU
# accelerator is not used", later: "requires a GPU accelerator"; Fabric 2.0.x to 2.6: "... FSDP is only
# available on GPU". Both keep the accelerator in ``_accelerator_flag``.
_TRAINER_GPU_ONLY = "GPU accelerator"
_FABRIC_GPU_ONLY = "FSDP is only available on GPU"
_SETTLE_S = 0.05  # leave_process_group's pause before destroying the group: 10 x what sufficed in 1,000 tries


def cpu_fsdp_supported() -> Tuple[bool, str]:
    """Whether this torch can run multi-rank FSDP on the CPU, and if not, why."""
    from ._patching import _torch_compat as compat

    if not compat.cpu_fsdp_supported():
        return False, f"torch {compat.release_text()} cannot run FSDP on CPU: gloo lacks _allgather_base before torch 2.2"
    return True, ""


def cpu_optimizer_state_supported(use_orig_params: bool) -> Tuple[bool, str]:
    """Whether this torch can produce an optimizer state dict (full or sharded) of CPU FSDP ranks; if not, why."""
    from ._patching import _torch_compat as compat

    if use_orig_params and not compat.cpu_orig_params_optimizer_state_supported():
        return False, (
            "torch 2.2 gathers optimizer state with use_orig_params=True through torch.cuda calls,"
            " which fail without a GPU"
        )
    return True, ""


def enable_cpu_fsdp() -> None:
    """Allow ``FSDPStrategy`` with ``accelerator="cpu"`` in the Trainer and in Fabric. Idempotent. Imports torch and
    installed Lightning."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.api import FullOptimStateDictConfig, FullStateDictConfig

    _patcher.apply(FullyShardedDataParallel, {"__init__": Wrap(_default_cpu_device_id)})
    # Native Lightning (2.1+) gathers full checkpoints with offload_to_cpu=True, which crashes torch
    # when the parameters already live on the CPU. FSDP checks the configs' exact type: patch, not subclass.
    for config in (FullStateDictConfig, FullOptimStateDictConfig):
        _patcher.apply(config, {"__init__": Wrap(_no_offload_on_cpu)})
    for module_name, connector, gpu_only_message in _gpu_only_checks():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        _patcher.apply(getattr(module, connector), {"_check_strategy_and_fallback": Wrap(_allow_cpu_fsdp(gpu_only_message))})


def _gpu_only_checks() -> Iterator[Tuple[str, str, str]]:
    """(module, connector class, words of its GPU-only refusal) of every flavour: the Trainer's and Fabric's."""
    for flavour in FLAVOURS:
        if flavour.kind == FABRIC:
            yield f"{flavour.package}.connector", "_Connector", _FABRIC_GPU_ONLY
        else:
            yield f"{flavour.package}.trainer.connectors.accelerator_connector", "_AcceleratorConnector", _TRAINER_GPU_ONLY


def disable_cpu_fsdp() -> None:
    for cls in _patcher.patched_classes():
        _patcher.revert(cls)


def leave_process_group() -> None:
    """End a rank program: wait for every rank, then destroy the process group.

    A rank that exits while gloo still talks to it can abort another ("terminate called without an
    active exception"), e.g. after ``trainer.predict``, which ends without a barrier. So can an FSDP
    module kept alive by reference cycles (after a Fabric loop) and freed only after the process group
    is gone: it is collected first.

    The group is destroyed after a pause that holds no lock: on torch 2.2 and 2.4 (not 2.13), a gloo
    worker thread that drops the last reference to a collective's tensors after the collective has
    returned waits for Python's lock to free them; a group destroyed at that moment waits for that
    thread while holding the lock, and the process hangs for ever (in one process, a collective then
    an immediate destroy hung within 1,500 tries, the barrier before it included; with a 5 ms pause, no
    hang in 1,000).
    """
    import gc
    import time

    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        time.sleep(_SETTLE_S)
        dist.destroy_process_group()


def _default_cpu_device_id(original_init: Callable) -> Callable:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        import torch

        if kwargs.get("device_id") is None and not torch.cuda.is_available():
            kwargs["device_id"] = torch.device("cpu")
        original_init(self, *args, **kwargs)

    return __init__


def _no_offload_on_cpu(original_init: Callable) -> Callable:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        import torch

        original_init(self, *args, **kwargs)
        if not torch.cuda.is_available():
            self.offload_to_cpu = False

    return __init__


def _allow_cpu_fsdp(gpu_only_message: str) -> Callable[[Callable], Callable]:
    """A wrapper of a connector's ``_check_strategy_and_fallback`` that lets FSDP pass with any accelerator:
    where the check refuses with ``gpu_only_message``, it runs again as if the accelerator were a GPU."""

    def wrap(original_check: Callable) -> Callable:
        def _check_strategy_and_fallback(self: Any) -> None:
            try:
                return original_check(self)
            except Exception as error:  # MisconfigurationException or ValueError, by release
                if gpu_only_message not in str(error):
                    raise
            accelerator = self._accelerator_flag
            self._accelerator_flag = "gpu"  # only for the duration of the check
            try:
                return original_check(self)
            finally:
                self._accelerator_flag = accelerator

        return _check_strategy_and_fallback

    return wrap
