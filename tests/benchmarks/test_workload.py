"""benchmarks/workload.py: a decode recorded from a tiny random Qwen2 model, replayed at a larger Llama geometry
(twice the head size, more layers and KV heads, fewer query heads per KV head, a longer context): the replayed
attention logits equal the recorded ones, re-rotated keys equal RoPE at the shifted position, and bad geometries
fail with errors that say what to change."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from benchmarks import workload

from ..helpers import tiny_recorded_model, tiny_recording

THETA = 1e6
CONTEXT, STEPS = 40, 3


@pytest.fixture(scope="module")
def recording():
    return tiny_recording(THETA, CONTEXT, STEPS)


def target_config(**changes) -> LlamaConfig:
    kw = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=5, num_attention_heads=8, num_key_value_heads=4,
              head_dim=32, vocab_size=128, rope_theta=THETA, max_position_embeddings=512)  # fmt: skip
    return LlamaConfig(**{**kw, **changes})


def recorded_logits(rec: workload.Recording, layer: int, q_head: int, kv_head: int, t: int) -> torch.Tensor:
    """The recorded model's logits ``q.k / sqrt(d)`` of decode step ``t`` over the context (int8 keys)."""
    n = rec.context
    q = workload.rope_at(rec.queries[layer, t, q_head][None], torch.tensor([n + t]), THETA)[0]
    k = workload.rope_at(rec.layer_keys(layer)[kv_head], torch.arange(n), THETA)
    return (k @ q) / math.sqrt(rec.head_dim)


def test_rerotation_equals_rope_at_the_shifted_position():
    torch.manual_seed(1)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    p = torch.arange(10) * 997
    delta = torch.tensor([5, -3, 0, 12345, 7, 1, 2, 3, 4, 65536])
    shifted = workload.rotate(workload.rope_at(x, p, THETA), delta, THETA)
    torch.testing.assert_close(shifted, workload.rope_at(x, p + delta, THETA), rtol=1e-4, atol=1e-4)
    # and equals the model's own RoPE (transformers, float64 angles on our side) at the shifted positions
    cfg = target_config(head_dim=16)
    cos, sin = _model_rope(cfg, (p + delta)[None])
    ref, _ = apply_rotary_pos_emb(x.float()[None], x.float()[None], cos, sin)
    torch.testing.assert_close(shifted, ref[0], rtol=1e-3, atol=1e-3)


def _model_rope(cfg, positions):
    rope = LlamaForCausalLM(cfg).model.rotary_emb
    return rope(torch.zeros(1, dtype=torch.float32), positions)


