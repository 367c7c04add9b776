"""Turns one run's figures into `bench/RESULTS.md` and `bench/results.json`.

Owns: the project's targets (numbers from the benchmark issue), the verdict per target
(PASS / MISS / n/a with the reason), the ratios, and the page layout. Must never: compute
a figure (workloads do), or round a number before judging it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import profile_phases
import streams

Results = dict[str, Any]


@dataclass(frozen=True)
class Goal:
    name: str
    unit: str
    limit: float
    higher_is_better: bool
    measure: Callable[[Results], float | None]
    why_missing: str = "not measured in this run"

    def verdict(self, value: float | None) -> str:
        if value is None or math.isnan(value):
            return "n/a"
        ok = value >= self.limit if self.higher_is_better else value <= self.limit
        return "PASS" if ok else "MISS"

    @property
    def target(self) -> str:
        return f"{'≥' if self.higher_is_better else '≤'} {self.limit:g}{self.unit}"


def _get(r: Results, *path: str) -> Any:
    cur: Any = r
    for p in path:
        if not isinstance(cur, dict) or p not in cur:
            return None
        cur = cur[p]
    return cur


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or not b:
        return None
    return float(a) / float(b)


def paired_ratio(r: Results, section: str, key: str) -> float | None:
    """kvproxy/bare: the median of the per-round ratios when the run has them, else the
    ratio of the two medians. A round measures bare and kvproxy within a minute (one right
    after the other in the first three rounds), so its ratio cancels what the shared machine
    did to both then; the median keeps one disturbed round (seen here: one round of five
    reading 1.7x when the others read 1.2-1.4x) from moving the figure."""
    vals = _round_ratios(r, section)
    if vals:
        return float(statistics.median(vals))
    return _ratio(_get(r, section, "kvproxy", key), _get(r, section, "bare", key))


def _round_ratios(r: Results, section: str) -> list[float]:
    """kvproxy/bare per round of the comparison, as the run noted them (`Bench.round_ratios`)."""
    return [v for v in _get(r, "round_ratios", section) or [] if isinstance(v, int | float)]


def small_cpu(r: Results, target: str) -> float | None:
    v = _get(r, "small_chat", target, "cpu_us_per_req")
    return float(v) if isinstance(v, int | float) else None


def _method_ms(r: Results, section: str, method: str) -> float | None:
    v = _get(r, "long_prompts", section, "4MB", "decision_ms_by_method", method)
    return float(v) if isinstance(v, int | float) else None


GOALS = (
    Goal(
        "small chat: CPU per request, kvproxy / bare",
        "×",
        1.3,
        False,
        lambda r: paired_ratio(r, "small_chat", "cpu_us_per_req"),
    ),
    Goal(
        "small chat: throughput per core, kvproxy / litellm",
        "×",
        10,
        True,
        lambda r: _ratio(small_cpu(r, "litellm"), small_cpu(r, "kvproxy")),
        "litellm runs only with `make bench-peers`",
    ),
    Goal(
        "SSE relay: CPU per chunk, kvproxy / bare",
        "×",
        1.3,
        False,
        lambda r: paired_ratio(r, "sse", "cpu_us_per_chunk"),
    ),
    Goal(
        "4 MB prompt decided, bound suffices",
        " ms",
        10,
        False,
        lambda r: _method_ms(r, "kvproxy-bound", "bound"),
    ),
    Goal(
        "4 MB prompt decided, exact count",
        " ms",
        150,
        False,
        lambda r: _method_ms(r, "kvproxy", "exact"),
    ),
    Goal(
        "4 MB near-limit exact count, kvproxy / HF encode of the same text",
        "×",
        0.2,
        False,
        lambda r: _get(r, "decision_latency", "near_limit", "ratio"),
        "bench/decision_latency.py prints it (in-process, pinned like the server)",
    ),
    Goal(
        "~100k-token prompts at concurrency 16: kvproxy's added TTFB p99",
        " ms",
        60,
        False,
        lambda r: _get(r, "long_concurrent", "kvproxy", "100k", "16", "added_ms_p99"),
    ),
    Goal(
        "~100k-token prompts at concurrency 1: kvproxy's added TTFB p50",
        " ms",
        4,
        False,
        lambda r: _get(r, "long_concurrent", "kvproxy", "100k", "1", "added_ms_p50"),
    ),
    Goal(
        "~100k-token prompts at concurrency 16: added p99, kvproxy / litellm",
        "×",
        0.1,
        False,
        lambda r: _ratio(
            _get(r, "long_concurrent", "kvproxy", "100k", "16", "added_ms_p99"),
            _get(r, "long_concurrent", "litellm", "100k", "16", "added_ms_p99"),
        ),
        "litellm runs only with `make bench-peers`",
    ),
    Goal(
        "~1M-token prompt counted exactly, concurrency 1: kvproxy's added TTFB p50",
        " ms",
        50,
        False,
        lambda r: _get(r, "long_concurrent", "kvproxy", "1M", "1", "added_ms_p50"),
    ),
    Goal(
        "small p99 while 4 MB prompts are counted / idle p99",
        "×",
        2,
        False,
        lambda r: _get(r, "mixed", "small_p99_ratio"),
    ),
    Goal(
        "event-loop lag p99 while 4 MB prompts are counted",
        " ms",
        20,
        False,
        lambda r: _get(r, "mixed", "loop_lag_p99_ms_loaded"),
    ),
    Goal(
        "RSS with the real tokenizer loaded",
        " MB",
        150,
        False,
        lambda r: _get(r, "memory", "kvproxy_tokenizer_rss_mib"),
    ),
    Goal(
        "RSS with the real tokenizer loaded, tokenizer_backend hf",
        " MB",
        150,
        False,
        lambda r: _get(r, "memory", "kvproxy_tokenizer_hf_rss_mib"),
    ),
    Goal(
        "in-flight budget in Redis: added CPU per small request vs the local budget",
        " µs",
        100,
        False,
        lambda r: _diff(
            _get(r, "budget_backend", "redis budget", "cpu_us_per_req"),
            _get(r, "budget_backend", "local budget", "cpu_us_per_req"),
        ),
        "runs only when redis-server is installed (make sysdeps)",
    ),
    Goal(
        "small chat: instructions per request, kvproxy / bare (callgrind)",
        "×",
        1.3,
        False,
        lambda r: _get(r, "instructions", "ratio"),
        "runs when valgrind is installed (make sysdeps)",
    ),
    Goal(
        "small chat: instructions per request, kvproxy with default settings / bare",
        "×",
        1.3,
        False,
        lambda r: _get(r, "instructions", "ratio_defaults"),
        "runs when valgrind is installed (make sysdeps)",
    ),
    Goal(
        "peak RSS under sixteen concurrent 4 MB prompts",
        " MB",
        600,
        False,
        lambda r: _get(r, "memory", "kvproxy_peak", "peak_mib"),
    ),
)


def _streams_head(r: Results) -> dict[str, Any] | None:
    """The streams phase when it ran the headline count (2,000 streams) on both proxies."""
    st = r.get("streams")
    if not isinstance(st, dict):
        return None
    if not streams.step_at(st, "kvproxy", streams.HEADLINE) or not streams.step_at(
        st, "bare", streams.HEADLINE
    ):
        return None
    return st


def _streams_lost(r: Results) -> float | None:
    st = _streams_head(r)
    if st is None:
        return None
    return float(streams.step_at(st, "kvproxy", streams.HEADLINE)["lost"])


def _streams_capacity(r: Results, target: str) -> float | None:
    cap = _get(r, "streams", target, "capacity", "streams")
    return float(cap) if isinstance(cap, int | float) else None


_STREAMS_WHY = "the streams phase runs 2,000 streams in the full and --quick runs"

STREAM_GOALS = (
    Goal(
        "streams: CPU per chunk kvproxy / bare at 2,000 streams",
        "×",
        1.3,
        False,
        lambda r: streams.ratio_at(_streams_head(r) or {}, streams.HEADLINE),
        _STREAMS_WHY,
    ),
    Goal(
        "streams lost at 2,000 (kvproxy)",
        "",
        0,
        False,
        _streams_lost,
        _STREAMS_WHY,
    ),
)

# Informative rows: no target, the figure the issue asks to measure.
INFO = (
    ("streams: capacity of kvproxy (lag p99 ≤ 20 ms, none lost)", "kvproxy"),
    ("streams: capacity of the bare forwarder (interval lateness p99 ≤ 20 ms, none lost)", "bare"),
)

GOALS = (*GOALS, *STREAM_GOALS)


def judge(r: Results) -> list[dict[str, Any]]:
    out = []
    for g in GOALS:
        v = g.measure(r)
        out.append(
            {
                "goal": g.name,
                "target": g.target,
                "value": v,
                "verdict": g.verdict(v),
                "note": "" if v is not None else g.why_missing,
            }
        )
    st = r.get("streams") if isinstance(r.get("streams"), dict) else {}
    held = streams.both_held(st)
    out.append(
        {
            "goal": "streams: CPU per chunk kvproxy / bare at the largest count both held",
            "target": "informative",
            "value": streams.ratio_at(st, held) if held else None,
            "verdict": "info",
            "note": f"{held:,} streams" if held else "no count held by both (or not run)",
        }
    )
    for name, target in INFO:
        cap = _streams_capacity(r, target)
        bound = _get(r, "streams", target, "capacity", "bound")
        out.append(
            {
                "goal": name,
                "target": "informative",
                "value": cap,
                "verdict": "info",
                "note": _capacity_note(bound, _get(r, "streams", target, "capacity", "failed_at"))
                if cap is not None
                else "the streams phase did not run",
            }
        )
    return out


def _capacity_note(bound: Any, failed_at: Any) -> str:
    if bound == "plan":
        return "every step held: at least this"
    if bound == "load":
        return f"at least this: the load generator saturated at {failed_at:,} streams"
    what = {"lag": "lag p99 over 20 ms", "lost": "streams lost"}.get(str(bound), str(bound))
    return f"{what} at {failed_at:,} streams"


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if math.isnan(v):
            return "—"
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render(r: Results) -> str:
    m = r["meta"]
    verdicts = judge(r)
    r["verdicts"] = verdicts
    out = [
        "# kvproxy benchmark results",
        "",
        f"Generated by `{m['command']}` on {m['date']} ({m['mode']} mode, "
        f"{m['rounds']} round(s), wall time {m['wall_s']:.0f} s). Do not edit by hand: "
        "rerun `make bench`.",
        "",
        "Performance claims here are ratios measured in the same run on the same machine; "
        "absolute numbers move with the machine and its neighbours.",
        "",
        "## Against the project's targets",
        "",
    ]
    out += _table(
        ["figure", "measured", "target", "verdict"],
        [
            [
                v["goal"],
                _fmt(v["value"], 2),
                v["target"],
                v["verdict"] + (f" ({v['note']})" if v["note"] else ""),
            ]
            for v in verdicts
        ],
    )
    spreads = [
        (what, noise(r, sec)) for what, sec in (("small chat", "small_chat"), ("SSE", "sse"))
    ]
    told = [f"{what} ±{50 * got[1]:.1f} %" for what, got in spreads if got is not None]
    if told:
        out += [
            "",
            "Run-to-run noise of the two kvproxy/bare ratios in this run (half the spread "
            "between its rounds): " + ", ".join(told) + ".",
        ]
    out += ["", "## Machine and versions", ""]
    out += _table(
        ["", ""],
        [[k, str(v)] for k, v in m["machine"].items()]
        + [[k, str(v)] for k, v in m["versions"].items()]
        + [
            ["load average at start", m["load_start"]],
            ["load average at end", m.get("load_end", "")],
        ],
    )
    out += ["", "## How it was measured", ""]
    out += [f"- {line}" for line in m["method"]]
    out += ["", "## Small chat POST", ""]
    direct_p50 = _get(r, "small_chat", "direct", "p50_us_c1")
    rows = []
    for name, s in r.get("small_chat", {}).items():
        added = (s["p50_us_c1"] - direct_p50) / 1e3 if direct_p50 is not None else None
        cpu = s["cpu_us_per_req"] if name != "direct" else None
        rows.append(
            [
                name,
                _fmt(s["rps"], 0),
                _fmt(cpu),
                _fmt(1e6 / cpu, 0) if cpu else "—",
                _fmt(s["p50_us_c1"] / 1e3, 3),
                _fmt(s["p99_us_c1"] / 1e3, 3),
                _fmt(added, 3) if name != "direct" else "—",
                _fmt(s["p99_us_saturated"] / 1e3, 2),
                str(s["errors"]),
            ]
        )
    out += _table(
        [
            "target",
            "req/s (saturated)",
            "CPU µs/req",
            "req/s per core",
            "p50 ms (c=1)",
            "p99 ms (c=1)",
            "added p50 ms vs direct",
            "p99 ms (saturated)",
            "errors",
        ],
        rows,
    )
    out += ["", "Ratios of CPU per request: " + _ratios(r, "small_chat", "cpu_us_per_req")]
    out += [_noise(r, "small_chat"), ""]
    out += ["## SSE relay", ""]
    rows = [
        [
            name,
            _fmt(s["chunks_per_s"], 0),
            _fmt(s["cpu_us_per_chunk"], 2) if name != "direct" else "—",
            _fmt(s["p50_us_stream"] / 1e3, 2),
            str(s["errors"]),
        ]
        for name, s in r.get("sse", {}).items()
    ]
    out += _table(["target", "chunks/s", "CPU µs/chunk", "p50 ms per stream", "errors"], rows)
    out += ["", "Ratios of CPU per chunk: " + _ratios(r, "sse", "cpu_us_per_chunk")]
    out += [_noise(r, "sse"), ""]
    out += _policy_section(r) + profile_phases.section(r) + _instructions_section(r)
    out += _budget_section(r) + _long_section(r)
    out += _concurrent_section(r) + _mixed_section(r) + _memory_section(r)
    out += streams_section(r)
    if r.get("problems"):
        out += ["## Correctness problems seen (figures above are affected)", ""]
        out += [f"- {p}" for p in r["problems"]] + [""]
    if r.get("notes"):
        out += ["## Notes", ""] + [f"- {n}" for n in r["notes"]] + [""]
    out += ["## Commands", "", "```"] + m["commands"] + ["```", ""]
    return "\n".join(out)


def _ratios(r: Results, section: str, key: str) -> str:
    rows = r.get(section, {})
    k = _get(rows, "kvproxy", key)
    parts = []
    for other in ("bare", "nginx", "litellm"):
        ratio = _ratio(k, _get(rows, other, key))
        if ratio is not None:
            parts.append(f"kvproxy/{other} = {ratio:.2f}×")
    return ", ".join(parts) if parts else "—"


def noise(r: Results, section: str) -> tuple[list[float], float] | None:
    """kvproxy/bare per round of the comparison and their spread, (max - min) / median: the
    run's own noise on that ratio. None with fewer than two rounds."""
    vals = _round_ratios(r, section)
    if len(vals) < 2:
        return None
    mid = statistics.median(vals)
    return vals, (max(vals) - min(vals)) / mid if mid else 0.0


