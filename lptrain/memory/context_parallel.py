"""What context parallelism changes in one rank's memory.

A context-parallel rank holds ``seq_length / CP`` tokens of each sequence (two chunks), and
everything it keeps for the backward is per token -- the attention included: each core keeps
the same q, k, v, output and log-sum-exp per token as the attention at CP 1 -- so the
activations of one micro-batch divide by CP (:func:`tokens_per_rank`). Weights, gradients and
optimizer states do not: CP shards no weight (the distributed optimizer's shards are cut over
data x context parallel, which the layout planner sees as the group size).

What CP adds is the attention's communication buffers, alive while one layer's attention runs
(:func:`cp_buffer_bytes`), by ``model.cp_comm_type``:

* ``p2p`` (ring, also the ring level of ``a2a+p2p``): the backward holds the key/value block it
  computes on and the next one arriving (2 x 2 x ``b s_r g d`` activation bytes), the moving
  fp32 key/value gradient and the one arriving (2 x 2 x ``b s_r g d`` x 4 bytes), and one
  query chunk's fp32 scores, probabilities and their gradient against the keys it sees (at
  most ``3 x b n c s_r`` x 4 bytes, ``c = seq / 2 CP``); ``s_r`` the ring's sequence per rank
  (``seq / CP``; times the a2a size under ``a2a+p2p``, whose ring carries 1/a2a of the heads);
* ``a2a``: the all-to-all's copies of q, k, v and the output with this rank's heads and the
  whole sequence (as many bytes as this rank's q, k, v, o), twice (sent and received);
* ``allgather``: the gathered keys and values (``b s g d`` each) and their gradients before the
  reduce-scatter, plus the mask (``s_r x s`` bytes).

``n`` and ``g`` are the heads and kv heads of one tensor-parallel rank.
"""

from __future__ import annotations

from lptrain.config.schema import LPTrainConfig


def cp_size(cfg: LPTrainConfig) -> int:
    return max(1, cfg.model.context_parallel_size)


def tokens_per_rank(cfg: LPTrainConfig) -> int:
    """Tokens of one micro-batch on one rank: ``micro_batch_size x seq_length / CP``."""
    return cfg.train.micro_batch_size * cfg.model.seq_length // cp_size(cfg)


def cp_buffer_bytes(cfg: LPTrainConfig, a: int) -> int:
    """Peak bytes of one layer's context-parallel attention buffers (module doc; 0 at CP 1).
    ``a``: the activation dtype's bytes."""
    cp = cp_size(cfg)
    if cp <= 1:
        return 0
    m = cfg.model
    tp = max(1, m.tensor_model_parallel_size)
    n = m.num_attention_heads // tp
    g = (m.num_query_groups or m.num_attention_heads) // tp
    d = m.hidden_size // m.num_attention_heads
    b, s = cfg.train.micro_batch_size, m.seq_length
    s_rank = s // cp
    kind = m.cp_comm_type
    if kind == "a2a":
        return 2 * b * s_rank * (2 * n + 2 * g) * d * a
    if kind == "allgather":
        return 2 * 2 * b * s * g * d * a + s_rank * s
    ring = s_rank
    extra = 0
    if kind == "a2a+p2p":
        sizes = m.hierarchical_context_parallel_sizes or [1, cp]
        a2a = max(1, int(sizes[0]))
        ring = s_rank * a2a  # the a2a level's whole sequence, for 1/a2a of the heads
        n, g = n // a2a, max(1, g // a2a)
        extra = 2 * b * s_rank * (2 * n * a2a + 2 * g * a2a) * d * a
    c = s_rank // 2  # one chunk: the rows of one block's scores
    kv = 2 * b * ring * g * d
    scores = 3 * b * n * c * ring * 4  # against at most the whole block's keys
    return 2 * kv * a + 2 * kv * 4 + scores + extra


def context_parallel_note(cfg: LPTrainConfig) -> str:
    """The planner's note for a context-parallel run."""
    m = cfg.model
    return (f"context parallel {cp_size(cfg)} ({m.cp_comm_type}): each rank holds "
            f"{m.seq_length // cp_size(cfg)} of the {m.seq_length} tokens of a sequence; activations "
            "are that rank's, the attention's communication buffers of one layer are counted apart")
