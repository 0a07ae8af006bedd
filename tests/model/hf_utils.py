"""Random tiny Hugging Face checkpoints for parity tests, and a driver that runs our model
on a flat batch with shuffled, non-contiguous block tables and measures its logits against
transformers' exact (float64) forward pass (``tests/numerics.py``)."""

from __future__ import annotations

import copy
import random
import weakref
from pathlib import Path

import torch

from draftwise.worker.model.kv_cache import KVCache
from draftwise.worker.model.loader import load_model
from draftwise.worker.model.model_runner import ModelRunner, SequenceChunk
from tests.numerics import Agreement, agreement, closest_to_failing

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (architecture, extra config)
CASES: dict[str, tuple[str, dict]] = {
    "llama-mha-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-gqa-tied-llama3rope": (
        "llama",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
    ),
    "llama-linear-rope-mqa": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        ),
    ),
    "qwen2-bias-gqa-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-bias-mha-untied": ("qwen2", dict(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)),
    "mistral-gqa-window": (
        "mistral",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=12),
    ),
    "mistral-mha-tied": (
        "mistral",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, sliding_window=None),
    ),
}


def make_checkpoint(case: str, folder: Path, seed: int = 0):
    """Save a random tiny HF model for ``case`` in ``folder`` (float32 safetensors); return it."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    arch, extra = CASES[case]
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    cfg = cfg_cls(**TINY, **extra, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # make biases and norms non-trivial
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def shuffled_tables(
    lengths: list[int], block_size: int, rng: random.Random, spare: int = 7
) -> tuple[list[list[int]], int]:
    """Block tables for sequences of the given final lengths, drawn from a shuffled pool so
    that no table is contiguous. Returns (tables, pool size)."""
    need = [-(-n // block_size) for n in lengths]
    pool = list(range(sum(need) + spare))
    rng.shuffle(pool)
    tables, i = [], 0
    for n in need:
        tables.append(pool[i : i + n])
        i += n
    return tables, len(pool)


_EXACT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def exact_copy(hf_model):
    """A float64 copy of a float32 Hugging Face model (kept while the model lives): the exact
    reference that float32 results, ours and transformers' own, are measured against."""
    if hf_model not in _EXACT:
        _EXACT[hf_model] = copy.deepcopy(hf_model).to(torch.float64).eval()
    return _EXACT[hf_model]


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    return hf_model(input_ids=torch.tensor([ids])).logits[0]


@torch.no_grad()
def compare_prefill_then_decode(
    folder: Path,
    hf_model,
    prompts: list[list[int]],
    block_size: int,
    decode_steps: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Agreement:
    """Run all prompts as one flat batch, then ``decode_steps`` single-token steps for every
    sequence (random tokens); measure every logit against the exact (float64) forward pass of
    ``hf_model`` on the same tokens, bounded by transformers' own float32 error
    (``tests/numerics.py``)."""
    rng = random.Random(seed)
    loaded = load_model(folder, dtype=dtype)
    vocab = loaded.config.vocab_size
    final = [len(p) + decode_steps for p in prompts]
    tables, num_blocks = shuffled_tables(final, block_size, rng)
    runner = ModelRunner(loaded, KVCache(loaded.config, num_blocks, block_size, dtype, "cpu"))
    seqs = [list(p) for p in prompts]
    chunks = [SequenceChunk(p, 0, t, num_logits=len(p)) for p, t in zip(prompts, tables, strict=True)]
    ours: list[list[torch.Tensor]] = [[rows] for rows in runner.run(chunks).split([len(p) for p in prompts])]
    for _ in range(decode_steps):
        new = [rng.randrange(vocab) for _ in seqs]
        chunks = [SequenceChunk([t], len(s), tab) for s, t, tab in zip(seqs, new, tables, strict=True)]
        logits = runner.run(chunks)  # [num sequences, vocab]
        for i, (s, t) in enumerate(zip(seqs, new, strict=True)):
            s.append(t)
            ours[i].append(logits[i : i + 1])
    exact = exact_copy(hf_model)
    # a causal model's logits at position i depend on tokens <= i: one pass per final sequence
    return closest_to_failing(
        [
            agreement(torch.cat(rows), hf_logits(exact, s), hf_logits(hf_model, s))
            for rows, s in zip(ours, seqs, strict=True)
        ]
    )
