"""Sampling with speculation draws whole sequences from exactly the target's distribution.

Two random tiny Llamas with a 4-token vocabulary (target and a differently seeded draft,
their LM heads scaled up so that p and q are peaked and differ) are saved as Hugging Face
checkpoints. For every one of the 4^4 continuations of 4 tokens the exact probability under
the target is computed with transformers (an independent implementation), shaped by the
request's temperature / top-k. The engine then samples 6000 continuations with the draft
proposer (k = 3), with n-gram lookup, with the suffix cache (unseeded), with random EAGLE and Medusa heads for the target
(k = 3), with the draft proposer and a lookup beside it (hybrid: both parts drafting), with a draft whose
tokenizer differs from the target's (TLI and SLEM, tests/engine/test_cross_vocab.py's crafted pair), and without speculation, and a chi-square goodness-of-fit test compares each sample to the exact distribution. Requests are seeded
(seeds 1000, 1001, ...: speculation verifies them by Gumbel coupling, so the sample is
across seeds) or, in the "-unseeded" cases, not (random seeds; rejection sampling).

False-alarm rate: each test rejects at p < 1e-3, so a correct engine fails one of these
cases with probability about 1e-3 per case; the seeds are fixed, so a given commit passes
or fails deterministically. Power: the same test must reject the draft model's own
distribution (what a broken verifier that accepted everything would produce).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.sampling.sampling_params import SamplingParams
from tests.engine.test_cross_vocab import make_cross_pair

VOCAB = 4
LENGTH = 4
PROMPT = [1, 3, 0]
N = 6000
ALPHA = 1e-3


def _save_tiny(folder, seed: int, like=None, noise: float = 0.0):
    """A random tiny Llama saved in ``folder``; with ``like``, a copy of that model with
    Gaussian noise of ``noise`` times each tensor's spread added (a draft that resembles it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        if like is None:
            model.lm_head.weight.mul_(10.0)  # context-dependent distributions of moderate entropy
        else:
            model.load_state_dict(like.state_dict())
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std().clamp_min(1e-3))
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _save_heads(root) -> None:
    """Random EAGLE and Medusa heads for the tiny target (``root/eagle``, ``root/medusa``),
    their draft vocabulary the whole 4-token vocabulary, scaled so that their q are peaked."""
    from draftwise.worker.model.loader import load_model
    from draftwise.worker.speculative.heads import EagleHead, MedusaHeads, head_model_config, save_head

    loaded = load_model(root / "target", dtype="float32")
    torch.manual_seed(7)
    eagle = EagleHead(head_model_config(loaded.config))
    for p in eagle.parameters():
        torch.nn.init.normal_(p, std=0.3)
    medusa = MedusaHeads(loaded.config.hidden_size, 3)
    torch.nn.init.normal_(medusa.proj, std=0.3)
    for name, head in (("eagle", eagle), ("medusa", medusa)):
        save_head(root / name, head, torch.arange(VOCAB), "tiny target", loaded.model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_pair")
    target = _save_tiny(root / "target", seed=1)
    draft = _save_tiny(root / "draft", seed=2, like=target, noise=0.5)
    _save_heads(root)
    make_cross_pair(root / "cross", root / "target", root / "draft")
    return root, target, draft


def _exact(model, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(continuation) under ``model`` shaped by temperature and top-k, by enumeration."""
    seqs = list(itertools.product(range(VOCAB), repeat=LENGTH))
    ids = torch.tensor([PROMPT + list(s) for s in seqs])
    with torch.no_grad():
        logits = model(ids).logits.float()  # [num_seqs, len, vocab]
    logits = logits[:, len(PROMPT) - 1 : -1] / params.temperature  # [num_seqs, LENGTH, vocab]
    if params.top_k > 0:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = logits.log_softmax(dim=-1)
    picked = logp.gather(2, torch.tensor(seqs).unsqueeze(2)).squeeze(2).sum(dim=1)  # [num_seqs]
    return {s: math.exp(float(v)) for s, v in zip(seqs, picked, strict=True)}


def _sample(root, params: SamplingParams, seeded: bool = True, **spec) -> tuple[dict[tuple[int, ...], int], LLMEngine]:
    engine = LLMEngine(
        EngineConfig(
            model=root / "target",
            dtype="float32",
            skip_tokenizer_init=True,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            num_kv_blocks=512,
            block_size=4,
            **spec,
        )
    )
    counts: dict[tuple[int, ...], int] = {}
    for i in range(N):
        p = SamplingParams(
            temperature=params.temperature,
            top_k=params.top_k,
            max_tokens=LENGTH,
            ignore_eos=True,
            seed=1000 + i if seeded else None,
        )
        engine.add_request(str(i), PROMPT, p)
    while engine.has_unfinished_requests():
        for o in engine.step().finished:
            seq = tuple(o.outputs[0].token_ids)
            assert len(seq) == LENGTH
            counts[seq] = counts.get(seq, 0) + 1
    engine.check_idle_invariants()
    return counts, engine


def _chi2_pvalue(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit, outcomes with expected count < 5 pooled into one bin."""
    n = sum(counts.values())
    small = [s for s in probs if probs[s] * n < 5]
    big = [s for s in probs if probs[s] * n >= 5]
    obs = [counts.get(s, 0) for s in big]
    exp = [probs[s] * n for s in big]
    if small:
        obs.append(sum(counts.get(s, 0) for s in small))
        exp.append(sum(probs[s] for s in small) * n)
    exp_total = sum(exp)
    exp = [e * n / exp_total for e in exp]  # float rounding of the probabilities
    return float(chisquare(obs, exp).pvalue)


CASES = {
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7-top3": SamplingParams(temperature=0.7, top_k=3),
}
SPEC = {
    "draft-k3": dict(speculative_method="draft", num_speculative_tokens=3, speculative_adaptive=False),
    "ngram-k3": dict(
        speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=False, prompt_lookup_min=1
    ),
    "plain": {},
    "eagle-k3": dict(speculative_method="eagle", num_speculative_tokens=3, speculative_adaptive=False),
    "medusa-k3": dict(speculative_method="medusa", num_speculative_tokens=3, speculative_adaptive=False),
    "eagle-k3-unseeded": dict(
        speculative_method="eagle", num_speculative_tokens=3, speculative_adaptive=False, seeded=False
    ),
    "medusa-k3-unseeded": dict(
        speculative_method="medusa", num_speculative_tokens=3, speculative_adaptive=False, seeded=False
    ),
    "draft-k3-unseeded": dict(
        speculative_method="draft", num_speculative_tokens=3, speculative_adaptive=False, seeded=False
    ),
    "suffix-k3-unseeded": dict(
        speculative_method="suffix", num_speculative_tokens=3, speculative_adaptive=False, seeded=False
    ),
    "draft+suffix-k3": dict(
        speculative_method="draft", speculative_lookup="suffix", num_speculative_tokens=3, speculative_adaptive=False
    ),
    "eagle+suffix-k3-unseeded": dict(
        speculative_method="eagle",
        speculative_lookup="suffix",
        num_speculative_tokens=3,
        speculative_adaptive=False,
        seeded=False,
    ),
    "draft+ngram-k3-unseeded": dict(
        speculative_method="draft",
        speculative_lookup="ngram",
        num_speculative_tokens=3,
        speculative_adaptive=False,
        prompt_lookup_min=2,  # a bigram must repeat: the lookup finds drafts for some requests and steps only
        seeded=False,
    ),
    "cross-tli-k3-unseeded": dict(  # a draft with another tokenizer (tests/engine/test_cross_vocab.py's crafted pair)
        speculative_vocab_mapping="tli", num_speculative_tokens=3, speculative_adaptive=False, seeded=False
    ),
    "cross-slem-k3": dict(speculative_vocab_mapping="slem", num_speculative_tokens=3, speculative_adaptive=False),
    "ngram-k3-unseeded": dict(
        speculative_method="ngram",
        num_speculative_tokens=3,
        speculative_adaptive=False,
        prompt_lookup_min=1,
        seeded=False,
    ),
}


# each case under each speculation, but these under one case each: their sampling paths are the draft
# model's, EAGLE's and the lookup's, which the other speculations run under every case
ONE_CASE = {"cross-tli-k3-unseeded": "t0.7-top3", "cross-slem-k3": "t1.0", "eagle+suffix-k3-unseeded": "t0.7-top3"}
RUNS = [(case, spec) for spec in SPEC for case in CASES if ONE_CASE.get(spec, case) == case]


@pytest.mark.parametrize(("case", "spec"), RUNS)
def test_sequences_follow_the_target_distribution(pair, case, spec):
    root, target, draft = pair
    params = CASES[case]
    kw = dict(SPEC[spec])
    if kw.get("speculative_method") in ("draft", "eagle", "medusa"):
        kw["speculative_model"] = str(root / kw["speculative_method"])
    if spec.startswith("cross"):
        root = root / "cross"
        kw["speculative_model"] = str(root / "draft")
    counts, engine = _sample(root, params, **kw)
    exact = _exact(target, params)
    pvalue = _chi2_pvalue(counts, exact)
    assert pvalue > ALPHA, f"{spec} {case}: chi-square p = {pvalue:.2e}"
    if spec != "plain":
        t = engine.spec_totals
        assert 0 < t["accepted"] < t["proposed"], t  # accepts and rejects both exercised
        if "+" in spec:  # a hybrid: both of its parts drafted
            drafted = engine.spec.proposer.drafted  # type: ignore[union-attr]
            assert min(drafted) > 0, drafted
        # the test has power: the draft's own distribution is far from what we sampled
        wrong = _exact(draft, params) if spec.startswith("draft") else None
        if wrong is not None:
            assert _chi2_pvalue(counts, wrong) < 1e-12
