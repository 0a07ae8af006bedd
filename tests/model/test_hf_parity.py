"""Our model code against Hugging Face transformers, float32: every logit within 5x
transformers' own float32 error of the exact (float64) forward pass (``tests/numerics.py``)."""

from __future__ import annotations

import random

import pytest

from tests.model.hf_utils import CASES, compare_prefill_then_decode, make_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for case in CASES:
        folder = tmp_path_factory.mktemp(case)
        out[case] = (folder, make_checkpoint(case, folder))
    return out


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(checkpoints, case, block_size):
    folder, hf = checkpoints[case]
    rng = random.Random(hash((case, block_size)) & 0xFFFF)
    vocab = hf.config.vocab_size
    # several sequences, long ones (chunk path) and short ones (padded-batch path)
    lengths = [1, 5, 17, 40, 33, 2]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    a = compare_prefill_then_decode(folder, hf, prompts, block_size, decode_steps=20, seed=block_size)
    assert a.ok, f"{case} block_size={block_size}: {a.describe()}"
