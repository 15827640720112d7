"""Decode throughput of HF's KV caches and of OffloadCache on a random-weight model of a real shape, in one run.

Methods, each decoding one new token per sequence and step through the model's forward:

* ``dynamic``: transformers' ``DynamicCache`` (all KV on the device; every step concatenates a layer's KV anew).
* ``static``: transformers' ``StaticCache`` (all KV on the device, preallocated to the context; run eagerly, without
  ``torch.compile``).
* ``hf-offloaded``: transformers' ``DynamicCache(offloading=True)``: every layer's whole KV lives in host memory
  and is copied to the device before the layer runs (prefetched one layer ahead on a side stream) and back after.
* ``quantkey``: ``OffloadCache(selector="quantkey")`` (2-bit keys, selection alone: the fast selector, the default
  before the estimate of the unselected blocks; ``--quantkey-selector`` swaps in another spec, e.g. the default
  ``"quantkey[bits=4,tail_bits=2,tail_near=3]"``), the default transfer path.
* ``quantkey-graphs``, ``solohead-graphs``: the same with ``cuda_graphs=True`` (each layer's decode attention
  replayed from a CUDA graph).
* ``solohead``: ``OffloadCache(selector="solohead")``, the default transfer path (the gather kernel where Triton
  runs on CUDA).
* ``quantkey-auto``, ``solohead-auto``: the same with IO-adaptive admission (``admission="auto"``: the sealed blocks
  stay in device memory as far as it allows, the rest in host memory; same selection and budget) and CUDA graphs
  where they run (``cuda_graphs=None``), sized by the library from what the process may allocate (or bounded by
  ``--admission-gib``). The plain methods put every block in host memory (``admission="always"``).
* ``defaults``: ``OffloadCache(model, budget_tokens=B)``, nothing else set: the library as a user gets it.
* ``headwise-copy``: ``OffloadCache(selector="headwise", transfer="torch")``: one selection per KV head, so a
  recalled block moves as ``2 x kv_heads`` pieces, through the portable path: per layer and step the block table
  is read on the host (a device-to-host synchronisation), the CPU gathers the missing pieces from the pinned pool
  into a pinned staging tensor, and one host-to-device copy moves them.

Decode-only: the KV is filled without a prefill. ``--workload random`` (default) fills random keys and values, and the
random weights make the queries: the worst case for a sparse cache, whose selection then changes almost entirely
from step to step. ``--workload recorded:PATH`` replays a decode recorded from a real model
(``benchmarks/workload.py``): keys of a real document tiled to the context, each step's query and new key taken from
the recording (values random), so the selection and the hit rate behave like a model's. Every row and the metadata
name the workload; the dense methods' speed does not depend on it. ``--e2e`` adds one end-to-end run with a real
(chunked) prefill at batch 1, ``DynamicCache`` vs
``OffloadCache``. Per configuration: tokens per second, time per step, peak device memory, host bytes, recalled
GB/s, hit rate, a roofline bound from bandwidths measured in the same run, and the planner's predicted bytes.
The JSON (``benchmarks.common.write_results``) is rewritten after every configuration.

    python benchmarks/bench_decode.py --shape llama-8b --contexts 32768 65536 131072 --batches auto --e2e
    python benchmarks/bench_decode.py --shape llama-8b --contexts 65536 131072 --batches 8 --methods dynamic quantkey \
        quantkey-auto --workload recorded:.workloads/qwen05_needle_16k.safetensors
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import io
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bench_decode_step import fill_random  # noqa: E402
from benchmarks.common import run_metadata, write_results  # noqa: E402
from benchmarks.workload import RANDOM_WORKLOAD, Replay, load_workload, workload_row  # noqa: E402
from hf_offload import OffloadCache, OffloadConfig, disable_offload_attention  # noqa: E402
from hf_offload.config import DEFAULT_SELECTOR  # noqa: E402
from hf_offload.attention import take_handoff  # noqa: E402
from hf_offload.kernels.gather import kernels_available  # noqa: E402
from hf_offload.planner import plan, shape_from_config  # noqa: E402
from hf_offload.store.host import available_host_bytes  # noqa: E402

GIB = 1 << 30
DECODE_ONLY = "decode-only: KV filled with random values, no prefill"
METHODS = ["dynamic", "static", "hf-offloaded", "defaults", "quantkey", "quantkey-graphs", "quantkey-auto",
           "solohead", "solohead-graphs", "solohead-auto", "headwise-copy"]
OFFLOAD_METHODS = ("defaults", "quantkey", "quantkey-graphs", "quantkey-auto", "solohead", "solohead-graphs",
                   "solohead-auto", "headwise-copy")

# Model sizes (random bf16 weights: speed does not depend on the values). ``family``: the transformers model class;
# ``preset``: the matching hf_offload.planner preset (same KV geometry).
SHAPES: dict[str, dict] = {
    "tiny": dict(family="llama", preset=None, config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=256)),
    "llama-1b": dict(family="llama", preset="llama-3.2-1b", config=dict(  # Llama-3.2-1B
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)),
    "llama-3b": dict(family="llama", preset="llama-3.2-3b", config=dict(  # Llama-3.2-3B
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)),
    "llama-8b": dict(family="llama", preset="llama-3.1-8b", config=dict(  # Llama-3.1-8B
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen-7b": dict(family="qwen2", preset="qwen2.5-7b", config=dict(  # Qwen2.5-7B
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        head_dim=128, vocab_size=152064, rope_theta=1000000.0, tie_word_embeddings=False)),
}  # fmt: skip

METHOD_NOTES = {
    "dynamic": "transformers DynamicCache: all KV on the device; each step concatenates every layer's KV anew",
    "static": "transformers StaticCache(max_cache_len=context): all KV on the device, preallocated; run eagerly "
    "(no torch.compile, no CUDA graphs), so every step attends over the whole preallocated length under a mask",
    "hf-offloaded": "transformers DynamicCache(offloading=True): each layer's whole KV in (pinned) host memory, copied "
    "to the device one layer ahead on a side stream and back to the host after the layer's update, every step",
    "defaults": "OffloadCache(model, budget_tokens=B): the library's defaults as a user gets them (the default "
    "selector, admission='auto' sized from what the process may allocate, CUDA graphs where they run)",
    "solohead": "OffloadCache(selector='solohead', transfer='auto', admission='always'): one block selection per layer and sequence, "
    "whole-block recall (gather kernel where Triton runs on CUDA); every other setting is the OffloadConfig default "
    "of the run's commit (lookahead: off, then on with the kernels for a while, off again since the decode step "
    "with padded recent tokens; CHANGELOG)",
    "quantkey": "OffloadCache(selector='quantkey', transfer='auto', admission='always'): the fast selector (every key on the device at "
    "2 bits, blocks ranked by their estimated attention mass, one shared selection per layer and sequence), "
    "whole-block recall; every other setting is the OffloadConfig default of the run's commit",
    "quantkey-graphs": "OffloadCache(selector='quantkey', transfer='auto', cuda_graphs=True): quantkey with each "
    "layer's decode attention replayed from a CUDA graph (captured once per block capacity, decode_capacity_blocks)",
    "solohead-graphs": "OffloadCache(selector='solohead', transfer='auto', cuda_graphs=True): solohead with each "
    "layer's decode attention replayed from a CUDA graph (captured once per block capacity, decode_capacity_blocks)",
    "quantkey-auto": "OffloadCache(selector='quantkey', transfer='auto', admission='auto', cuda_graphs=None, "
    "device_memory_gib=--admission-gib or None): sealed blocks in device memory as far as it allows, the rest "
    "in host memory; CUDA graphs where they run",
    "solohead-auto": "OffloadCache(selector='solohead', transfer='auto', admission='auto', cuda_graphs=None, "
    "device_memory_gib=--admission-gib or None): sealed blocks in device memory as far as it allows, the rest "
    "in host memory; CUDA graphs where they run",
    "headwise-copy": "OffloadCache(selector='headwise', transfer='torch'): one selection per KV head (2 x kv_heads "
    "pieces per block); per layer and step the block table is read on the host (one synchronisation), the CPU "
    "gathers the missed pieces into a pinned staging tensor, one host-to-device copy moves them (the random fill "
    "writes through the gather kernel where it runs; every decode step uses the torch path)",
}


# ---------------------------------------------------------------------------------------------------------- helpers
def build_model(shape: str, max_positions: int, device: torch.device, rope_theta: float | None = None):
    """A model of ``shape`` with random bf16 weights, built directly on ``device`` (never loaded), in eval mode;
    ``rope_theta`` replaces the shape's (a recorded workload's RoPE base; speed does not depend on it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = SHAPES[shape]
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        spec["family"]
    ]
    settings = {**spec["config"], **({"rope_theta": rope_theta} if rope_theta is not None else {})}
    config = config_cls(**settings, max_position_embeddings=max_positions, attn_implementation="sdpa")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def weight_bytes(model) -> tuple[int, int]:
    """``(all weight bytes, weight bytes read per decode step)``: the step reads every weight except the input
    embedding table (a few rows), unless that table is also the output projection."""
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == embed.data_ptr()
    return total, total - (0 if tied else embed.numel() * embed.element_size())


