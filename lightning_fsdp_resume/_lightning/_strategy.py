"""The checkpointing native Lightning 2.1 gave the Trainer's ``FSDPStrategy`` (methods: ``self`` is the strategy), and
2.6's ``weights_only`` on the ``Trainer``'s entry points and ``load_from_checkpoint``, for 2.0.x of both flavours. No
Lightning import, no patching (``_patches`` does it); what Fabric's does alike is in ``_saving`` and ``_loading``.
"""
import functools
from typing import Any, Callable, Dict, Optional, Sequence

from .. import _participants, _storage
from .._checkpoint import _format, _preflight
from .._patching import _signature
from .._patching import _torch_compat as compat
from .._patching._held import ModuleHeld, asking, held
from .._save_load import _background, _loading, _ranks, _saving
from .._storage import Location

OLD_TORCH_ERROR = (
    "Saving checkpoints with `FSDPStrategy(state_dict_type='sharded')` is not supported in PyTorch < 2.0."
    " Please upgrade `torch`."
)


def wrap_init(original_init: Callable) -> Callable:
    """``FSDPStrategy(..., state_dict_type="full" | "sharded")``, ``"full"`` by default as in native 2.1."""
    return _signature.wrap_init(original_init, default="full", old_torch_error=OLD_TORCH_ERROR)


def wrap_setup_model(original_setup_model: Callable) -> Callable:
    """Wrap a LightningModule in FSDP once; every later ``fit``/``validate``/``test``/``predict`` of any Trainer
    in the same processes runs the same sharded model.

    The LightningModule keeps that root in its ``ModuleHeld`` (not as a submodule: no state-dict keys), because the
    weights of the root unit live in the root's flat parameters. Lightning 2.0.x wraps anew on every run: its
    sub-units are FSDP units already and the root unit's weights sit in the earlier root's flat parameters, so the new
    root holds none of them and loads fail (native 2.1 fails the same way, upstream #20373).
    """

    @functools.wraps(original_setup_model)
    def _setup_model(self: Any, model: Any) -> Any:
        lightning_module = self.lightning_module
        kept = held(lightning_module, ModuleHeld)
        root = kept.fsdp_root
        if root is None:
            root = kept.fsdp_root = original_setup_model(self, model)  # not a submodule: no state-dict keys
            return root
        wanted = bool(self.kwargs.get("use_orig_params", False))
        if compat.uses_orig_params(root) != wanted:
            raise ValueError(
                f"`FSDPStrategy(use_orig_params={wanted})` cannot run this {type(lightning_module).__name__}: an"
                f" earlier run in this process wrapped it in FSDP with use_orig_params={not wanted}, and FSDP cannot"
                " wrap a model twice. Use the same setting as that run, or a new instance of the model (load its"
                " weights with `ckpt_path=`)."
            )
        return root

    return _setup_model


def wrap_setup_optimizers(original_setup_optimizers: Callable) -> Callable:
    """Create optimizers when fitting only, as native 2.1 does: 2.0.x creates new ones for ``validate``, ``test``
    and ``predict`` too, so a ``save_checkpoint`` after them wrote fresh optimizer states over the trained ones."""

    @functools.wraps(original_setup_optimizers)
    def setup_optimizers(self: Any, trainer: Any) -> None:
        if trainer.state.fn == "fit":
            original_setup_optimizers(self, trainer)

    return setup_optimizers


def restore_checkpoint_after_setup(self: Any) -> bool:
    # Restore into the wrapped, sharded model: the full model is never materialised on every rank.
    return True


def lightning_restore_optimizer(self: Any) -> bool:
    # load_checkpoint() already restored the optimizers into their FSDP shards.
    return False


def load_model_state_dict(self: Any, checkpoint: Any) -> None:
    """Nothing to do: ``load_checkpoint()`` already loaded the weights into the FSDP module."""


