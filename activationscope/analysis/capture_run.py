"""Capturing a model over a data set into a store: the work behind ``activationscope capture``
and the demo (the command line only parses arguments and prints).

A model spec is ``demo``, a Hugging Face model folder or ``package.module:factory``; a data
spec is ``demo``, a text file (one sample per line, optionally ``__label__<tag> text``) or a
tensor file (``.npy`` / ``.pt``, samples along dim 0). :func:`run_capture` runs the batches
of :func:`text_batches` or :func:`tensor_batches` through the model with a store tracker.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ActivationScopeError, CaptureError, SpecError, one_line
from ..sizes import dir_bytes, format_bytes


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
    )
    summary = CaptureSummary()
    tracker = scope.track(model, include=include, exclude=exclude)  # validates the patterns first
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
                        f"{summary.n_samples}..{summary.n_samples + n - 1} of this run; {out} keeps the rows "
                        "committed before (status incomplete)"
                    ) from e
                summary.n_samples += n
                summary.n_forwards += 1
                elapsed = max(time.perf_counter() - start, 1e-9)
                summary.n_bytes = _written_bytes(tracker, out)
                bar.set_postfix_str(f"{format_bytes(summary.n_bytes / elapsed)}/s", refresh=False)
                bar.update(n)
            summary.hook_points = tracker.hook_points
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


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any = None
    name: str = ""
    default_include: list[str] | None = None


def load_model_spec(spec: str) -> LoadedModel:
    """``demo``, a Hugging Face model folder, or ``package.module:factory``.

    Raises
    ------
    SpecError
        The spec is none of these, the import fails, or the factory does not give an nn.Module.
    """
    import torch

    from . import demo

    if spec == "demo":
        tokenizer, model = demo.load_model()
        return LoadedModel(model, tokenizer, "all-MiniLM-L6-v2 (demo)", demo.layer_include(model))
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecError(f"--model {spec!r} is a folder without config.json (not a Hugging Face model folder)")
        tokenizer, model = demo.load_model(path, pooled=False)
        return LoadedModel(model, tokenizer, str(path))
    if ":" not in spec:
        raise SpecError(
            f"--model must be 'demo', a Hugging Face model folder or an import path package.module:factory, got {spec!r}"
        )
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any failure of user code at import
        raise SpecError(f"--model {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SpecError(f"--model {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, torch.nn.Module):
        if not callable(obj):
            raise SpecError(f"--model {spec!r} must name an nn.Module or a factory returning one, got {type(obj).__name__}")
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--model {spec!r}: the factory raised {type(e).__name__}: {e}") from e
    if not isinstance(obj, torch.nn.Module):
        raise SpecError(f"--model {spec!r}: the factory must return a torch.nn.Module, got {type(obj).__name__}")
    obj.eval()
    return LoadedModel(obj, None, spec)


@dataclass
class LoadedData:
    texts: list[str] | None = None
    tensor: Any = None
    labels: list[Any] | None = None
    name: str = ""

    def __len__(self) -> int:
        return len(self.texts) if self.texts is not None else int(self.tensor.shape[0])


def load_data_spec(spec: str) -> LoadedData:
    """``demo``, a text file (one sample per line) or a tensor file (.npy / .pt).

    Raises
    ------
    SpecError
        Missing or unreadable file, an empty data set, or a tensor file without a tensor.
    """
    import torch

    from . import demo

    if spec == "demo":
        texts, labels = demo.load_polarity()
        return LoadedData(texts=texts, labels=labels, name="pang_lee_polarity")
    path = Path(spec)
    if not path.exists():
        raise SpecError(f"--data {spec!r} does not exist")
    if not path.is_file():
        raise SpecError(f"--data {spec!r} must be a file (text, .npy or .pt), got a folder")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        import numpy as np

        try:
            array = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--data {spec!r} is not a readable .npy file: {e}") from e
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    elif suffix in (".pt", ".pth"):
        try:
            tensor = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise SpecError(f"--data {spec!r} is not a readable torch file: {one_line(e)}") from e
        if not isinstance(tensor, torch.Tensor):
            raise SpecError(f"--data {spec!r} must hold one tensor (samples along dim 0), got {type(tensor).__name__}")
    else:
        try:
            raw = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raw = path.read_text(encoding="latin-1")
        lines = [line.strip() for line in raw.splitlines() if line.strip()]
        if not lines:
            raise SpecError(f"--data {spec!r} has no non-empty lines")
        if all(line.startswith("__label__") for line in lines):
            labels, texts = [], []
            for line in lines:
                tag, _, text = line.partition(" ")
                labels.append(tag[len("__label__"):])
                texts.append(text.strip())
            return LoadedData(texts=texts, labels=labels, name=path.name)
        return LoadedData(texts=lines, name=path.name)
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        raise SpecError(f"--data {spec!r} must have samples along dim 0, got shape {tuple(tensor.shape)}")
    return LoadedData(tensor=tensor, name=path.name)


def text_batches(
    texts: Sequence[str], tokenizer: Any, batch_size: int, max_length: int,
    labels: Sequence[Any] | None = None, first_id: int = 0, extra: dict[str, Sequence[Any]] | None = None,
) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """Tokenized batches with their ``set_batch`` arguments (mask, sample ids, label, text)."""
    from . import demo

    for start, enc in demo.iter_text_batches(texts, tokenizer, batch_size, max_length):
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
