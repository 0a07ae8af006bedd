"""The offline API, in vLLM's shape:

from draftwise.worker import LLM, SamplingParams
llm = LLM()                                   # the embedded default model
outs = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64))
print(outs[0].outputs[0].text)
llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))  # a model with a chat template

Every keyword is an EngineConfig field under vLLM's name (``speculative_model=``,
``num_speculative_tokens=``, ``enable_chunked_prefill=``, ``max_num_seqs=``,
``gpu_memory_utilization=``, ``tensor_parallel_size=``, ...); a Hugging Face name
(``meta-llama/Meta-Llama-3-8B``) is its local copy (draftwise.worker.paths: nothing is
downloaded); vLLM's ``use_v2_block_manager=`` is accepted and changes nothing (a notice on stderr).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from tqdm.auto import tqdm

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.core.outputs import RequestOutput
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.paths import is_hub_name, local_copy
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.chat import ChatPrompt
from draftwise.worker.text.tokenizer import Tokenizer

Prompt = str | Sequence[int]
USE_V2_BLOCK_MANAGER_NOTICE = (
    "notice: use_v2_block_manager changes nothing: draftwise has one block manager (paged KV blocks, the only one), "
    "always on"
)
Conversation = Sequence[Mapping[str, Any]]


class LLM:
    """An engine plus a blocking ``generate`` over many prompts."""

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        if kwargs.pop("use_v2_block_manager", None) is not None:
            print(USE_V2_BLOCK_MANAGER_NOTICE, file=sys.stderr)
        spec = kwargs.get("speculative_model")
        if spec is not None and is_hub_name(spec):  # the draft's loader reads paths; the engine resolves model
            kwargs["speculative_model"] = local_copy(str(spec))
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs in prompt order.
        A bad prompt or parameter raises ValueError and leaves no request behind."""
        batch = _as_prompt_list(prompts)
        params = _params_for(sampling_params, len(batch), "prompts")
        return self._run([(p, None, sp) for p, sp in zip(batch, params, strict=True)], use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or
        several (a list of such lists), as vLLM's ``LLM.chat``: each is rendered with the
        model's chat template (generation prompt appended) and stops at the template's
        end-of-turn token. ValueError when the model has no chat template, a conversation is
        empty, a role is unknown to the template, or a conversation is too long."""
        convs = _as_conversation_list(messages)
        params = _params_for(sampling_params, len(convs), "conversations")
        items: list[tuple[Prompt, list[int] | None, SamplingParams]] = []
        for conv, p in zip(convs, params, strict=True):
            chat = self.engine.encode_chat(ChatPrompt.from_messages(conv))
            items.append((chat.text, chat.token_ids, chat.sampling_params(p, self.engine.eos_token_ids)))
        return self._run(items, use_tqdm)

    def _run(self, items: list[tuple[Prompt, list[int] | None, SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        """Add every (prompt, its token ids when known, params) and step until all finished."""
        ids: list[str] = []
        try:
            for prompt, prompt_ids, p in items:
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, prompt_token_ids=prompt_ids)
                ids.append(rid)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            while self.engine.has_unfinished_requests():  # drain the abort notices
                self.engine.step()
            raise
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                out = self.engine.step()
                for o in out.finished:
                    if o.request_id in wanted:
                        done[o.request_id] = o
                        bar.update(1)
        return [done[r] for r in ids]


def _params_for(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int, what: str
) -> list[SamplingParams]:
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or SamplingParams()] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} {what}")
    return params


def _as_conversation_list(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    seq = list(messages) if isinstance(messages, Sequence) and not isinstance(messages, str) else None
    if seq is None:
        raise ValueError(
            f"messages must be a list of {{'role', 'content'}} dicts (or a list of such lists), got {type(messages).__name__}"
        )
    if seq and all(isinstance(c, Sequence) and not isinstance(c, str | Mapping) for c in seq):
        return cast(list[Conversation], seq)  # several conversations
    return [cast(Conversation, seq)]  # one conversation


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    seq = list(prompts)
    if seq and all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
        return [cast(Prompt, seq)]  # one prompt of token ids
    return cast(list[Prompt], seq)
