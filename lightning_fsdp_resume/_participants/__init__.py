"""Checkpoint participants: states a checkpoint carries beside one FSDP model's weights, each under an entry of its own
and in the weights' sharded layout (``ShardedEMA``'s average, ``_ema.Average``, is one). The saves and loads know
them only through ``Participant``: a participant attaches to the module whose checkpoints carry it (a LightningModule,
which outlives its Trainers), and every save, load and rank-state capture asks ``of`` or ``within`` for what is
attached. Adding one is a module that subclasses ``Participant`` and calls ``attach``. No torch.
"""
from typing import Any, Dict, Iterator, List

from .._patching._held import ModuleHeld, held, peek


class Participant:
    """One state saved beside the weights of an FSDP model, ``model`` below (the root, wrapper included), whose
    parameter names begin with ``prefix`` (Lightning 2.0.x's wrapper's, ``_forward_module.``) before the ones stored."""

    key: str  # its entry in a sharded checkpoint, beside ``model``'s
    full_key: str  # its entry in a full checkpoint file, beside ``state_dict``
    rank_key: str  # its rank-local tensors' entry in each rank's state (``_rank_states``)

    def twice(self, module: Any) -> str:
        """What to say when a second participant under the same key attaches to ``module``."""
        raise NotImplementedError

    def saves(self) -> bool:
        """Whether a save now carries it (an average before its first update does not)."""
        raise NotImplementedError

    def sharded_state(self, model: Any, prefix: str) -> Dict[str, Any]:
        """This rank's part, a sharded state dict by the model's names without ``prefix``."""
        raise NotImplementedError

    def full_state(self, model: Any, prefix: str, build: Any) -> Dict[str, Any]:
        """The whole of it on rank 0 (a collective): ``build()`` gathers a full state dict of ``model`` as a full save
        does."""
        raise NotImplementedError

    def shapes(self, model: Any) -> Dict[str, Any]:
        """The full shape of every tensor it keeps, by ``model``'s names (``prefix`` included): what a load expects."""
        raise NotImplementedError

    def read(self, model: Any, reader: Any, stored: Dict[str, str]) -> None:
        """Read each tensor named in ``stored`` (model name -> checkpoint entry) through torch DCP's ``reader`` (a
        collective), resharded as the weights are."""
        raise NotImplementedError

    def copy(self, model: Any, values: Dict[str, Any]) -> None:
        """This rank's part of each full tensor in ``values`` (by ``model``'s names)."""
        raise NotImplementedError

    def absent(self, where: str) -> None:
        """The checkpoint at ``where`` does not carry it."""
        raise NotImplementedError

    def live_tensors(self) -> Iterator[Any]:
        """The tensors training changes in place, which a save in the background copies before it returns."""
        raise NotImplementedError

    def rank_tensors(self) -> Dict[str, Any]:
        """This rank's tensors that differ from rank to rank (as buffers do), by ``model``'s names."""
        return {}


def attach(module: Any, participant: Participant) -> None:
    """Checkpoints of ``module`` carry ``participant``; one per key."""
    attached = held(module, ModuleHeld).participants
    other = attached.get(participant.key)
    if other is not None and other is not participant:
        raise ValueError(participant.twice(module))
    attached[participant.key] = participant


def of(module: Any) -> List[Participant]:
    """The participants attached to ``module`` (None: a strategy used without a LightningModule)."""
    kept = None if module is None else peek(module, ModuleHeld)
    return [] if kept is None else list(kept.participants.values())


def within(model: Any) -> Iterator[Participant]:
    """The participants attached to any module inside ``model``."""
    for module in model.modules():
        yield from of(module)
