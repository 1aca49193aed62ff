"""Medusa-2 export: the Medusa heads (formats of export/medusa.py) plus the target's LoRA adapters.

`adapter="merge"` (default) also writes `target/`: the target checkpoint with the LoRA merged into
its weights (safetensors + config + tokenizer), the verifier to serve the heads with.
`adapter="ship"` writes `adapter/` instead: a peft adapter folder (adapter_config.json +
adapter_model.safetensors, written by peft) to apply to the base target. specheads.json records the
choice under "adapter"; the README says how to serve it. The heads themselves are Medusa-1 heads.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import torch

from specheads.export import medusa
from specheads.export.plan import DTYPES, ExportRefused, float_dtype, target_folder
from specheads.export.readme import Readme
from specheads.heads.medusa2 import ADAPTER
from specheads.protocols import ExportPlan, ExportRequest

FORMATS_WRITTEN = medusa.FORMATS_WRITTEN
WEIGHTS_FILES = medusa.WEIGHTS_FILES
validate = medusa.validate  # the heads are Medusa-1 heads
ADAPTER_MODES = ("merge", "ship")
FOLDERS = {"merge": "target", "ship": "adapter"}  # subfolder of the export per mode


def check_exportable(config, fmt: str, weights: dict) -> None:
    """The heads export like Medusa-1's; the adapter goes into target/ or adapter/."""


def heads_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the Medusa heads' own names (the `medusa.` prefix dropped)."""
    return {n[len("medusa."):]: t for n, t in weights.items() if n.startswith("medusa.")}


def peft_model(head, base_dir: Path, dtype: torch.dtype = torch.float32):
    """The base target from `base_dir` with this head's LoRA loaded through peft (a PeftModel)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

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
    model = peft_model(head, base_dir)
    model.peft_config[ADAPTER].base_model_name_or_path = base_name
    model.save_pretrained(out, safe_serialization=True)


def merge_command(out: Path, base: str) -> str:
    """The command that merges a shipped adapter into the base target, as target/ beside the heads."""
    merged = str(out / FOLDERS["merge"])
    return "python -c " + shlex.quote(
        "from peft import PeftModel; from transformers import AutoModelForCausalLM as M, "
        f"AutoTokenizer as T; b = M.from_pretrained({base!r}); "
        f"PeftModel.from_pretrained(b, {str(out / FOLDERS['ship'])!r}).merge_and_unload()"
        f".save_pretrained({merged!r}); T.from_pretrained({base!r}).save_pretrained({merged!r})")


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


def plan(request: ExportRequest) -> ExportPlan:
    """Heads (as Medusa-1 in the format) + target/ (merged) or adapter/ (peft); the verifier named in
    config.json and served is the adapted target, target/."""
    ckpt, head, fmt, out = request.ckpt, request.head, request.fmt, request.out_dir
    adapter = request.adapter or "merge"
    base_dir = target_folder(ckpt, request.verifier, "a Medusa-2 export needs the base target (to merge into or to "
                             "name in the adapter)")
    base_name = request.target.hub_id or str(base_dir)
    tensors = medusa.export_tensors(heads_weights(ckpt.weights), fmt, request.dtype)
    merged = str(out / FOLDERS["merge"])  # the verifier the heads were trained for is the adapted target
    config = medusa.config_json(head.config.medusa_config(), fmt, request.k, merged, request.target.architectures,
                                float_dtype(tensors))
    if adapter == "merge":
        write = {FOLDERS[adapter]: lambda path: write_merged(head, base_dir, path, request.dtype)}
    else:
        write = {FOLDERS[adapter]: lambda path: write_adapter(head, base_dir, path, base_name)}
    record = {"adapter": {"mode": adapter, "folder": FOLDERS[adapter], "base_target": base_name,
                          "verifier": "the merged target in target/" if adapter == "merge"
                          else "the base target with the peft adapter in adapter/ applied"}}
    return ExportPlan(config=config, tensors=tensors, weights_file=WEIGHTS_FILES[fmt], written=write, record=record,
                      serve_as=merged, serve_prefix=[] if adapter == "merge" else [merge_command(out, base_name)],
                      readme_extra=adapter_section(adapter, base_name), expected=head.config.medusa_config())


def load_export(meta, attn_implementation: str = "sdpa", check: bool = True):
    """A Medusa-2 export -> (Medusa heads in eval mode, meta); the verifier is target/ (merge) or
    base + adapter/ (ship), as meta.record["adapter"] says."""
    return medusa.load_export(meta, attn_implementation, check)


def readme_lines(fmt: str, head: dict) -> list[str]:
    """The README's Head section: Medusa's lines and the LoRA it was trained with."""
    return [*medusa.readme_lines(fmt, head), f"- trained jointly with LoRA (r {head['lora_r']}, alpha "
            f"{head['lora_alpha']}) on {len(head['lora_modules'])} target projections, self-distillation "
            f"weight {head['distill_weight']}; see Adapter below for the verifier to use"]


README = Readme("Medusa-2 heads (trained with LoRA on the target)", readme_lines)
