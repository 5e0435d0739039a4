import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openk3.ops.mx import (
    FP4_E2M1_VALUES,
    e8m0_to_float,
    fake_quant_mxfp4,
    fake_quant_mxfp8_e4m3,
    mxfp4_dequantize,
    mxfp4_quantize,
    unpack_fp4,
)

# OCP Microscaling Formats v1.0, FP4 E2M1 element encodings 0b0000..0b1111 (sign bit first).
OCP_E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _pack_pairs(codes: list[int]) -> torch.Tensor:
    """Hand packing, independent of the quantiser's: low nibble = even element."""
    return torch.tensor([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)], dtype=torch.uint8)


def _expected_fp32(values_f64: list[float]) -> torch.Tensor:
    # The exact product rounded once to fp32 (inf on overflow), as the decoder promises.
    return torch.tensor(values_f64, dtype=torch.float64).to(torch.float32)


def _assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[~nan], expected[~nan])
    assert torch.equal(torch.signbit(actual[~nan]), torch.signbit(expected[~nan]))


def test_fp4_values_table_matches_ocp():
    _assert_bitwise_equal(FP4_E2M1_VALUES, torch.tensor(OCP_E2M1_TABLE))


def test_e8m0_decodes_every_byte_exactly():
    decoded = e8m0_to_float(torch.arange(256, dtype=torch.uint8))
    assert decoded.dtype == torch.float32
    expected = _expected_fp32([math.ldexp(1.0, s - 127) for s in range(255)] + [math.nan])
    _assert_bitwise_equal(decoded, expected)
    assert decoded[0].item() == 2.0**-127 and decoded[0].item() > 0


@pytest.mark.parametrize("s", [0, 1, 100, 127, 130, 254, 255])
def test_every_code_decodes_to_ocp_value(s):
    codes = list(range(16)) * 2  # one block of 32
    weight_packed = _pack_pairs(codes)[None]  # [1, 16]
    weight_scale = torch.tensor([[s]], dtype=torch.uint8)
    decoded = mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32)
    assert decoded.shape == (1, 32)
    if s == 255:
        assert torch.isnan(decoded).all()
        return
    expected = _expected_fp32([OCP_E2M1_TABLE[c] * math.ldexp(1.0, s - 127) for c in codes])
    _assert_bitwise_equal(decoded[0], expected)
    bf16 = mxfp4_dequantize(weight_packed, weight_scale)
    assert bf16.dtype == torch.bfloat16
    _assert_bitwise_equal(bf16[0], expected.to(torch.bfloat16))


def test_nibble_order_low_nibble_is_even_element():
    packed = torch.tensor([0x3A], dtype=torch.uint8)
    assert unpack_fp4(packed).tolist() == [0xA, 0x3]
    weight_packed = torch.full((1, 16), 0x3A, dtype=torch.uint8)
    decoded = mxfp4_dequantize(weight_packed, torch.tensor([[127]], dtype=torch.uint8), dtype=torch.float32)
    assert decoded[0, :4].tolist() == [-1.0, 1.5, -1.0, 1.5]
    # and the quantiser packs the same way: amax 6 gives scale 2^0, -1 is code 0xA, 1.5 is 0x3
    w = torch.tensor([[-1.0, 1.5] * 15 + [6.0, 6.0]])
    assert mxfp4_quantize(w)[0].tolist() == [[0x3A] * 15 + [0x77]]


def test_unpack_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    codes = unpack_fp4(every_byte)
    assert codes.shape == (4, 128) and int(codes.max()) <= 15
    assert torch.equal(_pack_pairs(codes.flatten().tolist()).reshape(4, 64), every_byte)


