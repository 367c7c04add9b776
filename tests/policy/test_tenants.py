"""Tenant identity (kvproxy/policy/tenants.py): header trust, token map, hashing, safe labels."""

from __future__ import annotations

import hashlib
import hmac
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvproxy.config import Settings
from kvproxy.policy.tenants import (
    MAX_TENANT_LEN,
    TenantResolver,
    sanitize_tenant,
    tenant_label,
)

SAFE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
SECRET = "sk-live-0123456789abcdef"


def resolver(**kw: object) -> TenantResolver:
    return TenantResolver(Settings(**kw))  # type: ignore[arg-type]


def test_untrusted_header_is_ignored_and_stripped() -> None:
    r = resolver()
    assert r.resolve({"X-Tenant-ID": "acme"}) is None
    assert r.headers_to_strip() == frozenset({"x-tenant-id"})


def test_trusted_header_wins_and_is_forwarded() -> None:
    r = resolver(trust_tenant_header=True, tenant_tokens={SECRET: "bob"})
    headers = {"x-tenant-id": "acme", "Authorization": f"Bearer {SECRET}"}
    assert r.resolve(headers) == "acme"
    assert r.headers_to_strip() == frozenset()
    # Blank header: fall back to the token.
    assert r.resolve({"X-Tenant-ID": "  ", "Authorization": f"Bearer {SECRET}"}) == "bob"


def test_custom_header_name_is_case_insensitive() -> None:
    r = resolver(trust_tenant_header=True, tenant_header="X-Org")
    assert r.resolve({"X-ORG": "org-1"}) == "org-1"
    assert resolver(tenant_header="X-Org").headers_to_strip() == frozenset({"x-org"})


def test_bearer_token_map() -> None:
    r = resolver(tenant_tokens={SECRET: "acme"})
    assert r.resolve({"Authorization": f"Bearer {SECRET}"}) == "acme"
    assert r.resolve({"authorization": f"bearer   {SECRET}  "}) == "acme"


def test_unknown_token_gets_a_salted_hash_never_the_token() -> None:
    r = resolver()
    t1 = r.resolve({"Authorization": f"Bearer {SECRET}"})
    assert t1 is not None
    assert re.fullmatch(r"anon-[0-9a-f]{8}", t1)
    assert SECRET not in t1
    assert r.resolve({"Authorization": f"Bearer {SECRET}"}) == t1  # stable
    assert r.resolve({"Authorization": "Bearer other-token"}) != t1
    assert resolver(tenant_hash_salt="pepper").resolve({"Authorization": f"Bearer {SECRET}"}) != t1


def test_no_identity_is_none_and_labelled_unknown() -> None:
    r = resolver()
    assert r.resolve({}) is None
    assert r.resolve({"Authorization": "Basic dXNlcjpwYXNz"}) is None
    assert r.resolve({"Authorization": "Bearer "}) is None
    assert tenant_label(None) == "unknown"
    assert tenant_label("acme") == "acme"


def test_mapped_tenant_names_are_sanitised() -> None:
    r = resolver(tenant_tokens={SECRET: "Acme Corp/EU"})
    got = r.resolve({"Authorization": f"Bearer {SECRET}"})
    assert got is not None
    assert SAFE.match(got)
    assert got.startswith("Acme_Corp_EU-")


def test_safe_ids_pass_unchanged() -> None:
    for value in ("acme", "tenant-1", "a.b_c", "x" * MAX_TENANT_LEN):
        assert sanitize_tenant(value) == value
    assert sanitize_tenant("") is None
    assert sanitize_tenant("   ") is None


@given(st.text(min_size=1, max_size=300))
def test_sanitised_ids_are_safe_labels(raw: str) -> None:
    got = sanitize_tenant(raw)
    if raw.strip():
        assert got is not None
        assert SAFE.match(got), got
    else:
        assert got is None


@given(st.text(min_size=1, max_size=80), st.text(min_size=1, max_size=80))
def test_different_ids_do_not_collide(a: str, b: str) -> None:
    if a.strip() != b.strip():
        assert sanitize_tenant(a) != sanitize_tenant(b) or sanitize_tenant(a) is None


def test_lookalikes_stay_apart() -> None:
    assert sanitize_tenant("a b") != sanitize_tenant("a_b")
    assert sanitize_tenant("x" * 65) != sanitize_tenant("x" * 66)


def test_anonymous_ids_are_remembered_by_hash_never_by_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The HMAC is computed once per token; the memo keeps the process's string hash of the
    token, never the token (I8), and stays bounded."""
    from kvproxy.policy import tenants

    r = resolver(tenant_hash_salt="pepper")
    first = r.resolve({"Authorization": f"Bearer {SECRET}"})
    expected = "anon-" + hmac.new(b"pepper", SECRET.encode(), hashlib.sha256).hexdigest()[:8]
    assert first == expected
    calls: list[object] = []
    original = tenants.hmac.new

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(tenants.hmac, "new", counting)
    assert r.resolve({"Authorization": f"Bearer {SECRET}"}) == first
    assert calls == []  # remembered
    assert all(type(k) is int for k in r._anonymous)
    assert SECRET not in repr(r._anonymous)
    monkeypatch.setattr(tenants, "ANONYMOUS_MEMO", 4)
    ids = {r.resolve({"Authorization": f"Bearer sk-{i}"}) for i in range(10)}
    assert len(ids) == 10
    assert len(r._anonymous) <= 4
    # A different token still gets its own id, through the HMAC.
    assert r.resolve({"Authorization": "Bearer sk-other"}) != first
