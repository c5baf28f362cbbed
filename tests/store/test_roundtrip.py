"""Capture into a store and read back: equal to the in-memory capture (plain PyTorch)."""

from __future__ import annotations

import json
import os
import warnings
import re
import threading
import uuid

import numpy as np
import pytest
import torch
from acs_testing import store_three_batches
import zarr

import activationscope as acs
from activationscope.errors import StoreError
from activationscope.store import StoreWriter, open_store

from store_models import MLP, SmallCNN, batches_mlp, capture_memory, capture_store, make_encoder

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SMALL = {"chunk_rows": 4, "shard_bytes": 1024}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_equals_memory_capture(tmp_path, dtype):
    torch.manual_seed(0)
    model = MLP().to(dtype).eval()
    xs = batches_mlp()
    ref = capture_memory(model, xs, dtype=dtype)
    capture_store(model, xs, tmp_path / "s.zarr", dtype=dtype, store_options=SMALL)
    store = open_store(tmp_path / "s.zarr")
    assert store.status == "complete"
    assert sorted(store.hook_points) == sorted(ref)
    for hp, r in ref.items():
        got = store[hp]
        assert got.dtype == dtype
        assert torch.equal(got, r), hp
        assert store.row_kind(hp) == "sample"
        assert store.n_rows(hp) == r.shape[0]
    assert store.attrs["arrays"]["fc1.output"]["dtype"] == str(dtype).removeprefix("torch.")
    assert store.verify() == []


def test_storage_dtype_bfloat16_equals_cast(tmp_path, mlp):
    xs = batches_mlp()
    ref = capture_memory(mlp, xs)
    capture_store(mlp, xs, tmp_path / "s.zarr", storage_dtype=torch.bfloat16)
    store = open_store(tmp_path / "s.zarr")
    for hp, r in ref.items():
        assert store[hp].dtype == torch.bfloat16
        assert torch.equal(store[hp], r.to(torch.bfloat16)), hp


def test_cnn_with_inplace_relu(tmp_path):
    torch.manual_seed(0)
    model = SmallCNN().eval()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 3, 6, 6, generator=g) for _ in range(4)]
    ref = capture_memory(model, xs)
    capture_store(model, xs, tmp_path / "s.zarr", store_options={"chunk_rows": 2, "shard_bytes": 2000})
    store = open_store(tmp_path / "s.zarr")
    # SNAPSHOT: conv outputs are stored before the in-place ReLU changed them
    assert (store["conv1.output"] < 0).any()
    for hp, r in ref.items():
        assert torch.equal(store[hp], r), hp


def test_transformer_token_rows(tmp_path):
    model = make_encoder()
    g = torch.Generator().manual_seed(2)
    batches = []
    for i in range(4):
        x = torch.randn(3, 7, 16, generator=g)
        lengths = torch.tensor([7, 4, 1 + i])
        mask = torch.arange(7)[None, :] < lengths[:, None]
        tok = torch.randint(0, 100, (3, 7), generator=g)
        batches.append((x, mask, tok))

    def run(scope):
        with scope.track(model, include=["layers.*"], exclude=["*.dropout*", "*.self_attn*"]) as tr:
            with torch.no_grad():
                for i, (x, mask, tok) in enumerate(batches):
                    tr.set_batch(attention_mask=mask, sample_ids=[10 * i + j for j in range(3)],
                                 label=[i] * 3, token_ids=tok)
                    model(x, src_key_padding_mask=~mask)
        return tr

    mem = run(acs.ActivationScope())
    run(acs.ActivationScope(store=str(tmp_path / "t.zarr"), store_options={"chunk_rows": 8, "shard_bytes": 2048}))
    store = open_store(tmp_path / "t.zarr")
    n_tokens = int(sum(m.sum() for _, m, _ in batches))
    checked = 0
    for hp, recs in mem.activations.items():
        if recs[0].dim() < 2 or tuple(recs[0].shape[:2]) != (3, 7):
            continue
        ref = torch.cat([r[m] for r, (_, m, _) in zip(recs, batches)])
        assert store.row_kind(hp) == "token", hp
        assert torch.equal(store[hp], ref), hp
        assert store.n_rows(hp) == n_tokens
        checked += 1
    assert checked >= 2
    tokens = store.row_table("token")
    assert tokens.num_rows == n_tokens
    mask0 = batches[0][1]
    idx = mask0.nonzero()
    assert tokens.column("pos").to_pylist()[: len(idx)] == idx[:, 1].tolist()
    assert tokens.column("token_ids").to_pylist()[: len(idx)] == batches[0][2][mask0].tolist()
    samples = store.row_table("sample")
    assert samples.column("sample_id").to_pylist() == [10 * i + j for i in range(4) for j in range(3)]
    assert samples.column("label").to_pylist() == [i for i in range(4) for _ in range(3)]
    assert samples.column("batch").to_pylist() == [i for i in range(4) for _ in range(3)]


