"""Hook-point discovery and selection.

A *hook point* is a named capture site: ``<module path>.output``, ``<module path>.input.0``,
``<module path>.input.kw.<name>``, leaves of structured outputs by field path
(``<module path>.output.last_hidden_state``, ``<module path>.output.0``) and ``#k`` after the
module path for the k-th call of one module within one forward (``blocks.0#1.output``).
Modules are selected by fnmatch patterns on their ``named_modules()`` names.

A TransformerLens ``HookPoint`` (an identity module that exists to be hooked) is recorded
under its TransformerLens name, the module path itself (``blocks.0.hook_resid_post``,
``blocks.0.attn.hook_z``, ``#k`` appended for later calls in one forward), not
``<path>.output``: its input and output are the same tensor, captured once.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

import torch

from ..errors import HookPointNotFoundError

__all__ = ["select_modules", "hook_point_module", "normalize_patterns", "is_hook_point_module", "rename_hook_point"]


def normalize_patterns(patterns: str | Iterable[str] | None, argument: str) -> list[str] | None:
    """Return ``patterns`` as a list of strings (None stays None).

    Raises
    ------
    TypeError
        If ``patterns`` is not a string or an iterable of strings; names ``argument``.
    """
    if patterns is None:
        return None
    if isinstance(patterns, str):
        return [patterns]
    out = list(patterns)
    for p in out:
        if not isinstance(p, str):
            raise TypeError(f"{argument} must be a list of fnmatch patterns (str), got {p!r} in {patterns!r}")
    return out


def select_modules(
    model: torch.nn.Module,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> list[tuple[str, torch.nn.Module]]:
    """Select the modules of ``model`` to track, in ``named_modules()`` order.

    Parameters
    ----------
    model : torch.nn.Module
        The model; its own name is ``""`` (the root).
    include : list of str, optional
        fnmatch patterns on module names. Default: every submodule (the root excluded,
        since its output repeats its last submodule's; include ``""`` to track it).
    exclude : list of str, optional
        fnmatch patterns removed after ``include``.

    Returns
    -------
    list of (name, module)

    Raises
    ------
    HookPointNotFoundError
        If an ``include`` pattern matches no module, or the selection ends up empty; the
        message lists module names that exist.
    TypeError
        If ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    include = normalize_patterns(include, "include")
    exclude = normalize_patterns(exclude, "exclude")
    named = list(model.named_modules())
    names = [n for n, _ in named]
    if include is None:
        chosen = [(n, m) for n, m in named if n != ""]
        if not chosen:  # a model without submodules: track the root itself
            chosen = named[:1]
    else:
        for pat in include:
            if not any(fnmatch.fnmatchcase(n, pat) for n in names):
                raise HookPointNotFoundError(
                    f"include pattern {pat!r} matches no module of {type(model).__name__}; "
                    f"module names look like {_examples(names)}"
                )
        chosen = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) for p in include)]
    if exclude:
        chosen = [(n, m) for n, m in chosen if not any(fnmatch.fnmatchcase(n, p) for p in exclude)]
    if not chosen:
        raise HookPointNotFoundError(
            f"include={include!r} and exclude={exclude!r} leave no module of {type(model).__name__} to track; "
            f"module names look like {_examples(names)}"
        )
    return chosen


def hook_point_module(hook_point: str) -> str:
    """Module path of a hook point name (``"enc.0#1.output.x"`` -> ``"enc.0"``)."""
    for marker in (".output", ".input"):
        i = hook_point.find(marker)
        while i >= 0:
            rest = hook_point[i + len(marker):]
            if rest == "" or rest.startswith("."):
                return hook_point[:i].split("#")[0]
            i = hook_point.find(marker, i + 1)
    if hook_point.startswith(("output", "input")):
        return ""
    return hook_point.split("#")[0]


def is_hook_point_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a TransformerLens ``HookPoint`` (checked by class, without
    importing TransformerLens)."""
    return any(c.__name__ == "HookPoint" and c.__module__.startswith("transformer_lens")
               for c in type(module).__mro__)


def rename_hook_point(name: str, hook_point_paths: frozenset[str], side: str) -> str | None:
    """The recorded name of the capture site ``name`` (``<path>[#k].output`` or
    ``<path>[#k].input.0``) when ``<path>`` is a TransformerLens ``HookPoint``:
    ``<path>[#k]``; ``None`` for its input when both sides are captured (the same tensor as
    its output). Other names are returned unchanged.
    """
    if not hook_point_paths:
        return name
    for suffix, is_input in ((".output", False), (".input.0", True)):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
            if base.split("#")[0] in hook_point_paths:
                return None if is_input and side == "both" else base
    return name


def _examples(names: Sequence[str], n: int = 8) -> str:
    shown = [repr(x) for x in names if x][:n]
    more = "" if len([x for x in names if x]) <= n else ", ..."
    return "[" + ", ".join(shown) + more + "]"
