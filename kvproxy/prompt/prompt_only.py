"""Prompt extraction for the prompt-only routes: `/v1/embeddings`, `/v1/classify`,
`/v1/rerank` (and `/rerank`), `/v1/score`, and SGLang's `/encode` and `/classify`.

Each input is one sequence the engine prefills; nothing is generated, so the input limit
applies to every sequence (I1) and no decode budget is asked for (I4 does not apply). Shapes
follow SGLang's request types (`EmbeddingRequest`, `ClassifyRequest`, `V1RerankReqInput`,
`ScoringRequest`, `EmbeddingReqInput` in python/sglang/srt/entrypoints/openai/protocol.py and
managers/io_struct.py). Pure functions, no I/O; a 400 names the field and never quotes text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvproxy.policy import invalid_request
from kvproxy.prompt.shape import SequencePrompt, media_count, strings_or_token_ids, token_ids

# Tokens allowed per pair for a reranker's prompt wrapper, added to every pair's count: a
# cross-encoder adds ~3 special tokens; Qwen3-Reranker's published prompt format wraps each
# pair in ~90 (a fixed system prompt, <Instruct>/<Query>/<Document> labels, a default
# instruction when none is sent, and an empty think block). 256 covers both with room.
RERANK_OVERHEAD_TOKENS = 256

# --- prompt-only routes ---------------------------------------------------------------------

_Parsed = tuple[tuple[SequencePrompt, ...], str]


def _embeddings(data: Mapping[str, Any]) -> _Parsed:
    """OpenAI `input`: a string, strings, token ids, or lists of token ids; each a sequence.
    Multimodal objects are refused: SGLang renders them through a template kvproxy lacks."""
    return strings_or_token_ids(data.get("input"), "input"), "input"


def _rerank(data: Mapping[str, Any]) -> _Parsed:
    query = data.get("query")
    if not isinstance(query, str):
        raise invalid_request("query must be a string", "query")
    docs = data.get("documents")
    if not isinstance(docs, list) or not docs:
        raise invalid_request("documents must be a non-empty array of strings", "documents")
    extra: tuple[str, ...] = ()
    instruct = data.get("instruct")
    if instruct is not None:
        if not isinstance(instruct, str):
            raise invalid_request("instruct must be a string", "instruct")
        extra = (instruct,)
    seqs = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, str):
            raise invalid_request(f"documents[{i}] must be a string", f"documents[{i}]")
        seqs.append(SequencePrompt(texts=(query, doc, *extra), token_ids=RERANK_OVERHEAD_TOKENS))
    return tuple(seqs), "documents"


def _score(data: Mapping[str, Any]) -> _Parsed:
    """SGLang's scoring: one prefill per item of query + item (serving_score.py)."""
    query, items = data.get("query"), data.get("items")
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, list) or not items:
        raise invalid_request("items must be a string or a non-empty array", "items")
    if isinstance(query, str):
        if not all(isinstance(x, str) for x in items):
            raise invalid_request("items must be strings when query is a string", "items")
        return tuple(SequencePrompt(texts=(query, x)) for x in items), "items"
    if not isinstance(query, list):
        raise invalid_request("query must be a string or an array of token ids", "query")
    q = token_ids(query, "query")
    seqs = tuple(
        SequencePrompt(token_ids=q + token_ids(x, f"items[{i}]")) for i, x in enumerate(items)
    )
    return seqs, "items"


def _encode(data: Mapping[str, Any]) -> _Parsed:
    """SGLang's EmbeddingReqInput (`/encode`, `/classify`): text, text pairs or input_ids."""
    if data.get("input_embeds") is not None:
        raise invalid_request("input_embeds is not supported through kvproxy", "input_embeds")
    text, input_ids = data.get("text"), data.get("input_ids")
    if text is None and input_ids is None and "input" in data:
        # vLLM's /classify takes the OpenAI `input` shape instead.
        return _embeddings(data)
    if (text is None) == (input_ids is None):
        raise invalid_request("exactly one of text or input_ids is required", "text")
    images = media_count(data.get("image_data"), "image_data")
    images += media_count(data.get("video_data"), "video_data")
    audios = media_count(data.get("audio_data"), "audio_data")
    if input_ids is not None:
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            counts = [token_ids(x, f"input_ids[{i}]") for i, x in enumerate(input_ids)]
        else:
            counts = [token_ids(input_ids, "input_ids")]
        return tuple(
            SequencePrompt(token_ids=n, images=images, audios=audios) for n in counts
        ), "input_ids"
    texts: list[tuple[str, ...]]
    if isinstance(text, str):
        texts = [(text,)]
    elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        texts = [(t,) for t in text]
    elif isinstance(text, list) and text and all(_str_pair(t) for t in text):
        texts = [tuple(t) for t in text]  # cross-encoder pairs: one sequence each
    else:
        raise invalid_request(
            "text must be a string, an array of strings or an array of string pairs", "text"
        )
    return tuple(SequencePrompt(texts=t, images=images, audios=audios) for t in texts), "text"


PROMPT_ONLY: dict[str, Callable[[Mapping[str, Any]], _Parsed]] = {
    "embeddings": _embeddings,
    "classify": _embeddings,  # /v1/classify takes the embeddings `input` shape
    "rerank": _rerank,
    "score": _score,
    "encode": _encode,
    "native_classify": _encode,  # SGLang's /classify takes EmbeddingReqInput, like /encode
}


# The top-level fields each route's parser reads (see the functions above). Any other field
# that `tokens.gate.features.INERT_KEYS` does not name may carry prompt text an engine reads (vLLM's
# /v1/score takes text_1/text_2, its pooling routes `messages`): the counter then bounds the
# request by all of its text (tokens.bound.guarantee.text_tokens) and never counts it exactly.
MODELED_KEYS: dict[str, frozenset[str]] = {
    "embeddings": frozenset({"input", "encoding_format", "dimensions"}),
    "classify": frozenset({"input"}),
    "rerank": frozenset({"query", "documents", "instruct", "top_n", "return_documents"}),
    "score": frozenset({"query", "items", "label_token_ids", "apply_softmax", "item_first"}),
    "encode": frozenset({"text", "input_ids", "input", "image_data", "video_data", "audio_data"}),
    "native_classify": frozenset(
        {"text", "input_ids", "input", "image_data", "video_data", "audio_data"}
    ),
    # Parsed in `kvproxy.prompt`.
    "completions": frozenset({"prompt", "suffix", "echo", "best_of", "add_special_tokens"}),
    "generate": frozenset(
        {
            "text",
            "input_ids",
            "sampling_params",
            "image_data",
            "video_data",
            "audio_data",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
            "token_ids_logprob",
            "return_text_in_logprobs",
        }
    ),
}


def _str_pair(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(isinstance(s, str) for s in value)


__all__ = ["MODELED_KEYS", "PROMPT_ONLY", "RERANK_OVERHEAD_TOKENS"]
