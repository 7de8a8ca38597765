"""Saves in the background with real ranks: ``Trainer(plugins=[AsyncCheckpointIO()])`` and Fabric's
``FSDPStrategy(async_save=True)``, two ranks.

The workers log each step of their saves (``support.faults.trace_saves``) and start every write late, so that
training goes on while a save writes: a checkpoint that held a later step's state, a removal before its
replacement is in place, or a save that did not wait for the one before it shows in the checkpoints and the log.
A write in the background is held until its save has returned: a save that waits for its write logs its return last.
"""
import re
import sys
from pathlib import Path

import pytest

from lightning_fsdp_resume._commands._verify_command import verify
from support.crash_chain import run_chain
from support.flavours import NATIVE, VERSION
from support.marks import TORCH, needs_async_save, needs_cpu_fsdp, needs_patched_fabric
from support.ranks import EPOCHS, FULL_USE_ORIG_PARAMS, config, fabric_config, fabric_worker, worker
from support.states import assert_identical, assert_ranks_identical
from support.stores import LocalStore

pytestmark = [
    pytest.mark.multirank,
    needs_cpu_fsdp,
    pytest.mark.skipif(NATIVE, reason=f"native Lightning {VERSION} saves FSDP checkpoints in the foreground"),
]
DELAY = "0.5"  # seconds each write starts late


def _saves(run: Path, rank: int = 0):
    return (run / "out" / f"saves_rank{rank}.txt").read_text().splitlines()


def _async_run(run: Path, kind: str, *args, wrap: str = "policy") -> None:
    worker(run, *config(run, kind, FULL_USE_ORIG_PARAMS if kind == "full" else 0, wrap=wrap), "--max-epochs", EPOCHS,
           "--async-save", "--trace-saves", DELAY, *args)


@needs_async_save
@pytest.mark.parametrize("kind, wrap", [pytest.param("sharded", "policy", marks=pytest.mark.smoke), ("full", "policy"),
                                        ("sharded", "root")])  # root: no auto_wrap_policy, one flat parameter
def test_background_saves_hold_the_state_at_the_call_and_resume_exactly(tmp_path, kind, wrap):
    # BatchNorm's running statistics: buffers that a sharded state dict hands over as they are, not copied
    run, resumed = tmp_path / "async", tmp_path / "resumed"
    _async_run(run, kind, "--net", "buffered", wrap=wrap)
    # epoch=0.ckpt was written while epoch 1 trained: it must hold epoch 0's end, which the run recorded there
    worker(resumed, *config(resumed, kind, FULL_USE_ORIG_PARAMS if kind == "full" else 0, wrap=wrap), "--net", "buffered",
           "--max-epochs", EPOCHS, "--ckpt-path", run / "ckpt" / "epoch=0.ckpt")
    assert_ranks_identical(run / "out", "epoch0", resumed / "out", "start")
    assert_ranks_identical(run / "out", "final", resumed / "out", "final")
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == [f"epoch={epoch}.ckpt" for epoch in range(EPOCHS)]
    for epoch in range(EPOCHS if not NATIVE else 0):  # every byte hashed as the background thread wrote it
        assert verify(str(run / "ckpt" / f"epoch={epoch}.ckpt"), progress=False).files >= (4 if kind == "sharded" else 1)
    if kind == "sharded":  # every save, the first included, copied into host memory made before it, in a thread
        for rank in (0, 1):
            saves = _saves(run, rank)
            buffers = [line for line in saves if line.startswith("host-buffer")]
            assert buffers and set(buffers) == {"host-buffer prepared"}, buffers
            # and the background threads' process group made with them, after the first step, not by the first save
            assert saves.count("process-group made") == 1, saves
            assert saves.index("process-group made") < saves.index("save-called epoch=0.ckpt"), saves


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread has a CPU priority of its own on Linux alone")
def test_a_save_in_the_background_is_written_at_the_lowest_cpu_priority_and_training_keeps_its_own(tmp_path):
    import os
    import threading
    import types

    from lightning_fsdp_resume._save_load import _background

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    strategy, seen = types.SimpleNamespace(global_rank=0), {}
    training = priority()
    _background.start(strategy, tmp_path, lambda: seen.update(write=priority()), lambda: seen.update(publish=priority()))
    _background.wait(strategy)
    assert seen == {"write": 19, "publish": 19}
    assert priority() == training


