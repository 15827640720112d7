"""Sibling projections as one product (``hf_offload.patches.projections``): which groups are taken, that the weights
become views with the same values and no added memory, that the product runs only inside the cache's decoder layer
calls with ``fused_projections`` on, that outputs match the separate products, and that a changed model falls back."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache, disable_offload_attention
from hf_offload.kernels.act import silu_mul, silu_mul_reference, silu_mul_supported
from hf_offload.kernels.gather import kernels_available
from hf_offload.patches.projections import (
    ProjectionForward,
    fused_groups,
    fused_mlps,
    fused_projections_active,
    install_fused_projections,
    remove_fused_projections,
)

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import ARCHS, build_model, left_padded

TRITON = kernels_available(torch.device("cpu"))  # the CPU interpreter (TRITON_INTERPRET=1)
GROUPED = {"llama", "mistral", "qwen2", "qwen3", "gemma3"}  # Phi-3 has its own qkv_proj and gate_up_proj


def _storages(model) -> int:
    """Bytes of the distinct storages behind the model's parameters."""
    seen = {}
    for p in model.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("arch", ARCHS)
def test_install_groups_siblings_as_views_with_the_same_values(arch):
    model = build_model(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    size = _storages(model)
    groups = install_fused_projections(model)
    assert install_fused_projections(model) == groups  # idempotent
    assert groups == (2 * model.config.num_hidden_layers if arch in GROUPED else 0)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert _storages(model) == size  # the old tensors are gone: no memory added
    for group in fused_groups(model):
        assert group.intact()
        start = 0
        for m, n in zip(group.modules, group.sizes):
            assert m.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
            assert torch.equal(m.weight, group.weight[start : start + n])
            start += n
    remove_fused_projections(model)
    assert not any(isinstance(m.__dict__.get("forward"), ProjectionForward) for m in model.modules())
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)


def test_biases_are_grouped_too():
    model = build_model("qwen2")  # q, k and v have biases; gate and up none
    install_fused_projections(model)
    attn = model.model.layers[0].self_attn
    group = attn.q_proj.forward.group
    assert group.bias is not None and group.bias.shape == (group.weight.shape[0],)
    assert torch.equal(attn.v_proj.bias, group.bias[-attn.v_proj.out_features :])
    assert model.model.layers[0].mlp.gate_proj.forward.group.bias is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_outside_the_active_context_each_module_computes_its_own_product(arch):
    model = build_model(arch)
    ids, _ = left_padded([9, 9])
    with torch.no_grad():
        want = model(ids).logits
    install_fused_projections(model)
    with torch.no_grad():
        got = model(ids).logits
    assert torch.equal(got, want)
    assert sum(g.calls for g in fused_groups(model)) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_inside_the_active_context_one_product_gives_the_same_logits(arch):
    model = build_model(arch)
    ids, _ = left_padded([11, 11], seed=2)
    with torch.no_grad():
        want = model(ids).logits
    install_fused_projections(model)
    with torch.no_grad(), fused_projections_active(True):
        got = model(ids).logits
    groups = fused_groups(model)
    assert [g.calls for g in groups] == [1] * len(groups)  # each group's product once, its siblings served from it
    assert all(g._input is None for g in groups)  # nothing held after the layer
    mlps = fused_mlps(model)  # where Triton runs, a SiLU MLP's product and activation go through its own forward
    assert [f.calls for f in mlps] == [1 if TRITON else 0] * len(mlps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same sums; the library may add them apart


def test_a_sibling_called_with_another_input_computes_its_own_product():
    model = build_model("llama")
    install_fused_projections(model)
    attn = model.model.layers[0].self_attn
    x, other = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    with torch.no_grad(), fused_projections_active(True):
        q = attn.q_proj(x)
        k_other = attn.k_proj(other)  # not the input the group's product was computed with
        k = attn.k_proj(x)
        k_again = attn.k_proj(x)  # already handed out: computed again
    torch.testing.assert_close(q, x @ attn.q_proj.weight.T)
    torch.testing.assert_close(k_other, other @ attn.k_proj.weight.T)
    torch.testing.assert_close(k, x @ attn.k_proj.weight.T)
    torch.testing.assert_close(k_again, k)


def test_a_changed_model_falls_back_to_separate_products():
    model = build_model("llama")
    install_fused_projections(model)
    model.double()  # every parameter replaced: the weights are no longer views of the groups' tensors
    groups = fused_groups(model)
    assert not any(g.intact() for g in groups)
    ids, _ = left_padded([7])
    with torch.no_grad():
        want = model(ids).logits
    with torch.no_grad(), fused_projections_active(True):
        got = model(ids).logits
    assert torch.equal(got, want) and sum(g.calls for g in groups) == 0
    attn = model.model.layers[1].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())
    assert not attn.q_proj.forward.group.intact()


def test_calls_that_autograd_records_compute_separate_products():
    model = build_model("llama")
    install_fused_projections(model)
    ids, _ = left_padded([6])
    with fused_projections_active(True):
        model(ids).logits.sum().backward()
    assert sum(g.calls for g in fused_groups(model)) == 0
    assert model.model.layers[0].self_attn.k_proj.weight.grad is not None


