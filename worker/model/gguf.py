"""GGUF checkpoints (llama.cpp's single-file format) for our Llama-family model code.

The container is read by :mod:`draftwise.worker.model.gguf_file` (metadata and tensor table with
``struct`` over a memory map: gguf-py's reader parses the tokenizer's arrays element by element, a
quarter of a server's start-up); tensors are dequantized with the maintained ``gguf`` package:

- the architecture and hyper-parameters come from the file's metadata (``general.architecture``,
  ``{arch}.embedding_length``, ``{arch}.block_count``, ``{arch}.attention.head_count`` ...), the
  vocabulary size from the embedding tensor, tied embeddings from the absence of ``output.weight``,
  the end-of-sequence ids from ``tokenizer.ggml.eos_token_id`` / ``eot_token_id`` / ``eom_token_id``;
- every weight is dequantized at load, one tensor at a time, to the dtype the model runs in
  (``SUPPORTED_TYPES``; any other type is refused naming the type and the tensor);
- the Q/K row permutation llama.cpp's converter applies to Llama weights is undone, as
  transformers does when it loads a GGUF file.

The tokenizer (with the file's chat template) is built by ``draftwise.worker.text.tokenizer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from draftwise.worker.model.gguf_file import GGUFTensor, read_gguf
from draftwise.worker.model.model_config import ModelConfig, ModelLoadError, RopeConfig

log = structlog.get_logger("draftwise.gguf")

GGUF_MAGIC = b"GGUF"
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
"""Tensor types dequantized at load (``gguf.GGMLQuantizationType`` names)."""
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""``general.architecture`` values we load -> the model code they run on."""
# Llama 3.1 / 3.2 frequency scaling, as llama.cpp's converter writes it into ``rope_freqs.weight``
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def is_gguf_path(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file: a ``.gguf`` name, or a file starting with GGUF's magic."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    try:
        with p.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass
class GGUFCheckpoint:
    """An opened GGUF file: its metadata and its tensors (memory-mapped, not yet dequantized)."""

    path: Path
    tensors: list[GGUFTensor]  # memory-mapped, in the file's order
    metadata: dict[str, Any]  # key -> value (strings, numbers, lists), token arrays excluded

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]


# token arrays: tens of thousands of entries, read by the tokenizer only
_SKIPPED_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open ``path``; a missing, truncated or foreign file raises ModelLoadError saying which."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: GGUF file does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a file (expected a .gguf file)")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        file = read_gguf(path, skip=_SKIPPED_KEYS)
    except (ValueError, OSError) as e:  # GGUFFormatError is a ValueError
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    return GGUFCheckpoint(path=path, tensors=file.tensors, metadata=file.metadata)


def gguf_config(ckpt: GGUFCheckpoint) -> ModelConfig:
    """The architecture of a GGUF checkpoint, from its metadata (and tensor shapes)."""
    path, md = ckpt.path, ckpt.metadata
    arch = ckpt.architecture
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r} (general.architecture); "
            f"draftwise loads {', '.join(ARCHITECTURES)} GGUF files"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {full!r}")
        return md[full]

    heads = int(need("attention.head_count"))
    kv = md.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv, list):  # per layer
        if len(set(kv)) != 1:
            raise ModelLoadError(f"{path}: per-layer key/value head counts {sorted(set(kv))} are not supported")
        kv = kv[0]
    hidden = int(need("embedding_length"))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    rot = md.get(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelLoadError(
            f"{path}: partial rotary embeddings ({arch}.rope.dimension_count={rot}, head size {head_dim}) "
            "are not supported"
        )
    tensors = {t.name: t for t in ckpt.tensors}
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' not found in the GGUF file")
    eos = [
        md.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ]
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "head_dim": head_dim,
        "vocab_size": int(embed.shape[1]),  # ggml order: [hidden, vocab]
        "rms_norm_eps": float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensors,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": sorted({int(e) for e in eos if e is not None}),
    }
    config = ModelConfig.from_dict(cfg, source=str(path))
    rope = _rope(ckpt, arch, config)
    return ModelConfig(**{**config.__dict__, "rope": rope})


