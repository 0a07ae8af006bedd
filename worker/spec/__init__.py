"""Speculative decoding: proposers (n-gram prompt lookup, ...) and exact rejection sampling."""

from __future__ import annotations

from draftwise.worker.spec.ngram import NgramProposer
from draftwise.worker.spec.rejection_sampler import RejectionOutput, rejection_sample

__all__ = ["NgramProposer", "RejectionOutput", "rejection_sample"]
