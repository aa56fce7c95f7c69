"""Dependencies go one way: core, kernels ← speculative ← radix_cache ← hicache ← scheduler ←
disaggregation ← srt, config (architecture.md); inside a package they go one way too (no
import circle between its files); scheduler/ and disaggregation/ touch no other object's
private attributes (plug-ins act through the port, scheduler/port.py).

The test parses every module's imports (no import is executed) and fails on a back edge.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import radixlm

ROOT = Path(radixlm.__file__).parent
# Lower number = lower layer; a module may import only from its own layer or lower ones.
# kernels import nothing else from radixlm, so every layer may use them
# speculative holds the drafting and verification algorithms and imports nothing above them
# disaggregation drives a scheduler through its port and is built by srt: between the two
LAYERS = {"kernels": 0, "speculative": 0.5, "radix_cache": 1, "hicache": 2, "scheduler": 3, "disaggregation": 3.5,
          "srt": 4}
# config describes every layer (its choices come from their registries): it sits with srt
TOP_LEVEL_HIGH = {"__main__": 5, "__init__": 5, "config": 4}


def _layer(module: str) -> float:
    parts = module.split(".")
    if len(parts) < 2:
        return 5
    head = parts[1]
    if head in LAYERS:
        return LAYERS[head]
    return TOP_LEVEL_HIGH.get(head, 0)  # core, messages, registry, sampling_params, envs


def _imports(path: Path, *, type_only: bool = True) -> list[str]:
    """The radixlm modules `path` imports (a `from m import name` also names m.name, which may
    be a module); with type_only=False, those under `if TYPE_CHECKING:` are left out."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    if not type_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skip.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            if not type_only:
                out.extend(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return [m for m in out if m == "radixlm" or m.startswith("radixlm.")]


def _modules() -> dict[str, Path]:
    return {"radixlm." + ".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in ROOT.rglob("*.py")}


def test_no_back_edges():
    bad = []
    for mod, path in _modules().items():
        for imp in _imports(path):
            if imp == "radixlm" and not mod.endswith("__main__"):
                bad.append(f"{mod} imports the package root")
            elif _layer(imp) > _layer(mod):
                bad.append(f"{mod} -> {imp}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


# Import circles left: request validation builds its input model from SamplingParams' fields,
# and SamplingParams validates through it (the two are one intake, split in two files).
KNOWN_CIRCLES = [["radixlm.sampling_params", "radixlm.validation"]]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circles_between_files_of_one_package():
    """Inside a package, imports go one way (imports under `if TYPE_CHECKING:` aside; an import
    inside a function counts: it is the same dependency, only later)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod.rsplit(".", 1)[0]
        graph[mod] = {imp for imp in _imports(path, type_only=False)
                      if imp in mods and imp != mod and imp.rsplit(".", 1)[0] == package
                      and not imp.endswith(".__init__")}
    circles = [c for c in _circles(graph) if c not in KNOWN_CIRCLES]
    assert not circles, "import circles inside a package:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]


def test_plug_ins_see_the_scheduler_only_through_the_port():
    """Speculation, the error boundary, the control handlers and the disaggregation sides take
    the port (scheduler/port.py), not the Scheduler: no module of scheduler/ or disaggregation/
    imports the scheduler's classes, not even for types (the scheduler imports them)."""
    scheduler_classes = {"radixlm.scheduler.scheduler", "radixlm.scheduler.lifecycle"}
    allowed = {"radixlm.scheduler.scheduler": {"radixlm.scheduler.lifecycle"}}
    bad = [f"{mod} -> {imp}" for mod, path in _modules().items()
           if mod.startswith(("radixlm.scheduler.", "radixlm.disaggregation."))
           for imp in _imports(path) if imp in scheduler_classes - {mod} - allowed.get(mod, set())]
    assert not bad, "the scheduler imported past its port:\n" + "\n".join(bad)


PRIVATE_ACCESS_FREE = ("scheduler", "disaggregation")


def _private_accesses(source: str) -> list[tuple[int, str]]:
    """`x._name` where x is not self or cls (dunders aside)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_private_attribute_access_on_other_objects():
    """scheduler/ and disaggregation/ reach other objects through what they offer: a plug-in
    calls the port, not the scheduler's private helpers."""
    bad = [f"{path.relative_to(ROOT)}:{line} {expr}" for package in PRIVATE_ACCESS_FREE
           for path in sorted((ROOT / package).rglob("*.py")) for line, expr in _private_accesses(path.read_text())]
    assert not bad, "private attributes of other objects used:\n" + "\n".join(bad)


def test_private_access_finder_sees_other_objects_only():
    code = "self._a\ncls._b\ns._emit()\nx.y._z\nobj.__class__\n"
    assert sorted(_private_accesses(code)) == [(3, "s._emit"), (4, "x.y._z")]


def test_import_radixlm_is_light():
    import subprocess
    import sys
    code = "import sys, radixlm; assert 'torch' not in sys.modules, 'import radixlm pulled torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_only_the_cache_manager_writes_a_requests_kv_fields():
    """A request's KV state has one writer (semantics §5): no other module that handles requests
    (imports `Req`) assigns those fields."""
    from radixlm.core import KV_FIELDS

    owner = ROOT / "scheduler" / "cache_manager.py"
    bad = []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if path == owner or not re.search(r"^from radixlm\.core import .*\bReq\b", text, re.M):
            continue
        for node in ast.walk(ast.parse(text)):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr in KV_FIELDS and not \
                            (isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} writes .{sub.attr}")
    assert not bad, "KV fields written outside the cache manager:\n" + "\n".join(bad)


def test_importing_radixlm_changes_no_environment():
    """No import-time side effects on the process: importing every module leaves os.environ as it
    was (what the runtime's children need, e.g. HF_HUB_OFFLINE, the launcher gives them)."""
    import os
    import subprocess
    import sys
    code = ("import importlib, os, pkgutil, radixlm\n"
            "before = dict(os.environ)\n"
            "for m in pkgutil.walk_packages(radixlm.__path__, 'radixlm.'):\n"
            "    try:\n"
            "        importlib.import_module(m.name)\n"
            "    except ImportError:\n"
            "        pass  # a GPU library that is not installed\n"
            "changed = set(os.environ.items()) ^ set(before.items())\n"
            "assert not changed, changed\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_radixlm_environment_flags_are_read_in_one_module():
    """RADIXLM_* variables are read in radixlm/envs.py only (one list of every flag)."""
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in ROOT.rglob("*.py") if p.name != "envs.py"
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if re.search(r"(environ|getenv)\b.*RADIXLM_", line)]
    assert not bad, "RADIXLM_* read outside radixlm/envs.py: " + ", ".join(bad)
