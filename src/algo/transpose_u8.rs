//! Byte-matrix transposes for the int8 paths' NCHW <-> NHWC conversions: 16x16 blocks
//! through SSE2 unpacks on x86-64 (SSE2 is part of the x86-64 baseline), 8x8 blocks
//! through u64 words elsewhere, element by element at the ragged edges.

/// `dst[j * ds + i] = src[i * ss + j] ^ flip` for `i < rows`, `j < cols`.
///
/// Panics (a bug, not bad input) if a slice is too short for the strides it is given.
pub(crate) fn transpose(
    src: &[u8],
    ss: usize,
    rows: usize,
    cols: usize,
    dst: &mut [u8],
    ds: usize,
    flip: u8,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(src.len() >= (rows - 1) * ss + cols && dst.len() >= (cols - 1) * ds + rows);
    const B: usize = BLOCK;
    let (rb, cb) = (rows / B * B, cols / B * B);
    for i0 in (0..rb).step_by(B) {
        for j0 in (0..cb).step_by(B) {
            // SAFETY: the block's rows i0..i0+B of src (stride ss) and rows j0..j0+B of dst
            // (stride ds) lie inside the slices, as the assert above checked for the whole
            // matrix.
            unsafe {
                block(
                    src.as_ptr().add(i0 * ss + j0),
                    ss,
                    dst.as_mut_ptr().add(j0 * ds + i0),
                    ds,
                    flip,
                )
            };
        }
        for j in cb..cols {
            for i in i0..i0 + B {
                dst[j * ds + i] = src[i * ss + j] ^ flip;
            }
        }
    }
    for i in rb..rows {
        for j in 0..cols {
            dst[j * ds + i] = src[i * ss + j] ^ flip;
        }
    }
}

#[cfg(target_arch = "x86_64")]
const BLOCK: usize = 16;
#[cfg(not(target_arch = "x86_64"))]
const BLOCK: usize = 8;

/// One 16x16 block: four rounds of byte, word, dword and qword unpacks. Fed the rows in
/// bit-reversed order, the rounds leave column `j` in register `j`, rows in order.
///
/// # Safety
/// `src` must be readable for 16 rows of 16 bytes `ss` apart, `dst` writable for 16 rows of
/// 16 bytes `ds` apart.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block(src: *const u8, ss: usize, dst: *mut u8, ds: usize, flip: u8) {
    use core::arch::x86_64::*;
    const BITREV: [usize; 16] = [0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15];
    let f = _mm_set1_epi8(flip as i8);
    let mut r = [_mm_setzero_si128(); 16];
    for (i, reg) in r.iter_mut().enumerate() {
        *reg = _mm_xor_si128(
            _mm_loadu_si128(src.add(BITREV[i] * ss) as *const __m128i),
            f,
        );
    }
    for round in 0..4 {
        let mut o = [_mm_setzero_si128(); 16];
        for i in 0..8 {
            let (a, b) = (r[i], r[i + 8]);
            (o[2 * i], o[2 * i + 1]) = match round {
                0 => (_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)),
                1 => (_mm_unpacklo_epi16(a, b), _mm_unpackhi_epi16(a, b)),
                2 => (_mm_unpacklo_epi32(a, b), _mm_unpackhi_epi32(a, b)),
                _ => (_mm_unpacklo_epi64(a, b), _mm_unpackhi_epi64(a, b)),
            };
        }
        r = o;
    }
    for (j, reg) in r.iter().enumerate() {
        _mm_storeu_si128(dst.add(j * ds) as *mut __m128i, *reg);
    }
}

/// One 8x8 block through u64 words: swap 4x4 blocks, then 2x2, then single bytes.
///
/// # Safety
/// `src` must be readable for 8 rows of 8 bytes `ss` apart, `dst` writable for 8 rows of 8
/// bytes `ds` apart.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
unsafe fn block(src: *const u8, ss: usize, dst: *mut u8, ds: usize, flip: u8) {
    let mut w = [0u64; 8];
    for (r, word) in w.iter_mut().enumerate() {
        *word = (src.add(r * ss) as *const u64).read_unaligned();
    }
    for (shift, mask, step) in [
        (32u32, 0x0000_0000_FFFF_FFFFu64, 4usize),
        (16, 0x0000_FFFF_0000_FFFF, 2),
        (8, 0x00FF_00FF_00FF_00FF, 1),
    ] {
        for i in 0..8 {
            if i & step == 0 {
                let (a, b) = (w[i], w[i + step]);
                w[i] = (a & mask) | ((b << shift) & !mask);
                w[i + step] = ((a >> shift) & mask) | (b & !mask);
            }
        }
    }
    let f = u64::from_le_bytes([flip; 8]);
    for (c, word) in w.iter().enumerate() {
        (dst.add(c * ds) as *mut u64).write_unaligned(word ^ f);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn transposes_every_size_like_the_definition() {
        for (rows, cols) in [(1, 1), (3, 5), (16, 16), (17, 33), (40, 9), (64, 100)] {
            let ss = cols + 3;
            let src: Vec<u8> = (0..rows * ss).map(|i| (i * 7 + 3) as u8).collect();
            let ds = rows + 5;
            let mut dst = vec![0u8; cols * ds];
            super::transpose(&src, ss, rows, cols, &mut dst, ds, 0x80);
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(
                        dst[j * ds + i],
                        src[i * ss + j] ^ 0x80,
                        "{rows}x{cols} at {i},{j}"
                    );
                }
            }
        }
    }
}
