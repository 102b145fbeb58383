"""The Sinkhorn passes of one token in a warp's lanes, shared by the Sinkhorn kernels (:mod:`.sinkhorn`) and the
fused pre stage (:mod:`.pre_big_fuse`), so both run the same instructions (their bitwise contract)."""


def sinkhorn_layout(hc_mult: int) -> tuple[int, int]:
    """``(k, N)``: matrix elements per lane and lanes per token of the Sinkhorn kernels.

    One lane per element (``N = m*m``) while a token fits a warp; at m = 8 two neighbouring
    elements of a row per lane (``k = 2``, ``N = 32``).
    """
    k = max(1, hc_mult * hc_mult // 32)
    return k, hc_mult * hc_mult // k


def sinkhorn_macros(T, m: int):
    """Sinkhorn building blocks for the element-per-lane layout (the arithmetic: :mod:`.sinkhorn`'s docstring).

    A token's ``N`` lanes hold its ``m x m`` matrix row-major, ``k`` neighbouring elements of one row
    per lane (:func:`sinkhorn_layout`): lane ``l`` holds elements ``l*k .. l*k+k-1``, so the lanes of a
    row differ in their low ``log2(m/k)`` bits and the lanes of a column in the next ``log2(m)`` bits.
    A row (column) sum is an xor-butterfly over those bits (after the lane's own ``k`` elements,
    added in order, for a row): every lane of the row (column) ends with the same bits, since each
    butterfly level adds the same two partial sums, only in swapped operand order.

    Returns ``(softmax_eps, row_sum, col_sum, quotient)`` macros.
    """
    k, _ = sinkhorn_layout(m)
    row_bits = (m // k).bit_length() - 1  # butterfly levels of a row sum
    col_bits = m.bit_length() - 1  # butterfly levels of a column sum
    col_base = m // k  # lane distance between neighbouring rows

    @T.macro
    def row_max(src, s):
        s[0] = src[0]
        for c in T.unroll(1, k):
            s[0] = T.max(s[0], src[c])
        for b in T.unroll(row_bits):
            s[0] = T.max(s[0], T.shfl_xor(s[0], 1 << b))

    @T.macro
    def row_sum(src, s):
        # s[0] = the sum of this lane's row of src.
        s[0] = src[0]
        for c in T.unroll(1, k):
            s[0] = s[0] + src[c]
        for b in T.unroll(row_bits):
            s[0] = s[0] + T.shfl_xor(s[0], 1 << b)

    @T.macro
    def col_sum(src, s):
        # s[c] = the sum of the column of element c of this lane.
        for c in T.unroll(k):
            s[c] = src[c]
            for b in T.unroll(col_bits):
                s[c] = s[c] + T.shfl_xor(s[c], col_base << b)

    @T.macro
    def softmax_eps(y, s, pm, eps):
        # pm = row softmax of y (max-subtracted, IEEE division); y = pm + eps (pm may be y itself).
        row_max(y, s)
        for c in T.unroll(k):
            y[c] = T.exp(y[c] - s[0])
        row_sum(y, s)
        for c in T.unroll(k):
            pm[c] = y[c] / s[0]
            y[c] = pm[c] + eps

    @T.macro
    def quotient(buf, i, d, rc, q):
        # buf[i] <- buf[i] / d, correctly rounded (rc = __frcp_rn(d); one Markstein correction).
        q[0] = T.ieee_mul(buf[i], rc)
        buf[i] = T.ieee_fmaf(T.ieee_fmaf(-d, q[0], buf[i]), rc, q[0])

    return softmax_eps, row_sum, col_sum, quotient
