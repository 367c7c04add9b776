"""`kvproxy check`: the release gate, its probes and its release record."""
