"""MXFP4 quantisation-aware training: the QAT expert forward against an explicit reference (values
and straight-through gradients), the switch and its validation, bit-exact export of what the QAT
forward used, the same logits from the export, and QAT through ``openk3 train`` (run config,
resume, packed export, ``load_model`` of the run)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import openk3
from openk3 import build_model, preset
from openk3.cli import _config_flags_given, build_parser, main
from openk3.model import moe as moe_module
from openk3.model.moe import RoutedExperts, glu_act, run_experts, set_qat
from openk3.ops.mx import fake_quant_mxfp4, fake_quant_mxfp8_e4m3, mxfp4_dequantize
from openk3.runtime import load_model, run_qat
from openk3.train.config import RUN_CONFIG_FILE, RunConfig, resolve_run_config
from openk3.train.trainer import train
from tests.train.test_trainer import TINY_MODEL, cache_dir, corpus, tiny  # noqa: F401 (fixtures)

# A K3-format model small enough for a few CPU steps; expert widths D = 64, F = 32 are MX blocks.
QAT_MODEL = {"num_hidden_layers": 3, "full_attn_layers": [3], "hidden_size": 64,
             "linear_head_dim": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
             "v_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 32, "intermediate_size": 96,
             "moe_intermediate_size": 32, "moe_latent_size": 64, "attn_res_block_size": 2,
             "vocab_size": 300}


def _experts_inputs(seed: int, E=3, F=64, D=32, counts=(5, 0, 7)):
    g = torch.Generator().manual_seed(seed)
    w1, w3 = torch.randn(E, F, D, generator=g) / 4, torch.randn(E, F, D, generator=g) / 4
    w2 = torch.randn(E, D, F, generator=g) / 6
    xs = torch.randn(sum(counts), D, generator=g)
    return w1, w3, w2, xs, torch.tensor(counts)


def test_run_experts_qat_matches_explicit_reference_values_and_gradients():
    cfg = preset("debug")
    w1, w3, w2, xs, counts = _experts_inputs(0)
    params = [t.clone().requires_grad_() for t in (w1, w3, w2, xs)]
    out = run_experts(cfg, *params, counts, qat="mxfp4")
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(upstream)

    # Reference: each expert's matrices quantised on their own (blocks of 32 along the input
    # dimension: D for w1/w3, F for w2), its rows quantised before w1/w3 and its GLU output
    # before w2. The quantised tensors are leaves here: with a straight-through estimator the
    # gradient of a master tensor is the gradient of its quantised copy.
    leaves = [fake_quant_mxfp4(w).detach().requires_grad_() for w in (w1, w3, w2)]
    x_q = fake_quant_mxfp8_e4m3(xs).detach().requires_grad_()
    q1, q3, q2 = leaves
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        assert torch.equal(q1.detach()[e], fake_quant_mxfp4(w1[e]))  # per-expert blocks
        xe = x_q[start:start + n]
        h = fake_quant_mxfp8_e4m3(glu_act(cfg, xe @ q1[e].T, xe @ q3[e].T))
        outs.append(h @ q2[e].T)
        start += n
    ref = torch.cat(outs)
    ref.backward(upstream)
    assert torch.equal(out.detach(), ref.detach())
    for got, want in zip(params, [*leaves, x_q]):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7)
    # and QAT is not a no-op
    plain = run_experts(cfg, w1, w3, w2, xs, counts)
    assert not torch.equal(plain, out.detach())


def test_run_experts_refuses_unknown_qat_mode():
    w1, w3, w2, xs, counts = _experts_inputs(0)
    with pytest.raises(ValueError, match=r"run_experts: qat='int4'.*\('none', 'mxfp4'\)"):
        run_experts(preset("debug"), w1, w3, w2, xs, counts, qat="int4")


def test_set_qat_reaches_every_routed_expert_layer_and_validates():
    model = build_model(preset("debug").replace(num_nextn_predict_layers=1), device="meta")
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) > 1 and any(n.startswith("mtp.") for n, m in model.named_modules()
                                     if isinstance(m, RoutedExperts))
    assert {m.qat for m in experts} == {"none"}  # off by default
    set_qat(model, "mxfp4")
    assert {m.qat for m in experts} == {"mxfp4"}
    set_qat(model, "none")
    assert {m.qat for m in experts} == {"none"}
    with pytest.raises(ValueError, match=r"qat='fp4': choose one of \('none', 'mxfp4'\)"):
        set_qat(model, "fp4")
    odd = build_model(preset("debug").replace(moe_latent_size=80), device="meta")
    with pytest.raises(ValueError, match=r"ModelConfig\.moe_latent_size=80 divisible by 32"):
        set_qat(odd, "mxfp4")


def test_run_config_qat_field_and_flag(tmp_path, capsys):
    assert RunConfig().qat == "none"
    with pytest.raises(ValueError, match=r"RunConfig\.qat='int4': choose one of \('none', 'mxfp4'\)"):
        RunConfig(qat="int4")
    with pytest.raises(ValueError, match=r"RunConfig\.qat='mxfp4'.*ModelConfig\.moe_intermediate_size=48"):
        RunConfig(qat="mxfp4", model_overrides={"moe_intermediate_size": 48})
    args = build_parser().parse_args(["train", "--qat", "mxfp4"])
    assert _config_flags_given(args, RunConfig)["qat"] == "mxfp4"
    assert main(["train", "--qat", "nf4", "--out", str(tmp_path / "run")]) == 2
    assert "RunConfig.qat='nf4': choose one of ('none', 'mxfp4')" in capsys.readouterr().err


def _record_quantised_weights(monkeypatch) -> dict[int, torch.Tensor]:
    """What every ``fake_quant_mxfp4`` call of the expert forward returned, by input tensor id
    (the parameter it quantised); the last forward's calls win."""
    seen: dict[int, torch.Tensor] = {}
    real = moe_module.fake_quant_mxfp4

    def recording(w):
        out = real(w)
        seen[id(w)] = out.detach().clone()
        return out

    monkeypatch.setattr(moe_module, "fake_quant_mxfp4", recording)
    return seen


