"""The engine: requests in, one batched forward pass per ``step()``, token deltas out.

engine = LLMEngine(EngineConfig())
engine.add_request("a", "def fibonacci(n):", SamplingParams(max_tokens=32))
while engine.has_unfinished_requests():
    out = engine.step()   # StepOutput: deltas, finished, stats
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

from draftwise.logs import ensure_logging
from draftwise.worker import default_model_path
from draftwise.worker.block_manager import BlockManager
from draftwise.worker.config import EngineConfig
from draftwise.worker.continuation import add_spec_counters, check_continuation
from draftwise.worker.detokenizer import IncrementalDetokenizer
from draftwise.worker.gguf import is_gguf_path
from draftwise.worker.graph_runner import GraphConfig
from draftwise.worker.kv_cache import KVCache, bytes_per_block
from draftwise.worker.loader import LoadedModel, load_model
from draftwise.worker.model_config import ModelLoadError
from draftwise.worker.model_runner import ModelRunner, SequenceChunk
from draftwise.worker.outputs import RequestDelta, RequestOutput, SpecStats, StepOutput, StepStats
from draftwise.worker.request import FinishReason, Request, RequestStatus
from draftwise.worker.sampler import Sampler, SamplingRow, TokenLogprobs, processed_probs, token_logprobs
from draftwise.worker.sampling_params import SamplingParams
from draftwise.worker.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from draftwise.worker.spec.draft import DraftModelProposer
from draftwise.worker.spec.ngram import NgramProposer
from draftwise.worker.spec.policy import CostModel, PolicyConfig, RequestSpecState, SpeculationPolicy
from draftwise.worker.spec.rejection_sampler import rejection_sample
from draftwise.worker.tokenizer import Tokenizer, load_tokenizer

log = structlog.get_logger("draftwise.engine")

CPU_MAX_DEFAULT_KV_BYTES = 1 << 30
"""The CPU default KV budget: enough for max_num_seqs sequences at max_model_len tokens, but
at most this and at most CPU_MAX_DEFAULT_KV_SHARE of the machine's memory."""
CPU_MAX_DEFAULT_KV_SHARE = 1 / 8
DEFAULT_CHUNKED_BATCH_TOKENS = 2048

_FATAL_MARKERS = (
    "out of memory",
    "cuda error",
    "cublas",
    "cudnn",
    "device-side assert",
    "illegal memory access",
    "nccl",
    "hip error",
)


class EngineDeadError(RuntimeError):
    """The engine hit an error that poisons the whole step (device error, out of memory, a
    broken invariant) and stopped: every request on it is lost; the process should exit so
    that a supervisor replaces it."""


