"""Needle-in-a-haystack accuracy and memory of dense vs offloaded KV caches, through ``model.generate``.

For each prompt length and method (``dense`` = transformers' ``DynamicCache``; ``solohead`` / ``headwise`` /
``streaming`` = ``OffloadCache(model, budget_tokens, selector=method)``) it runs greedy generation over needle prompts
of exactly that length (eval_harness/needle.py; equal lengths, so batches need no padding) and records:

* accuracy and per-sample correctness, depth and output;
* wall time of the generate calls;
* the prefill alone (a separate ``generate(max_new_tokens=1)`` with a fresh cache, one batch): its time and, on CUDA,
  its peak device memory, raw and minus the memory allocated before the call (weights, inputs);
* device-resident KV bytes (dense: every layer's keys + values; offload: ``cache.stats()``: slot pools + open blocks),
  summary bytes, host KV bytes, recalled bytes (total, prefill part, decode part) and the hit rate;
* with ``--prefill-peak-both`` (default on), the solohead prefill with and without ``prefill_chunk_size``, to show
  that the chunked prefill peak does not grow with the prompt.

A markdown table is printed as runs finish; the JSON is rewritten after every run (partial results survive a crash).

Examples::

    # end-to-end check on CPU in well under a minute (tiny random Qwen2, random prompts, no scoring)
    PYTHONPATH=. python benchmarks/needle_core.py --tiny --lengths 512 1024 --needles 3 --budget 256 \\
        --prefill-chunk 256 --out /tmp/needle_tiny.json
    # the real thing
    PYTHONPATH=. python benchmarks/needle_core.py --model /path/to/Qwen2.5-7B-Instruct --lengths 8192 16384 32768
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata  # noqa: E402
from eval_harness.needle import haystack_info, make_needle_prompts, score  # noqa: E402

OFFLOAD_METHODS = ("meanbound", "solohead", "headwise", "streaming", "oracle", "meanvar", "union")
MIB = 1 << 20


# ------------------------------------------------------------------------------------------------------------- cli
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="local Hugging Face model folder (not needed with --tiny)")
    p.add_argument("--tokenizer", help="tokenizer folder (default: --model; with --tiny: none -> random prompts)")
    p.add_argument("--tiny", action="store_true", help="tiny random Qwen2 model built from a config (CPU smoke test)")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768], help="prompt lengths in tokens")
    p.add_argument("--needles", type=int, default=10, help="prompts per length (needle depths 0.05 .. 0.95)")
    p.add_argument("--budget", type=int, default=2048, help="OffloadCache budget_tokens")
    p.add_argument(
        "--methods", nargs="+", default=["dense", "meanbound", "solohead", "headwise", "streaming"],
        choices=["dense", *OFFLOAD_METHODS],
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=None, help="prompts per generate call (default: --needles)")
    p.add_argument(
        "--prefill-chunk", type=int, default=4096, help="generate(prefill_chunk_size=...); 0 = one-shot prefill"
    )
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")  # fmt: skip
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", default="results/core_needle/needle.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-chat", dest="chat", action="store_false", help="plain prompts instead of the chat template")
    p.add_argument(
        "--prefill-peak-both", action=argparse.BooleanOptionalAction, default=True,
        help="also measure the solohead prefill with and without prefill_chunk_size at each length (needs "
        "--prefill-chunk > 0)",
    )  # fmt: skip
    p.add_argument("--fail-fast", action="store_true", help="re-raise the first error instead of recording it")
    args = p.parse_args(argv)
    if not args.tiny and not args.model:
        p.error("--model is required unless --tiny")
    if args.batch is None:
        args.batch = args.needles
    if args.batch < 1 or args.needles < 1:
        p.error("--batch and --needles must be positive")
    return args


# ------------------------------------------------------------------------------------------------------ loading
def load(args, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_path = args.tokenizer or (None if args.tiny else args.model)
    tokenizer = AutoTokenizer.from_pretrained(tok_path) if tok_path else None
    if args.tiny:
        from transformers import Qwen2Config

        torch.manual_seed(args.seed)
        vocab = len(tokenizer) if tokenizer is not None else 1024
        config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=max(args.lengths) + args.max_new_tokens + 64,
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=None,  # random weights: always generate max_new_tokens
            pad_token_id=0,
            initializer_range=0.08,  # large weights: peaked attention and varied outputs, so caches can disagree
        )
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    return model, tokenizer


def random_prompts(vocab: int, length: int, n: int, seed: int) -> list[dict]:
    """Prompts of random token ids (``--tiny`` without a tokenizer): nothing to score, outputs are recorded."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + length)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    return [{"input_ids": row.tolist(), "answer": None, "depth": None, "key": None} for row in ids]


