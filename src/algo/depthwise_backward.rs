//! Depthwise backward kernels (groups == input channels, any channel multiplier `m`): the GEMM
//! formulation has one input channel a group and nothing to reuse, so these work on rows.
//!
//! - Backward data, NCHW: an input-gradient row gathers from the output-gradient rows its
//!   taps reach. With stride `s` each tap feeds one phase of the row (the columns `x ≡ r mod
//!   s`) with a contiguous multiply-add, so no work is spent on the zeros a strided
//!   formulation would insert; the phases are interleaved into the row at the end. The 3x3
//!   stride-2 layer with padding 1 ([`data_nchw_k3s2`]) makes two input rows at a time.
//! - Backward data, NHWC: per input pixel, a multiply-add over the channels per tap.
//! - Backward weights, NCHW: per output channel and tap, dot products of output-gradient rows
//!   with input rows; the input row is copied once, zero-padded and split into stride phases,
//!   so every tap reads it contiguously (3x3 at unit strides: four output rows and all nine
//!   taps a step). NHWC: per block of channels, the tap sums over the pixels with a
//!   multiply-add over the channels. Depthwise layers with one output a channel (either
//!   layout; NCHW only where the plane path loses) run blocks of 16 channels a pixel.
//!   The plane and blocked paths sum the bias gradient from the output gradient they read.
//!
//! Every kernel is compiled for the plan's ISA ([`isa_dispatch`]) and left to the compiler to
//! vectorise: the loops are contiguous multiply-adds. One exception: the blocked mode's
//! unit-stride tap-row pass has an AVX-512 version in intrinsics
//! ([`BlockPass::run_row_avx512`]), as the compiler's went through permutes.

use super::backward_gemm::{grad_bias, isa_dispatch, madd, plane_sum, taps_inside, Epilogue};
use super::{copy_run, for_each_worker, zero_run, SendPtr};
use crate::cpu::generated_layout::Transpose8x8;
use crate::cpu::Isa;
use crate::params::Geometry;
use crate::{ConvParams, Layout};

isa_dispatch!(fn data_nchw_at = data_nchw(
    plan: &DwBackwardPlan,
    g: &Geometry,
    weights: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    ep: &Epilogue,
    phases: &mut [f32],
    item: usize,
));
isa_dispatch!(fn data_nhwc_at = data_nhwc(
    plan: &DwBackwardPlan,
    g: &Geometry,
    weights: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    ep: &Epilogue,
    item: usize,
));
isa_dispatch!(fn weights_nchw_at = weights_nchw(
    plan: &DwBackwardPlan,
    g: &Geometry,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    db: Option<&mut f32>,
    accumulate: bool,
    scratch: &mut [f32],
    oc: usize,
));
isa_dispatch!(fn weights_blocked_at = weights_blocked(
    isa: Isa,
    t: Transpose8x8,
    g: &Geometry,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    bias: Option<&mut [f32]>,
    accumulate: bool,
    scratch: &mut [f32],
    item: usize,
));
isa_dispatch!(fn weights_nhwc_at = weights_nhwc(
    plan: &DwBackwardPlan,
    g: &Geometry,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    accumulate: bool,
    sums: &mut [f32],
    item: usize,
));

/// A depthwise convolution's weights for the backward kernels.
pub(crate) struct DwBackward {
    isa: Isa,
    transpose: Transpose8x8,
    /// NCHW: OIHW as given (`c_out x taps`); NHWC: tap-major (`taps x c_out`).
    weights: Vec<f32>,
    layout: Layout,
}

/// Workers, scratch and index tables of one run: the tables hold the divisions by the stride
/// the kernels would otherwise repeat for every row and tap.
#[derive(Clone, Debug)]
pub(crate) struct DwBackwardPlan {
    workers: usize,
    data_scratch: usize,
    weight_scratch: usize,
    /// For each (input row, tap row): the output row whose tap reaches it, or `NONE`.
    src_y: Vec<usize>,
    /// For each (input column, tap column): the output column, or `NONE` (NHWC).
    src_x: Vec<usize>,
    /// Per tap column (NCHW backward data): the stride phase of the input row it feeds and
    /// the output columns it reads.
    xtaps: Vec<XTap>,
    /// Per tap column (NCHW backward weights): the stride phase and offset of the padded input
    /// row it reads.
    wtaps: Vec<[usize; 2]>,
    /// Backward weights in blocks of `BLOCK` channels (depthwise, multiplier 1, scratch within
    /// `BLOCKED_MAX`).
    blocked: bool,
    /// NCHW backward weights through [`RowsPass`]es (see [`rows_pass`]).
    rows_pass: bool,
    /// NCHW backward data by [`data_nchw_k3s2`].
    k3s2: bool,
}

/// Tap column `kx` of an NCHW input row: column `x = phase + s·j` takes output column
/// `j + shift`, for `j` in `lo..hi`.
#[derive(Clone, Copy, Debug)]
struct XTap {
    phase: usize,
    shift: isize,
    lo: usize,
    hi: usize,
}

const NONE: usize = usize::MAX;

