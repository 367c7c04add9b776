"""The advisory table: the shipped data validates against its schema, every entry has a
fixed version and a source and matches exactly the versions it names, and a bad operator
file or acceptance fails at start."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvproxy.config import ConfigError, load_settings
from kvproxy.posture.advisories import (
    BUILTIN_CHECKS,
    SCHEMA_PATH,
    SHIPPED,
    AdvisoryError,
    load_table,
    parse_version,
)

SHIPPED_DATA: dict[str, Any] = json.loads(SHIPPED.read_text())
SHIPPED_IDS = [a["id"] for a in SHIPPED_DATA["advisories"]]


def schema_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def entry(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "site-example",
        "engine": "sglang",
        "fixed_in": "0.6.0",
        "effect": "an operator's own advisory for the test",
        "severity": "high",
        "source": "https://example.invalid/advisory",
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


def write_table(tmp_path: Path, *entries: dict[str, Any]) -> Path:
    path = tmp_path / "advisories.json"
    path.write_text(json.dumps({"schema": "kvproxy.advisories/1", "advisories": list(entries)}))
    return path


def test_the_shipped_table_validates_against_its_schema_and_loads() -> None:
    schema_validator().validate(SHIPPED_DATA)
    table = load_table()
    assert [a.id for a in table.advisories] == SHIPPED_IDS
    assert table.accepted == frozenset()


@pytest.mark.parametrize("advisory_id", SHIPPED_IDS)
def test_every_shipped_entry_has_a_source_and_matches_only_versions_before_its_fix(
    advisory_id: str,
) -> None:
    adv = load_table().by_id(advisory_id)
    assert adv is not None
    assert adv.source.startswith("https://github.com/")
    assert adv.verification  # what could and could not be checked is stated
    fixed = parse_version(adv.fixed_in)
    assert fixed is not None
    major, minor, patch, _ = fixed
    assert adv.affects_version((major, minor, patch - 1, 0))
    assert adv.affects_version((major, minor, patch, -1))  # a release candidate of the fix
    assert not adv.affects_version(fixed)
    assert not adv.affects_version((major, minor, patch + 1, 0))


@pytest.mark.parametrize("missing", ["fixed_in", "source"])
def test_an_entry_without_fixed_in_or_source_fails_validation(tmp_path: Path, missing: str) -> None:
    bad = entry(**{missing: None})
    with pytest.raises(jsonschema.ValidationError):
        schema_validator().validate({"schema": "kvproxy.advisories/1", "advisories": [bad]})
    with pytest.raises(AdvisoryError, match=missing):
        load_table(str(write_table(tmp_path, bad)))


def test_a_source_that_is_not_a_url_fails(tmp_path: Path) -> None:
    with pytest.raises(AdvisoryError, match="source"):
        load_table(str(write_table(tmp_path, entry(source="the incident write-up"))))


def test_an_operator_file_adds_entries_and_duplicates_fail(tmp_path: Path) -> None:
    table = load_table(str(write_table(tmp_path, entry())), ["site-example"])
    assert table.by_id("site-example") is not None
    assert table.accepted == {"site-example"}
    assert len(table.files) == 2
    with pytest.raises(AdvisoryError, match="duplicate"):
        load_table(str(write_table(tmp_path, entry(id=SHIPPED_IDS[0]))))
    with pytest.raises(AdvisoryError, match="duplicate"):
        load_table(str(write_table(tmp_path, entry(id="page-size-mismatch"))))


def test_accepting_an_unknown_id_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="accept_advisories names no advisory: typo-id"):
        load_settings(accept_advisories=["typo-id"])
    for builtin in BUILTIN_CHECKS:
        assert builtin in load_settings(accept_advisories=[builtin]).accept_advisories


def test_a_missing_operator_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(advisories_file=str(tmp_path / "absent.json"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.5.21-sim", (0, 5, 21, 0)),
        ("v0.5.23", (0, 5, 23, 0)),
        ("0.5.22rc1", (0, 5, 22, -1)),
        ("0.5.9.post2", (0, 5, 9, 0)),
        ("0.6", (0, 6, 0, 0)),
        ("main", None),
        ("", None),
        (None, None),
    ],
)
def test_reported_versions(text: str | None, expected: tuple[int, ...] | None) -> None:
    assert parse_version(text) == expected
