//! Packing of GEMM operands into micro-panels: `r` rows (A) or columns (B) interleaved per K
//! step, zero-padded to a whole panel, so the microkernel reads both operands contiguously.

use super::{BlockB, Panels};
use crate::cpu::generated_layout::Transpose8x8;

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

/// A row-major `m x k` matrix as the A operand (or, through the same packing, a column-major
/// `k x n` one as B): packing it is a transpose, done in 8x8 blocks by `transpose`.
pub(crate) struct RowMajorA<'a> {
    pub data: &'a [f32],
    pub ld: usize,
    pub transpose: Transpose8x8,
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
        let kc8 = kc / 8 * 8;
        for q in 0..len.div_ceil(r) {
            let panel = &mut dst[q * kc * r..(q + 1) * kc * r];
            let rows = r.min(len - q * r);
            let row = |i: usize| &self.data[(start + q * r + i) * self.ld + k0..][..kc];
            // Whole groups of 8 rows: 8x8 blocks through the transpose kernel (a scalar
            // transposing copy costs as much as the products of a deep, narrow GEMM).
            let full = if r.is_multiple_of(8) { rows / 8 * 8 } else { 0 };
            for i0 in (0..full).step_by(8) {
                let src = row(i0);
                let _ = row(i0 + 7); // bounds-checks the last of the 8 rows
                for kk in (0..kc8).step_by(8) {
                    // SAFETY: rows i0..i0+8 hold kc >= kk+8 floats each from `src`, `ld`
                    // apart (`row` checked the first and the last); the panel holds kc steps
                    // of r >= i0+8 floats.
                    unsafe {
                        (self.transpose)(
                            src[kk..].as_ptr(),
                            self.ld,
                            panel[kk * r + i0..].as_mut_ptr(),
                            r,
                        )
                    }
                }
                for i in i0..i0 + 8 {
                    for (kk, &v) in row(i).iter().enumerate().skip(kc8) {
                        panel[kk * r + i] = v;
                    }
                }
            }
            for i in full..rows {
                for (kk, &v) in row(i).iter().enumerate() {
                    panel[kk * r + i] = v;
                }
            }
            if rows < r {
                // The zero rows of a last, partial panel: a run at the end of each step.
                panel
                    .chunks_exact_mut(r)
                    .for_each(|step| step[rows..].fill(0.0));
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
                panel_row(d, &self.data[(k0 + kk) * self.ld + col0..][..cols]);
            }
        }
        (dst.as_ptr(), kc * r)
    }
}

/// One K step of a micro-panel: `d` (the panel's `r` floats) gets `s` (at most `r`) and zeros
/// after it. The common whole-panel case copies a fixed size, with no call to `memcpy` for a
/// few vectors.
#[inline(always)]
pub(crate) fn panel_row(d: &mut [f32], s: &[f32]) {
    fn exact<const N: usize>(d: &mut [f32], s: &[f32]) -> bool {
        match (<&mut [f32; N]>::try_from(d), <&[f32; N]>::try_from(s)) {
            (Ok(d), Ok(s)) => {
                *d = *s;
                true
            }
            _ => false,
        }
    }
    if !(exact::<8>(d, s) || exact::<16>(d, s) || exact::<32>(d, s) || exact::<64>(d, s)) {
        d[..s.len()].copy_from_slice(s);
        d[s.len()..].fill(0.0);
    }
}

impl BlockB for Prepacked<'_> {}
impl BlockB for RowMajorB<'_> {}
