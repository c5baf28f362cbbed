"""Researchers' workflows end to end, each against plain PyTorch forward hooks: capture under
``torch.autocast``, a training loop (dropout, backward, optimizer steps), ``no_grad`` /
``inference_mode`` forwards of a float16 / bfloat16 model, and ``generate()`` of a decoder
with a key-value cache."""

from __future__ import annotations

import gc
import os
import re
import warnings
from typing import Optional

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import activationscope as acs
from activationscope.errors import ArgumentValueError

from acs_testing import plain_hooks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = [acs.CaptureMode.SNAPSHOT, acs.CaptureMode.REFERENCE]
STATS = ["mean", "var", "min", "max"]


def _mlp(dtype=torch.float32, dropout=0.0):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(dropout), torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 4),
    ).to(dtype)


def _hooked(model, run, names=None):
    """``run()`` with a plain forward hook on each child of ``model`` (or each module in
    ``names``), recording a detached copy of its output: ``({hook point: [Tensor]}, result)``."""
    names = names if names is not None else [n for n, _ in model.named_children()]
    return plain_hooks(model, run, names, structured="first", grad=True)


def _assert_records_equal(got, expected):
    assert sorted(got) == sorted(expected)
    for name, refs in expected.items():
        assert len(got[name]) == len(refs), name
        for a, b in zip(got[name], refs):
            assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype)
            assert torch.equal(a, b), name


def _assert_stats(red, rows):
    """Reductions against float64 statistics of the very rows recorded."""
    v = rows.double().reshape(-1, *rows.shape[1:])
    torch.testing.assert_close(red["mean"], v.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(red["var"], v.var(0, unbiased=False), rtol=1e-9, atol=1e-12)
    assert torch.equal(red["min"].double(), v.min(0).values)
    assert torch.equal(red["max"].double(), v.max(0).values)


# ---------------------------------------------------------------------- torch.autocast


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
def test_autocast_bf16_records_and_reductions_equal_plain_hooks(mode, grad):
    model = _mlp().eval()
    xs = [torch.randn(5, 8) + i for i in range(3)]

    def run():
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            return [model(x) for x in xs]

    expected, outs = _hooked(model, run)
    assert expected["0.output"][0].dtype == torch.bfloat16  # the autocast op's dtype, not the module's
    with acs.ActivationScope(capture_mode=mode, reductions=STATS).track(model) as tracker:
        got_outs = run()
    _assert_records_equal(tracker.activations, expected)
    assert all(torch.equal(a, b) for a, b in zip(got_outs, outs))
    for name, refs in expected.items():
        _assert_stats(tracker.reductions[name], torch.cat(refs))


def test_autocast_bf16_into_a_store_is_bit_exact_with_its_dtype(tmp_path):
    model = _mlp().eval()
    xs = [torch.randn(5, 8) * (i + 1) for i in range(3)]

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return [model(x) for x in xs]

    expected, _ = _hooked(model, run)
    path = tmp_path / "autocast.zarr"
    with acs.ActivationScope(store=path, reductions=STATS).track(model):
        run()
    store = acs.open_store(path)
    for name, refs in expected.items():
        rows = torch.cat(refs)
        assert store[name].dtype == rows.dtype and torch.equal(store[name], rows), name
        _assert_stats(store.reductions[name], rows)
    batch = next(iter(torch.utils.data.DataLoader(acs.ActivationDataset(path, hook_points=["0.output"]),
                                                  batch_size=15)))
    assert batch["0.output"].dtype == torch.bfloat16 and torch.equal(batch["0.output"], torch.cat(expected["0.output"]))


def test_autocast_switched_on_mid_capture_is_refused_in_a_store_not_cast(tmp_path):
    # float32 rows first, then bf16 rows of the same hook point: one dtype per array
    model = _mlp().eval()
    path = tmp_path / "mixed.zarr"
    with pytest.raises(acs.CaptureError, match="'0.output'"):
        with torch.no_grad(), acs.ActivationScope(store=path).track(model, include=["0"]):
            model(torch.randn(5, 8))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.randn(5, 8))
    store = acs.open_store(path)
    assert store["0.output"].dtype == torch.float32 and store["0.output"].shape == (5, 16)


