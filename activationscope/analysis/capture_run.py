"""Capturing a model over a data set into a store: the work behind ``activationscope capture``
and the demo (the command line only parses arguments and prints).

:func:`capture_dataset` is ``activationscope capture`` as a function: it checks the output
path, loads the model and data specs (:mod:`.specs`), works out where a resumed store continues,
builds the batches and the store options and calls :func:`run_capture`, which runs the batches of
:func:`text_batches` (tokenized with :func:`iter_text_batches`) or :func:`tensor_batches` through
the model with a store tracker.
"""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import (ActivationScopeError, ArgumentValueError, CaptureError, CaptureWarning, SpecError,
                      StoreError, StoreLockedError, docs_page, warn_at_caller)
from ..sizes import dir_bytes, format_bytes

#: Tokens per text at most (longer texts are truncated).
MAX_LENGTH = 128

#: ``--padding``: how a batch of texts is padded. ``"longest"`` (the default): to the batch's
#: longest text; ``"max_length"``: every batch to ``max_length`` tokens, so that a hook point
#: stored one row per sample whose shape follows ``pos`` (an attention map ``(batch, heads,
#: pos, pos)``) keeps one shape.
PADDINGS = ("longest", "max_length")


@dataclass
class CaptureSummary:
    """What a capture did: samples, forwards, wall time (s) and hook points seen."""

    n_samples: int = 0
    n_forwards: int = 0
    elapsed_s: float = 0.0
    hook_points: list[str] = field(default_factory=list)
    n_bytes: int = 0
    #: First sample of this run: 0, or the samples a resumed store already held.
    first_sample: int = 0
    #: Samples the store holds when the capture is done (data set length, capped by max_samples).
    n_target: int = 0
    #: Hook points whose reductions were written by this run (with nothing left to capture:
    #: computed over the stored rows).
    reduced_hook_points: list[str] = field(default_factory=list)
    #: A resume with nothing left to capture found the store ``incomplete`` (a run stopped
    #: after its last sample was stored, before it closed) and marked it complete.
    completed: bool = False
    #: The modules tracked for want of ``include``, in a few words for the user: the model
    #: spec's default, e.g. ``"encoder.layer.0..5 (the model's blocks; --include to choose
    #: others)"``, or for the resume of a store of every module ``"every module, as the store
    #: was captured"``; "" when ``include`` was given.
    include_note: str = ""
    #: This process's rank and the number of ranks of a capture run by torchrun (0 and 1 for
    #: one process). Under torchrun, ``n_samples``, ``n_forwards``, ``first_sample`` and
    #: ``n_target`` count every rank's (the store's), ``elapsed_s`` and ``hook_points`` are
    #: this rank's.
    rank: int = 0
    world_size: int = 1

    @property
    def nothing_to_capture(self) -> bool:
        """True when a resumed store already held every sample (no forward ran)."""
        return self.n_forwards == 0 and self.first_sample >= self.n_target


def run_capture(
    model: Any,
    batches: Iterable[tuple[int, Any, dict[str, Any]]],
    *,
    out: str,
    n_total: int,
    include: list[str] | None,
    exclude: list[str] | None,
    reductions: list[str] | None,
    capture: str = "output",
    storage_dtype: Any = None,
    store_options: dict[str, Any] | None = None,
    progress: bool = True,
    desc: str = "capture",
    stop_after_last: bool = False,
    token_rows: Any = None,
    resumable: bool = True,
    rows: str = "auto",
    exclude_hook_points: list[str] | None = None,
    data: str | None = None,
    reductions_only: bool = False,
    samples_of: tuple[int, str] = (0, "this run"),
) -> CaptureSummary:
    """Run ``batches`` through ``model`` with a store tracker attached.

    ``samples_of``: how the error of a failed forward names its samples, ``(position of the
    first batch's first sample, what the positions count)``: ``(0, "this run")`` by default; a
    rank of a torchrun capture names their positions in the whole data.

    ``data``: the ``--data`` spec the batches come from, named by the error of a forward
    that fails on a tensor batch (with the batch's shape and dtype and what the model's first
    layer takes, :func:`_input_hint`).

    ``resumable``: whether the caller's command can resume a store (``capture --resume``;
    the demo cannot): the message of a failed capture offers ``--resume`` only then.

    Parameters
    ----------
    batches : iterable of (start, inputs, batch_info)
        ``inputs`` is a dict of keyword arguments or a Tensor (one positional argument);
        ``batch_info`` holds the keyword arguments of :meth:`Tracker.set_batch`
        (``attention_mask``, ``sample_ids``, columns).
    n_total : int
        Samples expected (for the progress bar).
    stop_after_last : bool, default False
        End each forward after its last tracked hook point (``ActivationScope(stop_after_last=True)``).
    token_rows : bool or dict of str to bool, optional
        ``ActivationScope(token_rows=...)``: which hook points shaped like the mask's
        ``(batch, pos)`` store token rows (True) or sample rows (False).
    rows : {"auto", "token"}, default "auto"
        ``ActivationScope(rows=...)``: ``"token"`` stores one row per token of tensor data
        without a mask (``(batch, pos)`` of the model's first input).
    reductions_only : bool, default False
        A store that keeps reductions only
        (``ActivationScope(reduction_policy=ReductionPolicy.STREAMING)``).

    Raises
    ------
    CaptureError
        The model raised during a forward (naming the exception and the samples).
    CaptureWarning
        A warning of the library's own that the warnings filter turns into an error
        (``-W error``), as it is: the library's, not the model's.
    """
    import torch
    from tqdm.auto import tqdm

    from .. import store as _store  # noqa: F401 - registers the store writer with capture
    from ..capture.scope import ActivationScope, ReductionPolicy

    scope = ActivationScope(
        store=out,
        store_options=store_options or {},
        reductions=reductions or None,
        **({"reduction_policy": ReductionPolicy.STREAMING} if reductions_only else {}),
        storage_dtype=storage_dtype,
        capture=capture,
        stop_after_last=stop_after_last,
        token_rows=token_rows,
        rows=rows,
        exclude_hook_points=exclude_hook_points,
    )
    summary = CaptureSummary()
    tracker = scope.track(model, include=include, exclude=exclude)  # validates the patterns first
    new_store = not (store_options or {}).get("resume")
    from ..store._backend import local_path

    local = local_path(out) if isinstance(out, (str, os.PathLike)) else None
    folder_existed = local is not None and os.path.isdir(local)
    path_existed = local is not None and os.path.lexists(local)  # (nothing there: a failure has nothing to keep)
    from ..capture.writer import merges_reductions

    # (torchrun: a multi-rank overwrite of a local store puts it back when nothing is committed; on
    # object storage it deletes the old store before the ranks write, never put back)
    multi_rank = merges_reductions(out, store_options or {})
    bar = tqdm(total=n_total, unit="samples", desc=desc, disable=not progress, dynamic_ncols=True,
               file=sys.stderr, leave=True)
    start = time.perf_counter()
    registry: set[Any] = set()  # the warnings raised in forwards already shown: once per text and place
    try:
        with torch.inference_mode(), tracker:
            for first, inputs, info in batches:
                tracker.set_batch(**info)
                n = _batch_len(inputs)
                caught: list[warnings.WarningMessage] = []
                done = False  # the forward returned (and the tracker recorded its samples)
                try:
                    raised: BaseException | None = None
                    try:
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            if isinstance(inputs, dict):
                                model(**inputs)
                            else:
                                model(inputs)
                        done = True
                    except BaseException as e:  # noqa: BLE001 - raised again below, after the warnings
                        raised = e
                    if caught:  # shown on lines of their own, not on the progress bar's
                        bar.clear()
                        try:
                            _reissue(caught, registry)
                        except Exception as w:  # noqa: BLE001 - a warning the filter makes an error
                            if raised is None:
                                raise
                            # the forward's own error stays the one reported
                            raised.add_note(f"it warned first: {type(w).__name__}: {' '.join(str(w).split())}")
                        finally:
                            bar.refresh()
                    if raised is not None:
                        raise raised
                except Exception as e:  # noqa: BLE001 - user model code
                    if isinstance(e, ActivationScopeError) or _is_library_warning(e):
                        # a warning of the library's own (shown by _reissue) that the warnings
                        # filter turns into an error (-W error): it is what it says, not the model's
                        raise
                    if done and isinstance(e, Warning):
                        # shown again by _reissue after the forward, whose samples are captured
                        first = samples_of[0] + summary.n_samples
                        summary.n_samples += n
                        summary.n_forwards += 1
                        bar.update(n)
                        raise CaptureError(
                            f"the model warned {type(e).__name__}: {' '.join(str(e).split())} in its forward on "
                            f"samples {first}..{first + n - 1} of {samples_of[1]}, an error under the warnings filter "
                            "(-W error or PYTHONWARNINGS); those samples were captured, the capture stopped after "
                            "them"
                        ) from e
                    raise CaptureError(
                        f"the model raised {type(e).__name__}: {' '.join(str(e).split())} on samples "
                        f"{samples_of[0] + summary.n_samples}..{samples_of[0] + summary.n_samples + n - 1} of "
                        f"{samples_of[1]}"
                        + "".join(f" ({note})" for note in getattr(e, "__notes__", ()))
                        + _input_hint(model, inputs, data) + _decoder_hint(model, inputs)
                    ) from e
                summary.n_samples += n
                summary.n_forwards += 1
                elapsed = max(time.perf_counter() - start, 1e-9)
                summary.n_bytes = _written_bytes(tracker, out)
                bar.set_postfix_str(f"{format_bytes(summary.n_bytes / elapsed)}/s", refresh=False)
                bar.update(n)
            summary.hook_points = tracker.hook_points
    except BaseException as e:
        # a new store that holds no committed row is removed, so the corrected rerun needs no
        # --overwrite; otherwise it keeps every row committed before the failure
        from ..store import remove_if_empty

        gone = tracker._store_removed  # (a store it made that holds no row: removed, said in a note)
        e = _token_rows_flag_error(e, token_rows)
        # (--overwrite: the store being replaced is put back by the tracker, and may hold no
        # row either; it is the user's, never removed here)
        removed = new_store and (gone or (not (store_options or {}).get("overwrite")
                                          and remove_if_empty(out, remove_folder=not folder_existed)))
        nothing_there = local is not None and not path_existed and not os.path.lexists(local)
        put_back = tracker._store_put_back  # (--overwrite, no row committed: the earlier store kept, said in a note)
        if put_back is not None and put_back in (getattr(e, "__notes__", None) or ()):
            e.__notes__.remove(put_back)  # (said below in the command's words)
        if put_back is None and multi_rank and getattr(tracker.writer, "put_back", False):
            put_back = ""  # (several ranks, local --overwrite: rank 0 put the earlier store back, said by every rank)
        tail = (f"this capture wrote nothing; {out} is left to the writer that holds it"
                if isinstance(e, StoreLockedError) else
                f"no row was committed, so the new store {out} was removed" if removed else
                f"no row of this capture was committed, so the store that was at {out} is kept as it was, with the "
                "rows of the capture that wrote it (--overwrite replaces it only once the new capture commits); once "
                "the cause is fixed, run the command again" if put_back is not None else
                f"nothing was written at {out}" if nothing_there else
                f"nothing was committed at {out}" if new_store and not (store_options or {}).get("overwrite")
                and summary.n_forwards == 0 and not _readable_store(out) else
                f"{out} is left as it was" if tracker._refused is not None else
                f"the store that was at {out} was deleted when this capture started (--overwrite on several ranks "
                f"replaces a store on object storage before the ranks write, "
                f"{docs_page('docs/usage/distributed.md', 'Overwriting a multi-rank store')}); "
                + _what_is_kept(out, resumable)
                if (store_options or {}).get("overwrite") and multi_rank and local is None else
                _what_is_kept(out, resumable) if multi_rank and (store_options or {}).get("overwrite") else
                f"no row was committed, so the store that was at {out} is kept as it was (overwrite replaces it "
                "only once the new capture commits)" if (store_options or {}).get("overwrite")
                and summary.n_forwards == 0 else
                _what_is_kept(out, resumable))
        if isinstance(e, CaptureError) and not isinstance(e.__cause__, ActivationScopeError):
            said = str(e)
            said = said[:-1] if said.endswith(".") and not said.endswith("..") else said  # (no ".;")
            raise CaptureError(f"{said}; {tail}") from e.__cause__
        # (the tracker's note says it already; several ranks: the error says the earlier store is put back)
        if not gone and not (put_back == "" and "is put back as it was" in str(e)):
            e.add_note(tail)
        raise e
    finally:
        bar.close()
    summary.reduced_hook_points = list(tracker.reductions)
    summary.elapsed_s = time.perf_counter() - start
    summary.n_bytes = max(summary.n_bytes, dir_bytes(out))
    return summary


