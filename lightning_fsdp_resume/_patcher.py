"""Generic, reversible class patching. Knows nothing about checkpoints or Lightning.

Every attribute a patch replaces is remembered exactly as it stood in the class's own ``__dict__``
(or remembered as absent, when the class only inherited it), so ``revert`` restores the class
attribute for attribute and ``get_original`` answers what was there before.
"""
from typing import Any, Callable, Dict, Mapping


class Wrap:
    """A table entry built from the attribute it replaces: ``factory(original) -> replacement``."""

    def __init__(self, factory: Callable[[Any], Any]) -> None:
        self.factory = factory


_ABSENT = object()


def _resolve(cls: type, name: str) -> Any:
    """The raw attribute (function, property, ...) that ``cls.name`` finds along the MRO."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(f"{cls.__qualname__} has no attribute {name!r} to wrap")


class Patcher:
    def __init__(self) -> None:
        self._saved: Dict[type, Dict[str, Any]] = {}

    def apply(self, cls: type, table: Mapping[str, Any]) -> bool:
        """Put every entry of ``table`` on ``cls``. False, and nothing done, when ``cls`` is already patched."""
        if cls in self._saved:
            return False
        saved = {}
        for name, replacement in table.items():
            saved[name] = cls.__dict__.get(name, _ABSENT)
            if isinstance(replacement, Wrap):
                replacement = replacement.factory(_resolve(cls, name))
            setattr(cls, name, replacement)
        self._saved[cls] = saved
        return True

    def revert(self, cls: type) -> bool:
        """Undo ``apply`` exactly. False when ``cls`` was not patched."""
        saved = self._saved.pop(cls, None)
        if saved is None:
            return False
        for name, original in saved.items():
            if original is _ABSENT:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        return True

    def is_patched(self, cls: type) -> bool:
        return cls in self._saved

    def get_original(self, cls: type, name: str) -> Any:
        """What ``cls.__dict__[name]`` held before patching; ``AttributeError`` if the class only inherited it."""
        original = self._saved[cls][name]
        if original is _ABSENT:
            raise AttributeError(f"{cls.__qualname__} did not define {name!r} itself before it was patched")
        return original

    def patched_classes(self) -> list:
        return list(self._saved)
