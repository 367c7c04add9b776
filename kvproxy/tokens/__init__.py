"""Token counting: guaranteed bounds first, exact counts only when the bound is not enough.

Public API (the proxy calls only these):

    counter = build_counter(settings, session=session)      # at start
    count = await counter.count(shape, admit_at_most)       # per request -> TokenCount
    counter.describe()                                      # start-up log line
    await counter.aclose()                                  # at stop

`KVPROXY_TOKENIZER` selects the exact method: `bytes` (bound only), `hf:PATH`,
`tiktoken:PATH` or `engine` (the engine's `/tokenize`). `hf:PATH` counts with fastokens
when it is installed and agrees with HF `tokenizers` on a probe corpus at start-up (`fast`),
else with HF itself; `counter.backend` says which.

The package is split by tier, each a subpackage whose face names what the other tiers
use; a tier imports only tiers listed above it here, and only through their faces
(tests/test_architecture_tokens.py):

    replica   what the engine will tokenize: its chat normalisation, the template's
              render, frames, the tokenizer pipelines transformers builds      (pure)
    gate      whether the exact count may admit: request features against
              the verified table                                               (pure)
    bound     a guaranteed upper bound with no tokenizer run: byte bounds, the
              template proof, the raw request's measures, the guarantee        (pure)
    exact     the engine's count: HF / fastokens / tiktoken in worker threads,
              or the engine's /tokenize                                        (threads, aiohttp)
    ladder    the rungs and their one executor (`ladder`), declared once in
              `counter.LADDER`; `TokenCounter` runs them                       (asyncio)

Nothing in this package logs or labels prompt text (I8).
"""

from __future__ import annotations

from typing import Any

from kvproxy.config import ConfigError, Settings, effective_tokenizer
from kvproxy.policy import CountMethod, TokenCount
from kvproxy.prompt import FieldPolicy, ImageProcessor, MediaPolicy
from kvproxy.tokens.bound import BoundRule
from kvproxy.tokens.counter import TokenCounter
from kvproxy.tokens.exact import (
    EngineTokenize,
    EngineTokenizer,
    EngineTokenizeRequest,
    FailoverEngineTokenizer,
    load_hf,
    load_hf_counting,
    load_tiktoken,
    release_load_garbage,
)
from kvproxy.tokens.gate import RouterKind, Verifier
from kvproxy.tokens.replica import ENGINE_KINDS, ChatTemplate, EngineKind, load_template


def build_counter(
    settings: Settings,
    *,
    session: Any = None,
    engine_tokenize: EngineTokenize | None = None,
) -> TokenCounter:
    """Build the counter `settings.tokenizer` asks for (`auto`, the default, is `engine` or
    `bytes`: config.effective_tokenizer). Raises ConfigError with one line.

    `session` (an aiohttp.ClientSession the caller owns) is needed only for `engine`, unless
    `engine_tokenize` is given (tests pass a fake).
    """
    spec = effective_tokenizer(settings.tokenizer, settings.engines)
    try:
        if spec == "bytes":
            return _counter(settings, "nfc", _template(settings, None))
        if spec == "engine":
            engine = engine_tokenize or _engine_from_settings(settings, session)
            desc = getattr(engine, "describe", lambda: "engine /tokenize")()
            template = _template(settings, None)
            return _counter(
                settings, "nfc", template, engine=engine, description=desc, backend="engine"
            )
        kind, _, path = spec.partition(":")
        if kind == "hf":
            local: Any = load_hf_counting(
                path, use_fastokens=settings.tokenizer_backend == "fastokens"
            )
        else:
            local = load_tiktoken(path, None)
        release_load_garbage()
        template = _template(settings, local.template)
        local.template = template
        if getattr(local, "unmodelled", None):
            return _bound_only(settings, local, template)
        return _counter(
            settings,
            local.bound_rule,
            template,
            local=local,
            special_tokens=local.special_tokens,
            description=local.describe(),
            backend=local.backend,
        )
    except ImportError as exc:
        # hf: and tiktoken: need native libraries a plain install leaves out.
        raise ConfigError(
            f"invalid setting tokenizer ({settings.where('tokenizer', spec)}): needs the "
            "Python package "
            f"{(exc.name or 'tokenizers').partition('.')[0]!r}: "
            "pip install 'kvproxy[tokenizers]'"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"invalid setting tokenizer ({settings.where('tokenizer', spec)}): {exc}"
        ) from None


