"""What placing the data cursor costs: an epoch of ``--size`` samples drawn by a shuffling ``DistributedSampler``,
saved by 2 ranks after ``--at`` of it and resumed on each of ``--ranks``: rank 0's share of the rest, placed by
``_data_cursor.place`` (what a resumed Trainer runs), against walking the saving run's sampler to the same place.

    python benchmarks/data_cursor.py [--size 10000000] [--at 0.9] [--ranks 1,3,4] [--repeats 3]

Each measurement runs in a fresh process (its peak resident memory is its own). Prints, per rank count, the median
time and memory growth over the repeats with their spread, against the targets: ≤ 1 s and ≤ 100 MB a rank.
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

TIME_TARGET_S, MEMORY_TARGET_MB = 1.0, 100.0
SAVED_ON, BATCH = 2, 8


def measure(size: int, at: float, ranks: int, way: str) -> dict:
    """One placement in this process: seconds and peak resident growth (MB)."""
    import torch

    from lightning_fsdp_resume._run_state import _data_cursor

    sampler = torch.utils.data.DistributedSampler(range(size), num_replicas=SAVED_ON, rank=0, shuffle=True, seed=7)
    loader = torch.utils.data.DataLoader(range(size), batch_size=BATCH, sampler=sampler)
    batches = int(size * at) // (BATCH * SAVED_ON)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    if way == "cursor":
        saved = _data_cursor.cursor(_data_cursor.identity(loader), _data_cursor.first_segment(SAVED_ON), batches)
        share = _data_cursor.place(saved, 0, ranks, batches).indices
    else:  # the saving run's sampler walked past what rank 0 trained (all a per-rank skip can do)
        iterator = iter(sampler)
        for _ in range(batches * BATCH):
            next(iterator)
        share = list(iterator)
    seconds = time.perf_counter() - began
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return {"seconds": seconds, "mb": grown, "share": len(share)}


def _median(values):
    return statistics.median(values), max(values) - min(values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000_000)
    parser.add_argument("--at", type=float, default=0.9)
    parser.add_argument("--ranks", default="1,3,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)  # ranks, way: a measuring process
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.size, args.at, int(args.one[0]), args.one[1])))
        return 0
    rows = []
    print(f"{args.size:,} samples, saved by {SAVED_ON} ranks after {args.at:.0%}; medians of {args.repeats} (spread)")
    print(f"{'ranks':>5} {'way':>7} {'seconds':>16} {'MB':>14} {'share':>9} {'verdict':>7}")
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for way in ("cursor", "walk"):
            runs = [json.loads(subprocess.run([sys.executable, __file__, "--size", str(args.size), "--at", str(args.at),
                                               "--one", str(ranks), way], capture_output=True, text=True,
                                              check=True).stdout) for _ in range(args.repeats)]
            (seconds, spread_s), (mb, spread_mb) = _median([r["seconds"] for r in runs]), _median([r["mb"] for r in runs])
            met = seconds <= TIME_TARGET_S and mb <= MEMORY_TARGET_MB
            verdict = ("met" if met else "MISSED") if way == "cursor" else "-"
            rows.append({"ranks": ranks, "way": way, "seconds": seconds, "seconds_spread": spread_s, "mb": mb,
                         "mb_spread": spread_mb, "share": runs[0]["share"], "verdict": verdict})
            print(f"{ranks:>5} {way:>7} {seconds:>9.3f} ±{spread_s:<5.3f} {mb:>8.1f} ±{spread_mb:<4.1f} "
                  f"{runs[0]['share']:>9,} {verdict:>7}")
    print(f"targets: ≤ {TIME_TARGET_S} s and ≤ {MEMORY_TARGET_MB:.0f} MB a rank for the cursor")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
