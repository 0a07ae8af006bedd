"""Sampling: sampling parameters, the batched sampler (temperature, top-k/p, min-p, penalties,
logprobs) and randomness keyed by (seed, position)."""
