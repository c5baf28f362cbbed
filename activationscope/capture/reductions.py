"""Online reductions: built-in streaming statistics and custom TorchScript reductions.

A reduction sees the rows of one hook point batch after batch and keeps a small state. The
built-ins run in C++ (``activationscope._C``) with float64 accumulators on the rows' device
(``min``, ``max`` and ``topk`` of integer rows: int64, exact beyond 2**53);
every one of them is mergeable (workers, ranks, resumed runs) so that streaming any split of
the rows, in any order, gives the one-shot result up to float64 round-off.

Moments (``mean``, ``var``, ``std``, ``cov``) use the pairwise update of Chan, Golub & LeVeque
[2]_ [3]_: each batch is reduced two-pass in float64, then folded in with
``delta = mean_b - mean_a``, ``m2 = m2_a + m2_b + delta**2 * n_a * n_b / n``, of which
Welford's one-pass update [1]_ is the one-row special case.

Custom reductions follow the contract ``(acc: Optional[Tensor], x: Tensor) -> Tensor``: the
function receives ``acc=None`` on the first batch (unless pre-seeded with ``init=``) and the
rows ``x`` of each batch, and returns the new accumulator, of the shape and dtype of the one it
was given (another is refused with :class:`CaptureError`). Functions are compiled with
TorchScript, saved to a ``.pt`` file and run from C++ with no Python per batch; when
TorchScript cannot compile one, an :class:`EagerReduction` runs the Python function per batch
instead, after one :class:`EagerFallbackWarning`.

References
----------
.. [1] B. P. Welford, "Note on a method for calculating corrected sums of squares and
   products", Technometrics 4(3), 1962.
.. [2] T. F. Chan, G. H. Golub, R. J. LeVeque, "Updating formulae and a pairwise algorithm
   for computing sample variances", Stanford CS report STAN-CS-79-773, 1979.
.. [3] T. F. Chan, G. H. Golub, R. J. LeVeque, "Algorithms for computing the sample variance:
   analysis and recommendations", The American Statistician 37(3), 1983.
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import inspect
import math
import os
import re
import shutil
import tempfile
import threading
import uuid
import warnings
import weakref
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from activationscope import _C
from activationscope.errors import (
    ActivationScopeError,
    ArgumentValueError,
    CaptureError,
    ReductionError,
    docs_page,
    warn_at_caller,
)

from .._args import check_reduction_name
from .hooks import pattern_selects

__all__ = [
    "BUILTIN_REDUCTIONS",
    "CONTRACT",
    "EagerFallbackWarning",
    "EagerReduction",
    "ReductionFactory",
    "make_reduction",
    "merge_states",
    "pca",
    "reductions_for",
    "resolve_reductions",
    "script_reduction",
    "validate_reductions",
]

#: Names of the built-in reductions (``make_reduction("var")`` ...).
BUILTIN_REDUCTIONS: tuple[str, ...] = tuple(_C.builtin_reduction_kinds())

#: The signature every custom reduction must have.
CONTRACT = "(acc: Optional[Tensor], x: Tensor) -> Tensor"

Reduction = _C.Reduction
ReductionLike = Union["_C.Reduction", "EagerReduction"]


class EagerFallbackWarning(UserWarning):
    """A custom reduction could not be compiled with TorchScript and runs as Python."""


# ---------------------------------------------------------------------------- TorchScript


@contextlib.contextmanager
def _quiet_jit():
    """Silence torch's deprecation warnings about ``torch.jit`` (they must not reach users)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(torch\.jit|TorchScript)", category=DeprecationWarning)
        yield


def _script_types() -> tuple[type, ...]:
    jit = getattr(torch, "jit", None)
    return tuple(t for t in (getattr(jit, "ScriptFunction", None), getattr(jit, "ScriptModule", None)) if t)


def _is_scripted(obj: Any) -> bool:
    types = _script_types()
    return bool(types) and isinstance(obj, types)


_lock = threading.Lock()
_cache_dir: Optional[Path] = None
# function or scripted object -> saved .pt path, or None when it runs eagerly (warned once)
_compiled: "weakref.WeakKeyDictionary[Any, Optional[Path]]" = weakref.WeakKeyDictionary()


def _remove_scratch_dir(path: Path, pid: int) -> None:
    """At exit: remove the scripts' scratch folder, only in the process that made it (a
    process forked from it exits with the same handler, while its parent still uses them)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _remove_scratch_file(path: Path, pid: int) -> None:
    """Once its function is freed: remove the ``.pt`` file compiled from it, only in the
    process that made it (a forked process shares the file with its parent)."""
    if os.getpid() == pid:
        with contextlib.suppress(OSError):
            path.unlink()


def _scratch_dir() -> Path:
    global _cache_dir
    if _cache_dir is None:
        _cache_dir = Path(tempfile.mkdtemp(prefix="activationscope-reductions-"))
        atexit.register(_remove_scratch_dir, _cache_dir, os.getpid())
    return _cache_dir


def _fn_name(fn: Any) -> str:
    if _is_scripted(fn):
        name = getattr(fn, "original_name" if isinstance(fn, torch.nn.Module) else "name", None)
    elif isinstance(fn, torch.nn.Module):
        name = type(fn).__name__
    else:
        name = getattr(fn, "__name__", None)
    return str(name or type(fn).__name__)


def _check_signature(fn: Callable) -> None:
    """Raise ReductionError unless ``fn`` takes exactly two positional parameters."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    name = _fn_name(fn)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError) as e:
        raise ReductionError(f"custom reduction {name!r} has no inspectable signature; it must be {CONTRACT}") from e
    params = list(sig.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != 2 or any(p.kind not in positional for p in params):
        raise ReductionError(
            f"custom reduction {name!r} must have the signature {CONTRACT}, got {name}{sig}; "
            "it is called as fn(acc, x) with acc=None on the first batch"
        )


def _schema_acc_optional(scripted: Any) -> bool:
    """Whether the scripted forward accepts ``acc=None``."""
    try:
        schema = scripted.forward.schema if isinstance(scripted, torch.nn.Module) else scripted.schema
        args = [a for a in schema.arguments if a.name != "self"]
        if len(args) != 2:
            raise ReductionError(
                f"custom reduction {_fn_name(scripted)!r} must have the signature {CONTRACT}, got {schema}"
            )
        return isinstance(args[0].type, torch.OptionalType)
    except AttributeError:  # no schema to look at; the native side checks again
        return True


#: The fix for a state of several tensors (a tuple, dict or list), which the contract does not take.
_SEVERAL_HINT = ("; to keep several statistics, hold them in one tensor (torch.stack([s, q]) of one shape, or "
                 "torch.cat of flattened ones) and split the result after reading it")


def _check_returns_tensor(scripted: Any, name: str) -> None:
    """Raise ReductionError unless the scripted forward returns a Tensor and a ``merge``, if
    there is one, is ``(a: Tensor, b: Tensor) -> Tensor`` (found when the reduction is made,
    not at the first batch or the first merge)."""
    methods = [("forward", scripted.forward if isinstance(scripted, torch.nn.Module) else scripted, CONTRACT)]
    if isinstance(scripted, torch.nn.Module) and hasattr(scripted, "merge"):
        methods.append(("merge", scripted.merge, "merge(a: Tensor, b: Tensor) -> Tensor"))
    for method, fn, contract in methods:
        schema = getattr(fn, "schema", None)
        if schema is None:  # nothing to look at; the native side checks each call
            continue
        args = [a for a in schema.arguments if a.name != "self"]
        returns = list(schema.returns)
        ok = len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)
        if method == "merge":
            ok = ok and len(args) == 2 and all(isinstance(a.type, torch.TensorType) for a in args)
        if not ok:
            several = any(isinstance(r.type, (torch.TupleType, torch.DictType, torch.ListType)) for r in returns)
            raise ReductionError(f"custom reduction {name!r} must have the signature {contract}, got {schema}"
                                 f"{_SEVERAL_HINT if several else ''}")


