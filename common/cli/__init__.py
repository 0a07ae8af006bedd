"""The ``draftwise`` command (console script ``draftwise = "draftwise.cli:main"``).

draftwise serve [--workers 2] [--port 50051] [--model FOLDER|FILE.gguf]   # gateway + workers on this machine
draftwise serve --speculative-model default                     # ... with speculative decoding
draftwise generate "def fibonacci(n):"                           # in-process engine, embedded default model
draftwise generate "def fibonacci(n):" --server 127.0.0.1:50051  # streamed from a running server
draftwise chat --server 127.0.0.1:50051                          # a conversation (a model with a chat template)
draftwise health 127.0.0.1:50051                                 # exit 0 when it answers SERVING
draftwise worker ... / draftwise gateway ...                     # one process of a deployment each

One module per subcommand: ``generate`` (in-process), ``remote`` (``generate --server``, through
the Python client), ``chat``, ``serve`` (``health`` is :mod:`draftwise.health_cli`); ``connect`` holds what the commands that
talk to a server share, ``engine_flags`` the engine's flags (made from EngineConfig's fields,
:mod:`draftwise.flagtable`), ``main`` the top level.
"""

from __future__ import annotations

from draftwise.cli.connect import server_address
from draftwise.cli.main import main

__all__ = ["main", "server_address"]
