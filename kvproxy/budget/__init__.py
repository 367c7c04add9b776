"""The in-flight budget: how many prompt tokens and requests may be upstream at once, on
this replica (`local`) or shared by every replica through Redis (`cluster`); `build_budget`
picks one from the settings. A lease is held until the upstream is closed (I6)."""

from kvproxy.budget.build import build_budget
from kvproxy.budget.leases import Lease
from kvproxy.budget.local import Budget, charge_tokens

__all__ = ["Budget", "Lease", "build_budget", "charge_tokens"]
