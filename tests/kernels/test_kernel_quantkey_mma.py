"""The tensor-core scoring kernel (``hf_offload.kernels.quantkey_mma``): its rounding scheme on the CPU, the kernel
itself on CUDA (compute capability 9.0+) against that scheme and against the float32 reference."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_offload.kernels import quantkey_mma
from hf_offload.kernels.quant import dequantize_keys, quantize_keys
from hf_offload.kernels.quantkey import _launch_block_lse, block_lse, block_lse_reference
from hf_offload.kernels.quantkey_mma import block_lse_emulated, mma_supported

HAS_MMA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
needs_mma = pytest.mark.skipif(not HAS_MMA, reason="needs a CUDA device of compute capability 9.0 or newer")


def _inputs(batch, n, heads, group, head_dim, device="cpu", seed=0, bits=2):
    """Scaled queries, the ``bits``-bit summaries of keys whose channels have different ranges (as RoPE'd keys have), and
    those keys (CPU)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 6.0, head_dim)
    keys = (torch.randn(batch, n, heads, 16, head_dim, generator=g) * scale).to(torch.bfloat16)
    query = torch.randn(batch, heads, group, head_dim, generator=g) * head_dim**-0.5 * 3
    s = quantize_keys(keys, bits)
    return query.to(device), {k: v.to(device) for k, v in s.items()}, keys


def _term_bound(query, s, bits=2):
    """Per (batch, head, query head, block): the largest sum over channels of ``|code * kstep * q|`` of a token, the
    scale of the rounding error of ``kstep * q`` in bfloat16."""
    code = dequantize_keys(s["codes"], torch.zeros_like(s["kmin"]), torch.ones_like(s["kmin"]), bits)
    w = (s["kstep"].float()[:, :, :, None, :] * query.float()[:, None]).abs()  # [B, N, H, G, D]
    return torch.einsum("bnhtd,bnhgd->bhgnt", code, w).amax(dim=-1)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("head_dim, group", [(64, 7), (128, 4), (256, 1)])
def test_rounding_scheme_stays_close_to_the_float32_reference(head_dim, group, bits):
    query, s, keys = _inputs(2, 40, 2, group, head_dim, bits=bits)
    expected = block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], bits)
    got = block_lse_emulated(query, s["codes"], s["kmin"], s["kstep"], bits)
    err = (got - expected).abs()
    # kstep * q is rounded to bfloat16 twice (relative error below 2**-8 each product): the logits move by less than
    # 2**-7 of the sum of the magnitudes of their terms, and far less on average.
    bound = _term_bound(query, s, bits)
    assert (err <= 2**-7 * bound + 1e-4).all(), err.max()
    assert err.mean() < 2**-9 * bound.mean()
    # Far below the error of the codes themselves (against the logits of the keys before quantization): a twentieth
    # of it at 2 bits, under a sixth at 4 (16 times finer codes), which adds about 1% to it in quadrature.
    true = torch.einsum("bhgd,bnhtd->bhgnt", query, keys.float()).logsumexp(dim=-1)
    assert err.mean() < {2: 0.05, 4: 0.15}[bits] * (true - expected).abs().mean()


def test_rounding_scheme_ranks_blocks_like_the_reference():
    query, s, _ = _inputs(1, 256, 2, 4, 128, seed=3)
    expected = torch.softmax(block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], 2), dim=-1).sum((1, 2))
    got = torch.softmax(block_lse_emulated(query, s["codes"], s["kmin"], s["kstep"]), dim=-1).sum((1, 2))
    k = 16
    top_ref = set(expected.topk(k).indices[0].tolist())
    top_got = set(got.topk(k).indices[0].tolist())
    assert len(top_ref & top_got) >= k - 2
    assert (got - expected).abs().sum() < 0.05 * expected.sum()


def test_mma_is_not_taken_without_its_requirements():
    query, s, _ = _inputs(1, 4, 1, 4, 128)
    assert not mma_supported(query, s["codes"], s["kmin"], 2)  # CPU tensors
    if HAS_MMA:
        q, c = query.cuda(), {k: v.cuda() for k, v in s.items()}
        assert mma_supported(q, c["codes"], c["kmin"], 2)
        assert not mma_supported(q, c["codes"], c["kmin"].float(), 2)  # float32 summaries
        assert not mma_supported(q, c["codes"], c["kmin"], 4)  # 2-bit codes called 4-bit ones
        c4 = quantize_keys(torch.randn(1, 4, 1, 16, 128, device="cuda").to(torch.bfloat16), 4)
        assert mma_supported(q, c4["codes"], c4["kmin"], 4)
        assert not mma_supported(q, quantize_keys(torch.randn(1, 4, 1, 16, 128, device="cuda"), 1)["codes"],
                                 c["kmin"], 1)  # 1-bit codes  # fmt: skip
        q9 = torch.zeros(1, 1, 9, 128, device="cuda")
        assert not mma_supported(q9, c["codes"], c["kmin"], 2)  # more than 8 query heads per KV head


