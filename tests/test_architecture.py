"""The layer table of the package, enforced: imports flow one way, one home per concept stays visible.

Every module of src/mixprec is read as a syntax tree (nothing is imported), and each of its references
to mixprec is checked against LAYERS: a module may import its own package and packages on lower layers,
nothing on its own layer (sideways) or above it (upward). A reference is any form that can import:
`import` / `from ... import` at module level or inside functions; `import mixprec` followed by
attribute access (`mixprec.comparison.runner`); and any string that names a mixprec module — what
`importlib.import_module("mixprec...")`, `__import__("mixprec...")` and a package's lazy `_EXPORTS`
table (`"mixprec.training.step:TrainingStep"`) hand to the import machinery. An `import_module` or
`__import__` whose name is computed cannot be followed, so it is refused, except in a package's lazy
namespace, whose table of strings is checked instead. docs/architecture.md shows the same table; a test
below keeps the two equal.
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

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


# a string naming a mixprec module, with an optional ":attribute" (the lazy tables' form)
MODULE_STRING = re.compile(r"^(mixprec(?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_]\w*)?$")
IMPORT_CALLS = ("import_module", "__import__")
# packages whose lazy namespace computes the module name from a table of strings (checked as strings)
LAZY_TABLES = ("_EXPORTS", "_MODULES")


def existing_packages(src: Path = SRC) -> set[str]:
    """The first names under mixprec that exist (module files and sub-packages)."""
    return {p.stem for p in src.glob("*.py")} | {
        p.name for p in src.iterdir() if (p / "__init__.py").exists()
    }


def _inside_functions(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(inner) for inner in ast.walk(node) if inner is not node)
    return inside


def _from_import(module: str, node: ast.ImportFrom, is_package: bool, inside: bool) -> list[Import]:
    target = node.module or ""
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join([*base, target] if target else base)
    if not (target == "mixprec" or target.startswith("mixprec.")):
        return []
    names = tuple(a.name for a in node.names)
    if target == "mixprec":  # `from mixprec import formats` imports the submodules
        return [Import(module, f"mixprec.{n}", (), inside, node.lineno) for n in names if n != "__version__"]
    return [Import(module, target, names, inside, node.lineno)]


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None when the chain does not start at a plain name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def imports_of(module: str, source: str, is_package: bool = False) -> list[Import]:
    """Every reference to a mixprec module in a module's source, with whether it sits inside a function."""
    tree = ast.parse(source)
    in_function = _inside_functions(tree)
    packages = existing_packages()
    aliases = {  # names bound to the mixprec package itself by `import mixprec [as m]`
        a.asname or a.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for a in node.names
        if a.name == "mixprec"
    }
    lazy = is_package and any(
        isinstance(node, ast.Assign) and any(getattr(t, "id", "") in LAZY_TABLES for t in node.targets)
        for node in tree.body
    )
    found = []
    for node in ast.walk(tree):
        inside = id(node) in in_function
        if isinstance(node, ast.ImportFrom):
            found += _from_import(module, node, is_package, inside)
        elif isinstance(node, ast.Import):
            found += [
                Import(module, a.name, (), inside, node.lineno)
                for a in node.names
                if a.name.startswith("mixprec.")
            ]
        elif isinstance(node, ast.Attribute) and aliases:
            chain = _attribute_chain(node)
            if chain and chain[0] in aliases and len(chain) > 1 and chain[1] in packages:
                found.append(Import(module, f"mixprec.{chain[1]}", (), inside, node.lineno))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = MODULE_STRING.match(node.value)
            if match and match.group(1).split(".")[1] in packages:
                found.append(Import(module, match.group(1), (), inside, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) in IMPORT_CALLS
        ):
            named = node.args and isinstance(node.args[0], ast.Constant)
            if not named and not lazy:
                found.append(Import(module, COMPUTED, (), inside, node.lineno))
    return found


# the target of an import whose module name is computed at run time
COMPUTED = "<computed>"


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
            if imp.target == COMPUTED:
                problems.append(
                    f"{where} imports a module whose name is computed (the layers cannot be checked)"
                )
                continue
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
        "mixprec.inference.runtime.linear": ("from mixprec.scaling import _secret\n", False),
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


