"""A TCP proxy on 127.0.0.1 between a client and a gateway, whose connections a test can
drop at will (reset, as a network failure would): the client's gRPC call then fails with
UNAVAILABLE while the gateway keeps the request. It runs its own event loop on a thread, so
blocking and asyncio tests use it alike."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from typing import Any


class TcpProxy:
    """Listens on an ephemeral port of 127.0.0.1 and pipes each connection to ``target_port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.drops = 0
        """Connections reset by :meth:`drop`."""
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port: int = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        pair = (writer, up_writer)
        self._conns.add(pair)
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._conns.discard(pair)
            for w in pair:
                w.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    async def _drop(self) -> int:
        n = 0
        for pair in list(self._conns):
            for w in pair:
                sock = w.get_extra_info("socket")
                if sock is not None:  # SO_LINGER 0: close with RST, not a graceful FIN
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.transport.abort()
            n += 1
        self._conns.clear()
        return n

    def drop(self) -> int:
        """Reset every open connection (client and gateway sides); returns how many. New
        connections are accepted as before (the client reconnects through the proxy)."""
        n = self._run(self._drop())
        self.drops += n
        return n

    def close(self) -> None:
        """Stop listening and reset every connection (idempotent)."""
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            self._server.close()
            await self._drop()
            # Handlers whose pipes are still unwinding end here, not as pending tasks the
            # stopped loop would destroy.
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
