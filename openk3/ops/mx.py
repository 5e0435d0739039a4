"""OCP Microscaling (MX) formats: MXFP4 (E2M1) weights and MXFP8 (E4M3) activations.

An MX block is 32 consecutive elements along the last (input) dimension sharing one E8M0
scale, a bare biased exponent: byte ``s`` means ``2^(s - 127)`` and ``s = 255`` is NaN
(OCP Microscaling Formats Specification v1.0). K3 stores its routed experts as MXFP4
(``.weight_packed`` uint8 with two 4-bit codes per byte, low nibble = even element, and
``.weight_scale`` uint8 E8M0 per 32 inputs) and trains them with MXFP4/MXFP8 fake
quantisation and a straight-through estimator (K3_SPEC §2, §3).

``mxfp4_quantize`` is the one MXFP4 quantiser: QAT's forward (``fake_quant_mxfp4``, through
``openk3.model.moe.run_experts``), the export (``save_pretrained(..., experts="mxfp4")``) and
packed serving all call it, so what training saw is what is written and served, bit for bit.

Scale rule: the OCP v1.0 one, ``X = 2^(floor(log2(amax)) - emax_elem)`` (torchao's
``ScaleCalculationMode.FLOOR``), elements rounded to nearest, ties to even, saturating at the
element maximum. It maps a block's largest element into [4, 8) for E2M1, so about 30% of
Gaussian blocks clip it to 6; torchao's EVEN rule, which avoids that, has ~3% less MXFP4 error
on Gaussian weights and RCEIL ~10% less MXFP8 error (``benchmarks/mx_scale_rules.py``).
docs/mxfp4.md says why openk3 keeps the spec's rule.

All arithmetic that decides a value is done in fp32 on exact powers of two, so decoding
is bit-exact and quantising is deterministic across devices.

Example::

    >>> w = torch.randn(4, 64)
    >>> weight_packed, weight_scale = mxfp4_quantize(w)  # [4, 32] uint8, [4, 2] uint8
    >>> w_q = mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32)
    >>> torch.equal(w_q, fake_quant_mxfp4(w))
    True
"""

import functools

import torch

MX_BLOCK_SIZE = 32
E8M0_BIAS = 127
# Quantisation-aware training of the routed experts (RunConfig.qat, openk3.model.moe.set_qat):
# "mxfp4" is MXFP4 weights with MXFP8 (E4M3) inputs, as K3 trains them (K3_SPEC §3).
QAT_MODES = ("none", "mxfp4")

# Code bit 3 is the sign, bits 0-2 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}
# (E2M1: exponent bias 1, one subnormal 0.5). Code 8 is -0.0.
FP4_E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
_FP4_E2M1_MAGNITUDES = FP4_E2M1_VALUES[:8]
# Exact midpoints between neighbouring magnitudes, used for round-to-nearest.
_FP4_E2M1_MIDPOINTS = (_FP4_E2M1_MAGNITUDES[:-1] + _FP4_E2M1_MAGNITUDES[1:]) / 2
_FP4_E2M1_EMAX = 2  # largest magnitude 6 = 1.5 * 2^2


@functools.cache
def _table_on(name: str, device: torch.device) -> torch.Tensor:
    """A lookup table copied to ``device`` once: a copy per call would be a host-to-device
    transfer inside every quantisation, which a CUDA graph cannot capture."""
    return {"values": FP4_E2M1_VALUES, "midpoints": _FP4_E2M1_MIDPOINTS}[name].to(device)


_FP8_E4M3_EMAX = 8  # largest magnitude 448 = 1.75 * 2^8
_FP8_E4M3_MAX = 448.0


