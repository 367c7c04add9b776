"""kvproxy's Grafana dashboard and Prometheus alert rules, kept as Python code.

`grafana.generate` writes every artifact (dashboard JSON, panel list, rules file and the
Kubernetes PrometheusRule) from `grafana.dashboard` and `grafana.rules`; the committed files
are checked against it in tests. Nothing here runs inside the proxy.
"""