def test_zero_copy_view_lies_in_the_mapped_shard(tmp_path, mlp):
    capture_store(mlp, batches_mlp(), tmp_path / "s.zarr")
    store = open_store(tmp_path / "s.zarr")
    t = store["fc1.output"]
    shard = os.path.realpath(tmp_path / "s.zarr" / "acts" / "fc1.output" / "c" / "0" / "0")
    ptr = t.data_ptr()
    found = None
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= ptr < hi:
                found = parts[-1] if len(parts) >= 6 else ""
                break
    assert found == shard


def test_writing_into_a_view_never_changes_the_file(tmp_path, mlp):
    capture_store(mlp, batches_mlp(), tmp_path / "s.zarr")
    shard = tmp_path / "s.zarr" / "acts" / "fc1.output" / "c" / "0" / "0"
    before = shard.read_bytes()
    store = open_store(tmp_path / "s.zarr")
    t = store["fc1.output"]
    t.fill_(123.0)
    assert shard.read_bytes() == before
    fresh = open_store(tmp_path / "s.zarr")["fc1.output"]
    assert not torch.equal(fresh, t)


def test_slices_within_and_across_shards(tmp_path, mlp):
    xs = batches_mlp(n_batches=10)
    ref = capture_memory(mlp, xs)["fc1.output"]
    capture_store(mlp, xs, tmp_path / "s.zarr", store_options={"chunk_rows": 4, "shard_bytes": 4 * 16 * 4 * 2})
    store = open_store(tmp_path / "s.zarr")
    assert store.segments("fc1.output")[:3] == [0, 8, 16]
    assert torch.equal(store["fc1.output", 1:7], ref[1:7])
    assert torch.equal(store["fc1.output", 5:37], ref[5:37])
    assert torch.equal(store.rows("fc1.output", 0, 50), ref)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("block_bytes", [64 << 20, 3 * 8 * 4])  # (the second: a few rows per block read)
def test_a_strided_slice_that_is_a_copy_holds_only_its_rows(tmp_path, monkeypatch, compression, block_bytes):
    """store[hp, ::k] of a compressed array, or any negative step, is a copy: it holds the rows
    taken, not every row between the first and the last (all of the array for [::1000])."""
    from activationscope.store import reader as reader_mod

    monkeypatch.setattr(reader_mod, "_STRIDED_BLOCK_BYTES", block_bytes)
    data = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    w = StoreWriter(tmp_path / "s.zarr", chunk_rows=4, shard_rows=16, compression=compression)
    w.open_array("x", (8,), torch.float32, "sample").append(data)
    w.add_batch(300)
    w.close()
    store = open_store(tmp_path / "s.zarr")
    for sl in (slice(None, None, 100), slice(None, None, -100), slice(5, 290, 7), slice(290, 5, -7), slice(-1, None, -1),
               slice(3, 4, 2), slice(None, None, 2)):
        rows = list(range(300))[sl]
        got = store["x", sl]
        assert torch.equal(got, data[rows]), sl
        exact = got.untyped_storage().nbytes() == got.nbytes == len(rows) * 8 * 4
        if compression is not None or sl.step < 0:
            assert exact, sl
        else:  # uncompressed, positive step: a strided view of mapped rows (16-row shards of 512 bytes
            # do not map back to back: within one shard only), else a copy of the rows taken
            view = len(rows) == 1 or not got.is_contiguous()
            assert view == (rows[0] // 16 == rows[-1] // 16) and (view or exact), sl


def test_a_slice_of_step_zero_is_our_error_naming_the_hook_point(tmp_path):
    from activationscope.errors import ArgumentValueError

    store_three_batches(tmp_path / "s.zarr")
    with pytest.raises(ArgumentValueError, match=r"store\['0.output', rows\]: the slice step must not be zero, got "
                                                 r"slice\(1, 5, 0\)"):
        open_store(tmp_path / "s.zarr")["0.output", 1:5:0]


def test_plain_zarr_reads_every_array(tmp_path):
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16).eval()
    xs = batches_mlp()
    ref = capture_memory(model, xs, dtype=torch.bfloat16)
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=["mean"],
                                store_options={"chunk_rows": 4, "shard_bytes": 1024})
    with scope.track(model) as tr:
        with torch.no_grad():
            for x in xs:
                model(x.to(torch.bfloat16))
    g = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")  # no activationscope reader involved
    for hp, r in ref.items():
        arr = g[f"acts/{hp}"]
        assert arr.dtype == np.dtype("uint16")
        assert np.array_equal(arr[:], r.view(torch.uint16).numpy()), hp
    red = g["reductions/fc1.output/mean"][...]
    assert np.array_equal(red, tr.reductions["fc1.output"]["mean"].numpy())


