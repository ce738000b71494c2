"""mixprec profile: its statistics are those of actually quantizing the same tensors with each recipe.

The profile runs high-precision (bf16) passes and quantizes each Linear's input, weight and grad_output
as every recipe would. Checked against (1) a plain reference: the same tensors captured by this test's
own hooks, quantized with each recipe's layout and scales computed here from first principles (delayed
scaling: the max amax of the earlier passes / fmt.max), clipped and flushed elements counted elementwise;
(2) the real thing: a LowPrecisionLinear trained with each recipe, observed by the PrecisionMonitor. Counts must
be equal exactly, the SNR to rounding.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from mixprec.cli import main
from mixprec.errors import MixprecError
from mixprec.formats import E5M2, decode
from mixprec.monitor import PrecisionMonitor
from mixprec.quantization import quantize
from mixprec.recipes import RECIPES, ROLES, Fp8Recipe, from_name
from mixprec.scaling import Granularity
from mixprec.sensitivity import Profile, profile_model, quantizing_recipes, write_profile
from mixprec.training import advance_scaling_state, convert_for_training
from mixprec.training.quantizer_state import rounding_key

PASSES = 3
TE_DELAYED = "fp8-delayed:growing=false"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32))


def _batches() -> list[torch.Tensor]:
    # inputs that grow pass after pass: delayed scaling lags behind them and clips
    g = torch.Generator().manual_seed(1)
    return [torch.randn(40, 64, generator=g) * 4.0**t for t in range(PASSES)]


def _target(out_features: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(40, out_features, generator=g).bfloat16()


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    # linear in the output: grad_output is the target itself, whatever precision computed the output
    out = model(batch.to(next(model.parameters()).dtype))
    return (out.float() * _target(out.shape[-1]).float()).sum()


def _captured(model: nn.Module) -> dict[tuple[str, str], list[torch.Tensor]]:
    """The tensors each Linear shows in bf16 passes, by this test's own hooks."""
    work = copy.deepcopy(model)
    convert_for_training(work, "bf16")
    seen: dict[tuple[str, str], list[torch.Tensor]] = {}

    def hook_for(name):
        def hook(module, args, output):
            seen.setdefault((name, "input"), []).append(args[0].detach().clone())
            seen.setdefault((name, "weight"), []).append(module.weight.detach().clone())
            output.register_hook(lambda g: seen.setdefault((name, "grad_output"), []).append(g.clone()))

        return hook

    for name, m in work.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(hook_for(name))
    for batch in _batches():
        _loss(work, batch).backward()
        work.zero_grad()
    return seen


def _expanded(scale: torch.Tensor, g: Granularity, rows: int, cols: int) -> torch.Tensor:
    """One scale per element, by plain indexing (independent of scaling.expand_scale)."""
    br, bc = g.block_shape(rows, cols)
    r = torch.arange(rows) // br
    c = torch.arange(cols) // bc
    return scale[r[:, None], c[None, :]]


def _reference(tensors: list[torch.Tensor], recipe, role: str, layer: str = "") -> list[dict]:
    op = recipe.operand(role, False)
    amaxes: list[float] = []
    out = []
    for step, t in enumerate(tensors):
        x = t.float().reshape(-1, t.shape[-1])
        scale = None
        if recipe.name == "fp8-unscaled":
            scale = torch.ones(1, 1)
        elif recipe.delayed:  # max amax of the earlier passes; the tensor's own before any history
            amax = float(x.abs().max())
            ref = max(amaxes) if amaxes else amax
            # current_while_growing: after a pass whose amax set a record, the tensor's own amax again
            record = len(amaxes) == 1 or (len(amaxes) > 1 and amaxes[-1] > max(amaxes[:-1]))
            if getattr(recipe, "current_while_growing", False) and record:
                ref = amax
            scale = torch.tensor(ref, dtype=torch.float32) / op.fmt.max
            amaxes.append(amax)
        # FP4 gradients: the stochastic rounding the FP4 run draws at this step (rank 0, first backward)
        key = rounding_key(recipe.seed, step, 0, layer, "grad_input", role) if op.stochastic else None
        q = quantize(t, op.fmt, op.granularity, scale=scale, power_of_two=op.power_of_two, rounding_key=key)
        s = _expanded(q.effective_scale(), op.granularity, *x.shape)  # NVFP4: block scale / global scale
        payload = decode(q.data, op.fmt)  # the payload's values (FP4 payloads are uint8 codes)
        deq = (payload * s).double()
        out.append(
            {
                # clipped beyond what the block scales' own rounding clips (1 for fp32 scales)
                "saturated": int(((x / s).abs() > op.fmt.max * op.granularity.clip_headroom(op.fmt)).sum()),
                "underflowed": int(((x != 0) & (payload == 0)).sum()),
                "nonzero": int((x != 0).sum()),
                "numel": x.numel(),
                "snr_db": 10 * math.log10(float((x.double() ** 2).sum() / ((x.double() - deq) ** 2).sum())),
            }
        )
    return out


