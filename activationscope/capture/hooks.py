"""Hook-point discovery and selection.

A *hook point* is a named capture site: ``<module path>.output``, ``<module path>.input.0``,
``<module path>.input.kw.<name>``, leaves of structured outputs by field path
(``<module path>.output.last_hidden_state``, ``<module path>.output.0``) and ``#k`` after the
module path for the k-th call of one module within one forward (``blocks.0#1.output``).
Modules are selected by fnmatch patterns on their ``named_modules()`` names; a pattern equal to a
name selects that name only (:func:`pattern_hits`), so ``"d.a[1]"`` names the module ``d.a[1]``
rather than the character class that matches ``d.a1``.

A TransformerLens ``HookPoint`` (an identity module that exists to be hooked) is recorded
under its TransformerLens name, the module path itself (``blocks.0.hook_resid_post``,
``blocks.0.attn.hook_z``, ``#k`` appended for later calls in one forward), not
``<path>.output``: its input and output are the same tensor, captured once.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..errors import (ArgumentTypeError, CaptureError, CaptureWarning, HookPointNotFoundError, name_repr, names_repr,
                      warn_at_caller)

__all__ = ["select_modules", "hook_point_module", "normalize_patterns", "is_hook_point_module", "rename_hook_point",
           "pattern_hits", "pattern_selects", "bracket_hint", "block_stacks", "block_modules", "never_called_type",
           "named_modules", "peft_holds"]


def pattern_hits(pattern: str, names: Iterable[str]) -> list[str]:
    """The names that ``pattern`` selects, in the order of ``names``.

    Exact names first: a pattern equal to one of ``names`` selects that name only (a module
    or hook point may contain ``[``, ``]``, ``*`` or ``?``, as the keys of an
    ``nn.ModuleDict`` can); any other pattern selects the names it matches with
    ``fnmatch.fnmatchcase`` (case-sensitive). The same rule as ``ActivationDataset(hook_points=...)``,
    :func:`~activationscope.data.export_parquet` and the CLI's ``--hook-points``.

    Parameters
    ----------
    pattern : str
        A name or an fnmatch pattern.
    names : iterable of str
        The names to choose from (module names or hook points).

    Returns
    -------
    list of str
        The selected names (empty when none matches).
    """
    names = list(names)
    if pattern in names:
        return [pattern]
    return [n for n in names if fnmatch.fnmatchcase(n, pattern)]


def pattern_selects(pattern: str, name: str, names: Any = None) -> bool:
    """Whether ``pattern`` selects ``name``, one name at a time (the rule of
    :func:`pattern_hits` when not every name is at hand yet: ``reductions=`` and
    ``token_rows=`` patterns meet hook points as they appear): a pattern equal to ``name``
    does; a pattern equal to another of ``names`` (the names there can be) selects that one
    only; any other pattern selects what ``fnmatch.fnmatchcase`` matches."""
    if pattern == name:
        return True
    if names is not None and pattern in names:
        return False
    return fnmatch.fnmatchcase(name, pattern)


def check_column(key: str, col: Any) -> None:
    """A row-table column given to ``set_batch`` / ``add_batch`` is a sequence or tensor
    with one entry per sample: anything else raises ArgumentTypeError naming it."""
    if col is None or isinstance(col, (str, bytes)) or not hasattr(col, "__len__"):
        raise ArgumentTypeError(
            f"column {key!r} must be a sequence or tensor with one entry per sample, got "
            f"{type(col).__name__}; drop it from set_batch() to stop recording it"
        )


def normalize_patterns(patterns: str | Iterable[str] | None, argument: str) -> list[str] | None:
    """Return ``patterns`` as a list of strings (None stays None).

    Raises
    ------
    ArgumentTypeError
        If ``patterns`` is not a string or an iterable of strings; names ``argument``.
    """
    if patterns is None:
        return None
    if isinstance(patterns, str):
        return [patterns]
    try:
        out = list(patterns)
    except TypeError:
        raise ArgumentTypeError(f"{argument} must be a str or a list of fnmatch patterns (str), got "
                                f"{patterns!r}") from None
    for p in out:
        if not isinstance(p, str):
            raise ArgumentTypeError(f"{argument} must be a list of fnmatch patterns (str), got {p!r} in {patterns!r}")
    return out


def select_modules(
    model: torch.nn.Module,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> list[tuple[str, torch.nn.Module]]:
    """Select the modules of ``model`` to track, in ``named_modules()`` order (a submodule
    replaced by its ``torch.compile`` wrapper named as in the eager model: :func:`named_modules`).

    Parameters
    ----------
    model : torch.nn.Module
        The model; its own name is ``""`` (the root).
    include : list of str, optional
        Module names or fnmatch patterns on them; a pattern equal to a module name selects
        that module only (see :func:`pattern_hits`). Default: every submodule (the root excluded,
        since its output repeats its last submodule's; include ``""`` to track it). The
        ``out_proj`` of an ``nn.MultiheadAttention``, which that module never calls, is
        selected only when a pattern names it exactly.
        Modules inside a TorchScript module (``torch.jit.script`` / ``trace``) cannot be
        tracked: they are replaced by their outermost scripted ancestor, with a
        :class:`~activationscope.errors.CaptureWarning` naming them. So are modules of a
        ``torch.fx.GraphModule`` that its graph never calls (all of
        ``torch.export.export(...).module()``): replaced by that GraphModule. The packed
        weights of quantized ``Linear`` / ``Embedding`` modules and the ``GuardsFn`` of a
        ``torch.export`` module, never called by their parents, are selected only when named
        exactly; so are the parametrizations of ``torch.nn.utils.parametrize``
        (``<module>.parametrizations.weight...`` of ``weight_norm``, ``orthogonal``,
        ``spectral_norm``), which compute a weight, not an activation.
    exclude : list of str, optional
        Module names or fnmatch patterns (same rule as ``include``) removed after
        ``include``; a pattern that matches no module warns
        (:class:`CaptureWarning`), as it excludes nothing.

    Returns
    -------
    list of (name, module)

    Raises
    ------
    HookPointNotFoundError
        If an ``include`` pattern matches no module, or the selection ends up empty; the
        message lists module names that exist, or, for a pattern naming a module registered
        under several names by one of its later names (``named_modules()`` lists it once,
        under its first), that first name.
    CaptureError
        If two selected modules are ``P`` and ``P#<k>`` (``k`` digits, e.g. the ``nn.ModuleDict``
        keys ``"a"`` and ``"a#1"``): ``P#<k>.output`` also names the repeated call ``#k`` of
        ``P``, so their rows could end up in one array. Rename one, or exclude it.
    TypeError
        If ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    include = normalize_patterns(include, "include")
    exclude = normalize_patterns(exclude, "exclude")
    named = named_modules(model)
    names = [n for n, _ in named]
    # nn.MultiheadAttention never calls its out_proj (it passes the weights to
    # F.multi_head_attention_forward): selected only when named exactly (then the capture
    # warns that it recorded nothing)
    never_called = {f"{n}.out_proj" if n else "out_proj" for n, m in named if type(m) is torch.nn.MultiheadAttention}
    # nor are the packed weights of a quantized Linear / Embedding, nor the input check of a
    # torch.export module (GuardsFn, which returns nothing): selected only when named exactly
    never_called |= {n for n, m in named if n and never_called_type(m)}
    # the parametrizations of torch.nn.utils.parametrize (weight_norm, orthogonal, spectral_norm,
    # ...) compute a weight each time it is read, not an activation of the forward: selected
    # only when named exactly (their rows would be the weight's)
    weights = [f"{n}.parametrizations" if n else "parametrizations" for n, m in named if _parametrized(m)]
    never_called |= {n for n in names if any(n == w or n.startswith(w + ".") for w in weights)}
    if include is None:
        chosen = [(n, m) for n, m in named if n != "" and n not in never_called]
        if not chosen:  # a model without submodules: track the root itself
            chosen = named[:1]
    else:
        included: set[str] = set()
        for pat in include:
            hits = pattern_hits(pat, names)
            bracket = bracket_hint(pat, names, hits, "include", "modules")
            if not hits:
                raise HookPointNotFoundError(
                    f"include pattern {pat!r} matches no module of {type(model).__name__}"
                    + (bracket or _shared_names_hint(model, named, pat, "include")
                       or wrapper_hint(model, pat, names, "include")
                       or f"; module names look like {_examples(names)}" + _hook_point_hint(pat, names, named))
                )
            if bracket:
                warn_at_caller(f"include pattern {pat!r} selects {_examples(hits)}{bracket}", CaptureWarning)
            included.update(hits)
        chosen = [(n, m) for n, m in named if n in included and (n not in never_called or n in include)]
    chosen = _replace_scripted(model, named, chosen, explicit=include is not None)
    chosen = _replace_inlined(model, named, chosen, explicit=include is not None)
    if exclude:
        excluded: set[str] = set()
        for pat in exclude:
            hits = pattern_hits(pat, names)
            bracket = bracket_hint(pat, names, hits, "exclude", "modules", "leaves out")
            if bracket and hits:
                warn_at_caller(f"exclude pattern {pat!r} leaves out {_examples(hits)}{bracket}", CaptureWarning)
            if not hits:
                close = _close_names(pat, names)
                warn_at_caller(
                    f"exclude pattern {pat!r} matches no module of {type(model).__name__}, so it excludes nothing"
                    + (bracket or _shared_names_hint(model, named, pat, "exclude")
                       or wrapper_hint(model, pat, names, "exclude")
                       or f"; module names look like {_examples(names)}" + (f"; did you mean {names_repr(close)}?" if close else "")),
                    CaptureWarning,
                )
            excluded.update(hits)
        chosen = [(n, m) for n, m in chosen if n not in excluded]
    if not chosen:
        raise HookPointNotFoundError(
            f"include={include!r} and exclude={exclude!r} leave no module of {type(model).__name__} to track; "
            f"module names look like {_examples(names)}"
        )
    _refuse_call_index_names(chosen, type(model).__name__)
    _refuse_unencodable_names(chosen, type(model).__name__)
    return chosen


