"""The on-disk checkpoint format as small pure functions: which files a sharded directory or a full file holds,
the Trainer's and Fabric's entry keys, parameter names without wrapper prefixes (as native 2.1+ writes them), and
the wording of refusals every layer shares. No torch, no Lightning."""
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Literal, Sequence

from .._patching._versions import FABRIC, TRAINER

# A checkpoint's kind, and a strategy's ``state_dict_type``: a directory of shards, or one file.
StateDictType = Literal["full", "sharded"]
FULL: StateDictType = "full"
SHARDED: StateDictType = "sharded"
STATE_DICT_TYPES = (FULL, SHARDED)

METADATA_FILENAME = "meta.pt"
# torch.distributed.checkpoint's own index of a sharded checkpoint: what each key holds and where.
DCP_METADATA_FILENAME = ".metadata"
# Where lightning_fsdp_resume before the manifest moved into ``.metadata`` kept it; no longer read, but a save may
# replace a directory that holds one.
OLD_CHECKSUMS_FILENAME = "checksums.json"
# What every refusal of a damaged or incomplete checkpoint tells the user to do.
RESUME_ELSEWHERE = "Resume from another checkpoint."
RESUME_OR_COPY = "Resume from another checkpoint, or copy this one again from where it was saved."
MODEL_KEY = "model"
EMA_KEY = "ema"  # a Trainer checkpoint's average of the weights (``ShardedEMA``), beside ``model``
EMA_STATE_KEY = "ema_state_dict"  # the same in a full checkpoint file, beside ``state_dict``
_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)(?:\.|$)")
# The Trainer writes it into every checkpoint, from 2.0 on; Fabric writes only what the user's state holds.
TRAINER_VERSION_KEY = "pytorch-lightning_version"


# A URL (s3://, gs://, memory://, any fsspec protocol), which ``pathlib.Path`` would turn into a local path
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: Any) -> bool:
    return isinstance(path, str) and _URL.match(path) is not None


def is_pickled_entry(stored: Any) -> bool:
    """Whether an entry of a DCP index (a value of ``state_dict_metadata``) is a pickled object rather than a tensor:
    a ``BytesStorageMetadata``, which has no chunks."""
    return not hasattr(stored, "chunks")


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_replaceable_directory(path: Path) -> bool:
    """A directory a save may replace: empty, or holding only what a sharded checkpoint holds."""
    return all(p.name in (METADATA_FILENAME, DCP_METADATA_FILENAME, OLD_CHECKSUMS_FILENAME) or p.suffix == ".distcp" for p in path.iterdir())


def count_saved_optimizers(storage_keys: Iterable[str]) -> int:
    """How many ``optimizer_{i}`` entries a sharded checkpoint's metadata keys name."""
    indices = {int(m.group(1)) for m in map(_OPTIMIZER_KEY.match, storage_keys) if m}
    return len(indices)


def sharded_checkpoint_writer(stored_entries: Iterable[str], meta_keys: Iterable[str]) -> str:
    """``TRAINER`` or ``FABRIC``: who wrote a sharded checkpoint, from the entries its shards store and the
    keys of its ``meta.pt``.

    The Trainer's stores only ``model``, ``optimizer_{i}`` and ``ema`` and its ``meta.pt`` always holds
    ``pytorch-lightning_version`` (Lightning 2.0 and 2.1+, this package's saves and native ones). Both
    must hold: a Fabric user may name a module ``model``, but Fabric's ``meta.pt`` holds only the user's
    other entries. Anything else is Fabric's.
    """
    trainer_entries = all(key in (MODEL_KEY, EMA_KEY) or _OPTIMIZER_KEY.fullmatch(key) for key in stored_entries)
    return TRAINER if trainer_entries and TRAINER_VERSION_KEY in set(meta_keys) else FABRIC


def is_optimizer_entry(paths: Iterable[Sequence[Any]]) -> bool:
    """Whether a stored entry of a sharded checkpoint is an optimizer's state, from the nested paths of its
    flattened keys (``.metadata``'s ``planner_data``).

    An optimizer state dict always has ``param_groups`` (``(key, "param_groups", 0, "lr")``) and, once
    stepped, ``state`` (``(key, "state", "body.0.weight", "exp_avg")``); a module's are
    ``(key, parameter name)``, the name one string however many dots it has. torch 2.2 stores the state
    dict of an optimizer that never stepped, which holds no tensor, whole: ``(key,)``. A module's always
    holds tensors.
    """
    return any(
        len(path) == 1 or path[1] == "param_groups" or (path[1] == "state" and len(path) > 2) for path in paths
    )


