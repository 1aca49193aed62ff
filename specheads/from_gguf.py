"""`specheads target from-gguf`: a GGUF chat model -> an ordinary HF folder a head can train against.

transformers loads a GGUF file dequantised (it needs the `gguf` package), but refuses to
`save_pretrained` that model (its GGUF quantizer is not serialisable). So its state dict goes into
a fresh model built from the same config without `quantization_config` (tied embeddings kept),
which saves as safetensors beside the tokenizer and its chat template. The saved folder is
reloaded and its logits compared with the GGUF-loaded model's before the atomic rename.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specheads.atomic import atomic_dir

CHECK_TEXT = "The quick brown fox jumps over the lazy dog. def f(x):\n    return x + 1"


class GGUFError(ValueError):
    """The GGUF file cannot be converted (missing, unreadable, or the `gguf` package absent)."""


def _require_gguf():
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader imports it)
    except ImportError:
        raise GGUFError("reading GGUF needs the `gguf` package: pip install 'specheads[gguf]'") from None


def load_gguf(file: Path):
    """(model, tokenizer) dequantised to fp32 by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    if not file.is_file():
        raise GGUFError(f"{file}: no such GGUF file")
    try:
        tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as err:
        raise GGUFError(f"{file}: transformers cannot load it as a causal LM: {err}") from None
    return model.eval(), tok


def plain_copy(model):
    """The same weights in a fresh model whose config has no quantization_config (saveable)."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    # a tied output head is the embedding itself: absent from a tied state dict, nothing else may be
    missing = [k for k in missing if not (config.tie_word_embeddings and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise GGUFError(f"GGUF weights do not fit {type(fresh).__name__}: missing {missing[:4]}, "
                        f"unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        fresh.tie_weights()
    return fresh.eval()


@torch.no_grad()
def max_logit_difference(a, b, tok) -> float:
    """Largest |logit| difference of two models on CHECK_TEXT (0.0 for an exact copy)."""
    ids = torch.tensor([tok(CHECK_TEXT)["input_ids"]])  # [1, T]
    return (a(ids).logits - b(ids).logits).abs().max().item()


def convert(file: str | Path, out: str | Path, name: str | None = None, report=print) -> Path:
    """Write the HF folder for GGUF `file` at `out`; `name` (a hub id) is recorded as the target's
    `_name_or_path` so exports name their verifier after it, not after the local folder."""
    from transformers import AutoModelForCausalLM

    file, out = Path(file).expanduser(), Path(out).expanduser()
    src, tok = load_gguf(file)
    model = plain_copy(src)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _record_source(tmp, file, name)
        saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        diff = max_logit_difference(src, saved, tok)
        if diff != 0.0:
            raise GGUFError(f"{file}: the saved folder's logits differ from the GGUF model's by {diff:.3g}")
    report(f"[specheads] {file.name} -> {out}: {sum(p.numel() for p in model.parameters()):,} parameters, "
           f"vocab {model.config.vocab_size}, chat template {'kept' if tok.chat_template else 'absent'}, "
           "logits equal to the GGUF model's")
    return out


def _record_source(folder: Path, file: Path, name: str | None) -> None:
    """config.json `_name_or_path` = the hub id when given; the GGUF file name in specheads_source.json."""
    if name:
        cfg_path = folder / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["_name_or_path"] = name
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (folder / "specheads_source.json").write_text(json.dumps({"gguf_file": file.name, "name": name}, indent=2) + "\n")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="specheads target from-gguf",
                                description="Convert a GGUF chat model into a HF folder (fp32, chat template kept).")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("--out", required=True, help="folder to write (atomically)")
    p.add_argument("--name", default=None,
                   help="the model's hub id (e.g. HuggingFaceTB/SmolLM2-135M-Instruct), recorded for exports")
    a = p.parse_args(argv)
    print(convert(a.file, a.out, name=a.name))
    return 0