def test_embedded_head_turns_with_the_target_models_rope():
    torch.manual_seed(2)
    x = torch.randn(3, 7, 16)
    pos = torch.arange(7) * 311
    cos, sin = _model_rope(target_config(), pos[None])
    ref, _ = apply_rotary_pos_emb(workload.embed_head(x, 32)[None], x.new_zeros(1, 3, 7, 32), cos, sin)
    torch.testing.assert_close(workload.embed_head(workload.rope_at(x, pos, THETA), 32), ref[0], rtol=1e-4,
                               atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("fill", [CONTEXT, 2 * CONTEXT + 5])
def test_replayed_logits_equal_the_recorded_ones(recording, fill):
    """Decode through a random-weight target model inside ``hooks``: each step's query (as the model's q_proj hook
    returns it, rotated by the model's RoPE) against the keys the cache holds gives, over the recorded document, the
    recorded logits at every target layer, sequence, KV head and query head."""
    rec = recording
    cfg = target_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    batch = 2
    replay = workload.Replay(rec, cfg, batch=batch, fill_tokens=fill, dtype=torch.float32)
    cache = DynamicCache(config=cfg)
    replay.fill(cache)
    queries = {}
    with torch.inference_mode(), replay.hooks(model):
        captures = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, j=j: queries.__setitem__(j, out))
                    for j, layer in enumerate(model.model.layers)]  # fmt: skip
        ids = torch.zeros(batch, 1, dtype=torch.long)
        for t in range(STEPS):
            model(input_ids=ids, position_ids=torch.full((batch, 1), fill + t), use_cache=True,
                  **{workload.cache_keyword(model): cache})
            pos = torch.full((batch, 1), fill + t)
            cos, sin = model.model.rotary_emb(queries[0], pos)
            for j in range(cfg.num_hidden_layers):
                q = queries[j].view(batch, 1, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)  # [batch, q_heads, 1, D]
                keys = cache.layers[j].keys  # [batch, kv_heads, fill + t + 1, D]
                for b in range(batch):
                    for h in range(cfg.num_key_value_heads):
                        li, hi = replay.source(j, h, b)
                        for i, qh in enumerate(replay.query_heads(h)):
                            got = keys[b, h, fill - rec.context : fill] @ q[b, h * replay.q_per_kv + i, 0]
                            want = recorded_logits(rec, li, qh, hi, t)
                            torch.testing.assert_close(got / math.sqrt(cfg.head_dim), want, rtol=1e-4, atol=1e-4)
                        # the step's own key went into the cache at its position, as recorded
                        key = workload.rope_at(rec.new_keys[li, t, hi][None], torch.tensor([fill + t]), THETA)
                        torch.testing.assert_close(keys[b, h, fill + t], workload.embed_head(key, 32)[0], rtol=1e-4,
                                                   atol=1e-4)  # fmt: skip
        for c in captures:
            c.remove()
    assert replay.step == STEPS
    # hooks removed on exit: the model's own projections again
    assert not model.model.layers[0].self_attn.q_proj._forward_hooks
    assert not model._forward_pre_hooks


def test_sequences_differ_and_layers_cycle_in_pairs(recording):
    replay = workload.Replay(recording, target_config(), batch=3, fill_tokens=3 * CONTEXT, dtype=torch.float32)
    idx = [replay.token_index(b) for b in range(3)]
    assert all(len(i) == 3 * CONTEXT for i in idx)
    assert all(torch.equal(i[-CONTEXT:], torch.arange(CONTEXT)) for i in idx)  # the document last
    assert all(torch.equal(i[:4], torch.arange(4)) for i in idx)  # its sink tokens first
    assert not torch.equal(idx[0], idx[1]) and not torch.equal(idx[1], idx[2])
    assert [replay.source(j, 0)[0] for j in range(5)] == [0, 1, 2, 3, 0]
    assert replay.source(0, 0, seq=1) == (2, 0) and replay.source(0, 3) == (1, 1)
    short = workload.Replay(recording, target_config(), batch=1, fill_tokens=CONTEXT - 10, dtype=torch.float32)
    assert torch.equal(short.token_index(0), torch.cat((torch.arange(4), torch.arange(14, CONTEXT))))


def test_save_and_load_round_trip(recording, tmp_path):
    path = recording.save(tmp_path / "w.safetensors")
    back = workload.Recording.load(path)
    for name in ("keys", "key_scales", "key_means", "queries", "new_keys", "token_ids", "forecasts"):
        assert torch.equal(getattr(back, name), getattr(recording, name)), name
    assert back.describe()["forecasts"] is True
    assert back.meta["rope_theta"] == THETA and back.meta["layers"] == [0, 1, 2, 3]
    assert back.describe()["sha256"] == workload.file_sha256(path) and back.describe()["file"] == "w.safetensors"
    assert max(back.meta["keys_int8_logit_error"]) < 0.1
    assert workload.load_workload("random") is None
    assert workload.load_workload(f"recorded:{path}").file_sha256 == back.file_sha256
    with pytest.raises(ValueError, match="recorded:PATH"):
        workload.load_workload(str(path))
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(ValueError, match="not a decode workload"):
        workload.Recording.load(other)


