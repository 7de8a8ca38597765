"""Sharded state dicts built from this rank's FSDP flat shards as they lie, what a sharded save writes, with no
gathering and no copy: each rank's rectangles of a parameter are views of its flat shard, in a ``ShardedTensor``.
``UnknownLayout``: FSDP's builder instead, on every rank (``agreed``). torch is imported inside the functions.
"""
import copy
from typing import Any, Callable, Dict, Hashable, List, Sequence, Tuple

from .._patching._held import ModuleHeld, held
from . import _shard_layout
from ._ranks import everyone
from ._shard_layout import FlatShard, Piece


class UnknownLayout(Exception):
    """This state is not one built here; the message says why (FSDP's own builder is used instead)."""


class _Reuse:
    """The ``ShardedTensor``s one kind of build made at the last save, for the next: the flat shards, the optimizer's
    states and an average change in place between saves, so the same views of them serve again, and a save builds
    only what is new (about 50 us a tensor, most of a later save in the background's time outside its copy). An
    entry holds views of its storage, which no other storage can share the address of while it lives; each build
    keeps only the entries it used."""

    def __init__(self, last: Dict[Hashable, Any]) -> None:
        self.last = last
        self.now: Dict[Hashable, Any] = {}

    def sharded(self, tensor: Any, shape: Tuple[int, ...], own: Sequence[Piece], rank: int, world: int) -> Any:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr(), storage.nbytes(), tensor.dtype, tensor.storage_offset(),
               tuple(tensor.size()), tensor.stride(), tuple(shape), tuple(own), rank, world)
        found = self.last.get(key)
        self.now[key] = found = _sharded(tensor, shape, own, rank, world) if found is None else found
        return found


def _reusing(model: Any, kind: Any, build: Callable[["_Reuse"], Dict[str, Any]]) -> Dict[str, Any]:
    """``build(reuse)``, with the ``ShardedTensor``s ``model``'s last build of ``kind`` made (a name, or an optimizer:
    kept while it lives)."""
    built = held(model, ModuleHeld)  # what the root module's last sharded state dicts were built of
    kept = built.optimizer_views if not isinstance(kind, str) else built.views
    reuse = _Reuse(kept.get(kind, {}))
    state = build(reuse)
    kept[kind] = reuse.now
    return state


def ahead(model: Any, optimizer: Any) -> Callable[[], List[Dict[str, Any]]]:
    """``model_state`` and ``optimizer_state`` of ``model`` and ``optimizer``, to build on another thread before the
    first save, which then finds its views made: they are only reused where a save's own build asks for the same
    view of the same storage. Their holder is made here, on the caller's thread, where the holder's other users are."""
    held(model, ModuleHeld)
    return lambda: [model_state(model), optimizer_state(model, optimizer)]


def agreed(build: Any, *args: Any) -> Dict[str, Any]:
    """``build(*args)``'s state where every rank could build it (a collective); where any rank could not, every rank
    raises ``UnknownLayout`` with the first such rank's reason: a rank that took FSDP's builder alone would wait in
    its gathers for ever."""
    try:
        state, reason = build(*args), None
    except UnknownLayout as unknown:
        state, reason = None, str(unknown)
    reasons = [found for found in everyone(reason) if found is not None]
    if reasons:
        raise UnknownLayout(reasons[0])
    assert state is not None  # built here, as no rank gave a reason
    return state


def model_state(model: Any) -> Dict[str, Any]:
    """The sharded model state dict FSDP would build for ``model`` (names without FSDP's segments), each
    parameter a ``ShardedTensor`` of views of this rank's flat shards, each persistent buffer as it is."""
    from .._checkpoint._format import clean_module_name

    flats = known(model)
    reason = _shard_layout.not_only_flat_parameters(model, flats)
    if reason is not None:
        raise UnknownLayout(reason)
    params: Dict[str, Dict[str, Any]] = {}  # by the module that owns them, in registration order within it
    views = _reusing(model, "model", lambda reuse: parameter_state(flats, _shard_layout.local_shard, reuse))
    for name, value in views.items():
        params.setdefault(name.rpartition(".")[0], {})[name] = value
    # Module.state_dict()'s order, which readers take the modules' order from: a module's parameters, then its
    # buffers, then its children's
    state: Dict[str, Any] = {}
    casts = _casts_buffers(model)
    for module_name, module in model.named_modules():
        module_name = clean_module_name(module_name)
        if casts and set(module._buffers) - set(module._non_persistent_buffers_set):
            raise UnknownLayout("FSDP's mixed precision casts buffers, which its state dict casts back")
        state.update(params.pop(module_name, {}))
        for buffer_name, buffer in module._buffers.items():
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                state[f"{module_name}.{buffer_name}" if module_name else buffer_name] = buffer.detach()
    if params:
        raise UnknownLayout(f"no module owns {', '.join(sorted(name for names in params.values() for name in names))}")
    return state


def parameter_state(flats: Sequence[FlatShard], shard_of: Callable[[FlatShard], Any], reuse: _Reuse) -> Dict[str, Any]:
    """Each original parameter of ``flats`` (``_known``'s) as a ``ShardedTensor`` of views of ``shard_of(flat)``, a 1-D
    tensor laid out as that flat parameter's local shard: the weights (the shard itself, even where the unit holds a
    gathered copy), or a state kept beside them in their layout (a checkpoint participant's, ``state_beside``)."""
    state: Dict[str, Any] = {}
    for flat in flats:
        shard = shard_of(flat).detach()
        for name, shape in zip(flat.names, flat.shapes):
            own = [piece for piece in flat.pieces if piece.name == name]
            state[name] = reuse.sharded(shard, shape, own, flat.rank, flat.world)
    return state


