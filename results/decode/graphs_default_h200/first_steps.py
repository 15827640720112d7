"""The first decode steps with CUDA graphs on (the default) and off: seconds of generate() for 1, 2, 3 and 8 new
tokens, each a fresh cache, in one process (Llama-3.2-1B shape, random bf16 weights, batch 2, 8,192-token prompts,
budget 2048; the default selector and plain quantkey), and a profile of the 3-token call with graphs on. The first
calls of a process include Triton's compilation; the later ones show what a capture costs once compiled.

    python results/decode/graphs_default_h200/first_steps.py > $OUT/first_steps_run3.txt
"""
import cProfile, pstats, time, io, sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from transformers import LlamaConfig, LlamaForCausalLM
from hf_offload import OffloadCache

cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=64, vocab_size=32000, max_position_embeddings=16384)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
ids = torch.randint(0, 32000, (2, 8192), device="cuda")
mask = torch.ones_like(ids)
for name, opts in (("default", {}), ("plain", {"selector": "quantkey"})):
    for graphs in (None, False):
        times = []
        for steps in (1, 2, 3, 8):
            cache = OffloadCache(model, budget_tokens=2048, cuda_graphs=graphs, **opts)
            torch.cuda.synchronize(); t = time.perf_counter()
            prof = cProfile.Profile() if (steps == 3 and graphs is None) else None
            if prof: prof.enable()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps,
                               do_sample=False)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
            if prof:
                prof.disable(); s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-3500:])
        print(name, "graphs", graphs, "generate s for 1/2/3/8 tokens:", [round(x, 2) for x in times], flush=True)
