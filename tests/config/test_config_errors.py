"""Config load failures, as an operator meets them: exit 2 and one line on stderr naming
where the value came from (the file and line, or the environment variable actually set),
the setting at fault, and for a misspelt key the closest valid one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvproxy.cli import main
from kvproxy.config import ConfigError, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("KVPROXY_"):
            monkeypatch.delenv(name)


def failure(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI; it must exit 2 with exactly one line on stderr, which is returned."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    return err.rstrip("\n")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvproxy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_bad_json_in_an_environment_variable_is_one_line_exit_2() -> None:
    # The process as an operator runs it: before, a traceback and exit 1.
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVPROXY_")}
    env["KVPROXY_ENGINES"] = '[{"url": "http://e:1", "role": prefill}]'
    proc = subprocess.run(
        [sys.executable, "-m", "kvproxy", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "kvproxy: invalid setting engines (KVPROXY_ENGINES): not valid JSON: Expecting value: "
        "line 1 column 32 (char 31)\n"
    )


def test_the_variable_named_is_the_one_set(monkeypatch: pytest.MonkeyPatch) -> None:
    # Environment names are case-insensitive to kvproxy: the message names the one set.
    monkeypatch.setenv("kvproxy_max_context", "many")
    with pytest.raises(ConfigError) as err:
        load_settings()
    assert str(err.value).startswith("invalid setting max_context (kvproxy_max_context): ")


def test_a_misspelt_key_names_the_file_line_and_the_closest_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, 'upstream: "http://127.0.0.1:8000"\nmax_contxt: 8192\n')
    line = failure(capsys, "serve", "--config", str(path))
    # Not KVPROXY_MAX_CONTXT: nobody set that variable.
    assert line == (
        f"kvproxy: invalid setting max_contxt ({path} line 2): unknown key "
        "(did you mean max_context?)"
    )


def test_a_misspelt_nested_key_is_matched_against_its_own_model(tmp_path: Path) -> None:
    path = write(tmp_path, "engines:\n  - url: http://e:1\n    rol: prefill\n")
    with pytest.raises(ConfigError) as err:
        load_settings(config_path=path)
    assert str(err.value) == (
        f"invalid setting engines.0.rol ({path} line 3): unknown key (did you mean role?)"
    )


def test_a_key_like_nothing_suggests_nothing(tmp_path: Path) -> None:
    path = write(tmp_path, "zzzz: 1\n")
    with pytest.raises(ConfigError) as err:
        load_settings(config_path=path)
    assert str(err.value) == f"invalid setting zzzz ({path} line 1): unknown key"


def test_a_bad_value_names_its_line_in_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "listen: 0.0.0.0:8080\ndrain_timeout_s: -1\n")
    with pytest.raises(ConfigError) as err:
        load_settings(config_path=path)
    assert str(err.value).startswith(f"invalid setting drain_timeout_s ({path} line 2): ")


def test_a_flag_is_named_as_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(overrides={"max_context": 0})
    assert str(err.value).startswith("invalid setting max_context (--max-context): ")


def test_a_yaml_error_names_the_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "max_context: 8192\nengines: [\n  {url: x\nlisten: 1\n")
    line = failure(capsys, "serve", "--config", str(path))
    assert line.startswith(f"kvproxy: config file {path} line 4 column 7: ")
    assert "<unicode string>" not in line


def test_a_missing_chat_template_is_blamed_on_chat_template(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-template.jinja"
    path = write(tmp_path, f"tokenizer: bytes\nchat_template: {missing}\n")
    line = failure(capsys, "serve", "--config", str(path), "--listen", "127.0.0.1:0")
    assert line == (
        f"kvproxy: invalid setting chat_template ({path} line 2: {missing}): "
        "No such file or directory"
    )


def test_a_missing_chat_template_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "t.jinja"
    monkeypatch.setenv("KVPROXY_CHAT_TEMPLATE", str(missing))
    line = failure(capsys, "serve", "--listen", "127.0.0.1:0")
    assert line == (
        f"kvproxy: invalid setting chat_template (KVPROXY_CHAT_TEMPLATE={missing}): "
        "No such file or directory"
    )


def test_a_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = failure(capsys, "serve", "--config", str(tmp_path / "nope.yaml"))
    assert line == f"kvproxy: config file {tmp_path / 'nope.yaml'}: No such file or directory"