def test_reductions_read_back(tmp_path, mlp):
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"), reductions=["mean", "var"])
    with scope.track(mlp) as tr:
        for x in batches_mlp():
            mlp(x)
    store = open_store(tmp_path / "s.zarr")
    for hp, reds in tr.reductions.items():
        for name, value in reds.items():
            assert torch.equal(store.reductions[hp][name], value), (hp, name)


def test_existing_complete_store_needs_overwrite_or_resume(tmp_path, mlp):
    capture_store(mlp, batches_mlp(1), tmp_path / "s.zarr")
    with pytest.raises(acs.StoreExistsError, match=r"s\.zarr.*overwrite=True.*resume=True"):
        StoreWriter(tmp_path / "s.zarr", capture_config={}, model=None, storage_dtype=None)
    with pytest.raises(FileExistsError):
        StoreWriter(tmp_path / "s.zarr", capture_config={}, model=None, storage_dtype=None)
    w = StoreWriter(tmp_path / "s.zarr", capture_config={}, model=None, storage_dtype=None, overwrite=True)
    w.close()
    assert open_store(tmp_path / "s.zarr").hook_points == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"compression": "lzma"}, r"compression must be one of"),
        ({"chunk_rows": 0}, r"chunk_rows must be a positive int"),
        ({"shard_bytes": -1}, r"shard_bytes must be a positive int"),
        ({"overwrite": True, "resume": True}, r"exclude each other"),
        ({"provenance": {"bad": object()}}, r"provenance must be JSON"),
    ],
)
def test_invalid_options_write_nothing(tmp_path, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        StoreWriter(tmp_path / "s.zarr", capture_config={}, model=None, storage_dtype=None, **kwargs)
    assert not (tmp_path / "s.zarr").exists()


def test_unknown_compression_lists_every_accepted_form():
    """The refusal lists every form parse_compression accepts (store.md's options table),
    'blosc-lz4:<clevel>' included, each of which is then accepted."""
    from activationscope.store import _format as F

    with pytest.raises(acs.errors.ArgumentValueError) as info:
        F.parse_compression("lzma")
    listed = re.search(r"one of (\[.*?\])", str(info.value)).group(1)
    assert listed == "[None, 'zstd', 'zstd:<level>', 'blosc-lz4', 'blosc-lz4:<clevel>']"
    for form in ("zstd", "zstd:7", "blosc-lz4", "blosc-lz4:2"):
        assert F.parse_compression(form) is not None


def test_shape_change_between_batches_names_the_hook_point(tmp_path):
    model = torch.nn.Sequential(torch.nn.Identity())
    scope = acs.ActivationScope(store=str(tmp_path / "s.zarr"))
    with pytest.raises(acs.ActivationScopeError, match=r"hook point '0\.output'.*feature shape"):
        with scope.track(model):
            model(torch.randn(2, 3))
            model(torch.randn(2, 4))
    assert open_store(tmp_path / "s.zarr").status == "incomplete"


def test_metadata_identity_and_provenance(tmp_path, mlp):
    capture_store(mlp, batches_mlp(2), tmp_path / "s.zarr", store_options={"provenance": {"dataset": "toy"}})
    attrs = open_store(tmp_path / "s.zarr").attrs
    assert attrs["format"] == {"name": "activationscope", "version": 1}
    assert attrs["provenance"] == {"dataset": "toy"}
    assert attrs["model"]["class"].endswith("store_models.MLP")
    assert re.fullmatch(r"[0-9a-f]{64}", attrs["model"]["state_dict_sha256"])
    assert attrs["library"]["torch"] == torch.__version__
    assert attrs["n_samples"] == 10
    assert attrs["capture_config"]["capture"] == "output"
    doc = json.loads((tmp_path / "s.zarr" / "acts" / "fc1.output" / "zarr.json").read_text())
    assert doc["codecs"][0]["name"] == "sharding_indexed"
    info = open_store(tmp_path / "s.zarr").info()
    assert info["arrays"]["fc1.output"]["shape"] == [10, 16]
    assert info["status"] == "complete"


def _reference_sha256(model: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    sd = model.state_dict()
    for name in sorted(sd):
        h.update(sd[name].detach().clone().contiguous().numpy().tobytes())  # a copy: numpy() locks a storage
    return h.hexdigest()


@pytest.mark.parametrize("width", [8, 600])
def test_model_identity_is_the_sha256_of_the_state_dict_at_the_open(tmp_path, width):
    # a model in training mode: the weights as they are when the store opens, also when they
    # change in place during the capture (fine-tuning while capturing): a resume with the
    # weights of the open is accepted, one with other weights refused
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)).train()
    want = _reference_sha256(model)
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model):
        at_open = json.loads((path / "zarr.json").read_text())["attributes"]["activationscope"]["model"]
        assert at_open["state_dict_sha256"] == want
        with torch.no_grad():
            model(torch.randn(3, width))
            model[0].weight.mul_(2)
            model(torch.randn(3, width))
            model[0].weight.div_(2)
    model.eval()
    attrs = open_store(path).attrs
    assert attrs["model"]["state_dict_sha256"] == want
    assert attrs["model"]["n_elements"] == sum(t.numel() for t in model.state_dict().values())
    assert acs.store.model_identity(model) == attrs["model"]
    # hashing leaves the model's storages as they were (resizable: code that frees parameter
    # memory with resize_(0) keeps working)
    model[2].bias.untyped_storage().resize_(model[2].bias.untyped_storage().nbytes())
    other = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)).eval()
    with pytest.raises(acs.StoreError, match="sha256"):
        with acs.ActivationScope(store=str(path), store_options={"resume": True}).track(other):
            pass
    with acs.ActivationScope(store=str(path), store_options={"resume": True}).track(model), torch.no_grad():
        model(torch.randn(3, width))
    assert open_store(path).n_samples == 9


