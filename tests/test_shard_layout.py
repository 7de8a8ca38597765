"""Where a rank's shard of a flattened parameter lies in the parameter's full shape (no process group)."""
import math

import pytest
import torch

from lightning_fsdp_resume._save_load._shard_layout import boxes


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5), (2, 1, 3, 4)])
def test_boxes_hold_exactly_a_flat_range_in_order(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).view(shape)
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            pieces = [full[tuple(slice(o, o + s) for o, s in zip(at, size))].reshape(-1) for at, size in boxes(shape, start, stop)]
            held = torch.cat(pieces) if pieces else torch.empty(0, dtype=full.dtype)
            assert torch.equal(held, torch.arange(start, stop)), (shape, start, stop)


def test_boxes_of_whole_rows_are_one_rectangle():
    assert boxes((6, 4), 8, 20) == [((2, 0), (3, 4))]
