"""Fused projections (``openk3.model.fuse``): the same function, the same checkpoint, fewer
kernels per decode step."""

from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

import openk3.model.fuse as fuse_mod
import openk3.model.kda as kda_mod
import openk3.model.moe as moe_mod
from openk3 import build_model, preset
from openk3.checkpoint.hf import save_pretrained
from openk3.model.fuse import add_linear_, fuse_projections
from openk3.model.kda import KDAttention
from openk3.model.mla import MLAttention
from openk3.model.moe import MLP, MoE
from openk3.ops.norm import rms_norm
from openk3.serve.config import EngineConfig
from openk3.serve.model_runner import ModelRunner
from tests.ops.checks import run_doctests

ARCHS = ["kimi_k3", "kimi_linear"]
GEMMS = ("mm", "addmm", "bmm", "convolution")


def _config(arch: str):
    """``debug``; Kimi Linear's variant also has no query LoRA (``q_proj``, as the 48B model)."""
    cfg = preset("debug")
    if arch == "kimi_linear":
        cfg = cfg.replace(arch="kimi_linear", kda_gate_lower_bound=None, moe_latent_size=None,
                          attn_res_block_size=None, hidden_act="silu", routed_scaling_factor=2.446,
                          q_lora_rank=None)
    return cfg


@torch.no_grad()
def _frozen(model):
    """Frozen, AttnRes queries away from the uniform mixture, and routing that does not depend
    on rounding: the correction bias picks the same experts for every token, so fused and
    unfused models run the same expert GEMMs (and bf16 cannot flip a choice)."""
    model.eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if name.endswith("_res.proj.weight"):
            p.normal_(0, 0.1)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.arange(b.numel(), 0, -1.0) * 10)
    return model


def _model(arch: str):
    return _frozen(build_model(_config(arch), seed=0))


def _ids(cfg, T=23):
    return torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))


def _fused_layers(model):
    """The modules with a fused projection (a latent MoE's holds its shared experts' too)."""
    return [m for m in model.modules() if isinstance(m, (KDAttention, MLAttention, MLP))
            or isinstance(m, MoE) and m.cfg.moe_latent_size is not None]


