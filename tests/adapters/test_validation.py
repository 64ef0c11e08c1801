"""What the registry accepts reproduces peft exactly; everything else is
rejected with a message naming the problem."""

from __future__ import annotations

import shutil

import pytest
import torch

from adapters.errors import CONFIG_FILE, WEIGHTS_FILE, AdapterError
from adapters.peft_config import DEFAULT_MAX_LORA_RANK
from adapters.registry import AdapterRegistry
from tests.adapters.conftest import ALL_MODULES, as_upload, build_peft_adapter

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"

PEFT_CONFIGS = {
    "r4-alpha8-all": dict(r=4, lora_alpha=8, target_modules=ALL_MODULES),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "rank-and-alpha-patterns": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "k_proj"],
        rank_pattern={"model.layers.1.self_attn.q_proj": 2, "down_proj": 6},
        alpha_pattern={"q_proj": 3, "layers.0.mlp.down_proj": 32},
    ),
    "patterns-with-rslora": dict(
        r=2, lora_alpha=5, use_rslora=True, target_modules=["o_proj", "up_proj"],
        rank_pattern={"up_proj": 8}, alpha_pattern={"model.layers.1.self_attn.o_proj": 1.5},
    ),
    "regex-targets": dict(r=3, lora_alpha=7, target_modules=r"model\.layers\.1\.(self_attn\.[ko]_proj|mlp\.up_proj)"),
    "layers-to-transform": dict(r=4, lora_alpha=4, target_modules=["gate_proj", "k_proj"], layers_to_transform=[1]),
    "exclude-modules": dict(
        r=4, lora_alpha=16, target_modules=["q_proj", "up_proj"], exclude_modules=["model.layers.0.mlp.up_proj"]
    ),
}


