"""Side by side with the anchors: EAGLE-3 (and DFlash / DSpark) drafters trained by specheads,
speculators and SpecForge on the same conversations and budget, all measured by specheads' verifier on
the same held-out prompts.

    nice -n 19 python bench/anchors.py --run runs/demo --out runs/anchors \
        [--anchors speculators,specforge] [--steps 300] [--conversations N] [--limit 32] \
        [--max-new-tokens 96] [--k 3] [--recipe recipes/demo/eagle3.yaml [--recipe recipes/dspark/demo.yaml]] \
        [--threads 2] [OVERRIDES ...]

`--run` is a folder with `target` (link or HF folder) and `data/train_regen.jsonl` (the target's own
answers; else `data/train.jsonl`) and `data/heldout_prompts.jsonl` (a `make demo` or `make real` run).
Each `--recipe` (with OVERRIDES) is one kind's section, its head.kind naming the kind (eagle3, dflash,
dspark), and fixes the shared settings: target layers, draft vocabulary size, learning rate, warm-up,
max length, `--steps` x `train.batch_size`; EAGLE-3's TTT steps and decay; DFlash's and DSpark's
layer count, anchor blocks per sample and block (G drafted tokens: anchor + G query slots in the fill-in
layout, or G for a DSpark recipe with head.sample_from_anchor), DSpark's Markov and confidence heads. Block
drafters are measured with a chain of the whole block (k = G): their full-block acceptance is the
last slot's. specheads
tokenises the conversations once (assistant-only loss masks) and every toolkit trains on those very
samples (the training split of the recipe's seeded hold-out).

Each anchor runs as a library in its own virtualenv under the user cache (created once, CPU torch
pinned; `ANCHORS` says what is installed and what is left out), through a driver script in
bench/anchor_drivers/ run as a subprocess. Their capture engines (vLLM, SGLang) need a GPU, so the
drivers compute the target's hidden states with transformers into each toolkit's offline format,
then call the toolkit's own trainer. Packed trainers get `batch_size x mean sample length` tokens a
step. The checkpoint each toolkit saves is loaded as is by specheads' verifier (export/foreign.py
reads speculators' and SGLang's EAGLE-3 folders, speculators' DFlash / DSpark and SpecForge's DFlash
checkpoints, and names what it refuses); every drafter decodes the same prompts greedily:
tau, acceptance per position, greedy equality with plain decoding and wall-clock speed-up over plain
decoding (drafting included). Each chain drafter is also replayed on every held-out answer of the run
(`data/heldout.jsonl`, whole): its teacher-forced rows walked in decode order, the verifier's tau on
that text over several thousand drafts, where a few hundred decoded tokens leave a few percent of noise
(only where that file holds the target's own regenerated answers, as `make real` writes it).
A toolkit that fails keeps its row with the stage and its own error. A toolkit
that finished in OUT with the same budget and samples is not trained again (its row.json), so a
second call can add a toolkit or re-measure all of them in one process.
Writes OUT/anchors.json and OUT/anchors.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.atomic import write_json, write_text
from specheads.engines.venvs import run_logged

ROOT = Path(__file__).resolve().parents[1]
DRIVERS = Path(__file__).resolve().parent / "anchor_drivers"
RECIPE = ROOT / "recipes" / "demo" / "eagle3.yaml"
TORCH_PIN = "torch==2.13.0"  # the CPU build (the local index's); never an unpinned torch (CUDA stack)
STAMP = ".specheads-installed"


@dataclass(frozen=True)
class Anchor:
    """A toolkit: its pip name and version, its driver, and the pip steps of its CPU venv."""

    package: str
    version: str
    driver: str
    installs: tuple[tuple[str, ...], ...]  # `pip install ARGS` steps, in order
    removes: tuple[str, ...] = ()  # packages uninstalled afterwards
    notes: tuple[str, ...] = ()  # what installing on a CPU needed, for the table
    kinds: tuple[str, ...] = ("eagle3",)  # the kinds its driver trains
    not_driven: str = ""  # what the toolkit has that the driver does not run yet, and why


ANCHORS = {
    "speculators": Anchor(
        "speculators", "0.9.0", "speculators_train.py",
        installs=((TORCH_PIN,), ("speculators==0.9.0", TORCH_PIN)),
        removes=("torchvision", "torchaudio"),
        notes=("pip install torch==2.13.0 (CPU) first, then speculators==0.9.0 with its own deps "
               "(it accepts torch<=2.14.1)",
               "torchvision/torchaudio uninstalled: the PyPI builds pip picks do not match the CPU torch and "
               "`import transformers.modeling_utils` fails with `RuntimeError: operator torchvision::nms does "
               "not exist`",
               "no vLLM: target hidden states computed with transformers into speculators' offline "
               "hs_<i>.safetensors files; samples passed pre-tokenized (input_ids + loss_mask), since "
               "natural-language rows need a vLLM /render endpoint",
               "options chosen for a CPU: --loss-implementation eager (fused is the default), --draft-attn-impl "
               "sdpa (simple_flex_attention is), --num-workers 0, --hidden-states-dtype float32; "
               "--train-data-ratio 0.98 (it requires a validation split)"),
        kinds=("eagle3", "dflash", "dspark")),
    "specforge": Anchor(
        "specforge", "0.2.0", "specforge_train.py",
        installs=((TORCH_PIN,), ("--no-deps", "specforge==0.2.0"),
                  (TORCH_PIN, "transformers==5.8.1", "datasets", "tqdm", "accelerate", "huggingface-hub",
                   "numpy", "openai-harmony", "pydantic", "psutil", "pyyaml", "safetensors", "requests",
                   "typing-extensions", "triton")),
        notes=("specforge==0.2.0 installed with --no-deps: it pins torch==2.11.0 and sglang==0.5.14 (a CUDA "
               "stack); its other deps installed beside torch==2.13.0 (CPU), without sglang, yunchang, "
               "wandb and tensorboard",
               "triton installed although no kernel of it can run here: its EAGLE-3 loss module does `import "
               "triton` (`ModuleNotFoundError: No module named 'triton'` without it)",
               "its offline records are bfloat16 and its draft and frozen lm_head run in bfloat16 (its default "
               "torch_dtype; float32 states fail with `RuntimeError: expected m1 and m2 to have the same dtype`)",
               "no SGLang: target hidden states computed with transformers into its offline records "
               "(data.hidden_states_path) of each kind: EAGLE-3's, its DFlash family's (taps concatenated; "
               "DSpark also the final-norm states)",
               "options chosen for a CPU: training.attention_backend sdpa (flex_attention is its default), "
               "dataloader_num_workers 0",
               "DFlash / DSpark: a Qwen3 draft config of the target's shape with the shared layers, taps and "
               "block; exported with its HF exporter (`specforge export --to hf`; its SGLang exporter takes "
               "EAGLE-3 only), the mask token id its trainer resolved written into the config it exports with",
               "DSpark: SpecForge 0.2.0 trains only the anchor-as-first layout (its slot 0 drafts anchor + 1), "
               "given block_size G for the same G drafted tokens; our verifier reads its folder as SGLang's "
               "DSPARK worker does (sample_from_anchor, its default)"),
        kinds=("eagle3", "dflash", "dspark")),
}


class AnchorSetupError(RuntimeError):
    """An anchor's venv cannot be created; says which pip step failed and where its log is."""