def bracket_hint(pattern: str, names: Iterable[str], hits: Sequence[str], argument: str, noun: str = "hook points",
                 verb: str = "selects", spelled: str | None = None) -> str:
    """For a pattern holding ``[`` (``d.a[1].*``, meant for the names below the
    ``nn.ModuleDict`` key ``a[1]``) that fnmatch reads as a character class (one of ``1``), so
    that it selects other names than those holding the brackets themselves: ``"; ..."`` naming
    those and the pattern that selects them (``d.a[[]1].*``). ``""`` when the pattern holds no
    ``[``, equals one of ``names`` (an exact name selects itself only), no name holds its
    brackets, or both readings select the same names. The same text for every argument that
    takes patterns: ``include=`` / ``exclude=``, ``reductions=`` / ``token_rows=`` /
    ``exclude_hook_points=`` keys, ``ActivationDataset(hook_points=...)``, ``--hook-points``.

    Parameters
    ----------
    pattern : str
        The pattern as given.
    names : iterable of str
        The names the pattern chooses from (module names or hook points).
    hits : sequence of str
        What the pattern selected (:func:`pattern_hits`).
    argument : str
        The argument's name, as the fix spells it (``include`` gives ``include=['d.a[[]1].*']``).
    noun, verb : str
        What ``names`` are (``"modules"``) and what the argument does with them (``"leaves out"``).
    spelled : str, optional
        The fix's spelling with ``{}`` where the escaped pattern goes (``"--hook-points {}"``);
        default ``"<argument>=[{}]"``.
    """
    names = list(names)
    if "[" not in pattern or pattern in names:
        return ""
    literal = pattern.replace("[", "[[]")
    held = [n for n in names if fnmatch.fnmatchcase(n, literal)]
    if not held or held == list(hits):
        return ""
    fix = (spelled or argument + "=[{}]").replace("{}", repr(literal))
    return (f"; fnmatch reads '[...]' in it as a character class (one of its characters): the {noun} whose names "
            f"hold those brackets are {_examples(held)}, which {fix} {verb}")


