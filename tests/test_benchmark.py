"""The benchmark runs at its smallest size on the shim side and prints every row it promises."""
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from lightning_fsdp_resume.testing import cpu_optimizer_state_supported
from support.flavours import PATCHABLE_TRAINERS
from support.marks import long_runs, needs_cpu_fsdp
from support.ranks import _run

pytestmark = [pytest.mark.multirank, needs_cpu_fsdp]

BENCHMARK = Path(__file__).parent.parent / "benchmarks" / "resume_benchmark.py"
# The object-storage rows where the S3 server can run (tox installs it)
REMOTE = ["--remote"] if all(importlib.util.find_spec(name) for name in ("moto", "s3fs", "flask")) else []
# The benchmark's use_orig_params=True needs an optimizer gather torch 2.2 cannot make on the CPU.
USE_ORIG_PARAMS = "1" if cpu_optimizer_state_supported(True)[0] else "0"
# One benchmark run is several torchrun launches (up to 4 ranks on a 2-core machine): more than one launch's limit
BENCHMARK_TIMEOUT_S = 900


def _tables(output: str):
    """Each markdown table of the output as a list of {column: cell} rows."""
    tables, header = [], None
    for line in output.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if header is None:
            header = cells
            tables.append([])
        elif not set("".join(cells)) <= {"-"}:
            tables[-1].append(dict(zip(header, cells)))
    return tables


@long_runs
def test_benchmark_reports_save_and_resume_of_both_kinds_and_the_targets(tmp_path):
    output = _run([sys.executable, str(BENCHMARK), "--width", "16", "--layers", "2", "--outputs", "1", "--use-orig-params", USE_ORIG_PARAMS, "--repeats", "1",
                   "--import-repeats", "2", "--workdir", str(tmp_path), *REMOTE], env={"LIGHTNING_FSDP_RESUME_NATIVE_PYTHON": ""},
                  timeout=BENCHMARK_TIMEOUT_S)
    figures, raw, checksums, targets, *remote = _tables(output)
    assert [(r["phase"], r["kind"], r["side"]) for r in figures] == [
        (phase, kind, "shim") for phase in ("save", "resume") for kind in ("sharded", "full")
    ] + [("async save", "sharded", "shim")]
    for row in figures:
        assert row["Lightning"].endswith(("patched", "native")), row
        assert float(row["time s"].split(";")[0]) > 0
        assert ("; stall " in row["time s"]) == (row["phase"] == "async save"), row
        for rank in (0, 1):
            assert re.fullmatch(r"-?\d+\.\d \(-?\d+\.\d–-?\d+\.\d\)", row[f"rank {rank} peak growth MB (range)"]), row
    assert [(r["phase"], r["kind"]) for r in raw] == [(phase, kind) for phase in ("save", "resume") for kind in ("sharded", "full")]
    for row in raw:
        medium = "write \\+ fsync" if row["phase"] == "save" else "cold read"
        assert re.fullmatch(rf"\d+\.\d{{3}} \({medium}\)", row["raw I/O s"]) and float(row["checkpoint MB"]) >= 0, row
        assert re.fullmatch(r"\d+\.\d\d|n/a", row["shim/raw"]), row  # n/a: a read too small to time
    assert [(r["phase"], r["kind"]) for r in checksums] == [("save", "sharded"), ("resume", "sharded"), ("resume", "full")]
    for row in checksums:
        assert float(row["shim s"]) > 0 and float(row["no checksums s"]) > 0 and re.fullmatch(r"[+-]\d+\.\d%", row["cost"]), row
    assert re.search(r"verify: [\d.]+ MB in [\d.]+ s \(\d+ MB/s\); cold read of as many bytes [\d.]+ s", output), output
    sums_targets = [row for row in targets if row["target"].startswith("checksums: ")]
    assert len(sums_targets) == 4 and all(row["met"] == "not measured" for row in sums_targets), sums_targets
    verdicts = {row["target"].split(":")[0].split(" (")[0]: row["met"] for row in targets}
    for phase in ("save", "resume"):  # a smoke-sized state is below the size the target is set for
        assert verdicts[f"sharded {phase} time / raw I/O of the same bytes, at ≥ 1500.0 MB of state"] == "not measured"
    assert verdicts["sharded resume"] in ("yes", "**NO**")
    assert verdicts["full save"] in ("yes", "**NO**")
    assert verdicts["sharded resume time shim/native"] == "not measured"  # no native side given
    assert verdicts["import lightning_fsdp_resume imports neither torch nor Lightning"] == "yes"
    background = [row for row in targets if row["target"].startswith(("async save", "sharded save: each rank"))]
    assert len(background) == 5 and all(row["met"] in ("yes", "**NO**") for row in background), background
    beyond = next(row for row in background if "less the copy alone" in row["target"])
    assert re.fullmatch(r"-?[0-9.]+ ms \(-?[0-9.]+–-?[0-9.]+\)", beyond["figure"]), beyond
    if REMOTE:
        (rows,) = remote
        assert [(r["phase"], r["kind"]) for r in rows] == [(phase, kind) for phase in ("save", "resume") for kind in ("sharded", "full")]
        for row in rows:
            assert float(row["S3 s"]) > 0 and float(row["raw S3 copy s"]) > 0 and float(row["S3/disk"]) > 0, row
    assert [p.name for p in tmp_path.iterdir()] == (["s3-server.log"] if REMOTE else []), "the checkpoints of each run are removed after it"


