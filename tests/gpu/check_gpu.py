"""The one GPU check: kernels compiled for real against their twins, CUDA-graph replay
against eager execution, and the timings that say whether graphs and kernels pay.

    python tests/gpu/check_gpu.py               # on a CUDA machine, a few minutes
    python tests/gpu/check_gpu.py --dry-run     # anywhere: tiny shapes, CPU, Triton interpreter
    python tests/gpu/check_gpu.py --json out.json

Sections (each failure becomes a FAIL row; nothing here crashes the run):

1. kernels: every Triton kernel (paged decode and prefill/verify attention, KV write,
   RMSNorm + residual, rejection accept) against its torch twin, bfloat16 and float16,
   fresh random inputs, outputs poisoned (NaN) before each run;
2. graphs: every captured shape (decode shapes, and flat shapes of a token bucket for
   verify steps) replayed with a step padded into it gives the logits and KV cache of
   ``ModelRunner.run`` (float32); greedy tokens of ``LLM(device="cuda")`` with graphs equal
   those with ``enforce_eager=True``, for every batch-size bucket, speculation off and on
   (draft model and n-gram), on the embedded default models;
3. serving: 64 mixed requests with n-gram speculation: no Triton compilation while serving,
   the graphs' padding waste, the memory profile against the serving peak; seeded sampling
   identical alone and in batches of 8 and 64; tensor parallelism (``check_tp.py``): TP=2
   greedy equals one device, each rank with its graphs (needs >= 2 CUDA devices; says so
   otherwise);
4. timings: the decode step at batch 1, 8 and 64, eager against graphs; decode attention's
   achieved bandwidth on long contexts against a measured device-to-device copy;
   end-to-end output tokens/s and steps/s of a random ~1B Llama built here (nothing
   downloaded) at batch 1, 8 and 64, with and without speculation.

A short table comes last. The exit status is 1 when a correctness check failed; timing
goals (graphs >= 2x eager at batch 1, decode attention >= 70% of copy bandwidth) are
reported, never asserted. ``--dry-run`` runs every section on CPU with tiny shapes (the
kernels under ``TRITON_INTERPRET=1``, graph replay stood in for by the graph runner's
eager path) so that CI keeps this script working without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Row:
    """One line of the summary table."""

    section: str
    check: str
    result: str
    goal: str = ""
    ok: bool | None = None  # a correctness check passed / failed; None: a measurement
    goal_met: bool | None = None  # a measurement against its (performance) goal; never fails the run


@dataclass(frozen=True)
class Ctx:
    """Sizes of one run: the real ones on CUDA, tiny ones for --dry-run."""

    device: torch.device
    dry: bool
    dtypes: tuple[torch.dtype, ...]
    heads: tuple[int, int, int]  # query heads, KV heads, head dim (attention checks)
    max_context: int  # longest context in the kernel checks
    graph_max_seqs: int  # largest batch-size bucket in the graph check
    graph_tokens: int  # tokens generated per request in the graph check
    decode_batches: tuple[int, ...]  # batches of the decode-step timing
    decode_context: int  # context length of the decode-step timing
    timed_steps: int
    bandwidth_shapes: tuple[tuple[int, int], ...]  # (sequences, context) of the attention bandwidth rows
    e2e_batches: tuple[int, ...]  # requests per end-to-end run
    e2e_tokens: int  # output tokens per request end to end
    llama: dict[str, int]  # LlamaConfig fields of the random model


def make_ctx(dry: bool) -> Ctx:
    if dry:
        return Ctx(
            device=torch.device("cpu"),
            dry=True,
            dtypes=(torch.float32,),
            heads=(4, 2, 16),
            max_context=80,
            graph_max_seqs=4,
            graph_tokens=6,
            decode_batches=(1, 8),
            decode_context=24,
            timed_steps=2,
            bandwidth_shapes=((2, 64),),
            e2e_batches=(1, 4),
            e2e_tokens=8,
            llama=dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=512,
            ),
        )
    return Ctx(
        device=torch.device("cuda"),
        dry=False,
        dtypes=(torch.bfloat16, torch.float16),
        heads=(32, 8, 128),
        max_context=3000,
        graph_max_seqs=64,
        graph_tokens=24,
        decode_batches=(1, 8, 64),
        decode_context=512,
        timed_steps=50,
        bandwidth_shapes=((16, 16384), (64, 4096)),
        e2e_batches=(1, 8, 64),
        e2e_tokens=128,
        llama=dict(  # TinyLlama-1.1B's shape: 1.1 B parameters
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
        ),
    )


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _poison_allocator(dev: torch.device, nbytes: int = 64 << 20) -> None:
    """Fill freed device memory with NaN, so that outputs a kernel allocates and fails to
    write read back as NaN instead of as stale correct values."""
    if dev.type == "cuda":
        junk = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device=dev)
        del junk


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference, relative to the largest value wanted (at least 1); NaN stays NaN."""
    if not got.numel():
        return 0.0
    scale = max(1.0, float(want.float().abs().max()))
    return float((got.float() - want.float()).abs().max()) / scale


