"""Our Llama-family causal LM (Llama 2/3, Qwen2, Mistral): grouped-query attention, RoPE,
optional q/k/v bias, tied or untied embeddings, per-layer sliding windows.

It runs a *flat* batch: the new tokens of many sequences concatenated, each at its own
position, attention reading earlier context from the paged KV cache. q/k/v and gate/up
projections are fused (one matmul each); the loader splits checkpoint tensors into them.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.kernels import AttentionBackend, AttentionMetadata, dispatch
from draftwise.worker.model import cpu_attention, cpu_layer, cpu_matmul
from draftwise.worker.model.cpu_weights import PackedWeight, exact_codes
from draftwise.worker.model.model_config import ModelConfig
from draftwise.worker.model.rope import RotaryEmbedding, apply_rope
from draftwise.worker.model.sharding import Shard

# RMSNorm on CPU: this package's kernel (float32, no gradients; the torch twin otherwise)
dispatch.register("rms_norm", "cpu", "draftwise-cpu", cpu_matmul.rms_norm)
# paged attention and KV writes on CPU: the library's (float32 on CPU; the torch twins otherwise)
dispatch.register("paged_attention", "cpu", cpu_attention.BACKEND, cpu_attention.paged_attention)
dispatch.register("write_kv_cache", "cpu", cpu_attention.BACKEND, cpu_attention.write_kv_cache)


def _empty(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


HEAD_QUANTIZATION = {"int4": "int8"}  # a 4-bit vocabulary costs the most accuracy for the fewest bytes
MIN_BLOCK_COLUMNS = 64  # narrower column blocks cost more in per-block overhead than their thread brings
MAX_BLOCKS = 8  # a few cores already draw what memory gives; more blocks only thin out large products


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be laid out in memory for CPU decoding
    (:meth:`set_cpu_layout`) or packed in lower precision (:meth:`quantize`); ``weight`` holds the
    checkpoint's values unless packed (then it is empty and ``packed`` holds them)."""

    packed: PackedWeight | None = None
    panels: bool = False  # the weight is stored as the CPU kernel's panels (cpu_matmul)
    layout_version = 0
    """Bumped whenever any projection's weight, bias or packing is set: the fused CPU layers
    (``cpu_layer``) point into them and are rebuilt when it moves."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("weight", "bias", "packed"):
            Linear.layout_version += 1
        super().__setattr__(name, value)

    def set_cpu_layout(self, parts: int | None) -> None:
        """Lay the weight out for ``parts`` threads (None: the checkpoint's ``[out, in]``).

        A decode step on CPU multiplies one row, or a few, by each weight: a matrix-vector
        product that streams the weight from memory, and BLAS runs it on one thread. With
        ``parts = 1`` the weight is stored ``[in, out]``, which BLAS streams 1.3-1.8x faster
        than ``[out, in]`` for one row; with ``parts = p > 1`` it is stored as ``p`` column
        blocks ``[p, in, out / p]`` and multiplied as one batched product, which torch runs
        one block per thread (fewer where ``p`` does not divide the columns or would make
        blocks narrower than ``MIN_BLOCK_COLUMNS``, and at most ``MAX_BLOCKS``): another 1.4-1.9x for 1-16 rows, about even at 64-512 rows and
        up to ~5% slower on 2,048-row prompt chunks (docs/benchmarks.md, "CPU weight layout").
        Measured with 2 threads only; the cap keeps many-core machines from splitting a
        product into thin blocks. ``weight`` stays an ``[out, in]`` tensor (a view of the blocks for ``p = 1``, a
        ``[p, out / p, in]`` view for ``p > 1``; :meth:`dense_weight` gives it 2-D).

        Where this package's CPU kernel runs (``cpu_matmul``: AVX2, a compiler, the output
        width a multiple of its panel), any ``parts`` lays the weight out as its panels
        instead: column blocks of ``cpu_matmul.PANEL`` (the same ``[P, PANEL, in]`` view), which
        the kernel multiplies with every thread, 1-8 rows at about the cost of one."""
        w = self.dense_weight()
        out_features, in_features = w.shape
        self.panels = parts is not None and w.dtype == torch.float32 and cpu_matmul.packs(out_features)
        if self.panels:
            self.weight = nn.Parameter(cpu_matmul.pack(w).transpose(1, 2), requires_grad=False)
            return
        if parts is not None:  # the most blocks up to ``parts`` that divide the columns evenly, none too narrow
            parts = next(
                p
                for p in range(min(max(1, parts), MAX_BLOCKS), 0, -1)
                if p == 1 or (out_features % p == 0 and out_features // p >= MIN_BLOCK_COLUMNS)
            )
        if parts is None:
            stored = w.contiguous()
        elif parts == 1:
            stored = w.t().contiguous().t()
        else:
            stored = w.reshape(parts, out_features // parts, in_features).transpose(1, 2).contiguous().transpose(1, 2)
        self.weight = nn.Parameter(stored, requires_grad=False)

    def quantize(self, mode: str) -> None:
        """Pack the weight in lower precision for CPU (``draftwise.worker.model.cpu_weights``:
        "fp16"); the float weight is dropped, ``dense_weight`` unpacks the values
        the products use."""
        self.packed = PackedWeight(self.dense_weight(), mode)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def keep_exact_codes(self) -> str:
        """Pack the weight in codes that hold it exactly (``cpu_weights.exact_codes``): the mode it took
        ("int8", "fp16"), or "float32" where none does (then nothing changes)."""
        packed = exact_codes(self.dense_weight()) if self.packed is None else None
        if packed is None:
            return "float32" if self.packed is None else self.packed.mode
        self.packed = packed
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return packed.mode

    def dense_weight(self) -> torch.Tensor:  # [out, in]
        if self.packed is not None:
            return self.packed.dense()
        w = self.weight
        return w if w.dim() == 2 else w.reshape(-1, w.shape[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pyright: ignore[reportIncompatibleMethodOverride]  [T, in] -> [T, out]
        w = self.weight
        if w.dim() == 2 and self.packed is None:
            return F.linear(x, w, self.bias)
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def product(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out], the bias left out
        if self.packed is not None:
            return self.packed.matmul(x)
        w = self.weight
        if w.dim() == 2:
            return F.linear(x, w)
        if self.panels and not (x.requires_grad or w.requires_grad) and cpu_matmul.kernel() is not None:
            return cpu_matmul.matmul(x, w.transpose(1, 2))  # (training multiplies the same blocks with torch)
        parts, block, _ = w.shape
        y = torch.bmm(x.expand(parts, *x.shape), w.transpose(1, 2))  # [p, T, out / p]
        return y.transpose(0, 1).reshape(x.shape[0], parts * block)


class Collectives(Protocol):
    """How a tensor-parallel rank combines its partial results with the other ranks'
    (``draftwise.worker.parallel.group.RankGroup``)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...  # the sum over ranks, in place

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor: ...  # ranks' columns on rank 0


