"""Checkpoint participants, the states a checkpoint carries beside the weights, each under an entry of its own, of two
kinds. A ``Participant`` is in one FSDP model's sharded layout (``ShardedEMA``'s average, ``_ema.Average``): it
attaches to the module whose checkpoints carry it (a LightningModule, which outlives its Trainers), and every save,
load and rank-state capture asks ``of`` or ``within`` for what is attached. An ``Entry`` is a state of the run, stored
as it is (every rank's random states, the data position): it registers once, and every Trainer checkpoint asks it.
The saves and loads know them only through these two classes: adding one is a module that subclasses one and calls
``attach`` or ``register``. No torch.
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


class Entry:
    """A state of the run that a Trainer checkpoint carries under an entry of its own, as it is rather than in the
    weights' layout: every rank's random states and buffers (``_rank_states``), the run's place in its data
    (``_epoch_loop``). Each registers itself (``register``) as its module is imported; the checkpoint connector's
    patches (``_lightning._connector``) ask every one as a checkpoint is made and as a Trainer call resumes from one.
    ``ours``: the Trainer's strategy is the package's FSDP one or a subclass of it (``_strategy.patched``), whose saves
    and loads every rank makes."""

    key: str  # its entry in the checkpoint

    def state(self, trainer: Any, ours: bool) -> Any:
        """What the checkpoint being made holds under ``key``, asked on every rank once Lightning's entries and hooks
        are in; None: no entry."""
        raise NotImplementedError

    def loaded(self, trainer: Any, checkpoint: Dict[str, Any], where: str, ours: bool) -> None:
        """The checkpoint at ``where`` a Trainer call resumes from, as loaded, before Lightning and the user's hooks
        read it: its entry taken (``pop`` keeps it from them), or what a checkpoint without one means."""
        raise NotImplementedError

    def starting(self, trainer: Any) -> None:
        """As a resumed fit starts training (the package's strategy's ``on_train_start``, after every other hook)."""


_ENTRIES: Dict[str, Entry] = {}  # every registered Entry by its key: a declaration, made once per module


def register(entry: Entry) -> None:
    """Checkpoints carry ``entry`` from now on, under its key (one per key: a module imported again replaces its own)."""
    _ENTRIES[entry.key] = entry


def entries() -> List[Entry]:
    """The registered ``Entry``s, in the order they registered."""
    return list(_ENTRIES.values())


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
