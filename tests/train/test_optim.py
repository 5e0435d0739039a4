"""Per-head Muon, the Muon/AdamW parameter split and the learning-rate schedules."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F

from openk3 import build_model, preset
from openk3.model.kda import KDAttention
from openk3.model.mla import MLAttention
from openk3.train.optim import (NS_COEFFS, HeadSplit, LRSchedule, Muon, build_optimizers, head_slices,
                                lr_multiplier, muon_updates, set_lr, zeropower_via_newtonschulz)

# Quintic NS with (3.4445, -4.7750, 2.0315) and 5 steps leaves well-conditioned inputs'
# singular values in about [0.68, 1.14] (observed on Gaussian matrices of aspect >= 2).
SV_LO, SV_HI = 0.6, 1.2


def _tiny(name: str = "debug", **changes):
    cfg = preset("debug").replace(vocab_size=256, **changes)
    if name == "kimi-linear":
        cfg = cfg.replace(arch="kimi_linear", kda_gate_lower_bound=None, moe_latent_size=None,
                          attn_res_block_size=None, q_lora_rank=None, hidden_act="silu")
    return cfg


def muon_update(M, split=None):
    """Muon's direction for one momentum."""
    return muon_updates([M], [split])[0]


def _loss(model, ids):
    logits = model(ids[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _batch(cfg, seed, B=2, T=17):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def _train(model, opts, ids):
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    _loss(model, ids).backward()
    for opt in opts:
        opt.step()


def _block_svals(u: torch.Tensor) -> torch.Tensor:
    """Singular values of an update block divided by its RMS-matching scale."""
    return torch.linalg.svdvals(u) / (0.2 * math.sqrt(max(u.shape[-2:])))


@pytest.mark.parametrize("shape", [(256, 64), (64, 256), (4, 48, 160), (3, 2, 40, 96)])
def test_newton_schulz_singular_values(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    X = zeropower_via_newtonschulz(G)
    assert X.shape == G.shape and X.dtype == G.dtype
    s = torch.linalg.svdvals(X)
    assert s.min() > SV_LO and s.max() < SV_HI, (s.min().item(), s.max().item())
    # the singular vectors are G's: X is close to the exact polar factor U V^T
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    assert ((X - U @ Vh).norm() / (U @ Vh).norm()) < 0.25


def _newton_schulz_fp64(G: torch.Tensor) -> torch.Tensor:
    """The quintic iteration as written, in fp64, on the wide form of G / ||G||_F."""
    a, b, c = NS_COEFFS
    tall = G.shape[-2] > G.shape[-1]
    X = G.double().mT if tall else G.double()
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def test_newton_schulz_is_the_quintic_iteration():
    """``(a I + b A + c A^2) X``, one product per step, is the quintic ``a X + (b A + c A^2) X``:
    in fp32 within rounding of the iteration run in fp64 (wide and tall inputs, a batch), the
    first iteration's input divided by its Frobenius norm (done through the Gram matrix)."""
    for shape in [(48, 160), (160, 48), (3, 40, 96)]:
        G = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        want = _newton_schulz_fp64(G)
        got = zeropower_via_newtonschulz(G.float()).double()
        assert ((got - want).norm() / want.norm()) < 1e-5, shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(64, 256, 512), (3, 1024, 4096), (8, 128, 1024), (2, 300, 200)])
def test_newton_schulz_in_bf16_on_cuda_stays_near_the_fp64_iteration(shape):
    """The CUDA path (bf16 iterates, the normalisation through the first Gram matrix and the
    per-matrix scaling kernel) within 3% of the same iteration in fp64 for every matrix
    (docstring: ~2%), a tall batch included."""
    G = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    want = _newton_schulz_fp64(G)
    got = zeropower_via_newtonschulz(G.bfloat16()).double()
    err = (got - want).norm(dim=(-2, -1)) / want.norm(dim=(-2, -1))
    assert err.max() < 0.03, err.max()


def test_newton_schulz_keeps_dtype_and_zero():
    G = torch.randn(32, 64, dtype=torch.bfloat16)
    assert zeropower_via_newtonschulz(G).dtype == torch.bfloat16
    assert zeropower_via_newtonschulz(torch.zeros(8, 16)).abs().max() == 0
    with pytest.raises(ValueError, match="steps"):  # the first iteration normalises X
        zeropower_via_newtonschulz(G, steps=0)


@pytest.fixture(scope="module")
def debug_grads():
    """A debug model after one backward pass on random tokens (real gradients)."""
    torch.manual_seed(0)
    cfg = _tiny()
    model = build_model(cfg)
    _loss(model, _batch(cfg, 0, B=4, T=65)).backward()
    return model


def test_per_head_update_is_orthogonal_per_head(debug_grads):
    attn = next(m for m in debug_grads.modules() if isinstance(m, KDAttention))
    H, K = attn.num_heads, attn.head_dim
    g = attn.q_proj.weight.grad  # [H*K, d]
    split = head_slices(debug_grads)[attn.q_proj.weight]
    assert split == HeadSplit(0, (K,))
    u = muon_update(g, split)
    for h in range(H):
        s = _block_svals(u[h * K:(h + 1) * K])
        assert s.min() > SV_LO and s.max() < SV_HI, (h, s.min().item(), s.max().item())
    whole = muon_update(g)  # same scale here (max(K, d) == max(H*K, d)), different directions
    assert (u - whole).norm() > 0.1 * whole.norm()


def test_one_head_per_head_muon_equals_plain_muon():
    g = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    plain = muon_update(g)
    assert torch.equal(muon_update(g, HeadSplit(0, (64,))), plain)
    assert torch.equal(muon_update(g, HeadSplit(1, (96,))), plain)
    # end to end: a one-head model trains identically with and without its head splits.
    # kv_b_proj stays split in both runs: its key and value rows are two matrices even then.
    cfg = _tiny(linear_num_heads=1, num_attention_heads=1)
    runs = []
    for per_head in (True, False):
        model = build_model(cfg, seed=0)
        opts = build_optimizers(model, lr=1e-2, weight_decay=0.1)
        kv_b = {p: s for p, s in opts[0].head_splits.items() if len(s.sizes) == 2}
        assert len(kv_b) == 2 and len(opts[0].head_splits) > len(kv_b)
        if not per_head:
            opts[0].head_splits = kv_b
        for step in range(2):
            _train(model, opts, _batch(cfg, step))
        runs.append([p.detach().clone() for p in model.parameters()])
    # Not bit-exact: Muon stacks same-shape blocks into one batched Newton-Schulz, and the two
    # runs stack different sets (a one-head block of o_proj joins the other 96x64 blocks), so
    # batched matmuls of different batch sizes may round differently (seen: 2e-6 on 4 of 32768
    # entries after 2 steps). A wrong split would move parameters by ~lr * 0.2 = 2e-3.
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_column_split_for_o_proj_and_separate_k_v_blocks(debug_grads):
    splits = head_slices(debug_grads)
    kda = next(m for m in debug_grads.modules() if isinstance(m, KDAttention))
    mla = next(m for m in debug_grads.modules() if isinstance(m, MLAttention))
    assert splits[kda.o_proj.weight] == HeadSplit(1, (kda.head_dim,))
    assert splits[mla.o_proj.weight] == HeadSplit(1, (mla.v_dim,))
    assert splits[mla.kv_b_proj.weight] == HeadSplit(0, (mla.nope, mla.v_dim))
    assert splits[mla.q_b_proj.weight] == HeadSplit(0, (mla.nope + mla.rope,))
    assert splits[mla.g_proj.weight] == HeadSplit(0, (mla.v_dim,))
    assert mla.q_a_proj.weight not in splits and mla.kv_a_proj_with_mqa.weight not in splits

    g = kda.o_proj.weight.grad  # [d, H*K]: head h owns columns h*K:(h+1)*K
    u, K = muon_update(g, splits[kda.o_proj.weight]), kda.head_dim
    for h in range(kda.num_heads):
        cols = slice(h * K, (h + 1) * K)
        torch.testing.assert_close(u[:, cols], muon_update(g[:, cols]), rtol=1e-5, atol=1e-6)
        s = _block_svals(u[:, cols])
        assert s.min() > SV_LO and s.max() < SV_HI

    # kv_b_proj with unequal key / value widths: each head's k rows and v rows are two matrices
    nope, v, H, r = 24, 40, 3, 16
    g = torch.randn(H * (nope + v), r, generator=torch.Generator().manual_seed(2))
    u = muon_update(g, HeadSplit(0, (nope, v)))
    for h in range(H):
        start = h * (nope + v)
        k_rows, v_rows = slice(start, start + nope), slice(start + nope, start + nope + v)
        torch.testing.assert_close(u[k_rows], muon_update(g[k_rows]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(u[v_rows], muon_update(g[v_rows]), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple of the head period"):
        muon_update(torch.randn(50, 8), HeadSplit(0, (nope, v)))


def test_kimi_linear_head_splits():
    model = build_model(_tiny("kimi-linear"))
    splits = head_slices(model)
    kda = next(m for m in model.modules() if isinstance(m, KDAttention))
    mla = next(m for m in model.modules() if isinstance(m, MLAttention))
    assert splits[kda.g_b_proj.weight] == HeadSplit(0, (kda.head_dim,))
    assert kda.g_a_proj.weight not in splits
    assert splits[mla.q_proj.weight] == HeadSplit(0, (mla.nope + mla.rope,))
    assert not hasattr(mla, "g_proj")


def test_vision_attention_is_split_by_head():
    """MoonViT's fused wqkv and its wo were orthogonalised whole (spec §3: each head's slice)."""
    from openk3.vision.tower import VisionBlock

    model = build_model(preset("debug-vl"))
    block = next(m for m in model.modules() if isinstance(m, VisionBlock))
    splits = head_slices(model)
    assert splits[block.wqkv.weight] == HeadSplit(0, (block.head_dim,))
    assert splits[block.wo.weight] == HeadSplit(1, (block.head_dim,))
    hd, H = block.head_dim, block.heads
    g = torch.randn(3 * H * hd, block.wqkv.in_features, generator=torch.Generator().manual_seed(4))
    u = muon_update(g, splits[block.wqkv.weight])
    for part in range(3):  # q, k, v; then head by head
        for h in range(H):
            rows = slice((part * H + h) * hd, (part * H + h + 1) * hd)
            torch.testing.assert_close(u[rows], muon_update(g[rows]), rtol=1e-5, atol=1e-6)


def test_routed_experts_orthogonalised_one_by_one():
    g = torch.randn(8, 64, 96, generator=torch.Generator().manual_seed(3))  # [E, F, D]
    u = muon_update(g)
    for e in range(8):  # atol: a batch of 8 and a batch of 1 round their fp32 products
        # differently (one element of 6144 at 1.2e-6 once a X + B X became one product)
        torch.testing.assert_close(u[e], muon_update(g[e]), rtol=1e-5, atol=2e-6)
        s = _block_svals(u[e])
        assert s.min() > SV_LO and s.max() < SV_HI


@pytest.mark.parametrize("name", ["debug", "kimi-linear"])
def test_every_parameter_in_exactly_one_optimizer(name):
    model = build_model(_tiny(name))
    named = dict(model.named_parameters())
    muon, adamw = build_optimizers(model, lr=1e-3, weight_decay=0.1)
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    seen = [p for opt in (muon, adamw) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len({id(p) for p in seen}) == len(named)

    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    decay, no_decay = ({id(p) for p in g["params"]} for g in adamw.param_groups)
    assert adamw.param_groups[0]["weight_decay"] == 0.1 and adamw.param_groups[1]["weight_decay"] == 0
    for n, p in named.items():
        if p.dim() < 2 or n.endswith("_res.proj.weight"):
            assert id(p) in no_decay, n
        elif n.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight", "conv1d.weight")):
            assert id(p) in decay, n
        else:
            assert id(p) in in_muon, n
    assert id(model.model.layers[1].mlp.experts.w1) in in_muon
    assert all(g["initial_lr"] == 1e-3 for opt in (muon, adamw) for g in opt.param_groups)

    (baseline,) = build_optimizers(model, lr=1e-3, weight_decay=0.1, optimizer="adamw")
    decay, no_decay = ({id(p) for p in g["params"]} for g in baseline.param_groups)
    assert decay | no_decay == {id(p) for p in named.values()} and not decay & no_decay
    assert in_muon <= decay


def test_decoupled_weight_decay_with_zero_gradient():
    model = build_model(_tiny())
    lr, wd = 0.01, 0.5
    muon, adamw = build_optimizers(model, lr=lr, weight_decay=wd)
    w, emb, norm = (model.model.layers[0].self_attn.q_proj.weight, model.model.embed_tokens.weight,
                    model.model.norm.weight)
    before = [t.detach().clone() for t in (w, emb, norm)]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    muon.step()
    adamw.step()
    torch.testing.assert_close(w, before[0] * (1 - lr * wd))
    torch.testing.assert_close(emb, before[1] * (1 - lr * wd))
    assert torch.equal(norm, before[2])  # 1-D: no decay


def test_batched_step_equals_one_matrix_at_a_time():
    """Muon.step stacks same-shape blocks of many parameters into one Newton-Schulz batch, in
    memory-bounded buckets; the result is each matrix's own per-head update (up to matmul
    rounding), whatever the bucket size."""
    cfg = _tiny()
    lr, wd = 1e-2, 0.1
    runs = []
    for bucket_numel in (1, 1 << 27):  # one parameter per bucket / all of them in one
        model = build_model(cfg, seed=0)
        opt, adamw = build_optimizers(model, lr=lr, weight_decay=wd)
        opt.bucket_numel = bucket_numel
        _train(model, [opt, adamw], _batch(cfg, 0))
        runs.append((model, opt))
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # by hand, one matrix at a time: first step, so the Nesterov momentum is (1 + mu) * grad
    model, opt = runs[1]
    mu = opt.param_groups[0]["momentum"]
    fresh = dict(build_model(cfg, seed=0).named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if p in opt.state:
            want = fresh[name] * (1 - lr * wd) - lr * muon_update((1 + mu) * p.grad, opt.head_splits.get(p))
            torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6, msg=name)
            checked += 1
    assert checked == len(opt.param_groups[0]["params"]) > 10


@pytest.mark.parametrize("nesterov,tensor_lr", [(True, False), (False, False), (True, True)])
def test_in_place_update_equals_the_gathered_reference(monkeypatch, nesterov, tensor_lr):
    """Muon's in-place path (Nesterov momentum written into the stacked Newton-Schulz input,
    tall blocks transposed there, each block's result added into its slice of the parameter)
    against the reference (``muon_updates`` on whole momenta, FSDP's path) over three steps of
    a model with every kind of block: per-head rows and columns, MLA's two-size key/value
    split, tall and wide matrices, stacked experts; with a float and a 0-dim tensor lr."""
    cfg = _tiny()
    runs = []
    for path in ("_update_in_place", "_update_gathered"):
        model = build_model(cfg, seed=0)
        opt, adamw = build_optimizers(model, lr=1e-2, weight_decay=0.1)
        opt.param_groups[0]["nesterov"] = nesterov
        if path == "_update_gathered":
            monkeypatch.setattr(opt, "_update_in_place", _reference_update(opt))
        for group in adamw.param_groups:  # Muon alone moves the model: AdamW's first steps are
            group["lr"] = 0.0             # sign-like, so they would amplify rounding differences
        for step in range(3):
            lr = 1e-2 * (1 - 0.2 * step)
            opt.param_groups[0]["lr"] = torch.tensor(lr) if tensor_lr else lr
            _train(model, [opt, adamw], _batch(cfg, step))
        runs.append(model)
    shapes = {tuple(p.shape) for p in runs[0].parameters() if p.dim() >= 2}
    assert any(s[-2] > s[-1] for s in shapes) and any(s[-2] < s[-1] for s in shapes)
    assert any(len(s) == 3 for s in shapes)  # stacked experts
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def _reference_update(opt: Muon):
    """Muon's reference path in place of its in-place one: the momentum of whole tensors, then
    ``muon_updates`` on them (what FSDP's DTensors take)."""
    def update(params, group):
        opt._momentum(params, group["momentum"])
        opt._update_gathered(params, group)
    return update


# bare parameters with every kind of block: row and column splits, a two-size split of unequal
# sizes (MLA's kv_b_proj), tall head blocks (a column split of a narrow matrix), stacked experts
# both ways, tall and wide whole matrices, and a column split of a 3-D tensor, whose blocks are
# not views of it (the in-place path hands it to the reference)
BARE = [((256, 128), HeadSplit(0, (32,))), ((128, 256), HeadSplit(1, (32,))),
        ((6 * 40, 64), HeadSplit(0, (16, 24))), ((8, 4 * 16), HeadSplit(1, (16,))),
        ((4, 96, 64), None), ((4, 64, 96), None), ((64, 200), None), ((200, 64), None),
        ((3, 16, 64), HeadSplit(1, (16,)))]


def _bare_paths(device: str, bucket_numel: int) -> list[list[torch.Tensor]]:
    """Three Muon steps on ``BARE``, in-place path and reference: each run's weight changes."""
    gen = torch.Generator(device=device).manual_seed(0)
    init = [torch.randn(s, generator=gen, device=device) for s, _ in BARE]
    grads = [[torch.randn(s, generator=gen, device=device) for s, _ in BARE] for _ in range(3)]
    results = []
    for path in ("_update_in_place", "_update_gathered"):
        params = [torch.nn.Parameter(w.clone()) for w in init]
        opt = Muon(params, lr=0.02, weight_decay=0.1, bucket_numel=bucket_numel,
                   head_splits={p: sp for p, (_, sp) in zip(params, BARE) if sp is not None})
        if path == "_update_gathered":
            opt._update_in_place = _reference_update(opt)
        for step, gs in enumerate(grads):
            opt.param_groups[0]["lr"] = torch.tensor(0.02 * (1 - 0.2 * step), device=device)
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() - w for p, w in zip(params, init)])
    return results


@pytest.mark.parametrize("bucket_numel", [1 << 27, 20_000])
def test_in_place_update_equals_the_gathered_reference_on_bare_parameters(bucket_numel):
    """Every kind of block of ``BARE``, in one bucket and in several, with a 0-dim tensor lr.
    The changes (~0.03) are differences of O(1) weights: they carry the weights' rounding
    (an fp32 ulp at 2-4 is 2.4e-7), hence atol 1e-6."""
    for (shape, _), a, b in zip(BARE, *_bare_paths("cpu", bucket_numel)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=str(shape))


def test_clipping_folded_into_muon_equals_clipping_first():
    """``update_step``'s path: the clipping scales all but Muon's gradients and Muon applies the
    coefficient in its momentum pass; three clipped steps give exactly the weights and momenta of
    torch's ``clip_grad_norm_`` followed by plain steps (the same products, rounded the same)."""
    from openk3.parallel.parallelize import Parallel

    cfg = _tiny()
    runs = []
    for folded in (False, True):
        model = build_model(cfg, seed=0)
        opts = build_optimizers(model, lr=1e-2, weight_decay=0.1)
        muon = opts[0]
        for step in range(3):
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            _loss(model, _batch(cfg, step)).backward()
            if folded:
                unscaled = [p for g in muon.param_groups for p in g["params"]]
                before = {p: p.grad.clone() for p in unscaled}
                norm, coef = Parallel(model, 0, 1).clip_grads_(0.05, unscaled=unscaled)
                assert coef is not None and coef < 1  # clipping is active
                assert all(torch.equal(p.grad, g) for p, g in before.items())  # left unscaled
                muon.step(grad_scale=coef)
                opts[1].step()
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                for opt in opts:
                    opt.step()
        runs.append((model, muon))
    (a, muon_a), (b, muon_b) = runs
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    for p, q in zip(muon_a.param_groups[0]["params"], muon_b.param_groups[0]["params"]):
        torch.testing.assert_close(muon_a.state[p]["momentum_buffer"], muon_b.state[q]["momentum_buffer"],
                                   rtol=0, atol=0)


def test_momentum_of_another_layout_takes_the_reference():
    """A gradient of another memory layout (set by hand, or a loaded momentum) makes a momentum
    whose head blocks are copies, not views: the in-place path must not update those copies (the
    momentum would stay zero) but hand the parameter to the reference."""
    runs = []
    for path in ("_update_in_place", "_update_gathered"):
        gen = torch.Generator().manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, 32, 16, generator=gen))
        opt = Muon([p], lr=0.02, weight_decay=0.1, head_splits={p: HeadSplit(0, (8,))})
        if path == "_update_gathered":
            opt._update_in_place = _reference_update(opt)
        for _ in range(3):
            p.grad = torch.randn(32, 4, 16, generator=gen).transpose(0, 1)  # [4, 32, 16], strided
            opt.step()
        runs.append((p.detach().clone(), opt.state[p]["momentum_buffer"].clone()))
    assert runs[0][1].norm() > 0
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=0, atol=0)
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_in_place_update_equals_the_gathered_reference_on_cuda():
    """The same on CUDA, where both paths run Newton-Schulz in bf16 (no model: fla's kernels
    would autotune for minutes at these widths); a 0-dim device lr, as the CUDA graphs use.
    The paths round the same bf16 input the same way; only the final scale-and-add rounds
    differently (fp32)."""
    for (shape, _), a, b in zip(BARE, *_bare_paths("cuda", 1 << 27)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=str(shape))


