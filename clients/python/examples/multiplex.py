"""Many requests on one stream: start several, cancel one mid-way, collect the others.

python examples/multiplex.py --server 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import os

from draftwise_client import AsyncClient, SamplingParams

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef walk(path):", "def quicksort(items):"]


async def main(server: str) -> None:
    async with AsyncClient(server, api_key=os.environ.get("DRAFTWISE_API_KEY")) as client:
        await client.wait_ready(timeout=60)
        async with client.session() as session:
            streams = [await session.generate(p, SamplingParams(max_tokens=48, temperature=0)) for p in PROMPTS]
            long = await session.generate("# a long one\n", SamplingParams(max_tokens=400, ignore_eos=True))
            first = await anext(long)  # let it start, then cancel it
            await long.cancel()
            rest = [d async for d in long]
            print(
                f"cancelled after {len(first.token_ids) + sum(len(d.token_ids) for d in rest)} tokens:",
                rest[-1].finish_reason,
            )
            for prompt, completion in zip(PROMPTS, await asyncio.gather(*(s.complete() for s in streams)), strict=True):
                print(f"--- {completion.finish_reason}, {len(completion.token_ids)} tokens\n{prompt}{completion.text}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--server", default="127.0.0.1:50051")
    asyncio.run(main(p.parse_args().server))
