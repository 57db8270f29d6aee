//! Depthwise backward kernels (groups == input channels, any channel multiplier `m`): the GEMM
//! formulation has one input channel a group and nothing to reuse, so these work on rows.
//!
//! - Backward data, NCHW: an input-gradient row gathers from the output-gradient rows its
//!   taps reach. With stride `s` each tap feeds one phase of the row (the columns `x ≡ r mod
//!   s`) with a contiguous multiply-add, so no work is spent on the zeros a strided
//!   formulation would insert; the phases are interleaved into the row at the end.
//! - Backward data, NHWC: per input pixel, a multiply-add over the channels per tap.
//! - Backward weights, NCHW: per output channel and tap, dot products of output-gradient rows
//!   with input rows; the input row is copied once, zero-padded and split into stride phases,
//!   so every tap reads it contiguously. NHWC: per block of channels, the tap sums over the
//!   pixels with a multiply-add over the channels.
//!
//! Every kernel is compiled for the plan's ISA ([`with_isa`]) and left to the compiler to
//! vectorise: the loops are contiguous multiply-adds.

use super::backward_gemm::{with_isa, Epilogue};
use super::{for_each_worker, SendPtr};
use crate::cpu::Isa;
use crate::params::Geometry;
use crate::{ConvParams, Layout};

