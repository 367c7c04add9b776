"""Independent oracles for issue #30: each engine's request preprocessing, replicated from
its source at a pinned release (`versions.py`), then transformers' chat template and the
tokenizer, giving the token count the engine prefills for a request body.

Owns: the replicas (`sglang`, `vllm`, `smg`), the shipped models they render with
(`models`), the named bodies of every under-count class (`corpus`), and the one adapter
that asks kvproxy for its decision (`kvproxy_side`). Must never: import kvproxy anywhere
but `kvproxy_side.py`, or take a rule from kvproxy/tokens/replica/chatnorm.py (an oracle written
from the code it checks verifies nothing; DESIGN.md, round-3 amendment on I1).
"""
