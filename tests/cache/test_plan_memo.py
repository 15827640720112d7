"""A decode forward builds its shared inputs (attendable tokens, valid and forced blocks) once for all layers, with
the same selections as when every layer builds its own."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_offload import OffloadCache
from hf_offload.attention import DecodeInputs


def test_decode_inputs_built_once_per_forward(monkeypatch):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (2, 300))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding: the sink starts later in sequence 1
    calls, fills = [], []
    original = DecodeInputs.update

    def counting(self, *args, **kwargs):
        before = self._step
        calls.append(1)
        out = original(self, *args, **kwargs)
        if self._step != before:
            fills.append(self._step)
        return out

    monkeypatch.setattr(DecodeInputs, "update", counting)
    cache = OffloadCache(model, budget_tokens=96, block_tokens=16, sink_tokens=16, window_tokens=32, selector="solohead")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert len(calls) == 4 * 4  # 4 layers x 4 decode forwards (the first token comes from the prompt's forward)
    assert len(fills) == 4  # once per forward
    layer = cache.offload_layers[0]
    inputs = layer.resources.decode_inputs(layer.device)
    n = layer.n_blocks - (1 if layer.keys.shape[-2] == 0 else 0)  # blocks before the last decode step
    capacity = layer.execution.capacity_blocks  # the sealed blocks rounded up to it (64 for solohead)
    assert capacity == 64 and inputs.forced.shape == (2, -(-n // capacity) * capacity)
    assert not inputs.forced[:, n:].any()  # the blocks past the sealed ones are never forced
    # Sequence 1's sink starts at its first real block (37 padding tokens: block 2), sequence 0's at block 0.
    assert inputs.forced[0, 0] and not inputs.forced[1, 0] and inputs.forced[1, 2]
    # Same tokens when every layer rebuilds the inputs.
    def rebuild(self, *args, **kwargs):
        self.invalidate()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecodeInputs, "update", rebuild)
    cache = OffloadCache(model, budget_tokens=96, block_tokens=16, sink_tokens=16, window_tokens=32, selector="solohead")
    with torch.no_grad():
        again = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, again)
