"""One Trainer run with ``ShardedEMA``, launched by tests/test_ema.py on forked ranks (FSDP on CPU over gloo).

It fits the Trainer worker's ``Net`` with a validation after every epoch and a sharded checkpoint at each epoch's
end, or validates a checkpoint. Rank 0 writes, gathered by torch's ``summon_full_params`` (never by the package):
``seen_e{epoch}.pt``, the weights validation computes with; ``training_e{epoch}.pt``, the training weights before
and after it (``before``/``after``); ``reference_e{epoch}.pt``, an average of the gathered weights kept beside the run
by the rule of torch's ``AveragedModel`` (``--reference``); ``final.pt``, the training weights at the end. Every
rank writes ``buffers_e{epoch}_rank{rank}.pt``: its own buffers as validation sees them (``seen``), its training
buffers before and after it, and the reference average of them (``--net buffered``: BatchNorm's statistics, which
differ by rank).
"""
import argparse
import os
import sys
from pathlib import Path

import torch

import lightning_fsdp_resume
from lightning_fsdp_resume.testing import enable_cpu_fsdp, leave_process_group

if __name__ == "__main__":  # run as a script: `support` is in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import states  # noqa: E402
from support.faults import trace_saves  # noqa: E402
from support.flavours import TRAINER_UNDER_TEST  # noqa: E402
from support.trainer_worker import BufferedNet, FSDPStrategy, L, ModelCheckpoint, Net, data  # noqa: E402

Callback = L.Callback


def gathered(trainer) -> dict:
    return states.full_weights(trainer.model, trainer.lightning_module)


def own_buffers(pl_module) -> dict:
    """This rank's buffers, by the names the module's author gave them."""
    return {states.clean(name): value.detach().clone() for name, value in pl_module.named_buffers()}


def rank() -> str:
    return os.environ.get("RANK", "0")


class Reference(Callback):
    """After every optimizer step, the average of the gathered weights as torch's ``AveragedModel`` with
    ``get_ema_multi_avg_fn(decay)`` keeps it: the first step copies, each later one ``lerp``s by ``1 - decay``; and
    each rank's of its own buffers (``use_buffers``: the floating ones averaged, the others copied; else all copied)."""

    def __init__(self, out: Path, decay: float, use_buffers: bool) -> None:
        self.out, self.decay, self.use_buffers = out, decay, use_buffers
        self.average, self.buffers = None, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        weights = gathered(trainer)
        buffers = own_buffers(pl_module)
        averaged = sorted(n for n, b in buffers.items() if self.use_buffers and b.is_floating_point())
        if self.average is None:
            self.average = {name: value.clone() for name, value in weights.items()}
            self.buffers = buffers
        else:
            names = sorted(weights)
            torch._foreach_lerp_([self.average[n] for n in names], [weights[n] for n in names], 1 - self.decay)
            for name in averaged:
                self.buffers[name].lerp_(buffers[name], 1 - self.decay)
            self.buffers.update((name, value) for name, value in buffers.items() if name not in averaged)

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_rank == 0 and self.average is not None:
            torch.save(self.average, self.out / f"reference_e{trainer.current_epoch}.pt")
        self.seen_buffers = {name: value.clone() for name, value in self.buffers.items()}


class Before(Callback):
    """Before ShardedEMA in the callbacks: sees the training weights as validation starts."""

    def on_validation_start(self, trainer, pl_module):
        self.weights = gathered(trainer)
        self.buffers = own_buffers(pl_module)


class After(Callback):
    """After ShardedEMA: sees what validation computes with, and the weights once it has ended."""

    def __init__(self, out: Path, before: Before, reference) -> None:
        self.out, self.before, self.reference = out, before, reference

    def on_validation_start(self, trainer, pl_module):
        self.seen = gathered(trainer)
        self.seen_buffers = own_buffers(pl_module)

    def on_validation_end(self, trainer, pl_module):
        after = gathered(trainer)
        epoch = trainer.current_epoch
        if trainer.global_rank == 0:
            torch.save(self.seen, self.out / f"seen_e{epoch}.pt")
            torch.save({"before": self.before.weights, "after": after}, self.out / f"training_e{epoch}.pt")
        buffers = {"seen": self.seen_buffers, "before": self.before.buffers, "after": own_buffers(pl_module)}
        if self.reference is not None:
            buffers["reference"] = self.reference.seen_buffers
        torch.save(buffers, self.out / f"buffers_e{epoch}_rank{rank()}.pt")

    def on_train_end(self, trainer, pl_module):
        final = gathered(trainer)  # a collective: every rank
        if trainer.global_rank == 0:
            torch.save(final, self.out / "final.pt")


