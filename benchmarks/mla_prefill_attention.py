"""The MLA prefill's varlen causal attention by kernel (issue P8: 36% of a cold 32K prefill).

``small``'s MLA layers attend with 8 heads, query/key head dim 192 and value head dim 128.
FlashAttention-2 (``torch.ops.aten._flash_attention_forward``, what ``varlen_causal_attention``
calls) needs one head dim, so V is padded to 192. cuDNN's fused attention
(``torch.ops.aten._cudnn_attention_forward``, varlen through ``cum_seq_q/k``) takes V at 128.
``varlen_causal_attention`` itself (one sequence: FlashAttention-2 over the prefix in pieces,
the causal square in cuDNN from 4,096 queries, merged by log-sum-exp) is timed beside them, with
its first call on a new length (cuDNN's plan build for a new bucket) timed apart.
For each case this prints each kernel's time (CUDA events, median of 10 after 3 warm-up calls),
its rate on the useful FLOPs (causal: the pairs each query may see, QK and PV at their own head
dims) and its largest difference from the FlashAttention output (bottom-right causal: a chunk's
queries are the last ``T`` of its ``S`` keys).

Cases (sequences x new tokens, cached prefix): a cold 32K prompt in one chunk, a 1,024-token
chunk after a 31,744-token prefix (the warm request), 64 prompts of 128 tokens (a batch's
prefill), two 16K chunks on 16K prefixes.

Run on the device: ``python benchmarks/mla_prefill_attention.py``.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.common import environment, write_results
from openk3.ops.varlen_attention import _flash_varlen, varlen_causal_attention

H, DQK, DV = 8, 192, 128
CASES = {"cold 1x32768": [(32768, 0)], "warm 1x1024 after 31744": [(1024, 31744)],
         "warm 1x512 after 30720": [(512, 30720)], "1x16384 after 16384": [(16384, 16384)],
         "cold 1x20000": [(20000, 0)], "cold 1x8192": [(8192, 0)], "cold 1x1024": [(1024, 0)],
         "1x1024 after 1024": [(1024, 1024)],
         "64x128 cold": [(128, 0)] * 64, "2x16384 after 16384": [(16384, 16384)] * 2}
ROWS: list[dict] = []


def cudnn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, False, 0.0, True,
                                                   False, scale=scale)[0]


def once(fn) -> float:
    """One call's wall time in ms, synchronised (a first call: plan builds included)."""
    import time
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def timed(fn) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    print(environment())
    dev, dt = "cuda", torch.bfloat16
    scale = DQK ** -0.5
    for name, seqs in CASES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        T = sum(t for t, _ in seqs)
        K = sum(t + p for t, p in seqs)
        q = torch.randn(T, H, DQK, device=dev, dtype=dt, generator=g)
        k = torch.randn(K, H, DQK, device=dev, dtype=dt, generator=g)
        v = torch.randn(K, H, DV, device=dev, dtype=dt, generator=g)
        cu_q = torch.tensor([0] + [t for t, _ in seqs]).cumsum(0)
        cu_k = torch.tensor([0] + [t + p for t, p in seqs]).cumsum(0)
        cu_q_d, cu_k_d = cu_q.to(dev, torch.int32), cu_k.to(dev, torch.int32)
        max_q, max_k = int(cu_q.diff().max()), int(cu_k.diff().max())
        # useful FLOPs: query i of a chunk sees prefix + i + 1 keys
        pairs = sum(t * p + t * (t + 1) / 2 for t, p in seqs) * H
        flop = 2 * pairs * (DQK + DV)
        ref = _flash_varlen(q, k, v, cu_q_d, cu_k_d, cu_q, cu_k, scale, True)
        kernels = {
            "flash2 (V padded)": lambda: _flash_varlen(q, k, v, cu_q_d, cu_k_d, cu_q, cu_k, scale, True),
            "openk3 varlen_causal_attention": lambda: varlen_causal_attention(q, k, v, cu_q_d, cu_k_d, cu_q,
                                                                              cu_k, scale),
        }
        if len(seqs) > 1:
            kernels["cudnn varlen"] = lambda: cudnn_varlen(q, k, v, cu_q_d, cu_k_d, max_q, max_k, scale)
        if len(seqs) == 1 and seqs[0][1] == 0:  # one cold sequence: the dense call, causal top-left
            def dense(backend):
                from torch.nn.attention import sdpa_kernel
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(
                        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                        is_causal=True, scale=scale)[0].transpose(0, 1)
            from torch.nn.attention import SDPBackend
            kernels["cudnn dense sdpa"] = lambda: dense(SDPBackend.CUDNN_ATTENTION)
        for kname, fn in kernels.items():
            row = {"case": name, "kernel": kname}
            try:
                row["first_call_ms"] = once(fn)
                out = fn()
                row["max_abs_diff_vs_flash"] = (out.float() - ref.float()).abs().max().item()
                ms = timed(fn)
                row.update(ms=ms, tflops=flop / ms / 1e9)
            except Exception as e:  # noqa: BLE001 - record the failure, keep measuring
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            ROWS.append(row)
            write_results("mla_prefill_attention", ROWS)


def key_build() -> None:
    """The MLA prefill's keys [K, H, 192] from kv_b_proj's nope half and the shared rope part:
    ``torch.cat`` (as ``PagedMLAView._expanded_prefill``) against two copies into one buffer."""
    dev, dt, K = "cuda", torch.bfloat16, 32768
    kv = torch.randn(K, H, 256, device=dev, dtype=dt)
    k_r = torch.randn(K, 64, device=dev, dtype=dt)
    k_nope = kv[..., :128]

    def copies():
        k = torch.empty(K, H, DQK, device=dev, dtype=dt)
        k[..., :128] = k_nope
        k[..., 128:] = k_r[:, None]
        return k

    fns = {"cat": lambda: torch.cat([k_nope, k_r[:, None].expand(K, H, 64)], dim=-1), "two copies": copies}
    for name, fn in fns.items():
        ms = timed(fn)
        ROWS.append({"case": f"keys of {K} tokens", "kernel": name, "ms": ms,
                     "max_abs_diff_vs_flash": (fn() - fns["cat"]()).abs().max().item(),
                     "tb_per_s": K * H * (DQK * 2 + 128 * 2) / ms / 1e9})  # bytes written + read
    write_results("mla_prefill_attention", ROWS)


if __name__ == "__main__":
    main()
    key_build()
