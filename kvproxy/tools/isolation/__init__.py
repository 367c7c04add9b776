"""`kvproxy canary`: the two-tenant isolation harness, its scenarios and report."""
