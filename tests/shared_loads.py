"""One load per tokenizer for tests that build many counters of the same `hf:` tokenizer.

Loading an `hf:` tokenizer (HF, then fastokens and their agreement check) takes 2-12 s here,
and a module that starts a proxy per test, or a counter per engine, loads the same one again
each time. Inside `shared_tokenizer_loads()`, `kvproxy.tokens.load_hf_counting` loads each
(path, backend) once and hands every caller its own copy of the object and of its template
(build_counter sets the template's engines). Not for tests of loading itself
(tests/tokens/test_tokens_build.py, test_tokens_fast*.py, test_tokens_hfbuild.py): they must
see every load. The `shared_tokenizer_loads` fixture (tests/conftest.py) holds it for a module.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import kvproxy.tokens as kv_tokens

_LOADS: dict[tuple[str, tuple[tuple[str, Any], ...]], Any] = {}
_LOADS_KEPT = 4


@contextlib.contextmanager
def shared_tokenizer_loads() -> Iterator[None]:
    original = getattr(kv_tokens, "load_hf_counting", None)
    if original is None:  # a kvproxy without it simply loads every time
        yield
        return

    def cached(path: Any, **kwargs: Any) -> Any:
        key = (str(path), tuple(sorted(kwargs.items())))  # the backend is a keyword
        hit = _LOADS.get(key)
        if hit is None:
            hit = original(path, **kwargs)
            _LOADS[key] = hit
            while len(_LOADS) > _LOADS_KEPT:
                _LOADS.pop(next(iter(_LOADS)))
        local = copy.copy(hit)
        if getattr(local, "template", None) is not None:
            local.template = copy.copy(local.template)
        return local

    kv_tokens.load_hf_counting = cached  # type: ignore[attr-defined]
    try:
        yield
    finally:
        kv_tokens.load_hf_counting = original  # type: ignore[attr-defined]
