"""``token_rows=``: which hook points shaped like the mask's ``(batch, pos)`` store token rows,
where the shape rule alone cannot tell (issue 11: a pooled ``(batch, d)`` output with
``d == pos`` lost its padded columns). Reference: the module's output in plain PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch

from activationscope import ActivationScope, CaptureError, CaptureWarning, open_store


class Pooled(torch.nn.Module):
    """Token ids -> embeddings (batch, pos, 8) -> a pooled head (batch, 6) whose width equals pos."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 6)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (4, 6), generator=g)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[:, 4:] = 0
    mask[0] = 1
    return ids, mask


def _capture(path, track_kw=None, **scope_kw):
    m = Pooled()
    ids, mask = _inputs()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        scope = ActivationScope(store=str(path), reductions=["mean"], **scope_kw)
        with torch.no_grad(), scope.track(m, include=["emb", "head"], **(track_kw or {})) as tr:
            tr.set_batch(attention_mask=mask)
            m(ids)
    with torch.no_grad():
        ref_head, ref_emb = m(ids), m.emb(ids)
    ambiguous = [str(r.message) for r in rec if issubclass(r.category, CaptureWarning) and "padded columns" in str(r.message)]
    return open_store(str(path)), ref_head, ref_emb, mask.bool(), ambiguous


@pytest.mark.parametrize("how", [
    {"token_rows": {"head.*": False}},
    {"token_rows": False},
    {"track_kw": {"token_rows": {"head.output": False}}},
])
def test_sample_rows_keep_a_pooled_output_whole_without_a_warning(tmp_path, how):
    store, ref_head, ref_emb, mask, ambiguous = _capture(tmp_path / "s.zarr", **how)
    assert ambiguous == []
    assert store.row_kind("head.output") == "sample"
    torch.testing.assert_close(torch.as_tensor(store["head.output"][:]), ref_head)  # every column, every sample
    torch.testing.assert_close(store.reductions["head.output"]["mean"], ref_head.double().mean(0))
    if how.get("token_rows") is False:  # every hook point: emb too is one row per sample
        assert store.row_kind("emb.output") == "sample"
        torch.testing.assert_close(torch.as_tensor(store["emb.output"][:]), ref_emb)
    else:  # unmatched hook points follow the shape rule
        assert store.row_kind("emb.output") == "token"
        torch.testing.assert_close(torch.as_tensor(store["emb.output"][:]), ref_emb[mask])


def test_token_rows_true_confirms_per_token_scalars_without_a_warning(tmp_path):
    store, ref_head, _, mask, ambiguous = _capture(tmp_path / "s.zarr", token_rows={"head.output": True})
    assert ambiguous == []
    assert store.row_kind("head.output") == "token"
    torch.testing.assert_close(torch.as_tensor(store["head.output"][:]), ref_head[mask])
    torch.testing.assert_close(store.reductions["head.output"]["mean"], ref_head[mask].double().mean(0))


def test_without_token_rows_the_ambiguous_case_still_warns_and_names_the_option(tmp_path):
    store, _, _, _, ambiguous = _capture(tmp_path / "s.zarr")
    assert len(ambiguous) == 1 and "token_rows={'head.output': False}" in ambiguous[0]
    assert store.row_kind("head.output") == "token"


def test_token_rows_true_on_a_hook_point_that_cannot_be_token_rows_is_refused(tmp_path):
    m = Pooled()
    ids, mask = _inputs()
    scope = ActivationScope(store=str(tmp_path / "s.zarr"), token_rows={"head.output": True})
    with pytest.raises(CaptureError, match=r"'head.output' is set to token rows by token_rows=.*\(4, 6\)"):
        with torch.no_grad(), scope.track(m, include=["head"]) as tr:
            tr.set_batch(attention_mask=mask[:, :5])  # pos 5: (4, 6) does not start with it
            m(ids[:, :5])