def _worse(a: float, b: float) -> float:
    """max() that keeps NaN (Python's max drops it when it comes second)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


# a few roundings of the dtype: twin and kernel round at different points
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------- 1. kernels


def _paged_case(ctx: Ctx, dtype: torch.dtype, block_size: int, query_lens: Sequence[int], seed: int) -> dict[str, Any]:
    """A shuffled paged cache holding random contexts (some crossing block and partition
    boundaries) and the metadata of ``query_lens`` new tokens per sequence."""
    from draftwise.kernels import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    h, hkv, d = ctx.heads
    seq_lens = [max(q, rng.randint(1, ctx.max_context)) for q in query_lens]
    seq_lens[0] = max(query_lens[0], ctx.max_context)  # the longest crosses every split
    if len(seq_lens) > 1:
        seq_lens[1] = max(query_lens[1], block_size + 1)  # just past one block
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(need) + 2))
    rng.shuffle(pool)
    tables, i = [], 0
    for n in need:
        tables.append(pool[i : i + n])
        i += n
    k_cache = torch.randn(len(pool), block_size, hkv, d, generator=g).to(ctx.device, dtype)
    v_cache = torch.randn(len(pool), block_size, hkv, d, generator=g).to(ctx.device, dtype)
    meta = AttentionMetadata.build(
        query_lens=list(query_lens), seq_lens=seq_lens, block_tables=tables, block_size=block_size, device=ctx.device
    )
    q = torch.randn(meta.num_tokens, h, d, generator=g).to(ctx.device, dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, meta=meta, scale=d**-0.5)


def _nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def check_attention(ctx: Ctx, rows: list[Row]) -> None:
    from draftwise.kernels import reference
    from draftwise.kernels.triton_attention import paged_decode_attention, paged_prefill_attention

    rng = random.Random(0)
    for dtype in ctx.dtypes:
        for block_size in (16, 32):
            worst = {"decode": 0.0, "prefill/verify": 0.0}
            for seed in range(2):
                n = 6 if ctx.dry else 24
                c = _paged_case(ctx, dtype, block_size, [1] * n, seed)
                m = c["meta"]
                want = reference.paged_attention(c["q"], c["k_cache"], c["v_cache"], m, c["scale"])
                got = paged_decode_attention(
                    c["q"], c["k_cache"], c["v_cache"], m.block_tables, m.seq_lens, c["scale"], out=_nan_like(c["q"])
                )
                worst["decode"] = _worse(worst["decode"], _err(got, want))
                qlens = [1, 2, 4, 6, 40] + [rng.randint(1, 8) for _ in range(n - 5)]  # decode, verify, a chunk
                c = _paged_case(ctx, dtype, block_size, qlens, 100 + seed)
                m = c["meta"]
                want = reference.paged_attention(c["q"], c["k_cache"], c["v_cache"], m, c["scale"])
                got = paged_prefill_attention(
                    c["q"],
                    c["k_cache"],
                    c["v_cache"],
                    m.block_tables,
                    m.seq_lens,
                    m.query_start_loc,
                    m.max_query_len,
                    c["scale"],
                    out=_nan_like(c["q"]),
                )
                worst["prefill/verify"] = _worse(worst["prefill/verify"], _err(got, want))
            for kind, err in worst.items():
                ok = err <= TOL[dtype]  # NaN (an unwritten output) compares False
                rows.append(
                    Row(
                        "kernels",
                        f"attention {kind} {_name(dtype)} bs{block_size}",
                        f"rel err {err:.2e}",
                        f"<= {TOL[dtype]:.0e}",
                        ok,
                    )
                )


def check_write_kv(ctx: Ctx, rows: list[Row]) -> None:
    from draftwise.kernels import reference, triton_ops

    _, hkv, d = ctx.heads
    for dtype in ctx.dtypes:
        for block_size in (16, 32):
            g = torch.Generator().manual_seed(block_size)
            num_blocks, t = 8, 40
            slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
            slots[::7] = -1  # padding tokens: nothing written
            k = torch.randn(t, hkv, d, generator=g).to(ctx.device, dtype)
            v = torch.randn(t, hkv, d, generator=g).to(ctx.device, dtype)
            slots = slots.to(ctx.device)
            caches = [torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=ctx.device)]
            caches = [caches[0].clone() for _ in range(4)]
            reference.write_kv_cache(k, v, caches[0], caches[1], slots, True)
            triton_ops.write_kv_cache(k, v, caches[2], caches[3], slots)
            same = all(
                torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
                for a, b in ((caches[0], caches[2]), (caches[1], caches[3]))
            )
            rows.append(
                Row(
                    "kernels",
                    f"write_kv_cache {_name(dtype)} bs{block_size}",
                    "identical" if same else "DIFFERS",
                    "bitwise",
                    same,
                )
            )


def check_rms_norm(ctx: Ctx, rows: list[Row]) -> None:
    from draftwise.kernels import reference, triton_ops

    hidden = 256 if ctx.dry else 4096
    for dtype in ctx.dtypes:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(37, hidden, generator=g).to(ctx.device, dtype)
        res = torch.randn(37, hidden, generator=g).to(ctx.device, dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(ctx.device, dtype)
        want_n, want_r = reference.rms_norm(x, w, 1e-5, res)
        _poison_allocator(ctx.device)
        got_n, got_r = triton_ops.rms_norm(x, w, 1e-5, res)
        err = _worse(_err(got_n, want_n), _err(got_r, want_r))
        tol = TOL[dtype]
        rows.append(
            Row("kernels", f"rms_norm+residual {_name(dtype)}", f"rel err {err:.2e}", f"<= {tol:.0e}", err <= tol)
        )


def check_rejection(ctx: Ctx, rows: list[Row]) -> None:
    from draftwise.kernels import reference, triton_ops

    g = torch.Generator().manual_seed(2)
    n, k, vocab = (6, 3, 64) if ctx.dry else (64, 5, 32000)
    p = torch.softmax(3 * torch.randn(n, k + 1, vocab, generator=g), -1)
    q = torch.softmax(3 * torch.randn(n, k, vocab, generator=g), -1)
    ids = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(n, k)
    ids[: n // 2] = p[: n // 2, :k].argmax(-1)  # some drafts the target agrees with
    num_draft = torch.randint(0, k + 1, (n,), generator=g)
    u = torch.rand(n, k, generator=g)
    e = torch.empty(n, vocab).exponential_(generator=g)
    greedy = torch.arange(n) % 3 == 0
    ok = True
    for with_q in (True, False):
        args = [t.to(ctx.device) for t in (p, q, ids, num_draft, u, e, greedy)]
        if not with_q:
            args[1] = None
        want = reference.rejection_accept(*args)
        _poison_allocator(ctx.device)
        got = triton_ops.rejection_accept(*args)
        ok &= all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(want, got, strict=True))
    rows.append(
        Row("kernels", "rejection_accept float32 (draft q, n-gram)", "identical" if ok else "DIFFERS", "exact", ok)
    )


def check_dispatch(ctx: Ctx, rows: list[Row]) -> None:
    from draftwise.kernels import dispatch

    picked = {op: dispatch.backend_name(op, ctx.device) for op in dispatch.OPS}
    want = "torch" if ctx.dry else "triton"
    ok = all(v == want for v in picked.values())
    rows.append(Row("kernels", f"dispatch on {ctx.device.type}", ", ".join(sorted(set(picked.values()))), want, ok))


# ---------------------------------------------------------------- 2. graphs against eager


def _attach_stand_ins(llm: Any) -> None:
    """CPU only: give the engine's runners graph runners that run the padded static-buffer
    path eagerly, what ``enable_graphs`` captures on CUDA."""
    from draftwise.worker.model.graph_runner import GraphRunner
    from draftwise.worker.model.graph_shapes import GraphConfig

    eng = llm.engine
    k = eng.config.max_draft_tokens
    runners = [(eng.runner, 1 + k)]
    if eng.proposer is not None:
        runners.append((eng.proposer.runner, 2))
    for r, q in runners:
        r.graph_runner = GraphRunner(
            r.model, r.kv_cache, r.backend, GraphConfig.for_steps(eng.config.max_num_seqs, q), use_graphs=False
        )


def _graph_runners(llm: Any) -> list[Any]:
    eng = llm.engine
    runners = [eng.runner] + ([eng.proposer.runner] if eng.proposer is not None else [])
    return [r.graph_runner for r in runners if r.graph_runner is not None]


def _step_for_shape(shapes: Sequence[Any], shape: Any, rng: random.Random) -> list[int] | None:
    """Tokens per sequence of a random step that ``choose_shape`` puts in ``shape`` (None when
    200 draws found none)."""
    from draftwise.worker.model.graph_shapes import choose_shape

    b, t, q = shape
    for _ in range(200):
        s = rng.randint(max(1, b // 2), b)
        lens = [1] * s
        if q > 1:
            extra = rng.randint(1, max(1, min(t, s * q) - s))
            for _ in range(extra):
                i = rng.randrange(s)
                if lens[i] < q:
                    lens[i] += 1
        if choose_shape(shapes, s, sum(lens), max(lens)) == shape:
            return lens
    return None


def check_replay_logits(ctx: Ctx, rows: list[Row]) -> None:
    """Every captured shape (decode shapes, and flat shapes of a token bucket for verify
    steps), replayed with a random step padded into it, against ModelRunner.run eagerly on an
    identical KV cache (float32 target model)."""
    from draftwise.worker import default_model_path
    from draftwise.worker.model.graph_runner import GraphRunner
    from draftwise.worker.model.graph_shapes import GraphConfig
    from draftwise.worker.model.kv_cache import KVCache
    from draftwise.worker.model.loader import load_model
    from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk

    loaded = load_model(default_model_path("target"), dtype="float32", device=ctx.device)
    n, bs, per_seq = ctx.graph_max_seqs, 16, 32  # 512 tokens of context per sequence at most
    caches = [KVCache(loaded.config, n * per_seq, bs, torch.float32, ctx.device) for _ in range(2)]
    for c in caches:  # identical random contents: a stray write shows up below
        torch.manual_seed(5)
        c.k.normal_()
        c.v.normal_()
    eager, graphed = ModelRunner(loaded, caches[0]), ModelRunner(loaded, caches[1])
    config = GraphConfig.for_steps(n, 4, max_model_len=per_seq * bs)
    if ctx.dry:
        graphed.graph_runner = GraphRunner(loaded.model, caches[1], graphed.backend, config, use_graphs=False)
    else:
        graphed.enable_graphs(config)
    gr = graphed.graph_runner
    if gr is None:
        rows.append(Row("graphs", "replay == eager logits, every shape", "no graphs captured", "", False))
        return
    rng = random.Random(6)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
    lens = [rng.randint(5, 40) for _ in range(n)]
    prompts = [
        SequenceChunk([rng.randrange(3, 8000) for _ in range(m)], 0, t) for m, t in zip(lens, tables, strict=True)
    ]
    for r in (eager, graphed):
        r.run(prompts)  # prompt chunks: eager on both
    worst, same, total, missed, unplanned = 0.0, 0, 0, 0, 0
    for shape in gr.shapes:
        step = _step_for_shape(gr.shapes, shape, rng)
        if step is None:
            unplanned += 1
            continue
        chunks = []
        for i, m in enumerate(step):
            chunks.append(SequenceChunk([rng.randrange(3, 8000) for _ in range(m)], lens[i], tables[i], m))
            lens[i] += m
        want = eager.run(chunks)
        before = gr.num_replays
        got = graphed.run(chunks)
        missed += gr.num_replays != before + 1
        worst = _worse(worst, _err(got, want))
        same += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += want.shape[0]
    cache_err = _worse(_err(caches[1].k, caches[0].k), _err(caches[1].v, caches[0].v))
    ok = missed == 0 and unplanned == 0 and worst <= 1e-3 and cache_err <= 1e-4
    rows.append(
        Row(
            "graphs",
            f"replay == eager logits, {len(gr.shapes)} shapes",
            f"rel err {worst:.1e}, argmax {same}/{total}, KV err {cache_err:.1e}, {missed} not replayed, "
            f"{unplanned} without a step",
            "<= 1e-3",
            ok,
        )
    )


def check_graphs(ctx: Ctx, rows: list[Row]) -> None:
    from draftwise.worker import LLM, SamplingParams
    from draftwise.worker.model.graph_shapes import batch_size_buckets

    buckets = batch_size_buckets(ctx.graph_max_seqs)
    sizes = sorted(set(buckets) | {b - 1 for b in buckets if b > 2})  # exactly a bucket, and padded up to one
    specs: list[tuple[str, dict[str, Any]]] = [
        ("spec off", {}),
        ("spec draft k=3", dict(speculative_model="default", num_speculative_tokens=3)),
        ("spec ngram k=4", dict(speculative_method="ngram", num_speculative_tokens=4)),
        ("spec eagle k=4", dict(speculative_method="eagle", num_speculative_tokens=4)),  # the shipped heads
        ("spec medusa k=3", dict(speculative_method="medusa", num_speculative_tokens=3)),
    ]
    dtypes = ["float32"] if ctx.dry else ["float32", "bfloat16"]
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 8000) for _ in range(rng.randint(4, 40))] for _ in range(max(sizes))]
    params = SamplingParams(temperature=0, max_tokens=ctx.graph_tokens, ignore_eos=True)
    for dtype in dtypes:
        for label, spec in specs:
            kw = dict(
                device=ctx.device.type,
                dtype=dtype,
                max_num_seqs=ctx.graph_max_seqs,
                max_model_len=512,
                kv_cache_memory_bytes=256 << 20,
                **spec,
            )
            eager = LLM(enforce_eager=True, **kw)
            graphed = LLM(enforce_eager=False, **kw)
            if ctx.dry:
                _attach_stand_ins(graphed)
            grs = _graph_runners(graphed)
            captured = sum(g.num_graphs for g in grs) if not ctx.dry else len(grs)
            same = total = 0
            mismatched: list[int] = []
            for n in sizes:
                a = eager.generate(prompts[:n], params, use_tqdm=False)
                b = graphed.generate(prompts[:n], params, use_tqdm=False)
                total += n
                ok_n = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b, strict=True))
                same += ok_n
                if ok_n != n:
                    mismatched.append(n)
            replays = sum(g.num_replays for g in grs)
            strict = dtype == "float32"
            ok = bool(captured) and replays > 0 and (same == total or not strict)
            detail = f"{same}/{total} identical, {captured} {'stand-ins' if ctx.dry else 'graphs'}, {replays} replays"
            if mismatched:
                detail += f"; differ at batch {mismatched[:4]}"
            rows.append(
                Row("graphs", f"replay == eager {label} {dtype}", detail, "all identical" if strict else "info", ok)
            )
            del eager, graphed
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()


# ---------------------------------------------------------------- 3. serving (the hot path under load)


class _CompileCounter:
    """Triton compilations while it is installed (on CUDA; the interpreter compiles nothing)."""

    def __init__(self) -> None:
        self.count = 0
        self._old: Any = None

    def _hook(self, *args: Any, **kwargs: Any) -> None:
        self.count += 1

    def __enter__(self) -> _CompileCounter:
        from triton import knobs

        self._old = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = self._old


def _mixed_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of 4 to 300 tokens, most of them repeating a motif (n-gram drafts find
    matches), some random (drafts are rejected)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([4, 30, 90, 300])
        if i % 3 == 2:
            out.append([1] + [rng.randrange(3, 8000) for _ in range(length)])
        else:
            motif = [rng.randrange(3, 8000) for _ in range(rng.randint(3, 12))]
            out.append([1] + (motif * length)[:length])
    return out


def check_serving(ctx: Ctx, rows: list[Row]) -> None:
    """The default target with n-gram speculation (k = 5) serving a mixed batch, greedy and
    seeded requests: no Triton compilation after start-up; how much of the graphs' work was
    padding; the memory profile against the peak serving reached."""
    from draftwise.worker import LLM, SamplingParams

    n = ctx.graph_max_seqs
    kw: dict[str, Any] = dict(
        device=ctx.device.type,
        dtype="float32" if ctx.dry else "bfloat16",
        max_num_seqs=n,
        max_model_len=1024,
        speculative_method="ngram",
        num_speculative_tokens=5,
    )
    if ctx.dry:
        kw["kv_cache_memory_bytes"] = 64 << 20
    llm = LLM(**kw)
    eng = llm.engine
    if ctx.dry:
        _attach_stand_ins(llm)
    prompts = _mixed_prompts(n, 7)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=ctx.graph_tokens, ignore_eos=True)
        for i in range(n)
    ]
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with _CompileCounter() as compiles:
        llm.generate(prompts, params, use_tqdm=False)
    if ctx.dry:
        rows.append(
            Row("serving", "compile-free serving", "n/a on CPU (tests/engine/test_kernel_warm_up.py)", "0", None)
        )
    else:
        rows.append(
            Row(
                "serving",
                "compile-free serving",
                f"{compiles.count} Triton compilations while serving (warm-up {eng.kernel_warm_up_seconds:.1f}s, "
                f"capture {eng.graph_capture_seconds:.1f}s)",
                "0",
                compiles.count == 0,
            )
        )
    gr = eng.runner.graph_runner
    if gr is not None and gr.padded_tokens:
        waste = 1 - gr.real_tokens / gr.padded_tokens
        rows.append(
            Row(
                "serving",
                "graph padding waste (target)",
                f"{gr.real_tokens} real of {gr.padded_tokens} tokens run ({waste:.0%} padding), {gr.num_replays} replays",
                "info",
                None,
            )
        )
    from draftwise.worker.model.graph_shapes import GraphConfig, choose_shape

    shapes = GraphConfig.for_steps(256, 6, max_num_tokens=2048).shapes
    b, t, _ = choose_shape(shapes, 129, 134, 6) or (0, 0, 0)
    rows.append(
        Row("serving", "128 decodes + one verify of 6", f"run as {t} tokens (per-sequence padding: {b * 6})", "info")
    )
    prof = eng.memory_profile
    if prof is not None and ctx.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(ctx.device)
        _, total = torch.cuda.mem_get_info(ctx.device)
        limit = int(total * eng.config.gpu_memory_utilization)
        peaks = ", ".join(f"{k} {v >> 20}" for k, v in prof.peaks.items())
        rows.append(
            Row(
                "serving",
                "memory profile",
                f"probes MiB: {peaks}; graph pool {prof.graph_pool >> 20}; serving peak {peak >> 20} of {limit >> 20} MiB",
                "peak <= budget",
                peak <= limit,
            )
        )
    del llm
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def check_seeded_batch_invariance(ctx: Ctx, rows: list[Row]) -> None:
    """Seeded sampled requests give the same tokens alone and inside batches of every size
    (randomness is keyed by seed and position), speculation off and on."""
    from draftwise.worker import LLM, SamplingParams

    n = ctx.graph_max_seqs
    prompts = _mixed_prompts(n, 11)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=ctx.graph_tokens) for i in range(n)]
    sizes = sorted({1, min(8, n), n})
    for label, spec in (("spec off", {}), ("n-gram k=4", dict(speculative_method="ngram", num_speculative_tokens=4))):
        # float32: other batch shapes round differently, and bfloat16 could flip a near-tie
        # for reasons that are not the sampler's
        kw: dict[str, Any] = dict(device=ctx.device.type, dtype="float32", max_num_seqs=n, max_model_len=1024)
        if ctx.dry:
            kw["kv_cache_memory_bytes"] = 64 << 20
        llm = LLM(**kw, **spec)
        if ctx.dry:
            _attach_stand_ins(llm)
        alone = [llm.generate([prompts[i]], params[i], use_tqdm=False)[0].outputs[0].token_ids for i in range(4)]
        same = total = 0
        for size in sizes:
            outs = llm.generate(prompts[:size], params[:size], use_tqdm=False)
            for i in range(min(4, size)):
                same += outs[i].outputs[0].token_ids == alone[i]
                total += 1
        rows.append(
            Row(
                "serving",
                f"seeded sampling, batch {'/'.join(map(str, sizes))} == alone, {label}",
                f"{same}/{total} identical",
                "all",
                same == total,
            )
        )
        del llm
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- 4. timings


def build_random_llama(ctx: Ctx, folder: Path) -> Path:
    """A randomly initialised Llama saved as a Hugging Face checkpoint (bfloat16 on CUDA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **ctx.llama,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16 if not ctx.dry else torch.float32)
    model.save_pretrained(folder)
    del model
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return folder


