"""Whether fused RMS norms (``OffloadConfig.fused_norms``) change what a real model generates.

The same needle prompts decode greedily through an ``OffloadCache`` with ``fused_norms=True`` and with
``fused_norms=False`` (transformers' norms), at a full budget (every token attended: the cache is exact, so any
difference comes from the norms; for scale, the cache with transformers' norms is also compared with DynamicCache,
whose attention kernels round differently) and at a sparse budget, in the model's dtype (``--dtype``, bfloat16 by default, where
the norms round their output). Reports per setting whether the tokens are identical, the largest absolute difference
of the logits over all decode steps, and the largest difference relative to each step's logit range. The kernel runs
where Triton runs: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

    TRITON_INTERPRET=1 python benchmarks/fused_norms_accuracy.py --model qwen05 --context 2048 --prompts 2 \\
        --out results/selection/fused_norms_accuracy_qwen05.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from hf_offload import OffloadCache, disable_offload_attention  # noqa: E402
from hf_offload.cache import generate_cache_kwarg  # noqa: E402
from hf_offload.patches.norms import FusedNorm  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _decode(model, ids: torch.Tensor, budget: int, steps: int, fused: bool, selector: str):
    """Greedy decode through an OffloadCache (``budget`` tokens, ``fused`` norms), or through transformers'
    DynamicCache with ``budget=None``; returns the new tokens, the logits ``[steps, 1, vocab]`` (float32) and the
    kernel calls of the fused norms."""
    cache = DynamicCache() if budget is None else OffloadCache(model, budget_tokens=budget, selector=selector,
                                                                 fused_norms=fused)  # fmt: skip
    kwargs = {generate_cache_kwarg(): cache}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)  # fmt: skip
    kernel_calls = sum(m.forward.calls for m in model.modules() if isinstance(m.__dict__.get("forward"), FusedNorm))
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits).float(), kernel_calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen05", help="a name of hf_offload.tools.models, or 'random' (a small "
                        "random Llama and random prompts, for tests)")  # fmt: skip
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 256],
                        help="budget_tokens per setting; 0: the whole prompt and every new token (exact)")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per prompt")
    parser.add_argument("--selector", default="quantkey[bits=4,tail_bits=2,tail_near=3]")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    if args.model == "random":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
        model = LlamaForCausalLM(config).to(DTYPES[args.dtype]).eval()
        g = torch.Generator().manual_seed(0)
        ids_list = [torch.randint(3, 512, (1, args.context), generator=g) for _ in range(args.prompts)]
    else:
        from eval_harness.needle import make_needle_prompts
        from hf_offload.tools.models import load

        model, tokenizer = load(args.model, dtype=DTYPES[args.dtype])
        model.eval()
        samples = make_needle_prompts(tokenizer, args.context, n=args.prompts, seed=0, chat=True)
        ids_list = [torch.tensor([s["input_ids"]]) for s in samples]
    rows = []
    for budget in args.budgets:
        # Whole blocks covering the longest prompt and every new token: nothing is left out.
        tokens = budget or 16 * -(-(max(i.shape[1] for i in ids_list) + args.steps + 64) // 16)
        for p, ids in enumerate(ids_list):
            start = time.perf_counter()
            dense = _decode(model, ids, None, args.steps, False, args.selector) if budget == 0 else None
            base, base_logits, _ = _decode(model, ids, tokens, args.steps, False, args.selector)
            fused, fused_logits, calls = _decode(model, ids, tokens, args.steps, True, args.selector)
            disable_offload_attention(model)
            diff = (fused_logits - base_logits).abs()
            spread = base_logits.amax(-1) - base_logits.amin(-1)
            first = next((i for i, (a, b) in enumerate(zip(base, fused)) if a != b), None)
            row = {
                "budget_tokens": tokens, "exact": budget == 0, "prompt": p, "prompt_tokens": ids.shape[1],
                "same_tokens": base == fused, "first_different_step": first,
                # Logits compared over the steps both runs share the same prefix (all of them if the tokens agree).
                "max_abs_logit_diff": diff[: first + 1 if first is not None else None].max().item(),
                "max_rel_logit_diff": (diff.amax(-1) / spread)[: first + 1 if first is not None else None].max().item(),
                "kernel_calls": calls, "seconds": time.perf_counter() - start,
            }  # fmt: skip
            if dense is not None:  # the noise floor: transformers' norms, the cache against DynamicCache
                d_first = next((i for i, (a, b) in enumerate(zip(dense[0], base)) if a != b), None)
                d_diff = (base_logits - dense[1]).abs()[: d_first + 1 if d_first is not None else None]
                row.update(dense_same_tokens=dense[0] == base, dense_max_abs_logit_diff=d_diff.max().item())
            rows.append(row)
            print(f"budget {tokens:6d} prompt {p} ({row['prompt_tokens']} tokens): same tokens {row['same_tokens']}, "
                  f"max |logit diff| {row['max_abs_logit_diff']:.4f} ({row['max_rel_logit_diff']:.2e} of the range), "
                  f"{calls} kernel calls ({row['seconds']:.0f} s)"
                  + (f"; cache against DynamicCache (norms off): same tokens {row['dense_same_tokens']}, max |logit "
                     f"diff| {row['dense_max_abs_logit_diff']:.4f}" if dense is not None else ""), flush=True)  # fmt: skip
    if args.out:
        write_results(args.out, {"metadata": run_metadata(args), "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
