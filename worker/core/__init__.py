"""What every part of the worker shares about requests: the ``Request`` and its outputs, the
engine configuration, the KV block manager, the scheduler (the one writer of a request's
progress) and per-request containment.

It imports none of ``engine``, ``speculative`` or ``text``: those build on it, and the engine's
step (``worker/engine/``) calls the others, so the worker's packages form no cycle."""
