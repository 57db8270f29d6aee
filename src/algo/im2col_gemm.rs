//! The generic path: im2col + GEMM, for every convolution shape.
//!
//! The im2col matrix is never built whole: the GEMM driver asks for one block of it at a time
//! and the packers below write that block straight into the micro-panel layout the kernel
//! reads, so scratch memory is one cache block per thread whatever the image size.
//!
//! - NCHW: `C[c_out/g x pixels] = W[c_out/g x K] · im2col[K x pixels]` per image and group;
//!   the weights are the A operand, packed at create time; bias goes by row.
//! - NHWC: `C[pixels x c_out/g] = im2col[pixels x K] · W^T[K x c_out/g]` over the whole batch
//!   per group, K ordered (ky, kx, ci) so each tap reads a contiguous run of channels; the
//!   weights are the B operand, packed at create time; bias goes by column.
//!
//! A 1x1 stride-1 unpadded convolution needs no im2col at all: its "im2col block" is a plain
//! copy of input rows (NCHW) or of pixels' channel runs (NHWC), which the packers detect.
//! Groups are one more dimension of the parallel loop, not separate convolutions.

use crate::buffer::AlignedBuf;
use crate::cpu::{self, Isa};
use crate::gemm::pack::{prepack, prepacked_len, Prepacked};
use crate::gemm::{gemm, Blocking, GemmKernel, Output, Panels, NC_MAX};
use crate::params::{mul, Geometry};
use crate::{Activation, ConvParams, Layout, Result};
use rayon::prelude::*;

/// Weights packed for the GEMM kernel of one ISA.
pub(crate) struct Im2colGemm {
    kern: &'static GemmKernel,
    packed: AlignedBuf,
    group_len: usize,
    k: usize,
    layout: Layout,
}

/// How one plan splits the work: `outer` x `mchunks` x `nchunks` items over `workers`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmPlan {
    blk: Blocking,
    m: usize,
    n: usize,
    outer: usize,
    mchunk: usize,
    nchunk: usize,
    mchunks: usize,
    nchunks: usize,
    workers: usize,
    scratch_per_worker: usize,
}

impl GemmPlan {
    pub(crate) fn workspace_floats(&self) -> usize {
        self.workers * self.scratch_per_worker
    }
}

impl Im2colGemm {
    pub(crate) fn new(p: &ConvParams, weights: &[f32], isa: Isa) -> Result<Self> {
        let kern = cpu::gemm_f32(isa);
        let (cin_g, cout_g, kh, kw) = (
            p.in_channels_per_group(),
            p.out_channels_per_group(),
            p.kernel[0],
            p.kernel[1],
        );
        let k = cin_g * kh * kw;
        let r = match p.layout {
            Layout::Nchw => kern.mr,
            Layout::Nhwc => kern.nr,
        };
        let group_len = prepacked_len(cout_g, k, r);
        let mut packed = AlignedBuf::zeroed(
            mul(&[group_len, p.groups], "packed weights")?,
            "packed weights",
        )?;
        for (g, dst) in packed
            .as_mut_slice()
            .chunks_exact_mut(group_len)
            .take(p.groups)
            .enumerate()
        {
            let w = &weights[g * cout_g * k..(g + 1) * cout_g * k];
            match p.layout {
                // Row = output channel, K in OIHW order: the weights as they are.
                Layout::Nchw => prepack(dst, cout_g, k, r, |co, kk| w[co * k + kk]),
                // Column = output channel, K in (ky, kx, ci) order.
                Layout::Nhwc => prepack(dst, cout_g, k, r, |co, kk| {
                    let (tap, ci) = (kk / cin_g, kk % cin_g);
                    w[(co * cin_g + ci) * kh * kw + tap]
                }),
            }
        }
        Ok(Im2colGemm {
            kern,
            packed,
            group_len,
            k,
            layout: p.layout,
        })
    }