def test_round_trip_exact_on_grid():
    generator = torch.Generator().manual_seed(0)
    rows, cols = 8, 128
    codes = torch.randint(0, 16, (rows, cols), generator=generator)
    codes[:, ::32] = 7  # +6 in every block, so the block amax is 6 * 2^e and the scale is exact
    exponents = torch.randint(-120, 120, (rows, cols // 32), generator=generator)
    values = torch.tensor(OCP_E2M1_TABLE, dtype=torch.float64)[codes]
    w = (values * torch.pow(2.0, exponents.double()).repeat_interleave(32, dim=1)).float()
    weight_packed, weight_scale = mxfp4_quantize(w)
    assert weight_packed.shape == (rows, cols // 2) and weight_packed.dtype == torch.uint8
    assert weight_scale.shape == (rows, cols // 32) and weight_scale.dtype == torch.uint8
    assert torch.equal(weight_scale.long(), exponents + 127)
    assert torch.equal(mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32), w)
    # Codes come back too, except -0.0, which may be written as +0 or -0.
    round_trip_codes = unpack_fp4(weight_packed).long()
    assert torch.equal(round_trip_codes % 8 == 0, codes % 8 == 0)
    nonzero = codes % 8 != 0
    assert torch.equal(round_trip_codes[nonzero], codes[nonzero])


def test_round_half_to_even_on_e2m1_encoding():
    # Block amax 5 gives floor(log2(5)) - 2 = 0, so the scale is 1 and values are raw E2M1.
    # Ties go to the even mantissa bit, i.e. the even code index.
    cases = {
        0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0,
        0.2500001: 0.5, 2.5000002: 3.0, 4.9999995: 4.0, 5.0000005: 6.0,
        5.9: 6.0, 6.0: 6.0, 7.0: 6.0, 7.9999995: 6.0,
    }
    inputs = list(cases)
    expected = [cases[x] for x in inputs]
    pad = 32 - 2 * len(inputs)
    w = torch.tensor([inputs + [-x for x in inputs] + [0.0] * pad], dtype=torch.float32)
    w[0, -1] = 5.0  # keep the block's amax below 8 whatever the cases are
    weight_packed, weight_scale = mxfp4_quantize(w)
    assert weight_scale.tolist() == [[127]]
    decoded = mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32)[0]
    assert decoded[: len(inputs)].tolist() == expected
    assert decoded[len(inputs) : 2 * len(inputs)].tolist() == [-x for x in expected]


def test_all_zero_block_decodes_to_zero_with_smallest_scale():
    w = torch.zeros(2, 64)
    w[1, 32:] = torch.linspace(-3, 3, 32)
    weight_packed, weight_scale = mxfp4_quantize(w)
    assert weight_scale[:, 0].tolist() == [0, 0]  # documented choice: 2^-127
    decoded = mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32)
    assert torch.equal(decoded[:, :32], torch.zeros(2, 32))
    assert torch.equal(decoded[0], torch.zeros(64))


def test_non_finite_block_decodes_to_nan_and_leaves_others_alone():
    w = torch.ones(1, 96)
    w[0, 3] = math.nan
    w[0, 40] = math.inf
    weight_packed, weight_scale = mxfp4_quantize(w)
    assert weight_scale.tolist() == [[255, 255, 127 - 2]]
    decoded = mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32)
    assert torch.isnan(decoded[0, :64]).all()
    assert torch.equal(decoded[0, 64:], torch.ones(32))


@settings(max_examples=150, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    log2_range=st.integers(-140, 120),
    data=st.data(),
)
def test_quantize_is_nearest_grid_point(shape, log2_range, data):
    rows, n_blocks = shape
    unit = st.floats(min_value=-1.0, max_value=1.0, allow_nan=False, width=32)
    raw = data.draw(st.lists(unit, min_size=rows * n_blocks * 32, max_size=rows * n_blocks * 32))
    w = (torch.tensor(raw, dtype=torch.float64).reshape(rows, n_blocks * 32) * 2.0**log2_range).float()
    weight_packed, weight_scale = mxfp4_quantize(w)
    decoded = mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32).double()
    w64 = w.double().numpy().reshape(rows, n_blocks, 32)
    q64 = decoded.numpy().reshape(rows, n_blocks, 32)
    for r in range(rows):
        for b in range(n_blocks):
            block, q = w64[r, b], q64[r, b]
            amax = float(np.abs(block).max())
            s = int(weight_scale[r, b])
            if amax == 0.0:
                assert s == 0 and (q == 0).all()
                continue
            e = min(max(math.frexp(amax)[1] - 1 - 2, -127), 127)
            assert s == e + 127
            grid = np.array(E2M1_MAGNITUDES) * 2.0**e
            # Bounded: the block's largest element decodes to at most 6 * 2^e.
            assert np.abs(q).max() <= 6 * 2.0**e
            # Every decoded value is a signed grid point and a nearest one (saturation
            # included: beyond 6 * 2^e the nearest grid point is 6 * 2^e).
            assert np.isin(np.abs(q), grid).all()
            assert ((np.sign(q) == np.sign(block)) | (q == 0)).all()
            error = np.abs(block - q)
            best = np.abs(np.abs(block)[:, None] - grid[None, :]).min(axis=1)
            assert (error == best).all()
            # Inside the grid the error is at most half the local grid step of the block.
            inside = np.abs(block) <= grid[-1]
            upper = np.searchsorted(grid, np.abs(block[inside]), side="left").clip(1, 7)
            half_step = (grid[upper] - grid[upper - 1]) / 2
            assert (error[inside] <= half_step).all()


