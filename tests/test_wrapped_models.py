"""Capture through model wrappers (DataParallel, DistributedDataParallel, fully_shard),
parametrizations and hooks of the user's own, checked against plain ``register_forward_hook``."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import activationscope as acs
from activationscope.store import model_identity

from acs_testing import MLP, plain_hooks


def _reference(model, names, xs):
    """Outputs of ``names`` over ``xs`` by plain forward hooks: {hook point: (rows, ...)}."""
    got, _ = plain_hooks(model, lambda: [model(x) for x in xs], names)
    return {k: torch.cat(v) for k, v in got.items()}


_FULLY_SHARD = textwrap.dedent("""
    import os, sys, tempfile
    import torch, torch.distributed as dist
    import activationscope as acs
    from activationscope.store import model_identity
    sys.path.insert(0, {tests!r})
    from test_wrapped_models import MLP, _reference
    dist.init_process_group("gloo", init_method="file://" + {pg!r}, rank=0, world_size=1)
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = MLP()
    plain = model_identity(model)
    fully_shard(model.fc1)
    fully_shard(model)
    xs = [torch.randn(5, 8) for _ in range(3)]
    ref = _reference(model, ["fc1", "act"], xs)
    path = {store!r}
    with acs.ActivationScope(store=path, reductions={{"*": ["mean", "var"]}}).track(model, include=["fc1", "act"]):
        with torch.no_grad():
            for x in xs:
                model(x)
    store = acs.open_store(path)
    for k, v in ref.items():
        assert torch.equal(store[k], v), k
        assert torch.allclose(store.reductions[k]["mean"], v.double().mean(0)), k
        assert torch.allclose(store.reductions[k]["var"], v.double().var(0, correction=0)), k
    assert store.attrs["model"]["state_dict_sha256"] == plain["state_dict_sha256"]
    dist.destroy_process_group()
    print("ok")
""")


def test_fully_shard_model_captures_into_a_store(tmp_path):
    # the weights of a fully_shard (FSDP2) model are DTensors, with no memory of their own
    # (data_ptr() 0): the store's sha256 of the weights read address 0 and the process died
    # (SIGSEGV) when the tracker attached. In one process they are hashed by their local
    # tensors: the sha256 of the unsharded model
    script = _FULLY_SHARD.format(tests=str(Path(__file__).parent), pg=str(tmp_path / "pg"),
                                 store=str(tmp_path / "s.zarr"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_model_identity_refuses_a_tensor_without_memory():
    # a tensor subclass without storage (data_ptr() 0) was read at address 0: the process died
    class NoMemory(torch.Tensor):
        @staticmethod
        def __new__(cls, shape):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
                return args[0]
            raise NotImplementedError(str(func))

    model = MLP()
    model.register_buffer("odd", NoMemory((3,)))
    with pytest.raises(acs.ActivationScopeError, match=r"state dict entry 'odd' is a NoMemory with no memory"):
        model_identity(model)


_SPLIT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from activationscope.errors import ArgumentValueError
    from activationscope.store import model_identity

    def run(rank):
        dist.init_process_group("gloo", init_method="file://" + {pg!r}, rank=rank, world_size=2)
        from torch.distributed.fsdp import fully_shard
        model = torch.nn.Sequential(torch.nn.Linear(8, 16))
        fully_shard(model)
        try:
            model_identity(model)
        except ArgumentValueError as e:
            print(rank, e, flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(run, nprocs=2)
""")


