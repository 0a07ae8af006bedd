"""Small steps on fewer threads (``decode_threads``): on CPU a step of at most 32 tokens (decode,
verify) runs on ``decode_threads`` torch threads and a larger one (a prefill chunk) on all of
them, the count restored after each step; ``draftwise serve`` sets it only where the user asks;
refusals are one line."""

from __future__ import annotations

import pytest
import torch

from draftwise.gateway.launcher import ServeConfig, _worker_procs
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.model import cpu_matmul
from draftwise.worker.sampling.sampling_params import SamplingParams
from tests.engine.test_spec_exactness import _config


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _threads_seen(engine: LLMEngine, prompt: list[int], monkeypatch) -> list[int]:
    seen: list[int] = []
    matmul = cpu_matmul.matmul
    monkeypatch.setattr(
        cpu_matmul, "matmul", lambda x, p, s=None: seen.append(torch.get_num_threads()) or matmul(x, p, s)
    )
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    per_step = []
    while engine.has_unfinished_requests():
        seen.clear()
        engine.step()
        per_step.append(set(seen))
    return per_step  # type: ignore[return-value]


def test_decode_steps_run_on_fewer_threads_and_prefill_on_all(two_threads, monkeypatch):
    assert cpu_matmul.kernel() is not None, cpu_matmul.unavailable_reason()
    engine = LLMEngine(_config(num_kv_blocks=32, decode_threads=1))
    steps = _threads_seen(engine, list(range(5, 45)), monkeypatch)  # a 40-token prompt, then 3 decode steps
    assert steps[0] == {2} and all(s == {1} for s in steps[1:]) and len(steps) == 4, steps
    assert torch.get_num_threads() == 2


def test_without_decode_threads_every_step_runs_on_all(two_threads, monkeypatch):
    engine = LLMEngine(_config(num_kv_blocks=32))
    steps = _threads_seen(engine, list(range(5, 45)), monkeypatch)
    assert all(s == {2} for s in steps), steps


def test_the_same_tokens_on_fewer_decode_threads(two_threads):
    prompts = [list(range(5, 45)), [1, 7, 9]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for few in (None, 1):
        engine = LLMEngine(_config(num_kv_blocks=32, decode_threads=few))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        got = {}
        while engine.has_unfinished_requests():
            for o in engine.step().finished:
                got[o.request_id] = o.outputs[0].token_ids
        outs[few] = got
    assert outs[None] == outs[1]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"decode_threads": 0}, "decode_threads must be >= 1"),
        ({"decode_threads": 1, "device": "cuda"}, "applies to one CPU process"),
        ({"decode_threads": 1, "tensor_parallel_size": 2}, "applies to one CPU process"),
    ],
)
def test_bad_decode_threads_are_refused_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        EngineConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_serve_leaves_decode_threads_to_the_user(tmp_path):
    """``serve`` once gave a CPU worker one decode thread fewer when its threads took every core (libgomp's
    teams stalled when the gateway preempted one); on the kernel library's own pool two threads decode
    1.4-1.7x faster served than one (docs/benchmarks.md, "CPU path against llama.cpp"), so only a flag sets it."""
    base = ServeConfig(num_workers=1, worker_args=("--model", "m"), threads_per_worker=2)
    (proc,) = _worker_procs(base, tmp_path, tmp_path / "secret")
    assert "--decode-threads" not in proc.args and proc.env["OMP_NUM_THREADS"] == "2"
    given = ServeConfig(num_workers=1, worker_args=("--model", "m", "--decode-threads", "1"), threads_per_worker=2)
    (proc,) = _worker_procs(given, tmp_path, tmp_path / "secret")
    assert proc.args[-2:] == ["--decode-threads", "1"]
