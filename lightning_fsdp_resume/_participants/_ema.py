"""An exponential moving average of an FSDP model's weights kept on each rank's own shards (``Average``): one tensor
per flat parameter laid out as its local shard, so that it is updated, swapped in for evaluation, saved and read
with no gathering; beside them, an average (or copy) of each persistent buffer, which every rank holds whole and
keeps to itself, as the buffers are. ``ShardedEMA`` (``ema``) keeps one, attached to its LightningModule as a checkpoint participant
(``_participants``): the saves and loads carry it, each rank's buffers through ``_rank_states``. torch is imported inside.
"""
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .. import _participants
from .._checkpoint import _format
from .._save_load import _shard_layout, _shard_views
from .._save_load._shard_layout import FlatShard


class Average(_participants.Participant):
    """The average of one FSDP model's weights, one tensor per flat parameter (by ``id`` of the parameter) laid out as
    this rank's local shard of it, padding included. The rule is that of torch's ``AveragedModel`` with
    ``get_ema_multi_avg_fn(decay)``: the first update copies the weights, each later one moves the average a
    ``1 - decay`` part of the way to them (``lerp``). The model's persistent buffers (``persistent_buffers``): with
    ``use_buffers``, the floating ones are averaged by the same rule and the others copied; without, all copied at
    each update. Evaluation runs with them swapped in too (Lightning 2.6's ``WeightAveraging`` swaps both)."""

    key, full_key, rank_key = _format.EMA_KEY, _format.EMA_STATE_KEY, "average_buffers"

    def __init__(self, decay: float, dtype: Any = None, use_buffers: bool = True) -> None:
        self.decay = decay
        self.dtype = dtype  # None: float32
        self.use_buffers = use_buffers
        self.shards: Dict[int, Any] = {}
        self.buffers: Dict[str, Any] = {}  # by the model's names; this rank's, as the model's buffers are
        self.updates = 0  # AveragedModel's n_averaged
        self.loaded = False  # read from a checkpoint (a validate/test/predict with ckpt_path restores no counters)
        self._kept: Optional[Tuple[List[Any], Dict[str, Any]]] = None  # training weights and buffers, while swapped
        self.started_fresh: Optional[str] = None  # the checkpoint loaded last, where it held no average

    @property
    def ready(self) -> bool:
        return self.updates > 0 or self.loaded

    @property
    def swapped(self) -> bool:
        return self._kept is not None

    def twice(self, module: Any) -> str:
        return (f"Two ShardedEMA callbacks average {type(module).__name__}'s weights: a checkpoint carries one average."
                " Keep one ShardedEMA in the Trainer's callbacks.")

    def saves(self) -> bool:
        return self.ready and not self.swapped

    def live_tensors(self) -> Iterator[Any]:
        yield from self.shards.values()
        yield from self.buffers.values()

    def rank_tensors(self) -> Dict[str, Any]:
        return dict(self.buffers)

    def update(self, model: Any) -> None:
        """One update from ``model``'s (the FSDP root's) current weights, on this rank's shards."""
        import torch

        flats = flats_of(model)
        with torch.no_grad():
            averages = [self._shard(flat) for flat in flats]
            weights = [self._as_average(_shard_layout.local_shard(flat)) for flat in flats]
            for name, buffer in _shard_layout.persistent_buffers(model).items():
                if self._averages(buffer):
                    averages.append(self._buffer(name, buffer))
                    weights.append(self._as_average(buffer))
                else:
                    self._buffer(name, buffer).copy_(buffer)
            if not self.ready:
                for average, weight in zip(averages, weights):
                    average.copy_(weight)
            elif averages:
                torch._foreach_lerp_(averages, weights, 1.0 - self.decay)
        self.updates += 1

    def swap(self, model: Any) -> None:
        """Put the average into ``model``'s shards (the training weights kept aside), or the training weights back,
        bit for bit. FSDP's gathered copies are freed either side, so that the next forward computes with the shards."""
        import torch

        flats = flats_of(model)
        buffers = _shard_layout.persistent_buffers(model)
        _shard_layout.drop_gathered_copies(model)
        with torch.no_grad():
            if self._kept is None:
                self._kept = ([_shard_layout.local_shard(flat).clone() for flat in flats],
                              {name: buffers[name].clone() for name in self.buffers})
                for flat in flats:
                    _shard_layout.local_shard(flat).copy_(self._shard(flat))
                for name, average in self.buffers.items():
                    buffers[name].copy_(average)
            else:
                kept_shards, kept_buffers = self._kept
                for flat, kept in zip(flats, kept_shards):
                    _shard_layout.local_shard(flat).copy_(kept)
                for name, kept in kept_buffers.items():
                    buffers[name].copy_(kept)
                self._kept = None
        _shard_layout.drop_gathered_copies(model)

    def sharded_state(self, model: Any, prefix: str) -> Dict[str, Any]:
        """The average as a sharded state dict under the model's own parameter names (without ``prefix``, the
        wrapper's), in the weights' layout: each parameter a ``ShardedTensor`` of views of the average's shards; each
        buffer this rank's (a save keeps rank 0's, as it does the model's)."""
        state = _shard_views.state_beside(model, self.key, flats_of(model), self._shard)
        state.update((name, buffer.detach()) for name, buffer in self.buffers.items())
        return _format.strip_prefix(state, prefix)

    def full_state(self, model: Any, prefix: str, build: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
        """The average in a full state dict under the model's own names (without ``prefix``): ``build()``,
        the model's state dict as a full save gathers it, built with the average swapped into the shards (where
        ``build`` gives nothing, as a full save does on ranks other than 0, nothing)."""
        names = set(_format.strip_prefix(self.shapes(model), prefix))
        # FSDP's full state dict holds the buffers themselves, which the swap back restores: those are copied
        buffers = set(_format.strip_prefix(_shard_layout.persistent_buffers(model), prefix))
        self.swap(model)
        try:
            state = build()
            return {name: value.clone() if name in buffers else value for name, value in state.items() if name in names}
        finally:
            self.swap(model)

    def shapes(self, model: Any) -> Dict[str, Any]:
        """The full shape of every parameter and persistent buffer averaged, by ``model``'s names (the wrapper's prefix
        included)."""
        shapes = {name: shape for flat in flats_of(model) for name, shape in zip(flat.names, flat.shapes)}
        shapes.update((name, tuple(buffer.shape)) for name, buffer in _shard_layout.persistent_buffers(model).items())
        return shapes

    def read(self, model: Any, reader: Any, stored: Dict[str, str]) -> None:
        """Read the average of each parameter and buffer named in ``stored`` from the checkpoint entry it names into
        this rank's shards and buffers, through torch DCP's ``reader`` (a collective); another number of ranks is
        resharded as weights are."""
        buffers = {name: self._buffer(name, buffer) for name, buffer in _shard_layout.persistent_buffers(model).items()}
        _shard_layout.read_model_into_shards(model, reader, stored, into=self._shard, whole=buffers)
        self.loaded = True

    def copy(self, model: Any, values: Dict[str, Any]) -> None:
        """This rank's part of each full tensor ``values[name]`` (by ``model``'s names) into the average's shards, and
        each buffer's whole."""
        import torch

        _shard_layout.copy_model_into_shards(model, values, into=self._shard)
        with torch.no_grad():
            for name, buffer in _shard_layout.persistent_buffers(model).items():
                if name in values:
                    self._buffer(name, buffer).copy_(values[name])
        self.loaded = True

    def absent(self, where: str) -> None:
        """The checkpoint at ``where`` holds no average: the next update starts one from the weights."""
        self.shards.clear()
        self.buffers.clear()
        self.updates, self.loaded = 0, False
        self.started_fresh = where

    def _shard(self, flat: FlatShard) -> Any:
        import torch

        shard = self.shards.get(id(flat.param))
        if shard is None:
            local = _shard_layout.local_shard(flat)
            shard = torch.zeros(local.numel(), dtype=self.dtype or torch.float32, device=local.device)
            self.shards[id(flat.param)] = shard
        return shard

    def _buffer(self, name: str, buffer: Any) -> Any:
        """The average (or copy) of the model's ``buffer``: in the average's dtype where averaged, else the buffer's."""
        import torch

        held = self.buffers.get(name)
        if held is None:
            dtype = (self.dtype or torch.float32) if self._averages(buffer) else buffer.dtype
            held = self.buffers[name] = torch.zeros(buffer.shape, dtype=dtype, device=buffer.device)
        return held

    def _averages(self, buffer: Any) -> bool:
        return self.use_buffers and buffer.is_floating_point()

    def _as_average(self, weight: Any) -> Any:
        import torch

        return weight.detach().to(self.dtype or torch.float32)


def flats_of(model: Any) -> List[FlatShard]:
    """``model``'s flat shards, where each parameter's elements lie on one rank of the world: the layout an average
    is kept in. Otherwise refused, naming the setting."""
    try:
        return _shard_views.known(model)
    except _shard_views.UnknownLayout as unknown:
        raise ValueError(
            f"ShardedEMA keeps its average on each rank's FSDP shards, which this run's layout does not give: {unknown}."
            " Use FSDPStrategy's FULL_SHARD or SHARD_GRAD_OP sharding, or run on one rank."
        ) from None
