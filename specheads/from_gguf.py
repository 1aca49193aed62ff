"""`specheads target from-gguf`: a GGUF chat model -> an ordinary HF folder a head can train against.

transformers loads a GGUF file dequantised (it needs the `gguf` package), but refuses to
`save_pretrained` that model (its GGUF quantizer is not serialisable). So its state dict goes into
a fresh model built from the same config without `quantization_config` (tied embeddings kept),
which saves as safetensors beside the tokenizer and its chat template. The saved folder is
reloaded and its logits compared with the GGUF-loaded model's before the atomic rename.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from specheads.atomic import OutputRefused, atomic_dir, describe_contents, is_empty_dir
from specheads.cli_parsers import from_gguf_parser

CHECK_TEXT = "The quick brown fox jumps over the lazy dog. def f(x):\n    return x + 1"


class GGUFError(ValueError):
    """The GGUF file cannot be converted (missing, unreadable, or the `gguf` package absent)."""


def _require_gguf():
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader imports it)
    except ImportError:
        raise GGUFError("reading GGUF needs the `gguf` package: pip install 'specheads[gguf]'") from None


# --- the file's own extent: header, tensor table, data (GGUF v2/v3), read before anything loads ---
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class _Truncated(Exception):
    pass


class _Header:
    """Sequential reads of a GGUF header; running past the end of the file raises _Truncated."""

    def __init__(self, fh, size: int, endian: str):
        self.fh, self.size, self.endian = fh, size, endian

    def take(self, n: int) -> bytes:
        data = self.fh.read(n) if n <= self.size else b""
        if len(data) < n:
            raise _Truncated
        return data

    def num(self, fmt: str):
        return struct.unpack(self.endian + fmt, self.take(struct.calcsize(fmt)))[0]

    def skip(self, n: int) -> None:
        if self.fh.tell() + n > self.size:
            raise _Truncated
        self.fh.seek(n, 1)

    def value(self, kind: int):
        """One metadata value (arrays of fixed-size items are skipped, not read)."""
        if kind in SCALARS:
            return self.num(SCALARS[kind])
        if kind == STRING:
            return self.take(self.num("Q"))
        if kind != ARRAY:
            raise ValueError(f"unknown metadata type {kind}")
        item, count = self.num("I"), self.num("Q")
        if item in SCALARS:
            return self.skip(count * struct.calcsize(SCALARS[item]))
        for _ in range(count):
            self.value(item)
        return None


def tensor_data_end(h: _Header) -> tuple[int, int]:
    """(bytes the file needs: the end of its last tensor's data, number of tensors) from the header."""
    from gguf.constants import GGML_QUANT_SIZES

    version = h.num("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
    tensors, kvs = h.num("Q"), h.num("Q")
    alignment = 32
    for _ in range(kvs):
        key, value = h.take(h.num("Q")), h.value(h.num("I"))
        alignment = value if key == b"general.alignment" and isinstance(value, int) and value > 0 else alignment
    end = 0
    for _ in range(tensors):
        h.take(h.num("Q"))
        dims = [h.num("Q") for _ in range(h.num("I"))]
        kind, offset = h.num("I"), h.num("Q")
        if kind not in GGML_QUANT_SIZES:
            raise ValueError(f"unknown tensor type {kind}")
        block, nbytes = GGML_QUANT_SIZES[kind]
        end = max(end, offset + math.prod(dims) // block * nbytes)
    start = -(-h.fh.tell() // alignment) * alignment  # the data section starts aligned after the table
    return start + end, tensors


def check_extent(file: Path) -> None:
    """Refuse a GGUF file cut short (a partial download or copy) by name, before transformers reads
    it: the header must parse within the file, and the file must hold every tensor's data."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        magic = fh.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{file}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        endian = "<" if struct.unpack("<I", fh.read(4).ljust(4, b"\0"))[0] < 0x10000 else ">"
        fh.seek(4)
        try:
            need, tensors = tensor_data_end(_Header(fh, size, endian))
        except _Truncated:
            raise GGUFError(f"{file}: truncated: the file ends ({size:,} bytes) inside its header, before the "
                            "tensor data; download or copy it again") from None
        except (ValueError, OverflowError) as err:
            raise GGUFError(f"{file}: not a GGUF file we can read ({err})") from None
    if need > size:
        raise GGUFError(f"{file}: truncated: its {tensors} tensors need {need:,} bytes but the file has {size:,} "
                        f"({need - size:,} missing); download or copy it again")


def load_gguf(file: Path):
    """(model, tokenizer) dequantised to fp32 by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _require_gguf()
    if not file.is_file():
        raise GGUFError(f"{file}: no such GGUF file")
    check_extent(file)
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
    check_out(out)  # before minutes of loading a large GGUF
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


def check_out(out: Path) -> None:
    """--out must be absent or an empty folder (the conversion is written there atomically)."""
    if not out.exists() and not out.is_symlink():
        return
    if is_empty_dir(out):
        return
    held = describe_contents(out) if out.is_dir() and not out.is_symlink() else "a file"
    raise OutputRefused(f"--out {out} already exists ({held}). Nothing was read or changed: choose a new --out, "
                        "or move or remove it yourself")


def _record_source(folder: Path, file: Path, name: str | None) -> None:
    """config.json `_name_or_path` = the hub id when given; the GGUF file name in specheads_source.json."""
    if name:
        cfg_path = folder / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["_name_or_path"] = name
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (folder / "specheads_source.json").write_text(json.dumps({"gguf_file": file.name, "name": name}, indent=2) + "\n")


def main(argv: list[str]) -> int:
    p = from_gguf_parser()
    a = p.parse_args(argv)
    print(convert(a.file, a.out, name=a.name))
    return 0
