"""The package namespace and the public docstrings."""

from __future__ import annotations

import builtins
import inspect
import pydoc
import re
import subprocess
import sys
import symtable
from pathlib import Path

import torch

import activationscope as acs

ROOT = Path(__file__).resolve().parents[1]


def test_public_names_are_exported_and_listed():
    for name in ("open_store", "Store", "StoreWriter", "ActivationDataset", "ActivationScope", "Tracker"):
        assert name in acs.__all__, name
        assert name in dir(acs), name
    from activationscope.data import ActivationDataset
    from activationscope.store import Store, open_store

    assert acs.open_store is open_store and acs.Store is Store and acs.ActivationDataset is ActivationDataset
    for name in acs.__all__:
        assert getattr(acs, name) is not None, name
    star: dict = {}
    exec("from activationscope import *", star)
    assert {"open_store", "Store", "ActivationDataset"} <= set(star)


def test_no_stray_names_in_the_namespace():
    # submodules appear once imported (by this or other tests); nothing else may
    public = {n for n in dir(acs) if not n.startswith("_") and not inspect.ismodule(getattr(acs, n))}
    assert "annotations" not in public
    assert public == set(acs.__all__) - {"__version__"}, public ^ set(acs.__all__)


def test_import_does_not_load_torch():
    code = "import sys, activationscope; print('torch' in sys.modules, 'activationscope._C' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    code = "import sys, activationscope as a; a.ActivationScope; print('activationscope._C' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]


def _public_classes():
    return [getattr(acs, n) for n in acs.__all__
            if inspect.isclass(getattr(acs, n)) and not issubclass(getattr(acs, n), BaseException)]


def test_public_methods_have_their_own_docstrings():
    dunders = {"__len__", "__getitem__", "__getitems__", "__contains__", "__iter__", "__enter__", "__exit__"}
    missing = []
    for cls in _public_classes():
        if not cls.__module__.startswith("activationscope"):
            continue
        for name, value in vars(cls).items():
            if name.startswith("_") and name not in dunders:
                continue
            if callable(value) or isinstance(value, property):
                if not (getattr(value, "__doc__", None) or "").strip():
                    missing.append(f"{cls.__name__}.{name}")
    assert missing == []


def test_help_of_dataset_len_shows_a_docstring_not_a_comment():
    from activationscope.data import ActivationDataset

    text = pydoc.render_doc(ActivationDataset.__len__, renderer=pydoc.plaintext)
    assert "Number of rows" in text and "# ---" not in text


def test_reductions_docstrings_give_shapes_and_dtypes():
    from activationscope.store import Store

    for doc in (acs.Tracker.reductions.__doc__, Store.reductions.__doc__):
        for word in ("(*feature_shape)", "float64", "int64", "(bins + 1,)", "(D, D)", "(n, *feature_shape)", "min(k,"):
            assert word in doc, word


def test_tracker_writer_is_documented_and_matches_what_it_says(tmp_path):
    doc = inspect.getdoc(acs.Tracker)
    assert "writer :" in doc and "n_samples_committed" in doc
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    tracker = acs.ActivationScope(store=str(tmp_path / "s.zarr")).track(model)
    assert tracker.writer is None
    with tracker:
        assert tracker.writer.n_samples_committed == 0 == tracker.resume_from
        assert tracker.writer.path == str(tmp_path / "s.zarr")
        model(torch.randn(5, 2))
    tracker = acs.ActivationScope(store=str(tmp_path / "s.zarr"), store_options={"resume": True}).track(model)
    with tracker:
        assert tracker.writer.n_samples_committed == 5 == tracker.resume_from
    assert acs.ActivationScope().track(model).attach().writer is None


def _free_names(code: str) -> set[str]:
    table = symtable.symtable(code, "README.md", "exec")
    free: set[str] = set()

    def walk(t):
        for s in t.get_symbols():
            if (s.is_global() or (t.get_type() == "module" and s.is_referenced())) and not s.is_assigned() \
                    and not s.is_imported() and not hasattr(builtins, s.get_name()):
                free.add(s.get_name())
        for child in t.get_children():
            walk(child)

    walk(table)
    return free


def test_readme_first_quick_start_uses_only_the_names_it_says_are_yours():
    readme = (ROOT / "README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", readme, flags=re.S)[0]
    assert "loss.backward()" in block
    assert _free_names(block) == {"model", "dataloader", "loss_fn"}
    said = readme[: readme.index(block)].rsplit("```python", 1)[0].strip().rsplit("\n\n", 1)[-1]
    for name in ("model", "dataloader", "loss_fn"):
        assert f"`{name}`" in said, name
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(2)]
    env = {"model": model, "dataloader": data, "loss_fn": torch.nn.functional.mse_loss}
    exec(compile(block, "README.md", "exec"), env)
    assert [len(v) for v in env["acts"].values()] == [2]


def test_every_activationscope_name_the_docs_and_the_command_line_give_exists():
    # `activationscope.copy_store` was named by `activationscope copy --help` and cli.md but was
    # only importable from activationscope.store; a name written that way must be reachable so
    import importlib.util

    texts = {p.relative_to(ROOT).as_posix(): p.read_text()
             for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "activationscope" / "cli").glob("*.py"))]}
    # keys of the store's root attribute and of an export's field metadata, written the same way
    metadata_keys = {"arrays", "aliases", "dtype", "shape", "hook_point", "row_kind", "format"}
    named = set()
    for where, text in texts.items():
        for m in re.finditer(r"(?<![\w.~])activationscope\.([A-Za-z_]\w*)\b(?![\[\w])", text):
            if m.group(1) in metadata_keys:               # `activationscope.aliases` of the root attributes
                continue
            named.add((m.group(1), where))
    assert ("copy_store", "docs/usage/cli.md") in named
    missing = sorted((name, where) for name, where in named
                     if not hasattr(acs, name) and importlib.util.find_spec(f"activationscope.{name}") is None)
    assert not missing, missing
    from activationscope.store import copy_store

    assert acs.copy_store is copy_store and "copy_store" in acs.__all__


def test_readme_lists_every_usage_page():
    readme = (ROOT / "README.md").read_text()
    docs = readme[readme.index("## Documentation"):]
    for page in sorted((ROOT / "docs" / "usage").glob("*.md")):
        assert f"(docs/usage/{page.name})" in docs, page.name


def test_public_names_import_no_optional_extra():
    # the extras (demo, dask, interop) are optional: only their own modules may import them
    extras = ("transformers", "matplotlib", "sklearn", "dask", "distributed", "xarray", "tensorstore", "datasets",
              "pandas", "polars", "sae_lens", "transformer_lens", "gensim")
    code = ("import sys, activationscope as a\n"
            "for name in a.__all__:\n"
            "    if name != 'to_dask':\n"
            "        getattr(a, name)\n"
            "import activationscope.cli, activationscope.reductions, activationscope.data, activationscope.analysis\n"
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({extras!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "[]", out.stdout
