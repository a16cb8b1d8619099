"""The package's layers point one way (../shared/DESIGN.md, "Layout"): a module imports only from its
own layer or the ones below it, and no two modules import each other, at module level or inside a
function (a deferred import is still an arrow). The graph is read from the source (ast), so the
test needs none of the optional packages the modules import."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# bottom to top; a module's layer is that of the longest prefix of its dotted name listed here
LAYERS = [
    ("specdec.errors", "specdec.paths", "specdec.text", "specdec.stats", "specdec.progress"),
    # config beside sampling: a GenerationConfig carries the SamplingParams it makes, and the
    # grammar its constraint compiles to (grammar, tools)
    ("specdec.sampling", "specdec.config", "specdec.grammar", "specdec.tools", "specdec.models", "specdec.catalog"),
    ("specdec.drafters", "specdec.acceptance", "specdec.costs", "specdec.controller"),
    ("specdec.request", "specdec.spec", "specdec.engine", "specdec.build", "specdec.decoder"),
    (
        "specdec",  # the package's front door (load_model, SpeculativeDecoder)
        "specdec.compare",
        "specdec.check",
        "specdec.demo",
        "specdec.server",
        "specdec.bench",
        "specdec.train",
        "specdec.vllm",
        "specdec.vllm_peer",
        "specdec.peers",
        "specdec.cli",
    ),
]


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, layer = len(name), i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


def module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = SRC) -> set[str]:
    """The specdec modules `path` (under `root`) imports (`from . import x` counts as the module x)."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if not name.startswith("specdec"):
                continue
            found = [f"{name}.{a.name}" for a in node.names if _is_module(f"{name}.{a.name}", root)]
            out.update(found or [name])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("specdec"))
    return out - {module}


def _is_module(name: str, root: Path = SRC) -> bool:
    path = root / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted((SRC / "specdec").rglob("*.py"))}


def test_no_module_imports_from_a_layer_above_its_own():
    up = [
        f"{module} (layer {layer_of(module)}) imports {other} (layer {layer_of(other)})"
        for module, others in graph().items()
        for other in sorted(others)
        if layer_of(other) > layer_of(module)
    ]
    assert not up, "\n".join(up)


def test_no_two_modules_import_each_other():
    edges = graph()
    # a package imports its own modules (its __init__ re-exports them): not a cycle between peers
    cycles = sorted(
        f"{a} <-> {b}"
        for a, others in edges.items()
        for b in others
        if a < b and a in edges.get(b, ()) and not b.startswith(a + ".") and not a.startswith(b + ".")
    )
    assert not cycles, "\n".join(cycles)


def test_the_check_sees_an_arrow_that_points_up(tmp_path):
    """Power: a drafter that imports the training package is an arrow up (0af4022's
    drafters/head.py did)."""
    fake = tmp_path / "specdec" / "drafters"
    (tmp_path / "specdec" / "train").mkdir(parents=True)
    fake.mkdir(parents=True)
    (tmp_path / "specdec" / "train" / "trainer.py").write_text("")
    (fake / "bad.py").write_text("from ..train import trainer\n")
    found = imports(fake / "bad.py", tmp_path)
    assert found == {"specdec.train.trainer"}
    assert layer_of("specdec.train.trainer") > layer_of("specdec.drafters.bad")


def test_the_product_never_imports_the_lab():
    """specdec_lab (the replay, the synthetic drafters, the benchmarks' helpers) sits above
    everything and outside the distribution (pyproject.toml packages specdec alone): an import of
    it from the product would fail for anyone who installed specdec rather than cloned it."""
    lab = [
        f"{module} imports {other}" for module, others in graph().items() for other in others if "specdec_lab" in other
    ]
    assert not lab, "\n".join(lab)
    assert (SRC / "specdec_lab" / "replay.py").is_file() and not (SRC / "specdec" / "replay.py").exists()
    pyproject = (SRC.parent / "pyproject.toml").read_text()
    assert 'include = ["specdec", "specdec.*"]' in pyproject
