"""A damaged checkpoint is refused, never trained on: every byte a save writes is hashed as it is written, and checked
on every read before anything uses it (``_checksums``); a full file's zip CRC-32s are checked, whoever wrote it.

Damage is made as disks and copies make it: one bit flipped, at many positions of every kind of file (payload and
headers), a file cut short, a shard swapped in from another save of the same run. Each is refused naming the file, by
``verify`` and by the loads users make (the Trainer's resume on 2 ranks, ``load_from_checkpoint``, ``consolidate``,
a checkpoint at a URL); clean checkpoints load everywhere else in the suite, through the same checks.
"""
import importlib.util
import mmap
import os
import re
import shutil
import zlib
from pathlib import Path

import pytest
import xxhash

from lightning_fsdp_resume._checkpoint._checksums import DamagedCheckpointError
from support.damage import flipped, index_end, largest_item, manifest, records, sharded_positions, without_checksums, zip_positions
from support.flavours import NATIVE
from support.marks import TORCH, needs_cpu_fsdp
from support.ranks import MID, config, worker

patched_only = pytest.mark.skipif(NATIVE, reason="the shim's checksums")
# torch 2.4's DCP storage streams through its file system, which the shim wraps; torch 2.2/2.3's opens its files itself
streaming_dcp = pytest.mark.skipif(TORCH < (2, 4), reason="torch < 2.4's DCP storage opens its files itself: its saves"
                                   " hash each item whole, and its loads check what they read first")
DAMAGE = r"The checkpoint file '[^']*{name}'? is (damaged|\d+ bytes|missing)"


def _net():
    from support import trainer_worker

    return trainer_worker.Net


@pytest.fixture(scope="module")
def checkpoints(reference):
    """The reference run's sharded and full checkpoints after epoch 1."""
    return {kind: reference(kind, 0) / "ckpt" / MID for kind in ("sharded", "full")}


@needs_cpu_fsdp
@patched_only
def test_a_sharded_save_hashes_every_byte_of_every_file_per_item(checkpoints):
    """The directory holds native's files alone, every one listed by the manifest that closes ``.metadata``; its
    ranges lie back to back over all of each file (of ``.metadata``, over the index's pickle); each item of the DCP
    index is exactly one range, named by its entry (this model's tensors are small: a large one's data is hashed in
    ranges of its own, below)."""
    import pickle

    directory = checkpoints["sharded"]
    files = manifest(directory)
    names = {p.name for p in directory.iterdir()}
    assert names == {".metadata", "meta.pt"} | {name for name in names if name.endswith(".distcp")}
    assert set(files) == names
    for name, ranges in files.items():
        data, at = (directory / name).read_bytes(), 0
        for offset, length, digest, _ in ranges:
            assert offset == at and xxhash.xxh3_64_hexdigest(data[offset:offset + length]) == digest
            at += length
        assert at == (index_end(directory) if name == ".metadata" else len(data))
    index = pickle.loads((directory / ".metadata").read_bytes())
    by_place = {(name, offset, length): entry for name, ranges in files.items() for offset, length, _, entry in ranges}
    for key, info in index.storage_data.items():
        assert by_place[(info.relative_path, info.offset, info.length)] == key.fqn


