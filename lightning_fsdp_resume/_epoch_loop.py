"""A Trainer run resumed inside an epoch goes on from where it stopped, for every strategy: the batch the checkpoint
was taken after is not trained again (Lightning 2.0.x and 2.1 trained it again), and the epoch's data goes on
from the next batch (they fed the epoch's first ones again). Methods of Lightning 2.0.x's ``_TrainingEpochLoop``.
"""
import contextlib
import functools
import warnings
from typing import Any, Callable, Dict, Iterator

from . import _data_position, _rank_states, _ranks

KEY = "lightning_fsdp_resume_data_position"  # in the epoch loop's state dict: every rank's position, by rank
_START = "_lightning_fsdp_resume_epoch_start"  # this rank's random states as the epoch's iterator was made
_PENDING = "_lightning_fsdp_resume_position"  # this rank's position in the checkpoint being resumed
_END_OF_BATCH = "_lightning_fsdp_resume_end_of_batch"  # the saved batch was trained, its end was not run
_VALIDATED = "_lightning_fsdp_resume_validated"  # the validation due after it ran: the save was at its end
_STOCK_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


def _on(self: Any) -> bool:
    return _data_position.mode() != _data_position.LIGHTNING


def _loaders(self: Any) -> list:
    loader = self.trainer.fit_loop._combined_loader
    return list(loader.flattened) if loader is not None else []


def wrap_on_save_checkpoint(original: Callable) -> Callable:
    """Every rank's data position beside the loop's counters, where every rank saves (the patched FSDP strategy's
    saves are collectives); rank 0's for every rank elsewhere, whose saves rank 0 may make alone (DDP)."""

    @functools.wraps(original)
    def on_save_checkpoint(self: Any) -> Dict:
        state = original(self)
        if _on(self):
            trainer = self.trainer
            mine = _data_position.position(trainer.current_epoch, self.batch_progress.current.processed,
                                           trainer.validating and trainer.state.fn == "fit", vars(self).get(_START),
                                           _loaders(self))
            if _every_rank_saves(trainer):
                state[KEY] = _ranks.everyone(mine)
            else:
                state[KEY] = [dict(mine, every_rank=_rank_states.rank_and_world_size()[1] > 1)]
        return state

    return on_save_checkpoint


def _every_rank_saves(trainer: Any) -> bool:
    from . import _strategy

    return getattr(type(trainer.strategy), "save_checkpoint", None) is _strategy.save_checkpoint


def wrap_on_load_checkpoint(original: Callable) -> Callable:
    @functools.wraps(original)
    def on_load_checkpoint(self: Any, state_dict: Dict) -> None:
        original(self, state_dict)
        saved = state_dict.get(KEY)
        vars(self).pop(_PENDING, None)
        if not isinstance(saved, list) or not saved:
            return
        rank, world_size = _rank_states.rank_and_world_size()
        mine = saved[rank] if rank < len(saved) else saved[0]
        for_every_rank = len(saved) == 1 and mine.get("every_rank")
        # on another number of ranks, a sampler's share of the data differs: said where the epoch is resumed inside
        vars(self)[_PENDING] = dict(mine, saved_by=len(saved) if len(saved) != world_size and not for_every_rank else None)

    return on_load_checkpoint


def wrap_reset(original: Callable) -> Callable:
    """On a resume inside an epoch: a checkpoint taken after a batch was trained (``on_train_batch_end``, as
    ``ModelCheckpoint(every_n_train_steps=...)`` saves) counts that batch as done, and ``advance`` then runs only
    the rest of that batch's end (validation if due, ``_batches_that_stepped``), as the uninterrupted run did. One
    taken at the end of the validation after a batch (``ModelCheckpoint(monitor=...)``) runs that end without the
    validation, which Lightning ran again."""

    @functools.wraps(original)
    def reset(self: Any) -> None:
        if not (self.restarting and _on(self)):
            return original(self)
        batches = self.batch_progress
        trained = batches.current.processed > batches.current.completed
        if trained:
            batches.current.completed = batches.current.processed
            batches.total.completed = batches.total.processed
        _refuse_inside_accumulation(self)
        with _quiet(_STOCK_WARNING):
            original(self)
        saved = vars(self).get(_PENDING)
        validated = bool(saved and saved.get("validated")) and batches.current.completed > 0
        vars(self)[_END_OF_BATCH] = trained or validated
        vars(self)[_VALIDATED] = validated
        if saved is None and _inside_epoch(self) and self.trainer.global_rank == 0:
            warnings.warn(
                "You're resuming from a checkpoint that ended before the epoch ended and that does not say where"
                " the data was (it was not saved with lightning_fsdp_resume's mid-epoch position): this epoch's"
                " data starts again from its first batch."
            )

    return reset