def _noise(r: Results, section: str) -> str:
    got = noise(r, section)
    if got is None:
        return "Run-to-run noise: one round, not measured (a full run has three)."
    vals, spread = got
    per = ", ".join(f"{v:.2f}×" for v in vals)
    return (
        f"Run-to-run noise: kvproxy/bare per round {per}; spread {100 * spread:.1f} % of the "
        "median (a later run's ratio within it is not a change)."
    )


def _policy_section(r: Results) -> list[str]:
    steps = r.get("policy_cost")
    if not steps:
        return []
    bare = _get(r, "small_chat", "bare", "cpu_us_per_req")
    out = ["## Where kvproxy's CPU per small request goes", ""]
    out += [
        "The small chat POST again, through kvproxy with one more part of its policy at each "
        "step (medians over the rounds; the bare forwarder's figure is from the comparison "
        "above, same run).",
        "",
    ]
    rows, before = [], None
    for name, s in steps.items():
        cpu = s.get("cpu_us_per_req")
        step = cpu - before if cpu is not None and before is not None else None
        rows.append(
            [name, _fmt(cpu), _fmt(_ratio(cpu, bare), 2), _fmt(step), str(s.get("errors", 0))]
        )
        before = cpu
    out += _table(
        ["kvproxy configured with", "CPU µs/req", "× bare", "this step µs", "errors"], rows
    )
    return [*out, ""]


