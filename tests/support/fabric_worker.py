"""One Fabric run, launched by the tests under torchrun (FSDP on CPU over gloo) or forked by the rank server.

It trains a plain ``nn.Module`` with nested FSDP units through Fabric within what Fabric 2.0.x supports
(FSDP's flat parameters, ``use_orig_params=False``, and one parameter group): ``setup_module``,
``setup_optimizers`` (Adam), a ``StepLR`` on the optimizer Fabric returns, and fixed per-rank batches.
After each epoch it saves ``{"model", "optimizer", "scheduler", "epoch", "step", "loss", "world_size"}``
with ``fabric.save``; ``--resume PATH`` loads one into the same objects with ``fabric.load``, asking for
all but ``loss`` and ``world_size``, and goes on from the epoch after it. Into ``--out`` it writes what
the tests compare (states.py): every rank's local shards, raw optimizer state and scheduler state at the
start (after loading, if it loads), after each epoch and at the end; rank 0 also the full weights and
optimizer state gathered by torch; and what ``fabric.load`` gave back. ``--errors PATH`` instead makes
each call that native Fabric refuses and records what every rank raised. It checks nothing itself.

``StepLR(step_size=1)`` multiplies the optimizer's current learning rate, which the optimizer state
restores: the weights do not depend on whether the scheduler itself was restored, which the tests check
separately.
"""
import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

import lightning_fsdp_resume  # (the one-line activation under test; RankStates)
from lightning_fsdp_resume.testing import enable_cpu_fsdp, leave_process_group

if __name__ == "__main__":  # run as a script (torchrun, `python tests/support/fabric_worker.py`): `support` is in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import models, states  # noqa: E402
from support.damage import carries_checksums, flipped, largest_item, middle_of_largest_record  # noqa: E402
from support.faults import cut_network, kill_during_saves, trace_saves  # noqa: E402
from support.flavours import FABRIC_UNDER_TEST  # noqa: E402
from support.poison import FULL_SITE, Hidden, poisoned  # noqa: E402
from support.s3 import configure, directory  # noqa: E402

Fabric = FABRIC_UNDER_TEST.module().Fabric  # lightning.fabric where lightning is installed, else lightning_fabric
FSDPStrategy = FABRIC_UNDER_TEST.module("strategies").FSDPStrategy

BATCH = 4  # per rank
LR = 1e-2
GAMMA = 0.5
MISSING_KEY = "missing"  # asked for by --request-missing, in no checkpoint
MISSING_DEFAULT = "kept"


class Net(nn.Module):
    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.body = models.body(variant)
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


class GrownNet(Net):
    """``Net`` grown by a layer since a checkpoint was saved (``--grown``): it has weights no checkpoint holds."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(2, 2)  # in the root FSDP unit, beside head
        self.register_buffer("scale", torch.full((2,), 3.0))  # not a parameter: FSDP does not shard it


# --net: the body's variant (support/models.py): dropout's masks come from each rank's random number generator,
# batch normalisation's running statistics from each rank's own batches
NETS = {"net": "plain", "dropout": "dropout", "buffered": "batchnorm"}


def batches(rank: int, world_size: int):
    """The same 64 samples every epoch; each global batch of BATCH per rank is split among the ranks."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=generator)
    y = torch.randn(64, 2, generator=generator)
    size = BATCH * world_size
    for start in range(0, len(x) - size + 1, size):
        rows = slice(start + rank * BATCH, start + (rank + 1) * BATCH)
        yield x[rows], y[rows]


