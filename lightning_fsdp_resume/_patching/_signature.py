"""The patched strategies' ``__init__`` (``wrap_init``: ``state_dict_type``, Fabric's ``async_save``, ``"sharded"``
refused on torch < 2.0) and what tools that read signatures (LightningCLI's jsonargparse, ``inspect.signature``, IDEs)
see of a patched method: the original's parameters plus those the shim adds (``with_keyword``).
"""
import functools
import inspect
from typing import Any, Callable, Optional

from .._checkpoint._format import StateDictType
from . import _torch_compat as compat


def wrap_init(original_init: Callable, default: StateDictType, old_torch_error: Optional[str], async_save: bool = False) -> Callable:
    """``__init__(..., state_dict_type=default)``; Lightning 2.0.x would pass the argument on to FSDP.

    ``old_torch_error``: the ``NotImplementedError`` message for ``"sharded"`` on torch < 2.0 (None: no check
    here). ``async_save``: also take ``async_save=False`` (Fabric's switch for saves in the background). The
    wrapper's signature is the original's plus what it takes.
    """

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, state_dict_type: StateDictType = default, **kwargs: Any) -> None:
        if old_torch_error and state_dict_type == "sharded" and not compat.supports_sharded_checkpoints():
            raise NotImplementedError(old_torch_error)
        background = bool(kwargs.pop("async_save", False)) if async_save else False
        original_init(self, *args, **kwargs)
        self._state_dict_type = state_dict_type
        if async_save:
            self._async_save = background

    signature = with_keyword(original_init, "state_dict_type", default, StateDictType)
    if async_save:
        signature = with_keyword(signature, "async_save", False, bool)
    __init__.__signature__ = signature  # type: ignore[attr-defined]
    return __init__


def with_keyword(original: Any, name: str, default: Any, annotation: Any, keyword_only: bool = False) -> inspect.Signature:
    """``original``'s signature (or ``original`` itself, a signature) plus the parameter ``name``: keyword-only
    before ``**kwargs`` where it has them (the wrapper takes it by keyword and passes the rest on), or when
    asked, else last and positional too."""
    signature = original if isinstance(original, inspect.Signature) else inspect.signature(original)
    parameters = [p for p in signature.parameters.values() if p.name != name]
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if at is None else inspect.Parameter.KEYWORD_ONLY
    if keyword_only or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        kind = inspect.Parameter.KEYWORD_ONLY
    at = len(parameters) if at is None else at
    added = inspect.Parameter(name, kind, default=default, annotation=annotation)
    return signature.replace(parameters=[*parameters[:at], added, *parameters[at:]])