def wrap_advance(original: Callable) -> Callable:
    @functools.wraps(original)
    def advance(self: Any, data_fetcher: Any) -> None:
        if vars(self).pop(_END_OF_BATCH, False):
            self.val_loop.restarting = False  # a validation due after that batch had not started: it runs anew
            return  # on_advance_end runs the end of the batch the checkpoint was taken after
        original(self, data_fetcher)

    return advance


def wrap_should_check_val_fx(original: Callable) -> Callable:
    @functools.wraps(original)
    def _should_check_val_fx(self: Any, *args: Any, **kwargs: Any) -> bool:
        if vars(self).pop(_VALIDATED, False):
            return False  # the checkpoint was saved at the end of this validation: it ran
        return original(self, *args, **kwargs)

    return _should_check_val_fx


def wrap_on_run_start(original: Callable) -> Callable:
    """The epoch's data iterator, made as the uninterrupted run made it, and on a resume inside the epoch going on
    from the batch after the checkpoint's."""

    @functools.wraps(original)
    def on_run_start(self: Any, data_fetcher: Any) -> None:
        if not _on(self):
            return original(self, data_fetcher)
        loaders = _loaders(self)
        saved = vars(self).pop(_PENDING, None)
        if saved is None or not saved.get("start") or saved["epoch"] != self.trainer.current_epoch or not self.restarting:
            if saved is not None:  # resumed at an epoch's end: the samplers' generators as the saving run left them
                _data_position.restore_generators(loaders, saved["generators"])
            vars(self)[_START] = _data_position.epoch_start(loaders)
            return original(self, data_fetcher)
        vars(self)[_START] = saved["start"]
        if saved["batches"] and saved["saved_by"] and self.trainer.global_rank == 0:
            warnings.warn(
                f"The checkpoint was taken inside epoch {saved['epoch']} by {saved['saved_by']} ranks and is resumed on"
                f" {self.trainer.world_size}: each rank leaves out the {saved['batches']} batches it would have trained"
                " first in this epoch, which on another number of ranks are not the samples the saving run trained on."
            )
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

        if _data_position.reposition(loaders, saved, create, fetch) == "batches":
            # the batches dropped count among the fetcher's own; the loop's count (batch_idx) is the one it set
            data_fetcher.fetched = fetched[0]
            length = _length(data_fetcher)
            if length is not None:
                data_fetcher.done = data_fetcher.fetched >= length

    return on_run_start


def _length(data_fetcher: Any) -> Any:
    """The number of batches the fetcher counts its ``done`` by; None where it learns it from the loader's end."""
    if hasattr(data_fetcher, "length"):  # Lightning 2.0.9
        return data_fetcher.length
    return len(data_fetcher.dataloader) if getattr(data_fetcher, "_has_len", False) else None  # 2.0.0 to 2.0.8


def _inside_epoch(self: Any) -> bool:
    done = self.batch_progress.current.completed
    return 0 < done and done != self.trainer.num_training_batches


def _refuse_inside_accumulation(self: Any) -> None:
    trainer = self.trainer
    done, every = self.batch_progress.current.completed, trainer.accumulate_grad_batches
    if every > 1 and done % every and done != trainer.num_training_batches:
        raise ValueError(
            f"The checkpoint was taken after batch {done} of epoch {trainer.current_epoch}, between two optimizer steps"
            f" of `Trainer(accumulate_grad_batches={every})`: the gradients accumulated since the last step are not in"
            " a checkpoint, so the run cannot go on exactly from it. Resume from a checkpoint taken at an optimizer"
            " step (`ModelCheckpoint(every_n_train_steps=...)` saves only there), or call"
            " `lightning_fsdp_resume.set_mid_epoch_resume('lightning')` for Lightning's own resume."
        )


@contextlib.contextmanager
def _quiet(message: str) -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=message)
        yield
