"""Speculative decoding: proposers (n-gram prompt lookup, ...), exact rejection sampling and
the policy that picks k per request per step. Not yet wired into the engine."""

from __future__ import annotations

from draftwise.worker.spec.ngram import NgramProposer
from draftwise.worker.spec.policy import CostModel, PolicyConfig, RequestSpecState, SpeculationPolicy
from draftwise.worker.spec.rejection_sampler import RejectionOutput, rejection_sample

__all__ = [
    "CostModel",
    "NgramProposer",
    "PolicyConfig",
    "RejectionOutput",
    "RequestSpecState",
    "SpeculationPolicy",
    "rejection_sample",
]
