"""The engine: requests in, one batched step at a time, deltas out: LLMEngine and its
AsyncEngine bridge, the scheduler and the KV block pool, the Request, the configuration and the
outputs; LLM, the offline API."""
