"""Triton kernels for the hot ops other than attention: the KV-cache write through slot
mappings, RMSNorm fused with the residual add, and the rejection sampler's
accept-and-resample step.

Each wrapper has the signature of its torch twin in :mod:`draftwise.kernels.reference` and
computes what the twin computes (bit for bit where the twin's arithmetic is exact: the
cache write, the residual sum, the acceptance test and the final draw; to rounding in
RMSNorm's reduction). The dispatch point picks them for CUDA tensors; on CPU tensors they
run under ``TRITON_INTERPRET=1``, which is how the unit tests hold them to their twins.
Wrappers check dtypes, strides and contiguity, allocate their outputs and launch without a
host synchronisation, so they can be captured in CUDA graphs.
"""

# pyright: reportArgumentType=false, reportCallIssue=false, reportOperatorIssue=false
# (a @triton.jit function is typed by its Python signature: launches pass ints for constexpr
# parameters and launch options such as num_warps, and tl values are untyped)
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rejection_accept", "rms_norm", "write_kv_cache"]

_F32_TINY = torch.finfo(torch.float32).tiny  # Exp(1) noise is clamped to this, as the twin does


# ----------------------------------------------------------------------------- KV-cache write


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [T, H, D]
    v_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_slots, H, D] contiguous
    v_cache_ptr,  # [num_slots, H, D] contiguous
    slot_ptr,  # [T] int64
    k_stride_t,
    k_stride_h,
    v_stride_t,
    v_stride_h,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)  # int64
    if slot >= 0:  # a negative slot (graph padding) writes nothing
        h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        mask = (h < H) & (d < D)
        dst = slot * (H * D) + h * D + d  # [BLOCK_H, BLOCK_D] int64
        k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64; -1: do not write
    skip_negative: bool = False,  # the twin's switch; the kernel always skips negative slots
) -> None:
    """Store each new token's key and value at its slot (one program per token); tokens with
    a negative slot are skipped on the device, without a host read."""
    t, h, d = k.shape
    assert v.shape == k.shape, f"k {list(k.shape)} and v {list(v.shape)} differ"
    assert k_cache.shape == v_cache.shape and k_cache.shape[-2:] == (h, d), "cache and k/v head shapes differ"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1, "k and v must be contiguous along head_dim"
    assert slot_mapping.dtype == torch.int64 and slot_mapping.shape == (t,), "slot_mapping must be [T] int64"
    assert slot_mapping.is_contiguous()
    if t == 0:
        return
    if k.dtype != k_cache.dtype:  # cast by torch, as in the twin: the kernel only copies bits
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    _write_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        H=h,
        D=d,
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_D=triton.next_power_of_2(d),
    )


