"""SiTU-GLU and SwiGLU activations (K3_SPEC §1.4).

SiTU-GLU: ``h = [b1 tanh(gate/b1) * sigmoid(gate)] * [b2 tanh(up/b2)]`` in fp32, so
``|h| <= b1 * b2`` (100 for K3). The sigmoid takes the *uncapped* gate.
SwiGLU (Kimi Linear): ``h = silu(gate) * up``.
The K3 MLA output gate: ``o * sigmoid(gate)`` (``sigmoid_gate``).

On CUDA ``situ_glu`` and ``sigmoid_gate`` run as one compiled kernel each
(``openk3.ops.fast.compiled``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.fast import compiled, use_fast_path


def situ_glu_ref(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0,
                 beta2: float = 25.0) -> torch.Tensor:
    """gate, up: [..., F] (any float dtype); math in fp32; returns gate.dtype."""
    g, u = gate.float(), up.float()
    h = beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))
    return h.to(gate.dtype)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_situ_glu_fast = compiled(situ_glu_ref)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return (_situ_glu_fast if use_fast_path(gate) else situ_glu_ref)(gate, up, beta1, beta2)


def sigmoid_gate_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` in the inputs' dtype: K3's MLA output gate (``g_proj``)."""
    return x * torch.sigmoid(gate)


_sigmoid_gate_fast = compiled(sigmoid_gate_ref)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``sigmoid_gate_ref``; one kernel on CUDA instead of a sigmoid and a product (the compiled
    kernel keeps the sigmoid in fp32 and rounds once)."""
    if x.shape != gate.shape:
        raise ValueError(f"sigmoid_gate: x {tuple(x.shape)} and gate {tuple(gate.shape)} differ")
    return (_sigmoid_gate_fast if use_fast_path(x) else sigmoid_gate_ref)(x, gate)