def _instructions_section(r: Results) -> list[str]:
    ins = r.get("instructions")
    if not isinstance(ins, dict):
        return []
    out = ["## Instructions per small chat request (callgrind)", ""]
    out += [
        "CPU time per request moves by several percent between rounds on a shared machine "
        "(the noise lines above); the instructions a process executes for the same requests "
        "do not (about 1 % run to run). Each target in-process on one event loop with its "
        "client and upstream, under `valgrind --tool=callgrind`, counted for "
        f"{ins['requests']} requests after a warm-up, less the client-to-upstream path's "
        "own count (bench/instructions.py). kvproxy with the comparison's full policy, and "
        "with default settings (only the upstream and the engine set: the tokenizer `auto`, "
        "the engine's own, without a chat template; the tenant from the bearer token). "
        "Instructions are not time (a cache miss costs none): read the ratio beside the CPU "
        "ratio, not instead of it.",
        "",
    ]
    rows = [
        ["bare", f"{ins['bare_per_req']:,}"],
        ["kvproxy", f"{ins['kvproxy_per_req']:,}"],
    ]
    if "defaults_per_req" in ins:
        rows.append(["kvproxy, default settings", f"{ins['defaults_per_req']:,}"])
    out += _table(["target", "instructions per request"], rows)
    ratio = ins.get("ratio")
    out += ["", f"kvproxy / bare = {_fmt(ratio, 2)}×"]
    if "ratio_defaults" in ins:
        out += [f"kvproxy with default settings / bare = {_fmt(ins['ratio_defaults'], 2)}×"]
    return [*out, ""]