    pub(crate) fn kernel_name(&self) -> &'static str {
        self.kern.name
    }

    /// Splits the work so every worker gets the same number of items where possible.
    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> GemmPlan {
        let (mr, nr) = (self.kern.mr, self.kern.nr);
        let pixels = g.oh * g.ow;
        let (m, n, outer) = match self.layout {
            Layout::Nchw => (g.cout_g(), pixels, g.batch * g.groups),
            Layout::Nhwc => (g.batch * pixels, g.cout_g(), g.groups),
        };
        let blk = Blocking::new(self.kern, self.k, NC_MAX);
        let t = threads.max(1);
        let (mchunk, nchunk) = split(m, n, self.k, outer, t, (mr, nr), self.layout);
        let (mchunks, nchunks) = (m.div_ceil(mchunk), n.div_ceil(nchunk));
        let items = outer * mchunks * nchunks;
        let workers = t.min(items);
        let blk = Blocking {
            nc: blk.nc.min(nchunk),
            ..blk
        };
        let scratch_per_worker = match self.layout {
            Layout::Nchw => blk.b_scratch(),
            Layout::Nhwc => blk.a_scratch(),
        };
        GemmPlan {
            blk,
            m,
            n,
            outer,
            mchunk,
            nchunk,
            mchunks,
            nchunks,
            workers,
            scratch_per_worker,
        }
    }

    /// Runs a planned convolution. Slice lengths were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &GemmPlan,
        g: &Geometry,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
        bias: Option<&[f32]>,
        activation: Activation,
        scratch: &mut [f32],
    ) {
        let out = SendPtr(output.as_mut_ptr());
        let items = plan.outer * plan.mchunks * plan.nchunks;
        let work = |w: usize, scratch: &mut [f32]| {
            for item in w * items / plan.workers..(w + 1) * items / plan.workers {
                let outer = item / (plan.mchunks * plan.nchunks);
                let mi = item / plan.nchunks % plan.mchunks;
                let ni = item % plan.nchunks;
                // SAFETY: items write disjoint blocks of the output (distinct image/group,
                // rows or columns), which `output` covers: its length was checked.
                unsafe {
                    self.run_item(
                        plan, g, input, residual, out, bias, activation, scratch, outer, mi, ni,
                    )
                };
            }
        };
        let scratch = &mut scratch[..plan.workspace_floats()];
        if plan.workers == 1 {
            work(0, scratch);
        } else {
            scratch
                .par_chunks_mut(plan.scratch_per_worker)
                .with_max_len(1)
                .enumerate()
                .for_each(|(w, s)| work(w, s));
        }
    }

    /// One item: rows `mi`, columns `ni` of image/group `outer`.
    ///
    /// # Safety
    /// `out` must point to the whole output tensor, and no other thread may write this item's
    /// block during the call.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run_item(
        &self,
        plan: &GemmPlan,
        g: &Geometry,
        input: &[f32],
        residual: Option<&[f32]>,
        out: SendPtr,
        bias: Option<&[f32]>,
        activation: Activation,
        scratch: &mut [f32],
        outer: usize,
        mi: usize,
        ni: usize,
    ) {
        let (m0, n0) = (mi * plan.mchunk, ni * plan.nchunk);
        let (mlen, nlen) = (plan.mchunk.min(plan.m - m0), plan.nchunk.min(plan.n - n0));
        let (kern, k) = (self.kern, self.k);
        let (cin_g, cout_g) = (g.cin_g(), g.cout_g());
        match self.layout {
            Layout::Nchw => {
                let (b, grp) = (outer / g.groups, outer % g.groups);
                let pixels = g.oh * g.ow;
                let weights =
                    &self.packed.as_slice()[grp * self.group_len + m0 / kern.mr * k * kern.mr..];
                let a = Prepacked { data: weights, k };
                let plane = g.h * g.w;
                let b_op = Im2colNchw {
                    input: &input[(b * g.c_in + grp * cin_g) * plane..][..cin_g * plane],
                    g,
                    col0: n0,
                };
                let first = (b * g.c_out + grp * cout_g + m0) * pixels + n0;
                let o = Output {
                    c: out.0.add(first),
                    rs_c: pixels as isize,
                    bias: bias.map(|x| &x[grp * cout_g + m0..][..mlen]),
                    bias_per_row: true,
                    residual: residual.map_or(std::ptr::null(), |r| r[first..].as_ptr()),
                    activation,
                };
                gemm(
                    kern,
                    &plan.blk,
                    mlen,
                    nlen,
                    k,
                    &a,
                    &b_op,
                    &o,
                    &mut [],
                    scratch,
                );
            }
            Layout::Nhwc => {
                let grp = outer;
                let a = Im2colNhwc {
                    input,
                    g,
                    group: grp,
                    row0: m0,
                };
                let weights =
                    &self.packed.as_slice()[grp * self.group_len + n0 / kern.nr * k * kern.nr..];
                let b_op = Prepacked { data: weights, k };
                let first = m0 * g.c_out + grp * cout_g + n0;
                let o = Output {
                    c: out.0.add(first),
                    rs_c: g.c_out as isize,
                    bias: bias.map(|x| &x[grp * cout_g + n0..][..nlen]),
                    bias_per_row: false,
                    residual: residual.map_or(std::ptr::null(), |r| r[first..].as_ptr()),
                    activation,
                };
                gemm(
                    kern,
                    &plan.blk,
                    mlen,
                    nlen,
                    k,
                    &a,
                    &b_op,
                    &o,
                    scratch,
                    &mut [],
                );
            }
        }
    }
}

