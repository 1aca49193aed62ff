"""`specheads push EXPORT_DIR --repo ID`: publish an export folder with a generated model card.

The card (the repository's README.md) is built from the export's own files: specheads.json
(format, head, provenance, target fingerprint), README.md (serve commands, recommended settings)
and eval/metrics.json (written by `specheads eval --attach`). A folder without metrics, or whose
speculative output was not identical to plain greedy decoding, is refused. The token comes from
HF_TOKEN or the cached `hf auth login`; it is never printed or written anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from contextlib import contextmanager
from pathlib import Path

import yaml

from specheads.cli_parsers import push_parser
from specheads.errors import first_line, is_network_error, read_user_text
from specheads.eval.predict import advice_summary
from specheads.eval_identity import KEY, eval_mismatch, history_warning

METRICS = Path("eval") / "metrics.json"
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
META = "specheads.json"
log = logging.getLogger(__name__)


class PushError(ValueError):
    """An export folder that cannot be pushed (the message says what to run first)."""


def read_export(export_dir: str | Path) -> tuple[dict, dict, str]:
    """(specheads.json, eval/metrics.json, README.md text) of an export, refusing incomplete ones."""
    folder = Path(export_dir)
    if not (folder / META).is_file():
        raise PushError(f"'{folder}' is not an export folder ({META} missing): run `specheads export` first")
    metrics_path = folder / METRICS
    if not metrics_path.is_file():
        raise PushError(f"'{folder}' has no {METRICS.as_posix()}: measure it first with `specheads eval "
                        f"--draft {folder} ... --attach` (a card without measured acceptance is not published)")
    metrics = _read_json(metrics_path)
    if metrics.get("greedy_equal") is False:
        raise PushError(f"{metrics_path}: speculative output differed from plain greedy decoding "
                        f"(prompts {metrics.get('mismatched_ids')}); fix the export before publishing it")
    check_measured_weights(metrics, folder, metrics_path)
    readme = read_user_text(folder / "README.md", "README", PushError) if (folder / "README.md").is_file() else ""
    return _read_json(folder / META), metrics, readme


def check_measured_weights(metrics: dict, folder: Path, metrics_path: Path) -> None:
    """Refuse an eval of other weights (e.g. copied from another export), naming both hashes; one that
    records none (an older specheads) is pushed with a warning."""
    mismatch = eval_mismatch(metrics, folder, metrics_path)
    if mismatch is None:
        return
    other, why = mismatch
    if other:
        raise PushError(f"{why}; the card would publish another drafter's numbers")
    log.warning("%s", why)


def _read_json(path: Path) -> dict:
    """A JSON object of the export, or a PushError naming the file."""
    try:
        obj = json.loads(read_user_text(path, "export file", PushError))
    except json.JSONDecodeError as err:
        raise PushError(f"{path}: not valid JSON ({err.msg}, line {err.lineno}); rewrite it with "
                        "`specheads export` / `specheads eval --attach`") from None
    if not isinstance(obj, dict):
        raise PushError(f"{path}: expected a JSON object")
    return obj


def front_matter(meta: dict, license_id: str, base_model: str | None = None) -> str:
    """The card's YAML header: license (the target's), tags, the base model when it is a hub id."""
    hub_id = base_model or (meta.get("verifier") or {}).get("hub_id")
    lines = ["---", "library_name: specheads", f"license: {license_id}", "tags:", "- speculative-decoding",
             f"- {meta.get('kind', 'draft')}", f"- {meta.get('engine', {}).get('name', meta.get('format', 'engine'))}"]
    if hub_id:
        lines += [f"base_model: {hub_id}", "base_model_relation: adapter"]
    return "\n".join(lines + ["---", ""])


def metrics_section(metrics: dict) -> list[str]:
    """Measured numbers: tau, acceptance per position, speed-ups, the prompts and device used."""
    spec = metrics.get("speculative") or {}
    prov = metrics.get("provenance") or {}
    acc = " / ".join(f"{a:.2f}" for a in spec.get("acceptance_per_position", []))
    lines = ["## Measured acceptance", "",
             f"Built-in verifier, {metrics.get('num_prompts')} prompts from `{Path(str(prov.get('prompts_file', '?'))).name}`, "
             f"draft shape {json.dumps(metrics.get('tree'))}, {prov.get('device', '?')} {prov.get('dtype', '')}, "
             f"greedy output identical to plain decoding: {metrics.get('greedy_equal')}.", "",
             "| tau (bonus included) | acceptance per position | measured speed-up | n-gram baseline tau | "
             "suffix decoding tau |",
             "|---:|---|---:|---:|---:|",
             f"| {metrics.get('tau', 0):.3f} | {acc} | {spec.get('measured_speedup', 0):.2f}x | "
             f"{(metrics.get('ngram') or {}).get('tau', float('nan')):.3f} | "
             f"{(metrics.get('suffix') or {}).get('tau', float('nan')):.3f} |", ""]
    adv = metrics.get("advice")
    if adv:
        lines += [f"Recommended on that hardware: {advice_summary(adv)}.", ""]
    weights = (metrics.get(KEY) or {}).get("sha256")
    if weights:
        lines += [f"Measured with these weights (sha256 of their checksums: `{weights[:16]}…`).", ""]
    flag = history_warning(metrics)
    if flag:
        lines += [f"> **Warning:** {flag}.", ""]
    return lines


def provenance_section(meta: dict) -> list[str]:
    """Where the head came from: versions, checkpoint, git SHA, target fingerprint."""
    prov = meta.get("checkpoint_provenance") or {}
    target = meta.get("target") or {}
    return ["## Provenance", "",
            f"- specheads {meta.get('specheads_version')}, checkpoint `{meta.get('checkpoint')}` "
            f"(step {meta.get('checkpoint_step')}), git {str(prov.get('git_sha') or 'unknown')[:12]}",
            f"- engine {meta.get('engine', {}).get('name')} {meta.get('engine', {}).get('version')}, "
            f"format `{meta.get('format')}`, weights {meta.get('dtype')}",
            f"- target `{target.get('name')}`: vocabulary {target.get('vocab_size')}, hidden {target.get('hidden_size')}, "
            f"{target.get('num_layers')} layers, tokenizer sha256 {str(target.get('tokenizer_sha256'))[:16]}…, "
            + (f"embedding sha256 {str(target['embedding_sha256'])[:16]}…" if "embedding_sha256" in target
               else f"embedding sketch of {len(target.get('embedding_sketch') or [])} rows"), ""]


def model_card(export_dir: str | Path, repo_id: str | None = None, license_id: str | None = None,
               base_model: str | None = None) -> str:
    """The generated README.md of the hub repository `repo_id`: its serve commands name the repository
    (and `base_model`, the target's hub id, when given); the licence is `license_id`, else the target's."""
    meta, metrics, readme = read_export(export_dir)
    targets = served_targets(meta)
    license_id = license_id or target_license(meta, targets, base_model)
    readme = card_readme(readme, meta, Path(export_dir), repo_id, base_model, targets) if repo_id else readme
    body = readme.strip("\n") + "\n\n" if readme else ""
    return (front_matter(meta, license_id, base_model) + "\n" + body
            + "\n".join(metrics_section(metrics) + provenance_section(meta)))


# --- the card's serve commands, title and licence ------------------------------------------------------
def _command_tokens(meta: dict) -> list[list[str]]:
    """The export's serve commands (specheads.json), split as a shell would; a JSON spec's "model" added."""
    out = []
    for cmd in meta.get("serve_commands") or []:
        try:
            tokens = shlex.split(cmd)
        except ValueError:
            continue
        specs = [json.loads(t) for t in tokens if t.startswith("{") and _is_json(t)]
        out.append(tokens + [str(sp["model"]) for sp in specs if isinstance(sp, dict) and sp.get("model")])
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def served_targets(meta: dict) -> list[str]:
    """The target as the serve commands name it (`vllm serve X`, `--model-path X`): a local path or a
    placeholder; hub ids left out (they already work anywhere)."""
    hub = (meta.get("verifier") or {}).get("hub_id")
    found = []
    for tokens in _command_tokens(meta):
        for flag in ("serve", "--model-path"):
            if flag in tokens[:-1]:
                tok = tokens[tokens.index(flag) + 1]
                if tok != hub and tok not in found:
                    found.append(tok)
    return found


def _export_strings(meta: dict, export_dir: Path) -> list[str]:
    """How the serve commands name the export folder (a relative or absolute path of `export_dir`)."""
    here = export_dir.resolve()
    return sorted({t for tokens in _command_tokens(meta) for t in tokens
                   if not t.startswith("-") and "/" in t and _same_dir(t, here)}, key=len, reverse=True)


def _same_dir(text: str, folder: Path) -> bool:
    try:
        return Path(text).expanduser().resolve() == folder
    except (OSError, ValueError):
        return False


def card_readme(readme: str, meta: dict, export_dir: Path, repo_id: str, base_model: str | None,
                targets: list[str]) -> str:
    """The export's README for the hub: the export folder named by `repo_id` in the serve commands, the
    target by `base_model` (else its absolute path), the title naming the repository."""
    for folder in _export_strings(meta, export_dir):
        readme = readme.replace(folder, repo_id)
    for target in targets:
        local = Path(target).expanduser()
        where = base_model or (os.path.abspath(local) if local.is_dir() else None)
        if where and where != target:
            readme = re.sub(rf"(?<![\w./-]){re.escape(target)}(?![\w./-])", where, readme)
    lines = readme.split("\n")
    if lines and lines[0].startswith("# "):  # the export's title names the target folder: the repository first
        lines[0:1] = [f"# {repo_id}", "", lines[0][2:].strip() + "."]
    return "\n".join(lines)


def target_license(meta: dict, targets: list[str], base_model: str | None) -> str:
    """The target's licence: the `license:` of its model card (a local folder the serve commands name,
    or the hub id's card in the cache); else a PushError asking for --license."""
    hub_id = base_model or (meta.get("verifier") or {}).get("hub_id")
    cards = [Path(t).expanduser() / "README.md" for t in targets] + ([_cached_card(hub_id)] if hub_id else [])
    for card in cards:
        found = card_license(card) if card is not None else None
        if found:
            return found
    name = hub_id or (meta.get("verifier") or {}).get("name") or "the target"
    looked = ", ".join(str(c) for c in cards if c is not None) or "no model card of the target was found"
    raise PushError(f"the licence of {name} is unknown (no `license:` in its model card; looked at: {looked}); "
                    "pass --license ID with the target's licence (e.g. apache-2.0, llama3.1, gemma, other): the "
                    "drafter is trained on its outputs and published beside it")


def card_license(readme: Path) -> str | None:
    """`license:` of a model card's YAML front matter, None when it has none."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    match = re.match(r"---\s*\n(.*?)\n---\s*\n", text, re.S)
    try:
        data = yaml.safe_load(match.group(1)) if match else None
    except yaml.YAMLError:
        return None
    value = data.get("license") if isinstance(data, dict) else None
    return str(value) if value else None


def _cached_card(hub_id: str) -> Path | None:
    """The hub id's README.md from the hub cache (never downloaded here)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(hub_id, "README.md")
    return Path(found) if isinstance(found, str) else None


def upload_plan(export_dir: str | Path) -> list[tuple[str, Path | None]]:
    """(path in repo, local file) for every file pushed; README.md is the generated card (None)."""
    folder = Path(export_dir)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    plan = [(p.relative_to(folder).as_posix(), p) for p in files if p.relative_to(folder).as_posix() != "README.md"]
    return [("README.md", None), *plan]


@contextmanager
def hub_errors(repo_id: str, endpoint: str):
    """The hub's failures as one PushError line: no network, no login, no access, refused."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        yield
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            raise PushError(f"the hub at {endpoint} refused {repo_id} (HTTP {status}): set HF_TOKEN or run "
                            "`hf auth login` with a token that can write to it") from None
        raise PushError(f"the hub at {endpoint} refused the upload to {repo_id}: "
                        f"{str(err).splitlines()[0]}") from None
    except Exception as err:  # noqa: BLE001 - only connection failures are turned into a message
        if not is_network_error(err):
            raise
        raise PushError(f"cannot reach the hub at {endpoint} ({type(err).__name__}: {first_line(err)}); "
                        "nothing was uploaded: check the network or HF_ENDPOINT (--dry-run shows the card)") from None


def push(export_dir: str | Path, repo_id: str, private: bool = False, dry_run: bool = False,
         endpoint: str | None = None, out=print, license_id: str | None = None,
         base_model: str | None = None) -> str | None:
    """Create the repo (if needed) and commit the export with its card; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    if not REPO_ID.match(repo_id):
        raise PushError(f"--repo '{repo_id}': expected a hub id such as org/name-eagle3")
    if base_model and not REPO_ID.match(base_model):
        raise PushError(f"--base-model '{base_model}': expected the target's hub id, such as org/name")
    card = model_card(export_dir, repo_id, license_id, base_model)
    plan = upload_plan(export_dir)
    out(f"{'would push' if dry_run else 'pushing'} {export_dir} -> {repo_id} ({'private' if private else 'public'})")
    for path, local in plan:
        size = len(card.encode()) if local is None else local.stat().st_size
        out(f"  {path} ({size:,} bytes){' [generated model card]' if local is None else ''}")
    if dry_run:
        out("--- model card ---\n" + card)
        return None
    api = HfApi(endpoint=endpoint)  # token: HF_TOKEN or the cached login, never echoed
    with hub_errors(repo_id, api.endpoint):
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        ops = [CommitOperationAdd(path, card.encode() if local is None else str(local)) for path, local in plan]
        info = api.create_commit(repo_id, operations=ops, commit_message="Upload draft head exported by specheads")
    out(f"pushed: {info.commit_url}")
    return info.commit_url


def main(argv: list[str] | None = None) -> int:
    p = push_parser()
    a = p.parse_args(argv)
    push(a.export_dir, a.repo, a.private, a.dry_run, a.endpoint, license_id=a.license, base_model=a.base_model)
    return 0