/// Lanes of the NCHW backward-weights partial sums: one AVX-512 vector, two AVX2 ones.
const LANES: usize = 16;

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
            transpose: crate::cpu::transpose_8x8(isa),
            weights,
            layout: p.layout,
        }
    }

    pub(crate) fn kernel_name(&self) -> String {
        format!("channel_backward_f32_{}", self.isa.name())
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> DwBackwardPlan {
        let k3s2 = self.layout == Layout::Nchw
            && (g.kh, g.kw, g.sh, g.sw, g.dh, g.dw) == (3, 3, 2, 2, 1, 1)
            && (g.pad_top, g.pad_left, g.cout_g()) == (1, 1, 1);
        let (data_items, mut weight_items, mut data_scratch, mut weight_scratch) = match self.layout
        {
            Layout::Nchw => (
                g.batch * g.c_in,
                g.c_out,
                g.sw * g.w.div_ceil(g.sw),
                g.oh * padded_ow(g)
                    + (padded_rows(g) + 1) * g.sw * phase_len(g)
                    + g.k_len() * LANES,
            ),
            Layout::Nhwc => (
                g.batch * g.h,
                g.c_out.div_ceil(NHWC_CHANNELS),
                0,
                g.kh * g.kw * NHWC_CHANNELS,
            ),
        };
        if k3s2 {
            data_scratch = 6 * k3s2_half(g) + 2;
        }
        let blocked_scratch = blocked_floats(g);
        let blocked = g.cin_g() == 1
            && g.cout_g() == 1
            && blocked_scratch <= BLOCKED_MAX
            && !(self.layout == Layout::Nchw && planes_win(g, self.isa));
        if blocked {
            (weight_items, weight_scratch) = (g.c_out.div_ceil(BLOCK), blocked_scratch);
        }
        // Output position `o` whose tap `k` lands on input position `i`: i + pad - k·d = o·s.
        let source = |i: usize, k: usize, pad: usize, d: usize, s: usize, outs: usize| {
            let t = (i + pad) as isize - (k * d) as isize;
            let o = t / s as isize;
            if t >= 0 && (t as usize).is_multiple_of(s) && (o as usize) < outs {
                o as usize
            } else {
                NONE
            }
        };
        let src_y = (0..g.h * g.kh)
            .map(|i| source(i / g.kh, i % g.kh, g.pad_top, g.dh, g.sh, g.oh))
            .collect();
        let src_x = (0..g.w * g.kw)
            .map(|i| source(i / g.kw, i % g.kw, g.pad_left, g.dw, g.sw, g.ow))
            .collect();
        let s = g.sw as isize;
        let xtaps = (0..g.kw)
            .map(|kx| {
                // x = ox·s + kx·dw − pad: phase (kx·dw − pad) mod s, and x = phase + s·j
                // takes ox = j + shift.
                let num = (kx * g.dw) as isize - g.pad_left as isize;
                let phase = num.rem_euclid(s) as usize;
                let shift = (phase as isize - num) / s;
                let len = (g.w - phase.min(g.w)).div_ceil(g.sw);
                let lo = (-shift).max(0) as usize;
                let hi = (g.ow as isize - shift).clamp(0, len as isize) as usize;
                XTap {
                    phase,
                    shift,
                    lo,
                    hi: hi.max(lo),
                }
            })
            .collect();
        let wtaps = (0..g.kw)
            .map(|kx| [kx * g.dw % g.sw, kx * g.dw / g.sw])
            .collect();
        DwBackwardPlan {
            workers: threads.clamp(1, data_items.max(weight_items)),
            data_scratch,
            weight_scratch,
            src_y,
            src_x,
            xtaps,
            wtaps,
            blocked,
            rows_pass: rows_pass(g, self.isa),
            k3s2,
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
            // one image (NHWC), which no other item writes; `dx` holds the whole tensor. The
            // ISA was checked against the CPU at create.
            unsafe {
                let dx = std::slice::from_raw_parts_mut(out.get(), g.input_len());
                match self.layout {
                    Layout::Nchw => {
                        data_nchw_at(self.isa, plan, g, w, dy, dx, accumulate, &ep, s, item)
                    }
                    Layout::Nhwc => {
                        data_nhwc_at(self.isa, plan, g, w, dy, dx, accumulate, &ep, item)
                    }
                }
            }
        });
    }

    /// `dw (+)= backward-weights(x, dy)`, and `db (+)= Σ dy` per output channel if given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_weights(
        &self,
        plan: &DwBackwardPlan,
        g: &Geometry,
        x: &[f32],
        dy: &[f32],
        dw: &mut [f32],
        mut db: Option<&mut [f32]>,
        accumulate: bool,
        scratch: &mut [f32],
    ) {
        let out = SendPtr(dw.as_mut_ptr());
        // The plane and blocked paths sum each channel's output gradient as they read it.
        let fused = plan.blocked || self.layout == Layout::Nchw;
        let bias = SendPtr(match &mut db {
            Some(db) if fused => db.as_mut_ptr(),
            _ => std::ptr::null_mut(),
        });
        let scratch = &mut scratch[..plan.workers * plan.weight_scratch];
        // Output channels an item takes.
        let per_item = match self.layout {
            _ if plan.blocked => BLOCK,
            Layout::Nchw => 1,
            Layout::Nhwc => NHWC_CHANNELS,
        };
        let (k_len, t) = (g.k_len(), self.transpose);
        assert!(dw.len() >= g.c_out * k_len && db.as_ref().is_none_or(|db| db.len() >= g.c_out));
        for_each_worker(
            plan.workers,
            g.c_out.div_ceil(per_item),
            scratch,
            |s, item| {
                let (first, count) = (item * per_item, per_item.min(g.c_out - item * per_item));
                // SAFETY: items take disjoint ranges of output channels, so their weights (and
                // bias gradients) are disjoint slices of `dw` (and `db`), inside them (assert
                // above).
                let (dw, db) = unsafe {
                    let dw =
                        std::slice::from_raw_parts_mut(out.get().add(first * k_len), count * k_len);
                    let db = bias.get();
                    let db = (!db.is_null())
                        .then(|| std::slice::from_raw_parts_mut(db.add(first), count));
                    (dw, db)
                };
                // SAFETY: the ISA was checked against the CPU at create.
                unsafe {
                    match self.layout {
                        _ if plan.blocked => weights_blocked_at(
                            self.isa, self.isa, t, g, x, dy, dw, db, accumulate, s, item,
                        ),
                        Layout::Nchw => {
                            let db = db.map(|db| &mut db[0]);
                            weights_nchw_at(self.isa, plan, g, x, dy, dw, db, accumulate, s, item)
                        }
                        Layout::Nhwc => {
                            weights_nhwc_at(self.isa, plan, g, x, dy, dw, accumulate, s, item)
                        }
                    }
                }
            },
        );
        if let Some(db) = db.filter(|_| !fused) {
            grad_bias(g, dy, db, accumulate);
        }
    }
}

/// Output columns rounded up to whole lanes (the zero-padded output-gradient row).
fn padded_ow(g: &Geometry) -> usize {
    g.ow.div_ceil(LANES) * LANES
}

/// Rows of the zero-padded input plane the taps read: `oy·sh + ky·dh` over every output row
/// and tap row.
fn padded_rows(g: &Geometry) -> usize {
    (g.oh - 1) * g.sh + (g.kh - 1) * g.dh + 1
}

/// Floats of one stride phase of a zero-padded input row: every column a tap reads for the
/// lane-padded output row, `j + (kx·dw)/sw` for `j < padded_ow`, rounded up to whole lanes
/// so that every row starts on a vector boundary.
fn phase_len(g: &Geometry) -> usize {
    (padded_ow(g) + (g.kw - 1) * g.dw / g.sw + 1).next_multiple_of(LANES)
}

/// Backward data of the common 3x3 stride-2 depthwise layer (padding 1 at the top and left,
/// one output a channel), two input rows at a time. With `A`, `B` the output-gradient rows
/// `i`, `i + 1` and `w` the taps row-major, input row `2i` is `w₄·A[j]` (even columns) and
/// `w₃·A[j+1] + w₅·A[j]` (odd), row `2i + 1` is `w₁·B[j] + w₇·A[j]` and
/// `w₀·B[j+1] + w₂·B[j] + w₆·A[j+1] + w₈·A[j]`: 9 multiply-adds for 4 inputs, every read a
/// whole vector of a zero-padded copy of the row. On dw3x3s2_112 it runs 1.8x the general
/// path, where perf put 40% of the time in the taps' multiply-adds over 56-float phase rows
/// and the rest in per-tap loop control, tails and the interleave.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn data_nchw_k3s2<const F: bool>(
    g: &Geometry,
    weights: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    ep: &Epilogue,
    scratch: &mut [f32],
    item: usize,
) {
    let (n, c) = (item / g.c_in, item % g.c_in);
    let half = k3s2_half(g);
    let (phases, rows) = scratch.split_at_mut(4 * half);
    let (e0, rest) = phases.split_at_mut(half);
    let (o0, rest) = rest.split_at_mut(half);
    let (e1, o1) = rest.split_at_mut(half);
    let (mut a, mut b) = rows[..2 * (half + 1)].split_at_mut(half + 1);
    let w = &weights[c * 9..][..9];
    let plane = &dy[(n * g.c_out + c) * g.oh * g.ow..][..g.oh * g.ow];
    let load = |dst: &mut [f32], i: usize| {
        dst.fill(0.0);
        if i < g.oh {
            let cols = g.ow.min(dst.len());
            dst[..cols].copy_from_slice(&plane[i * g.ow..][..cols]);
        }
    };
    load(b, 0);
    for i in 0..g.h.div_ceil(2) {
        std::mem::swap(&mut a, &mut b);
        load(b, i + 1);
        for j in 0..half {
            let (a0, a1, b0, b1) = (a[j], a[j + 1], b[j], b[j + 1]);
            e0[j] = a0 * w[4];
            o0[j] = madd::<F>(a1, w[3], a0 * w[5]);
            e1[j] = madd::<F>(b0, w[1], a0 * w[7]);
            o1[j] = madd::<F>(
                b1,
                w[0],
                madd::<F>(b0, w[2], madd::<F>(a1, w[6], a0 * w[8])),
            );
        }
        for (y, even, odd) in [(2 * i, &*e0, &*o0), (2 * i + 1, &*e1, &*o1)] {
            if y >= g.h {
                break;
            }
            let start = ((n * g.c_in + c) * g.h + y) * g.w;
            let row = &mut dx[start..][..g.w];
            interleave2(row, even, odd, accumulate);
            if !ep.is_empty() {
                ep.apply(row, c, start);
            }
        }
    }
}

