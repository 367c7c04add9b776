"""`kvproxy check` on the command line: its flags, the options they make (the same
`load_settings` the proxy uses, so the gate reads the proxy's config file, margin and
fallback), and the printed verdict. The gate itself is kvproxy.tools.check.gate.

One gate per model of the config's model table, one after another (their probes would
compete for the same router otherwise): the single-model form is one gate and one record;
with a `models` config each model is gated on its own engines and declared context, its
boundary probes request it by its configured name, the proxy limit compared with the
measurement is the one under its `model` label, and the record has a section per model
(`--model NAME`, a name or an alias, gates that one alone). The deferral counts on the
proxy's admin /metrics belong to the replica, not to a model: each section shows the same.
A model with `upstreams` (gateway mode) is gated by the same gate, each cluster on its own
engines, and the proxy's routing between them, its record one section per cluster
(kvproxy.tools.check.clusters); `--sim CLUSTER=URL` gives each cluster's ground truth.

Exit codes: 0 every check passed, 1 a check failed (cli.py maps ConfigError to 2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from kvproxy.config import (
    IMPLICIT_CLUSTER,
    ConfigError,
    ModelSpec,
    Settings,
    UpstreamCluster,
    load_settings,
)
from kvproxy.tools.check.gate import ClusterTarget, GateOptions, run_gate
from kvproxy.tools.check.record import (
    ReleaseRecord,
    combined_json,
    engine_table,
    write_models_record,
    write_record,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvproxy YAML config to read engines and max_context from")
    p.add_argument("--engines", help="JSON list as in KVPROXY_ENGINES (default: the config)")
    p.add_argument("--max-context", type=int, help="declared context (KVPROXY_MAX_CONTEXT)")
    p.add_argument("--proxy", help="kvproxy public URL: run boundary probes through it")
    p.add_argument("--proxy-admin", help="kvproxy admin URL: read its limit and deferral counts")
    p.add_argument(
        "--sim",
        action="append",
        metavar="[CLUSTER=]URL",
        help="simulator router URL: ground truth for the probes; with a gateway config "
        "(`upstreams`), CLUSTER=URL once per cluster",
    )
    p.add_argument("--canary", action="store_true", help="run the isolation scenarios too")
    p.add_argument(
        "--canary-allow-partial",
        action="store_true",
        help="with --canary: pass even if some isolation scenario could not run (e.g. "
        "transfer_failure without --sim); recorded in the isolation report",
    )
    p.add_argument(
        "--canary-rounds",
        type=int,
        default=4,
        help="with --canary: rounds of each isolation scenario (`kvproxy canary --rounds`)",
    )
    p.add_argument(
        "--canary-prompt-chars",
        type=int,
        help="with --canary: characters of each long prompt (`kvproxy canary --prompt-chars`)",
    )
    p.add_argument(
        "--unknown-probe",
        help="a kvproxy URL whose engines are unreachable: must answer 503 capacity_unknown",
    )
    p.add_argument(
        "--accept-drain-timeouts",
        action="store_true",
        help="pass even if deferred cancellations ended by timeout or shutdown (drain not "
        "confirmed); recorded in the release record",
    )
    p.add_argument(
        "--model",
        help="model id to request (default: the proxy's /v1/models); with a models config, "
        "the configured model to check (default: every one, a section each)",
    )
    p.add_argument(
        "--probe-kind",
        choices=("auto", "text", "token_ids"),
        default="auto",
        help="boundary prompts: text measured by an engine's /tokenize (auto, when one "
        "answers) or token-id arrays",
    )
    p.add_argument("--out", help="directory for release-record.json and release-record.md")


def gate_settings(args: argparse.Namespace) -> Settings:
    """The config file plus --engines / --max-context (ConfigError: one line)."""
    overrides: dict[str, Any] = {}
    if args.engines:
        try:
            overrides["engines"] = orjson.loads(args.engines)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"invalid setting engines (--engines): not JSON: {exc}") from None
    if args.max_context is not None:
        overrides["max_context"] = args.max_context
    return load_settings(config_path=args.config, overrides=overrides)


def sim_urls(args: argparse.Namespace) -> dict[str | None, str]:
    """--sim values: a plain URL (key None) or CLUSTER=URL (ConfigError: one line)."""
    found: dict[str | None, str] = {}
    for value in args.sim or ():
        name, sep, url = value.partition("=")
        key = name if sep and not name.startswith(("http://", "https://")) else None
        url = url if key is not None else value
        if key in found:
            raise ConfigError(f"invalid setting sim (--sim): {key or 'a URL'} given twice")
        found[key] = url.rstrip("/")
    return found


def options_from(
    args: argparse.Namespace,
    settings: Settings | None = None,
    spec: ModelSpec | None = None,
    cluster: UpstreamCluster | None = None,
) -> GateOptions:
    """The gate's options for one model (`spec`; default the single-model form's), or for
    one of its upstream clusters (`cluster`, gateway mode: that cluster's engines and
    ground truth)."""
    settings = settings or gate_settings(args)
    named = spec is not None and bool(settings.models)
    if spec is None:
        if settings.models:
            raise ConfigError("invalid setting engines (--engines / KVPROXY_ENGINES): none given")
        spec = settings.model_table()[0]
    sims = sim_urls(args)
    sim = sims.get(None, sims.get(IMPLICIT_CLUSTER))
    if cluster is not None:
        # A plain --sim URL stands for the cluster every model shares (`check_sims`).
        settings = settings.for_cluster(spec, cluster)
        sim = sims.get(cluster.name, sim)
    else:
        settings = settings.for_model(spec)
        if spec.upstreams:
            # The model's options in gateway mode: its engines are its clusters'.
            settings = settings.model_copy(
                update={"engines": tuple(e for c in spec.upstreams for e in c.engines)}
            )
    if not settings.engines:
        raise ConfigError("invalid setting engines (--engines / KVPROXY_ENGINES): none given")

    def strip(u: str | None) -> str | None:
        return u.rstrip("/") if u else None

    return GateOptions(
        engines=settings.engines,
        max_context=settings.max_context,
        limit_margin_tokens=settings.limit_margin_tokens,
        capacity_fallback_limit_tokens=settings.capacity_fallback_limit_tokens,
        proxy=strip(args.proxy),
        proxy_admin=strip(args.proxy_admin),
        sim=sim,
        canary=args.canary,
        unknown_probe=strip(args.unknown_probe),
        out=Path(args.out) if args.out else None,
        # A configured model is requested by its name and read under its `model` label.
        model=spec.name if named else args.model,
        limit_model=spec.name if named else None,
        accept_drain_timeouts=args.accept_drain_timeouts,
        canary_allow_partial=args.canary_allow_partial,
        canary_rounds=max(1, min(args.canary_rounds, 50)),
        canary_prompt_chars=max(200, args.canary_prompt_chars)
        if args.canary_prompt_chars
        else None,
        probe_kind=args.probe_kind,
        advisories_file=settings.advisories_file,
        accept_advisories=settings.accept_advisories,
    )


def selected_models(settings: Settings, wanted: str | None) -> tuple[ModelSpec, ...]:
    """The models to gate: every one, or with a `models` config the one `--model` names
    (in the single-model form `--model` is only the model id its probes request)."""
    table = settings.model_table()
    if not settings.models or wanted is None:
        return table
    for spec in table:
        if wanted in spec.names:
            return (spec,)
    names = ", ".join(m.name for m in table)
    raise ConfigError(f"invalid setting model (--model): {wanted!r} is not configured ({names})")


def cluster_targets(
    args: argparse.Namespace, settings: Settings, spec: ModelSpec
) -> list[ClusterTarget]:
    """The clusters a model's config names (`upstreams`: gateway mode), each with the gate's
    options for its own engines; none in the single-upstream form, whose one implicit
    cluster is the model's own engines (`run_gate`)."""
    named = {c.name for c in spec.upstreams}
    return [
        ClusterTarget(c.name, c.url, c.weight, options_from(args, settings, spec, c))
        for c in settings.clusters(spec)
        if c.name in named
    ]


