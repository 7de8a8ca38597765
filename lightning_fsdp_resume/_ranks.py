"""What every rank must agree on: rank 0's value or verdict given to all, and barriers that also work in one
process without a process group (a notebook, a unit test), as native Lightning 2.1's do.

``strategy`` is the Trainer's or Fabric's strategy object (``global_rank``, ``broadcast``, ``barrier``).
"""
import warnings
from typing import Any, Callable, List, Optional

from . import _torch_compat as compat


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


def raise_found_on_any_rank(found: Optional[str]) -> None:
    """Raise ``RuntimeError`` on every rank when any rank ``found`` a fault (its message), naming the first such rank
    (a collective: every rank calls it, with None where all is well), so that no rank goes on alone."""
    for rank, message in enumerate(everyone(found)):
        if message is not None:
            raise RuntimeError(f"{message} (found on rank {rank})")


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
