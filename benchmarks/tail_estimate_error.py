"""How close a decode step's attention output comes to dense attention, with and without an estimate of the tail.

The selection misses 10-20% of the attention mass at a budget of 1/16 (``benchmarks/selection_budget_split.py``);
attention over the selection alone renormalises that mass onto the selected tokens. With
``QuantKeySelector(tail_bits=b)`` every block's values are kept on the device at ``b`` bits beside the quantized
keys, and the unselected blocks' attention is estimated from them and merged with the exact attention over the
selection (``hf_offload.kernels.tail``). This script measures, on real captures, the relative error of the attention
output against dense attention, ``|out - dense| / |dense|`` per query head, averaged over layers, decode queries
and samples, for:

* ``oracle``: the selection by true attention mass, no estimate (the ceiling of any selection alone);
* ``quantkey[bits=k]``: the selection by ``k``-bit keys, no estimate;
* ``quantkey[bits=k,tail_bits=b]``: the same selection plus the estimate of the rest from ``k``-bit keys and
  ``b``-bit values.
* ``quantkey[bits=k,tail_bits=b,tail_near=R]``: the bounded estimate: only the ``R * k`` best unselected blocks
  token by token, the others by their block log-sum-exp (``QuantKeySelector.tail_near``);
* ``quantkey[bits=2]+mean-values``: a coarser estimate (not built into the library): each unselected block
  weighted by its log-sum-exp over the 2-bit keys (the selector's own block scores), times the block's mean value
  (one bf16 vector per block and KV head), as estimates from cluster centroids do.

Inputs, paired by RULER task, seed and sample index: the decode queries and keys of
``benchmarks/selection_recall.py``'s captures (``--query-dir``) and the prompt's keys and values of
``benchmarks/selection_replay.py``'s (``--kv-dir``); the keys of both are checked equal. Only the prompt's tokens
are attended (the replay capture holds no values of the generated tokens), by dense and sparse attention alike.
Each step is planned as the cache plans it (``benchmarks.selection_quality.plan_blocks``: sink and window forced,
the open block attended exactly). Reports also the device bytes of each variant's summaries per block and KV
head, against the block's own keys and values.

    python benchmarks/tail_estimate_error.py --length 4096 --out results/selection/tail_error_qwen05_4k.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_metadata, write_results  # noqa: E402

VARIANTS = [
    "oracle",
    "quantkey[bits=2]",
    "quantkey[bits=2,tail_bits=1]",
    "quantkey[bits=2,tail_bits=2]",
    "quantkey[bits=2,tail_bits=4]",
    "quantkey[bits=2]+mean-values",
    "quantkey[bits=4]",
    "quantkey[bits=4,tail_bits=2]",
    "quantkey[bits=4,tail_bits=4]",
]

MEAN_VALUES = "+mean-values"


def pair_captures(query_dir: str, kv_dir: str, model: str, length: int, seeds: list[int]) -> list[tuple[str, Path, Path]]:
    """``(sample name, query capture, kv capture)`` for every sample captured in both folders."""
    pairs = []
    for q in sorted(Path(query_dir).glob(f"{model}-*-{length}-s*-*-d*.pt")):
        m = re.fullmatch(rf"{re.escape(model)}-(.+)-{length}-s(\d+)-(\d+)-d\d+\.pt", q.name)
        if not m or int(m.group(2)) not in seeds:
            continue
        task, seed, index = m.groups()
        kv = sorted(Path(kv_dir).glob(f"{model}-{task}-{length}-s{seed}-{index}-*.pt"))
        if kv:
            pairs.append((f"{task}-s{seed}-{index}", q, kv[0]))
    return pairs


def variant_bytes(name: str, head_dim: int, block_tokens: int, itemsize: int) -> int:
    """Device bytes per block and KV head of a variant's summaries (quantized keys and values; the oracle reads the
    full keys and values and counts as the block itself)."""
    from hf_offload.selectors import get_selector

    if name == "oracle":
        return 2 * block_tokens * head_dim * itemsize
    selector = get_selector(name.removesuffix(MEAN_VALUES))
    mean_values = head_dim * itemsize if name.endswith(MEAN_VALUES) else 0
    keys = torch.empty((1, 1, 1, block_tokens, head_dim), dtype={2: torch.bfloat16}.get(itemsize, torch.float32))
    summaries = selector.summarize(keys)
    summaries.update(selector.summarize_values(keys))
    return sum(t.numel() * t.element_size() for t in summaries.values()) + mean_values


def sample_errors(queries: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  scaling: float, budget_tokens: int, args) -> dict[str, torch.Tensor]:  # fmt: skip
    """Relative output error per variant, ``[steps, layers]`` each (mean over query heads).

    Args:
        queries: ``[steps, layers, kv_heads, group, head_dim]``, float32, CPU (each attends to the prompt only).
        keys: per layer ``[kv_heads, prompt_tokens, head_dim]``, float32.
        values: per layer, same shape.
        scaling: softmax scale.
        budget_tokens: the decode budget.
    """
    from hf_offload.kernels.tail import attention_lse_reference as _attention_lse
    from hf_offload.config import OffloadConfig
    from hf_offload.kernels.quantkey import block_lse_reference
    from hf_offload.kernels.tail import merge_attention
    from hf_offload.selectors import get_selector
    from hf_offload.selectors.base import Selector
    from benchmarks.selection_quality import block_keys, plan_blocks

    T = args.block_tokens
    config = OffloadConfig(budget_tokens=budget_tokens, block_tokens=T)
    prompt = keys[0].shape[1]
    steps, layers = queries.shape[:2]
    errors = {name: torch.zeros(steps, layers) for name in args.variants}
    selectors = {name: get_selector(name.removesuffix(MEAN_VALUES)) for name in args.variants if name != "oracle"}
    for layer in range(layers):
        K, V = keys[layer], values[layer]
        n = prompt // T  # sealed blocks of the prompt; its last partial block is the open block (exact)
        kb, vb = block_keys(K[None], n, T), block_keys(V[None], n, T)  # [1, n, H, T, D]
        summaries = {}
        for name, sel in selectors.items():
            s = sel.summarize(kb)
            s.update(sel.summarize_values(vb))
            summaries[name] = s
        for step in range(steps):
            q = queries[step, layer][None]  # [1, H, G, D]
            plan = plan_blocks(prompt + 1, batch=1, budget_tokens=budget_tokens, block_tokens=T,
                               sink_blocks=config.sink_blocks, window_blocks=config.window_blocks)  # fmt: skip
            k = plan.k
            all_ok = torch.ones((1, 1, 1, prompt), dtype=torch.bool)
            dense, _ = _attention_lse(q, K[None], V[None], all_ok, scaling)
            valid = torch.ones((1, n), dtype=torch.bool)
            forced = plan.forced[:, :n]
            exact_lse = torch.einsum("bhgd,bnhtd->bhgnt", q * scaling, kb).logsumexp(-1)  # [1, H, G, n]
            for name in args.variants:
                if name == "oracle":
                    selection = Selector.choose(exact_lse.softmax(-1).sum(dim=(1, 2))[:, None], k, forced, valid)
                else:
                    selection = selectors[name].select(q, summaries[name], scaling, k, forced, valid)
                chosen = torch.zeros(n + 1, dtype=torch.bool)
                chosen[torch.where(selection.keep, selection.blocks, n)[0, 0]] = True
                token_ok = torch.cat([chosen[:n].repeat_interleave(T), torch.ones(prompt - n * T, dtype=torch.bool)])
                out, lse = _attention_lse(q, K[None], V[None], token_ok.view(1, 1, 1, -1), scaling)
                sel = selectors.get(name)
                if name.endswith(MEAN_VALUES):
                    sm = summaries[name]
                    block_lse = block_lse_reference(q * scaling, sm["codes"], sm["kmin"], sm["kstep"], sel.bits)
                    block_lse = block_lse.masked_fill(chosen[:n], float("-inf"))  # [1, H, G, n]
                    tail_out = torch.einsum("bhgn,bnhd->bhgd", block_lse.softmax(-1), vb.mean(dim=3))
                    out, _ = merge_attention(out, lse, tail_out, block_lse.logsumexp(-1))
                elif sel is not None and sel.estimates_tail:
                    tail_ok = ~chosen[:n, None].expand(n, T)[None]
                    tail_out, tail_lse = sel.tail_attention(q, summaries[name], scaling, tail_ok, selection=selection)
                    out, _ = merge_attention(out, lse, tail_out, tail_lse)
                err = (out - dense).norm(dim=-1) / dense.norm(dim=-1).clamp(min=1e-12)
                errors[name][step, layer] = err.mean()
    return errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--query-dir", default="/tmp/hfo_selection_captures", help="selection_recall.py's captures")
    p.add_argument("--kv-dir", default="/tmp/hfo_replay_captures", help="selection_replay.py's captures")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="capture file names start with it")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--budget", default="1/16", help="a share of --length (at least --budget-min) or tokens")
    p.add_argument("--budget-min", type=int, default=512)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--variants", nargs="+", default=VARIANTS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from eval_harness.runner import parse_budget

    budget = parse_budget(args.budget, args.budget_min).resolve(args.length)
    pairs = pair_captures(args.query_dir, args.kv_dir, args.model, args.length, args.seeds)
    if not pairs:
        print(f"no sample captured in both {args.query_dir} and {args.kv_dir} at length {args.length}", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    per_sample, all_errors, head_dim = {}, {name: [] for name in args.variants}, None
    for name, qpath, kvpath in pairs:
        qc = torch.load(qpath, weights_only=False)
        kvc = torch.load(kvpath, weights_only=False)
        keys = [kv[0].float() for kv in kvc["kv"]]
        values = [kv[1].float() for kv in kvc["kv"]]
        prompt = keys[0].shape[1]
        for layer, K in enumerate(keys):
            if not torch.allclose(K, qc["keys"][layer][:, :prompt], atol=1e-3):
                raise ValueError(f"{name}: the keys of {qpath.name} and {kvpath.name} differ (layer {layer})")
        head_dim = keys[0].shape[-1]
        errors = sample_errors(qc["queries"], keys, values, qc["scaling"], budget, args)
        per_sample[name] = {v: round(float(e.mean()), 5) for v, e in errors.items()}
        for v, e in errors.items():
            all_errors[v].append(e)
        print(name, prompt, "tokens:", "  ".join(f"{v} {e:.4f}" for v, e in per_sample[name].items()), flush=True)
    kv_bytes = 2 * args.block_tokens * head_dim * 2
    summary = {}
    for v, errs in all_errors.items():
        e = torch.stack(errs)  # [samples, steps, layers]
        summary[v] = {
            "relative_error": round(float(e.mean()), 5),
            "per_layer": [round(float(x), 4) for x in e.mean(dim=(0, 1))],
            "summary_bytes_per_block_head_bf16": variant_bytes(v, head_dim, args.block_tokens, 2),
        }
        summary[v]["summary_share_of_kv"] = round(summary[v]["summary_bytes_per_block_head_bf16"] / kv_bytes, 4)
    print(f"\n{'variant':34s} {'rel. error':>10s} {'device bytes / KV':>18s}")
    for v, s in summary.items():
        print(f"{v:34s} {s['relative_error']:10.4f} {s['summary_share_of_kv']:18.3f}")
    if args.out:
        write_results(args.out, {
            **run_metadata(args),
            "setting": {"budget_tokens": budget, "samples": [n for n, _, _ in pairs],
                        "metric": "|out - dense| / |dense| per query head, mean over layers, decode queries, samples",
                        "attended": "prompt tokens only (dense and sparse alike)"},
            "summary": summary, "per_sample": per_sample,
        })  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
