"""Loading what a speculative method drafts with, before the engine sizes its KV cache: a
draft model (checked against the target; with the bridge between their tokenizers when they
differ), or a trained EAGLE / Medusa head (the one given, or the one shipped for the target)."""

from __future__ import annotations

from pathlib import Path

from draftwise.worker.core.config import EngineConfig
from draftwise.worker.model.gguf import is_gguf_path
from draftwise.worker.model.kv_cache import bytes_per_block
from draftwise.worker.model.loader import LoadedModel, load_model
from draftwise.worker.model.model_config import ModelLoadError
from draftwise.worker.paths import default_model_path
from draftwise.worker.speculative.heads import (
    HEAD_KINDS,
    LoadedHead,
    find_head,
    head_model_config,
    load_head,
    target_fingerprint,
)
from draftwise.worker.speculative.vocab_bridge import VocabBridge, build_bridge
from draftwise.worker.text.tokenizer import Tokenizer, load_tokenizer

__all__ = ["check_speculative_model", "head_kv_bytes_per_block", "load_draft", "load_spec_head"]


def check_speculative_model(config: EngineConfig) -> None:
    """ModelLoadError when ``config.speculative_model`` names no checkpoint folder, .gguf file
    or "default" (checked before the target's load, which may be long)."""
    name = config.speculative_model
    if name is None or str(name) == "default":
        return
    path = Path(name)
    if config.spec_method in HEAD_KINDS:
        if not (path / "draftwise_head.json").is_file():
            raise ModelLoadError(f"speculative_model: {name}: not a draft head folder (no draftwise_head.json)")
        return
    if not (path.is_dir() or (path.is_file() and is_gguf_path(path))):
        raise ModelLoadError(f"speculative_model: {name}: not a checkpoint folder or .gguf file (or 'default')")


def load_draft(
    config: EngineConfig, target: LoadedModel, max_model_len: int, target_tokenizer: Tokenizer | None
) -> tuple[LoadedModel | None, VocabBridge | None]:
    """The draft model when ``config`` speculates with one (checked against the target), and
    the bridge between their tokenizers when they differ (None: the draft drafts target ids).
    ``target_tokenizer``: the engine's (None: read from the target's folder if it has one)."""
    if config.spec_method != "draft":
        return None, None
    name = str(config.speculative_model)
    folder = default_model_path("draft") if name == "default" else Path(name)
    try:
        quantization = config.speculative_quantization or target.quantization
        draft = load_model(folder, dtype=target.dtype, device=target.device, quantization=quantization)
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_model: {e}") from e
    bridge = _bridge(config, folder, draft, target, target_tokenizer)
    if bridge is not None:
        return draft, bridge  # its context is counted in its own tokens (CrossVocabProposer.can_draft)
    if config.speculative_vocab_mapping != "auto":
        raise ValueError(
            f"speculative_vocab_mapping={config.speculative_vocab_mapping!r}: the draft shares the target's "
            "tokenizer (it applies to a draft with another tokenizer)"
        )
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"the draft model's context ({draft.config.max_position_embeddings}) is shorter than "
            f"max_model_len={max_model_len}: lower max_model_len"
        )
    if draft.config.vocab_size > target.config.vocab_size:
        raise ValueError(
            f"the draft's vocabulary ({draft.config.vocab_size}) is larger than the target's "
            f"({target.config.vocab_size}) and no tokenizer says how the two map: give the draft's folder its tokenizer"
        )
    return draft, None


def _bridge(
    config: EngineConfig, folder: Path, draft: LoadedModel, target: LoadedModel, target_tokenizer: Tokenizer | None
) -> VocabBridge | None:
    """The bridge when both sides have a tokenizer and they differ; None when either has none
    (the draft is taken to share the target's ids, as before tokenizers were compared)."""
    try:
        draft_tok = load_tokenizer(folder)
        target_tok = target_tokenizer or load_tokenizer(Path(config.tokenizer) if config.tokenizer else target.folder)
    except ModelLoadError:
        return None
    return build_bridge(
        draft_tok, target_tok, draft.config.vocab_size, target.config.vocab_size, config.speculative_vocab_mapping
    )


def load_spec_head(config: EngineConfig, target: LoadedModel) -> LoadedHead | None:
    """The EAGLE or Medusa head when ``config`` speculates with one: ``speculative_model``'s
    folder, or the head shipped for this target; ModelLoadError when it does not fit."""
    kind = config.spec_method
    if kind not in HEAD_KINDS:
        return None
    name = config.speculative_model
    folder = find_head(kind, target_fingerprint(target.model)) if name is None or str(name) == "default" else Path(name)
    return load_head(folder, target.model, target.dtype, target.device, exact_codes=target.quantization == "auto")


def head_kv_bytes_per_block(head: LoadedHead | None, target: LoadedModel, block_size: int) -> int:
    """Bytes an EAGLE head's own KV cache takes per block (0 for Medusa or no head): counted
    in the KV budget beside the target's."""
    if head is None or head.config.kind != "eagle":
        return 0
    return bytes_per_block(head_model_config(target.config), block_size, target.dtype)
