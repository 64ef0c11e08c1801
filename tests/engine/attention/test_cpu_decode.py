"""The C++ CPU decode kernel and its torch twin (the bucketed SDPA path),
each against the naive float64 reference, on skewed batches and real shapes.
Contexts past the kernel's span (512 positions) are split and merged; odd
tile lengths exercise the bfloat16 pair path's zero row."""

import pytest
import torch

from engine.attention import cpu_decode
from engine.attention.torch_backend import TorchAttentionBackend
from tests.engine.attention.test_backends import SCENARIOS, check_backend, make_case
from tests.native import built_or_skip, torch_threads

DECODE_HEAVY = ["decode_varied_lengths", "mixed", "skew_1_long_7_short", "skew_7_long_1_short", "long_context"]
# Decode rows over contexts past several 16-position chunks and blocks, and
# past one and two of the kernel's 512-position spans.
LONG_DECODES = [(700, 1), (33, 1), (257, 1), (16, 1), (1, 1), (1100, 1), (480, 64)]


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(cpu_decode.load_kernel, "CPU decode kernel")


def _backend(path: str) -> TorchAttentionBackend:
    return TorchAttentionBackend(decode_kernel=path == "kernel")


@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scenario", DECODE_HEAVY)
@pytest.mark.parametrize("path", ["kernel", "twin"])
def test_decode_paths_match_the_reference(kernel, path, scenario, dtype, block_size):
    case = make_case(SCENARIOS[scenario], block_size=block_size, dtype=dtype, head_dim=32, seed=block_size)
    check_backend(_backend(path), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(3, 3), (9, 3), (8, 2), (16, 1)], ids=["mha", "smollm", "gqa4", "mqa16"])
