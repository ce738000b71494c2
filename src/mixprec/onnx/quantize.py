"""`mixprec quantize-onnx`: FP8 E4M3 QuantizeLinear/DequantizeLinear graphs (opset >= 19).

Every MatMul / Gemm whose weight is a 2-D fp32 initializer gets its weight stored as FLOAT8E4M3FN with
fp32 scales (per output channel, or one per tensor) and a DequantizeLinear in front of it. With
calibration inputs the activations feeding those nodes also get static per-tensor scales and a
QuantizeLinear -> DequantizeLinear pair (amax over the calibration runs / 448); without, the graph is
weight-only. Payloads and scales come from mixprec.quantization, so they are bit-identical to what the
PyTorch path produces (scale = amax / 448, payload = saturating RNE cast of w / scale).

onnxruntime's CPU provider runs both QuantizeLinear to float8 and DequantizeLinear from float8 (checked
with onnxruntime 1.32 at opsets 19 and 21); it computes the MatMul in fp32 on the dequantized values,
so on CPU the FP8 graph is smaller, not faster.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from mixprec.errors import MixprecError
from mixprec.files import check_new_output
from mixprec.formats import E4M3
from mixprec.onnx.check import check_fp8_onnx
from mixprec.onnx.common import (
    MIN_OPSET,
    check_output,
    default_opset,
    load_model,
    need_onnx,
    need_ort,
    run_session,
    save_model_atomic,
)
from mixprec.onnx.inputs import check_counts, synthetic_inputs
from mixprec.quantization import quantize
from mixprec.scaling import Granularity, compute_scale
from mixprec.select import check_pattern, selects

SCHEMA_VERSION = 2  # 2: max_error and written
DEFAULT_EXCLUDE = ("lm_head",)  # as in the PyTorch inference defaults: the output head stays high precision


@dataclass
class QuantizeOnnxReport:
    input: str
    output: str
    granularity: str
    activations: str  # "static" or "none (weight-only)"
    opset: int
    weights: list[dict] = field(default_factory=list)
    activation_scales: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    weight_bytes_before: int = 0  # bytes of all initializers
    weight_bytes_after: int = 0
    file_bytes_after: int = 0
    check: dict | None = None
    notes: list[str] = field(default_factory=list)
    max_error: float | None = None  # the limit on the check's worst relative L2 error, if any
    written: bool = False  # False when the check exceeded max_error: no output file exists

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}


class MaxErrorExceeded(MixprecError):
    """The FP8 graph's check exceeded max_error; nothing was written. `report` holds the measurements."""

    def __init__(self, message: str, report: QuantizeOnnxReport):
        super().__init__(message)
        self.report = report


def check_max_error(max_error: float | None, check: bool) -> None:
    if max_error is None:
        return
    if not check:
        raise MixprecError("--max-error needs the check (drop --no-check)")
    if not (math.isfinite(max_error) and max_error > 0):
        raise MixprecError(f"--max-error {max_error}: a positive relative error is expected (e.g. 0.05)")


def check_quantize_inputs(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    force: bool = False,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    check: bool = True,
    max_error: float | None = None,
    calib_data: str | os.PathLike | None = None,
    tokenizer: str | os.PathLike | None = None,
    calib_samples: int = 32,
    calib_seq_len: int = 64,
    json_path: str | os.PathLike | None = None,
) -> None:
    """Every check of quantize-onnx's arguments that needs no graph loaded: paths, counts, patterns."""
    check_max_error(max_error, check)
    check_counts(calib_samples, calib_seq_len)
    for pattern in exclude:
        check_pattern(pattern, "--exclude pattern")
    src, dst = Path(input_path), Path(output_path)
    if src.is_dir():
        raise MixprecError(f"--input {src} is a directory; an .onnx file is expected")
    if not src.is_file():
        raise MixprecError(f"--input {src} does not exist")
    check_output(dst, force, (src,))
    if calib_data is not None and not Path(calib_data).exists():
        raise MixprecError(f"--calib-data {calib_data} does not exist")
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise MixprecError(f"--tokenizer {tokenizer} is not a directory (a model or tokenizer directory)")
    if json_path is not None:
        j = Path(json_path)
        if j.is_dir():
            raise MixprecError(f"--json {j} is a directory; give the file to write")
        if j.absolute() in (dst.absolute(), src.absolute()):
            raise MixprecError(f"--json {j} is also the ONNX input or output")
        check_new_output(j, force, label="--json")


