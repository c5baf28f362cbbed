"""A hook point that is the very tensor of another (a container's output and its last
child's, a module's input and the previous module's output) is kept and stored once, read
back through an alias. Reference: the modules called in plain PyTorch."""

from __future__ import annotations

import warnings

import pytest
import torch

from activationscope import ActivationScope, CaptureError, ReductionPolicy, StoragePolicy, open_store

from acs_testing import plain_hooks


def _features():
    torch.manual_seed(0)
    features = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))
    return torch.nn.Sequential(features, torch.nn.Linear(5, 2))


def _dir_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and "/acts/" in str(p))


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode", "enabled"])
def test_issue_input_container_output_stored_once(tmp_path, grad):
    m = _features()
    xs = [torch.randn(4, 6) for _ in range(3)]
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
           "enabled": torch.enable_grad}[grad]
    with ctx(), ActivationScope(store=tmp_path / "s.zarr").track(m):
        for x in xs:
            m(x)
    s = open_store(tmp_path / "s.zarr")
    assert s.aliases == {"0.output": "0.2.output"}
    assert "0.output" in s and "0.output" in s.hook_points
    assert not (tmp_path / "s.zarr" / "acts" / "0.output").exists()
    with torch.no_grad():
        ref = torch.cat([m[0](x) for x in xs])
    torch.testing.assert_close(s["0.output"][:], ref, rtol=0, atol=0)
    torch.testing.assert_close(s["0.2.output"][:], ref, rtol=0, atol=0)
    assert s.n_rows("0.output") == 12 and s.verify() == []
    info = s.info()
    assert info["aliases"] == {"0.output": "0.2.output"} and "0.output" not in info["arrays"]


def test_aliased_store_has_the_bytes_of_one_copy(tmp_path):
    # the reference: the same capture with the container excluded has the same bytes on disk
    m = _features()
    xs = [torch.randn(64, 6) for _ in range(4)]
    with torch.no_grad():
        with ActivationScope(store=tmp_path / "a.zarr").track(m):
            for x in xs:
                m(x)
        with ActivationScope(store=tmp_path / "b.zarr").track(m, exclude=["0"]):
            for x in xs:
                m(x)
    assert _dir_bytes(tmp_path / "a.zarr") == _dir_bytes(tmp_path / "b.zarr")


def test_inputs_that_are_the_previous_output_are_stored_once(tmp_path):
    m = _features()
    x = torch.randn(4, 6)
    with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr", capture="both").track(m[0]):
        m[0](x)
    s = open_store(tmp_path / "s.zarr")
    assert s.aliases["1.input.0"] == "0.output"
    assert s.aliases["2.input.0"] == "1.output"
    with torch.no_grad():
        torch.testing.assert_close(s["1.input.0"][:], m[0][0](x), rtol=0, atol=0)


def test_in_memory_snapshot_keeps_one_copy():
    m = _features()
    x = torch.randn(4, 6)
    with torch.no_grad(), ActivationScope().track(m) as t:
        m(x)
        m(x + 1)
    acts = t.activations
    for a, b in zip(acts["0.output"], acts["0.2.output"]):
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape  # the same bytes: one copy
    with torch.no_grad():
        torch.testing.assert_close(acts["0.output"][1], m[0](x + 1), rtol=0, atol=0)


