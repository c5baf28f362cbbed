"""Shared fixtures: devices (cuda marked gpu and skipped without CUDA), dtypes, small models."""

from __future__ import annotations

import pytest
import torch
from acs_testing import SmallCNN, small_transformer, toy_mlp  # noqa: F401

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(params=FLOAT_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def float_dtype(request):
    return request.param


@pytest.fixture
def mlp():
    return toy_mlp()


@pytest.fixture
def cnn():
    return SmallCNN().eval()


@pytest.fixture
def transformer():
    return small_transformer().eval()
