"""Weights and optimizer states read straight into this rank's FSDP flat shards, with no template and no gathering, from
FSDP1's flat-parameter attributes (``layout()`` None: torch's loaders instead); and the gathered copies FSDP keeps
between forwards, freed before a load and checked after it. torch is imported inside the functions.
"""
import math
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from .._patching import _torch_compat as compat

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # offsets and sizes in a parameter's full shape


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of the flattened original parameter ``name`` sit at ``at`` in the shard."""

    name: str
    start: int
    stop: int
    at: int


class ShardLayout(NamedTuple):
    """One optimizer parameter on this rank: its local size and which original elements it holds.

    With ``use_orig_params=True`` that is one original parameter (``pieces`` empty where this rank holds
    none of it); otherwise a flat parameter, and ``names`` lists every original parameter in it.
    """

    numel: int
    names: Tuple[str, ...]
    pieces: Tuple[Piece, ...]


class FlatShard(NamedTuple):
    """One FSDP flat parameter on this rank, and the original parameters flattened into it."""

    param: Any
    names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    pieces: Tuple[Piece, ...]
    originals: Optional[List[Any]]  # use_orig_params=True: the original parameters, as ``names``
    shared: bool  # some original parameter appears under a second name (tied weights)
    rank: int  # this rank, and how many share the flat parameter, in FSDP's process group
    world: int
    whole_shards: bool  # each element on exactly one rank of that group (FULL_SHARD, SHARD_GRAD_OP; one rank's NO_SHARD)


class Layout(NamedTuple):
    params: List[List[Any]]  # the optimizer's parameters, by group
    shards: Dict[int, ShardLayout]  # by id() of the parameter
    shapes: Dict[str, Tuple[int, ...]]  # every original parameter's full shape, by name


def _handles(model: Any) -> Iterator[Tuple[str, Any]]:
    """Every FSDP unit of ``model`` that holds a flat parameter: its name and its handle (torch 2.0: the first of
    its ``_handles``, the one a unit has)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit_name, unit in model.named_modules():
        if not isinstance(unit, FSDP):
            continue
        handle = getattr(unit, "_handle", None) or next(iter(getattr(unit, "_handles", None) or ()), None)
        if handle is not None:
            yield unit_name, handle


def flat_shards(model: Any) -> Optional[List[FlatShard]]:
    """Every flat parameter of ``model`` with what this rank holds of it; None if FSDP's layout is not one
    this module knows (the answer is the same on every rank, so all of them take the same path). On one rank FSDP
    shards nothing (``NO_SHARD``): the flat parameter is that rank's one shard, with the same metadata."""
    from .._checkpoint._format import clean_module_name

    found = []
    for unit_name, handle in _handles(model):
        flat = handle.flat_param
        infos = getattr(flat, "_shard_param_infos", None)
        alone = handle.world_size == 1
        if not (handle.uses_sharded_strategy or alone) or infos is None or len(infos) != len(flat._fqns):
            return None
        names = tuple(clean_module_name(f"{unit_name}.{fqn}" if unit_name else fqn) for fqn in flat._fqns)
        pieces = tuple(
            Piece(name, info.intra_param_start_idx, info.intra_param_end_idx + 1, info.offset_in_shard)
            for name, info in zip(names, infos)
            if info.in_shard and info.numel_in_shard
        )
        originals = None
        if handle._use_orig_params:
            originals = flat._params
            if originals is None or len(originals) != len(names):
                return None
        shapes = tuple(tuple(shape) for shape in flat._shapes)
        strategy = getattr(getattr(handle, "_sharding_strategy", None), "name", "")
        found.append(FlatShard(flat, names, shapes, pieces, originals, bool(flat._shared_param_infos), handle.rank,
                               handle.world_size, alone or strategy in ("FULL_SHARD", "SHARD_GRAD_OP")))
    return found or None


def local_shard(flat: FlatShard) -> Any:
    """This rank's shard of ``flat``'s parameter, even where the unit holds a gathered copy; before FSDP's first forward
    (which makes ``_local_shard``) the parameter is its shard."""
    shard = getattr(flat.param, "_local_shard", None)
    return flat.param.data if shard is None else shard


def layout(model: Any, optimizer: Any) -> Optional[Layout]:
    """Where this rank's shard of each of ``optimizer``'s parameters lies; None as for ``flat_shards``."""
    flats = flat_shards(model)
    if flats is None:
        return None
    shards: Dict[int, ShardLayout] = {}
    shapes: Dict[str, Tuple[int, ...]] = {}
    for flat in flats:
        shapes.update(zip(flat.names, flat.shapes))
        # sizes from the layout, not from the parameters: a unit that keeps a gathered copy has them gathered
        if flat.originals is None:
            shards[id(flat.param)] = ShardLayout(flat.param._sharded_size.numel(), flat.names, flat.pieces)
            continue
        for param, name in zip(flat.originals, flat.names):
            own = tuple(piece._replace(at=0) for piece in flat.pieces if piece.name == name)
            shards[id(param)] = ShardLayout(sum(piece.stop - piece.start for piece in own), (name,), own)
    params = [list(group["params"]) for group in optimizer.param_groups]
    if any(id(param) not in shards for group in params for param in group):
        return None
    return Layout(params, shards, shapes)


