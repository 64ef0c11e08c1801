"""The parts of a PEFT `adapter_config.json` that loragw understands.

`check_features` rejects every feature that would change the math and is not
implemented (DoRA, bias training, modules_to_save, other peft types, config
fields it does not know). `LoraSettings` answers, for a module key as peft
names it on a `LlamaForCausalLM` (`model.layers.3.self_attn.q_proj`), whether
the adapter targets it and with which rank and scaling, by peft 0.21's own
rules: `check_target_module_exists` for target_modules, exclude_modules and
layers_to_transform; `get_pattern_key` for rank_pattern and alpha_pattern.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from adapters.errors import AdapterError

# The LoRA-able projections of a Llama layer, and the submodule holding each.
LORA_MODULES: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}
# init_lora_weights values that rewrite the base weights at training time:
# such an adapter only works on the modified base, which we do not serve.
_BASE_MODIFYING_INITS = ("pissa", "olora", "loftq", "corda", "mica", "lora_ga")
# Config fields that do not affect inference (or only matter together with a
# field that is checked): accepted whatever their value.
_INERT_FIELDS = frozenset({
    "base_model_name_or_path", "revision", "task_type", "inference_mode", "auto_mapping",
    "peft_version", "lora_dropout", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "qalora_group_size", "megatron_core", "ensure_weight_tying",
})
_HANDLED_FIELDS = frozenset({
    "peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern",
    "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
    "use_dora", "bias", "lora_bias", "fan_in_fan_out", "modules_to_save", "init_lora_weights",
})


def module_key(layer: int, module: str) -> str:
    """peft's name for a projection: `model.layers.3.self_attn.q_proj`."""
    return f"model.layers.{layer}.{LORA_MODULES[module]}.{module}"


def _pattern_key(patterns: dict, key: str) -> str | None:
    """peft's `get_pattern_key`: the first pattern that matches a dotted suffix of `key`."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return None


@dataclass
class LoraSettings:
    """The parts of adapter_config.json that decide targets, ranks and scaling."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    target_modules: list[str] | str = field(default_factory=list)
    exclude_modules: list[str] | str | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None

    def rank_for(self, key: str) -> int:
        pattern = _pattern_key(self.rank_pattern, key)
        return self.r if pattern is None else self.rank_pattern[pattern]

    def scaling_for(self, key: str) -> float:
        pattern = _pattern_key(self.alpha_pattern, key)
        alpha = self.lora_alpha if pattern is None else self.alpha_pattern[pattern]
        r = self.rank_for(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, key: str) -> bool:
        """peft's `check_target_module_exists` for a LoRA-able module key."""
        excl = self.exclude_modules
        if isinstance(excl, str) and re.fullmatch(excl, key):
            return False
        if isinstance(excl, list) and (key in excl or any(key.endswith(f".{e}") for e in excl)):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, key) is not None
        if key in self.target_modules:
            return True
        if not any(key.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None or self.layers_to_transform == []:
            return True
        return self._layer_index(key) in _as_list(self.layers_to_transform)

    def _layer_index(self, key: str) -> int | None:
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            match = None
            for pattern in _as_list(self.layers_pattern):
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
                if match:
                    break
        return int(match["idx"]) if match else None


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


# ---- config -------------------------------------------------------------


def check_features(cfg: dict) -> None:
    """Reject every config feature that changes the math and is not implemented."""
    peft_type = cfg.get("peft_type")
    if peft_type is None:
        raise AdapterError("adapter_config.json has no peft_type; expected a PEFT LoRA adapter")
    if peft_type != "LORA":
        raise AdapterError(f"unsupported peft_type {peft_type!r}: only LORA adapters are served")
    if cfg.get("use_dora"):
        raise AdapterError("DoRA (use_dora=true) is not supported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise AdapterError(f"bias training (bias={cfg['bias']!r}) is not supported; only bias='none'")
    if cfg.get("lora_bias"):
        raise AdapterError("LoRA bias (lora_bias=true) is not supported")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out=true is not supported (Llama projections are nn.Linear)")
    if cfg.get("modules_to_save"):
        raise AdapterError(
            f"modules_to_save is not supported ({cfg['modules_to_save']!r}): only LoRA deltas on "
            "q/k/v/o/gate/up/down projections are served"
        )
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.startswith(_BASE_MODIFYING_INITS):
        raise AdapterError(
            f"init_lora_weights={init!r} is not supported: that initialization changes the base "
            "weights; convert the adapter with peft's path_initial_model_for_weight_conversion"
        )
    for name, value in sorted(cfg.items()):
        if name not in _HANDLED_FIELDS and name not in _INERT_FIELDS and value:
            raise AdapterError(f"unsupported adapter_config feature {name!r} (value {value!r})")


def _number(cfg: dict, name: str, default, kind: type, where: str = "") -> float:
    value = cfg.get(name, default)
    allowed = (int,) if kind is int else (int, float)
    if not isinstance(value, allowed) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"{where}{name} must be a positive {kind.__name__}, got {value!r}")
    return value


def parse_settings(cfg: dict) -> LoraSettings:
    check_features(cfg)
    settings = LoraSettings(
        r=_number(cfg, "r", 8, int),
        lora_alpha=_number(cfg, "lora_alpha", 8, float),
        use_rslora=bool(cfg.get("use_rslora", False)),
        rank_pattern=cfg.get("rank_pattern") or {},
        alpha_pattern=cfg.get("alpha_pattern") or {},
        target_modules=cfg.get("target_modules"),
        exclude_modules=cfg.get("exclude_modules"),
        layers_to_transform=cfg.get("layers_to_transform"),
        layers_pattern=cfg.get("layers_pattern"),
    )
    for attr, kind in (("rank_pattern", int), ("alpha_pattern", float)):
        patterns = getattr(settings, attr)
        if not isinstance(patterns, dict):
            raise AdapterError(f"{attr} must be an object, got {patterns!r}")
        for pattern in patterns:
            _number(patterns, pattern, None, kind, where=f"{attr} ")
            _check_regex(pattern, attr)
    targets = settings.target_modules
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            settings.target_modules = list(LORA_MODULES)
        else:
            _check_regex(targets, "target_modules")
    elif not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        raise AdapterError(f"target_modules must be a non-empty list of names or a regex string, got {targets!r}")
    if isinstance(settings.exclude_modules, str):
        _check_regex(settings.exclude_modules, "exclude_modules")
    for pattern in _as_list(settings.layers_pattern or []):
        _check_regex(pattern, "layers_pattern")
    layers = settings.layers_to_transform
    if layers is not None and not all(isinstance(i, int) for i in _as_list(layers)):
        raise AdapterError(f"layers_to_transform must be an int or a list of ints, got {layers!r}")
    return settings


def _check_regex(pattern: str, where: str) -> None:
    try:
        re.compile(pattern)
    except re.error as exc:
        raise AdapterError(f"{where}: invalid regex {pattern!r}: {exc}") from None