def test_a_resume_after_optimizer_steps_is_refused_naming_the_weights_of_the_open(tmp_path):
    # a capture during training killed after some steps: the model's weights are no longer those
    # the store recorded, and the refusal gave two hashes and a guess about dtypes only
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    path = tmp_path / "s.zarr"
    with pytest.raises(KeyboardInterrupt):
        with acs.ActivationScope(store=str(path)).track(net, include=["1"]):
            for _ in range(3):
                net(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            raise KeyboardInterrupt
    assert open_store(path).status == "incomplete"
    with pytest.raises(StoreError) as err:
        with acs.ActivationScope(store=str(path), store_options={"resume": True}).track(net, include=["1"]):
            pass
    msg = str(err.value)
    assert "cannot resume" in msg and "nothing was changed" in msg
    assert "weights as they were when the store was opened" in msg and "optimizer steps" in msg
    assert "a new store" in msg


def test_an_eval_model_is_hashed_in_the_background_and_recorded_by_the_first_commit(tmp_path):
    """In eval mode (inference captures) the sha256 is taken while the first forwards run: the
    root written at the open may lack it, every root that lists rows has it; weights changed
    in place while it was being taken are hashed again, with a CaptureWarning."""
    from activationscope.store import writer as writer_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval()
    want = _reference_sha256(model)
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model), torch.no_grad():
        model(torch.randn(3, 64))
    assert open_store(path).attrs["model"]["state_dict_sha256"] == want

    # the open does not wait for the hash (the capture runs while it is held back); weights
    # changed in place while it ran: hashed again as they are then, said so
    class Slow(writer_module._ModelIdentity):
        def _run(self):
            self.started.set()
            self.go.wait(30)
            super()._run()

    started, go = threading.Event(), threading.Event()
    Slow.started, Slow.go = started, go
    orig = writer_module._ModelIdentity
    writer_module._ModelIdentity = Slow
    try:
        path2 = tmp_path / "t.zarr"
        with pytest.warns(acs.CaptureWarning, match=r"weights changed in place \(0.weight\) while the store"):
            with acs.ActivationScope(store=str(path2)).track(model), torch.no_grad():
                started.wait(30)
                model[0].weight.add_(1)
                go.set()
                model(torch.randn(3, 64))
    finally:
        writer_module._ModelIdentity = orig
    assert open_store(path2).attrs["model"]["state_dict_sha256"] == _reference_sha256(model) != want


def test_a_writer_that_fails_to_open_stops_hashing_the_model(tmp_path):
    """A capture refused at the open (StoreExistsError: the store is there) left the background
    hash of the model's weights running, unjoined: at interpreter exit the daemon thread, inside
    torch's native code, was ended by pthread_exit, which aborted the process (status 134,
    "terminate called without an active exception"), about 1 run in 3. The failed open now
    stops the hash and waits for its thread; the exit hook stops any other still running."""
    from activationscope.errors import StoreExistsError
    from activationscope.store import writer as writer_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path)).track(model), torch.no_grad():
        model(torch.randn(3, 4))

    started, go = threading.Event(), threading.Event()
    made = []

    class Held(writer_module._ModelIdentity):  # a hash still running when the open fails
        def __init__(self, m):
            super().__init__(m)
            made.append(self)

        def _run(self):
            started.set()
            go.wait(30)
            super()._run()

    orig = writer_module._ModelIdentity
    writer_module._ModelIdentity = Held
    try:
        threading.Timer(0.5, go.set).start()  # (let the hash go on its own, with or without a cancel)
        with pytest.raises(StoreExistsError):
            with acs.ActivationScope(store=str(path)).track(model), torch.no_grad():
                model(torch.randn(3, 4))
    finally:
        writer_module._ModelIdentity = orig
    assert started.is_set() and len(made) == 1
    assert not made[0]._thread.is_alive() and made[0]._stop.is_set()  # stopped and joined by the failed open
    assert made[0].get() is None and made[0] not in writer_module._HASHING


