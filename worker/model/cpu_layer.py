"""A decoder layer on CPU in one call to this package's kernel library (``cpu_layer.cpp``): the fused path
``LlamaModel.forward`` takes for steps whose sequences each bring at most ``reference.SHORT_QUERY_MAX`` new
tokens (decode, verify, short chunks), where the layer's kernels all run.

A SmolLM2-135M decode step on CPU called some 25 torch ops a layer around its products: ~5 ms of Python on
a ~15 ms step. The fused layer calls the same kernels in the same order from C++ (the products, RMSNorm,
RoPE, the KV write and paged attention of ``cpu_attention``), so its outputs are the module path's but for
silu's exponential (this library's polynomial, not torch's Sleef: the last bits of the MLP's activations).

It applies when (``plan``): the kernel library is built, the model is float32 on CPU with no tensor
parallelism, no gradient is wanted, every projection is the kernel's (float32 / float16 panels or 8- / 4-bit
codes), the attention backend is the library's (not the torch twin a test asks for), and the step has no
long prompt chunk. Otherwise the modules run as before.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from draftwise.kernels import AttentionBackend, AttentionMetadata, reference
from draftwise.worker.model import cpu_attention, cpu_matmul

# The model's classes (llama.py imports this module) are typed Any here: a Linear, DecoderLayer, LlamaModel.
Linear = DecoderLayer = LlamaModel = Any

KINDS = {torch.float32: 0, torch.float16: 1}  # panels' dtype -> the kernel's weight kind; codes: 2 (8-bit), 3 (4-bit)


class DwWeight(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("w", ctypes.c_void_p),
        ("sm", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_int64),
        ("inp", ctypes.c_int64),
    ]


class DwLayer(ctypes.Structure):
    _fields_ = [
        *[(name, DwWeight) for name in ("qkv", "o", "gate_up", "down")],
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps", ctypes.c_double),
        *[(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "window")],
        ("scale", ctypes.c_double),
    ]


class DwStep(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int64),
        *[(name, ctypes.c_void_p) for name in ("cos", "sin", "slots", "qsl", "seq_lens", "tables")],
        ("table_width", ctypes.c_int64),
        ("seq_ids", ctypes.c_void_p),
        *[(name, ctypes.c_int64) for name in ("n_ids", "block_size", "capacity", "threads")],
    ]


def _weight(linear: Linear, keep: list[Any]) -> DwWeight | None:
    """``linear`` as the kernel's weight, or None where the kernel does not multiply it."""
    bias = linear.bias
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or not bias.is_contiguous()):
        return None
    if linear.packed is not None:
        held = getattr(linear.packed, "panels", None)  # a PackedWeight's (a bench may install another product)
        if not isinstance(held, tuple):
            return None
        panels, sm = held
        codes = 2 if panels.shape[2] == cpu_matmul.PANEL else 3  # 8-bit or 4-bit
        kind = codes if panels.dtype == torch.uint8 else KINDS[panels.dtype]
    elif linear.panels and linear.weight.dtype == torch.float32:
        panels, sm, kind = linear.weight.transpose(1, 2), None, 0
    else:
        return None
    if not panels.is_contiguous():
        return None
    keep += [panels, sm, bias]
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    return DwWeight(kind, panels.data_ptr(), ptr(sm), ptr(bias), panels.shape[0] * cpu_matmul.PANEL, panels.shape[1])


