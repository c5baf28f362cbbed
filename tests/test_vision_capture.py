"""Convolutional networks: what a capture of conv feature maps (batch, C, H, W) tells the user."""

from __future__ import annotations

import pytest
import torch

import activationscope as acs
from activationscope.errors import CaptureError


class _Stem(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return self.pool(torch.relu(self.bn(self.conv(x))))


def test_images_of_another_size_name_the_fixes_for_images(tmp_path):
    """Conv maps follow the input's size: a second batch of 10x10 images after 8x8 ones is
    refused, and the message only said to pass an attention mask (a fix for token sequences
    that does not apply to images). It now names the fixes for images too, and the pooled
    output of the same forwards is stored."""
    torch.manual_seed(0)
    model = _Stem().eval()
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"))
    with pytest.raises(CaptureError) as info:
        with torch.no_grad(), scope.track(model, include=["conv", "pool"]):
            model(torch.randn(2, 3, 8, 8))
            model(torch.randn(2, 3, 10, 10))
    message = str(info.value)
    assert "hook point 'conv.output' changed its feature shape from (4, 8, 8) to (4, 10, 10)" in message
    assert "for images of varying size" in message and "resize or crop" in message
    assert "nn.AdaptiveAvgPool2d" in message
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.n_rows("pool.output") == 2  # the first forward is kept whole
