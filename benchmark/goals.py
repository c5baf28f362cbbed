"""The performance goals, evaluated on one run's records (PASS / FAIL / SKIP).

Each group is a function registered with :func:`benchmark.registry.register_goal`; a goal
with no figure (a mode it needs was skipped or failed) is SKIP with the reason.
"""

from __future__ import annotations

from typing import Any

from activationscope.sizes import format_bytes as fmt_bytes

from .registry import goal, missing, ratio, ratio_goal, record, register_goal

# The seed's published figures (toy model, its own machine): naive hooks vs scope.
SEED = {"naive_ms_per_forward": 3.13, "scope_ms_per_forward": 2.65, "speedup_vs_naive": 1.18}

R = dict[str, dict[str, Any]]


def side_by_side_goal(gid: str, text: str, r: R, wl: str, num: str, den: str, op: str,
                      threshold: float, floor: str | None = None) -> dict[str, Any]:
    """Goal on the median over rounds of ``num / den`` timed in the same round of ``side_by_side``
    (one process, interleaved; see ``benchmark/interleaved.py``). ``floor``: a part doing the
    same memory work without hooks, whose ratios to ``den`` and from ``num`` the note gives."""
    rec = record(r, wl, "side_by_side")
    ratios = {} if rec is None else ((rec.get("extra") or {}).get("ratio_median") or {})
    fig = ratios.get(f"{num}/{den}")
    note = missing(r, (wl, "side_by_side"))
    if rec is not None and fig is None:
        skipped = (rec.get("extra") or {}).get("skipped_parts") or {}
        note = "not measured: " + ("; ".join(f"{k}: {v}" for k, v in skipped.items()) or f"no {num}/{den} figure")
    info = ""
    if fig is not None and floor is not None and f"{floor}/{den}" in ratios and f"{num}/{floor}" in ratios:
        info = (f"{floor} (the same tensors held, no hooks) {ratios[f'{floor}/{den}']:.3f}x {den}; "
                f"{num} {ratios[f'{num}/{floor}']:.3f}x {floor}")
    return goal(gid, text + " (side by side in one process, median over rounds)", fig, op, threshold, note=note,
                info=info, rounds=round_ratios(rec, num, den) if fig is not None else None)


def round_ratios(rec: dict[str, Any] | None, num: str, den: str) -> list[float] | None:
    """``num / den`` of each round of an interleaved record (``part_repeat_s``, the cold round
    already left out), or None when the record has no per-round times of both parts."""
    times = ((rec or {}).get("extra") or {}).get("part_repeat_s") or {}
    a, b = times.get(num), times.get(den)
    if not a or not b:
        return None
    return [x / y for x, y in zip(a, b) if y > 0]


@register_goal
def in_memory(r: R) -> list[dict[str, Any]]:
    return [
        side_by_side_goal("toy_snapshot_vs_naive", "toy, in memory: SNAPSHOT <= 0.90x naive clone hooks", r,
                          "toy", "scope_snapshot", "naive_clone", "<=", 0.90),
        side_by_side_goal("toy_snapshot_vs_plain", "toy, in memory: SNAPSHOT <= 1.10x plain forward", r,
                          "toy", "scope_snapshot", "plain", "<=", 1.10, floor="copy_floor"),
        side_by_side_goal("toy_reference_vs_plain", "toy, in memory: REFERENCE <= 1.05x plain forward", r,
                          "toy", "scope_reference", "plain", "<=", 1.05, floor="keep_floor"),
        side_by_side_goal("toy_reductions_vs_plain",
                          "toy, streaming mean/var/min/max on every hook point: <= 1.25x plain", r,
                          "toy", "scope_reductions", "plain", "<=", 1.25),
    ]


@register_goal
def into_a_store(r: R) -> list[dict[str, Any]]:
    inter = record(r, "toy", "store_floor_interleaved")
    fig = None if inter is None else (inter.get("extra") or {}).get("store_vs_floor_median")
    return [
        goal("toy_store_vs_floor",
             "toy, into an uncompressed store: <= 1.15x max(plain forward, raw write of the same bytes), "
             "median over rounds measured interleaved in one process (store_floor_interleaved)",
             fig, "<=", 1.15, note=missing(r, ("toy", "store_floor_interleaved")),
             rounds=(inter.get("extra") or {}).get("store_vs_floor_per_round") if inter is not None else None),
        ratio_goal("toy_store_vs_torch_save", "toy, into a store: faster than per-batch torch.save (speedup > 1)", r,
                   ("toy", "torch_save"), ("toy", "scope_store"), ">", 1.0),
        ratio_goal("toy_store_vs_zarr_chunked",
                   "toy, into a store: faster than zarr-python with whole-chunk writes (speedup > 1)", r,
                   ("toy", "zarr_chunked"), ("toy", "scope_store"), ">", 1.0),
        side_by_side_goal("minilm_store_vs_plain", "MiniLM, every encoder layer into a store: <= 1.2x plain forward",
                          r, "minilm", "scope_store", "plain", "<=", 1.2),
    ]


