"""``ShardedEMA``: the Trainer callback that keeps an exponential moving average of an FSDP model's weights on each
rank's own shards (``_ema``), evaluates with it and checkpoints it. Importing this module imports Lightning: the
callback is a ``Callback`` of every Lightning 2.0.x flavour installed (``lightning.pytorch``, ``pytorch_lightning``).
"""
import importlib
import logging
from typing import Any, Optional, Tuple

from . import _participants
from ._lightning import _strategy
from ._participants import _ema
from ._patching._versions import FLAVOURS, TRAINER, installed_version
from ._save_load import _background


def _callback_bases() -> Tuple[type, ...]:
    """The ``Callback`` class of every installed Trainer flavour (on one the package does not patch, ``setup`` refuses)."""
    bases = [importlib.import_module(flavour.package).Callback for flavour in FLAVOURS
             if flavour.kind == TRAINER and installed_version(flavour) is not None]
    if not bases:
        raise ImportError("ShardedEMA is a Lightning Trainer callback: install Lightning 2.0.x (lightning or pytorch_lightning)")
    return tuple(bases)


class ShardedEMA(*_callback_bases()):  # type: ignore[misc]
    """An exponential moving average of the weights of a model trained with the patched ``FSDPStrategy``, kept in
    ``dtype`` (float32 by default) on each rank's own shard of every FSDP flat parameter: no gathering, and one
    shard of memory. The parameters are those of Lightning 2.6's ``EMAWeightAveraging``.

    The rule is that of torch's ``AveragedModel`` with ``get_ema_multi_avg_fn(decay)``: the first update copies the
    weights, each later one sets ``ema = ema + (1 - decay) * (weights - ema)``; an update follows every optimizer step
    whose zero-based index is a multiple of ``update_every_n_steps`` and at least ``update_starting_at_step``, and the
    end of each epoch from ``update_starting_at_epoch`` on. Validation, test and predict run with the average in
    the shards (``evaluate=False``: with the training weights), which training gets back bit for bit after them.

    The model's persistent buffers (BatchNorm's running statistics) go with the average: ``use_buffers=True`` averages
    the floating ones by the same rule (the others, such as ``num_batches_tracked``, are copied), ``use_buffers=False``
    copies them all at each update; evaluation swaps them in too. Each rank keeps its own, as FSDP keeps each rank's
    buffers, and a checkpoint every rank's.

    Sharded checkpoints carry the average beside the weights (entry ``ema``, in their layout, so it reshards), full
    ones as ``ema_state_dict`` (gathered to rank 0 as the weights are); a resume restores it exactly, and one from a
    checkpoint without it starts a new average, with a log line.
    """

    def __init__(self, decay: float = 0.999, update_every_n_steps: int = 1, update_starting_at_step: Optional[int] = None,
                 update_starting_at_epoch: Optional[int] = None, use_buffers: bool = True, dtype: Any = None,
                 evaluate: bool = True) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"ShardedEMA(decay={decay!r}): the decay is a number from 0 to 1, such as 0.999")
        if update_every_n_steps < 0:
            raise ValueError(f"ShardedEMA(update_every_n_steps={update_every_n_steps!r}): give 0 (never) or more steps")
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch
        self.use_buffers = use_buffers
        self.evaluate = evaluate
        self._average = _ema.Average(decay, dtype, use_buffers)
        self._latest_update_step = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(decay=self.decay)

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """Whether to update after optimizer step ``step_idx`` (zero-based) or at the end of epoch ``epoch_idx``."""
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        return epoch_idx is not None and self.update_starting_at_epoch is not None and epoch_idx >= self.update_starting_at_epoch

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        if not _strategy.patched(strategy):
            raise ValueError(
                f"ShardedEMA averages the shards of the FSDPStrategy this package patches; this Trainer runs"
                f" {type(strategy).__module__}.{type(strategy).__name__}, which it has not patched. Use"
                " `strategy=FSDPStrategy(...)` of Lightning 2.0.x, with lightning_fsdp_resume patching (its default)."
            )
        _participants.attach(pl_module, self._average)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        _ema.flats_of(trainer.model)  # refused here, before the first step, where the shards cannot hold an average

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        where, self._average.started_fresh = self._average.started_fresh, None
        if where is not None and trainer.global_rank == 0:
            # Lightning's own logger (its package's), which shows its INFO lines
            logging.getLogger(type(trainer).__module__.partition(".trainer")[0]).info(
                f"ShardedEMA: the checkpoint {where!r} holds no average of the weights; it starts anew at the next update."
            )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # global_step counts the optimizer steps taken: it moves once per accumulated batch
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx=trainer.global_step - 1):
            self._update(trainer)
            self._latest_update_step = trainer.global_step

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.should_update(epoch_idx=trainer.current_epoch):
            self._update(trainer)

    def _update(self, trainer: Any) -> None:
        started = not self._average.ready
        self._average.update(trainer.model)
        if started:  # a new average: host buffers for saves in the background, made before the first save needs them
            _background.prepare_also(trainer.strategy, self._average.live_tensors)

    def _evaluation_starts(self, trainer: Any, pl_module: Any) -> None:
        if self.evaluate and self._average.ready and not self._average.swapped:
            self._average.swap(trainer.model)

    def _evaluation_ends(self, trainer: Any, pl_module: Any) -> None:
        if self._average.swapped:
            self._average.swap(trainer.model)

    on_validation_start = on_test_start = on_predict_start = _evaluation_starts
    on_validation_end = on_test_end = on_predict_end = _evaluation_ends

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._evaluation_ends(trainer, pl_module)  # the training weights back in the shards, whatever stopped the run

    def state_dict(self) -> dict:
        # the average itself is a checkpoint entry of its own (the strategy's save); these say where it stands
        return {"updates": self._average.updates, "latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict) -> None:
        if self._average.loaded:  # the checkpoint held an average: its counters go with it
            self._average.updates = int(state_dict.get("updates", 0))
            self._latest_update_step = int(state_dict.get("latest_update_step", 0))
