"""Launching worker processes for the multi-rank tests: the one place that knows how."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import pytest

from support.flavours import NATIVE

HERE = Path(__file__).parent
ROOT = HERE.parents[1]  # the repository, first on the launched processes' PYTHONPATH
WORKER = HERE / "trainer_worker.py"  # the Trainer's rank program
FABRIC_WORKER = HERE / "fabric_worker.py"  # Fabric's
MID_EPOCH_WORKER = HERE / "mid_epoch_worker.py"  # the Trainer's, checkpointing and resuming inside epochs
EMA_WORKER = HERE / "ema_worker.py"  # the Trainer's with ShardedEMA
TIMEOUT_S = 300
# Reference runs train EPOCHS epochs and checkpoint each; resumed runs start from MID (after epoch 1).
EPOCHS = 3
MID = "epoch=1.ckpt"


def _env(extra=None):
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


def _run(command: Sequence[str], env=None, expect_failure: bool = False, timeout: float = TIMEOUT_S) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=_env(env))
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


# The workers' launches are forks of the rank server (rank_server.py): the same ranks, environment and
# failure handling as torchrun, without importing Lightning anew for each. "torchrun" here launches
# every one with torchrun instead.
LAUNCHER_ENV = "LIGHTNING_FSDP_RESUME_TEST_LAUNCHER"
_server = []  # the rank server of this pytest session, started on first use


def _rank_server() -> subprocess.Popen:
    if _server and _server[0].poll() is None:
        return _server[0]
    import atexit

    errors = tempfile.NamedTemporaryFile("w+", prefix="rank-server-", suffix=".log")
    server = subprocess.Popen([sys.executable, str(HERE / "rank_server.py")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=errors, text=True, env=_env())
    server.errors = errors
    if not json.loads(server.stdout.readline() or "{}").get("ready"):
        errors.seek(0)
        pytest.fail(f"the rank server did not start:\n{errors.read()[-12000:]}")
    atexit.register(server.kill)
    _server[:] = [server]
    return server


def _forked(script: Path, args: Sequence[str], nproc: int, expect_failure: bool, grace: float = 0.0) -> str:
    server = _rank_server()
    logs = tempfile.mkdtemp(prefix="ranks-")
    try:
        request = {"worker": script.stem, "args": list(args), "nproc": nproc, "logs": logs, "timeout": TIMEOUT_S, "grace": grace}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        line = server.stdout.readline()
        if not line:
            server.errors.seek(0)
            pytest.fail(f"the rank server died:\n{server.errors.read()[-12000:]}")
        reply = json.loads(line)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    failed = any(reply["codes"])
    what = f"{script.stem} {' '.join(args)} on {nproc or 'one plain'} forked rank(s)"
    if expect_failure and not failed:
        pytest.fail(f"{what} succeeded but was expected to fail\n{reply['output'][-6000:]}")
    if failed and not expect_failure:
        pytest.fail(f"{what} exited {reply['codes']}\n{reply['output'][-18000:]}")
    return reply["output"]


def single(script: Path, args: Sequence[str], env=None, expect_failure: bool = False) -> str:
    return _run([sys.executable, str(script)] + [str(a) for a in args], env, expect_failure)


def _launch(script: Path, args: Sequence, nproc: int, env, expect_failure: bool, by_torchrun: bool,
            grace: float = 0.0) -> str:
    """``script`` on ``nproc`` ranks (``nproc=0``: one plain process): forks of the rank server unless
    ``by_torchrun``, ``env`` or LIGHTNING_FSDP_RESUME_TEST_LAUNCHER=torchrun; ``grace``: the seconds the other ranks
    of a forked launch have to end by themselves once one failed (``rank_server.launch``)."""
    forked = not (by_torchrun or env or os.environ.get(LAUNCHER_ENV) == "torchrun")
    args = [str(a) for a in args]
    if forked:
        return _forked(script, args, nproc, expect_failure, grace)
    if nproc == 0:
        return single(script, args, env, expect_failure)
    return torchrun(script, args, nproc, env, expect_failure)


def worker(tmp: Path, *args, nproc: int = 2, env=None, expect_failure: bool = False, by_torchrun: bool = False) -> str:
    """The Trainer worker on ``nproc`` ranks; ``nproc=0`` runs it as one plain process without FSDP."""
    if nproc == 0:
        args = ("--strategy", "single", *args)
    return _launch(WORKER, args, nproc, env, expect_failure, by_torchrun)


def fabric_worker(tmp: Path, *args, nproc: int = 2, env=None, expect_failure: bool = False, by_torchrun: bool = False) -> str:
    """The Fabric worker on ``nproc`` ranks, launched as ``worker`` launches the Trainer's."""
    return _launch(FABRIC_WORKER, args, nproc, env, expect_failure, by_torchrun)


def mid_epoch_worker(*args, nproc: int = 2, expect_failure: bool = False, grace: float = 0.0) -> str:
    """The mid-epoch rank program on ``nproc`` ranks (``nproc=0``: one plain process without FSDP); ``grace`` as
    ``_launch``'s."""
    if nproc == 0:
        args = ("--strategy", "single", *args)
    return _launch(MID_EPOCH_WORKER, args, nproc, None, expect_failure, by_torchrun=False, grace=grace)


def ema_worker(*args, nproc: int = 2, expect_failure: bool = False) -> str:
    """The ShardedEMA rank program on ``nproc`` ranks."""
    return _launch(EMA_WORKER, args, nproc, None, expect_failure, by_torchrun=False)


def nodes(tmp: Path, *args, count: int = 2, env=None) -> str:
    """The Trainer worker as ``count`` torchrun "nodes" of one rank each, meeting on the loopback interface."""
    from support.rank_server import free_port

    port = free_port()
    base = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={count}", "--nproc-per-node=1",
            "--master-addr=127.0.0.1", f"--master-port={port}"]
    launches = [
        subprocess.Popen(base + [f"--node-rank={node}", str(WORKER), *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=_env(env))
        for node in range(count)
    ]
    outputs = [launch.communicate(timeout=TIMEOUT_S)[0] for launch in launches]
    for node, (launch, output) in enumerate(zip(launches, outputs)):
        if launch.returncode != 0:
            pytest.fail(f"node {node} exited {launch.returncode}\n{output[-12000:]}")
    return "".join(outputs)


def config(root: Path, state_dict_type: str, use_orig_params: int, optimizers: int = 1, wrap: str = "policy"):
    """The worker arguments of one configuration, writing under ``root``. ``wrap``: ``"policy"`` (an FSDP unit
    per ``nn.Sequential``) or ``"root"`` (no ``auto_wrap_policy``: Lightning's default, the root unit alone)."""
    return [
        "--out", root / "out", "--ckpt-dir", root / "ckpt", "--state-dict-type", state_dict_type,
        "--use-orig-params", use_orig_params, "--optimizers", optimizers, "--wrap", wrap,
    ]


def fabric_config(root: Path, state_dict_type: str, wrap: str = "policy"):
    """The Fabric worker's arguments of one configuration, writing under ``root`` (``wrap`` as for ``config``)."""
    return ["--out", root / "out", "--ckpt-dir", root / "ckpt", "--state-dict-type", state_dict_type, "--wrap", wrap]


# Native Lightning re-keys id-keyed (full) optimizer states with FSDP.rekey_optim_state_dict, which
# fails for flat parameters; wherever one is saved or loaded natively, use_orig_params=True is used.
FULL_USE_ORIG_PARAMS = 1 if NATIVE else 0
