"""The workflows around ``fit`` that users run with FSDP checkpoints, and what each Lightning does with them.

One table serves the tests and the documentation: each workflow's test is an expected failure (strict) where this
table says the Lightning under test fails it, and it must fail with one of the errors the table names there (a crashed
rank, a timeout or a harness error fails the test), so a cell that goes stale fails the matrix; the table in
docs/resuming.md is rendered from it (``markdown``) and ``tests/test_docs.py`` checks that they agree. Columns: stock
Lightning 2.0.9 (the shim turned off), native 2.1.4, the newest native release the matrix installs, and Lightning 2.0.x
with the shim.
"""
import re
from typing import Dict, NamedTuple, Optional, Tuple

import pytest

from support.flavours import TRAINER_UNDER_TEST, release
from support.marks import failing_as
from support.states import DIFFER

STOCK, NATIVE_21, NATIVE_NEWEST, SHIM = "stock 2.0.9", "native 2.1.4", "newest native", "2.0.x + shim"
COLUMNS = (STOCK, NATIVE_21, NATIVE_NEWEST, SHIM)
PASS, FAIL = "passes", "fails"


class Fails(NamedTuple):
    """How a Lightning fails a row: the table's words, and the errors its test must see there, each a pattern of the
    error's ``Type: message`` as a rank's step reports it, a rank's last traceback line reads or this process raises
    it; ``weights``: or a step runs, with other weights than the checkpoint's."""

    why: str
    errors: Tuple[str, ...] = ()
    weights: bool = False

    def accepts(self, error: BaseException) -> bool:
        alternatives = "|".join(f"(?:{pattern})" for pattern in self.errors) or "(?!)"
        text = str(error)
        if isinstance(error, AssertionError):  # a step's error (_step_ok), or the weights compared (assert_identical)
            return bool(re.search(rf"failed: (?:{alternatives})", text)
                        or self.weights and re.search(DIFFER, text))
        if isinstance(error, pytest.fail.Exception):  # ranks that exited: their output ends in their tracebacks
            return bool(re.search(rf"^\s*(?:[\w.]+\.)?(?:{alternatives})", text, flags=re.M))
        return bool(re.match(alternatives, f"{type(error).__name__}: {text}"))

    def cell(self) -> str:
        names = list(dict.fromkeys("`" + re.match(r"[A-Za-z]\w*", pattern)[0] + "`" for pattern in self.errors))
        return f"{FAIL}: {', '.join(names + ['other weights'] * self.weights)} ({self.why})"


# What each Lightning's ranks raise, measured: stock 2.0.9 on torch 2.4 (on torch >= 2.6 it cannot read its own
# checkpoints at all), native 2.1.4 on torch 2.4, the newest native on torch 2.13
_STOCK_REWRAPS = Fails("it wraps the model again", ("KeyError: Parameter containing",))
_STOCK_OPTIMIZER = Fails("its optimizer state does not fit: rank 0's shard only, or the model wrapped again", (
    "ValueError: loaded state dict contains a parameter group that doesn't match",
    "ValueError: The optimizer does not seem to reference any FSDP parameters",
))
_LOADS_INTO_A_REWRAPPED_MODEL = ("CheckpointException: ", r"RuntimeError: Error\(s\) in loading state_dict for ")
_REWRAPS = Fails("it wraps the model again", _LOADS_INTO_A_REWRAPPED_MODEL)
_REWRAPS_IN_MEMORY = Fails("it wraps the model again", ("RuntimeError: mat2 must be a matrix",
                                                        "AssertionError: Expected .* to be in fqn_to_fsdp_param_info"),
                           weights=True)
_REWRAPS_SAVE = Fails("it wraps the model again",
                      (*_LOADS_INTO_A_REWRAPPED_MODEL, "AssertionError: Expected .* to be in fqn_to_fsdp_param_info"))
_READS_FILES = Fails("it reads files only", ("IsADirectoryError: ",))
_HOOK_LATE = Fails("it loads before the hook builds them", (
    r"RuntimeError: Error\(s\) in loading state_dict for BuiltNet:\s+Unexpected key\(s\) in state_dict: \"late\.",))


# How the rows' models were wrapped in FSDP: the same-process rows run with both (tests/test_workflows.py's CONFIGS)
BOTH_WRAPPINGS = "root unit alone, and a wrap policy"
WITHOUT_FSDP = "— (read without FSDP)"
IN_THE_HOOK = "units wrapped in the hook"


