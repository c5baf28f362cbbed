"""``activationscope capture`` under ``torchrun --standalone --nproc_per_node=2`` (gloo, CPU).

Each rank captures its contiguous part of the data (``partition_bounds``) into one store.
References: the library's own multi-rank capture of the same rows (``RankStore`` tasks, then
``commit_ranks``), and a one-process ``activationscope capture`` of the same data, its rows put
in the documented order (store/FORMAT.md section 10).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import activationscope as acs
from activationscope import cli
from activationscope.data.samplers import partition_bounds
from activationscope.store.ranks import commit_ranks

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
CONSOLE_SCRIPT = Path(sys.executable).with_name("activationscope")
WORLD, N, BATCH, POISON = 2, 53, 6, 50  # sample POISON lies in rank 1's part, [26, 53)
S = 16384  # the shard rows of a multi-rank capture (the command takes no --shard-bytes there)

FACTORY = textwrap.dedent('''
    import os
    import torch


    class Fussy(torch.nn.Module):
        """An MLP that raises on a sample whose first value is above FUSSY_LIMIT, where that is set."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))

        def forward(self, x):
            if os.environ.get("FUSSY_KILL_RANK") == os.environ.get("RANK", "-"):
                os.kill(os.getpid(), 9)  # (SIGKILL: no cleanup of any kind)
            limit = os.environ.get("FUSSY_LIMIT")
            if limit is not None and bool((x[:, 0] > float(limit)).any()):
                raise ValueError(f"a sample above {limit}")
            return self.net(x)


    def fussy():
        return Fussy()
''')

# ``python -m commitkill ARGS``: ``activationscope ARGS`` whose rank 0 is SIGKILLed in the commit of
# the rank stores, at the step KILL_STEP names: ``tail`` (writing its first re-chunked tail shard:
# every rank store complete, nothing of the commit done) or ``root`` (writing the root zarr.json,
# the commit point: everything else of the commit written)
COMMIT_KILL = textwrap.dedent('''
    import os
    import sys

    from activationscope.__main__ import main
    from activationscope.store import ranks


    def killed(*args, **kwargs):
        os.kill(os.getpid(), 9)  # (SIGKILL: no cleanup of any kind)


    if os.environ.get("RANK") == "0":
        if os.environ["KILL_STEP"] == "tail":
            ranks._TailWriter.write = killed
        else:
            ranks._put_root = killed
    sys.exit(main())
