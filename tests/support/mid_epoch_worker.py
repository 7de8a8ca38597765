"""One Trainer run that checkpoints inside epochs (``ModelCheckpoint(every_n_train_steps=K)``), or resumes from such a
checkpoint, launched as the Trainer's rank program is (``trainer_worker``).

Every rank writes, into --out, what the tests compare with the uninterrupted run: each training step's global step,
epoch, batch index and the indices of the samples it trained on (``trained_rank{r}.json``), each validation's step
(``validated_rank{r}.json``), and its shards and optimizer state at the end (``final``). It checks nothing itself.
"""
import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch
from torch import nn

import lightning_fsdp_resume
from lightning_fsdp_resume.testing import enable_cpu_fsdp, leave_process_group

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import models, states  # noqa: E402
from support.flavours import TRAINER_UNDER_TEST  # noqa: E402

L = TRAINER_UNDER_TEST.module()
ModelCheckpoint = TRAINER_UNDER_TEST.module("callbacks").ModelCheckpoint
FSDPStrategy = TRAINER_UNDER_TEST.module("strategies").FSDPStrategy
SAMPLES = 48  # 6 batches of 4 per rank and epoch on 2 ranks, 12 on one (--samples: another size)


class Samples(torch.utils.data.Dataset):
    """Sample i is (x_i, y_i, i); ``augment``: x plus noise drawn from the process's random number generator (the
    main process's, or a worker's)."""

    def __init__(self, augment: bool = False, size: int = SAMPLES) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 8, generator=generator)
        self.y = torch.randn(size, 2, generator=generator)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + 0.1 * torch.randn(8) if self.augment else self.x[i]
        return x, self.y[i], i


class Stream(torch.utils.data.IterableDataset):
    """The same samples as a stream: each rank its share, in an order drawn from the global generator as it starts."""

    def __init__(self, augment: bool = False) -> None:
        self.samples = Samples(augment)

    def __iter__(self):
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) \
            if torch.distributed.is_initialized() else (0, 1)
        for i in torch.randperm(SAMPLES)[rank::world].tolist():
            yield self.samples[i]


def loader(kind: str, workers: int, augment: bool, persistent: bool = False, size: int = SAMPLES,
           sampler_drop_last: bool = False, loader_drop_last: bool = False, shuffle: bool = True):
    if kind == "pair":  # two loaders, which Lightning combines (max_size_cycle): the shorter one starts again
        small = torch.utils.data.Subset(Samples(augment), range(20))
        return {"a": loader("shuffle", workers, augment), "b": torch.utils.data.DataLoader(small, batch_size=4, shuffle=True)}
    kwargs = {"batch_size": 4, "num_workers": workers, "persistent_workers": persistent, "drop_last": loader_drop_last}
    if kind == "iterable":
        return torch.utils.data.DataLoader(Stream(augment), **kwargs)
    dataset = Samples(augment, size)
    if kind == "sequential":
        return torch.utils.data.DataLoader(dataset, **kwargs)
    if kind == "shuffle":
        return torch.utils.data.DataLoader(dataset, shuffle=True, **kwargs)
    if kind == "generator":  # a RandomSampler with its own generator (kept where Lightning injects no sampler)
        sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(7))
        return torch.utils.data.DataLoader(dataset, sampler=sampler, **kwargs)
    if kind == "user-distributed":  # the user's own DistributedSampler, which Lightning keeps (and sets the epoch of)
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=int(os.environ["WORLD_SIZE"]),
                                                      rank=int(os.environ["RANK"]), shuffle=shuffle, seed=3,
                                                      drop_last=sampler_drop_last)
        return torch.utils.data.DataLoader(dataset, sampler=sampler, **kwargs)
    if kind == "stateful":  # a loader that says where it is: torchdata's
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(dataset, shuffle=True, **kwargs)
    if kind == "batch-sampler":  # the user's own batch sampler, drop_last
        sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(7))
        batches = torch.utils.data.BatchSampler(sampler, batch_size=5, drop_last=True)
        return torch.utils.data.DataLoader(dataset, batch_sampler=batches, num_workers=workers)
    raise ValueError(kind)


