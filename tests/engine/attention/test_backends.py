"""Every attention backend against the naive reference, on hand-built batches.

Without a GPU the Triton kernel runs under the interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 before anything imports triton). With one, both
backends run on CUDA tensors and the reference stays on the CPU.
"""

from dataclasses import dataclass

import pytest
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from tests.engine.attention.naive import naive_paged_attention
from tests.triton_env import KERNEL_DEVICE as DEVICE
from tests.triton_env import assert_runs_without_triton

BACKENDS = ["torch", "triton"]
TOLERANCE = {  # (atol, rtol) against the float64 reference
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def _get_backend(name: str) -> AttentionBackend:
    from engine.attention import get_attention_backend

    if name == "triton":
        pytest.importorskip("triton")
    return get_attention_backend(name, DEVICE)


@dataclass
class Case:
    query: torch.Tensor  # [T, num_heads, head_dim]
    key: torch.Tensor  # [T, num_kv_heads, head_dim]
    value: torch.Tensor  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor  # before the step
    v_cache: torch.Tensor
    meta: AttentionMetadata
    block_tables: list[list[int]]
    slots: list[int]


def make_case(
    seqs: list[tuple[int, int]],  # (seq_len, query_len) per sequence
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,  # None: dtype
    shared: tuple[tuple[int, int, int], ...] = (),  # (seq, source seq, leading blocks it borrows)
    seed: int = 0,
) -> Case:
    """A step's batch with a shuffled block pool. Borrowed blocks hold the same
    K/V in both sequences, as after a prefix-cache hit; when the source is still
    filling them in this step, the cache holds garbage there until the write."""
    gen = torch.Generator().manual_seed(seed)
    borrows = {dst: (src, n) for dst, src, n in shared}
    num_fresh = sum(-(-seq_len // block_size) for seq_len, _ in seqs) - sum(n for _, _, n in shared)
    num_blocks = num_fresh + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()

    tables: list[list[int]] = []
    owner: dict[int, int] = {}
    k_hist, v_hist = [], []
    for b, (seq_len, query_len) in enumerate(seqs):
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        table = []
        if b in borrows:
            src, n = borrows[b]
            assert src < b and n * block_size <= min(seqs[src][0], seq_len - query_len)
            table = tables[src][:n]
            k[: n * block_size] = k_hist[src][: n * block_size]
            v[: n * block_size] = v_hist[src][: n * block_size]
        while len(table) * block_size < seq_len:
            table.append(free.pop())
            owner[table[-1]] = b
        tables.append(table)
        k_hist.append(k)
        v_hist.append(v)

    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    slots, new_k, new_v = [], [], []
    for b, (seq_len, query_len) in enumerate(seqs):
        context_len = seq_len - query_len
        for p in range(seq_len):
            block, offset = tables[b][p // block_size], p % block_size
            if p >= context_len:
                slots.append(block * block_size + offset)
                new_k.append(k_hist[b][p])
                new_v.append(v_hist[b][p])
            elif p < seqs[owner[block]][0] - seqs[owner[block]][1]:  # cached by the block's owner
                k_cache[block, offset] = k_hist[b][p]
                v_cache[block, offset] = v_hist[b][p]

    query_lens = [q for _, q in seqs]
    seq_lens = [s for s, _ in seqs]
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=DEVICE),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
        block_size=block_size,
    )
    return Case(
        query=torch.randn(len(slots), num_heads, head_dim, generator=gen).to(DEVICE, dtype),
        key=torch.stack(new_k).to(DEVICE, dtype),
        value=torch.stack(new_v).to(DEVICE, dtype),
        k_cache=k_cache.to(DEVICE, cache_dtype or dtype),
        v_cache=v_cache.to(DEVICE, cache_dtype or dtype),
        meta=meta,
        block_tables=tables,
        slots=slots,
    )


def check_backend(backend: AttentionBackend, case: Case) -> None:
    dtype = case.query.dtype
    head_dim = case.query.shape[-1]
    scale = head_dim**-0.5
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    out = backend.forward(case.query, case.key, case.value, k_cache, v_cache, case.meta, scale)
    ref_out, ref_k, ref_v = naive_paged_attention(
        case.query.cpu(),
        case.key.cpu(),
        case.value.cpu(),
        case.k_cache.cpu(),
        case.v_cache.cpu(),
        case.block_tables,
        case.slots,
        case.meta.seq_lens_host,
        case.meta.query_lens_host,
        scale,
    )
    assert torch.equal(k_cache.cpu(), ref_k), "K cache differs from the step's writes"
    assert torch.equal(v_cache.cpu(), ref_v), "V cache differs from the step's writes"
    assert out.shape == case.query.shape and out.dtype == dtype and out.device == case.query.device
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=atol, rtol=rtol)


SCENARIOS = {
    "decode_varied_lengths": [(1, 1), (7, 1), (16, 1), (17, 1), (33, 1)],
    "prefill_no_prefix": [(5, 5), (20, 20), (37, 37)],
    "prefill_over_prefix": [(30, 12), (40, 25), (19, 3)],
    "mixed": [(33, 1), (24, 24), (40, 9), (5, 1), (18, 2)],
    "skew_1_long_7_short": [(40, 24)] + [(n, 1) for n in (3, 9, 2, 12, 6, 1, 15)],
    "skew_7_long_1_short": [(36, 12), (40, 1), (33, 17), (38, 2), (35, 35), (39, 1), (34, 5), (2, 2)],
    # Past one kernel KV tile (64 keys), so the running max and sum are rescaled.
    "long_context": [(150, 20), (130, 1), (70, 70), (65, 1)],
}


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_scenarios(backend_name, scenario, dtype, block_size):
    backend = _get_backend(backend_name)
    case = make_case(SCENARIOS[scenario], block_size=block_size, dtype=dtype, head_dim=32, seed=block_size)
    check_backend(backend, case)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(3, 3), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_gqa_ratios(backend_name, num_heads, num_kv_heads):
    backend = _get_backend(backend_name)
    case = make_case(SCENARIOS["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=4, seed=7)
    check_backend(backend, case)


@pytest.mark.parametrize(
    "seqs,shared",
    [
        # The borrowed blocks were cached in an earlier step.
        ([(20, 4), (28, 3), (19, 1)], ((1, 0, 4), (2, 0, 3))),
        # The source fills the borrowed blocks in this very step: the write
        # must land for the whole batch before sequence 1 reads them.
        ([(24, 24), (30, 6)], ((1, 0, 4),)),
    ],
    ids=["cached_prefix", "filled_this_step"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_shared_prefix_blocks(backend_name, dtype, seqs, shared):
    backend = _get_backend(backend_name)
    case = make_case(seqs, shared=shared, block_size=4, dtype=dtype, num_heads=6, num_kv_heads=2, seed=3)
    check_backend(backend, case)


@pytest.mark.parametrize("head_dim", [16, 32, 64])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_head_dims_fp16(backend_name, head_dim):
    backend = _get_backend(backend_name)
    seqs = [(9, 1), (21, 6)]
    case = make_case(seqs, head_dim=head_dim, dtype=torch.float16, num_heads=9, num_kv_heads=3, seed=11)
    check_backend(backend, case)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_non_contiguous_query(backend_name):
    """The runner may hand over query as a view of a fused qkv projection."""
    backend = _get_backend(backend_name)
    case = make_case(SCENARIOS["mixed"], seed=5)
    fused = torch.cat([case.query, torch.zeros_like(case.query)], dim=1)
    case.query = fused[:, : case.query.shape[1]]
    assert not case.query.is_contiguous()
    check_backend(backend, case)


@pytest.mark.parametrize("scenario", ["mixed", "long_context", "skew_1_long_7_short"])
def test_triton_matches_the_torch_path(scenario):
    """The two backends side by side on the same batch and cache."""
    case = make_case(SCENARIOS[scenario], block_size=16, head_dim=32, seed=21)
    outs = []
    for name in ("torch", "triton"):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        backend = _get_backend(name)
        backend.prepare(case.meta)
        outs.append(backend.forward(case.query, case.key, case.value, k_cache, v_cache,
                                    case.meta, case.query.shape[-1] ** -0.5))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_engine_on_the_triton_path_matches_the_torch_path(tiny_llama_dir):
    """The whole engine, chunked prefill and decode, on each backend."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    prompts = ["The quick brown fox jumps over the lazy dog", "Hi"]
    results = [
        [o.outputs[0].token_ids for o in
         LLM(str(tiny_llama_dir), attention_backend=name, max_num_batched_tokens=8, device=DEVICE.type,
             dtype="float32").generate(prompts, params)]
        for name in ("torch", "triton")
    ]
    assert results[0] == results[1]


def test_importing_engine_attention_does_not_import_triton():
    assert_runs_without_triton(
        "import engine.attention, engine.attention.base\n"
        "assert 'triton.language' not in sys.modules\n"
        "get = getattr(engine.attention, 'get_attention_backend', None)\n"
        "if get is not None:\n"
        "    import torch\n"
        "    get('torch', torch.device('cpu'))\n"
    )