def _refuse_unencodable_names(chosen: list[tuple[str, torch.nn.Module]], model_name: str) -> None:
    """Refuse a tracked module whose name is no UTF-8 text (a lone surrogate, such as
    ``os.fsdecode`` makes of a file name's undecodable byte): hook points name arrays, files
    and row-table columns, all UTF-8, so it could be stored under no name."""
    for n, _ in chosen:
        try:
            n.encode("utf-8")
        except UnicodeEncodeError as e:
            raise CaptureError(
                f"tracked module {ascii(n)} of {model_name} has a name that is not UTF-8 text (the character "
                f"{ascii(n[e.start])} at {e.start}, a lone surrogate), so no hook point can be named after it; rename "
                f"the module (its nn.ModuleDict key), or pass exclude=[{n!r}] to track()"
            ) from None


def named_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``model.named_modules()``, with a ``torch.compile`` wrapper inside the model
    (``model.layer = torch.compile(model.layer)``, an ``OptimizedModule``) replaced by the
    module it wraps, under the wrapper's name: its modules named as in the eager model
    (``layer.fc1``, not ``layer._orig_mod.fc1``), each listed as itself (a fused layer, a
    dropout, a HookPoint is recognised by its type), and captured inside the compiled graph.
    Modules registered under several names are listed once, under the first."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(dynamo, "OptimizedModule", None)
    if optimized is None or not any(isinstance(m, optimized) for m in model.modules()):
        return list(model.named_modules())
    out: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    while stack:
        prefix, module = stack.pop()
        while isinstance(module, optimized):  # the wrapped module, under the wrapper's name
            seen.add(id(module))
            module = module._orig_mod
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append((prefix, module))
        children = [(f"{prefix}.{n}" if prefix else n, c) for n, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))
    return out