def row_parallel(linear: Linear, x: torch.Tensor, comm: Collectives | None) -> torch.Tensor:
    """``linear(x)`` for a row-parallel projection: this rank's partial product summed over the
    ranks, the bias added once after the sum; plain ``linear(x)`` without ranks."""
    if comm is None:
        return linear(x)
    y = comm.all_reduce(linear.product(x))
    return y if linear.bias is None else y + linear.bias


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
    def __init__(self, cfg: ModelConfig, sliding_window: int | None, comm: Collectives | None = None) -> None:
        super().__init__()
        self.comm = comm
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = sliding_window
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)

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
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if not cpu_matmul.rope_(qk, *cos_sin):  # in place on CPU (qkv is this call's own), else torch's
            qk = apply_rope(qk, *cos_sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window)
        return row_parallel(self.o_proj, o.reshape(t, self.q_size), self.comm)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Collectives | None = None) -> None:
        super().__init__()
        self.comm = comm
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return row_parallel(self.down_proj, F.silu(gate) * up, self.comm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, comm: Collectives | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, cfg.sliding_window[layer] if cfg.sliding_window else None, comm)
        self.mlp = MLP(cfg, comm)
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
        assert residual is not None
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Decoder stack + LM head. ``forward`` returns final hidden states; ``compute_logits``
    turns the selected ones into logits, so prompt chunks skip the LM head."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        shard: Shard | None = None,
        comm: Collectives | None = None,
    ) -> None:
        """``shard`` and ``comm``: this rank's part of a tensor-parallel model and how it meets the
        other ranks (both or neither); the modules then have the rank's shapes (``local_config``)."""
        super().__init__()
        if (shard is None) != (comm is None):
            raise ValueError("a tensor-parallel shard needs its collectives, and the reverse")
        self.config = cfg
        self.shard = shard
        self.comm = comm
        self.local_config = local = cfg if shard is None else shard.local_config(cfg)
        """The shapes this process holds: the whole model's, or its rank's (heads, MLP width, vocabulary rows)."""
        self.embed_tokens = nn.Embedding(
            local.vocab_size, cfg.hidden_size, _weight=torch.empty(local.vocab_size, cfg.hidden_size)
        )
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(local, i, comm) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, local.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings)
        self._lm_head: Linear | None = None  # a tied LM head laid out on CPU (set_cpu_layout), unregistered
        self._fused_layers: cpu_layer.FusedLayers | None = None  # the layers as the CPU library's (cpu_layer.plan)
        self.feature_layers: tuple[int, ...] = ()
        """Layers whose output stream :meth:`forward` returns too, after the final hidden state (an
        EAGLE-3 head fuses them; set before graphs are captured)."""
        for p in self.parameters():
            p.requires_grad_(False)

    def bind(self, device: torch.device) -> None:
        """Resolve device-dependent ops and build the RoPE table on ``device`` (after the
        weights are there; construction may have happened on the meta device)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.bind(device)
        self.rope = RotaryEmbedding(self.config.rope, self.config.head_dim, self.rope.max_positions, device)
        self.set_cpu_layout(max(1, torch.get_num_threads()) if device.type == "cpu" else None)

    def set_cpu_layout(self, parts: int | None) -> None:
        """Lay every projection's weight out for CPU decoding with ``parts`` threads (None:
        as in the checkpoint); see :meth:`Linear.set_cpu_layout`. ``bind`` does it on CPU
        with the intra-op thread count. A tied LM head is laid out the same way, and the
        embedding lookups read the same storage (``_embed``): no second copy of the matrix."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.set_cpu_layout(parts)
        head = None
        if self.lm_head is None:
            embedding = self._embedding_dense()
            if parts is not None:
                head = Linear(self.config.hidden_size, self.local_config.vocab_size, bias=False, device="meta")
                head.weight = nn.Parameter(embedding, requires_grad=False)
                head.set_cpu_layout(parts)
                self.embed_tokens.weight = head.weight  # [vocab, hidden] or [p, vocab / p, hidden]: one parameter
            else:
                self.embed_tokens.weight = nn.Parameter(embedding.contiguous(), requires_grad=False)
        # not a submodule: its weight is the embedding's parameter, counted once
        object.__setattr__(self, "_lm_head", head)

    def quantize(self, mode: str) -> None:
        """Pack every projection and the LM head in lower precision for CPU (``Linear.quantize``;
        after ``bind``; the head in int8 where the projections are int4: ``HEAD_QUANTIZATION``). A tied LM head gets its own packed copy: the embedding keeps its float
        rows for the lookups (a few rows a step, never streamed whole)."""
        head_mode = HEAD_QUANTIZATION.get(mode, mode)
        for m in self.modules():
            if isinstance(m, Linear):
                m.quantize(head_mode if m is self.lm_head else mode)
        if self.lm_head is None:
            embedding = self._embedding_dense().contiguous()
            self.embed_tokens.weight = nn.Parameter(embedding, requires_grad=False)
            head = Linear(self.config.hidden_size, self.local_config.vocab_size, bias=False, device="meta")
            head.weight = nn.Parameter(embedding, requires_grad=False)
            head.quantize(head_mode)
            object.__setattr__(self, "_lm_head", head)

    def keep_exact_codes(self) -> dict[str, int]:
        """Pack every projection, and the LM head, that int8 or float16 codes hold exactly (``Linear.keep_exact_codes``;
        after ``bind``): the same products bit for bit from a fraction of the bytes. A tied head so held gets its
        own packed copy, as in ``quantize``; one that is not stays the embedding's. How many took each mode."""
        taken: dict[str, int] = {}
        for m in self.modules():
            if isinstance(m, Linear):
                mode = m.keep_exact_codes()
                taken[mode] = taken.get(mode, 0) + 1
        if self.lm_head is None:
            embedding = self._embedding_dense().contiguous()
            packed = exact_codes(embedding)
            mode = "float32" if packed is None else packed.mode
            taken[mode] = taken.get(mode, 0) + 1
            if packed is not None:
                self.embed_tokens.weight = nn.Parameter(embedding, requires_grad=False)
                head = Linear(self.config.hidden_size, self.local_config.vocab_size, bias=False, device="meta")
                head.weight = nn.Parameter(embedding.new_empty(0), requires_grad=False)
                head.packed = packed
                object.__setattr__(self, "_lm_head", head)
        return taken

    def linears(self) -> list[Linear]:
        """Every projection, and the tied LM head laid out or packed on CPU (not a submodule)."""
        found = [m for m in self.modules() if isinstance(m, Linear)]
        return found if self._lm_head is None else [*found, self._lm_head]

    def memory_bytes(self) -> int:
        """Bytes of parameters and packed weights held (a tensor shared by two names once)."""
        packed = sum(m.packed.nbytes for m in self.linears() if m.packed is not None)
        return packed + sum(p.numel() * p.element_size() for p in self.parameters())

    def streamed_bytes(self) -> int:
        """Bytes of weights a decode step reads whole: everything held but the embedding, unless the
        LM head multiplies by it (tied and not packed); other embedding rows are only looked up."""
        embedding = self.embed_tokens.weight
        head_reads_embedding = self.lm_head is None and (self._lm_head is None or self._lm_head.packed is None)
        return self.memory_bytes() - (0 if head_reads_embedding else embedding.numel() * embedding.element_size())

    def _embedding_dense(self) -> torch.Tensor:  # [vocab, hidden]
        w = self.embed_tokens.weight
        return w if w.dim() == 2 else w.reshape(-1, w.shape[-1])

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.shard is None or self.comm is None:
            return self._lookup(input_ids)
        v0, v1 = self.shard.vocab  # this rank's rows; the other ranks bring the rest, zeros here
        local = input_ids - v0
        inside = ((local >= 0) & (local < v1 - v0)).unsqueeze(1)  # [T, 1]
        x = self._lookup(local.clamp(0, self.shard.vocab_rows - 1))
        return self.comm.all_reduce(torch.where(inside, x, torch.zeros((), dtype=x.dtype, device=x.device)))

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden], rows this process holds
        w = self.embed_tokens.weight
        if w.dim() == 2:
            return F.embedding(input_ids, w)
        block = w.shape[1]  # column blocks of a tied LM head: row v is row v % block of block v // block
        return w[input_ids // block, input_ids % block]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_cache, v_cache)
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, feature_width]: the final hidden state, then feature_layers' streams
        x = self._embed(input_ids)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        residual = None
        fused = cpu_layer.plan(self, x, meta, backend, kv_caches)  # every layer in one call each, where it can
        if fused is not None:
            x, residual, streams = cpu_layer.forward(fused, self, x, cos_sin, kv_caches, meta)
        else:
            streams = []
            for i, (layer, (kc, vc)) in enumerate(zip(self.layers, kv_caches, strict=True)):
                x, residual = layer(x, residual, cos_sin, kc, vc, meta, backend)
                if i in self.feature_layers:
                    streams.append(x + residual)
        x, _ = self.norm(x, residual)
        return torch.cat([x, *streams], dim=-1) if streams else x

    @property
    def feature_width(self) -> int:
        """Columns of :meth:`forward`'s rows: the hidden size, once more per feature layer."""
        return self.config.hidden_size * (1 + len(self.feature_layers))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        """The logits of ``hidden``'s rows; under tensor parallelism every rank computes its
        vocabulary columns and rank 0 gets them all (the other ranks an empty tensor)."""
        if hidden.shape[-1] != self.config.hidden_size:  # rows of forward with feature layers: the final state first
            hidden = hidden[:, : self.config.hidden_size].contiguous()
        head = self._lm_head if self._lm_head is not None else self.lm_head
        logits = F.linear(hidden, self._embedding_dense()) if head is None else head(hidden)
        if self.comm is not None:
            logits = self.comm.gather_columns(logits, self.config.vocab_size)
        return logits.float()
