"""Checkpoints at URLs: saved through fsspec, crash-safe by the pointer protocol (``_storage._objects``), and never written
to a local folder named after the scheme (``Path("s3://b/run")`` is the local ``s3:/b/run``).

``memory://`` serves the one-process tests; the multi-rank ones run against a real S3-compatible server on
127.0.0.1 (support/s3.py), through s3fs and botocore as users run them: resume bit for bit, ``ckpt_path="last"``,
``save_top_k``, a rank SIGKILLed at each point of a save, a network cut mid-save, a bucket that refuses writes, a
bucket that does not exist.
"""
import importlib
import json
import os
import re
from pathlib import Path

import pytest

from support.flavours import NATIVE, PATCHABLE_TRAINERS, VERSION, strategy_class
from support.marks import needs_cpu_fsdp, needs_patched_trainer
from support.stores import S3Store

MEMORY = "memory://bucket/run"


@pytest.fixture
def in_empty_directory(tmp_path, monkeypatch):
    """The working directory, where a URL taken for a local path would have been written."""
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    assert list(tmp_path.iterdir()) == [], "something was written to the working directory"


@pytest.fixture
def memory():
    """fsspec's in-memory file system, empty before and after."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield fs
    fs.store.clear()


def _trainer(kind: str, dirpath: str, max_epochs: int, background: bool = False, **checkpointing):
    """``background``: with AsyncCheckpointIO, which saves in the background where torch has ``async_save``."""
    from lightning_fsdp_resume.testing import enable_cpu_fsdp

    lightning = importlib.import_module(PATCHABLE_TRAINERS[0])
    callbacks = importlib.import_module(f"{PATCHABLE_TRAINERS[0]}.callbacks")
    enable_cpu_fsdp()
    checkpoint = callbacks.ModelCheckpoint(dirpath=dirpath, filename="{epoch}", **checkpointing)
    plugins = [importlib.import_module(f"{PATCHABLE_TRAINERS[0]}.plugins.io").AsyncCheckpointIO()] if background else []
    return lightning.Trainer(
        plugins=plugins,
        accelerator="cpu", devices=1, strategy=strategy_class(PATCHABLE_TRAINERS[0])(state_dict_type=kind),
        max_epochs=max_epochs, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoint],
    )


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


# --- one process, memory:// ---------------------------------------------------------------------------------------


@needs_cpu_fsdp
@needs_patched_trainer
@pytest.mark.parametrize("kind", ["sharded", "full"])
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_trainer_saves_to_a_url_and_resumes_last_from_it(in_empty_directory, memory, process_group, kind, background):
    import torch

    from support.trainer_worker import Net, data

    trainer = _trainer(kind, MEMORY, 2, background, save_top_k=1, monitor="step", mode="max", save_last=True)
    trained = Net()
    trainer.fit(trained, train_dataloaders=data())
    entries = sorted(p.rsplit("/", 1)[-1] for p in memory.ls("/bucket/run", detail=False))
    if kind == "sharded":  # two pointers and their data; epoch=0's went with its pointer (save_top_k=1)
        assert [e for e in entries if not e.startswith(".fsdp-resume-data-")] == ["epoch=1.ckpt", "last.ckpt"]
        assert len(entries) == 4, entries
    else:
        assert entries == ["epoch=1.ckpt", "last.ckpt"]

    torch.manual_seed(1)  # other initial weights, which the load must replace
    resumed = Net()
    _trainer(kind, MEMORY, 2).fit(resumed, train_dataloaders=data(), ckpt_path="last")  # loads; nothing left to train
    for saved, loaded in zip(_weights(trained), _weights(resumed)):
        assert torch.equal(saved, loaded)


@needs_cpu_fsdp
@needs_patched_trainer
def test_a_sharded_url_checkpoint_reads_with_load_from_checkpoint_and_consolidates_to_a_url(memory, process_group):
    """The pointer is followed by every reader: Lightning's ``load_from_checkpoint``, and ``consolidate`` from a URL
    into a URL, whose output is an ordinary file any Lightning reads."""
    import torch

    from lightning_fsdp_resume.cli import main
    from support.trainer_worker import Net, data

    _trainer("sharded", MEMORY, 1, save_top_k=-1).fit(Net(), train_dataloaders=data())
    loaded = Net.load_from_checkpoint(f"{MEMORY}/epoch=0.ckpt")
    assert main(["consolidate", "--quiet", f"{MEMORY}/epoch=0.ckpt", "memory://bucket/out/full.ckpt"]) == 0
    with memory.open("/bucket/out/full.ckpt", "rb") as handle:
        full = torch.load(handle, weights_only=False)
    assert full["epoch"] == 0 and sorted(full["state_dict"]) == sorted(loaded.state_dict())
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full["state_dict"][name]), name
    assert not [p for p in memory.ls("/bucket/out", detail=False) if ".fsdp-resume-" in p], "a partial object was left"


@needs_cpu_fsdp
@needs_patched_trainer
def test_a_url_checkpoint_reads_without_the_package_and_an_uploaded_directory_reads_as_it_is(memory, process_group, tmp_path):
    """docs/saving.md's way to read a sharded checkpoint at a URL without this package (follow the pointer, copy the
    prefix), and the other way round: a sharded directory uploaded as it is reads at its URL."""
    import torch

    from support.trainer_worker import Net, data

    _trainer("sharded", MEMORY, 1, save_top_k=-1).fit(Net(), train_dataloaders=data())
    pointer = json.loads(memory.cat_file("/bucket/run/epoch=0.ckpt"))
    assert pointer["kind"] == "sharded" and pointer["data"].startswith(".fsdp-resume-data-")
    local = tmp_path / "epoch=0.ckpt"
    memory.get(f"/bucket/run/{pointer['data']}/", str(local), recursive=True)
    assert {".metadata", "meta.pt"} <= {p.name for p in local.iterdir()}
    memory.put(str(local), "/bucket/uploaded/epoch=0.ckpt", recursive=True)
    expected = Net.load_from_checkpoint(local).state_dict()
    for source in (f"{MEMORY}/epoch=0.ckpt", "memory://bucket/uploaded/epoch=0.ckpt"):
        loaded = Net.load_from_checkpoint(source).state_dict()
        assert sorted(loaded) == sorted(expected)
        for name, value in expected.items():
            assert torch.equal(loaded[name], value), (source, name)


def test_an_unknown_protocol_is_refused_by_name_and_nothing_is_written(in_empty_directory, capsys):
    from lightning_fsdp_resume.cli import main

    assert main(["consolidate", "nosuchprotocol://bucket/run/last.ckpt", "out.ckpt"]) == 1
    assert re.search(r"error: Cannot read the checkpoint 'nosuchprotocol://bucket/run/last\.ckpt': its protocol has no"
                     r" fsspec implementation here \(Protocol not known: nosuchprotocol\)\..* Nothing was written\.",
                     capsys.readouterr().err)  # and the fixture finds the directory empty


def test_a_protocol_whose_fsspec_implementation_is_missing_names_what_to_install(in_empty_directory):
    from lightning_fsdp_resume._storage import open_path as location

    with pytest.raises(ImportError, match=r"Cannot save the checkpoint 'nosuchprotocol://bucket/x': its protocol has no"
                                          r" fsspec implementation here .* Nothing was written"):
        location("nosuchprotocol://bucket/x", "save")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"Cannot load the checkpoint 'gs://bucket/x'.*gcsfs"):
            location("gs://bucket/x", "load")


def test_a_torch_without_fsspec_storage_refuses_sharded_urls_naming_the_release(monkeypatch):
    """torch 2.0 has no fsspec storage for torch.distributed.checkpoint: the refusal names the release and what works."""
    import sys

    import torch.distributed.checkpoint as dcp

    from lightning_fsdp_resume._patching import _torch_compat as compat
    from lightning_fsdp_resume._storage import checked
    from lightning_fsdp_resume._storage import open_path as location

    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint._fsspec_filesystem", None)  # as if torch had none
    monkeypatch.delattr(dcp, "_fsspec_filesystem", raising=False)
    release = ".".join(map(str, compat.torch_release()))
    with pytest.raises(RuntimeError, match=rf"Sharded checkpoints at URLs \('memory:///bucket/run/last\.ckpt'\) need"
                                           rf" torch\.distributed\.checkpoint's fsspec storage, which torch {release} does"
                                           r" not have .*save full checkpoints"):
        checked.writer(location(f"{MEMORY}/last.ckpt", "save"))


def test_http_checkpoints_are_downloaded_where_torch_hub_keeps_them_and_read_restricted(tmp_path, monkeypatch):
    """Lightning reads an http(s) URL with torch.hub; so does the reader's wrap, without asking fsspec (whose http file
    system would fetch the whole file to see whether it is a directory), then unpickles it as any other file: a
    checkpoint whose pickle names code is refused, one of Lightning's kinds loads. A real server, on 127.0.0.1."""
    import functools
    import http.server
    import threading

    import torch

    from lightning_fsdp_resume import UnsafeCheckpointError
    from lightning_fsdp_resume._lightning._lightning_reads import wrap_load
    from support.poison import Hidden

    served = tmp_path / "served"
    served.mkdir()
    torch.save({"state_dict": {"w": torch.arange(3.0)}, "hyper_parameters": {"lr": 0.1}}, served / "clean.ckpt")
    torch.save({"state_dict": {}, "hidden": Hidden(tmp_path / "ran")}, served / "poisoned.ckpt")
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        load = wrap_load(lambda *args: pytest.fail(f"Lightning's own reader was called: {args}"))
        loaded = load(f"{url}/clean.ckpt", "cpu")
        assert torch.equal(loaded["state_dict"]["w"], torch.arange(3.0)) and loaded["hyper_parameters"] == {"lr": 0.1}
        assert (tmp_path / "hub" / "checkpoints" / "clean.ckpt").is_file()  # torch.hub's cache, as Lightning's read
        with pytest.raises(UnsafeCheckpointError, match=r"Refused to unpickle 'http://127\.0\.0\.1:\d+/poisoned\.ckpt'"):
            load(f"{url}/poisoned.ckpt", "cpu")
        assert not (tmp_path / "ran").exists()
    finally:
        server.shutdown()
        server.server_close()


