"""A decode forward builds its forced (sink and window) blocks once for all layers, with the same selections."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_offload.attention as attention
from hf_offload import OffloadCache


def test_forced_blocks_built_once_per_forward(monkeypatch):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 300))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding: the sink starts later in sequence 1
    builds, calls = [], []
    original = attention.OffloadMask.memo

    def counting(self, key, build):
        calls.append(key)
        return original(self, key, lambda: builds.append(key) or build())

    monkeypatch.setattr(attention.OffloadMask, "memo", counting)
    cache = OffloadCache(model, budget_tokens=96, block_tokens=16, sink_tokens=16, window_tokens=32, selector="solohead")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
    forced = [k for k in calls if k[0] == "forced"]
    assert len(forced) == 4 * 4  # 4 layers x 4 decode forwards (the first token comes from the prompt's forward)
    assert len([k for k in builds if k[0] == "forced"]) == 4  # once per forward
    # Same tokens as without the memo (every layer computing its own forced blocks).
    monkeypatch.setattr(attention.OffloadMask, "memo", lambda self, key, build: build())
    cache = OffloadCache(model, budget_tokens=96, block_tokens=16, sink_tokens=16, window_tokens=32, selector="solohead")
    with torch.no_grad():
        again = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, again)
