"""``Store.info()["pending_ranks"]`` and ``activationscope info``: rank stores under ``ranks/``
waiting for ``consolidate`` (store/FORMAT.md section 10). A capture again of a committed store
was not shown at all (info described the committed store alone), and an uncommitted multi-rank
store was shown without its world size, its missing ranks or whether it could be committed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope import cli
from activationscope.store.ranks import capture_again_run_id

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import torchrun_capture as job  # noqa: E402
from test_capture_again import _committed, _model, _task  # noqa: E402

ROWS = {f"{i}.output": 7 * job.BATCH for i in range(6)}  # a task of 3 captures 7 of the 21 batches of 7 rows


def _dies_at_second_forward(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` raising at its second forward (as a task stopped part way); its hook points unchanged."""
    calls = []

    def stop(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the task was stopped")

    model.register_forward_pre_hook(stop)
    return model


def _info(url: str, capsys) -> str:
    assert cli.main(["info", url]) == 0
    return capsys.readouterr().out


def test_info_of_a_committed_store_shows_a_capture_again_waiting_in_ranks(tmp_path, capsys):
    url = str(tmp_path / "s.zarr")
    old = _committed(url, None, 2, _model(0))
    assert "pending_ranks" not in old.info() and "ranks:" not in _info(url, capsys)
    run = capture_again_run_id(dict(old.attrs), (Path(url) / "zarr.json").read_bytes())
    _task(url, None, 0, 3, _model(1), overwrite=True)
    with pytest.raises(RuntimeError, match="stopped"):
        _task(url, None, 1, 3, _dies_at_second_forward(_model(1)), overwrite=True)
    st = acs.open_store(url)
    info = st.info()
    assert info["status"] == "complete" and info["n_samples"] == old.n_samples  # the store as it reads
    p = info["pending_ranks"]
    assert p["capture"] == "again" and p["run_id"] == run and p["world_size"] == 3
    assert [e["rank"] for e in p["ranks"]] == [0, 1]
    assert p["ranks"][0] == {"rank": 0, "status": "complete", "n_samples": 7 * job.BATCH, "n_rows": ROWS,
                             "world_size": 3}
    assert p["ranks"][1]["status"] == "incomplete" and p["ranks"][1]["n_samples"] == 0  # (no whole shard yet)
    assert (p["missing"], p["n_missing"], p["incomplete"], p["beyond"], p["other_runs"], p["ready"]) == (
        [2], 1, [1], [], [], False)
    out = _info(url, capsys)
    assert "status:   complete, 147 samples" in out
    assert (f"ranks:    a capture again of this store waits in ranks/ (run {run}, 3 ranks), not committed: the "
            "store reads its current rows (147 samples) until it is") in out, out
    assert "rank 0: complete, 49 samples, 49 rows per hook point" in out
    assert "rank 1: incomplete, 0 samples, " in out and "missing: rank(s) [2]" in out
    assert ("next:     run the task(s) of rank(s) [2] with store_options overwrite=True, as the others; resume rank(s) "
            f"[1] (store_options resume=True) until complete; then `activationscope consolidate {url}` commits them, "
            "replacing the store's current rows") in out, out
    assert cli.main(["info", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pending_ranks"] == json.loads(json.dumps(p))
    _task(url, None, 1, 3, _model(1), resume=True)
    _task(url, None, 2, 3, _model(1), overwrite=True)
    p = acs.open_store(url).info()["pending_ranks"]
    assert p["ready"] and p["incomplete"] == [] and p["missing"] == [] and len(p["ranks"]) == 3
    out = _info(url, capsys)
    assert (f"next:     all 3 ranks are complete: `activationscope consolidate {url}` commits them, replacing the "
            "store's current rows") in out, out
    assert cli.main(["consolidate", url]) == 0
    capsys.readouterr()
    st = acs.open_store(url)
    assert st.attrs["run_id"] == run and "pending_ranks" not in st.info() and "ranks:" not in _info(url, capsys)


def test_info_of_an_uncommitted_multi_rank_store_names_its_missing_ranks_and_what_to_run(tmp_path, capsys):
    url = str(tmp_path / "u.zarr")
    _task(url, None, 1, 3, _model(0))
    st = acs.open_store(url)
    p = st.info()["pending_ranks"]
    assert p["capture"] == "this" and p["run_id"] == st.attrs["distributed"]["run_id"] and p["world_size"] == 3
    assert [e["rank"] for e in p["ranks"]] == [1] and p["ranks"][0]["status"] == "complete"
    assert (p["missing"], p["n_missing"], p["incomplete"], p["ready"]) == ([0, 2], 2, [], False)
    out = _info(url, capsys)
    assert f"ranks:    not committed: a capture by 3 ranks (run {p['run_id']}); shown are the rows of rank stores [1]" in out
    assert "rank 1: complete, 49 samples, 49 rows per hook point" in out and "missing: rank(s) [0, 2]" in out
    assert (f"next:     run the task(s) of rank(s) [0, 2]; then `activationscope consolidate {url}` commits them into "
            "one store") in out, out
    for task in (0, 2):
        _task(url, None, task, 3, _model(0))
    assert acs.open_store(url).info()["pending_ranks"]["ready"]
    assert (f"next:     all 3 ranks are complete: `activationscope consolidate {url}` commits them into one "
            "store") in _info(url, capsys)


def test_info_of_a_store_whose_ranks_folder_cannot_be_read_says_so_and_describes_the_store(tmp_path, capsys):
    """info() of a committed store whose ranks/ is a link leaving the store raised
    StoreCorruptError (the listing of ranks/ refuses it), though the store opens and its rows
    read: info describes the store and says why its rank stores cannot be read."""
    url = str(tmp_path / "s.zarr")
    old = _committed(url, None, 2, _model(0))
    expected = old.info()
    (tmp_path / "elsewhere").mkdir()
    (Path(url) / "ranks").symlink_to(tmp_path / "elsewhere")
    info = acs.open_store(url).info()
    p = info.pop("pending_ranks")
    assert info == expected  # the store as it reads
    assert p["capture"] == "unreadable" and not p["ready"] and p["ranks"] == []
    assert "'ranks/' resolves to" in p["error"] and "outside the store" in p["error"]
    out = _info(url, capsys)
    assert "status:   complete, 147 samples" in out
    assert "ranks:    the rank stores under ranks/ cannot be read: store " in out and "outside the store" in out
    assert "next:" not in out


def test_info_says_consolidate_removes_a_rank_store_of_another_run_beside_a_ready_capture(tmp_path, capsys):
    """A rank store of another run beyond the world size of a ready capture again was shown as
    "no part of it" under a next: line saying consolidate commits the others; consolidate then
    removed it with them (every rank store under ranks/ goes once the commit lands)."""
    url = str(tmp_path / "s.zarr")
    _committed(url, None, 2, _model(0))
    for task in (0, 1):
        _task(url, None, task, 2, _model(1), overwrite=True)
    import shutil
    shutil.copytree(Path(url) / "ranks" / "00000", Path(url) / "ranks" / "00002")
    doc = json.loads((Path(url) / "ranks" / "00002" / "zarr.json").read_text())
    doc["attributes"]["activationscope"]["rank_store"]["run_id"] = "0" * 32
    (Path(url) / "ranks" / "00002" / "zarr.json").write_text(json.dumps(doc))
    p = acs.open_store(url).info()["pending_ranks"]
    assert p["capture"] == "again" and p["other_runs"] == [2] and p["ready"]
    out = _info(url, capsys)
    assert ("of another run, no part of it: rank store(s) [2]; consolidate removes them with the others once it "
            "commits: move them away first if you keep them") in out, out
    assert cli.main(["consolidate", url]) == 0  # (what info said: the rank store of the other run is gone)
    assert not (Path(url) / "ranks" / "00002").exists()


def test_info_tells_a_rank_store_still_being_written_from_one_to_resume(tmp_path, capsys):
    """While task 1 was still capturing, info said to resume rank 1, which its running task
    would refuse (it holds the lock) or, once it finished, capture its rows twice. The rank
    store is now named as being written by its task, and what to run is to wait for it (a task
    that stopped part way is still to be resumed: the capture-again test above)."""
    import os

    url = str(tmp_path / "u.zarr")
    _task(url, None, 0, 2, _model(0))
    model = _model(0)
    with acs.ActivationScope(store=url, store_options={**job.STORE_OPTIONS, "process_group": acs.RankStore(1, 2)}
                             ).track(model) as tracker, torch.no_grad():
        model(job.batch(1))
        tracker.writer.commit()
        p = acs.open_store(url).info()["pending_ranks"]
        assert p["incomplete"] == [1] and f"pid {os.getpid()}" in p["ranks"][1]["writer"], p
        out = _info(url, capsys)
        assert f"rank 1: incomplete, being written by pid {os.getpid()} on host" in out, out
        assert "next:     wait for the task(s) writing rank(s) [1] to finish; then" in out and "resume" not in out, out
    p = acs.open_store(url).info()["pending_ranks"]
    assert p["ready"] and "writer" not in p["ranks"][1]
