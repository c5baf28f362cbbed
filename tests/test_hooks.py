"""Hook-point selection helpers of ``activationscope.capture.hooks``: the stacks of repeated
blocks a model is made of (``block_stacks`` / ``block_modules``), found by structure."""

from __future__ import annotations

import pytest
import torch

from activationscope.capture.hooks import block_modules, block_stacks
from activationscope.errors import ArgumentTypeError


class Expert(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)


class Block(torch.nn.Module):
    def __init__(self, n_experts: int = 0) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        if n_experts:
            self.experts = torch.nn.ModuleList(Expert() for _ in range(n_experts))


class Pool(torch.nn.Module):
    """Composite but without parameters of its own (like the demo's MaskedMeanPool + an identity)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Identity()


class DecoderOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(Block(n_experts=5) for _ in range(3))
        self.heads = torch.nn.ModuleList(torch.nn.Linear(4, 2) for _ in range(7))  # leaf modules: no blocks
        self.pool = torch.nn.ModuleList(Pool() for _ in range(9))  # no parameters: no blocks
        self.mixed = torch.nn.ModuleList([Block(), Expert(), Block(), Expert()])  # two classes: no stack


def test_block_stacks_is_the_outermost_list_of_one_block_class():
    # the 5 experts of each layer form a longer list, but it lies inside the layers' stack;
    # lists of Linear, of parameterless modules and of two classes are no stacks
    model = DecoderOnly()
    assert block_stacks(model) == ["model.layers"]
    assert block_modules(model) == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_block_stacks_of_an_encoder_decoder_are_both_stacks():
    model = torch.nn.Module()
    model.encoder, model.decoder = torch.nn.Module(), torch.nn.Module()
    model.encoder.layers = torch.nn.ModuleList(Block() for _ in range(2))
    model.decoder.layers = torch.nn.ModuleList(Block() for _ in range(3))
    assert block_stacks(model) == ["encoder.layers", "decoder.layers"]
    assert block_modules(model) == ["encoder.layers.0", "encoder.layers.1",
                                    "decoder.layers.0", "decoder.layers.1", "decoder.layers.2"]


def test_block_stacks_of_a_single_block_and_of_a_sequential_model():
    one = torch.nn.Module()
    one.h = torch.nn.ModuleList([Block()])
    assert block_modules(one) == ["h.0"]
    seq = torch.nn.Sequential(Block(), Block())  # the model itself is the stack
    assert block_stacks(seq) == [""] and block_modules(seq) == ["0", "1"]


def test_block_stacks_of_a_model_without_one_is_empty():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert block_stacks(mlp) == [] and block_modules(mlp) == []
    empty = torch.nn.Module()
    empty.layers = torch.nn.ModuleList()
    assert block_stacks(empty) == []


def test_block_stacks_refuses_what_is_not_a_module():
    with pytest.raises(ArgumentTypeError, match="model must be a torch.nn.Module, got dict"):
        block_stacks({})
