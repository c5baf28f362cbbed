"""ActivationScope / Tracker: every captured value is compared with a plain-PyTorch reference
(``plain_hooks`` of acs_testing: ``register_forward_hook`` / ``register_forward_pre_hook`` that clone)."""

from __future__ import annotations

import dataclasses
import gc
import sys
import threading
import re
import typing
import warnings
from typing import Optional

import pytest
import numpy as np
import torch
import torch.utils.checkpoint

import activationscope as acs
from activationscope import CaptureMode, CapturePolicy, ReductionPolicy, StoragePolicy
from activationscope.errors import ArgumentTypeError

from acs_testing import BracketNames, SmallCNN, plain_hooks, toy_mlp


# ----------------------------------------------------------------------------- reference
def assert_same_records(got, want):
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for key, tensors in want.items():
        assert len(got[key]) == len(tensors), key
        for a, b in zip(got[key], tensors):
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a, b), key


def no_wrappers(model):
    return all("forward" not in m.__dict__ for m in model.modules())


# ----------------------------------------------------------------------------- the seed
def test_seed_quick_start_verbatim():
    model = toy_mlp()
    data = [(torch.randn(4, 16), torch.randn(4, 16)) for _ in range(3)]
    dataloader = torch.utils.data.DataLoader(data, batch_size=None)
    loss_fn = torch.nn.MSELoss()

    import activationscope

    with activationscope.ActivationScope().track(model) as tracker:
        for x, y in dataloader:
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()

    acts = tracker.activations  # {layer_name: [Tensor, ...]} across all batches

    def run():
        for x, _ in data:
            model(x)

    want, _ = plain_hooks(model, run, grad=True)
    assert set(acts) == set(want)
    assert_same_records(acts, want)
    for tensors in acts.values():
        assert all(not t.requires_grad and t.grad_fn is None for t in tensors)
    assert no_wrappers(model)


@pytest.mark.parametrize("factory,shape", [(toy_mlp, (5, 16)), (SmallCNN, (2, 3, 8, 8))])
def test_models_both_sides_equal_reference(factory, shape):
    model = factory().eval()
    xs = [torch.randn(*shape) for _ in range(2)]
    with acs.ActivationScope(capture="both").track(model) as tracker:
        for x in xs:
            model(x)
    want, _ = plain_hooks(model, lambda: [model(x) for x in xs], side="both", grad=True)
    assert_same_records(tracker.activations, want)


def test_transformer_encoder_equals_reference(transformer):
    x = torch.randn(3, 5, 16)
    with acs.ActivationScope().track(transformer, include=["layers.*"]) as tracker:
        transformer(x)
    names = {n for n, _ in transformer.named_modules() if n.startswith("layers.")}
    want, _ = plain_hooks(transformer, lambda: transformer(x), names, grad=True)
    assert_same_records(tracker.activations, want)
    assert "layers.0.self_attn.output.0" in tracker.activations  # attention returns a tuple


# ----------------------------------------------------------------------------- arguments
def test_capture_policy_passed_as_capture_raises_typeerror():
    with pytest.raises(TypeError, match="capture_policy=CapturePolicy.SAMPLE_N"):
        acs.ActivationScope(capture=CapturePolicy.SAMPLE_N)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"capture": "outputs"}, "capture must be one of"),
        ({"capture_policy": "sometimes"}, "capture_policy must be one of"),
        ({"capture_mode": "deep"}, "capture_mode must be one of"),
        ({"storage": "tape"}, "storage must be one of"),
        ({"reduction_policy": "all"}, "reduction_policy must be one of"),
        ({"sample_every": 0}, "sample_every must be a positive int"),
        ({"rows": "sample"}, r"rows must be one of \['auto', 'token'\], got 'sample'; for one row per sample whatever "
                             r"the shapes, pass token_rows=False"),
        ({"capture_policy": CapturePolicy.MAX_K}, "needs max_k="),
        ({"storage": StoragePolicy.DISK}, "needs store="),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        acs.ActivationScope(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_k": 2}, r"max_k=2 counts the forwards of capture_policy=CapturePolicy.MAX_K only, and this capture has "
                       r"capture_policy=CapturePolicy.EVERY: pass capture_policy=CapturePolicy.MAX_K"),
        ({"capture_policy": "sample_n", "sample_every": 3, "max_k": 2}, r"max_k=2 .*=CapturePolicy.SAMPLE_N: pass"),
        ({"sample_every": 3}, r"sample_every=3 is the period of capture_policy=CapturePolicy.SAMPLE_N only, and this "
                              r"capture has capture_policy=CapturePolicy.EVERY: pass capture_policy=CapturePolicy.SAMPLE_N"),
        ({"capture_policy": "max_k", "max_k": 2, "sample_every": 3}, r"sample_every=3 .*=CapturePolicy.MAX_K: pass"),
        ({"capture_policy": "sample_n"}, r"CapturePolicy.SAMPLE_N needs sample_every= a positive int"),
        ({"capture_policy": "sample_n", "sample_every": True}, r"sample_every must be a positive int, got True"),
    ],
)
def test_a_policy_argument_without_its_policy_is_refused(mlp, kwargs, match):
    """max_k= or sample_every= without the capture policy that reads it (or that policy without
    it) was ignored: the capture kept every forward it was meant to leave out."""
    from activationscope.errors import ArgumentValueError

    with pytest.raises(ArgumentValueError, match=match):
        acs.ActivationScope(**kwargs)
    # with their policies they are taken at their word
    for kw, n in (({"capture_policy": "max_k", "max_k": 2}, 2), ({"capture_policy": "sample_n", "sample_every": 3}, 2),
                  ({"capture_policy": "sample_n", "sample_every": 1}, 5), ({"sample_every": 1}, 5)):
        with torch.no_grad(), acs.ActivationScope(**kw).track(mlp, include=["0"]) as tr:
            for _ in range(5):
                mlp(torch.randn(2, 16))
        assert len(tr.activations["0.output"]) == n, kw


@pytest.mark.parametrize("policy", ["streaming", "final_only"])
def test_a_reduction_policy_a_store_would_not_follow_is_refused(tmp_path, mlp, policy):
    """FINAL_ONLY with a store wrote every captured row into it all the same: refused, naming
    the fix (STREAMING makes a store that keeps reductions only: tests/test_reductions_only.py)."""
    from activationscope.errors import ArgumentValueError

    if policy == "final_only":
        with pytest.raises(ArgumentValueError, match=r"reduction_policy=ReductionPolicy.FINAL_ONLY decides which "
                                                     r"activations are kept in memory.*the store would hold every "
                                                     r"captured row.*ReductionPolicy.STREAMING with reductions="):
            acs.ActivationScope(store=tmp_path / "s.zarr", reductions=["mean"], reduction_policy=policy)
        assert not (tmp_path / "s.zarr").exists()
    # records kept in memory as well (storage=CPU): the policy is theirs, the store has every row
    scope = acs.ActivationScope(store=tmp_path / "c.zarr", storage="cpu", reductions=["mean"], reduction_policy=policy)
    with torch.no_grad(), scope.track(mlp, include=["0"]) as tr:
        for _ in range(3):
            mlp(torch.randn(2, 16))
    assert len(tr.activations["0.output"]) == (0 if policy == "streaming" else 1)
    assert acs.open_store(tmp_path / "c.zarr").n_rows("0.output") == 6


def test_policies_accept_strings():
    scope = acs.ActivationScope(capture_policy="sample_n", sample_every=2, capture_mode="reference", storage="cpu")
    assert scope.capture_policy is CapturePolicy.SAMPLE_N
    assert scope.capture_mode is CaptureMode.REFERENCE
    assert scope.storage is StoragePolicy.CPU


def test_include_pattern_matching_nothing_names_the_pattern(mlp):
    with pytest.raises(acs.HookPointNotFoundError, match="'encoder.*' matches no module"):
        acs.ActivationScope().track(mlp, include=["encoder.*"])
    with pytest.raises(KeyError):  # also the natural builtin
        acs.ActivationScope().track(mlp, include=["nope"])


def test_an_include_pattern_naming_a_hook_point_says_patterns_name_modules():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
    with pytest.raises(acs.HookPointNotFoundError, match=r"include pattern '2.output' matches no module of "
                       r"Sequential; .*Patterns name modules, not hook points: include='2' records '2.output'$"):
        acs.ActivationScope().track(model, include=["2.output"])
    with pytest.raises(acs.HookPointNotFoundError, match=r"include='1' records '1.input' \(with capture='input' "
                                                         r"or 'both'\)"):
        acs.ActivationScope().track(model, include=["1.input"])
    with pytest.raises(acs.HookPointNotFoundError) as e:
        acs.ActivationScope().track(model, include=["9.output"])
    assert "Patterns name modules" not in str(e.value)


def test_an_include_pattern_naming_the_end_of_module_paths_names_the_whole_paths():
    # include=["layer.3"] on a BERT-like model: "matches no module" with the first module names
    # of the model and no hint that a pattern is matched against the whole path from the root
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dense = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.dense(x)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embeddings = torch.nn.Linear(4, 4)
            self.encoder = torch.nn.Module()
            self.encoder.layer = torch.nn.ModuleList([Block() for _ in range(4)])

        def forward(self, x):
            x = self.embeddings(x)
            for block in self.encoder.layer:
                x = block(x)
            return x

    model = Encoder()
    for pattern, whole in (("layer.3", "['encoder.layer.3']"), ("layer.?.dense", "['encoder.layer.0.dense', "
                                                                                   "'encoder.layer.1.dense', ...]")):
        with pytest.raises(acs.HookPointNotFoundError) as e:
            acs.ActivationScope().track(model, include=[pattern])
        msg = str(e.value)
        assert msg.startswith(f"include pattern {pattern!r} matches no module of Encoder"), msg
        assert (f"a pattern is matched against the whole module path from the model's root: did you mean {whole}? "
                f"('*.{pattern}' selects them)") in msg, msg
    with pytest.raises(acs.HookPointNotFoundError) as e:  # nothing ends so: no such hint
        acs.ActivationScope().track(model, include=["block.9"])
    assert "whole module path" not in str(e.value)


class _SharedLayers(torch.nn.Module):
    """One block registered three times (``nn.ModuleList([block] * 3)``, as ALBERT shares its
    layer) and the embedding under a second attribute: ``named_modules()`` lists each once."""

    def __init__(self):
        super().__init__()
        block = torch.nn.Linear(4, 4)
        self.emb = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([block, block, block])
        self.tied = self.emb

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return h


@pytest.mark.parametrize("pattern, first", [("layers.2", "layers.0"), ("tied", "emb"), ("layers.[12]", "layers.0")])
def test_an_include_naming_a_module_registered_under_another_name_says_which_and_the_fix(pattern, first):
    # "matches no module; module names look like [...]" although model.layers[2] and
    # model.tied exist: they are the modules named_modules() lists as layers.0 and emb
    torch.manual_seed(0)
    model = _SharedLayers().eval()
    with pytest.raises(acs.HookPointNotFoundError) as e:
        acs.ActivationScope().track(model, include=[pattern])
    msg = str(e.value)
    assert f"include pattern {pattern!r} matches no module of _SharedLayers: it names a module registered" in msg
    assert f" is {first!r}: the same module object" in msg and f"include={[first]!r} records every call" in msg
    assert f"({first!r}: {first}.output, {first}#1.output, ...)" in msg
    with pytest.warns(acs.CaptureWarning, match=rf"exclude pattern {re.escape(repr(pattern))} matches no module of "
                                            rf"_SharedLayers, so it excludes nothing: .*exclude=\['{first}'\] leaves "
                                            "out every call of it"):
        with acs.ActivationScope().track(model, exclude=[pattern]):
            pass
    # what the message says is so: the fix records every call under the first name
    ids = torch.randint(0, 10, (2, 3))
    with torch.no_grad(), acs.ActivationScope().track(model, include=["layers.0"]) as tracker:
        model(ids)
    assert tracker.hook_points == ["layers.0.output", "layers.0#1.output", "layers.0#2.output"]
    with torch.no_grad():
        h = model.emb(ids)
        for k, name in enumerate(tracker.hook_points):
            h = model.layers[k](h)
            assert torch.equal(tracker.activations[name][0], h)


def test_a_pattern_naming_no_module_under_any_name_keeps_its_message():
    with pytest.raises(acs.HookPointNotFoundError) as e:
        acs.ActivationScope().track(_SharedLayers(), include=["layers.3"])
    assert "module names look like" in str(e.value) and "registered under more than one name" not in str(e.value)


def test_exclude_everything_is_an_error(mlp):
    with pytest.raises(acs.HookPointNotFoundError, match="leave no module"):
        acs.ActivationScope().track(mlp, exclude=["*"])


def test_include_exclude_select_modules(mlp):
    x = torch.randn(2, 16)
    with acs.ActivationScope().track(mlp, include=["0", "2", "4", "1"], exclude=["1"]) as tr:
        mlp(x)
    assert tr.hook_points == ["0.output", "2.output", "4.output"]


def test_include_exact_module_name_wins_over_its_pattern_reading():
    torch.manual_seed(0)
    model, x = BracketNames(), torch.randn(4, 2)
    with acs.ActivationScope().track(model, include=["d.a[1]"]) as tr:
        model(x)
    assert tr.hook_points == ["d.a[1].output"]
    assert torch.equal(tr.activations["d.a[1].output"][0], model.d["a[1]"](x).detach())
    # a pattern that names no module stays a pattern
    with acs.ActivationScope().track(model, include=["d.a?"]) as tr:
        model(x)
    assert tr.hook_points == ["d.a1.output"]


def test_exclude_exact_module_name_wins_over_its_pattern_reading():
    model = BracketNames()
    with acs.ActivationScope().track(model, exclude=["d.a[1]", "d"]) as tr:
        model(torch.randn(4, 2))
    assert tr.hook_points == ["d.a1.output"]


class _BracketBlocks(torch.nn.Module):
    """ModuleDict keys 'a[1]' and 'a1', each a block with submodules 0 and 1."""

    def __init__(self):
        super().__init__()
        block = lambda: torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())  # noqa: E731
        self.d = torch.nn.ModuleDict({"a[1]": block(), "a1": block()})

    def forward(self, x):
        return [m(x) for m in self.d.values()]