_loaded: dict[tuple[str, int, int], tuple[bool, Optional[str]]] = {}


def _check_pt(path: Path, name: str, init: Any) -> None:
    """Check the signature of the TorchScript file ``path`` as for a function: ``forward``
    returns a Tensor (and ``merge``), and takes ``acc: Optional[Tensor]`` unless ``init`` is
    given. The native side loads the file anyway; this looks at its schema in Python once
    per file version."""
    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
    with _lock:
        found = _loaded.get(key)
    if found is None:
        try:
            with _quiet_jit():
                scripted = torch.jit.load(str(path), map_location="cpu")
        except Exception:  # noqa: BLE001 - the native load says what is wrong with the file
            return
        error = None
        try:
            _check_returns_tensor(scripted, name)
        except ReductionError as e:
            error = str(e)
        found = (_schema_acc_optional(scripted), error)
        with _lock:
            _loaded[key] = found
    acc_optional, error = found
    if error is not None:
        raise ReductionError(error)
    if init is None and not acc_optional:
        raise _needs_optional(name)


def _save_scripted(scripted: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _quiet_jit():
        torch.jit.save(scripted, str(path))
    return path


def _compile(fn: Callable, *, strict: bool) -> Optional[Any]:
    """torch.jit.script ``fn``; None (or ReductionError when strict) if TorchScript fails."""
    try:
        with _quiet_jit():
            return torch.jit.script(fn)
    except Exception as e:  # noqa: BLE001 - any TorchScript failure means "run eagerly"
        if strict:
            raise ReductionError(
                f"custom reduction {_fn_name(fn)!r} cannot be compiled with TorchScript: {e}"
            ) from e
        warn_at_caller(
            f"custom reduction {_fn_name(fn)!r} could not be compiled with TorchScript "
            f"({type(e).__name__}: {_first_line(e)}); "
            "it will run as eager Python once per captured batch, holding the GIL. "
            "Make it TorchScript-compatible to run it natively.",
            EagerFallbackWarning,
        )
        return None


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0].rstrip(":") if lines else ""


def _pt_for(obj: Any) -> Optional[tuple[Path, bool]]:
    """(cached .pt path, acc accepts None) of a function or scripted object; None if eager."""
    with _lock:
        with contextlib.suppress(TypeError):  # TypeError: not weak-referenceable, no caching
            if obj in _compiled:
                return _compiled[obj]
        scripted = obj if _is_scripted(obj) else _compile(obj, strict=False)
        entry = None
        if scripted is not None:
            _check_returns_tensor(scripted, _fn_name(obj))
            optional = _schema_acc_optional(scripted)
            path = _save_scripted(scripted, _scratch_dir() / f"{_fn_name(obj)}-{uuid.uuid4().hex[:12]}.pt")
            entry = (path, optional)
        with contextlib.suppress(TypeError):
            _compiled[obj] = entry
            if entry is not None:
                # the file goes with its function: a function made anew for each capture (a
                # closure, a lambda) would otherwise leave one file per capture until exit
                weakref.finalize(obj, _remove_scratch_file, entry[0], os.getpid()).atexit = False
        return entry


# ---------------------------------------------------------------------------- eager fallback


def _checkable(t: torch.Tensor) -> bool:
    """Whether ``made_nonfinite`` looks at ``t``: a dense tensor of floating or complex values
    (a sparse, nested or meta one, or integers, never counts)."""
    return t.layout == torch.strided and not t.is_meta and not t.is_nested and (t.is_floating_point() or t.is_complex())


