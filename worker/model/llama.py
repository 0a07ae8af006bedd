"""Our Llama-family causal LM (Llama 2/3, Qwen2, Mistral): grouped-query attention, RoPE,
optional q/k/v bias, tied or untied embeddings, per-layer sliding windows.

It runs a *flat* batch: the new tokens of many sequences concatenated, each at its own
position, attention reading earlier context from the paged KV cache. q/k/v and gate/up
projections are fused (one matmul each); the loader splits checkpoint tensors into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.kernels import AttentionBackend, AttentionMetadata, dispatch
from draftwise.worker.model.model_config import ModelConfig
from draftwise.worker.model.rope import RotaryEmbedding, apply_rope


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = _empty(size)
        self.eps = eps
        self._impl = dispatch.impl("rms_norm", "cpu")

    def bind(self, device: torch.device) -> None:
        self._impl = dispatch.impl("rms_norm", device)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None = None,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._impl(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = sliding_window
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # RoPE tables at the tokens' positions, [T, 1, D] each
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk = apply_rope(
            qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), *cos_sin
        )
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, cfg.sliding_window[layer] if cfg.sliding_window else None)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos_sin, k_cache, v_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Decoder stack + LM head. ``forward`` returns final hidden states; ``compute_logits``
    turns the selected ones into logits, so prompt chunks skip the LM head."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings)
        self._lm_head_in_out: torch.Tensor | None = None  # [hidden, vocab] copy of the LM head on CPU
        for p in self.parameters():
            p.requires_grad_(False)

    def bind(self, device: torch.device) -> None:
        """Resolve device-dependent ops and build the RoPE table on ``device`` (after the
        weights are there; construction may have happened on the meta device)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.bind(device)
        self.rope = RotaryEmbedding(self.config.rope, self.config.head_dim, self.rope.max_positions, device)
        self.store_weights_in_out(device.type == "cpu")

    def store_weights_in_out(self, enabled: bool = True) -> None:
        """With ``enabled``, keep every projection's weight in memory as ``[in, out]`` (the
        parameter stays an ``[out, in]`` view of it, so ``F.linear`` and every reader see the
        same values); without, as ``[out, in]``. ``bind`` enables it on CPU.

        On CPU a decode step multiplies one row (or a few) by each weight, a matrix-vector
        product bound by how fast the weights stream from memory. BLAS streams an ``[in, out]``
        matrix about 1.7x faster than an ``[out, in]`` one for 1-2 rows (a dot per output
        along a 1 KiB row against an axpy over contiguous outputs) and equally fast from 64 rows
        up (measured in docs/benchmarks.md, "CPU weight layout"). The LM head gets an
        ``[hidden, vocab]`` copy when it is tied to the embedding, which keeps ``[vocab, hidden]``
        for its row lookups."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                w = m.weight.t().contiguous().t() if enabled else m.weight.contiguous()
                m.weight = nn.Parameter(w, requires_grad=False)
        self._lm_head_in_out = self.embed_tokens.weight.t().contiguous() if enabled and self.lm_head is None else None

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        residual = None
        for layer, (kc, vc) in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kc, vc, meta, backend)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        weight = self.lm_head_weight if self._lm_head_in_out is None else self._lm_head_in_out.t()
        return F.linear(hidden, weight).float()
