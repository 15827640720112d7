"""Time per phase of one decode step with the KV offloaded, on a real-shaped random-weight model.

The KV cache is filled directly with random keys and values (no prefill: decode speed does not depend on the KV
contents, only its size, but what a selector picks does), then the model decodes ``--steps`` tokens through
``generate()`` with ``OffloadCache(timing=True)``. Reports mean milliseconds per decode step of select / prefetch /
recall / attention / rest, tokens per second, hit rate and recalled bytes per step, for each transfer path and
lookahead setting (``--lookahead off|on|both``; every setting decodes on the same filled cache, one after the
other). Raw JSON to ``--out``.

``--hidden-share`` also measures how much of the recall is hidden behind compute::

    hidden share = 1 - (step ms with recall - step ms with every selected block resident) / recall ms alone

* "every selected block resident": the same decode steps (same plans, slot assignments, launches and attention)
  with the recall copies emptied, so no byte moves: the copy kernel is launched with every entry skipped (the
  launch a step whose blocks are all resident makes), the portable path copies nothing. The pool, the hit rate and
  all other work stay those of the real run, which a larger pool (or a replayed step) would change.
* ``--rounds R``: each setting decodes ``R`` times per mode, the modes alternating (moved, none, moved, ...), and
  the step times are the medians over rounds, so that a slow phase of the host falls on both modes; the spread of
  the per-round shares is reported too. Every setting first decodes ``--warmup`` untimed steps. With CUDA graphs
  each round drops the graphs (those captured with copies must not serve the other mode) and decodes ``--warmup``
  untimed steps in its mode, which capture them again; its step time is the median of its timed steps (the mean,
  ``wall_ms_per_step``, also carries a seal's capture where one falls in them).
* "recall ms alone": the copies of that step's missed bytes in isolation, measured in the same run: per offloaded
  layer one recall of as many random blocks (pieces for per-head selectors) of that layer's host pool as the exact
  plans of the lookahead-off run missed per layer and step, into a scratch slot pool, on an idle device; median of
  ``--alone-repeats``. Also given for the bytes each setting moved itself (``recall_alone_own_ms``: prefetches
  included).

``--workload recorded:PATH`` fills the cache with a decode recorded from a real model instead
(``benchmarks/workload.py``: its keys tiled to the context, random values) and replays the recorded queries and new
keys at every decode step, so that selection, hit rate and step-to-step locality are a model's; the model's
``rope_theta`` becomes the recording's. Lookahead's forecast still runs the next layer's query projection of the
random weights, so it forecasts nothing there.

Must-show of the recall engine (H200, ~1 min)::

    python benchmarks/bench_decode_step.py --shape llama-8b --context 32768 --batch 8 --budget 2048 \\
        --transfers kernel --lookahead both --hidden-share --out results/decode/decode_step_lookahead.json

Smoke test on a CPU: ``--shape tiny --context 512 --batch 2 --budget 128 --steps 4 --transfers torch``.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.check_transfer_paths import SHAPES  # noqa: E402
from benchmarks.common import run_metadata, write_results  # noqa: E402
from benchmarks.workload import Replay, load_workload, workload_row  # noqa: E402
from hf_offload import OffloadCache, generate_cache_kwarg  # noqa: E402
from hf_offload.store import transfer  # noqa: E402
from hf_offload.tools.bench import _StepClock, fill_random  # noqa: E402
from hf_offload.kernels.gather import kernels_available  # noqa: E402
from hf_offload.store import DeviceSlotPool  # noqa: E402

LOOKAHEAD = {"off": [False], "on": [True], "both": [False, True]}
GRAPHS = {"off": [False], "on": [True], "both": [False, True]}


@contextlib.contextmanager
def copies_skipped():
    """Within the block, recalls move no bytes: the kernel is launched with every entry skipped (``-1``), the
    portable path copies nothing; every other part of a decode step runs as usual."""
    kernel, portable = transfer.recall_blocks_kernel, transfer.recall_blocks

    def kernel_skipping(host, pool, ids, batch_idx, slot_idx, head_idx=None, offsets=None):
        kernel(host, pool, torch.full_like(ids, -1), batch_idx, slot_idx, head_idx, offsets)

    def portable_skipping(host, pool, ids, batch_idx, slot_idx, head_idx=None):
        unit = host.block_bytes if head_idx is None else host.block_bytes // pool.kv_heads
        return len(ids) * unit

    transfer.recall_blocks_kernel, transfer.recall_blocks = kernel_skipping, portable_skipping
    try:
        yield
    finally:
        transfer.recall_blocks_kernel, transfer.recall_blocks = kernel, portable


def decode(model, cache, ids: torch.Tensor, steps: int, cuda: bool, step_s: list | None = None
           ) -> tuple[torch.Tensor, float]:  # fmt: skip
    """``steps`` greedy decode steps continuing ``ids`` on ``cache``; returns the new ids and the wall seconds. With
    ``step_s`` (a list), each step's seconds are appended to it (the device synchronised after each step)."""
    from transformers import LogitsProcessorList

    clock = _StepClock(torch.device("cuda" if cuda else "cpu"))
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                             do_sample=False,
                             max_new_tokens=steps, min_new_tokens=steps,
                             logits_processor=LogitsProcessorList([clock]) if step_s is not None else None)  # fmt: skip
    if cuda:
        torch.cuda.synchronize()
    if step_s is not None:
        step_s.extend(b - a for a, b in zip([t0, *clock.marks], clock.marks))
    return out, time.perf_counter() - t0


