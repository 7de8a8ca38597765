"""Sharded saves built from each rank's flat shards, gathering nothing, write checkpoints that every reader reads
exactly as it reads those FSDP's own builder writes: the same state, saved both ways by real 2-rank runs, is read
back whole and compared bit for bit, and training is the same either way. Where the layout is not one the package
knows, FSDP's builder is used, and a debug line says why.
"""
import logging

import pytest
import torch

from lightning_fsdp_resume._checkpoint import _whole_read
from lightning_fsdp_resume._patching import _torch_compat as compat
from lightning_fsdp_resume._patching._held import ModuleHeld, held
from lightning_fsdp_resume._save_load import _saving
from lightning_fsdp_resume._storage import checked, open_path
from support.flavours import NATIVE
from support.marks import needs_cpu_fsdp, skip_without_optimizer_state
from support.ranks import EPOCHS, config, fabric_config, fabric_worker, worker
from support.states import assert_identical, assert_ranks_identical

pytestmark = [needs_cpu_fsdp, pytest.mark.skipif(NATIVE, reason="native Lightning saves with FSDP's builder")]


def _read(checkpoint):
    return _whole_read.read_full_checkpoint(open_path(checkpoint, "load"))[0]


def _chunks(checkpoint):
    """Each stored tensor's rectangles, as ``.metadata`` lists them."""
    index = checked.index(open_path(checkpoint, "load"))
    return {key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            for key, entry in index.state_dict_metadata.items() if hasattr(entry, "chunks")}


def _weights(keys):
    """The stored weights' keys in their order, which readers number parameters by (an optimizer's states are found
    by name, and FSDP's builder lists them in an order of its own)."""
    return [key for key in keys if not key.partition(".")[2].startswith(("state.", "param_groups"))]


def _assert_same_reading(from_shards, fsdps, entries):
    """Both checkpoints read back the same ``entries`` and list their weights in the same order, though their shards are
    cut differently (so the one from the shards was not FSDP's builder's)."""
    ours, theirs = _read(from_shards), _read(fsdps)
    for entry in entries:
        assert_identical(theirs[entry], ours[entry], f"{entry!r} of {from_shards.name}")
    mine, fsdp = _chunks(from_shards), _chunks(fsdps)
    assert _weights(mine) == _weights(fsdp), "the index lists the weights in another order (readers number parameters by it)"
    assert any(mine[key] != fsdp[key] for key in mine), "the shards are cut as FSDP's builder cuts them"


@pytest.mark.multirank
@pytest.mark.parametrize("use_orig_params, wrap, net", [(0, "root", "buffered"), (1, "policy", "net")])
def test_a_trainer_save_from_the_shards_reads_back_as_fsdps_builder_writes_it(tmp_path, use_orig_params, wrap, net):
    skip_without_optimizer_state(use_orig_params)
    runs = {}
    for builder, flags in (("shards", []), ("fsdp", ["--fsdp-builder"])):
        root = runs[builder] = tmp_path / builder
        worker(root, *config(root, "sharded", use_orig_params, wrap=wrap), "--max-epochs", EPOCHS, "--net", net, *flags)
    for epoch in range(EPOCHS):
        name = f"epoch={epoch}.ckpt"
        _assert_same_reading(runs["shards"] / "ckpt" / name, runs["fsdp"] / "ckpt" / name, ["state_dict", "optimizer_states"])
    assert_ranks_identical(runs["fsdp"] / "out", "final", runs["shards"] / "out", "final")


@pytest.mark.multirank
def test_a_fabric_save_from_the_shards_reads_back_as_fsdps_builder_writes_it(tmp_path, fabric_reference):
    ref = fabric_reference("sharded")
    fabric_worker(tmp_path, *fabric_config(tmp_path, "sharded"), "--epochs", EPOCHS, "--fsdp-builder")
    saved = sorted(path.name for path in (ref / "ckpt").iterdir() if not path.name.startswith("."))
    assert saved
    for name in saved:
        ours = _read(ref / "ckpt" / name)
        _assert_same_reading(ref / "ckpt" / name, tmp_path / "ckpt" / name, list(ours))
    assert_ranks_identical(tmp_path / "out", "final", ref / "out", "final")


