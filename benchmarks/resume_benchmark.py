"""Save and resume FSDP checkpoints, sharded and full, on 2 ranks: the shim against native Lightning.

Run it with the Python of an environment holding Lightning 2.0.x (the shim side); give the Python of an
environment with native Lightning 2.1.x and the same torch (``--native-python`` or the environment
variable below) to measure both sides, interleaved, and print shim/native ratios. Each repeat launches,
per side and checkpoint kind, one torchrun job that trains a step and saves, and one that resumes in
new processes (``checkpoint_ranks.py``), and the shim's sharded save with ``AsyncCheckpointIO`` (how long it
blocks training, how long until it is written, and each rank's memory against its shard). Then it times
``import lightning_fsdp_resume``.

    python benchmarks/resume_benchmark.py --native-python /path/to/native-env/bin/python

``--consolidate`` also measures ``consolidate``'s peak memory for each output format on a sharded
checkpoint the shim saves; ``--consolidate-from DIR`` measures only that, on the sharded checkpoint DIR.
``--scaling 8,32,80`` instead measures the sharded save, its stall in the background, the resume and
``consolidate`` at each of those ``--layers`` counts (0.4, 1.6 and 4.0 GB of state at the default width), with
native's and the disk's raw I/O, the targets at each size, a fitted line and what it predicts for a 7B model;
``--plot PNG`` draws it (matplotlib: the ``[plot]`` extra).
``--ranks 2,4,8,16`` instead saves and resumes the same state sharded on each of those numbers of ranks
(``--repeats`` each): the slowest rank's time, the part of it beyond the disk's raw write or read of the same bytes
(planning, agreement, the index; on a small machine also the processes sharing its cores), and the index's size.
``--remote`` also saves and resumes each kind to an S3-compatible server it starts on 127.0.0.1 (moto's, as
the tests do; needs the [s3] extra and moto), against the same on the local disk and against copying the
same bytes to and from the server with s3fs.
``--json PATH`` also writes the records behind every table it prints: each row's cells beside the figures they are
made of, and each target's value, limit and verdict.

Exits 1 when a run fails or the shim import pulls in torch or Lightning; missed targets are reported
in the tables, not in the exit status.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import import_time

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RANK_PROGRAM = HERE / "checkpoint_ranks.py"
NATIVE_PYTHON_ENV = "LIGHTNING_FSDP_RESUME_NATIVE_PYTHON"
RANKS = 2
PHASES = ("save", "resume")
KINDS = ("sharded", "full")
PHASE_KINDS = tuple((phase, kind) for phase in PHASES for kind in KINDS)
ASYNC = "async save"  # the shim's sharded save with AsyncCheckpointIO, measured until the checkpoint is in place
# its first save comes after this many steps, and the rank program waits for the host buffers made after the first
# one before it times it, as a run's first save after many steps finds them made (how long it waited is printed)
ASYNC_SAVE_AFTER_STEPS = 3
UNCHECKED = "no checksums"  # the shim with its checksums switched off in the rank processes: their cost, by difference
CHECKSUM_PHASES = (("save", "sharded"), ("resume", "sharded"), ("resume", "full"))  # where checksums add work
MB = 1e6

# The targets, as data: each is checked against the figures and printed with them.
RESUME_TIME_RATIO_LIMIT = 1.05
FULL_RESUME_MEMORY_RATIO_LIMIT = 1.02  # "no worse than native", within 2% for sampling noise
IMPORT_LIMIT_S = 0.005
# a sharded save or resume within this multiple of the disk's own time for the same bytes, from this much state: a
# save builds its state from views of the shards and writes, so it should cost little more than the writing
RAW_TIME_RATIO_LIMIT = {"save": 1.3, "resume": 2.0}
RAW_TARGET_MIN_STATE = 1.5e9
# a sharded save's (and resume's) time against native's
NATIVE_TIME_RATIO_LIMIT = {"save": 0.7, "resume": 1.0}
# the time a save in the background blocks training, as a share of the synchronous save's
ASYNC_STALL_RATIO_LIMIT = 0.05
# and what a later one blocks it for beside copying the state into its kept host buffers (the slowest rank's)
ASYNC_BEYOND_COPY_LIMIT_S = 0.020
# each rank's peak growth during a sharded save, in shards, over the allowance: the synchronous save copies nothing
# of the state (only the item the writer is writing), the one in the background copies the shard once
SYNC_GROWTH_SHARDS = 0.1
ASYNC_GROWTH_SHARDS = 1.0
# what checksums add to a save or a resume (hashing as it writes, checking as it reads), from RAW_TARGET_MIN_STATE
CHECKSUM_COST_LIMIT = 0.03
# ``verify`` of a sharded checkpoint read cold, against a cold read of as many bytes
VERIFY_RAW_RATIO_LIMIT = 1.2


def targets_markdown(allowance_mb: float = 64) -> str:
    """Every target the benchmark checks, with its limit, from the constants above: docs/benchmark.md's "The targets"
    is this table (tests/test_docs.py), so a quoted target cannot drift from the one measured."""
    run, sizes = "every run", "each `--scaling` size"
    run_and_sizes, large = f"{run} and {sizes}", f"{run}, from {RAW_TARGET_MIN_STATE / 1e9:g} GB of state"
    above = f"{large}; {sizes} from there"
    rows = [
        ("sharded resume: each rank's peak growth", f"≤ full state / {RANKS} + {allowance_mb:g} MB", run),
        ("full save: peak growth of every rank but 0", f"≤ full state / {RANKS} + {allowance_mb:g} MB", run),
        ("sharded and full resume time / native's", f"≤ {RESUME_TIME_RATIO_LIMIT:g}", run),
        ("full resume peak growth / native's (worst rank)", f"≤ {FULL_RESUME_MEMORY_RATIO_LIMIT:g}", run),
        ("sharded save time / native's", f"≤ {NATIVE_TIME_RATIO_LIMIT['save']:g}", run_and_sizes),
        ("sharded resume time / native's", f"≤ {NATIVE_TIME_RATIO_LIMIT['resume']:g}", sizes),
        ("sharded save and resume peak growth / native's", "≤ 1", sizes),
        ("sharded save time / raw write + fsync of the same bytes", f"≤ {RAW_TIME_RATIO_LIMIT['save']:g}", above),
        ("sharded resume time / raw cold read of the same bytes", f"≤ {RAW_TIME_RATIO_LIMIT['resume']:g}", above),
        (f"{ASYNC}: training blocked / synchronous sharded save time, the first save and a later one",
         f"≤ {ASYNC_STALL_RATIO_LIMIT:g}", run_and_sizes),
        (f"{ASYNC}: a later save's stall less the copy of the rank's state into touched memory (slowest rank)",
         f"≤ {ASYNC_BEYOND_COPY_LIMIT_S * 1e3:g} ms", run_and_sizes),
        ("sharded save: each rank's peak growth", f"≤ {SYNC_GROWTH_SHARDS:g} × its shard + {allowance_mb:g} MB", run_and_sizes),
        (f"{ASYNC}: each rank's peak growth", f"≤ {ASYNC_GROWTH_SHARDS:g} × its shard + {allowance_mb:g} MB", run_and_sizes),
        ("checksums: time added to a sharded save, a sharded resume, a full resume", f"≤ {CHECKSUM_COST_LIMIT:.0%}", large),
        ("checksums: `verify` time / cold read of the same bytes", f"≤ {VERIFY_RAW_RATIO_LIMIT:g}", large),
        ("`import lightning_fsdp_resume` after `import wrapt`", f"< {IMPORT_LIMIT_S * 1e3:g} ms added", run),
        ("`import lightning_fsdp_resume` imports torch or Lightning", "never", run),
    ]
    return table(["target", "limit", "checked"], rows)


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    # Native 2.1.4 torch.load()s full checkpoints with torch's default, weights_only=True since torch 2.6,
    # which refuses Lightning's checkpoints; both sides read trusted files the same way.
    env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    return env


def launch(python: str, phase: str, kind: str, checkpoint: Any, out: Path, args: argparse.Namespace,
           env: Optional[Dict[str, str]] = None, extra: Sequence[str] = ()) -> List[Dict]:
    """One torchrun job of the rank program; every rank's record, by rank. ``checkpoint``: a path or a URL."""
    command = [
        python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", str(RANK_PROGRAM),
        "--phase", phase, "--state-dict-type", kind, "--checkpoint", str(checkpoint), "--out", str(out),
        "--width", str(args.width), "--layers", str(args.layers), "--outputs", str(args.outputs), "--use-orig-params", str(args.use_orig_params),
        *extra,
    ]
    result = subprocess.run(command, capture_output=True, text=True, env={**_env(), **(env or {})}, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{phase} ({kind}) with {python} exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return [json.loads((out / f"{phase}_rank{rank}.json").read_text()) for rank in range(args.nproc)]


def launch_in_background(python: str, run_dir: Path, args: argparse.Namespace) -> List[Dict]:
    """The shim's sharded save with AsyncCheckpointIO after a few steps, then once more in the same processes (phase
    ``ASYNC``): every rank's record, with its stalls."""
    extra = ["--async-save", "--save-after-steps", str(ASYNC_SAVE_AFTER_STEPS)]
    return launch(python, "save", "sharded", run_dir / "async-checkpoint", run_dir, args, extra=extra)


def beyond_copy(records: List[Dict]) -> float:
    """Of one run's later stall, what is not the copy of the rank's state: the slowest rank's."""
    return max(record["stall_again"] - record["copy_alone"] for record in records)


def run_all(sides: Sequence[Tuple[str, str]], args: argparse.Namespace, workdir: Path, raw: Dict[str, List[Dict]],
            kinds: Sequence[str] = KINDS, checksums: bool = True) -> Dict[Tuple[str, str, str], List]:
    """``{(phase, kind, side): [per-repeat list of rank records]}``, the sides interleaved run by run, and the shim's
    sharded save with AsyncCheckpointIO (phase ``ASYNC``), the shim without its checksums (side ``UNCHECKED``) and
    ``verify`` of its sharded checkpoint, read cold (phase "verify"). Into ``raw``, per kind, the raw I/O of as many
    bytes as the shim's checkpoint holds, on the same disk, each repeat. ``checksums=False``: not what checksums cost
    (the scaling rows)."""
    results: Dict[Tuple[str, str, str], List] = {}
    for repeat in range(args.repeats):
        for kind in kinds:
            for side, python in sides:
                run_dir = workdir / f"{side}-{kind}-{repeat}"
                checkpoint = run_dir / ("checkpoint" if kind == "sharded" else "checkpoint.ckpt")
                for phase in PHASES:
                    print(f"repeat {repeat + 1}/{args.repeats}: {side:<6} {kind:<7} {phase}", file=sys.stderr, flush=True)
                    records = launch(python, phase, kind, checkpoint, run_dir, args)
                    results.setdefault((phase, kind, side), []).append(records)
                if side == "shim" and kind == "sharded":
                    print(f"repeat {repeat + 1}/{args.repeats}: shim   {kind:<7} {ASYNC}", file=sys.stderr, flush=True)
                    results.setdefault((ASYNC, kind, side), []).append(launch_in_background(python, run_dir, args))
                    if checksums:
                        results.setdefault(("verify", kind, side), []).append([verify_cold(python, checkpoint)])
                if side == "shim" and checksums:
                    for phase, checked_kind in CHECKSUM_PHASES:
                        if checked_kind != kind:
                            continue
                        print(f"repeat {repeat + 1}/{args.repeats}: shim   {kind:<7} {phase}, {UNCHECKED}", file=sys.stderr, flush=True)
                        target = checkpoint if phase == "resume" else run_dir / "unchecked-checkpoint"
                        unchecked = run_dir / "unchecked"
                        records = launch(python, phase, kind, target, unchecked, args, extra=["--no-checksums"])
                        results.setdefault((phase, kind, UNCHECKED), []).append(records)
                if side == "shim":
                    print(f"repeat {repeat + 1}/{args.repeats}: raw I/O of the {kind} checkpoint's bytes", file=sys.stderr, flush=True)
                    raw.setdefault(kind, []).append(raw_io(run_dir, _bytes_of(checkpoint)))
                shutil.rmtree(run_dir)  # a few hundred MB each
    return results


def verify_cold(python: str, checkpoint: Path) -> Dict[str, float]:
    """``verify`` of ``checkpoint`` in a new process, its files' pages dropped from the page cache first (where the
    platform allows): the seconds of the check itself, and the bytes it checked."""
    for path in [checkpoint] if checkpoint.is_file() else sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        with open(path, "rb") as handle:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    program = ("import json, sys; from lightning_fsdp_resume._commands._verify_command import verify;"
               " print(json.dumps(verify(sys.argv[1], progress=False)._asdict()))")
    result = subprocess.run([python, "-c", program, str(checkpoint)], capture_output=True, text=True, env=_env(), check=False)
    if result.returncode != 0:
        raise RuntimeError(f"verify of {checkpoint} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _bytes_of(checkpoint: Path) -> int:
    files = [checkpoint] if checkpoint.is_file() else [p for p in checkpoint.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)


_RAW_BLOCK = 8 << 20


def raw_io(directory: Path, size: int) -> Dict[str, float]:
    """The disk's own time for ``size`` bytes in ``directory``: written in 8 MB blocks and fsynced, then read back
    cold (its pages dropped from the page cache first, where the platform allows)."""
    path = directory / "raw-io"
    block = os.urandom(_RAW_BLOCK)  # not zeros, which a file system may store without writing
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as handle:
        for offset in range(0, size, _RAW_BLOCK):
            handle.write(block[: min(_RAW_BLOCK, size - offset)])
        os.fsync(handle.fileno())
    written = time.perf_counter() - start
    with open(path, "rb", buffering=0) as handle:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        while handle.read(_RAW_BLOCK):
            pass
        read = time.perf_counter() - start
    path.unlink()
    return {"bytes": size, "write": written, "read": read}


class Figures:
    """Medians over repeats of one (phase, kind, side): wall time (slowest rank) and each rank's peak growth."""

    def __init__(self, repeats: List[List[Dict]]) -> None:
        self.times = [max(record["seconds"] for record in records) for records in repeats]
        self.time = statistics.median(self.times)
        self.growth = [statistics.median(records[rank]["growth"] for records in repeats) for rank in range(RANKS)]
        self.growth_spread = [
            (min(r[rank]["growth"] for r in repeats), max(r[rank]["growth"] for r in repeats)) for rank in range(RANKS)
        ]
        stalls = [max(record["stall"] for record in records) for records in repeats if records[0].get("stall") is not None]
        self.stall = statistics.median(stalls) if stalls else None
        again = [max(record["stall_again"] for record in records) for records in repeats
                 if records[0].get("stall_again") is not None]
        self.stall_again = statistics.median(again) if again else None  # a later save's, its buffers kept
        beyond = [beyond_copy(records) for records in repeats if records[0].get("copy_alone") is not None]
        self.beyond_copy = statistics.median(beyond) if beyond else None  # of the later stall, what is not the copy
        self.beyond_copies = beyond  # each repeat's
        waits = [max(record.get("waited_for_buffers", 0.0) for record in records) for records in repeats]
        self.waited_for_buffers = statistics.median(waits)  # before the first save's clock: its buffers still being made
        self.shard = [statistics.median(records[rank].get("shard_bytes", 0) for records in repeats) for rank in range(RANKS)]
        first = repeats[0][0]
        self.lightning = first["lightning"]
        self.mode = first["shim"]
        self.torch = first["torch"]
        self.full_state = first["full_state_bytes"]

    @property
    def worst_growth(self) -> float:
        return max(self.growth)


def _mb(value: float) -> str:
    return f"{value / MB:.1f}"


def _ratio(shim: float, native: float) -> Optional[float]:
    return shim / native if native > 0 else None


def _show(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _verdict(met: Optional[bool]) -> str:
    return "not measured" if met is None else ("yes" if met else "**NO**")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def cells_table(records: Sequence[Dict[str, Any]]) -> str:
    """The markdown table of ``records``, a row each: their ``cells``, whose keys are the columns."""
    return table(list(records[0]["cells"]), [list(record["cells"].values()) for record in records])


# The records behind the tables (``--json``) hold, beside each row's printed ``cells``, the figures they are made of. A
# target's record also holds its ``value``, which is its ``formula`` of the figures ``of`` (tests/test_benchmark.py
# recomputes each): "ratio" a / b, "added" a / b - 1, "difference" a - b, "worst" the largest, "median", "count" the length of
# a list, "over" the largest of each rank's growth less its allowance (growth, shard, shards, allowance).


def judged(cells: Dict[str, str], value: Optional[float], limit: float, formula: str, of: Sequence[Any] = (),
           strict: bool = False, state: Optional[float] = None) -> Dict[str, Any]:
    """A checked figure's record, its verdict in ``cells["met"]``: ``value`` against ``limit`` (``<`` where ``strict``,
    else ``≤``); not measured without a value, nor at a ``state`` below the size a target is set for, where given."""
    measured = value is not None and (state is None or state >= RAW_TARGET_MIN_STATE)
    met = (value < limit if strict else value <= limit) if measured else None
    gated = {} if state is None else {"state": state, "from state": RAW_TARGET_MIN_STATE}
    return {"cells": {**cells, "met": _verdict(met)}, "value": value, "limit": limit, "strict": strict, "formula": formula,
            "of": list(of), **gated}


def _target(name: str, figure: str, limit: str) -> Dict[str, str]:
    return {"target": name, "figure": figure, "limit": limit}


def _ratio_target(name: str, of: Sequence[float], limit: float, limit_text: str, figure: str = "",
                  state: Optional[float] = None) -> Dict[str, Any]:
    """A target on the ratio of ``of`` (none without figures), shown with ``figure`` after it."""
    ratio = _ratio(*of) if of else None
    return judged(_target(name, _show(ratio) + figure, limit_text), ratio, limit, "ratio", of, state=state)


def _below(value: Optional[float], state: float) -> str:
    """What a figure adds where the state is below the size its target is set for."""
    return "" if value is None or state >= RAW_TARGET_MIN_STATE else f" (state {_mb(state)} MB: below the size it is set for)"


def _figures_record(phase: str, kind: str, side: str, f: Figures) -> Dict[str, Any]:
    stall = f"; stall {f.stall:.3f}" if phase == ASYNC and f.stall is not None else ""
    stall += f", then {f.stall_again:.3f}" if phase == ASYNC and f.stall_again is not None else ""
    growth = {f"rank {rank} peak growth MB (range)": f"{_mb(g)} ({_mb(lo)}–{_mb(hi)})"
              for rank, (g, (lo, hi)) in enumerate(zip(f.growth, f.growth_spread))}
    cells = {"phase": phase, "kind": kind, "side": side, "Lightning": f"{f.lightning} {f.mode}", "time s": f"{f.time:.3f}{stall}",
             "time range s": f"{min(f.times):.3f}–{max(f.times):.3f}", **growth}
    return {"cells": cells, "phase": phase, "kind": kind, "side": side, **vars(f)}


def run_records(figures: Dict[Tuple[str, str, str], Any], imports: Dict, args: argparse.Namespace,
                raw: Optional[Dict[str, List[Dict]]] = None) -> Dict[str, Any]:
    """The records behind a run's tables: its figures, shim/native, the raw I/O, what checksums cost, the targets."""
    sides = [side for side in ("shim", "native") if ("save", "sharded", side) in figures]
    records: Dict[str, Any] = {"imports": imports, "raw I/O": raw or {}}
    keys = [(phase, kind, side) for phase in PHASES for kind in KINDS for side in sides] + [(ASYNC, "sharded", "shim")]
    records["figures"] = [_figures_record(*key, figures[key]) for key in keys]
    records["native"] = []
    for phase, kind in PHASE_KINDS if "native" in sides else ():
        shim, native = figures[(phase, kind, "shim")], figures[(phase, kind, "native")]
        time, growth = [shim.time, native.time], [shim.worst_growth, native.worst_growth]
        cells = {"phase": phase, "kind": kind, "time shim/native": _show(_ratio(*time)),
                 "peak growth shim/native (worst rank)": _show(_ratio(*growth))}
        records["native"].append({"cells": cells, "phase": phase, "kind": kind, "time": time, "growth": growth})
    records["raw"] = []
    for phase, kind in PHASE_KINDS if raw else ():
        medium = "write" if phase == "save" else "read"
        raw_time, shim_time = statistics.median(r[medium] for r in raw[kind]), figures[(phase, kind, "shim")].time
        size = statistics.median(r["bytes"] for r in raw[kind])
        cells = {"phase": phase, "kind": kind, "checkpoint MB": _mb(size), "shim s": f"{shim_time:.3f}",
                 "raw I/O s": f"{raw_time:.3f} ({'write + fsync' if phase == 'save' else 'cold read'})",
                 "shim/raw": _show(_ratio(shim_time, raw_time))}
        records["raw"].append({"cells": cells, "phase": phase, "kind": kind, "bytes": size, "shim": shim_time, "raw": raw_time})
    records["checksums"] = []
    for phase, kind in CHECKSUM_PHASES:
        with_sums, without = figures[(phase, kind, "shim")].time, figures[(phase, kind, UNCHECKED)].time
        cells = {"phase": phase, "kind": kind, "shim s": f"{with_sums:.3f}", f"{UNCHECKED} s": f"{without:.3f}",
                 "cost": _percent(_cost(with_sums, without))}
        records["checksums"].append({"cells": cells, "phase": phase, "kind": kind, "with": with_sums, "without": without})
    records["verify"] = raw_verify(figures, raw)
    records["targets"] = run_targets(figures, records, args)
    return records


def _cost(with_sums: float, without: float) -> Optional[float]:
    return with_sums / without - 1 if without > 0 else None


def run_targets(figures: Dict[Tuple[str, str, str], Any], records: Dict[str, Any], args: argparse.Namespace) -> List[Dict]:
    """The run's targets, each a record (``judged``), from its figures and the records of its other tables."""
    sharded = figures[("resume", "sharded", "shim")]
    state = sharded.full_state
    allowance = state / RANKS + args.allowance_mb * MB
    targets = [judged(_target(f"sharded resume: per-rank peak growth ≤ full state / {RANKS} + {args.allowance_mb:g} MB",
                              f"{_mb(sharded.worst_growth)} MB (worst rank)", f"≤ {_mb(allowance)} MB"),
                      sharded.worst_growth, allowance, "worst", sharded.growth)]
    # Full save: rank 0 alone gathers and writes; every other rank keeps to its shard, as under native Lightning.
    full_save = figures[("save", "full", "shim")]
    others = max(full_save.growth[1:])
    native_save = figures.get(("save", "full", "native"))
    shown = f"{_mb(others)} MB (worst rank ≠ 0)" + (f"; native: {_mb(max(native_save.growth[1:]))} MB" if native_save else "")
    targets.append(judged(_target(f"full save: peak growth of every rank but 0 ≤ full state / {RANKS} + {args.allowance_mb:g} MB",
                                  shown, f"≤ {_mb(allowance)} MB"), others, allowance, "worst", full_save.growth[1:]))
    native = {(r["phase"], r["kind"]): r for r in records["native"]}
    for name, phase, kind, which, limit, limit_text in [
        *((f"{kind} resume time shim/native", "resume", kind, "time", RESUME_TIME_RATIO_LIMIT, f"≤ {RESUME_TIME_RATIO_LIMIT}")
          for kind in KINDS),
        ("sharded save time shim/native", "save", "sharded", "time", NATIVE_TIME_RATIO_LIMIT["save"],
         f"≤ {NATIVE_TIME_RATIO_LIMIT['save']:g}"),
        ("full resume peak growth shim/native (worst rank)", "resume", "full", "growth", FULL_RESUME_MEMORY_RATIO_LIMIT,
         f"≤ {FULL_RESUME_MEMORY_RATIO_LIMIT}"),
    ]:
        targets.append(_ratio_target(name, native[(phase, kind)][which] if (phase, kind) in native else [], limit, limit_text))
    raw = {(r["phase"], r["kind"]): [r["shim"], r["raw"]] for r in records["raw"]}

    def at_size(name: str, formula: str, of: Sequence[float], limit: float, limit_text: str) -> Dict[str, Any]:
        value = (_cost if formula == "added" else _ratio)(*of) if of else None
        shown = (_percent if formula == "added" else _show)(value) + _below(value, state)
        return judged(_target(f"{name}, at ≥ {_mb(RAW_TARGET_MIN_STATE)} MB of state", shown, limit_text), value, limit, formula,
                      of, state=state)

    targets += [at_size(f"sharded {phase} time / raw I/O of the same bytes", "ratio", raw.get((phase, "sharded"), []),
                        RAW_TIME_RATIO_LIMIT[phase], f"≤ {RAW_TIME_RATIO_LIMIT[phase]:g}") for phase in PHASES]
    targets += background_targets(figures, args)
    targets += [at_size(f"checksums: {r['kind']} {r['phase']} time added", "added", [r["with"], r["without"]], CHECKSUM_COST_LIMIT,
                        f"≤ {CHECKSUM_COST_LIMIT:.0%}") for r in records["checksums"]]
    targets.append(at_size("checksums: verify time / cold read of the same bytes", "ratio",
                           [v[key] for v in records["verify"] for key in ("seconds", "raw")], VERIFY_RAW_RATIO_LIMIT,
                           f"≤ {VERIFY_RAW_RATIO_LIMIT:g}"))
    imports = records["imports"]
    added_ms = imports["added"] * 1e3
    targets.append(judged(_target(f"import lightning_fsdp_resume after import wrapt (median of {imports['repeats']})",
                                  f"+{added_ms:.2f} ms ({imports['wrapt'] * 1e3:.2f} → {imports['wrapt_and_shim'] * 1e3:.2f} ms)",
                                  f"< {IMPORT_LIMIT_S * 1e3:g} ms"),
                          imports["added"], IMPORT_LIMIT_S, "difference", [imports["wrapt_and_shim"], imports["wrapt"]], strict=True))
    heavy = imports["heavy_imported"]
    targets.append(judged(_target("import lightning_fsdp_resume imports neither torch nor Lightning",
                                  ", ".join(heavy) if heavy else "none imported", "none"), len(heavy), 0, "count", [heavy]))
    return targets


def report(records: Dict[str, Any], args: argparse.Namespace) -> str:
    """A run's tables, printed from its records (``run_records``)."""
    first = records["figures"][0]
    lines = [
        f"{RANKS} ranks, CPU (gloo), torch {first['torch']}, {os.cpu_count()} CPU cores; model {args.layers} layers"
        f" × width {args.width}, full state {_mb(first['full_state'])} MB (parameters + Adam moments);"
        f" use_orig_params={bool(args.use_orig_params)}; median of {args.repeats} repeats.",
        "",
        cells_table(records["figures"]),
        "", f"{ASYNC}: the shim's sharded save with AsyncCheckpointIO, timed until the checkpoint is in place;"
        " its stall is how long the save call blocked the training loop, then that of a second save in the same"
        " processes.",
    ]
    if records["native"]:
        lines += ["", cells_table(records["native"])]
    if records["raw"]:
        lines += ["", "Against the disk itself: the same number of bytes as the shim's checkpoint, written and fsynced,"
                  " or read cold, in the same run (a resume reads a checkpoint just written, from the page cache).", "",
                  cells_table(records["raw"])]
    lines += ["", f"Checksums: the shim against itself with them switched off ({UNCHECKED}, in the same run); and"
              " `verify` of the sharded checkpoint read cold, against a cold read of as many bytes.", "",
              cells_table(records["checksums"])]
    for verified in records["verify"]:
        lines += ["", f"verify: {_mb(verified['bytes'])} MB in {verified['seconds']:.3f} s"
                  f" ({verified['bytes'] / MB / max(verified['seconds'], 1e-9):.0f} MB/s); cold read of as many bytes"
                  f" {verified['raw']:.3f} s."]
    lines += ["", cells_table(records["targets"])]
    return "\n".join(lines)


def raw_verify(figures: Dict[Tuple[str, str, str], Any], raw: Optional[Dict[str, List[Dict]]]) -> List[Dict[str, float]]:
    """The median ``verify`` (seconds, bytes) with the raw cold read of as many bytes (``raw``), where both were measured."""
    verifies = figures.get(("verify", "sharded", "shim"))
    if verifies is None or not raw or "sharded" not in raw:
        return []
    seconds = statistics.median(v["seconds"] for v in verifies)
    size = statistics.median(v["bytes"] for v in verifies)
    reads = [r["read"] * size / r["bytes"] for r in raw["sharded"] if r["bytes"]]
    return [{"seconds": seconds, "bytes": size, "raw": statistics.median(reads) if reads else 0.0}]


def _percent(cost: Optional[float]) -> str:
    return "n/a" if cost is None else f"{cost:+.1%}"


def background_targets(figures: Dict[Tuple[str, str, str], Figures], args: argparse.Namespace) -> List[Dict]:
    """The targets of saves in the background and of a sharded save's memory, against each rank's own shard."""
    save, background = figures[("save", "sharded", "shim")], figures[(ASYNC, "sharded", "shim")]
    stall = [background.stall or 0.0, save.time]
    again = [background.stall_again or 0.0, save.time]
    allowance = args.allowance_mb * MB
    sync = [save.growth, save.shard, SYNC_GROWTH_SHARDS, allowance]
    in_background = [background.growth, background.shard, ASYNC_GROWTH_SHARDS, allowance]
    per_rank = " / ".join(f"{_mb(g)} of {_mb(s)}" for g, s in zip(save.growth, save.shard))
    per_rank_async = " / ".join(f"{_mb(g)} of {_mb(s)}" for g, s in zip(background.growth, background.shard))
    beyond = background.beyond_copy
    return [
        _ratio_target(f"{ASYNC}: training blocked / synchronous sharded save time", stall, ASYNC_STALL_RATIO_LIMIT,
                      f"≤ {ASYNC_STALL_RATIO_LIMIT:g}", f" ({stall[0]:.3f} s of {save.time:.3f} s; written in {background.time:.3f} s;"
                      f" waited {background.waited_for_buffers:.3f} s for its host buffers before the clock)"),
        _ratio_target(f"{ASYNC}, a later save (its host buffers kept): training blocked / synchronous sharded save time", again,
                      ASYNC_STALL_RATIO_LIMIT, f"≤ {ASYNC_STALL_RATIO_LIMIT:g}", f" ({again[0]:.3f} s of {save.time:.3f} s)"),
        judged(_target(f"{ASYNC}, a later save: training blocked less the copy alone (slowest rank; median, min–max)",
                       "n/a" if beyond is None else f"{beyond * 1e3:.1f} ms ({min(background.beyond_copies) * 1e3:.1f}–"
                       f"{max(background.beyond_copies) * 1e3:.1f})", f"≤ {ASYNC_BEYOND_COPY_LIMIT_S * 1e3:g} ms"),
               beyond, ASYNC_BEYOND_COPY_LIMIT_S, "median", background.beyond_copies),
        judged(_target(f"sharded save: each rank's peak growth ≤ {SYNC_GROWTH_SHARDS:g} × its shard + {args.allowance_mb:g} MB",
                       f"{per_rank} MB (rank 0 / 1)", f"{SYNC_GROWTH_SHARDS:g} × shard + allowance"), _over(*sync), 0, "over", sync),
        judged(_target(f"{ASYNC}: each rank's peak growth ≤ its shard + {args.allowance_mb:g} MB", f"{per_rank_async} MB (rank 0 / 1)",
                       f"{ASYNC_GROWTH_SHARDS:g} × shard + allowance"), _over(*in_background), 0, "over", in_background),
    ]


def _over(growth: Sequence[float], shard: Sequence[float], shards: float, allowance: float) -> float:
    """The most a rank grew by beyond ``shards`` × its shard and ``allowance``."""
    return max(g - (shards * s + allowance) for g, s in zip(growth, shard))


# --- scaling: how the costs grow with the state --------------------------------------------------------

# 7B parameters with Adam in fp32: the parameters and two moments, 4 bytes each
PREDICTED_PARAMETERS = 7e9
PREDICTED_RANKS = 8


def measure_scaling(sides: Sequence[Tuple[str, str]], args: argparse.Namespace, workdir: Path) -> List[Dict[str, Any]]:
    """One row per ``--scaling`` size: the sharded save, stall, resume and consolidate times, each rank's worst peak
    growth, native's save and resume where given, and the disk's raw I/O of the same bytes: medians of ``--repeats``."""
    rows = []
    for layers in args.scaling:
        sized = argparse.Namespace(**{**vars(args), "layers": layers})
        raw: Dict[str, List[Dict]] = {}
        figures = {key: Figures(value) for key, value in run_all(sides, sized, workdir, raw, kinds=("sharded",), checksums=False).items()}
        row: Dict[str, Any] = {"layers": layers, "state": figures[("save", "sharded", "shim")].full_state,
                               "repeats": args.repeats,
                               **{f"raw {medium}": statistics.median(io[medium] for io in raw["sharded"]) for medium in ("write", "read")}}
        for side in [side for side, _ in sides]:
            for phase in PHASES:
                f = figures[(phase, "sharded", side)]
                row[f"{side} {phase}"], row[f"{side} {phase} memory"] = f.time, f.worst_growth
        background = figures[(ASYNC, "sharded", "shim")]
        row["shim stall"], row["shim async memory"] = background.stall, background.worst_growth
        row["shim later stall"] = background.stall_again
        row["shim consolidate"] = consolidate_seconds(sized, workdir)
        row["targets"] = background_targets(figures, sized) + _size_targets(row)
        rows.append(row)
    return rows


def _size_targets(row: Dict[str, Any]) -> List[Dict]:
    """At one size: the sharded save and resume against the disk's raw I/O, and against native's time and memory."""
    targets = []
    for phase, medium in (("save", "raw write"), ("resume", "raw read")):
        limit = RAW_TIME_RATIO_LIMIT[phase]
        targets.append(_ratio_target(f"sharded {phase} / raw I/O", [row[f"shim {phase}"], row[medium]], limit,
                                     f"≤ {limit:g} from {_mb(RAW_TARGET_MIN_STATE)} MB", state=row["state"]))
        if f"native {phase}" in row:
            limit = NATIVE_TIME_RATIO_LIMIT[phase]
            targets.append(_ratio_target(f"sharded {phase} time / native", [row[f"shim {phase}"], row[f"native {phase}"]], limit,
                                         f"≤ {limit:g}"))
            targets.append(_ratio_target(f"sharded {phase} peak growth / native",
                                         [row[f"shim {phase} memory"], row[f"native {phase} memory"]], 1, "≤ 1"))
    return targets


# --- rank scaling: the same state on more ranks --------------------------------------------------------------------


def measure_ranks(args: argparse.Namespace, workdir: Path) -> List[Dict[str, Any]]:
    """One row per ``--ranks`` count: the shim's sharded save and resume of the same state, ``--repeats`` times each
    (the slowest rank's time), each less the disk's raw write or cold read of the checkpoint's bytes in that repeat,
    a later save in the background's stall and what of it is not the copy (the slowest rank's), and the
    checkpoint's DCP items, ``.metadata`` bytes and files."""
    from torch.distributed.checkpoint import FileSystemReader

    rows = []
    for ranks in args.ranks:
        ranked = argparse.Namespace(**{**vars(args), "nproc": ranks})
        times: Dict[str, List[float]] = {}
        for repeat in range(args.repeats):
            run_dir = workdir / f"ranks-{ranks}-{repeat}"
            checkpoint = run_dir / "checkpoint"
            took = {}
            for phase in PHASES:
                print(f"{ranks} ranks, repeat {repeat + 1}/{args.repeats}: {phase}", file=sys.stderr, flush=True)
                records = launch(sys.executable, phase, "sharded", checkpoint, run_dir, ranked)
                took[phase], state = max(record["seconds"] for record in records), records[0]["full_state_bytes"]
            print(f"{ranks} ranks, repeat {repeat + 1}/{args.repeats}: {ASYNC}", file=sys.stderr, flush=True)
            records = launch_in_background(sys.executable, run_dir, ranked)
            times.setdefault("later stall", []).append(max(record["stall_again"] for record in records))
            times.setdefault("later stall beyond copy", []).append(beyond_copy(records))
            raw = raw_io(run_dir, _bytes_of(checkpoint))
            for phase, medium in (("save", "write"), ("resume", "read")):
                times.setdefault(phase, []).append(took[phase])
                times.setdefault(f"{phase} beyond raw", []).append(took[phase] - raw[medium])
            index = {"items": len(FileSystemReader(str(checkpoint)).read_metadata().storage_data),
                     "metadata": (checkpoint / ".metadata").stat().st_size,
                     "files": sum(1 for path in checkpoint.rglob("*") if path.is_file())}
            shutil.rmtree(run_dir)
        rows.append({"ranks": ranks, "state": state, **index, **times})
    return rows


def _median_and_spread(values: Sequence[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


# the columns of the rank-scaling table: seconds, then milliseconds of a save in the background
RANK_COLUMNS = ("save", "save beyond raw", "resume", "resume beyond raw")
RANK_STALLS = ("later stall", "later stall beyond copy")


def ranks_records(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The rank-scaling rows with their cells, and how much each cost grew from the fewest ranks to the most against
    the rank count (``checks``)."""
    for row in rows:
        row["cells"] = {"ranks": str(row["ranks"]), **{f"{column} s": _median_and_spread(row[column]) for column in RANK_COLUMNS},
                        **{f"{ASYNC}: {column} ms": _median_and_spread([value * 1e3 for value in row[column]], digits=0)
                           for column in RANK_STALLS},
                        "DCP items": str(row["items"]), "`.metadata` bytes": f"{row['metadata']:,}", "files": str(row["files"])}
    first, last = rows[0], rows[-1]
    grew = last["ranks"] / first["ranks"]
    checks = []
    for column in ("save beyond raw", "resume beyond raw", "later stall beyond copy", "items", "metadata"):
        of = [statistics.median(row[column]) if isinstance(row[column], list) else row[column] for row in (last, first)]
        checks.append(judged({"grows no faster than the ranks": f"{column}: {last['ranks']} ranks / {first['ranks']}",
                              "ratio": _show(_ratio(*of)), "limit": f"≤ {grew:g} (the ranks)"}, _ratio(*of), grew, "ratio", of))
    return {"ranks": rows, "checks": checks}


def ranks_report(records: Dict[str, Any], repeats: int) -> str:
    """The rank-scaling tables, printed from their records (``ranks_records``)."""
    lines = [f"Rank scaling: the same {_mb(records['ranks'][0]['state'])} MB of state saved and resumed sharded by the shim, "
             f"medians of {repeats} repeats (min–max), the slowest rank's seconds", "", cells_table(records["ranks"])]
    lines += ["", cells_table(records["checks"])]
    return "\n".join(lines)


def consolidate_seconds(args: argparse.Namespace, workdir: Path) -> float:
    """``consolidate``'s time to a torch file of the weights, for a sharded checkpoint the shim saves: the median of
    ``--repeats`` fresh processes."""
    run_dir = workdir / "scaling-consolidate"
    launch(sys.executable, "save", "sharded", run_dir / "checkpoint", run_dir, args)
    try:
        seconds = [_consolidate_once(sys.executable, run_dir / "checkpoint", run_dir, {"weights_only": True})["seconds"]
                   for _ in range(args.repeats)]
    finally:
        shutil.rmtree(run_dir)
    return statistics.median(seconds)


def _fit(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """Least squares ``y = a + b x``."""
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


SCALING_SERIES = ("shim save", "shim stall", "shim later stall", "shim resume", "shim consolidate", "native save", "native resume",
                  "raw write", "raw read")


def scaling_records(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The rows of each size with their cells (their targets inside), and the line fitted to each series (``fits``)."""
    series = [name for name in SCALING_SERIES if all(row.get(name) is not None for row in rows)]
    memory = [name for name in ("shim save memory", "shim async memory", "shim resume memory", "native save memory",
                                "native resume memory") if all(name in row for row in rows)]
    for row in rows:
        row["cells"] = {"state GB": f"{row['state'] / 1e9:.2f}", **{f"{name} s": f"{row[name]:.2f}" for name in series},
                        **{f"{name} MB": _mb(row[name]) for name in memory}}
    gigabytes = [row["state"] / 1e9 for row in rows]
    predicted_state = PREDICTED_PARAMETERS * 4 * 3 / 1e9
    fits = []
    for name in series:
        intercept, slope = _fit(gigabytes, [row[name] for row in rows])
        predicted = intercept + slope * predicted_state
        cells = {"series": name, "a s": f"{intercept:.2f}", "b s/GB": f"{slope:.3f}",
                 f"predicted s at {predicted_state:.0f} GB": f"{predicted:.0f}"}
        fits.append({"cells": cells, "series": name, "a": intercept, "b": slope, "at GB": predicted_state, "predicted": predicted})
    return {"sizes": rows, "fits": fits}


def scaling_report(records: Dict[str, Any]) -> str:
    """The scaling tables, printed from their records (``scaling_records``)."""
    rows = records["sizes"]
    lines = [
        f"How the costs grow: sharded checkpoints on {RANKS} ranks, medians of {rows[0]['repeats']} runs per size; times in s,"
        " each rank's worst peak"
        " growth in MB; stall: how long a save with AsyncCheckpointIO blocked training (later stall: a second such save"
        " in the same processes); consolidate: to a torch file of"
        " the weights.",
        "",
        cells_table(rows),
    ]
    verdicts = [[target["cells"]["target"], *(f"{row['targets'][index]['cells']['figure']}: {row['targets'][index]['cells']['met']}"
                                               for row in rows)] for index, target in enumerate(rows[0]["targets"])]
    lines += ["", "The targets at each size (figure: met):", "",
              table(["target", *(f"{row['state'] / 1e9:.2f} GB" for row in rows)], verdicts)]
    predicted_state = records["fits"][0]["at GB"]
    lines += ["", f"A line fitted to each (time = a + b × state GB), and what it predicts for a {PREDICTED_PARAMETERS / 1e9:g}B-parameter"
              f" model with Adam (fp32: {predicted_state:.0f} GB of state) at this machine's disk and CPU speed, its"
              f" {PREDICTED_RANKS} ranks sharing them as these {RANKS} do:", "",
              cells_table(records["fits"])]
    return "\n".join(lines)


def scaling_plot(rows: List[Dict[str, Any]], path: Path) -> str:
    """A PNG of the scaling table's times against the state (needs matplotlib: the [plot] extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"No plot: matplotlib is not installed (pip install \"lightning-fsdp-resume[plot]\"); {path} not written."
    gigabytes = [row["state"] / 1e9 for row in rows]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in SCALING_SERIES:
        if all(row.get(name) is not None for row in rows):
            style = ":" if name.startswith("raw") else ("--" if name.startswith("native") else "-")
            axes.plot(gigabytes, [row[name] for row in rows], style, marker="o", label=name)
    axes.set_xlabel("state (parameters + Adam moments), GB")
    axes.set_ylabel("seconds")
    axes.set_title(f"Sharded checkpoints on {RANKS} CPU ranks: time against size")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return f"Plot written: {path}"


# --- consolidate: peak memory per output format ------------------------------------------------------

# Each output of consolidate that is measured, with consolidate()'s options for it.
CONSOLIDATE_OUTPUTS = (
    ("torch, full", {}),
    ("torch, --weights-only", {"weights_only": True}),
    ("safetensors", {"format": "safetensors"}),
    ("safetensors, --dtype bf16", {"format": "safetensors", "dtype": "bf16"}),
    # not a consolidate output: the same reader, as load_from_checkpoint and a non-FSDP ckpt_path use it (no file)
    ("read whole, no file (load_from_checkpoint)", {"read_whole": True}),
)

# One consolidation in a fresh process, so that no earlier one's freed memory hides its peak. The sizes
# come from the shard index; torch and its checkpoint reader are imported before the phase.
_CONSOLIDATE_PROBE = """\
import json, sys, time
from pathlib import Path
import torch.distributed.checkpoint
from peak_rss import PeakRss
from lightning_fsdp_resume._checkpoint import _reader, _whole_read
from lightning_fsdp_resume._commands import _consolidate
from lightning_fsdp_resume._storage import open_path
src, dst, options = open_path(sys.argv[1], "read"), Path(sys.argv[2]), json.loads(sys.argv[3])
index = _reader.index(src)
sizes = {key: entry.size.numel() * entry.properties.dtype.itemsize
         for key, entry in index.state_dict_metadata.items() if hasattr(entry, "properties")}
selected = _whole_read.select_weights(src, None)
weights = [sizes[key] for keys in selected.keys.values() for key in keys if key in sizes]
read_whole = options.pop("read_whole", False)
if read_whole:
    from lightning_fsdp_resume._lightning import _lightning_reads
with PeakRss() as phase:
    start = time.perf_counter()
    if read_whole:
        checkpoint = _lightning_reads.read_whole(src)
    else:
        _consolidate.consolidate(src, dst, overwrite=True, progress=False, **options)
    seconds = time.perf_counter() - start
print(json.dumps({"growth": phase.growth, "seconds": seconds, "file": 0 if read_whole else dst.stat().st_size,
                  "state": sum(sizes.values()),
                  "tensors": len(sizes), "weights": sum(weights), "largest_weight": max(weights, default=0)}))
"""


def measure_consolidate(python: str, src: Path, workdir: Path, repeats: int) -> Dict[str, List[Dict]]:
    """``{output: [record per repeat]}``, each record from one fresh process consolidating ``src``."""
    records: Dict[str, List[Dict]] = {}
    for repeat in range(repeats):
        for label, options in CONSOLIDATE_OUTPUTS:
            print(f"repeat {repeat + 1}/{repeats}: consolidate to {label}", file=sys.stderr, flush=True)
            records.setdefault(label, []).append(_consolidate_once(python, src, workdir, options))
    return records


def _consolidate_once(python: str, src: Path, workdir: Path, options: Dict[str, Any]) -> Dict:
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])  # peak_rss
    dst = workdir / "consolidated"
    command = [python, "-c", _CONSOLIDATE_PROBE, str(src), str(dst), json.dumps(options)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"consolidate ({options}) with {python} exited {result.returncode}:\n{result.stderr[-8000:]}")
    dst.unlink(missing_ok=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def consolidate_records(records: Dict[str, List[Dict]]) -> List[Dict[str, Any]]:
    """Per output, its runs and their medians with the cells of its row: file size, time and peak growth, and the growth
    against the largest weight tensor, the weights and the full state."""
    first = next(iter(records.values()))[0]
    largest, weights, state = first["largest_weight"], first["weights"], first["state"]
    rows = []
    for label, runs in records.items():
        growth = statistics.median(run["growth"] for run in runs)
        seconds = statistics.median(run["seconds"] for run in runs)
        spread = f"{_mb(min(r['growth'] for r in runs))}–{_mb(max(r['growth'] for r in runs))}"
        cells = {"consolidate output": label, "file MB": _mb(runs[0]["file"]), "time s": f"{seconds:.2f}",
                 "peak growth MB (range)": f"{_mb(growth)} ({spread})", "growth / largest weight tensor": _show(_ratio(growth, largest)),
                 "growth / weights": _show(_ratio(growth, weights)), "growth / full state": _show(_ratio(growth, state))}
        rows.append({"cells": cells, "output": label, "runs": runs, "growth": growth, "seconds": seconds})
    return rows


def consolidate_report(rows: List[Dict[str, Any]], source: str) -> str:
    """The consolidate table, printed from its records (``consolidate_records``)."""
    first = rows[0]["runs"][0]
    lines = [
        f"consolidate of {source}: full state {_mb(first['state'])} MB in {first['tensors']} tensors, weights {_mb(first['weights'])} MB,"
        f" largest weight tensor {_mb(first['largest_weight'])} MB; each output made in a fresh process, median of {len(rows[0]['runs'])}.",
        "",
        cells_table(rows),
    ]
    return "\n".join(lines)


def consolidate_a_save(args: argparse.Namespace, workdir: Path) -> List[Dict[str, Any]]:
    """The consolidate records for a sharded checkpoint of the benchmark's model, saved by the shim."""
    run_dir = workdir / "consolidate"
    checkpoint = run_dir / "checkpoint"
    print("consolidate: saving a sharded checkpoint to measure", file=sys.stderr, flush=True)
    launch(sys.executable, "save", "sharded", checkpoint, run_dir, args)
    try:
        records = measure_consolidate(sys.executable, checkpoint, run_dir, args.repeats)
    finally:
        shutil.rmtree(run_dir)
    return consolidate_records(records)


# --- object storage: the same saves and resumes at an S3 URL -----------------------------------------


def measure_remote(args: argparse.Namespace, workdir: Path) -> Dict[Tuple[str, str], Dict[str, List[float]]]:
    """Per (phase, kind): the shim's times at an S3 URL ("s3"), and s3fs copying the same bytes ("raw": the
    upload of the saved checkpoint for a save, its download for a resume), each repeat."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.s3 import S3Server  # the tests' server: moto on 127.0.0.1, behind a relay

    server = S3Server(str(workdir / "s3-server.log"))
    figures: Dict[Tuple[str, str], Dict[str, List[float]]] = {}
    try:
        server.create_bucket("bench")
        conf = server.fsspec_conf()
        import fsspec

        fs = fsspec.filesystem("s3", **conf["s3"])
        env = {"FSSPEC_S3": json.dumps(conf["s3"])}  # fsspec's configuration, as a user sets it
        for repeat in range(args.repeats):
            for kind in KINDS:
                url = f"s3://bench/{kind}-{repeat}/" + ("checkpoint" if kind == "sharded" else "checkpoint.ckpt")
                run_dir = workdir / f"s3-{kind}-{repeat}"
                for phase in PHASES:
                    print(f"repeat {repeat + 1}/{args.repeats}: s3 {kind:<7} {phase}", file=sys.stderr, flush=True)
                    records = launch(sys.executable, phase, kind, url, run_dir, args, env)
                    figures.setdefault((phase, kind), {}).setdefault("s3", []).append(max(r["seconds"] for r in records))
                saved = _data_of(fs, url)
                local = run_dir / "copy"
                start = time.perf_counter()
                fs.get(saved, str(local), recursive=True)
                figures[("resume", kind)].setdefault("raw", []).append(time.perf_counter() - start)
                start = time.perf_counter()
                fs.put(str(local), f"bench/raw-{kind}-{repeat}", recursive=True)
                figures[("save", kind)].setdefault("raw", []).append(time.perf_counter() - start)
                size = sum(f.stat().st_size for f in ([local] if local.is_file() else local.rglob("*")) if f.is_file())
                figures[("save", kind)].setdefault("bytes", []).append(size)
                fs.rm(f"bench/{kind}-{repeat}", recursive=True)
                fs.rm(f"bench/raw-{kind}-{repeat}", recursive=True)
                shutil.rmtree(run_dir)
    finally:
        server.stop()
    return figures


def _data_of(fs: Any, url: str) -> str:
    """What a checkpoint at ``url`` consists of: the prefix its pointer names, or the file itself (docs/saving.md)."""
    content = fs.cat_file(url)
    if content.startswith(b"{"):
        return url.rsplit("/", 1)[0] + "/" + json.loads(content)["data"]
    return url


def remote_records(remote: Dict[Tuple[str, str], Dict[str, List[float]]], local: Dict[Tuple[str, str, str], Figures]) -> List[Dict]:
    """Per phase and kind, the medians at S3, on the local disk and of s3fs copying the bytes, with the cells of its row."""
    rows = []
    for phase, kind in PHASE_KINDS:
        s3 = statistics.median(remote[(phase, kind)]["s3"])
        raw = statistics.median(remote[(phase, kind)]["raw"])
        disk = local[(phase, kind, "shim")].time
        size = statistics.median(remote[("save", kind)]["bytes"])
        cells = {"phase": phase, "kind": kind, "checkpoint MB": _mb(size), "local disk s": f"{disk:.3f}", "S3 s": f"{s3:.3f}",
                 "S3/disk": _show(_ratio(s3, disk)), "raw S3 copy s": f"{raw:.3f}", "S3/raw copy": _show(_ratio(s3, raw))}
        rows.append({"cells": cells, "phase": phase, "kind": kind, "bytes": size, "disk": disk, "s3": s3, "raw": raw,
                     "runs": remote[(phase, kind)]})
    return rows


def remote_report(rows: List[Dict]) -> str:
    """The object-storage table, printed from its records (``remote_records``)."""
    return "\n".join([
        "Object storage: the same saves and resumes at s3:// URLs of a local S3 server (moto on 127.0.0.1, through a"
        " TCP relay), against the local disk, and against s3fs copying the checkpoint's bytes (upload for a save,"
        " download for a resume); median of the repeats.",
        "",
        cells_table(rows),
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--native-python", default=os.environ.get(NATIVE_PYTHON_ENV),
                        help=f"Python of a native Lightning 2.1.x environment (default: ${NATIVE_PYTHON_ENV}; none: shim only)")
    parser.add_argument("--width", type=int, default=2048, help="width of each square layer (default 2048)")
    parser.add_argument("--layers", type=int, default=8, help="layers, one FSDP unit each (default 8: 403 MB of state)")
    parser.add_argument("--outputs", type=int, default=8, help="outputs of the head layer (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, kind and phase (default 3)")
    parser.add_argument("--import-repeats", type=int, default=40, help="interpreters per import measurement (default 40)")
    parser.add_argument("--use-orig-params", type=int, choices=[0, 1], default=1,
                        help="1 (default): native 2.1.x cannot save full optimizer state with flat parameters")
    parser.add_argument("--allowance-mb", type=float, default=64.0,
                        help="the constant of the memory targets, per rank (default 64 MB)")
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--consolidate", action="store_true",
                        help="also measure consolidate's peak memory per output format, on a sharded checkpoint of the model")
    parser.add_argument("--remote", action="store_true",
                        help="also save and resume to an S3 server started on 127.0.0.1, against the local disk")
    parser.add_argument("--consolidate-from", type=Path, default=None, metavar="DIR",
                        help="measure only consolidate's peak memory per output format, on the sharded checkpoint DIR")
    parser.add_argument("--scaling", type=lambda text: [int(n) for n in text.split(",")], default=None, metavar="L,L,...",
                        help="instead: the sharded costs at these --layers counts (one run each), a fitted line and a prediction")
    parser.add_argument("--plot", type=Path, default=None, help="with --scaling: write a PNG plot here (the [plot] extra)")
    parser.add_argument("--ranks", type=lambda text: [int(n) for n in text.split(",")], default=None, metavar="N,N,...",
                        help="instead: the same state saved and resumed sharded by each of these numbers of ranks")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the records behind every printed table here: figures, ratios, limits and verdicts")
    parser.set_defaults(nproc=RANKS)
    args = parser.parse_args(argv)

    sides = [("shim", sys.executable)] + ([("native", args.native_python)] if args.native_python else [])
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fsdp-resume-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    records: Dict[str, Any] = {}
    try:
        if args.ranks:
            records = ranks_records(measure_ranks(args, workdir))
            text = ranks_report(records, args.repeats)
        elif args.scaling:
            records = scaling_records(measure_scaling(sides, args, workdir))
            text = scaling_report(records) + ("" if args.plot is None else "\n" + scaling_plot(records["sizes"], args.plot))
        elif args.consolidate_from is not None:
            records = {"consolidate": consolidate_records(measure_consolidate(sys.executable, args.consolidate_from, workdir,
                                                                              args.repeats))}
            text = consolidate_report(records["consolidate"], repr(str(args.consolidate_from)))
        else:
            raw: Dict[str, List[Dict]] = {}
            results = run_all(sides, args, workdir, raw)
            consolidated = consolidate_a_save(args, workdir) if args.consolidate else []
            remote = measure_remote(args, workdir) if args.remote else {}
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if not records:  # a run of both kinds: its figures, then the import's
        imports = import_time.measure(sys.executable, args.import_repeats, env=_env())
        figures: Dict[Tuple[str, str, str], Any] = {key: Figures(value) for key, value in results.items() if key[0] != "verify"}
        figures.update({key: [runs[0] for runs in value] for key, value in results.items() if key[0] == "verify"})
        records = run_records(figures, imports, args, raw)
        text = report(records, args)
        if remote:
            records["remote"] = remote_records(remote, figures)
            text += "\n\n" + remote_report(records["remote"])
        if consolidated:
            records["consolidate"] = consolidated
            text += "\n\n" + consolidate_report(consolidated, f"the shim's sharded checkpoint of the model above ({args.layers} × {args.width})")
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(records, indent=1, ensure_ascii=False), encoding="utf-8")
    return 1 if records.get("imports", {}).get("heavy_imported") else 0


if __name__ == "__main__":
    sys.exit(main())