def _template(settings: Settings, fallback: ChatTemplate | None) -> ChatTemplate | None:
    """The chat template to count with; a `chat_template` file that does not load is that
    setting's error, not the tokenizer's (ConfigError naming where it was set)."""
    try:
        return load_template(settings.chat_template, fallback)
    except (OSError, ValueError) as exc:
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ConfigError(
            f"invalid setting chat_template "
            f"({settings.where('chat_template', settings.chat_template)}): {what}"
        ) from None


def _bound_only(settings: Settings, local: Any, template: ChatTemplate | None) -> TokenCounter:
    """The counter for a tokenizer the engines do not build as its files say, in a way kvproxy
    does not model (tokens.replica.hfbuild): its counts could fall short of the engine's, so
    it never counts; requests are decided on the byte bound (fail closed)."""
    why = f"exact counts are off for {local.origin}: {local.unmodelled}"
    if local.bound_rule is None:
        # Not byte-level BPE: no byte bound holds either, so nothing could admit safely.
        raise ValueError(f"{why}; it has no byte bound either: use tokenizer: engine")
    description = (
        f"bytes: UTF-8 byte bound only (NFC rule, + template overhead); {why}. "
        "Configure tokenizer: engine for exact counts"
    )
    # The NFC rule whatever the file says (the engine's normalizer is unknown), and the
    # unknown-tokenizer allowance for special tokens (its class may add its own).
    return _counter(settings, "nfc", template, description=description, backend="bytes")


def _counter(
    settings: Settings,
    rule: BoundRule | None,
    template: ChatTemplate | None,
    **kwargs: Any,
) -> TokenCounter:
    if template is not None:
        template.engines = engine_kinds(settings)
    kwargs.setdefault("verifier", build_verifier(settings))
    return TokenCounter(
        bound_rule=rule,
        template=template,
        media=build_media(settings),
        fields=FieldPolicy(
            settings.extra_neutral_fields,
            trust_request_template=settings.trust_request_chat_template,
        ),
        count_timeout_s=settings.count_timeout_s,
        count_concurrency=settings.count_concurrency,
        **kwargs,
    )


def build_media(settings: Settings) -> MediaPolicy:
    """The model's media pricing (prompt.media): its image processor, if one is configured."""
    processor = None
    if settings.media_processor:
        try:
            processor = ImageProcessor.load(settings.media_processor)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"invalid setting media_processor: {exc}") from None
    return MediaPolicy(processor, settings.unseen_media, settings.image_tokens)


def build_verifier(settings: Settings) -> Verifier:
    """The verified-feature view of `settings`' engines and router (tokens.gate.verified); the
    capacity monitor feeds it the measured versions and the detected router."""
    return Verifier([e.kind for e in settings.engines], settings.router_kind)


def engine_kinds(settings: Settings) -> tuple[EngineKind, ...]:
    """Whose chat normalisation to count: the configured engines' kind when they all agree,
    else both (a static pool, or a mix, could be either engine)."""
    kinds = {e.kind for e in settings.engines}
    if kinds == {"sglang"}:
        return ("sglang",)
    if kinds == {"vllm"}:
        return ("vllm",)
    return ENGINE_KINDS


def _engine_from_settings(settings: Settings, session: Any) -> FailoverEngineTokenizer:
    # Prefill engines see every prompt; any sglang/vllm engine shares the model's tokenizer,
    # so each of the first one's kind is a fallback when another cannot be reached (in
    # gateway mode the engines are every cluster's: one cluster down must not stop counts).
    engines = sorted(
        (e for e in settings.engines if e.kind in ("sglang", "vllm")),
        key=lambda e: e.role == "decode",
    )
    if not engines:
        raise ValueError("engine counting needs an sglang or vllm engine in KVPROXY_ENGINES")
    if session is None:
        raise ValueError("engine counting needs an HTTP session")
    kind: EngineKind = "vllm" if engines[0].kind == "vllm" else "sglang"
    urls = list(dict.fromkeys(e.url for e in engines if e.kind == kind))
    return FailoverEngineTokenizer([EngineTokenizer(session, url, kind) for url in urls])


__all__ = [
    "ChatTemplate",
    "CountMethod",
    "EngineTokenize",
    "EngineTokenizeRequest",
    "EngineTokenizer",
    "RouterKind",
    "TokenCount",
    "TokenCounter",
    "Verifier",
    "build_counter",
    "build_verifier",
    "engine_kinds",
    "load_hf",
    "load_tiktoken",
]