class _ChangesAfter(torch.nn.Module):
    """Returns its child's output after changing it in place: not an alias."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(2)
        return y


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
def test_in_place_change_after_the_child_is_not_an_alias(tmp_path, grad):
    torch.manual_seed(0)
    m = torch.nn.Sequential(_ChangesAfter())
    x = torch.randn(3, 4)
    ctx = torch.no_grad if grad == "no_grad" else torch.inference_mode
    with ctx(), ActivationScope(store=tmp_path / "s.zarr").track(m):
        m(x)
    s = open_store(tmp_path / "s.zarr")
    assert s.aliases == {}
    with torch.no_grad():
        lin = m[0].lin(x)
    torch.testing.assert_close(s["0.lin.output"][:], lin, rtol=0, atol=0)
    torch.testing.assert_close(s["0.output"][:], lin * 2, rtol=0, atol=0)


class _Sometimes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y if self.calls == 1 else y + 1


def test_alias_that_stops_holding_is_an_error_naming_both(tmp_path):
    m = torch.nn.Sequential(_Sometimes())
    with pytest.raises(CaptureError, match=r"'0.output' is stored once, as an alias of '0.lin.output'.*exclude="):
        with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr").track(m):
            m(torch.randn(3, 4))
            m(torch.randn(3, 4))
    # the forwards before stay readable and exact
    s = open_store(tmp_path / "s.zarr")
    assert s.status == "incomplete"


def _capture_then_resume(m, path, xs, k):
    """Capture ``xs[:k]`` into a new store (reductions mean), then resume it with the rest;
    returns the reference (``m[0]`` of every x) and the store's aliases after the first part."""
    with torch.no_grad():
        with ActivationScope(store=path, reductions=["mean"]).track(m):
            for x in xs[:k]:
                m(x)
        aliases_first = open_store(path).aliases
        with ActivationScope(store=path, reductions=["mean"], store_options={"resume": True}).track(m):
            for x in xs[k:]:
                m(x)
        return torch.cat([m[0](x) for x in xs]), aliases_first


def test_resumed_store_keeps_its_aliases(tmp_path):
    m = _features()
    xs = [torch.randn(4, 6) for _ in range(4)]
    ref, _ = _capture_then_resume(m, tmp_path / "s.zarr", xs, 2)
    s = open_store(tmp_path / "s.zarr")
    assert s.aliases == {"0.output": "0.2.output"}
    torch.testing.assert_close(s["0.output"][:], ref, rtol=0, atol=0)
    torch.testing.assert_close(s.reductions["0.output"]["mean"], ref.double().mean(0))


def test_resume_whose_first_forward_is_an_empty_batch_keeps_the_aliases(tmp_path):
    # an empty batch keeps no tensor to compare an alias with: the resume was refused ("gives
    # '0.output' its own tensor") although model and selection were the same
    m = _features()
    xs = [torch.randn(4, 6), torch.randn(0, 6), torch.randn(3, 6), torch.randn(0, 6), torch.randn(2, 6)]
    ref, _ = _capture_then_resume(m, tmp_path / "s.zarr", xs, 1)
    s = open_store(tmp_path / "s.zarr")
    assert s.aliases == {"0.output": "0.2.output"}
    assert s.status == "complete" and s.n_rows("0.output") == 9
    torch.testing.assert_close(s["0.output"][:], ref, rtol=0, atol=0)
    torch.testing.assert_close(s.reductions["0.output"]["mean"], ref.double().mean(0))