def strip_prefix(state: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    """Drop ``prefix`` from every key that has it (the 2.0.x wrapper's ``_forward_module.``)."""
    if not prefix:
        return state
    return {strip_name(key, prefix): value for key, value in state.items()}


def add_prefix(state: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    if not prefix:
        return state
    return {prefix + key: value for key, value in state.items()}


def strip_name(name: Any, prefix: str) -> Any:
    return name[len(prefix) :] if isinstance(name, str) and name.startswith(prefix) else name


def rename_optimizer_params(optimizer_state: Dict[str, Any], rename) -> Dict[str, Any]:
    """Apply ``rename`` to every parameter key of a name-keyed optimizer state dict (state and groups)."""
    renamed = dict(optimizer_state)
    renamed["state"] = {rename(key): value for key, value in optimizer_state.get("state", {}).items()}
    renamed["param_groups"] = [
        {**group, "params": [rename(name) for name in group["params"]]}
        for group in optimizer_state.get("param_groups", [])
    ]
    return renamed


def strip_optimizer_prefix(optimizer_state: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    if not prefix or not optimizer_state:
        return optimizer_state
    return rename_optimizer_params(optimizer_state, lambda name: strip_name(name, prefix))


def add_optimizer_prefix(optimizer_state: Dict[str, Any], prefix: str) -> Dict[str, Any]:
    if not prefix or not optimizer_state:
        return optimizer_state
    return rename_optimizer_params(optimizer_state, lambda name: prefix + name)


def is_id_keyed(optimizer_state: Dict[str, Any]) -> bool:
    """Standard PyTorch format: parameters named by integer position, as ``Optimizer.state_dict()`` writes."""
    for group in optimizer_state.get("param_groups", []):
        for param in group["params"]:
            return isinstance(param, int)
    return any(isinstance(key, int) for key in optimizer_state.get("state", {}))


def names_to_ids(optimizer_state: Dict[str, Any], names_by_group: Sequence[Sequence[str]]) -> Dict[str, Any]:
    """Re-key a name-keyed optimizer state to integer ids, numbering ``names_by_group`` in order.

    That is the numbering ``torch.optim.Optimizer.state_dict()`` uses: position across all groups.
    """
    ids: Dict[str, int] = {}
    for names in names_by_group:
        for name in names:
            ids.setdefault(name, len(ids))
    keyed = dict(optimizer_state)
    keyed["state"] = {ids[name]: value for name, value in optimizer_state["state"].items()}
    keyed["param_groups"] = [
        {**group, "params": [ids[name] for name in names]}
        for group, names in zip(optimizer_state["param_groups"], names_by_group)
    ]
    return keyed


def ids_to_names(optimizer_state: Dict[str, Any], names_by_group: Sequence[Sequence[str]]) -> Dict[str, Any]:
    """Re-key an id-keyed optimizer state to parameter names, matching ids to names by position within
    each parameter group, as ``torch.optim.Optimizer.load_state_dict`` matches them to parameters."""
    saved_groups = optimizer_state["param_groups"]
    if len(saved_groups) != len(names_by_group) or any(
        len(group["params"]) != len(names) for group, names in zip(saved_groups, names_by_group)
    ):
        raise ValueError(
            "The checkpoint's optimizer state does not fit the optimizer: it has parameter groups of sizes"
            f" {[len(g['params']) for g in saved_groups]}, the optimizer {[len(n) for n in names_by_group]}."
            " Configure the same optimizer parameters as the run that wrote the checkpoint."
        )
    names = {pid: name for group, group_names in zip(saved_groups, names_by_group) for pid, name in zip(group["params"], group_names)}
    keyed = dict(optimizer_state)
    keyed["state"] = {names[pid]: value for pid, value in optimizer_state["state"].items()}
    keyed["param_groups"] = [{**group, "params": list(group_names)} for group, group_names in zip(saved_groups, names_by_group)]
    return keyed


def in_module_order(names: Sequence[str], module_names: Sequence[str]) -> List[str]:
    """Sort parameter names by the position of their module in ``module_names`` (registration order).

    FSDP's flat parameters list the parameters of the root unit before those of nested units; a plain
    ``optimizer(module.parameters())`` numbers them in registration order, which is this order.
    """
    position = {name: index for index, name in enumerate(module_names)}
    return sorted(names, key=lambda name: position.get(name.rpartition(".")[0], len(position)))


def modules_in_state_dict_order(state_dict_keys: Iterable[str]) -> List[str]:
    """The modules that own ``state_dict_keys``, in the order the keys list them.

    ``Module.state_dict()`` lists a module's own entries before its children's, in registration order,
    so for a checkpoint without its module this is the registration order ``in_module_order`` needs.
    """
    return list(dict.fromkeys(key.rpartition(".")[0] for key in state_dict_keys))


def clean_module_name(name: str) -> str:
    """A module name as FSDP reports it in state dicts: without its wrapper segments."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    for wrapper in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"):
        if name.endswith(wrapper):
            name = name[: -len(wrapper)].rstrip(".")
    return name