/// Packing one im2col element costs about as much as this many multiply-adds in the kernel.
const PACK_COST: usize = 8;

/// Chooses the chunk sizes (rows, columns) of the work items: the split whose busiest worker
/// has the least to do, counting tile padding at the chunk edges and the im2col packing each
/// item repeats. With one worker that is one item per image and group.
fn split(
    m: usize,
    n: usize,
    k: usize,
    outer: usize,
    t: usize,
    (mr, nr): (usize, usize),
    layout: Layout,
) -> (usize, usize) {
    let mut best = (usize::MAX, usize::MAX, m, n);
    for mch in 1..=m.div_ceil(mr).min(8 * t) {
        for nch in 1..=n.div_ceil(nr).min(8 * t) {
            let mchunk = m.div_ceil(mch).div_ceil(mr) * mr;
            let nchunk = n.div_ceil(nch).div_ceil(nr) * nr;
            let items = outer * m.div_ceil(mchunk) * n.div_ceil(nchunk);
            let packed = match layout {
                Layout::Nchw => nchunk,
                Layout::Nhwc => mchunk,
            };
            let item = mchunk * nchunk * k + PACK_COST * packed * k;
            let cost = (items.div_ceil(t) * item, items);
            if cost < (best.0, best.1) {
                best = (cost.0, cost.1, mchunk, nchunk);
            }
        }
    }
    (best.2, best.3)
}

/// The output pointer, shared by the workers that write disjoint blocks of it.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: workers only write disjoint blocks (see `run`), so sharing the pointer is sound.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

/// Copies `src` into `dst` (same length); short fixed lengths become straight vector moves
/// instead of a `memcpy` call, which matters at 16 floats a call.
#[inline(always)]
fn copy_run(dst: &mut [f32], src: &[f32]) {
    match dst.len() {
        16 => dst[..16].copy_from_slice(&src[..16]),
        8 => dst[..8].copy_from_slice(&src[..8]),
        32 => dst[..32].copy_from_slice(&src[..32]),
        12 => dst[..12].copy_from_slice(&src[..12]),
        _ => dst.copy_from_slice(src),
    }
}

/// The NCHW im2col matrix of one image and group as the B operand: row k = (ci, ky, kx),
/// column = output pixel `col0 + j`.
struct Im2colNchw<'a> {
    /// The group's input channels of one image.
    input: &'a [f32],
    g: &'a Geometry,
    col0: usize,
}

impl Im2colNchw<'_> {
    /// One row of a micro-panel: pixels `p..p+row.len()` of tap (ci, ky, kx).
    #[inline(always)]
    fn fill(&self, row: &mut [f32], ci: usize, ky: usize, kx: usize, p: usize) {
        let g = self.g;
        let plane = &self.input[ci * g.h * g.w..][..g.h * g.w];
        let (mut oy, mut ox) = (p / g.ow, p % g.ow);
        let mut j = 0;
        while j < row.len() {
            let seg = (row.len() - j).min(g.ow - ox);
            let dst = &mut row[j..j + seg];
            let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
            if iy < 0 || iy >= g.h as isize {
                dst.fill(0.0);
            } else {
                let src = &plane[iy as usize * g.w..][..g.w];
                let ix0 = (ox * g.sw + kx * g.dw) as isize - g.pad_left as isize;
                if g.sw == 1 {
                    // Valid input columns are ix0+lo .. ix0+hi; zeros outside.
                    let lo = (-ix0).clamp(0, seg as isize) as usize;
                    let hi = (g.w as isize - ix0).clamp(lo as isize, seg as isize) as usize;
                    dst[..lo].fill(0.0);
                    if hi > lo {
                        copy_run(
                            &mut dst[lo..hi],
                            &src[(ix0 + lo as isize) as usize..][..hi - lo],
                        );
                    }
                    dst[hi..].fill(0.0);
                } else {
                    for (t, d) in dst.iter_mut().enumerate() {
                        let ix = ix0 + (t * g.sw) as isize;
                        *d = if ix >= 0 && ix < g.w as isize {
                            src[ix as usize]
                        } else {
                            0.0
                        };
                    }
                }
            }
            j += seg;
            oy += 1;
            ox = 0;
        }
    }
}

