"""A sharded checkpoint directory read whole, in one process, with no process group, no model and no Lightning: the one
reader of sharded checkpoints outside a training run, in its writer's format (``read_full_checkpoint``). ``consolidate``
writes what it reads; ``_lightning_reads`` hands it to Lightning wherever Lightning reads a full file.
"""
import re
import sys
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Type

from .._patching import _torch_compat as compat
from .._storage import Location, checked
from . import _format, _reader

# ``consolidate``'s options as its refusals name them, marked in their text by ``option``: keyword arguments in Python
# (here), the command line's flags in ``cli``, which says them with its own table (``spoken``); ``{!r}``: the value given
KEYWORDS = {"ema": "ema=True", "weights_only": "weights_only=True", "overwrite": "overwrite=True",
            "safetensors": "format='safetensors'", "module NAME": "module=NAME", "module": "module={!r}",
            "module name": "module", "dtype": "dtype={!r}", "dtype name": "dtype", "format": "format"}
_MARK = re.compile("\x00([^\x00\x01]*)(?:\x01([^\x00]*))?\x00")


def option(name: str, value: Optional[str] = None) -> str:
    """The mark of option ``name`` (a key of ``KEYWORDS``), given ``value``, in a refusal's text."""
    return f"\x00{name}\x00" if value is None else f"\x00{name}\x01{value}\x00"


def spoken(text: str, names: Mapping[str, str]) -> str:
    """``text`` with each option marked in it said as ``names`` says it."""
    return _MARK.sub(lambda mark: names[mark[1]].format(mark[2]), text)


def refusal(kind: Type[Exception], text: str) -> Exception:
    """A ``kind`` saying ``text`` with its options as keyword arguments; its ``options_text`` keeps the marks, for a
    caller that names the options otherwise (``cli``)."""
    error = kind(spoken(text, KEYWORDS))
    error.options_text = text  # type: ignore[attr-defined]
    return error


class Summary(NamedTuple):
    """What one consolidation wrote."""

    writer: str  # _format.TRAINER or _format.FABRIC: whose sharded checkpoint it was, so the file's format
    weights: Dict[str, int]  # the file's entries holding weights ("state_dict" for the Trainer's) -> how many
    optimizers: Tuple[str, ...]  # the file's optimizer states: "optimizer_states[i]", or Fabric's entries
    tensor_bytes: int  # bytes of tensor data read from the shards


def read_full_checkpoint(src: Location, progress: bool = False) -> Tuple[Dict[str, Any], Summary]:
    """The full checkpoint held by the sharded directory ``src``, in its writer's full format, and what it holds."""
    metadata = _reader.index(src)
    flat, tensor_bytes = read_flat(src, metadata, progress)
    stored = nest(flat, metadata, src)
    meta = _reader.meta(src)
    writer = _format.sharded_checkpoint_writer(stored, meta)
    if writer == _format.TRAINER:
        entries, weights, optimizers = _trainer_entries(stored)
    else:
        entries, weights, optimizers = _fabric_entries(stored, metadata.planner_data)
    return {**meta, **entries}, Summary(writer, weights, optimizers, tensor_bytes)


class Weights(NamedTuple):
    """The weights a weights-only output holds: per output entry, the stored keys of its tensors."""

    writer: str
    keys: Dict[str, List[str]]  # "state_dict" (the Trainer's) or a Fabric module's key -> keys of .metadata, saved order
    paths: Dict[str, Sequence[Any]]  # each stored key's nested path: (entry, parameter name) for a module's tensor

    def counts(self) -> Dict[str, int]:
        return {entry: len(keys) for entry, keys in self.keys.items()}


