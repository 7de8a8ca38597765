"""Saving and refusing checkpoint files, in one process: atomic replacement, leftovers of failed saves,
and the clear error each broken input gets. Checkpoints are made by the patched strategy's own
``save_checkpoint`` over a one-process gloo group; the multi-rank versions are in test_crash_safety.py.
"""
import os
from pathlib import Path

import pytest

from lightning_fsdp_resume._checkpoint import _preflight
from lightning_fsdp_resume._patching import _torch_compat as compat
from lightning_fsdp_resume._storage import _local, open_path
from support.checkpoints import saved_epoch, trainer_checkpoint
from support.damage import without_checksums
from support.flavours import PATCHABLE_TRAINERS, strategy_class
from support.marks import needs_patched_trainer
from support.states import file_hashes


def _strategy(kind: str):
    strategy = strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type=kind)
    strategy.broadcast = lambda obj, src=0: obj  # one process: rank 0's value is everyone's
    strategy.barrier = lambda *args, **kwargs: None
    return strategy


def save(path: Path, epoch: int, kind: str = "sharded") -> Path:
    _strategy(kind).save_checkpoint(trainer_checkpoint(epoch), path)
    return path


def test_partial_saves_are_hidden_and_never_named_last(tmp_path):
    partial = _local.partial_path(tmp_path / "last.ckpt", "abc")
    assert partial.parent == tmp_path and partial.name.startswith(".") and "last" not in partial.name


@needs_patched_trainer
class TestAtomicSaves:
    @pytest.fixture(autouse=True)
    def group(self, process_group):
        yield

    def test_a_save_leaves_only_the_complete_checkpoint(self, tmp_path):
        path = save(tmp_path / "last.ckpt", 1)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
        assert {"meta.pt", ".metadata"} <= {p.name for p in path.iterdir()}
        assert _preflight.checkpoint_kind(open_path(path, "load")) == _preflight.SHARDED and saved_epoch(path) == 1

    @pytest.mark.parametrize("first,second", [("sharded", "sharded"), ("sharded", "full"), ("full", "sharded"), ("full", "full")])
    def test_overwriting_replaces_the_checkpoint_whole(self, tmp_path, first, second):
        path = save(tmp_path / "last.ckpt", 1, first)
        save(path, 2, second)
        assert saved_epoch(path) == 2 and (path.is_dir() == (second == "sharded"))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

    def test_a_failed_save_keeps_the_previous_checkpoint_and_the_next_one_cleans_up(self, tmp_path, monkeypatch):
        path = save(tmp_path / "last.ckpt", 1)
        before = file_hashes(path)

        def fail_after_writing(state, partial):
            original(state, partial)
            raise OSError("disk full")

        original = compat.save_distributed
        monkeypatch.setattr(compat, "save_distributed", fail_after_writing)
        with pytest.raises(OSError, match="disk full"):
            save(path, 2)
        monkeypatch.undo()
        assert file_hashes(path) == before
        leftovers = _local.leftovers(tmp_path)
        assert len(leftovers) == 1 and "last" not in leftovers[0].name
        save(path, 3)
        assert saved_epoch(path) == 3 and _local.leftovers(tmp_path) == []

    def test_without_atomic_exchange_a_crash_between_renames_names_the_previous(self, tmp_path, monkeypatch):
        monkeypatch.setattr(_local, "_exchange", lambda first, second: False)  # e.g. NFS
        path = save(tmp_path / "last.ckpt", 1)
        save(path, 2)
        assert saved_epoch(path) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]

        moved, real_rename = [], os.rename

        def killed_before_the_second_rename(source, target):
            if Path(target) == path:
                raise KeyboardInterrupt("killed between the renames")
            if Path(source) == path:
                moved.append(Path(target))
            real_rename(source, target)

        monkeypatch.setattr(os, "rename", killed_before_the_second_rename)
        with pytest.raises(KeyboardInterrupt):
            save(path, 3)
        monkeypatch.undo()
        assert not path.exists()
        with pytest.raises(FileNotFoundError, match="rename that to") as refused:
            _strategy("sharded").load_checkpoint(path)
        assert str(moved[0]) in str(refused.value) and saved_epoch(moved[0]) == 2

    def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(self, tmp_path):
        path = tmp_path / "results"
        path.mkdir()
        (path / "notes.txt").write_text("keep me")
        for kind in ("sharded", "full"):
            with pytest.raises(IsADirectoryError, match=r"^The checkpoint path exists and is a directory: .*results\. It is not a sharded checkpoint"):
                save(path, 1, kind)
        assert [p.name for p in path.iterdir()] == ["notes.txt"] and _local.leftovers(tmp_path) == []

    def test_a_full_save_refuses_an_empty_directory_and_a_sharded_one_takes_its_place(self, tmp_path):
        path = tmp_path / "empty"
        path.mkdir()
        with pytest.raises(IsADirectoryError, match=r"^The checkpoint path exists and is a directory: .*empty\. "):
            save(path, 1, "full")
        assert path.is_dir() and not any(path.iterdir())
        save(path, 1, "sharded")
        assert saved_epoch(path) == 1 and _local.leftovers(tmp_path) == []


