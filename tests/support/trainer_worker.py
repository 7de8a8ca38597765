"""One Trainer run, launched by the tests under torchrun (FSDP on CPU over gloo), forked by the rank server or as one process.

It trains a small model with nested FSDP units on a fixed dataset and writes, into --out, what the
tests compare: every rank's local shards and raw optimizer state at each epoch end, after restoring
and at the end; rank 0 also writes the gathered full weights. It checks nothing itself.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

import lightning_fsdp_resume  # noqa: F401  (the one-line activation under test)
from lightning_fsdp_resume.testing import enable_cpu_fsdp, leave_process_group

if __name__ == "__main__":  # run as a script (torchrun, `python tests/support/trainer_worker.py`): `support` is in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import models, states  # noqa: E402
from support.faults import cut_network, fail_write, keep_gathered_copies, kill_during_saves, trace_saves  # noqa: E402
from support.flavours import TRAINER_UNDER_TEST, optimizer_state_on_cpu  # noqa: E402
from support.s3 import configure, directory  # noqa: E402

L = TRAINER_UNDER_TEST.module()  # lightning.pytorch where lightning is installed, else pytorch_lightning
Callback, ModelCheckpoint = L.Callback, TRAINER_UNDER_TEST.module("callbacks").ModelCheckpoint
FSDPStrategy = TRAINER_UNDER_TEST.module("strategies").FSDPStrategy


class Net(L.LightningModule):
    def __init__(self, optimizers: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = models.body()
        self.head = nn.Linear(16, 2)
        self.automatic_optimization = optimizers == 1

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))

    def _loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        return None

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch[0])

    def configure_optimizers(self):
        # trainer.model holds the FSDP flat parameters when use_orig_params=False (the 2.0.x default)
        params = list(self.trainer.model.parameters())
        if self.hparams.optimizers == 1:
            return torch.optim.Adam(params, lr=1e-2)
        body = {id(p) for p in self.body.parameters()}
        return [
            torch.optim.Adam([p for p in params if id(p) in body], lr=1e-2),
            torch.optim.SGD([p for p in params if id(p) not in body], lr=1e-2, momentum=0.9),
        ]


class WideNet(Net):
    """The same names as Net, a wider body: a checkpoint of Net does not fit it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16))