def test_every_form_of_an_upward_import_is_caught():
    """The forms a plain import scan misses: a new entry of a package's lazy table, __import__, `import
    mixprec` then attribute access, and import_module with a computed name."""
    sources = package_sources()
    training_init, _ = sources["mixprec.training"]
    sources["mixprec.training"] = (
        training_init.replace(
            "_EXPORTS = {", '_EXPORTS = {\n    "compare": "mixprec.comparison.runner:compare",'
        ),
        True,
    )
    sources["mixprec.gemm"] = (
        sources["mixprec.gemm"][0] + '\n_runner = __import__("mixprec.comparison.runner")\n',
        False,
    )
    sources["mixprec.scaling"] = (
        sources["mixprec.scaling"][0]
        + "\nimport mixprec\n\ndef _late(x):\n    return mixprec.demo.run_demo(x)\n",
        False,
    )
    sources["mixprec.formats"] = (
        sources["mixprec.formats"][0]
        + '\nimport importlib\n\ndef _any(name):\n    return importlib.import_module("mixprec." + name)\n',
        False,
    )
    found = violations(sources)
    assert any(
        "mixprec.training:" in v and "mixprec.comparison.runner upward (wings -> workflows)" in v
        for v in found
    ), found
    assert any(
        "mixprec.gemm:" in v and "mixprec.comparison.runner upward (seams -> workflows)" in v for v in found
    ), found
    assert any("mixprec.scaling:" in v and "mixprec.demo upward (scaling -> demo)" in v for v in found), found
    assert any("mixprec.formats:" in v and "name is computed" in v for v in found), found
    # and none of them is reported in the package as it is
    assert violations(package_sources()) == []


def test_strings_that_only_look_like_modules_are_not_imports():
    """ONNX metadata keys ("mixprec.source_model") and API names in messages ("mixprec.load_quantized")
    name no module: they are not references."""
    source = 'KEY = "mixprec.source_model"\nAPI = "mixprec.load_quantized"\nDOC = "see mixprec.comparison for more"\n'
    assert imports_of("mixprec.formats", source) == []
    assert [i.target for i in imports_of("mixprec.formats", 'X = "mixprec.comparison.runner:compare"\n')] == [
        "mixprec.comparison.runner"
    ]


# The rooms of the inference wing, lowest first, held like LAYERS: a module of the wing may import its
# own room and the rooms below it, never a room beside it or above it. A room is the first name under
# mixprec.inference (a module file or a sub-package). The wing's package itself is its lazy public
# namespace, which names every room by design.
INFERENCE_ROOMS: list[tuple[str, tuple[str, ...]]] = [
    ("schemes", ("schemes",)),  # what a scheme is: formats, granularities, serving rules
    ("mixed", ("mixed",)),  # one scheme per Linear (a mixed checkpoint)
    ("checkpoint", ("checkpoint",)),  # safetensors IO, the layout table, the scales file, publish
    ("calibration", ("calibration",)),  # data, observers, the run, layer by layer
    ("runtime", ("runtime",)),  # QuantizedLinear, unfused experts, a live model's quantization
    ("products", ("producers", "readers")),  # quantize / save / convert; load / inspect
]
WING = "mixprec.inference"


def room_of(module: str) -> str:
    """The room of a module of the inference wing ("" for the wing's package itself)."""
    return module[len(WING) + 1 :].split(".")[0] if module.startswith(WING + ".") else ""


def wing_violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """What breaks the order of INFERENCE_ROOMS in {module: (source, is_package)}."""
    level = {room: i for i, (_, rooms) in enumerate(INFERENCE_ROOMS) for room in rooms}
    problems = []
    for module, (source, is_package) in sorted(sources.items()):
        own = room_of(module)
        if not own:
            continue
        if own not in level:
            problems.append(f"{module}: room {own!r} is in no row of INFERENCE_ROOMS")
            continue
        for imp in imports_of(module, source, is_package):
            target = room_of(imp.target)
            if not target or target == own:
                continue
            where = f"{module}:{imp.line}"
            if target not in level:
                problems.append(f"{where} imports {imp.target}, which is in no room")
            elif level[target] >= level[own]:
                direction = "sideways" if level[target] == level[own] else "upward"
                problems.append(f"{where} imports {imp.target} {direction} ({own} -> {target})")
    return problems


def test_the_inference_wing_keeps_its_rooms_in_order():
    sources = package_sources()
    assert wing_violations(sources) == []
    present = {room_of(m) for m in sources if room_of(m)}
    assert present == {room for _, rooms in INFERENCE_ROOMS for room in rooms}


def test_an_inverted_import_inside_the_wing_is_caught():
    sources = package_sources()
    linear, _ = sources["mixprec.inference.runtime.linear"]
    # a runtime layer reaching into a producer; the checkpoint room into calibration (in a function);
    # a reader taking a producer's helper (sideways)
    sources["mixprec.inference.runtime.linear"] = (
        linear + "\nfrom mixprec.inference.producers.quantize import quantize_checkpoint\n",
        False,
    )
    sources["mixprec.inference.checkpoint.publish"] = (
        sources["mixprec.inference.checkpoint.publish"][0]
        + "\ndef _late():\n    from mixprec.inference.calibration.run import calibrate\n",
        False,
    )
    sources["mixprec.inference.readers.load"] = (
        sources["mixprec.inference.readers.load"][0]
        + '\n_SAVE = "mixprec.inference.producers.save:save_quantized"\n',
        False,
    )
    found = wing_violations(sources)
    assert any(
        "mixprec.inference.runtime.linear:" in v and "upward (runtime -> producers)" in v for v in found
    ), found
    assert any(
        "mixprec.inference.checkpoint.publish:" in v and "upward (checkpoint -> calibration)" in v
        for v in found
    ), found
    assert any(
        "mixprec.inference.readers.load:" in v and "sideways (readers -> producers)" in v for v in found
    ), found


