"""The data cursor in one process, against torch's own ``DistributedSampler``: on the saving run's number of ranks a
placed share is the rest of what the sampler gives that rank; on another, the ranks' shares are the untrained
samples, each once, padded by fewer repeats than ranks (or cut, with ``drop_last``), all of one length."""
from collections import Counter

import pytest
import torch

from lightning_fsdp_resume._run_state import _data_cursor

BATCH = 3


def _loader(size: int, ranks: int, rank: int, shuffle: bool, drop_last: bool, epoch: int = 2):
    sampler = torch.utils.data.DistributedSampler(range(size), num_replicas=ranks, rank=rank, shuffle=shuffle, seed=5,
                                                  drop_last=drop_last)
    sampler.set_epoch(epoch)
    return torch.utils.data.DataLoader(range(size), batch_size=BATCH, sampler=sampler)


def _saved(size: int, ranks: int, batches: int, shuffle: bool, drop_last: bool):
    found = _data_cursor.identity(_loader(size, ranks, 0, shuffle, drop_last))
    return _data_cursor.cursor(found, _data_cursor.first_segment(ranks), batches)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("size, ranks", [(50, 2), (47, 3), (13, 4)])
def test_on_the_same_rank_count_each_share_is_the_rest_of_the_samplers(size, ranks, shuffle, drop_last):
    saved = _saved(size, ranks, 1, shuffle, drop_last)
    for rank in range(ranks):
        placed = _data_cursor.place(saved, rank, ranks, 1)
        assert placed.indices == list(_loader(size, ranks, rank, shuffle, drop_last).sampler)[BATCH:]
        assert placed.segment == saved["segment"]


def test_a_large_epoch_is_placed_as_the_sampler_orders_it():
    """2,000,003 samples (the cursor draws the order as int32, the sampler as int64): rank 1 of 2 after 100 batches."""
    saved = _saved(2_000_003, 2, 100, True, False)
    assert _data_cursor.place(saved, 1, 2, 100).indices == list(_loader(2_000_003, 2, 1, True, False).sampler)[300:]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("size, saved_on, resumed_on", [(50, 2, 3), (50, 2, 1), (47, 4, 2), (50, 3, 4), (7, 2, 5)])
def test_on_another_rank_count_the_shares_are_the_untrained_samples(size, saved_on, resumed_on, shuffle, drop_last):
    saved = _saved(size, saved_on, 1, shuffle, drop_last)
    trained = {i for rank in range(saved_on) for i in list(_loader(size, saved_on, rank, shuffle, drop_last).sampler)[:BATCH]}
    shares = [_data_cursor.place(saved, rank, resumed_on, 1).indices for rank in range(resumed_on)]
    counts = Counter(i for share in shares for i in share)
    untrained = set(range(size)) - trained
    assert len({len(share) for share in shares}) == 1, [len(share) for share in shares]
    assert not set(counts) & trained
    if drop_last:
        assert max(counts.values(), default=1) == 1 and len(untrained - set(counts)) < resumed_on
    else:
        assert set(counts) == untrained and sum(counts.values()) - len(untrained) < resumed_on
    segment = _data_cursor.place(saved, 0, resumed_on, 1).segment
    assert segment == {"start": saved["trained"], "ranks": resumed_on, "from_batch": 1}


def test_a_chain_of_rank_counts_trains_each_sample_once():
    """2 ranks train 1 batch each, 3 ranks 2 batches each, then 1 rank the rest: 50 samples, each once."""
    saved = _saved(50, 2, 1, True, False)
    first = {i for rank in range(2) for i in list(_loader(50, 2, rank, True, False).sampler)[:BATCH]}
    on_three = [_data_cursor.place(saved, rank, 3, 1) for rank in range(3)]
    second = [i for placed in on_three for i in placed.indices[:2 * BATCH]]
    again = _data_cursor.cursor(dict(saved), on_three[0].segment, 3)
    last = _data_cursor.place(again, 0, 1, 3).indices
    assert sorted(first | set(second) | set(last)) == list(range(50))
    assert len(first) + len(second) + len(last) == 50


def test_a_loader_whose_order_is_not_a_distributed_samplers_has_no_cursor():
    assert _data_cursor.identity(torch.utils.data.DataLoader(range(10), batch_size=2, shuffle=True)) is None
    saved = _saved(10, 2, 1, True, False)
    assert _data_cursor.mismatch(saved, None) is not None
    other = _data_cursor.identity(_loader(11, 2, 0, True, False))
    assert _data_cursor.mismatch(saved, other) == "the dataset's size is 11 where the checkpoint's was 10"