def module_path(node) -> str:
    """The torch module a node came from (torch exporter metadata), else the node's name."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            scopes = [s.strip(" '\"") for s in prop.value.strip("[]").split(",")]
            if len(scopes) >= 2:
                path = scopes[-2]
                return path.split(".", 1)[1] if path.startswith("model.") else path
    return node.name


def _excluded(labels: Sequence[str], patterns: Sequence[str]) -> str | None:
    """The first pattern (mixprec.select) selecting one of a node's labels: module path, node and
    initializer names."""
    for pattern in patterns:
        for label in labels:
            if label and selects(label, pattern):
                return pattern
    return None


def _weight_axis(node) -> int:
    """Axis of the weight initializer that indexes output channels."""
    if node.op_type == "MatMul":
        return 1  # B is [K, N]
    trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
    return 0 if trans_b else 1


def quantize_weight_array(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 E4M3 codes shaped like w, fp32 scales: [C] along `axis`, or a scalar for axis=None)."""
    t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    rows = t if axis in (None, 0) else t.T  # channel axis first: one scale per row
    q = quantize(rows.contiguous(), E4M3, Granularity.tensor() if axis is None else Granularity.rows())
    payload = q.data if axis in (None, 0) else q.data.T
    codes = payload.contiguous().view(torch.uint8).numpy()
    scale = q.scale.reshape(()) if axis is None else q.scale.reshape(-1)
    return codes, scale.numpy().astype(np.float32)


def _fp8_tensor(name: str, codes: np.ndarray):
    onnx = need_onnx()
    t = onnx.TensorProto()
    t.name = name
    t.data_type = onnx.TensorProto.FLOAT8E4M3FN
    t.dims.extend(codes.shape)
    t.raw_data = codes.astype(np.uint8).tobytes()
    return t


def _fp8_zero(name: str, shape: tuple[int, ...]):
    return _fp8_tensor(name, np.zeros(shape, dtype=np.uint8))