def block_stacks(model: torch.nn.Module) -> list[str]:
    """Module names of ``model``'s stacks of repeated blocks, in ``named_modules()`` order.

    A stack is an ``nn.ModuleList`` (or ``nn.Sequential``) whose children are all instances
    of one class, each holding submodules and parameters of its own (a transformer layer,
    not a ``Linear`` or a parameterless pool), and that lies inside no other such stack (the
    experts of a mixture-of-experts layer are inside the layers' stack). Found by structure,
    not by architecture names: ``encoder.layer`` of BERT, ``h`` / ``transformer.h`` of GPT-2,
    ``layers`` / ``model.layers`` of Llama-style models, ``gpt_neox.layers``; both
    ``encoder.layers`` and ``decoder.layers`` of an encoder-decoder model. The model itself
    is a stack when it is one (``""``).

    Parameters
    ----------
    model : torch.nn.Module

    Returns
    -------
    list of str
        The stacks' module names; empty when the model has none.

    Raises
    ------
    ArgumentTypeError
        ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(module.children())
        if not children or len({type(c) for c in children}) != 1:
            continue
        if not all(next(c.children(), None) is not None and next(c.parameters(), None) is not None
                   for c in children):
            continue
        if any(name == s or s == "" or name.startswith(s + ".") for s in found):  # inside a stack found
            continue
        found.append(name)
    return found


def block_modules(model: torch.nn.Module) -> list[str]:
    """Module names of the blocks of ``model``'s stacks (:func:`block_stacks`): every
    child of every stack, ``encoder.layer.0``, ``encoder.layer.1``, ... Each block's
    ``output`` hook point is the residual stream after that block: for a Hugging Face model,
    ``hidden_states[i + 1]`` of ``output_hidden_states=True`` (where the model normalises its
    last hidden state, GPT-2's ``ln_f`` or Llama's ``norm``, the last block's output is that
    state before the norm).

    Returns
    -------
    list of str
        Module names in ``named_modules()`` order, usable as ``include=`` patterns (each
        selects that module only); empty when the model has no stack.

    Raises
    ------
    ArgumentTypeError
        ``model`` is not an ``nn.Module``.
    """
    out: list[str] = []
    for stack in block_stacks(model):
        module = model.get_submodule(stack)
        out.extend(f"{stack}.{child}" if stack else child for child, _ in module.named_children())
    return out


def _refuse_call_index_names(chosen: list[tuple[str, torch.nn.Module]], model_name: str) -> None:
    """Refuse two tracked modules ``P`` and ``P#<k>`` (an ``nn.ModuleDict`` key ``"a#1"`` next to
    ``"a"``): the hook points of ``P#<k>`` are the names of the (k+1)-th call of ``P`` in one
    forward, so a forward calling ``P`` twice and another calling ``P#<k>`` would store the rows
    of two modules as one array."""
    tracked = {n for n, _ in chosen}
    for n, _ in chosen:
        base, sep, k = n.rpartition("#")
        if sep and k.isdigit() and k.isascii() and base in tracked:
            raise CaptureError(
                f"tracked module {n!r} of {model_name} is named like the repeated call #{k} of the tracked module "
                f"{base!r}: the hook points of both would be {n + '.output'!r}, so the rows of two modules could be "
                f"stored as one array; rename the module (its nn.ModuleDict key), or pass exclude=[{n!r}] "
                f"(or [{base!r}]) to track()"
            )


def _scripted_owner(name: str, by_name: dict[str, torch.nn.Module]) -> str | None:
    """Path of the outermost TorchScript module strictly above ``name`` (None if there is none)."""
    parts = name.split(".") if name else []
    for i in range(len(parts)):
        path = ".".join(parts[:i])
        if isinstance(by_name.get(path), torch.jit.ScriptModule):
            return path
    return None


def _replace_scripted(
    model: torch.nn.Module,
    named: list[tuple[str, torch.nn.Module]],
    chosen: list[tuple[str, torch.nn.Module]],
    explicit: bool,
) -> list[tuple[str, torch.nn.Module]]:
    """Modules inside a TorchScript module (``torch.jit.script`` / ``trace``) are called by
    TorchScript, never through Python, so no wrapper can see them: drop them, track their
    outermost scripted ancestor instead (its own output), and say so once."""
    by_name = dict(named)
    dropped: dict[str, list[str]] = {}
    out: list[tuple[str, torch.nn.Module]] = []
    for n, m in chosen:
        owner = _scripted_owner(n, by_name)
        if owner is None:
            out.append((n, m))
        else:
            dropped.setdefault(owner, []).append(n)
    if not dropped:
        return chosen
    have = {n for n, _ in out}
    for owner in dropped:
        if owner not in have:  # the default selection drops the root, but here it is all there is
            out.append((owner, by_name[owner]))
            have.add(owner)
    order = {n: i for i, (n, _) in enumerate(named)}
    out.sort(key=lambda nm: order[nm[0]])
    inner = sorted(n for names in dropped.values() for n in names)
    shown = inner[:8] + (["..."] if len(inner) > 8 else [])
    owners = ", ".join(repr(o) if o else "the model itself" for o in dropped)
    warn_at_caller(
        f"{len(inner)} {'selected ' if explicit else ''}module(s) of {type(model).__name__} are inside TorchScript "
        f"({owners}) and cannot be tracked: TorchScript calls them without Python {shown}. "
        f"Tracking {owners} instead (its own output); to see inside, track the eager model before "
        "torch.jit.script / torch.jit.trace",
        CaptureWarning,
    )
    return out


# types of modules that their parent never calls: qualified class names
_NEVER_CALLED_TYPES = frozenset({
    "torch.ao.nn.quantized.modules.linear.LinearPackedParams",  # quantized (dynamic) Linear's packed weights
    "torch.ao.nn.quantized.modules.embedding_ops.EmbeddingPackedParams",
    "torch.export._unlift.GuardsFn",  # a torch.export module's input check: returns nothing
})


def _parametrized(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds ``torch.nn.utils.parametrize`` parametrizations."""
    from torch.nn.utils import parametrize

    return parametrize.is_parametrized(module)


