"""The Triton kernel of ``adamw_bf16.AdamWBF16`` (a module of its own: Triton is imported only where a GPU runs it)."""

import triton
import triton.language as tl


@triton.jit
def _to_bf16_nearest(x):
    """fp32 -> bf16 rounded to nearest, ties to even (torch's rounding), in integer operations: the result's low 16 bits
    are zero, so the final conversion is exact in any rounding mode (Triton's CPU interpreter truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True)).to(tl.bfloat16)


@triton.jit
def adamw_bf16_kernel(p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, n, lr, beta1_weight, beta2_weight, eps, weight_decay,
                      correction1, correction2_sqrt, seed, STOCHASTIC: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """One AdamW step on ``BLOCK`` elements of a bf16 parameter, its gradient and its two bf16 moments, in fp32;
    ``*_weight`` = 1 - beta; the parameter rounded stochastically (``STOCHASTIC``) or to nearest. With ``SCALED`` the
    gradient is first multiplied by the bf16 scalar at ``coef_ptr`` (the clip's coefficient) and rounded to bf16."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32)
    if SCALED:
        # The product of two bf16 numbers is exact in fp32; one rounding to bf16 then gives what torch's bf16 multiply
        # (clip_grad_norm_'s, in place) stores, bit for bit.
        g = _to_bf16_nearest(g * tl.load(coef_ptr).to(tl.float32)).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask).to(tl.float32)
    p = p - lr * weight_decay * p
    # torch.lerp(start, end, w): start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w)
    if beta1_weight < 0.5:
        m = m + beta1_weight * (g - m)
    else:
        m = g - (g - m) * (1 - beta1_weight)
    g2 = g * g
    if beta2_weight < 0.5:
        v = v + beta2_weight * (g2 - v)
    else:
        v = g2 - (g2 - v) * (1 - beta2_weight)
    tl.store(m_ptr + offsets, _to_bf16_nearest(m), mask=mask)
    tl.store(v_ptr + offsets, _to_bf16_nearest(v), mask=mask)
    p = p - lr * (m / correction1) / (tl.sqrt_rn(v) / correction2_sqrt + eps)
    if STOCHASTIC:
        # away from zero with probability (the 16 bits bf16 drops) / 2^16; offsets past 2^32 wrap (still uniform)
        random16 = (tl.randint(seed, offsets.to(tl.uint32)) & 0xFFFF).to(tl.int32)
        bits = p.to(tl.int32, bitcast=True)
        truncated = bits & -65536
        bits = tl.where(random16 < (bits & 0xFFFF), truncated + 0x10000, truncated)
        p_bf16 = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low 16 bits are zero
    else:
        p_bf16 = _to_bf16_nearest(p)
    tl.store(p_ptr + offsets, p_bf16, mask=mask)