# --- the anchors' venvs ----------------------------------------------------------------------------
def venv_dir(name: str) -> Path:
    from specheads.builtin.tiny_target import cache_dir

    a = ANCHORS[name]
    return cache_dir() / "anchors" / f"{a.package}-{a.version}"


def python_of(name: str) -> Path:
    return venv_dir(name) / "bin" / "python"


def is_ready(name: str) -> bool:
    stamp = venv_dir(name) / STAMP
    return python_of(name).exists() and stamp.is_file() and stamp.read_text().strip() == ANCHORS[name].version


def installed_version(name: str) -> str | None:
    """The anchor's version as its venv's importlib.metadata reports it (None: no venv or not installed)."""
    py = python_of(name)
    if not py.exists():
        return None
    code = f"from importlib.metadata import version; print(version('{ANCHORS[name].package}'))"
    done = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or None if done.returncode == 0 else None


def ensure_venv(name: str, progress=print) -> Path:
    """The anchor venv's Python, creating the venv first when needed (once; a stamp marks it done)."""
    a, folder = ANCHORS[name], venv_dir(name)
    if is_ready(name):
        return python_of(name)
    if installed_version(name) != a.version:
        log = folder.parent / f"{folder.name}.install.log"
        progress(f"[anchors] creating the {a.package} {a.version} environment at {folder} (once); log {log}")
        _pip_run([sys.executable, "-m", "venv", "--clear", str(folder)], log)
        for args in a.installs:
            _pip_run([str(python_of(name)), "-m", "pip", "install", *args], log)
        if a.removes:
            _pip_run([str(python_of(name)), "-m", "pip", "uninstall", "-y", *a.removes], log)
        if installed_version(name) != a.version:
            raise AnchorSetupError(f"{folder}: {a.package}=={a.version} is not importable after installing; see {log}")
    write_text(folder / STAMP, a.version + "\n")
    return python_of(name)


def _pip_run(cmd: list[str], log: Path) -> None:
    run_logged(cmd, log, "setting up an anchor's environment failed", AnchorSetupError)


# --- shared data and budget ------------------------------------------------------------------------
BLOCK_KINDS = ("dflash", "dspark")
KINDS = ("eagle3", *BLOCK_KINDS)


@dataclass(frozen=True)
class Budget:
    """What every toolkit shares: steps x batch (packed trainers: tokens a step) and the head's shape.
    aux_layers are target taps in vLLM's numbering (HF hidden_states index; a DFlash layer output + 1)."""

    steps: int
    batch_size: int
    tokens_per_step: int
    max_length: int
    aux_layers: list[int]
    draft_vocab_size: int
    ttt_steps: int | None  # EAGLE-3 only
    step_decay: float | None  # EAGLE-3 only
    lr: float
    warmup_steps: int
    seed: int
    kind: str = "eagle3"
    # DFlash / DSpark: num_layers, block_size (anchor + G), causal, num_anchors, DSpark's heads and, when its
    # recipe trains anchor-as-first, sample_from_anchor (G query slots instead of anchor + G)
    block: dict | None = None

    @property
    def k(self) -> int | None:
        """Drafted tokens a block drafter proposes (G); None for EAGLE-3 (the chain length is asked)."""
        return None if self.block is None else self.block["block_size"] - 1


