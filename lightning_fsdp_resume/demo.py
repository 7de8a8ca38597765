"""The demo: an uninterrupted FSDP run against one stopped mid-run and resumed in new processes.

``run_demo`` orchestrates three torchrun launches of this module: the reference run, the run that stops
after ``--stop-after`` epochs (checkpointing each epoch), and the run that resumes from its last
checkpoint. Each rank program records, on rank 0, the loss of every step and the gathered weights at
every epoch end; the orchestrator compares them and prints a table and a verdict.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

PROGRESS = "demo: "
FAILED = "failed-rank"  # + the rank + ".txt": a rank program's error, type and first line


def run_demo(args: argparse.Namespace) -> int:
    if not 0 < args.stop_after < args.epochs:
        print(f"--stop-after must lie between 0 and --epochs ({args.epochs}); got {args.stop_after}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fsdp-resume-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    common = ["--hidden", str(args.hidden), "--state-dict-type", args.state_dict_type]
    interrupted = workdir / "interrupted"
    last = interrupted / "ckpt" / f"epoch={args.stop_after - 1}.ckpt"
    phases = [
        ("reference", f"uninterrupted, {args.epochs} epochs", ["--epochs", str(args.epochs)]),
        ("interrupted", f"stops after {args.stop_after} epochs, checkpointing ({args.state_dict_type})",
         ["--epochs", str(args.stop_after)]),
        ("resumed", f"new processes resume from {last.name} to {args.epochs} epochs",
         ["--epochs", str(args.epochs), "--ckpt-path", str(last)]),
    ]
    print(f"Working in {workdir} with {args.ranks} ranks")
    for number, (name, what, extra) in enumerate(phases, 1):
        print(f"[{number}/3] {name} run: {what}", flush=True)
        code = _launch(args.ranks, ["--out", str(workdir / name), *common, *extra])
        if code != 0:
            print(f"The {name} run failed (exit status {code}); its output is above.", file=sys.stderr)
            return code
    return _report(workdir / "reference", workdir / "resumed", args.stop_after)


def _launch(ranks: int, args: List[str]) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "lightning_fsdp_resume.demo", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    other = []
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(PROGRESS):
            print("      " + line[len(PROGRESS):], end="", flush=True)
        else:
            other.append(line)
    code = process.wait()
    if code != 0:
        sys.stderr.write("".join(other[-80:]))
    return code


def _report(reference: Path, resumed: Path, stop_after: int) -> int:
    import torch

    ref_losses = _losses(reference)
    res_losses = _losses(resumed)
    print()
    print(f"{'epoch':>5} {'step':>6} {'reference loss':>16} {'resumed loss':>16} {'largest |Δ param|':>18}")
    exact = bool(res_losses)
    for epoch_file in sorted(resumed.glob("weights_epoch*.pt"), key=lambda p: int(p.stem[len("weights_epoch"):])):
        epoch = int(epoch_file.stem[len("weights_epoch"):])
        mine = torch.load(epoch_file, weights_only=False)
        theirs = torch.load(reference / epoch_file.name, weights_only=False)
        diff = max(float((mine["params"][k] - theirs["params"][k]).abs().max()) for k in theirs["params"])
        step = mine["step"]
        print(f"{epoch:>5} {step:>6} {ref_losses[step]:>16.8f} {res_losses[step]:>16.8f} {diff:>18.3g}")
        exact = exact and diff == 0.0 and set(mine["params"]) == set(theirs["params"])
    exact = exact and all(ref_losses.get(step) == loss for step, loss in res_losses.items())
    first = min(res_losses) if res_losses else None
    print()
    if exact:
        print(f"PASS: resumed from epoch {stop_after}, every loss from step {first} on and every weight equal bit for bit.")
        return 0
    print("FAIL: the resumed run differs from the uninterrupted one.")
    return 1


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
