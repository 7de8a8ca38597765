"""Fault injection for the crash-safety tests, shared by the Trainer and Fabric workers: SIGKILL one rank at a
chosen point of a checkpoint save. The points are found in torch's writers (and the shim's publishing),
so they exist for the shim's saves and for native Lightning's alike, but for the two publish points."""
import os
import signal
import socket
import sys

HOLD_S = 30  # trace_saves: the longest a write in the background is held for its save to return


def sigkill() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def fail_write() -> None:
    """A fault that fails the write where it is, as a full disk would."""
    raise OSError(28, "No space left on device (injected by the test)")


def cut_network(control_port: int):
    """A fault that cuts the network to the S3 server (support/s3.py's relay) and returns once it is cut."""

    def cut() -> None:
        with socket.create_connection(("127.0.0.1", control_port), timeout=30) as control:
            control.recv(1)  # the relay closes it once every connection is cut

    return cut


def keep_gathered_copies() -> None:
    """Loads leave the gathered weights FSDP kept from an earlier forward in place (the shim frees them before it
    loads): what the check after every load must then refuse."""
    from lightning_fsdp_resume._save_load import _shard_layout

    _shard_layout.drop_gathered_copies = lambda model: None


def kill_during_saves(strategy, point: str, rank: int, save: int, fault=sigkill) -> None:
    """SIGKILL ``rank`` at ``point`` of the ``save``-th checkpoint save (``strategy.save_checkpoint``) of this process
    (or run another ``fault`` there, once).

    Points: ``before-shards`` (nothing written yet), ``mid-shards`` (after this rank's shard file),
    ``after-shards`` (shards done, ``meta.pt`` not written), ``before-publish`` (complete, not yet in
    place), ``after-publish`` (in place, replaced checkpoint not yet removed); ``mid-file`` for the Trainer's
    full saves, through the strategy's ``checkpoint_io`` (half of the file written). The publish points are the shim's
    atomic publishing (at a URL: writing the pointer, or copying the full file into place): native Lightning has
    none, and never reaches them.
    """
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as fs

    from lightning_fsdp_resume._patching._held import StrategyHeld, peek
    from lightning_fsdp_resume._storage import _local, _objects

    saves = [0]
    original_save = strategy.save_checkpoint

    def counting_save(*args, **kwargs):
        # a save begins by waiting for the one writing in the background: its thread joined here (its failure left
        # for the save to raise), that one's publish is counted as its own save's, not the next's, however slowly it runs
        kept = peek(strategy, StrategyHeld)
        if kept is not None and kept.pending_save is not None and kept.pending_save.thread is not None:
            kept.pending_save.thread.join()
        saves[0] += 1
        return original_save(*args, **kwargs)

    strategy.save_checkpoint = counting_save

    done = [False]

    def die(where: str) -> None:
        if where == point and strategy.global_rank == rank and saves[0] == save and not done[0]:
            done[0] = True
            fault()

    def around(owner, name, before, after):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            die(before)
            result = original(*args, **kwargs)
            die(after)
            return result

        setattr(owner, name, wrapped)

    # Every writer of shards looks these up in torch.distributed.checkpoint when it saves: the shim's, and
    # native Lightning's (save_state_dict in 2.1, save in later releases).
    for name in ("save", "save_state_dict"):  # save from torch 2.2
        if hasattr(dcp, name):
            around(dcp, name, "before-shards", "after-shards")
    around(fs.FileSystemWriter, "write_data", "", "mid-shards")
    try:  # the writer to URLs: a FileSystemWriter from torch 2.4, a writer of its own in torch 2.2
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    except ImportError:
        FsspecWriter = fs.FileSystemWriter
    if not issubclass(FsspecWriter, fs.FileSystemWriter):
        around(FsspecWriter, "write_data", "", "mid-shards")
    around(_local, "publish", "before-publish", "after-publish")
    around(_objects, "commit", "before-publish", "after-publish")
    around(_objects, "publish_file", "before-publish", "after-publish")

    if point != "mid-file":
        return
    # Fabric's FSDPStrategy has no checkpoint_io (it raises): this point is the Trainer's only.
    original_save_file = strategy.checkpoint_io.save_checkpoint

    def half_then_die(checkpoint, path, storage_options=None):
        if strategy.global_rank == rank and saves[0] == save:
            original_save_file(checkpoint, path)
            with open(path, "r+b") as handle:
                handle.truncate(os.path.getsize(path) // 2)
            die("mid-file")
        return original_save_file(checkpoint, path)

    strategy.checkpoint_io.save_checkpoint = half_then_die


def trace_saves(strategy, log, delay: float, removals: bool = True) -> None:
    """Append each step of this rank's saves to ``log``, in the order they happen, and start every write ``delay``
    seconds late (so that training goes on while a save in the background writes); a write in another thread than
    the one that called the save (in the background) is held, before it is logged, until that save has returned (at
    most ``HOLD_S``: a save that waits for its write in the background returns only after it, as does one that writes
    in the foreground). Called from the thread that saves. The steps: ``save-called NAME`` and
    ``save-returned NAME`` (the strategy's ``save_checkpoint``), ``write`` (a rank's shards or rank 0's full file),
    ``publish NAME`` (the checkpoint is in place), ``remove NAME`` (one that ModelCheckpoint no longer keeps) and
    ``host-buffer prepared`` / ``host-buffer at-save`` (host memory a save in the background copies into, made ahead
    of the saves or by one) and ``process-group made`` (a new one: the background threads')."""
    import threading
    import time
    from pathlib import Path

    import torch.distributed
    import torch.distributed.checkpoint.filesystem as fs

    from lightning_fsdp_resume._save_load import _background
    from lightning_fsdp_resume._storage import _local

    saving = threading.get_ident()  # the thread that calls the saves
    returned = threading.Semaphore(0)  # released as each save returns; a write in the background takes its save's

    def note(line: str) -> None:
        with open(log, "a") as handle:
            handle.write(line + "\n")

    def traced(owner, name, before=None, after=None, slow=False, then=None):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if slow and threading.get_ident() != saving:
                returned.acquire(timeout=HOLD_S)
            if before:
                note(before(*args, **kwargs))
            if slow:
                time.sleep(delay)
            result = original(*args, **kwargs)
            if after:
                note(after(*args, **kwargs))
            if then:
                then()
            return result

        setattr(owner, name, wrapped)

    def target(*args, **kwargs) -> str:  # the Trainer's strategy is called (checkpoint, filepath), Fabric's (path=, state=)
        return Path(kwargs["path"] if "path" in kwargs else args[1]).name

    traced(strategy, "save_checkpoint", before=lambda *a, **k: f"save-called {target(*a, **k)}",
           after=lambda *a, **k: f"save-returned {target(*a, **k)}", then=returned.release)
    traced(fs.FileSystemWriter, "write_data", before=lambda *_: "write", slow=True)
    traced(_local, "write_file", before=lambda *_: "write", slow=True)
    traced(_local, "publish", after=lambda partial, path: f"publish {Path(path).name}")
    # a host buffer a save in the background copies into: made ahead, off the training thread, or by the save itself
    traced(_background, "_host_buffer", before=lambda *_, touched: f"host-buffer {'prepared' if touched else 'at-save'}")
    traced(torch.distributed, "new_group", before=lambda *_, **__: "process-group made")
    if removals:  # the Trainer's ModelCheckpoint removes through it; Fabric's FSDPStrategy has none (it raises)
        traced(strategy.checkpoint_io, "remove_checkpoint", before=lambda path: f"remove {Path(path).name}")
