"""The package's shape: imports only point down the layers, one class per name, small files.

Layers, lowest first: core and observe < engine, speech and vision (the GPU encoders) < sched < stages < pipeline < serve < scale <
commands (with ``cli``/``client`` at the top). A module may import its own layer and any lower
one, at module level or inside a function.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "tristream"

RANK = {"core": 0, "observe": 0, "data": 0, "engine": 1, "speech": 1, "vision": 1, "sched": 2, "stages": 3, "pipeline": 4, "serve": 5,
        "scale": 6, "commands": 7, "cli": 8, "client": 8, "__init__": 8}



MAX_LINES = 500
LONGER = {"core/clock.py": 710, "serve/pipeline_backend.py": 706, "serve/session.py": 599,
          "stages/asr_stream.py": 564, "serve/protocol.py": 556}
"""Product files over `MAX_LINES`: none may grow, and each leaves this list once it is split."""


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "tristream":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> list[tuple[str, ast.Module]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        out.append((".".join(rel.parts), ast.parse(path.read_text(), str(path))))
    return out


def _imports(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
    return names


def test_imports_point_down() -> None:
    upward = []
    for mod, tree in _modules():
        own = _layer(mod)
        assert own in RANK, f"{mod}: layer {own!r} has no rank; add it to RANK"
        for imp in _imports(tree):
            other = _layer(imp)
            if other is None or other == own:
                continue
            assert other in RANK, f"{mod} imports {imp}: layer {other!r} has no rank"
            if RANK[other] > RANK[own]:
                upward.append(f"{mod} ({own}) imports {imp} ({other})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_one_class_per_name() -> None:
    where: dict[str, list[str]] = collections.defaultdict(list)
    for mod, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(mod)
    dups = {name: mods for name, mods in where.items() if len(mods) > 1}
    assert not dups, f"classes defined more than once (one concept, one type): {dups}"


def test_product_files_stay_small() -> None:
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    over = {f: n for f, n in sizes.items() if n > LONGER.get(f, MAX_LINES)}
    assert not over, f"files over {MAX_LINES} lines (or grown past their size in LONGER): {over}"
    split = [f for f, n in LONGER.items() if sizes.get(f, 0) <= MAX_LINES]
    assert not split, f"now within {MAX_LINES} lines: take them out of LONGER: {split}"


def test_the_checks_catch_what_they_look_for() -> None:
    tree = ast.parse("from tristream.serve.server import RealtimeServer\nimport tristream.scale.app\n")
    assert _imports(tree) == ["tristream.serve.server", "tristream.scale.app"]
    assert _layer("tristream.serve.server") == "serve" and RANK["serve"] > RANK["pipeline"]