def test_resume_refuses_an_alias_that_is_another_tensor_after_an_empty_batch(tmp_path):
    # the stored alias kept on an empty batch is checked again at the next call with rows
    class Copies(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.same, self.n = torch.nn.Linear(3, 3), torch.nn.Identity(), 0

        def forward(self, x):
            y = self.lin(x)
            self.n += 1
            return self.same(y if self.n != 3 else y.clone())  # y itself, but a copy at the third call

    m = Copies()
    with torch.no_grad():
        with ActivationScope(store=tmp_path / "s.zarr").track(m):
            m(torch.randn(2, 3))
        assert open_store(tmp_path / "s.zarr").aliases == {"same.output": "lin.output"}
        with pytest.raises(CaptureError, match="'same.output' is stored once, as an alias of 'lin.output'"), \
                ActivationScope(store=tmp_path / "s.zarr", store_options={"resume": True}).track(m):
            m(torch.randn(0, 3))
            m(torch.randn(2, 3))
    assert m.n == 3  # refused at the call with rows, not at the empty one
    assert open_store(tmp_path / "s.zarr").n_rows("lin.output") == 2


def test_resume_of_a_store_of_empty_batches_keeps_its_arrays(tmp_path):
    # a first forward of an empty batch stores each hook point as an array of its own (there is
    # no tensor to compare): a resume with rows made '0.output' an alias again and was refused
    # ("has an array in this store; it cannot become an alias")
    m = _features()
    xs = [torch.randn(0, 6), torch.randn(4, 6), torch.randn(3, 6)]
    ref, aliases_first = _capture_then_resume(m, tmp_path / "s.zarr", xs, 1)
    assert aliases_first == {}
    s = open_store(tmp_path / "s.zarr")
    assert s.aliases == {} and s.status == "complete"
    torch.testing.assert_close(s["0.output"][:], ref, rtol=0, atol=0)
    torch.testing.assert_close(s["0.2.output"][:], ref, rtol=0, atol=0)
    torch.testing.assert_close(s.reductions["0.output"]["mean"], ref.double().mean(0))
    assert s.verify() == []


class _RaisesOnce(torch.nn.Module):
    """Returns its input (so its output is an alias of the previous module's); raises once."""

    def __init__(self, bad_call):
        super().__init__()
        self.bad_call, self.n = bad_call, 0

    def forward(self, x):
        self.n += 1
        if self.n == self.bad_call:
            raise RuntimeError("bad batch")
        return x


@pytest.mark.parametrize("where", ["memory", "store"])
def test_forward_that_raises_between_target_and_alias(tmp_path, where):
    # forward 1 runs the target (0.output) but raises before the alias (1.output): later
    # forwards still pair each alias call with its target's call of the same forward. In a
    # store the alias is its target's array (the warning says it shows the target's rows); in
    # memory its records are its own calls'
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), _RaisesOnce(2), torch.nn.Linear(4, 4))
    xs = [torch.randn(2, 4) for _ in range(4)]
    kw = {"store": tmp_path / "s.zarr"} if where == "store" else {}
    with pytest.warns(RuntimeWarning, match=r"forward 1 of the tracked model raised") as caught:
        with torch.no_grad(), ActivationScope(**kw).track(m) as t:
            for x in xs:
                try:
                    m(x)
                except RuntimeError as e:
                    assert str(e) == "bad batch"
    said = " ".join(str(w.message) for w in caught if "raised" in str(w.message))
    assert ("aliases of others (['1.output'])" in said) == (where == "store")
    assert t._aliases == {"1.output": "0.output"}
    whole = [x for i, x in enumerate(xs) if i != 1]
    if where == "store":
        s = open_store(tmp_path / "s.zarr")
        assert s.aliases == {"1.output": "0.output"} and s.n_rows("2.output") == 6
        with torch.no_grad():
            torch.testing.assert_close(s["2.output"][:], torch.cat([m[2](m[0](x)) for x in whole]), rtol=0, atol=0)
        return
    acts = t.activations
    with torch.no_grad():
        _ = [torch.testing.assert_close(r, m[2](m[0](x)), rtol=0, atol=0) for r, x in zip(acts["2.output"], whole)]
        assert len(acts["1.output"]) == 3
        _ = [torch.testing.assert_close(r, m[0](x), rtol=0, atol=0) for r, x in zip(acts["1.output"], whole)]
        assert len(acts["0.output"]) == 4  # the partial forward included, as the warning says


