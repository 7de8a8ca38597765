"""Loading a checkpoint never runs code hidden in its pickles unless the user trusts it (``weights_only=False``).

Every pickle site of a real checkpoint is poisoned in turn (``support/poison.py``: the hidden code makes a directory)
and loaded through the entry points users have: the Trainer's resume and evaluation on 2 ranks, and in this process
``load_from_checkpoint``, ``consolidate`` and a checkpoint at a URL (Fabric's ``load`` and ``load_raw``:
test_fabric_multirank.py). A refusal must name the file, what it names and both ways out, and the directory must not
exist; a trusted load must run the code (the switch works). Clean checkpoints load by default everywhere else in the
suite: every load there goes through the same restricted unpickler.
"""
import argparse
import collections
import re
from pathlib import Path

import pytest
import torch

from lightning_fsdp_resume import UnsafeCheckpointError, add_safe_globals
from lightning_fsdp_resume._storage import checked, open_path
from support.flavours import NATIVE, TRAINER_UNDER_TEST
from support.marks import TORCH, needs_cpu_fsdp
from support.poison import FULL_SITE, SHARDED_SITES, Hidden, poisoned
from support.ranks import MID, config, worker
from support.states import assert_ranks_identical

patched_only = pytest.mark.skipif(NATIVE, reason="the shim's restricted unpickling; native's: docs/behaviour.md")
REFUSAL = r"Refused to unpickle [^']*'[^']*{name}[^']*': it names `support\.poison\.ran`, .*If you trust the source of" \
          r" this checkpoint, load it with `weights_only=False`; to admit only this type, call" \
          r" `.*add_safe_globals\(\[support\.poison\.ran\]\)`"


class Admitted:
    """A type of the user's own, which a checkpoint holds only when they admit it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other) -> bool:
        return isinstance(other, Admitted) and other.value == self.value


# --- the restricted unpickler, in this process, on every torch ---------------------------------------------------


def test_what_lightning_and_torch_put_into_checkpoints_loads_by_default(tmp_path):
    AttributeDict = TRAINER_UNDER_TEST.module("utilities.parsing").AttributeDict
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    checkpoint = {
        "state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()], "epoch": 3, "global_step": 7,
        "hyper_parameters": AttributeDict(lr=0.1, layers=[3, 2], args=argparse.Namespace(seed=1), name=None),
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"dirpath": Path("/runs/a"), "best_k_models": {"a": torch.tensor(1.0)}}},
        "loops": {"fit_loop": collections.OrderedDict(state={"epoch": 1}, counts=(1, 2.5, True, b"x", {1, 2}, frozenset([3])))},
        "rng": (torch.get_rng_state(), torch.float16, torch.device("cpu"), torch.Size([2, 3]), complex(1, 2)),
    }
    torch.save(checkpoint, tmp_path / "clean.ckpt")
    loaded = checked.load_file(open_path(tmp_path / "clean.ckpt", "load"))
    assert type(loaded["hyper_parameters"]) is AttributeDict and loaded["hyper_parameters"] == checkpoint["hyper_parameters"]
    assert loaded["callbacks"] == {key: {"dirpath": Path("/runs/a"), "best_k_models": {"a": torch.tensor(1.0)}}
                                   for key in checkpoint["callbacks"]}
    assert loaded["loops"] == checkpoint["loops"] and loaded["lr_schedulers"] == checkpoint["lr_schedulers"]
    assert torch.equal(loaded["rng"][0], checkpoint["rng"][0]) and loaded["rng"][1:] == checkpoint["rng"][1:]
    assert str(loaded["optimizer_states"]) == str(checkpoint["optimizer_states"])


def test_a_pickle_naming_code_is_refused_before_it_runs_and_runs_only_when_trusted(tmp_path):
    ran = tmp_path / "ran"
    torch.save({"state_dict": {}, "hidden": Hidden(ran)}, tmp_path / "poisoned.ckpt")
    with pytest.raises(UnsafeCheckpointError, match=REFUSAL.format(name="poisoned.ckpt")):
        checked.load_file(open_path(tmp_path / "poisoned.ckpt", "load"))
    assert not ran.exists()
    assert isinstance(UnsafeCheckpointError("x", "y"), ValueError)  # as every other refusal of a checkpoint
    checked.load_file(open_path(tmp_path / "poisoned.ckpt", "load", trusted=True))
    assert ran.is_dir()


def test_a_type_the_user_admits_loads_by_default(tmp_path):
    torch.save({"mine": Admitted(3)}, tmp_path / "own.ckpt")
    name = f"{__name__}.Admitted"
    with pytest.raises(UnsafeCheckpointError, match=rf"names `{re.escape(name)}`"):
        checked.load_file(open_path(tmp_path / "own.ckpt", "load"))
    add_safe_globals([Admitted])  # torch's own allowlist where torch has one (2.4+), which this package honours
    try:
        assert checked.load_file(open_path(tmp_path / "own.ckpt", "load")) == {"mine": Admitted(3)}
    finally:
        if TORCH >= (2, 4):
            torch.serialization.clear_safe_globals()
        else:
            from lightning_fsdp_resume._checkpoint import _unpickling

            _unpickling._added.clear()


# --- real checkpoints of a 2-rank run, each pickle site poisoned in turn ------------------------------------------


def _poisoned(reference, tmp_path: Path, site: str) -> Path:
    """A copy of the reference run's checkpoint after epoch 1, sharded (or full for FULL_SITE), with ``site`` poisoned:
    unpickling it makes ``tmp_path / "ran"``."""
    kind = "full" if site == FULL_SITE else "sharded"
    source = reference(kind, 0) / "ckpt" / MID
    return poisoned(source, tmp_path / f"poisoned-{site}.ckpt", site, tmp_path / "ran")


def _net():
    from support import trainer_worker

    return trainer_worker.Net


@needs_cpu_fsdp
@patched_only
@pytest.mark.multirank
@pytest.mark.parametrize("site, fn", [*((site, "fit") for site in ("meta.pt", ".metadata", FULL_SITE)), ("entry", "validate")])
def test_the_trainer_refuses_a_poisoned_checkpoint_on_every_rank_before_it_runs(reference, tmp_path, site, fn):
    """fit resumes and validate evaluates from a checkpoint whose pickle runs code: every rank raises the refusal of the
    rank-0 check, made before anything loads (a pickled entry of the shards too, which validate would not read)."""
    checkpoint = _poisoned(reference, tmp_path, site)
    root = tmp_path / "run"
    worker(root, *config(root, "full" if site == FULL_SITE else "sharded", 0), "--max-epochs", 3, "--fn", fn,
           "--ckpt-path", checkpoint, "--record-error")
    for rank in range(2):
        error = (root / "out" / f"error_rank{rank}.txt").read_text()
        assert re.search(r"UnsafeCheckpointError: " + REFUSAL.format(name=re.escape(checkpoint.name)), error), error
    assert not (tmp_path / "ran").exists()


@needs_cpu_fsdp
@patched_only
@pytest.mark.multirank
def test_the_trainer_resumes_a_checkpoint_it_is_told_to_trust(reference, tmp_path):
    """``fit(..., weights_only=False)``, Lightning 2.6's keyword: the hidden code runs (the user's choice) and the run
    resumes exactly, ending as the uninterrupted one."""
    checkpoint = _poisoned(reference, tmp_path, "meta.pt")
    root = tmp_path / "run"
    worker(root, *config(root, "sharded", 0), "--max-epochs", 3, "--ckpt-path", checkpoint, "--trust-pickles")
    assert (tmp_path / "ran").is_dir()
    assert_ranks_identical(reference("sharded", 0) / "out", "final", root / "out", "final")


@needs_cpu_fsdp
@patched_only
def test_a_loads_check_and_the_load_itself_unpickle_each_pickled_entry_once(reference, monkeypatch):
    """Rank 0 checks every pickled entry of the shards before anything loads (``checkpoint_kind``); the load then reads
    the optimizer's param groups, entries of those, through the same location: from what the check unpickled."""
    from lightning_fsdp_resume._checkpoint import _format, _preflight, _unpickling
    from lightning_fsdp_resume._save_load import _loading

    path = open_path(str(reference("sharded", 0) / "ckpt" / MID), "load", False)
    unpickled = collections.Counter()
    real = _unpickling.torch_load
    monkeypatch.setattr(_unpickling, "torch_load", lambda *a, **k: unpickled.update([k.get("name")]) or real(*a, **k))
    assert _preflight.checkpoint_kind(path) == "sharded"
    entries = sum(count for name, count in unpickled.items() if str(name).startswith("an entry of"))
    shards = checked.index(path)
    assert entries == sum(_format.is_pickled_entry(stored) for stored in shards.state_dict_metadata.values()) > 0
    groups = _loading._saved_param_groups(path, "optimizer_0", shards)
    assert groups and all("lr" in group for group in groups)
    assert sum(count for name, count in unpickled.items() if str(name).startswith("an entry of")) == entries