# ----------------------------------------------------------------------------- RMSNorm (+ residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    res_ptr,  # [T, N] (unused without HAS_RES)
    w_ptr,  # [N]
    out_ptr,  # [T, N] contiguous
    res_out_ptr,  # [T, N] contiguous (unused without HAS_RES)
    x_stride,
    res_stride,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
        # rounded to the input dtype first, as torch's ``x + residual`` is; the norm reads that
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    # the normalised value is rounded to the input dtype before the weight multiplies it
    y = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * tl.load(w_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual' = x + residual`` (or ``x``), then RMSNorm of it in float32, one program
    per row; returns ``(normed, residual')`` in the input dtype, as the twin does."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, hidden], contiguous along hidden"
    t, n = x.shape
    assert weight.shape == (n,) and weight.is_contiguous(), f"weight must be [{n}] contiguous"
    assert weight.dtype == x.dtype, f"weight is {weight.dtype}, x is {x.dtype}"
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1, "residual must be shaped and laid out as x"
        assert residual.dtype == x.dtype, f"residual is {residual.dtype}, x is {x.dtype}"
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)  # [T, hidden]
    res_out = torch.empty_like(out) if residual is not None else x  # [T, hidden]
    if t == 0:
        return out, res_out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(t,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out, res_out


# ----------------------------------------------------------------------------- rejection sampling


@triton.jit
def _race_argmax(
    p_ptr,  # [V] float32: p
    q_ptr,  # [V] float32: q (read only with HAS_Q and use_residual)
    noise_ptr,  # [V] float32: Exp(1) noise (read only without unit_noise)
    V,
    drop,  # int64 scalar: an index whose weight is 0 (-1: none)
    use_residual,  # int32 scalar, 0 or 1: weights max(0, p - q) instead of p (with HAS_Q)
    unit_noise,  # int32 scalar, 0 or 1: noise 1 everywhere, i.e. the argmax of the weights
    tiny,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """argmax over v of w[v] / max(noise[v], tiny), the first index on ties, in chunks."""
    # flags as blocks, built from int32: the interpreter mis-types scalar booleans broadcast to blocks
    residual_b = (tl.zeros([BLOCK_V], tl.int32) + use_residual) != 0  # [BLOCK_V]
    unit_b = (tl.zeros([BLOCK_V], tl.int32) + unit_noise) != 0  # [BLOCK_V]
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        w = tl.load(p_ptr + offs, mask=mask, other=0.0)
        if HAS_Q:
            q = tl.load(q_ptr + offs, mask=mask & residual_b, other=0.0)
            w = tl.where(residual_b, tl.maximum(w - q, 0.0), w)
        w = tl.where(offs == drop, 0.0, w)
        e = tl.load(noise_ptr + offs, mask=mask & (unit_b == 0), other=1.0)
        e = tl.where(unit_b, 1.0, tl.maximum(e, tiny))
        score = tl.where(mask, tl.div_rn(w, e), float("-inf"))  # IEEE division, as torch's
        chunk_best = tl.max(score, axis=0)
        chunk_idx = tl.argmax(score, axis=0, tie_break_left=True).to(tl.int64) + start
        better = chunk_best > best_val  # strict: on a tie the earlier chunk keeps it
        best_idx = tl.where(better, chunk_idx, best_idx)
        best_val = tl.where(better, chunk_best, best_val)
    return best_idx


@triton.jit
def _residual_has_mass(
    p_ptr,  # [V] float32
    q_ptr,  # [V] float32 (read only with HAS_Q)
    V,
    drop,  # int64 scalar: an index whose weight is 0 (-1: none)
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Whether max(0, p - q) (with HAS_Q) or p without ``drop`` has a positive entry."""
    count = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        r = tl.load(p_ptr + offs, mask=mask, other=0.0)
        if HAS_Q:
            r = tl.maximum(r - tl.load(q_ptr + offs, mask=mask, other=0.0), 0.0)
        r = tl.where(offs == drop, 0.0, r)
        count += tl.sum((r > 0.0).to(tl.int32), axis=0)
    return count > 0


@triton.jit
def _rejection_accept_kernel(
    p_ptr,  # [N, K + 1, V] float32 contiguous
    q_ptr,  # [N, K, V] float32 contiguous (read only with HAS_Q)
    ids_ptr,  # [N, K] int64 contiguous (read only when K > 0)
    num_draft_ptr,  # [N] int64
    u_ptr,  # [N, K] float32 contiguous (read only when K > 0)
    noise_ptr,  # [N, V] float32 contiguous
    greedy_ptr,  # [N] bool
    num_acc_ptr,  # [N] int64, out
    final_ptr,  # [N] int64, out
    K,
    V,
    tiny,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    k_i = tl.load(num_draft_ptr + i)
    is_greedy = tl.load(greedy_ptr + i) != 0
    p_row = p_ptr + i * (K + 1) * V
    q_row = q_ptr + i * K * V
    alive = tl.full((), 1, tl.int32)  # 1 while every draft so far was accepted
    acc = tl.full((), 0, tl.int64)
    for j in range(0, K):
        live = (alive != 0) & (j < k_i)
        x = tl.load(ids_ptr + i * K + j)  # int64
        p_x = tl.load(p_row + j * V + x)
        q_x = tl.load(q_row + j * V + x) if HAS_Q else 1.0  # one-hot q: 1 at the drafted token
        # q == 0 < p: inf, accepted; p == 0: 0 or NaN, rejected. IEEE division, as torch's.
        ok = tl.load(u_ptr + i * K + j) < tl.div_rn(p_x, q_x)
        if live & is_greedy:  # greedy: accepted iff the draft is argmax p_j (first index on ties)
            ok = x == _race_argmax(p_row + j * V, p_row, noise_ptr, V, -1, 0, 1, tiny, False, BLOCK_V)
        alive = (live & ok).to(tl.int32)
        acc += alive.to(tl.int64)
    rejected = (acc < k_i) & (is_greedy == 0)
    at = tl.minimum(acc, tl.maximum(K - 1, 0))  # the rejected position (clamped where there is none)
    p_fin = p_row + acc * V  # the final position: the first rejection, or the bonus
    q_fin = q_row + at * V
    # with a one-hot q at the rejected draft x, the residual is p without x
    drop = tl.full((), -1, tl.int64) if HAS_Q else tl.load(ids_ptr + i * K + at, mask=rejected, other=-1)
    # an empty residual falls back to p
    use_residual = rejected & _residual_has_mass(p_fin, q_fin, V, drop, HAS_Q, BLOCK_V)
    drop = tl.where(use_residual, drop, -1)
    final = _race_argmax(
        p_fin,
        q_fin,
        noise_ptr + i * V,
        V,
        drop,
        use_residual.to(tl.int32),
        is_greedy.to(tl.int32),
        tiny,
        HAS_Q,
        BLOCK_V,
    )
    tl.store(num_acc_ptr + i, acc)
    tl.store(final_ptr + i, final)


def rejection_accept(
    target_probs: torch.Tensor,  # [N, K + 1, V] float32
    draft_probs: torch.Tensor | None,  # [N, K, V] float32; None: q one-hot at the drafted token
    draft_ids: torch.Tensor,  # [N, K] int64, padded with any valid id
    num_draft: torch.Tensor,  # [N] int64
    uniforms: torch.Tensor,  # [N, K] float32
    exp_noise: torch.Tensor,  # [N, V] float32
    greedy: torch.Tensor,  # [N] bool
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [N] int64, final_token [N] int64
    """The accept-and-resample step, one program per row; see the twin
    :func:`draftwise.kernels.reference.rejection_accept` for the rule."""
    n, k1, v = target_probs.shape
    k = k1 - 1
    assert target_probs.dtype == torch.float32 and target_probs.is_contiguous(), "target_probs: float32, contiguous"
    if draft_probs is not None:
        assert draft_probs.shape == (n, k, v), f"draft_probs must be [{n}, {k}, {v}], got {list(draft_probs.shape)}"
        assert draft_probs.dtype == torch.float32 and draft_probs.is_contiguous(), "draft_probs: float32, contiguous"
    assert draft_ids.shape == (n, k) and draft_ids.dtype == torch.int64 and draft_ids.is_contiguous()
    assert num_draft.shape == (n,) and num_draft.dtype == torch.int64 and num_draft.is_contiguous()
    assert uniforms.shape == (n, k) and uniforms.dtype == torch.float32 and uniforms.is_contiguous()
    assert exp_noise.shape == (n, v) and exp_noise.dtype == torch.float32 and exp_noise.is_contiguous()
    assert greedy.shape == (n,) and greedy.dtype == torch.bool and greedy.is_contiguous()
    num_accepted = torch.empty(n, dtype=torch.int64, device=target_probs.device)  # [N]
    final = torch.empty(n, dtype=torch.int64, device=target_probs.device)  # [N]
    if n == 0:
        return num_accepted, final
    has_q = draft_probs is not None and k > 0
    _rejection_accept_kernel[(n,)](
        target_probs,
        draft_probs if has_q else target_probs,
        draft_ids if k > 0 else num_draft,  # an empty tensor may have no storage to point at
        num_draft,
        uniforms if k > 0 else exp_noise,
        exp_noise,
        greedy,
        num_accepted,
        final,
        k,
        v,
        _F32_TINY,
        HAS_Q=has_q,
        BLOCK_V=min(triton.next_power_of_2(v), 1024),
    )
    return num_accepted, final