class ExtraNet(Net):
    """Net plus a layer Net's checkpoints do not have."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Sequential(nn.Linear(2, 2))

    def forward(self, x):
        return self.extra(super().forward(x))


class BufferedNet(Net):
    """Net with batch normalisation in the body: its running statistics are buffers, which FSDP keeps
    whole on every rank and which no optimizer touches."""

    def __init__(self) -> None:
        super().__init__()
        self.body = models.body("batchnorm")


class DropoutNet(Net):
    """Net with dropout in the body: each step's masks come from the rank's random number generator."""

    def __init__(self) -> None:
        super().__init__()
        self.body = models.body("dropout")


class BuiltNet(Net):
    """Net whose last layer is built in the hook Lightning runs before wrapping: 2.0.x's
    ``configure_sharded_model``, the ``configure_model`` that native 2.1+ names it. Idempotent, as the hook may
    run more than once."""

    def __init__(self) -> None:
        super().__init__()
        self.late = None

    def _build(self):
        """Build the last layer; in 2.0.x's hook, wrap every part too (a root unit it does not add), as
        TwoOptimizerNet does. Outside the Trainer, ``wrap`` wraps nothing."""
        from torch.distributed.fsdp.wrap import wrap

        if self.late is None:
            self.late = wrap(nn.Sequential(nn.Linear(2, 2)))
            self.body, self.head = wrap(self.body), wrap(self.head)

    def forward(self, x):
        return self.late(super().forward(x))


if TRAINER_UNDER_TEST.native:
    BuiltNet.configure_model = BuiltNet._build
else:
    BuiltNet.configure_sharded_model = BuiltNet._build


class TwoOptimizerNet(Net):
    """Two optimizers (manual optimization): Adam for the body, SGD with momentum for the head."""

    def __init__(self) -> None:
        super().__init__(optimizers=2)

    def configure_sharded_model(self):
        """Wrap each part here, so the Trainer does not wrap the root.

        Manual optimization calls backward inside training_step; under a root FSDP unit that is inside
        FSDP's forward, which torch refuses. Wrapping the parts is the Lightning 2.0.x way around it.
        """
        from torch.distributed.fsdp.wrap import wrap

        self.body = wrap(self.body)
        self.head = wrap(self.head)


def data(batch_size: int = 4):
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=generator)
    y = torch.randn(64, 2, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class Recorder(Callback):
    """Writes what the tests compare; raw tensors, not produced by the shim."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.prefix = ""  # the step's, in a run of several steps (run_steps)

    def dump(self, trainer, name: str) -> None:
        name = self.prefix + name
        rank = trainer.global_rank
        local = states.local_state(trainer.model, trainer.strategy.optimizers)
        full = {"params": full_weights(trainer), "optim": None}
        # the optimizer state is left out where torch cannot gather it on the CPU (torch 2.2, use_orig_params)
        use_orig_params = getattr(trainer.strategy, "kwargs", {}).get("use_orig_params", False)
        if optimizer_state_on_cpu(use_orig_params):
            full["optim"] = [full_optimizer_state(trainer, o) for o in trainer.strategy.optimizers]
        info = {"epoch": trainer.current_epoch, "global_step": trainer.global_step, "optimizers": len(local["optim"])}
        states.write(self.out, name, rank, local, info, full)

    def on_train_start(self, trainer, pl_module):
        self.dump(trainer, "start")

    def on_train_epoch_end(self, trainer, pl_module):
        self.dump(trainer, f"epoch{trainer.current_epoch}")

    def on_train_end(self, trainer, pl_module):
        self.dump(trainer, "final")
        self.count_saved_entries(trainer)

    def count_saved_entries(self, trainer) -> None:
        """How many entries the strategy's own state-dict methods return on this rank (full: 0 but on rank 0)."""
        strategy = trainer.strategy
        if not isinstance(strategy, FSDPStrategy):
            return
        counts = {"model": len(strategy.lightning_module_state_dict())}
        if optimizer_state_on_cpu(strategy.kwargs.get("use_orig_params", False)):
            counts["optimizers"] = [len(strategy.optimizer_state(o)) for o in strategy.optimizers]
        (self.out / f"saved_entries_rank{trainer.global_rank}.json").write_text(json.dumps(counts))

    def on_validation_start(self, trainer, pl_module):
        if trainer.state.fn == "validate":
            self.dump(trainer, "validate")

    def on_test_start(self, trainer, pl_module):
        self.dump(trainer, "test")

    def on_predict_start(self, trainer, pl_module):
        self.dump(trainer, "predict")


def full_weights(trainer):
    """The LightningModule's weights by its own names, gathered with torch's summon_full_params."""
    module = trainer.lightning_module
    if not isinstance(trainer.strategy, FSDPStrategy):
        return {n: p.detach().clone() for n, p in module.named_parameters()}
    return states.full_weights(trainer.model, module)


def full_optimizer_state(trainer, optimizer):
    """An optimizer's whole state keyed by parameter name, gathered by torch itself (not by the shim)."""
    if not isinstance(trainer.strategy, FSDPStrategy):
        names = [n for n, _ in trainer.lightning_module.named_parameters()]
        state = optimizer.state_dict()
        return {names[i]: v for i, v in state["state"].items()}
    return states.full_optimizer_state(trainer.model, optimizer)


def trace_meta_writes(log: Path) -> None:
    """Append one line per ``meta.pt`` written, naming the writing rank."""
    from lightning_fsdp_resume._storage import _checked

    original = _checked.save_file

    def traced(location, obj):
        with open(log, "a") as handle:
            handle.write(f"{os.environ.get('RANK', '0')} {location}\n")
        return original(location, obj)

    _checked.save_file = traced


class CliNet(Net):
    """Net with its own training data, as LightningCLI's ``fit`` wants a model or a datamodule to provide it."""

    def train_dataloader(self):
        return data()


