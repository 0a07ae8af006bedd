"""The Triton kernels of ``kernels/triton_ops.py`` against their torch twins.

On a machine without a GPU they run in Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``, set by tests/conftest.py); with ``DRAFTWISE_TEST_CUDA=1`` they are
compiled and run on CUDA tensors. Shapes stay small so that the interpreter is fast.

- KV-cache write: block sizes 16 and 32, shuffled slots, k/v as strided views of a fused
  projection, slots of -1 left untouched (caches poisoned first, compared in full).
- RMSNorm fused with the residual add: float32 tight, float16 and bfloat16 to one rounding.
- Rejection sampler's accept-and-resample step: crafted p and q covering every edge case,
  random padded batches compared exactly, and ``rejection_sample`` (twin, then kernel)
  compared with a per-position implementation of the same rule and keyed randomness.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import pytest
import torch

from draftwise.kernels import dispatch, reference, triton_ops
from draftwise.worker.sampling.keyed_random import STREAM_ACCEPT, STREAM_SAMPLE, keyed_exponential, keyed_uniform
from draftwise.worker.speculative.rejection_sampler import RejectionOutput, rejection_sample

DEVICE = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")

# The interpreter runs the kernels' divisions in numpy, which warns where IEEE arithmetic
# gives inf or NaN on purpose (q = 0 < p accepts, 0 / 0 rejects).
pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning"
)


# ----------------------------------------------------------------------------- KV-cache write


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)],
)
def test_write_kv_cache_matches_twin(block_size: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(block_size)
    num_blocks, heads, kv_heads, d, t = 6, 4, 2, 8, 23
    # q, k, v split out of one fused projection, as the model does: k and v are strided views
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)  # [T, (H + 2 Hkv) D]
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)  # [T, Hkv, D]
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)  # [T, Hkv, D]
    assert not k.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]  # [T] shuffled, distinct
    skipped = torch.tensor([0, 5, 6, 17, 22])
    slots[skipped] = -1  # graph padding: these tokens must not be written anywhere
    poison = torch.full((num_blocks, block_size, kv_heads, d), 1234.5).to(cache_dtype)
    caches = {}
    for name, fn in (("twin", reference.write_kv_cache), ("triton", triton_ops.write_kv_cache)):
        kc, vc = poison.clone().to(DEVICE), (poison.clone() * -1).to(DEVICE)
        fn(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE), True)  # the batch holds padding
        caches[name] = (kc.cpu(), vc.cpu())
    assert torch.equal(caches["twin"][0], caches["triton"][0])
    assert torch.equal(caches["twin"][1], caches["triton"][1])
    kc, vc = caches["triton"]
    written = slots[slots >= 0]
    kept = torch.ones(num_blocks * block_size, dtype=torch.bool)
    kept[written] = False
    assert torch.equal(kc.view(-1, kv_heads, d)[written], k[slots >= 0].to(cache_dtype))
    assert torch.equal(vc.view(-1, kv_heads, d)[written], v[slots >= 0].to(cache_dtype))
    assert (kc.view(-1, kv_heads, d)[kept] == poison.flatten()[0]).all()
    assert (vc.view(-1, kv_heads, d)[kept] == -poison.flatten()[0]).all()


def test_write_kv_cache_all_padding_and_empty() -> None:
    kc = torch.zeros(2, 16, 1, 4, device=DEVICE)
    vc = torch.zeros(2, 16, 1, 4, device=DEVICE)
    k = torch.ones(3, 1, 4, device=DEVICE)
    for fn in (reference.write_kv_cache, triton_ops.write_kv_cache):
        fn(k, k, kc, vc, torch.full((3,), -1, dtype=torch.int64, device=DEVICE), True)
        fn(k[:0], k[:0], kc, vc, torch.zeros(0, dtype=torch.int64, device=DEVICE))
        fn(k[:0], k[:0], kc, vc, torch.zeros(0, dtype=torch.int64, device=DEVICE), True)
    assert not kc.any() and not vc.any()


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("hidden", [64, 96])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_matches_twin(hidden: int, with_residual: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hidden)
    wide = (torch.randn(7, hidden + 16, generator=g) * 3).to(dtype).to(DEVICE)
    x = wide[:, 8 : 8 + hidden]  # [7, hidden], rows strided as a slice of a wider tensor
    residual = (torch.randn(7, hidden, generator=g) * 3).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + torch.randn(hidden, generator=g) / 4).to(dtype).to(DEVICE)
    want, want_res = reference.rms_norm(x, weight, 1e-5, residual)
    got, got_res = triton_ops.rms_norm(x, weight, 1e-5, residual)
    assert got.dtype == dtype and got_res.dtype == dtype and got.shape == x.shape
    ulp = torch.finfo(dtype).eps
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        # Triton's interpreter truncates float32 -> bfloat16 where the GPU (and torch) round to
        # nearest even, so on CPU bfloat16 results agree to one rounding, not bit for bit.
        if residual is not None:
            s = (x.float() + residual.float()).view(torch.int32) & -65536  # truncated to bfloat16's bits
            assert torch.equal(got_res, s.view(torch.float32).to(dtype))
        torch.testing.assert_close(got_res.float(), want_res.float(), rtol=ulp, atol=0)
        torch.testing.assert_close(got.float(), want.float(), rtol=3 * ulp, atol=1e-6)
        return
    assert torch.equal(got_res, want_res)  # the residual sum is rounded exactly as torch's
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    else:  # the reduction's order may move the float32 value across one rounding boundary
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=1e-6)
        assert (got == want).float().mean() > 0.9


def test_model_rms_norm_runs_the_registered_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's RMSNorm module resolves its op through the dispatch point at ``bind``."""
    from draftwise.worker.model.llama import RMSNorm

    monkeypatch.setattr(dispatch, "_FAST", {})
    dispatch.register("rms_norm", DEVICE.type, "triton", triton_ops.rms_norm)
    norm = RMSNorm(32, 1e-6).to(DEVICE)
    norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    norm.bind(DEVICE)
    assert norm._impl is triton_ops.rms_norm
    x, r = torch.randn(3, 32, device=DEVICE), torch.randn(3, 32, device=DEVICE)
    for residual in (None, r):
        got, got_res = norm(x, residual)
        want, want_res = reference.rms_norm(x, norm.weight, 1e-6, residual)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        assert torch.equal(got_res, want_res)


