"""The dependency direction of docs/design/ARCHITECTURE.md, checked by parsing imports:
core modules import neither Ray nor ``actors``; ``kernels`` imports only torch/triton (+stdlib);
only the entry points (pipeline, serve, bench) import ``actors``."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"pipeline", "serve", "bench"}


def _full_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _imports(path: Path) -> set[str]:
    return {m.split(".")[0] for m in _full_imports(path)}


def _modules(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


def test_core_is_ray_free():
    bad = []
    for f in _modules("adaflash_ray"):
        rel = f.relative_to(ROOT / "adaflash_ray")
        if rel.parts[0].removesuffix(".py") in ENTRY_POINTS:
            continue
        hit = _imports(f) & {"ray", "actors"}
        if hit:
            bad.append(f"{rel}: {sorted(hit)}")
    assert not bad, f"core modules import Ray/actors: {bad}"


def test_kernels_import_only_torch_and_triton():
    allowed = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names) | {"kernels"}
    bad = [f"{f.name}: {sorted(_imports(f) - allowed)}" for f in _modules("kernels") if _imports(f) - allowed]
    assert not bad, bad


def test_actors_do_not_import_entry_points():
    bad = []
    for f in _modules("actors"):
        for mod in _full_imports(f):
            if mod.split(".")[:2] in ([ "adaflash_ray", ep] for ep in ENTRY_POINTS):
                bad.append(f"{f.name} -> {mod}")
    assert not bad, bad


def test_the_checker_detects_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom ray.util import metrics\nimport actors.inference_worker\n")
    assert {"ray", "actors"} <= _imports(f)
