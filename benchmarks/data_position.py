"""What putting a resumed epoch's data back in place costs: an epoch of ``--batches`` batches resumed after
``--at`` of them, its trained batches left out by index (``set_mid_epoch_resume("skip")``, the default for a map-style
dataset) against loading them and dropping them (``"replay"``, and every loader without indices), through the same
code a resumed Trainer runs (``_data_position.reposition``). One process, no Trainer: the figure is the data's alone.

    python benchmarks/data_position.py [--batches 10000] [--at 0.9] [--repeats 5] [--json PATH]

Prints, for each way, the median time over the repeats with its spread, and the ratio the target is set on:
leaving out by index costs at most 1 % of loading the batches it leaves out.
"""
import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from lightning_fsdp_resume._run_state import _data_position
from resume_benchmark import cells_table

TARGET = 0.01  # index-level skipping / loading the skipped batches


class Images(torch.utils.data.Dataset):
    """Small images made and normalised as they are read: a sample costs what a cheap decode and transform do."""

    def __init__(self, samples: int) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int):
        image = torch.rand(3, 32, 32)
        return (image - image.mean()) / (image.std() + 1e-6), index % 10


def position_once(mode: str, batches: int, at: int) -> float:
    """Seconds ``reposition`` takes to make a shuffled epoch's iterator going on after batch ``at``."""
    _data_position.set_mode(mode)
    loader = torch.utils.data.DataLoader(Images(batches * 8), batch_size=8, shuffle=True)
    start = _data_position.epoch_start([loader])
    saved = _data_position.position(0, at, False, start, [loader])
    iterator: List = []
    began = time.perf_counter()
    _data_position.reposition([loader], saved, lambda: iterator.append(iter(loader)), lambda: next(iterator[0]))
    next(iterator[0])  # the first batch after the position: where a by-index skip draws the indices it leaves out
    return time.perf_counter() - began


def measure(batches: int, at: int, repeats: int) -> Dict[str, List[float]]:
    return {mode: [position_once(mode, batches, at) for _ in range(repeats)] for mode in ("skip", "replay")}


WAYS = (("skip", "left out by index (skip)"), ("replay", "loaded and dropped (replay)"))


def records(times: Dict[str, List[float]]) -> Dict:
    """Each way's times with the cells of its row (``ways``), and the ratio of their medians against the target."""
    ways = [{"cells": {"way": name, "median": f"{statistics.median(times[mode]):.4f} s",
                       "spread (min–max)": f"{min(times[mode]):.4f}–{max(times[mode]):.4f} s"}, "mode": mode, "times": times[mode]}
            for mode, name in WAYS]
    ratio = statistics.median(times["skip"]) / statistics.median(times["replay"])
    return {"ways": ways, "ratio": ratio, "limit": TARGET, "verdict": "met" if ratio <= TARGET else "MISSED"}


def report(record: Dict, batches: int, at: int) -> str:
    """The table and the ratio's line, printed from the records (``records``)."""
    return "\n".join([
        f"An epoch of {batches} batches resumed after {at} ({at / batches:.0%}), medians of {len(record['ways'][0]['times'])} repeats",
        cells_table(record["ways"]),
        f"skip / replay: {record['ratio']:.4f} (target ≤ {record['limit']}): {record['verdict']}",
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=10_000, help="batches in the epoch (default 10000)")
    parser.add_argument("--at", type=float, default=0.9, help="the share of the epoch trained before the save (default 0.9)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each way (default 5, at least 3)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the records behind the report here")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats: at least 3, for a median and its spread")
    at = int(args.batches * args.at)
    logging.getLogger("lightning_fsdp_resume").setLevel(logging.ERROR)  # each replay's warning: the table says it
    record = records(measure(args.batches, at, args.repeats))
    print(report(record, args.batches, at))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1, ensure_ascii=False), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
