"""The offline API and the incremental API on the embedded default model: outputs, finish
reasons, errors that disturb nothing, aborts, seeded sampling, the async stream."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from scipy import stats

from draftwise.worker import LLM, SamplingParams
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.async_engine import AsyncEngine
from draftwise.worker.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_model_len=512, num_kv_blocks=128, max_num_batched_tokens=64, max_num_seqs=64)


def _drain(engine):
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            outs[o.request_id] = o
    return outs


def test_generate_shapes_and_metrics(llm):
    prompts = ["def fibonacci(n):", "import os\n", [1, 536, 887]]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["def fibonacci(n):", "import os\n", None]
    assert outs[2].prompt_token_ids == [1, 536, 887]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 24
        assert c.text == llm.get_tokenizer().decode(c.token_ids)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    engine = llm.engine
    engine.check_idle_invariants()


def test_stop_string_excluded_and_finish_reason(llm):
    full = llm.generate("def fibonacci(n):", GREEDY, use_tqdm=False)[0].outputs[0].text
    start = next(i for i in range(3, len(full)) if not full[i].isspace())
    stop = full[start : start + 5]
    assert stop.strip() and len(stop) == 5, full
    out = llm.generate("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[
        0
    ]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full[: full.index(stop)]


def test_stop_token_ids_and_eos(llm):
    tok = llm.get_tokenizer()
    full = llm.generate("def fibonacci(n):", GREEDY, use_tqdm=False)[0].outputs[0]
    target = full.token_ids[3]
    out = llm.generate(
        "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[target]), use_tqdm=False
    )
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == target
    assert c.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    assert c.text == tok.decode(full.token_ids[: full.token_ids.index(target)])


def test_min_tokens_suppresses_eos(llm):
    # the end of a test module: the default model ends the file (EOS) at once
    prompt = 'if __name__ == "__main__":\n    unittest.main()\n'
    eos = llm.engine.eos_token_ids
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in eos and len(free.token_ids) < 5
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=50, min_tokens=8), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(forced.token_ids) >= 8
    assert not set(forced.token_ids[:7]) & set(eos)
    assert forced.token_ids[0] != free.token_ids[0]  # EOS was masked, another token chosen


BAD_REQUESTS = [
    ("", GREEDY, "prompt is empty"),
    ([], GREEDY, "prompt is empty"),
    ([1] * 600, GREEDY, "max_model_len"),
    ("x = 1\n" * 400, GREEDY, "max_model_len"),
    ([1, 99999], GREEDY, "prompt token ids"),
    ([1, -3], GREEDY, "prompt token ids"),
    ("def", "not params", "sampling_params"),
]


@pytest.mark.parametrize(
    "prompt,params,match", BAD_REQUESTS, ids=[m + str(i) for i, (_, _, m) in enumerate(BAD_REQUESTS)]
)
def test_bad_request_raises_and_disturbs_nothing(llm, prompt, params, match):
    engine = llm.engine
    ref = llm.generate(["def fibonacci(n):", "class A:\n"], GREEDY, use_tqdm=False)
    engine.add_request("ok1", "def fibonacci(n):", GREEDY)
    engine.add_request("ok2", "class A:\n", GREEDY)
    for _ in range(3):
        engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    assert "bad" not in engine.requests
    outs = _drain(engine)
    assert outs["ok1"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert outs["ok2"].outputs[0].token_ids == ref[1].outputs[0].token_ids
    engine.check_idle_invariants()


def test_invalid_sampling_params_raise_value_error():
    for kwargs in [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-5),
        dict(max_tokens=0),
        dict(n=2),
        dict(logprobs=99),
    ]:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)


def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request("dup", "a = 1", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "b = 2", GREEDY)
    _drain(engine)


def test_generate_rolls_back_on_bad_prompt(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["def f():", ""], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_idle_invariants()


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    idle = engine.blocks.num_free_blocks
    engine.add_request("long", "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_free_blocks < idle
    assert engine.abort_request("long")
    assert engine.blocks.num_free_blocks == idle
    assert not engine.abort_request("long")
    out = engine.step()
    (d,) = out.deltas
    assert d.finished and d.finish_reason == "abort" and d.request_id == "long"
    assert out.finished[0].outputs[0].finish_reason == "abort"
    engine.check_idle_invariants()


def test_logprobs(llm):
    out = llm.generate(
        "def f(x):", SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 5
    for tok, lp in zip(out.outputs[0].token_ids, lps, strict=True):
        assert lp.token_id == tok and lp.rank == 1 and len(lp.top) == 3 and lp.top[0][0] == tok
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_seeded_sampling_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate("import sys\n", p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True)] * 5
    batch = llm.generate(
        ["def a():", "x = [", "import sys\n", "class B:", "# c", "for i in"],
        [*others[:2], p, *others[2:]],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone
    again = llm.generate(["import sys\n"] * 3, [others[0], p, others[1]], use_tqdm=False)
    assert again[1].outputs[0].token_ids == alone


def test_first_token_distribution_through_engine(llm):
    """The engine's first sampled token at temperature 0.8 follows softmax(logits / 0.8)
    of the model: chi-square over the likely tokens; reject at p < 1e-3."""
    prompt = "def fibonacci(n):\n    "
    engine = llm.engine
    ids = engine.tokenizer.encode(prompt)
    from draftwise.worker.model.kv_cache import KVCache
    from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk

    loaded = engine.loaded
    runner = ModelRunner(loaded, KVCache(loaded.config, 8, 16, loaded.dtype, "cpu"))
    logits = runner.run([SequenceChunk(ids, 0, list(range(8)))])[0]
    probs = torch.softmax(logits.double() / 0.8, -1).numpy()
    n = 3000
    outs = llm.generate([prompt] * n, SamplingParams(temperature=0.8, max_tokens=1, ignore_eos=True), use_tqdm=False)
    counts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=len(probs))
    top = np.argsort(-probs)[:8]
    top = top[probs[top] * n >= 10]
    observed = np.append(counts[top], n - counts[top].sum())
    expected = np.append(probs[top] * n, n * (1 - probs[top].sum()))
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_async_stream_and_cancel(llm):
    engine = llm.engine
    aengine = AsyncEngine(engine)
    aengine.start()
    idle = engine.blocks.num_free_blocks

    async def main():
        got, text = [], []
        async for d in aengine.generate("s1", "def fibonacci(n):", GREEDY):
            assert d.first_token_index == len(got)
            got.extend(d.token_ids)
            text.append(d.text)
        # cancel mid-stream: close the stream early; its abort is queued on the engine thread
        # and commands run in order, so once a later command has run the blocks are free
        n = 0
        gen = aengine.generate(
            "s2", "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        )
        async for _ in gen:
            n += 1
            if n == 3:
                break
        await gen.aclose()
        assert await aengine.call(lambda e: e.blocks.num_free_blocks) == idle
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in aengine.generate("s3", "", GREEDY):
                pass
        return got, "".join(text)

    try:
        got, text = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert len(got) == 24 and text == engine.tokenizer.decode(got)
    assert engine.blocks.num_free_blocks == idle


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_model_len=4096), "max_position_embeddings"),
        (dict(max_model_len=512, num_kv_blocks=8), "raise the KV budget or lower max_model_len"),
        (dict(max_num_batched_tokens=16, max_num_seqs=32), "must be >= max_num_seqs"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=512), "without chunked prefill"),
        (dict(kv_cache_memory_bytes=100), "smaller than one block"),
        (dict(block_size=0), "block_size"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    ],
)
def test_engine_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(dtype="float32", **kwargs)


def test_library_use_logs_no_debug_lines(capfd):
    import subprocess
    import sys

    code = (
        "from draftwise.worker import LLM, SamplingParams;"
        "LLM(dtype='float32', max_model_len=128, num_kv_blocks=16).generate(['x = 1'], SamplingParams(max_tokens=2), use_tqdm=False)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "request added" not in res.stdout + res.stderr  # debug lines are filtered
    assert "kv cache ready" in res.stderr  # info lines go to stderr


def test_speculation_config_errors(tmp_path):
    from draftwise.worker.model.model_config import ModelLoadError

    with pytest.raises(ModelLoadError, match="speculative_model: .*not a checkpoint folder"):
        LLMEngine(EngineConfig(speculative_model=tmp_path / "missing"))
    with pytest.raises(ValueError, match="num_speculative_tokens set without speculation"):
        EngineConfig(num_speculative_tokens=3)
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        EngineConfig(speculative_method="lookahead")
    with pytest.raises(ValueError, match="needs speculative_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="needs no draft checkpoint"):
        EngineConfig(speculative_method="ngram", speculative_model="default")
    with pytest.raises(ValueError, match="num_speculative_tokens must be in"):
        EngineConfig(speculative_model="default", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min/max apply to"):
        EngineConfig(speculative_model="default", prompt_lookup_max=3)
    with pytest.raises(ValueError, match="prompt_lookup_max must be >="):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative_adaptive set without speculation"):
        EngineConfig(speculative_adaptive=False)
