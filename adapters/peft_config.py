"""The parts of a PEFT `adapter_config.json` that loragw understands.

`check_features` rejects every feature that would change the math and is not
implemented (DoRA, bias training, modules_to_save, other peft types, config
fields it does not know). `LoraSettings` answers, for a module key as peft
names it on a `LlamaForCausalLM` (`model.layers.3.self_attn.q_proj`), whether
the adapter targets it and with which rank and scaling, by peft 0.21's own
rules: `check_target_module_exists` for target_modules, exclude_modules and
layers_to_transform; `get_pattern_key` for rank_pattern and alpha_pattern, with every regex
matched by RE2 (see config_regex.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from adapters.config_regex import MatchBudget, Regex, compile_regex
from adapters.errors import AdapterError, shown

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


# Bounds on the numbers and lists of a config: far above any real adapter,
# low enough that a hostile one cannot make validation slow or the math
# non-finite (a NaN lora_alpha would turn every output into NaN).
MAX_RANK = 1 << 16
MAX_LORA_ALPHA = 1e6
MAX_LAYER_INDEX = 1 << 16
MAX_LIST_ENTRIES = 1024  # target_modules, exclude_modules, layers_to_transform, layers_pattern
# The rank an engine pads its adapter slots to unless told otherwise
# (--max-lora-rank), and so the rank an adapter may have by default: the
# engine's setting, the registry and `loragw adapters import` all take it
# from here, so that an adapter imported with the defaults is one that
# `loragw serve` with the defaults can load.
DEFAULT_MAX_LORA_RANK = 16
MAX_PATTERN_ENTRIES = 1024  # rank_pattern, alpha_pattern (AdaLoRA lists every module: 7 per layer)
# peft's default layer-index regex: ours, fixed, and safe for `re`.
_DEFAULT_LAYER_INDEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")


def module_key(layer: int, module: str) -> str:
    """peft's name for a projection: `model.layers.3.self_attn.q_proj`."""
    return f"model.layers.{layer}.{LORA_MODULES[module]}.{module}"


def _pattern_keys(patterns: dict, where: str) -> list[tuple[str, Regex]]:
    """peft's `get_pattern_key` regex for each key: a dotted suffix of the module key."""
    return [(p, compile_regex(rf"(.*\.)?({p})$", f"{where} key", tenant_part=p)) for p in patterns]