def never_called_type(module: torch.nn.Module) -> bool:
    """Whether ``module`` is of a type its parent never calls (:data:`_NEVER_CALLED_TYPES`)."""
    t = type(module)
    return f"{t.__module__}.{t.__qualname__}" in _NEVER_CALLED_TYPES


def _called_modules(model: torch.nn.Module) -> set[int] | None:
    """``id()`` of every module of ``model`` that a forward of it can call, when ``model`` holds
    a ``torch.fx.GraphModule`` (None when it holds none: every module may be called). A
    GraphModule calls only the targets of its graph's ``call_module`` nodes; the modules it
    holds for their parameters (every module of ``torch.export.export(...).module()``, a module
    ``torch.fx.symbolic_trace`` traced through) are never called. Any other module is taken to
    call each of its children."""
    graph_module = torch.fx.GraphModule
    if not any(isinstance(m, graph_module) for m in model.modules()):
        return None
    called: set[int] = set()
    stack = [model]
    while stack:
        m = stack.pop()
        if id(m) in called:
            continue
        called.add(id(m))
        if isinstance(m, graph_module):
            for node in m.graph.nodes:
                if node.op == "call_module" and isinstance(node.target, str):
                    try:
                        stack.append(m.get_submodule(node.target))
                    except AttributeError:  # (a graph naming no module of it fails when it runs)
                        pass
        else:
            stack.extend(m.children())
    return called


