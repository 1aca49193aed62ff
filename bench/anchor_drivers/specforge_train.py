"""SpecForge (sgl-project) as a library on a CPU: train an EAGLE-3, DFlash or DSpark drafter (the
job's `kind`) on the bench's samples.

    <specforge venv>/bin/python specforge_train.py JOB.json      (bench/anchors.py writes JOB)

Runs in the SpecForge venv only (no specheads import). Its online path needs an SGLang capture
server (a GPU), so this uses its offline path: the target's states written by capture.py with
transformers as its offline records, a draft config, then `specforge.cli.main(["train", ...])` and
its exporter. EAGLE-3: records of `input_ids`, `loss_mask`, `hidden_state` (the final-norm output
its frozen lm_head reads) and `aux_hidden_state` (the aux taps concatenated); a one-layer
LlamaForCausalLMEagle3 config with the shared draft vocabulary and aux layers in SGLang numbering;
exported by `export_to_sglang`. DFlash / DSpark: records of `input_ids`, `loss_mask`,
`hidden_states` (the taps concatenated) and, for DSpark, `target_last_hidden_states` (the
final-norm output); a Qwen3 DFlashDraftModel / DSparkDraftModel config with the shared layers,
taps (DFlash layer-output ids) and block; exported by `export_to_hf`, SpecForge's exporter for
its DFlash family. Its exports are loaded as is by specheads' verifier (or refused by name).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from capture import capture_all, load_target, read_samples, run_job, with_adaptations

ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta",
               "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias", "mlp_bias")
BLOCK_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "DSparkDraftModel"}
DSPARK_HEADS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def kind_of(job: dict) -> str:
    return job.get("kind", "eagle3")


def usable_samples(job: dict, samples: list[dict]) -> list[dict]:
    """The samples this kind's trainer accepts: SpecForge's DFlash family refuses a sample without two
    consecutive supervised tokens (its own loss_mask_filter, applied here with its predicate)."""
    if kind_of(job) == "eagle3":
        return samples
    from specforge.data.loss_mask import has_consecutive_supervised_tokens

    return [s for s in samples if has_consecutive_supervised_tokens(s["loss_mask"][: job["max_length"]])]


def record(kind: str, ids: list[int], mask: list[int], aux: list[torch.Tensor], final: torch.Tensor) -> dict:
    """One sample as SpecForge's offline record of `kind`; states in bfloat16, as its SGLang capture
    stores them (its frozen lm_head is bfloat16 too). aux: taps, each [T, H]; final: [T, H]."""

    def states(t):  # [T, W] -> [1, T, W]
        return t[None].to(torch.bfloat16).contiguous()

    ids_mask = {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask)}
    if kind == "eagle3":
        return {**ids_mask, "hidden_state": states(final), "aux_hidden_state": states(torch.cat(aux, -1))}
    block = {**ids_mask, "hidden_states": states(torch.cat(aux, -1))}
    if kind == "dspark":
        block["target_last_hidden_states"] = states(final)
    return block


def write_features(job: dict, folder: Path) -> tuple[dict, list[list[int]]]:
    """data_<i>.ckpt per usable sample (SpecForge's offline record of the kind); the capture's counts."""
    samples = read_samples(job["samples"])
    kept = usable_samples(job, samples)
    folder.mkdir(parents=True, exist_ok=True)
    model = load_target(job["target"])
    norm = model.get_decoder().norm
    masks = [s["loss_mask"] for s in kept]

    def save(i, ids, aux, last):
        with torch.no_grad():
            final = norm(last)  # [T, H]: what the target's lm_head reads
        torch.save(record(kind_of(job), ids, masks[i], aux, final), folder / f"data_{i:06d}.ckpt")

    ids = [s["input_ids"][: job["max_length"]] for s in kept]
    captured = capture_all(model, ids, job["aux_layers"], save)
    if len(kept) < len(samples):
        captured["samples_skipped_by_its_filter"] = len(samples) - len(kept)
    return captured, ids


def target_config(job: dict) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(job["target"]).to_dict()


def draft_config(job: dict, path: Path) -> dict:
    """The draft config of the job's kind, written to `path`."""
    target = target_config(job)
    cfg = eagle3_config(job, target) if kind_of(job) == "eagle3" else block_config(job, target)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


def eagle3_config(job: dict, target: dict) -> dict:
    """LlamaForCausalLMEagle3 config from the target's shape (one layer, the shared draft vocabulary)."""
    cfg = {k: target[k] for k in ARCH_FIELDS if target.get(k) is not None}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               vocab_size=target["vocab_size"], draft_vocab_size=job["draft_vocab_size"], tie_word_embeddings=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in job["aux_layers"]],
                             "use_aux_hidden_state": True})
    return cfg


