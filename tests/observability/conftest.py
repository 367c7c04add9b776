"""The observability tests import `grafana`, a top-level folder that is not an installed
package: put the repository root on sys.path before they are collected."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
