"""Selection recall of block selectors on real decode queries (no generation with a sparse cache).

For each RULER sample, the model runs densely (``DynamicCache``, greedy) over the prompt and ``--decode-steps``
answer tokens. A capturing attention function (registered with transformers' ``AttentionInterface``; it calls the
model's own ``sdpa`` attention unchanged) records, per layer, the query of the last prompt token and of every decode
token, and the full key sequence (after RoPE, as the cache sees them). Each recorded query is then one decode step of
an ``OffloadCache`` at that position: :func:`benchmarks.selection_quality.evaluate_selector` plans the step as
``OffloadLayer.select`` does (selectable sealed blocks, sink, window, open block, ``k``), lets every selector
choose, and measures recall, coverage and attended mass against the true attention (definitions in
``benchmarks/selection_quality.py``).

Captures are kept in ``--capture-dir`` (one ``.pt`` per sample), so re-scoring selectors does not re-run the model.

Example (CPU, Qwen2.5-Coder-0.5B-Instruct, about a minute per sample)::

    python benchmarks/selection_recall.py --model qwen05 --seeds-a 1 --seeds-b 2 --samples 2 \\
        --selectors oracle headwise solohead tempered roundrobin --out results/selection/qwen05_4k.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from benchmarks.selection_candidates import RoundRobinSelector, TemperedVoteSelector  # noqa: E402
from hf_offload.config import OffloadConfig  # noqa: E402
from hf_offload.selectors import SELECTORS, get_selector  # noqa: E402
from benchmarks.selection_quality import block_keys, evaluate_selector  # noqa: E402
from hf_offload.kernels.quantkey_mma import block_lse_emulated  # noqa: E402
from hf_offload.kernels.quant import grid_codes, padded_channels  # noqa: E402
from hf_offload.selectors.quantkey import QuantKeySelector  # noqa: E402

class BF16QuantKeySelector(QuantKeySelector):
    """``quantkey`` as a bfloat16 cache runs it: keys rounded to bfloat16 before quantization (summaries in
    bfloat16), scored in float32 by the reference."""

    name = "quantkey-bf16"

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """The summaries of the keys rounded to bfloat16 (see :class:`QuantKeySelector`)."""
        return super().summarize(keys.to(torch.bfloat16))


class MmaQuantKeySelector(BF16QuantKeySelector):
    """``quantkey-bf16`` scored with the rounding of the tensor-core kernel (``kstep * q`` in bfloat16;
    ``hf_offload.kernels.quantkey_mma.block_lse_emulated``): what a compute-capability-9.0 GPU selects."""

    name = "quantkey-mma"

    def block_lse(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Block log-sum-exps as the tensor-core kernel computes them (2- or 4-bit codes)."""
        if self.bits not in (2, 4):
            raise ValueError(f"quantkey-mma: the tensor-core kernel takes 2- or 4-bit codes, not {self.bits}")
        q = query.float() * scaling
        return block_lse_emulated(q, summaries["codes"], summaries["kmin"], summaries["kstep"], self.bits)


def fp8_covering(kmin: torch.Tensor, kmax: torch.Tensor, levels: int, dtype: torch.dtype = torch.float8_e4m3fn):
    """A quantization grid whose minimum and step are ``dtype`` values and which covers ``[kmin, kmax]``: the
    minimum rounded toward ``-inf``, the step toward ``+inf`` (so no key is clamped; the grid is as coarse as the
    minimum's rounding makes it).

    Args:
        kmin, kmax: per-(block, head, channel) key ranges, ``[batch, n, kv_heads, channels]``, float32, any device.
        levels: ``2 ** bits - 1``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Returns:
        ``(kmin8, step8)``: float32 tensors of ``kmin``'s shape, each exactly a ``dtype`` value.
    """
    top = torch.finfo(dtype).max

    def rounded(x: torch.Tensor, up: bool) -> torch.Tensor:
        x = x.clamp(-top, top)
        y = x.to(dtype).float()  # to nearest
        # One step of the format past a rounding that went the wrong way: walk the magnitude's bit pattern.
        bits = x.to(dtype).view(torch.uint8).int()
        wrong = (y < x) if up else (y > x)
        away = (y >= 0) == up  # the wrong way is fixed by a larger magnitude
        tiny = 0x01 if up else 0x81  # the smallest magnitude of the wanted sign, past a zero
        bits = torch.where(wrong & away, bits + 1, torch.where(wrong, bits - 1, bits))
        bits = torch.where(wrong & (y == 0), tiny, bits)
        return bits.to(torch.uint8).view(dtype).float()

    kmin8 = rounded(kmin, up=False)
    step8 = rounded((kmax - kmin8) / levels, up=True)
    return kmin8, step8