def block_config(job: dict, target: dict) -> dict:
    """Qwen3 DFlashDraftModel / DSparkDraftModel config of the target's shape (as SpecForge generates its
    DFlash draft) with the shared layers, taps (DFlash numbering: layer output t = tap t + 1), block and
    DSpark heads (and the mask token id when the job shares one), full attention in every layer.
    DFlash's block_size counts the anchor (the fill-in layout); SpecForge's DSpark drafts block_size
    tokens from a block of block_size slots (anchor-as-first, its only layout), so it gets G: the same
    number of drafted tokens."""
    block, kind = job["block"], kind_of(job)
    heads = target["num_attention_heads"]
    kv_heads = target.get("num_key_value_heads") or heads
    method = {"target_layer_ids": [i - 1 for i in job["aux_layers"]]}
    if block.get("mask_token_id") is not None:  # shared: its trainer takes the draft config's before its own
        method["mask_token_id"] = block["mask_token_id"]
    if kind == "dspark":
        method.update({k: block[k] for k in DSPARK_HEADS})
        if kv_heads == heads:  # its DSpark refuses equal head counts unless told "mha"
            method["attention_mode"] = "mha"
    cfg = {k: target[k] for k in ARCH_FIELDS if target.get(k) is not None}
    cfg.setdefault("head_dim", target["hidden_size"] // heads)
    cfg.update(architectures=[BLOCK_ARCHITECTURES[kind]], model_type="qwen3", num_hidden_layers=block["num_layers"],
               num_key_value_heads=kv_heads, vocab_size=target["vocab_size"], tie_word_embeddings=False,
               num_target_layers=target["num_hidden_layers"],
               block_size=block["block_size"] - (1 if kind == "dspark" else 0),
               layer_types=["full_attention"] * block["num_layers"], use_sliding_window=False, sliding_window=None,
               dflash_config=method)
    return cfg


def tied(job: dict) -> bool:
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(job["target"]), "tie_word_embeddings", False))


def run_config(job: dict, work: Path, features: Path, draft: Path, output: Path) -> dict:
    """SpecForge's typed run config (offline, colocated, one process) for the shared budget: EAGLE-3
    also names its aux layers (SGLang numbering), TTT length and, for a tied target, the lm_head key;
    the DFlash family takes its taps from the draft config and its tied head from the target's."""
    eagle3 = kind_of(job) == "eagle3"
    model = {"target_model_path": job["target"], "draft_model_config": str(draft), "torch_dtype": "bfloat16"}
    if eagle3:
        model.update(aux_hidden_state_layer_ids=[i - 1 for i in job["aux_layers"]],
                     **({"lm_head_key": "model.embed_tokens.weight"} if tied(job) else {}))
    training = {"strategy": kind_of(job), "max_steps": job["steps"], "total_steps": job["steps"],
                "num_epochs": 1000, "batch_size": job["batch_size"], "learning_rate": job["lr"],
                "warmup_ratio": min(1.0, job["warmup_steps"] / job["steps"]),
                **({"ttt_length": job["ttt_steps"]} if eagle3 else {"num_anchors": job["block"]["num_anchors"]}),
                "attention_backend": "sdpa", "seed": job["seed"], "log_interval": 10,
                "fsdp_sharding": "NO_SHARD", "save_interval": job["steps"]}
    return {
        "run_id": "anchors", "output_dir": str(output), "model": model,
        "data": {"hidden_states_path": str(features), "max_length": job["max_length"], "cache_dir": str(work / "cache"),
                 "dataloader_num_workers": 0, "build_dataset_num_proc": 1},
        "training": training,
    }


