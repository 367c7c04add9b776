"""The replica tier: what the engine will tokenize, rebuilt as the engine builds it. Pure.

It decides *the text*: each engine's chat request normalisation (`chatnorm`), the model's
chat template rendered in transformers' sandbox (`sandbox`, `templates`), a plain chat's
render filled into a frame proven once per conversation shape (`frames`), and the
tokenizer pipelines transformers may build from a tokenizer directory (`hfbuild`). The
exact tier counts this text; the replica bound is its bytes. It is only as good as the
bodies it was proven on: the gate tier says when the exact count may rest on it.

Two mechanisms spare a jinja render, and both stay because they answer different
questions. A frame (`frames`) *is* the render of one plain chat (role + string content),
so it bounds the text the engine tokenizes tightly, but it is this replica's render: it
holds only as far as the replica is right, and only for plain chats. The template proof
(tokens.bound.proof, with tokens.bound.guarantee) never renders and never uses this
replica: it bounds the output of every request whatever role, key or position an engine
moves its data to, so it can admit without trusting the replica, but it is looser.

Must never: log, label or keep prompt text.
"""

from kvproxy.tokens.replica.chatnorm import (
    ENGINE_KINDS,
    SPECIAL_TOKEN_KEYS,
    EngineKind,
    reserialised_bytes,
)
from kvproxy.tokens.replica.frames import frames_for
from kvproxy.tokens.replica.hfbuild import dumps, engine_pipelines
from kvproxy.tokens.replica.sandbox import Sandbox, environment
from kvproxy.tokens.replica.templates import ChatTemplate, from_tokenizer_dir_files, load_template

__all__ = [
    "ENGINE_KINDS",
    "SPECIAL_TOKEN_KEYS",
    "ChatTemplate",
    "EngineKind",
    "Sandbox",
    "dumps",
    "engine_pipelines",
    "environment",
    "frames_for",
    "from_tokenizer_dir_files",
    "load_template",
    "reserialised_bytes",
]
