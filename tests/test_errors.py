"""Bad input gets a clear error that says what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from hf_offload import OffloadCache, OffloadConfig

from .helpers import build_model, left_padded


def test_budget_smaller_than_sink_plus_window():
    with pytest.raises(ValueError, match=r"budget_tokens=64 is smaller than sink_tokens \+ window_tokens"):
        OffloadConfig(budget_tokens=64, sink_tokens=32, window_tokens=64)


@pytest.mark.parametrize("block_tokens", [0, -16, 12, 24])
def test_block_size_must_be_power_of_two(block_tokens):
    with pytest.raises(ValueError, match="block_tokens"):
        OffloadConfig(block_tokens=block_tokens)


def test_sink_and_window_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of block_tokens=16"):
        OffloadConfig(sink_tokens=20)


@pytest.mark.parametrize("value", ["flash", None, True])
def test_decode_attention_must_be_one_of_three(value):
    with pytest.raises(ValueError, match="decode_attention must be 'auto', 'paged' or 'pool'"):
        OffloadConfig(decode_attention=value)


def test_paged_attention_needs_the_kernel_path():
    """On a CPU without Triton's interpreter (or with transfer='torch' anywhere) the paged kernel cannot run: a clear
    error at the first forward, where the cache learns its device."""
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=64, block_tokens=8, transfer="torch", decode_attention="paged")
    with pytest.raises(RuntimeError, match="decode_attention='paged' needs the kernel transfer path"):
        model(torch.randint(3, 90, (1, 40)), past_key_values=cache)


def test_unknown_selector():
    model = build_model("llama")
    with pytest.raises(ValueError, match="Unknown selector 'quest'"):
        OffloadCache(model, selector="quest")


def test_encoder_decoder_model_is_refused():
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4
    )
    model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(ValueError, match="encoder-decoder"):
        OffloadCache(model)


def test_model_without_kv_cache_is_refused():
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    with pytest.raises(ValueError, match="not a generative decoder model"):
        OffloadCache(transformers.BertModel(config))


def test_state_space_model_is_refused():
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4)
    with pytest.raises(ValueError, match="serves attention layers only"):
        OffloadCache(transformers.MambaForCausalLM(config))


def test_all_sliding_model_is_refused():
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=4096,
    )
    with pytest.raises(ValueError, match="sliding-window layer"):
        OffloadCache(transformers.MistralForCausalLM(config))


def test_not_a_model():
    with pytest.raises(TypeError, match="takes the transformers model itself"):
        OffloadCache(build_model("llama").config)


def test_cache_reused_with_a_model_that_does_not_use_it():
    model_a = build_model("llama")
    model_b = build_model("llama", seed=1)  # never switched: its attention ignores the cache's handoff
    cache = OffloadCache(model_a, budget_tokens=256)
    ids, mask = left_padded([20])
    with pytest.raises(RuntimeError, match="serves only the model it was built with"):
        model_b.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2)


def test_cache_reused_with_another_switched_model():
    model_a = build_model("llama")
    model_b = build_model("llama", seed=1)
    OffloadCache(model_b)  # model_b now runs the offload attention too
    cache = OffloadCache(model_a, budget_tokens=256)
    ids, mask = left_padded([20])
    with pytest.raises(RuntimeError, match="built for llama and is being used by another model"):
        model_b.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2)


def test_filled_cache_with_a_different_batch():
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=256)
    ids, mask = left_padded([20, 12])
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="use a new OffloadCache for a new batch"):
        model(input_ids=ids[:1, -3:], past_key_values=cache)


def test_host_memory_limit():
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=256, host_memory_gib=1e-6)
    ids, mask = left_padded([40])
    with pytest.raises(MemoryError, match="host_memory_gib"):
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)


def test_unknown_attention_implementation_lists_the_supported_ones():
    model = build_model("llama")
    model.config._attn_implementation = "no_such_attention"
    with pytest.raises(ValueError, match=r"no attention function registered.*'flex_attention'.*attn_implementation='sdpa'"):
        OffloadCache(model)
    assert model.config._attn_implementation == "no_such_attention"  # nothing changed


def test_paged_attention_of_continuous_batching_is_refused():
    model = build_model("llama")
    model.config._attn_implementation = "paged|eager"  # registered on every supported transformers
    with pytest.raises(ValueError, match=r"continuous batching.*attn_implementation='sdpa'"):
        OffloadCache(model)
    assert model.config._attn_implementation == "paged|eager"


def test_integer_settings_take_any_integer_type():
    np = pytest.importorskip("numpy")
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=np.int64(256), block_tokens=np.int32(8), sink_tokens=np.int64(8),
                         window_tokens=np.uint16(8), pool_tokens=np.int64(16), host_chunk_mib=np.int64(1))  # fmt: skip
    assert type(cache.config.budget_tokens) is int and cache.config.budget_tokens == 256
    assert type(cache.config.host_chunk_mib) is int
    cache.reserve(np.int64(64))
    ids, mask = left_padded([20])
    model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2)


def test_host_memory_cap_smaller_than_one_chunk_names_both_knobs_in_mib():
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=256, host_memory_gib=1e-4, host_chunk_mib=1)  # 0.1 MiB < 1 MiB
    ids, mask = left_padded([40])
    with pytest.raises(MemoryError) as caught:
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    message = str(caught.value)
    assert "host_chunk_mib" in message and "host_memory_gib" in message and "MiB" in message
    assert "0.00 GiB" not in message and "batch" not in message


def test_host_memory_cap_reached_by_growth_says_how_much_in_mib():
    from hf_offload.store import HostBlockPool, HostMemoryBudget

    budget = HostMemoryBudget(host_memory_gib=1 / 1024)  # 1 MiB
    pool = HostBlockPool((2, 1, 16, 64), torch.float32, False, chunk_bytes=768 << 10, budget=budget)
    pool.allocate(1)
    with pytest.raises(MemoryError, match=r"host_memory_gib=0\.0009765625 \(1\.0 MiB\).*1\.5 MiB"):
        pool.allocate(pool.chunk_blocks + 1)
    assert pool.used_blocks == 1  # the failed allocation took nothing


def test_tensor_parallel_model_is_refused(tmp_path):
    """A model whose weights are DTensors (``tp_plan="auto"``) is refused at once, naming device_map="auto"; run in a
    single-process gloo group so that real DTensors exist."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1")
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor
        from hf_offload import OffloadCache
        from tests.helpers import build_model
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
        model = build_model("llama")
        mesh = init_device_mesh("cpu", (1,))
        proj = model.model.layers[0].self_attn.q_proj
        proj.weight = torch.nn.Parameter(distribute_tensor(proj.weight.data, mesh, [Replicate()]))
        try:
            OffloadCache(model)
        except ValueError as e:
            print("REFUSED", e)
        else:
            print("ACCEPTED")
        print("IMPLEMENTATION", model.config._attn_implementation)
        dist.destroy_process_group()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert "model.layers.0.self_attn.q_proj.weight" in out.stdout and "device_map='auto'" in out.stdout
    assert "IMPLEMENTATION sdpa" in out.stdout  # refused before anything of the model changed
