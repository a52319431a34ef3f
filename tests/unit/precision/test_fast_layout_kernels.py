"""The transpose shortcut keeps every bit: ``byte_transpose.transposed_copy`` transposes large byte
tensors four rows per int32 word, small ones with few columns through an int16 copy (tiny
ones, other dtypes and odd row counts through torch's transpose); each case is compared
with torch's plain transpose on random bit patterns, exactly (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch

from lptrain.precision.byte_transpose import transposed_bytes, transposed_copy


def _random_words(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int32)


@pytest.mark.parametrize("shape", [(512, 4096), (8, 24), (1, 7), (0, 5)])
def test_transposed_copy_of_words_is_the_bitwise_transpose_and_never_aliases(shape: tuple[int, int]) -> None:
    w = _random_words(shape)
    w[0:1, 0:1] = 0x7FC00001 if w.numel() else w[0:1, 0:1]  # a quiet NaN with a payload
    out = transposed_copy(w)
    assert out.dtype == torch.int32 and out.is_contiguous()
    assert torch.equal(out, w.t().contiguous())
    if w.numel():
        assert out.data_ptr() != w.data_ptr()
        out[0, 0] += 1  # the result owns its storage
        assert not torch.equal(out, w.t().contiguous())


@pytest.mark.parametrize("shape", [(256, 4096), (4, 3), (12, 40), (6, 10), (0, 8),
                                   (512, 64), (513, 192), (1024, 256), (64, 512)])
def test_transposed_copy_of_bytes_is_the_bitwise_transpose(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(1)
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    out = transposed_copy(b)  # (6, 10): rows not divisible by 4 take torch's byte transpose
    assert out.dtype == torch.uint8 and out.is_contiguous()
    assert torch.equal(out, b.t().contiguous())


def test_transposed_copy_keeps_an_fp8_dtype_view() -> None:
    b = (torch.arange(512 * 64) % 256).to(torch.uint8).view(512, 64).view(torch.float8_e4m3fn)
    for fn in (transposed_copy, transposed_bytes):
        out = fn(b)  # the int16 path: same dtype back, same bytes
        assert out.dtype == torch.float8_e4m3fn
        assert torch.equal(out.view(torch.uint8), b.view(torch.uint8).t().contiguous())


def test_transposed_copy_of_a_strided_byte_view() -> None:
    """A non-contiguous byte tensor (e.g. a column slice) takes a path that reads strides."""
    g = torch.Generator().manual_seed(2)
    big = torch.randint(0, 256, (1024, 1024), generator=g, dtype=torch.int32).to(torch.uint8)
    for b in (big[:, :512], big[::2, :128], big):
        assert torch.equal(transposed_copy(b), b.t().contiguous())
        assert torch.equal(transposed_bytes(b), b.t().contiguous())
