"""The metric contract as text: every `Metrics` attribute's family (class, name, type, label
names, buckets, help) and the series a fresh proxy exports, without their creation times.

After a deliberate change to the contract, rewrite the fixture with
`.venv/bin/python tests/observe/metric_contract.py > tests/observe/fixtures/metric_families.txt`."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvproxy.observe.metrics import Metrics


def contract_text() -> str:
    m = Metrics()
    m.add_model("m1")
    m.add_cluster("m1", "c1")
    out = []
    for attr, v in sorted(vars(m).items()):
        if attr == "registry":
            continue
        kind = f"{type(v).__module__.split('.')[0]}.{type(v).__name__}"
        bounds = getattr(v, "_upper_bounds", None)
        out.append(
            f"{attr} {kind} {v._name} {v._type} {list(v._labelnames)} {bounds} {v._documentation!r}"
        )
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        out.append(f"{family.name} {family.type} {family.documentation!r}")
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out.append(f"  {s.name}{{{labels}}} {s.value!r}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(contract_text(), end="")
