"""A resumed epoch's data put back in place, in one process without Lightning: the code a resumed Trainer runs
(``_data_position.reposition``) on torch's own DataLoader, against the batches an uninterrupted epoch yields."""
import pytest
import torch

from lightning_fsdp_resume._run_state import _data_position


def _loader(workers: int = 0):
    data = torch.utils.data.TensorDataset(torch.arange(40))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=workers)


def _uninterrupted(at: int, workers: int = 0):
    """The epoch's batches, the position after ``at`` of them, and the random state right after batch ``at - 1``."""
    torch.manual_seed(3)
    loader = _loader(workers)
    position = _data_position.position(0, at, None, _data_position.epoch_start([loader]), [loader])
    batches = [batch[0].tolist() for batch in loader]
    return batches, position


@pytest.mark.parametrize("mode", ["skip", "replay"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_yields_the_rest_of_the_uninterrupted_one(mode, workers):
    batches, saved = _uninterrupted(6, workers)
    torch.manual_seed(99)  # the resumed process's own state, which the epoch's start replaces while it is placed
    before = torch.get_rng_state()
    loader, iterator = _loader(workers), []
    _data_position.set_mode(mode)
    try:
        how = _data_position.reposition([loader], saved, lambda: iterator.append(iter(loader)), lambda: next(iterator[0]))
    finally:
        _data_position.set_mode("skip")
    assert how == {"skip": "indices", "replay": "batches"}[mode]
    assert [batch[0].tolist() for batch in iterator[0]] == batches[6:]
    assert torch.equal(torch.get_rng_state(), before), "the random state after it is the one before it"


@pytest.mark.parametrize("mode", ["skip", "replay"])
def test_a_position_past_the_datas_end_is_refused_with_what_was_found(mode):
    _, saved = _uninterrupted(12)
    loader, iterator = _loader(), []
    _data_position.set_mode(mode)
    try:
        with pytest.raises(ValueError, match=r"taken after batch 12 of epoch 0, but the training data has 10 batches"):
            _data_position.reposition([loader], saved, lambda: iterator.append(iter(loader)), lambda: next(iterator[0]))
    finally:
        _data_position.set_mode("skip")


def test_an_unknown_mode_is_refused_naming_the_modes():
    import lightning_fsdp_resume

    with pytest.raises(ValueError, match=r"set_mid_epoch_resume\('fast'\): the mode is one of 'skip', 'replay', 'lightning'"):
        lightning_fsdp_resume.set_mid_epoch_resume("fast")