def check_sims(args: argparse.Namespace, settings: Settings) -> None:
    """--sim CLUSTER=URL must name a configured cluster; a plain URL stands for the cluster
    every model shares, so with gateway clusters of different names it names none of them
    (ConfigError: one line, before any probe)."""
    sims = sim_urls(args)
    clusters = {c.name for spec in settings.model_table() for c in settings.clusters(spec)}
    gateway = any(spec.upstreams for spec in settings.model_table())
    unknown = sorted(k for k in sims if k is not None and k not in clusters)
    if unknown:
        names = ", ".join(sorted(clusters))
        raise ConfigError(f"invalid setting sim (--sim): no cluster {unknown[0]!r} ({names})")
    if gateway and None in sims and any(a != b for a in clusters for b in clusters):
        raise ConfigError("invalid setting sim (--sim): give CLUSTER=URL for each cluster")


async def gate_models(
    args: argparse.Namespace, settings: Settings, progress: Any = print
) -> list[tuple[str, ReleaseRecord]]:
    """One gate per selected model, one after another; a model with `upstreams` gates each
    of its clusters and the routing between them (kvproxy.tools.check.clusters)."""
    check_sims(args, settings)  # what a plain --sim URL stands for (`options_from`)
    records = []
    for spec in selected_models(settings, args.model):
        if settings.models:
            progress(f"[check] model {spec.name}")
        opts = options_from(args, settings, spec)
        record = await run_gate(opts, progress, cluster_targets(args, settings, spec))
        records.append((spec.name, record))
    return records


def run_check(args: argparse.Namespace) -> int:
    settings = gate_settings(args)
    # Refused before any probe: a bad --engines, --sim or config names itself first.
    check_sims(args, settings)
    for spec in selected_models(settings, args.model):
        options_from(args, settings, spec)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    records = asyncio.run(gate_models(args, settings, progress))
    for name, record in records:
        if settings.models:
            print(f"== model {name}")
        print("\n".join(engine_table(record)))
        print()
        for c in record.checks:
            print(f"{'PASS' if c.passed else 'FAIL'}  {c.name}: {c.detail}")
        if record.safe_max_context_tokens is not None and not settings.models:
            print(f"\nlargest safe context: {record.safe_max_context_tokens:,} tokens")
        if settings.models:
            print()
    out = Path(args.out) if args.out else Path(os.environ.get("KVPROXY_RECORD_DIR", "."))
    if settings.models:
        j, m = write_models_record(records, out)
        summary = combined_json(records)
        passed, failed = summary["passed"], summary["failed_checks"]
    else:
        [(_, record)] = records
        j, m = write_record(record, out)
        passed, failed = record.passed, record.failed_checks
    print(f"release record: {j} and {m}")
    if passed:
        print("RESULT: PASS")
        return 0
    print("RESULT: FAIL (" + "; ".join(failed) + ")")
    return 1
