"""Capturing a model over a data set into a store: the work behind ``activationscope capture``
and the demo (the command line only parses arguments and prints).

:func:`run_capture` runs the batches of :func:`text_batches` (tokenized with
:func:`iter_text_batches`) or :func:`tensor_batches` through the model with a store tracker.
Model and data specs are loaded by :mod:`.specs`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ActivationScopeError, ArgumentValueError, CaptureError, SpecError
from ..sizes import dir_bytes, format_bytes

#: Tokens per text at most (longer texts are truncated).
MAX_LENGTH = 128


@dataclass
class CaptureSummary:
    """What a capture did: samples, forwards, wall time (s) and hook points seen."""

    n_samples: int = 0
    n_forwards: int = 0
    elapsed_s: float = 0.0
    hook_points: list[str] = field(default_factory=list)
    n_bytes: int = 0


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
) -> CaptureSummary:
    """Run ``batches`` through ``model`` with a store tracker attached.

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
    """
    import torch
    from tqdm.auto import tqdm

    from .. import store as _store  # noqa: F401 - registers the store writer with capture
    from ..capture.scope import ActivationScope

    scope = ActivationScope(
        store=out,
        store_options=store_options or {},
        reductions=reductions or None,
        storage_dtype=storage_dtype,
        capture=capture,
        stop_after_last=stop_after_last,
    )
    summary = CaptureSummary()
    tracker = scope.track(model, include=include, exclude=exclude)  # validates the patterns first
    new_store = not (store_options or {}).get("resume")
    folder_existed = "://" not in str(out) and os.path.isdir(out)
    bar = tqdm(total=n_total, unit="samples", desc=desc, disable=not progress, dynamic_ncols=True,
               file=sys.stderr, leave=True)
    start = time.perf_counter()
    try:
        with torch.inference_mode(), tracker:
            for first, inputs, info in batches:
                tracker.set_batch(**info)
                n = _batch_len(inputs)
                try:
                    if isinstance(inputs, dict):
                        model(**inputs)
                    else:
                        model(inputs)
                except Exception as e:  # noqa: BLE001 - user model code
                    if isinstance(e, ActivationScopeError):
                        raise
                    raise CaptureError(
                        f"the model raised {type(e).__name__}: {' '.join(str(e).split())} on samples "
                        f"{summary.n_samples}..{summary.n_samples + n - 1} of this run"
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

        removed = new_store and remove_if_empty(out, remove_folder=not folder_existed)
        tail = (f"no row was committed, so the new store {out} was removed" if removed else
                f"{out} keeps the rows committed before (status incomplete; --resume continues it)")
        if isinstance(e, CaptureError) and not isinstance(e.__cause__, ActivationScopeError):
            raise CaptureError(f"{e}; {tail}") from e.__cause__
        e.add_note(tail)
        raise
    finally:
        bar.close()
    summary.elapsed_s = time.perf_counter() - start
    summary.n_bytes = max(summary.n_bytes, dir_bytes(out))
    return summary


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
) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """Tokenized batches with their ``set_batch`` arguments (mask, sample ids, label, text)."""
    for start, enc in iter_text_batches(texts, tokenizer, batch_size, max_length):
        n = enc["input_ids"].shape[0]
        info: dict[str, Any] = {
            "attention_mask": enc["attention_mask"],
            "sample_ids": list(range(first_id + start, first_id + start + n)),
            "text": list(texts[start:start + n]),
        }
        if labels is not None:
            info["label"] = list(labels[start:start + n])
        for key, col in (extra or {}).items():
            info[key] = list(col[start:start + n])
        yield start, enc, info


def tensor_batches(tensor: Any, batch_size: int, first_id: int = 0) -> Iterator[tuple[int, Any, dict[str, Any]]]:
    """Slices of ``tensor`` along dim 0 with their sample ids."""
    if batch_size < 1:
        raise SpecError(f"--batch-size must be a positive int, got {batch_size}")
    for start in range(0, tensor.shape[0], batch_size):
        chunk = tensor[start:start + batch_size]
        yield start, chunk, {"sample_ids": list(range(first_id + start, first_id + start + chunk.shape[0]))}


def iter_text_batches(
    texts: Sequence[str], tokenizer: Any, batch_size: int, max_length: int = MAX_LENGTH
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Tokenize ``texts`` batch by batch (padded to the batch's longest, truncated).

    Yields
    ------
    (start, encoded) : int, dict of Tensor (batch, pos)
        Index of the batch's first text, and the tokenizer output (``input_ids``,
        ``attention_mask``, ...).
    """
    if batch_size < 1:
        raise ArgumentValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start:start + batch_size])
        encoded = tokenizer(chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        yield start, dict(encoded)
