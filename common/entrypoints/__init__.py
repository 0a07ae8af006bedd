"""Entry points under vLLM's module names, for commands copied from vLLM's guides:
``python -m draftwise.entrypoints.api_server`` (:mod:`draftwise.entrypoints.api_server`)."""
