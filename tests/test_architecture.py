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
    ("base", ("files", "progress", "ranks", "verdicts")),
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


def lazy_tables(src: Path = SRC) -> dict[str, dict[str, dict[str, str]]]:
    """{package: {table: {public name: where}}} for every package whose __init__ assigns a lazy table
    (`_EXPORTS`: "module:attribute"; `_MODULES`: a module), read from the syntax trees."""
    found: dict[str, dict[str, dict[str, str]]] = {}
    for path in sorted(src.rglob("__init__.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if getattr(target, "id", "") in LAZY_TABLES:
                        tables = found.setdefault(module_name(path, src), {})
                        tables[target.id] = ast.literal_eval(node.value)
    return found


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


LAZY = lazy_tables()


def test_the_lazy_namespaces_are_found():
    assert {"mixprec", "mixprec.training", "mixprec.inference"} <= set(LAZY)
    assert all(tables.get("_EXPORTS") or tables.get("_MODULES") for tables in LAZY.values())


@pytest.mark.parametrize("package", sorted(LAZY))
def test_every_lazy_export_resolves_to_what_its_table_names(package):
    """Each public name of a lazy namespace is importable by its public dotted name and is the very object
    its table entry names: `from mixprec.pkg import Name` gives the table's "module:attribute", and a
    public module `mixprec.pkg.X` of `_MODULES` imports as `import mixprec.pkg.X` (an attribute that only
    resolves through the table would fail there). A typo in a table would surface only when a user asks."""
    namespace = importlib.import_module(package)
    tables = LAZY[package]
    exports = tables.get("_EXPORTS", {})
    assert set(namespace.__all__) >= set(exports)
    for name, entry in exports.items():
        module, attr = entry.split(":")
        imported: dict[str, object] = {}
        exec(f"from {package} import {name}", imported)
        assert imported[name] is getattr(importlib.import_module(module), attr), (package, name)
    for name, module in tables.get("_MODULES", {}).items():
        public = importlib.import_module(f"{package}.{name}")
        assert public is importlib.import_module(module), (package, name)
        assert getattr(namespace, name) is public, (package, name)


@pytest.mark.parametrize(
    ("old", "real"), [("optim", "mixprec.training.optim"), ("hardware", "mixprec.kernels.hardware")]
)
def test_the_old_module_attributes_warn_and_name_the_real_module(old, real):
    """`mixprec.optim` and `mixprec.hardware` were attributes that `import mixprec.optim` could not import:
    for one release they still resolve, with a DeprecationWarning that says where the module lives."""
    import mixprec

    with pytest.warns(DeprecationWarning, match=re.escape(real)):
        module = getattr(mixprec, old)
    assert module is importlib.import_module(real)
    assert old not in LAZY["mixprec"].get("_MODULES", {})


# ---- one notion of rank, one training loop ---------------------------------------------------------
# The one module that asks torch.distributed and torchrun's environment who this process is.
RANKS_MODULE = "mixprec.ranks"
RANK_CALLS = ("get_rank", "get_world_size", "is_initialized")
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# modules allowed to read the rank themselves, each with the reason (this list may only shrink):
RANK_READERS_ALLOWED: dict[str, str] = {}


def rank_reads(source: str) -> list[str]:
    """Where a module asks for its rank or world itself: calls of torch.distributed's get_rank /
    get_world_size / is_initialized (under any alias; `torch.cuda.is_initialized` asks something else)
    and torchrun's RANK / WORLD_SIZE / LOCAL_RANK named as strings (os.environ[...], .get, getenv, `in`).
    Docstrings are text, not reads."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            chain = _attribute_chain(func) if isinstance(func, ast.Attribute) else None
            asks_cuda = chain is not None and len(chain) > 1 and chain[-2] == "cuda"
            if name in RANK_CALLS and not asks_cuda:
                found.append(f"{node.lineno}: {name}()")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name in RANK_CALLS]
        elif isinstance(node, ast.Constant) and node.value in RANK_VARIABLES and id(node) not in docstrings:
            found.append(f"{node.lineno}: {node.value!r}")
    return found


def test_rank_and_world_are_read_in_one_module():
    readers = {}
    for module, (source, _) in package_sources().items():
        if module == RANKS_MODULE or module in RANK_READERS_ALLOWED:
            continue
        if found := rank_reads(source):
            readers[module] = found
    assert readers == {}, f"read the rank and world through {RANKS_MODULE}: {readers}"
    assert rank_reads(package_sources()[RANKS_MODULE][0]), "the ranks module reads nothing any more?"


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\nr = dist.get_rank()\n",
        "import torch\nw = torch.distributed.get_world_size(group)\n",
        "from torch.distributed import is_initialized\n",
        "import torch.distributed as d\nok = d.is_available() and d.is_initialized()\n",
        'import os\nr = int(os.environ["RANK"])\n',
        'import os\nr = os.environ.get("LOCAL_RANK", "0")\n',
        'import os\nw = os.getenv("WORLD_SIZE")\n',
        'import os\nlaunched = "WORLD_SIZE" in os.environ\n',
    ],
)
def test_every_form_of_a_rank_read_is_caught(source):
    assert rank_reads(source), source


def test_what_only_looks_like_a_rank_read_is_not_one():
    source = (
        '"""Reads RANK from the environment."""\nimport torch\n'
        'ok = torch.cuda.is_initialized()\nmsg = f"WORLD_SIZE={w!r} is not an integer"\n'
    )
    assert rank_reads(source) == []


# the names an optimizer goes by (optimizer, opt, self.optimizer, inner_optim, optimizers[...] excluded)
OPTIMIZER_NAME = re.compile(r"^_*(\w+_)?(optimizer|optim|opt)$")


def _optimizer_named(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return bool(OPTIMIZER_NAME.match(name))


def optimizer_steps(source: str) -> list[int]:
    """Lines that step an optimizer: `<optimizer>.step(...)`, or any `.step(<optimizer>)` (a GradScaler
    steps the optimizer it is given). Docstring examples are text, not calls."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "step"
        and (_optimizer_named(node.func.value) or any(_optimizer_named(a) for a in node.args))
    ]


def test_only_the_training_wing_steps_an_optimizer():
    """One training loop: the optimizer step (with clipping, loss scaling, skip agreement and the
    scaling advance around it) is TrainingStep's; the comparison run and the profile loop call it."""
    stepping = {
        module: lines
        for module, (source, _) in package_sources().items()
        if package_of(module) != "training" and (lines := optimizer_steps(source))
    }
    assert stepping == {}


@pytest.mark.parametrize(
    "source",
    ["optimizer.step()\n", "self.optimizer.step()\n", "opt.step()\n", "scaler.step(optimizer)\n"],
)
def test_an_optimizer_step_is_caught(source):
    assert optimizer_steps(source) == [1]


def test_other_steps_are_not_optimizer_steps():
    assert optimizer_steps('"""optimizer.step()"""\nscheduler.step()\nstep.step(skip=True)\n') == []


WEAK_TABLES = ("WeakKeyDictionary", "WeakValueDictionary")


def module_level_weak_tables(source: str) -> list[str]:
    """Module-level names bound to a table keyed by live objects (a registry that outlives calls)."""
    found = []
    for node in ast.parse(source).body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call):
            func = value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in WEAK_TABLES:
                found.append(f"{node.lineno}: {name}")
    return found