# ------------------------------------------------------------------------------------------------------- helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def make_cache(model, method: str, budget: int):
    """A fresh cache: ``DynamicCache`` for dense (model switched back to its own attention), else an OffloadCache."""
    if method == "dense":
        from transformers import DynamicCache

        from hf_offload import disable_offload_attention

        disable_offload_attention(model)  # a pristine dense baseline (no-op if never switched)
        return DynamicCache(config=model.config)
    from hf_offload import OffloadCache

    return OffloadCache(model, budget_tokens=budget, selector=method)


def dense_kv_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def generate(model, input_ids, cache, max_new_tokens: int, prefill_chunk: int | None, pad_token_id):
    from hf_offload import generate_cache_kwarg

    kwargs = dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        **{generate_cache_kwarg(): cache},
        max_new_tokens=max_new_tokens,
        do_sample=False,  # greedy
        repetition_penalty=1.0,  # plain greedy even if the model's generation_config sets a penalty
        pad_token_id=pad_token_id,
    )
    if prefill_chunk:
        kwargs["prefill_chunk_size"] = prefill_chunk
    with torch.inference_mode():
        return model.generate(**kwargs)


def measure_prefill(model, method, budget, input_ids, prefill_chunk, device, pad_token_id) -> dict:
    """One prefill (``generate(max_new_tokens=1)``) with a fresh cache: time, peak device memory, cache stats."""
    free_memory(device)
    cuda = device.type == "cuda"
    if cuda:
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    cache = make_cache(model, method, budget)
    sync(device)
    t0 = time.perf_counter()
    out = generate(model, input_ids, cache, 1, prefill_chunk, pad_token_id)
    sync(device)
    elapsed = time.perf_counter() - t0
    result = {
        "prefill_chunk_size": prefill_chunk or None,
        "batch": int(input_ids.shape[0]),
        "time_s": elapsed,
        "baseline_bytes": baseline if cuda else None,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
    }
    result["peak_minus_baseline_bytes"] = result["peak_bytes"] - baseline if cuda else None
    if method == "dense":
        result["device_kv_bytes"] = dense_kv_bytes(cache)
    else:
        s = cache.stats()
        result.update({k: s[k] for k in ("device_kv_bytes", "device_summary_bytes", "host_kv_bytes")})
        result["recalled_bytes"] = s["recalled_bytes"]
        result["recalled_blocks"] = s["recalled_blocks"]
    del cache, out
    free_memory(device)
    return result


def aggregate_stats(per_batch: list[dict]) -> dict:
    """Combine the ``stats()`` of several generate calls: residency as the max of one call, traffic as the sum."""
    lookups = hits = 0
    for s in per_batch:
        for layer in s["layers"].values():
            if layer["lookups"]:
                lookups += layer["lookups"]
                hits += layer["hit_rate"] * layer["lookups"]
    agg = {k: max(s[k] for s in per_batch) for k in ("device_kv_bytes", "device_summary_bytes", "host_kv_bytes")}
    agg.update({k: sum(s[k] for s in per_batch) for k in ("recalled_blocks", "recalled_bytes", "offloaded_bytes")})
    agg["hit_rate"] = hits / lookups if lookups else None
    agg["decode_steps"] = max(s["decode_steps"] for s in per_batch)
    return agg


