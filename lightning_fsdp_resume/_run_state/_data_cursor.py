"""One run's place in an epoch of a map-style dataset read through a ``DistributedSampler``, on any number of ranks: the
epoch's global order (a function of seed, epoch and size), how much of it was trained, and each rank's share of the
rest. docs/behaviour.md#another-number-of-ranks says what it places exactly and what it refuses.
"""
import contextlib
import math
from typing import Any, Dict, Iterator, List, Optional

Cursor = Dict[str, Any]

# A segment is a stretch of the epoch read by one number of ranks: from position ``start`` of the epoch's order,
# ``ranks`` ranks, the first of its batches being the epoch's batch ``from_batch``. An epoch starts with one at 0;
# each resume on another number of ranks starts another where the last one stopped.


def identity(loader: Any) -> Optional[Dict[str, Any]]:
    """What fixes the order of a torch ``DataLoader`` over a map-style dataset drawn by a ``DistributedSampler``
    (Lightning's or the user's) in batches of ``BatchSampler``; None for any other loader."""
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    batches, sampler = loader.batch_sampler, loader.sampler
    if type(batches) is not BatchSampler or batches.sampler is not sampler or type(sampler) is not DistributedSampler:
        return None
    return {"size": len(sampler.dataset), "seed": sampler.seed, "shuffle": sampler.shuffle,
            "drop_last": sampler.drop_last, "epoch": sampler.epoch, "batch_size": batches.batch_size}


def first_segment(world_size: int) -> Dict[str, int]:
    return {"start": 0, "ranks": world_size, "from_batch": 0}


def cursor(found: Dict[str, Any], segment: Dict[str, int], batches: int) -> Cursor:
    """The cursor after ``batches`` of the epoch's batches were trained on every rank of ``segment``'s."""
    read = (batches - segment["from_batch"]) * found["batch_size"] * segment["ranks"]
    return dict(found, segment=dict(segment), trained=min(found["size"], segment["start"] + read))


def mismatch(saved: Cursor, found: Optional[Dict[str, Any]]) -> Optional[str]:
    """What differs between the saved cursor's data and the loader's now (``identity``), or None."""
    if found is None:
        return "it is not a DataLoader over a map-style dataset drawn by a DistributedSampler in batches"
    for key in ("size", "seed", "shuffle", "drop_last"):
        if found[key] != saved[key]:
            name = "the dataset's size" if key == "size" else f"its DistributedSampler's {key}"
            return f"{name} is {found[key]!r} where the checkpoint's was {saved[key]!r}"
    return None


def place(saved: Cursor, rank: int, world_size: int, batches: int) -> "Placed":
    """This rank's share of the rest of the saved cursor's epoch on ``world_size`` ranks, ``batches`` of the epoch's
    batches being done: on the saved segment's number of ranks, that segment goes on as it was (the uninterrupted
    run's order and padding); on another, a new segment from the first untrained sample, padded (fewer than
    ``world_size`` repeats, from the untrained samples) or cut (``drop_last``) as ``DistributedSampler`` does."""
    segment = saved["segment"]
    if world_size == segment["ranks"]:
        read = (batches - segment["from_batch"]) * saved["batch_size"] * world_size
        share = _segment_order(saved, segment["start"], world_size)[read + rank::world_size]
    else:
        segment = {"start": saved["trained"], "ranks": world_size, "from_batch": batches}
        share = _segment_order(saved, segment["start"], world_size)[rank::world_size]
    return Placed(share.tolist(), segment)


class Placed:
    """A rank's share of the rest of an epoch (``indices``) and the segment it belongs to."""

    def __init__(self, indices: List[int], segment: Dict[str, int]) -> None:
        self.indices, self.segment = indices, segment


def batches_in(count: int, batch_size: int, drop_last: bool) -> int:
    return count // batch_size if drop_last else math.ceil(count / batch_size)


def _segment_order(saved: Cursor, start: int, ranks: int) -> Any:
    """The epoch's order from ``start`` on, made a multiple of ``ranks`` long as ``DistributedSampler`` does: padded
    with its own first samples, or cut where ``drop_last``."""
    import torch

    if saved["shuffle"]:
        generator = torch.Generator()
        generator.manual_seed(saved["seed"] + saved["epoch"])
        # int32 where it holds the size: the same permutation as torch's default int64 (the tests compare with
        # DistributedSampler's), in half the memory
        dtype = torch.int32 if saved["size"] < 2**31 else torch.int64
        order = torch.randperm(saved["size"], generator=generator, dtype=dtype)[start:]
    else:
        order = torch.arange(start, saved["size"])
    length = len(order)
    if saved["drop_last"]:
        return order[:length - length % ranks]
    padding = -length % ranks
    if padding and length:
        order = torch.cat([order, order.repeat(math.ceil(padding / length))[:padding]])
    return order


class ListSampler:
    """Yields the indices it was given, once (a resumed epoch's share)."""

    def __init__(self, indices: List[int]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


@contextlib.contextmanager
def feeding(loader: Any, indices: List[int]) -> Iterator[None]:
    """Within: an iterator made of ``loader`` draws ``indices`` in its batches (its batch size, its ``drop_last``)
    instead of its sampler's; iterators made afterwards (the next epochs) draw from its sampler again."""
    from torch.utils.data import BatchSampler

    original = loader.batch_sampler
    batches = BatchSampler(ListSampler(indices), original.batch_size, original.drop_last)
    object.__setattr__(loader, "batch_sampler", batches)  # DataLoader refuses to set it once made
    try:
        yield
    finally:
        object.__setattr__(loader, "batch_sampler", original)
