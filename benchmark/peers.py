"""Peers a researcher would pick instead of ActivationScope (the optional `bench` extra).

nnsight and TorchLens on the toy model; SAELens's ``CacheActivationsRunner`` and
TransformerLens ``run_with_cache`` on a ``HookedTransformer`` built from a config with random
weights (no hub access: ``HF_HUB_OFFLINE=1``), same tokens into the same hook points. A
peer whose package is missing is skipped with a note; anything else is an error.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from activationscope.sizes import dir_bytes

from ._util import remove
from .capture import Mode, leaf_tensors, selected_modules
from .registry import register_mode, require_optional
from .workloads import Workload


class NNsightMode(Mode):
    """nnsight ``NNsight(model).trace(x)`` saving every selected module's input and/or output.

    ``clone=False``: ``.save()`` keeps references to the model's tensors (like REFERENCE);
    ``clone=True``: ``.clone().save()`` copies them (like SNAPSHOT).
    """

    def __init__(self, wl: Workload, ctx: dict[str, Any], clone: bool) -> None:
        super().__init__(wl, ctx)
        self.clone = clone

    def setup(self) -> None:
        require_optional("nnsight", "bench", "nnsight")
        from nnsight import NNsight

        self.nm = NNsight(self.wl.model)
        self.envoys = []
        for name, _mod in selected_modules(self.wl):
            env = self.nm
            for part in name.split("."):
                env = getattr(env, part)
            self.envoys.append(env)

    def run(self, i: int) -> None:
        wl = self.wl
        saved = []
        cap_in, cap_out = wl.capture in ("input", "both"), wl.capture in ("output", "both")
        for f in range(wl.n_forwards):
            b = wl.batch(f)
            with self.nm.trace(**b) if isinstance(b, dict) else self.nm.trace(b):
                for env in self.envoys:
                    if cap_in:
                        saved.append(env.input.clone().save() if self.clone else env.input.save())
                    if cap_out:
                        saved.append(env.output.clone().save() if self.clone else env.output.save())
        self.saved = saved

    def describe(self) -> dict[str, Any]:
        total = 0
        for s in self.saved:
            v = getattr(s, "value", s)
            total += sum(t.nbytes for t in leaf_tensors(v))
        return {"captured_bytes": total}

    def reset(self) -> None:
        self.saved = None


register_mode("nnsight", peer=True, workloads=("toy",), optional=True, slow=True, quick=False,
              doc="nnsight NNsight(model).trace(x), .save() of every selected module's input and output: keeps "
              "references (compare with scope_reference)")(lambda wl, ctx: NNsightMode(wl, ctx, clone=False))
register_mode("nnsight_clone", peer=True, workloads=("toy",), optional=True, slow=True, quick=False,
              doc="the same with .clone().save(): copies (compare with scope_snapshot)")(
    lambda wl, ctx: NNsightMode(wl, ctx, clone=True))


@register_mode("torchlens", peer=True, workloads=("toy",), optional=True, slow=True, quick=False, own_interpreter=True,
               doc="TorchLens trace(model, x) (2.x; log_forward_pass(..., layers_to_save='all') before) per "
               "forward, saving every op's output (every op, not only modules)")
class TorchLensMode(Mode):
    def setup(self) -> None:
        require_optional("torchlens", "bench", "TorchLens")
        import torchlens

        self.tl = torchlens

    def run(self, i: int) -> None:
        wl = self.wl
        logs = []
        trace = getattr(self.tl, "trace", None)
        for f in range(wl.n_forwards):
            b = wl.batch(f)
            if trace is not None:  # TorchLens 2.x: saves every op's output by default
                logs.append(trace(wl.model, None, input_kwargs=b) if isinstance(b, dict) else trace(wl.model, b))
            else:
                x = b if not isinstance(b, dict) else [b]
                logs.append(self.tl.log_forward_pass(wl.model, x, layers_to_save="all", vis_opt="none"))
        self.logs = logs

    def describe(self) -> dict[str, Any]:
        """Bytes TorchLens saved (every op's output, so more than the modules' outputs)."""
        total = 0
        for log in self.logs or []:
            for layer in getattr(log, "layer_list", []):
                v = getattr(layer, "out", None)
                if v is None:
                    v = getattr(layer, "tensor_contents", None)
                total += sum(t.nbytes for t in leaf_tensors(v)) if v is not None else 0
        return {"captured_bytes": total} if total else {}

    def reset(self) -> None:
        self.logs = None


# ----------------------------------------------------------------- TransformerLens, SAELens
class _TLMode(Mode):
    """Base of the TransformerLens modes: the workload's hook points and forward arguments."""

    def setup(self) -> None:
        require_optional("transformer_lens", "bench", "TransformerLens")
        self.hook_points = list(self.wl.info["hook_points"])
        self.stop = self.wl.call_kwargs.get("stop_at_layer")

    def _cache(self, f: int) -> dict[str, torch.Tensor]:
        _logits, cache = self.wl.model.run_with_cache(self.wl.batch(f), names_filter=self.hook_points,
                                                      stop_at_layer=self.stop)
        return {hp: cache[hp] for hp in self.hook_points}


