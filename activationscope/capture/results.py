"""Result dicts of a capture: ``{hook_point: ...}`` and ``{reduction name: Tensor}`` whose
missing key raises our KeyError subclass naming the keys there are (the store's reductions
use them too)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Mapping

from ..errors import HookPointNotFoundError, ReductionNotFoundError, hook_point_hint


def main_result_key(kind: str, result: Mapping[str, Any]) -> str | None:
    """The key of ``result`` (a reduction's ``result()``) that is its main value, stored and
    shown under the reduction's own name: the kind's key (``"mean"``), else ``"value"``, else
    the only key that is not ``"count"``. None when there is none -- a reduction that saw no
    rows has only its ``count`` (0), which is never shown as the value."""
    if kind in result:
        return kind
    if "value" in result:
        return "value"
    keys = [k for k in result if k != "count"]
    return keys[0] if len(keys) == 1 and len(result) == 1 else None


class _Results(dict):
    """A dict whose missing key raises ``_error`` with the message of :meth:`_missing_message`."""

    _error: type = KeyError

    def _missing_message(self, key: str) -> str:
        raise NotImplementedError

    def __missing__(self, key: str):
        raise self._error(self._missing_message(key))

    def __reduce__(self):
        # pickled as an OrderedDict of the same items (torch.save(tracker.activations), of
        # tracker.reductions and of a store's reductions): torch.load, whose weights_only=True
        # loads no class of ours (nor a dict built by a call), reads it back
        return OrderedDict, (), None, None, iter(self.items())


class HookPointResults(_Results):
    """``{hook_point: value}``; a missing hook point raises :class:`HookPointNotFoundError`
    naming the hook points there are (``what``: what the values are, for the message)."""

    _error = HookPointNotFoundError

    def __init__(self, what: str, *args, hint: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.what = what
        #: whether the keys are every hook point (a missing one is then no hook point: the names
        #: closest to it are suggested)
        self.hint = hint

    def _missing_message(self, hook_point: str) -> str:
        return (f"hook point {hook_point!r} has no {self.what}; hook points with {self.what}: {sorted(self)}"
                + (hook_point_hint(hook_point, self) if self.hint else ""))


class ReductionResults(_Results):
    """``{reduction name: Tensor}`` of one hook point; a missing name raises
    :class:`ReductionNotFoundError` naming the hook point and the names there are, and the
    name of an entry the store refuses (left out) raises its :class:`StoreCorruptError`."""

    _error = ReductionNotFoundError

    def __init__(self, hook_point: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hook_point = hook_point
        #: ``{name: make_error}`` of the entries a store refuses (``Store.refused_reductions``):
        #: left out of the dict, and indexing one raises ``make_error()`` (a new error each time)
        self.refused: dict[str, Callable[[], Exception]] = {}

    def __missing__(self, name: str):
        if name in self.refused:
            raise self.refused[name]()
        return super().__missing__(name)

    def _missing_message(self, name: str) -> str:
        count = dict.get(self, f"{name}.count")
        if count is not None and count.numel() == 1 and int(count) == 0:
            return (f"reduction {name!r} of hook point {self.hook_point!r} saw no rows ({name}.count is 0), "
                    "so it has no value; capture rows of it first")
        keys = sorted(k for k in self if isinstance(k, str) and isinstance(name, str) and k.startswith(name + ".")
                      and k != f"{name}.count")
        hint = ""
        if keys:  # (a reduction of several results, topk or hist: no value under its own name)
            hint = (f"; {name!r} holds several results, read each by its key: {keys} (a reduction's results are "
                    "'<name>' and '<name>.<key>')")
        elif isinstance(name, str):
            import difflib

            close = difflib.get_close_matches(name, [k for k in self if isinstance(k, str)], n=3, cutoff=0.7)
            hint = f"; did you mean {close}?" if close else ""
        return f"hook point {self.hook_point!r} has no reduction {name!r}{hint}; its reductions: {sorted(self)}"
