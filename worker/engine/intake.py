"""Requests in: what a caller submits (text or token ids, sampling parameters, a failover's
continuation) becomes a :class:`Request`, or a ValueError that names the problem and touches
nothing. Tokenization and chat rendering touch no engine state, so callers may run them off the
engine thread (AsyncEngine does)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

from draftwise.worker.core.request import Request
from draftwise.worker.engine.continuation import check_continuation
from draftwise.worker.sampling.grammar import GrammarCompiler
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.text.chat import ChatPrompt, ChatTemplate, RenderedChat
from draftwise.worker.text.tokenizer import Tokenizer


class Intake:
    """Tokenizes, validates and builds requests for one engine."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        folder: Path,
        config_eos_ids: tuple[int, ...],
        max_model_len: int,
        vocab_size: int,
        seed: int | None,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_ids(folder, config_eos_ids, tokenizer)
        self.chat_template = ChatTemplate(tokenizer) if tokenizer is not None else None
        self.max_prompt_bytes: int | None = None  # text prompts longer than this cannot fit: refused untokenized
        if tokenizer is not None:
            # x2: normalizers may shrink text (NFKC), so a token can stand for more input than it decodes to
            self.max_prompt_bytes = max_model_len * max(tokenizer.max_token_bytes(), 4) * 2
        self._seed_rng = random.Random(seed)
        # constraints (SamplingParams.constraint) compile against the tokenizer's vocabulary
        self.grammar = None if tokenizer is None else GrammarCompiler(tokenizer.hf, vocab_size, self.eos_token_ids)

    def compile_constraint(self, params: SamplingParams) -> None:
        """Compile ``params.constraint`` into the cache (thread-safe: AsyncEngine runs it off the
        engine thread); ValueError for one that cannot be used."""
        if params.constraint is None:
            return
        if self.grammar is None:
            raise ValueError("constraints need a tokenizer (the engine runs with skip_tokenizer_init)")
        self.grammar.compile(params.constraint)

    def encode_prompt(self, prompt: str) -> list[int]:
        """Tokenize a text prompt; ValueError for one that is empty or too long. A prompt whose
        byte length alone shows it cannot fit in max_model_len is refused without tokenizing."""
        if not prompt:
            raise ValueError("prompt is empty")
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (the engine runs with skip_tokenizer_init)")
        size = len(prompt.encode("utf-8", errors="surrogatepass"))
        if self.max_prompt_bytes is not None and size > self.max_prompt_bytes:
            raise ValueError(
                f"prompt is {size} bytes, more than can fit in max_model_len={self.max_model_len} tokens "
                f"(at most {self.max_prompt_bytes} bytes of text)"
            )
        return self.tokenizer.encode(prompt)

    def encode_chat(self, prompt: ChatPrompt) -> RenderedChat:
        """Render chat messages with the model's chat template and tokenize them; ValueError
        for no template, a bad conversation or one too long."""
        if self.chat_template is None:
            raise ValueError("chat messages need a tokenizer (the engine runs with skip_tokenizer_init)")
        return self.chat_template.encode(prompt, self.max_model_len, self.max_prompt_bytes)

    def build(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None,
        prompt_token_ids: Sequence[int] | None,
        continuation: Sequence[int],
    ) -> Request:
        """The request (without its seed: :meth:`seed_for`, once nothing else can refuse it);
        a continuation becomes its first output tokens. ValueError for anything invalid."""
        if isinstance(prompt, str) and prompt_token_ids is not None:  # tokenized already (encode_prompt)
            text, ids = prompt, list(prompt_token_ids)
        else:
            text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens; it must be shorter than max_model_len={self.max_model_len} "
                "to leave room for output"
            )
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            # refused, not silently capped (vLLM and OpenAI answer 400): a continuation keeps the
            # original prompt and max_tokens, so its tokens so far never count against it twice
            raise ValueError(
                f"max_tokens={params.max_tokens} is too large: the prompt is {len(ids)} tokens and "
                f"prompt + max_tokens ({len(ids) + params.max_tokens}) must be at most "
                f"max_model_len={self.max_model_len}; ask for at most {room} tokens"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        eos = () if params.ignore_eos else self.eos_token_ids
        cont = check_continuation(continuation, self.vocab_size, len(ids), self.max_model_len, max_tokens, eos, params)
        req = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=eos,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
        )
        if cont:
            req.output_token_ids.extend(cont)
            if params.logprobs is not None:  # not known here: the client has them already
                req.output_logprobs.extend([None] * len(cont))
        return req

    def seed_for(self, params: SamplingParams) -> int | None:
        """What keys a request's randomness with each token's position: its own seed, or one
        drawn from the engine's; None for greedy requests (they use no randomness)."""
        if params.is_greedy:
            return None
        return params.seed if params.seed is not None else self._seed_rng.getrandbits(63)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.encode_prompt(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {t!r}")
        return None, ids


def eos_ids(folder: Path, from_config: tuple[int, ...], tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """End-of-sequence ids: config.json, generation_config.json and the tokenizer, together."""
    ids = set(from_config)
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError):
            eos = None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))
