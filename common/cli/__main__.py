"""``python -m draftwise.cli``: the ``draftwise`` command."""

from __future__ import annotations

import sys

from draftwise.cli.main import main

sys.exit(main())
