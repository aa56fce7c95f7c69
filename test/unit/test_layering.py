"""Dependencies go one way: core ← radix_cache ← hicache ← scheduler ← disaggregation ← srt, config
(architecture.md).

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
# disaggregation drives a scheduler through its hooks and is built by srt: between the two
LAYERS = {"kernels": 0, "radix_cache": 1, "hicache": 2, "scheduler": 3, "disaggregation": 3.5, "srt": 4}
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


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return [m for m in out if m == "radixlm" or m.startswith("radixlm.")]


def test_no_back_edges():
    bad = []
    for path in ROOT.rglob("*.py"):
        mod = "radixlm." + ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for imp in _imports(path):
            if imp == "radixlm" and not mod.endswith("__main__"):
                bad.append(f"{mod} imports the package root")
            elif _layer(imp) > _layer(mod):
                bad.append(f"{mod} -> {imp}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


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