def train_file(run: Path, out: Path, conversations: int | None) -> Path:
    """The run's regenerated conversations (train_regen.jsonl, else train.jsonl), the first N if asked."""
    src = run / "data" / "train_regen.jsonl"
    if not src.is_file():
        src = run / "data" / "train.jsonl"
    if not src.is_file():
        raise FileNotFoundError(f"{run / 'data'}: neither train_regen.jsonl nor train.jsonl; pass a `make demo` "
                                "or `make real` run folder as --run")
    if conversations is None:
        return src
    lines = [ln for ln in src.read_text().splitlines() if ln.strip()][:conversations]
    dest = out / "data" / f"conversations_{conversations}.jsonl"
    write_text(dest, "\n".join(lines) + "\n")
    return dest


def work_root(out: Path, kind: str) -> Path:
    """Where a kind's section writes: OUT itself for EAGLE-3, OUT/<kind> for the others."""
    return out if kind == "eagle3" else out / kind


def recipe_kind(recipe_path: Path) -> str:
    """The kind a recipe trains (its head.kind), without loading the target."""
    import yaml

    return ((yaml.safe_load(Path(recipe_path).read_text()) or {}).get("head") or {}).get("kind", "eagle3")


def load_recipe_for(recipe_path: Path, target: Path, data: Path, out: Path, steps: int, overrides: list[str]):
    from specheads.config import load_recipe

    return load_recipe(recipe_path, [f"target.path={target}", f"data.train=[{data}]",
                                     f"train.output_dir={out / 'specheads' / 'checkpoint'}",
                                     f"train.max_steps={steps}", f"train.save_every={steps}",
                                     "train.resume=false", "train.progress=false", *overrides])


def write_samples(recipe, target, dest: Path) -> list:
    """The recipe's training samples (tokenised by specheads, held-out split removed) as JSONL rows
    of input_ids and loss_mask: the one copy every toolkit trains on."""
    from specheads.data.samples import prepare_samples, split_samples

    samples, _ = split_samples(recipe, prepare_samples(recipe, target.tokenizer, report=lambda *_: None))
    rows = [json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask}) for s in samples]
    write_text(dest, "\n".join(rows) + "\n")
    return samples


def budget_of(recipe, target, samples) -> Budget:
    from specheads.heads.eagle3 import default_aux_layers

    mean_len = statistics.mean(len(s.input_ids) for s in samples)
    h, t = recipe.head, recipe.train
    common = dict(steps=t.max_steps, batch_size=t.batch_size, tokens_per_step=round(t.batch_size * mean_len),
                  max_length=recipe.data.max_length, lr=t.lr, warmup_steps=t.warmup_steps, seed=t.seed, kind=h.kind)
    if h.kind in BLOCK_KINDS:
        return Budget(**common, **block_budget(h, target), ttt_steps=None, step_decay=None)
    aux = list(getattr(h, "aux_layers", None) or default_aux_layers(target.num_layers))
    return Budget(**common, aux_layers=aux, draft_vocab_size=h.draft_vocab_size, ttt_steps=h.ttt_steps,
                  step_decay=h.step_decay)


def block_budget(h, target) -> dict:
    """A DFlash / DSpark recipe's shared head: taps (layer outputs + 1), vocabulary, layers and block."""
    from specheads.heads.dflash import default_target_layer_ids
    from specheads.heads.dspark import HEAD_FIELDS

    ids = list(h.target_layer_ids or default_target_layer_ids(target.num_layers, h.num_layers))
    drafted = h.block_size if h.kind == "dspark" else h.block_size - 1  # DSpark's recipe counts G; DFlash's, anchor + G
    block = {"num_layers": h.num_layers, "block_size": drafted + 1, "causal": bool(h.causal),
             "num_anchors": h.num_anchors}  # blocks supervised per sample and step: the work of a step
    if h.kind == "dspark":
        block.update({name: getattr(h, name) for name in HEAD_FIELDS})
        if h.sample_from_anchor:  # anchor-as-first (absent: fill-in, as every earlier run's key says)
            block["sample_from_anchor"] = True
    return {"aux_layers": [i + 1 for i in ids], "draft_vocab_size": h.draft_vocab_size or target.vocab_size,
            "block": block}


# --- training: ours and the anchors' ---------------------------------------------------------------
def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def reused(record: Path, key: dict) -> dict | None:
    """The row a finished run recorded at `record` for the same `key` (budget and samples), whose
    export is still there; None otherwise (train again)."""
    if not record.is_file():
        return None
    saved = json.loads(record.read_text())
    row = saved.get("row") or {}
    if saved.get("key") != key or not row.get("export_path") or not Path(row["export_path"]).is_dir():
        return None
    return {**row, "reused": True}