@pytest.mark.parametrize("where", ["store", "memory"])
def test_an_alias_that_gets_no_rows_while_its_target_does(tmp_path, where):
    # a store holds the alias as its target's array: it must not show the rows of forwards
    # in which its module returned nothing, so that forward is refused; in memory the alias
    # keeps its own calls' records (two) while its target goes on
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), _GateFor(2))
    xs = [torch.randn(4, 8) for _ in range(5)]
    with torch.no_grad():
        ref = [m[1].lin(m[0](x)) for x in xs]
    if where == "memory":
        with torch.no_grad(), ActivationScope().track(m) as t:
            for x in xs:
                m(x)
        acts = t.activations
        assert t._aliases == {"1.output": "1.lin.output"}
        assert len(acts["1.output"]) == 2 and all(torch.equal(a, b) for a, b in zip(acts["1.output"], ref))
        assert len(acts["1.lin.output"]) == 5 and all(torch.equal(a, b) for a, b in zip(acts["1.lin.output"], ref))
        return
    with pytest.raises(CaptureError, match=r"'1.output' is stored once, as an alias of '1.lin.output'.*in forward 2 "
                                           r"it did not get the rows.*The store keeps every forward before this one"):
        with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr").track(m):
            for x in xs:
                m(x)
    s = open_store(tmp_path / "s.zarr")
    assert s.status == "incomplete" and s.aliases == {"1.output": "1.lin.output"}
    assert s.n_rows("1.output") == s.n_rows("1.lin.output") == 8  # the two whole forwards
    torch.testing.assert_close(s["1.output"][:], torch.cat(ref[:2]), rtol=0, atol=0)


class _GateFor(torch.nn.Module):
    """Returns its child's very tensor (an alias of it) for ``n_open`` calls, then None."""

    def __init__(self, n_open):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.n_open, self.calls = n_open, 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x)
        return y if self.calls <= self.n_open else None


class _LateChild(torch.nn.Module):
    """Runs a child (a new hook point) from its third call on."""

    def __init__(self):
        super().__init__()
        self.extra = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls >= 3:
            self.extra(x)
        return x + 1


@pytest.mark.parametrize("n_open", [1, 3, 6])
def test_an_alias_missing_a_forward_is_found_after_quiet_forwards_and_new_hook_points(tmp_path, n_open):
    # forwards in which every store alias got its target's rows are checked without looking
    # at each hook point; the forward in which one did not (after quiet forwards, after a hook
    # point first seen in forward 2, or in that same forward) is still refused, naming it
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), _LateChild(), _GateFor(n_open))
    xs = [torch.randn(4, 8) for _ in range(9)]
    with pytest.raises(CaptureError, match=rf"'2.output' is stored once, as an alias of '2.lin.output'.*in forward "
                                           rf"{n_open} it did not get the rows"):
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            with ActivationScope(store=tmp_path / "s.zarr").track(m) as t:
                for x in xs:
                    m(x)
    s = open_store(tmp_path / "s.zarr")
    assert s.n_rows("2.lin.output") == 4 * n_open  # the whole forwards before the refused one
    assert ("1.extra.output" in t.hook_points) == (n_open >= 2)
    late = [w for w in caught if "'1.extra.output' was first captured in forward 2" in str(w.message)]
    assert len(late) == (n_open >= 2)


def test_aliases_that_stay_aligned_over_many_forwards_are_never_refused():
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)], _LateChild())
    with torch.no_grad(), ActivationScope(capture="both").track(m) as t:
        for _ in range(40):
            m(torch.randn(3, 8))
    assert len(t._aliases) >= 6  # each layer's input is the previous layer's output
    counts = {k: len(v) for k, v in t.activations.items()}
    assert counts.pop("6.extra.output") == 38 and counts.pop("6.extra.input.0") == 38  # from forward 2 on
    assert set(counts.values()) == {40}


class _ReturnsAnEarlyTensor(torch.nn.Module):
    """Returns the output of its third layer after running many more: the alias search must
    find a target that is not the hook point captured last."""

    def __init__(self, n: int = 24) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(n))

    def forward(self, x):
        kept = None
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 2:
                kept = x
        return kept