class Interrupted(Exception):
    """A failure inside a validation (as a preemption's signal would stop it)."""


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = models.body("dropout")
        self.head = nn.Linear(16, 2)
        self.trained, self.validated = [], []
        self.fail_at = None  # [epoch, global step, validation batch] where validation_step raises, once

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

    def training_step(self, batch, batch_idx):
        parts = list(batch.values()) if isinstance(batch, dict) else [batch]
        indices = [index.tolist() for _, _, index in parts]
        self.trained.append([self.global_step, self.current_epoch, batch_idx, indices if len(parts) > 1 else indices[0]])
        return sum(nn.functional.mse_loss(self(x), y) for x, y, _ in parts)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        if self.fail_at == [self.current_epoch, self.global_step, batch_idx]:
            raise Interrupted(f"validation batch {batch_idx} at step {self.global_step}")
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def on_validation_epoch_end(self):
        if self.trainer.state.fn == "fit":
            self.validated.append([self.global_step, self.current_epoch])

    def on_validation_end(self):
        if self.trainer.state.fn == "fit":  # the epoch's mean, as the callbacks read it
            self.validated[-1].append(self.trainer.callback_metrics["val_loss"].item())

    def configure_optimizers(self):
        return torch.optim.Adam(self.trainer.model.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--strategy", choices=["fsdp", "ddp", "single"], default="fsdp")
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--wrap", choices=["policy", "root"], default="policy")
    parser.add_argument("--use-orig-params", type=int, default=0)
    parser.add_argument("--data", default="shuffle", help="sequential, shuffle, user-distributed, generator, batch-sampler, iterable, stateful, pair")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--persistent-workers", action="store_true", help="DataLoader(persistent_workers=True)")
    parser.add_argument("--augment", action="store_true", help="each sample drawn with noise from the RNG")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--every", type=int, default=4, help="ModelCheckpoint(every_n_train_steps=...)")
    parser.add_argument("--at-validation-end", action="store_true", help="save at the end of each validation instead")
    parser.add_argument("--val-every", type=int, default=0, help="val_check_interval in batches (0: no validation)")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--mode", default=None, help="lightning_fsdp_resume.set_mid_epoch_resume(MODE)")
    parser.add_argument("--save-at-batch", type=int, default=None, help="also save mid-epoch.ckpt after this batch of epoch 0")
    parser.add_argument("--rank-zero-saves", action="store_true", help="mid-epoch.ckpt is saved by rank 0 alone")
    parser.add_argument("--samples", type=int, default=SAMPLES, help="the dataset's size")
    parser.add_argument("--sampler-drop-last", action="store_true", help="DistributedSampler(drop_last=True)")
    parser.add_argument("--loader-drop-last", action="store_true", help="DataLoader(drop_last=True)")
    parser.add_argument("--no-shuffle", action="store_true", help="user-distributed without shuffling (Lightning shuffles training data)")
    parser.add_argument("--fail-in-validation", type=int, nargs=3, metavar=("EPOCH", "STEP", "BATCH"), default=None,
                        help="raise in that validation batch (unless resuming), OnExceptionCheckpoint saving on-exception.ckpt")
    parser.add_argument("--other-rank-counts", default=None, help="set_mid_epoch_resume(other_rank_counts=...)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    if args.mode or args.other_rank_counts:
        lightning_fsdp_resume.set_mid_epoch_resume(args.mode or "skip", other_rank_counts=args.other_rank_counts or "exact")
    logging.basicConfig()
    logging.getLogger("lightning_fsdp_resume").setLevel(logging.INFO)  # the resume's line, for the tests to read

    L.seed_everything(0)
    if args.strategy == "fsdp":
        enable_cpu_fsdp()
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapping = {"auto_wrap_policy": ModuleWrapPolicy({nn.Sequential})} if args.wrap == "policy" else {}
        strategy = FSDPStrategy(state_dict_type=args.state_dict_type, use_orig_params=bool(args.use_orig_params), **wrapping)
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    elif args.strategy == "ddp":
        strategy, devices = "ddp", int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    else:
        strategy, devices = "auto", 1
    if args.at_validation_end:  # ModelCheckpoint(monitor=...): a save at the end of every validation
        saving = {"monitor": "val_loss"}
    else:
        saving = {"every_n_train_steps": args.every}
    callbacks = [ModelCheckpoint(dirpath=str(args.ckpt_dir), filename="{step}", save_top_k=-1, **saving)]
    if args.save_at_batch is not None:
        callbacks.append(SaveAt(args.ckpt_dir / "mid-epoch.ckpt", args.save_at_batch, args.rank_zero_saves))
    if args.fail_in_validation:
        callbacks.append(TRAINER_UNDER_TEST.module("callbacks").OnExceptionCheckpoint(str(args.ckpt_dir), "on-exception"))
    validation = {"val_check_interval": args.val_every, "limit_val_batches": 2} if args.val_every else {"limit_val_batches": 0}
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=args.max_epochs,
                        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, deterministic=True, accumulate_grad_batches=args.accumulate, **validation)
    model = Net()
    model.fail_at = None if args.ckpt_path else args.fail_in_validation
    data = loader(args.data, args.workers, args.augment, args.persistent_workers, args.samples, args.sampler_drop_last,
                  args.loader_drop_last, shuffle=not args.no_shuffle)
    val = {"val_dataloaders": loader("sequential", 0, False)} if args.val_every else {}
    try:
        trainer.fit(model, train_dataloaders=data, ckpt_path=args.ckpt_path, **val)
    except Exception:
        import traceback

        (args.out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:  # after a failure too: the steps and validations so far, which a resumed run goes on from
        (args.out / f"trained_rank{rank}.json").write_text(json.dumps(model.trained))
        (args.out / f"validated_rank{rank}.json").write_text(json.dumps(model.validated))
    optimizers = trainer.strategy.optimizers
    states.write(args.out, "final", rank, states.local_state(trainer.model, optimizers),
                 {"global_step": trainer.global_step, "epoch": trainer.current_epoch})
    leave_process_group()


class SaveAt(L.Callback):
    """Saves ``path`` after batch ``batch`` of epoch 0 (a save ``ModelCheckpoint``'s step counting would not make), on
    every rank or, as DDP allows, on rank 0 alone."""

    def __init__(self, path: Path, batch: int, rank_zero: bool) -> None:
        self.path, self.batch, self.rank_zero = path, batch, rank_zero

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx + 1 == self.batch and (trainer.is_global_zero or not self.rank_zero):
            trainer.save_checkpoint(self.path)


if __name__ == "__main__":
    sys.exit(main())