/// Output-gradient columns [`data_nchw_k3s2`] makes a row: half the input row, rounded up to
/// whole vectors.
fn k3s2_half(g: &Geometry) -> usize {
    g.w.div_ceil(2).next_multiple_of(LANES)
}

/// `row (+)= even and odd interleaved`: a pattern the compiler vectorises with shuffles.
#[inline(always)]
fn interleave2(row: &mut [f32], even: &[f32], odd: &[f32], accumulate: bool) {
    let last_even = row.len() / 2;
    let mut pairs = row.chunks_exact_mut(2);
    let both = (&mut pairs).zip(even.iter().zip(odd));
    match accumulate {
        true => both.for_each(|(pair, (&a, &b))| {
            pair[0] += a;
            pair[1] += b;
        }),
        false => both.for_each(|(pair, (&a, &b))| {
            pair[0] = a;
            pair[1] = b;
        }),
    }
    if let [last] = pairs.into_remainder() {
        let v = even[last_even];
        *last = if accumulate { *last + v } else { v };
    }
}

/// One input channel of one image (NCHW): every row, gathered a stride phase at a time.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn data_nchw<const F: bool>(
    plan: &DwBackwardPlan,
    g: &Geometry,
    weights: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    accumulate: bool,
    ep: &Epilogue,
    phases: &mut [f32],
    item: usize,
) {
    if plan.k3s2 {
        return data_nchw_k3s2::<F>(g, weights, dy, dx, accumulate, ep, phases, item);
    }
    let (n, c) = (item / g.c_in, item % g.c_in);
    let (m, taps, s) = (g.cout_g(), g.kh * g.kw, g.sw);
    let per_phase = g.w.div_ceil(s);
    let phases = &mut phases[..s * per_phase];
    let plane = (n * g.c_in + c) * g.h * g.w;
    for iy in 0..g.h {
        phases.fill(0.0);
        for oc in c * m..(c + 1) * m {
            let wts = &weights[oc * taps..][..taps];
            for ky in 0..g.kh {
                let oy = plan.src_y[iy * g.kh + ky];
                if oy == NONE {
                    continue;
                }
                let dy_row = &dy[((n * g.c_out + oc) * g.oh + oy) * g.ow..][..g.ow];
                for (kx, t) in plan.xtaps.iter().enumerate() {
                    if t.lo >= t.hi {
                        continue;
                    }
                    let wv = wts[ky * g.kw + kx];
                    let dst = &mut phases[t.phase * per_phase..][t.lo..t.hi];
                    let src = &dy_row[(t.lo as isize + t.shift) as usize..][..t.hi - t.lo];
                    axpy::<F>(dst, src, wv);
                }
            }
        }
        let start = plane + iy * g.w;
        let row = &mut dx[start..][..g.w];
        if s == 1 {
            match accumulate {
                true => row.iter_mut().zip(&*phases).for_each(|(d, &v)| *d += v),
                false => row.copy_from_slice(phases),
            }
        } else if s == 2 {
            let (even, odd) = phases.split_at(per_phase);
            interleave2(row, even, odd, accumulate);
        } else {
            for (j, chunk) in row.chunks_mut(s).enumerate() {
                for (r, d) in chunk.iter_mut().enumerate() {
                    let v = phases[r * per_phase + j];
                    *d = if accumulate { *d + v } else { v };
                }
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
    plan: &DwBackwardPlan,
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
            let oy = plan.src_y[iy * g.kh + ky];
            if oy == NONE {
                continue;
            }
            for kx in 0..g.kw {
                let ox = plan.src_x[ix * g.kw + kx];
                if ox == NONE {
                    continue;
                }
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

/// One output channel's weight gradient (NCHW; any group with few channels, not only
/// depthwise). Per image: the output-gradient plane is copied once with its rows zero-padded
/// to whole lanes, and each input channel of the group once into a zero-padded plane of
/// stride phases (every row a tap row reads, each split into the `s` phases of its columns).
/// Then per tap row and block of up to four tap columns, one pass over the output rows
/// multiplies each lane-chunk of output gradient by the chunk each tap reads, into partial
/// sums that stay in registers for the whole pass (3x3 at unit strides: [`RowsPass`]es).
/// `dw` and `db` are the channel's own weight and bias gradients.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weights_nchw<const F: bool>(
    plan: &DwBackwardPlan,
    g: &Geometry,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    db: Option<&mut f32>,
    accumulate: bool,
    scratch: &mut [f32],
    oc: usize,
) {
    let (cin_g, s, taps) = (g.cin_g(), g.sw, g.kh * g.kw);
    let mut bias = 0.0f64;
    let c0 = oc / g.cout_g() * cin_g; // the group's first input channel
    let (owp, len, rows) = (padded_ow(g), phase_len(g), padded_rows(g));
    let (dy_plane, rest) = scratch.split_at_mut(g.oh * owp);
    let (plane, rest) = rest.split_at_mut(rows * s * len);
    let (padded, rest) = rest.split_at_mut(s * len);
    let sums = &mut rest[..cin_g * taps * LANES];
    sums.fill(0.0);
    for n in 0..g.batch {
        let dy_c = &dy[(n * g.c_out + oc) * g.oh * g.ow..][..g.oh * g.ow];
        if db.is_some() {
            bias += plane_sum(dy_c);
        }
        // Rows of whole lanes are read where they are.
        let dy_plane: &[f32] = if owp == g.ow {
            dy_c
        } else {
            for (dst, src) in dy_plane.chunks_exact_mut(owp).zip(dy_c.chunks_exact(g.ow)) {
                copy_run(&mut dst[..g.ow], src);
                zero_run(&mut dst[g.ow..]);
            }
            dy_plane
        };
        for ci in 0..cin_g {
            // plane[(pr·s + r)·len + j] = input[pr − pad_top][j·s + r − pad_left], zero
            // outside: each row zero-padded into `padded`, then split into its phases.
            let (xs, rest) = padded.split_at_mut(g.pad_left.min(s * len));
            xs.fill(0.0);
            let copied = g.w.min(rest.len());
            rest[copied..].fill(0.0);
            for pr in 0..rows {
                let dst = &mut plane[pr * s * len..][..s * len];
                let iy = pr as isize - g.pad_top as isize;
                if iy < 0 || iy as usize >= g.h {
                    dst.fill(0.0);
                    continue;
                }
                let row = &x[((n * g.c_in + c0 + ci) * g.h + iy as usize) * g.w..][..copied];
                if s == 1 {
                    zero_run(&mut dst[..g.pad_left.min(len)]);
                    copy_run(&mut dst[g.pad_left.min(len)..][..copied], row);
                    zero_run(&mut dst[(g.pad_left + copied).min(len)..]);
                    continue;
                }
                padded[g.pad_left.min(s * len)..][..copied].copy_from_slice(row);
                let (even, odd) = dst.split_at_mut(len);
                if s == 2 {
                    // 16 pixels at a time, a fixed-size shuffle the compiler vectorises.
                    for (src, e) in padded.chunks_exact(16).zip(even.chunks_exact_mut(8)) {
                        for i in 0..8 {
                            e[i] = src[2 * i];
                        }
                    }
                    for (src, o) in padded.chunks_exact(16).zip(odd.chunks_exact_mut(8)) {
                        for i in 0..8 {
                            o[i] = src[2 * i + 1];
                        }
                    }
                    let done = len / 8 * 8;
                    for j in done..len {
                        (even[j], odd[j]) = (padded[2 * j], padded[2 * j + 1]);
                    }
                } else {
                    for (j, chunk) in padded.chunks_exact(s).enumerate() {
                        for (r, &v) in chunk.iter().enumerate() {
                            dst[r * len + j] = v;
                        }
                    }
                }
            }
            if plan.rows_pass {
                // Three tap rows a pass (all of a 3x3 kernel), the last pass what is left.
                let pass = RowsPass {
                    g,
                    dy_plane,
                    plane,
                    owp,
                    len,
                };
                for ky0 in (0..g.kh).step_by(3) {
                    let acc = &mut sums[(ci * taps + ky0 * g.kw) * LANES..];
                    match (g.kh - ky0).min(3) {
                        3 => pass.run::<3, 3, F>(ky0, acc),
                        2 => pass.run::<2, 3, F>(ky0, acc),
                        _ => pass.run::<1, 3, F>(ky0, acc),
                    }
                }
                continue;
            }
            for ky in 0..g.kh {
                for kx0 in (0..g.kw).step_by(4) {
                    let pass = TapPass {
                        g,
                        dy_plane,
                        plane,
                        ky,
                        offsets: &plan.wtaps[kx0..],
                        owp,
                        len,
                    };
                    let acc = &mut sums[(ci * taps + ky * g.kw + kx0) * LANES..];
                    match g.kw - kx0 {
                        1 => pass.run::<1, F>(acc),
                        2 => pass.run::<2, F>(acc),
                        3 => pass.run::<3, F>(acc),
                        _ => pass.run::<4, F>(acc),
                    }
                }
            }
        }
    }
    let dst = &mut dw[..cin_g * taps];
    for (t, d) in dst.iter_mut().enumerate() {
        let v: f32 = sums[t * LANES..][..LANES].iter().sum();
        *d = if accumulate { *d + v } else { v };
    }
    if let Some(db) = db {
        *db = if accumulate {
            *db + bias as f32
        } else {
            bias as f32
        };
    }
}

/// Whether the NCHW plane path runs its tap sums as [`RowsPass`]es (3 tap rows at once; else
/// [`TapPass`]es): 3x3 kernels, unit strides and dilations, where the nine sums and four
/// output-gradient vectors stay in registers. Measured with `convkit bench --pass
/// backward-weights` (one thread, AMD EPYC Zen 4, interleaved A/B of three rounds, medians
/// and minima): at AVX-512 grouped and channel-multiplier 3x3 layers 7 to 56 wide 1.13-1.58x
/// (minima 0.98-1.54x); at AVX2 (twice the registers a sum: 18 of 16, spilled) 0.93-1.20x
/// (minima 0.80-0.95x), so there only images at least 64 wide (below).
fn rows_pass(g: &Geometry, isa: Isa) -> bool {
    let unit = g.sh == 1 && g.dh == 1 && g.sw == 1 && g.dw == 1;
    unit && g.kw == 3
        && match isa {
            Isa::Avx512 => true,
            Isa::Avx2 => g.ow >= 64,
            _ => false,
        }
}

/// Whether the plane path beats the blocked mode on an NCHW depthwise layer with one output
/// a channel (no transposes; the output gradient read in place where its rows are whole
/// lanes). Measured with `convkit bench --pass backward-weights` (one thread, AMD EPYC Zen 4,
/// 3x3 stride 1 on images 14 to 112 wide, two to three runs of three rounds, GFLOP/s planes
/// vs blocked): AVX-512 112 wide 33-45 vs 20-24, 64 34-39 vs 20-23, 56 20-28 vs 20-24, 32
/// 23-29 vs 19-22, 28 16-21 vs 17-21 (a tie: left blocked), 14 7-8 vs 12-16; AVX2 112 26-32
/// vs 22-25, 64 22-29 vs 21-26, 56 18-20 vs 20-23, 32 16-21 vs 19-24. NEON is not measured
/// and keeps the blocked mode.
fn planes_win(g: &Geometry, isa: Isa) -> bool {
    rows_pass(g, isa) && g.ow >= 32
}

/// Output rows a [`RowsPass`] step takes: each input row chunk loaded serves up to
/// `ROWS_AT_ONCE` of them, each output-gradient chunk every tap row of the pass.
const ROWS_AT_ONCE: usize = 4;

/// A pass of [`weights_nchw`] at unit strides and dilations: tap rows `ky0..ky0 + T`,
/// all `KW` tap columns, [`ROWS_AT_ONCE`] output rows a step. A step loads the rows' output
/// gradient once and each input row chunk once for every (output row, tap row) pair that
/// reads it: `R + (R + T − 1)·KW` loads for `R·T·KW` multiply-adds, where a tap row at a
/// time (`TapPass`) loads `R·(1 + KW)` for `R·KW`.
struct RowsPass<'a> {
    g: &'a Geometry,
    dy_plane: &'a [f32],
    plane: &'a [f32],
    owp: usize,
    len: usize,
}

impl RowsPass<'_> {
    /// `acc[(ky·kw + kx)·LANES + i] += Σ dy[oy][c·LANES + i] · x[oy + ky0 + ky][c·LANES + i +
    /// kx]` over every output row and lane chunk, for `ky < T`, `kx < KW`.
    #[inline(always)]
    fn run<const T: usize, const KW: usize, const F: bool>(&self, ky0: usize, acc: &mut [f32]) {
        let (g, owp, len) = (self.g, self.owp, self.len);
        // What the loops below read: dy rows 0..oh of owp floats, input rows ky0..ky0 + oh +
        // T − 1 of len floats, each to column owp + KW − 1 at most.
        assert!(
            self.dy_plane.len() >= g.oh * owp
                && self.plane.len() >= (ky0 + g.oh + T - 1) * len
                && owp.is_multiple_of(LANES)
                && owp + KW - 1 <= len
        );
        let mut lanes = [[[0.0f32; LANES]; KW]; T];
        let (dy, x) = (self.dy_plane.as_ptr(), self.plane[ky0 * len..].as_ptr());
        let full = g.oh / ROWS_AT_ONCE * ROWS_AT_ONCE;
        let mut oy = 0;
        while oy < g.oh {
            for c in (0..owp).step_by(LANES) {
                // SAFETY: rows oy..oy + R (R + T − 1 input rows) are below oh (oh + T − 1),
                // and c + LANES <= owp, c + KW − 1 + LANES <= len: inside the assert above.
                unsafe {
                    let (d, xs) = (dy.add(oy * owp + c), x.add(oy * len + c));
                    if oy < full {
                        rows::<ROWS_AT_ONCE, T, KW, F>(d, xs, owp, len, &mut lanes);
                    } else {
                        rows::<1, T, KW, F>(d, xs, owp, len, &mut lanes);
                    }
                }
            }
            oy += if oy < full { ROWS_AT_ONCE } else { 1 };
        }
        for (ky, row) in lanes.iter().enumerate() {
            add_chains(&mut acc[ky * g.kw * LANES..], row);
        }
    }
}

/// One lane chunk of `R` output rows into the tap sums of a [`RowsPass`]: the rows' output
/// gradients at `dy` (rows `owp` apart), the input rows their `T` tap rows read at `x` (rows
/// `len` apart).
///
/// # Safety
/// `dy` must be readable for `R` rows of `LANES` floats, `x` for `R + T − 1` rows of
/// `LANES + KW − 1`.
#[inline(always)]
unsafe fn rows<const R: usize, const T: usize, const KW: usize, const F: bool>(
    dy: *const f32,
    x: *const f32,
    owp: usize,
    len: usize,
    lanes: &mut [[[f32; LANES]; KW]; T],
) {
    // SAFETY: within the rows the caller vouches for.
    let d: [[f32; LANES]; R] =
        std::array::from_fn(|r| unsafe { *(dy.add(r * owp) as *const [f32; LANES]) });
    for ir in 0..R + T - 1 {
        // An index loop: iterating `lanes` or an array of the KW input vectors instead made
        // the compiler keep them in memory (2x slower).
        #[allow(clippy::needless_range_loop)]
        for kx in 0..KW {
            // SAFETY: as above.
            let xv = unsafe { *(x.add(ir * len + kx) as *const [f32; LANES]) };
            // Output row r meets this input row through tap row ir − r.
            for (r, dr) in d.iter().enumerate() {
                if ir >= r && ir - r < T {
                    madd_lanes::<F>(&mut lanes[ir - r][kx], dr, &xv);
                }
            }
        }
    }
}

/// One pass of [`weights_nchw`]: tap row `ky`, the tap columns whose (phase, offset) are
/// `offsets`, over every output row.
struct TapPass<'a> {
    g: &'a Geometry,
    dy_plane: &'a [f32],
    plane: &'a [f32],
    ky: usize,
    offsets: &'a [[usize; 2]],
    owp: usize,
    len: usize,
}

impl TapPass<'_> {
    /// `acc[q·LANES + i] += Σ over output rows and lane-chunks c of dy[c·LANES + i] ·
    /// tap_q[c·LANES + i]`, for `K` tap columns: `K` independent chains (twice as many
    /// registers at AVX2), in registers for the whole pass.
    #[inline(always)]
    fn run<const K: usize, const F: bool>(&self, acc: &mut [f32]) {
        let g = self.g;
        let (s, len) = (g.sw, self.len);
        let mut lanes = [[0.0f32; LANES]; K];
        let mut offs = [0usize; K];
        for (q, o) in offs.iter_mut().enumerate() {
            let [r, base] = self.offsets[q];
            *o = r * len + base;
        }
        for oy in 0..g.oh {
            let d = &self.dy_plane[oy * self.owp..][..self.owp];
            let phases = &self.plane[(oy * g.sh + self.ky * g.dh) * s * len..][..s * len];
            for c in 0..self.owp / LANES {
                let dc = &d[c * LANES..][..LANES];
                for q in 0..K {
                    madd_lanes::<F>(&mut lanes[q], dc, &phases[offs[q] + c * LANES..]);
                }
            }
        }
        add_chains(acc, &lanes);
    }
}

