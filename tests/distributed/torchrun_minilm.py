"""MiniLM token rows under torchrun (run by tests/distributed/test_torchrun.py).

    torchrun --standalone --nproc_per_node=2 torchrun_minilm.py STORE

Rank r captures batches r, r + world, ... of TEXTS (BATCH sentences each, padded), token rows
at the attention mask. Without WORLD_SIZE it captures the batches of rank 0, then rank 1
(``--world`` ranks' worth, in rank order) in one process: the reference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import activationscope as acs  # noqa: E402
from activationscope.analysis.demo import load_model  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while seven tired cats sleep under warm red blankets".split()
TEXTS = [" ".join(WORDS[i % 7: i % 7 + 3 + (i * 5) % 11]) for i in range(20)]
BATCH = 4
STORE_OPTIONS = {"shard_rows": 32}


def batches_of(rank: int, world: int) -> list[int]:
    return list(range(rank, -(-len(TEXTS) // BATCH), world))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, args.world)
    tokenizer, model = load_model(pooled=False)
    order = batches_of(rank, world) if distributed else [b for r in range(world) for b in batches_of(r, world)]
    scope = acs.ActivationScope(store=args.store, reductions=["mean", "var"],
                                store_options={**STORE_OPTIONS, "process_group": None if distributed else False})
    with scope.track(model, include=["encoder.layer.0.output.dense", "encoder.layer.5.output", "pooler"]) as tracker, \
            torch.no_grad():
        for b in order:
            enc = tokenizer(TEXTS[b * BATCH:(b + 1) * BATCH], padding=True, return_tensors="pt")
            tracker.set_batch(attention_mask=enc["attention_mask"], sample_ids=torch.arange(b * BATCH, (b + 1) * BATCH),
                              token_ids=enc["input_ids"])
            model(**enc)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
