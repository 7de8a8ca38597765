"""The command line: ``demo`` (train, checkpoint, resume, compare), ``status``, ``consolidate`` and ``verify``."""
import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning_fsdp_resume", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="train on 2 ranks, checkpoint mid-run, resume, compare with an uninterrupted run (--compare-stock: also"
        " without the shim)",
        description="Train a small model with FSDP, checkpoint mid-run, stop, resume in new processes and compare each"
        " epoch's loss and weights with an uninterrupted run. Exit status 0 only when the resumed run matches bit for"
        " bit.",
    )
    demo.add_argument("--ranks", type=int, default=2, help="FSDP ranks (default 2)")
    demo.add_argument("--epochs", type=int, default=4, help="epochs of the whole run (default 4)")
    demo.add_argument("--stop-after", type=int, default=2, help="epochs before the interruption (default 2)")
    demo.add_argument("--hidden", type=int, default=32, help="model width (default 32)")
    demo.add_argument("--state-dict-type", choices=["sharded", "full"], default="sharded",
                      help="the shim's checkpoint kind (default sharded); stock Lightning 2.0.x writes one full file")
    demo.add_argument("--compare-stock", action="store_true",
                      help="first interrupt and resume with patching off (stock Lightning 2.0.x FSDP, whose checkpoint holds"
                      " no weights and only rank 0's optimizer shard) and print its column beside the shim's; the exit"
                      " status stays the shim's verdict, whether stock differs, fails or not")
    demo.add_argument("--fabric", action="store_true",
                      help="the same proof through Fabric: a training loop that checkpoints with fabric.save and resumes"
                      " with fabric.load (model, optimizer, LR scheduler, epoch and step); Fabric's FSDPStrategy"
                      " (same --state-dict-type default, sharded) instead of the Trainer's")
    demo.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary directory)")

    commands.add_parser("status", help="installed Lightning, torch and wrapt, and what the shim did with each flavour")

    from ._commands._consolidate import DTYPES, FORMATS, TORCH  # plain names: importing it loads no torch

    consolidate = commands.add_parser(
        "consolidate",
        help="turn a sharded checkpoint directory into one full checkpoint file, in one process",
        description="Read a sharded FSDP checkpoint directory (this package's or Lightning >= 2.1's, written by the"
        " Trainer or by Fabric) and write the full checkpoint file the same run would have written. The Trainer's:"
        " weights under state_dict, optimizer states in PyTorch's format. Fabric's: each module and optimizer under"
        " its own key, optimizer states keyed by parameter name. Everything else of meta.pt is kept. With --weights-only"
        " or --format safetensors: the weights alone, for inference. Needs no GPU and no process group; SRC is never"
        " modified.",
    )
    # strings, not Paths: Path("s3://b/x") is the local s3:/b/x; consolidate opens a URL with fsspec
    consolidate.add_argument("src", metavar="SRC", help="the sharded checkpoint directory, or its URL (s3://..., any fsspec URL)")
    consolidate.add_argument("dst", metavar="DST", help="the full checkpoint file to write, or its URL")
    consolidate.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    consolidate.add_argument("--quiet", action="store_true", help="no progress on stderr")
    consolidate.add_argument(
        "--weights-only", action="store_true",
        help="the model's weights for inference, without optimizer state or training metadata. A Trainer checkpoint"
        " keeps state_dict and what load_from_checkpoint reads (pytorch-lightning_version, the hyper-parameters)"
        " plus epoch and global_step; loops, callbacks, optimizer and scheduler states are left out. A Fabric"
        " checkpoint keeps its module entries only",
    )
    consolidate.add_argument(
        "--dtype", choices=list(DTYPES), default=None,
        help="cast floating-point weights to this dtype; integer and bool tensors are kept as they are (default:"
        " as stored). Weights-only output only: with --weights-only or --format safetensors",
    )
    consolidate.add_argument(
        "--format", choices=FORMATS, default=TORCH,
        help="torch (default): a checkpoint file for torch.load and load_from_checkpoint. safetensors: one module's"
        " tensors under its own key names (the Trainer's state_dict keys), read and written one tensor at a time so"
        " that memory stays near the largest tensor; weights only, so --weights-only is implied",
    )
    consolidate.add_argument(
        "--ema", action="store_true",
        help="the average of the weights that ShardedEMA saved beside them, under state_dict in their place: weights"
        " only (as --weights-only), for inference or export; with --dtype and --format as for the weights",
    )
    consolidate.add_argument(
        "--trusted", action="store_true",
        help="unpickle SRC's metadata with no restriction, running whatever code it names: only for a checkpoint from"
        " a source you trust that holds types the default refuses (the refusal names them)",
    )
    consolidate.add_argument(
        "--module", metavar="NAME", default=None,
        help="a Fabric checkpoint's module entry (the key given to fabric.save) to write alone; with --weights-only or"
        " --format safetensors, and needed for safetensors when the checkpoint holds several modules",
    )

    verify = commands.add_parser(
        "verify",
        help="check every byte of a checkpoint against the checksums its save wrote",
        description="Check every byte of a checkpoint, with no model and no process group: a sharded directory against"
        " the checksums this package's save wrote beside its shards, a full file against the CRC-32s of its zip"
        " records (any writer's). Nothing is unpickled or written. Exit status 0 when it is whole, 1 with the first"
        " damage named, 2 when it carries no checksums (native Lightning's sharded checkpoints, torch's legacy format).",
    )
    verify.add_argument("path", metavar="PATH", help="the checkpoint directory or file, or its URL (s3://..., any fsspec URL)")
    verify.add_argument("--quiet", action="store_true", help="no progress on stderr")

    args = parser.parse_args(argv)
    if args.command == "verify":
        return run_verify(args)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args)
    if args.command == "consolidate":
        return run_consolidate(args)
    return print_status()