def cache_kwarg(model) -> str:
    """The forward's cache argument: ``cache`` (transformers 5.24) or ``past_key_values`` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def sync(device: torch.device) -> None:
    """Wait for the device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def empty_host_cache() -> bool:
    """Return torch's cached, unused pinned host blocks to the system; ``False`` where this torch cannot."""
    fn = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(
        torch._C, "_host_emptyCache", None
    )
    if fn is None or not torch.cuda.is_available():
        return False
    fn()
    return True


def pinned_allocator_bytes() -> tuple[int | None, int | None]:
    """``(bytes owned by torch's pinned host allocator, of which in use)``; ``None`` where unknown."""
    if not torch.cuda.is_available():
        return None, None
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:
        return None, None
    return stats.get("allocated_bytes.current"), stats.get("active_bytes.current")


def host_free_bytes() -> int | None:
    """Host bytes a new cache may take: available memory plus pinned blocks torch keeps cached for reuse.

    The cached share never counts below zero: after ``empty_host_cache`` torch 2.11 reported more active than owned
    pinned bytes (a host-memory check at 64K then read -301.7 GiB free and skipped a configuration that fit).
    """
    available = available_host_bytes()
    if available is None:
        return None
    owned, active = pinned_allocator_bytes()
    return available + (max(owned - active, 0) if owned is not None and active is not None else 0)


def release(device: torch.device) -> None:
    """Free what the last configuration left (after an exception too), pinned host blocks included.

    torch's pinned allocator keeps freed blocks for reuse, and where its statistics do not say how many bytes it
    holds unused, ``MemAvailable`` would count them as taken and the next host-memory prediction would skip
    configurations that fit; returning them to the system keeps the prediction exact (at the cost of pinning anew).
    """
    take_handoff()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        empty_host_cache()


class Clock:
    """Per-step timing: CUDA events on CUDA (no synchronisation inside the loop), wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.host_marks: list[float] = []

    def mark(self) -> None:
        """Record a time point (after all work queued so far), and the host's clock when it was queued."""
        self.host_marks.append(time.perf_counter())
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(self.host_marks[-1])

    def host_spans_s(self) -> list[float]:
        """Seconds of host time between consecutive marks (where the host ran ahead of the device, less than
        :meth:`spans_s`; a step that makes the host wait for the device shows here as long as on the device)."""
        return [b - a for a, b in zip(self.host_marks, self.host_marks[1:])]

    def spans_s(self) -> list[float]:
        """Seconds between consecutive marks (synchronises once)."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def measure_bandwidths(device: torch.device, nbytes: int, repeat: int = 5) -> dict:
    """Device-memory bandwidth (a device-to-device copy of ``nbytes``: bytes read + written per second) and the
    host-to-device / device-to-host bandwidth of a pinned buffer. On the CPU both are host memory copies."""
    cuda = device.type == "cuda"
    buf = {"src": torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)}
    buf["dst"] = torch.empty_like(buf["src"])
    buf["host"] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(2)

    def timed(fn) -> float:
        fn()
        sync(device)
        times = []
        for _ in range(repeat):
            clock = Clock(device)
            clock.mark()
            fn()
            clock.mark()
            times.append(clock.spans_s()[0])
        return sorted(times)[len(times) // 2]

    d2d = timed(lambda: buf["dst"].copy_(buf["src"]))
    h2d = timed(lambda: buf["dst"].copy_(buf["host"], non_blocking=cuda))
    d2h = timed(lambda: buf["host"].copy_(buf["src"], non_blocking=cuda))
    buf.clear()
    release(device)
    empty_host_cache()
    return {
        "bytes": nbytes,
        "hbm_bytes_per_s": 2 * nbytes / d2d,
        "h2d_pinned_bytes_per_s": nbytes / h2d,
        "d2h_pinned_bytes_per_s": nbytes / d2h,
        "note": "hbm: device-to-device copy, bytes read + written per second; h2d / d2h: one pinned buffer "
        "(on a CPU: host memory copies); medians of " + str(repeat),
    }


def tensor_bytes(cache, device: torch.device) -> tuple[int, int]:
    """``(bytes on the compute device, bytes elsewhere)`` of a transformers cache's key and value tensors."""
    on_device = elsewhere = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                n = t.numel() * t.element_size()
                if t.device == device or (t.device.type == device.type and device.index is None):
                    on_device += n
                else:
                    elsewhere += n
    return on_device, elsewhere


# ----------------------------------------------------------------------------------------------------- predictions
def method_note(method: str, args) -> str:
    """:data:`METHOD_NOTES`' line for ``method``, naming ``--quantkey-selector`` where it replaces ``quantkey``."""
    note = METHOD_NOTES[method]
    if method.startswith("quantkey") and selector_of(method, args) != "quantkey":
        note += f"; selector {selector_of(method, args)!r} (--quantkey-selector) instead of 'quantkey'"
    return note


def selector_of(method: str, args) -> str:
    """The selector of an OffloadCache method: ``headwise`` for ``headwise-copy``, else the method's first word, where
    ``quantkey`` stands for ``--quantkey-selector`` (e.g. ``quantkey[bits=4,tail_bits=2]``)."""
    if method == "headwise-copy":
        return "headwise"
    name = method.split("-")[0]
    return getattr(args, "quantkey_selector", "quantkey") if name == "quantkey" else name


def offload_config(method: str, args) -> OffloadConfig | None:
    """The :class:`OffloadConfig` of an OffloadCache method (``None`` for the others). The plain methods put every
    block in host memory (``admission="always"``); the ``-auto`` methods and ``defaults`` admit blocks to the device
    as the library does, the ``-auto`` ones bounded by ``--admission-gib`` where given."""
    if method not in OFFLOAD_METHODS:
        return None
    if method == "defaults":
        return OffloadConfig(budget_tokens=args.budget, **adaptive_of(args))
    selector = selector_of(method, args)
    capacity = dict(decode_capacity_blocks=getattr(args, "decode_capacity", None),
                    decode_attention=getattr(args, "decode_attention", "auto"),
                    reselect_every=getattr(args, "reselect_every", 1), **adaptive_of(args))  # fmt: skip
    if not method.endswith("-auto"):
        return OffloadConfig(budget_tokens=args.budget, selector=selector, admission="always", **fusions_of(args),
                             **capacity)  # fmt: skip
    return OffloadConfig(budget_tokens=args.budget, selector=selector, admission="auto",
                         device_memory_gib=args.admission_gib, graph_scope=getattr(args, "graph_scope", "layer"),
                         **fusions_of(args), **capacity)  # fmt: skip


def adaptive_of(args) -> dict:
    """OffloadConfig.max_budget_tokens and missed_mass_target for ``--max-budget`` and ``--missed-mass-target``
    (the adaptive budget of every OffloadCache method but ``headwise-copy``; none where they are not given), and
    ``lookahead=True`` for ``--lookahead on``."""
    cap, target = getattr(args, "max_budget", None), getattr(args, "missed_mass_target", None)
    ahead = {"lookahead": True} if getattr(args, "lookahead", "off") == "on" else {}
    return ahead if cap is None and target is None else {"max_budget_tokens": cap, "missed_mass_target": target,
                                                        **ahead}


def fusions_of(args) -> dict:
    """OffloadConfig.fused_norms, fused_rotary and fused_projections for ``--fused-norms``, ``--fused-rotary`` and
    ``--fused-projections`` (auto: None, on: True, off: False)."""
    setting = {"auto": None, "on": True, "off": False}
    names = ("fused_norms", "fused_rotary", "fused_projections")
    return {name: setting[getattr(args, name, "auto")] for name in names}