class EagerReduction(_C.Reduction):
    """A custom reduction run as Python, a subclass of the native ``Reduction``.

    Used when TorchScript cannot compile the function (or is unavailable). Each ``update``
    calls the Python function once, holding the GIL: correct, but slower than the native path.

    Parameters
    ----------
    fn : callable
        ``fn(acc: Optional[Tensor], x: Tensor) -> Tensor``.
    options : dict[str, float], optional
        Kept for :attr:`options` (same meaning as for native reductions).
    """

    kind = "eager"
    #: The hook point it reduces (set by the capture; named in errors), or None.
    hook_point: Optional[str] = None

    def __init__(self, fn: Callable, options: Optional[Mapping[str, float]] = None):
        super().__init__()
        self._fn = fn
        self._options = dict(options or {})
        self._acc: Optional[torch.Tensor] = None
        self._rows_device: torch.device | None = None  # the device of the rows self._acc was last made from
        self._acc_from_state = False  # self._acc is an init= or a loaded state, not yet updated
        # a batch made NaN or inf of finite rows (_note_nonfinite): on the CPU a bool, elsewhere
        # also a () bool tensor on the accumulator's device; whether self._acc was finite when
        # made (a () bool tensor; None: no accumulator, or one of integers)
        self._made_nonfinite = False
        self._made_nonfinite_dev: Optional[torch.Tensor] = None
        self._acc_finite: Optional[torch.Tensor] = None
        self._checkpoint: Optional[tuple] = None  # (checkpoint(): what restore_checkpoint() puts back)
        self._undo: Optional[tuple] = None  # (undo_update(): what the last update found besides the accumulator)

    @property
    def options(self) -> dict[str, float]:
        return dict(self._options)

    @property
    def made_nonfinite(self) -> bool:
        """Whether a batch turned finite rows, and a finite accumulator (or none), into an
        accumulator holding NaN or inf: the function's own doing (a division by zero, the log of
        0, an overflow of its dtype). NaN or inf of the rows carried along does not count, as the
        built-ins carry it (like torch). Off the CPU reading it synchronises with the device."""
        return self._made_nonfinite or (self._made_nonfinite_dev is not None and bool(self._made_nonfinite_dev))

    def _note_nonfinite(self, acc: torch.Tensor, rows: torch.Tensor) -> None:
        """After a batch (``acc`` what the function returned for ``rows``), as the native
        custom reduction does: on the CPU the accumulator is looked at, the rows only when it is
        not finite; elsewhere the answer stays on the device (no synchronisation per batch)."""
        if self._made_nonfinite or not (_checkable(acc) and _checkable(rows)):
            return
        try:
            finite = torch.isfinite(acc).all()
            before = self._acc_finite  # (as noted when made: the function may have changed it in place since)
            if acc.device.type == "cpu":
                self._made_nonfinite = (not bool(finite) and (before is None or bool(before))
                                        and bool(torch.isfinite(rows).all()))
            else:
                made = finite.logical_not() & torch.isfinite(rows).all().to(acc.device)
                if before is not None:
                    made &= before.to(acc.device)
                self._made_nonfinite_dev = made if self._made_nonfinite_dev is None else self._made_nonfinite_dev | made
            self._acc_finite = finite
        except (RuntimeError, NotImplementedError):  # (a device or tensor kind without isfinite: nothing is said)
            self._acc_finite = None

    def _where(self) -> str:
        """``hook point '<name>': `` for errors, once the capture has set it."""
        return f"hook point {self.hook_point!r}: " if self.hook_point else ""

    def update(self, rows: torch.Tensor, row_offset: int = 0) -> None:
        """Fold a batch of rows into the accumulator (one call of ``fn(acc, rows)``).

        Parameters
        ----------
        rows : Tensor, (n_rows, *feature_shape), any dtype, any device
            The batch; an empty one (``n_rows`` 0) changes nothing.
        row_offset : int, default 0
            Row index of the batch's first row in the hook point's array, as the native
            reductions take it (``topk`` records row ids from it); ``fn`` does not see it.

        Raises
        ------
        CaptureError
            ``fn`` raised, changed ``rows`` in place, or returned an accumulator of another
            shape or dtype than the one it was given.
        ReductionError
            ``fn`` returned something other than a Tensor.

        The accumulator is left as it was before the batch whenever one of these is raised.
        """
        if rows.dim() >= 1 and rows.shape[0] == 0:
            return
        self._undo = (self._acc_from_state, self._rows_device, self._made_nonfinite, self._made_nonfinite_dev,
                      self._acc_finite)
        # (an inference tensor, rows of a model run under torch.inference_mode, has no version counter)
        version = None if rows.is_inference() else rows._version
        # self._acc stays as it was until the batch is folded in: the function works on a copy
        # at every batch, so a batch it fails on leaves the accumulator untouched. (Whether it
        # writes into acc cannot be told beforehand, nor always after: a write through acc.data,
        # or under inference_mode, moves no version counter. The copy also keeps a tensor that
        # result() / state() handed out, or init=, shared by every hook point, as it is.)
        acc_in = self._acc
        if acc_in is not None and acc_in.device != rows.device and self._rows_device != rows.device:
            # as the native reduction: an accumulator that did not come from rows of this device
            # (init=, a stored state, committed rows read back from a store) follows the rows
            with torch.inference_mode(False):
                acc_in = self._acc = acc_in.to(rows.device)
        if acc_in is not None:
            with torch.inference_mode(False):  # a normal tensor, which may be updated in place anywhere
                acc_in = acc_in.clone()
        try:
            with torch.no_grad():
                out = self._fn(acc_in, rows.detach())
        except Exception as e:  # noqa: BLE001 - named as the native side names a script's failure
            raise CaptureError(
                f"{self._where()}custom reduction {_fn_name(self._fn)!r} (eager) failed on rows of shape "
                f"{tuple(rows.shape)} ({rows.dtype}): {type(e).__name__}: {e}"
            ) from e
        if version is not None and rows._version != version:
            # the rows are the model's activations (or the rows a store keeps)
            raise CaptureError(
                f"{self._where()}custom reduction {_fn_name(self._fn)!r} (eager) changed its input x in place (rows of "
                f"shape {tuple(rows.shape)}): x holds the model's activations, so the forward and the stored rows "
                "would change; use out-of-place ops (x = x.clamp(min=0.0), not x.clamp_(min=0.0)) or work on x.clone()"
            )
        if not isinstance(out, torch.Tensor):
            several = isinstance(out, (tuple, list, dict))
            raise ReductionError(
                f"{self._where()}custom reduction {_fn_name(self._fn)!r} must return a Tensor, got {type(out).__name__}"
                f"{_SEVERAL_HINT if several else ''}"
            )
        acc = out.detach()
        if acc_in is not None and (acc.shape != acc_in.shape or acc.dtype != acc_in.dtype):
            # another shape broadcasts (a () sum plus a (d,) one is (d,), every feature holding the
            # earlier batches' total), another dtype rounds what was folded in
            fix = ("give init= (or the stored state) the shape and dtype the function returns" if self._acc_from_state
                   else "make the function return a tensor of its accumulator's shape and dtype")
            raise CaptureError(
                f"{self._where()}custom reduction {_fn_name(self._fn)!r} (eager) was given an accumulator of shape "
                f"{tuple(acc_in.shape)} ({acc_in.dtype}) and returned one of shape {tuple(acc.shape)} ({acc.dtype}), "
                f"on rows of shape {tuple(rows.shape)} ({rows.dtype}): the accumulator must keep its shape and dtype "
                f"from batch to batch (one of another shape broadcasts, so the batches would not be folded in alike); "
                f"{fix}"
            )
        if acc.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr() and rows.untyped_storage().nbytes():
            acc = acc.clone()  # x itself (`return x` for the first batch) or a view of it: the model's memory
        self._acc = acc
        self._note_nonfinite(acc, rows)
        self._acc_from_state = False
        self._rows_device = rows.device

    def merge(self, other: "EagerReduction") -> None:
        """Not supported: a plain function has no merge rule.

        Parameters
        ----------
        other : EagerReduction
            Another reduction of the same function.

        Raises
        ------
        ReductionError
            Always; script a ``torch.nn.Module`` with ``forward(acc, x)`` and ``merge(a, b)``
            methods, or merge the states yourself.
        """
        raise ReductionError(
            f"custom reduction {_fn_name(self._fn)!r} cannot merge: a plain function has no merge rule. "
            "Script a torch.nn.Module with forward(acc, x) and merge(a, b) methods, or merge the states yourself"
        )

    def result(self) -> dict[str, torch.Tensor]:
        """``{"value": acc}``: the accumulator as ``fn`` returned it (its shape, dtype and
        device; not a copy, and later updates leave it as it is), or ``{}`` before the first
        update."""
        return {} if self._acc is None else {"value": self._acc}

    def state(self) -> dict[str, torch.Tensor]:
        """``{"acc": acc}`` (what :meth:`load_state` takes; not a copy, and later updates leave
        it as it is), or ``{}`` before the first update."""
        return {} if self._acc is None else {"acc": self._acc}

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace the accumulator with a saved one (what :meth:`state` returned).

        Parameters
        ----------
        state : mapping of str to Tensor
            ``{"acc": Tensor}``, or ``{}`` for an empty reduction; the tensor is kept (detached,
            not copied) and moved to the rows' device at the next :meth:`update`.

        Raises
        ------
        ReductionError
            A key other than ``"acc"``.
        """
        unknown = set(state) - {"acc"}
        if unknown:
            raise ReductionError(f"state of a custom reduction has only the key 'acc', got {sorted(unknown)}")
        acc = state.get("acc")
        self._acc = None if acc is None else acc.detach()
        try:
            self._acc_finite = torch.isfinite(self._acc).all() if acc is not None and _checkable(acc) else None
        except (RuntimeError, NotImplementedError):
            self._acc_finite = None
        self._acc_from_state = acc is not None
        self._rows_device = None  # (moved to the rows' device at the next update)

    def checkpoint(self) -> None:
        """Remember the accumulator as it is now, with what :attr:`made_nonfinite` knows of it
        (replacing what was remembered before): a capture takes out of its reductions a forward
        its store leaves out (:meth:`restore_checkpoint`). Called by the capture, with no update
        running; the accumulator is kept, not copied (the next update works on a copy)."""
        self._checkpoint = (self._acc, self._acc_from_state, self._rows_device, self._made_nonfinite,
                            self._made_nonfinite_dev, self._acc_finite)

    def restore_checkpoint(self) -> None:
        """Put back what :meth:`checkpoint` remembered: the accumulator, and whether a batch
        made NaN or inf of finite rows (NaN or inf made by the forwards taken out is taken out
        with them, as the TorchScript reduction's). Before any checkpoint: an empty reduction."""
        saved = self._checkpoint or (None, False, None, False, None, None)
        (self._acc, self._acc_from_state, self._rows_device, self._made_nonfinite, self._made_nonfinite_dev,
         self._acc_finite) = saved

    def undo_update(self, state: Mapping[str, torch.Tensor]) -> None:
        """Put back the state before the last :meth:`update` with what :attr:`made_nonfinite`
        knew then: a capture does when a later custom reduction of the hook point refuses the
        batch (none of its rows is kept).

        Parameters
        ----------
        state : mapping of str to Tensor
            What :meth:`state` returned just before that update (``{"acc": Tensor}``, or ``{}``).

        Raises
        ------
        ReductionError
            A key other than ``"acc"``.
        """
        self.load_state(state)
        if self._undo is not None:
            (self._acc_from_state, self._rows_device, self._made_nonfinite, self._made_nonfinite_dev,
             self._acc_finite) = self._undo

    def fresh(self) -> "EagerReduction":
        """An empty reduction of the same function and options."""
        return EagerReduction(self._fn, self._options)

    def __repr__(self) -> str:
        return f"EagerReduction({_fn_name(self._fn)!r})"


# ---------------------------------------------------------------------------- construction


#: The options each built-in takes besides ``per_feature`` (``csrc/reductions_builtin.cpp``
#: checks them too; known here so that an unknown name is said before its value's type).
BUILTIN_OPTION_NAMES: dict[str, tuple[str, ...]] = {
    "mean": (), "var": ("ddof",), "std": ("ddof",), "min": (), "max": (), "absmax": (), "l2": (), "nonzero": (),
    "hist": ("bins", "lo", "hi"), "cov": ("ddof",), "topk": ("k",),
}


def _parse_options(options: Mapping[str, Any], spec: Any = None) -> dict[str, float]:
    """Options as floats. For a built-in ``spec``, an option it does not take is refused first
    (``dim=(0, 2, 3)`` of ``mean`` is an unknown option, not a value of the wrong type)."""
    if isinstance(spec, str) and spec in BUILTIN_OPTION_NAMES:
        allowed = (*BUILTIN_OPTION_NAMES[spec], "per_feature")
        for k in options:
            if k not in allowed:
                hint = (f" (there is no per-channel or axis option: see "
                        f"{docs_page('docs/usage/reductions.md', 'Per channel of conv feature maps')})"
                        if k in ("dim", "dims", "axis", "axes", "per_channel", "channel") else "")
                raise ReductionError(f"reduction {spec!r} has no option {k!r}; its options are [{', '.join(allowed)}]"
                                     f"{hint}")
    out = {}
    for k, v in options.items():
        if isinstance(v, bool):
            v = float(v)
        if not isinstance(v, (int, float)):
            raise ReductionError(f"reduction option {k!r} must be a number, got {v!r}")
        out[str(k)] = float(v)
    return out


def _is_path_spec(spec: Any) -> bool:
    if isinstance(spec, os.PathLike):
        return True
    return isinstance(spec, str) and (spec.endswith(".pt") or os.sep in spec or "/" in spec)


def _bracket_hint(spec: str) -> str:
    """The Python spelling of a built-in given with the command line's options in brackets
    (``"hist[lo=-4,hi=4]"``, what ``--reduce`` takes), or "" for any other string."""
    m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*\[(.*)\]\s*", spec)
    if m is None or m.group(1) not in BUILTIN_REDUCTIONS:
        return ""
    kind = m.group(1)
    options = {}
    for item in (i for i in m.group(2).split(",") if i.strip()):
        key, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not key.strip().isidentifier() or number is None:
            options = None
            break
        options[key.strip()] = int(number) if number.is_integer() else number
    example = f"make_reduction({kind!r}, {', '.join(f'{k}={v!r}' for k, v in options.items())})" if options else \
        f"make_reduction({kind!r}, <option>=<value>)"
    as_tuple = f"({kind!r}, {kind!r}, {options!r})" if options else f"({kind!r}, {kind!r}, {{<option>: <value>}})"
    return (f"; options in brackets are the command line's spelling (--reduce): in Python pass them as "
            f"keywords, {example}, or in reductions= as a (name, kind, options) tuple, {as_tuple}")


def _unknown_builtin(spec: str) -> ReductionError:
    bracket = _bracket_hint(spec)
    if bracket:
        return ReductionError(f"reduction must be one of {list(BUILTIN_REDUCTIONS)} (a name, without options), "
                              f"got {spec!r}{bracket}")
    close = difflib.get_close_matches(spec, BUILTIN_REDUCTIONS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ReductionError(
        f"reduction must be one of {list(BUILTIN_REDUCTIONS)}, a function {CONTRACT}, "
        f"a scripted function / module or a path to a .pt file; got {spec!r}{hint}"
    )


def _seed(r: ReductionLike, init: Any) -> ReductionLike:
    if init is None:
        return r
    if not isinstance(init, Mapping) and r.kind in BUILTIN_REDUCTIONS:
        raise ReductionError(
            f"init= of the built-in reduction {r.kind!r} must be its state dict (the state() of a {r.kind!r} reduction "
            f"with the same options, e.g. to resume one), got {type(init).__name__}; a lone tensor is the first "
            "accumulator of a custom reduction only"
        )
    state = dict(init) if isinstance(init, Mapping) else {"acc": init}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            raise ReductionError(f"initial state {k!r} must be a Tensor, got {type(v).__name__}")
    try:
        r.load_state(state)
    except ActivationScopeError as e:
        raise ReductionError(str(e)) from e
    return r


def _from_pt(path: Path, options: dict[str, float], name: str, *, scratch: bool = False) -> "_C.Reduction":
    """The native reduction of a ``.pt`` file; errors name it ``name`` when the file is a
    scratch file (a function compiled here), else by the path the user gave."""
    try:
        return _C.make_script_reduction(str(path), options, name if scratch else "")
    except ActivationScopeError as e:
        raise ReductionError(f"custom reduction {name!r}: {_load_error_text(str(e), path)}") from e


def _load_error_text(text: str, path: Path) -> str:
    """The native error of a ``.pt`` file that did not load, without torch's C++ stack and
    advice of its own (``Exception raised from ...``, ``This is an internal miniz error ...``),
    plus what the file seems to be and how to make one that loads."""
    if "could not be loaded as TorchScript" not in text:
        return text
    for cut in (" This is an internal miniz error", "Exception raised from"):
        text = text.split(cut, 1)[0]
    text = text.rstrip(" .\n") + "."
    try:
        with zipfile.ZipFile(path) as z:
            entries = z.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        entries = None
    if entries is None:
        what = " It is no TorchScript file (not a zip archive)"
    elif not any(e.split("/", 1)[-1].startswith("code/") for e in entries):
        what = (" It holds no TorchScript code: a file of torch.save (a tensor, a state dict, a pickled module), "
                "not of torch.jit.save")
    else:
        what = " It may come from another torch version, or be damaged"
    return (f"{text}{what}; save the reduction with script_reduction(fn, path) (activationscope.reductions) or "
            "torch.jit.save(torch.jit.script(fn), path), or pass the function itself in reductions=")


def make_reduction(spec: Any, *, init: Any = None, **options: float) -> ReductionLike:
    """Make one reduction from a built-in name, a function, a scripted object or a ``.pt`` path.

    Parameters
    ----------
    spec : str | callable | torch.jit.ScriptFunction | torch.jit.ScriptModule | os.PathLike
        A built-in name from :data:`BUILTIN_REDUCTIONS`; a Python function (or
        ``nn.Module``) with the contract ``(acc: Optional[Tensor], x: Tensor) -> Tensor``,
        compiled with TorchScript and run from C++; an already scripted function or module
        (a module may also define ``merge(a: Tensor, b: Tensor) -> Tensor`` to be
        mergeable); or the path of a ``.pt`` file saved by :func:`script_reduction` or
        ``torch.jit.save``.
    init : Tensor or dict[str, Tensor], optional
        Initial accumulator of a custom reduction (``load_state({"acc": init})``), or any
        reduction's state dict (resume from :meth:`state`).
    **options : float
        Options of the built-ins: ``per_feature`` (1: reduce over rows, result shape =
        feature_shape; 0: every value is one observation, result is a scalar), ``ddof``
        (``var``/``std``/``cov``, default 0: population statistics; the divisor is
        ``max(0, count - ddof)`` as in ``torch.var(correction=ddof)``, so ``ddof >= count``
        gives inf for a column that varies and NaN for a constant one), ``bins``/``lo``/``hi``
        (``hist``), ``k`` (``topk``, default 10). Custom reductions take none (their function
        gets only ``acc`` and ``x``): options given to one raise :class:`ReductionError`.

    Returns
    -------
    activationscope._C.Reduction or EagerReduction
        An empty reduction (``update(rows, row_offset)``, ``merge``, ``result``, ``state``,
        ``load_state``, ``fresh``, ``kind``, ``options``). :class:`EagerReduction` only when
        TorchScript could not compile a Python function (one warning per function).

    Raises
    ------
    ReductionError
        Unknown name (the message lists the valid ones), wrong signature, bad option,
        unreadable ``.pt``.

    Example
    -------
    >>> r = make_reduction("var")
    >>> r.update(torch.randn(128, 16))
    >>> r.result()["var"].shape
    torch.Size([16])
    """
    opts = _parse_options(options, spec)
    if isinstance(spec, str) and not _is_path_spec(spec):
        if spec not in BUILTIN_REDUCTIONS:
            raise _unknown_builtin(spec)
        if spec == "hist" and not {"lo", "hi"} <= set(opts):
            given = ", ".join(f"{k}={v:g}" for k, v in opts.items()) or "none"
            raise ReductionError(
                f"reduction 'hist' needs options 'lo' and 'hi' (the histogram range), got {given}: in Python "
                "('hist', 'hist', {'lo': -4.0, 'hi': 4.0}) in reductions= or make_reduction('hist', lo=-4.0, hi=4.0); "
                "on the command line hist[lo=-4,hi=4]")
        try:
            r = _C.make_builtin_reduction(spec, opts)
        except ActivationScopeError as e:
            raise ReductionError(str(e)) from e
        if spec == "hist":
            _check_hist_range(opts)
        return _seed(r, init)
    if opts and (_is_path_spec(spec) or _is_scripted(spec) or callable(spec)):
        # the function gets only (acc, x): an option would change nothing in its values
        name = Path(spec).stem if _is_path_spec(spec) else _fn_name(spec)
        given = ", ".join(f"{k}={v:g}" for k, v in opts.items())
        raise ReductionError(
            f"custom reduction {name!r} takes no options, got {given}: its function is called as fn(acc, x) only, so "
            f"the options would change none of its values (per_feature, ddof, bins, lo, hi and k are the built-ins'); "
            f"write the value into the function (or a scripted module's attribute), and give its first accumulator "
            f"as init="
        )
    if _is_path_spec(spec):
        path = Path(spec)
        if not path.is_file():
            raise ReductionError(f"custom reduction file {str(path)!r} does not exist")
        r = _from_pt(path, opts, path.stem)  # (the native load reports an unreadable file)
        _check_pt(path, path.stem, init)
        return _seed(r, init)
    if _is_scripted(spec) or callable(spec):
        if not _is_scripted(spec):
            _check_signature(spec)
        entry = _pt_for(spec)
        if entry is None:
            return _seed(EagerReduction(spec, opts), init)
        path, acc_optional = entry
        if init is None and not acc_optional:
            raise _needs_optional(spec)
        return _seed(_from_pt(path, opts, _fn_name(spec), scratch=True), init)
    raise ReductionError(
        f"reduction must be a built-in name {list(BUILTIN_REDUCTIONS)}, a function {CONTRACT}, "
        f"a scripted function / module or a path to a .pt file; got {type(spec).__name__}"
    )


#: Float64 / int64 values per feature of each built-in's state besides its ``count``
#: (``csrc/reductions_builtin.cpp``): ``mean``; ``mean``, ``m2``; ``value``; ``sumsq``; ``n_nonzero``.
_STATE_PER_FEATURE = {"mean": 1, "var": 2, "std": 2, "min": 1, "max": 1, "absmax": 1, "l2": 1, "nonzero": 1}


def state_bytes(kind: str, options: Mapping[str, float], n_features: int) -> int | None:
    """Bytes of the state (float64 and int64 tensors) of a built-in reduction ``kind`` with
    ``options`` over rows of ``n_features`` values (``prod(feature_shape)``), once it has seen
    rows: exactly what :meth:`state` holds (``topk``: once it holds ``k`` values, its most).
    None for a custom reduction (its state is its own).

    With ``per_feature=1`` (the default) the state is per feature, ``D = n_features``; with
    ``per_feature=0`` every value is one observation, ``D = 1``. Besides an 8-byte ``count``:
    ``hist`` ``(bins + 3) * D`` counts (bins, under, over, NaN); ``cov`` a ``(D, D)`` co-moment
    and a ``D`` mean (``(1, 1)`` and 1 with ``per_feature=0``); ``topk`` ``k * D`` values and
    row ids (and ``k`` feature ids with ``per_feature=0``); the others one or two values per
    feature (``var``/``std``: mean and m2)."""
    per_feature = bool(options.get("per_feature", 1.0))
    d = max(0, int(n_features)) if per_feature else 1
    count = 8
    if kind == "hist":
        return count + 8 * (int(options.get("bins", 64.0)) + 3) * d
    if kind == "cov":
        return count + 8 * (d * d + d)
    if kind == "topk":
        k = int(options.get("k", 10.0))
        return count + (16 * k * d if per_feature else 24 * k)
    if kind in _STATE_PER_FEATURE:
        return count + 8 * _STATE_PER_FEATURE[kind] * d
    return None


def _check_hist_range(opts: Mapping[str, float]) -> None:
    """Refuse a ``hist`` range whose bins float64 cannot tell apart: ``hi - lo`` not finite
    (``lo=-1e308, hi=1e308``: the edges are NaN and inf), ``bins / (hi - lo)`` not finite
    (``hi - lo`` subnormal: the bin of ``x == lo`` is NaN) or bins narrower than 16 float64
    steps at ``max(|lo|, |hi|)`` (``lo=1e15, hi=1e15 + 1, bins=1000``: edges repeat, and a
    value is no longer settled against the edges the result reports)."""
    lo, hi, bins = opts["lo"], opts["hi"], opts.get("bins", 64.0)
    width = (hi - lo) / bins
    if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(hi - lo) and math.isfinite(bins / (hi - lo))
            and width >= 16 * math.ulp(max(abs(lo), abs(hi)))):
        raise ReductionError(
            f"options of reduction 'hist' give bins float64 cannot hold: lo={lo!r}, hi={hi!r}, bins={int(bins)} "
            f"(bin width {width!r}); lo, hi, hi - lo and bins / (hi - lo) must be finite and each bin at least 16 float64 "
            "steps wide at max(|lo|, |hi|): use fewer bins or a wider range"
        )


def _needs_optional(fn: Any) -> ReductionError:
    return ReductionError(
        f"custom reduction {fn if isinstance(fn, str) else _fn_name(fn)!r} must annotate its first parameter as "
        f"Optional[torch.Tensor] ({CONTRACT}): TorchScript types an unannotated parameter as "
        "Tensor, which cannot be None on the first batch. Annotate it, or pass init=<Tensor>"
    )


def script_reduction(fn: Callable, path: Union[str, os.PathLike]) -> Path:
    """Compile a custom reduction with TorchScript and save it as a ``.pt`` file to ship.

    Parameters
    ----------
    fn : callable | torch.jit.ScriptFunction | torch.jit.ScriptModule
        ``(acc: Optional[Tensor], x: Tensor) -> Tensor``.
    path : str or os.PathLike
        Destination file (parents are created; an existing file is replaced).

    Returns
    -------
    pathlib.Path
        ``path``; load it with ``make_reduction(path)`` (or ``torch.jit.load``).

    Raises
    ------
    ReductionError
        Wrong signature, or TorchScript cannot compile ``fn`` (no eager fallback here).
    """
    if not _is_scripted(fn):
        if not callable(fn):
            raise ReductionError(f"custom reduction must be callable {CONTRACT}, got {type(fn).__name__}")
        _check_signature(fn)
        fn = _compile(fn, strict=True)
    _schema_acc_optional(fn)  # raises on a wrong arity
    _check_returns_tensor(fn, _fn_name(fn))
    return _save_scripted(fn, Path(path))


# ---------------------------------------------------------------------------- scope helpers


@dataclass(frozen=True)
class ReductionFactory:
    """A named reduction spec; calling it makes a fresh, empty reduction.

    Attributes
    ----------
    name : str
        Name of the result in the store (``reductions/<hook point>/<name>``).
    spec : Any
        What :func:`make_reduction` accepts.
    options : dict[str, float]
    init : Tensor or dict[str, Tensor] or None
        Initial accumulator / state.
    """

    name: str
    spec: Any
    options: dict = field(default_factory=dict)
    init: Any = None

    def __call__(self) -> ReductionLike:
        return make_reduction(self.spec, init=self.init, **self.options)

    @property
    def is_builtin(self) -> bool:
        return isinstance(self.spec, str) and self.spec in BUILTIN_REDUCTIONS

    def script_path(self) -> Optional[Path]:
        """The ``.pt`` file of a custom reduction (to keep with the store); None otherwise."""
        if self.is_builtin:
            return None
        if _is_path_spec(self.spec):
            return Path(self.spec)
        entry = _pt_for(self.spec)
        return entry[0] if entry else None


def _default_name(spec: Any) -> str:
    if isinstance(spec, str) and not _is_path_spec(spec):
        return spec
    if _is_path_spec(spec):
        return Path(spec).stem
    name = _fn_name(spec)
    if not name or not str(name).isidentifier():
        raise ReductionError(
            f"custom reduction {spec!r} has no usable name ({name!r}); give one as (name, fn)"
        )
    return str(name)


def _folded(name: str) -> str:
    """``name`` as a file system that folds case and Unicode normalization (macOS, Windows)
    compares it."""
    import unicodedata

    return unicodedata.normalize("NFC", unicodedata.normalize("NFD", name).casefold())


def _spelled(a: str, b: str) -> str:
    """`` (written ...)`` with both names in ASCII escapes when they print alike, else nothing."""
    import unicodedata

    return f" (written {ascii(a)} and {ascii(b)})" if unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b) else ""


