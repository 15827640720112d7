"""OffloadConfig: grouped and flat construction, the ways the library reads it, and plain-data behaviour."""

from __future__ import annotations

import copy
import dataclasses
import doctest
import inspect
import pickle
import re

import pytest

import hf_offload.config as config_module
from hf_offload import OffloadConfig
from hf_offload.config import DEFAULT_SELECTOR, GROUPS, Attended, Execution, Memory

# Every setting and its default, as the flat configuration had them.
DEFAULTS = {
    "budget_tokens": 2048, "block_tokens": 16, "sink_tokens": None, "window_tokens": None,
    "selector": DEFAULT_SELECTOR, "pool_tokens": None, "prefill_chunk_tokens": 1024, "host_chunk_mib": 16,
    "host_memory_gib": None, "pin_memory": None, "transfer": "auto", "admission": "auto", "device_memory_gib": None,
    "transfer_cap_blocks": None, "transfer_cap_margin": 0.1, "disk_cap_blocks": None, "reselect_every": 1, "timing": False, "lookahead": False,
    "lookahead_query": "next", "lookahead_blocks": None, "cuda_graphs": None, "graph_scope": "layer",
    "decode_capacity_blocks": None, "decode_attention": "auto", "fused_norms": None, "fused_rotary": None,
    "fused_projections": None, "disk_dir": None, "disk_memory_gib": None, "disk_staging_chunks": 8, "disk_stage_near": 0,
    "disk_stage_left_out": 0,
    "disk_read_threads": 16, "max_budget_tokens": None, "missed_mass_target": None, "coarsen_summaries": True,
}  # fmt: skip


def test_groups_hold_every_setting_once_with_its_default():
    grouped = {f.name: f.default for cls in GROUPS.values() for f in dataclasses.fields(cls)}
    assert grouped == DEFAULTS
    assert sum(len(dataclasses.fields(cls)) for cls in GROUPS.values()) == len(DEFAULTS)
    assert GROUPS == {"attended": Attended, "memory": Memory, "execution": Execution}


def test_class_level_defaults_read_flat():
    # planner.py and demo.py take argparse defaults from the class: OffloadConfig.selector, OffloadConfig.admission.
    for name, default in DEFAULTS.items():
        assert getattr(OffloadConfig, name) == default, name
    assert OffloadConfig.selector == DEFAULT_SELECTOR and OffloadConfig.admission == "auto"


def test_dataclass_fields_list_every_setting_flat():
    # bench.py's --set FIELD=VALUE lists and checks names with dataclasses.fields(OffloadConfig) (f.init).
    names = [f.name for f in dataclasses.fields(OffloadConfig) if f.init]
    assert sorted(names) == sorted(DEFAULTS)
    assert inspect.signature(OffloadConfig).parameters.keys() >= {*DEFAULTS, *GROUPS}


def test_flat_and_grouped_construction_are_equal():
    flat = OffloadConfig(budget_tokens=2048, lookahead=True)
    grouped = OffloadConfig(attended=Attended(budget_tokens=2048), execution=Execution(lookahead=True))
    assert flat == grouped and hash(flat) == hash(grouped)
    assert OffloadConfig() == OffloadConfig(attended=Attended(), memory=Memory(), execution=Execution())
    assert OffloadConfig(4096) == OffloadConfig(budget_tokens=4096)  # the budget may come first, unnamed
    mixed = OffloadConfig(memory=Memory(admission="auto"), budget_tokens=512, timing=True)
    assert (mixed.admission, mixed.budget_tokens, mixed.timing) == ("auto", 512, True)


def test_flat_keywords_apply_over_the_groups():
    config = OffloadConfig(attended=Attended(budget_tokens=4096, block_tokens=32), budget_tokens=1024)
    assert (config.budget_tokens, config.block_tokens) == (1024, 32)


