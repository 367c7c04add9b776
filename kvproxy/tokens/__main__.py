"""`python -m kvproxy.tokens [--check]`: the counting ladder's table in docs/counting.md,
made from `LADDER` (kvproxy/tokens/counter.py) by the machinery of `make docs`
(kvproxy.config.doctables); `--check` changes nothing and exits 1 when the table is stale.

Must never: load a tokenizer or touch the network (it runs in `make docs`).
"""

from __future__ import annotations

import sys

from kvproxy.config import doctables
from kvproxy.tokens.counter import LADDER
from kvproxy.tokens.ladder import table

COUNTING_MD = doctables.REPO / "docs" / "counting.md"
LADDER_TABLE = doctables.Table(
    COUNTING_MD, "ladder", lambda: table(LADDER, "kvproxy/tokens/counter.py")
)

if __name__ == "__main__":
    sys.exit(doctables.main(None, (LADDER_TABLE,), "python -m kvproxy.tokens", __doc__))
