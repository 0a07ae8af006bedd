"""Penalties read a penalised request's token counts kept on the device between steps
(``worker/sampling/token_counts.py``): the logits they give equal those counted from the
token lists, step after step, with drafts, and the host adds only the new tokens."""

from __future__ import annotations

import random

import pytest
import torch

from draftwise.worker.core.request import Request
from draftwise.worker.sampling.sampler import SamplingRow, apply_penalties
from draftwise.worker.sampling.sampling_params import SamplingParams
from draftwise.worker.sampling.token_counts import TokenCounts

VOCAB = 50
PENALISED = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(frequency_penalty=0.4, presence_penalty=0.2),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.3),
]


def _request(i: int, params: SamplingParams, prompt: list[int]) -> Request:
    return Request(f"r{i}", None, prompt, params, max_tokens=1000)


def test_counts_on_the_device_equal_counts_from_the_lists():
    rng = random.Random(0)
    reqs = [_request(i, p, [rng.randrange(VOCAB) for _ in range(30 + i)]) for i, p in enumerate(PENALISED)]
    reqs.append(_request(9, SamplingParams(), [1, 2, 3]))  # no penalty: no counts
    for _ in range(40):
        for r in reqs:
            r.output_token_ids.extend(rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 3])))
        drafts = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))] for _ in reqs]
        rows = [r.sampling_row(d) for r, d in zip(reqs, drafts, strict=True)]
        assert [row.counts is not None for row in rows] == [True, True, True, False]
        plain = [
            SamplingRow(r.sampling_params, None, r.prompt_token_ids, r.output_token_ids, drafts=d)
            for r, d in zip(reqs, drafts, strict=True)
        ]
        logits = torch.randn(len(reqs), VOCAB)
        torch.testing.assert_close(apply_penalties(logits, rows), apply_penalties(logits, plain), rtol=0, atol=0)
    # the host added each token once: prompt and output, never the whole context per step
    for r in reqs[:3]:
        assert r.token_counts is not None
        assert r.token_counts.tokens_added == len(r.prompt_token_ids) + len(r.output_token_ids)


def test_counts_rebuild_when_the_output_shrinks_and_reject_bad_ids():
    tc = TokenCounts()
    out, seen = tc.sync([1, 1, 4], [2, 2, 3], 6, torch.device("cpu"))
    assert out.tolist() == [0, 0, 2, 1, 0, 0] and seen.tolist() == [False, True, False, False, True, False]
    out, _ = tc.sync([1, 1, 4], [2], 6, torch.device("cpu"))  # shorter: counted again from scratch
    assert out.tolist() == [0, 0, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="token ids must be in"):
        tc.sync([1], [2, 9], 6, torch.device("cpu"))
    r = _request(0, PENALISED[0], [1, 2])
    row = r.sampling_row([7, 60])  # a draft id outside the vocabulary
    with pytest.raises(ValueError, match="token ids must be in"):
        apply_penalties(torch.zeros(1, VOCAB), [row])