def _check_overlapping_names(names: Iterable[str], where: str) -> None:
    """Two reductions of one hook point whose arrays would be the same: ``<name>.<key>`` of
    one (its other outputs ``var.mean``, states ``var.state.m2``, script ``var.pt``) is the
    other's name (``var`` and ``var.mean``), also where the names differ only in case or Unicode
    normalization (``Mean`` and ``mean``), as a file system that folds names compares them."""
    names = sorted(set(names))
    for a in names:
        for b in names:
            if a < b and _folded(a) == _folded(b):
                raise ReductionError(
                    f"{where} has reductions named {a!r} and {b!r}{_spelled(a, b)}, which differ only in case or Unicode "
                    "normalization: a file system that does not tell such names apart (macOS, Windows) holds their "
                    "arrays as one file, so a store there, or a copy of it, would read one as the other; rename one "
                    "with (name, spec)"
                )
            if b.startswith(a + ".") or (a != b and _folded(b).startswith(_folded(a) + ".")):
                folds = "" if b.startswith(a + ".") else (
                    " on a file system that does not tell names differing only in case apart (macOS, Windows)")
                raise ReductionError(
                    f"{where} has reductions named {a!r} and {b!r}: the arrays of {a!r} are stored as "
                    f"'{a}.<key>' (e.g. '{a}.count', '{a}.state.<key>'), so {b!r} would overwrite or be "
                    f"overwritten by one of them{folds}; rename one with (name, spec)"
                )


