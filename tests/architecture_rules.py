"""The rules tests/test_architecture.py enforces, read from syntax trees: the layer table and how each
form of import is found, the inference wing's rooms, where checkpoint tensor names, rank reads and
optimizer steps may appear, and function lengths. Kept apart from the tests so that each file stays short."""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

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
    ("finetuning", ("finetune",)),
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
    ("algorithms", ("algorithms",)),  # what wins back accuracy over round-to-nearest: GPTQ, ...
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


FUNCTION_LINES = 80  # the limit of every function in src/, docstring included
NO_FUNCTION_LINES = 100  # not even an allow-listed function reaches this
# Functions over FUNCTION_LINES as they stand, with their lengths: the list may only shrink (the test
# fails when an entry got shorter or went away, so that the list is lowered with it).
LONG_FUNCTIONS: dict[str, int] = {
    # one @triton.jit body: its loads, block scales, rounding and stores share registers
    "mixprec.kernels.triton_quant._quant_kernel": 82,
}
# The pipelines that read as a handful of steps: each within its own, tighter limit.
PIPELINES: dict[str, int] = {
    "mixprec.inference.producers.quantize.quantize_checkpoint": 60,
    "mixprec.comparison.training_run.train_run": 60,
    "mixprec.comparison.runner.compare": 60,
}


def function_lengths(source: str, module: str = "") -> dict[str, int]:
    """{"module.Class.function": lines from its `def` to its last line} of every function and method
    (nested ones too, under their enclosing function's name); decorators are not counted."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), f"{module}." if module else "")
    return out


def every_function_length() -> dict[str, int]:
    lengths: dict[str, int] = {}
    for module, (source, _) in package_sources().items():
        lengths.update(function_lengths(source, module))
    return lengths


LAZY = lazy_tables()


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