def test_the_exit_hook_stops_a_model_hash_still_running():
    """A writer never closed (or a capture that raised before its first commit) leaves its hash
    running: the exit hook stops it after the tensor it is reading and joins its thread, before
    Python finalizes (where the daemon thread would abort the process)."""
    from activationscope.store import writer as writer_module

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(50)]).eval()
    seen = []

    class Slow(writer_module._ModelIdentity):
        def _run(self):
            real = writer_module._hash_state

            def one_tensor_at_a_time(cls, items, stop=None):
                for i in range(len(items)):
                    seen.append(i)
                    real(cls, items[i:i + 1], stop)
                    if stop is not None and stop.wait(0.05):
                        raise writer_module._HashCancelled()
                return real(cls, items, stop)

            try:
                self._result = one_tensor_at_a_time(self._cls, self._items or [], self._stop)
            except BaseException as e:  # noqa: BLE001 - as _ModelIdentity._run
                self._error = e

    ident = Slow(model)
    assert ident in writer_module._HASHING and ident._thread.is_alive()
    writer_module._stop_hashes_at_exit()
    assert not ident._thread.is_alive() and ident not in writer_module._HASHING
    assert 0 < len(seen) < 100 and ident.get() is None  # stopped partway: no record


@pytest.mark.parametrize("chunk_rows", [4, 64])
def test_store_capture_under_inference_mode_keeps_every_row(tmp_path, chunk_rows):
    """Chunk buffers made under torch.inference_mode() are filled and padded in place later,
    also after the inference mode ended (the tracker's exit after it, forwards outside it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
    xs = [torch.randn(3, 8) for _ in range(3)]
    opts = {"chunk_rows": chunk_rows}
    with acs.ActivationScope(store=str(tmp_path / "a.zarr"), store_options=opts).track(model), torch.inference_mode():
        for x in xs:
            model(x)
    with acs.ActivationScope(store=str(tmp_path / "b.zarr"), store_options=opts).track(model):
        with torch.inference_mode():
            model(xs[0])
        with torch.no_grad():
            model(xs[1])
            model(xs[2])
    with torch.no_grad():
        want = torch.cat([model[0](x) for x in xs])
    for name in ("a.zarr", "b.zarr"):
        s = open_store(tmp_path / name)
        assert s.status == "complete"
        torch.testing.assert_close(s["0.output"][:], want, rtol=0, atol=0)
        torch.testing.assert_close(s["1.output"][:], want.relu(), rtol=0, atol=0)


def test_verify_finds_a_flipped_byte(tmp_path, mlp):
    capture_store(mlp, batches_mlp(10), tmp_path / "s.zarr", store_options={"chunk_rows": 4, "shard_bytes": 4 * 16 * 4 * 2})
    store = open_store(tmp_path / "s.zarr")
    assert store.verify() == []
    shard = tmp_path / "s.zarr" / "acts" / "fc1.output" / "c" / "1" / "0"
    data = bytearray(shard.read_bytes())
    data[4 * 16 * 4 + 5] ^= 0x10  # chunk 1 of shard 1 = chunk 3 of the array
    shard.write_bytes(bytes(data))
    problems = open_store(tmp_path / "s.zarr").verify()
    assert len(problems) == 1
    assert "fc1.output" in problems[0] and "chunk 3" in problems[0], problems


def test_row_count_not_following_the_table_is_flagged(tmp_path):
    w = StoreWriter(tmp_path / "s.zarr", capture_config={}, model=None, storage_dtype=None)
    a = w.open_array("a.output", (4,), torch.float32, "sample")
    b = w.open_array("b.output", (4,), torch.float32, "sample")  # e.g. a module called on 2x the batch
    for i in range(2):
        a.append(torch.full((3, 4), float(i)))
        b.append(torch.full((6, 4), float(i)))
        w.add_batch(3, list(range(3 * i, 3 * i + 3)), None, {})
    w.close()
    store = open_store(tmp_path / "s.zarr")
    assert store.attrs["arrays"]["a.output"]["follows_row_table"] is True
    assert store.attrs["arrays"]["b.output"]["follows_row_table"] is False
    assert store.n_rows("b.output") == 12 and store.n_rows("a.output") == 6
    assert torch.equal(store["b.output"][6:], torch.ones(6, 4))


def test_a_resume_keeps_the_provenance_and_appends_its_own_to_the_history(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    path = str(tmp_path / "s.zarr")

    def run(provenance):
        opts = {"resume": True} if os.path.exists(path) else {}
        if provenance is not None:
            opts["provenance"] = provenance
        with acs.ActivationScope(store=path, store_options=opts).track(model), torch.no_grad():
            model(torch.randn(2, 4))
        return open_store(path).attrs["provenance"]

    first = {"dataset": "toy", "commit": "abc"}
    assert run(first) == first
    assert run(None) == first  # a resume that gives none keeps the store's
    assert run(dict(first)) == first  # the same one: nothing to add
    second = {"dataset": "toy", "commit": "def"}
    assert run(second) == {**first, "resumes": [second]}
    assert run(second) == {**first, "resumes": [second]}  # the last resume's again: no new entry
    third = {"dataset": "toy2"}
    assert run(third) == {**first, "resumes": [second, third]}
    assert open_store(path).n_samples == 12


def test_a_resume_stopped_before_its_first_batch_leaves_the_store_as_found(tmp_path):
    """An exception before the first forward of a resume was recorded (a bad batch, Ctrl-C):
    the store is put back as found, root document and all (a complete store stays complete,
    no entry in its provenance's history); once a batch is recorded, the abort commits what is
    durable and marks the store incomplete, as before."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    path = tmp_path / "s.zarr"
    with acs.ActivationScope(store=str(path), store_options={"provenance": {"run": 1}}).track(model), torch.no_grad():
        model(torch.randn(2, 4))
    root = (path / "zarr.json").read_bytes()
    opts = {"resume": True, "provenance": {"run": 2}}
    with pytest.raises(RuntimeError, match="stopped"):
        with acs.ActivationScope(store=str(path), store_options=opts).track(model), torch.no_grad():
            raise RuntimeError("stopped before the first forward")
    assert (path / "zarr.json").read_bytes() == root
    store = open_store(path)
    assert store.status == "complete" and store.attrs["provenance"] == {"run": 1} and store.n_samples == 2
    with pytest.raises(RuntimeError, match="stopped"):
        with acs.ActivationScope(store=str(path), store_options=opts).track(model), torch.no_grad():
            model(torch.randn(3, 4))
            raise RuntimeError("stopped after a forward")
    store = open_store(path)
    assert store.status == "incomplete" and store.n_samples == 5
    assert store.attrs["provenance"] == {"run": 1, "resumes": [{"run": 2}]}


def _tree(path) -> tuple[dict[str, bytes], set[str]]:
    """The files (relative name: bytes) and folders of a store (the writer lock file left out)."""
    files = {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*")
             if p.is_file() and p.name != ".activationscope-writer.lock"}
    return files, {str(p.relative_to(path)) for p in path.rglob("*") if p.is_dir()}


@pytest.mark.parametrize("committed", [False, True], ids=["no_commit", "commit"])
def test_an_aborted_resume_that_recorded_no_batch_leaves_the_files_as_found(tmp_path, committed):
    """A resume that appended rows (shards of a stored array past its committed ones, and of
    a new array) but recorded no batch, then aborted: the store's files are those found, same
    names and bytes, no new folder, and it opens complete with its rows. Also when a commit
    of the resume (it lists the new array) ran before the abort."""
    path = tmp_path / "s.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 16 * 8 * 4}  # 16-row shards
    data = store_three_batches(path, **options)  # shards 0, 1 and a partial shard 2 (4 rows)
    found = _tree(path)
    assert sorted(k for k in found[0] if "/c/" in k) == ["acts/0.output/c/0/0", "acts/0.output/c/1/0",
                                                         "acts/0.output/c/2/0"]
    w = StoreWriter(path, resume=True, **options)
    w.open_array("0.output", (8,), torch.float32, "sample").append(torch.randn(40, 8))  # shards 2, 3 and part of 4
    w.open_array("1.output", (8,), torch.float32, "sample").append(torch.randn(40, 8))  # a new array: shards 0, 1
    w._core.drain()
    if committed:
        w.commit()
    made = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} - set(found[0])
    assert {"acts/0.output/c/3/0", "acts/1.output/c/0/0", "acts/1.output/c/1/0"} <= made
    w.abort(RuntimeError("stopped before the first forward was recorded"))
    after = _tree(path)
    assert sorted(after[0]) == sorted(found[0])
    assert [k for k in found[0] if after[0][k] != found[0][k]] == []
    assert after[1] == found[1]
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 36 and store.hook_points == ["0.output"]
    assert torch.equal(store["0.output"], data) and store.verify() == []


