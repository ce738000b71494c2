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
from pathlib import Path

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
    onnx = need_onnx()
    from onnx import helper, numpy_helper

    check_max_error(max_error, check)
    if granularity not in ("channel", "tensor"):
        raise MixprecError(f"granularity must be 'channel' or 'tensor', got {granularity!r}")
    exclude = [check_pattern(p, "--exclude pattern") for p in exclude]
    src, dst = Path(input_path), Path(output_path)
    model = load_model(src)
    check_output(dst, force, (src,))
    opset = default_opset(model)
    if opset < MIN_OPSET:
        try:
            from onnx import version_converter

            model = version_converter.convert_version(model, MIN_OPSET)
        except Exception as exc:
            raise MixprecError(
                f"{src} is at opset {opset}; FP8 Q/DQ needs {MIN_OPSET} and the conversion failed: {exc}"
            ) from None
    report = QuantizeOnnxReport(
        str(src), str(dst), granularity, "static" if calib_inputs else "none (weight-only)", max(opset, MIN_OPSET),
        weight_bytes_before=initializer_bytes(model), max_error=max_error,
    )  # fmt: skip
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    taken |= {i.name for i in graph.input} | {n.name for n in graph.node}

    # 1. Which nodes get an FP8 weight.
    targets = []  # (node, weight name, axis)
    for node in graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] not in inits:
            continue
        w = inits[node.input[1]]
        label = module_path(node)
        why = None
        if w.data_type != onnx.TensorProto.FLOAT:
            why = f"weight dtype {onnx.TensorProto.DataType.Name(w.data_type)} (only FLOAT weights are quantized)"
        elif len(w.dims) != 2:
            why = f"weight is {len(w.dims)}-D"
        elif (pattern := _excluded([label, node.name, w.name], exclude)) is not None:
            why = f"excluded by pattern {pattern!r}"
        if why:
            report.skipped.append({"node": node.name, "module": label, "weight": w.name, "reason": why})
            continue
        targets.append((node, w.name, _weight_axis(node), label))
    if not targets:
        raise MixprecError(f"{src} has no MatMul/Gemm with a 2-D fp32 weight initializer to quantize")

    # 2. Weights -> FP8 initializers + DequantizeLinear.
    front_nodes, dq_of = [], {}
    for node, wname, axis, label in targets:
        if wname in dq_of:
            continue
        w = numpy_helper.to_array(inits[wname]).astype(np.float32)
        if not np.isfinite(w).all():
            raise MixprecError(f"weight {wname} ({label}) holds NaN or inf")
        use_axis = axis if granularity == "channel" else None
        codes, scale = quantize_weight_array(w, use_axis)
        qname, sname, zname = (_unique(f"{wname}_{s}", taken) for s in ("fp8", "scale", "zero_point"))
        out = _unique(f"{wname}_dequantized", taken)
        graph.initializer.extend(
            [_fp8_tensor(qname, codes), numpy_helper.from_array(scale, sname), _fp8_zero(zname, scale.shape)]
        )
        attrs = {"axis": use_axis} if use_axis is not None else {}
        front_nodes.append(helper.make_node("DequantizeLinear", [qname, sname, zname], [out],
                                            name=_unique(f"{wname}_DequantizeLinear", taken), **attrs))  # fmt: skip
        dq_of[wname] = out
        deq = _dequantize(codes, scale, use_axis)
        report.weights.append({
            "weight": wname, "module": label, "node": node.name, "shape": list(w.shape),
            "axis": use_axis, "scale_min": float(scale.min()), "scale_max": float(scale.max()),
            "relative_error": float(np.linalg.norm(deq - w) / max(np.linalg.norm(w), 1e-30)),
        })  # fmt: skip
    for node, wname, _, _ in targets:
        node.input[1] = dq_of[wname]

    # 3. Activations -> static scales + QuantizeLinear/DequantizeLinear (calibration data only).
    act_nodes: dict[str, list] = {}
    if calib_inputs:
        names = list(dict.fromkeys(n.input[0] for n, *_ in targets))
        amax = _activation_amax(load_model(src), names, calib_inputs)
        act_dq = {}
        producer = {o: n for n in graph.node for o in n.output}
        readers: dict[str, list] = {}
        for n in graph.node:
            for i in n.input:
                readers.setdefault(i, []).append(n)
        target_ids = {id(n) for n, *_ in targets}
        for a in names:
            scale = compute_scale(torch.tensor(amax[a]), E4M3).reshape(()).numpy().astype(np.float32)
            sname, zname = _unique(f"{a}_scale", taken), _unique(f"{a}_zero_point", taken)
            qout, dqout = _unique(f"{a}_fp8", taken), _unique(f"{a}_dequantized", taken)
            graph.initializer.extend([numpy_helper.from_array(scale, sname), _fp8_zero(zname, ())])
            relu = producer.get(a)
            moved = (relu is not None and relu.op_type == "Relu"
                     and all(id(n) in target_ids for n in readers.get(a, [])))  # fmt: skip
            # onnxruntime's ReluQuantRewrite (level-2 optimizer) deletes a Relu followed by a
            # QuantizeLinear whose zero point is the type's minimum - right for uint8, wrong for float8,
            # where it lets negative values through. Symmetric FP8 Q/DQ commutes with Relu
            # (Q(relu(h)) = relu(Q(h)), Q(0) = 0), so the pair goes before the Relu: same values, and
            # nothing for that rewrite to match.
            src_tensor = relu.input[0] if moved else a
            act_nodes[src_tensor] = [
                helper.make_node("QuantizeLinear", [src_tensor, sname, zname], [qout],
                                 name=_unique(f"{a}_QuantizeLinear", taken), saturate=1),
                helper.make_node("DequantizeLinear", [qout, sname, zname], [dqout],
                                 name=_unique(f"{a}_DequantizeLinear", taken)),
            ]  # fmt: skip
            if moved:
                relu.input[0] = dqout
                act_dq[a] = a
            else:
                act_dq[a] = dqout
            report.activation_scales.append(
                {"tensor": a, "amax": amax[a], "scale": float(scale), "placed_before_relu": moved}
            )
        for node, *_ in targets:
            node.input[0] = act_dq[node.input[0]]

    # 4. Topological order: weight DQs first, each activation Q/DQ just before its first consumer.
    ordered, pending = list(front_nodes), dict(act_nodes)
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

    # 5. Drop fp32 weights nothing reads any more.
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [t for t in graph.initializer if t.name in used]
    dropped = {t.name for t in graph.initializer} - {t.name for t in keep}
    del graph.initializer[:]
    graph.initializer.extend(keep)
    # Old (IR < 4) graphs also list initializers as graph inputs: a dropped one must go there too.
    inputs = [i for i in graph.input if i.name not in dropped]
    del graph.input[:]
    graph.input.extend(inputs)
    _set_opset(model, report.opset)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # a bug here, not a user error: keep the message
        raise MixprecError(f"the FP8 graph failed onnx.checker: {exc}") from None
    report.weight_bytes_after = initializer_bytes(model)

    def vet(staged: Path) -> None:
        """Runs on the staged copy: a graph over max_error is never published under `dst`."""
        report.file_bytes_after = sum(
            f.stat().st_size for f in staged.parent.glob(staged.name + "*") if f.is_file()
        )
        if not check:
            return
        feeds, where = calib_inputs, "calibration inputs"
        if not feeds:
            feeds, where = (
                (check_inputs, "given inputs")
                if check_inputs
                else (synthetic_inputs(model), "synthetic inputs")
            )
        report.check = check_fp8_onnx(src, staged, feeds)
        report.check["inputs"] = where
        worst = report.check["worst_relative_l2_error"]
        if max_error is not None and not worst <= max_error:  # NaN fails too
            name = max(report.check["outputs"], key=lambda n: report.check["outputs"][n]["relative_l2_error"])
            raise MaxErrorExceeded(
                f"relative L2 error {worst:.4g} (output {name}, {where}) > --max-error {max_error:g}: "
                f"{dst} was not written",
                report,
            )

    save_model_atomic(model, dst, vet=vet)
    report.written = True
    return report


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