def test_export_is_bit_exact_and_reloads_to_the_same_logits(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = build_model(preset("debug").replace(**QAT_MODEL), seed=3)
    set_qat(model, "mxfp4")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # a few QAT steps, so the masters are off the MXFP4 grid and moved by STE
        ids = torch.randint(0, 300, (2, 17), generator=g)
        model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    seen = _record_quantised_weights(monkeypatch)
    model.eval()
    ids = torch.randint(0, 300, (2, 16), generator=g)
    with torch.no_grad():
        logits = model(ids).logits

    openk3.save_pretrained(model, tmp_path / "mx", experts="mxfp4")
    tensors = {}
    for f in (tmp_path / "mx").glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, RoutedExperts):
            continue
        layer = name.split(".")[2]  # model.layers.{i}.mlp.experts
        for proj in ("w1", "w2", "w3"):
            master = getattr(module, proj)
            used = seen[id(master)]  # [E, out, in], what the QAT forward multiplied by
            assert not torch.equal(used, master.detach())
            for e in range(master.shape[0]):
                stem = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{proj}"
                decoded = mxfp4_dequantize(tensors[stem + ".weight_packed"],
                                           tensors[stem + ".weight_scale"], dtype=torch.float32)
                assert torch.equal(decoded, used[e]), stem
                checked += 1
    assert checked == 2 * 3 * 8  # layers 1 and 2 (layer 0 is dense), 3 matrices, 8 experts

    # Loaded, the experts hold the decoded weights exactly. With the same QAT forward (set_qat:
    # MXFP8 inputs too; quantising weights already on the grid gives them back unchanged) it
    # is the same computation in fp32 on the same values: equal bit for bit, no tolerance.
    loaded = openk3.load_pretrained(tmp_path / "mx")
    set_qat(loaded, "mxfp4")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
        # Without the MXFP8 inputs only the activation rounding differs (E4M3: 3 mantissa
        # bits, at most 2^-4 relative per element): close, and not equal.
        set_qat(loaded, "none")
        unquantised_inputs = loaded(ids).logits
        # Served packed (the bytes stay MXFP4; on the CPU each used expert is decoded), with the
        # QAT setting the packed experts round their inputs to MXFP8 too: the same logits.
        served = openk3.load_pretrained(tmp_path / "mx", experts="packed")
        set_qat(served, "mxfp4")
        assert torch.equal(served(ids).logits, logits)
    assert not torch.equal(unquantised_inputs, logits)
    torch.testing.assert_close(unquantised_inputs, logits, rtol=0, atol=0.1)


