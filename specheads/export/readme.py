"""Serve commands and the README.md of an export folder: how to run it in the engines of
`engine_facts`, with the commands its SERVING table gives per (kind, format).

Commands pass the method explicitly: vLLM only guesses EAGLE-3 from a path containing "eagle3"
(docs/engines.md §2.1), and SGLang needs the algorithm flag anyway.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specheads.engine_facts import (
    FORMATS,
    GGUF_FORMAT,
    GGUF_TITLE,
    LAUNCHERS,
    SERVING,
    SGLANG_DRAFT,
    VLLM,
    VLLM_SERVE_DIR,
    Serving,
    sglang_chain_flags,
)

RECOMMENDED = "## Recommended settings"  # the README section `specheads eval --attach` adds
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class TargetRef:
    """How the serve commands name the target: its hub id when known, else a local folder."""

    name: str  # what the training run called the target
    hub_id: str | None  # "org/name" that vLLM / SGLang can download
    local: str | None  # a local folder to serve instead (None: the user fills it in)
    architectures: list[str]

    @property
    def serve_as(self) -> str:
        """The hub id, else the local folder (absolute when it is here: a command must work from any
        directory), else a placeholder."""
        if self.hub_id:
            return self.hub_id
        if self.local and Path(self.local).expanduser().is_dir():
            return os.path.abspath(Path(self.local).expanduser())
        return self.local or f"/path/to/{self.name or 'target'}"

    @property
    def config_name(self) -> str:
        """The verifier's `name_or_path` in an engine config: the hub id, else the local folder as
        an absolute path (never its bare basename, which an engine would look up on the hub)."""
        if self.hub_id:
            return self.hub_id
        if self.local and Path(self.local).expanduser().is_dir():
            return str(Path(self.local).expanduser().resolve())
        return self.serve_as


def looks_like_hub_id(name: str | None) -> bool:
    """'org/name' that is not an existing local path."""
    return bool(name) and bool(HUB_ID.match(name)) and not Path(name).expanduser().exists()


def target_ref(provenance: dict, recipe: dict, verifier: str | None = None) -> TargetRef:
    """Resolve the target from `verifier` (hub id or local folder), the recorded name, the recipe path."""
    name = (provenance.get("target") or {}).get("name") or ""
    path = ((recipe.get("target") or {}).get("path") or "") if isinstance(recipe, dict) else ""
    local = path if path and not path.startswith("builtin:") else None
    hub = name if looks_like_hub_id(name) else None
    if verifier:
        hub, local = (verifier, local) if looks_like_hub_id(verifier) else (hub, verifier)
    return TargetRef(name=name, hub_id=hub, local=local, architectures=_architectures(local))


def _architectures(local: str | None) -> list[str]:
    """The target's architectures from its local config.json, when that folder is here."""
    try:
        return list(json.loads((Path(local).expanduser() / "config.json").read_text()).get("architectures") or [])
    except (TypeError, OSError, json.JSONDecodeError, AttributeError):
        return []


def serve_command(serving: Serving, folder: str, served: str, k: int, parallel: bool = False) -> str:
    """One command line of `serving`'s launcher (engine_facts.LAUNCHERS) for the export at `folder`,
    serving `served`, drafting k tokens (P-EAGLE heads add parallel_drafting to vLLM's config)."""
    q = shlex.quote
    spec = {"method": serving.method, **({"model": folder} if serving.draft else {}), "num_speculative_tokens": k}
    spec = json.dumps({**spec, "parallel_drafting": True} if parallel else spec, separators=(",", ":"))
    cmd = LAUNCHERS[serving.launcher].format(served=q(served), folder=q(folder), spec=q(spec), method=serving.method)
    if serving.launcher == "sglang" and serving.draft:
        cmd += SGLANG_DRAFT.format(folder=q(folder))
    if serving.launcher == "sglang" and serving.chain:  # topk 1, k steps, k + 1 tokens verified per step
        cmd += " " + sglang_chain_flags(k)
    return cmd


def serve_commands(fmt: str, folder: str | Path, target: TargetRef, k: int, kind: str,
                   parallel: bool = False, served: str | None = None) -> list[str]:
    """The exact commands that serve the export, best first (engine_facts.SERVING says how);
    `served` overrides the model served (Medusa-2: the merged target)."""
    folder, serving = str(folder), SERVING[(kind, fmt)]
    served = served or (folder if serving.serves == "export" else target.serve_as)
    cmds = [serve_command(serving, folder, served, k, parallel)]
    if serving.serve_dir and target.hub_id:  # the config names a hub verifier: `vllm serve DIR` works
        cmds.insert(0, VLLM_SERVE_DIR.format(folder=shlex.quote(folder)))
    return cmds


@dataclass(frozen=True)
class Readme:
    """What an export's README says of its kind: the heading's name and the Head section's lines."""

    name: str  # "EAGLE-3 draft"
    head_lines: Callable[[str, dict], list[str]]  # (format, head_config) -> the Head section's lines
    serve_notes: bool = False  # explain how the serve commands name the target (speculators configs)


def notes(fmt: str, target: TargetRef) -> list[str]:
    """Why the commands look the way they do, for this format and target."""
    out = []
    if fmt == "vllm" and not target.hub_id:
        out.append(f"The target is not a Hugging Face hub id, and {VLLM} rejects a local verifier in "
                   "`vllm serve DIR` (\"Speculators verifier must name a remote model repository\"). "
                   "Serve the local target and pass this folder in `--speculative-config`: vLLM still "
                   "parses its speculators config.")
    if fmt == "vllm" and target.hub_id:
        out.append(f"`vllm serve DIR` serves the verifier `{target.hub_id}` named in config.json with this "
                   "draft; the second form does the same with an explicit target.")
    if not target.hub_id and not target.local:
        out.append(f"Replace `{target.serve_as}` with the local folder of the target `{target.name}` the "
                   "head was trained on (same tokenizer and embeddings).")
    if fmt == "sglang":
        out.append("`--speculative-num-steps` is the draft length k; SGLang verifies k + 1 tokens per step.")
    return out


def readme_title(fmt: str, kind: str) -> str:
    """The engine and format named in the README's heading (speculators: EAGLE-3 in `vllm` only)."""
    if fmt == GGUF_FORMAT:
        return GGUF_TITLE
    return SERVING[(kind, fmt)].title or FORMATS[fmt].title


def readme_text(fmt: str, readme: Readme, commands: list[str], target: TargetRef, meta: dict) -> str:
    """README.md: what this folder is (the writer's `readme`), how to serve it, where it came from."""
    head, kind = meta["head_config"], meta["kind"]
    cmd_block = "\n\n".join(commands)
    title = readme_title(fmt, kind)
    lines = [
        f"# {readme.name} for `{target.name or target.serve_as}` ({title})",
        "",
        f"Exported by specheads {meta['specheads_version']} from checkpoint `{meta['checkpoint']}`.",
        "",
        "## Serve",
        "",
        "```bash",
        cmd_block,
        "```",
        "",
        *[f"- {n}" for n in (notes(fmt, target) if readme.serve_notes else [])],
        "",
        "## Head",
        "",
        *readme.head_lines(fmt, head),
        f"- weights: {meta['dtype']}",
        "",
        "`specheads.json` records the export format, the engine versions targeted, the training "
        "provenance and the target fingerprint (a verifier refuses a target whose vocabulary differs).",
        "",
    ]
    return "\n".join(lines)
