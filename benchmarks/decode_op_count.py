"""Count the torch (aten) operations of one decode step per offloaded layer, by phase.

On a GPU every aten operation is a kernel launch or at least a trip through the dispatcher (~5-10 us of host time
each), and the decode step of an offloaded 8B model is bound by that host-side work, not by the device. This script
counts the operations on the CPU (the count does not depend on the device, only on the code path): it builds a
small random Llama with real head geometry (32 query heads, 8 KV heads of 128), fills the cache with random KV
without a prefill (:func:`hf_offload.tools.bench.fill_random`), runs a few warm-up decode steps through
``generate()``, then counts every aten operation of ``--steps`` decode steps under a ``TorchDispatchMode``.

Per offloaded layer and decode step (mean over the counted steps; ``--steps`` a multiple of ``block_tokens``
includes one seal per layer, as in steady decoding), the count is split into:

* ``update``: ``cache.update`` (append to the open block; seal a full block);
* ``select``, ``prefetch``, ``recall``, ``attention``: the phases of ``OffloadConfig(timing=True)`` (``recall`` is
  the slot assignment, hit/miss counters and the launch arguments of the copy; ``attention`` includes putting a
  newly sealed block into the slot pool);
* ``plan_other``: the rest of the offload attention call (outside the four phases);
* ``model``: the decoder layer's own operations (norms, projections, rotary embedding, MLP).

The copy kernel itself (``hf_offload.kernels.gather.copy_pieces``) counts as one operation (one launch): the
operations inside it are not counted. Where Triton's CPU interpreter is available (``TRITON_INTERPRET=1`` and
Triton installed) the kernel runs; elsewhere the kernel path runs with a pure-torch copy in its place (the same
launch arguments are computed; the count is the same). Composite operations (``einsum``, ``pad``, ``flatten``,
``to``, ...) count as the operations they decompose into (a ``to`` that changes nothing counts zero), so the
numbers are of operations that reach a kernel or a view; ``view`` operations (no kernel on a GPU, but a
dispatcher trip) are counted in the totals and reported separately as ``views``. The scoring and tail kernels of
``quantkey`` selectors are not special-cased: without Triton they run their pure-torch references (counted as such),
and under the interpreter the operations the interpreter itself issues are counted (inflated counts). A dense layer with ``DynamicCache`` (the
model's own SDPA attention) is counted for reference.

Example::

    python benchmarks/decode_op_count.py --out results/decode/op_count_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402

PHASES = ("update", "select", "prefetch", "recall", "attention", "plan_other", "model")
TIMED = ("select", "prefetch", "recall", "attention")


class OpCounter(TorchDispatchMode):
    """Counts aten operations into the current bucket (a key of :attr:`ops`) while :attr:`on`.

    Attributes:
        ops: operations per bucket.
        views: view operations (no kernel launch on a GPU) per bucket.
        names: per bucket, a count per operation name.
    """

    def __init__(self):
        super().__init__()
        self.on = False
        self.trace: list[tuple[str, bool]] = []  # (name, is a view) of every operation counted, in order
        self.bucket: object = None
        self.ops: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()
        self.names: dict[object, collections.Counter] = collections.defaultdict(collections.Counter)

    def count(self, name: str, view: bool = False) -> None:
        """Count one operation ``name`` into the current bucket (if counting is on)."""
        if self.on:
            self.trace.append((name, view))
            self.ops[self.bucket] += 1
            self.views[self.bucket] += view
            self.names[self.bucket][name] += 1

    @contextlib.contextmanager
    def into(self, bucket):
        """Count into ``bucket`` inside the block, then back into the previous one."""
        previous, self.bucket = self.bucket, bucket
        try:
            yield
        finally:
            self.bucket = previous

    @contextlib.contextmanager
    def paused(self):
        """Count nothing inside the block."""
        previous, self.on = self.on, False
        try:
            yield
        finally:
            self.on = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Composite operations (einsum, pad, flatten, to, ...) are counted as the operations they run.
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        self.count(str(func.overloadpacket.__name__), view=func.is_view)
        return func(*args, **kwargs)


class OpTimer:
    """Stands in for :class:`~hf_offload.timing.PhaseTimer`: a mark is the operation count so far, and each phase
    span's operations move from the layer's ``plan_other`` bucket to the phase's bucket."""

    def __init__(self, counter: OpCounter, layer_idx: int):
        self.counter, self.layer_idx = counter, layer_idx

    def mark(self) -> int:
        return len(self.counter.trace)

    def add(self, phase: str, start: int, end: int) -> None:
        c, src, dst = self.counter, (self.layer_idx, "plan_other"), (self.layer_idx, phase)
        for name, view in c.trace[start:end]:
            c.ops[src] -= 1
            c.ops[dst] += 1
            c.views[src] -= view
            c.views[dst] += view
            c.names[src][name] -= 1
            c.names[dst][name] += 1

    def step_start(self) -> None:
        pass


