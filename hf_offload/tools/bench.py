"""``hf-offload bench``: decode speed of ``OffloadCache`` against ``DynamicCache`` on a random-weight model.

Builds a Llama-architecture model with random bf16 weights and the sizes of a named shape (``tiny``, or a preset of
``hf-offload plan``), fills each cache with ``--context`` random tokens of KV per sequence without running a prefill
(decode speed depends on the size of the KV, not on its values), then decodes ``--steps`` tokens through
``generate()``. Prints, per method: milliseconds per decode step, tokens per second (all sequences), device KV and
block summaries, host KV, the decode hit rate and the bytes recalled per step; ``--json OUT`` writes the same
numbers with the versions and the machine.

Examples::

    hf-offload bench                                                   # tiny shape, runs on a CPU in seconds
    hf-offload bench --shape llama-3.1-8b --context 32768 --batch 8 --budget 2048 --steps 32
    hf-offload bench --shape llama-3.2-1b --selector solohead headwise --json bench.json
    hf-offload bench --context 8192 --budget 1024 --set pool_tokens=2048 --set block_tokens=32
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

MIB = 1 << 20

# Model sizes per shape name. Apart from ``tiny``, the names and the KV geometry (layers, KV heads, head size) are
# those of ``hf_offload.planner.PRESETS``, so ``hf-offload plan`` predicts the bytes that ``hf-offload bench``
# measures; every shape is built as a Llama model (random weights: speed does not depend on them).
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
    "qwen2.5-coder-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                               rope_theta=1000000.0),
    "qwen2.5-coder-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936,
                               rope_theta=1000000.0),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, vocab_size=152064, rope_theta=1000000.0),
}  # fmt: skip


def fill_random(cache, batch: int, context: int, kv_heads: int, head_dim: int, device, chunk: int = 4096,
                dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    """Write ``context`` tokens of random keys and values into every layer of ``cache``, ``chunk`` tokens at a time.

    No model runs: each layer's ``update`` receives the random tensors directly, so an ``OffloadCache`` seals and
    offloads its blocks (and summarises them) exactly as during a prefill. The keys come from a generator seeded
    with 0 on ``device``, the values from torch's default generator (seed it for repeatable values).

    Args:
        cache: an :class:`~hf_offload.cache.OffloadCache`, or a ``transformers.DynamicCache`` built with the model's
            config (so that its layers exist).
        batch: sequences.
        context: tokens per sequence to write.
        kv_heads: KV heads per layer.
        head_dim: head size.
        device: the model's compute device (``torch.device`` or a name).
        chunk: tokens per ``update`` call.
        dtype: dtype of the keys and values, the model's dtype.
    """
    from .. import OffloadLayer
    from ..attention import take_handoff

    g = torch.Generator(device=device).manual_seed(0)
    if hasattr(cache, "reserve"):  # an OffloadCache: summaries allocated once, not grown chunk by chunk
        cache.reserve(context)
    for layer in cache.layers:
        for start in range(0, context, chunk):
            n = min(chunk, context - start)
            k = torch.randn(batch, kv_heads, n, head_dim, device=device, dtype=dtype, generator=g)
            layer.update(k, torch.randn_like(k))
            if isinstance(layer, OffloadLayer):
                take_handoff()  # no attention runs for a fill
                layer.finish_step()


def build_model(shape: str, context: int, steps: int, device: torch.device):
    """A Llama model of ``shape`` with random bf16 weights, in eval mode, on ``device``.

    Args:
        shape: a key of :data:`SHAPES`.
        context: tokens of the filled KV; positions up to ``context + steps`` must exist.
        steps: decode steps that will run.
        device: where to build it.

    Returns:
        The ``LlamaForCausalLM``.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"Unknown shape {shape!r}; shapes: {sorted(SHAPES)}")
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=context + steps + 16, pad_token_id=0)
    torch.manual_seed(0)
    with device:  # built in bf16 directly: an 8B model never exists in float32
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


