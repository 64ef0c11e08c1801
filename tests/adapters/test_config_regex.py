"""Issue 12, defect 5: an adapter_config.json can no longer freeze the process.

Its regexes (target_modules or exclude_modules as a string, layers_pattern,
the keys of rank_pattern and alpha_pattern) are matched by RE2, in bounded
work, and still mean what they mean to peft (whose functions are the
reference here); its numbers are finite and in range; a regex that `re` or
RE2 rejects is an AdapterError (a 400), never a 500.
"""

from __future__ import annotations

import random
import re
import time

import pytest
import re2
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from adapters.config_regex import MATCH_BUDGET, MAX_PATTERN_CHARS, MatchBudget, compile_regex
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
    r"model\.layers\.(1?[0-9])\.self_attn\.(q|v)_proj",
    r".*\.(self_attn|mlp)\.\w+_proj",
    r"(?i).*\.Q_PROJ",
    r"model\.layers\.\d{1,2}\.mlp\.(gate|up|down)_proj",
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


def test_rank_and_alpha_patterns_pick_what_peft_picks_with_exclude_and_layers():
    cfg = dict(target_modules=r".*\.(q_proj|v_proj|down_proj)", exclude_modules=r".*\.1\d\..*",
               rank_pattern={r"layers\.(\d)\.self_attn\.q_proj": 3}, alpha_pattern={r"v_pr.j": 2.5})
    ours = _settings(**cfg)
    peft_config = LoraConfig(r=4, lora_alpha=8, **cfg)
    selected = [k for k in KEYS if ours.targets(k)]
    assert selected == [k for k in KEYS if check_target_module_exists(peft_config, k)]
    for key in selected:
        rank = cfg["rank_pattern"].get(get_pattern_key(list(cfg["rank_pattern"]), key), 4)
        assert ours.rank_for(key) == rank, key
        assert ours.scaling_for(key) == cfg["alpha_pattern"].get(get_pattern_key(["v_pr.j"], key), 8) / rank, key


def _random_regex(rng: random.Random, depth: int = 0) -> str:
    atoms = ["a", "b", ".", r"\.", "[ab]", "[^a]", r"\d", r"\w", "1"]
    if depth > 2 or rng.random() < 0.4:
        return rng.choice(atoms)
    kind = rng.choice(["seq", "alt", "star", "plus", "opt", "lazy", "count", "group", "anchor"])
    sub = lambda: _random_regex(rng, depth + 1)  # noqa: E731
    return {
        "seq": lambda: sub() + sub(), "alt": lambda: f"(?:{sub()}|{sub()})", "star": lambda: f"(?:{sub()})*",
        "plus": lambda: f"(?:{sub()})+", "opt": lambda: f"(?:{sub()})?", "lazy": lambda: f"(?:{sub()})*?",
        "count": lambda: f"(?:{sub()}){{{rng.randint(0, 2)},{rng.randint(2, 3)}}}", "group": lambda: f"({sub()})",
        "anchor": lambda: rng.choice(["^", "$", r"\b", r"\B"]) + sub(),
    }[kind]()