def test_geometries_that_cannot_map_say_what_to_change(recording):
    with pytest.raises(ValueError, match="rope_theta=1e\\+06"):
        workload.Replay(recording, target_config(rope_theta=5e5), batch=1, fill_tokens=64)
    with pytest.raises(ValueError, match="head_dim 24"):
        workload.Replay(recording, target_config(head_dim=24), batch=1, fill_tokens=64)
    with pytest.raises(ValueError, match="at least 4"):
        workload.Replay(recording, target_config(num_attention_heads=16), batch=1, fill_tokens=64)
    with pytest.raises(ValueError, match="default RoPE"):
        cfg = target_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
        workload.Replay(recording, cfg, batch=1, fill_tokens=64)


def test_kept_layers_are_adjacent_pairs():
    assert workload.kept_layers(24, 7) == [0, 1, 4, 5, 7, 8, 11, 12, 15, 16, 18, 19, 22, 23]
    assert workload.kept_layers(24, 12) == list(range(24))
    assert workload.kept_layers(8, 1) == [0, 1]


def test_bench_decode_replays_a_recorded_workload(recording, tmp_path, capsys):
    """bench_decode --workload recorded:PATH on the CPU at the tiny shape: the fill and the decode come from the
    replay, and every row and the metadata name the workload."""
    from benchmarks import bench_decode

    path = recording.save(tmp_path / "tiny.safetensors")
    out = tmp_path / "bench.json"
    argv = ["--shape", "tiny", "--budget", "64", "--steps", "2", "--warmup", "1", "--bandwidth-mib", "8",
            "--device", "cpu", "--contexts", "256", "--batches", "2", "--methods", "dynamic", "quantkey",
            "--out", str(out)]  # fmt: skip
    assert bench_decode.main([*argv, "--workload", f"recorded:{path}"]) == 0
    data = __import__("json").loads(out.read_text())
    sha = workload.file_sha256(path)
    assert data["workload"]["kind"] == "recorded" and data["workload"]["sha256"] == sha
    assert data["metadata"]["workload"]["recording"]["model"] == "tiny-qwen2"
    assert "tiny.safetensors" in data["decode_only"] and "tiny.safetensors" in data["metadata"]["note"]
    runs = {r["method"]: r for r in data["runs"]}
    assert sorted(runs) == ["dynamic", "quantkey"]
    for r in runs.values():
        assert r["workload"] == {"kind": "recorded", "label": "recorded tiny.safetensors (tiny-qwen2)",
                                 "file": "tiny.safetensors", "sha256": sha, "model": "tiny-qwen2"}  # fmt: skip
        assert r["workload_steps_replayed"] == 3  # warm-up and timed steps
    assert 0 <= runs["quantkey"]["hit_rate"] <= 1 and runs["dynamic"]["hit_rate"] is None
    printed = capsys.readouterr().out
    assert any(line.startswith("quantkey ") and line.endswith("recorded") for line in printed.splitlines())
    # random stays the default, and says so
    assert bench_decode.main(argv) == 0
    data = __import__("json").loads(out.read_text())
    assert data["workload"] == bench_decode.RANDOM_WORKLOAD
    assert all(r["workload"]["label"] == "random KV (worst case)" for r in data["runs"])
    with pytest.raises(SystemExit):
        bench_decode.parse_args([*argv, "--workload", "recorded:/nonexistent.safetensors"])