def cli_main(argv) -> None:
    """``cli --out OUT --ckpt-dir DIR <LightningCLI arguments>``: the user's way, the strategy from a YAML config
    or flags. The worker adds only what it records and where checkpoints go."""
    import importlib

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    args, cli_args = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    enable_cpu_fsdp()
    checkpoint = ModelCheckpoint(dirpath=str(args.ckpt_dir), filename="{epoch}", save_top_k=-1)
    cli = importlib.import_module(f"{L.__name__}.cli")
    cli.LightningCLI(CliNet, args=cli_args, seed_everything_default=0, save_config_callback=None,
                     trainer_defaults={"callbacks": [checkpoint, Recorder(args.out)]})
    leave_process_group()


def activation_checkpointing(enabled: bool) -> dict:
    """FSDPStrategy's argument checkpointing every ``nn.Linear``: 2.0.x's ``activation_checkpointing``, or the
    ``activation_checkpointing_policy`` that native 2.1+ deprecates it for."""
    if not enabled:
        return {}
    return {"activation_checkpointing_policy": {nn.Linear}} if TRAINER_UNDER_TEST.native else {"activation_checkpointing": [nn.Linear]}


class OwnFSDPStrategy(FSDPStrategy):
    """A user's subclass of FSDPStrategy whose own save and load call the strategy's (to log, say)."""

    def save_checkpoint(self, *args, **kwargs):
        return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        return super().load_checkpoint(*args, **kwargs)


