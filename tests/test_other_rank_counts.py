"""A Trainer run checkpointed inside an epoch and resumed on another number of ranks (more, fewer, and a chain of
them) trains the rest of that epoch on exactly the samples it had not trained: each once (padding, where the rank
count asks for it, repeats fewer samples than there are ranks, all of them untrained), every rank the same number of
steps; the next epoch is the new number of ranks' own ``DistributedSampler`` order, and ``global_step`` goes on.

The record of every rank's steps (global step, epoch, batch index, sample indices) comes from ``mid_epoch_worker``.
"""
import json
from collections import Counter
from pathlib import Path

import pytest

from support.flavours import NATIVE
from support.marks import needs_cpu_fsdp
from support.ranks import mid_epoch_worker

pytestmark = [pytest.mark.multirank,
              pytest.mark.skipif(NATIVE, reason="the shim's data cursor: native Lightning is not patched")]
BATCH = 4  # mid_epoch_worker's batch size


def _run(out: Path, *args, nproc: int, ckpt: Path = None) -> str:
    resume = ("--ckpt-path", ckpt) if ckpt else ()
    return mid_epoch_worker("--out", out / "out", "--ckpt-dir", out / "ckpt", *args, *resume, nproc=nproc)


def _steps(out: Path, ranks: int):
    """Every rank's records of its training steps: [global_step, epoch, batch_idx, indices]."""
    return [json.loads((out / "out" / f"trained_rank{rank}.json").read_text()) for rank in range(ranks)]


def _indices(steps, epoch: int, before_step: float = float("inf")):
    return [i for rank in steps for step, e, _, batch in rank if e == epoch and step < before_step for i in batch]


def _assert_rest_of_epoch(trained_before, resumed_steps, size: int, ranks: int, drop_last: bool = False):
    """The resumed ranks' epoch 0 trains the samples not trained before, each once (fewer than ``ranks`` repeats of
    untrained samples as padding; with ``drop_last``, fewer than a batch a rank left out), in equal step counts."""
    assert len(trained_before) == len(set(trained_before)), "the saving run trained a sample twice before the save"
    untrained = set(range(size)) - set(trained_before)
    rest = _indices(resumed_steps, 0)
    counts = Counter(rest)
    assert not set(counts) & set(trained_before), "a sample trained before the checkpoint was trained again"
    if drop_last:
        assert max(counts.values()) == 1
        assert len(untrained - set(counts)) < ranks * BATCH + ranks
    else:
        assert set(counts) == untrained, f"never trained: {sorted(untrained - set(counts))}"
        assert sum(counts.values()) - len(untrained) < ranks, f"repeated as padding: {counts.most_common(3)}"
    steps = [len([s for s in rank if s[1] == 0]) for rank in resumed_steps]
    assert len(set(steps)) == 1, f"steps in the resumed epoch by rank: {steps}"


def _assert_next_epoch_is_the_samplers(resumed_steps, size: int, ranks: int, shuffle: bool, seed: int = 0) -> None:
    import torch

    dataset = range(size)
    for rank, steps in enumerate(resumed_steps):
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=ranks, rank=rank, shuffle=shuffle, seed=seed)
        sampler.set_epoch(1)
        assert [i for step in steps if step[1] == 1 for i in step[3]] == list(sampler), f"epoch 1 on rank {rank}"


def _assert_steps_go_on(resumed_steps, first_step: int) -> None:
    for steps in resumed_steps:
        assert [s[0] for s in steps] == list(range(first_step, first_step + len(steps)))


@needs_cpu_fsdp
def test_fsdp_sharded_from_two_ranks_goes_on_with_the_untrained_samples_on_one_three_and_four(tmp_path):
    """50 samples shuffled by Lightning's DistributedSampler, saved after step 2 of 7 by 2 ranks (16 trained):
    on 1 rank the other 34 in 9 batches, on 3 ranks 34 padded to 36 (2 repeats), on 4 ranks 34 padded to 36."""
    args = ["--samples", "50", "--every", "2", "--max-epochs", "2", "--state-dict-type", "sharded"]
    _run(tmp_path / "ref", *args, nproc=2)
    trained_before = _indices(_steps(tmp_path / "ref", 2), 0, before_step=2)
    for ranks in (1, 3, 4):
        out = tmp_path / f"on{ranks}"
        _run(out, *args, nproc=ranks, ckpt=tmp_path / "ref" / "ckpt" / "step=2.ckpt")
        steps = _steps(out, ranks)
        _assert_rest_of_epoch(trained_before, steps, 50, ranks)
        _assert_next_epoch_is_the_samplers(steps, 50, ranks, shuffle=True)
        _assert_steps_go_on(steps, 2)


