"""The operator's tools: the release gate (`kvproxy check`, kvproxy.tools.check) and the
two-tenant isolation harness (`kvproxy canary`, kvproxy.tools.isolation), and the HTTP
client they share (`client`)."""

from kvproxy.tools.check import cli as check_cli
from kvproxy.tools.isolation import cli as canary_cli
from kvproxy.tools.isolation.diagnosis import arming_settings
from kvproxy.tools.isolation.scenarios import DEFAULT_TENANT_HEADER, DEFAULT_TENANTS

__all__ = ["DEFAULT_TENANTS", "DEFAULT_TENANT_HEADER", "arming_settings", "canary_cli", "check_cli"]