class Workflow(NamedTuple):
    what: str  # the table's row
    fails: Dict[str, Optional[Fails]]  # column -> how it fails there (missing: it passes; None: does not apply)
    wrapping: str = BOTH_WRAPPINGS  # how FSDP wrapped the model where the row runs


_NATIVE_REWRAPS = {NATIVE_21: _REWRAPS, NATIVE_NEWEST: _REWRAPS}
_NO_SHARDED_IN_STOCK = {STOCK: None, NATIVE_21: _READS_FILES, NATIVE_NEWEST: _READS_FILES}
WORKFLOWS = {
    "test_best": Workflow(
        '`fit`, then `test(ckpt_path="best")` in the same processes', {STOCK: _STOCK_REWRAPS, **_NATIVE_REWRAPS},
    ),
    "evaluate_path": Workflow(
        "`fit`, then `validate(ckpt_path=<a checkpoint>)`", {STOCK: _STOCK_REWRAPS, **_NATIVE_REWRAPS},
    ),
    "evaluate_last": Workflow('`fit`, then `predict(ckpt_path="last")`', {STOCK: _STOCK_REWRAPS, **_NATIVE_REWRAPS}),
    "evaluate_none": Workflow(
        "`fit`, then `test(ckpt_path=None)` (the weights in memory)",
        {STOCK: _STOCK_REWRAPS, NATIVE_21: _REWRAPS_IN_MEMORY, NATIVE_NEWEST: _REWRAPS_IN_MEMORY},
    ),
    "save_after_test": Workflow(
        "`save_checkpoint` after `test`, resumed exactly in new processes",
        {STOCK: _STOCK_REWRAPS, NATIVE_21: _REWRAPS_SAVE, NATIVE_NEWEST: _REWRAPS_SAVE},
    ),
    "fit_again_same_trainer": Workflow(
        '`fit`, then `fit(ckpt_path="last")` with more epochs, same Trainer', {STOCK: _STOCK_OPTIMIZER, **_NATIVE_REWRAPS},
    ),
    "fit_again_new_trainer": Workflow(
        '`fit`, then `fit(ckpt_path="last")` with more epochs, a new Trainer', {STOCK: _STOCK_OPTIMIZER, **_NATIVE_REWRAPS},
    ),
    "load_from_checkpoint": Workflow(
        "`LightningModule.load_from_checkpoint(<sharded directory>)`, no process group", _NO_SHARDED_IN_STOCK, WITHOUT_FSDP,
    ),
    "single_device_ckpt_path": Workflow(
        "`Trainer(devices=1).predict(model, ckpt_path=<sharded directory>)`", _NO_SHARDED_IN_STOCK, WITHOUT_FSDP,
    ),
    "ddp_ckpt_path": Workflow(
        '`Trainer(strategy="ddp").fit(model, ckpt_path=<sharded directory>)`, exact resume', _NO_SHARDED_IN_STOCK,
        WITHOUT_FSDP,
    ),
    "fabric_without_fsdp": Workflow(
        "Fabric without FSDP: `load` of a sharded directory (model, optimizer, the rest)", _NO_SHARDED_IN_STOCK,
        WITHOUT_FSDP,
    ),
    "configure_sharded_model_full": Workflow(
        "`load_from_checkpoint(<full file>)` of a model that builds layers in `configure_sharded_model`",
        {STOCK: _HOOK_LATE, NATIVE_21: _HOOK_LATE}, IN_THE_HOOK,
    ),
    "configure_sharded_model_sharded": Workflow(
        "`load_from_checkpoint(<sharded directory>)` of a model that builds layers in `configure_sharded_model`",
        _NO_SHARDED_IN_STOCK, IN_THE_HOOK,
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
    """The mark for ``workflow``'s test here: where the table says it fails, an expected failure (strict) that must
    fail with one of the errors the table names."""
    here = column(stock)
    fails = WORKFLOWS[workflow].fails.get(here or "")
    if fails is None:  # passes, or (stock, sharded checkpoints) not tested
        return []
    reason = f"{here}: {fails.cell()}"
    return [pytest.mark.xfail(strict=True, raises=failing_as(reason, fails.accepts), reason=reason)]


def _cell(workflow: Workflow, column: str) -> str:
    if column not in workflow.fails:
        return PASS
    fails = workflow.fails[column]
    return "— (no sharded checkpoints)" if fails is None else fails.cell()


def markdown() -> str:
    """The table of docs/resuming.md (its section on the workflows after ``fit``)."""
    lines = ["| workflow | FSDP wrapping | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for workflow in WORKFLOWS.values():
        cells = [_cell(workflow, c) for c in COLUMNS]
        lines.append(f"| {workflow.what} | {workflow.wrapping} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