def test_a_bracket_pattern_that_selects_other_modules_than_the_brackets_names_says_so():
    """include=['d.a[1].*'] meant the blocks below the key 'a[1]', but fnmatch reads '[1]' as
    one of '1': it selected the blocks of 'a1' without a word (or matched nothing, with
    names unrelated to the brackets). Now a CaptureWarning (an error when nothing matches)
    names the modules holding the brackets and the pattern that selects them; it selects them."""
    model, x = _BracketBlocks().eval(), torch.randn(3, 2)
    hint = ("fnmatch reads '[...]' in it as a character class (one of its characters): the modules whose names hold "
            "those brackets are ['d.a[1].0', 'd.a[1].1'], which {}=['d.a[[]1].*'] {}")
    with pytest.warns(acs.CaptureWarning, match=re.escape(
            "include pattern 'd.a[1].*' selects ['d.a1.0', 'd.a1.1']; " + hint.format("include", "selects"))):
        with acs.ActivationScope().track(model, include=["d.a[1].*"]) as tr, torch.no_grad():
            model(x)
    assert tr.hook_points == ["d.a1.0.output", "d.a1.1.output"]
    with pytest.warns(acs.CaptureWarning, match=re.escape(hint.format("exclude", "leaves out"))):
        with acs.ActivationScope().track(model, include=["d.*.0"], exclude=["d.a[1].*"]) as tr, torch.no_grad():
            model(x)
    assert tr.hook_points == ["d.a[1].0.output"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with acs.ActivationScope().track(model, include=["d.a[[]1].*"]) as tr, torch.no_grad():
            model(x)
    assert tr.hook_points == ["d.a[1].0.output", "d.a[1].1.output"]
    with torch.no_grad():
        torch.testing.assert_close(tr.activations["d.a[1].0.output"][0], model.d["a[1]"][0](x), rtol=0, atol=0)
    del model.d["a1"]
    with pytest.raises(acs.HookPointNotFoundError, match=re.escape(hint.format("include", "selects"))):
        acs.ActivationScope().track(model, include=["d.a[1].*"])


_HOOK_HINT = ("fnmatch reads '[...]' in it as a character class (one of its characters): the hook points whose names "
              "hold those brackets are ['d.a[1].0.output', 'd.a[1].1.output', 'd.a[1].output'], which {}")


@pytest.mark.parametrize("argument, value, fix", [
    ("reductions", {"d.a[1].*": ["mean"]}, "reductions={'d.a[[]1].*': ...} selects"),
    ("token_rows", {"d.a[1].*": False}, "token_rows={'d.a[[]1].*': ...} selects"),
])
def test_a_bracket_pattern_of_reductions_or_token_rows_that_selects_other_hook_points_says_so(argument, value, fix):
    """reductions={'d.a[1].*': [...]} (and token_rows=) meant the hook points below the key
    'a[1]', but fnmatch read '[1]' as one of '1': the reductions went to d.a1's hook points
    without a word, or the no-match error named no reason. Now a CaptureWarning names the hook
    points holding the brackets and the pattern that selects them, and the error says so."""
    model, x = _BracketBlocks().eval(), torch.randn(3, 2)
    with pytest.warns(acs.CaptureWarning, match=re.escape(
            f"{argument}= pattern 'd.a[1].*' selects ['d.a1.0.output', 'd.a1.1.output', 'd.a1.output']; "
            + _HOOK_HINT.format(fix))):
        with acs.ActivationScope(**{argument: value}).track(model) as tr, torch.no_grad():
            model(x)
    if argument == "reductions":
        assert sorted(tr.reductions) == ["d.a1.0.output", "d.a1.1.output", "d.a1.output"]
    escaped = {k.replace("[", "[[]"): v for k, v in value.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with acs.ActivationScope(**{argument: escaped}).track(model) as tr, torch.no_grad():
            model(x)
    if argument == "reductions":
        assert sorted(tr.reductions) == ["d.a[1].0.output", "d.a[1].1.output", "d.a[1].output"]
        torch.testing.assert_close(tr.reductions["d.a[1].0.output"]["mean"],
                                   model.d["a[1]"][0](x).detach().double().mean(0))
    del model.d["a1"]
    with pytest.raises(acs.HookPointNotFoundError, match=re.escape(_HOOK_HINT.format(fix))):
        with acs.ActivationScope(**{argument: value}).track(model), torch.no_grad():
            model(x)


def test_a_bracket_pattern_of_exclude_hook_points_that_leaves_out_other_hook_points_says_so():
    """exclude_hook_points=['d.a[1].*'] meant the hook points below the key 'a[1]', but left
    out d.a1's without a word. Now a CaptureWarning at the first forward names the hook points
    holding the brackets and the pattern that leaves them out; that one leaves them out."""
    model, x = _BracketBlocks().eval(), torch.randn(3, 2)
    fix = "exclude_hook_points=['d.a[[]1].*'] leaves out"
    with pytest.warns(acs.CaptureWarning, match=re.escape(
            "exclude_hook_points= pattern 'd.a[1].*' leaves out ['d.a1.0.output', 'd.a1.1.output', 'd.a1.output']; "
            + _HOOK_HINT.format(fix))):
        with acs.ActivationScope().track(model, exclude_hook_points=["d.a[1].*"]) as tr, torch.no_grad():
            model(x)
    assert "d.a1.0.output" not in tr.hook_points and "d.a[1].0.output" in tr.hook_points
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with acs.ActivationScope().track(model, exclude_hook_points=["d.a[[]1].*"]) as tr, torch.no_grad():
            model(x)
    assert "d.a[1].0.output" not in tr.hook_points and "d.a1.0.output" in tr.hook_points
    del model.d["a1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope().track(model, exclude_hook_points=["d.a[1].*"]), torch.no_grad():
            model(x)
    said = [str(w.message) for w in caught if w.category is acs.CaptureWarning]
    assert said[0] == "exclude_hook_points= pattern 'd.a[1].*' leaves out no hook point; " + _HOOK_HINT.format(fix)
    assert "left out no hook point" in said[1] and len(said) == 2  # (the exit's word on a pattern that did nothing)


def test_pattern_hits_exact_names_first():
    from activationscope.capture.hooks import pattern_hits

    names = ["d.a1", "d.a[1]", "d.b"]
    assert pattern_hits("d.a[1]", names) == ["d.a[1]"]
    assert pattern_hits("d.a[0-9]", names) == ["d.a1"]
    assert pattern_hits("d.*", names) == names
    assert pattern_hits("D.b", names) == []


def test_track_overrides_capture_side(mlp):
    with acs.ActivationScope(capture="output").track(mlp, include=["0"], capture="input") as tr:
        mlp(torch.randn(2, 16))
    assert tr.hook_points == ["0.input.0"]


def test_wrong_reduction_signature_raises_at_construction():
    def bad(x):
        return x

    with pytest.raises(acs.ReductionError, match="bad"):
        acs.ActivationScope(reductions=[bad])
    with pytest.raises(acs.ReductionError, match="unknown|mean"):
        acs.ActivationScope(reductions=["meen"])


def test_set_batch_validates(mlp):
    tr = acs.ActivationScope().track(mlp)
    with pytest.raises(ValueError, match="attention_mask must be 2-D \\(batch, pos\\), got shape \\(3,\\)"):
        tr.set_batch(attention_mask=torch.ones(3))
    with pytest.raises(ValueError, match="column 'label' has 2 entries, expected the batch size 3"):
        tr.set_batch(attention_mask=torch.ones(3, 4, dtype=torch.bool), label=[0, 1])


# ----------------------------------------------------------------------------- structured I/O
@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    extra: Optional[torch.Tensor] = None
    note: str = "x"


class Structured(torch.nn.Module):
    def forward(self, x, *, scale=None, bias=0.0):
        y = x * 2
        s = x if scale is None else x * scale
        return (y, [s, None], {"k": y + 1, "text": "hello"}, Out(hidden=y - 1))


def test_structured_outputs_are_flattened_into_named_leaves():
    m = torch.nn.Sequential(Structured())
    x = torch.randn(2, 3)
    with acs.ActivationScope().track(m) as tr:
        m[0](x)
    acts = tr.activations
    assert sorted(acts) == sorted(["0.output.0", "0.output.1.0", "0.output.2.k", "0.output.3.hidden"])
    assert torch.equal(acts["0.output.0"][0], x * 2)
    assert torch.equal(acts["0.output.1.0"][0], x)
    assert torch.equal(acts["0.output.2.k"][0], x * 2 + 1)
    assert torch.equal(acts["0.output.3.hidden"][0], x * 2 - 1)


@dataclasses.dataclass
class WithClassVar:
    SCALE: typing.ClassVar[torch.Tensor] = torch.full((2,), 7.0)  # of the class, not a field
    hidden: torch.Tensor
    steps: dataclasses.InitVar[Optional[torch.Tensor]] = None  # an __init__ argument, not a field

    def __post_init__(self, steps):
        pass


def test_dataclass_output_leaves_are_its_fields_only():
    # ClassVar and InitVar names are in __dataclass_fields__ but are not fields of the output
    # (dataclasses.fields leaves them out): the class's tensor is not recorded at every call
    class M(torch.nn.Module):
        def forward(self, x):
            return WithClassVar(hidden=x * 2, steps=x)

    model = torch.nn.Sequential(M())
    x = torch.randn(2, 3)
    with acs.ActivationScope().track(model) as tr:
        model(x)
    assert list(tr.activations) == ["0.output.hidden"]
    assert torch.equal(tr.activations["0.output.hidden"][0], x * 2)


class _Holder:
    """A plain object holding tensors (as an HF cache does)."""

    def __init__(self, x):
        self.layers = [{"keys": x + 1}]
        self.note = "not a tensor"


class _Empty:
    """A plain object holding no tensor."""

    def __init__(self):
        self.n = 3


class ReturnsObjects(torch.nn.Module):
    def forward(self, x, holder=None, empty=None, lin=None, dtype=torch.float32):
        return x * 2, _Holder(x), _Empty(), torch.distributions.Normal(x, 1.0)


def test_tensors_held_by_objects_the_walk_does_not_enter_are_warned_about_once_per_type():
    # an HF Cache, a distribution or a custom object holding tensors is not walked: its tensors
    # were left out without a word; now a CaptureWarning names the path, the type and a tensor
    # of it, once per type per capture. Objects holding no tensor, modules passed as arguments
    # and dtypes are not warned about.
    model = torch.nn.Sequential(ReturnsObjects())
    xs = [torch.randn(2, 3) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(capture="both").track(model) as tr:
            for x in xs:
                model[0](x, holder=_Holder(x), empty=_Empty(), lin=torch.nn.Linear(2, 2), dtype=torch.float16)
    said = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    held = [m for m in said if "holding tensors" in m]
    assert len(held) == 2, said  # one per type: _Holder (input first), Normal
    assert held[0].startswith("'0.input.kw.holder' is a ") and "_Holder holding tensors (e.g. \".layers[0]['keys']\")" in held[0]
    assert held[1].startswith("'0.output.3' is a torch.distributions.normal.Normal holding tensors")
    assert "Track the modules that compute them" in held[0]
    assert sorted(tr.activations) == ["0.input.0", "0.output.0"]  # what is captured is unchanged
    assert all(torch.equal(a, x * 2) for a, x in zip(tr.activations["0.output.0"], xs))


def test_an_object_that_holds_tensors_only_later_is_still_warned_about():
    # a cache is empty at its first calls and filled later: the type is checked again (a few
    # times) until it holds a tensor
    class Cache:
        def __init__(self):
            self.keys = []

    class M(torch.nn.Module):
        def forward(self, x, cache):
            cache.keys.append(x + 1)
            return x

    cache, model = Cache(), torch.nn.Sequential(M())
    with pytest.warns(acs.CaptureWarning, match=r"'0.input.1' is a .*Cache holding tensors \(e.g. '.keys\[0\]'\)"):
        with acs.ActivationScope(capture="input").track(model, include=["0"]):
            with torch.no_grad():
                model[0](torch.randn(2, 3), Cache())  # empty when it enters the module
                model[0](torch.randn(2, 3), cache)
                model[0](torch.randn(2, 3), cache)  # holds one tensor now


def _made_class(i: int, holds: bool) -> type:
    """A class made at run time (as a model that makes one per forward) whose instances hold a
    tensor in an attribute, or an int."""

    def __init__(self, x):
        self.t = x + 1 if holds else 3

    return type(f"Made{i}", (), {"__init__": __init__})


class _TakesObject(torch.nn.Module):
    def forward(self, x, obj):
        return x * 2


def _held_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "holding tensors" in str(w.message)]


def test_the_verdict_on_a_class_never_applies_to_another_class_at_its_address():
    """The check for held tensors kept its verdict on a class (warned about; or holding no
    tensor after 8 checks) by the class's address, for as long as the tracker lived: a class
    freed and another made at its address (as Python does at once) inherited the verdict, so
    a class holding tensors went without a warning. Each class is now warned about on its own
    (once), and the cache of verdicts holds no class alive."""
    import weakref

    model, x = torch.nn.Sequential(_TakesObject()), torch.randn(2, 3)
    holds = [i % 3 != 0 for i in range(24)]  # (no, yes, yes, ...: every change of verdict at a reused address)
    ids, refs = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(capture="input").track(model, include=["0"]) as tr:
            for i, h in enumerate(holds):
                cls = _made_class(i, h)
                ids.append(id(cls))
                refs.append(weakref.ref(cls))
                before = len(caught)
                for _ in range(10):  # (past the 8 checks of a class that holds none)
                    model[0](x, cls(x))
                said = _held_warnings(caught[before:])
                if h:
                    assert len(said) == 1 and said[0].startswith(f"'0.input.1' is a {__name__}.Made{i} holding "
                                                                  "tensors (e.g. '.t')"), (i, said)
                else:
                    assert said == [], (i, said)
                del cls
                gc.collect()
                assert refs[-1]() is None  # (freed: the cache holds no class alive)
            # (one entry per address: a freed class's entry is dropped when another class is met at its address)
            assert tr._core._unwalked_types_cached <= len(set(ids))
    assert len(set(ids)) < len(ids)  # (addresses were reused: what the test is about)
    assert torch.equal(tr.activations["0.input.0"][0], x) and len(tr.activations["0.input.0"]) == 240


def test_the_forward_hook_warning_of_a_reference_capture_says_the_record_holds_the_hooks_value():
    """Under REFERENCE a record is the module's own tensor: a forward hook that changes it in place
    changes the record, so the warning about hooks says so (it said only that the record is the
    value before the hooks), and the record holds the steered value."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    model[0].register_forward_hook(lambda m, i, out: out.mul_(0.5))
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(capture_mode=CaptureMode.REFERENCE).track(model) as tr:
            out = model(x)
    said = [str(w.message) for w in caught if "forward hooks of the tracked modules" in str(w.message)]
    assert len(said) == 1 and "With CaptureMode.REFERENCE a record is the module's own tensor" in said[0]
    assert torch.equal(tr.activations["0.output"][0], out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope().track(model):
            model(x)
    said = [str(w.message) for w in caught if "forward hooks of the tracked modules" in str(w.message)]
    assert len(said) == 1 and "REFERENCE" not in said[0]


def test_an_object_whose_class_attribute_claims_tensor_is_not_taken_for_one():
    """An object whose ``__class__`` says torch.Tensor (a mock, a proxy) passes isinstance(), and
    the native walk of a module's inputs and outputs took it for a tensor: it ran that property
    and read the object's memory as a tensor's (the process crashed). Tensors are told by their
    type now: such an object is not captured, its property never runs, and real tensors beside
    it are captured as before."""
    import subprocess
    import textwrap

    script = textwrap.dedent("""
        import warnings, torch, activationscope as acs
        class Fake:
            calls = 0
            @property
            def __class__(self):
                Fake.calls += 1
                return torch.Tensor
        class M(torch.nn.Module):
            def forward(self, x, other=None):
                return Fake(), x * 2
        m = torch.nn.Sequential(M())
        x = torch.randn(2, 3)
        assert isinstance(Fake(), torch.Tensor)
        Fake.calls = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with acs.ActivationScope(capture="both").track(m) as tr:
                m[0](x, Fake())
                out = m(x)
        assert Fake.calls == 0, Fake.calls
        acts = tr.activations
        assert sorted(acts) == ["0.input.0", "0.output.1"], sorted(acts)
        assert torch.equal(acts["0.output.1"][-1], x * 2) and torch.equal(acts["0.input.0"][-1], x)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stdout, done.stderr[-2000:])


def test_the_verdicts_on_classes_made_at_each_forward_stay_bounded():
    """A model that makes a new class at each forward grew the tracker's cache of verdicts by
    one entry per class, without end. It now holds at most _UNWALKED_TYPES_CAP entries: the
    entries of freed classes are dropped, and a class met while that many live classes are
    cached is still checked (warned about when it holds tensors) without a cached verdict."""
    from activationscope import _C

    cap = _C._UNWALKED_TYPES_CAP
    model, x = torch.nn.Sequential(_TakesObject()), torch.randn(2, 3)
    alive = [_made_class(i, i % 2 == 0) for i in range(cap + 40)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(capture="input").track(model, include=["0"]) as tr:
            for cls in alive:  # (all kept alive: the cache fills up)
                model[0](x, cls(x))
            assert tr._core._unwalked_types_cached == cap
            said = _held_warnings(caught)
            for i in range(cap + 40):
                named = [m for m in said if f".Made{i} holding tensors" in m]
                assert len(named) == (1 if i % 2 == 0 else 0), (i, named)
            # a class past the cap is checked at each meeting
            before = len(caught)
            model[0](x, alive[-2](x))
            assert len(_held_warnings(caught[before:])) == 1
            model[0](x, alive[-1](x))
            assert _held_warnings(caught[before + 1:]) == []
            # freed classes make room: a new class is cached again (warned about once)
            del alive[:]
            gc.collect()
            for i in range(cap + 40, cap + 100):
                before = len(caught)
                cls = _made_class(i, True)
                for _ in range(3):
                    model[0](x, cls(x))
                said = _held_warnings(caught[before:])
                assert len(said) == 1 and f".Made{i} holding tensors" in said[0], (i, said)
                del cls
                assert tr._core._unwalked_types_cached <= cap
    assert len(tr.activations["0.input.0"]) == cap + 42 + 60 * 3


_VERDICTS_AT_EXIT = r"""
import gc, sys, threading, warnings
import torch
import activationscope as acs

class Holder:
    def __init__(self, x):
        self.t = x

class M(torch.nn.Module):
    def forward(self, x, obj):
        return x * 2

warnings.simplefilter("ignore")
model = torch.nn.Sequential(M())
scope = acs.ActivationScope(capture="input")
kept = scope.track(model).__enter__()  # (never closed: alive at exit, its verdicts too)
model[0](torch.ones(2), Holder(torch.ones(2)))
assert kept._core._unwalked_types_cached == 1

def other():  # a tracker whose last reference goes in another thread
    with acs.ActivationScope(capture="input").track(model) as tr:
        model[0](torch.ones(2), type("Made", (), {})())
        assert tr._core._unwalked_types_cached == 1
    del tr
    gc.collect()

t = threading.Thread(target=other)
t.start()
t.join()
print("ok", flush=True)
"""


def test_the_verdicts_on_classes_are_released_at_a_tracker_end_and_at_exit():
    """The cache of verdicts holds references to Python objects (its types' weak references):
    released with the GIL when a tracker is freed (also from another thread), left to an
    interpreter that is ending."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _VERDICTS_AT_EXIT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr[-3000:]


def test_a_hugging_face_cache_in_the_outputs_is_warned_about():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, 50, (2, 6))
    with pytest.warns(acs.CaptureWarning, match=r"'output\.(cache|past_key_values)' is a transformers\.cache_utils\.\w+ "
                                                r"holding tensors.*key / value projections"):
        with acs.ActivationScope().track(model, include=[""]) as tr, torch.no_grad():
            out = model(ids, use_cache=True)
    assert torch.equal(tr.activations["output.last_hidden_state"][0], out.last_hidden_state)



_USER_CALLS: list = []


class _SlotsWithGetattr:
    __slots__ = ("t", "unset")

    def __init__(self, x):
        self.t = x

    def __getattr__(self, name):  # a proxy: any attribute it lacks is made on access
        _USER_CALLS.append(f"__getattr__({name!r})")
        return self


class _ClassProperty:
    def __init__(self, x):
        self.t = x

    @property
    def __class__(self):  # (as unittest.mock objects have)
        _USER_CALLS.append("__class__")
        return _ClassProperty


class _Getattribute:
    def __init__(self, x):
        self.t = x

    def __getattribute__(self, name):
        _USER_CALLS.append(f"__getattribute__({name!r})")
        return object.__getattribute__(self, name)


class deque:  # noqa: N801 - a class of the user's that is no collections.deque
    def __init__(self, x):
        self.x, self.consumed = x, False

    def __iter__(self):
        _USER_CALLS.append("deque.__iter__")
        self.consumed = True
        return iter([self.x])


class _Items(dict):
    def items(self):
        _USER_CALLS.append("items")
        return super().items()


class _Iter(list):
    def __iter__(self):
        _USER_CALLS.append("list.__iter__")
        return super().__iter__()


class _Key:
    def __repr__(self):
        _USER_CALLS.append("__repr__")
        return "key"


class _HoldsSubclasses:
    def __init__(self, x):
        self.d, self.l, self.k = _Items(a=x), _Iter([x]), {_Key(): x}
        self.__dict__[_Key()] = x  # (an attribute whose name is no str)


class _BaseSlots:
    __slots__ = ("cache",)


class _InheritedSlots(_BaseSlots):
    __slots__ = ()

    def __init__(self, x):
        self.cache = x


class _StrSlots:
    __slots__ = "cache"

    def __init__(self, x):
        self.cache = x


class _MroProperty(type):
    @property
    def __mro__(cls):
        _USER_CALLS.append("__mro__")
        return (cls, object)


class _PrivateSlotOfAMetaclass(metaclass=_MroProperty):
    __slots__ = ("__t",)

    def __init__(self, x):
        self.__t = x


@pytest.mark.parametrize("kind", [_SlotsWithGetattr, _ClassProperty, _Getattribute, deque, _HoldsSubclasses,
                                  _PrivateSlotOfAMetaclass])
def test_the_check_for_held_tensors_itself_runs_no_code_of_the_object(kind):
    """(What a capture does besides: its walk tells tensors by torch's own check, which reads
    ``__class__`` of an object that is none, as every torch function given one does.)"""
    from activationscope.capture import compiled

    obj = kind(torch.ones(2))
    _USER_CALLS.clear()
    with pytest.warns(acs.CaptureWarning, match=f"'p' is a {__name__}.{kind.__qualname__} holding tensors"):
        assert compiled.warn_unwalked("p", obj)
    assert _USER_CALLS == []


@pytest.mark.parametrize("kind", [_SlotsWithGetattr, deque, _HoldsSubclasses, _InheritedSlots, _StrSlots])
def test_the_check_for_held_tensors_runs_no_code_of_the_object_and_finds_every_slot(kind):
    """Looking for tensors in an object the walk does not enter read it through its own
    attribute lookup: it ran a proxy's ``__getattr__``, a ``__class__`` property, an
    overridden ``__getattribute__``, ``items`` / ``__iter__`` of dict and list subclasses and
    the ``repr`` of dict keys, and consumed a user class named ``deque`` by iterating it.
    Tensors in a base class's ``__slots__`` or a ``__slots__`` string were not found."""
    class M(torch.nn.Module):
        def forward(self, x, obj):
            return x * 2

    model, x = torch.nn.Sequential(M()), torch.randn(2, 3)
    obj = kind(x)
    _USER_CALLS.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acs.ActivationScope(capture="input").track(model) as tr:
            model[0](x, obj)
    assert _USER_CALLS == []
    said = [str(w.message) for w in caught if "holding tensors" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"'0.input.1' is a {__name__}.{kind.__qualname__} holding tensors")
    assert not getattr(obj, "consumed", False) if kind is deque else True
    assert torch.equal(tr.activations["0.input.0"][0], x)


class Nested(torch.nn.Module):
    """Returns ``(x + 1, ((...(x * 3,)...),))``: ``x * 3`` inside ``levels`` one-element tuples
    (``x`` may come inside tuples too)."""

    def __init__(self, levels: int) -> None:
        super().__init__()
        self.levels = levels

    def forward(self, x):
        while isinstance(x, tuple):
            (x,) = x
        deep = x * 3
        for _ in range(self.levels):
            deep = (deep,)
        return (x + 1, deep)


def test_deeply_nested_output_is_captured_whole():
    # a tree-structured output 12 containers deep: every tensor leaf is a hook point
    model = torch.nn.Sequential(Nested(12))
    x = torch.randn(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with acs.ActivationScope(capture="both").track(model) as tr:
            model(((x,),))
    acts = tr.activations
    deep = "0.output.1" + ".0" * 12
    assert sorted(acts) == sorted(["0.input.0.0.0", "0.output.0", deep])
    assert torch.equal(acts[deep][0], x * 3)
    assert torch.equal(acts["0.output.0"][0], x + 1)


def test_output_nested_past_the_walk_limit_warns_naming_the_path():
    model = torch.nn.Sequential(Nested(40))
    x = torch.randn(2, 3)
    with pytest.warns(acs.CaptureWarning, match=r"'0\.output\.1(\.0){31}'.*nested 32 levels deep"):
        with acs.ActivationScope().track(model) as tr:
            model(x)
    assert list(tr.activations) == ["0.output.0"]  # what the walk reached, kept
    assert torch.equal(tr.activations["0.output.0"][0], x + 1)


def test_namedtuple_output_uses_field_names():
    from collections import namedtuple

    Pair = namedtuple("Pair", ["left", "right"])

    class M(torch.nn.Module):
        def forward(self, x):
            return Pair(x + 1, x - 1)

    model = torch.nn.Sequential(M())
    x = torch.randn(2, 2)
    with acs.ActivationScope().track(model) as tr:
        model(x)
    assert torch.equal(tr.activations["0.output.left"][0], x + 1)
    assert torch.equal(tr.activations["0.output.right"][0], x - 1)


def test_hf_model_output_optional_fields():
    mo = pytest.importorskip("transformers.modeling_outputs")

    class M(torch.nn.Module):
        def forward(self, x):
            return mo.BaseModelOutputWithPooling(last_hidden_state=x * 3, pooler_output=None)

    model = torch.nn.Sequential(M())
    x = torch.randn(2, 4, 3)
    with acs.ActivationScope().track(model) as tr:
        model(x)
    assert list(tr.activations) == ["0.output.last_hidden_state"]
    assert torch.equal(tr.activations["0.output.last_hidden_state"][0], x * 3)


def test_keyword_inputs_and_all_keyword_calls():
    m = torch.nn.Sequential(Structured())
    x, scale = torch.randn(2, 3), torch.randn(2, 3)
    with acs.ActivationScope(capture="input").track(m) as tr:
        m[0](x, scale=scale)
        m[0](x=x)
    acts = tr.activations
    assert torch.equal(acts["0.input.0"][0], x)
    assert torch.equal(acts["0.input.kw.scale"][0], scale)
    assert torch.equal(acts["0.input.kw.x"][0], x)  # all-keyword call, no positional input
    assert len(acts["0.input.kw.scale"]) == 1


def test_module_called_several_times_in_one_forward():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            a = self.lin(x)
            b = self.lin(a[:1])  # second call, other shape
            return self.lin(b) + 1

    torch.manual_seed(0)
    model = Shared()
    xs = [torch.randn(3, 4), torch.randn(3, 4)]
    with acs.ActivationScope().track(model, include=["lin"]) as tr:
        for x in xs:
            model(x)
    acts = tr.activations
    assert sorted(acts) == ["lin#1.output", "lin#2.output", "lin.output"]
    for i, x in enumerate(xs):
        a = model.lin(x)
        b = model.lin(a[:1])
        assert torch.equal(acts["lin.output"][i], a)
        assert torch.equal(acts["lin#1.output"][i], b)
        assert torch.equal(acts["lin#2.output"][i], model.lin(b))
    assert acts["lin#1.output"][0].shape == (1, 4)


# ----------------------------------------------------------------------------- in-place
def test_snapshot_is_the_value_at_call_time_despite_inplace_relu(cnn):
    x = torch.randn(2, 3, 8, 8)
    with acs.ActivationScope(capture="both").track(cnn) as tr:
        cnn(x)
    acts = tr.activations
    pre = cnn.bn1(cnn.conv1(x))
    assert torch.equal(acts["bn1.output"][0], pre)  # before relu1 changed it in place
    assert acts["bn1.output"][0].min() < 0
    assert torch.equal(acts["relu1.input.0"][0], pre)  # input taken before the module ran
    assert torch.equal(acts["relu1.output"][0], torch.relu(pre))


def test_reference_mode_warns_naming_the_hook_point(cnn):
    x = torch.randn(2, 3, 8, 8)
    with pytest.warns(acs.CaptureWarning, match="'bn1.output'.*changed in place"):  # a RuntimeWarning too
        with acs.ActivationScope(capture_mode=CaptureMode.REFERENCE).track(cnn, include=["bn1"]) as tr:
            cnn(x)
    assert tr.activations["bn1.output"][0].min() >= 0  # the reference saw the in-place ReLU


def test_reference_mode_no_warning_without_inplace(mlp):
    x = torch.randn(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with acs.ActivationScope(capture_mode=CaptureMode.REFERENCE).track(mlp) as tr:
            mlp(x)
        acts = tr.activations
    assert torch.equal(acts["0.output"][0], mlp[0](x))


# ----------------------------------------------------------------------------- layouts
class Layouts(torch.nn.Module):
    def forward(self, x):
        return (
            x.t(),  # non-contiguous
            x[:, None, None, :].expand(x.shape[0], 3, 4, x.shape[1]),  # stride 0
            x[:, :0],  # zero-size
            x.reshape(1, 2, x.shape[0] // 2, x.shape[1]).contiguous(memory_format=torch.channels_last),
        )


def test_noncontiguous_expanded_zero_size_channels_last_in_logical_order():
    m = torch.nn.Sequential(Layouts())
    x = torch.randn(4, 6)
    with acs.ActivationScope().track(m) as tr:
        out = m(x)
    acts = tr.activations
    for i, want in enumerate(out):
        got = acts[f"0.output.{i}"][0]
        assert got.shape == want.shape and torch.equal(got, want)
        assert got.is_contiguous()
    assert acts["0.output.2"][0].numel() == 0


@pytest.mark.parametrize("mode", [acs.CaptureMode.SNAPSHOT, acs.CaptureMode.REFERENCE])
def test_empty_batch_keeps_an_empty_record(mlp, mode):
    """An empty batch adds no rows and changes no reduction, but keeps its (empty) record:
    record i is forward i's, and the final record of FINAL_ONLY is the last forward's."""
    xs = [torch.randn(0, 16), torch.randn(2, 16), torch.randn(0, 16), torch.randn(3, 16)]
    with acs.ActivationScope(capture_mode=mode, reductions=["mean"]).track(mlp, include=["0"]) as tr, torch.no_grad():
        for x in xs:
            mlp(x)
    records = tr.activations["0.output"]
    assert [tuple(t.shape) for t in records] == [(0, 16), (2, 16), (0, 16), (3, 16)]
    with torch.no_grad():
        want = torch.cat([mlp[0](x) for x in xs])
    torch.testing.assert_close(torch.cat(records), want, rtol=0, atol=0)
    torch.testing.assert_close(tr.reductions["0.output"]["mean"], want.double().mean(0))
    with acs.ActivationScope(reduction_policy=ReductionPolicy.FINAL_ONLY).track(mlp, include=["0"]) as tr, torch.no_grad():
        mlp(torch.randn(2, 16))
        mlp(torch.randn(0, 16))
    assert [tuple(t.shape) for t in tr.activations["0.output"]] == [(0, 16)]


class _EmptyPlaceholder(torch.nn.Module):
    """Returns a float16 (0, 3) placeholder for an empty batch, its float32 rows otherwise."""

    def forward(self, x):
        if x.shape[0] == 0:
            return torch.zeros(0, 3, dtype=torch.float16)
        return x * 1.001


@pytest.mark.parametrize("first", [(0, 3), (0, 5)], ids=["other-dtype", "other-shape"])
def test_a_store_array_opened_by_an_empty_first_batch_refuses_rows_it_would_change(tmp_path, first):
    """The store array is opened at a hook point's first call: an empty batch there (a
    placeholder of another dtype) fixed its dtype, and the first real rows were cast to it
    without a word (float32 70070 stored as float16 inf, 1.2358 as 1.2354) while the
    reductions saw them uncast. Now refused, naming the hook point and the fix."""
    m = torch.nn.Sequential(_EmptyPlaceholder())
    store = tmp_path / "s.zarr"
    rows = torch.tensor([[70000.0, 1.2345678, -3.0]])
    with pytest.raises(acs.CaptureError, match=(
            r"hook point '0.output' returned an empty batch at its first call \(rows of shape \(3,\), "
            r"torch.float16\).*first rows are \(3,\), torch.float32.*x.new_empty")):
        with acs.ActivationScope(store=store, reductions=["max"]).track(m), torch.no_grad():
            m(torch.zeros(*first))  # first=(0, 5): the placeholder's shape (3,) is what counts
            m(rows)
    # storage_dtype= makes every row one dtype: the empty placeholder is no longer a problem
    with acs.ActivationScope(store=store, storage_dtype=torch.float32,
                             store_options={"overwrite": True}).track(m), torch.no_grad():
        m(torch.zeros(0, 3))
        m(rows)
    assert torch.equal(acs.open_store(store)["0.output"], rows * 1.001)
    # an empty first batch of the rows' own dtype and shape is fine, as before
    mlp = torch.nn.Sequential(torch.nn.Linear(3, 3))
    with acs.ActivationScope(store=tmp_path / "t.zarr").track(mlp), torch.no_grad():
        mlp(torch.zeros(0, 3))
        mlp(rows)
    with torch.no_grad():
        want = mlp(rows)
    assert torch.equal(acs.open_store(tmp_path / "t.zarr")["0.output"], want)


class _HalfRows(torch.nn.Module):
    """Returns a float32 (0, 3) placeholder for an empty batch, its rows as float16 once ``half``."""

    half = False

    def forward(self, x):
        if x.shape[0] == 0:
            return torch.zeros(0, 3)
        return x.half() if self.half else x * 1.0


def test_an_empty_first_batch_of_a_resume_does_not_advise_storage_dtype(tmp_path):
    """In a resume the stored array (not the empty first call) fixed the rows' dtype, and a
    resume must keep the store's storage_dtype: the refusal of rows of another dtype after an
    empty first call advised storage_dtype=, which that resume then refused. Now it names the
    stored array and the ways that work."""
    m = torch.nn.Sequential(_HalfRows())
    store = tmp_path / "s.zarr"
    with acs.ActivationScope(store=store).track(m), torch.no_grad():
        m(torch.ones(2, 3))
    m[0].half = True
    with pytest.raises(acs.CaptureError) as info:
        with acs.ActivationScope(store=store, store_options={"resume": True}).track(m), torch.no_grad():
            m(torch.zeros(0, 3))
            m(torch.ones(2, 3))
    msg = str(info.value)
    assert "storage_dtype=" not in msg
    assert ("returned an empty batch at its first call (rows of shape (3,), torch.float32), the row shape and dtype "
            "of its store array in the store this capture resumes; its first rows are (3,), torch.float16") in msg
    assert "resume with rows of the stored shape and dtype, capture again with overwrite=True, or exclude= its module" in msg
    # (following storage_dtype= was refused: a resume keeps the store's storage_dtype)
    with pytest.raises(acs.CaptureError, match=r"cannot resume .* storage_dtype=None"):
        with acs.ActivationScope(store=store, storage_dtype=torch.float16,
                                 store_options={"resume": True}).track(m), torch.no_grad():
            m(torch.zeros(0, 3))
    assert acs.open_store(store).n_rows("0.output") == 2


# ----------------------------------------------------------------------------- autograd modes
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recompute_is_not_recorded_twice(use_reentrant):
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            h = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=use_reentrant)
            return self.head(h)

    net = Net().train()
    x = torch.randn(4, 8, requires_grad=True)
    with acs.ActivationScope().track(net, include=["block.0", "head"]) as tr:
        for _ in range(2):
            net(x).sum().backward()
    acts = tr.activations
    assert len(acts["block.0.output"]) == 2 and len(acts["head.output"]) == 2
    assert torch.equal(acts["block.0.output"][0], block[0](x).detach())
    assert all(t.grad_fn is None and not t.requires_grad for t in acts["block.0.output"])


@pytest.mark.parametrize("mode", ["train", "no_grad", "inference_mode"])
def test_grad_modes(mode, mlp):
    x = torch.randn(3, 16)
    ctx = {"train": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with acs.ActivationScope().track(mlp) as tr:
        with ctx():
            out = mlp(x)
            if mode == "train":
                out.sum().backward()
    want, _ = plain_hooks(mlp, lambda: mlp(x), grad=True)
    assert_same_records(tr.activations, want)


class _Sentinel:
    pass


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sentinel):
        ctx.sentinel = sentinel  # lives exactly as long as the graph node
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


class _WithGraph(torch.nn.Module):
    def __init__(self, sentinel):
        super().__init__()
        self.sentinel = sentinel

    def forward(self, x):
        return _Double.apply(x, self.sentinel)


@pytest.mark.parametrize("mode", [CaptureMode.SNAPSHOT, CaptureMode.REFERENCE])
def test_records_do_not_keep_the_graph_alive(mode):
    import weakref

    sentinel = _Sentinel()
    ref = weakref.ref(sentinel)
    model = torch.nn.Sequential(_WithGraph(sentinel), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    with acs.ActivationScope(capture_mode=mode, capture="both").track(model) as tr:
        out = model(x)
    model[0].sentinel = None
    del sentinel
    assert ref() is not None  # `out` still holds the graph
    del out
    gc.collect()
    assert ref() is None  # the graph died although the tracker holds every record
    recs = [t for ts in tr.activations.values() for t in ts]
    assert len(recs) == 4 and all(t.grad_fn is None and not t.requires_grad for t in recs)


# ----------------------------------------------------------------------------- policies
def test_sample_n_and_max_k_count_forwards(mlp):
    xs = [torch.randn(2, 16) for _ in range(7)]
    with acs.ActivationScope(capture_policy=CapturePolicy.SAMPLE_N, sample_every=3).track(mlp, include=["0"]) as tr:
        for x in xs:
            mlp(x)
    got = tr.activations["0.output"]
    assert len(got) == 3
    for rec, i in zip(got, [0, 3, 6]):
        assert torch.equal(rec, mlp[0](xs[i]))
    with acs.ActivationScope(capture_policy="max_k", max_k=2).track(mlp, include=["0"]) as tr:
        for x in xs:
            mlp(x)
    assert [torch.equal(r, mlp[0](x)) for r, x in zip(tr.activations["0.output"], xs)] == [True, True]
    assert len(tr.activations["0.output"]) == 2
    assert tr.n_forwards == 7


def _rss_bytes():
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_flat_over_1000_forwards_with_bounded_capture():
    acs.capture.scope._C.set_staging_prefault(False)  # no background slab preparation while measuring
    try:
        _memory_flat()
    finally:
        acs.capture.scope._C.set_staging_prefault(True)


def _memory_flat():
    model = toy_mlp(64, 2)
    x = torch.randn(32, 64)
    with acs.ActivationScope(capture="both", capture_policy="max_k", max_k=3).track(model) as tr:
        for _ in range(50):
            model(x)
        C = acs.capture.scope._C
        before, pooled_before = _rss_bytes(), C.pooled_staging_bytes()
        for _ in range(1000):
            model(x)
        after, pooled_after = _rss_bytes(), C.pooled_staging_bytes()
    assert all(len(v) == 3 for v in tr.activations.values())
    # the staging pool may prepare a slab in the background meanwhile: not capture memory
    assert (after - before) - (pooled_after - pooled_before) < 8 << 20


def test_streaming_keeps_reductions_only(mlp):
    xs = [torch.randn(3, 16) for _ in range(4)]
    with acs.ActivationScope(reduction_policy=ReductionPolicy.STREAMING, reductions=["mean", "max"]).track(mlp) as tr:
        for x in xs:
            mlp(x)
    assert all(len(v) == 0 for v in tr.activations.values())
    rows = torch.cat([mlp[0](x) for x in xs]).double()
    torch.testing.assert_close(tr.reductions["0.output"]["mean"], rows.mean(0))
    torch.testing.assert_close(tr.reductions["0.output"]["max"], rows.max(0).values)


def test_final_only_keeps_the_last_record(mlp):
    xs = [torch.randn(3, 16) for _ in range(3)]
    with acs.ActivationScope(reduction_policy="final_only", reductions=["mean"]).track(mlp, include=["0"]) as tr:
        for x in xs:
            mlp(x)
    recs = tr.activations["0.output"]
    assert len(recs) == 1 and torch.equal(recs[0], mlp[0](xs[-1]))
    torch.testing.assert_close(tr.reductions["0.output"]["mean"], torch.cat([mlp[0](x) for x in xs]).double().mean(0))


def test_storage_dtype_casts_records(mlp, float_dtype):
    x = torch.randn(3, 16)
    with acs.ActivationScope(storage_dtype=float_dtype).track(mlp, include=["0"]) as tr:
        mlp(x)
    rec = tr.activations["0.output"][0]
    assert rec.dtype == float_dtype and torch.equal(rec, mlp[0](x).to(float_dtype))


def test_model_dtype_is_kept(float_dtype):
    model = toy_mlp().to(float_dtype)
    x = torch.randn(3, 16, dtype=float_dtype)
    with acs.ActivationScope().track(model) as tr:
        model(x)
    assert_same_records(tr.activations, plain_hooks(model, lambda: model(x), grad=True)[0])
    assert tr.activations["0.output"][0].dtype == float_dtype


def test_capture_parameters_snapshot(mlp):
    with acs.ActivationScope(capture_parameters=True).track(mlp) as tr:
        with torch.no_grad():
            mlp[0].weight.add_(1.0)
    assert set(tr.parameters) == {n for n, _ in mlp.named_parameters()}
    torch.testing.assert_close(tr.parameters["0.weight"] + 1.0, mlp[0].weight)


def test_token_mask_excludes_padding_from_reductions(transformer):
    x = torch.randn(2, 5, 16)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    with acs.ActivationScope(reductions=["mean"]).track(transformer, include=["layers.0"]) as tr:
        tr.set_batch(attention_mask=mask)
        transformer(x)
    out = tr.activations["layers.0.output"][0]
    assert out.shape == (2, 5, 16)  # in memory the activation keeps its shape
    torch.testing.assert_close(tr.reductions["layers.0.output"]["mean"], out[mask].double().mean(0))


def test_eager_fallback_reduction_runs_in_capture(mlp, monkeypatch):
    import activationscope.capture.reductions as red

    def total(acc, x):
        s = x.double().sum(0)
        return s if acc is None else acc + s

    def no_script(fn, *a, **k):  # TorchScript cannot compile this function
        raise RuntimeError("unsupported construct")

    monkeypatch.setattr(torch.jit, "script", no_script)
    with pytest.warns(red.EagerFallbackWarning, match="'total'"):
        scope = acs.ActivationScope(reductions=[total])
    xs = [torch.randn(2, 16) for _ in range(3)]
    with scope.track(mlp, include=["0"]) as tr:
        for x in xs:
            mlp(x)
    torch.testing.assert_close(tr.reductions["0.output"]["total"], torch.cat([mlp[0](x) for x in xs]).double().sum(0))


# ----------------------------------------------------------------------------- lifecycle
def test_exit_removes_exactly_its_wrappers_even_when_body_raises(mlp):
    with pytest.raises(ZeroDivisionError):
        with acs.ActivationScope().track(mlp):
            mlp(torch.randn(2, 16))
            1 / 0
    assert no_wrappers(mlp)


def test_existing_instance_forward_is_restored(mlp):
    calls = []
    original = mlp[0].forward

    def patched(x):
        calls.append(1)
        return original(x)

    mlp[0].forward = patched
    with acs.ActivationScope().track(mlp, include=["0"]) as tr:
        mlp(torch.randn(2, 16))
    assert mlp[0].__dict__["forward"] is patched and len(calls) == 1
    assert len(tr.activations["0.output"]) == 1


def test_several_trackers_on_one_model(mlp):
    x1, x2 = torch.randn(2, 16), torch.randn(2, 16)
    t1 = acs.ActivationScope().track(mlp, include=["0", "2"]).attach()
    t2 = acs.ActivationScope(capture="input").track(mlp, include=["0"]).attach()
    mlp(x1)
    t1.remove()
    mlp(x2)
    t2.remove()
    assert no_wrappers(mlp)
    assert len(t1.activations["0.output"]) == 1 and len(t1.activations["2.output"]) == 1
    assert [torch.equal(a, b) for a, b in zip(t2.activations["0.input.0"], [x1, x2])] == [True, True]


def test_attach_remove_clear(mlp):
    tr = acs.ActivationScope().track(mlp, include=["0"])
    mlp(torch.randn(2, 16))
    assert tr.activations == {}
    tr.attach()
    tr.attach()  # idempotent
    mlp(torch.randn(2, 16))
    assert len(tr.activations["0.output"]) == 1
    tr.clear()
    assert tr.activations["0.output"] == []
    tr.remove()
    mlp(torch.randn(2, 16))
    assert tr.activations["0.output"] == [] and no_wrappers(mlp)


def test_signature_of_wrapped_forward_is_visible():
    import inspect

    m = torch.nn.Sequential(Structured())
    with acs.ActivationScope().track(m):
        params = inspect.signature(m[0].forward).parameters
    assert "scale" in params


def test_native_extension_version_check(monkeypatch):
    from activationscope.capture import _native

    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    with pytest.raises(acs.NativeExtensionError, match=r"built against torch .* but torch 0.0.1-other is installed"):
        _native.load()


def test_native_extension_built_from_older_sources_is_refused(monkeypatch):
    from activationscope.capture import _native

    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "REQUIRED", ("is_token_rows", "no_such_native_function"))
    with pytest.raises(acs.NativeExtensionError, match=r"built from older sources \(it lacks \['no_such_native_function'\]\); rebuild"):
        _native.load()
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(_native, "REQUIRED", ("is_token_rows", "Sink.no_such_method"))
    with pytest.raises(acs.NativeExtensionError, match=r"it lacks \['Sink.no_such_method'\]"):
        _native.load()
    monkeypatch.setattr(_native, "REQUIRED", ("is_token_rows", "Sink.set_alias_of"))
    assert _native.load().is_token_rows is not None


def test_native_extension_advice_names_a_fix_that_works_where_the_package_comes_from(monkeypatch):
    from activationscope.capture import _native

    built = _native.load().TORCH_VERSION
    assert _native.in_source_checkout()  # (the tests run from one)
    monkeypatch.setattr(_native, "_module", None)
    monkeypatch.setattr(torch, "__version__", "0.0.1-other")
    with pytest.raises(acs.NativeExtensionError, match=r"but torch 0.0.1-other is installed; rebuild it with `pip install "
                       r"--no-build-isolation -e .` \(or `make build`\)"):
        _native.load()
    # installed from a wheel: no checkout to rebuild in; the torch it was built for, or a build from the sdist
    monkeypatch.setattr(_native, "in_source_checkout", lambda: False)
    with pytest.raises(acs.NativeExtensionError) as e:
        _native.load()
    assert f"`pip install torch=={built}`" in str(e.value)
    assert "--no-build-isolation --no-binary activationscope" in str(e.value) and "-e ." not in str(e.value)

    monkeypatch.setitem(sys.modules, "activationscope._C", None)  # an extension that is not there
    with pytest.raises(acs.NativeExtensionError, match=r"activationscope._C could not be loaded") as e:
        _native.load()
    assert "--no-binary activationscope" in str(e.value) and "torch==" not in str(e.value)


# ----------------------------------------------------------------------------- the GIL
def test_gil_is_released_while_copying():
    big = torch.randn(16, 1 << 20)  # 64 MiB

    class Emit(torch.nn.Module):
        def forward(self, x):
            return big  # no torch op here: only the capture's copy can release the GIL

    model = torch.nn.Sequential(Emit())
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.2)  # the main thread yields the GIL only when it releases it (or after 0.2 s)
    t = threading.Thread(target=spin)
    t.start()
    try:
        with acs.ActivationScope().track(model) as tr:
            progress = []
            for _ in range(3):
                c0 = counter[0]
                model(None)
                progress.append(counter[0] - c0)
    finally:
        stop.set()
        sys.setswitchinterval(old)
        t.join()
    assert min(progress) > 0, progress  # the other thread ran during every capture
    assert torch.equal(tr.activations["0.output"][0], big)


# ----------------------------------------------------------------------------- devices
def test_device_capture_equals_reference(device):
    model = toy_mlp().to(device)
    x = torch.randn(4, 16, device=device)
    with acs.ActivationScope(capture="both").track(model) as tr:
        model(x)
    want, _ = plain_hooks(model, lambda: model(x), side="both", to="cpu", grad=True)
    acts = tr.activations
    assert all(t.device.type == "cpu" for v in acts.values() for t in v)
    assert_same_records(acts, want)


def test_gpu_storage_keeps_device(device):
    model = toy_mlp().to(device)
    x = torch.randn(4, 16, device=device)
    with acs.ActivationScope(storage=StoragePolicy.GPU).track(model, include=["0"]) as tr:
        model(x)
    rec = tr.activations["0.output"][0]
    assert rec.device == x.device and torch.equal(rec, model[0](x))


def test_tracker_is_freed_after_exit(mlp):
    import weakref

    with acs.ActivationScope().track(mlp) as tr:
        mlp(torch.randn(2, 16))
    ref = weakref.ref(tr)
    del tr
    gc.collect()
    assert ref() is None  # no reference cycle through the native core keeps it (and its records) alive


def test_reattach_after_exit_keeps_capturing(mlp):
    tr = acs.ActivationScope().track(mlp, include=["0"])
    with tr:
        mlp(torch.randn(2, 16))
    with tr:
        mlp(torch.randn(2, 16))
    assert len(tr.activations["0.output"]) == 2 and no_wrappers(mlp)


@pytest.mark.parametrize("numel", [4095, 4096, 4099, 100_003, 1 << 20])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_snapshot_copy_exact_for_sizes_and_alignments(numel, offset):
    # sizes around the streaming-copy threshold (16 KiB), sources at unaligned addresses
    base = torch.randn(numel + offset)
    x = base[offset:]
    assert x.is_contiguous()

    class Emit(torch.nn.Module):
        def forward(self, _):
            return x

    model = torch.nn.Sequential(Emit())
    with acs.ActivationScope().track(model) as tr:
        model(None)
        model(None)
    recs = tr.activations["0.output"]
    assert len(recs) == 2 and all(torch.equal(r, x) for r in recs)
    assert recs[0].data_ptr() != x.data_ptr()


def test_a_misspelt_store_option_names_the_option_meant(tmp_path):
    # store_options={"overwrit": True} listed the thirteen options without pointing at the one
    # meant, where a misspelt reduction or keyword of ActivationScope says "did you mean"
    with pytest.raises(TypeError) as err:
        acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"overwrit": True})
    msg = str(err.value)
    assert msg.startswith("store_options has no option 'overwrit'; valid options are [") and msg.endswith(
        "]; did you mean 'overwrite'?"), msg
    with pytest.raises(TypeError) as err:
        acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"zzz": True})
    assert "did you mean" not in str(err.value) and "valid options are [" in str(err.value)
    assert not (tmp_path / "s.zarr").exists()


