"""The benchmarks at their smallest sizes: every row they promise is there, and each printed ratio and verdict is what
the figures behind it make it (their ``--json`` records). Speed is theirs to report, never asserted here."""
import json
import math
import operator
import re
import statistics
import sys
from pathlib import Path

import pytest

from support.flavours import PATCHABLE_TRAINERS, TORCH
from support.marks import ORIG_PARAMS_OPTIMIZER_STATE_ON_CPU, S3_PACKAGES, importable, long_runs, needs_cpu_fsdp, needs_patched_trainer
from support.ranks import _run

pytestmark = [pytest.mark.multirank, needs_cpu_fsdp]

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
BENCHMARK = BENCHMARKS / "resume_benchmark.py"
# The benchmark's use_orig_params=True needs an optimizer gather torch 2.2 cannot make on the CPU.
USE_ORIG_PARAMS = "1" if ORIG_PARAMS_OPTIMIZER_STATE_ON_CPU else "0"
# One benchmark run is several torchrun launches (up to 4 ranks on a 2-core machine): more than one launch's limit
BENCHMARK_TIMEOUT_S = 900

# The targets each run and each --scaling size is checked against, by the start of their names
BACKGROUND_TARGETS = [
    "async save: training blocked / synchronous sharded save time",
    "async save, a later save (its host buffers kept): training blocked / synchronous sharded save time",
    "async save, a later save: training blocked less the copy alone (slowest rank; median, min–max)",
    "sharded save: each rank's peak growth",
    "async save: each rank's peak growth",
]
SIZED_TARGETS = [  # set for a state of 1.5 GB and more: not measured at the sizes here
    "sharded save time / raw I/O of the same bytes", "sharded resume time / raw I/O of the same bytes",
    "checksums: sharded save time added", "checksums: sharded resume time added", "checksums: full resume time added",
    "checksums: verify time / cold read of the same bytes",
]
RUN_TARGETS = [
    "sharded resume: per-rank peak growth", "full save: peak growth of every rank but 0",
    "sharded resume time shim/native", "full resume time shim/native", "sharded save time shim/native",
    "full resume peak growth shim/native (worst rank)",
    *SIZED_TARGETS[:2], *BACKGROUND_TARGETS, *SIZED_TARGETS[2:],
    "import lightning_fsdp_resume after import wrapt", "import lightning_fsdp_resume imports neither torch nor Lightning",
]
SCALING_TARGETS = [*BACKGROUND_TARGETS, "sharded save / raw I/O", "sharded resume / raw I/O"]

# How a checked figure's value is made of the figures its record names (resume_benchmark.judged)
FORMULAS = {
    "ratio": lambda a, b: a / b if b > 0 else None,
    "added": lambda a, b: a / b - 1 if b > 0 else None,
    "difference": operator.sub,
    "worst": lambda *values: max(values),
    "median": lambda *values: statistics.median(values),
    "count": len,
    "over": lambda growth, shard, shards, allowance: max(g - (shards * s + allowance) for g, s in zip(growth, shard)),
}
VERDICTS = {None: "not measured", True: "yes", False: "**NO**"}
UNITS = {"": 1, "%": 100, " MB": 1e-6, " ms": 1e3}  # a printed figure's unit, from the records' (seconds, bytes, ratios)


def _tables(output: str):
    """Each markdown table of the output as a list of rows, the header first, each a list of cells."""
    tables, inside = [], False
    for line in output.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not inside:
                tables.append([])
            if not set("".join(cells)) <= {"-"}:
                tables[-1].append(cells)
        inside = line.startswith("|")
    return tables


def _printed(table):
    """A table's rows as {column: cell}."""
    return [dict(zip(table[0], row)) for row in table[1:]]


def _shows(cell: str, value: float) -> bool:
    """Whether ``cell`` begins with ``value``: in the cell's unit, to its last printed digit."""
    number, decimals, unit = re.match(r"\+?([+-]?\d+(?:\.(\d+))?)(%| MB| ms)?", cell).groups()  # "+-": the import's
    scaled = value * UNITS[unit or ""]
    return abs(float(number) - scaled) <= 0.5 * 10 ** -len(decimals or "") + 1e-9 * max(1.0, abs(scaled))


