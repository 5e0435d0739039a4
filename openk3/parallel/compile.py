"""Regional compilation and activation checkpointing of the decoder layers, applied from outside
the model by ``parallelize`` (in torchtitan's order: checkpointing, compilation, then FSDP2).

Compiled regions (``REGIONS``) are the modules that run the same code with the same shapes in
every layer of their kind: the two attentions (``KDAttention``, ``MLAttention``), the routed
experts and the GLU MLPs (dense layers, shared experts). Dynamo keeps its graphs per code
object, so each kind is traced and compiled once and every layer of that kind reuses the graph:
the number of graphs does not grow with depth. Inside a region the norms and activations are
traced into the region's graph (``openk3.ops.fast.compiled`` steps aside), and fla-core's
Triton kernels are opaque calls with a graph break around each (``torch.compiler.disable`` in
``openk3/ops``): registering them as custom ops would remove the breaks but means rewriting
their autograd by hand around fla's internal forward and backward functions.

What stays eager, and why (measured with dynamo's recompile log on ``small``'s layer pattern):

* ``DecoderLayer.forward`` itself: it branches on the layer's position (``index``, for whether
  it seals an AttnRes block, and the length of the bank), and dynamo specialises on both: one
  graph per layer, 24 on ``small``, beyond dynamo's default limit of 8 recompiles per function,
  past which the remaining layers run eagerly after all. What the layer adds to its regions is
  two residual adds, two norms (each compiled on its own) and the AttnRes reads (fla's fused
  kernel on CUDA).
* the MoE router: the balancer's forward hook on it holds the router's index in its closure;
  traced, it too makes one graph per MoE layer. Its few small kernels stay eager.

Activation checkpointing keeps only each decoder layer's inputs and recomputes its forward
(compiled regions included) during backward: non-reentrant ``torch.utils.checkpoint``, around
the layer's ``forward`` so that the layer's own hooks (the trainer's activation probe, FSDP2's)
do not run again. Hooks inside a layer (the balancer's on each router) run in the recomputation
too and store the same routing again.

Both leave module names, parameters and hooks as they are: the layer's or region's ``forward``
is replaced on the instance (a deep copy of the model would still call the original's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from openk3.model.kda import KDAttention
from openk3.model.mla import MLAttention
from openk3.model.moe import MLP, RoutedExperts
from openk3.ops.fast import prepare_compile

REGIONS = (KDAttention, MLAttention, RoutedExperts, MLP)


def compile_layers(model: nn.Module, backend: str | Callable = "inductor") -> None:
    """``torch.compile`` every ``REGIONS`` module of the decoder layers (``model.model.layers``
    and the MTP layer's block, ``model.mtp``, which reuses their graphs), in place.

    Only training forwards (and their recomputation in backward) run the compiled graphs.
    Evaluation and generation run without autograd, rarely, and eagerly: compiled, they would
    add graphs of their own (grad mode is part of every graph's guards); generation's fp32
    experts take the reference loop, whose host reads would recompile at every token; and its
    decoding cache is a Python object the layer updates in place.

    ``dynamic=None``: a region's first graph is specialised to the training shape (the best
    kernels); a region that meets a second shape compiles one graph with symbolic sizes that
    serves every later one. ``fullgraph=False``: the KDA region breaks around fla's kernels by
    design, and the CPU references read values on the host (the expert loop's row counts, the
    bounded gate's check).
    """
    for layer in [*model.model.layers, *model.mtp]:
        for module in layer.modules():
            if isinstance(module, REGIONS):
                _replace_forward(module, lambda forward: _compiled(forward, backend))


def checkpoint_layers(model: nn.Module) -> None:
    """Recompute each decoder layer of ``model.model.layers`` (and the MTP layer, ``model.mtp``)
    in backward instead of keeping its activations (per layer only its inputs stay: ``p``
    [B, T, d] and the AttnRes bank, which the model keeps anyway), in place. Costs about one
    more forward per step."""
    for layer in [*model.model.layers, *model.mtp]:
        _replace_forward(layer, _checkpointed)


def _replace_forward(module: nn.Module, wrap: Callable[[Callable], Callable]) -> None:
    if "forward" in vars(module):
        raise ValueError(f"{type(module).__name__}.forward is already replaced on this instance "
                         "(compiled or checkpointed twice?)")
    module.forward = wrap(module.forward)


def _compiled(forward: Callable, backend: str | Callable) -> Callable:
    prepare_compile()  # the Triton calls' disabled forms, before anything traces them
    graph = torch.compile(forward, backend=backend, dynamic=None, fullgraph=False)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        tensors = all(a is None or isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
        if torch.is_grad_enabled() and tensors:
            return graph(*args, **kwargs)
        return forward(*args, **kwargs)

    return run


def _checkpointed(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation, generation: nothing is kept for backward
            return forward(*args, **kwargs)
        # non-reentrant: the bank is a list, some inputs need no grad, and outputs made inside
        # (the router scores of the aux loss) are used outside. The forward draws no random
        # numbers, so the RNG state need not be saved and restored.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return run
