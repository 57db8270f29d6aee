//! f16 and bf16 storage: tensors kept in 16 bits, arithmetic in f32.
//!
//! The element types a [`Plan`](crate::Plan) reads and writes are the [`Storage`] types:
//! `f32`, [`half::f16`] and [`half::bf16`]. Weights are widened to f32 once, at create
//! ([`Conv2d::from_storage`](crate::Conv2d::from_storage)); activations are widened where the
//! kernels read them and rounded (to nearest, ties to even) where they are stored:
//!
//! - depthwise convolutions (the memory-bound ones) run generated kernels that load 16-bit
//!   inputs and store 16-bit outputs in registers (`dw_f16_*`, `dw_bf16_*`), or, in the
//!   blocked NCHW mode, convert in the transposes into and out of the worker's scratch;
//! - every other path ([`Bands`]) converts a band of input rows (all channels, the rows a
//!   band of output rows reads) into f32 in the workspace, runs the f32 algorithm on it, and
//!   rounds that band of outputs (bias, residual and activation already applied) into the
//!   output. A band is sized to stay in cache ([`BAND_FLOATS`]), so the workspace is
//!   bounded whatever the image size and no whole-tensor f32 copy is made.

use crate::params::Geometry;
use crate::Activation;
use half::{bf16, f16};

mod sealed {
    /// Only convkit's storage types implement [`Storage`](super::Storage).
    pub trait Sealed: bytemuck::Pod {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// Which [`Storage`] type a tensor is kept in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageType {
    /// IEEE single precision.
    F32,
    /// IEEE half precision (11-bit significand, range ±65504).
    F16,
    /// bfloat16 (8-bit significand, f32's range).
    Bf16,
}

impl StorageType {
    /// `f32`, `f16` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            StorageType::F32 => "f32",
            StorageType::F16 => "f16",
            StorageType::Bf16 => "bf16",
        }
    }

    /// The unit roundoff of rounding to this type: the largest relative error of one rounding
    /// to nearest (2^-24, 2^-11, 2^-8), for values in its normal range.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            StorageType::F32 => (-24f64).exp2(),
            StorageType::F16 => (-11f64).exp2(),
            StorageType::Bf16 => (-8f64).exp2(),
        }
    }
}

/// An element type tensors can be stored in: `f32`, [`half::f16`] or [`half::bf16`]. Every
/// computation runs in f32; a 16-bit type is widened exactly on load and rounded to nearest
/// (ties to even) on store. Sealed: convkit's kernels know each type.
pub trait Storage: sealed::Sealed + Copy + Send + Sync + 'static {
    /// Which type this is.
    const TYPE: StorageType;
    /// `x` rounded to this type (to nearest, ties to even; NaN stays NaN).
    fn from_f32(x: f32) -> Self;
    /// The value as an f32 (exact).
    fn to_f32(self) -> f32;
}

impl Storage for f32 {
    const TYPE: StorageType = StorageType::F32;
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Storage for f16 {
    const TYPE: StorageType = StorageType::F16;
    #[inline]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Storage for bf16 {
    const TYPE: StorageType = StorageType::Bf16;
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_bits(bf16_bits(x))
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// `x` rounded to bf16 (to nearest, ties to even), as bits; NaN stays a (quiet) NaN.
#[inline]
pub(crate) fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even; a carry into
    // the exponent is the right result (up to infinity).
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// Widens `src` into `dst` (same length): 8 at a time with F16C / AVX2 where the CPU has them.
pub(crate) fn widen<T: Storage>(src: &[T], dst: &mut [f32]) {
    debug_assert_eq!(src.len(), dst.len());
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    if T::TYPE == StorageType::F32 {
        dst.copy_from_slice(bytemuck::cast_slice(src));
        return;
    }
    let bits: &[u16] = bytemuck::cast_slice(src);
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX2 and F16C (checked); the slices have the same length.
        unsafe { x86::widen(T::TYPE == StorageType::F16, bits, dst) };
        return;
    }
    for (d, &b) in dst.iter_mut().zip(bits) {
        *d = match T::TYPE {
            StorageType::F16 => f16::from_bits(b).to_f32(),
            _ => f32::from_bits((b as u32) << 16),
        };
    }
}

/// Rounds `src` into `dst` (same length): 8 at a time with F16C / AVX2 where the CPU has them.
pub(crate) fn narrow<T: Storage>(src: &[f32], dst: &mut [T]) {
    debug_assert_eq!(src.len(), dst.len());
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    if T::TYPE == StorageType::F32 {
        bytemuck::cast_slice_mut(dst).copy_from_slice(src);
        return;
    }
    let bits: &mut [u16] = bytemuck::cast_slice_mut(dst);
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: the CPU has AVX2 and F16C (checked); the slices have the same length.
        unsafe { x86::narrow(T::TYPE == StorageType::F16, src, bits) };
        return;
    }
    for (d, &x) in bits.iter_mut().zip(src) {
        *d = match T::TYPE {
            StorageType::F16 => f16::from_f32(x).to_bits(),
            _ => bf16_bits(x),
        };
    }
}