class MixedNet(Net):
    """Net whose outputs, bfloat16 under mixed precision, go to the loss as float32 (torch < 2.5's CPU
    ``mse_loss`` has no bfloat16 kernel)."""

    def forward(self, x):
        return super().forward(x).float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--use-orig-params", type=int, default=0)
    parser.add_argument("--wrap", choices=["root", "policy"], default="policy")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume", default=None, help="a checkpoint in --ckpt-dir to fit on from")
    parser.add_argument("--validate", default=None, help="a checkpoint in --ckpt-dir to validate, instead of fitting")
    parser.add_argument("--ema", type=int, default=1, help="0: no ShardedEMA (a run to compare with)")
    parser.add_argument("--net", choices=["plain", "buffered"], default="plain", help="buffered: BatchNorm in the body")
    parser.add_argument("--use-buffers", type=int, default=1)
    parser.add_argument("--every-n-steps", type=int, default=None,
                        help="also a sharded checkpoint every this many steps, inside epochs (step={step}.ckpt)")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="FSDP computes and reduces in bfloat16 (MixedPrecision), from float32 shards")
    parser.add_argument("--reference", type=int, default=1)
    parser.add_argument("--decay", type=float, default=0.75)
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--async-save", type=float, default=None,
                        help="saves in the background (AsyncCheckpointIO), each write started this many seconds late")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    enable_cpu_fsdp()
    torch.manual_seed(0)
    from torch import nn
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    wrapping = {"auto_wrap_policy": ModuleWrapPolicy({nn.Sequential})} if args.wrap == "policy" else {}
    if args.mixed_precision:
        from torch.distributed.fsdp import MixedPrecision

        wrapping["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                                     buffer_dtype=torch.bfloat16)
    strategy = FSDPStrategy(state_dict_type=args.state_dict_type, use_orig_params=bool(args.use_orig_params), **wrapping)
    before = Before()
    callbacks = [ModelCheckpoint(dirpath=str(args.ckpt_dir), filename="{epoch}", save_top_k=-1), before]
    if args.every_n_steps:
        callbacks.append(ModelCheckpoint(dirpath=str(args.ckpt_dir), filename="{step}", save_top_k=-1,
                                         every_n_train_steps=args.every_n_steps))
    if args.ema:
        callbacks.append(lightning_fsdp_resume.ShardedEMA(decay=args.decay, use_buffers=bool(args.use_buffers)))
    reference = Reference(args.out, args.decay, bool(args.use_buffers)) if args.reference else None
    if reference is not None:
        callbacks.append(reference)
    callbacks.append(After(args.out, before, reference))
    plugins = [TRAINER_UNDER_TEST.module("plugins.io").AsyncCheckpointIO()] if args.async_save is not None else []
    trainer = L.Trainer(plugins=plugins, accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        strategy=strategy, max_epochs=args.epochs, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
    if args.async_save is not None:  # training goes on, and the average is updated, while each save writes
        trace_saves(trainer.strategy, args.out / f"saves_rank{rank()}.txt", args.async_save)
    model = BufferedNet() if args.net == "buffered" else MixedNet() if args.mixed_precision else Net()
    if args.validate:
        trainer.validate(model, dataloaders=data(), ckpt_path=str(args.ckpt_dir / args.validate))
    else:
        ckpt = str(args.ckpt_dir / args.resume) if args.resume else None
        trainer.fit(model, train_dataloaders=data(), val_dataloaders=data(), ckpt_path=ckpt)
    leave_process_group()


if __name__ == "__main__":
    main()
