"""Reading and comparing what the worker wrote. Comparisons are exact: ``torch.equal``, no tolerance."""
import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch


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
