"""The benchmark's rank program, launched by ``resume_benchmark.py`` under torchrun (FSDP on the CPU).

``--phase save`` trains ``--save-after-steps`` steps (at least one, so Adam has state) and times ``trainer.save_checkpoint``;
``--phase resume`` starts fresh processes, ``trainer.fit(ckpt_path=...)`` and times
``FSDPStrategy.load_checkpoint``, which restores model and optimizers on the shim and on native
Lightning >= 2.1 alike. ``--async-save`` saves with ``AsyncCheckpointIO``: the phase lasts until the checkpoint is
in place, and ``stall`` is how long the save call blocked training. Each rank measures its peak resident memory during
the phase (a save in the background: plus the host buffers made ahead for it) and writes one JSON record into
``--out``. The same program runs on native Lightning: the shim then does nothing.
"""
import argparse
import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

if importlib.util.find_spec("lightning") is not None:  # lightning.pytorch where installed, as the tests do
    import lightning.pytorch as L
else:
    import pytorch_lightning as L

import lightning_fsdp_resume as shim
from lightning_fsdp_resume.testing import enable_cpu_fsdp, leave_process_group
from peak_rss import PeakRss

ADAM_STATES_PER_PARAMETER = 2  # exp_avg and exp_avg_sq, each the parameter's size


class Block(nn.Module):
    """One FSDP unit: a square layer, so the model's size is ``layers × width²``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Model(L.LightningModule):
    def __init__(self, width: int, layers: int, outputs: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(layers)))
        self.head = nn.Linear(width, outputs)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.head(self.blocks(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-3)


def full_state_bytes(model: nn.Module) -> int:
    """Parameters plus Adam's two moments, as a full checkpoint holds them (Adam's step counters left out)."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params * (1 + ADAM_STATES_PER_PARAMETER)


class Measured:
    """Runs a callable under a timer and a :class:`PeakRss`, once, and keeps the figures."""

    def __init__(self) -> None:
        self.seconds = None
        self.memory = None

    def run(self, function, *args, **kwargs):
        with PeakRss() as memory:
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds = time.perf_counter() - start
        self.memory = memory
        return result


class SaveAfterSteps(L.Callback):
    """Saves once after ``steps`` optimizer steps, measured until the checkpoint is in place; ``stall``: how long the
    save call itself blocked training (with AsyncCheckpointIO it returns before the checkpoint is written).
    ``again``: then saves once more, unmeasured but for ``stall_again``, the stall of a later save in a long run."""

    def __init__(self, path: str, measured: Measured, steps: int = 1, again: bool = False) -> None:
        self.path = path
        self.measured = measured
        self.steps = steps
        self.again = again
        self.stall = None
        self.stall_again = None
        self.copy_alone = None
        self.held_ahead = 0
        self.waited_for_buffers = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step < self.steps:
            return
        self.waited_for_buffers, self.held_ahead = host_buffers_ahead(trainer.strategy)
        trainer.strategy.barrier()  # both ranks start the clock together
        self.measured.run(self.save_and_wait, trainer)
        if self.again:
            first = self.stall
            trainer.strategy.barrier()
            self.save_and_wait(trainer)
            self.stall, self.stall_again = first, self.stall
            self.copy_alone = copy_seconds(trainer.strategy.model, trainer.strategy.optimizers)

    def save_and_wait(self, trainer) -> None:
        start = time.perf_counter()
        trainer.save_checkpoint(self.path)
        self.stall = time.perf_counter() - start
        shim.wait_for_saves(trainer)  # nothing to wait for unless the save runs in the background


def copy_seconds(model: nn.Module, optimizers) -> float:
    """How long copying this rank's state into host memory already touched takes, memory to memory, with nothing
    else: each storage a save in the background copies into its kept buffers (the package's own list of what
    training changes: flat shards, buffers, optimizer states), once. The least of 3 copies."""
    from lightning_fsdp_resume._save_load import _background, _saving

    storages = _background.Live(_saving.training_tensors(model, optimizers)).storages.values()
    sources = [torch.empty(0, dtype=torch.uint8).set_(storage) for storage in storages]
    buffers = [torch.empty_like(source).zero_() for source in sources]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for buffer, source in zip(buffers, sources):
            buffer.copy_(source)
        times.append(time.perf_counter() - start)
    return min(times)


def host_buffers_ahead(strategy):
    """How long this rank waited for the thread making the host buffers for its saves in the background (made after
    the first optimizer step; a run's first save after many steps finds them made), and their bytes: memory such a
    save holds that its phase's growth no longer shows. (0, 0) for a synchronous run."""
    from lightning_fsdp_resume._patching._held import StrategyHeld, peek

    kept = peek(strategy, StrategyHeld)
    staging = None if kept is None else kept.staging
    if staging is None:
        return 0.0, 0
    start = time.perf_counter()
    if staging.preparing is not None:
        staging.preparing.join()
    return time.perf_counter() - start, sum(buffer.nbytes for buffer in staging.this_save.values())


