"""A llama.cpp sidecar compared with the export it was converted from, and the faulted sidecars the
engine check must catch.

llama.cpp runs an EAGLE-3 GGUF whose aux layer ids are wrong without a word (the output stays
greedy-equal, only acceptance drops), so `sidecar_problems` reads what the GGUF records (its target
layers, its d2t map) with llama.cpp's own `gguf` reader and compares it with the export's config.json
and weights. `write_fault` writes a copy of a sidecar with one fault (FAULTS), for the engine check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np


def _gguf():
    import gguf  # llama.cpp's gguf-py (the converter's; importable wherever the converter runs)

    return gguf


def read_sidecar(path: Path) -> dict:
    """{arch, target_layers, d2t, tensors} of a GGUF (target_layers / d2t None when absent)."""
    reader = _gguf().GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    layers = reader.fields.get(f"{arch}.target_layers")
    tensors = {t.name: t for t in reader.tensors}
    d2t = np.array(tensors["d2t"].data).astype(np.int64).reshape(-1) if "d2t" in tensors else None
    return {"arch": arch, "target_layers": [int(x) for x in layers.contents()] if layers else None,
            "d2t": d2t, "tensors": sorted(tensors)}


def export_d2t(export_dir: Path) -> np.ndarray | None:
    """The export's draft -> target map as absolute target ids (the export stores offsets, the GGUF ids)."""
    from safetensors.numpy import load_file

    weights = load_file(str(Path(export_dir) / "model.safetensors"))
    if "d2t" not in weights:
        return None
    offsets = weights["d2t"].astype(np.int64).reshape(-1)
    return offsets + np.arange(len(offsets))


def sidecar_problems(gguf_path: Path, export_dir: Path) -> list[str]:
    """Where an EAGLE-3 sidecar disagrees with its export: aux layer ids, the d2t map ([] = none)."""
    facts, cfg = read_sidecar(gguf_path), json.loads((Path(export_dir) / "config.json").read_text())
    if facts["arch"] != "eagle3":
        return []
    problems = []
    want = [int(x) for x in cfg.get("eagle_aux_hidden_state_layer_ids") or []]
    if facts["target_layers"] != want:
        problems.append(f"{gguf_path}: eagle3.target_layers {facts['target_layers']} but the export's "
                        f"eagle_aux_hidden_state_layer_ids are {want} (llama.cpp would tap the wrong target layers "
                        "silently: outputs stay equal, acceptance drops)")
    d2t = export_d2t(export_dir)
    if d2t is not None and (facts["d2t"] is None or not np.array_equal(facts["d2t"], d2t)):
        bad = "missing" if facts["d2t"] is None else f"{int((facts['d2t'] != d2t).sum())} of {len(d2t)} entries differ"
        problems.append(f"{gguf_path}: d2t {bad} from the export's model.safetensors d2t")
    return problems


# --- faulted sidecars (the engine check must catch each) ---------------------------------------------
def rewrite(src: Path, dst: Path, rename: dict[str, str] | None = None, arrays: dict[str, list[int]] | None = None,
            tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the GGUF `src` at `dst`, with tensors renamed, integer-array fields and tensor data replaced."""
    gguf = _gguf()
    rename, arrays, tensors = rename or {}, arrays or {}, tensors or {}
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, arrays.get(name, field.contents()), field.types[0], sub)
    for t in reader.tensors:
        data = tensors.get(t.name, np.array(t.data))
        writer.add_tensor(rename.get(t.name, t.name), data.astype(np.array(t.data).dtype), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _renamed_tensor(src: Path, dst: Path) -> Path | None:
    name = next(n for n in read_sidecar(src)["tensors"] if n.endswith("attn_q.weight"))
    return rewrite(src, dst, rename={name: name.replace("attn_q", "attn_qq")})


def _wrong_d2t(src: Path, dst: Path) -> Path | None:
    """Two draft ids swap their target tokens (the GGUF stores target ids): still a valid map, so
    llama.cpp loads it. None: the sidecar drafts the whole vocabulary (no d2t to get wrong)."""
    d2t = read_sidecar(src)["d2t"]
    if d2t is None:
        return None
    ids = d2t.copy()
    ids[[0, 1]] = ids[[1, 0]]
    return rewrite(src, dst, tensors={"d2t": ids})


def _wrong_aux_layers(src: Path, dst: Path) -> Path | None:
    """Each aux layer id one lower (the off-by-one of SGLang's numbering): still 3 valid layers."""
    layers = read_sidecar(src)["target_layers"]
    return rewrite(src, dst, arrays={"eagle3.target_layers": [max(0, x - 1) for x in layers]})


# fault -> writes the faulted copy of src at dst (None: the fault does not apply to this sidecar)
FAULTS: dict[str, Callable[[Path, Path], Path | None]] = {
    "renamed-tensor": _renamed_tensor,
    "wrong-d2t": _wrong_d2t,
    "wrong-aux-layers": _wrong_aux_layers,
}