@needs_cpu_fsdp
@patched_only
@pytest.mark.parametrize("site", [*SHARDED_SITES, FULL_SITE])
def test_load_from_checkpoint_refuses_each_poisoned_site_and_trusts_when_told(reference, tmp_path, site):
    checkpoint = _poisoned(reference, tmp_path, site)
    with pytest.raises(UnsafeCheckpointError, match=REFUSAL.format(name=re.escape(checkpoint.name))):
        _net().load_from_checkpoint(checkpoint)
    assert not (tmp_path / "ran").exists()
    _net().load_from_checkpoint(checkpoint, weights_only=False)
    assert (tmp_path / "ran").is_dir()


@needs_cpu_fsdp
@patched_only
@pytest.mark.parametrize("site", SHARDED_SITES)
def test_consolidate_refuses_each_poisoned_site_and_trusts_when_told(reference, tmp_path, capsys, site):
    from lightning_fsdp_resume.cli import main

    checkpoint = _poisoned(reference, tmp_path, site)
    command = ["consolidate", str(checkpoint), str(tmp_path / "out.ckpt"), "--quiet"]
    assert main(command) == 1
    assert re.search("error: " + REFUSAL.format(name=re.escape(checkpoint.name)), capsys.readouterr().err)
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out.ckpt").exists()
    assert main([*command, "--trusted"]) == 0, capsys.readouterr().err
    assert (tmp_path / "ran").is_dir() and (tmp_path / "out.ckpt").is_file()


@needs_cpu_fsdp
@patched_only
@pytest.mark.parametrize("site", [".metadata", FULL_SITE])
def test_a_poisoned_checkpoint_at_a_url_is_refused(reference, s3_server, bucket, tmp_path, site):
    import fsspec

    checkpoint = _poisoned(reference, tmp_path, site)
    url = f"{bucket}/{checkpoint.name}"
    fsspec.filesystem("s3").put(str(checkpoint), url, recursive=checkpoint.is_dir())
    with pytest.raises(UnsafeCheckpointError, match=REFUSAL.format(name=re.escape(url))):
        _net().load_from_checkpoint(url)
    assert not (tmp_path / "ran").exists()
