"""The disk tier against the drive it runs on: sequential write / read and random block reads of the drive (dd-like,
with the tier's own I/O sizes), the tier's spill and read throughput, and decode tokens/s host-only vs disk tier.

* **drive**: a file of ``--drive-mib`` MiB in ``--dir``, written in chunk-sized writes (``host_chunk_mib``, what a
  spill writes) and fsynced, read back sequentially in chunk-sized reads, then ``--random-reads`` block-sized reads
  at random block offsets on ``--threads`` threads (what a recall reads); ``O_DIRECT`` where the file system takes
  it, as the tier.
* **tier**: a Llama-architecture model of ``--shape`` (random weights; ``--layers`` overrides the layer count) with
  ``--context`` tokens of random KV per sequence written into the cache (``hf_offload.tools.bench.fill_random``,
  no prefill computed), then ``--steps`` greedy decode steps. Once with every block in host memory, once with
  ``host_memory_gib`` set to ``--host-fraction`` of the KV and ``disk_dir=--dir``. The spill throughput is the
  bytes spilled over the time spent in ``DiskTier.spill`` (write and its reservation); the read throughput the
  bytes read from disk over the time spent in ``DiskTier.read_blocks`` (reads, waits and copies out of staging).

``--model NAME`` runs a real model instead (a registry name of ``hf-offload models`` or a local folder): each
sequence's prompt is ``--context`` tokens of real text with a question at the end (``benchmarks/workload.py:
needle_document``, one document per sequence), prefilled into the cache (``prefill_chunk_size``), then ``--steps``
greedy steps from it; every configuration must generate the host-only run's tokens (``tokens_match_host_only``).
Real keys, queries and hidden states make the selection, and lookahead's forecast of the next layer's blocks, the
model's own (the recorded workload replays queries, so a forecast from the hidden states means nothing there).

Random KV and random queries select blocks nearly at random (a low hit rate), which is the worst case for recall
traffic. ``--workload recorded:PATH`` fills the cache with a decode recorded from a real model instead
(``benchmarks/workload.py``: its keys tiled to the context, random values) and replays the recorded queries and new
keys at every decode step, so that selection, hit rate and step-to-step reuse, and with them the disk reads, are a
model's; every run names its workload. Raw JSON (``benchmarks.common.write_results``).

    python benchmarks/bench_disk.py --shape llama-3.2-1b --layers 4 --context 16384 --batch 2 --dir /tmp \\
        --out results/disk/cpu_llama1b4l_16k.json
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from benchmarks.workload import Replay, load_workload, workload_row  # noqa: E402
from hf_offload import OffloadCache  # noqa: E402
from hf_offload.store.disk import ALIGN, DiskTier, aligned_buffer  # noqa: E402
from hf_offload.tools.bench import SHAPES, _decode_step_times, fill_random  # noqa: E402

MIB = 1 << 20
WORKLOAD = "random weights, random KV written into the cache (no prefill computed), random token ids, greedy decode"


def _open(path: str) -> tuple[int, bool]:
    """``path`` opened for writing and reading, with ``O_DIRECT`` where the file system takes it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def drive(directory: str, total_mib: int, chunk_bytes: int, block_bytes: int, reads: int, threads: int) -> dict:
    """Sequential chunk-sized write (fsynced) and read, and random block-sized reads on ``threads`` threads, of one
    file in ``directory`` (removed afterwards); GB/s each."""
    chunk_bytes = -(-chunk_bytes // ALIGN) * ALIGN
    n_chunks = max(1, total_mib * MIB // chunk_bytes)
    buffer = aligned_buffer(chunk_bytes, False)
    buffer.copy_(torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8))
    view = memoryview(buffer.numpy())
    fd, direct = _open(os.path.join(directory, f"hf-offload-drive-{os.getpid()}.bin"))
    path = os.path.join(directory, f"hf-offload-drive-{os.getpid()}.bin")
    try:
        start = time.perf_counter()
        for i in range(n_chunks):
            os.pwrite(fd, view, i * chunk_bytes)
        os.fsync(fd)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(n_chunks):
            os.preadv(fd, [view], i * chunk_bytes)
        read_s = time.perf_counter() - start
        total = n_chunks * chunk_bytes
        aligned_blocks = block_bytes % ALIGN == 0 or not direct
        rand_fd = fd if aligned_blocks else os.open(path, os.O_RDONLY)
        per_block = total // block_bytes
        rng = random.Random(0)
        offsets = [rng.randrange(per_block) * block_bytes for _ in range(reads)]
        slots = [memoryview(aligned_buffer(block_bytes, False).numpy()) for _ in range(threads)]

        def read(i: int) -> None:
            os.preadv(rand_fd, [slots[i % threads]], offsets[i])

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(read, range(reads), chunksize=max(1, reads // (4 * threads))))
        random_s = time.perf_counter() - start
        if rand_fd != fd:
            os.close(rand_fd)
    finally:
        os.close(fd)
        os.unlink(path)
    return {
        "direct_io": direct,
        "bytes": total,
        "write_chunk_bytes": chunk_bytes,
        "seq_write_gbs": total / write_s / 1e9,
        "seq_read_gbs": total / read_s / 1e9,
        "random_read_block_bytes": block_bytes,
        "random_reads": reads,
        "random_read_gbs": reads * block_bytes / random_s / 1e9,
        "random_read_iops": reads / random_s,
    }


class _Timed:
    """Seconds spent in ``DiskTier.spill`` and ``DiskTier.read_blocks`` while installed."""

    def __init__(self):
        self.spill_s = self.read_s = 0.0
        self._spill, self._read = DiskTier.spill, DiskTier.read_blocks

    def __enter__(self):
        DiskTier.spill, DiskTier.read_blocks = self._timing(self._spill, "spill_s"), self._timing(self._read, "read_s")
        return self

    def _timing(self, method, total: str):
        """``method`` that adds the seconds each call takes to the attribute ``total``."""

        def timed(*args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                setattr(self, total, getattr(self, total) + time.perf_counter() - start)

        return timed

    def __exit__(self, *exc):
        DiskTier.spill, DiskTier.read_blocks = self._spill, self._read


def build(shape: str, layers: int | None, positions: int, device: torch.device, dtype: torch.dtype,
          rope_theta: float | None = None):  # fmt: skip
    """A Llama model of ``shape`` (``hf_offload.tools.bench.SHAPES``), ``layers`` layers if given, random weights;
    ``rope_theta`` replaces the shape's (a recorded workload's RoPE base; speed does not depend on it)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    settings = dict(SHAPES[shape], max_position_embeddings=positions, pad_token_id=0)
    if layers is not None:
        settings["num_hidden_layers"] = layers
    if rope_theta is not None:
        settings["rope_theta"] = rope_theta
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=dtype).eval()


def run_cache(model, args, device, disk: dict, recording=None) -> dict:
    """Fill a cache with ``args.context`` tokens per sequence (random, or replayed from ``recording``), decode
    ``args.steps`` steps (with a recording, its queries and keys); times, tokens/s, stats."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # Every sealed block in host memory (or on disk): admission "auto" would keep them on a GPU that has room.
    cache = OffloadCache(model, budget_tokens=args.budget, host_chunk_mib=args.host_chunk_mib, admission="always",
                         **disk)  # fmt: skip
    torch.manual_seed(0)
    with _Timed() as timed:
        start = time.perf_counter()
        replay = None
        with torch.inference_mode():
            if recording is None:
                fill_random(cache, args.batch, args.context, config.num_key_value_heads, head_dim, device,
                            dtype=model.dtype)  # fmt: skip
            else:
                replay = Replay(recording, config, args.batch, args.context, device, dtype=model.dtype)
                replay.fill(cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        fill_s = time.perf_counter() - start
        fill_spill_s = timed.spill_s
        with replay.hooks(model) if replay is not None else contextlib.nullcontext():
            step_times = _decode_step_times(model, cache, args.batch, args.context, args.steps, device)
    return _row(cache, args, step_times, fill_s, cache.stats()["disk_spilled_bytes"], fill_spill_s, timed.spill_s,
                timed.read_s)  # fmt: skip


def run_model_cache(model, prompts: torch.Tensor, args, device, disk: dict) -> dict:
    """A real model: prefill ``prompts`` (``[batch, context]``) into a cache, then ``args.steps`` greedy steps; times,
    tokens/s, stats (of the decode steps), the generated tokens."""
    from hf_offload import generate_cache_kwarg
    from hf_offload.tools.bench import _StepClock
    from transformers import LogitsProcessorList

    cache = OffloadCache(model, budget_tokens=args.budget, host_chunk_mib=args.host_chunk_mib, admission="always",
                         **disk)  # fmt: skip
    kw = generate_cache_kwarg()
    with _Timed() as timed, torch.inference_mode():
        start = time.perf_counter()
        first = model.generate(prompts, attention_mask=torch.ones_like(prompts), **{kw: cache}, do_sample=False,
                               max_new_tokens=1, prefill_chunk_size=args.prefill_chunk)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize()
        fill_s, fill_spill_s = time.perf_counter() - start, timed.spill_s
        spilled = cache.stats()["disk_spilled_bytes"]
        cache.reset_stats()  # the decode's reads alone
        timed.read_s = 0.0
        clock = _StepClock(device)
        out = model.generate(first, attention_mask=torch.ones_like(first), **{kw: cache}, do_sample=False,
                             max_new_tokens=args.steps, min_new_tokens=args.steps,
                             logits_processor=LogitsProcessorList([clock]))  # fmt: skip
    step_times = [b - a for a, b in zip(clock.marks[1:], clock.marks[2:])]
    return _row(cache, args, step_times, fill_s, spilled, fill_spill_s, timed.spill_s, timed.read_s,
                tokens=out[:, prompts.shape[1] + 1 :].tolist())  # fmt: skip


def _row(cache, args, step_times: list[float], fill_s: float, spilled: int, fill_spill_s: float, spill_s: float,
         read_s: float, **extra) -> dict:  # fmt: skip
    """The result row of one cache configuration (closes the cache): the spill throughput is ``spilled`` bytes over
    the fill's seconds spilling (``fill_spill_s``); ``spill_s`` and ``read_s`` are all the seconds spent spilling and
    reading."""
    # The steady step is the median: the mean carries the steps that capture CUDA graphs (the first seals).
    step_s, mean_s = statistics.median(step_times), sum(step_times) / len(step_times)
    stats = cache.stats()
    stats.pop("layers")
    cache.close()
    read = stats["disk_read_bytes"]
    steps = max(1, stats["decode_steps"])
    return {
        "fill_s": fill_s,
        "fill_gbs": (stats["host_kv_bytes"] + stats["disk_kv_bytes"]) / fill_s / 1e9,
        "decode_step_ms": step_s * 1e3,
        "decode_tok_s": args.batch / step_s,
        "decode_mean_step_ms": mean_s * 1e3,
        "decode_step_s": step_times,
        "spill_gbs": spilled / fill_spill_s / 1e9 if fill_spill_s else None,
        "tier_read_gbs": read / read_s / 1e9 if read_s else None,
        "hit_rate": stats.get("hit_rate"),
        # Per decode step: blocks read from disk when a recall needed them (not staged ahead), blocks staged ahead
        # (lookahead, disk_stage_near) and those of them a recall used.
        "demand_read_blocks_per_step": (stats["disk_read_blocks"] - stats["disk_staged_ahead_blocks"]) / steps,
        "staged_ahead_blocks_per_step": stats["disk_staged_ahead_blocks"] / steps,
        "staged_used_blocks_per_step": stats["disk_staged_used_blocks"] / steps,
        "staging_hits_per_step": stats["disk_staging_hits"] / steps,
        "spill_s": spill_s,
        "read_s": read_s,
        "stats": stats,
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="the disk tier's directory (disk_dir)")
    parser.add_argument("--host-fraction", type=float, default=0.25, help="host_memory_gib as a share of the KV")
    parser.add_argument("--host-chunk-mib", type=float, default=16)
    parser.add_argument("--staging-chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None,
                        help="the drive test's threads and disk_read_threads (default: the library's default)")
    parser.add_argument("--drive-mib", type=int, default=1024)
    parser.add_argument("--random-reads", type=int, default=4096)
    parser.add_argument("--dtype", default=None,
                        help="default: bfloat16 for --shape; for --model the loader's (bfloat16 on CUDA, float32 on "
                        "CPU)")  # fmt: skip
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="a real model (a registry name of 'hf-offload models', or a local folder) instead of "
                        "--shape: real prompts prefilled, greedy decode")  # fmt: skip
    parser.add_argument("--prefill-chunk", type=int, default=4096, help="prefill_chunk_size of --model's prefill")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each cache, alternating (the summary takes the last of each: the first run of a "
                        "process pays one-time costs)")
    parser.add_argument("--lookahead", choices=("off", "on", "both"), default="off",
                        help="the disk tier with lookahead (the next layer's likely blocks staged from disk during this "
                        "layer's work): off, on, or both as two configurations")  # fmt: skip
    parser.add_argument("--graphs", choices=("off", "on", "both"), default=None,
                        help="the disk tier's decode steps op by op (off: cuda_graphs=False) or replayed from CUDA "
                             "graphs (on: cuda_graphs=True, CUDA only; each step of a layer two graphs with the host's "
                             "reads from disk between them); default: on with CUDA (the library's default), else off")
    parser.add_argument("--stage-near", type=int, nargs="+", default=[0], metavar="N",
                        help="disk_stage_near of the disk tier; each value is one configuration (0: 'disk_tier', N: "
                        "'disk_tier_nearN')")  # fmt: skip
    parser.add_argument("--disk-cap", type=int, nargs="+", default=[], metavar="N",
                        help="disk_cap_blocks of the disk tier; each value adds one configuration ('disk_tier_capN', "
                        "without disk_stage_near)")  # fmt: skip
    parser.add_argument("--stage-left-out", type=int, nargs="+", default=[0], metavar="M",
                        help="disk_stage_left_out of each --disk-cap configuration; each value above 0 adds one more "
                        "('disk_tier_capN_leftM')")  # fmt: skip
    parser.add_argument("--workload", default="random", metavar="random|recorded:PATH",
                        help="'random' (random KV and queries, the worst case) or 'recorded:PATH', a decode recorded by "
                        "benchmarks/workload.py and replayed at the shape (the model's rope_theta becomes the "
                        "recording's)")  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first two steps are not timed)")
    if args.threads is None:
        from hf_offload import OffloadConfig

        args.threads = OffloadConfig().disk_read_threads
    if args.model is not None and (args.workload != "random" or args.layers is not None):
        parser.error("--model runs a real model on real prompts: leave out --workload and --layers")
    try:
        recording = load_workload(args.workload)  # a bad file fails here, before any model is built
    except (OSError, ValueError) as err:
        parser.error(f"--workload: {err}")
    device = torch.device(args.device)
    prompts = None
    if args.model is not None:
        from benchmarks.workload import needle_document
        from hf_offload.tools.models import load

        model, tokenizer = load(args.model, dtype=None if args.dtype is None else getattr(torch, args.dtype),
                                device=device)  # fmt: skip
        model.eval()
        dtype = model.dtype
        documents = [needle_document(tokenizer, args.context, seed) for seed in range(args.batch)]
        prompts = torch.tensor([ids for ids, _ in documents], device=device)
        workload = {"kind": "model", "label": f"real model {args.model} ({str(dtype).removeprefix('torch.')})",
                    "model": args.model,
                    "prompts": [info for _, info in documents]}  # fmt: skip
        note = (f"{workload['label']}: one needle document of {args.context:,} tokens per sequence (benchmarks/"
                "workload.py: needle_document, seeds 0..batch-1), prefilled, then greedy decode")  # fmt: skip
    else:
        dtype = getattr(torch, args.dtype or "bfloat16")
        model = build(args.shape, args.layers, args.context + args.steps + 16, device, dtype,
                      rope_theta=recording.rope_theta if recording is not None else None)  # fmt: skip
        workload = workload_row({"recording": recording})  # the same row as bench_decode's
        if recording is None:
            note = f"{workload['label']}: {WORKLOAD}"
        else:
            workload["recording"] = recording.describe()
            note = (f"{workload['label']}: random weights, the recording's keys tiled to the context with random "
                    "values written into the cache, its queries and new keys at every decode step")  # fmt: skip
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = 2 * config.num_key_value_heads * 16 * head_dim * dtype.itemsize
    kv_bytes = config.num_hidden_layers * args.batch * (args.context // 16) * block_bytes
    chunk_bytes = int(args.host_chunk_mib * MIB) // block_bytes * block_bytes
    print(f"KV {kv_bytes / MIB:.0f} MiB; drive test in {args.dir} ...", flush=True)
    drive_result = drive(args.dir, args.drive_mib, chunk_bytes, block_bytes, args.random_reads, args.threads)
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in drive_result.items()}, flush=True)
    host_gib = args.host_fraction * kv_bytes / (1 << 30)
    tier = dict(host_memory_gib=host_gib, disk_dir=args.dir, disk_staging_chunks=args.staging_chunks,
                disk_read_threads=args.threads)  # fmt: skip
    configs = [("host_only", {})]
    for near in args.stage_near:
        tag, with_near = (f"_near{near}", dict(tier, disk_stage_near=near)) if near else ("", tier)
        if args.lookahead in ("off", "both"):
            configs.append((f"disk_tier{tag}", with_near))
        if args.lookahead in ("on", "both"):
            configs.append((f"disk_tier{tag}_lookahead", dict(with_near, lookahead=True)))
    for cap in args.disk_cap:
        for left in args.stage_left_out:
            tag, settings = (f"_left{left}", {"disk_stage_left_out": left}) if left else ("", {})
            configs.append((f"disk_tier_cap{cap}{tag}", dict(tier, disk_cap_blocks=cap, **settings)))
    graphs = args.graphs or ("on" if device.type == "cuda" else "off")
    if graphs != "on":  # op by op
        configs = configs[:1] + [(name, dict(disk, cuda_graphs=False)) for name, disk in configs[1:]]
    if graphs != "off":  # the disk configurations again with graphs (two a step, the host's reads between)
        graphed = [(f"{name}_graphs", dict(disk, cuda_graphs=True)) for name, disk in configs[1:]]
        configs = configs[:1] + graphed if graphs == "on" else configs + graphed
    runs, repeats = {}, {name: [] for name, _ in configs}
    for _ in range(args.repeats):
        for name, disk in configs:
            if prompts is not None:
                runs[name] = r = run_model_cache(model, prompts, args, device, disk)
            else:
                runs[name] = r = run_cache(model, args, device, disk, recording)
            repeats[name].append({k: r[k] for k in ("fill_s", "decode_tok_s", "spill_gbs", "tier_read_gbs", "hit_rate")})
            print(f"{name}: fill {r['fill_s']:.2f} s, decode {r['decode_tok_s']:.2f} tok/s (median step; mean "
                  f"{args.batch * 1e3 / r['decode_mean_step_ms']:.2f}), spill {r['spill_gbs']} "
                  f"GB/s, tier read {r['tier_read_gbs']} GB/s, disk {r['stats']['disk_kv_bytes'] / MIB:.0f} MiB, "
                  f"hit rate {r['hit_rate']}, per step: {r['demand_read_blocks_per_step']:.1f} blocks read on demand, "
                  f"{r['staged_ahead_blocks_per_step']:.1f} staged ahead ({r['staged_used_blocks_per_step']:.1f} "
                  f"used), missed mass {r['stats']['missed_mass']['mean'] if r['stats']['missed_mass'] else None}, "
                  f"{workload['kind']}", flush=True)  # fmt: skip
    summary = {}
    for name in runs:
        if name == "host_only":
            continue
        disk_run, tag = runs[name], name.removeprefix("disk_tier")
        summary.update({
            f"spill_vs_drive_write{tag}": (disk_run["spill_gbs"] or 0) / drive_result["seq_write_gbs"],
            f"tier_read_vs_drive_random_read{tag}": (disk_run["tier_read_gbs"] or 0) / drive_result["random_read_gbs"],
            f"decode_disk_vs_host_only{tag}": disk_run["decode_tok_s"] / runs["host_only"]["decode_tok_s"],
            f"decode_mean_disk_vs_host_only{tag}":
                runs["host_only"]["decode_mean_step_ms"] / disk_run["decode_mean_step_ms"],
        })  # fmt: skip
        if prompts is not None:  # the disk tier moves blocks, never what is attended (but for a disk cap)
            summary[f"tokens_match_host_only{tag}"] = disk_run["tokens"] == runs["host_only"]["tokens"]
    print(summary)
    payload = {"metadata": run_metadata(args, workload=note, kv_bytes=kv_bytes, block_bytes=block_bytes,
                                        chunk_bytes=chunk_bytes, host_memory_gib=host_gib),
               "workload": workload, "drive": drive_result, "runs": runs, "repeats": repeats,
               "summary": summary}  # fmt: skip
    if args.out:
        write_results(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
