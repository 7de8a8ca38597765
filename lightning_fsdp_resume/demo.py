"""The demo: an uninterrupted FSDP run against one stopped mid-run and resumed in new processes. ``run_demo`` launches
this module under torchrun for each run and compares them; the rank program trains with the Trainer or, with
``--fabric``, in a Fabric loop. What it runs and prints: docs/behaviour.md#the-demo-in-detail.
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
from ._checkpoint import _unpickling
from ._patching._versions import FABRIC, FLAVOURS, TRAINER, installed_version

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
        loop = ["--fabric"] if args.fabric else []
        code = _launch(args.ranks, workdir / name, ["--hidden", str(args.hidden), *loop, *shim_only, *extra], patched)
        if code != 0 and patched:
            print(f"The {name} run failed (exit status {code}); its output is above.", file=sys.stderr)
            return code
    stock = workdir / "stock-resumed" if args.compare_stock else None
    return _report(workdir / "reference", workdir / "resumed", args.stop_after, stock, FABRIC if args.fabric else TRAINER)


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


def _report(reference: Path, resumed: Path, stop_after: int, stock: Optional[Path] = None, kind: str = TRAINER) -> int:
    """Print the shim's resumed run against the reference, stock Lightning's (``kind``: the Trainer's or Fabric's)
    in a column before it if given, and a verdict for each; 0 when the shim's run is exact."""
    ref_losses = _losses(reference)
    ref_steps = {epoch: _unpickling.torch_load(str(path), trusted=True)["step"] for epoch, path in _epoch_files(reference).items()}
    epochs = sorted(epoch for epoch in ref_steps if epoch >= stop_after)
    columns = {_stock_label(kind): stock, SHIM: resumed} if stock is not None else {"": resumed}
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
    failure = _failure(resumed)
    losses = _losses(resumed) if (resumed / "losses.jsonl").is_file() else {}
    exact = failure is None and bool(losses) and all(ref_losses.get(step) == loss for step, loss in losses.items())
    rows = {}
    for epoch, path in _epoch_files(resumed).items():
        mine, theirs = (_unpickling.torch_load(str(p), trusted=True) for p in (path, reference / path.name))  # its own records
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


def _stock_label(kind: str = TRAINER) -> str:
    return f"stock {'Fabric' if kind == FABRIC else 'Lightning'} {_lightning_version(kind) or '(not installed)'}"


def _lightning_version(kind: str = TRAINER) -> Optional[str]:
    """The release the rank program imports for ``kind``: ``lightning``'s, else the standalone package's (Trainer:
    ``pytorch_lightning``, Fabric: ``lightning_fabric``); None: neither."""
    return next(filter(None, (installed_version(flavour) for flavour in FLAVOURS if flavour.kind == kind)), None)


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
    parser.add_argument("--fabric", action="store_true", help="train with Fabric, not the Trainer")
    args = parser.parse_args(argv)

    import torch

    import lightning_fsdp_resume  # noqa: F401  (the one line a user adds)

    from .testing import enable_cpu_fsdp, leave_process_group

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.device_count() >= ranks:
        accelerator = "gpu"
    else:
        enable_cpu_fsdp()
        accelerator = "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        (_fit_with_fabric if args.fabric else _fit_with_trainer)(args, accelerator, ranks)
    except Exception as error:  # recorded for the report (stock Lightning's resume may fail), then raised
        first_line = next(iter(str(error).splitlines()), "")
        (args.out / f"{FAILED}{os.environ.get('RANK', '0')}.txt").write_text(f"{type(error).__name__}: {first_line}")
        raise
    leave_process_group()


def _fit_with_trainer(args: argparse.Namespace, accelerator: str, ranks: int) -> None:
    """``trainer.fit``, checkpointing every epoch with ``ModelCheckpoint``; resumes with ``ckpt_path``."""
    try:
        import lightning.pytorch as L
    except ImportError:
        import pytorch_lightning as L

    class Regressor(_model_class(L.LightningModule)):  # type: ignore[misc]
        def training_step(self, batch, batch_idx):
            return _loss(self, batch)

        def configure_optimizers(self):
            return _optimizer(self.trainer.model.parameters())

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            _record_loss(args.out, trainer.global_rank, trainer.global_step, outputs["loss"])

        def on_train_epoch_end(self, trainer, module):
            _record_weights(args.out, trainer.global_rank, trainer.model, module, trainer.current_epoch, trainer.global_step)

    L.seed_everything(0, workers=True)
    # dirpath a str, as usually written: a Path is pickled into the checkpoint, and since torch 2.6 stock
    # Lightning 2.0.x (torch.load with weights_only=True) fails on it before it gets to FSDP.
    checkpoints = L.callbacks.ModelCheckpoint(dirpath=str(args.out / "ckpt"), filename="{epoch}", save_top_k=-1)
    trainer = L.Trainer(
        accelerator=accelerator, devices=ranks, strategy=L.strategies.FSDPStrategy(**_strategy_options(args)),
        max_epochs=args.epochs, callbacks=[checkpoints, Record()],
        logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
    )
    trainer.fit(Regressor(args.hidden), train_dataloaders=_data(), ckpt_path=args.ckpt_path)


