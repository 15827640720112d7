"""Every attention implementation a model can be loaded with on this CUDA machine (``eager``, ``sdpa``,
``flex_attention``, and ``flash_attention_2`` / ``_3`` where the package is installed): switched, and with an
OffloadCache at a budget that covers the context it generates DynamicCache's tokens under the same implementation.
Skipped without CUDA."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, disable_offload_attention

from ..helpers import build_model, left_padded

pytestmark = pytest.mark.cuda

IMPLEMENTATIONS = ["eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"]
PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_cuda_every_installed_implementation_switches_and_generates_exactly(implementation):
    package = PACKAGES.get(implementation)
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    # float32 where the implementation takes it (the library's attention and the model's then agree to rounding
    # far below a token flip); flash attention runs half precision only.
    dtype = torch.bfloat16 if implementation.startswith("flash") else torch.float32
    model = build_model("llama").to("cuda", dtype)
    model.set_attn_implementation(implementation)
    plain = copy.deepcopy(model)
    # Right-aligned prompts of equal length: flash attention's varlen path and flex's masks need no padding here.
    ids, mask = left_padded([600, 600], seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        expected = plain.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=plain.config),
                                  max_new_tokens=12, do_sample=False)  # fmt: skip
        cache = OffloadCache(model, budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8)
        assert model.config._attn_implementation == f"hf_offload_{implementation}"
        got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                             do_sample=False)  # fmt: skip
        again = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                               max_new_tokens=12, do_sample=False)  # fmt: skip
    assert cache.stats()["decode_steps"] == 11
    assert torch.equal(again, expected)  # any other cache: the model's own implementation, unchanged
    assert torch.equal(got, expected)
    disable_offload_attention(model)
    assert model.config._attn_implementation == implementation
