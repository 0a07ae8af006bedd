"""Stream a completion with the asyncio client.

python examples/async_stream.py "def fibonacci(n):" --server 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import os

from draftwise_client import AsyncClient, SamplingParams


async def main(prompt: str, server: str, max_tokens: int) -> None:
    async with AsyncClient(server, api_key=os.environ.get("DRAFTWISE_API_KEY")) as client:
        await client.wait_ready(timeout=60)
        print("models:", [m.name for m in await client.list_models()])
        print(prompt, end="", flush=True)
        async for delta in client.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0)):
            print(delta.text, end="", flush=True)
        print()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("prompt")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    asyncio.run(main(args.prompt, args.server, args.max_tokens))
