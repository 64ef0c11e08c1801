"""Issue 12, defect 5: an adapter_config.json can no longer freeze the process.

Its regexes (target_modules or exclude_modules as a string, layers_pattern,
the keys of rank_pattern and alpha_pattern) are matched in bounded work and
still mean what they mean to peft; its numbers are finite and in range; a
regex that `re` rejects is an AdapterError (a 400), never a 500.
"""

from __future__ import annotations

import random
import re

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from adapters.bounded_regex import MATCH_BUDGET, MAX_PATTERN_CHARS, BoundedRegex, MatchBudget
from adapters.errors import AdapterError
from adapters.peft_config import LORA_MODULES, module_key, parse_settings
from adapters.registry import AdapterRegistry
from tests.adapters.conftest import as_upload

# The module names of a 32-layer Llama, and the two that LoRA must never target.
KEYS = [module_key(i, m) for i in range(32) for m in LORA_MODULES] + ["model.embed_tokens", "lm_head"]

REAL_TARGET_REGEXES = [
    r".*\.(q_proj|v_proj)",
    r"model.layers.*.self_attn.(q_proj|k_proj)",
    r".*(q_proj|k_proj|v_proj|o_proj)$",
    r"^(?!.*mlp).*proj",
    r"model\.layers\.(1?[0-9])\.self_attn\.(q|v)_proj",
    r".*\.(self_attn|mlp)\.\w+_proj",
    r"(?i).*\.Q_PROJ",
    r"model\.layers\.\d{1,2}\.mlp\.(gate|up|down)_proj",
    r".*(?<=attn\.)[qk]_proj",
    r"model.layers.[0-9]+.self_attn.q_proj",
]


def _settings(**cfg):
    return parse_settings({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **cfg})


@pytest.mark.parametrize("pattern", REAL_TARGET_REGEXES)
def test_real_target_regexes_select_what_peft_selects(pattern):
    ours = _settings(target_modules=pattern)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=pattern)
    selected = [k for k in KEYS if ours.targets(k)]
    assert selected == [k for k in KEYS if check_target_module_exists(peft_config, k)]
    assert selected  # each of them selects something


@pytest.mark.parametrize("layers_pattern", [None, "layers", "(?:layers|h)", "layers|blocks", "lay.rs", ["h", "layers"]])
def test_layers_pattern_and_layers_to_transform_select_what_peft_selects(layers_pattern):
    cfg = dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1, 3, 17], layers_pattern=layers_pattern)
    ours = _settings(**cfg)
    peft_config = LoraConfig(r=4, lora_alpha=8, **cfg)
    assert [k for k in KEYS if ours.targets(k)] == [k for k in KEYS if check_target_module_exists(peft_config, k)]


def test_rank_and_alpha_patterns_pick_what_peft_picks():
    ranks = {"q_proj": 2, r"layers\.1\d\.mlp\..*": 6, "model.layers.3.self_attn.v_proj": 3, r"(k|v)_proj": 5,
             r"layers.2.*": 7}
    alphas = {"down_proj": 3.5, r"model\.layers\.(2|30)\..*": 16}
    ours = _settings(target_modules="all-linear", rank_pattern=ranks, alpha_pattern=alphas)
    for key in KEYS[:-2]:
        rank = ranks.get(get_pattern_key(list(ranks), key), 4)
        alpha = alphas.get(get_pattern_key(list(alphas), key), 8)
        assert ours.rank_for(key) == rank, key
        assert ours.scaling_for(key) == alpha / rank, key


