"""``--stats`` of ``draftwise chat`` and ``draftwise generate``: after each reply, one line on
stderr with the request's token count and speculation counters.

Against a real ``draftwise serve --speculative-method ngram`` (the embedded default model, with a
ChatML template so that chat runs too: tests/chat_model.py), the commands run in this process
with the wire tapped (the Python client's ``generate`` for ``generate --server``, the gRPC stub's
``GenerateStream`` for ``chat``), so the line is checked against the counters of the very request
it reports: the finished event's usage and the last delta's ``SpeculationStats``. In-process
``generate --stats`` is checked against the engine's final output of its request.

Both speculate with ``--no-speculative-adaptive`` (k drafted tokens every step the lookup finds a
match): the adaptive policy may rightly draft nothing for a few dozen tokens when its step times
are taken on a loaded machine (CI's run once had a 32-token reply with 0 drafts), and these tests
are about the line, not the policy (tests/unit/test_spec_policy.py)."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from draftwise.cli import main
from draftwise.cli.stats import SpecCounts, stats_line
from tests.chat_model import make_chat_model
from tests.integration.procs import CLIENT_DIR, ServeProc

sys.path.insert(0, str(CLIENT_DIR))
import draftwise_client  # noqa: E402

LINE = re.compile(
    r"^\[(?P<tokens>\d+) tokens?, (?:no speculation|speculation: (?P<accepted>\d+) of (?P<proposed>\d+) drafts "
    r"accepted(?:, (?P<per_pass>\d+\.\d) tokens per verify pass)?)\]$"
)
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
"""A prompt the model goes on repeating: n-gram lookup finds drafts in it, and most are accepted."""


def test_the_line() -> None:
    assert (
        stats_line(96, SpecCounts(80, 61, 22))
        == "[96 tokens, speculation: 61 of 80 drafts accepted, 3.8 tokens per verify pass]"
    )
    assert stats_line(96, None) == "[96 tokens, no speculation]"
    assert stats_line(1, None) == "[1 token, no speculation]"
    assert stats_line(5, SpecCounts(0, 0, 0)) == "[5 tokens, speculation: 0 of 0 drafts accepted]"
    for line in (
        "[96 tokens, speculation: 61 of 80 drafts accepted, 3.8 tokens per verify pass]",
        "[1 token, no speculation]",
    ):
        assert LINE.match(line), line


@pytest.fixture(scope="module")
def ngram_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    model = make_chat_model(tmp_path_factory.mktemp("stats-model") / "chatml")
    s = ServeProc(
        tmp_path_factory.mktemp("stats"), f"--model={model}", "--speculative-method=ngram", "--no-speculative-adaptive"
    )
    yield s.wait_listening()
    s.close()


def _check(err: str, usage: Any, last_spec: Any) -> re.Match[str]:
    """The one stderr line against the request's own counters."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    m = LINE.match(lines[0])
    assert m, err
    assert int(m["tokens"]) == usage.completion_tokens > 0
    assert last_spec is not None, "a request of a speculating server carries SpeculationStats"
    assert (last_spec.proposed_tokens, last_spec.accepted_tokens) == (
        usage.speculative_proposed_tokens,
        usage.speculative_accepted_tokens,
    )
    assert (int(m["proposed"]), int(m["accepted"])) == (
        usage.speculative_proposed_tokens,
        usage.speculative_accepted_tokens,
    )
    assert usage.speculative_proposed_tokens > 0, "n-gram lookup drafted nothing on a prompt that repeats"
    assert m["per_pass"] == f"{last_spec.mean_accepted_length:.1f}"
    assert last_spec.verify_steps > 0 and 1 <= float(m["per_pass"]) <= 1 + usage.speculative_accepted_tokens
    return m