def test_bad_store_options_and_storage_dtype_are_named(tmp_path):
    with pytest.raises(TypeError, match="store_options has no option 'compresion'; valid options are .*'compression'"):
        acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"compresion": "zstd"})
    with pytest.raises(ValueError, match="store_options=.*needs store="):
        acs.ActivationScope(store_options={"overwrite": True})
    # values too, when the scope is made: nothing runs, nothing is written
    bad = [({"compression": "zstd:99"}, ValueError, "zstd"), ({"chunk_rows": 0}, ValueError, "chunk_rows"),
           ({"shard_rows": 100, "shard_bytes": 1 << 20}, ValueError, "shard_rows and shard_bytes"),
           ({"overwrite": True, "resume": True}, ValueError, "overwrite=True and resume=True"),
           ({"commit_interval": -1}, ValueError, "commit_interval"),
           ({"provenance": ["x"]}, TypeError, "provenance must be a dict"),
           ({"storage_options": "anon"}, TypeError, "storage_options must be a dict")]
    for options, cls, msg in bad:
        with pytest.raises(cls, match=msg):
            acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options=options)
    assert not (tmp_path / "s.zarr").exists()
    acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"compression": "zstd:5", "chunk_rows": 4})
    with pytest.raises(ValueError, match="storage_dtype must be a floating-point dtype.*torch.int8"):
        acs.ActivationScope(storage_dtype=torch.int8)


