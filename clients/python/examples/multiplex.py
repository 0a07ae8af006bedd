"""Many requests on one stream with the asyncio client: start one per prompt, cancel a long one
mid-way, collect the others.

python examples/multiplex.py "def fibonacci(n):" "class Stack:" --server 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import os

from draftwise_client import AsyncClient, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef walk(path):", "def quicksort(items):"]


async def main(prompts: list[str], server: str, max_tokens: int) -> None:
    async with AsyncClient(server, api_key=os.environ.get("DRAFTWISE_API_KEY")) as client:
        await client.wait_ready(timeout=60)
        async with client.session() as session:
            params = SamplingParams(max_tokens=max_tokens, temperature=0)
            streams = [await session.generate(p, params) for p in prompts]
            long = await session.generate("# a long one\n", SamplingParams(max_tokens=400, ignore_eos=True))
            first = await anext(long)  # let it start, then cancel it
            await long.cancel()
            rest = [d async for d in long]
            print(
                f"cancelled after {len(first.token_ids) + sum(len(d.token_ids) for d in rest)} tokens:",
                rest[-1].finish_reason,
            )
            for prompt, completion in zip(prompts, await asyncio.gather(*(s.complete() for s in streams)), strict=True):
                print(f"--- {completion.finish_reason}, {len(completion.token_ids)} tokens\n{prompt}{completion.text}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("prompts", nargs="*", default=PROMPTS, help="one request per prompt (default: four)")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    asyncio.run(main(args.prompts, args.server, args.max_tokens))