def test_every_setting_reads_flat_and_through_its_group():
    config = OffloadConfig(budget_tokens=512, admission="auto", lookahead=None, transfer_cap_blocks=3)
    for group, cls in GROUPS.items():
        view = getattr(config, group)
        assert isinstance(view, cls)
        for f in dataclasses.fields(cls):
            assert getattr(view, f.name) == getattr(config, f.name), f.name
    assert config.attended.sink_tokens == config.sink_tokens == 16  # derived sizes are filled in the groups too
    assert config.memory.pool_tokens == 640
    assert (config.sink_blocks, config.window_blocks, config.pool_blocks) == (1, 4, 40)


def test_groups_round_trip():
    config = OffloadConfig(budget_tokens=512, pool_tokens=1024, cuda_graphs=False, host_memory_gib=2.5)
    again = OffloadConfig(attended=config.attended, memory=config.memory, execution=config.execution)
    assert again == config


def test_replace_takes_flat_settings_and_groups():
    # cache.py (OffloadCache(config=..., **overrides), set_options) and planner.py change configs with replace().
    config = OffloadConfig(budget_tokens=128)
    assert config.replace(lookahead=True, timing=True) == OffloadConfig(budget_tokens=128, lookahead=True, timing=True)
    execution = Execution(cuda_graphs=False, graph_scope="attention")
    changed = config.replace(execution=execution, reselect_every=2)
    assert changed.execution == execution and changed.reselect_every == 2
    assert changed.attended.budget_tokens == 128 and config.cuda_graphs is None  # the original is unchanged
    assert config.replace(execution=execution, cuda_graphs=True).cuda_graphs is True  # flat over the group
    big = config.replace(budget_tokens=8192)
    assert (big.sink_tokens, big.window_tokens, big.pool_tokens) == (64, 256, 10240)  # derived again


@pytest.mark.parametrize("option", ["lookahead", "cuda_graphs", "graph_scope", "timing", "fused_norms", "fused_rotary",
                                    "fused_projections", "reselect_every"])  # fmt: skip
def test_each_set_options_setting_replaces_alone(option):
    value = {"graph_scope": "attention", "reselect_every": 3, "timing": True, "cuda_graphs": False}.get(option, True)
    config = OffloadConfig(budget_tokens=256, selector="quantkey")
    changed = config.replace(**{option: value})
    assert getattr(changed, option) == value
    assert {n: getattr(changed, n) for n in DEFAULTS if n != option} == {
        n: getattr(config, n) for n in DEFAULTS if n != option
    }


def test_dataclasses_replace_and_asdict():
    config = OffloadConfig(budget_tokens=256, lookahead=True)
    flat = dataclasses.asdict(config)
    assert list(flat) == [f.name for f in dataclasses.fields(OffloadConfig)] and flat["sink_tokens"] == 16
    assert OffloadConfig(**flat) == config
    changed = dataclasses.replace(config, timing=True)
    assert changed.timing and changed.lookahead and changed.budget_tokens == 256
    # dataclasses.replace passes every size as given (sink and window stay those of budget 256); replace() derives.
    assert dataclasses.replace(config, budget_tokens=4096).window_tokens == 32
    assert config.replace(budget_tokens=4096).window_tokens == 256


