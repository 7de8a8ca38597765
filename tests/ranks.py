"""Launching worker processes for the multi-rank tests: the one place that knows how."""
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

HERE = Path(__file__).parent
WORKER = HERE / "fsdp_worker.py"
TIMEOUT_S = 300


def _env(extra=None):
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def _run(command: Sequence[str], env=None, expect_failure: bool = False) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(env))
    if expect_failure:
        if result.returncode == 0:
            pytest.fail(f"{' '.join(map(str, command))} succeeded but was expected to fail\n{result.stderr[-6000:]}")
    elif result.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-12000:]}")
    return result.stdout + result.stderr


def torchrun(script: Path, args: Sequence[str], nproc: int = 2, env=None, expect_failure: bool = False) -> str:
    """Run ``script`` on ``nproc`` local ranks with torchrun (gloo on the CPU)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)]
    return _run(command + [str(a) for a in args], env, expect_failure)


def single(script: Path, args: Sequence[str], env=None, expect_failure: bool = False) -> str:
    return _run([sys.executable, str(script)] + [str(a) for a in args], env, expect_failure)


def worker(tmp: Path, *args, nproc: int = 2, env=None, expect_failure: bool = False) -> str:
    """The Trainer worker on ``nproc`` ranks; ``nproc=0`` runs it as one plain process without FSDP."""
    if nproc == 0:
        return single(WORKER, ["--strategy", "single", *args], env, expect_failure)
    return torchrun(WORKER, list(args), nproc, env, expect_failure)