def test_an_alias_target_is_found_among_many_hook_points(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(_ReturnsAnEarlyTensor(), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr", capture="output").track(m):
        m(x)
        m(x + 1)
    s = open_store(tmp_path / "s.zarr")
    assert s.aliases == {"0.output": "0.layers.2.output"}
    layers = m[0].layers
    with torch.no_grad():
        want = torch.cat([layers[2](layers[1](layers[0](v))) for v in (x, x + 1)])
    torch.testing.assert_close(s["0.output"][:], want, rtol=0, atol=0)
    assert set(s.hook_points) == {"0.output", "1.output", *(f"0.layers.{i}.output" for i in range(24))}


def test_a_new_hook_point_is_compared_only_with_those_on_its_tensors_storage(tmp_path, monkeypatch):
    # n distinct outputs: compared with every earlier hook point of the forward, the first
    # forward would give the native check n^2/2 candidates; those on the same storage are a few
    from activationscope.capture import scope as scope_module

    n = 200
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(n)]), torch.nn.Linear(4, 2))
    given = []
    last_match = scope_module._C.last_match

    def counted(x, sinks):
        given.append(len(sinks))
        return last_match(x, sinks)

    monkeypatch.setattr(scope_module._C, "last_match", counted)
    xs = [torch.randn(3, 4), torch.randn(3, 4)]
    with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr", capture="output").track(m):
        for x in xs:
            m(x)
    assert 1 <= len(given) <= n + 2  # at most one search per hook point, in its first forward
    assert sum(given) <= 3 * (n + 2), sum(given)
    s = open_store(tmp_path / "s.zarr")
    assert s.aliases == {"0.output": f"0.{n - 1}.output"}  # the container's output: its last child's
    with torch.no_grad():
        want = torch.cat([m[0](x) for x in xs])
    torch.testing.assert_close(s["0.output"][:], want, rtol=0, atol=0)


def test_an_alias_of_a_module_called_on_its_own_is_found_after_another_call_of_its_target():
    # outside a forward of the tracked model each call is its own: "0.output" is watched with
    # its first call's tensor, then holds its second call's, which "1.output" (an Identity) is
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Identity())
    x = torch.randn(2, 4)
    with torch.no_grad(), ActivationScope(capture="output").track(m) as t:
        m[0](x)
        y = m[0](x + 1)
        m[1](y)
    assert t._aliases == {"1.output": "0.output"}
    acts = t.activations
    assert acts["1.output"][0].data_ptr() == acts["0.output"][1].data_ptr()  # kept once
    torch.testing.assert_close(acts["1.output"][0], y, rtol=0, atol=0)


def test_a_repeated_tensor_with_other_rows_than_its_target_is_stored_as_its_own_array(tmp_path):
    # token_rows= makes the Identity's output (the same tensor as "0.output") one row per
    # sample while "0.output" stores one row per token: an alias would store it as token rows
    # (against token_rows=) and its reduction would cover other rows than its array
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.Identity(), torch.nn.Linear(5, 2))
    x = torch.randn(3, 5, 5)  # (batch, pos, d) with d == pos
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[0, 3:] = 0
    scope = ActivationScope(store=tmp_path / "s.zarr", token_rows={"1.output": False},
                            reductions={"1.output": ["mean"]})
    with torch.no_grad(), scope.track(m) as t:
        t.set_batch(attention_mask=mask)
        m(x)
    s = open_store(tmp_path / "s.zarr")
    with torch.no_grad():
        ref = m[0](x)
    assert s.aliases == {}
    assert s.row_kind("0.output") == "token" and s.row_kind("1.output") == "sample"
    torch.testing.assert_close(s["0.output"][:], ref[mask.bool()], rtol=0, atol=0)
    torch.testing.assert_close(s["1.output"][:], ref, rtol=0, atol=0)
    torch.testing.assert_close(s.reductions["1.output"]["mean"], ref.double().mean(0))


class _SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h, h, h, need_weights=False)[0]


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h, h


