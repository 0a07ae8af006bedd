"""Prompts for the integration tests: short pieces of Python, the default model's domain."""

from __future__ import annotations

BASES = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    "import os\n\n\ndef list_files(path):",
    "def quicksort(items):",
    "for i in range(10):",
    "with open(path) as f:",
    "def __repr__(self):",
    "try:\n    import json\nexcept ImportError:",
    "def parse_args(argv=None):",
    "if __name__ == '__main__':",
]


def prompts(n: int) -> list[str]:
    """``n`` distinct prompts."""
    return [BASES[i % len(BASES)] if i < len(BASES) else f"# {i}\n{BASES[i % len(BASES)]}" for i in range(n)]


def max_tokens(i: int) -> int:
    """Output lengths that vary, so requests join and leave the batch at different steps."""
    return 8 + (i * 7) % 33