def ours_key(recipe, budget: Budget, samples_sha256: str) -> dict:
    """What specheads' row depends on: the budget, the samples and its whole recipe (optimizer, loss
    and every option the anchors do not share)."""
    from specheads.config import to_dict

    return {**budget.__dict__, "samples": samples_sha256, "recipe": json.loads(json.dumps(to_dict(recipe), default=str))}


def train_ours(recipe, out: Path, budget: Budget, samples_sha256: str = "") -> dict:
    """specheads' own run of the recipe, exported in the vLLM (speculators) format; a finished run
    with the same recipe, budget and samples is reused (OUT/.../specheads/row.json)."""
    from specheads.export import export
    from specheads.train import train

    record, key = work_root(out, budget.kind) / "specheads" / "row.json", ours_key(recipe, budget, samples_sha256)
    if (row := reused(record, key)) is not None:
        return row
    t0 = time.perf_counter()
    ckpt = train(recipe)
    train_s = time.perf_counter() - t0
    folder = export(ckpt, "vllm", work_root(out, budget.kind) / "specheads" / "export", overwrite=True)
    folder = Path(os.path.relpath(folder, out))
    tokens = budget.steps * budget.tokens_per_step
    rate = round(tokens / train_s, 1)
    row = {"toolkit": "specheads", "kind": budget.kind, "version": _our_version(), "export": f"OUT/{folder}",
           "export_path": str(out / folder), "train_s": round(train_s, 2),
           "train_tokens_est": tokens, "train_tokens_per_s": rate,
           # online: the target's forward runs inside each step, so the rate already includes the capture
           "train_tokens_per_s_with_capture": rate,
           "note": "target forward inside each step (online features)"}
    write_json(record, {"key": key, "row": row})
    return row


def bring_ours(c, out: Path, budget: Budget, data: Path, recipe_head: dict | None = None) -> dict:
    """specheads' row from a checkpoint `c` trained elsewhere (`--specheads-checkpoint`): exported here
    and measured like the others, with every shared setting its recipe.json differs in named in the row,
    and every head option of its own that differs from the recipe's `recipe_head`."""
    from specheads.export import export

    ckpt = c.path
    folder = export(ckpt, "vllm", work_root(out, budget.kind) / "specheads" / "export", overwrite=True)
    return {"toolkit": "specheads", "kind": budget.kind, "version": _our_version(),
            "export": "OUT/" + os.path.relpath(folder, out), "export_path": str(folder),
            "brought": str(ckpt), "differs_from_budget": checkpoint_differences(c, budget, data),
            "head_differs_from_recipe": head_differences(c, recipe_head or {}),
            "note": f"trained before this call (its own run of the same recipe): {ckpt}"}


def head_differences(c, recipe_head: dict) -> list[str]:
    """The checkpoint's own head options that differ from the recipe's, e.g. `norm_output true (recipe
    false)`; those the budget shares are left to `checkpoint_differences`, in the budget's numbering."""
    from specheads.heads.dspark import HEAD_FIELDS

    block = ("target_layer_ids", "num_layers", "block_size", "causal", "num_anchors", "sample_from_anchor")
    shared = {*SHARED_HEAD_KEYS, *block, *HEAD_FIELDS}
    trained = (c.recipe or {}).get("head") or {}
    return [f"{k} {json.dumps(v)} (recipe {json.dumps(recipe_head[k])})" for k, v in trained.items()
            if k in recipe_head and k not in shared and v != recipe_head[k]]


def checkpoint_differences(c, budget: Budget, data: Path) -> list[str]:
    """The shared settings a checkpoint was trained with that the budget does not have (data by content)."""
    r, head = c.recipe, c.head_config
    have = {"kind": head.get("kind"), "steps": c.trainer_state["step"], "batch_size": r["train"]["batch_size"],
            "lr": r["train"]["lr"], "warmup_steps": r["train"]["warmup_steps"], "seed": r["train"]["seed"],
            "max_length": r["data"]["max_length"], **shared_head(head)}
    diffs = [f"{k} {v} (budget {getattr(budget, k)})" for k, v in have.items() if v != getattr(budget, k)]
    if budget.block is not None:
        theirs = {**budget.block, "sample_from_anchor": bool(budget.block.get("sample_from_anchor"))}
        diffs += [f"{k} {v} (budget {theirs[k]})" for k, v in block_of(head).items() if k in theirs and v != theirs[k]]
    trained_on = [Path(p) for p in r["data"]["train"]]
    if [sha256_of(p) if p.is_file() else str(p) for p in trained_on] != [sha256_of(data)]:
        diffs.append(f"data {[str(p) for p in trained_on]} (budget {data})")
    if r["data"].get("features"):
        diffs.append(f"trained from a stored feature capture ({r['data']['features']}), not online")
    return diffs


SHARED_HEAD_KEYS = ("aux_layers", "draft_vocab_size", "ttt_steps", "step_decay")  # EAGLE-3's, as the budget names them


def shared_head(head: dict) -> dict:
    """A trained head config's taps (vLLM numbering), draft vocabulary and TTT as the budget names them."""
    if head.get("kind") not in ("dflash", "dspark"):
        return {k: head.get(k) for k in SHARED_HEAD_KEYS}
    d = head.get("dflash", head)
    return {"aux_layers": [t + 1 for t in d["target_layer_ids"]], "draft_vocab_size": d["draft_vocab_size"],
            "ttt_steps": None, "step_decay": None}