@needs_mma
@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("shape", [(2, 70, 2, 4, 128), (1, 16, 3, 7, 64), (3, 129, 1, 8, 256), (1, 1, 2, 1, 128),
                                   (1, 23, 2, 6, 128), (2, 9, 1, 2, 64)])  # fmt: skip
@pytest.mark.parametrize("transpose", [True, False])
def test_kernel_matches_its_scheme_and_the_reference(monkeypatch, transpose, shape, bits):
    monkeypatch.setattr(quantkey_mma, "TRANSPOSE", transpose)
    batch, n, heads, group, head_dim = shape
    query, s, _ = _inputs(batch, n, heads, group, head_dim, device="cuda", seed=n, bits=bits)
    out = torch.full((batch, heads, group, n), float("nan"), device="cuda")
    got = _launch_block_lse(query, s["codes"], s["kmin"], s["kstep"], bits, out, variant="mma")
    emulated = block_lse_emulated(query, s["codes"], s["kmin"], s["kstep"], bits)
    expected = block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], bits)
    assert not torch.isnan(got).any()
    # Against the same rounding, the only differences are the order of float32 sums.
    assert torch.allclose(got, emulated, atol=2e-3, rtol=1e-4), (got - emulated).abs().max()
    assert ((got - expected).abs() <= 2**-7 * _term_bound(query, s, bits) + 2e-3).all()