# consolidate's options as its refusals name them here: the flags above (``_whole_read.KEYWORDS`` names them in Python)
FLAGS = {"ema": "--ema", "weights_only": "--weights-only", "overwrite": "--overwrite", "safetensors": "--format safetensors",
         "module NAME": "--module NAME", "module": "--module {!r}", "module name": "--module", "dtype": "--dtype {}",
         "dtype name": "--dtype", "format": "--format"}


def run_consolidate(args: argparse.Namespace) -> int:
    """Exit status 0 when DST was written, 1 when the conversion was refused (the reason on stderr, options as flags)."""
    from ._checkpoint._format import TRAINER
    from ._checkpoint._whole_read import spoken
    from ._commands._consolidate import SAFETENSORS, consolidate

    weights_only = args.weights_only or args.format == SAFETENSORS or args.ema
    try:
        summary = consolidate(args.src, args.dst, overwrite=args.overwrite, progress=not args.quiet,
                              weights_only=args.weights_only, dtype=args.dtype, format=args.format, module=args.module,
                              trusted=args.trusted, ema=args.ema)
    except (OSError, ValueError, NotImplementedError, ImportError, RuntimeError) as error:
        said = getattr(error, "options_text", None)
        print(f"lightning_fsdp_resume consolidate: error: {error if said is None else spoken(said, FLAGS)}", file=sys.stderr)
        return 1
    if summary.writer == TRAINER:
        held = f"{summary.weights['state_dict']} state_dict entries"
        if not weights_only:
            held += f", {len(summary.optimizers)} optimizer states"
    else:
        modules = ", ".join(f"{key!r} ({count} entries)" for key, count in summary.weights.items())
        held = f"Fabric checkpoint: modules {modules}"
        if not weights_only:
            held += f"; optimizers {', '.join(map(repr, summary.optimizers)) or 'none'}"
    if weights_only:
        held = f"{'the average of the weights' if args.ema else 'weights'} only ({args.format}{', ' + args.dtype if args.dtype else ''}): {held}"
    print(f"Wrote {str(args.dst)!r}: {held}, {summary.tensor_bytes / 2**20:.1f} MiB of tensors read.")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Exit status 0 when every byte checked out, 1 when something is damaged or missing, 2 when there is nothing to
    check against."""
    from ._commands._verify_command import UncheckableError, verify

    try:
        verified = verify(args.path, progress=not args.quiet)
    except UncheckableError as error:
        print(f"lightning_fsdp_resume verify: {error}", file=sys.stderr)
        return 2
    except (OSError, ValueError, ImportError) as error:
        print(f"lightning_fsdp_resume verify: error: {error}", file=sys.stderr)
        return 1
    mib = verified.bytes / 2**20
    print(f"{args.path}: whole: {verified.files} file{'s' if verified.files != 1 else ''}, {mib:.1f} MiB checked in"
          f" {verified.seconds:.2f} s ({mib / max(verified.seconds, 1e-9):.1f} MiB/s)")
    return 0


def print_status() -> int:
    """Exit status 0 when FSDP resume is usable: some flavour is patched or native."""
    import importlib.metadata

    import lightning_fsdp_resume as shim

    from ._patching._versions import import_installed_flavours

    import_installed_flavours()  # applies the patch, so the report says what a training script would get
    for dist in ("torch", "wrapt"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{dist:<18} {version}")
    usable = False
    for package, state in shim.status().items():
        print(f"{package:<18} {state.version or '-':<10} {state.mode:<14} {state.reason}")
        usable = usable or state.mode in ("patched", "native")
    print("FSDP resume is usable" if usable else "FSDP resume is NOT usable: no patched or native Lightning found")
    return 0 if usable else 1


if __name__ == "__main__":
    sys.exit(main())