def _gram(acc: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    g = x.t() @ x
    if acc is None:
        return g
    return acc + g


class _Scale(torch.nn.Module):
    def forward(self, x):
        return x * 2  # (not an autocast op: float32 rows under a bf16 autocast too)


@pytest.mark.filterwarnings(r"ignore:custom reduction\(s\) with a half-precision accumulator")
@pytest.mark.parametrize("store", [False, True], ids=["memory", "store"])
def test_custom_reductions_of_forwards_under_autocast_equal_those_of_the_rows_outside_it(tmp_path, store):
    """A custom reduction runs inside the model's forward: under its autocast the gram matrix of
    float32 rows was computed in bfloat16 (a bf16 accumulator where make_reduction on the same rows
    gives float32), and a bf16 hook point's second batch was refused (TorchScript's executor
    specialises on the autocast state). Now it is the offline reduction of the captured rows."""
    from activationscope.reductions import make_reduction

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Scale(), torch.nn.Linear(8, 8))
    xs = [torch.randn(16, 8) for _ in range(3)]
    path = tmp_path / "gram.zarr" if store else None
    with acs.ActivationScope(store=path, reductions=[("gram", _gram)]).track(model) as tracker:
        for x in xs:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
    for name, dtype in (("0.output", torch.float32), ("1.output", torch.bfloat16)):
        rows = acs.open_store(path)[name][:] if store else torch.cat(tracker.activations[name])
        got = (acs.open_store(path).reductions if store else tracker.reductions)[name]["gram"]
        offline = make_reduction(_gram)
        for part in rows.split(16):
            offline.update(part)
        assert rows.dtype == dtype and got.dtype == dtype, (name, got.dtype)
        assert torch.equal(got, offline.result()["value"]), name


def test_a_resume_outside_the_autocast_of_the_stored_forwards_is_refused_naming_the_autocast(tmp_path):
    """A store captured under autocast (bf16 arrays) resumed without it (float32 rows), with the
    same model and options: refused naming both dtypes and the autocast (it said only "resume
    with the same model and options"), the stored rows kept; the resume under the same autocast
    appends."""
    model = _mlp().eval()
    xs = [torch.randn(5, 8) + i for i in range(3)]
    path = tmp_path / "autocast.zarr"

    def run(x):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    with acs.ActivationScope(store=path).track(model, include=["0"]):
        run(xs[0])
    with pytest.raises(acs.StoreError, match=r"'0\.output'.*now give float32 where the stored ones gave bfloat16.*"
                                              r"torch\.autocast"):
        with torch.no_grad(), acs.ActivationScope(store=path, store_options={"resume": True}).track(model, include=["0"]):
            model(xs[1])
    store = acs.open_store(path)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        first = model[0](xs[0])
        second = model[0](xs[2])
    assert store["0.output"].dtype == torch.bfloat16 and torch.equal(store["0.output"][:], first)
    with acs.ActivationScope(store=path, store_options={"resume": True}).track(model, include=["0"]):
        run(xs[2])
    assert torch.equal(acs.open_store(path)["0.output"][:], torch.cat([first, second]))


# ---------------------------------------------------------------------- training loop


def _train(model, steps, capture=None):
    """A few steps of training with dropout: ``(losses, grads per step)``; the model's
    parameters are trained in place."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, 16, 8, generator=g), torch.randn(steps, 16, 4, generator=g)
    model.train()
    torch.manual_seed(2)  # dropout masks
    losses, grads = [], []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        losses.append(loss.detach())
        opt.step()
    return losses, grads


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
def test_training_loop_under_capture_trains_bit_identically_and_records_plain_hook_values(mode):
    plain = _mlp(dropout=0.5)
    losses, grads = _train(plain, 4)
    hooked = _mlp(dropout=0.5)
    expected, _ = _hooked(hooked, lambda: _train(hooked, 4))
    model = _mlp(dropout=0.5)
    with acs.ActivationScope(capture_mode=mode, reductions=["mean"]).track(model) as tracker:
        got_losses, got_grads = _train(model, 4)
    assert all(torch.equal(a, b) for a, b in zip(got_losses, losses))
    for step_a, step_b in zip(got_grads, grads):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b))
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    _assert_records_equal(tracker.activations, expected)
    # dropout zeroed about half of its inputs: the records are the training forward's
    assert 0.3 < float((tracker.activations["2.output"][0] == 0).float().mean()) < 0.7
    for rec in tracker.activations["0.output"]:
        assert not rec.requires_grad and rec.grad_fn is None
    torch.testing.assert_close(tracker.reductions["4.output"]["mean"],
                               torch.cat(expected["4.output"]).double().mean(0), rtol=1e-12, atol=1e-12)


def test_training_loop_into_a_store_keeps_the_training_forward_values(tmp_path):
    hooked = _mlp(dropout=0.5)
    expected, _ = _hooked(hooked, lambda: _train(hooked, 3))
    model = _mlp(dropout=0.5)
    path = tmp_path / "train.zarr"
    with acs.ActivationScope(store=path, reductions=["mean"]).track(model, include=["2", "4"]):
        _train(model, 3)
    store = acs.open_store(path)
    for name in ("2.output", "4.output"):
        assert torch.equal(store[name], torch.cat(expected[name])), name


def _saved_storages(model, run):
    """Run ``run()`` with autograd's saved tensors noted (weakly, parameters left out):
    the :class:`StorageWeakRef` of each, per call of ``run``."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[StorageWeakRef] = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(StorageWeakRef(t.untyped_storage()))
        return t.detach()  # (the tensor itself would make a cycle through its grad_fn)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return saved


