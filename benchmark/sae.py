"""The SAE caching workload, side by side: ``python -m benchmark.sae``.

A TransformerLens ``HookedTransformer`` built from a config with random weights (no hub):
4 blocks, d_model 256 (8 heads of 32, MLP 1024, GELU, LayerNorm), vocabulary ``--vocab``
(default 1024), ``--seqs`` random sequences of 128 tokens, batch 16, one torch thread. Two cases: one hook point (``blocks.2.hook_resid_post``) and every block's
``hook_resid_post`` (4 hook points), all as token rows. Modes, each timed over the same
tokens:

- ``plain``: ``model(tokens)`` per batch, no capture (the full forward, unembedding included).
- ``scope_store``: ActivationScope into an uncompressed store (``rows="token"``), full forward.
- ``scope_store_stop``: the same with ``stop_after_last=True`` (the forward ends after the
  last tracked hook point).
- ``saelens_runner``: SAELens ``CacheActivationsRunner`` (HF datasets / Arrow shards, its own
  ``stop_at_layer``), its model loader pointed at the same model; one run per hook point
  (the runner caches one hook point per run), so the 4-hook case is 4 runs.

Before timing, the stores of both tools are checked against ``run_with_cache`` on the first
batch (exact equality): a tool that stores other values fails the run. Figures are tokens/s,
medians over ``--repeats`` timed repeats after a warm-up, the modes alternating within a
repeat. Goals (issue 16): ``scope_store_stop`` >= 1.0x SAELens's tokens/s with one hook
point, >= 2.0x with four.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch

from ._util import write_json

N_CTX = 128
BATCH = 16
D_MODEL = 256
ONE = ["blocks.2.hook_resid_post"]
ALL = [f"blocks.{i}.hook_resid_post" for i in range(4)]
GOALS = {"1 hook point": 1.0, "4 hook points": 2.0}


def build_model(vocab: int) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        cfg = HookedTransformerConfig(n_layers=4, d_model=D_MODEL, n_ctx=N_CTX, d_head=32, n_heads=8, d_mlp=1024,
                                      d_vocab=vocab, act_fn="gelu", normalization_type="LN", seed=0, device="cpu")
        return HookedTransformer(cfg).eval()


class Modes:
    def __init__(self, model: Any, tokens: torch.Tensor, workdir: str) -> None:
        self.model, self.tokens, self.workdir = model, tokens, workdir
        self._saelens = None

    def plain(self, hps: list[str]) -> None:
        with torch.no_grad():
            for b in self.tokens.split(BATCH):
                self.model(b)

    def _scope(self, hps: list[str], stop: bool) -> str:
        import activationscope as acs

        path = os.path.join(self.workdir, "scope.zarr")
        scope = acs.ActivationScope(store=path, store_options={"overwrite": True}, rows="token")
        with torch.no_grad(), scope.track(self.model, include=hps, stop_after_last=stop):
            for b in self.tokens.split(BATCH):
                self.model(b)
        return path

    def scope_store(self, hps: list[str]) -> str:
        return self._scope(hps, False)

    def scope_store_stop(self, hps: list[str]) -> str:
        return self._scope(hps, True)

    def _sae_setup(self) -> Any:
        if self._saelens is None:
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
            os.environ["TQDM_DISABLE"] = "1"
            import datasets
            import sae_lens.cache_activations_runner as car

            logging.getLogger("sae_lens").setLevel(logging.ERROR)
            datasets.disable_progress_bars()
            datasets.disable_caching()
            model = self.model
            car.load_model = lambda *a, **k: model  # the runner loads by name from the hub: hand it ours
            tokens = datasets.Dataset.from_dict({"input_ids": self.tokens.tolist()})
            self._saelens = (car, tokens)
        return self._saelens

    def saelens_runner(self, hps: list[str]) -> list[str]:
        from sae_lens.config import CacheActivationsRunnerConfig

        car, tokens = self._sae_setup()
        paths = []
        for hp in hps:  # one hook point per run
            path = os.path.join(self.workdir, f"saelens-{hp}")
            shutil.rmtree(path, ignore_errors=True)
            cfg = CacheActivationsRunnerConfig(
                new_cached_activations_path=path, dataset_path="benchmark-tokens",
                model_name="benchmark-random-hooked-transformer", model_batch_size=BATCH, hook_name=hp, d_in=D_MODEL,
                training_tokens=int(self.tokens.numel()), context_size=N_CTX, shuffle=False, dtype="float32",
                device="cpu", buffer_size_gb=4 * BATCH * N_CTX * D_MODEL * 4 / 1e9, prepend_bos=False,
                streaming=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                car.CacheActivationsRunner(cfg, override_dataset=tokens).run()
            paths.append(path)
        return paths


def check(modes: Modes, hps: list[str]) -> None:
    """Both tools store exactly run_with_cache's values (first batch of each hook point)."""
    import datasets

    import activationscope as acs

    first = modes.tokens[:BATCH]
    with torch.no_grad():
        _, cache = modes.model.run_with_cache(first, names_filter=hps)
    n = BATCH * N_CTX
    for fn in (modes.scope_store, modes.scope_store_stop):
        store = acs.open_store(fn(hps))
        for hp in hps:
            got = store[hp, 0:n]  # HookPoints are stored under their TransformerLens names
            if not torch.equal(got, cache[hp].reshape(n, D_MODEL)):
                raise RuntimeError(f"{fn.__name__}: {hp} differs from run_with_cache")
    for hp, path in zip(hps, modes.saelens_runner(hps)):
        ds = datasets.load_from_disk(path).with_format("torch")
        got = torch.cat([ds[i][hp] for i in range(BATCH)]).reshape(n, D_MODEL)
        if not torch.equal(got, cache[hp].reshape(n, D_MODEL)):
            raise RuntimeError(f"saelens_runner: {hp} differs from run_with_cache")


