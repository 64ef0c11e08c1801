"""oneDNN's packed bfloat16 and float32 weights (`cpu_linear.pack`): the
product against a float64 reference and F.linear, when packing is decided,
and the model multiplying by its packed copies as by its plain weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine.attention.torch_backend import TorchAttentionBackend
from engine.model import cpu_linear, quant_linear
from engine.model.llama import LlamaForCausalLM
from tests.engine.model.test_cpu_linear import _case  # (x, w, b, the float64 product), as the skinny kernel's tests
from tests.engine.model.test_llama import PagedRunner, random_tokens, tiny_config

HIDDEN, INTERMEDIATE, QKV = 576, 1536, 960  # SmolLM2-135M
BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
# Both dtypes, bfloat16 only where oneDNN packs it on this CPU (not on an
# AVX2-only one: test_a_cpu_that_cannot_pack_a_dtype_keeps_f_linear covers that).
PACKABLE = [
    pytest.param(BF16, id="bf16", marks=pytest.mark.skipif(
        torch.backends.mkldnn.is_available() and not cpu_linear.can_pack(BF16),
        reason="oneDNN does not pack bfloat16 on this CPU (it wants AVX-512 or AVX-NE-CONVERT)")),
    pytest.param(torch.float32, id="fp32"),
]


@pytest.fixture
def packing(monkeypatch):
    """Sets LORAGW_CPU_PACKED_WEIGHTS ("0", "1", or None: unset) for one test."""

    def set_to(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(cpu_linear.PACK_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_linear.PACK_ENV, value)
        cpu_linear.packing_pays.cache_clear()

    yield set_to
    cpu_linear.packing_pays.cache_clear()


# (atol, rtol) against the float64 product and against F.linear. bfloat16:
# float32 sums rounded once to bfloat16, so within a bfloat16 rounding of
# either. float32: sums of 576 or 1,536 products in another order than
# MKL's, so within float32 rounding of either (the skinny kernel's bounds).
TOLERANCES = {BF16: ((3e-2, 1e-2), (2e-2, 1e-2)), torch.float32: ((2e-5, 1e-5), (2e-5, 1e-5))}


@pytest.mark.parametrize("rows", [1, 5, 16, 130])
@pytest.mark.parametrize("shape", [(QKV, HIDDEN), (HIDDEN, INTERMEDIATE), (2 * INTERMEDIATE, HIDDEN)],
                         ids=["qkv", "down", "gate_up"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", PACKABLE)
def test_the_packed_product_matches_the_reference(packing, rows, shape, bias, dtype):
    packing("1")
    x, w, b, expected = _case(rows, *shape, dtype, seed=rows, bias=bias)
    packed = cpu_linear.pack(w)
    assert packed is not None and packed.is_mkldnn
    got = cpu_linear.linear(None, x, w, b, packed)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    (ref_atol, ref_rtol), (torch_atol, torch_rtol) = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), expected, atol=ref_atol, rtol=ref_rtol)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=torch_atol, rtol=torch_rtol)
    # It is the packed copy that is multiplied, not the weight beside it.
    torch.testing.assert_close(cpu_linear.linear(None, x, torch.zeros_like(w), b, packed), got, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", PACKABLE)
def test_a_strided_input_multiplies_as_a_contiguous_one(packing, dtype):
    packing("1")
    x, w, _, expected = _case(6, QKV, HIDDEN, dtype, seed=9)
    wide = torch.zeros(6, 2 * HIDDEN, dtype=dtype)
    wide[:, :HIDDEN] = x
    packed = cpu_linear.pack(w)
    assert torch.equal(cpu_linear.linear(None, wide[:, :HIDDEN], w, None, packed),
                       cpu_linear.linear(None, x, w, None, packed))


def test_only_weight_matrices_of_the_packed_dtypes_are_packed(packing):
    packing("1")
    w = torch.randn(64, 32)
    assert cpu_linear.pack(w) is not None
    assert not cpu_linear.packing_pays(torch.float16, torch.get_num_threads())
    assert cpu_linear.pack(w.half()) is None
    assert cpu_linear.pack(torch.randn(4, 64, 32)) is None  # not a weight matrix


def test_a_cpu_that_cannot_pack_a_dtype_keeps_f_linear(packing, monkeypatch, caplog):
    """oneDNN refuses to reorder bfloat16 weights on an AVX2-only CPU: a
    model in bfloat16 there loads with its weights unpacked (its larger
    calls go to F.linear), even with LORAGW_CPU_PACKED_WEIGHTS=1, and float32
    is still packed."""
    packing("1")
    reorder = cpu_linear.packed_copy

    def refuses_bfloat16(weight):
        if weight.dtype == BF16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")
        return reorder(weight)

    monkeypatch.setattr(cpu_linear, "packed_copy", refuses_bfloat16)
    caplog.set_level("INFO", logger=cpu_linear.__name__)
    w = torch.randn(64, 32)
    assert cpu_linear.pack(w.to(BF16)) is None
    assert "bfloat16 weights are not packed: mkldnn_reorder_linear_weight" in caplog.text
    assert cpu_linear.pack(w) is not None
    model = _model(tiny_config(), seed=1, dtype=BF16)
    assert all(p.packed is None for p in model.packed_linears().values()) and model.lm_head_packed is None


def test_the_environment_decides_when_set(packing, monkeypatch):
    def no_measuring(*_):
        raise AssertionError("measured although the environment decides")

    monkeypatch.setattr(cpu_linear, "best_of", no_measuring)
    w = torch.randn(64, 32)
    packing("0")
    assert cpu_linear.pack(w) is None
    packing("1")
    assert cpu_linear.pack(w) is not None
    packing("yes")
    with pytest.raises(ValueError, match=cpu_linear.PACK_ENV):
        cpu_linear.pack(w)


def test_a_torch_without_the_packed_ops_does_not_pack(packing, monkeypatch, caplog):
    packing("1")

    class NoOps:
        pass

    monkeypatch.setattr(torch.ops, "mkldnn", NoOps())
    assert cpu_linear.pack(torch.randn(64, 32).to(BF16)) is None
    assert "lacks oneDNN's packed linear ops" in caplog.text


@pytest.mark.parametrize("timings,pays", [
    ({16: (1.0, 2.0), 128: (1.0, 2.0)}, True),
    ({16: (1.0, 2.0), 128: (2.5, 2.0)}, False),  # slower at prefill size
    ({16: (2.0, 2.0), 128: (2.0, 2.0)}, False),  # no faster at either
    ({16: (2.05, 2.0), 128: (1.0, 2.0)}, True),  # level at a decode batch, within the slack
    ({16: (1.0, 2.0), 128: (2.02, 2.0)}, True),  # level at prefill size, within the slack
    ({16: (2.08, 2.0), 128: (1.96, 2.0)}, False),  # within the slack at both, slower over the two
    ({16: (2.2, 2.0), 128: (1.0, 2.0)}, False),  # slower at a decode batch
])
@pytest.mark.parametrize("dtype", PACKABLE)
def test_unset_it_packs_where_the_packed_product_gains_and_loses_at_neither_size(packing, monkeypatch,
                                                                                timings, pays, dtype):
    packing(None)
    measured = []

    def best_of(run_packed, run_plain, copies):
        rows = cpu_linear.PACK_CALIBRATION_ROWS[len(measured)]
        measured.append((rows, copies))
        run_packed(0), run_plain(0)  # both paths run on the calibration weights
        return timings[rows]

    monkeypatch.setattr(cpu_linear, "best_of", best_of)
    assert cpu_linear.packing_pays(dtype, torch.get_num_threads()) is pays
    assert measured == [(rows, cpu_linear.copies_for(rows)) for rows in cpu_linear.PACK_CALIBRATION_ROWS]


@pytest.mark.parametrize("dtype", PACKABLE)
def test_the_quantized_path_hands_its_larger_calls_to_the_packed_copy(packing, dtype):
    packing("1")
    x, w, _, expected = _case(40, QKV, HIDDEN, dtype, seed=4)
    qweight = quant_linear.quantize(w.float(), quant_linear.AS_STORED)
    exact = qweight.dequantize(dtype)
    packed = cpu_linear.pack(exact)
    got = quant_linear.linear(None, x, qweight, None, exact, None, packed, limit=0)
    assert torch.equal(got, cpu_linear.linear(None, x, exact, None, packed))
    atol, rtol = TOLERANCES[dtype][0]
    torch.testing.assert_close(got.double(), x.double() @ exact.double().T, atol=atol, rtol=rtol)


def _model(config, seed: int, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config).eval()
    ours = LlamaForCausalLM(config, TorchAttentionBackend(), dtype, torch.device("cpu"))
    ours.load_weights(hf.state_dict().items())
    return ours


# The logits of a model with and without its packed copies: bfloat16's
# activations round at every layer, float32's only to float32.
LOGIT_TOLERANCE = {BF16: 5e-2, torch.float32: 1e-4}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", PACKABLE)
def test_a_model_packs_every_float_weight_and_computes_as_without(packing, kernel_rows, tied, dtype):
    """Each projection and the LM head get their packed copy when the
    weights are loaded, and a prefill chunk and a decode give the logits of
    the model without them (the skinny kernels kept out: every call goes to
    torch, packed or not)."""
    kernel_rows("0")
    config = tiny_config(tie_word_embeddings=tied)
    tokens = random_tokens(24, seed=3)
    logits = {}
    for setting in ("1", "0"):
        packing(setting)
        model = _model(config, seed=1, dtype=dtype)
        linears = list(model.packed_linears().values())
        if setting == "1":
            assert all(p.packed is not None and p.packed.is_mkldnn for p in linears)
            assert model.lm_head_packed is not None
        else:
            assert all(p.packed is None for p in linears) and model.lm_head_packed is None
        runner = PagedRunner(model, config, block_size=4)
        logits[setting] = torch.cat([runner.step([(0, tokens[:20])])[0], runner.step([(0, tokens[20:21])])[0]])
    tol = LOGIT_TOLERANCE[dtype]
    torch.testing.assert_close(logits["1"], logits["0"], atol=tol, rtol=tol)
    assert torch.equal(logits["1"].argmax(-1), logits["0"].argmax(-1))