@pytest.mark.parametrize("clear", [False, True], ids=["kept", "cleared"])
def test_reference_records_with_grad_keep_no_graph_alive(clear):
    """REFERENCE records hold the storage of the captured tensors only: the rest of each
    forward's graph (its other saved tensors) is freed with the model's output, backward or
    not; records dropped with ``clear()`` free those too, so memory stays flat."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    per_step = []
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE)
    with scope.track(model, include=["1"]) as tracker:
        for i in range(6):
            def step():
                out = model(torch.randn(64, 8))
                if i % 2 == 0:  # backward on some steps only: the others just drop the output
                    out.sum().backward()
                    opt.step()
                    opt.zero_grad()
            saved = _saved_storages(model, step)
            gc.collect()
            per_step.append(saved)
            if clear:
                tracker.clear()
        # Linear 0 saves its input, Tanh and Linear 2 its output (the record's storage)
        assert all(len(s) == 3 for s in per_step)
        for s in per_step:
            assert s[0].expired()  # the input: part of the graph only
            assert s[1].expired() == clear and s[2].expired() == clear
        assert len(tracker.activations["1.output"]) == (0 if clear else 6)


def test_reference_streaming_capture_with_grad_keeps_nothing_over_many_steps():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    scope = acs.ActivationScope(capture_mode=acs.CaptureMode.REFERENCE, reductions=["mean"],
                                reduction_policy=acs.ReductionPolicy.STREAMING)
    saved = []
    with scope.track(model) as tracker:
        for _ in range(50):
            saved += _saved_storages(model, lambda: model(torch.randn(16, 8)).sum().backward())
        gc.collect()
        assert saved and all(s.expired() for s in saved)
        assert tracker.activations["1.output"] == []
        assert int(tracker.reductions["1.output"]["mean.count"]) == 50 * 16


# ---------------------------------------------------------------------- no_grad / inference_mode, half models


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_model_into_a_store_and_back_through_the_dataset(tmp_path, dtype, context, mode):
    model = _mlp(dtype).eval()
    xs = [(torch.randn(5, 8) * (i + 1)).to(dtype) for i in range(3)]

    def run():
        with context():
            return [model(x) for x in xs]

    expected, _ = _hooked(model, run)
    with acs.ActivationScope(capture_mode=mode, reductions=STATS).track(model) as tracker:
        run()
    _assert_records_equal(tracker.activations, expected)
    assert not any(r.is_inference() for rs in tracker.activations.values() for r in rs)
    path = tmp_path / "half.zarr"
    with acs.ActivationScope(store=path, capture_mode=mode, reductions=STATS).track(model) as tracker:
        for i, x in enumerate(xs):
            tracker.set_batch(sample_ids=range(5 * i, 5 * i + 5))
            with context():
                model(x)
    store = acs.open_store(path)
    ds = acs.ActivationDataset(path, hook_points=list(expected), columns=["sample_id"])
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=15)))
    assert torch.equal(batch["sample_id"], torch.arange(15))
    for name, refs in expected.items():
        rows = torch.cat(refs)
        assert store[name].dtype == dtype and torch.equal(store[name], rows), name
        assert batch[name].dtype == dtype and torch.equal(batch[name], rows), name
        _assert_stats(store.reductions[name], rows)


# ---------------------------------------------------------------------- generate() with a key-value cache

BLOCKS = ["transformer.h.0", "transformer.h.1"]


def _gpt2():
    """A small random GPT-2 (no download) and a left-padded prompt: sample 0 has 2 pad tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=49)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(2, 48, (3, 4))
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = 0, 0
    return model, ids, mask


def _generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)


def _by_block(records):
    """Records keyed by block (``transformer.h.0``), whatever the hook point's leaf name."""
    return {b: records[next(k for k in records if k.startswith(b + ".output"))] for b in BLOCKS}


def test_generate_in_memory_records_every_step_as_plain_hooks_and_generates_the_same():
    model, ids, mask = _gpt2()
    expected, out = _hooked(model, lambda: _generate(model, ids, mask), names=BLOCKS)
    expected = {f"{b}.output": v for b, v in _by_block(expected).items()}
    assert [tuple(r.shape) for r in expected["transformer.h.0.output"]] == [(3, 4, 16)] + [(3, 1, 16)] * 4
    with acs.ActivationScope().track(model, include=["transformer.h.?"]) as tracker:
        tracker.set_batch(attention_mask=mask)  # no effect on records kept whole
        got = _generate(model, ids, mask)
    assert torch.equal(got, out)
    _assert_records_equal({f"{b}.output": v for b, v in _by_block(tracker.activations).items()}, expected)


