"""Our Llama-family decoder (Llama, Mistral without sliding window) over a
flat batch and a paged KV cache.

Numerics follow HF transformers' op order wherever it changes bits: RMSNorm
in float32 cast back before the weight, RoPE via rotate_half, softmax scale
head_dim ** -0.5. q/k/v and gate/up run as one fused matmul each; every
projection goes through `PackedLinear.forward` (engine/model/layers.py), the
one place a LoRA backend adds its per-slice deltas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import ModelLoadError
from engine.model import cpu_elementwise, cpu_linear, quant_limits, quant_linear, triton_elementwise
from engine.model.layers import PackedLinear, RMSNorm, empty_param, load_param
from engine.model.rope import RotaryEmbedding, apply_rotary, head_dim_of

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@contextmanager
def _single_threaded() -> Iterator[None]:
    """Weight copies are memory-bound; on a busy 2-core host a 2-thread copy
    stalls on its descheduled helper (1.7 s measured against 0.15 s for one
    thread), so loading runs on one intra-op thread."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class LlamaAttention(nn.Module):
    def __init__(self, config, attn_backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
                 quantized: bool = False):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        self.attn_backend = attn_backend
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_size = q_size + kv_size
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = PackedLinear(
            config.hidden_size, (("q", q_size), ("k", kv_size), ("v", kv_size)), bias, dtype, device, quantized
        )
        self.o_proj = PackedLinear(q_size, (("o", config.hidden_size),), bias, dtype, device, quantized)
        self.elementwise = cpu_elementwise.load_kernel() if torch.device(device).type == "cpu" else None
        self.gpu_elementwise = triton_elementwise.serves(device)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # q and k heads sit side by side in qkv: rotate them in one pass
        # (elementwise, so bit-identical to rotating each on its own).
        qk = qkv[:, : self.qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        rotated = None
        if self.elementwise is not None:
            rotated = cpu_elementwise.rotary(self.elementwise, qk, cos, sin)
        elif self.gpu_elementwise:
            rotated = triton_elementwise.rotary(qk, cos, sin)
        if rotated is None:
            rotated = apply_rotary(qk, cos, sin)
        q, k = rotated.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn_backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype, device: torch.device, quantized: bool = False):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only silu)")
        size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = PackedLinear(
            config.hidden_size, (("gate", size), ("up", size)), bias, dtype, device, quantized
        )
        self.down_proj = PackedLinear(size, (("down", config.hidden_size),), bias, dtype, device, quantized)
        self.intermediate_size = size
        self.elementwise = cpu_elementwise.load_kernel() if torch.device(device).type == "cpu" else None
        self.gpu_elementwise = triton_elementwise.serves(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = None
        if self.elementwise is not None:
            act = cpu_elementwise.silu_mul(self.elementwise, gate_up)
        elif self.gpu_elementwise:
            act = triton_elementwise.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, attn_backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
                 quantized: bool = False):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(config, attn_backend, dtype, device, quantized)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device, quantized)

    def forward(self, hidden, mlp_out, cos, sin, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, the MLP's output) -> the same for the next layer: the
        residual add after the MLP is left to the next norm (`add_forward`,
        one call for both); `mlp_out` None for the first layer."""
        if mlp_out is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add_forward(hidden, mlp_out)
        attn = self.self_attn(normed, cos, sin, kv_cache, meta)
        hidden, normed = self.post_attention_layernorm.add_forward(hidden, attn)
        return hidden, self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """Flat-batch Llama: `forward` takes the T new tokens of one step and
    returns their final (normed) hidden states; `compute_logits` projects
    only the rows that sample.

    `quantization` "int8" or "int4" stores the linears' weights quantized,
    and the LM head's in int8 (engine/model/quant_linear.py); they load in
    float32 and are quantized at the end of `load_weights`. The embedding table
    stays in `dtype`: a step gathers only its tokens' rows from it. "auto"
    keeps every weight in `dtype` and, where the linears' weights are all
    exactly Q4_1 values (a Q4_1 GGUF), their Q4_1 blocks beside them for
    small calls, and the LM head's Q8_0 blocks where it is exactly Q8_0
    values: the model's values do not change."""

    def __init__(self, config, attn_backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
                 quantization: str = "none", activation_quantization: str = "none"):
        super().__init__()
        self.activation_quantization = activation_quantization
        if quantization == "auto" and (torch.device(device).type != "cpu" or quant_linear.load_kernel() is None):
            quantization = "none"  # no Q4_1 kernel to read them with (a GPU, LORAGW_CPU_LINEAR_KERNEL=0)
        self.quantization = quantization
        quantized = quantization != "none"
        # Loaded in float32 when quantized, like the linears; the LM head,
        # tied or not, is quantized from it ("auto" checks it for Q8_0
        # values, then casts it to `dtype`).
        head_dtype = torch.float32 if quantized else dtype
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.attn_backend = attn_backend
        self.num_layers = config.num_hidden_layers
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = empty_param((config.vocab_size, config.hidden_size),
                                   head_dtype if self.tie_word_embeddings else dtype, self.device)
        self.rotary = RotaryEmbedding(config, self.device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend, dtype, self.device, quantized) for _ in range(self.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, self.device)
        if self.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = empty_param((config.vocab_size, config.hidden_size), head_dtype, self.device)
        self.lm_head_q: quant_linear.QuantizedWeight | None = None  # set by `quantize`
        self.as_stored = False  # set by `keep_as_stored`: "auto" found Q4_1 linears
        self.lm_head_stored: quant_linear.QuantizedWeight | None = None  # "auto" found a Q8_0 head
        self.lm_head_stored_rows = 0  # the rows it takes; set by `pack_weights`, measured on the head
        self.lm_head_packed: torch.Tensor | None = None  # set by `pack_weights`
        self._cpu_linear = cpu_linear.load_kernel() if self.device.type == "cpu" else None
        self._quant_kernel = quant_linear.load_kernel() if quantized and self.device.type == "cpu" else None
        # Measured now, not in the first step.
        if self._cpu_linear is not None:
            cpu_linear.row_limit(dtype, torch.get_num_threads())
        if self._quant_kernel is not None and quantization != "auto":  # "auto": once it finds Q4_1
            quant_limits.row_limit(dtype, torch.get_num_threads())

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        before_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """Runs one step. Calls `attn_backend.prepare(meta)` once, so the
        caller must not; each layer writes this step's K/V into its cache.
        `before_layer(i)` runs before layer i; it may raise to stop the step."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        with torch.inference_mode():
            self.attn_backend.prepare(meta)
            hidden = F.embedding(input_ids, self.embed_tokens)
            cos, sin = self.rotary(positions, hidden.dtype)
            mlp_out = None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                if before_layer is not None:
                    before_layer(i)
                hidden, mlp_out = layer(hidden, mlp_out, cos, sin, kv_cache, meta)
            return self.norm(hidden) if mlp_out is None else self.norm.add_forward(hidden, mlp_out)[1]

    def packed_linears(self) -> dict[tuple[int, str], PackedLinear]:
        """(layer, "qkv_proj" | "o_proj" | "gate_up_proj" | "down_proj") -> projection."""
        found = {}
        for i, layer in enumerate(self.layers):
            found[(i, "qkv_proj")] = layer.self_attn.qkv_proj
            found[(i, "o_proj")] = layer.self_attn.o_proj
            found[(i, "gate_up_proj")] = layer.mlp.gate_up_proj
            found[(i, "down_proj")] = layer.mlp.down_proj
        return found

    def keep_as_stored(self) -> None:
        """Quantization "auto": the linears' Q4_1 form beside their float
        weights if it holds every weight exactly (stops looking at the first
        that it does not, so a checkpoint of other values pays one trial),
        and the LM head's Q8_0 form beside it if that holds it exactly."""
        linears = list(self.packed_linears().values())
        stored = []
        with torch.no_grad():
            for linear in linears:
                qweight = quant_linear.quantize_exactly(linear.weight.data, quant_linear.AS_STORED)
                if qweight is None:
                    stored = []
                    break
                stored.append(qweight)
            for linear, qweight in zip(linears, stored or [None] * len(linears)):
                linear.keep(qweight)
        self.as_stored = bool(stored)
        with torch.no_grad():
            self.lm_head_stored = quant_linear.quantize_exactly(self.lm_head.data, quant_linear.HEAD_AS_STORED)
            self.lm_head.data = self.lm_head.data.to(self.dtype)
            self.embed_tokens.data = self.embed_tokens.data.to(self.dtype)  # the same tensor when tied

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        with torch.inference_mode():
            if self.lm_head_q is not None:
                limit = quant_limits.weight_row_limit(self._quant_kernel, self.lm_head_q, hidden.dtype,
                                                      beside_float=False)
                return quant_linear.linear(self._quant_kernel, hidden, self.lm_head_q, limit=limit).float()
            if self.lm_head_stored is not None:
                return quant_linear.linear(self._quant_kernel, hidden, self.lm_head_stored, None, self.lm_head,
                                           self._cpu_linear, self.lm_head_packed,
                                           limit=self.lm_head_stored_rows).float()
            return cpu_linear.linear(self._cpu_linear, hidden, self.lm_head, None, self.lm_head_packed).float()

    # ---- weights -------------------------------------------------------

    def _weight_loaders(self) -> dict[str, Callable[[torch.Tensor], None]]:
        """HF tensor name -> the function that loads that tensor into us."""
        loaders: dict[str, Callable[[torch.Tensor], None]] = {}

        def plain(name: str, param: nn.Parameter) -> None:
            loaders[name] = partial(load_param, param, name)

        def packed(prefix: str, linear: PackedLinear) -> None:
            for slice_name in linear.slice_names:
                for param in linear.param_names:
                    loaders[f"{prefix}{slice_name}_proj.{param}"] = partial(
                        linear.load_slice, slice_name, param
                    )

        plain("model.embed_tokens.weight", self.embed_tokens)
        plain("model.norm.weight", self.norm.weight)
        if not self.tie_word_embeddings:
            plain("lm_head.weight", self.lm_head)
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            plain(prefix + "input_layernorm.weight", layer.input_layernorm.weight)
            plain(prefix + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            packed(prefix + "self_attn.", layer.self_attn.qkv_proj)
            packed(prefix + "self_attn.", layer.self_attn.o_proj)
            packed(prefix + "mlp.", layer.mlp.gate_up_proj)
            packed(prefix + "mlp.", layer.mlp.down_proj)
        return loaders

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors, casting to our dtype. A tensor that needs
        no cast, move or fusion is adopted, not copied, so the caller must not
        modify it afterwards. Raises ModelLoadError on an unknown name, a shape
        mismatch, or a tensor the model needs that `weights` did not provide."""
        loaders = self._weight_loaders()
        pending = set(loaders)
        with torch.no_grad(), _single_threaded():
            for name, tensor in weights:
                tied_head = name == "lm_head.weight" and self.tie_word_embeddings
                if tied_head or name.endswith(_IGNORED_SUFFIXES):
                    continue
                load = loaders.get(name)
                if load is None:
                    raise ModelLoadError(f"unexpected tensor {name!r} in the checkpoint (not a Llama weight)")
                load(tensor)
                pending.discard(name)
        if pending:
            missing = sorted(pending)
            shown = ", ".join(missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
            raise ModelLoadError(f"checkpoint is missing tensors: {shown}")
        if self.quantization != "none":
            self.quantize()
        if self.activation_quantization == "int8":
            self.use_int8_activations()
        if self.as_stored:  # the limit the Q4_1 calls use, measured now and only it, not in the first step
            first = next(iter(self.packed_linears().values()))
            quant_limits.weight_row_limit(self._quant_kernel, first.qweight, self.dtype, beside_float=True)
        self.pack_weights()

    def use_int8_activations(self) -> None:
        """Activation quantization int8: the Q4_1 and Q8_0 kernel calls
        round their float32 activations to int8 (quant_linear.py). Refused
        where no such call would run, rather than ignored."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ModelLoadError(
                "activation quantization int8 needs float32 activations on the CPU (--dtype float32); this "
                f"model runs in {str(self.dtype).removeprefix('torch.')} on {self.device.type}")
        weights = [linear.qweight for linear in self.packed_linears().values()]
        if not all(isinstance(w, quant_linear.Q41Weight) for w in weights):
            raise ModelLoadError(
                "activation quantization int8 needs Q4_1 linears: --quantization int4, or auto on a checkpoint "
                "whose linears are exactly Q4_1 values (a Q4_1 GGUF such as the bundled model), with the C++ "
                "kernels on (not LORAGW_CPU_LINEAR_KERNEL=0)")
        if not quant_linear.int8_activations_available(self._quant_kernel, self.dtype):
            raise ModelLoadError("activation quantization int8 needs the C++ quantized kernel's AVX2 path: a CPU "
                                 "with AVX2 and F16C, and not LORAGW_CPU_LINEAR_KERNEL=0")
        quant_linear.use_int8_activations([*weights, self.lm_head_q, self.lm_head_stored])

    def pack_weights(self) -> None:
        """oneDNN's packed copies of the float weights, where they pay
        (`cpu_linear.pack`): the last step of loading, once the weights are
        final."""
        with torch.no_grad():
            for linear in self.packed_linears().values():
                linear.pack()
            if self.lm_head is not None:
                self.lm_head_packed = cpu_linear.pack(self.lm_head.data)
            if self.lm_head_stored is not None:
                self.lm_head_stored_rows = quant_limits.head_row_limit(
                    self._quant_kernel, self.lm_head_stored, self.lm_head.data, self._cpu_linear, self.lm_head_packed)

    def quantize(self) -> None:
        """Quantizes every packed linear and the LM head from their float32
        weights (dropped after); a tied embedding table is cast to the
        model's dtype. "auto": `keep_as_stored`."""
        if self.quantization == "auto":
            self.keep_as_stored()
            return
        with torch.no_grad():
            for linear in self.packed_linears().values():
                linear.quantize(self.quantization)
            head = quant_linear.HEAD_QUANTIZATION[self.quantization]
            self.lm_head_q = quant_linear.quantize(self.lm_head.data, head)
            self.lm_head = None
            self.embed_tokens.data = self.embed_tokens.data.to(self.dtype)