def build_model(args):
    """A random-weight float32 Llama with the requested head geometry (small hidden and MLP sizes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.q_heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        vocab_size=256, max_position_embeddings=args.context + args.warmup + args.steps + 16,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def copy_words(chunks, chunk_blocks, block_words, ids, host_off, device_tensor, dev_off, piece_words, to_host):
    """What the copy kernel does, in vectorised torch (the arguments of
    :func:`~hf_offload.kernels.gather.copy_pieces`, with the host chunks as tensors instead of their addresses)."""
    dev = device_tensor.view(-1).view(torch.int32)
    hosts = [chunk.view(-1).view(torch.int32) for chunk in chunks]
    for block_id, h, d in zip(ids.tolist(), host_off.tolist(), dev_off.tolist()):
        if block_id < 0:
            continue
        host = hosts[block_id // chunk_blocks]
        h += (block_id % chunk_blocks) * block_words
        if to_host:
            host[h : h + piece_words] = dev[d : d + piece_words]
        else:
            dev[d : d + piece_words] = host[h : h + piece_words]


@contextlib.contextmanager
def counted_copy_kernel(counter: OpCounter, caches_chunks):
    """Count each launch of the copy kernel as one operation and nothing inside it; without a runnable kernel, copy
    with the pure-torch reference over the host chunks instead (``caches_chunks()``: the live chunk tensors)."""
    import importlib
    import pkgutil

    from hf_offload import kernels
    from hf_offload.kernels import gather

    # Every kernel module is imported before the patch below, so that the others (scoring, estimate, block scores,
    # top-k, ...) keep the real kernels_available they imported: they have no pure-torch stand-in here.
    for module in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{module.name}")
    original, available = gather.copy_pieces, gather.kernels_available
    runnable = available(torch.device("cpu"))

    def copy(chunk_addrs, chunk_blocks, block_words, ids, host_off, device_tensor, dev_off, piece_words, to_host,
             *rest, **kw):  # fmt: skip
        counter.count("copy_pieces (kernel launch)")
        with counter.paused():
            if runnable:
                return original(chunk_addrs, chunk_blocks, block_words, ids, host_off, device_tensor, dev_off,
                                piece_words, to_host, *rest, **kw)  # fmt: skip
            by_addr = {c.data_ptr(): c for c in caches_chunks()}
            chunks = [by_addr[a] for a in chunk_addrs.tolist()]
            copy_words(chunks, chunk_blocks, block_words, ids, host_off, device_tensor, dev_off, piece_words, to_host)

    gather.copy_pieces = copy
    if not runnable:
        gather.kernels_available = lambda device: device.type == "cpu"
    try:
        yield runnable
    finally:
        gather.copy_pieces, gather.kernels_available = original, available


@contextlib.contextmanager
def dense_attention_bucket(counter: OpCounter):
    """Count the model's own SDPA attention calls into ``(layer, "attention")`` (the dense reference)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def counted(module, *a, **kw):
        with counter.into((module.layer_idx, "attention")):
            return sdpa(module, *a, **kw)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = counted
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


@contextlib.contextmanager
def layer_buckets(counter: OpCounter, model, cache):
    """Count each decoder layer's operations into ``(layer, "model")``, its cache update into ``(layer, "update")``
    and the offload attention call into ``(layer, "plan_other")`` (the timer moves the phases out of it)."""
    from hf_offload import attention

    handles, stack = [], []
    for i, block in enumerate(model.model.layers):
        def pre(module, inputs, i=i):
            stack.append(counter.bucket)
            counter.bucket = (i, "model")

        def post(module, inputs, output):
            counter.bucket = stack.pop()

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    originals = []
    for i, layer in enumerate(cache.layers):
        update = layer.update

        def counted_update(*a, _update=update, _i=i, **kw):
            with counter.into((_i, "update")):
                return _update(*a, **kw)

        originals.append(layer)
        layer.update = counted_update
    forward = attention.offload_attention_forward

    def counted_forward(handoff, *a, **kw):
        with counter.into((handoff.layer.layer_idx, "plan_other")):
            return forward(handoff, *a, **kw)

    attention.offload_attention_forward = counted_forward
    try:
        yield
    finally:
        attention.offload_attention_forward = forward
        for layer in originals:
            del layer.update
        for h in handles:
            h.remove()


