"""TransformerLens HookPoints are recorded under their TransformerLens names."""

from __future__ import annotations

import fnmatch
import os
import warnings

import pytest
import torch

import activationscope as acs
from activationscope.capture.hooks import rename_hook_point

os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    tl = pytest.importorskip("transformer_lens", reason="needs `pip install transformer-lens`")


@pytest.fixture(scope="module")
def model():
    cfg = tl.HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=50,
                                     act_fn="relu", d_mlp=32, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HookedTransformer's own deprecation notice
        return tl.HookedTransformer(cfg).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(0))


def test_hook_points_have_their_transformer_lens_names_and_values(model, tokens):
    _, cache = model.run_with_cache(tokens)
    with acs.ActivationScope().track(model, include=["blocks.*.hook_*", "hook_embed"]) as tracker:
        model(tokens)
    names = set(tracker.activations)
    expected = {k for k in cache.keys() if fnmatch.fnmatchcase(k, "blocks.*.hook_*")} | {"hook_embed"}
    assert "blocks.0.hook_resid_post" in names and "blocks.1.hook_mlp_out" in names
    assert {n.split("#")[0] for n in names} == expected
    # ln1 runs once per q, k, v input in one forward: later calls are <name>#1, #2
    assert {"blocks.0.ln1.hook_scale#1", "blocks.0.ln1.hook_scale#2"} <= names
    for name in expected:
        (record,) = tracker.activations[name]
        assert torch.equal(record, cache[name]), name


@pytest.mark.parametrize("side", ["output", "input", "both"])
def test_every_cached_hook_is_recorded_once_on_any_side(model, tokens, side):
    _, cache = model.run_with_cache(tokens)
    with acs.ActivationScope(capture=side).track(model) as tracker:
        model(tokens)
    acts = tracker.activations
    for name in cache.keys():
        assert name in acts, name
        assert torch.equal(acts[name][0], cache[name]), name
        assert f"{name}.output" not in acts and f"{name}.input.0" not in acts
    # other modules keep the usual names
    if side != "input":
        assert "blocks.0.attn.output" in acts
    if side != "output":
        assert "blocks.0.ln1.input.0" in acts


def test_store_of_a_hooked_transformer(model, tokens, tmp_path):
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1:, 6:] = False
    with acs.ActivationScope(store=str(tmp_path / "tl.zarr")).track(model, include=["blocks.*.hook_resid_post"]) as tr:
        tr.set_batch(attention_mask=mask)
        model(tokens)
    store = acs.open_store(str(tmp_path / "tl.zarr"))
    assert store.hook_points == ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"]
    _, cache = model.run_with_cache(tokens)
    assert torch.equal(store["blocks.1.hook_resid_post"], cache["blocks.1.hook_resid_post"][mask])


def test_rename_rule():
    paths = frozenset({"blocks.0.hook_resid_post"})
    assert rename_hook_point("blocks.0.hook_resid_post.output", paths, "output") == "blocks.0.hook_resid_post"
    assert rename_hook_point("blocks.0.hook_resid_post#2.output", paths, "output") == "blocks.0.hook_resid_post#2"
    assert rename_hook_point("blocks.0.hook_resid_post.input.0", paths, "input") == "blocks.0.hook_resid_post"
    assert rename_hook_point("blocks.0.hook_resid_post.input.0", paths, "both") is None
    assert rename_hook_point("blocks.0.mlp.output", paths, "output") == "blocks.0.mlp.output"
    assert rename_hook_point("blocks.0.hook_resid_post.output", frozenset(), "output") == "blocks.0.hook_resid_post.output"


def test_readme_transformer_lens_example_runs(tmp_path, monkeypatch, capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "HookedTransformer(" in b)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(block, "README.md", "exec"), {})
    assert "torch.Size([2048, 64])" in capsys.readouterr().out


