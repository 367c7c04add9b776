"""The server: the public and admin apps and their lifecycle (`app`), the request handler
as stages over one context (`handler`, `context`) and the relay that pumps the upstream's
answer and defers cancellation when the client leaves (`relay`)."""

from kvproxy.serve.app import KvproxyServer

__all__ = ["KvproxyServer"]