def test_repr_equality_hash_copy_pickle():
    config = OffloadConfig(budget_tokens=512, admission="auto", fused_norms=False)
    assert eval(repr(config), vars(config_module)) == config  # noqa: S307
    assert repr(config).startswith("OffloadConfig(attended=Attended(budget_tokens=512,")
    assert config != config.replace(timing=True)
    assert len({config, OffloadConfig(budget_tokens=512, admission="auto", fused_norms=False)}) == 1
    for again in (copy.copy(config), copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert again == config and hash(again) == hash(config)
        assert again.replace(budget_tokens=8192).window_tokens == 256  # still knows which sizes were derived
    assert Attended(budget_tokens=64) == Attended(budget_tokens=64) and hash(Memory()) == hash(Memory())


def test_config_is_immutable():
    config = OffloadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.budget_tokens = 4096
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.attended.budget_tokens = 4096
    config.validate()  # validating again changes nothing (benchmarks call it)
    assert config == OffloadConfig()


def test_a_selector_instance_is_kept_as_given():
    from hf_offload.selectors import QuantKeySelector

    selector = QuantKeySelector(bits=4)
    config = OffloadConfig(budget_tokens=256, selector=selector)
    assert config.selector is selector and config.attended.selector is selector
    assert config == OffloadConfig(attended=Attended(budget_tokens=256, selector=QuantKeySelector(bits=4)))


def test_unknown_names_are_a_type_error_with_close_matches():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'budgt_tokens' \(did you mean 'budget_tokens'"):
        OffloadConfig(budgt_tokens=4096)
    with pytest.raises(TypeError, match=r"'lookahed' \(did you mean 'lookahead'"):
        OffloadConfig(budget_tokens=256).replace(lookahed=True)
    with pytest.raises(TypeError, match=r"'colour'\. The settings are, by group, attended: budget_tokens, "):
        OffloadConfig(colour="red")
    with pytest.raises(TypeError, match=r"'attnded' \(did you mean 'attended'"):
        OffloadConfig(attnded=Attended())


def test_a_group_must_be_its_class():
    with pytest.raises(TypeError, match=r"memory= takes a Memory .* got Attended"):
        OffloadConfig(memory=Attended())
    with pytest.raises(TypeError, match=r"attended= takes an? Attended .* got dict"):
        OffloadConfig(budget_tokens=256).replace(attended={"budget_tokens": 512})


def test_invalid_values_fail_as_before_whichever_way_they_come():
    message = r"budget_tokens=64 is smaller than sink_tokens \+ window_tokens \+ block_tokens = 32 \+ 64 \+ 16 = 112"
    with pytest.raises(ValueError, match=message):
        OffloadConfig(attended=Attended(budget_tokens=64, sink_tokens=32, window_tokens=64))
    with pytest.raises(ValueError, match="cuda_graphs=True cannot be combined with timing=True"):
        OffloadConfig(execution=Execution(cuda_graphs=True), timing=True)


def test_docstrings_state_each_field_as_a_contract():
    for cls in GROUPS.values():
        section = cls.__doc__.split("Attributes:")[1]
        documented = re.findall(r"^        (\w+): ", section, flags=re.M)
        assert documented == [f.name for f in dataclasses.fields(cls)], cls.__name__
        entries = re.split(r"^        \w+: ", section, flags=re.M)[1:]
        for name, entry in zip(documented, entries):
            assert len(entry.strip().splitlines()) <= 3, name
            assert "default" in entry.lower() or "as ``fused_norms``" in entry.lower(), name
    text = inspect.getsource(config_module)
    # Measurements belong in docs/tuning.md and docs/results/, not in the settings' contracts.
    assert not re.findall(r"RULER|H200|docs/results|\d ?(?:ms|us|GB/s|tok/s)\b", text)


def test_module_examples_run():
    assert doctest.testmod(config_module).failed == 0


def test_offload_cache_takes_flat_settings_groups_and_a_config():
    from hf_offload import OffloadCache

    from .helpers import build_model

    model = build_model("llama")
    flat = OffloadCache(model, budget_tokens=64, block_tokens=8, lookahead=True)
    grouped = OffloadCache(model, attended=Attended(budget_tokens=64, block_tokens=8), execution=Execution(lookahead=True))
    assert flat.config == grouped.config == OffloadConfig(budget_tokens=64, block_tokens=8, lookahead=True)
    base = OffloadConfig(budget_tokens=64, block_tokens=8, selector="quantkey")
    over = OffloadCache(model, 128, config=base, execution=Execution(timing=True))
    assert over.config == base.replace(budget_tokens=128, timing=True)
    over.set_options(timing=False, reselect_every=2)
    assert not over.config.timing and over.config.reselect_every == 2 and over.config.block_tokens == 8
    assert all(layer.config is over.config for layer in over.offload_layers)
    assert copy.deepcopy(over).config == over.config
    with pytest.raises(TypeError, match="did you mean 'budget_tokens'"):
        OffloadCache(model, budgt_tokens=64)