def mib(x) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def source_sha256() -> str:
    """Hash of hf_offload/**/*.py (identifies the library code even when the working tree is not committed)."""
    h = hashlib.sha256()
    for path in sorted((REPO / "hf_offload").rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def metadata(args, model, device, dtype) -> dict:
    """Results header: machine, versions, commit and arguments (benchmarks.common) plus the run's own fields."""
    cfg = model.config.get_text_config(decoder=True)
    return run_metadata(
        args,
        hf_offload_source_sha256=source_sha256(),
        device=str(device),
        dtype=str(dtype).replace("torch.", ""),
        model={
            "type": getattr(cfg, "model_type", None),
            "layers": getattr(cfg, "num_hidden_layers", None),
            "kv_heads": getattr(cfg, "num_key_value_heads", None),
            "head_dim": getattr(cfg, "head_dim", None)
            or getattr(cfg, "hidden_size", 0) // max(getattr(cfg, "num_attention_heads", 1), 1),
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        generation={"do_sample": False, "repetition_penalty": 1.0, "max_new_tokens": args.max_new_tokens},
        haystack=haystack_info(),
    )


# ------------------------------------------------------------------------------------------------------------ run
TABLE_HEADER = (
    "| length | method | acc | =dense | device KV MiB | host KV MiB | prefill peak MiB | time s |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|"
)


def table_row(r: dict) -> str:
    if r.get("error"):
        return f"| {r['length']} | {r['method']} | error: {r['error'][:60]} | | | | | |"
    acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
    same = "-" if r.get("match_dense") is None else f"{r['match_dense']:.2f}"
    kv = r["kv"]
    peak = r["prefill"]["peak_minus_baseline_bytes"] if r.get("prefill") else None
    return (
        f"| {r['length']} | {r['method']} | {acc} | {same} | {mib(kv.get('device_kv_bytes'))} | "
        f"{mib(kv.get('host_kv_bytes', 0))} | {mib(peak)} | {r['generate_time_s']:.2f} |"
    )


def run_one(model, tokenizer, method, length, prompts, args, device, pad_token_id, dense_outputs) -> dict:
    prefill_chunk = args.prefill_chunk or None
    record: dict = {"length": length, "method": method, "n": len(prompts), "batch": args.batch}
    ids = torch.tensor([p["input_ids"] for p in prompts], dtype=torch.long)
    # Prefill alone, first batch (also warms up kernels before the timed run).
    record["prefill"] = measure_prefill(
        model, method, args.budget, ids[: args.batch].to(device), prefill_chunk, device, pad_token_id
    )
    outputs: list[list[int]] = []
    stats: list[dict] = []
    kv_bytes = 0
    elapsed = 0.0
    for start in range(0, len(prompts), args.batch):
        batch = ids[start : start + args.batch].to(device)
        cache = make_cache(model, method, args.budget)
        sync(device)
        t0 = time.perf_counter()
        out = generate(model, batch, cache, args.max_new_tokens, prefill_chunk, pad_token_id)
        sync(device)
        elapsed += time.perf_counter() - t0
        outputs.extend(out[:, batch.shape[1] :].tolist())
        if method == "dense":
            kv_bytes = max(kv_bytes, dense_kv_bytes(cache))
        else:
            stats.append(cache.stats())
        del cache, out, batch
        free_memory(device)
    record["generate_time_s"] = elapsed
    if method == "dense":
        record["kv"] = {"device_kv_bytes": kv_bytes, "device_summary_bytes": 0, "host_kv_bytes": 0}
    else:
        kv = aggregate_stats(stats)
        # stats() counts recalls of the prefill too; the separate prefill run gives that part (first batch only).
        prefill_recall = record["prefill"]["recalled_bytes"] * len(stats)
        kv["prefill_recalled_bytes_est"] = prefill_recall
        kv["decode_recalled_bytes_est"] = kv["recalled_bytes"] - prefill_recall
        record["kv"] = kv
        record["stats_per_batch"] = stats
    samples = []
    correct = 0
    for i, (prompt, gen) in enumerate(zip(prompts, outputs)):
        text = tokenizer.decode(gen, skip_special_tokens=True) if tokenizer is not None else None
        ok = score(text, prompt["answer"]) if prompt["answer"] is not None else None
        correct += bool(ok)
        samples.append(
            {
                "depth": prompt["depth"],
                "actual_depth": prompt.get("actual_depth"),
                "key": prompt["key"],
                "expected": prompt["answer"],
                "output": text,
                "output_ids": gen,
                "correct": ok,
                "match_dense": None if dense_outputs is None else gen == dense_outputs[i],
            }
        )
    scored = prompts[0]["answer"] is not None
    record["correct"] = correct if scored else None
    record["accuracy"] = correct / len(prompts) if scored else None
    record["match_dense"] = (
        None if dense_outputs is None else sum(s["match_dense"] for s in samples) / len(samples)
    )
    record["samples"] = samples
    record["_outputs"] = outputs
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    model, tokenizer = load(args, device, dtype)
    pad_token_id = model.generation_config.pad_token_id
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        eos = model.generation_config.eos_token_id
        pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results = {"metadata": metadata(args, model, device, dtype), "runs": [], "prefill_peak_both": []}

    def save() -> None:
        tmp = out_path.with_suffix(out_path.suffix + ".tmp")
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(out_path)

    print(
        f"# needle: {results['metadata']['model']['type']} on {device} "
        f"({results['metadata']['machine']['gpu'] or 'cpu'}), "
        f"{dtype_name}, budget {args.budget}, needles {args.needles}, batch {args.batch}, "
        f"prefill chunk {args.prefill_chunk or 'off'}\n",
        flush=True,
    )
    print(TABLE_HEADER, flush=True)
    for length in args.lengths:
        if tokenizer is not None:
            prompts = make_needle_prompts(tokenizer, length, args.needles, args.seed, chat=args.chat)
        else:
            prompts = random_prompts(model.config.vocab_size, length, args.needles, args.seed)
        dense_outputs = None
        by_method = {}
        for method in args.methods:
            try:
                record = run_one(model, tokenizer, method, length, prompts, args, device, pad_token_id, dense_outputs)
            except Exception as err:  # record OOM and friends, keep going
                if args.fail_fast:
                    raise
                traceback.print_exc()
                record = {"length": length, "method": method, "error": f"{type(err).__name__}: {err}"}
                free_memory(device)
            outputs = record.pop("_outputs", None)
            if method == "dense" and outputs is not None:
                dense_outputs = outputs
            by_method[method] = record
            results["runs"].append(record)
            print(table_row(record), flush=True)
            save()
        if args.prefill_peak_both and args.prefill_chunk:
            entry = {"length": length, "method": "solohead", "batch": min(args.batch, args.needles)}
            ids = torch.tensor([p["input_ids"] for p in prompts[: args.batch]], dtype=torch.long).to(device)
            for label, chunk in (("chunked", args.prefill_chunk or None), ("unchunked", None)):
                solo = by_method.get("solohead")
                if chunk == (args.prefill_chunk or None) and solo and "prefill" in solo:
                    entry[label] = solo["prefill"]
                    continue
                try:
                    entry[label] = measure_prefill(model, "solohead", args.budget, ids, chunk, device, pad_token_id)
                except Exception as err:
                    if args.fail_fast:
                        raise
                    traceback.print_exc()
                    entry[label] = {"prefill_chunk_size": chunk, "error": f"{type(err).__name__}: {err}"}
                    free_memory(device)
            results["prefill_peak_both"].append(entry)
            del ids
            save()
    if results["prefill_peak_both"]:
        print(
            "\nSolohead prefill, peak device MiB above baseline (time s):\n\n"
            f"| length | chunked ({args.prefill_chunk or 'off'}) | unchunked |\n|---:|---:|---:|",
            flush=True,
        )
        for e in results["prefill_peak_both"]:
            cells = []
            for label in ("chunked", "unchunked"):
                m = e.get(label, {})
                cells.append(
                    f"error: {m['error'][:40]}"
                    if "error" in m
                    else f"{mib(m.get('peak_minus_baseline_bytes'))} ({m.get('time_s', float('nan')):.2f})"
                )
            print(f"| {e['length']} | {cells[0]} | {cells[1]} |", flush=True)
    results["metadata"]["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    save()
    print(f"\nwrote {out_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