def test_muon_update_rms_is_matched():
    model = build_model(_tiny())
    w = model.model.layers[0].mlp.gate_proj.weight
    opt = Muon([w], lr=0.1, momentum=0.0, nesterov=False)
    before = w.detach().clone()
    w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(4))
    opt.step()
    rms = ((w - before) / 0.1).pow(2).mean().sqrt()
    assert 0.15 < rms < 0.22  # 0.2 times the RMS of NS's singular values (about 0.9)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_state_dict_round_trip(optimizer):
    cfg = _tiny()
    model = build_model(cfg, seed=0)
    opts = build_optimizers(model, lr=3e-3, weight_decay=0.1, optimizer=optimizer)
    for step in range(2):
        set_lr(opts, lr_multiplier(step, 6, 2))
        _train(model, opts, _batch(cfg, step))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opts": [o.state_dict() for o in opts]}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    resumed = build_model(cfg, seed=1)
    resumed.load_state_dict(ckpt["model"])
    resumed_opts = build_optimizers(resumed, lr=3e-3, weight_decay=0.1, optimizer=optimizer)
    for o, sd in zip(resumed_opts, ckpt["opts"]):
        o.load_state_dict(sd)
    for step in range(2, 4):
        for m, o in ((model, opts), (resumed, resumed_opts)):
            set_lr(o, lr_multiplier(step, 6, 2))
            _train(m, o, _batch(cfg, step))
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_warmup_and_cosine():
    kw = dict(max_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, **kw) == pytest.approx(1.0)
    assert lr_multiplier(10, **kw) == pytest.approx(1.0)
    assert lr_multiplier(99, **kw) == pytest.approx(0.1)
    assert lr_multiplier(500, **kw) == pytest.approx(0.1)
    mid = (10 + 99) / 2
    assert lr_multiplier(int(mid), **kw) == pytest.approx(0.55, abs=0.02)
    values = [lr_multiplier(s, **kw) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_shape():
    kw = dict(max_steps=100, warmup_steps=10, schedule="wsd", min_lr_ratio=0.0)  # decays over the last 20%
    assert lr_multiplier(0, **kw) == pytest.approx(0.1)
    assert all(lr_multiplier(s, **kw) == 1.0 for s in range(9, 80))
    assert lr_multiplier(99, **kw) == pytest.approx(0.0)
    decay = [lr_multiplier(s, **kw) for s in range(79, 100)]
    steps = [a - b for a, b in zip(decay, decay[1:])]
    assert all(d == pytest.approx(steps[0]) for d in steps) and steps[0] > 0  # linear


def test_schedule_validation_and_set_lr():
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, 10, 1, schedule="linear")
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_multiplier(0, 10, 10)
    model = build_model(_tiny())
    opts = build_optimizers(model, lr=2e-3, weight_decay=0.0)
    set_lr(opts, 0.25)
    assert all(g["lr"] == pytest.approx(5e-4) for o in opts for g in o.param_groups)


