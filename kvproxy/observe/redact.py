"""Credentials are never printed: passwords and tokens in URLs, wherever a URL is shown
(config errors, log lines, /capacity). Pure text in, text out.

    redact("http://user:pw@host/x?token=t")  ->  "http://user:***@host/x?token=***"

A URL's userinfo keeps its user name when it has a password (`user:***@`), and is masked
whole when it has none (`***@`: a lone userinfo is most often a token). Query parameters
whose name says they carry a secret are masked too.
"""

from __future__ import annotations

import re

MASK = "***"
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^:@/\s'\"\\]*)(:[^@/\s'\"\\]*)?@")
_SECRET_PARAM = re.compile(
    r"([?&](?:access_token|token|api_key|apikey|key|password|passwd|pass|secret|sig|"
    r"signature|auth)=)[^&#\s'\"\\]*",
    re.IGNORECASE,
)


def _userinfo(m: re.Match[str]) -> str:
    if m.group(3) is not None:
        return f"{m.group(1)}{m.group(2)}:{MASK}@"
    return f"{m.group(1)}{MASK}@"


def redact(text: str) -> str:
    """`text` with every URL's password or token masked."""
    if "@" in text:
        text = _USERINFO.sub(_userinfo, text)
    if "=" in text:
        text = _SECRET_PARAM.sub(lambda m: m.group(1) + MASK, text)
    return text


__all__ = ["MASK", "redact"]
