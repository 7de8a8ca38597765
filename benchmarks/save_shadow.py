"""What a save costs training while it is written (its shadow), on FSDP ranks on the CPU: the patched Trainer's sharded
save, synchronous and with ``AsyncCheckpointIO``, against a window of steps without one; the disk's own write of the
same files; and what ``ShardedEMA``'s update adds to a step.

    python benchmarks/save_shadow.py [--sizes 0.4,1.6,4] [--trials 5] [--steps 12] [--json PATH]

``--sizes``: GB of training state (weights and Adam's two states, float32) over all ranks: a model of square layers,
one FSDP unit each. Each size is one launch of ``--ranks`` ranks: one fit unmeasured, then each trial a run of fits back
to back, each a window of ``--steps`` steps after ``--warmup`` steps: no save, a synchronous save, a save in the
background (after the window's ``--save-at``-th step; the window lasts until the save is in place), then ``ShardedEMA``
at each ``--ema-every``; then every rank writes its share of the synchronous save's files anew, fsynced. A shadow is a
window less the same trial's window without a save (the slowest rank's). Printed: medians over the trials with their
spread, and the targets, each judged in ``targets``. ``--json``: the records behind the tables, each rank's figures too.
"""
import argparse
import functools
import gc
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ema_cost import WIDTH, launch, layers_of, printed, ran_as_rank, sized_options
from resume_benchmark import _median_and_spread, cells_table, judged, table

SAVES = ("none", "sync", "background")  # a trial's windows, in the order they run
SHADOW_RATIO_LIMIT = 0.3  # the background save's shadow / the synchronous save's
RAW_RATIO_LIMIT = 1.3  # the synchronous save / the disk's write of its files by as many processes, fsynced
FIRST_STALL_LIMIT = 0.05  # the first background save's stall / the synchronous save
EMA_SHARE_LIMIT = 0.02  # ShardedEMA's update at update_every_n_steps=1 / a whole step
OUTPUTS = 8  # the head's outputs (checkpoint_ranks.Model)
_RAW_BLOCK = 8 << 20
_DISTCP = re.compile(r"__(\d+)_\d+\.distcp$")  # torch DCP's file of one rank's shards; rank 0 writes the rest


def targets_markdown() -> str:
    """The targets ``targets`` judges, with their limits, from the constants above: docs/benchmark.md quotes this table
    (tests/test_docs.py)."""
    rows = [
        ("a save in the background's shadow (its window less the window without a save) / a synchronous save's",
         f"≤ {SHADOW_RATIO_LIMIT:g}"),
        ("a synchronous save's time / the disk's write of its files, by as many processes, to new files, fsynced",
         f"≤ {RAW_RATIO_LIMIT:g}"),
        ("the first save in the background's stall / a synchronous save's time", f"≤ {FIRST_STALL_LIMIT:g}"),
        ("`ShardedEMA`'s update at `update_every_n_steps=1` / a whole step (forward, backward, optimizer)", f"≤ {EMA_SHARE_LIMIT:g}"),
    ]
    return table(["target, at each size (the ratio of the trials' medians)", "limit"], rows)


# --- the rank program -------------------------------------------------------------------------------------------------