def _peft_lora_layers(model) -> dict[tuple[int, str], object]:
    out = {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for module in ALL_MODULES:
            parent = layer.self_attn if hasattr(layer.self_attn, module) else layer.mlp
            linear = getattr(parent, module)
            if hasattr(linear, "lora_A") and "default" in linear.lora_A:
                out[(i, module)] = linear
    return out


@pytest.mark.parametrize("name", list(PEFT_CONFIGS))
def test_loaded_weights_reproduce_peft_deltas(name, tiny_llama_dir, tiny_config, tmp_path):
    model = build_peft_adapter(tiny_llama_dir, tmp_path / "src", seed=7, **PEFT_CONFIGS[name])
    registry = AdapterRegistry(tmp_path / "reg", base_config=tiny_config)
    manifest = registry.import_dir("a", tmp_path / "src")
    weights = registry.load("a")

    peft_layers = _peft_lora_layers(model)
    assert weights.modules.keys() == peft_layers.keys()
    assert manifest.target_modules == tuple(sorted({m for _, m in peft_layers}))
    assert weights.rank == manifest.rank == max(lin.r["default"] for lin in peft_layers.values())
    torch.manual_seed(0)
    for key, linear in peft_layers.items():
        a, b = weights.modules[key]
        assert a.dtype == b.dtype == torch.float32
        assert a.shape[0] == b.shape[1] == linear.r["default"]
        x = torch.randn(5, linear.in_features)
        with torch.no_grad():
            expected = linear.lora_B["default"](linear.lora_A["default"](x)) * linear.scaling["default"]
        torch.testing.assert_close(x @ a.T @ b.T, expected, rtol=1e-5, atol=1e-5, msg=str(key))


def _set(**changes):
    return lambda cfg, tensors: cfg.update(changes)


def _truncate_a(cfg, tensors):
    tensors[f"{Q0}.lora_A.weight"] = tensors[f"{Q0}.lora_A.weight"][:, :32]


def _rename_layer(old, new):
    def edit(cfg, tensors):
        for name in [n for n in tensors if f".layers.{old}." in n]:
            tensors[name.replace(f".layers.{old}.", f".layers.{new}.")] = tensors.pop(name)
    return edit


def _add_tensor(name, shape=(4, 64), dtype=torch.float32):
    return lambda cfg, tensors: tensors.__setitem__(name, torch.ones(shape, dtype=dtype))


def _drop(*names):
    def edit(cfg, tensors):
        for name in names:
            del tensors[name]
    return edit


def _replace_tensor(name, fn):
    return lambda cfg, tensors: tensors.__setitem__(name, fn(tensors[name]))


def _nan(t):
    t = t.clone()
    t[0, 0] = float("nan")
    return t


REJECTIONS = {
    "wrong shape": (_truncate_a, f"{Q0[17:]}.lora_A has wrong shape [4, 32], expected [4, 64]"),
    "rank disagrees with config": (_set(r=2), "lora_A has wrong shape [4, 128], expected [2, 128] (r=2, in_features=128)"),
    "unknown target module": (_set(target_modules=ALL_MODULES + ["foo_proj"]), "unknown target module 'foo_proj'"),
    "regex selecting nothing": (_set(target_modules=r".*\.nothing"), "selects none of q_proj"),
    "DoRA": (_set(use_dora=True), "DoRA (use_dora=true) is not supported"),
    "DoRA tensor": (_add_tensor(f"{Q0}.lora_magnitude_vector", (64,)), "DoRA (use_dora) is not supported: tensor"),
    "bias": (_set(bias="all"), "bias training (bias='all') is not supported"),
    "lora bias": (_set(lora_bias=True), "LoRA bias (lora_bias=true) is not supported"),
    "modules_to_save": (_set(modules_to_save=["lm_head"]), "modules_to_save is not supported"),
    "lm_head target": (_set(target_modules=ALL_MODULES + ["lm_head"]), "LM-head LoRA is not supported (target_modules covers lm_head)"),
    "embedding beside layers_to_transform": (
        _set(target_modules=["q_proj", "embed_tokens"], layers_to_transform=[0]),
        "LM-head LoRA is not supported (target_modules has 'embed_tokens')",
    ),
    "embedding regex": (_set(target_modules=r".*(embed_tokens|q_proj)"), "covers model.embed_tokens"),
    "embedding tensor": (
        _add_tensor("base_model.model.model.embed_tokens.lora_embedding_A"),
        "embedding or LM-head LoRA is not supported: tensor base_model.model.model.embed_tokens",
    ),
    "non-LoRA peft type": (_set(peft_type="IA3"), "unsupported peft_type 'IA3'"),
    "missing peft type": (lambda cfg, t: cfg.pop("peft_type"), "has no peft_type"),
    "fan_in_fan_out": (_set(fan_in_fan_out=True), "fan_in_fan_out=true is not supported"),
    "unknown feature": (_set(use_qalora=True), "unsupported adapter_config feature 'use_qalora'"),
    "pissa init": (_set(init_lora_weights="pissa_niter_4"), "init_lora_weights='pissa_niter_4' is not supported"),
    "bad rank type": (_set(r=4.5), "r must be an int in (0, 65536], got 4.5"),
    "bad rank_pattern": (_set(rank_pattern={"q_proj": 0}), "rank_pattern 'q_proj' must be an int in (0, 65536], got 0"),
    "bad regex": (_set(target_modules="q_proj("), "target_modules: invalid regex"),
    "unexpected tensor": (_add_tensor(f"{Q0}.lora_C.weight"), f"unexpected tensor name {Q0}.lora_C.weight"),
    "unprefixed tensor": (_add_tensor("model.layers.0.self_attn.q_proj.lora_A.weight"), "unexpected tensor name"),
    "layer out of range": (_rename_layer(1, 5), "layer index 5 out of range (the base model has 2 layers)"),
    "a layer index past int()'s limit": (_rename_layer(1, "9" * 5000), "layer index 99999999999999999999... "
                                         "(5000 digits) out of range (the base model has 2 layers)"),
    # peft writes ASCII digits without leading zeros; these would alias layer 1.
    "a Unicode digit as the layer": (_rename_layer(1, "\u0661"), "unexpected tensor name"),
    "a leading zero in the layer": (_rename_layer(1, "01"), "unexpected tensor name"),
    "untargeted tensors": (_set(target_modules=["q_proj"]), "layers.0.mlp.down_proj, which target_modules does not cover"),
    "missing module": (
        _drop(f"{Q0}.lora_A.weight", f"{Q0}.lora_B.weight"),
        "missing LoRA tensors for model.layers.0.self_attn.q_proj",
    ),
    "half a pair": (_drop(f"{Q0}.lora_B.weight"), "model.layers.0.self_attn.q_proj has no lora_B tensor"),
    "integer dtype": (_replace_tensor(f"{Q0}.lora_A.weight", lambda t: t.to(torch.int32)), "has dtype torch.int32"),
    "nan": (_replace_tensor(f"{Q0}.lora_B.weight", _nan), "lora_B holds NaN or infinite values"),
    "no tensors": (lambda cfg, tensors: tensors.clear(), "holds no LoRA tensors"),
}


# The rest name the weights: a tensor that does not fit the config (its rank,
# a module it does not target) is found by the weights' check.
CONFIG_FAULTS = {
    "unknown target module", "regex selecting nothing", "DoRA", "bias", "lora bias", "modules_to_save",
    "lm_head target", "embedding beside layers_to_transform", "embedding regex", "non-LoRA peft type",
    "missing peft type", "fan_in_fan_out", "unknown feature", "pissa init", "bad rank type", "bad rank_pattern",
    "bad regex",
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_malformed_adapter_is_rejected_with_its_own_message(case, valid_files, tiny_config, tmp_path):
    edit, message = REJECTIONS[case]
    cfg, tensors = valid_files
    edit(cfg, tensors)
    registry = AdapterRegistry(tmp_path, base_config=tiny_config)
    with pytest.raises(AdapterError) as info:
        registry.put("a", *as_upload(cfg, tensors))
    assert message in info.value.message
    assert isinstance(info.value, ValueError)
    assert info.value.param == (CONFIG_FILE if case in CONFIG_FAULTS else WEIGHTS_FILE)
    assert registry.list() == []


def test_rank_above_max_lora_rank(valid_files, tiny_config, tmp_path):
    registry = AdapterRegistry(tmp_path, base_config=tiny_config, max_lora_rank=2)
    with pytest.raises(AdapterError, match="has rank 4, above max_lora_rank 2") as info:
        registry.put("a", *as_upload(*valid_files))
    assert info.value.param == CONFIG_FILE


def test_the_registry_s_default_rank_limit_is_the_engine_s(valid_files, tiny_config, tmp_path):
    """`loragw adapters import` once accepted rank 64 by default where
    `loragw serve` pads slots to 16: every request on such an adapter then
    failed with a 500. One default now serves both."""
    from engine.config import LoraConfig

    assert LoraConfig().max_lora_rank == DEFAULT_MAX_LORA_RANK == 16
    cfg, tensors = valid_files
    cfg["rank_pattern"] = {"layers.0.self_attn.q_proj": 17}
    with pytest.raises(AdapterError, match="rank 17, above max_lora_rank 16"):
        AdapterRegistry(tmp_path, base_config=tiny_config).put("a", *as_upload(cfg, tensors))


@pytest.mark.parametrize(
    "files, message, param",
    [
        (["adapter_model.safetensors"], "missing adapter_config.json", CONFIG_FILE),
        (["adapter_config.json"], "missing adapter_model.safetensors", WEIGHTS_FILE),
        (["adapter_config.json", "adapter_model.bin"], "pickle-format weights (adapter_model.bin) are not accepted",
         WEIGHTS_FILE),
    ],
)
def test_incomplete_adapter_directory(files, message, param, valid_adapter_dir, tiny_config, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in files:
        if name == "adapter_model.bin":
            torch.save({"x": torch.zeros(1)}, src / name)
        else:
            shutil.copy(valid_adapter_dir / name, src / name)
    with pytest.raises(AdapterError) as info:
        AdapterRegistry(tmp_path / "reg", base_config=tiny_config).import_dir("a", src)
    assert message in info.value.message
    assert info.value.param == param


def test_pickle_bytes_uploaded_as_weights_are_never_unpickled(valid_adapter_dir, tiny_config, tmp_path, monkeypatch):
    import pickle

    torch.save({"x": torch.zeros(1)}, tmp_path / "w.bin")
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    config = (valid_adapter_dir / "adapter_config.json").read_bytes()
    registry = AdapterRegistry(tmp_path / "reg", base_config=tiny_config)
    for weights in ((tmp_path / "w.bin").read_bytes(), pickle.dumps({"x": 1})):
        with pytest.raises(AdapterError, match="pickle-format weights"):
            registry.put("a", config, weights)


@pytest.mark.parametrize(
    "config, weights, message, param",
    [
        (b"{not json", None, "adapter_config.json is not valid JSON", CONFIG_FILE),
        (b"[1, 2]", None, "adapter_config.json must hold a JSON object", CONFIG_FILE),
        (None, b"\x10\x00\x00\x00\x00\x00\x00\x00{}garbage", "not a valid safetensors file", WEIGHTS_FILE),
    ],
)
def test_unreadable_files(config, weights, message, param, valid_files, tiny_config, tmp_path):
    good_config, good_weights = as_upload(*valid_files)
    with pytest.raises(AdapterError, match=message) as info:
        AdapterRegistry(tmp_path, base_config=tiny_config).put("a", config or good_config, weights or good_weights)
    assert info.value.param == param


def test_inert_config_fields_do_not_change_the_digest(valid_files, tiny_config, tmp_path):
    cfg, tensors = valid_files
    registry = AdapterRegistry(tmp_path, base_config=tiny_config)
    first = registry.put("a", *as_upload(cfg, tensors))
    cfg.update(peft_version="0.0.1", base_model_name_or_path="elsewhere", lora_dropout=0.1, lora_alpha=8.0)
    assert registry.put("a", *as_upload(cfg, tensors)) == first


def test_without_base_config_only_base_independent_checks_run(valid_files, valid_adapter_dir, tmp_path):
    registry = AdapterRegistry(tmp_path)
    manifest = registry.import_dir("a", valid_adapter_dir)
    assert manifest.base_model_fingerprint is None
    assert registry.load("a").modules.keys() == {(i, m) for i in range(2) for m in ALL_MODULES}
    cfg, tensors = valid_files
    _rename_layer(1, 5)(cfg, tensors)  # layers 0 and 5: layers 1..4 are targeted but missing
    with pytest.raises(AdapterError, match="missing LoRA tensors for model.layers.1"):
        registry.put("b", *as_upload(cfg, tensors))
    _rename_layer(5, 10**9)(cfg, tensors)  # would make a billion candidate layers
    with pytest.raises(AdapterError, match="layer index 1000000000 above 65536"):
        registry.put("b", *as_upload(cfg, tensors))
