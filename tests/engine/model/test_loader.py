"""Checkpoint loading: clear errors for what we refuse, exact weights for what we take."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.attention.torch_backend import TorchAttentionBackend
from engine.errors import ModelLoadError
from engine.model import loader
from engine.model.loader import (
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    load_model,
    resolve_model_dir,
)
from tests.engine.model.test_llama import PagedRunner, hf_logits, random_tokens, tiny_config

CPU = torch.device("cpu")
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_checkpoint(path: Path, config=None, model_cls=transformers.LlamaForCausalLM, gen_eos=None):
    """Saves a tiny random HF model (safetensors) with a tokenizer; returns the HF model."""
    torch.manual_seed(0)
    hf = model_cls(config or tiny_config()).eval()
    hf.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    if gen_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    return hf


def load(path, dtype=torch.float32):
    return load_model(str(path), dtype=dtype, device=CPU, attn_backend=TorchAttentionBackend())


# ---- errors ----------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*never downloads"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    (tmp_path / "weights.gguf").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a directory"):
        load(tmp_path / "weights.gguf")


def test_no_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(tmp_path)


def test_unsupported_architecture_is_named(tmp_path):
    transformers.GPT2Config(architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load(tmp_path)


def test_mistral_with_sliding_window_is_refused(tmp_path):
    config = transformers.MistralConfig(
        architectures=["MistralForCausalLM"], sliding_window=32, hidden_size=64, num_attention_heads=4
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="sliding_window=32"):
        load(tmp_path)


def test_pickle_only_weights_are_refused(tmp_path):
    tiny_config(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(ModelLoadError, match="pickle-only weights are not loaded; convert to safetensors"):
        load(tmp_path)


def test_no_weights_at_all(tmp_path):
    tiny_config(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load(tmp_path)


def test_missing_tensors_are_listed(tmp_path):
    save_checkpoint(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.self_attn.v_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.0\.self_attn\.v_proj\.weight"):
        load(tmp_path)


def test_truncated_safetensors(tmp_path):
    save_checkpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot read"):
        load(tmp_path)


def test_sequence_length_dependent_rope_is_refused(tmp_path):
    rope = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    save_checkpoint(tmp_path, tiny_config(rope_parameters=rope))
    with pytest.raises(ModelLoadError, match="'dynamic' depends on the sequence length"):
        load(tmp_path)


# ---- loading -----------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_saved_checkpoint_loads_and_matches(tmp_path, tied):
    hf = save_checkpoint(tmp_path, tiny_config(tie_word_embeddings=tied), gen_eos=[2, 7])
    loaded = load(tmp_path)
    assert loaded.model_dir == tmp_path
    assert loaded.max_model_len == 256
    assert loaded.eos_token_ids == frozenset({2, 7})
    assert loaded.chat_template == CHAT_TEMPLATE and loaded.has_chat_template
    assert loaded.tokenizer("w5 w9").input_ids == [5, 9]
    tokens = random_tokens(21, seed=3)
    (logits,) = PagedRunner(loaded.model, loaded.hf_config).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-5, rtol=1e-5)


def test_mistral_without_sliding_window_loads(tmp_path):
    config = transformers.MistralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    hf = save_checkpoint(tmp_path, config, model_cls=transformers.MistralForCausalLM)
    loaded = load(tmp_path)
    tokens = random_tokens(19, seed=4)
    (logits,) = PagedRunner(loaded.model, loaded.hf_config).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=1e-5, rtol=1e-5)


def test_float32_checkpoint_loads_as_bfloat16(tmp_path):
    hf = save_checkpoint(tmp_path)
    loaded = load(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    expected = hf.model.layers[1].self_attn.k_proj.weight.to(torch.bfloat16)
    qkv = loaded.model.layers[1].self_attn.qkv_proj
    k_rows = qkv.weight[qkv.offsets["k"] : qkv.offsets["k"] + qkv.sizes["k"]]
    assert torch.equal(k_rows, expected)


def test_kv_cache_sizing_and_allocation():
    config = tiny_config(num_hidden_layers=3, num_key_value_heads=2, head_dim=32)
    per_block = kv_cache_bytes_per_block(config, block_size=16, dtype=torch.bfloat16)
    assert per_block == 2 * 3 * 16 * 2 * 32 * 2
    caches = allocate_kv_caches(config, num_blocks=5, block_size=16, dtype=torch.bfloat16, device=CPU)
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, 16, 2, 32) and k.dtype == torch.bfloat16
        assert not k.any() and not v.any() and k.data_ptr() != v.data_ptr()
    assert sum(k.nbytes + v.nbytes for k, v in caches) == 5 * per_block



def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    flags, inside = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, "no mapping holds the tensor"
    return flags


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(__import__("mmap"), "MADV_HUGEPAGE")
                    or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="needs Linux's smaps and a kernel with transparent huge pages")
def test_cpu_kv_caches_are_advised_for_huge_pages():
    """The advice is what the code controls; whether the kernel then backs
    the range with 2 MiB pages depends on its THP settings and free memory."""
    config = tiny_config(num_hidden_layers=2, num_key_value_heads=2, head_dim=32)
    caches = allocate_kv_caches(config, num_blocks=300, block_size=16, dtype=torch.float32, device=CPU)
    for k, v in caches:
        assert "hg" in _vm_flags(k.data_ptr()) and "hg" in _vm_flags(v.data_ptr())
        k[7, 3, 1, 5] = 2.5  # writable, and views index as a torch tensor would
        assert k.sum().item() == 2.5 and not v.any()


def test_cpu_kv_caches_without_huge_pages(monkeypatch):
    """A kernel built without THP refuses the advice with EINVAL, as it does
    any advice it does not know (what stands in for it here): the cache is
    still allocated, zeroed, in plain pages."""
    import mmap

    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)
    with pytest.raises(OSError):
        mmap.mmap(-1, 4096).madvise(mmap.MADV_HUGEPAGE)
    config = tiny_config(num_hidden_layers=1, num_key_value_heads=2, head_dim=32)
    (k, v), = allocate_kv_caches(config, num_blocks=300, block_size=16, dtype=torch.bfloat16, device=CPU)
    assert k.shape == (300, 16, 2, 32) and not k.any() and not v.any() and k.data_ptr() != v.data_ptr()


# ---- the bundled model's cache -----------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"gguf v1")
    monkeypatch.setenv("LORAGW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "bundled_gguf_path", lambda: gguf)
    return gguf


def test_cache_entry_is_keyed_by_the_gguf_file(fake_gguf, tmp_path):
    first = loader.bundled_checkpoint_dir(fake_gguf)
    assert first.is_relative_to(tmp_path / "cache")
    os.utime(fake_gguf, ns=(1_000_000_000, 1_000_000_000))
    second = loader.bundled_checkpoint_dir(fake_gguf)
    fake_gguf.write_bytes(b"gguf v2, longer")
    os.utime(fake_gguf, ns=(1_000_000_000, 1_000_000_000))
    assert len({first, second, loader.bundled_checkpoint_dir(fake_gguf)}) == 3


def test_conversion_runs_once_and_lands_atomically(fake_gguf, monkeypatch):
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(out_dir)
        assert out_dir.name.startswith(".")  # writes go to a private temp dir
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    target = loader.ensure_bundled_checkpoint()
    assert target == loader.bundled_checkpoint_dir(fake_gguf)
    assert (target / "config.json").is_file() and not calls[0].exists()
    assert loader.ensure_bundled_checkpoint() == target and len(calls) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_concurrent_conversion_keeps_the_winners_copy(fake_gguf, monkeypatch):
    target = loader.bundled_checkpoint_dir(fake_gguf)

    def convert_while_another_process_wins(gguf, out_dir):
        (out_dir / "config.json").write_text('{"mine": true}')
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(loader, "_convert_gguf", convert_while_another_process_wins)
    assert loader.ensure_bundled_checkpoint() == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


# ---- the real bundled model ----------------------------------------------------


@pytest.mark.smollm
def test_bundled_smollm2_matches_hf_and_reloads_from_the_cache(monkeypatch):
    """Uses the default cache dir (CI warms it); converts on first use otherwise.

    A reload must come from the cached conversion, never convert again; how
    long it takes is a benchmark's business, not an assertion on a shared host."""
    load_model(None, dtype=torch.float32, device=CPU, attn_backend=TorchAttentionBackend())

    def no_second_conversion(gguf, out_dir):
        raise AssertionError(f"reloading converted {gguf} again")

    monkeypatch.setattr(loader, "_convert_gguf", no_second_conversion)
    loaded = load_model(None, dtype=torch.float32, device=CPU, attn_backend=TorchAttentionBackend())
    assert loaded.has_chat_template and loaded.eos_token_ids == frozenset({2})

    hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    tokens = loaded.tokenizer(prompt).input_ids
    (logits,) = PagedRunner(loaded.model, loaded.hf_config, num_blocks=16, block_size=16).step([(0, tokens)])
    ref = hf_logits(hf, tokens)
    torch.testing.assert_close(logits[-1], ref[-1], atol=1e-4, rtol=1e-4)
    assert logits[-1].argmax() == ref[-1].argmax()