def _time_steps(ctx: Ctx, fn: Callable[[], Any], steps: int) -> float:
    """Median seconds of ``fn`` (which must end with a host read, as an engine step does)."""
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_device(ctx: Ctx, fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call of ``fn`` launched back to back, timed by CUDA events (on CPU: the
    wall clock), so that launch gaps do not count against a kernel's bandwidth."""
    fn()
    _sync(ctx.device)
    if ctx.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def time_decode_steps(ctx: Ctx, folder: Path, rows: list[Row]) -> None:
    from draftwise.worker.model.graph_runner import GraphRunner
    from draftwise.worker.model.graph_shapes import GraphConfig
    from draftwise.worker.model.kv_cache import KVCache
    from draftwise.worker.model.loader import load_model
    from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk

    dtype = "float32" if ctx.dry else "bfloat16"
    loaded = load_model(folder, dtype=dtype, device=ctx.device)
    bs, n = 16, max(ctx.decode_batches)
    per_seq = -(-(ctx.decode_context + 1) // bs)
    cache = KVCache(loaded.config, n * per_seq, bs, loaded.dtype, ctx.device)
    eager = ModelRunner(loaded, cache)
    graphed = ModelRunner(loaded, cache)
    cfg = GraphConfig(batch_sizes=tuple(sorted(ctx.decode_batches)))
    if ctx.dry:
        graphed.graph_runner = GraphRunner(loaded.model, cache, graphed.backend, cfg, use_graphs=False)
    else:
        graphed.enable_graphs(cfg)
    if graphed.graph_runner is None:
        rows.append(Row("timings", "decode step graphs", "no graphs captured", "", False))
        return
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
    for i in range(0, n, 8):  # the contexts, eagerly
        eager.run([SequenceChunk([1 + (j % 500) for j in range(ctx.decode_context)], 0, t) for t in tables[i : i + 8]])
    for b in ctx.decode_batches:
        chunks = [SequenceChunk([7], ctx.decode_context, t) for t in tables[:b]]
        e = _time_steps(ctx, lambda c=chunks: eager.run(c).argmax(-1).tolist(), ctx.timed_steps)
        g = _time_steps(ctx, lambda c=chunks: graphed.run(c).argmax(-1).tolist(), ctx.timed_steps)
        goal = ">= 2x at batch 1" if b == 1 else ""
        met = (g * 2 <= e) if b == 1 and not ctx.dry else None
        rows.append(
            Row(
                "timings",
                f"decode step batch {b} ({dtype}, ctx {ctx.decode_context})",
                f"eager {1e3 * e:.2f} ms, graph {1e3 * g:.2f} ms, {e / g:.2f}x",
                goal,
                goal_met=met,
            )
        )


def _copy_bandwidth(ctx: Ctx) -> float:
    """Bytes per second of a device-to-device copy (read + write), the roofline we compare to."""
    n = (8 << 20) if ctx.dry else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    t = _time_device(ctx, lambda: dst.copy_(src), 5 if ctx.dry else 20)
    return 2 * n / t


def time_attention_bandwidth(ctx: Ctx, rows: list[Row]) -> None:
    from draftwise.kernels.triton_attention import paged_decode_attention

    copy_bw = _copy_bandwidth(ctx)
    rows.append(Row("timings", "device copy bandwidth", f"{copy_bw / 1e9:.0f} GB/s", "", None))
    h, hkv, d = ctx.heads
    dtype = torch.float32 if ctx.dry else torch.bfloat16
    bs = 16
    for s, ctx_len in ctx.bandwidth_shapes:
        nb = -(-ctx_len // bs)
        k_cache = torch.randn(s * nb, bs, hkv, d, device=ctx.device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(s * nb, device=ctx.device)
        tables = perm.view(s, nb).to(torch.int32)
        seq_lens = torch.full((s,), ctx_len, dtype=torch.int32, device=ctx.device)
        q = torch.randn(s, h, d, device=ctx.device, dtype=dtype)
        out = torch.empty_like(q)
        args = (q, k_cache, v_cache, tables, seq_lens, d**-0.5)

        def attend(a: tuple[Any, ...] = args, o: torch.Tensor = out) -> None:
            paged_decode_attention(*a, out=o)

        t = _time_device(ctx, attend, 3 if ctx.dry else 20)
        bw = 2 * s * ctx_len * hkv * d * k_cache.element_size() / t
        met = (bw >= 0.7 * copy_bw) if not ctx.dry else None
        rows.append(
            Row(
                "timings",
                f"decode attention {s} x {ctx_len} ctx, {h}/{hkv} heads",
                f"{bw / 1e9:.0f} GB/s = {100 * bw / copy_bw:.0f}% of copy ({1e6 * t:.0f} us)",
                ">= 70% of copy",
                goal_met=met,
            )
        )
        del args, k_cache, v_cache


def time_end_to_end(ctx: Ctx, folder: Path, rows: list[Row]) -> None:
    from draftwise.worker import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=ctx.e2e_tokens, ignore_eos=True)
    rng = random.Random(4)
    pattern = [rng.randrange(3, 500) for _ in range(16)]
    prompts = [
        (pattern * 8)[rng.randrange(16) :][:96] for _ in range(max(ctx.e2e_batches))
    ]  # repetitive: n-gram finds drafts
    dtype = "float32" if ctx.dry else "bfloat16"
    for label, spec in (
        ("no speculation", {}),
        ("n-gram k=4", dict(speculative_method="ngram", num_speculative_tokens=4)),
    ):
        llm = LLM(
            str(folder),
            device=ctx.device.type,
            dtype=dtype,
            skip_tokenizer_init=True,
            max_num_seqs=max(ctx.e2e_batches),
            max_model_len=1024,
            kv_cache_memory_bytes=(64 << 20) if ctx.dry else (8 << 30),
            **spec,
        )
        for b in ctx.e2e_batches:
            llm.generate(prompts[:b], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            steps0 = llm.engine.num_steps
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:b], params, use_tqdm=False)
            dt = time.perf_counter() - t0
            steps = llm.engine.num_steps - steps0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            tot = llm.engine.spec_totals
            acc = f", accepted {tot['accepted']}/{tot['proposed']}" if spec else ""
            rows.append(
                Row(
                    "timings",
                    f"end to end {dtype} batch {b}, {label}",
                    f"{toks / dt:.0f} tok/s, {steps / dt:.0f} steps/s{acc}",
                    "",
                    None,
                )
            )
        del llm
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


def time_heads(ctx: Ctx, rows: list[Row]) -> None:
    """The trained heads shipped for the embedded target (EAGLE, Medusa) against no
    speculation, greedy, graphs on: tokens/s, steps/s and the mean accepted length (tokens
    per verify pass), on code prompts of the default tokenizer."""
    from draftwise.worker import LLM, SamplingParams

    prompts = [
        "def fibonacci(n):",
        "import os\nimport sys\n\ndef main(",
        "class Stack:\n    def __init__(self):",
        "def read_config(path):\n    with open(path) as f:",
    ]
    params = SamplingParams(temperature=0, max_tokens=ctx.e2e_tokens, ignore_eos=True)
    dtype = "float32" if ctx.dry else "bfloat16"
    for label, spec in (
        ("no speculation", {}),
        ("eagle k=4", dict(speculative_method="eagle", num_speculative_tokens=4)),
        ("medusa k=3", dict(speculative_method="medusa", num_speculative_tokens=3)),
    ):
        llm = LLM(device=ctx.device.type, dtype=dtype, max_num_seqs=max(ctx.e2e_batches), max_model_len=1024,
                  kv_cache_memory_bytes=(64 << 20) if ctx.dry else (8 << 30), **spec)  # fmt: skip
        grs = _graph_runners(llm)
        graphs = sum(g.num_graphs for g in grs)
        for b in ctx.e2e_batches:
            batch = (prompts * (b // len(prompts) + 1))[:b]
            llm.generate(batch, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
            steps0, tot0 = llm.engine.num_steps, dict(llm.engine.spec_totals)
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            steps = llm.engine.num_steps - steps0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            tot = llm.engine.spec_totals
            verify = tot["verify_steps"] - tot0["verify_steps"]
            acc = (
                f", accepted length {1 + (tot['accepted'] - tot0['accepted']) / verify:.2f}" if spec and verify else ""
            )
            rows.append(
                Row("timings", f"heads {dtype} batch {b}, {label}",
                    f"{toks / dt:.0f} tok/s, {steps / dt:.0f} steps/s, {graphs} graphs{acc}", "", None)
            )  # fmt: skip
        del llm
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- driver


def _section(rows: list[Row], name: str, fn: Callable[..., None], *args: Any) -> None:
    """Run one check; an exception (an import failure included) becomes a FAIL row."""
    t0 = time.perf_counter()
    n = len(rows)
    try:
        fn(*args, rows)
    except Exception as e:
        traceback.print_exc()
        rows.append(Row(name, fn.__name__, f"{type(e).__name__}: {str(e)[:120]}", "runs", False))
    print(f"[{name}] {fn.__name__}: {len(rows) - n} rows in {time.perf_counter() - t0:.1f}s", flush=True)


def format_table(rows: Sequence[Row], header: str) -> str:
    """The summary: one line per row, status first."""
    status = {True: "PASS", False: "FAIL", None: "info"}
    goal = {True: "met", False: "MISS", None: "info"}
    cells = [
        (status[r.ok] if r.ok is not None else goal[r.goal_met], r.section, r.check, r.result, r.goal) for r in rows
    ]
    titles = ("status", "section", "check", "result", "goal")
    widths = [max(len(t), *(len(c[i]) for c in cells)) if cells else len(t) for i, t in enumerate(titles)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [header, line.format(*titles), line.format(*("-" * w for w in widths))]
    out += [line.format(*c).rstrip() for c in cells]
    failed = sum(r.ok is False for r in rows)
    missed = sum(r.goal_met is False for r in rows)
    out.append(f"{len(rows)} rows, {failed} failed" + (f", {missed} goals missed" if missed else ""))
    return "\n".join(out)


def machine(ctx: Ctx) -> str:
    import triton

    dev = (
        torch.cuda.get_device_name(ctx.device)
        if ctx.device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})"
    )
    return f"{time.strftime('%Y-%m-%d')}  {dev}  torch {torch.__version__}  triton {triton.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, kernels under TRITON_INTERPRET=1")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=["kernels", "graphs", "serving", "timings"], help="sections to skip"
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    elif not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    ctx = make_ctx(args.dry_run)
    t0 = time.perf_counter()
    rows: list[Row] = []
    if "kernels" not in args.skip:
        for fn in (check_dispatch, check_attention, check_write_kv, check_rms_norm, check_rejection):
            _section(rows, "kernels", fn, ctx)
    if "graphs" not in args.skip:
        _section(rows, "graphs", check_replay_logits, ctx)
        _section(rows, "graphs", check_graphs, ctx)
    if "serving" not in args.skip:
        _section(rows, "serving", check_serving, ctx)
        _section(rows, "serving", check_seeded_batch_invariance, ctx)
        from check_tp import check_tensor_parallel  # the script's folder is on sys.path

        _section(rows, "serving", check_tensor_parallel, ctx, Row, _graph_runners)
    if "timings" not in args.skip:
        _section(rows, "timings", time_attention_bandwidth, ctx)
        _section(rows, "timings", time_heads, ctx)
        with tempfile.TemporaryDirectory(prefix="draftwise-llama-") as tmp:
            folder = Path(tmp)
            try:
                build_random_llama(ctx, folder)
            except Exception as e:
                traceback.print_exc()
                rows.append(Row("timings", "build random Llama", f"{type(e).__name__}: {str(e)[:120]}", "runs", False))
            else:
                _section(rows, "timings", time_decode_steps, ctx, folder)
                _section(rows, "timings", time_end_to_end, ctx, folder)
    header = f"draftwise GPU check  {machine(ctx)}  {time.perf_counter() - t0:.0f}s{'  (dry run)' if ctx.dry else ''}"
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": [asdict(r) for r in rows]}, indent=1))
    print(format_table(rows, header))
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