def train(cfg_file: Path) -> None:
    from specforge.cli import main

    rc = main(["train", "-c", str(cfg_file)])
    if rc:
        raise RuntimeError(f"specforge train returned exit status {rc}")


class PlainSoftCrossEntropy:
    """EAGLE-3's soft cross-entropy in plain torch (autograd): -sum(mask * p_target * log_softmax(logits)),
    averaged over positions. SpecForge computes it with a Triton kernel only, which needs a GPU."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        # logits, target_p [B, T, V]; position_mask [B, T, 1] -> scalar
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(position_mask * target_p * logp).sum(-1).mean()


def _plain_loss() -> None:
    import specforge.algorithms.eagle3.model as model

    model.LogSoftmaxLoss = PlainSoftCrossEntropy


def indexed_target(job: dict) -> Path:
    """A view of the target folder (links to its files) plus the model.safetensors.index.json that
    SpecForge's TargetHead looks its lm_head up in; a single-file checkpoint has none."""
    from safetensors import safe_open

    source, view = Path(job["target"]), Path(job["work"]) / "target-indexed"
    view.mkdir(exist_ok=True)
    for f in source.iterdir():
        if not (view / f.name).exists():
            (view / f.name).symlink_to(f.resolve())
    weight_map = {}
    for shard in sorted(source.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            weight_map.update(dict.fromkeys(fh.keys(), shard.name))
    (view / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}) + "\n")
    return view


# applied only after a run fails with the marker in its error (capture.with_adaptations)
def adaptations(job: dict) -> tuple:
    def index():
        job["target"] = str(indexed_target(job))

    if kind_of(job) != "eagle3":
        return ()
    return (
        ("target given as a folder view with a model.safetensors.index.json (links to the same files): "
         "SpecForge's TargetHead reads the lm_head only through a weight index", "No index.json file found", index),
        ("specforge.algorithms.eagle3.model.LogSoftmaxLoss -> the same soft cross-entropy in plain torch: "
         "SpecForge's is a Triton kernel, and Triton finds no CPU driver", "active drivers", _plain_loss),
    )


def latest_checkpoint(output: Path) -> Path:
    """The newest checkpoint folder SpecForge saved under its output_dir."""
    found = sorted((p for p in output.rglob("*") if p.is_dir() and any(p.glob("*.safetensors")) or
                    p.is_dir() and any(p.glob("*.pt"))), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"{output}: SpecForge saved no checkpoint")
    return found[-1]


def export(job: dict, checkpoint: str, draft: Path, work: Path) -> Path:
    """The checkpoint through SpecForge's own exporter of the kind: SGLang's EAGLE-3 folder, or the HF
    folder it writes for its DFlash family (its SGLang exporter takes EAGLE-3 only)."""
    if kind_of(job) == "eagle3":
        from specforge.export.to_sglang import export_to_sglang

        return Path(export_to_sglang(checkpoint, str(draft), str(work / "export-sglang"), vocab_mapping_path=None))
    from specforge.export.to_hf import export_to_hf

    return Path(export_to_hf(checkpoint, str(resolved_draft(job, checkpoint, draft)), str(work / "export-hf")))


