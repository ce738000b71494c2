"""FP8 Q/DQ conversion of small hand-built graphs: payloads, scales, onnxruntime outputs, bad input."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import onnx
from mixprec.cli import main
from mixprec.commands import quantize_onnx as quantize_command
from mixprec.errors import MixprecError
from mixprec.formats import E4M3
from mixprec.onnx import quantize as quantize_module
from mixprec.onnx import quantize_onnx
from mixprec.onnx.quantize import MaxErrorExceeded
from mixprec.quantization import quantize
from mixprec.scaling import Granularity
from onnx import TensorProto, helper, numpy_helper

BOUND_WEIGHT_ONLY = 2**-4  # relative L2 error of the outputs, weights in FP8
BOUND_STATIC = 2 * 2**-4  # weights and activations each rounded once more

rng = np.random.default_rng(0)
W1 = rng.standard_normal((16, 32)).astype(np.float32) * np.linspace(
    0.1, 3, 32, dtype=np.float32
)  # MatMul B [K, N]
W2 = rng.standard_normal((8, 32)).astype(np.float32)  # Gemm B with transB=1: [N, K]


def mlp(path, opset=19):
    """x[B,16] -> MatMul W1 -> Relu -> Gemm(W2, transB=1) -> y[B,8]."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Gemm", ["r", "W2"], ["y"], name="fc2", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def fp8_values(t):
    codes = np.frombuffer(t.raw_data, dtype=np.uint8).reshape(tuple(t.dims))
    return torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()


def run(path, x):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_weight_only_graph(tmp_path, granularity):
    src = mlp(tmp_path / "mlp.onnx")
    report = quantize_onnx(src, tmp_path / "fp8.onnx", granularity=granularity)
    m = onnx.load(str(tmp_path / "fp8.onnx"))
    inits = {t.name: t for t in m.graph.initializer}
    fp8 = [t for t in m.graph.initializer if t.data_type == TensorProto.FLOAT8E4M3FN and len(t.dims) == 2]
    assert {t.name for t in fp8} == {"W1_fp8", "W2_fp8"} and "W1" not in inits and "W2" not in inits
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("DequantizeLinear") == 2 and "QuantizeLinear" not in ops
    assert m.opset_import[0].version >= 19 and report.activations.startswith("none")
    # payloads and scales are exactly mixprec.scaling's (W as [out, in], one scale per output row)
    for name, w_out_in, axis in (("W1", W1.T, 1), ("W2", W2, 0)):
        g = Granularity.rows() if granularity == "channel" else Granularity.tensor()
        q = quantize(torch.from_numpy(np.ascontiguousarray(w_out_in)), E4M3, g)
        payload = fp8_values(inits[f"{name}_fp8"])
        assert np.array_equal(payload if axis == 0 else payload.T, q.data.float().numpy())
        assert np.array_equal(
            numpy_helper.to_array(inits[f"{name}_scale"]).reshape(-1), q.scale.reshape(-1).numpy()
        )
    # onnxruntime computes exactly the graph with dequantized weights; the error against fp32 is bounded
    x = rng.standard_normal((5, 16)).astype(np.float32)
    deq = {t: fp8_values(inits[f"{t}_fp8"]) for t in ("W1", "W2")}
    s1, s2 = (numpy_helper.to_array(inits[f"{t}_scale"]) for t in ("W1", "W2"))
    want = np.maximum(x @ (deq["W1"] * s1), 0) @ (deq["W2"] * (s2.reshape(-1, 1) if s2.ndim else s2)).T
    got = run(tmp_path / "fp8.onnx", x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    ref = run(src, x)
    # stated bound: 2^-4, the largest relative rounding error of one E4M3 value (3 mantissa bits)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < BOUND_WEIGHT_ONLY
    assert (
        report.check["worst_relative_l2_error"] < BOUND_WEIGHT_ONLY
        and report.check["inputs"] == "synthetic inputs"
    )
    assert report.weight_bytes_after < 0.35 * report.weight_bytes_before  # fp8 payload + scales vs fp32


def test_static_activation_scales_from_calibration(tmp_path):
    src = mlp(tmp_path / "mlp.onnx")
    calib = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(3)]
    report = quantize_onnx(src, tmp_path / "fp8.onnx", calib_inputs=calib)
    m = onnx.load(str(tmp_path / "fp8.onnx"))
    ops = [n.op_type for n in m.graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") == 4
    amax_x = max(float(np.abs(c["x"]).max()) for c in calib)
    scales = {a["tensor"]: a for a in report.activation_scales}
    # regression: onnxruntime's ReluQuantRewrite drops a Relu before an FP8 QuantizeLinear, so the pair
    # for the Relu output goes before the Relu (exact: symmetric Q/DQ commutes with Relu)
    assert scales["r"]["placed_before_relu"] is True and "Relu" in ops
    assert scales["x"]["amax"] == pytest.approx(amax_x) and scales["x"]["scale"] == pytest.approx(
        amax_x / 448
    )
    assert (
        report.check["inputs"] == "calibration inputs"
        and report.check["worst_relative_l2_error"] < BOUND_STATIC
    )
    # an input beyond the calibrated range saturates at 448 * scale instead of overflowing
    x = calib[0]["x"] * 10
    assert np.isfinite(run(tmp_path / "fp8.onnx", x)).all()


def test_calibration_from_npz_via_cli(tmp_path):
    src = mlp(tmp_path / "mlp.onnx")
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((8, 16)).astype(np.float32))
    argv = ["quantize-onnx", "--input", str(src), "--output", str(tmp_path / "fp8.onnx"), "--calib-data",
            str(tmp_path / "calib.npz"), "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert main(argv) == 0
    import json

    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema_version"] == 2 and len(doc["activation_scales"]) == 2 and doc["check"]["batches"] == 2
    assert doc["written"] is True and doc["max_error"] is None
    assert main(argv) == 2  # output exists without --force


def test_failed_max_error_leaves_no_file(tmp_path, capsys):
    import json

    src = mlp(tmp_path / "mlp.onnx")
    argv = ["quantize-onnx", "--input", str(src), "--output", str(tmp_path / "fp8.onnx"),
            "--max-error", "1e-9", "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert main(argv) == 1  # a failed gate, not a bad input
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "r.json").read_text())
    worst = doc["check"]["worst_relative_l2_error"]
    assert f"{worst:.4g}" in out and "--max-error 1e-09" in out and "was not written" in out
    assert doc["written"] is False and doc["max_error"] == 1e-9 and worst > 1e-9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx", "r.json"]  # no graph, no staging dir
    # the library raises the same, with the measurements attached
    with pytest.raises(MaxErrorExceeded, match="was not written") as caught:
        quantize_onnx(src, tmp_path / "fp8.onnx", max_error=1e-9)
    assert caught.value.report.check["worst_relative_l2_error"] == worst
    assert not (tmp_path / "fp8.onnx").exists()
    # a limit the graph meets publishes it
    assert quantize_onnx(src, tmp_path / "fp8.onnx", max_error=BOUND_WEIGHT_ONLY).written
    assert (tmp_path / "fp8.onnx").is_file()