@pytest.mark.parametrize("options", [{"overwrite": "False"}, {"overwrite": 1}, {"overwrite": None},
                                     {"resume": "no"}, {"resume": 0.0}, {"fsync": "no"}, {"fsync": None}])
def test_store_option_flags_must_be_bools(tmp_path, options):
    # overwrite="False" (from a config file or an environment variable) is a true string: taken
    # as a flag it would replace the store. Refused when the scope is made, naming the option
    (name, value), = options.items()
    with pytest.raises(ArgumentTypeError, match=rf"{name} must be True or False, got {re.escape(repr(value))}"):
        acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options=options)
    with pytest.raises(ArgumentTypeError, match=rf"{name} must be True or False"):
        acs.store.StoreWriter(str(tmp_path / "s.zarr"), **options)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("options", [True, "overwrite", ["overwrite"], []])
def test_store_options_that_are_not_a_dict_are_named(tmp_path, options):
    # store_options=True (meant: overwrite) was read key by key, a TypeError of Python's own
    with pytest.raises(ArgumentTypeError, match=rf"store_options must be a dict of writer options "
                                                rf"\(e.g. \{{'overwrite': True\}}\), got {type(options).__name__}"):
        acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options=options)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("kwargs, fix", [
    ({"overwrite": True}, "store_options={'overwrite': True}"),
    ({"resume": True}, "store_options={'resume': True}"),
    ({"compression": "zstd:5"}, "store_options={'compression': 'zstd:5'}"),
    # a writer option next to store_options: the fix keeps those
    ({"overwrite": True, "store_options": {"chunk_rows": 4}}, "store_options={'chunk_rows': 4, 'overwrite': True}"),
])
def test_an_unknown_keyword_that_is_a_store_option_names_store_options(tmp_path, kwargs, fix):
    # overwrite=True given to the scope itself (after a store-exists error) was Python's own
    # "unexpected keyword argument" TypeError, without the fix
    with pytest.raises(ArgumentTypeError, match="unexpected keyword argument .*an option of the store writer") as info:
        acs.ActivationScope(store=str(tmp_path / "s.zarr"), **kwargs)
    assert fix in str(info.value)
    assert isinstance(info.value, TypeError)  # (except TypeError keeps working)
    assert not (tmp_path / "s.zarr").exists()