def test_re2_agrees_with_re_on_random_regexes():
    """`re` (peft's engine) as the reference, on short texts where its backtracking is
    still cheap: whether a name matches, and which layer index peft's wrapper reads."""
    rng = random.Random(12)
    # No empty text: module names are never empty, and there `re` alone finds no \B (until Python 3.14).
    texts = ["a", "ab", "a.b", "ba1.a", "aab.b1", "a.1.b.a", "b..a1ba", ".", "1.a"]
    for _ in range(400):
        pattern = _random_regex(rng)
        full = compile_regex(pattern, "t")
        prefixed = compile_regex(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", "t", tenant_part=pattern)
        for text in texts + [t + ".12.x" for t in texts]:
            budget = MatchBudget()
            assert budget.fullmatch(full, text) == (re.fullmatch(pattern, text) is not None), (pattern, text)
            want = re.match(prefixed.pattern, text)
            got = budget.match(prefixed, text)
            assert (got is None) == (want is None), (pattern, text)
            if want is not None:
                assert got.group("idx") == want.group("idx"), (pattern, text)


# Catastrophic backtracking for `re` on a module name: (.|.)*! tries 2^31
# ways to read model.layers.0.self_attn.q_proj before failing.
REDOS = [r"(a+)+$", r"(.|.)*!", r"(.*.*)*x", r"(\w|\d|.)*z", r"(?:(?:.*)*)*Z", r"(.*){30}Z", r"(?:.?){40}.{40}"]


@pytest.mark.parametrize("pattern", REDOS)
def test_redos_pattern_is_matched_by_re2(pattern):
    settings = _settings(target_modules=pattern)
    assert [type(r) for r in settings.regexes] == [re2._Regexp]  # RE2 matches it, not re
    assert not any(settings.targets(k) for k in KEYS)
    # No backtracking to blow up on a name of any length: each needs a last
    # character or a length that this name does not have.
    assert not MatchBudget().fullmatch(settings.regexes[0], "a" * 50_000 + "." + KEYS[0])


def test_redos_adapter_upload_is_refused_not_frozen(valid_files, tiny_config, tmp_path, monkeypatch):
    """The whole upload path: RE2 matches (.|.)*! against every module name,
    and `re`'s matching functions, poisoned, are never reached (with them,
    the pattern would backtrack 2^31 ways per module)."""
    cfg, tensors = valid_files
    cfg["target_modules"] = r"(.|.)*!"
    matched_by_re2 = []
    re2_fullmatch = re2._Regexp.fullmatch

    def spy(regex, text, *args):
        matched_by_re2.append((regex.pattern, text))
        return re2_fullmatch(regex, text, *args)

    def backtracking(*args, **kwargs):
        raise AssertionError(f"re matched an adapter regex: {args}")

    registry = AdapterRegistry(tmp_path, base_config=tiny_config)
    start = time.perf_counter()
    with monkeypatch.context() as patched:
        patched.setattr(re2._Regexp, "fullmatch", spy)
        for name in ("match", "fullmatch", "search"):
            patched.setattr(re, name, backtracking)
        with pytest.raises(AdapterError) as refused:
            registry.put("a", *as_upload(cfg, tensors))
    assert "target_modules '(.|.)*!' selects none of q_proj" in str(refused.value)
    keys = {text for pattern, text in matched_by_re2 if pattern == cfg["target_modules"]}
    assert keys >= {module_key(i, m) for i in range(tiny_config.num_hidden_layers) for m in LORA_MODULES}
    assert time.perf_counter() - start < 30  # generous: `re` would take minutes per module


def test_redos_work_over_a_whole_config_is_capped():
    many = {rf"(?:.?){{40}}.{{40}}q{i}": 2 for i in range(1000)}  # each: about 700 RE2 instructions
    settings = _settings(target_modules="all-linear", rank_pattern=many)
    with pytest.raises(AdapterError, match=f"needs more than {MATCH_BUDGET} units"):
        for key in KEYS:
            settings.rank_for(key)


@pytest.mark.parametrize("cfg, message", [
    (dict(target_modules="q" * (MAX_PATTERN_CHARS + 1)), f"at most {MAX_PATTERN_CHARS}"),
    (dict(target_modules=r"(?:(?:q_proj){100}){100}"), "RE2 does not support regex '(?:(?:q_proj){100}){100}' "
                                                       "(invalid repetition size: {100})"),
    (dict(target_modules=r"(.*)\1"), r"RE2 does not support regex '(.*)\\1' (invalid escape sequence: \1)"),
    (dict(target_modules=r"(?>.*)q_proj"), "RE2 does not support regex '(?>.*)q_proj'"),
    (dict(target_modules=r".*+q_proj"), "RE2 does not support regex '.*+q_proj'"),
    (dict(target_modules=r"(?P<a>x)?(?(a)q|k)_proj"), "RE2 does not support"),
    (dict(target_modules=r".*\.q_proj\Z"), "RE2 does not support"),
    (dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="(?P<idx>layers)"),
     "layers_pattern: invalid regex '(?P<idx>layers)': redefinition of group name 'idx'"),
    (dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="(layers"),
     "layers_pattern: invalid regex '(layers'"),
    (dict(target_modules="all-linear", rank_pattern={"q_proj)": 2}), "rank_pattern key: invalid regex 'q_proj)'"),
    (dict(target_modules=".*", exclude_modules="(?<=a*)b"), "look-behind requires fixed-width pattern"),
    (dict(target_modules=r"model\.layers\.\d{,2}\.self_attn\.q_proj"), "'{,n}' is a repeat to Python"),
    (dict(target_modules=r".*[[:alpha:]]_proj"), "is a POSIX class to RE2"),
    (dict(target_modules=["q_proj"] * 2000), "target_modules has 2000 entries; at most 1024"),
    (dict(target_modules=[1, 2]), "target_modules must be a string or a list of strings"),
])
def test_malformed_or_too_complex_regex_is_an_adapter_error(cfg, message):
    with pytest.raises(AdapterError, match=re.escape(message)):
        _settings(**cfg)


