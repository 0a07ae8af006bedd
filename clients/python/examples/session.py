"""Many requests on one stream with the blocking client: one per prompt, each read to its end
in its own thread while the others run.

python examples/session.py "def fibonacci(n):" "class Stack:" --server 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor

from draftwise_client import Client, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:", "def quicksort(items):"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("prompts", nargs="*", default=PROMPTS, help="one request per prompt (default: three)")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    with Client(args.server, api_key=os.environ.get("DRAFTWISE_API_KEY")) as client:
        client.wait_ready(timeout=60)
        with client.session(timeout=300) as session:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
            streams = [session.generate(prompt, params) for prompt in args.prompts]
            with ThreadPoolExecutor(len(streams)) as pool:
                completions = list(pool.map(lambda s: s.complete(), streams))
    for prompt, completion in zip(args.prompts, completions, strict=True):
        print(f"--- {completion.finish_reason}, {len(completion.token_ids)} tokens\n{prompt}{completion.text}")


if __name__ == "__main__":
    main()