def test_steering_hooks_are_warned_and_the_next_hook_point_records_the_steered_value(model, tokens):
    """A TransformerLens hook that steers blocks.0.hook_resid_post (model.hooks, inside the
    with block) is named in a CaptureWarning: that hook point is recorded as its HookPoint
    returns it, before the hook; blocks.1.hook_resid_pre, which receives it, records the
    steered value, as run_with_cache shows it. run_with_cache's own (reading) hooks are not
    warned about."""
    steer = torch.zeros(model.cfg.d_model)
    steer[0] = 5.0
    include = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_pre"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope().track(model, include=include) as tr, torch.no_grad():
            with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + steer)]):
                model(tokens)
                _, cache = model.run_with_cache(tokens, names_filter=include)
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(messages) == 1 and "'blocks.0.hook_resid_post' replaced or changed their output" in messages[0]
    recorded = tr.activations["blocks.1.hook_resid_pre"]
    torch.testing.assert_close(recorded[0], cache["blocks.1.hook_resid_pre"], rtol=0, atol=0)
    torch.testing.assert_close(tr.activations["blocks.0.hook_resid_post"][0] + steer, recorded[0], rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with acs.ActivationScope().track(model, include=include), torch.no_grad():
            model.run_with_cache(tokens, names_filter=include)


def test_hook_point_names_are_read_as_their_modules_and_a_store_of_them_resumes(model, tokens, tmp_path):
    """A HookPoint is recorded under its own path, read back as that module (also with #k):
    no tracked HookPoint is said to have recorded nothing, and a resume accepts the store."""
    from activationscope.capture.hooks import hook_point_module

    names = {n for n, _ in model.named_modules()}
    paths = {n for n, m in model.named_modules() if type(m).__name__ == "HookPoint"}
    assert hook_point_module("blocks.0.hook_resid_post", names, paths) == "blocks.0.hook_resid_post"
    assert hook_point_module("blocks.0.ln1.hook_scale#2", names, paths) == "blocks.0.ln1.hook_scale"
    assert hook_point_module("blocks.0.attn.output", names, paths) == "blocks.0.attn"
    path = str(tmp_path / "tl.zarr")
    include = ["blocks.*.hook_resid_post", "blocks.0.attn.hook_z", "blocks.0.attn"]
    for resume in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with acs.ActivationScope(store=path, store_options={"resume": resume}).track(model, include=include), \
                    torch.no_grad():
                model(tokens)
        assert [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)] == [], resume
    store = acs.open_store(path)
    assert store.n_samples == 6
    assert {"blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.0.attn.hook_z"} <= set(store.hook_points)
    _, cache = model.run_with_cache(tokens)
    rows = store["blocks.1.hook_resid_post"]
    assert torch.equal(rows[: rows.shape[0] // 2].reshape(cache["blocks.1.hook_resid_post"].shape),
                       cache["blocks.1.hook_resid_post"])


def test_rows_token_warns_when_the_model_is_given_a_mask_with_padding_that_set_batch_is_not(model, tokens, tmp_path):
    """rows='token' stores every position of a forward whose set_batch gave no mask: a padded
    batch whose attention_mask went to the model only (model(tokens, attention_mask=mask))
    would put its padding into the store's token rows and reductions without a word. It is
    named in a CaptureWarning (once); given to set_batch too, the padding is left out and
    nothing is warned about; a mask without padding is no reason to warn."""
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1:, 5:] = 0                                                 # 6 padded positions of 24
    hp = "blocks.0.hook_resid_post"

    def capture(path, describe, masks):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scope = acs.ActivationScope(store=str(tmp_path / path), rows="token", reductions=["mean"])
            with scope.track(model, include=[hp]) as tr, torch.no_grad():
                for m in masks:
                    if describe:
                        tr.set_batch(attention_mask=m)
                    model(tokens, attention_mask=m)
        return [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]

    caught = capture("model-only.zarr", False, [torch.ones_like(mask), mask, mask])
    assert len(caught) == 1, caught
    assert "forward 1 of the tracked model was given attention_mask= with padding (6 of 24 positions are 0)" in caught[0]
    assert "tracker.set_batch(attention_mask=mask)" in caught[0]
    assert acs.open_store(str(tmp_path / "model-only.zarr")).n_rows(hp) == 3 * 24     # as warned: padding kept
    assert capture("described.zarr", True, [mask]) == []
    assert acs.open_store(str(tmp_path / "described.zarr")).n_rows(hp) == 18
    assert capture("no-padding.zarr", False, [torch.ones_like(mask)]) == []


