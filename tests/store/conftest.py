"""Fixtures of the store tests."""

from __future__ import annotations

import pytest
import torch

from store_models import MLP


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return MLP().eval()