def test_generate_into_a_store_with_token_rows_keeps_the_samples_ids_at_every_step(tmp_path):
    model, ids, _ = _gpt2()
    ids[0, :2] = 7  # no padding: every position is a token
    expected, out = _hooked(model, lambda: _generate(model, ids, None), names=BLOCKS)
    path = tmp_path / "gen.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with acs.ActivationScope(store=path, rows="token", reductions=["mean"]).track(
                model, include=["transformer.h.?"]) as tracker:
            tracker.set_batch(sample_ids=[10, 11, 12])  # sticky: every step's forward is these samples
            got = _generate(model, ids, None)
    assert torch.equal(got, out)
    store = acs.open_store(path)
    for block, refs in _by_block(expected).items():
        (name,) = [h for h in store.hook_points if h.startswith(block + ".output")]
        rows = torch.cat([r.reshape(-1, 16) for r in refs])
        assert store.row_kind(name) == "token" and torch.equal(store[name], rows)
        torch.testing.assert_close(store.reductions[name]["mean"], rows.double().mean(0), rtol=1e-12, atol=1e-12)
    table = store.row_table("token")
    assert table.column("sample_id").to_pylist() == [10] * 4 + [11] * 4 + [12] * 4 + [10, 11, 12] * 4
    assert table.column("batch").to_pylist() == [0] * 12 + [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]


def test_generate_with_the_prompts_mask_only_refuses_the_cached_steps_and_keeps_the_prompt(tmp_path):
    """The mask given for the prompt (batch, pos) cannot describe the (batch, 1) forwards of
    the later steps: the capture says so and how to describe them, rather than guess."""
    model, ids, mask = _gpt2()
    expected, _ = _hooked(model, lambda: _generate(model, ids, mask), names=BLOCKS)
    path = tmp_path / "gen.zarr"
    with pytest.raises(acs.CaptureError, match=r"got activation \(3, 1, 16\) and mask \(3, 4\)") as info:
        with acs.ActivationScope(store=path).track(model, include=["transformer.h.?"]) as tracker:
            tracker.set_batch(attention_mask=mask)
            _generate(model, ids, mask)
    assert "generate()" in str(info.value) and "same_samples=True" in str(info.value)
    store = acs.open_store(path)
    assert store.status == "incomplete"
    for block, refs in _by_block(expected).items():
        (name,) = [h for h in store.hook_points if h.startswith(block + ".output")]
        assert torch.equal(store[name], refs[0][mask.bool()])  # the prompt's real tokens only


def _describe_each_step(model, tracker, **columns):
    """A forward pre-hook that describes each step of generate() after the prompt: the new
    token's column of the mask generate() passes, the same samples again."""

    def describe(module, args, kwargs):
        n = kwargs["input_ids"].shape[1]
        if n < kwargs["attention_mask"].shape[1]:  # the cache holds the earlier tokens
            tracker.set_batch(attention_mask=kwargs["attention_mask"][:, -n:], same_samples=True, **columns)

    return model.register_forward_pre_hook(describe, with_kwargs=True)