def _names(records):
    return [re.split(r" ≤ |, at ≥ | \(median of", record["cells"]["target"])[0] for record in records]


def _agrees(record, state: float, figure: str = "figure") -> None:
    """A checked figure's record: its value is its formula of its figures; its verdict that value against its limit,
    not measured without one or below the state it is set from; its cells show the value and the limit."""
    value = FORMULAS[record["formula"]](*record["of"]) if record["of"] else None
    assert record["value"] == (None if value is None else pytest.approx(value, rel=1e-12)), record
    measured = value is not None and state >= record.get("from state", -math.inf)
    met = ((value < record["limit"]) if record["strict"] else (value <= record["limit"])) if measured else None
    cells = record["cells"]
    assert cells["met"] == VERDICTS[met] and record.get("state", state) == state, record
    if value is None:
        assert cells[figure].startswith("n/a"), record
    elif record["formula"] == "over":  # each rank's growth of its shard, in MB
        growth, shard = record["of"][:2]
        numbers = [float(n) for n in re.findall(r"-?\d+\.\d", cells[figure])]
        assert numbers == pytest.approx([b / 1e6 for pair in zip(growth, shard) for b in pair], abs=0.051), record
    elif record["formula"] == "count":
        assert (cells[figure] == "none imported") == (value == 0), record
    else:
        assert _shows(cells[figure], value), record
    if cells["limit"][:2] in ("≤ ", "< "):
        assert (cells["limit"][0] == "<") == record["strict"] and _shows(cells["limit"][2:], record["limit"]), record