def load_optimizer_state_dict(self: Any, checkpoint: Any) -> None:
    """Nothing to do: ``load_checkpoint()`` already loaded the optimizer states."""


def lightning_module_state_dict(self: Any) -> Dict[str, Any]:
    state = _saving.model_state(self.model, _saving.state_dict_type(self), offload=_saving.offload(self.model))
    return _format.strip_prefix(state, _prefix(self))


def optimizer_state(self: Any, optimizer: Any) -> Dict[str, Any]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    kind = _saving.state_dict_type(self)
    if not compat.supports_sharded_checkpoints():
        _ranks.warn_rank_zero(self, "FSDP in Lightning with PyTorch < 2.0 does not support saving the optimizer state.")
        return {}
    state = _saving.optimizer_state(self.model, optimizer, kind, offload=_saving.offload(self.model))
    state = _format.strip_optimizer_prefix(state, _prefix(self))
    if kind == _format.SHARDED:
        return state
    if self.global_rank != 0 or not state:
        return {}
    # Standard PyTorch format (parameter ids), as a non-FSDP run writes it. Native 2.1.4 uses
    # FSDP.rekey_optim_state_dict here, which fails for flat parameters (use_orig_params=False).
    groups = [group["params"] for group in state["param_groups"]]
    return _format.names_to_ids(state, _loading.names_by_group(_restore(self, fitting=False), groups))