@pytest.mark.parametrize("committed", [False, True], ids=["no_commit", "commit"])
def test_an_aborted_resume_puts_back_its_partial_last_shard_without_hard_links(tmp_path, monkeypatch, committed):
    """On a file system without hard links (some network and FUSE mounts), the found partial
    last shard that a resume rewrites is kept as a copy: an abort puts it back byte for byte,
    and the store reads and verifies as found."""
    import errno

    from activationscope.store import writer as writer_module

    def no_link(src, dst, *a, **k):
        raise OSError(errno.EPERM, "hard links are not supported here", str(dst))

    path = tmp_path / "s.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 16 * 8 * 4}  # 16-row shards
    data = store_three_batches(path, **options)  # shards 0, 1 and a partial shard 2 (4 rows)
    found = _tree(path)
    monkeypatch.setattr(writer_module.os, "link", no_link)
    w = StoreWriter(path, resume=True, **options)
    w.open_array("0.output", (8,), torch.float32, "sample").append(torch.randn(40, 8))  # rewrites shard 2
    w._core.drain()
    if committed:
        w.commit()
    # the rewrite replaces the found file only at a commit that lists rows (this one has no batch to
    # list): until then it waits under another name (FORMAT.md section 7)
    assert (path / "acts/0.output/c/2/0").read_bytes() == found[0]["acts/0.output/c/2/0"]
    assert (path / "acts/0.output/c/2/0.resumed.tmp").exists()
    w.abort(RuntimeError("stopped before the first forward was recorded"))
    after = _tree(path)
    assert sorted(after[0]) == sorted(found[0])
    assert [k for k in found[0] if after[0][k] != found[0][k]] == []
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 36
    assert torch.equal(store["0.output"], data) and store.verify() == []


