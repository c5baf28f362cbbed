"""What a notebook shows of the public objects: readable reprs that read no data."""

from __future__ import annotations

from typing import Optional

import torch

import activationscope as acs
from activationscope.store.reader import Store

from acs_testing import toy_mlp


def test_scope_repr_names_the_store_and_the_capture(tmp_path):
    path = tmp_path / "s.zarr"
    scope = acs.ActivationScope(store=path, reductions=["mean", "var"], store_options={"resume": True})
    assert repr(scope) == (f"<ActivationScope store={str(path)!r}, capture='output', capture_policy=EVERY, "
                           "reductions=['mean', 'var'], store_options={'resume': True}>")
    assert repr(acs.ActivationScope(capture="both")) == (
        "<ActivationScope store=memory, capture='both', capture_policy=EVERY>")


def test_store_reductions_repr_names_them_without_reading_them(tmp_path, monkeypatch):
    model = toy_mlp(depth=1)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, reductions=["mean"]).track(model):
        model(torch.randn(4, 16))
    store = acs.open_store(path)

    def read(*args, **kwargs):
        raise AssertionError("repr read a reduction")

    monkeypatch.setattr(Store, "_read_small", read)
    assert repr(store.reductions) == (f"<reductions of {str(path)!r}: {{'0.output': ['mean', 'mean.count'], "
                                      "'1.output': ['mean', 'mean.count']}>")


def test_scope_repr_shows_no_storage_options_value():
    scope = acs.ActivationScope(store="s3://bucket/run.zarr", store_options={
        "storage_options": {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value"}, "resume": True})
    assert repr(scope) == ("<ActivationScope store='s3://bucket/run.zarr', capture='output', capture_policy=EVERY, "
                           "store_options={'storage_options': {'key': '...', 'secret': '...'}, 'resume': True}>")
    assert "AKIAEXAMPLE" not in repr(scope) and "s3cr3t" not in repr(scope)


def test_scope_repr_names_named_reductions_and_their_patterns():
    def sq(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x.square().sum(0) if acc is None else acc + x.square().sum(0)

    scope = acs.ActivationScope(reductions=[("m2", "mean"), ("squares", sq), "var"])
    assert repr(scope) == ("<ActivationScope store=memory, capture='output', capture_policy=EVERY, "
                           "reductions=['m2', 'squares', 'var']>")
    scope = acs.ActivationScope(reductions={"0.*": ["mean"], "1.*": [("m2", "mean"), sq]})
    assert repr(scope) == ("<ActivationScope store=memory, capture='output', capture_policy=EVERY, "
                           "reductions={'0.*': ['mean'], '1.*': ['m2', 'sq']}>")