def _factory(item: Any, where: str = "") -> ReductionFactory:
    options: dict = {}
    if isinstance(item, tuple):
        if not 2 <= len(item) <= 3 or not isinstance(item[0], str):
            raise ReductionError(
                f"a reduction tuple must be (name, spec) or (name, spec, {{options}}), got {item!r}"
            )
        name, spec = item[0], item[1]
        if len(item) == 2 and isinstance(spec, Mapping):
            # (name, {options}): the options where the spec goes, which would be refused as "got dict"
            raise ReductionError(
                f"a reduction tuple must be (name, spec) or (name, spec, {{options}}), got {item!r}: its second entry "
                f"is the spec, not the options; write ({name!r}, {name!r}, {dict(spec)!r}) for the built-in "
                f"{name!r} with these options" if name in BUILTIN_REDUCTIONS else
                f"a reduction tuple must be (name, spec) or (name, spec, {{options}}), got {item!r}: its second entry "
                f"is the spec (a built-in name, a function or a .pt path), not the options; write (name, spec, "
                f"{dict(spec)!r})")
        if len(item) == 3:
            if not isinstance(item[2], Mapping):
                raise ReductionError(f"options of reduction {name!r} must be a dict, got {item[2]!r}")
            options = dict(item[2])
    elif isinstance(item, Mapping):
        if "spec" not in item:
            raise ReductionError(f"a reduction dict needs a 'spec' key, got keys {sorted(item)}")
        spec = item["spec"]
        name = item.get("name") or _default_name(spec)
        options = dict(item.get("options") or {})
        if "init" in item:
            options["init"] = item["init"]
    else:
        spec, name = item, _default_name(item)
    init = options.pop("init", None)
    check_reduction_name(name, where)
    f = ReductionFactory(name=name, spec=spec, options=_parse_options(options, spec), init=init)
    f()  # validate now (name, signature, options, TorchScript), not at the first batch
    return f


