"""What every rank must agree on: rank 0's value or verdict given to all, every rank's outcome of a step (``failures``,
``agree``), broadcasts and barriers that also work without a process group (a notebook, a unit test), as native 2.1's
do; and what each rank has of its own: its rank, and its random number generators' states. ``strategy`` is the
Trainer's or Fabric's strategy object (``global_rank``, ``broadcast``, ``barrier``).
"""
import pickle
import random
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from .._checkpoint import _unpickling
from .._patching import _torch_compat as compat


def decided_on_rank_zero(strategy: Any, check: Callable[..., Any], *args: Any) -> Any:
    """Run ``check`` on rank 0 and give every rank its result, or raise its error on every rank."""
    outcome: Any = (None, None)
    if strategy.global_rank == 0:
        try:
            outcome = (check(*args), None)
        except Exception as raised:  # whatever it is, the other ranks must hear of it rather than wait
            outcome = (None, raised)
    result, error = broadcast(strategy, outcome)
    if error is not None:
        raise error
    return result


def everyone(obj: Any, group: Any = None) -> List[Any]:
    """Every rank's ``obj``, in rank order, on every rank (a collective over ``group``, the default one if None);
    ``[obj]`` in a process without a process group."""
    if not compat.distributed():
        return [obj]
    import torch.distributed as dist

    gathered: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


class RanksFailedError(RuntimeError):
    """Several ranks failed at one step; ``failures`` holds each one's error, by rank."""

    def __init__(self, failures: Dict[int, BaseException]) -> None:
        self.failures = failures
        causes = "; ".join(f"rank {rank}: {describe(error)}" for rank, error in sorted(failures.items()))
        super().__init__(f"{len(failures)} ranks failed: {causes}")


def failures(error: Optional[BaseException], group: Any = None) -> Dict[int, BaseException]:
    """Every rank's failure at one step, on every rank: rank -> its error, for the ranks whose ``error`` is not None
    (a collective over ``group``: every rank calls it, with None where it succeeded). The one way ranks learn each
    other's outcome, so that none goes on alone and no rank's own error is lost behind another's."""
    if not compat.distributed():
        return {} if error is None else {0: error}
    import torch.distributed as dist

    found = {rank: theirs for rank, theirs in enumerate(everyone(_portable(error), group)) if theirs is not None}
    if error is not None:
        found[dist.get_rank(group)] = error  # this rank's own, with its traceback
    return found


def agree(error: Optional[BaseException], group: Any = None) -> None:
    """``failures``, raised on every rank when any rank failed: the failed rank's error where one failed (each rank
    raises the same exception, as if the step had failed there), else ``RanksFailedError`` naming each."""
    found = failures(error, group)
    if not found:
        return
    if len(found) == 1:
        (only,) = found.values()
        raise only
    raise RanksFailedError(found) from error


def describe(error: BaseException) -> str:
    """The first line of ``error``, with its type; torch.distributed.checkpoint's name the rank that failed first."""
    where = ""
    nested = getattr(error, "failures", None)
    if isinstance(nested, dict) and nested:
        rank, failure = sorted(nested.items(), key=lambda item: item[0])[0]
        error = failure[0] if isinstance(failure, tuple) else failure
        where = f" (on rank {rank})"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}{': ' + lines[0] if lines else ''}{where}"


def _portable(error: Optional[BaseException]) -> Optional[BaseException]:
    """``error`` as the other ranks receive it: itself where it pickles, else a ``RuntimeError`` that describes it."""
    if error is None:
        return None
    try:
        _unpickling.loads(pickle.dumps(error), "an error", trusted=True)
    except Exception:
        return RuntimeError(describe(error))
    return error


def raise_found_on_any_rank(found: Optional[str]) -> None:
    """Raise ``RuntimeError`` on every rank when any rank ``found`` a fault (its message), naming the first such rank
    (a collective: every rank calls it, with None where all is well), so that no rank goes on alone."""
    for rank, error in sorted(failures(None if found is None else RuntimeError(found)).items()):
        raise RuntimeError(f"{error} (found on rank {rank})")


def broadcast(strategy: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank. Lightning 2.0.x's ``broadcast`` needs a process group; native 2.1's,
    like this, returns ``obj`` in a process without one (a notebook, a unit test)."""
    return strategy.broadcast(obj) if compat.distributed() else obj


def barrier(strategy: Any) -> None:
    """Lightning 2.0.x's ``barrier`` fails without a process group (its check tests a function, not its result)."""
    if compat.distributed():
        strategy.barrier()


def warn_rank_zero(strategy: Any, message: str) -> None:
    if strategy.global_rank == 0:
        warnings.warn(message)


def rank_and_world_size() -> Tuple[int, int]:
    """This process's rank and the number of ranks (0 and 1 without a process group)."""
    if not compat.distributed():
        return 0, 1  # one process without a process group: a notebook, a unit test
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def rng_state() -> Dict[str, Any]:
    """This process's random number generators' states: torch's CPU and, where initialised, CUDA generators,
    Python's ``random``, NumPy's where imported."""
    import torch

    rng: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # imported by the user's code, or not wanted
    if numpy is not None:
        # its key array as a tensor: a checkpoint read with weights_only=True (torch >= 2.6's default) takes no arrays
        kind, keys, *rest = numpy.random.get_state()
        rng["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), *rest)
    return rng


def set_rng_state(rng: Dict[str, Any]) -> None:
    """Put back the states ``rng_state`` returned."""
    import torch

    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in rng and numpy is not None:
        kind, keys, *rest = rng["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), *rest))
