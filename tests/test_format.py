"""The on-disk format helpers: pure functions, no processes."""
import pytest

from lightning_fsdp_resume._checkpoint import _format


def test_only_checkpoint_directories_may_be_replaced(tmp_path):
    assert _format.is_replaceable_directory(tmp_path)  # empty
    for name in ("meta.pt", ".metadata", "__0_0.distcp"):
        (tmp_path / name).write_bytes(b"x")
    assert _format.is_replaceable_directory(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    assert not _format.is_replaceable_directory(tmp_path)


def test_prefix_is_stripped_and_restored():
    state = {"_forward_module.a.weight": 1, "_forward_module.b": 2}
    stripped = _format.strip_prefix(state, "_forward_module.")
    assert stripped == {"a.weight": 1, "b": 2}
    assert _format.add_prefix(stripped, "_forward_module.") == state
    assert _format.strip_prefix(state, "") is state


def test_optimizer_prefix_covers_state_and_groups():
    state = {"state": {"p.a": {"s": 1}}, "param_groups": [{"lr": 1, "params": ["p.a", "p.b"]}]}
    stripped = _format.strip_optimizer_prefix(state, "p.")
    assert stripped == {"state": {"a": {"s": 1}}, "param_groups": [{"lr": 1, "params": ["a", "b"]}]}
    assert _format.add_optimizer_prefix(stripped, "p.") == state


def test_names_and_ids_round_trip_like_torch_numbering():
    named = {
        "state": {"head.w": {"m": 3}, "a.w": {"m": 1}},
        "param_groups": [{"lr": 1, "params": ["head.w"]}, {"lr": 2, "params": ["a.w", "a.b"]}],
    }
    groups = [["head.w"], ["a.w", "a.b"]]
    ids = _format.names_to_ids(named, groups)
    assert ids["state"] == {0: {"m": 3}, 1: {"m": 1}}
    assert [g["params"] for g in ids["param_groups"]] == [[0], [1, 2]]
    assert _format.is_id_keyed(ids) and not _format.is_id_keyed(named)
    assert _format.ids_to_names(ids, groups) == named


def test_id_keyed_state_that_does_not_fit_is_refused():
    ids = {"state": {}, "param_groups": [{"params": [0, 1]}]}
    with pytest.raises(ValueError, match=r"sizes \[2\], the optimizer \[3\]"):
        _format.ids_to_names(ids, [["a", "b", "c"]])


def test_empty_optimizer_state_is_id_keyed_when_its_groups_are():
    assert _format.is_id_keyed({"state": {}, "param_groups": [{"params": [0]}]})
    assert not _format.is_id_keyed({"state": {}, "param_groups": [{"params": ["a"]}]})


def test_flat_parameter_order_becomes_registration_order():
    # FSDP lists the root unit's parameters (a, head) before the nested unit's (b)
    names = ["a.weight", "a.bias", "head.weight", "b.0.weight"]
    modules = ["", "a", "b", "b.0", "b.1", "head"]
    assert _format.in_module_order(names, modules) == ["a.weight", "a.bias", "b.0.weight", "head.weight"]


def test_module_order_is_recovered_from_state_dict_keys():
    # Module.state_dict(): a module's own entries (the root's "scale") before its children's
    keys = ["scale", "a.weight", "a.bias", "b.0.weight", "b.0.running_mean", "b.1.weight", "head.weight"]
    modules = _format.modules_in_state_dict_order(keys)
    assert modules == ["", "a", "b.0", "b.1", "head"]
    # the flat-parameter order of a sharded checkpoint's group becomes the module's order
    assert _format.in_module_order(["head.weight", "b.1.weight", "a.weight", "b.0.weight"], modules) == [
        "a.weight", "b.0.weight", "b.1.weight", "head.weight"]


def test_module_names_lose_their_wrapper_segments():
    assert _format.clean_module_name("_fsdp_wrapped_module._forward_module.b._fsdp_wrapped_module.0") == "_forward_module.b.0"
    assert _format.clean_module_name("_fsdp_wrapped_module") == ""


def test_saved_optimizers_are_counted_from_storage_keys():
    keys = ["model.a", "optimizer_0.state.a.exp_avg", "optimizer_0.param_groups", "optimizer_1.state.b.m"]
    assert _format.count_saved_optimizers(keys) == 2
    assert _format.count_saved_optimizers(["model.a"]) == 0


VERSION_KEY = "pytorch-lightning_version"


@pytest.mark.parametrize("stored,meta,writer", [
    (["model", "optimizer_0", "optimizer_1"], ["epoch", "global_step", VERSION_KEY, "loops"], "trainer"),
    (["model"], ["epoch", VERSION_KEY], "trainer"),  # weights only
    (["net", "opt_a"], ["sched", "epoch", "step"], "fabric"),
    (["model", "optimizer_0"], ["epoch", "step"], "fabric"),  # a Fabric user's choice of the Trainer's keys
    (["model", "optimizer"], ["epoch", VERSION_KEY], "fabric"),  # not the Trainer's optimizer keys
])
def test_sharded_checkpoint_writer_needs_the_trainers_keys_and_its_version_entry(stored, meta, writer):
    assert _format.sharded_checkpoint_writer(stored, meta) == writer


@pytest.mark.parametrize("paths,optimizer", [
    ([("opt", "state", "body.0.weight", "exp_avg"), ("opt", "param_groups", 0, "lr")], True),
    ([("opt", "param_groups", 0, "lr"), ("opt", "param_groups", 0, "params")], True),  # never stepped
    ([("opt", "param_groups")], True),  # groups stored as one object
    ([("opt",)], True),  # torch 2.2: a never-stepped optimizer's state dict, no tensor in it, stored whole
    ([("net", "body.0.weight"), ("net", "state.weight"), ("net", "param_groups.bias")], False),
    ([("net", "state")], False),  # a parameter named "state"
])
def test_optimizer_entries_are_told_by_their_nested_paths(paths, optimizer):
    assert _format.is_optimizer_entry(paths) == optimizer
