"""Why kvproxy withheld nothing: when the isolation harness saw foreign markers delivered
through something that answers as kvproxy, its tripwire does not know the harness's
tenants. Reads kvproxy's admin `/tripwire` (when given) to say which setting is missing,
and writes the configuration that arms it. Reads settings and counts only, never reply
text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aiohttp

from kvproxy.tools.client import get_json
from kvproxy.tools.isolation.scenarios import CanaryOptions, ScenarioResult


def arming_settings(tenants: Sequence[str], tenant_header: str) -> dict[str, Any]:
    """The kvproxy settings that make its tripwire know these synthetic tenants and the
    markers the harness writes for them (`KVCANARY-<tenant>-<16 hex>`, `scenarios`).
    One definition: `arming_config` prints it, `kvproxy demo` runs with it."""
    return {
        "tenant_header": tenant_header,
        "trust_tenant_header": True,
        "canary_action": "block",
        "canaries": [{"tenant": t, "patterns": [f"KVCANARY-{t}-[0-9a-f]{{16}}"]} for t in tenants],
    }


def arming_config(opts: CanaryOptions) -> str:
    """The kvproxy YAML that makes its tripwire know the harness's tenants and markers."""
    arm = arming_settings(opts.tenants, opts.tenant_header)
    lines = [
        f"tenant_header: {arm['tenant_header']}",
        "trust_tenant_header: true  # only behind a gateway that sets this header itself",
        f"canary_action: {arm['canary_action']}",
        "canaries:",
    ]
    for c in arm["canaries"]:
        lines += [f"  - tenant: {c['tenant']}", f'    patterns: ["{c["patterns"][0]}"]']
    return "\n".join(lines)


async def tripwire_diagnosis(
    http: aiohttp.ClientSession, opts: CanaryOptions, results: list[ScenarioResult]
) -> dict[str, Any] | None:
    """Foreign markers were delivered and none withheld, through something that answers as
    kvproxy (admin URL given, or X-Kvproxy-Decision on its replies): its tripwire does not
    know the harness's tenants. Say so, and how to arm it."""
    delivered = sum(len(r.foreign_markers) for r in results)
    blocked = sum(r.blocked_by_tripwire for r in results)
    if not delivered or blocked:
        return None
    admin = await get_json(http, opts.proxy_admin + "/tripwire") if opts.proxy_admin else None
    is_kvproxy = isinstance(admin, dict) or any(r.kvproxy_answered for r in results)
    if not is_kvproxy:
        return None
    reasons: list[str] = []
    if isinstance(admin, dict):
        source = f"{opts.proxy_admin}/tripwire"
        if not admin.get("trust_tenant_header"):
            reasons.append("trust_tenant_header is false: the harness's tenant header is ignored")
        header = str(admin.get("tenant_header") or "")
        if header.lower() != opts.tenant_header.lower():
            reasons.append(
                f"it reads the tenant from {header!r}, the harness sends {opts.tenant_header!r}"
            )
        known = set(admin.get("canary_tenants") or [])
        missing = [t for t in opts.tenants if t not in known]
        if missing:
            reasons.append(f"no canaries configured for {', '.join(missing)}")
        if admin.get("canary_action") == "observe":
            reasons.append("canary_action is observe: hits are counted, not withheld")
    else:
        source = "X-Kvproxy-Decision response headers"
        reasons.append(
            "the target answers as kvproxy but withheld nothing: its tripwire "
            "probably does not know the harness's tenants (pass --proxy-admin "
            "to check)"
        )
    return {
        "target_is_kvproxy": True,
        "armed": False,
        "source": source,
        "reasons": reasons,
        "config": arming_config(opts),
    }
