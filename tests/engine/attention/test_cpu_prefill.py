"""The C++ CPU prefill kernel against the naive float64 reference, in
each pairing it builds (float32 over a float32 or float16 cache anywhere,
bfloat16 with AVX512-BF16): first chunks and chunks over a cached prefix,
chunks that end mid-tile, borrowed prefix blocks, every head shape it
builds, and stale NaNs in the cache past a chunk's end that must not leak
in. The float32 cases turn the decode kernel off, so that chunks of up to
SHORT_CHUNK_ROWS rows, which it would take, reach this kernel too."""

import pytest
import torch

from engine.attention import cpu_prefill
from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.attention.test_backends import SCENARIOS, check_backend, make_case
from tests.native import built_or_skip

PREFILL_HEAVY = ["prefill_no_prefix", "prefill_over_prefix", "mixed", "skew_7_long_1_short", "long_context"]
# (seq_len, query_len): one-token-past-a-tile chunks, a chunk of 17 (two
# query blocks, the second of one row), and long chunks over long prefixes.
LONG_PREFILLS = [(17, 17), (40, 17), (300, 300), (530, 211), (16, 16), (33, 1), (95, 2), (700, 64)]
# (query dtype, cache dtype)
PAIRINGS = {"fp32": (torch.float32, torch.float32), "fp32-f16cache": (torch.float32, torch.float16),
            "bf16": (torch.bfloat16, torch.bfloat16)}


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_prefill.load_kernel, "CPU prefill kernel")


@pytest.fixture(params=list(PAIRINGS))
def dtypes(request, kernel):
    """A pairing the kernel takes on this host: bfloat16 needs AVX512-BF16."""
    if request.param == "bf16" and not kernel.has_bfloat16():
        pytest.skip("the CPU prefill kernel takes bfloat16 only with AVX512-BF16")
    return PAIRINGS[request.param]


def _kernel_backend() -> TorchAttentionBackend:
    return TorchAttentionBackend(prefill_kernel=True, decode_kernel=False)


def _case(seqs, dtypes, **kwargs):
    dtype, cache_dtype = dtypes
    return make_case(seqs, dtype=dtype, cache_dtype=cache_dtype, **kwargs)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("scenario", PREFILL_HEAVY)
def test_scenarios_match_the_reference(dtypes, scenario, block_size):
    case = _case(SCENARIOS[scenario], dtypes, block_size=block_size, head_dim=64, num_heads=6, num_kv_heads=2,
                 seed=block_size)
    check_backend(_kernel_backend(), case)


@pytest.mark.parametrize("head_dim", cpu_prefill.HEAD_DIMS)
@pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(3, 3), (9, 3), (8, 2), (16, 1)], ids=["mha", "smollm", "gqa4", "mqa16"])
def test_head_shapes(dtypes, num_heads, num_kv_heads, head_dim):
    seqs = LONG_PREFILLS if head_dim <= 64 else LONG_PREFILLS[:5]
    case = _case(seqs, dtypes, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                 seed=head_dim)
    check_backend(_kernel_backend(), case)


def test_shared_prefix_blocks(dtypes):
    """A chunk reads prefix blocks another sequence filled, one in this very step."""
    case = _case([(48, 48), (60, 12), (64, 40)], dtypes, shared=((1, 0, 3), (2, 0, 1)), block_size=16,
                 num_heads=9, num_kv_heads=3, head_dim=64, seed=7)
    check_backend(_kernel_backend(), case)