def fsdp_root(model: nn.Module) -> nn.Module:
    """The outermost FSDP module inside Fabric's wrapper: what holds this rank's flat shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return next(m for m in model.modules() if isinstance(m, FSDP))


class Run:
    """One rank's Fabric, model, optimizer and scheduler, and what it writes for the tests."""

    def __init__(self, args) -> None:
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        self.args = args
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        # use_orig_params=False: 2.0.x's default and only kind; 2.1+ defaults to True
        background = {"async_save": True} if args.async_save else {}
        # --wrap root: FSDPStrategy's default, no policy, so FSDP wraps the root module alone
        wrapping = {"auto_wrap_policy": ModuleWrapPolicy({nn.Sequential})} if args.wrap == "policy" else {}
        strategy = FSDPStrategy(state_dict_type=args.state_dict_type, use_orig_params=False, **wrapping, **background)
        self.fabric = Fabric(accelerator="cpu", devices=devices, num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // devices,
                             strategy=strategy)
        # Needed under torchrun too: it joins the process group, and Fabric 2.1+ refuses setup_module without it.
        self.fabric.launch()
        torch.manual_seed(0)  # every rank builds the same model, which FSDP then shards
        self.model = self.fabric.setup_module(GrownNet() if args.grown else Net(NETS[args.net]))
        self.optimizer = self.fabric.setup_optimizers(torch.optim.Adam(self.model.parameters(), lr=LR))
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=GAMMA)
        self.epoch, self.step, self.loss = -1, 0, None
        # --more-entries: a module without FSDP units (an EMA copy, say) and plain values of other kinds, the
        # same on every rank; each epoch changes them
        torch.manual_seed(1)
        self.ema = nn.Linear(3, 2)
        self.history, self.notes, self.pair, self.offset = [], {}, (), torch.zeros(2)

    def more_entries(self) -> dict:
        return {"ema": self.ema, "history": self.history, "notes": self.notes, "pair": self.pair, "offset": self.offset}

    def more_entries_record(self) -> dict:
        """The extra entries as the tests compare them, with the type of each plain value."""
        plain = {key: value for key, value in self.more_entries().items() if key != "ema"}
        return {
            "ema": {name: value.tolist() for name, value in self.ema.state_dict().items()},
            **{key: [type(value).__name__, value.tolist() if torch.is_tensor(value) else value] for key, value in plain.items()},
        }

    def state(self) -> dict:
        """What each save writes; a load never asks for ``loss`` and ``world_size``, which fabric.load returns."""
        state = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "epoch": self.epoch,
                 "step": self.step, "loss": self.loss, "world_size": self.fabric.world_size, **self.rank_states()}
        return {**state, **self.more_entries()} if self.args.more_entries else state

    def rank_states(self) -> dict:
        """``--rank-states``: each rank's RNG states and buffers, the way a Fabric user asks for them."""
        return {"ranks": lightning_fsdp_resume.RankStates(self.model)} if self.args.rank_states else {}

    def resume(self, path: Path) -> dict:
        """``fabric.load`` into a state that asks for all but UNREQUESTED; what the tests read of it."""
        state = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "epoch": None, "step": None,
                 **self.rank_states()}
        if self.args.request_missing:
            state[MISSING_KEY] = MISSING_DEFAULT
        if self.args.more_entries:
            state.update(self.more_entries())
        weights_only = {"weights_only": True} if self.args.weights_only else {}
        remainder = self.fabric.load(path, state, strict=bool(self.args.strict), **weights_only)
        self.epoch, self.step = state["epoch"], state["step"]
        if self.args.more_entries:
            self.history, self.notes, self.pair, self.offset = (state[key] for key in ("history", "notes", "pair", "offset"))
        return {
            "remainder": dict(remainder),
            # native Lightning 2.1+ puts a sharded checkpoint's scheduler state in place of the scheduler
            "scheduler_type": type(state["scheduler"]).__name__,
            "scheduler_in_place": state["scheduler"] is self.scheduler,
            MISSING_KEY: state.get(MISSING_KEY),
            "ema_in_place": state.get("ema") is self.ema,
        }

    def train_epoch(self) -> None:
        self.epoch += 1
        for x, y in batches(self.fabric.global_rank, self.fabric.world_size):
            self.optimizer.zero_grad()
            loss = nn.functional.mse_loss(self.model(x), y)
            self.fabric.backward(loss)
            self.optimizer.step()
            self.step += 1
            self.loss = loss.item()
        self.scheduler.step()
        with torch.no_grad():
            if self.args.evaluate:  # a forward with no backward after it: FSDP keeps the root unit's weights gathered
                self.model(next(batches(self.fabric.global_rank, self.fabric.world_size))[0])
            self.ema.weight.mul_(0.5).add_(self.step)
        self.history.append(self.step)
        self.notes = {"epochs": {"seen": list(range(self.epoch + 1))}, "lr": LR}
        self.pair = (self.epoch, self.step)
        self.offset = self.offset + self.step / 3

    def record(self, name: str, **info) -> None:
        root, optimizer = fsdp_root(self.model), self.optimizer.optimizer  # Fabric's wrappers left out
        local = states.local_state(root, [optimizer])
        local["scheduler"] = self.scheduler.state_dict()
        full = {"params": states.full_weights(root, root), "optim": [states.full_optimizer_state(root, optimizer)]}
        info = {"epoch": self.epoch, "step": self.step, "loss": self.loss, "last_epoch": self.scheduler.last_epoch,
                "last_lr": self.scheduler.get_last_lr(),
                # what the optimizer Fabric returned shows, which the scheduler steps
                "fabric_optimizer_lr": [group["lr"] for group in self.optimizer.param_groups], **info}
        if self.args.more_entries:
            info["more_entries"] = self.more_entries_record()
        states.write(self.args.out, name, self.fabric.global_rank, local, info, full)

    def save_filter(self):
        """``--filter``: keep only the model's weights (no biases)."""
        return {"model": lambda key, value: "weight" in key} if self.args.filter else None