class Fp8QuantKeySelector(BF16QuantKeySelector):
    """``quantkey-bf16`` with ``kmin`` and ``kstep`` stored as 8-bit floats (e4m3) instead of bfloat16: a quarter
    fewer bytes for the scoring kernel to read at 2 bits (6 instead of 8 per block, head and channel), the grid
    covering each block's range (:func:`fp8_covering`). Scored in float32 by the reference."""

    name = "quantkey-fp8"

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """Codes against the 8-bit-float grid of the keys rounded to bfloat16; ``kmin`` and ``kstep`` float32
        values that an 8-bit float holds exactly."""
        k = padded_channels(keys.to(torch.bfloat16).float(), self.bits)
        kmin8, step8 = fp8_covering(k.amin(dim=3), k.amax(dim=3), (1 << self.bits) - 1)
        return {"codes": grid_codes(k, kmin8, step8, self.bits), "kmin": kmin8, "kstep": step8}


# Unregistered candidates the benchmark can still measure by name.
CANDIDATES = {**SELECTORS, RoundRobinSelector.name: RoundRobinSelector, TemperedVoteSelector.name: TemperedVoteSelector,
              BF16QuantKeySelector.name: BF16QuantKeySelector, MmaQuantKeySelector.name: MmaQuantKeySelector,
              Fp8QuantKeySelector.name: Fp8QuantKeySelector}

CAPTURE_NAME = "hfo_selection_capture"
TASKS = ["niah_multikey_2", "niah_multivalue", "vt"]
METRICS = ("recall", "coverage", "attended")


# ------------------------------------------------------------------------------------------------------- capture
class _Recorder:
    """Per-layer queries and keys seen by the capturing attention function during one sample."""

    def __init__(self):
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.scaling: float | None = None
        self.active = False