def select_weights(src: Location, module: Optional[str], ema: bool = False) -> Weights:
    """Which stored keys are the model's weights: the Trainer's ``model`` entry (``ema``: the average of them
    ``ShardedEMA`` saved, its ``ema`` entry); Fabric's module entries, or the one named ``module``."""
    metadata, meta = _reader.index(src), _reader.meta(src)
    paths = _planner_paths(metadata, src)
    by_entry: Dict[str, List[str]] = {}
    for key in metadata.state_dict_metadata:  # the saved order: each module's keys in state_dict order
        by_entry.setdefault(paths[key][0], []).append(key)
    writer = _format.sharded_checkpoint_writer(by_entry, meta)
    if writer == _format.TRAINER:
        if module is not None:
            raise refusal(ValueError,
                f"{option('module', module)} picks a module of a Fabric checkpoint, but {str(src)!r} is the Trainer's,"
                f" whose weights are its one state_dict. Drop {option('module name')}."
            )
        if ema and _format.EMA_KEY not in by_entry:
            raise refusal(ValueError,
                f"{option('ema')}: the checkpoint {str(src)!r} holds no average of the weights (ShardedEMA saves it in"
                f" sharded checkpoints, beside the weights). Drop {option('ema')}, or consolidate a checkpoint of a run"
                " with ShardedEMA."
            )
        return Weights(writer, {"state_dict": by_entry.get(_format.EMA_KEY if ema else _format.MODEL_KEY, [])}, paths)
    if ema:
        raise refusal(ValueError,
            f"{option('ema')} writes the average ShardedEMA saves in the Trainer's checkpoints; {str(src)!r} is Fabric's,"
            f" whose modules are entries of their own. Pass {option('module NAME')} instead."
        )
    modules = [
        entry for entry in by_entry
        if not _format.is_optimizer_entry(paths[key] for key in by_entry[entry])
    ]
    if module is not None:
        if module not in modules:
            raise refusal(ValueError,
                f"{option('module', module)}: the Fabric checkpoint {str(src)!r} has no such module entry; its modules"
                f" are {quoted_names(modules)}. Pass one of them."
            )
        modules = [module]
    if not modules:
        raise ValueError(f"The Fabric checkpoint {str(src)!r} holds no module weights, only optimizer states.")
    return Weights(writer, {entry: by_entry[entry] for entry in modules}, paths)


def quoted_names(names: Sequence[str]) -> str:
    return ", ".join(map(repr, names)) or "none"


def _trainer_entries(stored: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, int], Tuple[str, ...]]:
    """``state_dict``, ``ema_state_dict`` where the run kept an average of the weights (``ShardedEMA``) and, unless the
    save was weights-only, ``optimizer_states`` (id-keyed)."""
    model_state = stored.get(_format.MODEL_KEY, {})
    entries: Dict[str, Any] = {"state_dict": model_state}
    if _format.EMA_KEY in stored:
        entries[_format.EMA_STATE_KEY] = stored[_format.EMA_KEY]
    modules = _format.modules_in_state_dict_order(model_state)
    count = _format.count_saved_optimizers(stored)
    if count:  # none: a weights-only save, which has no "optimizer_states" either
        entries["optimizer_states"] = [
            standard_optimizer_state(stored[_format.optimizer_key(index)], modules) for index in range(count)
        ]
    return entries, {"state_dict": len(model_state)}, tuple(f"optimizer_states[{index}]" for index in range(count))


def _fabric_entries(
    stored: Dict[str, Any], paths: Dict[str, Sequence[Any]]
) -> Tuple[Dict[str, Any], Dict[str, int], Tuple[str, ...]]:
    """Every stored entry under its own key: a module's full state dict, an optimizer's name-keyed FSDP state
    (what native Fabric's full save writes, ``FSDP.optim_state_dict`` under a full state-dict context)."""
    optimizers = {key for key in stored if _format.is_optimizer_entry(p for p in paths.values() if p[0] == key)}
    entries = {key: with_state(value) if key in optimizers else value for key, value in stored.items()}
    weights = {key: len(value) for key, value in entries.items() if key not in optimizers}
    return entries, weights, tuple(key for key in stored if key in optimizers)


def standard_optimizer_state(state: Dict[str, Any], modules: Sequence[str]) -> Dict[str, Any]:
    """A name-keyed FSDP optimizer state in PyTorch's id-keyed format.

    Ids number each group's parameters in the module's registration order, which a plain
    ``optimizer(module.parameters())`` uses and our full save writes. With ``use_orig_params=False``
    the stored group lists the parameters in flat-parameter order, so the order is not taken from it;
    the module's order is recovered from the model's keys (see ``modules_in_state_dict_order``).
    """
    state = with_state(state)
    names_by_group = [_format.in_module_order(group["params"], modules) for group in state["param_groups"]]
    return _format.names_to_ids(state, names_by_group)


