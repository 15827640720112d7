"""``hf-offload plan``: device / host bytes of a cache for a model, context and batch, and the largest batch.

The numbers come from :mod:`hf_offload.planner`; this module only finds the model's shape (a preset, a model of
``hf-offload models``, a local folder or a hub name) and prints them.

Examples::

    hf-offload plan llama-3.1-8b --context 65536 --batch 8
    hf-offload plan /path/to/model --context 32768 --batch 4 --budget 2048
"""

from __future__ import annotations

import argparse
import sys

from .. import OffloadConfig, planner
from ..planner import (
    GIB,
    PRESETS,
    ModelShape,
    largest_batch,
    largest_resident_batch,
    plan,
    shape_from_config,
    shape_from_preset,
    suggested_device_memory_gib,
)


def load_shape(model: str) -> ModelShape:
    """The :class:`ModelShape` of a preset, a registry model, a local model folder or a hub name.

    Raises:
        ValueError: ``model`` is none of those, or its config could not be read (the message says what to pass).
    """
    import difflib
    import os

    if model in PRESETS:
        return shape_from_preset(model)
    from transformers import AutoConfig

    from . import models

    if models._lookup(model) is not None:  # a registry model: its converted folder (fetched on first use)
        return shape_from_config(AutoConfig.from_pretrained(models.fetch(model)))
    what = (f"a preset ({', '.join(sorted(PRESETS))}), a model of `hf-offload models`, a local model folder or a "
            f"hub name (owner/name)")  # fmt: skip
    close = difflib.get_close_matches(model, list(PRESETS), n=1, cutoff=0.6)
    if close and "/" not in model and not os.path.exists(model):  # a mistyped preset: no hub round trip
        raise ValueError(f"Unknown model {model!r}: did you mean the preset {close[0]!r}? Pass {what}.")
    try:
        return shape_from_config(AutoConfig.from_pretrained(model))
    except Exception as err:
        raise ValueError(f"Could not read the config of {model!r} ({type(err).__name__}: {str(err)[:200]}). "
                         f"Pass {what}.") from err