@pytest.mark.parametrize("cfg", [
    dict(target_modules=r"^(?!.*mlp).*proj"),
    dict(target_modules=r".*(?<=attn\.)[qk]_proj"),
    dict(target_modules=r".*\.(?=q)q_proj"),
    dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern="(?!h)layers"),
    dict(target_modules="all-linear", alpha_pattern={r"(?<!mlp\.)down_proj": 2}),
])
def test_lookaround_regex_peft_accepts_is_refused_naming_re2(cfg):
    peft_config = LoraConfig(r=4, lora_alpha=8, **cfg)
    for key in KEYS:  # peft (re) matches it without complaint
        check_target_module_exists(peft_config, key)
        get_pattern_key(list(cfg.get("alpha_pattern", {})), key)
    with pytest.raises(AdapterError, match="RE2 does not support regex .* RE2, which has no lookaheads, lookbehinds"):
        _settings(**cfg)


NAN, INF = float("nan"), float("inf")
NOT_FINITE = "every number must be finite"


@pytest.mark.parametrize("changes, message", [
    (dict(lora_alpha=NAN), f"adapter_config.json is not valid JSON: NaN is not a JSON number; {NOT_FINITE}"),
    (dict(lora_alpha=INF), f"Infinity is not a JSON number; {NOT_FINITE}"),
    (dict(lora_alpha=-INF), f"-Infinity is not a JSON number; {NOT_FINITE}"),
    (dict(alpha_pattern={"q_proj": INF}), f"Infinity is not a JSON number; {NOT_FINITE}"),
    (dict(lora_dropout=NAN), f"NaN is not a JSON number; {NOT_FINITE}"),
    (dict(eva_config={"rho": INF}), f"Infinity is not a JSON number; {NOT_FINITE}"),
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
    # json.dumps writes NaN/Infinity; the registry's parser refuses them (Python's json.loads takes them).
    with pytest.raises(AdapterError, match=re.escape(message)):
        AdapterRegistry(tmp_path, base_config=tiny_config).put("a", *as_upload(cfg, tensors))


def test_lora_alpha_overflowing_to_infinity_is_refused(valid_files, tiny_config, tmp_path):
    cfg, tensors = valid_files
    config_json, weights = as_upload({**cfg, "lora_alpha": 12345.0}, tensors)
    config_json = config_json.replace(b"12345.0", b"1e400")  # json.loads would read inf
    with pytest.raises(AdapterError, match=re.escape(f"1e400 is out of range; {NOT_FINITE}")):
        AdapterRegistry(tmp_path, base_config=tiny_config).put("a", config_json, weights)


@pytest.mark.parametrize("name", ["r", "lora_alpha", "lora_dropout"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_nan_or_inf_in_a_config_dict_is_refused(name, value):
    """The same for a config that did not come through the registry's JSON parser."""
    with pytest.raises(AdapterError, match=f"{name} must be (an int|a finite number) in"):
        _settings(target_modules=["q_proj"], **{name: value})