def parameter_shapes(model: Any) -> Optional[Dict[str, Tuple[int, ...]]]:
    """The model's state-dict entries and their full shapes, when every entry is a parameter sharded by
    FSDP (no buffers, no extra state, no tied or unsharded parameters); None otherwise."""
    flats = flat_shards(model)
    if flats is None or not_only_flat_parameters(model, flats) is not None:
        return None
    if persistent_buffers(model):
        return None
    return {name: shape for flat in flats for name, shape in zip(flat.names, flat.shapes)}


def persistent_buffers(model: Any) -> Dict[str, Any]:
    """``model``'s buffers that its state dict holds (not those registered ``persistent=False``), by the names FSDP
    gives them in state dicts (``_format.clean_module_name``'s)."""
    from .._checkpoint._format import clean_module_name

    return {
        clean_module_name(f"{module_name}.{name}" if module_name else name): buffer
        for module_name, module in model.named_modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    }


def not_only_flat_parameters(model: Any, flats: List[FlatShard]) -> Optional[str]:
    """Why ``model``'s state is not only the original parameters in ``flats``, buffers aside, or None: a tied weight,
    a parameter outside FSDP's flat parameters, a module with extra state."""
    from torch import nn

    if any(flat.shared for flat in flats):
        return "a parameter is shared by two modules (tied weights)"
    covered = {id(flat.param) for flat in flats} | {id(p) for flat in flats for p in flat.originals or ()}
    if any(id(param) not in covered for param in model.parameters()):
        return "a parameter is outside FSDP's flat parameters"
    for name, module in model.named_modules():
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            from .._checkpoint._format import clean_module_name

            return f"module {clean_module_name(name)!r} has extra state"
    return None


def _known_flat_shards(model: Any) -> List[FlatShard]:
    """``flat_shards`` of a model whose layout ``parameter_shapes`` accepted (the loaders below need it)."""
    flats = flat_shards(model)
    if flats is None:
        raise RuntimeError(
            "FSDP's parameter layout is not one this module reads: load through torch's state-dict API where"
            " parameter_shapes() returns None."
        )
    return flats


def copy_model_into_shards(model: Any, values: Dict[str, Any], into: Optional[Callable[[FlatShard], Any]] = None) -> None:
    """Copy this rank's part of each full tensor ``values[name]`` into the flat parameters' local shards (``into``:
    as ``read_model_into_shards``)."""
    import torch

    with torch.no_grad():
        for flat in _known_flat_shards(model):
            target = flat.param.data if into is None else into(flat)
            for piece in flat.pieces:
                if piece.name in values:
                    copy_piece(values[piece.name], target, piece)


def read_model_into_shards(model: Any, reader: Any, stored: Dict[str, str],
                           into: Optional[Callable[[FlatShard], Any]] = None, whole: Optional[Dict[str, Any]] = None) -> None:
    """Read, for each original parameter name in ``stored``, this rank's part of the checkpoint entry
    ``stored[name]`` straight into the flat parameters' local shards, through torch DCP's storage ``reader`` (a
    collective). ``into(flat)``: a 1-D tensor laid out as ``flat``'s local shard to read into instead (an average
    kept beside the weights, ``_ema``). ``whole``: tensors, by names in ``stored``, read whole in the same load."""
    import torch

    views = ViewsReader()
    for name, tensor in (whole or {}).items():
        if name in stored:
            views.add(stored[name], (0,) * tensor.dim(), tensor)
    for flat in _known_flat_shards(model):
        shapes = dict(zip(flat.names, flat.shapes))
        target = flat.param.data if into is None else into(flat)
        for piece in flat.pieces:
            if piece.name in stored:
                views.add_piece(stored[piece.name], shapes[piece.name], target, piece)
    with torch.no_grad():
        views.read(reader)


def _gathered_copy(handle: Any) -> Optional[Any]:
    """The unit's gathered (unsharded) flat parameter where FSDP keeps it allocated between forwards, else None.

    A unit that does not reshard after its forward keeps the copy until its backward: the root unit always, every
    unit with ``SHARD_GRAD_OP``. Evaluation has no backward, so after ``validate``, ``test`` or a forward under
    ``no_grad`` the copy stays, and the next forward computes with it instead of gathering the shards again."""
    if not handle.uses_sharded_strategy:
        return None  # NO_SHARD: the flat parameter is whole and is what a load writes
    padded = getattr(handle.flat_param, "_full_param_padded", None)  # made by FSDP's first forward
    return padded if padded is not None and padded.untyped_storage().size() > 0 else None