/// A block of output channels' weight gradients (NHWC): tap sums over every pixel, a
/// multiply-add over the block's channels, kept tap-major in `sums` and stored at the end.
/// `dw` holds the block's weight gradients.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weights_nhwc<const F: bool>(
    _plan: &DwBackwardPlan,
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
                for (tap, iy, ix) in taps_inside(g, oy, ox) {
                    let px = ((n * g.h + iy) * g.w + ix) * g.c_in;
                    let acc = &mut sums[tap * NHWC_CHANNELS..][..cc];
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
    for i in 0..cc {
        let dst = &mut dw[i * taps..][..taps];
        for (t, d) in dst.iter_mut().enumerate() {
            let v = sums[t * NHWC_CHANNELS + i];
            *d = if accumulate { *d + v } else { v };
        }
    }
}

/// Channels a blocked backward-weights item takes: a vector's worth of lanes.
const BLOCK: usize = LANES;
/// The most floats of scratch a blocked item may take (16 MiB); larger images run the row
/// kernels.
const BLOCKED_MAX: usize = 4 << 20;

/// (rows, columns) of the zero-padded input a blocked item copies for a band of `rows` output
/// rows: every position a tap reads.
fn blocked_extent(g: &Geometry, rows: usize) -> (usize, usize) {
    (
        (rows - 1) * g.sh + (g.kh - 1) * g.dh + 1,
        (g.ow - 1) * g.sw + (g.kw - 1) * g.dw + 1,
    )
}

