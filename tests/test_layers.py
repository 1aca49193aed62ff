"""The package's import graph: no cycles, and no import from a lower floor to a higher one.

Floors, lowest first (README "Layout" names the same): a module may import its own floor or the
floors below. Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specheads"

FLOORS = [  # (floor, top-level modules and packages of specheads)
    ("foundation", {"specheads", "atomic", "integrity", "protocols", "provenance", "hf_compat", "metrics", "schedule",
                    "optim", "builtin", "bounds", "progress", "errors", "engine_facts", "model_ref", "cli_parsers", "run_lock",
                    "eval_identity"}),
    ("models", {"attention", "target", "heads", "from_gguf"}),
    ("recipes", {"config", "resume_plan"}),
    ("data", {"data"}),
    ("artifacts", {"export", "verify", "session", "mixing"}),
    ("kinds", {"kinds"}),
    ("measurement", {"eval", "engines"}),
    ("services", {"train", "runlog", "serve", "hub", "cli_options"}),
    ("commands", {"generate", "regenerate_command", "demo"}),
    ("entry", {"cli", "__main__"}),
]


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (a name imported from a package counts as the
    submodule when it is one, else as the package), wherever the import statement is."""
    mods = module_files()

    def owner(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {owner(a.name) for a in node.names if a.name.split(".")[0] == "specheads"}
            elif isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}:{node.lineno}: relative import; write `from specheads...`")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "specheads":
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else owner(node.module)
                         for a in node.names}
        graph[mod] = deps - {mod}
    return graph


def floor_of(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else mod
    for i, (_, names) in enumerate(FLOORS):
        if top in names:
            return i
    raise AssertionError(f"{mod}: not on any floor; add it to FLOORS (and the README's Layout)")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_up_the_floors():
    graph = import_graph()
    up = [f"{m} ({FLOORS[floor_of(m)][0]}) imports {d} ({FLOORS[floor_of(d)][0]})"
          for m, deps in graph.items() for d in sorted(deps) if floor_of(d) > floor_of(m)]
    assert up == []


def test_library_modules_import_no_command_module():
    """Only the CLI imports the command modules (`specheads generate`, `specheads demo`)."""
    graph = import_graph()
    commands = {m for m in graph if FLOORS[floor_of(m)][0] == "commands"}
    users = {m: sorted(deps & commands) for m, deps in graph.items()
             if deps & commands and FLOORS[floor_of(m)][0] != "entry"}
    assert users == {}


def test_readme_layout_names_every_top_level_module():
    """README's Layout section and the tree agree: each module and package of specheads/ is named
    there, and every name on a floor exists."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)(?:\.py|/)`", layout))
    tree = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").is_file())}
    assert tree - named == set(), f"in the tree, not in README Layout: {sorted(tree - named)}"
    on_floors = {name for _, names in FLOORS for name in names} - {"specheads"}
    assert on_floors == tree, f"FLOORS and the tree differ: {sorted(on_floors ^ tree)}"


# Our own imports inside functions, each with a start-up time measured and written beside it;
# cli.py defers each verb's module (`specheads --help` 0.03 s against 4.2 s importing every verb).
LAZY_ALLOWED = {
    ("specheads.atomic", "specheads.integrity"),  # 0.07 s against 1.9 s (torch)
    ("specheads.eval", "specheads.eval"),  # `specheads bench` (HTTP client) imports the package
    ("specheads.eval.bench", "specheads.data.prompts"),  # 0.17 s against 1.9 s (torch)
}


def lazy_imports() -> set[tuple[str, str]]:
    """(module, imported specheads module) for every `specheads` import inside a function."""
    found = set()
    for mod, path in module_files().items():
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specheads"):
                    found.add((mod, node.module))
                elif isinstance(node, ast.Import):
                    found |= {(mod, a.name) for a in node.names if a.name.startswith("specheads")}
    return found


def test_imports_inside_functions_have_a_measured_reason():
    extra = sorted((m, d) for m, d in lazy_imports() - LAZY_ALLOWED if m != "specheads.cli")
    assert not extra, (f"imports inside functions without a measured start-up reason: {extra}; move them "
                       "to the module top, or measure the start-up cost and add them to LAZY_ALLOWED")


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain (modules, importer first) of an acyclic graph."""
    best: dict[str, list[str]] = {}

    def chain(mod: str) -> list[str]:
        if mod not in best:
            tails = [chain(d) for d in sorted(graph[mod])]
            best[mod] = [mod] + max(tails, key=len, default=[])
        return best[mod]

    return max((chain(m) for m in graph), key=len, default=[])


def test_longest_chain_finder():
    assert longest_chain({"a": {"b", "d"}, "b": {"c"}, "c": set(), "d": set()}) == ["a", "b", "c"]


def test_verify_import_chains_are_at_most_six_deep():
    """Inside verify/, a module reaches the bottom (trees, sampling) through <= 6 modules."""
    graph = import_graph()
    verify = {m for m in graph if m == "specheads.verify" or m.startswith("specheads.verify.")}
    chain = longest_chain({m: graph[m] & verify for m in verify})
    assert len(chain) <= 6, " -> ".join(chain)