def test_file_urls_are_local_paths(tmp_path):
    from lightning_fsdp_resume._storage import open_path as location

    assert location(f"file://{tmp_path}/x.ckpt", "save") == location(tmp_path / "x.ckpt", "save")


def test_a_damaged_pointer_or_missing_data_is_refused_by_name(memory):
    from lightning_fsdp_resume._storage import open_path as location

    memory.pipe_file("/bucket/run/last.ckpt", b'{"lightning_fsdp_resume.pointer": 1, "kind": "sharded"}')
    with pytest.raises(ValueError, match=r"The checkpoint pointer 'memory:///bucket/run/last\.ckpt' is damaged"):
        location(f"{MEMORY}/last.ckpt", "load").resolve()
    memory.pipe_file("/bucket/run/last.ckpt", json.dumps({"lightning_fsdp_resume.pointer": 1, "kind": "sharded",
                                                          "data": ".fsdp-resume-data-gone"}).encode())
    with pytest.raises(FileNotFoundError, match=r"names its data 'memory:///bucket/run/\.fsdp-resume-data-gone', which does"
                                                r" not exist"):
        location(f"{MEMORY}/last.ckpt", "load").resolve()
    memory.pipe_file("/bucket/run/last.ckpt", json.dumps({"lightning_fsdp_resume.pointer": 9, "data": "x"}).encode())
    with pytest.raises(ValueError, match=r"newer format \(9\).*Upgrade lightning_fsdp_resume"):
        location(f"{MEMORY}/last.ckpt", "load").resolve()