def test_stale_nan_past_the_context_stays_out(dtypes):
    """Slots of a chunk's last block past its end hold whatever an earlier
    sequence left there; the kernel may read them (bfloat16 reads a whole
    tile; float32 widens only the visible rows) but must weigh them by
    exactly zero, even when they are NaN: the output is bit for bit the one
    over finite garbage, which matches the reference."""
    case = _case([(21, 21), (40, 13), (7, 7)], dtypes, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                 seed=8)
    check_backend(_kernel_backend(), case)
    written = torch.zeros(case.k_cache.shape[0] * 16, dtype=torch.bool)
    for table, seq_len in zip(case.block_tables, case.meta.seq_lens_host, strict=True):
        for p in range(seq_len):
            written[table[p // 16] * 16 + p % 16] = True
    outs = []
    for poison in (False, True):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        if poison:
            for cache in (k_cache, v_cache):
                cache.view(-1, 3, 64)[~written] = float("nan")
        outs.append(_kernel_backend().forward(case.query, case.key, case.value, k_cache, v_cache, case.meta, 0.125))
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("parallel_tiles", [0, 10**9], ids=["parallel", "serial"])
def test_calls_on_one_thread_or_both_match_the_reference(dtypes, monkeypatch, parallel_tiles):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(cpu_prefill, "PARALLEL_TILES_WHEN_THREADS_SLEEP", parallel_tiles)
    case = _case(LONG_PREFILLS, dtypes, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=9)
    check_backend(_kernel_backend(), case)


def test_kernel_and_sdpa_agree_on_smollm_shapes(dtypes):
    """Kernel and the SDPA twin on the same batch (in bfloat16, the same
    rounding of the weights, so closer to each other than to float64)."""
    case = _case(LONG_PREFILLS, dtypes, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=4)
    outs = []
    for backend in (_kernel_backend(), TorchAttentionBackend(prefill_kernel=False, decode_kernel=False)):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        outs.append(backend.forward(case.query, case.key, case.value, k_cache, v_cache, case.meta, 0.125))
    tol = 1.6e-2 if dtypes[0] == torch.bfloat16 else 1e-5
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)


def test_non_contiguous_query_rows(dtypes):
    """The model hands over query as a view of its fused q/k projection."""
    case = _case(SCENARIOS["mixed"], dtypes, num_heads=6, num_kv_heads=2, head_dim=64, seed=5)
    fused = torch.cat([case.query, torch.zeros(case.query.shape[0], 2, 64, dtype=case.query.dtype)], dim=1)
    case.query = fused[:, :6]
    assert not case.query.is_contiguous()
    check_backend(_kernel_backend(), case)


def test_what_it_does_not_cover_goes_to_sdpa(kernel):
    """float16 queries, head_dim 48, blocks of 8 positions, and bfloat16
    without AVX512-BF16 take the SDPA path, and requiring the kernel for
    them is an error."""
    cases = [
        make_case(SCENARIOS["prefill_over_prefix"], head_dim=64, dtype=torch.float16, seed=1),
        make_case(SCENARIOS["prefill_over_prefix"], head_dim=48, seed=2),
        make_case(SCENARIOS["prefill_over_prefix"], head_dim=64, block_size=8, seed=3),
    ]
    if not kernel.has_bfloat16():
        cases.append(make_case(SCENARIOS["prefill_over_prefix"], head_dim=64, dtype=torch.bfloat16, seed=4))
    for case in cases:
        assert not cpu_prefill.supports(case.query, case.k_cache)
        check_backend(TorchAttentionBackend(), case)
        with pytest.raises(ValueError, match="does not support"):
            TorchAttentionBackend(prefill_kernel=True).forward(
                case.query, case.key, case.value, case.k_cache.clone(), case.v_cache.clone(), case.meta, 0.2)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,tail", [(9, 3, 2), (9, 3, 5), (9, 3, 6), (9, 3, 15), (8, 2, 8), (16, 1, 3)],
    ids=["smollm-2", "smollm-5", "smollm-6", "smollm-15", "gqa4-8", "mqa16-3"])
