"""Crash-safe saves and refused inputs, with real ranks: one rank SIGKILLed at chosen points of a save,
checkpoints of other models, weights-only checkpoints, ranks that disagree on the path.

The atomic saves are the shim's: native Lightning writes sharded checkpoints in place, so on native
Lightning these tests are skipped with that reason.
"""
import re
from pathlib import Path

import pytest

from support.crash_chain import run_chain
from support.flavours import NATIVE, VERSION
from support.marks import needs_cpu_fsdp
from support.ranks import FULL_USE_ORIG_PARAMS, config, worker
from support.states import assert_identical, assert_ranks_identical, file_hashes, load
from support.stores import LocalStore

pytestmark = [
    pytest.mark.multirank,
    needs_cpu_fsdp,
    pytest.mark.skipif(NATIVE, reason=f"native Lightning {VERSION} writes checkpoints in place and does not check them"
                                      " before loading; these are the shim's guarantees"),
]

# (kill point, rank): one rank is SIGKILLed there while a save overwrites last.ckpt. The first trial
# kills the very first save (there is no previous checkpoint); the last one kills after the new
# checkpoint is in place, before the replaced one is removed.
SHARDED_TRIALS = [
    ("mid-shards", 1),
    ("before-shards", 0),
    ("before-shards", 1),
    ("mid-shards", 0),
    ("mid-shards", 1),
    ("after-shards", 0),
    ("after-shards", 1),
    ("before-publish", 0),
    ("after-publish", 0),
]
FULL_TRIALS = [("mid-file", 0), ("before-publish", 0)]


def test_killed_sharded_saves_leave_the_previous_checkpoint_loadable(reference, tmp_path):
    store = LocalStore(tmp_path / "ckpt")
    assert run_chain(reference, tmp_path, store, "sharded", 0, SHARDED_TRIALS, first_save_killed=True) == 9


@pytest.mark.smoke
def test_killed_full_saves_leave_the_previous_checkpoint_loadable(reference, tmp_path):
    store = LocalStore(tmp_path / "ckpt")
    assert run_chain(reference, tmp_path, store, "full", FULL_USE_ORIG_PARAMS, FULL_TRIALS, first_save_killed=False) == 2


# --- refused inputs: every rank raises the same clear error, nothing is loaded, no file changes --------


def _refused(tmp_path: Path, ckpt: Path, *args, pattern: str) -> None:
    before = file_hashes(ckpt)
    output = worker(tmp_path, *config(tmp_path, "sharded", 0), "--ckpt-path", ckpt, *args, expect_failure=True)
    assert re.search(pattern, output), output[-4000:]
    assert str(ckpt) in output
    assert not list((tmp_path / "out").glob("*.pt")), "the run went on from a refused checkpoint"
    assert file_hashes(ckpt) == before


def test_checkpoint_of_a_wider_model_is_refused(reference, tmp_path):
    _refused(tmp_path, reference("sharded", 0) / "ckpt" / "epoch=1.ckpt", "--net", "wide",
             pattern=r"RuntimeError: The checkpoint .* does not fit this model\. Error\(s\) in loading state_dict:\s+size mismatch for"
                     r" body\.0\.bias: copying a param with shape torch\.Size\(\[16\]\) from checkpoint, the shape in current"
                     r" model is torch\.Size\(\[32\]\)")


def test_checkpoint_missing_keys_is_refused_when_strict(reference, tmp_path):
    _refused(tmp_path, reference("sharded", 0) / "ckpt" / "epoch=1.ckpt", "--net", "extra", "--fn", "validate",
             pattern=r"does not fit this model\. Error\(s\) in loading state_dict:\s+Missing key\(s\) in state_dict: extra\.0\.bias,"
                     r" extra\.0\.weight")


def test_strict_loading_false_loads_the_keys_both_have(reference, tmp_path):
    ref = reference("sharded", 0)
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--ckpt-path", ref / "ckpt" / "epoch=1.ckpt", "--net", "extra",
           "--strict", 0, "--fn", "validate")
    expected = load(ref / "out" / "full_epoch1.pt")["params"]
    loaded = load(tmp_path / "out" / "full_validate.pt")["params"]
    assert_identical(expected, {k: v for k, v in loaded.items() if not k.startswith("extra.")}, "shared weights")


def test_weights_only_checkpoint_cannot_resume_fit(tmp_path):
    first = tmp_path / "first"
    worker(first, *config(first, "sharded", 0), "--max-epochs", 1, "--weights-only")
    _refused(tmp_path / "second", first / "ckpt" / "epoch=0.ckpt",
             pattern=r"KeyError: .Trying to restore optimizer state but checkpoint contains only the model\. This is probably due"
                     r" to `ModelCheckpoint\.save_weights_only` being set to `True`\. \(Checkpoint: ")


def test_truncated_shard_is_refused_on_every_rank(reference, tmp_path):
    import shutil

    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(reference("sharded", 0) / "ckpt" / "epoch=1.ckpt", damaged)
    shard = sorted(damaged.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])
    _refused(tmp_path / "run", damaged,
             pattern=rf"DamagedCheckpointError: The checkpoint file .*{shard.name}' is 100 bytes; its save wrote \d+ bytes")


def test_rank_zero_path_wins_when_ranks_disagree(reference, tmp_path):
    ref = reference("sharded", 0)
    worker(tmp_path, *config(tmp_path, "sharded", 0), "--max-epochs", 3, "--ckpt-path", ref / "ckpt" / "epoch=1.ckpt",
           "--other-ranks-ckpt-path", tmp_path / "does-not-exist.ckpt")
    assert_ranks_identical(ref / "out", "epoch1", tmp_path / "out", "start")
