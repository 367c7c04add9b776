"""Drives wrk with a Lua body and reads its figures back as JSON.

Owns: the Lua script (POST body, alternating tenant headers, optional pacing), the wrk
command line (pinned with taskset), and parsing. Must never: put the request body or any
response text in its output, or judge a result (the report does that).

Why a `done()` hook printing one JSON line: wrk's human output rounds latencies and changes
units; the hook hands over exact microseconds and the error counters.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from payloads import API_KEY
from procstat import pin_prefix

MARK = "WRKJSON "

_LUA = """
local body = [==[%(body)s]==]
local path = "%(path)s"
local tenants = {%(tenants)s}
local reqs = {}
local n = 0

init = function(args)
  for _, t in ipairs(tenants) do
    reqs[#reqs + 1] = wrk.format("POST", path,
      {["Content-Type"] = "application/json", ["X-Tenant-ID"] = t,
       ["Authorization"] = "Bearer %(key)s"}, body)
  end
end

request = function()
  n = n + 1
  return reqs[(n %% #reqs) + 1]
end
%(delay)s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%(mark)s{"requests":%%d,"duration_us":%%d,"bytes":%%d,"err_connect":%%d,"err_read":%%d,' ..
    '"err_write":%%d,"err_status":%%d,"err_timeout":%%d,"p50_us":%%d,"p90_us":%%d,' ..
    '"p99_us":%%d,"max_us":%%d,"mean_us":%%.1f}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
    e.status, e.timeout, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean))
end
"""


@dataclass(frozen=True)
class WrkResult:
    requests: int
    duration_us: int
    bytes: int
    err_connect: int
    err_read: int
    err_write: int
    err_status: int
    err_timeout: int
    p50_us: int
    p90_us: int
    p99_us: int
    max_us: int
    mean_us: float

    @property
    def errors(self) -> int:
        return (
            self.err_connect + self.err_read + self.err_write + self.err_status + self.err_timeout
        )

    @property
    def rps(self) -> float:
        return self.requests / (self.duration_us / 1e6) if self.duration_us else 0.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(asdict(self))
        d["rps"] = round(self.rps, 1)
        d["errors"] = self.errors
        return d


def lua_script(body: bytes, path: str, tenants: tuple[str, ...], delay_ms: int = 0) -> str:
    text = body.decode()
    if "]==]" in text:
        raise ValueError("body cannot be quoted in a Lua long string")
    delay = f"\ndelay = function() return {delay_ms} end\n" if delay_ms > 0 else ""
    return _LUA % {
        "body": text,
        "path": path,
        "tenants": ", ".join(f'"{t}"' for t in tenants),
        "delay": delay,
        "mark": MARK,
        "key": API_KEY,
    }


def run_wrk(
    url: str,
    body: bytes,
    *,
    path: str = "/v1/chat/completions",
    duration_s: float,
    connections: int,
    tenants: tuple[str, ...] = ("acme", "globex"),
    delay_ms: int = 0,
    cpu: int | None = 1,
    timeout_s: int = 10,
) -> WrkResult:
    """One wrk run against `url` (scheme://host:port); raises RuntimeError when wrk fails."""
    with tempfile.TemporaryDirectory(prefix="kvbench-wrk-") as tmp:
        script = Path(tmp) / "load.lua"
        script.write_text(lua_script(body, path, tenants, delay_ms))
        cmd = [
            *pin_prefix(cpu),
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(duration_s))}s",
            f"--timeout={timeout_s}s",
            "-s",
            str(script),
            url,
        ]
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=duration_s + timeout_s + 30,
            check=False,
        )
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            return WrkResult(**json.loads(line[len(MARK) :]))
    tail = (done.stdout + done.stderr).strip()[-400:]
    raise RuntimeError(f"wrk exited {done.returncode} without a result: {tail}")
