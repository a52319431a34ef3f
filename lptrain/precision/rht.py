"""NVFP4 random Hadamard transform (numerics.md 2.5, TE ``get_rht_matrix``).

R = diag(s) H16 / 4 with the Sylvester Hadamard H16[i, j] = (-1)^popcount(i & j) and TE's
fixed sign vector s. Every entry is +-0.25 (exact in bf16 and fp32) and R is orthogonal:
R R^T = I exactly in fp32 (each entry of the product is a sum of sixteen +-1/16 terms).
It is applied to the columnwise (wgrad) operands of inputs and grads: groups of 16 consecutive
tokens of x^T are multiplied by R with fp32 accumulation and the result is rounded to bf16.
The rotation cancels inside the wgrad GEMM because both operands get the same R.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
RHT_SIZE = 16


def hadamard16() -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix (entries +-1), fp32."""
    i = torch.arange(RHT_SIZE, device="cpu")
    parity = torch.zeros(RHT_SIZE, RHT_SIZE, dtype=torch.int64, device="cpu")
    anded = i[:, None] & i[None, :]
    for bit in range(4):
        parity ^= (anded >> bit) & 1
    return (1 - 2 * parity).to(torch.float32)


def rht_matrix() -> torch.Tensor:
    """R = diag(s) H / 4 as fp32 (values +-0.25; identical when stored as bf16)."""
    s = torch.tensor(RHT_SIGNS, dtype=torch.float32, device="cpu")
    return (s[:, None] * hadamard16()) * 0.25


_CHUNK_ELEMS = 1 << 19  # ~2 MiB of fp32 per pass: GEMM outputs stay cached before rounding


_MATRICES: dict[tuple[bool, torch.device], torch.Tensor] = {}


def _matrix(inverse: bool, device: torch.device) -> torch.Tensor:
    """R (``inverse``: R^T, contiguous) on ``device``.

    Cached per device: building it takes ~25 small ops, which on the tiny tensors of a small
    model cost more than the rotation itself (the values are constants, so a cached copy
    gives the same bits; callers never write to it)."""
    key = (inverse, torch.device(device))
    m = _MATRICES.get(key)
    if m is None:
        with torch.inference_mode(False):  # a normal tensor even when first built in inference
            r = rht_matrix().to(device)
            m = r.t().contiguous() if inverse else r
        _MATRICES[key] = m
    return m


def _round_bf16_(y: torch.Tensor) -> None:
    y.copy_(y.to(torch.bfloat16))


def rotate_group_rows_into(
    x: torch.Tensor, out: torch.Tensor, inverse: bool = False, round_to_bf16: bool = True
) -> torch.Tensor:
    """One chunk of :func:`rotate_token_groups`: ``x`` [m, K] (m divisible by 16) rotated into
    ``out`` (same shape, e.g. a reused cache-sized buffer) with one GEMM call, then rounded.

    Why reuse a buffer: writing the GEMM into a fresh full-size tensor costs ~4x the GEMM
    itself on CPU (first-touch page faults); the quantizer rotates each row chunk into a
    scratch buffer, twice if it must (block amaxes first, then the codes), which is cheaper
    and gives the same bits (the same call on the same rows).
    """
    m, k = x.shape
    if m % RHT_SIZE:
        raise ValueError(f"RHT needs the token dim divisible by 16, got {m}")
    rt = _matrix(inverse, x.device).t()
    torch.matmul(rt, x.float().view(-1, RHT_SIZE, k), out=out.view(-1, RHT_SIZE, k))
    if round_to_bf16:
        _round_bf16_(out)
    return out


_SCRATCH = threading.local()