def make_trainer(args, max_epochs: int):
    """A Trainer as the arguments ask, with a new strategy and new callbacks (checkpoints into --ckpt-dir)."""
    if args.strategy in ("fsdp", "own-fsdp"):
        enable_cpu_fsdp()
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        checkpoint_kind = {} if args.stock else {"state_dict_type": args.state_dict_type}
        # --wrap root: Lightning's default, no policy, so FSDP wraps the root module alone
        wrapping = {"auto_wrap_policy": ModuleWrapPolicy({nn.Sequential})} if args.wrap == "policy" else {}
        from torch.distributed.fsdp import ShardingStrategy

        sharding = {"sharding_strategy": ShardingStrategy[args.sharding_strategy]} if args.sharding_strategy else {}
        strategy = (OwnFSDPStrategy if args.strategy == "own-fsdp" else FSDPStrategy)(
            **checkpoint_kind,
            use_orig_params=bool(args.use_orig_params),
            **wrapping,
            **sharding,
            **activation_checkpointing(args.activation_checkpointing),
        )
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    elif args.strategy == "ddp":
        strategy, devices = "ddp", int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    else:
        strategy, devices = "auto", 1
    num_nodes = int(os.environ.get("WORLD_SIZE", "1")) // devices
    if args.last_only:
        checkpoint = ModelCheckpoint(dirpath=str(args.ckpt_dir), save_top_k=0, save_last=True)
    elif args.best_first:
        checkpoint = ModelCheckpoint(
            dirpath=str(args.ckpt_dir), filename="{epoch}", save_top_k=-1, monitor="step", mode="min", save_last=True
        )
    elif args.top_k == -1:
        checkpoint = ModelCheckpoint(
            dirpath=str(args.ckpt_dir), filename="{epoch}", save_top_k=-1, save_weights_only=args.weights_only
        )
    else:
        checkpoint = ModelCheckpoint(
            dirpath=str(args.ckpt_dir), filename="{epoch}", save_top_k=args.top_k, monitor="step", mode="max", save_last=True
        )
    plugins = [TRAINER_UNDER_TEST.module("plugins.io").AsyncCheckpointIO()] if args.async_save else []
    return L.Trainer(
        plugins=plugins,
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_epochs=max_epochs,
        callbacks=[checkpoint, Recorder(args.out)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0 if args.fn == "fit" and not args.then else None,
        deterministic=True,
    )


def recorder(trainer) -> "Recorder":
    return next(callback for callback in trainer.callbacks if isinstance(callback, Recorder))


def open_process_group(seconds: int) -> None:
    """The process group Lightning would open (it keeps one that is open), with a shorter timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=seconds))


def run_steps(args, trainer, model) -> None:
    """Run ``--then``'s steps in these processes, one after another, each recorded with its number (``s1-test``)
    and its outcome in ``OUT/steps_rank{rank}.json``; a failed step does not stop the next.

    ``FN:CKPT`` runs ``trainer.FN(model, ckpt_path=CKPT)`` (``none``: None; a file name: in --ckpt-dir);
    ``fit:CKPT:EPOCHS`` fits on to EPOCHS with the same Trainer, ``newfit:CKPT:EPOCHS`` with a new one;
    ``save:NAME`` records the state as ``sN-saved`` and saves ``OUT/NAME``.
    """
    outcomes = []
    for number, step in enumerate(args.then, start=1):
        fn, _, rest = step.partition(":")
        recorder(trainer).prefix = f"s{number}-"
        try:
            if fn == "save":
                recorder(trainer).dump(trainer, "saved")
                trainer.save_checkpoint(args.out / rest)
            else:
                where, _, epochs = rest.partition(":")
                ckpt_path = {"none": None, "best": "best", "last": "last"}.get(where, str(args.ckpt_dir / where))
                if fn == "newfit":
                    trainer, fn = make_trainer(args, int(epochs)), "fit"
                    recorder(trainer).prefix = f"s{number}-"
                if fn == "fit":
                    trainer.fit_loop.max_epochs = int(epochs)
                    trainer.fit(model, train_dataloaders=data(), val_dataloaders=data(), ckpt_path=ckpt_path)
                else:
                    getattr(trainer, fn)(model, dataloaders=data(), ckpt_path=ckpt_path)
            outcomes.append({"step": step, "error": None})
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # recorded for the test to judge (torch's CheckpointException is a BaseException)
            outcomes.append({"step": step, "error": f"{type(error).__name__}: {error}"[:2000]})
    (args.out / f"steps_rank{int(os.environ.get('RANK', '0'))}.json").write_text(json.dumps(outcomes))


def main() -> None:
    if sys.argv[1:2] == ["cli"]:
        return cli_main(sys.argv[2:])
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=directory, required=True, help="a directory or a URL")
    parser.add_argument("--fsspec-conf", default=None, help="JSON for fsspec.config.conf: a store's endpoint and keys")
    parser.add_argument("--cut", default=None, help="POINT:RANK:SAVE:PORT, cut the network to the S3 server there")
    parser.add_argument("--strategy", choices=["fsdp", "own-fsdp", "single", "ddp"], default="fsdp",
                        help="own-fsdp: a subclass of FSDPStrategy of the user's, see OwnFSDPStrategy")
    parser.add_argument("--state-dict-type", default="sharded")
    parser.add_argument("--use-orig-params", type=int, default=0)
    parser.add_argument("--optimizers", type=int, default=1)
    parser.add_argument("--wrap", choices=["policy", "root"], default="policy",
                        help="policy: an FSDP unit per nn.Sequential; root: no auto_wrap_policy, the root unit only")
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--fn", choices=["fit", "validate", "test", "predict"], default="fit")
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--top-k", type=int, default=-1, help="-1: keep every epoch; else monitor step, keep k, save last")
    parser.add_argument("--last-only", action="store_true", help="only last.ckpt, overwritten every epoch")
    parser.add_argument("--weights-only", action="store_true", help="ModelCheckpoint(save_weights_only=True)")
    parser.add_argument("--net", choices=["net", "wide", "extra", "buffered", "dropout", "built"], default="net")
    parser.add_argument("--strict", type=int, default=1, help="LightningModule.strict_loading")
    parser.add_argument("--other-ranks-ckpt-path", default=None, help="what ranks > 0 pass as ckpt_path")
    parser.add_argument("--kill", default=None, help="POINT:RANK:SAVE, see kill_during_saves")
    parser.add_argument("--trace-meta", action="store_true", help="log each meta.pt write to OUT/meta_writes.txt")
    parser.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every nn.Linear's activations")
    parser.add_argument("--best-first", action="store_true", help="keep every epoch, the best is the first (monitor step, min)")
    parser.add_argument("--stock", action="store_true", help="Lightning's own FSDPStrategy arguments (no state_dict_type)")
    parser.add_argument("--then", nargs="*", default=[], help="steps after the first call in the same processes, see run_steps")
    parser.add_argument("--async-save", action="store_true", help="Trainer(plugins=[AsyncCheckpointIO()])")
    parser.add_argument("--keep-gathered-copies", action="store_true", help="see faults.keep_gathered_copies")
    parser.add_argument("--fsdp-builder", action="store_true", help="sharded saves build their state dicts with FSDP's builder")
    parser.add_argument("--sharding-strategy", default=None, help="FSDP's, by name (SHARD_GRAD_OP, say); default FULL_SHARD")
    parser.add_argument("--record-error", action="store_true", help="each rank writes what the call raised to OUT/error_rankN.txt")
    parser.add_argument("--trust-pickles", action="store_true", help="the call's weights_only=False (Lightning 2.6's keyword)")
    parser.add_argument("--fail", default=None,
                        help="POINT:RANK:SAVE, fail the write there (see kill_during_saves); fit's error goes to OUT/error_rank{rank}.txt")
    parser.add_argument("--trace-saves", type=float, default=None,
                        help="SECONDS: log each save's steps to OUT/saves_rank{rank}.txt, each write delayed by SECONDS")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    configure(args.fsspec_conf)

    L.seed_everything(0)
    if args.then:
        open_process_group(seconds=120)  # a step that fails on one rank ends the run in minutes, not gloo's 30
    trainer = make_trainer(args, args.max_epochs)
    if args.trace_meta:
        trace_meta_writes(args.out / "meta_writes.txt")
    if args.kill:
        point, rank, save = args.kill.split(":")
        kill_during_saves(trainer.strategy, point, int(rank), int(save))
    if args.fail:
        point, rank, save = args.fail.split(":")
        kill_during_saves(trainer.strategy, point, int(rank), int(save), fault=fail_write)
    if args.trace_saves is not None:
        trace_saves(trainer.strategy, args.out / f"saves_rank{os.environ.get('RANK', '0')}.txt", args.trace_saves)
    if args.keep_gathered_copies:
        keep_gathered_copies()
    if args.fsdp_builder:
        states.build_with_fsdp()
    if args.cut:
        point, rank, save, port = args.cut.split(":")
        kill_during_saves(trainer.strategy, point, int(rank), int(save), fault=cut_network(int(port)))
    if args.optimizers == 2:
        model = TwoOptimizerNet()
    else:
        model = {"net": Net, "wide": WideNet, "extra": ExtraNet, "buffered": BufferedNet, "dropout": DropoutNet,
                 "built": BuiltNet}[args.net]()
    model.strict_loading = bool(args.strict)
    ckpt_path = args.ckpt_path
    if args.other_ranks_ckpt_path is not None and int(os.environ.get("RANK", "0")) > 0:
        ckpt_path = args.other_ranks_ckpt_path
    trusted = {"weights_only": False} if args.trust_pickles else {}
    if args.fail or args.record_error:
        try:  # every rank records what it raised: the first to fail would end the others before they print it
            if args.fn == "fit":
                trainer.fit(model, train_dataloaders=data(), ckpt_path=ckpt_path, **trusted)
            else:
                getattr(trainer, args.fn)(model, dataloaders=data(), ckpt_path=ckpt_path, **trusted)
        except Exception:
            import traceback

            (args.out / f"error_rank{os.environ.get('RANK', '0')}.txt").write_text(traceback.format_exc())
    elif args.fn == "fit":
        # before the steps in the same processes, validation too: its forward passes are what FSDP keeps gathered
        trainer.fit(model, train_dataloaders=data(), val_dataloaders=data() if args.then else None, ckpt_path=ckpt_path,
                    **trusted)
        if args.trace_saves is not None:
            with open(args.out / f"saves_rank{os.environ.get('RANK', '0')}.txt", "a") as log:
                log.write("fit-returned\n")
    else:
        getattr(trainer, args.fn)(model, dataloaders=data(), ckpt_path=ckpt_path, **trusted)
    if args.then:
        run_steps(args, trainer, model)
    leave_process_group()


if __name__ == "__main__":
    sys.exit(main())