/// The slice conversions in AVX2 + F16C; their 8-wide steps serve the generated AVX2 16-bit
/// depthwise kernels too.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use core::arch::x86_64::*;

    /// True if the CPU has AVX2 and F16C.
    #[inline]
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
    }

    /// f16 (`is_f16`) or bf16 bits widened to f32.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `dst` is at least as long as `src`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn widen(is_f16: bool, src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: elements `i..i + 8` are inside both slices.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), widen8(is_f16, h));
            }
            i += 8;
        }
        if i < n {
            // The last few through a vector too: a value at a time would be a software
            // conversion each (a 14x14 plane ends in 4).
            let (mut h, mut x) = ([0u16; 8], [0.0f32; 8]);
            h[..n - i].copy_from_slice(&src[i..n]);
            // SAFETY: the CPU has AVX2 and F16C (this function's contract); the loads and
            // stores cover the 8 elements of each local array.
            unsafe {
                let v = widen8(is_f16, _mm_loadu_si128(h.as_ptr() as *const __m128i));
                _mm256_storeu_ps(x.as_mut_ptr(), v);
            }
            dst[i..n].copy_from_slice(&x[..n - i]);
        }
    }

    /// 8 f16 (`is_f16`) or bf16 values widened.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) fn widen8(is_f16: bool, h: __m128i) -> __m256 {
        if is_f16 {
            _mm256_cvtph_ps(h)
        } else {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    /// f32 rounded (to nearest, ties to even) to f16 (`is_f16`) or bf16 bits.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `dst` is at least as long as `src`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn narrow(is_f16: bool, src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: elements `i..i + 8` are inside both slices.
            unsafe {
                let h = narrow8(is_f16, _mm256_loadu_ps(src.as_ptr().add(i)));
                _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
            }
            i += 8;
        }
        if i < n {
            // The last few through a vector too (see `widen`).
            let (mut x, mut h) = ([0.0f32; 8], [0u16; 8]);
            x[..n - i].copy_from_slice(&src[i..n]);
            // SAFETY: the CPU has AVX2 and F16C (this function's contract); the loads and
            // stores cover the 8 elements of each local array.
            unsafe {
                let v = narrow8(is_f16, _mm256_loadu_ps(x.as_ptr()));
                _mm_storeu_si128(h.as_mut_ptr() as *mut __m128i, v);
            }
            dst[i..n].copy_from_slice(&h[..n - i]);
        }
    }

    /// 8 f32 values rounded to nearest even f16 (`is_f16`) or bf16 bits.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(crate) fn narrow8(is_f16: bool, x: __m256) -> __m128i {
        if is_f16 {
            _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x)
        } else {
            // Add 0x7fff and the lowest kept bit; NaN stays a quiet NaN.
            let b = _mm256_castps_si256(x);
            let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
            let r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
            let q = _mm256_or_si256(b, _mm256_set1_epi32(0x40_0000));
            let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
            let r = _mm256_srli_epi32::<16>(_mm256_blendv_epi8(r, q, nan));
            let w = _mm256_packus_epi32(r, r);
            _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(w))
        }
    }
}

/// The f32 copy of `xs` (weights and bias at create time).
pub(crate) fn to_f32_vec<T: Storage>(xs: &[T]) -> Vec<f32> {
    xs.iter().map(|x| x.to_f32()).collect()
}

/// The floats a band's f32 input, output and residual take together (1 MiB), so that a band
/// stays in L2/L3 between its conversion and its use: at most this, or 4 times this for a band
/// of 12 rows (whole Winograd tiles), or one output row, whatever its size.
pub(crate) const BAND_FLOATS: usize = 1 << 18;

/// Floats rounded up to a cache line, so each region of the workspace stays 64-byte aligned.
fn lines(floats: usize) -> usize {
    floats.next_multiple_of(16)
}