/// `a·b + c`, fused where the ISA has FMA (`F`); a plain multiply-add in scalar code, where
/// `mul_add` would be a library call.
#[inline(always)]
fn madd<const F: bool>(a: f32, b: f32, c: f32) -> f32 {
    if F {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Runs `f::<true>` (FMA) or `f::<false>` compiled for `isa`.
macro_rules! at_isa {
    ($isa:expr, $f:ident ( $($arg:expr),* )) => {{
        let isa: Isa = $isa;
        // SAFETY: `isa` was checked against the CPU when the convolution was created.
        unsafe {
            with_isa(isa, || {
                if isa == Isa::Scalar {
                    $f::<false>($($arg),*)
                } else {
                    $f::<true>($($arg),*)
                }
            })
        }
    }};
}

/// A depthwise convolution's weights for the backward kernels.
pub(crate) struct DwBackward {
    isa: Isa,
    /// NCHW: OIHW as given (`c_out x taps`); NHWC: tap-major (`taps x c_out`).
    weights: Vec<f32>,
    layout: Layout,
}

/// Workers and scratch of one run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DwBackwardPlan {
    workers: usize,
    data_scratch: usize,
    weight_scratch: usize,
}

impl DwBackwardPlan {
    pub(crate) fn workspace_floats(&self) -> usize {
        self.workers * self.data_scratch.max(self.weight_scratch)
    }
}

/// Output channels a backward-weights NHWC item sums (its tap sums stay in L1).
const NHWC_CHANNELS: usize = 64;

impl DwBackward {
    /// `Some(reason)` if `params` is not depthwise.
    pub(crate) fn rejects(p: &ConvParams) -> Option<String> {
        (p.groups != p.in_channels).then(|| {
            format!(
                "groups ({}) is not the input channel count ({})",
                p.groups, p.in_channels
            )
        })
    }

    pub(crate) fn new(p: &ConvParams, weights: &[f32], isa: Isa) -> Self {
        let taps = p.kernel[0] * p.kernel[1];
        let weights = match p.layout {
            Layout::Nchw => weights.to_vec(),
            Layout::Nhwc => (0..taps * p.out_channels)
                .map(|i| weights[i % p.out_channels * taps + i / p.out_channels])
                .collect(),
        };
        DwBackward {
            isa,
            weights,
            layout: p.layout,
        }
    }

    pub(crate) fn kernel_name(&self) -> String {
        format!("dw_backward_f32_{}", self.isa.name())
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> DwBackwardPlan {
        let (data_items, weight_items, data_scratch, weight_scratch) = match self.layout {
            Layout::Nchw => (
                g.batch * g.c_in,
                g.c_out,
                g.sw * g.w.div_ceil(g.sw),
                g.sw * phase_len(g),
            ),
            Layout::Nhwc => (
                g.batch * g.h,
                g.c_out.div_ceil(NHWC_CHANNELS),
                0,
                g.kh * g.kw * NHWC_CHANNELS,
            ),
        };
        DwBackwardPlan {
            workers: threads.clamp(1, data_items.max(weight_items)),
            data_scratch,
            weight_scratch,
        }
    }

    /// `dx (+)= backward-data(dy)`, then the epilogue.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_data(
        &self,
        plan: &DwBackwardPlan,
        g: &Geometry,
        dy: &[f32],
        dx: &mut [f32],
        accumulate: bool,
        ep: Epilogue,
        scratch: &mut [f32],
    ) {
        let out = SendPtr(dx.as_mut_ptr());
        let w = &self.weights[..];
        let scratch = &mut scratch[..plan.workers * plan.data_scratch];
        let items = match self.layout {
            Layout::Nchw => g.batch * g.c_in,
            Layout::Nhwc => g.batch * g.h,
        };
        for_each_worker(plan.workers, items, scratch, |s, item| {
            // SAFETY: an item writes one input channel of one image (NCHW) or one input row of
            // one image (NHWC), which no other item writes; `dx` holds the whole tensor.
            let dx = unsafe { std::slice::from_raw_parts_mut(out.get(), g.input_len()) };
            match self.layout {
                Layout::Nchw => {
                    at_isa!(self.isa, data_nchw(g, w, dy, dx, accumulate, &ep, s, item))
                }
                Layout::Nhwc => at_isa!(self.isa, data_nhwc(g, w, dy, dx, accumulate, &ep, item)),
            }
        });
    }

    /// `dw (+)= backward-weights(x, dy)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_weights(
        &self,
        plan: &DwBackwardPlan,
        g: &Geometry,
        x: &[f32],
        dy: &[f32],
        dw: &mut [f32],
        accumulate: bool,
        scratch: &mut [f32],
    ) {
        let out = SendPtr(dw.as_mut_ptr());
        let scratch = &mut scratch[..plan.workers * plan.weight_scratch];
        let items = match self.layout {
            Layout::Nchw => g.c_out,
            Layout::Nhwc => g.c_out.div_ceil(NHWC_CHANNELS),
        };
        let len = g.c_out * g.kh * g.kw;
        for_each_worker(plan.workers, items, scratch, |s, item| {
            // SAFETY: an item writes the weights of its output channels only.
            let dw = unsafe { std::slice::from_raw_parts_mut(out.get(), len) };
            match self.layout {
                Layout::Nchw => at_isa!(self.isa, weights_nchw(g, x, dy, dw, accumulate, s, item)),
                Layout::Nhwc => at_isa!(self.isa, weights_nhwc(g, x, dy, dw, accumulate, s, item)),
            }
        });
    }
}

/// Floats of one stride phase of a zero-padded input row: every column a tap of an output row
/// reads, `ox + (kx·dw)/sw` for `ox < ow`.
fn phase_len(g: &Geometry) -> usize {
    g.ow + (g.kw - 1) * g.dw / g.sw + 1
}

/// The output row `oy` that tap row `ky` of input row `iy` comes from, if any.
#[inline(always)]
fn source_row(g: &Geometry, iy: usize, ky: usize) -> Option<usize> {
    let t = (iy + g.pad_top) as isize - (ky * g.dh) as isize;
    (t >= 0 && (t as usize).is_multiple_of(g.sh) && (t as usize / g.sh) < g.oh)
        .then(|| t as usize / g.sh)
}

