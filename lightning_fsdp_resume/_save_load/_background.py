"""Saves that finish in the background: each rank copies its part (the state at the call) to host memory and trains on
while a thread writes it; it is published, and the one it replaces removed, once every rank's part is written. The
threads agree over a gloo group of their own. Nothing here knows about patching, the Trainer or Fabric.
"""
import copy
import threading
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from .._patching import _torch_compat as compat
from .._patching._held import StrategyHeld, held, peek
from ._ranks import describe, failures


class BackgroundSaveError(RuntimeError):
    """A save that ran in the background failed on some rank; nothing of it was published."""


class _Pending:
    """One save in the background on this rank; ``failure`` (its first cause) is every rank's same verdict."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.finished = False
        self.failure: Optional[str] = None
        self.error: Optional[BaseException] = None  # this rank's own, chained to what it raises
        self.after: List[Callable[[], None]] = []
        self.thread: Optional[threading.Thread] = None


def start(strategy: Any, path: Any, write: Callable[[], Any], publish: Callable[[], None]) -> None:
    """``write`` this rank's part in a thread; once every rank's succeeded, rank 0 ``publish``es it. The thread is
    not a daemon: a process that ends while it writes waits for it. It starts writing once this call returns: a thread
    running Python holds the interpreter's lock for up to its switch interval (5 ms) at a time, which the training
    thread would otherwise wait for inside the save."""
    group = process_group(strategy)
    rank = strategy.global_rank
    pending = _Pending(path)
    begun = threading.Event()

    def run() -> None:
        begun.wait()
        yield_to_training()
        error = _attempt(write)
        try:
            failure = _first(failures(error, group))
            if failure is None:  # every rank's part is written: rank 0 publishes, and every rank learns how it went
                if rank == 0:
                    error = _attempt(publish)
                failure = _first(failures(error, group))
        except Exception as lost:  # a rank gone mid-agreement: this one cannot know, so it reports a failure
            error, failure = lost, _first({rank: lost})
        with pending.lock:
            pending.failure, pending.error, pending.finished = failure, error, True
            after = pending.after if failure is None else []
        for action in after:
            action()

    held(strategy, StrategyHeld).pending_save = pending
    pending.thread = threading.Thread(target=run, name=f"lightning_fsdp_resume: saving {path}")
    pending.thread.start()
    begun.set()


WRITER_NICENESS = 19  # the writing thread's CPU priority on Linux: the lowest


def yield_to_training() -> None:
    """This thread (a save's writer) at the lowest CPU priority, where the system gives a thread one of its own
    (Linux: each thread's nice value): on cores that training keeps busy the write takes the time training leaves
    (its waits on collectives and data), rather than an equal share of every core, and training's steps beside the
    write slow less; on idle cores it runs as fast as before. Elsewhere a priority is the whole process's, so it is
    left as it is."""
    import os
    import sys

    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except OSError:  # a sandbox that forbids it: the write runs at training's priority
            pass


def wait(strategy: Any) -> None:
    """Wait for this rank's save in the background, if any, and raise its failure (every rank raises it)."""
    kept = peek(strategy, StrategyHeld)
    if kept is None or kept.pending_save is None:
        return
    pending, kept.pending_save = kept.pending_save, None
    assert pending.thread is not None
    pending.thread.join()
    if pending.failure is not None:
        raise BackgroundSaveError(
            f"The checkpoint {str(pending.path)!r}, saved in the background, could not be written: {pending.failure}."
            " Nothing of this save was published: the path holds what it held before, and the checkpoint it"
            " was to replace was kept. Fix the cause, then save again."
        ) from pending.error


def after_publish(strategy: Any, action: Callable[[], None]) -> None:
    """Run ``action`` once the save in the background is published (now, if none is pending); never if it fails."""
    kept = peek(strategy, StrategyHeld)
    pending = None if kept is None else kept.pending_save
    if pending is not None:
        with pending.lock:
            if not pending.finished:
                pending.after.append(action)
                return
            if pending.failure is not None:
                return  # its failure is raised at the next wait
    action()


def process_group(strategy: Any) -> Any:
    """The background threads' gloo group (None without a process group), created by the first save that needs
    it: a collective, which every rank reaches at the same save."""
    if not compat.distributed():
        return None
    kept = held(strategy, StrategyHeld)
    if kept.save_group is None:
        import torch.distributed as dist

        kept.save_group = dist.new_group(backend="gloo")
    return kept.save_group


def _first(found: Dict[int, BaseException]) -> Optional[str]:
    """What every rank says of the failures ``found`` (by rank): the first; torch's own errors name the rank that
    failed."""
    if not found:
        return None
    rank, error = min(found.items(), key=lambda item: item[0])
    cause = describe(error)
    return cause if "(on rank " in cause else f"{cause} (on rank {rank})"


def _attempt(action: Callable[[], Any]) -> Optional[BaseException]:
    try:
        action()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        return error
    return None


# --- the copy a save in the background writes ---------------------------------------------------


class Live:
    """Where training's tensors keep their data (``tensors``: the module's and the optimizers'), to tell whether
    another tensor's data lies in it: a view of a flat shard, or a tensor over a slice of its storage."""

    def __init__(self, tensors: Iterable[Any]) -> None:
        self.storages: Dict[Tuple[str, int], Any] = {}
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            known = self.storages.get(key)
            if storage.nbytes() and (known is None or storage.nbytes() > known.nbytes()):
                self.storages[key] = storage
        self.starts: Dict[str, List[int]] = {}
        for device, ptr in sorted(self.storages):
            self.starts.setdefault(device, []).append(ptr)

    def holding(self, tensor: Any) -> Optional[Any]:
        """The live storage ``tensor``'s data lies in, or None."""
        import bisect

        device, ptr = str(tensor.device), tensor.untyped_storage().data_ptr()
        starts = self.starts.get(device, [])
        index = bisect.bisect_right(starts, ptr) - 1
        if index < 0:
            return None
        storage = self.storages[(device, starts[index])]
        return storage if ptr < starts[index] + storage.nbytes() else None


class Staging:
    """This rank's host buffers for what a save in the background copies of the live state, kept from one save to
    the next: copying into memory already touched costs the copy alone, where new memory first faults in every
    page. One buffer per live storage (a flat shard, an optimizer state), copied whole once per save; a tensor
    then lies in its buffer where it lay in the storage (over as exact a slice of it as the tensor had). Reused only
    once the save that wrote from it is finished (``wait``)."""

    def __init__(self) -> None:
        self.kept: Dict[Tuple[int, int, str], Any] = {}
        self.this_save: Dict[Tuple[int, int, str], Any] = {}
        # the host ShardedTensors of the last save and this one, by the ShardedTensor they copy (kept with it): a
        # save of the same views (``_shard_views`` reuses them) into the same buffers rebuilds none
        self.kept_sharded: Dict[int, Tuple[Any, Any]] = {}
        self.this_sharded: Dict[int, Tuple[Any, Any]] = {}
        self.preparing: Optional[threading.Thread] = None
        self.prepared: Set[int] = set()  # the optimizers whose tensors have buffers made (by id)

    def prepare(self, live: Live, ahead: Optional[Callable[[], Any]] = None) -> None:
        """Before the first save: a buffer for each of ``live``'s storages that has none, made and every page faulted
        in by a thread while training goes on (torch's checkpoint modules imported too), so that the first save, like
        every later one, copies into resident memory; then, where given, the state ``ahead()`` builds (what the save
        will store), its host copies laid out in those buffers (``host_copy``, which copies a buffer once a save:
        these are this save's, so nothing is copied), so that the first save, like every later one, finds the views and
        host ``ShardedTensor``s it reuses made. A thread still making the last ones is waited for by the new one, not
        here."""
        wanted = [(ptr, storage.nbytes(), device) for (device, ptr), storage in live.storages.items()]
        before = self.preparing

        def make() -> None:
            if before is not None:
                before.join()
            compat.import_background_saving()
            for key in wanted:
                if key not in self.this_save:
                    self.this_save[key] = _host_buffer(key[1], key[2], touched=True)
            if ahead is not None:
                try:
                    host_copy(ahead(), live, self)
                except Exception as unknown:  # a state the save builds otherwise (every rank decides that, then): none ahead
                    import logging

                    logging.getLogger(__name__).debug("lightning_fsdp_resume: nothing built ahead of saves: %s.", unknown)

        self.preparing = threading.Thread(target=make, name="lightning_fsdp_resume: host buffers for saves", daemon=True)
        self.preparing.start()

    def begin(self) -> None:
        """A new save: the buffers the last one used (or ``prepare`` made) are kept, any other is dropped."""
        if self.preparing is not None:
            self.preparing.join()
            self.preparing = None
        self.kept, self.this_save = self.this_save, {}
        self.kept_sharded, self.this_sharded = self.this_sharded, {}

    def copy(self, tensor: Any, base: Any) -> Any:
        """``tensor``, whose data lies in the live storage ``base``, as it is now, in host memory."""
        import torch

        key = (base.data_ptr(), base.nbytes(), str(tensor.device))
        buffer = self.this_save.get(key)
        if buffer is None:
            buffer = self.kept.get(key)
            if buffer is None:
                buffer = _host_buffer(base.nbytes(), str(tensor.device), touched=False)
            buffer.copy_(torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(base))
            self.this_save[key] = buffer
        storage = tensor.untyped_storage()
        at = storage.data_ptr() - base.data_ptr()
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(buffer.untyped_storage()[at : at + storage.nbytes()], tensor.storage_offset(), tensor.size(), tensor.stride())

    def sharded(self, tensor: Any, copies: List[Any], build: Callable[[], Any]) -> Any:
        """The host ``ShardedTensor`` of ``tensor`` whose local shards are ``copies``: the last save's where its shards
        lie where ``copies`` do, else ``build()``."""
        last = self.kept_sharded.get(id(tensor))
        if last is not None and last[0] is tensor and [shard.tensor.data_ptr() for shard in last[1].local_shards()] == [
                copied.data_ptr() for copied in copies]:
            host = last[1]
        else:
            host = build()
        self.this_sharded[id(tensor)] = (tensor, host)
        return host


def _host_buffer(nbytes: int, device: str, touched: bool) -> Any:
    """Host memory for ``nbytes`` copied from ``device``: page-locked where that is a CUDA device (torch's
    ``pin_memory``: its copies run at the link's speed), plain elsewhere; ``touched``: every page faulted in now."""
    import torch

    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    return buffer.zero_() if touched else buffer


def _staging(strategy: Any) -> Staging:
    kept = held(strategy, StrategyHeld)
    if kept.staging is None:
        kept.staging = Staging()
    return kept.staging


def staging(strategy: Any) -> Staging:
    """The strategy's ``Staging``, for the save about to copy (the last one's is finished: ``wait``)."""
    kept = _staging(strategy)
    kept.begin()
    return kept


def prepared(strategy: Any, optimizer: Any) -> bool:
    """Whether ``prepare`` ran for ``optimizer`` (after its first step): every later step asks, so nothing else is done."""
    kept = peek(strategy, StrategyHeld)
    return kept is not None and kept.staging is not None and id(optimizer) in kept.staging.prepared


def prepare(strategy: Any, optimizer: Any, tensors: Callable[[], Iterable[Any]],
            ahead: Optional[Callable[[], Any]] = None) -> None:
    """After ``optimizer``'s first step (its states exist then), once: ``Staging.prepare`` for the storages of
    ``tensors()``, what training changes of it and the module, and the state ``ahead()`` builds of them, so that no
    save, the first included, waits for new memory or builds what later saves reuse; and the threads' process group,
    so that the first save does not wait for its making either (a collective: every rank's first step comes here;
    12 ms to 0.3 s inside a first save on 2 CPU ranks)."""
    kept = _staging(strategy)
    if id(optimizer) not in kept.prepared:
        kept.prepared.add(id(optimizer))
        process_group(strategy)
        kept.prepare(Live(tensors()), ahead)


def prepare_also(strategy: Any, tensors: Callable[[], Iterable[Any]]) -> None:
    """Where saves in the background have host buffers made (``prepare``), buffers for ``tensors()`` too: state that
    comes into being after the optimizers' first steps (``ShardedEMA``'s average, at its first update)."""
    kept = peek(strategy, StrategyHeld)
    if kept is not None and kept.staging is not None:
        kept.staging.prepare(Live(tensors()))


def release(strategy: Any) -> None:
    """The host buffers of saves in the background given back (at the end of a run), once the last save is written."""
    kept = peek(strategy, StrategyHeld)
    if kept is None or kept.staging is None:
        return
    staging, kept.staging = kept.staging, None
    if staging.preparing is not None:
        staging.preparing.join()


def host_copy(obj: Any, live: Optional[Live] = None, staged: Optional[Staging] = None) -> Any:
    """``obj`` as it is now, for a save that writes it while training goes on: its accelerator tensors copied into
    host memory, its other leaves deep-copied. ``live``: where training's tensors keep their data; host tensors
    elsewhere are FSDP's own copies, which nothing changes, and are kept as they are (None: every one is copied).
    ``staged``: the tensors in ``live`` storages are copied into its kept buffers, each storage once."""
    import torch

    if isinstance(obj, dict):
        return type(obj)((key, host_copy(value, live, staged)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(host_copy(value, live, staged) for value in obj)
    if type(obj).__name__ == "ShardedTensor":
        return _sharded_host_copy(obj, live, staged)
    if isinstance(obj, torch.Tensor):
        return _host_tensor(obj, live, staged)
    return copy.deepcopy(obj)


def _host_tensor(tensor: Any, live: Optional[Live], staged: Optional[Staging]) -> Any:
    base = None if live is None else live.holding(tensor)
    if tensor.device.type == "cpu" and live is not None and base is None:
        return tensor
    if staged is not None and base is not None:
        return staged.copy(tensor.detach(), base)
    return tensor.detach().to("cpu", copy=True)


def _sharded_host_copy(tensor: Any, live: Optional[Live], staged: Optional[Staging]) -> Any:
    shards = tensor.local_shards()
    if staged is None and any(shard.tensor.device.type != "cpu" for shard in shards):
        return tensor.cpu()  # a copy, its shards' placements moved to the CPU with them
    copies = [_host_tensor(shard.tensor, live, staged) for shard in shards]
    if all(copied is shard.tensor for copied, shard in zip(copies, shards)):
        return tensor
    if staged is not None:
        return staged.sharded(tensor, copies, lambda: _host_sharded(tensor, shards, copies))
    return _host_sharded(tensor, shards, copies)


def _host_sharded(tensor: Any, shards: List[Any], copies: List[Any]) -> Any:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    metadata = tensor.metadata()
    if any(shard.tensor.device.type != "cpu" for shard in shards):  # their placements move to the host with them
        metadata = copy.copy(metadata)
        metadata.shards_metadata = [_on_host(ShardMetadata, entry) for entry in metadata.shards_metadata]
    host_shards = [Shard(copied, _on_host(ShardMetadata, shard.metadata)) for copied, shard in zip(copies, shards)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(host_shards, metadata, process_group=tensor._process_group)


def _on_host(metadata_type: Any, entry: Any) -> Any:
    return metadata_type(entry.shard_offsets, entry.shard_sizes, f"rank:{entry.placement.rank()}/cpu")