def test_bf16_run_continued_with_qat_exports_packed_experts(corpus, tmp_path):  # noqa: F811
    """The path of docs/mxfp4.md: a run without QAT, resumed with ``--qat mxfp4`` (qat may change
    on resume), exports packed experts; the mode is saved with the run and kept by a later
    resume; ``load_model`` of the run runs the QAT forward."""
    out = tmp_path / "run"
    base = tiny(corpus, out, model_overrides={**TINY_MODEL, "moe_latent_size": 64}, max_steps=2,
                warmup_steps=1, ckpt_interval=2, eval_interval=2)
    train(base)
    index_file = out / "export" / "model.safetensors.index.json"
    assert any(k.endswith("experts.0.w1.weight") for k in json.loads(index_file.read_text())["weight_map"])
    assert run_qat(out) == "none"

    cfg, _ = resolve_run_config({"resume": True, "out": str(out), "max_steps": 3, "qat": "mxfp4"})
    assert cfg.qat == "mxfp4" and cfg.seq_len == base.seq_len  # the rest from the saved run
    assert train(cfg)["start_step"] == 2
    assert json.loads((out / RUN_CONFIG_FILE).read_text())["run"]["qat"] == "mxfp4"
    assert run_qat(out) == "mxfp4"
    assert resolve_run_config({"resume": True, "out": str(out), "max_steps": 4})[0].qat == "mxfp4"
    weight_map = json.loads(index_file.read_text())["weight_map"]
    assert any(k.endswith("experts.0.w1.weight_packed") for k in weight_map)
    assert not any(k.endswith("experts.0.w1.weight") for k in weight_map)

    model, _, _ = load_model(out, device="cpu")
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert experts and {m.qat for m in experts} == {"mxfp4"}
    w = experts[0].w2.detach()
    assert torch.equal(fake_quant_mxfp4(w), w)  # already on the MXFP4 grid
    plain, _, _ = load_model(out / "export", device="cpu")  # an HF directory: no run config
    assert {m.qat for m in plain.modules() if isinstance(m, RoutedExperts)} == {"none"}