def test_muon_rejects_vectors():
    with pytest.raises(ValueError, match="matrices"):
        Muon([torch.nn.Parameter(torch.zeros(4))])


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
@pytest.mark.parametrize("at_step", [5, 40, 75, 99, 100])
def test_extending_a_run_never_raises_the_learning_rate(schedule, at_step):
    """Resuming with a larger max_steps continues from the multiplier reached, down to the
    minimum at the new end; it never jumps up (a restarted cosine would)."""
    old = LRSchedule(100, 10, schedule, 0.1)
    new = old.extended(300, at_step)
    reached = old(at_step)
    values = [new(s) for s in range(at_step, 300)]
    assert values[0] == pytest.approx(reached)
    if at_step >= 10:  # past warm-up: it only ever goes down from here
        assert all(b <= a + 1e-12 for a, b in zip(values, values[1:]))
    assert values[-1] == pytest.approx(0.1)
    restarted = lr_multiplier(at_step, 300, 10, schedule, 0.1)
    if schedule == "cosine" and 10 < at_step:
        assert restarted > reached  # what the old code did


def test_wsd_extended_in_its_stable_phase_keeps_it():
    new = LRSchedule(100, 10, "wsd", 0.1).extended(300, 50)
    assert all(new(s) == 1.0 for s in range(50, 240))
    assert new(299) == pytest.approx(0.1)