def rotated_scratch(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A bf16 [M, K] buffer for the rotated (bf16-rounded) operand of one quantization.

    Why: the NVFP4 quantizer needs the rotated values twice (block amaxes first, then the
    codes, since the global amax must be known before any code); keeping the first pass's
    bf16 rounding -- exact, the values are bf16 by construction -- replaces the second
    rotation GEMM by a copy. On the CPU a fresh buffer of that size would be page-faulted in
    on every call (no caching allocator), so one buffer per thread is kept and grown to the
    largest operand seen; elsewhere the device's caching allocator makes a fresh one cheap.
    The contents are only valid until the next quantization on the same thread.
    """
    m, k = shape
    if torch.device(device).type != "cpu":
        return torch.empty(m, k, dtype=torch.bfloat16, device=device)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < m * k:
        with torch.inference_mode(False):
            buf = torch.empty(m * k, dtype=torch.bfloat16, device="cpu")
        _SCRATCH.buf = buf
    return buf[: m * k].view(m, k)


def rotate_group_rows_keep(x: torch.Tensor, out: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """:func:`rotate_group_rows_into` (forward, rounded to bf16) with the rounded values left
    in ``keep`` (bf16, same shape) and returned; ``out`` (fp32) is the GEMM's scratch.

    The same GEMM call, and the rounding ``_round_bf16_`` does (fp32 -> bf16
    round-to-nearest-even): ``keep`` widened is exactly what :func:`rotate_group_rows_into`
    returns. Why not widen it back into ``out`` as well: the consumers (the block amaxes and
    the codes pass) read the bf16 values directly, and the widening pass cost as much as the
    rounding."""
    rotate_group_rows_into(x, out, round_to_bf16=False)
    return keep.copy_(out)


def rotate_token_groups(x: torch.Tensor, inverse: bool = False, round_to_bf16: bool = True) -> torch.Tensor:
    """RHT in the [M, K] layout: the transpose of ``apply_rht(x.t())``, without transposing.

    ``x`` is [M, K] with M (tokens) divisible by 16; every 16-row group X_g becomes R^T X_g
    (``inverse``: R X_g), i.e. y[16g + j, k] = sum_i x[16g + i, k] R[i, j]: the same 16-term
    fp32 dot products as ``g @ R`` on the rows of x^T, accumulated in the same order (the
    products are exact, +-0.25 x, so only the order could differ; tests assert equality).
    This is the quantizer's layout: no fp32 transpose of the operand (a strided gather costs
    ~3x a copy), and its columnwise 1x16 blocks then run along dim 0 in place.
    Evaluated over row chunks of ~2 MiB (:func:`rotate_group_rows_into`), rounded to bf16
    chunk by chunk.
    """
    m, k = x.shape
    if m % RHT_SIZE:
        raise ValueError(f"RHT needs the token dim divisible by 16, got {m}")
    xc = x.float().contiguous()
    out = torch.empty(m, k, dtype=torch.float32, device=x.device)
    step = max(RHT_SIZE, _CHUNK_ELEMS // max(k, 1) // RHT_SIZE * RHT_SIZE)
    for r0 in range(0, m, step):
        rotate_group_rows_into(xc[r0 : r0 + step], out[r0 : r0 + step], inverse, round_to_bf16)
    return out


def apply_rht(x_t: torch.Tensor, inverse: bool = False, round_to_bf16: bool = True) -> torch.Tensor:
    """Rotate each group of 16 consecutive elements of the last dim: y = g @ R (fp32 accumulate).

    ``x_t`` is the transposed operand [K, M] (M = tokens, divisible by 16). Returns fp32 values;
    with ``round_to_bf16`` they are rounded to bf16 first (TE's ``convert_accum_to_bf16``).
    ``inverse`` multiplies by R^T instead (used to un-rotate for dequantization).

    Layout-driven: a transposed view of a contiguous [M, K] tensor (``x.t()``, the
    quantizer's case) goes through :func:`rotate_token_groups` on the base and returns a
    transposed view, so the quantizer and this function compute identical bits; otherwise
    the contiguous rows are rotated as [n, 16] @ [16, 16] GEMMs over ~2 MiB chunks.
    """
    if x_t.shape[-1] % RHT_SIZE:
        raise ValueError(f"RHT needs the token dim divisible by 16, got {x_t.shape[-1]}")
    if x_t.dim() == 2 and not x_t.is_contiguous() and x_t.t().is_contiguous():
        return rotate_token_groups(x_t.t(), inverse, round_to_bf16).t()
    r = _matrix(inverse, x_t.device)
    g = x_t.float().reshape(-1, RHT_SIZE)
    out = torch.empty(g.shape, dtype=torch.float32, device=x_t.device)
    step = max(1, _CHUNK_ELEMS // RHT_SIZE)
    for r0 in range(0, g.shape[0], step):
        o = torch.matmul(g[r0 : r0 + step], r, out=out[r0 : r0 + step])
        if round_to_bf16:
            _round_bf16_(o)
    return out.view(x_t.shape)


@dataclass
class ChunkedRowRotation:
    """Accumulates ``apply_rht(v, inverse, round_to_bf16=False)`` of a contiguous [R, C] tensor
    v that is produced chunk by chunk: ``sink(vals, e0, e1)`` takes flat elements [e0, e1)
    of v (chunks of exactly ``chunk_elems``, the last one shorter) and writes their rotation
    into ``out``. The GEMM calls are the ones :func:`apply_rht` makes on the whole tensor
    (same chunk boundaries and shapes), so the bits are identical; v never exists in full.
    """

    out: torch.Tensor
    matrix: torch.Tensor
    chunk_elems: int = _CHUNK_ELEMS
    _flat: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self._flat = self.out.view(-1, RHT_SIZE)

    def sink(self, vals: torch.Tensor, e0: int, e1: int) -> None:
        g0, g1 = e0 // RHT_SIZE, e1 // RHT_SIZE
        torch.matmul(vals.view(-1, RHT_SIZE), self.matrix, out=self._flat[g0:g1])


def rht_rows_from_chunks(
    rows: int, cols: int, inverse: bool = False, device: torch.device | str = "cpu"
) -> ChunkedRowRotation:
    """A :class:`ChunkedRowRotation` for an fp32 [rows, cols] tensor (cols divisible by 16)."""
    if cols % RHT_SIZE:
        raise ValueError(f"RHT needs the token dim divisible by 16, got {cols}")
    out = torch.empty(rows, cols, dtype=torch.float32, device=device)
    return ChunkedRowRotation(out, _matrix(inverse, out.device))