def test_modules_that_cannot_be_grouped_are_left_alone():
    model = build_model("llama")
    layer0, layer1 = model.model.layers[0], model.model.layers[1]

    class MyLinear(torch.nn.Linear):
        pass

    mine = MyLinear(64, layer0.mlp.up_proj.out_features, bias=False)
    layer0.mlp.up_proj = mine  # a subclass
    handle = layer1.self_attn.v_proj.register_forward_hook(lambda *a: None)  # a hook (accelerate's, say)
    assert install_fused_projections(model) == 2
    assert "forward" not in mine.__dict__ and "forward" not in layer0.mlp.gate_proj.__dict__
    assert "forward" not in layer1.self_attn.q_proj.__dict__
    handle.remove()


def test_config_validates_resolves_and_set_options_builds_groups():
    model = build_model("llama")
    with pytest.raises(ValueError, match="fused_projections must be True, False or None"):
        OffloadCache(model, fused_projections="yes", **SMALL)
    cache = OffloadCache(model, **SMALL)  # None: on CUDA only
    assert fused_groups(model) == []
    ids, mask = left_padded([20])
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert {layer.execution.fusions[2] for layer in cache.offload_layers} == {False}
    assert cache.stats()["fusions"]["projection_groups"] == 0
    cache.set_options(fused_projections=True)
    assert len(fused_groups(model)) == 4 and cache.stats()["fusions"]["projection_groups"] == 4


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_generate_through_the_cache_gives_the_tokens_of_separate_products(arch):
    model = build_model(arch)
    ids, mask = left_padded([30, 21], seed=3)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 6, "do_sample": False,
              "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    runs = {}
    for setting in (False, True):
        cache = OffloadCache(model, fused_projections=setting, **SMALL)
        runs[setting] = model.generate(**kwargs, past_key_values=cache)
        assert {layer.execution.fusions[2] for layer in cache.offload_layers} == {setting}
        assert cache.stats()["fusions"]["projections"] is setting
    assert sum(g.calls for g in fused_groups(model)) > 0
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    for a, b in zip(runs[True].logits, runs[False].logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    disable_offload_attention(model)
    assert not any(isinstance(m.__dict__.get("forward"), ProjectionForward) for m in model.modules())


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_cuda_fused_projections_by_default_in_graphs(arch):
    """On CUDA ``fused_projections`` is on by default, inside the whole-layer graphs too: bfloat16 decode below the
    full budget gives the tokens of the same cache with separate products, and logits within bfloat16 rounding."""
    model = build_model(arch).to("cuda", torch.bfloat16)
    ids, mask = left_padded([90, 70], seed=5)
    kwargs = {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "max_new_tokens": 24, "do_sample": False,
              "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    runs = {}
    for setting in (False, None):
        cache = OffloadCache(model, fused_projections=setting, cuda_graphs=None, **SMALL)
        runs[setting] = model.generate(**kwargs, past_key_values=cache)
        assert {layer.execution.fusions[2] for layer in cache.offload_layers} == {setting is None}
        assert sum(int(layer.stats.layer_graph_replays) for layer in cache.offload_layers) > 0
    assert sum(g.calls for g in fused_groups(model)) >= 2 * model.config.num_hidden_layers
    same = (runs[None].sequences == runs[False].sequences).float().mean().item()
    assert same >= 0.95, same  # bfloat16: a near tie may break the other way after a different rounding
    first = (runs[None].logits[0].float() - runs[False].logits[0].float()).abs().max().item()
    assert first < 0.1, first
    disable_offload_attention(model)



@pytest.mark.parametrize("arch", ARCHS)
def test_gated_silu_mlps_get_their_own_forward(arch):
    model = build_model(arch)
    install_fused_projections(model)
    want = arch in {"llama", "mistral", "qwen2", "qwen3"}  # Gemma 3: GELU; Phi-3: its own gate_up_proj
    assert len(fused_mlps(model)) == (model.config.num_hidden_layers if want else 0)
    remove_fused_projections(model)
    assert fused_mlps(model) == []


@pytest.mark.skipif(not TRITON, reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_kernel_rounds_as_torch(dtype):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(3, 5, 2 * 1500, generator=g) * 4).to(dtype)
    got, want = silu_mul(gate_up), silu_mul_reference(gate_up)
    assert got.shape == (3, 5, 1500) and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # NumPy's exp and torch's differ far below bfloat16's last place
    else:  # the interpreter's exp may differ from torch's CPU exp in the last float32 bit
        torch.testing.assert_close(got, want, rtol=2e-3 if dtype == torch.float16 else 1e-6, atol=1e-6)


def test_silu_mul_reference_is_transformers_mlp_product():
    gate_up = torch.randn(2, 7, 10)
    gate, up = gate_up[..., :5], gate_up[..., 5:]
    assert torch.equal(silu_mul_reference(gate_up), torch.nn.functional.silu(gate) * up)
    assert not silu_mul_supported(gate_up[..., :9])  # an odd last dimension
    strided = torch.randn(2, 7, 20)[..., ::2]  # no unit stride along the last dimension: the reference runs
    assert not silu_mul_supported(strided)
    assert torch.equal(silu_mul(strided), silu_mul_reference(strided))



@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_silu_mul_is_torch_bit_for_bit(dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    gate_up = (torch.randn(12, 1, 2 * 14336, generator=g, device="cuda") * 3).to(dtype)
    assert torch.equal(silu_mul(gate_up), silu_mul_reference(gate_up))
    rows = gate_up.view(12, -1)[:, : 2 * 5000]  # rows of a wider buffer
    assert torch.equal(silu_mul(rows), silu_mul_reference(rows))