def resolve_reductions(
    reductions: Union[Sequence[Any], Mapping[str, Sequence[Any]], None], hook_point: str, names: Any = None
) -> list[tuple[str, ReductionFactory]]:
    """The reductions that apply to one hook point, as ``(name, factory)`` pairs.

    Parameters
    ----------
    reductions : list of specs, or dict {fnmatch pattern: list of specs}, or None
        A list applies to every hook point; a dict applies each list to the hook points its
        pattern selects (:func:`pattern_selects`: an exact hook-point name selects that hook
        point only, else ``fnmatch.fnmatchcase``), in the dict's order. A spec is anything
        :func:`make_reduction` accepts, ``(name, spec)``, ``(name, spec, {options})`` or
        ``{"name": ..., "spec": ..., "options": {...}, "init": tensor}``; ``options`` may hold
        ``init`` (initial accumulator). Names default to the built-in name, the function's
        ``__name__`` or the ``.pt`` file's stem.
    hook_point : str
    names : collection of str, optional
        The hook points the capture can have (exact names among the patterns win).

    Returns
    -------
    list[tuple[str, ReductionFactory]]

    Raises
    ------
    ReductionError
        Invalid spec, or two reductions with the same name at this hook point.
    """
    if not reductions:
        return []
    if isinstance(reductions, Mapping):
        items: list[tuple[str, Any]] = []
        for pattern, specs in reductions.items():
            if pattern_selects(pattern, hook_point, names):
                items += [(pattern, s) for s in _as_list(specs)]
    else:
        items = [("*", s) for s in _as_list(reductions)]
    out: list[tuple[str, ReductionFactory]] = []
    seen: dict[str, str] = {}
    for pattern, item in items:
        f = _factory(item, f" (hook point {hook_point!r}, pattern {pattern!r})")
        if f.name in seen:
            raise ReductionError(
                f"hook point {hook_point!r} has two reductions named {f.name!r} (patterns "
                f"{seen[f.name]!r} and {pattern!r}); name one with (name, spec)"
            )
        seen[f.name] = pattern
        out.append((f.name, f))
    _check_overlapping_names(seen, f"hook point {hook_point!r}")
    return out


