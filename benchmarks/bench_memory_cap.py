"""End-to-end ``generate()`` under a device memory cap, and device memory across many ``generate()`` calls.

Two questions, one run:

* **cap**: with the process limited to ``--cap-gib`` of the device (``torch.cuda.set_per_process_memory_fraction``,
  what a 16 / 24 / 48 GiB GPU allows), which batches of a model at ``--context`` tokens run through ``generate()``
  (chunked prefill), with ``DynamicCache``, with the library's defaults (``OffloadCache(model, budget_tokens=B)``,
  nothing else set), with every block in host memory (``admission="always"``) and with ``DynamicCache(offloading=True)``
  (``offloaded``); per batch: time to first token,
  steady decode tokens/s (the median step; the mean, which carries the steps that capture graphs, beside it),
  peak device memory, host KV, hit rate, or the out-of-memory error. With ``--calls N``
  each configuration runs N ``generate()`` calls on the same model, each with a fresh cache: the first decode step
  of call 2 on, against a steady step, says what a later call pays for graph capture.
* **soak**: ``--soak N`` calls of ``generate()``, each with a fresh cache, alternating two batch sizes and two
  prompt lengths; device memory allocated after each call (and pinned host memory where torch reports it), so that
  growth per call shows.

Random weights by default: speed and memory depend on shapes, not weights; the hit rate does not (it is reported for
what it is: random-weight activations). ``--model qwen05`` runs a real model on real text instead (per sequence a
document of key-value records and a question), where selection and hit rate are the model's. Raw JSON
(``benchmarks.common.write_results``).

    python benchmarks/bench_memory_cap.py --shape qwen2.5-coder-0.5b --context 32768 --batches 16 48 --cap-gib 16
    python benchmarks/bench_memory_cap.py --model qwen05 --context 32768 --batches 1 8 32 64 --cap-gib 140 \
        --caches dynamic defaults
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload import OffloadCache, generate_cache_kwarg, warm_up  # noqa: E402
from hf_offload.cache import parked_bytes, release_parked  # noqa: E402
from hf_offload.tools.bench import SHAPES  # noqa: E402

GIB = 1 << 30
WORKLOAD = "random bf16 weights, random token ids; generate() with a chunked prefill"


def build(shape: str, positions: int, device: torch.device, **overrides):
    """A Llama-architecture model of ``shape`` (a key of ``hf_offload.tools.bench.SHAPES``, its entries replaced by
    ``overrides``), random bf16 weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**SHAPES[shape], **overrides}, max_position_embeddings=positions, pad_token_id=0)
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


class StepClock:
    """A logits processor that records the time after each step (synchronised)."""

    def __init__(self):
        self.marks: list[float] = []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.marks.append(time.perf_counter())
        return scores


OFFLOAD_SETTINGS = {"defaults": {}, "always": {"admission": "always"}}
"""The OffloadCache settings of each cache kind besides ``budget_tokens``."""


def make_cache(kind: str, model, budget: int):
    from transformers import DynamicCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind == "offloaded":  # transformers' own offloading: each layer's whole KV to the device and back per step
        return DynamicCache(config=model.config, offloading=True)
    if kind in OFFLOAD_SETTINGS:
        return OffloadCache(model, budget_tokens=budget, **OFFLOAD_SETTINGS[kind])
    raise ValueError(kind)


def real_prompts(tokenizer, batch: int, context: int) -> torch.Tensor:
    """``[batch, context]`` token ids of real text: per sequence a document of key-value records (its own seed) and
    a question about one of them, cut to ``context`` tokens with the question kept at the end."""
    from benchmarks.bench_prefix_sharing import build_document

    rows = []
    gap = tokenizer("\n\n", add_special_tokens=False).input_ids
    for seed in range(batch):
        prefix, [(question, _)] = build_document(tokenizer, context, 1, seed)
        rows.append(prefix[: context - len(gap) - len(question)] + gap + question)
    return torch.tensor(rows)


