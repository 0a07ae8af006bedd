"""Load a Hugging Face checkpoint folder, or a GGUF file, into our model code.

Single or sharded safetensors (``model.safetensors`` or ``model.safetensors.index.json``),
tied or untied embeddings; a ``.gguf`` file is read and dequantized by ``draftwise.worker.model.gguf``;
dtype float32, bfloat16 or float16; device cpu or cuda. Every failure raises ``ModelLoadError``
naming the file and the problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from draftwise.worker.model import cpu_matmul
from draftwise.worker.model.cpu_weights import check_supported
from draftwise.worker.model.gguf import gguf_config, is_gguf_path, iter_gguf_tensors, open_gguf
from draftwise.worker.model.llama import Collectives, Linear, LlamaModel
from draftwise.worker.model.model_config import ModelConfig, ModelLoadError
from draftwise.worker.model.sharding import Shard

log = structlog.get_logger("draftwise.loader")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# checkpoints above this size show a progress bar while loading
PROGRESS_BAR_BYTES = 200 * 1024 * 1024
# tensors some checkpoints carry that our code recomputes
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    """A model ready to run, with what it was loaded from."""

    model: LlamaModel
    config: ModelConfig
    folder: Path  # the checkpoint folder, or the .gguf file
    dtype: torch.dtype
    device: torch.device
    weight_bytes: int  # bytes of parameters and packed weights in memory
    streamed_bytes: int = 0  # bytes of weights a decode step reads whole (LlamaModel.streamed_bytes)
    quantization: str | None = None  # CPU lower-precision weights ("fp16", "int8", "int4", "auto"), None: the dtype's

    @property
    def kv_config(self) -> ModelConfig:
        """The shapes of the KV cache this process holds: the model's, or a tensor-parallel
        rank's (its key/value heads)."""
        return self.model.local_config


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """``"auto"``: float32 on CPU, the checkpoint's dtype on CUDA (bfloat16 if unknown)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(str(config.torch_dtype), torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files, and for a sharded checkpoint the tensor -> file map."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = sorted({folder / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        return files, {name: folder / f for name, f in weight_map.items()}
    single = folder / "model.safetensors"
    if single.is_file():
        return [single], None
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files, None
    others = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
    hint = f" (found {', '.join(others)}; convert to safetensors)" if others else ""
    raise ModelLoadError(f"{folder}: no model.safetensors or *.safetensors weights in the model folder{hint}")


def _checkpoint_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our parameter name -> the checkpoint tensors it is made of (concatenated on dim 0)."""
    names: dict[str, list[str]] = {
        "embed_tokens.weight": ["model.embed_tokens.weight"],
        "norm.weight": ["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        names[dst + "self_attn.qkv_proj.weight"] = [attn + f"{p}_proj.weight" for p in "qkv"]
        if cfg.qkv_bias:
            names[dst + "self_attn.qkv_proj.bias"] = [attn + f"{p}_proj.bias" for p in "qkv"]
        names[dst + "self_attn.o_proj.weight"] = [attn + "o_proj.weight"]
        if cfg.o_bias:
            names[dst + "self_attn.o_proj.bias"] = [attn + "o_proj.bias"]
        names[dst + "mlp.gate_up_proj.weight"] = [mlp + "gate_proj.weight", mlp + "up_proj.weight"]
        names[dst + "mlp.down_proj.weight"] = [mlp + "down_proj.weight"]
        if cfg.mlp_bias:
            names[dst + "mlp.gate_up_proj.bias"] = [mlp + "gate_proj.bias", mlp + "up_proj.bias"]
            names[dst + "mlp.down_proj.bias"] = [mlp + "down_proj.bias"]
        names[dst + "input_layernorm.weight"] = [src + "input_layernorm.weight"]
        names[dst + "post_attention_layernorm.weight"] = [src + "post_attention_layernorm.weight"]
    return names


def read_config(folder: str | Path) -> ModelConfig:
    """The architecture of a checkpoint folder or GGUF file, without loading its weights."""
    folder = Path(folder)
    if is_gguf_path(folder):
        return gguf_config(open_gguf(folder))
    return ModelConfig.from_folder(folder)


def load_model(
    folder: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    progress: bool | None = None,
    parallel: tuple[int, int, Collectives] | None = None,
    quantization: str | None = None,
) -> LoadedModel:
    """Load ``folder`` (a Hugging Face checkpoint of a supported architecture, or a GGUF file).
    ``parallel``: (rank, ranks, collectives) of a tensor-parallel rank; only the rank's shard
    (``draftwise.worker.model.sharding``) is read and held. ``quantization``: pack the projections
    and LM head in lower precision on CPU (``draftwise.worker.model.cpu_weights``: "fp16", "int8", "int4";
    float32 activations, so ``dtype`` must be float32); "auto": on CPU in float32 with the kernel, keep a GGUF
    file's weights that int8 or float16 codes hold exactly as those codes (``LlamaModel.keep_exact_codes``: the
    same products bit for bit, a fraction of the bytes), anything else as None; None or "none": the dtype's."""
    folder = Path(folder)
    gguf = is_gguf_path(folder)
    ckpt = None  # the open GGUF file
    if gguf:
        ckpt = open_gguf(folder)
        cfg = gguf_config(ckpt)
        origin = "the GGUF metadata"
    else:
        if not folder.exists():
            raise ModelLoadError(f"{folder}: model folder does not exist")
        if not folder.is_dir():
            raise ModelLoadError(f"{folder}: not a folder (expected a Hugging Face checkpoint folder or a .gguf file)")
        cfg = ModelConfig.from_folder(folder)
        origin = "config.json"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"{folder}: device {device} requested but CUDA is not available")
    torch_dtype = resolve_dtype(dtype, cfg, device)
    if quantization == "none":
        quantization = None
    if quantization not in (None, "auto"):
        _check_quantization(folder, quantization, torch_dtype, device)
    files, weight_map = ([folder], None) if gguf else _weight_files(folder)

    try:
        shard = None if parallel is None else Shard.plan(cfg, parallel[0], parallel[1])
    except ValueError as e:
        raise ModelLoadError(f"{folder}: {e}") from None
    with torch.device("meta"):
        model = LlamaModel(cfg, max_positions, shard, None if parallel is None else parallel[2])

    def part(name: str) -> tuple[int, tuple[int, int]] | None:
        return None if shard is None else shard.slice_of(name, cfg)

    model = model.to(torch_dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    wanted = _checkpoint_names(cfg)
    sources = {src for srcs in wanted.values() for src in srcs}
    if cfg.tie_word_embeddings:
        sources.add("lm_head.weight")  # may be present; the embedding is used

    owner = {src: name for name, srcs in wanted.items() for src in srcs}
    pending: dict[str, tuple[Path, torch.Tensor]] = {}
    done: set[str] = set()

    def place(name: str) -> None:
        """Copy a parameter once all of its checkpoint tensors have been read."""
        srcs = wanted[name]
        if name in done or any(s not in pending for s in srcs):
            return
        parts = [pending[s][1] for s in srcs]
        got = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        param = params[name]
        if shard is not None and name in ("embed_tokens.weight", "lm_head.weight") and got.shape[0] < param.shape[0]:
            got = torch.cat([got, got.new_zeros(param.shape[0] - got.shape[0], *got.shape[1:])])  # vocabulary padding
        if tuple(got.shape) != tuple(param.shape):
            shapes = ", ".join(f"{s} {tuple(pending[s][1].shape)} in {pending[s][0].name}" for s in srcs)
            raise ModelLoadError(f"{folder}: wrong shape for {shapes}; {origin} implies {_expected(param.shape, srcs)}")
        with torch.no_grad():
            param.copy_(got)
        done.add(name)
        for s in srcs:
            del pending[s]

    tensors = (
        iter_gguf_tensors(ckpt, cfg, sources, torch_dtype, part)
        if ckpt is not None
        else _iter_tensors(folder, files, weight_map, sources, progress, part)
    )
    for path, key, tensor in tensors:
        if key in owner:
            pending[key] = (path, tensor)
            place(owner[key])
    for name, srcs in wanted.items():
        if name not in done:
            missing = next(s for s in srcs if s not in pending)
            where = ", ".join(f.name for f in files)
            raise ModelLoadError(f"{folder}: tensor {missing!r} not found in {where}")
    model.bind(device)
    kept = None
    if quantization == "auto":
        if gguf and device.type == "cpu" and torch_dtype == torch.float32 and cpu_matmul.kernel() is not None:
            kept = model.keep_exact_codes()
    elif quantization is not None:
        model.quantize(quantization)
    model.eval()
    packed = [m.packed.numel for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    param_count = sum(p.numel() for p in model.parameters()) + sum(packed)  # a tied head's packed copy not again
    log.info(
        "model loaded",
        folder=str(folder),
        architecture=cfg.architecture,
        dtype=str(torch_dtype).removeprefix("torch."),
        quantization=quantization,
        exact_codes=kept,
        device=str(device),
        params_m=round(param_count / 1e6, 2),
        cpu_products=cpu_products(model) if device.type == "cpu" else None,
    )
    return LoadedModel(
        model=model,
        config=cfg,
        folder=folder,
        dtype=torch_dtype,
        device=device,
        weight_bytes=model.memory_bytes(),
        streamed_bytes=model.streamed_bytes(),
        quantization=quantization,
    )


def _check_quantization(folder: Path, mode: str, dtype: torch.dtype, device: torch.device) -> None:
    try:
        check_supported(mode)
    except ValueError as e:
        raise ModelLoadError(f"{folder}: {e}") from None
    if device.type != "cpu":
        raise ModelLoadError(f"{folder}: quantization={mode!r} runs on CPU only, got device {device}")
    if dtype != torch.float32:
        name = str(dtype).removeprefix("torch.")
        raise ModelLoadError(
            f"{folder}: quantization={mode!r} packs the weights and keeps float32 activations: use dtype float32 "
            f"or auto, got {name}"
        )


def _expected(shape: torch.Size, srcs: list[str]) -> str:
    if len(srcs) == 1:
        return str(tuple(shape))
    return f"{tuple(shape)} for the {len(srcs)} tensors concatenated on dim 0"


def _read(st: Any, key: str, cut: tuple[int, tuple[int, int]] | None) -> torch.Tensor:
    """Tensor ``key`` of an open safetensors file, or only the rows / columns ``cut`` names."""
    if cut is None:
        return st.get_tensor(key)
    dim, (a, b) = cut
    sl = st.get_slice(key)
    return sl[a:b] if dim == 0 else sl[:, a:b]


def _iter_tensors(
    folder: Path,
    files: list[Path],
    weight_map: dict[str, Path] | None,
    wanted: set[str],
    progress: bool | None,
    part: Callable[[str], tuple[int, tuple[int, int]] | None] = lambda name: None,
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, name, tensor) for each wanted tensor, one file at a time; ``part(name)``: the
    (dimension, [start, stop)) to read of it (a tensor-parallel shard), None for all of it."""
    total = sum(f.stat().st_size for f in files)
    show = total >= PROGRESS_BAR_BYTES if progress is None else progress
    seen: set[str] = set()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {folder.name}", disable=not show)
    try:
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    for key in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                        if key in wanted:
                            seen.add(key)
                            yield f, key, _read(st, key, part(key))
                        elif not key.endswith(_IGNORED_SUFFIXES):
                            log.warning("unused tensor in checkpoint", file=f.name, tensor=key)
            except SafetensorError as e:
                raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
            except OSError as e:
                raise ModelLoadError(f"{f}: cannot read ({e})") from None
            bar.update(f.stat().st_size)
    finally:
        bar.close()
    if weight_map is not None:
        for key, f in weight_map.items():
            if key in wanted and key not in seen:
                raise ModelLoadError(f"{f}: tensor {key!r} listed in model.safetensors.index.json is not in this shard")


def cpu_products(model: LlamaModel) -> str:
    """Which kernel multiplies the weights on CPU: this package's (``cpu_matmul``) for how many
    of the projections, or torch's and why."""
    linears = model.linears()
    ours = sum(m.panels or (m.packed is not None and m.packed.kernel == "draftwise") for m in linears)
    if ours == len(linears):
        return f"draftwise kernel ({'AVX-512' if cpu_matmul.vector_bits() == 512 else 'AVX2'})"
    reason = cpu_matmul.unavailable_reason()
    return f"draftwise kernel for {ours} of {len(linears)}" if reason is None else f"torch ({reason})"