def _unique(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


@dataclass(frozen=True)
class OnnxQuantizeJob:
    """One quantize_onnx call with its arguments checked: what the steps of the rewrite read."""

    src: Path
    dst: Path
    granularity: str  # "channel" or "tensor"
    exclude: tuple[str, ...]  # checked mixprec.select patterns
    calib_inputs: list[dict[str, np.ndarray]] | None
    check_inputs: list[dict[str, np.ndarray]] | None
    force: bool
    check: bool
    max_error: float | None

    def weight_axis(self, channel_axis: int) -> int | None:
        """The DequantizeLinear axis of a weight: its output channels, or None for one scale per tensor."""
        return channel_axis if self.granularity == "channel" else None


class Target(NamedTuple):
    """A MatMul / Gemm whose weight becomes FP8."""

    node: Any
    weight: str  # the initializer's name
    axis: int  # the weight's output-channel axis
    label: str  # the torch module it came from (module_path)


@dataclass
class GraphEdit:
    """The graph being rewritten, its initializers by name and every name already taken in it."""

    graph: Any
    initializers: dict[str, Any]
    taken: set[str]

    @classmethod
    def of(cls, graph) -> GraphEdit:
        taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
        taken |= {i.name for i in graph.input} | {n.name for n in graph.node}
        return cls(graph, {t.name: t for t in graph.initializer}, taken)

    def unique(self, base: str) -> str:
        return _unique(base, self.taken)


def quantize_onnx(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    granularity: str = "channel",
    calib_inputs: list[dict[str, np.ndarray]] | None = None,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    check_inputs: list[dict[str, np.ndarray]] | None = None,
    force: bool = False,
    check: bool = True,
    max_error: float | None = None,
) -> QuantizeOnnxReport:
    """Write an FP8 Q/DQ copy of `input_path` to `output_path` and (check=True) compare the two in onnxruntime.

    granularity: "channel" (per output channel weight scales) or "tensor". calib_inputs: feeds
    (input name -> array) for static activation scales; None gives a weight-only graph. The check runs
    on calib_inputs, else check_inputs, else synthetic inputs (see mixprec.onnx.inputs).
    max_error: the worst relative L2 error the check may find; the graph is checked before it is
    published, and over the limit MaxErrorExceeded is raised (its `report` holds the check) and nothing
    is written.
    """
    job = _job(
        input_path, output_path, granularity, calib_inputs, exclude, check_inputs, force, check, max_error
    )
    model, opset = _load_at_fp8_opset(job)
    report = QuantizeOnnxReport(
        str(job.src), str(job.dst), granularity, "static" if calib_inputs else "none (weight-only)",
        max(opset, MIN_OPSET), weight_bytes_before=initializer_bytes(model), max_error=max_error,
    )  # fmt: skip
    edit = GraphEdit.of(model.graph)
    targets = _select_targets(edit, job, report)
    weight_nodes = _quantize_weights(edit, targets, job, report)
    activation_nodes = _quantize_activations(edit, targets, job, report) if calib_inputs else {}
    _place_nodes(model.graph, weight_nodes, activation_nodes)
    _drop_unread_initializers(model.graph)
    _set_opset(model, report.opset)
    _check_graph(model)
    report.weight_bytes_after = initializer_bytes(model)
    save_model_atomic(model, job.dst, vet=partial(_vet, job, model, report))
    report.written = True
    return report


def _job(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    granularity: str,
    calib_inputs: list[dict[str, np.ndarray]] | None,
    exclude: Sequence[str],
    check_inputs: list[dict[str, np.ndarray]] | None,
    force: bool,
    check: bool,
    max_error: float | None,
) -> OnnxQuantizeJob:
    """The arguments checked before the graph is read."""
    need_onnx()
    check_max_error(max_error, check)
    if granularity not in ("channel", "tensor"):
        raise MixprecError(f"granularity must be 'channel' or 'tensor', got {granularity!r}")
    patterns = tuple(check_pattern(p, "--exclude pattern") for p in exclude)
    return OnnxQuantizeJob(Path(input_path), Path(output_path), granularity, patterns, calib_inputs,
                           check_inputs, force, check, max_error)  # fmt: skip


def _load_at_fp8_opset(job: OnnxQuantizeJob):
    """(the graph, its original opset), converted to the opset FP8 Q/DQ needs when it is older."""
    model = load_model(job.src)
    check_output(job.dst, job.force, (job.src,))
    opset = default_opset(model)
    if opset < MIN_OPSET:
        try:
            from onnx import version_converter

            model = version_converter.convert_version(model, MIN_OPSET)
        except Exception as exc:
            raise MixprecError(
                f"{job.src} is at opset {opset}; FP8 Q/DQ needs {MIN_OPSET} and the conversion failed: {exc}"
            ) from None
    return model, opset


def _select_targets(edit: GraphEdit, job: OnnxQuantizeJob, report: QuantizeOnnxReport) -> list[Target]:
    """1. Which nodes get an FP8 weight; the others that read a weight initializer are reported skipped."""
    onnx = need_onnx()
    targets = []
    for node in edit.graph.node:
        if (
            node.op_type not in ("MatMul", "Gemm")
            or len(node.input) < 2
            or node.input[1] not in edit.initializers
        ):
            continue
        w = edit.initializers[node.input[1]]
        label = module_path(node)
        why = None
        if w.data_type != onnx.TensorProto.FLOAT:
            why = f"weight dtype {onnx.TensorProto.DataType.Name(w.data_type)} (only FLOAT weights are quantized)"
        elif len(w.dims) != 2:
            why = f"weight is {len(w.dims)}-D"
        elif (pattern := _excluded([label, node.name, w.name], job.exclude)) is not None:
            why = f"excluded by pattern {pattern!r}"
        if why:
            report.skipped.append({"node": node.name, "module": label, "weight": w.name, "reason": why})
            continue
        targets.append(Target(node, w.name, _weight_axis(node), label))
    if not targets:
        raise MixprecError(f"{job.src} has no MatMul/Gemm with a 2-D fp32 weight initializer to quantize")
    return targets


def _quantize_weights(
    edit: GraphEdit, targets: list[Target], job: OnnxQuantizeJob, report: QuantizeOnnxReport
) -> list:
    """2. Each target weight (once, however many nodes read it) -> an FP8 initializer and the
    DequantizeLinear its nodes now read; returns those DequantizeLinear nodes."""
    weight_nodes, dequantized = [], {}
    for target in targets:
        if target.weight not in dequantized:
            node, dequantized[target.weight] = _weight_dequantize(
                edit, target, job.weight_axis(target.axis), report
            )
            weight_nodes.append(node)
    for target in targets:
        target.node.input[1] = dequantized[target.weight]
    return weight_nodes


def _weight_dequantize(edit: GraphEdit, target: Target, axis: int | None, report: QuantizeOnnxReport):
    """(the DequantizeLinear node of one weight, the name of its output)."""
    onnx = need_onnx()
    wname = target.weight
    w = onnx.numpy_helper.to_array(edit.initializers[wname]).astype(np.float32)
    if not np.isfinite(w).all():
        raise MixprecError(f"weight {wname} ({target.label}) holds NaN or inf")
    codes, scale = quantize_weight_array(w, axis)
    qname, sname, zname = (edit.unique(f"{wname}_{s}") for s in ("fp8", "scale", "zero_point"))
    out = edit.unique(f"{wname}_dequantized")
    edit.graph.initializer.extend(
        [_fp8_tensor(qname, codes), onnx.numpy_helper.from_array(scale, sname), _fp8_zero(zname, scale.shape)]
    )
    attrs = {"axis": axis} if axis is not None else {}
    node = onnx.helper.make_node("DequantizeLinear", [qname, sname, zname], [out],
                                 name=edit.unique(f"{wname}_DequantizeLinear"), **attrs)  # fmt: skip
    deq = _dequantize(codes, scale, axis)
    report.weights.append({
        "weight": wname, "module": target.label, "node": target.node.name, "shape": list(w.shape),
        "axis": axis, "scale_min": float(scale.min()), "scale_max": float(scale.max()),
        "relative_error": float(np.linalg.norm(deq - w) / max(np.linalg.norm(w), 1e-30)),
    })  # fmt: skip
    return node, out


def _quantize_activations(
    edit: GraphEdit, targets: list[Target], job: OnnxQuantizeJob, report: QuantizeOnnxReport
) -> dict[str, list]:
    """3. The activations feeding the targets -> static scales (amax over the calibration runs) and a
    QuantizeLinear/DequantizeLinear pair; returns {tensor the pair reads: [Q, DQ]}."""
    names = list(dict.fromkeys(t.node.input[0] for t in targets))
    amax = _activation_amax(load_model(job.src), names, job.calib_inputs)
    producer = {o: n for n in edit.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in edit.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    target_ids = {id(t.node) for t in targets}
    pairs, reads = {}, {}
    for a in names:
        relu = producer.get(a)
        moved = (relu is not None and relu.op_type == "Relu"
                 and all(id(n) in target_ids for n in readers.get(a, [])))  # fmt: skip
        source, pairs_nodes, reads[a] = _activation_pair(edit, a, amax[a], relu if moved else None, report)
        pairs[source] = pairs_nodes
    for target in targets:
        target.node.input[0] = reads[target.node.input[0]]
    return pairs


def _activation_pair(edit: GraphEdit, a: str, amax: float, relu, report: QuantizeOnnxReport):
    """(the tensor the Q/DQ pair reads, [Q, DQ], what the targets that read `a` read now). With `relu`
    (the Relu producing `a`, read only by targets) the pair goes before the Relu."""
    helper, numpy_helper = need_onnx().helper, need_onnx().numpy_helper
    scale = compute_scale(torch.tensor(amax), E4M3).reshape(()).numpy().astype(np.float32)
    sname, zname = edit.unique(f"{a}_scale"), edit.unique(f"{a}_zero_point")
    qout, dqout = edit.unique(f"{a}_fp8"), edit.unique(f"{a}_dequantized")
    edit.graph.initializer.extend([numpy_helper.from_array(scale, sname), _fp8_zero(zname, ())])
    moved = relu is not None
    # onnxruntime's ReluQuantRewrite (level-2 optimizer) deletes a Relu followed by a
    # QuantizeLinear whose zero point is the type's minimum - right for uint8, wrong for float8,
    # where it lets negative values through. Symmetric FP8 Q/DQ commutes with Relu
    # (Q(relu(h)) = relu(Q(h)), Q(0) = 0), so the pair goes before the Relu: same values, and
    # nothing for that rewrite to match.
    source = relu.input[0] if moved else a
    nodes = [
        helper.make_node("QuantizeLinear", [source, sname, zname], [qout],
                         name=edit.unique(f"{a}_QuantizeLinear"), saturate=1),
        helper.make_node("DequantizeLinear", [qout, sname, zname], [dqout],
                         name=edit.unique(f"{a}_DequantizeLinear")),
    ]  # fmt: skip
    if moved:
        relu.input[0] = dqout
    report.activation_scales.append(
        {"tensor": a, "amax": amax, "scale": float(scale), "placed_before_relu": moved}
    )
    return source, nodes, a if moved else dqout


def _place_nodes(graph, weight_nodes: list, activation_nodes: dict[str, list]) -> None:
    """4. Topological order: weight DQs first, each activation Q/DQ just before its first consumer."""
    ordered, pending = list(weight_nodes), dict(activation_nodes)
    produced = {o for n in graph.node for o in n.output}
    for a in [a for a in pending if a not in produced]:  # graph inputs (or constants) come first
        ordered += pending.pop(a)
    for node in graph.node:
        ordered.append(node)
        for o in node.output:
            if o in pending:
                ordered += pending.pop(o)
    del graph.node[:]
    graph.node.extend(ordered)


def _drop_unread_initializers(graph) -> None:
    """5. Drop the fp32 weights nothing reads any more."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    dropped = {t.name for t in graph.initializer} - {t.name for t in keep}
    del graph.initializer[:]
    graph.initializer.extend(keep)
    # Old (IR < 4) graphs also list initializers as graph inputs: a dropped one must go there too.
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)


def _check_graph(model) -> None:
    try:
        need_onnx().checker.check_model(model)
    except Exception as exc:  # a bug here, not a user error: keep the message
        raise MixprecError(f"the FP8 graph failed onnx.checker: {exc}") from None


def _vet(job: OnnxQuantizeJob, model, report: QuantizeOnnxReport, staged: Path) -> None:
    """Runs on the staged copy: a graph over max_error is never published under `dst`."""
    report.file_bytes_after = sum(
        f.stat().st_size for f in staged.parent.glob(staged.name + "*") if f.is_file()
    )
    if not job.check:
        return
    feeds, where = job.calib_inputs, "calibration inputs"
    if not feeds:
        feeds, where = (
            (job.check_inputs, "given inputs")
            if job.check_inputs
            else (synthetic_inputs(model), "synthetic inputs")
        )
    report.check = check_fp8_onnx(job.src, staged, feeds)
    report.check["inputs"] = where
    worst = report.check["worst_relative_l2_error"]
    if job.max_error is not None and not worst <= job.max_error:  # NaN fails too
        name = max(report.check["outputs"], key=lambda n: report.check["outputs"][n]["relative_l2_error"])
        raise MaxErrorExceeded(
            f"relative L2 error {worst:.4g} (output {name}, {where}) > --max-error {job.max_error:g}: "
            f"{job.dst} was not written",
            report,
        )


def initializer_bytes(model) -> int:
    from onnx import numpy_helper

    total = 0
    for t in model.graph.initializer:
        total += len(t.raw_data) if t.raw_data else numpy_helper.to_array(t).nbytes
    return total


def _dequantize(codes: np.ndarray, scale: np.ndarray, axis: int | None) -> np.ndarray:
    values = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    if axis is None:
        return values * scale
    shape = [1, 1]
    shape[axis] = -1
    return values * scale.reshape(shape)


def _set_opset(model, opset: int) -> None:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            imp.version = max(int(imp.version), opset)


def _activation_amax(model, names: list[str], feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Max |x| of each named tensor over all calibration runs of the original graph."""
    from onnx import TensorProto, helper

    ort = need_ort()
    existing = {o.name for o in model.graph.output}
    for n in names:
        if n not in existing:
            model.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out_names = [o.name for o in sess.get_outputs()]
    amax = dict.fromkeys(names, 0.0)
    for feed in feeds:
        values = dict(zip(out_names, run_session(sess, _feed(sess, feed), "a calibration batch")))
        for n in names:
            v = values[n]
            if not np.isfinite(v).all():
                raise MixprecError(f"calibration: activation {n} holds NaN or inf")
            amax[n] = max(amax[n], float(np.abs(v).max()) if v.size else 0.0)
    return amax


def _feed(sess, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    wanted = [i.name for i in sess.get_inputs()]
    missing = [n for n in wanted if n not in feed]
    if missing:
        raise MixprecError(f"calibration inputs lack graph input(s) {missing} (have {sorted(feed)})")
    return {n: feed[n] for n in wanted}


__all__ = [
    "DEFAULT_EXCLUDE",
    "SCHEMA_VERSION",
    "MaxErrorExceeded",
    "QuantizeOnnxReport",
    "check_max_error",
    "check_quantize_inputs",
    "module_path",
    "quantize_onnx",
    "quantize_weight_array",
]