class _KernelCounter(TorchDispatchMode):
    """Counts the aten ops that reach the kernels (below autograd and composite decompositions)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_model_computes_the_same_logits_and_decodes(arch):
    model = _model(arch)
    ids = _ids(model.cfg)
    with torch.no_grad():
        unfused = model(ids).logits
        fuse_projections(model)
        assert all(m.fused_proj is not None for m in _fused_layers(model))
        fused = model(ids).logits
        cache = model.new_cache()
        parts = [model(ids[:, :9], cache).logits]
        parts += [model(ids[:, t:t + 1], cache).logits for t in range(9, 16)]
        parts.append(model(ids[:, 16:], cache).logits)  # a chunk after decoding
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(parts, 1), unfused, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_are_views_of_the_fused_tensors_and_checkpoints_are_unchanged(arch, tmp_path):
    model = _model(arch)
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_pretrained(model, tmp_path / "unfused")
    bytes_before = sum(p.numel() * p.element_size() for p in model.parameters())
    fuse_projections(model)
    # the same Parameter objects under the same names
    assert all(params[name] is p for name, p in model.named_parameters()) and len(params) == len(
        dict(model.named_parameters()))
    for layer in _fused_layers(model):
        groups = [(layer.fused_proj, layer.input_projections())]
        if isinstance(layer, KDAttention):
            groups.append((layer.fused_conv, layer.short_convs()))
        for fused, modules in groups:
            assert fused.shape[0] == sum(m.weight.shape[0] for m in modules)
            for m in modules:
                assert m.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    # no weight is stored twice: the parameters' storages hold exactly the parameters' bytes
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == bytes_before
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)
    save_pretrained(model, tmp_path / "fused")
    for shard in sorted((tmp_path / "unfused").glob("*.safetensors")):
        a, b = load_file(shard), load_file(tmp_path / "fused" / shard.name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (tmp_path / "fused").iterdir()) == sorted(
        p.name for p in (tmp_path / "unfused").iterdir())


def test_load_state_dict_writes_through_to_the_fused_tensors():
    model, other = _model("kimi_k3"), build_model(_config("kimi_k3"), seed=1).eval()
    ids = _ids(model.cfg)
    fuse_projections(model)
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, other(ids).logits, rtol=1e-5, atol=1e-5)


def test_fusing_twice_is_a_no_op_and_fusing_again_after_moving_the_model_reshares():
    model = fuse_projections(_model("kimi_k3"))
    fused = [m.fused_proj for m in _fused_layers(model)]
    fuse_projections(model)
    assert all(a is m.fused_proj for a, m in zip(fused, _fused_layers(model)))
    model.double()  # copies every weight on its own: the views are gone
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() != attn.fused_proj.data_ptr()
    fuse_projections(model)
    assert attn.fused_proj.dtype == torch.float64
    assert attn.q_proj.weight.data_ptr() == attn.fused_proj.data_ptr()


def test_fusion_refuses_trainable_parameters_and_a_trainable_fused_model_gets_every_gradient():
    model = build_model(_config("kimi_k3"), seed=0)
    with pytest.raises(ValueError, match=r"require grad \(first: model\.embed_tokens\.weight\).*requires_grad_\(False\)"):
        fuse_projections(model)
    reference = build_model(_config("kimi_k3"), seed=0)
    fuse_projections(model.requires_grad_(False))
    for p, q in zip(model.parameters(), reference.parameters()):  # made trainable again
        p.requires_grad_(q.requires_grad)
    ids = _ids(model.cfg)
    model(ids).logits.square().mean().backward()
    reference(ids).logits.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_decode_step_runs_the_expected_number_of_fewer_kernels(arch, monkeypatch):
    """Per layer one GEMM instead of one per projection of the layer input, and per KDA layer
    one short convolution instead of three. (The CPU reference convolution is not an aten
    convolution: its calls are counted at the layer's call site.)"""
    model = _model(arch)
    cfg = model.cfg
    convs = Counter()

    def counted_conv(*args, **kwargs):
        convs["causal_conv1d"] += 1
        return conv(*args, **kwargs)

    conv = kda_mod.causal_conv1d
    monkeypatch.setattr(kda_mod, "causal_conv1d", counted_conv)
    ids = _ids(cfg, T=6)

    def decode_step_kernels() -> Counter:
        cache = model.new_cache()
        model(ids[:, :5], cache)
        convs.clear()
        with torch.no_grad(), _KernelCounter() as counter:
            model(ids[:, 5:], cache)
        return Counter({op: counter.counts[op] for op in GEMMS}) + convs

    with torch.no_grad():
        unfused = decode_step_kernels()
        fuse_projections(model)
        fused = decode_step_kernels()
    n_mla = sum(cfg.is_mla_layer(i) for i in range(cfg.num_hidden_layers))
    n_kda = cfg.num_hidden_layers - n_mla
    n_latent_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if cfg.is_k3 else 0
    mla_group = 3 if cfg.is_k3 else 2  # q_a_proj (q_proj), kv_a_proj_with_mqa, K3's g_proj
    # KDA: 6 projections -> 1; MLA: mla_group -> 1; every layer's MLP or shared experts: 2 -> 1;
    # a latent MoE's routed down projection joins its shared experts' GEMM: one more
    saved_gemms = n_kda * 5 + n_mla * (mla_group - 1) + cfg.num_hidden_layers + n_latent_moe
    assert (n_kda, n_mla, n_latent_moe) == (6, 2, 7 if cfg.is_k3 else 0)
    assert saved_gemms == (49 if cfg.is_k3 else 40)
    assert unfused["mm"] - fused["mm"] == saved_gemms
    assert {op: unfused[op] - fused[op] for op in ("addmm", "bmm", "convolution")} == dict.fromkeys(
        ("addmm", "bmm", "convolution"), 0)
    assert (unfused["causal_conv1d"], fused["causal_conv1d"]) == (3 * n_kda, n_kda)


def test_add_linear_accumulates_in_place_only_where_nothing_needs_the_old_value():
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=False)
    x, out = torch.randn(3, 5, 24), torch.randn(3, 5, 40)
    want = out + linear(x).detach()
    with torch.no_grad():
        got = add_linear_(out, x, linear)
    assert got is out  # in place: one GEMM that adds (addmm_), no add kernel
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    out = torch.randn(3, 5, 40)
    before = out.clone()
    got = add_linear_(out, x, linear)  # autograd records: out of place, out untouched
    assert got is not out and got.requires_grad and torch.equal(out, before)
    torch.testing.assert_close(got, out + linear(x), rtol=0, atol=0)
    with torch.no_grad():
        for other in (out.double(), out[:, :1], out.transpose(0, 1).contiguous().transpose(0, 1)):
            kept = other.clone()  # another dtype, a broadcast shape, a strided layout
            got = add_linear_(other, x, linear)
            assert got is not other and torch.equal(other, kept)
            torch.testing.assert_close(got, other + linear(x).to(other.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_mlps_add_into_the_residual_in_their_gemms(arch, monkeypatch):
    """Per decode step one add kernel less per layer (the residual after the MLP) and per latent
    MoE (routed + shared): their output GEMMs accumulate in place. The same logits as with
    every sum out of place."""
    model = fuse_projections(_model(arch))
    cfg, ids = model.cfg, _ids(model.cfg, T=6)

    def decode_step() -> tuple[torch.Tensor, Counter]:
        cache = model.new_cache()
        model(ids[:, :5], cache)
        with torch.no_grad(), _KernelCounter() as counter:
            logits = model(ids[:, 5:], cache).logits
        return logits, counter.counts

    with torch.no_grad():
        logits, fused = decode_step()
        monkeypatch.setattr(moe_mod, "add_linear_", lambda out, x, linear: out + linear(x))
        monkeypatch.setattr(moe_mod, "add_normed_linear_", lambda out, x, norm, linear, dtype:
                            out + linear(rms_norm(x, norm.weight, norm.eps, out_dtype=dtype)))
        expected, plain = decode_step()
    n_latent_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if cfg.is_k3 else 0
    saved = cfg.num_hidden_layers + n_latent_moe
    assert (fused["addmm_"], plain["addmm_"]) == (saved, 0)
    assert plain["add"] - fused["add"] == saved
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_the_model_runner_serves_a_fused_model():
    model = build_model(preset("debug"), seed=0)
    ModelRunner(model, EngineConfig(max_num_seqs=2, num_blocks=4, physical_block_size=512,
                                    num_kda_checkpoints=1, cuda_graphs=False))
    assert not any(p.requires_grad for p in model.parameters())
    assert all(m.fused_proj is not None for m in _fused_layers(model))


def test_docstring_examples_run():
    run_doctests(fuse_mod)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_bf16_model_matches_unfused_on_gpu(arch, monkeypatch):
    """bf16 on the fast path (fla kernels, compiled norms), fused vs unfused, each against the
    fp32 reference: fusion only changes GEMM shapes (cuBLAS may sum in another order), so the
    fused error must stay within twice the unfused one plus 2e-3 (the standard of
    test_gpu.py), for a full forward and for prefill + 40 decode steps; a single layer of each
    kind agrees with its unfused self within 1e-2 relative (bf16 rounding of a differently
    shaped GEMM)."""
    cfg = _config(arch).replace(linear_head_dim=64, hidden_size=256)
    exact = _frozen(build_model(cfg, device="cuda"))
    unfused = build_model(cfg, device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)
    unfused.load_state_dict(exact.state_dict())
    fused = build_model(cfg, device="cuda", dtype=torch.bfloat16).eval().requires_grad_(False)
    fused.load_state_dict(exact.state_dict())
    fuse_projections(fused)
    ids = torch.randint(0, cfg.vocab_size, (2, 300), device="cuda")

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    def prefill_and_decode(model):
        cache = model.new_cache()
        parts = [model(ids[:, :260], cache).logits]
        parts += [model(ids[:, t:t + 1], cache).logits for t in range(260, 300)]
        return torch.cat(parts, 1)

    with torch.no_grad():
        monkeypatch.setenv("OPENK3_REFERENCE", "1")
        ref = exact(ids).logits
        monkeypatch.setenv("OPENK3_REFERENCE", "0")
        errors = {"unfused": rel(unfused(ids).logits, ref), "fused": rel(fused(ids).logits, ref),
                  "unfused decode": rel(prefill_and_decode(unfused), ref),
                  "fused decode": rel(prefill_and_decode(fused), ref)}
        x = torch.randn(2, 77, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        for a, b in zip(_fused_layers(unfused), _fused_layers(fused)):
            errors[type(a).__name__] = max(errors.get(type(a).__name__, 0), rel(b(x), a(x)))
    assert errors["unfused"] > 0, errors  # the bf16 path really ran in bf16
    assert errors["fused"] <= 2 * errors["unfused"] + 2e-3, errors
    assert errors["fused decode"] <= 2 * errors["unfused decode"] + 2e-3, errors
    assert max(errors[k] for k in ("KDAttention", "MLAttention", "MLP")) < 1e-2, errors