@dataclass
class LoraSettings:
    """The parts of adapter_config.json that decide targets, ranks and scaling.

    Every regex is compiled by RE2 once, at construction, and all matching
    for one config draws on one `MatchBudget`."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    target_modules: list[str] | str = field(default_factory=list)
    exclude_modules: list[str] | str | None = None
    layers_to_transform: list[int] | int | None = None
    layers_pattern: list[str] | str | None = None
    budget: MatchBudget = field(default_factory=MatchBudget, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._rank_keys = _pattern_keys(self.rank_pattern, "rank_pattern")
        self._ranks: dict[str, int] = {}
        self._alpha_keys = _pattern_keys(self.alpha_pattern, "alpha_pattern")
        self._target_regex = _regex(self.target_modules, "target_modules")
        self._exclude_regex = _regex(self.exclude_modules, "exclude_modules")
        self._layers_regexes = [
            compile_regex(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", "layers_pattern", tenant_part=p)
            for p in _as_list(self.layers_pattern or [])
        ]

    @property
    def regexes(self) -> list[Regex]:
        """Every compiled regex of the config, in no particular order."""
        found = [regex for _, regex in self._rank_keys + self._alpha_keys] + self._layers_regexes
        return found + [r for r in (self._target_regex, self._exclude_regex) if r is not None]

    def _pattern_key(self, keys: list[tuple[str, Regex]], key: str) -> str | None:
        """peft's `get_pattern_key`: the first pattern that matches a dotted suffix of `key`."""
        for pattern, regex in keys:
            if self.budget.match(regex, key):
                return pattern
        return None

    def rank_for(self, key: str) -> int:
        if key not in self._ranks:
            pattern = self._pattern_key(self._rank_keys, key)
            self._ranks[key] = self.r if pattern is None else self.rank_pattern[pattern]
        return self._ranks[key]

    def scaling_for(self, key: str) -> float:
        pattern = self._pattern_key(self._alpha_keys, key)
        alpha = self.lora_alpha if pattern is None else self.alpha_pattern[pattern]
        r = self.rank_for(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, key: str) -> bool:
        """peft's `check_target_module_exists` for a LoRA-able module key."""
        excl = self.exclude_modules
        if self._exclude_regex is not None and self.budget.fullmatch(self._exclude_regex, key):
            return False
        if isinstance(excl, list) and (key in excl or any(key.endswith(f".{e}") for e in excl)):
            return False
        if self._target_regex is not None:
            return self.budget.fullmatch(self._target_regex, key)
        if key in self.target_modules:
            return True
        if not any(key.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None or self.layers_to_transform == []:
            return True
        return self._layer_index(key) in _as_list(self.layers_to_transform)

    def _layer_index(self, key: str) -> int | None:
        if not self.layers_pattern:
            match = _DEFAULT_LAYER_INDEX.match(key)
            return int(match["idx"]) if match else None
        for regex in self._layers_regexes:
            match = self.budget.match(regex, key)
            if match:
                # peft reads `idx` of the first pattern that matches, even when an
                # alternation in the pattern left `idx` out (then: no layer).
                idx = match.group("idx")
                return None if idx is None else int(idx)
        return None


def _regex(value, where: str) -> Regex | None:
    return compile_regex(value, where) if isinstance(value, str) else None


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
            raise AdapterError(f"unsupported adapter_config feature {shown(name)} (value {shown(value)})")


def _number(value, name: str, kind: type, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """`value` as a finite `kind` in [lo, hi] (or (lo, hi] with `lo_open`)."""
    allowed = (int,) if kind is int else (int, float)
    ok = isinstance(value, allowed) and not isinstance(value, bool)
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if ok:
        ok = (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        noun = "an int" if kind is int else "a finite number"
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise AdapterError(f"{name} must be {noun} in {bound}, got {shown(value)}")
    return value


def _names(value, name: str, *, allow_str: bool) -> None:
    """A list of at most MAX_LIST_ENTRIES strings (or, with `allow_str`, one string)."""
    if allow_str and isinstance(value, str):
        return
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        what = "a string or a list of strings" if allow_str else "a list of strings"
        raise AdapterError(f"{name} must be {what}, got {shown(value)}")
    if len(value) > MAX_LIST_ENTRIES:
        raise AdapterError(f"{name} has {len(value)} entries; at most {MAX_LIST_ENTRIES}")


def parse_settings(cfg: dict) -> LoraSettings:
    check_features(cfg)
    _number(cfg.get("lora_dropout") or 0.0, "lora_dropout", float, 0.0, 1.0)
    for attr, kind, hi in (("rank_pattern", int, MAX_RANK), ("alpha_pattern", float, MAX_LORA_ALPHA)):
        patterns = cfg.get(attr) or {}
        if not isinstance(patterns, dict):
            raise AdapterError(f"{attr} must be an object, got {shown(patterns)}")
        if len(patterns) > MAX_PATTERN_ENTRIES:
            raise AdapterError(f"{attr} has {len(patterns)} entries; at most {MAX_PATTERN_ENTRIES}")
        for pattern, value in patterns.items():
            _number(value, f"{attr} {shown(pattern)}", kind, 0, hi, lo_open=True)
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = list(LORA_MODULES)
    if not targets or (not isinstance(targets, str) and not isinstance(targets, list)):
        raise AdapterError(f"target_modules must be a non-empty list of names or a regex string, got {shown(targets)}")
    _names(targets, "target_modules", allow_str=True)
    for name in ("exclude_modules", "layers_pattern"):
        if cfg.get(name) is not None:
            _names(cfg[name], name, allow_str=True)
    layers = cfg.get("layers_to_transform")
    if layers is not None:
        if isinstance(layers, list) and len(layers) > MAX_LIST_ENTRIES:
            raise AdapterError(f"layers_to_transform has {len(layers)} entries; at most {MAX_LIST_ENTRIES}")
        for index in _as_list(layers):
            _number(index, "layers_to_transform", int, 0, MAX_LAYER_INDEX)
    return LoraSettings(  # compiles every regex: an invalid or too complex one is an AdapterError
        r=_number(cfg.get("r", 8), "r", int, 0, MAX_RANK, lo_open=True),
        lora_alpha=_number(cfg.get("lora_alpha", 8), "lora_alpha", float, 0, MAX_LORA_ALPHA, lo_open=True),
        use_rslora=bool(cfg.get("use_rslora", False)),
        rank_pattern=cfg.get("rank_pattern") or {},
        alpha_pattern=cfg.get("alpha_pattern") or {},
        target_modules=targets,
        exclude_modules=cfg.get("exclude_modules"),
        layers_to_transform=layers,
        layers_pattern=cfg.get("layers_pattern"),
    )