@long_runs
def test_benchmark_reports_save_and_resume_of_both_kinds_and_the_targets(tmp_path):
    remote = ["--remote"] if importable("s3", *S3_PACKAGES) else []  # the object-storage rows where the S3 server runs
    work, records_at = tmp_path / "work", tmp_path / "records.json"
    output = _run([sys.executable, str(BENCHMARK), "--width", "16", "--layers", "2", "--outputs", "1", "--use-orig-params", USE_ORIG_PARAMS,
                   "--repeats", "1", "--import-repeats", "2", "--workdir", str(work), "--json", str(records_at), *remote],
                  env={"LIGHTNING_FSDP_RESUME_NATIVE_PYTHON": ""}, timeout=BENCHMARK_TIMEOUT_S)
    records = json.loads(records_at.read_text(encoding="utf-8"))
    names = ["figures", "raw", "checksums", "targets", *(["remote"] if remote else [])]
    tables = _tables(output)
    assert [_printed(table) for table in tables] == [[row["cells"] for row in records[name]] for name in names]
    figures = {(row["phase"], row["kind"]): row for row in records["figures"]}
    assert [(r["phase"], r["kind"], r["side"]) for r in records["figures"]] == [
        (phase, kind, "shim") for phase in ("save", "resume") for kind in ("sharded", "full")
    ] + [("async save", "sharded", "shim")]
    for row in records["figures"]:
        assert row["time"] == statistics.median(row["times"]) and _shows(row["cells"]["time s"], row["time"]), row
        assert ("; stall " in row["cells"]["time s"]) == (row["phase"] == "async save"), row
        for rank, growth in enumerate(row["growth"]):
            assert _shows(row["cells"][f"rank {rank} peak growth MB (range)"], growth / 1e6), row
    assert [(r["phase"], r["kind"]) for r in records["raw"]] == [(phase, kind) for phase in ("save", "resume") for kind in ("sharded", "full")]
    for row in records["raw"]:
        medium = "write" if row["phase"] == "save" else "read"
        assert row["shim"] == figures[(row["phase"], row["kind"])]["time"], row
        assert row["raw"] == statistics.median(io[medium] for io in records["raw I/O"][row["kind"]]), row
        ratio = FORMULAS["ratio"](row["shim"], row["raw"])  # none: a read too small to time
        assert row["cells"]["shim/raw"] == "n/a" if ratio is None else _shows(row["cells"]["shim/raw"], ratio), row
    assert [(r["phase"], r["kind"]) for r in records["checksums"]] == [("save", "sharded"), ("resume", "sharded"), ("resume", "full")]
    for row in records["checksums"]:
        assert row["with"] == figures[(row["phase"], row["kind"])]["time"] and _shows(row["cells"]["cost"], row["with"] / row["without"] - 1), row
    assert re.search(r"verify: [\d.]+ MB in [\d.]+ s \(\d+ MB/s\); cold read of as many bytes [\d.]+ s", output), output

    targets = records["targets"]
    assert _names(targets) == RUN_TARGETS
    state = figures[("resume", "sharded")]["full_state"]
    for target in targets:
        _agrees(target, state)
    by_name = dict(zip(RUN_TARGETS, targets))
    save, background = figures[("save", "sharded")], figures[("async save", "sharded")]
    (verified,), imports = records["verify"], records["imports"]
    expected_of = {  # each target's figures, as the tables above (and the imports measured) give them
        "sharded resume: per-rank peak growth": figures[("resume", "sharded")]["growth"],
        "full save: peak growth of every rank but 0": figures[("save", "full")]["growth"][1:],
        "sharded save time / raw I/O of the same bytes": [records["raw"][0]["shim"], records["raw"][0]["raw"]],
        "sharded resume time / raw I/O of the same bytes": [records["raw"][2]["shim"], records["raw"][2]["raw"]],
        BACKGROUND_TARGETS[0]: [background["stall"], save["time"]],
        BACKGROUND_TARGETS[1]: [background["stall_again"], save["time"]],
        BACKGROUND_TARGETS[2]: background["beyond_copies"],
        BACKGROUND_TARGETS[3]: [save["growth"], save["shard"], *by_name[BACKGROUND_TARGETS[3]]["of"][2:]],
        BACKGROUND_TARGETS[4]: [background["growth"], background["shard"], *by_name[BACKGROUND_TARGETS[4]]["of"][2:]],
        **{f"checksums: {r['kind']} {r['phase']} time added": [r["with"], r["without"]] for r in records["checksums"]},
        "checksums: verify time / cold read of the same bytes": [verified["seconds"], verified["raw"]],
        "import lightning_fsdp_resume after import wrapt": [imports["wrapt_and_shim"], imports["wrapt"]],
        "import lightning_fsdp_resume imports neither torch nor Lightning": [imports["heavy_imported"]],
    }
    assert {name: by_name[name]["of"] for name in expected_of} == expected_of
    assert all(not by_name[name]["of"] for name in RUN_TARGETS if "shim/native" in name)  # no native side given
    # a smoke-sized state is below the size these targets are set for; the import's never pulls in torch
    assert {by_name[name]["cells"]["met"] for name in SIZED_TARGETS} == {"not measured"}
    assert by_name[RUN_TARGETS[-1]]["cells"]["met"] == "yes"
    if remote:
        assert [(r["phase"], r["kind"]) for r in records["remote"]] == [(phase, kind) for phase in ("save", "resume") for kind in ("sharded", "full")]
        for row in records["remote"]:
            assert row["disk"] == figures[(row["phase"], row["kind"])]["time"], row
            assert _shows(row["cells"]["S3/disk"], row["s3"] / row["disk"]) and _shows(row["cells"]["S3/raw copy"], row["s3"] / row["raw"]), row
    assert [p.name for p in work.iterdir()] == (["s3-server.log"] if remote else []), "the checkpoints of each run are removed after it"


