"""Models prepared by libraries that hook or replace a module's forward (accelerate, PEFT),
checked against plain ``register_forward_hook``: a forward set on a tracked module while it is
tracked (accelerate's ``add_hook_to_module`` / ``remove_hook_from_module``, an assignment)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import activationscope as acs

from acs_testing import MLP, plain_hooks


def _capture_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, acs.CaptureWarning)]


def _restore_forward(module):
    """Give ``module`` its class's forward again, as ``remove_hook_from_module`` does."""
    module.forward = types.MethodType(type(module).forward, module)


@pytest.mark.parametrize("how", ["remove_hook_from_module", "assignment"])
def test_forward_replaced_while_tracked_is_named_in_a_warning(how):
    # a tracked module whose forward was set again while tracked (accelerate's
    # remove_hook_from_module puts back the forward its hook replaced) no longer ran the capture:
    # its later calls went unrecorded, with no warning; now the end of the capture names it
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    torch.manual_seed(0)
    model = MLP()
    if how == "remove_hook_from_module":
        accelerate_hooks.add_hook_to_module(model.fc1, accelerate_hooks.ModelHook())
    xs = [torch.randn(5, 8) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
            model(xs[0])
            if how == "remove_hook_from_module":
                accelerate_hooks.remove_hook_from_module(model.fc1)
            else:
                _restore_forward(model.fc1)
            for x in xs[1:]:
                model(x)
    assert len(tracker.activations["fc1.output"]) == 1
    assert len(tracker.activations["fc2.output"]) == 3
    found = [w for w in _capture_warnings(caught) if "was replaced while it was tracked" in w]
    assert len(found) == 1, _capture_warnings(caught)
    assert "'fc1'" in found[0] and "'fc2'" not in found[0] and "fc1.output" in found[0]


def test_forward_replaced_in_a_store_capture_names_the_cause(tmp_path):
    # in a store the hook point left the row table with "its module returned no tensor there":
    # the cause, its forward replaced while tracked, was not told
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(5, 8)
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=path).track(model):
            model(x)
            _restore_forward(model.fc1)
            model(x)
    lost = [w for w in _capture_warnings(caught) if "recorded 0 row(s) in forward 1" in w]
    assert len(lost) == 1 and "'fc1.output'" in lost[0] and "was replaced while it was tracked" in lost[0]
    store = acs.open_store(path)
    assert store["fc1.output"].shape[0] == 5 and store["fc2.output"].shape[0] == 10


def test_model_forward_replaced_in_a_store_capture_names_the_cause(tmp_path):
    # accelerate's cpu_offload hooks the model itself too: remove_hook_from_module(model,
    # recurse=True) while tracked put back its forward, so no later forward was captured, and the
    # warning said that the tracked modules "were called on their own"
    accelerate = pytest.importorskip("accelerate")
    from accelerate.hooks import remove_hook_from_module

    torch.manual_seed(0)
    model = MLP()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    x = torch.randn(5, 8)
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope(store=path).track(model):
            model(x)
            remove_hook_from_module(model, recurse=True)
            model(x)
    outside = [w for w in _capture_warnings(caught) if "called on their own" in w]
    assert len(outside) == 1 and "MLP's own forward was replaced while it was tracked" in outside[0]
    replaced = [w for w in _capture_warnings(caught) if "forward of tracked module(s)" in w]
    assert len(replaced) == 1 and "the model itself (MLP)" in replaced[0]
    assert acs.open_store(path)["fc2.output"].shape[0] == 5