def window_steps(steps: int, every: Sequence[int]) -> int:
    """An EMA window's steps: the least multiple of every ``update_every_n_steps`` that is at least ``steps``, so that
    it holds exactly steps / n updates for each n."""
    whole = functools.reduce(lambda a, b: a * b // math.gcd(a, b), every, 1)
    return whole * -(-steps // whole)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import lightning_fsdp_resume as shim
    from checkpoint_ranks import Block, L, Model, full_state_bytes, host_buffers_ahead
    from lightning_fsdp_resume._patching._held import ModuleHeld, StrategyHeld, drop, peek
    from lightning_fsdp_resume._save_load import _background
    from lightning_fsdp_resume.testing import enable_cpu_fsdp, leave_process_group

    enable_cpu_fsdp()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    layers = layers_of(args.size)
    every = [int(n) for n in args.ema_every.split(",")]
    ema_steps = window_steps(args.steps, every)

    class Window(L.Callback):
        """Times ``steps`` steps after ``warmup`` (each step's end, from a barrier), saving after the ``save_at``-th of
        them where asked; the window ends once the save is in place."""

        def __init__(self, steps: int, save: str = "none", path: str = "") -> None:
            self.steps, self.save, self.path = steps, save, path
            self.start: Optional[float] = None
            self.cpu = 0.0  # the process's CPU time (every thread's) at the window's start
            self.record: Dict[str, Any] = {"stamps": [], "updates": [], "stall": None, "written": None, "saved_at": None,
                                           "in_background": None}

        def now(self) -> float:
            return time.perf_counter() - (self.start or 0.0)

        def written(self) -> None:
            self.record["written"] = self.now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step - args.warmup
            if step == 0:
                host_buffers_ahead(trainer.strategy)  # a save in the background finds its host buffers made
                trainer.strategy.barrier()
                self.start, self.cpu = time.perf_counter(), time.process_time()
            if step <= 0:
                return
            if step == args.save_at and self.save != "none":
                self.record["saved_at"] = self.now()
                trainer.save_checkpoint(self.path)
                self.record["stall"] = self.now() - self.record["saved_at"]
                kept = peek(trainer.strategy, StrategyHeld)
                self.record["in_background"] = kept is not None and kept.pending_save is not None
                _background.after_publish(trainer.strategy, self.written)  # stamped by the thread that wrote it
            self.record["stamps"].append(self.now())
            if step == self.steps:
                shim.wait_for_saves(trainer)
                self.record["window"] = self.now()
                self.record["cpu"] = time.process_time() - self.cpu
                if self.record["in_background"]:
                    self.record["write cpu"] = writing[-1]

    # One model for every fit: torch's FSDP keeps each deleted FSDP module's flat shards alive (torch 2.13 on the CPU,
    # without Lightning too), so a new model a fit would grow every rank by its shard each fit. A model keeps its FSDP
    # root from its first fit on; before each fit it is made new to the package (no views of an earlier save to reuse,
    # no average attached), so that each fit's first save is a first save.
    model = Model(WIDTH, layers, OUTPUTS)
    state = full_state_bytes(model)  # before FSDP holds only this rank's shard of it
    writing: List[float] = []  # the CPU time of each save in the background's writing thread, in its write
    start_writing = _background.start

    def timed_start(strategy, path, write, publish) -> None:
        def timed_write():
            begun = time.thread_time()
            try:
                return write()
            finally:
                writing.append(time.thread_time() - begun)

        start_writing(strategy, path, timed_write, publish)

    _background.start = timed_start

    def fit(steps: int, save: str = "none", path: str = "", every_n: int = 0) -> Dict[str, Any]:
        L.seed_everything(0, workers=False)
        kept = peek(model, ModuleHeld)
        if kept is not None:
            kept.participants.clear()
            if kept.fsdp_root is not None:
                drop(kept.fsdp_root)
        window = Window(steps, save, path)
        window.record["state"] = state
        callbacks: List[Any] = [window]
        if every_n:
            ema = shim.ShardedEMA(update_every_n_steps=every_n)
            update = ema._update

            def timed_update(trainer) -> None:  # the callback's whole update, as it runs after a step
                begun = time.perf_counter()
                update(trainer)
                if window.start is not None:
                    window.record["updates"].append(time.perf_counter() - begun)

            ema._update = timed_update  # type: ignore[method-assign]
            callbacks.insert(0, ema)  # before the window's callback: each step's end stamped after its update
        samples = args.batch * world * (args.warmup + steps)
        generator = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(samples, WIDTH, generator=generator),
                                              torch.randn(samples, OUTPUTS, generator=generator))
        trainer = L.Trainer(
            accelerator="cpu", devices=world, max_steps=args.warmup + steps, callbacks=callbacks,
            strategy=L.strategies.FSDPStrategy(state_dict_type="sharded", auto_wrap_policy=ModuleWrapPolicy({Block})),
            plugins=[L.plugins.AsyncCheckpointIO()] if save == "background" else [],
            enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=args.batch))
        del trainer, callbacks
        gc.collect()  # this fit's optimizer and host buffers gone before the next fit
        return window.record

    fit(args.steps)  # unmeasured: the process's first fit pays for what later ones find made (imports, gloo's first collectives)
    trials = []
    for trial in range(args.trials):
        figures: Dict[str, Any] = {}
        for save in SAVES:
            where = Path(args.workdir) / f"trial{trial}-{save}"
            figures[save] = fit(args.steps, save, str(where / "checkpoint"))
            dist.barrier()
            if save == "sync":  # the files the save wrote, by the rank that wrote them
                figures["files"] = sorted((p.name, p.stat().st_size) for p in (where / "checkpoint").rglob("*") if p.is_file())
            dist.barrier()
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)
        figures["ema"] = {str(n): fit(ema_steps, every_n=n) for n in every}
        mine = [size for name, size in figures["files"] if writer_of(name) == rank]
        figures["raw"] = raw_write(Path(args.workdir) / f"trial{trial}-raw", rank, mine, dist.barrier)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(Path(args.workdir) / f"trial{trial}-raw", ignore_errors=True)
        trials.append(figures)
    record = {"rank": rank, "layers": layers, "ema steps": ema_steps, "torch": torch.__version__, "trials": trials}
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record))
    leave_process_group()