@long_runs
def test_scaling_reports_each_size_a_fitted_line_and_a_plot(tmp_path):
    plot, records_at = tmp_path / "scaling.png", tmp_path / "records.json"
    output = _run([sys.executable, str(BENCHMARK), "--width", "16", "--outputs", "1", "--use-orig-params", USE_ORIG_PARAMS,
                   "--scaling", "2,4", "--repeats", "1", "--plot", str(plot), "--workdir", str(tmp_path / "work"), "--json",
                   str(records_at)], env={"LIGHTNING_FSDP_RESUME_NATIVE_PYTHON": ""}, timeout=BENCHMARK_TIMEOUT_S)
    records = json.loads(records_at.read_text(encoding="utf-8"))
    sizes, verdicts, fits = _tables(output)
    rows = records["sizes"]
    assert _printed(sizes) == [row["cells"] for row in rows] and _printed(fits) == [fit["cells"] for fit in records["fits"]]
    assert [row["layers"] for row in rows] == [2, 4] and rows[0]["state"] < rows[1]["state"], rows
    series = ["shim save", "shim stall", "shim later stall", "shim resume", "shim consolidate", "raw write", "raw read"]
    assert [fit["series"] for fit in records["fits"]] == series
    for row in rows:
        assert all(row[name] >= 0 and _shows(row["cells"][f"{name} s"], row[name]) for name in series), row
        assert _names(row["targets"]) == SCALING_TARGETS
        for target in row["targets"]:
            _agrees(target, row["state"])
        raw_save, raw_resume = row["targets"][-2:]
        assert raw_save["of"] == [row["shim save"], row["raw write"]] and raw_resume["of"] == [row["shim resume"], row["raw read"]]
        assert {raw_save["cells"]["met"], raw_resume["cells"]["met"]} == {"not measured"}  # below the size they are set for
    # the table of verdicts: a row a target, a column a size, each cell that size's figure and verdict
    assert verdicts[0] == ["target", *(f"{row['state'] / 1e9:.2f} GB" for row in rows)]
    assert verdicts[1:] == [[target["cells"]["target"], *(f"{row['targets'][index]['cells']['figure']}: {row['targets'][index]['cells']['met']}"
                                                         for row in rows)] for index, target in enumerate(rows[0]["targets"])]
    (x0, x1) = (row["state"] / 1e9 for row in rows)  # two sizes: the fitted line is the one through both
    for fit in records["fits"]:
        y0, y1 = (row[fit["series"]] for row in rows)
        slope = (y1 - y0) / (x1 - x0)
        assert (fit["b"], fit["a"]) == pytest.approx((slope, y0 - slope * x0), rel=1e-6, abs=1e-6), fit
        assert fit["predicted"] == pytest.approx(fit["a"] + fit["b"] * fit["at GB"])
        assert all(_shows(fit["cells"][column], fit[key]) for column, key in (("a s", "a"), ("b s/GB", "b"))), fit
        assert _shows(fit["cells"][f"predicted s at {fit['at GB']:.0f} GB"], fit["predicted"]), fit
    assert fits[0][-1] == "predicted s at 84 GB"  # 7B parameters, fp32, Adam: 3 × 4 bytes each
    if importable("plot", "matplotlib"):
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "No plot: matplotlib is not installed" in output and not plot.exists()


@long_runs
def test_rank_scaling_reports_each_rank_count_and_how_its_costs_grow(tmp_path):
    records_at = tmp_path / "records.json"
    output = _run([sys.executable, str(BENCHMARK), "--width", "16", "--layers", "2", "--outputs", "1", "--use-orig-params",
                   USE_ORIG_PARAMS, "--ranks", "2,3", "--repeats", "1", "--json", str(records_at)], timeout=BENCHMARK_TIMEOUT_S)
    records = json.loads(records_at.read_text(encoding="utf-8"))
    rows, checks = _tables(output)
    assert _printed(rows) == [row["cells"] for row in records["ranks"]] and _printed(checks) == [c["cells"] for c in records["checks"]]
    assert [row["ranks"] for row in records["ranks"]] == [2, 3]
    for row in records["ranks"]:
        for column in ("save", "save beyond raw", "resume", "resume beyond raw"):
            assert _shows(row["cells"][f"{column} s"], statistics.median(row[column])), row
        for column in ("later stall", "later stall beyond copy"):
            assert _shows(row["cells"][f"async save: {column} ms"], statistics.median(row[column]) * 1e3), row
    # each rank writes its own file, beside .metadata and meta.pt; each rank's piece of a tensor is an item
    assert [row["files"] for row in records["ranks"]] == [4, 5]
    assert records["ranks"][1]["items"] > records["ranks"][0]["items"]
    columns = ("save beyond raw", "resume beyond raw", "later stall beyond copy", "items", "metadata")
    assert [check["cells"]["grows no faster than the ranks"] for check in records["checks"]] == [f"{column}: 3 ranks / 2" for column in columns]
    first, last = records["ranks"]
    for check, column in zip(records["checks"], columns):
        assert check["of"] == [statistics.median(row[column]) if isinstance(row[column], list) else row[column] for row in (last, first)]
        assert check["limit"] == 3 / 2, check  # the ranks grew by that
        _agrees(check, first["state"], figure="ratio")


