"""One worker of the embedded default model and a gateway in front of it with the OpenAI HTTP
endpoint on (``--http-port=0``), for tests that talk raw HTTP and gRPC to the same server."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.integration.procs import Proc, start_gateway, start_workers


@dataclass
class HttpGateway:
    worker: Proc
    gateway: Proc
    http_port: int

    def raw(self, data: bytes, timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
        """Send ``data`` (a whole HTTP/1.1 request) on a fresh connection: (status, headers, body)."""
        with socket.create_connection(("127.0.0.1", self.http_port), timeout=timeout) as s:
            s.sendall(data)
            chunks = []
            while True:
                try:
                    b = s.recv(65536)
                except ConnectionResetError:
                    break
                if not b:
                    break
                chunks.append(b)
        resp = b"".join(chunks)
        head, _, body = resp.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = _unchunk(body)
        return status, headers, body

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        h = {"Host": "127.0.0.1", "Content-Type": "application/json", "Connection": "close", **(headers or {})}
        h["Content-Length"] = str(len(body))
        head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        return self.raw(head.encode() + body)

    def post_json(self, path: str, obj: object) -> tuple[int, dict[str, str], object]:
        status, headers, body = self.post(path, json.dumps(obj).encode())
        return status, headers, json.loads(body)


def _unchunk(data: bytes) -> bytes:
    out = []
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out.append(rest[:n])
        data = rest[n + 2 :]
    return b"".join(out)


@contextlib.contextmanager
def http_gateway(tmp: Path, *flags: str) -> Iterator[HttpGateway]:
    (worker,) = start_workers(1, tmp, "httpworker")
    try:
        g = start_gateway([worker], tmp, "httpgw", "--http-port=0", *flags)
        try:
            port = next(int(e["http_port"]) for e in g.log_events() if e.get("event") == "gateway listening")
            yield HttpGateway(worker, g, port)
        finally:
            g.stop()
    finally:
        worker.stop()
