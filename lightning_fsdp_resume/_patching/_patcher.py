"""Generic, reversible patching of classes and modules; knows nothing about checkpoints or Lightning. ``revert`` puts
back each attribute as the class's own ``__dict__`` held it (or absent, if inherited), and, like wrapt's
``unwrap_object``, refuses where another library has since replaced one: restoring ours would silently remove theirs.
"""
from typing import Any, Callable, Dict, Mapping, NamedTuple


class Wrap:
    """A table entry built from the attribute it replaces: ``factory(original) -> replacement``."""

    def __init__(self, factory: Callable[[Any], Any]) -> None:
        self.factory = factory


class NotOutermostError(RuntimeError):
    """A patched attribute was replaced by someone else after ``apply``: the class is left as it is."""


_ABSENT = object()


class _Swap(NamedTuple):
    original: Any  # what the class's own __dict__ held, or _ABSENT
    replacement: Any  # what apply put there


def _resolve(cls: Any, name: str) -> Any:
    """The raw attribute (function, property, ...) that ``cls.name`` finds along the MRO (a module: its own)."""
    for klass in getattr(cls, "__mro__", (cls,)):
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(f"{_name(cls)} has no attribute {name!r} to wrap")


def _name(cls: Any) -> str:
    """``module.Class`` for a class, the module's name for a module."""
    qualname = getattr(cls, "__qualname__", None)
    return f"{cls.__module__}.{qualname}" if qualname else cls.__name__


class Patcher:
    def __init__(self) -> None:
        self._saved: Dict[Any, Dict[str, _Swap]] = {}

    def apply(self, cls: Any, table: Mapping[str, Any]) -> bool:
        """Put every entry of ``table`` on ``cls``. False, and nothing done, when ``cls`` is already patched."""
        if cls in self._saved:
            return False
        saved = {}
        for name, replacement in table.items():
            if isinstance(replacement, Wrap):
                replacement = replacement.factory(_resolve(cls, name))
            saved[name] = _Swap(cls.__dict__.get(name, _ABSENT), replacement)
            setattr(cls, name, replacement)
        self._saved[cls] = saved
        return True

    def revert(self, cls: Any) -> bool:
        """Undo ``apply`` exactly. False when ``cls`` was not patched; ``NotOutermostError``, and nothing
        changed, when an attribute ``apply`` set has been replaced since."""
        saved = self._saved.get(cls)
        if saved is None:
            return False
        replaced = [name for name, swap in saved.items() if cls.__dict__.get(name, _ABSENT) is not swap.replacement]
        if replaced:
            raise NotOutermostError(
                f"{_name(cls)}: {', '.join(replaced)} replaced by someone else after it was"
                " patched; restoring the original would remove that change too, so the class is left patched. Undo"
                " that change first, then revert."
            )
        del self._saved[cls]
        for name, swap in saved.items():
            if swap.original is _ABSENT:
                delattr(cls, name)
            else:
                setattr(cls, name, swap.original)
        return True

    def is_patched(self, cls: Any) -> bool:
        return cls in self._saved

    def get_original(self, cls: Any, name: str) -> Any:
        """What ``cls.__dict__[name]`` held before patching; ``AttributeError`` if the class only inherited it."""
        original = self._saved[cls][name].original
        if original is _ABSENT:
            raise AttributeError(f"{_name(cls)} did not define {name!r} itself before it was patched")
        return original

    def patched_classes(self) -> list:
        return list(self._saved)