def is_step_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` poisons the whole step rather than one request's rows: out of memory
    and device errors (after which the device state cannot be trusted)."""
    if isinstance(exc, MemoryError | torch.OutOfMemoryError | EngineDeadError):
        return True
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, ...
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _FATAL_MARKERS)


class LLMEngine:
    """Continuous batching over a paged KV cache, with chunked prefill and preemption."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        ensure_logging()
        self.config = config = config or EngineConfig()
        folder = Path(config.model) if config.model is not None else default_model_path("target")
        spec_model = config.speculative_model
        if spec_model is not None and str(spec_model) != "default" and not _is_checkpoint(spec_model):
            # before the (possibly long) target load
            raise ModelLoadError(
                f"speculative_model: {spec_model}: not a checkpoint folder or .gguf file (or 'default')"
            )
        self.loaded: LoadedModel = load_model(folder, dtype=config.dtype, device=config.device)
        mcfg = self.loaded.config
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={mcfg.max_position_embeddings}"
            )
        self.tokenizer: Tokenizer | None = None
        if not config.skip_tokenizer_init:
            self.tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else folder)
        self.eos_token_ids = _eos_ids(folder, mcfg.eos_token_ids, self.tokenizer)
        self.max_prompt_bytes: int | None = None  # text prompts longer than this cannot fit: refused untokenized
        if self.tokenizer is not None:
            # x2: normalizers may shrink text (NFKC), so a token can stand for more input than it decodes to
            self.max_prompt_bytes = self.max_model_len * max(self.tokenizer.max_token_bytes(), 4) * 2

        max_batched = config.max_num_batched_tokens or (
            DEFAULT_CHUNKED_BATCH_TOKENS if config.enable_chunked_prefill else self.max_model_len
        )
        if not config.enable_chunked_prefill and max_batched < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({max_batched}) must be >= max_model_len "
                f"({self.max_model_len}) so that every prompt fits in one step"
            )
        if max_batched < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= max_num_seqs ({config.max_num_seqs}): "
                "every running request needs at least one token per step"
            )
        draft = self._load_draft()
        num_blocks = self._num_kv_blocks(max_batched, draft)
        capacity = num_blocks * config.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {config.block_size}), fewer than "
                f"max_model_len={self.max_model_len}: raise the KV budget or lower max_model_len"
            )
        self.kv_cache = KVCache(mcfg, num_blocks, config.block_size, self.loaded.dtype, self.loaded.device)
        self.runner = ModelRunner(self.loaded, self.kv_cache)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self._init_speculation(draft, num_blocks)
        self.graph_capture_seconds = self._capture_graphs(max_batched)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max_batched,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.blocks,
            on_release=self._release_spec,
        )
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self._seed_rng = random.Random(config.seed)
        self._pending: list[tuple[RequestDelta, RequestOutput]] = []  # aborts, reported next step
        self._doomed: list[tuple[Request, BaseException]] = []  # failed while scheduling; finished after it
        self.dead: str | None = None  # why the engine stopped (EngineDeadError); None while it runs
        self.num_steps = 0
        self.num_request_errors = 0  # requests the engine failed on their own (the others went on)
        log.info(
            "kv cache ready",
            blocks=num_blocks,
            block_size=config.block_size,
            capacity_tokens=capacity,
            kv_mib=round(self.kv_cache.num_bytes / 2**20, 1),
            weights_mib=round(self.loaded.weight_bytes / 2**20, 1),
            max_model_len=self.max_model_len,
            max_num_batched_tokens=max_batched,
            attention_backend=self.runner.backend.name,
            speculation=self.spec_method,
        )

    # ------------------------------------------------------------------ sizing

    def _capture_graphs(self, max_batched: int) -> float:
        """On CUDA without ``enforce_eager``: CUDA graphs of the target's decode and verify
        steps (1 + k tokens per request) and of the draft's propose steps (a catch-up of 1 or
        2 tokens, then 1), for batch-size buckets up to max_num_seqs, all in one memory pool
        (docs/kernels.md). Returns the seconds capture took (0.0: none)."""
        cfg = self.config
        if self.loaded.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        k = cfg.spec_k if self.spec_method is not None else 0
        target = self.runner.enable_graphs(
            GraphConfig.for_steps(cfg.max_num_seqs, 1 + k, max_batched, self.max_model_len), pool, cfg.enforce_eager
        )
        draft = None
        if self.proposer is not None:
            draft = self.proposer.runner.enable_graphs(
                GraphConfig.for_steps(cfg.max_num_seqs, 2, max_batched, self.max_model_len), pool, cfg.enforce_eager
            )
        seconds = time.perf_counter() - t0
        log.info(
            "cuda graph capture",
            seconds=round(seconds, 2),
            target_graphs=target.num_graphs if target else 0,
            draft_graphs=draft.num_graphs if draft else 0,
            enforce_eager=cfg.enforce_eager,
        )
        return seconds if target or draft else 0.0

    def _load_draft(self) -> LoadedModel | None:
        """The draft model, when speculative_method is "draft" (checked against the target)."""
        cfg = self.config
        if cfg.spec_method != "draft":
            return None
        name = str(cfg.speculative_model)
        folder = default_model_path("draft") if name == "default" else Path(name)
        try:
            draft = load_model(folder, dtype=self.loaded.dtype, device=self.loaded.device)
        except ModelLoadError as e:
            raise ModelLoadError(f"speculative_model: {e}") from e
        if draft.config.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"the draft model's context ({draft.config.max_position_embeddings}) is shorter than "
                f"max_model_len={self.max_model_len}: lower max_model_len"
            )
        if draft.config.vocab_size > self.loaded.config.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({draft.config.vocab_size}) is larger than the target's "
                f"({self.loaded.config.vocab_size}): draft and target must share a tokenizer"
            )
        return draft

    def _init_speculation(self, draft: LoadedModel | None, num_blocks: int) -> None:
        cfg = self.config
        self.spec_method: str | None = cfg.spec_method
        self.proposer: DraftModelProposer | None = None
        self.ngram: NgramProposer | None = None
        if draft is not None:
            self.proposer = DraftModelProposer(draft, num_blocks, cfg.block_size, self.loaded.config.vocab_size)
        elif self.spec_method == "ngram":
            self.ngram = NgramProposer(cfg.prompt_lookup_min or 1, cfg.prompt_lookup_max or 4)
        k = cfg.spec_k
        # n-gram lookup costs next to nothing, and its matches come and go with the text (a copy
        # resumes after an edit): a request it switched off is probed again sooner
        probe_after = 8 if self.spec_method == "ngram" else PolicyConfig.probe_after
        self.policy = SpeculationPolicy(
            PolicyConfig(max_k=k, initial_k=min(4, k), probe_after=probe_after), CostModel()
        )
        self.spec_adaptive = cfg.speculative_adaptive
        self.spec_totals = {"proposed": 0, "accepted": 0, "verify_steps": 0, "draft_seconds": 0.0}
        self._ngram_seconds = 0.0

    def _num_kv_blocks(self, max_batched: int, draft: LoadedModel | None = None) -> int:
        """Blocks for the target's KV pool; with a draft model, the draft's pool gets as many
        blocks of the same size, and both come out of the one budget."""
        cfg = self.config
        per_block = bytes_per_block(self.loaded.config, cfg.block_size, self.loaded.dtype)
        if draft is not None:
            per_block += bytes_per_block(draft.config, cfg.block_size, draft.dtype)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.loaded.device.type == "cuda":
            budget = self._cuda_kv_budget(max_batched)
        else:
            return cpu_default_kv_blocks(per_block, cfg.block_size, cfg.max_num_seqs, self.max_model_len)
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"the KV budget of {budget} bytes is smaller than one block ({per_block} bytes)")
        return int(blocks)

    def _cuda_kv_budget(self, max_batched: int) -> int:
        """gpu_memory_utilization of the device, less the weights and the activation peak of
        a profiling forward pass of ``max_batched`` tokens."""
        dev = self.loaded.device
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        n = min(max_batched, self.max_model_len)
        probe = KVCache(
            self.loaded.config, -(-n // self.config.block_size), self.config.block_size, self.loaded.dtype, dev
        )
        ModelRunner(self.loaded, probe).run([SequenceChunk([0] * n, 0, list(range(probe.num_blocks)))])
        torch.cuda.synchronize(dev)
        activations = torch.cuda.max_memory_allocated(dev) - before - probe.num_bytes
        del probe
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(dev)
        budget = int(total * self.config.gpu_memory_utilization) - torch.cuda.memory_allocated(dev) - activations
        log.info(
            "cuda memory profile", total_mib=total >> 20, activations_mib=activations >> 20, kv_budget_mib=budget >> 20
        )
        return budget

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        continuation: Sequence[int] = (),
        continuation_spec: SpecStats | None = None,
    ) -> Request:
        """Queue a request. Raises ValueError (touching nothing) for a bad one,
        EngineDeadError once the engine has stopped.

        ``continuation``: output tokens the request already has (a failover resubmission).
        They become its first output tokens, prefilled with the prompt, and count for
        max_tokens, min_tokens, penalties and stop checks; the detokenizer reads them without
        releasing text; the first delta has first_token_index = len(continuation).
        ``continuation_spec``: their speculation counters, added to the request's own."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
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
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer (the engine runs with skip_tokenizer_init)")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos_ids = () if params.ignore_eos else self.eos_token_ids
        cont = check_continuation(
            continuation, self.loaded.config.vocab_size, len(ids), self.max_model_len, max_tokens, eos_ids, params
        )
        seed = None  # keys the request's randomness with each token's position
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                stop=params.stop or (),
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
            )
            if cont and detok.prime(cont) is not None:
                raise ValueError(
                    f"continuation is already finished: its text contains the stop string {detok.stop_matched!r}"
                )
        req = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=ids,
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=eos_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            seed=seed,
            detokenizer=detok,
        )
        if cont:
            req.output_token_ids.extend(cont)
            if params.logprobs is not None:  # not known here: the client has them already
                req.output_logprobs.extend([None] * len(cont))
        if self.spec_method is not None and params.use_speculation:
            req.spec = self.policy.new_state(params.max_speculative_tokens)
            if continuation_spec is not None:
                add_spec_counters(req.spec, continuation_spec)
        self.requests[request_id] = req
        self.scheduler.add(req)
        log.debug(
            "request added",
            request_id=request_id,
            prompt_tokens=len(ids),
            max_tokens=max_tokens,
            continuation_tokens=len(cont),
        )
        return req

    def encode_prompt(self, prompt: str) -> list[int]:
        """Tokenize a text prompt; ValueError for one that is empty or too long. A prompt whose
        byte length alone shows it cannot fit in max_model_len is refused without tokenizing.
        Touches no engine state, so callers may run it off the engine thread (AsyncEngine does)."""
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

    def _prompt_ids(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.encode_prompt(prompt)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.loaded.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
        return None, ids

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final delta comes with the next step.
        False if no such request is unfinished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self.scheduler.remove(req)
        text = req.detokenizer.output_text if req.detokenizer else ""
        self._finish(req, FinishReason.ABORT)
        final = RequestOutput.of(req, text)
        delta = RequestDelta(
            request_id=request_id,
            token_ids=[],
            first_token_index=len(req.output_token_ids),
            text="",
            logprobs=None,
            finished=True,
            finish_reason=FinishReason.ABORT.value,
            final=final,
        )
        self._pending.append((delta, final))
        log.info("request aborted", request_id=request_id, output_tokens=len(req.output_token_ids))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ------------------------------------------------------------------ stepping

    def step(self) -> StepOutput:
        """One engine step. An error that belongs to one request finishes that request
        (finish_reason "error") and the step goes on for the others; anything else (out of
        memory, a device error, a broken invariant) raises EngineDeadError, after which the
        engine refuses all work."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        try:
            return self._step()
        except BaseException as e:
            self.dead = f"{type(e).__name__}: {e}"
            log.error("engine step failed; the engine stops", error=self.dead, exc_info=True)
            if isinstance(e, EngineDeadError):
                raise
            raise EngineDeadError(f"the engine stopped after a step-wide error: {self.dead}") from e

    def _step(self) -> StepOutput:
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        deltas = [d for d, _ in pending]
        finished = [o for _, o in pending]
        self._ngram_seconds = 0.0
        lookahead = None
        if self.spec_method is not None and self.policy.may_pay(len(self.scheduler.running), self.spec_adaptive):
            lookahead = self._lookahead
        sched = self.scheduler.schedule(lookahead)
        scheduled = sched.scheduled
        if self._doomed:  # requests whose own part of scheduling failed (their n-gram lookup, ...)
            doomed, self._doomed = self._doomed, []
            for req, err in doomed:
                self._fail(req, err, deltas, finished)
            scheduled = [s for s in scheduled if not s.request.is_finished]
        spec_counts = (0, 0)
        if scheduled:
            spec_counts = self._execute(scheduled, deltas, finished)
        self.num_steps += 1
        stats = StepStats(
            num_scheduled=len(scheduled),
            num_batched_tokens=sum(s.num_new_tokens for s in scheduled),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted=len(sched.preempted),
            num_free_blocks=self.blocks.num_free_blocks,
            step_time=time.perf_counter() - t0,
            num_spec_proposed=spec_counts[0],
            num_spec_accepted=spec_counts[1],
        )
        return StepOutput(deltas=deltas, finished=finished, stats=stats)

    # ------------------------------------------------------------------ speculation

    def _lookahead(self, req: Request, batch_size: int) -> int:
        """Draft tokens ``req`` (decoding) gets this step: the policy's k, within what is left
        of its max_tokens and of the context. For n-gram lookup, the drafts themselves are
        found here (k is then what the lookup found)."""
        req.spec_draft_ids = []
        st = req.spec
        if st is None or st.limit == 0:
            return 0
        try:
            return self._lookahead_one(req, st, batch_size)
        except Exception as e:
            if is_step_fatal(e):
                raise
            self._doomed.append((req, e))
            return 0

    def _lookahead_one(self, req: Request, st: RequestSpecState, batch_size: int) -> int:
        if self.proposer is not None and not self.proposer.can_draft(req):
            st.cap = st.limit = 0  # tokens the draft cannot read: this request is not speculated any more
            self.proposer.release(req)
            return 0
        room = min(req.max_tokens - len(req.output_token_ids) - 1, self.max_model_len - req.num_tokens)
        k = st.limit if not self.spec_adaptive else self.policy.choose_k(st, batch_size)
        k = min(k, room)
        if k <= 0:
            return 0
        if self.ngram is not None:
            t0 = time.perf_counter()
            req.spec_draft_ids = self.ngram.propose(req.all_token_ids, k)
            self._ngram_seconds += time.perf_counter() - t0
            return len(req.spec_draft_ids)
        return k

    def _release_spec(self, req: Request) -> None:
        """The scheduler freed ``req``'s blocks: its draft KV goes too."""
        req.spec_draft_ids = []
        if self.proposer is not None:
            self.proposer.release(req)

    def _propose(self, spec: list[ScheduledRequest]) -> dict[str, torch.Tensor | None]:
        """Fill ``spec_draft_ids`` of the requests verifying drafts this step; per request id
        its draft distributions q ([k, vocab]), or None where the verifier treats q as one-hot
        (n-gram lookup; greedy rows of an all-greedy batch)."""
        ks = [s.num_draft_tokens for s in spec]
        if self.proposer is None:
            for s, k in zip(spec, ks, strict=True):
                s.request.spec_draft_ids = s.request.spec_draft_ids[:k]
            self.policy.costs.record_draft(len(self.scheduler.running), self._ngram_seconds / max(ks))
            return {s.request.request_id: None for s in spec}
        prop = self.proposer.propose([s.request for s in spec], ks)
        for s, d in zip(spec, prop.token_ids, strict=True):
            s.request.spec_draft_ids = d
        if prop.seconds_per_step is not None:
            self.policy.costs.record_draft(len(spec), prop.seconds_per_step)
        self.spec_totals["draft_seconds"] += prop.seconds
        qs = [None] * len(spec) if prop.probs is None else list(prop.probs.split(ks))
        return {s.request.request_id: q for s, q in zip(spec, qs, strict=True)}

    def _propose_contained(
        self, spec: list[ScheduledRequest], deltas: list[RequestDelta], finished: list[RequestOutput]
    ) -> dict[str, torch.Tensor | None]:
        """``_propose``; when the batch fails, each request proposes alone from a clean draft
        cache, and those that still fail are finished with their error."""
        try:
            return self._propose(spec)
        except Exception as e:
            if is_step_fatal(e):
                raise
            log.warning("proposal failed for the batch; isolating", error=repr(e), requests=len(spec))
        out: dict[str, torch.Tensor | None] = {}
        for s in spec:
            if self.proposer is not None:
                self.proposer.release(s.request)  # whatever the failed batch left in its draft cache
            try:
                out.update(self._propose([s]))
            except Exception as e:
                if is_step_fatal(e):
                    raise
                self._fail(s.request, e, deltas, finished)
        return out

    def _run_contained(
        self, scheduled: list[ScheduledRequest], deltas: list[RequestDelta], finished: list[RequestOutput]
    ) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """The forward pass; when it fails, each sequence runs alone to find the ones that
        fail by themselves (finished with their error), and the rest run again together.
        Rerunning is safe: a forward pass only writes KV at positions not yet counted."""
        try:
            return scheduled, self.runner.run([self._chunk(s) for s in scheduled])
        except Exception as e:
            if is_step_fatal(e):
                raise
            first = e
        log.warning("forward pass failed; isolating", error=repr(first), sequences=len(scheduled))
        survivors = []
        for s in scheduled:
            try:
                self.runner.run([self._chunk(s)])
                survivors.append(s)
            except Exception as e:
                if is_step_fatal(e):
                    raise
                self._fail(s.request, e, deltas, finished)
        if not survivors:
            return [], torch.empty(0)
        if len(survivors) == len(scheduled):  # no sequence fails alone: the batch itself is broken
            raise EngineDeadError(f"the forward pass fails for the batch but for no sequence alone: {first!r}")
        return survivors, self.runner.run([self._chunk(s) for s in survivors])

    @staticmethod
    def _chunk(s: ScheduledRequest) -> SequenceChunk:
        r = s.request
        start = r.num_computed_tokens
        if s.num_draft_tokens:
            return SequenceChunk(
                r.token_slice(start, start + 1) + r.spec_draft_ids, start, r.block_table, 1 + s.num_draft_tokens
            )
        return SequenceChunk(
            r.token_slice(start, start + s.num_new_tokens), start, r.block_table, 1 if s.samples else 0
        )

    # ------------------------------------------------------------------ execution

    def _execute(
        self, scheduled: list[ScheduledRequest], deltas: list[RequestDelta], finished: list[RequestOutput]
    ) -> tuple[int, int]:
        """Run one step; returns (draft tokens verified, accepted)."""
        now = time.monotonic()
        spec = [s for s in scheduled if s.num_draft_tokens > 0]
        draft_q: dict[str, torch.Tensor | None] = {}
        if spec:
            draft_q = self._propose_contained(spec, deltas, finished)
            scheduled = [s for s in scheduled if not s.request.is_finished]
        for s in scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        pure = all(s.samples and s.num_new_tokens == 1 + s.num_draft_tokens for s in scheduled)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        t0 = time.perf_counter()
        scheduled, logits = self._run_contained(scheduled, deltas, finished)  # [sum of num_logits, vocab]
        plain: list[tuple[Request, int]] = []  # (request, its logits row)
        verify: list[tuple[ScheduledRequest, int]] = []  # (request, its first logits row)
        row = 0
        for s in scheduled:
            if s.num_draft_tokens:
                verify.append((s, row))
                row += 1 + s.num_draft_tokens
                continue
            samples = s.samples  # before num_computed_tokens moves
            s.request.num_computed_tokens += s.num_new_tokens
            if samples:
                plain.append((s.request, row))
                row += 1
        if plain:
            self._sample_plain(logits, plain, deltas, finished)
        counts = self._verify(logits, verify, draft_q, deltas, finished) if verify else (0, 0)
        if self.spec_method is not None and pure:
            # a pure decode/verify step: its cost (forward, sampling or verification, outputs)
            # feeds the speculation policy; the draft's share is recorded by _propose
            self.policy.costs.record_target(num_tokens, time.perf_counter() - t0)
        return counts

    def _emit(
        self,
        r: Request,
        tokens: list[int],
        lps: list[TokenLogprobs | None],
        deltas: list[RequestDelta],
        finished: list[RequestOutput],
    ) -> RequestDelta | None:
        """Append ``tokens`` to ``r`` and report them; None when that failed (``r`` is then
        finished with its error, its unsent tokens dropped)."""
        sent = len(r.output_token_ids)
        try:
            delta = self._append(r, tokens, lps)
        except Exception as e:
            if is_step_fatal(e):
                raise
            del r.output_token_ids[sent:]
            del r.output_logprobs[sent:]
            self._fail(r, e, deltas, finished)
            return None
        if delta.finished:
            final = RequestOutput.of(r, r.detokenizer.output_text if r.detokenizer else "")
            delta = dataclasses.replace(delta, final=final)
            finished.append(final)
        deltas.append(delta)
        return delta

    def _fail(
        self, req: Request, err: BaseException, deltas: list[RequestDelta], finished: list[RequestOutput]
    ) -> None:
        """Finish ``req`` because of an error of its own: its blocks go back, and its final
        delta (finish_reason "error") carries the reason. The other requests go on."""
        if req.is_finished:
            return
        message = f"{type(err).__name__}: {err}"
        log.error("request failed in the engine", request_id=req.request_id, error=message, exc_info=err)
        self.num_request_errors += 1
        self.scheduler.remove(req)
        self._finish(req, FinishReason.ERROR)
        error = f"the engine failed this request ({message}); other requests were not affected"
        final = RequestOutput.of(req, req.detokenizer.output_text if req.detokenizer else "", error=error)
        finished.append(final)
        deltas.append(
            RequestDelta(
                request_id=req.request_id,
                token_ids=[],
                first_token_index=len(req.output_token_ids),
                text="",
                logprobs=None,
                finished=True,
                finish_reason=FinishReason.ERROR.value,
                final=final,
                spec=SpecStats.of(req),
                error=error,
            )
        )

    def _sample_plain(
        self,
        logits: torch.Tensor,
        plain: list[tuple[Request, int]],
        deltas: list[RequestDelta],
        finished: list[RequestOutput],
    ) -> None:
        reqs = [r for r, _ in plain]
        rows = [r.sampling_row() for r in reqs]
        idx = [i for _, i in plain]
        if idx != list(range(logits.shape[0])):
            logits = logits[torch.tensor(idx, device=logits.device)]
        try:
            out = self.sampler(logits, rows)
            results = list(zip(reqs, out.token_ids, out.logprobs, strict=True))
        except Exception as e:
            if is_step_fatal(e):
                raise
            log.warning("sampling failed for the batch; isolating", error=repr(e), rows=len(rows))
            results = []
            for i, (r, row) in enumerate(zip(reqs, rows, strict=True)):
                try:
                    one = self.sampler(logits[i : i + 1], [row])
                    results.append((r, one.token_ids[0], one.logprobs[0]))
                except Exception as e1:
                    if is_step_fatal(e1):
                        raise
                    self._fail(r, e1, deltas, finished)
        for r, tok, lp in results:
            self._emit(r, [tok], [lp], deltas, finished)

    def _verify(
        self,
        logits: torch.Tensor,
        verify: list[tuple[ScheduledRequest, int]],
        draft_q: dict[str, torch.Tensor | None],
        deltas: list[RequestDelta],
        finished: list[RequestOutput],
    ) -> tuple[int, int]:
        """Rejection-sample the drafted tokens against the target's distributions; when the
        batch fails, each request is verified alone and those that still fail are finished."""
        try:
            results = self._verify_batch(logits, verify, draft_q)
        except Exception as e:
            if is_step_fatal(e):
                raise
            log.warning("verification failed for the batch; isolating", error=repr(e), requests=len(verify))
            results = []
            for item in verify:
                try:
                    results.extend(self._verify_batch(logits, [item], draft_q))
                except Exception as e1:
                    if is_step_fatal(e1):
                        raise
                    self._fail(item[0].request, e1, deltas, finished)
        proposed = accepted = 0
        for s, toks, a, lps in results:
            r, k = s.request, s.num_draft_tokens
            try:
                assert r.spec is not None
                self.policy.update(r.spec, k, a)
                num_tokens_before = r.num_tokens
                r.num_computed_tokens += (
                    1 + a
                )  # the token verified plus the accepted drafts; the last emitted one is new
                r.spec_draft_ids = []
                delta = self._emit(r, toks, lps, deltas, finished)
                if delta is not None and not delta.finished:
                    self.blocks.shrink(r.block_table, r.num_tokens)  # rejected positions' blocks go back
                    if self.proposer is not None:
                        self.proposer.settle(r, num_tokens_before, k, a)
            except Exception as e:
                if is_step_fatal(e):
                    raise
                self._fail(r, e, deltas, finished)
                continue
            proposed += k
            accepted += a
        self.spec_totals["proposed"] += proposed
        self.spec_totals["accepted"] += accepted
        self.spec_totals["verify_steps"] += len(results)
        return proposed, accepted

    def _verify_batch(
        self,
        logits: torch.Tensor,  # [sum of num_logits, vocab]
        verify: list[tuple[ScheduledRequest, int]],
        draft_q: dict[str, torch.Tensor | None],
    ) -> list[tuple[ScheduledRequest, list[int], int, list[TokenLogprobs | None]]]:
        """(request, tokens, accepted, logprobs) for each of ``verify``; touches no request."""
        idx: list[int] = []
        rows: list[SamplingRow] = []
        for s, first in verify:
            r, k = s.request, s.num_draft_tokens
            idx.extend(range(first, first + k + 1))
            rows.extend(r.sampling_row(r.spec_draft_ids[:j]) for j in range(k + 1))
        v_logits = logits[torch.tensor(idx, device=logits.device)]  # [sum(k + 1), vocab]
        p = processed_probs(v_logits, rows)  # [sum(k + 1), vocab]
        reqs = [s.request for s, _ in verify]
        res = rejection_sample(
            p,
            [r.spec_draft_ids for r in reqs],
            _stack_q([draft_q.get(r.request_id) for r in reqs], [r.spec_draft_ids for r in reqs], p),
            [r.sampling_params.is_greedy for r in reqs],
            [r.seed for r in reqs],
            [r.num_tokens for r in reqs],  # the position of each request's first draft
            [r.sampling_params.seed is not None for r in reqs],  # seeded: Gumbel coupling, output as plain sampling
        )
        out = []
        base = 0
        for (s, _), toks, a in zip(verify, res.token_ids, res.num_accepted, strict=True):
            r, k = s.request, s.num_draft_tokens
            lps: list[TokenLogprobs | None] = [None] * len(toks)
            if r.sampling_params.logprobs is not None:
                lps = token_logprobs(
                    v_logits[base : base + len(toks)],
                    rows[base : base + len(toks)],
                    torch.tensor(toks, device=p.device),
                )
            base += k + 1
            out.append((s, toks, a, lps))
        return out

    def _append(self, req: Request, tokens: Sequence[int], logprobs: Sequence[TokenLogprobs | None]) -> RequestDelta:
        """Add sampled tokens to ``req`` one at a time, stopping at the first finish condition."""
        params = req.sampling_params
        first = len(req.output_token_ids)
        new: list[int] = []
        new_lp: list[TokenLogprobs | None] = []
        text: list[str] = []
        detok = req.detokenizer
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        for tok, lp in zip(tokens, logprobs, strict=True):
            req.output_token_ids.append(tok)
            new.append(tok)
            new_lp.append(lp)
            if params.logprobs is not None:
                req.output_logprobs.append(lp)
            if tok in params.stop_token_ids or tok in req.eos_token_ids:
                # the stop token's id is reported; its text is not
                if detok is not None:
                    text.append(detok.flush())
                self._finish(req, FinishReason.STOP, tok if tok in params.stop_token_ids else None)
                break
            if detok is not None:
                d = detok.add_tokens([tok])
                text.append(d.text)
                if d.stop_matched is not None:
                    self._finish(req, FinishReason.STOP, d.stop_matched)
                    break
            if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
                if detok is not None:
                    text.append(detok.flush())
                self._finish(req, FinishReason.LENGTH)
                break
        if req.is_finished:
            self.scheduler.remove(req)
        return RequestDelta(
            request_id=req.request_id,
            token_ids=new,
            first_token_index=first,
            text="".join(text),
            logprobs=new_lp if params.logprobs is not None else None,
            finished=req.is_finished,
            finish_reason=None if req.finish_reason is None else req.finish_reason.value,
            stop_reason=req.stop_reason,
            spec=SpecStats.of(req),
            num_prompt_tokens=req.num_prompt_tokens if first == 0 else None,
            queue_time=(
                req.first_scheduled_time - req.arrival_time
                if first == 0 and req.first_scheduled_time is not None
                else None
            ),
        )

    def _finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.finish_time = time.monotonic()
        self.requests.pop(req.request_id, None)
        log.debug(
            "request finished",
            request_id=req.request_id,
            reason=reason.value,
            output_tokens=len(req.output_token_ids),
            preemptions=req.num_preemptions,
        )

    def check_invariants(self) -> None:
        """Every block (target pool, and the draft pool with a draft model) is owned once by
        the request holding it, or free; no request's draft KV runs ahead of its tokens
        (tests call this)."""
        reqs = [*self.scheduler.running, *self.scheduler.waiting]
        self.blocks.pool.check(r.block_table for r in reqs)
        if self.proposer is not None:
            self.proposer.blocks.pool.check(r.draft_block_table for r in reqs)
            for r in reqs:
                if r.num_draft_computed > r.num_tokens:
                    raise AssertionError(f"{r.request_id}: draft KV of {r.num_draft_computed} > {r.num_tokens} tokens")

    def check_idle_invariants(self) -> None:
        """With no request left, every block of every pool must be free (tests call this)."""
        if self.scheduler.num_unfinished:
            raise AssertionError(f"{self.scheduler.num_unfinished} requests unfinished")
        pools = [("target", self.blocks)]
        if self.proposer is not None:
            pools.append(("draft", self.proposer.blocks))
        for name, blocks in pools:
            blocks.pool.check([])
            if blocks.num_free_blocks != blocks.num_blocks:
                raise AssertionError(f"{blocks.num_blocks - blocks.num_free_blocks} {name} blocks still in use")


def _stack_q(
    qs: list[torch.Tensor | None],
    drafts: list[list[int]],
    p: torch.Tensor,  # [sum(k + 1), vocab]: the target's distributions (for shape, dtype, device)
) -> torch.Tensor | None:  # [sum k, vocab]
    """One q tensor for the verifier from per-request draft distributions: None when no
    request has one (the verifier then takes q one-hot at each draft), else the rows stacked,
    one-hot at the drafted token where a request has none (n-gram drafts; greedy rows, whose
    q the verifier does not read)."""
    if all(q is None for q in qs):
        return None
    parts = []
    for q, d in zip(qs, drafts, strict=True):
        if q is None:
            q = torch.zeros(len(d), p.shape[1], dtype=p.dtype, device=p.device)
            q[torch.arange(len(d), device=p.device), torch.tensor(d, device=p.device, dtype=torch.long)] = 1.0
        parts.append(q.to(p.dtype))
    return torch.cat(parts)


def _is_checkpoint(path: str | Path) -> bool:
    """A checkpoint folder, or a GGUF file (existing)."""
    return Path(path).is_dir() or (Path(path).is_file() and is_gguf_path(path))


def _eos_ids(folder: Path, from_config: tuple[int, ...], tokenizer: Tokenizer | None) -> tuple[int, ...]:
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


def cpu_default_kv_blocks(per_block: int, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """KV blocks on CPU when no budget is given: every one of ``max_num_seqs`` sequences at
    ``max_model_len`` tokens, within CPU_MAX_DEFAULT_KV_BYTES and CPU_MAX_DEFAULT_KV_SHARE of the
    machine's memory, and never less than one sequence at full length."""
    per_seq = -(-max_model_len // block_size)
    cap = CPU_MAX_DEFAULT_KV_BYTES
    with contextlib.suppress(ValueError, OSError):  # without sysconf: the fixed cap alone
        cap = min(cap, int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_MAX_DEFAULT_KV_SHARE))
    return max(per_seq, min(max_num_seqs * per_seq, cap // per_block))