def drop_gathered_copies(model: Any) -> None:
    """Free every gathered copy ``_gathered_copy`` finds in ``model``, so that its next forward gathers the shards:
    a load writes the shards, and a copy kept from an earlier forward would run the old weights."""
    for _, handle in _handles(model):
        if _gathered_copy(handle) is not None:
            handle.reshard(True)  # to the shard, then free the copy: what FSDP does after a backward


def units_off_their_shards(model: Any) -> List[str]:
    """The FSDP units of ``model`` whose next forward would not compute with this rank's shards: a gathered copy is
    kept whose part for this rank differs from the shard (in the copy's dtype, mixed precision's). Unit names
    without wrapper segments; the root's is ``""``."""
    import torch

    from .._checkpoint._format import clean_module_name

    stale = []
    for unit_name, handle in _handles(model):
        padded, shard = _gathered_copy(handle), getattr(handle.flat_param, "_local_shard", None)
        if padded is None or shard is None:
            continue
        own = padded[handle.rank * shard.numel() : (handle.rank + 1) * shard.numel()]
        if not torch.equal(own, shard.to(device=own.device, dtype=own.dtype)):
            stale.append(clean_module_name(unit_name))
    return stale


def names_by_group(found: Layout) -> List[List[str]]:
    """The original parameter names of each group's parameters, in the optimizer's order."""
    return [[name for param in group for name in found.shards[id(param)].names] for group in found.params]


def boxes(shape: Sequence[int], start: int, stop: int) -> List[Box]:
    """Rectangles of a row-major tensor of ``shape`` that together hold flat elements ``[start, stop)``, in order."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    row = math.prod(shape[1:])
    whole_from = -(-start // row) * row  # the first row boundary at or after start
    whole_to = stop // row * row

    def within(index: int, begin: int, end: int) -> List[Box]:
        return [((index,) + at, (1,) + size) for at, size in boxes(shape[1:], begin, end)]

    if whole_from > whole_to:  # inside one row
        index = start // row
        return within(index, start - index * row, stop - index * row)
    found: List[Box] = []
    if start < whole_from:
        found += within(start // row, start % row, row)
    if whole_from < whole_to:
        found.append(((whole_from // row,) + (0,) * (len(shape) - 1), ((whole_to - whole_from) // row,) + tuple(shape[1:])))
    if whole_to < stop:
        found += within(whole_to // row, 0, stop - whole_to)
    return found


def piece_boxes(shape: Sequence[int], piece: Piece) -> Iterator[Tuple[Tuple[int, ...], Tuple[int, ...], int]]:
    """``boxes`` of ``piece`` of a parameter of ``shape``, each with where its elements start in the rank's 1-D
    tensor (``piece.at`` onwards)."""
    at = piece.at
    for offsets, sizes in boxes(shape, piece.start, piece.stop):
        yield offsets, sizes, at
        at += math.prod(sizes)


class CheckpointSource:
    """States from a sharded checkpoint: each piece is read by ``torch.distributed.checkpoint`` into a view
    of the state it belongs to, in ``finish()`` (a collective: every rank calls it)."""

    def __init__(self, reader: Any, key: str, metadata: Any, shapes: Dict[str, Tuple[int, ...]], stored: Callable[[str], str]) -> None:
        self.reader = reader
        self.metadata = metadata.state_dict_metadata
        self.shapes = shapes
        self.stored = stored
        self.prefix = f"{key}.state."
        self.names: Dict[str, List[str]] = {}
        for entry in self.metadata:
            if entry.startswith(self.prefix):
                name, _, state_name = entry[len(self.prefix) :].rpartition(".")
                self.names.setdefault(name, []).append(state_name)
        self.views = ViewsReader()

    def readable(self) -> bool:
        """Whether every saved state is a tensor of its parameter's shape or a scalar tensor: what this reads.
        Decided from the checkpoint's index and the model alone, so it is the same on every rank."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        stored_shapes = {self.stored(name): shape for name, shape in self.shapes.items()}
        for name, state_names in self.names.items():
            for state_name in state_names:
                entry = self.metadata[f"{self.prefix}{name}.{state_name}"]
                if not isinstance(entry, TensorStorageMetadata) or name not in stored_shapes:
                    return False
                if tuple(entry.size) not in ((), stored_shapes[name]):
                    return False
        return True

    def _entry(self, name: str, state_name: str) -> Any:
        return self.metadata[f"{self.prefix}{self.stored(name)}.{state_name}"]

    def state_names(self, name: str) -> List[str]:
        return list(self.names.get(self.stored(name), []))

    def is_sharded(self, name: str, state_name: str) -> bool:
        return len(self._entry(name, state_name).size) > 0

    def whole(self, name: str, state_name: str) -> Any:
        import torch

        entry = self._entry(name, state_name)
        value = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        self.views.add(f"{self.prefix}{self.stored(name)}.{state_name}", (0,) * value.dim(), value)
        return value

    def new_tensor(self, name: str, state_name: str, numel: int) -> Any:
        import torch

        return torch.zeros(numel, dtype=self._entry(name, state_name).properties.dtype)

    def fill(self, state_name: str, tensor: Any, piece: Piece) -> None:
        key = f"{self.prefix}{self.stored(piece.name)}.{state_name}"
        self.views.add_piece(key, self.shapes[piece.name], tensor, piece)

    def finish(self) -> None:
        self.views.read(self.reader)


