"""SpecForge (sgl-project) as a library on a CPU: train an EAGLE-3 drafter on the bench's samples.

    <specforge venv>/bin/python specforge_eagle3.py JOB.json      (bench/anchors.py writes JOB)

Runs in the SpecForge venv only (no specheads import). Its online path needs an SGLang capture
server (a GPU), so this uses its offline path: the target's states written as its offline EAGLE-3
records (`input_ids`, `loss_mask`, `hidden_state` = the final-norm output its frozen lm_head reads,
`aux_hidden_state` = the aux taps concatenated) by capture.py with transformers; a draft config
(LlamaForCausalLMEagle3, one layer, the shared draft vocabulary and aux layers in SGLang numbering);
then `specforge.cli.main(["train", ...])` and `specforge.export.to_sglang.export_to_sglang`. The
export is SGLang's LlamaForCausalLMEagle3 folder, loaded as is by specheads' verifier.
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


def write_features(job: dict, folder: Path) -> tuple[dict, list[list[int]]]:
    """data_<i>.ckpt per sample (SpecForge's offline EAGLE-3 record); the capture's counts."""
    samples = read_samples(job["samples"])
    folder.mkdir(parents=True, exist_ok=True)
    model = load_target(job["target"])
    norm = model.get_decoder().norm
    masks = [s["loss_mask"] for s in samples]

    def save(i, ids, aux, last):
        with torch.no_grad():
            final = norm(last)  # [T, H]: what the target's lm_head reads
        # bfloat16, as its SGLang capture stores them (its frozen lm_head is bfloat16 too)
        torch.save({"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(masks[i]),
                    "hidden_state": final[None].to(torch.bfloat16).contiguous(),
                    "aux_hidden_state": torch.cat(aux, -1)[None].to(torch.bfloat16).contiguous()},
                   folder / f"data_{i:06d}.ckpt")

    ids = [s["input_ids"][: job["max_length"]] for s in samples]
    return capture_all(model, ids, job["aux_layers"], save), ids


def draft_config(job: dict, path: Path) -> dict:
    """LlamaForCausalLMEagle3 config from the target's shape (one layer, the shared draft vocabulary)."""
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(job["target"]).to_dict()
    cfg = {k: target[k] for k in ARCH_FIELDS if target.get(k) is not None}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               vocab_size=target["vocab_size"], draft_vocab_size=job["draft_vocab_size"], tie_word_embeddings=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in job["aux_layers"]],
                             "use_aux_hidden_state": True})
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


def tied(job: dict) -> bool:
    from transformers import AutoConfig

    return bool(getattr(AutoConfig.from_pretrained(job["target"]), "tie_word_embeddings", False))


def run_config(job: dict, work: Path, features: Path, draft: Path, output: Path) -> dict:
    """SpecForge's typed run config (offline, colocated, one process) for the shared budget."""
    return {
        "run_id": "anchors", "output_dir": str(output),
        "model": {"target_model_path": job["target"], "draft_model_config": str(draft), "torch_dtype": "bfloat16",
                  "aux_hidden_state_layer_ids": [i - 1 for i in job["aux_layers"]],
                  **({"lm_head_key": "model.embed_tokens.weight"} if tied(job) else {})},
        "data": {"hidden_states_path": str(features), "max_length": job["max_length"], "cache_dir": str(work / "cache"),
                 "dataloader_num_workers": 0, "build_dataset_num_proc": 1},
        "training": {"strategy": "eagle3", "max_steps": job["steps"], "total_steps": job["steps"],
                     "num_epochs": 1000, "batch_size": job["batch_size"], "learning_rate": job["lr"],
                     "warmup_ratio": min(1.0, job["warmup_steps"] / job["steps"]), "ttt_length": job["ttt_steps"],
                     "attention_backend": "sdpa", "seed": job["seed"], "log_interval": 10,
                     "fsdp_sharding": "NO_SHARD", "save_interval": job["steps"]},
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
    export = work / "export-sglang"
    from specforge.export.to_sglang import export_to_sglang

    export_to_sglang(state["checkpoint"], str(draft), str(export), vocab_mapping_path=None)
    tokens = job["steps"] * job["batch_size"] * sum(len(i) for i in ids) / len(ids)
    return {**state, "stage": "done", "export": str(export), "train_s": round(timing["train_s"], 2), **captured,
            "steps": job["steps"], "train_tokens_est": round(tokens),
            "toolkit_defaults_kept": {"torch_dtype": "bfloat16", "max_grad_norm": 0.5, "ttt loss decay": 0.8,
                                      "warmup_ratio": min(1.0, job["warmup_steps"] / job["steps"])}}


if __name__ == "__main__":
    sys.exit(run_job(main))
