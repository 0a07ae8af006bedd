"""Chat in the engine: messages rendered with the checkpoint's chat template exactly as
Hugging Face's ``apply_chat_template`` renders them, the template's end-of-turn token as a
stop token, and a ValueError a person can act on for every conversation that cannot run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from draftwise.worker import LLM, SamplingParams
from draftwise.worker.engine.async_engine import AsyncEngine
from draftwise.worker.text.chat import ChatPrompt
from tests.chat_model import DROPPING_TEMPLATE, STRICT_TEMPLATE, make_chat_model

ENGINE = {"max_model_len": 256, "num_kv_blocks": 64, "max_num_seqs": 8}
CONV = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fibonacci(n):"}]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def llm(chat_dir: Path) -> LLM:
    return LLM(chat_dir, **ENGINE)


def test_chat_renders_like_transformers_and_matches_generate_on_those_tokens(llm: LLM, chat_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(chat_dir), local_files_only=True)
    want = hf.apply_chat_template(CONV, add_generation_prompt=True, tokenize=True, return_dict=False)
    (out,) = llm.chat(CONV, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == list(want)
    assert out.prompt.endswith("<|im_start|>assistant\n")
    (ref,) = llm.generate([list(want)], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 12


def test_chat_takes_several_conversations_and_text_parts(llm: LLM) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "def fibo"}, {"type": "text", "text": "nacci(n):"}]}]
    plain = [{"role": "user", "content": "def fibonacci(n):"}]
    a, b = llm.chat([parts, plain], GREEDY, use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_end_of_turn_token_is_found_and_added_to_stop_token_ids(tmp_path: Path) -> None:
    # a template that closes turns with <pad> (id 0), not the EOS: <pad> joins the stop token ids
    folder = make_chat_model(tmp_path / "pad", end_of_turn="'<pad>'")
    llm = LLM(folder, **ENGINE)
    chat = llm.engine.encode_chat(ChatPrompt.from_messages(CONV))
    assert chat.stop_token_ids == (0,)
    params = chat.sampling_params(SamplingParams(stop_token_ids=[7]), llm.engine.eos_token_ids)
    assert params.stop_token_ids == (7, 0)
    # the EOS closes ChatML turns in the default fixture: nothing to add
    assert llm.engine.eos_token_ids == (2,)


def test_reply_stops_at_the_end_of_turn_token(tmp_path: Path) -> None:
    # a template that closes turns with "def", made a special token (its own vocabulary id): the model
    # writes "def" early in its reply, so the chat reply is the free-running one cut right after it
    folder = make_chat_model(tmp_path / "def", end_of_turn="'def'")
    tj_path = folder / "tokenizer.json"
    tj = json.loads(tj_path.read_text())
    eot = tj["model"]["vocab"]["def"]
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    tj["added_tokens"].append({"id": eot, "content": "def", **special})
    tj_path.write_text(json.dumps(tj))
    llm = LLM(folder, **ENGINE)
    chat = llm.engine.encode_chat(ChatPrompt.from_messages(CONV))
    assert chat.stop_token_ids == (eot,) and eot not in llm.engine.eos_token_ids
    params = SamplingParams(temperature=0, max_tokens=24)
    (free,) = llm.generate([chat.token_ids], params, use_tqdm=False)
    ids = free.outputs[0].token_ids
    assert eot in ids, "the model did not write the token: pick another end-of-turn token for this test"
    (out,) = llm.chat(CONV, params, use_tqdm=False)
    assert out.outputs[0].token_ids == ids[: ids.index(eot) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == eot
    assert len(out.outputs[0].token_ids) < len(ids)


def test_chatml_end_of_turn_is_the_eos(llm: LLM) -> None:
    chat = llm.engine.encode_chat(ChatPrompt.from_messages(CONV))
    assert chat.stop_token_ids == (2,)
    assert chat.sampling_params(GREEDY, llm.engine.eos_token_ids) is GREEDY


def test_model_without_template_is_refused() -> None:
    llm = LLM(**ENGINE)  # the embedded default model: no chat template
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(CONV, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "chat has no messages"),
        ([{"role": "", "content": "x"}], r"messages\[0\]\.role is empty"),
        ([{"role": 3, "content": "x"}], r"messages\[0\]\.role must be a string"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text is served"),
        ([{"role": "user", "content": "def f(x):\n" * 400}], "render to a prompt of .* max_model_len=256"),
    ],
)
def test_bad_conversations_are_refused(llm: LLM, messages: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_roles_the_template_does_not_know(tmp_path: Path) -> None:
    narrator = [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "def f():"}]
    # ChatML writes any role: accepted
    chatml = LLM(make_chat_model(tmp_path / "chatml"), **ENGINE)
    (out,) = chatml.chat(narrator, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert "<|im_start|>narrator\nOnce" in out.prompt
    # a template that raises on it (as Llama 2's does): its message passed on
    strict = LLM(make_chat_model(tmp_path / "strict", STRICT_TEMPLATE), **ENGINE)
    with pytest.raises(ValueError, match="chat template refused the messages: Unknown role: narrator"):
        strict.chat(narrator, GREEDY, use_tqdm=False)
    # a template that silently drops it: detected and refused
    dropping = LLM(make_chat_model(tmp_path / "drop", DROPPING_TEMPLATE), **ENGINE)
    with pytest.raises(ValueError, match=r"messages\[0\]\.role 'narrator' is not a role this model's chat template"):
        dropping.chat(narrator, GREEDY, use_tqdm=False)
    (ok,) = dropping.chat(CONV, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert ok.prompt.startswith("<s>system: You write Python.</s>\n")


def test_async_engine_streams_chat_like_llm_chat(llm: LLM, chat_dir: Path) -> None:
    (ref,) = llm.chat(CONV, GREEDY, use_tqdm=False)

    async def run() -> list[int]:
        from draftwise.worker.core.config import EngineConfig
        from draftwise.worker.engine.llm_engine import LLMEngine

        aengine = AsyncEngine(LLMEngine(EngineConfig(model=chat_dir, **ENGINE)))
        aengine.start()
        try:
            ids: list[int] = []
            async for d in aengine.generate("c1", ChatPrompt.from_messages(CONV), GREEDY):
                ids.extend(d.token_ids)
            with pytest.raises(ValueError, match="chat has no messages"):
                async for _ in aengine.generate("c2", ChatPrompt(()), GREEDY):
                    pass
            return ids
        finally:
            aengine.shutdown()

    assert asyncio.run(run()) == ref.outputs[0].token_ids
