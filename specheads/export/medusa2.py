"""Medusa-2 export: the Medusa heads (formats of export/medusa.py) plus the target's LoRA adapters.

`adapter="merge"` (default) also writes `target/`: the target checkpoint with the LoRA merged into
its weights (safetensors + config + tokenizer), the verifier to serve the heads with.
`adapter="ship"` writes `adapter/` instead: a peft adapter folder (adapter_config.json +
adapter_model.safetensors, written by peft) to apply to the base target. specheads.json records the
choice under "adapter"; the README says how to serve it. The heads themselves are Medusa-1 heads.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from specheads.export import medusa
from specheads.export.contract_rules import CONFIG_FILE, META_FILE
from specheads.export.eagle3 import DTYPES, ExportRefused

FORMATS = medusa.FORMATS
REFUSED = medusa.REFUSED
WEIGHTS_FILES = medusa.WEIGHTS_FILES
ADAPTER_MODES = ("merge", "ship")
FOLDERS = {"merge": "target", "ship": "adapter"}  # subfolder of the export per mode


def check_exportable(config, fmt: str, weights: dict) -> None:
    """The heads export like Medusa-1's; the adapter goes into target/ or adapter/."""


def heads_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the Medusa heads' own names (the `medusa.` prefix dropped)."""
    return {n[len("medusa."):]: t for n, t in weights.items() if n.startswith("medusa.")}


def target_folder(ckpt, verifier: str | None) -> Path:
    """The base target to merge into / to name: `verifier` when it is a local folder, else the recipe's."""
    from specheads.target import resolve_target_path

    if verifier and (Path(verifier).expanduser() / CONFIG_FILE).is_file():
        return Path(verifier).expanduser()
    path = (ckpt.recipe.get("target") or {}).get("path") or ""
    if not path:
        raise ExportRefused("a Medusa-2 export needs the base target (to merge into or to name in the adapter): "
                            "pass --verifier TARGET_FOLDER")
    return resolve_target_path(path)


