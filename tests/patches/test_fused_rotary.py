"""Fused rotary embedding (``hf_offload.patches.rotary``): which attention modules are taken, that their copied forward
runs the kernel only inside the cache's decoder layer calls with ``fused_rotary`` on, that outputs stay transformers'
bit for bit, and that removing the cache's routing gives every module its own forward back. The kernel runs where
Triton runs: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``); the rest runs everywhere."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_offload import OffloadCache, disable_offload_attention
from hf_offload.kernels.gather import kernels_available
from hf_offload.patches.rotary import (
    RotaryForward,
    _with_global,
    fused_rotary_active,
    install_fused_rotary,
    remove_fused_rotary,
    rotary_function,
)

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import ARCHS, build_model, left_padded

TRITON = kernels_available(torch.device("cpu"))
needs_triton = pytest.mark.skipif(not TRITON, reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")
TAKEN = {"llama", "mistral", "qwen2", "qwen3", "gemma3"}  # Phi-3's partial rotary has its own function


def _attention(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def _fused(model) -> list[RotaryForward]:
    return [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), RotaryForward)]


@pytest.mark.parametrize("arch", ARCHS)
def test_install_takes_the_known_forms_and_remove_restores(arch):
    model = build_model(arch)
    layers = model.config.num_hidden_layers
    installed = install_fused_rotary(model)
    assert install_fused_rotary(model) == installed  # idempotent
    assert installed == (layers if arch in TAKEN else 0)
    assert len(_fused(model)) == installed
    remove_fused_rotary(model)
    assert not any("forward" in m.__dict__ for m in _attention(model))


def test_other_forwards_and_instance_forwards_are_left_alone():
    model = build_model("llama")
    attn = model.model.layers[0].self_attn

    class Other(type(attn)):  # its own forward: calls no apply_rotary_pos_emb
        def forward(self, hidden_states, *args, **kwargs):
            return hidden_states, None

    assert rotary_function(attn) is not None
    assert rotary_function(Other(model.config, 0)) is None
    assert rotary_function(torch.nn.Linear(2, 2)) is None
    own = attn.forward  # an instance forward somebody else set (accelerate's hooks do)
    attn.forward = own
    install_fused_rotary(model)
    assert attn.__dict__["forward"] is own
    assert all(isinstance(m.__dict__.get("forward"), RotaryForward) for m in _attention(model)[1:])


def test_copies_go_through_wrapping_decorators_only():
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return ("wrapped", fn(*args, **kwargs))

        return wrapper

    @decorate
    def f(x):
        return helper(x)  # noqa: F821 - a global the copy gets

    copy = _with_global(f, "helper", lambda x: x + 1)
    assert copy(1) == ("wrapped", 2)
    assert "helper" not in globals()

    def opaque(fn):  # keeps the function somewhere other than its closure
        holder = {"fn": fn}

        @functools.wraps(fn)
        def wrapper(*args):
            return holder["fn"](*args)

        return wrapper

    assert _with_global(opaque(f.__wrapped__), "helper", abs) is None


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_outside_the_active_context_transformers_runs(arch):
    model = build_model(arch)
    ids, _ = left_padded([9, 9])
    with torch.no_grad():
        want = model(ids).logits
    install_fused_rotary(model)
    with torch.no_grad(), fused_rotary_active(False):
        got = model(ids).logits
    assert torch.equal(got, want)
    assert sum(f.rotary.calls for f in _fused(model)) == 0


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inside_the_active_context_the_kernel_gives_transformers_logits(arch, dtype):
    model = build_model(arch).to(dtype)
    ids, _ = left_padded([11, 11], seed=2)
    with torch.no_grad():
        want = model(ids).logits
    install_fused_rotary(model)
    with torch.no_grad(), fused_rotary_active(True):
        got = model(ids).logits
    assert sum(f.rotary.calls for f in _fused(model)) == model.config.num_hidden_layers
    assert torch.equal(got, want)


@needs_triton
def test_calls_that_autograd_records_keep_transformers_function():
    model = build_model("llama")
    install_fused_rotary(model)
    ids, _ = left_padded([6])
    with fused_rotary_active(True):
        model(ids).logits.sum().backward()
    assert sum(f.rotary.calls for f in _fused(model)) == 0
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_config_validates_and_resolves():
    model = build_model("llama")
    with pytest.raises(ValueError, match="fused_rotary must be True, False or None"):
        OffloadCache(model, fused_rotary=1, **SMALL)
    ids, mask = left_padded([20])
    for setting in (None, False):  # None: on CUDA only
        cache = OffloadCache(model, fused_rotary=setting, **SMALL)
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
        assert {layer.execution.fusions[1] for layer in cache.offload_layers} == {False}
    if not TRITON:
        cache = OffloadCache(model, fused_rotary=True, **SMALL)
        with pytest.raises(RuntimeError, match="fused_rotary=True needs Triton"):
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2)
    cache = OffloadCache(model, **SMALL)
    cache.set_options(fused_rotary=False)
    assert cache.config.fused_rotary is False


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_generate_through_the_cache_gives_the_tokens_and_logits_of_transformers_rotary(arch):
    model = build_model(arch)
    ids, mask = left_padded([30, 21], seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    runs = {}
    for setting in (True, False):
        cache = OffloadCache(model, fused_rotary=setting, fused_norms=False, **SMALL)
        runs[setting] = model.generate(**kwargs, past_key_values=cache)
    assert sum(f.rotary.calls for f in _fused(model)) > 0
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    for a, b in zip(runs[True].logits, runs[False].logits):
        assert torch.equal(a, b)
    disable_offload_attention(model)
    assert not any("forward" in m.__dict__ for m in _attention(model))


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_cuda_fused_rotary_by_default_in_graphs_gives_the_outputs_of_transformers(arch):
    """On CUDA ``fused_rotary`` is on by default, inside the whole-layer graphs too: bfloat16 decode below the full
    budget gives the tokens and logits of the same cache with transformers' rotary embedding, bit for bit."""
    model = build_model(arch).to("cuda", torch.bfloat16)
    ids, mask = left_padded([90, 70], seed=5)
    kwargs = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, do_sample=False,
                  output_logits=True, return_dict_in_generate=True)  # fmt: skip
    runs = {}
    for setting in (None, False):
        cache = OffloadCache(model, fused_rotary=setting, cuda_graphs=None, **SMALL)
        runs[setting] = model.generate(**kwargs, past_key_values=cache)
        assert {layer.execution.fusions[1] for layer in cache.offload_layers} == {setting is None}
        assert sum(int(layer.stats.layer_graph_replays) for layer in cache.offload_layers) > 0
    assert sum(f.rotary.calls for f in _fused(model)) >= model.config.num_hidden_layers
    assert torch.equal(runs[None].sequences, runs[False].sequences)
    for a, b in zip(runs[None].logits, runs[False].logits):
        assert torch.equal(a, b)
    disable_offload_attention(model)


@needs_triton
def test_stats_say_which_modules_are_fused_and_whether_the_calls_run_them():
    model = build_model("qwen3")  # q / k norms besides the two per layer
    layers = model.config.num_hidden_layers
    ids, mask = left_padded([20])
    cache = OffloadCache(model, fused_rotary=True, fused_norms=False, **SMALL)
    before = cache.stats()["fusions"]
    assert before["rotary_modules"] == layers and before["norm_modules"] == 4 * layers
    assert before["norms"] is None and before["rotary"] is None  # no layer call yet
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    after = cache.stats()["fusions"]
    assert after["rotary"] is True and after["norms"] is False
    disable_offload_attention(model)
    assert cache.stats()["fusions"]["rotary_modules"] == 0


def test_stats_report_no_fused_rotary_for_a_form_it_does_not_know():
    model = build_model("phi3")
    cache = OffloadCache(model, **SMALL)
    assert cache.stats()["fusions"]["rotary_modules"] == 0
    disable_offload_attention(model)