@pytest.mark.parametrize("model", ["self_attention", "tuple"])
@pytest.mark.parametrize("to_store", [False, True])
def test_one_tensor_passed_or_returned_twice_is_captured_in_every_forward(tmp_path, model, to_store):
    # attn(h, h, h) and a tuple (h, h): several new hook points of one call are the same
    # tensor as one earlier hook point; every forward after the first was refused
    torch.manual_seed(0)
    m = _SelfAttention() if model == "self_attention" else _Twice()
    xs = [torch.randn(2, 5, 8) for _ in range(3)]
    ref, _ = plain_hooks(m, lambda: [m(x) for x in xs], [n for n, _ in m.named_modules()], side="both",
                         structured="leaves")
    scope = ActivationScope(capture="both", **({"store": tmp_path / "s.zarr"} if to_store else {}))
    with torch.no_grad(), scope.track(m, include=["*"]) as t:
        for x in xs:
            m(x)
    got = open_store(tmp_path / "s.zarr") if to_store else {k: torch.cat(v) for k, v in t.activations.items()}
    names = list(got.hook_points) if to_store else list(got)
    assert sorted(names) == sorted(ref)
    for name in names:
        torch.testing.assert_close(got[name][:], torch.cat(ref[name]), rtol=0, atol=0)


class _Router(torch.nn.Module):
    """Routes a batch through one of two experts by its sign (data-dependent routing): its
    output is expert 0's very tensor in one forward, expert 1's in another."""

    def __init__(self):
        super().__init__()
        self.e0, self.e1 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.e0(x) if x.mean() > 0 else self.e1(x)


@pytest.mark.parametrize("policy", ["store_all", "final_only"])
def test_in_memory_alias_of_a_branch_not_taken_keeps_its_own_records(policy):
    # '1.output' is kept as an alias of '1.e0.output' (the same tensor in the first forward);
    # forwards routed through e1 are not e0's tensor: each call is still recorded, as its own
    # record, and calls that are e0's tensor share e0's record (one copy of the bytes)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Identity(), _Router())
    xs = [torch.randn(3, 4) + s for s in (3, -3, 3, -3, -3)]
    with torch.no_grad(), ActivationScope(reduction_policy=policy, capture="output").track(m) as t:
        outs = [m(x).clone() for x in xs]
    assert t._aliases == {"1.output": "1.e0.output"}
    acts = t.activations
    if policy == "final_only":
        assert [len(v) for v in acts.values()] == [1, 1, 1, 1] and torch.equal(acts["1.output"][0], outs[-1])
        return
    assert len(acts["1.output"]) == 5 and all(torch.equal(r, o) for r, o in zip(acts["1.output"], outs))
    assert len(acts["1.e0.output"]) == 2 and len(acts["1.e1.output"]) == 3
    assert acts["1.output"][0].data_ptr() == acts["1.e0.output"][0].data_ptr()  # kept once
    assert acts["1.output"][2].data_ptr() == acts["1.e0.output"][1].data_ptr()
    assert acts["1.output"][1].data_ptr() != acts["1.e1.output"][0].data_ptr()  # its own copy
    assert torch.equal(acts["1.e1.output"][2], outs[4])


def test_store_alias_of_a_branch_not_taken_is_an_error_that_keeps_the_whole_forwards(tmp_path):
    # a store holds an alias as its target's array: a forward where it is not is refused
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Identity(), _Router())
    xs = [torch.randn(3, 4) + s for s in (3, 3, -3)]
    with pytest.raises(CaptureError, match=r"'1.output' is stored once, as an alias of '1.e0.output'.*exclude="), \
            pytest.warns(RuntimeWarning, match=r"'1.e1.output' was first captured in forward 2"):
        with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr", capture="output").track(m):
            for x in xs:
                m(x)
    s = open_store(tmp_path / "s.zarr")
    assert s.status == "incomplete" and s.n_rows("1.output") == 6
    with torch.no_grad():
        torch.testing.assert_close(s["1.output"][:], torch.cat([m[1](x) for x in xs[:2]]), rtol=0, atol=0)