/// One input channel of one image (NCHW): every row, gathered a stride phase at a time.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn data_nchw<const F: bool>(
    g: &Geometry,
    weights: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    ep: &Epilogue,
    phases: &mut [f32],
    item: usize,
) {
    let (n, c) = (item / g.c_in, item % g.c_in);
    let (m, taps, s) = (g.cout_g(), g.kh * g.kw, g.sw);
    let per_phase = g.w.div_ceil(s);
    let plane = (n * g.c_in + c) * g.h * g.w;
    for iy in 0..g.h {
        phases.fill(0.0);
        for oc in c * m..(c + 1) * m {
            let wts = &weights[oc * taps..][..taps];
            for ky in 0..g.kh {
                let Some(oy) = source_row(g, iy, ky) else {
                    continue;
                };
                let dy_row = &dy[((n * g.c_out + oc) * g.oh + oy) * g.ow..][..g.ow];
                for kx in 0..g.kw {
                    // Column x = ox·s + kx·dw − pad: phase r = (kx·dw − pad) mod s, and
                    // x = r + s·j takes ox = j + shift.
                    let num = (kx * g.dw) as isize - g.pad_left as isize;
                    let r = num.rem_euclid(s as isize) as usize;
                    let shift = (r as isize - num) / s as isize;
                    let len = (g.w - r).div_ceil(s);
                    let lo = (-shift).max(0) as usize;
                    let hi = (g.ow as isize - shift).clamp(0, len as isize) as usize;
                    if lo >= hi {
                        continue;
                    }
                    let wv = wts[ky * g.kw + kx];
                    let dst = &mut phases[r * per_phase..][lo..hi];
                    let src = &dy_row[(lo as isize + shift) as usize..][..hi - lo];
                    dst.iter_mut()
                        .zip(src)
                        .for_each(|(d, &v)| *d = madd::<F>(v, wv, *d));
                }
            }
        }
        let start = plane + iy * g.w;
        let row = &mut dx[start..][..g.w];
        if s == 1 {
            let src = &phases[..g.w];
            match accumulate {
                true => row.iter_mut().zip(src).for_each(|(d, &v)| *d += v),
                false => row.copy_from_slice(src),
            }
        } else {
            for (x, d) in row.iter_mut().enumerate() {
                let v = phases[x % s * per_phase + x / s];
                *d = if accumulate { *d + v } else { v };
            }
        }
        if !ep.is_empty() {
            ep.apply(row, c, start);
        }
    }
}

/// One input row of one image (NHWC): per pixel, a multiply-add over the channels per tap.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn data_nhwc<const F: bool>(
    g: &Geometry,
    weights: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    ep: &Epilogue,
    item: usize,
) {
    let (n, iy) = (item / g.h, item % g.h);
    let m = g.cout_g();
    for ix in 0..g.w {
        let start = ((n * g.h + iy) * g.w + ix) * g.c_in;
        let dst = &mut dx[start..][..g.c_in];
        if !accumulate {
            dst.fill(0.0);
        }
        for ky in 0..g.kh {
            let Some(oy) = source_row(g, iy, ky) else {
                continue;
            };
            for kx in 0..g.kw {
                let t = (ix + g.pad_left) as isize - (kx * g.dw) as isize;
                if t < 0 || !(t as usize).is_multiple_of(g.sw) || t as usize / g.sw >= g.ow {
                    continue;
                }
                let ox = t as usize / g.sw;
                let src = &dy[((n * g.oh + oy) * g.ow + ox) * g.c_out..][..g.c_out];
                let wts = &weights[(ky * g.kw + kx) * g.c_out..][..g.c_out];
                if m == 1 {
                    dst.iter_mut()
                        .zip(src.iter().zip(wts))
                        .for_each(|(d, (&v, &w))| *d = madd::<F>(v, w, *d));
                } else {
                    for (c, d) in dst.iter_mut().enumerate() {
                        for j in c * m..(c + 1) * m {
                            *d = madd::<F>(src[j], wts[j], *d);
                        }
                    }
                }
            }
        }
        if !ep.is_empty() {
            ep.apply_channels(dst, 0, start);
        }
    }
}

