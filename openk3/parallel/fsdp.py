"""FSDP2 data parallelism, applied from outside the model (the model code stays single-device).

Each decoder layer (and the MTP layer) is one FSDP unit (its parameters are all-gathered just before it runs and
freed after), the embedding/head/final norms form the root unit. On CUDA the compute runs in
bf16 with fp32 gradient reduction; on CPU (gloo) everything stays fp32.

Under a bf16 policy each MoE router is a unit of its own that keeps fp32: the router and
Quantile Balancing run in fp32 (K3_SPEC §1.5-1.6), and the layer's policy would all-gather the
router weight in bf16 (a 256 KB all-gather per `small` layer more). ``A_log`` and ``dt_bias`` share
their unit with KDA's projections and are all-gathered in bf16 (issue P7's notes).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from openk3.model.moe import Router


def apply_fsdp(model, env, ignored_params: set | None = None,
               param_dtype: torch.dtype | None = None) -> None:
    """Shard ``model`` in place over all ranks of the default process group.

    ``ignored_params`` (the rank-local expert shares of MoonEP) are left as they are.
    ``param_dtype``: the dtype parameters are all-gathered in for compute (default: ``env.dtype``
    on CUDA, fp32 on the CPU); the routers stay fp32 whatever it is."""
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    if param_dtype is None:
        param_dtype = env.dtype if env.device.type == "cuda" else torch.float32
    kw = dict(mesh=mesh, ignored_params=ignored_params or None)
    if param_dtype != torch.float32:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    fp32 = dict(kw, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
    for layer in [*model.model.layers, *model.mtp]:
        if "mp_policy" in kw:
            for module in layer.modules():
                if isinstance(module, Router):
                    fully_shard(module, **fp32)
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
