"""The exact tier: the engine's own count of the replica tier's text.

It decides *the number*, in one of two places: a local tokenizer in worker threads
(`local`: HF tokenizers and tiktoken, stopped once the decision is known; `fast`:
fastokens, verified against HF at load, else HF), or the engine's `POST /tokenize`
(`engine`, aiohttp). It runs only when no bound already decided, and only admits where the
gate tier verified the request's features.

Must never: log prompt text (an engine request carries it; that is its job).
"""

from kvproxy.tokens.exact.engine import (
    EngineTokenize,
    EngineTokenizer,
    EngineTokenizeRequest,
    FailoverEngineTokenizer,
    client_chat_fields,
)
from kvproxy.tokens.exact.fast import load_hf_counting
from kvproxy.tokens.exact.local import (
    EarlyStopping,
    LocalTokenizer,
    Partial,
    load_hf,
    load_tiktoken,
    release_load_garbage,
)

__all__ = [
    "EarlyStopping",
    "EngineTokenize",
    "EngineTokenizeRequest",
    "EngineTokenizer",
    "FailoverEngineTokenizer",
    "LocalTokenizer",
    "Partial",
    "client_chat_fields",
    "load_hf",
    "load_hf_counting",
    "load_tiktoken",
    "release_load_garbage",
]