def _generate_into_store(model, path, gen, *, prompt: dict, each_step: dict, reductions=None):
    """Run ``gen()`` (a ``generate()`` of ``model``) captured into the store at ``path``: its
    first forward described by ``set_batch(**prompt)``, each later step by
    :func:`_describe_each_step` with ``each_step`` columns; a CaptureWarning fails the test.
    Returns ``gen()``'s result."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", acs.CaptureWarning)
        with acs.ActivationScope(store=path, reductions=reductions).track(
                model, include=["transformer.h.?"]) as tracker:
            tracker.set_batch(**prompt)
            handle = _describe_each_step(model, tracker, **each_step)
            try:
                return gen()
            finally:
                handle.remove()


def _stored_steps(store, expected, mask):
    """Per block: ``(its hook point in store, its records in expected, the rows the store must
    hold)``: the prompt's tokens where ``mask`` is 1, then each later step's new token."""
    for block, refs in _by_block(expected).items():
        (name,) = [h for h in store.hook_points if h.startswith(block + ".output")]
        yield name, refs, torch.cat([refs[0][mask.bool()]] + [r[:, 0] for r in refs[1:]])


@pytest.mark.parametrize("given_ids", [True, False], ids=["ids", "counted"])
def test_generate_with_a_mask_per_step_stores_the_prompt_tokens_and_every_new_token(tmp_path, given_ids):
    model, ids, mask = _gpt2()
    expected, out = _hooked(model, lambda: _generate(model, ids, mask), names=BLOCKS)
    path = tmp_path / "gen.zarr"
    sample_ids = [10, 11, 12] if given_ids else [0, 1, 2]
    got = _generate_into_store(model, path, lambda: _generate(model, ids, mask), reductions=["mean"],
                               prompt={"attention_mask": mask, "label": [0, 1, 0],
                                       **({"sample_ids": sample_ids} if given_ids else {})},
                               each_step={"label": [0, 1, 0]})
    assert torch.equal(got, out)
    store = acs.open_store(path)
    for name, _, rows in _stored_steps(store, expected, mask):
        assert store.row_kind(name) == "token" and torch.equal(store[name], rows)
        torch.testing.assert_close(store.reductions[name]["mean"], rows.double().mean(0), rtol=1e-12, atol=1e-12)
    a, b, c = sample_ids
    table = store.row_table("token")
    assert table.column("sample_id").to_pylist() == [a] * 2 + [b] * 4 + [c] * 4 + [a, b, c] * 4
    assert table.column("pos").to_pylist()[:10] == [2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    samples = store.row_table("sample")
    assert samples.column("sample_id").to_pylist() == sample_ids * 5
    assert samples.column("label").to_pylist() == [0, 1, 0] * 5


@pytest.mark.parametrize("generate_kwargs", [{"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}],
                         ids=["beams", "return_sequences"])
def test_generate_with_two_rows_per_prompt_is_refused_for_one_row_each_and_stored_for_repeated_ones(
        tmp_path, generate_kwargs):
    """generate() with num_beams= or num_return_sequences= runs batch * k rows from the prompt on:
    a description of the prompts is refused (saying so), never stored under other samples' ids;
    one of every row (its own id, the prompt's as a column) stores every row as plain hooks see it."""
    model, ids, mask = _gpt2()
    kwargs = {"max_new_tokens": 3, **generate_kwargs}

    def gen():
        torch.manual_seed(1)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, **kwargs)

    path = tmp_path / "gen.zarr"
    with pytest.raises(ArgumentValueError, match=r"describes 3 samples, but the forward's batch has 6") as info:
        with acs.ActivationScope(store=path).track(model, include=["transformer.h.?"]) as tracker:
            tracker.set_batch(attention_mask=mask, sample_ids=[10, 11, 12])
            gen()
    assert "2 times the samples described" in str(info.value) and "prompt=ids.repeat_interleave(k)" in str(info.value)
    assert not path.exists()

    expected, out = _hooked(model, gen, names=BLOCKS)
    prompt = torch.tensor([10, 11, 12]).repeat_interleave(2)
    got = _generate_into_store(model, path, gen, each_step={"prompt": prompt}, prompt={
        "attention_mask": mask.repeat_interleave(2, 0), "sample_ids": range(6), "prompt": prompt})
    assert torch.equal(got, out)
    store = acs.open_store(path)
    for name, refs, rows in _stored_steps(store, expected, mask.repeat_interleave(2, 0)):
        assert [tuple(r.shape) for r in refs] == [(6, 4, 16), (6, 1, 16), (6, 1, 16)]
        assert torch.equal(store[name], rows)
    table = store.row_table("sample")
    assert table.column("sample_id").to_pylist() == list(range(6)) * 3
    assert table.column("prompt").to_pylist() == [10, 10, 11, 11, 12, 12] * 3
    assert store.row_table("token").column("sample_id").to_pylist() == [0, 0, 1, 1] + [2] * 4 + [3] * 4 + [4] * 4 \
        + [5] * 4 + list(range(6)) * 2


def test_same_samples_needs_a_captured_forward_before_it_and_takes_no_ids():
    model = _mlp().eval()
    with acs.ActivationScope().track(model, include=["0"]) as tracker:
        with pytest.raises(ArgumentValueError, match="no forward was captured yet"):
            tracker.set_batch(same_samples=True)
        with torch.no_grad():
            model(torch.randn(2, 8))
        with pytest.raises(ArgumentValueError, match="sample_ids= as well"):
            tracker.set_batch(sample_ids=[0, 1], same_samples=True)
        tracker.set_batch(same_samples=True)
        with torch.no_grad():
            model(torch.randn(2, 8))
        with pytest.raises(ArgumentValueError, match="describes 2 samples, but the forward's batch has 3"):
            with torch.no_grad():
                model(torch.randn(3, 8))