def _budget_section(r: Results) -> list[str]:
    rows_in = r.get("budget_backend")
    if not rows_in:
        return []
    local = rows_in.get("local budget", {})
    out = ["## In-flight budget: local against Redis", ""]
    out += [
        "The small chat POST through kvproxy (byte bound, no canaries, no access log) with an "
        "in-flight budget far above the load, held locally or in Redis (`budget_backend: "
        "redis`: one script call per request on kvproxy's own pipelined connection, a "
        "release riding with the next acquisition; Redis on the load generator's core). "
        "Medians over the rounds.",
        "",
    ]
    rows = []
    for name, s in rows_in.items():
        cpu, p50 = s.get("cpu_us_per_req"), s.get("p50_us_c1")
        rows.append(
            [
                name,
                _fmt(cpu),
                _fmt(_diff(cpu, local.get("cpu_us_per_req"))),
                _fmt(p50),
                _fmt(_diff(p50, local.get("p50_us_c1"))),
                _fmt(s.get("rps")),
                str(s.get("errors", 0)),
            ]
        )
    out += _table(
        ["budget", "CPU µs/req", "+ µs vs local", "p50 µs (c=1)", "+ µs vs local", "req/s",
         "errors"],
        rows,
    )  # fmt: skip
    return [*out, ""]


