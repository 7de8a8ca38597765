"""Real multi-rank FSDP runs: 2 ranks under torchrun, gloo on the CPU, the Trainer doing the work.

Each test names one promised behaviour. Reference runs train 3 epochs and checkpoint every epoch;
resumed runs start in new processes from the checkpoint after epoch 1 (``epoch=1.ckpt``).
"""
import re
from pathlib import Path

import pytest
import torch

from support.flavours import NATIVE, VERSION
from support.marks import needs_cpu_fsdp, raising, skip_without_optimizer_state
from support.ranks import EPOCHS, FULL_USE_ORIG_PARAMS, MID, config, worker
from support.states import DIFFER, assert_identical, assert_ranks_identical, clean, differences, info, load

pytestmark = [pytest.mark.multirank, needs_cpu_fsdp]


def _resume_matches_uninterrupted(reference, tmp_path: Path, key) -> Path:
    """Resume ``key``'s checkpoint after epoch 1 in new processes; restored and final states must be
    bit-identical to the uninterrupted run's. Returns the resumed run's directory."""
    skip_without_optimizer_state(key[1])
    ref = reference(*key)
    worker(tmp_path, *config(tmp_path, *key), "--max-epochs", EPOCHS, "--ckpt-path", ref / "ckpt" / MID)
    assert_ranks_identical(ref / "out", "epoch1", tmp_path / "out", "start")
    assert_ranks_identical(ref / "out", "final", tmp_path / "out", "final")
    return tmp_path


# How FSDP is wrapped: an FSDP unit per nn.Sequential (the head in the root unit), or Lightning's default, no
# auto_wrap_policy, where the root unit holds every weight in one flat parameter
WRAPPINGS = ["policy", "root"]


@pytest.mark.parametrize("wrap", WRAPPINGS)
@pytest.mark.parametrize("use_orig_params", [pytest.param(0, marks=pytest.mark.smoke), 1])
def test_sharded_resume_is_bit_exact(reference, tmp_path, use_orig_params, wrap):
    resumed = _resume_matches_uninterrupted(reference, tmp_path, ("sharded", use_orig_params, 1, wrap))
    assert (reference("sharded", use_orig_params, wrap=wrap) / "ckpt" / MID).is_dir()
    assert info(resumed / "out", "start")["epoch"] == 2


def test_a_torchrun_launch_resumes_the_same_as_the_rank_server(reference, tmp_path):
    """The suite forks its ranks from a process that has already imported Lightning (rank_server.py);
    a resume launched by torchrun itself restores and ends exactly as the forked runs do."""
    ref = reference("sharded", 0)
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--max-epochs", EPOCHS, "--ckpt-path", ref / "ckpt" / MID,
           by_torchrun=True)
    assert_ranks_identical(ref / "out", "epoch1", tmp_path / "out", "start")
    assert_ranks_identical(ref / "out", "final", tmp_path / "out", "final")


@pytest.mark.parametrize("wrap", WRAPPINGS)
@pytest.mark.parametrize("use_orig_params", [pytest.param(0, marks=pytest.mark.smoke), 1])
def test_full_resume_is_bit_exact(reference, tmp_path, use_orig_params, wrap):
    if NATIVE and not use_orig_params:
        pytest.skip(f"native Lightning {VERSION} cannot save a full checkpoint with use_orig_params=False")
    _resume_matches_uninterrupted(reference, tmp_path, ("full", use_orig_params, 1, wrap))
    assert (reference("full", use_orig_params, wrap=wrap) / "ckpt" / MID).is_file()


KEEPS_NO_RANK_STATES = pytest.mark.xfail(
    NATIVE, strict=True, raises=raising(AssertionError, DIFFER),
    reason="native Lightning keeps no rank's RNG states, and one copy of buffers: the resumed states differ")


