"""No Triton compilation while serving: the engine launches at start-up every attention
kernel variant its eager steps can need (``ModelRunner.warm_up``), so serving launches no
variant it has not launched before.

Run on CPU with the Triton kernels registered for CPU tensors (the interpreter:
tests/conftest.py sets TRITON_INTERPRET=1) on a real embedded model: the default draft, which has
the target's attention shapes (8 query heads, 4 key/value heads, head size 32, so the same kernel
variants) in one layer instead of ten (the interpreter runs every launch in Python). A variant is what
Triton compiles one binary for: the kernel, its dtypes, its constexprs and the class of
each integer argument (``draftwise.kernels.launch_record.recording_launches`` collects them). On a
GPU, tests/gpu/check_gpu.py counts real compilations while serving.
"""

from __future__ import annotations

import random

import pytest

from draftwise.kernels import dispatch
from draftwise.kernels import launch_plan as plan
from draftwise.kernels.launch_record import recording_launches
from draftwise.worker import default_model_path
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams


@pytest.fixture
def triton_on_cpu():
    saved = dict(dispatch._FAST)
    assert "paged_attention" in dispatch.register_triton("cpu")
    yield
    dispatch._FAST.clear()
    dispatch._FAST.update(saved)


def _serve(engine: LLMEngine, rng: random.Random) -> int:
    """A varied workload: batches of 1 to 4, prompts of 1 to 150 tokens (chunked), repeating
    text so that n-gram drafts are verified, greedy and sampled; the steps it took."""
    vocab = engine.loaded.config.vocab_size
    steps = 0
    for batch in (1, 4, 2, 3):
        for i in range(batch):
            n = rng.choice([1, 5, 17, 40, 150])
            motif = [rng.randrange(3, vocab) for _ in range(4)]
            prompt = (motif * n)[:n]
            params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=10, ignore_eos=True)
            engine.add_request(f"{batch}-{i}-{n}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    return steps


def test_serving_launches_only_what_warm_up_launched(triton_on_cpu):
    with recording_launches() as warmed:
        engine = LLMEngine(
            EngineConfig(
                model=default_model_path("draft"),  # the target's attention shapes, one layer
                dtype="float32",
                max_num_seqs=4,
                max_model_len=512,
                max_num_batched_tokens=64,  # prompts of 150 tokens come in chunks
                speculative_method="ngram",
                num_speculative_tokens=3,
                skip_tokenizer_init=True,
            )
        )
    assert engine.runner.backend.name == "triton"
    assert engine.kernel_warm_up_seconds > 0
    kinds = {key[0] for key in warmed}
    assert kinds == {"decode", "varlen"}
    assert len({key[3][4] for key in warmed if key[0] == "decode"}) >= 2  # several partition counts
    with recording_launches() as served:
        steps = _serve(engine, random.Random(0))
    assert steps > 20 and {key[0] for key in served} == {"decode", "varlen"}
    assert served <= warmed, f"launched while serving, never at start-up: {served - warmed}"
    assert engine.spec_totals["verify_steps"] > 0  # verify steps ran the varlen kernel


def test_warm_up_plan_covers_every_choice():
    """Every partition count a decode step can get, and every tile height a varlen step can,
    has a step in the plan (checked against the choosers over every batch and width)."""
    kw = dict(max_num_seqs=64, max_num_tokens=2048, max_context=8192, block_size=16, num_kv_heads=4, group=2)
    steps = plan.warm_up_plan(**kw, num_sms=132)
    planned_p = {plan.decode_num_partitions(s, 4, w * 16, 132) for s, n, w in steps if n == 1}
    every_p = {plan.decode_num_partitions(s, 4, w * 16, 132) for s in range(1, 65) for w in (16, 32, 64, 128, 256, 512)}
    assert planned_p == every_p and len(every_p) > 3
    planned_m = {plan.prefill_block_m(n, 2) for s, n, w in steps if n > 1}
    assert planned_m == {plan.prefill_block_m(n, 2) for n in range(2, 2049)} == {16, 32, 64}
    assert all(w >= 16 and w & (w - 1) == 0 for _, _, w in steps)