def validate_reductions(reductions: Union[Sequence[Any], Mapping[str, Sequence[Any]], None]) -> None:
    """Check every spec of a scope's ``reductions=`` argument, before any capture.

    Parameters
    ----------
    reductions : list of specs, or dict {fnmatch pattern: list of specs}, or None
        As for :func:`resolve_reductions`.

    Raises
    ------
    ReductionError
        The first invalid spec (unknown name, option, signature, ``.pt`` file), a pattern
        that is not a string, or two reductions with the same name in one list.
    """
    if reductions is None:
        return
    if isinstance(reductions, Mapping):
        groups = []
        for pattern, specs in reductions.items():
            if not isinstance(pattern, str):
                raise ReductionError(f"reduction patterns must be str (fnmatch), got {pattern!r}")
            groups.append((pattern, specs))
    elif isinstance(reductions, (str, bytes)) or not isinstance(reductions, Iterable):
        raise ReductionError(
            f"reductions must be a list of specs or a dict {{pattern: list of specs}}, got {reductions!r}"
        )
    else:
        groups = [("*", reductions)]
    for pattern, specs in groups:
        seen: set[str] = set()
        for item in _as_list(specs):
            name = _factory(item, f" (pattern {pattern!r})").name
            if name in seen:
                raise ReductionError(
                    f"two reductions named {name!r} for pattern {pattern!r}; name one with (name, spec)"
                )
            seen.add(name)
        _check_overlapping_names(seen, f"pattern {pattern!r}")


def _all_specs(reductions: Union[Sequence[Any], Mapping[str, Sequence[Any]]]) -> list[Any]:
    """The reduction specs of a scope's ``reductions=`` argument, a list or a mapping of
    patterns to lists, in the order given."""
    if isinstance(reductions, Mapping):
        return [s for v in reductions.values() for s in _as_list(v)]
    return _as_list(reductions)


def _custom_factories(reductions: Union[Sequence[Any], Mapping[str, Sequence[Any]], None]) -> list[Any]:
    """The factories of the custom reductions of a ``reductions=`` argument, one per name, in
    the order given."""
    out: dict[str, Any] = {}
    for item in _all_specs(reductions) if reductions else []:
        f = _factory(item)
        if not f.is_builtin and f.name not in out:
            out[f.name] = f
    return list(out.values())


