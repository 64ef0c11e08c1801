"""EngineConfig: sections, the flat keyword arguments `LLM(...)` takes, and
the premium reserve with tiers off."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import CacheConfig, EngineConfig, LoraConfig, SchedulerConfig, SpeculativeConfig, flat_names
from engine.errors import ValidationError

SECTIONS = {"scheduler": SchedulerConfig, "cache": CacheConfig, "lora": LoraConfig,
            "speculative_config": SpeculativeConfig}


def test_every_setting_name_is_declared_once_across_the_sections():
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS]
    for cls in SECTIONS.values():
        names += [f.name for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert set(flat_names()) == set(names)


def test_flat_keyword_arguments_land_in_their_sections():
    config = EngineConfig.from_flat(model="m", max_num_seqs=8, num_kv_blocks=64, max_loras=2,
                                    enable_prefix_caching=False, max_standard_prefill_tokens=32)
    assert config.model == "m"
    assert config.scheduler == SchedulerConfig(max_num_seqs=8, max_standard_prefill_tokens=32)
    assert config.cache == CacheConfig(num_kv_blocks=64, enable_prefix_caching=False)
    assert config.lora == LoraConfig(max_loras=2)
    assert EngineConfig.from_flat() == EngineConfig()


def test_flat_round_trip_covers_every_field():
    config = EngineConfig.from_flat(dtype="float32", max_model_len=99, block_size=32, max_cpu_loras=3,
                                    num_threads=2, enable_tiers=False)
    flat = config.to_flat()
    assert len(flat) == len(flat_names())
    assert (flat["max_model_len"], flat["block_size"], flat["max_cpu_loras"]) == (99, 32, 3)
    assert EngineConfig.from_flat(**flat) == config


def test_an_unknown_flat_name_is_a_clear_error():
    with pytest.raises(TypeError, match=r"'max_num_seq' is not an engine setting; did you mean 'max_num_seqs'"):
        EngineConfig.from_flat(max_num_seq=8)
    with pytest.raises(TypeError, match="'scheduler' is not an engine setting"):
        EngineConfig.from_flat(scheduler=SchedulerConfig())


def test_sections_validate_their_values():
    with pytest.raises(ValidationError, match="block_size"):
        EngineConfig.from_flat(block_size=12)
    with pytest.raises(ValidationError, match="premium_reserved_fraction"):
        CacheConfig(premium_reserved_fraction=1.0)
    with pytest.raises(ValidationError, match="max_loras"):
        LoraConfig(max_loras=-1)
    with pytest.raises(ValidationError, match="num_threads"):
        EngineConfig(num_threads=0)


def test_the_premium_reserve_is_a_share_of_the_blocks_and_none_with_tiers_off():
    reserved = EngineConfig.from_flat(premium_reserved_fraction=0.2)
    assert reserved.premium_reserved_blocks(100) == 20
    assert reserved.premium_reserved_blocks(7) == 1
    off = EngineConfig.from_flat(premium_reserved_fraction=0.2, enable_tiers=False)
    assert off.premium_reserved_blocks(100) == 0
    assert EngineConfig().premium_reserved_blocks(100) == 0  # offline: no reserve