@pytest.mark.parametrize("key, fix", [
    ("captur", "did you mean capture=, capture_mode=, capture_policy=?"),
    ("stor", "did you mean store=, storage=?"),
    ("storage_dtyp", "did you mean storage_dtype="),
    ("compresion", "did you mean the store writer option 'compression', given as store_options={'compression': 1}?"),
    ("foo", "its parameters are ['capture', 'capture_policy'"),
])
def test_an_unknown_keyword_names_the_closest_parameters(key, fix):
    with pytest.raises(ArgumentTypeError, match=f"unexpected keyword argument '{key}'") as info:
        acs.ActivationScope(**{key: 1})
    assert fix in str(info.value)


def test_positional_arguments_are_still_refused_by_python():
    with pytest.raises(TypeError, match="positional argument") as info:
        acs.ActivationScope("s.zarr")
    assert not isinstance(info.value, ArgumentTypeError)


def test_store_writer_check_options_takes_every_store_option_with_its_default():
    # ActivationScope checks store_options with StoreWriter.check_options(**options): an option
    # StoreWriter takes and check_options lacks would fail there as an unexpected keyword
    import inspect

    from activationscope.capture.writer import writer_options

    check = inspect.signature(acs.store.StoreWriter.check_options).parameters
    init = inspect.signature(acs.store.StoreWriter.__init__).parameters
    assert sorted(check) == [o for o in writer_options() if o not in ("process_group", "rank_wait_s")]  # (multi-rank)
    assert {n: p.default for n, p in check.items()} == {n: init[n].default for n in check}


@pytest.mark.parametrize("group", ["gloo", 3, True])
def test_store_option_process_group_is_checked_when_the_scope_is_made(tmp_path, group):
    with pytest.raises(ArgumentTypeError, match=r"process_group must be None, False, a torch.distributed "
                                                    rf"process group or an acs.RankStore, got {re.escape(repr(group))}"):
        acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"process_group": group})
    assert not (tmp_path / "s.zarr").exists()
    for good in (None, False, acs.RankStore(0, 1)):
        acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"process_group": good})


class SeqFirst(torch.nn.Module):
    """Embeds (batch, pos) ids, works sequence-first inside, pools per sample."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids):
        h = self.emb(ids.T)  # (pos, batch, d): the first tracked tensor is not per sample
        return self.head(h.mean(0))


class SliceFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.a(x[:2])  # a first call on a slice of the batch
        return self.a(x)


@pytest.mark.parametrize("with_ids", [False, True])
def test_samples_per_forward_come_from_the_model_input(tmp_path, with_ids):
    model = SeqFirst()
    path = str(tmp_path / "s.zarr")
    ids = [torch.randint(0, 20, (6, 9)) for _ in range(2)]
    with acs.ActivationScope(store=path).track(model, include=["head"]) as tr, torch.no_grad():
        for i, x in enumerate(ids):
            if with_ids:
                tr.set_batch(sample_ids=list(range(i * 6, i * 6 + 6)))
            model(x)
    store = acs.open_store(path)
    assert store.n_samples == 12
    assert store.row_table("sample").column("sample_id").to_pylist() == list(range(12))
    assert store.n_rows("head.output") == 12

    model2 = SliceFirst()
    path2 = str(tmp_path / "t.zarr")
    with pytest.warns(acs.CaptureWarning, match=r"hook point 'a.output' recorded 2 row\(s\) in forward 0 .*"
                      r"row table got 5") as record:
        with acs.ActivationScope(store=path2).track(model2, include=["a"]) as tr, torch.no_grad():
            for i in range(2):
                tr.set_batch(sample_ids=list(range(i * 5, i * 5 + 5)))
                model2(torch.randn(5, 4))
    assert sum("row table" in str(w.message) for w in record) == 1  # its first call, on a slice
    store2 = acs.open_store(path2)
    assert store2.n_samples == 10
    assert not store2.follows_row_table("a.output") and store2.follows_row_table("a#1.output")


def test_small_capture_holds_little_memory():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    before = _rss_bytes()
    with acs.ActivationScope().track(model) as tr:
        model(torch.randn(4, 8))
    import time

    time.sleep(0.2)  # no background slab preparation may start for a capture this small
    assert _rss_bytes() - before < 32 << 20
    assert len(tr.activations["0.output"]) == 1


class _RaisesOnCall(torch.nn.Module):
    def __init__(self, bad_calls):
        super().__init__()
        self.bad_calls, self.n = set(bad_calls), 0

    def forward(self, x):
        self.n += 1
        if self.n in self.bad_calls:
            raise RuntimeError("bad batch")
        return x


def _bomb_model(bad_calls):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), _RaisesOnCall(bad_calls), torch.nn.Linear(4, 4)).eval()


@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_caught_exception_in_a_forward_warns_with_the_partial_hook_points(tmp_path, last):
    """A forward that raises inside the capture, with the exception caught by the caller: a
    RuntimeWarning names the hook points that recorded the partial forward (at the next
    forward, or at the end of the capture when it was the last one)."""
    import warnings

    model = _bomb_model({3} if not last else {4})
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=str(path)).track(model):
            for i in range(4):
                try:
                    model(torch.randn(2, 4))
                except RuntimeError:
                    pass
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    bad = 2 if not last else 3
    assert len(msgs) == 1 and msgs[0].startswith(f"forward {bad} of the tracked model raised"), msgs
    assert "hook points ['0.output'] recorded rows of it" in msgs[0]
    store = acs.open_store(path)
    assert store.status == "complete" and store.n_samples == 6 and store.verify() == []
    if last:  # the partial last forward is not committed: every array ends aligned
        assert "The store and the reductions leave that partial forward out (both end at the last whole forward)" in msgs[0]
        assert store.attrs["arrays"]["0.output"]["follows_row_table"] is True
        assert store.n_rows("0.output") == 6 and store.n_rows("2.output") == 6
    else:
        assert "no longer line up with the sample row table" in msgs[0]
        assert store.attrs["arrays"]["0.output"]["follows_row_table"] is False
        assert store.n_rows("0.output") == 8 and store.n_rows("2.output") == 6


def test_a_forward_refused_before_any_row_was_stored_is_said_to_leave_the_store_aligned(tmp_path):
    """A custom reduction that raises on one batch (caught inside the capture): no hook point
    stored a row of that forward, the store leaves it out whole and stays aligned with its row
    table, and the warning says so (it said the rows no longer line up)."""
    import warnings
    from typing import Optional

    from activationscope.errors import CaptureError, CaptureWarning

    def refuses_two_rows(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 2:
            raise RuntimeError("two rows")
        return x.sum(0) if acc is None else acc + x.sum(0)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    xs = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 4)]
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=str(path), reductions=["mean", refuses_two_rows]).track(
                model, include=["0"]):
            for x in xs:
                try:
                    model(x)
                except CaptureError:
                    pass
    msgs = [str(w.message) for w in caught if issubclass(w.category, CaptureWarning) and "raised" in str(w.message)]
    assert len(msgs) == 1 and msgs[0].startswith(
        "forward 1 of the tracked model raised and the exception was caught inside the capture before any hook point "
        "stored a row of it: the store leaves that forward out whole and its rows still line up"), msgs
    store = acs.open_store(path)
    assert store.follows_row_table("0.output") and store.verify() == []
    with torch.no_grad():
        want = torch.cat([model(xs[0]), model(xs[2])])
    assert torch.equal(store["0.output"], want) and store.row_table().num_rows == 6
    assert torch.allclose(store.reductions["0.output"]["mean"], want.double().mean(0))


@pytest.mark.parametrize("ids", [False, True])
def test_a_caught_forward_says_its_samples_were_not_counted(tmp_path, ids):
    """A forward that raised and was caught is not counted by the default sample ids: the next
    forward takes its ids (data rows 5..7 stored as samples 3..5 when it fed the next batch). The
    warning says so, and how to keep ids the samples' places; not when ids are given."""
    from activationscope.errors import CaptureWarning

    model = _bomb_model({2})
    xs = torch.randn(9, 4)
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=path).track(model) as tr:
            for b in range(3):
                if ids:
                    tr.set_batch(sample_ids=range(3 * b, 3 * b + 3))
                try:
                    model(xs[3 * b:3 * b + 3])
                except RuntimeError:
                    pass
    msgs = [str(w.message) for w in caught if issubclass(w.category, CaptureWarning) and "raised" in str(w.message)]
    assert len(msgs) == 1
    assert ("Its samples were not counted: the default sample ids of the next forward start where this one's did"
            in msgs[0]) is not ids
    stored = acs.open_store(path).row_table("sample").column("sample_id").to_pylist()
    assert stored == ([0, 1, 2, 6, 7, 8] if ids else [0, 1, 2, 3, 4, 5])


def test_uncaught_or_uncaptured_failures_do_not_warn(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        model = _bomb_model({2})
        with pytest.raises(RuntimeError, match="bad batch"):  # the exception ends the capture
            with torch.no_grad(), acs.ActivationScope(store=str(tmp_path / "a.zarr")).track(model):
                for _ in range(3):
                    model(torch.randn(2, 4))
        assert acs.open_store(tmp_path / "a.zarr").n_samples == 2
        model = _bomb_model({2})  # forward 1 is not captured (max_k=1): nothing partial
        with torch.no_grad(), acs.ActivationScope(capture_policy=acs.CapturePolicy.MAX_K, max_k=1).track(model) as tr:
            for _ in range(3):
                try:
                    model(torch.randn(2, 4))
                except RuntimeError:
                    pass
        assert len(tr.activations["0.output"]) == 1


def test_native_errors_reach_the_caller_through_the_wrapper(tmp_path):
    """An error raised by the native sink during a wrapped module call (here: a store array
    whose feature shape changes) reaches the caller as CaptureError with its message; the
    wrapper is called with positional and keyword arguments alike."""

    class Slice(torch.nn.Module):
        def forward(self, x, width=4):
            return x[:, :width]

    model = Slice().eval()
    with pytest.raises(acs.CaptureError, match=r"hook point 'output' changed its feature shape from \(4,\) to \(3,\)"):
        with torch.no_grad(), acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model):
            model(torch.randn(2, 8))
            model(torch.randn(2, 8), width=4)
            model(x=torch.randn(2, 8), width=3)
    store = acs.open_store(tmp_path / "s.zarr")
    assert store.status == "incomplete"


def test_configurations_that_would_record_nothing_are_refused_or_warned():
    """A capture never records nothing silently: max_k=0, STREAMING without reductions (and no
    store) and 8-bit float storage are refused up front; an exclude pattern that matches no
    module warns (it excludes nothing: a typo captures what it meant to leave out)."""
    from activationscope.errors import ArgumentValueError, CaptureWarning

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(), torch.nn.ReLU())
    with pytest.raises(ArgumentValueError, match=r"max_k= a positive int \(max_k=0 would record nothing\)"):
        acs.ActivationScope(capture_policy=acs.CapturePolicy.MAX_K, max_k=0)
    with pytest.raises(ArgumentValueError, match=r"STREAMING keeps only reductions, and none were given"):
        acs.ActivationScope(reduction_policy=acs.ReductionPolicy.STREAMING)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        with pytest.raises(ArgumentValueError, match=r"storage_dtype=torch.float8_e[45]m[32]\w* is not supported"):
            acs.ActivationScope(storage_dtype=dtype)
    with pytest.warns(CaptureWarning, match=r"exclude pattern '\*.droput' matches no module of Sequential"):
        with acs.ActivationScope().track(m, exclude=["*.droput"]) as tr:
            m(torch.randn(2, 4))
    assert sorted(tr.activations) == ["0.output", "1.output", "2.output"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaptureWarning)
        with acs.ActivationScope().track(m, exclude=["1"]) as tr:  # a matching pattern: no warning
            m(torch.randn(2, 4))
    assert sorted(tr.activations) == ["0.output", "2.output"]
    # what stays accepted: STREAMING with reductions, or into a store
    acs.ActivationScope(reduction_policy=acs.ReductionPolicy.STREAMING, reductions=["mean"])
    acs.ActivationScope(capture_policy=acs.CapturePolicy.MAX_K, max_k=1)