def _diff(a: Any, b: Any) -> float | None:
    if a is None or b is None:
        return None
    return float(a) - float(b)


def _long_section(r: Results) -> list[str]:
    lp = r.get("long_prompts")
    if not lp:
        return []
    out = ["## Long prompts (one at a time)", ""]
    rows = []
    for target, sizes in lp.items():
        if not isinstance(sizes, dict) or "4MB" not in sizes:
            continue
        for size, row in sizes.items():
            dec = row.get("decision_ms_by_method") or {}
            rows.append(
                [
                    target,
                    size,
                    _fmt(row["e2e_ms_median"], 1),
                    _fmt(row.get("cpu_ms_per_request"), 1) if target != "direct" else "—",
                    ", ".join(f"{k} {v:.2f}" for k, v in dec.items()) or "—",
                    row.get("x-kvproxy-prompt-tokens", "—"),
                    ",".join(str(s) for s in row["statuses"])
                    + "".join(f" {c}" for c in row.get("error_codes", [])),
                ]
            )
    out += _table(
        [
            "target",
            "prompt",
            "end to end ms (median)",
            "target CPU ms/request",
            "decision ms by method (kvproxy metrics, mean)",
            "tokens used",
            "HTTP",
        ],
        rows,
    )
    dl = r.get("decision_latency")
    if dl:
        out += ["", "In-process decision latency (`bench/decision_latency.py`):", "", "```"]
        out += [str(dl.get("output", "")).rstrip(), "```"]
    return [*out, ""]


