"""The profile step's arithmetic and its RESULTS.md section (pure: no py-spy, no servers)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import profile_phases  # noqa: E402
import report  # noqa: E402

SITE = "/work/main/.venv/lib/python3.11/site-packages"
COLLAPSED = "\n".join(
    [
        # 6 samples in the handler's render, 3 in aiohttp's writer, 1 in the idle loop.
        "_run_module_as_main (<frozen runpy>:198);handle (/w/kvproxy/serve/handler.py:10);"
        "render (/w/kvproxy/tokens/templates.py:20);root (<template>:3) 6",
        f"_run_module_as_main (<frozen runpy>:198);handle (/w/kvproxy/serve/handler.py:12);"
        f"_writelines ({SITE}/aiohttp/http_writer.py:80) 3",
        "run (/usr/lib/python3.11/asyncio/runners.py:118) 1",
        "garbage line",
    ]
)


def test_summarise_counts_self_and_kvproxy_inclusive_shares() -> None:
    got = profile_phases.summarise(COLLAPSED, top=5)
    assert got["samples"] == 10
    assert got["self"][0] == ("<template>:root", 60.0)
    assert ("aiohttp/http_writer.py:_writelines", 30.0) in got["self"]
    inclusive = dict(got["inclusive"])
    # Lines of one function add up; only kvproxy's own functions are listed inclusive.
    assert inclusive == {
        "kvproxy/serve/handler.py:handle": 90.0,
        "kvproxy/tokens/templates.py:render": 60.0,
    }


def test_section_lists_each_phase_and_says_why_one_is_missing() -> None:
    r = {
        "profile": {
            "seconds": 5.0,
            "phases": {
                "relay only": profile_phases.summarise(COLLAPSED, top=5),
                "SSE relay (full policy)": {"error": "StartError: no"},
            },
        }
    }
    md = "\n".join(profile_phases.section(r))
    assert "### relay only" in md
    assert "| 60.0 | `<template>:root` |" in md
    assert "Not profiled: StartError: no" in md
    skipped = profile_phases.section({"profile": {"skipped": "py-spy could not be installed"}})
    assert "Not profiled: py-spy could not be installed." in skipped
    assert profile_phases.section({}) == []


def test_gil_shares_merge_numbered_workers_and_name_the_innermost_frame() -> None:
    raw = (
        "thread (11): MainThread;Runner.run (asyncio/runners.py:118);"
        "load_json (/w/kvproxy/prompt/shape.py:40) 6\n"
        "thread (12): kvproxy-count_0;_worker (concurrent/futures/thread.py:83);"
        "segment_chunks (/w/kvproxy/tokens/bounds.py:201) 3\n"
        "thread (13): kvproxy-count_1;_worker (concurrent/futures/thread.py:83);"
        "segment_chunks (/w/kvproxy/tokens/bounds.py:210) 1\n"
    )
    got = profile_phases.summarise_gil(raw, 4.0)
    assert got["samples"] == 10
    assert got["threads"] == [("MainThread", 60.0), ("kvproxy-count", 40.0)]
    assert got["functions"] == [
        ("kvproxy/prompt/shape.py:load_json", 60.0),
        ("kvproxy/tokens/bounds.py:segment_chunks", 40.0),
    ]
    lines = "\n".join(report._gil_lines(got))
    assert "MainThread 60.0 %, kvproxy-count 40.0 %" in lines
    assert "| 60.0 | `kvproxy/prompt/shape.py:load_json` |" in lines
    assert profile_phases.summarise_gil("", 4.0)["samples"] == 0
