"""Time per phase of one decode step with the KV offloaded, on a real-shaped random-weight model.

The KV cache is filled directly with random keys and values (no prefill: decode speed does not depend on the KV
contents, only its size), then the model decodes ``--steps`` tokens through ``generate()`` with
``OffloadCache(timing=True)``. Reports mean milliseconds per decode step of select / recall / attention / rest,
tokens per second, hit rate and recalled bytes per step, for each transfer path. Raw JSON to ``--out``.

    python benchmarks/bench_decode_step.py --shape llama-8b --context 32768 --batch 8 --budget 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.check_transfer_paths import SHAPES  # noqa: E402
from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload import OffloadCache  # noqa: E402
from hf_offload.bench import fill_random  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--transfers", nargs="+", default=["kernel", "torch"])
    parser.add_argument("--selector", default="solohead")
    parser.add_argument("--out", default="results/decode/decode_step.json")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES[args.shape]
    config = LlamaConfig(**shape, max_position_embeddings=args.context + args.steps + 16)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    with device:
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    build_s = time.perf_counter() - t0
    runs = []
    for transfer in args.transfers:
        cache = OffloadCache(model, budget_tokens=args.budget, selector=args.selector, transfer=transfer, timing=True)
        t0 = time.perf_counter()
        fill_random(cache, args.batch, args.context, shape["num_key_value_heads"], shape["head_dim"], device)
        if cuda:
            torch.cuda.synchronize()
        fill_s = time.perf_counter() - t0
        ids = torch.randint(0, config.vocab_size, (args.batch, args.context + 1), device=device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, do_sample=False,
                           max_new_tokens=args.steps, min_new_tokens=args.steps)  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        total_s = time.perf_counter() - t0
        stats = cache.stats()
        stats.pop("layers")
        timing = stats["timing"]
        run = {
            "transfer": transfer,
            "fill_s": fill_s,
            "generate_s": total_s,
            "tokens_per_s": args.batch * timing["timed_steps"] / (timing["step_ms"] * timing["timed_steps"] / 1e3),
            "decode_recalled_bytes_per_step": stats["decode_recalled_bytes"] / max(stats["decode_steps"], 1),
            "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "stats": stats,
        }
        runs.append(run)
        print(f"{transfer:6s} step {timing['step_ms']:7.2f} ms = select {timing['select_ms']:.2f} + recall "
              f"{timing['recall_ms']:.2f} + attention {timing['attention_ms']:.2f} + rest {timing['rest_ms']:.2f}; "
              f"{run['tokens_per_s']:.1f} tok/s; hit {stats['hit_rate']:.3f}; recall "
              f"{run['decode_recalled_bytes_per_step'] / 2**20:.1f} MiB/step; fill {fill_s:.1f} s", flush=True)  # fmt: skip
        del cache
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    write_results(args.out, {"metadata": run_metadata(args, model_build_s=build_s, note="decode-only: the KV is filled with random values without a prefill; random weights"), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
