"""FSDP2 data parallelism, applied from outside the model (the model code stays single-device).

Each decoder layer (and the MTP layer) is one FSDP unit (its parameters are all-gathered just before it runs and
freed after), the embedding/head/final norms form the root unit. On CUDA the compute runs in
bf16 with fp32 gradient reduction; on CPU (gloo) everything stays fp32.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model, env, ignored_params: set | None = None) -> None:
    """Shard ``model`` in place over all ranks of the default process group.

    ``ignored_params`` (the rank-local expert shares of MoonEP) are left as they are."""
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    mp = None
    if env.device.type == "cuda" and env.dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=env.dtype, reduce_dtype=torch.float32)
    kw = dict(mesh=mesh, ignored_params=ignored_params or None)
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in [*model.model.layers, *model.mtp]:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