def _layer(layer: DecoderLayer, keep: list[Any]) -> DwLayer | None:
    attn, mlp = layer.self_attn, layer.mlp
    weights = [_weight(m, keep) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(w is None for w in weights) or any(n.dtype != torch.float32 or not n.is_contiguous() for n in norms):
        return None
    keep += norms
    return DwLayer(
        *weights,
        norms[0].data_ptr(),
        norms[1].data_ptr(),
        layer.input_layernorm.eps,
        attn.o_proj.out_features,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        mlp.intermediate,
        attn.sliding_window or 0,
        attn.scale,
    )


class FusedLayers:
    """A model's layers as the kernel's structures, built once per weight layout (``Linear.layout_version``)."""

    def __init__(self, model: LlamaModel, version: int) -> None:
        self.version = version
        self.keep: list[Any] = []  # the tensors the structures point into
        layers = [_layer(layer, self.keep) for layer in model.layers]
        self.layers: list[DwLayer] | None = None if any(x is None for x in layers) else layers  # type: ignore[assignment]
        self.heads = model.local_config.num_attention_heads
        self.kv_heads = model.local_config.num_key_value_heads
        self.head_dim = model.config.head_dim


def plan(
    model: LlamaModel,
    x: torch.Tensor,
    meta: AttentionMetadata,
    backend: AttentionBackend,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> FusedLayers | None:
    """The model's fused layers where this step can take them, else None (the modules run)."""
    from draftwise.worker.model import llama

    lib = cpu_matmul.kernel()
    if (
        lib is None
        or model.comm is not None
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or (torch.is_grad_enabled() and x.requires_grad)
        or backend.name != cpu_attention.BACKEND  # not the torch twins a test may ask for
        or meta.max_query_len > reference.SHORT_QUERY_MAX
        or meta.slot_mapping.device.type != "cpu"
        # every layer's cache is a view of one KVCache tensor: the first stands for them all
        or (kv_caches and any(c.dtype != torch.float32 or not c.is_contiguous() for c in kv_caches[0]))
    ):
        return None
    fused = model._fused_layers
    version = llama.Linear.layout_version
    if fused is None or fused.version != version:
        fused = FusedLayers(model, version)
        object.__setattr__(model, "_fused_layers", fused)
    if (
        fused.layers is None
        or fused.head_dim % 8
        or fused.heads % fused.kv_heads
        or fused.heads // fused.kv_heads > lib.dw_attention_max_group()
    ):
        return None
    return fused


def forward(
    fused: FusedLayers,
    model: LlamaModel,
    x: torch.Tensor,  # [T, hidden] embeddings
    cos_sin: tuple[torch.Tensor, torch.Tensor],  # [T, 1, D] each
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Every layer: (the last layer's output, its residual stream, the feature layers' streams)."""
    lib = cpu_matmul.kernel()
    assert lib is not None and fused.layers is not None
    t, hidden = x.shape
    cos, sin = (c.reshape(t, -1).contiguous() for c in cos_sin)
    slots = meta.slot_mapping.to(torch.int64).contiguous()
    short, _, qsl, seq_lens, tables = cpu_attention._plan(meta)
    step = DwStep(
        t, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), qsl.data_ptr(), seq_lens.data_ptr(), tables.data_ptr(),
        tables.shape[1], short.data_ptr(), short.numel(), meta.block_size, 0, torch.get_num_threads(),
    )  # fmt: skip
    scratch = torch.empty(lib.dw_layer_scratch(ctypes.byref(fused.layers[0]), t), dtype=torch.float32)
    out = torch.empty(t, hidden, dtype=torch.float32)
    residual = torch.empty(t, hidden, dtype=torch.float32)
    x = x.contiguous()
    streams = []
    for i, (layer, (kc, vc)) in enumerate(zip(fused.layers, kv_caches, strict=True)):
        step.capacity = kc.shape[0] * kc.shape[1]
        bad = lib.dw_layer_forward(
            ctypes.byref(layer), ctypes.byref(step), x.data_ptr(), None if i == 0 else residual.data_ptr(),
            kc.data_ptr(), vc.data_ptr(), out.data_ptr(), residual.data_ptr(), scratch.data_ptr(),
        )  # fmt: skip
        if bad >= 0:
            raise IndexError(f"write_kv_cache: slot {bad} is beyond the cache's {step.capacity}")
        x = out
        if i in model.feature_layers:
            streams.append(x + residual)
    return x, residual, streams
