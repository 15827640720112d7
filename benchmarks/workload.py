"""A realistic decode workload: keys and queries recorded from a real model, replayed at a larger model's shape.

Which blocks a sparse decode step selects, how many of them are still on the device from the step before (the hit
rate) and how much attention the selection holds depend on the keys and queries behaving like a model's. With random
keys and queries 0.22 of the selected blocks are still resident from one step to the next (``docs/design.md``), with
Qwen2.5-Coder-0.5B and 1.5B on RULER at a 1/16 budget 0.77-0.84 (``docs/tuning.md``, from
``results/ruler_qwen05_tail/``), so a throughput benchmark on random KV measures a worst case. This module records a
real model's decode and replays it at the benchmark's shape (``results/workload/`` compares the two on a CPU):

**record** (``python benchmarks/workload.py record``): runs Qwen2.5-Coder-0.5B-Instruct (the registry's ``qwen05``)
in float32 on the CPU over a long real document (standard-library documentation, the haystack of
:mod:`eval_harness.needle`, with one needle in the middle and a question at the end), prefills it in chunks, then
decodes ``--steps`` tokens greedily. It keeps, for a subset of layers (adjacent pairs): the context's keys before
RoPE (their mean per layer and head, plus an int8 residual with one float16 scale per token and head: see
:func:`record`), and per decode step the pre-RoPE query (``q_proj``'s output) and pre-RoPE key (``k_proj``'s
output) of the new token, and lookahead's forecast of each kept layer's query (its input norm and ``q_proj`` on the
previous kept layer's input). Values are not kept (speed and selection do not depend on them). The file is
safetensors in ``.workloads/`` (git-ignored) with its metadata in the header.

**replay** (:class:`Replay`): maps the recording onto a target model (e.g. the Llama-3.1-8B shape: 32 layers,
32 query / 8 KV heads, head_dim 128) and a context of any length:

* head size: recorded RoPE pair ``i`` (dims ``i``, ``i + d/2``, frequency ``theta^(-2i/d)``) goes to target pair
  ``r*i`` (dims ``r*i``, ``r*i + D/2``) with ``r = D/d``, which turns at the same frequency ``theta^(-2ri/D)``;
  the other target pairs are zero. The target model must use the recorded ``rope_theta`` without scaling. Queries
  are multiplied by ``sqrt(D/d)``, so ``q.k / sqrt(D)`` equals the recorded ``q.k / sqrt(d)``.
* heads and layers: target layer ``j`` of sequence ``b`` takes base index ``m = (j + 2b) mod n`` into the ``n``
  kept layers; its KV head ``h`` is kept layer ``(m + h // g) mod n``, KV head ``h mod g`` (``g`` recorded KV
  heads), and its query heads are ``q_per_kv`` of that KV head's recorded query heads, evenly spaced. Consecutive
  target layers thus map to consecutive kept layers (the kept pairs stay adjacent wherever ``m`` is even).
* context: the recorded document goes last, at offset ``o = fill - n_ctx``: its key ``p`` gets RoPE at ``o + p``,
  which is the recorded post-RoPE key re-rotated by ``o`` positions (rotations compose, :func:`rotate`), and the
  decode's queries run at ``fill + t``: each query sees its document at the recorded relative positions. The first
  ``sink_tokens`` positions hold the recording's first tokens (the attention sink); between them and the document,
  copies of the recording (each key rotated to where it lies) are long-range distractors, each sequence starting
  its copies elsewhere. A context shorter than the recording keeps the first ``sink_tokens`` and the last tokens.
* the decode: :meth:`Replay.hooks` replaces ``q_proj`` / ``k_proj`` outputs of decode steps (one token per sequence)
  with the recorded step's query and key, so the model's own RoPE rotates them; values stay the model's (random).
  Lookahead's prediction of the next layer's query is the recorded forecast (an adjacent layer's in the recorded
  model for half of the transitions, across the layers between two kept pairs for the others).

``tests/benchmarks/test_workload.py`` checks the mapping on a tiny random model: replayed logits equal the recorded
ones at the target geometry, and a re-rotated key equals RoPE at the shifted position.

Examples::

    python benchmarks/workload.py record --out .workloads/qwen05_needle_16k.safetensors
    python benchmarks/workload.py info .workloads/qwen05_needle_16k.safetensors
    python benchmarks/bench_decode.py --workload recorded:.workloads/qwen05_needle_16k.safetensors ...
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hf_offload import forward_cache_kwarg  # noqa: E402

FORMAT = "hf-offload-decode-workload/1"
DEFAULT_DIR = REPO / ".workloads"


cache_keyword = forward_cache_kwarg
"""The keyword ``model.forward`` takes its cache under (:func:`hf_offload.forward_cache_kwarg`)."""


# ----------------------------------------------------------------------------------------------------------- RoPE

def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """Default RoPE frequencies ``theta^(-2i/head_dim)``, ``i < head_dim / 2``, float64 on the CPU."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def rotate(x: torch.Tensor, delta: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate post-RoPE vectors by ``delta`` more positions (rotate-half convention, default RoPE).

    ``rotate(rope(x, p), delta) == rope(x, p + delta)``: the rotations of one pair compose, so this moves a key
    recorded at position ``p`` to position ``p + delta`` without its pre-RoPE value.

    Args:
        x: ``[..., tokens, head_dim]``, any float dtype and device.
        delta: ``[tokens]`` integer (any sign) or a Python ``int``, on ``x``'s device or the CPU.
        theta: the RoPE base the vectors were rotated with.

    Returns:
        ``x`` rotated, float32, ``x``'s shape and device.
    """
    d = x.shape[-1]
    if not torch.is_tensor(delta):
        delta = torch.full((x.shape[-2],), int(delta))
    # float64 angles: positions of 10^5 times frequencies near 1 keep their fraction of a turn exactly enough.
    angle = delta.to("cpu", torch.float64)[:, None] * rope_inv_freq(theta, d)[None, :]
    cos = angle.cos().to(x.device, torch.float32)
    sin = angle.sin().to(x.device, torch.float32)
    x = x.float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_at(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Apply default RoPE at ``positions`` to pre-RoPE vectors ``x`` (``[..., tokens, head_dim]``), float32."""
    return rotate(x, positions, theta)


