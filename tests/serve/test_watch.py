"""The heap the server settles before serving (watch.settle_heap / release_heap).

A full collection on the loop's thread frees whatever cyclic garbage start-up left (a
dropped tokenizer's finaliser alone took ~22 ms here) and walks every long-lived object;
the server collects and freezes before its lag monitor starts, and unfreezes when it stops.
"""

from __future__ import annotations

import gc
import weakref

from kvtest import running_proxy

from kvproxy.serve.watch import release_heap, settle_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_settle_heap_collects_startup_garbage_and_freezes_the_survivors() -> None:
    gc.unfreeze()
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    kept = _Node()
    try:
        frozen = settle_heap()
        assert gone() is None  # the cycle was collected before serving, not during it
        assert frozen == gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects(generation=2))  # permanent now
    finally:
        release_heap()
    assert gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects(generation=2))


async def test_the_server_freezes_its_heap_while_it_serves_and_releases_it_on_stop() -> None:
    gc.unfreeze()
    async with running_proxy("http://127.0.0.1:9", refresh=False):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
