"""Kimi Delta Attention (KDA) numerics (K3_SPEC §1.2), one file per path:

* ``gate.py``   ``kda_gate``: raw decay logits -> per-channel log decay g (``SAFE_LOWER_BOUND``).
* ``naive.py``  ``kda_recurrent_ref``: the per-token recurrence, the ground truth.
* ``chunk.py``  ``kda_chunk_ref``: the chunkwise (WY / UT-transform) form for training and prefill.
* ``decode.py`` ``kda_decode_step``: one decode token.
* ``fla.py``    fla-core's Triton kernels, the fast path on GPU.
* ``dispatch.py`` ``kda``: the entry point layers call; picks fla on CUDA, the references elsewhere.
* ``pooled.py`` ``kda_decode_``: one decode token per row, the states read from and written
  back to a pool of state slots in place (the serving decode step); ``kda_verify_pooled``: T
  tokens per row from pool rows, which are not written (the speculative verify step).
* ``verify.py`` ``kda_verify``: a speculative-verification segment with per-position states, and
  the rollback of the recurrent and conv states to the last accepted token (``rollback_*``,
  ``conv_state_rollback``).

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; g (log decay, fp32) ``[B, T, H, K]``;
beta (already sigmoided) ``[B, T, H]``; state ``[B, H, K, V]`` fp32. All internal math is
fp32; outputs are cast to ``v.dtype`` and final states stay fp32. The short convolution in
front of q, k, v is ``openk3.ops.conv``.
"""

from openk3.ops.kda.chunk import kda_chunk_ref
from openk3.ops.kda.decode import kda_decode_step
from openk3.ops.kda.dispatch import kda
from openk3.ops.kda.gate import SAFE_LOWER_BOUND, kda_gate
from openk3.ops.kda.naive import kda_recurrent_ref
from openk3.ops.kda.pooled import kda_decode_, kda_verify_pooled
from openk3.ops.kda.verify import (
    conv_state_rollback,
    conv_state_rollback_ref,
    kda_verify,
    kda_verify_ref,
    rollback_recompute_,
    rollback_snapshot_,
)

__all__ = ["SAFE_LOWER_BOUND", "conv_state_rollback", "conv_state_rollback_ref", "kda",
           "kda_chunk_ref", "kda_decode_", "kda_decode_step", "kda_gate", "kda_recurrent_ref", "kda_verify",
           "kda_verify_pooled", "kda_verify_ref", "rollback_recompute_", "rollback_snapshot_"]