/// `Σ a·b` with 32 lanes of partial sums (four vectors' worth of independent chains).
#[inline(always)]
fn dot<const F: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 32];
    let (ac, bc) = (a.chunks_exact(32), b.chunks_exact(32));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(&x, &y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..32 {
            acc[i] = madd::<F>(x[i], y[i], acc[i]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// One output channel's weight gradient (NCHW): per image, output row and tap row, one dot
/// product per tap column against the zero-padded input row's stride phases.
#[inline(always)]
fn weights_nchw<const F: bool>(
    g: &Geometry,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    accumulate: bool,
    phases: &mut [f32],
    oc: usize,
) {
    let (m, s) = (g.cout_g(), g.sw);
    let c = oc / m;
    let len = phase_len(g);
    let taps = &mut dw[oc * g.kh * g.kw..][..g.kh * g.kw];
    if !accumulate {
        taps.fill(0.0);
    }
    for n in 0..g.batch {
        for oy in 0..g.oh {
            let dy_row = &dy[((n * g.c_out + oc) * g.oh + oy) * g.ow..][..g.ow];
            for ky in 0..g.kh {
                let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
                if iy < 0 || iy as usize >= g.h {
                    continue;
                }
                let row = &x[((n * g.c_in + c) * g.h + iy as usize) * g.w..][..g.w];
                // phases[r·len + j] = row[j·s + r − pad_left], zero outside the row.
                for r in 0..s {
                    for (j, v) in phases[r * len..][..len].iter_mut().enumerate() {
                        let ix = (j * s + r) as isize - g.pad_left as isize;
                        *v = if ix >= 0 && (ix as usize) < g.w {
                            row[ix as usize]
                        } else {
                            0.0
                        };
                    }
                }
                for kx in 0..g.kw {
                    let (r, base) = (kx * g.dw % s, kx * g.dw / s);
                    let src = &phases[r * len + base..][..g.ow];
                    taps[ky * g.kw + kx] += dot::<F>(dy_row, src);
                }
            }
        }
    }
}

/// A block of output channels' weight gradients (NHWC): tap sums over every pixel, a
/// multiply-add over the block's channels, kept tap-major in `sums` and stored at the end.
#[inline(always)]
fn weights_nhwc<const F: bool>(
    g: &Geometry,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    accumulate: bool,
    sums: &mut [f32],
    item: usize,
) {
    let (m, taps) = (g.cout_g(), g.kh * g.kw);
    let oc0 = item * NHWC_CHANNELS;
    let cc = NHWC_CHANNELS.min(g.c_out - oc0);
    let sums = &mut sums[..taps * NHWC_CHANNELS];
    sums.fill(0.0);
    for n in 0..g.batch {
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let d = &dy[((n * g.oh + oy) * g.ow + ox) * g.c_out + oc0..][..cc];
                for ky in 0..g.kh {
                    let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
                    if iy < 0 || iy as usize >= g.h {
                        continue;
                    }
                    for kx in 0..g.kw {
                        let ix = (ox * g.sw + kx * g.dw) as isize - g.pad_left as isize;
                        if ix < 0 || ix as usize >= g.w {
                            continue;
                        }
                        let px = ((n * g.h + iy as usize) * g.w + ix as usize) * g.c_in;
                        let acc = &mut sums[(ky * g.kw + kx) * NHWC_CHANNELS..][..cc];
                        if m == 1 {
                            let xs = &x[px + oc0..][..cc];
                            acc.iter_mut()
                                .zip(d.iter().zip(xs))
                                .for_each(|(a, (&dv, &xv))| *a = madd::<F>(dv, xv, *a));
                        } else {
                            for (i, a) in acc.iter_mut().enumerate() {
                                *a = madd::<F>(d[i], x[px + (oc0 + i) / m], *a);
                            }
                        }
                    }
                }
            }
        }
    }
    for i in 0..cc {
        let dst = &mut dw[(oc0 + i) * taps..][..taps];
        for (t, d) in dst.iter_mut().enumerate() {
            let v = sums[t * NHWC_CHANNELS + i];
            *d = if accumulate { *d + v } else { v };
        }
    }
}