def with_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer that never stepped has no stored ``state``; its state dict has an empty one."""
    return {"state": {}, **state}


# --- reading the shards ----------------------------------------------------------------------------


def read_flat(src: Location, metadata: Any, progress: bool, keys: Optional[Sequence[str]] = None):
    """Every stored key (or those of ``keys``), as ``.metadata`` names it, read into tensors allocated once
    at full size."""
    import torch

    tensors: Dict[str, Any] = {}
    objects: Dict[str, Any] = {}
    for key in metadata.state_dict_metadata if keys is None else keys:
        stored = metadata.state_dict_metadata[key]
        if _format.is_pickled_entry(stored):
            objects[key] = None  # read whole
        else:
            tensors[key] = torch.empty(stored.size, dtype=stored.properties.dtype)
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    bar = Progress(total, f"reading {str(src)!r}", enabled=progress)
    planner = _planner(objects, bar.advance)
    try:
        compat.read_distributed_in_one_process({**tensors, **objects}, checked.reader(src), planner)
    finally:
        bar.close()
    return {**tensors, **objects}, total


def _planner(objects: Dict[str, Any], advance: Callable[[int], None]) -> Any:
    """A load planner for a flat state dict: pickled objects land in ``objects``, tensors report progress."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class FlatLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            # Kept apart: dcp.load writes its own copy of the state dict's values back at the end
            objects[read_item.dest_index.fqn] = checked.load_entry(value)

        def commit_tensor(self, read_item: Any, tensor: Any) -> None:
            advance(tensor.numel() * tensor.element_size())

    return FlatLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def nest(flat: Dict[str, Any], metadata: Any, src: Location) -> Dict[str, Any]:
    """Rebuild the saved nesting (``{"model": {...}, "optimizer_0": {...}}``) from the flat keys.

    The saver recorded each flat key's path (``("optimizer_0", "state", "body.0.weight", "exp_avg")``)
    in ``planner_data``: parameter names contain dots, so the keys alone are ambiguous.
    """
    paths = _planner_paths(metadata, src)
    root: Dict[str, Any] = {}
    for key in [key for key in metadata.state_dict_metadata if key in flat]:  # the saved order: state_dict order
        _put_at(root, paths[key], flat.pop(key))
    return root


def _planner_paths(metadata: Any, src: Location) -> Dict[str, Sequence[Any]]:
    """Each stored key's nested path, which a sharded save records; refused where it is missing."""
    paths = metadata.planner_data
    if not isinstance(paths, dict) or any(key not in paths for key in metadata.state_dict_metadata):
        raise ValueError(
            f"The sharded checkpoint {str(src)!r} does not record how its keys nest (its"
            f" {_format.DCP_METADATA_FILENAME!r} has no planner_data for them), so it was not written by"
            " FSDPStrategy(state_dict_type='sharded'). Only Lightning's and this package's sharded checkpoints"
            " can be consolidated."
        )
    return paths


def _put_at(root: Dict[str, Any], path: Sequence[Any], value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, making dicts (str steps) and lists (int steps) on the way."""
    node: Any = root
    for step, following in zip(path, path[1:]):
        child = _get(node, step)
        if child is None:
            child = [] if isinstance(following, int) else {}
            _set(node, step, child)
        node = child
    _set(node, path[-1], value)


def _get(node: Any, step: Any) -> Any:
    if isinstance(node, list):
        return node[step] if step < len(node) else None
    return node.get(step)


def _set(node: Any, step: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (step + 1 - len(node)))
    node[step] = value


def read_tensor(src: Location, key: str, stored: Any, advance: Callable[[int], None]) -> Any:
    """The stored tensor ``key`` alone, read from its shards into one tensor of its full size."""
    import torch

    tensor = torch.empty(stored.size, dtype=stored.properties.dtype)
    if tensor.numel():
        compat.read_distributed_in_one_process({key: tensor}, checked.reader(src), _planner({}, advance))
    return tensor


def check_torch() -> None:
    if not compat.consolidate_supported():
        needed = ".".join(map(str, compat.CONSOLIDATE_MIN))
        raise NotImplementedError(
            f"Consolidating a sharded checkpoint needs torch >= {needed}; this is torch"
            f" {compat.release_text()}. Install torch>={needed} in any environment (the training one is not"
            " needed) and run the command there."
        )


class Progress:
    """Bytes done of ``total``: a tqdm bar where tqdm is installed, else a line on stderr every 10%."""

    def __init__(self, total: int, what: str, enabled: bool = True, command: str = "consolidate") -> None:
        self.total, self.what, self.enabled, self.command = total, what, enabled, command
        self.done, self._said = 0, -1
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                self._say()
            else:
                self._bar = tqdm(total=total, desc=f"{command}: {what}", unit="B", unit_scale=True, file=sys.stderr)

    def advance(self, count: int) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self.enabled:
            self._say()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def _say(self) -> None:
        percent = 100 if not self.total else self.done * 100 // self.total
        if percent // 10 > self._said:  # once per tenth crossed
            self._said = percent // 10
            mib = 2**20
            print(f"{self.command}: {self.what}: {percent}% ({self.done / mib:.1f} of {self.total / mib:.1f} MiB)",
                  file=sys.stderr, flush=True)
