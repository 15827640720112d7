"""Fused RMS norms (``hf_offload.patches.norms``): which modules are taken, that they run the kernel only inside the
cache's decoder layer calls with ``fused_norms`` on, that outputs stay those of transformers' norms, and that
removing the cache's routing gives every module its own forward back. The kernel runs where Triton runs: on CUDA, or
on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``); the rest runs everywhere."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, disable_offload_attention
from hf_offload.kernels.gather import kernels_available
from hf_offload.patches.norms import FusedNorm, fused_norms_active, install_fused_norms, norm_form, remove_fused_norms

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import ARCHS, build_model, left_padded

TRITON = kernels_available(torch.device("cpu"))
needs_triton = pytest.mark.skipif(not TRITON, reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")


def _norms(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def test_forms_of_the_supported_architectures():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    assert norm_form(LlamaRMSNorm(8, eps=1e-5)) == (False, 1e-5)
    assert norm_form(Qwen2RMSNorm(8, eps=1e-6)) == (False, 1e-6)  # generated from Llama's: the same code
    assert norm_form(Qwen3RMSNorm(8)) == (False, 1e-6)
    assert norm_form(Gemma3RMSNorm(8, eps=1e-6)) == (True, 1e-6)


def test_other_norms_are_left_alone():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Scaled(LlamaRMSNorm):  # another definition under a familiar name
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    assert norm_form(Scaled(8)) is None
    assert norm_form(torch.nn.LayerNorm(8)) is None
    assert norm_form(torch.nn.RMSNorm(8)) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_install_covers_the_decoder_layers_and_remove_restores(arch):
    model = build_model(arch)
    layers = model.config.num_hidden_layers
    installed = install_fused_norms(model)
    assert install_fused_norms(model) == installed  # idempotent
    fused = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), FusedNorm)]
    assert len(fused) == installed >= 2 * layers  # at least the two per layer; Qwen3 and Gemma 3 add q / k norms
    assert model.model.norm.__dict__.get("forward") is None  # the final norm is outside the decoder layers
    remove_fused_norms(model)
    assert not any("forward" in m.__dict__ for m in _norms(model))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_outside_the_active_context_the_modules_own_forward_runs(arch):
    model = build_model(arch)
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(2, 3, model.config.hidden_size)
    want = type(norm).forward(norm, x)
    install_fused_norms(model)
    with fused_norms_active(False):
        assert torch.equal(norm(x), want)
    assert torch.equal(norm(x), want) and norm.forward.calls == 0


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_inside_the_active_context_the_kernel_runs(arch):
    model = build_model(arch).to(torch.bfloat16)
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_(0, 0.5)
    x = torch.randn(4, 1, model.config.hidden_size, dtype=torch.bfloat16)
    want = type(norm).forward(norm, x)
    install_fused_norms(model)
    with fused_norms_active(True), torch.no_grad():
        got = norm(x)
    assert norm.forward.calls == 1 and got.dtype == want.dtype and got.shape == want.shape
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-30)
    assert ((got.float() - want.float()).abs() <= ulp).all()  # at most one unit in the last place


def test_config_validates_and_resolves():
    model = build_model("llama")
    with pytest.raises(ValueError, match="fused_norms must be True, False or None"):
        OffloadCache(model, fused_norms="yes", **SMALL)
    ids, mask = left_padded([20])
    for setting, want in ((None, False), (False, False)):  # None: on CUDA only
        cache = OffloadCache(model, fused_norms=setting, **SMALL)
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
        assert {layer.execution.fusions[0] for layer in cache.offload_layers} == {want}
    if not TRITON:  # the first layer call says so, before any token is cached
        cache = OffloadCache(model, fused_norms=True, **SMALL)
        with pytest.raises(RuntimeError, match="fused_norms=True needs Triton"):
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2)
        assert cache.get_seq_length() == 0
    disable_offload_attention(model)


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_decode_with_fused_norms_matches_the_model_s_own(arch):
    """Full budget (nothing dropped): the cache with fused norms gives the tokens and, to float32 rounding, the
    logits of DynamicCache; the kernel ran in every decoder layer call."""
    model = build_model(arch)
    ids, mask = left_padded([30, 22], seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    want = model.generate(**kwargs, past_key_values=DynamicCache())
    cache = OffloadCache(model, fused_norms=True, budget_tokens=128, block_tokens=8, sink_tokens=8, window_tokens=8,
                         transfer="torch")  # fmt: skip
    got = model.generate(**kwargs, past_key_values=cache)
    fused = [m.forward for m in model.modules() if isinstance(m.__dict__.get("forward"), FusedNorm)]
    assert [f.calls for f in fused] == [6] * len(fused)  # every norm of every layer: the prefill and each decode step
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    disable_offload_attention(model)
    assert not any("forward" in m.__dict__ for m in _norms(model))


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_cuda_fused_norms_by_default_in_graphs_give_the_tokens_of_the_models_own(arch):
    """On CUDA ``fused_norms`` is on by default, inside the whole-layer graphs too: bfloat16 decode with the cache's
    budget below the context gives the tokens of the same cache with transformers' norms, logits to bfloat16
    rounding, and the kernel ran in the captured layers."""
    model = build_model(arch).to("cuda", torch.bfloat16)
    ids, mask = left_padded([90, 70], seed=5)
    kwargs = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, do_sample=False,
                  output_logits=True, return_dict_in_generate=True)  # fmt: skip
    runs = {}
    for setting in (None, False):
        cache = OffloadCache(model, fused_norms=setting, cuda_graphs=None, **SMALL)
        runs[setting] = model.generate(**kwargs, past_key_values=cache)
        assert {layer.execution.fusions[0] for layer in cache.offload_layers} == {setting is None}
        assert sum(int(layer.stats.layer_graph_replays) for layer in cache.offload_layers) > 0
    calls = sum(m.forward.calls for m in model.modules() if isinstance(m.__dict__.get("forward"), FusedNorm))
    assert calls >= 2 * model.config.num_hidden_layers
    assert torch.equal(runs[None].sequences, runs[False].sequences)
    for a, b in zip(runs[None].logits, runs[False].logits):
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.02)
    disable_offload_attention(model)


@needs_triton
def test_calls_that_autograd_records_keep_the_modules_own_forward():
    """The kernel has no backward: with gradients on, the norm runs transformers' code and its gradient flows."""
    model = build_model("llama")
    norm = model.model.layers[0].input_layernorm
    install_fused_norms(model)
    x = torch.randn(2, 1, model.config.hidden_size, requires_grad=True)
    with fused_norms_active(True):
        norm(x).sum().backward()
        assert norm.forward.calls == 0 and x.grad is not None and norm.weight.grad is not None
        with torch.no_grad():
            norm(x)
    assert norm.forward.calls == 1