def test_leftover_data_is_found_unless_a_pointer_is_damaged(memory):
    from lightning_fsdp_resume._storage import open_path as location
    from lightning_fsdp_resume._storage._objects import leftovers

    memory.pipe_file("/bucket/run/.fsdp-resume-data-kept/.metadata", b"x")
    memory.pipe_file("/bucket/run/.fsdp-resume-data-dead/.metadata", b"x")
    memory.pipe_file("/bucket/run/last.ckpt", json.dumps({"lightning_fsdp_resume.pointer": 1, "kind": "sharded",
                                                          "data": ".fsdp-resume-data-kept"}).encode())
    memory.pipe_file("/bucket/run/notes.txt", b"a user's file")
    directory = location(MEMORY, "save")
    assert [p.name for p in leftovers(directory)] == [".fsdp-resume-data-dead"]
    memory.pipe_file("/bucket/run/epoch=0.ckpt", b'{"lightning_fsdp_resume.pointer": 1}')  # names nothing readable
    assert leftovers(directory) == []


# --- two ranks, a real S3 server -----------------------------------------------------------------------------------

def multirank_s3(test):
    """Two ranks against the S3 server: FSDP on this CPU, and the shim (no native Lightning saves sharded to URLs)."""
    marks = [
        pytest.mark.multirank,
        needs_cpu_fsdp,
        pytest.mark.skipif(NATIVE, reason=f"native Lightning {VERSION} saves no sharded checkpoints to URLs (upstream"
                                          " #18786) and writes full ones in place; these are the shim's guarantees"),
    ]
    for mark in marks:
        test = mark(test)
    return test


