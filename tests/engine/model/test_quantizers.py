"""The quantizers of engine/model/quant_linear.py: exact on zero rows and
flat blocks and the bundled checkpoint's Q4_1 linears reproduced (read
back through quant_reference.py's naive element-by-element decoding),
and `quantize_exactly` taking only weights that are its format's values."""

from __future__ import annotations

import pytest
import torch

from engine.model import quant_linear
from tests.engine.model.quant_reference import naive_weight


def test_quantizers_keep_zero_rows_and_flat_blocks_exact():
    w = torch.randn(4, 64)
    w[1] = 0.0
    w[2, :32] = 0.25  # one block of equal values: d = 0
    for qw in (quant_linear.quantize_int8(w), quant_linear.quantize_q4_1(w)):
        back = naive_weight(qw)
        assert torch.equal(back[1], torch.zeros(64, dtype=torch.float64))
    assert torch.equal(naive_weight(quant_linear.quantize_q4_1(w))[2, :32], torch.full((32,), 0.25, dtype=torch.float64))


def test_int4_needs_blocks_of_32():
    with pytest.raises(ValueError, match="divisible by 32"):
        quant_linear.quantize_q4_1(torch.randn(8, 48))


@pytest.mark.smollm
def test_int4_reproduces_the_bundled_q4_1_linears(smollm_dir):
    """The bundled SmolLM2 ships its linears as GGUF Q4_1: requantized, they
    come back as they were (d and m are float16 in both); int8 per channel
    stays within half a step of its scale."""
    from safetensors import safe_open

    with safe_open(str(smollm_dir / "model.safetensors"), "pt") as f:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                     "model.layers.29.mlp.down_proj.weight", "model.layers.13.mlp.up_proj.weight"):
            w = f.get_tensor(name).double()
            assert torch.allclose(naive_weight(quant_linear.quantize_q4_1(w.float())), w, atol=1e-6, rtol=0)
            int8 = quant_linear.quantize_int8(w.float())
            err = (naive_weight(int8) - w).abs().amax(dim=1)
            assert bool((err <= int8.scale.double() * 0.5 + 1e-7).all())


def test_quantize_exactly_takes_only_weights_that_are_q4_1_values():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 64, generator=gen)
    stored = quant_linear.quantize_q4_1(w).dequantize(torch.float32)  # a checkpoint dequantized from Q4_1
    exact = quant_linear.quantize_exactly(stored, "int4")
    assert exact is not None and torch.equal(exact.dequantize(torch.float32), stored)
    assert quant_linear.quantize_exactly(w, "int4") is None  # random floats are not
    nudged = stored.clone()
    nudged[5, 7] += 1e-3
    assert quant_linear.quantize_exactly(nudged, "int4") is None  # one value off is enough
    assert quant_linear.quantize_exactly(torch.zeros(4, 48), "int4") is None  # K not a multiple of 32
    q8 = quant_linear.quantize_q8_0(w).dequantize(torch.float32)  # a Q8_0 GGUF's embedding table
    assert quant_linear.quantize_exactly(q8, "q8_0") is not None
    assert quant_linear.quantize_exactly(stored, "q8_0") is None and quant_linear.quantize_exactly(w, "q8_0") is None
