"""The offline API, in vLLM's shape:

from draftwise.worker import LLM, SamplingParams
llm = LLM()                                   # the embedded default model
outs = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from draftwise.worker.config import EngineConfig
from draftwise.worker.engine import LLMEngine
from draftwise.worker.outputs import RequestOutput
from draftwise.worker.sampling_params import SamplingParams
from draftwise.worker.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    """An engine plus a blocking ``generate`` over many prompts."""

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
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
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"got {len(params)} sampling_params for {len(batch)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
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


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    seq = list(prompts)
    if seq and all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
        return [seq]  # one prompt of token ids
    return seq