def main(argv: list[str] | None = None) -> int:
    """``hf-offload plan`` entry point."""
    parser = argparse.ArgumentParser(
        prog="hf-offload plan", description=planner.__doc__.split("\n\n")[0],
        epilog="example: hf-offload plan llama-3.1-8b --context 65536 --batch 8 --device-gib 139 --host-gib 120",
    )  # fmt: skip
    parser.add_argument("model", help=f"a preset ({', '.join(sorted(PRESETS))}), a local model folder or a hub name")
    parser.add_argument("--context", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=2048, help="OffloadCache budget_tokens")
    parser.add_argument("--selector", default=OffloadConfig.selector, help="block selector (default: %(default)s)")
    parser.add_argument("--device-gib", type=float, default=None, help="device memory for weights + cache")
    parser.add_argument("--host-gib", type=float, default=None, help="host memory for the offloaded cache")
    parser.add_argument("--admission", choices=("always", "auto"), default=OffloadConfig.admission,
                        help="OffloadCache admission (default: %(default)s)")  # fmt: skip
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="the bound on all the cache's device bytes (default: none; with --device-gib, "
                        "admission='auto' admits blocks into what the weights, the cache's other device bytes and "
                        "a margin for temporaries leave)")  # fmt: skip
    parser.add_argument("--margin-gib", type=float, default=8.0,
                        help="with --device-gib: device memory to leave for the model's temporaries, CUDA graphs and "
                        "allocator fragmentation when suggesting device_memory_gib and the every-block-on-the-device "
                        "batch (default %(default)s: an 8B-shape model on an H200 ran 64K tokens at batches 10-13 and "
                        "128K at 6-7 with it, 3 GiB ran out of memory)")
    parser.add_argument("--disk-gib", type=float, default=None,
                        help="with --host-gib: a disk tier of this many GiB takes the blocks past --host-gib "
                        "(OffloadCache(host_memory_gib=HOST_GIB, disk_dir=..., disk_memory_gib=DISK_GIB))")
    parser.add_argument("--gpus", type=float, nargs="+", default=None, metavar="GIB",
                        help="what runs on devices of these sizes (e.g. 24 48 80): per size, the largest batch at "
                        "--context with the defaults, the summary level it takes, and the every-block-on-the-device "
                        "batch")  # fmt: skip
    parser.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                        help="the prompt's prefill chunk (generate(prefill_chunk_size=...)): the largest batches "
                        "then also need its last chunk's temporaries to fit, and the offload row gives them")  # fmt: skip
    args = parser.parse_args(argv)
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        parser.error("--prefill-chunk takes a number of tokens >= 1")
    if args.disk_gib is not None and args.host_gib is None:
        parser.error("--disk-gib needs --host-gib (the disk tier takes what is past host_memory_gib)")
    try:
        shape = load_shape(args.model)
    except ValueError as err:
        parser.error(str(err))
    disk = {} if args.disk_gib is None else dict(host_memory_gib=args.host_gib, disk_dir=".",
                                                 disk_memory_gib=args.disk_gib)  # fmt: skip
    config = OffloadConfig(budget_tokens=args.budget, selector=args.selector, admission=args.admission,
                           device_memory_gib=args.device_memory_gib, **disk)  # fmt: skip
    weights = shape.weights_bytes or 0
    device_free = None if args.device_gib is None else int(args.device_gib * GIB) - weights
    print(f"{args.model}: {shape.full_layers} full + {shape.sliding_layers} sliding layers, {shape.kv_heads} KV heads, "
          f"head_dim {shape.head_dim}: {shape.kv_bytes_per_token * (shape.full_layers + shape.sliding_layers) / 1024:.0f}"
          f" KiB of KV per token (bf16)\n")  # fmt: skip
    print(f"{'method':8s} {'device KV GiB':>14s} {'(admitted)':>11s} {'summaries GiB':>14s} {'step GiB':>9s} "
          f"{'host KV GiB':>12s} {'host reserved GiB':>18s}" + (f" {'disk KV GiB':>12s}" if disk else ""))  # fmt: skip
    for method in ("dense", "static", "offload"):
        p = plan(shape, args.context, args.batch, method, config, device_free_bytes=device_free)
        print(f"{method:8s} {p.device_kv_bytes / GIB:14.2f} {p.admitted_kv_bytes / GIB:11.2f} "
              f"{p.device_summary_bytes / GIB:14.2f} {p.step_transient_bytes / GIB:9.2f} {p.host_kv_bytes / GIB:12.2f} "
              f"{p.host_reserved_bytes / GIB:18.2f}" + (f" {p.disk_kv_bytes / GIB:12.2f}" if disk else ""))  # fmt: skip
    print("(dense: DynamicCache; static: StaticCache; step: what a decode step allocates beyond the cache)")
    try:
        p = plan(shape, args.context, args.batch, "offload", config, device_free_bytes=device_free,
                 prefill_chunk_tokens=args.prefill_chunk)  # fmt: skip
    except ValueError as err:
        parser.error(str(err))
    if args.prefill_chunk:
        fits = "" if device_free is None else (" (fits)" if p.prefill_peak_bytes <= device_free else
                                               " (does NOT fit: a smaller batch or prefill chunk)")  # fmt: skip
        print(f"\nprefill in chunks of {args.prefill_chunk:,}: the last chunk's temporaries "
              f"{p.prefill_transient_bytes / GIB:.2f} GiB; with the cache less its admitted blocks "
              f"{p.prefill_peak_bytes / GIB:.2f} GiB of the device besides the weights{fits}")  # fmt: skip
    if p.summary_selector != _spec(config.selector):
        print(f"\nsummaries: the configured {_spec(config.selector)!r} would not fit beside the cache's other device "
              f"bytes; the cache re-encodes them at {p.summary_selector!r} (coarsen_summaries; docs/tuning.md, "
              "'Summaries that fit')")  # fmt: skip
    _print_coverage(args.context, config)
    if device_free is not None and args.admission == "auto":
        suggest = suggested_device_memory_gib(shape, args.context, args.batch, config, device_free, args.margin_gib)
        print(f"\nadmission='auto': {p.admitted_reserved_bytes / GIB:.2f} GiB admitted, "
              f"{(device_free - p.device_bytes) / GIB:.2f} GiB of the device left after weights and cache; to leave "
              f"{args.margin_gib:g} GiB for temporaries, pass device_memory_gib={suggest:.1f}")  # fmt: skip
    if device_free is not None:
        host_free = int((args.host_gib if args.host_gib is not None else 1e9) * GIB)
        print(f"\nlargest batch at {args.context:,} tokens ({args.device_gib:g} GiB device"
              f"{'' if args.host_gib is None else f', {args.host_gib:g} GiB host'}"
              f"{'' if args.disk_gib is None else f', {args.disk_gib:g} GiB disk'}; weights {weights / GIB:.1f} GiB):")
        for method in ("dense", "static", "offload"):
            disk_free = None if args.disk_gib is None else int(args.disk_gib * GIB)
            print(f"  {method:8s} {largest_batch(shape, args.context, method, device_free, host_free, config, disk_free_bytes=disk_free, prefill_chunk_tokens=args.prefill_chunk)}")
        resident = largest_resident_batch(shape, args.context, device_free, config, args.margin_gib)
        gib = suggested_device_memory_gib(shape, args.context, max(resident, 1), config.replace(admission="auto"),
                                          device_free, args.margin_gib)  # fmt: skip
        print(f"  offload, every block on the device (admission='auto', {args.margin_gib:g} GiB margin): {resident}"
              + (f" (device_memory_gib={gib:.1f})" if resident else "")
              + "\n(past that batch a decode step reads the blocks it selects from host memory, at PCIe speed: "
              "usually the fastest decode is at the every-block-on-the-device batch)")  # fmt: skip
    if args.gpus:
        _print_gpus(shape, args, config)
    return 0


