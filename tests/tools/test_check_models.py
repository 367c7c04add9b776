"""`kvproxy check` with a models config (kvproxy.tools.check.cli): one section per configured
model, each gated on its own engines and on the proxy's limit for that model, through a
real proxy in front of two simulator clusters with different pools."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from kvtest import running_proxy
from test_check_gate import validate

from kvproxy.sim.launcher import SimCluster, SimOptions
from kvproxy.tools.check.record import MODELS_SCHEMA

POOLS = {"model-a": 2048, "model-b": 5322}


def engines_of(sim: SimCluster) -> list[dict[str, Any]]:
    return [
        {"url": sim.prefill_url, "role": "prefill", "kind": "sglang"},
        {"url": sim.decode_url, "role": "decode", "kind": "sglang"},
    ]


async def check_cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvproxy", "check", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_check_gates_every_configured_model_in_its_own_section(tmp_path: Path) -> None:
    free = {"port": 0, "prefill_port": 0, "decode_port": 0, "engine_version": "0.5.23"}
    a_opts = SimOptions(**free, model_name="model-a", prefill_pool_tokens=POOLS["model-a"])
    b_opts = SimOptions(**free, model_name="model-b", prefill_pool_tokens=POOLS["model-b"])
    async with SimCluster(a_opts) as a, SimCluster(b_opts) as b:
        models = [
            {
                "name": name,
                "aliases": [name[-1]],
                "engines": engines_of(sim),
                "upstream": sim.router_url,
                # Exact counts from the model's own engine: limit+0 must be admitted.
                "tokenizer": "engine",
            }
            for name, sim in (("model-a", a), ("model-b", b))
        ]
        cfg = tmp_path / "kvproxy.yaml"
        cfg.write_text(yaml.safe_dump({"models": models}), encoding="utf-8")
        async with running_proxy(
            "http://127.0.0.1:9", refresh=False, engines=None, models=models
        ) as proxy:
            for m in proxy.services.models.models:
                await m.capacity.refresh_now()
            common = ("--config", str(cfg), "--proxy", proxy.public_url)
            common += ("--proxy-admin", proxy.admin_url)
            rc_all, out_all = await check_cli(*common, "--out", str(tmp_path / "all"))
            rc_one, _ = await check_cli(*common, "--model", "a", "--out", str(tmp_path / "one"))
            rc_bad, _ = await check_cli(*common, "--model", "model-z", "--out", str(tmp_path))
            limits = {
                m.name: m.capacity.limits().admission_limit_tokens
                for m in proxy.services.models.models
            }
    assert rc_all == 0, out_all
    record = json.loads((tmp_path / "all" / "release-record.json").read_text())
    assert record["schema"] == MODELS_SCHEMA
    assert record["passed"] is True
    assert list(record["models"]) == ["model-a", "model-b"]
    for name, section in record["models"].items():
        # Each section is a complete single-model record on that model's engines.
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(section))
        validate(path)
        sim = a if name == "model-a" else b
        assert {e["url"] for e in section["engines"]} == {sim.prefill_url, sim.decode_url}
        limit = limits[name]
        assert section["limits"]["admission_limit_tokens"] == limit
        # The proxy's limit for this model (its `model` label), not the other model's.
        assert section["deferred_cancellations"]["proxy_admission_limit_tokens"] == limit
        checks = {c["name"]: c for c in section["checks"]}
        over = checks[f"boundary limit+1 ({limit + 1:,} tokens)"]
        assert over["passed"]
        assert over["data"]["status"] == 400
        assert checks[f"boundary limit+0 ({limit:,} tokens)"]["passed"]
    assert limits["model-a"] is not None
    assert limits["model-b"] is not None
    assert limits["model-a"] < limits["model-b"]
    md = (tmp_path / "all" / "release-record.md").read_text()
    assert "## Model `model-a`: PASS" in md
    assert "## Model `model-b`: PASS" in md
    assert rc_one == 0
    one = json.loads((tmp_path / "one" / "release-record.json").read_text())
    assert list(one["models"]) == ["model-a"]  # chosen by its alias
    assert rc_bad == 2  # an unconfigured --model is a usage error
