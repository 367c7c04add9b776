"""Engine posture: known-vulnerable engine versions and transfer backends (advisories),
each engine's PD settings as its `/server_info` reports them, pair checks across prefill
and decode, and the engines' own transfer-failure counters.

The capacity probes read the reports (kvproxy.capacity); this package only interprets
them, so /capacity, the metrics and `kvproxy check` show the same findings.
"""