def _print_coverage(context: int, config: OffloadConfig) -> None:
    """Where the selector's estimate of the unselected blocks takes only some of them token by token at this context
    and budget, say how many (aggregation tasks lose accuracy below all of them)."""
    from ..selectors import get_selector

    selector = get_selector(config.selector)
    coverage = getattr(selector, "estimate_coverage", None)
    n = context // config.block_tokens
    k = min(n, -(-config.budget_tokens // config.block_tokens))
    share = coverage(n, k) if coverage is not None else None
    if share is None or share >= 1:
        return
    print(f"\nestimate: {_spec(config.selector)!r} estimates about {share:.2f} of the {n - k:,} unselected blocks "
          f"token by token at {context:,} tokens (tail_near={selector.tail_near:g} per selected block), the rest by "
          "their mass alone; aggregation tasks lose accuracy below all of them (docs/tuning.md, 'How many near "
          "blocks'); selector='quantkey[bits=4,tail_bits=2]' estimates every one")  # fmt: skip


def _spec(selector) -> str:
    from ..cache.persist import selector_spec
    from ..selectors import get_selector

    return selector_spec(get_selector(selector))


def _print_gpus(shape, args, config: OffloadConfig) -> None:
    """``--gpus``: per device size, the largest batch at the context (host memory unbounded unless --host-gib),
    its summary level, and the every-block-on-the-device batch."""
    weights = shape.weights_bytes or 0
    host_free = int((args.host_gib if args.host_gib is not None else 1e9) * GIB)
    print(f"\nwhat runs at {args.context:,} tokens (weights {weights / GIB:.1f} GiB, admission={args.admission!r}, "
          f"budget {args.budget}{'' if args.host_gib is None else f', {args.host_gib:g} GiB host'}"
          f"{'' if args.prefill_chunk is None else f', prefill chunks of {args.prefill_chunk:,}'}):")  # fmt: skip
    fine = config.replace(coarsen_summaries=False)
    print(f"  {'device GiB':>10s} {'dense':>6s} {'offload':>8s}  {'summaries at that batch':40s} "
          f"{'configured summaries':>20s} {'resident':>8s}")  # fmt: skip
    for gib in args.gpus:
        free = int(gib * GIB) - weights
        if free <= 0:
            print(f"  {gib:10g}  the weights alone do not fit")
            continue
        dense = largest_batch(shape, args.context, "dense", free, host_free, config)
        chunk = args.prefill_chunk
        batch = largest_batch(shape, args.context, "offload", free, host_free, config, prefill_chunk_tokens=chunk)
        level = plan(shape, args.context, max(batch, 1), "offload", config, device_free_bytes=free).summary_selector
        kept = largest_batch(shape, args.context, "offload", free, host_free, fine, prefill_chunk_tokens=chunk)
        resident = largest_resident_batch(shape, args.context, free, config, args.margin_gib)
        print(f"  {gib:10g} {dense:6d} {batch:8d}  {level if batch else '-':40s} {kept:20d} {resident:8d}")
    print("  (offload: the largest batch, its summaries coarsened where they must be; configured summaries: the "
          "largest batch without that, coarsen_summaries=False; resident: every block on the device with a margin of "
          "--margin-gib, past it a decode step reads its misses from host memory)")


if __name__ == "__main__":
    sys.exit(main())