def train(run: Run, args) -> None:
    info = {}
    if args.resume:
        info = run.resume(args.resume)
    elif args.load_raw:
        run.fabric.load_raw(args.load_raw, run.model, strict=bool(args.strict))
    elif args.load_model:
        run.fabric.load(args.load_model, {"model": run.model}, strict=bool(args.strict))
    run.record("start", **info)
    while run.epoch + 1 < args.epochs:
        run.train_epoch()
        run.record(f"epoch{run.epoch}")
        run.fabric.save(args.ckpt_dir / f"epoch={run.epoch}.ckpt", run.state(), filter=run.save_filter())
    run.record("final")
    lightning_fsdp_resume.wait_for_saves(run.fabric)  # a no-op unless --async-save
    if args.reload is not None:
        # in the same processes, back to an earlier checkpoint and on from it
        run.resume(args.ckpt_dir / f"epoch={args.reload}.ckpt")
        run.record("reloaded")
        run.train_epoch()
        run.record(f"reloaded-epoch{run.epoch}")


def refusals(run: Run, checkpoint: Path, scratch: Path) -> dict:
    """Every call native Fabric refuses, made on every rank, with what it raised (None: nothing)."""
    fabric, model, optimizer = run.fabric, run.model, run.optimizer
    torch.manual_seed(0)
    other = fabric.setup_module(Net())
    sharded = run.args.state_dict_type == "sharded"
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / "empty-dir").mkdir(exist_ok=True)
    (scratch / "plain-dir").mkdir(exist_ok=True)  # a directory that holds no checkpoint, but holds something
    (scratch / "plain-dir" / "notes.txt").write_text("not a checkpoint")
    calls = {
        "save-without-model": lambda: fabric.save(scratch / "no-model.ckpt", {"optimizer": optimizer, "epoch": 0}),
        "load-without-model": lambda: fabric.load(checkpoint, {"optimizer": optimizer}),
        "save-two-models": lambda: fabric.save(scratch / "two.ckpt", {"model": model, "other": other}),
        "load-two-models": lambda: fabric.load(checkpoint, {"model": model, "other": other}),
        "load-raw-optimizer": lambda: fabric.load_raw(checkpoint, optimizer),
        "load-empty-state": lambda: fabric.load(checkpoint, {}),
        "load-no-state": lambda: fabric.load(checkpoint),
        "load-missing-path": lambda: fabric.load(scratch / "does-not-exist.ckpt", {"model": model}),
        "load-empty-directory": lambda: fabric.load(scratch / "empty-dir", {"model": model}),
        "filter-not-a-dict": lambda: fabric.save(scratch / "f.ckpt", {"model": model}, filter=lambda k, v: True),
        "filter-unknown-key": lambda: fabric.save(scratch / "f.ckpt", {"model": model}, filter={"nope": lambda k, v: True}),
        "filter-not-callable": lambda: fabric.save(scratch / "f.ckpt", {"model": model}, filter={"model": 1}),
        # last: it loads the model and optimizer before it finds the key missing
        "load-strict-missing-key": lambda: fabric.load(checkpoint, {"model": model, "optimizer": optimizer, MISSING_KEY: 0}),
    }
    if sharded:
        calls["save-sharded-filtered"] = lambda: fabric.save(scratch / "filtered.ckpt", {"model": model},
                                                             filter={"model": lambda k, v: True})
        calls["load-raw-sharded"] = lambda: fabric.load_raw(checkpoint, model)
    else:
        calls["save-full-onto-directory"] = lambda: fabric.save(scratch / "plain-dir", {"model": model})
        calls["save-full-onto-empty-directory"] = lambda: fabric.save(scratch / "empty-dir", {"model": model})
    calls["load-raw-missing-path"] = lambda: fabric.load_raw(scratch / "does-not-exist.pt", model)
    calls["load-raw-plain-directory"] = lambda: fabric.load_raw(scratch / "plain-dir", model)
    calls["get-checkpoint-io"] = lambda: fabric.strategy.checkpoint_io
    # a copy of the checkpoint that runs code when unpickled, and a raw state dict file that does (support/poison.py)
    site = "meta.pt" if sharded else FULL_SITE
    poisoned_copy = scratch / f"poisoned-{site}.ckpt"
    if fabric.global_rank == 0:
        poisoned(checkpoint, poisoned_copy, site, scratch / "ran-load")
        torch.save({"hidden": Hidden(scratch / "ran-load-raw")}, scratch / "poisoned-raw.pt")
    fabric.barrier()
    # a copy with one bit flipped in a tensor (of rank 1's shard file), and a damaged state dict file (support/damage.py)
    damaged_copy, damaged_raw = scratch / "damaged.ckpt", scratch / "damaged-raw.pt"
    # native's sharded checkpoints carry no checksums: its loads read damaged shards (one rank failing in torch's reader)
    checked = not sharded or carries_checksums(checkpoint)
    if fabric.global_rank == 0 and checked:
        if sharded:
            shutil.copytree(checkpoint, damaged_copy)
            offset, length, *_ = largest_item(damaged_copy, "__1_0.distcp")
            flipped(damaged_copy / "__1_0.distcp", offset + length // 2)
        else:
            shutil.copyfile(checkpoint, damaged_copy)
            flipped(damaged_copy, middle_of_largest_record(damaged_copy))
        torch.save({name: torch.ones(64) for name in ("a", "b")}, damaged_raw)
        flipped(damaged_raw, middle_of_largest_record(damaged_raw))
    fabric.barrier()
    if checked:
        calls["load-damaged"] = lambda: fabric.load(damaged_copy, {"model": model, "optimizer": optimizer})
        calls["load-raw-damaged"] = lambda: fabric.load_raw(damaged_raw, model)
    calls["load-poisoned"] = lambda: fabric.load(poisoned_copy, {"model": model, "optimizer": optimizer})
    calls["load-raw-poisoned"] = lambda: fabric.load_raw(scratch / "poisoned-raw.pt", model)
    checkpoint_io = FABRIC_UNDER_TEST.module("plugins").TorchCheckpointIO()
    calls["set-checkpoint-io"] = lambda: setattr(fabric.strategy, "checkpoint_io", checkpoint_io)  # as Fabric(plugins=[...]) does
    raised = {}
    for name, call in calls.items():
        try:
            call()
            raised[name] = None
        except Exception as error:
            message = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
            raised[name] = {"type": type(error).__name__, "bases": [c.__name__ for c in type(error).__mro__],
                            "message": message}
    return raised


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=directory, required=True, help="a directory or a URL")
    parser.add_argument("--fsspec-conf", default=None, help="JSON for fsspec.config.conf: a store's endpoint and keys")
    parser.add_argument("--cut", default=None, help="POINT:RANK:SAVE:PORT, cut the network to the S3 server there")
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--epochs", type=int, default=3, help="train until this many epochs are done")
    parser.add_argument("--resume", type=directory, default=None, help="fabric.load this checkpoint (a path or URL) first")
    parser.add_argument("--strict", type=int, default=1, help="fabric.load(..., strict=)")
    parser.add_argument("--request-missing", action="store_true", help=f"ask the load for {MISSING_KEY!r} too")
    parser.add_argument("--load-raw", type=Path, default=None, help="fabric.load_raw this model state dict first")
    parser.add_argument("--load-model", type=Path, default=None, help="fabric.load this checkpoint's model alone first")
    parser.add_argument("--grown", action="store_true", help="train a model with one more layer than Net")
    parser.add_argument("--net", choices=sorted(NETS), default="net", help="the model (--grown: GrownNet)")
    parser.add_argument("--rank-states", action="store_true", help="save and load a RankStates of the model")
    parser.add_argument("--weights-only", action="store_true", help="fabric.load(..., weights_only=True)")
    parser.add_argument("--filter", action="store_true", help="save only the model's weights (fabric.save filter=)")
    parser.add_argument("--more-entries", action="store_true",
                        help="save and load a plain module, a list, a nested dict, a tuple and a tensor besides")
    parser.add_argument("--kill", default=None, help="POINT:RANK:SAVE, see faults.kill_during_saves")
    parser.add_argument("--errors", type=Path, default=None, help="make the refused calls, with this checkpoint")
    parser.add_argument("--async-save", action="store_true", help="FSDPStrategy(async_save=True)")
    parser.add_argument("--fsdp-builder", action="store_true", help="sharded saves build their state dicts with FSDP's builder")
    parser.add_argument("--wrap", choices=["policy", "root"], default="policy",
                        help="policy: an FSDP unit per nn.Sequential; root: no auto_wrap_policy, the root unit only")
    parser.add_argument("--evaluate", action="store_true", help="a forward under no_grad after each epoch")
    parser.add_argument("--reload", type=int, default=None,
                        help="EPOCH: after training, fabric.load that epoch's checkpoint, record it, train one epoch more")
    parser.add_argument("--trace-saves", type=float, default=None,
                        help="SECONDS: log each save's steps to OUT/saves_rank{rank}.txt, each write delayed by SECONDS")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)  # native full saves do not make it (sharded ones do)
    configure(args.fsspec_conf)

    enable_cpu_fsdp()
    if args.fsdp_builder:
        states.build_with_fsdp()
    run = Run(args)
    if args.kill:
        point, rank, save = args.kill.split(":")
        kill_during_saves(run.fabric.strategy, point, int(rank), int(save))
    if args.trace_saves is not None:
        trace_saves(run.fabric.strategy, args.out / f"saves_rank{run.fabric.global_rank}.txt", args.trace_saves,
                    removals=False)
    if args.cut:
        point, rank, save, port = args.cut.split(":")
        kill_during_saves(run.fabric.strategy, point, int(rank), int(save), fault=cut_network(int(port)))
    if args.errors:
        raised = refusals(run, args.errors, args.out / "scratch")
        (args.out / f"errors_rank{run.fabric.global_rank}.json").write_text(json.dumps(raised, indent=1))
    else:
        train(run, args)
    leave_process_group()


if __name__ == "__main__":
    sys.exit(main())
