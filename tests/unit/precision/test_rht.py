"""NVFP4 random Hadamard transform (numerics.md 2.5)."""

from __future__ import annotations

import torch

from lptrain.precision import quantize
from lptrain.precision.rht import RHT_SIGNS, apply_rht, hadamard16, rht_matrix


def test_matrix_entries_and_exact_orthogonality() -> None:
    r = rht_matrix()
    assert r.dtype == torch.float32 and r.shape == (16, 16)
    assert torch.equal(r.abs(), torch.full((16, 16), 0.25))
    assert torch.equal(r.bfloat16().float(), r)  # +-0.25 is exact in bf16
    assert torch.equal(r @ r.t(), torch.eye(16))  # exact in fp32: sums of sixteen +-1/16
    assert torch.equal(r.t() @ r, torch.eye(16))


def test_hadamard_is_sylvester_and_signs_are_teS() -> None:
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    h16 = torch.kron(torch.kron(torch.kron(h2, h2), h2), h2)  # independent construction
    assert torch.equal(hadamard16(), h16)
    assert torch.equal(rht_matrix(), torch.tensor(RHT_SIGNS, dtype=torch.float32)[:, None] * h16 / 4)


def test_apply_twice_with_transpose_recovers_input() -> None:
    g = torch.Generator().manual_seed(0)
    xi = torch.randint(-64, 64, (8, 64), generator=g).float()  # integers: every product/sum exact
    y = apply_rht(xi, round_to_bf16=False)
    assert torch.equal(apply_rht(y, inverse=True, round_to_bf16=False), xi)
    x = torch.randn(8, 64, generator=g)
    back = apply_rht(apply_rht(x, round_to_bf16=False), inverse=True, round_to_bf16=False)
    assert torch.allclose(back, x, rtol=0, atol=1e-6)  # fp32 accumulation rounding only


def test_groups_are_16_consecutive_tokens_and_bf16_rounded() -> None:
    g = torch.Generator().manual_seed(1)
    xt = torch.randn(3, 32, generator=g)  # [K, M]
    y = apply_rht(xt)
    ref = torch.cat([xt[:, :16] @ rht_matrix(), xt[:, 16:] @ rht_matrix()], dim=1)
    assert torch.equal(y, ref.bfloat16().float())


def test_nvfp4_columnwise_uses_rht_operand() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 48, generator=g)
    with_rht = quantize(x, "nvfp4", role="input", rht=True)
    plain = quantize(apply_rht(x.t()).t().contiguous(), "nvfp4", role="input", rht=False)
    # columnwise(x, RHT) == columnwise quantization of the rotated operand y^T = RHT(x^T)
    v, p = with_rht.storage_views(), plain.storage_views()
    for k in ("columnwise_data", "columnwise_scale_inv", "amax_columnwise"):
        assert torch.equal(v[k], p[k]), k
    assert torch.equal(v["rowwise_data"], quantize(x, "nvfp4", rht=False).storage_views()["rowwise_data"])
    # the rotated operands of a wgrad GEMM cancel: (R^T a)^T (R^T b) = a^T b
    a, b = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
    ra, rb = apply_rht(a.t(), round_to_bf16=False), apply_rht(b.t(), round_to_bf16=False)
    assert torch.allclose(ra @ rb.t(), a.t() @ b, atol=1e-5)
