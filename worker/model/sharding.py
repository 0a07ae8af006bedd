"""Which part of a Llama-family model each tensor-parallel rank holds (Megatron-style).

- q/k/v and gate/up are **column-parallel**: a rank holds the rows of its heads (its key/value
  heads and the query heads that read them) and of its slice of the MLP width;
- o and down are **row-parallel**: a rank holds the matching input columns, and the ranks' partial
  products are summed with an all-reduce (the bias, when there is one, is added once after it);
- the embedding and the LM head are **vocabulary-parallel**: a rank holds a contiguous range of
  ``ceil(vocab / ranks)`` rows (the last range padded): a lookup outside it gives zeros and the
  all-reduce sums the one rank that has the row; the LM head's logits are gathered on rank 0.

Heads are split by key/value group, so that a rank's query heads read only its own key/value
heads: with ``Hkv >= ranks`` each rank gets a contiguous run of key/value heads (as even as the
count allows: SmolLM2-135M's 3 over 2 ranks gives 2 and 1) and their query heads; with fewer
key/value heads than ranks each key/value head is replicated on ``ranks / Hkv`` ranks and its
group's query heads split among them. Plain data, no torch.distributed: the loader and the tests
read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from draftwise.worker.model.model_config import ModelConfig

Span = tuple[int, int]  # [start, stop)

__all__ = ["Shard", "Span", "split"]


def split(n: int, parts: int, i: int) -> Span:
    """Part ``i`` of ``range(n)`` cut into ``parts`` contiguous runs as even as possible (the
    first ``n % parts`` runs one longer)."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds of a model."""

    rank: int  # this rank, 0 .. size - 1
    size: int  # ranks in all
    q_heads: Span  # query heads
    kv_heads: Span  # key/value heads
    intermediate: Span  # columns of the MLP width
    vocab: Span  # embedding / LM-head rows that are real (the rest of the padded range is padding)
    vocab_rows: int  # rows every rank holds: ceil(vocab_size / size)

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, size: int) -> Shard:
        """Rank ``rank``'s part of ``cfg``; ValueError naming the reason when ``size`` ranks cannot
        share the model (more ranks than query heads or than MLP columns, or key/value heads that
        neither split over the ranks nor replicate evenly across them)."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside [0, {size})")
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        group = heads // kv
        if size > heads:
            raise ValueError(f"tensor_parallel_size={size} is more than the model's {heads} attention heads")
        if size > cfg.intermediate_size:
            raise ValueError(f"tensor_parallel_size={size} is more than the model's MLP width")
        if kv >= size:
            kv_span = split(kv, size, rank)
            q_span = (kv_span[0] * group, kv_span[1] * group)
        else:
            if size % kv:
                raise ValueError(
                    f"tensor_parallel_size={size} must be a multiple of the model's {kv} key/value heads "
                    "when it is larger (each key/value head is replicated on the same number of ranks)"
                )
            per_head = size // kv
            if per_head > group:
                raise ValueError(
                    f"tensor_parallel_size={size}: {per_head} ranks per key/value head but only {group} query heads each"
                )
            head = rank // per_head
            lo, hi = split(group, per_head, rank % per_head)
            kv_span = (head, head + 1)
            q_span = (head * group + lo, head * group + hi)
        rows = -(-cfg.vocab_size // size)
        v0 = min(rank * rows, cfg.vocab_size)
        return cls(
            rank=rank,
            size=size,
            q_heads=q_span,
            kv_heads=kv_span,
            intermediate=split(cfg.intermediate_size, size, rank),
            vocab=(v0, min(v0 + rows, cfg.vocab_size)),
            vocab_rows=rows,
        )

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with this rank's head counts, MLP width and vocabulary rows: the shapes of the
        modules and of the KV cache it holds."""
        return replace(
            cfg,
            num_attention_heads=self.q_heads[1] - self.q_heads[0],
            num_key_value_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            vocab_size=self.vocab_rows,
        )

    def slice_of(self, name: str, cfg: ModelConfig) -> tuple[int, Span] | None:
        """The (dimension, span) of Hugging Face checkpoint tensor ``name`` this rank reads (None:
        all of it). Vocabulary spans are the real rows; the loader pads the last rank's."""
        d = cfg.head_dim
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, self.vocab
        parts = name.rsplit(".", 2)
        if len(parts) < 3:
            return None
        kind = parts[-2]
        if kind == "q_proj":
            return 0, (self.q_heads[0] * d, self.q_heads[1] * d)
        if kind in ("k_proj", "v_proj"):
            return 0, (self.kv_heads[0] * d, self.kv_heads[1] * d)
        if kind in ("gate_proj", "up_proj"):
            return 0, self.intermediate
        if parts[-1] != "weight":  # a row-parallel bias stays whole: added once, after the sum
            return None
        if kind == "o_proj":
            return 1, (self.q_heads[0] * d, self.q_heads[1] * d)
        if kind == "down_proj":
            return 1, self.intermediate
        return None
