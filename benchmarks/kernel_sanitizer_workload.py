"""A short CUDA workload of the copy kernels and the kernel transfer path, to run under compute-sanitizer:

    compute-sanitizer --tool memcheck python benchmarks/kernel_sanitizer_workload.py
    compute-sanitizer --tool racecheck python benchmarks/kernel_sanitizer_workload.py

``--variants`` and ``--selectors`` run a part of it (racecheck is slow: a part per call), for example
``--variants lookahead --selectors headwise --no-copies``.

It gathers and scatters blocks of several sizes between pinned host chunks (and an admitted device chunk) and device
tensors, then decodes a few steps of a tiny model with ``transfer="kernel"`` and both selectors (replayed from CUDA
graphs of the whole layer and of the attention alone, the offload stream for sealed blocks, and once with the
layer-ahead lookahead on the prefetch stream), with a prompt long enough for the chunked-prefill path, and checks
bytes and tokens against the host-side reference and the torch path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hf_offload import OffloadCache, generate_cache_kwarg  # noqa: E402
from hf_offload.kernels.gather import copy_pieces  # noqa: E402
from hf_offload.store import DeviceAdmission, HostBlockPool, HostMemoryBudget  # noqa: E402


VARIANTS = {"layer": ("kernel", False, "layer"), "attention": ("kernel", False, "attention"),
            "torch": ("torch", False, None), "lookahead": ("kernel", True, None)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="decodes to run (their tokens are compared with the first's)")  # fmt: skip
    parser.add_argument("--selectors", nargs="+", choices=("solohead", "headwise"), default=["solohead", "headwise"])
    parser.add_argument("--no-copies", action="store_true", help="skip the copy kernels' part")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    for block_elems in () if args.no_copies else (512, 2048, 32768):
        block_bytes = block_elems * 2
        admission = DeviceAdmission(device, 4 * block_bytes)  # the first chunk goes to the device
        host = HostBlockPool((block_elems,), torch.bfloat16, True, 4 * block_bytes, HostMemoryBudget(None), admission)
        ids = host.allocate(16)
        src = torch.randn(16, block_elems, generator=g).to(torch.bfloat16).to(device)
        words = host.block_words
        offs = torch.arange(16, device=device) * words
        ids_dev = ids.to(device)
        copy_pieces(host.chunk_addrs(device), host.chunk_blocks, words, ids_dev, torch.zeros_like(ids_dev), src, offs,
                    words, to_host=True)  # fmt: skip
        dst = torch.empty_like(src)
        perm = torch.randperm(16, generator=g).to(device)
        copy_pieces(host.chunk_addrs(device), host.chunk_blocks, words, ids_dev[perm], torch.zeros_like(ids_dev), dst,
                    offs, words, to_host=False)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(dst, src[perm]), block_elems
        assert torch.equal(host.read(ids).view(16, -1).to(device), src)
    if not args.no_copies:
        print("copy kernels: ok")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).to(device).eval()
    ids = torch.randint(0, 128, (2, 90), device=device)
    # (transfer, lookahead, graph scope): the whole layer and the attention alone replayed from CUDA graphs, the
    # torch path, and the layer-ahead lookahead on the prefetch stream (no graphs).
    variants = [VARIANTS[name] for name in args.variants]
    for selector in args.selectors:
        outs = []
        for transfer, lookahead, scope in variants:
            graphs = {"cuda_graphs": True, "graph_scope": scope} if scope else {"cuda_graphs": False}
            cache = OffloadCache(model, budget_tokens=48, block_tokens=8, sink_tokens=8, window_tokens=16,
                                 pool_tokens=64, selector=selector, transfer=transfer, lookahead=lookahead,
                                 admission="always", **graphs)  # fmt: skip
            with torch.no_grad():
                outs.append(
                    model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                                   max_new_tokens=12,
                                   do_sample=False, prefill_chunk_size=32)
                )
            stats = cache.stats()
            replays = stats["graph_replays"]
            print(selector, transfer, lookahead, scope, {k: stats[k] for k in ("graph_captures", "graph_replays",
                  "recalled_blocks", "host_kv_bytes", "device_kv_bytes")})  # fmt: skip
            assert (replays > 0) == bool(scope), (selector, transfer, lookahead, scope, replays)
        for variant, out in zip(variants[1:], outs[1:]):
            assert torch.equal(outs[0], out), (selector, variant)
    print(f"kernel transfer path ({', '.join(args.variants)}; {', '.join(args.selectors)}; offload stream, chunked "
          "prefill): ok")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
