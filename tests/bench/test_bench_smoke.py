"""The benchmark harness in its tiny mode: every target answers correctly, the report exists.

No assertion here is about speed: the machines are shared and noisy, and the benchmark's
verdicts live in bench/RESULTS.md, not in the test suite. The two pure tests check the
arithmetic the report relies on (histogram quantiles, PASS/MISS).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import report  # noqa: E402
import scrape  # noqa: E402

TARGETS = ("direct", "nginx", "bare", "kvproxy")


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # 100 observations: 90 in (0, 0.01], 9 in (0.01, 0.02], 1 in (0.02, 0.05].
    h = scrape.HistDelta(((0.01, 90.0), (0.02, 99.0), (0.05, 100.0), (math.inf, 100.0)),
                         100.0, 0.9)  # fmt: skip
    assert h.quantile(0.5) == pytest.approx(0.01 * 50 / 90)
    assert h.quantile(0.99) == pytest.approx(0.02)
    assert h.at_most(0.99) == 0.02
    assert h.mean == pytest.approx(0.009)
    empty = scrape.HistDelta(((math.inf, 0.0),), 0.0, 0.0)
    assert math.isnan(empty.quantile(0.99))


def test_verdicts_compare_ratios_against_the_issue_targets() -> None:
    results = {
        "small_chat": {"kvproxy": {"cpu_us_per_req": 130.0}, "bare": {"cpu_us_per_req": 100.0},
                       "litellm": {"cpu_us_per_req": 900.0}},
        "sse": {"kvproxy": {"cpu_us_per_chunk": 14.0}, "bare": {"cpu_us_per_chunk": 10.0}},
    }  # fmt: skip
    verdicts = {v["goal"]: v for v in report.judge(results)}
    assert verdicts["small chat: CPU per request, kvproxy / bare"]["verdict"] == "PASS"
    assert verdicts["small chat: throughput per core, kvproxy / litellm"]["verdict"] == "MISS"
    assert verdicts["SSE relay: CPU per chunk, kvproxy / bare"]["verdict"] == "MISS"
    assert verdicts["RSS with the real tokenizer loaded"]["verdict"] == "n/a"


def test_the_kvproxy_bare_verdicts_take_the_median_of_the_rounds_ratios() -> None:
    # The medians of the rows would read 200/120 = 1.67 (the disturbed third round moves
    # kvproxy's median); the rounds' own ratios, paired in time, read 1.25, 1.28 and 2.5.
    results = {
        "small_chat": {"kvproxy": {"cpu_us_per_req": 200.0}, "bare": {"cpu_us_per_req": 120.0}},
        "sse": {"kvproxy": {"cpu_us_per_chunk": 14.0}, "bare": {"cpu_us_per_chunk": 10.0}},
        "round_ratios": {"small_chat": [1.25, 2.5, 1.28], "sse": []},
    }
    verdicts = {v["goal"]: v for v in report.judge(results)}
    small = verdicts["small chat: CPU per request, kvproxy / bare"]
    assert small["value"] == pytest.approx(1.28)
    assert small["verdict"] == "PASS"
    # Without per-round ratios (an SSE phase that did not pair): the ratio of the medians.
    assert verdicts["SSE relay: CPU per chunk, kvproxy / bare"]["value"] == pytest.approx(1.4)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tiny_run_measures_every_target_and_writes_the_report(tmp_path: Path) -> None:
    for tool in ("wrk", "nginx", "taskset"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            pytest.skip(f"{tool} is not installed (make sysdeps)")
    done = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "RESULTS.md").read_text()
    # Every target was started, answered a correct first reply, and served wrk's load.
    for section in ("small_chat", "sse"):
        for name in TARGETS:
            row = results[section].get(name)
            assert row is not None, (section, name, results["notes"])
            assert row["errors"] == 0 or row.get("problem"), (section, name, row)
    assert results["small_chat"]["kvproxy"]["requests"] > 0
    assert results["sse"]["kvproxy"]["chunks"] > 0
    # Correctness problems (e.g. a broken keep-alive) are reported, and none is expected.
    assert results["problems"] == [], results["problems"]
    assert "## Against the project's targets" in md
    assert results["verdicts"]
    # Streams at scale, 100 paced streams per proxy: every stream answered 200 and, unless
    # the machine stalled it past a second, arrived whole (counted by its client).
    for name in ("bare", "kvproxy"):
        step = results["streams"][name]["steps"][0]
        assert step["streams"] == 100, (name, step)
        assert step["events"] > 0, (name, step)
        assert set(step["lost_by_reason"]) <= {"stalled"}, (name, step)
    assert "## Streams at scale" in md


def test_policy_breakdown_rows_show_each_step_and_its_ratio_to_bare() -> None:
    results = {
        "small_chat": {"bare": {"cpu_us_per_req": 500.0}},
        "policy_cost": {
            "relay only": {"cpu_us_per_req": 800.0, "errors": 0},
            "+ admission": {"cpu_us_per_req": 950.0, "errors": 0},
            "+ template": {"cpu_us_per_req": 1250.0, "errors": 2},
        },
    }
    lines = report._policy_section(results)
    rows = [line for line in lines if line.startswith("| ") and "CPU µs/req" not in line]
    assert rows == [
        "| relay only | 800.0 | 1.60 | — | 0 |",
        "| + admission | 950.0 | 1.90 | 150.0 | 0 |",
        "| + template | 1,250.0 | 2.50 | 300.0 | 2 |",
    ]
    assert report._policy_section({"small_chat": {}}) == []


def test_the_run_reports_its_own_noise_on_the_headline_ratios() -> None:
    results = {"round_ratios": {"small_chat": [1.70, 1.80], "sse": [1.6]}}
    vals, spread = report.noise(results, "small_chat")  # type: ignore[misc]
    assert vals == [1.70, 1.80]
    assert spread == pytest.approx(0.10 / 1.75)
    assert "per round 1.70×, 1.80×; spread 5.7 %" in report._noise(results, "small_chat")
    # One round cannot measure a spread, and says so rather than printing 0 %.
    assert report.noise(results, "sse") is None
    assert "not measured" in report._noise(results, "sse")
    assert report.noise({}, "sse") is None


def test_instruction_counts_are_judged_and_shown_as_a_ratio() -> None:
    """The callgrind phase (bench/instructions.py): its ratio is a target row, and its
    section shows both counts; a run without it shows neither."""
    ins = {"requests": 640, "direct_per_req": 61_000, "bare_per_req": 600_000,
           "kvproxy_per_req": 900_000, "ratio": 1.5, "defaults_per_req": 720_000,
           "ratio_defaults": 1.2}  # fmt: skip
    verdicts = {v["goal"]: v for v in report.judge({"instructions": ins})}
    row = verdicts["small chat: instructions per request, kvproxy / bare (callgrind)"]
    assert row["verdict"] == "MISS"
    assert row["value"] == 1.5
    lines = report._instructions_section({"instructions": ins})
    assert "| kvproxy | 900,000 |" in lines
    assert "kvproxy / bare = 1.50×" in lines
    assert "| kvproxy, default settings | 720,000 |" in lines
    assert "kvproxy with default settings / bare = 1.20×" in lines
    defaults = verdicts[
        "small chat: instructions per request, kvproxy with default settings / bare"
    ]
    assert (defaults["verdict"], defaults["value"]) == ("PASS", 1.2)
    assert report._instructions_section({}) == []
    ok = {v["goal"]: v for v in report.judge({"instructions": {**ins, "ratio": 1.2}})}
    assert (
        ok["small chat: instructions per request, kvproxy / bare (callgrind)"]["verdict"] == "PASS"
    )