/// Floats of input and output-gradient block a band may take (256 KiB): the band's blocks
/// stay in L2 while the tap-row passes go over them again, where a whole 112x112 image's
/// blocks of 16 channels (1.6 MB) would not.
const BAND_FLOATS: usize = 64 << 10;

/// Output rows of a blocked item's band.
fn band_rows(g: &Geometry) -> usize {
    let (_, wp) = blocked_extent(g, 1);
    (BAND_FLOATS / ((g.sh * wp + g.ow) * BLOCK)).clamp(1, g.oh)
}

/// Scratch floats of one blocked item: the padded input block and the output-gradient block
/// of a band, the tap sums, and (NCHW) the band's input rows as pixels before padding.
fn blocked_floats(g: &Geometry) -> usize {
    let rows = band_rows(g);
    let (hp, wp) = blocked_extent(g, rows);
    let stage = if staged_rows(g) { hp * g.w } else { 0 };
    (hp * wp + rows * g.ow + g.kh * g.kw + stage) * BLOCK
}

/// `BLOCK` depthwise channels' weight gradients (multiplier 1, either layout): per image, the
/// channels' input is copied into a zero-padded block of 16-channel pixels and their output
/// gradient into one of 16-channel pixels (NCHW through 8x8 transposes), then per tap row
/// and block of up to four tap columns one pass over the output pixels multiplies each
/// output-gradient pixel by the input pixel each tap reads, the sums in registers for the
/// whole pass. No lane is spent on padding however small the image. `dw` and `bias` hold the
/// block's weight and bias gradients.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn weights_blocked<const F: bool>(
    isa: Isa,
    t: Transpose8x8,
    g: &Geometry,
    x: &[f32],
    dy: &[f32],
    dw: &mut [f32],
    bias: Option<&mut [f32]>,
    accumulate: bool,
    scratch: &mut [f32],
    item: usize,
) {
    let band = band_rows(g);
    // The bias gradients of the block's channels (`bias` starts at the first): f32 lanes a
    // band, summed in f64.
    let mut bias_sums = [0.0f64; BLOCK];
    let (hp, wp) = blocked_extent(g, band);
    let taps = g.kh * g.kw;
    let c0 = item * BLOCK;
    let cc = BLOCK.min(g.c_out - c0);
    let (xb, rest) = scratch.split_at_mut(hp * wp * BLOCK);
    let (db, rest) = rest.split_at_mut(band * g.ow * BLOCK);
    let (sums, rest) = rest.split_at_mut(taps * BLOCK);
    sums.fill(0.0);
    let bands = g.oh.div_ceil(band);
    for i in 0..g.batch * bands {
        let (n, oy0) = (i / bands, i % bands * band);
        let rows = band.min(g.oh - oy0);
        let (hp, _) = blocked_extent(g, rows);
        let xb = &mut xb[..hp * wp * BLOCK];
        let db = &mut db[..rows * g.ow * BLOCK];
        fill_input_block(t, g, x, n, c0, cc, oy0 * g.sh, (hp, wp), xb, rest);
        fill_grad_block(t, g, dy, n, c0, cc, oy0 * g.ow, db);
        if bias.is_some() {
            let mut lanes = [0.0f32; BLOCK];
            for px in db.chunks_exact(BLOCK) {
                lanes.iter_mut().zip(px).for_each(|(l, &v)| *l += v);
            }
            bias_sums
                .iter_mut()
                .zip(lanes)
                .for_each(|(s, l)| *s += l as f64);
        }
        let (xb, db) = (&*xb, &*db);
        let pass = |t0| BlockPass {
            g,
            xb,
            db,
            wp,
            t0,
            rows,
        };
        // Unit stride and dilation along x: a tap row at a time, ROW_PIXELS output pixels
        // at a time, so that each input pixel loaded serves every tap that reads it.
        if g.sw == 1 && g.dw == 1 && (2..=9).contains(&g.kw) {
            for ky in 0..g.kh {
                let t0 = ky * g.kw;
                let acc = &mut sums[t0 * BLOCK..];
                let pass = pass(t0);
                #[cfg(not(target_arch = "x86_64"))]
                let _ = isa;
                #[cfg(target_arch = "x86_64")]
                if isa == Isa::Avx512 {
                    // SAFETY: the plan's ISA, checked against the CPU at create.
                    unsafe {
                        match g.kw {
                            2 => pass.run_row_avx512::<2>(acc),
                            3 => pass.run_row_avx512::<3>(acc),
                            4 => pass.run_row_avx512::<4>(acc),
                            5 => pass.run_row_avx512::<5>(acc),
                            6 => pass.run_row_avx512::<6>(acc),
                            7 => pass.run_row_avx512::<7>(acc),
                            8 => pass.run_row_avx512::<8>(acc),
                            _ => pass.run_row_avx512::<9>(acc),
                        }
                    }
                    continue;
                }
                match g.kw {
                    2 => pass.run_row::<2, F>(acc),
                    3 => pass.run_row::<3, F>(acc),
                    4 => pass.run_row::<4, F>(acc),
                    5 => pass.run_row::<5, F>(acc),
                    6 => pass.run_row::<6, F>(acc),
                    7 => pass.run_row::<7, F>(acc),
                    8 => pass.run_row::<8, F>(acc),
                    _ => pass.run_row::<9, F>(acc),
                }
            }
            continue;
        }
        // Taps in groups of at most 9 (3x3 in one pass; 5x5 9 + 9 + 7): that many independent
        // chains, each input pixel loaded once per tap.
        let group = taps.div_ceil(taps.div_ceil(9));
        for t0 in (0..taps).step_by(group) {
            let acc = &mut sums[t0 * BLOCK..];
            let pass = pass(t0);
            match group.min(taps - t0) {
                1 => pass.run::<1, F>(acc),
                2 => pass.run::<2, F>(acc),
                3 => pass.run::<3, F>(acc),
                4 => pass.run::<4, F>(acc),
                5 => pass.run::<5, F>(acc),
                6 => pass.run::<6, F>(acc),
                7 => pass.run::<7, F>(acc),
                8 => pass.run::<8, F>(acc),
                _ => pass.run::<9, F>(acc),
            }
        }
    }
    for i in 0..cc {
        let dst = &mut dw[i * taps..][..taps];
        for (tap, d) in dst.iter_mut().enumerate() {
            let v = sums[tap * BLOCK + i];
            *d = if accumulate { *d + v } else { v };
        }
    }
    if let Some(bias) = bias {
        for (d, &v) in bias.iter_mut().zip(&bias_sums[..cc]) {
            *d = if accumulate { *d + v as f32 } else { v as f32 };
        }
    }
}

