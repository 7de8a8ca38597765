"""Checkpoint participants (``_participants``): a state kept beside the weights plugs in by attaching to its module, and
what every save copies and every rank keeps finds it there, with no module naming it. One process, no process group."""
import pytest
import torch
from torch import nn

from lightning_fsdp_resume import _participants
from lightning_fsdp_resume._patching._held import ModuleHeld, drop, peek
from lightning_fsdp_resume._run_state import _rank_states
from lightning_fsdp_resume._save_load import _saving


class Counter(_participants.Participant):
    """A participant no module of the package knows: a count per rank and a tensor in the weights' place."""

    key, full_key, rank_key = "counter", "counter_state_dict", "counter_buffers"

    def __init__(self, module: nn.Module) -> None:
        self.total = torch.arange(4.0)
        self.seen = {f"{name}.seen": torch.full((1,), 7.0) for name, _ in module.named_modules() if name}

    def twice(self, module: nn.Module) -> str:
        return f"one Counter per {type(module).__name__}"

    def live_tensors(self):
        yield self.total

    def rank_tensors(self):
        return self.seen


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.register_buffer("steps", torch.zeros(1))


def test_one_participant_per_key_with_its_own_refusal_and_each_key_its_own():
    net = Net()
    first = Counter(net)
    _participants.attach(net, first)
    _participants.attach(net, first)  # the same one again: nothing changes
    with pytest.raises(ValueError, match="one Counter per Net"):
        _participants.attach(net, Counter(net))
    other = Counter(net)
    other.key = "another"
    _participants.attach(net, other)
    assert _participants.of(net) == [first, other]
    assert _participants.of(None) == [] and _participants.of(Net()) == []
    drop(net)
    assert peek(net, ModuleHeld) is None and _participants.of(net) == []


def test_a_background_save_copies_what_a_participant_changes_in_place():
    outer = nn.Sequential(Net())
    counter = Counter(outer[0])
    _participants.attach(outer[0], counter)  # attached below the root a strategy saves
    copied = {id(tensor) for tensor in _saving.training_tensors(outer, [])}
    assert id(counter.total) in copied
    assert {id(param) for param in outer.parameters()} <= copied


def test_every_rank_keeps_a_participants_rank_local_tensors_under_its_key_by_the_authors_names():
    net = Net()
    counter = Counter(net)
    _participants.attach(net, counter)
    state = _rank_states.capture(net)
    assert set(state) == {"rng", _rank_states.BUFFERS, "counter_buffers"}
    assert state["counter_buffers"].keys() == counter.seen.keys()
    assert all(torch.equal(state["counter_buffers"][name], value) for name, value in counter.seen.items())
    state["counter_buffers"]["layer.seen"] = torch.full((1,), 3.0)
    assert _rank_states.restore_buffers([state], net)
    assert torch.equal(counter.seen["layer.seen"], torch.full((1,), 3.0))  # read back into the participant's own
    drop(net)
    assert "counter_buffers" not in _rank_states.capture(net)