@long_runs
def test_scaling_reports_each_size_a_fitted_line_and_a_plot(tmp_path):
    plot = tmp_path / "scaling.png"
    output = _run([sys.executable, str(BENCHMARK), "--width", "16", "--outputs", "1", "--use-orig-params", USE_ORIG_PARAMS,
                   "--scaling", "2,4", "--repeats", "1", "--plot", str(plot), "--workdir", str(tmp_path / "work")],
                  env={"LIGHTNING_FSDP_RESUME_NATIVE_PYTHON": ""}, timeout=BENCHMARK_TIMEOUT_S)
    sizes, targets, fits = _tables(output)
    assert len(sizes) == 2 and float(sizes[0]["state GB"]) <= float(sizes[1]["state GB"]), sizes
    series = ["shim save", "shim stall", "shim later stall", "shim resume", "shim consolidate", "raw write", "raw read"]
    for row in sizes:
        assert all(float(row[f"{name} s"]) >= 0 for name in series), row
    assert [row["series"] for row in fits] == series
    for row in targets:  # a smoke-sized state is below the size the raw I/O targets are set for
        expected = "not measured" if "raw I/O" in row["target"] else "(yes|\\*\\*NO\\*\\*)"
        assert all(re.fullmatch(rf".*: {expected}", row[column]) for column in row if column != "target"), row
    predicted = next(column for column in fits[0] if column.startswith("predicted s at "))
    assert predicted == "predicted s at 84 GB", fits[0]  # 7B parameters, fp32, Adam: 3 × 4 bytes each
    if importlib.util.find_spec("matplotlib"):
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "No plot: matplotlib is not installed" in output and not plot.exists()


@long_runs
def test_rank_scaling_reports_each_rank_count_and_how_its_costs_grow(tmp_path):
    output = _run([sys.executable, str(BENCHMARK), "--width", "16", "--layers", "2", "--outputs", "1", "--use-orig-params",
                   USE_ORIG_PARAMS, "--ranks", "2,3", "--repeats", "1"], timeout=BENCHMARK_TIMEOUT_S)
    rows, checks = _tables(output)
    assert [row["ranks"] for row in rows] == ["2", "3"]
    for row in rows:
        assert all(re.fullmatch(r"-?[0-9.]+ \(-?[0-9.]+–-?[0-9.]+\)", row[f"{column} s"])
                   for column in ("save", "save beyond raw", "resume", "resume beyond raw")), row
        assert all(re.fullmatch(r"-?[0-9]+ \(-?[0-9]+–-?[0-9]+\)", row[f"async save: {column} ms"])
                   for column in ("later stall", "later stall beyond copy")), row
    # each rank writes its own file, beside .metadata and meta.pt; each rank's piece of a tensor is an item
    assert [int(row["files"]) for row in rows] == [4, 5]
    assert int(rows[1]["DCP items"]) > int(rows[0]["DCP items"])
    assert [row["grows no faster than the ranks"] for row in checks] == [
        f"{column}: 3 ranks / 2" for column in ("save beyond raw", "resume beyond raw", "later stall beyond copy", "items",
                                                "metadata")]
    assert all(re.fullmatch(r"yes|\*\*NO\*\*", row["met"]) for row in checks), checks


DATA_POSITION = Path(__file__).parent.parent / "benchmarks" / "data_position.py"


@pytest.mark.skipif(not PATCHABLE_TRAINERS, reason="the data position is the patched Trainer's (native Lightning has none)")
def test_the_data_position_benchmark_reports_both_ways_and_its_target(tmp_path):
    """One process, no ranks: a small epoch, each way's median and spread, and the ratio against its target."""
    output = _run([sys.executable, str(DATA_POSITION), "--batches", "200", "--repeats", "3"])
    (rows,) = _tables(output)
    assert [row["way"] for row in rows] == ["left out by index (skip)", "loaded and dropped (replay)"]
    assert all(re.fullmatch(r"[0-9.]+ s", row["median"]) and re.fullmatch(r"[0-9.]+–[0-9.]+ s", row["spread (min–max)"])
               for row in rows)
    assert re.search(r"skip / replay: [0-9.]+ \(target ≤ 0\.01\): (met|MISSED)", output)
    assert "loaded and dropped the" not in output  # the replays' warnings are the table's, not lines of their own


DATA_CURSOR = Path(__file__).parent.parent / "benchmarks" / "data_cursor.py"


def test_the_data_cursor_benchmark_rows_agree_with_their_figures_and_targets(tmp_path):
    """A small epoch placed on 1 and 3 ranks: each row's share is the rest of the epoch over those ranks (the cursor)
    or of rank 0's own share (the walk), and each verdict is what its figures and the targets make it."""
    rows_at = tmp_path / "rows.json"
    _run([sys.executable, str(DATA_CURSOR), "--size", "20000", "--ranks", "1,3", "--repeats", "1", "--json", rows_at])
    rows = json.loads(rows_at.read_text())
    assert [(row["ranks"], row["way"]) for row in rows] == [(1, "cursor"), (1, "walk"), (3, "cursor"), (3, "walk")]
    rest, per_rank = 20000 - 20000 * 9 // 10 // 16 * 16, 10000 - 20000 * 9 // 10 // 16 * 8
    assert [row["share"] for row in rows] == [rest, per_rank, -(-rest // 3), per_rank]
    for row in rows:
        met = row["seconds"] <= 1.0 and row["mb"] <= 100
        assert row["verdict"] == ({True: "met", False: "MISSED"}[met] if row["way"] == "cursor" else "-"), row
        assert row["seconds"] > 0 and row["seconds_spread"] >= 0 and row["mb_spread"] >= 0
