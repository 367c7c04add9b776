"""The operator's tools: the release gate (`kvproxy check`, kvproxy.tools.check) and the
two-tenant isolation harness (`kvproxy canary`, kvproxy.tools.isolation), and the HTTP
client they share (`client`)."""

from kvproxy.tools.check import cli as check_cli
from kvproxy.tools.isolation import cli as canary_cli

__all__ = ["canary_cli", "check_cli"]
