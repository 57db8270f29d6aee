//! Packing of GEMM operands into micro-panels: `r` rows (A) or columns (B) interleaved per K
//! step, zero-padded to a whole panel, so the microkernel reads both operands contiguously.

use super::{BlockB, Panels};

/// Operand packed once at create time: for each micro-panel of `r` rows/columns, all `k` steps.
pub(crate) struct Prepacked<'a> {
    pub data: &'a [f32],
    pub k: usize,
}

impl Panels for Prepacked<'_> {
    const PREPACKED: bool = true;
    #[inline(always)]
    fn panels(
        &self,
        start: usize,
        _len: usize,
        k0: usize,
        _kc: usize,
        r: usize,
        _dst: &mut [f32],
    ) -> (*const f32, usize) {
        debug_assert_eq!(start % r, 0);
        let off = (start / r * self.k + k0) * r;
        (self.data[off..].as_ptr(), self.k * r)
    }
}

/// Packs `rows` rows of depth `k` into micro-panels of `r` in `dst` (zero-filled, of
/// `prepacked_len(rows, k, r)` floats), reading element (row, kk) from `get`. Used at create
/// time for weights.
pub(crate) fn prepack(
    dst: &mut [f32],
    rows: usize,
    k: usize,
    r: usize,
    get: impl Fn(usize, usize) -> f32,
) {
    for q in 0..rows.div_ceil(r) {
        for i in 0..r.min(rows - q * r) {
            for kk in 0..k {
                dst[(q * k + kk) * r + i] = get(q * r + i, kk);
            }
        }
    }
}

/// Size in floats of `prepack(rows, k, r, ..)` per group.
pub(crate) fn prepacked_len(rows: usize, k: usize, r: usize) -> usize {
    rows.div_ceil(r) * k * r
}

/// A row-major `m x k` matrix as the A operand.
pub(crate) struct RowMajorA<'a> {
    pub data: &'a [f32],
    pub ld: usize,
}

impl Panels for RowMajorA<'_> {
    const PREPACKED: bool = false;
    #[inline(always)]
    fn panels(
        &self,
        start: usize,
        len: usize,
        k0: usize,
        kc: usize,
        r: usize,
        dst: &mut [f32],
    ) -> (*const f32, usize) {
        for q in 0..len.div_ceil(r) {
            let panel = &mut dst[q * kc * r..(q + 1) * kc * r];
            let rows = r.min(len - q * r);
            for i in 0..r {
                if i < rows {
                    let src = &self.data[(start + q * r + i) * self.ld + k0..][..kc];
                    for (kk, &v) in src.iter().enumerate() {
                        panel[kk * r + i] = v;
                    }
                } else {
                    (0..kc).for_each(|kk| panel[kk * r + i] = 0.0);
                }
            }
        }
        (dst.as_ptr(), kc * r)
    }
}

/// A row-major `k x n` matrix as the B operand.
pub(crate) struct RowMajorB<'a> {
    pub data: &'a [f32],
    pub ld: usize,
}

impl Panels for RowMajorB<'_> {
    const PREPACKED: bool = false;
    #[inline(always)]
    fn panels(
        &self,
        start: usize,
        len: usize,
        k0: usize,
        kc: usize,
        r: usize,
        dst: &mut [f32],
    ) -> (*const f32, usize) {
        for q in 0..len.div_ceil(r) {
            let cols = r.min(len - q * r);
            let col0 = start + q * r;
            for kk in 0..kc {
                let d = &mut dst[(q * kc + kk) * r..][..r];
                let s = &self.data[(k0 + kk) * self.ld + col0..][..cols];
                d[..cols].copy_from_slice(s);
                d[cols..].fill(0.0);
            }
        }
        (dst.as_ptr(), kc * r)
    }
}

impl BlockB for Prepacked<'_> {}
impl BlockB for RowMajorB<'_> {}