def test_extension_during_warmup_and_round_trip():
    s = LRSchedule(100, 10, "cosine", 0.1).extended(200, 5)
    assert s.anchor is None and s(5) == lr_multiplier(5, 200, 10)
    again = s.extended(400, 150)
    assert LRSchedule.from_dict(again.to_dict()) == again and again.anchor[0] == 150


@pytest.mark.parametrize("shape, split", [((32, 48), HeadSplit(0, (8,))),  # blocks are views
                                          ((2, 16, 24), HeadSplit(1, (8,)))])  # copied blocks
def test_grad_scale_equals_gradients_scaled_first_on_both_paths(shape, split):
    """The copied-block path (``_update_gathered``) took the unscaled gradient into Nesterov's
    ``g + mu m`` (0.01 off after three steps); the in-place path did not."""
    torch.manual_seed(0)
    w0, grads = torch.randn(shape), [torch.randn(shape) for _ in range(3)]
    out = []
    for folded in (True, False):
        p = torch.nn.Parameter(w0.clone())
        opt = Muon([p], lr=0.02, weight_decay=0.0, head_splits={p: split})
        for g in grads:
            p.grad = g.clone() if folded else g * 0.1
            opt.step(grad_scale=torch.tensor(0.1) if folded else None)
        out.append(p.detach())
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-6)
