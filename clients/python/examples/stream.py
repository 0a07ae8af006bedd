"""Stream a completion with the blocking client.

python examples/stream.py "def fibonacci(n):" --server 127.0.0.1:50051 --max-tokens 64
"""

from __future__ import annotations

import argparse
import os

from draftwise_client import Client, GenerationError, SamplingParams


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("prompt")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    with Client(args.server, api_key=os.environ.get("DRAFTWISE_API_KEY")) as client:
        client.wait_ready(timeout=60)
        print(args.prompt, end="", flush=True)
        try:
            for delta in client.generate(
                args.prompt, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
            ):
                print(delta.text, end="", flush=True)
                if delta.finished:
                    print(f"\n[{delta.finish_reason}; {delta.usage.completion_tokens} tokens]")
        except GenerationError as e:
            print(f"\nerror: {e}")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