def writer_of(name: str) -> int:
    """The rank that writes a sharded checkpoint's file ``name``."""
    found = _DISTCP.search(name)
    return int(found.group(1)) if found else 0


def raw_write(directory: Path, rank: int, sizes: Sequence[int], barrier) -> Dict[str, Any]:
    """This rank's files of the save's sizes, new in ``directory``, written in 8 MB blocks of random bytes and each
    fsynced, then the directory; timed from a barrier of every rank."""
    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(_RAW_BLOCK)  # not zeros, which a file system may store without writing
    barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    for index, size in enumerate(sizes):
        with open(directory / f"raw-{rank}-{index}", "wb", buffering=0) as handle:
            for offset in range(0, size, _RAW_BLOCK):
                handle.write(block[: min(_RAW_BLOCK, size - offset)])
            os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return {"seconds": time.perf_counter() - start, "cpu": time.thread_time() - cpu, "bytes": sum(sizes), "files": len(sizes)}


# --- the launch and the records ---------------------------------------------------------------------------------------


def measure(size: float, args: argparse.Namespace) -> Dict[str, Any]:
    """One size: a launch of ``args.ranks`` ranks, every rank's record."""
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        print(f"{size} GB: {args.trials} trials on {args.ranks} ranks", file=sys.stderr, flush=True)
        options = {"--size": size, "--workdir": workdir, "--trials": args.trials, "--steps": args.steps, "--warmup": args.warmup,
                   "--save-at": args.save_at, "--ema-every": args.ema_every, "--batch": args.batch}
        return {"size": size, "ranks": launch(Path(__file__).resolve(), args.ranks, options)}


def _durations(stamps: Sequence[float]) -> List[float]:
    return [end - start for start, end in zip([0.0, *stamps], stamps)]


