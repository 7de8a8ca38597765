"""Where a run is in its training data, per rank, and putting a resumed epoch's data back there: the random states
its iterator was made from, the batches already trained on left out (by index, by state, or loaded and dropped).
What each way costs and when it is exact: docs/behaviour.md#resuming-inside-an-epoch.
"""
import contextlib
import logging
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from .._patching._held import SETTINGS
from .._save_load import _ranks

log = logging.getLogger(__name__)

SKIP, REPLAY, LIGHTNING = "skip", "replay", "lightning"
MODES = (SKIP, REPLAY, LIGHTNING)
EXACT, APPROXIMATE = "exact", "approximate"  # on another number of ranks, data without a cursor: refused, or not exact

# The attributes of a DataLoader where torch keeps the generators its iterator and its sampler draw from
_GENERATOR_PATHS = ("generator", "sampler.generator", "batch_sampler.generator", "batch_sampler.sampler.generator")


def set_mode(mode: str, other_rank_counts: str = EXACT) -> None:
    """``skip``, ``replay`` or ``lightning``, and ``exact`` or ``approximate``: see
    ``lightning_fsdp_resume.set_mid_epoch_resume``."""
    if mode not in MODES:
        raise ValueError(f"set_mid_epoch_resume({mode!r}): the mode is one of {', '.join(map(repr, MODES))}.")
    if other_rank_counts not in (EXACT, APPROXIMATE):
        raise ValueError(f"set_mid_epoch_resume(other_rank_counts={other_rank_counts!r}): it is 'exact' or 'approximate'.")
    SETTINGS.mid_epoch, SETTINGS.other_rank_counts = mode, other_rank_counts


def approximate() -> bool:
    return SETTINGS.other_rank_counts == APPROXIMATE


def mode() -> str:
    return SETTINGS.mid_epoch


def generators(loader: Any) -> Dict[str, Any]:
    """The ``torch.Generator`` objects a loader and its samplers draw from, by their attribute path."""
    import torch

    found = {}
    for path in _GENERATOR_PATHS:
        value = loader
        for name in path.split("."):
            value = getattr(value, name, None)
        if isinstance(value, torch.Generator):
            found[path] = value
    return found


def epoch_start(loaders: Sequence[Any]) -> Dict[str, Any]:
    """This rank's random states as an epoch's data iterator is about to be made: what the samplers and the loaders'
    workers draw from."""
    return {"rng": _ranks.rng_state(), "generators": _generator_states(loaders)}


def position(epoch: int, batches: int, validation: Optional[str], start: Optional[Dict[str, Any]],
             loaders: Sequence[Any]) -> Dict[str, Any]:
    """This rank's place in the data: ``batches`` of epoch ``epoch`` trained on (and where the validation after them
    was, if it was running: at its ``end`` or ``inside`` it), the states its iterator was made from (``start``), its
    generators' states now, and each loader's own ``state_dict()`` where it has one."""
    return {
        "epoch": epoch,
        "batches": batches,
        "validation": validation,
        "start": start,
        "generators": _generator_states(loaders),
        "loaders": [loader.state_dict() if stateful(loader) else None for loader in loaders],
    }