def device_free_bytes(device: torch.device) -> int | None:
    """Device memory this process may still allocate (CUDA: the free memory, and under ``--cap-gib`` no more than the
    process's memory fraction leaves), else ``None``: what an admitting cache of the next configuration may take."""
    from hf_offload.store.host import process_headroom_bytes

    return process_headroom_bytes(device) if device.type == "cuda" else None


def predict(method: str, shape, context: int, batch: int, config: OffloadConfig, layer_kv_bytes: int,
            n_rep: int, device_free: int | None = None) -> dict:  # fmt: skip
    """Predicted cache bytes of ``method`` holding ``context`` tokens per sequence.

    Returns:
        ``device_bytes`` and ``host_bytes`` of the cache (the planner's numbers where it models the method),
        ``transient_device_bytes`` (the largest extra allocation during a step: the planner's
        ``step_transient_bytes`` for dynamic and static, an estimate for hf-offloaded), ``step_transient_bytes``
        (where the planner predicts it: counted in the predicted peak) and ``source``.
    """
    if method in OFFLOAD_METHODS:
        p = plan(shape, context, batch, "offload", config, device_free_bytes=device_free)
        return {"source": "hf_offload.planner.plan(method='offload')", "device_bytes": p.device_bytes,
                "device_kv_bytes": p.device_kv_bytes + p.device_summary_bytes, "host_bytes": p.host_reserved_bytes,
                "host_kv_bytes": p.host_kv_bytes, "admitted_kv_bytes": p.admitted_kv_bytes,
                "admitted_reserved_bytes": p.admitted_reserved_bytes, "transient_device_bytes": 0}  # fmt: skip
    dense = plan(shape, context, batch, "static" if method == "static" else "dense")
    if method == "hf-offloaded":
        # Whole KV on the host; on the device the prefetched layer and the one being updated (plus its concatenation).
        return {"source": "estimate: the planner's dense KV on the host, two layers on the device",
                "device_bytes": 2 * layer_kv_bytes, "host_bytes": dense.device_kv_bytes,
                "host_kv_bytes": dense.device_kv_bytes,
                "transient_device_bytes": (1 + n_rep) * layer_kv_bytes}  # fmt: skip
    # dynamic: a step concatenates a layer's K and V anew; static: SDPA repeats one layer's K and V to every query
    # head (the planner's step_transient_bytes, part of the predicted peak).
    return {"source": f"hf_offload.planner.plan(method={dense.method!r})", "device_bytes": dense.device_bytes,
            "host_bytes": 0, "host_kv_bytes": 0, "step_transient_bytes": dense.step_transient_bytes,
            "transient_device_bytes": dense.step_transient_bytes}  # fmt: skip


def fit_problem(method: str, pred: dict, device: torch.device, args, pinned_round: int = 0) -> str | None:
    """Why the prediction says this configuration cannot fit device or host memory, or ``None``."""
    if device.type == "cuda":
        free = device_free_bytes(device)
        # Admitted blocks stay on the device only while they fit: the cache sends them back to host memory first.
        kept = pred["device_bytes"] - pred.get("admitted_reserved_bytes", 0)
        need = kept + pred["transient_device_bytes"] + int(args.device_margin_gib * GIB)
        if need > free:
            return f"predicted not to fit device memory: {need / GIB:.1f} GiB needed, {free / GIB:.1f} GiB free"
    host_need = pred["host_bytes"] + pinned_round
    if device.type != "cuda":  # dense caches live in host memory too
        host_need += pred["device_bytes"] + pred["transient_device_bytes"]
    free_host = host_free_bytes()
    if host_need and free_host is not None and host_need + int(args.host_margin_gib * GIB) > free_host:
        return f"predicted not to fit host memory: {host_need / GIB:.1f} GiB needed, {free_host / GIB:.1f} GiB free"
    return None


# ------------------------------------------------------------------------------------------------------ decoding
def decode(model, cache, kw: str, ids: torch.Tensor, start: int, n: int, mask: torch.Tensor, clock=None):
    """``n`` greedy decode steps through the model's forward, one new token per sequence, from position ``start``.

    Args:
        model: the model.
        cache: its cache, holding ``start`` tokens per sequence.
        kw: the forward's cache argument name.
        ids: the next input token per sequence, ``[batch, 1]``.
        start: position of the first new token.
        n: steps.
        mask: all-ones padding mask, ``[batch, >= start + n]``.
        clock: a :class:`Clock` marked after every step, or ``None``.

    Returns:
        The token after the last step, ``[batch, 1]``.
    """
    batch = ids.shape[0]
    for i in range(n):
        pos = start + i
        out = model(input_ids=ids, position_ids=torch.full((batch, 1), pos, device=ids.device),
                    attention_mask=mask[:, : pos + 1], use_cache=True, logits_to_keep=1, **{kw: cache})  # fmt: skip
        ids = out.logits[:, -1:].argmax(-1)
        if clock is not None:
            clock.mark()
    return ids


def profile_host(model, cache, kw: str, ids: torch.Tensor, start: int, n: int, mask: torch.Tensor,
                 device: torch.device, path: Path) -> None:
    """Decode ``n`` more steps under :mod:`cProfile` (host time only; the profiler's own cost inflates every call)
    and write where the host time goes to ``path``: the functions by cumulative time, and what the seals of full
    blocks (``_seal``) and the steps after a layer graph's replay call. ``mask`` must hold ``start + n`` positions."""
    import cProfile
    import pstats

    if mask.shape[1] < start + n:
        print(f"--profile-seal: {n} steps do not fit the context ({mask.shape[1] - start} left); skipped")
        return
    profiler = cProfile.Profile()
    sync(device)
    t0 = time.perf_counter()
    profiler.enable()
    decode(model, cache, kw, ids, start, n, mask)
    profiler.disable()
    host_s = time.perf_counter() - t0
    sync(device)
    text = io.StringIO()
    text.write(f"{n} decode steps from position {start} under cProfile: {host_s * 1e3:.1f} ms of host time "
               f"(wall until the device finished: {(time.perf_counter() - t0) * 1e3:.1f} ms)\n")  # fmt: skip
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats(60)
    stats.print_callees(r"_seal|finish_step|_run_decoder_layer")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())
    print(f"host profile of {n} steps -> {path}")