def slowest(windows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One window of every rank as the slowest rank's: its length, each step's, the save's stall and when the save was in
    place (from the save's call), and which steps began while it was written on some rank (``during``)."""
    steps = [max(step) for step in zip(*(_durations(w["stamps"]) for w in windows))]
    combined: Dict[str, Any] = {"window": max(w["window"] for w in windows), "steps": steps, "during": [False] * len(steps),
                                "cpu": sum(w["cpu"] for w in windows)}  # the CPU every rank took: the cores they share
    if windows[0]["stall"] is not None:
        combined.update(stall=max(w["stall"] for w in windows), written=max(w["written"] - w["saved_at"] for w in windows),
                        in_background=all(w["in_background"] for w in windows),
                        outlasted=any(w["written"] > w["stamps"][-1] for w in windows))  # the window's end waited for it
        begins = zip(*([0.0, *w["stamps"][:-1]] for w in windows))  # each step's beginning, on each rank
        combined["during"] = [any(w["saved_at"] <= begun < w["written"] for w, begun in zip(windows, begun_on)) for begun_on in begins]
    return combined


def size_record(result: Dict[str, Any]) -> Dict[str, Any]:
    """One size's trials as the slowest rank's: its windows, each save's shadow (its window less the same trial's window
    without a save), the raw write of the save's files, and each ShardedEMA window's updates against a step."""
    ranks = result["ranks"]
    trials = []
    for index in range(len(ranks[0]["trials"])):
        per_rank = [rank["trials"][index] for rank in ranks]
        windows = {save: slowest([r[save] for r in per_rank]) for save in SAVES}
        shadow = {save: windows[save]["window"] - windows["none"]["window"] for save in SAVES[1:]}
        cpu = {save: windows[save]["cpu"] - windows["none"]["cpu"] for save in SAVES[1:]}
        step = statistics.median(windows["none"]["steps"])
        ema = {n: {"updates": max(len(r["ema"][n]["updates"]) for r in per_rank),
                   "update": max(statistics.median(r["ema"][n]["updates"]) if r["ema"][n]["updates"] else 0.0 for r in per_rank),
                   "per step": max(sum(r["ema"][n]["updates"]) for r in per_rank) / ranks[0]["ema steps"]}
               for n in per_rank[0]["ema"]}
        raw = {"seconds": max(r["raw"]["seconds"] for r in per_rank), "cpu": sum(r["raw"]["cpu"] for r in per_rank),
               "bytes": sum(r["raw"]["bytes"] for r in per_rank), "files": sum(r["raw"]["files"] for r in per_rank)}
        write_cpu = sum(r["background"].get("write cpu", 0.0) for r in per_rank)  # none where it ran in the foreground
        during = [s for s, flag in zip(windows["background"]["steps"], windows["background"]["during"]) if flag]
        trials.append({"windows": windows, "shadow": shadow, "cpu": cpu, "step": step, "during": during, "raw": raw, "ema": ema,
                       "write cpu": write_cpu,
                       "saved bytes": sum(size for _, size in per_rank[0]["files"])})
    return {"size": result["size"], "layers": ranks[0]["layers"], "state": ranks[0]["trials"][0]["none"]["state"],
            "ema steps": ranks[0]["ema steps"], "torch": ranks[0]["torch"], "trials": trials, "ranks": ranks}


def _seconds(values: Sequence[float]) -> str:
    return _median_and_spread(values, 3)


def _ms(values: Sequence[float]) -> str:
    return _median_and_spread([value * 1e3 for value in values], 1)


def _state(size: Dict[str, Any]) -> str:
    return f"{size['state'] / 1e9:.2f} GB ({size['layers']} layer{'s' if size['layers'] > 1 else ''})"


def window_rows(size: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A row per save of one size: its window, shadow, stall, when it was in place, the steps that ran while it was
    written; each figure the trials' median with its spread."""
    trials, rows = size["trials"], []
    for save in SAVES:
        windows = [trial["windows"][save] for trial in trials]
        row: Dict[str, Any] = {"size": size["size"], "save": save, "windows": [w["window"] for w in windows]}
        row["window cpu"] = [w["cpu"] for w in windows]
        cells = {"state": _state(size), "save": save, "window s": _seconds(row["windows"]), "CPU s": _seconds(row["window cpu"])}
        if save == "none":
            row["step"] = [trial["step"] for trial in trials]
            cells.update({"shadow s": "—", "CPU shadow s": "—", "stall s": "—", "in place after s": "—", "steps during the write": "—",
                          "median step ms": "without a save: " + _ms(row["step"])})
        else:
            row.update(shadow=[trial["shadow"][save] for trial in trials], cpu=[trial["cpu"][save] for trial in trials],
                       stall=[w["stall"] for w in windows],
                       written=[w["written"] for w in windows], during=[sum(w["during"]) for w in windows])
            row["in background"] = all(w["in_background"] for w in windows)
            row["outlasted"] = sum(w["outlasted"] for w in windows)
            cells.update({"shadow s": _seconds(row["shadow"]), "CPU shadow s": _seconds(row["cpu"]), "stall s": _seconds(row["stall"]),
                          "in place after s": _seconds(row["written"]),
                          "steps during the write": f"{statistics.median(row['during']):g} of {len(windows[0]['steps'])}"})
            cells["median step ms"] = "—"
            if save == "background":
                row["step during"] = [statistics.median(trial["during"]) for trial in trials if trial["during"]]
                row["step without"] = [trial["step"] for trial in trials if trial["during"]]
                if row["step during"]:
                    row["during / without"] = statistics.median(row["step during"]) / statistics.median(row["step without"])
                    cells["median step ms"] = (f"during the write: {_ms(row['step during'])}, {row['during / without']:.2f} ×"
                                               " without")
        rows.append({"cells": cells, **row})
    return rows


def disk_row(size: Dict[str, Any]) -> Dict[str, Any]:
    """One size's synchronous save against the disk's write of its files (as many processes and files, fsynced), and the
    first save in the background's stall."""
    trials = size["trials"]
    sync, raw = [t["windows"]["sync"]["stall"] for t in trials], [t["raw"]["seconds"] for t in trials]
    stall = [t["windows"]["background"]["stall"] for t in trials]
    write_cpu, raw_cpu = [t["write cpu"] for t in trials], [t["raw"]["cpu"] for t in trials]
    cells = {"state": _state(size), "checkpoint MB": f"{trials[0]['saved bytes'] / 1e6:.1f} in {trials[0]['raw']['files']} files",
             "sync save s": _seconds(sync), "raw write s": _seconds(raw), "first background stall s": _seconds(stall),
             "background write CPU s": _seconds(write_cpu), "raw write CPU s": _seconds(raw_cpu),
             "write CPU / raw": f"{statistics.median(write_cpu) / statistics.median(raw_cpu):.2f}"}
    return {"cells": cells, "size": size["size"], "sync": sync, "raw": raw, "stall": stall, "write cpu": write_cpu,
            "raw cpu": raw_cpu, "bytes": [t["raw"]["bytes"] for t in trials]}


def ema_rows(size: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A row per ``update_every_n_steps``: the updates in its window, each one's time, their time per step, and that
    against a step without (the window without a save's median step)."""
    trials, rows = size["trials"], []
    step = [t["step"] for t in trials]
    for n in trials[0]["ema"]:
        update, per_step = [t["ema"][n]["update"] for t in trials], [t["ema"][n]["per step"] for t in trials]
        share = statistics.median(per_step) / statistics.median(step)
        cells = {"state": _state(size), "update_every_n_steps": n, "updates": f"{trials[0]['ema'][n]['updates']} in {size['ema steps']} steps",
                 "update ms": _ms(update), "per step ms": _ms(per_step), "step ms": _ms(step), "share of a step": f"{share:.2%}"}
        rows.append({"cells": cells, "size": size["size"], "every": int(n), "update": update, "per step": per_step, "step": step,
                     "share": share})
    return rows


def targets(sizes: Sequence[Dict[str, Any]], windows: Sequence[Dict], disk: Sequence[Dict], ema: Sequence[Dict]) -> List[Dict]:
    """Every target at every size, each judged (``resume_benchmark.judged``): its value the ratio of the two medians it
    names, against its limit."""
    rows = []
    for size in sizes:
        gb = f"{size['state'] / 1e9:.2f} GB"
        saves = {row["save"]: row for row in windows if row["size"] == size["size"]}
        (row,) = [row for row in disk if row["size"] == size["size"]]
        every = {r["every"]: r for r in ema if r["size"] == size["size"]}
        checks = [
            (f"background save's shadow / sync save's shadow, {gb}", [saves["background"]["shadow"], saves["sync"]["shadow"]],
             SHADOW_RATIO_LIMIT, "s"),
            (f"sync save / raw write of its files, {gb}", [row["sync"], row["raw"]], RAW_RATIO_LIMIT, "s"),
            (f"first background stall / sync save, {gb}", [row["stall"], row["sync"]], FIRST_STALL_LIMIT, "s"),
        ]
        if 1 in every:
            checks.append((f"ShardedEMA update / step at update_every_n_steps=1, {gb}", [every[1]["per step"], every[1]["step"]],
                           EMA_SHARE_LIMIT, "ms"))
        for name, (over, under), limit, unit in checks:
            of = [statistics.median(over), statistics.median(under)]
            ratio = of[0] / of[1] if of[1] > 0 else None
            shown = [f"{value * (1e3 if unit == 'ms' else 1):.{1 if unit == 'ms' else 3}f}" for value in of]
            figure = "n/a" if ratio is None else f"{ratio:.3f} ({shown[0]} / {shown[1]} {unit})"
            rows.append(judged({"target": name, "figure": figure, "limit": f"≤ {limit:g}"}, ratio, limit, "ratio", of))
    return rows


def records(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    sizes = [size_record(result) for result in results]
    windows = [row for size in sizes for row in window_rows(size)]
    disk = [disk_row(size) for size in sizes]
    ema = [row for size in sizes for row in ema_rows(size)]
    return {"sizes": sizes, "windows": windows, "disk": disk, "ema": ema, "targets": targets(sizes, windows, disk, ema)}


def report(records: Dict[str, Any], ranks: int) -> str:
    """The tables, printed from the records (``records``)."""
    first = records["sizes"][0]
    trials = len(first["trials"])
    lines = [
        f"The write's shadow: {ranks} CPU ranks (gloo), torch {first['torch']}, {os.cpu_count()} CPU cores; medians of {trials} trials"
        " (min–max), the slowest rank's. Each trial runs windows of the same steps back to back: without a save, with a"
        " synchronous save, with one in the background (AsyncCheckpointIO) lasting until it is in place. Shadow: the window less"
        " the same trial's window without a save; CPU: what every rank's process took in the window (each thread's), and its"
        " shadow that less the same trial's without a save; stall: how long the save call blocked the step.", "",
        cells_table(records["windows"]), "",
        f"The synchronous save against the disk's write of the same files by as many processes ({ranks}), fresh and fsynced;"
        " the first background save's stall; and the CPU time a save in the background's writing threads took in their"
        " write (every rank's), against the disk's write's.", "",
        cells_table(records["disk"]), "",
        "ShardedEMA: the callback's updates in a window of steps, per step, against a step without it (the window without a"
        " save's median step).", "",
        cells_table(records["ema"]), "",
        cells_table(records["targets"]),
    ]
    background = [row for row in records["windows"] if row["save"] == "background"]
    if not all(row["in background"] for row in background):
        lines += ["", "Saves in the background ran in the foreground here (they need torch ≥ 2.3)."]
    for row in background:
        if row["outlasted"]:
            lines += ["", f"{row['size']} GB: in {row['outlasted']} of {len(row['windows'])} trials the window's steps ended before"
                      " the background save was in place, and the window waited for it: more --steps would show its shadow alone."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = sized_options(__doc__, "0.4,1.6,4")
    parser.add_argument("--trials", type=int, default=5, help="at least 2 (default 5)")
    parser.add_argument("--steps", type=int, default=12, help="steps in a window (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before each window (default 2)")
    parser.add_argument("--save-at", type=int, default=3, help="the save comes after this step of the window (default 3)")
    parser.add_argument("--ema-every", default="1,4,16", help="ShardedEMA's update_every_n_steps, a window each (default 1,4,16)")
    parser.add_argument("--batch", type=int, default=8, help="samples a step on each rank (default 8)")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: the temporary directory)")
    args = parser.parse_args(argv)
    if ran_as_rank(args, rank_main):
        return 0
    if args.trials < 2:
        parser.error("--trials: at least 2, for a median and its spread")
    if not 1 <= args.save_at <= args.steps or args.warmup < 1:
        parser.error("--save-at: a step of the window (1 to --steps); --warmup: at least 1, so that Adam has its states")
    rows = records([measure(float(size), args) for size in args.sizes.split(",")])
    return printed(report(rows, args.ranks), rows, args.json)

if __name__ == "__main__":
    sys.exit(main())
