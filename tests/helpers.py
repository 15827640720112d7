"""Shared test helpers: tiny random decoder models built from configs (no downloads), left-padded prompts, and the
small cache geometries the tests run at.

Imported by the tests (``from ..helpers import build_model``); the pytest fixtures and markers are in conftest.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

VOCAB = 97

# Cache geometries. Each test module binds the one it uses to its own name (usually ``SMALL``); a module that needs
# something else spells out the difference from one of these.
TINY_BLOCKS = dict(block_tokens=8, sink_tokens=8, window_tokens=8)
"""8-token blocks, one block of sink and one of window; budget and pools left to the test."""
TINY_PREFILL = dict(TINY_BLOCKS, pool_tokens=16, prefill_chunk_tokens=16)
"""TINY_BLOCKS with a two-block device pool and two-block prefill chunks, so prompts cross both boundaries."""
TINY_SPARSE = dict(TINY_BLOCKS, budget_tokens=48, pool_tokens=48)
"""TINY_BLOCKS at a 48-token budget (six blocks, sink and window included) with a device pool of the same size."""


def _common(**extra):
    """The shared keyword arguments of the tiny configs, updated with ``extra``."""
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(extra)
    return base


def build_config(arch: str):
    """A tiny config of ``arch``; sliding windows shorter than the test prompts where the architecture has them."""
    if arch == "llama":
        return transformers.LlamaConfig(**_common())
    if arch == "mistral":
        # Every Mistral layer would be a sliding layer (kept dense on the device); None makes them full attention.
        return transformers.MistralConfig(**_common(sliding_window=None))
    if arch == "qwen2":
        return transformers.Qwen2Config(**_common())
    if arch == "qwen3":
        return transformers.Qwen3Config(**_common(head_dim=16))
    if arch == "phi3":
        return transformers.Phi3Config(**_common(sliding_window=None, pad_token_id=0))
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **_common(
                num_hidden_layers=4,
                head_dim=16,
                sliding_window=12,
                layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            )
        )
    raise ValueError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]


def build_model(arch: str, attn_implementation: str = "sdpa", seed: int = 0):
    """A tiny random ``arch`` causal LM in float32, eval mode, on the CPU."""
    torch.manual_seed(seed)
    config = build_config(arch)
    config._attn_implementation = attn_implementation
    cls = transformers.Gemma3ForCausalLM if arch == "gemma3" else transformers.AutoModelForCausalLM
    model = cls.from_config(config, attn_implementation=attn_implementation) if cls is not transformers.Gemma3ForCausalLM else cls(config)
    # Larger weights give peaked, well-separated logits, so greedy decoding is not decided by float rounding.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.eval()


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of the given lengths, left-padded with token 0: ``(input_ids, attention_mask)``."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def tiny_recorded_model(theta: float = 1e6):
    """The tiny random Qwen2 model :func:`tiny_recording` records from (4 layers, 6 query / 2 KV heads, head size 16,
    RoPE base ``theta``), float32, eval mode; the global RNG seeded as the recording left it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=96, intermediate_size=64, num_hidden_layers=4, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=128, rope_theta=theta, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def tiny_recording(theta: float = 1e6, context: int = 40, steps: int = 3):
    """A decode recorded by ``benchmarks/workload.py`` from :func:`tiny_recorded_model`: ``context`` random tokens,
    then ``steps`` decode steps."""
    from benchmarks import workload

    model = tiny_recorded_model(theta)
    ids = torch.randint(0, 128, (context,)).tolist()
    return workload.record(model, ids, steps, layers=[0, 1, 2, 3], chunk=16, meta={"model": "tiny-qwen2"},
                           log=lambda *a: None)  # fmt: skip


def kernel_backends(module):
    """An autouse fixture that runs each test of a file once per kernel of ``module`` (which reads its ``BACKEND``
    at each call): the Triton one, and the CUDA one where CUDA runs. The test sees the backend's name."""
    @pytest.fixture(autouse=True, params=["triton", "cuda"])
    def backend(request, monkeypatch):
        if request.param == "cuda" and not torch.cuda.is_available():
            pytest.skip("needs CUDA")
        monkeypatch.setattr(module, "BACKEND", request.param)
        return request.param

    return backend