def profile_kernels(model, cache, kw: str, ids: torch.Tensor, start: int, n: int, mask: torch.Tensor,
                    device: torch.device) -> dict | None:
    """Decode ``n`` more steps under :mod:`torch.profiler` and return the device time per step by kernel name
    (``device_us_per_step`` all together; ``kernels``, longest first: launches and microseconds per step), or
    ``None`` where there is no CUDA device or the steps do not fit ``mask``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if device.type != "cuda" or mask.shape[1] < start + n:
        return None
    sync(device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode(model, cache, kw, ids, start, n, mask)
        sync(device)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        entry = kernels.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.device_time
    rows = sorted(({"kernel": name[:160], "launches_per_step": c / n, "us_per_step": us / n}
                   for name, (c, us) in kernels.items()), key=lambda r: -r["us_per_step"])  # fmt: skip
    return {"steps": n, "device_us_per_step": sum(r["us_per_step"] for r in rows), "kernels": rows}


def make_cache(method: str, model, context: int, args, device: torch.device, config: OffloadConfig | None = None):
    """A fresh cache of ``method`` (an OffloadCache one with ``config``, from :func:`offload_config`); returns
    ``(cache, transfer path used by decode steps or None)``."""
    from transformers import DynamicCache, StaticCache

    if method == "dynamic":
        return DynamicCache(config=model.config), None
    if method == "static":
        return StaticCache(config=model.config, max_cache_len=context), None
    if method == "hf-offloaded":
        return DynamicCache(config=model.config, offloading=True), None
    capacity = getattr(args, "decode_capacity", None)
    attention = getattr(args, "decode_attention", "auto")
    every = getattr(args, "reselect_every", 1)
    adaptive = adaptive_of(args)
    if method in ("solohead", "quantkey"):
        graphs = {"cuda_graphs": False} if getattr(args, "cuda_graphs", "default") == "off" else {}
        return OffloadCache(model, budget_tokens=args.budget, selector=selector_of(method, args), transfer="auto",
                            admission="always",
                            decode_capacity_blocks=capacity, decode_attention=attention, reselect_every=every,
                            **graphs, **fusions_of(args), **adaptive), "auto"  # fmt: skip
    if method in ("solohead-graphs", "quantkey-graphs"):
        selector = selector_of(method, args)
        return OffloadCache(model, budget_tokens=args.budget, selector=selector, transfer="auto", cuda_graphs=True,
                            admission="always",
                            decode_capacity_blocks=capacity, decode_attention=attention, reselect_every=every,
                            graph_scope=getattr(args, "graph_scope", "layer"),
                            **fusions_of(args), **adaptive), "auto"  # fmt: skip
    if method in ("solohead-auto", "quantkey-auto", "defaults"):
        return OffloadCache(model, config=config or offload_config(method, args)), "auto"

    # headwise-copy decodes through transfer='torch'. Where the kernels run, the fill writes through them (the
    # torch path writes host blocks with the CPU, far slower) and the layers switch to the torch path before the
    # first decode step; host contents, block table and summaries are the same either way.
    fill_kernel = kernels_available(device)
    cache = OffloadCache(model, budget_tokens=args.budget, selector="headwise", admission="always",
                         transfer="kernel" if fill_kernel else "torch")  # fmt: skip
    return cache, "torch"


def fill_dense(cache, batch: int, tokens: int, layers: int, kv_heads: int, head_dim: int, device) -> None:
    """Write ``tokens`` random bf16 tokens per sequence into every layer of a transformers cache, one
    ``cache.update`` per layer."""
    g = torch.Generator(device=device).manual_seed(0)
    for idx in range(layers):
        k = torch.randn(batch, kv_heads, tokens, head_dim, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(batch, kv_heads, tokens, head_dim, device=device, dtype=torch.bfloat16, generator=g)
        cache.update(k, v, idx)
        del k, v


def seal_warmup(method: str, args, device: torch.device, config: OffloadConfig | None) -> int:
    """Warm-up steps added for a cache that captures CUDA graphs: a block and two tokens, so that the first seal,
    which captures the seal's graphs (seconds at long contexts), falls in the warm-up and not in the timed steps."""
    if method not in OFFLOAD_METHODS or device.type != "cuda" or getattr(args, "cuda_graphs", "default") == "off":
        return 0
    block = config.block_tokens if config is not None else OffloadConfig(budget_tokens=args.budget).block_tokens
    return block + 2