/// `dst[i] += w·src[i]`. Rows under 64 floats (56 at stride 2 on a 112-wide image) go 16 and
/// then 8 floats at a time with sizes the compiler knows: its own loop, unrolled to 64 floats,
/// ran dw3x3s2_112's backward data 1.23x slower.
#[inline(always)]
fn axpy<const F: bool>(dst: &mut [f32], src: &[f32], w: f32) {
    #[inline(always)]
    fn fixed<const N: usize, const F: bool>(d: &mut [f32; N], s: &[f32; N], w: f32) {
        for i in 0..N {
            d[i] = madd::<F>(s[i], w, d[i]);
        }
    }
    let src = &src[..dst.len()];
    if dst.len() >= 64 {
        dst.iter_mut()
            .zip(src)
            .for_each(|(d, &v)| *d = madd::<F>(v, w, *d));
        return;
    }
    let (d16, dst) = dst.as_chunks_mut::<16>();
    let (s16, src) = src.as_chunks::<16>();
    d16.iter_mut()
        .zip(s16)
        .for_each(|(d, s)| fixed::<16, F>(d, s, w));
    let (d8, dst) = dst.as_chunks_mut::<8>();
    let (s8, src) = src.as_chunks::<8>();
    d8.iter_mut()
        .zip(s8)
        .for_each(|(d, s)| fixed::<8, F>(d, s, w));
    dst.iter_mut()
        .zip(src)
        .for_each(|(d, &v)| *d = madd::<F>(v, w, *d));
}

/// `l[i] += d[i]·x[i]` over one vector's worth of lanes.
#[inline(always)]
fn madd_lanes<const F: bool>(l: &mut [f32; LANES], d: &[f32], x: &[f32]) {
    let (d, x) = (&d[..LANES], &x[..LANES]);
    for i in 0..LANES {
        l[i] = madd::<F>(d[i], x[i], l[i]);
    }
}

