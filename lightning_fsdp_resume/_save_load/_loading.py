"""The load routine both FSDP strategies share (``load``): rank 0 names and checks the checkpoint, then one FSDP module
and its optimizers load into their shards, from a sharded directory or a full file; a caller's differences come in a
``Request``, the user's ``weights_only`` as the call asked it (``_held.asking``). No patching here, and no import of
Lightning.
"""
import functools
import re
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple

from .. import _storage
from .._checkpoint import _format, _preflight, _reader
from .._patching import _torch_compat as compat
from .._patching._held import asked
from .._storage import Location, checked
from . import _background, _shard_layout
from ._ranks import broadcast, decided_on_rank_zero, raise_found_on_any_rank, warn_rank_zero


def trusted(weights_only: Optional[bool] = None) -> bool:
    """Whether a load may unpickle whatever its checkpoint names: only when ``weights_only=False`` was given, to the
    load or to the call it runs in (``_held.asking``). ``None`` (the default) and ``True`` read every pickle restricted
    (``_unpickling``)."""
    if weights_only is None:
        weights_only = asked().weights_only
    return weights_only is False


class Restore(NamedTuple):
    """What a load restores: one FSDP-wrapped module and the optimizers over its parameters."""

    module: Any  # the FSDP-wrapped root
    prefix: str  # the module's parameter names before the stored ones (Lightning 2.0.x: ``_forward_module.``)
    module_key: str  # the checkpoint entry holding the module's weights
    optimizers: Dict[str, Any]  # checkpoint entry -> optimizer to restore; empty: the weights only
    strict: bool  # refuse a checkpoint whose weights are not exactly the module's
    leniency: str = _preflight.TRAINER_LENIENCY  # how to load anyway, said when ``strict`` refuses
    # restore the optimizers even where the checkpoint lacks weights (Fabric's strict=False: a filter= save
    # of the trainable weights); the Trainer's fit needs every weight the optimizers step
    optimizers_without_weights: bool = False
    # checkpoint entry -> a module without FSDP units beside the FSDP one (Fabric: an EMA copy, say), loaded whole
    modules: Mapping[str, Any] = {}
    # checkpoint entry -> a state saved beside the weights in their layout (``_participants``), read into its own
    # shards; told where the checkpoint has none
    participants: Mapping[str, Any] = {}