class _WithExtraState(torch.nn.Linear):
    """A linear layer with extra state, which the shard views leave to FSDP's builder."""

    def __init__(self) -> None:
        super().__init__(4, 3)

    def get_extra_state(self):
        return {"calls": 3}

    def set_extra_state(self, state) -> None:
        pass


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "NO_SHARD"])
def test_a_layout_the_package_does_not_know_is_saved_by_fsdps_builder(process_group, caplog, sharding):
    """A module with extra state, on one rank (where FSDP shards nothing: its NO_SHARD is one rank's shard all the
    same) under either sharding strategy."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(_WithExtraState(), torch.nn.Linear(3, 2)), device_id=torch.device("cpu"),
                 sharding_strategy=ShardingStrategy[sharding])
    with caplog.at_level(logging.DEBUG, logger=_saving.__name__):
        state = _saving.model_state(model, "sharded", offload=False)
    expected = compat.model_state_dict(model, full=False, offload=False)
    assert_identical({k: _whole(v) for k, v in expected.items()}, {k: _whole(v) for k, v in state.items()}, "the state")
    assert "FSDP builds this sharded state dict: module '0' has extra state" in caplog.text


def test_one_ranks_flat_parameters_are_saved_from_the_shards(process_group, caplog):
    """On one rank FSDP switches to NO_SHARD: the flat parameter is the rank's one shard, and is saved as it lies."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), device_id=torch.device("cpu"))
    with caplog.at_level(logging.DEBUG, logger=_saving.__name__):
        state = _saving.model_state(model, "sharded", offload=False)
    expected = compat.model_state_dict(model, full=False, offload=False)
    assert_identical({k: _whole(v) for k, v in expected.items()}, {k: _whole(v) for k, v in state.items()}, "the state")
    assert "FSDP builds this sharded state dict" not in caplog.text


def _whole(value):
    return value.local_shards()[0].tensor if hasattr(value, "local_shards") else getattr(value, "_local_tensor", value)


def test_a_later_save_builds_no_view_again_of_what_training_changes_in_place(process_group):
    """Building the views is most of what a later save in the background costs beside its copy: the same views of
    the same flat shards and optimizer states serve the next save, and show the values of that save; a state that
    training replaced (not changed in place) gets views of the new one, and the old ones are let go."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters())

    def step_and_build():
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        return (_saving.model_state(model, "sharded", offload=False),
                _saving.optimizer_state(model, optimizer, "sharded", offload=False)["state"])

    weights, states = step_and_build()
    later_weights, later_states = step_and_build()
    assert all(later_weights[name] is weights[name] for name in weights), "the weights' views were built again"
    assert all(later_states[name]["exp_avg"] is states[name]["exp_avg"] for name in states), "the states' were"
    expected = compat.model_state_dict(model, full=False, offload=False)  # FSDP's builder, after the second step
    assert_identical({k: _whole(v) for k, v in expected.items()}, {k: _whole(v) for k, v in later_weights.items()}, "the state")
    expected = compat.optimizer_state_dict(model, optimizer, full=False, offload=False)["state"]
    assert_identical({name: _whole(values["exp_avg"]) for name, values in expected.items()},
                     {name: _whole(values["exp_avg"]) for name, values in later_states.items()}, "the optimizer state")
    for values in optimizer.state.values():
        values["exp_avg"] = values["exp_avg"] + 1  # replaced: a new tensor, in new memory
    replaced = _saving.optimizer_state(model, optimizer, "sharded", offload=False)["state"]
    for name, values in replaced.items():
        assert values["exp_avg"] is not later_states[name]["exp_avg"], f"{name}: the replaced state's old views"
        assert values["exp_avg_sq"] is later_states[name]["exp_avg_sq"], f"{name}: the state changed in place"
    expected = compat.optimizer_state_dict(model, optimizer, full=False, offload=False)["state"]
    assert_identical({name: _whole(values["exp_avg"]) for name, values in expected.items()},
                     {name: _whole(values["exp_avg"]) for name, values in replaced.items()}, "the replaced state")
    views = [value for values in replaced.values() for value in values.values() if hasattr(value, "local_shards")]
    kept = held(model, ModuleHeld).optimizer_views[optimizer].values()  # what the next save may reuse
    assert sorted(map(id, kept)) == sorted(map(id, views)), "views of the replaced states are still held"