def block_of(head: dict) -> dict:
    """A DFlash / DSpark head config's block as the budget names it (block_size = anchor + G)."""
    from specheads.heads.dspark import HEAD_FIELDS

    d = head.get("dflash", head)
    from_anchor = bool(head.get("sample_from_anchor", False))
    drafted = d["block_size"] - (0 if from_anchor else 1)
    block = {"num_layers": d["num_hidden_layers"], "block_size": drafted + 1, "causal": bool(d["causal"]),
             "num_anchors": d["num_anchors"]}
    if head.get("kind") == "dspark":
        block.update({k: head[k] for k in HEAD_FIELDS}, sample_from_anchor=from_anchor)
    return block


def _our_version() -> str:
    from importlib.metadata import version

    return version("specheads")


def train_anchor(name: str, out: Path, target_dir: Path, samples_file: Path, budget: Budget, threads: int,
                 progress=print) -> dict:
    """Run the anchor's driver in its venv; its result.json (with the error in its own words if any)."""
    a = ANCHORS[name]
    row = {"toolkit": name, "kind": budget.kind, "version": a.version, "install_notes": list(a.notes)}
    if budget.kind not in a.kinds:
        return {**row, "stage": "not driven", "error": a.not_driven or f"{name} does not train {budget.kind}"}
    work = work_root(out, budget.kind) / name
    job = {"target": str(target_dir.resolve()), "samples": str(samples_file.resolve()), "work": str(work.resolve()),
           "threads": threads, **budget.__dict__, "samples_sha256": sha256_of(samples_file)}
    key = {k: v for k, v in job.items() if k != "threads"}
    if (row_done := reused(work / "row.json", key)) is not None:
        return row_done
    try:
        py = ensure_venv(name, progress)
    except AnchorSetupError as err:
        return {**row, "stage": "install", "error": str(err)}
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    job_file = work.resolve() / "job.json"  # the driver runs in `work`: a relative --out must not be joined twice
    write_json(job_file, job)
    progress(f"[anchors] {name}: training in {venv_dir(name)} ({budget.steps} steps)")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    with (work / "driver.log").open("w") as log:
        done = subprocess.run([str(py), str(DRIVERS / a.driver), str(job_file)], cwd=work, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    result_file = work / "result.json"
    if not result_file.is_file():
        tail = (work / "driver.log").read_text(errors="replace")[-1500:]
        return {**row, "stage": "driver", "error": f"driver exited {done.returncode} without a result; log end:\n{tail}"}
    result = json.loads(_relative(result_file.read_text(), {out.resolve(): "OUT", target_dir.resolve(): "TARGET"}))
    if result.get("export"):
        result["export_path"] = str(work / Path(result["export"]).relative_to(
            "OUT/" + str(work.relative_to(out))))
        tokens = result["train_tokens_est"]
        result["train_tokens_per_s"] = round(tokens / result["train_s"], 1)
        result["train_tokens_per_s_with_capture"] = round(tokens / (result["train_s"] + result["capture_s"]), 1)
        write_json(work / "row.json", {"key": key, "row": {**row, **result}})
    return {**row, **result}


def _relative(text: str, names: dict[Path, str]) -> str:
    """`text` with each absolute folder written as its name (reports carry no machine paths)."""
    for folder, name in names.items():
        text = text.replace(str(folder), name)
    return text


# --- measuring, with specheads' verifier -----------------------------------------------------------
def _bench_module(script: str):
    path = Path(__file__).resolve().parent / script
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def heldout_answers(run: Path, target, max_length: int) -> list:
    """The run's held-out conversations when they are the target's own greedy answers (`make real`
    regenerates `data/heldout.jsonl`, each row marked `regenerated`), tokenised; [] otherwise (the
    demo's held-out file holds the source text, which the target would not have written)."""
    from specheads.data.conversations import read_conversations
    from specheads.data.tokenize import tokenize_all

    path = run / "data" / "heldout.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or not all("regenerated" in row for row in rows):
        return []
    return tokenize_all(target.tokenizer, read_conversations(str(path))[0], max_length)


def replay_heldout(head, target, answers: list) -> dict:
    """A chain drafter's teacher-forced rows on every held-out answer, replayed in decode order: the
    verifier's tau on those answers at k = its TTT steps, without decoding them (block drafters: {})."""
    from specheads.eval.offline import offline_acceptance

    if not answers:
        return {}
    acc = offline_acceptance(target, head, answers)
    walk = acc.get("decode_order")
    return {} if walk is None else {"heldout_tau": walk["tau"], "heldout_drafts": walk["starts"],
                                     "heldout_teacher_forced_tau": acc["tau_est"]}


def measure_export(folder: str, target, prompts, plain, k: int, max_new_tokens: int, answers=()) -> dict:
    """tau, acceptance per position, greedy equality and speed-up over `plain` of a chain of k; and
    the replay of the held-out `answers` in decode order."""
    from specheads.session import load_draft
    from specheads.verify.settings import make_tree_spec

    heads = _bench_module("heads.py")
    draft = load_draft(folder, target)
    references = plain["references"]
    stats, bad = heads.decode_all(target, draft.head, make_tree_spec("chain", k=k), prompts, references, max_new_tokens)
    s = stats.summary()
    return {**replay_heldout(draft.head, target, list(answers)),
            "fingerprint_checked": draft.fingerprint_checked, "k": k, "tau": s["tau"],
            "acceptance_per_position": s["acceptance_per_position"],
            "acceptance_per_position_conditional": s["acceptance_per_position_conditional"],
            "full_block_acceptance": s["acceptance_per_position"][k - 1],
            "greedy_equal": not bad, "mismatched_ids": bad, "tokens_per_s": heads.rate(stats),
            "speedup": heads.rate(stats) / plain["tokens_per_s"]}


def plain_reference(target, prompts, max_new_tokens: int) -> dict:
    """Plain greedy decoding of every prompt: the reference tokens and its tokens/s."""
    heads = _bench_module("heads.py")
    from specheads.session import eos_ids
    from specheads.verify.loop import greedy_decode
    from specheads.verify.steps import DecodeStats

    eos, total, refs = eos_ids(target), DecodeStats(), []
    for _, ids in prompts:
        result = greedy_decode(target, ids, max_new_tokens, eos)
        refs.append(result.tokens)
        total = total.add(result.stats)
    return {"references": refs, "tokens_per_s": heads.rate(total)}


# --- report ----------------------------------------------------------------------------------------
def _num(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


KIND_TITLES = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}


def budget_line(b: dict) -> str:
    """One kind's shared settings, in words."""
    line = (f"{b['steps']} steps x batch {b['batch_size']} (packed trainers: {b['tokens_per_step']} tokens a step); "
            f"target taps {b['aux_layers']} (vLLM numbering), draft vocabulary {b['draft_vocab_size']}, lr {b['lr']}, "
            f"warm-up {b['warmup_steps']}")
    blk = b.get("block")
    if blk is None:
        return line + f"; one layer, TTT {b['ttt_steps']} (decay {b['step_decay']})."
    G = blk["block_size"] - 1
    layout = (f"{G} slots, anchor-as-first layout (sample_from_anchor)" if blk.get("sample_from_anchor") else
              f"anchor + {G} (fill-in layout)")
    line += (f"; {blk['num_layers']} layers, up to {blk.get('num_anchors')} anchor blocks a sample, blocks of {layout}, "
             f"{'causal' if blk['causal'] else 'bidirectional'} in the block (specheads; the anchors keep their own)")
    if "markov_rank" in blk:
        line += (f"; Markov head rank {blk['markov_rank']} ({blk['markov_head_type']}), confidence head "
                 f"{'on' if blk['enable_confidence_head'] else 'off'}"
                 f"{' with the Markov embedding' if blk['confidence_head_with_markov'] else ''}")
    return line + "."


def section(kind: str, b: dict, rows: list[dict], chain_k: int) -> list[str]:
    """One kind's table: every toolkit's tau, acceptance, equality, speed and training rate."""
    k = chain_k if b.get("block") is None else b["block"]["block_size"] - 1
    ours = next((r for r in rows if r["toolkit"] == "specheads" and "tau" in r), {})
    lines = [f"## {KIND_TITLES.get(kind, kind)} (chain k = {k})", "", budget_line(b), "",
             "| toolkit | tau | specheads' tau / this | acceptance per position | greedy equal | speed-up vs plain "
             "| held-out answers: tau in decode order | specheads / this | train tokens/s | incl. hidden-state capture "
             "| train s |",
             "|---|---:|---:|---|:---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = f"{r['toolkit']} {r.get('version', '')}".strip()
        if "tau" not in r:
            lines.append(f"| {name} | {r.get('stage')} | | `{_cell(r.get('error', ''))}` | | | | | | | |")
            continue
        acc = " / ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        mine = r["toolkit"] == "specheads"
        lines.append(f"| {name} | {r['tau']:.2f} | {'' if mine else _ratio(ours.get('tau'), r['tau'])} | {acc} | "
                     f"{'yes' if r['greedy_equal'] else 'NO'} | {r['speedup']:.2f}x | {_num(r.get('heldout_tau'), '.3f')} | "
                     f"{'' if mine else _ratio(ours.get('heldout_tau'), r.get('heldout_tau'))} | "
                     f"{_num(r.get('train_tokens_per_s'), '.0f')} | "
                     f"{_num(r.get('train_tokens_per_s_with_capture'), '.0f')} | {_num(r.get('train_s'), '.0f')} |")
    return lines + [""]


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "" if ours is None or not theirs else f"{ours / theirs:.2f}x"


def markdown(report: dict) -> str:
    st = report["settings"]
    lines = ["# Side by side with the anchors", "",
             f"`{st['command']}`", "",
             f"target `{st['target']}`; training samples from `{st['data']}` (tokenised once by specheads, the same "
             f"rows for every toolkit). Measured by specheads' verifier on {st['num_prompts']} held-out prompts, "
             f"max {st['max_new_tokens']} new tokens, greedy, CPU float32, {st['threads']} thread(s), nice "
             f"{st['niceness']}, load average at the end {', '.join(f'{x:.2f}' for x in st['loadavg_at_end'])}; "
             f"plain decoding {st['plain_tokens_per_s']:.1f} tokens/s. tau counts the bonus token; a block "
             "drafter's full-block acceptance is its last slot's.", ""]
    if st.get("heldout_answers"):
        lines += [f"Held-out answers: each chain drafter's teacher-forced rows on all {st['heldout_answers']} held-out "
                  "conversations (the target's own greedy answers, whole) replayed in decode order: the tau the "
                  "verifier measures on that text at k = TTT steps (equal to it within 0.3% on the demo and SmolLM2), "
                  "over many more drafts than the decoded prompts above.", ""]
    for kind, b in report["budgets"].items():
        lines += section(kind, b, [r for r in report["rows"] if r.get("kind", "eagle3") == kind], st["k"])
    again = [f"{r['toolkit']} {KIND_TITLES.get(r.get('kind', 'eagle3'))}" for r in report["rows"] if r.get("reused")]
    if again:
        lines += [f"Trained by an earlier call into the same OUT (same budget and samples) and measured again here: "
                  f"{', '.join(again)}; their training seconds and tokens/s are that call's.", ""]
    lines += ["What each toolkit needed on a CPU, and what did not work (in its own words):", ""]
    noted = set()
    for r in report["rows"]:
        if r["toolkit"] == "specheads":
            if r.get("brought"):
                differs = "; ".join(r.get("differs_from_budget") or []) or "nothing"
                own = "; ".join(r.get("head_differs_from_recipe") or [])
                lines.append(f"- **specheads, {KIND_TITLES.get(r.get('kind', 'eagle3'))}**: not trained by this call: "
                             f"the checkpoint `{r['brought']}` exported and measured; it differs from the budget in: "
                             f"{differs}" + (f"; its own head options differ from the recipe's in: {own}" if own else ""))
            else:
                lines.append(f"- **specheads, {KIND_TITLES.get(r.get('kind', 'eagle3'))}**: trained online (the "
                             "target's forward inside each step), so its tokens/s include the hidden-state capture: "
                             "compare them with the anchors' \"incl. hidden-state capture\"")
            continue
        lines.append(f"- **{r['toolkit']} {r.get('version', '')}, {KIND_TITLES.get(r.get('kind', 'eagle3'))}**")
        if r["toolkit"] not in noted:
            noted.add(r["toolkit"])
            lines += [f"  - setup: {note}" for note in r.get("install_notes", [])]
        for err, ad in zip(r.get("errors_before_adaptation", []), r.get("cpu_adaptations", [])):
            lines.append(f"  - failed with `{_cell(err)}`; then adapted: {ad}")
        if r.get("toolkit_defaults_kept"):
            kept = ", ".join(f"{k} {v}" for k, v in r["toolkit_defaults_kept"].items())
            lines.append(f"  - its own defaults kept: {kept}")
        if "error" in r:
            lines.append(f"  - {r.get('stage')}: `{_cell(r['error'])}`")
        if r.get("export") and "tau" in r:
            lines.append(f"  - its checkpoint loaded as is by our verifier from `{r['export']}` "
                         f"(fingerprint checked: {r.get('fingerprint_checked')})")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("`", "'")[:600]


# --- the bench -------------------------------------------------------------------------------------
def train_section(recipe_path: Path, a: argparse.Namespace, out: Path, data: Path, target,
                  brought=None) -> tuple[Budget, list]:
    """One kind: the recipe's samples written once, then every toolkit trained on them (specheads'
    row from the checkpoint `brought` when it is of this kind)."""
    root = work_root(out, recipe_kind(recipe_path))
    recipe = load_recipe_for(recipe_path, a.target, data, root, a.steps, a.overrides)
    samples_file = root / "data" / "samples.jsonl"
    samples = write_samples(recipe, target, samples_file)
    budget = budget_of(recipe, target, samples)
    rows = []
    if brought is not None and brought.kind == budget.kind:
        from specheads.config import to_dict

        rows.append(bring_ours(brought, out, budget, data, to_dict(recipe.head)))
    elif "specheads" in a.toolkits:
        rows.append(train_ours(recipe, out, budget, sha256_of(samples_file)))
        print(f"[anchors] {budget.kind}: specheads trained: {rows[-1]['train_s']} s", flush=True)
    for name in a.toolkits:
        if name != "specheads":
            rows.append(train_anchor(name, out, a.target, samples_file, budget, a.threads))
            print(f"[anchors] {budget.kind}: {name}: "
                  f"{json.dumps({k: rows[-1].get(k) for k in ('stage', 'error', 'export')})[:600]}", flush=True)
    return budget, [{**r, "train_samples": len(samples)} for r in rows]


def bench(a: argparse.Namespace, command: str) -> dict:
    from specheads.data.prompts import read_prompts
    from specheads.provenance import provenance
    from specheads.target import Target

    torch.set_num_threads(a.threads)
    out, run = Path(a.out), Path(a.run)
    out.mkdir(parents=True, exist_ok=True)
    data = train_file(run, out, a.conversations)
    target = Target.load(str(a.target), device="cpu")
    budgets, rows = {}, []
    brought = None
    if a.specheads_checkpoint:
        from specheads.export.checkpoint import Checkpoint

        brought = Checkpoint(a.specheads_checkpoint)  # read (and checksum-verified) once
    for recipe_path in a.recipes:
        budget, section = train_section(Path(recipe_path), a, out, data, target, brought)
        budgets[budget.kind] = budget
        rows += section
    prompts = _bench_module("verifier.py").encode_rows(target, read_prompts(run / "data" / "heldout_prompts.jsonl",
                                                                          a.limit))
    plain = plain_reference(target, prompts, a.max_new_tokens)
    answers = heldout_answers(run, target, max(b.max_length for b in budgets.values()))
    for row in rows:
        if row.get("export"):
            k = budgets[row["kind"]].k or a.k
            try:
                row.update(measure_export(row.get("export_path", row["export"]), target, prompts, plain, k,
                                          a.max_new_tokens, answers if row["kind"] == "eagle3" else ()))
            except (ValueError, FileNotFoundError, KeyError) as err:
                row.update(stage="load-into-verifier", error=f"{type(err).__name__}: {err}")
        row.pop("export_path", None)  # the report names folders relative to OUT
    report = {"settings": {"command": command, "target": str(a.target), "data": str(data),
                           "train_samples": max((r["train_samples"] for r in rows), default=0),
                           "num_prompts": len(prompts), "k": a.k, "heldout_answers": len(answers),
                           "max_new_tokens": a.max_new_tokens, "threads": torch.get_num_threads(),
                           "niceness": os.nice(0), "cpu_count": os.cpu_count(), "loadavg_at_end": os.getloadavg(),
                           "plain_tokens_per_s": plain["tokens_per_s"]},
              "budgets": {kind: {**b.__dict__} for kind, b in budgets.items()}, "rows": rows,
              "provenance": provenance(target=target.fingerprint())}
    write_json(out / "anchors.json", report)
    write_text(out / "anchors.md", markdown(report))
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a run folder: target link, data/train_regen.jsonl, "
                   "data/heldout_prompts.jsonl")
    p.add_argument("--out", required=True, help="folder for anchors.json and anchors.md")
    p.add_argument("--target", type=Path, default=None, help="the target's HF folder (default: RUN/target)")
    p.add_argument("--anchors", default=",".join(ANCHORS), help=f"comma-separated, of {', '.join(ANCHORS)}")
    p.add_argument("--no-specheads", action="store_true", help="leave specheads' own row out")
    p.add_argument("--recipe", action="append", default=None,
                   help=f"a recipe that fixes one kind's shared settings (its head.kind: {', '.join(KINDS)}); "
                   f"repeat for more kinds (default: {RECIPE.relative_to(ROOT)})")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps for every toolkit")
    p.add_argument("--specheads-checkpoint", type=Path, default=None,
                   help="measure this specheads checkpoint (its kind's section) instead of training one; every "
                   "shared setting its recipe differs in is named in the row")
    p.add_argument("--conversations", type=int, default=None, help="the first N conversations only")
    p.add_argument("--limit", type=int, default=32, help="held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=3, help="chain length")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, every process")
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value), shared by every toolkit")
    a = p.parse_args(argv)
    anchors = [x.strip() for x in a.anchors.split(",") if x.strip()]
    unknown = [x for x in anchors if x not in ANCHORS]
    if unknown:
        p.error(f"--anchors: unknown '{unknown[0]}'; expected some of {', '.join(ANCHORS)}")
    for flag in ("steps", "limit", "max_new_tokens", "k", "threads", "conversations"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1 (got {value})")
    a.target = a.target or Path(a.run) / "target"
    if not (a.target / "config.json").is_file():
        p.error(f"--target {a.target}: no config.json there; pass the target's HF folder (or a --run with a "
                "'target' link)")
    if not (Path(a.run) / "data" / "heldout_prompts.jsonl").is_file():
        p.error(f"--run {a.run}: no data/heldout_prompts.jsonl in it")
    a.recipes = a.recipe or [str(RECIPE)]
    kinds = []
    for recipe in a.recipes:
        if not Path(recipe).is_file():
            p.error(f"--recipe {recipe}: no such file")
        kinds.append(recipe_kind(Path(recipe)))
        if kinds[-1] not in KINDS:
            p.error(f"--recipe {recipe}: head.kind '{kinds[-1]}' has no anchor to compare with; expected one of "
                    f"{', '.join(KINDS)}")
    if len(set(kinds)) < len(kinds):
        p.error(f"--recipe: two recipes of one kind ({', '.join(kinds)}); give one recipe a kind")
    a.toolkits = ([] if a.no_specheads else ["specheads"]) + anchors
    return a


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    a = parse_args(args)
    report = bench(a, "python bench/anchors.py " + " ".join(args))
    print(markdown(report), end="")
    print(f"-> {Path(a.out) / 'anchors.json'}")
    return 0 if all(r.get("greedy_equal", True) for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