def test_model_identity_refuses_weights_split_across_ranks(tmp_path):
    # each rank holds a part of a fully_shard model's weights: no rank can hash the model
    script = tmp_path / "split.py"
    script.write_text(_SPLIT.format(pg=str(tmp_path / "pg")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    # (every assertion shows both ranks' output: stdout and stderr)
    seen = f"exit code {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, seen
    lines = sorted(proc.stdout.strip().splitlines())
    assert len(lines) == 2 and [line[0] for line in lines] == ["0", "1"], seen
    assert all("state dict entry '0.bias' is a DTensor split across 2 ranks (Shard(dim=0))" in line
               for line in lines), seen


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload", "dispatch_model"])
def test_accelerate_offloaded_model_captures_into_a_store(tmp_path, offload):
    # accelerate leaves an offloaded module's weights on the meta device between forwards (its
    # hook loads them for each forward): a store capture was refused as a model whose weights
    # were never loaded ("load them ... before capturing"); now its offloaded values are hashed
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = MLP()
    plain = model_identity(model)
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    elif offload == "disk_offload":
        accelerate.disk_offload(model, str(tmp_path / "off"), execution_device=torch.device("cpu"))
    else:
        accelerate.dispatch_model(model, device_map={"fc1": "cpu", "act": "cpu", "fc2": "disk"},
                                  offload_dir=str(tmp_path / "off"), main_device="cpu")
    assert model.state_dict()["fc2.weight"].is_meta
    xs = [torch.randn(5, 8) for _ in range(3)]
    ref = _reference(model, ["fc1", "act", "fc2"], xs)
    path = tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path, reductions={"*": ["mean", "var"]}).track(model):
        for x in xs:
            model(x)
    store = acs.open_store(path)
    assert sorted(store.hook_points) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(store[k], v), k
        assert torch.allclose(store.reductions[k]["mean"], v.double().mean(0)), k
        assert torch.allclose(store.reductions[k]["var"], v.double().var(0, correction=0)), k
    assert store.attrs["model"]["state_dict_sha256"] == plain["state_dict_sha256"]


def _capture_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]


def test_global_forward_hook_that_replaces_an_output_is_warned_about():
    # a global forward hook (register_module_forward_hook) runs after the forward the capture
    # records: its replacement went on to the next module with no warning, only module hooks
    # were looked at
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 8)
    doubled = torch.nn.modules.module.register_module_forward_hook(
        lambda m, a, o: o * 2 if isinstance(m, torch.nn.ReLU) else None)
    received = []
    pre = model.fc2.register_forward_pre_hook(lambda m, a: received.append(a[0].clone()))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad(), acs.ActivationScope().track(model, include=["fc1", "act"]) as tracker:
                model(x)
                model(x)
    finally:
        doubled.remove()
        pre.remove()
    said = _capture_warnings(caught)
    assert len(said) == 1 and "forward hooks of the tracked modules 'act' replaced or changed their output" in said[0]
    assert "register_module_forward_hook" in said[0]
    recorded = tracker.activations["act.output"]
    assert torch.equal(recorded[0], torch.relu(model.fc1(x))) and torch.equal(received[0], 2 * recorded[0])
    assert len(torch.nn.modules.module._global_forward_hooks) == 0  # the probe went with the first forward


def test_global_forward_hook_that_only_reads_is_not_warned_about():
    model = MLP()
    seen = []
    reading = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
                model(torch.randn(2, 8))
    finally:
        reading.remove()
    assert _capture_warnings(caught) == [] and seen == ["Linear", "ReLU", "Linear", "MLP"]
    assert sorted(tracker.activations) == ["act.output", "fc1.output", "fc2.output"]


@pytest.mark.parametrize("parametrization", ["weight_norm", "orthogonal", "spectral_norm"])
def test_parametrizations_are_not_tracked_by_default(tmp_path, parametrization):
    # the parametrizations of torch.nn.utils.parametrize compute the weight at each read: they
    # were tracked by default, and a store took the weight (out_features rows per forward) as
    # rows of the batch, out of step with the row table, with a warning
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = MLP().eval()
    getattr(parametrizations, parametrization)(model.fc2)
    xs = [torch.randn(5, 8) for _ in range(3)]
    ref = _reference(model, ["fc1", "act", "fc2"], xs)
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=path, reductions={"*": ["mean", "var"]}).track(model):
            for x in xs:
                model(x)
    assert _capture_warnings(caught) == []
    store = acs.open_store(path)
    assert sorted(store.hook_points) == ["act.output", "fc1.output", "fc2.output"]
    for k, v in ref.items():
        assert torch.equal(store[k], v), k
        assert torch.allclose(store.reductions[k]["var"], v.double().var(0, correction=0)), k
    # named exactly, a parametrization is tracked (its output is the weight)
    with torch.no_grad(), acs.ActivationScope().track(model, include=["fc2.parametrizations.weight"]) as tracker:
        model(xs[0])
    assert torch.equal(tracker.activations["fc2.parametrizations.weight.output"][0], model.fc2.weight)
    with torch.no_grad(), acs.ActivationScope().track(model, include=["fc2*"]) as tracker:
        model(xs[0])
    assert tracker.hook_points == ["fc2.output"]