def save_checkpoint(self: Any, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
    """A sharded directory (``model``, ``optimizer_0``, … and ``meta.pt``) or one file, put at ``filepath``
    only once complete."""
    _saving.refuse_storage_options(storage_options)
    io = _plain_io(self)
    participants = [participant for participant in _participants.of(self.lightning_module) if participant.saves()]
    kind = _saving.state_dict_type(self)
    if kind == _format.FULL:
        for participant in participants:  # gathered as the weights are, to rank 0
            checkpoint[participant.full_key] = participant.full_state(self.model, _prefix(self), lambda: lightning_module_state_dict(self))
        # a str: Lightning's CheckpointIO opens a URL with fsspec, a local path as it is
        write = lambda state, partial: io.save_checkpoint(state, str(partial))  # noqa: E731
        saved = _saving.Checkpoint(kind, checkpoint, {}, (self.model, self.optimizers), write)
    else:
        stored = _stored(checkpoint, participants, keep_optimizer_states=False)
        stored.update((participant.key, participant.sharded_state(self.model, _prefix(self))) for participant in participants)
        rank_zeros = (_format.MODEL_KEY, *(participant.key for participant in participants))
        saved = _saving.Checkpoint(kind, stored, checkpoint, (self.model, self.optimizers), rank_zeros=rank_zeros)
    _saving.save(self, filepath, saved, background=_asks_for_background(self))


def _asks_for_background(self: Any) -> bool:
    """Lightning's ``AsyncCheckpointIO`` asks for saves in the background; they are while ``fit`` runs, whose
    teardown waits for them. A save after it (``trainer.save_checkpoint``) has its checkpoint written on return."""
    if not _asks_for_background_io(self):
        return False
    state = self.lightning_module.trainer.state
    return state.fn == "fit" and state.status == "running"


def _plain_io(strategy: Any) -> Any:
    """The Trainer's ``CheckpointIO`` that writes a full checkpoint when called: ``AsyncCheckpointIO``'s wrapped one.

    ``AsyncCheckpointIO``'s own thread would write the file after it is published and the checkpoint it replaces
    removed. Its request for saves in the background is answered here instead (``in_background``)."""
    io = strategy.checkpoint_io
    wrapped = getattr(io, "checkpoint_io", None)
    return wrapped if _asks_for_background_io(strategy) and wrapped is not None else io


def _asks_for_background_io(strategy: Any) -> bool:
    """Whether the Trainer's plugins include Lightning's ``AsyncCheckpointIO``."""
    return type(strategy.checkpoint_io).__name__ == "AsyncCheckpointIO"


def wrap_teardown(original_teardown: Callable) -> Callable:
    """The end of ``fit`` (and of every other run) waits for the save in the background and raises its failure."""

    @functools.wraps(original_teardown)
    def teardown(self: Any) -> None:
        try:
            _background.wait(self)
        finally:
            _background.release(self)
            original_teardown(self)

    return teardown


def wrap_optimizer_step(original_optimizer_step: Callable) -> Callable:
    """After the first step of a ``fit`` that saves in the background, the saves' host buffers are made in a thread."""
    return _saving.preparing_background_saves(original_optimizer_step, _asks_for_background, lambda self: self.model)


def wrap_remove_checkpoint(original_remove_checkpoint: Callable) -> Callable:
    """``ModelCheckpoint``'s removal of a checkpoint it no longer keeps (``save_top_k``), once the save before it is
    published. At a URL, the pointer goes before the data it names, so that nothing half-removed is ever read.
    Lightning's removes the pointer alone."""

    @functools.wraps(original_remove_checkpoint)
    def remove_checkpoint(self: Any, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        # Lightning's removal (its CheckpointIO's) where the store allows, else the store's own
        remove = _storage.open_path(filepath, "remove").remover(functools.partial(original_remove_checkpoint, self, filepath))
        # the checkpoint that replaces this one may still be writing in the background: it goes once that one is in place
        _background.after_publish(self, remove)

    return remove_checkpoint


def load_checkpoint(self: Any, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
    """Weights into the FSDP module and, when fitting, every optimizer's state into its shards; returns the
    rest of the checkpoint for Lightning to restore (loops, callbacks, schedulers). ``weights_only`` (Lightning 2.6's;
    None: the Trainer call's, ``wrap_entry``): ``False`` trusts the checkpoint's pickles to run any code; otherwise
    every one is unpickled restricted, before anything loads."""
    return _loading.load(self, checkpoint_path, _TrainerLoad(self, weights_only))


def wrap_entry(original: Callable) -> Callable:
    """``Trainer.fit``, ``validate``, ``test`` and ``predict`` with Lightning 2.6's ``weights_only=None`` last: the
    loads the call makes (its ``ckpt_path``, with any strategy) take it. ``False`` trusts the checkpoint to run any
    code when unpickled; ``None`` and ``True`` admit what Lightning and torch put into checkpoints only."""
    signature = _signature.with_keyword(original, "weights_only", None, Optional[bool])

    @functools.wraps(original)
    def entry(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        weights_only = bound.arguments.pop("weights_only", None)
        with asking(weights_only=weights_only):
            return original(*bound.args, **bound.kwargs)

    entry.__signature__ = signature  # type: ignore[attr-defined]
    return entry


def wrap_load_from_checkpoint(original: Any) -> classmethod:
    """``LightningModule`` / ``LightningDataModule.load_from_checkpoint(..., weights_only=None, ema=False, **kwargs)``:
    Lightning 2.6's ``weights_only``, which the checkpoint's read takes (2.0.x would pass it on to the model's
    ``__init__``); ``ema=True`` loads the average of the weights ``ShardedEMA`` saved in their place."""
    function = original.__func__

    @functools.wraps(function)
    def load_from_checkpoint(cls: Any, *args: Any, weights_only: Optional[bool] = None, ema: bool = False, **kwargs: Any) -> Any:
        with asking(weights_only=weights_only, average=ema):
            return function(cls, *args, **kwargs)

    signature = _signature.with_keyword(function, "weights_only", None, Optional[bool])
    load_from_checkpoint.__signature__ = _signature.with_keyword(signature, "ema", False, bool)  # type: ignore[attr-defined]
    return classmethod(load_from_checkpoint)


def wrap_on_train_start(original_on_train_start: Callable) -> Callable:
    """The checkpoint entries' last part of a resume (``_participants.Entry.starting``: each rank's random states),
    right before the first epoch."""

    @functools.wraps(original_on_train_start)
    def on_train_start(self: Any) -> None:
        original_on_train_start(self)
        for entry in _participants.entries():
            entry.starting(self.lightning_module.trainer)

    return on_train_start


def patched(strategy: Any) -> bool:
    """Whether ``strategy`` is the FSDP strategy this module patches (patched, not unpatched), or a subclass of it, whose
    own ``save_checkpoint`` or ``load_checkpoint`` may call this module's: every rank makes its saves and loads, so a
    collective may run in them; elsewhere (DDP) rank 0 may save alone."""
    return any(vars(cls).get("save_checkpoint") is save_checkpoint for cls in type(strategy).__mro__)


class _TrainerLoad(_loading.Request):
    """validate/test/predict: the weights are all there is to load; fit: the optimizers too, as many as saved."""

    required = "state_dict"

    def __init__(self, strategy: Any, weights_only: Optional[bool]) -> None:
        super().__init__(weights_only)
        self.strategy = strategy

    def plan(self, path: Location, saved_optimizers: int, verdict: Any) -> _loading.Restore:
        fitting = _fitting(self.strategy)
        if fitting:
            _check_optimizer_count(self.strategy, saved_optimizers, path)
        return _restore(self.strategy, fitting)

    def take(self, checkpoint: Dict[str, Any]) -> Dict[str, Any]:
        return _stored(checkpoint, _participants.of(self.strategy.lightning_module), keep_optimizer_states=True)


def _stored(checkpoint: Dict[str, Any], participants: Sequence[Any], keep_optimizer_states: bool) -> Dict[str, Any]:
    """A Lightning checkpoint's weights, optimizer states and ``participants``' entries, under the keys a sharded one
    stores them by, taken out of ``checkpoint`` (a load leaves ``optimizer_states`` in it, as Lightning's own loading
    does)."""
    optimizer_states = (checkpoint.get if keep_optimizer_states else checkpoint.pop)("optimizer_states", None) or []
    stored = {
        _format.MODEL_KEY: checkpoint.pop("state_dict"),
        **{_format.optimizer_key(index): state for index, state in enumerate(optimizer_states)},
    }
    for participant in participants:
        if participant.full_key in checkpoint:
            stored[participant.key] = checkpoint.pop(participant.full_key)
    return stored


# --- small helpers, all read-only ------------------------------------------------------------------


def _restore(self: Any, fitting: bool) -> _loading.Restore:
    """The Trainer's module and, when fitting, its optimizers, under the keys the Trainer stores them by."""
    optimizers = {_format.optimizer_key(index): optimizer for index, optimizer in enumerate(self.optimizers)}
    return _loading.Restore(
        module=self.model,
        prefix=_prefix(self),
        module_key=_format.MODEL_KEY,
        optimizers=optimizers if fitting else {},
        # LightningModule.strict_loading (the name native Lightning 2.2 uses), True unless set.
        strict=bool(getattr(self.lightning_module, "strict_loading", True)),
        participants={participant.key: participant for participant in _participants.of(self.lightning_module)},
    )


def _fitting(self: Any) -> bool:
    return self.lightning_module.trainer.state.fn == "fit"


def _prefix(self: Any) -> str:
    """The name path from the FSDP-wrapped root to the LightningModule (2.0.x: ``_forward_module.``)."""
    for name, module in self.model.named_modules():
        if module is self.lightning_module:
            name = _format.clean_module_name(name)
            return f"{name}." if name else ""
    return ""


def _check_optimizer_count(self: Any, saved: int, path: Location) -> None:
    if saved == 0 and self.optimizers:
        raise _preflight.weights_only_error(path)
    if saved != len(self.optimizers):
        raise RuntimeError(
            f"You have configured {len(self.optimizers)} optimizers but the checkpoint contains {saved} optimizers"
            " to load. Please resume training with the same number of optimizers or edit the checkpoint manually"
            f" to remove states. (Checkpoint: {str(path)!r}.)"
        )
