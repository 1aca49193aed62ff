"""llama.cpp's own converter (convert_hf_to_gguf.py), run unchanged, with one run-time fallback.

    python llamacpp_convert.py LLAMA_CPP_SOURCE [convert_hf_to_gguf.py arguments...]

The converter names a BPE tokenizer's pre-tokenizer by hashing how the tokenizer splits a test
string and refuses a hash it does not know (`get_vocab_base_pre`), with no option to name one. With
SPECHEADS_GGUF_PRE set, an unknown hash gets that name instead (the caller picks it from
tokenizer.json, engine_facts.LLAMA_CPP_PRE_TOKENIZERS) and the line `SPECHEADS_PRE_FALLBACK=<name>` is
printed so the caller records it; a known hash keeps the converter's own answer. Nothing is edited on
disk. Runs under any Python with torch, transformers, safetensors and sentencepiece: no specheads
imports.
"""

from __future__ import annotations

import os
import runpy
import sys

MARKER = "SPECHEADS_PRE_FALLBACK="


def main() -> None:
    source, args = sys.argv[1], sys.argv[2:]
    fallback = os.environ.get("SPECHEADS_GGUF_PRE", "")
    sys.path.insert(0, os.path.join(source, "gguf-py"))  # the vendored gguf, as the converter itself does
    sys.path.insert(0, source)
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not fallback:
                raise
            print(f"{MARKER}{fallback}", file=sys.stderr, flush=True)
            return fallback

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = os.path.join(source, "convert_hf_to_gguf.py")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