''')


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder holding the model factory ``toycli:fussy`` and ``inputs.npy`` (N samples of 6
    float32; sample POISON's first value 50), the current directory of the commands."""
    (tmp_path / "toycli.py").write_text(FACTORY)
    x = np.random.default_rng(0).standard_normal((N, 6)).astype(np.float32)
    x[:, 0] = np.clip(x[:, 0], -5, 5)
    x[POISON, 0] = 50
    np.save(tmp_path / "inputs.npy", x)
    (tmp_path / "commitkill.py").write_text(COMMIT_KILL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "FUSSY_LIMIT", "FUSSY_KILL_RANK",
              "KILL_STEP"):
        monkeypatch.delenv(k, raising=False)
    sys.modules.pop("toycli", None)
    return tmp_path


def _capture_args(out: str, *extra: str) -> list[str]:
    return ["capture", "--model", "toycli:fussy", "--data", "inputs.npy", "--out", out, "--reduce", "mean,var",
            "--batch-size", str(BATCH), "--no-progress", *extra]


def _torchrun(workdir: Path, args: list[str], *, script: bool = False, env: dict | None = None,
              module: str = "activationscope") -> dict:
    """Run ``activationscope ARGS`` under torchrun (``-m MODULE``, or the console script with
    ``--no-python``); the return code and each rank's stdout and stderr."""
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [sys.executable, "-m", "torch.distributed.run"]
    program = ["--no-python", str(CONSOLE_SCRIPT)] if script else ["-m", module]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), str(workdir)]), "OMP_NUM_THREADS": "1",
           **(env or {})}
    logs = Path(tempfile.mkdtemp(prefix="acs-torchrun-cli-"))
    env["TMPDIR"] = str(logs)  # (torchrun leaves torchelastic_* folders in TMPDIR)
    try:
        done = subprocess.run([*launcher, "--standalone", f"--nproc_per_node={WORLD}", "--monitor-interval=1",
                               "--log-dir", str(logs / "logs"), "--redirects", "3", *program, *args],
                              cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
        ranks = {}
        for r in range(WORLD):
            found = {p.name: p.read_text() for p in (logs / "logs").glob(f"*/attempt_0/{r}/std*.log")}
            ranks[r] = (found.get("stdout.log", ""), found.get("stderr.log", ""))
        return {"rc": done.returncode, "ranks": ranks, "torchrun": done.stderr}
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _library_ranks(path: Path, x: torch.Tensor) -> None:
    """The library's multi-rank capture of the rows the command's ranks capture: task r takes
    ``partition_bounds(N, r, WORLD)`` in batches of BATCH with global sample ids, then one commit."""
    sys.modules.pop("toycli", None)
    import toycli

    model = toycli.fussy().eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): the same kernels, the same bits
    try:
        _library_tasks(path, model, x)
    finally:
        torch.set_num_threads(threads)
    commit_ranks(str(path))


def _library_tasks(path: Path, model: torch.nn.Module, x: torch.Tensor) -> None:
    for r in range(WORLD):
        lo, hi = partition_bounds(len(x), r, WORLD)
        scope = acs.ActivationScope(store=str(path), reductions=["mean", "var"],
                                    store_options={"process_group": acs.RankStore(r, WORLD)})
        with scope.track(model) as tracker, torch.inference_mode():
            for s in range(lo, hi, BATCH):
                e = min(s + BATCH, hi)
                tracker.set_batch(sample_ids=list(range(s, e)))
                model(x[s:e])


def _documented_order(rank_rows: list[int]) -> np.ndarray:
    """Row indices into the rank-major concatenation, in the store's documented order."""
    starts = np.cumsum([0, *rank_rows[:-1]])
    heads = [np.arange(s, s + (n // S) * S) for s, n in zip(starts, rank_rows)]
    tails = [np.arange(s + (n // S) * S, s + n) for s, n in zip(starts, rank_rows)]
    return np.concatenate(heads + tails)


def _assert_same_store(got: acs.Store, ref: acs.Store) -> None:
    """Arrays byte-identical, row tables equal (with the rank column), reductions within 1e-12."""
    assert got.status == ref.status == "complete" and got.attrs["format"]["version"] == 2
    assert got.hook_points == ref.hook_points and len(got.hook_points) >= 3
    for hp in got.hook_points:
        assert got[hp].dtype == ref[hp].dtype and torch.equal(got[hp].view(torch.int32), ref[hp].view(torch.int32)), hp
        for name in ("mean", "var"):
            torch.testing.assert_close(got.reductions[hp][name], ref.reductions[hp][name], rtol=1e-12, atol=1e-15)
    assert got.row_table("sample").equals(ref.row_table("sample"))
    assert got.row_table("sample").column_names[-1] == "rank"


def test_capture_under_torchrun_is_the_library_multi_rank_store_and_the_one_process_rows(workdir):
    run = _torchrun(workdir, _capture_args("two.zarr"))
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    (out0, err0), (out1, err1) = run["ranks"][0], run["ranks"][1]
    n_hook_points = len(acs.open_store(workdir / "two.zarr").hook_points)
    assert out0.splitlines()[-1].startswith(f"captured {N} samples (10 forwards, {n_hook_points} hook points) in ")
    assert out0.splitlines()[-1].endswith(" into two.zarr on 2 ranks") and err0 == ""
    assert (out1, err1) == ("", "")  # the other ranks say nothing
    assert not (workdir / "two.zarr" / "ranks").exists()

    x = torch.from_numpy(np.load(workdir / "inputs.npy"))
    _library_ranks(workdir / "lib.zarr", x)
    two, lib = acs.open_store(workdir / "two.zarr"), acs.open_store(workdir / "lib.zarr")
    _assert_same_store(two, lib)
    assert two.attrs["distributed"]["world_size"] == WORLD
    assert [r["n_samples"] for r in two.attrs["distributed"]["ranks"]] == [26, 27]

    # one process: the same rows and values, in the documented order
    assert cli.main(_capture_args("one.zarr")) == 0
    one = acs.open_store(workdir / "one.zarr")
    assert one.attrs["format"]["version"] == 1
    perm = _documented_order([26, 27])
    assert two.row_table("sample").column("sample_id").to_pylist() == \
        np.asarray(one.row_table("sample").column("sample_id"))[perm].tolist() == list(range(N))
    for hp in one.hook_points:
        torch.testing.assert_close(two[hp], one[hp][torch.from_numpy(perm)], rtol=1e-6, atol=1e-6)
        for name in ("mean", "var"):
            torch.testing.assert_close(two.reductions[hp][name], one.reductions[hp][name], rtol=1e-6, atol=1e-9)


def test_a_rank_that_fails_fails_every_rank_and_resume_completes_the_store(workdir):
    # sample 50 (rank 1's) makes the model raise: every rank exits 1 with rank 1's error
    run = _torchrun(workdir, _capture_args("two.zarr"), script=True, env={"FUSSY_LIMIT": "10"})
    assert run["rc"] != 0
    said = ("the model raised ValueError: a sample above 10 on samples 50..52 of the data (rank 1's part, "
            "samples 26..52)")
    for r in range(WORLD):
        out, err = run["ranks"][r]
        assert out == "" and said in err and err.startswith("activationscope capture: error: "), (r, err)
    assert "rank(s) [1] failed" in run["ranks"][0][1] and "rerun with --resume" in run["ranks"][0][1]
    assert acs.open_store(workdir / "two.zarr").status == "incomplete"

    # --resume under torchrun continues each rank's part: the store of an uninterrupted capture
    run = _torchrun(workdir, _capture_args("two.zarr", "--resume"), script=True)
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    assert run["ranks"][1] == ("", "")
    _library_ranks(workdir / "lib.zarr", torch.from_numpy(np.load(workdir / "inputs.npy")))
    _assert_same_store(acs.open_store(workdir / "two.zarr"), acs.open_store(workdir / "lib.zarr"))

    # and once more: nothing left to capture, said by rank 0
    run = _torchrun(workdir, _capture_args("two.zarr", "--resume"))
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    assert run["ranks"][0][0].strip() == f"store two.zarr already holds {N} samples of {N}; nothing to capture"
    assert run["ranks"][1] == ("", "")


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path: bytes), but the writer lock (never moved aside)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".activationscope-writer.lock"}


def _asides(workdir: Path) -> list[Path]:
    return sorted(workdir.glob(".two.zarr.replaced-*"))


def test_overwrite_under_torchrun_that_fails_puts_the_old_store_back_byte_for_byte(workdir):
    # --overwrite on several ranks deleted the old store before the ranks wrote: a rank whose
    # model then raised left an incomplete store of the new run, the old one gone for nothing
    assert cli.main(_capture_args("two.zarr", "--max-samples", "7")) == 0
    before = _files(workdir / "two.zarr")
    run = _torchrun(workdir, _capture_args("two.zarr", "--overwrite"), env={"FUSSY_LIMIT": "10"})
    assert run["rc"] != 0
    said = ["the store that --overwrite was to replace at 'two.zarr' is put back as it was",  # rank 0: rank 1 failed
            "the store that was at two.zarr is kept as it was"]  # rank 1: its own model's error
    for r in range(WORLD):
        err = run["ranks"][r][1]
        assert "was deleted when this capture started" not in err, (r, err)
        assert "a sample above 10" in err and said[r] in err, (r, err)
    assert "rank(s) [1] failed" in run["ranks"][0][1]
    assert _files(workdir / "two.zarr") == before and _asides(workdir) == []
    store = acs.open_store(workdir / "two.zarr")
    assert store.status == "complete" and store.n_samples == 7 and store.verify() == []


def test_overwrite_under_torchrun_replaces_the_store_and_leaves_no_folder_aside(workdir):
    assert cli.main(_capture_args("two.zarr", "--max-samples", "7")) == 0
    run = _torchrun(workdir, _capture_args("two.zarr", "--overwrite"))
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    assert _asides(workdir) == []
    store = acs.open_store(workdir / "two.zarr")
    assert store.status == "complete" and store.n_samples == N and store.verify() == []


def test_overwrite_under_torchrun_killed_before_the_commit_keeps_the_old_store_and_a_rerun_completes(workdir):
    assert cli.main(_capture_args("two.zarr", "--max-samples", "7")) == 0
    before = _files(workdir / "two.zarr")
    # rank 0 SIGKILLed in its first forward: after the move aside, before the ranks' commit
    run = _torchrun(workdir, _capture_args("two.zarr", "--overwrite"), env={"FUSSY_KILL_RANK": "0"})
    assert run["rc"] != 0
    (aside,) = _asides(workdir)  # the old store, whole
    assert _files(aside) == before
    assert acs.open_store(aside).verify() == []
    assert acs.open_store(workdir / "two.zarr").status == "incomplete"
    # overwrite=True again takes that folder over: deleted once the new store commits
    run = _torchrun(workdir, _capture_args("two.zarr", "--overwrite"))
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    assert _asides(workdir) == []
    store = acs.open_store(workdir / "two.zarr")
    assert store.status == "complete" and store.n_samples == N and store.verify() == []


def test_overwrite_under_torchrun_killed_then_failing_again_puts_the_old_store_back(workdir):
    assert cli.main(_capture_args("two.zarr", "--max-samples", "7")) == 0
    before = _files(workdir / "two.zarr")
    run = _torchrun(workdir, _capture_args("two.zarr", "--overwrite"), env={"FUSSY_KILL_RANK": "0"})
    assert run["rc"] != 0 and len(_asides(workdir)) == 1
    run = _torchrun(workdir, _capture_args("two.zarr", "--overwrite"), env={"FUSSY_LIMIT": "10"})
    assert run["rc"] != 0
    assert "the store that was at two.zarr is kept as it was" in run["ranks"][1][1], run["ranks"]
    assert _files(workdir / "two.zarr") == before and _asides(workdir) == []


def test_resume_under_torchrun_of_a_one_process_store_is_refused_on_every_rank(workdir):
    assert cli.main(_capture_args("one.zarr", "--max-samples", "20")) == 0
    before = {p: p.read_bytes() for p in (workdir / "one.zarr").rglob("*") if p.is_file()}
    run = _torchrun(workdir, _capture_args("one.zarr", "--resume"))
    assert run["rc"] != 0
    for r in range(WORLD):
        assert "was captured by one process, and this command runs on 2 ranks" in run["ranks"][r][1], r
    assert {p: p.read_bytes() for p in (workdir / "one.zarr").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("flag", [["--shard-bytes", "1MiB"], ["--reductions-only"]])
def test_flags_a_multi_rank_capture_cannot_take_are_refused_before_anything_is_written(workdir, monkeypatch, capsys,
                                                                                        flag):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # (never reached: refused before the process group)
    assert cli.main(_capture_args("two.zarr", *flag)) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"activationscope capture: error: {flag[0]} cannot be used on 2 ranks (torchrun)")
    assert not (workdir / "two.zarr").exists()


def test_world_size_one_is_one_process(workdir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(_capture_args("one.zarr")) == 0
    store = acs.open_store(workdir / "one.zarr")
    assert store.attrs["format"]["version"] == 1 and "distributed" not in store.attrs
    assert store.row_table("sample").column_names == ["sample_id", "batch"] and store.n_samples == N


def test_text_under_torchrun_keeps_the_line_numbers_and_the_token_rows_of_one_process(workdir):
    lines = ["the quick brown fox jumps", "", "over the lazy dog", "seven tired cats sleep under warm red blankets",
             "a b", "the end of the text is here", "short"]
    (workdir / "texts.txt").write_text("\n".join(lines) + "\n")
    args = ["capture", "--model", "demo", "--data", "texts.txt", "--include", "encoder.layer.5", "--reduce", "mean",
            "--batch-size", "2", "--no-progress"]
    run = _torchrun(workdir, [*args, "--out", "two.zarr"])
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    # the warning about the data as a whole (its blank line) is rank 0's alone
    assert "skipped 1 blank line" in run["ranks"][0][1] and run["ranks"][1] == ("", "")
    with pytest.warns(UserWarning, match="skipped 1 blank line"):
        assert cli.main([*args, "--out", "one.zarr"]) == 0
    two, one = acs.open_store(workdir / "two.zarr"), acs.open_store(workdir / "one.zarr")
    samples = two.row_table("sample")
    assert samples.column("sample_id").to_pylist() == [0, 2, 3, 4, 5, 6]  # line numbers; parts of 3 samples
    assert samples.column("rank").to_pylist() == [0, 0, 0, 1, 1, 1]
    assert samples.column("text").to_pylist() == one.row_table("sample").column("text").to_pylist()
    tokens, ref = two.row_table("token"), one.row_table("token")
    for column in ("sample_id", "pos", "token_ids"):
        assert tokens.column(column).to_pylist() == ref.column(column).to_pylist(), column
    hp = "encoder.layer.5.output"
    torch.testing.assert_close(two[hp], one[hp], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(two.reductions[hp]["mean"], one.reductions[hp]["mean"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("step", ["tail", "root"])
def test_resume_under_torchrun_after_the_commit_was_killed_commits_the_store_of_an_uninterrupted_run(workdir, step):
    # every rank's part written, rank 0 killed in the commit: the store reads every row, uncommitted
    run = _torchrun(workdir, _capture_args("two.zarr"), module="commitkill", env={"KILL_STEP": step})
    assert run["rc"] != 0
    killed = acs.open_store(workdir / "two.zarr")
    assert killed.status == "incomplete" and killed.n_samples == N
    killed.close()
    run = _torchrun(workdir, _capture_args("two.zarr", "--resume"))
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    assert run["ranks"][1] == ("", "")
    assert not (workdir / "two.zarr" / "ranks").exists()
    _library_ranks(workdir / "lib.zarr", torch.from_numpy(np.load(workdir / "inputs.npy")))
    two, lib = acs.open_store(workdir / "two.zarr"), acs.open_store(workdir / "lib.zarr")
    _assert_same_store(two, lib)
    for hp in two.hook_points:  # (the reductions too: merged from the same float64 states)
        for name in ("mean", "var"):
            assert torch.equal(two.reductions[hp][name], lib.reductions[hp][name]), (hp, name)
    assert two.verify() == []


def test_resume_under_torchrun_of_a_committed_store_refuses_other_tensor_data(workdir):
    run = _torchrun(workdir, _capture_args("two.zarr"))
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    before = _files(workdir / "two.zarr")
    x = np.load(workdir / "inputs.npy")
    x[40, 1] += 1  # (rank 1's part, samples 26..52: the same length, another value)
    np.save(workdir / "inputs.npy", x)
    run = _torchrun(workdir, _capture_args("two.zarr", "--resume"))
    assert run["rc"] != 0
    said = ("--resume: store 'two.zarr' holds 53 samples, but --data 'inputs.npy' is not the data they were captured "
            "from: its samples 26..52 (a rank's part of the data; dtype torch.float32, shape (6,) each) differ from those "
            "that rank recorded")
    for r in range(WORLD):
        assert said in run["ranks"][r][1], (r, run["ranks"][r])
    assert _files(workdir / "two.zarr") == before


def test_a_rank_without_a_rank_store_at_resume_cuts_texts_at_the_recorded_max_length(workdir):
    lines = ["the quick brown fox jumps over it", "over the lazy dog and far away",
             "seven tired cats sleep under warm red blankets", "a b", "the end of the text is here today",
             "short but not that short at all"]
    (workdir / "texts.txt").write_text("\n".join(lines) + "\n")
    args = ["capture", "--model", "demo", "--data", "texts.txt", "--include", "encoder.layer.5", "--batch-size", "2",
            "--no-progress"]
    # every rank's part captured with --max-length 6, the commit killed, rank 1's rank store gone
    run = _torchrun(workdir, [*args, "--out", "two.zarr", "--max-length", "6"], module="commitkill",
                    env={"KILL_STEP": "tail"})
    assert run["rc"] != 0
    shutil.rmtree(workdir / "two.zarr" / "ranks" / "00001")
    # --resume without --max-length: rank 1 takes the 6 rank 0's store records, not the default
    run = _torchrun(workdir, [*args, "--out", "two.zarr", "--resume"])
    assert run["rc"] == 0, run["torchrun"][-3000:] + str(run["ranks"])
    assert cli.main([*args, "--out", "one.zarr", "--max-length", "6"]) == 0
    two, one = acs.open_store(workdir / "two.zarr"), acs.open_store(workdir / "one.zarr")
    assert two.status == "complete" and two.n_samples == len(lines)
    tokens = two.row_table("token")
    per_sample = np.bincount(tokens.column("sample_id").to_numpy())
    assert per_sample.max() == 6 and (per_sample[[0, 1, 2, 4, 5]] == 6).all()
    for column in ("sample_id", "pos", "token_ids"):
        assert tokens.column(column).to_pylist() == one.row_table("token").column(column).to_pylist(), column
    assert two.row_table("token").column("rank").to_pylist()[-1] == 1