def shard_bytes(model: nn.Module, optimizers) -> int:
    """This rank's own part of the state: its parameter shards and its optimizers' states of them."""
    tensors = list(model.parameters())
    tensors += [value for optimizer in optimizers for state in optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor) and value.dim() > 0]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def timed_load(strategy, measured: Measured) -> None:
    """Measure ``strategy.load_checkpoint`` of this instance, where Lightning restores from ``ckpt_path``."""
    original = strategy.load_checkpoint

    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        return measured.run(original, *args, **kwargs)

    strategy.load_checkpoint = load_checkpoint


def data(width: int, outputs: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, width, generator=generator)
    y = torch.randn(8, outputs, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def without_checksums() -> None:
    """The shim as it would be without checksums: saves hash nothing and write no manifest, reads check nothing (the
    benchmark's baseline for their cost; the package itself has no such switch)."""
    from lightning_fsdp_resume._checkpoint import _checksums, _zip_checks
    from lightning_fsdp_resume._storage import _checked

    _checked._summing = lambda storage, location: storage
    _checked.sums = lambda location: None
    whole = _checked._whole

    def index_alone(location, relative):  # a checked save's .metadata, read up to its pickle's end as torch reads it
        data = whole(location, relative)
        listed = _checksums.manifest_of(data, str(location), relative) if relative == ".metadata" else None
        return data[: listed[relative].hashed] if listed else data

    _checked._whole = index_alone
    _checked.seal = lambda location, ranges: None
    _zip_checks.check_torch_file = lambda source, name, share=(0, 1): None
    _zip_checks.check_zip = lambda source, name, share=(0, 1): None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["save", "resume"], required=True)
    parser.add_argument("--state-dict-type", choices=["sharded", "full"], required=True)
    parser.add_argument("--checkpoint", required=True, help="a path or a URL (its store configured by FSSPEC_* variables)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--use-orig-params", type=int, default=1)
    # Fewer outputs than ranks leave the head's sharded state empty on some rank: the smoke test uses 1, as
    # the shim's sharded resume once failed there ("Missing key in checkpoint state_dict: ...param_groups").
    parser.add_argument("--outputs", type=int, default=8)
    parser.add_argument("--async-save", action="store_true", help="save with Trainer(plugins=[AsyncCheckpointIO()])")
    # a run's first save comes after some steps: a save in the background has its host buffers made by then
    parser.add_argument("--save-after-steps", type=int, default=1, help="optimizer steps before the save (default 1)")
    parser.add_argument("--no-checksums", action="store_true",
                        help="the shim with its checksums switched off in this process: what they cost, by difference")
    args = parser.parse_args(argv)
    if args.no_checksums:
        without_checksums()

    enable_cpu_fsdp()
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    L.seed_everything(0)
    model = Model(args.width, args.layers, args.outputs)
    state_bytes = full_state_bytes(model)
    strategy = L.strategies.FSDPStrategy(
        state_dict_type=args.state_dict_type,
        use_orig_params=bool(args.use_orig_params),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
    )
    measured = Measured()
    callbacks = []
    if args.phase == "save":
        callbacks.append(SaveAfterSteps(args.checkpoint, measured, args.save_after_steps, again=args.async_save))
    else:
        timed_load(strategy, measured)
    plugins = [L.plugins.AsyncCheckpointIO()] if args.async_save else []
    trainer = L.Trainer(
        plugins=plugins,
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", "1")),
        strategy=strategy,
        max_steps=args.save_after_steps if args.phase == "save" else 2,  # resume: one step more than the checkpoint holds
        callbacks=callbacks,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=data(args.width, args.outputs), ckpt_path=args.checkpoint if args.phase == "resume" else None)
    if measured.seconds is None:
        raise RuntimeError(f"the {args.phase} phase never ran: nothing was measured")
    record = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "phase": args.phase,
        "state_dict_type": args.state_dict_type,
        "seconds": measured.seconds,
        "stall": callbacks[0].stall if args.phase == "save" else None,
        "stall_again": callbacks[0].stall_again if args.phase == "save" else None,
        "copy_alone": callbacks[0].copy_alone if args.phase == "save" else None,
        "shard_bytes": shard_bytes(trainer.model, trainer.strategy.optimizers),
        "rss_start": measured.memory.start,
        "rss_peak": measured.memory.peak,
        # a save in the background: with the host buffers made ahead for it, what it costs beside a synchronous run
        "growth": measured.memory.growth + (callbacks[0].held_ahead if args.phase == "save" else 0),
        "host_buffers_ahead": callbacks[0].held_ahead if args.phase == "save" else 0,
        "waited_for_buffers": callbacks[0].waited_for_buffers if args.phase == "save" else 0.0,
        "full_state_bytes": state_bytes,
        "lightning": L.__version__,
        "shim": shim.status()[L.__name__].mode,
        "torch": torch.__version__,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.phase}_rank{trainer.global_rank}.json").write_text(json.dumps(record))
    leave_process_group()


if __name__ == "__main__":
    sys.exit(main())
