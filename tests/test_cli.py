"""The command line: demo, status, and the demo's verdict."""
import json
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
import torch

from lightning_fsdp_resume.demo import _report
from support.flavours import FABRIC, FABRIC_UNDER_TEST, INSTALLED, NATIVE_MODE, PATCH, TRAINER, TRAINER_UNDER_TEST, mode_of
from support.marks import long_runs, needs_consolidate, needs_cpu_fsdp


def cli(*args, env=None):
    import os

    return subprocess.run([sys.executable, "-m", "lightning_fsdp_resume", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _demo_lightning_is_patched(kind=TRAINER):
    under_test = {TRAINER: TRAINER_UNDER_TEST, FABRIC: FABRIC_UNDER_TEST}[kind]
    return under_test is not None and under_test.mode == PATCH


def _losses(run: Path) -> dict:
    """The loss of each step a demo run recorded (rank 0's ``losses.jsonl``); none where it left no record."""
    path = run / "losses.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _weights(run: Path, epoch: int) -> dict:
    """What a demo run recorded at the end of ``epoch``: its ``step`` and the full weights (``params``)."""
    return torch.load(run / f"weights_epoch{epoch}.pt", weights_only=True)


def _against_reference(workdir: Path, prefix: str, stop_after: int, epochs: int) -> Tuple[int, List[str]]:
    """The step the demo's ``{prefix}interrupted`` run stopped at, and how ``{prefix}resumed`` differs from the
    reference run by the records both wrote (nothing: exact): the loss of every step after that one, none missing
    and none more, and the step and weights at the end of every epoch from ``stop_after`` on, bit for bit."""
    reference, resumed = workdir / "reference", workdir / f"{prefix}resumed"
    stopped_at = _weights(workdir / f"{prefix}interrupted", stop_after - 1)["step"]
    expected = {step: loss for step, loss in _losses(reference).items() if step > stopped_at}
    losses = _losses(resumed)
    differing = sorted(step for step in expected.keys() | losses.keys() if losses.get(step) != expected.get(step))
    differences = [f"the losses of steps {differing} ({len(expected)} in the reference)"] if differing or not expected else []
    for epoch in range(stop_after, epochs):
        if not (resumed / f"weights_epoch{epoch}.pt").is_file():
            differences.append(f"no weights at the end of epoch {epoch}")
            continue
        mine, theirs = _weights(resumed, epoch), _weights(reference, epoch)
        same = mine["params"].keys() == theirs["params"].keys() and all(
            torch.equal(value, theirs["params"][name]) for name, value in mine["params"].items())
        if not same or mine["step"] != theirs["step"]:
            differences.append(f"the weights at the end of epoch {epoch} (step {mine['step']}, the reference's {theirs['step']})")
    return stopped_at, differences


def _assert_the_shim_resumed_exactly(result, workdir: Path, stop_after: int, epochs: int, label: str = "") -> None:
    """By the runs' records, the shim's resumed run is the reference run from the resume on; the demo's verdict (after
    ``label``) and exit status say so."""
    stopped_at, differences = _against_reference(workdir, "", stop_after, epochs)
    assert not differences, differences
    verdict = (f"{label}PASS: resumed from epoch {stop_after}, every loss from step {stopped_at + 1} on and every weight"
               " equal bit for bit.")
    assert verdict in result.stdout.splitlines() and result.returncode == 0, result.stdout


@pytest.mark.multirank
@long_runs
@needs_cpu_fsdp
def test_demo_fabric_resumes_bit_exactly_through_fabric_save_and_load(tmp_path):
    """Patched Fabric 2.0.x or native Fabric alike; Fabric's default checkpoint is sharded. Two epochs after the
    resume, so that the LR scheduler steps on the loaded optimizer."""
    result = cli("demo", "--fabric", "--epochs", "3", "--stop-after", "1", "--hidden", "8", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[3/3] resumed run" in result.stdout and "(sharded)" in result.stdout
    _assert_the_shim_resumed_exactly(result, tmp_path, 1, 3)
    meta = torch.load(tmp_path / "interrupted" / "ckpt" / "epoch=0.ckpt" / "meta.pt", weights_only=False)
    assert set(meta) == {"scheduler", "epoch", "step"}  # model and optimizer are in the shards
    assert (meta["epoch"], meta["step"], meta["scheduler"]["last_epoch"]) == (1, 16, 1)


@pytest.mark.multirank
@long_runs
@needs_cpu_fsdp
@pytest.mark.skipif(not _demo_lightning_is_patched(FABRIC), reason="the demo's Fabric is native: stock has no bug to show")
def test_demo_fabric_compare_stock_shows_stock_fabric_failing_and_the_shim_exact_with_full_files(tmp_path):
    args = ("demo", "--fabric", "--compare-stock", "--state-dict-type", "full", "--epochs", "2", "--stop-after", "1",
            "--hidden", "8", "--workdir", str(tmp_path))
    result = cli(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any("stock Fabric 2.0" in line and "lightning_fsdp_resume" in line for line in lines), result.stdout
    row = next(line.split() for line in lines if line.split()[:1] == ["1"])
    assert "resume failed: RuntimeError" in " ".join(row) and row[-1] == "0", result.stdout
    assert _against_reference(tmp_path, "stock-", 1, 2)[1], "stock Fabric's resumed run is the reference run"
    assert any(line.startswith("stock Fabric 2.0") and "FAIL: resume failed: RuntimeError: Error(s) in loading state_dict"
               in line for line in lines), result.stdout
    _assert_the_shim_resumed_exactly(result, tmp_path, 1, 2, "lightning_fsdp_resume: ")
    assert (tmp_path / "interrupted" / "ckpt" / "epoch=0.ckpt").is_file()  # --state-dict-type full: one file


@pytest.mark.multirank
@long_runs
@needs_cpu_fsdp
@pytest.mark.skipif(not _demo_lightning_is_patched(), reason="the demo's Lightning is native: stock has no bug to show")
def test_demo_compare_stock_shows_stock_lightning_wrong_and_the_shim_exact(tmp_path):
    """The main job, with stock's column beside it (the shim's plain run is the same run without that column)."""
    args = ("demo", "--compare-stock", "--epochs", "2", "--stop-after", "1", "--hidden", "8", "--workdir", str(tmp_path))
    result = cli(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "[3/5] stock-resumed run" in result.stdout and "[5/5] resumed run" in result.stdout
    assert any("stock Lightning 2.0" in line and "lightning_fsdp_resume" in line for line in lines), result.stdout
    row = next(line.split() for line in lines if line.split()[:1] == ["1"])  # epoch 1: the resumed part
    stock_failed = "resume failed:" in " ".join(row)
    assert stock_failed or float(row[4]) != 0.0, result.stdout
    assert row[-1] == "0", result.stdout  # the shim's largest difference
    assert _against_reference(tmp_path, "stock-", 1, 2)[1], "stock Lightning's resumed run is the reference run"
    assert any(line.startswith("stock Lightning 2.0") and ": FAIL: " in line for line in lines), result.stdout
    _assert_the_shim_resumed_exactly(result, tmp_path, 1, 2, "lightning_fsdp_resume: ")
    assert (tmp_path / "interrupted" / "ckpt" / "epoch=0.ckpt" / "meta.pt").is_file()


def _installed_modes():
    """Per installed flavour, what the shim does with it: patch or native (or unsupported)."""
    return {package: mode_of(version) or "unsupported" for package, version in INSTALLED.items()}


def test_status_reports_each_flavour_and_exits_by_usability():
    result = cli("status")
    modes = _installed_modes()
    assert modes, "no Lightning flavour installed"
    for package, mode in modes.items():
        shown = "patched" if mode == PATCH else mode
        assert any(line.startswith(package) and f" {shown} " in line for line in result.stdout.splitlines()), result.stdout
    assert "torch" in result.stdout and "wrapt" in result.stdout
    usable = any(mode in (PATCH, NATIVE_MODE) for mode in modes.values())
    assert result.returncode == (0 if usable else 1), result.stdout


def test_status_with_patching_off_counts_only_native_lightning():
    result = cli("status", env={"LIGHTNING_FSDP_RESUME_DISABLE": "1"})
    modes = _installed_modes()
    for package, mode in modes.items():
        if mode == PATCH:
            assert any(line.startswith(package) and " unpatched " in line for line in result.stdout.splitlines())
    native = any(mode == NATIVE_MODE for mode in modes.values())
    assert result.returncode == (0 if native else 1), result.stdout
    assert ("NOT usable" in result.stdout) == (not native)


def _write_run(directory, losses, weight):
    directory.mkdir()
    (directory / "losses.jsonl").write_text("".join(f'{{"step": {step}, "loss": {loss}}}\n' for step, loss in losses.items()))
    torch.save({"step": max(losses), "params": {"w": torch.tensor([weight])}}, directory / "weights_epoch1.pt")


@pytest.mark.parametrize("loss,weight,verdict", [(0.5, 1.0, 0), (0.5, 1.0 + 2**-20, 1), (0.50000001, 1.0, 1)])
def test_demo_verdict_demands_exact_equality(tmp_path, capsys, loss, weight, verdict):
    _write_run(tmp_path / "reference", {1: 0.7, 2: 0.5}, 1.0)
    _write_run(tmp_path / "resumed", {2: loss}, weight)
    assert _report(tmp_path / "reference", tmp_path / "resumed", 1) == verdict
    assert ("PASS" if verdict == 0 else "FAIL") in capsys.readouterr().out


@pytest.mark.parametrize("stock,shim_weight,verdict,shown", [
    ("differs", 1.0, 0, "stock Lightning 2.0.9: FAIL: the resumed run differs"),
    ("differs", 1.5, 1, "lightning_fsdp_resume: FAIL: the resumed run differs"),
    ("no output", 1.0, 0, "stock Lightning 2.0.9: FAIL: resume failed: no output"),
    ("raised", 1.0, 0, "stock Lightning 2.0.9: FAIL: resume failed: RuntimeError: Error(s) in loading state_dict"),
])
def test_demo_compare_stock_verdict_is_the_shims_and_shows_stock(tmp_path, capsys, monkeypatch, stock, shim_weight,
                                                                 verdict, shown):
    monkeypatch.setattr("lightning_fsdp_resume.demo._lightning_version", lambda kind=TRAINER: "2.0.9")
    _write_run(tmp_path / "reference", {1: 0.7, 2: 0.5}, 1.0)
    _write_run(tmp_path / "resumed", {2: 0.5}, shim_weight)
    if stock == "differs":
        _write_run(tmp_path / "stock", {2: 0.9}, 1.25)
    elif stock == "raised":
        (tmp_path / "stock").mkdir()
        (tmp_path / "stock" / "failed-rank0.txt").write_text("RuntimeError: Error(s) in loading state_dict for M:")
    assert _report(tmp_path / "reference", tmp_path / "resumed", 1, tmp_path / "stock") == verdict
    out = capsys.readouterr().out
    assert shown in out and "stock Lightning 2.0.9" in out.splitlines()[1]
    row = next(line for line in out.splitlines() if line.split()[:1] == ["1"])
    assert ("0.90000000" in row and "0.25" in row) if stock == "differs" else "resume failed" in row
    if verdict == 0:
        assert "lightning_fsdp_resume: PASS" in out


def test_demo_compare_stock_names_stock_fabric_for_fabric_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("lightning_fsdp_resume.demo._lightning_version", lambda kind=TRAINER: "2.0.9")
    _write_run(tmp_path / "reference", {1: 0.7, 2: 0.5}, 1.0)
    _write_run(tmp_path / "resumed", {2: 0.5}, 1.0)
    (tmp_path / "stock").mkdir()
    assert _report(tmp_path / "reference", tmp_path / "resumed", 1, tmp_path / "stock", FABRIC) == 0
    out = capsys.readouterr().out
    assert "stock Fabric 2.0.9" in out.splitlines()[1] and "stock Fabric 2.0.9: FAIL: resume failed: no output" in out


def test_help_lists_consolidate_and_its_arguments():
    listed = cli("--help")
    assert listed.returncode == 0 and "consolidate" in listed.stdout
    result = cli("consolidate", "--help")
    assert result.returncode == 0
    assert "SRC" in result.stdout and "DST" in result.stdout and "--overwrite" in result.stdout


def test_consolidate_without_its_arguments_is_a_usage_error():
    result = cli("consolidate", "only-one")
    assert result.returncode == 2 and "DST" in result.stderr


@needs_consolidate
def test_consolidate_refusals_exit_1_naming_the_path(tmp_path):
    missing = cli("consolidate", str(tmp_path / "nowhere"), str(tmp_path / "out.ckpt"))
    assert missing.returncode == 1
    assert f"'{tmp_path / 'nowhere'}' does not point to a valid checkpoint: it does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr

    (tmp_path / "not-sharded").mkdir()
    (tmp_path / "not-sharded" / "notes.txt").write_text("")
    not_sharded = cli("consolidate", str(tmp_path / "not-sharded"), str(tmp_path / "out.ckpt"))
    assert not_sharded.returncode == 1
    assert "does not point to a valid checkpoint: the directory has neither 'meta.pt' nor the shard index '.metadata'" in not_sharded.stderr

    for name in ("meta.pt", ".metadata"):
        (tmp_path / "not-sharded" / name).write_bytes(b"")
    (tmp_path / "out.ckpt").write_bytes(b"mine")
    exists = cli("consolidate", str(tmp_path / "not-sharded"), str(tmp_path / "out.ckpt"))
    assert exists.returncode == 1 and "Pass --overwrite" in exists.stderr
    assert (tmp_path / "out.ckpt").read_bytes() == b"mine"
    assert not exists.stdout


@pytest.mark.skipif(not needs_consolidate.args[0], reason="this torch can consolidate: the refusals above apply")
def test_consolidate_on_too_old_a_torch_exits_1_naming_the_minimum(tmp_path):
    result = cli("consolidate", str(tmp_path / "src"), str(tmp_path / "out.ckpt"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "needs torch >= 2.2" in result.stderr, result.stderr
    assert not (tmp_path / "out.ckpt").exists()
