"""Trained draft heads that read the target's hidden states: EAGLE and Medusa.

Both read the target's *final hidden state* ``f_t`` (the LM head's input at position ``t``,
which the target's forward pass computes anyway) and share the target's embedding and LM
head, restricted to a **draft vocabulary** (the most frequent tokens of the head's training
data, as EAGLE-3 and FR-Spec do): drafting multiplies by ``V_d`` LM-head rows, not by the
whole vocabulary, and a token outside it is simply never proposed (q = 0 there; rejection
sampling stays exact).

- **EAGLE** (:class:`EagleHead`): one decoder layer over ``fc([embed(x_t); f_{t-1}])`` at
  position ``t`` (``f_{-1} = 0``), its own KV cache, output ``g_t = norm(layer(...))`` ≈ ``f_t``;
  the draft distribution of ``x_{t+1}`` is ``softmax(g_t W_d^T)``. Drafting feeds ``g_t`` back
  as the next position's feature, autoregressively. With ``feature_layers`` (EAGLE-3), the
  target's feature is ``fuse([f_t; n(s_a,t); n(s_b,t)...])`` instead: the output streams of
  earlier layers ``a, b...`` (each RMS-normalised) fused with the final state by one linear
  map; the target's forward pass returns those streams beside ``f`` (``LlamaModel.feature_layers``).
- **Medusa** (:class:`MedusaHeads`): ``K`` residual blocks on ``f_t``; head ``i`` (1-based)
  gives ``x_{t+1+i}``: ``softmax((f_t + SiLU(W_i f_t + b_i)) W_d^T)``.

A head lives in a folder: ``draftwise_head.json`` (:class:`HeadConfig`: the kind, the target it
was trained for and that target's fingerprint) and ``head.safetensors`` (float16 weights and
the draft vocabulary ``draft_ids``). :func:`load_head` refuses a head whose target differs
from the one being served, in one line. ``EagleHead.train_forward`` is the same computation
over padded batches with plain causal attention, differentiable (``scripts/train_heads.py``;
a test checks the two agree).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftwise.kernels import AttentionBackend, AttentionMetadata
from draftwise.worker.model.llama import DecoderLayer, Linear, LlamaModel, RMSNorm
from draftwise.worker.model.model_config import ModelConfig, ModelLoadError
from draftwise.worker.model.rope import RotaryEmbedding, apply_rope
from draftwise.worker.paths import HEADS_DIR

__all__ = [
    "HEAD_KINDS",
    "EagleHead",
    "HeadConfig",
    "LoadedHead",
    "MedusaHeads",
    "find_head",
    "fingerprints_match",
    "draft_lm_head",
    "head_model_config",
    "load_head",
    "save_head",
    "target_fingerprint",
]

HEAD_KINDS = ("eagle", "medusa")
CONFIG_FILE = "draftwise_head.json"
WEIGHTS_FILE = "head.safetensors"


def target_fingerprint(model: LlamaModel) -> dict[str, int | float]:
    """What identifies a target for a head: its shape, and a checksum of its embedding (the
    head shares it, so a head trained on another checkpoint of the same shape is refused)."""
    cfg = model.config
    w = model._embedding_dense()  # noqa: SLF001 - the embedding rows, whatever their CPU layout
    rows = w[: min(256, w.shape[0])].float()
    return {
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "embedding_checksum": round(float(rows.abs().sum()), 2),
    }


def fingerprints_match(a: dict[str, int | float], b: dict[str, int | float]) -> bool:
    """Same shape, and embedding checksums within 0.5% (a target loaded in bfloat16 or float16
    sums its rows a little differently from the float32 it was trained against)."""
    shape = ("hidden_size", "vocab_size", "num_hidden_layers")
    if any(a.get(k) != b.get(k) for k in shape):
        return False
    ca, cb = float(a.get("embedding_checksum", 0.0)), float(b.get("embedding_checksum", 0.0))
    return abs(ca - cb) <= 5e-3 * max(abs(ca), abs(cb), 1e-6)


@dataclass(frozen=True)
class HeadConfig:
    """``draftwise_head.json``."""

    kind: str  # "eagle" | "medusa"
    target: str  # the target's name, for messages
    fingerprint: dict[str, int | float]  # target_fingerprint of that target
    draft_vocab_size: int  # rows of the draft vocabulary
    num_heads: int = 0  # Medusa: heads (positions drafted at most)
    feature_layers: list[int] = dataclasses.field(default_factory=list)  # EAGLE: target layers fused with f (EAGLE-3)
    training: dict[str, object] = dataclasses.field(default_factory=dict)  # data, recipe, figures (informational)

    @classmethod
    def read(cls, folder: Path) -> HeadConfig:
        path = folder / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
            cfg = cls(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise ModelLoadError(f"{path}: not a draft head config ({e})") from None
        if cfg.kind not in HEAD_KINDS:
            raise ModelLoadError(f"{path}: kind must be one of {', '.join(HEAD_KINDS)}, got {cfg.kind!r}")
        return cfg

    def write(self, folder: Path) -> None:
        (folder / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")


def head_model_config(target: ModelConfig) -> ModelConfig:
    """The EAGLE layer's shape: one decoder layer of the target's, full attention."""
    return dataclasses.replace(target, num_hidden_layers=1, sliding_window=())


class EagleHead(nn.Module):
    """fc + one decoder layer + norm; the embedding and LM-head rows are the target's."""

    def __init__(self, cfg: ModelConfig, feature_layers: Sequence[int] = ()) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.feature_layers = tuple(feature_layers)
        # EAGLE-3's fused feature: the final state and the feature layers' streams (each RMS-normalised) -> hidden
        self.fuse = Linear((1 + len(self.feature_layers)) * h, h, bias=False) if self.feature_layers else None
        self.fc = Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg, 0)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def fused(self, feats: torch.Tensor) -> torch.Tensor:  # [..., feature width] -> [..., hidden]
        """The target's feature rows (the final hidden state, then each feature layer's stream)
        as the one feature the layer reads: themselves without feature layers."""
        if self.fuse is None:
            return feats
        h = self.config.hidden_size
        parts = feats.split(h, dim=-1)
        normed = [parts[0]] + [F.rms_norm(p, (h,), eps=self.config.rms_norm_eps) for p in parts[1:]]
        return self.fuse(torch.cat(normed, dim=-1))

    def init_fuse(self) -> None:
        """Start the fusion as the final state alone: a head trained without feature layers
        computes what it did."""
        if self.fuse is not None:
            h = self.config.hidden_size
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, :h].copy_(torch.eye(h))

    def bind(self, device: torch.device) -> None:
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.bind(device)

    def forward(
        self,
        emb: torch.Tensor,  # [T, hidden]: the target's embedding of x_t
        feats: torch.Tensor,  # [T, hidden]: f_{t-1} (or a drafted g_{t-1})
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],  # this layer's (k_cache, v_cache)
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]: g_t
        x = self.fc(torch.cat([emb, feats], dim=-1))
        h, residual = self.layer(x, None, cos_sin, kv[0], kv[1], meta, backend)
        g, _ = self.norm(h, residual)
        return g

    def train_forward(
        self,
        emb: torch.Tensor,  # [B, T, hidden]
        feats: torch.Tensor,  # [B, T, hidden]
        rope: RotaryEmbedding,
    ) -> torch.Tensor:  # [B, T, hidden]: g at every position, causal within each row (positions 0..T-1)
        """The same computation as :meth:`forward` over whole padded sequences, with plain
        causal attention and differentiable ops (training; positions start at 0 in each row)."""
        return self.train_pass(emb, feats, rope, [])[0]

    def train_pass(
        self,
        emb: torch.Tensor,  # [B, T, hidden]: x_i
        feats: torch.Tensor,  # [B, T, hidden]: this pass's feature before each position
        rope: RotaryEmbedding,
        past: list[tuple[torch.Tensor, torch.Tensor]],  # the earlier passes' (k, v), each [B, T, kv heads, d]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Pass ``j = len(past) + 1`` of training-time test (EAGLE-3): position ``i`` plays
        drafting position ``j`` at ``t = i - j + 1``, so it sees what drafting would: pass 1's
        keys (real features) at positions up to ``t`` and pass ``m``'s key at ``t + m - 1`` for
        ``m = 2..j`` (its own at ``i``). Pass 1 is :meth:`train_forward`. Returns (g, this
        pass's (k, v)) for the next pass."""
        cfg = self.config
        b, t, hd = emb.shape
        attn, mlp, layer = self.layer.self_attn, self.layer.mlp, self.layer
        x = self.fc(torch.cat([emb, feats], dim=-1))
        h = F.rms_norm(x, (hd,), layer.input_layernorm.weight, cfg.rms_norm_eps)
        qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)  # [B, T, q + 2kv]
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = rope.cos_sin(torch.arange(t, device=emb.device), emb.dtype)  # [T, 1, D]
        q = apply_rope(qkv[..., : nh * d].reshape(b, t, nh, d), cos, sin)
        k = apply_rope(qkv[..., nh * d : (nh + nkv) * d].reshape(b, t, nkv, d), cos, sin)
        v = qkv[..., (nh + nkv) * d :].reshape(b, t, nkv, d)
        rep = nh // nkv
        mask = None
        keys, values = k, v
        if past:
            j = len(past) + 1
            keys = torch.cat([pk for pk, _ in past] + [k], dim=1)  # [B, j T, kv, d]
            values = torch.cat([pv for _, pv in past] + [v], dim=1)
            i = torch.arange(t, device=emb.device)[:, None]
            p = torch.arange(t, device=emb.device)[None, :]
            blocks = [p <= i - j + 1] + [p == i - j + m for m in range(2, j + 1)]
            mask = torch.cat(blocks, dim=1)  # [T, j T]: True where position i may attend
        keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, is_causal=mask is None
        )
        o = F.linear(o.transpose(1, 2).reshape(b, t, nh * d), attn.o_proj.weight, attn.o_proj.bias)
        r = x + o
        h = F.rms_norm(r, (hd,), layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        gate, up = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).split(mlp.intermediate, dim=-1)
        m = F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return F.rms_norm(r + m, (hd,), self.norm.weight, cfg.rms_norm_eps), (k, v)


