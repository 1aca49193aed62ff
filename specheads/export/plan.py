"""What the writers share when they describe an export (protocols.ExportPlan): ExportRefused, the export
dtypes, casting, the weights' dtype name, the plan of a kind that is its own tensors plus a
config.json, and the local target folder a kind that ships target files copies from.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.export.contract_rules import CONFIG_FILE
from specheads.export.readme import looks_like_hub_id
from specheads.protocols import ExportPlan, ExportRequest
from specheads.target import resolve_target_path


class ExportRefused(ValueError):
    """This head cannot be served correctly in the requested format; the message says where it can."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # export dtypes
DTYPE_NAMES = {t: name for name, t in DTYPES.items()}


def check_dtype(dtype: str | None) -> None:
    """An export dtype is one of DTYPES (None keeps the checkpoint's)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype '{dtype}': expected one of {', '.join(DTYPES)}")


def cast(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """A floating tensor in `dtype` (None: unchanged); ids and masks never cast; contiguous, on CPU."""
    tensor = tensor.detach().cpu()
    return (tensor.to(DTYPES[dtype]) if dtype is not None and tensor.is_floating_point() else tensor).contiguous()


def float_dtype(tensors: dict[str, torch.Tensor]) -> str:
    """The name of the (single) floating dtype of the exported weights."""
    found = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(found) != 1:
        return "mixed"
    one = next(iter(found))
    return DTYPE_NAMES.get(one, str(one).removeprefix("torch."))


def head_plan(request: ExportRequest, export_tensors, config_json, **fields) -> ExportPlan:
    """The plan of a kind whose export is its own tensors and a config.json: `export_tensors(weights,
    fmt, dtype)` and `config_json(config, fmt, k, verifier, verifier_archs, dtype name)`."""
    tensors = export_tensors(request.ckpt.weights, request.fmt, request.dtype)
    target = request.target
    config = config_json(request.head.config, request.fmt, request.k, target.config_name, target.architectures,
                         float_dtype(tensors))
    return ExportPlan(config=config, tensors=tensors, **fields)


def target_folder(ckpt, verifier: str | None, why: str) -> Path:
    """The local target folder: `verifier` when it is one, else the recipe's target (else a hub-id
    `verifier`'s); refused with `why` (what the export takes from the target), naming --verifier,
    when none of them is one. A `verifier` meant as a folder (not shaped org/name) must be one."""
    if verifier and (Path(verifier).expanduser() / CONFIG_FILE).is_file():
        return Path(verifier).expanduser()
    if verifier and not looks_like_hub_id(verifier):
        local = Path(verifier).expanduser()
        state = ("does not exist" if not local.exists() else "is not a folder" if not local.is_dir()
                 else f"is a folder without {CONFIG_FILE}")
        raise ExportRefused(f"--verifier {verifier} {state}: {why}; pass the target's local Hugging Face folder "
                            "(or its hub id) as --verifier")
    path = (ckpt.recipe.get("target") or {}).get("path") or ""
    if not path and not verifier:
        raise ExportRefused(f"{why}: pass --verifier TARGET_FOLDER")
    try:
        return resolve_target_path(path or verifier)
    except ValueError as err:
        if not verifier or not path:  # the recipe's target, or (no recipe path) the hub id in --verifier
            named = f"--verifier {verifier}: " if verifier else ""
            raise ExportRefused(f"{named}{err}; {why}: pass the target's local folder as --verifier") from None
        try:  # the recipe's target is not here: the hub id the user named
            return resolve_target_path(verifier)
        except ValueError as hub_err:
            raise ExportRefused(f"--verifier {verifier}: {hub_err}; and the recipe's target.path '{path}' is not "
                                f"here either. {why}: pass the target's local folder as --verifier") from None