class _Unrolled(torch.nn.Module):
    """Applies one cell a number of times that changes from forward to forward (an RNN over
    sequences of different lengths): the input of call k + 1 is the output of call k."""

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.Linear(4, 4)

    def forward(self, x, steps):
        for _ in range(steps):
            x = torch.tanh(self.cell(x))
        return x


def test_in_memory_aliases_of_a_loop_with_a_varying_step_count_record_every_call():
    torch.manual_seed(0)
    m = _Unrolled()
    runs = [(torch.randn(2, 4), steps) for steps in (3, 1, 2, 4)]
    with torch.no_grad(), ActivationScope(capture="both").track(m) as t:
        for x, steps in runs:
            m(x, steps)
    acts = t.activations
    expected: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for x, steps in runs:
            for k in range(steps):
                name = "cell" if k == 0 else f"cell#{k}"
                expected.setdefault(f"{name}.input.0", []).append(x)
                x = torch.tanh(m.cell(x))
                expected.setdefault(f"{name}.output", []).append(m.cell(expected[f"{name}.input.0"][-1]))
    for name, refs in expected.items():
        assert len(acts[name]) == len(refs), name
        for got, ref in zip(acts[name], refs):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_t5_generate_with_inputs_and_outputs_records_every_call():
    # the decoder's cross-attention computes its keys and values from the encoder's output
    # in the first step only (then they are cached): aliases made there stop pairing
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        expected = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        hidden = model.encoder(input_ids=ids).last_hidden_state
    # ("shared" is the embedding both stacks use through modules of their own: never called itself)
    with ActivationScope(capture="both").track(model, exclude=["shared"]) as t, torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, expected)
    acts = t.activations
    key = "decoder.block.1.layer.1.EncDecAttention"
    assert len(acts[f"{key}.k.input.0"]) >= 1
    assert all(torch.equal(r, hidden) for r in acts[f"{key}.k.input.0"])
    n_steps = len(acts["decoder.output.last_hidden_state"])
    assert n_steps == expected.shape[1] - 1
    assert len(acts[f"{key}.input.kw.key_value_states"]) == n_steps
    assert all(torch.equal(r, hidden) for r in acts[f"{key}.input.kw.key_value_states"])