def _s3_args(s3_server, url: str, keys=None):
    return ["--ckpt-dir", url, "--fsspec-conf", json.dumps(s3_server.fsspec_conf(keys))]


@multirank_s3
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_trainer_resumes_last_from_s3_bit_exact_and_save_top_k_removes_whole_checkpoints(reference, s3_server, bucket, tmp_path, kind):
    from support.ranks import FULL_USE_ORIG_PARAMS, config, worker
    from support.states import assert_ranks_identical

    use_orig_params = 0 if kind == "sharded" else FULL_USE_ORIG_PARAMS
    ref = reference(kind, use_orig_params)
    url = f"{bucket}/run"
    first, second = tmp_path / "first", tmp_path / "second"
    worker(first, *config(first, kind, use_orig_params), *_s3_args(s3_server, url), "--top-k", 1, "--max-epochs", 2)
    store = S3Store(url)
    assert store.names() == ["epoch=1.ckpt", "last.ckpt"], store.names()  # epoch=0's pointer and data are gone
    worker(second, *config(second, kind, use_orig_params), *_s3_args(s3_server, url), "--top-k", 1, "--max-epochs", 3,
           "--ckpt-path", "last")
    assert_ranks_identical(ref / "out", "epoch1", second / "out", "start")
    assert_ranks_identical(ref / "out", "final", second / "out", "final")
    assert store.names() == ["epoch=2.ckpt", "last.ckpt"], store.names()
    assert not list(Path(os.getcwd()).glob("s3:*")), "a local folder was made for the URL"


@multirank_s3
@pytest.mark.parametrize("kind, trials", [
    ("sharded", [("mid-shards", 0), ("mid-shards", 1), ("after-shards", 1), ("before-publish", 0), ("after-publish", 0)]),
    ("full", [("before-publish", 0), ("after-publish", 0)]),
])
def test_killed_saves_to_s3_leave_the_previous_checkpoint_loadable(reference, s3_server, bucket, tmp_path, kind, trials):
    """A rank SIGKILLed at the first shard, the last shard, before the commit and after it: the previous checkpoint
    stays loadable and exact, a partial one is never loaded, and the next save removes what the killed one left."""
    from support.crash_chain import run_chain
    from support.ranks import FULL_USE_ORIG_PARAMS

    store = S3Store(f"{bucket}/run")
    extra = ["--fsspec-conf", json.dumps(s3_server.fsspec_conf())]
    use_orig_params = 0 if kind == "sharded" else FULL_USE_ORIG_PARAMS
    assert run_chain(reference, tmp_path, store, kind, use_orig_params, trials, first_save_killed=kind == "sharded",
                     extra=extra) == len(trials)


# --- refusals from a real store: one process ---------------------------------------------------------------------


