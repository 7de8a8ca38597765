"""Methods of Lightning 2.0.x's checkpoint connector, for every strategy: the states of the run a Trainer checkpoint
carries under entries of their own (``_participants.Entry``: every rank's random states and buffers, the data position),
asked for as each checkpoint is made and handed what a Trainer call resumes from.
"""
import functools
from typing import Any, Callable, Dict

from .. import _participants
from . import _strategy


def wrap_dump_checkpoint(original: Callable) -> Callable:
    """The checkpoint as Lightning makes it, then each entry's state under its key."""

    @functools.wraps(original)
    def dump_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Dict:
        checkpoint = original(self, *args, **kwargs)
        every_rank = _strategy.patched(self.trainer.strategy)
        for entry in _participants.entries():
            state = entry.state(self.trainer, every_rank)
            if state is not None:
                checkpoint[entry.key] = state
        return checkpoint

    return dump_checkpoint


def wrap_resume_start(original: Callable) -> Callable:
    """The checkpoint a Trainer call resumes from, loaded as Lightning loads it, then handed to each entry before
    Lightning and the user's hooks read it."""

    @functools.wraps(original)
    def resume_start(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self._loaded_checkpoint:
            every_rank, where = _strategy.patched(self.trainer.strategy), f"The checkpoint {str(self._ckpt_path)!r}"
            for entry in _participants.entries():
                entry.loaded(self.trainer, self._loaded_checkpoint, where, every_rank)

    return resume_start
