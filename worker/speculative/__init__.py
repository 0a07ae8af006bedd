"""Speculative decoding: the Proposer interface and its two proposers (a draft model, n-gram
prompt lookup), the SpecDecoder that runs propose → verify → accept → roll back, exact
rejection sampling, and the policy that picks k per request per step (docs/engine.md,
"Speculative decoding")."""

from __future__ import annotations

from draftwise.worker.speculative.ngram import NgramProposer
from draftwise.worker.speculative.policy import CostModel, PolicyConfig, RequestSpecState, SpeculationPolicy
from draftwise.worker.speculative.proposer import Proposal, Proposer
from draftwise.worker.speculative.rejection_sampler import RejectionOutput, rejection_sample

__all__ = [
    "CostModel",
    "NgramProposer",
    "PolicyConfig",
    "Proposal",
    "Proposer",
    "RejectionOutput",
    "RequestSpecState",
    "SpeculationPolicy",
    "rejection_sample",
]
