"""How well layer-ahead lookahead guesses the next layer's blocks, per query source, on a real or random model.

For each setting (lookahead off; ``lookahead_query="same"``: the layer's own query; ``"next"``: the next layer's
query predicted from the layer's input, ``hf_offload.cache.lookahead``) the same needle prompts decode greedily through an
``OffloadCache`` (every block offloaded) and the script reports, from ``cache.stats()``: blocks prefetched per
decode step, the share of them that the next layer's exact plan attended (``prefetch_used_blocks /
prefetched_blocks``: the guess's precision), the share of the exact plans' misses that a prefetch had already
covered (``prefetch_used_blocks / (prefetch_used_blocks + decode recalls)``), the hit rate, and whether the tokens
equal those of the run without lookahead (they must: lookahead only moves data early). Speed is not measured
here (on a CPU the prefetch runs synchronously).

    python benchmarks/lookahead_accuracy.py --model qwen05 --context 3072 --budget 256 --prompts 2 \\
        --out results/selection/lookahead_accuracy_qwen05.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload import OffloadCache, generate_cache_kwarg  # noqa: E402

SETTINGS = {"off": dict(lookahead=False), "same": dict(lookahead=True, lookahead_query="same"),
            "next": dict(lookahead=True, lookahead_query="next")}  # fmt: skip


def _random_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=16384)  # fmt: skip
    return LlamaForCausalLM(config).eval()


def prompts(args) -> tuple[object, list[torch.Tensor]]:
    """The model and the prompts' token ids (``[1, n]`` each)."""
    if args.model == "random":
        model = _random_llama(args.layers)
        g = torch.Generator().manual_seed(0)
        return model, [torch.randint(3, 4096, (1, args.context), generator=g) for _ in range(args.prompts)]
    from eval_harness.needle import make_needle_prompts
    from hf_offload.tools.models import load

    model, tokenizer = load(args.model, dtype=torch.float32)
    samples = make_needle_prompts(tokenizer, args.context, n=args.prompts, seed=0, chat=True)
    return model.eval(), [torch.tensor([s["input_ids"]]) for s in samples]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random",
                        help="'random' (a random Llama) or a name of hf_offload.tools.models")
    parser.add_argument("--layers", type=int, default=8, help="--model random: decoder layers")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24, help="decode steps per prompt")
    parser.add_argument("--selector", default="quantkey")
    parser.add_argument("--lookahead-blocks", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    model, ids_list = prompts(args)
    rows = {}
    for name, setting in SETTINGS.items():
        totals = dict(prefetched=0, used=0, recalled=0, lookups=0, hits=0, steps=0, seconds=0.0)
        tokens = []
        for ids in ids_list:
            cache = OffloadCache(model, budget_tokens=args.budget, selector=args.selector,
                                 lookahead_blocks=args.lookahead_blocks, **setting)  # fmt: skip
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                                     max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False)  # fmt: skip
            totals["seconds"] += time.perf_counter() - start
            tokens.append(out[0, ids.shape[1]:].tolist())
            stats = cache.stats()
            totals["prefetched"] += stats["prefetched_blocks"]
            totals["used"] += stats["prefetch_used_blocks"]
            totals["recalled"] += stats["decode_recalled_blocks"] - stats["prefetched_blocks"]
            for layer in stats["layers"].values():
                totals["lookups"] += layer["lookups"]
                totals["hits"] += round((layer["hit_rate"] or 0.0) * layer["lookups"])
            totals["steps"] += stats["decode_steps"]
        rows[name] = {
            **totals,
            "precision": totals["used"] / totals["prefetched"] if totals["prefetched"] else None,
            "covered": totals["used"] / (totals["used"] + totals["recalled"]) if totals["used"] + totals["recalled"]
            else None,
            "hit_rate": totals["hits"] / totals["lookups"] if totals["lookups"] else None,
            "tokens": tokens,
        }
        rows[name]["same_tokens_as_off"] = tokens == rows["off"]["tokens"]
        r = rows[name]
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"{name:5s} prefetched {r['prefetched']:7d} used {r['used']:6d} precision {fmt(r['precision'])} "
              f"covered {fmt(r['covered'])} hit rate {fmt(r['hit_rate'])} same tokens {r['same_tokens_as_off']} "
              f"({r['seconds']:.1f} s)", flush=True)  # fmt: skip
    if args.out:
        write_results(args.out, {"metadata": run_metadata(args), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