def _is_library_warning(e: BaseException) -> bool:
    """Whether ``e`` is a warning of one of activationscope's own categories
    (:class:`~activationscope.errors.CaptureWarning`, ``EagerFallbackWarning``; the tracker
    issues its warnings during a forward as CaptureWarning) raised as an exception, which the
    warnings filter does for ``-W error``."""
    return isinstance(e, Warning) and type(e).__module__.partition(".")[0] == __name__.partition(".")[0]


def _reissue(caught: Sequence[warnings.WarningMessage], registry: set[Any]) -> None:
    """Show the warnings ``caught`` during a forward as they were raised (same category and
    place), the mask warning of the tracker in the words of ``capture`` (with its ``reason``,
    ``mask_shape`` and ``first_shapes``).

    Where the warnings filter turns a warning into an error (``-W error``), it raises here,
    as the warning's own category."""
    from ..errors import CaptureWarning

    first_error: Exception | None = None
    for w in caught:
        message = w.message
        if isinstance(message, CaptureWarning) and getattr(message, "reason", None) == "mask_unused":
            # the tracker's warning about the set_batch mask: here the mask is the tokenizer's
            said = message
            message = CaptureWarning(
                f"the attention mask of the tokenized text, of shape {message.mask_shape} (batch, pos), fits no "
                f"tracked hook point: no activation starts with it ({message.first_shapes}), so every hook point "
                "stores one row per sample, with the padding of an activation that has a token axis inside its "
                "rows. Pass --sample-rows PATTERN to confirm one row per sample (this silences the warning), or "
                "track hook points whose activations start with (batch, pos) for token rows"
            )
            # the same facts as the tracker's, for callers that tell warnings apart by them
            message.reason, message.mask_shape, message.first_shapes = said.reason, said.mask_shape, said.first_shapes
        key = (str(message), w.category, w.filename, w.lineno)
        if key in registry:  # warnings' own registry is reset by every catch_warnings of a forward
            continue
        registry.add(key)
        try:  # with its module's name, as warnings.warn gives it: filters that name a module match
            warnings.warn_explicit(message, w.category, w.filename, w.lineno, module=_module_of(w.filename))
        except Exception as e:  # noqa: BLE001 - a warning the filter makes an error: the others first
            first_error = first_error or e
    if first_error is not None:
        raise first_error


def _module_of(filename: str) -> str | None:
    """The name of the imported module whose file is ``filename`` (None: none is; warnings
    then names it by the file's path, as it does)."""
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return name
    return None


def _token_rows_flag_error(e: BaseException, token_rows: Any) -> BaseException:
    """The library's refusal of a ``token_rows=`` pattern that selects no hook point
    (HookPointNotFoundError with ``argument == "token_rows"``) in the words of the command
    line, naming ``--sample-rows`` or ``--token-rows``; any other error as it is."""
    from ..errors import HookPointNotFoundError

    if not (isinstance(e, HookPointNotFoundError) and getattr(e, "argument", None) == "token_rows"
            and isinstance(token_rows, dict) and e.pattern in token_rows):
        return e
    option = "--token-rows" if token_rows[e.pattern] else "--sample-rows"
    hook_points = list(e.hook_points)
    shown = ", ".join(hook_points[:8]) + (", ..." if len(hook_points) > 8 else "")
    error = HookPointNotFoundError(
        f"{option} {e.pattern!r} matches no tracked hook point; the hook points are [{shown}] (patterns match hook "
        f"point names, e.g. {hook_points[0] if hook_points else 'layer.0.output'!r})")
    error.argument, error.pattern, error.hook_points = option, e.pattern, hook_points
    error.__suppress_context__ = True
    return error.with_traceback(e.__traceback__)


def _readable_store(out: Any) -> bool:
    """Whether a store opens at ``out`` (a new capture that failed before its first forward,
    at a location that cannot be read or written, e.g. object storage without credentials,
    left none there: it did not "keep the rows committed before")."""
    from ..store import open_store

    try:
        open_store(out).close()
    except Exception:  # noqa: BLE001 - no store, or none that can be read
        return False
    return True


def _what_is_kept(out: Any, resumable: bool = True) -> str:
    """After a failed capture into an existing store: the status it has now, read from it
    (a resume refused before writing leaves a complete store complete); ``--resume`` is
    offered for an incomplete store only when ``resumable``, else a rerun is."""
    from ..store import open_store

    try:
        store = open_store(out)
        try:
            status, n, rows = store.status, int(store.n_samples), store.rows_stored
        finally:
            store.close()
    except Exception:  # noqa: BLE001 - the failure itself is what the caller reports
        return f"{out} keeps the rows committed before"
    if status == "complete":
        return f"{out} keeps its {n} committed samples (status complete)"
    fix = "--resume continues it" if resumable else "a rerun replaces it"
    if not rows:  # (a store that keeps reductions only holds no row: its reductions cover the committed samples)
        return f"{out} keeps the reductions of the samples committed before ({n} samples, status {status}; {fix})"
    return f"{out} keeps the rows committed before ({n} samples, status {status}; {fix})"


#: Values of ``capture_dataset(dtype=...)`` (names of torch dtypes).
STORAGE_DTYPES = ("float32", "float16", "bfloat16", "float64")
#: Values of ``capture_dataset(compression=...)``.
COMPRESSIONS = ("none", "zstd", "blosc-lz4")


