"""The commands of vLLM's articles, typed with ``draftwise`` for ``vllm``, work (docs/serving.md,
"Coming from vLLM"). The models are the embedded pair (worker/default_models/target and draft):
given by folder, or under the articles' own names (``meta-llama/Meta-Llama-3-70B`` / ``-8B``)
through a models folder (``DRAFTWISE_MODELS_DIR``) or a Hugging Face cache laid out as
huggingface_hub lays it out. Every other flag is the article's, ``--max-model-len 4096`` included:
the local copies under the articles' names say a 4096-token context (``_models_dir``); given the
embedded pair's own 2048, draftwise refuses 4096 as vLLM does (one line, before any worker
starts: tested here).

Real processes on 127.0.0.1: ``draftwise serve`` and ``python -m draftwise.entrypoints.api_server``
started together once for the module; ``/generate`` answered in vLLM's shape, whole and streamed,
its errors as 400s the worker never sees; ``LLM(...)`` in-process with the articles' keywords.
``--tensor-parallel-size 4`` / ``tensor_parallel_size=4`` run as the articles give them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tests.integration.procs import ENGINE_ARGS, ROOT, ServeProc, child_env, said

TARGET = ROOT / "worker" / "default_models" / "target"
DRAFT = ROOT / "worker" / "default_models" / "draft"
HUB_TARGET, HUB_DRAFT = "meta-llama/Meta-Llama-3-70B", "meta-llama/Meta-Llama-3-8B"
LOCAL_MAX_MODEL_LEN = "4096"
"""The articles' value: the local copies under the articles' names have a 4096-token context
(``_models_dir``); past the embedded pair's own 2048 it is refused (test_the_articles_4096_is_refused_...)."""
PROMPT = "def fibonacci(n):"


def _http_port(serve: ServeProc) -> int:
    assert serve.popen.stdout is not None
    line = said(serve.popen.stdout.readline().rstrip("\n"))
    prefix = "OpenAI-compatible HTTP on http://127.0.0.1:"
    assert line.startswith(prefix) and line.endswith("/v1"), f"unexpected second line {line!r}"
    return int(line[len(prefix) : -len("/v1")])


class ApiServerProc(ServeProc):
    """``python -m draftwise.entrypoints.api_server ARGS`` (what serve starts, HTTP on ``--port``)."""

    def __init__(self, tmp: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.log_file = tmp / "serve.log"
        args = [sys.executable, "-m", "draftwise.entrypoints.api_server", "--workers=1", "--log-format=json"]
        args += ["--metrics-port=0", *ENGINE_ARGS, *flags]
        with open(self.log_file, "wb") as log:
            self.popen = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=log, env=env or child_env(), cwd=tmp, text=True
            )
        self.port = self.metrics_port = 0
        self.model = ""


@dataclass
class Servers:
    serve: ServeProc  # the `draftwise serve MODEL --speculative-model ...` article command
    serve_http: int
    api: ApiServerProc  # the `python -m draftwise.entrypoints.api_server ...` article command
    api_http: int


