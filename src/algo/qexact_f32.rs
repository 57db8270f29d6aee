//! int8 convolutions with short sums through the f32 kernels, exactly.
//!
//! A grouped convolution with few channels a group (ResNeXt's 4) sums few products: the int8
//! GEMM's packed panels are mostly padding there, while the f32 direct kernels (NCHW, the
//! kernel sizes and strides the generator made) run such layers near peak. With `k` products of a centred input (`x - zero_point`, at most 255 in
//! magnitude) by an i8 weight (at most 128), every partial sum is an integer of magnitude at
//! most `k · 255 · 128`; for `k <= MAX_K` that is below 2^24, so f32 holds each one exactly,
//! in any order of summation and with or without FMA. The f32 direct convolution of the centred input therefore gives the exact integer sums, zero
//! padding standing for the zero point as it should; the bias and the int8 epilogue follow,
//! so the outputs equal the int8 kernels' bit for bit. Images run one at a time: the
//! workspace holds one image's input and output in f32, and the f32 plan's own.

use super::backward_gemm::isa_dispatch;
use super::qgemm::{requantize, QMode, QOut};
use super::zip_chunks;
use crate::cpu::Isa;
use crate::params::Geometry;
use crate::Result;
use crate::{Activation, Algorithm, Conv2d, ConvParams, Layout, Options, Plan, Precision};

/// The most products a sum may have: `MAX_K · 255 · 128 < 2^24`.
pub(crate) const MAX_K: usize = (1 << 24) / (255 * 128);

pub(crate) struct QExactF32 {
    /// The convolution on f32 tensors holding integers: the i8 weights, no bias, no epilogue.
    conv: Conv2d,
    /// The i32 bias as given (not folded: the input is centred instead).
    bias: Vec<i32>,
    /// The input zero point in u8 (i8 inputs are shifted by 128 on the way in).
    zu: u8,
    isa: Isa,
}

pub(crate) struct QExactF32Plan {
    plan: Plan,
    /// Workers of the passes before and after the f32 convolution.
    workers: usize,
}

impl QExactF32Plan {
    pub(crate) fn workspace_bytes(&self) -> usize {
        4 * (self.plan.input_len() + self.plan.output_len()) + self.plan.workspace_bytes()
    }
}

impl QExactF32 {
    /// Why the route cannot take `p` (None: it can).
    pub(crate) fn rejects(p: &ConvParams) -> Option<String> {
        let k = p.in_channels_per_group() * p.kernel[0] * p.kernel[1];
        (k > MAX_K).then(|| {
            format!(
                "a sum of {k} products could pass 2^24, where f32 stops holding every integer \
                 (at most {MAX_K})"
            )
        })
    }

    /// Through the f32 direct kernels: an `AlgorithmUnsupported` error where none takes `p`
    /// (they run NCHW, at the kernel sizes and strides the generator made).
    pub(crate) fn new(
        p: &ConvParams,
        weights: &[i8],
        bias: Option<&[i32]>,
        zu: u8,
        isa: Isa,
        options: &Options,
    ) -> Result<Self> {
        let mut params = *p;
        params.activation = Activation::None;
        let w: Vec<f32> = weights.iter().map(|&v| v as f32).collect();
        let opts = Options {
            algorithm: Some(Algorithm::Direct),
            kernel: None,
            precision: Precision::Exact,
            ..*options
        };
        Ok(QExactF32 {
            conv: Conv2d::new(params, &w, None, opts)?,
            bias: bias.map_or_else(|| vec![0; p.out_channels], <[i32]>::to_vec),
            zu,
            isa,
        })
    }

    pub(crate) fn kernel_name(plan: &QExactF32Plan) -> String {
        plan.plan.kernel_name()
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> Result<QExactF32Plan> {
        Ok(QExactF32Plan {
            // One image at a time: the f32 copies stay one image's size whatever the batch.
            plan: self.conv.plan(1, g.h, g.w)?,
            workers: threads,
        })
    }

    /// Runs a planned convolution (see [`QGemm::run`](super::qgemm::QGemm::run) for the
    /// arguments); `scratch` holds `plan.workspace_bytes()`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &QExactF32Plan,
        g: &Geometry,
        out: &QOut,
        input: &[u8],
        flip: u8,
        residual: Option<&[f32]>,
        output: &mut [u8],
        scratch: &mut [f32],
    ) {
        let (n_in, n_out) = (plan.plan.input_len(), plan.plan.output_len());
        let (x, rest) = scratch.split_at_mut(n_in);
        let (y, rest) = rest.split_at_mut(n_out);
        let (isa, zu) = (self.isa, self.zu);
        // Chunks of whole channel planes (NCHW) or whole pixels (NHWC).
        let run = match g.layout {
            Layout::Nchw => g.oh * g.ow,
            Layout::Nhwc => g.c_out,
        };
        let rows = CHUNK.div_ceil(run);
        let eb = out.elem_bytes();
        let zmm = isa == Isa::Avx512;
        for b in 0..g.batch {
            let image = &input[b * n_in..(b + 1) * n_in];
            zip_chunks(plan.workers, x, CHUNK, image, CHUNK, |_, x, input| {
                // SAFETY: the plan's ISA is one this CPU has (checked at create).
                unsafe { center_at(isa, input, flip, zu, x) }
            });
            plan.plan.run_scratch(x, None, y, rest);
            let o = &mut output[b * n_out * eb..(b + 1) * n_out * eb];
            let residual = residual.map(|r| &r[b * n_out..(b + 1) * n_out]);
            zip_chunks(
                plan.workers,
                o,
                rows * run * eb,
                y,
                rows * run,
                |i, o, y| {
                    let at = i * rows * run;
                    let res = residual.map(|r| &r[at..at + y.len()]);
                    // SAFETY: as above.
                    unsafe { epilogue_at(isa, y, &self.bias, out, g.layout, run, at, zmm, res, o) }
                },
            );
        }
    }
}

