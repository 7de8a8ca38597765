"""A Trainer run resumed inside an epoch, or inside a validation, goes on from where it stopped, for every strategy and
on any number of ranks: methods of Lightning 2.0.x's ``_TrainingEpochLoop``, and every rank's data position and the
run's data cursor as a checkpoint entry of their own (``DataPosition``, a ``_participants.Entry``)."""
import contextlib
import functools
import logging
import warnings
from typing import Any, Callable, Dict, Iterator, Optional

from .. import _participants
from .._patching._held import LoopHeld, held
from .._save_load import _ranks
from . import _data_cursor, _data_position

log = logging.getLogger(__name__)
ENTRY = "data_position"  # the checkpoint's entry: every rank's position and the run's data cursor
_LEGACY = "lightning_fsdp_resume_data_position"  # where earlier releases kept the positions: in the loop's state
_STOCK_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"
END, INSIDE = "end", "inside"  # where a save made during a validation was made: at its end, or inside it


def _state(loop: Any) -> LoopHeld:
    return held(loop, LoopHeld)


def _on(self: Any = None) -> bool:
    """Whether this package places the data (else Lightning's own resume runs): by ``set_mid_epoch_resume``, and for
    one epoch resumed where nothing can go on exactly."""
    return _data_position.mode() != _data_position.LIGHTNING and not (self is not None and _state(self).stock)


def _loaders(self: Any) -> list:
    loader = self.trainer.fit_loop._combined_loader
    return list(loader.flattened) if loader is not None else []


class DataPosition(_participants.Entry):
    """The checkpoint's entry ``data_position``, beside Lightning's own (whose loop state stays as Lightning writes
    it), for every strategy: every rank's position where every rank saves (``ours``: the package's FSDP strategy's
    saves are collectives), rank 0's for every rank elsewhere (DDP, whose saves rank 0 may make alone), and the run's
    data cursor. A fit resumed from a checkpoint hands this rank's position to the epoch loop (``on_run_start``): the
    entry's, or an earlier release's positions inside the loop's state."""

    key = ENTRY

    def state(self, trainer: Any, ours: bool) -> Optional[Dict[str, Any]]:
        return _entry(trainer, ours) if _on() else None

    def loaded(self, trainer: Any, checkpoint: Dict[str, Any], where: str, ours: bool) -> None:
        if trainer.state.fn == "fit":
            entry = checkpoint.get(ENTRY) or _legacy_entry(checkpoint)
            _state(trainer.fit_loop.epoch_loop).pending = _mine(entry) if isinstance(entry, dict) and entry.get("positions") else None


_participants.register(DataPosition())


def _entry(trainer: Any, every_rank_saves: bool) -> Dict[str, Any]:
    loop = trainer.fit_loop.epoch_loop
    batches = loop.batch_progress.current.processed
    validation = None
    if trainer.validating and trainer.state.fn == "fit":
        validation = END if _validation_finished(loop.val_loop) else INSIDE
    loaders = _loaders(loop)
    mine = _data_position.position(trainer.current_epoch, batches, validation, _state(loop).start, loaders)
    world_size = _ranks.rank_and_world_size()[1]
    found = _data_cursor.identity(loaders[0]) if len(loaders) == 1 else None
    segment = _state(loop).segment or _data_cursor.first_segment(world_size)
    return {
        "world_size": world_size,
        "positions": _ranks.everyone(mine) if every_rank_saves else [mine],
        "cursor": _data_cursor.cursor(found, segment, batches) if found else None,
    }


def _validation_finished(val_loop: Any) -> bool:
    """Whether the validation running now has run all its batches (a save at its end: ``ModelCheckpoint(monitor=...)``
    in ``on_validation_end``), rather than being inside them (a failure, a signal, a save from a step)."""
    progress = val_loop.batch_progress
    if progress.current.ready != progress.current.completed:
        return False
    total = sum(val_loop.max_batches)
    return progress.is_last_batch or progress.current.completed >= total