_RECORDER = _Recorder()


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, recording the last query row and all keys of each layer.

    ``query``: ``[batch, q_heads, q_len, head_dim]``; ``key``: ``[batch, kv_heads, n_tokens, head_dim]``, both after
    RoPE and after ``cache.update`` (so ``key`` holds every cached key, the current tokens last).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _RECORDER.active:
        layer = module.layer_idx
        _RECORDER.queries.setdefault(layer, []).append(query[:, :, -1].detach().clone())
        _RECORDER.keys[layer] = key.detach()  # the last call's keys extend every earlier call's
        scaling = kwargs.get("scaling")
        _RECORDER.scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _switch_to_capture(model) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(CAPTURE_NAME, _capture_attention)
    if CAPTURE_NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(CAPTURE_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(CAPTURE_NAME)


def capture_sample(model, input_ids: list[int], decode_steps: int) -> dict:
    """Dense greedy run over one prompt; returns the recorded decode queries and keys of every layer.

    Returns:
        ``queries``: ``[steps, layers, kv_heads, group, head_dim]`` (float32, CPU): the last prompt token's query,
        then one per decode token; ``positions``: ``[steps]`` int, each query's position (it attends to keys
        ``0..position``); ``keys``: ``[layers, kv_heads, n_tokens, head_dim]`` (float32, CPU); ``scaling``;
        ``generated``: the greedy tokens.
    """
    from transformers import DynamicCache

    from hf_offload import generate_cache_kwarg

    _RECORDER.queries.clear()
    _RECORDER.keys.clear()
    _RECORDER.active = True
    ids = torch.tensor([input_ids], device=model.device)
    try:
        with torch.no_grad():
            out = model.generate(
                ids, **{generate_cache_kwarg(): DynamicCache(config=model.config)}, max_new_tokens=decode_steps + 1,
                do_sample=False, min_new_tokens=decode_steps + 1,
            )
    finally:
        _RECORDER.active = False
    layers = sorted(_RECORDER.keys)
    kv_heads = _RECORDER.keys[layers[0]].shape[1]
    # generate() runs one forward per new token; the last new token is never fed back, so steps = decode_steps + 1.
    steps = len(_RECORDER.queries[layers[0]])
    queries = torch.stack(
        [torch.stack([_RECORDER.queries[l][s][0] for l in layers]) for s in range(steps)]
    ).float()  # [S, L, q_heads, D]
    S, L, HQ, D = queries.shape
    queries = queries.view(S, L, kv_heads, HQ // kv_heads, D).cpu()
    keys = torch.stack([_RECORDER.keys[l][0] for l in layers]).float().cpu()  # [L, H, n_tokens, D]
    positions = torch.arange(len(input_ids) - 1, len(input_ids) - 1 + steps)
    return {
        "queries": queries,
        "positions": positions,
        "keys": keys,
        "scaling": float(_RECORDER.scaling),
        "generated": out[0, len(input_ids):].tolist(),
    }


def load_captures(args, seeds: list[int]) -> list[dict]:
    """Captures of ``args.samples`` samples per task and seed, from ``args.capture_dir`` or computed (and saved)."""
    from eval_harness.ruler import make_ruler_samples
    from hf_offload.tools.models import load

    folder = Path(args.capture_dir)
    folder.mkdir(parents=True, exist_ok=True)
    model = tokenizer = None
    captures = []
    for task in args.tasks:
        for seed in seeds:
            samples = None
            for i in range(args.samples):
                path = folder / f"{Path(str(args.model)).name}-{task}-{args.length}-s{seed}-{i}-d{args.decode_steps}.pt"
                if path.exists():
                    cap = torch.load(path)
                else:
                    if model is None:
                        model, tokenizer = load(args.model, dtype=torch.float32, device="cpu")
                        _switch_to_capture(model)
                    if samples is None:
                        samples = make_ruler_samples(tokenizer, task, args.length, args.samples, seed=seed)
                    sample = samples[i]
                    start = time.perf_counter()
                    cap = capture_sample(model, sample["input_ids"], args.decode_steps)
                    cap.update(task=task, seed=seed, index=i, outputs=sample["outputs"],
                               answer=tokenizer.decode(cap["generated"], skip_special_tokens=True))
                    torch.save(cap, path)
                    print(f"captured {task} seed {seed} #{i}: {len(sample['input_ids'])} tokens in "
                          f"{time.perf_counter() - start:.1f} s; answer {cap['answer']!r} (ref {sample['outputs']})",
                          flush=True)
                captures.append(cap)
    return captures


# --------------------------------------------------------------------------------------------------------- score
def score_capture(cap: dict, selectors: dict[str, object], config: OffloadConfig) -> dict[str, dict[str, list]]:
    """Per selector and metric: ``[steps][layers]`` values for one captured sample."""
    queries, keys, positions = cap["queries"], cap["keys"], cap["positions"]
    S, L = queries.shape[:2]
    T = config.block_tokens
    out = {name: {m: [[0.0] * L for _ in range(S)] for m in METRICS} for name in selectors}
    for layer in range(L):
        layer_keys = keys[layer][None]  # [1, H, n_tokens, D]
        n_max = (int(positions[-1])) // T
        sealed = block_keys(layer_keys, n_max, T)
        for name, sel in selectors.items():
            summaries = sel.summarize(sealed)
            for s in range(S):
                n_tokens = int(positions[s]) + 1
                res = evaluate_selector(
                    sel, queries[s, layer][None], layer_keys[:, :, :n_tokens], cap["scaling"],
                    budget_tokens=config.budget_tokens, block_tokens=T, sink_blocks=config.sink_blocks,
                    window_blocks=config.window_blocks, summaries=summaries,
                )
                for m in METRICS:
                    out[name][m][s][layer] = float(res[m][0])
    return out


def summary_bytes(selector, kv_heads: int, block_tokens: int, head_dim: int, dtype=torch.bfloat16) -> int:
    """Device bytes of one block's summaries (``dtype`` keys), from ``selector.summarize`` on one block."""
    keys = torch.zeros((1, 1, kv_heads, block_tokens, head_dim), dtype=dtype)
    return sum(t.numel() * t.element_size() for t in selector.summarize(keys).values())


def scoring_ms(selector, summaries: dict, query: torch.Tensor, scaling: float, repeat: int = 20) -> float:
    """Median CPU milliseconds of one ``score`` call (one layer, one sequence)."""
    selector.score(query, summaries, scaling)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        selector.score(query, summaries, scaling)
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def aggregate(per_sample: list[dict], names: list[str], layers: int) -> dict:
    """Mean over samples (each the mean over its decode queries) per layer, and overall, per selector and metric."""
    agg = {}
    for name in names:
        agg[name] = {}
        for m in METRICS:
            per_layer = torch.tensor(
                [[sum(step[l] for step in s["scores"][name][m]) / len(s["scores"][name][m]) for l in range(layers)]
                 for s in per_sample]
            )  # [samples, layers]
            agg[name][m] = {"per_layer": per_layer.mean(0).tolist(), "mean": float(per_layer.mean())}
            if m == "recall":
                agg[name][m]["by_task"] = {
                    t: float(torch.stack([per_layer[i] for i, s in enumerate(per_sample) if s["task"] == t]).mean())
                    for t in sorted({s["task"] for s in per_sample})
                }
    return agg


def print_table(title: str, agg: dict, names: list[str], layers: int) -> None:
    print(f"\n{title}: selection recall per layer (mean over samples and decode queries)")
    print("layer " + " ".join(f"{n[:10]:>10}" for n in names))
    for l in range(layers):
        print(f"{l:5d} " + " ".join(f"{agg[n]['recall']['per_layer'][l]:10.3f}" for n in names))
    for m in METRICS:
        print(f"{m[:5]:>5} " + " ".join(f"{agg[n][m]['mean']:10.3f}" for n in names))
    for task in next(iter(agg.values()))["recall"]["by_task"]:
        print(f"  recall {task}: " + " ".join(f"{n}={agg[n]['recall']['by_task'][task]:.3f}" for n in names))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen05")
    parser.add_argument("--tasks", nargs="+", default=TASKS)
    parser.add_argument("--length", type=int, default=4096, help="RULER context length (prompt + answer tokens)")
    parser.add_argument("--samples", type=int, default=2, help="samples per task and seed")
    parser.add_argument("--seeds-a", type=int, nargs="+", default=[1], help="RULER seeds to tune on")
    parser.add_argument("--seeds-b", type=int, nargs="+", default=[2], help="RULER seeds to report on (disjoint)")
    parser.add_argument("--sets", nargs="+", choices=["A", "B"], default=["A", "B"],
                        help="seed sets to score (tune on A alone, then report A and B)")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode queries after the last prompt token")
    parser.add_argument("--budget", default="1/16", help="a share of --length (at least --budget-min) or tokens")
    parser.add_argument("--budget-min", type=int, default=512)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--selectors", nargs="+", default=["oracle", "headwise", "solohead"])
    parser.add_argument("--set", nargs="*", default=[], metavar="SEL.FIELD=VALUE[,FIELD=VALUE]",
                        help="selector variants, e.g. tempered.power=3,head_weight=1 (named SEL[FIELD=VALUE,...])")
    parser.add_argument("--capture-dir", default="/tmp/hfo_selection_captures")
    parser.add_argument("--out", default=None, help="JSON results file (e.g. results/selection/qwen05_4k.json)")
    args = parser.parse_args(argv)
    if set(args.seeds_a) & set(args.seeds_b):
        parser.error("--seeds-a and --seeds-b must be disjoint")

    if "/" in args.budget:
        num, den = args.budget.split("/")
        budget = max(args.budget_min, args.length * int(num) // int(den))
    else:
        budget = int(args.budget)
    config = OffloadConfig(budget_tokens=budget, block_tokens=args.block_tokens)
    config.validate()

    selectors = {name: CANDIDATES[name]() if name in CANDIDATES else get_selector(name) for name in args.selectors}
    for item in args.set:
        name, settings = item.split(".", 1)
        default = CANDIDATES[name]()
        fields = dict(pair.split("=", 1) for pair in settings.split(","))
        variant = CANDIDATES[name](**{f: type(getattr(default, f))(v) for f, v in fields.items()})
        selectors[f"{name}[{settings}]"] = variant
    names = list(selectors)

    results = {}
    for label, seeds in (("A", args.seeds_a), ("B", args.seeds_b)):
        if label not in args.sets:
            continue
        captures = load_captures(args, seeds)
        per_sample = []
        for cap in captures:
            start = time.perf_counter()
            per_sample.append({
                "task": cap["task"], "seed": cap["seed"], "index": cap["index"], "answer": cap["answer"],
                "outputs": cap["outputs"], "n_tokens": int(cap["positions"][-1]) + 1,
                "scores": score_capture(cap, selectors, config),
            })
            print(f"scored {cap['task']} seed {cap['seed']} #{cap['index']} in {time.perf_counter() - start:.1f} s",
                  flush=True)
        layers = captures[0]["queries"].shape[1]
        agg = aggregate(per_sample, names, layers)
        print_table(f"seeds {label} {seeds}", agg, names, layers)
        results[label] = {"seeds": seeds, "aggregate": agg, "samples": per_sample}

    cap = captures[0]
    _, L, H, G, D = cap["queries"].shape
    n = (int(cap["positions"][0])) // args.block_tokens
    sealed = block_keys(cap["keys"][0][None], n, args.block_tokens)
    cost = {}
    for name, sel in selectors.items():
        summaries = sel.summarize(sealed)
        cost[name] = {
            "summary_bytes_per_block_bf16": summary_bytes(sel, H, args.block_tokens, D),
            "score_ms_cpu_one_layer": scoring_ms(sel, summaries, cap["queries"][0, 0][None], cap["scaling"]),
            "blocks_scored": n,
        }
    print("\ncost: " + "; ".join(f"{k}: {v['summary_bytes_per_block_bf16']} B/block, "
                                 f"{v['score_ms_cpu_one_layer']:.3f} ms/score" for k, v in cost.items()))
    payload = run_metadata(
        args,
        setting={
            "budget_tokens": budget, "block_tokens": config.block_tokens, "sink_tokens": config.sink_tokens,
            "window_tokens": config.window_tokens, "decode_queries_per_sample": args.decode_steps + 1,
            "metric": "benchmarks.selection_quality (recall: captured / oracle's best shared k_free blocks; "
                      "coverage: captured / all free-block mass; attended: share of total attention attended)",
            "capture": "dense greedy DynamicCache run; last prompt token + decode tokens' queries per layer, "
                       "float32 on CPU",
            "selectors": {k: repr(v) for k, v in selectors.items()},
        },
        cost=cost,
        results=results,
    )
    if args.out:
        write_results(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
