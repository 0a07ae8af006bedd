"""A real model with a chat template for the chat tests: the embedded default target (real
weights, real tokenizer) copied to a folder whose tokenizer_config.json gains a ChatML-style
``chat_template``. The default tokenizer has no ``<|im_start|>``/``<|im_end|>`` tokens, so
the template writes ``<|im_start|>`` as plain text (it tokenizes) and closes each turn with
the model's own EOS, ``</s>`` (a special token): the end-of-turn token the worker stops on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from draftwise.worker import default_model_path

CHATML_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + END + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with END standing for the end-of-turn token (filled in by ``make_chat_model``)."""

STRICT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{{ '[' + message['role'] + '] ' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)
"""A template that refuses roles other than system, user and assistant (as Llama 2's does)."""

DROPPING_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant'] %}"
    "{{ message['role'] + ': ' + message['content'] + eos_token + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
"""A template that silently leaves out messages of any other role."""


def make_chat_model(folder: Path, template: str | None = None, end_of_turn: str = "eos_token") -> Path:
    """Copy the embedded target model to ``folder`` with ``template`` (default: ChatML) as its
    chat template; ``end_of_turn`` is the Jinja expression that closes a turn (default the EOS)."""
    src = default_model_path("target")
    shutil.copytree(src, folder, dirs_exist_ok=True)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (template or CHATML_TEMPLATE).replace("END", end_of_turn)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def chat_doc_blocks(path: Path) -> list[str]:
    """The ```py blocks of a doc page: examples that need a model with a chat template or an
    HTTP endpoint, which tests/integration/test_doc_snippets.py (```python blocks, against the
    embedded default model's gRPC gateway) cannot give them; the chat and OpenAI tests run them."""
    import re

    return re.findall(r"^```py\n(.*?)^```", path.read_text(), re.S | re.M)
