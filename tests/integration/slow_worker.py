"""A real worker whose engine steps are slow on purpose, for the stall tests: every step that
has work sleeps ``DELAY_S`` seconds on the engine thread first (as one long prefill on a loaded
machine would take), then runs. The worker's gRPC front is untouched: it answers ``GetLoad``
and health checks while a step runs.

    python tests/integration/slow_worker.py DELAY_S [worker flags...]
"""

from __future__ import annotations

import sys
import time

from draftwise.worker.engine.llm_engine import LLMEngine
from draftwise.worker.serving.server import main


def slow_steps(delay_s: float) -> None:
    """Make every ``LLMEngine.step`` sleep ``delay_s`` seconds before it runs."""
    step = LLMEngine.step

    def slow_step(self: LLMEngine):  # noqa: ANN202 (whatever step returns)
        time.sleep(delay_s)
        return step(self)

    LLMEngine.step = slow_step  # type: ignore[method-assign]


if __name__ == "__main__":
    slow_steps(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
