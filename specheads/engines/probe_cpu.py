"""The CPU-feature path an engine probe runs on: the machine's own, or one forced for a test.

vLLM and SGLang pick kernels (and the weight repacking done right after loading) by CPU features:
`torch.cpu._is_amx_tile_supported()`, `_is_avx512_supported()`, ... and `platform.machine()`. Which
CPU CI draws is chance, so `make engine-check` must give the same verdicts on every path; a test forces
each one with SPECHEADS_ENGINE_CPU=<profile> (read by both probes before the engine is imported).

What each engine chooses by CPU at load time (the probes load in float32; forwards of MTP targets are
not run), read from vLLM 0.33.0 and SGLang 0.5.23:
- vLLM, AMX: DeepSeek-V3's MLA gets the AMX backend, whose post-load VNNI packing calls
  `torch.ops._C.convert_weight_packed`, absent from the PyPI wheel (probe_vllm replaces that step);
  MoE experts pick the AMX grouped GEMM only for bf16 (the repacking of every CPU MoE class is
  replaced already); dense linears repack for AMX only in bf16 / fp16 / int8.
- vLLM, AVX-512 / AVX2 / aarch64: which `_C` library is imported (none ships in the wheel) and the
  reference MLA backend; nothing repacked in float32.
- SGLang: its AMX backend needs `torch.ops.sgl_kernel.convert_weight_packed`, which the CUDA sgl_kernel
  installed lacks, so every path takes the same native code.

Runs under the engine's Python, next to the probes; imports nothing from specheads.
"""

from __future__ import annotations

import os
import platform
import sys

ENV = "SPECHEADS_ENGINE_CPU"
ENGINE_PACKAGES = ("vllm", "sglang")  # the modules whose view of the CPU is forced
X86_BASE = {"avx2": False, "avx512": False, "avx512_bf16": False, "vnni": False, "amx_tile": False,
            "amx_fp16": False}
PROFILES = {  # name -> (platform.machine(), the torch.cpu feature answers); "native" forces nothing
    "native": None,
    "x86-avx2": ("x86_64", {**X86_BASE, "avx2": True}),
    "x86-avx512": ("x86_64", {**X86_BASE, "avx2": True, "avx512": True, "avx512_bf16": True, "vnni": True}),
    "x86-amx": ("x86_64", {**X86_BASE, "avx2": True, "avx512": True, "avx512_bf16": True, "vnni": True,
                           "amx_tile": True}),  # Sapphire Rapids: AMX-BF16/INT8 without AMX-FP16
    "aarch64": ("aarch64", dict(X86_BASE)),
}
CAPABILITY_KEYS = {"avx2": ("avx2",), "avx512": ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"),
                   "avx512_bf16": ("avx512_bf16",), "vnni": ("avx512_vnni",),
                   "amx_tile": ("amx_tile", "amx_bf16", "amx_int8"), "amx_fp16": ("amx_fp16",)}


class UnknownProfile(ValueError):
    """SPECHEADS_ENGINE_CPU names no profile."""


def profile_name() -> str:
    name = os.environ.get(ENV, "native") or "native"
    if name not in PROFILES:
        raise UnknownProfile(f"{ENV}={name!r}: expected one of {', '.join(PROFILES)}")
    return name


def apply() -> dict:
    """Force the profile named by SPECHEADS_ENGINE_CPU (before the engine is imported); returns what the
    engine will see, for result.json: the profile, the machine and each feature answer."""
    import torch

    name = profile_name()
    forced = PROFILES[name]
    if forced is not None:
        machine, features = forced
        platform.machine = _machine_for_engines(machine, platform.machine)
        for feature, value in features.items():
            setattr(torch.cpu, f"_is_{feature}_supported", _constant(value))
        _override_capabilities(torch, machine, features)
    return {"profile": name, "machine": platform.machine(),
            "features": {f: bool(getattr(torch.cpu, f"_is_{f}_supported")()) for f in X86_BASE}}


def _machine_for_engines(forced: str, real):
    """platform.machine() answering `forced` to the engines' own modules only: libraries that pick a
    bundled binary by it (soundfile's libsndfile) must still find the one this machine runs."""
    def machine() -> str:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return forced if caller.split(".")[0] in ENGINE_PACKAGES or caller == __name__ else real()
    return machine


def _constant(value: bool):
    return lambda: value


def _override_capabilities(torch, machine: str, features: dict) -> None:
    """torch.cpu.get_capabilities() agrees with the forced answers (vLLM reads its 'bf16' on ARM)."""
    real = torch.cpu.get_capabilities

    def capabilities():
        caps = dict(real())
        for feature, value in features.items():
            for key in CAPABILITY_KEYS[feature]:
                caps[key] = value
        caps["architecture"] = machine
        caps["bf16"] = machine == "aarch64"
        return caps

    torch.cpu.get_capabilities = capabilities