def _concurrent_section(r: Results) -> list[str]:
    lc = r.get("long_concurrent")
    if not lc:
        return []
    out = [
        "## Long prompts under concurrency (bench/long_concurrent.py)",
        "",
        "Chat prompts of varied text (~100 K and ~1 M Qwen-3 tokens), C clients at a time on "
        "keep-alive connections; kvproxy pinned to one core, with a pool just above the prompt "
        "so that each one is counted exactly (`kind`: what X-Kvproxy-Prompt-Tokens-Kind said). "
        "TTFB = client's time to the first response byte; *added* = minus direct's at the same "
        "size and concurrency (nearest-rank quantiles). CPU per prompt from /proc; peak RSS = "
        "VmHWM of the target, started fresh per size. Plot: [long_prompts.png](long_prompts.png). "
        "Where one such prompt's CPU goes, step by step against fastokens alone: "
        "[PROFILE-LONG.md](PROFILE-LONG.md) (`bench/profile_long.py`).",
        "",
    ]
    rows = []
    for name, sizes in lc.items():
        for size, row in sizes.items():
            for c in ("1", "16", "64"):
                cell = row.get(c)
                if not cell:
                    continue
                rows.append(
                    [
                        name,
                        size,
                        c,
                        str(cell["requests"]),
                        _fmt(cell["ttfb_ms_p50"], 2),
                        _fmt(cell["ttfb_ms_p99"], 2),
                        _fmt(cell.get("added_ms_p50"), 2),
                        _fmt(cell.get("added_ms_p99"), 2),
                        _fmt(cell["cpu_ms_per_prompt"], 2),
                        _fmt(row.get("peak_rss_mib")),
                        f"{cell['statuses']} {','.join(k for k in cell['kinds'] if k != '-')}",
                    ]
                )
    head = ["target", "prompt", "C", "requests", "TTFB p50 ms", "TTFB p99 ms", "added p50",
            "added p99", "CPU ms/prompt", "peak RSS MiB", "HTTP, kind"]  # fmt: skip
    return [*out, *_table(head, rows), ""]


def _mixed_section(r: Results) -> list[str]:
    mx = r.get("mixed")
    if not mx:
        return []
    out = ["## Mixed: small requests while 4 MB prompts are counted (kvproxy)", ""]
    if "small_rate_asked_rps" in mx:
        out += [
            f"Small requests paced at {mx['small_rate_asked_rps']:g} req/s "
            f"(achieved {mx['small_rps']:g} with the 4 MB prompts).",
            "",
        ]
    out += _table(
        ["figure", "idle", "with 4 MB prompts"],
        [
            [
                "small p50 ms",
                _fmt(mx["small_p50_us_idle"] / 1e3, 3),
                _fmt(mx["small_p50_us_loaded"] / 1e3, 3),
            ],
            [
                "small p99 ms",
                _fmt(mx["small_p99_us_idle"] / 1e3, 3),
                _fmt(mx["small_p99_us_loaded"] / 1e3, 3),
            ],
            [
                "event-loop lag p99 ms (histogram)",
                _fmt(mx["loop_lag_p99_ms_idle"], 2),
                _fmt(mx["loop_lag_p99_ms_loaded"], 2),
            ],
        ],
    )
    out += [
        "",
        f"4 MB prompts sent: {mx['big_prompts']} (HTTP {mx['big_statuses']}"
        f"{''.join(' ' + c for c in mx.get('big_error_codes', []))}, median "
        f"{_fmt(mx['big_e2e_ms_median'])} ms end to end); decision ms by method: "
        f"{mx['decision_ms_by_method']}; largest loop lag since start: "
        f"{mx['loop_lag_max_ms_since_start']} ms; small-request errors: "
        f"{mx['small_errors']}.",
        "",
    ]
    return out + _gil_lines(mx.get("gil"))