@needs_cpu_fsdp
@needs_patched_trainer
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_a_bucket_that_refuses_writes_fails_the_save_clearly_and_keeps_the_checkpoint(
        in_empty_directory, s3_server, bucket, process_group, monkeypatch, kind):
    import fsspec.config

    from support.trainer_worker import Net, data

    url = f"{bucket}/run"
    _trainer(kind, url, 1, save_last=True).fit(Net(), train_dataloaders=data())
    store = S3Store(url)
    before = store.hashes("last.ckpt")
    monkeypatch.setitem(fsspec.config.conf, "s3", s3_server.fsspec_conf(s3_server.reader)["s3"])  # may read, not write
    with pytest.raises(OSError, match=rf"Could not save the checkpoint '{url}/epoch=1\.ckpt': .*(AccessDenied|Access Denied)"
                                      r".*Nothing of this save was committed"):
        _trainer(kind, url, 2, save_last=True).fit(Net(), train_dataloaders=data(), ckpt_path="last")
    monkeypatch.undo()
    assert store.hashes("last.ckpt") == before
    assert [name for name in store.names() if not name.startswith(".")] == ["epoch=0.ckpt", "last.ckpt"]


@needs_cpu_fsdp
@needs_patched_trainer
def test_a_missing_bucket_is_refused_by_name_and_not_created(in_empty_directory, s3_server, process_group):
    import boto3  # noqa: F401  (the object-storage extra)

    from support.trainer_worker import Net, data

    with pytest.raises(FileNotFoundError, match=r"Cannot save the checkpoint 's3://no-such-bucket/run/epoch=0\.ckpt': the"
                                                r" bucket 'no-such-bucket' does not exist"):
        _trainer("sharded", "s3://no-such-bucket/run", 1).fit(Net(), train_dataloaders=data())
    buckets = s3_server._client("s3", s3_server.writer).list_buckets()["Buckets"]
    assert "no-such-bucket" not in [b["Name"] for b in buckets]


# --- two ranks: the network cut mid-save, Fabric -------------------------------------------------------------------


@multirank_s3
def test_a_network_cut_mid_save_fails_every_rank_clearly_and_keeps_the_previous_checkpoint(reference, s3_server, bucket, tmp_path):
    from support.crash_chain import assert_restored
    from support.ranks import config, worker
    from support.states import assert_ranks_identical

    url = f"{bucket}/run"
    store = S3Store(url)
    cut, resumed = tmp_path / "cut", tmp_path / "resumed"
    # rank 1 has written its shard of the second save (after epoch 1) when the network goes
    output = worker(cut, *config(cut, "sharded", 0), *_s3_args(s3_server, url), "--last-only", "--max-epochs", 3,
                    "--cut", f"mid-shards:1:2:{s3_server.relay.control_port}", expect_failure=True)
    s3_server.relay.mend()
    assert re.search(rf"RemoteCheckpointError: Could not save the checkpoint '{url}/last\.ckpt': .*Nothing of this save"
                     " was committed", output), output[-6000:]
    assert store.names()[-1] == "last.ckpt"
    worker(resumed, *config(resumed, "sharded", 0), *_s3_args(s3_server, url), "--last-only", "--max-epochs", 3,
           "--ckpt-path", "last")
    assert_restored(reference("sharded", 0), resumed, saved_epoch=0)
    assert_ranks_identical(reference("sharded", 0) / "out", "final", resumed / "out", "final")
    assert store.names() == ["last.ckpt"], "what the cut save wrote was not removed by the next one"


@multirank_s3
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_fabric_saves_to_s3_and_resumes_bit_exact(fabric_reference, s3_server, bucket, tmp_path, kind):
    from support.ranks import EPOCHS, fabric_config, fabric_worker
    from support.states import assert_ranks_identical

    url = f"{bucket}/run"
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    fabric_worker(saved, *fabric_config(saved, kind), *_s3_args(s3_server, url), "--epochs", 2)
    fabric_worker(resumed, *fabric_config(resumed, kind), *_s3_args(s3_server, url), "--epochs", EPOCHS,
                  "--resume", f"{url}/epoch=0.ckpt")
    ref = fabric_reference(kind)
    for part in ("params", "buffers", "optim"):
        assert_ranks_identical(ref / "out", "epoch0", resumed / "out", "start", parts=[part])
        assert_ranks_identical(ref / "out", "final", resumed / "out", "final", parts=[part])
    assert S3Store(url).names() == [f"epoch={e}.ckpt" for e in range(EPOCHS)]
