"""The demo: an uninterrupted FSDP run against one stopped mid-run and resumed in new processes.

``run_demo`` orchestrates torchrun launches of this module: the reference run, the run that stops
after ``--stop-after`` epochs (checkpointing each epoch), and the run that resumes from its last
checkpoint; with ``--compare-stock`` first that pair with patching off (stock Lightning). Each rank
program records, on rank 0, the loss of every step and the gathered weights at every epoch end, and
each failing rank its error; the orchestrator compares each resumed run with the reference by one
routine and prints a table, a column per resumed run, and a verdict per run.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

from . import DISABLE_ENV
from ._versions import FLAVOURS, installed_version

PROGRESS = "demo: "
SHIM = "lightning_fsdp_resume"  # the shim's column
FAILED = "failed-rank"  # + the rank + ".txt": a rank program's error, type and first line


def run_demo(args: argparse.Namespace) -> int:
    if not 0 < args.stop_after < args.epochs:
        print(f"--stop-after must lie between 0 and --epochs ({args.epochs}); got {args.stop_after}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fsdp-resume-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    phases = [("reference", f"uninterrupted, {args.epochs} epochs", ["--epochs", str(args.epochs)], True)]
    # (directory prefix, patched): stock Lightning first, so that the problem comes before the fix
    for prefix, patched in ([("stock-", False)] if args.compare_stock else []) + [("", True)]:
        last = workdir / f"{prefix}interrupted" / "ckpt" / f"epoch={args.stop_after - 1}.ckpt"
        kind = args.state_dict_type if patched else "stock: one full file"
        phases += [
            (f"{prefix}interrupted", f"stops after {args.stop_after} epochs, checkpointing ({kind})",
             ["--epochs", str(args.stop_after)], patched),
            (f"{prefix}resumed", f"new processes resume from {last.name} to {args.epochs} epochs",
             ["--epochs", str(args.epochs), "--ckpt-path", str(last)], patched),
        ]
    print(f"Working in {workdir} with {args.ranks} ranks")
    for number, (name, what, extra, patched) in enumerate(phases, 1):
        print(f"[{number}/{len(phases)}] {name} run: {what}", flush=True)
        # Stock 2.0.x forwards unknown arguments to torch's FSDP, which rejects state_dict_type.
        shim_only = ["--state-dict-type", args.state_dict_type] if patched else []
        code = _launch(args.ranks, workdir / name, ["--hidden", str(args.hidden), *shim_only, *extra], patched)
        if code != 0 and patched:
            print(f"The {name} run failed (exit status {code}); its output is above.", file=sys.stderr)
            return code
    stock = workdir / "stock-resumed" if args.compare_stock else None
    return _report(workdir / "reference", workdir / "resumed", args.stop_after, stock)


def _launch(ranks: int, out: Path, args: List[str], patched: bool) -> int:
    """Run the rank program under torchrun, showing its progress lines; all its output goes to ``out/launch.log``.

    Where a patched run fails, the end of its output goes to stderr; a stock run's failure (expected) is one line.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "lightning_fsdp_resume.demo", "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop(DISABLE_ENV, None)  # the shim's runs patch even where the caller's environment turns patching off
    if not patched:
        env[DISABLE_ENV] = "1"
    out.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    other = []
    assert process.stdout is not None
    with open(out / "launch.log", "w") as log:
        for line in process.stdout:
            log.write(line)
            if line.startswith(PROGRESS):
                print("      " + line[len(PROGRESS):], end="", flush=True)
            else:
                other.append(line)
    code = process.wait()
    if code != 0 and patched:
        sys.stderr.write("".join(other[-80:]))
    elif code != 0:
        print(f"      failed (exit status {code}): {_failure(out)}\n      its output: {out / 'launch.log'}", flush=True)
    return code


# --- the comparison: every resumed run against the reference, one routine for each column ---------


class _Comparison(NamedTuple):
    rows: Dict[int, Tuple[float, float]]  # epoch -> (resumed loss at the epoch's last step, largest |Δ param|)
    first_step: Optional[int]  # the first step the resumed run took
    exact: bool
    failure: Optional[str]  # how the run failed: "RuntimeError: <first line>", "no output"


def _report(reference: Path, resumed: Path, stop_after: int, stock: Optional[Path] = None) -> int:
    """Print the shim's resumed run against the reference, stock Lightning's in a column before it if given,
    and a verdict for each; 0 when the shim's run is exact."""
    import torch

    ref_losses = _losses(reference)
    ref_steps = {epoch: torch.load(path, weights_only=False)["step"] for epoch, path in _epoch_files(reference).items()}
    epochs = sorted(epoch for epoch in ref_steps if epoch >= stop_after)
    columns = {_stock_label(): stock, SHIM: resumed} if stock is not None else {"": resumed}
    results = {label: _compare(reference, run, epochs, ref_losses) for label, run in columns.items()}
    width = 16 + 1 + 18  # a column: resumed loss, largest |Δ param|
    print()
    if stock is not None:
        print((" " * (5 + 1 + 6 + 1 + 16) + "".join(f"   {label:^{width}}" for label in columns)).rstrip())
    print(f"{'epoch':>5} {'step':>6} {'reference loss':>16}" + f"   {'resumed loss':>16} {'largest |Δ param|':>18}" * len(columns))
    for epoch in epochs:
        cells = "".join(f"   {_cell(result, epoch, width)}" for result in results.values())
        print(f"{epoch:>5} {ref_steps[epoch]:>6} {ref_losses[ref_steps[epoch]]:>16.8f}{cells}")
    print()
    for label, result in results.items():
        print(f"{label}: {_verdict(result, stop_after)}" if label else _verdict(result, stop_after))
    return 0 if results[SHIM if stock is not None else ""].exact else 1


