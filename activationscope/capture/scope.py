"""ActivationScope: capture intermediate activations with native hooks.

The hot path is native: each tracked module's ``forward`` is replaced (on the instance, for
the lifetime of the tracker) by a C++ callable that calls the original forward and hands
the tensors of its inputs and outputs to per-hook-point sinks with the GIL released. The
sinks copy (SNAPSHOT) or keep (REFERENCE) the activation, update reductions, and pass rows
to a store writer. Python runs once per new hook point and twice per root forward, never
per tensor.
"""

from __future__ import annotations

import copyreg
import enum
import functools
import inspect
import itertools
import math
import operator
import os
import re
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from . import _native, compiled
from .._args import parse_flag
from ..errors import (ActivationScopeError, ArgumentTypeError, ArgumentValueError, CaptureError, CaptureWarning,
                      HookPointNotFoundError, ReductionError, StoreError, StoreExistsError, StoreLockedError,
                      docs_page, names_repr, warn_at_caller)
from .hooks import (check_column, hook_point_module, is_hook_point_module, named_modules, never_called_type,
                    bracket_hint, normalize_patterns, pattern_selects, peft_holds, rename_hook_point, select_modules,
                    without_wrappers, wrapper_hint)
from .results import HookPointResults, ReductionResults, main_result_key
from .writer import check_writer_options, merges_reductions, open_writer, writer_options

_C = _native.load()
# torch's hook handles (forward hooks of any module, global ones too) take their ids from one
# counter: a forward whose value differs from the last one's had a hook registered before it
_RemovableHandle = torch.utils.hooks.RemovableHandle
_FORWARD_HOOKS = operator.attrgetter("_forward_hooks")  # a module's forward hooks: {handle id: hook}
# where accelerate keeps the forward it replaces on an instance: add_hook_to_module's
# `_old_forward` (cpu_offload, dispatch_model, ...) and Accelerator.prepare's `_original_forward`
_KEPT_FORWARD_ATTRS = ("_old_forward", "_original_forward")
_MAX_UNWRAP = 16  # forwards wrapping forwards followed (`__wrapped__`, `__func__`, a partial's `func`)
compiled.install()  # the in-graph path of a torch.compile'd tracked model


def _warn_2d_token_rows(name: str, shape: tuple[int, ...]) -> None:
    """The CaptureWarning for a 2-D hook point shaped like the mask, taken as token rows (one
    scalar per real token) while a mask has padding: its padded columns are dropped."""
    warn_at_caller(
        f"hook point {name!r} has shape {shape}, the attention mask's (batch, pos): it is "
        "stored as one scalar row per real token and its padded columns are dropped. If it is a pooled "
        "(batch, features) output whose width only happens to equal pos, pass token_rows={"
        f"{name!r}: False}} (one row per sample), or token_rows={{{name!r}: True}} to confirm token rows",
        CaptureWarning,
    )


def _warn_head_first_token_rows(found: Mapping[str, tuple[int, ...]]) -> None:
    """One CaptureWarning for the hook points of shape ``(batch, pos, pos, ...)`` first captured
    in a forward, taken as token rows: an attention map or per-head tensor ``(batch, heads, pos,
    ...)`` whose number of heads only happens to equal pos has that shape too, and would be
    stored as rows of (sample, head) pairs picked by the mask. (One warning, not one per hook
    point: a model returning its attention maps has several per layer.)"""
    listed = "; ".join(f"{name!r} {shape}, rows of {shape[2:]}" for name, shape in found.items())
    sample = ", ".join(f"{name!r}: False" for name in found)
    warn_at_caller(
        f"hook point{'s' if len(found) > 1 else ''} {listed}: the second dimension equals pos (of the attention "
        "mask, or under rows='token' without one, of the model's first input), and so does the third, so each "
        "is stored as one row per real token. If it is head-first, (batch, heads, pos, ...) like an attention "
        f"map whose number of heads only happens to equal pos, pass token_rows={{{sample}}} (one row per "
        "sample; fnmatch patterns work too); True instead of False confirms token rows",
        CaptureWarning,
    )


def _reduce_forward_wrapper(wrapper: Any) -> tuple[Any, tuple[Any, ...]]:
    """Pickle / copy a tracked module's native forward wrapper as the forward it replaced.

    ``copy.deepcopy``, ``pickle`` and ``torch.save`` of a module while it is tracked meet
    the wrapper in the module's ``__dict__``; they get the forward the module had before
    (a bound method re-bound to the copy of its object, any other callable as it is), so
    the copy is an untracked model that computes what the original computes. Only the
    standard library is named in the pickle: a checkpoint saved while tracked loads
    without activationscope.
    """
    forward = getattr(wrapper, "__wrapped__", None)
    if forward is None:
        forward = wrapper.original
    func = getattr(forward, "__func__", None)
    owner = getattr(forward, "__self__", None)
    if owner is not None and callable(getattr(func, "__get__", None)) and not isinstance(owner, type):
        return func.__get__, (owner,)  # the method bound to the copy of its module
    return operator.itemgetter(0), ((forward,),)  # the callable itself


copyreg.pickle(_C.ForwardWrapper, _reduce_forward_wrapper)

__all__ = [
    "ActivationScope",
    "Tracker",
    "StoragePolicy",
    "ReductionPolicy",
    "CapturePolicy",
    "CaptureMode",
]



class StoragePolicy(enum.Enum):
    """Where captured activations are kept.

    AUTO : host memory for in-memory capture (pinned + asynchronous copies when activations
        live on an accelerator); DISK when a ``store=`` is given.
    CPU : host memory.
    GPU : the activation's own device (no device-to-host copy).
    DISK : streamed into a store (``store=``), nothing kept in memory.
    """

    AUTO = "auto"
    CPU = "cpu"
    GPU = "gpu"
    DISK = "disk"


class ReductionPolicy(enum.Enum):
    """What is kept next to the reductions.

    STORE_ALL : every captured activation, plus the reductions (in memory, or every row in a
        store with ``store=``).
    STREAMING : reductions only; activations are reduced and dropped (memory stays flat).
        With ``store=``, a store that keeps the reductions, the sample row table and the rows
        reduced per hook point, and no activation row (``store/FORMAT.md`` section 11).
    FINAL_ONLY : only the most recent activation per hook point, plus the reductions (in
        memory only).
    """

    STORE_ALL = "store_all"
    STREAMING = "streaming"
    FINAL_ONLY = "final_only"


class CapturePolicy(enum.Enum):
    """When to capture, counted in root forwards (calls of the tracked model).

    EVERY : every forward.
    SAMPLE_N : forwards 0, n, 2n, ... (``sample_every=n``).
    MAX_K : the first k forwards (``max_k=k``); later forwards cost one branch per module. A
        resumed store capture counts the forwards the store already holds.
    """

    EVERY = "every"
    SAMPLE_N = "sample_n"
    MAX_K = "max_k"


class CaptureMode(enum.Enum):
    """How an activation is taken.

    SNAPSHOT : copy at the moment of the call (default): later in-place changes by the
        model (``ReLU(inplace=True)``, in-place residual adds) do not reach the record.
    REFERENCE : keep the tensor itself (no copy, fastest). A later in-place change is
        detected through the tensor's version counter and warned about, naming the hook point,
        when the records are read (``activations``) and when the ``with`` block ends.
        Under ``torch.inference_mode`` tensors have no version counter: they are copied.
        With ``storage_dtype`` a record of a floating-point hook point holds the cast values,
        so it is a copy too; an integer or bool hook point (not cast) is kept without a copy.
    """

    REFERENCE = "reference"
    SNAPSHOT = "snapshot"


_CAPTURE_SIDES = ("output", "input", "both")
_ROWS = ("auto", "token")
_REBUILD_ROWS = 1 << 16  # rows read back per step when a resumed reduction is rebuilt from the store
_POLICY_CODE = {CapturePolicy.EVERY: 0, CapturePolicy.SAMPLE_N: 1, CapturePolicy.MAX_K: 2}
_KEEP_CODE = {ReductionPolicy.STORE_ALL: 0, ReductionPolicy.FINAL_ONLY: 1, ReductionPolicy.STREAMING: 2}
_PLACEMENT_CODE = {StoragePolicy.AUTO: 0, StoragePolicy.CPU: 1, StoragePolicy.GPU: 2, StoragePolicy.DISK: 3}
# The close of a tracker waits this long for calls of its modules still running in other threads.
_CLOSE_WAIT_S = 30.0
# Trackers attached (or attaching) in this process, each with the thread that attached it
# (Tracker._thread), the ids of the modules it wraps (Tracker._module_ids) and of every module
# of its model (Tracker._tree_ids): trackers one of which wraps a module of the other's model
# must be attached from one thread (Tracker._claim_modules)
_ATTACHED: "weakref.WeakSet[Tracker]" = weakref.WeakSet()
_ATTACHED_LOCK = threading.Lock()


def _parse_enum(value: Any, cls: type[enum.Enum], argument: str) -> enum.Enum:
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if value.lower() in (member.value, member.name.lower()):
                return member
    choices = ", ".join(f"{cls.__name__}.{m.name}" for m in cls)
    raise ArgumentValueError(f"{argument} must be one of [{choices}], got {value!r}")


def _refuse_unknown_keywords(unknown: Mapping[str, Any], store_options: Any) -> None:
    """Raise ArgumentTypeError for keywords ActivationScope does not take, naming the fix."""
    import difflib
    import reprlib

    params = [n for n in inspect.signature(ActivationScope.__init__).parameters if n not in ("self", "unknown")]
    valid = writer_options()
    shown = reprlib.Repr()
    shown.maxstring = shown.maxother = 60
    for key in unknown:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, params, n=3, cutoff=0.6)
        near_writer = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        if close:
            fix = f"did you mean {', '.join(f'{c}=' for c in close)}?"
        elif near_writer:
            fix = (f"did you mean the store writer option {near_writer[0]!r}, given as "
                   f"store_options={{{near_writer[0]!r}: {shown.repr(unknown[key])}}}?")
        else:
            fix = f"its parameters are {params}, and store_options= takes the store writer's options {valid}"
        raise ArgumentTypeError(f"ActivationScope got an unexpected keyword argument {key!r}; {fix}")
    for_writer = dict(unknown)
    merged = {**(dict(store_options) if isinstance(store_options, Mapping) else {}), **for_writer}
    fix = "{" + ", ".join(f"{k!r}: {shown.repr(v)}" for k, v in merged.items()) + "}"
    raise ArgumentTypeError(
        f"ActivationScope got unexpected keyword argument{'s' if len(for_writer) > 1 else ''} "
        f"{', '.join(map(repr, for_writer))}: "
        f"{'options' if len(for_writer) > 1 else 'an option'} of the store writer, which ActivationScope takes "
        f"through store_options; pass ActivationScope(store=..., store_options={fix})")


def _check_store_options(options: Mapping[str, Any]) -> None:
    import difflib

    valid = writer_options()
    for key in options:
        if key not in valid:
            hint = "; storage_dtype is an argument of ActivationScope itself" if key == "storage_dtype" else ""
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6) if isinstance(key, str) else []
            meant = f"; did you mean {close[0]!r}?" if close else ""
            raise ArgumentTypeError(f"store_options has no option {key!r}; valid options are {valid}{meant}{hint}")
    check_writer_options(options)  # their values, before a model runs


def _parse_token_rows(value: Any) -> bool | dict[str, bool] | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, Mapping):
        out: dict[str, bool] = {}
        for pattern, flag in value.items():
            if not isinstance(pattern, str) or not isinstance(flag, bool):
                raise ArgumentTypeError(
                    f"token_rows must map fnmatch patterns (str) to True (token rows) or False (sample rows), got "
                    f"{pattern!r}: {flag!r}"
                )
            out[pattern] = flag
        return out
    raise ArgumentTypeError(
        f"token_rows must be None, a bool or a dict of fnmatch pattern to bool, got {type(value).__name__}"
    )


def _parse_capture(capture: Any) -> str:
    if isinstance(capture, CapturePolicy):
        raise ArgumentTypeError(
            f"capture= takes which side to capture ('output', 'input' or 'both'), got {capture}; "
            f"to choose when to capture, pass capture_policy={capture} instead"
        )
    if capture not in _CAPTURE_SIDES:
        raise ArgumentValueError(f"capture must be one of {list(_CAPTURE_SIDES)}, got {capture!r}")
    return capture


class ActivationScope:
    """Configuration of a capture; ``track(model)`` makes a :class:`Tracker`.

    Parameters
    ----------
    capture : {"output", "input", "both"}, default "output"
        Which side of each tracked module is captured. Inputs are taken before the module
        runs; positional inputs are ``<module>.input.<i>``, keyword inputs
        ``<module>.input.kw.<name>``.
    capture_policy : CapturePolicy, default EVERY
        When to capture (counted in forwards of the tracked model).
    sample_every : int, optional
        Period of ``CapturePolicy.SAMPLE_N`` (required by it; refused with another policy,
        which would ignore it).
    max_k : int, optional
        Number of forwards captured by ``CapturePolicy.MAX_K`` (required by it; refused with
        another policy, which would ignore it).
    capture_mode : CaptureMode, default SNAPSHOT
        Copy now (SNAPSHOT) or keep the tensor (REFERENCE).
    storage : StoragePolicy, default AUTO
        Where activations go; DISK (the default when ``store=`` is given) streams them into
        the store.
    reduction_policy : ReductionPolicy, default STORE_ALL
        Whether activations are kept next to the reductions. With ``store=`` (and
        ``storage=StoragePolicy.DISK``, its default): STORE_ALL stores every captured row;
        STREAMING (``reductions=`` required) makes a store that keeps
        reductions only (its reductions, exactly as a STORE_ALL store holds them, the sample
        row table and the rows reduced per hook point; no activation row, no token row table:
        reading rows from it raises :class:`~activationscope.errors.StoreError`). Each commit
        stores the reductions of its forwards, so ``resume=True`` with the same reductions
        continues a killed capture (a resume that cannot continue every stored reduction
        raises StoreError, the store left as it is); several ranks are refused when the
        tracker attaches. FINAL_ONLY is refused there. With ``store=`` and
        ``storage=StoragePolicy.CPU`` (or GPU) the store holds every captured row and the
        policy decides what is kept in memory.
    reductions : list or dict, optional
        Online reductions: a list of specs for every hook point (``["mean", "var"]``, a
        Python function ``(acc: Optional[Tensor], x: Tensor) -> Tensor`` compiled with
        TorchScript, a scripted function, or a ``.pt`` path), or ``{fnmatch pattern: list}``
        per hook point (a pattern equal to a tracked hook point selects that one only; a
        pattern that selects none of the hook points of the first captured forward, nor any
        a tracked module could give in a later one, raises
        :class:`~activationscope.errors.HookPointNotFoundError` at the end of that forward,
        before any of its rows is stored). See :mod:`activationscope.reductions`.
    store : str, os.PathLike, zarr store or None
        Capture into a store: a local path, an fsspec URL (``s3://bucket/run.zarr``,
        ``memory://run``) or a zarr ``Store``. See :mod:`activationscope.store`.
    store_options : dict, optional
        Options of the store writer (``overwrite``, ``resume``, ``compression``,
        ``chunk_rows``, ``shard_bytes``, ``provenance``, ...), see
        :class:`activationscope.store.StoreWriter`.
    storage_dtype : torch.dtype, optional
        Cast the activations of floating-point hook points (float16, bfloat16, float32,
        float64) to it (e.g. ``torch.bfloat16`` to halve memory and disk); integer and bool
        hook points (token ids as an input, argmax outputs, masks) keep their own dtype, in
        records and in the store. Which a hook point is, its first call decides: a later call
        of one whose first was integer or bool that gives a floating-point tensor raises
        :class:`CaptureError` naming both dtypes (its record would keep the uncast values; a
        store refuses any change of a hook point's dtype), unless the hook point keeps nothing
        (``reduction_policy=STREAMING`` and no reduction applying to it). Records, stored rows and
        reductions are all the stored values (a reduction equals the float64 statistic of
        ``store[hook_point]``). A cast
        that turns a finite value into inf raises :class:`CaptureError` naming the hook
        point, as does a complex hook point (the cast would drop its imaginary part). A resume
        must use the store's ``storage_dtype``; a hook point the store holds cast (its array,
        or in a store that keeps reductions only the rows it reduced, is ``storage_dtype``: its
        first call was floating-point, or an earlier version cast every hook point) is cast
        again when the resume's first call gives integers, and an integer the cast would
        change (token id 257 in bfloat16, which holds every integer only up to 256) raises
        :class:`CaptureError`.
    capture_parameters : bool, default False
        Snapshot the model's parameters when the tracker attaches
        (``tracker.parameters``); anything but a bool (``"False"``) raises ArgumentTypeError.
    include, exclude : list of str, optional
        Default fnmatch patterns of modules for :meth:`track`.
    exclude_hook_points : list of str, optional
        Default fnmatch patterns of hook points for :meth:`track` that are never captured
        (no record, row or reduction), while the other hook points of their module are: a
        leaf of a structured output, such as the attention weights ``h.0.output.1`` a BLOOM
        block returns next to its hidden state ``h.0.output.0``. A pattern equal to a hook
        point selects that one only. A pattern that left out no hook point of the captured
        forwards warns at the end of the capture (``CaptureWarning``).
    rows : {"auto", "token"}, default "auto"
        What a stored row is. ``"auto"``: one row per real token for hook points whose
        activation starts with the ``(batch, pos)`` of an attention mask given to
        :meth:`Tracker.set_batch`, else one row per sample (a model given an ``attention_mask``
        with padding that ``set_batch`` does not describe keeps it inside such sample rows: a
        store or reduction capture warns once, ``CaptureWarning``). ``"token"``: one row per token
        also without a mask: ``(batch, pos)`` are the first two dimensions of the model's
        first tensor input (token ids ``(batch, pos)``, or embeddings ``(batch, pos, d)``),
        and every hook point whose activation starts with them stores
        ``(batch * pos, *rest)`` rows, in ``(sample, position)`` order; a mask given to
        ``set_batch`` still leaves padding out. A capture where no tracked hook point starts
        with them warns once (``CaptureWarning``, ``reason == "token_rows_unused"``).
    token_rows : bool or dict of str to bool, optional
        Overrides the shape rule of ``rows`` for hook points whose activation starts with
        the ``(batch, pos)`` of the forward's mask, where the shape alone cannot tell a
        per-token activation from a pooled ``(batch, features)`` one whose width happens to
        equal ``pos``. ``{fnmatch pattern: bool}`` per hook point (the first matching
        pattern wins; hook points no pattern matches follow the shape rule): True stores one
        row per token (padding left out), False one row per sample (the whole activation).
        A bool applies to every hook point. Either way no ambiguity warning is given for the
        hook points it decides. A hook point a pattern sets to True that cannot be token
        rows (its activation does not start with the mask's ``(batch, pos)``, or the forward
        has no mask) raises :class:`CaptureError`. A pattern that selects no hook point of
        the first captured forward (nor one a tracked module could give in a later forward;
        for a resume that captures no forward: none of the stored hook points) raises
        :class:`HookPointNotFoundError` at the end of that forward (``argument``
        ``"token_rows"``, ``pattern``, ``hook_points``), as a ``reductions=`` pattern does;
        no row of the run is stored.
    stop_after_last : bool, default False
        End each captured forward as soon as every tracked hook point of it has been
        captured: the modules after the last hook point (later layers, the unembedding)
        do not run, and the forward returns ``None``. Which hook point is last is learnt
        from the first captured forward (call order), which runs in full. Records, stores
        and reductions are exactly those of a full run in eval mode (in training mode the
        skipped dropout and BatchNorm modules change later forwards' random draws: a
        ``CaptureWarning`` says so). Forwards that the capture policy
        skips run in full and return their output. See the capture guide for what it
        assumes (every forward reaches the same hook points in the same order).
    **unknown
        Any other keyword is refused with :class:`~activationscope.errors.ArgumentTypeError`
        naming the fix: an option of the store writer (``overwrite=True``, ``resume=True``,
        ``compression=...``) goes in ``store_options={'overwrite': True}``; another name is
        answered with the closest parameter names.

    Raises
    ------
    TypeError
        A keyword that is not a parameter (a store writer option given directly, or a typo:
        the message names the fix);
        ``capture=`` given a CapturePolicy (use ``capture_policy=``), or a ``token_rows``
        that is not a bool or a dict of pattern to bool; ``store_options`` that is not a dict; a
        ``store_options`` key the writer
        does not take, or a value of the wrong type (``overwrite`` / ``resume`` / ``fsync``
        not a bool, ``process_group``, ``provenance`` or ``storage_options`` of another type).
    ValueError
        An unknown policy, side or non-positive ``sample_every`` / ``max_k``;
        ``reduction_policy=ReductionPolicy.FINAL_ONLY`` with ``storage=StoragePolicy.DISK`` (the
        default with ``store=``); STREAMING without ``reductions=`` (but for a store capture
        that also keeps records in memory); ``sample_every``
        (other than 1) or ``max_k`` without the policy that uses it, or that policy without it; a
        ``store_options`` value the writer refuses (``compression``, ``chunk_rows``,
        ``shard_rows``, ...: checked here, before a model runs).

    Example
    -------
    >>> with ActivationScope().track(model) as tracker:   # doctest: +SKIP
    ...     out = model(x)
    >>> tracker.activations["0.output"][0].shape          # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        capture: str = "output",
        capture_policy: CapturePolicy | str = CapturePolicy.EVERY,
        sample_every: int | None = None,
        max_k: int | None = None,
        capture_mode: CaptureMode | str = CaptureMode.SNAPSHOT,
        storage: StoragePolicy | str = StoragePolicy.AUTO,
        reduction_policy: ReductionPolicy | str = ReductionPolicy.STORE_ALL,
        reductions: Sequence[Any] | Mapping[str, Sequence[Any]] | None = None,
        store: Any = None,
        store_options: Mapping[str, Any] | None = None,
        storage_dtype: torch.dtype | None = None,
        capture_parameters: bool = False,
        include: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
        rows: str = "auto",
        token_rows: bool | Mapping[str, bool] | None = None,
        stop_after_last: bool = False,
        exclude_hook_points: Iterable[str] | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            _refuse_unknown_keywords(unknown, store_options)
        self.capture = _parse_capture(capture)
        self.token_rows = _parse_token_rows(token_rows)
        if rows not in _ROWS:
            raise ArgumentValueError(
                f"rows must be one of {list(_ROWS)}, got {rows!r}"
                + ("; for one row per sample whatever the shapes, pass token_rows=False (rows='auto' stores one row "
                   "per sample unless set_batch gives an attention mask)" if rows == "sample" else ""))
        stop_after_last = parse_flag(stop_after_last, "stop_after_last")
        self.rows = rows
        self.stop_after_last = stop_after_last
        self.capture_policy = _parse_enum(capture_policy, CapturePolicy, "capture_policy")
        self.capture_mode = _parse_enum(capture_mode, CaptureMode, "capture_mode")
        self.storage = _parse_enum(storage, StoragePolicy, "storage")
        self.reduction_policy = _parse_enum(reduction_policy, ReductionPolicy, "reduction_policy")
        if sample_every is not None and (not isinstance(sample_every, int) or isinstance(sample_every, bool)
                                         or sample_every < 1):
            raise ArgumentValueError(f"sample_every must be a positive int, got {sample_every!r}")
        if self.capture_policy is CapturePolicy.MAX_K:
            if not isinstance(max_k, int) or isinstance(max_k, bool) or max_k < 1:
                raise ArgumentValueError(f"capture_policy=CapturePolicy.MAX_K needs max_k= a positive int (max_k=0 "
                                         f"would record nothing), got {max_k!r}")
        elif max_k is not None:
            # (ignored, it would capture every forward it meant to leave out)
            raise ArgumentValueError(
                f"max_k={max_k!r} counts the forwards of capture_policy=CapturePolicy.MAX_K only, and this capture has "
                f"capture_policy=CapturePolicy.{self.capture_policy.name}: pass capture_policy=CapturePolicy.MAX_K to "
                "capture the first max_k forwards, or leave max_k out")
        if self.capture_policy is CapturePolicy.SAMPLE_N:
            if sample_every is None:
                raise ArgumentValueError(
                    "capture_policy=CapturePolicy.SAMPLE_N needs sample_every= a positive int (forwards 0, n, 2n, ... "
                    "are captured; without it every forward would be), got None")
        elif sample_every not in (None, 1):
            raise ArgumentValueError(
                f"sample_every={sample_every!r} is the period of capture_policy=CapturePolicy.SAMPLE_N only, and this "
                f"capture has capture_policy=CapturePolicy.{self.capture_policy.name}: pass "
                "capture_policy=CapturePolicy.SAMPLE_N to capture forwards 0, n, 2n, ..., or leave sample_every out")
        if sample_every is None:
            sample_every = 1
        if storage_dtype is not None and not isinstance(storage_dtype, torch.dtype):
            raise ArgumentTypeError(f"storage_dtype must be a torch.dtype, got {storage_dtype!r}")
        if storage_dtype is not None and not storage_dtype.is_floating_point:
            raise ArgumentValueError(
                "storage_dtype must be a floating-point dtype (torch.float32, torch.float16, torch.bfloat16, ...), "
                f"got {storage_dtype}: casting activations to it would truncate them"
            )
        if storage_dtype is not None and storage_dtype.itemsize == 1:
            raise ArgumentValueError(
                f"storage_dtype={storage_dtype} is not supported (8-bit floats have no overflow check nor "
                "reductions on the CPU, and a store cannot hold them); use torch.float16 or torch.bfloat16"
            )
        if store_options is not None and not isinstance(store_options, Mapping):
            raise ArgumentTypeError(
                f"store_options must be a dict of writer options (e.g. {{'overwrite': True}}), got "
                f"{type(store_options).__name__} {store_options!r}")
        if store_options:
            if store is None:
                raise ArgumentValueError(f"store_options={dict(store_options)!r} needs store= (a path, URL or zarr store)")
            _check_store_options(store_options)
        if self.storage is StoragePolicy.DISK and store is None:
            raise ArgumentValueError("storage=StoragePolicy.DISK needs store= (a path, URL or zarr store) to write into")
        if store is not None and self.storage is StoragePolicy.AUTO:
            self.storage = StoragePolicy.DISK
        if self.storage is StoragePolicy.DISK and self.reduction_policy is ReductionPolicy.FINAL_ONLY:
            # (it decides which records stay in memory; a store holds every captured row whatever it says)
            raise ArgumentValueError(
                f"reduction_policy=ReductionPolicy.{self.reduction_policy.name} decides which activations are kept in "
                "memory next to the reductions, and a store capture (storage=StoragePolicy.DISK) keeps none there: "
                "the store would hold every captured row, not only the reductions. To keep only the reductions in "
                "the store, pass reduction_policy=ReductionPolicy.STREAMING with reductions=; to store every row with "
                "its reductions, leave reduction_policy out; to also keep records in memory, pass "
                "storage=StoragePolicy.CPU"
            )
        if self.reduction_policy is ReductionPolicy.STREAMING and not reductions and (
                store is None or self.storage is StoragePolicy.DISK):
            raise ArgumentValueError(
                "reduction_policy=ReductionPolicy.STREAMING keeps only reductions, and none were given, so the "
                "capture would keep nothing" + (
                    f" (a store {str(store)!r} that keeps reductions only would hold no value); pass reductions=[...] "
                    "(e.g. ['mean', 'var']), or leave reduction_policy out to store every row"
                    if store is not None else "; pass reductions=[...] (e.g. ['mean', 'var']) or store= a path")
            )
        self.sample_every = sample_every
        self.max_k = max_k
        self.reductions = reductions
        self.store = store
        self.store_options = dict(store_options or {})
        self.storage_dtype = storage_dtype
        self.capture_parameters = parse_flag(capture_parameters, "capture_parameters")  # ("False" is a true string)
        self.include = normalize_patterns(include, "include")
        self.exclude = normalize_patterns(exclude, "exclude")
        self.exclude_hook_points = normalize_patterns(exclude_hook_points, "exclude_hook_points")
        if reductions is not None:
            from . import reductions as _red

            _red.validate_reductions(reductions)
        _native.check_pool_env()  # the staging pool's cap, read once the first capture needs a slab

    def __repr__(self) -> str:
        where = "memory" if self.store is None else repr(str(self.store) if isinstance(self.store, (str, os.PathLike))
                                                         else type(self.store).__name__)
        parts = [f"store={where}", f"capture={self.capture!r}", f"capture_policy={self.capture_policy.name}"]
        if self.reductions:  # (names: a custom reduction's repr may be a whole TorchScript module)
            def names(specs: Any) -> list[str]:
                specs = [specs] if isinstance(specs, (str, os.PathLike)) or callable(specs) else specs
                return [r if isinstance(r, str) else os.fspath(r) if isinstance(r, os.PathLike)
                        else r[0] if isinstance(r, tuple) and r and isinstance(r[0], str)
                        else getattr(r, "__name__", type(r).__name__) for r in specs]

            red = self.reductions
            shown = {p: names(v) for p, v in red.items()} if isinstance(red, Mapping) else names(red)
            parts.append(f"reductions={shown!r}")
        if self.store_options:
            # (storage_options holds credentials, key / secret / token: its keys only, never their values)
            shown = {k: ({o: "..." for o in v} if k == "storage_options" and isinstance(v, Mapping) else v)
                     for k, v in self.store_options.items()}
            parts.append(f"store_options={shown!r}")
        return f"<ActivationScope {', '.join(parts)}>"

    def config(self) -> dict[str, Any]:
        """The capture configuration as plain JSON-able values (stored as provenance)."""
        return {
            "capture": self.capture,
            "capture_policy": self.capture_policy.name,
            "sample_every": self.sample_every,
            "max_k": self.max_k,
            "capture_mode": self.capture_mode.name,
            "storage": self.storage.name,
            "reduction_policy": self.reduction_policy.name,
            "storage_dtype": None if self.storage_dtype is None else str(self.storage_dtype).replace("torch.", ""),
            "include": self.include,
            "exclude": self.exclude,
            "rows": self.rows,
            "token_rows": self.token_rows,
            "stop_after_last": self.stop_after_last,
            "exclude_hook_points": self.exclude_hook_points,
        }

    def track(
        self,
        model: torch.nn.Module,
        include: Iterable[str] | None = None,
        exclude: Iterable[str] | None = None,
        capture: str | None = None,
        stop_after_last: bool | None = None,
        token_rows: bool | Mapping[str, bool] | None = None,
        exclude_hook_points: Iterable[str] | None = None,
    ) -> "Tracker":
        """Make a tracker for ``model`` (attached on ``__enter__`` or :meth:`Tracker.attach`).

        Parameters
        ----------
        model : torch.nn.Module
        include, exclude : list of str, optional
            Module names or fnmatch patterns on ``named_modules()`` names; a pattern equal
            to a module name selects that module only (``"d.a[1]"`` is the module
            ``d.a[1]``, not ``d.a1``); override the scope's.
        capture : {"output", "input", "both"}, optional
            Override the scope's side.
        stop_after_last : bool, optional
            Override the scope's ``stop_after_last``: end each captured forward after its
            last tracked hook point; the forward then returns ``None``.
        token_rows : bool or dict of str to bool, optional
            Override the scope's ``token_rows`` (which hook points shaped like the mask's
            ``(batch, pos)`` store token rows, and which sample rows).
        exclude_hook_points : list of str, optional
            Override the scope's ``exclude_hook_points`` (hook points never captured).

        Raises
        ------
        HookPointNotFoundError
            An ``include`` pattern matches no module, or the selection ends up empty (an
            ``exclude`` pattern that matches no module warns, ``CaptureWarning``).
        ArgumentTypeError
            ``stop_after_last`` is not a bool, or ``include`` / ``exclude`` is neither a str
            nor a list of str.

        Example
        -------
        >>> with scope.track(model, include=["blocks.2.hook_resid_post"],
        ...                  stop_after_last=True) as tracker:        # doctest: +SKIP
        ...     model(tokens)                                        # returns None
        """
        side = self.capture if capture is None else _parse_capture(capture)
        inc = normalize_patterns(include, "include") if include is not None else self.include
        exc = normalize_patterns(exclude, "exclude") if exclude is not None else self.exclude
        if stop_after_last is not None:
            stop_after_last = parse_flag(stop_after_last, "stop_after_last")
        compiled = model is not _uncompiled(model) or getattr(model, "_compiled_call_impl", None) is not None
        model = _uncompiled(model)
        modules = select_modules(model, inc, exc)
        stop = self.stop_after_last if stop_after_last is None else stop_after_last
        tracker = Tracker(self, model, modules, side, stop_after_last=stop,
                          patterns={"include": inc, "exclude": exc})
        if token_rows is not None:
            tracker._token_rows = _parse_token_rows(token_rows)
        if exclude_hook_points is not None:
            tracker._skip_patterns = normalize_patterns(exclude_hook_points, "exclude_hook_points")
        tracker._hook_probes_done = compiled  # (probes would make a compiled model compile again)
        tracker._hook_probes_done_compiled = compiled
        return tracker


def _memory_bytes() -> int | None:
    """This machine's physical memory in bytes, None when the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _script_of(factory: Any) -> tuple[str | None, bytes | None]:
    """The ``.pt`` file of a custom reduction's factory and its bytes as they are now ((None,
    None) for a built-in or eager one, bytes None when the file cannot be read)."""
    script = factory.script_path()
    if script is None:
        return None, None
    try:
        with open(script, "rb") as f:
            return str(script), f.read()
    except OSError:
        return str(script), None