# ----------------------------------------------------------------------------- rejection step

AcceptInputs = tuple[
    torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def run_both(inputs: AcceptInputs) -> tuple[list[int], list[int]]:
    """Run the twin and the kernel on the same inputs; they must agree exactly."""
    on_dev = tuple(None if t is None else t.to(DEVICE) for t in inputs)
    want_acc, want_final = reference.rejection_accept(*on_dev)
    got_acc, got_final = triton_ops.rejection_accept(*on_dev)
    assert got_acc.dtype == torch.int64 and got_final.dtype == torch.int64
    assert got_acc.tolist() == want_acc.tolist(), (got_acc, want_acc)
    assert got_final.tolist() == want_final.tolist(), (got_final, want_final)
    return want_acc.tolist(), want_final.tolist()


def pad_rows(
    rows: Sequence[tuple[list[list[float]], list[list[float]] | None, list[int], list[float], bool]],
    vocab: int,
    seed: int = 0,
) -> AcceptInputs:
    """Padded op inputs from per-row (p rows, q rows or None, draft ids, uniforms, greedy),
    with random garbage in the padding, which the op must ignore."""
    g = torch.Generator().manual_seed(seed)
    n, k = len(rows), max(len(r[2]) for r in rows)
    p = torch.rand(n, k + 1, vocab, generator=g)  # garbage past each row's k_i + 1
    has_q = rows[0][1] is not None
    q = torch.rand(n, k, vocab, generator=g) if has_q else None
    ids = torch.randint(vocab, (n, k), generator=g)
    u = torch.rand(n, k, generator=g) / 10  # garbage uniforms that would accept
    for i, (p_rows, q_rows, x, us, _) in enumerate(rows):
        p[i, : len(p_rows)] = torch.tensor(p_rows)
        if q is not None and q_rows:
            q[i, : len(q_rows)] = torch.tensor(q_rows)
        ids[i, : len(x)] = torch.tensor(x, dtype=torch.int64)
        u[i, : len(us)] = torch.tensor(us)
    num_draft = torch.tensor([len(r[2]) for r in rows], dtype=torch.int64)
    noise = torch.empty(n, vocab).exponential_(generator=g)
    greedy = torch.tensor([r[4] for r in rows], dtype=torch.bool)
    return p, q, ids, num_draft, u, noise, greedy


def test_rejection_accept_crafted_draft_distributions() -> None:
    flat = [1 / 6] * 6
    rows = [
        # p == q: always accepted, even with u close to 1; bonus from the last p
        ([flat, flat, flat, [0, 0, 0, 0, 1, 0]], [flat, flat, flat], [0, 3, 5], [0.999, 0.999, 0.999], False),
        # disjoint supports: p(x) = 0, rejected at once; the residual is p itself
        ([[0.5, 0.5, 0, 0, 0, 0], flat], [[0, 0, 0.5, 0.5, 0, 0]], [2], [0.0], False),
        # q(x) = 0 < p(x): infinite ratio, accepted
        ([[0.2, 0.2, 0.2, 0.2, 0.2, 0], [0, 0, 1, 0, 0, 0]], [[1, 0, 0, 0, 0, 0]], [1], [0.999], False),
        # one-hot p: accepted at x (ratio 2), then p(x) = 0 rejects; the residual keeps only token 0
        ([[0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0], flat], [[0, 0, 0, 0.5, 0.5, 0], flat], [3, 2], [0.999, 0.0], False),
        # p(x) = q(x) = 0: 0 / 0 is NaN, rejected
        ([[0, 0.5, 0.5, 0, 0, 0], flat], [[0, 0.5, 0.5, 0, 0, 0]], [0], [0.0], False),
        # empty residual (q >= p everywhere, a malformed q): falls back to p
        ([[0.25, 0.25, 0.25, 0.25, 0, 0], flat], [[0.5, 0.5, 0.5, 0.5, 0, 0]], [1], [0.9], False),
        # k = 0: one token from p
        ([[0, 0, 0, 0, 0, 1]], [], [], [], False),
        # greedy: accepted while x is argmax p (uniforms ignored), then argmax p
        ([[0, 1, 0, 0, 0, 0], [0, 0, 0.6, 0.4, 0, 0], [0.1, 0, 0, 0, 0.9, 0]], [flat, flat], [1, 3], [0.99, 0.0], True),
        # greedy on ties: the first index is the argmax
        ([flat, flat, flat], [flat, flat], [0, 1], [0.5, 0.5], True),
    ]
    acc, final = run_both(pad_rows(rows, vocab=6))
    assert acc == [3, 0, 1, 1, 0, 0, 0, 1, 1]
    assert final[0] == 4 and final[1] in (0, 1) and final[2] == 2 and final[3] == 0
    assert final[4] in (1, 2) and final[5] in (0, 1, 2, 3) and final[6] == 5 and final[7] == 2 and final[8] == 0


def test_rejection_accept_crafted_one_hot_draft() -> None:
    p = [0.1, 0.3, 0.0, 0.6]
    rows = [
        ([[0, 1, 0, 0], p], None, [1], [0.999], False),  # p(x) = 1: accepted
        ([p, p], None, [2], [0.0], False),  # p(x) = 0: rejected, drawn from p
        ([p, p, p], None, [3, 1], [0.5, 0.4], False),  # u < p(x) accepts, then 0.4 >= 0.3 rejects x = 1
        ([[0, 0, 0, 1], [0, 1, 0, 0], p], None, [3, 1], [0.2, 0.3], False),  # all accepted, bonus from p
        ([[0, 0, 1, 0]], None, [], [], False),  # k = 0
        ([p, p], None, [1], [0.0], True),  # greedy: x = 1 is not argmax (3)
    ]
    acc, final = run_both(pad_rows(rows, vocab=4, seed=1))
    assert acc == [1, 0, 1, 2, 0, 0]
    assert final[1] in (0, 1, 3) and final[2] in (0, 3) and final[4] == 2 and final[5] == 3
    # an unnormalised p with all its mass on the rejected draft: the empty residual falls back to p
    acc, final = run_both(pad_rows([([[0, 0.5, 0, 0], p], None, [1], [0.7], False)], vocab=4))
    assert acc == [0] and final == [1]
    # Exp(1) noise of exactly 0 is clamped to the smallest normal float, not left to divide by 0:
    # two such entries race by their weights (unclamped, both would be inf and the first would win)
    inputs = list(pad_rows([([p], None, [], [], False)], vocab=4))
    inputs[5] = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    assert run_both(tuple(inputs)) == ([0], [3])  # type: ignore[arg-type]
    # the recovered token never repeats the rejected draft: q is one-hot at it
    for seed in range(6):
        _, final = run_both(pad_rows([([p, p], None, [3], [0.99], False)] * 8, vocab=4, seed=seed))
        assert all(f in (0, 1) for f in final)


def random_padded(g: torch.Generator, n: int, k: int, vocab: int, with_q: bool) -> AcceptInputs:
    """A random batch with near-p drafts (so that acceptance varies), zeros in p and q,
    k_i from 0 to K and a third of the rows greedy."""
    p = torch.rand(n, k + 1, vocab, generator=g) ** 4
    p[torch.rand(p.shape, generator=g) < 0.2] = 0  # p(x) = 0 happens
    p = p / p.sum(-1, keepdim=True)
    q = None
    if with_q:
        q = p[:, :k] + torch.rand(n, k, vocab, generator=g) ** 4 / vocab
        q[torch.rand(q.shape, generator=g) < 0.1] = 0  # q(x) = 0 < p(x) happens
        q = q / q.sum(-1, keepdim=True)
    src = (q if q is not None else p[:, :k]).reshape(-1, vocab) + 1e-9
    ids = torch.multinomial(src, 1, generator=g).view(n, k)  # [N, K]
    greedy = torch.rand(n, generator=g) < 0.33
    best = p[:, :k].argmax(-1)  # greedy rows: follow the argmax for a while
    follow = greedy[:, None] & (torch.rand(n, k, generator=g) < 0.8)
    ids = torch.where(follow, best, ids)
    num_draft = torch.randint(0, k + 1, (n,), generator=g)
    u = torch.rand(n, k, generator=g)
    noise = torch.empty(n, vocab).exponential_(generator=g)
    noise[0, :3] = 0.0  # Exp(1) can be exactly 0: clamped, as the sampler does
    return p, q, ids, num_draft, u, noise, greedy


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("k,vocab", [(4, 37), (3, 1500), (0, 50)])
def test_rejection_accept_random_batches(with_q: bool, k: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(k * 1000 + vocab + with_q)
    seen_acc: set[int] = set()
    for _ in range(3):
        acc, _ = run_both(random_padded(g, 12, k, vocab, with_q))
        seen_acc.update(acc)
    if k:
        assert len(seen_acc) >= 3  # the batch exercised several acceptance lengths


def test_rejection_accept_argmax_ties_across_chunks() -> None:
    """Greedy argmax and the race keep the first index on ties, across vocabulary chunks."""
    vocab = 2100  # three chunks of 1024
    p = torch.zeros(vocab)
    p[[1500, 50, 2090]] = 1 / 3  # equal maxima in three chunks: the first one is the argmax
    rows = [
        ([p.tolist(), p.tolist()], None, [50], [0.0], True),
        ([p.tolist(), p.tolist()], None, [1500], [0.0], True),
    ]
    acc, final = run_both(pad_rows(rows, vocab))
    assert acc == [1, 0] and final == [50, 50]
    inputs = list(pad_rows([([p.tolist()], None, [], [], False)], vocab))
    inputs[5] = torch.full((1, vocab), 2.0)  # equal noise everywhere: the race ties too
    assert run_both(tuple(inputs))[1] == [50]  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- rejection_sample


def legacy_rejection_sample(
    target_probs: torch.Tensor,  # [sum(k_i + 1), vocab]
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,  # [sum(k_i), vocab]
    greedy: Sequence[bool],
    seeds: Sequence[int | None],
    positions: Sequence[int],
) -> RejectionOutput:
    """The implementation ``rejection_sample`` had before the padded op (its general path),
    with the keyed randomness drawn per request and position: U(seed, position + j) for the
    accept test of draft j, E(seed, final position) for the final race. The reference the
    op-based version must reproduce exactly."""
    ks = [len(d) for d in draft_token_ids]
    n = len(ks)
    device = target_probs.device
    t_start = [sum(ks[:i]) + i for i in range(n)]
    d_start = [sum(ks[:i]) for i in range(n)]
    num_accepted = [0] * n
    if max(ks) > 0:
        flat_ids = torch.tensor([int(t) for ids in draft_token_ids for t in ids], dtype=torch.int64)
        t_rows = torch.tensor([t_start[i] + j for i in range(n) for j in range(ks[i])], dtype=torch.int64)
        p_x = target_probs[t_rows, flat_ids]
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[torch.arange(len(flat_ids)), flat_ids]
        uniforms = torch.zeros_like(p_x)
        for i in range(n):
            if ks[i] > 0 and not greedy[i]:
                for j in range(ks[i]):
                    uniforms[d_start[i] + j] = float(
                        keyed_uniform([seeds[i]], [positions[i] + j], STREAM_ACCEPT, 1, device)[0, 0]  # type: ignore[list-item]
                    )
        accept = (uniforms < p_x / q_x).tolist()
        best = target_probs[t_rows].argmax(-1).tolist()
        for i in range(n):
            a = 0
            while a < ks[i]:
                pos = d_start[i] + a
                ok = flat_ids[pos].item() == best[pos] if greedy[i] else accept[pos]
                if not ok:
                    break
                a += 1
            num_accepted[i] = a
    weights = target_probs[torch.tensor([t_start[i] + num_accepted[i] for i in range(n)])].clone()
    p_final = weights.clone()
    for i in range(n):
        if num_accepted[i] < ks[i] and not greedy[i]:
            if draft_probs is None:
                residual = weights[i].clone()
                residual[int(draft_token_ids[i][num_accepted[i]])] = 0.0
            else:
                residual = (weights[i] - draft_probs[d_start[i] + num_accepted[i]]).clamp_min(0.0)
            if residual.sum() > 0:
                weights[i] = residual
    noise = torch.ones_like(weights)
    for i in range(n):
        if not greedy[i]:
            noise[i] = keyed_exponential(
                [seeds[i]], [positions[i] + num_accepted[i]], STREAM_SAMPLE, weights.shape[1], device
            )[0]  # type: ignore[list-item]
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    final = (weights / noise).argmax(-1).tolist()
    for i in range(n):
        if greedy[i]:
            final[i] = int(p_final[i].argmax())
    token_ids = [[int(t) for t in draft_token_ids[i][: num_accepted[i]]] + [final[i]] for i in range(n)]
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)


def random_flat_batches(seed: int, count: int) -> Iterator[tuple]:
    """Flat rejection_sample inputs: ragged k_i (uniform k in some), mixed greedy, q or None."""
    g = torch.Generator().manual_seed(seed)
    for b in range(count):
        n, vocab = int(torch.randint(1, 9, (), generator=g)), int(torch.randint(3, 40, (), generator=g))
        ks = [3] * n if b % 4 == 0 else torch.randint(0, 5, (n,), generator=g).tolist()
        p = (torch.rand(sum(ks) + n, vocab, generator=g) ** 3).softmax(-1) if b % 2 else torch.rand(sum(ks) + n, vocab)
        p[torch.rand(p.shape, generator=g) < 0.15] = 0
        p = p / p.sum(-1, keepdim=True)
        q = (torch.rand(sum(ks), vocab, generator=g) ** 3).softmax(-1) if b % 3 else None
        if q is not None and b % 5 == 1:  # a malformed q above p everywhere: every residual is empty
            q = 2 * p[torch.tensor([sum(ks[:i]) + i + j for i in range(n) for j in range(ks[i])], dtype=torch.int64)]
        drafts = [torch.randint(vocab, (k,), generator=g).tolist() for k in ks]
        greedy = (torch.rand(n, generator=g) < 0.3).tolist()
        greedy[0] = False  # at least one sampling row: the general path
        yield p, drafts, q, greedy, [1000 * b + i for i in range(n)], torch.randint(0, 3000, (n,), generator=g).tolist()


def check_against_legacy(seed: int, count: int) -> None:
    outcomes = set()
    for p, drafts, q, greedy, seeds, positions in random_flat_batches(seed, count):
        row_seeds = [None if gr else s for gr, s in zip(greedy, seeds, strict=True)]
        p, q = p.to(DEVICE), None if q is None else q.to(DEVICE)
        new = rejection_sample(p, drafts, q, greedy, row_seeds, positions)
        old = legacy_rejection_sample(p, drafts, q, greedy, row_seeds, positions)
        assert new == old
        outcomes.update(new.num_accepted)
    assert len(outcomes) >= 3


def test_rejection_sample_with_the_twin_matches_the_previous_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_FAST", {})
    assert dispatch.impl("rejection_accept", DEVICE) is reference.rejection_accept
    check_against_legacy(seed=3, count=40)


def test_rejection_sample_with_the_kernel_matches_the_previous_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_FAST", {})
    dispatch.register("rejection_accept", DEVICE.type, "triton", triton_ops.rejection_accept)
    assert dispatch.impl("rejection_accept", DEVICE) is triton_ops.rejection_accept
    check_against_legacy(seed=4, count=12)


# ----------------------------------------------------------------------------- compiled mode

# Compiles every kernel for an sm_90 target (Triton's front end, LLVM and the ptxas bundled
# with triton; no GPU needed). The interpreter accepts some code that compiled mode rejects.