def _disk_goal(gid: str, text: str, r: R, wl: str, peer: str) -> dict[str, Any]:
    ours, theirs = record(r, wl, "scope_store"), record(r, wl, peer)
    info = ((record(r, wl, "side_by_side") or {}).get("extra") or {}).get("part_info") or {}
    if (ours is None or theirs is None) and {"scope_store", peer} <= set(info):
        ours, theirs = info["scope_store"], info[peer]  # the same bytes, from the side-by-side rounds
    fig = None
    if ours and theirs and ours.get("stored_bytes") and theirs.get("stored_bytes"):
        fig = ours["stored_bytes"] / theirs["stored_bytes"]
    return goal(gid, text, fig, "<=", 1.0,
                note=missing(r, (wl, "scope_store"), (wl, peer)) if fig is None else "")


@register_goal
def peers(r: R) -> list[dict[str, Any]]:
    out = []
    for wl, peer, name in (("transformer", "saelens_runner", "SAELens CacheActivationsRunner"),
                           ("transformer", "tl_cache_torch_save", "TransformerLens run_with_cache + torch.save"),
                           ("transformer_all", "tl_cache_torch_save",
                            "TransformerLens run_with_cache + torch.save, every block")):
        tag = f"{wl}_store_vs_{peer}"
        out.append(side_by_side_goal(f"{tag}_speed",
                                     f"{wl}: capture into a store faster than {name} (tokens/s ratio > 1)",
                                     r, wl, peer, "scope_store", ">", 1.0))
        out.append(_disk_goal(f"{tag}_disk", f"{wl}: bytes on disk no larger than {name} (ratio <= 1)", r, wl, peer))
    return out


READBACK_BOUNDS = {"sequential": 1.0, "chunk_shuffled": 1.0, "shuffled": 0.8}


@register_goal
def readback(r: R) -> list[dict[str, Any]]:
    from .readback import ORDERS, WORKERS

    rb = r.get("readback", {})
    out = []
    for kind in ORDERS:
        for w in WORKERS:
            ours = rb.get(f"dl:acs:{kind}:w{w}", {}).get("rows_per_s")
            # against the in-RAM baseline: the two read side by side in one process, median over rounds
            sbs_mode = f"dl_side_by_side:{kind}:w{w}"
            sbs = rb.get(sbs_mode, {})
            sbs_ratio = (sbs.get("extra") or {}).get("acs_vs_tensor_batched_median") if sbs.get("status") == "ok" else None
            bound = READBACK_BOUNDS[kind]
            out.append(goal(f"readback_{kind}_w{w}", f"read-back, DataLoader {kind}, num_workers={w}, every batch "
                            f"consumed: ActivationDataset >= {bound}x rows/s of the in-RAM tensor read a batch at a "
                            "time (side by side in one process, median over rounds)", sbs_ratio, ">=", bound,
                            note=missing(r, ("readback", sbs_mode)),
                            # rows/s of ours over the baseline's: the baseline's time over ours, per round
                            rounds=round_ratios(sbs, "tensor_batched", "acs") if sbs_ratio is not None else None))
            theirs = rb.get(f"dl:hf:{kind}:w{w}", {}).get("rows_per_s")
            out.append(goal(f"readback_{kind}_w{w}_vs_hf", f"read-back, DataLoader {kind}, num_workers={w}, every "
                            f"batch consumed: ActivationDataset >= 1.0x rows/s of HF datasets", ratio(ours, theirs),
                            ">=", 1.0, note=missing(r, ("readback", f"dl:acs:{kind}:w{w}"), ("readback", f"dl:hf:{kind}:w{w}"))))
    op = rb.get("open_layer", {})
    ok = op.get("status") == "ok"
    layer = (op.get("extra") or {}).get("layer_bytes")
    size = fmt_bytes(layer) if layer else "1 GiB"
    out += [
        goal("open_layer_time", f"open a {size} uncompressed layer (open_store + store[hp]) < 10 ms",
             op.get("median_s") * 1e3 if ok else None, "<", 10.0, unit="ms", note=missing(r, ("readback", "open_layer"))),
        goal("open_layer_rss", f"RSS growth opening a {size} uncompressed layer < 1% of the layer",
             (op.get("extra") or {}).get("rss_growth_fraction", 0) * 100 if ok else None, "<", 1.0, unit="%",
             note=missing(r, ("readback", "open_layer"))),
    ]
    return out


def evaluate(results: R) -> list[dict[str, Any]]:
    """Every registered goal with its measured figure."""
    from .registry import GOALS, load_all

    load_all()
    out: list[dict[str, Any]] = []
    for fn in GOALS:
        out += fn(results)
    return out