@pytest.mark.parametrize("flag", ["False", "no", 1, None])
def test_same_samples_must_be_a_bool(tmp_path, flag):
    # same_samples="False" (from a config file) is a true string: taken as a flag, the next forward
    # would store its rows under the last forward's ids. Refused, naming the argument; nothing changes
    model = _mlp().eval()
    path = tmp_path / "flag.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path).track(model, include=["0"]) as tracker:
        tracker.set_batch(sample_ids=[4, 5])
        model(torch.randn(2, 8))
        with pytest.raises(acs.errors.ArgumentTypeError,
                           match=rf"same_samples must be True or False, got {re.escape(repr(flag))}"):
            tracker.set_batch(same_samples=flag)
        tracker.set_batch()  # (a description of new samples: counted on)
        model(torch.randn(2, 8))
    assert acs.open_store(path).row_table().column("sample_id").to_pylist() == [4, 5, 2, 3]


def test_same_samples_takes_the_ids_as_they_were_at_the_forward(tmp_path):
    # a sample-id tensor refilled for the next batch does not change the ids continued
    model = _mlp().eval()
    ids = torch.tensor([4, 5])
    path = tmp_path / "ids.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path).track(model, include=["0"]) as tracker:
        tracker.set_batch(sample_ids=ids)
        model(torch.randn(2, 8))
        ids.copy_(torch.tensor([6, 7]))
        tracker.set_batch(same_samples=True)
        model(torch.randn(2, 8))
        tracker.set_batch(sample_ids=ids)
        model(torch.randn(2, 8))
    assert acs.open_store(path).row_table().column("sample_id").to_pylist() == [4, 5, 4, 5, 6, 7]


@pytest.mark.parametrize("policy", [{}, {"capture_policy": acs.CapturePolicy.SAMPLE_N, "sample_every": 2}])
def test_same_samples_forwards_do_not_advance_the_running_counter(tmp_path, policy):
    # counted ids are the samples' places in the data: the generation steps of prompts 0..2
    # (captured or skipped) feed no new sample, so the next prompts are 3..5, not 9..11
    model = _mlp().eval()
    path = tmp_path / "counter.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, **policy).track(model, include=["0"]) as tracker:
        for _ in range(2):                     # two "prompt batches" of 3, each with 3 steps
            tracker.set_batch()
            model(torch.randn(3, 8))
            for _ in range(3):
                tracker.set_batch(same_samples=True)
                model(torch.randn(3, 8))
    ids = acs.open_store(path).row_table("sample").column("sample_id").to_pylist()
    # every forward stored: 8 forwards of 3; SAMPLE_N: forwards 0, 2, 4, 6 (prompt, step 2, prompt, step 2)
    assert ids == ([0, 1, 2] * 4 + [3, 4, 5] * 4 if not policy else [0, 1, 2] * 2 + [3, 4, 5] * 2)


@pytest.mark.parametrize("given_ids", [False, True], ids=["counted", "given"])
def test_same_samples_after_a_skipped_forward_continues_its_samples(tmp_path, given_ids):
    # SAMPLE_N (every 2nd forward) over prompt batches of 3 forwards (the prompt, 2 steps): the
    # second prompt's forward (3) is skipped and its first step (4) captured; that step's rows
    # are the second prompt's samples, never stored under the first prompt's ids
    model = _mlp().eval()
    path = tmp_path / "skipped.zarr"
    prompts = [[10, 11, 12], [20, 21, 22]] if given_ids else [None, None]
    with torch.no_grad(), acs.ActivationScope(store=path, capture_policy=acs.CapturePolicy.SAMPLE_N,
                                              sample_every=2).track(model, include=["0"]) as tracker:
        for ids in prompts:
            tracker.set_batch(**({"sample_ids": ids} if ids else {}))
            model(torch.randn(3, 8))
            for _ in range(2):
                tracker.set_batch(same_samples=True)
                model(torch.randn(3, 8))
    first, second = prompts if given_ids else ([0, 1, 2], [3, 4, 5])
    # forwards 0 (prompt 1), 2 (its second step), 4 (the first step of prompt 2)
    assert acs.open_store(path).row_table("sample").column("sample_id").to_pylist() == first * 2 + second


def test_same_samples_then_counted_ids_in_a_memory_store_continue_the_data_counter():
    # the counted ids same_samples continues: after the steps, a new batch's
    # forward and a same_samples step of it take its own ids
    model = _mlp().eval()
    path = "memory://counter_same_samples"
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"overwrite": True}).track(
            model, include=["0"]) as tracker:
        model(torch.randn(2, 8))
        tracker.set_batch(same_samples=True)
        model(torch.randn(2, 8))
        tracker.set_batch()
        model(torch.randn(2, 8))
        tracker.set_batch(same_samples=True)
        model(torch.randn(2, 8))
    assert acs.open_store(path).row_table("sample").column("sample_id").to_pylist() == [0, 1, 0, 1, 2, 3, 2, 3]


