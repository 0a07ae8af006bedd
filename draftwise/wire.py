"""gRPC metadata keys the gateway and the workers share (no torch here: the gateway imports it).

A worker answers ``GetLoad`` with these as trailing metadata; the gateway's router reads them
and ``ListModels`` reports them.
"""

from __future__ import annotations

MAX_MODEL_LEN_KEY = "draftwise-max-model-len"
"""The worker's context length (prompt + output tokens of one request)."""
SPEC_METHOD_KEY = "draftwise-speculative-method"
""""draft" or "ngram"; absent when the worker does not speculate."""
DRAFT_MODEL_KEY = "draftwise-draft-model"
"""The draft model's name, with speculative method "draft"."""
SPEC_TOKENS_KEY = "draftwise-num-speculative-tokens"
"""The most tokens drafted per request per step."""
