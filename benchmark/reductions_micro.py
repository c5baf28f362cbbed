"""Micro-benchmark of the native streaming reductions (the capture hot path).

Prints
  * microseconds per ``Reduction.update`` of one (32, 256) batch, per kind and dtype, for a
    contiguous batch (the native fast path) and for a non-contiguous view of the same values
    (the general ATen path), medians over repeats;
  * the toy-model ratio: 48 x nn.Linear(256, 256), batch 32, plain forward vs
    ``ActivationScope(capture="both", reductions=["mean", "var", "min", "max"],
    reduction_policy="streaming")`` (96 hook points, 384 reduction updates per forward),
    with ``torch.set_num_threads(1)``, medians of 5 repeats of 200 forwards each;
  * the load average, since the machine may be shared.

Run: ``.venv/bin/python benchmark/reductions_micro.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import activationscope as acs
from activationscope.capture import reductions as R

KINDS = ["mean", "var", "std", "min", "max", "absmax", "l2", "nonzero"]


def per_update_us(kind: str, x: torch.Tensor, updates: int, repeats: int) -> float:
    r = R.make_reduction(kind)
    r.update(x)  # allocate the state outside the timing
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(updates):
            r.update(x)
        times.append((time.perf_counter() - t0) / updates * 1e6)
    return statistics.median(times)


def micro(updates: int, repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(32, 256, generator=g)
    print(f"us per update of a (32, 256) batch (median of {repeats} x {updates} updates)")
    print(f"{'kind':>8} {'dtype':>9} {'contiguous':>11} {'non-contig':>11}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = base.to(dtype)
        xt = x.t().contiguous().t()  # same values, column-major: not contiguous
        assert not xt.is_contiguous() and torch.equal(xt, x)
        for kind in KINDS if dtype is torch.float32 else ["var", "max"]:
            fast = per_update_us(kind, x, updates, repeats)
            slow = per_update_us(kind, xt, updates, repeats)
            print(f"{kind:>8} {str(dtype).replace('torch.', ''):>9} {fast:11.2f} {slow:11.2f}")


def forward_ms(model: torch.nn.Module, x: torch.Tensor, forwards: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(forwards):
            model(x)
        times.append((time.perf_counter() - t0) / forwards * 1e3)
    return statistics.median(times)


def toy_model(forwards: int, repeats: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(48)]).eval()
    x = torch.randn(32, 256)
    scope = acs.ActivationScope(capture="both", reductions=["mean", "var", "min", "max"],
                                reduction_policy="streaming")
    with torch.no_grad():
        for _ in range(20):
            model(x)
        plain = forward_ms(model, x, forwards, repeats)
        with scope.track(model):
            for _ in range(20):
                model(x)
            tracked = forward_ms(model, x, forwards, repeats)
        plain_after = forward_ms(model, x, forwards, repeats)
    plain = min(plain, plain_after)  # the less disturbed of the two plain measurements
    print(f"toy model (48 x Linear(256, 256), batch 32, capture='both', 4 streaming reductions; "
          f"median of {repeats} x {forwards} forwards)")
    print(f"  plain forward   {plain:7.3f} ms")
    print(f"  with reductions {tracked:7.3f} ms   ratio {tracked / plain:.2f}x   "
          f"overhead {(tracked - plain) * 1e3 / 384:.2f} us per reduction update")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if a.quick:
        micro(updates=200, repeats=3)
        toy_model(forwards=20, repeats=3)
    else:
        micro(updates=2000, repeats=7)
        toy_model(forwards=200, repeats=5)
    print(f"load average after {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