def embed_head(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Place ``d``-dim RoPE vectors into ``head_dim`` dims so that every pair keeps its rotation frequency.

    Recorded pair ``i`` (dims ``i``, ``i + d/2``) goes to pair ``r*i`` (dims ``r*i``, ``r*i + head_dim/2``), with
    ``r = head_dim / d``; under ``theta^(-2k/head_dim)`` pair ``r*i`` turns at ``theta^(-2i/d)``, as recorded. The
    other dims are zero, so dot products are unchanged.

    Args:
        x: ``[..., d]``.
        head_dim: the target head size, a multiple of ``d``.

    Returns:
        ``[..., head_dim]``, ``x``'s dtype and device.
    """
    d = x.shape[-1]
    r = head_dim // d
    out = x.new_zeros(*x.shape[:-1], head_dim)
    half = d // 2
    out[..., 0 : head_dim // 2 : r] = x[..., :half]
    out[..., head_dim // 2 :: r] = x[..., half:]
    return out


# ------------------------------------------------------------------------------------------------------ recording
@dataclass
class Recording:
    """A recorded decode (see the module docstring), in CPU memory.

    Attributes:
        keys: ``[n_layers, kv_heads, context, head_dim]`` int8, the kept layers' pre-RoPE context keys less their
            mean.
        key_scales: ``[n_layers, kv_heads, context]`` float16.
        key_means: ``[n_layers, kv_heads, head_dim]`` float32: the context's pre-RoPE key of token ``p`` is
            ``key_means + keys[..., p, :] * key_scales[..., p, None]``.
        queries: ``[n_layers, steps, q_heads, head_dim]`` float32, pre-RoPE queries of the decode steps (step ``t`` at
            position ``context + t``).
        new_keys: ``[n_layers, steps, kv_heads, head_dim]`` float32, pre-RoPE keys of the decode steps' tokens.
        token_ids: ``[context + steps]`` int64: the prompt, then the greedy tokens fed to the decode steps.
        forecasts: ``[n_layers, steps, q_heads, head_dim]`` float32 or ``None`` (files recorded before it): per
            kept layer ``i`` and decode step, the pre-RoPE query that kept layer ``i``'s own input norm and
            ``q_proj`` give on the input of the kept layer before it (``(i - 1) mod n_layers``): what a layer-ahead
            lookahead predicts (``hf_offload.cache.lookahead``); from the layer just before where the two are a kept
            pair, else from a farther one.
        meta: the header's metadata (``model``, ``rope_theta``, ``head_dim``, ``layers``, ``context``, ``steps``,
            ``text_source``, ``token_ids_sha256``, ...).
        path: the file it was read from, if any.
        file_sha256: SHA-256 of that file.
    """

    keys: torch.Tensor
    key_scales: torch.Tensor
    key_means: torch.Tensor
    queries: torch.Tensor
    new_keys: torch.Tensor
    token_ids: torch.Tensor
    meta: dict
    path: str | None = None
    file_sha256: str | None = None
    forecasts: torch.Tensor | None = None

    @property
    def n_layers(self) -> int:
        """Kept layers."""
        return self.keys.shape[0]

    @property
    def kv_heads(self) -> int:
        """Recorded KV heads per layer."""
        return self.keys.shape[1]

    @property
    def context(self) -> int:
        """Context tokens before the first decode step."""
        return self.keys.shape[2]

    @property
    def head_dim(self) -> int:
        """Recorded head size."""
        return self.keys.shape[3]

    @property
    def steps(self) -> int:
        """Recorded decode steps."""
        return self.queries.shape[1]

    @property
    def q_heads(self) -> int:
        """Recorded query heads per layer."""
        return self.queries.shape[2]

    @property
    def rope_theta(self) -> float:
        """The recorded model's RoPE base."""
        return float(self.meta["rope_theta"])

    def describe(self) -> dict:
        """What a results file should say about this workload: file, its SHA-256, model and sizes."""
        return {
            "kind": "recorded", "file": Path(self.path).name if self.path else None, "sha256": self.file_sha256,
            "model": self.meta.get("model"), "layers": self.meta.get("layers"), "context": self.context,
            "steps": self.steps, "head_dim": self.head_dim, "rope_theta": self.rope_theta,
            "text_source": self.meta.get("text_source"), "token_ids_sha256": self.meta.get("token_ids_sha256"),
            "forecasts": self.forecasts is not None,
        }  # fmt: skip

    def save(self, path: str | Path) -> Path:
        """Write as safetensors (no pickle), the metadata JSON-encoded under the header key ``workload``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"keys": self.keys, "key_scales": self.key_scales, "key_means": self.key_means,
                   "queries": self.queries, "new_keys": self.new_keys, "token_ids": self.token_ids}  # fmt: skip
        if self.forecasts is not None:
            tensors["forecasts"] = self.forecasts
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
                  metadata={"format": FORMAT, "workload": json.dumps(self.meta)})  # fmt: skip
        self.path, self.file_sha256 = str(path), file_sha256(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        """Read a file :meth:`save` wrote; raises ``ValueError`` for any other file."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no workload file at {path}; record one with `python benchmarks/workload.py "
                                    f"record --out {path}`")  # fmt: skip
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            if header.get("format") != FORMAT:
                raise ValueError(f"{path} is not a decode workload (format {header.get('format')!r}, expected "
                                 f"{FORMAT!r})")  # fmt: skip
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        names = ("keys", "key_scales", "key_means", "queries", "new_keys", "token_ids")
        return cls(*(tensors[k] for k in names), json.loads(header["workload"]), str(path), file_sha256(path),
                   tensors.get("forecasts"))  # fmt: skip

    def layer_keys(self, index: int) -> torch.Tensor:
        """Kept layer ``index``'s pre-RoPE context keys, dequantized: ``[kv_heads, context, head_dim]`` float32."""
        return self.key_means[index][:, None] + self.keys[index].float() * self.key_scales[index].float()[..., None]


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: ``(codes int8, scales float16)`` with ``x ~= codes * scales[..., None]``."""
    scale = (x.abs().amax(-1) / 127.0).clamp_min(1e-8).half()
    codes = torch.round(x / scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, scale


def kept_layers(n_layers: int, pairs: int) -> list[int]:
    """``pairs`` adjacent layer pairs ``(i, i + 1)`` spread evenly over ``n_layers``, as a sorted list.

    A lookahead plans layer ``i + 1`` from layer ``i``, so the pairs keep two consecutive layers together.
    """
    if pairs * 2 >= n_layers:
        return list(range(n_layers))
    starts = [round(k * (n_layers - 2) / (pairs - 1)) if pairs > 1 else 0 for k in range(pairs)]
    return sorted({i for s in starts for i in (s, s + 1)})


def record(model, prompt_ids: list[int], steps: int, layers: list[int], chunk: int = 1024,
           meta: dict | None = None, log=print) -> Recording:  # fmt: skip
    """Prefill ``prompt_ids`` in chunks, decode ``steps`` tokens greedily, and keep what a replay needs.

    The context's keys are kept before RoPE (``k_proj``'s output: a replay rotates them to wherever it places them,
    which equals re-rotating the cached post-RoPE keys, since rotations compose), as their mean per layer and head
    (float32) plus an int8 residual with one scale per token and head. The mean holds ``k_proj``'s bias and the
    other constant directions, which in Qwen2's first layer are ten times the rest of the key: quantizing the whole
    post-RoPE key per token moved the first layer's logits by up to 4.7 standard deviations, the residual by 0.17
    (a 1,500-token document).

    Args:
        model: a Llama-form causal LM (``self_attn.q_proj`` / ``k_proj``, default RoPE), in eval mode.
        prompt_ids: the prompt's token ids.
        steps: greedy decode steps to record.
        layers: indices of the decoder layers to keep.
        chunk: prefill tokens per forward.
        meta: extra metadata to store.
        log: progress printer.

    Returns:
        The :class:`Recording` (not yet saved).
    """

    from transformers import DynamicCache

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q_heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    theta, _ = _rope_of(cfg)
    device = next(model.parameters()).device
    n = len(prompt_ids)
    ids = torch.tensor([prompt_ids], device=device)
    cache = DynamicCache(config=cfg)
    kw = cache_keyword(model)
    captured: dict[str, list] = {"q_proj": [], "k_proj": []}
    handles = []
    for name, store in captured.items():
        for i in layers:
            module = getattr(model.model.layers[i].self_attn, name)
            handles.append(module.register_forward_hook(
                lambda mod, args, out, store=store: store.append(out.detach()[0].float().cpu())))  # fmt: skip
    inputs: dict[int, torch.Tensor] = {}  # kept layer -> its input hidden state at the current decode step
    for i in layers:
        handles.append(model.model.layers[i].register_forward_pre_hook(
            lambda mod, args, kwargs, i=i: inputs.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0, -1]
                                                              .detach()), with_kwargs=True))  # fmt: skip
    forecasts = []
    t0 = time.perf_counter()
    generated = []
    try:
        with torch.inference_mode():
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                out = model(input_ids=ids[:, s:e], position_ids=torch.arange(s, e, device=device)[None],
                            use_cache=True, logits_to_keep=1, **{kw: cache})  # fmt: skip
                log(f"prefill {e:,}/{n:,} tokens, {time.perf_counter() - t0:.0f} s")
            n_kept = len(layers)
            pre = captured["k_proj"]  # chunk-major, then layer: [tokens, kv_heads * head_dim] each
            keys = torch.stack([torch.cat(pre[li::n_kept]) for li in range(n_kept)])  # [L, n, kv * d]
            keys = keys.view(n_kept, n, kv_heads, head_dim).transpose(1, 2).contiguous()  # [L, kv, n, d]
            for store in captured.values():
                store.clear()
            token = out.logits[:, -1:].argmax(-1)
            for t in range(steps):
                generated.append(int(token))
                out = model(input_ids=token, position_ids=torch.full((1, 1), n + t, device=device), use_cache=True,
                            logits_to_keep=1, **{kw: cache})  # fmt: skip
                token = out.logits[:, -1:].argmax(-1)
                forecasts.append(_forecasts(model, layers, inputs))
    finally:
        for h in handles:
            h.remove()
    log(f"decoded {steps} steps, {time.perf_counter() - t0:.0f} s")
    q = torch.stack(captured["q_proj"]).view(steps, n_kept, q_heads, head_dim).transpose(0, 1).contiguous()
    k = torch.stack(captured["k_proj"]).view(steps, n_kept, kv_heads, head_dim).transpose(0, 1).contiguous()
    # The captured keys, rotated at their positions, must be the keys the cache holds (the Llama form assumed).
    post = cache.layers[layers[-1]].keys[0].float().cpu()  # [kv, n + steps, d]
    ours = torch.cat((rope_at(keys[-1], torch.arange(n), theta), rope_at(k[-1].transpose(0, 1), n + torch.arange(
        steps), theta)), dim=1)  # fmt: skip
    if not torch.allclose(ours, post, rtol=1e-3, atol=1e-3 * post.abs().max().item()):
        raise RuntimeError("the captured k_proj outputs, rotated by RoPE at their positions, are not the keys the "
                           "cache holds: the model is not of the Llama form this recorder assumes (default RoPE, "
                           "rotate-half, no key norm)")  # fmt: skip
    means = keys.mean(2)  # [L, kv, d]
    codes, scales = quantize_int8(keys - means[:, :, None])
    token_ids = torch.tensor(list(prompt_ids) + generated, dtype=torch.int64)
    f = torch.stack(forecasts).view(steps, n_kept, q_heads, head_dim).transpose(0, 1).contiguous()
    rec = Recording(codes, scales, means, q, k, token_ids, {}, forecasts=f)
    # How far int8 moves the first decode step's logits, relative to their spread over the context (worst head).
    q0 = rope_at(q[:, 0][:, :, None], torch.tensor([n]), theta)[:, :, 0]  # [L, q_heads, d]
    g = q_heads // kv_heads
    pos = torch.arange(n)
    errors = []
    for li in range(n_kept):
        exact = torch.einsum("hd,hnd->hn", q0[li], rope_at(keys[li], pos, theta).repeat_interleave(g, 0))
        approx = torch.einsum("hd,hnd->hn", q0[li], rope_at(rec.layer_keys(li), pos, theta).repeat_interleave(g, 0))
        errors.append(float(((exact - approx).abs().amax(-1) / exact.std(-1)).max()))
    rec.meta = {
        **(meta or {}),
        "model_type": cfg.model_type, "rope_theta": theta, "rope_type": "default", "head_dim": head_dim,
        "model_layers": cfg.num_hidden_layers, "q_heads": q_heads, "kv_heads": kv_heads, "layers": list(layers),
        "context": n, "steps": steps, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "keys": "pre-RoPE k_proj outputs of the context: key_means [layer, head, dim] float32 + keys int8 "
                "[layer, head, token, dim] * key_scales float16 [layer, head, token]",
        "generated_ids": generated,
        "token_ids_sha256": hashlib.sha256(token_ids.numpy().tobytes()).hexdigest(),
        "keys_int8_logit_error": errors,
        "forecasts": "per kept layer i and step, the pre-RoPE query of kept layer i's input_layernorm and q_proj on "
                     "the input of kept layer (i - 1) mod n (lookahead's prediction; the layer just before where the "
                     "two are a pair)",
        "record_s": time.perf_counter() - t0,
    }  # fmt: skip
    return rec


def _forecasts(model, layers: list[int], inputs: dict) -> torch.Tensor:
    """One decode step's :attr:`Recording.forecasts`: ``[n_kept, q_heads * head_dim]`` float32, CPU. Kept layer
    ``layers[i]``'s input norm and query projection (its weights, not its module call: the recording's ``q_proj``
    hooks must not see it) on the input of ``layers[i - 1]`` (``inputs``)."""
    rows = []
    for i, layer_index in enumerate(layers):
        layer = model.model.layers[layer_index]
        source = inputs[layers[(i - 1) % len(layers)]]
        q_proj = layer.self_attn.q_proj
        rows.append(torch.nn.functional.linear(layer.input_layernorm(source[None]), q_proj.weight, q_proj.bias)[0])
    return torch.stack(rows).float().cpu()


def needle_document(tokenizer, context: int, seed: int = 0) -> tuple[list[int], dict]:
    """A prompt of exactly ``context`` tokens: standard-library documentation (the haystack of
    :mod:`eval_harness.needle`), one needle at about 40% of it, and a question at the end whose answer needs the
    needle and then the document as a whole; in the tokenizer's chat template.

    Returns:
        ``(token ids, description for the metadata)``.
    """
    import random

    from eval_harness.needle import NEEDLE_KEYS, NEEDLE_TEMPLATE, haystack_info, haystack_text

    rng = random.Random(seed)
    key, value = rng.choice(NEEDLE_KEYS), str(rng.randrange(1_000_000, 10_000_000))
    question = (f"What is the special magic number for {key} mentioned in the text above? Then list the Python modules "
                "whose documentation appears above and say in one sentence what each of them does.")  # fmt: skip
    marker = "\x00"
    wrapped = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                            tokenize=False)  # fmt: skip
    head, tail = wrapped.split(marker)

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    paragraphs = [p + "\n\n" for p in haystack_text().split("\n\n") if p.strip()]
    before, after = enc(head), enc("\n\n" + question + tail)
    needle = enc(NEEDLE_TEMPLATE.format(key=key, value=value) + "\n\n")
    room = context - len(before) - len(after) - len(needle)
    hay: list[int] = []
    starts = []
    i = 0
    while len(hay) < room:  # whole paragraphs (the text repeats if short), trimmed at the end
        starts.append(len(hay))
        hay += enc(paragraphs[i % len(paragraphs)])
        i += 1
    hay = hay[:room]
    insert = min((s for s in starts if s <= room), key=lambda s: abs(s - 0.4 * room))
    ids = before + hay[:insert] + needle + hay[insert:] + after
    assert len(ids) == context, (len(ids), context)
    info = {"text_source": "eval_harness.needle haystack: " + haystack_info()["source"],
            "text_licence": haystack_info()["licence"], "text_sha256": haystack_info()["sha256"],
            "python": haystack_info()["python"], "needle": {"key": key, "value": value, "position":
            len(before) + insert}, "question": question}  # fmt: skip
    return ids, info


# --------------------------------------------------------------------------------------------------------- replay
def _rope_of(config) -> tuple[float, int]:
    """``(rope_theta, head_dim)`` of a transformers config with default RoPE over the whole head; ``ValueError``
    otherwise (the recorder and the replay rotate with the default frequencies only)."""
    params = getattr(config, "rope_parameters", None)
    params = params if isinstance(params, dict) else {}
    scaling = getattr(config, "rope_scaling", None)
    kind = params.get("rope_type") or (scaling or {}).get("rope_type") or "default"
    if kind != "default" or getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"the model's RoPE is {kind!r} (partial_rotary_factor "
                         f"{getattr(config, 'partial_rotary_factor', 1.0)}); the replay needs default RoPE over the "
                         "whole head: use a model without rope scaling")  # fmt: skip
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return float(theta), int(head_dim)


@dataclass
class Replay:
    """A :class:`Recording` mapped onto a target model's attention geometry and context (module docstring).

    Build it, fill each cache with :meth:`fill`, and run the decode steps inside :meth:`hooks`; the decode must start
    at position ``fill_tokens`` (the token after the filled ones) and run one token per sequence and step.

    Attributes:
        recording: the recorded decode.
        config: the target model's transformers config (Llama form, default RoPE with the recorded ``rope_theta``).
        batch: sequences.
        fill_tokens: context tokens per sequence written by :meth:`fill`; decode step ``t`` runs at position
            ``fill_tokens + t``.
        device: where the keys and the decode inputs are built (the model's device).
        dtype: the model's dtype.
        sink_tokens: the recording's first tokens (the attention sink), kept at positions ``0..sink_tokens - 1`` of
            every sequence, before the tiled copies or, where ``fill_tokens`` is shorter than the recording, its tail.
    """

    recording: Recording
    config: object
    batch: int
    fill_tokens: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.bfloat16
    sink_tokens: int = 4

    def __post_init__(self):
        rec, cfg = self.recording, self.config
        self.device = torch.device(self.device)
        theta, self.head_dim = _rope_of(cfg)
        d = rec.head_dim
        if abs(theta - rec.rope_theta) > 1e-6 * rec.rope_theta:
            raise ValueError(f"the target model's rope_theta is {theta:g}, the recording's {rec.rope_theta:g}: build "
                             f"the model with rope_theta={rec.rope_theta:g} (speed does not depend on it)")  # fmt: skip
        if self.head_dim % d or (self.head_dim // d) & (self.head_dim // d - 1):
            raise ValueError(f"target head_dim {self.head_dim} is not a power-of-two multiple of the recorded "
                             f"{d}: record from a model whose head_dim divides it (e.g. 64 for 128)")  # fmt: skip
        self.kv_heads = cfg.num_key_value_heads
        self.q_per_kv = cfg.num_attention_heads // self.kv_heads
        self.layers = cfg.num_hidden_layers
        g_rec = rec.q_heads // rec.kv_heads
        if self.q_per_kv > g_rec:
            raise ValueError(f"the target has {self.q_per_kv} query heads per KV head, the recording {g_rec}: "
                             f"record from a model with at least {self.q_per_kv}")  # fmt: skip
        if self.fill_tokens <= self.sink_tokens:
            raise ValueError(f"fill_tokens ({self.fill_tokens}) must exceed sink_tokens ({self.sink_tokens})")
        # Evenly spaced query heads of each recorded group (all of them where the counts agree).
        self.q_pick = [round(i * (g_rec - 1) / max(self.q_per_kv - 1, 1)) for i in range(self.q_per_kv)]
        self.scale = math.sqrt(self.head_dim / d)
        self._cos_sin = None
        self._tables = None
        self._index = None
        self.step = 0

    # ----------------------------------------------------------------------------------------------- the mapping
    def base(self, layer: int, seq: int) -> int:
        """Index into the kept layers of target ``layer``'s KV head 0 for sequence ``seq``: ``(layer + 2 seq) mod
        n`` (each sequence starts two kept layers further; pairs stay aligned)."""
        return (layer + 2 * seq) % self.recording.n_layers

    def source(self, layer: int, head: int, seq: int = 0) -> tuple[int, int]:
        """``(kept layer index, recorded KV head)`` that target ``layer``'s KV ``head`` replays for ``seq``."""
        g = self.recording.kv_heads
        return (self.base(layer, seq) + head // g) % self.recording.n_layers, head % g

    def query_heads(self, head: int) -> list[int]:
        """Recorded query heads (within a layer) of target KV ``head``'s query heads, in target order."""
        g_rec = self.recording.q_heads // self.recording.kv_heads
        kv = head % self.recording.kv_heads
        return [kv * g_rec + i for i in self.q_pick]

    def token_index(self, seq: int) -> torch.Tensor:
        """``[fill_tokens]`` int64: the recorded token each target position of ``seq`` replays.

        The recording (``n`` tokens) fills the last ``n`` positions; before it, copies of the recording without its
        first ``sink_tokens`` tokens, cyclically from a per-sequence start, after those sink tokens at positions 0..
        Shorter than the recording: the first ``sink_tokens`` tokens and the last ones.
        """
        n, s, fill = self.recording.context, self.sink_tokens, self.fill_tokens
        if fill <= n:
            return torch.cat((torch.arange(s), torch.arange(n - (fill - s), n)))
        prefix = fill - n
        shift = (seq * (n - s)) // max(self.batch, 1)
        body = s + (shift + torch.arange(max(prefix - s, 0))) % (n - s)
        return torch.cat((torch.arange(min(s, prefix)), body, torch.arange(n)))

    # -------------------------------------------------------------------------------------------------- the keys
    def _on_device(self):
        if self._tables is None:
            rec = self.recording
            self._tables = {"codes": rec.keys.to(self.device), "scales": rec.key_scales.to(self.device),
                            "means": rec.key_means.to(self.device)}  # fmt: skip
        return self._tables

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[fill_tokens, d/2]`` float32 at the target positions (float64 angles)."""
        if self._cos_sin is None:
            angle = torch.arange(self.fill_tokens, dtype=torch.float64)[:, None] * rope_inv_freq(
                self.recording.rope_theta, self.recording.head_dim)[None]  # fmt: skip
            self._cos_sin = (angle.cos().float().to(self.device), angle.sin().float().to(self.device))
        return self._cos_sin

    def layer_keys(self, layer: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Post-RoPE keys of target ``layer`` for positions ``start:end``.

        Returns:
            ``[batch, kv_heads, end - start, head_dim]``, :attr:`dtype`, on :attr:`device`.
        """
        end = self.fill_tokens if end is None else end
        t = self._on_device()
        cos, sin = (x[start:end] for x in self._rope_table())
        d = self.recording.head_dim
        out = torch.empty(self.batch, self.kv_heads, end - start, self.head_dim, dtype=self.dtype, device=self.device)
        if self._index is None:
            self._index = [self.token_index(b).to(self.device) for b in range(self.batch)]
        for b in range(self.batch):
            idx = self._index[b][start:end]
            src = [self.source(layer, h, b) for h in range(self.kv_heads)]
            li = torch.tensor([s[0] for s in src], device=self.device)
            hi = torch.tensor([s[1] for s in src], device=self.device)
            k = t["means"][li, hi][:, None] + t["codes"][li, hi][:, idx].float() * t["scales"][li, hi][:, idx, None]
            k1, k2 = k[..., : d // 2], k[..., d // 2 :]
            k = torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=-1)
            out[b] = embed_head(k, self.head_dim).to(self.dtype)
        return out

    def fill(self, cache, chunk: int = 4096, seed: int = 0) -> None:
        """Write the replayed keys (and random values) of every layer into ``cache``, without running the model.

        An :class:`~hf_offload.cache.OffloadCache` receives ``chunk`` tokens per ``update`` call of each layer (it
        seals, offloads and summarises its blocks as after a prefill, as :func:`hf_offload.tools.bench.fill_random`
        does); any other transformers cache one ``cache.update`` per layer.

        Args:
            cache: the cache, empty, built for the target model.
            chunk: tokens per ``update`` of an OffloadCache layer.
            seed: seeds the values (a generator on :attr:`device`).
        """
        from hf_offload import OffloadLayer
        from hf_offload.attention import take_handoff

        g = torch.Generator(device=self.device).manual_seed(seed)
        if hasattr(cache, "reserve"):
            cache.reserve(self.fill_tokens)
        if not hasattr(cache, "offload_layers"):
            for j in range(self.layers):
                k = self.layer_keys(j)
                cache.update(k, torch.randn(k.shape, dtype=k.dtype, device=k.device, generator=g), j)
                del k
            return
        for j, layer in enumerate(cache.layers):
            for start in range(0, self.fill_tokens, chunk):
                k = self.layer_keys(j, start, min(self.fill_tokens, start + chunk))
                layer.update(k, torch.randn(k.shape, dtype=k.dtype, device=k.device, generator=g))
                if isinstance(layer, OffloadLayer):
                    take_handoff()  # no attention runs for a fill
                    layer.finish_step()

    # ------------------------------------------------------------------------------------------------ the decode
    def step_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every recorded step's query and key at the target geometry, per base index (:meth:`base`).

        Returns:
            ``(q [steps, n_kept, q_heads * head_dim], k [steps, n_kept, kv_heads * head_dim])``, pre-RoPE,
            :attr:`dtype`, on :attr:`device`; queries scaled by ``sqrt(head_dim / recorded head_dim)``.
        """
        rec = self.recording
        k = torch.empty(rec.steps, rec.n_layers, self.kv_heads, self.head_dim)
        for m in range(rec.n_layers):
            for h in range(self.kv_heads):
                li, hi = (m + h // rec.kv_heads) % rec.n_layers, h % rec.kv_heads
                k[:, m, h] = embed_head(rec.new_keys[li][:, hi], self.head_dim)
        return self._query_table(rec.queries), k.flatten(2).to(self.device, self.dtype)

    def forecast_table(self) -> torch.Tensor | None:
        """Every recorded step's forecast query (:attr:`Recording.forecasts`) at the target geometry, per base index,
        laid out as :meth:`step_tables`' queries: ``[steps, n_kept, q_heads * head_dim]``; ``None`` where the
        recording has none. Target layer ``j``'s KV head ``h`` takes the forecast of the kept layer its query comes
        from, made on the input of the kept layer that target layer ``j - 1``'s head ``h`` comes from."""
        forecasts = self.recording.forecasts
        return None if forecasts is None else self._query_table(forecasts)

    def _query_table(self, queries: torch.Tensor) -> torch.Tensor:
        """Recorded per-layer queries ``[n_kept, steps, q_heads, head_dim]`` at the target geometry and scale."""
        rec = self.recording
        q = torch.empty(rec.steps, rec.n_layers, self.kv_heads * self.q_per_kv, self.head_dim)
        for m in range(rec.n_layers):
            for h in range(self.kv_heads):
                li = (m + h // rec.kv_heads) % rec.n_layers
                q[:, m, h * self.q_per_kv : (h + 1) * self.q_per_kv] = embed_head(
                    queries[li][:, self.query_heads(h)] * self.scale, self.head_dim)  # fmt: skip
        return q.flatten(2).to(self.device, self.dtype)

    @contextlib.contextmanager
    def hooks(self, model):
        """Within this context, every decode step of ``model`` (one token per sequence) attends with the recorded
        step's query and key: the outputs of each decoder layer's ``self_attn.q_proj`` and ``k_proj`` are replaced
        (forward hooks, removed on exit), so the model's own RoPE rotates them.

        Step ``t`` (counted from 0 at entry, wrapping after the recorded steps) is loaded into fixed buffers by a
        pre-hook on ``model`` before its forward, and each projection's hook returns a copy of its layer's row: a
        CUDA graph captured around a decoder layer reads those buffers, so replays see later steps. A projection
        called outside its own layer's attention keeps its own output. Where the recording has forecasts, the
        lookahead's prediction of a layer's query (``hf_offload.cache.recaller.speculative_query``, replaced within
        this context) is the recorded forecast, rotated by the step's RoPE, in place of what the random weights
        give (which it still computes, so the step keeps its cost). Forwards of more than one token (a prefill) are
        left unchanged.

        Args:
            model: the target causal LM (``model.model.layers[j].self_attn``), with ``config`` the one given here.

        Yields:
            This replay (``step``: decode steps run so far).
        """
        q_table, k_table = self.step_tables()
        index = torch.tensor([[self.base(j, b) for b in range(self.batch)] for j in range(self.layers)],
                             device=self.device)  # fmt: skip
        q_buf = q_table[0][index].clone()  # [layers, batch, q_heads * head_dim]
        k_buf = k_table[0][index].clone()
        f_table = self.forecast_table()
        f_buf = None if f_table is None else f_table[0][index].clone()
        state = {"decode": False, "active": None}
        handles = []
        self.step = 0
        steps = self.recording.steps

        def before_forward(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            x = ids if ids is not None else kwargs.get("inputs_embeds")
            state["decode"] = x is not None and x.shape[1] == 1
            if state["decode"]:
                if x.shape[0] != self.batch:
                    raise ValueError(f"the replay was built for batch {self.batch}, the decode runs {x.shape[0]}")
                t = self.step % steps
                q_buf.copy_(q_table[t][index])
                k_buf.copy_(k_table[t][index])
                if f_buf is not None:
                    f_buf.copy_(f_table[t][index])
                self.step += 1

        def replace(buf, j):
            def hook(module, args, out):
                if state["decode"] and state["active"] == j and out.shape[1] == 1:
                    return buf[j][:, None].clone()
                return out

            return hook

        def enter(j):
            def hook(module, args, kwargs=None):
                state["active"] = j

            return hook

        def leave(module, args, out):
            state["active"] = None

        layers = model.model.layers
        if len(layers) != self.layers:
            raise ValueError(f"the model has {len(layers)} decoder layers, the replay was built for {self.layers}")
        from hf_offload.cache import recaller
        from hf_offload.cache.lookahead import _rotate_half as rotate_half

        predict = recaller.speculative_query
        layer_of = {id(layer): j for j, layer in enumerate(layers)}

        def forecast(decoder_layer, hidden, position_embeddings):
            own = predict(decoder_layer, hidden, position_embeddings)  # the random weights' (its cost stays)
            j = layer_of.get(id(decoder_layer))
            if own is None or j is None or not state["decode"] or own.shape[2] != 1:
                return own
            cos, sin = (x.unsqueeze(1) for x in position_embeddings)
            q = f_buf[j].view(own.shape[0], own.shape[1], 1, own.shape[3]).to(own.dtype)
            return q * cos + rotate_half(q) * sin  # the rotation speculative_query applies

        try:
            if f_buf is not None:
                recaller.speculative_query = forecast
            handles.append(model.register_forward_pre_hook(before_forward, with_kwargs=True))
            for j, layer in enumerate(layers):
                attn = layer.self_attn
                handles.append(attn.register_forward_pre_hook(enter(j)))
                handles.append(attn.register_forward_hook(leave))
                handles.append(attn.q_proj.register_forward_hook(replace(q_buf, j)))
                handles.append(attn.k_proj.register_forward_hook(replace(k_buf, j)))
            yield self
        finally:
            recaller.speculative_query = predict
            for h in handles:
                h.remove()

    def describe(self) -> dict:
        """The recording's :meth:`Recording.describe` plus the mapping's settings."""
        return {**self.recording.describe(), "target_head_dim": self.head_dim, "target_kv_heads": self.kv_heads,
                "q_per_kv": self.q_per_kv, "query_heads_of_group": self.q_pick, "query_scale": self.scale,
                "fill_tokens": self.fill_tokens, "sink_tokens": self.sink_tokens,
                "mapping": "target layer j, KV head h, sequence b <- kept layer (j + 2b + h // g) mod n, head h mod g; "
                           "recorded document last, earlier positions cyclic copies; values random",
                "lookahead_forecast": "recorded (the recorded model's prediction of each kept layer's query from the "
                                      "kept layer before it)" if self.recording.forecasts is not None else
                                      "the target's random weights (the recording has no forecasts)"}  # fmt: skip


def load_workload(spec: str) -> Recording | None:
    """``"random"`` -> ``None``; ``"recorded:PATH"`` -> the :class:`Recording` at ``PATH``; else ``ValueError``."""
    if spec == "random":
        return None
    kind, sep, path = spec.partition(":")
    if kind != "recorded" or not sep or not path:
        raise ValueError(f"workload must be 'random' or 'recorded:PATH', got {spec!r}")
    return Recording.load(path)


RANDOM_WORKLOAD = {"kind": "random", "label": "random KV (worst case)"}


def workload_row(env: dict) -> dict:
    """What each result row says about its workload: random, or the recording's (``env["recording"]``) file, SHA-256
    and model."""
    rec = env.get("recording")
    if rec is None:
        return dict(RANDOM_WORKLOAD)
    d = rec.describe()
    return {"kind": "recorded", "label": f"recorded {d['file']} ({d['model']})", "file": d["file"],
            "sha256": d["sha256"], "model": d["model"]}  # fmt: skip


# ------------------------------------------------------------------------------------------------- CPU hit rate
GEOMETRIES = {
    # The attention of the Llama-3.1-8B shape (32 query / 8 KV heads, head_dim 128) on a few thin layers: what the
    # throughput benchmarks replay at, small enough for a CPU.
    "llama-8b-attention": dict(hidden_size=256, intermediate_size=512, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, vocab_size=1024),
    # The recorded model's own attention geometry (Qwen2.5-0.5B: 14 query / 2 KV heads, head_dim 64).
    "qwen05-attention": dict(hidden_size=224, intermediate_size=512, num_attention_heads=14, num_key_value_heads=2,
                             head_dim=64, vocab_size=1024),
}  # fmt: skip


def measure_hit_rate(recording: Recording | None, geometry: str, layers: int, context: int, batch: int,
                     budget: int, steps: int, selector: str, warmup: int = 1, **settings) -> dict:  # fmt: skip
    """Decode ``steps`` tokens on the CPU through a random-weight Llama model of ``geometry`` with an
    ``OffloadCache`` and return its selection statistics.

    Args:
        recording: the workload to replay, or ``None`` for random keys and values (and the model's own queries).
        geometry: a key of :data:`GEOMETRIES`.
        layers: decoder layers.
        context: tokens per sequence at the first decode step.
        batch: sequences.
        budget: ``budget_tokens``.
        steps: decode steps counted (after ``warmup`` uncounted ones: the first step's selection has nothing
            resident to hit).
        selector: the selector spec.
        warmup: decode steps before the counters are reset.
        settings: further ``OffloadCache`` settings (e.g. ``max_budget_tokens`` and ``missed_mass_target``).

    Returns:
        ``hit_rate``, ``selected_mass`` (``1 - tail_share`` where the selector estimates the rest, else ``None``),
        ``missed_mass`` (``stats()["missed_mass"]``), ``attended_tokens`` (sealed tokens a step attended per
        sequence, mean), ``hit_rate_per_layer``, ``seconds``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_offload import OffloadCache, disable_offload_attention
    from hf_offload.tools.bench import fill_random

    theta = recording.rope_theta if recording is not None else 1e6
    cfg = LlamaConfig(**GEOMETRIES[geometry], num_hidden_layers=layers, rope_theta=theta,
                      max_position_embeddings=context + warmup + steps + 16)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    t0 = time.perf_counter()
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        cache = OffloadCache(model, budget_tokens=budget, selector=selector, **settings)
        if recording is not None:
            replay = Replay(recording, cfg, batch, context, torch.device("cpu"), dtype=torch.float32)
            replay.fill(cache)
            stack.enter_context(replay.hooks(model))
        else:
            cache.reserve(context)
            fill_random(cache, batch, context, cfg.num_key_value_heads, cfg.head_dim, "cpu", dtype=torch.float32)
        ids = torch.zeros(batch, 1, dtype=torch.long)
        mask = torch.ones(batch, context + warmup + steps, dtype=torch.long)
        for i in range(warmup + steps):
            if i == warmup:
                cache.reset_stats()
            pos = context + i
            out = model(input_ids=ids, position_ids=torch.full((batch, 1), pos), attention_mask=mask[:, : pos + 1],
                        use_cache=True, logits_to_keep=1, **{cache_keyword(model): cache})  # fmt: skip
            ids = out.logits[:, -1:].argmax(-1)
        stats = cache.stats()
    disable_offload_attention(model)
    return {
        "hit_rate": stats["hit_rate"],
        "selected_mass": None if stats["tail_share"] is None else 1.0 - stats["tail_share"],
        "missed_mass": stats["missed_mass"],
        "attended_tokens": stats["attended_blocks"] * cache.config.block_tokens,
        "hit_rate_per_layer": {str(k): v["hit_rate"] for k, v in stats["layers"].items()},
        "seconds": time.perf_counter() - t0,
    }


def hitrate_main(args) -> int:
    """``hitrate`` subcommand: recorded against random KV, side by side, on the CPU."""
    from benchmarks.common import run_metadata, write_results

    rec = Recording.load(args.workload)
    rows = []
    print(f"{'geometry':20s} {'selector':40s} {'context':>7s} {'batch':>5s} {'workload':>9s} {'hit rate':>8s} "
          f"{'sel mass':>8s} {'s':>6s}")  # fmt: skip
    for geometry in args.geometry:
        for selector in args.selector:
            for name, workload in (("recorded", rec), ("random", None)):
                r = measure_hit_rate(workload, geometry, args.layers, args.context, args.batch, args.budget,
                                     args.steps, selector)  # fmt: skip
                rows.append({"geometry": geometry, "selector": selector, "workload": name, "context": args.context,
                             "batch": args.batch, "budget": args.budget, "steps": args.steps, **r})  # fmt: skip
                mass = "-" if r["selected_mass"] is None else f"{r['selected_mass']:.3f}"
                print(f"{geometry:20s} {selector:40s} {args.context:7d} {args.batch:5d} {name:>9s} "
                      f"{r['hit_rate']:8.3f} {mass:>8s} {r['seconds']:6.0f}", flush=True)  # fmt: skip
    meta = run_metadata(args, workload=rec.describe(), geometries={g: GEOMETRIES[g] for g in args.geometry},
                        note="CPU, float32, random-weight Llama models of each geometry; the hit rate counts decode "
                        "steps after the first (cache.reset_stats())")  # fmt: skip
    write_results(args.out, {"metadata": meta, "runs": rows})
    return 0


def model_title(name: str) -> str:
    """A registry model's title and GGUF identity (``hf-offload models list``), else ``name`` itself."""
    from hf_offload.tools.models import get_spec

    try:
        spec = get_spec(name)
    except (KeyError, ValueError):
        return name
    return f"{spec.title} (hf-offload models: {spec.name}, GGUF sha256 {spec.sha256[:12]}..., run in float32)"


def record_main(args) -> int:
    """``record`` subcommand."""
    from hf_offload.tools.models import load

    torch.manual_seed(0)
    model, tokenizer = load(args.model, dtype=torch.float32, device="cpu")
    layers = kept_layers(model.config.num_hidden_layers, args.layer_pairs)
    ids, info = needle_document(tokenizer, args.context, args.seed)
    print(f"recording {args.model}: {args.context:,} tokens, {args.steps} decode steps, layers {layers}")
    rec = record(model, ids, args.steps, layers, chunk=args.chunk, meta={"model": model_title(args.model),
                 "model_name": args.model, **info})  # fmt: skip
    path = rec.save(args.out)
    print(f"generated: {tokenizer.decode(rec.meta['generated_ids'])!r}")
    print(f"wrote {path} ({path.stat().st_size / (1 << 20):.1f} MiB, sha256 {rec.file_sha256[:16]}...); int8 keys move "
          f"the first step's logits by at most {max(rec.meta['keys_int8_logit_error']):.3f} of their standard "
          f"deviation")
    return 0


def info_main(args) -> int:
    """``info`` subcommand."""
    rec = Recording.load(args.path)
    print(json.dumps({**rec.describe(), "bytes": Path(args.path).stat().st_size,
                      "meta": {k: v for k, v in rec.meta.items() if k != "generated_ids"}}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line: ``record`` and ``info``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record a real model's decode over a long document (CPU, float32)")
    rec.add_argument("--model", default="qwen05", help="registry name or folder (default: qwen05)")
    rec.add_argument("--context", type=int, default=16384, help="prompt tokens (default: 16384)")
    rec.add_argument("--steps", type=int, default=64, help="greedy decode steps recorded (default: 64)")
    rec.add_argument("--layer-pairs", type=int, default=7,
                     help="adjacent layer pairs kept, spread over the model (default: 7; 0 or >= half: all)")
    rec.add_argument("--chunk", type=int, default=1024, help="prefill tokens per forward (default: 1024)")
    rec.add_argument("--seed", type=int, default=0, help="needle key and value (default: 0)")
    rec.add_argument("--out", default=str(DEFAULT_DIR / "qwen05_needle_16k.safetensors"))
    inf = sub.add_parser("info", help="print a workload file's metadata")
    inf.add_argument("path")
    hit = sub.add_parser("hitrate", help="CPU: decode hit rate of a recorded workload against random KV")
    hit.add_argument("workload", help="the recording (a .safetensors file of `record`)")
    hit.add_argument("--geometry", nargs="+", choices=list(GEOMETRIES), default=["llama-8b-attention"])
    hit.add_argument("--selector", nargs="+", default=["quantkey", "quantkey[bits=4,tail_bits=2,tail_near=3]"])
    hit.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    hit.add_argument("--context", type=int, default=32768, help="tokens per sequence (default: 32768)")
    hit.add_argument("--batch", type=int, default=2, help="sequences (default: 2)")
    hit.add_argument("--budget", type=int, default=2048, help="budget_tokens (default: 2048)")
    hit.add_argument("--steps", type=int, default=20, help="decode steps counted (default: 20)")
    hit.add_argument("--out", default="results/workload/hitrate_cpu.json")
    args = parser.parse_args(argv)
    if args.command == "hitrate":
        return hitrate_main(args)
    if args.command == "record":
        if args.layer_pairs <= 0:
            args.layer_pairs = 1 << 30
        return record_main(args)
    return info_main(args)


if __name__ == "__main__":
    sys.exit(main())