def test_names_without_the_wrapper_attribute_are_told_what_to_write():
    # a DataParallel / DistributedDataParallel model names its modules 'module.fc1': include=['fc1']
    # was refused listing names only ("module names look like [...]"), not what to write
    model = torch.nn.DataParallel(MLP())
    with pytest.raises(acs.HookPointNotFoundError, match=re.escape(
            "include pattern 'fc*' matches no module of DataParallel: the modules of DataParallel are named with the "
            "attributes of the wrappers that hold them ('module.fc1' for 'fc1'): include=['module.fc*'], or track the "
            "wrapped model itself (model.module, a MLP)")):
        acs.ActivationScope().track(model, include=["fc*"])
    with pytest.warns(acs.CaptureWarning, match=re.escape("exclude pattern 'act' matches no module of DataParallel, so "
                                                          "it excludes nothing: the modules of DataParallel are named "
                                                          "with the attributes") + ".*exclude=\\['module.act'\\]"):
        acs.ActivationScope().track(model, exclude=["act"])
    x = torch.randn(5, 8)
    ref = _reference(model.module, ["fc1"], [x])
    with torch.no_grad(), acs.ActivationScope().track(model, include=["module.fc1"]) as wrapped, \
            acs.ActivationScope().track(model.module, include=["fc1"]) as inner:
        model(x)
    assert torch.equal(wrapped.activations["module.fc1.output"][0], ref["fc1.output"])
    assert torch.equal(inner.activations["fc1.output"][0], ref["fc1.output"])


class _Stop(Exception):
    pass


@pytest.mark.parametrize("first_wrapped", [True, False])
def test_resume_through_another_wrapping_names_the_wrapper(tmp_path, first_wrapped):
    # a store captured through DataParallel ('module.fc1.output') and resumed with the model
    # itself ('fc1.output'), or the other way round, was refused as other hook points only
    model = MLP()
    wrapped = torch.nn.DataParallel(model)
    first, then = (wrapped, model) if first_wrapped else (model, wrapped)
    x = torch.randn(5, 8)
    path = tmp_path / "s.zarr"
    with pytest.raises(_Stop), torch.no_grad(), acs.ActivationScope(store=path).track(first):
        first(x)
        raise _Stop
    side = "store" if first_wrapped else "capture"
    with pytest.raises(acs.CaptureError, match=re.escape(f"The {side}'s names hold a wrapper's attribute") +
                       ".*track the model as the first run did, the wrapper or the model it wraps"):
        with torch.no_grad(), acs.ActivationScope(store=path, store_options={"resume": True}).track(then):
            then(x)
    with torch.no_grad(), acs.ActivationScope(store=path, store_options={"resume": True}).track(first):
        first(x)
    store = acs.open_store(path)
    name = "module.fc1.output" if first_wrapped else "fc1.output"
    assert torch.equal(store[name], torch.cat([model.fc1(x)] * 2).detach())


def test_resume_of_a_model_with_a_submodule_named_module_names_no_wrapper(tmp_path):
    # a plain model whose submodule is called 'module' was told its store's names hold the
    # attribute of a DataParallel wrapper when resumed with other hook points
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.head = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.head(self.module(x))

    model, x, path = Net(), torch.randn(3, 2), tmp_path / "s.zarr"
    with torch.no_grad(), acs.ActivationScope(store=path).track(model, include=["module"]):
        model(x)
    with pytest.raises(acs.CaptureError) as info:
        with torch.no_grad(), acs.ActivationScope(store=path, store_options={"resume": True}).track(
                model, include=["head"]):
            model(x)
    assert "with other hook points than it holds (it holds ['module.output']" in str(info.value)
    assert "wrapper" not in str(info.value)
    assert acs.open_store(path).n_rows("module.output") == 3


