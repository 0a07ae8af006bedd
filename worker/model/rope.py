"""Rotary position embeddings (default, linear and llama3 scaling), as a cos/sin table
indexed by absolute position. Computed in float32 the way Hugging Face computes them."""

from __future__ import annotations

import math

import torch
from torch import nn

from draftwise.worker.model.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] float32
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """Applies RoPE (the rotate-half convention) to queries and keys at given positions."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.cos: torch.Tensor  # [P, D]: buffers, registered below
        self.sin: torch.Tensor
        with torch.device("cpu"):  # real values even when the model is built on the meta device
            inv = inverse_frequencies(rope, head_dim)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)  # [P, D/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables at ``positions`` ([T]), as [T, 1, D] in ``dtype``: computed once per forward."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([T, heads, D]; queries and keys may come together) by cos/sin ([T, 1, D])."""
    h = x.shape[-1] // 2
    rotated = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rotated * sin