def test_quantize_accepts_low_precision_and_batched_weights():
    w = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    weight_packed, weight_scale = mxfp4_quantize(w)
    assert weight_packed.shape == (2, 3, 32) and weight_scale.shape == (2, 3, 2)
    flat_packed, flat_scale = mxfp4_quantize(w.reshape(6, 64))
    assert torch.equal(weight_packed.reshape(6, 32), flat_packed)
    assert torch.equal(weight_scale.reshape(6, 2), flat_scale)


def test_bad_shapes_and_dtypes_raise_value_error_naming_argument():
    with pytest.raises(ValueError, match="w last dimension must be divisible by 32"):
        mxfp4_quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="w must be a floating tensor"):
        mxfp4_quantize(torch.zeros(4, 32, dtype=torch.int32))
    packed = torch.zeros(4, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(4, 3\).*weight_packed of shape \(4, 32\)"):
        mxfp4_dequantize(packed, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"weight_scale has shape \(2, 2\)"):
        mxfp4_dequantize(packed, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_packed last dimension"):
        mxfp4_dequantize(torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_packed must be uint8"):
        mxfp4_dequantize(packed.to(torch.int8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="weight_scale must be uint8"):
        mxfp4_dequantize(packed, torch.zeros(4, 2, dtype=torch.float32))
    with pytest.raises(ValueError, match="packed_u8 must be uint8"):
        unpack_fp4(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale_u8 must be uint8"):
        e8m0_to_float(torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="x last dimension must be divisible by 32"):
        fake_quant_mxfp8_e4m3(torch.zeros(2, 33))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_mxfp4_forward_and_straight_through_gradient(dtype):
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(4, 96, generator=generator).to(dtype).requires_grad_()
    upstream = torch.randn(4, 96, generator=generator).to(dtype)
    out = fake_quant_mxfp4(w)
    assert out.dtype == dtype and out.shape == w.shape
    expected = mxfp4_dequantize(*mxfp4_quantize(w.detach()), dtype=dtype)
    assert torch.equal(out.detach(), expected)
    assert not torch.equal(out.detach(), w.detach())
    out.backward(upstream)
    assert torch.equal(w.grad, upstream)


def _finite_e4m3_values() -> torch.Tensor:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values)]  # 254 values: +-0 and +-(2^-9 .. 448)


@pytest.mark.parametrize("shift", [-100, -8, 0, 37])
def test_mxfp8_round_trip_exact_for_representable_values(shift):
    values = _finite_e4m3_values()
    assert values.numel() == 254
    # Every block starts with 448, so its shared exponent is floor(log2 448) - 8 = 0 before
    # the shift and every E4M3 value in it is representable at that scale.
    n_blocks = math.ceil(values.numel() / 31)
    body = torch.cat([values, torch.zeros(n_blocks * 31 - values.numel())]).reshape(n_blocks, 31)
    x = torch.cat([torch.full((n_blocks, 1), 448.0), body], dim=1).flatten() * 2.0**shift
    assert torch.equal(fake_quant_mxfp8_e4m3(x), x)
    assert torch.equal(fake_quant_mxfp8_e4m3(x.bfloat16()), x.bfloat16())


def test_mxfp8_saturates_and_rounds():
    x = torch.zeros(64)
    # Block 0: amax 500 -> exponent 0; 500 and 480 exceed 448 and saturate.
    x[:6] = torch.tensor([500.0, -500.0, 480.0, 1.0, 1.0625, 1.1875])
    # Block 1: amax 1 -> exponent -8, so 2^-14 is a normal E4M3 value after scaling
    # (2^-6), 2^-17 the smallest subnormal (2^-9), and 2^-19 (2^-11) flushes to zero.
    x[32:36] = torch.tensor([1.0, 2.0**-14, -(2.0**-17), 2.0**-19])
    out = fake_quant_mxfp8_e4m3(x)
    # 1.0625 is the midpoint of 1 and 1.125 (ties to even -> 1.0); 1.1875 -> 1.25 (even).
    assert out[:6].tolist() == [448.0, -448.0, 448.0, 1.0, 1.0, 1.25]
    assert out[32:36].tolist() == [1.0, 2.0**-14, -(2.0**-17), 0.0]
    assert torch.equal(out[36:], torch.zeros(28))
    assert torch.equal(fake_quant_mxfp8_e4m3(torch.zeros(2, 32)), torch.zeros(2, 32))


def test_fake_quant_mxfp8_straight_through_gradient():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 64, generator=generator).requires_grad_()
    upstream = torch.randn(3, 5, 64, generator=generator)
    out = fake_quant_mxfp8_e4m3(x)
    assert out.shape == x.shape and not torch.equal(out.detach(), x.detach())
    out.backward(upstream)
    assert torch.equal(x.grad, upstream)


# Hand-computed MXFP4 blocks: (inputs, expected E8M0 byte, expected 4-bit codes of the inputs).
# The rest of each 32-element block is +0 (code 0). Scale: e = floor(log2(amax)) - 2, clamped to
# [-127, 127]; byte = e + 127; code = sign bit 3 | index of the nearest of {0, .5, 1, 1.5, 2, 3,
# 4, 6} to |x| / 2^e, ties to the even index, above 6 saturating to 6 (index 7).
_TINY = 2.0**-125
MXFP4_HAND_CASES = {
    "every code, scale 1 (amax 6)": (
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
        127, list(range(16))),
    "every code, scale 2^-3 (amax 0.75)": (
        [v / 8 for v in OCP_E2M1_TABLE], 124, list(range(16))),
    "ties to the even code": (  # midpoints .25 .75 1.25 1.75 2.5 3.5 5 of the E2M1 magnitudes
        [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0],
        127, [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14]),
    "just off the ties": (
        [6.0, 0.2500001, 0.7499999, 1.7500001, 4.9999995, 5.0000005], 127, [7, 1, 1, 4, 6, 7]),
    "amax exactly 4 = 2^2: scale 1": ([4.0, 1.0, -0.5, 0.2], 127, [6, 2, 9, 0]),
    "amax exactly 8 = 2^3: scale 2": ([8.0, 3.0, 1.0, -2.5], 128, [6, 3, 1, 10]),  # -1.25: tie, even
    "amax exactly 1: scale 2^-2": ([1.0, 0.375, -0.125, 0.0625], 125, [6, 3, 9, 0]),
    "amax just below 8 saturates to 6": ([7.9999995, 7.0, -7.5, 6.5], 127, [7, 7, 15, 7]),
    "overflow clamps to +-6 X": ([15.0, -13.0, 12.0, 2.0], 128, [7, 15, 7, 2]),
    "amax 2^-125: e = -127, byte 0": (
        [_TINY, _TINY / 4, _TINY / 8, _TINY / 16, 3 * _TINY / 16, -_TINY / 2], 0, [6, 2, 1, 0, 2, 12]),
    "amax below the clamp (fp32 subnormal 1.5 * 2^-127)": (
        [1.5 * 2.0**-127, 2.0**-127, 2.0**-149], 0, [3, 2, 0]),
    "amax 2^-130, far below the clamp, rounds to zero": ([2.0**-130, -(2.0**-131)], 0, [0, 8]),
    "fp32 max: e = 125, saturates": ([3.4028234663852886e38, 2.0**127, -(2.0**125)], 252, [7, 6, 10]),
    "all-zero block": ([0.0, 0.0], 0, [0, 0]),
    "all negative zeros keep their sign": ([-0.0] * 32, 0, [8] * 32),
}


@pytest.mark.parametrize("case", sorted(MXFP4_HAND_CASES))
def test_mxfp4_hand_computed_blocks(case):
    inputs, scale_byte, codes = MXFP4_HAND_CASES[case]
    pad = 32 - len(inputs)
    w = torch.tensor([inputs + [0.0] * pad], dtype=torch.float32)
    assert torch.equal(w[0, : len(inputs)], torch.tensor(inputs, dtype=torch.float64).float())  # exact inputs
    weight_packed, weight_scale = mxfp4_quantize(w)
    assert weight_scale.tolist() == [[scale_byte]]
    assert torch.equal(weight_packed[0], _pack_pairs(codes + [0] * pad))
    decoded = mxfp4_dequantize(weight_packed, weight_scale, dtype=torch.float32)[0]
    expected = _expected_fp32([OCP_E2M1_TABLE[c] * math.ldexp(1.0, scale_byte - 127) for c in codes + [0] * pad])
    _assert_bitwise_equal(decoded, expected)


def test_mxfp4_nan_block_codes_are_zero_and_scale_is_nan():
    w = torch.full((1, 32), 2.0)
    w[0, 5] = -math.inf
    weight_packed, weight_scale = mxfp4_quantize(w)
    assert weight_scale.tolist() == [[255]] and weight_packed.eq(0).all()


# Hand-computed MXFP8 (E4M3) blocks: (inputs, expected fake-quantised values). e = floor(log2(amax))
# - 8 clamped to [-127, 127]; x / 2^e rounds to E4M3 (3 mantissa bits, subnormals down to 2^-9,
# ties to even), saturating at 448.
MXFP8_HAND_CASES = {
    "amax 448: scale 1, E4M3 subnormals": (
        [448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 0.01171875, -(2.0**-6)],
        [448.0, 2.0**-9, 0.0, 2.0**-9, 0.01171875, -(2.0**-6)]),
    "amax exactly 256 = 2^8: scale 1": ([256.0, 1.0625, 17.0, -3.0], [256.0, 1.0, 16.0, -3.0]),
    "amax exactly 512: scale 2": ([512.0, 1.0625, 17.0, 3.0], [512.0, 1.0, 16.0, 3.0]),
    "overflow saturates to 448 X": ([486.0, -500.0, 460.0], [448.0, -448.0, 448.0]),
    "amax 2^-118: e = -126": ([2.0**-118, 2.0**-127], [2.0**-118, 2.0**-127]),
    "amax below the clamp (fp32 subnormal): flushes": ([2.0**-140, -(2.0**-141)], [0.0, -0.0]),
    "fp32 max: e = 119, saturates": ([3.4028234663852886e38, 2.0**127], [448 * 2.0**119, 2.0**127]),
}


@pytest.mark.parametrize("case", sorted(MXFP8_HAND_CASES))
def test_mxfp8_hand_computed_blocks(case):
    inputs, expected = MXFP8_HAND_CASES[case]
    pad = 32 - len(inputs)
    x = torch.tensor(inputs + [0.0] * pad, dtype=torch.float64).float()
    _assert_bitwise_equal(fake_quant_mxfp8_e4m3(x)[: len(inputs)], _expected_fp32(expected))


def test_mxfp8_non_finite_blocks_become_nan():
    x = torch.ones(96)
    x[3], x[40] = math.nan, math.inf
    out = fake_quant_mxfp8_e4m3(x)
    assert torch.isnan(out[:64]).all() and torch.equal(out[64:], torch.ones(32))


def _torchao_mx():
    pytest.importorskip("torchao")
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    config = pytest.importorskip("torchao.prototype.mx_formats.config")
    return mx_tensor, config.ScaleCalculationMode.FLOOR


def _blocks_for_torchao(seed: int) -> torch.Tensor:
    """[64, 256] fp32: Gaussian blocks at scales 2^-100..2^100, plus zero blocks, blocks whose
    amax is a power of two, blocks of exact E2M1 and E4M3 ties, and saturating blocks. No block
    has 0 < amax < 2^-125: there torchao divides by 2^-126 (it clamps the divisor to the smallest
    normal fp32) while it stores the scale 2^-127, and decodes to half the value it rounded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, 32, generator=g) * torch.exp2(torch.randint(-100, 100, (64, 8, 1), generator=g).float())
    x[0, 0] = 0.0
    x[1, 1, 0] = 4.0 * x[1, 1].abs().max()  # makes the amax a power of two
    x[1, 1, 0] = 2.0 ** torch.floor(torch.log2(x[1, 1, 0]))
    x[2, 2] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4) * torch.tensor([1.0, -1.0]).repeat(16)
    x[3, 3] = torch.linspace(-8, 8, 32) * 2.0**20  # amax 8 * 2^20 and saturating neighbours
    x[4, 4] = 448.0 + torch.arange(32) * (1.0 / 16)  # E4M3 ties around 448..450
    return x.reshape(64, 256)


def test_mxfp4_matches_torchao_floor_bit_for_bit():
    mx_tensor, floor = _torchao_mx()
    w = _blocks_for_torchao(0)
    scale, packed = mx_tensor.to_mx(w, torch.float4_e2m1fn_x2, 32, floor)
    weight_packed, weight_scale = mxfp4_quantize(w)
    assert torch.equal(scale.view(torch.uint8), weight_scale)
    assert torch.equal(packed.view(torch.uint8), weight_packed)  # same nibble order, too


def test_mxfp8_matches_torchao_floor():
    mx_tensor, floor = _torchao_mx()
    x = _blocks_for_torchao(1)
    scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, floor)
    decoded = mx_tensor.to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
    _assert_bitwise_equal(fake_quant_mxfp8_e4m3(x), decoded)