@needs_async_save
def test_each_save_returns_before_it_is_written_and_the_next_one_waits_for_it(tmp_path):
    _async_run(tmp_path, "sharded")
    for rank in (0, 1):
        saves = _saves(tmp_path, rank)
        # returned while its write was held (the write is logged once its save has returned, or after HOLD_S where the
        # save waits for it): a save that wrote in the foreground or waited for its write logs its return after it
        for epoch in range(EPOCHS):
            name = f"epoch={epoch}.ckpt"
            assert saves.index(f"save-returned {name}") < saves.index("write", saves.index(f"save-called {name}")), saves
    saves = _saves(tmp_path, 0)
    # the next save waits: writes and publishes alternate, every write's checkpoint is in place before the next starts
    steps = [line for line in saves if line == "write" or line.startswith("publish")]
    assert steps == [step for epoch in range(EPOCHS) for step in ("write", f"publish epoch={epoch}.ckpt")], saves
    # fit returns once the last one is in place
    assert saves[-2:] == [f"publish epoch={EPOCHS - 1}.ckpt", "fit-returned"], saves


@needs_async_save
def test_model_checkpoint_removes_a_checkpoint_only_once_its_replacement_is_in_place(reference, tmp_path):
    _async_run(tmp_path, "sharded", "--top-k", "1")
    saves = _saves(tmp_path, 0)
    removed = [line for line in saves if line.startswith("remove")]
    assert removed == [f"remove epoch={epoch}.ckpt" for epoch in range(EPOCHS - 1)], saves
    for epoch in range(EPOCHS - 1):
        # ModelCheckpoint asked for the removal right after the next save returned, before it was written
        assert saves.index(f"publish epoch={epoch + 1}.ckpt") < saves.index(f"remove epoch={epoch}.ckpt"), saves
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"epoch={EPOCHS - 1}.ckpt", "last.ckpt"]
    resumed = tmp_path / "resumed"
    worker(resumed, *config(resumed, "sharded", 0), "--max-epochs", EPOCHS + 1, "--ckpt-path", tmp_path / "ckpt" / "last.ckpt")
    assert_ranks_identical(reference("sharded", 0) / "out", f"epoch{EPOCHS - 1}", resumed / "out", "start")


@needs_async_save
@pytest.mark.parametrize("save, where", [(2, "_sharded_destination"), (3, "teardown")])  # raised at the next save, or at the end
def test_a_failed_background_write_is_raised_on_every_rank_and_publishes_nothing(tmp_path, save, where):
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--max-epochs", EPOCHS, "--async-save", "--fail", f"mid-shards:1:{save}")
    message = (rf"BackgroundSaveError: The checkpoint '[^']*epoch={save - 1}\.ckpt', saved in the background, could not be"
               r" written: .*No space left on device \(injected by the test\) \(on rank 1\)\. Nothing of this save was published")
    for rank in (0, 1):
        error = (tmp_path / "out" / f"error_rank{rank}.txt").read_text()
        assert re.search(message, error), error
        assert re.search(rf"in {where}\n.*_background\.wait\(", error), error
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("epoch=*")) == [f"epoch={e}.ckpt" for e in range(save - 1)]


@needs_async_save
def test_killed_background_writes_leave_the_previous_checkpoint_loadable(reference, tmp_path):
    trials = [("mid-shards", 1), ("mid-shards", 0), ("before-publish", 0), ("after-publish", 0)]
    store = LocalStore(tmp_path / "ckpt")
    assert run_chain(reference, tmp_path, store, "sharded", 0, trials, first_save_killed=True, extra=["--async-save"]) == 4


@pytest.mark.skipif(TORCH >= (2, 3), reason="this torch saves in the background")
def test_without_async_save_saves_are_written_in_the_foreground_and_said_so(reference, tmp_path):
    output = worker(tmp_path, *config(tmp_path, "sharded", 0), "--max-epochs", EPOCHS, "--async-save",
                    "--trace-saves", "0")
    assert "FSDP checkpoints are saved in the foreground: saving them in the background needs torch >= 2.3" in output
    saves = _saves(tmp_path, 0)
    for epoch in range(EPOCHS):
        name = f"epoch={epoch}.ckpt"
        assert saves.index(f"publish {name}") < saves.index(f"save-returned {name}"), saves
    assert_ranks_identical(reference("sharded", 0) / "out", "final", tmp_path / "out", "final")