def _replace_inlined(
    model: torch.nn.Module,
    named: list[tuple[str, torch.nn.Module]],
    chosen: list[tuple[str, torch.nn.Module]],
    explicit: bool,
) -> list[tuple[str, torch.nn.Module]]:
    """Modules of a ``torch.fx.GraphModule`` that its graph never calls (it computes them
    inline from their parameters: ``torch.export.export(...).module()``, and the modules
    ``torch.fx.symbolic_trace`` traced through) can record nothing: drop them, track the
    GraphModule that computes them instead (its own output), and say so once. Containers whose
    children are called (``mlp`` of ``mlp.fc1`` in a symbolic_trace GraphModule, which traced
    through ``mlp``'s forward) are dropped (they have no call of their own), named in a CaptureWarning."""
    called = _called_modules(model)
    if called is None:
        return chosen
    graphs = {n for n, m in named if isinstance(m, torch.fx.GraphModule) and id(m) in called}
    by_name = dict(named)
    dropped: dict[str, list[str]] = {}
    traced_through: dict[str, list[str]] = {}
    out: list[tuple[str, torch.nn.Module]] = []
    for n, m in chosen:
        if id(m) in called:
            out.append((n, m))
            continue
        parts = n.split(".")
        owner = next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)) if p in graphs), None)
        if owner is None:  # (not below a GraphModule that runs: a module nothing calls, warned about after the capture)
            out.append((n, m))
        elif any(id(sub) in called for sub in m.modules()):
            traced_through.setdefault(owner, []).append(n)  # a container of called modules: no call of its own
        else:
            dropped.setdefault(owner, []).append(n)
    if traced_through:
        inner = sorted(n for names in traced_through.values() for n in names)
        shown = inner[:8] + (["..."] if len(inner) > 8 else [])
        owners = ", ".join(repr(o) if o else "the model itself" for o in traced_through)
        alone = not out and not dropped  # nothing else selected: the GraphModule's own output instead
        warn_at_caller(
            f"{len(inner)} {'selected ' if explicit else ''}module(s) of {type(model).__name__} have no hook point of "
            f"their own {shown}: the torch.fx graph of {owners} calls modules inside them, never them (torch.fx traced "
            "through their forward, or they only hold modules, as a ModuleList), so their outputs are not recorded"
            + (f". Tracking {owners} instead (its own output)" if alone else "")
            + ". Track the eager model to record them, or trace with them as leaves (a torch.fx.Tracer whose "
            "is_leaf_module returns True for them)",
            CaptureWarning,
        )
        if alone:
            dropped = {o: [] for o in traced_through}
    if not dropped:
        return out if traced_through else chosen
    have = {n for n, _ in out}
    for owner in dropped:
        if owner not in have:
            out.append((owner, by_name[owner]))
            have.add(owner)
    order = {n: i for i, (n, _) in enumerate(named)}
    out.sort(key=lambda nm: order[nm[0]])
    inner = sorted(n for names in dropped.values() for n in names)
    if not inner:
        return out
    shown = inner[:8] + (["..."] if len(inner) > 8 else [])
    owners = ", ".join(repr(o) if o else "the model itself" for o in dropped)
    kinds = ", ".join(sorted({type(by_name[o]).__name__ for o in dropped}))
    warn_at_caller(
        f"{len(inner)} {'selected ' if explicit else ''}module(s) of {type(model).__name__} are never called by the "
        f"torch.fx graph of {owners} ({kinds}), which computes them inline from their parameters, so they cannot be "
        f"tracked {shown}. Tracking {owners} instead (its own output). To see inside: for "
        "torch.export.export(model, args), track the eager model or torch.export.unflatten(exported_program), "
        "whose modules are called; for torch.fx.symbolic_trace, track the eager model or trace with these modules "
        "as leaves (a torch.fx.Tracer whose is_leaf_module returns True for them)",
        CaptureWarning,
    )
    return out


def hook_point_module(hook_point: str, modules: Any = None, hook_point_paths: Any = ()) -> str:
    """Module path of a hook point name (``"enc.0#1.output.x"`` -> ``"enc.0"``).

    A module may itself be called ``output`` or ``input`` (Hugging Face BERT's
    ``encoder.layer.0.output``, a ``BertOutput``, and its ``encoder.layer.0.output.dense``), so
    a name can be read several ways; ``modules`` (the module paths there are) picks the
    longest of them that is a module (``"encoder.layer.0.output.dense.output"`` ->
    ``"encoder.layer.0.output.dense"``). Without it, or when none is, the first reading.

    The whole name is read as a module path only when it is one of ``hook_point_paths``
    (the paths of TransformerLens ``HookPoint`` modules, recorded under their own names):
    BERT's ``"encoder.layer.0.output"`` is the output of ``encoder.layer.0``, never the
    ``BertOutput`` module at that path (whose output is ``"encoder.layer.0.output.output"``).
    """
    if modules is not None:
        known = [m for m in _module_readings(hook_point, hook_point_paths) if m in modules]
        if known:
            return max(known, key=len)
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


def _module_readings(hook_point: str, hook_point_paths: Any = ()) -> list[str]:
    """Every module path ``hook_point`` can be read as: the part before each ``.output`` /
    ``.input`` that ends a name part (``#k`` dropped), the root for a name starting with
    ``output`` / ``input``, and the whole name (``#k`` dropped) when it is one of
    ``hook_point_paths`` (a TransformerLens ``HookPoint``, recorded under its path)."""
    out = [""] if hook_point.startswith(("output", "input")) else []
    for marker in (".output", ".input"):
        i = hook_point.find(marker)
        while i >= 0:
            rest = hook_point[i + len(marker):]
            if rest == "" or rest.startswith("."):
                out.append(hook_point[:i].split("#")[0])
                out.append(hook_point[:i])  # (a module whose own name holds a '#': a ModuleDict key "g#h")
            i = hook_point.find(marker, i + 1)
    whole = hook_point.split("#")[0]
    if whole in hook_point_paths:
        out.append(whole)
    return out


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


