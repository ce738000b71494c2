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

import importlib
import re

import pytest

from architecture_rules import (
    FUNCTION_LINES,
    INFERENCE_ROOMS,
    LAYERS,
    LAYOUT_MODULE,
    LAZY,
    LONG_FUNCTIONS,
    MAX_LINES,
    NO_FUNCTION_LINES,
    PIPELINES,
    RANK_READERS_ALLOWED,
    RANKS_MODULE,
    ROOT,
    SRC,
    TRAINING_LAYER,
    TRAINING_LAYER_MAX_LINES,
    autograd_functions,
    every_function_length,
    function_lengths,
    imports_of,
    layer_of,
    module_arguments,
    module_classes,
    module_level_weak_tables,
    optimizer_steps,
    package_of,
    package_sources,
    rank_reads,
    room_of,
    spelled_tensor_names,
    violations,
    wing_violations,
)


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


def test_the_drawing_of_the_floors_is_the_table():
    """The drawing in docs/architecture.md: one line per floor, top down, naming the floor's packages."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    drawing = doc.split("```\n", 2)[1]
    floors = re.findall(r"^\s*(\d+) (\w+)\s+(.*)$", drawing, flags=re.M)
    assert [(int(n), name) for n, name, _ in floors] == [(i, name) for i, (name, _) in enumerate(LAYERS)][
        ::-1
    ]
    for (_, _, text), (_, packages) in zip(floors[::-1], LAYERS):
        assert set(packages) <= set(re.findall(r"[a-z_]+", text)), (text, packages)


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


def test_functions_read_as_short_steps():
    """No function over FUNCTION_LINES outside the allow-list, none at all over NO_FUNCTION_LINES, the
    allow-list exactly as long as what it allows (it may only shrink), the pipelines within their limits."""
    lengths = every_function_length()
    long = {name: n for name, n in lengths.items() if n > FUNCTION_LINES}
    assert long == LONG_FUNCTIONS, "shorten the new long functions; lower or remove entries that got shorter"
    assert max(lengths.values()) < NO_FUNCTION_LINES
    assert {name: lengths[name] for name in PIPELINES if lengths[name] > PIPELINES[name]} == {}


def test_a_long_function_is_measured():
    body = "".join(f"    x{i} = {i}\n" for i in range(90))
    source = f"def f():\n{body}\n\nclass C:\n    @property\n    def g(self):\n        def h():\n            return 1\n\n        return h\n"
    assert function_lengths(source, "m") == {"m.f": 91, "m.C.g": 5, "m.C.g.h": 2}


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