@needs_mma
@pytest.mark.cuda
def test_kernel_reads_blocks_of_a_larger_buffer_and_replays_in_a_graph():
    # block_lse runs the mma kernel by itself on such a GPU
    query, s, _ = _inputs(3, 90, 2, 4, 128, device="cuda", seed=5)
    views = {k: v[:, :77] for k, v in s.items()}  # the first 77 of 90 blocks per sequence, in place
    expected = block_lse_emulated(query, *(views[k].contiguous() for k in ("codes", "kmin", "kstep")))
    got = block_lse(query, views["codes"], views["kmin"], views["kstep"], 2)
    assert torch.allclose(got, expected, atol=2e-3, rtol=1e-4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = block_lse(query, views["codes"], views["kmin"], views["kstep"], 2)
    query.mul_(0.5)
    graph.replay()
    again = block_lse(query, views["codes"], views["kmin"], views["kstep"], 2)
    assert torch.equal(replayed, again)


@needs_mma
@pytest.mark.cuda
def test_extreme_steps_and_zero_ranges():
    query, s, _ = _inputs(1, 33, 2, 4, 128, device="cuda", seed=7)
    s["kstep"][:, :3] = 0  # constant blocks (every code 0)
    s["codes"][:, :3] = 0
    s["kstep"][:, 3:6] *= 1000.0  # large products: kstep * q * 2**112 must stay finite
    query[:, :, 1] *= 1e-6  # tiny ones: products far below 2**-21 still count
    out = torch.empty(1, 2, 4, 33, device="cuda")
    got = quantkey_mma.launch(query, s["codes"], s["kmin"], s["kstep"], out, block_stride=33)
    emulated = block_lse_emulated(query, s["codes"], s["kmin"], s["kstep"])
    assert torch.isfinite(got).all()
    assert torch.allclose(got, emulated, atol=2e-2, rtol=1e-4), (got - emulated).abs().max()


@needs_mma
@pytest.mark.cuda
@pytest.mark.parametrize(
    "prefetch, unroll, warps, stages, chains, min_blocks",
    [(True, 1, 4, 0, 1, 0), (False, 2, 4, 0, 1, 0), (False, 1, 8, 0, 1, 0), (True, 2, 8, 0, 1, 0), (False, 1, 4, 0, 1, 0),
     (False, 1, 4, 2, 1, 0), (False, 1, 4, 3, 1, 0), (False, 1, 4, 4, 1, 0), (False, 1, 8, 4, 1, 0),
     (False, 2, 4, 3, 1, 0), (False, 1, 4, 6, 1, 0), (False, 1, 4, 0, 2, 0), (False, 1, 4, 2, 2, 8),
     (False, 1, 4, 0, 1, 8), (False, 2, 4, 3, 2, 9)],
)  # fmt: skip
@pytest.mark.parametrize("bits, head_dim", [(2, 128), (4, 128), (2, 64), (4, 256)])
@pytest.mark.parametrize("transpose", [True, False])
def test_compile_time_settings_score_alike(monkeypatch, prefetch, unroll, warps, stages, chains, min_blocks, bits,
                                           head_dim, transpose):  # fmt: skip
    monkeypatch.setattr(quantkey_mma, "TRANSPOSE", transpose)
    monkeypatch.setattr(quantkey_mma, "PREFETCH", prefetch)
    monkeypatch.setattr(quantkey_mma, "UNROLL", unroll)
    monkeypatch.setattr(quantkey_mma, "WARPS", warps)
    monkeypatch.setattr(quantkey_mma, "STAGES", stages)
    monkeypatch.setattr(quantkey_mma, "CHAINS", chains)
    monkeypatch.setattr(quantkey_mma, "MIN_BLOCKS", min_blocks)
    # 157 of 180 blocks (a buffer with room to grow): 16 and 64 blocks per program leave rests
    query, full, _ = _inputs(2, 180, 2, 4, head_dim, bits=bits, device="cuda", seed=11)
    stride, s = 180, {k: v[:, :157] for k, v in full.items()}
    out = torch.full((2, 2, 4, 157), float("nan"), device="cuda")
    got = quantkey_mma.launch(query, s["codes"], s["kmin"], s["kstep"], out, block_stride=stride, bits=bits)
    emulated = block_lse_emulated(query, s["codes"], s["kmin"], s["kstep"], bits)
    assert torch.allclose(got, emulated, atol=2e-3, rtol=1e-4), (got - emulated).abs().max()


@needs_mma
@pytest.mark.cuda
@pytest.mark.parametrize("passes, pair, stages", [(1, True, 3), (1, True, 2), (2, False, 3), (2, True, 3), (3, True, 2),
                                                  (4, False, 0), (4, True, 3)])  # fmt: skip
@pytest.mark.parametrize("bits, head_dim", [(2, 128), (4, 128), (2, 64), (4, 256)])
@pytest.mark.parametrize("shape", [(2, 157, 2, 4), (1, 203, 3, 3), (2, 33, 1, 1), (1, 129, 2, 7), (1, 1, 1, 4)])
def test_passes_and_paired_blocks_score_alike(monkeypatch, passes, pair, stages, bits, head_dim, shape):
    monkeypatch.setattr(quantkey_mma, "PASSES", passes)
    monkeypatch.setattr(quantkey_mma, "PAIR", pair)
    monkeypatch.setattr(quantkey_mma, "STAGES", stages)
    batch, n, heads, group = shape  # odd block counts: the last pair holds one block, passes past the end are empty
    query, full, _ = _inputs(batch, n + 5, heads, group, head_dim, bits=bits, device="cuda", seed=n + group)
    s = {k: v[:, :n] for k, v in full.items()}
    out = torch.full((batch, heads, group, n), float("nan"), device="cuda")
    got = quantkey_mma.launch(query, s["codes"], s["kmin"], s["kstep"], out, block_stride=n + 5, bits=bits)
    emulated = block_lse_emulated(query, s["codes"], s["kmin"], s["kstep"], bits)
    assert not torch.isnan(got).any()
    assert torch.allclose(got, emulated, atol=2e-3, rtol=1e-4), (got - emulated).abs().max()


def test_a_failed_compilation_warns_once_and_is_not_retried(monkeypatch):
    calls = []

    def broken(source, name, *args, **kwargs):
        calls.append(name)
        raise RuntimeError("nvrtc: library not found")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", broken, raising=False)
    monkeypatch.setattr(quantkey_mma, "_COMPILED", {})
    monkeypatch.setattr(quantkey_mma, "_FAILED", None)
    with pytest.warns(RuntimeWarning, match="could not be compiled .*library not found.*Triton kernel instead"):
        assert quantkey_mma.compiled(128, 2) is None
    assert quantkey_mma.compiled(128, 4) is None  # no second attempt, no second warning
    assert calls == ["quantkey_mma"]


class _Shape:
    """Stands in for a CUDA tensor where only the dispatch is tested (no GPU needed): shape, dtype, device."""

    def __init__(self, *shape, dtype=torch.bfloat16):
        self.shape, self.dtype, self.is_cuda, self.device = shape, dtype, True, "cuda:0"


@pytest.mark.parametrize("capability, hip, compiles, expected", [
    ((9, 0), None, True, True),  # H100 / H200
    ((10, 0), None, True, True),  # newer
    ((8, 0), None, True, False),  # A100: no mul.bf16x2
    ((9, 4), "6.0", True, False),  # ROCm reports gfx numbers; the kernel is inline PTX
    ((9, 0), None, False, False),  # NVRTC cannot build it: the Triton kernel scores instead
])  # fmt: skip
def test_dispatch_on_the_device_and_the_toolkit(monkeypatch, capability, hip, compiles, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(quantkey_mma, "_FAILED", None)
    monkeypatch.setattr(quantkey_mma, "_COMPILED", {})

    def compile_kernel(source, name, *args, **kwargs):
        if not compiles:
            raise RuntimeError("NVRTC_ERROR_COMPILATION")
        return object()

    monkeypatch.setattr(torch.cuda, "_compile_kernel", compile_kernel, raising=False)
    query, codes, kmin = _Shape(2, 8, 4, 128), _Shape(2, 100, 8, 16, 32, dtype=torch.uint8), _Shape(2, 100, 8, 128)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert mma_supported(query, codes, kmin, 2) is expected
    if expected:
        assert not mma_supported(_Shape(2, 8, 4, 96), codes, kmin, 2)  # head_dim 96
        assert not mma_supported(query, _Shape(2, 100, 8, 32, 32, dtype=torch.uint8), kmin, 2)  # 32-token blocks


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("warps", [4, 8])
def test_ring_depth_fits_static_shared_memory(monkeypatch, warps, transpose):
    monkeypatch.setattr(quantkey_mma, "WARPS", warps)
    monkeypatch.setattr(quantkey_mma, "TRANSPOSE", transpose)
    for stages in (0, 1, 2, 3, 4, 6, 16):
        monkeypatch.setattr(quantkey_mma, "STAGES", stages)
        for head_dim in (64, 128, 256):
            for bits in (2, 4):
                for group in (1, 4, 7, 8):
                    depth = quantkey_mma.stages(head_dim, bits, group)
                    assert depth == 0 or 2 <= depth <= stages
                    slots = 2 * depth if quantkey_mma.paired(group, depth) else depth  # pairs of blocks
                    ring = warps * slots * (2 * head_dim * bits + 2 * head_dim)
                    if transpose:  # the tile of 8 blocks x group heads x 20 floats and 16 x group constants
                        staging = 4 * warps * (8 * group * 20 + 16 * group)
                    else:  # two [16 blocks, 9 heads] float arrays per warp
                        staging = 4 * 2 * warps * 16 * 9
                    assert staging == quantkey_mma.staging_bytes(group)
                    assert ring + staging <= quantkey_mma.SHARED_BYTES
    monkeypatch.setattr(quantkey_mma, "STAGES", 3)
    # paired blocks (the tile's reduction only): 2 pairs of 768-byte blocks per warp
    assert quantkey_mma.stages(128, 2, 4) == (quantkey_mma.PAIR_STAGES if transpose else 3) == (2 if transpose else 3)
    if warps == 4:  # 7 query heads: no pairs, 3 x 768 bytes per warp
        assert quantkey_mma.stages(128, 2, 7) == 3
    monkeypatch.setattr(quantkey_mma, "PAIR", False)
    assert quantkey_mma.stages(128, 2, 4) == 3
    monkeypatch.setattr(quantkey_mma, "STAGES", 1)
    assert quantkey_mma.stages(128, 2, 4) == 0  # a ring of one would only serialise the copies


def test_an_unscaled_query_of_any_dtype_is_scaled_as_torch_scales_it():
    query, s, _ = _inputs(2, 20, 2, 4, 128, seed=13)
    raw = (query * 11.3).to(torch.bfloat16)
    scaling = 128**-0.5
    got = block_lse(raw, s["codes"], s["kmin"], s["kstep"], 2, scaling=scaling)
    expected = block_lse_reference(raw.float() * scaling, s["codes"], s["kmin"], s["kstep"], 2)
    assert torch.equal(got, expected)


@needs_mma
@pytest.mark.cuda
@pytest.mark.parametrize("bits", [2, 4])
def test_a_bfloat16_query_is_scaled_inside_the_kernel_bit_for_bit(bits):
    query, s, _ = _inputs(3, 70, 2, 4, 128, device="cuda", seed=17, bits=bits)
    raw = (query * 11.3).to(torch.bfloat16)
    scaling = 128**-0.5
    in_kernel = block_lse(raw, s["codes"], s["kmin"], s["kstep"], bits, scaling=scaling)
    outside = block_lse(raw.float() * scaling, s["codes"], s["kmin"], s["kstep"], bits)
    assert torch.equal(in_kernel, outside)
    strided = raw.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous: converted first, same result
    assert torch.equal(block_lse(strided, s["codes"], s["kmin"], s["kstep"], bits, scaling=scaling), outside)
