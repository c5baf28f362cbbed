"""The capture path inside a ``torch.compile``d graph.

Eagerly, a tracked module's ``forward`` is a native :class:`_C.ForwardWrapper` called
through its C slot; TorchDynamo cannot trace that call. For dynamo the wrapper type also
has a Python-level ``__call__`` (:func:`traced_call`, placed in the type's dict without
touching the C slot, so eager calls never run it): dynamo inlines it, and it calls the
original forward in the graph between two custom ops of the extension,
``activationscope::call_begin`` and ``activationscope::call_end`` (csrc/compiled_ops.cpp).
Those run, when the compiled graph runs, the bookkeeping and captures the eager wrapper runs
(root forward start / end, capture policy, ``#k`` names, sinks, reductions, store rows), so
records are those of the eager model, with no graph break.

What is decided while tracing is only the structure: which tensors of a call's inputs /
outputs are leaves and their names (:func:`leaves`, the same rule as the native
``collect``), and which ops to emit (``wrapper.plan()``). Dynamo guards on the wrapper
(the module's ``forward``) and on these attributes, so attaching or removing a tracker
recompiles.

A wrapper whose capture cannot run inside a graph (``stop_after_last=True``, which ends a
forward by raising) leaves the graph: the traced ``__call__`` calls the eager wrapper (a
graph break per tracked module, records exact) and :func:`warn_eager` says so once.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import itertools
import types
from typing import Any

import torch

from ..errors import CaptureWarning, warn_at_caller
from . import _native

_C = _native.load()

__all__ = ["traced_call", "leaves", "first_input", "warn_eager", "warn_too_deep", "warn_unwalked", "install"]

# Declared mutated by both ops, never written: keeps every op call and their order in a graph.
_TOKEN = torch.zeros(1)
_MAX_DEPTH = 32  # containers this deep are not walked, as in the native collect()


def leaves(obj: Any, prefix: str, names: list[str], tensors: list[torch.Tensor], depth: int = 0,
           warn: bool = True) -> None:
    """Append the tensor leaves of ``obj`` and their names (``prefix`` + field path), in the
    order and with the names of the native wrapper's ``collect`` (forward_wrapper.cpp):
    tensors; tuples / lists by index (named tuples by field); dicts (HF ``ModelOutput``
    included) by ``str(key)``; dataclasses by field (``dataclasses.fields``); ``None`` and
    other objects skipped; a container ``_MAX_DEPTH`` levels down is not walked
    (:func:`warn_too_deep`; ``warn`` False: silently)."""
    if isinstance(obj, torch.Tensor):
        names.append(prefix)
        tensors.append(obj)
        return
    if obj is None:
        return
    if depth >= _MAX_DEPTH:
        container = len(obj) > 0 if isinstance(obj, (tuple, list, dict)) else \
            isinstance(getattr(type(obj), "__dataclass_fields__", None), dict)
        if warn and container:
            warn_too_deep(prefix)
        return
    if isinstance(obj, (tuple, list)):
        fields = getattr(obj, "_fields", None)
        for i, item in enumerate(obj):
            key = str(fields[i]) if isinstance(fields, tuple) and i < len(fields) else str(i)
            leaves(item, prefix + "." + key, names, tensors, depth + 1, warn)
        return
    if isinstance(obj, dict):
        for key, item in obj.items():
            leaves(item, prefix + "." + str(key), names, tensors, depth + 1, warn)
        return
    fields = getattr(type(obj), "__dataclass_fields__", None)
    if isinstance(fields, dict):
        for name, field in fields.items():
            if getattr(field, "_field_type", None) is not dataclasses._FIELD:
                continue  # a ClassVar or InitVar name, not a field of the instance (dataclasses.fields)
            leaves(getattr(obj, name, None), prefix + "." + name, names, tensors, depth + 1, warn)


def warn_too_deep(path: str) -> None:
    """The CaptureWarning of a container nested ``_MAX_DEPTH`` levels deep in a tracked module's
    inputs or outputs (``path``: its hook point prefix): the capture does not walk it, so the
    tensors inside it are not captured. Also called by the native ``collect``."""
    warn_at_caller(
        f"{path!r} is a tuple, list, dict or dataclass nested {_MAX_DEPTH} levels deep in a tracked "
        "module's inputs or outputs: the capture walks no deeper, so the tensors inside it are not captured. "
        "Track the modules that compute those tensors, return a flatter structure, or exclude= this module",
        CaptureWarning,
    )


# objects whose tensors (a module's parameters) are no activations, and ones that hold none
_NOT_ACTIVATIONS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                    torch.nn.Module, torch.dtype, torch.device)
_HELD_SCAN_ITEMS = 4096  # objects looked at per scan of an object for the tensors it holds
_HELD_SCAN_DEPTH = 4  # attributes / items followed this deep


# a class's own namespace, MRO and name, read past any metaclass (whose properties are code)
_TYPE_NAMESPACE, _TYPE_MRO, _TYPE_NAME = type.__dict__["__dict__"], type.__dict__["__mro__"], type.__dict__["__name__"]
_SEQUENCES = ((list, list.__iter__), (tuple, tuple.__iter__), (set, set.__iter__), (frozenset, frozenset.__iter__),
              (collections.deque, collections.deque.__iter__))


def _attributes(o: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of the instance attributes of ``o``: its ``__dict__`` and the
    ``__slots__`` of every class of its type's MRO, read through the descriptors Python makes
    for them (C code), never through ``o``'s own attribute lookup: no ``__getattr__``,
    ``__getattribute__``, property or other code of the object's runs."""
    out: list[tuple[str, Any]] = []
    instance_dict = False
    for cls in _TYPE_MRO.__get__(type(o)):
        ns = _TYPE_NAMESPACE.__get__(cls)
        d = ns.get("__dict__")
        if not instance_dict and d is not None:
            instance_dict = True  # (the first one found is the instance's; a property of that name is code)
            if isinstance(d, types.GetSetDescriptorType):
                inst = d.__get__(o, cls)
                if type(inst) is dict:
                    out += [(f".{k}" if type(k) is str else f".<{type(k).__name__}>", v)
                            for k, v in itertools.islice(dict.items(inst), _HELD_SCAN_ITEMS)]
        slots = ns.get("__slots__", ())
        names = (slots,) if type(slots) is str else slots if type(slots) in (tuple, list, dict) else ()
        for name in names:
            if type(name) is not str or name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):  # (a private name is mangled)
                name = f"_{_TYPE_NAME.__get__(cls).lstrip('_')}{name}"
            member = ns.get(name)
            if isinstance(member, types.MemberDescriptorType):
                try:
                    out.append((f".{name}", member.__get__(o, cls)))
                except AttributeError:  # (a slot not set)
                    pass
    return out


