"""The performance goals, evaluated on one run's records (PASS / FAIL / SKIP)."""

from __future__ import annotations

from typing import Any

from activationscope.sizes import format_bytes as fmt_bytes

from .readback import ORDERS, WORKERS

# The seed's published figures (toy model, its own machine): naive hooks vs scope.
SEED = {"naive_ms_per_forward": 3.13, "scope_ms_per_forward": 2.65, "speedup_vs_naive": 1.18}


def _median(results: dict[str, dict[str, Any]], workload: str, mode: str) -> float | None:
    rec = results.get(workload, {}).get(mode)
    if not rec or rec.get("status") != "ok":
        return None
    return rec.get("median_s")


def _goal(gid: str, text: str, measured: float | None, op: str, threshold: float, unit: str = "x",
          missing: str = "") -> dict[str, Any]:
    if measured is None:
        status = "SKIP"
    elif op == "<=":
        status = "PASS" if measured <= threshold else "FAIL"
    elif op == "<":
        status = "PASS" if measured < threshold else "FAIL"
    elif op == ">=":
        status = "PASS" if measured >= threshold else "FAIL"
    else:  # ">"
        status = "PASS" if measured > threshold else "FAIL"
    return {"id": gid, "goal": text, "measured": measured, "op": op, "threshold": threshold, "unit": unit,
            "status": status, "note": missing if measured is None else ""}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def evaluate(results: dict[str, dict[str, Any]], durability: str) -> list[dict[str, Any]]:
    """Every goal with its measured figure. ``durability`` picks the raw-write floor."""
    m = lambda w, k: _median(results, w, k)  # noqa: E731
    plain = m("toy", "plain")

    def miss(*modes: str) -> str:
        bad = []
        for key in modes:
            w, _, mo = key.partition("/")
            rec = results.get(w, {}).get(mo)
            if rec is None:
                bad.append(f"{key} not run")
            elif rec.get("status") != "ok":
                bad.append(f"{key} {rec.get('status')}: {rec.get('note', '')[:100]}")
        return "not measured: " + "; ".join(bad or ["no figure"])
    goals = [
        _goal("toy_snapshot_vs_naive", "toy, in memory: SNAPSHOT <= 0.90x naive clone hooks",
              _ratio(m("toy", "scope_snapshot"), m("toy", "naive_clone")), "<=", 0.90,
              missing=miss("toy/scope_snapshot", "toy/naive_clone")),
        _goal("toy_snapshot_vs_plain", "toy, in memory: SNAPSHOT <= 1.12x plain forward",
              _ratio(m("toy", "scope_snapshot"), plain), "<=", 1.12, missing=miss("toy/scope_snapshot", "toy/plain")),
        _goal("toy_reference_vs_plain", "toy, in memory: REFERENCE <= 1.05x plain forward",
              _ratio(m("toy", "scope_reference"), plain), "<=", 1.05, missing=miss("toy/scope_reference", "toy/plain")),
    ]
    raw_mode = "raw_write_fsync" if durability == "fsync" else "raw_write"
    raw = m("toy", raw_mode)
    floor = None if plain is None or raw is None else max(plain, raw)
    store = m("toy", "scope_store")
    goals += [
        _goal("toy_store_vs_floor",
              f"toy, into a store: wall <= 1.15x max(plain forward, bytes / raw write bandwidth) ({raw_mode})",
              _ratio(store, floor), "<=", 1.15, missing=miss("toy/scope_store", f"toy/{raw_mode}")),
        _goal("toy_store_vs_zarr_append", "toy, into a store: >= 10x faster than per-batch zarr-python appends",
              _ratio(m("toy", "zarr_append"), store), ">=", 10.0, missing=miss("toy/scope_store", "toy/zarr_append")),
        _goal("toy_store_vs_torch_save", "toy, into a store: faster than per-batch torch.save (speedup > 1)",
              _ratio(m("toy", "torch_save"), store), ">", 1.0, missing=miss("toy/scope_store", "toy/torch_save")),
        _goal("minilm_store_vs_plain", "MiniLM, every encoder layer into a store: <= 1.2x plain forward",
              _ratio(m("minilm", "scope_store"), m("minilm", "plain")), "<=", 1.2,
              missing=miss("minilm/scope_store", "minilm/plain")),
        _goal("toy_reductions_vs_plain", "toy, streaming mean/var/min/max on every hook point: <= 1.25x plain",
              _ratio(m("toy", "scope_reductions"), plain), "<=", 1.25, missing=miss("toy/scope_reductions", "toy/plain")),
    ]
    rb = results.get("readback", {})
    for kind in ORDERS:
        for w in WORKERS:
            ours = rb.get(f"dl:acs:{kind}:w{w}", {}).get("rows_per_s")
            ram = rb.get(f"dl:tensor:{kind}:w{w}", {}).get("rows_per_s")
            goals.append(_goal(
                f"readback_{kind}_w{w}",
                f"read-back, DataLoader {kind}, num_workers={w}: ActivationDataset >= 0.8x rows/s of in-RAM TensorDataset",
                _ratio(ours, ram), ">=", 0.8, missing=miss(f"readback/dl:acs:{kind}:w{w}", f"readback/dl:tensor:{kind}:w{w}"),
            ))
    op = rb.get("open_layer", {})
    ok = op.get("status") == "ok"
    layer = (op.get("extra") or {}).get("layer_bytes")
    size = fmt_bytes(layer) if layer else "1 GiB"
    goals += [
        _goal("open_layer_time", f"open a {size} uncompressed layer (open_store + store[hp]) < 10 ms",
              op.get("median_s") * 1e3 if ok else None, "<", 10.0, unit="ms", missing=miss("readback/open_layer")),
        _goal("open_layer_rss", f"RSS growth opening a {size} uncompressed layer < 1% of the layer",
              (op.get("extra") or {}).get("rss_growth_fraction", None) * 100 if ok else None, "<", 1.0, unit="%",
              missing=miss("readback/open_layer")),
    ]
    return goals