@pytest.mark.parametrize("how", ["closure", "after_last_forward"])
def test_forward_replaced_without_loss_is_not_warned(how):
    # a forward replaced while tracked by a closure that calls the one it replaced (no
    # functools.wraps), or replaced after the last forward, lost no call: the warning said
    # "their calls since were not recorded, so the records of hook points ... end there"
    torch.manual_seed(0)
    model = MLP()
    xs = [torch.randn(5, 8) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
            model(xs[0])
            if how == "closure":
                inner = model.fc1.forward
                model.fc1.forward = lambda *args, **kwargs: inner(*args, **kwargs)
            for x in xs[1:]:
                model(x)
            if how == "after_last_forward":
                _restore_forward(model.fc1)
    assert [t.shape[0] for t in tracker.activations["fc1.output"]] == [5, 5, 5]
    assert torch.equal(tracker.activations["fc1.output"][2], model.fc1(xs[2]))
    assert not [w for w in _capture_warnings(caught) if "replaced" in w], _capture_warnings(caught)


def test_forward_wrapping_the_capture_keeps_recording_and_is_undone():
    # accelerate hooks added to a tracked module (cpu_offload inside the block) keep the capture's
    # forward as the one they call (_old_forward): the calls were recorded, but after the block
    # remove_hook_from_module put the capture's forward back on the module, to stay there; now
    # the tracker gives accelerate the module's own forward when it ends
    accelerate = pytest.importorskip("accelerate")
    from accelerate.hooks import remove_hook_from_module

    torch.manual_seed(0)
    model = MLP()
    xs = [torch.randn(5, 8) for _ in range(2)]
    ref, _ = plain_hooks(model, lambda: [model(x) for x in xs], ["fc1", "fc2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
            model(xs[0])
            accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
            model(xs[1])
    assert not [w for w in _capture_warnings(caught) if "replaced" in w], _capture_warnings(caught)
    for k in ("fc1.output", "fc2.output"):
        assert len(tracker.activations[k]) == 2
        assert all(torch.equal(a, b) for a, b in zip(tracker.activations[k], ref[k])), k
    remove_hook_from_module(model, recurse=True)
    # each module's forward is its class's again (accelerate sets it on the instance)
    for m in model.modules():
        forward = m.__dict__.get("forward")
        assert forward is None or (isinstance(forward, types.MethodType) and forward.__func__ is type(m).forward)
    with torch.no_grad():
        assert torch.equal(model(xs[1]), ref["fc2.output"][1])
    with torch.no_grad(), acs.ActivationScope().track(model) as again:  # the model is as it was
        model(xs[0])
    assert torch.equal(again.activations["fc2.output"][0], ref["fc2.output"][0])


def _lora_bert():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    config = peft.LoraConfig(r=4, target_modules=["query", "value"], init_lora_weights=False)
    return peft.get_peft_model(transformers.BertModel(cfg), config).eval()


@pytest.mark.parametrize("adapter", ["unmerged", "merged", "disabled"])
def test_peft_lora_hook_points_equal_forward_hooks(adapter):
    model = _lora_bert()
    query = "base_model.model.encoder.layer.0.attention.self.query"
    names = [query, f"{query}.base_layer", f"{query}.lora_B.default", "base_model.model.encoder.layer.1.output.dense"]
    x = torch.randint(0, 100, (3, 7))
    if adapter == "merged":
        model.merge_adapter()

    def forward(inputs):
        if adapter == "disabled":
            with model.disable_adapter():
                return model(input_ids=inputs)
        return model(input_ids=inputs)

    ref = {k: v[-1] for k, v in plain_hooks(model, lambda: forward(x), names)[0].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), acs.ActivationScope().track(model, include=names) as tracker:
            forward(x)
    # a merged or disabled adapter's lora_B is not called: it has no record
    assert sorted(tracker.activations) == sorted(ref)
    assert (f"{query}.lora_B.default.output" in ref) == (adapter == "unmerged")
    for k, v in ref.items():
        assert torch.equal(tracker.activations[k][0], v), k
    if adapter == "unmerged":  # the adapter changes the query's output: the records tell them apart
        assert not torch.equal(tracker.activations[f"{query}.output"][0],
                               tracker.activations[f"{query}.base_layer.output"][0])


def test_peft_base_model_tracked_names_hook_points_as_in_the_model(tmp_path):
    # track the model PeftModel wraps, call the PeftModel: hook points named as without PEFT
    model = _lora_bert()
    inner = model.get_base_model()
    x = torch.randint(0, 100, (3, 7))
    mask = torch.ones_like(x)
    mask[0, 4:] = 0
    ref = {}
    handle = inner.encoder.layer[0].attention.self.query.register_forward_hook(
        lambda m, a, o: ref.setdefault("q", o.clone()))
    with torch.no_grad():
        model(input_ids=x, attention_mask=mask)
    handle.remove()
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad(), acs.ActivationScope(store=path, rows="token").track(
                inner, include=["encoder.layer.0.attention.self.query"]) as tracker:
            tracker.set_batch(attention_mask=mask)
            model(input_ids=x, attention_mask=mask)
    store = acs.open_store(path)
    assert store.hook_points == ["encoder.layer.0.attention.self.query.output"]
    assert torch.equal(store["encoder.layer.0.attention.self.query.output"], ref["q"][mask.bool()])


def test_peft_pattern_without_its_prefix_is_refused_with_the_names_to_write():
    # a pattern of the model's own names matched nothing of a PeftModel, and the error listed its
    # first module names only; now it gives the pattern with PEFT's prefix and get_base_model()
    model = _lora_bert()
    with pytest.raises(acs.HookPointNotFoundError) as caught:
        acs.ActivationScope().track(model, include=["encoder.layer.*"])
    message = str(caught.value)
    assert "include=['base_model.model.encoder.layer.*']" in message
    assert "model.get_base_model(), a BertModel" in message


@pytest.mark.parametrize("reentrant", [True, False])
def test_hugging_face_gradient_checkpointing_records_each_forward_once(tmp_path, reentrant):
    # the recomputation of a checkpointed layer in backward runs its modules' forwards again
    # (plain forward hooks see each call twice): the store keeps the forward's rows only
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    model = transformers.BertModel(cfg).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    hp = "encoder.layer.1.intermediate.dense"
    calls = []
    handle = model.encoder.layer[1].intermediate.dense.register_forward_hook(
        lambda m, a, o: calls.append(o.detach().clone()))
    xs = [torch.randint(0, 100, (3, 7)) for _ in range(2)]
    path = tmp_path / "s.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with acs.ActivationScope(store=path, reductions=["mean"]).track(model, include=[hp]):
            for x in xs:
                model(input_ids=x).last_hidden_state.sum().backward()
    handle.remove()
    assert len(calls) == 4  # forward, recomputation, forward, recomputation
    want = torch.cat([calls[0], calls[2]])
    store = acs.open_store(path)
    assert torch.equal(store[f"{hp}.output"], want)
    assert torch.allclose(store.reductions[f"{hp}.output"]["mean"], want.double().mean(0))


def test_accelerator_prepare_while_tracked_unwraps_to_the_models_own_forward():
    # Accelerator.prepare with mixed precision inside the block keeps the capture's forward as
    # the model's _original_forward: the forwards were recorded, but unwrapping the model after
    # the block (keep_fp32_wrapper=False) set the capture's forward on it for good
    accelerate = pytest.importorskip("accelerate")
    from accelerate.utils import extract_model_from_parallel

    torch.manual_seed(0)
    model = MLP()
    xs = [torch.randn(5, 8) for _ in range(2)]
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
        model(xs[0])
        accelerator.prepare(model)
        model(xs[1])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(tracker.activations["fc2.output"][1], model.fc2(model.act(model.fc1(xs[1]))))
    assert len(tracker.activations["fc1.output"]) == 2
    unwrapped = extract_model_from_parallel(model, keep_fp32_wrapper=False)
    forward = unwrapped.__dict__.get("forward")
    assert forward is None or (isinstance(forward, types.MethodType) and forward.__func__ is MLP.forward)


def test_peft_tuner_the_forward_passes_over_is_named_with_its_reason():
    # a PeftModel without a task type calls the model itself, not its tuner (base_model, a
    # LoraModel): tracking every module warned "never called, or it returned / received no
    # tensor" about it at every capture; now the warning says why and what to write
    model = _lora_bert()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope().track(model) as tracker:
            model(input_ids=torch.randint(0, 100, (3, 7)))
    silent = [w for w in _capture_warnings(caught) if "recorded nothing" in w]
    assert len(silent) == 1
    assert ("'base_model' (LoraModel): PEFT's tuner around the model, which the forward of PeftModel passes over "
            "(it calls the model, 'base_model.model', itself); exclude=['base_model'], or track "
            "model.get_base_model() instead") in silent[0]
    assert "base_model.model.encoder.layer.1.output.dense.output" in tracker.activations
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), acs.ActivationScope().track(model, exclude=["base_model"]) as tracker:
            model(input_ids=torch.randint(0, 100, (3, 7)))
    assert not [w for w in _capture_warnings(caught) if "'base_model'" in w]
    assert "base_model.model.encoder.layer.1.output.dense.output" in tracker.activations


def test_peft_generate_is_captured_through_the_model_it_wraps(tmp_path):
    # PeftModelForCausalLM.generate() calls the wrapped model's generate(), never the PeftModel's
    # forward: a store capture of the PeftModel failed with "call the model inside the `with`
    # block"; now the error says that its modules ran outside its forward and what to track
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", init_lora_weights=False)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), config).eval()
    x = torch.randint(1, 100, (2, 6))

    def generate():
        return model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
                              pad_token_id=0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(acs.CaptureError, match=r"its tracked modules were called 3 time\(s\), all outside a "
                           r"forward of PeftModelForCausalLM.*\(peft_model.get_base_model\(\)\)"):
            with torch.no_grad(), acs.ActivationScope(store=tmp_path / "a.zarr", rows="token").track(
                    model, include=["base_model.model.model.layers.1.mlp"]):
                generate()
        steps = []
        handle = model.get_base_model().model.layers[1].mlp.register_forward_hook(
            lambda m, a, o: steps.append(o.clone()))
        with torch.no_grad(), acs.ActivationScope(store=tmp_path / "b.zarr", rows="token").track(
                model.get_base_model(), include=["model.layers.1.mlp"]) as tracker:
            tracker.set_batch(sample_ids=[0, 1])
            generate()
        handle.remove()
    store = acs.open_store(tmp_path / "b.zarr")
    assert torch.equal(store["model.layers.1.mlp.output"], torch.cat([s.reshape(-1, 16) for s in steps]))
    assert store["model.layers.1.mlp.output"].shape == (2 * 6 + 2 * 2, 16)  # the prompt's tokens, 2 steps of 2
