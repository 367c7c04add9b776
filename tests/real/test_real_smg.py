"""What smg 1.13 (`make smg`) does as the PD router of a real vLLM NIXL pair, kept so that a
later smg that does pass vLLM's kv_transfer_params on is noticed (then it, not
pd_test_router.py, should stand in front of the pair here and in the docs)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from engines import PDPair, idle, wait_metrics
from kvproxy_stack import body_of, post_chat
from ports import free_port
from real_router import RealRouter, smg_command, spawn, stop_process, wait_for_workers

SOURCE = "vllm:prompt_tokens_by_source_total"


def test_smg_1_13_answers_but_moves_no_kv_for_vllm(vllm_pd: PDPair, real_logs: Path) -> None:
    async def through_smg() -> tuple[int, dict[str, object]]:
        port, metrics_port = free_port(), free_port()
        cmd = smg_command(vllm_pd.prefill.url, vllm_pd.decode.url, port, metrics_port)
        log = real_logs / "smg.log"
        proc = spawn([*cmd, "--backend", "vllm"], log)
        router = RealRouter(f"http://127.0.0.1:{port}", "", proc, log)
        try:
            await wait_for_workers(router)
            body = body_of(uuid.uuid4().hex + " hello" * 300, max_tokens=4)
            return await asyncio.to_thread(post_chat, router.url, body)
        finally:
            stop_process(proc)

    d0 = wait_metrics(vllm_pd.decode, idle, "idle")
    status, out = asyncio.run(through_smg())
    assert status == 200, out
    prompt = out["usage"]["prompt_tokens"]  # type: ignore[index]
    d1 = wait_metrics(
        vllm_pd.decode,
        lambda m: (
            m.value("vllm:prompt_tokens_total") - d0.value("vllm:prompt_tokens_total") >= prompt
        ),
        "served it",
    )
    pulled = d1.value(SOURCE, source="external_kv_transfer") - d0.value(
        SOURCE, source="external_kv_transfer"
    )
    computed = d1.value(SOURCE, source="local_compute") - d0.value(SOURCE, source="local_compute")
    assert (pulled, computed) == (0, prompt), (
        f"smg 1.13 with --backend vllm now moved {pulled} of {prompt} prompt tokens over NIXL "
        f"(decode computed {computed}): a smg that passes kv_transfer_params on is the PD router "
        "to use for vLLM; replace tests/real/pd_test_router.py with it"
    )
