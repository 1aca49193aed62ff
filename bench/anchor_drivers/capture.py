"""Target hidden states for the anchors' offline trainers, computed with plain transformers on a CPU.

Runs inside an anchor's own virtualenv (no specheads import). The anchors capture these states with
vLLM or SGLang, which do not run on a CPU; this computes the same tensors with the HF target:
aux layer i = the output of decoder layer i-1 (HF `hidden_states[i]`, vLLM's EAGLE-3 tap), `last` =
the last decoder layer's output before the final norm (what the anchors feed their frozen norm and
lm_head to get the target's logits).
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch


def load_target(path: str):
    """The frozen HF target in float32 on the CPU, eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def decoder_layers(model) -> torch.nn.ModuleList:
    return model.get_decoder().layers


@torch.no_grad()
def hidden_states(model, ids: list[int], aux_layers: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """ids [T] -> (aux states, each [T, H]; last state [T, H]) by forward hooks on the decoder layers."""
    layers = decoder_layers(model)
    wanted = sorted({i - 1 for i in aux_layers} | {len(layers) - 1})
    store: dict[int, torch.Tensor] = {}

    def hook_for(idx):
        def hook(_module, _inputs, output):
            store[idx] = (output[0] if isinstance(output, tuple) else output)[0].detach()
        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in wanted]
    try:
        model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [store[i - 1] for i in aux_layers], store[len(layers) - 1]


def error_words(err: BaseException) -> str:
    """The exception as its library wrote it (type and message, first 1,500 characters)."""
    return f"{type(err).__name__}: {err}"[:1500]


def capture_all(model, samples: list[list[int]], aux_layers: list[int], save) -> dict:
    """save(i, ids, aux, last) for every sample; returns the capture's seconds and token count."""
    t0, tokens = time.perf_counter(), 0
    for i, ids in enumerate(samples):
        aux, last = hidden_states(model, ids, aux_layers)
        save(i, ids, aux, last)
        tokens += len(ids)
    return {"capture_s": round(time.perf_counter() - t0, 2), "capture_tokens": tokens}


def with_adaptations(attempt, adaptations, state: dict):
    """attempt(n) unchanged first; after a failure whose message contains an adaptation's `marker`,
    record the toolkit's own error, apply that (description, marker, apply) and try again. A
    failure no adaptation names propagates."""
    left = list(adaptations)
    for n in range(len(adaptations) + 1):
        try:
            return attempt(n)
        except Exception as err:
            words = error_words(err)
            fit = next((a for a in left if a[1] in words), None)
            if fit is None:
                raise
            left.remove(fit)
            state["errors_before_adaptation"].append(words)
            fit[2]()
            state["cpu_adaptations"].append(fit[0])
    return None


def read_samples(path: str) -> list[dict]:
    """The bench's pre-tokenized samples: one {"input_ids": [...], "loss_mask": [...]} per line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_job(main) -> int:
    """`driver.py JOB.json`: main(job, state) -> result, written to WORK/result.json; on failure the
    error in the toolkit's own words, its traceback and `state` (the stage reached, notes so far)."""
    import sys

    job = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(int(job.get("threads") or torch.get_num_threads()))
    out = Path(job["work"]) / "result.json"
    state: dict = {"stage": "start", "cpu_adaptations": [], "errors_before_adaptation": []}
    t0 = time.time()
    try:
        result = main(job, state)
    except BaseException as err:  # noqa: BLE001 -- the row must carry the toolkit's own words
        result = {**state, "error": error_words(err), "traceback": traceback.format_exc()[-6000:]}
    result["wall_s"] = round(time.time() - t0, 2)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if "error" in result else 0
