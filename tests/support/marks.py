"""The skip marks that test modules share, each with the one reason it gives wherever it skips."""
import importlib
import os
import re
from typing import Callable, Type

import pytest

from support.flavours import ORIG_PARAMS_OPTIMIZER_STATE_ON_CPU, PATCHABLE_FABRICS, PATCHABLE_TRAINERS, TORCH, optimizer_state_on_cpu

# Every test that runs FSDP ranks on the CPU (the multirank ones): gloo cannot serve FSDP before torch 2.2.
needs_cpu_fsdp = pytest.mark.skipif(
    TORCH < (2, 2), reason=f"torch {'.'.join(map(str, TORCH))} cannot run FSDP on CPU: gloo lacks _allgather_base before torch 2.2"
)

needs_orig_params_optimizer_state = pytest.mark.skipif(
    not ORIG_PARAMS_OPTIMIZER_STATE_ON_CPU,
    reason="torch 2.2 gathers optimizer state with use_orig_params=True through torch.cuda calls, which fail without a GPU",
)


def skip_without_optimizer_state(use_orig_params) -> None:
    """In a test or fixture parametrized by ``use_orig_params``: skip where this torch cannot gather its optimizer state."""
    if not optimizer_state_on_cpu(use_orig_params):
        skip_as(needs_orig_params_optimizer_state)


# Packages that tox installs for some environments only. Where tox installs a group of them it sets
# LIGHTNING_FSDP_RESUME_INSTALLED_<GROUP>=1 (tox.ini's setenv), and a test that needs one fails there when it does not
# import; elsewhere the test is skipped.
S3_PACKAGES = ("moto", "s3fs", "boto3", "flask")


def installed_by_tox(group: str) -> bool:
    """Whether tox installed ``group`` (``"s3"``, ``"torchdata"``) for this environment."""
    return os.environ.get(f"LIGHTNING_FSDP_RESUME_INSTALLED_{group.upper()}") == "1"


def importable(group: str, *modules: str) -> bool:
    """Whether ``modules`` import; where tox installed ``group``, one that does not import raises (fails the test)."""
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError:
        if installed_by_tox(group):
            raise
        return False
    return True


def require(group: str, *modules: str) -> None:
    """In a test: import ``modules``, skipping where tox does not install ``group`` and they are missing."""
    if not importable(group, *modules):
        pytest.skip(f"needs {', '.join(modules)}: tox installs them where it sets LIGHTNING_FSDP_RESUME_INSTALLED_{group.upper()}=1")


# Saves in the background (AsyncCheckpointIO, Fabric's) write through torch DCP's async_save.
needs_async_save = pytest.mark.skipif(TORCH < (2, 3), reason="torch < 2.3 has no dcp.async_save")

# Where torch is too old, consolidate refuses before it looks at its arguments (test_cli checks that).
needs_consolidate = pytest.mark.skipif(TORCH < (2, 2), reason="consolidate needs torch >= 2.2, which this torch is not")

# The tests of the Trainer's patched strategy itself (its signature, its saves in one process).
needs_patched_trainer = pytest.mark.skipif(not PATCHABLE_TRAINERS, reason="no Lightning 2.0.x installed: nothing of the Trainer is patched")
# The same for Fabric's patched classes (Fabric and its FSDPStrategy).
needs_patched_fabric = pytest.mark.skipif(not PATCHABLE_FABRICS, reason="no Fabric 2.0.x installed: nothing of Fabric is patched")

# Runs that are several torchrun launches of their own (the demo end to end, a Fabric resume from a consolidated file,
# the two-node run, the benchmark's smoke run) are made in one environment of the matrix, for time: tox sets this
# there. Each launch imports Lightning anew in every rank; what they run, the other environments run forked.
LONG_RUNS_ENV = "LIGHTNING_FSDP_RESUME_LONG_RUNS"
long_runs = pytest.mark.skipif(
    os.environ.get(LONG_RUNS_ENV) != "1",
    reason=f"several torchrun launches of its own: runs where {LONG_RUNS_ENV}=1 (tox: lightning209-torch213)",
)


class _Accepting(type):
    def __instancecheck__(cls, error) -> bool:
        return bool(cls.accepts(error))


def failing_as(name: str, accepts: Callable[[BaseException], bool]) -> Type[Exception]:
    """For ``xfail(raises=...)``: a class whose instances are the errors ``accepts`` takes. An expected failure then
    fails the test when it fails for another reason (a crashed rank, a harness error, another message)."""
    return _Accepting(name, (Exception,), {"accepts": staticmethod(accepts)})


def raising(exception: Type[BaseException], pattern: str) -> Type[Exception]:
    """For ``xfail(raises=...)``: an ``exception`` whose message matches ``pattern`` (``re.search``)."""
    return failing_as(f"{exception.__name__} matching {pattern!r}",
                      lambda error: isinstance(error, exception) and re.search(pattern, str(error)) is not None)


def skip_as(*marks) -> None:
    """In a fixture, which marks do not reach: skip as the first of ``marks`` whose condition holds would."""
    for mark in marks:
        if mark.args[0]:
            pytest.skip(mark.kwargs["reason"])