/// Elements a work item of the passes before and after the f32 convolution.
const CHUNK: usize = 16 * 1024;

isa_dispatch!(fn center_at = center(input: &[u8], flip: u8, zu: u8, x: &mut [f32]));

/// `x = (input ^ flip) - zu`, in f32.
#[inline(always)]
fn center<const F: bool>(input: &[u8], flip: u8, zu: u8, x: &mut [f32]) {
    let zu = zu as f32;
    for (d, &s) in x.iter_mut().zip(input) {
        *d = (s ^ flip) as f32 - zu;
    }
}

isa_dispatch!(fn epilogue_at = epilogue(
    y: &[f32],
    bias: &[i32],
    out: &QOut,
    layout: Layout,
    run: usize,
    at: usize,
    zmm: bool,
    residual: Option<&[f32]>,
    output: &mut [u8],
));

/// The int8 epilogue on the exact sums `y`, elements `at..` of the output (whole runs of
/// `run`: channel planes, or pixels), into `output` (and from `residual`) of the same
/// elements: the bias, then i32, f32 (scale, residual, activation) or requantised u8/i8
/// (`zmm`: requantised by [`requantize_plane_avx512`]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn epilogue<const F: bool>(
    y: &[f32],
    bias: &[i32],
    out: &QOut,
    layout: Layout,
    run: usize,
    at: usize,
    zmm: bool,
    residual: Option<&[f32]>,
    output: &mut [u8],
) {
    let cout = bias.len();
    #[cfg(not(target_arch = "x86_64"))]
    let _ = zmm;
    for (r, chunk) in y.chunks(run).enumerate() {
        let (i, res) = (
            r * run,
            residual.map(|x| &x[r * run..r * run + chunk.len()]),
        );
        match layout {
            Layout::Nchw => {
                let co = (at / run + r) % cout;
                #[cfg(target_arch = "x86_64")]
                if zmm && out.mode == QMode::Q8 {
                    // SAFETY: the CPU has AVX-512F/BW (`zmm`: the plan's ISA, checked at
                    // create); the plane of outputs has the length of the plane of sums.
                    let o = &mut output[i..i + chunk.len()];
                    unsafe { requantize_plane_avx512(chunk, bias[co], out.scale[co], out, o) };
                    continue;
                }
                let (b, s) = (
                    std::iter::repeat(bias[co]),
                    std::iter::repeat(out.scale[co]),
                );
                store(chunk, b, s, out, res, i, output);
            }
            Layout::Nhwc => {
                let (b, s) = (bias.iter().copied(), out.scale.iter().copied());
                store(chunk, b, s, out, res, i, output);
            }
        }
    }
}

/// Stores outputs `at..` of `output` from their sums `y` (and `residual`, of their length),
/// with the bias and scale of each.
#[inline(always)]
fn store(
    y: &[f32],
    bias: impl Iterator<Item = i32>,
    scale: impl Iterator<Item = f32>,
    out: &QOut,
    residual: Option<&[f32]>,
    at: usize,
    output: &mut [u8],
) {
    let n = y.len();
    let terms = y
        .iter()
        .zip(bias)
        .zip(scale)
        .map(|((&v, b), s)| (v as i32 + b, s));
    match out.mode {
        QMode::Q8 => {
            for (d, (v, s)) in output[at..at + n].iter_mut().zip(terms) {
                *d = requantize(v, s, out.lo, out.hi, out.zero_point) as u8;
            }
        }
        QMode::I32 => {
            let o: &mut [i32] = bytemuck::cast_slice_mut(&mut output[4 * at..4 * (at + n)]);
            for (d, (v, _)) in o.iter_mut().zip(terms) {
                *d = v;
            }
        }
        QMode::F32 => {
            let o: &mut [f32] = bytemuck::cast_slice_mut(&mut output[4 * at..4 * (at + n)]);
            for (i, (d, (v, s))) in o.iter_mut().zip(terms).enumerate() {
                *d = out
                    .activation
                    .apply(v as f32 * s + residual.map_or(0.0, |r| r[at + i]));
            }
        }
    }
}

/// [`requantize`] of `y + bias` into `o`, 16 at a time (the generated kernels' epilogue;
/// the compiler does not vectorise the saturating float-to-int casts).
///
/// # Safety
/// The CPU must have AVX-512F/BW; `o.len() == y.len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn requantize_plane_avx512(y: &[f32], bias: i32, scale: f32, out: &QOut, o: &mut [u8]) {
    use std::arch::x86_64::*;
    assert_eq!(y.len(), o.len());
    let (b, s) = (_mm512_set1_epi32(bias), _mm512_set1_ps(scale));
    let (lo, hi) = (_mm512_set1_ps(out.lo), _mm512_set1_ps(out.hi));
    let zp = _mm512_set1_epi32(out.zero_point);
    for at in (0..y.len()).step_by(16) {
        let m: __mmask16 = if y.len() - at >= 16 {
            !0
        } else {
            (1 << (y.len() - at)) - 1
        };
        // The sums are integers below 2^24: the truncating conversion is exact.
        let v = _mm512_add_epi32(
            _mm512_cvttps_epi32(_mm512_maskz_loadu_ps(m, y.as_ptr().add(at))),
            b,
        );
        let f = _mm512_min_ps(
            _mm512_max_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), s), lo),
            hi,
        );
        let q = _mm512_add_epi32(_mm512_cvtps_epi32(f), zp);
        _mm_mask_storeu_epi8(
            o.as_mut_ptr().add(at) as *mut i8,
            m,
            _mm512_cvtepi32_epi8(q),
        );
    }
}
