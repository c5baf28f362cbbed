"""Write the golden stores of the current format version (run once per format release).

python store/golden/make_golden.py      ->  store/golden/v1/{mlp_f32,tokens_bf16_zstd}.zarr + expected.pt
python store/golden/make_golden.py v2   ->  store/golden/v2/ranks.zarr (committed from 2 rank stores) + expected.pt
python store/golden/make_golden.py v3   ->  store/golden/v3/reductions.zarr (reductions only) + expected.pt
python store/golden/make_golden.py v4   ->  store/golden/v4/segments.zarr (segmented manifests) + expected.pt
Never regenerate an existing version's stores: the tests check that they still read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from activationscope.store import StoreWriter

OUT = Path(__file__).parent / "v1"
OUT_V2 = Path(__file__).parent / "v2"
OUT_V3 = Path(__file__).parent / "v3"
OUT_V4 = Path(__file__).parent / "v4"


def main_v4() -> None:
    """Version 4 (FORMAT.md section 5): manifests with segments. Sealed every 2 shards (the
    library's 1024 would take a store of 1024 shards; a reader takes any segment size): a float32
    array of 22 rows in 11 shards of 2 rows (chunks of 1 row), committed every 4 rows: segments of
    shards 0..9, shard 10 in the manifest; and a zstd-compressed one of 22 rows in shards of 8 rows
    (chunks of 4), committed once: a segment of shards 0..1, shard 2 in the manifest."""
    import shutil

    from activationscope.store import _format as F

    if OUT_V4.exists() and "--force" not in sys.argv:
        sys.exit(f"{OUT_V4} exists; golden stores are never regenerated")
    OUT_V4.mkdir(parents=True, exist_ok=True)
    path = OUT_V4 / "segments.zarr"
    shutil.rmtree(path, ignore_errors=True)
    F.MANIFEST_SEGMENT_SHARDS = 2
    g = torch.Generator().manual_seed(4096)
    x = torch.randn(22, 3, generator=g)
    z = torch.randn(22, 2, generator=g)
    w = StoreWriter(path, capture_config={"capture": "output"}, model=None, storage_dtype=None, chunk_rows=1,
                    shard_rows=2, provenance={"golden": "v4"})
    a = w.open_array("fc.output", (3,), torch.float32, "sample")
    for s in range(0, 22, 4):
        e = min(22, s + 4)
        a.append(x[s:e])
        w.add_batch(e - s, list(range(s, e)), None, {"label": [i % 3 for i in range(s, e)]})
        w.commit()
    w.close()
    zpath = OUT_V4 / "segments_zstd.zarr"
    shutil.rmtree(zpath, ignore_errors=True)
    w = StoreWriter(zpath, capture_config={}, model=None, storage_dtype=None, compression="zstd", chunk_rows=4,
                    shard_rows=8)
    a = w.open_array("enc.output", (2,), torch.float32, "sample")
    a.append(z)
    w.add_batch(22, list(range(22)), None, {})
    w.close()
    for p in (path, zpath):
        (p / ".activationscope-writer.lock").unlink(missing_ok=True)  # not part of the data (FORMAT.md section 1)
    torch.save({"fc.output": x.clone(), "enc.output": z.clone()}, OUT_V4 / "expected.pt")


def main_v3() -> None:
    """Version 3 (FORMAT.md section 11): a store that keeps reductions only, of a sample-row hook
    point ("0.output") and a token-row one ("1.output", a mask leaving padding out), with the
    float64 reference values of its reductions."""
    import shutil

    import activationscope as acs

    if OUT_V3.exists() and "--force" not in sys.argv:
        sys.exit(f"{OUT_V3} exists; golden stores are never regenerated")
    OUT_V3.mkdir(parents=True, exist_ok=True)
    path = OUT_V3 / "reductions.zarr"
    shutil.rmtree(path, ignore_errors=True)
    g = torch.Generator().manual_seed(2026)

    class Model(torch.nn.Module):
        def forward(self, x):  # x (batch, pos, 3): a pooled output and the token output
            return x.mean(1)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool, self.tok = Model(), torch.nn.Identity()

        def forward(self, x):
            return self.pool(x), self.tok(x)

    model = Two()
    scope = acs.ActivationScope(store=str(path), reduction_policy=acs.ReductionPolicy.STREAMING,
                                reductions=["mean", "var", "min", "max"], store_options={"provenance": {"golden": "v3"}})
    pooled, tokens, ids = [], [], []
    with scope.track(model, include=["pool", "tok"]) as tracker, torch.no_grad():
        for b in range(3):
            x = torch.randn(2, 4, 3, generator=g)
            mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
            tracker.set_batch(sample_ids=[f"s{2 * b}", f"s{2 * b + 1}"], attention_mask=mask)
            model(x)
            pooled.append(x.mean(1))
            tokens.append(x[mask])
            ids += [f"s{2 * b}", f"s{2 * b + 1}"]
    (path / ".activationscope-writer.lock").unlink(missing_ok=True)  # not part of the data (FORMAT.md section 1)
    expected = {}
    for hp, rows in (("pool.output", torch.cat(pooled)), ("tok.output", torch.cat(tokens))):
        r = rows.double()
        expected[hp] = {"n_rows": len(rows), "mean": r.mean(0), "var": r.var(0, unbiased=False),
                        "min": r.min(0).values, "max": r.max(0).values}
    expected["sample_id"] = ids
    torch.save(expected, OUT_V3 / "expected.pt")


def main_v2() -> None:
    """Version 2 (FORMAT.md section 10): two rank stores of bfloat16 sample rows (zstd), committed.
    Shards of 4 rows: rank 0 holds 1 full shard and a tail of 2 rows, rank 1 2 full shards and a
    tail of 1, so the committed order (full shards of every rank, then the tails) is not theirs."""
    import shutil

    import activationscope as acs
    from activationscope.store.ranks import commit_ranks

    if OUT_V2.exists() and "--force" not in sys.argv:
        sys.exit(f"{OUT_V2} exists; golden stores are never regenerated")
    OUT_V2.mkdir(parents=True, exist_ok=True)
    path = OUT_V2 / "ranks.zarr"
    shutil.rmtree(path, ignore_errors=True)
    g = torch.Generator().manual_seed(2024)
    model = torch.nn.Sequential(torch.nn.Identity())  # "0.output": the rows given
    expected = {"0.output": [], "sample_id": [], "label": []}
    for rank, n_batches in ((0, 2), (1, 3)):
        scope = acs.ActivationScope(store=str(path), reductions=["mean"], storage_dtype=torch.bfloat16,
                                    store_options={"shard_rows": 4, "chunk_rows": 2, "compression": "zstd",
                                                   "provenance": {"golden": "v2"},
                                                   "process_group": acs.RankStore(rank, 2)})
        rows, ids, labels = [], [], []
        with scope.track(model) as tracker, torch.no_grad():
            for b in range(n_batches):
                x = torch.randn(3, 5, generator=g)
                tracker.set_batch(sample_ids=torch.arange(3) + 100 * rank + 3 * b, label=torch.arange(3) + b)
                model(x)
                rows.append(x.to(torch.bfloat16))
                ids += [100 * rank + 3 * b + i for i in range(3)]
                labels += [b + i for i in range(3)]
        expected["0.output"].append(torch.cat(rows))
        expected["sample_id"].append(ids)
        expected["label"].append(labels)
    commit_ranks(path)
    (path / ".activationscope-writer.lock").unlink(missing_ok=True)  # not part of the data (FORMAT.md section 1)
    torch.save(expected, OUT_V2 / "expected.pt")


def main() -> None:
    if sys.argv[1:2] == ["v2"]:
        return main_v2()
    if sys.argv[1:2] == ["v3"]:
        return main_v3()
    if sys.argv[1:2] == ["v4"]:
        return main_v4()
    if OUT.exists() and "--force" not in sys.argv:
        sys.exit(f"{OUT} exists; golden stores are never regenerated")
    OUT.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1234)
    expected = {}
    # 1. uncompressed float32 sample rows, 3 shards, a reduction
    x = torch.randn(10, 3, generator=g)
    w = StoreWriter(OUT / "mlp_f32.zarr", capture_config={"capture": "output"}, model=None, storage_dtype=None,
                    chunk_rows=2, shard_bytes=2 * 3 * 4 * 2, provenance={"golden": "v1"})
    a = w.open_array("fc.output", (3,), torch.float32, "sample")
    for s in range(0, 10, 4):
        a.append(x[s:s + 4])
        w.add_batch(min(4, 10 - s), list(range(s, min(10, s + 4))), None, {"label": [i % 2 for i in range(s, min(10, s + 4))]})
    w.close()
    expected["mlp_f32"] = {"fc.output": x.clone()}
    # 2. bfloat16 token rows, zstd
    t = torch.randn(7, 4, generator=g).to(torch.bfloat16)
    t[0, 0] = float("nan")
    t[0, 1] = float("-inf")
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    w = StoreWriter(OUT / "tokens_bf16_zstd.zarr", capture_config={}, model=None, storage_dtype=torch.bfloat16,
                    compression="zstd", chunk_rows=3)
    a = w.open_array("enc.output", (4,), torch.bfloat16, "token")
    a.append(t)
    w.add_batch(2, ["a", "b"], mask, {"token_ids": torch.arange(8).reshape(2, 4)})
    w.close()
    expected["tokens_bf16_zstd"] = {"enc.output": t.clone()}
    torch.save(expected, OUT / "expected.pt")


if __name__ == "__main__":
    main()
