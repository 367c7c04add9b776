"""SGLang 0.5.23's own preprocessing as the SGLang oracle (issue #47), on the Qwen-3
tokenizer and template: the I1 corpus and the mutation fuzzer's bodies (every family)
counted by SGLang's real code (`sglang_real/worker.py`, in SGLang's venv), by the replica
(`oracles/sglang.py`) and by kvproxy configured for SGLang 0.5.23 (`kvproxy_side.py`).

- kvproxy never under-counts the real count: at a limit one under it kvproxy refuses; at
  the real count, an admitted body was counted at or above it; with no limit in the way,
  an admitted body's number is at least the real count.
- The replica agrees with the real code on every body both answer (same counts per
  sequence, or both refuse); a disagreement fails: the real code wins, and the replica is
  fixed or the part retired.

Runs only with KVPROXY_REAL=1 (`make test-real`, or alone: docs/development.md), after
`make sglang-real` built the venv. KVPROXY_SGLANG_REAL_EXAMPLES bodies are drawn per
fuzzer family (default 300: > 2,000 bodies SGLang serves).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kvtest import add_summary
from tokenizer_files import cache_root

from oracles import capture, corpus, fuzz
from oracles import sglang as replica
from oracles import vllm as vllm_replica
from oracles.common import Count, Refused, Unmodelled
from oracles.kvproxy_side import KvproxySide
from oracles.models import load_model
from oracles.sglang_real.client import RealSglang, venv_path

pytestmark = [pytest.mark.real, pytest.mark.timeout(1800)]

MODEL = "qwen-3"
EXAMPLES = int(os.environ.get("KVPROXY_SGLANG_REAL_EXAMPLES", "300"))
# Every route SGLang serves that the corpus and the fuzzer send it: the worker runs each
# with SGLang's own handler (score and rerank bodies are vLLM's, never SGLang's).
REAL_ROUTES = ("chat", "completions", "generate", "responses")
HUGE = 2**31 - 1


@dataclass
class Body:
    source: str  # "corpus:<case>" or "fuzz:<family>"
    route: str
    body: bytes


@dataclass
class Outcome:
    bodies: list[Body] = field(default_factory=list)
    real: list[dict[str, Any]] = field(default_factory=list)
    under: list[str] = field(default_factory=list)
    disagree: list[str] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    per_source: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    max_ratio: tuple[float, str] = (0.0, "")
    apart: list[str] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def corpus_bodies() -> tuple[list[Body], list[str]]:
    """Every corpus case SGLang serves; the ones on routes the worker does not run are
    returned apart (named in the summary)."""
    out, apart = [], []
    for case in corpus.CASES:
        if "sglang" not in case.engines:
            continue
        if case.route in REAL_ROUTES:
            out.append(Body(f"corpus:{case.name}", case.route, case.bytes()))
        else:
            apart.append(f"{case.name} ({case.route})")
    return out, apart


def fuzz_bodies(examples: int) -> list[Body]:
    """`examples` bodies from each fuzzer family, seeded, kept when SGLang serves the route
    (whatever engine the family drew the body for: the body is what SGLang is asked)."""
    out: list[Body] = []
    for family, strategy in fuzz.CLASSES.items():
        _draw_family(out, family, strategy, examples)
    return out


def _draw_family(out: list[Body], family: str, strategy: Any, examples: int) -> None:
    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        route, _engine, body = data.draw(strategy)
        if route in REAL_ROUTES:
            out.append(Body(f"fuzz:{family}", route, body))

    draw()


def _replica(model: Any, route: str, body: bytes) -> Count | str:
    try:
        return replica.count(model, route, body)
    except Refused:
        return "refused"
    except Unmodelled:
        return "unmodelled"


def _judge(out: Outcome, side: KvproxySide, model: Any, b: Body, real: dict[str, Any]) -> None:
    stats = out.per_source["corpus" if b.source.startswith("corpus:") else b.source]
    mine = _replica(model, b.route, b.body)
    if "error" in real or "unsupported" in real:
        raise AssertionError(f"the worker failed on {b.source}: {real}")
    if "refused" in real:
        out.stats["real-refused"] += 1
        stats["real-refused"] += 1
        if isinstance(mine, Count):
            out.disagree.append(
                f"{b.source}: SGLang refuses ({real['refused'][:160]}), the replica counts "
                f"{mine.tokens}\n    body: {b.body[:300]!r}"
            )
        return
    tokens: list[int] = real["tokens"]
    truth = max(tokens)
    out.stats["real-counted"] += 1
    stats["real-counted"] += 1
    if mine == "unmodelled":
        out.stats["replica-unmodelled"] += 1
    elif mine == "refused":
        out.disagree.append(
            f"{b.source}: SGLang counts {tokens}, the replica refuses\n    body: {b.body[:300]!r}"
        )
    elif isinstance(mine, Count) and list(mine.per_sequence or (mine.tokens,)) != tokens:
        out.disagree.append(
            f"{b.source}: SGLang counts {tokens}, the replica {list(mine.per_sequence)}"
            f"\n    body: {b.body[:300]!r}"
        )
    # kvproxy configured as in front of SGLang 0.5.23.
    if truth >= 1:
        below = side.decide(b.route, b.body, truth - 1)
        if below.admitted:
            out.under.append(
                f"{b.source}: admitted at limit {truth - 1}: kvproxy {below.tokens} "
                f"({below.kind}) < SGLang {truth}\n    body: {b.body[:300]!r}"
            )
    at = side.decide(b.route, b.body, truth)
    if at.admitted and (at.tokens or 0) < truth:
        out.under.append(f"{b.source}: admitted at {truth} counting {at.tokens} < {truth}")
    verdict = "admitted" if at.admitted else "refused"
    out.stats[f"kvproxy-at-limit-{verdict}-{at.kind}"] += 1
    stats[f"kvproxy-at-limit-{verdict}"] += 1
    # kvproxy's number at the engine's own limit (where its counter must be exact enough
    # to decide): how far over the truth a refused body was counted.
    if at.tokens is not None and truth:
        out.ratios.append(at.tokens / truth)
    if at.tokens is not None and truth and at.tokens / truth > out.max_ratio[0]:
        out.max_ratio = (at.tokens / truth, f"{b.source} ({at.tokens}/{truth}, {at.kind})")
    # With no limit in the way the counter may answer with its cheap bound: still never
    # under the truth.
    free = side.decide(b.route, b.body, HUGE)
    if free.admitted and (free.tokens or 0) < truth:
        out.under.append(
            f"{b.source}: kvproxy's bound {free.tokens} ({free.kind}) < SGLang {truth}"
            f"\n    body: {b.body[:300]!r}"
        )


@pytest.fixture(scope="module")
def real() -> Iterator[RealSglang]:
    """One worker for the module (its imports take 6-17 s), stopped at the end."""
    t0 = time.monotonic()
    model_dir = cache_root() / f"sglang-real-{MODEL}"
    # Served under the model id the corpus and the fuzzer name (the capture worker's).
    with RealSglang(venv_path(), model_dir, served_model_name=capture.MODEL) as worker:
        worker.ready["started_s"] = time.monotonic() - t0
        yield worker


@pytest.fixture(scope="module")
def side() -> Iterator[KvproxySide]:
    """kvproxy configured as in front of SGLang 0.5.23, on the same tokenizer and template."""
    s = KvproxySide(load_model(MODEL).directory, "sglang")
    yield s
    s.close()


@pytest.fixture(scope="module")
def outcome(real: RealSglang, side: KvproxySide) -> Outcome:
    out = Outcome()
    out.seconds["worker-start"] = real.ready["started_s"]
    t0 = time.monotonic()
    bodies, out.apart = corpus_bodies()
    out.stats["corpus"] = len(bodies)
    out.bodies = bodies + fuzz_bodies(EXAMPLES)
    out.stats["fuzz"] = len(out.bodies) - len(bodies)
    out.seconds["draw"] = time.monotonic() - t0
    t1 = time.monotonic()
    out.real = real.count_many([(b.route, b.body) for b in out.bodies])
    out.seconds["real-count"] = time.monotonic() - t1
    t2 = time.monotonic()
    model = load_model(MODEL)
    for b, r in zip(out.bodies, out.real, strict=True):
        _judge(out, side, model, b, r)
    out.seconds["replica+kvproxy"] = time.monotonic() - t2
    return out


def test_summary(outcome: Outcome, request: pytest.FixtureRequest) -> None:
    """What was counted (printed in the terminal summary): the corpus size, the fuzzer's
    families, the largest bound/truth ratio and the time each step took."""
    sizes = Counter(b.source for b in outcome.bodies if b.source.startswith("fuzz:"))
    families = sorted(sizes)
    ratios = sorted(outcome.ratios) or [0.0]
    lines = {
        "1": f"SGLang 0.5.23 real preprocessing on {MODEL}: {len(outcome.bodies)} bodies "
        f"({outcome.stats['corpus']} corpus, {outcome.stats['fuzz']} fuzz), "
        f"{outcome.stats['real-counted']} counted, {outcome.stats['real-refused']} refused",
        "2": "fuzz families: " + ", ".join(f"{f[5:]} {sizes[f]}" for f in families),
        "3": f"kvproxy: { {k: v for k, v in outcome.stats.items() if k.startswith('kvproxy')} }"
        f"; kvproxy's number / SGLang's at SGLang's count: median "
        f"{ratios[len(ratios) // 2]:.3f}, p90 {ratios[len(ratios) * 9 // 10]:.3f}, "
        f"max {outcome.max_ratio[0]:.3f} at {outcome.max_ratio[1]}",
        "4": f"replica unmodelled {outcome.stats['replica-unmodelled']}, disagreements "
        f"{len(outcome.disagree)}; under-counts {len(outcome.under)}",
        "5": "corpus cases on routes the worker does not run: " + ", ".join(outcome.apart),
        "6": "seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in outcome.seconds.items()),
    }
    add_summary(request.config, "oracles: SGLang 0.5.23's own preprocessing", lines)
    assert outcome.stats["real-counted"] > 0
    assert not outcome.apart, "every corpus case SGLang serves is counted by SGLang's code"
    assert len(families) == len(fuzz.CLASSES)
    if EXAMPLES >= 300:
        assert outcome.stats["fuzz"] >= 2000


def test_kvproxy_never_under_counts_real_sglang(outcome: Outcome) -> None:
    assert not outcome.under, f"{len(outcome.under)} under-counts\n" + "\n".join(outcome.under[:20])


def test_replica_agrees_with_real_sglang(outcome: Outcome) -> None:
    assert not outcome.disagree, f"{len(outcome.disagree)} disagreements\n" + "\n".join(
        outcome.disagree[:20]
    )


# The real-engine facts' body with one tool (../shared/facts/real-engines, sglang_render.py).
WEATHER = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "weather?"}],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ],
}


def test_tools_render_with_sglang_s_defer_loading_null(real: RealSglang, side: KvproxySide) -> None:
    """SGLang dumps each tool with `"defer_loading": null` (protocol.py Tool has no
    serializer of its own), so the same body is 150 tokens on SGLang and 145 on vLLM (the
    facts measured vLLM's /tokenize; the vLLM replica gives 145). The replica follows
    SGLang, and kvproxy configured for SGLang refuses it one token under SGLang's count."""
    body = json.dumps(WEATHER).encode()
    (answer,) = real.count_many([("chat", body)])
    assert answer == {"tokens": [150]}
    model = load_model(MODEL)
    assert replica.count(model, "chat", body).tokens == 150
    assert vllm_replica.count(model, "chat", body).tokens == 145
    assert not side.decide("chat", body, 149).admitted
