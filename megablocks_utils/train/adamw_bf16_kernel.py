"""The Triton kernels of ``adamw_bf16.AdamWBF16`` (a module of its own: Triton is imported only where a GPU runs it).

``adamw_bf16_kernel`` updates one tensor; ``adamw_bf16_multi_tensor_kernel`` updates many in one launch, each program
finding its tensor in a table. Both run the same ``_update_block``, so a tensor gets the same bits from either."""

import triton
import triton.language as tl

# The multi-tensor table: one row of int64 per tensor. Columns 0-6: the tensor's first program in the launch, its numel,
# its seed, and the addresses of the parameter, gradient, exp_avg and exp_avg_sq; columns 7-10 hold 8 fp32: lr,
# 1 - beta1, 1 - beta2, eps, weight_decay, correction1, correction2_sqrt and one unused.
TABLE_ROW = tl.constexpr(11)


@triton.jit
def _to_bf16_nearest(x):
    """fp32 -> bf16 rounded to nearest, ties to even (torch's rounding), in integer operations: the result's low 16 bits
    are zero, so the final conversion is exact in any rounding mode (Triton's CPU interpreter truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True)).to(tl.bfloat16)


@triton.jit
def _random16(seed, first, BLOCK: tl.constexpr):
    """16 uniform random bits for each of the ``BLOCK`` consecutive elements from ``first`` (a multiple of 8): one Philox
    call (``randint4x``: 128 bits) per 8 elements, a function of the seed and the element's offset only. One call per
    element (``randint``, 32 bits of which 16 were used) made the update compute-bound: Philox's ten rounds of integer
    multiplies per element cost more than the 14 bytes it moves (bench/optim_step.py, one H200)."""
    groups = (first // 8 + tl.arange(0, BLOCK // 8)).to(tl.uint32)  # past 2^32 groups (2^35 elements) they wrap
    r0, r1, r2, r3 = tl.randint4x(seed, groups)
    words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK // 2])  # 4 words per group, in a fixed order
    halves = tl.reshape(tl.join(words & 0xFFFF, (words >> 16) & 0xFFFF), [BLOCK])  # each word's two halves: 8 per group
    return halves.to(tl.int32)


@triton.jit
def _update_block(p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, first, n, lr, beta1_weight, beta2_weight, eps, weight_decay,
                  correction1, correction2_sqrt, seed, STOCHASTIC: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """One AdamW step on the ``BLOCK`` elements from ``first`` (int64, a multiple of 8; those below ``n``) of a bf16
    parameter, its gradient and its two bf16 moments, in fp32;
    ``*_weight`` = 1 - beta; the parameter rounded stochastically (``STOCHASTIC``) or to nearest. With ``SCALED`` the
    gradient is first multiplied by the bf16 scalar at ``coef_ptr`` (the clip's coefficient) and rounded to bf16."""
    offsets = first + tl.arange(0, BLOCK)
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
        # away from zero with probability (the 16 bits bf16 drops) / 2^16
        random16 = _random16(seed, first, BLOCK)
        bits = p.to(tl.int32, bitcast=True)
        truncated = bits & -65536
        bits = tl.where(random16 < (bits & 0xFFFF), truncated + 0x10000, truncated)
        p_bf16 = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: the low 16 bits are zero
    else:
        p_bf16 = _to_bf16_nearest(p)
    tl.store(p_ptr + offsets, p_bf16, mask=mask)


@triton.jit
def adamw_bf16_kernel(p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, n, lr, beta1_weight, beta2_weight, eps, weight_decay,
                      correction1, correction2_sqrt, seed, STOCHASTIC: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr):
    """``_update_block`` on the ``BLOCK`` elements of program ``program_id`` of one tensor of ``n`` elements."""
    _update_block(p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, tl.program_id(0).to(tl.int64) * BLOCK, n, lr, beta1_weight,
                  beta2_weight, eps, weight_decay, correction1, correction2_sqrt, seed, STOCHASTIC, SCALED, BLOCK)


@triton.jit
def adamw_bf16_multi_tensor_kernel(table_ptr, n_tensors, coef_ptr, STOCHASTIC: tl.constexpr, SCALED: tl.constexpr,
                                   ALIGNED: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
                                   BLOCKS_PER_PROGRAM: tl.constexpr):
    """``_update_block`` on ``BLOCKS_PER_PROGRAM`` consecutive blocks of one of the ``n_tensors`` tensors of ``table_ptr``
    (the layout above): the tensor whose programs hold this one, found by a binary search over their first programs
    (``SEARCH_STEPS`` = ceil(log2(n_tensors)); several blocks per program share its dependent loads); each block's
    elements counted from the tensor's start as ``adamw_bf16_kernel`` counts them (so the same bits). ``ALIGNED``: every
    address is a multiple of 16 bytes and every numel of 8, which lets the loads and stores move 16 bytes at a time, as
    they do for one such tensor."""
    program = tl.program_id(0)
    low, high = 0, n_tensors  # the tensor's row is in [low, high)
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high) // 2
        at_or_after = tl.load(table_ptr + middle * TABLE_ROW) <= program
        low = tl.where(at_or_after, middle, low)
        high = tl.where(at_or_after, high, middle)
    row = table_ptr + low * TABLE_ROW
    numel, seed = tl.load(row + 1), tl.load(row + 2)
    bf16_ptr = tl.pointer_type(tl.bfloat16)
    p_ptr, g_ptr = tl.load(row + 3).to(bf16_ptr), tl.load(row + 4).to(bf16_ptr)
    m_ptr, v_ptr = tl.load(row + 5).to(bf16_ptr), tl.load(row + 6).to(bf16_ptr)
    if ALIGNED:  # (on the pointers: a hint on the integer addresses does not reach the loads)
        numel = tl.multiple_of(numel, 8)
        p_ptr, g_ptr = tl.multiple_of(p_ptr, 16), tl.multiple_of(g_ptr, 16)
        m_ptr, v_ptr = tl.multiple_of(m_ptr, 16), tl.multiple_of(v_ptr, 16)
    scalars = (row + 7).to(tl.pointer_type(tl.float32), bitcast=True)
    lr, beta1_weight, beta2_weight, eps = tl.load(scalars), tl.load(scalars + 1), tl.load(scalars + 2), tl.load(scalars + 3)
    weight_decay, correction1, correction2_sqrt = tl.load(scalars + 4), tl.load(scalars + 5), tl.load(scalars + 6)
    first_block = (program - tl.load(row)) * BLOCKS_PER_PROGRAM  # int64, as the table is
    for j in tl.static_range(BLOCKS_PER_PROGRAM):
        _update_block(p_ptr, g_ptr, m_ptr, v_ptr, coef_ptr, (first_block + j) * BLOCK, numel, lr, beta1_weight,
                      beta2_weight, eps, weight_decay, correction1, correction2_sqrt, seed, STOCHASTIC, SCALED, BLOCK)
