"""Questions over one prefilled prefix, one after another: a new fork per question, one fork refilled for each
(``prefix.fork(into=fork)``), and a ``DynamicCache`` prefix deep-copied per question, timed in the same run.

A prefix of ``--context`` random tokens is prefilled once into an ``OffloadCache`` (and once into a
``DynamicCache``); then ``--questions`` questions of ``--question`` random tokens each are answered in turn with
``--new-tokens`` greedy tokens, each way:

* **new**: ``prefix.fork()`` per question (a new fork captures its CUDA graphs at its first decode step);
* **into**: one fork, refilled for each question after the first (``prefix.fork(into=fork)``: its graphs replay);
* **dynamic**: ``copy.deepcopy`` of the ``DynamicCache`` prefix per question (transformers' own way).

Per question and way: the fork's (or copy's) seconds, time to first token and total seconds (both including the
fork or copy), the graph captures of the answer, and whether its tokens equal the new fork's. The summary takes the
median over the questions after the first, and sets the refilled fork's times to first token against the first
question's: the prefix's timed prefill (after a throwaway one that compiles the kernels) plus that question's time
to first token. Random weights and token ids: the prefill attends exactly, and the
decode selects from random keys (its hit rate is in the file), so the times are those of the workload, not of a
model's answers.

``--profile``: after the timed questions, one more refilled fork and its question up to the first token run under
``torch.profiler`` (with Python frames); the file then lists, per line of this library or of the model's code (the
innermost frame of either that an event comes from), the host-side kernel launches, copies, memsets and
synchronisations on CUDA (top-level ``aten`` operations on the CPU), and the host time spent in them.

    python benchmarks/bench_fork.py --shape qwen2.5-coder-1.5b --context 32768 --questions 6 --new-tokens 16 \\
        --out results/prefix_sharing/h100_qwen15_32k_forks.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_disk import build  # noqa: E402
from benchmarks.common import run_metadata, synced_clock, write_results  # noqa: E402
from hf_offload import OffloadCache  # noqa: E402
from hf_offload.tools.bench import SHAPES  # noqa: E402

WORKLOAD = "random weights, random token ids (prefix and questions); greedy answers"
WAYS = ("new", "into", "dynamic")


class _FirstLogits:
    """A logits processor that notes when ``generate()`` first has logits (the end of the prefill)."""

    def __init__(self, device: torch.device):
        self.device, self.at = device, None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = synced_clock(self.device)
        return scores


def answer(model, make_cache, ids: torch.Tensor, new_tokens: int) -> dict:
    """``generate()`` over ``ids`` with the cache ``make_cache()`` returns (timed with it): tokens and times."""
    device = ids.device
    start = synced_clock(device)
    cache = make_cache()
    made = synced_clock(device)
    first = _FirstLogits(device)
    kwargs = cache.generate_kwargs() if hasattr(cache, "generate_kwargs") else {"past_key_values": cache}
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, logits_processor=[first])  # fmt: skip
    end = synced_clock(device)
    stats = cache.stats() if hasattr(cache, "stats") else {}
    return {"cache": cache, "tokens": out[0, ids.shape[1]:].tolist(), "make_s": made - start,
            "ttft_s": first.at - start, "total_s": end - start,
            "graph_captures": stats.get("graph_captures", 0) + stats.get("layer_graph_captures", 0)
            + stats.get("question_graph_captures", 0),
            "question_graph_replays": stats.get("question_graph_replays", 0),
            "hit_rate": stats.get("hit_rate")}  # fmt: skip


HOST_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaMemcpyAsync",
              "cudaMemsetAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""Host-side runtime calls counted per source line on CUDA."""


def _frame_label(name: str) -> str | None:
    """The source line of a profiler event of a Python frame of this library or of a model's code, else ``None``."""
    if ".py(" in name and ("hf_offload" in name or "transformers/models" in name):
        return name.split("site-packages/")[-1].split("hf_offload/", 1)[-1]
    return None


