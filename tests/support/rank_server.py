"""Starts the worker's ranks as forks of one process that has already imported torch and Lightning.

Importing Lightning 2.0.x (which imports ``lightning.app``) takes about 10 of the 15 seconds a torchrun
launch needs on a 2-core machine, and the suite launches the worker dozens of times in each environment
of the matrix. This server pays the import once per pytest session. Every launch still gets new
processes: forks of a parent that has imported but never trained, with torchrun's environment
variables, meeting over gloo on the loopback interface. As under torchrun, the first rank to fail takes
the others down with it. The output names the exit code of each rank that ended by itself (``-9`` for
SIGKILL) and says which ones the server stopped.

It serves the rank programs, the Trainer's (``trainer_worker``, ``mid_epoch_worker``) and Fabric's (``fabric_worker``), each
imported once at start. ``ranks.py`` talks to it in JSON lines: a request ``{"worker", "args", "nproc",
"logs", "timeout"}`` (and ``"grace"``, see ``launch``) on stdin, a reply ``{"codes", "output"}`` on stdout.
``LIGHTNING_FSDP_RESUME_TEST_LAUNCHER=torchrun`` makes the tests launch with torchrun instead.
"""
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

if __name__ == "__main__":  # run as a script (torchrun, `python tests/support/rank_server.py`): `support` is in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POLL_S = 0.02


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _torchrun_environment(rank: int, nproc: int, port: int) -> dict:
    """What torchrun gives a worker of a one-node launch, less its agent's store (rank 0 hosts one)."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": f"rank-server-{port}",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _rank(worker, args, rank: int, nproc: int, port: int, log: str) -> None:
    """The forked child: becomes one rank of the worker and never returns."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        if nproc:
            os.environ.update(_torchrun_environment(rank, nproc, port))
        # Lightning reads the rank from the environment once, when imported: tell it what it would have read.
        from lightning_utilities.core.rank_zero import rank_zero_only

        rank_zero_only.rank = rank
        sys.argv = [worker.__file__, *args]
        worker.main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: B036 - reported in the rank's log, like an uncaught exception under torchrun
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(worker, args, nproc: int, logs: str, timeout: float, grace: float = 0.0) -> dict:
    """``nproc`` ranks of the worker; ``nproc=0``: one plain process, not launched as a rank. Once a rank fails the
    others are stopped, after ``grace`` seconds in which they may end by themselves (a test that expects every rank to
    fail alike, each with its own error, gives them that long; one left waiting for the failed rank is stopped then)."""
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(max(nproc, 1)):
        log = os.path.join(logs, f"rank{rank}.log")
        pid = os.fork()
        if pid == 0:
            _rank(worker, args, rank, nproc, port, log)
        children[pid] = rank
    codes = {}
    stopped = {}  # rank: why the server killed it (it did not fail by itself)
    deadline = time.monotonic() + timeout
    failed = None  # the first rank that failed, and when the others are stopped if they have not ended by then
    while len(codes) < len(children):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                _stop(children, codes, stopped, f"killed after the {timeout} s timeout")
                deadline = float("inf")
            elif failed is not None and not stopped and time.monotonic() > failed[1]:
                _stop(children, codes, stopped, f"killed by the rank server after rank {failed[0]} failed")
            time.sleep(POLL_S)
            continue
        rank = children[pid]
        codes[rank] = _exit_code(status)
        if codes[rank] != 0 and failed is None:
            failed = (rank, time.monotonic() + grace)
    output = []
    for rank in range(len(children)):
        with open(os.path.join(logs, f"rank{rank}.log"), errors="replace") as handle:
            output.append(f"----- rank {rank} -----\n{handle.read()}")
    for rank in range(len(children)):
        code = codes[rank]
        if rank in stopped:  # not reported as an exit code: tests look for the codes the ranks died of
            output.append(f"rank {rank}: {stopped[rank]}")
        else:
            output.append(f"rank {rank} exitcode: {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else ""))
    return {"codes": [codes[r] for r in range(len(children))], "output": "\n".join(output) + "\n"}


def _exit_code(status: int) -> int:
    """A waitpid status as an exit code, negative for a signal (os.waitstatus_to_exitcode, new in Python 3.9)."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _stop(children, codes, stopped, why: str) -> None:
    """SIGKILL every rank still running, noting why; ranks that have already ended keep their own code."""
    for pid, rank in children.items():
        if rank in codes:
            continue
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            codes[rank] = _exit_code(status)
            continue
        stopped[rank] = why
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _import_what_enable_cpu_fsdp_patches() -> None:
    """Every rank calls ``testing.enable_cpu_fsdp()``, which imports the connectors of every installed flavour,
    the one under test or not (``pytorch_lightning`` beside ``lightning``: about 4 s on 2 cores): import them here,
    once. Importing patches nothing."""
    import importlib

    from lightning_fsdp_resume.testing import _gpu_only_checks

    for module, _, _ in _gpu_only_checks():
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the imports print goes to stderr, not into the replies
    # torch, the Lightning flavour and Fabric under test, and the shim
    from support import ema_worker, fabric_worker, mid_epoch_worker, trainer_worker

    workers = {worker.__name__.rpartition(".")[2]: worker for worker in (trainer_worker, fabric_worker, mid_epoch_worker, ema_worker)}
    _import_what_enable_cpu_fsdp_patches()
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        worker = workers[request["worker"]]
        reply = launch(worker, request["args"], request["nproc"], request["logs"], request["timeout"], request.get("grace", 0.0))
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