def state_beside(model: Any, key: str, flats: Sequence[FlatShard], shard_of: Callable[[FlatShard], Any]) -> Dict[str, Any]:
    """``parameter_state`` of the state saved under ``key``, kept in the weights' layout beside ``model``'s flat shards."""
    return _reusing(model, key, lambda reuse: parameter_state(flats, shard_of, reuse))


def optimizer_state(model: Any, optimizer: Any) -> Dict[str, Any]:
    """The sharded optimizer state dict FSDP would build (``state`` and ``param_groups`` keyed by parameter name):
    each state of a parameter's shape a ``ShardedTensor`` of views of this rank's state, each scalar (Adam's
    ``step``) as it is, from every rank that holds one (torch writes it once)."""
    flats = known(model)
    found = _shard_layout.layout(model, optimizer)
    if found is None:
        raise UnknownLayout("the optimizer holds a parameter outside FSDP's flat parameters")
    rank, world = flats[0].rank, flats[0].world

    def states(reuse: _Reuse) -> Dict[str, Any]:
        state: Dict[str, Dict[str, Any]] = {}
        for param in (param for group in found.params for param in group):
            values = optimizer.state.get(param)
            if not values:
                continue  # not stepped yet, or no element of this parameter here (use_orig_params=True)
            layout = found.shards[id(param)]
            for name in layout.names:
                own = [piece for piece in layout.pieces if piece.name == name]
                state[name] = {key: _optimizer_value(key, value, layout.numel, found.shapes[name], own, rank, world, reuse)
                               for key, value in values.items()}
        return state

    state = _reusing(model, optimizer, states)
    groups = []
    for group, names in zip(optimizer.param_groups, _shard_layout.names_by_group(found)):
        groups.append({**copy.deepcopy({key: value for key, value in group.items() if key != "params"}), "params": names})
    return {"state": state, "param_groups": groups}


def _optimizer_value(key: str, value: Any, numel: int, shape: Tuple[int, ...], own: Sequence[Piece], rank: int,
                     world: int, reuse: _Reuse) -> Any:
    import torch

    if not isinstance(value, torch.Tensor):
        raise UnknownLayout(f"the optimizer state {key!r} is not a tensor")
    if value.dim() == 0:
        return value  # the same on every rank holding the parameter, as FSDP's builder leaves it
    if value.dim() != 1 or value.numel() != numel:
        raise UnknownLayout(f"the optimizer state {key!r} is neither a scalar nor shaped as its parameter's shard")
    return reuse.sharded(value.detach(), shape, own, rank, world)


def known(model: Any) -> List[FlatShard]:
    """``model``'s flat shards where every one is laid out as this module reads (the same answer on every rank)."""
    import torch.distributed as dist

    flats = _shard_layout.flat_shards(model)
    if flats is None:
        raise UnknownLayout("FSDP's flat-parameter layout is not one this package reads (no sharded flat parameter)")
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    for flat in flats:
        if not flat.whole_shards or (flat.rank, flat.world) != (rank, world):
            raise UnknownLayout("FSDP's sharding strategy replicates shards (hybrid sharding) or shards over a subgroup")
        if any(len(shape) == 0 or 0 in shape for shape in flat.shapes):
            raise UnknownLayout("a parameter is a scalar or empty")
    return flats


def _casts_buffers(module: Any) -> bool:
    """Whether an FSDP unit of ``module`` casts buffers (``MixedPrecision(buffer_dtype=...)``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return any(getattr(getattr(unit, "mixed_precision", None), "buffer_dtype", None) is not None
               for unit in FSDP.fsdp_modules(module))


def _sharded(tensor: Any, shape: Tuple[int, ...], own: Sequence[Piece], rank: int, world: int) -> Any:
    """A ``ShardedTensor`` of ``shape`` whose local shards are views of the 1-D ``tensor`` at ``own``'s places.

    Its global layout lists those rectangles and, as another rank's, the rest of the tensor: torch checks that the
    list covers the tensor once, and DCP's save reads only the local shards, the size and the properties (its
    coordinator checks the rectangles every rank actually writes). So nothing of the other ranks is worked out or
    exchanged, and the check stays a few rectangles long on any number of ranks."""
    import math

    import torch
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = f"/{tensor.device}"
    local, layout = [], []
    for piece in own:
        for offsets, sizes, at in _shard_layout.piece_boxes(shape, piece):
            metadata = ShardMetadata(list(offsets), list(sizes), f"rank:{rank}{device}")
            local.append(Shard(_exactly(tensor, at, sizes), metadata))
            layout.append(metadata)
    other, end, held = f"rank:{(rank + 1) % world}{device}", math.prod(shape), 0
    for start, stop in [(piece.start, piece.stop) for piece in sorted(own, key=lambda piece: piece.start)] + [(end, end)]:
        layout += [ShardMetadata(list(offsets), list(sizes), other) for offsets, sizes in _shard_layout.boxes(shape, held, start)]
        held = stop
    properties = TensorProperties(dtype=tensor.dtype, layout=torch.strided, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    metadata = ShardedTensorMetadata(shards_metadata=layout, size=torch.Size(shape), tensor_properties=properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata)


def _exactly(tensor: Any, at: int, sizes: Sequence[int]) -> Any:
    """Elements ``[at, at + numel)`` of the contiguous 1-D ``tensor``, shaped ``sizes``, over a slice of its storage
    that holds exactly them: torch's writer copies a view of a larger storage before writing it (``torch.save``
    would write the whole storage), and would copy the whole shard, item by item, at every save."""
    import math

    import torch

    numel = math.prod(sizes)
    if not tensor.is_contiguous():
        return tensor[at : at + numel].view(sizes)
    size, start = tensor.element_size(), tensor.storage_offset() + at
    exact = tensor.untyped_storage()[start * size : (start + numel) * size]
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(exact).view(sizes)
