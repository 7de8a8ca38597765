"""The workflows around ``fit`` that users run with FSDP checkpoints, and what each Lightning does with them.

One table serves the tests and the README: each workflow's test marks itself an expected failure
(``strict=True``) where this table says the Lightning under test fails it, so a cell that goes stale fails the
matrix; the README's table is rendered from it (``markdown``) and ``tests/test_docs.py`` checks that they agree.
Columns: stock Lightning 2.0.9 (the shim turned off), native 2.1.4, the newest native release the matrix
installs, and Lightning 2.0.x with the shim.
"""
from typing import Dict, NamedTuple, Optional

import pytest

from support.flavours import TRAINER_UNDER_TEST, release

STOCK, NATIVE_21, NATIVE_NEWEST, SHIM = "stock 2.0.9", "native 2.1.4", "newest native", "2.0.x + shim"
COLUMNS = (STOCK, NATIVE_21, NATIVE_NEWEST, SHIM)
PASS, FAIL = "passes", "fails"


# What stock 2.0.9 raises (measured on torch 2.4; on torch >= 2.6 it cannot read its own checkpoints at all)
_STOCK_REWRAPS = "`KeyError` (it wraps the model again)"
_STOCK_OPTIMIZER = "`ValueError` (the save holds rank 0's optimizer shard only)"


# How the rows' models were wrapped in FSDP: the same-process rows run with both (tests/test_workflows.py's CONFIGS)
BOTH_WRAPPINGS = "root unit alone, and a wrap policy"
WITHOUT_FSDP = "— (read without FSDP)"
IN_THE_HOOK = "units wrapped in the hook"


class Workflow(NamedTuple):
    what: str  # the README's row
    fails: Dict[str, Optional[str]]  # column -> why it fails there (missing: it passes; None: does not apply)
    wrapping: str = BOTH_WRAPPINGS  # how FSDP wrapped the model where the row runs


WORKFLOWS = {
    "test_best": Workflow(
        '`fit`, then `test(ckpt_path="best")` in the same processes',
        {STOCK: _STOCK_REWRAPS, NATIVE_21: "wraps the model again", NATIVE_NEWEST: "wraps the model again"},
    ),
    "evaluate_path": Workflow(
        "`fit`, then `validate(ckpt_path=<a checkpoint>)`",
        {STOCK: _STOCK_REWRAPS, NATIVE_21: "wraps the model again", NATIVE_NEWEST: "wraps the model again"},
    ),
    "evaluate_last": Workflow(
        '`fit`, then `predict(ckpt_path="last")`',
        {STOCK: _STOCK_REWRAPS, NATIVE_21: "wraps the model again", NATIVE_NEWEST: "wraps the model again"},
    ),
    "evaluate_none": Workflow(
        "`fit`, then `test(ckpt_path=None)` (the weights in memory)",
        {STOCK: _STOCK_REWRAPS, NATIVE_21: "wraps the model again", NATIVE_NEWEST: "wraps the model again"},
    ),
    "save_after_test": Workflow(
        "`save_checkpoint` after `test`, resumed exactly in new processes",
        {STOCK: _STOCK_REWRAPS, NATIVE_21: "wraps the model again", NATIVE_NEWEST: "wraps the model again"},
    ),
    "fit_again_same_trainer": Workflow(
        '`fit`, then `fit(ckpt_path="last")` with more epochs, same Trainer',
        {STOCK: _STOCK_OPTIMIZER, NATIVE_21: "wraps the model again", NATIVE_NEWEST: "wraps the model again"},
    ),
    "fit_again_new_trainer": Workflow(
        '`fit`, then `fit(ckpt_path="last")` with more epochs, a new Trainer',
        {STOCK: _STOCK_OPTIMIZER, NATIVE_21: "wraps the model again", NATIVE_NEWEST: "wraps the model again"},
    ),
    "load_from_checkpoint": Workflow(
        "`LightningModule.load_from_checkpoint(<sharded directory>)`, no process group",
        {STOCK: None, NATIVE_21: "reads files only", NATIVE_NEWEST: "reads files only"},
        WITHOUT_FSDP,
    ),
    "single_device_ckpt_path": Workflow(
        "`Trainer(devices=1).predict(model, ckpt_path=<sharded directory>)`",
        {STOCK: None, NATIVE_21: "reads files only", NATIVE_NEWEST: "reads files only"},
        WITHOUT_FSDP,
    ),
    "ddp_ckpt_path": Workflow(
        '`Trainer(strategy="ddp").fit(model, ckpt_path=<sharded directory>)`, exact resume',
        {STOCK: None, NATIVE_21: "reads files only", NATIVE_NEWEST: "reads files only"},
        WITHOUT_FSDP,
    ),
    "fabric_without_fsdp": Workflow(
        "Fabric without FSDP: `load` of a sharded directory (model, optimizer, the rest)",
        {STOCK: None, NATIVE_21: "reads files only", NATIVE_NEWEST: "reads files only"},
        WITHOUT_FSDP,
    ),
    "configure_sharded_model_full": Workflow(
        "`load_from_checkpoint(<full file>)` of a model that builds layers in `configure_sharded_model`",
        {STOCK: "loads before the hook builds them", NATIVE_21: "loads before the hook builds them"},
        IN_THE_HOOK,
    ),
    "configure_sharded_model_sharded": Workflow(
        "`load_from_checkpoint(<sharded directory>)` of a model that builds layers in `configure_sharded_model`",
        {STOCK: None, NATIVE_21: "loads before the hook builds them", NATIVE_NEWEST: "reads files only"},
        IN_THE_HOOK,
    ),
}


def column(stock: bool = False) -> Optional[str]:
    """The column the Lightning under test fills: ``stock`` for a run with the shim turned off."""
    if TRAINER_UNDER_TEST is None:
        return None
    if not TRAINER_UNDER_TEST.native:
        return STOCK if stock else SHIM
    return NATIVE_21 if release(TRAINER_UNDER_TEST.version) == (2, 1) else NATIVE_NEWEST


def expected(workflow: str, stock: bool = False):
    """The mark for ``workflow``'s test here: an expected failure (strict) where the table says it fails."""
    why = WORKFLOWS[workflow].fails.get(column(stock) or "")
    if why is None:  # passes, or (stock, sharded checkpoints) not tested
        return []
    return [pytest.mark.xfail(strict=True, reason=f"{column(stock)}: {why}")]


def _cell(workflow: Workflow, column: str) -> str:
    if column not in workflow.fails:
        return PASS
    why = workflow.fails[column]
    return "— (no sharded checkpoints)" if why is None else f"{FAIL}: {why}"


def markdown() -> str:
    """The README's table."""
    lines = ["| workflow | FSDP wrapping | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for workflow in WORKFLOWS.values():
        cells = [_cell(workflow, c) for c in COLUMNS]
        lines.append(f"| {workflow.what} | {workflow.wrapping} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
