"""The dependency direction of docs/design/ARCHITECTURE.md, checked by parsing imports:
core modules import neither Ray nor the actors (``adaflash_ray.actors``); ``adaflash_ray.kernels`` imports only
torch/triton (+stdlib); only the entry points (pipeline, serve, bench) import the actors; and nothing imports the
bare top-level names ``actors`` / ``kernels`` any more (the folders stay at the top level of the repository and
are importable only as ``adaflash_ray.actors`` / ``adaflash_ray.kernels``, through symlinks)."""
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"pipeline", "serve", "bench"}
MAPPED = {"actors", "kernels"}  # adaflash_ray/<name> -> ../<name>


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
    """Top-level names, with ``adaflash_ray.actors`` / ``adaflash_ray.kernels`` reported as ``actors`` / ``kernels``."""
    out = set()
    for m in _full_imports(path):
        parts = m.split(".")
        out.add(parts[1] if parts[0] == "adaflash_ray" and len(parts) > 1 and parts[1] in MAPPED else parts[0])
    return out


def _modules(pkg: str):
    return sorted((ROOT / pkg).rglob("*.py"))


def _core_modules():
    for f in _modules("adaflash_ray"):
        rel = f.relative_to(ROOT / "adaflash_ray")
        if rel.parts[0] in MAPPED or rel.parts[0].removesuffix(".py") in ENTRY_POINTS:
            continue
        yield rel, f


def test_mapped_packages_are_symlinks_to_the_top_level_folders():
    for name in MAPPED:
        link = ROOT / "adaflash_ray" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), name


def test_core_is_ray_free():
    bad = [f"{rel}: {sorted(hit)}" for rel, f in _core_modules() if (hit := _imports(f) & {"ray", "actors"})]
    assert not bad, f"core modules import Ray/actors: {bad}"


def test_kernels_import_only_torch_and_triton():
    allowed = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names) | {"kernels"}
    bad = [f"{f.name}: {sorted(_imports(f) - allowed)}" for f in _modules("kernels") if _imports(f) - allowed]
    assert not bad, bad


def test_actors_do_not_import_entry_points():
    bad = []
    for f in _modules("actors"):
        for mod in _full_imports(f):
            if mod.split(".")[:2] in (["adaflash_ray", ep] for ep in ENTRY_POINTS):
                bad.append(f"{f.name} -> {mod}")
    assert not bad, bad


def test_nothing_imports_the_bare_top_level_names():
    files = [f for d in ("adaflash_ray", "actors", "kernels", "tests", "scripts") for f in _modules(d)
             if not (d == "adaflash_ray" and f.relative_to(ROOT / d).parts[0] in MAPPED)]
    bad = [f"{f.relative_to(ROOT)}: {m}" for f in files if f.name != "test_layout.py"
           for m in _full_imports(f) if m.split(".")[0] in MAPPED]
    assert not bad, bad


def test_the_checker_detects_a_violation(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom ray.util import metrics\nimport adaflash_ray.actors.inference_worker\n")
    assert {"ray", "actors"} <= _imports(f)
    f.write_text("from actors import InferenceWorker\n")
    assert "actors" in {m.split(".")[0] for m in _full_imports(f)}