@needs_cpu_fsdp
@patched_only
def test_verify_passes_whole_checkpoints_and_names_the_first_damage(checkpoints, tmp_path, capsys):
    from lightning_fsdp_resume.cli import main

    for kind, checkpoint in checkpoints.items():
        assert main(["verify", str(checkpoint)]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert re.search(r"whole: \d+ files?, [\d.]+ MiB checked in [\d.]+ s \([\d.]+ MiB/s\)", out), out
    damaged = shutil.copytree(checkpoints["sharded"], tmp_path / "sharded")
    for name, position in list(sharded_positions(damaged)):
        flipped(damaged / name, position)
        assert main(["verify", str(damaged)]) == 1, (name, position)
        assert re.search(DAMAGE.format(name=re.escape(name)), capsys.readouterr().err), (name, position)
        flipped(damaged / name, position)
    full = Path(shutil.copyfile(checkpoints["full"], tmp_path / "full.ckpt"))
    for position in zip_positions(full):
        flipped(full, position, bit=5)
        assert main(["verify", str(full)]) == 1, position
        assert re.search(DAMAGE.format(name="full.ckpt"), capsys.readouterr().err), position
        flipped(full, position, bit=5)
    assert main(["verify", str(damaged)]) == 0 and main(["verify", str(full)]) == 0


@needs_cpu_fsdp
@patched_only
def test_every_flipped_bit_is_refused_by_load_from_checkpoint_and_consolidate(checkpoints, tmp_path, capsys):
    from lightning_fsdp_resume.cli import main

    damaged = shutil.copytree(checkpoints["sharded"], tmp_path / "sharded")
    for name, position in list(sharded_positions(damaged)):
        flipped(damaged / name, position, bit=7)
        with pytest.raises(DamagedCheckpointError, match=DAMAGE.format(name=re.escape(name))):
            _net().load_from_checkpoint(damaged)
        assert main(["consolidate", str(damaged), str(tmp_path / "out.ckpt"), "--quiet"]) == 1
        assert re.search(DAMAGE.format(name=re.escape(name)), capsys.readouterr().err), (name, position)
        assert not (tmp_path / "out.ckpt").exists()
        flipped(damaged / name, position, bit=7)
    full = Path(shutil.copyfile(checkpoints["full"], tmp_path / "full.ckpt"))
    for position in zip_positions(full):
        flipped(full, position, bit=7)
        with pytest.raises(DamagedCheckpointError, match=DAMAGE.format(name="full.ckpt")):
            _net().load_from_checkpoint(full)
        flipped(full, position, bit=7)
    _net().load_from_checkpoint(damaged)  # each flip undone: whole again
    _net().load_from_checkpoint(full)


@needs_cpu_fsdp
@patched_only
def test_a_truncated_file_and_a_shard_from_another_save_of_the_run_are_refused(reference, tmp_path):
    run = reference("sharded", 0) / "ckpt"
    swapped = shutil.copytree(run / MID, tmp_path / "swapped")
    other = run / "epoch=0.ckpt" / "__1_0.distcp"
    assert other.stat().st_size == (swapped / "__1_0.distcp").stat().st_size  # the sizes cannot tell them apart
    shutil.copyfile(other, swapped / "__1_0.distcp")
    with pytest.raises(DamagedCheckpointError, match=DAMAGE.format(name="__1_0.distcp") + r": bytes \d+-\d+ \(the entry '"):
        _net().load_from_checkpoint(swapped)
    cut = shutil.copytree(run / MID, tmp_path / "cut")
    data = (cut / "__0_0.distcp").read_bytes()
    (cut / "__0_0.distcp").write_bytes(data[:-1])
    with pytest.raises(DamagedCheckpointError, match=rf"file '[^']*__0_0.distcp' is {len(data) - 1} bytes; its save wrote {len(data)} bytes"):
        _net().load_from_checkpoint(cut)


@needs_cpu_fsdp
@patched_only
def test_a_checkpoint_without_checksums_loads_and_says_it_could_not_be_verified(checkpoints, tmp_path, capsys):
    from lightning_fsdp_resume.cli import main

    plain = shutil.copytree(checkpoints["sharded"], tmp_path / "native-like")
    without_checksums(plain)
    with pytest.warns(UserWarning, match=r"carries no checksums .*: its bytes could not be verified"):
        _net().load_from_checkpoint(plain)
    assert main(["verify", str(plain)]) == 2
    assert "carries no checksums" in capsys.readouterr().err


@needs_cpu_fsdp
@patched_only
def test_a_checkpoint_another_program_saved_over_in_place_loads_that_save(reference, tmp_path):
    """Native Lightning saves a sharded checkpoint in place, over this package's: it rewrites ``.metadata``, and the
    checksums of the earlier save go with it. The checkpoint then loads the later save's weights, unverified; a
    checkpoint of an older lightning_fsdp_resume (``checksums.json`` beside it) loads unverified alike."""
    run = reference("sharded", 0) / "ckpt"
    over = shutil.copytree(run / MID, tmp_path / "over.ckpt")
    for saved in (run / "epoch=0.ckpt").iterdir():
        shutil.copyfile(saved, over / saved.name)
    without_checksums(over)  # native's index: DCP's pickle alone
    (over / "checksums.json").write_text('{"files": {}}')
    with pytest.warns(UserWarning, match=r"carries no checksums .*: its bytes could not be verified"):
        loaded = _net().load_from_checkpoint(over)
    expected, earlier = (_net().load_from_checkpoint(run / name).state_dict() for name in ("epoch=0.ckpt", MID))
    assert all(loaded.state_dict()[name].equal(value) for name, value in expected.items())
    assert not all(loaded.state_dict()[name].equal(value) for name, value in earlier.items())


@needs_cpu_fsdp
@patched_only
@pytest.mark.multirank
def test_the_trainer_refuses_a_damaged_shard_on_every_rank_before_it_trains(reference, tmp_path):
    """A flipped bit in a tensor of rank 1's shard file: both ranks raise the damage (found by rank 1 as it reads) and
    no step runs, so no checkpoint is written."""
    checkpoint = shutil.copytree(reference("sharded", 0) / "ckpt" / MID, tmp_path / "damaged.ckpt")
    offset, length, _, entry = largest_item(checkpoint, "__1_0.distcp")
    flipped(checkpoint / "__1_0.distcp", offset + length - 1)
    root = tmp_path / "run"
    worker(root, *config(root, "sharded", 0), "--max-epochs", 3, "--ckpt-path", checkpoint, "--record-error")
    for rank in range(2):
        error = (root / "out" / f"error_rank{rank}.txt").read_text()
        assert re.search(r"DamagedCheckpointError: " + DAMAGE.format(name="__1_0.distcp") + rf": bytes {offset}-"
                         rf"{offset + length} \(the entry '{re.escape(entry)}'\)", error), error
    assert not list((root / "ckpt").glob("epoch=*"))


def test_the_crc32_is_zips_own_and_the_fast_one_where_it_is_installed():
    """Full files are checked with zlib-ng's CRC-32 where its bindings are installed (the package's dependency where
    they have wheels), else with the standard library's: the same values, pieces chained and views alike."""
    from lightning_fsdp_resume._checkpoint._checksums import crc32_function

    crc32, implementation = crc32_function()
    assert implementation == ("zlib-ng" if importlib.util.find_spec("zlib_ng") else "zlib")
    data = os.urandom(3 * 2**20 + 5)
    for piece in (b"", data[:1], data, memoryview(data)[7:2 * 2**20 + 3]):
        assert crc32(piece) == zlib.crc32(piece)
    assert crc32(data[2**20:], crc32(data[:2**20])) == zlib.crc32(data)


@needs_cpu_fsdp
@patched_only
def test_shares_of_a_full_file_check_each_record_exactly_once(checkpoints, tmp_path):
    """The ranks of a node split a full file's CRC-32s (``check_zip``'s share k of n): a flipped bit in any record is
    found by exactly one share, for every n, and by none once it is undone."""
    from lightning_fsdp_resume._checkpoint._zip_checks import check_zip

    full = Path(shutil.copyfile(checkpoints["full"], tmp_path / "full.ckpt"))

    def finders(n):
        found = []
        for k in range(n):
            try:
                check_zip(str(full), "full.ckpt", (k, n))
            except DamagedCheckpointError as error:
                assert re.search(DAMAGE.format(name="full.ckpt"), str(error)), error
                found.append(k)
        return found

    for name, start, size in records(full):
        if size:
            flipped(full, start + size // 2)
            assert [len(finders(n)) for n in (1, 2, 3, 5)] == [1, 1, 1, 1], name
            flipped(full, start + size // 2)
    assert [finders(n) for n in (1, 2, 3)] == [[], [], []]


@needs_cpu_fsdp
@patched_only
@pytest.mark.multirank
def test_a_full_resume_refuses_damage_on_every_rank_whichever_rank_checked_it(reference, tmp_path):
    """A flipped bit in a record of the file's second half, which rank 1 checks for both: both ranks raise the damage
    and no step runs."""
    checkpoint = Path(shutil.copyfile(reference("full", 0) / "ckpt" / MID, tmp_path / "damaged.ckpt"))
    size = checkpoint.stat().st_size
    name, start, length = max((record for record in records(checkpoint) if record[1] * 2 >= size), key=lambda r: r[2])
    flipped(checkpoint, start + length // 2)
    root = tmp_path / "run"
    worker(root, *config(root, "full", 0), "--max-epochs", 3, "--ckpt-path", checkpoint, "--record-error")
    for rank in range(2):
        error = (root / "out" / f"error_rank{rank}.txt").read_text()
        assert re.search(r"DamagedCheckpointError: " + DAMAGE.format(name="damaged.ckpt")
                         + rf": the record '{re.escape(name)}' does not match its CRC-32", error), error
    assert not list((root / "ckpt").glob("epoch=*"))


@needs_cpu_fsdp
@patched_only
def test_damage_at_a_url_is_refused(checkpoints, s3_server, bucket, tmp_path):
    import fsspec

    damaged = shutil.copytree(checkpoints["sharded"], tmp_path / "damaged")
    offset, length, *_ = manifest(damaged)["__0_0.distcp"][-1]
    flipped(damaged / "__0_0.distcp", offset + length // 2)
    url = f"{bucket}/damaged"
    fsspec.filesystem("s3").put(str(damaged), url, recursive=True)
    with pytest.raises(DamagedCheckpointError, match=DAMAGE.format(name=re.escape("__0_0.distcp"))):
        _net().load_from_checkpoint(url)


def _large_state_saved(directory: Path, monkeypatch, whole_items: bool) -> dict:
    """A state of one large tensor ('big', 2.5 SPANs) and a small one, saved sharded into ``directory`` in this process;
    ``whole_items``: each item hashed whole, as torch < 2.4's saves hash them (read back once written)."""
    import torch

    from lightning_fsdp_resume import _storage
    from lightning_fsdp_resume._checkpoint import _checksums
    from lightning_fsdp_resume._patching import _torch_compat as compat

    state = {"big": torch.randn(int(2.5 * _checksums.SPAN) // 4, generator=torch.Generator().manual_seed(0)),
             "small": torch.arange(10)}
    location = _storage.open_path(directory, "save")
    location.mkdir()
    with monkeypatch.context() as patch:
        if whole_items:
            patch.setattr(compat, "streams_through_fs", lambda storage: False)
        compat.save_distributed(state, _storage.checked.writer(location))
    _storage.checked.seal(location, {})
    return state


def _loaded_mapping(directory: Path, state: dict, monkeypatch) -> "tuple[dict, list]":
    """``state``'s keys loaded from ``directory`` through the checked reader, and the lengths of file it memory-mapped."""
    import torch

    from lightning_fsdp_resume import _storage
    from lightning_fsdp_resume._checkpoint import _checksums
    from lightning_fsdp_resume._patching import _torch_compat as compat

    mapped: list = []
    original = _checksums.mapped
    target = {name: torch.zeros_like(value) for name, value in state.items()}
    with monkeypatch.context() as patch:
        patch.setattr(_checksums, "mapped", lambda raw, offset=0, length=0: mapped.append(length) or original(raw, offset, length))
        compat.load_distributed(target, _storage.checked.reader(_storage.open_path(directory, "load")))
    return target, mapped


@streaming_dcp
@patched_only
def test_a_large_tensor_is_hashed_in_spans_and_checked_in_the_readers_own_buffer(tmp_path, monkeypatch):
    """A tensor's data is hashed in ranges of its own of at most ``SPAN`` bytes (its last 64 KiB apart), which a load
    reads straight into torch's buffer and checks there (no range memory-mapped or read twice); a flipped bit in it is
    refused naming the entry and its bytes."""
    import torch

    from lightning_fsdp_resume._checkpoint import _checksums

    directory = tmp_path / "ckpt"
    state = _large_state_saved(directory, monkeypatch, whole_items=False)
    span = _checksums.SPAN
    (shard,) = [name for name in manifest(directory) if name.endswith(".distcp")]
    big = [r for r in manifest(directory)[shard] if r[3] == "big"]
    assert [length for _, length, _, _ in big if length >= _checksums.LARGE] == [span, span, span // 2 - _checksums._TAIL]
    loaded, mapped = _loaded_mapping(directory, state, monkeypatch)
    assert all(torch.equal(loaded[name], state[name]) for name in state) and mapped == []
    offset, length, _, _ = big[1]
    flipped(directory / shard, offset + length // 2)
    with pytest.raises(DamagedCheckpointError, match=rf"{shard}' is damaged: bytes {offset}-{offset + length} \(the entry 'big'\)"):
        _loaded_mapping(directory, state, monkeypatch)


@streaming_dcp
@patched_only
def test_a_checkpoint_hashed_item_by_item_loads_one_mapped_item_at_a_time(tmp_path, monkeypatch):
    """A save that hashed each item whole (torch < 2.4's) loads on any torch: a large item is checked in a memory map
    of it alone, and served from there; a flipped bit in it is refused naming the item."""
    import torch

    from lightning_fsdp_resume._checkpoint import _checksums

    directory = tmp_path / "ckpt"
    state = _large_state_saved(directory, monkeypatch, whole_items=True)
    (shard,) = [name for name in manifest(directory) if name.endswith(".distcp")]
    ((offset, length, _, _),) = [r for r in manifest(directory)[shard] if r[3] == "big"]
    loaded, mapped = _loaded_mapping(directory, state, monkeypatch)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    assert [n for n in mapped if n >= _checksums.LARGE] == [offset % mmap.ALLOCATIONGRANULARITY + length]
    flipped(directory / shard, offset + length // 2)
    with pytest.raises(DamagedCheckpointError, match=rf"{shard}' is damaged: bytes {offset}-{offset + length} \(the entry 'big'\)"):
        _loaded_mapping(directory, state, monkeypatch)


def _torch_keeps_save_settings_per_thread() -> bool:
    """Whether this torch lets one thread turn off torch.save's CRC-32s without changing another's (asked of torch)."""
    import threading

    import torch

    try:
        from torch.utils.serialization import config
    except ImportError:
        return False
    if not hasattr(torch.serialization, "get_crc32_options"):
        return False
    seen = []

    def other() -> None:
        with config.patch({"save.compute_crc32": False}):
            seen.append(torch.serialization.get_crc32_options())
            event.set()
            back.wait()

    event, back = threading.Event(), threading.Event()
    thread = threading.Thread(target=other)
    thread.start()
    event.wait()
    seen.append(torch.serialization.get_crc32_options())
    back.set()
    thread.join()
    return seen == [False, True]


@streaming_dcp
@patched_only
def test_a_sharded_save_writes_no_zip_crc32_that_no_loader_reads_and_only_in_its_own_thread(tmp_path, monkeypatch):
    """Where torch keeps its save settings per thread (2.13), a sharded save's items are torch.save records without
    their CRC-32s (no torch release's loader reads them; the checkpoint's own checksums cover every byte), which costs
    the writing thread less; a torch.save another thread makes meanwhile keeps its CRC-32s. The checkpoint loads
    exactly. Elsewhere every record keeps torch's CRC-32."""
    import io
    import pickle
    import threading
    import zipfile

    import torch

    per_thread = _torch_keeps_save_settings_per_thread()
    original, started, other_saved, other_crcs, saved = torch.save, threading.Event(), threading.Event(), [], []

    def save(obj, f, *args, **kwargs):  # the save's first item waits for another thread's torch.save
        if threading.current_thread() is not threading.main_thread() and not started.is_set():
            started.set()
            other_saved.wait(timeout=60)
        return original(obj, f, *args, **kwargs)

    directory = tmp_path / "ckpt"
    monkeypatch.setattr(torch, "save", save)
    saving = threading.Thread(target=lambda: saved.append(_large_state_saved(directory, monkeypatch, whole_items=False)))
    saving.start()
    assert started.wait(timeout=60), "the save wrote no item through torch.save"
    written = io.BytesIO()
    original(torch.arange(10), written)
    other_crcs = [info.CRC for info in zipfile.ZipFile(written).infolist()]
    other_saved.set()
    saving.join()
    monkeypatch.setattr(torch, "save", original)
    assert other_crcs and all(other_crcs), f"the other thread's records lost their CRC-32s: {other_crcs}"
    (shard,) = [name for name in manifest(directory) if name.endswith(".distcp")]
    data, crcs = (directory / shard).read_bytes(), []
    for info in pickle.loads((directory / ".metadata").read_bytes()[:index_end(directory)]).storage_data.values():
        crcs += [record.CRC for record in zipfile.ZipFile(io.BytesIO(data[info.offset:info.offset + info.length])).infolist()]
    assert len(crcs) >= 2 * 3, crcs  # two items, each a zip of several records
    assert (not any(crcs)) if per_thread else all(crcs), f"per-thread settings: {per_thread}; the records' CRC-32s: {crcs}"
    (state,) = saved
    loaded, _ = _loaded_mapping(directory, state, monkeypatch)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
