"""Engine configuration: one frozen dataclass, vLLM's names where vLLM has one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from."""

    model: str | Path | None = None  # Hugging Face checkpoint folder; None: the embedded default target
    tokenizer: str | Path | None = None  # tokenizer folder; None: the model folder
    skip_tokenizer_init: bool = False  # run without a tokenizer (prompts as token ids, no text out)
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (float32 on CPU, checkpoint dtype on CUDA)
    device: str = "cpu"  # cpu | cuda | cuda:N
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 128  # requests in one step
    max_num_batched_tokens: int | None = None  # tokens in one step; None: 2048 (chunked) or max_model_len
    enable_chunked_prefill: bool = True  # split long prompts across steps
    max_model_len: int | None = None  # context length; None: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = (
        None  # KV budget in bytes (CPU default 1 GiB; on CUDA overrides gpu_memory_utilization)
    )
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights, activations and KV
    num_kv_blocks: int | None = None  # exact KV block count, overriding both budgets (tests, tuning)
    seed: int = 0  # seeds the RNG of requests that bring no seed of their own
    enforce_eager: bool = False  # never use CUDA graphs (graph capture is CUDA-only; CPU is always eager)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
