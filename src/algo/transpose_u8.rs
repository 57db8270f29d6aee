//! Byte-matrix transposes for the int8 paths' NCHW <-> NHWC conversions: 16x16 blocks
//! through SSE2 unpacks on x86-64 (SSE2 is part of the x86-64 baseline), four of them side by
//! side in the 128-bit lanes of AVX-512 registers where the ISA allows, 8x8 blocks through
//! u64 words elsewhere; ragged edges by one more block, overlapping (element by element only
//! below one block).

use crate::cpu::Isa;

/// One round of unpacks over 16 registers: pairs `i` and `i + 8` interleaved (low, high).
/// Written out so that all 16 registers stay registers: loops over arrays of them went
/// through the stack, at a third of the speed.
#[cfg(target_arch = "x86_64")]
macro_rules! round {
    ($r:ident, $lo:ident, $hi:ident) => {
        [
            $lo($r[0], $r[8]),
            $hi($r[0], $r[8]),
            $lo($r[1], $r[9]),
            $hi($r[1], $r[9]),
            $lo($r[2], $r[10]),
            $hi($r[2], $r[10]),
            $lo($r[3], $r[11]),
            $hi($r[3], $r[11]),
            $lo($r[4], $r[12]),
            $hi($r[4], $r[12]),
            $lo($r[5], $r[13]),
            $hi($r[5], $r[13]),
            $lo($r[6], $r[14]),
            $hi($r[6], $r[14]),
            $lo($r[7], $r[15]),
            $hi($r[7], $r[15]),
        ]
    };
}

/// `[f(0), f(1), …, f(15)]`, written out (see [`round`]).
#[cfg(target_arch = "x86_64")]
macro_rules! sixteen {
    ($f:expr) => {{
        let f = $f;
        [
            f(0),
            f(1),
            f(2),
            f(3),
            f(4),
            f(5),
            f(6),
            f(7),
            f(8),
            f(9),
            f(10),
            f(11),
            f(12),
            f(13),
            f(14),
            f(15),
        ]
    }};
}

