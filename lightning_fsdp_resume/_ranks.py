"""What every rank must agree on: rank 0's value or verdict given to all, and barriers that also work in one
process without a process group (a notebook, a unit test), as native Lightning 2.1's do.

``strategy`` is the Trainer's or Fabric's strategy object (``global_rank``, ``broadcast``, ``barrier``).
"""
import warnings
from typing import Any, Callable

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