def run_generate(model, kind: str, batch: int, context: int, new_tokens: int, budget: int, chunk: int,
                 device: torch.device, tokenizer=None, roofline_of=None) -> dict:  # fmt: skip
    """One ``generate()`` of ``batch`` prompts of ``context`` tokens (random ids, or real text with a
    ``tokenizer``); times, memory and cache stats (and with ``roofline_of``, :func:`step_roofline`'s bound of an
    OffloadCache's decode step)."""
    from transformers import LogitsProcessorList

    row = {"cache": kind, "batch": batch, "context": context, "new_tokens": new_tokens, "prefill_chunk": chunk}
    gc.collect()
    torch.cuda.empty_cache()
    # What an earlier cache of the model left parked for this one (its graphs replay here where the shapes match).
    row["parked_gib_before"] = parked_bytes(model) / GIB
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    if tokenizer is None:
        ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    else:
        ids = real_prompts(tokenizer, batch, context).to(device)
    clock = StepClock()
    cache = None
    try:
        cache = make_cache(kind, model, budget)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                           do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           prefill_chunk_size=chunk, logits_processor=LogitsProcessorList([clock]))  # fmt: skip
        marks = clock.marks
        row["ttft_s"] = marks[0] - t0
        row["first_decode_step_s"] = marks[1] - marks[0]
        # Each step's time. The steps that capture graphs (the second decode step, the first seal of the decode,
        # the steps after a capacity boundary) cost tens to thousands of ms once per 1024 steps or per run, so a
        # short run's mean is mostly them: the steady step is the median, the mean is reported beside it.
        row["step_s"] = [b - a for a, b in zip(marks[1:], marks[2:])]
        # From the third decode step on (the first captures the attention, the second the whole layers; numbered
        # from 1, the prefill's token being step 0), or every step of a run too short for that.
        later = row["step_s"][1:] or row["step_s"]
        row["steady_step_s"] = statistics.median(later)
        row["median_step_s"] = row["steady_step_s"]
        row["mean_step_s"] = statistics.fmean(later)
        row["decode_tok_s"] = batch / row["steady_step_s"]
        row["mean_tok_s"] = batch / row["mean_step_s"]
        row["slow_steps"] = [[i + 3, s] for i, s in enumerate(later) if s > 3 * row["steady_step_s"]]
        row["first_over_steady"] = row["first_decode_step_s"] / row["steady_step_s"]
        row["ok"] = True
    except torch.OutOfMemoryError as err:
        row["ok"] = False
        row["error"] = f"OutOfMemoryError: {str(err).splitlines()[0][:300]}"
        row["traceback"] = traceback.format_exc()[-2000:]  # where it ran out: prefill, a growth, a decode step
    except Exception as err:  # noqa: BLE001 -- recorded, the sweep goes on
        row["ok"] = False
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        row["traceback"] = traceback.format_exc()[-2000:]
    row["peak_device_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    row["peak_above_model_gib"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
    if isinstance(cache, OffloadCache) and row.get("ok"):
        stats = cache.stats()
        if roofline_of is not None:
            row["roofline"] = roofline_of(stats, batch, row["steady_step_s"])
        row["host_kv_gib"] = stats["host_kv_bytes"] / GIB
        row["device_kv_gib"] = stats["device_kv_bytes"] / GIB
        row["hit_rate"] = stats.get("hit_rate")
        row["device_summary_gib"] = stats["device_summary_bytes"] / GIB
        row["selector"] = stats.get("selector")  # the summary level in use (coarsen_summaries)
        row["summary_levels"] = stats.get("summary_levels")
        row["parking"] = stats.get("parking")  # whether this cache took the graphs an earlier one parked
        first = cache.offload_layers[0].blocks if cache.offload_layers else None
        if first is not None and first.is_initialized:
            row["kernel_transfer"] = bool(first.execution.use_kernels)  # else pageable or portable copies
            row["pinned_host"] = bool(first.host.pin_memory)
            row["paged_attention"] = bool(first.execution.paged)
        # Whether the decode replayed CUDA graphs (a capture that failed leaves the steps op by op).
        for key in ("graph_captures", "graph_replays", "graph_capture_retries", "graph_pool_bytes", "decode_steps",
                    "prefetched_blocks", "graph_capture_ms", "layer_graph_captures", "seal_graph_captures"):  # fmt: skip
            row[key] = stats.get(key)
        admission = next(iter(cache._shared.admissions.values()), None)
        if admission is not None:
            row["admitted_gib"] = admission.admitted_bytes / GIB
            row["demoted_chunks"] = admission.demoted_chunks
            row["margin_gib"] = admission.margin_bytes / GIB
    del cache
    return row


def step_roofline(model, budget: int, bandwidth: dict):
    """``roofline_of(stats, batch, step_s)``: the lower bound of an OffloadCache's decode step from bandwidths
    measured in this run (``benchmarks.bench_decode.measure_bandwidths``): the weights, the attended KV
    (``budget`` tokens per sequence and layer) and every block summary read once from device memory, and the bytes
    the decode read from host memory (``decode_host_bytes`` over the decode steps) over PCIe."""
    from benchmarks.bench_decode import weight_bytes

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_key_value_heads * head_dim * model.dtype.itemsize * cfg.num_hidden_layers
    weights = weight_bytes(model)[1]

    def roofline_of(stats: dict, batch: int, step_s: float) -> dict:
        steps = max(1, stats.get("decode_steps") or 0)
        pcie = stats.get("decode_host_bytes", 0) / steps
        hbm = weights + budget * batch * per_token + stats["device_summary_bytes"]
        bound = hbm / bandwidth["hbm_bytes_per_s"] + pcie / bandwidth["h2d_pinned_bytes_per_s"]
        return {"hbm_bytes": int(hbm), "pcie_bytes": int(pcie), "roofline_ms": bound * 1e3,
                "step_over_roofline": step_s / bound}  # fmt: skip

    return roofline_of


def prefill_chunk(chunk: int, batch_tokens: int, batch: int) -> int:
    """The prefill chunk of one ``generate()``: ``chunk``, or with ``batch_tokens`` that many tokens over the batch
    (a multiple of 256, at least 256, at most ``chunk``)."""
    if not batch_tokens:
        return chunk
    return max(256, min(chunk, batch_tokens // batch // 256 * 256))


def _rss_mib() -> float:
    """Resident set size of this process (Linux ``/proc``; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


SOAK_SELECTORS = ("default", "quantkey")  # the default selector (with its tail estimate) and plain quantkey


def soak(models, calls: int, budget: int, device: torch.device, lengths=(3000, 2000),
         max_seconds: float = float("inf"), on_progress=None) -> list[dict]:  # fmt: skip
    """``calls`` generate() calls with fresh caches, alternating batch sizes (2, 3), prompt lengths, selectors
    (:data:`SOAK_SELECTORS`) and ``models`` (a dict name -> model); device memory allocated and reserved, pinned host
    memory and RSS after each. Stops early after ``max_seconds``. ``on_progress(rows)`` runs every 100 calls (the
    caller writes what it has, so that a soak stopped from outside keeps its rows)."""
    rows = []
    names = list(models)
    start = time.perf_counter()
    for i in range(calls):
        if time.perf_counter() - start > max_seconds:
            break
        batch, length = (2, 3)[i % 2], lengths[(i // 2) % len(lengths)]
        selector = SOAK_SELECTORS[(i // 4) % len(SOAK_SELECTORS)]
        name = names[(i // 8) % len(names)]
        model = models[name]
        ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device)
        chosen = {} if selector == SOAK_SELECTORS[0] else {"selector": selector}
        cache = OffloadCache(model, budget_tokens=budget, **chosen)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                           do_sample=False, max_new_tokens=8, min_new_tokens=8)  # fmt: skip
        del cache
        gc.collect()
        torch.cuda.synchronize()
        host = torch.cuda.memory.host_memory_stats() if hasattr(torch.cuda.memory, "host_memory_stats") else {}
        rows.append({"call": i, "model": name, "batch": batch, "length": length, "selector": selector,
                     "seconds": time.perf_counter() - start,
                     "allocated_mib": torch.cuda.memory_allocated(device) / 2**20,
                     "reserved_mib": torch.cuda.memory_reserved(device) / 2**20,
                     "pinned_allocated_mib": host.get("allocated_bytes.current", 0) / 2**20,
                     "rss_mib": _rss_mib()})  # fmt: skip
        if (i + 1) % 100 == 0:
            r = rows[-1]
            print(f"soak call {i + 1}: {r['seconds']:.0f} s, allocated {r['allocated_mib']:.1f} MiB, reserved "
                  f"{r['reserved_mib']:.1f} MiB, pinned {r['pinned_allocated_mib']:.1f} MiB, RSS {r['rss_mib']:.0f} MiB",
                  flush=True)  # fmt: skip
            if on_progress is not None:
                on_progress(rows)
    return rows


def _soak_summary(result: dict, rows: list[dict], n_models: int) -> dict:
    """``result`` with the soak's rows and, after the warm-up calls (each model met each selector and shape once),
    the drift per call and the largest rise of each counter."""
    result["soak"] = rows
    warm = min(2 * 8 * n_models, len(rows) - 1)
    first, last = rows[warm], rows[-1]
    calls = max(1, last["call"] - first["call"])
    for key in ("allocated_mib", "reserved_mib", "pinned_allocated_mib", "rss_mib"):
        result[f"soak_drift_{key}_per_call"] = (last[key] - first[key]) / calls
        result[f"soak_growth_{key}"] = max(r[key] for r in rows[warm:]) - first[key]  # the most it rose at any call
    result["soak_warm_calls"] = warm
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-coder-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--model", default=None,
                        help="a real model (a name for hf_offload.tools.models.load, e.g. qwen05) on real text, "
                             "instead of --shape with random weights and ids")  # fmt: skip
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument(
        "--batches", type=int, nargs="*", default=[16, 48], help="batches of the cap sweep (none: soak only)"
    )
    parser.add_argument(
        "--caches",
        nargs="+",
        default=["dynamic", "defaults", "always"],
        choices=["dynamic", "offloaded", "defaults", "always"],
    )
    parser.add_argument("--cap-gib", type=float, default=16.0, help="device memory the process may allocate")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=1,
                        help="generate() calls per configuration, each with a fresh cache on the same model")  # fmt: skip
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    parser.add_argument("--warmup-context", type=int, default=0,
                        help="before the sweep, per cache at the smallest batch, a warm-up with prompts of this many "
                             "tokens (hf_offload.warm_up for the library's caches, one generate() for the others), "
                             "not recorded, so that the kernels' compilation (Triton, once per process and shapes) "
                             "is out of the measured calls' times (0: none)")  # fmt: skip
    parser.add_argument("--warmup-parks", action="store_true",
                        help="keep what the warm-up parks (its layers and CUDA graphs) for the first measured call "
                             "(default: released, so that the first call shows compiled kernels only)")  # fmt: skip
    parser.add_argument(
        "--prefill-batch-tokens", type=int, default=0,
        help="tokens of one prefill chunk over the whole batch: the chunk is this divided by the batch (a multiple of "
             "256, at most --prefill-chunk), so that prefill activations stay the same size as the batch grows "
             "(0: --prefill-chunk at every batch)",
    )  # fmt: skip
    parser.add_argument("--soak", type=int, default=0, help="generate() calls of the soak (0: none)")
    parser.add_argument("--soak-lengths", type=int, nargs="+", default=[3000, 2000], help="prompt lengths of the soak")
    parser.add_argument(
        "--soak-shapes",
        nargs="+",
        default=None,
        choices=sorted(SHAPES),
        help="models the soak alternates (default: --shape only)",
    )
    parser.add_argument(
        "--soak-layers",
        type=int,
        default=0,
        help="decoder layers of the soak's models (0: the shape's own); fewer layers, more calls",
    )
    parser.add_argument("--soak-seconds", type=float, default=float("inf"), help="stop the soak after this long")
    parser.add_argument("--max-seconds", type=float, default=480.0)
    parser.add_argument("--out", default="results/memory_cap/bench_memory_cap.json")
    args = parser.parse_args(argv)
    if args.batches and args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (the first decode step and at least one step after it)")
    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    total = torch.cuda.mem_get_info(device)[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), device)
    tokenizer, workload = None, WORKLOAD
    if args.model:
        from hf_offload.tools.models import load

        model, tokenizer = load(args.model, dtype=torch.bfloat16, device=device)
        workload = (f"real model {args.model} (bf16), real text: documents of key-value records with a question; "
                    "generate() with a chunked prefill")  # fmt: skip
    else:
        model = build(args.shape, args.context + args.new_tokens + 16, device)
    result = {"metadata": run_metadata(args, note=workload), "workload": workload, "cap_gib": args.cap_gib,
              "weights_gib": torch.cuda.memory_allocated(device) / GIB, "runs": [], "skipped": []}  # fmt: skip
    roofline_of = None
    if args.batches:
        from benchmarks.bench_decode import measure_bandwidths

        result["bandwidth"] = measure_bandwidths(device, 512 << 20)
        roofline_of = step_roofline(model, args.budget, result["bandwidth"])
    print(f"{'cache':9s} {'batch':>5s} {'ok':>3s} {'ttft s':>7s} {'1st step s':>10s} {'tok/s':>8s} {'peak GiB':>9s} "
          f"{'host KV GiB':>11s} {'hit':>5s} summaries")  # fmt: skip
    if args.batches and args.warmup_context:
        result["warmup"] = []
        for kind in args.caches:
            if kind in OFFLOAD_SETTINGS:  # the library's own warm-up, with the settings of the calls to come
                chunk = prefill_chunk(args.prefill_chunk, args.prefill_batch_tokens, min(args.batches))
                w = warm_up(model, batch_size=min(args.batches), prompt_tokens=args.warmup_context,
                            generate_kwargs={"prefill_chunk_size": chunk}, budget_tokens=args.budget,
                            **OFFLOAD_SETTINGS[kind])  # fmt: skip
                result["warmup"].append({"cache": kind, **w})
                print(f"warm-up {kind} (hf_offload.warm_up) batch {w['batch_size']} prompt {w['prompt_tokens']}: "
                      f"{w['seconds']:.2f} s, {w['graph_captures']} graph captures")  # fmt: skip
                continue
            r = run_generate(model, kind, min(args.batches), args.warmup_context, 4, args.budget,
                             prefill_chunk(args.prefill_chunk, args.prefill_batch_tokens, min(args.batches)), device,
                             tokenizer)  # fmt: skip
            result["warmup"].append({k: r.get(k) for k in ("cache", "batch", "context", "ok", "ttft_s", "error")})
            print(f"warm-up {kind} batch {r['batch']} context {r['context']}: "
                  f"{'ok' if r['ok'] else (r.get('error') or '')[:80]} ttft {r.get('ttft_s', float('nan')):.2f} s")
        if not args.warmup_parks:
            release_parked()  # the sweep's first call starts with nothing parked: the warm-up leaves compiled code
        gc.collect()
    for batch in args.batches:
        for kind, call in [(kind, call) for kind in args.caches for call in range(1, args.calls + 1)]:
            if time.perf_counter() - start > args.max_seconds:
                result["skipped"].append({"cache": kind, "batch": batch, "call": call, "reason": "time budget"})
                continue
            r = run_generate(model, kind, batch, args.context, args.new_tokens, args.budget,
                             prefill_chunk(args.prefill_chunk, args.prefill_batch_tokens, batch), device, tokenizer,
                             roofline_of)  # fmt: skip
            r["call"] = call
            result["runs"].append(r)
            write_results(args.out, result)
            print(f"{kind:9s} {batch:5d} {'yes' if r['ok'] else 'no':>3s} {r.get('ttft_s', float('nan')):7.2f} "
                  f"{r.get('first_decode_step_s', float('nan')):10.3f} {r.get('decode_tok_s', float('nan')):8.1f} "
                  f"{r['peak_device_gib']:9.2f} {r.get('host_kv_gib', float('nan')):11.2f} "
                  f"{r.get('hit_rate') or float('nan'):5.2f} {r.get('selector') or '-'} "
                  f"{r.get('roofline', {}).get('step_over_roofline', float('nan')):.2f}x roofline call {call} "
                  f"1st/steady {r.get('first_over_steady', float('nan')):.1f} {r.get('error', '')[:90]}")  # fmt: skip
    if args.soak:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        positions = max(args.soak_lengths) + 64
        models = {}
        for shape in args.soak_shapes or [args.shape]:
            layers = {"num_hidden_layers": args.soak_layers} if args.soak_layers else {}
            models[shape] = build(shape, positions, device, **layers)
        result["soak_models"] = {name: {"layers": m.config.num_hidden_layers, "heads": m.config.num_attention_heads,
                                        "kv_heads": m.config.num_key_value_heads, "head_dim": m.config.head_dim}
                                 for name, m in models.items()}  # fmt: skip
        rows = soak(models, args.soak, args.budget, device, args.soak_lengths, args.soak_seconds,
                    on_progress=lambda rows: write_results(args.out, _soak_summary(result, rows, len(models))))
        _soak_summary(result, rows, len(models))
        first, last = rows[result["soak_warm_calls"]], rows[-1]
        print(f"soak: {len(rows)} calls; from call {first['call']} to {last['call']}: allocated "
              f"{first['allocated_mib']:.1f} -> {last['allocated_mib']:.1f} MiB, reserved {first['reserved_mib']:.1f} "
              f"-> {last['reserved_mib']:.1f} MiB, pinned {first['pinned_allocated_mib']:.1f} -> "
              f"{last['pinned_allocated_mib']:.1f} MiB, RSS {first['rss_mib']:.1f} -> {last['rss_mib']:.1f} MiB; "
              f"peak allocated {max(r['allocated_mib'] for r in rows):.1f} MiB")  # fmt: skip
    result["complete"] = True
    write_results(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