def _every_rank_resumes(tmp_path: Path, state_dict_type: str, net: str, wrap: str, *args) -> None:
    use_orig_params = FULL_USE_ORIG_PARAMS if state_dict_type == "full" else 0
    skip_without_optimizer_state(use_orig_params)
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    worker(ref, *config(ref, state_dict_type, use_orig_params, wrap=wrap), "--max-epochs", EPOCHS, "--net", net, *args)
    worker(resumed, *config(resumed, state_dict_type, use_orig_params, wrap=wrap), "--max-epochs", EPOCHS, "--net", net,
           "--ckpt-path", ref / "ckpt" / MID, *args)
    if net == "buffered":
        saved = [load(ref / "out" / f"epoch1_rank{rank}.pt")["buffers"] for rank in (0, 1)]
        assert any(name.endswith("running_mean") and stat.abs().sum() > 0 for name, stat in saved[0].items()), saved[0]
        assert differences(saved[0], saved[1]), "the ranks' running statistics should differ: each sees its own batches"
    assert_ranks_identical(ref / "out", "epoch1", resumed / "out", "start")
    assert_ranks_identical(ref / "out", "final", resumed / "out", "final")


@KEEPS_NO_RANK_STATES
@pytest.mark.parametrize("net, wrap", [("buffered", "policy"), ("buffered", "root"), ("dropout", "policy")])
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_every_rank_resumes_its_own_buffers_and_random_state(tmp_path, state_dict_type, net, wrap):
    """BatchNorm's running statistics are buffers that FSDP does not synchronise: each rank's are its own.
    Dropout's masks come from each rank's random number generator. The checkpoint holds both per rank, and
    every rank's weights, buffers and optimizer state after the resume equal the uninterrupted run's. With the root
    unit alone, the buffers are the root unit's, beside its one flat parameter."""
    _every_rank_resumes(tmp_path, state_dict_type, net, wrap)


@KEEPS_NO_RANK_STATES
def test_a_subclass_of_the_strategy_resumes_every_ranks_buffers_and_random_state(tmp_path):
    """A user's subclass of FSDPStrategy whose own save_checkpoint and load_checkpoint call the strategy's keeps and
    restores every rank's states as FSDPStrategy itself does."""
    _every_rank_resumes(tmp_path, "sharded", "buffered", "policy", "--strategy", "own-fsdp")


@pytest.mark.skipif(NATIVE, reason="native Lightning reads no sharded directory outside FSDP")
def test_a_checkpoint_keeps_rank_zeros_buffers_for_every_other_reader(tmp_path):
    """The model's own copy of a rank-local buffer, which consolidate, load_from_checkpoint and native Lightning
    read, is rank 0's, in a sharded checkpoint as in a full one."""
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--max-epochs", 2, "--net", "buffered")
    from support.trainer_worker import BufferedNet

    model = BufferedNet.load_from_checkpoint(tmp_path / "ckpt" / "epoch=1.ckpt")
    rank0 = load(tmp_path / "out" / "final_rank0.pt")["buffers"]
    mine = {name: value for name, value in model.named_buffers()}
    assert_identical({clean(name): value for name, value in rank0.items()}, mine, "rank 0's buffers")


@pytest.mark.parametrize("state_dict_type,use_orig_params", [("sharded", 0), ("full", 1)])
def test_two_optimizers_resume_bit_exact(reference, tmp_path, state_dict_type, use_orig_params):
    resumed = _resume_matches_uninterrupted(reference, tmp_path, (state_dict_type, use_orig_params, 2))
    assert info(resumed / "out", "start")["optimizers"] == 2


@pytest.mark.parametrize("fn", ["validate", "test", "predict"])
def test_validate_test_predict_load_weights_only_from_sharded(reference, tmp_path, fn):
    ref = reference("sharded", 0)
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--fn", fn, "--ckpt-path", ref / "ckpt" / MID)
    expected = load(ref / "out" / "full_epoch1.pt")["params"]
    assert_identical(expected, load(tmp_path / "out" / f"full_{fn}.pt")["params"], f"weights at {fn}")
    assert info(tmp_path / "out", fn)["optimizers"] == 0


def test_checkpoints_use_the_lightning_module_names(reference):
    """No ``_forward_module.`` prefix: full and sharded checkpoints name parameters as the LightningModule does."""
    import torch.distributed.checkpoint as dcp

    full_run = reference("full", FULL_USE_ORIG_PARAMS)
    expected = set(load(full_run / "out" / "full_epoch1.pt")["params"])
    full = load(full_run / "ckpt" / MID)
    assert set(full["state_dict"]) == expected
    stored = dcp.FileSystemReader(str(reference("sharded", 0) / "ckpt" / MID)).read_metadata().state_dict_metadata
    model_keys = {k[len("model."):] for k in stored if k.startswith("model.")}
    assert model_keys == expected
    optimizer_keys = {k for k in stored if k.startswith("optimizer_0.state.")}
    assert optimizer_keys and all(any(k.startswith(f"optimizer_0.state.{n}.") for n in expected) for k in optimizer_keys)
    assert not any("_forward_module" in k for k in stored)