def test_qat_fast_path_traces_as_one_graph():
    """The QAT expert forward of the CUDA path (grouped matmuls) traces with ``fullgraph=True``
    through AOT autograd: the quantisers read nothing on the host and their straight-through
    autograd functions trace. (Forward only: ``grouped_mm``'s CPU backward is not usable.)"""
    experts = RoutedExperts(preset("debug"), 64)
    for w in experts.parameters():
        torch.nn.init.normal_(w, 0.0, 0.1)
    experts.qat = "mxfp4"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=gen).bfloat16()
    topk_idx = torch.randint(0, 8, (40, 2), generator=gen)
    topk_weight = torch.rand(40, 2, generator=gen)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_module, "use_fast_path", lambda x: True)
        graph = torch.compile(experts.forward, backend="aot_eager", fullgraph=True)
        assert torch.equal(graph(x, topk_idx, topk_weight), experts(x, topk_idx, topk_weight))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qat_grouped_mm_matches_fp32_reference_loop_on_gpu(monkeypatch):
    """CUDA, fp32 master weights, bf16 rows (as under autocast): the grouped-matmul QAT path
    against the fp32 loop reference on the same rows. The quantised weights are identical (MXFP4
    values are exact in bf16); the GLU output is bf16 on one side and fp32 on the other, so a few
    of its MXFP8 roundings differ (one E4M3 step is up to 12.5% of an element). Measured on the
    H200 on 2026-11-30: 1.76e-2 relative for the output (a first bound of 1e-2, copied from the
    unquantised grouped path's test, failed); bound 2.5e-2, below the 3e-2 that separates QAT
    from no QAT."""
    cfg = preset("debug").replace(num_experts=16, moe_intermediate_size=128)
    E, F, D, P = 16, 128, 256, 2000
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(E, F, D, device="cuda", generator=g) * 0.05,
          torch.randn(E, F, D, device="cuda", generator=g) * 0.05,
          torch.randn(E, D, F, device="cuda", generator=g) * 0.05]
    xs = torch.randn(P, D, device="cuda", generator=g).bfloat16()
    counts = torch.bincount(torch.randint(0, E - 1, (P,), device="cuda", generator=g).sort().values,
                            minlength=E)  # the last expert gets no rows
    upstream = torch.randn(P, D, device="cuda", generator=g)

    def run(reference: bool):
        monkeypatch.setenv("OPENK3_REFERENCE", "1" if reference else "0")
        leaves = [w.clone().requires_grad_() for w in ws]
        x = (xs.float() if reference else xs).clone().requires_grad_()
        out = run_experts(cfg, *leaves, x, counts, qat="mxfp4")
        out.float().backward(upstream)
        return out, [t.grad for t in (*leaves, x)]

    fast, fast_grads = run(False)
    ref, ref_grads = run(True)
    assert fast.dtype == torch.bfloat16 and ref.dtype == torch.float32
    assert _rel(fast, ref) < 2.5e-2
    for got, want in zip(fast_grads, ref_grads):
        assert _rel(got, want) < 2.5e-2
    plain = run_experts(cfg, *ws, xs.float(), counts)
    assert _rel(plain, ref) > 3e-2  # and the comparison can tell QAT from no QAT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qat_decode_takes_the_sorted_path_on_gpu():
    """A few tokens without autograd would take the GEMV kernels, which do not quantise the GLU
    output: under QAT the layer runs the sorted (quantising) path, and equals it exactly."""
    experts = RoutedExperts(preset("debug"), 64).cuda()
    for w in experts.parameters():
        torch.nn.init.normal_(w, 0.0, 0.1)
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(4, 64, device="cuda", generator=gen).bfloat16()
    topk_idx = torch.randint(0, 8, (4, 2), device="cuda", generator=gen)
    topk_weight = torch.rand(4, 2, device="cuda", generator=gen)
    with torch.no_grad():
        gemv = experts(x, topk_idx, topk_weight)
        experts.qat = "mxfp4"
        qat = experts(x, topk_idx, topk_weight)
        assert torch.equal(qat, experts.forward_sorted(x, topk_idx, topk_weight))
    assert _rel(gemv, qat) > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantisers_compiled_by_inductor_are_bit_exact_on_gpu():
    """The training forward is compiled on CUDA: inductor's kernels of both fake quantisers give
    the eager (and so the exported) values bit for bit, for blocks at scales 2^-100..2^100."""
    g = torch.Generator(device="cuda").manual_seed(0)
    scales = torch.exp2(torch.randint(-100, 100, (256, 64, 1), device="cuda", generator=g).float())
    x = (torch.randn(256, 64, 32, device="cuda", generator=g) * scales).reshape(256, 2048)
    for quantiser in (fake_quant_mxfp4, fake_quant_mxfp8_e4m3):
        torch._dynamo.reset()
        compiled = torch.compile(quantiser, backend="inductor", fullgraph=True)
        assert torch.equal(compiled(x), quantiser(x)), quantiser.__name__