def _generate_batches(model, path, batches, store_options, stop_after=None, ids=None):
    """generate() over prompt batches of 2 into a store, each step after the prompt described
    by a pre-hook with ``same_samples=True``; skips the batches a resume already holds and,
    with ``stop_after``, stops (KeyboardInterrupt) before that batch. Returns ``resume_from``."""
    tracker = acs.ActivationScope(store=path, store_options=store_options).track(model, include=["transformer.h.?"])
    with tracker:
        for i in range(tracker.resume_from // 2, len(batches)):
            if i == stop_after:
                raise KeyboardInterrupt
            prompt, mask = batches[i]
            tracker.set_batch(attention_mask=mask, **({"sample_ids": ids[i]} if ids else {}))
            handle = _describe_each_step(model, tracker)
            try:
                _generate(model, prompt, mask)
            finally:
                handle.remove()
    return tracker.resume_from


@pytest.mark.parametrize("given_ids", [False, True], ids=["counted", "given"])
def test_generate_killed_between_prompts_and_resumed_stores_what_an_uninterrupted_run_does(tmp_path, given_ids):
    # each prompt batch of 2 stores 5 forwards (the prompt, 4 steps): 10 sample rows of 2
    # samples. The resume skips 4 samples of the data (not 20) and numbers on from 4
    model, ids, mask = _gpt2()
    batches = [(ids[r], mask[r]) for r in ([0, 1], [2, 0], [0, 2])]  # (each padded: generate() passes a mask)
    given = [[10, 11], [12, 13], [14, 15]] if given_ids else None
    ref, path = tmp_path / "ref.zarr", tmp_path / "gen.zarr"
    assert _generate_batches(model, ref, batches, {}, ids=given) == 0
    with pytest.raises(KeyboardInterrupt):
        _generate_batches(model, path, batches, {}, stop_after=2, ids=given)
    assert acs.open_store(path).n_samples == 20
    assert _generate_batches(model, path, batches, {"resume": True}, ids=given) == 4
    got, want = acs.open_store(path), acs.open_store(ref)
    samples = [i for b in (given or [[0, 1], [2, 3], [4, 5]]) for i in b * 5]
    assert want.row_table("sample").column("sample_id").to_pylist() == samples
    assert got.row_table("sample").column("sample_id").to_pylist() == samples
    for kind in ("sample", "token"):
        for column in ("sample_id", "pos", "batch") if kind == "token" else ("sample_id", "batch"):
            assert got.row_table(kind).column(column).to_pylist() == want.row_table(kind).column(column).to_pylist()
    assert got.status == "complete" and got.attrs["next_sample_id"] == 6
    assert got.hook_points == want.hook_points
    for hp in want.hook_points:
        assert torch.equal(got[hp], want[hp]), hp


class _Failing(torch.nn.Module):
    """Two linear layers on (batch, pos, 8) tokens; ``fail`` makes the forward raise between them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.fail = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), False

    def forward(self, x):
        x = self.a(x)
        if self.fail:
            raise RuntimeError("boom")
        return self.b(x)


def _raise_in_model(model, tracker, ids):
    tracker.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool), **ids)
    model.fail = True
    try:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 3, 8))
    finally:
        model.fail = False


def _raise_at_a_hook_point(model, tracker, ids):
    tracker.set_batch(attention_mask=torch.ones(2, 4, dtype=torch.bool), **ids)  # the prompt's mask: (2, 4)
    with pytest.raises(acs.CaptureError, match=r"got activation \(2, 3, 8\) and mask \(2, 4\)"):
        model(torch.randn(2, 3, 8))


@pytest.mark.parametrize("given_ids", [False, True], ids=["counted", "given"])
@pytest.mark.parametrize(("store", "fail"), [(True, _raise_in_model), (True, _raise_at_a_hook_point),
                                             (False, _raise_in_model)],  # (in memory a mask checks no record)
                         ids=["store-model", "store-hook_point", "memory-model"])
def test_same_samples_after_a_forward_that_raised_is_refused_and_its_retry_is_continued(
        tmp_path, fail, given_ids, store):
    # the failed forward described new samples and recorded none of them: its steps have no ids
    # to take (the last recorded forward's are other samples'), so same_samples=True is refused
    # naming it; the batch run again is recorded and its steps continue its ids
    model = _Failing().eval()
    path = tmp_path / "failed.zarr"
    first, second = ({"sample_ids": [10, 11]}, {"sample_ids": [20, 21]}) if given_ids else ({}, {})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", acs.CaptureWarning)  # (the partial forward's, tested elsewhere)
        with acs.ActivationScope(**({"store": path} if store else {})).track(model, include=["a", "b"]) as tracker:
            tracker.set_batch(attention_mask=torch.ones(2, 4, dtype=torch.bool), **first)
            model(torch.randn(2, 4, 8))
            fail(model, tracker, second)
            with pytest.raises(ArgumentValueError, match=r"forward 1 of the tracked model\) raised before its "
                                                         r"samples were recorded") as info:
                tracker.set_batch(same_samples=True)
            assert "Run that batch's first forward again" in str(info.value)
            tracker.set_batch(attention_mask=torch.ones(2, 3, dtype=torch.bool), **second)  # the retry
            model(torch.randn(2, 3, 8))
            tracker.set_batch(attention_mask=torch.ones(2, 1, dtype=torch.bool), same_samples=True)
            model(torch.randn(2, 1, 8))
            tracker.set_batch(attention_mask=torch.ones(2, 1, dtype=torch.bool))
            model(torch.randn(2, 1, 8))
    if not store:  # (the failed forward raised before b)
        assert [tuple(r.shape) for r in tracker.activations["b.output"]] == [(2, 4, 4), (2, 3, 4), (2, 1, 4), (2, 1, 4)]
    else:
        a, b = ([10, 11], [20, 21]) if given_ids else ([0, 1], [2, 3])
        table = acs.open_store(path).row_table("sample")
        assert table.column("sample_id").to_pylist() == a + b + b + [4, 5]
        assert table.column("batch").to_pylist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_same_samples_after_a_step_that_raised_continues_its_prompts_samples(tmp_path):
    # a step described with same_samples=True that raised continued samples already recorded:
    # the next step continues them too
    model = _Failing().eval()
    path = tmp_path / "step.zarr"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", acs.CaptureWarning)
        with acs.ActivationScope(store=path).track(model, include=["a", "b"]) as tracker:
            tracker.set_batch(sample_ids=[10, 11])
            model(torch.randn(2, 8))
            tracker.set_batch(same_samples=True)
            model.fail = True
            with pytest.raises(RuntimeError, match="boom"):
                model(torch.randn(2, 8))
            model.fail = False
            tracker.set_batch(same_samples=True)
            model(torch.randn(2, 8))
            tracker.set_batch()
            model(torch.randn(2, 8))
    assert acs.open_store(path).row_table("sample").column("sample_id").to_pylist() == [10, 11, 10, 11, 2, 3]


class _Skippable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.skip_a = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), False

    def forward(self, x):
        return self.b(x if self.skip_a else self.a(x))


@pytest.mark.parametrize("case", ["no_hook_point", "stop_after_last", "given_ids", "policy_skipped"])
def test_same_samples_continues_a_forward_that_recorded_its_samples(tmp_path, case):
    # the forward before the step recorded its samples (with no row of the tracked hook point,
    # cut short by stop_after_last, with ids given, or skipped by the capture policy, whose
    # samples are counted): the step takes its ids, and the next batch is counted on after it
    model = _Skippable().eval()
    path = tmp_path / f"{case}.zarr"
    options = {"stop_after_last": True} if case == "stop_after_last" else \
        {"capture_policy": acs.CapturePolicy.SAMPLE_N, "sample_every": 2} if case == "policy_skipped" else {}
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with acs.ActivationScope(store=path, **options).track(model, include=["a"]) as tracker:
            model(torch.randn(2, 8))  # samples 0, 1
            tracker.set_batch(**({"sample_ids": [7, 9]} if case == "given_ids" else {}))
            model.skip_a = case == "no_hook_point"
            out = model(torch.randn(2, 8))  # samples 2, 3 (or 7, 9): skipped under SAMPLE_N
            model.skip_a = False
            tracker.set_batch(same_samples=True)
            model(torch.randn(2, 8))
            tracker.set_batch()
            model(torch.randn(2, 8))  # samples 4, 5: skipped under SAMPLE_N
    assert (out is None) == (case == "stop_after_last")
    lost = [w for w in caught if "recorded 0 row(s) in forward 1" in str(w.message)]
    assert len(lost) == (case == "no_hook_point")
    second = [7, 9] if case == "given_ids" else [2, 3]
    expected = [0, 1, second, second, 4, 5] if case != "policy_skipped" else [0, 1, 2, 3]
    expected = [i for x in expected for i in (x if isinstance(x, list) else [x])]
    table = acs.open_store(path).row_table("sample")
    assert table.column("sample_id").to_pylist() == expected
    # the counter after the last stored forward (under SAMPLE_N the step; the skipped 4, 5 come after it)
    assert acs.open_store(path).attrs["next_sample_id"] == (4 if case == "policy_skipped" else 6)