def _damage(path: Path, how: str) -> None:
    shards = sorted(path.glob("*.distcp"))
    if how == "no meta.pt":
        (path / "meta.pt").unlink()
    elif how == "meta.pt alone":
        for p in path.iterdir():
            if p.name != "meta.pt":
                p.unlink()
    elif how == "missing shard":
        shards[0].unlink()
    elif how == "truncated shard":
        shards[0].write_bytes(shards[0].read_bytes()[:10])
    elif how == "corrupt .metadata":
        (path / ".metadata").write_bytes(b"garbage")
    elif how == "corrupt meta.pt":
        (path / "meta.pt").write_bytes(b"garbage")


# how -> what is refused without checksums (native's checkpoints), and with them (the shim's): the file, and its size
SHARDED_DAMAGE = {
    "no meta.pt": ("has no 'meta.pt'", "has no 'meta.pt'"),
    "meta.pt alone": ("has no shard index '.metadata'", "has no shard index '.metadata'"),
    "missing shard": (r"The shard file .* is missing", r"The checkpoint file .*__0_0.distcp' is missing; its save wrote \d+ bytes"),
    "truncated shard": (r"The shard file .* is truncated: 10 bytes", r"file .*__0_0.distcp' is 10 bytes; its save wrote \d+ bytes"),
    # the checksums close .metadata: garbage in its place ends as neither an index nor a checksummed one
    "corrupt .metadata": (r"The shard index .* cannot be read", r"The shard index .* cannot be read"),
    "corrupt meta.pt": (r"meta.pt' cannot be read", r"file .*meta.pt' is 7 bytes; its save wrote \d+ bytes"),
}


@needs_patched_trainer
@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "no checksums"])
@pytest.mark.parametrize("how", sorted(SHARDED_DAMAGE))
def test_damaged_sharded_checkpoint_is_refused_untouched(tmp_path, process_group, how, checksums):
    path = save(tmp_path / "damaged.ckpt", 1)
    if not checksums:
        without_checksums(path)
    _damage(path, how)
    before = file_hashes(path)
    message = SHARDED_DAMAGE[how][checksums]
    with pytest.raises(ValueError, match=message) as refused:
        _strategy("sharded").load_checkpoint(path)
    assert str(path) in str(refused.value)
    assert file_hashes(path) == before


@needs_patched_trainer
@pytest.mark.parametrize(
    "what,error,message",
    [
        ("missing", FileNotFoundError, "does not point to a valid checkpoint: it does not exist"),
        ("empty directory", ValueError, "does not point to a valid checkpoint: it is an empty directory"),
        ("other directory", ValueError, "does not point to a valid checkpoint: the directory has neither 'meta.pt' nor the shard"),
        ("empty file", ValueError, "is empty"),
        ("text file", ValueError, "is not a checkpoint torch can read"),
        ("list", ValueError, "holds a list, not a checkpoint's dict"),
        ("dict without state_dict", ValueError, "is not a Lightning checkpoint: it has no 'state_dict'"),
    ],
)
def test_what_is_not_a_checkpoint_is_refused_with_its_path(tmp_path, what, error, message):
    import torch

    path = tmp_path / "bad.ckpt"
    if what == "empty directory":
        path.mkdir()
    elif what == "other directory":
        path.mkdir()
        (path / "notes.txt").write_text("x")
    elif what == "empty file":
        path.touch()
    elif what == "text file":
        path.write_text("not a checkpoint\n")
    elif what == "list":
        torch.save([1, 2, 3], path)
    elif what == "dict without state_dict":
        torch.save({"epoch": 1}, path)
    before = file_hashes(path) if path.exists() else None
    with pytest.raises(error, match=message) as refused:
        _strategy("full").load_checkpoint(path)
    assert str(path) in str(refused.value)
    assert (file_hashes(path) if path.exists() else None) == before


def test_model_fit_check_honours_strict(tmp_path):
    model = {"a": (2, 3), "b": (3,)}
    assert _preflight.loadable_keys(tmp_path, model, {"a": (2, 3), "b": (3,), "extra": (1,)}, strict=False) == {"a", "b"}
    assert _preflight.loadable_keys(tmp_path, model, {"a": (2, 3)}, strict=False) == {"a"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: b\.\n\tUnexpected key\(s\) in state_dict: c\.\n.*strict_loading"):
        _preflight.loadable_keys(tmp_path, model, {"a": (2, 3), "c": (1,)}, strict=True)
    with pytest.raises(RuntimeError, match=r"size mismatch for a: copying a param with shape torch\.Size\(\[3, 2\]\) from"
                       r" checkpoint, the shape in current model is torch\.Size\(\[2, 3\]\)\.$"):
        _preflight.loadable_keys(tmp_path, model, {"a": (3, 2), "b": (3,)}, strict=False)