def stateful(loader: Any) -> bool:
    """A loader that says where it is (torchdata's ``StatefulDataLoader``, Lightning >= 2.3's convention)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def restore_generators(loaders: Sequence[Any], states: Sequence[Dict[str, Any]]) -> None:
    for loader, saved in zip(loaders, states):
        for path, generator in generators(loader).items():
            if path in saved:
                generator.set_state(saved[path])


def reposition(loaders: Sequence[Any], saved: Dict[str, Any], create: Callable[[], None], fetch: Callable[[], Any]) -> str:
    """Make the epoch's data iterator (``create``) so that it yields the batch after the ``saved`` position's last,
    exactly as the uninterrupted run's did; ``fetch`` draws one batch through it. The random states are the saved
    start's while the iterator is made and the trained batches are left out, and as they were before afterwards (the
    rank's saved ones, restored by the strategy). Returns how they were left out: ``state``, ``indices`` or
    ``batches``."""
    count = saved["batches"]
    how = _how(loaders, saved)
    before = _ranks.rng_state()
    _ranks.set_rng_state(saved["start"]["rng"])
    restore_generators(loaders, saved["start"]["generators"])
    began = time.perf_counter()
    try:
        if how == "state":
            for loader, state in zip(loaders, saved["loaders"]):
                loader.load_state_dict(state)
            create()
        elif how == "indices":
            with _skipping_indices(loaders[0], count) as skip:
                create()
            left = skip()
            if left:
                raise _shorter(saved, count - left)
        else:
            create()
            for done in range(count):
                try:
                    fetch()
                except StopIteration:
                    raise _shorter(saved, done) from None
    finally:
        _ranks.set_rng_state(before)
        # a stateful loader's own state sets the generators it draws from, maybe only when first asked: left as they are
        if how != "state":
            restore_generators(loaders, saved["generators"])
    seconds = time.perf_counter() - began
    if how == "batches":
        log.warning("Resumed inside epoch %d: loaded and dropped the %d batches already trained on, in %.2f s (%s).",
                    saved["epoch"], count, seconds, _why_replayed(loaders))
    else:
        log.info("Resumed inside epoch %d after batch %d: %s in %.3f s.", saved["epoch"], count,
                 "restored the loaders' states" if how == "state" else "left out the trained batches' indices", seconds)
    return how


def _shorter(saved: Dict[str, Any], found: int) -> ValueError:
    return ValueError(
        f"The checkpoint was taken after batch {saved['batches']} of epoch {saved['epoch']}, but the training data has"
        f" {found} batches in that epoch now. Resume with the data the run was trained on."
    )


def _how(loaders: Sequence[Any], saved: Dict[str, Any]) -> str:
    """By index where that is exact, else from the loaders' own states where every one has one, else by loading."""
    if mode() == SKIP and len(loaders) == 1 and _index_sampled(loaders[0]):
        return "indices"
    if loaders and all(stateful(loader) for loader in loaders) and all(s is not None for s in saved["loaders"]):
        return "state"
    return "batches"


def _why_replayed(loaders: Sequence[Any]) -> str:
    if mode() == REPLAY:
        return "set_mid_epoch_resume('replay')"
    if len(loaders) != 1:
        return f"{len(loaders)} train dataloaders"
    return f"a {type(loaders[0]).__name__} over {type(getattr(loaders[0], 'dataset', None)).__name__}, whose batches have no index"


def _index_sampled(loader: Any) -> bool:
    """A torch ``DataLoader`` over a map-style dataset: its batches are lists of indices drawn by a sampler."""
    from torch.utils.data import DataLoader, IterableDataset

    return isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)


@contextlib.contextmanager
def _skipping_indices(loader: Any, count: int) -> Iterator[Callable[[], int]]:
    """Within: every iterator made of the loader's index sampler (its batch sampler, else its sampler) leaves out its
    first ``count`` items, drawn when the first is asked for (a loader with workers asks as its iterator is made).
    Gives ``skip``, which leaves them out of the last one made at once: where the uninterrupted run drew its first
    index, right after its iterator was made; it returns how many the sampler did not have. Iterators made
    afterwards (persistent workers' next epoch) are plain."""
    attribute = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    original = getattr(loader, attribute)
    skipping = _SkipFirst(original, count)
    object.__setattr__(loader, attribute, skipping)  # DataLoader refuses to set it once made
    try:
        yield skipping.skip
    finally:
        object.__setattr__(loader, attribute, original)
        skipping.count = 0


class _SkipFirst:
    """An index sampler whose iterators leave out the sampler's first ``count`` items (none once ``count`` is 0)."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler = sampler
        self.count = count
        self.last: Optional[_Skipping] = None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        if not self.count:
            return iter(self.sampler)
        self.last = _Skipping(iter(self.sampler), self.count)
        return self.last

    def skip(self) -> int:
        if self.last is None:
            raise RuntimeError("The train dataloader's iterator was not made where the epoch starts: its trained batches"
                               " could not be left out. Call lightning_fsdp_resume.set_mid_epoch_resume('replay').")
        return self.last.skip()


_END = object()


class _Skipping:
    def __init__(self, iterator: Iterator[Any], count: int) -> None:
        self.iterator, self.left, self.missing = iterator, count, 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self.skip()
        return next(self.iterator)

    def skip(self) -> int:
        """Leave out what is left to leave out; how many of them the sampler did not have."""
        while self.left:
            self.left -= 1
            self.missing += next(self.iterator, _END) is _END
        return self.missing


def _generator_states(loaders: Sequence[Any]) -> List[Dict[str, Any]]:
    return [{path: generator.get_state() for path, generator in generators(loader).items()} for loader in loaders]