/// `dst[j * ds + i] = src[i * ss + j] ^ flip` for `i < rows`, `j < cols`; `isa` is the
/// level the caller runs at (AVX-512 and up: 16x64 blocks).
///
/// Panics (a bug, not bad input) if a slice is too short for the strides it is given.
#[allow(clippy::too_many_arguments)]
pub(crate) fn transpose(
    src: &[u8],
    ss: usize,
    rows: usize,
    cols: usize,
    dst: &mut [u8],
    ds: usize,
    flip: u8,
    isa: Isa,
) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(src.len() >= (rows - 1) * ss + cols && dst.len() >= (cols - 1) * ds + rows);
    const B: usize = BLOCK;
    if rows < B || cols < B {
        for i in 0..rows {
            for j in 0..cols {
                dst[j * ds + i] = src[i * ss + j] ^ flip;
            }
        }
        return;
    }
    // Columns 64 at a time (AVX-512), then B at a time. A ragged edge is one more block
    // flush with the end, overlapping the one before: it writes the same bytes again.
    let cw = if wide(isa) { cols / 64 * 64 } else { 0 };
    let starts = |from: usize, n: usize| {
        (from..n - B + 1)
            .step_by(B)
            .chain((!(n - from).is_multiple_of(B)).then_some(n - B))
    };
    for i0 in starts(0, rows) {
        #[cfg(target_arch = "x86_64")]
        for j0 in (0..cw).step_by(64) {
            // SAFETY: the CPU has AVX-512BW (`wide`); the block's rows i0..i0+16 of src
            // (64 bytes each, stride ss) and rows j0..j0+64 of dst (16 bytes each, stride ds)
            // lie inside the slices, as the assert above checked for the whole matrix.
            unsafe {
                block16x64(
                    src.as_ptr().add(i0 * ss + j0),
                    ss,
                    dst.as_mut_ptr().add(j0 * ds + i0),
                    ds,
                    flip,
                )
            };
        }
        for j0 in starts(cw, cols) {
            // SAFETY: the block's rows i0..i0+B of src (stride ss) and rows j0..j0+B of dst
            // (stride ds) lie inside the slices (i0 + B <= rows, j0 + B <= cols), as the
            // assert above checked for the whole matrix.
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
    let f = _mm_set1_epi8(flip as i8);
    let load = |i: usize| _mm_xor_si128(_mm_loadu_si128(src.add(BITREV[i] * ss).cast()), f);
    let r = sixteen!(load);
    let r = round!(r, _mm_unpacklo_epi8, _mm_unpackhi_epi8);
    let r = round!(r, _mm_unpacklo_epi16, _mm_unpackhi_epi16);
    let r = round!(r, _mm_unpacklo_epi32, _mm_unpackhi_epi32);
    let r = round!(r, _mm_unpacklo_epi64, _mm_unpackhi_epi64);
    for (j, reg) in r.into_iter().enumerate() {
        _mm_storeu_si128(dst.add(j * ds).cast(), reg);
    }
}

/// Rows in the order the unpack rounds want them (bit-reversed indices).
#[cfg(target_arch = "x86_64")]
const BITREV: [usize; 16] = [0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15];

/// Whether `isa` runs the 16x64 blocks (AVX-512 has BW, which its byte unpacks need).
fn wide(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && isa == Isa::Avx512
}

/// Four 16x16 blocks side by side (16 rows of 64 bytes): [`block`]'s rounds in each 128-bit
/// lane of 512-bit registers, so a lane `l` of register `j` ends as column `16 l + j`.
///
/// # Safety
/// The CPU must have AVX-512BW; `src` must be readable for 16 rows of 64 bytes `ss` apart,
/// `dst` writable for 64 rows of 16 bytes `ds` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn block16x64(src: *const u8, ss: usize, dst: *mut u8, ds: usize, flip: u8) {
    use core::arch::x86_64::*;
    let f = _mm512_set1_epi8(flip as i8);
    let load = |i: usize| _mm512_xor_si512(_mm512_loadu_si512(src.add(BITREV[i] * ss).cast()), f);
    let r = sixteen!(load);
    let r = round!(r, _mm512_unpacklo_epi8, _mm512_unpackhi_epi8);
    let r = round!(r, _mm512_unpacklo_epi16, _mm512_unpackhi_epi16);
    let r = round!(r, _mm512_unpacklo_epi32, _mm512_unpackhi_epi32);
    let r = round!(r, _mm512_unpacklo_epi64, _mm512_unpackhi_epi64);
    let store = |j: usize, reg: __m512i| {
        let at = |l: usize| dst.add((16 * l + j) * ds).cast();
        _mm_storeu_si128(at(0), _mm512_castsi512_si128(reg));
        _mm_storeu_si128(at(1), _mm512_extracti32x4_epi32::<1>(reg));
        _mm_storeu_si128(at(2), _mm512_extracti32x4_epi32::<2>(reg));
        _mm_storeu_si128(at(3), _mm512_extracti32x4_epi32::<3>(reg));
    };
    sixteen!(|j| store(j, r[j]));
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
        let sizes = [
            (1, 1),
            (3, 5),
            (16, 16),
            (17, 33),
            (40, 9),
            (64, 100),
            (33, 200),
            (24, 70),
            (15, 64),
            (16, 128),
        ];
        for (&isa, (rows, cols)) in crate::cpu::Isa::available()
            .iter()
            .flat_map(|i| sizes.map(|s| (i, s)))
        {
            let ss = cols + 3;
            let src: Vec<u8> = (0..rows * ss).map(|i| (i * 7 + 3) as u8).collect();
            let ds = rows + 5;
            let mut dst = vec![0u8; cols * ds];
            super::transpose(&src, ss, rows, cols, &mut dst, ds, 0x80, isa);
            for i in 0..rows {
                for j in 0..cols {
                    assert_eq!(
                        dst[j * ds + i],
                        src[i * ss + j] ^ 0x80,
                        "{isa}: {rows}x{cols} at {i},{j}"
                    );
                }
            }
        }
    }
}
