"""SiLU(gate) x up through csrc/layer/silu_mul.c against torch's expression evaluated in float32
and rounded once, as the compiled layers evaluate it (eager bf16 rounds SiLU's output to
bfloat16 before the product, a second rounding that differs from both on ~25% of values):
within one bfloat16 ulp everywhere and equal almost everywhere (the kernel's exp and
reciprocal are within ~2 float32 ulp of torch's, which the rounding hides except on ties),
tails shorter than 16 values, strided rows, and the extremes of the exp's range."""

from __future__ import annotations

import pytest
import torch

from kvserve.models.fused_mlp import fused_silu_available, fused_silu_mul, silu_and_mul

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    not fused_silu_available(CPU, torch.bfloat16), reason="no AVX512-BF16 C kernel here"
)


def reference(gate_up: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(gate_up.float()).bfloat16()


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of want's bfloat16 spacing (2^(exponent - 7))."""
    want32 = want.float()
    spacing = torch.ldexp(torch.ones_like(want32), torch.frexp(want32).exponent - 8)
    return (got.float() - want32).abs() / spacing.clamp_min(2.0**-133)


@pytest.mark.parametrize(("rows", "n"), [(1, 40), (7, 1536), (300, 72), (2048, 1536)])
def test_equals_torch_within_one_bf16_ulp(rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    gate_up = (3 * torch.randn(rows, 2 * n, generator=gen)).to(torch.bfloat16)
    got, want = fused_silu_mul(gate_up), reference(gate_up)
    assert got.shape == want.shape == (rows, n) and got.dtype == torch.bfloat16
    assert bf16_ulps(got, want).max().item() <= 1.0
    assert (got == want).float().mean().item() > 0.99


def test_strided_rows_and_leading_dims():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(2, 5, 3 * 48, generator=gen).to(torch.bfloat16)
    gate_up = wide[..., :96]  # rows 144 values apart
    got, want = fused_silu_mul(gate_up), reference(gate_up)
    assert got.shape == (2, 5, 48)
    assert bf16_ulps(got, want).max().item() <= 1.0


def test_the_ends_of_the_range():
    gate = torch.tensor([-1e4, -100.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 1.0, 20.0, 88.0, 100.0,
                         1e4, -3e38, 3e38, 0.5, -0.5, -1e38, -88.5])  # fmt: skip
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)]).to(torch.bfloat16)[None]
    got, want = fused_silu_mul(gate_up)[0].float(), reference(gate_up)[0].float()
    overflow = ~want.isfinite()  # 3e38 x 1.5: inf both ways
    assert overflow.sum() == 1 and torch.equal(got[overflow], want[overflow])
    tiny = want.abs() < 1e-30  # silu of a very negative gate: both within a hair of zero
    assert (got[tiny].abs() < 1e-30).all()
    rest = ~tiny & ~overflow
    assert bf16_ulps(got[rest], want[rest].bfloat16()).max().item() <= 1.0


def test_float32_keeps_torch_expression():
    """A float32 model's layers never take the kernel (their parity with transformers is
    exact), and the op itself gives torch's values for float32 input."""
    assert not fused_silu_available(CPU, torch.float32)
    gate_up = torch.randn(3, 64)
    assert torch.equal(fused_silu_mul(gate_up), silu_and_mul(gate_up))


def test_silu_x_up_fused_into_a_packed_projection_is_as_close_as_the_reference():
    """Where the projection kernel takes the weight, a packed gate_up projection computes
    SiLU(gate) x up in one kernel from the float32 results (csrc/linear/linear_amx.c, or
    linear_dot.c without AMX, whose 64-column blocks need features a multiple of 64; 600 rows:
    in chunks), within bfloat16 rounding of the float32 expression and no further than the
    reference path (F.linear in bf16, then torch's SiLU x up), up to one bf16 rounding.
    Without it (kernel_rows 0), oneDNN's projection and then the SiLU kernel: within one bf16
    ulp of torch's SiLU x up of oneDNN's gate and up."""
    from kvserve.models.fused_mlp import packed_silu_gate_up, silu_and_mul
    from kvserve.models.packed_linear import PackedLinear, can_pack

    if not can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("oneDNN cannot pack bf16 on this CPU")
    torch.manual_seed(0)
    features = 128
    weight = (torch.randn(2 * features, 64) * 0.2).to(torch.bfloat16)
    layer = PackedLinear(weight, None)
    cases = [(rows, layer.kernel_rows) for rows in (1, 16, 48, 64, 65, 200, 600)]
    for rows, kernel_rows in [*cases, (64, 0), (200, 0), (600, 0)]:
        layer.kernel_rows = kernel_rows
        x = torch.randn(rows, 64).to(torch.bfloat16)
        got = packed_silu_gate_up(x, layer.packed_weight, features, layer.kernel_rows)
        assert got.shape == (rows, features) and got.dtype == torch.bfloat16
        if not kernel_rows:
            linear = torch.ops.mkldnn._linear_pointwise
            gate_up = linear(x, layer.packed_weight, None, "none", [], "")
            assert bf16_ulps(got, reference(gate_up)).max().item() <= 1.0, rows
            continue
        gate, up = (x.float() @ weight.float().T).chunk(2, dim=-1)
        exact = torch.nn.functional.silu(gate) * up
        reference_path = silu_and_mul(torch.nn.functional.linear(x, weight)).float()
        errors = ((y - exact).abs().max().item() for y in (got.float(), reference_path))
        error, reference_error = errors
        assert error <= reference_error + 1e-3, rows  # one rounding of float32 results
        torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=1e-2)
