"""What a worker's steps take besides weights and KV, measured before the KV cache is sized.

On CUDA the KV budget is ``gpu_memory_utilization`` of the device less the weights (already
allocated) and less the most memory any one step takes on top of them. Steps run one after
another, so that is the largest peak among the kinds of step the engine runs, each probed
alone at its worst case (:func:`plan_probes`):

1. ``prefill``: one target chunk of ``max_num_batched_tokens`` tokens (the MLP's
   intermediates of the widest step; logits for its last token).
2. ``decode``: ``max_num_seqs`` sequences of one token, every one at a context of
   ``max_model_len``, then the sampler with every option on (penalties, top-k/top-p, the
   softmax). The context sizes the decode kernel's partial results (flash-decoding keeps a
   running max, sum and output per context split, float32).
   ``verify`` (with speculation): the same sequences with ``1 + k`` tokens each (fewer
   sequences when the token budget caps them), logits for every token, the verifier's
   distributions and the rejection sampler with the draft's distributions of every drafted
   token held: the widest logits and sampler copies.
3. ``draft catch-up``: one draft chunk of ``max_num_batched_tokens`` tokens without logits,
   the most the token budget lets through in one step (draft model only).
4. ``draft propose``: ``max_num_seqs`` draft sequences of one token at ``max_model_len``
   with logits (draft model only).

Each probe writes its KV into a few probe blocks that every sequence's block table repeats
(the values do not matter, the shapes do). When CUDA graphs will be captured, their private
memory pool holds the forward activations of the largest captured step and eager steps
cannot use it: the larger of the ``decode`` and ``verify`` probes' forward passes alone is
counted again for it (``graph pool``).

The probes are plain code (CPU tests run them on a real model); only the measure is CUDA's
(:func:`cuda_peak_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftwise.worker.model.chunk import SequenceChunk
from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import LoadedModel
from draftwise.worker.model.model_runner import ModelRunner
from draftwise.worker.sampling.sampler import Sampler, SamplingRow, processed_probs
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.speculative.rejection_sampler import rejection_sample

__all__ = ["MemoryProfile", "Probe", "cuda_peak_bytes", "plan_probes", "profile_activations"]

PROBE_BLOCKS = 4
"""KV blocks a probe writes into beyond what its longest chunk needs (the tables repeat them)."""

# the costliest sampling a request may ask for: every penalty, top-k and top-p (a sort), seeded
_WORST_PARAMS = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    top_k=50,
    min_p=0.01,
    presence_penalty=0.1,
    frequency_penalty=0.1,
    repetition_penalty=1.1,
    seed=0,
)


@dataclass(frozen=True)
class Probe:
    """One step of the profile: which model runs what."""

    name: str
    model: str  # "target" or "draft"
    num_seqs: int
    tokens_per_seq: int
    context: int  # each sequence's context after the step (tokens)
    logits_per_seq: int  # logits asked for per sequence
    sample: bool = False  # run the sampler (and, with ``draft_k``, the rejection sampler) on the logits
    draft_k: int = 0  # drafted tokens per sequence whose distributions the verify holds and checks

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.tokens_per_seq


def plan_probes(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    spec_k: int = 0,
    draft_model: bool = False,
) -> list[Probe]:
    """The probes of the module docstring for an engine of these limits; ``spec_k`` drafted
    tokens per sequence (0: no speculation), ``draft_model``: the proposer is a model."""
    prefill = min(max_num_batched_tokens, max_model_len)
    q = max(1, min(1 + spec_k, max_model_len))
    seqs = max(1, min(max_num_seqs, max_num_batched_tokens // q))
    probes = [
        Probe("prefill", "target", 1, prefill, prefill, 1),
        Probe("decode", "target", max_num_seqs, 1, max_model_len, 1, True),
    ]
    if q > 1:
        probes.append(Probe("verify", "target", seqs, q, max_model_len, q, True, q - 1))
    if draft_model:
        probes.append(Probe("draft catch-up", "draft", 1, prefill, prefill, 0))
        probes.append(Probe("draft propose", "draft", max_num_seqs, 1, max_model_len, 1))
    return probes


@dataclass
class MemoryProfile:
    """Peak bytes above the weights, per probe, and what the KV budget must leave free."""

    peaks: dict[str, int] = field(default_factory=dict)
    graph_pool: int = 0  # the largest captured step's forward activations (0: no graphs)

    @property
    def activations(self) -> int:
        """What the KV budget leaves free: the largest peak, plus the graph pool."""
        return max(self.peaks.values(), default=0) + self.graph_pool


def _probe_runner(loaded: LoadedModel, probe: Probe, block_size: int) -> tuple[ModelRunner, list[SequenceChunk]]:
    """A runner over a probe KV cache of a few blocks, and the probe's chunks (each table
    covers the whole context by repeating those blocks)."""
    needed = -(-probe.context // block_size)
    own = min(needed, -(-probe.tokens_per_seq // block_size) + PROBE_BLOCKS)
    cache = KVCache(loaded.kv_config, own, block_size, loaded.dtype, loaded.device)
    table = [i % own for i in range(needed)]
    start = probe.context - probe.tokens_per_seq
    chunk = SequenceChunk([0] * probe.tokens_per_seq, start, table, probe.logits_per_seq)
    return ModelRunner(loaded, cache), [chunk] * probe.num_seqs


def _sample(logits: torch.Tensor, probe: Probe, vocab: int) -> None:
    """What the engine does with a step's logits at its costliest: every row sampled with
    every option on; with drafts, the verifier's distributions and the rejection sampler."""
    prompt = [0] * 8
    if not probe.draft_k:
        rows = [SamplingRow(_WORST_PARAMS, 0, prompt, [0]) for _ in range(logits.shape[0])]
        Sampler()(logits, rows)
        return
    k = probe.draft_k
    rows = [SamplingRow(_WORST_PARAMS, 0, prompt, [0] * (1 + j)) for _ in range(probe.num_seqs) for j in range(k + 1)]
    p = processed_probs(logits, rows)  # [S * (k + 1), vocab]
    q = torch.full((probe.num_seqs * k, vocab), 1.0 / vocab, device=logits.device)  # the draft's, held
    rejection_sample(
        p,
        [[0] * k] * probe.num_seqs,
        q,
        [False] * probe.num_seqs,
        [0] * probe.num_seqs,
        [probe.context - probe.tokens_per_seq] * probe.num_seqs,
    )