class Request:
    """One caller's load (the Trainer's, Fabric's, Fabric's ``load_raw``): what rank 0 checks, what to restore and
    what of a full file is the module's and the optimizers'. ``load`` runs it; each caller subclasses it."""

    required: Optional[str] = None  # an entry a full checkpoint file must have

    def __init__(self, weights_only: Optional[bool] = None) -> None:
        self.trusted = trusted(weights_only)  # the user's ``weights_only`` (Lightning 2.6's name), or the call's

    def check(self, path: Location) -> Tuple[_format.StateDictType, Any]:
        """Rank 0, before anything loads: the checkpoint's kind once it is complete, and whatever else the caller
        checks (its verdict, which ``plan`` receives on every rank)."""
        return _preflight.checkpoint_kind(path), None

    def plan(self, path: Location, saved_optimizers: int, verdict: Any) -> Restore:
        """What to load, given how many optimizer states the checkpoint holds and rank 0's verdict."""
        raise NotImplementedError

    def take(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        """A full file's module and optimizer entries, taken out of it under the keys a sharded checkpoint stores them by."""
        raise NotImplementedError


def load(strategy: Any, path: Any, request: Request) -> Dict[str, Any]:
    """Load the checkpoint at ``path`` into the module and optimizers that ``request`` plans; returns the rest of the
    checkpoint (a sharded one's ``meta.pt``, a full file less what ``request.take`` took).

    Every rank loads what rank 0 names, so all shards come from one checkpoint; rank 0 checks the files
    before anything is loaded and every rank raises its verdict, so none waits in a collective.
    """
    _background.wait(strategy)  # a save still writing: it may be the very checkpoint asked for
    target = broadcast(strategy, str(path))
    # rank 0 follows a URL's pointer once: every rank reads that data, even if a save commits another meanwhile
    opened: Dict[str, Location] = {}
    resolved, kind, verdict = decided_on_rank_zero(strategy, _resolved_and_checked, target, request, opened)
    # rank 0 reads through the location it checked, whose index it has read already
    path = opened.get(resolved) or _storage.open_path(resolved, "load", request.trusted)
    if kind == _format.SHARDED:
        shards = _reader.index(path)
        restore = request.plan(path, _format.count_saved_optimizers(shards.state_dict_metadata), verdict)
        _shard_layout.drop_gathered_copies(restore.module)
        load_sharded(path, restore, shards)
        rest = _reader.meta(path)
    else:
        # the node's ranks check the file's CRC-32s a share each, before any rank uses a byte of it
        share = (strategy.local_rank, strategy.num_processes)
        together = checked.check_file_together(path, share if 0 <= share[0] < share[1] else (0, 1))
        rest = _reader.full(path, request.required, together)
        stored = request.take(rest)
        restore = request.plan(path, _format.count_saved_optimizers(stored), verdict)
        optimizer_states = {key: stored[key] for key in restore.optimizers}
        other_states = {key: stored[key] for key in restore.modules}
        participant_states = {key: stored[key] for key in restore.participants if key in stored}
        _shard_layout.drop_gathered_copies(restore.module)
        load_full(strategy, path, restore, stored[restore.module_key], optimizer_states, other_states, participant_states)
    _check_in_place(path, restore.module)
    return rest


def _check_in_place(path: Location, module: Any) -> None:
    """After a load, every FSDP unit's next forward computes with the shards it wrote; raised on every rank if not."""
    stale = _shard_layout.units_off_their_shards(module)
    found = None
    if stale:
        units = ", ".join(repr(name) if name else "the root" for name in stale)
        found = (
            f"The checkpoint {str(path)!r} was loaded into this rank's FSDP shards, but FSDP keeps a gathered copy of"
            f" other weights for {units} and would compute with it: the model would not run the checkpoint's weights."
            " Load the checkpoint in new processes (the model has not yet run a forward there), and report this"
            " with your torch release"
        )
    raise_found_on_any_rank(found)


def _resolved_and_checked(target: str, request: Request, opened: Dict[str, Location]) -> Tuple[str, _format.StateDictType, Any]:
    path = _storage.open_path(target, "load", request.trusted).resolve()
    kind, verdict = request.check(path)
    opened[str(path)] = path
    return str(path), kind, verdict


def load_sharded(path: Location, restore: Restore, shards: Any) -> None:
    """Load ``restore`` from the sharded checkpoint at ``path`` whose index (``.metadata``) is ``shards``."""
    module, prefix, key = restore.module, restore.prefix, restore.module_key
    stored = _preflight.stored_model_shapes(shards, key)
    shapes = model_parameter_shapes(module)
    if shapes is not None:
        # Read each rank's elements straight into its flat parameters: no state-dict template.
        keys = _loadable_keys(path, restore, _format.strip_prefix(shapes, prefix), stored)
        _shard_layout.read_model_into_shards(module, checked.reader(path), {prefix + name: f"{key}.{name}" for name in keys})
        model_state: Dict[str, Any] = {}  # the torch < 2.5 optimizer loader makes it where it needs it
    else:
        model_state = _format.strip_prefix(compat.model_state_dict(module, full=False, offload=False), prefix)
        keys = _loadable_keys(path, restore, _preflight.tensor_shapes(model_state), stored)
        container = {key: {name: value for name, value in model_state.items() if name in keys}}
        compat.load_distributed(container, checked.reader(path))
        model_state = container[key]
        compat.load_model_state_dict(module, _format.add_prefix(model_state, prefix), full=False, strict=restore.strict)
    for optimizer_key, optimizer in restore.optimizers.items():
        load_sharded_optimizer_state(module, optimizer, model_state, optimizer_key, path, shards, prefix)
    for participant_key, participant in restore.participants.items():
        _load_sharded_participant(path, restore, participant_key, participant, shards)
    for other_key, other in restore.modules.items():
        # Saved whole by every rank (torch de-duplicates); every rank reads it whole.
        wanted = other.state_dict()
        keys = _other_module_keys(path, restore, wanted, _preflight.stored_model_shapes(shards, other_key))
        container = {other_key: {name: value for name, value in wanted.items() if name in keys}}
        compat.load_distributed(container, checked.reader(path))
        other.load_state_dict(container[other_key], strict=restore.strict)


def _load_sharded_participant(path: Location, restore: Restore, key: str, participant: Any, shards: Any) -> None:
    stored = _preflight.stored_model_shapes(shards, key)
    if not stored:
        participant.absent(str(path))
        return
    keys = _participant_keys(path, restore, participant, stored)
    participant.read(restore.module, checked.reader(path), {restore.prefix + name: f"{key}.{name}" for name in keys})


def _participant_keys(path: Location, restore: Restore, participant: Any, stored: Dict[str, Any]) -> Set[str]:
    """The tensors of a stored participant (``stored``: their shapes) to load, strictly: another model's is refused."""
    expected = _format.strip_prefix(participant.shapes(restore.module), restore.prefix)
    return _preflight.loadable_keys(path, expected, stored, strict=True)


def load_full(
    strategy: Any, path: Location, restore: Restore, state_dict: Dict[str, Any], optimizer_states: Dict[str, Any],
    other_states: Optional[Dict[str, Any]] = None, participant_states: Optional[Dict[str, Any]] = None,
) -> None:
    """Load ``restore`` from a full checkpoint's weights, optimizer states, other modules' and participants' state dicts
    (by checkpoint entry), which every rank passes whole (memory-mapped); each rank keeps its part."""
    other_states = other_states or {}
    module, prefix = restore.module, restore.prefix
    shapes = model_parameter_shapes(module)
    direct = shapes is not None  # copy each rank's elements into its flat parameters, gathering nothing
    if not direct:
        # Only the global shapes are wanted: the sharded template goes at once.
        shapes = _preflight.tensor_shapes(compat.model_state_dict(module, full=False, offload=False))
    keys = _loadable_keys(path, restore, _format.strip_prefix(shapes, prefix), _preflight.tensor_shapes(state_dict))
    state_dict = _format.add_prefix({name: value for name, value in state_dict.items() if name in keys}, prefix)
    if direct:
        _shard_layout.copy_model_into_shards(module, state_dict)
    else:
        compat.load_model_state_dict(module, state_dict, full=True, strict=restore.strict)
    for participant_key, participant in restore.participants.items():
        state = (participant_states or {}).get(participant_key)
        if state is None:
            participant.absent(str(path))
            continue
        keys = _participant_keys(path, restore, participant, _preflight.tensor_shapes(state))
        participant.copy(module, {prefix + name: state[name] for name in keys})
    for other_key, other in restore.modules.items():
        stored = other_states[other_key]
        keys = _other_module_keys(path, restore, other.state_dict(), _preflight.tensor_shapes(stored))
        other.load_state_dict({name: value for name, value in stored.items() if name in keys}, strict=restore.strict)
    if not restore.optimizers:
        return
    if not compat.supports_sharded_checkpoints():
        warn_rank_zero(strategy, "FSDP in Lightning with PyTorch < 2.0 does not support loading the optimizer state.")
        return
    for optimizer_key, optimizer in restore.optimizers.items():
        state = optimizer_states[optimizer_key]
        if _format.is_id_keyed(state):
            # Written by a non-FSDP run or by a full FSDP save: map ids to this optimizer's parameters.
            groups = optimizer_parameter_names(module, optimizer)
            names = [[_format.strip_name(name, prefix) for name in group] for group in groups]
            state = _format.ids_to_names(state, names_by_group(restore, names))
        load_full_optimizer_state(module, optimizer, state, prefix)


def names_by_group(restore: Restore, groups: List[List[str]]) -> List[List[str]]:
    """Parameter names per group, in the order a non-FSDP optimizer over the same parameters numbers them."""
    groups = [list(names) for names in groups]
    if compat.uses_orig_params(restore.module):
        return groups  # the optimizer holds the original parameters in the user's order
    prefix = restore.prefix
    modules = [_format.clean_module_name(name) for name, _ in restore.module.named_modules()]
    modules = [name[len(prefix) :] if name.startswith(prefix) else name for name in modules]
    return [_format.in_module_order(names, modules) for names in groups]


def _other_module_keys(path: Location, restore: Restore, wanted: Dict[str, Any], stored: Dict[str, Any]) -> Set[str]:
    return _preflight.loadable_keys(path, _preflight.tensor_shapes(wanted), stored, restore.strict, restore.leniency)


def _loadable_keys(path: Location, restore: Restore, expected: Dict[str, Any], stored: Dict[str, Any]) -> Set[str]:
    keys = _preflight.loadable_keys(path, expected, stored, restore.strict, restore.leniency)
    missing = sorted(set(expected) - keys)
    if missing and restore.optimizers and not restore.optimizers_without_weights:
        raise RuntimeError(
            f"The checkpoint {str(path)!r} has no weights for {', '.join(missing[:8])}, so the optimizer states"
            " cannot be resumed. Resume with the model the checkpoint was written for."
        )
    return keys


# --- weights and optimizer states into the shards, by torch release ---------------------------------------------


def model_parameter_shapes(model: Any) -> Any:
    """torch >= 2.2: the model's state-dict entries and full shapes when all of them are parameters FSDP
    shards, which ``_shard_layout``'s loaders then read straight into the flat parameters; else None.

    FSDP's sharded state-dict template gathers every FSDP unit to re-chunk it, and its load gathers them again to
    copy it in; those loaders read or copy each rank's elements into its flat parameters.
    """
    return _shard_layout.parameter_shapes(model) if compat.through_flat_shards() else None


def optimizer_parameter_names(model: Any, optimizer: Any) -> list:
    """Each param group's parameter names; for a flat parameter, those of the original parameters in it."""
    found = _shard_layout.layout(model, optimizer) if compat.through_flat_shards() else None
    if found is not None:
        return _shard_layout.names_by_group(found)
    state = compat.optimizer_state_dict(model, optimizer, full=False, offload=False)
    return [list(group["params"]) for group in state["param_groups"]]


def load_full_optimizer_state(model: Any, optimizer: Any, state: Dict[str, Any], prefix: str) -> None:
    """Load a full, name-keyed optimizer state whose names lack the model's ``prefix``; every rank passes it."""
    found = _shard_layout.layout(model, optimizer) if compat.through_flat_shards() else None
    if found is None:
        compat.load_optimizer_state_dict(model, optimizer, _format.add_optimizer_prefix(state, prefix), full=True)
        return
    # torch's loaders convert the whole state to FSDP's layout first (torch >= 2.5's set_optimizer_state_dict: twice
    # the memory of native 2.1.4, which uses FSDP.optim_state_dict_to_load); this slices out what the rank holds.
    by_name = {prefix + name: value for name, value in state["state"].items()}
    source = FullSource(by_name, found.shapes)
    _shard_layout.load_into_shards(optimizer, found, source, state["param_groups"])


class FullSource:
    """States from a full, name-keyed optimizer state dict (every original parameter's whole state), for
    ``_shard_layout.load_into_shards``."""

    def __init__(self, state: Dict[str, Dict[str, Any]], shapes: Dict[str, Tuple[int, ...]]) -> None:
        self.state = state
        self.shapes = shapes

    def state_names(self, name: str) -> List[str]:
        return list(self.state.get(name, {}))

    def is_sharded(self, name: str, state_name: str) -> bool:
        value = self.state[name][state_name]
        return getattr(value, "dim", lambda: 0)() > 0 and tuple(value.shape) == self.shapes[name]

    def whole(self, name: str, state_name: str) -> Any:
        value = self.state[name][state_name]
        return value.clone() if hasattr(value, "clone") else value

    def new_tensor(self, name: str, state_name: str, numel: int) -> Any:
        import torch

        return torch.zeros(numel, dtype=self.state[name][state_name].dtype)

    def fill(self, state_name: str, tensor: Any, piece: _shard_layout.Piece) -> None:
        _shard_layout.copy_piece(self.state[piece.name][state_name], tensor, piece)

    def finish(self) -> None:
        pass


def load_sharded_optimizer_state(
    model: Any, optimizer: Any, model_state: Dict[str, Any], key: str, path: Location, shards: Any, prefix: str
) -> None:
    """Load optimizer ``key`` of a sharded checkpoint into this rank's shards.

    ``model_state`` is the model's sharded state as stored (names without the wrapper prefix), ``shards``
    the checkpoint's index (``checked.index``); ``prefix`` is what the model's parameter names have
    before the names the checkpoint stores.
    """
    found = _shard_layout.layout(model, optimizer) if compat.through_flat_shards() else None
    if found is not None:
        # torch's templates (below) initialise the optimizer state and re-chunk it per parameter, gathering (about
        # 2.6 times the shard on torch 2.13). This reads into the state's final layout instead.
        stored = functools.partial(_format.strip_name, prefix=prefix)
        source = _shard_layout.CheckpointSource(checked.reader(path), key, shards, found.shapes, stored)
        if source.readable():
            _shard_layout.load_into_shards(optimizer, found, source, _saved_param_groups(path, key, shards))
            return
    if compat.new_state_dict_api():
        # The new API builds a complete template (it initialises empty optimizer state); load fills it in.
        # Only the tensors go through dcp.load: the param groups' hyperparameters are read as saved and
        # laid over the optimizer's current ones. Loading them into the template fails when a newer torch
        # added a hyperparameter (torch 2.13's Adam ``decoupled_weight_decay``) and when the world size
        # changed (the template then flattens the groups differently from the saved keys).
        template = _format.strip_optimizer_prefix(compat.optimizer_state_dict(model, optimizer, full=False, offload=False), prefix)
        container = {key: {"state": template["state"]}}
        compat.load_distributed(container, checked.reader(path))
        for group, saved in zip(template["param_groups"], _saved_param_groups(path, key, shards)):
            group.update(saved)
        state = {**container[key], "param_groups": template["param_groups"]}
    else:
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

        if not model_state:  # the weights were read straight into the shards: its template is the model's layout
            model_state = _format.strip_prefix(compat.model_state_dict(model, full=False, offload=False), prefix)
        loaded = load_sharded_optimizer_state_dict(
            model_state_dict=model_state, optimizer_key=key, storage_reader=checked.reader(path)
        )
        state = loaded[key]
    compat.load_optimizer_state_dict(model, optimizer, _format.add_optimizer_prefix(state, prefix), full=False)


def _saved_param_groups(path: Location, key: str, index: Any) -> list:
    """Optimizer ``key``'s param groups as saved: pickled objects, read from the shard files directly."""
    whole = f"{key}.param_groups"
    fields: List[Tuple[Optional[Tuple[int, str]], Any]] = []  # (group, field) or None for the groups as one entry
    for entry, info in index.storage_data.items():
        field = re.fullmatch(re.escape(whole) + r"\.(\d+)\.(\w+)", entry.fqn)
        if entry.fqn == whole or field:
            fields.append(((int(field.group(1)), field.group(2)) if field else None, info))
    groups: Dict[int, Dict[str, Any]] = {}
    for (where, _), value in zip(fields, checked.load_items(path, [info for _, info in fields])):  # one request a file, at a URL
        if where is None:  # the groups saved as one entry
            return list(value)
        groups.setdefault(where[0], {})[where[1]] = value
    return [groups[i] for i in sorted(groups)]
