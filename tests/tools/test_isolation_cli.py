"""`kvproxy canary`'s command line (kvproxy.tools.isolation.cli): what the flags become, and the
refusals that name the flag. In-process, so coverage sees it (the end-to-end runs start
`kvproxy canary` as a subprocess: tests/tools/test_isolation.py)."""

from __future__ import annotations

import argparse

import pytest

from kvproxy.cli import build_parser
from kvproxy.tools.isolation.cli import options_from


def parse(*flags: str) -> argparse.Namespace:
    return build_parser(["canary"]).parse_args(["canary", *flags])


def test_flags_become_options() -> None:
    args = parse(
        "--target", "http://127.0.0.1:8080/", "--sim", "http://127.0.0.1:30000/",
        "--scenarios", "boundary, cancel", "--tenants", "Acme-1,beta", "--rounds", "999",
    )  # fmt: skip
    opts = options_from(args, lambda _: None)
    assert opts.target == "http://127.0.0.1:8080"
    assert opts.sim == "http://127.0.0.1:30000"
    assert opts.scenarios == ("boundary", "cancel")
    assert opts.tenants == ("acme-1", "beta")
    assert opts.rounds == 50  # bounded: every loop of the harness is


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--scenarios", "boundary,nope"), "unknown scenario"),
        (("--tenants", "only-one"), "--tenants needs two or more"),
        (("--tenants", "a,b c"), "--tenants needs two or more"),
    ],
)
def test_bad_flags_exit_naming_the_flag(flags: tuple[str, ...], says: str) -> None:
    with pytest.raises(SystemExit, match=says):
        options_from(parse("--target", "http://127.0.0.1:1", *flags), lambda _: None)