# The one module that may spell checkpoint tensor names (the layout table); everything else takes them
# from it. File-format names (model.fp8_scales.json) are no tensor names and stay where they are.
LAYOUT_MODULE = "mixprec.inference.checkpoint.layout"


def tensor_name_strings(source: str, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, string) of every string constant — f-string pieces included — equal to a checkpoint
    tensor name or ending in "." + one: a name spelled outside the layout table."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and any(node.value == n or node.value.endswith("." + n) for n in names)
        ):
            found.append((node.lineno, node.value))
    return found


def spelled_tensor_names(sources: dict[str, tuple[str, bool]]) -> list[str]:
    names = importlib.import_module(LAYOUT_MODULE).TENSOR_NAMES
    return [
        f"{module}:{line} spells {value!r}"
        for module, (source, _) in sorted(sources.items())
        if module != LAYOUT_MODULE
        for line, value in tensor_name_strings(source, names)
    ]


def test_checkpoint_tensor_names_are_spelled_only_in_the_layout_table():
    assert spelled_tensor_names(package_sources()) == []


def test_a_tensor_name_spelled_outside_the_layout_table_is_caught():
    sources = {
        "mixprec.inference.readers.load": ('def f(m):\n    return f"{m}.weight_scale_2"\n', False),
        "mixprec.inference.producers.save": ('KEY = "input_global_scale"\n', False),
        "mixprec.inference.runtime.linear": ('SUFFIX = ".k_scale"\nTEXT = "the k_scale tensors"\n', False),
        LAYOUT_MODULE: ('WEIGHT_SCALE = "weight_scale"\n', False),
    }
    found = spelled_tensor_names(sources)
    assert found == [
        "mixprec.inference.producers.save:1 spells 'input_global_scale'",
        "mixprec.inference.readers.load:2 spells '.weight_scale_2'",
        "mixprec.inference.runtime.linear:1 spells '.k_scale'",
    ], found


def test_the_runtime_layers_name_their_buffers_from_the_layout_table():
    layout = importlib.import_module(LAYOUT_MODULE)
    linear = importlib.import_module("mixprec.inference.runtime.linear")
    schemes = importlib.import_module("mixprec.inference.schemes")
    torch = importlib.import_module("torch")
    for name in ("fp8-static", "fp8-block", "nvfp4", "mxfp8"):
        layer = linear.QuantizedLinear.from_linear(torch.nn.Linear(64, 32, bias=False), schemes.SCHEMES[name])
        buffers = {b for b, _ in layer.named_buffers()}
        assert buffers and buffers <= {layout.WEIGHT, *layout.TENSOR_NAMES}, (name, buffers)


WING_FUNCTION_LINES = 80  # every function of the inference wing, its docstring included
PIPELINE_LINES = 60  # quantize_checkpoint: the pipeline over its job


def function_lengths(source: str) -> dict[str, int]:
    """{function name: lines from its `def` to its last line} of every function and method."""
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_the_inference_wing_reads_as_short_steps():
    sources = package_sources()
    long = {
        f"{module}.{name}": n
        for module, (source, _) in sources.items()
        if module == WING or module.startswith(WING + ".")
        for name, n in function_lengths(source).items()
        if n > WING_FUNCTION_LINES
    }
    assert long == {}
    quantize, _ = sources["mixprec.inference.producers.quantize"]
    assert function_lengths(quantize)["quantize_checkpoint"] <= PIPELINE_LINES


def test_a_long_function_is_measured():
    body = "".join(f"    x{i} = {i}\n" for i in range(90))
    assert function_lengths(f"def f():\n{body}\n\nclass C:\n    def g(self):\n        return 1\n") == {
        "f": 91,
        "g": 2,
    }


LAZY_PACKAGES = ("mixprec", "mixprec.training", "mixprec.inference")


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_lazy_export_resolves_to_what_its_table_names(package):
    """Each public name of a lazy namespace is importable by its dotted name and is the very object its
    table entry ("module:attribute") names: a typo in the table would surface only when a user asks."""
    namespace = importlib.import_module(package)
    table = namespace._EXPORTS
    assert set(namespace.__all__) >= set(table)
    for name, entry in table.items():
        module, attr = entry.split(":")
        assert getattr(namespace, name) is getattr(importlib.import_module(module), attr), (package, name)
    for name, module in getattr(namespace, "_MODULES", {}).items():
        assert getattr(namespace, name) is importlib.import_module(module), (package, name)
