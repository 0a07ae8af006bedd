"""``python -m draftwise.gateway``: see :mod:`draftwise.gateway.main`."""

from __future__ import annotations

import sys

from draftwise.gateway.main import main

sys.exit(main())
