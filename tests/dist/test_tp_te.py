"""Tensor + sequence parallelism on the Transformer Engine backend, checked on CPU: two ranks,
each on a virtual sm100 GPU with TE's own Python (newest release installed, kernels emulated:
TE's own TP arguments divide the layer, its own sequence-parallel collectives run along the
first dimension, its current-scaling amax reductions cover the sequence-parallel operands).

The column- and row-parallel layers must be TE's own ``Linear`` built with TE's ``tp_group``
(the TP group's ranks), ``tp_size``, ``parallel_mode`` and ``sequence_parallel`` -- TE does the
collectives, nothing home-made around them -- and must train like the emulated backend's TP
layers (MXFP8: block scales, no amax reduction, so the two backends run the same numbers in
another layout; the losses agree within the tolerance of tests/dist/test_tp_training.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lptrain.testing.dist import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _tp_te_cases import battery, pipelined_te  # noqa: E402

pytestmark = pytest.mark.dist

LOSS_RTOL = 2e-3  # (see tests/dist/test_tp_training.py)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(battery, 2, args=(str(tmp_path_factory.mktemp("cache")),), init_process_group=False,
                           timeout_s=300)


def test_te_layers_get_tes_tensor_parallel_arguments_and_train_like_the_emulation(results: list[dict]) -> None:
    for r in results:
        assert r["te_backend"].endswith("TE's own Python, kernels emulated"), r["te_backend"]
        assert r["violations"] == []
        layers = r["layers"]
        assert sorted(layers) == sorted(f"layers.{i}.{m}" for i in range(2) for m in (
            "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"))
        for name, kw in layers.items():
            column = name.endswith(("linear_qkv", "linear_fc1"))
            assert kw["parallel_mode"] == ("column" if column else "row"), name
            assert kw["tp_size"] == 2 and kw["sequence_parallel"] is True and kw["tp_group_ranks"] == [0, 1]
        assert layers["layers.0.self_attention.linear_qkv"]["weight"] == (96, 64)  # 192 rows / 2
        assert layers["layers.0.mlp.linear_fc2"]["weight"] == (64, 128)  # 256 columns / 2
        for te, emu in zip(r["te"], r["emulated"], strict=True):
            assert te == pytest.approx(emu, rel=LOSS_RTOL)
    assert results[0]["te"] == results[1]["te"]


def test_sequence_parallel_te_layers_copy_no_activation_for_more_than_one_sequence(results: list[dict]) -> None:
    """Issue 48 finding 6: TE's sequence-parallel ``Linear`` takes ``[s, b, h]``; the layer
    stack stores its activations that way on TE (lptrain.model.layout), so a layer's forward
    and the backward copy no more activations at micro-batch 2 than at 1 (where the two
    storages coincide). Batch-first, as before, every TE linear of the layer copied its input
    (and the old wrapper its output too): 8 copies per layer forward."""
    for r in results:
        c = r["copies"]
        (fwd1, bwd1), (fwd2, bwd2) = c["mb1"], c["mb2"]
        assert fwd2 == fwd1, c  # inside the layer
        assert bwd2 <= bwd1 + 1, c  # the head's sequence gather (one per model, not per layer)
        assert c["before_fix_mb2"][0] == fwd1 + 8, c  # the fix patched away: input and output of 4 linears
        assert c["bitwise_as_before"], c  # the same loss and gradients, bit for bit


def test_pp2_tp2_sp_on_te_matches_tp2_bitwise(results: list[dict], tmp_path: Path) -> None:
    """PP 2 x TP 2 + SP on TE's own Python: the sequence-first hidden states sent and received
    between the stages (``chunk_io``) and the schedule's ``is_first_microbatch`` give the
    unpipelined TP 2 run's losses and grad norms, bit for bit."""
    piped = run_distributed(pipelined_te, 4, args=(str(tmp_path / "cache"),), init_process_group=False,
                            timeout_s=300)
    want = results[0]
    for r in piped:
        n = len(r["losses"])
        assert r["losses"] == want["te"][:n] and r["grad_norms"] == want["te_norms"][:n], (r, want)
