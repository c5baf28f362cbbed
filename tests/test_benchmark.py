"""Smoke test of the benchmark runner's machinery (``python -m benchmark.runner --quick``).

Not a timed test: a tiny workload runs through the real child processes, and the JSON it
writes must hold the documented keys (benchmark/README.md), consistent bytes and every goal.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from benchmark import goals, runner

README = Path(runner.REPO) / "benchmark" / "README.md"

TOP_KEYS = {"schema_version", "machine", "settings", "workloads", "results", "limits", "seed_comparison", "goals", "wall_s"}


def documented_keys() -> set[str]:
    text = README.read_text()
    section = text[text.index("## JSON"):]
    section = section[: section.index("\n## ", 10)] if "\n## " in section[10:] else section
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def flat_keys(doc: dict) -> set[str]:
    out: set[str] = set()

    def walk(obj, path):
        leaf_maps = ("workloads.*.captured_bytes_by_mode",)  # {mode: bytes}: documented as one key
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
        "--only", "readback/build_raw", "--only", "readback/open_layer", "--only", "readback/dl:*:sequential:w0",
    ]
    buf = io.StringIO()
    with redirect_stdout(buf):
        runner.main(argv)
    printed = buf.getvalue()
    doc = json.loads(out_json.read_text())

    assert set(doc) == TOP_KEYS
    undocumented = flat_keys(doc) - documented_keys()
    assert not undocumented, f"keys missing from benchmark/README.md: {sorted(undocumented)}"

    toy = doc["results"]["toy"]
    assert set(toy) == {"plain", "naive_clone", "scope_snapshot", "scope_store", "memcpy", "raw_write", "nnsight"}
    for mode in ("plain", "naive_clone", "scope_snapshot", "memcpy", "raw_write"):
        rec = toy[mode]
        assert rec["status"] == "ok", (mode, rec.get("note"), rec.get("traceback"))
        assert rec["n_forwards"] == 3 and rec["n_repeats"] == 1 and len(rec["repeat_s"]) == 1
        assert rec["cold_s"] > 0 and rec["median_s"] > 0 and rec["peak_rss_bytes"] > 0
    assert toy["plain"]["ratio_vs_plain"] == 1.0
    # every capture mode saw the same bytes: 3 forwards x 48 layers x (input + output) x 32 x 256 float32
    expected = 3 * 48 * 2 * 32 * 256 * 4
    for mode in ("naive_clone", "scope_snapshot", "memcpy", "raw_write"):
        assert toy[mode]["captured_bytes"] == expected, mode
    assert toy["scope_snapshot"]["n_hook_points"] == 96
    # a mode that cannot run is skipped with a note, never an error
    for mode in ("scope_store", "nnsight"):
        assert toy[mode]["status"] in ("ok", "skipped"), toy[mode]
        if toy[mode]["status"] == "skipped":
            assert toy[mode]["note"]
    for rec in doc["results"]["readback"].values():
        assert rec["status"] in ("ok", "skipped"), rec

    ids = [g["id"] for g in doc["goals"]]
    assert len(ids) == len(set(ids)) == 16
    for g in doc["goals"]:
        assert g["status"] in ("PASS", "FAIL", "SKIP")
        assert (g["measured"] is None) == (g["status"] == "SKIP")
        assert g["id"] in README.read_text() or g["id"].startswith("readback_")
    snap = next(g for g in doc["goals"] if g["id"] == "toy_snapshot_vs_plain")
    assert snap["measured"] == pytest.approx(toy["scope_snapshot"]["median_s"] / toy["plain"]["median_s"])
    assert doc["seed_comparison"]["seed"] == goals.SEED
    assert doc["machine"]["torch_threads"] == 1
    assert "goals:" in printed and ("[PASS]" in printed or "[FAIL]" in printed)
    # scratch folder removed
    assert not Path(doc["settings"]["workdir"]).exists()


def test_resnet18_definition_matches_torchvision_layout():
    """Without torchvision the conv workload runs benchmark.workloads.ResNet18: the same
    architecture (parameter count of torchvision's resnet18) and module names."""
    import torch

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