def capture_dataset(
    model: str,
    data: str,
    out: str,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    capture: str = "output",
    reductions: Sequence[str] | None = None,
    dtype: str | None = None,
    compression: str | None = None,
    shard_bytes: int | None = None,
    chunk_rows: int | None = None,
    batch_size: int = 32,
    max_samples: int | None = None,
    max_length: int | None = None,
    padding: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    stop_after_last: bool = False,
    progress: bool = True,
    command: str | None = None,
    token_rows: Any = None,
    rows: str = "auto",
    on_start: Callable[[str], None] | None = None,
    exclude_hook_points: Sequence[str] | None = None,
    labels: str | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    reductions_only: bool = False,
) -> CaptureSummary:
    """Capture a model spec over a data spec into a store: ``activationscope capture`` as a function.

    The options are the command's flags (``--resume`` is ``resume=True``), and errors name
    them as the command line does. Checks run before anything is loaded: the output path
    (:func:`check_out`), the reduction names, ``batch_size`` and ``max_samples``.

    Run by ``torchrun`` (:func:`torchrun_ranks`: an initialised process group of several
    ranks, else ``WORLD_SIZE`` above 1 in the environment), every rank calls it with the same
    arguments: it initialises the process group where none is (gloo; nccl for a model on
    CUDA) and destroys it before it returns, rank *r* captures samples
    ``partition_bounds(n, r, world_size)`` of the ``n`` samples (their own sample ids) into its
    rank store, and rank 0 commits ONE store (``docs/usage/cli.md``, "Several processes:
    ``torchrun``"). No rank writes before every rank's checks passed: a rank whose checks fail
    raises its error, the others a StoreError naming it. A ``resume`` continues each rank's
    part of a store captured on as many ranks; the returned summary counts every rank's
    samples, with ``rank`` and ``world_size``.

    Parameters
    ----------
    model : str
        ``'demo'``, a local Hugging Face model folder, or ``package.module:factory``
        (:func:`.specs.load_model_spec`).
    data : str
        ``'demo'``, a text file (one sample per line) or a tensor file (``.npy`` / ``.pt``,
        samples along dim 0) (:func:`.specs.load_data_spec`).
    out : str
        Store path or URL.
    labels : str, optional
        ``--labels FILE``: one label per sample of tensor data, stored as the ``label``
        column (:func:`.specs.load_labels_spec`: a 1-D ``.npy`` / ``.pt``, or a text file of
        one label per line); its count must equal the data's samples. Text data is labelled
        by ``__label__`` tags instead and refuses it.
    text_column, label_column : str, optional
        ``--text-column`` / ``--label-column``: the columns of a table ``data`` (``.csv``,
        ``.tsv``, ``.jsonl``, ``.json``, ``.parquet``, ``.arrow``, ``.feather`` or a
        ``datasets.save_to_disk`` folder) holding each sample's text and label (default
        ``text``, and ``label`` where the table has one).
    include, exclude : sequence of str, optional
        fnmatch patterns of module names (``["*"]``: every module). ``include`` defaults to
        the model spec's default (:func:`.specs.load_model_spec`): the demo's layers and
        pools, a Hugging Face model's blocks (the children of its stacks of repeated layers,
        ``encoder.layer.0`` ...: the residual stream after each block), every module of an
        import path; the ``resume`` of a store that records ``include=None`` (every module)
        tracks every module. The summary's ``include_note`` says which.
    capture : {'output', 'input', 'both'}
    reductions : sequence of str, optional
        Built-in reduction names (``capture.reductions.BUILTIN_REDUCTIONS``), each optionally
        with options in brackets, ``hist[lo=-4,hi=4,bins=64]`` (see :func:`check_reductions`).
    dtype : str, optional
        Storage dtype, one of :data:`STORAGE_DTYPES` (default: the activations' own dtype).
    compression : str, optional
        One of :data:`COMPRESSIONS` (default and ``'none'``: uncompressed).
    shard_bytes, chunk_rows : int, optional
        Store layout (``store_options`` of :class:`ActivationScope`).
    batch_size : int, default 32
        Samples per forward, at least 1.
    max_samples : int, optional
        The store holds at most this many samples (the first ones of ``data``), at least 1.
    max_length : int, optional
        Token limit of text samples (special tokens included), more than the special tokens
        the tokenizer adds to a sample and at most the positions the model takes
        (``config.max_position_embeddings``). Default: :data:`MAX_LENGTH` (128), or the
        model's positions where it takes fewer. Longer texts are cut to their first
        ``max_length`` tokens, with a :class:`~activationscope.errors.CaptureWarning` that
        says how many and how long the longest is.
    padding : {'longest', 'max_length'}, optional
        ``--padding``: how each batch of text is padded: ``'longest'`` (the default) to the
        batch's longest text, ``'max_length'`` to ``max_length`` tokens (the tokenizer's
        ``padding="max_length"``), every batch the same length, so that a hook point stored
        one row per sample whose shape follows ``pos`` (an attention map ``(batch, heads, pos,
        pos)`` of a model returning its attention weights) keeps one shape; token rows leave
        the padding out either way. Recorded in the store's provenance (``padding``): a
        ``resume`` without it pads as the store's samples were, and one with another is
        refused. Text data only.
    resume : bool
        Continue the incomplete store at ``out`` from its next sample: samples
        ``store.n_samples`` .. end of ``data`` are captured with those sample ids. With
        ``reductions`` and nothing left to capture, the reductions are computed over the
        stored rows (no forward runs); without, the store is untouched. Either way a full
        store is checked as an incomplete one is (the model's weights, ``dtype``, and
        ``include`` / ``exclude`` / ``capture`` giving every stored hook point), and data
        with fewer samples than the store holds is refused.
    rows : {"auto", "token"}, default "auto"
        ``--rows``: ``"token"`` stores tensor data of token ids ``(batch, pos)`` (or
        embeddings ``(batch, pos, d)``) one row per token (``ActivationScope(rows="token")``:
        the SAE-caching layout, with a ``token`` row table of ``sample_id`` and ``pos``); text
        data has token rows through its attention mask already and refuses it.
    overwrite : bool
        Replace the store at ``out`` (never anything that is not an activationscope store).
    command : str, optional
        The command line, recorded in the store's provenance.
    token_rows : bool or dict of str to bool, optional
        ``ActivationScope(token_rows=...)`` (``--token-rows`` / ``--sample-rows``); each
        pattern must select a hook point of the first forward (of the store, for a resume
        with nothing left to capture), else HookPointNotFoundError names the flag.
    reductions_only : bool, default False
        ``--reductions-only``: a store that keeps the reductions only (and the sample row
        table), no activation row (``ActivationScope(reduction_policy=ReductionPolicy.STREAMING)``,
        ``store/FORMAT.md`` section 11). Needs ``reductions``; a ``resume`` of such a store
        needs it (and the same ``reductions``), and a ``resume`` with it of a store of rows is
        refused (StoreError), nothing changed.
    on_start : callable, optional
        Called once with :attr:`CaptureSummary.include_note` (the modules tracked without
        ``include``, in a few words) before the first forward, when there is one: what a long
        capture tracks is known from its start, also when it stops early.

    Returns
    -------
    CaptureSummary
        ``first_sample`` (where this run started), ``n_target`` (samples the store holds
        when complete), ``n_samples`` captured by this run; ``nothing_to_capture`` when a
        resumed store was already full (no forward ran, the store is untouched).

    Raises
    ------
    ArgumentValueError
        A bad option value, ``resume`` and ``overwrite`` together, an ``out`` that is not a
        store (or is one, without ``resume`` / ``overwrite``), text data with a model spec
        that has no tokenizer, a ``max_length`` that leaves no token of text after the
        tokenizer's special tokens or exceeds the model's positions, ``resume`` with data of
        fewer samples than the store holds, with text data whose first samples are not the
        stored ones (``sample_id`` / ``text`` / ``label`` of the store's sample table), with
        a tokenizer that gives the store's first or last sample other token ids than its
        ``token_ids`` hold (:func:`_check_resumed_token_ids`), with
        tensor data whose first samples hash otherwise than the store's runs recorded
        (provenance ``data_fingerprint``, :func:`tensor_fingerprint`) or that has fewer
        samples than the run whose fingerprint is compared read, or with another
        ``max_length`` or ``padding`` than the store records; ``padding`` with tensor data.
    SpecError
        A model or data spec that names nothing usable (a table, ``.csv`` / ``.jsonl`` /
        ...); no ``include`` for a Hugging Face model without a stack of repeated blocks (the
        message names ``--include`` and a few module names); text data whose tokenizer has
        neither a pad token nor an end-of-sequence token.
    CaptureError
        The model raised during a forward (the store keeps the rows committed before), or
        ``resume`` with another model, ``dtype`` or hook points than the store's (the store
        is left as it was).
    HookPointNotFoundError
        A ``token_rows`` pattern that selects no hook point of the first forward (nor of
        the store, for a resume with nothing left to capture): worded for ``--sample-rows``
        / ``--token-rows``, with ``argument`` (the flag), ``pattern`` and ``hook_points``.
    ArgumentTypeError
        ``resume`` or ``overwrite`` that is not a bool (``"False"`` is a true string); nothing
        is loaded or changed.
    ArgumentValueError
        Under torchrun: ``shard_bytes`` or ``reductions_only`` (nothing is loaded or written);
        a ``resume`` of a store captured by one process or on another number of ranks, or whose
        rank store records another part of the data (``--max-samples`` or data of another
        length), or of a committed store with fewer samples than the data or without the
        ``reductions`` asked for (nothing changed).
    StoreError
        Under torchrun: another rank failed (its error named; nothing written by this one).

    Warns
    -----
    CaptureWarning
        Text samples longer than ``max_length`` tokens, cut to it: once, after the last
        batch, with their count and the longest (see :func:`text_batches`).
    CaptureWarning
        Text data whose attention mask fits no tracked hook point (every hook point stores
        one row per sample): worded for ``--sample-rows``, raised once per capture, with the
        tracker's ``reason == "mask_unused"``, ``mask_shape`` and ``first_shapes``. Where
        the warnings filter turns it into an error (``-W error``), that CaptureWarning is
        raised as it is (not as a CaptureError: the model did not raise it), with a note
        saying what the store keeps.
    """
    from .._args import parse_flag
    from .specs import load_data_spec, load_labels_spec, load_model_spec

    # (resume="False" or overwrite="False", from a config file, are true strings: they resumed or replaced the store)
    resume, overwrite = parse_flag(resume, "resume"), parse_flag(overwrite, "overwrite")
    reductions_only = parse_flag(reductions_only, "reductions_only")
    if resume and overwrite:
        raise ArgumentValueError("--resume and --overwrite exclude each other: pass one of them")
    if reductions_only and not reductions:
        raise ArgumentValueError("--reductions-only keeps the reductions only, and no --reduce was given, so the store "
                                 "would hold nothing; pass --reduce (e.g. --reduce mean,var), or drop --reductions-only "
                                 "to store every row")
    if batch_size < 1:
        raise ArgumentValueError(f"--batch-size must be a positive int, got {batch_size}")
    if max_samples is not None and max_samples < 1:
        raise ArgumentValueError(f"--max-samples must be a positive int, got {max_samples}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise ArgumentValueError(f"--max-length must be a positive int, got {max_length!r}")
    if padding is not None and padding not in PADDINGS:
        raise ArgumentValueError(f"--padding must be one of {list(PADDINGS)}, got {padding!r}")
    if dtype is not None and dtype not in STORAGE_DTYPES:
        raise ArgumentValueError(f"--dtype must be one of {list(STORAGE_DTYPES)}, got {dtype!r}")
    if compression is not None and compression not in COMPRESSIONS:
        raise ArgumentValueError(f"--compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
    if rows not in ("auto", "token"):
        raise ArgumentValueError(f"--rows must be 'auto' or 'token', got {rows!r}")
    reductions = check_reductions(reductions)
    out = os.fspath(out)
    ranks = torchrun_ranks()
    if ranks is not None and reductions_only:
        raise ArgumentValueError(
            f"--reductions-only cannot be used on {ranks[1]} ranks (torchrun): the rank stores of a multi-rank "
            "capture are committed into one store from their rows, and --reductions-only keeps none; drop "
            "--reductions-only, or run the command as one process (without torchrun); nothing was written")
    if ranks is not None and shard_bytes is not None:
        raise ArgumentValueError(
            f"--shard-bytes cannot be used on {ranks[1]} ranks (torchrun): every rank's shards of a row kind must "
            "hold the same number of rows, whatever each hook point's row size, for the rank stores to be committed "
            "into one store (shards of 16384 rows); drop --shard-bytes, or run the command as one process (without "
            "torchrun); nothing was written")
    check_out(out, resume=resume, overwrite=overwrite)  # before loading anything

    with warnings.catch_warnings():
        if ranks is not None and ranks[0] != 0:  # (every rank loads the whole data: rank 0 says its warnings)
            warnings.simplefilter("ignore")
        dataset = load_data_spec(data, text_column=text_column, label_column=label_column)
    if labels is not None:
        if dataset.texts is not None:
            raise ArgumentValueError(
                f"--labels is for tensor data (.npy / .pt / .npz / .safetensors); --data {data!r} is text, labelled "
                "by the '__label__<name> ' prefix of each line (a text file) or by its label column (a table, "
                "--label-column): give the labels there and leave --labels out")
        dataset.labels = load_labels_spec(os.fspath(labels), data, len(dataset))
    if padding is not None and dataset.texts is None:
        raise ArgumentValueError(
            f"--padding {padding} is for text data, whose batches are tokenized and padded; --data {data!r} is a "
            "tensor file, fed to the model as it is: leave --padding out")
    if rows == "token" and dataset.texts is not None:
        raise ArgumentValueError(
            f"--rows token is for tensor data (token ids (batch, pos)); --data {data!r} is text, whose hook points "
            "shaped like its attention mask store one row per real token already: leave --rows out")
    loaded = load_model_spec(model)
    if dataset.texts is not None and loaded.tokenizer is None:
        raise ArgumentValueError(
            f"--data {data!r} is text, which needs a tokenizer: use --model demo or a Hugging Face model folder "
            "(or pass a .npy / .pt tensor file)"
        )
    made_group = ranks is not None and _init_rank_group(loaded.model)
    try:
        return _capture_loaded(
            loaded, dataset, model=model, data=data, out=out, ranks=ranks, include=include, exclude=exclude,
            capture=capture, reductions=reductions, dtype=dtype, compression=compression, shard_bytes=shard_bytes,
            chunk_rows=chunk_rows, batch_size=batch_size, max_samples=max_samples, max_length=max_length,
            padding=padding, resume=resume, overwrite=overwrite, stop_after_last=stop_after_last, progress=progress, command=command,
            token_rows=token_rows, rows=rows, on_start=on_start, exclude_hook_points=exclude_hook_points,
            reductions_only=reductions_only)
    finally:
        if made_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _capture_loaded(
    loaded: Any, dataset: Any, *, model: str, data: str, out: str, ranks: tuple[int, int] | None,
    include: Sequence[str] | None, exclude: Sequence[str] | None, capture: str, reductions: list[Any] | None,
    dtype: str | None, compression: str | None, shard_bytes: int | None, chunk_rows: int | None, batch_size: int,
    max_samples: int | None, max_length: int | None, padding: str | None, resume: bool, overwrite: bool,
    stop_after_last: bool,
    progress: bool, command: str | None, token_rows: Any, rows: str,
    on_start: Callable[[str], None] | None, exclude_hook_points: Sequence[str] | None, reductions_only: bool,
) -> CaptureSummary:
    """:func:`capture_dataset` once its arguments are checked and its model and data loaded
    (and, under torchrun, ``ranks`` its ``(rank, world_size)``, the process group initialised):
    a rank captures its part of the data, :func:`~activationscope.data.samplers.partition_bounds`
    of the samples (contiguous: the committed store holds them in the documented order of
    ``store/FORMAT.md`` section 10), and resumes its own rank store."""
    import torch

    rank, world = ranks if ranks is not None else (0, 1)
    n_all = len(dataset) if max_samples is None else min(len(dataset), max_samples)
    whole, offset, stop = dataset, 0, n_all
    if ranks is not None:
        from ..data.samplers import partition_bounds

        offset, stop = partition_bounds(n_all, rank, world)
        dataset = _rank_part(dataset, offset, stop)
    committed = False  # a torchrun resume of a committed store: checked whole, nothing captured

    def open_resumed() -> Any:
        nonlocal committed, dataset
        if ranks is None:
            return _open_resumed(out, reductions_only)
        opened, committed = _open_rank_resumed(out, rank, world, reductions_only)
        if committed:
            dataset = whole
        elif opened is not None:
            try:
                _check_rank_part(out, opened, rank, world, offset, stop)
            except BaseException:
                opened.close()
                raise
        return opened

    # the store a resume continues: opened once (open_resumed), and that one snapshot read by
    # every check below (its rows, max_length, include patterns, model, data, labels, token ids)
    store: Any = None
    error: BaseException | None = None
    first = n = 0
    include_note = ""
    recorded: dict[str, Any] | None = None  # what it records of the settings every rank shares
    try:
        try:
            if dataset.texts is not None:
                _ensure_pad_token(loaded.tokenizer, model)
                _pad_on_the_right(loaded.tokenizer)
            if resume:
                store = open_resumed()
                recorded = _recorded_settings(store)
        except Exception as e:  # noqa: BLE001 - every rank learns it (_exchange), then it is raised
            if ranks is None:
                raise
            error = e
        if ranks is not None and resume:  # (every rank, whatever its checks gave: a collective)
            import torch.distributed as dist

            every: list[Any] = [None] * world
            dist.all_gather_object(every, recorded)
        try:
            if error is not None:
                raise error  # (sent to every rank by _exchange below)
            if ranks is not None and resume:  # a rank without a rank store takes what the others' record
                recorded = _agreed_settings(out, recorded, every)
            if dataset.texts is not None:
                if recorded is not None:
                    max_length = _resumed_max_length(out, max_length, recorded.get("max_length"),
                                                     store.n_samples if store is not None else 0)
                max_length = _check_max_length(max_length, loaded.model, model, loaded.tokenizer)
                padding = _resumed_padding(out, padding, recorded.get("padding") if recorded else None)
                count = getattr(loaded.tokenizer, "num_special_tokens_to_add", None)
                n_special = int(count(pair=False)) if callable(count) else 0
                if max_length <= n_special:  # the tokenizer cannot truncate below its special tokens: it would not
                    raise ArgumentValueError(
                        f"--max-length {max_length} leaves no token of text: the tokenizer of --model {model!r} adds "
                        f"{n_special} special tokens to every sample (and would not truncate at all); pass "
                        f"--max-length {n_special + 1} or more")
            n = len(dataset) if ranks is not None and not committed else n_all
            first = resume_offset(store) if store is not None else 0
            include, include_note = _include_for(include, loaded, out, resume and recorded is not None,
                                                 recorded.get("include", _UNRECORDED) if recorded else _UNRECORDED)
            if resume and store is not None and (first >= n or committed):
                # (the store writer, which checks the model, is not opened when nothing is left)
                _check_no_writer(out)
                _check_resumed_model(out, loaded.model, store)
                _check_resumed_side(out, capture, store)
                if len(dataset) < first:
                    raise ArgumentValueError(
                        f"--resume: store {out!r} holds {first} samples, but --data {data!r} has only {len(dataset)}, "
                        "so it is not the data the store was captured from; resume with that data, or pass "
                        "--overwrite instead of --resume to capture this data into a new store (nothing was changed)")
            if resume and store is not None and 0 < first <= len(dataset) and dataset.texts is not None:
                _check_resumed_texts(out, dataset, data, first, store)
                if first < n:  # (the texts left are tokenized by this run)
                    _check_resumed_token_ids(out, dataset, data, model, loaded.tokenizer, first, store)
            if resume and store is not None and 0 < first <= len(dataset) and dataset.tensor is not None:
                if committed:  # (each rank's part, by the fingerprint that rank recorded)
                    _check_committed_tensor(out, dataset.tensor, data, first, store)
                else:
                    _check_resumed_tensor(out, dataset.tensor, data, first, store)
                _check_resumed_labels(out, dataset.labels, data, first, store)
            if committed:
                _check_committed_resume(out, store, first, n, reductions, world)
        except Exception as e:  # noqa: BLE001 - every rank learns it (_exchange), then it is raised
            if ranks is None:
                raise
            error = e
    finally:
        if store is not None:
            store.close()
    if ranks is not None:  # no rank writes before every rank's checks passed
        facts = _exchange(error, (first, n), world)
        if committed:
            return CaptureSummary(first_sample=first, n_target=n, include_note=include_note, rank=rank,
                                  world_size=world)
    if first >= n and not reductions and ranks is None:
        completed = _check_full_resume(
            out, loaded.model, include=include,
            exclude=list(exclude) if exclude else None, capture=capture,
            storage_dtype=getattr(torch, dtype) if dtype else None, token_rows=token_rows, rows=rows,
            complete=first >= len(dataset), provenance=capture_store_options(model=loaded.name, data=dataset.name, command=command)["provenance"])
        return CaptureSummary(first_sample=first, n_target=n, completed=completed, include_note=include_note)
    if first >= n:  # nothing left to capture: the reductions are computed over the stored rows
        batches: Iterable[tuple[int, Any, dict[str, Any]]] = []
    elif dataset.texts is not None:
        labels = dataset.labels[first:n] if dataset.labels is not None else None
        ids = dataset.sample_ids[first:n] if dataset.sample_ids is not None else None
        batches = text_batches(
            dataset.texts[first:n], loaded.tokenizer, batch_size, max_length, labels, first_id=offset + first,
            sample_ids=ids, max_positions=model_positions(loaded.model, loaded.tokenizer), resumed=resume,
            padding=padding)
    else:
        _warn_padded_ids(dataset.tensor[first:n], loaded.tokenizer, data)
        batches = tensor_batches(dataset.tensor[first:n], batch_size, first_id=offset + first,
                                 token_ids=rows == "token" and _are_token_ids(dataset.tensor),
                                 labels=dataset.labels[first:n] if dataset.labels is not None else None)
    if on_start is not None and include_note and rank == 0:
        on_start(include_note)
    options = capture_store_options(
        model=loaded.name, data=dataset.name, command=command, resume=resume, overwrite=overwrite,
        compression=compression, shard_bytes=shard_bytes, chunk_rows=chunk_rows,
        max_length=max_length if dataset.texts is not None else None,
        padding=padding if dataset.texts is not None else None,
    )
    if dataset.tensor is not None:  # what a later --resume checks its data against
        options["provenance"]["data_fingerprint"] = tensor_fingerprint(dataset.tensor, n)
    if ranks is not None:  # the samples of the data this rank captures (a --resume keeps them)
        options["provenance"]["rank_part"] = {"start": offset, "stop": stop, "n_samples": n_all, "world_size": world}
    summary = run_capture(
        loaded.model, batches, out=out, n_total=max(0, n - first),
        include=include,
        exclude=list(exclude) if exclude else None,
        reductions=reductions, capture=capture,
        storage_dtype=getattr(torch, dtype) if dtype else None, store_options=options,
        progress=progress and rank == 0, stop_after_last=stop_after_last, token_rows=token_rows, rows=rows,
        exclude_hook_points=list(exclude_hook_points) if exclude_hook_points else None,
        data=data if dataset.tensor is not None else None, reductions_only=reductions_only,
        samples_of=(offset + first, f"the data (rank {rank}'s part, samples {offset}..{stop - 1})")
        if ranks is not None else (0, "this run"),
    )
    summary.first_sample, summary.n_target, summary.include_note = first, n, include_note
    if ranks is not None:  # the whole store's, as every rank's checks told them (each ran its every batch)
        summary.rank, summary.world_size = rank, world
        summary.first_sample = sum(f for f, _ in facts)
        summary.n_target = n_all
        summary.n_samples = sum(max(0, m - f) for f, m in facts)
        summary.n_forwards = sum(-(-max(0, m - f) // batch_size) for f, m in facts)
        if rank == 0:  # (the committed store's: rank 0's part may have held nothing left to capture)
            from ..store import open_store

            committed_store = open_store(out)
            try:
                summary.hook_points = list(committed_store.hook_points)
            finally:
                committed_store.close()
    return summary


def _ensure_pad_token(tokenizer: Any, model: str) -> None:
    """Give a tokenizer without a pad token (GPT-2's, Llama's) its end-of-sequence token as
    one, so that text batches can be padded: the attention mask leaves the padded positions
    out of the forward's attention and out of the store, so which token fills them does not
    change a stored row (the tokenizer pads on its own side, right for GPT-2).

    Raises
    ------
    SpecError
        The tokenizer has neither a pad token nor an end-of-sequence token.
    """
    if getattr(tokenizer, "pad_token", None) is not None or not hasattr(tokenizer, "pad_token"):
        return
    eos = getattr(tokenizer, "eos_token", None)
    if eos is None:
        raise SpecError(
            f"the tokenizer of --model {model!r} has no pad token (nor an end-of-sequence token to pad with), so "
            "batches of texts of different lengths cannot be padded: add \"pad_token\" to the folder's "
            "tokenizer_config.json, or pass --batch-size 1")
    tokenizer.pad_token = eos


def _pad_on_the_right(tokenizer: Any) -> None:
    """Make a tokenizer that pads on the left (many decoders' tokenizer configs ask for it,
    for generation) pad on the right. A capture feeds the model ``input_ids`` and
    ``attention_mask`` only, and a model that numbers positions from 0 whatever the mask
    (GPT-2, Llama) would give a left-padded text's tokens the positions after its padding:
    rows other than the model's own on that text. Padded on the right, each text's tokens
    keep positions 0.., and the mask keeps the padding out of what they attend to."""
    if getattr(tokenizer, "padding_side", "right") == "left":
        tokenizer.padding_side = "right"


def _resumed_max_length(out: str, max_length: int | None, stored: int | None, n_samples: int) -> int | None:
    """The ``max_length`` of a resumed text capture: the one the store records (``stored``,
    :func:`_recorded_max_length`) when none is given, so the resumed samples are cut as the
    stored ones were; ``max_length`` as given for a store that records none (or none yet).
    ``n_samples``: the samples the store at ``out`` holds (named in a warning).

    Raises
    ------
    ArgumentValueError
        ``max_length`` other than the store's: its samples would be cut at another length
        than the stored ones, in one store. Nothing is changed.
    """
    if stored is None:
        if max_length is not None and n_samples:
            warn_at_caller(CaptureWarning(
                f"--resume --max-length {max_length}: store {out!r} records no --max-length (an earlier version "
                f"wrote it, and its command line gave none: it cut texts at {MAX_LENGTH} tokens unless the model "
                f"took fewer); where its {n_samples} stored samples were cut at another length than "
                f"{max_length}, the resumed ones are cut differently; pass --overwrite instead of --resume to "
                "capture every text at one length"))
        return max_length
    if max_length is not None and max_length != stored:
        raise ArgumentValueError(
            f"--resume --max-length {max_length}: store {out!r} was captured with --max-length {stored}, and its "
            f"resumed texts would be cut at another length than its stored ones; resume with --max-length {stored} "
            "(or without --max-length), or pass --overwrite instead of --resume to capture every text again "
            "(nothing was changed)")
    return stored


def _resumed_padding(out: str, padding: str | None, stored: Any) -> str:
    """The ``--padding`` of a text capture: ``padding`` as given, else the one the store a
    resume continues records (``stored``, provenance ``padding``), else ``"longest"``.

    Raises
    ------
    ArgumentValueError
        ``padding`` other than the one the store records: its resumed batches would be padded
        otherwise than its stored ones (a hook point stored one row per sample whose shape
        follows ``pos`` could not take their rows). Nothing is changed.
    """
    if stored not in PADDINGS:  # (a store of an earlier version, or of a Python capture: none recorded)
        return padding or "longest"
    if padding is not None and padding != stored:
        raise ArgumentValueError(
            f"--resume --padding {padding}: store {out!r} was captured with --padding {stored}, and its resumed "
            f"batches would be padded otherwise than its stored ones; resume with --padding {stored} (or without "
            "--padding), or pass --overwrite instead of --resume to capture every text again (nothing was changed)")
    return stored


def _recorded_max_length(store: Any) -> int | None:
    """The ``--max-length`` an opened ``store`` records (``provenance["max_length"]``, or the
    one its recorded command line gives); None where it records none."""
    provenance = store.attrs.get("provenance")
    stored = provenance.get("max_length") if isinstance(provenance, dict) else None
    if isinstance(stored, bool) or not isinstance(stored, int):
        stored = _max_length_of_command(provenance.get("command") if isinstance(provenance, dict) else None)
    return stored


def _recorded_settings(store: Any) -> dict[str, Any] | None:
    """What an opened ``store`` that a resume continues records of the settings its resumed
    samples must be captured with: ``max_length`` (:func:`_recorded_max_length`), ``padding``
    (provenance ``padding``) and
    ``include`` (:func:`_recorded_include`), each left out where the store records none;
    plain values, sent to the other ranks under torchrun. None for no store."""
    if store is None:
        return None
    settings: dict[str, Any] = {}
    max_length = _recorded_max_length(store)
    if max_length is not None:
        settings["max_length"] = max_length
    provenance = store.attrs.get("provenance")
    padding = provenance.get("padding") if isinstance(provenance, dict) else None
    if padding in PADDINGS:
        settings["padding"] = padding
    include = _recorded_include(store)
    if include is not _UNRECORDED:
        settings["include"] = include
    return settings


def _agreed_settings(out: str, mine: dict[str, Any] | None, every: list[Any]) -> dict[str, Any] | None:
    """The settings (:func:`_recorded_settings`) a rank of a torchrun resume captures with:
    its own store's (``mine``), or, for a rank without a rank store (one killed before it
    opened it, or whose rank store was removed), those the other ranks' stores record
    (``every``: each rank's, in rank order), so that no rank cuts its texts at another
    ``--max-length`` or tracks other hook points than the rows already stored; None where no
    rank has a store (every rank starts from its first sample).

    Raises
    ------
    ArgumentValueError
        Two ranks' stores record other values of one setting: the committed store would mix
        rows of both. Nothing is changed.
    """
    held = [(r, s) for r, s in enumerate(every) if isinstance(s, dict)]
    for key, flag in (("max_length", "--max-length"), ("padding", "--padding"), ("include", "--include patterns")):
        known = [(r, s[key]) for r, s in held if key in s]
        if any(v != known[0][1] for _, v in known):
            raise ArgumentValueError(
                f"--resume: the rank stores of store {out!r} record other {flag}: "
                + ", ".join(f"rank {r} {v!r}" for r, v in known)
                + "; their rows cannot be committed into one store, and a rank resumed without its rank store could "
                "not tell which to take: pass --overwrite instead of --resume to capture every rank again (nothing "
                "was changed)")
    if mine is not None or not held:
        return mine
    agreed: dict[str, Any] = {}
    for _, s in held:
        for key, value in s.items():
            agreed.setdefault(key, value)
    return agreed


def _max_length_of_command(command: Any) -> int | None:
    """``--max-length N`` (or ``--max-length=N``) of a command line a store's provenance
    records; None where it gives none (or is no str)."""
    if not isinstance(command, str):
        return None
    words = command.split()
    for i, word in enumerate(words):
        value = words[i + 1] if word == "--max-length" and i + 1 < len(words) else (
            word.partition("=")[2] if word.startswith("--max-length=") else None)
        if value is not None and value.isdigit() and value.isascii():
            return int(value)
    return None


def model_positions(module: Any, tokenizer: Any = None) -> int | None:
    """The positions (tokens) a Hugging Face model takes: ``config.max_position_embeddings``,
    or the tokenizer's ``model_max_length`` where it is fewer (RoBERTa numbers positions from
    ``pad_token_id + 1``: 514 embeddings, 512 tokens; a tokenizer that does not know its
    model's length says 10**30, ignored); None for a model without either."""
    def positive(n: Any) -> int | None:
        return None if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n > 10**9 else n

    config = getattr(module, "config", None)
    limits = [n for n in (positive(getattr(config, "max_position_embeddings", None)),
                          positive(getattr(tokenizer, "model_max_length", None))) if n is not None]
    return min(limits) if limits else None


def _check_max_length(max_length: int | None, module: Any, model: str, tokenizer: Any = None) -> int:
    """``max_length`` of a text capture, checked against the positions the model takes
    (:func:`model_positions`: ``config.max_position_embeddings`` of a Hugging Face model, or
    its tokenizer's ``model_max_length`` where fewer); None gives :data:`MAX_LENGTH`, or those
    positions where they are fewer.

    Raises
    ------
    ArgumentValueError
        ``max_length`` above the model's positions: its forward would fail on the first
        text that long (an index error inside the model), after rows were committed.
    """
    limit = model_positions(module, tokenizer)
    if limit is None:
        return MAX_LENGTH if max_length is None else max_length
    if max_length is None:
        return min(MAX_LENGTH, limit)
    if max_length > limit:
        raise ArgumentValueError(
            f"--max-length {max_length} is more than the {limit} positions --model {model!r} takes "
            f"(config.max_position_embeddings, or the tokenizer's model_max_length): a longer text would fail inside "
            f"the model; pass --max-length "
            f"{limit} or less (nothing was written)")
    return max_length


def _include_for(include: Sequence[str] | None, loaded: Any, out: str, resume: bool,
                 recorded: Any) -> tuple[list[str] | None, str]:
    """The ``include`` patterns of a capture and, when none were given, what was chosen in
    a few words (:attr:`CaptureSummary.include_note`): the model spec's default
    (:attr:`.specs.LoadedModel.default_include`), except for the resume of a store that
    records ``include=None`` (every module: a Hugging Face model folder captured without
    ``--include`` by a version whose default was every module), which tracks every module
    as the store was captured, since no ``--include`` pattern selects exactly that.
    ``recorded``: the include patterns the store at ``out`` that a resume continues records
    (:func:`_recorded_include`; under torchrun, for a rank without a rank store, those the
    other ranks' stores record: :func:`_agreed_settings`).

    Raises
    ------
    SpecError
        No ``include`` for a model spec that needs one (a Hugging Face model without a stack
        of repeated blocks: :attr:`.specs.LoadedModel.needs_include`).
    """
    if include:
        return list(include), ""
    if resume and (loaded.default_include is not None or loaded.needs_include) and recorded is None:
        return None, "every module, as the store was captured"
    if loaded.needs_include:
        raise SpecError(loaded.needs_include)
    return loaded.default_include, loaded.default_note


#: :func:`_recorded_include` of a store that records no include patterns.
_UNRECORDED = object()


def _recorded_include(store: Any) -> Any:
    """The ``include`` patterns an opened ``store`` records (``capture_config["patterns"]``):
    a list of str, None (every module), or :data:`_UNRECORDED` for a store written before
    the patterns were recorded."""
    config = store.attrs.get("capture_config")
    patterns = config.get("patterns") if isinstance(config, dict) else None
    if not isinstance(patterns, dict) or "include" not in patterns:
        return _UNRECORDED
    recorded = patterns["include"]
    if recorded is None or (isinstance(recorded, list) and recorded and all(isinstance(p, str) for p in recorded)):
        return recorded
    return _UNRECORDED


def _warn_padded_ids(tensor: Any, tokenizer: Any, data: str) -> None:
    """Warn when tensor data of token ids ``(batch, pos)`` starts or ends with the model's
    pad token id: a tensor file gives the model no attention mask, so those positions are
    attended to and stored as if they were text.

    Where the pad id is also the tokenizer's BOS or EOS id (GPT-2's 50256, which SAE token
    data begins or ends each context with), one such id at an end is that token, not
    padding: a sample counts as padded when two of them end or start it."""
    import torch

    pad = getattr(tokenizer, "pad_token_id", None)
    if (isinstance(pad, bool) or not isinstance(pad, int) or not isinstance(tensor, torch.Tensor)
            or tensor.dim() != 2 or tensor.shape[1] < 2 or tensor.dtype.is_floating_point
            or tensor.dtype.is_complex or tensor.dtype == torch.bool):
        return
    ends = (tensor[:, -1] == pad) | (tensor[:, 0] == pad)
    if pad in (getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        ends = ((tensor[:, -1] == pad) & (tensor[:, -2] == pad)) | ((tensor[:, 0] == pad) & (tensor[:, 1] == pad))
    padded = int(ends.sum())
    if padded:
        from ..errors import CaptureWarning

        warn_at_caller(CaptureWarning(
            f"--data {data!r} holds token ids padded with the tokenizer's pad token id {pad} ({padded} of "
            f"{tensor.shape[0]} samples start or end with it), but a tensor file gives the model no attention "
            "mask: padded positions are attended to and stored as rows like real tokens. Give the text instead "
            "(a text file, one sample per line: each batch is tokenized with its attention mask, and padding "
            "never enters the store), or ids of one length without padding"
        ))


def _check_no_writer(out: str) -> None:
    """A resume with nothing left to capture opens no writer, so the writer lock is taken and
    given back here first: a store another process is still writing is refused as such
    (StoreLockedError naming its pid and host), not compared, half written, with this run."""
    from ..store._backend import resolve
    from ..store._lock import WriterLock

    with WriterLock(resolve(out)):
        pass


def _check_resumed_model(out: str, model: Any, store: Any) -> None:
    """The store writer's model check (:func:`~activationscope.store.writer.check_same_model`)
    for a resume with nothing left to capture, which opens no writer; ``store``: the store at
    ``out``, opened."""
    import torch

    from ..store.writer import check_same_model, model_identity

    if isinstance(model, torch.nn.Module):
        check_same_model(out, store.attrs, model_identity(model))


def _check_resumed_texts(out: str, dataset: Any, data: str, first: int, store: Any) -> None:
    """A resume continues the data the store was captured from at its next sample: text data
    whose first ``first`` samples are not the stored ones (another file, or this one edited)
    would append other texts to them under sample ids that say otherwise. The store's sample
    table records each sample's ``sample_id``, ``text`` and ``label``: the data's first
    ``first`` samples must have the same (ArgumentValueError naming the first that differs;
    nothing changed). A store whose table has no ``text`` column is not checked. ``store``: the
    store at ``out``, opened; only those three columns of its table are read."""
    table = store.row_table("sample", columns=["sample_id", "text", "label"])
    if "text" not in table.column_names or table.num_rows != first:
        return
    _require_row_columns(store, "sample", table, ["sample_id"])
    stored_ids = table.column("sample_id").to_pylist()
    stored_texts = table.column("text").to_pylist()
    stored_labels = table.column("label").to_pylist() if "label" in table.column_names else None
    order = sorted(range(first), key=lambda i: stored_ids[i])
    ids = dataset.sample_ids[:first] if dataset.sample_ids is not None else list(range(first))
    labels = dataset.labels[:first] if dataset.labels is not None else None
    fix = ("resume with the data the store was captured from, or pass --overwrite instead of --resume to capture "
           "this data into a new store (nothing was changed)")

    def short(text: Any) -> str:
        text = str(text)
        return repr(text if len(text) <= 60 else text[:57] + "...")

    for k, i in enumerate(order):
        if stored_ids[i] != ids[k]:
            raise ArgumentValueError(
                f"--resume: store {out!r} holds sample ids up to {max(stored_ids)}, but sample {k} of --data {data!r} "
                f"has id {ids[k]} where the store has {stored_ids[i]} (blank lines moved), so it is not the data the "
                f"store was captured from; {fix}")
        if stored_texts[i] != dataset.texts[k]:
            raise ArgumentValueError(
                f"--resume: store {out!r} holds {first} samples, but --data {data!r} is not the data they were "
                f"captured from: sample {ids[k]} is {short(dataset.texts[k])} there and {short(stored_texts[i])} in "
                f"the store; {fix}")
        if stored_labels is not None and labels is not None and str(stored_labels[i]) != str(labels[k]):
            raise ArgumentValueError(
                f"--resume: store {out!r} holds {first} samples, but --data {data!r} labels them otherwise: sample "
                f"{ids[k]} has label {str(labels[k])!r} there and {str(stored_labels[i])!r} in the store; {fix}")
    if (stored_labels is None) != (labels is None):
        has, lacks = ("the store", f"--data {data!r}") if labels is None else (f"--data {data!r}", "the store")
        raise ArgumentValueError(
            f"--resume: store {out!r} holds {first} samples, but {has} has labels (__label__ tags) and {lacks} has "
            f"none, so it is not the data the store was captured from; {fix}")


def _require_row_columns(store: Any, kind: str, table: Any, names: Sequence[str]) -> None:
    """Raise :class:`StoreCorruptError` naming the store, the ``kind`` row table and the column
    when a table holding rows lacks one of ``names``, columns every row table of its kind has
    (FORMAT.md §4: ``sample_id``; ``pos`` of a token table): a damaged or hand-made store,
    whose rows the resume checks cannot tell."""
    from ..store import _validate as V

    missing = [c for c in names if c not in table.column_names]
    if table.num_rows and missing:
        raise V.corrupt(store._backend, f"its {kind} row table holds {table.num_rows} rows but no {missing[0]!r} "
                                        f"column, which every {kind} row table has (it has {table.column_names})")


def _check_resumed_token_ids(out: str, dataset: Any, data: str, model: str, tokenizer: Any, first: int,
                             store: Any) -> None:
    """A resumed text capture tokenizes its texts as the stored ones were: the token ids the
    store holds for its first and last stored samples (``token_ids`` of the token row table)
    must be those the tokenizer of ``model`` gives their texts now, cut where the stored ones
    are (a ``--max-length`` other than the store's is refused, or warned about, by
    :func:`_resumed_max_length`). Another tokenizer with the same weights (an edited
    ``tokenizer.json``, other special tokens, another truncation side) would store rows of
    other tokens, named otherwise, next to the stored ones: refused (ArgumentValueError naming
    the sample and both ids; nothing changed). A store without token ids (an earlier
    version's), with none for those samples, or one that keeps reductions only (no token
    table), is not checked. ``store``: the store at
    ``out``, opened; only the ``sample_id``, ``pos`` and ``token_ids`` of its token table are
    read."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not store.rows_stored:  # (a store that keeps reductions only has no token table: not checked)
        return
    table = store.row_table("token", columns=["sample_id", "pos", "token_ids"])
    if "token_ids" not in table.column_names:
        return
    _require_row_columns(store, "token", table, ["sample_id", "pos"])
    if not table.num_rows or not pa.types.is_integer(table.schema.field("sample_id").type):
        return
    ids = dataset.sample_ids if dataset.sample_ids is not None else range(len(dataset))
    for k in dict.fromkeys((0, first - 1)):
        rows = table.filter(pc.equal(table.column("sample_id"), ids[k]))
        stored = rows.column("token_ids").to_pylist()
        if not stored or None in stored or rows.column("pos").to_pylist() != list(range(len(stored))):
            continue  # (no ids, or the rows of more than one text: not checked)
        try:
            now = [int(t) for t in tokenizer([dataset.texts[k]], padding=True, truncation=True,
                                             max_length=len(stored), return_tensors="pt")["input_ids"][0].tolist()]
        except Exception:  # noqa: BLE001 - a cut the tokenizer refuses (special tokens only): not checked
            continue
        if stored != now:
            def short(values: list[int]) -> str:
                return str(values) if len(values) <= 12 else str(values[:12])[:-1] + ", ...]"

            raise ArgumentValueError(
                f"--resume: store {out!r} holds sample {ids[k]} of --data {data!r} as the token ids {short(stored)}, "
                f"but the tokenizer of --model {model!r} gives its text the token ids {short(now)}, so this run "
                "would store its texts' rows as other tokens than the stored ones; resume with the tokenizer the "
                "store was captured with, or pass --overwrite instead of --resume to capture every text again "
                "(nothing was changed)")


def tensor_fingerprint(tensor: Any, n: int) -> dict[str, Any]:
    """``{"samples": n, "sha256": ...}``: the sha256 of the first ``n`` samples of tensor
    data (their dtype, shape and bytes), recorded in a capture's provenance so that a
    ``--resume`` can tell the data it was captured from (:func:`_check_resumed_tensor`)."""
    import hashlib

    import torch

    part = tensor[:n].contiguous()
    digest = hashlib.sha256(f"{part.dtype}{tuple(part.shape)}".encode())
    if part.numel():
        digest.update(memoryview(part.reshape(-1).view(torch.uint8).numpy()))
    return {"samples": int(n), "sha256": digest.hexdigest()}


def _check_resumed_tensor(out: str, tensor: Any, data: str, first: int, store: Any) -> None:
    """Tensor data of a resume must start with the samples the store was captured from: each
    run records the sha256 of the first ``samples`` samples of its data (``data_fingerprint``
    in the store's provenance, a resumed run's in its entry of ``resumes``;
    :func:`tensor_fingerprint`). The fingerprint covering the fewest samples that still
    cover the ``first`` stored ones is compared: data whose first ones hash otherwise is
    another data set, and so is data with fewer samples than that fingerprint covers (the
    run that recorded it read that many: a file cut or rewritten since), both refused with
    ArgumentValueError, nothing changed. A store recording no fingerprint (an earlier
    version's, or a capture from Python) is not checked; one whose fingerprints all cover
    fewer samples than it holds is checked by the widest of them. ``store``: the store at
    ``out``, opened."""
    from ..store.writer import resume_history

    provenance = store.attrs.get("provenance")
    if not isinstance(provenance, dict):
        return
    runs = [provenance, *(r for r in resume_history(provenance) if isinstance(r, dict))]
    _check_fingerprints(out, tensor, data, first, runs)


def _check_committed_tensor(out: str, tensor: Any, data: str, first: int, store: Any) -> None:
    """Tensor data of a torchrun resume of a committed store (``store``, opened; ``first`` its
    samples) must hold, in each rank's part, the samples that rank captured: the store's
    provenance keeps every rank's runs (rank 0's, the others' in ``resumes``: the commit
    keeps each one that differs), each with the part of the data it captured (``rank_part``:
    ``start``, ``stop``) and the sha256 of its samples (``data_fingerprint``). Each part is
    checked as a resumed store is (:func:`_check_resumed_tensor`): samples
    ``[start, stop)`` of ``tensor`` that hash otherwise, or fewer than were read, are
    refused with ArgumentValueError, nothing changed. Runs recording no part or no
    fingerprint (a store committed by an earlier version, rank stores captured from Python)
    are not checked."""
    from ..store.writer import resume_history

    provenance = store.attrs.get("provenance")
    if not isinstance(provenance, dict):
        return
    parts: dict[tuple[int, int], list[dict]] = {}
    for run in [provenance, *resume_history(provenance)]:
        part = run.get("rank_part") if isinstance(run, dict) else None
        bounds = (part.get("start"), part.get("stop")) if isinstance(part, dict) else (None, None)
        if all(isinstance(b, int) and not isinstance(b, bool) for b in bounds) and 0 <= bounds[0] <= bounds[1]:
            parts.setdefault(bounds, []).append(run)
    for (start, stop), runs in sorted(parts.items()):
        _check_fingerprints(out, tensor[start:stop], data, stop - start, runs, (start, stop, first))


def _check_fingerprints(out: str, tensor: Any, data: str, first: int, runs: list[dict],
                        part: tuple[int, int, int] | None = None) -> None:
    """:func:`_check_resumed_tensor` of the runs ``runs`` (provenance records; those without
    a valid ``data_fingerprint`` are left out) that captured the ``first`` samples of
    ``tensor``: where ``part`` is ``(start, stop, n)``, ``tensor`` is samples
    ``[start, stop)`` of the data given, a rank's part of a committed store of ``n``
    samples (:func:`_check_committed_tensor`)."""
    prints = [r.get("data_fingerprint") for r in runs]
    prints = [p for p in prints if isinstance(p, dict) and isinstance(p.get("samples"), int)
              and not isinstance(p.get("samples"), bool) and p["samples"] > 0 and isinstance(p.get("sha256"), str)]
    if part is not None:  # (a rank's run read its part only: a longer record is no record of it)
        prints = [p for p in prints if p["samples"] <= part[1] - part[0]]
    if not prints:
        return
    covering = [p for p in prints if p["samples"] >= first]
    recorded = min(covering, key=lambda p: p["samples"]) if covering else max(prints, key=lambda p: p["samples"])
    n = recorded["samples"]
    fix = ("resume with the data the store was captured from, or pass --overwrite instead of --resume to capture "
           "this data into a new store (nothing was changed)")
    shape = f"dtype {tensor.dtype}, shape {tuple(tensor.shape[1:])} each"
    held = first
    if part is None:
        cut = (f"it has {len(tensor)} samples, and the run that captured them read {n} (data_fingerprint in the "
               f"store's provenance), so the file was cut or rewritten since and its first {first} samples cannot be "
               "told from those stored")
        other = (f"its first {n} samples ({shape}) differ from those the store recorded (sha256 in its provenance, "
                 "data_fingerprint)")
    else:
        start, stop, held = part
        record = f"data_fingerprint of the run whose rank_part is [{start}, {stop}), in the store's provenance"
        cut = (f"it has {len(tensor)} samples from sample {start} on, and the rank that captured samples "
               f"{start}..{stop - 1} read {n} ({record}), so the file was cut or rewritten since and the samples "
               "stored cannot be told from those given")
        other = (f"its samples {start}..{start + n - 1} (a rank's part of the data; {shape}) differ from those that "
                 f"rank recorded (sha256 in its provenance, {record})")
    said = f"--resume: store {out!r} holds {held} samples, but --data {data!r} is not the data they were captured from"
    if n > len(tensor):
        raise ArgumentValueError(f"{said}: {cut}; {fix}")
    if tensor_fingerprint(tensor, n)["sha256"] != recorded["sha256"]:
        raise ArgumentValueError(f"{said}: {other}; {fix}")


def _check_resumed_labels(out: str, labels: Sequence[Any] | None, data: str, first: int, store: Any) -> None:
    """The ``--labels`` of a resumed capture of tensor data must give the stored samples the
    labels the store holds (the ``label`` column of its row table), and a store with labels
    needs them as one without refuses them: otherwise the store's label column would stop or
    start part way, or label the later rows by another list (ArgumentValueError; nothing
    changed). A store whose row table does not cover its ``first`` samples is not checked.
    ``store``: the store at ``out``, opened; only the ``sample_id`` and ``label`` of its table
    are read. A row table that cannot be read (a damaged part) raises its StoreError: it says
    nothing of the store's labels."""
    table = None
    # (a store without a table of a kind reads an empty one; one that keeps reductions only has no token table)
    for kind in ("sample", "token") if store.rows_stored else ("sample",):
        table = store.row_table(kind, columns=["sample_id", "label"])
        if table.num_rows:
            break
    if table is None:
        return
    _require_row_columns(store, kind, table, ["sample_id"])
    if "sample_id" not in table.column_names:  # (an empty table)
        return
    fix = ("resume with the --labels the store was captured with, or pass --overwrite instead of --resume to "
           "capture this data into a new store (nothing was changed)")
    stored = "label" in table.column_names
    if stored != (labels is not None):
        raise ArgumentValueError(
            f"--resume: store {out!r} holds {first} samples " + ("with labels, but no --labels was given" if stored
                                                                 else "without labels, but --labels was given")
            + f", so its label column would not cover every row; {fix}")
    if not stored:
        return
    seen: dict[int, Any] = {}
    for sid, label in zip(table.column("sample_id").to_pylist(), table.column("label").to_pylist()):
        seen.setdefault(sid, label)
    for sid in sorted(seen):
        if isinstance(sid, int) and 0 <= sid < len(labels) and str(seen[sid]) != str(labels[sid]):
            raise ArgumentValueError(
                f"--resume: store {out!r} holds {first} samples, but --labels gives sample {sid} the label "
                f"{str(labels[sid])!r} where the store has {str(seen[sid])!r}, so they are not the labels the store "
                f"was captured with; {fix}")


def _check_resumed_side(out: str, capture: str, store: Any) -> None:
    """A resume with nothing left to capture runs no forward, so a ``--capture`` that would
    give other hook points is found from the store's recorded capture settings (of ``store``,
    the store at ``out``, opened): refused (CaptureError, nothing changed) when they differ."""
    from ..errors import CaptureError

    config = store.attrs.get("capture_config")
    stored = config.get("capture") if isinstance(config, dict) else None
    if isinstance(stored, str) and stored != capture:
        raise CaptureError(
            f"--resume: store {out!r} was captured with --capture {stored}, this run asks for --capture {capture}, "
            f"which gives other hook points; resume with --capture {stored}, or pass --overwrite instead of "
            "--resume to capture anew (nothing was changed)")


def _check_full_resume(out: str, model: Any, *, include: list[str] | None, exclude: list[str] | None,
                       capture: str, storage_dtype: Any, token_rows: Any = None, complete: bool = False,
                       provenance: dict[str, Any] | None = None, rows: str = "auto") -> bool:
    """The checks of a resume (the writer's model and storage dtype, the tracker's stored hook
    points and recorded include / exclude patterns) for one with nothing left to capture and
    no reductions, which captures nothing (CaptureError when refused; HookPointNotFoundError
    for a ``token_rows`` pattern that selects none of the stored hook points; the store is
    then left as it was).

    With ``complete`` (the store holds every sample of the data, not only the first
    ``max_samples``), a store found ``incomplete`` (its run stopped after its last sample was
    committed, before it closed) is closed by this resume, ``complete``, its provenance adding
    this run to ``resumes``: True. Otherwise the writer is discarded, the store left as it
    was: False."""
    from .. import store as _store  # noqa: F401 - registers the store writer with capture
    from ..capture.scope import ActivationScope

    options: dict[str, Any] = {"resume": True, "provenance": dict(provenance or {})}
    scope = ActivationScope(store=out, store_options=options, storage_dtype=storage_dtype, capture=capture, rows=rows)
    tracker = scope.track(model, include=include, exclude=exclude, token_rows=token_rows)
    tracker.attach()  # refused here (the writer discarded) when the store's hook points or dtype differ
    tracker._detach()
    tracker._closed = True
    try:  # a token_rows= pattern selecting none of the stored hook points: refused (the writer discarded)
        tracker._check_reduction_patterns(sorted(tracker._stored or ()), "the store holds")
    except BaseException as e:
        raise _token_rows_flag_error(e, token_rows) from None
    if complete and tracker.writer.found_status == "incomplete":
        tracker.writer.close()
        return True
    tracker.writer.discard()
    return False


def capture_store_options(
    *, model: str, data: str, command: str | None = None, resume: bool = False, overwrite: bool = False,
    compression: str | None = None, shard_bytes: int | None = None, chunk_rows: int | None = None,
    max_length: int | None = None, padding: str | None = None,
) -> dict[str, Any]:
    """``store_options`` of :class:`ActivationScope` for a capture of ``model`` over ``data``:
    provenance (with ``max_length``, the token limit of text data, and ``padding``, how its
    batches are padded, when given), and only the
    options that were given (``compression='none'`` is the default).
    Raises ArgumentTypeError for a ``resume`` or ``overwrite`` that is not a bool."""
    from .._args import parse_flag

    options: dict[str, Any] = {"provenance": {"model": model, "data": data, "command": command or ""}}
    if max_length is not None:
        options["provenance"]["max_length"] = int(max_length)
    if padding is not None:
        options["provenance"]["padding"] = str(padding)
    if parse_flag(overwrite, "overwrite"):
        options["overwrite"] = True
    if parse_flag(resume, "resume"):
        options["resume"] = True
    if compression and compression != "none":
        options["compression"] = compression
    if shard_bytes is not None:
        options["shard_bytes"] = shard_bytes
    if chunk_rows is not None:
        options["chunk_rows"] = chunk_rows
    return options


def resume_offset(out: Any) -> int:
    """Samples already committed in the store at ``out``: the position in the data of the
    first sample a resumed capture captures (its sample id too, except for text files with
    blank lines, whose sample ids are line numbers).

    ``out``: the store's path or URL, or the store opened (:func:`~activationscope.store.open_store`),
    which is read, not opened again.

    Raises
    ------
    ArgumentValueError
        ``out`` is a local path where nothing is.
    StoreError
        No store opens at ``out``.
    """
    from ..store import Store

    if isinstance(out, Store):
        return int(out.n_samples)
    store = _open_resumed(out)
    try:
        return int(store.n_samples)
    finally:
        store.close()


def _open_resumed(out: str, reductions_only: bool | None = None) -> Any:
    """The store at ``out`` that a resume continues, opened: once per resume, its one snapshot
    read by every check of the resume (:func:`capture_dataset`). ``reductions_only``: whether
    the resume keeps reductions only (``--reductions-only``); None checks nothing of it.

    Raises
    ------
    ArgumentValueError
        ``out`` is a local path where nothing is (``--resume`` without a store).
    StoreError
        No store opens at ``out``; or it keeps reductions only and the resume stores rows (no
        ``--reductions-only``), or the other way round; nothing changed.
    """
    from ..store import open_store
    from ..store._backend import local_path

    local = local_path(out)
    if local is not None and not os.path.exists(local):
        raise ArgumentValueError(f"--resume: store {out!r} does not exist; drop --resume to start a new store")
    store = open_store(out)
    if reductions_only is not None and store.rows_stored == reductions_only:
        store.close()
        if reductions_only:
            raise StoreError(f"--resume --reductions-only: store {out!r} stores activation rows, and one store cannot "
                             "hold both; nothing was changed. Drop --reductions-only to continue it, or capture into "
                             "another --out")
        raise StoreError(f"--resume: store {out!r} keeps reductions only (captured with --reductions-only): pass "
                         "--reductions-only with the same --reduce to continue it; nothing was changed")
    return store


def check_reductions(names: Sequence[str] | None) -> list[Any] | None:
    """``names`` as a list of reduction specs (None when empty), each a built-in reduction,
    optionally with options in brackets: ``hist[lo=-4,hi=4,bins=32]``, ``topk[k=5]``,
    ``var[ddof=1]`` (a spec with options becomes ``(name, name, {option: float})``).

    Raises
    ------
    ArgumentValueError
        A name that is not in ``BUILTIN_REDUCTIONS``, malformed options, an option given
        twice (``hist[lo=-4,hi=4,lo=0]``), a reduction given twice (``var,var[ddof=1]``:
        both are named ``var``), or options the
        reduction refuses (``hist`` without ``lo`` and ``hi``); the message shows the syntax.
    """
    if not names:
        return None
    from ..capture.reductions import BUILTIN_REDUCTIONS, make_reduction

    out: list[Any] = []
    given: dict[str, str] = {}  # reduction name -> the --reduce item that gave it
    for spec in names:
        m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*(?:\[(.*)\])?\s*", spec)
        if m is None and spec.strip().lower().endswith(".pt"):
            raise ArgumentValueError(
                f"--reduce: {spec!r} looks like a custom reduction file; --reduce takes built-in reductions only "
                f"({', '.join(BUILTIN_REDUCTIONS)}). Capture with a custom reduction from Python: "
                f"ActivationScope(reductions=[{spec.strip()!r}]) ({docs_page('docs/usage/reductions.md', 'Custom reductions')})")
        if m is None:
            raise ArgumentValueError(f"--reduce: {spec!r} is not a reduction name or name[option=value,...] "
                                     "(e.g. hist[lo=-4,hi=4,bins=32])")
        name, body = m.group(1), m.group(2)
        if name not in BUILTIN_REDUCTIONS:
            raise ArgumentValueError(
                f"--reduce: unknown reduction {name!r}; built-in reductions are {list(BUILTIN_REDUCTIONS)}")
        if name in given:  # a store holds one result per reduction name at a hook point
            raise ArgumentValueError(
                f"--reduce: {given[name]!r} and {spec.strip()!r} both give a reduction named {name!r}, and a hook "
                f"point holds one reduction per name; drop one of them (a second {name} with other options can be "
                "captured into another store)")
        given[name] = spec.strip()
        opts: dict[str, float] = {}
        for part in (body.split(",") if body and body.strip() else []):
            key, eq, text = part.partition("=")
            key = key.strip()
            try:
                if not eq or not key.isidentifier():
                    raise ValueError
                value = float(text)
            except ValueError:
                raise ArgumentValueError(f"--reduce {spec!r}: options are option=number pairs separated by commas, "
                                         f"got {part.strip()!r} (e.g. hist[lo=-4,hi=4,bins=32])") from None
            if key in opts:
                raise ArgumentValueError(f"--reduce {spec!r}: option {key!r} is given twice; give each option once "
                                         "(e.g. hist[lo=-4,hi=4,bins=32])")
            opts[key] = value
        try:
            make_reduction(name, **opts)  # the reduction's own checks of its options, before any capture
        except Exception as e:  # noqa: BLE001 - ReductionError / ValueError: reported as an argument error
            fix = " (e.g. hist[lo=-4,hi=4,bins=32])" if name == "hist" else ""
            raise ArgumentValueError(f"--reduce {spec!r}: {e}{fix}") from None
        out.append((name, name, opts) if opts else name)
    return out


def check_out(out: str, *, resume: bool, overwrite: bool, replaces: str | None = None) -> None:
    """Refuse an ``out`` that is not a store (or a new or empty path), saying what is there;
    ``--overwrite`` and ``--resume`` are offered only where they apply. ``replaces`` says
    what a command without ``--overwrite`` replaces (the demo: "the demo replaces only
    stores it wrote"), said instead of offering ``--overwrite``. A ``file://`` URL is
    checked as the local path it names; other URLs are not checked here (the store writer
    checks them).

    Raises
    ------
    ArgumentValueError
        ``resume`` without a store; ``out`` a file, a folder or a Zarr node that is not an
        activationscope store; an existing store without ``resume`` or ``overwrite``; ``out``
        inside an activationscope store (symlinks resolved).
    """
    from pathlib import Path

    from ..store._backend import LocalBackend, check_local_store_path, describe_local_path, local_path

    path = local_path(out)
    if path is None:
        return

    for above in reversed(Path(path).resolve().parents):  # the outermost first; symlinks resolved
        if (above / "zarr.json").is_file() and (describe_local_path(above) or ("",))[0] == "store":
            raise ArgumentValueError(
                f"--out {out!r} is inside the store {str(above)!r}: the capture would write a store among that "
                "store's files (and replacing that store would delete it); choose a path outside it")
    found = describe_local_path(path)
    kind = found[0] if found else None
    if kind is None:
        if resume:
            raise ArgumentValueError(f"--resume: store {out!r} does not exist; drop --resume to start a new store")
        check_local_store_path(path)  # a file above it
        return
    if kind == "empty":
        if resume:
            raise ArgumentValueError(
                f"--resume: {out!r} is an empty folder, not a store; drop --resume to start a new store")
        return
    if kind == "folder":  # (the half of a store an interrupted local overwrite left at the path?)
        moved = LocalBackend(path).moved_aside_hint()
        if moved and overwrite and replaces is None:
            return  # the store writer finishes that overwrite (store.md, "Options")
        if moved:
            raise ArgumentValueError(f"--out {out!r} holds no root document (zarr.json): {moved} (CLI: --overwrite); "
                                     "nothing was changed")
    if kind != "store":
        what = replaces or "--overwrite only replaces activationscope stores"
        raise ArgumentValueError(
            f"--out {out!r} is {found[1]}; choose another path ({what}, and never deletes anything else; nothing "
            "was changed)"
        )
    if not (resume or overwrite):
        raise ArgumentValueError(
            f"--out {out!r} is {found[1]}; pass --overwrite to replace it or --resume to continue it")


def _dtype_hint(model: Any, inputs: Any) -> str:
    """``"; --data holds float64 values ..."`` when the failed forward's input is a float tensor
    of another dtype than the model's floating parameters (numpy's default float64 data into
    a float32 model), else ``""``: torch's own message does not name the data."""
    import torch

    if not isinstance(inputs, torch.Tensor) or not inputs.dtype.is_floating_point:
        return ""
    params = {p.dtype for p in model.parameters() if p.dtype.is_floating_point}
    if len(params) != 1 or inputs.dtype in params:
        return ""
    return _save_as_hint(inputs.dtype, next(iter(params)))


def _save_as_hint(got: Any, want: Any) -> str:
    """``"; --data holds <got> values and the model's parameters are <want>: save it as ..."``
    for torch dtypes ``got`` (the data's) and ``want`` (the model's floating parameters')."""
    got, want = str(got).removeprefix("torch."), str(want).removeprefix("torch.")
    how = f"numpy: x.astype(np.{want}), " if want != "bfloat16" else ""  # (numpy has no bfloat16: a .pt file)
    return (f"; --data holds {got} values and the model's parameters are {want}: save it as {want} "
            f"({how}torch: x.to(torch.{want}))")


def _first_layer(model: Any) -> tuple[str, Any] | None:
    """The first module (in definition order) that is a Linear, ConvNd or Embedding: the
    layer a tensor input most likely reaches first; None without one."""
    import torch

    kinds = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
    return next(((name, m) for name, m in model.named_modules() if isinstance(m, kinds)), None)


def _input_hint(model: Any, inputs: Any, data: str | None) -> str:
    """What a forward that failed on a tensor batch of ``--data`` was given and, where it
    does not fit, what the model's first layer (:func:`_first_layer`) takes: ``"; --data
    'x.npy' gave the model a batch of shape (32, 7) (samples of shape (7,), float32); its first
    layer '0' (Linear) takes samples whose last dim is in_features=6"``, then
    :func:`_dtype_hint`. ``""`` for a batch that is not one tensor (text batches) or without
    ``data``."""
    import torch

    if data is None or not isinstance(inputs, torch.Tensor):
        return _dtype_hint(model, inputs)
    got = str(inputs.dtype).removeprefix("torch.")
    hint = (f"; --data {data!r} gave the model a batch of shape {tuple(inputs.shape)} (samples of shape "
            f"{tuple(inputs.shape[1:])}, {got})")
    first = _first_layer(model)
    if first is not None:
        name, layer = first
        where = f"its first layer {name!r} ({type(layer).__name__})"
        if isinstance(layer, torch.nn.Linear) and (inputs.dim() < 2 or inputs.shape[-1] != layer.in_features):
            hint += f"; {where} takes samples whose last dim is in_features={layer.in_features}"
        elif isinstance(layer, torch.nn.Embedding) and (inputs.dtype.is_floating_point or inputs.dtype == torch.bool):
            hint += (f"; {where} takes integer token ids (0..{layer.num_embeddings - 1}), not {got} values: save "
                     "the ids as int64")
        elif isinstance(layer, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            k = len(layer.kernel_size)
            if inputs.dim() != k + 2 or inputs.shape[1] != layer.in_channels:
                spatial = {1: "L", 2: "H, W", 3: "D, H, W"}[k]
                hint += (f"; {where} takes samples of shape ({layer.in_channels}, {spatial}): in_channels="
                         f"{layer.in_channels} first")
        if not isinstance(layer, torch.nn.Embedding) and not inputs.dtype.is_floating_point:
            weight = getattr(layer, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dtype.is_floating_point:
                return hint + _save_as_hint(inputs.dtype, weight.dtype)
    return hint + _dtype_hint(model, inputs)


def _decoder_hint(model: Any, inputs: Any) -> str:
    """``"; <model> is an encoder-decoder model ..."`` when the failed forward was an
    encoder-decoder model's given no decoder input: the command gives a text's ``input_ids`` and
    ``attention_mask`` only, which BART turns into its decoder's input (shifted) and T5 does not
    (it raises about the decoder's missing ``input_ids``), else ``""``."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or not isinstance(inputs, dict):
        return ""
    if any(k in inputs for k in ("decoder_input_ids", "decoder_inputs_embeds", "labels")):
        return ""
    return (f"; {type(model).__name__} is an encoder-decoder model, and the command gives it each text as "
            "input_ids and attention_mask only, without a decoder input, which this model does not make from "
            "them (BART does, T5 does not): capture it in Python, giving the decoder its input and each side its "
            f"own mask ({docs_page('docs/usage/capture.md', 'Encoder-decoder models and other models of two sequences')})")


def _batch_len(inputs: Any) -> int:
    if isinstance(inputs, dict):
        first = next(iter(inputs.values()))
        return int(first.shape[0])
    return int(inputs.shape[0])


def _written_bytes(tracker: Any, out: str) -> int:
    # Bytes in the store folder so far (durable shards and the shards being appended to);
    # 0 for remote stores, which upload whole shards at commits.
    return dir_bytes(out)


# ---------------------------------------------------------------------------- model and data loading


def text_batches(
    texts: Sequence[str], tokenizer: Any, batch_size: int, max_length: int,
    labels: Sequence[Any] | None = None, first_id: int = 0, extra: dict[str, Sequence[Any]] | None = None,
    sample_ids: Sequence[int] | None = None, max_positions: int | None = None, warn_cut: bool = True,
    resumed: bool = False, padding: str = "longest",
) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """Tokenized batches with their ``set_batch`` arguments (mask, sample ids, label, text,
    and the per-token column ``token_ids``: the ``input_ids``, which the store takes at the
    mask, as it takes the token rows).

    The sample ids are ``sample_ids`` (one per text, e.g. line numbers of a text file) when
    given, else ``first_id``, ``first_id + 1``, ...; the ``text`` and ``label`` columns are
    sliced alongside them. Texts longer than ``max_length`` tokens are cut to their first
    ``max_length``: once the last batch is yielded, one ``CaptureWarning`` says how many were
    and how long the longest is, with the ``--max-length`` that keeps every token
    (``max_positions``, the positions the model takes, when given, bounds that advice);
    ``warn_cut=False`` for a caller that cuts its texts on purpose and says so itself;
    ``resumed=True`` words that advice for a resume, which keeps the store's ``--max-length``.
    ``padding``: ``"longest"`` pads each batch to its longest text, ``"max_length"`` every batch
    to ``max_length`` tokens (:data:`PADDINGS`).
    """
    if sample_ids is not None and len(sample_ids) != len(texts):
        raise ArgumentValueError(f"sample_ids must have one entry per text ({len(texts)}), got {len(sample_ids)}")
    n_cut, longest = 0, (0, -1)  # texts cut to max_length; (tokens, -sample id) of the longest
    for start, enc in iter_text_batches(texts, tokenizer, batch_size, max_length, padding=padding):
        n = enc["input_ids"].shape[0]
        for i, length in _cut_lengths(texts[start:start + n], enc, tokenizer, max_length):
            n_cut += 1
            sid = int(sample_ids[start + i]) if sample_ids is not None else first_id + start + i
            longest = max(longest, (length, -sid))
        info: dict[str, Any] = {
            "attention_mask": enc["attention_mask"],
            "sample_ids": (list(sample_ids[start:start + n]) if sample_ids is not None
                           else list(range(first_id + start, first_id + start + n))),
            "text": list(texts[start:start + n]),
        }
        ids = enc.get("input_ids")
        if hasattr(ids, "shape") and tuple(ids.shape) == tuple(enc["attention_mask"].shape):
            info["token_ids"] = ids  # the tokenizer's id of every token row, taken at the mask as the rows are
        if labels is not None:
            info["label"] = list(labels[start:start + n])
        for key, col in (extra or {}).items():
            info[key] = list(col[start:start + n])
        yield start, enc, info
    if n_cut and warn_cut:
        from ..errors import CaptureWarning

        flag = "--overwrite --max-length" if resumed else "--max-length"  # a resume keeps the store's
        if max_positions is not None and longest[0] > max_positions:
            fix = (f"the model takes at most {max_positions} positions: split the longer texts into several samples "
                   "to keep every token")
            if max_length < max_positions:
                fix = f"pass {flag} {max_positions} to keep more; " + fix
        else:
            fix = f"pass {flag} {longest[0]} to keep every token"
        warn_at_caller(CaptureWarning(
            f"{n_cut} of the {len(texts)} text samples of this run are longer than --max-length {max_length} tokens "
            f"(special tokens included; the longest, sample {-longest[1]}, has {longest[0]}): each was cut to its "
            f"{'last' if getattr(tokenizer, 'truncation_side', 'right') == 'left' else 'first'} {max_length} tokens, "
            f"and the rest of it is not in the store; {fix}"))


def _cut_lengths(texts: Sequence[str], encoded: Any, tokenizer: Any, max_length: int) -> list[tuple[int, int]]:
    """``(index in texts, length in tokens)`` of the texts that ``encoded`` (truncated to
    ``max_length``) holds cut short. Only the texts that fill ``max_length`` are tokenized
    again, without truncation, to learn their full length."""
    mask = encoded.get("attention_mask")
    if mask is None:
        return []
    full = [i for i, m in enumerate(mask.sum(1).tolist()) if m >= max_length]
    if not full:
        return []
    ids = tokenizer([texts[i] for i in full], truncation=False, padding=False, verbose=False)["input_ids"]
    return [(i, len(row)) for i, row in zip(full, ids) if len(row) > max_length]


def tensor_batches(tensor: Any, batch_size: int, first_id: int = 0, token_ids: bool = False,
                   labels: Sequence[Any] | None = None) -> Iterator[tuple[int, Any, dict[str, Any]]]:
    """Slices of ``tensor`` along dim 0 with their sample ids; with ``token_ids`` (token ids
    ``(batch, pos)`` stored one row per token, ``--rows token``) each slice is also the
    per-token column ``token_ids``: the id of every token row; with ``labels`` (one per
    sample of ``tensor``, ``--labels``) the column ``label`` of the slice's samples."""
    if batch_size < 1:
        raise SpecError(f"--batch-size must be a positive int, got {batch_size}")
    for start in range(0, tensor.shape[0], batch_size):
        chunk = tensor[start:start + batch_size]
        info: dict[str, Any] = {"sample_ids": list(range(first_id + start, first_id + start + chunk.shape[0]))}
        if token_ids:
            info["token_ids"] = chunk
        if labels is not None:
            info["label"] = list(labels[start:start + chunk.shape[0]])
        yield start, chunk, info


def _are_token_ids(tensor: Any) -> bool:
    """Whether tensor data is token ids: integers ``(batch, pos)`` (not bool)."""
    import torch

    return (isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.dtype != torch.bool
            and not tensor.dtype.is_floating_point and not tensor.dtype.is_complex)


def iter_text_batches(
    texts: Sequence[str], tokenizer: Any, batch_size: int, max_length: int = MAX_LENGTH, padding: str = "longest",
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Tokenize ``texts`` batch by batch (padded to the batch's longest, or with
    ``padding="max_length"`` to ``max_length`` tokens; truncated to ``max_length``).

    Yields
    ------
    (start, encoded) : int, dict of Tensor (batch, pos)
        Index of the batch's first text, and the tokenizer output (``input_ids``,
        ``attention_mask``, ...).
    """
    if batch_size < 1:
        raise ArgumentValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if padding not in PADDINGS:
        raise ArgumentValueError(f"padding must be one of {list(PADDINGS)}, got {padding!r}")
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start:start + batch_size])
        encoded = tokenizer(chunk, padding=padding, truncation=True, max_length=max_length, return_tensors="pt")
        yield start, dict(encoded)


# ---------------------------------------------------------------------------------------------
# torchrun: each rank captures its part of the data into one store


def torchrun_ranks() -> tuple[int, int] | None:
    """``(rank, world_size)`` of a capture that several processes run together, or None for
    one process.

    An initialised ``torch.distributed`` default group of more than one rank gives them;
    without one, the environment ``torchrun`` sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``) does, where ``WORLD_SIZE`` is above 1. ``WORLD_SIZE=1`` (or unset) is one
    process.

    Raises
    ------
    ArgumentValueError
        ``WORLD_SIZE`` or ``RANK`` that is not an int, a ``RANK`` outside ``[0, WORLD_SIZE)``,
        or ``WORLD_SIZE`` above 1 without ``RANK``, ``MASTER_ADDR`` or ``MASTER_PORT`` (start
        the command with ``torchrun``, which sets them).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        return (dist.get_rank(), world) if world > 1 else None
    env = os.environ
    if env.get("WORLD_SIZE", "").strip() in ("", "1"):
        return None

    def number(name: str) -> int:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            raise ArgumentValueError(
                f"the environment says WORLD_SIZE={env.get('WORLD_SIZE')!r}, a capture on several processes, but "
                f"{name}={env.get(name)!r} is not an int; start the command with torchrun (which sets RANK, "
                "WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or unset WORLD_SIZE for one process") from None

    world, rank = number("WORLD_SIZE"), number("RANK")
    if world < 1 or not 0 <= rank < world:
        raise ArgumentValueError(f"the environment's RANK={rank} and WORLD_SIZE={world} must satisfy "
                                 "0 <= RANK < WORLD_SIZE; start the command with torchrun")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ArgumentValueError(
            f"the environment says WORLD_SIZE={world}, a capture on several processes, but {' and '.join(missing)} "
            "is not set; start the command with torchrun (which sets it), or unset WORLD_SIZE for one process")
    return rank, world


def _init_rank_group(model: Any) -> bool:
    """Initialise the default process group of a torchrun capture, unless one is (False):
    ``"nccl"`` when ``model`` holds a CUDA tensor (on the GPU ``LOCAL_RANK`` names), else
    ``"gloo"``, with :func:`activationscope.init_process_group` (which works after a torchrun
    restart). True when this call made it: the caller destroys it."""
    import itertools

    import torch
    import torch.distributed as dist

    from ..store.ranks import init_process_group

    if dist.is_initialized():
        return False
    tensors = itertools.chain(getattr(model, "parameters", lambda: ())(), getattr(model, "buffers", lambda: ())())
    if any(getattr(t, "is_cuda", False) for t in tensors):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
        torch.cuda.set_device(device)
        init_process_group("nccl", device_id=device)
    else:
        init_process_group("gloo")
    return True


def _rank_part(dataset: Any, start: int, stop: int) -> Any:
    """Samples ``[start, stop)`` of ``dataset`` (a :class:`.specs.LoadedData`), keeping their
    sample ids (those of the whole data set: ``start`` ... for data without ids of its own)."""
    from .specs import LoadedData

    ids = dataset.sample_ids[start:stop] if dataset.sample_ids is not None else None
    return LoadedData(
        texts=dataset.texts[start:stop] if dataset.texts is not None else None,
        tensor=dataset.tensor[start:stop] if dataset.tensor is not None else None,
        labels=dataset.labels[start:stop] if dataset.labels is not None else None,
        name=dataset.name, sample_ids=ids)


def _exchange(error: BaseException | None, facts: Any, world: int) -> list[Any]:
    """Every rank's ``facts`` (in rank order), once every rank says how its checks went: a
    rank that failed raises its own ``error``; the others raise StoreError naming it and its
    error, so every rank's log holds the cause. Nothing is written before this returns."""
    import torch.distributed as dist

    from ..errors import one_line

    said = None if error is None else f"{type(error).__name__}: {one_line(error)}"
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, (said, facts))
    if error is not None:
        raise error
    failed = [(r, s) for r, (s, _) in enumerate(outcomes) if s is not None]
    if failed:
        raise StoreError(f"rank(s) {[r for r, _ in failed]} failed before the capture started ("
                         + "; ".join(f"rank {r}: {s}" for r, s in failed) + "); nothing was written")
    return [f for _, f in outcomes]


def _open_rank_resumed(out: str, rank: int, world: int, reductions_only: bool) -> tuple[Any, bool]:
    """The store a rank of a torchrun ``resume`` continues, opened, and whether it is the
    committed store (True: every rank checks that) rather than the rank's own rank store
    (None in its place where the rank has none of this run yet: it starts from its first sample).

    Raises
    ------
    ArgumentValueError
        A store captured by one process (resumed by one process only), or one captured on
        another number of ranks; nothing changed.
    """
    from ..store import open_store
    from ..store.ranks import rank_target

    root = _open_resumed(out, reductions_only)
    record = root.attrs.get("distributed")
    if not isinstance(record, dict):
        root.close()
        raise ArgumentValueError(
            f"--resume: store {out!r} was captured by one process, and this command runs on {world} ranks "
            "(torchrun): its rows cannot be split between them; resume it without torchrun, or pass --overwrite "
            f"instead of --resume to capture it again on {world} ranks (nothing was changed)")
    recorded = record.get("world_size")
    if recorded != world:
        root.close()
        raise ArgumentValueError(
            f"--resume: store {out!r} was captured on {recorded} ranks, and this command runs on {world}: each rank "
            f"continues its own part of the data; resume it with torchrun --nproc_per_node={recorded} (over all "
            f"nodes: {recorded} processes), or pass --overwrite instead of --resume to capture it again on {world} "
            "ranks (nothing was changed)")
    if record.get("committed"):
        return root, True
    ranks = {r.get("rank"): r for r in record.get("ranks") or () if isinstance(r, dict)}
    root.close()
    if rank not in ranks:  # (none yet, or another run's: the store writer starts it anew)
        return None, False
    return open_store(rank_target(out, rank)), False


def _check_rank_part(out: str, store: Any, rank: int, world: int, start: int, stop: int) -> None:
    """A rank store continues the same samples ``[start, stop)`` of the data that its first
    run recorded (``rank_part`` of its provenance): other ones (another ``--max-samples``, or
    data of another length) would leave samples out or capture them twice (ArgumentValueError;
    nothing changed). A rank store recording none (captured from Python) is not checked."""
    provenance = store.attrs.get("provenance")
    part = provenance.get("rank_part") if isinstance(provenance, dict) else None
    if not isinstance(part, dict) or [part.get("start"), part.get("stop")] == [start, stop]:
        return
    raise ArgumentValueError(
        f"--resume: rank {rank} of store {out!r} was given samples [{part.get('start')}, {part.get('stop')}) of "
        f"{part.get('n_samples')} on {part.get('world_size')} ranks, and this run would give it [{start}, {stop}) (the "
        "--data or --max-samples differ): resume with the data and --max-samples of that capture, or pass "
        "--overwrite instead of --resume to capture anew (nothing was changed)")


def _check_committed_resume(out: str, store: Any, first: int, n: int, reductions: list[Any] | None, world: int) -> None:
    """A torchrun ``resume`` of a committed store (``store``, opened) captures nothing: it holds
    every sample of the data (``first`` of ``n``) with the reductions asked for, or it is refused
    (ArgumentValueError; nothing changed): its ranks' parts of the data are committed, so it
    takes no more samples and computes no other reduction under torchrun."""
    fix = "pass --overwrite instead of --resume to capture it again (nothing was changed)"
    if first < n:
        raise ArgumentValueError(
            f"--resume: store {out!r} was captured on {world} ranks and committed with {first} samples, and --data "
            f"with this --max-samples has {n}: a committed multi-rank store takes no more samples; {fix}")
    wanted = {r if isinstance(r, str) else r[0] for r in reductions or ()}
    stored = store.reductions
    for hp in store.hook_points:
        missing = sorted(wanted - set(stored[hp] if hp in stored else ()))
        if missing:
            raise ArgumentValueError(
                f"--resume --reduce: store {out!r} was captured on {world} ranks and committed without the reductions "
                f"{missing} of hook point {hp!r}; under torchrun a committed store computes no reduction over its "
                f"stored rows: run the command as one process (without torchrun) to compute them, or {fix}")
