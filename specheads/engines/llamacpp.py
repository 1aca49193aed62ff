"""llama.cpp, the third engine: our exports converted to GGUF and decoded by `llama-server` on a CPU.

The toolchain (find or build the pinned llama.cpp, run its converter, refuse what it cannot load) is
export/llamacpp_tool.py, the server llamacpp_server.py, the check llamacpp_check.py; this module is
their command line and their names in one place.

    python -m specheads.engines.llamacpp ensure
    python -m specheads.engines.llamacpp check EXPORT_OR_GGUF_FOLDER --target TARGET [--prompts FILE --limit N]
    python -m specheads.engines.llamacpp faults EXPORT_OR_GGUF_FOLDER --target TARGET
    python -m specheads.engines.llamacpp convert TARGET_OR_EXPORT OUT.gguf [--target TARGET]

`check` converts target and draft (a `--format gguf` folder brings its own), decodes each prompt plain
and with the draft (`--spec-type draft-eagle3 -md DRAFT.gguf`), and passes when every speculative
output equals the plain one token for token, the sidecar matches the export and drafts were accepted;
`faults` injects each fault of llamacpp_gguf.FAULTS into the sidecar and says whether the check caught it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specheads.atomic import write_json
from specheads.data.prompts import PromptsError
from specheads.engines.llamacpp_check import FAULTS, check, fault_check, format_check
from specheads.engines.llamacpp_server import (  # noqa: F401  (the server, under its usual names)
    Completion,
    Server,
    SpecSettings,
    completion_body,
    decode_all,
    load_average,
    omp_env,
    omp_label,
    prompt_ids,
    server_command,
)
from specheads.export.llamacpp_tool import (  # noqa: F401  (the toolchain, under its usual names)
    CONVERT_SHIM,
    LlamaCpp,
    LlamaCppError,
    RefusedExport,
    build_command,
    built,
    configure_command,
    convert,
    convert_command,
    convert_draft,
    download_command,
    draft_spec,
    ensure,
    home,
    pre_tokenizer,
)


def _check_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("export", help="a specheads export, or a `specheads export --format gguf` folder")
    c.add_argument("--target", required=True, help="the HF target folder the export was trained on")
    c.add_argument("--prompts", help="a prompts jsonl (default: 3 built-in prompts)")
    c.add_argument("--limit", type=int, default=8)
    c.add_argument("--n-predict", type=int, default=64)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--k", type=int, default=None, help="--spec-draft-n-max (default: the export's speculative_tokens)")
    c.add_argument("--work", default=None, help="folder for the GGUFs, logs and the JSON report")
    c.add_argument("--omp-wait-policy", choices=["PASSIVE", "ACTIVE"], default=None,
                   help="the servers' OMP_WAIT_POLICY (default: inherited); PASSIVE measured faster on shared cores")
    c.add_argument("--ours", action="store_true", help="also run our verifier on the same prompt ids (acceptance)")
    c.add_argument("--no-require-accepted", action="store_true",
                   help="pass on greedy equality alone (random-weight test heads draft but are never accepted)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specheads.engines.llamacpp", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ensure", help="locate or download + build the pinned llama.cpp")
    _check_args(sub.add_parser("check", help="plain vs speculative llama.cpp decoding of an export"))
    _check_args(sub.add_parser("faults", help="the check on sidecars with one injected fault each: all caught?"))
    v = sub.add_parser("convert", help="an HF target or (with --target) a specheads export as GGUF")
    v.add_argument("model")
    v.add_argument("out")
    v.add_argument("--target", default=None)
    v.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    return p


def _run_check(a: argparse.Namespace) -> int:
    work = Path(a.work or Path(a.export).resolve().parent / f"llamacpp-{a.cmd}")
    kw = dict(prompts_file=Path(a.prompts) if a.prompts else None, limit=a.limit, n_predict=a.n_predict,
              threads=a.threads, n_max=a.k, require_accepted=not a.no_require_accepted, compare_ours=a.ours,
              omp=a.omp_wait_policy)
    if a.cmd == "faults":
        faults = [fault_check(Path(a.export), Path(a.target), work / f, f, progress=lambda m: None, **kw) for f in FAULTS]
        write_json(work / "llamacpp-faults.json", faults)
        for f in faults:
            verdict = {True: "caught", False: "NOT CAUGHT", None: "not applicable"}[f["caught"]]
            print(f"{f['fault']}: {verdict}: {f['how'][:300]}")
        return 0 if all(f["caught"] is not False for f in faults) else 1
    r = check(Path(a.export), Path(a.target), work, **kw)
    write_json(work / "llamacpp-check.json", r)
    print(format_check(r))
    print(f"  report: {work / 'llamacpp-check.json'}")
    return 0 if r["verdict"] == "PASS" else 1


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        if a.cmd == "ensure":
            b = ensure()
            print(f"llama.cpp ready: {b.server}\n  {b.version()}\n  converter {b.converter}")
            return 0
        if a.cmd == "convert":
            rec = convert_draft(a.model, a.target, a.out, a.outtype) if a.target else convert(a.model, a.out, a.outtype)
            print(json.dumps(rec, indent=2))
            return 0
        return _run_check(a)
    except (LlamaCppError, FileNotFoundError, PromptsError) as e:
        print(f"llama.cpp: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