def _keep_script(reduction: Any, factory: Any, before: tuple[str | None, bytes | None], name: str,
                 hook_point: str) -> None:
    """Give a reduction just made by ``factory`` the path (``script_path``) and the bytes
    (``script_bytes``) of the TorchScript program it runs, read when it was loaded: what the
    store keeps, and what a resume compares with the stored program (the file may be saved
    again with another program while the capture runs).

    Raises
    ------
    ReductionError
        The file changed while the reduction loaded it (its bytes before and after differ).
    """
    script, data = _script_of(factory)
    if script is not None and before[0] == script and None not in (before[1], data) and before[1] != data:
        raise ReductionError(
            f"custom reduction {name!r} of hook point {hook_point!r}: its file {script!r} changed while it was loaded "
            "(saved again meanwhile); which program runs is not known. Save a reduction you change to another "
            "path while a capture uses it, then run the capture again")
    reduction.script_path = script
    reduction.script_bytes = data


def _check_state_fits(hook_point: str, name: str, reduction: Any, n_features: int, state_bytes: Any) -> None:
    """Refuse, before its state is allocated, a built-in reduction whose float64 state over
    ``n_features`` values per row would be larger than this machine's memory (``hist`` with
    2**24 bins on 768 features: 103 GB)."""
    need = state_bytes(str(reduction.kind), dict(reduction.options), n_features)
    have = _memory_bytes()
    if need is None or have is None or need <= have:
        return
    opts = ", ".join(f"{k}={int(v) if float(v).is_integer() else v}" for k, v in sorted(dict(reduction.options).items()))
    raise ReductionError(
        f"reduction {name!r} ({reduction.kind}, {opts}) of hook point {hook_point!r} needs a state of "
        f"{need / 1e9:.1f} GB over its {n_features} values per row, more than this machine's memory "
        f"({have / 1e9:.1f} GB); nothing was allocated. Use fewer bins or a smaller k, per_feature=0, or reduce "
        "fewer features (a hook point of fewer values, or a custom reduction)"
    )


# Modules that return their input as it is in eval mode and a new tensor in training mode (the
# torch.nn dropouts; drop path / stochastic depth of timm, torchvision and Hugging Face models)
_DROP_NAMES = ("Dropout", "DropPath", "DropBlock", "StochasticDepth")
# attributes of a module that calls a dropout itself, functional (Hugging Face BART, Whisper:
# ``F.dropout(x, p=self.dropout, training=self.training)``)
_DROP_ATTRS = ("dropout", "drop_prob", "drop_path", "droppath")