class MedusaHeads(nn.Module):
    """K residual blocks; ``forward`` gives every head's hidden state for one feature row."""

    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.zeros(num_heads, hidden, hidden))  # [K, out, in]
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden))  # [K, hidden]

    @property
    def num_heads(self) -> int:
        return self.proj.shape[0]

    def forward(self, f: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., K, hidden]
        y = torch.einsum("koi,...i->...ko", self.proj, f) + self.bias
        return f.unsqueeze(-2) + F.silu(y)


@dataclass
class LoadedHead:
    """A head ready to draft for one target."""

    config: HeadConfig
    folder: Path
    module: EagleHead | MedusaHeads
    draft_ids: torch.Tensor  # [V_d] int64: target token id of each draft-vocabulary row
    lm_head: Linear  # [V_d, hidden]: the target's LM-head rows for them (a gathered copy)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


def draft_lm_head(rows: torch.Tensor) -> Linear:
    """A Linear over the target's LM-head ``rows`` ([V_d, hidden]), laid out for CPU decoding
    on CPU (:meth:`Linear.set_cpu_layout`), as the target's own projections are."""
    head = Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
    _lay_out(head, rows.device)
    return head


def _lay_out(module: nn.Module, device: torch.device) -> None:
    if device.type == "cpu":
        for m in module.modules():
            if isinstance(m, Linear):
                m.set_cpu_layout(max(1, torch.get_num_threads()))