class _StepClock:
    """A logits processor that timestamps every decode step (after a device synchronisation on CUDA)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            torch.cuda.synchronize()
        self.marks.append(time.perf_counter())
        return scores


def _kv_bytes(cache) -> int:
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, torch.Tensor)
    )


def _decode(model, cache, batch: int, context: int, steps: int, device: torch.device) -> float:
    """Decode ``steps`` tokens after a filled cache; returns the mean seconds per step, the first two excluded."""
    times = _decode_step_times(model, cache, batch, context, steps, device)
    return sum(times) / len(times)


def _decode_step_times(model, cache, batch: int, context: int, steps: int, device: torch.device) -> list[float]:
    """Decode ``steps`` (at least 3) tokens after a filled cache; returns the seconds of steps 3..``steps``, each.

    A mean over them carries the steps that capture CUDA graphs (the second step, the first seals of a block):
    their median is the steady step."""
    from transformers import LogitsProcessorList

    from .. import generate_cache_kwarg

    ids = torch.randint(0, model.config.vocab_size, (batch, context + 1), device=device)
    clock = _StepClock(device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache}, do_sample=False,
                       max_new_tokens=steps, min_new_tokens=steps,
                       logits_processor=LogitsProcessorList([clock]))  # fmt: skip
    # One mark per step, taken after the step's forward: the spans from the second mark on time steps 3..steps. The
    # first step also pays one-time costs such as kernel compilation; with CUDA graphs (on by default) it runs op by
    # op and the second step captures each layer's graph, so the third is the first replayed step.
    return [b - a for a, b in zip(clock.marks[1:], clock.marks[2:])]


def check_settings(budget: int, selectors, transfer: str, overrides: dict) -> None:
    """Raise ``ValueError`` (or ``TypeError``) if an offloaded cache of :func:`run_bench` would get invalid settings.

    Args:
        budget: ``budget_tokens``.
        selectors: selector names, one offloaded run each.
        transfer: ``OffloadConfig.transfer``.
        overrides: further :class:`~hf_offload.config.OffloadConfig` fields.
    """
    from .. import OffloadConfig, get_selector

    for name in selectors:
        get_selector(OffloadConfig(budget_tokens=budget, selector=name, transfer=transfer, **overrides).selector)


def run_bench(shape: str = "tiny", context: int = 4096, batch: int = 1, budget: int = 1024, steps: int = 16,
              selectors: tuple[str, ...] = ("solohead",), device: str = "auto", transfer: str = "auto",
              dense: bool = True, overrides: dict | None = None) -> dict:  # fmt: skip
    """Time decode steps with ``DynamicCache`` and with ``OffloadCache`` on a random-weight model.

    Args:
        shape: a key of :data:`SHAPES`.
        context: tokens of KV per sequence before decoding (random, written without a prefill).
        batch: sequences.
        budget: ``budget_tokens`` of the offloaded caches.
        steps: decode steps per method (at least 3: the first two are not timed).
        selectors: one offloaded run per selector name.
        device: ``"auto"`` (CUDA where available, else the CPU) or a torch device name.
        transfer: ``OffloadConfig.transfer`` of the offloaded caches.
        dense: also run ``DynamicCache``.
        overrides: further :class:`~hf_offload.config.OffloadConfig` fields of the offloaded caches, e.g.
            ``{"pool_tokens": 2048}``.

    Returns:
        ``{"metadata": {...}, "runs": [...]}``; each run has ``method`` (``"dense"`` or the selector name),
        ``ms_per_step``, ``tokens_per_s`` (``batch`` tokens per step), ``device_kv_bytes``,
        ``device_summary_bytes``, ``host_kv_bytes``, ``hit_rate`` (``None`` for dense),
        ``decode_recalled_bytes_per_step``, ``context_tokens`` (tokens per sequence held at the end:
        ``context + steps``) and, with ``overrides={"timing": True}``, ``timing`` (``cache.stats()["timing"]``).
    """
    import transformers
    from transformers import DynamicCache

    from .. import OffloadCache, __version__

    if steps < 3:
        raise ValueError(
            f"steps must be at least 3 (the first two decode steps are not timed: one-time costs such as kernel "
            f"compilation, and with CUDA graphs the capture), got {steps}."
        )
    overrides = dict(overrides or {})
    check_settings(budget, selectors, transfer, overrides)  # before the model is built
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    cuda = dev.type == "cuda"
    model = build_model(shape, context, steps, dev)
    kv_heads, head_dim = SHAPES[shape]["num_key_value_heads"], SHAPES[shape]["head_dim"]
    runs = []
    for method in (["dense"] if dense else []) + list(selectors):
        if method == "dense":
            cache = DynamicCache(config=model.config)
        else:
            cache = OffloadCache(model, budget_tokens=budget, selector=method, transfer=transfer, **overrides)
        torch.manual_seed(0)  # every method gets the same values and token ids
        fill_random(cache, batch, context, kv_heads, head_dim, dev)
        step_s = _decode(model, cache, batch, context, steps, dev)
        run = {"method": method, "ms_per_step": step_s * 1e3, "tokens_per_s": batch / step_s,
               "context_tokens": cache.get_seq_length()}  # fmt: skip
        if method == "dense":
            run.update(device_kv_bytes=_kv_bytes(cache), device_summary_bytes=0, host_kv_bytes=0, hit_rate=None,
                       decode_recalled_bytes_per_step=0)  # fmt: skip
        else:
            stats = cache.stats()
            run.update({k: stats[k] for k in ("device_kv_bytes", "device_summary_bytes", "host_kv_bytes", "hit_rate")})
            run["decode_recalled_bytes_per_step"] = stats["decode_recalled_bytes"] / max(stats["decode_steps"], 1)
            if stats["timing"] is not None:  # --set timing=True: mean ms per step of select, recall, attention, rest
                run["timing"] = stats["timing"]
        runs.append(run)
        del cache
        if cuda:
            torch.cuda.empty_cache()
    metadata = {
        "shape": shape, "context": context, "batch": batch, "budget": budget, "steps": steps,
        "selectors": list(selectors), "transfer": transfer, "overrides": overrides, "device": str(dev),
        "dtype": "bfloat16",
        "model": SHAPES[shape],
        "machine": {"platform": platform.platform(), "gpu": torch.cuda.get_device_name(dev) if cuda else None},
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "hf_offload": __version__},
    }  # fmt: skip
    return {"metadata": metadata, "runs": runs}


def format_table(result: dict) -> str:
    """The printed table of :func:`run_bench`'s result: one line per method."""
    m = result["metadata"]
    lines = [
        f"{m['shape']} shape (random bf16 weights) on {m['device']}: {m['context']:,} tokens of random KV per "
        f"sequence (no prefill), batch {m['batch']}, budget {m['budget']}, {m['steps']} decode steps",
        "",
        f"{'method':10s} {'ms/step':>9s} {'tok/s':>9s} {'device KV MiB':>14s} {'summaries MiB':>14s} "
        f"{'host KV MiB':>12s} {'hit rate':>9s} {'recall MiB/step':>16s}",
    ]
    for r in result["runs"]:
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        lines.append(
            f"{r['method']:10s} {r['ms_per_step']:9.2f} {r['tokens_per_s']:9.1f} {r['device_kv_bytes'] / MIB:14.2f} "
            f"{r['device_summary_bytes'] / MIB:14.2f} {r['host_kv_bytes'] / MIB:12.2f} {hit:>9s} "
            f"{r['decode_recalled_bytes_per_step'] / MIB:16.3f}"
        )
    return "\n".join(lines)


