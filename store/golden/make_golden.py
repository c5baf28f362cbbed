"""Write the golden stores of the current format version (run once per format release).

python store/golden/make_golden.py   ->  store/golden/v1/{mlp_f32,tokens_bf16_zstd}.zarr + expected.pt
Never regenerate an existing version's stores: the tests check that they still read.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from activationscope.store import StoreWriter

OUT = Path(__file__).parent / "v1"


def main() -> None:
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
