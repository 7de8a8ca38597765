"""What the package keeps on objects it does not own, declared in one place: each kind of object carries one
dataclass of this module under one attribute (``ATTRIBUTE``), made on first use by ``held`` and read by ``peek``; a
process-wide setting is a field of ``SETTINGS``; what the user's call in progress asked is an ``Asked`` (``asking``).
A reader of a patched strategy, Lightning's epoch loop or a module sees here everything the package may have left on
it (``_patches.HELD`` says which patched class carries which), and ``tests/test_architecture.py`` holds every other
module to write nothing into an object's ``vars()`` and to keep no context variable of its own.
No torch, no Lightning: the fields' values are the types of the modules that use them.
"""
import contextlib
import contextvars
import dataclasses
import weakref
from typing import Any, Dict, Iterator, Optional, Type, TypeVar

ATTRIBUTE = "_lightning_fsdp_resume"


@dataclasses.dataclass
class StrategyHeld:
    """On a strategy, the Trainer's or Fabric's ``FSDPStrategy``."""

    pending_save: Any = None  # _background.Pending: this rank's save in the background, until it is waited for
    save_group: Any = None  # _background: the background threads' process group
    staging: Any = None  # _background.Staging: the host buffers that saves in the background copy into
    rank_states: Any = None  # _rank_states: a loaded checkpoint's rank states (one per rank), for when fit starts


@dataclasses.dataclass
class ModuleHeld:
    """On a module: a LightningModule (its FSDP root, its checkpoint participants) or an FSDP root (the views its saves made)."""

    fsdp_root: Any = None  # _strategy: the FSDP root a LightningModule's first run made, for every later run
    participants: Dict[str, Any] = dataclasses.field(default_factory=dict)  # _participants: what its checkpoints carry, by key
    views: Dict[Any, Any] = dataclasses.field(default_factory=dict)  # _shard_views: the last save's, by name
    optimizer_views: Any = dataclasses.field(default_factory=weakref.WeakKeyDictionary)  # _shard_views: the same by optimizer (kept while it lives)


@dataclasses.dataclass
class LoopHeld:
    """On Lightning 2.0.x's training epoch loop (``_epoch_loop``)."""

    start: Optional[Dict[str, Any]] = None  # this rank's random states as the epoch's data iterator was made
    pending: Optional[Dict[str, Any]] = None  # this rank's position in the checkpoint being resumed
    end_of_batch: bool = False  # the saved batch was trained, its end was not run
    validation: Optional[bool] = None  # the validation due after it: run (it was interrupted), skip (it ran) or as due
    segment: Optional[Dict[str, int]] = None  # where this epoch's data order stands (``_data_cursor``)
    put_back: Optional[tuple] = None  # Lightning's epoch length and validation interval, changed for a resumed epoch
    stock: bool = False  # this epoch resumes as Lightning resumes it
    rng_after_validation: Optional[Dict[str, Any]] = None  # the saved random states, again once that validation ran


@dataclasses.dataclass
class Settings:
    """The process's settings (``set_mid_epoch_resume``)."""

    mid_epoch: str = "skip"  # _data_position: how a resumed epoch leaves out what was trained (skip, replay, lightning)
    other_rank_counts: str = "exact"  # _data_position: data it cannot place on another number of ranks refused


SETTINGS = Settings()


@dataclasses.dataclass(frozen=True)
class Asked:
    """What the user's call in progress (a Trainer call, ``load_from_checkpoint``) asked of the reads Lightning 2.0.x
    makes inside it without a parameter to pass it by: set by ``asking``, read by ``asked``."""

    weights_only: Optional[bool] = None  # _loading: Lightning 2.6's keyword; False trusts the checkpoint's pickles
    average: bool = False  # _lightning_reads: ``load_from_checkpoint(ema=True)``, the average read as the weights


_ASKED: "contextvars.ContextVar[Asked]" = contextvars.ContextVar("lightning_fsdp_resume_asked", default=Asked())


@contextlib.contextmanager
def asking(**asked: Any) -> Iterator[None]:
    """Inside this block, ``asked()`` answers ``asked`` (Asked's fields) and the rest as outside it."""
    token = _ASKED.set(dataclasses.replace(_ASKED.get(), **asked))
    try:
        yield
    finally:
        _ASKED.reset(token)


def asked() -> Asked:
    """What the call in progress asked (``Asked()`` outside every ``asking`` block)."""
    return _ASKED.get()
Held = TypeVar("Held", StrategyHeld, ModuleHeld, LoopHeld)


def held(obj: Any, kind: Type[Held]) -> Held:
    """``obj``'s ``kind``, made empty the first time it is asked for."""
    found = peek(obj, kind)
    if found is None:
        found = vars(obj)[ATTRIBUTE] = kind()  # not through setattr: a module would take it for an attribute of its own
    return found


def peek(obj: Any, kind: Type[Held]) -> Optional[Held]:
    """``obj``'s ``kind`` where it has one, without making it."""
    found = vars(obj).get(ATTRIBUTE)
    if found is not None and not isinstance(found, kind):
        raise TypeError(f"lightning_fsdp_resume: {type(obj).__name__} holds a {type(found).__name__}, not a {kind.__name__}")
    return found


def drop(obj: Any) -> None:
    """``obj`` without what the package kept on it."""
    vars(obj).pop(ATTRIBUTE, None)