def _compare(reference: Path, resumed: Path, epochs: List[int], ref_losses: Dict[int, float]) -> _Comparison:
    """One resumed run against the reference: exact when it did not fail and every loss it recorded and the
    weights at the end of every one of ``epochs`` equal the reference's."""
    import torch

    failure = _failure(resumed)
    losses = _losses(resumed) if (resumed / "losses.jsonl").is_file() else {}
    exact = failure is None and bool(losses) and all(ref_losses.get(step) == loss for step, loss in losses.items())
    rows = {}
    for epoch, path in _epoch_files(resumed).items():
        mine, theirs = torch.load(path, weights_only=False), torch.load(reference / path.name, weights_only=False)
        diff = max(float((mine["params"][k] - theirs["params"][k]).abs().max()) for k in theirs["params"])
        rows[epoch] = (losses.get(mine["step"], float("nan")), diff)
        exact = exact and diff == 0.0 and set(mine["params"]) == set(theirs["params"]) and mine["step"] in losses
    exact = exact and set(epochs) <= set(rows)
    return _Comparison(rows, min(losses, default=None), exact, failure)


def _verdict(result: _Comparison, stop_after: int) -> str:
    if result.exact:
        return (f"PASS: resumed from epoch {stop_after}, every loss from step {result.first_step} on and every weight"
                " equal bit for bit.")
    if result.failure:
        return f"FAIL: resume failed: {result.failure}"
    return "FAIL: the resumed run differs from the uninterrupted one."


def _cell(result: _Comparison, epoch: int, width: int) -> str:
    if epoch in result.rows:
        loss, diff = result.rows[epoch]
        return f"{loss:>16.8f} {diff:>18.3g}"
    what = f"resume failed: {result.failure.split(':')[0]}" if result.failure else "no record of this epoch"
    return f"{what:^{width}}"


def _stock_label() -> str:
    return f"stock Lightning {_lightning_version() or '(not installed)'}"


def _lightning_version() -> Optional[str]:
    """The release the rank program imports: ``lightning``'s, else ``pytorch_lightning``'s (None: neither)."""
    return next(filter(None, map(installed_version, FLAVOURS)), None)


def _failure(run: Path) -> Optional[str]:
    """A run's recorded error (its lowest rank's), "no output" when it left no losses, or None."""
    errors = sorted(run.glob(f"{FAILED}*.txt"), key=lambda path: int(path.stem[len(FAILED):]))
    if errors:
        return errors[0].read_text()
    return None if (run / "losses.jsonl").is_file() else "no output"


def _epoch_files(run: Path) -> Dict[int, Path]:
    return {int(path.stem[len("weights_epoch"):]): path for path in run.glob("weights_epoch*.pt")}


def _losses(directory: Path) -> Dict[int, float]:
    lines = (directory / "losses.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


# --- the rank program, run under torchrun --------------------------------------------------------


def _rank_main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--state-dict-type", default=None)  # omitted for stock FSDPStrategy, which lacks it
    parser.add_argument("--ckpt-path", default=None)
    args = parser.parse_args(argv)

    import torch

    import lightning_fsdp_resume  # noqa: F401  (the one line a user adds)

    from .testing import enable_cpu_fsdp, leave_process_group

    try:
        import lightning.pytorch as L
    except ImportError:
        import pytorch_lightning as L
    from torch import nn

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.device_count() >= ranks:
        accelerator = "gpu"
    else:
        enable_cpu_fsdp()
        accelerator = "cpu"

    class Regressor(L.LightningModule):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
            self.out = nn.Linear(hidden, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.out(self.net(x)), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=3e-3)

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_rank == 0:
                with open(args.out / "losses.jsonl", "a") as log:
                    log.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")

        def on_train_epoch_end(self, trainer, module):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(trainer.model, writeback=False):
                params = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
            if trainer.global_rank == 0:
                record = {"step": trainer.global_step, "params": params}
                torch.save(record, args.out / f"weights_epoch{trainer.current_epoch}.pt")
                print(f"{PROGRESS}epoch {trainer.current_epoch} done at step {trainer.global_step}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0, workers=True)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=generator)
    y = torch.sin(x[:, :4]) + 0.1 * torch.randn(256, 4, generator=generator)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    strategy_options = {"state_dict_type": args.state_dict_type} if args.state_dict_type else {}  # none for stock
    strategy = L.strategies.FSDPStrategy(**strategy_options)
    # dirpath a str, as usually written: a Path is pickled into the checkpoint, and since torch 2.6 stock
    # Lightning 2.0.x (torch.load with weights_only=True) fails on it before it gets to FSDP.
    checkpoints = L.callbacks.ModelCheckpoint(dirpath=str(args.out / "ckpt"), filename="{epoch}", save_top_k=-1)
    trainer = L.Trainer(
        accelerator=accelerator, devices=ranks, strategy=strategy, max_epochs=args.epochs,
        callbacks=[checkpoints, Record()],
        logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
    )
    try:
        trainer.fit(Regressor(args.hidden), train_dataloaders=data, ckpt_path=args.ckpt_path)
    except Exception as error:  # recorded for the report (stock Lightning's resume may fail), then raised
        first_line = next(iter(str(error).splitlines()), "")
        (args.out / f"{FAILED}{os.environ.get('RANK', '0')}.txt").write_text(f"{type(error).__name__}: {first_line}")
        raise
    leave_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