def source_lines(events, targets) -> list[str]:
    """For each of ``targets`` (profiler events), the innermost frame of this library or of a model's code whose time
    span holds its start, ``"?"`` where none. By time, not by parent links: on CUDA the runtime calls (launches,
    copies) are not children of the Python frames they ran under. Frames of one thread nest, so one sweep over the
    frames and the targets in order of start, with a stack of the open frames, finds each target's innermost one."""
    items = [(e.time_range.start, 0, -e.time_range.end, label) for e in events if (label := _frame_label(e.name))]
    items += [(t.time_range.start, 1, i, None) for i, t in enumerate(targets)]
    items.sort()
    lines = ["?"] * len(targets)
    stack: list[tuple[int, str]] = []  # (end, label) of the open frames, innermost last
    for start, is_target, value, label in items:
        while stack and stack[-1][0] < start:
            stack.pop()
        if is_target:
            lines[value] = stack[-1][1] if stack else "?"
        else:
            stack.append((-value, label))
    return lines


def profile_question(model, make_cache, ids: torch.Tensor, device: torch.device) -> dict:
    """One question's cache (``make_cache()``) and its prefill to the first token under ``torch.profiler``: the
    host-side launches, copies and synchronisations per source line on CUDA, the top-level ``aten`` operations on
    the CPU (count and host milliseconds, most first)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synced_clock(device)
    with profile(activities=activities, with_stack=True) as prof:
        cache = make_cache()
        kwargs = cache.generate_kwargs()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs, max_new_tokens=1, do_sample=False)
        synced_clock(device)
    count: dict[str, int] = {}
    host_us: dict[str, float] = {}
    kinds: dict[str, dict[str, int]] = {}
    events = list(prof.events())
    top_ops = [e for e in events if e.name.startswith("aten::")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]  # fmt: skip
    ops: dict[str, int] = {}
    for line in source_lines(events, top_ops):
        ops[line] = ops.get(line, 0) + 1
    targets = [e for e in events if e.name.startswith(HOST_CALLS)] if cuda else top_ops
    for event, line in zip(targets, source_lines(events, targets)):
        kind = _host_call_kind(event.name) if cuda else event.name
        count[line] = count.get(line, 0) + 1
        host_us[line] = host_us.get(line, 0.0) + event.cpu_time_total
        per_line = kinds.setdefault(line, {})
        per_line[kind] = per_line.get(kind, 0) + 1
    by_line = sorted(((line, n, host_us[line] / 1e3) for line, n in count.items()), key=lambda r: -r[1])
    totals: dict[str, int] = {}
    for per_line in kinds.values():
        for kind, n in per_line.items():
            totals[kind] = totals.get(kind, 0) + n
    return {"kind": "launches, copies and synchronisations" if cuda else "top-level aten operations",
            "events": sum(count.values()), "host_ms": sum(host_us.values()) / 1e3, "by_line": by_line,
            "by_kind": kinds, "kinds": totals,
            "aten_ops_by_line": sorted(ops.items(), key=lambda r: -r[1])}  # fmt: skip


def _host_call_kind(name: str) -> str:
    """``launch``, ``copy``, ``memset`` or ``sync`` for a host-side runtime call of :data:`HOST_CALLS`."""
    if "Launch" in name:
        return "launch"
    if "Memcpy" in name:
        return "copy"
    if "Memset" in name:
        return "memset"
    return "sync"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    parser.add_argument("--context", type=int, default=32768, help="prefix tokens")
    parser.add_argument("--question", type=int, default=36, help="tokens per question")
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="the caches' budget_tokens")
    parser.add_argument("--admission", choices=["always", "auto"], default=None, help="default: the library's")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more refilled fork and question (launches per source line)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.questions < 2 or args.question < 1 or args.new_tokens < 2 or args.context < 64:
        parser.error("--questions >= 2, --question >= 1, --new-tokens >= 2 and --context >= 64, please")

    from transformers import DynamicCache

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model = build(args.shape, args.layers, args.context + args.question + args.new_tokens + 8, device, dtype)
    config = model.config
    g = torch.Generator().manual_seed(0)
    prefix_ids = torch.randint(3, config.vocab_size, (1, args.context), generator=g).to(device)
    questions = [torch.randint(3, config.vocab_size, (1, args.question), generator=g).to(device)
                 for _ in range(args.questions)]  # fmt: skip
    settings = {} if args.admission is None else {"admission": args.admission}
    prefix = OffloadCache(model, budget_tokens=args.budget, **settings)
    dense = DynamicCache(config=config)
    prefill_s = None
    with torch.inference_mode():
        # A throwaway prefill first (kernels compiled), then the prefix's, timed: the first question's share.
        for cache in (OffloadCache(model, budget_tokens=args.budget, **settings), prefix, dense):
            kwargs = cache.forward_kwargs() if hasattr(cache, "forward_kwargs") else {"past_key_values": cache}
            start = synced_clock(device)
            model(input_ids=prefix_ids, attention_mask=torch.ones_like(prefix_ids), **kwargs, use_cache=True,
                  logits_to_keep=1)  # fmt: skip
            if cache is prefix:
                prefill_s = synced_clock(device) - start
    rows = {way: [] for way in WAYS}
    held = {"into": None}

    def refilled():
        held["into"] = prefix.fork(into=held["into"])
        return held["into"]

    makers = {"new": prefix.fork, "into": refilled, "dynamic": lambda: copy.deepcopy(dense)}
    for q, question in enumerate(questions):
        ids = torch.cat([prefix_ids, question], dim=1)
        for way in WAYS:
            row = answer(model, makers[way], ids, args.new_tokens)
            row.pop("cache")
            row["question"] = q
            rows[way].append(row)
        for way in WAYS:
            rows[way][-1]["same_tokens_as_new"] = rows[way][-1]["tokens"] == rows["new"][-1]["tokens"]
    summary = {}
    print(f"{args.shape} ({config.num_hidden_layers} layers), {args.context}-token prefix, {args.questions} questions "
          f"of {args.question} tokens, {args.new_tokens} new tokens, budget {args.budget}, {device}, {args.dtype}; "
          f"{WORKLOAD}; medians over questions 2-{args.questions}")  # fmt: skip
    print(f"{'way':>8} {'fork/copy ms':>13} {'TTFT ms':>9} {'total ms':>9} {'captures':>9} {'same tokens':>12}")
    for way in WAYS:
        later = rows[way][1:]
        summary[way] = {name: statistics.median(r[name] for r in later) for name in ("make_s", "ttft_s", "total_s")}
        summary[way]["graph_captures_later"] = sum(r["graph_captures"] for r in later)
        summary[way]["same_tokens_as_new"] = sum(r["same_tokens_as_new"] for r in rows[way])
        s = summary[way]
        print(f"{way:>8} {1e3 * s['make_s']:>13.2f} {1e3 * s['ttft_s']:>9.2f} {1e3 * s['total_s']:>9.2f} "
              f"{s['graph_captures_later']:>9} {s['same_tokens_as_new']:>8}/{args.questions}", flush=True)
    summary["new_total_over_into"] = summary["new"]["total_s"] / summary["into"]["total_s"]
    print(f"new fork / refilled fork, total per question: {summary['new_total_over_into']:.2f}x")
    # The first question pays the prefix's prefill; the later ones (refilled fork) only their own tokens.
    first = prefill_s + rows["into"][0]["ttft_s"]
    later = [r["ttft_s"] for r in rows["into"][1:]]
    summary["prefix_prefill_s"], summary["first_question_ttft_s"] = prefill_s, first
    summary["later_ttft_over_first"] = {"median": statistics.median(later) / first, "max": max(later) / first}
    print(f"first question: prefix prefill {1e3 * prefill_s:.1f} ms + its question {1e3 * rows['into'][0]['ttft_s']:.1f}"
          f" ms; refilled questions 2-{args.questions}, time to first token over the first's: median "
          f"{summary['later_ttft_over_first']['median']:.3f}, max {summary['later_ttft_over_first']['max']:.3f}")
    result = {"metadata": run_metadata(args, workload=WORKLOAD), "rows": rows, "summary": summary}
    if args.profile:
        ids = torch.cat([prefix_ids, questions[-1]], dim=1)
        result["profile"] = profile_question(model, refilled, ids, device)
        p = result["profile"]
        print(f"refilled fork and question to the first token: {p['events']} {p['kind']}, {p['host_ms']:.1f} ms of "
              "host time in them; by source line:")  # fmt: skip
        print("  in all: " + ", ".join(f"{n} {kind}" for kind, n in sorted(p["kinds"].items(), key=lambda r: -r[1])))
        for line, count, ms in p["by_line"][:25]:
            top = sorted(p["by_kind"][line].items(), key=lambda r: -r[1])[:3]
            print(f"{count:>7} {ms:>8.2f} ms  {line}  ({', '.join(f'{n} {kind}' for kind, n in top)})")
        if device.type == "cuda":
            print(f"top-level aten operations by source line ({sum(n for _, n in p['aten_ops_by_line'])} in all):")
            for line, n in p["aten_ops_by_line"][:25]:
                print(f"{n:>7}  {line}")
    if args.out:
        write_results(args.out, {**result, "complete": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