def _parse_overrides(parser: argparse.ArgumentParser, items: list[str]) -> dict:
    """``["pool_tokens=2048", ...]`` as OffloadConfig overrides; values are Python literals or plain strings."""
    from .. import OffloadConfig

    fields = sorted(f.name for f in dataclasses.fields(OffloadConfig) if f.init)
    taken = {"budget_tokens": "--budget", "selector": "--selector", "transfer": "--transfer"}
    overrides = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in fields:
            parser.error(f"--set takes FIELD=VALUE with an OffloadConfig field ({', '.join(fields)}), got {item!r}")
        if name in taken:
            parser.error(f"set {name} with {taken[name]}, not --set")
        try:
            overrides[name] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            overrides[name] = text.strip()
    return overrides


def main(argv: list[str] | None = None) -> int:
    """``hf-offload bench`` entry point."""
    parser = argparse.ArgumentParser(
        prog="hf-offload bench", description=__doc__.split("\n\n")[0],
        epilog="example:\n  hf-offload bench --shape llama-3.1-8b --context 32768 --batch 8 --budget 2048 --steps 32"
               "\n  hf-offload bench --shape tiny --context 4096 --selector solohead headwise --json bench.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--shape", choices=list(SHAPES), default="tiny", metavar="NAME",
                        help=f"model sizes, one of: {', '.join(SHAPES)} (default: tiny)")  # fmt: skip
    parser.add_argument("--context", type=int, default=4096, help="tokens of KV per sequence (default: 4096)")
    parser.add_argument("--batch", type=int, default=1, help="sequences (default: 1)")
    parser.add_argument("--budget", type=int, default=1024, help="OffloadCache budget_tokens (default: 1024)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per method, >= 3 (default: 16)")
    parser.add_argument("--selector", nargs="+", default=["solohead"], help="one offloaded run per selector")
    parser.add_argument("--transfer", choices=["auto", "kernel", "torch"], default="auto",
                        help="OffloadConfig.transfer: auto, kernel or torch (default: auto)")  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto (CUDA where available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                        help="an OffloadConfig field of the offloaded caches, e.g. pool_tokens=2048 (repeatable)")
    parser.add_argument("--no-dense", action="store_true", help="skip the DynamicCache run")
    parser.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON to OUT")
    args = parser.parse_args(argv)
    overrides = _parse_overrides(parser, args.overrides)
    try:
        check_settings(args.budget, args.selector, args.transfer, overrides)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    try:
        result = run_bench(args.shape, args.context, args.batch, args.budget, args.steps, tuple(args.selector),
                           args.device, args.transfer, dense=not args.no_dense, overrides=overrides)  # fmt: skip
    except RuntimeError as err:
        if not str(err).startswith(("cuda_graphs=True needs", "transfer='kernel' needs")):
            raise
        parser.exit(2, f"hf-offload bench: error: {err}\n")  # a setting this machine cannot run
    print(format_table(result))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