def profile_steps(model, cache, ids: torch.Tensor, steps: int, cuda: bool, out: Path, host: bool = False,
                  trace_anchor: str | None = None) -> None:
    """Profile ``steps`` decode steps on ``cache`` (after the timed ones; their counts are not reported) and write
    the operators and kernels by total device time to ``out``; with ``host``, by host time (self CPU time), after
    dropping the captured graphs, so that the profiled steps start with a capture round.

    With ``trace_anchor`` (CUDA only), also write ``out`` with the suffix ``.trace.json.gz`` (gzip-compressed JSON;
    ``gzip.open(path, "rt")`` reads it): every device kernel of
    the profiled steps in launch order (name, start and duration in us, the operator that launched it and the
    innermost frame of this library or of transformers), and the kernels of one period between two consecutive
    kernels whose name contains ``trace_anchor`` (one layer's worth when the anchor runs once per layer), each
    with its median duration over all such periods."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if host:
        cache.drop_graphs()
    with profile(activities=activities, with_stack=bool(trace_anchor and cuda)) as prof:
        decode(model, cache, ids, steps, cuda)
    sort = "self_cpu_time_total" if host or not cuda else "cuda_time_total"
    what = "host time, starting with a capture round" if host else "device time" if cuda else "host time"
    out.write_text(f"{steps} decode steps, by {what}\n" + prof.key_averages().table(sort_by=sort, row_limit=40))
    print(f"wrote {out}")
    if trace_anchor and cuda:
        trace = kernel_trace(prof.events(), trace_anchor)
        path = out.with_suffix(".trace.json.gz")
        with gzip.open(path, "wt") as f:  # a period's thousands of kernels: megabytes of JSON, a tenth compressed
            json.dump(trace, f, indent=1)
        print(f"wrote {path}: {len(trace['period'])} kernels per period, {trace['period_us']:.1f} us "
              f"(median of {trace['periods']} periods)")
        for k in trace["period"]:
            print(f"  {k['us']:8.1f} us  {k['name'][:60]:60s} {k['op'][:28]:28s} {k['frame'][:90]}")


def kernel_trace(events, anchor: str) -> dict:
    """Device kernels of profiler ``events`` in launch order, and one period between two ``anchor`` kernels.

    Returns a dict: ``kernels`` (a list of ``{"name", "start_us", "us", "op", "frame"}``), ``periods`` (how many
    complete periods there were), ``period`` (the kernels of the last complete period, each with ``us`` the median
    over the periods of the same length) and ``period_us`` (their sum)."""
    from torch.autograd import DeviceType

    def frame(e) -> str:
        while e is not None:  # the stack of an operator, or the enclosing Python functions' events
            for f in [*(e.stack or ()), e.name]:
                if ".py(" in f and ("hf_offload" in f or "transformers" in f):
                    return f.split("site-packages/")[-1]
            e = e.cpu_parent
        return ""

    def op(e) -> str:
        p = getattr(e, "cpu_parent", None)
        while p is not None and p.cpu_parent is not None and p.cpu_parent.name.startswith("aten::"):
            p = p.cpu_parent
        return p.name if p is not None else ""

    kernels = sorted(
        ({"name": e.name, "start_us": e.time_range.start, "us": e.time_range.elapsed_us(), "op": op(e),
          "frame": frame(e)} for e in events if e.device_type == DeviceType.CUDA),
        key=lambda k: k["start_us"],
    )  # fmt: skip
    marks = [i for i, k in enumerate(kernels) if anchor in k["name"]]
    spans = [kernels[a:b] for a, b in zip(marks, marks[1:])]
    if not spans:
        return {"kernels": kernels, "periods": 0, "period": [], "period_us": 0.0}
    last = spans[-1]
    same = [s for s in spans if [k["name"] for k in s] == [k["name"] for k in last]]
    period = [{**k, "us": statistics.median(s[i]["us"] for s in same)} for i, k in enumerate(last)]
    return {"kernels": kernels, "periods": len(same), "period": period, "period_us": sum(k["us"] for k in period)}


def recall_alone_ms(cache, pieces_per_layer: float, path: str, repeats: int, seed: int = 0) -> float | None:
    """Median ms to recall ``pieces_per_layer`` random blocks (or head pieces) of every offloaded layer's host pool,
    one recall per layer as in a decode step, into a scratch slot pool on an otherwise idle device.

    Every repetition draws new blocks, as decode steps do: repeating the same blocks would time reads of host pages
    whose address translations the previous repetition left cached on the device.

    Args:
        cache: a filled :class:`~hf_offload.OffloadCache`.
        pieces_per_layer: blocks (whole blocks for shared selectors, single-head pieces for per-head selectors)
            per layer; rounded to the nearest integer.
        path: ``"kernel"`` or ``"torch"``: the transfer path to time.
        repeats: timed repetitions (after one warm-up).
    """
    n = round(pieces_per_layer)
    layers = cache.offload_layers
    if n <= 0 or not layers:
        return 0.0 if n <= 0 else None
    first = layers[0]
    device = first.device
    per_head = first.selector.per_head
    scratch = DeviceSlotPool(1, n, first.blocks.kv_heads, first.block_tokens, first.blocks.head_dim, first.blocks.dtype, device)
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(repeats + 1):  # every index on its side before the clock starts; new blocks each repetition
        plans = []
        for layer in layers:
            table = layer.blocks.block_table.flatten()
            ids = table[torch.randint(0, len(table), (n,), generator=g)]
            heads = torch.randint(0, layer.blocks.kv_heads, (n,), generator=g).to(device) if per_head else None
            plans.append((layer, ids if path == "torch" else ids.to(device), heads))
        steps.append(plans)
    zeros, slots = torch.zeros(n, dtype=torch.int64, device=device), torch.arange(n, device=device)
    recall = transfer.recall_blocks_kernel if path == "kernel" else transfer.recall_blocks

    def one_step(plans):
        for layer, ids, heads in plans:
            recall(layer.blocks.host, scratch, ids, zeros, slots, heads)

    cuda = device.type == "cuda"
    times = []
    for rep in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            one_step(steps[rep])
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            one_step(steps[rep])
            ms = (time.perf_counter() - t0) * 1e3
        if rep:  # the first run warms up
            times.append(ms)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per setting")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first, per transfer path")
    parser.add_argument("--transfers", nargs="+", default=["kernel", "torch"])
    parser.add_argument("--selector", default="solohead")
    parser.add_argument("--lookahead", choices=sorted(LOOKAHEAD), default="off")
    parser.add_argument("--graphs", choices=sorted(GRAPHS), default="off",
                        help="cuda_graphs setting(s); with graphs on, lookahead runs inside the whole-layer graphs "
                        "and there is no phase timing (the step time is the wall time of generate() per step)")  # fmt: skip
    parser.add_argument("--lookahead-blocks", type=int, default=None, help="OffloadConfig.lookahead_blocks")
    parser.add_argument("--admission", choices=("always", "auto"), default="always",
                        help="OffloadConfig.admission: 'always' offloads every block (recall over PCIe); 'auto' keeps "
                        "blocks in device memory up to --device-memory-gib (recall within the device)")  # fmt: skip
    parser.add_argument("--decode-attention", choices=("auto", "paged", "pool"), default="auto",
                        help="OffloadConfig.decode_attention")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="OffloadConfig.device_memory_gib for --admission auto (default: 80%% of the free memory)")
    parser.add_argument("--hidden-share", action="store_true", help="also time every setting with no bytes moved "
                        "and the recall alone, and report the share of recall hidden behind compute")  # fmt: skip
    parser.add_argument("--alone-repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed runs of --steps steps per setting and mode; with --hidden-share the modes "
                        "alternate (moved, none, moved, ...), so that a slow phase of the host or device falls on both, "
                        "and the share is computed from the medians over rounds")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after each setting's timed run, profile this many more decode steps (torch.profiler) "
                        "and write the kernels by device time next to --out")  # fmt: skip
    parser.add_argument("--profile-host", action="store_true",
                        help="with --profile: sort by host time, and drop the captured graphs first so that the "
                        "profiled steps start with a capture round (where a graph step's host time goes)")  # fmt: skip
    parser.add_argument("--profile-trace", default=None, metavar="ANCHOR",
                        help="with --profile on CUDA: also write every kernel in launch order and one period between "
                        "two kernels whose name contains ANCHOR (e.g. quantkey: one layer) to a .trace.json")  # fmt: skip
    parser.add_argument("--workload", default="random", metavar="random|recorded:PATH",
                        help="'random' (random KV and queries, the worst case) or 'recorded:PATH', a decode recorded "
                        "by benchmarks/workload.py and replayed at the shape (the model's rope_theta becomes the "
                        "recording's)")  # fmt: skip
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    parser.add_argument("--out", default="results/decode/decode_step.json")
    args = parser.parse_args(argv)
    try:
        recording = load_workload(args.workload)  # a bad file fails here, before any model is built
    except (OSError, ValueError) as err:
        parser.error(f"--workload: {err}")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step times are measured from one step's start to the next)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES[args.shape]
    # (cuda_graphs, lookahead) pairs; graphs run without the phase timer (lookahead inside the whole-layer graphs).
    settings = [(False, la) for la in LOOKAHEAD[args.lookahead]] * (False in GRAPHS[args.graphs])
    settings += [(True, la) for la in LOOKAHEAD[args.lookahead]] * (True in GRAPHS[args.graphs])
    modes = [False, True] if args.hidden_share else [False]  # copies skipped?
    total_steps = args.warmup * (1 + len(settings)) + args.steps * len(settings) * len(modes) * args.rounds
    theta = {"rope_theta": recording.rope_theta} if recording is not None else {}
    config = LlamaConfig(**{**shape, **theta}, max_position_embeddings=args.context + total_steps + 16)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    with device:
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    build_s = time.perf_counter() - t0
    runs, shares, skipped = [], [], []
    workload = workload_row({"recording": recording})
    if recording is None:
        note = "decode-only: the KV is filled with random values without a prefill; random weights"
    else:
        workload["recording"] = recording.describe()
        note = (f"decode-only: KV replayed from {workload['file']} (sha256 {workload['sha256'][:12]}..., recorded "
                f"from {workload['model']}; keys tiled to the context, the recorded queries and new keys, random "
                f"values); random weights")  # fmt: skip

    def save(complete: bool) -> None:
        meta = run_metadata(args, model_build_s=build_s, note=note, workload=workload)
        write_results(args.out, {"metadata": meta, "runs": runs,
                                 "hidden_share": shares, "skipped": skipped, "complete": complete})  # fmt: skip

    print(f"{'transfer':8s} {'graphs':6s} {'lookahead':9s} {'bytes':8s} {'wall ms':>8s} {'step ms':>8s} {'select':>7s} {'prefetch':>8s} "
          f"{'recall':>7s} {'attn':>7s} {'rest':>7s} {'tok/s':>7s} {'hit':>6s} {'MiB/step':>9s} {'prefetch used':>13s} {'replays/captures':>16s} {'capture ms':>10s}")  # fmt: skip
    for path in args.transfers:
        if path == "kernel" and not kernels_available(device):
            skipped.append({"transfer": path, "reason": f"the copy kernels cannot run on {device.type} here"})
            print(f"{path:8s} skipped: the copy kernels cannot run on {device.type} here")
            continue
        cache = OffloadCache(model, budget_tokens=args.budget, selector=args.selector, transfer=path, timing=True,
                             admission=args.admission, device_memory_gib=args.device_memory_gib,
                             decode_attention=args.decode_attention,
                             lookahead=settings[0][1], lookahead_blocks=args.lookahead_blocks)  # fmt: skip
        t0 = time.perf_counter()
        replay = None
        if recording is None:
            fill_random(cache, args.batch, args.context, shape["num_key_value_heads"], shape["head_dim"], device)
        else:  # decode starts at position args.context, the token after the filled ones (Replay's contract)
            replay = Replay(recording, config, args.batch, args.context, device, dtype=model.dtype)
            with torch.inference_mode():
                replay.fill(cache)
        if cuda:
            torch.cuda.synchronize()
        fill_s = time.perf_counter() - t0
        replaying = contextlib.ExitStack()
        if replay is not None:  # every decode step from here on attends with a recorded step's query and key
            replaying.enter_context(replay.hooks(model))
        try:
            ids = torch.randint(0, config.vocab_size, (args.batch, args.context + 1), device=device)
            if args.warmup:
                ids, _ = decode(model, cache, ids, args.warmup, cuda)  # compiles kernels, fills the slot pools
            layers = len(cache.offload_layers)
            measured = {}
            # Settings run one after the other on this cache. After a run without copies the slots hold stale bytes,
            # which changes the tokens that follow but no timing (decode cost does not depend on the values).
            for graphs, lookahead in settings:
                cache.set_options(cuda_graphs=graphs, timing=not graphs, lookahead=lookahead)
                if args.warmup:  # the setting's own kernels compile and its graphs are captured before any timed step
                    ids, _ = decode(model, cache, ids, args.warmup, cuda)
                for round_idx, skip in ((r, skip) for r in range(args.rounds) for skip in modes):
                    cache.reset_stats()
                    if cuda:
                        torch.cuda.reset_peak_memory_stats()
                    cache.drop_graphs()  # graphs captured with or without copies must not serve the other mode
                    step_s: list[float] = []
                    with copies_skipped() if skip else contextlib.nullcontext():
                        if graphs and args.warmup:  # the mode's graphs are captured before the timed steps
                            ids, _ = decode(model, cache, ids, args.warmup, cuda)
                            cache.reset_stats()
                        ids, generate_s = decode(model, cache, ids, args.steps, cuda, step_s)
                    stats = cache.stats()
                    if args.profile and not skip and round_idx == args.rounds - 1:
                        profile_steps(model, cache, ids, args.profile, cuda,
                                      Path(args.out).with_suffix(
                                          f".{path}.graphs-{graphs}.lookahead-{lookahead}.prof.txt"),
                                      host=args.profile_host, trace_anchor=args.profile_trace)  # fmt: skip
                    cache.drop_graphs()
                    stats.pop("layers")
                    steps = max(stats["decode_steps"], 1)
                    wall_ms = generate_s * 1e3 / args.steps
                    median_ms = statistics.median(step_s) * 1e3
                    # graphs: no phase timer; the median step (a seal's graph capture in the timed steps is one spike)
                    timing = stats["timing"] or {"step_ms": median_ms}
                    run = {
                        "transfer": path,
                        "workload": workload["kind"],
                        "cuda_graphs": graphs,
                        "lookahead": lookahead,
                        "bytes_moved": not skip,
                        "round": round_idx,
                        "fill_s": fill_s,
                        "generate_s": generate_s,
                        "wall_ms_per_step": wall_ms,
                        "median_step_ms": median_ms,
                        "step_s": step_s,
                        "step_ms": timing["step_ms"],
                        "tokens_per_s": args.batch * 1e3 / timing["step_ms"],
                        "decode_recalled_bytes_per_step": stats["decode_recalled_bytes"] / steps,
                        "decode_recalled_blocks_per_layer_step": stats["decode_recalled_blocks"] / steps / layers,
                        "exact_recalled_blocks_per_layer_step":
                            (stats["decode_recalled_blocks"] - stats["prefetched_blocks"]) / steps / layers,
                        "prefetched_bytes_per_step": stats["prefetched_bytes"] / steps,
                        "prefetch_used_share": stats["prefetch_used_blocks"] / stats["prefetched_blocks"]
                        if stats["prefetched_blocks"] else None,
                        "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                        # Host time of the layer steps that captured a graph, per timed step (a capture follows each
                        # seal of a block, every block_tokens steps): the part of wall_ms_per_step graphs cost.
                        "graph_capture_ms_per_step": stats["graph_capture_ms"] / steps,
                        "stats": stats,
                    }  # fmt: skip
                    runs.append(run)
                    measured.setdefault((graphs, lookahead, skip), []).append(run)
                    used = "-" if run["prefetch_used_share"] is None else f"{run['prefetch_used_share']:.2f}"
                    phases = " ".join(f"{timing.get(k + '_ms', float('nan')):{w}.2f}" for k, w in
                                      (("select", 7), ("prefetch", 8), ("recall", 7), ("attention", 7), ("rest", 7)))
                    print(f"{path:8s} {'on' if graphs else 'off':6s} {'on' if lookahead else 'off':9s} "
                          f"{'none' if skip else 'moved':8s} {wall_ms:8.2f} {timing['step_ms']:8.2f} {phases} "
                          f"{run['tokens_per_s']:7.1f} {stats['hit_rate']:6.3f} "
                          f"{run['decode_recalled_bytes_per_step'] / 2**20:9.2f} {used:>13s} "
                          f"{stats['graph_replays']:>8d}/{stats['graph_captures']:<7d} "
                          f"{run['graph_capture_ms_per_step']:10.2f}", flush=True)  # fmt: skip
            if args.hidden_share:
                # The bytes a step must move to be exact: the misses of the plans without lookahead.
                base = next(measured[key] for key in ((False, False, False), (True, False, False), (False, True, False))
                            if key in measured)  # fmt: skip
                missed = statistics.mean(r["exact_recalled_blocks_per_layer_step"] for r in base)
                alone = recall_alone_ms(cache, missed, path, args.alone_repeats)
                for graphs, lookahead in settings:
                    reals, residents = measured[(graphs, lookahead, False)], measured[(graphs, lookahead, True)]
                    step = statistics.median(r["step_ms"] for r in reals)
                    resident = statistics.median(r["step_ms"] for r in residents)
                    moved_blocks = statistics.mean(r["decode_recalled_blocks_per_layer_step"] for r in reals)
                    own = recall_alone_ms(cache, moved_blocks, path, args.alone_repeats)
                    exposed = step - resident
                    # Each round's own pair (its moved run and the resident run right after it): the spread of the
                    # share.
                    paired = ([1 - (a["step_ms"] - b["step_ms"]) / alone for a, b in zip(reals, residents)]
                              if alone else [])
                    share = {
                        "transfer": path,
                        "cuda_graphs": graphs,
                        "lookahead": lookahead,
                        "rounds": len(reals),
                        "step_ms": step,
                        "resident_step_ms": resident,
                        "exposed_recall_ms": exposed,
                        "recall_alone_ms": alone,
                        "recall_alone_blocks_per_layer": missed,
                        "hidden_share": 1 - exposed / alone if alone else None,
                        "hidden_share_per_round": paired,
                        "recall_alone_own_ms": own,
                        "recall_alone_own_blocks_per_layer": moved_blocks,
                    }
                    shares.append(share)
                    hidden = "-" if share["hidden_share"] is None else f"{share['hidden_share']:.2f}"
                    print(f"{path:8s} graphs {'on ' if graphs else 'off'} lookahead {'on ' if lookahead else 'off'}: step {share['step_ms']:.2f} ms, all "
                          f"resident {share['resident_step_ms']:.2f} ms, exposed recall {exposed:.2f} ms, recall alone "
                          f"{alone:.2f} ms ({share['recall_alone_blocks_per_layer']:.1f} blocks x {layers} layers; own "
                          f"bytes {own:.2f} ms) -> hidden share {hidden}"
                          + (f" (rounds {min(paired):.2f}..{max(paired):.2f})" if len(paired) > 1 else ""),
                          flush=True)  # fmt: skip
        finally:  # the replay's hooks leave the model on every path
            replaying.close()
        del cache
        if cuda:
            torch.cuda.empty_cache()
        save(complete=False)  # what is measured so far survives a stopped run
    save(complete=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