@needs_cpu_fsdp
def test_fsdp_full_chain_two_three_one_with_drop_last_trains_no_sample_twice(tmp_path):
    """The user's own DistributedSampler (seed 3, ``drop_last``) in a DataLoader with ``drop_last``, 50 samples:
    saved by 2 ranks after step 2, resumed on 3 ranks which save after their first step, then on 1: across the three
    runs no sample of epoch 0 is trained twice and fewer than a batch a rank (and the sampler's cut) are left out."""
    args = ["--samples", "50", "--max-epochs", "1", "--state-dict-type", "full", "--wrap", "root",
            "--data", "user-distributed", "--sampler-drop-last", "--loader-drop-last"]
    _run(tmp_path / "two", *args, "--every", "2", nproc=2)
    _run(tmp_path / "three", *args, "--every", "1", nproc=3, ckpt=tmp_path / "two" / "ckpt" / "step=2.ckpt")
    _run(tmp_path / "one", *args, "--every", "1", nproc=1, ckpt=tmp_path / "three" / "ckpt" / "step=3.ckpt")
    trained_before = _indices(_steps(tmp_path / "two", 2), 0, before_step=2)
    trained_before += _indices(_steps(tmp_path / "three", 3), 0, before_step=3)
    steps = _steps(tmp_path / "one", 1)
    _assert_rest_of_epoch(trained_before, steps, 50, 1, drop_last=True)
    _assert_steps_go_on(steps, 3)


@pytest.mark.parametrize("saved_on, size", [(4, 47), (3, 50)])
def test_ddp_from_more_ranks_goes_on_with_the_untrained_samples_on_two(tmp_path, saved_on, size):
    """The user's DistributedSampler without shuffling (Lightning's always shuffles training data), a dataset size
    neither rank count divides: saved after step 2 by 4 (or 3) DDP ranks, resumed on 2."""
    args = ["--strategy", "ddp", "--samples", size, "--every", "2", "--max-epochs", "2", "--data", "user-distributed",
            "--no-shuffle"]
    _run(tmp_path / "ref", *args, nproc=saved_on)
    out = tmp_path / "on2"
    _run(out, *args, nproc=2, ckpt=tmp_path / "ref" / "ckpt" / "step=2.ckpt")
    steps = _steps(out, 2)
    _assert_rest_of_epoch(_indices(_steps(tmp_path / "ref", saved_on), 0, before_step=2), steps, size, 2)
    _assert_next_epoch_is_the_samplers(steps, size, 2, shuffle=False, seed=3)
    _assert_steps_go_on(steps, 2)


def test_data_without_a_cursor_is_refused_on_another_rank_count_unless_approximate_is_asked_for(tmp_path):
    """An IterableDataset (each rank its share of a stream) saved inside epoch 0 by 2 DDP ranks cannot be placed on
    3: refused on every rank, naming the loader and both rank counts; with ``other_rank_counts="approximate"`` the
    run goes on, and rank 0 says once what it does."""
    args = ["--strategy", "ddp", "--data", "iterable", "--every", "2", "--max-epochs", "1"]
    _run(tmp_path / "ref", *args, nproc=2)
    ckpt = tmp_path / "ref" / "ckpt" / "step=2.ckpt"
    # each rank raises by itself: the first to fail does not take the others down before they do (one left waiting
    # for the others in a collective would be stopped after the grace, and its error missing)
    mid_epoch_worker("--out", tmp_path / "refused" / "out", "--ckpt-dir", tmp_path / "refused" / "ckpt", *args,
                     "--ckpt-path", ckpt, nproc=3, expect_failure=True, grace=30)
    for rank in range(3):
        error = (tmp_path / "refused" / "out" / f"error_rank{rank}.txt").read_text()
        assert ("ValueError: The checkpoint was taken inside epoch 0 (after batch 2) by 2 ranks and is resumed on 3,"
                " but its train dataloader (DataLoader) cannot be placed exactly") in error
    output = _run(tmp_path / "approximate", *args, "--other-rank-counts", "approximate", nproc=3, ckpt=ckpt)
    assert output.count("is resumed on 3 (other_rank_counts='approximate'): each rank leaves out the 2 batches") == 1
    assert all(steps[0][0] == 2 for steps in _steps(tmp_path / "approximate", 3))