def e8m0_to_float(scale_u8: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 scale bytes to fp32, exactly.

    Args:
        scale_u8: uint8 tensor of any shape.
    Returns:
        fp32 tensor of the same shape: ``2^(s - 127)``; ``s = 255`` is NaN and ``s = 0`` is
        the fp32 subnormal ``2^-127``.
    """
    if scale_u8.dtype != torch.uint8:
        raise ValueError(f"scale_u8 must be uint8, got {scale_u8.dtype}")
    s = scale_u8.to(torch.int32)
    # Build the fp32 bit pattern directly: s in 1..254 is the biased exponent field of
    # 2^(s-127); 2^-127 is the subnormal with only mantissa bit 22 set.
    bits = torch.where(s == 0, torch.full_like(s, 1 << 22), s << 23)
    bits = torch.where(s == 255, torch.full_like(s, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2^exponent`` for integer ``exponent`` in [-127, 127]."""
    return e8m0_to_float((exponent + E8M0_BIAS).to(torch.uint8))


def unpack_fp4(packed_u8: torch.Tensor) -> torch.Tensor:
    """Split each byte into two FP4 codes.

    Args:
        packed_u8: uint8 ``[..., N/2]``.
    Returns:
        uint8 codes ``[..., N]`` in 0..15; element ``2i`` is the low nibble of byte ``i``,
        element ``2i + 1`` the high nibble.
    """
    if packed_u8.dtype != torch.uint8:
        raise ValueError(f"packed_u8 must be uint8, got {packed_u8.dtype}")
    if packed_u8.dim() == 0:
        raise ValueError("packed_u8 must have at least one dimension, got a scalar")
    codes = torch.stack((packed_u8 & 0x0F, packed_u8 >> 4), dim=-1)
    return codes.flatten(-2)


def mxfp4_dequantize(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Decode an MXFP4 matrix: ``value = FP4_E2M1_VALUES[code] * 2^(s - 127)``.

    The product is exact in fp32 (it is a power-of-two shift of a 2-bit mantissa), so the
    only rounding is the final cast to ``dtype``.

    Args:
        weight_packed: uint8 ``[rows, cols/2]``, two codes per byte (leading batch dims allowed).
        weight_scale: uint8 E8M0 ``[rows, cols/32]``, one scale per 32 consecutive inputs.
        dtype: floating dtype of the result.
    Returns:
        ``[rows, cols]`` tensor of ``dtype``.
    """
    if weight_packed.dtype != torch.uint8:
        raise ValueError(f"weight_packed must be uint8, got {weight_packed.dtype}")
    if weight_scale.dtype != torch.uint8:
        raise ValueError(f"weight_scale must be uint8, got {weight_scale.dtype}")
    if weight_packed.dim() < 1 or weight_packed.shape[-1] % (MX_BLOCK_SIZE // 2) != 0:
        raise ValueError(
            f"weight_packed last dimension must be a multiple of {MX_BLOCK_SIZE // 2} "
            f"(cols divisible by {MX_BLOCK_SIZE}), got shape {tuple(weight_packed.shape)}"
        )
    cols = weight_packed.shape[-1] * 2
    expected_scale_shape = (*weight_packed.shape[:-1], cols // MX_BLOCK_SIZE)
    if tuple(weight_scale.shape) != expected_scale_shape:
        raise ValueError(
            f"weight_scale has shape {tuple(weight_scale.shape)} but weight_packed of shape "
            f"{tuple(weight_packed.shape)} needs {expected_scale_shape} "
            f"(one scale per {MX_BLOCK_SIZE} elements)"
        )
    codes = unpack_fp4(weight_packed)  # [..., cols]
    values = _table_on("values", weight_packed.device)[codes.long()]
    values_blocked = values.unflatten(-1, (-1, MX_BLOCK_SIZE))  # [..., cols/32, 32]
    scale = e8m0_to_float(weight_scale).unsqueeze(-1)  # [..., cols/32, 1]
    return (values_blocked * scale).flatten(-2).to(dtype)


def _check_blocked_last_dim(x: torch.Tensor, name: str) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % MX_BLOCK_SIZE != 0:
        raise ValueError(
            f"{name} last dimension must be divisible by {MX_BLOCK_SIZE} (one MX block), "
            f"got shape {tuple(x.shape)}"
        )


def _shared_exponent(x_blocked: torch.Tensor, emax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP shared exponent ``floor(log2(amax)) - emax`` per block, clamped to [-127, 127].

    Args:
        x_blocked: fp32 ``[..., n_blocks, 32]``.
    Returns:
        (int32 exponent ``[..., n_blocks, 1]``, bool ``[..., n_blocks, 1]`` finite-block mask).
        An all-zero block gets -127, the limit of ``log2(0) = -inf`` after clamping.
    """
    amax = x_blocked.abs().amax(dim=-1, keepdim=True)
    # frexp gives amax = m * 2^E with m in [0.5, 1), so floor(log2(amax)) = E - 1 exactly,
    # with no log2 rounding near powers of two (subnormals included).
    _, frexp_exp = torch.frexp(amax)
    exponent = (frexp_exp - 1 - emax).clamp(-E8M0_BIAS, E8M0_BIAS)
    exponent = torch.where(amax == 0, torch.full_like(exponent, -E8M0_BIAS), exponent)
    return exponent, torch.isfinite(amax)


def _round_to_e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by the block scale) to E2M1 codes, uint8.

    Round to nearest; ties go to the even code index, which is the even mantissa bit
    (IEEE round-half-to-even on the E2M1 encoding): 0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4. Magnitudes above 6 saturate to 6.
    """
    magnitude = scaled.abs()
    midpoints = _table_on("midpoints", scaled.device)
    # searchsorted(right=False) sends a value equal to midpoints[i] to index i, the lower
    # neighbour; move such ties up when i is odd so they land on the even index. Values
    # above the last midpoint (5) get index 7, which is the saturation to 6.
    index = torch.searchsorted(midpoints, magnitude, right=False)
    is_tie = magnitude == midpoints[index.clamp(max=len(midpoints) - 1)]
    index = torch.where(is_tie & (index % 2 == 1), index + 1, index)
    sign = torch.signbit(scaled).to(torch.uint8) << 3
    return index.to(torch.uint8) | sign


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a matrix to MXFP4 (OCP MX v1.0 E2M1 elements, E8M0 scale per 32 inputs).

    Per block of 32 along the last dimension: shared exponent ``e = floor(log2(amax)) - 2``
    (2 is the E2M1 emax), clamped to [-127, 127]; each element ``w / 2^e`` is rounded to the
    nearest E2M1 value, ties to even, saturating to +-6. So the largest element of a block
    lands in [4, 8) before rounding (lower when the -127 clamp applies) and decodes to at
    most ``6 * 2^e``. An all-zero block gets scale byte 0 (``2^-127``, the clamped limit of
    ``log2(0)``) and zero codes; any scale would decode it to zeros. A block holding NaN or
    +-inf gets scale byte 255 (NaN), so the whole block decodes to NaN, as OCP prescribes
    for a NaN scale.

    Args:
        w: floating ``[rows, cols]`` (leading batch dims allowed), ``cols % 32 == 0``;
            computed in fp32.
    Returns:
        ``(weight_packed, weight_scale)``: uint8 ``[rows, cols/2]`` and uint8 ``[rows, cols/32]``.
    """
    _check_blocked_last_dim(w, "w")
    w_blocked = w.float().unflatten(-1, (-1, MX_BLOCK_SIZE))  # [..., cols/32, 32]
    exponent, finite = _shared_exponent(w_blocked, _FP4_E2M1_EMAX)
    scaled = w_blocked * _pow2(-exponent)  # exact: a power-of-two shift
    scaled = torch.where(finite, scaled, torch.zeros_like(scaled))
    codes = _round_to_e2m1_codes(scaled).flatten(-2)  # [..., cols]
    scale_byte = torch.where(finite, exponent + E8M0_BIAS, torch.full_like(exponent, 255))
    weight_scale = scale_byte.squeeze(-1).to(torch.uint8)
    weight_packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the inverse of unpack_fp4
    return weight_packed, weight_scale


class _StraightThrough(torch.autograd.Function):
    """Forward applies ``quantizer``; backward passes the upstream gradient through unchanged."""

    @staticmethod
    def forward(ctx, x, quantizer):
        return quantizer(x)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def _mxfp4_qdq(w: torch.Tensor) -> torch.Tensor:
    weight_packed, weight_scale = mxfp4_quantize(w)
    return mxfp4_dequantize(weight_packed, weight_scale, dtype=w.dtype)


def fake_quant_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 fake quantisation for QAT: ``dequantize(quantize(w))`` with an identity gradient.

    Args:
        w: floating ``[..., cols]``, ``cols % 32 == 0`` (typically fp32 master weights).
    Returns:
        tensor of ``w``'s shape and dtype holding MXFP4-representable values; its gradient
        w.r.t. ``w`` is the upstream gradient (straight-through estimator).
    """
    _check_blocked_last_dim(w, "w")
    return _StraightThrough.apply(w, _mxfp4_qdq)


def _mxfp8_e4m3_qdq(x: torch.Tensor) -> torch.Tensor:
    x_blocked = x.float().unflatten(-1, (-1, MX_BLOCK_SIZE))  # [..., cols/32, 32]
    exponent, finite = _shared_exponent(x_blocked, _FP8_E4M3_EMAX)
    scaled = x_blocked * _pow2(-exponent)
    # Scaled magnitudes reach up to 512 (amax < 2^(e+9)); E4M3 stops at 448 and has no inf.
    # Saturate explicitly instead of relying on how a backend casts out-of-range values.
    scaled = scaled.clamp(-_FP8_E4M3_MAX, _FP8_E4M3_MAX)
    rounded = scaled.to(torch.float8_e4m3fn).float()
    scale = torch.where(finite, _pow2(exponent), torch.full_like(rounded[..., :1], float("nan")))
    return (rounded * scale).flatten(-2).to(x.dtype)


def fake_quant_mxfp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 (E4M3) fake quantisation of activations with an identity gradient.

    Per block of 32 along the last dimension: shared exponent ``floor(log2(amax)) - 8``
    (8 is the E4M3 emax), clamped to [-127, 127]; elements are divided by ``2^e``, rounded
    to E4M3 (round-half-to-even via ``torch.float8_e4m3fn``) with saturation to +-448, and
    multiplied back. All-zero blocks stay zero; blocks with NaN or +-inf become NaN.

    Args:
        x: floating ``[..., hidden]``, ``hidden % 32 == 0``; computed in fp32.
    Returns:
        tensor of ``x``'s shape and dtype; gradient = upstream gradient (straight-through).
    """
    _check_blocked_last_dim(x, "x")
    return _StraightThrough.apply(x, _mxfp8_e4m3_qdq)