def _held_tensor(obj: Any) -> str | None:
    """The path (``.attr[0].attr``) of a tensor that ``obj`` holds in its attributes (its
    ``__dict__`` or the ``__slots__`` of its classes) and the lists, tuples, sets, deques and
    dicts below them, :data:`_HELD_SCAN_DEPTH` levels deep and :data:`_HELD_SCAN_ITEMS`
    objects at most; None when none is found. Modules, classes, functions and ``nn.Module``s
    are not entered (a module's parameters are not activations). Runs no code of the objects
    it looks at (types are checked by ``type()``, containers read by the built-in methods, dict
    keys other than str / int named by their type): a proxy's ``__getattr__``, a property,
    an iterator's ``__iter__`` never run."""
    skip = _NOT_ACTIVATIONS + (str, bytes, int, float, complex)
    budget = [_HELD_SCAN_ITEMS]
    seen: set[int] = set()

    def key_name(k: Any) -> str:
        return repr(k) if type(k) in (str, int, float, bool, bytes) else f"<{type(k).__name__}>"

    def children(o: Any) -> list[tuple[str, Any]]:
        t = type(o)
        if issubclass(t, dict):
            return [(f"[{key_name(k)}]", v) for k, v in itertools.islice(dict.items(o), budget[0])]
        for kind, it in _SEQUENCES:
            if issubclass(t, kind):
                return [(f"[{i}]", v) for i, v in enumerate(itertools.islice(it(o), budget[0]))]
        return _attributes(o)

    def walk(o: Any, path: str, depth: int) -> str | None:
        budget[0] -= 1
        if issubclass(type(o), torch.Tensor):
            return path
        if budget[0] <= 0 or depth >= _HELD_SCAN_DEPTH or o is None or issubclass(type(o), skip) or id(o) in seen:
            return None
        seen.add(id(o))
        try:
            items = children(o)
        except Exception:  # noqa: BLE001 - an object whose attributes cannot be listed holds nothing we can name
            return None
        for key, child in items:
            found = walk(child, path + key, depth + 1)
            if found is not None:
                return found
        return None

    return walk(obj, "", 0) if not issubclass(type(obj), skip) else None


def warn_unwalked(path: str, obj: Any) -> bool:
    """Called by the native ``collect`` for an object in a tracked module's inputs or outputs
    that the capture does not walk (not a tensor, tuple, list, dict or dataclass; ``path``:
    its hook point prefix): when it holds tensors (an HF ``Cache``, a ``torch.distributions``
    object, a custom class), a CaptureWarning says they are not captured. Returns whether its
    type needs no further check (warned about, or a type that holds no activations). Runs no
    code of ``obj`` (:func:`_held_tensor`)."""
    if issubclass(type(obj), _NOT_ACTIVATIONS):
        return True
    held = _held_tensor(obj)
    if held is None:
        return False
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    warn_at_caller(
        f"{path!r} is a {kind} holding tensors (e.g. {held!r}): the capture walks tuples, lists, dicts and "
        f"dataclasses only, so tensors held by other objects are not captured (here, and wherever a {kind} "
        "appears in this capture). Track the modules that compute them (for a Hugging Face cache: the attention's "
        "key / value projections), or return them in a tuple, dict or dataclass",
        CaptureWarning,
    )
    return True


def _packed_batch(packed: Any) -> torch.Tensor | None:
    """A ``(batch,)`` placeholder of a PackedSequence's batch (``batch_sizes[0]``), as the
    native ``packed_batch``."""
    sizes = packed.batch_sizes
    if not isinstance(sizes, torch.Tensor) or sizes.dim() != 1 or sizes.numel() == 0:
        return None
    return torch.empty(int(sizes[0]), dtype=torch.bool)