def test_reduction_and_token_row_patterns_exact_hook_point_names_first(tmp_path):
    """A pattern of reductions= or token_rows= that equals a hook point selects that one only
    (``d.a[1].output`` is also an fnmatch pattern matching ``d.a1.output``)."""
    torch.manual_seed(0)
    model, x = BracketNames(), torch.randn(4, 2)
    with acs.ActivationScope(reductions={"d.a[1].output": ["mean"], "d.a[0-9].output": ["max"]}).track(model) as tr:
        model(x)
    with torch.no_grad():
        a, b = model.d["a[1]"](x).double(), model.d["a1"](x).double()
    assert set(tr.reductions["d.a[1].output"]) == {"mean", "mean.count"}
    assert set(tr.reductions["d.a1.output"]) == {"max", "max.count"}
    torch.testing.assert_close(tr.reductions["d.a[1].output"]["mean"], a.mean(0))
    torch.testing.assert_close(tr.reductions["d.a1.output"]["max"], b.max(0).values)

    xs, mask = torch.randn(2, 3, 2), torch.ones(2, 3, dtype=torch.bool)
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path), token_rows={"d.a[1].output": False}).track(model) as tr:
        tr.set_batch(attention_mask=mask)
        model(xs)
    arrays = acs.open_store(str(path)).attrs["arrays"]
    assert arrays["d.a[1].output"]["row_kind"] == "sample"  # as the pattern says
    assert arrays["d.a1.output"]["row_kind"] == "token"  # the shape rule: (batch, pos) of the mask


def test_pattern_selects_exact_names_first():
    from activationscope.capture.reductions import pattern_selects

    names = {"d.a1.output", "d.a[1].output"}
    assert pattern_selects("d.a[1].output", "d.a[1].output", names)
    assert not pattern_selects("d.a[1].output", "d.a1.output", names)
    assert pattern_selects("d.a[1].output", "d.a1.output")  # names unknown: fnmatch
    assert pattern_selects("d.*", "d.a1.output", names) and not pattern_selects("D.*", "d.a1.output", names)


@pytest.mark.parametrize("to_store", [False, True])
def test_a_tracker_entered_again_inside_its_with_block_records_until_the_outer_block_ends(tmp_path, to_store):
    # a helper given the tracker enters it again: its end must not stop the outer capture
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    xs = [torch.randn(2, 4) for _ in range(3)]
    scope = acs.ActivationScope(store=tmp_path / "s.zarr") if to_store else acs.ActivationScope()
    tracker = scope.track(model)
    with torch.no_grad(), tracker:
        model(xs[0])
        with tracker:
            model(xs[1])
        model(xs[2])
    assert "forward" not in model[0].__dict__  # removed at the end of the outer block
    with torch.no_grad():
        want = torch.cat([model[0](x) for x in xs])
    got = acs.open_store(tmp_path / "s.zarr")["0.output"][:] if to_store else torch.cat(tracker.activations["0.output"])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_store_records_what_track_overrode(tmp_path):
    # capture=, include=, token_rows= given to track() are what the capture did: the store's
    # capture_config says so, not the scope's defaults
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    scope = acs.ActivationScope(store=tmp_path / "s.zarr")
    with torch.no_grad(), scope.track(model, include=["0"], exclude=["1"], capture="both",
                                      token_rows={"0.output": False}, stop_after_last=True):
        model(torch.randn(2, 4))
    store = acs.open_store(tmp_path / "s.zarr")
    assert sorted(store.hook_points) == ["0.input.0", "0.output"]
    config = store.attrs["capture_config"]
    assert config["capture"] == "both" and config["include"] == ["0"] and config["exclude"] == ["1"]
    assert config["token_rows"] == {"0.output": False} and config["stop_after_last"] is True
    assert config["patterns"] == {"include": ["0"], "exclude": ["1"]}


@pytest.mark.parametrize("grad", [False, True, "inference_mode"])
@pytest.mark.parametrize("hook", ["replace", "in_place", "read_only", "same_tensors_new_tuple", "detach",
                                  "detach_in_place", "detach_one_replace_other", "same_storage_other_strides",
                                  "negative_view"])
def test_forward_hooks_that_change_an_output_are_named_and_the_next_input_records_them(hook, grad):
    """An output is recorded as its module's forward returns it, before its forward hooks run:
    a hook that replaces it or changes it in place (steering) is named in a CaptureWarning
    with the fix, and capture='input' of the module that receives it records the changed
    value. Hooks that only read, or return the same tensors, or the same tensors detached
    (same storage, strides and version counter: the same values), are not warned about. Under
    torch.inference_mode (no version counters) the values before and after the hooks tell."""
    torch.manual_seed(0)

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x), x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()
            self.head = torch.nn.Linear(3, 2)

        def forward(self, x):
            h, _ = self.pair(x)
            return self.head(h)

    model = Model().eval()
    x = torch.randn(5, 4)
    hooks = {
        "replace": lambda m, i, out: (out[0] + 5, out[1]),
        "in_place": lambda m, i, out: [out[0].add_(5)] and None,
        "read_only": lambda m, i, out: None,
        "same_tensors_new_tuple": lambda m, i, out: (out[0], out[1]),
        "detach": lambda m, i, out: (out[0].detach(), out[1].detach()),
        "detach_in_place": lambda m, i, out: (out[0].detach().add_(5), out[1]),
        "detach_one_replace_other": lambda m, i, out: (out[0].detach() + 5, out[1].detach()),
        # the same memory read with other strides is another value
        "same_storage_other_strides": lambda m, i, out: (out[0].detach().as_strided((5, 3), (1, 5)), out[1]),
        # the same memory, offset, shape and strides read as its negation (a lazy view, as conj())
        "negative_view": lambda m, i, out: (torch._neg_view(out[0].detach()), out[1]),
    }
    handle = model.pair.register_forward_hook(hooks[hook])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mode = torch.inference_mode() if grad == "inference_mode" else torch.set_grad_enabled(grad)
            with acs.ActivationScope(capture="both").track(model) as tr, mode:
                model(x)
                model(x)
        with torch.no_grad():
            plain = model.pair.lin(x)
    finally:
        handle.remove()
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    torch.testing.assert_close(tr.activations["pair.output.0"][0], plain, rtol=0, atol=0)
    if hook in ("replace", "in_place", "detach_in_place", "detach_one_replace_other", "same_storage_other_strides",
                "negative_view"):
        assert len(messages) == 1, messages
        assert re.search(r"forward hooks of the tracked modules 'pair' replaced or changed their output in the "
                         r"first captured forward: .*before its forward hooks run.*capture='input' of the next "
                         r"module", messages[0])
        passed_on = {"same_storage_other_strides": plain.as_strided((5, 3), (1, 5)),
                     "negative_view": -plain}.get(hook, plain + 5)
        torch.testing.assert_close(tr.activations["head.input.0"][0], passed_on, rtol=0, atol=0)
    else:
        assert messages == []
        torch.testing.assert_close(tr.activations["head.input.0"][0], plain, rtol=0, atol=0)
    assert not model.pair._forward_hooks  # the probes of the first forward are gone, and so is the user's


@pytest.mark.parametrize("where", ["module", "global"])
def test_a_forward_hook_added_after_the_first_forward_that_changes_an_output_is_named_once(where):
    """A forward hook added to a tracked module after the first captured forward (or a global
    one) that replaces its output is named in a CaptureWarning at the next forward, with its
    hook point and the fix, once; one that only reads is not."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).eval()
    x = torch.randn(5, 4)

    def steer(module, args, out):
        return out + 5 if module is model[0] else None

    handles = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with acs.ActivationScope(capture="both").track(model) as tr, torch.no_grad():
                model(x)
                handles.append(model[2].register_forward_hook(lambda m, i, out: None))  # reads only
                model(x)
                assert not [w for w in caught if issubclass(w.category, acs.CaptureWarning)]
                handles.append(model[0].register_forward_hook(steer) if where == "module"
                               else torch.nn.modules.module.register_module_forward_hook(steer))
                model(x)
                model(x)
                handles.append(model[0].register_forward_hook(lambda m, i, out: out * 2))  # (named already)
                model(x)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        plain = model[0](x)
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(messages) == 1, messages
    assert re.search(r"forward hooks of the tracked modules '0' \(hook points '0.output'\) replaced or changed "
                     r"their output in forward 2 \(they were added after the first captured forward.*before its "
                     r"forward hooks run.*capture='input' of the next module", messages[0])
    for i in range(5):  # recorded before the hooks; the next module's input after them
        torch.testing.assert_close(tr.activations["0.output"][i], plain, rtol=0, atol=0)
    torch.testing.assert_close(tr.activations["1.input.0"][3], plain + 5, rtol=0, atol=0)
    torch.testing.assert_close(tr.activations["1.input.0"][4], (plain + 5) * 2, rtol=0, atol=0)
    assert not model[0]._forward_hooks and not model[2]._forward_hooks  # the probes are gone
    assert not torch.nn.modules.module._global_forward_hooks


@pytest.mark.parametrize("how", ["register", "by_hand", "new_dict"])
def test_a_forward_hook_added_among_unrelated_hook_handles_is_named_without_comparing_every_hook_set(how):
    """Hook handles of other kinds created at every forward (Tensor.register_hook in a training
    loop, a forward pre-hook) do not make the start of each forward compare every tracked
    module's forward hooks (it used to: about 150 us a forward at 500 tracked modules); a forward
    hook then added to a tracked module (with register_forward_hook, put into its hook dict by
    hand, or in a hook dict put in place of its own) is still named at the next forward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).eval()
    x = torch.randn(5, 4)
    handles = []

    def steer(module, args, out):
        return out + 5

    def unrelated():
        handles.append(torch.zeros(1, requires_grad=True).register_hook(lambda g: g))
        handles.append(model[2].register_forward_pre_hook(lambda m, args: None))

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with acs.ActivationScope().track(model) as tr, torch.no_grad():
                compared = []
                probe_new_hooks = tr._probe_new_hooks
                tr._probe_new_hooks = lambda: compared.append(tr._core.n_forwards - 1) or probe_new_hooks()
                model(x)
                for _ in range(3):
                    unrelated()
                    model(x)
                assert compared == []
                assert not [w for w in caught if issubclass(w.category, acs.CaptureWarning)]
                unrelated()
                if how == "register":
                    handles.append(model[0].register_forward_hook(steer))
                elif how == "by_hand":
                    model[0]._forward_hooks[-1] = steer  # (not a handle id of torch's counter)
                else:
                    model[0]._forward_hooks = type(model[0]._forward_hooks)({0: steer})
                unrelated()
                model(x)
                unrelated()
                model(x)
    finally:
        model[0]._forward_hooks.clear()
        for h in handles:
            h.remove()
    assert compared == [4]
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(messages) == 1, messages
    assert re.search(r"forward hooks of the tracked modules '0' \(hook points '0.output'\) replaced or changed "
                     r"their output in forward 4 \(they were added after the first captured forward", messages[0])
    torch.testing.assert_close(tr.activations["0.output"][4], model[0](x), rtol=0, atol=0)


class HookAdder(torch.nn.Module):
    """Adds 1; in its call of forward ``when`` registers a forward hook on ``target`` (a module
    called after it) that replaces the target's output by ``out + 5``."""

    def __init__(self, target: torch.nn.Module, when: int) -> None:
        super().__init__()
        self.target = [target]  # (a list: not a submodule)
        self.when = when
        self.n_calls = 0
        self.handle = None

    def forward(self, x):
        if self.n_calls == self.when:
            self.handle = self.target[0].register_forward_hook(lambda m, args, out: out + 5)
        self.n_calls += 1
        return x + 1


@pytest.mark.parametrize("when", [0, 2])
def test_a_forward_hook_added_during_a_forward_is_named_with_that_forward(when):
    """A forward hook that the model registers during forward k (here on a module it calls after)
    already changes that forward's output, so the rows of forward k hold the output before it.
    The warning, given at the next captured forward, said the hook was added after the first
    captured forward and that rows were affected 'from this forward on' (forward k + 1); it now
    names forward k for both."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(HookAdder(lin, when), lin, torch.nn.Identity()).eval()
    xs = [torch.randn(5, 4) for _ in range(when + 3)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with acs.ActivationScope().track(model) as tr, torch.no_grad():
                for x in xs:
                    model(x)
    finally:
        if model[0].handle is not None:
            model[0].handle.remove()
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(messages) == 1, messages
    assert re.search(rf"forward hooks of the tracked modules '1' \(hook points '1.output'\) replaced or changed "
                     rf"their output in forward {when + 1} \(they were added during forward {when}, .*the rows "
                     rf"captured there from forward {when} on may hold the output before them\)", messages[0])
    with torch.no_grad():  # plain PyTorch: the output before the hook, and what the model passed on
        for i, x in enumerate(xs):
            before = torch.nn.functional.linear(x + 1, lin.weight, lin.bias)
            torch.testing.assert_close(tr.activations["1.output"][i], before, rtol=0, atol=0)
            torch.testing.assert_close(tr.activations["2.output"][i], before + 5 if i >= when else before,
                                       rtol=0, atol=0)


def test_a_forward_hook_added_during_a_forward_that_raised_is_named_with_that_forward():
    """A forward hook the model registers during forward 1, which then raises (caught, the
    capture going on), changes the output its records of that forward hold too: the warning said
    the hook was added after the first captured forward, rows affected from forward 2 on (the end
    of forward 1, which notes hooks added during it, never ran). It now names forward 1, and
    that the hook may have been added after it, before forward 2."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    model = torch.nn.Sequential(HookAdder(lin, 1), lin, _RaisesOnCall({2}), torch.nn.Identity()).eval()
    xs = [torch.randn(5, 4) for _ in range(4)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with acs.ActivationScope().track(model) as tr, torch.no_grad():
                for i, x in enumerate(xs):
                    if i == 1:
                        with pytest.raises(RuntimeError, match="bad batch"):
                            model(x)
                    else:
                        model(x)
    finally:
        if model[0].handle is not None:
            model[0].handle.remove()
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)
                and "forward hooks" in str(w.message)]
    assert len(messages) == 1, messages
    assert re.search(r"forward hooks of the tracked modules '1' \(hook points '1.output'\) replaced or changed "
                     r"their output in forward 2 \(they were added during forward 1, which raised, or after it, "
                     r".*the rows captured there from forward 1 on may hold the output before them\)", messages[0])
    with torch.no_grad():  # plain PyTorch: the output before the hook, in every forward's record
        for i, x in enumerate(xs):
            before = torch.nn.functional.linear(x + 1, lin.weight, lin.bias)
            torch.testing.assert_close(tr.activations["1.output"][i], before, rtol=0, atol=0)


def test_a_forward_hook_added_before_forwards_the_policy_skips_is_named_at_the_next_captured_one():
    """A forward hook added to a tracked module before a forward that the capture policy skips
    is named at the next captured forward (the skipped forward used to note torch's hook counter
    without looking at the hooks, and the captured one then saw no new handle)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).eval()
    x = torch.randn(5, 4)
    handle = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with acs.ActivationScope(capture_policy=CapturePolicy.SAMPLE_N, sample_every=2).track(model) as tr, \
                    torch.no_grad():
                model(x)  # captured
                handle = model[0].register_forward_hook(lambda m, args, out: out + 5)
                model(x)  # skipped
                model(x)  # captured
    finally:
        if handle is not None:
            handle.remove()
    messages = [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]
    assert len(messages) == 1, messages
    assert re.search(r"forward hooks of the tracked modules '0' \(hook points '0.output'\) replaced or changed "
                     r"their output in forward 2 \(they were added after the first captured forward", messages[0])
    assert len(tr.activations["0.output"]) == 2


class Encoder(torch.nn.Module):
    """Calls its dropout twice (as T5's encoder stack does: on the embeddings and at the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 4)
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.lin(self.drop(self.embed(x))))


