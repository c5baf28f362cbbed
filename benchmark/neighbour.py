"""What work on another CPU costs the model's forward: ``python -m benchmark.neighbour [--json PATH]``.

A capture's writer thread, a second rank, a data loader worker: each runs on another CPU
than the forward. On a machine whose CPUs share a core's resources (vCPUs that are the two
hardware threads of one core, or one memory bus), that work slows the forward itself, and no
capture can then cost less than what its background work costs the forward this way. This
measures it, with no ActivationScope code involved: the toy model's plain forward (48 x
``Linear(256, 256)``, batch 32, one torch thread) alone, and beside a neighbour process
(a separate process, so no GIL is shared) that either spins on integer additions (``alu``)
or copies a 32 MiB buffer over and over (``memory``). Rounds alternate the three
conditions; it reports the median ms per forward of each and the median ratio to the
forward alone within a round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

from ._util import write_json

NEIGHBOURS = {
    "alu": "x = 0\nwhile True:\n    x += 1\n",
    "memory": (
        "import numpy as np\n"
        "a = np.ones(32 << 20, dtype=np.uint8)\n"
        "b = np.empty_like(a)\n"
        "while True:\n"
        "    np.copyto(b, a)\n"
    ),
}


def measure(n_forwards: int = 300, rounds: int = 5, settle_s: float = 0.3) -> dict[str, Any]:
    """Median ms per forward alone and beside each neighbour, and the ratios (see module doc).

    Returns ``{"ms_per_forward": {cond: ms}, "ratio_vs_alone": {neighbour: x}, "rounds": n,
    "n_forwards": n}``; ``ms_per_forward`` holds every round's figure under ``"repeat_ms"``.
    """
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(48)]).eval()
    x = torch.randn(32, 256)

    def run() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            for _ in range(n_forwards):
                model(x)
        return (time.perf_counter() - t) / n_forwards * 1e3

    run()  # warm
    times: dict[str, list[float]] = {"alone": [], **{k: [] for k in NEIGHBOURS}}
    for _ in range(rounds):
        times["alone"].append(run())
        for name, code in NEIGHBOURS.items():
            p = subprocess.Popen([sys.executable, "-c", code])
            try:
                time.sleep(settle_s)  # the neighbour is running (numpy imported, buffers touched)
                if p.poll() is not None:
                    raise RuntimeError(f"the {name} neighbour process exited with {p.returncode}")
                times[name].append(run())
            finally:
                p.kill()
                p.wait()
    return {
        "n_forwards": n_forwards,
        "rounds": rounds,
        "ms_per_forward": {k: statistics.median(v) for k, v in times.items()},
        "repeat_ms": times,
        "ratio_vs_alone": {k: statistics.median(a / b for a, b in zip(times[k], times["alone"])) for k in NEIGHBOURS},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.neighbour", description=__doc__.split("\n\n")[0])
    ap.add_argument("--forwards", type=int, default=300, help="forwards per timed repeat (default 300)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the three conditions (default 5)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    out = measure(args.forwards, args.rounds)
    ms, ratio = out["ms_per_forward"], out["ratio_vs_alone"]
    print(f"toy plain forward, {args.rounds} rounds of {args.forwards} forwards, medians:")
    print(f"  alone            {ms['alone']:.3f} ms per forward")
    for name in NEIGHBOURS:
        print(f"  beside {name:9s} {ms[name]:.3f} ms per forward ({ratio[name]:.3f}x alone)")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