def first_input(args: tuple, kwargs: dict, kw_order: tuple[str, ...] = ()) -> torch.Tensor | None:
    """The model's first tensor input with a dimension, as the native ``root_first_input``:
    the leaves of the first positional argument that has any (else of the first keyword
    argument that has any, keywords taken in the order of the forward's parameters
    ``kw_order``, the others after them as passed), their first tensor of one dimension or more.
    A PackedSequence argument gives a ``(batch,)`` placeholder of its batch (its data is one row
    per token of every sample)."""
    names: list[str] = []
    found: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.nn.utils.rnn.PackedSequence):
            return _packed_batch(arg)
        leaves(arg, "", names, found, warn=False)
        if found:
            break
    if not found:
        keys = [k for k in kw_order if k in kwargs] + [k for k in kwargs if k not in kw_order]
        for key in keys:
            if isinstance(kwargs[key], torch.nn.utils.rnn.PackedSequence):
                return _packed_batch(kwargs[key])
            leaves(kwargs[key], "", names, found, warn=False)
            if found:
                break
    for t in found:
        if t.dim() >= 1:
            return t
    return None


def traced_call(self: Any, *args: Any, **kwargs: Any) -> Any:
    """``ForwardWrapper.__call__`` as TorchDynamo traces it (eager calls use the C slot).

    ``self`` is the wrapper; ``self._acs_key`` / ``self._acs_plan`` are set by the tracker
    when it installs or removes a site.
    """
    capture_in, capture_out, root, eager = self._acs_plan
    if eager:
        return self.call_eager(*args, **kwargs)  # leaves the graph: see warn_eager
    key = self._acs_key
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    if capture_in:
        for i, arg in enumerate(args):
            leaves(arg, "input." + str(i), names, tensors)
        for kw, arg in kwargs.items():
            leaves(arg, "input.kw." + kw, names, tensors)
    first = first_input(args, kwargs, self._acs_kw_order) if root else None
    tensors, complex_leaves = _real_views(tensors)
    torch.ops.activationscope.call_begin(_TOKEN, key, tensors, names, first, complex_leaves)
    out = self.__wrapped__(*args, **kwargs)
    names = []
    tensors = []
    if capture_out:
        leaves(out, "output", names, tensors)
    tensors, complex_leaves = _real_views(tensors)
    torch.ops.activationscope.call_end(_TOKEN, key, tensors, names, complex_leaves)
    return out


def _real_views(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """``tensors`` with each complex one as ``torch.view_as_real`` of it, and their positions:
    inductor cannot lower the call ops given complex tensors ("auto_functionalized_v2 was not
    removed"); the ops view them as complex again (csrc/compiled_ops.cpp)."""
    at = [i for i, t in enumerate(tensors) if t.is_complex()]
    if not at:
        return tensors, at
    tensors = list(tensors)
    for i in at:
        tensors[i] = torch.view_as_real(tensors[i].resolve_conj().resolve_neg())
    return tensors, at


def warn_eager(paths: list[str]) -> None:
    """The warning of a wrapper (tracking the modules ``paths``) that cannot capture inside a
    compiled graph; called once per wrapper by the native side, when it runs under dynamo."""
    paths = [p or "(the tracked model)" for p in paths]
    warn_at_caller(
        f"tracked module {', '.join(repr(p) for p in paths)} runs outside the torch.compile graph: its tracker has "
        "stop_after_last=True, which ends a forward by raising and cannot run inside a compiled graph. Its records "
        "stay exact, but each tracked module is a graph break (the compiled model runs about as fast as the eager "
        "one); track without stop_after_last to capture inside the graph",
        CaptureWarning,
    )


def _fake_call_begin(token, wrapper, leaves, names, first, complex_leaves=()) -> None:  # noqa: ANN001
    return None


def _fake_call_end(token, wrapper, leaves, names, complex_leaves=()) -> None:  # noqa: ANN001
    return None


_installed = False


def install() -> None:
    """Give the wrapper type its traced ``__call__`` and the ops their fake implementations
    (idempotent; the ops themselves are registered when the extension loads)."""
    global _installed
    if _installed:
        return
    _C._set_traced_call(traced_call)
    _register_fake("activationscope::call_begin", _fake_call_begin)
    _register_fake("activationscope::call_end", _fake_call_end)
    _installed = True


def _register_fake(qualname: str, fn: Any) -> None:
    """Give the op ``qualname`` the fake implementation ``fn``, beside the Meta kernel that
    csrc/compiled_ops.cpp registers for it. torch 2.13 allows that by default; torch 2.11
    refuses it ("already has an DispatchKey::Meta implementation") unless asked with
    ``allow_override=True``; a torch without that argument refuses it always and gets no fake
    implementation (the Meta kernel traces the op alike: both do nothing)."""
    if "allow_override" not in inspect.signature(torch.library.register_fake).parameters:
        return
    torch.library.register_fake(qualname, allow_override=True)(fn)
