"""The engine: requests in, one batched forward pass per ``step()``, token deltas out.

engine = LLMEngine(EngineConfig())
engine.add_request("a", "def fibonacci(n):", SamplingParams(max_tokens=32))
while engine.has_unfinished_requests():
    out = engine.step()   # StepOutput: deltas, finished, stats
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import structlog
import torch

from draftwise.logs import ensure_logging
from draftwise.worker.core.block_manager import BlockManager, PrefixCacheStats
from draftwise.worker.core.config import EngineConfig
from draftwise.worker.core.containment import (
    EngineDeadError,
    Failure,
    contain,
    contain_each,
    is_step_fatal,
    isolate,
)
from draftwise.worker.core.outputs import SpecStats, StepOutput
from draftwise.worker.core.request import FinishReason, Request, RequestStatus
from draftwise.worker.core.scheduler import ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from draftwise.worker.engine import sizing
from draftwise.worker.engine.constrain import mask_logits
from draftwise.worker.engine.host_memory import retain_freed_memory
from draftwise.worker.engine.intake import Intake
from draftwise.worker.engine.invariants import check_idle, check_running
from draftwise.worker.engine.step_data import StepReport, StepTokens, logit_rows, step_stats
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import LoadedModel, load_model
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk
from draftwise.worker.parallel.leader import Ranks
from draftwise.worker.paths import resolve_model
from draftwise.worker.sampling.grammar import Grammars
from draftwise.worker.sampling.sampler import Sampler
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.speculative.decoder import SpecDecoder, SpecPlan
from draftwise.worker.speculative.draft import DraftModelProposer
from draftwise.worker.speculative.loading import check_speculative_model, load_draft, load_spec_head
from draftwise.worker.text.chat import ChatPrompt, RenderedChat
from draftwise.worker.text.output_processor import Appended, OutputProcessor
from draftwise.worker.text.tokenizer import Tokenizer, load_tokenizer

log = structlog.get_logger("draftwise.engine")

__all__ = ["EngineDeadError", "LLMEngine", "is_step_fatal"]


def _req(s: ScheduledRequest | StepTokens) -> Request:
    return s.request


class LLMEngine:
    """Continuous batching over a paged KV cache, with chunked prefill and preemption."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        ensure_logging()
        self.config = config = config or EngineConfig()
        self.retains_freed_memory = config.retain_freed_memory and retain_freed_memory()
        folder = resolve_model(config.model)
        check_speculative_model(config)  # before the (possibly long) target load
        self.ranks = Ranks(config, str(folder)) if config.tensor_parallel_size > 1 else None  # the other TP ranks
        if self.ranks is not None:
            weakref.finalize(self, self.ranks.close)
        parallel = self.ranks.parallel if self.ranks is not None else None
        clock = sizing.Phases()
        self.loaded: LoadedModel = load_model(
            folder, dtype=config.dtype, device=config.device, parallel=parallel, quantization=config.quantization
        )
        clock.done("load_model_s")
        mcfg = self.loaded.config
        self.max_model_len = sizing.model_len(config, mcfg)
        tokenizer = None
        if not config.skip_tokenizer_init:
            tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else folder)
        self.intake = Intake(tokenizer, folder, mcfg.eos_token_ids, self.max_model_len, mcfg.vocab_size, config.seed)
        self.tokenizer: Tokenizer | None = tokenizer
        clock.done("tokenizer_s")
        self.eos_token_ids = self.intake.eos_token_ids
        self.grammars = Grammars(self.intake.grammar)  # constrained requests' matchers

        max_batched = sizing.batch_token_budget(config, self.max_model_len)
        draft_model, bridge = load_draft(config, self.loaded, self.max_model_len, tokenizer)
        draft = draft_model or load_spec_head(config, self.loaded)
        clock.done("draft_s")
        # memory_profile: what the CUDA profile measured (None: not profiled)
        size_kv = lambda: sizing.num_kv_blocks(config, self.loaded, draft, max_batched, self.max_model_len, bridge)  # noqa: E731
        num_blocks, self.memory_profile = (
            size_kv() if self.ranks is None else self.ranks.agree_kv_blocks(size_kv, max_batched, self.max_model_len)
        )
        capacity = sizing.check_capacity(num_blocks, config.block_size, self.max_model_len)
        self.kv_cache = KVCache(
            self.loaded.kv_config, num_blocks, config.block_size, self.loaded.dtype, self.loaded.device
        )
        clock.done("kv_cache_s")
        self.runner = ModelRunner(self.loaded, self.kv_cache, peers=self.ranks)
        self.runner.decode_threads = config.decode_threads
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.spec = SpecDecoder.build(config, draft, self.loaded, num_blocks, self.max_model_len, bridge)
        self.spec_method: str | None = None if self.spec is None else self.spec.method
        k = config.max_draft_tokens
        draft_runner = self.proposer.runner if self.proposer is not None else None
        if self.proposer is not None:  # constrained requests draft under their grammar
            self.proposer.draft_mask = self.grammars.mask_draft
        runners = [self.runner] + ([draft_runner] if draft_runner is not None else [])
        max_len = self.max_model_len
        self.kernel_warm_up_seconds = sizing.warm_up_kernels(runners, config.max_num_seqs, max_batched, max_len + k + 1)
        self.graph_capture_seconds = sizing.capture_graphs(self.runner, draft_runner, config, max_batched, max_len, k)
        clock.done("warm_up_s")
        self.startup_phases = clock.phases  # seconds of each start-up phase, as logged
        sched_config = SchedulerConfig(config.max_num_seqs, max_batched, config.enable_chunked_prefill)
        self.scheduler = Scheduler(sched_config, self.blocks)
        self.sampler = Sampler()
        self.output = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._pending = StepReport()  # aborts, reported with the next step
        self.dead: str | None = None  # why the engine stopped (EngineDeadError); None while it runs
        self.num_steps = 0
        self._hidden = torch.empty(0)  # the last forward pass's hidden states, when the proposer reads them
        sizing.log_ready(self, num_blocks, capacity, max_batched)

    @property
    def proposer(self) -> DraftModelProposer | None:
        """The draft-model proposer, when speculating with one (its runner, its KV pool)."""
        parts = () if self.spec is None else self.spec.proposer.parts
        return next((p for p in parts if isinstance(p, DraftModelProposer)), None)

    @property
    def spec_totals(self) -> dict[str, float]:
        """Speculation counters of the engine's lifetime (proposed, accepted, verify_steps,
        draft_seconds); zeros without speculation."""
        if self.spec is None:
            return {"proposed": 0, "accepted": 0, "verify_steps": 0, "draft_seconds": 0.0}
        return self.spec.totals

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:  # tokens looked up and found, blocks cached
        return self.blocks.prefix_cache_stats

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
        cache_salt: str = "",
    ) -> Request:
        """Queue a request. Raises ValueError (touching nothing) for a bad one,
        EngineDeadError once the engine has stopped.

        ``continuation``: output tokens the request already has (a failover resubmission).
        They become its first output tokens, prefilled with the prompt, and count for
        max_tokens, min_tokens, penalties and stop checks; the detokenizer reads them without
        releasing text; the first delta has first_token_index = len(continuation).
        ``continuation_spec``: their speculation counters, added to the request's own.
        ``cache_salt``: the tenant's prefix-cache salt (different salts never share cached KV)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has stopped: {self.dead}")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.intake.build(request_id, prompt, params, arrival_time, prompt_token_ids, continuation)
        if params.constraint is not None:  # ValueError: touches nothing
            self.grammars.add(request_id, params, req.output_token_ids, continuation_spec)
        try:
            self.output.add(request_id, req.prompt_token_ids, params, req.output_token_ids)  # ValueError: as above
        except ValueError:
            self.grammars.remove(request_id)
            raise
        req.seed = self.intake.seed_for(params)
        req.cache_salt = cache_salt
        if self.spec is not None and params.use_speculation and self.spec.serves(params.speculative_methods):
            self.spec.add(req, params.max_speculative_tokens, continuation_spec)
        self.requests[request_id] = req
        self.scheduler.add(req)
        n, cont = req.num_prompt_tokens, len(req.output_token_ids)
        log.debug(
            "request added", request_id=request_id, prompt_tokens=n, max_tokens=req.max_tokens, continuation_tokens=cont
        )
        return req

    def encode_prompt(self, prompt: str) -> list[int]:
        """Tokenize a text prompt (``Intake.encode_prompt``); off-thread safe (AsyncEngine runs it there)."""
        return self.intake.encode_prompt(prompt)

    def encode_chat(self, prompt: ChatPrompt) -> RenderedChat:
        """Render and tokenize chat messages (``Intake.encode_chat``); off-thread safe."""
        return self.intake.encode_chat(prompt)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final delta comes with the next step.
        False if no such request is unfinished."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._finish(req, FinishReason.ABORT)
        self._pending.add(self.output.closing_delta(req, self._spec_stats(req)))
        self._forget(req)
        log.info("request aborted", request_id=request_id, output_tokens=len(req.output_token_ids))
        return True

    def check_ranks(self) -> None:
        """EngineDeadError when a tensor-parallel rank has stopped (AsyncEngine asks while idle)."""
        if self.ranks is not None:
            self.ranks.check()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending.deltas)

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
        """plan speculation -> schedule -> catch up and propose -> run -> sample / verify ->
        update progress -> process outputs; finished and failed requests are freed in
        ``_finish`` (each phase returns data; nothing calls back into the engine)."""
        t0 = time.perf_counter()
        step, self._pending = StepReport(self._pending), StepReport()
        spec = self.spec
        plan = spec.plan(self.scheduler.running) if spec is not None else SpecPlan()
        self._fail(step, plan.failed)
        sched = self.scheduler.schedule(plan.draft_k)
        for rid in sched.preempted:
            self._release_spec(self.requests[rid])
        scheduled = self._draft(step, sched, plan.behind)
        proposed = accepted = 0
        if scheduled:
            pure = all(s.samples and s.num_new_tokens == 1 + s.num_draft_tokens for s in scheduled)
            num_tokens = sum(s.num_new_tokens for s in scheduled)
            t_run = time.perf_counter()
            scheduled, logits = self._run(step, scheduled)  # [sum of num_logits, vocab]
            if spec is not None and spec.wants_hidden and scheduled:
                spec.observe(scheduled, self._hidden)
            plain, verify = logit_rows(scheduled)
            plain, verify, failed = mask_logits(self.grammars, logits, plain, verify, spec)  # constrained rows
            self._fail(step, failed)
            results = self._sample(step, logits, plain) + self._verify(step, logits, verify)
            self.scheduler.update_from_output(scheduled, {v.request.request_id: v.num_accepted for v in results})
            proposed, accepted = self._process(step, results)
            if spec is not None and pure:
                spec.record_target_step(num_tokens, time.perf_counter() - t_run)
        self.num_steps += 1
        stats = step_stats(scheduled, sched, self.scheduler, self.blocks.num_free_blocks, t0, (proposed, accepted))
        return StepOutput(step.deltas, step.finished, stats)

    # ------------------------------------------------------------------ phases

    def _draft(self, step: StepReport, sched: SchedulerOutput, behind: list[Request]) -> list[ScheduledRequest]:
        """After scheduling: the proposer catches up on what it lags behind within the budget
        left, then drafts the granted positions; returns the scheduled requests still alive."""
        spec, scheduled = self.spec, sched.scheduled
        if spec is not None:
            left = self.scheduler.config.max_num_batched_tokens - sched.num_batched_tokens
            self._fail(step, spec.catch_up([r for r in behind if r.status is RequestStatus.RUNNING], left))
            self._fail(step, spec.propose([s for s in scheduled if s.num_draft_tokens and not s.request.is_finished]))
        now = time.monotonic()
        alive = [s for s in scheduled if not s.request.is_finished]
        for s in alive:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        return alive

    def _run(self, step: StepReport, scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """The forward pass, contained: when it fails, each sequence runs alone to find the
        ones that fail by themselves (finished with their error), and the rest run again
        together. Rerunning is safe: a forward pass only writes KV at positions not yet counted."""
        try:
            return scheduled, self._forward([self._chunk(s) for s in scheduled])
        except Exception as e:
            if is_step_fatal(e):
                raise
            first = e
        log.warning("forward pass failed for the batch; isolating", error=repr(first), sequences=len(scheduled))
        done, failed = isolate(scheduled, lambda ss: [self._forward([self._chunk(s) for s in ss])], _req)
        self._fail(step, failed)
        if not done:
            return [], torch.empty(0)
        if not failed:  # no sequence fails alone: the batch itself is broken
            raise EngineDeadError(f"the forward pass fails for the batch but for no sequence alone: {first!r}")
        survivors = [s for s, _ in done]
        return survivors, self._forward([self._chunk(s) for s in survivors])

    def _forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        """The target's pass; keeps its hidden states (``_hidden``) when the proposer reads them."""
        if self.spec is None or not self.spec.wants_hidden:
            return self.runner.run(chunks)
        logits, self._hidden = self.runner.run_hidden(chunks)
        return logits

    def _chunk(self, s: ScheduledRequest) -> SequenceChunk:
        r = s.request
        start = r.num_computed_tokens
        if s.num_draft_tokens:
            assert self.spec is not None
            drafts = self.spec.draft_tokens(r)
            return SequenceChunk(r.token_slice(start, start + 1) + drafts, start, r.block_table, 1 + s.num_draft_tokens)
        return SequenceChunk(
            r.token_slice(start, start + s.num_new_tokens), start, r.block_table, 1 if s.samples else 0
        )

    def _sample(self, step: StepReport, logits: torch.Tensor, plain: list[tuple[Request, int]]) -> list[StepTokens]:
        """One token for each request of ``plain`` (request, its logits row), contained."""
        if not plain:
            return []
        idx = [i for _, i in plain]
        if idx != list(range(logits.shape[0])):
            logits = logits[torch.tensor(idx, device=logits.device)]
        rows = {r.request_id: (n, r.sampling_row()) for n, (r, _) in enumerate(plain)}

        def run(reqs: Sequence[Request]) -> list[StepTokens]:
            picked = [rows[r.request_id] for r in reqs]
            sub = logits if len(reqs) == len(plain) else logits[[n for n, _ in picked]]
            out = self.sampler(sub, [row for _, row in picked])
            return [StepTokens(r, [t], [lp]) for r, t, lp in zip(reqs, out.token_ids, out.logprobs, strict=True)]

        done, failed = contain([r for r, _ in plain], run, lambda r: r, "sampling")
        self._fail(step, failed)
        return [t for _, t in done]

    def _verify(
        self, step: StepReport, logits: torch.Tensor, verify: list[tuple[ScheduledRequest, int]]
    ) -> list[StepTokens]:
        if not verify:
            return []
        assert self.spec is not None
        verified, failed = self.spec.verify(logits, verify)
        self._fail(step, failed)
        return [StepTokens(v.request, v.token_ids, v.logprobs, v) for v in verified]

    def _process(self, step: StepReport, results: list[StepTokens]) -> tuple[int, int]:
        """Append each request's new tokens through the output processor, settle speculation
        rounds, finish what is finished; returns (drafts verified, accepted that reached the
        output) for the step's stats."""
        proposed = accepted = 0
        done, failed = contain_each(results, self._append, _req)
        self._fail(step, failed)
        for t, app in done:
            r = t.request
            if t.verified is not None:
                assert self.spec is not None
                proposed += t.verified.num_drafts
                accepted += self.spec.settle(t.verified, len(app.token_ids), app.finish is not None)
            if app.finish is not None:
                self._finish(r, app.finish.reason, app.finish.stop_reason)
            step.add(self.output.delta(r, app, self._spec_stats(r)))
            if r.is_finished:
                self._forget(r)
        return proposed, accepted

    def _append(self, t: StepTokens) -> Appended:
        """The output processor keeps what it keeps of ``t``; a constrained request's matcher follows."""
        app = self.output.append(t.request, t.token_ids, t.logprobs)
        self.grammars.accept(t.request.request_id, app.token_ids)
        return app

    # ------------------------------------------------------------------ finishing

    def _fail(self, step: StepReport, failures: Sequence[Failure]) -> None:
        """Finish each failed request because of an error of its own: its blocks go back, and
        its final delta (finish_reason "error") carries the reason. The other requests go on."""
        for f in failures:
            req, err = f.request, f.error
            if req.is_finished:
                continue
            message = f"{type(err).__name__}: {err}"
            log.error("request failed in the engine", request_id=req.request_id, error=message, exc_info=err)
            self._finish(req, FinishReason.ERROR)
            error = f"the engine failed this request ({message}); other requests were not affected"
            step.add(self.output.closing_delta(req, self._spec_stats(req), error))
            self._forget(req)

    def _finish(self, req: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """``req`` is finished: out of the queues, its blocks (and the proposer's) freed. The one
        place every finished, failed or aborted request goes through."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if reason in (FinishReason.LENGTH, FinishReason.STOP):  # ended before its constraint was complete?
            req.constraint_unfinished = not self.grammars.is_complete(req.request_id)
        req.finish_time = time.monotonic()
        self.requests.pop(req.request_id, None)
        self.scheduler.remove(req)
        self._release_spec(req)
        n, pre = len(req.output_token_ids), req.num_preemptions
        log.debug("request finished", request_id=req.request_id, reason=reason.value, output_tokens=n, preemptions=pre)

    def _release_spec(self, req: Request) -> None:
        """``req``'s target blocks were freed (finished or preempted): its drafts go too."""
        if self.spec is not None:
            self.spec.release(req)

    def _forget(self, req: Request) -> None:
        """``req``'s final output is built: its text and speculation state go."""
        self.output.forget(req)
        self.grammars.remove(req.request_id)
        if self.spec is not None:
            self.spec.forget(req)

    def _spec_stats(self, req: Request) -> SpecStats | None:
        stats = None if self.spec is None else self.spec.stats(req)
        refused = self.grammars.refused(req.request_id)
        return replace(stats, grammar_refused=refused) if stats is not None and refused else stats

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Blocks owned once or free; per-request state only for unfinished requests (tests call this)."""
        check_running(self)

    def check_idle_invariants(self) -> None:
        """No request left: every block free, no per-request state (tests call this)."""
        check_idle(self)