def peft_model(head, base_dir: Path, dtype: torch.dtype = torch.float32):
    """The base target from `base_dir` with this head's LoRA loaded through peft (a PeftModel)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from specheads.heads.medusa2 import ADAPTER

    cfg = head.config
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, bias="none",
                      target_modules=list(cfg.lora_modules))
    model = get_peft_model(base, lora, adapter_name=ADAPTER)
    state = {n: t.detach().to(dtype) for n, t in head.lora_state().items()}
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ExportRefused(f"{base_dir}: peft did not place LoRA tensors {unexpected[:3]}: the target's module "
                            "names differ from the trained adapters'; pass the target the heads were trained on")
    return model.eval()


def write_merged(head, base_dir: Path, out: Path, dtype: str | None) -> None:
    """out/: the base target with the LoRA merged in (float32 merge, then the export dtype)."""
    from transformers import AutoConfig, AutoTokenizer

    stored = getattr(AutoConfig.from_pretrained(base_dir), "dtype", None)
    final = DTYPES[dtype] if dtype else (stored if isinstance(stored, torch.dtype) else torch.float32)
    merged = peft_model(head, base_dir).merge_and_unload().to(final)
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)


def write_adapter(head, base_dir: Path, out: Path, base_name: str) -> None:
    """out/: adapter_config.json + adapter_model.safetensors as peft writes them."""
    from specheads.heads.medusa2 import ADAPTER

    model = peft_model(head, base_dir)
    model.peft_config[ADAPTER].base_model_name_or_path = base_name
    model.save_pretrained(out, safe_serialization=True)


def serve_lines(fmt: str, out: Path, adapter: str, base: str, k: int) -> list[str]:
    """How to serve: the merged target with the heads (ship: merge with peft first)."""
    q, merged = shlex.quote, str(out / "target")
    spec = json.dumps({"method": "medusa", "model": str(out), "num_speculative_tokens": k}, separators=(",", ":"))
    serve = (f"vllm serve {q(merged)} --speculative-config {q(spec)}" if fmt == "vllm-0.32"
             else f"python -m medusa.inference.cli --model {q(str(out))}")
    if adapter == "merge":
        return [serve]
    merge = ("python -c " + q("from peft import PeftModel; from transformers import AutoModelForCausalLM as M, "
                              f"AutoTokenizer as T; b = M.from_pretrained({base!r}); "
                              f"PeftModel.from_pretrained(b, {str(out / 'adapter')!r}).merge_and_unload()"
                              f".save_pretrained({merged!r}); T.from_pretrained({base!r}).save_pretrained({merged!r})"))
    return [merge, serve]


def adapter_section(adapter: str, base: str) -> str:
    """README lines that say which adapter mode this export is and what the verifier must be."""
    if adapter == "merge":
        what = ("`target/` is the target with the Medusa-2 LoRA adapters **merged** into its weights. Serve "
                "`target/` as the verifier: the heads were trained on the adapted target, and the merged "
                "target is the model whose outputs speculative decoding reproduces.")
    else:
        what = (f"`adapter/` is a peft LoRA adapter (**shipped**, not merged) for the base target `{base}`. "
                "The verifier must be base + adapter: merge it as the first command does (or load it with "
                "`PeftModel.from_pretrained`); with the plain base target the heads propose for a model that "
                "is not the one verifying.")
    return "\n## Adapter\n\n" + what + "\n"


def export_folder(ckpt, fmt: str, tmp: Path, out_dir: Path, num_speculative_tokens: int | None, verifier: str | None,
                  dtype: str | None, adapter: str = "merge") -> Path:
    """Heads (as Medusa-1 in `fmt`) + target/ (merged) or adapter/ (peft), validated, into `tmp`, the
    atomic folder that becomes `out_dir` (export/folder.py)."""
    from safetensors.torch import save_file

    from specheads.export import _write_json, export_record, float_dtype
    from specheads.export.readme import readme_text, target_ref

    if adapter not in ADAPTER_MODES:
        raise ValueError(f"adapter '{adapter}': expected one of {', '.join(ADAPTER_MODES)}")
    head = ckpt.build_head()
    k = head.config.num_heads if num_speculative_tokens is None else num_speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_speculative_tokens {k!r}: expected a positive integer")
    base_dir = target_folder(ckpt, verifier)
    target = target_ref(ckpt.provenance, ckpt.recipe, verifier)
    base_name = target.hub_id or str(base_dir)
    tensors = medusa.export_tensors(heads_weights(ckpt.weights), fmt, dtype)
    record = export_record(ckpt, head.config, fmt, k, target, float_dtype(tensors))
    record["adapter"] = {"mode": adapter, "folder": FOLDERS[adapter], "base_target": base_name,
                         "verifier": "the merged target in target/" if adapter == "merge"
                         else "the base target with the peft adapter in adapter/ applied"}
    record["serve_commands"] = serve_lines(fmt, out_dir, adapter, base_name, k)
    verifier_name = str(out_dir / "target")  # the verifier the heads were trained for is the adapted target
    config = medusa.config_json(head.config.medusa_config(), fmt, k, verifier_name, target.architectures,
                                record["dtype"])
    save_file(tensors, str(tmp / WEIGHTS_FILES[fmt]), metadata={"format": "pt"})
    _write_json(tmp / CONFIG_FILE, config)
    _write_json(tmp / META_FILE, record)
    readme = readme_text(fmt, out_dir, record["serve_commands"], target, record)
    (tmp / "README.md").write_text(readme + adapter_section(adapter, base_name))
    if adapter == "merge":
        write_merged(head, base_dir, tmp / "target", dtype)
    else:
        write_adapter(head, base_dir, tmp / "adapter", base_name)
    medusa.validate(tmp, fmt, expected=head.config.medusa_config())
    return out_dir


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True):
    """A Medusa-2 export -> (Medusa heads in eval mode, meta); the verifier is target/ (merge) or
    base + adapter/ (ship), as meta.record["adapter"] says."""
    return medusa.load_export(meta, attn_implementation, check)