@pytest.mark.parametrize("parallel_tiles", [0, 10**9], ids=["parallel", "serial"])
def test_bfloat16_short_chunks_match_the_same_rows_in_a_whole_prompt(kernel, monkeypatch, num_heads, num_kv_heads,
                                                                      tail, parallel_tiles):
    """A chunk of 2 to 15 rows (a verification, a prompt's tail past a
    cached prefix; one row is a decode row, the decode kernel's) shares its
    items' lanes among the query heads of a KV head, where a longer chunk
    gives each query head its own: its rows come out bit for bit as the same
    positions do inside a whole prompt, next to a long chunk of another
    sequence in the same call, on the calling thread alone or on all of
    them."""
    if not kernel.has_bfloat16():
        pytest.skip("the CPU prefill kernel takes bfloat16 only with AVX512-BF16")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # where the serial threshold applies
    monkeypatch.setattr(cpu_prefill, "PARALLEL_TILES_WHEN_THREADS_SLEEP", parallel_tiles)
    seq_len, other = 203, (70, 70)
    whole = make_case([(seq_len, seq_len), other], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                      dtype=torch.bfloat16, seed=5)
    scale = 0.125
    k_cache, v_cache = whole.k_cache.clone(), whole.v_cache.clone()
    expected = _kernel_backend().forward(whole.query, whole.key, whole.value, k_cache, v_cache, whole.meta, scale)
    # The same K/V now cached; this step's chunk is the prompt's last `tail` rows, beside the other sequence.
    rows = torch.cat((torch.arange(seq_len - tail, seq_len), torch.arange(seq_len, seq_len + other[1])))
    meta = AttentionMetadata(
        slot_mapping=whole.meta.slot_mapping[rows],
        query_start_loc=torch.tensor([0, tail, tail + other[1]], dtype=torch.int32),
        seq_lens=whole.meta.seq_lens, block_tables=whole.meta.block_tables,
        query_lens_host=[tail, other[1]], seq_lens_host=[seq_len, other[0]], block_size=whole.meta.block_size)
    out = _kernel_backend().forward(whole.query[rows], whole.key[rows], whole.value[rows], k_cache.clone(),
                                    v_cache.clone(), meta, scale)
    assert torch.equal(out, expected[rows])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "f16cache"])
def test_float32_short_chunks_stay_on_the_decode_kernel(kernel, cache_dtype):
    """Chunks of up to SHORT_CHUNK_ROWS rows (a speculating sequence's
    verification) go row by row to the decode kernel, as decode rows would,
    whichever path takes the long ones: their rows are bit for bit the same
    with this kernel on or off, and the long chunks' rows agree closely."""
    from engine.attention import cpu_decode
    from engine.attention.torch_backend import SHORT_CHUNK_ROWS

    built_or_skip(cpu_decode.load_kernel, "CPU decode kernel")
    seqs = [(300, SHORT_CHUNK_ROWS), (120, 120), (95, 5), (530, 211), (40, 1)]
    case = make_case(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, cache_dtype=cache_dtype, seed=11)
    check_backend(TorchAttentionBackend(), case)
    outs = []
    for prefill_kernel in (True, False):
        backend = TorchAttentionBackend(prefill_kernel=prefill_kernel, decode_kernel=True)
        outs.append(backend.forward(case.query, case.key, case.value, case.k_cache.clone(), case.v_cache.clone(),
                                    case.meta, 0.125))
    starts = [0, *torch.tensor(case.meta.query_lens_host).cumsum(0).tolist()]
    short = torch.zeros(case.query.shape[0], dtype=torch.bool)
    for i, q_len in enumerate(case.meta.query_lens_host):
        if q_len <= SHORT_CHUNK_ROWS:
            short[starts[i] : starts[i] + q_len] = True
    assert torch.equal(outs[0][short], outs[1][short])
    assert not torch.equal(outs[0][~short], outs[1][~short])  # the long chunks did take the other path
    torch.testing.assert_close(outs[0][~short], outs[1][~short], atol=1e-5, rtol=1e-5)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_prefill.ENV_SWITCH, "0")
    assert cpu_prefill.load_kernel() is None
    backend = TorchAttentionBackend()
    assert backend.load_prefill_kernel() is False
    check_backend(backend, make_case(SCENARIOS["prefill_over_prefix"], head_dim=64, seed=3))
    with pytest.raises(RuntimeError, match="could not be built or this CPU lacks it"):
        TorchAttentionBackend(prefill_kernel=True).load_prefill_kernel()


def test_the_registry_builds_the_kernel_before_the_first_step(monkeypatch):
    from engine.attention import get_attention_backend

    calls = []
    monkeypatch.setattr(cpu_prefill, "load_kernel", lambda: calls.append(1))
    get_attention_backend("torch", torch.device("cpu"))
    assert calls == [1]