def test_in_memory_alias_reductions_cover_every_call_paired_or_not():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Identity(), _Router())
    xs = [torch.randn(3, 4) + s for s in (3, -3, 3, -3)]
    with torch.no_grad(), ActivationScope(capture="output", reductions=["mean", "max"]).track(m) as t:
        outs = torch.cat([m(x) for x in xs])
    assert t._aliases == {"1.output": "1.e0.output"}
    red = t.reductions["1.output"]
    torch.testing.assert_close(red["mean"], outs.double().mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(red["max"], outs.double().max(0).values, rtol=0, atol=0)
    assert int(red["mean.count"]) == 12


@pytest.mark.parametrize("policy", ["store_all", "final_only"])
def test_store_capture_that_keeps_records_in_memory_keeps_the_aliases_records(tmp_path, policy):
    # store= with storage=CPU keeps every call in memory too: a hook point stored as an alias
    # has the same records as any other (its target's bytes, not copied), an empty batch's too
    m = _features()
    xs = [torch.randn(4, 6), torch.randn(0, 6), torch.randn(3, 6), torch.randn(5, 6)]
    scope = ActivationScope(store=tmp_path / "s.zarr", storage=StoragePolicy.CPU, capture="both",
                            reduction_policy=ReductionPolicy[policy.upper()])
    with torch.no_grad(), scope.track(m) as t:
        for x in xs:
            m(x)
    with torch.no_grad():
        hidden = [m[0](x) for x in xs]
        relu = [m[0][1](m[0][0](x)) for x in xs]
    kept = slice(None) if policy == "store_all" else slice(-1, None)
    acts = t.activations
    assert open_store(tmp_path / "s.zarr").aliases["0.output"] == "0.2.output"
    for name, expected in [("0.output", hidden), ("0.2.output", hidden), ("1.input.0", hidden),
                           ("0.2.input.0", relu), ("0.1.output", relu)]:
        assert len(acts[name]) == len(expected[kept]), name
        for got, want in zip(acts[name], expected[kept]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(acts["0.output"], acts["0.2.output"]):
        if a.numel():
            assert a.data_ptr() == b.data_ptr()
    stored = open_store(tmp_path / "s.zarr")
    torch.testing.assert_close(stored["0.output"][:], torch.cat(hidden), rtol=0, atol=0)


class _Complex(torch.nn.Module):
    def forward(self, x):
        return torch.complex(x, 2 * x)


class _Lazy(torch.nn.Module):
    """Returns a lazy view of its input: the same memory, read as other values."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return x.conj() if self.kind == "conj" else torch._neg_view(x)


@pytest.mark.parametrize("grad", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("kind", ["conj", "neg"])
@pytest.mark.parametrize("where", ["memory", "store"])
def test_a_conjugate_or_negative_view_of_the_previous_output_is_not_an_alias(tmp_path, grad, kind, where):
    # x.conj() has x's storage, offset, shape, strides and dtype, but other values
    torch.manual_seed(0)
    first = _Complex() if kind == "conj" else torch.nn.Linear(3, 3)
    m = torch.nn.Sequential(first, _Lazy(kind))
    xs = [torch.randn(2, 3) for _ in range(3)]
    ctx = torch.no_grad if grad == "no_grad" else torch.inference_mode
    with ctx():
        expected = [m(x).resolve_conj().resolve_neg() for x in xs]
        scope = ActivationScope(store=tmp_path / "s.zarr") if where == "store" else ActivationScope()
        with scope.track(m) as t:
            for x in xs:
                m(x)
    if where == "store":
        s = open_store(tmp_path / "s.zarr")
        assert "1.output" not in s.aliases
        torch.testing.assert_close(s["1.output"][:], torch.cat(expected), rtol=0, atol=0)
    else:
        recs = t.activations["1.output"]
        assert len(recs) == 3
        for got, want in zip(recs, expected):
            torch.testing.assert_close(got.resolve_conj().resolve_neg(), want, rtol=0, atol=0)


@pytest.mark.parametrize("capture", ["output", "input"])
def test_a_refused_store_alias_says_which_call_and_that_the_whole_forwards_are_kept(tmp_path, capture):
    # output: '1.output' is another tensor than '1.e0.output' (the C++ check of each call);
    # input: '1.e0.input.0' is not called at all (the check after the forward)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Identity(), _Router())
    xs = [torch.randn(3, 4) + s for s in (3, 3, -3)]
    alias, target = ("1.output", "1.e0.output") if capture == "output" else ("1.e0.input.0", "1.input.0")
    if capture == "input":  # ('1.input.0' would be the alias of the Identity's input)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), _Router())
        m[0].weight.data.copy_(torch.eye(4))
        m[0].bias.data.zero_()
    where = "its call 3 (counting from 1)" if capture == "output" else "forward 2"
    with pytest.raises(CaptureError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), ActivationScope(store=tmp_path / "s.zarr", capture=capture).track(m):
            for x in xs:
                m(x)
    message = str(info.value)
    assert f"{alias!r} is stored once, as an alias of {target!r}" in message
    assert where in message and "The store keeps every forward before this one" in message
    if capture == "input":
        assert "was not called, or returned no tensor" in message
    s = open_store(tmp_path / "s.zarr")
    assert s.status == "incomplete" and s.n_rows(alias) == 6 and s.n_rows(target) == 6