def _models_dir(root: Path) -> Path:
    """The articles' names for the embedded pair: DIR/meta-llama/Meta-Llama-3-{70B,8B}, local
    checkpoints whose context is the articles' 4096 (the embedded pair's files, linked, with
    ``max_position_embeddings`` 4096 in config.json: RoPE reads any position; the pair was
    trained on 2048), so that the articles' ``--max-model-len 4096`` runs as written."""
    for name, folder in ((HUB_TARGET, TARGET), (HUB_DRAFT, DRAFT)):
        out = root / name
        out.mkdir(parents=True)
        for f in folder.iterdir():
            if f.name != "config.json":
                (out / f.name).symlink_to(f)
        config = json.loads((folder / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return root


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    tmp = tmp_path_factory.mktemp("articles")
    models = _models_dir(tmp / "models")
    (tmp / "serve").mkdir()
    (tmp / "api").mkdir()
    serve = ServeProc(
        tmp / "serve",
        *(HUB_TARGET, "--speculative-model", HUB_DRAFT, "--num-speculative-tokens", "5"),
        *("--gpu-memory-utilization", "0.9", "--max-model-len", LOCAL_MAX_MODEL_LEN, "--tensor-parallel-size", "4"),
        "--http-port=0",  # vllm serve's HTTP is draftwise serve's --http-port (its --port is gRPC)
        env=child_env(DRAFTWISE_MODELS_DIR=str(models)),
    )
    api = ApiServerProc(
        tmp / "api",
        *("--model", HUB_TARGET, "--draft-model", HUB_DRAFT, "--num-speculative-tokens", "5"),
        *("--use-v2-block-manager", "--gpu-memory-utilization", "0.9", "--max-model-len", LOCAL_MAX_MODEL_LEN),
        *("--port", "0"),  # the article's 8000, any free port here
        env=child_env(DRAFTWISE_MODELS_DIR=str(models)),
    )
    try:
        serve.wait_listening()
        serve_http = _http_port(serve)
        api.wait_listening()
        yield Servers(serve, serve_http, api, _http_port(api))
    finally:
        serve.close()
        api.close()


def _generate(port: int, body: object, **kw: object) -> requests.Response:
    return requests.post(f"http://localhost:{port}/generate", json=body, timeout=120, **kw)  # type: ignore[arg-type]


def _vllm_shape(answer: object, prompt: str) -> str:
    """The one text of a ``{"text": [prompt + output]}`` answer, checked; its output part."""
    assert isinstance(answer, dict) and list(answer) == ["text"], answer
    (text,) = answer["text"]
    assert isinstance(text, str) and text.startswith(prompt), text
    return text[len(prompt) :]


def test_serve_under_the_articles_names(servers: Servers) -> None:
    serve = servers.serve
    assert serve.model == HUB_TARGET  # served under the name given, as vLLM does
    (kv,) = [e for e in serve.log_events() if e.get("event") == "kv cache ready"]  # the worker's
    assert (kv["speculation"], kv["tensor_parallel_size"], kv["max_model_len"]) == ("draft", 4, 4096), kv
    models = requests.get(f"http://127.0.0.1:{servers.serve_http}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [HUB_TARGET]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.7, "use_beam_search": False}
    output = _vllm_shape(_generate(servers.serve_http, body).json(), PROMPT)
    assert output


def test_the_api_server_answers_the_articles_request(servers: Servers) -> None:
    port = servers.api_http
    assert requests.get(f"http://localhost:{port}/health", timeout=30).status_code == 200
    assert "notice: --use-v2-block-manager changes nothing" in servers.api.log()
    # the article: requests.post(".../generate", json={...}).json()["text"][0]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.7, "use_beam_search": False}
    text = _generate(port, body).json()["text"][0]
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)


def test_generate_streams_like_vllm(servers: Servers) -> None:
    """``"stream": true``: JSON chunks ``{"text": [prompt + text so far]}``, each followed by
    b"\\0"; the last one is the whole answer, the same as unstreamed (greedy)."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = _vllm_shape(_generate(servers.api_http, body).json(), PROMPT)
    resp = _generate(servers.api_http, dict(body, stream=True), stream=True)
    assert resp.status_code == 200
    raw = resp.content
    assert raw.endswith(b"\0")
    chunks = [json.loads(c) for c in raw.split(b"\0")[:-1]]
    assert chunks
    outputs = [_vllm_shape(c, PROMPT) for c in chunks]
    for shorter, longer in zip(outputs, outputs[1:], strict=False):
        assert longer.startswith(shorter) and len(longer) > len(shorter)
    assert outputs[-1] == whole
    # the client of vLLM's examples: iter_lines split on b"\0"
    resp = _generate(servers.serve_http, dict(body, stream=True), stream=True)
    last = [json.loads(c) for c in resp.iter_lines(chunk_size=8192, decode_unicode=False, delimiter=b"\0") if c][-1]
    assert last["text"][0] == PROMPT + whole  # the same engine settings: the same greedy text


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"prompt": PROMPT, "use_beam_search": True, "n": 4}, "use_beam_search", "beam search is not supported"),
        ({"prompt": PROMPT, "best_of": 2, "presence_penalty": 0}, "best_of", "best_of must be 1"),
        ({"prompt": PROMPT, "logprobs": 1}, "logprobs", "unknown field 'logprobs'"),
        ({"prompt": PROMPT, "n": 2}, "n", "n must be 1"),
        ({"prompt": PROMPT, "temperature": -1}, "temperature", "temperature"),
        ({"prompt": 42}, "prompt", "prompt must be a non-empty string"),
        ({"prompt": PROMPT, "max_tokens": 5000}, None, "max_tokens=5000 is too large"),
        ({"prompt": PROMPT, "stop_token_ids": [1 << 40]}, "stop_token_ids", "stop_token_ids"),
        ({"prompt": PROMPT, "stream": "yes"}, "stream", "stream must be true or false"),
        (["not", "an", "object"], None, "the request body must be a JSON object"),
    ],
)
def test_generate_refuses_bad_requests_with_a_400(servers: Servers, body: object, param: str | None, says: str) -> None:
    resp = _generate(servers.api_http, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert says in error["message"] and error["param"] == param


def test_the_worker_survives_every_bad_request(servers: Servers) -> None:
    port = servers.api_http
    before = {w: e["pid"] for w, e in servers.api.ready_workers().items()}
    for raw in (b"{", b"\xff\xfe", b'{"prompt": "\\ud800"}', b"[]", b"null", b'{"prompt": "x", "top_k": -5}'):
        resp = requests.post(f"http://127.0.0.1:{port}/generate", data=raw, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["message"], raw
    for body in ({"prompt": "x", "seed": 1 << 70}, {"prompt": "x", "stop": [""]}, {"prompt": "x", "min_p": 2}):
        assert _generate(port, body).status_code == 400
    assert requests.get(f"http://127.0.0.1:{port}/generate", timeout=30).status_code == 405
    # a client that leaves mid-stream: its request is cancelled, the worker goes on
    with _generate(port, {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}, stream=True) as r:
        next(r.iter_content(1))
    after = servers.api.ready_workers()
    assert {w: e["pid"] for w, e in after.items()} == before and all(e["restarts"] == 0 for e in after.values())
    assert all(os.path.exists(f"/proc/{pid}") for pid in before.values())
    ok = _generate(port, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert ok.status_code == 200 and _vllm_shape(ok.json(), PROMPT)


def _run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env or child_env(), timeout=timeout, cwd=ROOT
    )


def test_the_articles_4096_is_refused_before_any_worker_in_one_line() -> None:
    """The api_server article command verbatim (the local folders for the names): the local pair's
    context is 2048, and, as vLLM, draftwise refuses a longer --max-model-len, before a worker
    loads anything."""
    t0 = time.monotonic()
    out = _run_cli(
        *("-m", "draftwise.entrypoints.api_server", "--model", str(TARGET), "--draft-model", str(DRAFT)),
        *("--num-speculative-tokens", "5", "--use-v2-block-manager", "--gpu-memory-utilization", "0.9"),
        *("--max-model-len", "4096", "--port", "8000"),
    )
    assert out.returncode == 2 and out.stdout == ""
    notice, error = out.stderr.splitlines()
    assert notice.startswith("notice: --use-v2-block-manager changes nothing")
    assert error.startswith("error: --max-model-len 4096 is more than the model's context of 2048 tokens")
    assert error.endswith("lower --max-model-len to 2048 or less")
    print(f"refused in {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ("-m", "draftwise.cli", "serve", HUB_TARGET, "--speculative-model", HUB_DRAFT, "--max-model-len", "4096"),
            f"error: --model: no local copy of {HUB_TARGET!r}: ",
        ),
        (
            ("-m", "draftwise.entrypoints.api_server", "--model", str(TARGET), "--draft-model", HUB_DRAFT),
            f"error: --speculative-model: no local copy of {HUB_DRAFT!r}: ",
        ),
        (
            ("-m", "draftwise.cli", "generate", "hi", "--model", HUB_TARGET),
            f"error: --model: no local copy of {HUB_TARGET!r}",
        ),
        (
            ("-m", "draftwise.cli", "serve", str(TARGET), "--model", str(DRAFT)),
            f"error: the model is given twice: {str(TARGET)!r} (positional) and --model {str(DRAFT)!r}; give one",
        ),
    ],
)
def test_one_line_failures(tmp_path: Path, argv: tuple[str, ...], error: str) -> None:
    env = child_env(HF_HOME=str(tmp_path / "empty-hf-home"))
    env.pop("DRAFTWISE_MODELS_DIR", None)
    env.pop("HF_HUB_CACHE", None)
    out = _run_cli(*argv, env=env)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(error), out.stderr
    if "no local copy" in error:
        for said_ in ("downloads nothing", "a local checkpoint folder", "a GGUF file", "smollm2-135m-instruct"):
            assert said_ in out.stderr


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The articles' names in a Hugging Face cache laid out as huggingface_hub lays it out
    (models--org--name/refs/main naming a snapshot), holding the embedded pair."""
    cache = tmp_path / "hub"
    for name, folder in ((HUB_TARGET, TARGET), (HUB_DRAFT, DRAFT)):
        org, base = name.split("/")
        repo = cache / f"models--{org}--{base}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("0" * 40)
        (repo / "snapshots").mkdir()
        (repo / "snapshots" / ("0" * 40)).symlink_to(folder, target_is_directory=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("DRAFTWISE_MODELS_DIR", raising=False)
    return cache


def test_llm_with_the_articles_batching_keywords() -> None:
    from draftwise.worker import LLM, SamplingParams

    llm = LLM(model=str(TARGET), enable_chunked_prefill=True, max_num_seqs=256, gpu_memory_utilization=0.85)
    config = llm.engine.config
    assert (config.enable_chunked_prefill, config.max_num_seqs, config.gpu_memory_utilization) == (True, 256, 0.85)
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert out.outputs[0].token_ids and out.outputs[0].spec_token_acceptance_rate is None  # no speculation
    del llm


def test_llm_with_the_articles_speculative_keywords_and_acceptance_rate(hub_cache: Path) -> None:
    """The article verbatim, names included (found in the Hugging Face cache, offline):
    ``output.outputs[0].spec_token_acceptance_rate`` is accepted / drafted tokens."""
    from draftwise.worker import LLM, SamplingParams

    llm = LLM(
        model=HUB_TARGET,
        speculative_model=HUB_DRAFT,
        num_speculative_tokens=5,
        gpu_memory_utilization=0.9,
        tensor_parallel_size=4,
    )
    assert llm.engine.config.tensor_parallel_size == 4 and llm.engine.config.spec_method == "draft"
    prompts = [PROMPT, "Once upon a time"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    rates = []
    for output in outputs:
        completion = output.outputs[0]
        rate = completion.spec_token_acceptance_rate
        if completion.num_spec_proposed:
            assert rate is not None and 0.0 <= rate <= 1.0
            assert rate == completion.num_spec_accepted / completion.num_spec_proposed
        else:
            assert rate is None  # nothing drafted
        rates.append(rate)
    assert any(r is not None for r in rates), rates
    print("spec_token_acceptance_rate:", rates)
    del llm


def _prefill_steps(engine: object, n: int = 100) -> list[int]:
    """Tokens each step batched until an ``n``-token prompt's first output token."""
    from draftwise.worker import SamplingParams

    engine.add_request("r", list(range(10, 10 + n)), SamplingParams(max_tokens=1, temperature=0))  # type: ignore[attr-defined]
    batched = []
    while True:
        out = engine.step()  # type: ignore[attr-defined]
        batched.append(out.stats.num_batched_tokens if out.stats is not None else 0)
        if any(d.token_ids for d in out.deltas if d.request_id == "r"):
            break
    while engine.has_unfinished_requests():  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
    return batched


def test_enable_chunked_prefill_really_switches_chunking(capfd: pytest.CaptureFixture[str]) -> None:
    """``--enable-chunked-prefill`` with a 32-token budget: a 100-token prompt takes several steps
    of at most 32 tokens; ``--no-enable-chunked-prefill`` needs a budget that holds any prompt
    (the engine refuses 32 for a 256-token context); ``LLM(enable_chunked_prefill=False)``
    prefills it in one step."""
    from draftwise.cli.engine_flags import engine_config
    from draftwise.cli.main import build_parser
    from draftwise.worker import LLM
    from draftwise.worker.engine.llm_engine import LLMEngine

    small = ("serve", "--model", str(TARGET), "--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "4")
    chunked = engine_config(
        build_parser().parse_args([*small, "--enable-chunked-prefill", "--max-num-batched-tokens", "32"])
    )
    steps = _prefill_steps(LLMEngine(chunked))
    assert len(steps) >= 4 and max(steps) <= 32 and sum(steps) == 100, steps
    whole = engine_config(
        build_parser().parse_args([*small, "--no-enable-chunked-prefill", "--max-num-batched-tokens", "32"])
    )
    assert whole.enable_chunked_prefill is False
    with pytest.raises(ValueError, match="without chunked prefill"):
        LLMEngine(whole)
    llm = LLM(
        model=str(TARGET), enable_chunked_prefill=False, max_model_len=256, num_kv_blocks=64, use_v2_block_manager=True
    )
    assert "notice: use_v2_block_manager changes nothing" in capfd.readouterr().err
    assert _prefill_steps(llm.engine) == [100]


def test_the_workers_own_parser_takes_the_vllm_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """``draftwise worker`` (what serve starts, and a container's command) reads the same table."""
    from draftwise.worker.serving.server import build_parser as worker_parser

    args = worker_parser().parse_args(
        ["--draft-model", str(DRAFT), "--use-v2-block-manager", "--enable-chunked-prefill"]
    )
    assert args.speculative_model == str(DRAFT) and args.enable_chunked_prefill is True
    assert capsys.readouterr().err.startswith("notice: --use-v2-block-manager changes nothing")