class EncoderDecoder(torch.nn.Module):
    """Its forward takes the encoder's output: the encoder runs on its own first, as Hugging Face
    ``generate()`` runs an encoder-decoder's encoder once, outside the model's forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = Encoder()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, h):
        return self.head(h)


@pytest.mark.parametrize("side", ["output", "both"])
def test_modules_called_twice_inside_a_tracked_module_called_on_its_own_get_their_call_index(side):
    # each call of a tracked module made on its own names the repeated calls of the modules
    # inside it as a forward of the tracked model does (drop, drop#1), so a hook point never
    # mixes two call sites; with capture="both" the dropout's first input stays an alias of the
    # embedding's output
    model = EncoderDecoder().eval()
    xs = [torch.randn(3, 4), torch.randn(2, 4)]
    with acs.ActivationScope(capture=side).track(model) as tr, torch.no_grad():
        for x in xs:
            model(model.encoder(x))
    acts = tr.activations
    with torch.no_grad():
        embeds = [model.encoder.embed(x) for x in xs]
        lins = [model.encoder.lin(e) for e in embeds]
    assert len(acts["encoder.drop.output"]) == 2 and len(acts["encoder.drop#1.output"]) == 2
    for i in range(2):
        assert torch.equal(acts["encoder.drop.output"][i], embeds[i])
        assert torch.equal(acts["encoder.drop#1.output"][i], lins[i])
        assert torch.equal(acts["encoder.output"][i], lins[i])
        assert torch.equal(acts["head.output"][i], model.head(lins[i]))
    if side == "both":
        assert torch.equal(acts["encoder.drop#1.input.0"][1], lins[1])
        assert torch.equal(acts["encoder.drop.input.0"][1], embeds[1])


def test_t5_generate_captures_its_encoder_called_on_its_own():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(1, 64, (2, 5))
    # ("shared" is the embedding both stacks use through modules of their own: never called itself)
    with acs.ActivationScope(capture="both").track(model, exclude=["shared"]) as tr, torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=3, do_sample=False))
        hidden = model.encoder(input_ids=ids).last_hidden_state
    acts = tr.activations
    assert len(acts["encoder.dropout.output"]) == 1 and len(acts["encoder.dropout#1.output"]) == 1
    assert torch.equal(acts["encoder.dropout#1.output"][0], hidden)
    assert torch.equal(acts["encoder.output.last_hidden_state"][0], hidden)


def test_a_tracked_module_called_on_its_own_in_a_store_capture_records_nothing_and_is_warned(tmp_path):
    """A store's rows follow its row table (one entry per sample of a forward of the tracked
    model): a tracked submodule called on its own between forwards records nothing, its
    reductions see no row of it, and a CaptureWarning says so. In memory such calls are still
    recorded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    xs = [torch.randn(5, 4), torch.randn(3, 4)]
    path = tmp_path / "s.zarr"
    with pytest.warns(acs.CaptureWarning, match=r"called on their own, outside a forward of the tracked model "
                      r"\(1 call\(s\) so far\).*not recorded"):
        with acs.ActivationScope(store=str(path), reductions=["mean"]).track(model) as tr, torch.no_grad():
            model(xs[0])
            model[0](torch.randn(7, 4))  # on its own
            model(xs[1])
    s = acs.open_store(path)
    with torch.no_grad():
        want = torch.cat([model[0](x) for x in xs])
    assert s.n_samples == 8 and s.follows_row_table("0.output")
    torch.testing.assert_close(s["0.output"][:], want, rtol=0, atol=0)
    torch.testing.assert_close(s.reductions["0.output"]["mean"], want.double().mean(0))
    with acs.ActivationScope().track(model) as tr, torch.no_grad():
        model[0](xs[0])
    assert len(tr.activations["0.output"]) == 1


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("first_plain", [False, True])
@pytest.mark.parametrize("mode", [CaptureMode.SNAPSHOT, CaptureMode.REFERENCE])
def test_a_forward_inside_a_torch_func_transform_is_refused_naming_the_hook_point(transform, first_plain, mode):
    """Tensors of torch.func transforms (grad, vmap) are wrappers without storage of their own:
    refused as CaptureError naming the hook point and the fix, on a hook point's first call
    (Python check) and on a later one (native check); the plain forwards before it are kept."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    x = torch.randn(5, 4)
    params = dict(model.named_parameters())
    run = {"grad": lambda: grad(lambda p: functional_call(model, p, (x,)).sum())(params),
           "vmap": lambda: vmap(model)(x)}[transform]
    with acs.ActivationScope(capture_mode=mode).track(model) as tr:
        if first_plain:
            with torch.no_grad():
                model(x)
        with pytest.raises(acs.CaptureError, match=r"hook point '0.output' is a tensor inside a torch.func transform "
                           r"\(grad, vmap, jacrev, \.\.\.\).*Run the tracked model outside the transform"):
            run()
    if first_plain:
        with torch.no_grad():
            torch.testing.assert_close(tr.activations["0.output"][0], model[0](x), rtol=0, atol=0)


class _CollidingModules(torch.nn.Module):
    """Module 'a' called twice (its second call is 'd.a#1') next to a module named 'a#1'."""

    def __init__(self):
        super().__init__()
        self.d = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "a#1": torch.nn.Linear(2, 2)})

    def forward(self, x):
        return self.d["a#1"](self.d["a"](self.d["a"](x)))


class _CollidingKeys(torch.nn.Module):
    def forward(self, x):
        return {1: x, "1": x * 2}


class _CollidingAcrossForwards(torch.nn.Module):
    """Module 'a#1' in one forward, module 'a' called twice (its second call is 'd.a#1') in the next."""

    def __init__(self):
        super().__init__()
        self.d = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "a#1": torch.nn.Linear(2, 2)})

    def forward(self, x, twice=False):
        return self.d["a"](self.d["a"](x)) if twice else self.d["a#1"](self.d["a"](x))


@pytest.mark.parametrize("model_class", [_CollidingModules, _CollidingAcrossForwards])
@pytest.mark.parametrize("to_store", [False, True])
def test_a_module_named_like_another_modules_repeated_call_is_refused_at_track(tmp_path, model_class, to_store):
    """Tracked modules 'd.a' and 'd.a#1': 'd.a#1.output' names both the second call of 'd.a'
    and the module 'd.a#1', so a forward calling 'd.a' twice after one calling 'd.a#1' stored
    the rows of two modules as one array (verify found nothing). Refused when the tracker
    attaches, naming both and the fix, before any forward; excluding one of them captures."""
    model = model_class().eval()
    store = str(tmp_path / "s.zarr") if to_store else None
    x = torch.randn(3, 2)
    with pytest.raises(acs.CaptureError, match=r"tracked module 'd.a#1' of .* is named like the repeated call #1 of "
                       r"the tracked module 'd.a'.*rename the module.*exclude=\['d.a#1'\]"):
        with acs.ActivationScope(store=store).track(model) as tr, torch.no_grad():
            model(x)
            model(x, True) if model_class is _CollidingAcrossForwards else None
    if to_store:
        assert not (tmp_path / "s.zarr").exists()
    with acs.ActivationScope(store=store).track(model, exclude=["d.a#1"]) as tr, torch.no_grad():
        model(x, True) if model_class is _CollidingAcrossForwards else model(x)
    assert tr.hook_points == ["d.a.output", "d.a#1.output"]


@pytest.mark.parametrize("to_store", [False, True])
def test_a_module_whose_name_is_not_utf8_text_is_refused_at_track(tmp_path, to_store):
    """A ModuleDict key with a lone surrogate (os.fsdecode of a file name's undecodable byte)
    failed the attach with pybind11's 'incompatible constructor arguments' (a store folder
    left behind); refused naming the module and the fix, before anything is written.
    Excluding it captures the others."""
    d = torch.nn.ModuleDict({"s\udc80x": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    model = torch.nn.Module()
    model.d = d
    model.forward = lambda x: [m(x) for m in d.values()]
    store = str(tmp_path / "s.zarr") if to_store else None
    x = torch.randn(3, 2)
    with pytest.raises(acs.CaptureError, match=re.escape(
            r"tracked module 'd.s\udc80x' of Module has a name that is not UTF-8 text (the character '\udc80' at "
            r"3, a lone surrogate)") + r".*rename the module.*exclude="):
        with acs.ActivationScope(store=store).track(model), torch.no_grad():
            model(x)
    if to_store:
        assert not (tmp_path / "s.zarr").exists()
    with acs.ActivationScope(store=store).track(model, exclude=["d.s\udc80x"]) as tr, torch.no_grad():
        model(x)
    assert tr.hook_points == ["d.b.output"]
    got = acs.open_store(store)["d.b.output"] if to_store else tr.activations["d.b.output"][0]
    with torch.no_grad():
        torch.testing.assert_close(got, d["b"](x), rtol=0, atol=0)


class _SurrogateKey(torch.nn.Module):
    def forward(self, x):
        return {"ok": x + 1, "s\udc80": x * 2}


@pytest.mark.parametrize("to_store", [False, True])
def test_an_output_dict_key_that_is_not_utf8_text_is_refused_naming_it(tmp_path, to_store):
    """A dict key with a lone surrogate failed the forward with pybind11's 'Unable to cast
    Python instance of type str to C++ type'; refused naming the key, its hook point and the fix."""
    model = torch.nn.Module()
    model.r = _SurrogateKey()
    model.lin = torch.nn.Linear(2, 2)
    model.forward = lambda x: (model.r(x), model.lin(x))
    store = str(tmp_path / "s.zarr") if to_store else None
    x = torch.randn(3, 2)
    with pytest.raises(acs.CaptureError, match=re.escape(
            r"the key 's\udc80' below hook point 'r.output' is not UTF-8 text") + r".*rename the key.*exclude="):
        with acs.ActivationScope(store=store).track(model), torch.no_grad():
            model(x)
    with acs.ActivationScope(store=store, store_options={"overwrite": True} if to_store else None).track(
            model, exclude=["r"]) as tr, torch.no_grad():
        model(x)
    assert tr.hook_points == ["lin.output"]
    got = acs.open_store(store)["lin.output"] if to_store else tr.activations["lin.output"][0]
    with torch.no_grad():
        torch.testing.assert_close(got, model.lin(x), rtol=0, atol=0)


class _HashInName(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.d = torch.nn.ModuleDict({"g#h": torch.nn.Linear(2, 2), "b#2": torch.nn.Linear(2, 2)})

    def forward(self, x):
        return self.d["b#2"](self.d["g#h"](x))


def test_a_module_whose_name_holds_a_hash_is_not_reported_as_recording_nothing():
    """A module 'g#h' (or 'b#2' with no module 'b') records its own hook point; the capture
    warned that it recorded nothing, reading its name as module 'g', call '#h'."""
    model = _HashInName().eval()
    x = torch.randn(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with acs.ActivationScope().track(model) as tr, torch.no_grad():
            model(x)
    with torch.no_grad():
        first = model.d["g#h"](x)
        torch.testing.assert_close(tr.activations["d.g#h.output"][0], first, rtol=0, atol=0)
        torch.testing.assert_close(tr.activations["d.b#2.output"][0], model.d["b#2"](first), rtol=0, atol=0)


@pytest.mark.parametrize("model, name", [(torch.nn.Sequential(_CollidingKeys()), "0.output.1")])
@pytest.mark.parametrize("to_store", [False, True])
def test_two_tensors_of_one_forward_under_one_name_are_refused(tmp_path, model, name, to_store):
    """Two names of one forward that are the same (output keys 1 and '1'; a module named like
    another's repeated call is refused earlier, when the tracker attaches) would put two tensors,
    two rows per sample, under one hook point: refused as CaptureError naming it, and a store
    keeps the forwards before."""
    store = str(tmp_path / "s.zarr") if to_store else None
    with pytest.raises(acs.CaptureError, match=rf"hook point '{re.escape(name)}' was given two tensors in forward 0 "
                       r"of the tracked model: two names of that forward are the same.*Rename the module or key"):
        with acs.ActivationScope(store=store).track(model) as tr, torch.no_grad():
            model(torch.randn(3, 2))
    if to_store:  # nothing committed for that forward: the new store is removed
        assert not (tmp_path / "s.zarr").exists()
    else:
        assert len(tr.activations.get(name, [])) <= 1


# ---------------------------------------------------------------------------- modules called output


@pytest.fixture(scope="module")
def small_bert():
    """A BertModel of random weights from a small config (no download): every layer has a
    submodule called ``output`` (a BertOutput at ``encoder.layer.<i>.output``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16)
    return transformers.BertModel(cfg).eval()


def test_a_hook_point_name_is_read_as_a_module_only_for_transformer_lens_hook_points(small_bert):
    from activationscope.capture.hooks import hook_point_module

    names = {n for n, _ in small_bert.named_modules()}
    assert "encoder.layer.0.output" in names  # the BertOutput
    # the output of the layer, not the BertOutput module at the same path
    assert hook_point_module("encoder.layer.0.output", names) == "encoder.layer.0"
    assert hook_point_module("encoder.layer.0#1.output", names) == "encoder.layer.0"
    assert hook_point_module("encoder.layer.0.output.output", names) == "encoder.layer.0.output"
    assert hook_point_module("encoder.layer.0.output.input.0", names) == "encoder.layer.0.output"
    assert hook_point_module("encoder.layer.0.output.dense.output", names) == "encoder.layer.0.output.dense"
    # a module path read whole: only where it is a HookPoint's (recorded under its own path)
    assert hook_point_module("encoder.layer.0.output", names, {"encoder.layer.0.output"}) == "encoder.layer.0.output"
    assert hook_point_module("blocks.0.hook_z#1", {"blocks.0.hook_z"}, {"blocks.0.hook_z"}) == "blocks.0.hook_z"


def test_tracking_a_bert_layer_and_its_output_submodule_records_both_without_warning(small_bert, tmp_path):
    """encoder.layer.0 (a BertLayer) and encoder.layer.0.output (its BertOutput) tracked
    together: each gives its own hook point, and neither is said to have recorded nothing."""
    model = small_bert
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    seen: dict[str, torch.Tensor] = {}
    handles = [model.encoder.layer[0].register_forward_hook(lambda m, i, o: seen.__setitem__("layer", o)),
               model.encoder.layer[0].output.register_forward_hook(lambda m, i, o: seen.__setitem__("out", o))]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with acs.ActivationScope().track(model, include=["encoder.layer.0", "encoder.layer.0.output"]) as tr, \
                    torch.no_grad():
                model(ids)
    finally:
        for h in handles:
            h.remove()
    assert [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)] == []
    # a BertLayer returns its hidden states (a tuple of them in older transformers)
    layer_hp, layer_out = (("encoder.layer.0.output.0", seen["layer"][0]) if isinstance(seen["layer"], tuple)
                           else ("encoder.layer.0.output", seen["layer"]))
    torch.testing.assert_close(tr.activations[layer_hp][0], layer_out, rtol=0, atol=0)
    torch.testing.assert_close(tr.activations["encoder.layer.0.output.output"][0], seen["out"], rtol=0, atol=0)

    # a store of the layer's hook point cannot be resumed by tracking only the BertOutput
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path).track(model, include=["encoder.layer.0"]), torch.no_grad():
        model(ids)
    hp = acs.open_store(path).hook_points
    assert hp and all(h.startswith("encoder.layer.0.output") for h in hp)
    with pytest.raises(acs.ActivationScopeError, match=r"it holds \[.*'encoder.layer.0.output.*\] which this capture "
                                                       r"does not give"):
        with acs.ActivationScope(store=path, store_options={"resume": True}).track(
                model, include=["encoder.layer.0.output"]), torch.no_grad():
            model(ids)
    assert acs.open_store(path).n_samples == 2


def _killed_policy_capture(path, stop_at, **policy):
    """A capture of 6 forwards of a Linear(4, 4) under a capture policy, into ``path`` (a
    commit after every forward), stopped by KeyboardInterrupt before forward ``stop_at``.
    Returns (model, inputs (6, 2, 4), path, scope(**store_options) with the same policy)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    xs = torch.randn(6, 2, 4)

    def scope(**options):
        return acs.ActivationScope(store=path, store_options=options, **policy)

    with pytest.raises(KeyboardInterrupt):
        with torch.no_grad(), scope(commit_interval=0).track(model):
            for i in range(6):
                if i == stop_at:
                    raise KeyboardInterrupt
                model(xs[i])
    return model, xs, path, scope


def test_a_resumed_max_k_capture_counts_the_stored_forwards(tmp_path):
    # max_k=3, killed after 2 captured forwards: the resume captures 1 more, as one
    # uninterrupted run would have (it captured 3 more, and the store held 5 forwards)
    model, xs, path, scope = _killed_policy_capture(tmp_path / "k.zarr", 2, capture_policy=acs.CapturePolicy.MAX_K,
                                                    max_k=3)
    assert acs.open_store(path).n_rows("0.output") == 4
    with torch.no_grad(), scope(resume=True).track(model):
        for i in range(2, 6):
            model(xs[i])
    store = acs.open_store(path)
    with torch.no_grad():
        ref = torch.cat([model(xs[i]) for i in range(3)])
    assert store.status == "complete" and torch.equal(store["0.output"], ref)
    assert store.row_table("sample")["sample_id"].to_pylist() == list(range(6))
    # a resume of a store that already holds max_k forwards captures nothing more
    with torch.no_grad(), scope(resume=True).track(model):
        model(xs[5])
    assert torch.equal(acs.open_store(path)["0.output"], ref)


def test_a_resume_of_a_sample_n_capture_is_refused_and_the_store_kept(tmp_path):
    """SAMPLE_N keeps forwards 0, n, 2n, ...; the store records those, not the ones skipped, so
    a resume cannot tell which forward comes next (skipping the committed samples stores other
    samples than an uninterrupted run): refused before anything is written."""
    model, xs, path, scope = _killed_policy_capture(tmp_path / "n.zarr", 5, capture_policy=acs.CapturePolicy.SAMPLE_N,
                                                    sample_every=2)
    files = {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".activationscope-writer.lock"}
    assert acs.open_store(path).n_rows("0.output") == 6  # forwards 0, 2, 4
    with pytest.raises(acs.CaptureError, match=r"cannot resume .* with CapturePolicy.SAMPLE_N \(sample_every=2\): the "
                                               r"store records the forwards it captured, not the ones it skipped"):
        with torch.no_grad(), scope(resume=True).track(model):
            model(xs[5])
    assert {p: p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != ".activationscope-writer.lock"} == files
    # sample_every=1 keeps every forward: resumed as EVERY is
    path = tmp_path / "one.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, capture_policy=acs.CapturePolicy.SAMPLE_N,
                                              sample_every=1).track(model):
        model(xs[0])
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"resume": True},
                                              capture_policy=acs.CapturePolicy.SAMPLE_N,
                                              sample_every=1).track(model):
        model(xs[1])
    with torch.no_grad():
        assert torch.equal(acs.open_store(path)["0.output"], torch.cat([model(xs[0]), model(xs[1])]))