def run_config(model, env: dict, method: str, context: int, batch: int, args,
               config: OffloadConfig | None = None) -> dict:  # fmt: skip
    """Fill a cache of ``method`` (an OffloadCache one with ``config``) with ``context - warmup - steps`` tokens per
    sequence (random, or replayed from ``env["recording"]``), decode warm-up and timed steps (so the last step attends
    to at most ``context`` tokens; with a recording, inside :meth:`benchmarks.workload.Replay.hooks`) and return the
    measurements."""
    device, kw, shape = env["device"], env["kw"], env["shape"]
    cfg = model.config
    layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, env["head_dim"]
    cuda = device.type == "cuda"
    profiled = args.profile_seal + args.profile_kernels if method in OFFLOAD_METHODS else 0
    warmup = args.warmup + seal_warmup(method, args, device, config)
    if context - warmup - args.steps - profiled < 1:  # a context too short for the seal's warm-up: without it
        warmup = args.warmup
    fill_tokens = context - warmup - args.steps - profiled
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else None
    row: dict = {"method": method, "context": context, "batch": batch, "kv_tokens_start": fill_tokens,
                 "workload": workload_row(env)}  # fmt: skip
    recording = env.get("recording")
    replay = (Replay(recording, model.config, batch, fill_tokens, device, dtype=model.dtype) if recording is not None
              else None)  # fmt: skip
    with torch.inference_mode(), contextlib.ExitStack() as replaying:
        cache, transfer = make_cache(method, model, context, args, device, config)
        if method in OFFLOAD_METHODS and getattr(args, "seal_graphs", "on") == "off":
            for layer in cache.offload_layers:
                layer.graphs.seal_graphs = False  # every seal op by op (the comparison)
        sync(device)
        t0 = time.perf_counter()
        if method in OFFLOAD_METHODS:
            torch.manual_seed(0)  # the random values: the same KV for every OffloadCache method
            cache.reserve(context)  # summaries for the last step's length, allocated once (no growth, no fragments)
            if replay is not None:
                replay.fill(cache)
            else:
                fill_random(cache, batch, fill_tokens, kv_heads, head_dim, device)
            sync(device)
            row["fill_transfer"] = "kernel" if cache.offload_layers[0].execution.use_kernels else "torch"
            if transfer == "torch":
                for layer in cache.offload_layers:
                    layer.use_torch_transfer()
            row["transfer"] = "kernel" if cache.offload_layers[0].execution.use_kernels else "torch"
        elif replay is not None:
            replay.fill(cache)
            sync(device)
        else:
            fill_dense(cache, batch, fill_tokens, layers, kv_heads, head_dim, device)
            sync(device)
        row["fill_s"] = time.perf_counter() - t0
        if cuda:  # where the peak comes from: the fill, or the decode steps (graph pools included)
            row["fill_peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if replay is not None:  # every decode step from here on attends with the recorded step's query and key
            replaying.enter_context(replay.hooks(model))
        g = torch.Generator(device=device).manual_seed(1)
        ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device, generator=g)
        mask = torch.ones(batch, context, dtype=torch.long, device=device)
        pos = fill_tokens
        warm_s = []
        for _ in range(warmup):
            sync(device)
            t0 = time.perf_counter()
            ids = decode(model, cache, kw, ids, pos, 1, mask)
            sync(device)
            warm_s.append(time.perf_counter() - t0)
            pos += 1
        steps = args.steps
        if warm_s and args.config_seconds:
            steps = min(args.steps, max(args.min_steps, math.ceil(args.config_seconds / warm_s[-1])))
        if method in OFFLOAD_METHODS:
            cache.reset_stats()
        clock = Clock(device)
        clock.mark()
        ids = decode(model, cache, kw, ids, pos, steps, mask, clock)
        spans = clock.spans_s()
        host_spans = clock.host_spans_s()
        sync(device)
        pos += steps
        timed_s = sum(spans)
        step_s = timed_s / steps
        row.update(
            warmup_steps=warmup, warmup_step_s=warm_s, steps=steps, kv_tokens_end=pos, timed_s=timed_s,
            step_ms=step_s * 1e3, step_ms_median=sorted(spans)[len(spans) // 2] * 1e3,
            step_ms_each=[round(x * 1e3, 3) for x in spans], host_ms_each=[round(x * 1e3, 3) for x in host_spans],
            tokens_per_s=batch / step_s, ms_per_output_token=step_s * 1e3 / batch,
            peak_device_bytes=max(row["fill_peak_device_bytes"], torch.cuda.max_memory_allocated(device)) if cuda
            else None,
            decode_peak_device_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
            reserved_device_bytes=torch.cuda.memory_reserved(device) if cuda else None,
            device_bytes_before=base,
        )  # fmt: skip
        stats = None
        if method in OFFLOAD_METHODS:
            stats = cache.stats()
            stats.pop("layers")
            row["cache_device_bytes"] = stats["device_kv_bytes"] + stats["device_summary_bytes"]
            row["host_bytes"] = stats["host_reserved_bytes"]
            row["host_kv_bytes"] = stats["host_kv_bytes"]
            row["hit_rate"] = stats["hit_rate"]
            # The estimated attention share the selection holds (selectors with an estimate of the rest: tail_bits).
            row["selected_mass"] = None if stats["tail_share"] is None else 1.0 - stats["tail_share"]
            # The budget the decode steps used (sealed tokens attended per sequence; the open block aside) and the
            # accuracy certificate (the estimated share of attention left out), for fixed and adaptive budgets.
            blocks = stats["attended_blocks"]
            row["attended_tokens"] = None if blocks is None else blocks * cache.config.block_tokens
            row["missed_mass"] = stats["missed_mass"]
            row["stats"] = stats
            row["admitted_kv_bytes"] = sum(layer.blocks.host.used_bytes_on(True) for layer in cache.offload_layers
                                           if layer.is_initialized)  # fmt: skip
            recalled_per_step = stats["decode_recalled_bytes"] / steps
            pcie_per_step = stats["decode_host_bytes"] / steps  # blocks admitted to the device are not PCIe traffic
        else:
            on_device, elsewhere = tensor_bytes(cache, device)
            row["cache_device_bytes"], row["host_bytes"], row["host_kv_bytes"] = on_device, elsewhere, elsewhere
            row["hit_rate"] = row["selected_mass"] = row["attended_tokens"] = row["missed_mass"] = None
            # transformers' offloading copies every layer's whole KV to the device (and back) at every step.
            kv_mid = fill_tokens + warmup + (steps + 1) / 2
            pcie_per_step = layers * batch * kv_mid * 2 * kv_heads * head_dim * 2 if method == "hf-offloaded" else 0
            recalled_per_step = pcie_per_step
        owned, _ = pinned_allocator_bytes()
        row["pinned_allocator_bytes"] = owned
        row["recalled_bytes_per_step"] = recalled_per_step
        row["recalled_gbps"] = recalled_per_step / step_s / 1e9
        row["host_recalled_bytes_per_step"] = pcie_per_step
        row["pcie_gbps"] = pcie_per_step / step_s / 1e9
        kv_mid = fill_tokens + warmup + (steps + 1) / 2  # KV tokens per sequence, mean over the timed steps
        row["roofline"] = roofline(method, env, batch, kv_mid, pcie_per_step, step_s, layers, kv_heads, head_dim,
                                   stats, recalled_per_step - pcie_per_step)  # fmt: skip
        cfg_off = cache.config if method in OFFLOAD_METHODS else OffloadConfig(budget_tokens=args.budget)
        held = context if method == "static" else pos
        pred = predict(method, shape, held, batch, cfg_off, env["layer_kv_bytes"](batch, held), env["n_rep"])
        predicted_peak = (base or 0) + pred["device_bytes"] + pred.get("step_transient_bytes", 0)
        row["prediction"] = {
            **pred,
            "kv_tokens": held,
            "predicted_peak_device_bytes": predicted_peak if cuda else None,
            "peak_over_predicted": row["peak_device_bytes"] / predicted_peak if cuda else None,
            "device_matches": row["cache_device_bytes"] == pred.get("device_kv_bytes", pred["device_bytes"]),
            "host_matches": row["host_bytes"] == pred["host_bytes"],
            "host_over_predicted": row["host_bytes"] / pred["host_bytes"] if pred["host_bytes"] else None,
        }
        if args.profile_seal and method in OFFLOAD_METHODS:
            profile_host(model, cache, kw, ids, pos, args.profile_seal, mask, device,
                         Path(args.out).with_suffix(f".{method}.{context}.{batch}.host_profile.txt"))  # fmt: skip
        if args.profile_kernels and method in OFFLOAD_METHODS:
            row["kernel_profile"] = profile_kernels(model, cache, kw, ids, pos + args.profile_seal,
                                                    args.profile_kernels, mask, device)  # fmt: skip
            top = (row["kernel_profile"] or {}).get("kernels", [])[:12]
            for entry in top:
                print(f"    {entry['us_per_step']:9.1f} us/step {entry['launches_per_step']:7.1f} x  "
                      f"{entry['kernel'][:90]}")
        if replay is not None:
            row["workload_steps_replayed"] = replay.step
        del cache, ids, mask
    if method in OFFLOAD_METHODS:
        disable_offload_attention(model)
    return row


def roofline(method: str, env: dict, batch: int, kv_tokens: float, pcie_per_step: float, step_s: float, layers: int,
             kv_heads: int, head_dim: int, offload_stats: dict | None = None,
             device_recall_per_step: float = 0.0) -> dict:  # fmt: skip
    """Lower bound of one step: weights and attended KV read once from device memory, missed bytes over PCIe.

    OffloadCache (``offload_stats``: its ``stats()``) attends to ``budget_tokens`` per sequence and layer, and copies
    the recalled blocks that ``admission="auto"`` keeps on the device (``device_recall_per_step`` bytes, read and
    written in device memory); the dense methods attend to the whole KV. The block summaries the selector reads
    each step (all of ``device_summary_bytes``) are reported apart (``summary_bytes``,
    ``roofline_with_summaries_ms``).
    """
    bw = env["bandwidth"]
    per_token = 2 * kv_heads * head_dim * 2
    summary_bytes = 0
    if offload_stats is not None:
        budget = env["budget_tokens"]
        kv_read = min(budget, kv_tokens) * batch * layers * per_token
        summary_bytes = offload_stats["device_summary_bytes"]
    else:
        kv_read = kv_tokens * batch * layers * per_token
    weights = env["weights_per_step"]
    # hbm_bytes_per_s counts a device copy's bytes read plus written: a device-side recall of X bytes moves 2X.
    hbm_s = (weights + kv_read + 2 * device_recall_per_step) / bw["hbm_bytes_per_s"]
    pcie_s = pcie_per_step / bw["h2d_pinned_bytes_per_s"]
    bound = hbm_s + pcie_s
    with_summaries = bound + summary_bytes / bw["hbm_bytes_per_s"]
    return {
        "weight_bytes": weights, "kv_read_bytes": int(kv_read), "pcie_bytes": int(pcie_per_step),
        "device_recall_bytes": int(device_recall_per_step),
        "summary_bytes": summary_bytes, "hbm_ms": hbm_s * 1e3, "pcie_ms": pcie_s * 1e3, "roofline_ms": bound * 1e3,
        "step_over_roofline": step_s / bound, "roofline_with_summaries_ms": with_summaries * 1e3,
        "step_over_roofline_with_summaries": step_s / with_summaries,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------------------- e2e
def run_e2e(model, env: dict, args) -> dict:
    """Prefill a random prompt of ``--e2e-context`` tokens at batch 1 (chunks of ``--e2e-prefill-chunk``), then
    decode ``--e2e-steps`` tokens, with ``DynamicCache`` and with ``OffloadCache`` (``--e2e-selector``: the library's
    default selector unless set; every other setting the library's default, so every sealed block goes to the host).

    The prefill is exact with both caches, so the first generated token should agree (bf16 rounding of the two
    attention paths can still flip a near tie); ``first_token_identical`` reports it."""
    from transformers import DynamicCache

    device, kw = env["device"], env["kw"]
    cuda = device.type == "cuda"
    n = args.e2e_context
    chunk = args.e2e_prefill_chunk or n
    g = torch.Generator(device=device).manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, n), device=device, generator=g)
    mask = torch.ones(1, n + args.e2e_steps + 1, dtype=torch.long, device=device)
    runs = []
    for method in ("dynamic", "offload"):
        release(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():
            if method == "dynamic":
                cache = DynamicCache(config=model.config)
            else:
                cache = OffloadCache(model, budget_tokens=args.budget, selector=args.e2e_selector)
            sync(device)
            t0 = time.perf_counter()
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                out = model(input_ids=prompt[:, s:e], position_ids=torch.arange(s, e, device=device)[None],
                            attention_mask=mask[:, :e], use_cache=True, logits_to_keep=1, **{kw: cache})  # fmt: skip
            first = out.logits[:, -1:].argmax(-1)
            sync(device)
            prefill_s = time.perf_counter() - t0
            clock = Clock(device)
            clock.mark()
            decode(model, cache, kw, first, n, args.e2e_steps, mask, clock)
            spans = clock.spans_s()
            run = {
                "method": method, "prefill_s": prefill_s, "prefill_tokens_per_s": n / prefill_s,
                # The first decode step after a prefill pays one-time costs: reported apart.
                "decode_first_step_ms": spans[0] * 1e3 if spans else None,
                "decode_step_ms": sum(spans[1:]) / len(spans[1:]) * 1e3 if len(spans) > 1 else None,
                "first_token": int(first),
                "peak_device_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            }  # fmt: skip
            if method == "offload":
                stats = cache.stats()
                run["host_kv_bytes"], run["hit_rate"] = stats["host_kv_bytes"], stats["hit_rate"]
                run["selector"] = args.e2e_selector
            del cache, out
        if method == "offload":
            disable_offload_attention(model)
        runs.append(run)
        print(f"e2e {method:9s} prefill {n:,} tokens {prefill_s:7.2f} s ({n / prefill_s:8.0f} tok/s); decode "
              f"{run['decode_step_ms'] or 0:7.1f} ms/step; first token {run['first_token']}", flush=True)  # fmt: skip
    release(device)
    return {"context": n, "batch": 1, "prefill_chunk": chunk, "decode_steps": args.e2e_steps, "runs": runs,
            "first_token_identical": len({r["first_token"] for r in runs}) == 1}  # fmt: skip


# ------------------------------------------------------------------------------------------------------------ main
HEADER = (f"{'method':13s} {'context':>8s} {'batch':>5s} {'steps':>5s} {'tok/s':>9s} {'step ms':>9s} "
          f"{'peak GiB':>8s} {'pred GiB':>8s} {'host GiB':>8s} {'PCIe GB/s':>9s} {'hit':>5s} {'roof ms':>8s} "
          f"{'x roof':>6s} {'pk/pred':>7s} {'sel mass':>8s} workload")  # fmt: skip


def format_row(r: dict) -> str:
    """One printed table line."""

    def gib(x):
        return "-" if x is None else f"{x / GIB:.1f}"

    hit = "-" if r.get("hit_rate") is None else f"{r['hit_rate']:.2f}"
    mass = "-" if r.get("selected_mass") is None else f"{r['selected_mass']:.3f}"
    p = r["prediction"]
    ratio = "-" if p["peak_over_predicted"] is None else f"{p['peak_over_predicted']:.2f}"
    return (f"{r['method']:13s} {r['context']:8d} {r['batch']:5d} {r['steps']:5d} {r['tokens_per_s']:9.1f} "
            f"{r['step_ms']:9.1f} {gib(r['peak_device_bytes']):>8s} {gib(p['predicted_peak_device_bytes']):>8s} "
            f"{gib(r['host_bytes']):>8s} {r.get('pcie_gbps', r['recalled_gbps']):9.2f} {hit:>5s} "
            f"{r['roofline']['roofline_ms']:8.1f} "
            f"{r['roofline']['step_over_roofline']:6.1f} {ratio:>7s} {mass:>8s} "
            f"{r.get('workload', RANDOM_WORKLOAD)['kind']}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-8b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072],
                        help="KV tokens per sequence at the last decode step")  # fmt: skip
    parser.add_argument("--batches", nargs="+", default=["auto"],
                        help="batch sizes, or 'auto': 1, 2, 4, ... while predicted to fit (and no OOM)")  # fmt: skip
    parser.add_argument("--max-batch", type=int, default=256, help="largest batch of an auto sweep")
    parser.add_argument("--method-batches", nargs="+", default=[], metavar="METHOD=B,B,...",
                        help="batch sizes of one method in place of --batches, e.g. 'dynamic=4,8,12' "
                        "'quantkey-auto=12' (or 'METHOD=auto'): each method at its own batches in one run")
    parser.add_argument("--methods", nargs="*", choices=METHODS, default=METHODS,
                        help="methods to sweep (none: only --e2e)")  # fmt: skip
    parser.add_argument("--budget", type=int, default=2048, help="OffloadCache budget_tokens")
    parser.add_argument("--max-budget", type=int, default=None,
                        help="max_budget_tokens of the OffloadCache methods (with --missed-mass-target: the adaptive "
                        "budget's cap; headwise-copy keeps a fixed budget)")  # fmt: skip
    parser.add_argument("--lookahead", choices=["off", "on"], default="off",
                        help="OffloadConfig.lookahead of the OffloadCache methods (inside the whole-layer graphs "
                        "where they run)")  # fmt: skip
    parser.add_argument("--missed-mass-target", type=float, default=None,
                        help="missed_mass_target of the OffloadCache methods: a step leaving out more of the "
                        "estimated attention takes more blocks, up to --max-budget")  # fmt: skip
    parser.add_argument("--quantkey-selector", default="quantkey",
                        help="the selector of the quantkey* methods, with settings: e.g. 'quantkey[bits=4,tail_bits=2]' "
                             "(4-bit keys, the unselected blocks estimated from 2-bit values)")
    parser.add_argument("--decode-capacity", type=int, default=None,
                        help="decode_capacity_blocks of the OffloadCache methods (default: the cache's, 64 with CUDA "
                             "graphs; 1: the sealed blocks, one graph capture per seal)")
    parser.add_argument("--reselect-every", type=int, default=1,
                        help="reselect_every of the OffloadCache methods: decode steps choose their blocks every this "
                             "many steps, the others reuse that choice (1: every step)")
    parser.add_argument("--decode-attention", choices=("auto", "paged", "pool"), default="auto",
                        help="decode_attention of the OffloadCache methods ('paged': admitted blocks read in place; "
                             "'pool': every selected block copied into the slot pool first)")
    parser.add_argument("--cuda-graphs", choices=("default", "off"), default="default",
                        help="cuda_graphs of the quantkey and solohead methods: the OffloadConfig default, or False")
    parser.add_argument("--graph-scope", choices=("layer", "attention"), default="layer",
                        help="what a replayed CUDA graph covers (OffloadConfig.graph_scope)")
    parser.add_argument("--fused-norms", choices=("auto", "on", "off"), default="auto",
                        help="OffloadConfig.fused_norms (auto: on where Triton runs on CUDA)")
    parser.add_argument("--fused-rotary", choices=("auto", "on", "off"), default="auto",
                        help="OffloadConfig.fused_rotary (auto: on where Triton runs on CUDA)")
    parser.add_argument("--fused-projections", choices=("auto", "on", "off"), default="auto",
                        help="OffloadConfig.fused_projections (auto: on CUDA)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed decode steps per configuration (with CUDA graphs the first runs op by op and the "
                        "second captures, so the third is the first replay: the step --config-seconds divides by); "
                        "default 3, and 3 + --reselect-every where steps reuse selections (the choosing and the "
                        "reusing step capture their graphs in turn: four steps before both replay); an OffloadCache "
                        "with CUDA graphs takes a block and two tokens more, so that its first seal (which captures "
                        "the seal's graphs) is not timed")
    parser.add_argument("--steps", type=int, default=16, help="most timed decode steps per configuration")
    parser.add_argument("--min-steps", type=int, default=2, help="fewest timed decode steps per configuration")
    parser.add_argument("--config-seconds", type=float, default=3.0,
                        help="timed steps per configuration: about this many seconds (by the last warm-up step), "
                        "within [--min-steps, --steps]; 0: always --steps")  # fmt: skip
    parser.add_argument("--hf-offloaded-max-batch", type=int, default=4)
    parser.add_argument("--hf-offloaded-max-kv-gib", type=float, default=16.0,
                        help="skip hf-offloaded where its whole KV (copied both ways every step) exceeds this")
    parser.add_argument("--cap-gib", type=float, default=None,
                        help="limit the process to this much device memory (torch.cuda.set_per_process_memory_fraction)"
                             ", weights, caches and activations together, as a smaller GPU would (default: none)")
    parser.add_argument("--device-margin-gib", type=float, default=3.0, help="device memory kept free (activations)")
    parser.add_argument("--host-margin-gib", type=float, default=8.0, help="host memory kept free")
    parser.add_argument("--admission-gib", type=float, default=None,
                        help="device_memory_gib of the -auto methods: the bound on all their cache's device bytes "
                        "(default: none; the library admits into what the process may allocate)")  # fmt: skip
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="bytes per bandwidth copy (CUDA 1024, CPU 64)")
    parser.add_argument("--max-seconds", type=float, default=390.0,
                        help="wall budget of the run; configurations not started by then are skipped")  # fmt: skip
    parser.add_argument("--e2e", action="store_true", help="also one run with a real prefill at batch 1")
    parser.add_argument("--e2e-context", type=int, default=32768)
    parser.add_argument("--e2e-prefill-chunk", type=int, default=4096, help="0: the whole prompt in one forward")
    parser.add_argument("--e2e-steps", type=int, default=16)
    parser.add_argument("--e2e-selector", default=DEFAULT_SELECTOR,
                        help="the OffloadCache selector of --e2e (default: the library's, %(default)s)")
    parser.add_argument("--seal-graphs", choices=("on", "off"), default="on",
                        help="off: seal full blocks op by op after replayed decode steps (OffloadLayer.seal_graphs)")
    parser.add_argument("--profile-seal", type=int, default=0, metavar="STEPS",
                        help="after each OffloadCache configuration, decode this many more steps under cProfile (at "
                        "least block_tokens to include a seal) and write where the host time goes next to --out")
    parser.add_argument("--profile-kernels", type=int, default=0, metavar="STEPS",
                        help="after each OffloadCache configuration, decode this many more steps under torch.profiler "
                        "and record the device time per step by kernel in its row (CUDA)")
    parser.add_argument("--device", default="auto", help="auto (CUDA where available), cpu, cuda, ...")
    parser.add_argument("--workload", default="random", metavar="random|recorded:PATH",
                        help="the KV and queries of the decode: 'random' (default; random KV, the worst case for a "
                        "sparse cache) or 'recorded:PATH', a decode recorded by benchmarks/workload.py and replayed at "
                        "the shape (the model's rope_theta becomes the recording's)")  # fmt: skip
    parser.add_argument("--out", default="results/decode/bench_decode.json")
    parser.add_argument("--isolate", action="store_true",
                        help="run each (context, method) sweep, and --e2e, in a fresh process and merge their JSON: "
                        "no pinned or device memory carries over between sweeps")  # fmt: skip
    args = parser.parse_args(argv)
    if args.batches != ["auto"]:
        args.batches = [int(b) for b in args.batches]
    args.method_batches = _parse_method_batches(parser, args.method_batches)
    unused = [m for m in args.method_batches if m not in args.methods]
    if unused:
        parser.error(f"--method-batches names {', '.join(unused)}, which --methods does not run: add it to --methods "
                     "or drop its batches")  # fmt: skip
    if args.reselect_every < 1:
        parser.error(f"--reselect-every must be a positive integer, got {args.reselect_every}")
    try:
        load_workload(args.workload)  # a bad file fails here, before any model is built
    except (ValueError, FileNotFoundError) as err:
        parser.error(f"--workload: {err}")
    if args.warmup is None:
        args.warmup = 3 if args.reselect_every == 1 else 3 + args.reselect_every
    for context in args.contexts:
        if context - args.warmup - args.steps < 1:
            parser.error(f"context {context} must exceed --warmup + --steps = {args.warmup + args.steps}")
    return args


def _parse_method_batches(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, list]:
    """``--method-batches`` as {method: [batch, ...] or ["auto"]}; a malformed item is a usage error."""
    out: dict[str, list] = {}
    for item in items:
        method, sep, value = item.partition("=")
        if not sep or method not in METHODS:
            parser.error(f"--method-batches {item!r}: write METHOD=B,B,... with METHOD one of {', '.join(METHODS)}")
        if value == "auto":
            out[method] = ["auto"]
            continue
        try:
            batches = [int(b) for b in value.split(",")]
        except ValueError:
            batches = []
        if not batches or min(batches) < 1:
            parser.error(f"--method-batches {item!r}: the batches must be positive integers, e.g. {method}=4,8,12")
        out[method] = batches
    return out


def _batches_of(args: argparse.Namespace, method: str) -> list:
    """The batch sizes (or ["auto"]) one method sweeps: its ``--method-batches`` entry, else ``--batches``."""
    return args.method_batches.get(method, args.batches)


def _method_batches_argv(args: argparse.Namespace, method: str) -> list[str]:
    """``--method-batches`` of one isolated sweep: its method's entry, if the parent has one."""
    batches = args.method_batches.get(method)
    return [] if batches is None else ["--method-batches", f"{method}={','.join(map(str, batches))}"]


def _child_argv(args: argparse.Namespace) -> list[str]:
    """The command-line options every isolated sweep shares with the parent run (``--method-batches`` goes to
    each sweep for its own method: :func:`_method_batches_argv`)."""
    out = ["--shape", args.shape, "--batches", *map(str, args.batches), "--max-batch", str(args.max_batch),
           "--budget", str(args.budget), "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--min-steps", str(args.min_steps), "--config-seconds", str(args.config_seconds),
           "--hf-offloaded-max-batch", str(args.hf_offloaded_max_batch),
           "--hf-offloaded-max-kv-gib", str(args.hf_offloaded_max_kv_gib),
           "--device-margin-gib", str(args.device_margin_gib), "--host-margin-gib", str(args.host_margin_gib),
           "--device", args.device, "--workload", args.workload]  # fmt: skip
    if args.admission_gib is not None:
        out += ["--admission-gib", str(args.admission_gib)]
    # The settings of the OffloadCache methods (each child would otherwise run the defaults).
    out += ["--quantkey-selector", args.quantkey_selector, "--decode-attention", args.decode_attention,
            "--cuda-graphs", args.cuda_graphs, "--graph-scope", args.graph_scope, "--fused-norms", args.fused_norms,
            "--fused-rotary", args.fused_rotary, "--fused-projections", args.fused_projections,
            "--seal-graphs", args.seal_graphs, "--reselect-every", str(args.reselect_every),
            "--profile-seal", str(args.profile_seal), "--profile-kernels", str(args.profile_kernels),
            "--lookahead", args.lookahead]  # fmt: skip
    if args.max_budget is not None:
        out += ["--max-budget", str(args.max_budget)]
    if args.missed_mass_target is not None:
        out += ["--missed-mass-target", str(args.missed_mass_target)]
    if args.decode_capacity is not None:
        out += ["--decode-capacity", str(args.decode_capacity)]
    if args.admission_gib is not None:
        out += ["--admission-gib", str(args.admission_gib)]
    if args.bandwidth_mib is not None:
        out += ["--bandwidth-mib", str(args.bandwidth_mib)]
    return out


def run_isolated(args: argparse.Namespace, t_start: float) -> int:
    """``--isolate``: one process per (context, method) sweep (and one for ``--e2e``), JSON merged into ``--out``.

    Each child writes its own JSON next to ``--out``; the merged file takes the first child's metadata, model and
    bandwidths, every child's runs and skipped configurations (with the child's file name), and the e2e run.
    """
    import subprocess
    import tempfile

    out = Path(args.out)
    merged: dict | None = None
    jobs = [(c, m) for c in args.contexts for m in args.methods if m != "hf-offloaded"]
    jobs += [(c, "hf-offloaded") for c in args.contexts if "hf-offloaded" in args.methods]
    if args.e2e:
        jobs.append((None, "e2e"))
    with tempfile.TemporaryDirectory() as tmp:
        for n, (context, method) in enumerate(jobs):
            left = args.max_seconds - (time.perf_counter() - t_start)
            child = Path(tmp) / f"part{n:03d}.json"
            if method == "e2e":
                extra = ["--e2e", "--e2e-context", str(args.e2e_context), "--e2e-prefill-chunk",
                         str(args.e2e_prefill_chunk), "--e2e-steps", str(args.e2e_steps), "--e2e-selector",
                         args.e2e_selector, "--contexts",
                         str(max(args.contexts)), "--methods", "--max-seconds", f"{max(left, 0):.1f}"]  # fmt: skip
            else:
                extra = ["--contexts", str(context), "--methods", method, "--max-seconds", f"{max(left, 0):.1f}",
                         *_method_batches_argv(args, method)]  # fmt: skip
            if left <= 0:
                reason = "time budget (--max-seconds)"
                if merged is not None:
                    merged["skipped"].append({"method": method, "context": context, "batch": "auto", "reason": reason})
                continue
            cmd = [sys.executable, str(Path(__file__).resolve()), *_child_argv(args), *extra, "--out", str(child)]
            done = subprocess.run(cmd)
            if not child.exists():
                if merged is not None:
                    merged["skipped"].append({"method": method, "context": context, "batch": "auto",
                                              "reason": f"isolated process exited with status {done.returncode}"})
                continue
            data = json.loads(child.read_text())
            if merged is None:
                merged = {**data, "runs": [], "skipped": [], "e2e": None}
                merged["metadata"] = {**data["metadata"], "args": vars(args), "isolated": True}
                merged["methods"] = {m: method_note(m, args) for m in args.methods}
            merged["runs"] += data["runs"]
            if method == "e2e":
                merged["e2e"] = data.get("e2e")
            else:
                merged["skipped"] += data["skipped"]
            merged["elapsed_s"] = time.perf_counter() - t_start
            merged["complete"] = False
            write_results(str(out), merged)
    if merged is None:
        print("no isolated sweep produced results", file=sys.stderr)
        return 1
    merged["complete"] = True
    write_results(str(out), merged)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; returns 0."""
    t_start = time.perf_counter()
    args = parse_args(argv)
    if args.isolate:
        return run_isolated(args, t_start)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:  # the memory fraction takes an indexed device
        device = torch.device("cuda", torch.cuda.current_device())
    if args.cap_gib is not None:
        if not cuda:
            raise SystemExit("--cap-gib limits CUDA device memory: run on a CUDA device or leave it out.")
        total = torch.cuda.mem_get_info(device)[1]
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total), device)
    max_positions = max(args.contexts + ([args.e2e_context + args.e2e_steps + 1] if args.e2e else [])) + 16
    recording = load_workload(args.workload)
    t0 = time.perf_counter()
    model = build_model(args.shape, max_positions, device, rope_theta=recording.rope_theta if recording else None)
    sync(device)
    build_s = time.perf_counter() - t0
    cfg = model.config
    total_w, per_step_w = weight_bytes(model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = shape_from_config(cfg, dtype_bytes=2, weights_bytes=total_w)
    bandwidth = measure_bandwidths(device, (args.bandwidth_mib or (1024 if cuda else 64)) << 20)
    env = {
        "device": device, "kw": cache_kwarg(model), "shape": shape, "head_dim": head_dim, "bandwidth": bandwidth,
        "weights_per_step": per_step_w, "budget_tokens": args.budget,
        "n_rep": cfg.num_attention_heads // cfg.num_key_value_heads,
        "layer_kv_bytes": lambda batch, tokens: batch * tokens * shape.kv_bytes_per_token,
        "recording": recording,
    }  # fmt: skip
    workload = workload_row(env)
    if recording is not None:
        workload["recording"] = recording.describe()
        note = (f"decode-only: KV replayed from {workload['file']} (sha256 {workload['sha256'][:12]}..., recorded from "
                f"{workload['model']}; keys tiled to the context, the recorded queries and new keys, random values), "
                "no prefill")  # fmt: skip
    else:
        note = DECODE_ONLY
    print(f"{note}; {args.shape} shape, random bf16 weights ({total_w / GIB:.2f} GiB, {per_step_w / GIB:.2f} "
          f"GiB read per step) on {torch.cuda.get_device_name(device) if cuda else 'cpu'}; device copy "
          f"{bandwidth['hbm_bytes_per_s'] / 1e9:.0f} GB/s, pinned host-to-device "
          f"{bandwidth['h2d_pinned_bytes_per_s'] / 1e9:.1f} GB/s", flush=True)  # fmt: skip
    result = {
        "metadata": run_metadata(args, note=note + "; random weights", model_build_s=build_s, workload=workload,
                                 device=str(device),
                                 graph_scope=args.graph_scope, fused_norms=args.fused_norms,
                                 fused_rotary=args.fused_rotary,
                                 fused_projections=args.fused_projections, seal_graphs=args.seal_graphs,
                                 reselect_every=args.reselect_every),  # fmt: skip
        "decode_only": note,
        "workload": workload,
        "model": {"shape": args.shape, "family": SHAPES[args.shape]["family"], "planner_preset":
                  SHAPES[args.shape]["preset"], "config": SHAPES[args.shape]["config"], "weight_bytes": total_w,
                  "weight_bytes_read_per_step": per_step_w, "kv_bytes_per_token": shape.kv_bytes_per_token *
                  shape.full_layers},  # fmt: skip
        "methods": {m: method_note(m, args) for m in args.methods},
        "bandwidth": bandwidth,
        "roofline_note": "roofline_ms = (weights read per step + attended KV + 2 x recalled bytes of blocks kept on "
        "the device) / hbm_bytes_per_s + recalled bytes read from the host per step / h2d_pinned_bytes_per_s; "
        "attended KV: budget_tokens per sequence and layer for OffloadCache, the whole KV for the other methods; "
        "hf-offloaded recalls its whole KV every step; summary_bytes: the selector's summary buffers on the device "
        "(whole 256-block buffers)",
        "runs": [], "skipped": [], "e2e": None, "complete": False,
    }  # fmt: skip

    def save(final: bool = False) -> None:
        result["elapsed_s"] = time.perf_counter() - t_start
        result["complete"] = final
        if final:
            write_results(args.out, result)
        else:
            with contextlib.redirect_stdout(io.StringIO()):
                write_results(args.out, result)

    def over_budget() -> bool:
        return time.perf_counter() - t_start > args.max_seconds

    if args.e2e:
        if over_budget():
            result["skipped"].append({"method": "e2e", "reason": "time budget (--max-seconds)"})
        else:
            try:
                result["e2e"] = run_e2e(model, env, args)
            except (torch.cuda.OutOfMemoryError, MemoryError) as err:
                result["e2e"] = {"error": f"out of memory: {str(err).splitlines()[0]}"}
            except Exception:
                result["e2e"] = {"error": traceback.format_exc()}
            release(device)
        save()

    print(HEADER, flush=True)
    # transformers' offloading runs last: its pinned blocks (power-of-two sizes) would otherwise sit next to the
    # OffloadCache chunks that torch's pinned allocator keeps for reuse by the next configuration.
    order = [m for m in args.methods if m != "hf-offloaded"]
    phases = [(c, m) for c in args.contexts for m in order]
    if "hf-offloaded" in args.methods:
        phases += [(c, "hf-offloaded") for c in args.contexts]
    emptied = False
    for context, method in phases:
        method_batches = _batches_of(args, method)
        if method == "hf-offloaded" and not cuda:
            for batch in method_batches:
                reason = "needs CUDA (transformers' offloading uses CUDA streams)"
                result["skipped"].append({"method": method, "context": context, "batch": batch, "reason": reason})
            continue
        if method.endswith("-graphs") and not (cuda and kernels_available(device)):
            for batch in method_batches:
                reason = "needs CUDA and Triton (CUDA graphs replay the kernel transfer path)"
                result["skipped"].append({"method": method, "context": context, "batch": batch, "reason": reason})
            continue
        if method == "hf-offloaded" and not emptied:
            emptied = empty_host_cache()
        auto = method_batches == ["auto"]
        batches = method_batches if not auto else [2**i for i in range(args.max_batch.bit_length())
                                                   if 2**i <= args.max_batch]  # fmt: skip
        for batch in batches:
            skip = {"method": method, "context": context, "batch": batch}
            if over_budget():
                result["skipped"].append({**skip, "batch": "auto" if auto else batch,
                                          "reason": "time budget (--max-seconds)"})  # fmt: skip
                if auto:
                    break
                continue
            layer_kv = env["layer_kv_bytes"](batch, context)
            if method == "hf-offloaded":
                kv = layer_kv * cfg.num_hidden_layers
                if batch > args.hf_offloaded_max_batch or kv > args.hf_offloaded_max_kv_gib * GIB:
                    result["skipped"].append({**skip, "reason": f"hf-offloaded copies the whole KV ({kv / GIB:.1f} "
                                              "GiB) both ways every step: beyond --hf-offloaded-max-batch / "
                                              "--hf-offloaded-max-kv-gib"})  # fmt: skip
                    if auto:
                        break
                    continue
            off_cfg = offload_config(method, args) or OffloadConfig(budget_tokens=args.budget)
            pred = predict(method, shape, context, batch, off_cfg, layer_kv, env["n_rep"], device_free_bytes(device))
            # torch's pinned allocator rounds each hf-offloaded layer tensor up to a power of two.
            pinned_round = 0
            if method == "hf-offloaded":
                per_tensor = layer_kv // 2
                pinned_round = 2 * cfg.num_hidden_layers * (2 ** math.ceil(math.log2(per_tensor)) - per_tensor)
            problem = fit_problem(method, pred, device, args, pinned_round)
            if problem:
                result["skipped"].append({**skip, "reason": problem})
                save()
                if auto:
                    break
                continue
            try:
                row = run_config(model, env, method, context, batch, args, off_cfg)
            except (torch.cuda.OutOfMemoryError, MemoryError) as err:
                row = None
                reason = f"out of memory: {str(err).splitlines()[0][:300]}"
                if cuda:  # how full the device was when it failed (allocated, held by the allocator, peak)
                    reason += (f" [allocated {torch.cuda.memory_allocated(device) / GIB:.2f} GiB, reserved "
                               f"{torch.cuda.memory_reserved(device) / GIB:.2f} GiB, peak "
                               f"{torch.cuda.max_memory_allocated(device) / GIB:.2f} GiB]")  # fmt: skip
            except Exception:
                row = None
                reason = "error: " + traceback.format_exc()[-2000:]
            if method in OFFLOAD_METHODS:
                disable_offload_attention(model)
            release(device)
            if row is None:
                result["skipped"].append({**skip, "reason": reason})
                print(f"{method:13s} {context:8d} {batch:5d} {reason.splitlines()[0][:90]}", flush=True)
                save()
                if auto or reason.startswith("out of memory"):
                    break
                continue
            result["runs"].append(row)
            print(format_row(row), flush=True)
            save()
    save(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