def run_probe(loaded: LoadedModel, probe: Probe, block_size: int, vocab: int, forward_only: bool = False) -> int:
    """Run ``probe`` on ``loaded`` (its own probe KV cache, freed on return); the bytes of
    that cache (not part of what the step takes)."""
    runner, chunks = _probe_runner(loaded, probe, block_size)
    with torch.inference_mode():
        logits = runner.run(chunks)  # [S * logits_per_seq, vocab]
        if probe.sample and not forward_only and logits.numel():  # a tensor-parallel follower gets no logits
            _sample(logits, probe, vocab)
    return runner.kv_cache.num_bytes


def profile_activations(
    target: LoadedModel,
    draft: LoadedModel | None,
    probes: list[Probe],
    block_size: int,
    measure: Callable[[Callable[[], int]], int],
    graphs: bool = False,
) -> MemoryProfile:
    """Each probe's peak as ``measure(run)`` reports it (bytes above what was allocated
    before, less the probe's own KV cache, which ``run`` returns), and the graph pool's share
    when ``graphs`` will be captured."""
    vocab = target.config.vocab_size
    models = {"target": target, "draft": draft}
    prof = MemoryProfile()
    for p in probes:
        model = models[p.model]
        if model is None:
            raise ValueError(f"probe {p.name!r} needs a {p.model} model")
        prof.peaks[p.name] = measure(lambda p=p, model=model: run_probe(model, p, block_size, vocab))
        if graphs and p.sample:  # the steps the largest graphs capture, without the eager sampler
            pool = measure(lambda p=p, model=model: run_probe(model, p, block_size, vocab, True))
            prof.graph_pool = max(prof.graph_pool, pool)
    return prof


def cuda_peak_bytes(device: torch.device) -> Callable[[Callable[[], int]], int]:
    """A measure for :func:`profile_activations`: the CUDA allocator's peak while ``fn`` runs,
    above what was allocated before it, less the bytes ``fn`` returns (its probe KV cache)."""

    def measure(fn: Callable[[], int]) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        excluded = fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before - excluded)

    return measure