def test_generate_server_stats(ngram_serve: ServeProc, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    seen: list[Any] = []
    plain = draftwise_client.Client.generate

    def tapped(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for delta in plain(self, *args, **kwargs):
            seen.append(delta)
            yield delta

    monkeypatch.setattr(draftwise_client.Client, "generate", tapped)
    argv = ["generate", CODE, "--server", ngram_serve.address, "--max-tokens", "48", "--wait", "30", "--stats"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out == CODE + "".join(d.text for d in seen) + "\n"
    usage = seen[-1].usage
    assert seen[-1].finished and usage is not None
    specs = [d.speculation for d in seen if d.speculation is not None]
    _check(err, usage, specs[-1] if specs else None)
    assert sum(len(d.token_ids) for d in seen) == usage.completion_tokens

    # without --stats: stderr stays empty
    assert main(argv[:-1]) == 0
    assert capsys.readouterr().err == ""


class _TappedStub:
    """GenerateServiceStub whose GenerateStream keeps every response it yields in ``seen``."""

    seen: list[Any] = []
    plain: Any = None  # the real stub class

    def __init__(self, channel: Any) -> None:
        self._stub = _TappedStub.plain(channel)

    def GenerateStream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the gRPC method's name
        return _TappedCall(self._stub.GenerateStream(*args, **kwargs))


class _TappedCall:
    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[Any]:
        for resp in self._call:
            _TappedStub.seen.append(resp)
            yield resp

    def cancel(self) -> bool:
        return self._call.cancel()


def test_chat_stats_after_each_reply(ngram_serve: ServeProc, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from draftwise.v1 import generate_service_pb2_grpc as gsgrpc

    _TappedStub.seen, _TappedStub.plain = [], gsgrpc.GenerateServiceStub
    monkeypatch.setattr(gsgrpc, "GenerateServiceStub", _TappedStub)
    turns = [CODE, "def mul(a, b):"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t.replace("\n", " ") + "\n" for t in turns)))
    argv = ["chat", "--server", ngram_serve.address, "--max-tokens", "32", "--wait", "30", "--stats"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    events = [r.event for r in _TappedStub.seen]
    finished = [i for i, e in enumerate(events) if e.WhichOneof("kind") == "finished"]
    assert len(finished) == len(turns) == len(err.splitlines()), err
    start = 0
    replies = []
    for line, end in zip(err.splitlines(), finished, strict=True):
        deltas = [e.delta for e in events[start:end]]
        specs = [d.speculation for d in deltas if d.HasField("speculation")]
        _check(line, events[end].finished.usage, specs[-1] if specs else None)
        replies.append("".join(d.text for d in deltas))
        start = end + 1
    assert out == "".join(r + "\n" for r in replies)


def test_generate_in_process_stats(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """In-process, the line comes from the engine's final output of the request."""
    import draftwise.worker.engine.llm_engine as llm_engine

    finals: list[Any] = []
    plain = llm_engine.LLMEngine.step

    def step(self: Any) -> Any:
        out = plain(self)
        finals.extend(d.final for d in out.deltas if d.final is not None)
        return out

    monkeypatch.setattr(llm_engine.LLMEngine, "step", step)
    base = ["generate", CODE, "--max-tokens", "24", "--stats"]
    assert main(base) == 0
    (final,) = finals
    assert _stats_lines(capsys.readouterr().err) == [f"[{len(final.outputs[0].token_ids)} tokens, no speculation]"]

    finals.clear()
    assert main([*base, "--speculative-method", "ngram", "--no-speculative-adaptive"]) == 0
    (final,) = finals
    out = final.outputs[0]
    (line,) = _stats_lines(capsys.readouterr().err)
    m = LINE.match(line)
    assert m and int(m["tokens"]) == len(out.token_ids)
    assert (int(m["proposed"]), int(m["accepted"])) == (out.num_spec_proposed, out.num_spec_accepted)
    assert out.num_spec_proposed > 0 and m["per_pass"] == f"{out.spec_mean_accepted_length:.1f}"


def _stats_lines(err: str) -> list[str]:
    """The stats lines of stderr (in-process, the engine's log records may share it: JSON
    lines, once an earlier test configured logging)."""
    return [line for line in err.splitlines() if line.startswith("[")]