/// How a planned convolution runs on 16-bit tensors through its f32 algorithm: bands of
/// `rows` output rows of one image, each with the f32 plan of its geometry.
pub(crate) struct Bands<P> {
    rows: usize,
    /// The distinct band geometries (top, middle, bottom, last) and their f32 plans.
    subs: Vec<(Geometry, P)>,
    /// Floats of the band buffers: input (`c_in x rows read x w`), output and residual.
    in_floats: usize,
    out_floats: usize,
    /// The most scratch floats any band's f32 plan needs.
    sub_floats: usize,
}

/// The geometry of output rows `oy0..oy1` of one image of `g`, and the first input row it
/// reads; `None` when those rows read only padding.
fn band_geometry(g: &Geometry, oy0: usize, oy1: usize) -> Option<(Geometry, usize)> {
    let span = ((g.kh - 1) * g.dh + 1) as isize;
    let start = (oy0 * g.sh) as isize - g.pad_top as isize;
    let end = ((oy1 - 1) * g.sh) as isize + span - g.pad_top as isize;
    let (lo, hi) = (start.max(0), end.min(g.h as isize));
    (hi > lo).then(|| {
        (
            Geometry {
                batch: 1,
                h: (hi - lo) as usize,
                pad_top: (lo - start) as usize,
                pad_bottom: (end - hi) as usize,
                oh: oy1 - oy0,
                ..*g
            },
            lo as usize,
        )
    })
}

impl<P> Bands<P> {
    /// Bands for `g`, each planned by `plan` (which also says its scratch floats).
    pub(crate) fn new(g: &Geometry, mut plan: impl FnMut(&Geometry) -> (P, usize)) -> Self {
        let per_row = (g.c_in * g.sh * g.w + 2 * g.c_out * g.ow).max(1);
        let fit = BAND_FLOATS / per_row;
        // Whole Winograd tiles (2, 4 or 6 rows: multiples of 12) and row blocks of the direct
        // kernels; 12 rows even past BAND_FLOATS while they take at most 4 times it (a band of
        // 4 rows would waste a third of F(6,3)'s tiles: vgg16_3x3_224 ran 150-160 GFLOP/s in
        // f16 against 170-230 in f32 before), else as many rows as fit.
        let rows = if fit >= g.oh {
            g.oh
        } else if fit >= 12 {
            fit / 12 * 12
        } else if 12 * per_row <= 4 * BAND_FLOATS {
            12.min(g.oh)
        } else if fit >= 4 {
            fit / 4 * 4
        } else {
            fit.max(1)
        };
        let mut subs: Vec<(Geometry, P)> = Vec::new();
        let (mut in_floats, mut sub_floats) = (0, 0);
        for oy0 in (0..g.oh).step_by(rows) {
            let oy1 = (oy0 + rows).min(g.oh);
            let Some((gb, _)) = band_geometry(g, oy0, oy1) else {
                continue;
            };
            in_floats = in_floats.max(gb.input_len());
            if !subs.iter().any(|(s, _)| *s == gb) {
                let (p, floats) = plan(&gb);
                sub_floats = sub_floats.max(floats);
                subs.push((gb, p));
            }
        }
        Bands {
            rows,
            subs,
            in_floats: lines(in_floats),
            out_floats: lines(g.c_out * rows * g.ow),
            sub_floats: lines(sub_floats),
        }
    }

    /// Workspace floats a run needs.
    pub(crate) fn workspace_floats(&self) -> usize {
        self.in_floats + 2 * self.out_floats + self.sub_floats
    }

