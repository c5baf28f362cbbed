"""Models and reference captures shared by the store tests (imported by name: pytest puts this
directory on sys.path)."""

from __future__ import annotations

import torch
import torch.nn as nn

import activationscope as acs


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.relu2 = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        x = self.relu1(self.conv1(x))
        x = self.relu2(self.conv2(x))
        return self.head(self.pool(x).flatten(1))


def make_encoder(d_model: int = 16) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()


def batches_mlp(n_batches: int = 6, batch: int = 5, d_in: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, d_in, generator=g) for _ in range(n_batches)]


def capture_memory(model, xs, dtype=None, **scope_kw):
    """Reference: the in-memory capture, rows concatenated per hook point."""
    with acs.ActivationScope(**scope_kw).track(model) as tr:
        with torch.no_grad():
            for x in xs:
                model(x if dtype is None else x.to(dtype))
    return {hp: torch.cat([r.reshape(r.shape[0] if r.dim() else 1, *r.shape[1:]) for r in recs])
            for hp, recs in tr.activations.items()}


def capture_store(model, xs, path, dtype=None, store_options=None, ids=True, **scope_kw):
    scope = acs.ActivationScope(store=str(path), store_options=store_options or {}, **scope_kw)
    with scope.track(model) as tr:
        with torch.no_grad():
            n = 0
            for x in xs:
                if ids:
                    tr.set_batch(sample_ids=list(range(n, n + x.shape[0])))
                model(x if dtype is None else x.to(dtype))
                n += x.shape[0]
    return tr
