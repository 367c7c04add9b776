"""Tenant identity: who a request belongs to, for canary checks, logs and metric labels.

Owns the rules, in priority order:

1. the tenant header (`KVPROXY_TENANT_HEADER`, default `X-Tenant-ID`), only when
   `KVPROXY_TRUST_TENANT_HEADER` is true (kvproxy sits behind an authenticating gateway
   that sets it); an untrusted header is ignored and stripped before forwarding, so a
   client cannot pose as another tenant to anything upstream either;
2. the bearer token, mapped through `KVPROXY_TENANT_TOKENS` (token -> tenant);
3. any other bearer token: `anon-<8 hex>`, a salted HMAC of the token, stable per token;
4. otherwise None (unknown).

Must never: log, store or return a token or any part of it (I8); return an id that is not
safe as a Prometheus label (only [A-Za-z0-9._-], at most `MAX_TENANT_LEN` characters).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

MAX_TENANT_LEN = 64
UNKNOWN_TENANT = "unknown"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
# Room for "-" + 8 hex characters when an id had to be changed to be safe.
_SUFFIX_LEN = 9
# Anonymous ids remembered (`TenantResolver._anonymous`): an HMAC-SHA256 in Python is ~30k
# instructions, more than the rest of a small request's tenant, routing and counting
# together; clients reuse their keys. Past this many the memo starts over.
ANONYMOUS_MEMO = 4096
# Mappings whose get() already ignores case (aiohttp's request headers).
_CASE_INSENSITIVE = (CIMultiDict, CIMultiDictProxy)


def sanitize_tenant(raw: str) -> str | None:
    """A label-safe tenant id. Ids that are already safe pass unchanged; others get unsafe
    characters replaced and a short hash of the original appended, so two different raw ids
    never collide into one (a collision would make a foreign canary look like one's own)."""
    value = raw.strip()
    if not value:
        return None
    if len(value) <= MAX_TENANT_LEN and not _SAFE.search(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    cleaned = _SAFE.sub("_", value)[: MAX_TENANT_LEN - _SUFFIX_LEN]
    return f"{cleaned}-{digest}"


def tenant_label(tenant: str | None) -> str:
    """The value for a `tenant` metric label / log field."""
    return tenant if tenant is not None else UNKNOWN_TENANT


def _header(headers: Mapping[str, str], name: str) -> str | None:
    # aiohttp's headers are case-insensitive; plain dicts (tests, other callers) are not.
    value = headers.get(name)
    if value is None and not isinstance(headers, _CASE_INSENSITIVE):
        lname = name.lower()
        value = headers.get(lname)
        if value is None:
            for key, v in headers.items():
                if key.lower() == lname:
                    return v
    return value


class TenantSettings(Protocol):
    """The settings tenant identity reads (kvproxy.config's Settings has them)."""

    @property
    def tenant_header(self) -> str: ...
    @property
    def trust_tenant_header(self) -> bool: ...
    @property
    def tenant_hash_salt(self) -> str: ...
    @property
    def tenant_tokens(self) -> Mapping[str, str]: ...


class TenantResolver:
    """Resolve a request's tenant from its headers; built once from the settings."""

    def __init__(self, settings: TenantSettings) -> None:
        self.header = settings.tenant_header
        self.trust_header = settings.trust_tenant_header
        self._salt = settings.tenant_hash_salt.encode("utf-8")
        self._tokens: dict[str, str] = {}
        for token, tenant in settings.tenant_tokens.items():
            safe = sanitize_tenant(tenant)
            if safe is not None and token:
                self._tokens[token] = safe
        self._strip = frozenset() if self.trust_header else frozenset({self.header.lower()})
        # hash(token) -> its anonymous id. Keyed by the process's own salted string hash,
        # so the token itself is never kept; two tokens whose 64-bit hashes met would share
        # an id, a far rarer event than two tokens meeting in the id's own 32 bits.
        self._anonymous: dict[int, str] = {}

    def resolve(self, headers: Mapping[str, str]) -> str | None:
        if self.trust_header:
            value = _header(headers, self.header)
            if value is not None:
                tenant = sanitize_tenant(value)
                if tenant is not None:
                    return tenant
        token = _bearer(_header(headers, "Authorization"))
        if token is None:
            return None
        mapped = self._tokens.get(token)
        if mapped is not None:
            return mapped
        key = hash(token)
        anonymous = self._anonymous.get(key)
        if anonymous is None:
            digest = hmac.new(self._salt, token.encode("utf-8"), hashlib.sha256).hexdigest()
            anonymous = "anon-" + digest[:8]
            if len(self._anonymous) >= ANONYMOUS_MEMO:
                self._anonymous.clear()
            self._anonymous[key] = anonymous
        return anonymous

    def headers_to_strip(self) -> frozenset[str]:
        """Lower-case names of request headers not to forward upstream."""
        return self._strip


def _bearer(value: str | None) -> str | None:
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token
