"""Checkpoints across topologies: written on 2 ranks, resumed on 1 and on 3; and 2 torchrun "nodes" of one
rank each on the loopback interface.
"""
import pytest

from support.flavours import NATIVE
from support.marks import long_runs, needs_cpu_fsdp, skip_without_optimizer_state
from support.ranks import EPOCHS, FULL_USE_ORIG_PARAMS, MID, config, nodes, worker
from support.states import assert_identical, assert_ranks_identical, info, load

pytestmark = [pytest.mark.multirank, needs_cpu_fsdp]


# (ranks, wrap): with the root unit alone (Lightning's default), one flat parameter holds every weight, so a rank's
# shard begins and ends inside parameters, on 3 ranks inside rows
@pytest.mark.parametrize("ranks, wrap", [(1, "policy"), (3, "policy"), (3, "root")])
@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
def test_checkpoint_from_two_ranks_resumes_on_other_world_sizes(reference, tmp_path, state_dict_type, ranks, wrap):
    """Right after loading, the gathered weights and optimizer state equal the 2-rank run's at the checkpoint;
    each rank that saved gets its own RNG states and buffers back, a new rank keeps its own, and one warning says so."""
    use_orig_params = FULL_USE_ORIG_PARAMS if state_dict_type == "full" else 0
    skip_without_optimizer_state(use_orig_params)
    ref = reference(state_dict_type, use_orig_params, wrap=wrap)
    output = worker(tmp_path, *config(tmp_path, state_dict_type, use_orig_params, wrap=wrap), "--max-epochs", EPOCHS,
                    "--ckpt-path", ref / "ckpt" / MID, nproc=ranks)
    if not NATIVE:  # each rank's RNG states and buffers stay as they are, and it says so once
        assert output.count(f"was saved by 2 ranks and is resumed on {ranks}:") == 1, output[-3000:]
    expected = load(ref / "out" / "full_epoch1.pt")
    restored = load(tmp_path / "out" / "full_start.pt")
    assert_identical(expected["params"], restored["params"], f"weights on {ranks} ranks")
    assert_identical(expected["optim"], restored["optim"], f"optimizer state on {ranks} ranks")
    assert info(tmp_path / "out", "start")["epoch"] == 2


@long_runs
def test_two_nodes_save_once_and_resume_bit_exact(reference, tmp_path):
    """Two nodes of one rank: the same shards as one node of two ranks, meta.pt written by rank 0 only,
    and a resume where rank 1 names another path loads rank 0's."""
    ref = reference("sharded", 0)
    first = tmp_path / "first"
    nodes(first, *config(first, "sharded", 0), "--max-epochs", EPOCHS, "--trace-meta")
    for epoch in range(EPOCHS):
        assert_ranks_identical(ref / "out", f"epoch{epoch}", first / "out", f"epoch{epoch}")
    if not NATIVE:  # the trace hooks the shim's meta.pt writer
        writers = (first / "out" / "meta_writes.txt").read_text().splitlines()
        assert len(writers) == EPOCHS and all(line.startswith("0 ") for line in writers), writers

    second = tmp_path / "second"
    nodes(second, *config(second, "sharded", 0), "--max-epochs", EPOCHS, "--ckpt-path", first / "ckpt" / MID,
          "--other-ranks-ckpt-path", tmp_path / "elsewhere.ckpt")
    assert_ranks_identical(ref / "out", "epoch1", second / "out", "start")
    assert_ranks_identical(ref / "out", "final", second / "out", "final")