def test_include_on_a_model_with_a_submodule_named_module_names_no_wrapper():
    # a plain model holding a submodule called 'module' (and others) was told its modules are
    # named with the attributes of wrappers and to track 'the wrapped model itself'
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Sequential()
            self.module.add_module("fc1", torch.nn.Linear(2, 2))
            self.head = torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.head(self.module(x))

    with pytest.raises(acs.HookPointNotFoundError) as info:
        acs.ActivationScope().track(Net(), include=["fc1"])
    assert str(info.value).startswith("include pattern 'fc1' matches no module of Net")
    assert "wrapper" not in str(info.value)
    with pytest.raises(acs.HookPointNotFoundError, match=re.escape(
            "the modules of DataParallel are named with the attributes of the wrappers that hold them "
            "('module.module.fc1' for 'module.fc1'): include=['module.module.fc1']")):
        acs.ActivationScope().track(torch.nn.DataParallel(Net()), include=["module.fc1"])


def test_a_replica_of_a_tracked_module_runs_the_original_forward():
    # what an nn.DataParallel over several devices does at each forward: replicas made by
    # Module._replicate_for_data_parallel share the instance __dict__, so the capture's
    # wrapper of the original, which runs the original's forward and parameters
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)

    def replica():
        r = model._replicate_for_data_parallel()
        for k, p in model._parameters.items():
            setattr(r, k, torch.zeros_like(p))
        return r

    assert torch.equal(replica()(x), torch.zeros(2, 4))
    with torch.no_grad(), acs.ActivationScope().track(model, include=[""]):
        assert torch.equal(replica()(x), model(x))  # not the replica's own parameters: refused below


@pytest.mark.parametrize("inside", [False, True])
def test_data_parallel_over_several_devices_is_refused(tmp_path, inside):
    parallel = torch.nn.DataParallel(MLP())
    parallel.device_ids = [0, 1]  # (as made on a machine of two GPUs)
    model = torch.nn.Sequential(parallel) if inside else parallel
    where = "the model's '0'" if inside else "the model"
    with pytest.raises(acs.CaptureError, match=re.escape(
            f"{where} is an nn.DataParallel over 2 devices (device_ids=[0, 1]): it copies the model to each device") +
            ".*DistributedDataParallel.*device_ids=\\[0\\]"):
        with acs.ActivationScope(store=tmp_path / "s.zarr").track(model):
            pass
    assert not (tmp_path / "s.zarr").exists()
    assert all("forward" not in m.__dict__ for m in model.modules())
    parallel.device_ids = []
    with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
        model(torch.randn(3, 8))
    assert len(tracker.hook_points) == (5 if inside else 4)


def test_hook_point_patterns_without_the_wrapper_attribute_are_told_what_to_write():
    # reductions= / exclude_hook_points= patterns of the model's own names selected nothing of a
    # DataParallel's hook points ('module.fc1.output'), and the messages listed names only
    model = torch.nn.DataParallel(MLP())
    x = torch.randn(5, 8)
    with pytest.raises(acs.HookPointNotFoundError, match=re.escape(
            "reductions= pattern 'fc*.output' selects no hook point") + ".*" + re.escape(
            ": the hook points of DataParallel are named with the attributes of the wrappers that hold them "
            "('module.fc1.output' for 'fc1.output'): reductions={'module.fc*.output': ...}, or track the wrapped model "
            "itself (model.module, a MLP)")):
        with torch.no_grad(), acs.ActivationScope(reductions={"fc*.output": ["mean"]}).track(model):
            model(x)
    said = re.escape("exclude_hook_points pattern(s) ['act.output'] left out no hook point")
    with pytest.warns(acs.CaptureWarning, match=said + ".*exclude_hook_points=\\['module.act.output'\\]"):
        with torch.no_grad(), acs.ActivationScope(exclude_hook_points=["act.output"]).track(model):
            model(x)
    with torch.no_grad(), acs.ActivationScope(reductions={"module.fc*.output": ["mean"]}).track(model) as tracker:
        model(x)
    assert torch.allclose(tracker.reductions["module.fc1.output"]["mean"], model.module.fc1(x).double().mean(0))
