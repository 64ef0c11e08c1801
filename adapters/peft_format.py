"""Reading a PEFT LoRA adapter and checking it against the base model.

Input: the parsed `adapter_config.json` and the tensors of
`adapter_model.safetensors`. Output: one `LoraModule` (A, B, scaling) per
(layer, module), or an `AdapterError` whose message names what is wrong.

Which modules an adapter covers, and each module's rank and scaling, come
from `peft_config.LoraSettings` (peft 0.21's own rules). Saved tensor names
are peft's module keys behind `base_model.model.` and before
`.lora_A.weight` / `.lora_B.weight`, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`; every one
of them must be a targeted module of a layer the base model has, and every
targeted module must have both tensors.

Anything that would change the math and is not implemented here (DoRA, bias
training, embedding or LM-head LoRA, modules_to_save, other peft types,
unknown config features, unknown tensors) is rejected, never ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from adapters.errors import CONFIG_FILE, WEIGHTS_FILE, AdapterError
from adapters.peft_config import LORA_MODULES, MAX_LAYER_INDEX, LoraSettings, module_key, parse_settings

EMBEDDING_KEYS = ("model.embed_tokens", "lm_head")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The layer index as peft writes it: ASCII digits without leading zeros (a
# Unicode digit or "00" would alias another layer's name).
_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(0|[1-9][0-9]*)\.(self_attn|mlp)\.([a-z_]+)\.lora_([AB])\.weight"
)


@dataclass(frozen=True)
class BaseShapes:
    """The base model dimensions that LoRA shapes depend on."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int

    @classmethod
    def from_hf_config(cls, config) -> BaseShapes:
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            num_hidden_layers=config.num_hidden_layers,
        )

    def features(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of `module`'s nn.Linear."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }[module]

    @property
    def fingerprint(self) -> str:
        """Short digest of the shapes: adapters with equal fingerprints fit the same bases."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return "shapes-" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LoraModule:
    lora_a: torch.Tensor  # [r, in_features], dtype as stored
    lora_b: torch.Tensor  # [out_features, r], dtype as stored; scaling NOT folded in
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


def group_tensors(tensors: dict[str, torch.Tensor], num_layers: int | None) -> dict[tuple[int, str], dict]:
    """{(layer, module): {"A": tensor, "B": tensor}} from saved tensor names."""
    groups: dict[tuple[int, str], dict] = {}
    for name in sorted(tensors):
        match = _TENSOR_NAME.fullmatch(name)
        if match is None or LORA_MODULES.get(match[3]) != match[2]:
            raise AdapterError(_explain_unknown_tensor(name))
        digits = match[1]
        # int() of thousands of digits is slow (and refused past 4,300): a long index is out of range as text.
        layer = int(digits) if len(digits) <= len(str(MAX_LAYER_INDEX)) else MAX_LAYER_INDEX + 1
        if num_layers is None and layer > MAX_LAYER_INDEX:  # without a base, layers 0..max are checked
            raise AdapterError(f"tensor {name[:200]}: layer index {_shown_index(digits)} above {MAX_LAYER_INDEX}")
        if num_layers is not None and layer >= num_layers:
            raise AdapterError(f"tensor {name[:200]}: layer index {_shown_index(digits)} out of range "
                               f"(the base model has {num_layers} layers)")
        groups.setdefault((layer, match[3]), {})[match[4]] = tensors[name]
    return groups


def _shown_index(digits: str) -> str:
    return digits if len(digits) <= 20 else f"{digits[:20]}... ({len(digits)} digits)"


def _explain_unknown_tensor(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return f"DoRA (use_dora) is not supported: tensor {name}"
    if "lora_embedding_" in name or "embed_tokens" in name or "lm_head" in name:
        return f"embedding or LM-head LoRA is not supported: tensor {name}"
    if "modules_to_save" in name:
        return f"modules_to_save is not supported: tensor {name}"
    return (
        f"unexpected tensor name {name}; expected "
        "base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight"
    )


def _check_targets(settings: LoraSettings, num_layers: int) -> set[tuple[int, str]]:
    """The (layer, module)s the config targets; rejects embedding targets and unknown entries."""
    for key in EMBEDDING_KEYS:
        if settings.targets(key):
            raise AdapterError(f"embedding or LM-head LoRA is not supported (target_modules covers {key})")
    candidates = [(i, m) for i in range(num_layers) for m in LORA_MODULES]
    targets = settings.target_modules
    if isinstance(targets, list):
        keys = [module_key(i, m) for i, m in candidates]
        for t in targets:
            if any(k == t or k.endswith(f".{t}") for k in EMBEDDING_KEYS):
                raise AdapterError(f"embedding or LM-head LoRA is not supported (target_modules has {t!r})")
            if not any(k == t or k.endswith(f".{t}") for k in keys):
                raise AdapterError(f"unknown target module {t!r}; supported: {', '.join(LORA_MODULES)}")
    expected = {c for c in candidates if settings.targets(module_key(*c))}
    if not expected:
        raise AdapterError(f"target_modules {targets!r} selects none of {', '.join(LORA_MODULES)}")
    return expected


def _check_module(layer: int, module: str, pair: dict, r: int, base: BaseShapes | None) -> None:
    key = module_key(layer, module)
    for side in ("A", "B"):
        if side not in pair:
            raise AdapterError(f"{key} has no lora_{side} tensor")
        t = pair[side]
        if t.dtype not in FLOAT_DTYPES:
            raise AdapterError(f"{key}.lora_{side} has dtype {t.dtype}; expected float32, float16 or bfloat16")
        if t.dim() != 2:
            raise AdapterError(f"{key}.lora_{side} has shape {list(t.shape)}; expected a matrix")
    a, b = pair["A"], pair["B"]
    in_f, out_f = base.features(module) if base else (a.shape[1], b.shape[0])
    for side, t, want in (("A", a, [r, in_f]), ("B", b, [out_f, r])):
        if list(t.shape) != want:
            dims = f"r={r}, in_features={in_f}" if side == "A" else f"out_features={out_f}, r={r}"
            raise AdapterError(f"{key}.lora_{side} has wrong shape {list(t.shape)}, expected {want} ({dims})")
        if not torch.isfinite(t).all():
            raise AdapterError(f"{key}.lora_{side} holds NaN or infinite values")


def parse_peft_adapter(
    cfg: dict, tensors: dict[str, torch.Tensor], base: BaseShapes | None, max_lora_rank: int
) -> dict[tuple[int, str], LoraModule]:
    """Validate a PEFT LoRA adapter; `cfg` is a JSON object already (the
    registry's config parser refuses anything else). Without `base`, in/out
    features and the layer count cannot be checked: A and B need only agree
    with each other and the config, and the layers are 0..(highest layer
    the tensors name)."""
    with _blaming(CONFIG_FILE):
        settings = parse_settings(cfg)
    with _blaming(WEIGHTS_FILE):
        groups = group_tensors(tensors, base.num_hidden_layers if base else None)
        if not groups:
            raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    num_layers = base.num_hidden_layers if base else 1 + max(layer for layer, _ in groups)
    with _blaming(CONFIG_FILE):  # the config's regexes are matched here, within their budget
        expected = _check_targets(settings, num_layers)
    untargeted = sorted(groups.keys() - expected)
    if untargeted:
        raise AdapterError(f"tensors for {module_key(*untargeted[0])}, which target_modules does not cover",
                           param=WEIGHTS_FILE)
    modules = {}
    for (layer, module), pair in sorted(groups.items()):
        key = module_key(layer, module)
        with _blaming(CONFIG_FILE):
            r, scaling = settings.rank_for(key), settings.scaling_for(key)
        if r > max_lora_rank:
            raise AdapterError(f"{key} has rank {r}, above max_lora_rank {max_lora_rank}", param=CONFIG_FILE)
        with _blaming(WEIGHTS_FILE):
            _check_module(layer, module, pair, r, base)
        modules[(layer, module)] = LoraModule(pair["A"], pair["B"], scaling)
    # After the shape checks: an adapter for another base model fails on shapes first.
    missing = sorted(expected - groups.keys())
    if missing:
        raise AdapterError(f"missing LoRA tensors for {module_key(*missing[0])}, which target_modules covers",
                           param=WEIGHTS_FILE)
    return modules


@contextmanager
def _blaming(param: str) -> Iterator[None]:
    """Errors raised inside, where they came from `param` (the file being
    checked), as that file's."""
    try:
        yield
    except AdapterError as exc:
        raise exc.blaming(param) from None


def check_fits(modules: dict[tuple[int, str], LoraModule], base: BaseShapes) -> None:
    """Re-check stored modules against a base model (e.g. before loading into the engine)."""
    for (layer, module), m in modules.items():
        if layer >= base.num_hidden_layers:
            raise AdapterError(f"layer index {layer} out of range (the base model has {base.num_hidden_layers} layers)")
        _check_module(layer, module, {"A": m.lora_a, "B": m.lora_b}, m.rank, base)