@pytest.mark.parametrize("stored,resumed,fix", [
    ({"capture_policy": acs.CapturePolicy.MAX_K, "max_k": 4}, {},
     r"resume with capture_policy=CapturePolicy.MAX_K, max_k=4"),
    ({"capture_policy": acs.CapturePolicy.MAX_K, "max_k": 4}, {"capture_policy": acs.CapturePolicy.MAX_K, "max_k": 5},
     r"resume with capture_policy=CapturePolicy.MAX_K, max_k=4"),
    ({"capture_policy": acs.CapturePolicy.SAMPLE_N, "sample_every": 2}, {},
     r"a store captured with CapturePolicy.SAMPLE_N cannot be resumed"),
    ({}, {"capture_policy": acs.CapturePolicy.MAX_K, "max_k": 4}, r"resume with capture_policy=CapturePolicy.EVERY \("),
])
def test_a_resume_with_another_capture_policy_is_refused_and_the_store_kept(tmp_path, stored, resumed, fix):
    """A resume under another policy than the store's picked its forwards by another rule (a
    MAX_K or SAMPLE_N store resumed with the default EVERY stored every later forward) and
    recorded only its own policy in capture_config: refused before anything is written."""
    model, xs, path, _ = _killed_policy_capture(tmp_path / "p.zarr", 2, **stored)
    files = {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and p.name != ".activationscope-writer.lock"}
    with pytest.raises(acs.CaptureError, match=r"cannot resume .*: it was captured with capture_policy=CapturePolicy\."
                                               r".*, which would pick the resumed forwards by another rule .*" + fix):
        with torch.no_grad(), acs.ActivationScope(store=path, store_options={"resume": True}, **resumed).track(model):
            for i in range(2, 6):
                model(xs[i])
    assert {p: p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != ".activationscope-writer.lock"} == files
    # SAMPLE_N with sample_every=1 is EVERY: resumed as it
    with torch.no_grad(), acs.ActivationScope(store=tmp_path / "e.zarr").track(model):
        model(xs[0])
    with torch.no_grad(), acs.ActivationScope(store=tmp_path / "e.zarr", store_options={"resume": True},
                                              capture_policy=acs.CapturePolicy.SAMPLE_N, sample_every=1).track(model):
        model(xs[1])
    assert acs.open_store(tmp_path / "e.zarr").n_rows("0.output") == 4


def test_a_skipped_forward_described_with_another_number_of_samples_is_refused(tmp_path):
    """A forward SAMPLE_N skips counts its samples by its description: one of 3 samples for a
    batch of 5 went through, and every later default id was 2 short (the stored rows of data
    rows 10..14 listed as samples 8..12). Refused as in a captured forward."""
    from activationscope.errors import ArgumentValueError

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    data = torch.randn(15, 4)
    path = tmp_path / "n.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, capture_policy=acs.CapturePolicy.SAMPLE_N,
                                              sample_every=2).track(model) as tr:
        for f in range(3):
            tr.set_batch(label=[f] * (3 if f == 1 else 5))
            if f == 1:
                with pytest.raises(ArgumentValueError, match=r"set_batch\(column 'label'=...\) describes 3 samples, "
                                                             r"but the forward's batch has 5"):
                    model(data[5:10])
                tr.set_batch(label=[f] * 5)  # described again: the same forward, counted once
            model(data[5 * f:5 * f + 5])
    store = acs.open_store(path)
    assert store.row_table("sample").column("sample_id").to_pylist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    with torch.no_grad():
        assert torch.equal(store["0.output"], torch.cat([model(data[:5]), model(data[10:])]))


class _TextModel(torch.nn.Module):
    """Takes a list of texts and makes its token ids inside: its input holds no tensor."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(100, 3)

    def forward(self, texts):
        return self.e(torch.tensor([int(t[1:]) for t in texts]))


def test_a_skipped_forward_of_a_model_without_tensor_input_is_refused_unless_described(tmp_path):
    """A forward SAMPLE_N skips, of a model taking texts, had no batch size to count: counted
    as 0 samples, texts 10..14 were stored as samples 5..9. Refused at that forward unless a
    set_batch description tells its samples."""
    from activationscope.errors import ArgumentValueError

    torch.manual_seed(0)
    model = _TextModel().eval()
    texts = [f"t{i}" for i in range(20)]
    path = tmp_path / "t.zarr"
    scope = acs.ActivationScope(store=path, capture_policy=acs.CapturePolicy.SAMPLE_N, sample_every=2)
    with pytest.raises(ArgumentValueError, match=r"forward 1 of the tracked model is skipped by CapturePolicy.SAMPLE_N "
                                                 r"\(sample_every=2\), and its input holds no tensor.*"
                                                 r"tracker.set_batch\(sample_ids=...\)"):
        with torch.no_grad(), scope.track(model):
            for s in range(0, 20, 5):
                model(texts[s:s + 5])
    assert acs.open_store(path).row_table("sample").column("sample_id").to_pylist() == [0, 1, 2, 3, 4]
    for described in ({"text": True}, {"ids": True}):
        path = tmp_path / f"{list(described)[0]}.zarr"
        scope = acs.ActivationScope(store=path, capture_policy=acs.CapturePolicy.SAMPLE_N, sample_every=2)
        with torch.no_grad(), scope.track(model) as tr:
            for s in range(0, 20, 5):
                if "ids" in described:
                    tr.set_batch(sample_ids=range(s, s + 5))
                else:
                    tr.set_batch(text=texts[s:s + 5])
                model(texts[s:s + 5])
        store = acs.open_store(path)
        assert store.row_table("sample").column("sample_id").to_pylist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
        with torch.no_grad():
            assert torch.equal(store["e.output"], model.e.weight[[0, 1, 2, 3, 4, 10, 11, 12, 13, 14]])


@pytest.mark.parametrize("columns", [False, True])
def test_default_sample_ids_of_a_sample_n_capture_count_the_skipped_forwards(tmp_path, columns):
    """The default ids number the samples of every forward, those SAMPLE_N skipped too: a stored
    sample's id is its row in the data (rows 32..47 of the data are ids 32..47, not 16..31)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    data = torch.randn(80, 4)
    path = tmp_path / "n.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, capture_policy=acs.CapturePolicy.SAMPLE_N,
                                              sample_every=2).track(model) as tr:
        for i, n in enumerate((16, 16, 16, 8, 24)):  # batches of other sizes: the skipped ones counted by theirs
            first = sum((16, 16, 16, 8, 24)[:i])
            if columns:  # a described batch without ids: still numbered by the counter
                tr.set_batch(label=list(range(first, first + n)))
            model(data[first:first + n])
    store = acs.open_store(path)
    ids = store.row_table("sample").column("sample_id").to_pylist()
    assert ids == list(range(0, 16)) + list(range(32, 48)) + list(range(56, 80))  # forwards 0, 2, 4
    with torch.no_grad():  # forward by forward, as captured (a matmul's last bits depend on the batch)
        expected = torch.cat([model(data[0:16]), model(data[32:48]), model(data[56:80])])
    assert torch.equal(store["0.output"], expected)
    if columns:
        assert store.row_table("sample").column("label").to_pylist() == ids
    ds = acs.ActivationDataset(store, "0.output", sample_ids=[33, 60])
    assert torch.equal(ds[list(range(len(ds)))]["0.output"], expected[[ids.index(33), ids.index(60)]])
    # EVERY: the counter as before, 0.. without gaps
    path = tmp_path / "every.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path).track(model):
        model(data[:5])
        model(data[5:12])
    assert acs.open_store(path).row_table("sample").column("sample_id").to_pylist() == list(range(12))


class _CountedList(list):
    """A list that counts the walks over it."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_a_first_forward_walks_the_tracked_modules_a_fixed_number_of_times(tmp_path, monkeypatch):
    """Each new hook point of a first forward looked its module up in a set of every tracked
    module's name made anew for it (and a dict of them, for token rows): quadratic in the hook
    points (1600 Linear layers: 1.5 s of the first forward). Now that lookup is made once;
    the records are as before."""
    import activationscope.capture.scope as S

    counts = {}
    real_init = S.Tracker.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self._modules = _CountedList(self._modules)

    monkeypatch.setattr(S.Tracker, "__init__", init)
    for n in (8, 32):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n)])
        x = torch.randn(3, 4)
        path = tmp_path / f"s{n}.zarr"
        with torch.no_grad(), acs.ActivationScope(store=str(path), reductions=["mean"]).track(model):
            before = _CountedList.walks
            model(x)
            counts[n] = _CountedList.walks - before
        st = acs.open_store(path)
        with torch.no_grad():
            h = x
            for i, layer in enumerate(model):
                h = layer(h)
                assert torch.equal(st[f"{i}.output"], h)
    assert counts[32] == counts[8], counts


@pytest.mark.parametrize("flag", ["False", "yes", 0, None])
def test_capture_parameters_takes_a_bool_only(flag):
    # capture_parameters="False" (from a config file) is a true string: it snapshotted every parameter
    with pytest.raises(acs.errors.ArgumentTypeError, match="capture_parameters must be True or False, got"):
        acs.ActivationScope(capture_parameters=flag)
    assert acs.ActivationScope(capture_parameters=np.bool_(True)).capture_parameters is True


@pytest.mark.parametrize("argument", ["include", "exclude", "exclude_hook_points"])
def test_patterns_that_are_not_a_str_or_a_list_are_named_in_the_error(argument):
    # include=3 was a bare TypeError ("'int' object is not iterable") naming no argument
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    match = f"{argument} must be a str or a list of fnmatch patterns \\(str\\), got 3"
    with pytest.raises(acs.errors.ArgumentTypeError, match=match):
        acs.ActivationScope(**{argument: 3})
    with pytest.raises(acs.errors.ArgumentTypeError, match=match):
        acs.ActivationScope().track(model, **{argument: 3})


def test_a_tracked_model_is_freed_once_the_user_drops_it():
    """The check of a model's forward for a second sequence cached its bound ``forward`` (64
    of them), so the last 64 models tracked stayed alive, with their parameters, after the
    user dropped them and the tracker. Now no model outlives its last reference, and attaching
    and detaching 200 times leaves no hook, wrapper or instance ``forward`` behind."""
    import weakref

    x = torch.randn(2, 8)
    refs = []
    for _ in range(3):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        with acs.ActivationScope().track(model) as tr:
            model(x)
        refs.append(weakref.ref(model))
        del model, tr
    gc.collect()
    assert [r() for r in refs] == [None, None, None]

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    scope = acs.ActivationScope()
    for _ in range(200):
        with scope.track(model) as tr:
            model(x)
        assert [r.shape for r in tr.activations["2.output"]] == [(2, 4)]
    del tr
    gc.collect()
    for m in model.modules():
        assert "forward" not in m.__dict__
        assert (len(m._forward_hooks), len(m._forward_pre_hooks)) == (0, 0)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_setup_that_fails_after_the_store_opened_closes_it_as_found(tmp_path, monkeypatch):
    """Wrapping a module failed after the store opened (the error caught): the writer stayed
    open, holding the store's lock, so the next capture into it was refused with
    StoreLockedError. The writer is now discarded: the store is as it was found, and a resume
    continues it."""
    from activationscope.capture import scope as scope_module

    store = str(tmp_path / "s.zarr")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    with acs.ActivationScope(store=store).track(model), torch.no_grad():
        model(x)
    install = scope_module.Tracker._install

    def failing_install(self, module, site):
        raise RuntimeError("injected failure to wrap a module")

    monkeypatch.setattr(scope_module.Tracker, "_install", failing_install)
    with pytest.raises(RuntimeError, match="injected failure to wrap a module"):
        with acs.ActivationScope(store=store, store_options={"resume": True}).track(model):
            pass
    monkeypatch.setattr(scope_module.Tracker, "_install", install)
    st = acs.open_store(store)
    assert st.status == "complete" and st["0.output"].shape == (2, 4)
    with acs.ActivationScope(store=store, store_options={"resume": True}).track(model), torch.no_grad():
        model(-x)
    got = acs.open_store(store)["0.output"]
    with torch.no_grad():
        assert torch.equal(got, torch.cat([model(x), model(-x)]))


def test_a_capture_cell_run_again_says_where_overwrite_goes(tmp_path):
    # the error names overwrite=True and resume=True, which ActivationScope takes in store_options
    model = toy_mlp(depth=1)
    path = tmp_path / "s.zarr"
    for _ in range(2):
        try:
            with torch.no_grad(), acs.ActivationScope(store=path).track(model):
                model(torch.randn(2, 16))
        except acs.StoreExistsError as e:
            error = e
    assert "pass overwrite=True" in str(error)
    assert error.__notes__ == ["ActivationScope takes them as store options: ActivationScope(store=..., "
                               "store_options={'overwrite': True}) or store_options={'resume': True}"]
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"overwrite": True}).track(model):
        model(torch.randn(2, 16))
    assert acs.open_store(path).status == "complete"


def test_a_tracker_left_attached_by_a_cell_run_again_is_found_and_closed(tmp_path):
    # `tracker = scope.track(model); tracker.attach()` in a notebook cell run twice: the first
    # tracker is no longer named but still attached; the error names it and Tracker.attached_to
    # finds it, and its remove() commits its rows
    model = toy_mlp(depth=1)
    path = tmp_path / "s.zarr"
    x = torch.randn(2, 16)
    tracker = acs.ActivationScope(store=path).track(model)
    tracker.attach()
    with torch.no_grad():
        model(x)
    tracker = acs.ActivationScope(store=path, store_options={"resume": True}).track(model)
    with pytest.raises(acs.StoreLockedError) as e:
        tracker.attach()
    assert e.value.__notes__ == [
        "it is held by a tracker of Sequential attached in this process and not closed (attach() without remove(): "
        "a notebook cell run again leaves the earlier tracker attached, its wrappers on the model); close it, and "
        "commit its rows, with `for t in acs.Tracker.attached_to(model): t.remove()`"]
    left = acs.Tracker.attached_to(model)
    assert len(left) == 1 and left[0] is not tracker and acs.Tracker.attached_to(model[0]) == left
    with acs.ActivationScope().track(model) as memory:
        assert acs.Tracker.attached_to(model) in ([left[0], memory], [memory, left[0]])
    for t in acs.Tracker.attached_to(model):
        t.remove()
    assert acs.Tracker.attached_to(model) == [] and not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"resume": True}).track(model):
        model(-x)
    store = acs.open_store(path)
    with torch.no_grad():
        assert store.status == "complete" and torch.equal(store["1.output"], torch.cat([model(x), model(-x)]))