def test_recorded_forecasts_are_what_lookahead_predicts_on_the_recorded_model(recording):
    """Each recorded forecast, rotated at its position, is the library's own prediction
    (``hf_offload.cache.lookahead.speculative_query``) of that layer's query from the previous layer's input, on the
    recorded model re-run over the recorded tokens."""
    from hf_offload.cache.lookahead import speculative_query

    model = tiny_recorded_model(THETA)
    n, ids = recording.context, recording.token_ids[None]
    inputs = {}
    hooks = [layer.register_forward_pre_hook(
        lambda m, a, kw, i=i: inputs.__setitem__(i, a[0] if a else kw["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]  # fmt: skip
    with torch.inference_mode():
        model(input_ids=ids[:, : n + STEPS])
    for h in hooks:
        h.remove()
    positions = torch.arange(n + STEPS)[None]
    cos, sin = model.model.rotary_emb(inputs[0], positions)
    layers = recording.meta["layers"]
    checked = 0
    for i in range(1, len(layers)):
        for t in range(STEPS):
            # decode step t ran token_ids[n + t] at position n + t
            p = n + t
            hidden = inputs[layers[i - 1]][:, p : p + 1]
            want = speculative_query(model.model.layers[layers[i]], hidden, (cos[:, p : p + 1], sin[:, p : p + 1]))
            got = workload.rope_at(recording.forecasts[i, t], torch.tensor([p]), THETA)  # [q_heads, d]
            torch.testing.assert_close(got, want[0, :, 0], rtol=1e-3, atol=1e-4)
            checked += 1
    assert checked == 3 * STEPS
    # the first kept layer's forecast comes from the last kept layer's input (the wrap): defined, finite
    assert recording.forecasts.shape == recording.queries.shape and bool(recording.forecasts.isfinite().all())


def test_replayed_lookahead_predicts_with_the_recorded_forecast(recording):
    """Inside ``hooks``, the library's prediction of target layer j's query (what lookahead plans layer j with,
    from layer j - 1) is the recorded forecast of the kept layer each head comes from, at the target geometry and
    rotated at the step's position; after the context, and with a recording that has no forecasts, the random
    weights' own."""
    from hf_offload.cache import recaller

    original = recaller.speculative_query
    cfg = target_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    batch, fill = 2, 2 * CONTEXT + 5
    replay = workload.Replay(recording, cfg, batch=batch, fill_tokens=fill, dtype=torch.float32)
    assert "recorded" in replay.describe()["lookahead_forecast"]
    cache = DynamicCache(config=cfg)
    replay.fill(cache)
    hidden = torch.randn(batch, 1, cfg.hidden_size)
    with torch.inference_mode(), replay.hooks(model):
        assert recaller.speculative_query is not original
        for t in range(STEPS):
            pos = torch.full((batch, 1), fill + t)
            model(input_ids=torch.zeros(batch, 1, dtype=torch.long), position_ids=pos, use_cache=True,
                  **{workload.cache_keyword(model): cache})  # fmt: skip
            cos, sin = model.model.rotary_emb(hidden, pos)
            for j in range(cfg.num_hidden_layers):
                got = recaller.speculative_query(model.model.layers[j], hidden, (cos, sin))  # [batch, heads, 1, D]
                own = original(model.model.layers[j], hidden, (cos, sin))
                assert got.shape == own.shape and not torch.allclose(got, own)
                for b in range(batch):
                    for h in range(cfg.num_key_value_heads):
                        li, _ = replay.source(j, h, b)
                        for i, qh in enumerate(replay.query_heads(h)):
                            want = workload.rope_at(recording.forecasts[li, t, qh][None] * replay.scale,
                                                    torch.tensor([fill + t]), THETA)  # fmt: skip
                            torch.testing.assert_close(got[b, h * replay.q_per_kv + i, 0],
                                                       workload.embed_head(want, cfg.head_dim)[0], rtol=1e-4,
                                                       atol=1e-4)  # fmt: skip
    assert recaller.speculative_query is original
    # a recording without forecasts (an older file) leaves the prediction to the model's weights
    import dataclasses

    old = workload.Replay(dataclasses.replace(recording, forecasts=None), cfg, batch=batch, fill_tokens=fill,
                          dtype=torch.float32)  # fmt: skip
    assert "random weights" in old.describe()["lookahead_forecast"]
    with old.hooks(model):
        assert recaller.speculative_query is original