def test_bad_arguments_refused_before_loading(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a graph was loaded before the arguments were checked")

    monkeypatch.setattr(quantize_module, "load_model", refuse)
    monkeypatch.setattr(quantize_command, "load_model", refuse)
    src = str(mlp(tmp_path / "mlp.onnx"))
    out = str(tmp_path / "o.onnx")
    (tmp_path / "dir.onnx").mkdir()
    (tmp_path / "exists.json").write_text("{}")
    (tmp_path / "corpus.txt").write_text("some text\n")
    cases = [
        (["--input", str(tmp_path), "--output", out], "is a directory"),
        (["--input", src, "--output", str(tmp_path / "dir.onnx"), "--force"], "is a directory"),
        (["--input", src, "--output", src, "--force"], "is the input"),
        (["--input", src, "--output", out, "--calib-samples", "0"], "--calib-samples 0"),
        (["--input", src, "--output", out, "--calib-samples", "-3"], "--calib-samples -3"),
        (["--input", src, "--output", out, "--calib-seq-len", "1"], "--calib-seq-len 1"),
        (["--input", src, "--output", out, "--max-error", "-1"], "positive"),
        (["--input", src, "--output", out, "--max-error", "0"], "positive"),
        (["--input", src, "--output", out, "--max-error", "nan"], "positive"),
        (["--input", src, "--output", out, "--max-error", "0.1", "--no-check"], "drop --no-check"),
        (["--input", src, "--output", out, "--exclude", "re:("], "not a valid regular expression"),
        (["--input", src, "--output", out, "--calib-data", str(tmp_path / "nope.txt")], "does not exist"),
        (["--input", src, "--output", out, "--calib-data", str(tmp_path / "corpus.txt"), "--tokenizer",
          str(tmp_path / "corpus.txt")], "--tokenizer"),
        (["--input", src, "--output", out, "--json", str(tmp_path / "exists.json")], "already exists"),
        (["--input", src, "--output", out, "--json", out], "also the ONNX"),
        (["--input", src, "--output", out, "--json", str(tmp_path)], "is a directory"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(["quantize-onnx", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "o.onnx").exists()


def test_calibration_data_the_graph_cannot_run_is_one_line(tmp_path, capsys):
    src = mlp(tmp_path / "mlp.onnx")
    np.savez(tmp_path / "wrong.npz", x=rng.standard_normal((8, 5)).astype(np.float32))  # 5 features, not 16
    argv = ["quantize-onnx", "--input", str(src), "--output", str(tmp_path / "o.onnx"),
            "--calib-data", str(tmp_path / "wrong.npz")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "onnxruntime failed on a calibration batch {'x': [4, 5]}" in err and err.count("\n") == 1
    assert not (tmp_path / "o.onnx").exists()


def test_bad_inputs(tmp_path, capsys):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a protobuf\n")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(bytes(range(256)) * 4)
    cases = [
        (["--input", str(text)], "not an ONNX model"),
        (["--input", str(junk)], "not an ONNX model"),
        (["--input", str(tmp_path / "missing.onnx")], "does not exist"),
        (
            ["--input", str(mlp(tmp_path / "m.onnx")), "--calib-data", str(tmp_path / "nope.npz")],
            "does not exist",
        ),
    ]
    for extra, message in cases:
        assert main(["quantize-onnx", "--output", str(tmp_path / "o.onnx"), *extra]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(MixprecError, match="is the input"):
        quantize_onnx(tmp_path / "m.onnx", tmp_path / "m.onnx", force=True)
    empty = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])  # fmt: skip
    onnx.save(
        helper.make_model(empty, opset_imports=[helper.make_opsetid("", 19)]), str(tmp_path / "relu.onnx")
    )
    with pytest.raises(MixprecError, match="no MatMul/Gemm"):
        quantize_onnx(tmp_path / "relu.onnx", tmp_path / "o2.onnx")
    assert not (tmp_path / "o.onnx").exists() and not (tmp_path / "o2.onnx").exists()


def test_old_opset_is_converted(tmp_path):
    src = mlp(tmp_path / "old.onnx", opset=17)
    report = quantize_onnx(src, tmp_path / "fp8.onnx")
    assert report.opset == 19 and onnx.load(str(tmp_path / "fp8.onnx")).opset_import[0].version >= 19
