"""Engine configuration: one frozen dataclass, vLLM's names where vLLM has one."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

from draftwise.worker.paths import is_model_name

DTYPE_NAMES = ("float32", "bfloat16", "float16", "auto")
QUANTIZATIONS = ("fp16", "int8", "int4")  # packed modes; draftwise.worker.model.cpu_weights (torch-free here)
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATIONS)  # "auto": exact codes for a GGUF file's blocks; "none": off
SPECULATIVE_METHODS = ("draft", "ngram", "eagle", "medusa", "suffix")
LOOKUP_METHODS = ("suffix", "ngram")
"""What ``speculative_lookup`` takes: a lookup drafting beside a model drafter."""
VOCAB_MAPPINGS = ("auto", "tli", "slem")
"""What ``speculative_vocab_mapping`` takes (draftwise.worker.speculative.vocab_bridge)."""
DEFAULT_SPECULATIVE_TOKENS = 5
MAX_SPECULATIVE_TOKENS = 16
MAX_TENSOR_PARALLEL = 64


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from."""

    model: str | Path | None = None  # Hugging Face checkpoint folder or GGUF file; None: the embedded default target
    tokenizer: str | Path | None = None  # tokenizer folder; None: the model folder
    skip_tokenizer_init: bool = False  # run without a tokenizer (prompts as token ids, no text out)
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (float32 on CPU, checkpoint dtype on CUDA)
    device: str = "cpu"  # cpu | cuda | cuda:N
    quantization: str | None = (
        "auto"  # "fp16" / "int8" / "int4": CPU weights packed in float16 / 8- / 4-bit codes (a float16 scale and minimum per output and 32 inputs), float32 activations (docs/models.md); "auto": on CPU in float32, a GGUF file's weights that int8 or float16 codes hold exactly kept so (the same results bit for bit); "none" or None: the dtype's weights
    )
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 128  # requests in one step
    max_num_batched_tokens: int | None = None  # tokens in one step; None: 2048 (chunked) or max_model_len
    enable_chunked_prefill: bool = True  # split long prompts across steps
    enable_prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (full blocks; per-tenant salt)
    max_model_len: int | None = None  # context length; None: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None = (
        None  # KV budget in bytes (CPU default: max_num_seqs x max_model_len tokens, at most 1 GiB; CUDA: overrides gpu_memory_utilization)
    )
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights, activations and KV
    num_kv_blocks: int | None = None  # exact KV block count, overriding both budgets (tests, tuning)
    seed: int = 0  # seeds the RNG of requests that bring no seed of their own
    enforce_eager: bool = False  # never use CUDA graphs (graph capture is CUDA-only; CPU is always eager)
    retain_freed_memory: bool = True  # glibc: keep freed heap memory in the process (worker/engine/host_memory.py)
    tensor_parallel_size: int = (
        1  # rank processes one worker shards the target across (torch.distributed: gloo on CPU, NCCL on CUDA)
    )
    decode_threads: int | None = (
        None  # CPU: threads for steps of at most 32 tokens (decode, verify), all of them for larger ones; None: the same for all (serve: one fewer when the gateway shares the cores)
    )
    # --- speculative decoding (docs/engine.md); all unset: no speculation
    speculative_model: str | Path | None = (
        None  # draft checkpoint folder, or "default": the embedded draft; eagle/medusa: a head folder (None: the head shipped for the target)
    )
    speculative_method: str | None = (
        None  # "draft" | "ngram" | "eagle" | "medusa" | "suffix"; None: "draft" when speculative_model is set
    )
    num_speculative_tokens: int | None = None  # most tokens drafted per request per step; None: 5
    speculative_adaptive: bool = True  # the policy picks k <= num_speculative_tokens; False: always exactly that
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched; None: 1
    prompt_lookup_max: int | None = None  # ngram: longest suffix tried first; None: 4
    suffix_cache_max_tokens: int | None = None  # suffix: tokens of earlier outputs kept, all tenants; None: 200000
    speculative_lookup: str | None = (
        None  # "suffix" | "ngram": a lookup beside a draft model, EAGLE or Medusa, the more promising drafts each step
    )
    speculative_quantization: str | None = (
        None  # "fp16" / "int8" / "int4": the draft model's weights packed so (CPU), whatever the target's; None: as the target's
    )
    speculative_vocab_mapping: str = (
        "auto"  # a draft with another tokenizer: "tli" / "slem"; "auto": TLI when half the draft's tokens are shared
    )

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str) and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        for name in ("quantization", "speculative_quantization"):
            mode = getattr(self, name)
            if mode is not None and mode not in QUANTIZATION_CHOICES:
                raise ValueError(f"{name} must be one of {', '.join(QUANTIZATION_CHOICES)}, got {mode!r}")
            if mode in QUANTIZATIONS and (self.device != "cpu" or self.dtype not in ("auto", "float32")):
                raise ValueError(
                    f"{name}={mode!r} packs CPU weights for float32 activations: it needs device cpu and "
                    f"dtype float32 or auto (got device {self.device}, dtype {self.dtype})"
                )
        if isinstance(self.device, str) and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
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
        if self.decode_threads is not None:
            if self.decode_threads < 1:
                raise ValueError(f"decode_threads must be >= 1, got {self.decode_threads}")
            if self.device != "cpu" or self.tensor_parallel_size > 1:
                raise ValueError(
                    "decode_threads applies to one CPU process (device cpu, tensor_parallel_size 1): "
                    f"got device {self.device}, tensor_parallel_size {self.tensor_parallel_size}"
                )
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL:
            raise ValueError(
                f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL}], got {self.tensor_parallel_size}"
            )
        self._check_speculation()

    def _check_speculation(self) -> None:
        method = self.speculative_method
        if method is not None and method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {method!r}")
        if method in ("eagle", "medusa") and self.tensor_parallel_size > 1:
            raise ValueError(
                f"speculative_method={method!r} does not run with tensor_parallel_size > 1 yet (the head reads the "
                "target's embedding and LM head, which the ranks split): use 'draft', 'ngram' or 'suffix'"
            )
        if method in ("ngram", "suffix") and self.speculative_model is not None:
            raise ValueError(f"speculative_method={method!r} needs no draft checkpoint: leave speculative_model unset")
        self._check_lookup()
        lookups = {method, self.speculative_lookup}
        if self.suffix_cache_max_tokens is not None and ("suffix" not in lookups or self.suffix_cache_max_tokens < 1):
            raise ValueError(
                "suffix_cache_max_tokens must be >= 1 and applies to speculative_method or speculative_lookup 'suffix' only"
            )
        if self.speculative_quantization is not None and self.spec_method != "draft":
            raise ValueError(
                "speculative_quantization applies to a draft model (speculative_model), "
                f"not to speculative_method={self.spec_method!r}"
            )
        if self.speculative_vocab_mapping not in VOCAB_MAPPINGS:
            raise ValueError(
                f"speculative_vocab_mapping must be one of {', '.join(VOCAB_MAPPINGS)}, got {self.speculative_vocab_mapping!r}"
            )
        if self.speculative_vocab_mapping != "auto" and self.spec_method != "draft":
            raise ValueError(
                "speculative_vocab_mapping applies to a draft model (speculative_model), "
                f"not to speculative_method={self.spec_method!r}"
            )
        if method == "draft" and self.speculative_model is None:
            raise ValueError("speculative_method='draft' needs speculative_model (a checkpoint folder, or 'default')")
        if self.speculative_model is not None and not str(self.speculative_model):
            raise ValueError("speculative_model must be a folder or 'default', got ''")
        k = self.num_speculative_tokens
        if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and lo < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {lo}")
        if hi is not None and hi < (lo or 1):
            raise ValueError(f"prompt_lookup_max must be >= prompt_lookup_min ({lo or 1}), got {hi}")
        if self.spec_method is None:
            given = [
                name
                for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
                if getattr(self, name) is not None
            ]
            if not self.speculative_adaptive:
                given.append("speculative_adaptive")
            if given:
                raise ValueError(
                    f"{', '.join(given)} set without speculation: give speculative_model or speculative_method"
                )
        elif "ngram" not in (self.spec_method, self.speculative_lookup) and (lo is not None or hi is not None):
            raise ValueError("prompt_lookup_min/max apply to speculative_method or speculative_lookup 'ngram' only")

    def _check_lookup(self) -> None:
        lookup = self.speculative_lookup
        if lookup is None:
            return
        if lookup not in LOOKUP_METHODS:
            raise ValueError(f"speculative_lookup must be one of {', '.join(LOOKUP_METHODS)}, got {lookup!r}")
        method = self.spec_method
        if method not in ("draft", "eagle", "medusa"):
            raise ValueError(
                f"speculative_lookup={lookup!r} drafts beside a draft model, an EAGLE head or Medusa heads "
                f"(speculative_method 'draft', 'eagle' or 'medusa'): got {method!r}"
            )

    @property
    def spec_method(self) -> str | None:
        """The speculative method in effect: "draft", "ngram", "eagle", "medusa", "suffix" or None (no speculation)."""
        if self.speculative_method is not None:
            return self.speculative_method
        return "draft" if self.speculative_model is not None else None

    @property
    def spec_k(self) -> int:
        """The most tokens drafted per request per step."""
        return self.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS

    @property
    def max_draft_tokens(self) -> int:
        """Tokens drafted per request per step at most: ``spec_k``, 0 without speculation."""
        return self.spec_k if self.spec_method is not None else 0


def missing_paths(config: EngineConfig) -> list[tuple[str, str]]:
    """The checkpoint paths of ``config`` that do not exist, as (field, path); checked before
    anything loads (a worker takes seconds to start)."""
    out = []
    for name in ("model", "tokenizer", "speculative_model"):
        value = getattr(config, name)
        if value is None or (name != "tokenizer" and is_model_name(value)):
            continue
        if not Path(value).exists():
            out.append((name, str(value)))
    return out


def as_flags(message: str) -> str:
    """``message`` about EngineConfig fields, written with the command-line flags instead:
    ``speculative_method='ngram'`` reads ``--speculative-method ngram``, ``max_num_seqs``
    reads ``--max-num-seqs``; quoted values stay as they are."""
    names = "|".join(sorted((f.name for f in fields(EngineConfig)), key=len, reverse=True))

    def flag(m: re.Match[str]) -> str:
        if m.group(1) is None:
            return m.group(0)  # a quoted value
        out = "--" + m.group(1).replace("_", "-")
        return out + (" " + m.group(2) if m.group(2) is not None else "")

    return re.sub(rf"'[^']*'|\b({names})\b(?:='([^']*)')?", flag, message)
