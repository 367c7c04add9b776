"""Prompt extraction: a counted route's request bytes in, a `PromptShape` out. Pure, no I/O.

`parse_request` is the one entry point; `SequencePrompt` is one sequence the engine will
prefill and `PromptShape` a whole request. The closed world's gates are public too:
`FieldPolicy` (every field classified per engine version, `request_template`) and
`MediaPolicy` / `ImageProcessor` (media priced from the media). `load_json_in_steps` parses
a large body as `load_json` does, in bounded steps the caller drives (the event loop runs
between them). Everything else in this package is private.
"""

from kvproxy.prompt.chat import REFUSED_TEMPLATE_KWARGS
from kvproxy.prompt.fields import FieldPolicy, request_template
from kvproxy.prompt.media import ImageProcessor, MediaPolicy
from kvproxy.prompt.parse import parse_request
from kvproxy.prompt.prompt_only import MODELED_KEYS, RERANK_OVERHEAD_TOKENS
from kvproxy.prompt.shape import MAX_N, MAX_OUTPUT_TOKENS, PromptShape, SequencePrompt, load_json
from kvproxy.prompt.sliced import load_json as load_json_in_steps

__all__ = [
    "MAX_N",
    "MAX_OUTPUT_TOKENS",
    "MODELED_KEYS",
    "REFUSED_TEMPLATE_KWARGS",
    "RERANK_OVERHEAD_TOKENS",
    "FieldPolicy",
    "ImageProcessor",
    "MediaPolicy",
    "PromptShape",
    "SequencePrompt",
    "load_json",
    "load_json_in_steps",
    "parse_request",
    "request_template",
]