@pytest.mark.skipif(not PATCHABLE_TRAINERS, reason="the data position is the patched Trainer's (native Lightning has none)")
def test_the_data_position_benchmark_reports_both_ways_and_its_target(tmp_path):
    """One process, no ranks: a small epoch, each way's median and spread, and the ratio of the medians against its
    target, the verdict what they make it."""
    record_at = tmp_path / "record.json"
    output = _run([sys.executable, str(BENCHMARKS / "data_position.py"), "--batches", "200", "--repeats", "3", "--json", str(record_at)])
    record = json.loads(record_at.read_text(encoding="utf-8"))
    (table,) = _tables(output)
    assert _printed(table) == [way["cells"] for way in record["ways"]]
    assert [way["cells"]["way"] for way in record["ways"]] == ["left out by index (skip)", "loaded and dropped (replay)"]
    for way in record["ways"]:
        low, high = re.fullmatch(r"([0-9.]+)–([0-9.]+) s", way["cells"]["spread (min–max)"]).groups()
        assert _shows(way["cells"]["median"], statistics.median(way["times"])), way
        assert _shows(low, min(way["times"])) and _shows(high, max(way["times"])), way
    skip, replay = (statistics.median(way["times"]) for way in record["ways"])
    ratio, limit, verdict = re.search(r"skip / replay: ([0-9.]+) \(target ≤ ([0-9.]+)\): (met|MISSED)", output).groups()
    assert _shows(ratio, skip / replay) and float(limit) == record["limit"], output
    assert verdict == record["verdict"] == ("met" if skip / replay <= record["limit"] else "MISSED"), output
    assert "loaded and dropped the" not in output  # the replays' warnings are the table's, not lines of their own


def test_the_ema_cost_benchmark_rows_agree_with_their_figures_and_targets(tmp_path):
    """Two small models on 2 ranks, one step a repeat: each row's times are its slowest rank's, its ratios are made of
    them and of each rank's memory, and its verdict is what they and the targets make it."""
    rows_at = tmp_path / "rows.json"
    output = _run([sys.executable, str(BENCHMARKS / "ema_cost.py"), "--sizes", "0.01,0.03", "--repeats", "3", "--steps", "1",
                   "--json", str(rows_at)])
    rows = json.loads(rows_at.read_text(encoding="utf-8"))
    (table,) = _tables(output)
    assert _printed(table) == [row["cells"] for row in rows]
    assert [(row["cells"]["state"], len(row["ranks"])) for row in rows] == [("0.01 GB", 2), ("0.03 GB", 2)]
    for row in rows:
        steps, updates = ([max(times) for times in zip(*(rank[key] for rank in row["ranks"]))] for key in ("steps", "updates"))
        assert (row["steps"], row["updates"]) == (steps, updates) and len(steps) == 3, row
        assert _shows(row["cells"]["optimizer step"], statistics.median(steps)) and _shows(row["cells"]["EMA update"], statistics.median(updates))
        ratio = statistics.median(updates) / statistics.median(steps)
        memory = max(rank["grown"] / rank["shard_bytes"] for rank in row["ranks"])
        shown_ratio, update_limit = re.fullmatch(r"(-?[0-9.]+) \(≤ ([0-9.]+)\)", row["cells"]["update / step"]).groups()
        shown_memory, memory_limit, verdict = re.fullmatch(r"(-?[0-9.]+) \(≤ ([0-9.]+)\) (met|missed)",
                                                           row["cells"]["average's memory / fp32 shard"]).groups()
        assert _shows(shown_ratio, ratio) and _shows(shown_memory, memory), row
        assert (float(update_limit), float(memory_limit)) == (row["update limit"], row["memory limit"]), row
        assert verdict == row["verdict"] == ("met" if ratio <= row["update limit"] and memory <= row["memory limit"] else "missed"), row


