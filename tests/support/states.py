"""What a rank records, and how the tests read it back and compare it.

The rank programs (trainer_worker.py, fabric_worker.py) write each rank's local shards and raw optimizer
state, and the full weights and optimizer state gathered by torch itself (never by the shim); the tests
load them and compare exactly: ``torch.equal``, no tolerance.
"""
import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

# --- what a rank program writes ---------------------------------------------------------------------------


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


# --- what the tests read back and compare -------------------------------------------------------------------


def load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def differences(expected: Any, actual: Any, where: str = "") -> List[str]:
    """Every place where two nested structures of tensors and plain values differ (empty when identical)."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        same = (
            isinstance(expected, torch.Tensor)
            and isinstance(actual, torch.Tensor)
            and expected.dtype == actual.dtype
            and expected.shape == actual.shape
            and torch.equal(expected, actual)
        )
        return [] if same else [f"{where}: {expected!r} != {actual!r}"]
    if isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) != set(actual):
            return [f"{where}: keys {sorted(map(str, expected))} != {sorted(map(str, actual))}"]
        return [d for key in expected for d in differences(expected[key], actual[key], f"{where}.{key}")]
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if len(expected) != len(actual):
            return [f"{where}: length {len(expected)} != {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]")]
    return [] if expected == actual else [f"{where}: {expected!r} != {actual!r}"]


# What a failed comparison says (assert_identical), for expected failures that must be one
DIFFER = r" differ in \d+ places, first: "


def assert_identical(expected: Any, actual: Any, what: str) -> None:
    found = differences(expected, actual)
    assert not found, f"{what} differ in {len(found)} places, first: {found[:3]}"


def without_lightning_wrapper(dump: dict) -> dict:
    """A rank's dump with Lightning 2.0.x's wrapper left out of parameter names (2.1+ has none), so
    shards recorded under the two compare by name."""
    return {**dump, **{kind: {name.replace("_forward_module.", ""): t for name, t in dump.get(kind, {}).items()}
                       for kind in ("params", "buffers")}}


def assert_ranks_identical(
    expected_dir: Path, expected_name: str, actual_dir: Path, actual_name: str, ranks: int = 2, across_flavours: bool = False,
    parts: Optional[Sequence[str]] = None,
) -> None:
    """Each rank's local parameter shards and raw optimizer state are bit-identical: the whole record, or only
    its ``parts`` (``"params"``, ``"buffers"``, ``"optim"``, and what else a worker records, e.g. ``"scheduler"``).

    ``across_flavours``: one side ran Lightning 2.0.x, the other 2.1+; parameter names are compared
    without 2.0.x's wrapper."""
    for rank in range(ranks):
        expected = load(expected_dir / f"{expected_name}_rank{rank}.pt")
        actual = load(actual_dir / f"{actual_name}_rank{rank}.pt")
        if across_flavours:
            expected, actual = without_lightning_wrapper(expected), without_lightning_wrapper(actual)
        assert expected["params"], "no parameters were recorded"
        assert any(o["state"] for o in expected["optim"]), "no optimizer state was recorded"
        if parts is not None:
            expected, actual = ({part: record[part] for part in parts if part in record} for record in (expected, actual))
        assert_identical(expected, actual, f"rank {rank}: {expected_name} vs {actual_name}")


def file_hashes(path: Path) -> Dict[str, str]:
    """Content hash of every file of a checkpoint (a directory or one file), by path below its parent."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p.relative_to(path.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def info(directory: Path, name: str, rank: int = 0) -> dict:
    return json.loads((directory / f"info_{name}_rank{rank}.json").read_text())


def build_with_fsdp() -> None:
    """This process's sharded saves build their state dicts with FSDP's builder, which gathers, instead of from each
    rank's flat shards: the two must write checkpoints that read back the same."""
    from lightning_fsdp_resume._save_load import _saving

    _saving._built = lambda from_shards, args, fsdps: fsdps()