def test_no_module_level_registry_keeps_the_amax_reduction():
    """The amax reduction is bound into the training step (TrainingStep(parallel=...), reduce=), never
    registered on a model in a module-level table."""
    tables = {m: f for m, (source, _) in package_sources().items() if (f := module_level_weak_tables(source))}
    assert tables == {}
    assert module_level_weak_tables("import weakref\n_R: dict = weakref.WeakKeyDictionary()\n")
    import mixprec.distributed
    from mixprec.training import scaling_state

    for gone in ("use_amax_reduction", "amax_reduction"):
        assert not hasattr(scaling_state, gone)
    assert not hasattr(mixprec.distributed, "register_amax_reduction")


# ---- the training layer: its GEMMs' autograd Function is given a quantizer state, not the layer ----

TRAINING_LAYER = SRC / "training" / "low_precision_linear.py"
TRAINING_LAYER_MAX_LINES = 300


def module_classes(sources: dict[str, tuple[str, bool]]) -> set[str]:
    """The names of the classes of the sources that derive from nn.Module (directly, or through
    another of these classes), and torch's own module names as they are written in annotations."""
    bases: dict[str, set[str]] = {}
    for source, _ in sources.values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                names = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                bases.setdefault(node.name, set()).update(names)
    found = {"Module", "Linear"}
    while True:
        more = {name for name, b in bases.items() if b & found} - found
        if not more:
            return found
        found |= more


def autograd_functions(source: str) -> list[ast.ClassDef]:
    """The classes of a module that subclass torch.autograd.Function (written `torch.autograd.Function`,
    `autograd.Function` or, imported, `Function`)."""

    def is_function(base: ast.expr) -> bool:
        if isinstance(base, ast.Name):
            return base.id == "Function"
        return isinstance(base, ast.Attribute) and (_attribute_chain(base) or [])[-2:] == [
            "autograd",
            "Function",
        ]

    return [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef) and any(is_function(b) for b in node.bases)
    ]


def module_arguments(function: ast.ClassDef, modules: set[str]) -> list[str]:
    """The arguments of the Function's forward (after ctx) that are not annotated, or whose annotation
    names an nn.Module class."""
    forward = next(n for n in function.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    wrong = []
    for arg in [*forward.args.args[1:], *forward.args.kwonlyargs]:
        named = set()
        for node in ast.walk(arg.annotation) if arg.annotation is not None else ():
            if isinstance(node, ast.Name):
                named.add(node.id)
            elif isinstance(node, ast.Attribute):
                named.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.update(re.findall(r"\w+", node.value))
        if arg.annotation is None or named & modules:
            wrong.append(
                f"{function.name}.forward({arg.arg}: {ast.unparse(arg.annotation or ast.Name('?'))})"
            )
    return wrong


def test_the_training_gemm_function_takes_no_module():
    """Every autograd.Function of the training wing (the GEMMs of the training layer) takes tensors and
    the layer's quantizer state: no argument of its forward is an nn.Module (the test of the training
    layer spies on `apply` in a real call: tests/training/test_low_precision_linear.py)."""
    sources = package_sources()
    modules = module_classes(sources)
    functions = [
        f
        for name, (source, _) in sources.items()
        if name.startswith("mixprec.training.")
        for f in autograd_functions(source)
    ]
    assert [f.name for f in functions] == ["LinearGemms"]
    assert [w for f in functions for w in module_arguments(f, modules)] == []
    # the check sees a layer passed in, by its class name or as nn.Module
    passed_the_layer = autograd_functions(
        "class F(torch.autograd.Function):\n"
        "    @staticmethod\n"
        "    def forward(ctx, x: torch.Tensor, layer: LowPrecisionLinear, m: 'nn.Module', n):\n"
        "        return x\n"
    )[0]
    assert module_arguments(passed_the_layer, modules) == [
        "F.forward(layer: LowPrecisionLinear)",
        "F.forward(m: 'nn.Module')",
        "F.forward(n: ?)",
    ]


def test_the_training_layer_file_is_short():
    assert len(TRAINING_LAYER.read_text().splitlines()) <= TRAINING_LAYER_MAX_LINES