def _gil_lines(gil: Any) -> list[str]:
    """The tail-latency profile: who held the GIL (and so stalled the loop) meanwhile."""
    if not isinstance(gil, dict):
        return []
    if "skipped" in gil:
        return [f"Not profiled for the GIL: {gil['skipped']}.", ""]
    if not gil.get("samples"):
        return ["py-spy --gil took no sample.", ""]
    threads = ", ".join(f"{name} {pct} %" for name, pct in gil["threads"])
    out = [
        f"What held the GIL while 4 MB prompts were counted (`py-spy record --gil --threads`, "
        f"{gil['seconds']:g} s after the timed part, {gil['samples']} samples; a sample is "
        "taken only from the thread holding the GIL, so a share is time every other thread, "
        f"the event loop's included, could not run Python): by thread, {threads}. By "
        "function (its own frame):",
        "",
    ]
    out += _table(
        ["% of GIL samples", "function"], [[f"{p}", f"`{f}`"] for f, p in gil["functions"]]
    )
    return [*out, ""]


def _memory_section(r: Results) -> list[str]:
    mem = r.get("memory")
    if not mem:
        return []
    peak = mem.get("kvproxy_peak", {})
    rows = [
        ["bare forwarder, idle", _fmt(mem.get("bare_idle_rss_mib"))],
        [
            "kvproxy, bound only (`KVPROXY_TOKENIZER=bytes`), idle",
            _fmt(mem.get("kvproxy_idle_rss_mib")),
        ],
        ["kvproxy, real tokenizer loaded", _fmt(mem.get("kvproxy_tokenizer_rss_mib"))],
        [
            "kvproxy, real tokenizer loaded, `KVPROXY_TOKENIZER_BACKEND=hf`",
            _fmt(mem.get("kvproxy_tokenizer_hf_rss_mib")),
        ],
        [
            f"kvproxy, peak (VmHWM) under {peak.get('concurrent', 16)} concurrent 4 MB prompts "
            f"(HTTP {peak.get('statuses')} {' '.join(peak.get('error_codes', []))})",
            _fmt(peak.get("peak_mib")),
        ],
    ]
    return ["## Memory (RSS, MiB, from /proc/PID/status)", "", *_table(["", "MiB"], rows), ""]


