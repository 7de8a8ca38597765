"""One Trainer run with ``ShardedEMA``, launched by tests/test_ema.py on forked ranks (FSDP on CPU over gloo).

It fits the Trainer worker's ``Net`` with a validation after every epoch and a sharded checkpoint at each epoch's
end, or validates a checkpoint. Rank 0 writes, gathered by torch's ``summon_full_params`` (never by the package):
``seen_e{epoch}.pt``, the weights validation computes with; ``training_e{epoch}.pt``, the training weights before
and after it (``before``/``after``); ``reference_e{epoch}.pt``, an average of the gathered weights kept beside the run
by the rule of torch's ``AveragedModel`` (``--reference``); ``final.pt``, the training weights at the end.
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
from support.trainer_worker import FSDPStrategy, L, ModelCheckpoint, Net, data  # noqa: E402

Callback = L.Callback


def gathered(trainer) -> dict:
    return states.full_weights(trainer.model, trainer.lightning_module)


class Reference(Callback):
    """After every optimizer step, the average of the gathered weights as torch's ``AveragedModel`` with
    ``get_ema_multi_avg_fn(decay)`` keeps it: the first step copies, each later one ``lerp``s by ``1 - decay``."""

    def __init__(self, out: Path, decay: float) -> None:
        self.out, self.decay, self.average = out, decay, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        weights = gathered(trainer)
        if self.average is None:
            self.average = {name: value.clone() for name, value in weights.items()}
        else:
            names = sorted(weights)
            torch._foreach_lerp_([self.average[n] for n in names], [weights[n] for n in names], 1 - self.decay)

    def on_validation_start(self, trainer, pl_module):
        if trainer.global_rank == 0 and self.average is not None:
            torch.save(self.average, self.out / f"reference_e{trainer.current_epoch}.pt")


class Before(Callback):
    """Before ShardedEMA in the callbacks: sees the training weights as validation starts."""

    def on_validation_start(self, trainer, pl_module):
        self.weights = gathered(trainer)


class After(Callback):
    """After ShardedEMA: sees what validation computes with, and the weights once it has ended."""

    def __init__(self, out: Path, before: Before) -> None:
        self.out, self.before = out, before

    def on_validation_start(self, trainer, pl_module):
        self.seen = gathered(trainer)

    def on_validation_end(self, trainer, pl_module):
        after = gathered(trainer)
        if trainer.global_rank == 0:
            epoch = trainer.current_epoch
            torch.save(self.seen, self.out / f"seen_e{epoch}.pt")
            torch.save({"before": self.before.weights, "after": after}, self.out / f"training_e{epoch}.pt")

    def on_train_end(self, trainer, pl_module):
        final = gathered(trainer)  # a collective: every rank
        if trainer.global_rank == 0:
            torch.save(final, self.out / "final.pt")


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
    strategy = FSDPStrategy(state_dict_type=args.state_dict_type, use_orig_params=bool(args.use_orig_params), **wrapping)
    before = Before()
    callbacks = [ModelCheckpoint(dirpath=str(args.ckpt_dir), filename="{epoch}", save_top_k=-1), before]
    if args.ema:
        callbacks.append(lightning_fsdp_resume.ShardedEMA(decay=args.decay))
    if args.reference:
        callbacks.append(Reference(args.out, args.decay))
    callbacks.append(After(args.out, before))
    plugins = [TRAINER_UNDER_TEST.module("plugins.io").AsyncCheckpointIO()] if args.async_save is not None else []
    trainer = L.Trainer(plugins=plugins, accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        strategy=strategy, max_epochs=args.epochs, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, deterministic=True)
    if args.async_save is not None:  # training goes on, and the average is updated, while each save writes
        trace_saves(trainer.strategy, args.out / f"saves_rank{os.environ.get('RANK', '0')}.txt", args.async_save)
    model = Net()
    if args.validate:
        trainer.validate(model, dataloaders=data(), ckpt_path=str(args.ckpt_dir / args.validate))
    else:
        ckpt = str(args.ckpt_dir / args.resume) if args.resume else None
        trainer.fit(model, train_dataloaders=data(), val_dataloaders=data(), ckpt_path=ckpt)
    leave_process_group()


if __name__ == "__main__":
    main()
