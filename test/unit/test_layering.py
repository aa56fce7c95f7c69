"""Dependencies go one way: core ← radix_cache ← hicache ← scheduler ← srt (architecture.md).

The test parses every module's imports (no import is executed) and fails on a back edge.
"""
from __future__ import annotations

import ast
from pathlib import Path

import radixlm

ROOT = Path(radixlm.__file__).parent
# Lower number = lower layer; a module may import only from its own layer or lower ones.
# kernels import nothing else from radixlm, so every layer may use them
LAYERS = {"kernels": 0, "radix_cache": 1, "hicache": 2, "scheduler": 3, "srt": 4}
TOP_LEVEL_HIGH = {"__main__": 5, "__init__": 5}


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2:
        return 5
    head = parts[1]
    if head in LAYERS:
        return LAYERS[head]
    return TOP_LEVEL_HIGH.get(head, 0)  # core, config, messages, registry, sampling_params


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
