"""``python -m graphstash``: the ``graphstash`` command (:mod:`graphstash.tools.cli`)."""
from __future__ import annotations

from graphstash.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