def streams_section(r: Results) -> list[str]:
    st = r.get("streams")
    if not isinstance(st, dict):
        return []
    plan = st.get("plan", {})
    out = [
        "## Streams at scale",
        "",
        f"Long SSE streams held open at once through one proxy pinned to CPU 0: each stream "
        f"gets a `chat.completion.chunk` event (~180 bytes) every {st.get('pace_ms', 50):g} ms "
        "from `bench/sse_upstream.py --pace-ms` (uvloop, one 1 ms tick for all streams, a "
        "write per event, on CPU 1) and is read by `bench/stream_client.py` (raw asyncio "
        "protocols on uvloop, "
        f"{plan.get('client_procs', 1)} process(es) on CPU 1, connections from four loopback "
        "source addresses). Per step, N streams open evenly over N/1,000 s (at least 0.5 s), "
        f"then {plan.get('settle_s', 1):g} s later a window of {plan.get('window_s', 0):g} s "
        "in which every stream is open (each lasts past it). Over the window: the target's "
        "CPU (utime+stime from /proc) / events the clients received = CPU per event; RSS per "
        "stream = (VmRSS at the window's end − VmRSS idle before the ramp) / N, same process; "
        "lag p99 = kvproxy's `kvproxy_event_loop_lag_seconds` histogram delta "
        "(interpolated like histogram_quantile); *late p99* = the clients' interval between "
        "a stream's consecutive events minus the pace (0.5 ms bins, upper edge), measured "
        "for every target and the only lag figure for the bare forwarder, which exports "
        "none; `direct` (no proxy, same step) is what the upstream and the clients add "
        "themselves. A stream is lost when it errored, was not 200, went silent > 1 s or "
        "ended without all its events and `[DONE]`. Capacity (one target process for all "
        "steps) = the last step before the first with lag p99 > 20 ms (kvproxy: its metric; "
        "bare: late p99), a lost stream, or the upstream and clients above "
        f"{streams.LOAD_SATURATED:.0%} of CPU 1 (then the load generator, not the target, "
        f"limits it); every step up to {streams.HEADLINE:,} runs, past it the first failed "
        "step ends the ramp. kvproxy: the comparison's full policy, plus "
        "`upstream_max_connections` above the largest step (its default, 1,024, would queue "
        "streams past it); the bare forwarder's connector limit raised likewise. "
        f"Descriptor limit (soft, raised to the hard limit for the targets): "
        f"{st.get('fd_limit', '?')}.",
        "",
    ]
    rows = []
    for target in ("bare", "kvproxy", "direct"):
        for s in (st.get(target) or {}).get("steps", []):
            load = s.get("load_cpu_share_by_process", {})
            rows.append(
                [
                    target,
                    f"{s['streams']:,}",
                    _fmt(s["events_per_s"], 0),
                    _fmt(s.get("delivered_share"), 3),
                    _fmt(s.get("cpu_us_per_event"), 2) if target != "direct" else "—",
                    _fmt(s.get("target_cpu_share"), 2) if target != "direct" else "—",
                    _fmt(s.get("rss_kib_per_stream"), 1) if target != "direct" else "—",
                    _fmt(s.get("lag_p99_ms"), 2),
                    _fmt(s.get("late_p99_ms"), 1),
                    _fmt(s.get("first_event_p99_ms"), 1),
                    str(s["lost"]) + (f" {s['lost_by_reason']}" if s["lost"] else ""),
                    f"{_fmt(load.get('upstream'), 2)} + {_fmt(load.get('clients'), 2)}",
                    str(s.get("verdict", "")),
                ]
            )
    head = ["target", "streams", "events/s", "delivered / paced", "CPU µs/event",
            "target CPU share", "RSS KiB/stream", "lag p99 ms (metric)", "late p99 ms (clients)",
            "first event p99 ms", "lost", "CPU 1: upstream + clients", "step"]  # fmt: skip
    out += _table(head, rows)
    ratio = streams.ratio_at(st, streams.HEADLINE)
    out += [""]
    if ratio is not None:
        out += [f"CPU per event at {streams.HEADLINE:,} streams: kvproxy / bare = {ratio:.2f}×."]
    held = streams.both_held(st)
    if held:
        out += [
            f"CPU per event at {held:,} streams, the largest count both held: kvproxy / bare "
            f"= {_fmt(streams.ratio_at(st, held), 2)}× (past its capacity a proxy's events "
            "batch up per wakeup, and its CPU per event falls)."
        ]
    for target in ("kvproxy", "bare"):
        cap = (st.get(target) or {}).get("capacity")
        if cap:
            out += [
                f"Capacity of {target}: {cap['streams']:,} streams "
                f"({_capacity_note(cap['bound'], cap.get('failed_at'))})."
            ]
        skipped = (st.get(target) or {}).get("skipped")
        if skipped:
            out += [f"{target}: ramp cut: {skipped}."]
    return [*out, ""]


def write(r: Results, out_dir: Path) -> tuple[Path, Path]:
    md = render(r)
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out_dir / "RESULTS.md", out_dir / "results.json"
    md_path.write_text(md)
    json_path.write_text(json.dumps(r, indent=2, sort_keys=False, default=str) + "\n")
    return md_path, json_path
