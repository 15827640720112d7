"""One install and one remove for everything that changes a user's model (``hf_offload.patches``): after the remove
the model is exactly the one given (the same parameter objects and values, ``state_dict``, forwards, attention
implementations, ``save_pretrained`` bytes); installing again shares the patches; importing changes nothing."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, OffloadConfig, disable_offload_attention, enable_offload_attention, patches
from hf_offload.patches.attention import _configs
from hf_offload.patches.layers import DecoderLayerCall
from hf_offload.patches.norms import FusedNorm
from hf_offload.patches.projections import GatedMLPForward, ProjectionForward, fused_groups
from hf_offload.patches.rotary import RotaryForward

from ..helpers import build_model, left_padded

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"budget_tokens": 48, "block_tokens": 8, "sink_tokens": 8, "window_tokens": 8, "pool_tokens": 48}
# Every patch, the projections included (their default is on CUDA only; the CPU runs them when asked).
EVERY = dict(SMALL, fused_projections=True)


def _state(model) -> dict:
    """What a remove must give back: parameters (objects, names, shapes, dtypes, flags, values, which share a
    storage), the state dict, instance forwards, forward hooks and the configs' attention implementations."""
    params = list(model.named_parameters())
    storages: dict[int, list[str]] = {}
    for name, p in params:
        storages.setdefault(p.untyped_storage().data_ptr(), []).append(name)
    return {
        "params": [(name, p, p.shape, p.dtype, p.requires_grad, p.is_contiguous()) for name, p in params],
        "values": {name: p.detach().clone() for name, p in params},
        "shared": sorted(sorted(names) for names in storages.values()),
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "forwards": [name for name, m in model.named_modules() if "forward" in m.__dict__],
        "hooks": [(name, len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()],
        "attention": [(type(c).__name__, c._attn_implementation) for c in _configs(model)],
    }


def _assert_same_state(got: dict, want: dict) -> None:
    assert [(n, id(p), s, d, g, c) for n, p, s, d, g, c in got["params"]] == [
        (n, id(p), s, d, g, c) for n, p, s, d, g, c in want["params"]
    ]  # the very parameter objects, in the same order
    assert got["values"].keys() == want["values"].keys()
    assert all(torch.equal(got["values"][k], want["values"][k]) for k in want["values"])
    assert got["shared"] == want["shared"]  # each parameter has a tensor of its own again
    assert got["state_dict"].keys() == want["state_dict"].keys()
    assert all(torch.equal(got["state_dict"][k], want["state_dict"][k]) for k in want["state_dict"])
    assert got["forwards"] == want["forwards"] == []
    assert got["hooks"] == want["hooks"]  # the forward hooks are off again
    assert got["attention"] == want["attention"]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _patched(model) -> dict[str, int]:
    modules = list(model.modules())

    def count(kind):
        return sum(isinstance(m.__dict__.get("forward"), kind) for m in modules)

    return {
        "layers": count(DecoderLayerCall),
        "norms": count(FusedNorm),
        "rotary": count(RotaryForward),
        "projections": count(ProjectionForward),
        "mlps": count(GatedMLPForward),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_remove_gives_back_exactly_the_model_given(arch, tmp_path):
    model = build_model(arch)
    pristine = copy.deepcopy(model)  # never patched
    before = _state(model)
    ids, mask = left_padded([30, 21], seed=3)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        want = pristine.generate(**kwargs, past_key_values=DynamicCache(config=pristine.config))

    cache = OffloadCache(model, **EVERY)
    layers = model.config.num_hidden_layers
    found = _patched(model)
    assert found["layers"] == layers and found["norms"] >= 2 * layers and found["rotary"] == layers
    assert found["projections"] == 5 * layers and len(fused_groups(model)) == 2 * layers  # q/k/v and gate/up
    assert model.config._attn_implementation == "hf_offload_sdpa"
    p = cache.patches
    assert (p.layer_calls, p.norm_modules, p.rotary_modules, p.projection_groups) == (
        layers, found["norms"], layers, 2 * layers
    )
    assert p.forward_hooks and (len(model._forward_pre_hooks), len(model._forward_hooks)) == (1, 1)
    with torch.no_grad():
        got = model.generate(**kwargs, past_key_values=cache)  # full budget: the tokens of DynamicCache
    assert torch.equal(got, want)
    assert sum(g.calls for g in fused_groups(model)) > 0  # the fused products ran

    cache.patches.remove()
    assert not cache.patches.active and patches.installed(model) is None
    assert _patched(model) == dict.fromkeys(found, 0)
    _assert_same_state(_state(model), before)
    _assert_same_state(_state(model), _state(pristine) | {"params": before["params"]})
    model.save_pretrained(tmp_path / "removed")
    pristine.save_pretrained(tmp_path / "pristine")
    assert _files(tmp_path / "removed") == _files(tmp_path / "pristine")
    with torch.no_grad():  # and it still computes what it did
        again = model.generate(**kwargs, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(again, want)


def test_remove_separates_the_views_left_after_a_parameter_was_replaced():
    model = build_model("llama")
    installed = patches.install(model, OffloadConfig(fused_projections=True))
    assert installed.projection_groups == 2 * model.config.num_hidden_layers
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())  # q and v stay views
    values = {name: p.detach().clone() for name, p in model.named_parameters()}
    objects = [id(p) for p in model.parameters()]
    installed.remove()
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(storages)) == len(storages)  # nothing shares the groups' tensors any more
    assert [id(p) for p in model.parameters()] == objects
    assert all(torch.equal(p, values[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_remove_restores_the_attention_implementation_of_every_config(implementation):
    model = build_model("qwen2", attn_implementation=implementation)
    before = [(c, c._attn_implementation) for c in _configs(model)]
    OffloadCache(model, **SMALL)
    assert {c._attn_implementation for c, _ in before} == {f"hf_offload_{implementation}"}
    disable_offload_attention(model)
    assert [(c, c._attn_implementation) for c in _configs(model)] == before


def test_install_twice_shares_the_patches_and_a_second_cache_keeps_working():
    model = build_model("llama")
    before = _state(model)
    first = OffloadCache(model, **SMALL)
    second = OffloadCache(model, **EVERY)  # adds what its config needs (the projections) to the shared patches
    assert first.patches is second.patches is patches.installed(model)
    assert second.patches.projection_groups == 2 * model.config.num_hidden_layers
    assert copy.deepcopy(first).patches is first.patches  # a copied cache shares its model's patches
    ids, mask = left_padded([25, 18], seed=4)
    kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        a = model.generate(**kwargs, past_key_values=first)
        b = model.generate(**kwargs, past_key_values=second)
    assert torch.equal(a, b)
    layer = model.model.layers[0]
    assert not isinstance(layer.forward.original, DecoderLayerCall)  # routed once
    first.patches.remove()
    second.patches.remove()  # already removed: a no-op
    patches.remove(model)  # idempotent
    _assert_same_state(_state(model), before)


def test_an_old_handle_does_not_remove_newer_patches():
    model = build_model("llama")
    old = OffloadCache(model, **SMALL).patches
    disable_offload_attention(model)
    new = OffloadCache(model, **SMALL).patches
    assert new is not old and new.active and not old.active
    old.remove()
    assert new.active and model.config._attn_implementation == "hf_offload_sdpa"
    assert _patched(model)["layers"] == model.config.num_hidden_layers
    new.remove()
    assert _patched(model)["layers"] == 0 and model.config._attn_implementation == "sdpa"


def test_enable_switches_only_the_attention_and_disable_removes_everything():
    model = build_model("llama")
    before = _state(model)
    assert enable_offload_attention(model) == "sdpa"
    assert model.config._attn_implementation == "hf_offload_sdpa" and _patched(model)["layers"] == 0
    assert enable_offload_attention(model) == "sdpa"  # idempotent
    disable_offload_attention(model)
    disable_offload_attention(model)
    _assert_same_state(_state(model), before)


def test_a_model_switched_without_a_record_is_switched_back():
    model = build_model("llama")
    OffloadCache(model, **EVERY)
    clone = copy.deepcopy(model)  # switched and patched, but not through an install of its own
    patches.remove(model)
    assert patches.installed(clone) is None
    patches.remove(clone)
    assert clone.config._attn_implementation == "sdpa"
    assert _patched(clone) == dict.fromkeys(_patched(clone), 0)
    assert all(torch.equal(a, b) for a, b in zip(clone.state_dict().values(), model.state_dict().values()))


def test_an_unsupported_implementation_changes_nothing():
    model = build_model("llama")
    model.config._attn_implementation = "paged|eager"  # continuous batching's, as if loaded with it
    before = _state(model)
    with pytest.raises(ValueError, match="attn_implementation"):
        OffloadCache(model, **EVERY)
    assert patches.installed(model) is None
    _assert_same_state(_state(model), before)


def test_import_registers_and_patches_nothing():
    """``import hf_offload`` (and loading every public name and module) leaves transformers as it was: no attention or
    mask function registered, no function or class attribute of the modeling modules replaced."""
    script = r"""
import importlib, json, pkgutil, sys
import torch
import transformers
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

names = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]
modules = [importlib.import_module(f"transformers.models.{n}.modeling_{n}") for n in names]
modules += [torch.nn.functional, transformers.masking_utils, transformers.modeling_utils]

def snapshot():
    state = {"attention": sorted(ALL_ATTENTION_FUNCTIONS.valid_keys()),
             "masks": sorted(ALL_MASK_ATTENTION_FUNCTIONS.valid_keys())}
    for module in modules:
        state[module.__name__] = {k: id(v) for k, v in vars(module).items()}
        for k, v in vars(module).items():
            if isinstance(v, type):
                state[f"{module.__name__}.{k}"] = {a: id(b) for a, b in vars(v).items()}
    for cls in (torch.nn.Module, torch.nn.Linear, transformers.PreTrainedModel):
        state[cls.__qualname__] = {a: id(b) for a, b in vars(cls).items()}
    return state

before = snapshot()
import hf_offload
for name in hf_offload.__all__:
    getattr(hf_offload, name)
loaded = []
for info in pkgutil.walk_packages(hf_offload.__path__, prefix="hf_offload."):
    if info.name.split(".")[1] in ("cli", "demo", "bench", "models", "tools"):
        continue  # the command-line tools are not the library
    importlib.import_module(info.name)
    loaded.append(info.name)
after = snapshot()
changed = sorted(k for k in before if before[k] != after[k])
print(json.dumps({"changed": changed, "loaded": loaded}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "hf_offload.patches" in result["loaded"] and "hf_offload.cache" in result["loaded"]
    assert result["changed"] == []
