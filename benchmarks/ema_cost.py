"""What ``ShardedEMA`` costs a training step: its update of the average on each rank's shards against the optimizer
step it follows (Adam), and the memory the average takes against one float32 shard, on FSDP ranks on the CPU.

    python benchmarks/ema_cost.py [--ranks 2] [--sizes 0.4,1.6] [--repeats 5] [--steps 5] [--json PATH]

``--sizes``: GB of training state (weights and Adam's two states, float32) over all ranks: a model of square layers
wrapped one FSDP unit each. Each repeat times ``--steps`` optimizer steps and as many updates on every rank (the
slowest rank counts); printed are the medians over the repeats with their spread, and the ratios the targets are set
on: an update ≤ 10 % of the optimizer step, the average's memory ≤ 1.05 × one float32 shard. ``--json``: the records
behind the table too, each rank's figures among them.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from resume_benchmark import cells_table

UPDATE_TARGET = 0.10  # update / optimizer step
MEMORY_TARGET = 1.05  # the average's resident memory / one float32 shard
WIDTH = 1024
BYTES_PER_WEIGHT = 4 * 3  # the weight and Adam's two states, float32


def layers_of(size: float) -> int:
    """Square ``WIDTH`` layers that hold ``size`` GB of training state (weights and Adam's two states, float32)."""
    return max(1, round(size * 1e9 / BYTES_PER_WEIGHT / (WIDTH * WIDTH)))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lightning_fsdp_resume._participants import _ema
    from lightning_fsdp_resume.testing import enable_cpu_fsdp, leave_process_group
    from peak_rss import rss_bytes

    dist.init_process_group("gloo")
    enable_cpu_fsdp()
    torch.manual_seed(0)
    layers = layers_of(args.size)
    model = FSDP(nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH)) for _ in range(layers))),
                 auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()  # Adam's states exist
    average = _ema.Average(decay=0.999)
    shard_bytes = sum(param.numel() * 4 for param in model.parameters())
    before = rss_bytes()
    average.update(model)  # the first update makes the average
    grown = rss_bytes() - before
    steps, updates = [], []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            optimizer.step()
        steps.append((time.perf_counter() - start) / args.steps)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            average.update(model)
        updates.append((time.perf_counter() - start) / args.steps)
    record = {"rank": dist.get_rank(), "layers": layers, "shard_bytes": shard_bytes, "grown": grown, "steps": steps,
              "updates": updates}
    (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    del model, optimizer, average
    leave_process_group()


def launch(script: Path, ranks: int, options: Dict[str, Any]) -> List[Dict]:
    """``script``'s rank program (``--rank-program``) on ``ranks`` ranks under torchrun, with ``options`` and an ``--out``
    folder for each rank's record: every rank's record, by rank."""
    with tempfile.TemporaryDirectory() as out:
        here = Path(__file__).resolve()
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=os.pathsep.join([str(here.parents[1]), str(here.parent), os.environ.get("PYTHONPATH", "")]))
        arguments = [str(item) for pair in {**options, "--out": out}.items() for item in pair]
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                        str(script), "--rank-program", *arguments], check=True, env=env, stdout=subprocess.DEVNULL)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"), key=lambda p: int(p.stem[4:]))]


def measure(size: float, ranks: int, repeats: int, steps: int) -> Dict:
    """One size on ``ranks`` ranks: every rank's record."""
    return {"size": size, "records": launch(Path(__file__).resolve(), ranks, {"--size": size, "--repeats": repeats, "--steps": steps})}


def _spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f} ms ({min(values) * 1e3:.1f}–{max(values) * 1e3:.1f})"


def records(results: List[Dict]) -> List[Dict]:
    """A record per size: its ranks' records, the slowest rank's times of each repeat, the ratios the targets are set on
    and the verdict, with the cells of its row."""
    rows = []
    for result in results:
        ranks = result["records"]
        steps = [max(r["steps"][i] for r in ranks) for i in range(len(ranks[0]["steps"]))]
        updates = [max(r["updates"][i] for r in ranks) for i in range(len(ranks[0]["updates"]))]
        ratio = statistics.median(updates) / statistics.median(steps)
        memory = max(r["grown"] / r["shard_bytes"] for r in ranks)
        verdict = "met" if ratio <= UPDATE_TARGET and memory <= MEMORY_TARGET else "missed"
        cells = {"state": f"{result['size']} GB", "layers": str(ranks[0]["layers"]), "optimizer step": _spread(steps),
                 "EMA update": _spread(updates), "update / step": f"{ratio:.3f} (≤ {UPDATE_TARGET})",
                 "average's memory / fp32 shard": f"{memory:.3f} (≤ {MEMORY_TARGET}) {verdict}"}
        rows.append({"cells": cells, "size": result["size"], "ranks": ranks, "steps": steps, "updates": updates, "ratio": ratio,
                     "update limit": UPDATE_TARGET, "memory": memory, "memory limit": MEMORY_TARGET, "verdict": verdict})
    return rows


def report(rows: List[Dict], ranks: int) -> str:
    """The table, printed from the records (``records``)."""
    return (f"ShardedEMA's cost on {ranks} CPU ranks (medians over the repeats, spread in brackets; slowest rank)\n"
            + cells_table(rows))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = sized_options(__doc__, "0.4,1.6")
    parser.add_argument("--repeats", type=int, default=5, help="at least 3 (default 5)")
    parser.add_argument("--steps", type=int, default=5, help="steps and updates timed in each repeat (default 5)")
    args = parser.parse_args(argv)
    if ran_as_rank(args, rank_main):
        return 0
    if args.repeats < 3:
        parser.error("--repeats: at least 3, for a median and its spread")
    rows = records([measure(float(size), args.ranks, args.repeats, args.steps) for size in args.sizes.split(",")])
    return printed(report(rows, args.ranks), rows, args.json)


def sized_options(doc: str, sizes: str) -> argparse.ArgumentParser:
    """The options of a benchmark that launches its rank program for each of ``--sizes`` (``launch``): ``--ranks``,
    ``--sizes``, ``--json``, and the rank program's own."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", default=sizes, help=f"GB of training state, comma-separated (default {sizes})")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the records behind the tables here")
    parser.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def ran_as_rank(args: argparse.Namespace, rank_main: Callable[[argparse.Namespace], None]) -> bool:
    """Whether this process is a rank (``--rank-program``, launched by ``launch``): then it has run ``rank_main``."""
    if args.rank_program:
        rank_main(args)
    return bool(args.rank_program)


def printed(text: str, rows: Any, path: Optional[Path]) -> int:
    """Print a benchmark's tables, and write the records they are printed from to ``path``, where given."""
    print(text)
    if path is not None:
        path.write_text(json.dumps(rows, indent=1, ensure_ascii=False), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
