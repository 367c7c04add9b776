"""Print, as JSON, the fields of SGLang's native request dataclasses (io_struct.py):
GenerateReqInput (/generate) and EmbeddingReqInput (/encode, /classify).

Run with the SGLang venv's python and the torchvision stub on the path
(tests/engine_models/test_engine_models.py).
"""

import dataclasses
import json

from sglang.srt.managers import io_struct

fields = {
    "generate": io_struct.GenerateReqInput,
    "encode": io_struct.EmbeddingReqInput,
    "native_classify": io_struct.EmbeddingReqInput,
}
print(json.dumps({r: sorted(f.name for f in dataclasses.fields(c)) for r, c in fields.items()}))
