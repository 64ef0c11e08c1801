"""The Llama family's building blocks that are not the model's shape:
parameters that load from a checkpoint, RMSNorm, and `PackedLinear`, the
projections that read one input computed as one matmul (where quantized
weights and LoRA deltas come in)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.model import cpu_elementwise, cpu_linear, quant_limits, quant_linear, triton_elementwise


def empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def load_param(param: nn.Parameter, name: str, tensor: torch.Tensor) -> None:
    """Loads `tensor` into `param`. A tensor already in the right dtype, on
    the right device and contiguous is adopted rather than copied: from a
    memory-mapped safetensors file that saves a copy and the page faults of a
    fresh allocation, and lets processes share the page cache."""
    if param.shape != tensor.shape:
        raise ModelLoadError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    if tensor.dtype == param.dtype and tensor.device == param.device and tensor.is_contiguous():
        param.data = tensor
    else:
        param.copy_(tensor)


class RMSNorm(nn.Module):
    """On the CPU by one C++ call (engine/model/cpu_elementwise.py), on a GPU
    by one Triton launch (engine/model/triton_elementwise.py), else by
    `twin`, HF's op order."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = empty_param((hidden_size,), dtype, device)
        self.eps = eps
        self.kernel = cpu_elementwise.load_kernel() if torch.device(device).type == "cpu" else None
        self.gpu_kernel = triton_elementwise.serves(device)

    def _kernel(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.kernel is not None:
            return cpu_elementwise.rms_norm(self.kernel, x, self.weight, self.eps, residual)
        if self.gpu_kernel:
            return triton_elementwise.rms_norm(x, self.weight, self.eps, residual)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._kernel(x)
        return self.twin(x) if out is None else out

    def add_forward(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm): the decoder layer's residual add and the
        norm after it in one call. The sum may be written into `x`."""
        out = self._kernel(x, residual)
        if out is not None:
            return x, out
        total = residual + x
        return total, self.twin(total)

    def twin(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)


class PackedLinear(nn.Module):
    """Several HF projections that read the same input, computed as one matmul.

    `slices` names the output columns in order, e.g. (("q", 576), ("k", 192),
    ("v", 192)); `forward` returns them side by side. LoRA hooks here: a delta
    for slice `s` adds to columns `offsets[s]:offsets[s] + sizes[s]`.
    """

    def __init__(
        self,
        in_features: int,
        slices: tuple[tuple[str, int], ...],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quantized: bool = False,
    ):
        super().__init__()
        self.slice_names = tuple(name for name, _ in slices)
        self.sizes = {name: size for name, size in slices}
        self.offsets: dict[str, int] = {}
        total = 0
        for name, size in slices:
            self.offsets[name] = total
            total += size
        self.in_features = in_features
        # Quantized (`quantize`), the weight loads in float32, whatever the
        # activations' dtype, so it quantizes from the checkpoint's values.
        self.dtype = dtype
        self.weight = empty_param((total, in_features), torch.float32 if quantized else dtype, device)
        self.bias = empty_param((total,), dtype, device) if bias else None
        self.param_names = ("weight", "bias") if bias else ("weight",)
        # Decode steps (a few rows) go to the C++ skinny kernels on the CPU.
        on_cpu = device.type == "cpu"
        self.cpu_linear = cpu_linear.load_kernel() if on_cpu else None
        self.quant_kernel = quant_linear.load_kernel() if on_cpu and quantized else None
        self.qweight: quant_linear.QuantizedWeight | None = None  # set by `quantize`
        self.packed: torch.Tensor | None = None  # set by `pack`
        # Set by the engine builder when LoRA is on: adds the step's
        # per-token adapter deltas into the output, hook(x, out).
        self.lora_hook: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, sum(sizes)]
        if self.qweight is not None:
            limit = quant_limits.weight_row_limit(self.quant_kernel, self.qweight, x.dtype,
                                                  beside_float=self.weight is not None)
            out = quant_linear.linear(self.quant_kernel, x, self.qweight, self.bias, self.weight, self.cpu_linear,
                                      self.packed, limit=limit)
        else:
            out = cpu_linear.linear(self.cpu_linear, x, self.weight, self.bias, self.packed)
        if self.lora_hook is not None:
            self.lora_hook(x, out)
        return out

    def quantize(self, method: str) -> None:
        """Replaces the loaded float weight by its `method` form; the float
        one is dropped (`weight` None)."""
        self.qweight = quant_linear.quantize(self.weight.data, method)
        self.weight = None

    def pack(self) -> None:
        """On the CPU, oneDNN's packed copy of the loaded float weight for
        the calls that go to torch, where that pays (`cpu_linear.pack`).
        Called once the weights are final: a later change to them would not
        reach the copy."""
        if self.weight is not None:
            self.packed = cpu_linear.pack(self.weight.data)

    def keep(self, qweight: quant_linear.QuantizedWeight | None) -> None:
        """Quantization "auto": the float weight, now in the activations'
        dtype, with `qweight` (exactly its values, or None) beside it for
        the calls small enough for the quantized kernel."""
        self.qweight = qweight
        self.weight = nn.Parameter(self.weight.data.to(self.dtype), requires_grad=False)

    def load_slice(self, name: str, param: str, tensor: torch.Tensor) -> None:
        target = self.weight if param == "weight" else self.bias
        if len(self.slice_names) == 1:
            load_param(target, f"{name}_proj.{param}", tensor)
            return
        rows = target[self.offsets[name] : self.offsets[name] + self.sizes[name]]
        if rows.shape != tensor.shape:
            raise ModelLoadError(
                f"{name}_proj.{param} has shape {tuple(tensor.shape)}, expected {tuple(rows.shape)}"
            )
        rows.copy_(tensor)
