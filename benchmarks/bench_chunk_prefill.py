"""A later prefill chunk's attention: in parts merged by their log-sum-exp against one masked call per KV head,
timed in the same run.

A prefix of ``--context`` random tokens is prefilled once into an ``OffloadCache``; then, per continuation length of
``--chunks`` (a question of a few dozen tokens, a prefill chunk of thousands), a fork of it (``--batch`` sequences)
takes the continuation in one forward (``logits_to_keep=1``), through each path:

* **parts** (the library's path wherever the device's fused attention gives its log-sum-exp): the earlier keys,
  which every query of the chunk sees, in one call with the query heads of each KV head stacked as more queries (no
  copy of the keys per query head); the chunk's own keys causally; the parts merged by their log-sum-exp;
* **masked** (the path where it does not): one ``scaled_dot_product_attention`` call per KV head with a lower-right
  causal mask, over the keys and values repeated for that head's query heads.

Both attend every earlier key exactly (a prefill does not select), so the workload is random weights and random
token ids; the time includes the fork. The two paths alternate ``--repeats`` times; the median of each is reported,
with their ratio and the largest difference of the last logits between them.

    python benchmarks/bench_chunk_prefill.py --shape qwen2.5-coder-1.5b --layers 2 --context 8192 --batch 1 \\
        --chunks 36 1024 --dtype float32 --device cpu --out results/prefill/cpu_qwen15_2layers_8k.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_disk import build  # noqa: E402
from benchmarks.common import run_metadata, synced_clock, write_results  # noqa: E402
from hf_offload import OffloadCache  # noqa: E402
from hf_offload.attention import prefill  # noqa: E402
from hf_offload.cache import layer as layer_module  # noqa: E402
from hf_offload.tools.bench import SHAPES  # noqa: E402

WORKLOAD = "random weights, random token ids; exact attention over every earlier key (a prefill does not select)"
PATHS = ("masked", "parts")


def timed_chunk(model, prefix: OffloadCache, ids: torch.Tensor, n_prefix: int, batch: int, path: str):
    """Fork ``prefix`` to ``batch`` sequences and forward ``ids`` (the continuation) through ``path``: seconds and
    the last position's logits."""
    device = ids.device
    available = prefill.lse_attention_available
    if path == "masked":  # the attention's check, and the admission's estimate of the forward's temporaries
        prefill.lse_attention_available = layer_module.lse_attention_available = lambda *args: False
    try:
        start = synced_clock(device)
        fork = prefix.fork(batch=batch)
        mask = torch.ones(batch, n_prefix + ids.shape[1], dtype=torch.long, device=device)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, **fork.forward_kwargs(), use_cache=True, logits_to_keep=1)
        seconds = synced_clock(device) - start
    finally:
        prefill.lse_attention_available = layer_module.lse_attention_available = available
    return seconds, out.logits[:, -1].float()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    parser.add_argument("--context", type=int, default=32768, help="prefix tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences the prefix is forked to")
    parser.add_argument("--chunks", type=int, nargs="+", default=[36, 1024, 4096], help="continuation lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.context < 64 or args.batch < 1 or args.repeats < 1 or min(args.chunks) < 2:
        parser.error("--context >= 64, --batch >= 1, --repeats >= 1 and every --chunks length >= 2, please")

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build(args.shape, args.layers, args.context + max(args.chunks) + 8, device, dtype)
    config = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randint(3, config.vocab_size, (1, args.context), generator=g).to(device)
    prefix = OffloadCache(model, budget_tokens=2048)
    with torch.inference_mode():
        model(input_ids=x, attention_mask=torch.ones_like(x), **prefix.forward_kwargs(), use_cache=True,
              logits_to_keep=1)  # fmt: skip
    rows = []
    print(f"{args.shape} ({config.num_hidden_layers} layers, {config.num_attention_heads} query / "
          f"{config.num_key_value_heads} KV heads), {args.context} prefix tokens, batch {args.batch}, {device}, "
          f"{args.dtype}; {WORKLOAD}")  # fmt: skip
    print(f"{'chunk':>6} {'masked ms':>10} {'parts ms':>9} {'masked/parts':>13} {'max |logit diff|':>17}")
    for n in args.chunks:
        ids = torch.randint(3, config.vocab_size, (args.batch, n), generator=g).to(device)
        for path in PATHS:  # once each, untimed: kernels compile, the allocator grows
            timed_chunk(model, prefix, ids, args.context, args.batch, path)
        times = {path: [] for path in PATHS}
        logits = {}
        for _ in range(args.repeats):
            for path in PATHS:
                seconds, logits[path] = timed_chunk(model, prefix, ids, args.context, args.batch, path)
                times[path].append(seconds)
        median = {path: statistics.median(times[path]) for path in PATHS}
        diff = float((logits["parts"] - logits["masked"]).abs().max())
        rows.append({"chunk": n, "masked_s": times["masked"], "parts_s": times["parts"],
                     "median_masked_s": median["masked"], "median_parts_s": median["parts"],
                     "masked_over_parts": median["masked"] / median["parts"], "max_abs_logit_diff": diff,
                     "max_abs_logit": float(logits["masked"].abs().max())})  # fmt: skip
        print(f"{n:>6} {1e3 * median['masked']:>10.2f} {1e3 * median['parts']:>9.2f} "
              f"{median['masked'] / median['parts']:>13.2f} {diff:>17.2e}", flush=True)
    if args.out:
        write_results(args.out, {"metadata": run_metadata(args, workload=WORKLOAD), "rows": rows, "complete": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