def find_head(kind: str, fingerprint: dict[str, int | float]) -> Path:
    """The shipped head of ``kind`` trained for the target with ``fingerprint``;
    ModelLoadError naming what is shipped when there is none."""
    shipped = sorted(p for p in HEADS_DIR.glob("*") if (p / CONFIG_FILE).is_file()) if HEADS_DIR.is_dir() else []
    names = []
    for folder in shipped:
        cfg = HeadConfig.read(folder)
        if cfg.kind == kind and fingerprints_match(cfg.fingerprint, fingerprint):
            return folder
        if cfg.kind == kind:
            names.append(cfg.target)
    have = f"shipped {kind} heads are for: {', '.join(names)}" if names else f"no {kind} head is shipped"
    raise ModelLoadError(f"no {kind} head was trained for this target ({have}); give --speculative-model <head folder>")


def load_head(
    folder: Path, target: LlamaModel, dtype: torch.dtype, device: torch.device, exact_codes: bool = False
) -> LoadedHead:
    """Load the head in ``folder`` for ``target``; ModelLoadError (one line) when it was
    trained for another target or is malformed. ``exact_codes`` (on CPU in float32): keep each of the
    head's projections, and its LM-head rows, in codes that hold them exactly
    (``Linear.keep_exact_codes``: a float16 head's weights as float16, a Q8_0 vocabulary's rows as
    int8), the same products bit for bit from fewer bytes per draft step."""
    from safetensors.torch import load_file

    cfg = HeadConfig.read(folder)
    mine = target_fingerprint(target)
    if not fingerprints_match(cfg.fingerprint, mine):
        raise ModelLoadError(
            f"{folder}: this {cfg.kind} head was trained for {cfg.target} {cfg.fingerprint}, "
            f"not for the target being served {mine}"
        )
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{folder / WEIGHTS_FILE}: {e}") from None
    draft_ids = tensors.pop("draft_ids").long()
    if draft_ids.numel() != cfg.draft_vocab_size or int(draft_ids.max()) >= target.config.vocab_size:
        raise ModelLoadError(f"{folder}: draft_ids does not fit the target's vocabulary")
    module: EagleHead | MedusaHeads
    if cfg.kind == "eagle":
        if any(not 0 <= i < target.config.num_hidden_layers for i in cfg.feature_layers):
            raise ModelLoadError(f"{folder}: feature_layers {cfg.feature_layers} are not all layers of the target")
        module = EagleHead(head_model_config(target.config), cfg.feature_layers)
    else:
        module = MedusaHeads(target.config.hidden_size, cfg.num_heads)
    try:
        module.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{folder}: weights do not match a {cfg.kind} head: {str(e).splitlines()[0]}") from None
    module = module.to(device=device, dtype=dtype).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    if isinstance(module, EagleHead):
        module.bind(device)
        _lay_out(module, device)
    # the streams the target's forward hands over beside its final state (before any graph is captured)
    target.feature_layers = module.feature_layers if isinstance(module, EagleHead) else ()
    dense = target._embedding_dense() if target.lm_head is None else target.lm_head.dense_weight()  # noqa: SLF001
    ids = draft_ids.to(device)
    lm_head = draft_lm_head(dense[ids])
    if exact_codes and device.type == "cpu" and dtype == torch.float32:
        for m in [*module.modules(), lm_head]:
            if isinstance(m, Linear):
                m.keep_exact_codes()
    return LoadedHead(cfg, folder, module, ids, lm_head)


def save_head(
    folder: Path,
    module: EagleHead | MedusaHeads,
    draft_ids: torch.Tensor,
    target_name: str,
    target: LlamaModel,
    training: dict[str, object] | None = None,
) -> HeadConfig:
    """Write ``module`` (float16) and its config for ``target`` into ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    kind = "eagle" if isinstance(module, EagleHead) else "medusa"
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()}
    tensors["draft_ids"] = draft_ids.to(torch.int32).contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE))
    cfg = HeadConfig(
        kind=kind,
        target=target_name,
        fingerprint=target_fingerprint(target),
        draft_vocab_size=int(draft_ids.numel()),
        num_heads=module.num_heads if isinstance(module, MedusaHeads) else 0,
        feature_layers=list(module.feature_layers) if isinstance(module, EagleHead) else [],
        training=training or {},
    )
    cfg.write(folder)
    return cfg