def _rope(ckpt: GGUFCheckpoint, arch: str, cfg: ModelConfig) -> RopeConfig:
    from draftwise.worker.model.rope import inverse_frequencies

    path, md = ckpt.path, ckpt.metadata
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    kind = str(md.get(f"{arch}.rope.scaling.type", "none"))
    factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    freqs = next((t for t in ckpt.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.1-style per-frequency factors: accepted when they are llama3 scaling's
        got = torch.from_numpy(_dequantize(ckpt, freqs).reshape(-1).copy())
        llama3 = RopeConfig(theta=theta, rope_type="llama3", factor=float(got.max()), **_LLAMA3_ROPE)  # type: ignore[arg-type]
        base = inverse_frequencies(RopeConfig(theta=theta), cfg.head_dim)
        want = base / inverse_frequencies(llama3, cfg.head_dim)
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-4):
            raise ModelLoadError(
                f"{path}: rope_freqs.weight holds frequency factors that are not Llama 3's rope scaling; not supported"
            )
        return llama3
    if kind in ("none", ""):
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    raise ModelLoadError(f"{path}: unsupported rope scaling {kind!r} ({arch}.rope.scaling.type); supported: linear")


def _dequantize(ckpt: GGUFCheckpoint, tensor: Any, rows: tuple[int, int] | None = None) -> np.ndarray:
    """``tensor`` as float32 in ggml's dims reversed (rows first); ``rows``: only that range of
    rows, sliced out of the file's (quantized) rows before anything is dequantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype.name not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"{ckpt.path}: tensor {tensor.name!r} has type {qtype.name}, which draftwise does not load; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )
    data = tensor.data if rows is None else tensor.data[rows[0] : rows[1]]  # quantized rows are independent
    try:
        out = dequantize(data, qtype)
    except (ValueError, IndexError) as e:
        raise ModelLoadError(f"{ckpt.path}: tensor {tensor.name!r} ({qtype.name}) is corrupt ({e})") from None
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if rows is not None:
        shape = (rows[1] - rows[0], *shape[1:])
    arr = np.asarray(out, dtype=np.float32).reshape(shape)
    return arr if arr.flags.writeable else arr.copy()  # F32 tensors come back as views of the read-only map


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows ([heads*D, ...] or a bias [heads*D])."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    """A GGUF tensor name -> the Hugging Face checkpoint name our loader knows (None: not ours)."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if name in fixed:
        return fixed[name]
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    layer, kind, suffix = parts[1], parts[2], parts[3]
    per_layer = {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    if kind not in per_layer:
        return None
    return f"model.layers.{layer}.{per_layer[kind]}.{suffix}"


def iter_gguf_tensors(
    ckpt: GGUFCheckpoint,
    cfg: ModelConfig,
    wanted: set[str],
    dtype: torch.dtype,
    part: Callable[[str], tuple[int, tuple[int, int]] | None] = lambda name: None,
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Yield (file, Hugging Face name, tensor in ``dtype``) for each wanted tensor, dequantized
    one at a time, Q/K rows back in Hugging Face's order for Llama. ``part(name)``: the
    (dimension, [start, stop)) of the tensor to keep (a tensor-parallel rank's shard), None for
    all of it; a range of rows is cut before dequantizing, a range of columns after."""
    unpermute = ckpt.architecture == "llama"
    for t in ckpt.tensors:
        name = _hf_name(t.name)
        if name is None or name not in wanted:
            if t.name != "rope_freqs.weight":  # read into the config
                log.warning("unused tensor in checkpoint", file=ckpt.path.name, tensor=t.name)
            continue
        cut = part(name)
        w = torch.from_numpy(_dequantize(ckpt, t, cut[1] if cut is not None and cut[0] == 0 else None))
        if unpermute and (".q_proj." in name or ".k_proj." in name):  # within each head: a head range stays whole
            w = _unpermute(w, w.shape[0] // cfg.head_dim)
        if cut is not None and cut[0] == 1:
            w = w[:, cut[1][0] : cut[1][1]]
        yield ckpt.path, name, w.to(dtype)