impl Panels for Im2colNchw<'_> {
    const PREPACKED: bool = false;
    fn panels(
        &self,
        start: usize,
        len: usize,
        k0: usize,
        kc: usize,
        r: usize,
        dst: &mut [f32],
    ) -> (*const f32, usize) {
        let g = self.g;
        let pointwise =
            g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && (g.oh, g.ow) == (g.h, g.w);
        let plane = g.h * g.w;
        for q in 0..len.div_ceil(r) {
            let p = self.col0 + start + q * r;
            let cnt = r.min(len - q * r);
            let panel = &mut dst[q * kc * r..(q + 1) * kc * r];
            if pointwise {
                // 1x1, stride 1, no padding: the rows of B are the input channels themselves.
                for (kk, row) in panel.chunks_exact_mut(r).enumerate() {
                    copy_run(&mut row[..cnt], &self.input[(k0 + kk) * plane + p..][..cnt]);
                    row[cnt..].fill(0.0);
                }
                continue;
            }
            let taps = g.kh * g.kw;
            let (mut ci, mut ky, mut kx) = (k0 / taps, k0 % taps / g.kw, k0 % g.kw);
            for row in panel.chunks_exact_mut(r) {
                self.fill(&mut row[..cnt], ci, ky, kx, p);
                row[cnt..].fill(0.0);
                kx += 1;
                if kx == g.kw {
                    kx = 0;
                    ky += 1;
                    if ky == g.kh {
                        ky = 0;
                        ci += 1;
                    }
                }
            }
        }
        (dst.as_ptr(), kc * r)
    }
}

/// The NHWC im2col matrix of one group over the whole batch as the A operand: row = output
/// pixel `row0 + i` (batch-major), column k = (ky, kx, ci).
struct Im2colNhwc<'a> {
    input: &'a [f32],
    g: &'a Geometry,
    group: usize,
    row0: usize,
}

impl Panels for Im2colNhwc<'_> {
    const PREPACKED: bool = false;
    fn panels(
        &self,
        start: usize,
        len: usize,
        k0: usize,
        kc: usize,
        r: usize,
        dst: &mut [f32],
    ) -> (*const f32, usize) {
        let g = self.g;
        let cin_g = g.cin_g();
        let pixels = g.oh * g.ow;
        for q in 0..len.div_ceil(r) {
            let panel = &mut dst[q * kc * r..(q + 1) * kc * r];
            for i in 0..r {
                if q * r + i >= len {
                    (0..kc).for_each(|kk| panel[kk * r + i] = 0.0);
                    continue;
                }
                let row = self.row0 + start + q * r + i;
                let (b, p) = (row / pixels, row % pixels);
                let (oy, ox) = (p / g.ow, p % g.ow);
                let (mut tap, mut ci) = (k0 / cin_g, k0 % cin_g);
                let mut kk = 0;
                while kk < kc {
                    let seg = (cin_g - ci).min(kc - kk);
                    let (ky, kx) = (tap / g.kw, tap % g.kw);
                    let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
                    let ix = (ox * g.sw + kx * g.dw) as isize - g.pad_left as isize;
                    let dst = panel[kk * r + i..].iter_mut().step_by(r).take(seg);
                    if iy < 0 || iy >= g.h as isize || ix < 0 || ix >= g.w as isize {
                        dst.for_each(|d| *d = 0.0);
                    } else {
                        let at = ((b * g.h + iy as usize) * g.w + ix as usize) * g.c_in
                            + self.group * cin_g
                            + ci;
                        dst.zip(&self.input[at..at + seg])
                            .for_each(|(d, s)| *d = *s);
                    }
                    kk += seg;
                    tap += 1;
                    ci = 0;
                }
            }
        }
        (dst.as_ptr(), kc * r)
    }
}
