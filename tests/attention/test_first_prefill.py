"""The fused first-prefill attention against an explicit masked softmax, and the cases it leaves to the tiles."""

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from hf_offload.attention import Handoff, OffloadMask
from hf_offload.attention.prefill import first_prefill as _first_prefill


def _inputs(batch=3, q_heads=6, kv_heads=2, q_len=37, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, dim, generator=g)
    k = torch.randn(batch, kv_heads, q_len, dim, generator=g)
    v = torch.randn(batch, kv_heads, q_len, dim, generator=g)
    return q, k, v


def _reference(q, k, v, padding, scaling):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    n = q.shape[-2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & padding[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v  # [B, H, Q, D]


def _mask(padding, mask_function=causal_mask_function):
    kwargs = dict(batch_size=padding.shape[0], q_length=padding.shape[1], kv_length=padding.shape[1], kv_offset=0, q_offset=0,
                  mask_function=mask_function, attention_mask=padding.long())  # fmt: skip
    return OffloadMask("sdpa", kwargs)


def _chunked_matches_dense(lengths, seed, chunk, new_tokens, **settings):
    """``generate(prefill_chunk_size=chunk)`` of left-padded prompts of ``lengths`` through DynamicCache and through
    an OffloadCache (8-token blocks, full budget, ``settings``): same tokens, logits within 1e-4. Returns the cache."""
    from transformers import DynamicCache

    from hf_offload import OffloadCache

    from ..helpers import build_model, left_padded

    model = build_model("llama")  # 2 query heads per KV head
    ids, mask = left_padded(lengths, seed=seed)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                  prefill_chunk_size=chunk, output_scores=True, return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        expected = model.generate(past_key_values=DynamicCache(config=model.config), **kwargs)
        cache = OffloadCache(model, budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=64,
                             **settings)  # fmt: skip
        got = model.generate(past_key_values=cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    return cache


@pytest.mark.parametrize("pads", [(0, 0, 0), (0, 5, 36)])
def test_matches_masked_softmax_at_real_positions(pads):
    q, k, v = _inputs()
    n = q.shape[-2]
    padding = torch.arange(n)[None, :] >= torch.tensor(pads)[:, None]
    out = _first_prefill(Handoff(None, k, v, 0, 0), q, _mask(padding), scaling=0.3)
    assert out is not None and out.shape == (3, n, 6, 16)
    ref = _reference(q, k, v, padding, 0.3).transpose(1, 2)
    real = padding[:, :, None, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    assert torch.all(out[~real] == 0)


def test_no_mask_is_plain_causal():
    q, k, v = _inputs(batch=2)
    out = _first_prefill(Handoff(None, k, v, 0, 0), q, None, scaling=0.25)
    ref = _reference(q, k, v, torch.ones(2, q.shape[-2], dtype=torch.bool), 0.25).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_other_cases_go_to_the_tiles():
    q, k, v = _inputs()
    n = q.shape[-2]
    full = torch.ones(3, n, dtype=torch.bool)
    right_padded = full.clone()
    right_padded[1, -4:] = False
    assert _first_prefill(Handoff(None, k, v, 0, 0), q, _mask(right_padded), 0.3) is None
    sliding = _mask(full, sliding_window_causal_mask_function(8))
    assert _first_prefill(Handoff(None, k, v, 0, 0), q, sliding, 0.3) is None
    assert _first_prefill(Handoff(None, k, v, 16, 1), q, _mask(full), 0.3) is None  # earlier blocks exist
    assert _first_prefill(Handoff(None, k, v, 0, 0), q[:, :, -1:], _mask(full), 0.3) is None  # decode


@pytest.mark.parametrize("transfer", ["torch", "kernel"])
def test_later_prefill_chunks_use_one_fused_call_and_match_dense(monkeypatch, transfer):
    """generate(prefill_chunk_size=...) with left padding: chunks after the first attend to every earlier sealed
    block (recalled in one pass) and their own tokens in one fused pass (two query heads per KV head: the earlier
    keys in one call for both, the chunk's own causally, merged by their log-sum-exp), and each decode step through
    one SDPA call over its selected blocks; logits match DynamicCache."""
    from transformers import DynamicCache

    from hf_offload import OffloadCache
    from hf_offload.attention import decode as attention_decode
    from hf_offload.attention import forward as attention_forward

    from ..helpers import build_model, left_padded

    from hf_offload.kernels.gather import kernels_available

    if transfer == "kernel" and not kernels_available(torch.device("cpu")):
        pytest.skip("the kernel path needs Triton on CUDA (or TRITON_INTERPRET=1)")
    calls = []
    original = attention_forward.chunk_prefill

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(attention_forward, "chunk_prefill", counted)
    decode_calls = []
    fused_decode = attention_decode.decode_sdpa
    monkeypatch.setattr(attention_decode, "decode_sdpa", lambda *a, **k: decode_calls.append(1) or fused_decode(*a, **k))
    model = build_model("llama")
    ids, mask = left_padded([45, 20, 38], seed=2)  # sequence 1 is padded into the second chunk
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, prefill_chunk_size=16,
                  output_scores=True, return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        expected = model.generate(past_key_values=DynamicCache(config=model.config), **kwargs)
        cache = OffloadCache(model, budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=64,
                             transfer=transfer)
        got = model.generate(past_key_values=cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    layers = len(cache.offload_layers)
    assert sum(calls) == 2 * layers  # chunks 2 and 3 of 45 tokens, in every layer
    assert cache.stats()["recalled_bytes"] > 0
    assert len(decode_calls) == 5 * layers  # every decode step after the first token, in every layer


@pytest.mark.parametrize("repeat_bytes", [None, 1])
def test_later_prefill_chunks_in_slices_of_the_batch_match_dense(monkeypatch, repeat_bytes):
    """A later chunk attends one KV head at a time over slices of the batch (REPEAT_BYTES bounds the keys and values
    repeated for the query heads): with one sequence per slice and with the whole batch at once, the tokens and
    logits match DynamicCache."""
    from hf_offload.attention import prefill

    if repeat_bytes is not None:
        monkeypatch.setattr(prefill, "REPEAT_BYTES", repeat_bytes)
    assert prefill.repeat_rows(4, 64, 16, 4) == (1 if repeat_bytes else prefill.REPEAT_BYTES // (2 * 4 * 64 * 16 * 4))
    rows = []
    original = prefill.repeat_rows
    monkeypatch.setattr(prefill, "repeat_rows", lambda *a: rows.append(original(*a)) or rows[-1])
    # No padding: the batch is attended at once or in slices.
    cache = _chunked_matches_dense([45, 45, 45], 3, 16, 4)
    assert cache.stats()["recalled_bytes"] > 0  # the later chunks recalled the earlier blocks
    # Each later chunk of each layer: one sequence per slice, or the whole batch of 3 at once (a short part takes
    # every query head in one call and asks for no slices).
    assert (rows and set(rows) == {1}) if repeat_bytes else min(rows, default=3) >= 3


@pytest.mark.parametrize("lengths", [[45, 45, 45], [45, 20, 38]])
@pytest.mark.parametrize("accumulator_bytes", [None, 1])
@pytest.mark.parametrize("chunk", [16, 12])
def test_later_prefill_chunks_in_segments_match_dense(monkeypatch, lengths, accumulator_bytes, chunk):
    """A later chunk whose earlier blocks exceed SEGMENT_BYTES attends them a segment at a time, then the recent
    tokens before it, then its own (causal), merged by their log-sum-exp: with segments of one block (and slices of
    one sequence), with and without left padding (sequence 1 is padded into the second chunk), with chunks of whole
    blocks and of 12 tokens (the open block's tokens before the chunk are a part of their own), the tokens and
    logits match DynamicCache."""
    from hf_offload.attention import prefill

    assert prefill.lse_attention_available(torch.device("cpu"), torch.float32, 16)
    assert prefill.lse_attention_available(torch.device("cpu"), torch.bfloat16, 64)
    monkeypatch.setattr(prefill, "SEGMENT_BYTES", 1)  # one block per segment
    monkeypatch.setattr(prefill, "segments_pay", lambda *args: True)
    if accumulator_bytes is not None:
        monkeypatch.setattr(prefill, "ACCUMULATOR_BYTES", accumulator_bytes)  # one sequence per slice
    segments = []
    original = prefill.segmented_prefill
    monkeypatch.setattr(prefill, "segmented_prefill", lambda *a: segments.append(a[-1]) or original(*a))
    cache = _chunked_matches_dense(lengths, 2, chunk, 4)
    # Every chunk after the first, in every layer: segments of one block.
    later = -(-45 // chunk) - 1
    assert len(segments) == later * len(cache.offload_layers) and set(segments) == {1}


@pytest.mark.parametrize("merge_bytes", [None, 1])
def test_segment_parts_merge_all_heads_at_once_or_a_kv_head_at_a_time(monkeypatch, merge_bytes):
    """A short part of a segmented chunk is one attention call and one merge for every query head; past
    MERGE_BYTES, one merge per KV head (and the causal part one call per KV head): both match DynamicCache, with
    left padding and chunks that cut blocks."""
    from hf_offload.attention import prefill

    monkeypatch.setattr(prefill, "SEGMENT_BYTES", 1)
    monkeypatch.setattr(prefill, "segments_pay", lambda *args: True)
    if merge_bytes is not None:
        monkeypatch.setattr(prefill, "MERGE_BYTES", merge_bytes)
    heads = []
    add = prefill._Merge.add
    monkeypatch.setattr(prefill._Merge, "add", lambda self, o, *a: heads.append(o.shape[1]) or add(self, o, *a))
    from ..helpers import build_model

    _chunked_matches_dense([45, 20, 38], 2, 12, 4)
    config = build_model("llama").config
    group = config.num_attention_heads // config.num_key_value_heads
    assert heads and set(heads) == ({group} if merge_bytes else {config.num_attention_heads})


def test_a_failed_check_keeps_the_unsegmented_path(monkeypatch):
    """Where the fused kernel's log-sum-exp entry point fails or disagrees with SDPA, segments are not used."""
    from hf_offload.attention import prefill

    monkeypatch.setattr(prefill, "_LSE_CHECKED", {})

    def wrong(q, k, v, causal, scale):  # a log-sum-exp in another base
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse / 0.6931471805599453

    monkeypatch.setattr(prefill, "_attention_with_lse", wrong)
    assert not prefill.lse_attention_available(torch.device("cpu"), torch.float32, 16)

    def missing(*args):
        raise RuntimeError("no such operator")

    monkeypatch.setattr(prefill, "_LSE_CHECKED", {})
    monkeypatch.setattr(prefill, "_attention_with_lse", missing)
    assert not prefill.lse_attention_available(torch.device("cpu"), torch.float32, 16)


def test_later_prefill_chunk_segments_through_the_kernel_path(monkeypatch):
    """The segments of a later chunk recalled by the copy kernel (``sealed_segment`` on the kernel path; Triton's
    interpreter on a CPU) give DynamicCache's tokens and logits, with left padding."""
    from hf_offload.attention import prefill
    from hf_offload.kernels.gather import kernels_available

    if not kernels_available(torch.device("cpu")):
        pytest.skip("the kernel path needs Triton on CUDA (or TRITON_INTERPRET=1)")
    monkeypatch.setattr(prefill, "SEGMENT_BYTES", 1)
    monkeypatch.setattr(prefill, "segments_pay", lambda *args: True)
    cache = _chunked_matches_dense([45, 20, 38], 2, 16, 3, transfer="kernel")
    assert cache.offload_layers[0].execution.use_kernels


def test_segments_are_used_where_they_hold_less():
    """A later chunk goes in segments where its earlier keys and values exceed one segment plus twice the
    accumulator, and in parts wherever query heads share KV heads; the admission's estimate of its temporaries
    follows (8B shape at 128K, chunks of 8,192)."""
    from types import SimpleNamespace

    from hf_offload.attention import prefill
    from hf_offload.cache.shared import forward_transient_bytes

    heads, q_len, head_dim = 32, 8192, 128
    accumulator = prefill.accumulator_bytes(1, heads, q_len, head_dim)
    assert accumulator == 4 * heads * q_len * (head_dim + 1)  # one sequence per slice at this size
    assert prefill.accumulator_bytes(8, heads, q_len, head_dim) == accumulator
    threshold = prefill.SEGMENT_BYTES + 2 * accumulator
    assert not prefill.segments_pay(threshold, 1, heads, q_len, head_dim)
    assert prefill.segments_pay(threshold + 1, 1, heads, q_len, head_dim)
    # Shared KV heads take the parts on the CPU only; past the threshold every device takes them.
    assert prefill.in_parts(True, 4, threshold, 1, heads, q_len, head_dim)
    assert not prefill.in_parts(False, 4, threshold, 1, heads, q_len, head_dim)
    assert not prefill.in_parts(True, 1, threshold, 1, heads, q_len, head_dim)
    assert prefill.in_parts(False, 1, threshold + 1, 1, heads, q_len, head_dim)
    config = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128, vocab_size=128256)  # fmt: skip
    # Without shared KV heads, one sequence's earlier keys (0.5 GiB) are attended whole; with them, in parts on the
    # CPU, and whole on CUDA (below the size where parts hold less).
    mha = SimpleNamespace(**{**vars(config), "num_key_value_heads": 32})
    one = forward_transient_bytes(mha, 1, 1024, 2, 1024, 4096)
    assert one == forward_transient_bytes(mha, 1, 1024, 2, 1024, 4096, segmented=False)
    assert one == forward_transient_bytes(mha, 1, 1024, 2, 1024, 4096, cpu=True)
    assert not prefill.segments_pay(2 * 8 * (131072 - 8192) * 128 * 2, 1, heads, q_len, head_dim)
    assert forward_transient_bytes(config, 1, 8192, 2, 8192, 131072 - 8192) == forward_transient_bytes(
        config, 1, 8192, 2, 8192, 131072 - 8192, segmented=False)  # fmt: skip
    gqa = forward_transient_bytes(config, 1, 8192, 2, 8192, 131072 - 8192, cpu=True)
    own = 2 * 4 * 8192 * 128 * 2  # the chunk's own keys and values, repeated for the 4 query heads of a KV head
    stacked = 2 * 32 * 8192 * 128 * 2  # the stacked queries of the 32 query heads and their output
    assert gqa == (prefill.SEGMENT_BYTES + own + stacked + 2 * accumulator
                   + forward_transient_bytes(config, 1, 8192, 2, 8192))  # fmt: skip
    eight = forward_transient_bytes(config, 8, 8192, 2, 8192, 131072 - 8192)
    whole = forward_transient_bytes(config, 8, 8192, 2, 8192, 131072 - 8192, segmented=False)
    earlier = 2 * 8 * 8 * (131072 - 8192) * 128 * 2
    assert whole - eight > earlier - prefill.SEGMENT_BYTES - 2 * accumulator - 1  # what the segments save


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_segments_of_a_later_chunk_match_the_whole_kv(monkeypatch, dtype):
    """On CUDA the log-sum-exp entry points pass their check, and a chunked prefill in segments of one block gives
    the logits of the same cache attending the whole earlier KV at once (bf16: flash; float32: memory-efficient)."""
    from hf_offload import OffloadCache
    from hf_offload.attention import prefill

    from ..helpers import build_model, left_padded

    assert prefill.lse_attention_available(torch.device("cuda"), dtype, 16)
    model = build_model("llama").to("cuda", dtype)
    ids, mask = left_padded([61, 30, 50], seed=5)
    ids, mask = ids.cuda(), mask.cuda()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, prefill_chunk_size=16,
                  output_scores=True, return_dict_in_generate=True)  # fmt: skip
    settings = dict(budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=64)
    runs = []
    for segmented in (False, True):
        monkeypatch.setattr(prefill, "segments_pay", lambda *args, on=segmented: on)
        monkeypatch.setattr(prefill, "SEGMENT_BYTES", 1 if segmented else prefill.SEGMENT_BYTES)
        with torch.no_grad():
            runs.append(model.generate(past_key_values=OffloadCache(model, **settings), **kwargs))
    whole, segments = runs
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(segments.scores, whole.scores):
        torch.testing.assert_close(a, b, atol=tolerance * max(1.0, b.abs().max().item()), rtol=tolerance)


@pytest.mark.cuda
def test_cuda_later_chunks_read_each_kv_head_once_for_its_query_heads(monkeypatch):
    """On CUDA in bfloat16 the flash kernel's grouped-query form passes its check, and a chunked prefill with left
    padding (two query heads per KV head, the whole earlier KV at once) gives the logits of the same cache attending
    keys and values repeated per query head, one KV head at a time."""
    from hf_offload import OffloadCache
    from hf_offload.attention import prefill

    from ..helpers import build_model, left_padded

    device, dtype = torch.device("cuda"), torch.bfloat16
    model = build_model("llama").to(device, dtype)
    config = model.config
    assert config.num_attention_heads > config.num_key_value_heads  # query heads share KV heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert prefill.flash_grouped_available(device, dtype, head_dim)
    ids, mask = left_padded([61, 30, 50], seed=5)
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, prefill_chunk_size=16,
                  output_scores=True, return_dict_in_generate=True)  # fmt: skip
    settings = dict(budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=64)
    monkeypatch.setattr(prefill, "segments_pay", lambda *args: False)
    grouped_calls = []
    original = prefill.grouped_flash

    def spied(q, k, *rest):
        grouped_calls.append(k.shape[1])
        return original(q, k, *rest)

    monkeypatch.setattr(prefill, "grouped_flash", spied)
    runs = []
    for grouped in (False, True):
        monkeypatch.setattr(prefill, "flash_grouped_available", lambda *args, on=grouped: on)
        with torch.no_grad():
            runs.append(model.generate(past_key_values=OffloadCache(model, **settings), **kwargs))
    repeated, once = runs
    for a, b in zip(once.scores, repeated.scores):
        torch.testing.assert_close(a, b, atol=2e-2 * max(1.0, b.abs().max().item()), rtol=2e-2)
    layers = config.num_hidden_layers
    assert grouped_calls and len(grouped_calls) % layers == 0  # later chunks only, once per layer and sequence
    assert set(grouped_calls) == {config.num_key_value_heads}  # the KV heads as they are, not repeated


def test_the_padding_is_read_on_the_host_once_per_forward(monkeypatch):
    """Where each sequence starts is read from the padding mask on the host (a device synchronisation on CUDA) once
    per prefill forward, not once per layer; the tokens are those of DynamicCache."""
    from hf_offload.attention import prefill

    reads = []
    original = prefill._left_padding
    monkeypatch.setattr(prefill, "_left_padding", lambda *a: reads.append(a[1]) or original(*a))
    cache = _chunked_matches_dense([45, 20, 38], seed=2, chunk=16, new_tokens=3)
    assert len(cache.offload_layers) > 1
    assert reads == [16, 32, 45]  # the first chunk and the two later ones: one read each


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_later_chunks_attend_in_parts_where_query_heads_share_kv_heads(monkeypatch, kv_heads):
    """Where query heads share a KV head (4 query heads on 2 KV heads), a later chunk attends its earlier keys with
    the heads' queries stacked in one call per sequence slice (no copy of the keys per query head) and its own keys
    causally, merged by their log-sum-exp; with one query head per KV head it stays one masked call. Tokens and
    logits are DynamicCache's either way."""
    import transformers
    from transformers import DynamicCache

    from hf_offload import OffloadCache
    from hf_offload.attention import prefill

    from ..helpers import _common, left_padded

    assert prefill.lse_attention_available(torch.device("cpu"), torch.float32, 16)  # checked before the spy
    parts, calls = [], []
    original, attention = prefill.segmented_prefill, prefill._attention_with_lse
    monkeypatch.setattr(prefill, "segmented_prefill", lambda *a: parts.append(1) or original(*a))
    monkeypatch.setattr(prefill, "_attention_with_lse",
                        lambda q, k, v, causal, scale: calls.append((q.shape[1], q.shape[2], k.shape[1], causal))
                        or attention(q, k, v, causal, scale))  # fmt: skip
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**_common(num_key_value_heads=kv_heads))
    model = transformers.LlamaForCausalLM(config).eval()
    ids, mask = left_padded([45, 45], seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, prefill_chunk_size=16,
                  output_scores=True, return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        expected = model.generate(past_key_values=DynamicCache(config=config), **kwargs)
        cache = OffloadCache(model, budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=64)
        got = model.generate(past_key_values=cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if kv_heads == 2:
        assert len(parts) == 2 * len(cache.offload_layers)  # chunks 2 and 3, in every layer
        # The earlier keys: both KV heads, each with its 2 query heads' 16 queries stacked (32).
        assert (2, 32, 2, False) in calls
        assert all(c[1] <= 16 for c in calls if c[3])  # the chunk's own keys: causal, queries not stacked
    else:
        assert parts == [] and calls == []