def _fit_with_fabric(args: argparse.Namespace, accelerator: str, ranks: int) -> None:
    """A plain loop: ``fabric.save`` of the model, optimizer, LR scheduler, epoch and step after every epoch, named
    as ``ModelCheckpoint`` names the Trainer's; resumes with ``fabric.load`` of the same state."""
    import torch

    try:
        import lightning.fabric as F
    except ImportError:
        import lightning_fabric as F

    F.seed_everything(0, workers=True)
    # As the Trainer's deterministic=True; cuBLAS needs the workspace setting for it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    fabric = F.Fabric(accelerator=accelerator, devices=ranks, strategy=F.strategies.FSDPStrategy(**_strategy_options(args)))
    fabric.launch()  # under torchrun it starts nothing; Fabric 2.1+ refuses to set up a model without it
    module = _model_class(torch.nn.Module)(args.hidden)
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(_optimizer(model.parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    data = fabric.setup_dataloaders(_data())
    # Stock Fabric 2.0.x (run without --state-dict-type, which it lacks) converts only modules and optimizers to
    # state dicts: it would pickle the scheduler, with the Fabric optimizer it holds, and fail. Its users save the
    # scheduler's state dict; Fabric 2.1 (and the shim) saves and loads the scheduler object.
    stock = args.state_dict_type is None

    def scheduler_entry():
        return scheduler.state_dict() if stock else scheduler

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler_entry(), "epoch": 0, "step": 0}
    if args.ckpt_path:
        fabric.load(args.ckpt_path, state)
        if state["scheduler"] is not scheduler:  # stock; native Fabric 2.1 to 2.6's sharded load puts a state dict there
            scheduler.load_state_dict(state["scheduler"])
            state["scheduler"] = scheduler_entry()
    (args.out / "ckpt").mkdir(exist_ok=True)  # a full save does not make it, natively or with the shim
    for epoch in range(state["epoch"], args.epochs):
        for batch in data:
            optimizer.zero_grad()
            loss = _loss(model, batch)
            fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            _record_loss(args.out, fabric.global_rank, state["step"], loss)
        scheduler.step()
        state.update(epoch=epoch + 1, scheduler=scheduler_entry())
        fabric.save(args.out / "ckpt" / f"epoch={epoch}.ckpt", state)
        _record_weights(args.out, fabric.global_rank, model, module, epoch, state["step"])


# --- what the Trainer's and Fabric's runs share: model, data, optimizer, the records ---------------------


def _strategy_options(args: argparse.Namespace) -> Dict[str, str]:
    return {"state_dict_type": args.state_dict_type} if args.state_dict_type else {}  # none for stock


def _model_class(base: type) -> type:
    """The demo's regressor on ``base``: ``nn.Module`` for Fabric, ``LightningModule`` for the Trainer."""
    from torch import nn

    class Regressor(base):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
            self.out = nn.Linear(hidden, 4)

        def forward(self, x):
            return self.out(self.net(x))

    return Regressor


def _loss(model, batch):
    from torch import nn

    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _optimizer(parameters):
    import torch

    return torch.optim.AdamW(parameters, lr=3e-3)


def _data():
    import torch

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(256, 16, generator=generator)
    y = torch.sin(x[:, :4]) + 0.1 * torch.randn(256, 4, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _record_loss(out: Path, rank: int, step: int, loss) -> None:
    """Rank 0: the loss of ``step`` (its own batch's), one JSON line."""
    if rank == 0:
        with open(out / "losses.jsonl", "a") as log:
            log.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")


def _record_weights(out: Path, rank: int, wrapped, module, epoch: int, step: int) -> None:
    """Every rank gathers the full weights of ``module`` (inside ``wrapped``, which holds the FSDP root); rank 0
    saves them for the comparison and says the epoch is done."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    root = next(m for m in wrapped.modules() if isinstance(m, FSDP))
    with FSDP.summon_full_params(root, writeback=False):
        params = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
    if rank == 0:
        torch.save({"step": step, "params": params}, out / f"weights_epoch{epoch}.pt")
        print(f"{PROGRESS}epoch {epoch} done at step {step}", flush=True)


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
