"""Chat with tools rendered by real tokenizers (``worker/text/chat.py``, ``chat_tools.py``):
SmolLM2-135M-Instruct's template knows no tools, so tools, calls and results are written in
Hermes style (exact text checked); the embedded default model with a ChatML template likewise;
the same model with a template that knows tools gets them through ``apply_chat_template(tools=)``
exactly as Hugging Face renders them. A conversation without tools renders as before."""

from __future__ import annotations

import json

import pytest

from draftwise.worker.text.chat import ChatPrompt, ChatTemplate
from draftwise.worker.text.tokenizer import load_tokenizer
from tests.chat_model import make_chat_model
from tests.model.smollm2 import require_smollm2

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(WEATHER)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
HERMES_TURNS = (
    "user\nWeather in Paris?{e}\n"
    '{s}assistant\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n</tool_call>{e}\n'
    "{s}user\n<tool_response>\n22 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>{e}\n"
    "{s}assistant\n"
)
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|im_start|>system\\n<tools>' }}{% for t in tools %}"
    "{{ '\\n' + (t | tojson) }}{% endfor %}{{ '\\n</tools>' + eos_token + '\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for c in message.tool_calls or [] %}{{ '<tool_call>' + (c.function | tojson) + '</tool_call>' }}{% endfor %}"
    "{{ eos_token + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A template that knows tools (as Qwen2.5's, Llama 3.1's and Hermes' do), in a few lines."""


@pytest.fixture(scope="module")
def smollm2() -> ChatTemplate:
    return ChatTemplate(load_tokenizer(require_smollm2()))


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(make_chat_model(tmp_path_factory.mktemp("chatml") / "m")))


@pytest.fixture(scope="module")
def knows_tools(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    folder = make_chat_model(tmp_path_factory.mktemp("tools") / "m", template=TOOLS_TEMPLATE)
    return ChatTemplate(load_tokenizer(folder))


def test_smollm2_gets_tools_hermes_style(smollm2: ChatTemplate) -> None:
    assert smollm2.available and not smollm2.supports_tools
    text = smollm2.render(ChatPrompt.from_messages(CONV, [WEATHER]))
    s, e = "<|im_start|>", "<|im_end|>"
    assert text == f"{s}system\n{TOOLS_BLOCK}{e}\n{s}" + HERMES_TURNS.format(s=s, e=e)
    # an existing system message keeps its text, the tools block follows it
    with_system = smollm2.render(
        ChatPrompt.from_messages([{"role": "system", "content": "Be brief."}, *CONV], [WEATHER])
    )
    assert with_system.startswith(f"{s}system\nBe brief.\n\n{TOOLS_BLOCK}{e}\n{s}user\n")
    # the reply still ends at the template's end-of-turn token
    assert smollm2.end_of_turn_ids == (smollm2.hf.convert_tokens_to_ids(e),)


def test_smollm2_without_tools_renders_as_before(smollm2: ChatTemplate) -> None:
    conv = [{"role": "user", "content": "Say hi."}]
    want = smollm2.hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert smollm2.render(ChatPrompt.from_messages(conv)) == want
    assert "You are a helpful AI assistant named SmolLM" in want


def test_chatml_default_model_gets_tools_hermes_style(chatml: ChatTemplate) -> None:
    assert not chatml.supports_tools
    text = chatml.render(ChatPrompt.from_messages(CONV, [WEATHER]))
    e, s = chatml.hf.eos_token, "<|im_start|>"
    assert text == f"{chatml.hf.bos_token}{s}system\n{TOOLS_BLOCK}{e}\n{s}" + HERMES_TURNS.format(s=s, e=e)
    rendered = chatml.encode(ChatPrompt.from_messages(CONV, [WEATHER]), max_model_len=4096, max_prompt_bytes=None)
    assert rendered.token_ids == chatml.hf.encode(text, add_special_tokens=False)


def test_a_template_that_knows_tools_gets_them_as_hugging_face_passes_them(knows_tools: ChatTemplate) -> None:
    assert knows_tools.supports_tools
    prompt = ChatPrompt.from_messages(CONV, [WEATHER])
    hf_messages = [
        CONV[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**CALL, "function": {**CALL["function"], "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "22 C", "tool_call_id": "call_1", "name": "get_weather"},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_2"},
    ]
    assert prompt.as_dicts() == hf_messages
    want = knows_tools.hf.apply_chat_template(hf_messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    text = knows_tools.render(prompt)
    assert text == want
    assert '"get_weather"' in text and '{"city": "Paris"}' in text and "<|im_start|>tool\n22 C" in text
    assert "<tool_response>" not in text  # no Hermes rewrite on top of the template's own format


@pytest.mark.parametrize(
    ("conv", "tools", "match"),
    [
        ([{"role": "user", "content": "x"}], {"type": "function"}, "tools must be a JSON array"),
        ([{"role": "user", "content": "x"}], [{"type": "function", "function": {}}], r"tools\[0\].function.name"),
        ([{"role": "tool", "content": ""}], None, r"messages\[0\].content is empty"),
        (
            [{"role": "user", "content": "x", "tool_calls": [CALL]}],
            None,
            r"messages\[0\].tool_calls is set on a 'user'",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[]"}}]}],
            None,
            r"messages\[0\].tool_calls\[0\].arguments must be a JSON object",
        ),
    ],
)
def test_malformed_tools_are_refused_naming_the_field(
    chatml: ChatTemplate, conv: list, tools: object, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        chatml.render(ChatPrompt.from_messages(conv, tools))