def test_a_resume_that_cannot_keep_its_partial_last_shard_is_refused(tmp_path, monkeypatch):
    """Neither a hard link nor a copy of the found partial last shard can be made (no hard
    links, a full disk): the resume is refused before that shard is rewritten, naming it,
    and the store stays as found."""
    import errno

    from activationscope.store import writer as writer_module

    def fail(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / "s.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 16 * 8 * 4}
    data = store_three_batches(path, **options)
    found = _tree(path)
    monkeypatch.setattr(writer_module.os, "link", fail)
    monkeypatch.setattr(writer_module.shutil, "copyfile", fail)
    w = StoreWriter(path, resume=True, **options)
    with pytest.raises(StoreError, match=r"partial last shard '0' of hook point '0.output' cannot be kept .*"
                                         r"No space left on device.*the shard was not touched"):
        w.open_array("0.output", (8,), torch.float32, "sample")
    w.abort(RuntimeError("refused"))
    after = _tree(path)
    assert after[0] == found[0]
    store = open_store(path)
    assert store.status == "complete" and torch.equal(store["0.output"], data) and store.verify() == []


@pytest.mark.parametrize("where", ["local", "memory"])
def test_an_aborted_resume_whose_commit_listed_nothing_new_leaves_the_files_as_found(tmp_path, where):
    """A resume that appended rows to its stored array only (no new array to list) and called
    commit() before recording a batch: that commit takes the finished shards past the found
    ones (and, remote, uploads them) but writes no document. The abort then removes them too:
    the store's files are those found, same names and bytes."""
    import fsspec

    options = {"chunk_rows": 4, "shard_bytes": 16 * 8 * 4}  # 16-row shards
    if where == "local":
        target = tmp_path / "s.zarr"

        def files():
            return _tree(target)[0]
    else:
        target = f"memory://acs-test/{uuid.uuid4().hex}.zarr"
        fs = fsspec.filesystem("memory")

        def files():
            return {p: fs.cat_file(p) for p in fs.find(target[len("memory:/"):])}
    data = store_three_batches(target, **options)  # shards 0, 1 and a partial shard 2 (4 rows)
    found = files()
    w = StoreWriter(target, resume=True, **options)
    w.open_array("0.output", (8,), torch.float32, "sample").append(torch.randn(40, 8))  # shards 2, 3 and part of 4
    w._core.drain()
    w.commit()
    assert any(k.endswith("acts/0.output/c/3/0") for k in files())
    w.abort(RuntimeError("stopped before the first forward was recorded"))
    after = files()
    assert sorted(after) == sorted(found)
    assert [k for k in found if after[k] != found[k]] == []
    store = open_store(target)
    assert store.status == "complete" and store.n_samples == 36
    assert torch.equal(store["0.output"], data) and store.verify() == []


@pytest.mark.parametrize("committed", [False, True], ids=["no_commit", "commit"])
def test_an_unchanged_resume_of_a_store_without_rows_leaves_no_folder_of_shards(tmp_path, committed):
    """A store whose array has no rows has no folder of shards (acts/<node>/c); a resume that
    appended rows to it but recorded no batch, closed as incomplete: its folders and files
    are those found (the c folder its shards went into removed with them)."""
    path = tmp_path / "s.zarr"
    options = {"chunk_rows": 4, "shard_bytes": 16 * 8 * 4}  # 16-row shards
    w = StoreWriter(path, **options)
    w.open_array("0.output", (8,), torch.float32, "sample")
    w.add_batch(0)  # a forward that gave it no row
    w.close()
    found = _tree(path)
    assert "acts/0.output/c" not in found[1]
    w = StoreWriter(path, resume=True, **options)
    w.open_array("0.output", (8,), torch.float32, "sample").append(torch.randn(40, 8))  # shards 0, 1 and part of 2
    w._core.drain()
    if committed:
        w.commit()
    assert (path / "acts/0.output/c/1/0").is_file()
    w.close("incomplete")
    after = _tree(path)
    assert after[1] == found[1]
    assert sorted(after[0]) == sorted(found[0])
    assert [k for k in found[0] if after[0][k] != found[0][k]] == []
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 0 and store.hook_points == ["0.output"]


@pytest.mark.parametrize("how", ["abort", "close"])
def test_a_batch_another_thread_records_while_an_unchanged_resume_closes_is_refused(tmp_path, monkeypatch, how):
    """abort() and close("incomplete") of a resume that recorded no batch put the store back
    as found; another thread that records and commits a batch in between the check and the
    discard waits for the writer's lock and is refused (the writer is closed): a commit is
    never reported and then rolled back."""
    path = tmp_path / "s.zarr"
    w = StoreWriter(path)
    w.add_batch(2)
    w.close()
    found = (path / "zarr.json").read_bytes()
    w = StoreWriter(path, resume=True)
    outcome: dict = {}

    def other() -> None:
        try:
            w.add_batch(3)
            outcome["committed"] = w.commit()
        except acs.StoreError as e:
            outcome["refused"] = str(e)

    other_thread = threading.Thread(target=other)
    check = StoreWriter._unchanged_resume

    def racing(self) -> bool:
        unchanged = check(self)
        if not other_thread.is_alive() and not outcome:
            other_thread.start()
            other_thread.join(timeout=2.0)  # its batch and commit, unless the lock holds it back
        return unchanged

    monkeypatch.setattr(StoreWriter, "_unchanged_resume", racing)
    if how == "abort":
        w.abort(RuntimeError("stopped before the first forward"))
    else:
        w.close("incomplete")
    other_thread.join(timeout=60)
    assert not other_thread.is_alive()
    assert list(outcome) == ["refused"] and "is closed" in outcome["refused"]
    assert (path / "zarr.json").read_bytes() == found
    store = open_store(path)
    assert store.status == "complete" and store.n_samples == 2


def test_resumed_provenance_of_stored_values_it_does_not_own():
    from activationscope.store.writer import resumed_provenance

    assert resumed_provenance(None, {"a": 1}) == {"a": 1}
    assert resumed_provenance("damaged", {}) == {}
    assert resumed_provenance({"a": 1}, {}) == {"a": 1}
    assert resumed_provenance({"a": 1, "resumes": "mine"}, {"b": 2}) == {"a": 1, "resumes": ["mine", {"b": 2}]}


class _WithBuffer(torch.nn.Module):
    def __init__(self, z: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("z", z)
        self.l = torch.nn.Linear(2, 2)


def test_model_identity_hashes_values_not_the_memory_under_a_lazy_view():
    z = torch.tensor([1 + 2j, 3 - 4j])
    torch.manual_seed(0)
    plain = acs.store.model_identity(_WithBuffer(z.conj().resolve_conj()))
    torch.manual_seed(0)
    lazy = acs.store.model_identity(_WithBuffer(z.conj()))  # the conjugate bit over z's memory
    torch.manual_seed(0)
    other = acs.store.model_identity(_WithBuffer(z))
    assert plain == lazy and lazy != other
    x = torch.tensor([1.0, -2.0])
    torch.manual_seed(0)
    neg = acs.store.model_identity(_WithBuffer(torch._neg_view(x)))
    torch.manual_seed(0)
    assert neg == acs.store.model_identity(_WithBuffer(-x))
    dense = torch.tensor([[0.0, 1.5], [2.0, 0.0]])
    torch.manual_seed(0)
    sparse = acs.store.model_identity(_WithBuffer(dense.to_sparse()))
    torch.manual_seed(0)
    assert sparse == acs.store.model_identity(_WithBuffer(dense))


def test_a_model_on_the_meta_device_is_refused_by_a_store_naming_the_tensor(tmp_path):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    from activationscope.errors import ArgumentValueError

    with pytest.raises(ArgumentValueError, match=r"'0\.bias' is on the meta device.*load them"):
        with acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model):
            pass
    assert not (tmp_path / "s.zarr").exists()


def test_a_resume_asking_for_another_compression_says_the_stored_arrays_keep_theirs(tmp_path):
    # the stored arrays keep their codec and layout on resume: compression= asking for another
    # one was ignored without a word
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).eval()
    path = str(tmp_path / "s.zarr")
    with acs.ActivationScope(store=path).track(model), torch.no_grad():
        model(torch.randn(2, 4))
    with pytest.warns(RuntimeWarning, match=r"'zstd'.*'0\.output'.*uncompressed.*new in this run"):
        with acs.ActivationScope(store=path, store_options={"resume": True, "compression": "zstd"}).track(model), \
                torch.no_grad():
            model(torch.randn(2, 4))
    store = open_store(path)
    assert store.n_samples == 4 and store.attrs["arrays"]["0.output"].get("compression") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same codec again: nothing to say
        with acs.ActivationScope(store=path, store_options={"resume": True}).track(model), torch.no_grad():
            model(torch.randn(2, 4))