def _legacy_entry(loaded: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    loop = loaded.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict", {})
    positions = loop.get(_LEGACY) if isinstance(loop, dict) else None
    if not isinstance(positions, list) or not positions:
        return None
    every_rank = len(positions) == 1 and positions[0].get("every_rank")
    world_size = _ranks.rank_and_world_size()[1] if every_rank else len(positions)
    for position in positions:
        position.setdefault("validation", END if position.get("validated") else None)
    return {"world_size": world_size, "positions": positions, "cursor": None}


def _mine(entry: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's saved position (rank 0's where it saved alone, or where this rank did not exist), with the run's
    cursor and the number of ranks that saved it."""
    rank = _ranks.rank_and_world_size()[0]
    positions = entry["positions"]
    mine = positions[rank] if rank < len(positions) else positions[0]
    return dict(mine, cursor=entry.get("cursor"), saved_by=entry["world_size"])


def wrap_reset(original: Callable) -> Callable:
    """On a resume inside an epoch: a checkpoint taken after a batch was trained (``on_train_batch_end``, as
    ``ModelCheckpoint(every_n_train_steps=...)`` saves) counts that batch as done, and ``advance`` then runs only
    the rest of that batch's end (validation if due, ``_batches_that_stepped``), as the uninterrupted run did. One
    taken at the end of the validation after a batch (``ModelCheckpoint(monitor=...)``) runs that end without the
    validation, which Lightning ran again; one taken inside that validation (a failure, a signal) finishes it."""

    @functools.wraps(original)
    def reset(self: Any) -> None:
        if not (self.restarting and _on(self)):
            return original(self)
        state = _state(self)
        batches = self.batch_progress
        trained = batches.current.processed > batches.current.completed
        if _between_accumulation_steps(self, max(batches.current.processed, batches.current.completed)):
            state.stock, state.pending, state.end_of_batch, state.validation = True, None, False, None
            return original(self)  # Lightning's own resume: that batch is trained again
        if trained:
            batches.current.completed = batches.current.processed
            batches.total.completed = batches.total.processed
        with _quiet(_STOCK_WARNING):
            original(self)
        saved = state.pending
        where = saved.get("validation") if saved and batches.current.completed > 0 else None
        if where == INSIDE:
            _validate_again(self.val_loop.batch_progress)
        state.end_of_batch = trained or where is not None
        state.validation = {END: False, INSIDE: True}.get(where)  # type: ignore[arg-type]
        if saved is None and _inside_epoch(self) and self.trainer.global_rank == 0:
            warnings.warn(
                "You're resuming from a checkpoint that ended before the epoch ended and that does not say where"
                " the data was (it was not saved with lightning_fsdp_resume's mid-epoch position): this epoch's"
                " data starts again from its first batch."
            )

    return reset


def _validate_again(progress: Any) -> None:
    """A validation interrupted inside its batches runs again from its first, and its completed batches count once:
    its metrics (epoch means, what ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` read) are then the
    uninterrupted run's, which those batches' logged values, not in any checkpoint, could not be otherwise."""
    done = progress.current.completed
    for counter in ("ready", "started", "processed", "completed"):
        setattr(progress.total, counter, getattr(progress.total, counter) - done)
        setattr(progress.current, counter, 0)


def wrap_advance(original: Callable) -> Callable:
    @functools.wraps(original)
    def advance(self: Any, data_fetcher: Any) -> None:
        state = _state(self)
        if state.end_of_batch:
            state.end_of_batch = False
            if not state.validation:
                self.val_loop.restarting = False  # a validation due after that batch had not started: it runs anew
            return  # on_advance_end runs the end of the batch the checkpoint was taken after
        original(self, data_fetcher)

    return advance


def wrap_should_check_val_fx(original: Callable) -> Callable:
    @functools.wraps(original)
    def _should_check_val_fx(self: Any, *args: Any, **kwargs: Any) -> bool:
        state = _state(self)
        if state.validation is not None:
            # saved inside this validation: it goes on (Lightning's val loop restarts); saved at its end: it ran
            decided, state.validation = state.validation, None
            return decided
        return original(self, *args, **kwargs)

    return _should_check_val_fx


def wrap_on_advance_end(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_advance_end(self: Any) -> None:
        original(self)
        state = _state(self)
        if state.rng_after_validation is not None:
            _ranks.set_rng_state(state.rng_after_validation)
            state.rng_after_validation = None

    return on_advance_end


def wrap_run(original: Callable) -> Callable:
    """The epoch's length and validation interval as Lightning set them for the next epoch, where a resume on another
    number of ranks changed them for this one."""

    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            return original(self, *args, **kwargs)
        finally:
            state = _state(self)
            state.stock = False
            if state.put_back is not None:
                self.trainer.fit_loop.max_batches, self.trainer.val_check_batch = state.put_back
                state.put_back = None

    return run


def wrap_on_run_start(original: Callable) -> Callable:
    """The epoch's data iterator, made as the uninterrupted run made it, and on a resume inside the epoch going on
    from the batch after the checkpoint's: on the number of ranks that saved it by the rank's own position, on
    another from the run's data cursor."""

    @functools.wraps(original)
    def on_run_start(self: Any, data_fetcher: Any) -> None:
        if not _on(self):
            return original(self, data_fetcher)
        state = _state(self)
        loaders = _loaders(self)
        saved, state.pending = state.pending, None
        world_size = self.trainer.world_size
        if saved is not None and saved.get("validation") == INSIDE and self.restarting:
            # saved inside a validation, after its data iterator drew a random number, which running it again draws
            # again: the states restored now are the ones the uninterrupted run went on with after it
            state.rng_after_validation = _ranks.rng_state()
        if saved is None or not saved.get("start") or saved["epoch"] != self.trainer.current_epoch or not self.restarting:
            if saved is not None:  # resumed at an epoch's end: the samplers' generators as the saving run left them
                _data_position.restore_generators(loaders, saved["generators"])
            state.start = _data_position.epoch_start(loaders)
            state.segment = None
            return original(self, data_fetcher)
        cursor = saved.get("cursor")
        segment = cursor["segment"] if cursor else None
        if saved["saved_by"] != world_size and self.batch_progress.is_last_batch:
            state.start, state.segment = _data_position.epoch_start(loaders), None
            return original(self, data_fetcher)  # saved after the epoch's last batch: it has nothing left to place
        if segment is not None and (segment["ranks"] != world_size or segment["start"]):
            return _resume_from_cursor(self, original, data_fetcher, loaders, saved)
        state.segment = segment
        state.start = saved["start"]
        if saved["saved_by"] != world_size and saved["batches"]:
            _refuse_or_approximate(self, loaders, saved)
        if saved["batches"] == 0:
            _data_position.restore_generators(loaders, saved["start"]["generators"])
            return original(self, data_fetcher)
        fetched = []

        def create() -> None:
            original(self, data_fetcher)
            fetched.append(data_fetcher.fetched)  # the loop's count of the epoch's batches, which it added
            data_fetcher.fetched -= self.batch_progress.current.ready  # the fetcher's own, which ends a sized epoch

        def fetch() -> None:
            # a training_step taking `dataloader_iter` is handed a wrapper, which fetches when asked
            next(getattr(data_fetcher, "iterator_wrapper", data_fetcher))

        _data_position.reposition(loaders, saved, create, fetch)
        # the batches left out count among the fetcher's own, by which a sized epoch ends (is_last_batch)
        data_fetcher.fetched = fetched[0]
        length = _length(data_fetcher)
        if length is not None:
            data_fetcher.done = data_fetcher.fetched >= length

    return on_run_start


def _resume_from_cursor(self: Any, original: Callable, data_fetcher: Any, loaders: list, saved: Dict[str, Any]) -> None:
    """The rest of the saved epoch from the run's data cursor: this rank's share of the samples not trained, on this
    number of ranks; the epoch ends when every rank has trained its share (all take the same number of steps)."""
    trainer, state = self.trainer, _state(self)
    cursor, batches = saved["cursor"], saved["batches"]
    problem: Optional[str] = f"there are {len(loaders)} train dataloaders"
    name = "several"
    if len(loaders) == 1:
        problem, name = _data_cursor.mismatch(cursor, _data_cursor.identity(loaders[0])), type(loaders[0]).__name__
    if problem:
        raise ValueError(
            f"The checkpoint was taken inside epoch {saved['epoch']} by {saved['saved_by']} ranks, whose place in the"
            f" data is kept as a position in the epoch's order, and is resumed on {trainer.world_size} ranks, but the"
            f" train dataloader ({name}) cannot be placed there: {problem}. Resume with the data the run was trained on."
        )
    loader = loaders[0]
    rank = trainer.global_rank
    placed = _data_cursor.place(cursor, rank, trainer.world_size, batches)
    state.segment, state.start = placed.segment, _data_position.epoch_start(loaders)
    more = _data_cursor.batches_in(len(placed.indices), loader.batch_size, loader.drop_last)
    with _data_cursor.feeding(loader, placed.indices):
        original(self, data_fetcher)
    _end_epoch_after(self, data_fetcher, batches, more)
    if rank == 0:
        log.info(
            "Resumed inside epoch %d on %d ranks from a checkpoint of %d: %d of its %d samples trained, each rank"
            " trains %d batches of the rest.", saved["epoch"], trainer.world_size, cursor["segment"]["ranks"],
            cursor["trained"], cursor["size"], more)


def _end_epoch_after(self: Any, data_fetcher: Any, done: int, more: int) -> None:
    """The resumed epoch ends after ``more`` batches beyond the ``done`` ones: the loop's length and, where it is a
    fraction of the epoch, the validation interval set for this epoch (``run`` puts them back), and the fetcher's
    end."""
    trainer, fit_loop = self.trainer, self.trainer.fit_loop
    _state(self).put_back = (fit_loop.max_batches, trainer.val_check_batch)
    length = done + more
    if fit_loop.max_batches < len(_loaders(self)[0]):  # limit_train_batches: the epoch ends there still
        length = min(length, fit_loop.max_batches)
    fit_loop.max_batches = length
    if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch != float("inf"):
        trainer.val_check_batch = max(1, int(length * trainer.val_check_interval))
    more = max(0, length - done)
    if hasattr(data_fetcher, "length"):  # Lightning 2.0.9: a sized epoch ends when `fetched` reaches `length`
        data_fetcher.length = length
        data_fetcher.fetched = done
    else:  # 2.0.0 to 2.0.8: when it reaches the loader's length
        data_fetcher.fetched = _length(data_fetcher) - more
    data_fetcher.done = more == 0


def _refuse_or_approximate(self: Any, loaders: list, saved: Dict[str, Any]) -> None:
    """A checkpoint taken inside an epoch by another number of ranks whose data has no cursor: refused, unless the
    user asked for an approximate resume, which says what it does."""
    trainer = self.trainer
    described = ", ".join(type(loader).__name__ for loader in loaders) or "none"
    if not _data_position.approximate():
        raise ValueError(
            f"The checkpoint was taken inside epoch {saved['epoch']} (after batch {saved['batches']}) by"
            f" {saved['saved_by']} ranks and is resumed on {trainer.world_size}, but its train dataloader ({described})"
            " cannot be placed exactly on another number of ranks: only one DataLoader over a map-style dataset drawn"
            " by a DistributedSampler can. Resume on the same number of ranks, or call"
            " `lightning_fsdp_resume.set_mid_epoch_resume(..., other_rank_counts='approximate')` to go on with each rank"
            " leaving out the batches it would have trained first."
        )
    if trainer.global_rank == 0:
        warnings.warn(
            f"The checkpoint was taken inside epoch {saved['epoch']} by {saved['saved_by']} ranks and is resumed on"
            f" {trainer.world_size} (other_rank_counts='approximate'): each rank leaves out the {saved['batches']}"
            " batches it would have trained first in this epoch, which on another number of ranks are not the samples"
            " the saving run trained on."
        )


def _length(data_fetcher: Any) -> Any:
    """The number of batches the fetcher counts its ``done`` by; None where it learns it from the loader's end."""
    if hasattr(data_fetcher, "length"):  # Lightning 2.0.9
        return data_fetcher.length
    return len(data_fetcher.dataloader) if getattr(data_fetcher, "_has_len", False) else None  # 2.0.0 to 2.0.8


def _inside_epoch(self: Any) -> bool:
    done = self.batch_progress.current.completed
    return 0 < done and done != self.trainer.num_training_batches


def _between_accumulation_steps(self: Any, done: int) -> bool:
    """Saved after ``done`` batches, between two optimizer steps of ``accumulate_grad_batches``: the gradients
    accumulated since the last step are in no checkpoint, so no resume goes on exactly from it; Lightning's own resume
    runs it, and rank 0 says so."""
    trainer = self.trainer
    every = trainer.accumulate_grad_batches
    if not (every > 1 and done % every and done != trainer.num_training_batches):
        return False
    if trainer.global_rank == 0:
        warnings.warn(
            f"The checkpoint was taken after batch {done} of epoch {trainer.current_epoch}, between two optimizer steps"
            f" of `Trainer(accumulate_grad_batches={every})`: the gradients accumulated since the last step are not in"
            " a checkpoint, so the run cannot go on exactly from it; this epoch resumes as Lightning resumes it (its"
            " data from the first batch). Resume from a checkpoint taken at an optimizer step"
            " (`ModelCheckpoint(every_n_train_steps=...)` saves only there) to go on exactly."
        )
    return True


@contextlib.contextmanager
def _quiet(message: str) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message)
        yield