# the attribute under which a wrapper holds the model it wraps: nn.DataParallel and
# DistributedDataParallel (module), FSDP's FullyShardedDataParallel (_fsdp_wrapped_module),
# torch.distributed's checkpoint_wrapper / offload_wrapper (_checkpoint_wrapped_module)
_WRAPPED_ATTRS = ("module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def without_wrappers(name: str) -> str:
    """``name`` (a module name or hook point) without the attributes of the wrappers on its path
    (``module.fc1.output`` of a ``DataParallel`` gives ``fc1.output``)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPED_ATTRS)


def _without_wrappers_of(model: torch.nn.Module, name: str) -> str:
    """:func:`without_wrappers` of ``name`` of ``model``, leaving out only the attributes of
    modules that are wrappers: a ``module`` child of an ``nn.DataParallel`` /
    ``DistributedDataParallel`` or of a module holding that child only (not the submodule
    ``module`` of a model that holds others: its names are as written)."""
    kept: list[str] = []
    holder: torch.nn.Module | None = getattr(model, "_orig_mod", model)  # (a torch.compile'd model: as in it)
    for part in name.split("."):
        child = holder._modules.get(part) if holder is not None else None
        if part in _WRAPPED_ATTRS and isinstance(child, torch.nn.Module) and (
                part != "module" or isinstance(holder, _DATA_PARALLEL) or list(holder._modules) == ["module"]):
            holder = child
            continue
        if peft_holds(holder, part, child):
            holder = child
            continue
        kept.append(part)
        holder = child if isinstance(child, torch.nn.Module) else None
    return ".".join(kept)


_DATA_PARALLEL = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def peft_holds(holder: torch.nn.Module | None, part: str, child: Any) -> bool:
    """Whether ``part`` of a name is PEFT's wrapping, not the model's: a ``PeftModel`` holds its
    tuner as ``base_model``, which holds the model as ``model`` (both have ``peft_config``)."""
    return (part in ("base_model", "model") and isinstance(child, torch.nn.Module) and hasattr(holder, "peft_config")
            and (part == "model" or callable(getattr(holder, "get_base_model", None))))


def wrapper_hint(model: torch.nn.Module, pattern: str, names: list[str], argument: str, noun: str = "modules",
                 spelled: str | None = None) -> str:
    """For a pattern that selects no module of ``model`` but would, were the wrappers'
    attributes (``module.`` of ``nn.DataParallel`` / ``DistributedDataParallel``,
    ``_fsdp_wrapped_module.`` of FSDP, ...) left out of the names: the names to write, and
    that tracking the wrapped model itself names hook points as in it. Else ``""``."""
    unwrapped: dict[str, list[str]] = {}
    for n in names:
        bare = _without_wrappers_of(model, n)
        if bare != n and bare:
            unwrapped.setdefault(bare, []).append(n)
    hits = pattern_hits(pattern, list(unwrapped))
    if not hits:
        return ""
    real = [n for h in hits for n in unwrapped[h]]
    leads = {n[: len(n) - len(h)] for h in hits for n in unwrapped[h] if n.endswith("." + h)}
    if len(leads) == 1 and all(n.endswith("." + h) for h in hits for n in unwrapped[h]):
        written: Any = leads.pop() + pattern  # (the wrappers are all in front: "module." + pattern)
    else:  # (wrappers inside the path: the names themselves)
        written = real[:8]
    shown = repr([written] if isinstance(written, str) else written)
    if spelled is not None:  # (a mapping's key: reductions={'module.fc1.output': ...})
        shown = spelled.format(repr(written) if isinstance(written, str) else shown)
    hint = (f": the {noun} of {type(model).__name__} are named with the attributes of the wrappers that hold them "
            f"({real[0]!r} for {hits[0]!r}): {argument}={shown}")
    inner = next((a for a in _WRAPPED_ATTRS if isinstance(model._modules.get(a), torch.nn.Module)
                  and _without_wrappers_of(model, a) == ""), None)
    if inner is not None:
        hint += (f", or track the wrapped model itself (model.{inner}, a {type(model._modules[inner]).__name__}): its "
                 "hook points are then named as without the wrapper")
    elif callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
        hint += (f", or track the model it wraps (model.get_base_model(), a {type(model.get_base_model()).__name__}) "
                 "and call the PeftModel as usual: its hook points are then named as without PEFT")
    return hint


def _shared_names_hint(model: torch.nn.Module, named: list[tuple[str, torch.nn.Module]], pattern: str,
                       argument: str) -> str:
    """For a pattern that selects none of ``named`` (``named_modules()``, which lists a module
    once, under its first name) but names a module registered under another name as well (a
    layer shared by ``nn.ModuleList([block] * 3)``, a submodule assigned to two attributes):
    that it is tracked under its first name, one hook point per call. Else ``""``."""
    first = {id(m): n for n, m in named}
    other: dict[str, str] = {}
    for n, m in model.named_modules(remove_duplicate=False):
        if first.get(id(m), n) != n:
            other.setdefault(n, first[id(m)])
    hits = pattern_hits(pattern, list(other))
    if not hits:
        return ""
    canon = list(dict.fromkeys(other[h] for h in hits))
    if all("_orig_mod" in h.split(".") for h in hits):  # a module inside a torch.compile wrapper
        return (f": the modules of a torch.compile wrapper (OptimizedModule) are named as in the eager model, without "
                f"'_orig_mod' ({hits[0]!r} is {other[hits[0]]!r}): {argument}={canon!r}")
    shown = ", ".join(f"{h!r} is {other[h]!r}" for h in hits[:3]) + (", ..." if len(hits) > 3 else "")
    c = canon[0]
    fix = (f"include={canon!r} records every call of it" if argument == "include"
           else f"exclude={canon!r} leaves out every call of it")
    return (f": it names a module registered under more than one name ({shown}: the same module object), which "
            "named_modules() lists once, under its first name; the capture tracks it under that name, each call in "
            f"a forward a hook point of its own in call order ({c!r}: {c}.output, {c}#1.output, ...), so one name "
            f"of it cannot be chosen apart from the others: {fix}")


def _examples(names: Sequence[str], n: int = 8) -> str:
    shown = [name_repr(x) for x in names if x][:n]  # (names that print alike told apart: name_repr)
    more = "" if len([x for x in names if x]) <= n else ", ..."
    return "[" + ", ".join(shown) + more + "]"


def _hook_point_hint(pattern: str, names: list[str], named: list[tuple[str, torch.nn.Module]] = ()) -> str:
    """A hint for an include pattern that names a hook point (``<module>.output``) rather
    than a module: patterns select modules, and each tracked module gives its hook points
    (a TransformerLens ``HookPoint`` under its own path). Otherwise the module names closest
    to the pattern (a typo), if any are close."""
    for side in (".output", ".input"):
        hits = pattern_hits(pattern[: -len(side)], names) if pattern.endswith(side) else []
        if hits:
            module = pattern[: -len(side)]
            modules = dict(named)
            if all(h in modules and is_hook_point_module(modules[h]) for h in hits):
                shown = repr(hits[0]) if len(hits) == 1 else f"{hits[0]!r}, ..."
                return (f". Patterns name modules, not hook points: include={module!r} records the HookPoint under "
                        f"its TransformerLens name {shown} (no {side!r})")
            return (f". Patterns name modules, not hook points: include={module!r} records "
                    f"{pattern!r}" + (" (with capture='input' or 'both')" if side == ".input" else ""))
    close = _close_names(pattern, names)
    if close:
        return f"; did you mean {names_repr(close)}?"
    # the end of module paths ("layer.3" for "encoder.layer.3"): fnmatch matches the whole name
    whole = pattern_hits(f"*.{pattern}", names) if pattern else []
    if whole:
        return (f"; a pattern is matched against the whole module path from the model's root: did you mean "
                f"{names_repr(whole, 2)}? ('*.{pattern}' selects them)")
    return ""


def _close_names(pattern: str, names: list[str], n: int = 3) -> list[str]:
    """Up to ``n`` module names closest to ``pattern`` (difflib's ratio of at least 0.8): for a
    pattern with wildcards, the names closest to it with each wildcard read as one of them."""
    import difflib

    if not any(c in pattern for c in "*?["):
        return difflib.get_close_matches(pattern, [x for x in names if x], n=n, cutoff=0.8)
    # a wildcard pattern: each name of as many dotted components is compared with the pattern
    # whose wildcard components are replaced by that name's own ("blocks.*.hook_resid_psot"
    # read as "blocks.0.hook_resid_psot" against "blocks.0.hook_resid_post")
    parts = pattern.split(".")
    scored = []
    for name in names:
        comps = name.split(".")
        if len(comps) != len(parts):
            continue
        filled = ".".join(c if any(w in p for w in "*?[") else p for p, c in zip(parts, comps))
        ratio = difflib.SequenceMatcher(None, filled, name).ratio()
        if ratio >= 0.8:
            scored.append((-ratio, name))
    return [name for _, name in sorted(scored)[:n]]