def _dropout_class(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a dropout itself: a ``torch.nn`` dropout, or of a class named like
    one (:data:`_DROP_NAMES`), rather than a module calling a functional dropout."""
    return isinstance(module, torch.nn.modules.dropout._DropoutNd) or \
        any(word in type(module).__name__ for word in _DROP_NAMES)


def _drops_in_training(module: torch.nn.Module) -> bool:
    """Whether ``module`` drops values in training mode: a dropout (``torch.nn`` or a class
    named like one) whose probability (``p``, ``drop_prob``) is not known to be 0, or a
    module holding a dropout probability above 0 (an attribute named like ``dropout``) for
    the functional dropout it calls."""
    attrs = getattr(module, "__dict__", {})
    if _dropout_class(module):
        for attr in ("p", "drop_prob"):
            p = attrs.get(attr)
            if isinstance(p, (int, float)) and not isinstance(p, bool):
                return p != 0
        return True
    return any(isinstance(value, float) and value > 0 and any(word in key.lower() for word in _DROP_ATTRS)
               for key, value in attrs.items())


def _functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torch.func transform's wrapper (grad, vmap: no storage)."""
    functorch = getattr(torch._C, "_functorch", None)
    check = getattr(functorch, "is_functorch_wrapped_tensor", None)
    return bool(check(tensor)) if check is not None else False


def _output_state(out: Any) -> list[tuple[torch.Tensor, int, torch.Tensor | None]]:
    """The tensors of a module's output (nested tuples, lists, dicts, dataclasses) with their
    version counters, and for an inference tensor (``torch.inference_mode``: no version
    counter, ``-1``) a copy of its bytes instead (held only while that call's forward hooks
    run, in the first captured forward)."""
    from torch.utils._pytree import tree_leaves

    state = []
    for leaf in tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            try:
                state.append((leaf, leaf._version, None))
            except RuntimeError:  # an inference tensor keeps no version counter: its bytes tell
                state.append((leaf, -1, _bytes_of(leaf)))
    return state


def _bytes_of(t: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``t``'s values as bytes (uint8, flat), None when it has no plain storage."""
    try:
        return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _cuda_graph_capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a CUDA graph; False without a
    query where CUDA was never initialised in this process (no GPU, or none used yet)."""
    try:
        return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):  # (a CUDA that cannot answer: no graph capture either)
        return False


def _same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``y`` reads exactly the memory of ``x`` the same way: the same storage, offset,
    shape, strides, dtype and device, and the same conjugate and negative bits (``x.detach()``,
    or a view that is the whole of ``x``; not ``x.conj()``, which reads it as other values).
    Tensors without storage (sparse, functorch wrappers) are the same only as one object."""
    if x is y:
        return True
    try:
        return (x.dtype == y.dtype and x.device == y.device and x.shape == y.shape and x.stride() == y.stride()
                and x.is_conj() == y.is_conj() and x.is_neg() == y.is_neg()
                and x.storage_offset() == y.storage_offset()
                and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
                and x.untyped_storage().nbytes() == y.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, wrapped): not comparable
        return False


def _storage_key(x: torch.Tensor) -> int | None:
    """The address of the storage ``x`` is on (its ``StorageImpl``, what the native alias
    check ``Sink.matches_last`` compares): the same for every tensor on that storage while it
    lives. None when Python cannot reach the storage (sparse, nested, a tensor subclass
    without one)."""
    try:
        return x.untyped_storage()._cdata
    except Exception:  # (any subclass's refusal: the caller then compares with every candidate)
        return None


def _same_output(a: list, b: list) -> bool:
    """Whether two :func:`_output_state` (``a`` as the forward returned it, ``b`` after the
    forward hooks) hold the same values, unchanged in place: the same tensors, or tensors
    reading the same memory the same way (:func:`_same_tensor`, as ``out.detach()`` does) whose
    version counter (``x.detach()`` shares the counter of ``x``) says nothing wrote into it
    since: an in-place change through either is a change. Inference tensors have no counter:
    their bytes before and after the hooks are compared instead."""
    if len(a) != len(b):
        return False
    for (x, u, xb), (y, v, yb) in zip(a, b):
        if not (x is y or _same_tensor(x, y)) or u != v:
            return False
        if xb is not None or yb is not None:  # inference tensors: the values tell
            if xb is None or yb is None or not torch.equal(xb, yb):
                return False
            continue
        if x is y:
            continue
        try:
            now = x._version  # a write through y (its shared counter) moved it
        except RuntimeError:
            now = -1
        if now != u:
            return False
    return True


def _named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Clones of ``model.named_parameters()``, named as the hook points are
    (:func:`~activationscope.capture.hooks.named_modules`: no ``_orig_mod`` of a submodule's
    ``torch.compile`` wrapper); a parameter shared by several modules once, under its first name."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, module in named_modules(model):
        for name, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            out[f"{prefix}.{name}" if prefix else name] = p.detach().clone()
    return out


def _refuse_replicating(model: torch.nn.Module) -> None:
    """CaptureError for a model holding an ``nn.DataParallel`` over several devices: at each
    forward it copies its module to each device with ``Module._replicate_for_data_parallel``,
    which copies the instance ``__dict__``, so each replica would call the capture's wrapper of
    the original module, running the original's forward (its parameters, on the first device)
    on that replica's part of the batch, from one thread per device."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.DataParallel) and len(module.device_ids or ()) > 1:
            where = f"the model's {name!r}" if name else "the model"
            raise CaptureError(
                f"{where} is an nn.DataParallel over {len(module.device_ids)} devices "
                f"(device_ids={list(module.device_ids)!r}): it copies the model to each device at every forward, and "
                "those copies would run the forwards of the tracked modules of the original. Capture with "
                "DistributedDataParallel (one process per device, torchrun: each rank's rows go to one store), or "
                "with DataParallel over one device (device_ids=[0]); nothing was written"
            )


def _uncompiled(model: Any) -> Any:
    """The module a ``torch.compile(model)`` wraps (hook points are named as in it); other
    objects unchanged."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(dynamo, "OptimizedModule", None)
    if optimized is not None and isinstance(model, optimized):
        return model._orig_mod
    return model


class Tracker:
    """Captures activations of one model; made by :meth:`ActivationScope.track`.

    Use it as a context manager (attach on enter; on exit remove exactly its own wrappers,
    also when the body raises, and close the store) or call :meth:`attach` /
    :meth:`remove` yourself.

    Attributes
    ----------
    writer : activationscope.capture.writer.ActivationWriter or None
        The writer of a store capture (``store=``; an :class:`activationscope.store.StoreWriter`
        unless another writer is registered), made by :meth:`attach` (so ``None``
        before it, and always ``None`` for an in-memory capture). Read-only use:
        ``writer.n_samples_committed`` (int, sample rows already in the store: 0 for a new
        store, the committed count for ``resume=True``; equal to :attr:`resume_from` unless
        ``same_samples=True`` steps stored a sample's rows again),
        ``writer.path`` (str, where it writes). Do not call its write methods yourself: the
        tracker drives the commit protocol.
    parameters : dict of str to Tensor
        With ``capture_parameters=True``: ``{name: Tensor}`` clones of the model's
        parameters taken at :meth:`attach`; otherwise empty.
    model : torch.nn.Module
        The tracked model.
    """

    def __init__(self, scope: ActivationScope, model: torch.nn.Module,
                 modules: list[tuple[str, torch.nn.Module]], side: str, stop_after_last: bool = False,
                 patterns: dict[str, list[str] | None] | None = None) -> None:
        self.scope = scope
        self.model = model
        self._modules = modules
        self._side = side
        # the include= / exclude= patterns that selected ``modules`` (recorded in the store's
        # capture_config; a resume with others is refused), None when not made by track()
        self._patterns = patterns
        # TransformerLens HookPoints are recorded under their own names (hooks.rename_hook_point)
        self._hook_point_paths = frozenset(n for n, m in modules if is_hook_point_module(m))
        # the hook points this tracker can record (first call, first input): a pattern of
        # reductions= or token_rows= equal to one of them selects that one only
        self._hook_names = frozenset(
            r for n, _m in modules for side in ("output", "input.0")
            if (r := rename_hook_point(f"{n}.{side}" if n else side, self._hook_point_paths, self._side)))
        # The core's callbacks are bound while attached only: a pybind object is invisible to
        # the garbage collector, so a permanent Tracker -> core -> Tracker cycle would leak.
        self._core = _C.TrackerCore(None)
        self._core.policy = _POLICY_CODE[scope.capture_policy]
        self._core.sample_every = scope.sample_every
        self._core.max_k = -1 if scope.max_k is None else scope.max_k
        self._core.token_rows = scope.rows == "token"
        self._core.stop_after_last = bool(stop_after_last)
        self.stop_after_last = bool(stop_after_last)
        self._arena = _C.Arena()
        self._sinks: dict[str, Any] = {}
        self._new_hook_point_lock = threading.RLock()
        self._reduction_names: dict[str, list[str]] = {}
        self._reduction_objects: dict[str, list[Any]] = {}
        self._reduction_base: dict[str, int] = {}  # resume: committed rows the reductions started from
        # hook point -> the hook point it repeats (kept once: in a store an alias, in memory the
        # same records for the calls where it is the other's tensor)
        self._aliases: dict[str, str] = {}
        self._watching: list[str] = []  # hook points of this forward that an alias may repeat
        # the same, by the storage of their tensor (_storage_key; None: unknown), in capture order
        # (position in _watching, name), and those an alias repeats since: an alias's candidates
        # are the hook points on its tensor's storage, not every one of this forward
        self._watch_by_storage: dict[int | None, list[tuple[int, str]]] = {}
        self._watch_targets: set[str] = set()
        # The first store forward with a dropout in eval mode: the tensors its dropouts returned
        # (their input as it is), so that only an alias made through one of them is not made
        # (None: not probing this forward; the later forwards use the model-wide rule)
        self._dropout_probes: list[Any] = []
        self._dropout_outputs: list[torch.Tensor] | None = None
        self._dropout_paths: tuple[str, ...] = ()  # modules calling a functional dropout, in eval mode
        self._dropout_modules: frozenset[str] = frozenset()  # every dropout in eval mode (its output: its input)
        self._dropouts_probed = False
        # Aliases are detected when storing both would duplicate bytes: a store, or in-memory
        # copies (REFERENCE in memory keeps the model's tensor itself: nothing duplicated).
        # A store that keeps reductions only (store= with ReductionPolicy.STREAMING, FORMAT.md
        # section 11): each hook point's rows are reduced and dropped, never stored; the store
        # holds the reductions, the sample row table and the rows reduced per hook point
        self._reductions_only = scope.storage is StoragePolicy.DISK and scope.reduction_policy is ReductionPolicy.STREAMING
        self._reduced_rows: dict[str, int] = {}  # its hook points declared to the writer -> rows of recorded forwards
        self._alias_candidates = (scope.storage is StoragePolicy.DISK and not self._reductions_only) or (
            scope.capture_mode is CaptureMode.SNAPSHOT and scope.reduction_policy is not ReductionPolicy.STREAMING
        )
        self._installed: list[tuple[torch.nn.Module, Any, Any]] = []
        # the thread that attached it (a weak reference: a thread that ended is never this one) and its name
        self._thread: tuple[Any, str] = (lambda: None, "")
        self._module_ids: frozenset[int] = frozenset()
        self._tree_ids: frozenset[int] = frozenset()  # every module of the model (its forwards call them)
        self._attached = False
        self._closed = False
        self._with_depth = 0  # `with tracker:` blocks entered and not yet left
        self._pending_batch: dict[str, Any] | None = None
        self._batch: dict[str, Any] | None = None
        self._ids_batch: dict[str, Any] | None = None  # the description the last recorded forward had
        # the description the last recorded forward had (any capture), and whether a later forward
        # that kept it with newly counted samples was checked / warned about (_warn_stale_batch)
        self._last_batch: dict[str, Any] | None = None
        self._stale_checked: dict[str, Any] | None = None
        self._warned_stale_batch = False
        self._warned_step = False  # (a generation step's new sample ids: warned once)
        self._last_token_shape: tuple[int, int] | None = None  # rows='token': the last captured forward's (batch, pos)
        # the sample ids of the last forward, captured or skipped by the policy, for
        # set_batch(same_samples=True): (the ids it was given, or None and the first id of the
        # running counter, its number of samples)
        self._last_ids: tuple[Any, int, int] | None = None
        # (index, described with same_samples=True) of the root forward that started last and has
        # not recorded its samples: it is running, or it raised (then set_batch(same_samples=True)
        # has no ids to continue, unless it was itself a step of the samples before it)
        self._unrecorded_forward: tuple[int, bool] | None = None
        # True once a failed capture removed the store it made (it held no committed row)
        self._store_removed = False
        self._store_put_back: str | None = None  # overwrite=True, no row committed: the note saying the old store is kept
        self._n_samples = 0
        self._resume_from = 0  # the running counter a resumed store left (set by attach)
        # samples of the forwards a CapturePolicy skipped (SAMPLE_N): the default sample ids
        # count them, so that a stored sample's id is its place in the data the model was fed
        self._skipped_samples = 0
        # samples of captured forwards described with same_samples=True (generation steps of
        # samples already fed): the default sample ids do not count them
        self._repeated_samples = 0
        self._open_forward: int | None = None  # index of a root forward that started and has not ended
        self._batches_at_start: int | None = None  # the writer's n_batches_recorded as it started
        self._n_raised = 0  # captured forwards that raised, the exception caught inside the block
        self._stop_learnt = False  # stop_after_last: the stop point was known when this forward started
        self._warned_stop = False
        self._warned_training_stop = False  # stop_after_last in training mode: said once
        # stop_after_last in training mode: the dropout / BatchNorm modules in training mode that ran
        # in the full first captured forward (None: not watched) and in the forward being watched
        self._train_full: set[str] | None = None
        self._train_ran: set[str] = set()
        self._train_phase = ""  # "full", "cut" or "" (not watching)
        self._train_probes: list[Any] = []
        self._n_captured = 0  # root forwards captured (ended) while attached
        # resume: the hook points the store holds (a capture must give exactly these), None
        # when there is nothing to check; a refused resume leaves the store as it was found
        self._stored: frozenset[str] | None = None
        self._intermittent: frozenset[str] = frozenset()
        self._first_checked = False
        # forward hooks that replace an output: looked for in the first captured forward
        self._hook_probes_done = False
        self._hook_probes_done_compiled = False
        self._warned_outside = False
        # tracked modules ("" the model) whose forward was replaced while tracked by one that no
        # longer runs the capture (noted when the wrappers come off)
        self._replaced: list[str] = []
        # hook points whose custom reductions' accumulator dtype is still to be looked at
        # (_warn_half_accumulators)
        self._half_pending: set[str] = set()
        self._warned_nonfinite = False  # (_warn_nonfinite_reductions, at the close)
        self._hook_probes: list[Any] = []
        self._hook_replaced: list[str] = []
        # forward hooks there were when last looked for ({id(module): hook ids}, global hook
        # ids; None before the first captured forward), the tracked modules and the number of
        # forward hooks each had then, torch's hook handle counter when last looked (a hook
        # added since has a larger id), and the modules named in a warning
        self._hooks_seen: tuple[dict[int, set[int]], set[int]] | None = None
        self._hook_counts: tuple[list[torch.nn.Module], list[int]] = ([], [])
        self._hook_id_seen = -1
        self._hooks_later = False
        # the forward during which forward hooks were added to tracked modules (seen at its end,
        # :meth:`_note_hooks_added`, or at the next start for one that raised, when they may have
        # been added after it), and the one the warning of _hooks_later names (None: added
        # between forwards): (forward, whether it raised)
        self._hooks_added_in: tuple[int, bool] | None = None
        self._hook_id_at_start = -1  # torch's hook counter at the start of the forward running
        self._hooks_later_added_in: tuple[int, bool] | None = None
        self._hook_warned: set[str] = set()
        self._refused: str | None = None
        self._refused_error: type[ActivationScopeError] = CaptureError  # raised again at the close
        self._refused_attrs: dict[str, Any] = {}  # ... with these attributes (argument, pattern, hook_points)
        self._token_rows = scope.token_rows
        # exclude_hook_points= patterns, and the hook points they left out (never captured)
        self._skip_patterns = scope.exclude_hook_points
        self._skipped_hook_points: set[str] = set()
        # a mask that applies to no hook point: their first shapes, and whether token_rows= chose
        # sample rows for one (then sample rows are asked for, not a mistake)
        self._first_shapes: dict[str, tuple[int, ...] | str] = {}
        # 2-D hook points taken as token rows by their shape while the mask had no padding:
        # warned about at the first later mask that has padding (_warn_2d_token_rows)
        self._unwarned_2d_token: dict[str, tuple[int, ...]] = {}
        # hook points of shape (batch, pos, pos, ...) taken as token rows in this forward, not yet warned about
        self._head_first_found: dict[str, tuple[int, ...]] = {}
        self._sample_rows_chosen = False
        self._warned_mask = False
        # hook points first captured (rows="auto") in a forward whose set_batch gave no attention
        # mask, starting with the (batch, pos) of the one the model was given: their rows are
        # samples for good (named by _note_unmasked_first), and the forward's index
        self._first_unmasked: dict[str, int] = {}
        # the attention_mask the model itself was given in the current forward (noted by the
        # root's Python frame, _python_frame), warned about once when it has padding that
        # set_batch did not describe: with rows="token" those positions are stored as token
        # rows, with rows="auto" inside the sample rows of the hook points starting with it
        self._model_mask: torch.Tensor | None = None
        self._warned_model_mask = False
        self._mask_arg_index: int | None = None
        self._notes_padding = False
        # CUDA masks' padding counts on their way to the host: (count, event, warn), read later
        self._padding_counts: list[tuple[torch.Tensor, Any, Any]] = []
        self._first_arg_type: str | None = None
        # rows="token": the shape (and parameter name) of the model's first tensor input in the
        # current forward when it is an image (batch, channels, height, width), a video or audio
        # (_MEDIA_INPUTS), whose first two dims are not (batch, pos); warned about once when hook
        # points took them as token rows
        self._image_input: tuple[tuple[int, ...], str | None] | None = None
        self._warned_image_input = False
        # rows="token": likewise when that input is a floating-point (batch, features) matrix (an
        # MLP's), whose second dim is no pos
        self._feature_input: tuple[tuple[int, ...], str | None] | None = None
        # a model taking token ids and an image or audio input (CLIP, LLaVA): its media inputs
        # by name; hook points of its vision / audio tower taken as token rows are warned about
        order = _keyword_order(getattr(model, "forward", None))
        self._media_params = sorted(_MEDIA_INPUTS & set(order)) if "input_ids" in order else []
        self._warned_media_tower = False
        # a store capture: the module paths of mixture-of-experts experts (children of a
        # ModuleList / ModuleDict named "experts"; None until the first forward's end), whose
        # hook points are stored off the sample row table, and the hook points decided so far
        self._expert_paths: tuple[str, ...] | None = None
        self._experts_decided: set[str] = set()
        # hook points of T5's relative position bias (no batch dimension), found at their first
        # forward and warned about (and, in a store, put off the row table) at its end
        self._position_bias_found: dict[str, tuple[int, ...]] = {}
        # a model of its own with a second (target / decoder) sequence input (forward(src, tgt)):
        # that parameter's (position, name), the (batch, S) of its tensor in the current forward,
        # and whether token rows taken with a mask of as many positions were warned about
        self._target_param: tuple[int, str] | None = None
        self._target_shape: tuple[int, int] | None = None
        self._warned_target = False
        self._expert_set: frozenset[str] = frozenset()  # (the same paths, for look-ups)
        # an encoder-decoder model (its forward takes decoder_input_ids / decoder_inputs_embeds):
        # the names of its positional parameters, the masks of the current forward's two
        # sequences (noted by the root's Python frame; the decoder's None when the forward gives
        # it no input of its own), the modules of its encoder and decoder (ids, found when first
        # needed), and the side of each hook point stored as token rows (its mask is checked
        # against that side's at each forward)
        self._seq2seq: tuple[str, ...] | None = None
        # a model of torch.nn's encoder and decoder stacks (nn.Transformer, or a model of one's own
        # around nn.TransformerEncoder / nn.TransformerDecoder and their layers, whose decoder
        # layers' multihead_attn is the cross-attention): the outermost stacks of each side, and
        # the handles of the pre-hooks that note each stack call's mask (the inverse of its
        # key padding mask, else every position of its input)
        self._nn_seq2seq: tuple[list[torch.nn.Module], list[torch.nn.Module]] | None = None
        self._nn_handles: list[Any] = []
        self._seq_masks: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        self._stacks: tuple[set[int], set[int]] | None = None
        self._token_sides: dict[str, str] = {}
        # decoder hook points (batch, T, ...) stored one row per sample under the encoder's mask,
        # named once per capture at the end of the forward that first gave them
        self._side_sample_rows: dict[str, dict[str, tuple[int, ...]]] = {}
        self._warned_side_sample_rows: set[str] = set()
        # store arrays already named in a warning for leaving the row table (first captured
        # late, a forward that raised, rows missing from a forward): warned once each
        self._warned_row_table: set[str] = set()
        # hook points whose first activation (1, ...) came in a forward of more samples (or, first
        # seen in a forward of one sample, recorded one row in a later one of more: noted by
        # _warn_row_table_lost): a tensor shared by the batch (T5's position bias), named where
        # its shape changes
        self._shared_rows: dict[str, tuple[int, ...]] = {}
        self._fastpath_off = False  # this tracker holds PyTorch's MHA fast path off
        self.parameters: dict[str, torch.Tensor] = {}
        self.writer = None
        self._reference_mode = scope.capture_mode is CaptureMode.REFERENCE
        self._red_factories = None
        if scope.reductions is not None:
            from . import reductions as _red

            self._red_factories = _red
        self._in_memory = scope.storage is not StoragePolicy.DISK

    # ------------------------------------------------------------------ lifecycle
    def attach(self) -> "Tracker":
        """Install the native wrappers on every selected module (idempotent).

        Raises
        ------
        CaptureError
            The tracker was already closed (a store tracker cannot be re-attached).
        CaptureError
            A resumed store holds hook points this tracker's modules and side cannot give
            (another ``include=`` / ``exclude=`` / ``capture=`` than the first run), was
            captured with other ``include=`` / ``exclude=`` patterns than this tracker's (as
            its ``capture_config["patterns"]`` records; compared as sets), or has another
            ``storage_dtype``: the store is left as it was. Hook points that differ
            only by what a forward reaches are refused at the first resumed forward, before
            any of its rows is committed.
        CaptureError
            A tracker attached by another thread (still attached) wraps a module of this
            tracker's model, or this tracker would wrap a module of that tracker's model (the
            same model, a submodule both models share, a model and one of its submodules):
            each would capture the other thread's forwards. Nothing is written; give each
            thread its own copy of the model, or attach both trackers in one thread.
        CaptureError
            The model holds an ``nn.DataParallel`` over several devices: its replicas of the
            tracked modules would run the forwards of the originals (see
            :func:`_refuse_replicating`). Nothing is written.

        Any error raised after the store opened (a refusal above, a module that cannot be
        wrapped) closes the store without committing anything of this run (left as it was
        found); in a multi-rank capture the other ranks then raise naming this rank and the
        error, and nothing is committed.
        """
        if self._attached:
            return self
        if self._closed and self.writer is not None:
            raise CaptureError("this tracker's store is closed; make a new tracker with resume=True to add rows")
        _refuse_replicating(self.model)
        self._claim_modules()  # (before the store is opened: a refusal writes nothing)
        opening = self.scope.store is not None and self.writer is None
        try:
            return self._attach()
        except BaseException as e:
            if self._installed or self._nn_handles or self._attached:
                # failed (or interrupted: Ctrl-C) after wrappers went on: every one comes off, so
                # that the model never keeps calling a capture that is not there
                try:
                    self._detach()
                except BaseException:  # noqa: BLE001 - the first error stays the one raised
                    pass
            self._release_modules()
            if opening and self.writer is not None and not self._closed:
                # the store opened, then the setup failed (wrapping a module, a check): nothing
                # of this run is committed, the writer is closed, and the other ranks of a
                # multi-rank capture learn of the failure instead of waiting for this rank
                self._closed = True
                _discard(self.writer, e)
                self._remove_unused_store(e)  # (a new store: the rerun needs neither overwrite= nor resume=)
            raise

    def _claim_modules(self) -> None:
        """Note this tracker as attached by this thread; refuse (CaptureError) when another
        tracker attached by another thread wraps a module of this tracker's model, or this
        tracker wraps a module of the other's model.

        Every call of a tracked module, from any thread, is captured by every tracker attached
        to it: two threads that each track the same model (or two models sharing a submodule,
        or a model and one of its submodules) with a tracker of their own would record each
        other's forwards, their rows in the other thread's store under that thread's sample ids."""
        ids = {id(self.model): ""} | {id(m): n for n, m in self._modules}
        tree = {id(m): n for n, m in named_modules(self.model)}
        for i, n in ids.items():
            tree.setdefault(i, n)
        me = threading.current_thread()
        with _ATTACHED_LOCK:
            for other in list(_ATTACHED):
                if other is self or other._thread[0]() is me:
                    continue
                # a module of this model the other tracker wraps, or one this tracker wraps that
                # the other's model calls
                shared = [(n, i in other._module_ids) for i, n in tree.items()
                          if i in other._module_ids or (i in ids and i in other._tree_ids)]
                if not shared:
                    continue
                path, wrapped = shared[0]
                what = (f"module {path!r} of {type(self.model).__name__}" if path
                        else f"{type(self.model).__name__} itself")
                same = other.model is self.model
                how = "also tracked by" if wrapped else "also a module of the model of"
                raise CaptureError(
                    f"cannot attach a tracker of {type(self.model).__name__} in thread {me.name!r}: {what} is {how} "
                    f"a tracker of {'the same model' if same else type(other.model).__name__} attached in "
                    f"thread {other._thread[1]!r}. Every call of a tracked module, from any thread, is captured by "
                    "every tracker attached to it, so each thread's forwards would be recorded by both captures (the "
                    "rows of one thread in the other's store). Give each thread its own copy of the model "
                    "(copy.deepcopy(model), tracked by that thread's tracker), or attach both trackers in one thread "
                    "(nothing was written)"
                )
            self._thread = (weakref.ref(me), me.name)
            self._module_ids = frozenset(ids)
            self._tree_ids = frozenset(tree)
            _ATTACHED.add(self)

    def _release_modules(self) -> None:
        with _ATTACHED_LOCK:
            _ATTACHED.discard(self)

    def _attach(self) -> "Tracker":
        if self.scope.store is not None and self.writer is None:
            if self._reductions_only and merges_reductions(self.scope.store, self.scope.store_options):
                raise CaptureError(
                    "a multi-rank capture (torch.distributed with several ranks, or a RankStore) cannot keep reductions "
                    "only (store= with reduction_policy=ReductionPolicy.STREAMING): its rank stores are merged from "
                    "their rows, and such a store keeps none. Capture a store per rank with "
                    "store_options={'process_group': False} (each rank its own path), or store the rows (leave "
                    "reduction_policy out); nothing was written"
                )
            if self._reductions_only and self._red_factories is not None:
                eager = self._red_factories.eager_reductions(self.scope.reductions)
                if eager:  # (said before the capture, not at a resume after a kill)
                    warn_at_caller(
                        f"custom reduction(s) {eager} run as eager Python (TorchScript could not compile them), and "
                        f"the store {str(self.scope.store)!r} keeps reductions only: an eager reduction's stored state "
                        "is never continued, so a resume of this store after a kill or an error is refused. Make "
                        "them TorchScript-compatible for a store that can be resumed", CaptureWarning)
            if self._red_factories is not None and merges_reductions(self.scope.store, self.scope.store_options):
                # a multi-rank capture merges every rank's reduction states when it commits
                bad = self._red_factories.unmergeable_reductions(self.scope.reductions)
                if bad:
                    raise ReductionError(
                        f"custom reduction {bad[0]!r} has no merge rule (a plain function): a multi-rank capture "
                        "merges every rank's reduction state when it commits, so its rank stores could never be "
                        "committed. Script a torch.nn.Module with forward(acc, x) and merge(a, b) methods "
                        f"({docs_page('docs/usage/reductions.md', 'Merging custom reductions')}), or capture a "
                        "store per rank with store_options={'process_group': False}; nothing was written"
                    )
            try:
                self.writer = open_writer(
                    self.scope.store,
                    capture_config=self._capture_config(),
                    model=self.model,
                    storage_dtype=self.scope.storage_dtype,
                    **({"reductions_only": True} if self._reductions_only else {}),
                    **self.scope.store_options,
                )
                if self._reductions_only and hasattr(self.writer, "set_reduction_source"):
                    # every commit stores the states of the forwards it commits: a resume continues them
                    self.writer.set_reduction_source(self._reduction_states)
            except StoreLockedError as e:  # (held by a tracker of this process that was never closed?)
                self._note_lock_holder(e)
                raise
            except StoreExistsError as e:  # (a cell run again: say where the scope takes those options)
                if not self.scope.store_options.get("overwrite") and not self.scope.store_options.get("resume"):
                    e.add_note("ActivationScope takes them as store options: ActivationScope(store=..., "
                               "store_options={'overwrite': True}) or store_options={'resume': True}")
                raise
            # a store's rows follow its row table: tracked modules called on their own, outside
            # a forward of the tracked model, are left out (and warned about)
            self._core.roots_only = True
            # resume: default sample ids continue the stored run's counter (its samples, each
            # counted once: a generation step's rows are not new samples)
            self._n_samples = int(getattr(self.writer, "next_sample_id", self.writer.n_samples_committed))
            self._resume_from = self._n_samples
            if self.scope.capture_policy is CapturePolicy.MAX_K:
                # a resume continues the capture's first max_k forwards: those stored count
                done = int(getattr(self.writer, "n_batches_committed", 0))
                self._core.max_k = max(0, self.scope.max_k - done)
            self._check_policy(getattr(self.writer, "stored_capture_config", None))
            if (self.scope.capture_policy is CapturePolicy.SAMPLE_N and self.scope.sample_every > 1
                    and int(getattr(self.writer, "n_batches_committed", 0)) > 0):
                # the store holds the forwards it captured, not those it skipped: a resume cannot
                # tell which forward of the data comes next
                self._closed = True
                refused = CaptureError(
                    f"cannot resume {self.writer.path!r} with CapturePolicy.SAMPLE_N (sample_every="
                    f"{self.scope.sample_every}): the store records the forwards it captured, not the ones it skipped, "
                    "so a resume cannot tell which forward of the data comes next and would store other samples "
                    "than an uninterrupted run. Capture every forward of every "
                    f"{self.scope.sample_every}-th batch instead (CapturePolicy.EVERY, which resumes by samples), or "
                    "start again with overwrite=True (the store is left as it was)"
                )
                _discard(self.writer, refused)  # (the other ranks of a multi-rank capture are told why)
                raise refused
            stored = getattr(self.writer, "stored_hook_points", None)
            self._stored = frozenset(stored) if stored else None
            # stored hook points a forward may not call (their rows already do not follow the
            # row table): the first resumed forward need not give them
            self._intermittent = frozenset(getattr(self.writer, "stored_intermittent", None) or ())
            if self._stored:
                # a stored hook point no tracked module can give: refused before anything is written
                names = {n for n, _ in self._modules}
                missing = sorted(h for h in self._stored if not self._can_capture(h, names))
                if missing:
                    self._closed = True
                    self._refuse(missing, [])
            self._check_patterns(getattr(self.writer, "stored_capture_config", None))
            self._check_rows(getattr(self.writer, "stored_capture_config", None))
        if self.scope.capture_parameters:
            with torch.no_grad():
                self.parameters = _named_parameters(self.model)
        cap_in = self._side in ("input", "both")
        cap_out = self._side in ("output", "both")
        root_done = False
        try:
            for name, module in self._modules:
                is_root = module is self.model
                root_done = root_done or is_root
                self._install(module, _C.Site(self._core, name, cap_in, cap_out, is_root))
            if not root_done:
                # the root is wrapped with no capture of its own to see forward boundaries
                self._install(self.model, _C.Site(self._core, "", False, False, True))
        except BaseException:
            self._uninstall_all()
            raise
        # (the native side calls them with TorchDynamo's frame hook off: under torch.compile
        # they are the capture's bookkeeping, not the model's)
        self._core.on_new_hook_point = self._on_new_hook_point
        self._core.on_forward_start = self._on_forward_start
        self._core.on_forward_end = self._on_forward_end
        for target in set(self._aliases.values()):  # re-attached: alias targets watch again
            self._sinks[target].watch_aliases(True)
        self._core.closing = False
        self._core.active = True
        self._attached = True
        if not self._seq2seq and not self._nn_handles:
            self._nn_seq2seq = _torch_stacks(self.model)
            for side, stacks in zip(("encoder", "decoder"), self._nn_seq2seq or ()):
                for stack in stacks:
                    # (bookkeeping of the capture: a compiled model calls it outside its graph)
                    note = torch.compiler.disable(functools.partial(self._note_stack_call, side))
                    self._nn_handles.append(stack.register_forward_pre_hook(note, with_kwargs=True))
        if not self._fastpath_off and _inside_fused(self.model, self._modules):
            _fastpath_acquire()
            self._fastpath_off = True
        return self

    def _note_lock_holder(self, error: BaseException) -> None:
        """The store is locked: when the holder is an attached tracker of this process with
        the same store (attached by ``attach()`` and never removed, as by a notebook cell run
        again), say so in a note of ``error``, and how to close it."""
        def where(target: Any) -> Any:
            return os.path.realpath(target) if isinstance(target, (str, os.PathLike)) and "://" not in str(
                target) else target

        with _ATTACHED_LOCK:
            found = list(_ATTACHED)
        mine = where(self.scope.store)
        holders = [t for t in found if t is not self and t._attached and t.writer is not None
                   and where(t.scope.store) == mine]
        if holders:
            model = type(holders[0].model).__name__
            error.add_note(
                f"it is held by a tracker of {model} attached in this process and not closed (attach() without "
                "remove(): a notebook cell run again leaves the earlier tracker attached, its wrappers on the model); "
                f"close it, and commit its rows, with `for t in acs.Tracker.attached_to(model): t.remove()`")

    def _capture_config(self) -> dict[str, Any]:
        """The store's ``capture_config``: the scope's configuration with what ``track()``
        overrode (``capture``, ``include`` / ``exclude``, ``token_rows``, ``stop_after_last``),
        so it says what this capture did."""
        config = {**self.scope.config(), "capture": self._side, "stop_after_last": self.stop_after_last,
                  "token_rows": self._token_rows}
        if self._patterns is not None:
            config.update(include=self._patterns["include"], exclude=self._patterns["exclude"],
                          patterns=self._patterns)
        return config

    def _can_capture(self, hook_point: str, modules: set[str]) -> bool:
        """Whether this tracker's modules and side can give ``hook_point`` (by name)."""
        module = hook_point_module(hook_point, modules, self._hook_point_paths)
        if module not in modules:
            return False
        if module in self._hook_point_paths:  # a TransformerLens HookPoint: either side
            return True
        tail = hook_point[len(module):]
        tail = tail.split(".", 1)[1] if tail.startswith("#") and "." in tail else tail.lstrip(".")
        if tail.startswith("input"):
            return self._side in ("input", "both")
        if tail.startswith("output"):
            return self._side in ("output", "both")
        return True

    def _module_by_name(self) -> dict[str, torch.nn.Module]:
        """``{name: module}`` of the tracked modules, made once (not at each new hook point: a
        first forward of N hook points would make it N times)."""
        cached = self.__dict__.get("_modules_dict")
        if cached is None or cached[0] is not self._modules or len(cached[1]) != len(self._modules):
            cached = self._modules_dict = (self._modules, dict(self._modules))
        return cached[1]

    def _module_of(self, hook_point: str) -> str:
        """The tracked module whose hook point ``hook_point`` is."""
        return hook_point_module(hook_point, self._module_by_name().keys(), self._hook_point_paths)

    def _check_patterns(self, stored_config: Any) -> None:
        """Refuse a resume whose include= / exclude= patterns differ from those the store
        records (``capture_config["patterns"]``): another selection may give hook points no
        forward of the resume shows (it may run none). Stores without the record are not
        checked. The writer is discarded: the store is left as it was."""
        if self._patterns is None or not isinstance(stored_config, Mapping) or "patterns" not in stored_config:
            return
        stored = stored_config["patterns"]

        def key(patterns: Any) -> Any:
            if not isinstance(patterns, Mapping):
                return patterns
            return tuple(sorted(set(v)) if isinstance(v, list) and all(isinstance(x, str) for x in v) else v
                         for v in (patterns.get("include"), patterns.get("exclude")))

        if key(stored) == key(self._patterns):
            return

        def shown(patterns: Any) -> str:
            if not isinstance(patterns, Mapping):
                return repr(patterns)
            return f"include={patterns.get('include')!r}, exclude={patterns.get('exclude')!r}"

        cli = " ".join(f"--{arg} {p}" for arg in ("include", "exclude") if isinstance(stored, Mapping)
                       and isinstance(stored.get(arg), list) for p in stored[arg])
        self._closed = True
        self._refused = (
            f"cannot resume {self.writer.path!r}: it was captured with {shown(stored)}, this capture has "
            f"{shown(self._patterns)}, which may select other hook points; every array of a store must cover "
            f"every sample, so resume with the same include=/exclude= as the first run"
            f"{f' (CLI: {cli})' if cli else ''}, or write the other hook points into a new store (the store is "
            "left as it was)"
        )
        _discard(self.writer, CaptureError(self._refused))
        raise CaptureError(self._refused)

    def _check_policy(self, stored_config: Any) -> None:
        """Refuse a resume whose capture policy differs from the one the store records
        (``capture_config["capture_policy"]``, ``sample_every``, ``max_k``) once it holds a
        committed forward: the resumed forwards would be picked by another rule than the stored
        ones (every forward after a ``MAX_K`` or ``SAMPLE_N`` run), and the store's
        ``capture_config`` would record the resume's policy alone. ``SAMPLE_N`` with
        ``sample_every=1`` is ``EVERY``. Stores without the record are not checked. The writer is
        discarded: the store is left as it was."""
        if not isinstance(stored_config, Mapping) or int(getattr(self.writer, "n_batches_committed", 0)) <= 0:
            return
        name, every, k = (stored_config.get(key) for key in ("capture_policy", "sample_every", "max_k"))

        def positive(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 1

        if name == "EVERY" or (name == "SAMPLE_N" and every == 1):
            stored: tuple[Any, ...] = (CapturePolicy.EVERY,)
        elif name == "SAMPLE_N" and positive(every):
            stored = (CapturePolicy.SAMPLE_N, every)
        elif name == "MAX_K" and positive(k):
            stored = (CapturePolicy.MAX_K, k)
        else:
            return  # (no record, or one of another version: not checked)
        policy = self.scope.capture_policy
        if policy is CapturePolicy.SAMPLE_N and self.scope.sample_every == 1:
            policy = CapturePolicy.EVERY
        this = ((policy,) if policy is CapturePolicy.EVERY else
                (policy, self.scope.sample_every if policy is CapturePolicy.SAMPLE_N else self.scope.max_k))
        if this == stored:
            return

        def shown(key: tuple[Any, ...]) -> str:
            arg = {CapturePolicy.SAMPLE_N: "sample_every", CapturePolicy.MAX_K: "max_k"}.get(key[0])
            return f"capture_policy=CapturePolicy.{key[0].name}" + (f", {arg}={key[1]}" if arg else "")

        fix = (f"resume with {shown(stored)} (the resumed forwards then continue its rule)"
               if stored[0] is not CapturePolicy.SAMPLE_N else
               "a store captured with CapturePolicy.SAMPLE_N cannot be resumed: start again with overwrite=True")
        self._closed = True
        self._refused = (
            f"cannot resume {self.writer.path!r}: it was captured with {shown(stored)}, this capture has "
            f"{shown(this)}, which would pick the resumed forwards by another rule than the stored ones (and "
            f"record only this capture's policy); {fix}, or capture into a new store (the store is left as it was)"
        )
        _discard(self.writer, CaptureError(self._refused))
        raise CaptureError(self._refused)

    def _check_rows(self, stored_config: Any) -> None:
        """Refuse a resume whose ``rows=`` differs from the one the store records
        (``capture_config["rows"]``): the setting decides what a stored row is (one per token
        of the model's first input, with a token row table, or one per sample), and a resume
        with nothing left to capture runs no forward that would show the other row kind. Stores
        without the record are not checked. The writer is discarded: the store is left as it
        was."""
        if not isinstance(stored_config, Mapping):
            return
        stored = stored_config.get("rows")
        if stored not in _ROWS or stored == self.scope.rows:
            return
        rows = {"auto": "one 'sample' row per sample, or per real token of an attention mask given to set_batch",
                "token": "one 'token' row per token of the model's first input (batch, pos), with a token row table"}
        self._closed = True
        self._refused = (
            f"cannot resume {self.writer.path!r}: it was captured with rows={stored!r} ({rows[stored]}), this capture "
            f"has rows={self.scope.rows!r} ({rows[self.scope.rows]}); every array and row table of a store must hold "
            f"its rows one way, so resume with rows={stored!r} (CLI: --rows {stored}), or capture into a new store "
            "(the store is left as it was)"
        )
        _discard(self.writer, CaptureError(self._refused))
        raise CaptureError(self._refused)

    def _refuse(self, missing: list[str], extra: list[str]) -> None:
        """Refuse a resumed capture whose hook points differ from the store's: nothing of it
        is committed and the store is left as it was found (at the tracker's close)."""
        stored = sorted(self._stored or ())
        parts = []
        if missing:
            parts.append(f"it holds {_names(missing)} which this capture does not give")
        if extra:
            parts.append(f"this capture gives {_names(extra)} which it does not hold")
        what = ("reduction of a store that keeps reductions only" if getattr(self.writer, "reductions_only", False)
                else "array of a store")
        self._refused = (
            f"cannot resume {self.writer.path!r} with other hook points than it holds ({'; '.join(parts)}); every "
            f"{what} must cover every sample, so a resumed capture gives exactly the stored hook points "
            f"({_names(stored)}): resume with the same include=/exclude=/capture= as the first run, or write the "
            "other hook points into a new store (the store is left as it was)"
        )
        # the names of one run are those of the other with a wrapper's attributes: a stored hook
        # point of a tracked module once those are left out (not a module of the model merely
        # named 'module', whose names are as in the store)
        bare = {without_wrappers(n): n for n, _ in self._modules if n}
        theirs = [x for x in missing if without_wrappers(x) != x
                  and any(without_wrappers(x).startswith(b + ".") and bare[b] == b for b in bare)]
        mine = [n for b, n in bare.items() if b != n and any(x.startswith(b + ".") for x in missing)]
        if bool(theirs) != bool(mine):  # one run tracked a wrapper (DataParallel: module.fc1), the other not
            self._refused += (
                f". The {'store' if theirs else 'capture'}'s names hold a wrapper's attribute "
                f"({(theirs or mine)[0]!r}: the 'module.' of DataParallel / DistributedDataParallel, "
                f"'_fsdp_wrapped_module.' of FSDP) and the {'capture' if theirs else 'store'}'s do not: track the model "
                "as the first run did, the wrapper or the model it wraps (the wrapper's .module)"
            )
        if self._closed:  # refused at attach: nothing to undo
            _discard(self.writer, CaptureError(self._refused))
        raise CaptureError(self._refused)

    def _install(self, module: torch.nn.Module, site: Any) -> None:
        current = module.__dict__.get("forward")
        if isinstance(current, _C.ForwardWrapper):
            self._installed.append((module, current, site))  # (noted first: see below)
            current.add_site(site)
            wrapper = current
        else:
            forward = module.forward
            original = forward
            # rows="auto" too, for a store or reductions: a model taking an attention_mask that
            # set_batch does not describe keeps its padding inside sample rows (warned about)
            note_mask = module is self.model and (self.scope.rows == "token" or (
                (self.scope.store is not None or self.scope.reductions is not None)
                and _takes_parameter(forward, "attention_mask")))
            if module is self.model:
                self._seq2seq = _seq2seq_parameters(forward)
                self._target_param = None if self._seq2seq else _target_parameter(forward)
            note = self._note_root_call if note_mask or (module is self.model and (
                self._seq2seq or self._target_param is not None)) else None
            if module is self.model and (_in_torch(forward) or note is not None):
                # a model compiled after tracking: TorchDynamo starts at the first Python frame
                # under the native root wrapper and skips torch.nn's own (nn.Sequential.forward),
                # so it would compile nothing; one Python frame of ours per forward gives it one.
                # With rows="token" that frame also notes the attention_mask the model is given,
                # and for an encoder-decoder model the masks of its two sequences
                self._mask_arg_index = _mask_arg_index(forward) if note_mask else None
                self._notes_padding = note_mask
                original = _python_frame(forward, note)
            wrapper = _C.ForwardWrapper(original)
            wrapper.__wrapped__ = forward  # inspect.signature() sees the real forward; traced_call calls it
            code = getattr(forward, "__code__", None)
            if isinstance(module, torch.fx.GraphModule) and isinstance(code, types.CodeType):
                # TorchDynamo, tracing the generated forward of a GraphModule (torch.export's, one
                # of torch.fx.symbolic_trace), reads module.forward.__code__ to map its lines
                wrapper.__code__ = code
            wrapper._acs_kw_order = _keyword_order(forward)  # (where a root forward's batch is looked for)
            wrapper.set_kw_order(list(wrapper._acs_kw_order))
            wrapper._acs_prior = current  # an instance-level forward set by someone else
            wrapper._acs_key = str(wrapper.key)  # names the wrapper in the in-graph ops
            # noted before the module's forward is replaced: an exception arriving anywhere after
            # (Ctrl-C in a notebook) is undone by _uninstall_all, never a wrapper left on the model
            self._installed.append((module, wrapper, site))
            wrapper.add_site(site)
            object.__setattr__(module, "forward", wrapper)
        wrapper._acs_plan = wrapper.plan()  # what the traced __call__ emits (compiled.traced_call)

    def _uninstall_all(self) -> None:
        self._unprobe_dropouts()  # (a forward that raised left them)
        while self._installed:
            # each entry is undone before it leaves the list (every step may be done again): an
            # exception in between (Ctrl-C) leaves it to the next call, never a wrapper unlisted
            module, wrapper, site = self._installed[-1]
            wrapper.remove_site(site)  # (False when it was not added yet)
            wrapper._acs_plan = wrapper.plan()
            if wrapper.n_sites == 0 and module.__dict__.get("forward") is wrapper:
                prior = getattr(wrapper, "_acs_prior", None)
                if prior is None:
                    object.__delattr__(module, "forward")
                else:
                    object.__setattr__(module, "forward", prior)
            elif wrapper.n_sites == 0:
                # a forward set on the module while tracked (accelerate's hooks) that calls the
                # wrapper as the forward it replaced: it gets the forward the wrapper replaced
                for attr in _KEPT_FORWARD_ATTRS:
                    if module.__dict__.get(attr) is wrapper:
                        object.__setattr__(module, attr, wrapper.__wrapped__)
            self._installed.pop()

    def remove(self) -> None:
        """Remove exactly this tracker's wrappers and close its store (if any).

        Records stay readable. After ``remove()`` a store tracker's store is complete.
        Calls of the tracked modules still running in other threads are waited for first (a
        root forward under way ends whole); calls that start meanwhile are not captured.

        Raises
        ------
        CaptureError
            Such calls still ran after 30 s: the wrappers are removed anyway, and those calls
            fail with CaptureError when they go on (their capture cannot be completed).
        CaptureError
            Called inside a forward of the tracked model on this thread (from a forward hook or
            a module): nothing is changed, the tracker stays attached.
        """
        try:
            self._refuse_close_inside_forward()
            left = self._detach()
            self._finish(status="complete", left_running=left)
        except BaseException as e:
            if not (self._attached and self._core.open_here):  # (refused inside a forward: stays attached)
                self._close_after_error(e)
            raise
        self._warn_nonfinite_reductions()  # (once the store is closed: an error filter costs no commit)
        self._raise_left_running(left)

    def _close_after_error(self, error: BaseException) -> None:
        """The close raised ``error``, or was interrupted by it (a second Ctrl-C in a notebook while
        the first one's close ran): every wrapper comes off and the store is left at its last
        commit (status ``incomplete``, its lock released; a new store without a committed row
        removed), so that neither the model nor the store stays held by a capture that no one
        can close. Nothing more is done where the close had done it. Never raises."""
        try:
            if self._attached or self._installed or self._nn_handles:
                self._detach()
        except BaseException:  # noqa: BLE001 - the error stays the one raised
            pass
        if self.writer is None:
            return
        self._closed = True
        try:
            self.writer.abort(error)  # (nothing where the writer is closed already)
            if not self._store_removed:
                self._remove_unused_store(error)
        except BaseException:  # noqa: BLE001
            pass

    def _refuse_close_inside_forward(self) -> None:
        """Refuse (CaptureError) to close this tracker inside a forward of its own model on this
        thread (a forward hook or a module calling remove()): the forward could not be completed,
        and its partial capture would be taken for a forward that raised."""
        if self._attached and self._core.open_here:
            raise CaptureError(
                f"the tracker of {type(self.model).__name__} cannot be closed (remove(), or its `with` block left) "
                f"inside a forward of its own model: forward {int(self._core.n_forwards) - 1} is still running on "
                "this thread (a forward hook or a module closed it), and its capture could not be completed. The "
                "tracker stays attached; close it after the forward returns"
            )

    def _wait_other_threads(self) -> int:
        """Wait (up to ``_CLOSE_WAIT_S``) until no call of a tracked module runs in another
        thread; calls that start meanwhile are not captured (``closing``). The calls still
        running then."""
        self._core.closing = True
        deadline = None
        while self._core.calls_elsewhere:
            now = time.monotonic()
            deadline = now + _CLOSE_WAIT_S if deadline is None else deadline
            if now >= deadline:
                break
            time.sleep(0.001)  # (releases the GIL: those calls go on)
        return int(self._core.calls_elsewhere)

    def _raise_left_running(self, left: int) -> None:
        if left:
            raise CaptureError(
                f"{left} call(s) of tracked modules of {type(self.model).__name__} still ran in other threads "
                f"{_CLOSE_WAIT_S:g} s after the tracker began to close (its `with` block ended, or remove()): its "
                "wrappers were removed, and those calls fail with CaptureError, their capture incomplete (a store "
                "ends at the last whole forward before them). Join "
                "the threads that call the tracked model before the `with` block ends"
            )

    def _detach(self) -> int:
        left = self._wait_other_threads()
        self._warn_head_first_found()  # (a forward that raised: its hook points were captured)
        self._core.active = False
        self._remove_hook_probes()
        self._remove_train_probes()
        self._train_phase = ""
        if self._installed:
            self._replaced = self._replaced_forwards()
        self._uninstall_all()
        while self._nn_handles:
            self._nn_handles[-1].remove()  # (removed before it leaves the list: see _uninstall_all)
            self._nn_handles.pop()
        self._core.release_callbacks()
        self._attached = False
        # Alias targets remember their last tensor (weakly) to compare the next call's; a
        # detached tracker forgets it. attach() watches again.
        for sink in self._sinks.values():
            sink.watch_aliases(False)
        self._watching = []
        self._watch_by_storage, self._watch_targets = {}, set()
        if self._fastpath_off:
            self._fastpath_off = False
            _fastpath_release()
        self._release_modules()
        return left

    def _replaced_forwards(self) -> list[str]:
        """Names of the tracked modules (``""``: the model itself) whose forward was replaced,
        while tracked, by one that no longer runs the capture (:func:`_runs_wrapper`): their
        calls since were not recorded."""
        names = {id(self.model): "", **{id(m): n for n, m in self._modules}}
        replaced = {names.get(id(module), type(module).__name__) for module, wrapper, _ in self._installed
                    if not _runs_wrapper(module, wrapper)}
        return sorted(replaced)

    def _forward_replaced(self, module_name: str) -> bool:
        """Whether the tracked module ``module_name`` (``""``: the model) had its forward replaced
        while tracked (:meth:`_replaced_forwards`), looked at now while attached."""
        if not self._installed:
            return module_name in self._replaced
        module = self.model if not module_name else self._module_by_name().get(module_name)
        return any(m is module and not _runs_wrapper(m, w) for m, w, _ in self._installed)

    def _warn_outside_calls(self) -> None:
        """Warn once when tracked modules were called on their own (outside a forward of the
        tracked model) during a store capture: those calls are not recorded."""
        n = int(self._core.outside_calls)
        if n and not self._warned_outside:
            self._warned_outside = True
            warn_at_caller(
                f"tracked modules of {type(self.model).__name__} were called on their own, outside a forward of the "
                f"tracked model ({n} call(s) so far): a store records forwards of the tracked model only (row i of "
                "each array is row i of its row table, one entry per sample of a forward), so those calls were not "
                "recorded. "
                + (f"{type(self.model).__name__}'s own forward was replaced while it was tracked (an assignment to "
                   "model.forward, as accelerate's remove_hook_from_module makes), so its forwards since are not "
                   "captured: prepare the model before attaching the tracker" if self._forward_replaced("") else
                   "Call the tracked model, or track the module you call (scope.track(that module))"),
                CaptureWarning,
            )

    def _finish(self, status: str, exc: BaseException | None = None, left_running: int = 0) -> None:
        """Close the capture (its store, with ``status``). ``exc``: the exception leaving the
        block; ``left_running``: calls in other threads still running (a forward of theirs is
        cut short by the close, not by an error: the CaptureError about them says so)."""
        if self._closed:
            if self.writer is not None:  # (a close of the store cut short by Ctrl-Cs: its writer finishes it)
                self.writer.abort(exc)  # (nothing where the writer is closed already)
            return
        self._closed = True
        self._wait_reductions()
        if self._padding_counts:  # (a device mask's padding of the last forwards: warned now)
            if exc is None:
                self._read_padding_counts(wait=True)
            self._padding_counts.clear()
        if self.writer is not None:
            self._warn_outside_calls()
        if self._refused is not None:  # nothing of this run is committed
            if self.writer is not None:
                _discard(self.writer, self._refused_error(self._refused))
            if exc is None:  # the refusal was caught inside the block: say it again
                raise self._refusal()
            return
        cut = self._open_forward
        if exc is None and self._open_forward is not None:  # the last forward raised, caught
            self._forward_raised(at_exit=True, warn=not left_running)
        silent = self._silent_modules() if exc is None else []
        if self.writer is not None:
            if cut is not None:  # (the store ends at the forward before it: so do the reductions)
                self._rollback_open_forward(cut)
            self._drop_unrecorded()
            if exc is None:
                if self._stored and self._n_captured == 0:  # no forward: patterns meet the stored hook points
                    self._check_reduction_patterns(sorted(self._stored), "the store holds")
                if self._stored and self._red_factories is not None:
                    self._reduce_stored_only()
                try:
                    self._write_reductions()
                except BaseException as e:
                    # the rows are intact: commit them ("incomplete": a resume computes the
                    # reductions again over them), and never leave the writer holding its lock
                    try:
                        self._close_writer("incomplete")
                    except BaseException:  # noqa: BLE001
                        self.writer.abort(e)
                    self._settle_unused_store(e)
                    raise
                if silent and not self._sinks:
                    # nothing was recorded: never report such a store as a success
                    self._close_writer("incomplete")
                    raise CaptureError(
                        f"the capture into {self.writer.path!r} recorded no hook point in {self._n_captured} forward(s) "
                        f"(store left 'incomplete'): {_silent_message(silent, self.model)}"
                    )
                if not self._sinks and self._n_captured == 0 and not int(self.writer.n_samples_committed) \
                        and not self._n_raised and getattr(self.writer, "may_be_empty", False):
                    # one rank of a multi-rank capture whose share of the data was empty: it
                    # adds no row (the commit takes the hook points from the other ranks)
                    warn_at_caller(
                        f"the capture into {self.writer.path!r} captured no forward of {type(self.model).__name__} "
                        "(this rank's data yielded no batch): its rank store holds no row; the other ranks' rows are "
                        "committed without it",
                        CaptureWarning,
                    )
                    self._close_writer(status)
                    return
                if not self._sinks and self._n_captured == 0 and not int(self.writer.n_samples_committed):
                    # no forward was captured at all (an empty data loader, max_k=0, the model
                    # never called): a new store holding nothing is not a success either
                    self._close_writer("incomplete")
                    removed = self._remove_unused_store(None)
                    if removed:
                        fate = "so the store holds no hook point (removed: it was new)"
                    elif getattr(self.writer, "put_back", False):
                        fate = "so the store that overwrite=True was to replace is kept as it was"
                    else:
                        fate = "so the store holds no hook point (left incomplete)"
                    if self._n_raised:  # called, but no forward ended: none was recorded
                        raise CaptureError(
                            f"the capture into {self.writer.path!r} captured no whole forward of "
                            f"{type(self.model).__name__}: the {self._n_raised} forward(s) it captured raised "
                            f"before their end (the exception was caught inside the `with` block), {fate}; fix "
                            "the error the model raised (or let it leave the block to see it)"
                        )
                    outside = int(self._core.outside_calls)
                    if outside and not self._forward_replaced(""):
                        # (the modules ran, the model's forward did not: a method of a wrapper calling
                        # the model it wraps, as PeftModel.generate() calls the wrapped model's generate())
                        raise CaptureError(
                            f"the capture into {self.writer.path!r} captured no forward of "
                            f"{type(self.model).__name__}, {fate}: its tracked modules were called {outside} "
                            f"time(s), all outside a forward of {type(self.model).__name__}, by a method that calls "
                            "them without its forward (PEFT's PeftModel.generate() calls the wrapped model's "
                            "generate()). Track the model whose forward that method calls "
                            "(peft_model.get_base_model()), or call the tracked model itself"
                        )
                    raise CaptureError(
                        f"the capture into {self.writer.path!r} captured no forward of "
                        f"{type(self.model).__name__}, {fate}; "
                        "call the model inside the `with scope.track(model)` block (check that the data "
                        "yielded batches and that capture_policy / max_k let a forward through)"
                    )
                try:
                    self._close_writer(status)
                except BaseException as e:
                    self._settle_unused_store(e)  # (a first commit that failed: no row to resume)
                    raise
                self._warn_silent(silent)
                return
            # The body raised: commit every whole forward captured so far (partial chunks
            # and shards flushed), status "incomplete", so `resume=True` continues from there.
            # Never raise over the caller's exception.
            try:
                stopped_by = getattr(self.writer, "stopped_by", None)
                if callable(stopped_by):  # (a multi-rank writer tells the other ranks what stopped it)
                    stopped_by(exc)
                self._close_writer("incomplete", raise_finished=False)
            except BaseException as e:  # noqa: BLE001
                if not (str(exc) and str(exc) in str(e)):  # (the close met the same failure: the error says it)
                    warn_at_caller(
                        f"the store could not be fully committed after {exc!r}: {e}; committed rows stay readable",
                        RuntimeWarning,
                    )
                self.writer.abort(exc)
            self._note_lost_store(exc)
            self._settle_unused_store(exc)
            return
        self._warn_silent(silent)

    def _close_writer(self, status: str, raise_finished: bool = True) -> None:
        """Close the store with ``status``. A Ctrl-C that cuts that close short before its commit
        (the rows flushed to their shards, the writer still holding its lock: the writer's
        ``close_pending``) does not give those rows up: the close is finished once more, as
        ``StoreWriter.close`` called again finishes it (every forward handed to the writer
        committed, with the status the close began with), and the KeyboardInterrupt goes on
        (``raise_finished=False``: not once that second try finished the close, for a close
        after the body raised, whose exception goes on). A Ctrl-C during that second try leaves
        the close to the abort that follows (the store at its last commit), as before; an error
        of that try (a full disk) is raised, as a close that fails raises it (the Ctrl-C its
        context), never left unsaid behind the KeyboardInterrupt."""
        try:
            self.writer.close(status=status)
        except KeyboardInterrupt:
            if not getattr(self.writer, "close_pending", False):
                raise
            try:
                self.writer.close(status=status)
            except KeyboardInterrupt:  # the first Ctrl-C stays the one raised
                raise_finished = True
            if raise_finished:
                raise

    def _note_lost_store(self, exc: BaseException) -> None:
        """After a failed capture: when the store's folder was moved, removed or replaced while
        it was written (the writer thread's error then names a file it could not create, and
        says the committed rows stay readable, resume=True continuing them), say so in a note
        of ``exc``: the committed rows are wherever the folder went."""
        lost = getattr(self.writer, "_store_lost", None)
        why = lost() if callable(lost) else None
        if why is None or "moved, removed or replaced" in str(exc):
            return
        exc.add_note(
            f"the store {self.writer.path!r} was moved, removed or replaced while this capture wrote it ({why}): "
            "the rows it committed are in the store's folder wherever it went (moved: resume=True there continues "
            "them; removed: they are gone), and nothing more was written at that path")

    def _settle_unused_store(self, exc: BaseException) -> None:
        """After a failed capture whose writer is closed or aborted: the store it made removed
        when it holds no committed row (:meth:`_remove_unused_store`), else the note that the
        store ``overwrite=True`` was to replace was put back (:meth:`_note_put_back`)."""
        if not self._remove_unused_store(exc):
            self._note_put_back(exc)

    def _note_put_back(self, exc: BaseException) -> None:
        """After a failed capture with ``overwrite=True`` that committed no row: the store it was
        to replace was put back (the writer's ``put_back``). The error (a full disk's, say) may
        say that committed rows stay readable and that resume=True continues them; say in a note
        of ``exc`` that no row of this capture is there, so that neither reading nor resuming
        the old store is taken for this capture's."""
        if not getattr(self.writer, "put_back", False):
            return
        self._store_put_back = (
            f"no row of this capture was committed, so the store that overwrite=True was to replace at "
            f"{self.writer.path!r} is kept as it was: open_store reads that earlier store, none of this capture's "
            "rows, and resume=True would continue that store, not this capture; once the cause is fixed, run the "
            "capture again with overwrite=True")
        exc.add_note(self._store_put_back)

    def _wait_reductions(self) -> None:
        """Closing: this thread's current CUDA stream waits for the kernels of every hook point's
        reductions (a model run under ``torch.cuda.stream(s)`` reduced on ``s``), so that what
        the close reads of them (results, states, NaN flags) is their final value, not
        accumulators still being written. No-op for CPU rows; the host does not wait."""
        with self._new_hook_point_lock:
            sinks = list(self._sinks.values())
        for sink in sinks:
            sink.wait_reductions()

    def _rollback_open_forward(self, k: int) -> None:
        """Closing a store capture whose last forward ``k`` (0-based) did not end (it raised,
        the exception caught inside the block or leaving it): the store ends at the whole forward
        before it, so every hook point's reductions are put back as they were before that forward
        (and the rows they count), to cover exactly the rows the store commits."""
        recorded = getattr(self.writer, "n_batches_recorded", None)
        if recorded is not None and self._batches_at_start is not None and int(recorded) > self._batches_at_start:
            return  # (the writer recorded it after all: a Ctrl-C landed as its add_batch returned)
        with self._new_hook_point_lock:
            sinks = list(self._sinks.values())
        for sink in sinks:
            sink.rollback_forward(k + 1)  # (the native side counts root forwards from 1)

    def _drop_unrecorded(self) -> None:
        """Closing a store capture: hook points first seen in a forward that was never recorded
        (refused partway, e.g. by a dtype or feature-shape change, or raised by the model) have
        no committed row; the store does not list them (its writer drops their arrays), nor
        does the tracker (``hook_points``, ``reductions``)."""
        names = getattr(self.writer, "unrecorded_hook_points", None)
        for name in names or ():
            self._sinks.pop(name, None)
            self._reduction_names.pop(name, None)
            self._reduction_objects.pop(name, None)
            self._aliases.pop(name, None)
            self._first_shapes.pop(name, None)

    def _remove_unused_store(self, exc: BaseException | None) -> bool:
        """After a failed capture: remove the store when this capture made it and it holds no
        committed row (``remove_if_unused`` of the writer, when it has one), saying so in a
        note of ``exc`` and in ``_store_removed``; True when removed."""
        remove = getattr(self.writer, "remove_if_unused", None)
        if remove is None or not remove():
            return False
        self._store_removed = True
        if exc is not None:
            exc.add_note(f"no row was committed, so the new store {self.writer.path!r} was removed (resume=True has "
                         "nothing to continue: once the cause is fixed, run the capture again without it)")
        return True

    def _silent_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """Tracked modules that recorded nothing although forwards were captured."""
        if self._n_captured == 0:
            return []
        names = {n for n, _ in self._modules}
        recorded = {hook_point_module(h, names, self._hook_point_paths)
                    for h in [*self._sinks, *self._skipped_hook_points]}  # (left out on purpose: not silent)
        silent = [(n, m) for n, m in self._modules if n not in recorded]
        if recorded:  # containers without a forward (ModuleList, ModuleDict) are never called
            silent = [(n, m) for n, m in silent if not _no_forward(m)]
        return silent

    def _replaced_with_loss(self) -> list[str]:
        """The modules of :meth:`_replaced_forwards` whose calls may have gone unrecorded: a
        hook point of theirs was recorded in fewer captured forwards than the model ran (or
        they have none). A forward replaced by one that still calls the capture's (a closure
        around it) or replaced after the last forward lost nothing: not named."""
        if not self._replaced:
            return []
        sinks = dict(self._sinks)
        calls: dict[str, list[int]] = {}
        for h, sink in sinks.items():
            calls.setdefault(self._module_of(h), []).append(int(sink.n_calls))
        return [n for n in self._replaced
                if not n or not calls.get(n) or min(calls[n]) < self._n_captured]

    def _warn_silent(self, silent: list[tuple[str, torch.nn.Module]]) -> None:
        replaced = self._replaced_with_loss()
        if replaced and self._n_captured:
            hook_points = sorted(h for h in self._sinks if self._module_of(h) in replaced)
            warn_at_caller(
                f"the forward of tracked module(s) {_replaced_message(replaced, self.model)} was replaced while "
                "it was tracked, by one that no longer runs the capture (an assignment to module.forward, as "
                "accelerate's add_hook_to_module / remove_hook_from_module make): their calls since were not "
                f"recorded, so the records of hook points {_names(hook_points)} end there. Prepare the model "
                "(dispatch_model, cpu_offload, hooks that set forward) before attaching the tracker, or attach a "
                "tracker again after",
                CaptureWarning,
            )
        unused = [p for p in self._skip_patterns or () if self._n_captured
                  and not any(pattern_selects(p, h, self._hook_names) for h in self._skipped_hook_points)]
        if unused:
            warn_at_caller(
                f"exclude_hook_points pattern(s) {unused} left out no hook point of the {self._n_captured} captured "
                f"forward(s), so they excluded nothing; the hook points captured: {sorted(self._sinks)[:8]}"
                + (", ..." if len(self._sinks) > 8 else "")
                + wrapper_hint(self.model, unused[0], sorted(self._sinks), "exclude_hook_points", "hook points"),
                CaptureWarning,
            )
        if silent:
            outside = ""
            n = int(self._core.outside_calls) if self.writer is not None else 0
            if n:
                # (a module called only on its own was called: "never called" is not the whole story)
                outside = (
                    f" Tracked modules were also called on their own, outside a forward of the tracked model ({n} "
                    "call(s)), which a store does not record: those named may be among them, as the encoder of an "
                    "encoder-decoder model that generate() calls before the decoder's forwards. Track such a module "
                    "in a tracker of its own, with a store of its own (scope.track(model.get_encoder())): its calls "
                    "are that tracker's forwards"
                )
            warn_at_caller(
                f"{len(silent)} tracked module(s) of {type(self.model).__name__} recorded nothing in "
                f"{self._n_captured} captured forward(s): {_silent_message(silent, self.model)}{outside}",
                CaptureWarning,
            )

    def __enter__(self) -> "Tracker":
        """Attach (see :meth:`attach`) and return the tracker. A ``with`` block of a tracker
        already in one (a helper given the tracker enters it again) nests: only the outermost
        block's end removes the wrappers."""
        if self._attached and self._with_depth > 0:
            self._with_depth += 1
            return self
        try:
            self.attach()
            self._with_depth = 1
            return self
        except BaseException as e:
            if self._attached:  # interrupted (Ctrl-C) once attached, before the block began: no __exit__ follows
                self.__exit__(type(e), e, e.__traceback__)
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        """Remove this tracker's wrappers and close its store: status ``complete``, or
        ``incomplete`` when the body raised (the exception propagates). The end of a nested
        ``with`` block of the same tracker does nothing. Calls of the tracked modules still
        running in other threads are waited for first, as :meth:`remove` does.

        Raises
        ------
        CaptureError
            As :meth:`remove`: left inside a forward of the tracked model on this thread
            (nothing is changed, the tracker stays attached), or calls in other threads still
            ran after 30 s."""
        if self._with_depth > 1:
            self._with_depth -= 1
            return
        try:
            self._refuse_close_inside_forward()
            self._with_depth = 0
            if exc is not None and self._shared_rows:
                self._note_shared_rows(exc)
            if exc is not None:
                self._note_broadcast_token_rows(exc)
            if exc is not None and self._first_unmasked:
                self._note_unmasked_first(exc)
            left = self._detach()
            self._finish(status="complete" if exc is None else "incomplete", exc=exc, left_running=left)
        except BaseException as e:
            if not (self._attached and self._core.open_here):  # (refused inside a forward: stays attached)
                self._close_after_error(e)
            raise
        if self._reference_mode:
            self._warn_changed(all_records=True)
        self._warn_nonfinite_reductions()  # (once the store is closed: an error filter costs no commit)
        if exc is None:
            self._raise_left_running(left)

    def clear(self) -> None:
        """Drop every in-memory record (reductions are kept)."""
        with self._new_hook_point_lock:  # (another thread capturing may add a hook point meanwhile)
            sinks = list(self._sinks.values())
        for sink in sinks:
            sink.clear_records()
        self._arena.reset()

    # ------------------------------------------------------------------ batch context
    def set_batch(
        self,
        attention_mask: torch.Tensor | None = None,
        sample_ids: Sequence[int] | torch.Tensor | None = None,
        *,
        same_samples: bool = False,
        **columns: Any,
    ) -> None:
        """Describe the next forward's batch (sticky until changed).

        Call it before each batch of data: a later forward that keeps the description without
        ``sample_ids=`` or ``same_samples=True`` is new samples, and a padding mask or columns
        kept for them warn once (``CaptureWarning``) where rows matter (a store, reductions).

        Parameters
        ----------
        attention_mask : Tensor or numpy array, (batch, pos), bool or 0/1 integers, any device, optional
            Real tokens (True or 1). A float mask is refused (``ArgumentTypeError``) with the
            conversion that keeps its tokens: ``mask.bool()`` of 0 / 1 values, ``mask == 0`` of
            an additive mask (0 at tokens, -inf or a large negative value at padding).
            Hook points whose activation starts with ``(batch, pos)`` then
            store one row per real token (padding never enters the store or the
            reductions); other hook points store one row per sample.
            A mask that fits no tracked hook point (the model prepends a token, so
            activations are ``(batch, pos + 1, ...)``) gives a
            :class:`~activationscope.errors.CaptureWarning` once per capture, naming the
            shapes; ``token_rows=False`` says that sample rows are meant.
        sample_ids : sequence of int or Tensor (batch,), optional
            Ids of the samples (default: a running counter over captured samples).
        same_samples : bool, default False
            The next forward continues the samples of the last forward (a generation step with
            a key-value cache, described with its own ``attention_mask``), captured or skipped
            by the capture policy: it takes that forward's sample ids (given or counted), which
            are not warned about as repeats, and the running counter does not count its samples
            again (a resume continues the counter, not the store's sample rows). A forward
            that recorded its samples is continued (also one in which no hook
            point gave a row, or that ``stop_after_last`` cut short); one that raised before it
            recorded them leaves nothing to continue, unless it was itself described with
            ``same_samples=True``. Columns are not carried over: give them again.
        **columns
            Per-sample user columns for the row table (labels, text, ...), each of length
            ``batch``; token columns (e.g. ``token_ids``) of shape (batch, pos) are taken
            at the real tokens. A column keeps its kind (per token or per sample) for the
            whole store.

        Raises
        ------
        ValueError
            ``same_samples=True`` with ``sample_ids``, before any captured forward, or after a
            forward that raised before recording the new samples it described; a mask
            that is not 2-D or holds values other than 0 and 1, columns whose
            length is not the batch size, or (with a store) a column named like one the
            row table fills itself (``sample_id``, ``pos``, ``batch``); at the forward (the model call raises it): sample
            ids, columns or mask rows that describe another number of samples than the
            forward's batch (the first dimension of its first input), nor its second (taken as
            the batch of a sequence-first input); with a store, a column whose kind differs from
            its kind in earlier batches (a (batch, pos) token column at a forward of another
            pos, a generation step; a (batch, k) per-sample tensor where the mask is (batch, k)).
        TypeError
            ``same_samples`` that is not a bool; a float (or complex) attention mask, or one that is
            neither a tensor nor a numpy array (a list: pass ``torch.as_tensor(mask)``); with a store,
            a column whose type differs
            from its type in earlier batches (``int64`` labels, then ``float``: a row-table
            column has one type), or a column that is not a sequence.
        CaptureError
            A store capture's tracker that is closed (its ``with`` block ended): no forward it
            would describe is captured.
        """
        if self._closed and self.writer is not None and not self._attached:
            # (a loop after the with block: its forwards would run without a hook, stored nowhere)
            raise CaptureError(
                f"set_batch on a closed tracker: its store {self.writer.path!r} is closed (its `with` block ended, "
                "or remove() was called), so the forwards it would describe are not captured; call set_batch and "
                "the model inside the `with scope.track(model)` block, or make a new tracker with "
                "store_options={'resume': True} to add rows")
        same_samples = parse_flag(same_samples, "same_samples")  # (same_samples="False" is a true string)
        if same_samples:
            if sample_ids is not None:
                raise ArgumentValueError(
                    "set_batch(same_samples=True) takes the sample ids of the last forward, got "
                    "sample_ids= as well; pass one or the other")
            failed = self._unrecorded_forward
            if failed is not None and not failed[1]:
                raise ArgumentValueError(
                    f"set_batch(same_samples=True) continues the samples of the last forward, and that forward "
                    f"(forward {failed[0]} of the tracked model) raised before its samples were recorded (a "
                    "store's row table has no row of them): there are no sample ids to continue, and the forward "
                    "before it described other samples. Run that batch's first forward again, described as it "
                    "was (without same_samples=True), then its steps")
            if self._last_ids is None:
                raise ArgumentValueError(
                    "set_batch(same_samples=True) continues the samples of the last captured forward, and no "
                    "forward was captured yet; describe the first forward (the prompt) without it")
            given, first, n_last = self._last_ids
            sample_ids = given if given is not None else torch.arange(first, first + n_last, dtype=torch.int64)
        mask = None
        if attention_mask is not None:
            if isinstance(attention_mask, np.ndarray) and attention_mask.dtype.kind in "biu":
                attention_mask = torch.from_numpy(np.ascontiguousarray(attention_mask))  # (return_tensors="np")
            if not isinstance(attention_mask, torch.Tensor):
                raise ArgumentTypeError(
                    "attention_mask must be a torch.Tensor or numpy array (batch, pos), got "
                    f"{type(attention_mask).__name__}"
                    + (f" of dtype {attention_mask.dtype}" if isinstance(attention_mask, np.ndarray) else "")
                    + "; pass torch.as_tensor(mask).bool()")
            if attention_mask.dim() != 2:
                raise ArgumentValueError(
                    f"attention_mask must be 2-D (batch, pos), got shape {tuple(attention_mask.shape)}")
            if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
                raise ArgumentTypeError(
                    f"attention_mask must be bool or 0/1 integers, got dtype {attention_mask.dtype}; "
                    + _float_mask_advice(attention_mask)
                )
            if attention_mask.dtype != torch.bool and attention_mask.numel():
                lo, hi = int(attention_mask.min()), int(attention_mask.max())
                if lo < 0 or hi > 1:
                    raise ArgumentValueError(
                        f"attention_mask must hold only 0 and 1, got values in [{lo}, {hi}]; pass (mask > 0) or "
                        "mask.bool() if that is what you mean"
                    )
            mask = attention_mask.detach().to(torch.bool).contiguous()
        n = None if mask is None else mask.shape[0]
        for key, col in columns.items():
            check_column(key, col)
            length = len(col)
            if n is None:
                n = length
            if length != n:
                raise ArgumentValueError(f"column {key!r} has {length} entries, expected the batch size {n}")
        if sample_ids is not None and n is not None and len(sample_ids) != n:
            raise ArgumentValueError(f"sample_ids has {len(sample_ids)} entries, expected the batch size {n}")
        check = getattr(self.writer, "check_columns", None)
        if check is not None and columns:  # names and types, as the store will take them: refused now, not at close
            check(columns, mask)
        check = getattr(self.writer, "check_sample_ids", None)
        if check is not None and sample_ids is not None:
            check(sample_ids)
        if mask is not None and self._unwarned_2d_token and not bool(mask.all()):
            for name, shape in self._unwarned_2d_token.items():
                _warn_2d_token_rows(name, shape)
            self._unwarned_2d_token.clear()
        self._core.token_mask = mask if mask is not None else torch.Tensor()
        self._pending_batch = {"attention_mask": mask, "sample_ids": sample_ids, "columns": columns,
                               "same_samples": bool(same_samples)}

    # ------------------------------------------------------------------ callbacks (cold path)
    def _on_new_hook_point(self, name: str, tensor: torch.Tensor) -> Any:
        # Called by the native wrapper for a name it has no sink for yet. Tracked modules
        # called on their own from several threads at once can ask for the same name together
        # (this callback runs Python, so they interleave in it): one sink per name, made once,
        # or the records of one thread would go to a sink the tracker does not list.
        with self._new_hook_point_lock:
            renamed = rename_hook_point(name, self._hook_point_paths, self._side)
            if renamed is None:  # a HookPoint's input, already captured as its output
                return None
            if self._skip_patterns and any(pattern_selects(p, renamed, self._hook_names) for p in self._skip_patterns):
                self._skipped_hook_points.add(renamed)  # (the native wrapper keeps its None: asked once)
                return None
            made = self._sinks.get(renamed)
            return made if made is not None else self._new_sink(renamed, tensor)

    def _new_sink(self, name: str, tensor: torch.Tensor) -> Any:
        if self._stored is not None and name not in self._stored and not (
                # (a store that keeps reductions only lists the hook points it reduces: one no
                # reduction applies to is captured and kept nowhere)
                self._reductions_only
                and not self._red_factories.resolve_reductions(self.scope.reductions, name, self._hook_names)):
            self._refuse([], [name])
        if self.writer is not None and self._n_captured > 0 and name not in self._intermittent:
            warn_at_caller(
                f"hook point {name!r} was first captured in forward {self._core.n_forwards - 1} of the tracked "
                f"model, after {self._n_captured} captured forward(s) without it: its store array starts there, so "
                f"its rows do not line up with the sample row table (store.follows_row_table({name!r}) is False). "
                "Track only hook points every forward reaches (exclude= its module), or capture it into a "
                "store of its own",
                CaptureWarning,
            )
        scope = self.scope
        self._check_layout(name, tensor)
        self._check_dtype(name, tensor)
        mask = self._pending_batch["attention_mask"] if self._pending_batch else None
        if mask is None and scope.rows == "token":
            mask = self._core.auto_token_mask  # (batch, pos) of the model's first input, all true
            mask = mask if mask.dim() == 2 else None
        elif (mask is None and self._model_mask is not None and not tensor.is_nested and tensor.dim() >= 2
              and tuple(tensor.shape[:2]) == tuple(self._model_mask.shape)):
            # (first reached with no set_batch mask, starting with the mask the model was given:
            # one row per sample for good; named if a later set_batch mask breaks it)
            self._first_unmasked[name] = self._core.n_forwards - 1
        token = _C.is_token_rows(tensor, mask)  # the rule of the native sink (sink.h)
        decided = _token_rows_for(name, self._token_rows, self._hook_names)
        if decided is True and not token and isinstance(self._token_rows, Mapping):
            raise CaptureError(
                f"hook point {name!r} is set to token rows by token_rows=, but its activation "
                f"{tuple(tensor.shape)} does not start with the (batch, pos) of "
                f"{'the attention mask ' + str(tuple(mask.shape)) if mask is not None else 'an attention mask (none given)'}; "
                "pass attention_mask= to tracker.set_batch (or rows='token'), or drop the hook point from token_rows="
            )
        self._first_shapes[name] = "(nested)" if tensor.is_nested else tuple(tensor.shape)
        if not tensor.is_nested and tensor.dim() >= 2 and tensor.shape[0] == 1 < int(self._core.batch_size):
            # (1, ...) in a forward of more samples: a tensor shared by the batch (named where it
            # breaks the row table, and where its shape changes: _note_shared_rows)
            self._shared_rows[name] = tuple(tensor.shape)
        known_layout = decided is None and _attention_map_hook_point(name, self._hook_point_paths)
        if known_layout:
            # a TransformerLens attention map is (batch, head_index, query_pos, key_pos), whatever
            # the shape says (with as many heads as positions it would pass for token rows of
            # (sample, head) pairs): one row per sample
            decided = False
        if decided is False:
            if not known_layout:  # (not asked for by the user: a mask that fits nothing is still warned about)
                self._sample_rows_chosen = True
            token = False
        path = self._module_of(name)
        batchless = decided is not True and _position_bias_hook_point(
            name, path, self._module_by_name().get(path), tensor)
        if batchless:
            # T5's relative position bias (query, key, heads), or its (query, key) buckets: no
            # batch dimension, whatever its first two sizes say (with as many samples as positions
            # they are those of the mask): stored off the row table, warned about at the forward's end
            self._position_bias_found[name] = tuple(tensor.shape)
            token = False
        rows_matter = decided is None and (self.writer is not None or (
            self._red_factories is not None
            and bool(self._red_factories.resolve_reductions(scope.reductions, name, self._hook_names))))
        if rows_matter and token and self._pending_batch and self._pending_batch.get("attention_mask") is not None:
            # (a set_batch mask: rows="token" alone takes the model's first input's positions, the
            # (pos, batch) of a sequence-first model, whose rows are warned about as swapped)
            self._check_sequence_first(name, tuple(tensor.shape), mask)
        if rows_matter and (self._seq2seq or self._nn_seq2seq):
            side = self._side_of(name)
            own = dict(zip(("encoder", "decoder"), self._seq_masks)).get(side)
            if token:
                # an encoder-decoder model: the mask must be that of this hook point's sequence
                self._check_token_side(name, side, tuple(tensor.shape), mask)
                self._token_sides[name] = side
            elif (mask is not None and own is not None and tensor.dim() >= 2
                  and tuple(tensor.shape[:2]) == tuple(own.shape) != tuple(mask.shape)):
                # (batch, T, ...) of the decoder with the encoder's (batch, S) mask, or (batch, S,
                # ...) of the encoder with the decoder's: one row per sample, that side's padding
                # inside (named at the end of the forward)
                self._side_sample_rows.setdefault(side, {})[name] = tuple(tensor.shape)
        # a shape that could be token rows or not, taken as token rows (warned about below, where
        # rows matter: a store or reductions; in-memory records are whole tensors either way)
        ambiguous = None
        if decided is None and token and tensor.dim() == 2 and not _token_ids_hook_point(name, self._hook_point_paths):
            # (batch, pos) values with padding: one scalar per real token, the padded columns
            # dropped. Right for per-token scalars (token ids, a per-token score); wrong for a
            # pooled (batch, features) output whose width happens to equal pos.
            ambiguous = "2d"
        elif (decided is None and token and tensor.dim() >= 4 and tensor.shape[2] == tensor.shape[1]
              and not _per_head_token_hook_point(name, self._hook_point_paths)):
            # (batch, pos, pos, ...): token rows of (pos, ...), or a head-first (batch, heads, pos,
            # ...) tensor with as many heads as positions (an attention map of 12 heads over 12
            # tokens), whose rows would be (sample, head) pairs. Only the user knows.
            ambiguous = "head-first"
        keep = _KEEP_CODE[scope.reduction_policy]
        if not self._in_memory:
            keep = 2
        cast = self._cast_dtype(name, tensor)
        sink = _C.Sink(
            name,
            # REFERENCE of a hook point cast to storage_dtype: a record of the cast values is a
            # copy (an integer or bool one is not cast: its record is the model's tensor)
            snapshot=scope.capture_mode is CaptureMode.SNAPSHOT or cast is not None,
            keep=keep,
            placement=_PLACEMENT_CODE[scope.storage],
            storage_dtype=cast,
            arena=self._arena,
            row_kind=1 if token else (0 if decided is False or batchless else -1),
            module=self._module_of(name),  # named by the native layout check of later calls
        )
        if self._red_factories is not None:
            names, objects = [], []
            resolved = self._red_factories.resolve_reductions(scope.reductions, name, self._hook_names)
            # (sized only where a reduction applies: a nested tensor kept by REFERENCE has no sizes)
            n_features = (math.prod(tensor.shape[2:] if token else tensor.shape[1:]) if tensor.dim() else 1) if resolved else 0
            for red_name, factory in resolved:
                before = _script_of(factory)
                reduction = factory()
                _check_state_fits(name, red_name, reduction, n_features, self._red_factories.state_bytes)
                _keep_script(reduction, factory, before, red_name, name)
                if isinstance(reduction, self._red_factories.EagerReduction):
                    reduction.hook_point = name  # named in its errors
                sink.add_reduction(reduction)
                names.append(red_name)
                objects.append(reduction)  # keeps Python subclasses (eager reductions) alive
            # (objects first: the names are what the close goes through, reading the objects of each)
            self._reduction_objects[name] = objects
            self._reduction_names[name] = names
            if objects and self.writer is not None:
                # a store ends at the last whole forward: a forward cut short at the end is taken
                # out of the reductions too (_rollback_open_forward)
                sink.set_keep_forward_start(True)
            if any(str(r.kind) in ("script", "eager") for r in objects):
                self._half_pending.add(name)
        if cast is None and scope.storage_dtype is not None and (keep != 2 or self._reduction_names.get(name)):
            # an integer or bool hook point, not cast: a later floating-point call is refused (its
            # record and reductions would not be storage_dtype's; one that keeps no record, under
            # reduction_policy=STREAMING, and that no reduction applies to keeps nothing of it)
            sink.set_uncast_storage_dtype(scope.storage_dtype, tensor.dtype)
        if ambiguous is not None and (self.writer is not None or self._reduction_names.get(name)):
            if ambiguous == "head-first":
                self._head_first_found[name] = tuple(tensor.shape)  # warned at the forward's end, all at once
            elif bool(mask.bool().all()):
                self._unwarned_2d_token[name] = tuple(tensor.shape)  # warned at the first mask with padding
            else:
                _warn_2d_token_rows(name, tuple(tensor.shape))
        target = self._alias_target(name, tensor, 1 if token else 0)
        if target is not None:
            # the same tensor as an earlier hook point of this forward: kept and stored once (in
            # memory each later call that is not its target's tensor is kept on its own)
            sink.set_alias_of(self._sinks[target], shares_records=self.writer is None)
            self._aliases[name] = target
            self._watch_targets.add(target)
            if self.writer is not None:
                self.writer.add_alias(name, target)
        elif self.writer is not None and self._reductions_only:
            if self._reduction_names.get(name):  # (a hook point no reduction applies to is not kept)
                feature_shape = tuple(tensor.shape[2:] if token else tensor.shape[1:]) if tensor.dim() else ()
                dtype = self._cast_dtype(name, tensor) or tensor.dtype
                self.writer.open_reduced(name, feature_shape, dtype, "token" if token else "sample")
                self._reduced_rows[name] = 0
                # the store records this first call's dtype and feature shape: a later call of
                # another (autocast switched on or off), or first rows of another after an empty
                # first call, is refused as a store array refuses it
                sink.set_one_layout(True, dtype, list(feature_shape))
        elif self.writer is not None:
            feature_shape = tuple(tensor.shape[2:] if token else tensor.shape[1:]) if tensor.dim() else ()
            dtype = self._cast_dtype(name, tensor) or tensor.dtype
            try:
                sink.set_writer(
                    self.writer.open_array(name, feature_shape, dtype, "token" if token else "sample")
                )
            except StoreError as e:
                stored_kind = getattr(self.writer, "stored_row_kind", None)
                if not (batchless and stored_kind is not None and stored_kind(name) == "token"):
                    raise
                # a store captured before such hook points were stored off the row table
                raise StoreError(
                    f"{e}. Hook point {name!r} is a relative position bias without a batch dimension, stored "
                    "as token rows by an earlier version (now one row per query, off the row table): resume with "
                    f"token_rows={{{name!r}: True}} to continue it as before, or capture into a new store (or "
                    "overwrite=True) to store it one row per query; the store is left as it was"
                ) from None
        if target is None and self.writer is not None and self._stored_layout(name):
            # (its rows' shape and dtype are the resumed store's: named where rows after an empty
            # first call differ from them, with no storage_dtype= advice, which a resume refuses)
            sink.set_stored(True)
        if self.writer is not None and self._reduction_names.get(name):
            self._resume_reductions(name, sink)
            if name in self._reduced_rows:  # (a resume: its rows reduced so far are the stored ones)
                self._reduced_rows[name] = self._reduction_base.get(name, 0)
        if self._alias_candidates and target is None and not self._core.in_graph:
            # (not inside a compiled graph: it reuses buffers, so identity means nothing there)
            sink.watch_aliases(True)  # until the end of this forward, or for good once a target
            self._watch_by_storage.setdefault(_storage_key(tensor), []).append((len(self._watching), name))
            self._watching.append(name)
        self._sinks[name] = sink
        return sink

    def _stop_watching(self) -> None:
        """Hook points first seen in the forward that ended and that no alias repeats stop
        keeping their last tensor."""
        if self._watching:
            targets = set(self._aliases.values())
            for name in self._watching:
                if name not in targets:
                    self._sinks[name].watch_aliases(False)
            self._watching = []
            self._watch_by_storage, self._watch_targets = {}, set()

    def _eval_mode_dropouts(self) -> Iterator[tuple[str, torch.nn.Module]]:
        """``(path, module)`` of each module of the tracked model that may return its input as
        it is in eval mode and a new tensor in training mode (a dropout, a drop path or
        stochastic depth, or a module calling a functional dropout, with a nonzero
        probability) and is in eval mode now."""
        return ((path, m) for path, m in named_modules(self.model) if not m.training and _drops_in_training(m))

    def _probe_dropouts(self) -> None:
        """At the first forward of a store capture, note the tensors that the model's dropouts
        in eval mode return (their input as it is), so that an alias is refused only where the
        identity goes through one of them (in training mode a dropout returns a new tensor);
        aliases elsewhere in the model are kept. Probes stay for this forward only."""
        self._dropouts_probed = True
        if self.writer is None or not self._alias_candidates or self._core.in_graph:
            return
        drops = list(self._eval_mode_dropouts())
        if not drops:
            return
        outputs: list[torch.Tensor] = []

        def note(_module, _args, out) -> None:
            for x in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(x, torch.Tensor):
                    outputs.append(x)

        self._dropout_outputs = outputs
        self._dropout_paths = tuple(path for path, m in drops if not _dropout_class(m))
        self._dropout_modules = frozenset(path for path, _ in drops)
        self._dropout_probes = [m.register_forward_hook(note) for _, m in drops]

    def _unprobe_dropouts(self) -> None:
        for handle in self._dropout_probes:
            handle.remove()
        self._dropout_probes = []
        self._dropout_outputs = None
        self._dropout_paths = ()
        self._dropout_modules = frozenset()

    def _alias_target(self, name: str, tensor: torch.Tensor, row_kind: int) -> str | None:
        """The hook point captured earlier in this forward whose tensor ``tensor`` is (same
        storage, offset, shape, strides, dtype, unchanged since) and whose rows are of the same
        kind (``row_kind``: 1 token rows, 0 sample rows; ``token_rows=`` can give the same
        tensor other rows), when storing both would duplicate bytes; None otherwise. On
        resume, a hook point stored as an array stays one, and one stored as an alias must be
        one again."""
        if self.writer is not None and not getattr(self.writer, "supports_aliases", False):
            return None  # a writer that cannot store aliases (a rank of a multi-rank capture)
        stored = self.writer.aliases if self.writer is not None else {}
        target = None
        # a hook point the store holds as an array stays one, rows or not (an array of 0 rows:
        # its first forwards were empty batches, which have no tensor to compare)
        stored_dtype = getattr(self.writer, "stored_dtype", None)
        held = self.writer is not None and name not in stored and (
            self.writer.committed_rows(name) or (stored_dtype is not None and stored_dtype(name) is not None))
        if self._alias_candidates and not self._core.in_graph and not held:
            # a target has one alias: it keeps its last tensor for one alias check per call
            # (a second alias of it, the same tensor passed twice, as attn(h, h, h), would
            # fail that check from the next forward on)
            key = _storage_key(tensor)
            if key is None or not self._core.open_here:
                # (a tensor whose storage Python cannot tell, or a tracked module called on its own:
                # such calls may give a watched hook point another tensor, so each is compared)
                targets = set(self._aliases.values())
                others = [other for other in self._watching if other != name and other not in targets]
            else:
                # inside a forward each watched hook point still holds the tensor it was first
                # seen with (a second tensor under one name is refused): only those on this
                # tensor's storage can be it (and those of a storage Python could not tell)
                found = self._watch_by_storage.get(key, [])
                if None in self._watch_by_storage:
                    found = sorted(found + self._watch_by_storage[None])
                others = [other for _, other in found if other != name and other not in self._watch_targets]
            others = [other for other in others if self._sinks[other].row_kind == row_kind]
            # (latest first; none to compare: no native call, whose GIL release and take-back
            # cost more than the search on a capture whose writer threads run)
            i = _C.last_match(tensor, [self._sinks[other] for other in others]) if others else -1
            target = others[i] if i >= 0 else None
            if target is not None and self.writer is not None and name not in stored:
                # the same tensor maybe only because a dropout in eval mode returns its input:
                # in training mode it gives a new one, and a store alias cannot follow (a
                # validation forward, then training, would be refused)
                if self._dropout_outputs is not None:  # the first forward: told exactly
                    module = self._module_of(name)
                    tail = name[len(module) + 1:] if module else name
                    if (module in self._dropout_modules and tail.startswith("output")) or any(
                            _same_tensor(tensor, out) for out in self._dropout_outputs) or any(
                            module == p or module.startswith(p + ".") or p == "" for p in self._dropout_paths):
                        target = None
                elif next(self._eval_mode_dropouts(), None) is not None:
                    target = None
        if (target is None and name in stored and stored[name] in self._sinks and tensor.dim() >= 1
                and tensor.shape[0] == 0):
            # an empty batch keeps no rows, and no tensor for an alias to be compared with (the
            # native sink returns before remembering it): the stored alias stays one, and the
            # next call with rows is checked against its target's as every later call is
            target = stored[name]
        if name in stored and target != stored[name]:
            raise CaptureError(
                f"the resumed store holds hook point {name!r} as an alias of {stored[name]!r} (the same tensor), "
                f"but this capture gives {name!r} {'as an alias of ' + repr(target) if target else 'its own tensor'}; "
                "resume with the same model and selection, or overwrite=True"
            )
        return target

    def _check_layout(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse, before the hook point's first row is kept, an activation whose values a
        copy, a store or a reduction cannot read: a sparse or nested tensor, or one on the
        meta device (shapes only), or a quantized one (its integers mean nothing without its
        scale and zero point). Only an in-memory REFERENCE capture without reductions, of a
        hook point ``storage_dtype`` does not cast (none given, or an integer or bool one),
        keeps the tensor itself, and so can hold them. The native sink (``Sink::consume``)
        makes the same check, with the same message, on every later call. A tensor of a
        torch.func transform (grad, vmap, ...) is refused in every mode: it has no values of
        its own outside the transform."""
        if _functorch_wrapped(tensor):
            raise CaptureError(
                f"hook point {name!r} is a tensor inside a torch.func transform (grad, vmap, jacrev, ...): such a "
                "tensor has no values of its own outside the transform, so a capture cannot keep, store or reduce "
                "it. Run the tracked model outside the transform (capture with a plain forward, then apply "
                f"torch.func to the model), or pass exclude=[{self._module_of(name)!r}] to track()"
            )
        if tensor.is_nested:
            what, convert = "a nested tensor", "x.to_padded_tensor(0.0)"
        elif tensor.layout != torch.strided:
            what = f"a {str(tensor.layout).replace('torch.', '')} tensor (not strided)"
            convert = "x.to_dense()"
        elif tensor.device.type == "meta":
            what, convert = "on the meta device (it has a shape but no values)", "a model on a real device"
        elif tensor.is_quantized:
            what, convert = f"a quantized tensor ({tensor.dtype})", "x.dequantize()"
        elif _is_fake(tensor):  # (no values at all: a forward traced under FakeTensorMode)
            what = "a FakeTensor (a shape without values, made under torch._subclasses.FakeTensorMode)"
            convert = "the forward run outside FakeTensorMode, on real tensors"
        elif _has_no_bytes(tensor):
            what = ("a tensor subclass with no bytes of its own (a __torch_dispatch__ wrapper: its values are computed "
                    f"by its Python code; {type(tensor).__qualname__})")
            convert = "a plain torch.Tensor of its values"
        else:
            return
        uses = []
        # (a cast is a copy, in either mode: the native message's words. An integer or bool
        # hook point is not cast (_cast_dtype), so under REFERENCE it is kept as it is, as the
        # native sink of a hook point first seen dense keeps it on every later call)
        if self._cast_dtype(name, tensor) is not None:
            uses.append(f"copied (CaptureMode.SNAPSHOT, or storage_dtype={self.scope.storage_dtype}, whose cast is a "
                        "copy)")
        elif self.scope.capture_mode is CaptureMode.SNAPSHOT:
            uses.append("copied (CaptureMode.SNAPSHOT)")
        elif tensor.is_inference():  # (no version counter to tell later changes by: REFERENCE copies it)
            uses.append("copied (an inference tensor, made under torch.inference_mode(), which CaptureMode.REFERENCE "
                        "copies)")
        if self.writer is not None:
            uses.append("stored")
        red = self._red_factories
        if red is not None and red.resolve_reductions(self.scope.reductions, name, self._hook_names):
            uses.append("reduced")
        if not uses:
            return
        module = self._module_of(name)
        raise CaptureError(
            f"hook point {name!r} is {what}, shape {tuple(tensor.shape) if not tensor.is_nested else '(nested)'}, "
            f"which cannot be {' or '.join(uses)}: a capture records dense strided tensors with values. "
            f"Pass exclude=[{module!r}] to track() (or give the capture a dense tensor: {convert}); an in-memory "
            "capture with capture_mode=CaptureMode.REFERENCE and no reductions keeps such a tensor as it is, in a "
            "forward under torch.no_grad() (not torch.inference_mode()) and without storage_dtype="
        )

    def _stored_layout(self, name: str) -> bool:
        """Whether the store this capture resumes holds hook point ``name`` (its array, or the
        rows a store that keeps reductions only reduced), whose row shape and dtype are then
        the stored ones."""
        stored = getattr(self.writer, "stored_dtype", None)
        return callable(stored) and stored(name) is not None

    def _cast_dtype(self, name: str, tensor: torch.Tensor) -> torch.dtype | None:
        """The dtype the rows of hook point ``name`` are cast to (None: kept as they are), from
        its first activation ``tensor``: ``storage_dtype`` for a floating-point one (a complex
        one is refused by :meth:`_check_dtype`); an integer or bool one keeps its dtype, except
        where a resumed store holds it cast to ``storage_dtype`` (its array, or the rows a store
        that keeps reductions only reduced: its first call was floating-point, or an earlier
        version cast every hook point): cast again, so its rows keep one dtype (the native sink
        refuses an integer the cast would change)."""
        dtype = self.scope.storage_dtype
        if dtype is None or tensor.is_floating_point() or tensor.is_complex():
            return dtype
        stored = getattr(self.writer, "stored_dtype", None)
        if stored is not None and stored(name) == str(dtype).replace("torch.", ""):
            return dtype
        return None

    def _check_dtype(self, name: str, tensor: torch.Tensor) -> None:
        """Refuse, before the hook point's first row is kept, a dtype its destination cannot
        hold exactly."""
        dtype = self._cast_dtype(name, tensor)
        if dtype is not None and tensor.is_complex() and not dtype.is_complex:
            raise CaptureError(
                f"hook point {name!r} is complex ({tensor.dtype}) but storage_dtype={dtype} is real: the cast would "
                f"drop the imaginary part; drop storage_dtype or exclude= the module of {name!r}"
            )
        held = getattr(self.writer, "supported_dtypes", None)
        if held is not None:
            stored = str(dtype or tensor.dtype).replace("torch.", "")
            if stored not in held:
                raise CaptureError(
                    f"hook point {name!r} has dtype {stored}, which a store cannot hold (it holds "
                    f"{', '.join(held)}); pass storage_dtype= one of those, or exclude= the module of {name!r}"
                )

    def _reduce_stored_only(self) -> None:
        """A resume that captured no forward (nothing was left to capture): reductions of the
        stored hook points are computed over their stored rows (loaded states, rows read back),
        so a reduction added on resume is not lost."""
        self._check_reduction_patterns(sorted(self._stored or ()), "the store holds")
        for name in sorted(self._stored or ()):
            if name in self._sinks:
                continue
            names, objects = [], []
            for red_name, factory in self._red_factories.resolve_reductions(self.scope.reductions, name, self._hook_names):
                before = _script_of(factory)
                reduction = factory()
                _keep_script(reduction, factory, before, red_name, name)
                if isinstance(reduction, self._red_factories.EagerReduction):
                    reduction.hook_point = name  # named in its errors
                names.append(red_name)
                objects.append(reduction)
            if names:
                self._reduction_names[name] = names
                self._reduction_objects[name] = objects
                self._resume_reductions(name, None)
        if self._reductions_only:  # (a stored reduction left out is refused, as after a resumed forward)
            self._check_reductions_continued()

    def _check_reduction_patterns(self, hook_points: list[str], source: str) -> None:
        """A ``reductions=`` or ``token_rows=`` pattern that selects none of ``hook_points``
        (what ``source`` gave) raises HookPointNotFoundError, as an ``include=`` pattern that
        matches no module does; nothing of this run is committed (a store is left as it was
        found). The error's ``argument`` is ``"reductions"`` or ``"token_rows"``, its
        ``pattern`` the pattern, its ``hook_points`` the sorted ``hook_points``. A pattern of
        these or of ``exclude_hook_points=`` holding ``[`` that selects other hook points than
        those holding the brackets (``'d.a[1].*'`` selecting ``d.a1.*``) gets a CaptureWarning
        naming those and the pattern that selects them (:func:`~.hooks.bracket_hint`), once."""
        if self._refused is not None:
            return
        reductions = self.scope.reductions
        token_rows = self._token_rows
        patterns = [("reductions", p) for p in (reductions if isinstance(reductions, Mapping) else ())]
        patterns += [("token_rows", p) for p in (token_rows if isinstance(token_rows, Mapping) else ())]
        skip = [p for p in self._skip_patterns or () if "[" in p]  # (checked for the bracket reading only)
        if not patterns and not skip:
            return
        modules = {n for n, _m in self._modules}
        # a hook point of a tracked module reached only in a later forward (a branch) counts
        later = [h for h in self._hook_names if self._can_capture(h, modules)]
        names = list(dict.fromkeys(itertools.chain(hook_points, sorted(later))))
        left_out = list(dict.fromkeys(itertools.chain(names, sorted(self._skipped_hook_points))))
        warned = self.__dict__.setdefault("_bracket_warned", set())  # (checked again on a resume's exit)
        for argument, pattern in [*patterns, *(("exclude_hook_points", p) for p in skip)]:
            leaves = argument == "exclude_hook_points"
            among = left_out if leaves else names
            hits = [h for h in among if pattern_selects(pattern, h, self._hook_names)]
            bracket = bracket_hint(pattern, among, hits, argument, verb="leaves out" if leaves else "selects",
                                   spelled=None if leaves else argument + "={" + "{}" + ": ...}")
            if bracket and (hits or leaves) and (argument, pattern) not in warned:
                warned.add((argument, pattern))
                done = "leaves out" if leaves else "selects"
                warn_at_caller(f"{argument}= pattern {pattern!r} {done} {_names(hits) if hits else 'no hook point'}"
                               f"{bracket}", CaptureWarning)
            if not hits and not leaves:
                self._refused_error = HookPointNotFoundError
                self._refused = (
                    f"{argument}= pattern {pattern!r} selects no hook point: {source} {_names(sorted(hook_points))}"
                    + (bracket or wrapper_hint(self.model, pattern, names, argument, "hook points",
                                               spelled="{{{}: ...}}")
                       or "; a pattern names hook points (a module path plus '.output' or '.input.0'), not "
                       "modules: fix the pattern or drop it")
                    + ("" if self.writer is None else " (no row of this run is stored)")
                )
                if self.writer is not None and self._closed:
                    _discard(self.writer, self._refused_error(self._refused))
                self._refused_attrs = {"argument": argument, "pattern": pattern, "hook_points": sorted(hook_points)}
                raise self._refusal()

    def _refusal(self) -> ActivationScopeError:
        """The error of this run's refusal (``_refused``), with its attributes."""
        error = self._refused_error(self._refused)
        for name, value in self._refused_attrs.items():
            setattr(error, name, value)
        return error

    def _resume_reductions(self, name: str, sink: Any) -> None:
        """A resumed store: continue each reduction of ``name`` from the rows already
        committed, so that it covers every stored row. The stored state is loaded when it
        covers exactly the committed rows and was recorded with the same kind and options;
        otherwise (a run killed before its close, a reduction added on resume or given
        another kind or options, a store written before states were kept) the state covers
        a prefix or nothing, and the committed rows past it are read back from the store and
        folded in, in order."""
        array = self._aliases.get(name) or getattr(self.writer, "aliases", {}).get(name, name)  # an alias's rows: its target's
        committed = self.writer.committed_rows(array)
        self._reduction_base[name] = committed
        if sink is not None:
            sink.set_row_base(committed)  # row ids of the new rows continue the stored ones
        if committed == 0:
            return
        starts: dict[int, list[Any]] = {}
        for red_name, red in zip(self._reduction_names[name], self._reduction_objects[name]):
            start = 0
            options = getattr(red, "options", None)
            options = options() if callable(options) else options
            kind = str(getattr(red, "kind", "custom"))
            custom = ({} if kind in self._red_factories.BUILTIN_REDUCTIONS  # the same program, or recomputed
                      else {"script": getattr(red, "script_bytes", None) or getattr(red, "script_path", None)})
            saved = self.writer.stored_reduction_state(name, red_name, kind, dict(options or {}), **custom)
            if self._reductions_only and (saved is None or saved[1] != committed):
                held = (getattr(self.writer, "stored_reductions", None) or {}).get(name) or []
                if saved is None and red_name not in held:  # (added on resume: no state, and no row to start from)
                    why = (f"its hook point {name!r} holds no reduction {red_name!r} (it holds {held}), and a reduction "
                           "cannot be added to a store that keeps reductions only")
                elif saved is None and kind == "eager":  # (no program to tell that the function is the same one)
                    why = (f"its reduction {red_name!r} of hook point {name!r} runs as eager Python (TorchScript could "
                           "not compile it; see its EagerFallbackWarning), and an eager reduction's stored state is "
                           "never continued: no program tells that the function is the one that made it. Make the "
                           "function TorchScript-compatible for a store that can be resumed")
                elif saved is None:
                    why = (f"its reduction {red_name!r} of hook point {name!r} has no state this capture's reduction "
                           "can continue (another kind, other options or another program, or files that fail their "
                           f"checks: `activationscope verify {self.writer.path}` names them)")
                else:
                    why = f"its reduction {red_name!r} of hook point {name!r} covers {saved[1]} of the {committed} rows it reduced"
                self._refuse_reduced_resume(why)
            if saved is not None and saved[1] <= committed:
                red.load_state(saved[0])
                start = saved[1]
            if start < committed:
                starts.setdefault(start, []).append(red)
        # every reduction is fed the stored rows forward by forward, as the capture fed it, so
        # that a resume gives the very result of an uninterrupted run: a custom function may
        # depend on how the rows were cut, and a built-in one's float64 round-off does (None:
        # rows that do not follow the row table, whose forwards are not known, go in blocks)
        ends = self.writer.committed_batch_ends(array) if starts else None
        for start, reds in starts.items():
            row = start
            cuts = [e for e in (ends or ()) if e > start]
            while row < committed:
                stop = min(committed, row + _REBUILD_ROWS)
                if cuts:  # whole forwards only (one forward larger than a step is read whole)
                    stop = max([e for e in cuts if e <= stop] or [cuts[0]])
                rows = self.writer.read_committed_rows(array, row, stop)
                for red in reds:
                    if ends is None:
                        red.update(rows, row)
                        continue
                    first = row
                    for end in cuts:
                        if end > stop:
                            break
                        red.update(rows[first - row:end - row], first)
                        first = end
                cuts = [e for e in cuts if e > stop]
                row = stop

    def _refuse_reduced_resume(self, why: str) -> None:
        """Refuse the resume of a store that keeps reductions only (nothing of this run is
        committed; the store is left as it was found, at the tracker's close)."""
        self._refused_error = StoreError
        self._refused = (
            f"cannot resume {self.writer.path!r}: {why}. A store that keeps reductions only holds no row to compute a "
            "reduction again from, so a resume continues every stored reduction from its stored state: resume with "
            "the same model, reductions= and storage_dtype, or capture again with store_options={'overwrite': True} "
            "(the store is left as it was)")
        if self._closed:  # (a resume that captured no forward, refused at its close: nothing to undo)
            _discard(self.writer, StoreError(self._refused))
        raise StoreError(self._refused)

    def _check_reductions_continued(self) -> None:
        """The first forward of the resume of a store that keeps reductions only: every stored
        reduction of every stored hook point is one of this capture's (a reduction left out
        would stay over fewer rows than the store counts; one of them, never to be computed)."""
        stored = getattr(self.writer, "stored_reductions", None) or {}
        for hp, names in sorted(stored.items()):
            left = [n for n in names if n not in (self._reduction_names.get(hp) or [])]
            if left:
                self._refuse_reduced_resume(f"its reductions {left} of hook point {hp!r} are not among this capture's "
                                            f"reductions ({self._reduction_names.get(hp) or 'none'})")

    def _warn_head_first_found(self) -> None:
        if self._head_first_found:
            found, self._head_first_found = self._head_first_found, {}
            _warn_head_first_token_rows(found)

    def _training_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """Modules of the tracked model in training mode whose skipping changes later forwards:
        dropout (random draws: a dropout, drop path or stochastic depth module, or a module
        calling a functional dropout, :func:`_drops_in_training`) and norms with running
        statistics (BatchNorm)."""
        return [(n or type(m).__name__, m) for n, m in named_modules(self.model) if m.training and (
            _drops_in_training(m)
            or (isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats))]

    def _warn_side_sample_rows(self) -> None:
        """Name (once per capture and side) the hook points of an encoder-decoder model stored
        one row per sample because the mask given is the other side's: decoder hook points
        under the encoder's mask, encoder ones under the decoder's. Each row holds a whole
        sequence, its padding inside, and a batch of another length of it is refused."""
        found, self._side_sample_rows = self._side_sample_rows, {}
        mask = self._rows_mask()
        for side, other in (("decoder", "encoder"), ("encoder", "decoder")):
            if not found.get(side) or side in self._warned_side_sample_rows:
                continue
            self._warned_side_sample_rows.add(side)
            names = sorted(found[side])
            shown = ", ".join(f"{n!r} {found[side][n]}" for n in names[:6]) + (
                f" and {len(names) - 6} more" if len(names) > 6 else "")
            seq, length, tokens = (("target", "T", "decoder token") if side == "decoder" else
                                   ("source", "S", "source token"))
            warn_at_caller(
                f"{side} hook points of the encoder-decoder model {type(self.model).__name__} start with the "
                f"{side}'s (batch, {length}), not with the (batch, pos) "
                f"{tuple(mask.shape) if mask is not None else ''} of the {other}'s mask their rows are taken with: "
                f"{shown}. They are stored one row per sample, each a whole {seq} with the {side}'s padding inside "
                f"(in the rows and the reductions), and a batch of another {seq} length is refused. For one row per "
                f"{tokens} capture the {side} in a tracker of its own, described with the {side}'s mask "
                f"({docs_page('docs/usage/capture.md', 'Encoder-decoder models and other models of two sequences')}); "
                "token_rows={pattern: False} says that sample rows are meant",
                CaptureWarning,
            )

    def _watch_training_stop(self) -> None:
        """stop_after_last=True in training mode: note which dropout / BatchNorm modules run in
        the full first captured forward and in the first forward cut short; those skipped by
        the cut are named at its end (:meth:`_check_training_stop`). Looked at in those two
        forwards only (pre-hooks, removed after): later forwards pay nothing."""
        if self._train_phase == "full" and self._train_full is None:
            self._remove_train_probes()  # (the full forward raised: watch again from here)
            self._train_phase = ""
        if self._train_phase:
            return
        if not self._stop_learnt:
            if self._train_full is not None or not self.model.training or self._hook_probes_done_compiled:
                return
            self._train_phase = "full"
        elif self._train_full is not None:
            self._train_phase = "cut"
        else:
            self._warned_training_stop = True  # (in eval mode when the stop point was learnt)
            return
        modules = self._training_modules()
        if not modules:
            self._remove_train_probes()
            self._train_phase = ""
            self._warned_training_stop = True
            return
        self._train_ran.clear()  # (the probes hold this set)
        if not self._train_probes:
            ran = self._train_ran

            def probe(name: str):
                return lambda module, args: ran.add(name)

            self._train_probes = [m.register_forward_pre_hook(probe(n)) for n, m in modules]

    def _remove_train_probes(self) -> None:
        while self._train_probes:
            self._train_probes.pop().remove()

    def _check_training_stop(self) -> None:
        """At the end of a watched forward (:meth:`_watch_training_stop`): after the full one,
        keep what ran; after the first cut one, warn naming what the cut skipped."""
        if self._train_phase == "full":
            self._train_full = set(self._train_ran)
            self._train_ran.clear()
            self._train_phase = ""
            return
        self._train_phase = ""
        self._warned_training_stop = True
        self._remove_train_probes()
        skipped = sorted(self._train_full - self._train_ran) if self._train_full is not None else []
        if not skipped:
            return
        dropout = {n for n, m in self._training_modules() if _drops_in_training(m)}
        effects = []
        if any(n in dropout for n in skipped):
            effects.append("its dropout takes no random numbers, so the dropout masks of later forwards (before the "
                           "stop point too), and so their records, differ from a full run's")
        if any(n not in dropout for n in skipped):
            effects.append("its BatchNorm running statistics are not updated, so the model's state after the capture "
                           "differs from a full run's")
        shown = ", ".join(repr(n) for n in skipped[:6]) + (f" and {len(skipped) - 6} more" if len(skipped) > 6 else "")
        warn_at_caller(
            f"stop_after_last=True with the model in training mode skips {shown} after the stop point: "
            f"{'; '.join(effects)}. Call model.eval() for the capture, or pass stop_after_last=False",
            CaptureWarning,
        )

    def _on_forward_start(self) -> None:
        if self._core.capturing and _cuda_graph_capturing():
            raise CaptureError(
                "the tracked model runs while a CUDA graph is being captured (torch.cuda.graph, "
                "torch.cuda.make_graphed_callables) on the current stream: its kernels and copies would only run "
                "when the graph is replayed, and a replay runs no hook, so the records, store rows and reductions "
                "of this forward would hold no values of it. Run the forwards to record eagerly, outside the graph "
                "capture, and capture the graph outside `with scope.track(model)`; nothing of this forward was "
                "kept"
            )
        self._model_mask = None  # (noted again by the root's Python frame, which runs next)
        if self._nn_seq2seq:
            self._seq_masks = (None, None)  # (noted again at the calls of the stacks)
        self._warn_head_first_found()  # (after a forward that raised)
        self._stop_learnt = self.stop_after_last and self._core.stop_learnt
        if self.stop_after_last and not self._warned_training_stop and self._core.capturing:
            self._watch_training_stop()
        self._stop_watching()  # after a forward that raised
        self._unprobe_dropouts()
        if not self._dropouts_probed and self._core.capturing:
            self._probe_dropouts()
        if self._open_forward is not None:
            self._note_hooks_added(raised=True)  # (its end did not run)
            self._forward_raised()
        if self._pending_batch is not None:
            # refused before any module of this forward records a row (the end of the forward
            # checks again when only the first activation tells the batch size); a forward the
            # policy skips too: the running counter counts its samples by the description
            self._check_batch_size(self._pending_batch)
        if not self._core.capturing and self.writer is not None:
            self._check_skipped_counted(self._pending_batch or {})
        self._batches_at_start = getattr(self.writer, "n_batches_recorded", None)  # (first: see _rollback_open_forward)
        self._open_forward = self._core.n_forwards - 1 if self._core.capturing else None
        if self._pending_batch is not None:
            self._batch = self._pending_batch
        else:
            self._batch = None
        self._unrecorded_forward = (self._core.n_forwards - 1, bool((self._batch or {}).get("same_samples")))
        if self._hook_probes:  # (after a forward that raised)
            self._remove_hook_probes()
        if not self._hook_probes_done and self._core.capturing and self._side != "input":
            self._hook_probes_done = True
            self._add_hook_probes()
            self._hook_id_seen = _RemovableHandle.next_id
        elif (self._hooks_seen is not None and _RemovableHandle.next_id != self._hook_id_seen
              and self._core.capturing):
            # a hook registered since the last look (any module's, one counter; forwards the
            # policy skips do not look, so the counter is noted only here): probe the tracked
            # modules that got forward hooks, as the first captured forward was
            if self._forward_hooks_changed():
                self._probe_new_hooks()
            self._hooks_added_in = None
            self._hook_id_seen = _RemovableHandle.next_id
        self._hook_id_at_start = _RemovableHandle.next_id  # (_note_hooks_added)

    def _add_hook_probes(self, only: set[int] | None = None) -> None:
        """For the first captured forward, around the forward hooks of each tracked module that
        has some (``register_forward_hook``, a TransformerLens hook): one hook first, that notes
        the output its forward returned, and one last, that sees what the hooks made of it. An
        output is recorded as the forward returns it, before its hooks run; one that a hook
        replaced or changed in place (steering, ablation, patching) is named in a warning at the
        end of the forward. Global forward hooks (``register_module_forward_hook``) run before
        each module's own: while there are some, every tracked module is looked at, its output
        noted by a global hook put first. Modules without forward hooks get nothing; later
        forwards neither, unless forward hooks were added since (:meth:`_probe_new_hooks`):
        ``only`` then holds the ids of the modules to look at (None: every one)."""
        self._note_forward_hooks(set(torch.nn.modules.module._global_forward_hooks))
        seen: dict[int, Any] = {}
        replaced = self._hook_replaced
        # the global forward hooks (torch.nn.modules.module.register_module_forward_hook) run
        # before each module's own: the output is noted by a global hook put first among them
        global_hooks = torch.nn.modules.module._global_forward_hooks
        tracked = {id(module) for _, module in self._modules}

        def first(module: Any, args: Any, out: Any) -> None:
            seen[id(module)] = _output_state(out)

        def first_global(module: Any, args: Any, out: Any) -> None:
            if id(module) in tracked:
                seen[id(module)] = _output_state(out)

        if global_hooks:
            handle = torch.nn.modules.module.register_module_forward_hook(first_global)
            global_hooks.move_to_end(handle.id, last=False)
            self._hook_probes.append(handle)
        for name, module in self._modules:
            if (not module._forward_hooks and not global_hooks) or (only is not None and id(module) not in only):
                continue

            def last(module: Any, args: Any, out: Any, _name: str = name) -> None:
                before = seen.pop(id(module), None)
                if before is not None and not _same_output(_output_state(out), before) and _name not in replaced:
                    replaced.append(_name)

            if not global_hooks:
                self._hook_probes.append(module.register_forward_hook(first, prepend=True))
            self._hook_probes.append(module.register_forward_hook(last))

    def _note_forward_hooks(self, global_seen: set[int]) -> None:
        """Note the forward hooks of the tracked modules as they are now (``_hooks_seen``, and
        their numbers for :meth:`_forward_hooks_changed`), with ``global_seen``, the ids of the
        global forward hooks."""
        modules = [m for _, m in self._modules]
        dicts = list(map(_FORWARD_HOOKS, modules))
        self._hooks_seen = ({id(m): set(d) for m, d in zip(modules, dicts)}, global_seen)
        self._hook_counts = (modules, list(map(len, dicts)))

    def _forward_hooks_changed(self) -> bool:
        """Whether a forward hook may have been added to a tracked module, or a global one, since
        the last look (at the start of a captured forward, after a hook handle of any kind was
        created: ``Tensor.register_hook`` in a training loop, activation checkpointing, FSDP).
        torch's handle ids only grow, so a hook registered since has an id of at least the
        counter noted then; a changed number of hooks (one removed, a hook dict replaced or
        filled by hand) is looked at too. False means none was: a few C-level passes over the
        tracked modules (about 20 us at 500 modules, where comparing every hook set costs about
        150 us); True means :meth:`_probe_new_hooks` compares the hook sets."""
        modules, counts = self._hook_counts
        dicts = list(map(_FORWARD_HOOKS, modules))  # (a dict put in place of a module's own too)
        try:
            return list(map(len, dicts)) != counts or self._hooks_since(self._hook_id_seen, dicts)
        except TypeError:  # a key that is not a handle id (put there by hand): compare the sets
            return True

    def _hooks_since(self, since: int, dicts: Any = None) -> bool:
        """Whether a tracked module (of :meth:`_note_forward_hooks`), or the global forward
        hooks, hold a forward hook registered since torch's hook counter was ``since`` (handle
        ids only grow). ``dicts``: the tracked modules' hook dicts where the caller has them
        already. TypeError: a hook dict holds a key that is not a handle id."""
        if dicts is None:
            dicts = map(_FORWARD_HOOKS, self._hook_counts[0])
        return (max(torch.nn.modules.module._global_forward_hooks, default=-1) >= since
                or max(map(max, filter(None, dicts)), default=-1) >= since)

    def _probe_new_hooks(self) -> None:
        """At the start of a captured forward after the first, when a hook was registered since
        the last look (:meth:`_forward_hooks_changed`): probe the tracked modules that got
        forward hooks since (every one for a new global forward hook), so that one replacing an
        output is named at the end of this forward, with the forward during which they were
        added (``_hooks_added_in``, :meth:`_note_hooks_added`) where they were not added between
        forwards."""
        modules, global_seen = self._hooks_seen
        if set(torch.nn.modules.module._global_forward_hooks) - global_seen:
            only = None
        else:
            only = {id(m) for _, m in self._modules if m._forward_hooks.keys() - modules.get(id(m), set())}
            if not only:
                self._note_forward_hooks(global_seen)
                return
        self._hooks_later = True
        self._hooks_later_added_in = self._hooks_added_in
        self._add_hook_probes(only)

    def _note_hooks_added(self, raised: bool = False) -> None:
        """At the end of a forward: note it in ``_hooks_added_in`` when forward hooks were
        added to tracked modules (or global ones) during it, by the model or a hook (the
        earliest such forward until the next captured one probes them): its rows, not only
        those of the forwards after it, may hold outputs before such a hook, and the warning of
        the next captured forward says so. One comparison of torch's hook counter unless a
        hook handle was created since the start of the forward. ``raised``: at the start of the
        forward after a captured one that raised (``_open_forward``), whose end did not run; a
        hook added since its start may have been added after it."""
        since = self._hook_id_at_start
        if self._hooks_added_in is not None or self._hooks_seen is None or _RemovableHandle.next_id == since:
            return
        # (a hook of a handle made during this forward has an id of at least the counter at its
        # start; one put into a hook dict by hand is not told apart from one added between forwards)
        try:
            added = self._hooks_since(since)
        except TypeError:  # a key that is not a handle id (put there by hand)
            added = False
        if added:
            self._hooks_added_in = (self._open_forward if raised else self._core.n_forwards - 1, raised)

    def _remove_hook_probes(self) -> None:
        while self._hook_probes:
            self._hook_probes.pop().remove()

    def _warn_replaced_outputs(self) -> None:
        later, self._hooks_later = self._hooks_later, False
        added_in, self._hooks_later_added_in = self._hooks_later_added_in, None
        found = [n for n in self._hook_replaced if n not in self._hook_warned]
        self._hook_replaced = []
        if not found:
            return
        self._hook_warned.update(found)
        names = [n or "(the tracked model)" for n in found]
        shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
        if later:
            points = sorted(hp for hp in self._sinks if self._module_of(hp) in found
                            and not re.sub(r"^(#\d+)?\.?", "", hp[len(self._module_of(hp)):]).startswith("input"))
            shown += (f" (hook points {', '.join(repr(hp) for hp in points[:4])}{', ...' if len(points) > 4 else ''})"
                      if points else "")
            when = (f"forward {self._core.n_forwards - 1} (they were added after the first captured forward, and "
                    "the rows captured there from this forward on hold the output before them)") if added_in is None \
                else (f"forward {self._core.n_forwards - 1} (they were added during forward {added_in[0]}"
                      f"{', which raised, or after it' if added_in[1] else ''}, after the first captured forward's "
                      f"hooks were looked at, and the rows captured there from forward {added_in[0]} on may hold the "
                      "output before them)")
        else:
            when = "the first captured forward"
        warn_at_caller(
            f"forward hooks of the tracked modules {shown} replaced or changed their output in {when}: "
            "activationscope records a module's output as its forward returns it, before its forward hooks "
            "run (its own and the global ones of register_module_forward_hook), so what is recorded there is not "
            "what the model passed on (a steered, ablated or patched value). "
            "To record the value the hooks made, track the module that receives it (capture='input' of the next "
            "module, or the next TransformerLens hook point, e.g. blocks.1.hook_resid_pre after "
            "blocks.0.hook_resid_post)" + (
                ". With CaptureMode.REFERENCE a record is the module's own tensor: where a hook changed that "
                "tensor in place, the in-memory record holds the hooks' value (and is named as changed in place "
                "when read)" if self._reference_mode else ""),
            CaptureWarning,
        )

    def _warn_sequence_first(self) -> None:
        """At the first captured forward of a store capture or of one with reductions, name the
        tracked modules built sequence-first (``batch_first=False``: ``nn.LSTM`` / ``GRU`` /
        ``RNN``, ``nn.Transformer``, ``nn.MultiheadAttention`` and the layers holding one, by
        default) that recorded hook points (stored, or reduced): rows are the first dimension of
        each activation, so theirs are positions with the batch among the features, which the
        row table lists as samples and reductions take as observations."""
        by_module: dict[str, list[str]] = {}
        for hp in self._sinks:
            if self.writer is not None or self._reduction_names.get(hp):
                by_module.setdefault(self._module_of(hp), []).append(hp)
        found, swapped = [], []
        for name, module in self._modules:
            first = getattr(module, "batch_first", None)
            if first is None:  # (nn.TransformerEncoderLayer / DecoderLayer: their attention's)
                first = getattr(getattr(module, "self_attn", None), "batch_first", None)
            if first is False and by_module.get(name):
                # (taken as token rows of the model's (batch, pos): rows are (pos, batch) pairs, said below)
                token = [hp for hp in sorted(by_module[name]) if self._sinks[hp].row_kind == 1]
                other = [hp for hp in sorted(by_module[name]) if hp not in token]
                if token:
                    swapped.append(f"{name!r} ({type(module).__name__}): {', '.join(token)}")
                if other:
                    found.append(f"{name!r} ({type(module).__name__}): {', '.join(other)}")
        if swapped:
            warn_at_caller(
                "tracked modules built sequence-first (batch_first=False) take and give (pos, batch, ...) "
                f"tensors, taken as token rows of the (batch, pos) of the mask (rows='token': of the model's first "
                f"input): {'; '.join(swapped)}. Their rows are (position, sample) pairs, listed in the token row "
                "table with the two swapped (its sample_id is the position, its pos the sample), and a mask with "
                "padding drops the wrong ones. Build the module "
                "with batch_first=True (the same state_dict loads) and feed it (batch, pos, ...) inputs, or exclude= "
                "it",
                CaptureWarning,
            )
        if found:
            warn_at_caller(
                "tracked modules built sequence-first (batch_first=False) take and give (pos, batch, ...) "
                f"tensors: {'; '.join(found)}. Rows are the first dimension of each activation, so these hook "
                "points store (and reduce over) one row per position, with the batch among the features, and the "
                "row table lists those rows as samples. Build the module with batch_first=True (the same "
                "state_dict loads) and feed it (batch, pos, ...) inputs, or exclude= it",
                CaptureWarning,
            )
        # a recurrent module built batch-first still gives its hidden state layer-first, and a
        # PackedSequence's fields in packed order: their rows are not samples either
        recurrent = []
        for name, module in self._modules:
            if isinstance(module, torch.nn.RNNBase) and module.batch_first and by_module.get(name):
                odd = [hp for hp in sorted(by_module[name]) if _recurrent_layout(hp, name) is not None]
                if odd:
                    recurrent.append(f"{name!r} ({type(module).__name__}): {', '.join(odd)}")
        if recurrent:
            warn_at_caller(
                f"tracked recurrent modules give tensors whose first dimension is not the batch: "
                f"{'; '.join(recurrent)}. A hidden state (output.1, h_n and c_n, and the hx input) is "
                "(num_layers * num_directions, batch, hidden) whatever batch_first says: its rows are layers, with "
                "the batch among the features. A PackedSequence (output.0 of a packed input) is stored field by "
                "field: data is one row per real token in time-major order of the samples sorted by length, "
                "batch_sizes one per time step, sorted_indices and unsorted_indices a permutation. Neither is one "
                "row per sample, yet where the number of rows equals the batch the row table lists them as samples "
                "(their labels and ids). Track the module that takes the padded output (after "
                "pad_packed_sequence), or one of your own that returns h_n.transpose(0, 1); or exclude= it",
                CaptureWarning,
            )

    def _warn_half_accumulators(self) -> None:
        """A custom reduction (TorchScript or eager) runs in the captured dtype: one whose
        accumulator is float16 or bfloat16 after its first batch gets a CaptureWarning naming it,
        its hook point and the fix, once per hook point (a sum in bfloat16 stops growing:
        256 + 1 is 256 there). Looked at at the end of each forward for the hook points with
        custom reductions that have not yet shown their accumulators."""
        with self._new_hook_point_lock:
            pending = [(n, self._reduction_names[n], self._reduction_objects[n], self._sinks.get(n))
                       for n in sorted(self._half_pending)]
        found = []
        for hook_point, names, objects, sink in pending:
            if sink is None:
                continue
            shown = True
            for i, (red_name, red) in enumerate(zip(names, objects)):
                if str(red.kind) not in ("script", "eager"):
                    continue
                value = sink.reduction_result(i).get("value")
                if value is None:  # no batch yet (every row so far was padding)
                    shown = False
                elif value.dtype in (torch.float16, torch.bfloat16):
                    found.append((hook_point, red_name, value.dtype))
            if shown:
                self._half_pending.discard(hook_point)
        if found:
            where = "; ".join(f"{red_name!r} of hook point {hp!r} ({str(dtype).replace('torch.', '')})"
                              for hp, red_name, dtype in found[:8]) + ("; ..." if len(found) > 8 else "")
            warn_at_caller(
                f"custom reduction(s) with a half-precision accumulator: {where}. A custom reduction runs in the "
                "captured dtype, and a sum or mean kept in float16 / bfloat16 stops growing once its total is a few "
                "hundred (bfloat16) or thousand (float16) times a batch's (in bfloat16, 256 + 1 is 256), without "
                "an error; convert inside the function (x.double().sum(0)) or give init= a float64 tensor. An "
                "accumulator of exact values (a running max or min) may stay in that dtype",
                CaptureWarning,
            )

    def _warn_nonfinite_reductions(self) -> None:
        """At the close: a custom reduction (TorchScript or eager) whose result holds NaN or inf
        that its function made of finite rows and a finite accumulator (``made_nonfinite``: a
        division by zero, the log of 0, an overflow of its dtype) gets a CaptureWarning naming
        it, its hook point and how many values are NaN or inf; the result is kept as the
        function returned it. NaN or inf of the rows carried along is not warned about, as the
        built-in reductions carry it (like torch). Once per tracker, after its store is closed."""
        if self._warned_nonfinite:
            return
        self._warned_nonfinite = True
        with self._new_hook_point_lock:
            pending = [(n, names, self._reduction_objects[n], self._sinks.get(n))
                       for n, names in sorted(self._reduction_names.items())]
        found = []
        for hook_point, names, objects, sink in pending:
            if sink is None:  # (a resumed hook point not captured again)
                continue
            for i, (red_name, red) in enumerate(zip(names, objects)):
                # (read through the sink, under its lock: a forward the close left running in
                # another thread may still be updating the reduction and its flags)
                if str(red.kind) not in ("script", "eager") or not sink.reduction_made_nonfinite(i):
                    continue
                value = sink.reduction_result(i).get("value")
                n_bad = 0 if value is None or value.layout != torch.strided else int(
                    torch.isfinite(value).logical_not().sum())
                if n_bad:
                    found.append((hook_point, red_name, n_bad, value.numel()))
        if found:
            where = "; ".join(f"{red_name!r} of hook point {hp!r} ({n_bad} of {n} values NaN or inf)"
                              for hp, red_name, n_bad, n in found[:8]) + ("; ..." if len(found) > 8 else "")
            warn_at_caller(
                f"custom reduction(s) whose result holds NaN or inf made of finite rows: {where}. Their rows and "
                "accumulators were finite, so the function made these values (a division by zero, the log or sqrt of "
                "a value <= 0, an overflow of the accumulator's dtype); they are kept, and stored, as it returned "
                "them. Fix the function (e.g. clamp before log, x.double() for sums); NaN or inf of the rows "
                "themselves is carried along without a warning, as the built-in reductions carry it",
                CaptureWarning,
            )

    def _next_counted_id(self) -> int:
        """The id the running counter gives the next sample: the samples fed before it (those a
        policy skipped too, not the forwards that described the same samples again)."""
        return self._n_samples + self._skipped_samples - self._repeated_samples

    def _on_forward_end(self) -> None:
        self._warn_head_first_found()
        self._warn_side_sample_rows()
        if self._train_phase:
            self._check_training_stop()
        # (_open_forward stays set until the forward is recorded: an error or a Ctrl-C before
        # that leaves it open, and the close takes it out of the reductions as one that raised)
        self._stop_watching()
        self._unprobe_dropouts()
        if self._hook_probes:
            self._remove_hook_probes()
            self._warn_replaced_outputs()
        self._note_hooks_added()
        if self._core.outside_calls and not self._warned_outside:
            self._warn_outside_calls()
        if not self._core.capturing:
            self._open_forward = None
            # (a forward the policy skipped: its samples still count, unless they are the last
            # forward's again, same_samples=True; a same_samples=True forward after it continues them)
            if self._core.n_forwards > 0 and not (self._batch or {}).get("same_samples"):
                batch = self._batch or {}
                n = _batch_size(batch, self._core.batch_size)
                self._last_ids = (_copy_ids(batch.get("sample_ids")), self._next_counted_id(), n)
                self._skipped_samples += n
            self._unrecorded_forward = None
            return
        if not self._first_checked and self._stored is not None:
            # the first captured forward of a resume gave every hook point it will: the
            # stored ones must all be there, before any row of it is committed
            self._first_checked = True
            missing = sorted(self._stored.difference(self._sinks).difference(self._intermittent))
            if missing:
                self._refuse(missing, [])
            if self._reductions_only:
                self._check_reductions_continued()
        if self._n_captured == 0:  # the first captured forward gave its hook points
            self._check_reduction_patterns(list(self._sinks), "the first captured forward gave")
            if self.writer is not None or self._reduction_names:
                self._warn_sequence_first()
        if self._stop_learnt and not (self._core.stopped or self._core.past_stop) and not self._warned_stop:
            self._warned_stop = True
            warn_at_caller(
                f"forward {self._core.n_forwards - 1} of the tracked model ran to its end without reaching the stop "
                "point of stop_after_last=True (the last hook point of the first captured forward, after as many "
                "captures): its hook points differ from the first forward's. Its capture is whole, but a forward "
                "whose extra hook points come after the stop point would lose them; use stop_after_last=False "
                "for models whose hook points change from forward to forward",
                CaptureWarning,
            )
        if self._aliases:
            self._check_aliases()
        if self._half_pending:
            self._warn_half_accumulators()
        self._n_captured += 1
        batch = self._batch or {}
        n = _batch_size(batch, self._core.batch_size)
        if self._batch is not None:
            self._check_batch_size(self._batch)
        if self._batch is not None and self._batch is self._last_batch and not self._warned_stale_batch:
            self._warn_stale_batch(self._batch)
        self._last_batch = self._batch
        if batch.get("attention_mask") is not None and not self._warned_mask:
            self._warn_mask_unused(batch["attention_mask"])
        elif self.scope.rows == "token" and not self._warned_mask:
            self._warn_token_rows_unused()
        if self.scope.rows == "token" and batch.get("attention_mask") is None:
            self._warn_model_mask_padding()
            self._warn_image_token_rows()
        elif batch.get("attention_mask") is None and self._model_mask is not None:
            self._warn_padding_in_sample_rows()
        if self._media_params and not self._warned_media_tower:
            self._warn_media_tower_token_rows(batch)
        if self._position_bias_found:
            self._leave_row_table_position_bias()
        if self._target_param is not None and not self._warned_target:
            self._warn_target_token_rows(batch)
        if self.writer is not None and self.scope.rows == "token":
            self._warn_generation_step(batch)
        if self.writer is not None and not (self._reductions_only and self._refused is not None):
            # (a refused resume of a store of reductions only records nothing: its commits would
            # replace the stored reductions' files, which the store as found lists)
            ids = batch.get("sample_ids")  # None: the writer numbers the samples on from its last
            if ids is None and (self._skipped_samples or self._repeated_samples):
                # the running counter counts the skipped forwards' samples too (SAMPLE_N), and not
                # the same_samples=True forwards' (stored rows of samples counted before): the
                # samples of data rows 32..47 are ids 32..47, whatever forwards were stored
                start = self._next_counted_id()
                ids = torch.arange(start, start + n, dtype=torch.int64)
            mask = batch.get("attention_mask")
            if mask is None and self.scope.rows == "token":
                mask = self._core.auto_token_mask
                mask = mask if mask.dim() == 2 else None
            # the same set_batch description as the previous forward (sticky), or one that says
            # so (same_samples=True): the same samples again
            again = ids is not None and self._batch is not None and (
                self._batch is self._ids_batch or bool(self._batch.get("same_samples")))
            self._ids_batch = self._batch
            first = int(getattr(self.writer, "next_sample_id", 0)) if ids is None else 0
            self._last_ids = (_copy_ids(ids), first, n)
            extra: dict[str, Any] = {"described_again": True} if again else {}
            if self._skipped_samples or self._repeated_samples or batch.get("same_samples"):
                # the counter after this forward, which the store records for a resume (without
                # skips and repeats the writer's own: its samples counted on)
                extra["next_id"] = self._next_counted_id() + (0 if batch.get("same_samples") else n)
            if extra:  # (optional keywords: a registered writer of an older protocol takes neither)
                extra = {k: v for k, v in extra.items() if _takes_keyword(self.writer.add_batch, k)}
            if self._reductions_only:  # the rows each hook point reduced, from the start of the capture
                self._reduced_rows = {hp: self._reduction_base.get(hp, 0) + int(self._sinks[hp].n_rows)
                                      for hp in self._reduced_rows}
                extra["reduced_rows"] = dict(self._reduced_rows)
            add, columns = self.writer.add_batch, batch.get("columns") or {}
            # (recorded and no longer open in one line: a Ctrl-C between the two would leave the
            # store holding a forward whose rows the close takes out of the reductions)
            lost, self._open_forward = add(n_samples=n, sample_ids=ids, token_mask=mask, columns=columns, **extra), None
            if lost and self._refused is None:  # a refused resume commits nothing
                self._warn_row_table_lost(lost)
            if self._expert_paths is None:
                self._expert_paths = _expert_paths(self.model)
                self._expert_set = frozenset(self._expert_paths)
            if self._expert_paths:
                self._leave_row_table_experts()
            self.writer.maybe_commit()
        else:
            self._open_forward = None
            self._last_ids = (_copy_ids(batch.get("sample_ids")), self._next_counted_id(), n)
        if batch.get("same_samples"):
            self._repeated_samples += n
        self._n_samples += n
        self._unrecorded_forward = None
        # (REFERENCE records changed in place are looked for when the records are read and at
        # the end of the `with` block, not here: a check here reads every new record's version
        # counter after every forward)

    def _warn_generation_step(self, batch: Mapping[str, Any]) -> None:
        """Warn (once per capture) when a ``rows='token'`` store capture numbers the samples of a
        forward of one token per sample, ``(batch, 1)``, that follows a forward of longer sequences
        of as many samples without a description of its samples: the mark of a generation step
        with a key-value cache (``generate()``), whose rows continue the prompt's samples but get
        new ids from the running counter."""
        auto = self._core.auto_token_mask
        shape = (int(auto.shape[0]), int(auto.shape[1])) if auto.dim() == 2 else None
        last, self._last_token_shape = self._last_token_shape, shape
        if (self._warned_step or shape is None or last is None or shape[1] != 1 or last[1] <= 1
                or shape[0] != last[0] or batch.get("sample_ids") is not None or batch.get("same_samples")):
            return
        self._warned_step = True
        k = self._core.n_forwards - 1
        warn_at_caller(
            f"forward {k} of the tracked model fed one token per sample, (batch, pos) = {shape}, right after a "
            f"forward of {last}, and no set_batch described its samples, so the running counter gave its rows new "
            "sample ids. If it is a generation step with a key-value cache (generate()), its rows continue the "
            "samples of the forward before: give their ids once before generate() with "
            "tracker.set_batch(sample_ids=...) (it is sticky: every step keeps them), or describe each step from a "
            "forward pre-hook of the model with set_batch(same_samples=True)", CaptureWarning)

    def _warn_stale_batch(self, batch: Mapping[str, Any]) -> None:
        """Warn (once per capture) when a forward keeps the last forward's ``set_batch``
        description (it is sticky) with samples the running counter numbers anew: its padding
        mask, or its per-sample columns, then describe another batch of data (``set_batch`` was
        not called before this batch). Not for ``same_samples=True`` steps or given sample ids
        (the same samples again, as documented), nor for a mask without padding."""
        if batch.get("same_samples") or batch.get("sample_ids") is not None or self._stale_checked is batch:
            return
        self._stale_checked = batch  # (one look per description: the mask is not read again each forward)
        mask, columns = batch.get("attention_mask"), batch.get("columns") or {}
        what = []
        # the mask matters where rows do (a store, reductions: in-memory records are kept whole),
        # and only when it fits this forward (one that does not is refused at the token rows)
        rows_matter = self.writer is not None or any(self._reduction_names.values())
        fits = mask is not None and mask.dim() == 2 and int(mask.shape[1]) in (
            int(self._core.second_dim), int(self._core.batch_size))
        if rows_matter and fits and not bool(mask.all()):
            what.append("attention_mask (with padding)")
        if columns and self.writer is not None:  # (columns go to a store's row table only)
            what.append("columns " + ", ".join(repr(c) for c in list(columns)[:4]) + (", ..." if len(columns) > 4 else ""))
        if not what:
            return
        self._warned_stale_batch = True
        k = self._core.n_forwards - 1
        warn_at_caller(
            f"forward {k} of the tracked model kept the set_batch description of an earlier forward (set_batch is "
            f"sticky), so the {' and '.join(what)} given there were applied to forward {k}'s new samples (numbered "
            "on by the counter). "
            "If this forward fed another batch of data, its padding and columns are wrong: call set_batch(...) "
            "before each batch; if it continued the same samples (a generation step), pass same_samples=True "
            "(or the same sample_ids=)", CaptureWarning)

    def _check_skipped_counted(self, batch: Mapping[str, Any]) -> None:
        """Refuse a forward that ``SAMPLE_N`` skips in a store capture when nothing tells its
        number of samples: no tensor in the model's input (texts, images tokenized inside the
        model) and no ``set_batch`` description. A captured forward learns it from its first
        activation; a skipped one, counted as 0, would give every later sample a default id
        that is not its place in the data."""
        if (self.scope.capture_policy is not CapturePolicy.SAMPLE_N or int(self._core.batch_size) >= 0
                or batch.get("same_samples") or batch.get("attention_mask") is not None
                or batch.get("sample_ids") is not None or batch.get("columns")):
            return
        raise ArgumentValueError(
            f"forward {self._core.n_forwards - 1} of the tracked model is skipped by CapturePolicy.SAMPLE_N "
            f"(sample_every={self.scope.sample_every}), and its input holds no tensor, so its samples cannot be "
            "counted: the default sample ids of the later forwards would not be their place in the data. Describe "
            "every forward, skipped ones too, with tracker.set_batch(sample_ids=...) (or a per-sample column)"
        )

    def _check_batch_size(self, batch: Mapping[str, Any]) -> None:
        """Refuse a ``set_batch`` that describes another number of samples than the forward's
        batch: the first dimension of its first input, once known, or its second dimension (a
        sequence-first input, ``(pos, batch, ...)``, as ``nn.LSTM`` and ``nn.Transformer``
        take by default)."""
        n = _batch_size(batch, self._core.batch_size)
        actual = int(self._core.batch_size)
        if actual >= 0 and n != actual and n != int(self._core.second_dim):
            what = ("attention_mask" if batch.get("attention_mask") is not None else
                    "sample_ids" if batch.get("sample_ids") is not None else
                    f"column {next(iter(batch.get('columns') or {'?': 0}))!r}")
            raise ArgumentValueError(
                f"set_batch({what}=...) describes {n} samples, but the forward's batch has {actual} (the first "
                "dimension of its first input; its second dimension, the batch of a sequence-first input, is "
                f"{'absent' if int(self._core.second_dim) < 0 else int(self._core.second_dim)}); call set_batch "
                "with one entry per sample before each forward"
                + (f" (the batch is {actual // n} times the samples described: generate() with num_beams= or "
                   "num_return_sequences= runs that many rows per prompt, each prompt's rows next to each other; "
                   "describe every row: attention_mask=mask.repeat_interleave(k, 0), sample ids of its own for "
                   "each row and the prompt's as a column, e.g. prompt=ids.repeat_interleave(k))"
                   if n > 0 and actual > n and actual % n == 0 else "")
            )

    def _leave_row_table_experts(self) -> None:
        """Store the sample-row hook points of mixture-of-experts experts off the row table from
        their first forward: an expert's rows are the tokens routed to it, and where their number
        equals the batch's samples (in every forward, with a fixed routing or short captures)
        the store would label them with the samples' ids and columns. Warned once per capture."""
        leave = getattr(self.writer, "leave_row_table", None)
        if leave is None:
            return
        marked = []
        widest: int | None = None  # (_widest_other, once per forward where it is needed)
        for name, sink in self._sinks.items():
            if name in self._experts_decided or sink.row_kind == -1:
                continue
            if sink.row_kind != 0 or not self._is_expert(name):
                self._experts_decided.add(name)
                continue
            # its rows are tokens where its first activation has fewer dims than a hook point's
            # that is no expert's (the (batch, pos, d) hidden states flattened to (tokens, d) for
            # the routing), or none tells; where none has more (features (batch, d) everywhere:
            # a dense mixture, as a multi-gate one, MMoE, gives every expert every sample) its
            # rows are the samples'
            widest = self._widest_other() if widest is None else widest
            first = self._first_shapes.get(name)
            if widest >= 0 and isinstance(first, tuple) and widest <= len(first):
                self._experts_decided.add(name)
                continue
            followed = leave(name)
            if followed is None:
                continue  # (no array yet: an alias, or its rows are not written yet)
            self._experts_decided.add(name)
            if followed:
                marked.append(name)
        if not marked:
            return
        shown = ", ".join(repr(n) for n in marked[:6]) + (f" and {len(marked) - 6} more" if len(marked) > 6 else "")
        k = self._core.n_forwards - 1
        warn_at_caller(
            f"hook point(s) {shown} of mixture-of-experts experts (modules in a ModuleList / ModuleDict named "
            f"'experts') gave as many rows as the batch's samples in forward {k}, but an expert's rows are the "
            "tokens routed to it: they are stored off the sample row table (store.follows_row_table() is False for "
            "them; their rows are read by their own index, without sample ids or columns). Track the "
            "mixture-of-experts block itself for rows of the samples' tokens",
            CaptureWarning,
        )

    def _leave_row_table_position_bias(self) -> None:
        """Warn about the hook points of a relative position bias (T5's ``relative_attention_bias``:
        ``(query, key, heads)``, its input ``(query, key)``) first captured in this forward,
        where rows matter (a store, or the hook point's reductions), and store them off the
        sample row table: they have no batch dimension, and with as many samples as positions
        their first two sizes are those of the ``(batch, pos)`` mask, so they would be listed as
        the samples' tokens (or, with as many samples as queries, as the samples)."""
        found, self._position_bias_found = self._position_bias_found, {}
        leave = getattr(self.writer, "leave_row_table", None) if self.writer is not None else None
        shown = []
        for name, shape in found.items():
            if self.writer is None and not self._reduction_names.get(name):
                continue  # (records in memory are whole tensors)
            if leave is not None and name not in self._aliases:
                leave(name)
            shown.append(f"{name!r} {shape}")
        if not shown:
            return
        warn_at_caller(
            f"hook point(s) {', '.join(shown)} of a relative position bias (a module named "
            "'relative_attention_bias', as T5's: (query, key, heads), computed from the positions alone) have no "
            "batch dimension: their rows are queries, not samples nor tokens, whatever their first two sizes "
            "(those of the (batch, pos) mask where the batch has as many samples as positions). They are stored "
            "off the sample row table (store.follows_row_table() is False for them; rows read by their own "
            "index, without sample ids or columns), and reductions take their queries as observations. Leave "
            "them out with exclude_hook_points=['*relative_attention_bias.*'] (or token_rows={hook_point: True} "
            "if such a hook point does start with (batch, pos))",
            CaptureWarning,
        )

    def _warn_target_token_rows(self, batch: Mapping[str, Any]) -> None:
        """Warn (once per capture) when a model of its own whose forward takes a second sequence
        (a parameter named like ``tgt``, ``trg``, ``decoder_input``: a home-made encoder-decoder)
        is given one of as many positions as the mask token rows are taken with, and that mask
        has padding (or the batch has per-token columns): the hook points over the second
        sequence start with the mask's ``(batch, pos)`` too, so they are taken as token rows
        picked by the first sequence's padding and listed with its positions and columns."""
        self._target_shape, shape = None, self._target_shape
        if shape is None or self._nn_seq2seq or isinstance(self._token_rows, Mapping):
            return  # (torch.nn's stacks are checked by their own masks; token_rows= decided)
        if getattr(self.model.__dict__.get("forward"), "n_sites", 1) > 1:
            return  # (another tracker on the model: one per side, each with its own mask, as documented)
        if self.writer is None and not any(self._reduction_names.values()):
            return  # (in memory, records are whole tensors: no rows taken)
        mask = self._rows_mask()
        if mask is None or tuple(mask.shape) != shape:
            return
        given = batch.get("attention_mask")
        columns = [k for k, v in (batch.get("columns") or {}).items()
                   if tuple(getattr(v, "shape", ())[:2]) == shape and len(getattr(v, "shape", ())) == 2]
        if (given is None or bool(given.all())) and not columns:
            return  # (every position of both: rows (sample, position) of whichever sequence, as listed)
        token = [n for n, sink in self._sinks.items() if sink.row_kind == 1]
        if not token:
            return
        self._warned_target = True
        key = self._target_param[1] if self._target_param else "tgt"
        shown = ", ".join(repr(n) for n in token[:6]) + (f" and {len(token) - 6} more" if len(token) > 6 else "")
        what = (f"the mask of tracker.set_batch, {tuple(mask.shape)}, with padding" if given is not None
                and not bool(given.all()) else f"the per-token column(s) {', '.join(map(repr, columns))}")
        warn_at_caller(
            f"forward {self._core.n_forwards - 1} of {type(self.model).__name__} took a second sequence, {key!r} "
            f"(batch, pos) = {shape}, of as many positions as {what}, which describes its first input: hook points "
            f"over {key!r} (a decoder's) start with the same (batch, pos) and are taken as token rows picked by the "
            f"first sequence's padding and listed with its positions and columns. Taken as token rows: {shown}. "
            "Capture each sequence with its own mask (one tracker per side, nested, each with its own store, "
            "include= that side's modules and its own set_batch(attention_mask=...)), or pass "
            "token_rows={pattern: False} for one row per sample of the other side's hook points "
            "(token_rows= given, or another tracker on the model: not warned; warned once per capture)",
            CaptureWarning,
        )

    def _is_expert(self, name: str) -> bool:
        """Whether hook point ``name`` is one of a mixture-of-experts expert (its module or one under it)."""
        parts = self._module_of(name).split(".")
        return any(".".join(parts[:i]) in self._expert_set for i in range(1, len(parts) + 1))

    def _widest_other(self) -> int:
        """The most dims of a first activation of a hook point of this capture that is no
        expert's; -1 when there is none."""
        return max((len(s) for n, s in self._first_shapes.items() if isinstance(s, tuple) and not self._is_expert(n)),
                   default=-1)

    def _warn_row_table_lost(self, lost: Mapping[str, tuple[int, int]]) -> None:
        """Warn once per hook point whose store rows stopped following the row table in this
        forward (its module returned no tensor, or another number of rows, in it)."""
        k = self._core.n_forwards - 1
        for name in sorted(set(lost) - self._warned_row_table):
            self._warned_row_table.add(name)
            got, expected = lost[name]
            first = self._shared_rows.get(name)
            if first is None and got == 1 < expected:
                # first seen in a forward of one sample, (1, ...), and one row at each call since,
                # this forward of more samples included: a tensor shared by the batch too (noted
                # for a later change of its shape, _note_shared_rows)
                sink, shape = self._sinks.get(name), self._first_shapes.get(name)
                if (sink is not None and isinstance(shape, tuple) and len(shape) >= 2 and shape[0] == 1
                        and int(sink.n_rows) <= int(sink.n_calls)):
                    first = self._shared_rows[name] = shape
            shared = got == 1 < expected and first is not None
            replaced = got == 0 and self._forward_replaced(self._module_of(name))
            warn_at_caller(
                f"hook point {name!r} recorded {got} row(s) in forward {k} of the tracked model, where the row "
                f"table got {expected} ("
                + ("its module's forward was replaced while it was tracked, by one that no longer runs the capture: "
                   "an assignment to module.forward, as accelerate's add_hook_to_module / remove_hook_from_module "
                   "make; prepare the model before attaching the tracker" if replaced else
                   "its module returned no tensor there, or another number of rows")
                + "): from "
                f"there on its store rows no longer follow the sample row table (store.follows_row_table({name!r}) "
                "is False; its rows are read by their own index, without sample ids or columns). "
                + (f"Its activation {first} is one tensor shared by the batch's samples (its first dimension 1 is "
                   "broadcast over them, as T5's position bias (1, heads, query, key), which a generate() step "
                   f"grows by one key): leave it out with exclude_hook_points=[{name!r}] (its module's other "
                   "outputs still captured), or capture it into a store of its own" if shared else
                   "Track only hook points whose module returns a tensor in every forward (exclude= its module), "
                   "or capture it into a store of its own"),
                CaptureWarning,
            )

    def _note_shared_rows(self, exc: BaseException) -> None:
        """Name the cause of a store array's changed feature shape where its hook point is a
        tensor shared by the batch (first dimension 1, named at the end of the forward where
        it first recorded one row for many samples): the advice of the native error (an
        attention mask, one image size) is no fix for it."""
        found = re.match(r"hook point '(.+?)'(?: changed its feature shape|: reduction '.*' .*got rows with "
                         r"feature shape)", str(exc))
        name = found.group(1) if found else None
        if name not in self._shared_rows or not hasattr(exc, "add_note"):
            return
        exc.add_note(
            f"{name!r} is one tensor shared by the batch's samples, not one row per sample: its "
            f"activation was {self._shared_rows[name]} for a batch of more samples (its first dimension 1 broadcast "
            "over them), as T5's position bias (1, heads, query, key), which each generate() step grows by one "
            f"key. Leave it out of the capture: exclude_hook_points=[{name!r}] (or a pattern for every layer's, as "
            f"{re.sub(r'[.][0-9]+[.]', '.*.', name, count=1)!r}); its module's other outputs are still captured")

    def _note_unmasked_first(self, exc: BaseException) -> None:
        """Name the cause of a store array's changed feature shape under a set_batch mask where
        its hook point was first captured in a forward whose set_batch gave no mask (the mask
        given after that forward, or from the second batch on): it was made an array of one row
        per sample then, and a later mask cannot make it token rows; leaving it out is no fix."""
        found = re.match(r"hook point '(.+?)' changed its feature shape from .*The attention mask given to set_batch",
                         str(exc), re.S)
        name = found.group(1) if found else None
        if name not in self._first_unmasked or not hasattr(exc, "add_note"):
            return
        exc.add_note(
            f"{name!r} was first captured in forward {self._first_unmasked[name]} of the tracked model, when "
            "tracker.set_batch had given no attention_mask: it was stored one row per sample, padding inside, from "
            "there on. set_batch describes the forwards after it: call tracker.set_batch(attention_mask=mask) "
            "before each forward, the first included, with that batch's mask, and capture again "
            "(store_options={'overwrite': True})")

    def _note_broadcast_token_rows(self, exc: BaseException) -> None:
        """Name the cause of a token-row hook point refused for its mask where it is a tensor
        shared by the batch (first dimension 1) taken as token rows at a first forward of one
        sample, whose (1, pos) mask it started with: the native error's advice (a mask for each
        forward, generation steps) is no fix for it."""
        found = re.match(r"hook point '(.+?)' stores token rows and needs an attention mask .*?; got activation "
                         r"\((\d+), .*? and mask \((\d+), ", str(exc))
        if found is None or not hasattr(exc, "add_note"):
            return
        name, rows, n = found.group(1), int(found.group(2)), int(found.group(3))
        first = self._first_shapes.get(name)
        if rows != 1 or n <= 1 or not isinstance(first, tuple) or not first or first[0] != 1:
            return
        exc.add_note(
            f"{name!r} is one tensor shared by the batch's samples, not one row per token: its first dimension "
            f"stays 1 in a batch of {n} samples (broadcast over them, as the (1, pos) position_ids and (1, pos, "
            "head_dim) rotary cos / sin a Llama model gives each layer). It was taken as token rows because its "
            f"first activation, {first}, came in a forward of one sample and started with that forward's (1, pos) "
            f"mask. Leave it out of the capture: exclude_hook_points=[{name!r}] (or a pattern for every layer's, as "
            f"{re.sub(r'[.][0-9]+[.]', '.*.', name, count=1)!r}); its module's other hook points are still captured")

    def _check_aliases(self) -> None:
        """Refuse a forward in which a store's alias hook point was not captured as often as its
        target (its module returned no tensor): the alias is stored as its target's array, so
        it would show rows it never had. Checked before the forward is recorded."""
        key = self._core.alias_mismatch()
        if not key:
            return
        public = key if key in self._aliases else (rename_hook_point(key, self._hook_point_paths, self._side) or key)
        target = self._aliases.get(public, "?")
        raise CaptureError(
            f"hook point {public!r} is stored once, as an alias of {target!r} (the same tensor when first "
            f"captured), but in forward {self._core.n_forwards - 1} it did not get the rows {target!r} got (its "
            "module was not called, or returned no tensor); pass exclude= for the module of one of them (or "
            "include= only one)" + (". The store keeps every forward before this one" if self.writer is not None else "")
        )

    def _no_token_rows_shapes(self) -> str | None:
        """When no hook point stores token rows (and sample rows were not chosen): the first
        shapes of the hook points, shown for a warning given once (it marks it given); else None."""
        if not self._sinks or self._sample_rows_chosen or any(s.row_kind == 1 for s in self._sinks.values()):
            return None
        self._warned_mask = True
        shapes = {n: self._first_shapes[n] for n in self._sinks if n in self._first_shapes}
        return ", ".join(f"{n!r}: {s}" for n, s in list(shapes.items())[:6]) + (", ..." if len(shapes) > 6 else "")

    def _warn_mask_unused(self, mask: torch.Tensor) -> None:
        """Warn (once per capture) when set_batch's attention mask fits no hook point: none
        stores token rows, so padding is kept inside sample rows and the mask is ignored."""
        shown = self._no_token_rows_shapes()
        if shown is None:
            return
        shapes = [s for n, s in self._first_shapes.items() if n in self._sinks]
        pooled = bool(shapes) and all(isinstance(s, tuple) and len(s) <= 2 for s in shapes)
        if pooled:  # (batch, d) rows: already one per sample, with no position (nor padding) in them
            fate = ("every hook point is already one row per sample with no pos dimension (pooled, or of no "
                    "token), so it holds no padding and the mask is ignored. Pass token_rows=False (or no mask) "
                    "to say one row per sample is what you want; track a module of (batch, pos, ...) "
                    "activations for token rows")
        else:
            fate = ("so every hook point stores one row per sample with its padding inside and the mask is "
                    "ignored. Pass a mask of the activations' (batch, pos) shape (e.g. with a column for a token "
                    "the model prepends), or token_rows=False if one row per sample is what you want")
        warning = CaptureWarning(
            f"set_batch(attention_mask=...) of shape {tuple(mask.shape)} (batch, pos) matches no tracked hook point: "
            f"no activation starts with it ({{{shown}}}), " + (fate if not pooled else "and " + fate)
        )
        # what it is, for callers that say it in their own words (the command line)
        warning.reason, warning.mask_shape, warning.first_shapes = "mask_unused", tuple(mask.shape), f"{{{shown}}}"
        warn_at_caller(warning)

    def _note_model_mask(self, args: tuple, kwargs: dict) -> None:
        """(rows="token", in the root's Python frame) the ``attention_mask`` the tracked model
        is called with in this forward: a 2-D tensor, or None (and the type of its first
        argument, for the warning about a model given no tensor)."""
        first = args[0] if args else next(iter(kwargs.values()), None)
        text = isinstance(first, str) or (isinstance(first, (list, tuple)) and bool(first)
                                          and all(isinstance(x, str) for x in first))
        self._first_arg_type = type(first).__name__ if text else None
        if not self._warned_image_input and (self.writer is not None or self.scope.reductions is not None):
            # (in memory without reductions no rows are taken: nothing to warn about)
            wrapper = self.model.__dict__.get("forward")
            order = getattr(wrapper, "_acs_kw_order", ())
            t = compiled.first_input(args, kwargs, order)
            named = [k for k, v in zip(order, args) if v is t] or [k for k, v in kwargs.items() if v is t]
            media = t is not None and (t.dim() >= 4 or (named and named[0] in _MEDIA_INPUTS and t.dim() >= 2))
            self._image_input = (tuple(t.shape), named[0] if named else None) if media else None
            features = (t is not None and not media and t.dim() == 2 and (t.is_floating_point() or t.is_complex()))
            self._feature_input = (tuple(t.shape), named[0] if named else None) if features else None
        self._note_padding_mask(args, kwargs)

    def _note_padding_mask(self, args: tuple, kwargs: dict) -> None:
        """(in the root's Python frame) the 2-D ``attention_mask`` tensor the tracked model is
        called with in this forward, or None; not looked for once its padding was warned about."""
        if self._warned_model_mask:
            return
        mask = kwargs.get("attention_mask")
        if mask is None and self._mask_arg_index is not None and self._mask_arg_index < len(args):
            mask = args[self._mask_arg_index]
        self._model_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _note_root_call(self, args: tuple, kwargs: dict) -> None:
        """(in the root's Python frame) what the tracked model is called with in this forward:
        its ``attention_mask`` (``rows="token"``), and for an encoder-decoder model the masks of
        its two sequences, checked against the hook points stored as token rows."""
        if self.scope.rows == "token":
            self._note_model_mask(args, kwargs)
        elif self._notes_padding:  # (set with _mask_arg_index)
            self._note_padding_mask(args, kwargs)
        if self._seq2seq:
            self._note_sequences(args, kwargs)
        if self._target_param is not None and not self._warned_target:
            i, key = self._target_param
            t = args[i] if i < len(args) else kwargs.get(key)
            self._target_shape = tuple(t.shape[:2]) if isinstance(t, torch.Tensor) and t.dim() >= 2 else None

    def _note_sequences(self, args: tuple, kwargs: dict) -> None:
        """The masks of an encoder-decoder forward's sequences: the encoder's (its
        ``attention_mask``, else all of its input's positions) and the decoder's
        (``decoder_attention_mask``, else all of ``decoder_input_ids`` / ``decoder_inputs_embeds``
        / ``labels``' positions; None when the forward gives the decoder no input of its own, as
        a BART forward given ``input_ids`` alone makes it from them). Then each hook point
        already stored as token rows is checked against the mask of this forward."""
        given = dict(zip(self._seq2seq or (), args))
        given.update(kwargs)

        def positions(keys: tuple[str, ...], mask_key: str) -> torch.Tensor | None:
            mask = given.get(mask_key)
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                return mask.detach().to("cpu", torch.bool)
            for key in keys:
                t = given.get(key)
                if isinstance(t, torch.Tensor) and t.dim() >= 2:
                    return torch.ones(tuple(t.shape[:2]), dtype=torch.bool)
            return None

        decoder = positions(("decoder_input_ids", "decoder_inputs_embeds", "labels"), "decoder_attention_mask")
        encoder = positions(("input_ids", "inputs_embeds"), "attention_mask")
        self._seq_masks = (encoder, decoder)
        if decoder is None or not self._token_sides or not self._core.capturing:
            return
        mask = self._rows_mask()
        for name, side in self._token_sides.items():
            self._check_token_side(name, side, None, mask)

    def _note_stack_call(self, side: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """(a forward pre-hook of a torch.nn encoder or decoder stack) the mask of its sequence
        in this forward: the inverse of its key padding mask (``src_key_padding_mask`` /
        ``tgt_key_padding_mask``, True at padding), else every position of its input; a
        decoder's ``memory_key_padding_mask`` gives the encoder's where no encoder stack ran. At a decoder's call both are known: each hook
        point already stored as token rows is checked against the mask of this forward."""
        if not self._core.capturing or self._open_forward is None:
            return  # (a stack called on its own, outside a forward of the tracked model: not recorded)
        given = dict(zip(_positional_names(type(module).forward)[1:], args))
        given.update(kwargs)
        first = _stack_batch_first(module)
        if side == "encoder":
            self._seq_masks = (_sequence_mask(given, "src", "src_key_padding_mask", first), self._seq_masks[1])
            return
        encoder = self._seq_masks[0]
        if encoder is None and isinstance(given.get("memory_key_padding_mask"), torch.Tensor):
            # (no encoder stack ran: the memory's padding, where the decoder is given it; a memory
            # without one, as the decoder's own input in a decoder-only model, tells nothing)
            encoder = _sequence_mask(given, "memory", "memory_key_padding_mask", first)
        self._seq_masks = (encoder, _sequence_mask(given, "tgt", "tgt_key_padding_mask", first))
        if self._seq_masks[1] is None or not self._token_sides:
            return
        mask = self._rows_mask()
        for name, side_of in self._token_sides.items():
            self._check_token_side(name, side_of, None, mask)

    def _rows_mask(self) -> torch.Tensor | None:
        """The (batch, pos) mask token rows are taken with in the current forward."""
        mask = (self._batch or {}).get("attention_mask")
        if mask is None and self.scope.rows == "token":
            mask = self._core.auto_token_mask
            mask = mask if mask.dim() == 2 else None
        return mask

    def _check_token_side(self, name: str, side: str, shape: tuple[int, ...] | None,
                          mask: torch.Tensor | None) -> None:
        """Refuse token rows of an encoder-decoder hook point taken with the other sequence's
        mask. Token rows are the positions of the mask given to ``set_batch`` (or of the
        model's first input, ``rows="token"``), and a decoder activation ``(batch, T, ...)``
        starts with the encoder mask's ``(batch, S)`` whenever ``T == S``: its rows would be
        the decoder positions where the encoder has tokens, listed with the encoder's
        positions and token columns. A decoder hook point needs the decoder's mask; an encoder
        one is refused when the mask is the decoder's and not the encoder's. For torch.nn's
        stacks, a mask that is a key padding mask as given (True at padding) is refused, and a
        hook point outside both stacks (``side == "either"``) is refused where the two
        sequences have one length but other padding (its side cannot be told)."""
        encoder, decoder = self._seq_masks
        if decoder is None or mask is None:
            return

        def same(a: torch.Tensor, b: torch.Tensor | None) -> bool:
            return b is not None and tuple(a.shape) == tuple(b.shape) and bool(torch.equal(a.to("cpu", torch.bool), b))

        nn = self._nn_seq2seq is not None and not self._seq2seq
        names = (("the inverse of src_key_padding_mask, else every position of src",
                  "the inverse of tgt_key_padding_mask, else every position of tgt") if nn else
                 ("attention_mask, else every position of input_ids",
                  "decoder_attention_mask, else every position of decoder_input_ids"))
        sides = {"encoder": encoder} if side == "encoder" else {"decoder": decoder} if side == "decoder" else \
            {"encoder": encoder, "decoder": decoder}
        inverted = [k for k, m in sides.items() if nn and m is not None and same(~mask.to("cpu", torch.bool), m)]
        if inverted:
            what = (f"the {inverted[0]}'s key padding mask as given (True at padding, {names[inverted[0] == 'decoder']} "
                    "being the positions of its tokens)")
        elif side == "either":
            if encoder is None or not (tuple(mask.shape) == tuple(encoder.shape) == tuple(decoder.shape)) \
                    or torch.equal(encoder, decoder):
                return
            what = ("one of two sequences of one length and other padding, the encoder's "
                    f"({names[0]}) and the decoder's ({names[1]}), and which one a module outside "
                    "nn.TransformerEncoder / nn.TransformerDecoder (and their layers) is over cannot be told")
        elif side == "decoder":
            if same(mask, decoder):
                return
            what = (f"the encoder's ({names[0]})" if same(mask, encoder) else
                    f"not the decoder's ({names[1]})" if nn else
                    f"not the decoder's ({names[1]}; a mask "
                    "of your own for the decoder, as labels != -100 where the model is given no "
                    "decoder_attention_mask, is confirmed with token_rows= True below)")
        else:
            if not same(mask, decoder) or same(mask, encoder):
                return
            what = f"the decoder's ({names[1]}), not the encoder's"
        given = "tracker.set_batch(attention_mask=...)" if (self._batch or {}).get("attention_mask") is not None \
            else "rows='token' (every position of the model's first input)"
        where = f"its activation {shape} starts" if shape is not None else "its activation starts"
        on = ("outside the encoder and decoder stacks" if side == "either" else f"on the {side} side")
        if inverted:
            fix = ("Describe the batch with the positions of the tokens: "
                   "tracker.set_batch(attention_mask=~key_padding_mask)")
            rows = "padding positions, the tokens left out"
        else:
            fix = ("Capture each side with its own mask: one tracker per side on the same model, nested (each "
                   "with its own store, include= that side's modules, and its own set_batch(attention_mask=...)), see "
                   + docs_page("docs/usage/capture.md", "Encoder-decoder models and other models of two sequences"))
            rows = (f"{side}'s activations at the other sequence's tokens, listed with that sequence's positions and "
                    "columns" if side != "either" else "activations at one sequence's tokens whichever it is on")
        raise CaptureError(
            f"hook point {name!r} is {on} of the encoder-decoder model {type(self.model).__name__}, "
            f"and {where} with the (batch, pos) {tuple(mask.shape)} of the mask its token rows are taken with "
            f"({given}), which in forward {self._core.n_forwards - 1} is {what}: its rows would be the "
            f"{rows}. {fix}; or pass token_rows={{{name!r}: False}} for one "
            f"row per sample (padding included), or token_rows={{{name!r}: True}} if this mask is meant for it"
        )

    def _check_sequence_first(self, name: str, shape: tuple[int, ...], mask: torch.Tensor | None) -> None:
        """Refuse token rows of a hook point of a torch.nn module built sequence-first, or inside
        one (``batch_first=False``: nn.Transformer's default, its stacks and layers,
        ``nn.MultiheadAttention``, ``nn.LSTM`` / ``GRU`` / ``RNN``; :func:`_sequence_first`): its
        activation is ``(pos, batch, ...)``, which starts with the ``(batch, pos)`` mask only
        where the two are equal, and its rows would be taken with the mask transposed. The
        module named is the outermost such one below the model (the model itself where it is
        the only one)."""
        if mask is None or tuple(shape[:2]) != tuple(mask.shape):
            return
        path = self._module_of(name)
        if _batch_first_part(name, path, self._module_by_name().get(path)):
            return
        parts = path.split(".") if path else []
        found = []
        for k in range(len(parts) + 1):
            where = ".".join(parts[:k])
            try:
                module = self.model.get_submodule(where)
            except (AttributeError, TypeError):
                break
            if _sequence_first(module):
                found.append((where, module))
        if not found:
            return
        where, module = next(((w, m) for w, m in found if w), found[0])
        kind = "encoder-decoder model" if self._seq2seq or self._nn_seq2seq else "model"
        raise CaptureError(
            f"hook point {name!r} is inside {where or 'the model'!r} ({type(module).__name__}) of the {kind} "
            f"{type(self.model).__name__}, built sequence-first (batch_first=False): its activation {shape} "
            f"is (pos, batch, ...), and it starts with the (batch, pos) {tuple(mask.shape)} of the mask its token "
            "rows are taken with only because the batch has as many samples as positions: its rows would be taken "
            "with the mask transposed. Build the model with batch_first=True (the same state_dict loads) and feed "
            f"it (batch, pos, ...) inputs, or pass token_rows={{{name!r}: False}} (one row per position, the batch "
            "among the features)"
        )

    def _side_of(self, name: str) -> str:
        """The side of an encoder-decoder model hook point ``name`` is on: ``"encoder"`` for a
        module inside ``model.get_encoder()`` (a module both stacks share, as T5's embedding,
        at its first call of a forward: the encoder runs first), and for the encoder's positions
        inside the decoder (a cross-attention's key and value projections, the encoder states a
        decoder module takes), else ``"decoder"`` (the decoder's modules, and those after it, as
        the language-model head). For torch.nn's stacks: ``"encoder"`` inside an encoder stack,
        ``"decoder"`` inside a decoder stack (its cross-attention's output too) or for an
        ``nn.Transformer``'s output, and ``"either"`` outside both (a model's own embeddings
        and head: which sequence it is over cannot be told from the model)."""
        if self._stacks is None and self._nn_seq2seq is not None and not self._seq2seq:
            self._stacks = tuple({id(m) for stack in stacks for m in stack.modules()}  # type: ignore[assignment]
                                 for stacks in self._nn_seq2seq)
        if self._stacks is None:
            get_encoder, get_decoder = getattr(self.model, "get_encoder", None), getattr(self.model, "get_decoder", None)
            ids: list[set[int]] = []
            for get in (get_encoder, get_decoder):
                try:
                    stack = get() if callable(get) else None
                except Exception:  # noqa: BLE001 - a model without one
                    stack = None
                ok = isinstance(stack, torch.nn.Module) and stack is not self.model
                ids.append({id(m) for m in stack.modules()} if ok else set())
            self._stacks = (ids[0], ids[1])
        encoder, decoder = self._stacks
        path = self._module_of(name)
        module = self._module_by_name().get(path)
        if _encoder_positions(name, path, module):
            return "encoder"  # (in the decoder, but over the encoder's positions: a cross-attention's keys)
        if self._nn_seq2seq is not None and not self._seq2seq:
            if module is not None and (id(module) in decoder or isinstance(module, torch.nn.Transformer)):
                return "decoder"
            return "encoder" if module is not None and id(module) in encoder else "either"
        if module is None or id(module) not in encoder:
            return "decoder"
        if id(module) in decoder and "#" in name[len(path):]:
            return "decoder"  # (a later call of a module both stacks share)
        return "encoder"

    def _warn_model_mask_padding(self) -> None:
        """Warn (once per capture) when ``rows="token"`` stored every position of a forward
        whose model was given an ``attention_mask`` with padding that ``set_batch`` did not
        describe: the padded positions went into the store (and reductions) as token rows."""
        mask = self._model_mask
        if mask is None or self._warned_model_mask:
            return
        if self.writer is None and not any(self._reduction_names.values()):
            return  # (in memory, records are whole tensors: no rows taken)
        auto = self._core.auto_token_mask
        if auto.dim() != 2 or tuple(mask.shape) != tuple(auto.shape):
            return
        if not any(s.row_kind == 1 for s in self._sinks.values()):
            return
        k, shape, numel = self._core.n_forwards - 1, tuple(mask.shape), mask.numel()

        def say(n_pad: int) -> None:
            warn_at_caller(
                f"forward {k} of the tracked model was given attention_mask= with padding ({n_pad} of {numel} "
                f"positions are {_padding_value(mask)}), but rows='token' with no attention_mask in "
                f"tracker.set_batch stores every position of its (batch, pos) = {shape}: the padded positions are "
                "stored as token rows and enter "
                "the reductions. Give the mask to tracker.set_batch(attention_mask=mask) before each forward to "
                "leave padding out (warned once per capture)",
                CaptureWarning,
            )

        self._count_padding(mask, say)

    def _warn_padding_in_sample_rows(self) -> None:
        """Warn (once per capture) when ``rows="auto"`` stored or reduced a forward whose model
        was given an ``attention_mask`` with padding that ``set_batch`` did not describe: the hook
        points starting with its ``(batch, pos)`` keep one row per sample, ``(pos, ...)`` with the
        padded positions inside, and their reductions count those positions (a hook point whose
        first forward had another batch size too, but not a ``(1, pos, ...)`` tensor shared by the
        batch, also where its first forward had one sample; padding as :func:`_padding_count`
        counts it)."""
        mask = self._model_mask
        if mask is None or self._warned_model_mask or mask.is_complex():
            return
        # (a CPU mask is counted here once, before the hook points, at every forward until warned;
        # the count goes to _count_padding, which would count it again)
        n_pad = int(_padding_count(mask)) if mask.device.type == "cpu" else None
        if n_pad == 0:
            return
        shape = tuple(mask.shape)
        stored = self.writer is not None

        def shared(n: str) -> bool:
            # (1, pos, ...) for a batch of more samples at its first call; or first seen in a forward of
            # one sample and one row at each call since, this forward of more samples included (a
            # per-sample hook point has recorded more rows than calls by now; one not called in this
            # forward kept none of its padding)
            if n in self._shared_rows:
                return True
            sink = self._sinks[n]
            return self._first_shapes[n][0] == 1 and int(sink.n_rows) <= int(sink.n_calls)

        # (a hook point of sample rows (batch, pos, ...): its pos is the mask's in every forward, its batch this
        # forward's, whatever the first forward's was; not one shared by the batch, (1, pos, ...))
        padded = [n for n in self._sinks
                  if (stored or self._reduction_names.get(n))
                  and isinstance(self._first_shapes.get(n), tuple) and len(self._first_shapes[n]) >= 2
                  and self._first_shapes[n][1] == shape[1]
                  and (self._first_shapes[n][0] == shape[0] or not shared(n))
                  and _token_rows_for(n, self._token_rows, self._hook_names) is not False]
        if not padded:
            return
        k, numel = self._core.n_forwards - 1, mask.numel()
        shown = ", ".join(repr(n) for n in padded[:4]) + (", ..." if len(padded) > 4 else "")
        where = "stored and reduced" if stored and any(self._reduction_names.get(n) for n in padded) else (
            "stored" if stored else "reduced")

        def say(n_pad: int) -> None:
            warn_at_caller(
                f"forward {k} of the tracked model was given attention_mask= with padding ({n_pad} of {numel} "
                f"positions are {_padding_value(mask)}), but tracker.set_batch was given no attention_mask: {shown}, "
                "starting with its "
                f"(batch, pos) = {shape}, are {where} one row per sample with the padded positions inside. Give the "
                "mask to tracker.set_batch(attention_mask=mask) before each forward to store one row per real "
                "token, padding left out; or token_rows=False to keep each sample's padded sequence as one row "
                "(warned once per capture)",
                CaptureWarning,
            )

        self._count_padding(mask, say, n_pad)

    def _count_padding(self, mask: torch.Tensor, say: Any, n_pad: int | None = None) -> None:
        """Count the 0 positions of the model's ``attention_mask`` of this forward and call
        ``say(count)`` (the warning, once per capture) when there are any. A CPU mask is counted
        now (``n_pad``: its count, where the caller has it already); a CUDA mask's count is
        copied to pinned host memory without waiting for the device (no synchronization per
        forward on the capture's path) and read at a later forward's end, once the device has
        got there, or at the capture's close (:meth:`_read_padding_counts`)."""
        self._read_padding_counts(wait=False)
        if self._warned_model_mask:
            return
        if not _counts_padding_later(mask):
            n_pad = int(_padding_count(mask)) if n_pad is None else n_pad
            if n_pad:
                self._warned_model_mask = True
                say(n_pad)
            return
        if len(self._padding_counts) >= 8:  # (the device is many forwards behind: wait for the oldest)
            self._read_padding_counts(wait=True, oldest_only=True)
            if self._warned_model_mask:
                return
        self._padding_counts.append((*_count_zeros_later(mask), say))

    def _read_padding_counts(self, wait: bool, oldest_only: bool = False) -> None:
        """Read the pending device counts of :meth:`_count_padding` in forward order: those the
        device has finished (every one with ``wait``, the oldest only with ``oldest_only``);
        warn at the first with padding and drop the rest."""
        while self._padding_counts:
            count, ready, say = self._padding_counts[0]
            if not wait and not ready.query():
                return
            if wait:
                ready.synchronize()
            self._padding_counts.pop(0)
            n_pad = int(count)
            if n_pad and not self._warned_model_mask:
                self._warned_model_mask = True
                self._padding_counts.clear()
                say(n_pad)
                return
            if oldest_only:
                return

    def _warn_image_token_rows(self) -> None:
        """Warn (once per capture) when ``rows="token"`` without a ``set_batch`` mask took token
        rows from a model whose first tensor input has 4 dims or more (pixel values
        ``(batch, channels, height, width)``), or is an audio input by its Hugging Face name
        (``input_features`` ``(batch, mel bins, frames)``): its first two dims are not
        ``(batch, pos)``, so hook points starting with them (the image itself under
        ``capture="both"``) were stored one row per channel labelled as tokens, while the
        transformer's ``(batch, patches, d)`` hidden states were stored one row per sample. Also
        for a floating-point ``(batch, features)`` first input (an MLP's) when every hook point
        taken as token rows is 2-D: each feature was stored as a token row of one value."""
        if (self._image_input is None and self._feature_input is None) or self._warned_image_input:
            return
        if self.writer is None and not any(self._reduction_names.values()):
            return  # (in memory, records are whole tensors: no rows taken)
        taken = [n for n, s in self._sinks.items() if s.row_kind == 1]
        if not taken:
            return  # (no token rows: warned about as rows='token' finding none)
        k = self._core.n_forwards - 1
        shown = ", ".join(repr(n) for n in taken[:6]) + (f" and {len(taken) - 6} more" if len(taken) > 6 else "")
        if self._image_input is None:
            shape, param = self._feature_input
            if any(not isinstance(self._first_shapes.get(n), tuple) or len(self._first_shapes[n]) != 2 for n in taken):
                return  # (a hook point of (batch, pos, d): a sequence of values, one per position, embedded)
            self._warned_image_input = True
            warn_at_caller(
                f"rows='token' took (batch, pos) = {shape} from the model's first tensor input in forward {k}, "
                f"{param + ' ' if param else ''}of shape {shape}: floating-point (batch, features), not token ids "
                f"(batch, pos) or embeddings (batch, pos, d), so {shown} stored {shape[1]} token rows per sample, one "
                "value each, one per feature given as its pos. For one row per sample (an MLP's features), leave "
                "rows='token' out (rows='auto') or pass token_rows=False; for token rows of a sequence model, give "
                "tracker.set_batch(attention_mask=...) a mask of its (batch, pos) before each forward (warned once "
                "per capture)",
                CaptureWarning,
            )
            return
        shape, param = self._image_input
        self._warned_image_input = True
        warn_at_caller(
            f"rows='token' took (batch, pos) = {shape[:2]} from the first two dims of the model's first tensor "
            f"input in forward {k}, {param + ' ' if param else ''}of shape {shape}: not token ids (batch, pos) or "
            "embeddings (batch, pos, d) but an image (batch, channels, height, width), a video or audio (batch, "
            f"mel bins, frames), so {shown} stored {shape[1]} token rows per sample, one per entry of that second "
            "dim given as its pos, and the other hook points one row per sample. For one row per patch or frame, "
            "give tracker.set_batch(attention_mask=...) a mask of the hidden states' (batch, pos) (all True, e.g. "
            "torch.ones(batch, n_patches + 1, dtype=torch.bool) for a ViT's patches and class token) before each "
            "forward; or token_rows=False for one row per sample (warned once per capture)",
            CaptureWarning,
        )

    def _warn_media_tower_token_rows(self, batch: Mapping[str, Any]) -> None:
        """Warn (once per capture) when a model of token ids and images or audio (CLIP's
        ``forward(input_ids, pixel_values, ...)``) stored hook points of its vision or audio tower
        (a module path with ``vision``, ``visual``, ``image``, ``audio`` or ``speech`` in a name)
        as token rows: their activations start with the text's (batch, pos) only by coincidence
        (as many patches and a class token as text positions), so their rows are the image's
        patches picked by the text's mask and labelled with the text's positions."""
        if self.writer is None and not any(self._reduction_names.values()):
            return  # (in memory, records are whole tensors: no rows taken)
        chosen = self._token_rows if isinstance(self._token_rows, Mapping) else None  # (True: confirmed)
        taken = [n for n, sink in self._sinks.items() if sink.row_kind == 1
                 and _MEDIA_TOWER.search(self._module_of(n)) and not _token_rows_for(n, chosen, self._hook_names)]
        if not taken:
            return
        self._warned_media_tower = True
        mask = batch.get("attention_mask")
        if mask is None:
            mask = self._core.auto_token_mask
        tower = _MEDIA_TOWER.search(self._module_of(taken[0]))
        pattern = self._module_of(taken[0])[:tower.end(1)] + ".*"
        shown = ", ".join(repr(n) for n in taken[:6]) + (f" and {len(taken) - 6} more" if len(taken) > 6 else "")
        k = self._core.n_forwards - 1
        warn_at_caller(
            f"{type(self.model).__name__} takes token ids and {' / '.join(self._media_params)}, and in forward {k} "
            f"the hook points {shown} of its vision or audio tower were stored as token rows with the attention mask "
            f"(batch, pos) = {tuple(mask.shape)} of the token ids: their activations start with it only because the "
            "tower has as many positions (patches and a class token, frames) as the text, so their rows are the "
            "tower's positions picked by the text's mask, padding included or patches dropped, and labelled with "
            f"the text's positions. Pass token_rows={{{pattern!r}: False}} for one row per image, or track the tower "
            f"itself (track(model.{pattern[:-2]})) with a mask of its own (batch, pos); token_rows={{{pattern!r}: True}} "
            "confirms token rows (warned once per capture)",
            CaptureWarning,
        )

    def _warn_token_rows_unused(self) -> None:
        """Warn (once per capture) when ``rows="token"`` makes no hook point token rows: no
        activation starts with the (batch, pos) of the model's first input (a model that
        prepends a token has (batch, pos + 1, ...)), so every one is stored one row per sample."""
        shown = self._no_token_rows_shapes()
        if shown is None:
            return
        auto = self._core.auto_token_mask
        if self._first_arg_type is not None and auto.dim() != 2:  # text, which the model tokenizes itself
            warning = CaptureWarning(
                f"rows='token' found no token rows: the model was called with no tensor input (its first argument "
                f"is a {self._first_arg_type}, text the model tokenizes inside its forward), so there "
                f"is no (batch, pos) to take token rows from ({{{shown}}}), and every hook point stores one row per "
                "sample, padding included. Call the model with token ids (TransformerLens: tokens = "
                "model.to_tokens(texts), then model(tokens)) and, for padded texts, give their attention_mask to "
                "tracker.set_batch; or token_rows=False if one row per sample is what you want"
            )
            warning.reason, warning.first_shapes = "token_rows_unused", f"{{{shown}}}"
            warn_at_caller(warning)
            return
        first = f"(batch, pos) = {tuple(auto.shape)}" if auto.dim() == 2 else "no (batch, pos) (it has fewer than 2 dims)"
        warning = CaptureWarning(
            f"rows='token' found no token rows: the model's first tensor input has {first}, and no tracked "
            f"hook point's activation starts with it ({{{shown}}}), so every hook point stores one row per "
            "sample. Pass attention_mask= of the activations' (batch, pos) shape to tracker.set_batch (e.g. with "
            "a column for a token the model prepends), or token_rows=False if one row per sample is what you want"
        )
        warning.reason, warning.first_shapes = "token_rows_unused", f"{{{shown}}}"
        warn_at_caller(warning)

    def _forward_raised(self, at_exit: bool = False, warn: bool = True) -> None:
        """A root forward raised, the exception was caught and the capture went on: the hook
        points that ran before the error recorded that forward, the others did not. ``warn``
        False: the forward did not raise but was still running in another thread when the
        tracker closed (the close raises CaptureError about it instead)."""
        k, self._open_forward = self._open_forward, None
        self._n_raised += 1 if warn else 0  # (not a forward the close cut short in another thread)
        if self._aliases:
            self._core.alias_mismatch()  # the alias checks start again after this partial forward
        partial = self.writer.rows_since_last_batch() if self.writer is not None else {}
        if self._reductions_only:  # (no array: the rows its hook points reduced since the last recorded forward)
            partial = {hp: n for hp, last in self._reduced_rows.items() if hp in self._sinks and (
                n := self._reduction_base.get(hp, 0) + int(self._sinks[hp].n_rows) - last)}
        if not at_exit:  # the warning below says they leave the row table: not warned again
            self._warned_row_table.update(partial)
        where = f"hook points {sorted(partial)} recorded rows of it" if partial else \
            "the hook points that ran before the error recorded it"
        batch = self._batch or {}
        counted = ""
        if self.writer is not None and not at_exit and batch.get("sample_ids") is None and not batch.get("same_samples"):
            # (the running counter counts recorded forwards only: the next batch takes these ids)
            counted = (" Its samples were not counted: the default sample ids of the next forward start where this "
                       "one's did (right when it feeds the same batch again; when it feeds the next batch, pass "
                       "set_batch(sample_ids=...) so that ids stay the samples' places in the data).")
        if at_exit and self.writer is not None:  # the last forward: the store ends at the whole forward before it
            effect = ("The store and the reductions leave that partial forward out (both end at the last whole "
                      "forward)" + ("; in-memory records of it are kept." if self._in_memory else "."))
        elif at_exit:
            effect = "Their in-memory records and streaming reductions include that partial forward."
        elif self.writer is not None and not partial:  # (refused by a hook point before any stored a row)
            if warn:
                warn_at_caller(
                    f"forward {k} of the tracked model raised and the exception was caught inside the capture "
                    "before any hook point stored a row of it: the store leaves that forward out whole and its "
                    "rows still line up with the sample row table; in-memory records and streaming reductions "
                    "of hook points that ran before the error may include it. Check the batch before calling "
                    "the model to keep every hook point's records whole." + counted,
                    CaptureWarning,
                )
            return
        elif self._reductions_only:
            effect = ("Their reductions include that partial forward, and so do the rows the store counts for "
                      "them (it keeps reductions only).")
        else:
            effect = ("Their records (and streaming reductions) include that partial forward, and in a "
                      "store their rows no longer line up with the sample row table (follows_row_table "
                      "becomes False).")
        aliased = sorted(a for a, t in self._aliases.items() if t in partial)
        if aliased:  # stored once with their target: they show what it recorded of that forward
            effect += f" Hook points kept as aliases of others ({aliased}) show their target's records."
        if not warn:
            return
        warn_at_caller(
            f"forward {k} of the tracked model raised and the exception was caught inside the capture; "
            f"{where}, the others did not. {effect} To keep every hook point aligned, let the exception "
            "leave the `with` block (a store then commits every whole forward before it, status "
            "'incomplete', and resume=True continues) or check the batch before calling the model." + counted,
            CaptureWarning,
        )

    def _warn_changed(self, all_records: bool) -> None:
        changed = (rename_hook_point(n, self._hook_point_paths, self._side) for n in self._core.changed_references(all_records))
        for name in sorted(n for n in changed if n is not None):
            reduced = (" (its reductions are of the value at capture time, so they no longer match the record)"
                       if self._reduction_names.get(name) else "")
            warn_at_caller(
                f"hook point {name!r}: a tensor kept by CaptureMode.REFERENCE was changed in place "
                "after it was captured (its version counter moved), so the record no longer holds the "
                f"value at capture time{reduced}; use CaptureMode.SNAPSHOT (the default) for this model",
                CaptureWarning,
            )

    # ------------------------------------------------------------------ results
    @property
    def hook_points(self) -> list[str]:
        """Names of the hook points captured so far, in order of first capture."""
        return list(self._sinks)

    @property
    def activations(self) -> dict[str, list[torch.Tensor]]:
        """``{hook_point: [Tensor per captured call]}`` kept in memory.

        Each tensor has the activation's own shape and dtype (``storage_dtype`` if given and
        the activation is floating-point),
        on the host (or the activation's device with ``StoragePolicy.GPU``). SNAPSHOT records
        are the tracker's own copies (each owning exactly its bytes in a pooled staging slab,
        alive as long as you hold them); REFERENCE records are the model's tensors, detached
        (copies under ``torch.inference_mode``, where no version counter tells later
        in-place changes, and cast copies with ``storage_dtype``). A hook point whose tensor
        in a call is the very tensor another hook point recorded just before (an alias: a
        container's output and its last child's) shares that record's bytes for that call
        instead of copying them; its records are always its own calls'. Empty with
        ``StoragePolicy.DISK`` (read the store) and ``ReductionPolicy.STREAMING``. A hook point
        that was not captured raises :class:`~activationscope.errors.HookPointNotFoundError` (a
        ``KeyError``) naming those that were and the closest to it.
        """
        if self._reference_mode:
            self._warn_changed(all_records=True)
        with self._new_hook_point_lock:  # (another thread capturing may add a hook point meanwhile)
            sinks = list(self._sinks.items())
        return HookPointResults("activations", {name: sink.records() for name, sink in sinks}, hint=True)

    @property
    def reductions(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{hook_point: {reduction name: Tensor}}``: current values of the reductions.

        The main value of a reduction is under its name (``"mean"``, ``"var"``); other
        outputs of the same reduction under ``"<name>.<key>"`` (``"var.count"``,
        ``"hist.edges"``). Values cover every row captured so far (streaming; no row is
        kept for them), as recorded: with ``storage_dtype``, the cast values. A resumed
        store capture also covers the rows stored before (with nothing left to capture,
        only those).

        Returns
        -------
        dict of str to dict of str to Tensor
            On the host (CPU), fresh tensors (copies of the accumulators, taken between two
            batches when another thread captures meanwhile: never half of one). Keys, shapes and
            dtypes per kind, for rows ``(rows, *feature_shape)`` and the default
            ``per_feature=1`` (with ``per_feature=0`` read ``feature_shape`` as ``()``):

            - ``mean``, ``var``, ``std``, ``min``, ``max``, ``absmax``, ``l2``, ``nonzero``:
              ``(*feature_shape)``, float64 (``nonzero``: fraction of values != 0;
              ``min`` / ``max`` of integer rows: int64, exact); ``var`` and ``std`` also
              ``<name>.mean``;
            - ``hist``: ``<name>.counts`` ``(*feature_shape, bins)`` int64,
              ``<name>.edges`` ``(bins + 1,)`` float64, ``<name>.underflow`` /
              ``.overflow`` / ``.nan`` ``(*feature_shape)`` int64;
            - ``cov``: ``(D, D)`` float64 with ``D = prod(feature_shape)``, and
              ``<name>.mean`` ``(D,)``;
            - ``topk``: ``<name>.values`` ``(n, *feature_shape)`` float64, int64 of
              integer rows (``n = min(k, rows seen)``) and ``<name>.row_ids`` of the same shape, int64 (global store row of each
              value);
            - every reduction: ``<name>.count``, int64 scalar, observations per output value;
              a reduction that saw no rows has only that (0): no value is made up, and
              ``[name]`` raises :class:`ReductionNotFoundError` saying so;
            - custom TorchScript reductions: the accumulator the function returns (its own
              shape and dtype).

        Raises
        ------
        HookPointNotFoundError
            Indexing a hook point that has no reductions (the message lists those that do).
        """
        out: dict[str, dict[str, torch.Tensor]] = HookPointResults("reductions")
        with self._new_hook_point_lock:  # (another thread capturing may add a hook point meanwhile)
            reductions = [(name, names, self._reduction_objects[name]) for name, names in self._reduction_names.items()]
        for name, names, objects in reductions:
            if not names:
                continue
            out[name] = ReductionResults(name)
            sink = self._sinks.get(name)  # (none yet for a resumed hook point not captured again)
            for i, (red_name, red) in enumerate(zip(names, objects)):
                # copies taken under the sink's lock: a thread capturing meanwhile adds whole
                # batches, and later ones leave them alone
                result = sink.reduction_result(i) if sink is not None else None
                out[name].update(_flatten_result(red_name, red, result))
        return out

    def reduction_objects(self, hook_point: str) -> dict[str, Any]:
        """The live reduction objects of one hook point (for ``state()`` / ``merge()``).

        Parameters
        ----------
        hook_point : str
            A hook point of this tracker.

        Returns
        -------
        dict of str to reduction
            ``{name: reduction}`` (the objects themselves, not copies); ``{}`` for a hook point
            without reductions, or one not captured (yet).
        """
        return dict(zip(self._reduction_names.get(hook_point, []), self._reduction_objects.get(hook_point, [])))

    def _reduction_states(self) -> list[tuple[str, str, Any, int]]:
        """``[(hook point, name, reduction, rows)]`` of a capture that keeps reductions only (the
        source of its writer's commits, ``StoreWriter.set_reduction_source``): each reduction
        and the rows its state covers, those of the store it resumes included."""
        out = []
        for name in self._reduced_rows:
            sink = self._sinks.get(name)
            if sink is None:
                continue
            covered = self._reduction_base.get(name, 0) + int(sink.n_rows)
            sink.wait_reductions()  # (a commit reading the states on another stream than the forward's)
            for red_name, red in zip(self._reduction_names.get(name, []), self._reduction_objects.get(name, [])):
                out.append((name, red_name, red, covered))
        return out

    def _write_reductions(self) -> None:
        if self._reductions_only and hasattr(self.writer, "set_reduction_source"):
            return  # (the close's commit stores them, with the forwards it commits)
        for name in self._reduction_names:
            sink = self._sinks.get(name)
            covered = self._reduction_base.get(name, 0) + (sink.n_rows if sink is not None else 0)
            for red_name, red in zip(self._reduction_names.get(name, []), self._reduction_objects.get(name, [])):
                self.writer.add_reductions(name, red_name, red, n_rows=covered)

    @property
    def resume_from(self) -> int:
        """Samples of the data the store already held when this tracker attached
        (``resume=True``), each counted once: skip that many samples of your data, and the
        default sample ids continue from it. In a generation capture (``same_samples=True``
        steps) the store holds more sample rows than that, a prompt's rows at each step.
        0 for a new store or an in-memory capture."""
        return self._resume_from

    @property
    def n_forwards(self) -> int:
        """Forwards of the tracked model seen while attached (captured or not)."""
        return self._core.n_forwards

    @staticmethod
    def attached_to(model: torch.nn.Module) -> list["Tracker"]:
        """The trackers of this process attached now to ``model`` or to one of its modules, in
        no set order: those of `with` blocks still open, and those attached by :meth:`attach`
        and not removed, a variable naming them or not (a notebook cell that calls ``attach()``
        and is run again leaves the earlier tracker attached: it records every forward, or
        holds its store, until its :meth:`remove`).

        Parameters
        ----------
        model : torch.nn.Module
            The model (or module) to look at.

        Returns
        -------
        list[Tracker]

        Example
        -------
        >>> for tracker in Tracker.attached_to(model):  # doctest: +SKIP
        ...     tracker.remove()
        """
        ids = {id(m) for m in model.modules()}
        with _ATTACHED_LOCK:
            found = list(_ATTACHED)
        return [t for t in found if t._attached and (t._module_ids & ids or id(model) in t._tree_ids)]

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return f"<Tracker {type(self.model).__name__} {len(self._modules)} modules, {len(self._sinks)} hook points, {state}>"


def _in_torch(forward: Any) -> bool:
    """Whether ``forward`` (a bound method) is defined in torch itself."""
    return str(getattr(getattr(forward, "__func__", None), "__module__", "")).startswith("torch.")


def _python_frame(forward: Any, note: Any = None) -> Any:
    """``forward`` called from one Python frame of this module (which TorchDynamo traces).
    ``note(args, kwargs)``, when given, sees the arguments of each eager call first."""
    if note is None:
        def forward_of_tracked_model(*args: Any, **kwargs: Any) -> Any:
            return forward(*args, **kwargs)
    else:
        def forward_of_tracked_model(*args: Any, **kwargs: Any) -> Any:
            if not torch.compiler.is_compiling():
                note(args, kwargs)
            return forward(*args, **kwargs)

    return forward_of_tracked_model


# Hugging Face's names of a model's image, video and audio inputs: their first two dims are not
# the (batch, pos) of tokens (pixel values (batch, channels, height, width), Whisper's log-mel
# features (batch, mel bins, frames), wav2vec2's raw audio (batch, samples))
_MEDIA_INPUTS = frozenset({"pixel_values", "pixel_values_videos", "input_features", "input_values"})


def _expert_paths(model: torch.nn.Module) -> tuple[str, ...]:
    """The module paths of ``model``'s mixture-of-experts experts: the children of an
    ``nn.ModuleList`` / ``nn.ModuleDict`` whose name is ``experts`` (Switch Transformers'
    ``mlp.experts.expert_0``, ``moe.experts.3`` of research code), each called with the tokens
    routed to it."""
    containers = {name for name, m in model.named_modules()
                  if name.rpartition(".")[2] == "experts" and isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))}
    return tuple(name for name, _m in model.named_modules() if name.rpartition(".")[0] in containers)


# a module path of a vision or audio tower (CLIP's vision_model, LLaVA's vision_tower); group 1
# ends at the end of the first such name
_MEDIA_TOWER = re.compile(r"^((?:[^.]*\.)*?[^.]*(?:vision|visual|image|audio|speech)[^.]*)(?:\.|$)", re.IGNORECASE)


def _keyword_order(forward: Any) -> tuple[str, ...]:
    """The parameters of ``forward`` that a keyword argument can fill, in their order (none
    when its signature cannot be read): a root forward called with keywords only takes its
    batch from the first of them given a tensor, as a positional call would."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in params if p.kind in kinds)


def _recurrent_layout(hook_point: str, module: str) -> str | None:
    """For a hook point of the ``nn.RNNBase`` module ``module``: ``"hidden"`` for its hidden
    state (``output.1`` and below, the ``hx`` input), ``"packed"`` for a field of a
    PackedSequence it gives or takes (``output.0.data``, ...), None for the others."""
    rest = hook_point[len(module):] if module else "." + hook_point
    if rest.startswith("#"):
        rest = rest[rest.find("."):] if "." in rest else ""
    for side in (".output", ".input"):
        for hidden in (f"{side}.1", f"{side}.kw.hx"):
            if rest == hidden or rest.startswith(hidden + "."):
                return "hidden"
        for field in ("data", "batch_sizes", "sorted_indices", "unsorted_indices"):
            if rest == f"{side}.0.{field}":
                return "packed"
    return None


# Hugging Face names of a cross-attention module (T5, BART / Marian / Pegasus / Whisper, BERT as
# a decoder, others), of its key and value projections, and of the keyword inputs that carry the
# encoder's states or mask into the decoder's modules
_CROSS_ATTENTION = frozenset({"EncDecAttention", "encoder_attn", "crossattention", "cross_attn"})
_KEYS_VALUES = frozenset({"k", "v", "k_proj", "v_proj", "key", "value"})
_ENCODER_KEYWORDS = ("key_value_states", "encoder_hidden_states", "encoder_attention_mask",
                     "memory", "memory_key_padding_mask")  # (the last two: torch.nn's decoder stacks and layers)
# the inputs of torch.nn's cross-attention (an nn.TransformerDecoderLayer's multihead_attn) over
# the encoder's positions, and those of nn.Transformer
_NN_CROSS_INPUTS = ("key", "value", "key_padding_mask")
_NN_SOURCE_INPUTS = ("src", "src_key_padding_mask", "memory_key_padding_mask")

_NN_ENCODERS = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer)
_NN_DECODERS = (torch.nn.TransformerDecoder, torch.nn.TransformerDecoderLayer)


def _is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a FakeTensor (``torch._subclasses.fake_tensor``: what a forward
    under ``FakeTensorMode`` makes, as torch.compile and torch.export trace with): a shape and
    a device, no values."""
    fake = getattr(getattr(torch, "_subclasses", None), "fake_tensor", None)
    return fake is not None and isinstance(tensor, fake.FakeTensor)


def _has_no_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``__torch_dispatch__`` wrapper subclass without bytes of its own
    (``torch.Tensor._make_wrapper_subclass``: DTensor, torchao's tensors): its data pointer is
    null, its values are what its Python code computes (``has_no_bytes`` in csrc/sink.cpp)."""
    if not torch._C._dispatch_keys(tensor).has(torch._C.DispatchKey.Python) or tensor.numel() == 0:
        return False
    try:
        return tensor.data_ptr() == 0
    except RuntimeError:  # a storage that refuses to give its pointer holds none we may read
        return True


def _torch_stacks(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list[torch.nn.Module]] | None:
    """The outermost encoder stacks (``nn.TransformerEncoder``, or an
    ``nn.TransformerEncoderLayer`` in none) and decoder stacks (``nn.TransformerDecoder`` /
    ``nn.TransformerDecoderLayer``) of ``model``: an encoder-decoder of torch.nn's modules
    (``nn.Transformer``, or a model of one's own around them) where it has a decoder stack,
    whose layers' cross-attention reads the encoder's sequence; else None."""
    found: tuple[list[torch.nn.Module], list[torch.nn.Module]] = ([], [])
    inside: set[int] = set()
    for module in model.modules():  # (parents before their children)
        if id(module) in inside:
            continue
        for i, kinds in enumerate((_NN_ENCODERS, _NN_DECODERS)):
            if isinstance(module, kinds):
                found[i].append(module)
                inside.update(id(m) for m in module.modules())
    return found if found[1] else None


@functools.lru_cache(maxsize=64)
def _positional_names(forward: Any) -> tuple[str, ...]:
    """The names of the positional parameters of ``forward`` (a class's function, never a bound
    method: the cache would keep its module alive), computed once per function: a torch.nn
    stack's pre-hook reads them at each of its calls."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _sequence_first(module: torch.nn.Module) -> bool:
    """Whether ``module`` of torch.nn takes and gives ``(pos, batch, ...)`` tensors: built with
    ``batch_first=False`` (nn.Transformer, nn.MultiheadAttention, nn.LSTM / GRU / RNN), or an
    encoder / decoder stack or layer whose attention is."""
    if isinstance(module, (*_NN_ENCODERS, *_NN_DECODERS)):
        return not _stack_batch_first(module)
    first = getattr(module, "batch_first", None)
    return first is False and isinstance(module, (torch.nn.Transformer, torch.nn.MultiheadAttention,
                                                  torch.nn.RNNBase))


def _batch_first_part(hook_point: str, path: str, module: torch.nn.Module | None) -> bool:
    """Whether ``hook_point`` of the module at ``path`` is ``(batch, ...)`` also where the
    module is built sequence-first: a key padding mask it takes (``(batch, pos)``, as
    ``src_key_padding_mask``), or ``nn.MultiheadAttention``'s attention weights (``output.1``)."""
    rest = hook_point[len(path):] if path else "." + hook_point
    rest = rest[rest.find("."):] if rest.startswith("#") and "." in rest else rest
    if isinstance(module, torch.nn.MultiheadAttention) and (rest == ".output.1" or rest.startswith(".output.1.")):
        return True
    if not rest.startswith(".input."):
        return False
    first = rest[len(".input."):].split(".")
    if first[0] == "kw":
        param = first[1] if len(first) > 1 else ""
    elif first[0].isdigit() and module is not None:
        names = _positional_names(type(module).forward)[1:]
        param = names[int(first[0])] if int(first[0]) < len(names) else ""
    else:
        return False
    return "padding_mask" in param


def _stack_batch_first(stack: torch.nn.Module) -> bool:
    layer = stack.layers[0] if hasattr(stack, "layers") and len(stack.layers) else stack
    return bool(getattr(getattr(layer, "self_attn", None), "batch_first", True))


def _float_mask_advice(mask: torch.Tensor) -> str:
    """How to make a float attention mask (batch, pos) the bool one set_batch takes: ``mask.bool()``
    of 0 / 1 values, ``mask == 0`` of an additive mask (0 at tokens, a large negative value or
    -inf at padding), whose ``mask.bool()`` would keep the padding and drop the tokens."""
    if mask.is_complex() or not mask.numel():
        return "pass a bool mask, True at the real tokens"
    values = mask.detach().to("cpu", torch.float64)
    if bool(((values == 0) | (values == 1)).all()):
        return "pass mask.bool()"
    if bool((values <= 0).all()):
        return (f"its values are 0 and negative (down to {float(values.min()):g}), as in an additive mask (0 where a "
                "token is attended, a large negative value or -inf at padding): pass (mask == 0); mask.bool() would "
                "keep the padding and leave out the tokens")
    return ("pass (mask > 0) or mask.bool() where a nonzero value marks a real token, or (mask == 0) for an additive "
            "mask (0 at the real tokens)")


def _sequence_mask(given: dict[str, Any], key: str, padding_key: str, batch_first: bool) -> torch.Tensor | None:
    """The (batch, pos) positions of a torch.nn stack's sequence ``given[key]``, by its key
    padding mask ``given[padding_key]`` (bool: True at padding; float: -inf at padding), else
    all of them; None where neither tells."""
    padding = given.get(padding_key)
    if isinstance(padding, torch.Tensor) and padding.dim() == 2:
        padding = padding.detach().to("cpu")
        return ~padding if padding.dtype == torch.bool else ~torch.isneginf(padding)
    x = given.get(key)
    if isinstance(x, torch.Tensor) and not x.is_nested and x.dim() >= 2:
        shape = tuple(x.shape[:2]) if batch_first or x.dim() == 2 else (x.shape[1], x.shape[0])
        return torch.ones(shape, dtype=torch.bool)
    return None


def _encoder_positions(hook_point: str, path: str, module: torch.nn.Module | None) -> bool:
    """Whether a hook point of an encoder-decoder's decoder is over the encoder's positions:
    a cross-attention's key or value projection (or a module inside one), or an encoder state
    or mask a decoder module takes (by keyword, or by position: the parameter of that name)."""
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in _CROSS_ATTENTION and parts[i + 1] in _KEYS_VALUES:
            return True
    rest = hook_point[len(path):]
    rest = rest[rest.find("."):] if rest.startswith("#") and "." in rest else rest
    if not rest.startswith(".input."):
        return False
    encoder_inputs: tuple[str, ...] = _ENCODER_KEYWORDS
    if isinstance(module, torch.nn.MultiheadAttention) and parts[-1] == "multihead_attn":
        encoder_inputs = _NN_CROSS_INPUTS  # (an nn.TransformerDecoderLayer's cross-attention)
    elif isinstance(module, torch.nn.Transformer):
        encoder_inputs = _NN_SOURCE_INPUTS
    first = rest[len(".input."):].split(".")
    if first[0] == "kw":
        param = first[1] if len(first) > 1 else ""
    elif first[0].isdigit() and module is not None:
        try:
            params = [p for p in inspect.signature(module.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            return False
        i = int(first[0])
        param = params[i].name if i < len(params) else ""
    else:
        return False
    return param in encoder_inputs


def _seq2seq_parameters(forward: Any) -> tuple[str, ...] | None:
    """The positional parameters of an encoder-decoder model's forward (one that takes
    ``decoder_input_ids`` or ``decoder_inputs_embeds``, as Hugging Face's T5, BART, Marian,
    ``EncoderDecoderModel`` do), or None for any other forward."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if not any(p.name in ("decoder_input_ids", "decoder_inputs_embeds") for p in params):
        return None
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _counts_padding_later(mask: torch.Tensor) -> bool:
    """Whether the padding of ``mask`` is counted without waiting for its device (a CUDA mask)."""
    return mask.is_cuda


def _padding_count(mask: torch.Tensor) -> torch.Tensor:
    """The padded positions of the model's ``attention_mask``, an int64 0-dim tensor on its
    device (no wait for the device): its 0 entries, of a bool or integer mask or of a
    floating-point one of 0s and 1s (a Hugging Face mask cast to float); its negative entries,
    of any other floating-point mask (additive: 0 at the real tokens, -inf or the dtype's
    lowest value at the padding)."""
    zero = mask == 0
    if not mask.is_floating_point():
        return zero.sum()
    return torch.where(_is_binary(mask, zero), zero.sum(), (mask < 0).sum())


def _is_binary(mask: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Whether the floating-point ``mask`` holds 0s and 1s only, one 1 at least (a 0 / 1 mask,
    not an additive one), as a bool 0-dim tensor on its device (no wait for the device).
    ``zero``: ``mask == 0`` where the caller has it already."""
    one = mask == 1
    return ((mask == 0 if zero is None else zero) | one).all() & one.any()


def _padding_value(mask: torch.Tensor) -> str:
    """What the padded positions of ``mask`` hold, as :func:`_padding_count` counts them, for a
    warning: "negative" of an additive floating-point mask, else "0" (waits for its device)."""
    return "negative" if mask.is_floating_point() and not bool(_is_binary(mask)) else "0"


def _count_zeros_later(mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The number of padded positions (:func:`_padding_count`) of the CUDA tensor ``mask``,
    copied without waiting into a pinned int64 host scalar, and a ``torch.cuda.Event`` recorded
    on the current stream after the copy (read the scalar once the event's ``query()`` or
    ``synchronize()`` says it is done)."""
    count = torch.empty((), dtype=torch.int64, pin_memory=True)
    count.copy_(_padding_count(mask), non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(mask.device))
    return count, ready


def _takes_parameter(forward: Any, name: str) -> bool:
    """Whether ``forward``'s signature names a parameter ``name`` (False when it cannot be read)."""
    try:
        return name in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def _mask_arg_index(forward: Any) -> int | None:
    """The position of ``forward``'s ``attention_mask`` parameter among its positional
    arguments (``model(input_ids, mask)``), or None."""
    try:
        params = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for i, p in enumerate(params):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return None
        if p.name == "attention_mask":
            return i
    return None


# Modules of torch.nn whose fused fast path (torch.backends.mha) computes their children without
# calling them, or (an nn.TransformerEncoder that uses nested tensors, given a src_key_padding_mask)
# passes its layers nested tensors of the real tokens: tracking a module inside one turns the fast
# path off while attached.
_FUSED_PARENTS = (torch.nn.TransformerEncoderLayer, torch.nn.MultiheadAttention, torch.nn.TransformerEncoder)


def _fused(module: torch.nn.Module) -> bool:
    if isinstance(module, torch.nn.TransformerEncoder):
        return bool(getattr(module, "use_nested_tensor", False))
    return isinstance(module, _FUSED_PARENTS)
_fastpath_lock = threading.Lock()
_fastpath_users = 0
_fastpath_saved = True


def _inside_fused(model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]]) -> bool:
    fused = [n for n, m in named_modules(model) if _fused(m)]
    return any(name.startswith(f + ".") or (f == "" and name != "") for name, _ in modules for f in fused)


def _fastpath_acquire() -> None:
    global _fastpath_users, _fastpath_saved
    with _fastpath_lock:
        if _fastpath_users == 0:
            _fastpath_saved = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _fastpath_users += 1


def _fastpath_release() -> None:
    global _fastpath_users
    with _fastpath_lock:
        _fastpath_users -= 1
        if _fastpath_users == 0:
            torch.backends.mha.set_fastpath_enabled(_fastpath_saved)


def _no_forward(module: torch.nn.Module) -> bool:
    return getattr(type(module), "forward", None) is torch.nn.Module.forward


_TARGET_PARAMETER = re.compile(r"(tgt|trg|dec|decoder)(_\w+)?|target_(ids|tokens|input|inputs|seq)")


def _target_parameter(forward: Any) -> tuple[int, str] | None:
    """The (position, name) of the second sequence a model's own ``forward`` takes (an
    encoder-decoder's ``forward(src, tgt)``: a parameter after the first named ``tgt``,
    ``trg``, ``dec`` or ``decoder`` (alone or with a suffix: ``tgt_ids``, ``decoder_input``),
    or ``target_ids`` / ``_tokens`` / ``_input(s)`` / ``_seq``), or None. (``targets``, the
    labels of nanoGPT's ``forward(idx, targets)``, is not one: it is over the first sequence.)"""
    # (not cached: ``forward`` is the model's bound method, and a cache would keep the model alive)
    names = _positional_names.__wrapped__(forward)
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None
    for name in params[1:]:
        if _TARGET_PARAMETER.fullmatch(name) and not name.endswith(("mask", "_padding_mask", "_lengths", "_len")):
            return (names.index(name) if name in names else len(names) + len(params), name)
    return None


def _position_bias_hook_point(name: str, path: str, module: torch.nn.Module | None, tensor: torch.Tensor) -> bool:
    """Whether ``name`` (a hook point of the module at ``path``) is one of a relative position
    bias without a batch dimension: an ``nn.Embedding`` named ``relative_attention_bias`` (T5,
    mT5, LongT5, UMT5, Switch Transformers) called on ``(query, key)`` buckets, whose output
    is ``(query, key, heads)``. (MPNet's, called on ``(batch, query, key)`` buckets, has a
    batch dimension: not this.)"""
    if not isinstance(module, torch.nn.Embedding) or tensor.is_nested or path.rpartition(".")[2] != "relative_attention_bias":
        return False
    side = re.sub(r"^#\d+", "", name[len(path):]).lstrip(".") if name.startswith(path) else ""
    return tensor.dim() == (3 if side.startswith("output") else 2)


def _attention_map_hook_point(name: str, hook_point_paths: frozenset[str]) -> bool:
    """Whether ``name`` is a TransformerLens attention map (``attn.hook_pattern``,
    ``attn.hook_attn_scores``, or a later call ``#k`` of one): head-first,
    ``(batch, head_index, query_pos, key_pos)``."""
    path = name.split("#")[0]
    return path in hook_point_paths and path.endswith(("attn.hook_pattern", "attn.hook_attn_scores"))


# TransformerLens per-head activations, (batch, pos, head_index, d_head | d_model): token-first
_PER_HEAD_TOKEN_HOOKS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z", "attn.hook_rot_q",
                         "attn.hook_rot_k", "attn.hook_result", "hook_q_input", "hook_k_input", "hook_v_input")


def _per_head_token_hook_point(name: str, hook_point_paths: frozenset[str]) -> bool:
    """Whether ``name`` is a TransformerLens per-head activation (``attn.hook_q``, ``hook_k``,
    ``hook_v``, ``hook_z``, ``hook_rot_q``, ``hook_rot_k``, ``hook_result``, ``hook_q_input``,
    ...; or a later call ``#k`` of one): ``(batch, pos, head_index, ...)``, token rows whatever
    the number of heads (a layout that is known, not one to warn about as head-first)."""
    path = name.split("#")[0]
    return path in hook_point_paths and path.endswith(_PER_HEAD_TOKEN_HOOKS)


def _token_ids_hook_point(name: str, hook_point_paths: frozenset[str]) -> bool:
    """Whether ``name`` is TransformerLens's ``hook_tokens``: the ``(batch, pos)`` token ids,
    one scalar per token (a layout that is known, not a pooled output to guess about)."""
    path = name.split("#")[0]
    return path in hook_point_paths and (path == "hook_tokens" or path.endswith(".hook_tokens"))


def _silent_reason(name: str, module: torch.nn.Module, model: torch.nn.Module) -> str:
    if _no_forward(module):
        return f"{name!r}: a {type(module).__name__} has no forward of its own; track its items ({name + '.*'!r})"
    parent_name = name.rpartition(".")[0] if "." in name else ""
    parent = dict(named_modules(model)).get(parent_name) if name else None
    if isinstance(parent, torch.nn.MultiheadAttention) and name.endswith("out_proj"):
        return (f"{name!r}: nn.MultiheadAttention uses its weights directly and never calls it; track "
                f"{parent_name!r} instead (hook point {(parent_name + '.' if parent_name else '') + 'output.0'!r})")
    if peft_holds(parent, name.rpartition(".")[2], module) and name.rpartition(".")[2] == "base_model":
        return (f"{name!r} ({type(module).__name__}): PEFT's tuner around the model, which the forward of "
                f"{type(parent).__name__} passes over (it calls the model, {name + '.model'!r}, itself); "
                f"exclude={[name]!r}, or track model{'.' + parent_name if parent_name else ''}.get_base_model() "
                "instead")
    if never_called_type(module):
        return (f"{name!r} ({type(module).__name__}): its parent never calls it (it holds the parent's packed "
                f"weights, or a torch.export input check); track {parent_name!r} instead")
    if is_hook_point_module(module):
        switch = _transformer_lens_switch(name, model)
        if switch is not None:
            flag, setter = switch
            return (f"{name!r} (HookPoint): TransformerLens calls it only with model.cfg.{flag}=True, and this "
                    f"model has {flag}=False: call {setter} before the capture")
        return (f"{name!r} (HookPoint): never called (TransformerLens skips the hook points of the layers a "
                "forward with stop_at_layer= does not run, and those its config leaves out)")
    return f"{name!r} ({type(module).__name__}): never called, or it returned / received no tensor"


# TransformerLens HookPoints called only when a config flag is on: name suffix -> (flag, setter)
_TRANSFORMER_LENS_SWITCHES = (
    (("attn.hook_result",), "use_attn_result", "model.set_use_attn_result(True)"),
    (("hook_q_input", "hook_k_input", "hook_v_input"), "use_split_qkv_input", "model.set_use_split_qkv_input(True)"),
    (("hook_attn_in",), "use_attn_in", "model.set_use_attn_in(True)"),
    (("hook_mlp_in",), "use_hook_mlp_in", "model.set_use_hook_mlp_in(True)"),
)


def _transformer_lens_switch(name: str, model: torch.nn.Module | None) -> tuple[str, str] | None:
    """``(flag, setter)`` when the HookPoint ``name`` is one TransformerLens calls only with
    ``model.cfg.<flag>`` on, and the model's config has it off; else None."""
    cfg = getattr(model, "cfg", None)
    for suffixes, flag, setter in _TRANSFORMER_LENS_SWITCHES:
        if any(name == x or name.endswith("." + x) for x in suffixes):
            return (flag, setter) if getattr(cfg, flag, None) is False else None
    return None


def _runs_wrapper(module: torch.nn.Module, wrapper: Any) -> bool:
    """Whether a call of ``module`` still runs the capture's ``wrapper``: it is the module's
    forward, or a forward set on the module since keeps it as the one it calls (accelerate's
    ``_old_forward`` / ``_original_forward``, ``__wrapped__`` of ``functools.wraps``). False once
    the forward was replaced by one that does not (``remove_hook_from_module`` putting back the
    forward its hook replaced, an assignment to ``module.forward``)."""
    found = module.__dict__
    if any(found.get(attr) is wrapper for attr in ("forward", *_KEPT_FORWARD_ATTRS)):
        return True
    forward = found.get("forward")
    for _ in range(_MAX_UNWRAP):
        if forward is None:
            return False
        if forward is wrapper:
            return True
        try:
            forward = next((f for f in (getattr(forward, a, None) for a in ("__wrapped__", "__func__", "func"))
                            if f is not None), None)
        except Exception:  # noqa: BLE001 - an object whose attributes raise otherwise: not followed
            return False
    return False


def _replaced_message(names: list[str], model: torch.nn.Module) -> str:
    """The tracked modules ``names`` (``""``: the model itself) as a warning names them."""
    return ", ".join(f"the model itself ({type(model).__name__})" if not n else repr(n) for n in names)


def _silent_message(silent: list[tuple[str, torch.nn.Module]], model: torch.nn.Module | None = None) -> str:
    shown = silent[:6]
    parts = [_silent_reason(n, m, model) if model is not None else f"{n!r} ({type(m).__name__})" for n, m in shown]
    more = f"; and {len(silent) - len(shown)} more" if len(silent) > len(shown) else ""
    if all(is_hook_point_module(m) for _, m in silent):
        return "; ".join(parts) + more + ". Track the hook points the model's forward reaches, or exclude= them"
    return (
        "; ".join(parts) + more + ". A parent may compute them without calling them (a fused fast path, "
        "F.* on their weights) or they are unused: track the parent or the hook points that ran, or "
        "exclude= them"
    )


def _names(names: list[str], n: int = 8) -> str:
    return names_repr(names, n)  # (names that print alike, NFC and NFD, told apart by escapes)


def _discard(writer: Any, exc: BaseException | None = None) -> None:
    """Close a writer without committing this run (never raises); ``exc``, the reason, goes
    to a writer whose ``discard`` takes it (a rank's writer tells the other ranks)."""
    discard = getattr(writer, "discard", None)
    if discard is None:
        writer.abort(None)
    elif exc is not None and _takes_keyword(discard, "exc"):
        discard(exc=exc)
    else:
        discard()


def _token_rows_for(name: str, token_rows: bool | Mapping[str, bool] | None, names: Any = None) -> bool | None:
    """The ``token_rows=`` decision for hook point ``name``: True, False or None (the shape rule).
    A pattern equal to one of ``names`` (the tracker's hook points) selects that one only."""
    if token_rows is None or isinstance(token_rows, bool):
        return token_rows
    for pattern, flag in token_rows.items():
        if pattern_selects(pattern, name, names):
            return flag
    return None


def _takes_keyword(method: Any, name: str) -> bool:
    """Whether ``method`` (a writer's ``add_batch``) takes the keyword argument ``name``: named
    in its signature, or taken by its ``**kwargs`` (a signature that cannot be read: True)."""
    key = (getattr(method, "__func__", method), name)
    known = _TAKES_KEYWORD.get(key)
    if known is None:
        import inspect

        try:
            params = inspect.signature(method).parameters
        except (TypeError, ValueError):
            known = True
        else:
            known = name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        _TAKES_KEYWORD[key] = known
    return known


_TAKES_KEYWORD: dict[tuple[Any, str], bool] = {}


def _copy_ids(ids: Any) -> Any:
    """Sample ids as they are now (a tensor or array the caller refills for the next batch
    does not change them)."""
    if ids is None:
        return None
    if isinstance(ids, torch.Tensor):
        return ids.detach().clone()
    if isinstance(ids, np.ndarray):
        return ids.copy()
    return list(ids)


def _batch_size(batch: Mapping[str, Any], from_inputs: int) -> int:
    """Samples in a forward: the attention mask's rows, else the sample ids, else a user
    column, else the first dimension of the model's first tensor input (else of the first
    captured activation); 0 when nothing tells."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.shape[0])
    if batch.get("sample_ids") is not None:
        return len(batch["sample_ids"])
    for column in (batch.get("columns") or {}).values():
        return len(column)
    return max(0, int(from_inputs))


def _flatten_result(name: str, reduction: Any, result: Any = None) -> dict[str, torch.Tensor]:
    if result is None:  # (copies: a custom reduction's result may be its live accumulator)
        result = {key: value.clone() for key, value in reduction.result().items()}
    out: dict[str, torch.Tensor] = {}
    main_key = main_result_key(str(reduction.kind), result)
    for key, value in result.items():
        out[name if key == main_key else f"{name}.{key}"] = value
    return out
