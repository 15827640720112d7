"""The asynchronous kernel transfer path against the synchronous portable path, on a real-shaped model.

Builds a random-weight model of a real architecture on the GPU (speed and data movement do not depend on the
weights), fills a long prompt, and decodes many steps with ``OffloadCache(transfer="kernel")`` (one launch per layer
and step, no host synchronisation) and ``transfer="torch"`` (host-side gather, synchronous). The generated tokens
must be identical; the script also reports time per step and the cache statistics of both. Raw JSON to ``--out``.

    python benchmarks/check_transfer_paths.py --steps 500 --out results/recall/transfer_paths.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload import OffloadCache, generate_cache_kwarg  # noqa: E402
from hf_offload.tools.bench import SHAPES as BENCH_SHAPES  # noqa: E402

# The shapes of ``hf-offload bench`` under their short names here (``--shape llama-8b`` in the results READMEs).
SHAPES = {"tiny": BENCH_SHAPES["tiny"], "llama-1b": BENCH_SHAPES["llama-3.2-1b"], "llama-8b": BENCH_SHAPES["llama-3.1-8b"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--selectors", nargs="+", default=["solohead", "headwise"])
    parser.add_argument("--out", default="results/recall/transfer_paths.json")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=args.context + args.steps + 16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.context), device="cuda")
    results = []
    for selector in args.selectors:
        outs = {}
        for transfer in ("kernel", "torch"):
            cache = OffloadCache(model, budget_tokens=args.budget, selector=selector, transfer=transfer)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    prompt, attention_mask=torch.ones_like(prompt), **{generate_cache_kwarg(): cache}, do_sample=False,
                    max_new_tokens=args.steps, min_new_tokens=args.steps, prefill_chunk_size=4096,
                )  # fmt: skip
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
            stats = cache.stats()
            stats.pop("layers")
            outs[transfer] = out[:, args.context :].cpu()
            results.append({"selector": selector, "transfer": transfer, "total_s": total, "stats": stats})
            print(f"{selector:9s} {transfer:6s} total {total:7.2f} s  hit {stats['hit_rate']:.3f}  "
                  f"decode recall {stats['decode_recalled_bytes'] / 2**30:.2f} GiB", flush=True)  # fmt: skip
            del cache
            torch.cuda.empty_cache()
        same = bool(torch.equal(outs["kernel"], outs["torch"]))
        first_diff = None if same else int((outs["kernel"] != outs["torch"]).any(0).nonzero()[0])
        results.append({"selector": selector, "tokens_identical": same, "first_differing_step": first_diff,
                        "steps": args.steps})  # fmt: skip
        print(f"{selector}: kernel vs torch tokens identical over {args.steps} steps: {same}", flush=True)
    write_results(args.out, {"metadata": run_metadata(args, note="random weights; prompt of random tokens; KV filled by a real (chunked) prefill"), "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
