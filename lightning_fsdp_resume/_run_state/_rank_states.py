"""What each rank keeps to itself and a checkpoint must hold once per rank for an exact resume: its RNG states and the
buffers its own batches updated (FSDP does not synchronise buffers, e.g. BatchNorm's statistics) and the rank-local
tensors of the checkpoint participants kept beside them (``_participants``: ``ShardedEMA``'s buffers), as one list
by rank, ``rank_states``, written by rank 0, read with ``weights_only=True``, restored on each rank the saving run had:
the Trainer's checkpoint entry (``Entry``), and Fabric's ``RankStates``.
"""
import pickle
from typing import Any, Dict, List, Optional

from .. import _participants
from .._checkpoint import _format, _unpickling
from .._patching._held import StrategyHeld, held, peek
from .._save_load._ranks import agree, rank_and_world_size, rng_state, set_rng_state

KEY = "rank_states"  # the checkpoint entry (the Trainer's; Fabric: wherever the user puts a RankStates)
# each rank's holds the rank's buffers by their clean names (``_buffers``) under BUFFERS, and each participant's
# rank-local tensors by the same names under its ``rank_key``
BUFFERS = "buffers"


def capture(module: Any) -> Dict[str, Any]:
    """This rank's RNG states (``rng_state``) and its buffers (and its participants' rank-local tensors) by their clean
    names, copied to the CPU."""
    state: Dict[str, Any] = {"rng": rng_state(), BUFFERS: {}}
    if module is not None:
        for key, tensors in _rank_local(module).items():
            if tensors or key == BUFFERS:
                state[key] = {name: value.detach().cpu().clone() for name, value in tensors.items()}
    return state


def gathered(module: Any) -> Optional[List[Dict[str, Any]]]:
    """Every rank's ``capture`` on rank 0, buffers kept only where they differ from rank 0's; None elsewhere.
    A collective: every rank calls it."""
    import torch

    mine: Dict[str, Any] = {}
    error: Optional[BaseException] = None
    try:
        mine = capture(module)
    except Exception as raised:  # every rank hears of it, rather than wait in the gather below
        error = raised
    agree(error)
    rank, world_size = rank_and_world_size()
    if world_size == 1:
        return [mine]
    import torch.distributed as dist

    # pickled first, on the CPU: gather_object pickles what it is given, GPU generator states included
    everyone: Optional[List[Any]] = [None] * world_size if rank == 0 else None
    dist.gather_object(pickle.dumps(mine), everyone, dst=0)
    if everyone is None:
        return None
    states = [_unpickling.loads(blob, "the gathered rank states", trusted=True) for blob in everyone]  # this run's
    for key in (key for key in mine if key != "rng"):  # the buffers and the participants' rank-local tensors
        reference = states[0].get(key, {})
        for state in states[1:]:  # rank 0's are all kept: a strategy may store any rank's copy in the model's entry
            if key in state:
                state[key] = {
                    name: value for name, value in state[key].items()
                    if name not in reference or not torch.equal(value, reference[name])
                }
    return states


def restore(states: Any, module: Any, where: str = "The checkpoint") -> None:
    """This rank's RNG states and buffers from ``states`` (a checkpoint's ``rank_states``), where this rank saved
    some (``restore_buffers``)."""
    if restore_buffers(states, module, where):
        restore_rng(states)


def restore_buffers(states: Any, module: Any, where: str = "The checkpoint") -> bool:
    """This rank's buffers from ``states``; False where it has none there: a rank the saving run did not have keeps
    the random states its run started with and rank 0's buffers (the model's). On another world size rank 0 says so
    in one warning."""
    import torch

    rank, world_size = rank_and_world_size()
    saved = len(states) if isinstance(states, list) else 0
    if saved != world_size and rank == 0:
        import warnings

        what = (f"ranks 0 to {min(saved, world_size) - 1} get their own random number generator states and rank-local"
                " buffers back" if saved else "each rank's random number generator states and buffers are not restored")
        if 0 < saved < world_size:
            what += f"; ranks {saved} to {world_size - 1} keep the random states this run gave them and rank 0's buffers"
        warnings.warn(f"{where} was saved by {saved or 'an unknown number of'} ranks and is resumed on {world_size}: {what}")
    if rank >= saved:
        return False
    if module is not None:
        with torch.no_grad():
            for key, mine in _rank_local(module).items():
                for name, value in states[rank].get(key, {}).items():
                    if name in mine:
                        mine[name].copy_(value)
    return True


def restore_rng(states: List[Dict[str, Any]]) -> None:
    """This rank's random number generator states from ``states``, which ``restore_buffers`` found it in."""
    set_rng_state(states[rank_and_world_size()[0]]["rng"])


class RankStatesEntry(_participants.Entry):
    """``rank_states`` in the checkpoints of the package's FSDP strategy (``ours``: every rank saves, so ``gathered``
    may gather), taken from them as a Trainer call loads one. A fit restores this rank's buffers then and its random
    states as training starts: Lightning 2.0.x before 2.0.9 draws a random number between (``iter(dataloader)`` in
    ``setup_data``), which the uninterrupted run drew before it saved. Evaluation keeps the model's copy of the buffers
    (rank 0's), as every other reader does."""

    key = KEY

    def state(self, trainer: Any, ours: bool) -> Optional[List[Dict[str, Any]]]:
        return gathered(trainer.strategy.model) if ours else None

    def loaded(self, trainer: Any, checkpoint: Dict[str, Any], where: str, ours: bool) -> None:
        states = checkpoint.pop(KEY, None) if ours else None
        if states is not None and trainer.state.fn == "fit" and restore_buffers(states, trainer.strategy.model, where):
            held(trainer.strategy, StrategyHeld).rank_states = states

    def starting(self, trainer: Any) -> None:
        kept = peek(trainer.strategy, StrategyHeld)
        if kept is not None and kept.rank_states is not None:
            states, kept.rank_states = kept.rank_states, None
            restore_rng(states)


_participants.register(RankStatesEntry())


class RankStates:
    """Fabric: put one in the state you save and load to keep each rank's RNG states and rank-local buffers,
    ``state = {"model": model, "optimizer": optimizer, "ranks": RankStates(model)}``: ``fabric.save`` writes
    every rank's (a collective: every rank calls it, as Fabric does), ``fabric.load`` restores this rank's when
    the world size matches. ``module``: the model whose buffers differ across ranks (None: RNG states only)."""

    def __init__(self, module: Any = None) -> None:
        self.module = module

    def state_dict(self) -> Any:
        return gathered(self.module)

    def load_state_dict(self, states: Any) -> None:
        restore(states, self.module, where="The checkpoint being loaded")


def _buffers(module: Any) -> Dict[str, Any]:
    """The module's buffers by the names its author gave them: no FSDP, activation-checkpointing or Lightning
    wrapper segments (2.0.x's ``_LightningModuleWrapperBase`` and Fabric's ``_FabricModule`` both call the
    module they wrap ``_forward_module``)."""
    return {_author_name(_format.clean_module_name(name)): buffer for name, buffer in module.named_buffers()}


def _rank_local(module: Any) -> Dict[str, Dict[str, Any]]:
    """The model ``module``'s buffers (``BUFFERS``) and its participants' rank-local tensors (under each one's
    ``rank_key``), by the names ``_buffers`` gives the buffers."""
    found = {BUFFERS: _buffers(module)}
    for participant in _participants.within(module):
        found[participant.rank_key] = {_author_name(name): value for name, value in participant.rank_tensors().items()}
    return found


def _author_name(name: str) -> str:
    return name.replace("_forward_module.", "")
