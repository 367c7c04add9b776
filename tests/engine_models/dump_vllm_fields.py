"""Print, as JSON, the request fields of vLLM's request models per kvproxy route.

Run with the vLLM venv's python (tests/engine_models/test_engine_models.py): it imports vLLM's
own pydantic models and prints each route's field names (aliases where set), nothing else.
"""

import importlib
import json

ROUTES = {
    "chat": ["openai.chat_completion.protocol:ChatCompletionRequest"],
    "completions": ["openai.completion.protocol:CompletionRequest"],
    "responses": ["openai.responses.protocol:ResponsesRequest"],
    "messages": ["anthropic.protocol:AnthropicMessagesRequest"],
    "embeddings": [
        "pooling.embed.protocol:EmbeddingCompletionRequest",
        "pooling.embed.protocol:EmbeddingChatRequest",
    ],
    "classify": [
        "pooling.classify.protocol:ClassificationCompletionRequest",
        "pooling.classify.protocol:ClassificationChatRequest",
    ],
    "native_classify": [
        "pooling.classify.protocol:ClassificationCompletionRequest",
        "pooling.classify.protocol:ClassificationChatRequest",
    ],
    "rerank": ["pooling.scoring.protocol:RerankRequest"],
    "score": [
        "pooling.scoring.protocol:ScoreDataRequest",
        "pooling.scoring.protocol:ScoreQueriesDocumentsRequest",
        "pooling.scoring.protocol:ScoreQueriesItemsRequest",
        "pooling.scoring.protocol:ScoreTextRequest",
    ],
}

out = {}
for route, names in ROUTES.items():
    fields = set()
    for name in names:
        mod, cls = name.split(":")
        model = getattr(importlib.import_module("vllm.entrypoints." + mod), cls)
        for key, field in model.model_fields.items():
            fields.add(field.alias or key)
    out[route] = sorted(fields)
print(json.dumps(out))