/// Adds chain `q`'s lanes into `acc[q·LANES..]`.
#[inline(always)]
fn add_chains<const K: usize>(acc: &mut [f32], lanes: &[[f32; LANES]; K]) {
    for (q, l) in lanes.iter().enumerate() {
        acc[q * LANES..][..LANES]
            .iter_mut()
            .zip(l)
            .for_each(|(a, &v)| *a += v);
    }
}

/// One pass of [`weights_blocked`] over the taps `t0..t0 + K` (row-major over (ky, kx)) and
/// the `rows` output rows of a band.
struct BlockPass<'a> {
    g: &'a Geometry,
    xb: &'a [f32],
    db: &'a [f32],
    wp: usize,
    t0: usize,
    rows: usize,
}

impl BlockPass<'_> {
    /// `acc[q] += Σ over output pixels of dy[pixel] · x[the pixel's tap t0 + q]`, 16 channels
    /// a lane, `K` independent chains kept in registers.
    #[inline(always)]
    fn run<const K: usize, const F: bool>(&self, acc: &mut [f32]) {
        let (g, wp) = (self.g, self.wp);
        let mut offs = [0usize; K];
        for (q, o) in offs.iter_mut().enumerate() {
            let (ky, kx) = ((self.t0 + q) / g.kw, (self.t0 + q) % g.kw);
            *o = (ky * g.dh * wp + kx * g.dw) * BLOCK;
        }
        let reach = offs[K - 1] + BLOCK;
        let mut lanes = [[0.0f32; LANES]; K];
        for oy in 0..self.rows {
            for ox in 0..g.ow {
                let d = &self.db[(oy * g.ow + ox) * BLOCK..][..BLOCK];
                let base = (oy * g.sh * wp + ox * g.sw) * BLOCK;
                let xs = &self.xb[base..][..reach];
                for q in 0..K {
                    madd_lanes::<F>(&mut lanes[q], d, &xs[offs[q]..]);
                }
            }
        }
        add_chains(acc, &lanes);
    }

    /// [`run`](Self::run) over the `K` taps of one tap row (`t0` its first), for unit stride
    /// and dilation along x: [`ROW_PIXELS`] output pixels at a time (the last 1 to 3 of a
    /// row together), whose taps read `P + K - 1` consecutive input pixels, each loaded once
    /// for all of them.
    #[inline(always)]
    fn run_row<const K: usize, const F: bool>(&self, acc: &mut [f32]) {
        const P: usize = ROW_PIXELS;
        let (g, wp) = (self.g, self.wp);
        let ky = self.t0 / g.kw;
        // Two chains a tap (even and odd pixels): a 3-wide tap row's three chains alone would
        // wait on the multiply-add latency.
        let mut lanes = [[[0.0f32; LANES]; K]; 2];
        let full = g.ow / P * P;
        for oy in 0..self.rows {
            let drow = &self.db[oy * g.ow * BLOCK..][..g.ow * BLOCK];
            let xrow = &self.xb[(oy * g.sh + ky * g.dh) * wp * BLOCK..][..(g.ow + K - 1) * BLOCK];
            for (ds, xs) in drow[..full * BLOCK]
                .chunks_exact(P * BLOCK)
                .zip(xrow.windows((P + K - 1) * BLOCK).step_by(P * BLOCK))
            {
                row_pixels::<P, K, F>(ds, xs, &mut lanes);
            }
            let (ds, xs) = (&drow[full * BLOCK..], &xrow[full * BLOCK..]);
            match g.ow - full {
                0 => {}
                1 => row_pixels::<1, K, F>(ds, xs, &mut lanes),
                2 => row_pixels::<2, K, F>(ds, xs, &mut lanes),
                _ => row_pixels::<3, K, F>(ds, xs, &mut lanes),
            }
        }
        add_chains(acc, &lanes[0]);
        add_chains(acc, &lanes[1]);
    }

    /// [`BlockPass::run_row`] in AVX-512 registers, two output pixels a step (one chain set
    /// each) sharing the `K + 1` input pixels their taps read. The compiler's vectorisation of
    /// the portable loop assembled the input vectors from 8- and 16-byte pieces with
    /// permutes; this pass made dw3x3_28's and dw3x3_7's weight gradients 1.3x faster.
    ///
    /// # Safety
    /// The CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn run_row_avx512<const K: usize>(&self, acc: &mut [f32]) {
        use std::arch::x86_64::*;
        let (g, wp) = (self.g, self.wp);
        let ky = self.t0 / g.kw;
        let mut even = [_mm512_setzero_ps(); K];
        let mut odd = [_mm512_setzero_ps(); K];
        for oy in 0..self.rows {
            let d = &self.db[oy * g.ow * BLOCK..][..g.ow * BLOCK];
            let x = &self.xb[(oy * g.sh + ky * g.dh) * wp * BLOCK..][..(g.ow + K - 1) * BLOCK];
            let (d, x) = (d.as_ptr(), x.as_ptr());
            let mut p = 0;
            while p + 2 <= g.ow {
                // SAFETY: pixels p, p + 1 < ow of the output-gradient row (ow pixels) and
                // p..p + K + 1 <= ow + K − 1 of the input row, all of 16 floats.
                unsafe {
                    let d0 = _mm512_loadu_ps(d.add(p * BLOCK));
                    let d1 = _mm512_loadu_ps(d.add((p + 1) * BLOCK));
                    let mut xv = _mm512_loadu_ps(x.add(p * BLOCK));
                    for q in 0..K {
                        let next = _mm512_loadu_ps(x.add((p + q + 1) * BLOCK));
                        even[q] = _mm512_fmadd_ps(d0, xv, even[q]);
                        odd[q] = _mm512_fmadd_ps(d1, next, odd[q]);
                        xv = next;
                    }
                }
                p += 2;
            }
            if p < g.ow {
                // SAFETY: pixel p < ow, and p + K − 1 < ow + K − 1.
                unsafe {
                    let d0 = _mm512_loadu_ps(d.add(p * BLOCK));
                    for (q, e) in even.iter_mut().enumerate() {
                        *e = _mm512_fmadd_ps(d0, _mm512_loadu_ps(x.add((p + q) * BLOCK)), *e);
                    }
                }
            }
        }
        for (q, (e, o)) in even.iter().zip(&odd).enumerate() {
            let a = &mut acc[q * LANES..][..LANES];
            // SAFETY: `a` holds 16 floats.
            unsafe {
                let sum = _mm512_add_ps(_mm512_loadu_ps(a.as_ptr()), _mm512_add_ps(*e, *o));
                _mm512_storeu_ps(a.as_mut_ptr(), sum);
            }
        }
    }
}

/// `P` consecutive output pixels (`ds`) of a tap row of `K` taps, whose inputs are the `P + K −
/// 1` pixels at `xs`, into the even and odd pixels' chains.
#[inline(always)]
fn row_pixels<const P: usize, const K: usize, const F: bool>(
    ds: &[f32],
    xs: &[f32],
    lanes: &mut [[[f32; LANES]; K]; 2],
) {
    let (ds, xs) = (&ds[..P * BLOCK], &xs[..(P + K - 1) * BLOCK]);
    for j in 0..P + K - 1 {
        let x = &xs[j * BLOCK..][..LANES];
        for q in 0..K {
            if j >= q && j - q < P {
                let l = &mut lanes[(j - q) % 2][q];
                madd_lanes::<F>(l, &ds[(j - q) * BLOCK..], x);
            }
        }
    }
}