def unmergeable_reductions(reductions: Union[Sequence[Any], Mapping[str, Sequence[Any]], None]) -> list[str]:
    """Names of the custom reductions of a scope's ``reductions=`` argument that cannot merge
    (a plain function, scripted or not: no ``merge(a, b)`` method), in the order given.

    A multi-rank capture merges every rank's state when it commits; such a reduction would
    make its rank stores impossible to commit, so the capture refuses it before it starts.
    Each custom factory is made once and merged with an empty reduction of its kind (a no-op
    for a mergeable one).
    """
    out: list[str] = []
    for f in _custom_factories(reductions):
        r = f()
        try:
            r.merge(r.fresh())
        except ActivationScopeError as e:
            if "no merge rule" in str(e):
                out.append(f.name)
            else:
                raise
    return out


def eager_reductions(reductions: Union[Sequence[Any], Mapping[str, Sequence[Any]], None]) -> list[str]:
    """Names of the custom reductions of a scope's ``reductions=`` argument that run as eager
    Python (:class:`EagerReduction`: TorchScript could not compile them), in the order given.

    A store that keeps reductions only never continues such a reduction's stored state (no
    program tells that a resumed function is the same one), so its capture cannot be resumed.
    """
    return [f.name for f in _custom_factories(reductions) if isinstance(f(), EagerReduction)]


def reductions_for(
    reductions: Union[Sequence[Any], Mapping[str, Sequence[Any]], None], hook_point: str
) -> list[tuple[str, ReductionLike]]:
    """Fresh reductions for one hook point: ``[(name, reduction), ...]``.

    Same rules as :func:`resolve_reductions`, with each factory called once. The objects are
    native ``_C.Reduction``s except :class:`EagerReduction` (TorchScript fallback), which
    must be updated from Python.

    Parameters
    ----------
    reductions : sequence of specs, mapping of str to sequence of specs, or None
        As ``ActivationScope(reductions=...)`` takes them: specs for every hook point, or
        ``{hook point or fnmatch pattern: specs}``.
    hook_point : str
        The hook point to make them for.
    """
    return [(name, factory()) for name, factory in resolve_reductions(reductions, hook_point)]


def _as_list(specs: Any) -> list:
    if isinstance(specs, (str, tuple, Mapping)) or callable(specs) or isinstance(specs, os.PathLike):
        return [specs]
    return list(specs)


def merge_states(spec: Any, states: Iterable[Mapping[str, torch.Tensor]], **options: float) -> ReductionLike:
    """Merge saved states (workers, ranks, resumed runs) of one reduction.

    Parameters
    ----------
    spec : str | callable | ...
        The reduction, as given to :func:`make_reduction`; ``options`` must be those the
        states were made with.
    states : iterable of dict[str, Tensor]
        Outputs of ``Reduction.state()``.
    **options : float
        The reduction's options (``ddof=1``, ``k=5``, ...), as :func:`make_reduction` takes them.

    Returns
    -------
    Reduction
        Holding the merged state: call ``.result()`` or ``.state()``.
    """
    total = make_reduction(spec, **options)
    for s in states:
        part = total.fresh()
        try:
            part.load_state(dict(s))
            total.merge(part)
        except ActivationScopeError as e:
            raise ReductionError(str(e)) from e
    return total


def pca(cov: Union[Mapping[str, torch.Tensor], torch.Tensor], n_components: Optional[int] = None, *,
        hook_point: Optional[str] = None):
    """Principal components from a ``cov`` reduction.

    Parameters
    ----------
    cov : dict with key "cov" (the result of the ``cov`` reduction, or a hook point's
        ``store.reductions[hook_point]``) or Tensor, (D, D), any float dtype
    n_components : int, optional
        Keep the first ``n_components``, an int in 1..D (all D by default).
    hook_point : str, optional
        Named in error messages (default: ``cov.hook_point`` when ``cov`` has one, as the
        store's and the tracker's reduction results do).

    Returns
    -------
    explained_variance_ratio : Tensor, (n_components,), float64
        Eigenvalues divided by their sum (negative round-off eigenvalues clipped to 0),
        descending.
    components : Tensor, (n_components, D), float64
        Unit eigenvectors as rows, same order; the sign makes each row's largest-magnitude
        entry positive. Project centred rows with ``(x - mean) @ components.T``.

    Raises
    ------
    ReductionError
        The ``cov`` reduction saw no rows (its result has only a count of 0; the message
        names the hook point when known), ``cov`` is not a square matrix, or it holds NaN or
        inf (rows with NaN or inf, or no more rows than ``ddof``).
    ReductionNotFoundError
        ``cov`` is a hook point's reductions without a ``cov`` one.
    ArgumentValueError
        ``n_components`` is not an int in 1..D.
    """
    if hook_point is None:
        hook_point = getattr(cov, "hook_point", None)
    where = f" of hook point {hook_point!r}" if hook_point else ""
    if isinstance(cov, Mapping):
        if "cov" not in cov:
            count = cov.get("cov.count", cov.get("count"))  # a store's results, or a reduction's own
            if count is not None and torch.as_tensor(count).numel() == 1 and int(count) == 0:
                raise ReductionError(
                    f"reduction 'cov'{where} saw no rows (count is 0), so there is no covariance to decompose; "
                    "capture rows at that hook point first")
            if not hasattr(cov, "hook_point"):  # a store's results raise their own error naming the reductions
                raise ReductionError(
                    f"cov must be the result of a 'cov' reduction (a mapping with key 'cov') or a (D, D) Tensor; "
                    f"got a mapping{where} with keys {sorted(cov)}")
        c = cov["cov"]
    else:
        c = cov
    if c.dim() != 2 or c.shape[0] != c.shape[1]:
        raise ReductionError(f"cov{where} must be a square (D, D) matrix, got shape {tuple(c.shape)}")
    d = int(c.shape[0])
    if n_components is not None and (
            isinstance(n_components, bool) or not isinstance(n_components, int) or not 1 <= n_components <= d):
        raise ArgumentValueError(f"n_components must be an int in 1..{d}, got {n_components!r}")
    c = c.to(torch.float64)
    finite = torch.isfinite(c)
    if not bool(finite.all()):
        n_bad = int((~finite).sum())
        count = cov.get("cov.count", cov.get("count")) if isinstance(cov, Mapping) else None
        seen = (f" (count {int(count)})"
                if count is not None and torch.as_tensor(count).numel() == 1 else "")
        raise ReductionError(
            f"cov{where} holds NaN or inf ({n_bad} of {d * d} values){seen}, so it has no principal components: "
            "the rows it saw hold NaN or +-inf (an overflow, masked attention scores), or no more rows than its "
            "ddof; capture 'cov' where the rows are finite, or run activationscope.analysis.dask.pca on the stored "
            "rows, which leaves out rows with NaN or inf")
    c = (c + c.T) / 2
    evals, evecs = torch.linalg.eigh(c)
    evals = evals.flip(0).clamp_min(0)
    comps = evecs.flip(1).T.contiguous()
    idx = comps.abs().argmax(dim=1)
    signs = torch.sign(comps.gather(1, idx[:, None]))
    signs[signs == 0] = 1
    comps = comps * signs
    total = evals.sum()
    ratio = evals / total if total > 0 else torch.zeros_like(evals)
    if n_components is not None:
        ratio, comps = ratio[:n_components], comps[:n_components]
    return ratio, comps