def _random_regex(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", ".", r"\.", "[ab]", "[^a]", r"\d", r"\w", "1"]
    if depth > 2 or rng.random() < 0.4:
        return rng.choice(atoms)
    kind = rng.choice(["seq", "alt", "star", "plus", "opt", "lazy", "count", "group", "anchor", "look"])
    sub = lambda: _random_regex(rng, depth + 1)  # noqa: E731
    return {
        "seq": lambda: sub() + sub(), "alt": lambda: f"(?:{sub()}|{sub()})", "star": lambda: f"(?:{sub()})*",
        "plus": lambda: f"(?:{sub()})+", "opt": lambda: f"(?:{sub()})?", "lazy": lambda: f"(?:{sub()})*?",
        "count": lambda: f"(?:{sub()}){{{rng.randint(0, 2)},{rng.randint(2, 3)}}}", "group": lambda: f"({sub()})",
        "anchor": lambda: rng.choice(["^", "$", r"\b", r"\B"]) + sub(),
        "look": lambda: rng.choice(["(?=", "(?!"]) + sub() + ")" + sub(),
    }[kind]()


def test_bounded_matcher_agrees_with_re_on_random_regexes():
    """`re` as the reference, on short texts where its backtracking is still cheap."""
    rng = random.Random(12)
    texts = ["", "a", "ab", "a.b", "ba1.a", "aab.b1", "a.1.b.a", "b..a1ba"]
    for _ in range(400):
        pattern = _random_regex(rng)
        full = BoundedRegex(pattern, where="t")
        prefixed = BoundedRegex(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", where="t", user_part=pattern, track="idx")
        for text in texts + [t + ".12.x" for t in texts]:
            budget = MatchBudget()
            assert full.fullmatch(text, budget) == (re.fullmatch(pattern, text) is not None), (pattern, text)
            want = re.match(prefixed.pattern, text)
            got = prefixed.match(text, budget)
            assert (got is None) == (want is None), (pattern, text)
            if want is not None:
                assert got.group == (want.span("idx") if want.group("idx") is not None else None), (pattern, text)


# Catastrophic backtracking for `re` on a module name: (.|.)*! tries 2^31
# ways to read model.layers.0.self_attn.q_proj before failing.
REDOS = [r"(a+)+$", r"(.|.)*!", r"(.*.*)*x", r"(\w|\d|.)*z", r"(?:(?:.*)*)*Z", r"(.*){30}Z", r"(?:.?){40}.{40}"]


@pytest.mark.parametrize("pattern", REDOS)
def test_redos_pattern_is_matched_in_bounded_work(pattern):
    regex = BoundedRegex(pattern, where="target_modules")
    assert regex.states > 0  # the Pike VM runs it, not re
    for key in KEYS:
        budget = MatchBudget()
        regex.fullmatch(key, budget)
        assert MATCH_BUDGET - budget.left <= 2 * regex.states * (len(key) + 1)


def test_redos_adapter_upload_is_refused_not_frozen(valid_files, tiny_config, tmp_path):
    cfg, tensors = valid_files
    cfg["target_modules"] = r"(.|.)*!"
    with pytest.raises(AdapterError, match="selects none of q_proj"):
        AdapterRegistry(tmp_path, base_config=tiny_config).put("a", *as_upload(cfg, tensors))


def test_redos_work_over_a_whole_config_is_capped():
    many = {rf"(?:.*){{200}}q{i}": 2 for i in range(50)}  # each: hundreds of states on every module
    settings = _settings(target_modules="all-linear", rank_pattern=many)
    with pytest.raises(AdapterError, match=f"needs more than {MATCH_BUDGET} steps"):
        for key in KEYS:
            settings.rank_for(key)


@pytest.mark.parametrize("cfg, message", [
    (dict(target_modules="q" * (MAX_PATTERN_CHARS + 1)), f"at most {MAX_PATTERN_CHARS}"),
    (dict(target_modules=r"(?:(?:q_proj){100}){100}"), "regex too complex"),
    (dict(target_modules=r"(.*)\1"), "backreferences are not supported"),
    (dict(target_modules=r"(?>.*)q_proj"), "atomic groups are not supported"),
    (dict(target_modules=r".*+q_proj"), "possessive repeats are not supported"),
    (dict(target_modules=r"(?P<a>x)?(?(a)q|k)_proj"), "conditional groups are not supported"),
    (dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="(?P<idx>layers)"),
     "redefinition of group name 'idx'"),
    (dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="(layers"), "invalid regex"),
    (dict(target_modules="all-linear", rank_pattern={"q_proj)(": 2}), "rank_pattern key: invalid regex"),
    (dict(target_modules=".*", exclude_modules="(?<=a*)b"), "look-behind requires fixed-width pattern"),
    (dict(target_modules=["q_proj"] * 2000), "target_modules has 2000 entries; at most 1024"),
    (dict(target_modules=[1, 2]), "target_modules must be a string or a list of strings"),
])
def test_malformed_or_too_complex_regex_is_an_adapter_error(cfg, message):
    with pytest.raises(AdapterError, match=re.escape(message)):
        _settings(**cfg)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("changes, message", [
    (dict(lora_alpha=NAN), "adapter_config.lora_alpha is nan; every number must be finite"),
    (dict(lora_alpha=INF), "adapter_config.lora_alpha is inf"),
    (dict(lora_alpha=-INF), "adapter_config.lora_alpha is -inf"),
    (dict(alpha_pattern={"q_proj": INF}), "adapter_config.alpha_pattern.q_proj is inf"),
    (dict(lora_dropout=NAN), "adapter_config.lora_dropout is nan"),
    (dict(eva_config={"rho": INF}), "adapter_config.eva_config.rho is inf"),
    (dict(lora_alpha=1e300), "lora_alpha must be a finite number in (0, 1000000.0]"),
    (dict(lora_alpha=0), "lora_alpha must be a finite number in (0, 1000000.0]"),
    (dict(r=10**30), "r must be an int in (0, 65536]"),
    (dict(rank_pattern={"q_proj": 2**40}), "rank_pattern 'q_proj' must be an int in (0, 65536]"),
    (dict(alpha_pattern={"q_proj": -1}), "alpha_pattern 'q_proj' must be a finite number in (0, 1000000.0]"),
    (dict(lora_dropout=2.0), "lora_dropout must be a finite number in [0.0, 1.0], got 2.0"),
    (dict(layers_to_transform=[0, -1]), "layers_to_transform must be an int in [0, 65536], got -1"),
    (dict(layers_to_transform=True), "layers_to_transform must be an int in [0, 65536], got True"),
    (dict(layers_to_transform=[10**30]), "layers_to_transform must be an int in [0, 65536]"),
])
def test_nan_inf_and_out_of_range_numbers_are_refused(changes, message, valid_files, tiny_config, tmp_path):
    cfg, tensors = valid_files
    cfg.update(changes)
    # json.dumps writes NaN/Infinity, and json.loads (like the registry) reads them back as floats.
    with pytest.raises(AdapterError, match=re.escape(message)):
        AdapterRegistry(tmp_path, base_config=tiny_config).put("a", *as_upload(cfg, tensors))
