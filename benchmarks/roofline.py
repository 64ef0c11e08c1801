"""The linear-layer roofline: how many tokens per second this machine can
push through a model's matmuls alone.

Every matmul one token meets (each layer's packed projections and the LM
head) runs on the model's real weights, in their dtype, at a fixed number
of tokens per step, by the path the engine takes for a call that size:
oneDNN's packed copy of a weight where the model keeps one
(engine/model/cpu_linear.py, `pack`), else F.linear. Nothing else
(attention, norms, sampling, Python) is counted, so an engine's throughput
over this figure says how much of the step time goes to the work that
cannot be avoided.

On a shared host the figure moves with the load, so a benchmark samples it
*during* its own run (`LinearRoofline.sample` between engine steps) and
compares against those samples, taken under the same load.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.model import cpu_linear

# (wall seconds, CPU seconds) of one pass over every weight.
Sample = tuple[float, float]


def linear_weights(model) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each layer's qkv, o, gate_up and down weights, then the LM head, each
    with its packed copy (None where the model keeps none)."""
    pairs = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        pairs += [(p.weight, p.packed) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    return [*pairs, (model.lm_head, model.lm_head_packed)]


class LinearRoofline:
    def __init__(self, model, tokens: int = 128):
        self.tokens = tokens
        self.weights = linear_weights(model)
        self.dtype = self.weights[0][0].dtype
        self.packed = any(packed is not None for _, packed in self.weights)
        self.inputs = {w.shape[1]: torch.randn(tokens, w.shape[1], dtype=w.dtype) for w, _ in self.weights}
        self.flops_per_token = 2 * sum(w.numel() for w, _ in self.weights)
        self._one_pass()  # warm-up: first-touch of the outputs, kernel selection

    @torch.inference_mode()
    def _one_pass(self) -> None:
        for w, packed in self.weights:
            cpu_linear.linear(None, self.inputs[w.shape[1]], w, None, packed)

    def sample(self, passes: int = 1) -> list[Sample]:
        out = []
        for _ in range(passes):
            t0, c0 = time.perf_counter(), time.process_time()
            self._one_pass()
            out.append((time.perf_counter() - t0, time.process_time() - c0))
        return out

    def summarize(self, samples: list[Sample]) -> dict:
        """Median over the samples, per wall second and per CPU second."""
        wall = statistics.median(s[0] for s in samples)
        cpu = statistics.median(s[1] for s in samples)
        return {
            "tokens_per_step": self.tokens,
            "tok_s": round(self.tokens / wall, 1),
            "gflop_s": round(self.flops_per_token * self.tokens / wall / 1e9, 1),
            "tok_per_cpu_s": round(self.tokens / cpu, 1),
            "tok_s_best": round(self.tokens / min(s[0] for s in samples), 1),
            "mflop_per_token": round(self.flops_per_token / 1e6, 1),
            "num_samples": len(samples),
            "packed_weights": self.packed,
        }