/// Output pixels a tap-row pass of the blocked weight gradient takes at a time: with a row's
/// (up to 9) chains and the input vector, the pixels' output gradients fit in registers.
const ROW_PIXELS: usize = 4;

/// Whether [`fill_input_block`] transposes an NCHW band's rows as one run: where the rows'
/// ragged ends (past a multiple of the transpose's 8 pixels) would be a large share of them.
/// Measured (one thread, Zen 4, 5 rounds, staged against not): dw7x7_14 1.11x; on rows of 28
/// the extra copy cost more than it saved (dw3x3_28 0.85x), on 56 10% (dw7x7_56).
fn staged_rows(g: &Geometry) -> bool {
    g.layout == Layout::Nchw && !g.w.is_multiple_of(8) && g.w < STAGED_BELOW
}
const STAGED_BELOW: usize = 16;

/// Channels `c0..c0 + cc` of image `n`'s input as zero-padded 16-channel pixels (`hp x wp`,
/// from padded row `pr0`: pixel (iy, ix) at (iy + pad_top - pr0, ix + pad_left), positions
/// no tap reads left out). NCHW rows go through the 8x8 transposes, a row at a time or (see
/// [`staged_rows`]) the band's rows, contiguous in each plane, as one run into `stage`
/// (`hp·w` pixels) and then row by row into place: a row at a time, rows narrower than the
/// transpose's 8 pixels (7x7 images) went element by element.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn fill_input_block(
    t: Transpose8x8,
    g: &Geometry,
    x: &[f32],
    n: usize,
    c0: usize,
    cc: usize,
    pr0: usize,
    (hp, wp): (usize, usize),
    xb: &mut [f32],
    stage: &mut [f32],
) {
    // Zeroes only what the copies leave: padding rows and columns, and the lanes of
    // channels past `cc` (a whole pass over the block cost 7% of dw3x3_112's weight gradient).
    if cc < BLOCK {
        xb.fill(0.0);
    }
    let cols = g.w.min(wp.saturating_sub(g.pad_left));
    // Input rows `iy0..iy1` land on block rows from `iy0 + pad_top - pr0`.
    let iy0 = pr0.saturating_sub(g.pad_top).min(g.h);
    let iy1 = (pr0 + hp).saturating_sub(g.pad_top).clamp(iy0, g.h);
    let staged = staged_rows(g);
    if staged && iy1 > iy0 {
        let (plane, len) = (g.h * g.w, (iy1 - iy0) * g.w);
        let stage = &mut stage[..len * BLOCK];
        if cc < BLOCK {
            stage.fill(0.0);
        }
        let first = |c: usize| (n * g.c_in + c0 + c) * plane + iy0 * g.w;
        to_block(
            t,
            cc,
            len,
            plane,
            stage,
            |c| &x[first(c)..],
            |c, p| x[first(c) + p],
        );
    }
    for r in 0..hp {
        let iy = (pr0 + r) as isize - g.pad_top as isize;
        let row = &mut xb[r * wp * BLOCK..][..wp * BLOCK];
        if iy < 0 || iy as usize >= g.h {
            row.fill(0.0);
            continue;
        }
        let left = g.pad_left.min(wp);
        row[..left * BLOCK].fill(0.0);
        row[(left + cols).min(wp) * BLOCK..].fill(0.0);
        let (iy, dst_row) = (iy as usize, r * wp + g.pad_left);
        let dst = &mut xb[dst_row * BLOCK..][..cols * BLOCK];
        match g.layout {
            Layout::Nhwc => {
                for (ix, d) in dst.chunks_exact_mut(BLOCK).enumerate() {
                    let src = &x[((n * g.h + iy) * g.w + ix) * g.c_in + c0..][..cc];
                    d[..cc].copy_from_slice(src);
                }
            }
            Layout::Nchw if staged => {
                dst.copy_from_slice(&stage[(iy - iy0) * g.w * BLOCK..][..cols * BLOCK]);
            }
            Layout::Nchw => {
                let plane = g.h * g.w;
                let first = (n * g.c_in + c0) * plane + iy * g.w;
                to_block(
                    t,
                    cc,
                    cols,
                    plane,
                    dst,
                    |c| &x[first + c * plane..],
                    |c, ix| x[first + c * plane + ix],
                );
            }
        }
    }
}

/// Channels `c0..c0 + cc` of image `n`'s output gradient as 16-channel pixels: the pixels
/// `p0..p0 + db.len() / 16`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn fill_grad_block(
    t: Transpose8x8,
    g: &Geometry,
    dy: &[f32],
    n: usize,
    c0: usize,
    cc: usize,
    p0: usize,
    db: &mut [f32],
) {
    let (pixels, len) = (g.oh * g.ow, db.len() / BLOCK);
    match g.layout {
        Layout::Nhwc => {
            for (p, d) in (p0..p0 + len).zip(db.chunks_exact_mut(BLOCK)) {
                let src = &dy[(n * pixels + p) * g.c_out + c0..][..cc];
                d[..cc].copy_from_slice(src);
                d[cc..].fill(0.0);
            }
        }
        Layout::Nchw => {
            if cc < BLOCK {
                db.fill(0.0);
            }
            let src = |c: usize, p: usize| dy[(n * g.c_out + c0 + c) * pixels + p0 + p];
            to_block(
                t,
                cc,
                len,
                pixels,
                db,
                |c| &dy[(n * g.c_out + c0 + c) * pixels + p0..],
                src,
            );
        }
    }
}

/// `len` consecutive positions of `cc` planes (plane `c` starting at `plane_at(c)`, planes
/// `stride` apart) into 16-channel pixels at `dst`: 8 channels x 8 positions through the
/// transpose kernel, the ragged rest through `at(c, position)`.
#[inline(always)]
fn to_block<'a>(
    t: Transpose8x8,
    cc: usize,
    len: usize,
    stride: usize,
    dst: &mut [f32],
    plane_at: impl Fn(usize) -> &'a [f32],
    at: impl Fn(usize, usize) -> f32,
) {
    let (c8, l8) = (cc / 8 * 8, len / 8 * 8);
    assert!(dst.len() >= len * BLOCK);
    for cb in (0..c8).step_by(8) {
        let src = plane_at(cb);
        assert!(src.len() >= 7 * stride + l8);
        for p0 in (0..l8).step_by(8) {
            // SAFETY: rows cb..cb+8 are `stride` floats apart and hold positions p0..p0+8
            // (asserted: 7 strides plus the row's length fit `src`); the destination's 8
            // pixels of 16 floats lie inside `dst` (asserted); the kernel runs on this CPU.
            unsafe {
                t(
                    src[p0..].as_ptr(),
                    stride,
                    dst[p0 * BLOCK + cb..].as_mut_ptr(),
                    BLOCK,
                )
            }
        }
        for p in l8..len {
            for c in cb..cb + 8 {
                dst[p * BLOCK + c] = at(c, p);
            }
        }
    }
    for c in c8..cc {
        for p in 0..len {
            dst[p * BLOCK + c] = at(c, p);
        }
    }
}