def test_the_data_cursor_benchmark_rows_agree_with_their_figures_and_targets(tmp_path):
    """A small epoch placed on 1 and 3 ranks: each row's share is the rest of the epoch over those ranks (the cursor)
    or of rank 0's own share (the walk), and each verdict is what its figures and the targets make it."""
    rows_at = tmp_path / "rows.json"
    _run([sys.executable, str(BENCHMARKS / "data_cursor.py"), "--size", "20000", "--ranks", "1,3", "--repeats", "1", "--json", rows_at])
    rows = json.loads(rows_at.read_text())
    assert [(row["ranks"], row["way"]) for row in rows] == [(1, "cursor"), (1, "walk"), (3, "cursor"), (3, "walk")]
    rest, per_rank = 20000 - 20000 * 9 // 10 // 16 * 16, 10000 - 20000 * 9 // 10 // 16 * 8
    assert [row["share"] for row in rows] == [rest, per_rank, -(-rest // 3), per_rank]
    for row in rows:
        met = row["seconds"] <= 1.0 and row["mb"] <= 100
        assert row["verdict"] == ({True: "met", False: "MISSED"}[met] if row["way"] == "cursor" else "-"), row
        assert row["seconds"] > 0 and row["seconds_spread"] >= 0 and row["mb_spread"] >= 0


# save_shadow.py's targets, the limits, named with each size's state (in GB)
SHADOW_TARGETS = {"background save's shadow / sync save's shadow": 0.3, "sync save / raw write of its files": 1.3,
                  "first background stall / sync save": 0.05, "ShardedEMA update / step at update_every_n_steps=1": 0.02}
SHADOW_SAVES = ["none", "sync", "background"]


@pytest.fixture(scope="module")
def shadow_run(tmp_path_factory):
    """save_shadow.py once, at its smallest: 0.01 GB on 2 ranks, 2 trials of 4-step windows saving after the first step,
    ShardedEMA every step and every 2. Its output and its records."""
    tmp = tmp_path_factory.mktemp("shadow")
    records_at = tmp / "records.json"
    output = _run([sys.executable, str(BENCHMARKS / "save_shadow.py"), "--sizes", "0.01", "--trials", "2", "--steps", "4",
                   "--save-at", "1", "--ema-every", "1,2", "--workdir", str(tmp), "--json", str(records_at)])
    assert [p.name for p in tmp.iterdir()] == ["records.json"], "the checkpoints and raw files of each trial are removed"
    return output, json.loads(records_at.read_text(encoding="utf-8"))


def _shows_median_and_spread(cell: str, values, scale: float = 1.0) -> bool:
    """Whether ``cell`` holds the median of ``values`` with their min–max in brackets (times ``scale``: 1e3 for ms)."""
    median, low, high = re.search(r"(-?[\d.]+) \((-?[\d.]+)–(-?[\d.]+)\)", cell).groups()
    return all(_shows(shown, value * scale) for shown, value in
               ((median, statistics.median(values)), (low, min(values)), (high, max(values))))


def _slowest(windows):
    """A window of every rank as the slowest rank's: the longest window and step, and the steps that began while a
    rank's save was being written (from its call to its being in place)."""
    steps = [max(step) for step in zip(*([b - a for a, b in zip([0.0, *w["stamps"]], w["stamps"])] for w in windows))]
    during = [any(w["saved_at"] is not None and w["saved_at"] <= begun < w["written"] for w, begun in zip(windows, begun_on))
              for begun_on in zip(*([0.0, *w["stamps"][:-1]] for w in windows))]
    return max(w["window"] for w in windows), steps, during


@needs_patched_trainer
def test_the_save_shadow_benchmark_takes_each_shadow_from_its_own_trials_windows(shadow_run):
    """Each trial's windows are the slowest rank's, each shadow that window less the same trial's window without a save,
    the steps during the write those that began between the save's call and its being in place; a window's CPU is what
    every rank's process took in it, its CPU shadow that less the same trial's without a save; each row shows the
    medians of those figures over the trials, with their spread."""
    _, records = shadow_run
    (size,) = records["sizes"]
    assert len(size["trials"]) == 2 and len(size["ranks"]) == 2
    for index, trial in enumerate(size["trials"]):
        per_rank = [rank["trials"][index] for rank in size["ranks"]]
        for save in SHADOW_SAVES:
            window, steps, during = _slowest([r[save] for r in per_rank])
            shown = trial["windows"][save]
            assert (shown["window"], shown["steps"], shown["during"]) == (window, steps, during) and len(steps) == 4, save
            assert all(0 < r[save]["cpu"] for r in per_rank) and shown["cpu"] == sum(r[save]["cpu"] for r in per_rank), save
            if save != "none":
                assert trial["shadow"][save] == window - trial["windows"]["none"]["window"], save
                assert trial["cpu"][save] == shown["cpu"] - trial["windows"]["none"]["cpu"], save
                assert shown["stall"] == max(r[save]["stall"] for r in per_rank), save
                assert shown["written"] == max(r[save]["written"] - r[save]["saved_at"] for r in per_rank), save
        assert not any(trial["windows"]["sync"]["during"]) and not any(trial["windows"]["background"]["during"][:1])
        assert trial["step"] == statistics.median(trial["windows"]["none"]["steps"])
        assert trial["during"] == [s for s, d in zip(trial["windows"]["background"]["steps"], trial["windows"]["background"]["during"]) if d]
    rows = records["windows"]
    assert [row["save"] for row in rows] == SHADOW_SAVES
    for row in rows:
        trials = size["trials"]
        assert row["windows"] == [t["windows"][row["save"]]["window"] for t in trials]
        assert _shows_median_and_spread(row["cells"]["window s"], row["windows"]), row
        assert row["window cpu"] == [t["windows"][row["save"]]["cpu"] for t in trials]
        assert _shows_median_and_spread(row["cells"]["CPU s"], row["window cpu"]), row
        if row["save"] == "none":
            assert row["step"] == [t["step"] for t in trials] and _shows_median_and_spread(row["cells"]["median step ms"], row["step"], 1e3)
            continue
        for key, cell in (("shadow", "shadow s"), ("cpu", "CPU shadow s"), ("stall", "stall s"), ("written", "in place after s")):
            figures = [t[key][row["save"]] if key in ("shadow", "cpu") else t["windows"][row["save"]][key] for t in trials]
            assert row[key] == figures and _shows_median_and_spread(row["cells"][cell], figures), (row, key)
        counts = [sum(t["windows"][row["save"]]["during"]) for t in trials]
        assert row["during"] == counts and row["cells"]["steps during the write"] == f"{statistics.median(counts):g} of 4", row
    background = rows[2]
    if background["step during"]:
        assert background["step during"] == [statistics.median(t["during"]) for t in size["trials"] if t["during"]]
        assert background["during / without"] == statistics.median(background["step during"]) / statistics.median(background["step without"])
        assert _shows_median_and_spread(background["cells"]["median step ms"], background["step during"], 1e3), background


@needs_patched_trainer
def test_the_save_shadow_benchmark_rows_of_the_disk_and_of_shardedema_agree_with_their_figures(shadow_run):
    """The raw write is as many files and bytes as the synchronous save wrote, its time the slowest rank's, its CPU and
    the background save's writing threads' every rank's; ShardedEMA's
    window holds steps / n updates for each n, its time per step is the slowest rank's total over the window's steps, and
    its share of a step the median of that over the median step without a save."""
    _, records = shadow_run
    (size,), (disk,) = records["sizes"], records["disk"]
    trials = size["trials"]
    for index, trial in enumerate(trials):
        per_rank = [rank["trials"][index] for rank in size["ranks"]]
        files = per_rank[0]["files"]
        assert all(r["files"] == files for r in per_rank) and "meta.pt" in dict(files)
        assert trial["raw"] == {"seconds": max(r["raw"]["seconds"] for r in per_rank), "cpu": sum(r["raw"]["cpu"] for r in per_rank),
                                "bytes": sum(size for _, size in files), "files": len(files)}
        writes = [r["background"].get("write cpu") for r in per_rank]  # torch < 2.3 saves in the foreground: no thread
        assert all(w is not None and w > 0 for w in writes) if TORCH >= (2, 3) else writes == [None, None], writes
        assert trial["write cpu"] == sum(w or 0.0 for w in writes)
        assert trial["saved bytes"] == trial["raw"]["bytes"] and [r["raw"]["files"] for r in per_rank] == [len(files) - 1, 1]
        for n, ema in trial["ema"].items():
            updates = [r["ema"][n]["updates"] for r in per_rank]
            assert [len(u) for u in updates] == [4 // int(n)] * 2 and ema["updates"] == 4 // int(n), n
            assert ema["update"] == max(statistics.median(u) for u in updates) and ema["per step"] == max(sum(u) for u in updates) / 4, n
    assert (disk["sync"], disk["raw"]) == ([t["windows"]["sync"]["stall"] for t in trials], [t["raw"]["seconds"] for t in trials])
    assert disk["stall"] == [t["windows"]["background"]["stall"] for t in trials]
    assert (disk["write cpu"], disk["raw cpu"]) == ([t["write cpu"] for t in trials], [t["raw"]["cpu"] for t in trials])
    for key, cell in (("sync", "sync save s"), ("raw", "raw write s"), ("stall", "first background stall s"),
                      ("write cpu", "background write CPU s"), ("raw cpu", "raw write CPU s")):
        assert _shows_median_and_spread(disk["cells"][cell], disk[key]), (disk, key)
    assert _shows(disk["cells"]["write CPU / raw"], statistics.median(disk["write cpu"]) / statistics.median(disk["raw cpu"]))
    assert disk["cells"]["checkpoint MB"] == f"{trials[0]['saved bytes'] / 1e6:.1f} in {trials[0]['raw']['files']} files"
    assert [row["every"] for row in records["ema"]] == [1, 2] and size["ema steps"] == 4
    for row in records["ema"]:
        per_step, step = [t["ema"][str(row["every"])]["per step"] for t in trials], [t["step"] for t in trials]
        assert (row["per step"], row["step"]) == (per_step, step) and row["share"] == statistics.median(per_step) / statistics.median(step)
        assert _shows_median_and_spread(row["cells"]["per step ms"], per_step, 1e3) and _shows_median_and_spread(row["cells"]["step ms"], step, 1e3)
        assert _shows_median_and_spread(row["cells"]["update ms"], row["update"], 1e3) and _shows(row["cells"]["share of a step"], row["share"])


@needs_patched_trainer
def test_the_save_shadow_benchmark_judges_every_target_from_the_medians_of_its_rows_and_prints_its_records(shadow_run):
    """A target a size for each of the issue's four, named, with its limit; each the ratio of two medians of the rows
    above, its verdict what value and limit make it; every printed table is its records' cells."""
    output, records = shadow_run
    (size,) = records["sizes"]
    targets = records["targets"]
    gb = f"{size['state'] / 1e9:.2f} GB"
    assert [t["cells"]["target"] for t in targets] == [f"{name}, {gb}" for name in SHADOW_TARGETS]
    assert [t["limit"] for t in targets] == list(SHADOW_TARGETS.values())
    windows, (disk,), ema = {row["save"]: row for row in records["windows"]}, records["disk"], records["ema"][0]
    medians = [[windows["background"]["shadow"], windows["sync"]["shadow"]], [disk["sync"], disk["raw"]], [disk["stall"], disk["sync"]],
               [ema["per step"], ema["step"]]]
    for target, (over, under) in zip(targets, medians):
        assert target["formula"] == "ratio" and target["of"] == [statistics.median(over), statistics.median(under)], target
        _agrees(target, size["state"])
    assert _tables(output) == [[list(rows[0]["cells"]), *([*row["cells"].values()] for row in rows)]
                               for rows in (records["windows"], records["disk"], records["ema"], targets)]