@needs_async_save
@needs_patched_fabric
def test_fabric_saves_in_the_background_with_async_save_and_resumes_exactly(tmp_path):
    run, resumed = tmp_path / "async", tmp_path / "resumed"
    # each rank's buffers differ (batch normalisation): RankStates saves them, as Fabric users do
    fabric_worker(run, *fabric_config(run, "sharded"), "--epochs", EPOCHS, "--net", "buffered", "--rank-states",
                  "--async-save", "--trace-saves", DELAY)
    saves = _saves(run)
    for epoch in range(EPOCHS):
        name = f"epoch={epoch}.ckpt"
        assert saves.index(f"save-returned {name}") < saves.index(f"publish {name}"), saves
    # the flat shards and optimizer states had host memory made after the first step (the module's own buffers, which
    # Fabric's strategy cannot see from an optimizer step, are made by the first save)
    assert "host-buffer prepared" in saves, saves
    # the last save was in place before the script ended: wait_for_saves
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == [f"epoch={epoch}.ckpt" for epoch in range(EPOCHS)]
    fabric_worker(resumed, *fabric_config(resumed, "sharded"), "--epochs", EPOCHS, "--net", "buffered", "--rank-states",
                  "--resume", run / "ckpt" / "epoch=1.ckpt")
    assert_ranks_identical(run / "out", "epoch1", resumed / "out", "start")
    assert_ranks_identical(run / "out", "final", resumed / "out", "final")


def test_a_later_save_in_the_background_copies_into_the_host_tensors_of_the_last_one(process_group):
    """A later save's stall is its copy: the same views of the shards (``_shard_views``) are copied into the same kept
    host buffers, whose host ``ShardedTensor``s serve again; what they hold is the state at that save, a copy that
    later steps leave as it is. Each shard lies over its own bytes of a buffer alone, so torch DCP writes it as it is
    (it copies a tensor whose storage holds more first)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_fsdp_resume._save_load import _background, _saving

    torch.manual_seed(0)
    model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters())
    staging = _background.Staging()

    def step() -> None:
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()

    def copied():
        staging.begin()
        live = _background.Live(_saving.training_tensors(model, [optimizer]))
        return _background.host_copy(_saving.model_state(model, "sharded", offload=False), live, staging)

    def values(state):
        return {name: value.local_shards()[0].tensor.clone() for name, value in state.items()}

    step()
    first = copied()
    step()
    expected = values(_saving.model_state(model, "sharded", offload=False))
    later = copied()
    assert all(later[name] is first[name] for name in first), "the host ShardedTensors were built again"
    buffers = [(buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes) for buffer in staging.this_save.values()]
    for name, value in later.items():
        shard = value.local_shards()[0].tensor
        assert shard.untyped_storage().nbytes() == shard.numel() * shard.element_size(), f"{name}: a storage with more"
        assert any(start <= shard.data_ptr() < end for start, end in buffers), f"{name}: not in a kept buffer"
    assert_identical(expected, values(later), "the later save's copy")
    step()
    assert_identical(expected, values(later), "the copy after another step")
    assert any(not torch.equal(expected[name], now) for name, now in values(_saving.model_state(model, "sharded", offload=False)).items())


def test_the_first_save_in_the_background_finds_what_later_saves_reuse_built_ahead(process_group):
    """After an optimizer's first step a thread makes the host buffers and builds, in them, what every save reuses
    (the views of the shards and their host ``ShardedTensor``s, ``_background.prepare``), so that the first save's
    stall is its copy alone, as a later one's: that save returns those very tensors, holding the state at the save;
    a state the thread cannot build leaves the buffers made and the save building it."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from lightning_fsdp_resume._save_load import _background, _saving, _shard_views

    def cannot() -> None:
        raise _shard_views.UnknownLayout("not one built here")

    for ahead in ("views", "none"):
        torch.manual_seed(0)
        model = FSDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), device_id=torch.device("cpu"))
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        staging = _background.Staging()
        live = _background.Live(_saving.training_tensors(model, [optimizer]))
        staging.prepare(live, _shard_views.ahead(model, optimizer) if ahead == "views" else cannot)
        staging.preparing.join()
        built = {id(host) for _, host in staging.this_sharded.values()}
        assert len(staging.this_save) == len(live.storages), "a host buffer for each live storage"
        assert len(built) == (2 * 2 * 3 if ahead == "views" else 0), built  # 4 parameters, each with Adam's 2 states
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        state = {"model": _saving.model_state(model, "sharded", offload=False),
                 "optimizer": _saving.optimizer_state(model, optimizer, "sharded", offload=False)["state"]}
        expected = {name: value.local_shards()[0].tensor.clone() for name, value in state["model"].items()}
        staging.begin()
        copied = _background.host_copy(state, _background.Live(_saving.training_tensors(model, [optimizer])), staging)
        hosts = [*copied["model"].values(), *(value for values in copied["optimizer"].values()
                                             for key, value in values.items() if key != "step")]
        assert len(hosts) == 2 * 2 * 3
        assert all(host.local_shards()[0].tensor.device.type == "cpu" for host in hosts)
        assert {id(host) for host in hosts} == built or ahead == "none", "the first save built its host tensors again"
        assert_identical(expected, {name: value.local_shards()[0].tensor for name, value in copied["model"].items()},
                         "the first save's copy")
