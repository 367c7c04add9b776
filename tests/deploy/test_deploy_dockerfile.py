"""deploy/Dockerfile, linted (fast suite); the slow suite builds and runs it
(tests/deploy/test_deploy_image.py, after `make image`).

The file is parsed into instructions (comments, parser directives and line continuations
handled) and checked for what the image must be: a pinned base, a build stage and a final
stage without compilers, a numeric non-root user, `kvproxy serve` as the entrypoint, no
HEALTHCHECK (Kubernetes probes it), dependencies pinned to the tested set, and an
interpreter called by the name every supported base has (`python3`).
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
COMPILERS = re.compile(
    r"\b(gcc|g\+\+|cc|clang|build-essential|make|cmake|rustc|cargo|python3?-dev|libc6?-dev)\b"
)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comments inside a continued instruction are ignored by BuildKit
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with ${ARG} substituted in FROM lines."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in instructions(text):
        if keyword == "ARG" and not stages:
            arg, _, default = rest.partition("=")
            args[arg] = default
        elif keyword == "FROM":
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], rest)
            words = [w for w in image.split() if not w.startswith("--platform")]
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=alias))
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, rest))
    return args, stages


ARGS, STAGES = parse(DOCKERFILE.read_text(encoding="utf-8"))
FINAL = STAGES[-1]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"{args} is not the exec (JSON) form"
    return [str(v) for v in value]


def test_parser_handles_continuations_and_directives() -> None:
    _, stages = parse(
        "# syntax=docker/dockerfile:1\nARG B=python:3.11.7-slim\nFROM ${B} AS a\n"
        "RUN a \\\n  # note\n  && b\nFROM $B\nUSER 1:1\n"
    )
    assert [s.base for s in stages] == ["python:3.11.7-slim", "python:3.11.7-slim"]
    assert stages[0].name == "a"
    assert stages[0].all("RUN") == ["a && b"]


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.name or "final")
def test_base_images_are_pinned(stage: Stage) -> None:
    # An exact patch release (python:3.11.7-...) or a digest; never a floating tag.
    assert "@sha256:" in stage.base or re.search(r":\d+\.\d+\.\d+(-[a-z0-9.-]+)?$", stage.base), (
        f"{stage.base} is not pinned"
    )
    assert "slim" in stage.base or "distroless" in stage.base


def test_base_python_satisfies_requires_python() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    match = re.search(r"python:(\d+\.\d+\.\d+)", FINAL.base)
    assert match, FINAL.base
    assert Version(match[1]) in SpecifierSet(pyproject["project"]["requires-python"])


def test_multi_stage_and_no_compilers_in_the_final_image() -> None:
    assert len(STAGES) >= 2
    assert FINAL.base == STAGES[0].base, "the venv's python symlink needs the same interpreter"
    assert any(c.startswith(f"--from={STAGES[0].name} ") for c in FINAL.all("COPY"))
    for run in FINAL.all("RUN"):
        assert not COMPILERS.search(run), f"final stage installs a toolchain: {run}"
        assert "pip install" not in run, "dependencies belong to the build stage"
    # The build stage takes wheels only, pinned to the tested set.
    build_runs = " ".join(STAGES[0].all("RUN"))
    assert "--only-binary=:all:" in build_runs
    assert "--constraint constraints.txt" in build_runs


def test_commands_call_python3_which_every_supported_base_has() -> None:
    # The official image has `python` and `python3`; Debian's python3 package (the base
    # `make image` builds where no registry is reachable) has only `python3`.
    runs = [run for stage in STAGES for run in stage.all("RUN")]
    assert any("python3 -m venv" in run for run in runs)
    for run in runs:
        assert not re.search(r"(^|[\s/&;|])python(\s|$)", run), f"bare `python` in: {run}"


def test_runs_as_a_numeric_non_root_user() -> None:
    users = FINAL.all("USER")
    assert users, "the final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it; matches the manifests' 10001.
    assert uid.isdigit()
    assert int(uid) != 0
    assert gid.isdigit()
    assert int(gid) != 0
    assert int(uid) == 10001
    # Nothing after USER may switch back to root.
    last_user = max(i for i, (kw, _) in enumerate(FINAL.instructions) if kw == "USER")
    assert all(kw != "RUN" for kw, _ in FINAL.instructions[last_user:])


def test_entrypoint_is_kvproxy_serve_and_no_healthcheck() -> None:
    assert exec_form(FINAL.all("ENTRYPOINT")[-1]) == ["kvproxy", "serve"]
    assert not FINAL.all("CMD")
    for healthcheck in FINAL.all("HEALTHCHECK"):
        assert healthcheck.upper() == "NONE"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["scripts"]["kvproxy"] == "kvproxy.cli:main"
    exposed = {p for args in FINAL.all("EXPOSE") for p in args.split()}
    assert exposed == {"8080", "9090"}


def _pins(path: Path) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _assert_pinned(pins: dict[str, Version], wanted: list[str], where: str) -> None:
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not pinned in {where}"
        assert pins[name] in req.specifier, f"{name}=={pins[name]} violates {req.specifier}"


def test_constraints_pin_every_runtime_dependency() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    project = pyproject["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["tokenizers"]]
    _assert_pinned(_pins(REPO / "deploy" / "constraints.txt"), wanted, "deploy/constraints.txt")


def test_the_development_lock_pins_every_extra_and_agrees_with_the_image() -> None:
    """`make` installs .venv with constraints.txt: every dependency of every extra is pinned
    there, and a package the image also carries has the version the suites ran."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    project = pyproject["project"]
    wanted = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        wanted.extend(extra)
    lock = _pins(REPO / "constraints.txt")
    _assert_pinned(lock, wanted, "constraints.txt")
    image = _pins(REPO / "deploy" / "constraints.txt")
    differ = {n: (str(v), str(lock.get(n))) for n, v in image.items() if lock.get(n) != v}
    assert not differ, f"deploy/constraints.txt and constraints.txt disagree: {differ}"
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    installs = [ln for ln in makefile.splitlines() if "pip install" in ln and "-e '." in ln]
    assert all("-c constraints.txt" in ln or "PIP_INSTALL" in ln for ln in installs), installs
    assert "-c constraints.txt" in makefile


def test_dockerignore_lets_in_everything_the_build_copies() -> None:
    ignore = (REPO / "deploy" / "Dockerfile.dockerignore").read_text(encoding="utf-8")
    allowed = {line[1:].rstrip("/") for line in ignore.splitlines() if line.startswith("!")}
    assert "*" in ignore.splitlines(), "the ignore file should be an allow-list"
    sources = []
    for stage in STAGES:
        for copy in stage.all("COPY"):
            words = [w for w in copy.split() if not w.startswith("--")]
            if not copy.startswith("--from"):
                sources += words[:-1]
    assert sources
    for source in sources:
        assert source.rstrip("/") in allowed, f"COPY {source} is excluded by the ignore file"
        assert (REPO / source).exists(), f"COPY {source}: no such path"
