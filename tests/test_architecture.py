"""The layer table of the package, enforced: imports flow one way, one home per concept stays visible.

Every module of src/mixprec is read as a syntax tree (nothing is imported), and each of its imports of
mixprec — at module level, inside functions, and `importlib.import_module("mixprec...")` calls — is
checked against LAYERS: a module may import its own package and packages on lower layers, nothing on
its own layer (sideways) or above it (upward). docs/architecture.md shows the same table; a test
below keeps the two equal.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "mixprec"

# Lowest layer first. A "package" is the first name under mixprec (a module file or a sub-package).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("errors",)),
    ("base", ("files", "progress", "verdicts")),
    ("formats", ("formats", "rounding")),
    ("scaling", ("scaling", "hadamard")),
    ("kernels", ("kernels",)),
    ("seams", ("quantization", "gemm")),
    ("vocabulary", ("recipes", "select", "conversion", "hf", "texts")),
    ("wings", ("training", "inference", "monitor")),
    ("services", ("distributed",)),
    ("support", ("data", "models", "pages")),
    ("analysis", ("sensitivity",)),
    ("workflows", ("comparison", "evaluation", "onnx")),
    ("demo", ("demo",)),
    ("commands", ("commands",)),
    ("cli", ("cli",)),
    ("main", ("__main__",)),
]

# Modules that import triton at their top: reachable only through an import inside a function, so
# that mixprec imports on machines without triton (a heavy optional dependency, like transformers).
OPTIONAL_HEAVY_MODULES = {"mixprec.kernels.triton_quant", "mixprec.kernels.triton_blockwise_gemm"}
MAX_LINES = 600


def layer_of() -> dict[str, int]:
    table: dict[str, int] = {}
    for index, (_, packages) in enumerate(LAYERS):
        for package in packages:
            assert package not in table, f"{package} is on two layers"
            table[package] = index
    return table


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. mixprec.training.convert
    target: str  # the imported module, e.g. mixprec.gemm
    names: tuple[str, ...]  # names taken from it (from-imports)
    in_function: bool
    line: int


def module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(module: str, source: str, is_package: bool = False) -> list[Import]:
    """Every import of mixprec in a module's source, with whether it sits inside a function."""
    tree = ast.parse(source)
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    found = []
    for node in ast.walk(tree):
        inside = id(node) in in_function
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, target] if target else base)
            if target == "mixprec" or target.startswith("mixprec."):
                names = tuple(a.name for a in node.names)
                if target == "mixprec":  # `from mixprec import formats` imports the submodules
                    for name in names:
                        if name != "__version__":
                            found.append(Import(module, f"mixprec.{name}", (), inside, node.lineno))
                    continue
                found.append(Import(module, target, names, inside, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mixprec."):
                    found.append(Import(module, alias.name, (), inside, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("mixprec.")
        ):
            found.append(Import(module, str(node.args[0].value), (), True, node.lineno))
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """What breaks the rules in {module: (source, is_package)}; empty when the code keeps them."""
    layers = layer_of()
    problems = []
    for module, (source, is_package) in sorted(sources.items()):
        if module == "mixprec":  # the lazy public namespace: names every layer by design
            continue
        own = package_of(module)
        if own not in layers:
            problems.append(f"{module}: package {own!r} is on no layer of LAYERS")
            continue
        for imp in imports_of(module, source, is_package):
            target = package_of(imp.target)
            where = f"{module}:{imp.line}"
            if target not in layers:
                problems.append(f"{where} imports {imp.target}, which is on no layer")
                continue
            if target != own and layers[target] >= layers[own]:
                direction = "sideways" if layers[target] == layers[own] else "upward"
                problems.append(
                    f"{where} imports {imp.target} {direction} "
                    f"({LAYERS[layers[own]][0]} -> {LAYERS[layers[target]][0]})"
                )
            if (
                imp.in_function
                and imp.target not in OPTIONAL_HEAVY_MODULES
                and not _lazy_namespace(imp, is_package)
            ):
                problems.append(f"{where} imports {imp.target} inside a function (import it at the top)")
            private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            if private and imp.target != module:
                problems.append(f"{where} imports private names {private} from {imp.target}")
    return problems


def _lazy_namespace(imp: Import, is_package: bool) -> bool:
    """A package's __init__ resolving its own public names lazily (importlib), which keeps imports cheap."""
    return is_package and imp.target.startswith(imp.module + ".")


def package_sources(src: Path = SRC) -> dict[str, tuple[str, bool]]:
    return {module_name(p, src): (p.read_text(), p.name == "__init__.py") for p in sorted(src.rglob("*.py"))}


def test_every_import_flows_down_the_layers():
    assert violations(package_sources()) == []


def test_an_upward_import_is_caught():
    sources = package_sources()
    formats_source, _ = sources["mixprec.formats"]
    # a numerics module reaching up into a workflow, as a top-level and as a hidden in-function import
    sources["mixprec.formats"] = (formats_source + "\nfrom mixprec.comparison import runner\n", False)
    sources["mixprec.gemm"] = (
        sources["mixprec.gemm"][0] + "\ndef _late():\n    from mixprec.training import convert\n",
        False,
    )
    found = violations(sources)
    assert any("mixprec.formats:" in v and "upward (formats -> workflows)" in v for v in found), found
    assert any("mixprec.gemm:" in v and "upward (seams -> wings)" in v for v in found), found
    assert any("mixprec.gemm:" in v and "inside a function" in v for v in found), found


def test_a_sideways_import_and_a_private_name_are_caught():
    sources = {
        "mixprec.training.convert": ("from mixprec.inference.schemes import SCHEMES\n", False),
        "mixprec.inference.linear": ("from mixprec.scaling import _secret\n", False),
    }
    found = violations(sources)
    assert any("sideways (wings -> wings)" in v for v in found), found
    assert any("private names ['_secret']" in v for v in found), found


def test_no_file_is_longer_than_the_limit():
    long = {
        str(p.relative_to(ROOT)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_package_is_on_exactly_one_layer_and_exists():
    layers = layer_of()  # asserts no package is listed twice
    present = {package_of(m) for m in package_sources() if m != "mixprec"}
    assert present - set(layers) == set(), "packages on no layer"
    assert set(layers) - present == set(), "layers name packages that do not exist"


def test_the_architecture_doc_shows_this_table():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\|\s*\d+\s*\|\s*(\w+)\s*\|\s*([^|]+?)\s*\|", doc, flags=re.M))
    want = {name: ", ".join(packages) for name, packages in LAYERS}
    got = {
        name: ", ".join(p.strip().strip("`").rstrip("/") for p in text.split(","))
        for name, text in rows.items()
    }
    assert got == want
