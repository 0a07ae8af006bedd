"""The architecture of a checkpoint, read from its Hugging Face ``config.json``.

Only what our model code needs, normalised across transformers versions (``rope_theta`` +
``rope_scaling`` in 4.x, ``rope_parameters`` in 5.x) and across the Llama family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(Exception):
    """A checkpoint could not be loaded. The message names the file and the problem."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters."""

    theta: float = 10000.0  # base wavelength
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0  # scaling factor (linear, llama3)
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family causal LM."""

    architecture: str = "LlamaForCausalLM"  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int = 32000  # rows of the embedding
    hidden_size: int = 4096  # model width
    intermediate_size: int = 11008  # MLP width
    num_hidden_layers: int = 32  # decoder layers
    num_attention_heads: int = 32  # query heads
    num_key_value_heads: int = 32  # key/value heads (< query heads: grouped-query attention)
    head_dim: int = 128  # per-head width
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    max_position_embeddings: int = 2048  # context length
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, Llama attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    mlp_bias: bool = False  # bias on MLP projections (Llama mlp_bias)
    rope: RopeConfig = field(default_factory=RopeConfig)  # rotary embedding
    sliding_window: tuple[int | None, ...] = ()  # per layer: window size or None (full attention)
    bos_token_id: int | None = None  # beginning of sequence
    eos_token_ids: tuple[int, ...] = ()  # end of sequence (config may list several)
    torch_dtype: str | None = None  # dtype the checkpoint was saved in

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"draftwise supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(cfg.get("attention_bias", False))
        qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope=_parse_rope(cfg, source),
            sliding_window=_parse_sliding_window(cfg, arch, layers),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: config.json not found in the model folder")
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(cfg, source=str(path))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _parse_rope(cfg: dict[str, Any], source: str) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(cfg.get("rope_scaling") or {})
    theta = float(scaling.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    try:
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=factor,
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: llama3 rope scaling lacks {e.args[0]!r}") from None


def _parse_sliding_window(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if arch == "LlamaForCausalLM" or window is None:
        return (None,) * layers
    if arch == "Qwen2ForCausalLM":
        if not cfg.get("use_sliding_window", False):
            return (None,) * layers
        types = cfg.get("layer_types")
        if types is None:
            start = int(cfg.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window),) * layers  # Mistral: every layer
