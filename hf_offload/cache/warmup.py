"""Warm-up: one short ``generate()`` that compiles the kernels a model's caches run, before the first real call.

The kernels are Triton's, compiled at their first launch in a process (and kept in Triton's cache on disk for later
processes); the first decode step of a process pays for every kernel of the decode, and its prefill for those of the
prefill. :func:`warm_up` runs one ``generate()`` of random token ids through an :class:`OffloadCache` with the
settings and batch of the calls to come, long enough that its decode steps select (a prompt of twice the budget), so
that those calls find the kernels compiled. The cache it used is let go of, which parks its layers and graphs for
the next cache of the same settings and batch (:mod:`hf_offload.cache.parking`).
"""

from __future__ import annotations

import time

import torch


def warm_up(model: torch.nn.Module, batch_size: int = 1, prompt_tokens: int | None = None,
            new_tokens: int | None = None, generate_kwargs: dict | None = None, **cache_settings) -> dict:  # fmt: skip
    """Run one short ``generate()`` through an ``OffloadCache(model, **cache_settings)`` so that the kernels it runs
    are compiled before the first real call (a server calls this once at start).

    Args:
        model: the model the caches will serve (on its device).
        batch_size: sequences per ``generate()`` call of the calls to come (kernels are compiled per batch size
            class, and a parked state serves that batch).
        prompt_tokens: tokens of the warm-up prompt; ``None``: twice the budget (at least 1,024), so that the decode
            steps select blocks instead of attending every one. The graphs it parks read buffers of its own
            context's size (in steps of ``SUMMARY_CHUNK_BLOCKS`` blocks, 4,096 tokens of the default 16-token
            blocks), so they can serve only calls of that size: pass the context length of the calls to come.
        new_tokens: tokens generated (at least 3: the first decode steps capture the CUDA graphs). ``None``: a block
            and three more (fewer where the model's positions end first), so that the decode seals its first block
            and parks the graphs of the capacity after it too: a prompt of whole blocks at a capacity boundary
            (``decode_capacity_blocks``) moves to the next capacity at its first seal.
        generate_kwargs: further ``generate()`` arguments of the calls to come, e.g. ``{"prefill_chunk_size":
            4096}`` (a chunked prefill runs the code that reads earlier chunks' blocks).
        **cache_settings: the ``OffloadCache`` settings of the calls to come (``budget_tokens=2048``, ...).

    Returns:
        ``{"seconds", "prompt_tokens", "new_tokens", "batch_size", "graph_captures", "decode_steps",
        "attended_blocks"}``
        (``attended_blocks``: sealed blocks a decode step attended per sequence, mean: fewer than the prompt's where
        the steps selected).

    Raises:
        ValueError: a batch size, prompt length or token count that cannot run, or a prompt longer than the model's
            positions.
    """
    from .container import OffloadCache, generate_cache_kwarg

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"warm_up: batch_size must be a positive integer, got {batch_size!r}.")
    if new_tokens is not None and (isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 3):
        raise ValueError(f"warm_up: new_tokens must be an integer of at least 3 (the first decode steps capture the "
                         f"CUDA graphs), got {new_tokens!r}.")  # fmt: skip
    cache = OffloadCache(model, **cache_settings)
    if prompt_tokens is None:
        prompt_tokens = max(1024, 2 * cache.config.budget_tokens)
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"warm_up: prompt_tokens must be a positive integer, got {prompt_tokens!r}.")
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    limit = getattr(config, "max_position_embeddings", None)
    if new_tokens is None:
        new_tokens = cache.config.block_tokens + 3
        if limit is not None:
            new_tokens = max(3, min(new_tokens, limit - prompt_tokens))
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise ValueError(f"warm_up: {prompt_tokens} prompt tokens + {new_tokens} new ones exceed the model's "
                         f"{limit} positions: pass a smaller prompt_tokens.")  # fmt: skip
    embeddings = model.get_input_embeddings()
    ids = _ordinary_ids(model, embeddings.num_embeddings, (batch_size, prompt_tokens)).to(embeddings.weight.device)
    devices = {p.device for p in model.parameters() if p.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), **{generate_cache_kwarg(): cache},
                       do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                       **(generate_kwargs or {}))  # fmt: skip
    for device in devices:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    stats = cache.stats()
    del cache  # parked for the next cache of these settings and batch (where it has CUDA graphs)
    return {"seconds": seconds, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "batch_size": batch_size,
            "graph_captures": int(stats.get("graph_captures") or 0),
            "decode_steps": int(stats.get("decode_steps") or 0), "attended_blocks": stats.get("attended_blocks")}


def _ordinary_ids(model: torch.nn.Module, vocab: int, shape: tuple[int, int]) -> torch.Tensor:
    """Random token ids of the embedding table, none of them a token id the model's configs name (an image or
    video placeholder of a multimodal model, BOS, EOS, padding), fixed by a seed."""
    named: set[int] = set()
    configs = [model.config, getattr(model.config, "get_text_config", lambda: model.config)()]
    for config in configs:
        for name, value in vars(config).items():
            if name.endswith(("token_id", "token_ids", "token_index")):
                for v in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(v, int) and not isinstance(v, bool):
                        named.add(v)
    allowed = torch.tensor(sorted(set(range(vocab)) - named) if named else range(vocab), dtype=torch.long)
    generator = torch.Generator(device="cpu").manual_seed(0)
    return allowed[torch.randint(0, len(allowed), shape, generator=generator)]