def test_profile_counts_equal_quantizing_the_same_tensors_with_every_recipe():
    model = _model()
    # every recipe of the registry, and TransformerEngine's delayed scaling (no current scaling while the
    # amax sets records), which lags behind the growing inputs
    profile = profile_model(model, _batches(), recipes=[*quantizing_recipes(), TE_DELAYED], loss_fn=_loss)
    seen = _captured(model)
    clipped = 0
    for layer in ("0", "2"):
        for role in ROLES:
            for spec in profile.recipes:
                want = _reference(seen[(layer, role)], from_name(spec), role, layer)
                cell = profile.cell(layer, role, spec)
                assert len(cell.passes) == PASSES
                for got, ref in zip(cell.passes, want):
                    assert (got.numel, got.nonzero, got.saturated, got.underflowed) == (
                        ref["numel"], ref["nonzero"], ref["saturated"], ref["underflowed"]
                    ), (layer, role, spec)  # fmt: skip
                    assert got.snr_db == pytest.approx(ref["snr_db"], abs=1e-3)
                    clipped += got.saturated
    assert clipped > 0  # the growing inputs do clip under delayed scaling (and unscaled): counts are tested
    assert profile.cell("0", "input", TE_DELAYED).peak_saturation > 0.1
    assert profile.cell("0", "input", "fp8-current").peak_saturation == 0


@pytest.mark.parametrize("recipe", ["fp8-delayed", TE_DELAYED, "fp8-current", "fp8-blockwise"])
def test_profile_counts_equal_what_an_fp8_training_run_shows_the_monitor(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    profile = profile_model(model, _batches(), recipes=[recipe], loss_fn=_loss)
    fp8 = copy.deepcopy(model)
    convert_for_training(fp8, recipe)
    monitor = PrecisionMonitor(fp8, every=1)
    for step, batch in enumerate(_batches()):
        monitor.begin_step(step)
        _loss(fp8, batch).backward()
        fp8.zero_grad()
        advance_scaling_state(fp8)
        for record in monitor.end_step():
            cell = profile.cell("0", record["role"], recipe).passes[step]
            assert (cell.saturated, cell.underflowed, cell.nonzero) == (
                record["saturated"], record["underflowed"], record["nonzero"]
            ), (step, record["role"])  # fmt: skip
    assert {r["role"] for r in monitor.records} == set(ROLES)


@dataclass(frozen=True)
class _RowwiseE5M2(Fp8Recipe):
    """A recipe the profile has never heard of: it joins through the registry."""

    name: ClassVar[str] = "fp8-test-e5m2-rows"

    def role_format(self, role: str):
        return E5M2

    def granularity(self, role: str, transposed: bool) -> Granularity:
        return Granularity.rows()


def test_a_new_recipe_in_the_registry_joins_the_profile(monkeypatch):
    monkeypatch.setitem(RECIPES, _RowwiseE5M2.name, _RowwiseE5M2)
    assert _RowwiseE5M2.name in quantizing_recipes()
    assert "bf16" not in quantizing_recipes()
    profile = profile_model(_model(), _batches()[:1], loss_fn=_loss)
    cell = profile.cell("0", "input", _RowwiseE5M2.name)
    assert (cell.fmt, cell.granularity) == ("e5m2", "row")


def test_profile_json_round_trip_and_report(tmp_path):
    profile = profile_model(
        _model(), _batches()[:2], recipes=["fp8-delayed:margin=1", "fp8-mxfp8"], loss_fn=_loss
    )
    out = write_profile(tmp_path / "prof", profile)
    doc = json.loads((out / "profile.json").read_text())
    assert doc["schema_version"] == 2 and doc["kind"] == "mixprec-profile"
    assert doc["recipes"] == ["fp8-delayed:margin=1", "fp8-mxfp8"]
    assert len(doc["cells"]) == 2 * len(ROLES) * 2
    again = Profile.from_dict(doc)
    for key, cell in profile.cells.items():
        assert again.cells[key].passes == cell.passes
    assert "<img" in (out / "report.html").read_text()


def test_profile_refuses_bad_input():
    with pytest.raises(MixprecError, match="does not quantize"):
        profile_model(_model(), _batches(), recipes=["bf16"], loss_fn=_loss)
    with pytest.raises(MixprecError, match="unknown recipe"):
        profile_model(_model(), _batches(), recipes=["fp9"], loss_fn=_loss)
    with pytest.raises(MixprecError, match="precision"):
        profile_model(_model(), _batches(), precision="fp16", loss_fn=_loss)
    with pytest.raises(MixprecError, match="nothing to profile"):
        profile_model(nn.Sequential(nn.Linear(10, 3)), _batches(), loss_fn=_loss)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--recipes", "bf16"], "does not quantize"),
        (["--passes", "0"], "--passes"),
        (["--data", "/nonexistent"], "does not exist"),
    ],
)
def test_cli_refuses_bad_input_before_any_work(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert main(["profile", "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