def test_full_checkpoint_opens_without_fsdp(reference, monkeypatch):
    """Full checkpoint -> LightningModule.load_from_checkpoint on one CPU, optimizer state in PyTorch's format."""
    from support.trainer_worker import Net

    # Lightning 2.0.x's loader predates torch 2.6's weights_only default; checkpoints are trusted files.
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    ref = reference("full", FULL_USE_ORIG_PARAMS)
    path = ref / "ckpt" / MID
    expected = load(ref / "out" / "full_epoch1.pt")
    model = Net.load_from_checkpoint(path)
    assert_identical(expected["params"], {n: p.detach() for n, p in model.named_parameters()}, "weights")

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer.load_state_dict(load(path)["optimizer_states"][0])
    names = [n for n, _ in model.named_parameters()]
    by_name = {names[i]: state for i, state in optimizer.state_dict()["state"].items()}
    assert_identical(expected["optim"][0], by_name, "optimizer state")


def test_resume_under_fsdp_from_single_device_checkpoint(tmp_path):
    single = tmp_path / "single"
    worker(single, "--out", single / "out", "--ckpt-dir", single / "ckpt", "--max-epochs", 2, nproc=0)
    fsdp = tmp_path / "fsdp"
    worker(fsdp, *config(fsdp, "sharded", FULL_USE_ORIG_PARAMS), "--max-epochs", 3, "--ckpt-path", single / "ckpt" / MID)
    expected = load(single / "out" / "full_epoch1.pt")
    restored = load(fsdp / "out" / "full_start.pt")
    assert_identical(expected["params"], restored["params"], "weights")
    assert_identical(expected["optim"], restored["optim"], "optimizer state")
    assert info(fsdp / "out", "final")["epoch"] == 3


def test_top_k_and_last_with_sharded_checkpoints(tmp_path):
    first = tmp_path / "first"
    worker(first, *config(first, "sharded", 0), "--max-epochs", 4, "--top-k", 2)
    kept = sorted(p.name for p in (first / "ckpt").iterdir())
    assert kept == ["epoch=2.ckpt", "epoch=3.ckpt", "last.ckpt"]
    assert all((first / "ckpt" / name / "meta.pt").is_file() for name in kept)

    second = tmp_path / "second"
    worker(second, *config(second, "sharded", 0), "--max-epochs", 5, "--top-k", 2, "--ckpt-path", "last",
           "--ckpt-dir", first / "ckpt")
    assert info(second / "out", "start")["epoch"] == 4
    assert_ranks_identical(first / "out", "epoch3", second / "out", "start")


def test_optimizer_count_mismatch_is_refused(reference, tmp_path):
    if NATIVE:
        pytest.skip(f"native Lightning {VERSION} does not check the optimizer count of a sharded checkpoint")
    ref = reference("sharded", 0)
    output = worker(tmp_path, *config(tmp_path, "sharded", 0, 2), "--ckpt-path", ref / "ckpt" / MID, expect_failure=True)
    assert re.search(r"RuntimeError: You have configured 2 optimizers but the checkpoint contains 1 optimizers to load\. .*\(Checkpoint: '.*'\.\)", output)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_full_state_is_returned_on_rank_zero_only(reference, state_dict_type):
    """As native Lightning: with "full", ``lightning_module_state_dict()`` and ``optimizer_state()`` return ``{}``
    on every rank but 0, which alone writes the file; with "sharded", every rank returns its shards."""
    import json

    use_orig_params = FULL_USE_ORIG_PARAMS if state_dict_type == "full" else 0
    out = reference(state_dict_type, use_orig_params) / "out"
    counts = [json.loads((out / f"saved_entries_rank{rank}.json").read_text()) for rank in (0, 1)]
    names = len(load(out / "full_final.pt")["params"])
    assert counts[0]["model"] == names
    assert counts[1]["model"] == (0 if state_dict_type == "full" else names)
    if "optimizers" in counts[0]:  # torch 2.2 cannot gather optimizer state with use_orig_params on the CPU
        assert counts[0]["optimizers"] == [2]  # "state" and "param_groups"
        assert counts[1]["optimizers"] == [0 if state_dict_type == "full" else 2]