@register_mode("tl_run_with_cache", peer=True, workloads=("transformer", "transformer_all"), optional=True, quick=False,
               doc="TransformerLens model.run_with_cache(tokens, names_filter=<hook points>, stop_at_layer=...) per "
               "forward, the ActivationCache kept in memory (compare with scope_snapshot)")
class TLRunWithCache(_TLMode):
    def run(self, i: int) -> None:
        self.caches = [self._cache(f) for f in range(self.wl.n_forwards)]

    def describe(self) -> dict[str, Any]:
        # token rows: (batch, pos, d) -> batch * pos rows, the same bytes
        return {"captured_bytes": sum(t.nbytes for c in self.caches for t in c.values()),
                "n_hook_points": len(self.hook_points)}

    def reset(self) -> None:
        self.caches = None


@register_mode("tl_cache_torch_save", peer=True, workloads=("transformer", "transformer_all"), optional=True,
               quick=False,
               doc="TransformerLens run_with_cache per forward, then torch.save({hook point: tensor}, batch-N.pt): "
               "one file per batch")
class TLCacheTorchSave(_TLMode):
    def run(self, i: int) -> None:
        self.dir = os.path.join(self.workdir, f"tl_cache_torch_save-{i}")
        os.makedirs(self.dir)
        for f in range(self.wl.n_forwards):
            with open(os.path.join(self.dir, f"batch-{f:06d}.pt"), "wb") as fh:
                torch.save(self._cache(f), fh)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())

    def describe(self) -> dict[str, Any]:
        d = self.wl.info["d_model"]
        rows = sum(self.wl.rows(f) for f in range(self.wl.n_forwards))
        return {"stored_bytes": dir_bytes(self.dir), "captured_bytes": rows * d * 4 * len(self.hook_points)}

    def reset(self) -> None:
        remove(self.dir)


@register_mode("saelens_runner", peer=True, workloads=("transformer",), optional=True, quick=False,
               doc="SAELens CacheActivationsRunner(cfg, override_dataset=<the tokens as an HF Dataset>).run() on the "
               "same HookedTransformer (its model loader is pointed at the workload's model: no hub), one hook "
               "point, HF datasets / Arrow shards on disk, shuffle=False; one buffer per 4 forwards")
class SAELensRunner(Mode):
    def setup(self) -> None:
        require_optional("sae_lens", "bench", "SAELens")
        require_optional("datasets", "bench", "HF datasets")
        import logging
        import warnings

        warnings.simplefilter("ignore")
        logging.getLogger("sae_lens").setLevel(logging.ERROR)
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ["TQDM_DISABLE"] = "1"
        import datasets
        import sae_lens.cache_activations_runner as car

        datasets.disable_progress_bars()
        datasets.disable_caching()
        wl = self.wl
        self.car = car
        # the runner loads its model by name from the hub: hand it the workload's model instead
        car.load_model = lambda *a, **k: wl.model
        toks = torch.cat([wl.batch(f) for f in range(wl.n_forwards)])
        self.tokens = datasets.Dataset.from_dict({"input_ids": toks.tolist()})
        self.n_tokens = int(toks.numel())
        ctx_len = int(toks.shape[1])
        d = wl.info["d_model"]
        batch = int(wl.batch(0).shape[0])
        # buffer_size_gb fixes the tokens per buffer (a shard): 4 model batches
        buffer_tokens = 4 * batch * ctx_len
        self.cfg_kw = dict(
            dataset_path="benchmark-tokens", model_name="benchmark-random-hooked-transformer",
            model_batch_size=batch, hook_name=wl.info["hook_points"][0], d_in=d,
            training_tokens=self.n_tokens, context_size=ctx_len, shuffle=False, dtype="float32", device="cpu",
            buffer_size_gb=buffer_tokens * d * 4 / 1e9, prepend_bos=False, streaming=False,
        )
        self.path = None

    def run(self, i: int) -> None:
        from sae_lens.config import CacheActivationsRunnerConfig

        self.path = os.path.join(self.workdir, f"saelens-{i}")
        cfg = CacheActivationsRunnerConfig(new_cached_activations_path=self.path, **self.cfg_kw)
        self.ds = self.car.CacheActivationsRunner(cfg, override_dataset=self.tokens).run()

    def describe(self) -> dict[str, Any]:
        hp = self.cfg_kw["hook_name"]
        n = len(self.ds)
        shape = self.ds.features[hp].shape
        rows = n * shape[0]
        if rows != self.n_tokens:
            raise RuntimeError(f"SAELens cached {rows} token rows, expected {self.n_tokens}")
        return {"stored_bytes": dir_bytes(self.path), "captured_bytes": rows * shape[1] * 4, "n_hook_points": 1}

    def reset(self) -> None:
        self.ds = None
        if self.path:
            remove(self.path)
