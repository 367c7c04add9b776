"""Policy, sans-IO: what kvproxy decides, with no socket, clock or thread in sight.

`errors` is the vocabulary of every outcome kvproxy answers itself; `admission` decides
admit or refuse (I1, I3, I4) on a count and the limits; `drain` is the deferred-cancellation
machine (I5); `routing` picks a model's upstream cluster by fit, then load; `routes` the
allowlist; `origin` where an upstream URL points; `clamp` rewrites
an output cap; `tenants` says whose request it is; `counts` is the one count type.
"""

from kvproxy.policy import admission, drain, errors, routing
from kvproxy.policy.admission import Admit
from kvproxy.policy.clamp import clamp_output
from kvproxy.policy.counts import CountMethod, TokenCount
from kvproxy.policy.drain import DEFERRED_OUTCOMES, DISCONNECT_PHASES
from kvproxy.policy.errors import (
    ERROR_CODE_HEADER,
    ConfigError,
    ErrorStyle,
    KvproxyError,
    NetworkKind,
    UpstreamFailure,
    invalid_request,
)
from kvproxy.policy.origin import Origin, parse_origin
from kvproxy.policy.records import record
from kvproxy.policy.routes import (
    CHAT_ROUTES,
    Route,
    RouteMatch,
    RouteTable,
    parse_passthrough,
    route_table,
)
from kvproxy.policy.routing import EJECTION_CAUSES, ROUTING_REASONS, SPILL_REASONS
from kvproxy.policy.routing import OUTCOMES as UPSTREAM_OUTCOMES
from kvproxy.policy.tenants import TenantResolver, sanitize_tenant

__all__ = [
    "CHAT_ROUTES",
    "DEFERRED_OUTCOMES",
    "DISCONNECT_PHASES",
    "EJECTION_CAUSES",
    "ERROR_CODE_HEADER",
    "ROUTING_REASONS",
    "SPILL_REASONS",
    "UPSTREAM_OUTCOMES",
    "Admit",
    "ConfigError",
    "CountMethod",
    "ErrorStyle",
    "KvproxyError",
    "NetworkKind",
    "Origin",
    "Route",
    "RouteMatch",
    "RouteTable",
    "TenantResolver",
    "TokenCount",
    "UpstreamFailure",
    "admission",
    "clamp_output",
    "drain",
    "errors",
    "invalid_request",
    "parse_origin",
    "parse_passthrough",
    "record",
    "route_table",
    "routing",
    "sanitize_tenant",
]  # fmt: skip