@pytest.mark.parametrize("path", ["kernel", "twin"])
def test_head_shapes(kernel, path, num_heads, num_kv_heads, head_dim, dtype):
    """head_dim 16 and 48 take the kernel's odd-chunk paths (no bfloat16 pairs)."""
    case = make_case(LONG_DECODES, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=16, dtype=dtype, seed=head_dim)
    check_backend(_backend(path), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_and_twin_agree_on_smollm_shapes(kernel, dtype):
    case = make_case(LONG_DECODES, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, seed=4)
    outs = []
    for path in ("kernel", "twin"):
        backend = _backend(path)
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        outs.append(backend.forward(case.query, case.key, case.value, k_cache, v_cache, case.meta, 0.125))
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("parallel_positions", [0, 10**9], ids=["parallel", "serial"])
def test_calls_on_one_thread_or_split_match_the_reference(kernel, monkeypatch, parallel_positions):
    """Where idle threads sleep, small calls stay on the calling thread."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(cpu_decode, "PARALLEL_POSITIONS_WHEN_THREADS_SLEEP", parallel_positions)
    case = make_case(LONG_DECODES, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, seed=6)
    check_backend(_backend("kernel"), case)


def test_non_contiguous_query_rows(kernel):
    """The model hands over query as a view of its fused q/k projection."""
    case = make_case(SCENARIOS["mixed"], num_heads=6, num_kv_heads=2, head_dim=32, seed=5)
    fused = torch.cat([case.query, torch.zeros(case.query.shape[0], 2, 32)], dim=1)
    case.query = fused[:, :6]
    assert not case.query.is_contiguous()
    check_backend(_backend("kernel"), case)


def test_unsupported_tensors_fall_back_to_the_twin(kernel):
    fp16 = make_case(SCENARIOS["mixed"], dtype=torch.float16, head_dim=32, seed=1)
    odd_head_dim = make_case(SCENARIOS["mixed"], head_dim=24, seed=2)
    for case in (fp16, odd_head_dim):
        assert not cpu_decode.supports(case.query, case.k_cache)
        check_backend(TorchAttentionBackend(), case)
        with pytest.raises(ValueError, match="does not support"):
            TorchAttentionBackend(decode_kernel=True).forward(
                case.query, case.key, case.value, case.k_cache.clone(), case.v_cache.clone(), case.meta, 0.2)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
    assert cpu_decode.load_kernel() is None
    check_backend(TorchAttentionBackend(), make_case(SCENARIOS["mixed"], head_dim=32, seed=3))


def test_a_failed_build_falls_back_to_the_twin(no_compiler, monkeypatch, caplog):
    """No compiler or no ninja (a bare CI image): the build raises inside
    cpp_extension.load; the backend logs it once and serves decodes with the twin."""
    assert cpu_decode._KERNEL.build() is None
    assert "unavailable" in caplog.text

    monkeypatch.setattr(cpu_decode, "load_kernel", lambda: None)
    backend = TorchAttentionBackend()
    assert backend.load_decode_kernel() is False
    check_backend(backend, make_case(SCENARIOS["mixed"], num_heads=9, num_kv_heads=3, head_dim=64, seed=6))
    with pytest.raises(RuntimeError, match="could not be built"):
        TorchAttentionBackend(decode_kernel=True).load_decode_kernel()


def test_the_registry_builds_the_kernel_before_the_first_step(monkeypatch):
    from engine.attention import get_attention_backend

    calls = []
    monkeypatch.setattr(cpu_decode, "load_kernel", lambda: calls.append(1))
    get_attention_backend("torch", torch.device("cpu"))
    assert calls == [1]


@pytest.mark.parametrize("length", [40, 130, 300, 700, 1100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_lone_sequence_is_split_across_threads_and_matches_the_reference(kernel, monkeypatch, length, dtype):
    """Fewer sequences than threads: each is cut into shorter spans (at
    least 64 positions) so that every thread gets one, and merged."""
    monkeypatch.setattr(cpu_decode, "PARALLEL_POSITIONS_WHEN_THREADS_SLEEP", 0)
    with torch_threads(2):
        case = make_case([(length, 1)], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype,
                         seed=length)
        check_backend(_backend("kernel"), case)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("path", ["kernel", "twin"])
def test_a_float16_cache_under_float32_queries(kernel, path, scenario):
    """A float32 model's 16-bit cache: every query attends over the K/V as
    the cache holds them, rounded to float16 (the reference reads the same
    cache in float64), whether they were written this step or before."""
    case = make_case(SCENARIOS[scenario], cache_dtype=torch.float16, head_dim=32, seed=9)
    assert cpu_decode.supports(case.query, case.k_cache)
    check_backend(_backend(path), case)


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_float16_cache_over_long_contexts_and_head_shapes(kernel, monkeypatch, head_dim, threads):
    """Past the kernel's span, split across threads and merged, and on the
    odd-chunk head sizes."""
    monkeypatch.setattr(cpu_decode, "PARALLEL_POSITIONS_WHEN_THREADS_SLEEP", 0)
    with torch_threads(threads):
        case = make_case(LONG_DECODES, num_heads=9, num_kv_heads=3, head_dim=head_dim, block_size=16,
                         cache_dtype=torch.float16, seed=head_dim)
        check_backend(_backend("kernel"), case)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_no_item_is_skipped_when_claimed_ahead(kernel, monkeypatch, threads, dtype):
    """A thread claims its next item before running the one it holds (to
    prefetch it) while more than two items a thread remain, and takes them
    one at a time after: with 24 items of every length (five sequences split
    into spans), every row still comes out as the reference's. (An item run
    twice would write the same values, so that does not show here.)"""
    monkeypatch.setattr(cpu_decode, "PARALLEL_POSITIONS_WHEN_THREADS_SLEEP", 0)
    lengths = [(n, 1) for n in (5, 700, 33, 1100, 16, 257, 90, 513, 1, 300, 47, 640, 128, 64, 999, 12, 400, 31)]
    with torch_threads(threads):
        case = make_case(lengths, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype, seed=11)
        check_backend(_backend("kernel"), case)


def _fused_kv(rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """key and value as the model hands them over: views of one row of q, k
    and v side by side, so rows sit a fused row apart."""
    gen = torch.Generator().manual_seed(seed)
    width = kv_heads * head_dim
    fused = torch.randn(rows, 3 * width + 16, generator=gen).to(dtype)
    key = fused[:, 16: 16 + width].view(rows, kv_heads, head_dim)
    value = fused[:, 16 + width: 16 + 2 * width].view(rows, kv_heads, head_dim)
    return key, value


@pytest.mark.parametrize("query_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                     (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "fp32-over-fp16", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_write_kv_writes_what_index_copy_writes(kernel, query_dtype, cache_dtype, rows):
    """The kernel's K/V write against the twin's cast and index_copy_, bit
    for bit, at the slots of a shuffled pool; slots it is not given keep
    their bytes."""
    kv_heads, head_dim, num_blocks, block_size = 3, 64, 40, 16
    key, value = _fused_kv(rows, kv_heads, head_dim, query_dtype, seed=rows)
    if cache_dtype == torch.float16:
        # Past float16's range, below its normals, between two of its
        # values, and a negative zero: the cast's rounding, not only copying.
        key[0, 0, :5] = torch.tensor([70000.0, -65520.0, 3e-6, 1.0 + 2**-11, -0.0])
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(7))[:rows]
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim).to(cache_dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    for cache, new in zip(expected, (key, value), strict=True):
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, new.to(cache_dtype))
    assert cpu_decode.write_kv(kernel, key, value, caches[0], caches[1], slots)
    bits = torch.int32 if cache_dtype == torch.float32 else torch.int16  # -0.0 and 0.0 told apart
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.view(bits), want.view(bits))


def test_write_kv_declines_what_it_does_not_take(kernel):
    """A slot out of range, a dtype pair the decode kernel does not read,
    or heads that are not side by side: False, and the caches untouched."""
    key, value = _fused_kv(4, 3, 64, torch.float32, seed=1)
    caches = [torch.zeros(2, 16, 3, 64) for _ in range(2)]
    slots = torch.tensor([0, 5, 31, 32])  # 32 slots in all: the last is out of range
    assert not cpu_decode.write_kv(kernel, key, value, *caches, slots)
    assert not cpu_decode.write_kv(kernel, key, value, *caches, torch.tensor([0, 5, -1, 3]))
    assert not cpu_decode.write_kv(kernel, key.to(torch.bfloat16), value.to(torch.bfloat16), *caches,
                                   torch.tensor([0, 1, 2, 3]))
    assert not cpu_decode.write_kv(kernel, key.transpose(0, 1), value.transpose(0, 1),
                                   *[torch.zeros(2, 16, 4, 64) for _ in range(2)], torch.tensor([0, 1, 2]))
    assert not cpu_decode.write_kv(kernel, key, value, *caches, torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    assert all(not c.any() for c in caches)


def test_a_slot_out_of_range_still_raises(kernel, monkeypatch):
    """The backend writes through the kernel, and where the kernel declines
    (a slot out of range) falls back to the twin, whose index_copy_ raises:
    a bad slot is an error, not a silent skip."""
    written: list[bool] = []
    real = cpu_decode.write_kv
    monkeypatch.setattr(cpu_decode, "write_kv", lambda *args: written.append(real(*args)) or written[-1])
    case = make_case(SCENARIOS["mixed"], block_size=16, dtype=torch.float32, head_dim=32, seed=3)
    check_backend(_backend("kernel"), case)
    assert written and all(written)
    written.clear()
    case.meta.slot_mapping[0] = case.k_cache.shape[0] * case.k_cache.shape[1]
    with pytest.raises(IndexError):
        _backend("kernel").forward(case.query, case.key, case.value, case.k_cache.clone(), case.v_cache.clone(),
                                   case.meta, 0.125)
    assert written == [False]