def copy_piece(full: Any, tensor: Any, piece: Piece) -> None:
    """Copy ``piece`` of the full tensor ``full`` into its place in the 1-D ``tensor``."""
    tensor[piece.at : piece.at + piece.stop - piece.start].copy_(full.reshape(-1)[piece.start : piece.stop])


class ViewsReader:
    """Collects tensors to read from a sharded checkpoint, each a rectangle of a stored entry, and reads them
    all in one ``torch.distributed.checkpoint`` load (a collective: every rank calls ``read``)."""

    def __init__(self) -> None:
        self.views: Dict[str, List[Tuple[Tuple[int, ...], Any]]] = {}

    def add(self, key: str, offsets: Tuple[int, ...], tensor: Any) -> None:
        self.views.setdefault(key, []).append((offsets, tensor))

    def add_piece(self, key: str, shape: Tuple[int, ...], tensor: Any, piece: Piece) -> None:
        """Read ``piece`` of the stored entry ``key`` (of ``shape``) into its place in the 1-D ``tensor``."""
        for offsets, sizes, at in piece_boxes(shape, piece):
            self.add(key, offsets, tensor[at : at + math.prod(sizes)].view(sizes))

    def read(self, reader: Any) -> None:
        """Through torch DCP's storage ``reader`` (torch >= 2.2, where these loaders run: ``dcp.load``)."""
        compat.load_distributed({}, reader, _into_views_planner(self.views))


def _into_views_planner(views: Dict[str, List[Tuple[Tuple[int, ...], Any]]]) -> Any:
    """A load planner that reads stored key ``k`` into the tensors ``views[k]``, each a rectangle of the stored
    tensor at its offsets: the rectangles, not a whole-shaped template, are what this rank holds."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class IntoViews(DefaultLoadPlanner):
        def create_local_plan(self) -> Any:
            items = []
            for key, chunks in views.items():
                local = [ChunkStorageMetadata(offsets=torch.Size(at), sizes=view.size()) for at, view in chunks]
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], local)
            return LoadPlan(items)

        def lookup_tensor(self, index: Any) -> Any:
            return views[index.fqn][index.index][1]

    return IntoViews()


def load_into_shards(optimizer: Any, found: Layout, source: Any, saved_groups: Sequence[Dict[str, Any]]) -> None:
    """Build this rank's optimizer state in its final layout from ``source`` and give it to ``optimizer``.

    A state of the parameter's shape is allocated once (zeros where FSDP pads) and filled piece by piece;
    any other (Adam's ``step``) is taken whole from the parameter's first name. ``saved_groups``'
    hyperparameters are laid over the optimizer's current ones.
    """
    ids: Dict[int, int] = {}
    state: Dict[int, Dict[str, Any]] = {}
    for group in found.params:
        for param in group:
            index = ids.setdefault(id(param), len(ids))
            shard = found.shards[id(param)]
            if not shard.pieces and len(shard.names) == 1:
                continue  # no element of this parameter here: training keeps no state for it either
            first = shard.names[0]
            values: Dict[str, Any] = {}
            for state_name in source.state_names(first):
                if not source.is_sharded(first, state_name):
                    values[state_name] = source.whole(first, state_name)
                    continue
                values[state_name] = tensor = source.new_tensor(first, state_name, shard.numel)
                for piece in shard.pieces:
                    source.fill(state_name, tensor, piece)
            if values:
                state[index] = values
    source.finish()
    groups = []
    for current, saved in zip(optimizer.param_groups, saved_groups):
        hyper = {k: v for k, v in {**current, **saved}.items() if k != "params"}
        groups.append({**hyper, "params": [ids[id(param)] for param in current["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