@pytest.mark.parametrize("hook, flag, setter", [
    ("blocks.0.attn.hook_result", "use_attn_result", "model.set_use_attn_result(True)"),
    ("blocks.0.hook_q_input", "use_split_qkv_input", "model.set_use_split_qkv_input(True)"),
    ("blocks.0.hook_attn_in", "use_attn_in", "model.set_use_attn_in(True)"),
    ("blocks.0.hook_mlp_in", "use_hook_mlp_in", "model.set_use_hook_mlp_in(True)"),
])
def test_a_hook_point_that_the_model_config_turns_off_is_named_with_its_switch(model, tokens, tmp_path, hook, flag,
                                                                               setter):
    """TransformerLens calls some HookPoints only when a config flag is on
    (cfg.use_attn_result for attn.hook_result, ...): a capture of one with the flag off records
    nothing, and the error names the flag and its setter, not fused fast paths or F.* calls."""
    assert not getattr(model.cfg, flag)
    with pytest.raises(acs.CaptureError) as e:
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model, include=[hook]), torch.no_grad():
            model(tokens)
    message = str(e.value)
    assert f"{hook!r} (HookPoint): TransformerLens calls it only with model.cfg.{flag}=True" in message
    assert setter in message and "fused fast path" not in message
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope().track(model, include=[hook, "blocks.0.hook_resid_post"]), torch.no_grad():
            model(tokens)
    (warned,) = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert f"model.cfg.{flag}=True" in warned and setter in warned


def test_hook_points_after_stop_at_layer_are_named_with_it(model, tokens):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope().track(model, include=["blocks.*.hook_resid_post"]) as tr, torch.no_grad():
            model(tokens, stop_at_layer=1)
    (warned,) = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert "'blocks.1.hook_resid_post' (HookPoint): never called" in warned
    assert "stop_at_layer=" in warned
    assert list(tr.activations) == ["blocks.0.hook_resid_post"]


@pytest.mark.parametrize("typo, meant", [
    ("blocks.0.hook_resid_postt", "blocks.0.hook_resid_post"),
    ("blocks.1.hook_mlp_output", "blocks.1.hook_mlp_out"),
    ("blocks.*.hook_resid_psot", "blocks.0.hook_resid_post"),
])
def test_a_mistyped_hook_point_is_refused_naming_the_names_it_is_close_to(model, typo, meant):
    """The first module names of a HookedTransformer (embed, hook_embed, ...) say nothing about
    a typo deep in the model: the error names the module names closest to the pattern."""
    with pytest.raises(acs.HookPointNotFoundError) as e:
        acs.ActivationScope().track(model, include=[typo])
    message = str(e.value)
    assert f"include pattern {typo!r} matches no module of HookedTransformer" in message
    assert "did you mean" in message and repr(meant) in message.split("did you mean")[1]
    for _, hp in model.hook_dict.items():
        assert not hp._forward_hooks
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("side", [".output", ".input"])
def test_a_hook_point_named_with_a_side_is_refused_naming_its_transformer_lens_name(model, side):
    """include= names modules: 'blocks.0.hook_resid_post.output' selects none. A HookPoint is
    recorded under its own path, so the error says so (not that it records '...output')."""
    with pytest.raises(acs.HookPointNotFoundError) as e:
        acs.ActivationScope().track(model, include=["blocks.0.hook_resid_post" + side])
    message = str(e.value)
    assert ("include='blocks.0.hook_resid_post' records the HookPoint under its TransformerLens name "
            "'blocks.0.hook_resid_post'") in message
    assert "records 'blocks.0.hook_resid_post" + side not in message