def measure(modes: Modes, hps: list[str], repeats: int) -> dict[str, float]:
    names = ["plain", "scope_store", "scope_store_stop", "saelens_runner"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn: Callable[[list[str]], Any] = getattr(modes, name)
            t = time.perf_counter()
            fn(hps)
            times[name].append(time.perf_counter() - t)
    n_tok = int(modes.tokens.numel())
    return {name: n_tok / statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.sae", description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=512, help="sequences of 128 tokens (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats (default: %(default)s)")
    p.add_argument("--workdir", default=None, help="parent of the scratch folder")
    p.add_argument("--json", default=None, help="write the figures as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    work = tempfile.mkdtemp(prefix="acs-sae-", dir=args.workdir)
    out: dict[str, Any] = {"seqs": args.seqs, "n_ctx": N_CTX, "batch": BATCH, "vocab": args.vocab,
                           "repeats": args.repeats, "cases": {}}
    try:
        model = build_model(args.vocab)
        tokens = torch.randint(0, args.vocab, (args.seqs, N_CTX), generator=torch.Generator().manual_seed(0))
        modes = Modes(model, tokens, work)
        for label, hps in (("1 hook point", ONE), ("4 hook points", ALL)):
            check(modes, hps)  # also the warm-up of every mode
            rates = measure(modes, hps, args.repeats)
            ratio = rates["scope_store_stop"] / rates["saelens_runner"]
            out["cases"][label] = {"hook_points": hps, "tokens_per_s": rates, "stop_vs_saelens": ratio,
                                   "goal": GOALS[label], "met": ratio >= GOALS[label]}
            print(f"{label}: " + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()) + " tok/s; "
                  f"early stop / SAELens {ratio:.2f}x (goal >= {GOALS[label]:.1f}x: "
                  f"{'met' if ratio >= GOALS[label] else 'NOT met'})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