def test_token_rows_in_memory(tmp_path):
    m = Pooled()
    ids, mask = _inputs()
    scope = ActivationScope(reductions=["mean"], token_rows={"head.output": False})
    with torch.no_grad(), scope.track(m, include=["head"]) as tr:
        tr.set_batch(attention_mask=mask)
        m(ids)
    with torch.no_grad():
        ref = m(ids)
    torch.testing.assert_close(tr.reductions["head.output"]["mean"], ref.double().mean(0))
    torch.testing.assert_close(tr.activations["head.output"][0], ref)


@pytest.mark.parametrize("bad", [{"head": 1}, {1: True}, ["head"], "head"])
def test_token_rows_is_validated(bad):
    with pytest.raises(TypeError, match="token_rows must"):
        ActivationScope(token_rows=bad)


@pytest.mark.parametrize("store", [False, True])
def test_a_token_rows_pattern_that_selects_no_hook_point_raises_after_the_first_forward(tmp_path, store):
    """As a reductions= pattern: HookPointNotFoundError naming the argument, the pattern and
    the hook points of the first captured forward; no row of the run is stored."""
    from activationscope import HookPointNotFoundError

    m = Pooled()
    ids, mask = _inputs()
    path = tmp_path / "s.zarr"
    scope = ActivationScope(store=str(path) if store else None, token_rows={"head.output": False, "head": False})
    forwards = 0
    with pytest.raises(HookPointNotFoundError) as e:
        with torch.no_grad(), scope.track(m, include=["emb", "head"]) as tr:
            tr.set_batch(attention_mask=mask)
            m(ids)
            forwards += 1
    assert forwards == 0  # raised at the end of the first forward, not at the close
    assert "token_rows= pattern 'head' selects no hook point" in str(e.value)
    assert "['emb.output', 'head.output']" in str(e.value)
    assert (e.value.argument, e.value.pattern, e.value.hook_points) == ("token_rows", "head",
                                                                        ["emb.output", "head.output"])
    if store:
        s = open_store(str(path))
        assert s.n_samples == 0 and all(s.n_rows(hp) == 0 for hp in s.hook_points)


@pytest.mark.parametrize("store", [False, True])
def test_a_token_rows_refusal_caught_in_the_block_is_raised_again_at_the_close_with_its_attributes(tmp_path, store):
    from activationscope import HookPointNotFoundError

    m = Pooled()
    ids, mask = _inputs()
    path = tmp_path / "s.zarr"
    scope = ActivationScope(store=str(path) if store else None, token_rows={"head": False})
    caught = []
    with pytest.raises(HookPointNotFoundError) as e:
        with torch.no_grad(), scope.track(m, include=["emb", "head"]) as tr:
            tr.set_batch(attention_mask=mask)
            try:
                m(ids)
            except HookPointNotFoundError as inner:
                caught.append(inner)
    assert len(caught) == 1 and e.value is not caught[0]
    assert str(e.value) == str(caught[0])
    for error in (caught[0], e.value):
        assert (error.argument, error.pattern, error.hook_points) == ("token_rows", "head",
                                                                      ["emb.output", "head.output"])
    if store:  # no row was committed: the new store is removed, and the error says so
        assert not path.exists()
        assert any("no row was committed, so the new store" in n for n in getattr(e.value, "__notes__", []))


def test_a_token_rows_pattern_of_track_is_checked_too():
    from activationscope import HookPointNotFoundError

    m = Pooled()
    ids, mask = _inputs()
    with pytest.raises(HookPointNotFoundError, match="token_rows= pattern 'emb.out' selects no hook point"):
        with torch.no_grad(), ActivationScope().track(m, include=["emb"], token_rows={"emb.out": True}) as tr:
            tr.set_batch(attention_mask=mask)
            m(ids)


def test_a_token_rows_pattern_for_a_hook_point_reached_in_a_later_forward_is_accepted():
    from acs_testing import LateBranch

    model, xs = LateBranch(), [torch.randn(3, 4) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # b.output does not follow the row table: warned elsewhere
        with torch.no_grad(), ActivationScope(token_rows={"b.output": False}).track(model) as tr:
            model(xs[0], extra=False)
            model(xs[1])
    with torch.no_grad():
        ref = model.b(model.a(xs[1]))
    torch.testing.assert_close(tr.activations["b.output"][0], ref)