def count_decode(model, cache, args, counter: OpCounter) -> dict:
    """Warm-up steps, then ``args.steps`` counted decode steps; operations per layer and step by phase."""
    from transformers import LogitsProcessorList

    from hf_offload import generate_cache_kwarg

    steps_seen = [0]

    def step_boundary(input_ids, scores):
        steps_seen[0] += 1
        counter.on = args.warmup <= steps_seen[0] < args.warmup + args.steps
        return scores

    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context + 1))
    counter.ops.clear(), counter.views.clear(), counter.names.clear(), counter.trace.clear()
    counter.bucket = "outside_layers"
    counter.on = args.warmup == 0
    with counter, layer_buckets(counter, model, cache), warnings.catch_warnings(), torch.inference_mode():
        warnings.filterwarnings("ignore", message="`past_key_values` is deprecated")
        new = args.warmup + args.steps
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                             do_sample=False,
                             max_new_tokens=new, min_new_tokens=new,
                             logits_processor=LogitsProcessorList([step_boundary]))  # fmt: skip
    counter.on = False
    n_layers = len(model.model.layers)
    per_phase = {p: sum(counter.ops[(i, p)] for i in range(n_layers)) / (n_layers * args.steps) for p in PHASES}
    views = {p: sum(counter.views[(i, p)] for i in range(n_layers)) / (n_layers * args.steps) for p in PHASES}
    offload = {p: per_phase[p] for p in PHASES if p != "model"}
    top = {}
    for p in PHASES:
        names = collections.Counter()
        for i in range(n_layers):
            names.update(counter.names[(i, p)])
        top[p] = {k: v / (n_layers * args.steps) for k, v in names.most_common() if v}
    return {
        "per_layer_step": per_phase,
        "views_per_layer_step": views,
        "offload_ops_per_layer_step": sum(offload.values()),
        "ops_per_layer_step": sum(per_phase.values()),
        "outside_layers_per_step": counter.ops["outside_layers"] / args.steps,
        "top_ops_per_layer_step": top,
        "tokens": out[:, -new:].tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=8192, help="random KV tokens per sequence before decoding")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--budget", type=int, default=1024, help="budget_tokens")
    parser.add_argument("--warmup", type=int, default=3, help="uncounted decode steps first")
    parser.add_argument("--steps", type=int, default=16, help="counted decode steps (16 = one block_tokens)")
    parser.add_argument("--transfers", nargs="+", default=["kernel", "torch"])
    parser.add_argument("--selectors", nargs="+", default=["meanbound", "solohead"])
    parser.add_argument("--no-dense", action="store_true", help="skip the DynamicCache reference")
    parser.add_argument("--out", default="results/decode/op_count_cpu.json")
    args = parser.parse_args(argv)
    from transformers import DynamicCache

    from hf_offload import OffloadCache
    from hf_offload.tools.bench import fill_random
    from hf_offload.cache import OffloadLayer

    model = build_model(args)
    counter = OpCounter()
    runs = []
    print(f"aten ops per layer and decode step ({args.layers} layers, {args.q_heads}/{args.kv_heads} heads x "
          f"{args.head_dim}, context {args.context}, batch {args.batch}, budget {args.budget}, {args.steps} steps)")
    header = f"{'cache':22s} " + " ".join(f"{p:>10s}" for p in PHASES) + f" {'offload':>8s} {'total':>8s} {'views':>6s}"
    print(header)

    def show(name, r):
        v = sum(r["views_per_layer_step"].values())
        print(f"{name:22s} " + " ".join(f"{r['per_layer_step'][p]:10.1f}" for p in PHASES)
              + f" {r['offload_ops_per_layer_step']:8.1f} {r['ops_per_layer_step']:8.1f} {v:6.1f}")  # fmt: skip

    live_caches: list = []

    def chunks():
        return [c for cache in live_caches for layer in cache.layers if isinstance(layer, OffloadLayer)
                and layer.is_initialized for c in layer.blocks.host.chunks]  # fmt: skip

    with counted_copy_kernel(counter, chunks) as kernel_runs:
        if not args.no_dense:
            cache = DynamicCache(config=model.config)
            torch.manual_seed(0)
            fill_random(cache, args.batch, args.context, args.kv_heads, args.head_dim, "cpu", dtype=torch.float32)
            with dense_attention_bucket(counter):
                r = count_decode(model, cache, args, counter)
            r.update(cache="dense", transfer=None, selector=None)
            runs.append(r)
            show("dense (DynamicCache)", r)
        for transfer in args.transfers:
            for selector in args.selectors:
                cache = OffloadCache(model, budget_tokens=args.budget, selector=selector, transfer=transfer)
                live_caches[:] = [cache]
                torch.manual_seed(0)
                fill_random(cache, args.batch, args.context, args.kv_heads, args.head_dim, "cpu", dtype=torch.float32)
                for layer in cache.offload_layers:
                    layer.timer = OpTimer(counter, layer.layer_idx)
                r = count_decode(model, cache, args, counter)
                stats = cache.stats()
                r.update(cache="offload", transfer=transfer, selector=selector, hit_rate=stats["hit_rate"],
                         copy_kernel="triton interpreter" if transfer == "kernel" and kernel_runs else
                         ("torch reference" if transfer == "kernel" else None))  # fmt: skip
                runs.append(r)
                show(f"{transfer}/{selector}", r)
                live_caches.clear()
                del cache
    write_results(args.out, {"metadata": run_metadata(args, phases=list(PHASES), device="cpu"), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
