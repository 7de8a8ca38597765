"""What a rank program writes for the tests to compare, shared by the Trainer worker (trainer_worker.py) and
the Fabric worker (fabric_worker.py): each rank's local shards and raw optimizer state, and the full
weights and optimizer state gathered by torch itself (never by the shim). states.py reads them back.
"""
import json
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch


def local_state(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Dict[str, Any]:
    """This rank's parameters (FSDP's flat shards) and buffers by the names ``model`` gives them, and each
    optimizer's raw ``state_dict()``."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "optim": [o.state_dict() for o in optimizers],
    }


def full_weights(fsdp_model: torch.nn.Module, module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """``module``'s whole weights (a module inside ``fsdp_model``, or the FSDP module itself), gathered with
    torch's ``summon_full_params``, by the names of the module as its author wrote it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(fsdp_model, writeback=False):
        return {clean(n): p.detach().clone() for n, p in module.named_parameters()}


def full_optimizer_state(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """An optimizer's whole state keyed by parameter name, gathered by torch itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    state = FSDP.optim_state_dict(fsdp_model, optimizer)  # FSDP's default: full, on every rank
    return {clean(name): v for name, v in state["state"].items()}


def clean(name: str) -> str:
    """A parameter name as the model's author has it, without FSDP's or Lightning 2.0.x's wrappers."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_forward_module.", "")


def write(out: Path, name: str, rank: int, local: Dict[str, Any], info: Dict[str, Any],
          full: Optional[Dict[str, Any]] = None) -> None:
    """``{name}_rank{rank}.pt`` (``local``), ``info_{name}_rank{rank}.json`` and, from rank 0, ``full_{name}.pt``."""
    torch.save(local, out / f"{name}_rank{rank}.pt")
    if rank == 0 and full is not None:
        torch.save(full, out / f"full_{name}.pt")
    (out / f"info_{name}_rank{rank}.json").write_text(json.dumps(info))