def resolved_draft(job: dict, checkpoint: str, draft: Path) -> Path:
    """The draft config as SpecForge's trainer ran it: ours plus the mask token id it resolved (its
    `<kind>_mask_token_id` in the checkpoint's resume contract), which its trainer writes into the live
    draft config's dflash_config but its exporter reads from the config file it is given."""
    from specforge.export.checkpoint_io import resolve_training_state

    found = find_key(resolve_training_state(checkpoint), f"{kind_of(job)}_mask_token_id")
    if found is None:
        raise KeyError(f"{checkpoint}: no {kind_of(job)}_mask_token_id in its training state")
    cfg = json.loads(draft.read_text())
    cfg["dflash_config"] = {**cfg["dflash_config"], "mask_token_id": int(found)}
    path = draft.with_name("draft_config_trained.json")
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def find_key(tree, key: str):
    """The first value under `key` anywhere in nested dicts / lists (None when absent)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for item in tree:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


def kept_defaults(job: dict, exported: dict) -> dict:
    """The settings the budget does not share, as SpecForge ran them (its own defaults)."""
    common = {"torch_dtype": "bfloat16", "max_grad_norm": 0.5,
              "warmup_ratio": min(1.0, job["warmup_steps"] / job["steps"])}
    if kind_of(job) == "eagle3":
        return {**common, "ttt loss decay": 0.8}
    method = exported.get("dflash_config", {})
    mask = {} if job["block"].get("mask_token_id") is not None else {
        "mask_token_id": f"{method.get('mask_token_id')} (its resolution: tokenizer mask, an unused embedding "
                         "row, else the pad token)"}
    kept = {**common, **mask, "loss_decay_gamma": None,
            "block attention": "bidirectional (its full-attention mask)", "draft layer": exported.get("model_type")}
    if job["draft_vocab_size"] != exported.get("vocab_size"):
        kept["draft vocabulary"] = f"the target's {exported.get('vocab_size')} (it drafts with the target's lm_head)"
    if kind_of(job) == "dflash":
        return {**kept, "loss": "dflash cross-entropy (its loss_type default)"}
    layout = {} if job["block"].get("sample_from_anchor") else {
        "layout": f"anchor-as-first (its only DSpark layout): block_size {exported.get('block_size')} "
                  "slots [anchor, mask...], slot j drafts the token at anchor + 1 + j"}
    return {**kept, **layout,
            **({"attention_mode": "mha (its opt-in for a draft of the target's equal query / KV head counts; "
                                  "its gqa default refuses them)"} if method.get("attention_mode") == "mha" else {}),
            "loss": "0.1 x cross-entropy + 0.9 x L1 to the target + 1.0 x confidence BCE (its dspark alphas)"}


def main(job: dict, state: dict) -> dict:
    from importlib.metadata import version

    work = Path(job["work"])
    state.update(stage="capture-hidden-states", toolkit="specforge", version=version("specforge"))
    captured, ids = write_features(job, work / "features")
    state.update(stage="config", samples=len(ids))
    draft = work / "draft_config.json"
    draft_config(job, draft)
    timing = {}

    def attempt(n: int) -> Path:
        output = work / f"output-{n}"
        cfg_file = work / f"run-{n}.json"
        cfg_file.write_text(json.dumps(run_config(job, work, work / "features", draft, output), indent=2) + "\n")
        t0 = time.perf_counter()
        train(cfg_file)
        timing["train_s"] = time.perf_counter() - t0
        return output

    state.update(stage="train")
    output = with_adaptations(attempt, adaptations(job), state)
    state.update(stage="export", checkpoint=str(latest_checkpoint(output)))
    folder = export(job, state["checkpoint"], draft, work)
    tokens = job["steps"] * job["batch_size"] * sum(len(i) for i in ids) / len(ids)
    return {**state, "stage": "done", "export": str(folder), "train_s": round(timing["train_s"], 2), **captured,
            "steps": job["steps"], "train_tokens_est": round(tokens),
            "toolkit_defaults_kept": kept_defaults(job, json.loads((folder / "config.json").read_text()))}


if __name__ == "__main__":
    sys.exit(run_job(main))