def _capture_with_heads_equal_pos(model, tmp_path, names):
    """Capture ``names`` of 3 samples of 4 tokens (as many as heads), the last token of two
    of them padding, with no CaptureWarning: (store, run_with_cache's cache, mask)."""
    assert model.cfg.n_heads == 4
    tokens = torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 4, dtype=torch.long)
    mask[1:, 3:] = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=["max"]).track(model, include=names) as tr, \
                torch.no_grad():
            tr.set_batch(attention_mask=mask)
            model(tokens, attention_mask=mask)
    assert [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)] == []
    store = acs.open_store(str(tmp_path / "s.zarr"))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, attention_mask=mask)
    return store, cache, mask


def test_attention_maps_are_sample_rows_also_when_heads_equal_pos(model, tmp_path):
    """attn.hook_pattern and attn.hook_attn_scores are (batch, head_index, query_pos, key_pos):
    with as many positions as heads (4 here) the shape rule would take them as token rows,
    (sample, head) pairs picked by the mask. Their layout is known: one row per sample, whole,
    as run_with_cache gives it, and no warning about a layout to guess."""
    names = ["blocks.1.attn.hook_pattern", "blocks.1.attn.hook_attn_scores", "blocks.1.hook_resid_post"]
    store, cache, mask = _capture_with_heads_equal_pos(model, tmp_path, names)
    for name in names[:2]:
        assert store.row_kind(name) == "sample"
        assert torch.equal(store[name], cache[name])
        assert torch.equal(store.reductions[name]["max"], cache[name].double().amax(0))
    assert store.row_kind(names[2]) == "token" and torch.equal(store[names[2]], cache[names[2]][mask.bool()])


def test_per_head_activations_are_token_rows_without_a_warning_when_heads_equal_pos(model, tmp_path):
    """attn.hook_q / hook_k / hook_v / hook_z (and hook_rot_q, hook_result, ...) are (batch, pos,
    head_index, d_head): with as many positions as heads (4 here) the shape rule warned that they
    might be head-first and told to pass token_rows=, although their layout is known. Token rows,
    no warning."""
    names = ["blocks.1.attn.hook_q", "blocks.1.attn.hook_k", "blocks.1.attn.hook_v", "blocks.1.attn.hook_z"]
    store, cache, mask = _capture_with_heads_equal_pos(model, tmp_path, names)
    for name in names:
        want = cache[name][mask.bool()]                          # (real tokens, head_index, d_head)
        assert store.row_kind(name) == "token" and torch.equal(store[name], want)
        assert torch.equal(store.reductions[name]["max"], want.double().amax(0))


def test_a_mistyped_exclude_pattern_is_warned_naming_the_names_it_is_close_to(model, tokens):
    with pytest.warns(acs.CaptureWarning, match=r"exclude pattern 'blocks\.1\.hook_resid_psot' matches no module of "
                                                r"HookedTransformer, so it excludes nothing; .*did you mean "
                                                r"\['blocks\.1\.hook_resid_post'"):
        with acs.ActivationScope().track(model, include=["blocks.*.hook_resid_post"],
                                         exclude=["blocks.1.hook_resid_psot"]) as tr, torch.no_grad():
            model(tokens)
    assert "blocks.1.hook_resid_post" in tr.activations           # as warned: nothing excluded


def test_hook_tokens_are_token_rows_without_a_warning_about_their_shape():
    """hook_tokens (cfg.use_hook_tokens) is TransformerLens's (batch, pos) token ids: one scalar
    per real token, a layout that is known, so it is not warned about as a 2-D hook point that
    might be a pooled (batch, features) output."""
    cfg = tl.HookedTransformerConfig(n_layers=1, d_model=16, n_ctx=8, d_head=4, n_heads=4, d_vocab=50,
                                     act_fn="relu", d_mlp=32, seed=0, use_hook_tokens=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tl.HookedTransformer(cfg).eval()
    tokens = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1:, 5:] = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(reductions=["max"]).track(model, include=["hook_tokens"]) as tr, torch.no_grad():
            tr.set_batch(attention_mask=mask)
            model(tokens, attention_mask=mask)
    assert [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)] == []
    assert torch.equal(tr.reductions["hook_tokens"]["max"], tokens[mask.bool()].max())
