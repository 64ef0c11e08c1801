"""Our Llama against HF transformers on tiny random-weight configs.

The reference is HF's eager implementation run on whole sequences; ours runs
flat batches over a paged cache with shuffled blocks, in chunks, with
sequences of different lengths batched together. float32 must agree to 1e-5.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.errors import ModelLoadError
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import allocate_kv_caches

CPU = torch.device("cpu")
ATOL, RTOL = 1e-5, 1e-5


def tiny_config(**overrides) -> transformers.LlamaConfig:
    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.1,  # activations of order one, so 1e-5 means something
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    fields.update(overrides)
    return transformers.LlamaConfig(**fields)


def build_pair(config, dtype=torch.float32, seed: int = 0):
    """(HF model, our model) with the same random weights."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config).eval()
    ours = LlamaForCausalLM(config, TorchAttentionBackend(), dtype, CPU)
    ours.load_weights(hf.state_dict().items())
    return hf, ours


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len, vocab] float32
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


class PagedRunner:
    """The smallest runner that drives our model: a shuffled block pool,
    block tables, slot mapping and AttentionMetadata built by hand."""

    def __init__(self, model, config, *, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        self.model = model
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(config, num_blocks, block_size, model.dtype, CPU)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """work: (seq id, new tokens) per sequence -> logits [len(tokens), vocab] per sequence."""
        bs = self.block_size
        slots, tokens, positions, query_lens, seq_lens = [], [], [], [], []
        for seq, new in work:
            table = self.tables.setdefault(seq, [])
            start = self.lens.get(seq, 0)
            for j, token in enumerate(new):
                pos = start + j
                if pos // bs == len(table):
                    table.append(self.free.pop())
                slots.append(table[pos // bs] * bs + pos % bs)
                tokens.append(token)
                positions.append(pos)
            self.lens[seq] = start + len(new)
            query_lens.append(len(new))
            seq_lens.append(self.lens[seq])
        tables = [self.tables[seq] for seq, _ in work]
        width = max(len(t) for t in tables)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
            block_size=bs,
        )
        hidden = self.model(torch.tensor(tokens), torch.tensor(positions), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return [logits[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def random_tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=gen).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, atol=ATOL, rtol=RTOL) -> None:
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, atol=atol, rtol=rtol)


CONFIGS = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "mqa": {"num_key_value_heads": 1},
    "tied": {"tie_word_embeddings": True},
    "head_dim_32": {"head_dim": 32},
    "bias": {"attention_bias": True, "mlp_bias": True},
    "theta_500k": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "rope_linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    "rope_llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "rope_yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
}


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_full_prefill_matches_hf(variant):
    config = tiny_config(**CONFIGS[variant])
    hf, ours = build_pair(config)
    tokens = random_tokens(37, seed=1)
    (logits,) = PagedRunner(ours, config, block_size=16).step([(0, tokens)])
    assert_close(logits, hf_logits(hf, tokens))


def test_tied_embeddings_share_storage():
    _, ours = build_pair(tiny_config(tie_word_embeddings=True))
    assert ours.lm_head is ours.embed_tokens
    _, untied = build_pair(tiny_config(tie_word_embeddings=False))
    assert untied.lm_head.data_ptr() != untied.embed_tokens.data_ptr()


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("variant", ["gqa", "tied", "rope_llama3"])
def test_chunked_prefill_over_shuffled_blocks(variant, block_size):
    config = tiny_config(**CONFIGS[variant])
    hf, ours = build_pair(config)
    tokens = random_tokens(45, seed=2)
    runner = PagedRunner(ours, config, block_size=block_size, seed=block_size)
    chunks, pieces, start = [16, 3, 20, 6], [], 0
    for size in chunks:
        (logits,) = runner.step([(0, tokens[start : start + size])])
        pieces.append(logits)
        start += size
    assert sorted(runner.tables[0]) != runner.tables[0], "the block table should not be contiguous"
    assert_close(torch.cat(pieces), hf_logits(hf, tokens))


@pytest.mark.parametrize("variant", ["gqa", "mha", "mqa", "rope_linear"])
def test_batched_decode_of_different_lengths(variant):
    config = tiny_config(**CONFIGS[variant])
    hf, ours = build_pair(config)
    prompt_lens, decode_steps = [5, 17, 33, 1], 6
    seqs = [random_tokens(n + decode_steps, seed=10 + i) for i, n in enumerate(prompt_lens)]
    refs = [hf_logits(hf, s) for s in seqs]
    runner = PagedRunner(ours, config, block_size=4, seed=3)
    # One step prefills every prompt; then every sequence decodes together.
    outs = runner.step([(i, s[:n]) for i, (s, n) in enumerate(zip(seqs, prompt_lens, strict=True))])
    for i, n in enumerate(prompt_lens):
        assert_close(outs[i], refs[i][:n])
    for k in range(decode_steps):
        outs = runner.step([(i, [s[n + k]]) for i, (s, n) in enumerate(zip(seqs, prompt_lens, strict=True))])
        for i, n in enumerate(prompt_lens):
            assert_close(outs[i], refs[i][n + k : n + k + 1])


def test_mixed_step_prefill_chunk_with_decodes():
    config = tiny_config()
    hf, ours = build_pair(config)
    a, b = random_tokens(30, seed=4), random_tokens(40, seed=5)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    runner = PagedRunner(ours, config, block_size=4, seed=5)
    runner.step([(0, a[:20])])
    # b's first chunk and a's decodes share steps; then b's second chunk is over a cached prefix.
    out_a, out_b = runner.step([(0, [a[20]]), (1, b[:25])])
    assert_close(out_a, ref_a[20:21])
    assert_close(out_b, ref_b[:25])
    out_b, out_a = runner.step([(1, b[25:40]), (0, [a[21]])])
    assert_close(out_a, ref_a[21:22])
    assert_close(out_b, ref_b[25:40])


def test_decode_buckets_with_heavy_tailed_lengths():
    """Many decodes, lengths spread so the backend pads some into shared buckets."""
    config = tiny_config()
    hf, ours = build_pair(config)
    lens = [3, 4, 5, 9, 60, 61, 62, 100, 170]
    seqs = [random_tokens(n + 1, seed=20 + i) for i, n in enumerate(lens)]
    runner = PagedRunner(ours, config, num_blocks=160, block_size=4, seed=6)
    runner.step([(i, s[:-1]) for i, s in enumerate(seqs)])
    outs = runner.step([(i, s[-1:]) for i, s in enumerate(seqs)])
    for i, s in enumerate(seqs):
        assert_close(outs[i], hf_logits(hf, s)[-1:])


def test_bfloat16_smoke():
    config = tiny_config()
    hf, _ = build_pair(config)
    _, ours = build_pair(config, dtype=torch.bfloat16)
    assert ours.embed_tokens.dtype == torch.bfloat16
    tokens = random_tokens(24, seed=7)
    runner = PagedRunner(ours, config, block_size=4)
    prefill, decode = runner.step([(0, tokens[:23])])[0], runner.step([(0, tokens[23:])])[0]
    logits = torch.cat([prefill, decode])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    ref = hf_logits(hf, tokens)
    assert (logits - ref).abs().max() < 0.25 * ref.abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_forward_returns_hidden_and_logits_only_for_given_rows():
    config = tiny_config()
    _, ours = build_pair(config)
    runner = PagedRunner(ours, config)
    (logits,) = runner.step([(0, random_tokens(7, seed=8))])
    assert logits.shape == (7, config.vocab_size)
    hidden = torch.randn(3, config.hidden_size)
    assert ours.compute_logits(hidden).shape == (3, config.vocab_size)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_sequence_length_dependent_rope_is_rejected(rope_type):
    params = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    if rope_type == "longrope":
        params.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=64)
    config = tiny_config(rope_parameters=params)
    with pytest.raises(ModelLoadError, match=rope_type):
        LlamaForCausalLM(config, TorchAttentionBackend(), torch.float32, CPU)


def test_load_weights_reports_missing_unexpected_and_misshapen():
    config = tiny_config()
    hf, ours = build_pair(config)
    state = dict(hf.state_dict())
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        ours.load_weights(missing.items())
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.vision_tower.weight'"):
        ours.load_weights([*state.items(), ("model.vision_tower.weight", torch.zeros(1))])
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(ModelLoadError, match="k_proj.weight has shape"):
        ours.load_weights(state.items())