    /// Runs `g` band by band: `run_f32(plan, band geometry, input, residual, output,
    /// scratch)` runs the f32 algorithm on one band's buffers.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run<I: Storage, O: Storage>(
        &self,
        g: &Geometry,
        input: &[I],
        residual: Option<&[O]>,
        output: &mut [O],
        bias: Option<&[f32]>,
        activation: Activation,
        scratch: &mut [f32],
        run_f32: impl Fn(&P, &Geometry, &[f32], Option<&[f32]>, &mut [f32], &mut [f32]),
    ) {
        let (xin, rest) = scratch.split_at_mut(self.in_floats);
        let (yout, rest) = rest.split_at_mut(self.out_floats);
        let (rband, sub) = rest.split_at_mut(self.out_floats);
        let nchw = g.layout == crate::Layout::Nchw;
        for n in 0..g.batch {
            for oy0 in (0..g.oh).step_by(self.rows) {
                let oy1 = (oy0 + self.rows).min(g.oh);
                let rb = oy1 - oy0;
                let out_len = g.c_out * rb * g.ow;
                // (offset in the output, offset in the band, floats): the band's runs of
                // contiguous outputs, one a channel (NCHW) or one in all (NHWC).
                let out_runs = |c: usize| {
                    if nchw {
                        (
                            ((n * g.c_out + c) * g.oh + oy0) * g.ow,
                            c * rb * g.ow,
                            rb * g.ow,
                        )
                    } else {
                        ((n * g.oh + oy0) * g.ow * g.c_out, 0, out_len)
                    }
                };
                let out_count = if nchw { g.c_out } else { 1 };
                let res = residual.map(|r| {
                    for c in 0..out_count {
                        let (o, b, len) = out_runs(c);
                        widen(&r[o..o + len], &mut rband[b..b + len]);
                    }
                    &rband[..out_len]
                });
                let y = &mut yout[..out_len];
                match band_geometry(g, oy0, oy1) {
                    Some((gb, lo)) => {
                        let (_, p) = self
                            .subs
                            .iter()
                            .find(|(s, _)| *s == gb)
                            .expect("every band's geometry was planned");
                        let x = &mut xin[..gb.input_len()];
                        if nchw {
                            let plane = gb.h * g.w;
                            for c in 0..g.c_in {
                                let s = ((n * g.c_in + c) * g.h + lo) * g.w;
                                widen(&input[s..s + plane], &mut x[c * plane..(c + 1) * plane]);
                            }
                        } else {
                            let s = (n * g.h + lo) * g.w * g.c_in;
                            widen(&input[s..s + x.len()], x);
                        }
                        run_f32(p, &gb, x, res, y, sub);
                    }
                    None => {
                        // Rows that read only padding: bias, residual and activation.
                        for (i, v) in y.iter_mut().enumerate() {
                            let c = if nchw { i / (rb * g.ow) } else { i % g.c_out };
                            let mut s = bias.map_or(0.0, |b| b[c]);
                            if let Some(r) = res {
                                s += r[i];
                            }
                            *v = activation.apply(s);
                        }
                    }
                }
                for c in 0..out_count {
                    let (o, b, len) = out_runs(c);
                    narrow(&y[b..b + len], &mut output[o..o + len]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        for x in [
            1.0f32,
            -3.5,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            1e-40,
            3.4e38,
        ] {
            let want = bf16::from_f32(x);
            assert_eq!(bf16_bits(x), want.to_bits(), "{x}");
        }
        assert!(bf16::from_bits(bf16_bits(f32::NAN)).is_nan());
        assert_eq!(bf16_bits(f32::INFINITY), bf16::INFINITY.to_bits());
        // Ties: 1 + 2^-8 is half-way between 1 and 1 + 2^-7: to the even one, 1.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), bf16::from_f32(1.0).to_bits());
    }

    #[test]
    fn slice_conversions_match_the_scalar_ones() {
        // Ties, NaN, infinities, subnormals, overflow, at both ends; every length, so each
        // special value lands in the vector loop and in every position of a short tail.
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            7e4,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            1.0 + 1.0 / 2048.0,
            -0.0,
            65520.0,
        ];
        let ramp = (0..29).map(|i| (i as f32 - 14.0) * 0.013_7);
        let xs: Vec<f32> = specials
            .iter()
            .copied()
            .chain(ramp)
            .chain(specials)
            .collect();
        for n in 0..=xs.len() {
            let xs = &xs[..n];
            let mut h = vec![f16::ZERO; n];
            let mut b = vec![bf16::ZERO; n];
            narrow(xs, &mut h);
            narrow(xs, &mut b);
            for (i, &x) in xs.iter().enumerate() {
                let (wh, wb) = (f16::from_f32(x), bf16::from_bits(bf16_bits(x)));
                assert!(
                    h[i].to_bits() == wh.to_bits() || (x.is_nan() && h[i].is_nan()),
                    "{x} at {i} of {n}"
                );
                assert!(
                    b[i].to_bits() == wb.to_bits() || (x.is_nan() && b[i].is_nan()),
                    "{x} at {i} of {n}"
                );
            }
            let (mut fh, mut fb) = (vec![0.0; n], vec![0.0; n]);
            widen(&h, &mut fh);
            widen(&b, &mut fb);
            for i in 0..n {
                assert!(fh[i].to_bits() == h[i].to_f32().to_bits() || fh[i].is_nan());
                assert!(fb[i].to_bits() == b[i].to_f32().to_bits() || fb[i].is_nan());
            }
        }
    }

    #[test]
    fn slices_round_trip() {
        let xs: Vec<f32> = (0..100).map(|i| i as f32 * 0.37 - 11.0).collect();
        let mut h = vec![f16::ZERO; 100];
        narrow(&xs, &mut h);
        let mut back = vec![0.0; 100];
        widen(&h, &mut back);
        for (a, b) in xs.iter().zip(&back) {
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-11));
        }
    }
}
