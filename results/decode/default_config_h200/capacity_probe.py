"""Op by op on the CPU (float32 tiny Llama from the tests, batch 3, 60 greedy steps): the tokens and logits of
decode_capacity_blocks=1 against 64, for the default selector and plain quantkey.

    python results/decode/default_config_h200/capacity_probe.py
"""
import torch, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from tests.conftest import build_model, left_padded
from hf_offload import OffloadCache
torch.manual_seed(0)
model = build_model("llama")
ids, mask = left_padded([150, 120, 90], seed=5)
outs = {}
for cap in (1, 64):
    for sel in ("quantkey[bits=4,tail_bits=2,tail_near=3]", "quantkey"):
        cache = OffloadCache(model, budget_tokens=48, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=48,
                             selector=sel, decode_capacity_blocks=cap)
        with torch.no_grad():
            o = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=60,
                               min_new_tokens=60, do_sample=False, output_logits=True, return_dict_in_generate=True)
        outs[(cap, sel)] = (o.sequences, torch.stack(o.logits))
for sel in ("quantkey[bits=4,tail_bits=2,tail_near=3]", "quantkey"):
    a, b = outs[(1, sel)], outs[(64, sel)]
    print(sel, "tokens equal", torch.equal(a[0], b[0]), "logits max diff", (a[1] - b[1]).abs().max().item())
