//! The generic path: im2col + GEMM, for every convolution shape.
//!
//! The im2col matrix is never built whole: the GEMM driver asks for one block of it at a time,
//! so scratch memory is one cache block per thread whatever the image size.
//!
//! - NCHW: `C[c_out/g x pixels] = W[c_out/g x K] · im2col[K x pixels]` per image and group;
//!   the weights are the A operand, packed at create time; bias goes by row. The im2col block
//!   is B, and mostly it is not packed at all: the kernels' row-pointer variants read B rows
//!   from one shifted copy of the input per (channel, kx) that every ky shares (vertical
//!   stride 1), from one copy per (channel, stride phase) that taps share along x (1-D), or
//!   straight from the input (1x1, stride 1). Other shapes fill the im2col rows of the block
//!   (or, for kernels without a row-pointer variant, packed panels); with stride 2-4 along x,
//!   the taps side by side are de-interleaved from one pass over the input.
//! - NHWC: `C[pixels x c_out/g] = im2col[pixels x K] · W^T[K x c_out/g]` over the whole batch
//!   per group, K ordered (ky, kx, ci) so each tap reads a contiguous run of channels; the
//!   weights are the B operand, packed at create time; bias goes by column.
//!
//! Groups and images are one more dimension of the parallel loop, not separate convolutions.

use super::{copy_run, for_each_item_claimed, zero_run, SendPtr};
use crate::buffer::AlignedBuf;
use crate::cpu::{self, Isa};
use crate::gemm::pack::{prepack, prepacked_len, Prepacked};
use crate::gemm::{gemm, BBlock, BlockB, Blocking, GemmKernel, Output, Panels, NC_MAX};
use crate::params::{mul, Geometry};
use crate::{Activation, ConvParams, Layout, Result};

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

    /// Splits the work into items that the workers claim as they go (see [`CLAIM_SPREAD`]).
    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> GemmPlan {
        let (mr, nr) = (self.kern.mr, self.kern.nr);
        let pixels = g.oh * g.ow;
        let (m, n, outer) = match self.layout {
            Layout::Nchw => (g.cout_g(), pixels, g.batch * g.groups),
            Layout::Nhwc => (g.batch * pixels, g.cout_g(), g.groups),
        };
        // NCHW K-blocks hold whole input channels, so stride-1 layers can share shifted copies.
        let align = match self.layout {
            Layout::Nchw if g.sh == 1 => g.kh * g.kw,
            _ => 1,
        };
        let t = threads.max(1);
        // Chunks start on micro-panel boundaries of the operand packed at create time; the
        // other may start anywhere, and the half-width and narrow edge kernels make a chunk's
        // last few columns cheap (at two threads, 784 pixels are two chunks of 24.5 panels).
        let gran = match (self.layout, self.kern.half, self.kern.narrow.last()) {
            (Layout::Nchw, Some(_), Some(nk)) => (mr, nk.cols),
            (Layout::Nchw, Some(_), None) => (mr, nr / 2),
            _ => (mr, nr),
        };
        // What a chunk of pixels repeats: nothing where a 1x1 stride-1 layer reads its B rows
        // in place, a shifted copy per kernel row (not per tap) at vertical stride 1.
        let pack = match self.layout {
            Layout::Nchw if self.kern.rows.is_some() && Im2colNchw::pointwise(g) => 0,
            Layout::Nchw if g.sh == 1 => PACK_COST.div_ceil(g.kh),
            _ => PACK_COST,
        };
        let (mchunk, nchunk) = split(m, n, self.k, outer, t, gran, self.layout, pack);
        // Several threads claim items as they go: a worker slowed down (another process on its
        // core, a small core) then takes fewer. So the even split is cut further along the
        // pixels, which costs no repeated packing, into items of at least CLAIM_MIN_PIXELS.
        let cut = |c: usize, g: usize| {
            let pieces = if t > 1 {
                (c / CLAIM_MIN_PIXELS).clamp(1, CLAIM_SPREAD)
            } else {
                1
            };
            c.div_ceil(pieces).div_ceil(g) * g
        };
        let (mchunk, nchunk) = match self.layout {
            Layout::Nchw => (mchunk, cut(nchunk, gran.1)),
            Layout::Nhwc => (cut(mchunk, gran.0), nchunk),
        };
        let (mchunks, nchunks) = (m.div_ceil(mchunk), n.div_ceil(nchunk));
        let items = outer * mchunks * nchunks;
        let workers = t.min(items);
        // NCHW: an item's C block (its rows x nc columns) is read and written once per K-block,
        // so it should stay in L2 beside the B block: at most C_BLOCK_FLOATS of it.
        let nc = match self.layout {
            Layout::Nchw => (C_BLOCK_FLOATS / mchunk.max(1)).clamp(4 * nr, NC_MAX),
            Layout::Nhwc => NC_MAX,
        };
        let blk = match self.layout {
            Layout::Nchw if self.kern.rows.is_some() => {
                Blocking::for_rows(self.kern, self.k, nc.min(nchunk), align)
            }
            _ => Blocking::new(self.kern, self.k, nc.min(nchunk), align),
        };
        let scratch_per_worker = match self.layout {
            Layout::Nchw => Im2colNchw::scratch(g, blk.kc, blk.nc, nr),
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
        let job = Job {
            plan,
            g,
            input,
            residual,
            out: SendPtr(output.as_mut_ptr()),
            bias,
            activation,
        };
        let items = plan.outer * plan.mchunks * plan.nchunks;
        let scratch = &mut scratch[..plan.workspace_floats()];
        for_each_item_claimed(plan.workers, items, scratch, |scratch, item| {
            // SAFETY: items write disjoint blocks of the output (distinct image/group, rows or
            // columns), which `output` covers: its length was checked. The kernel's ISA was
            // checked when the weights were packed.
            unsafe { self.run_item_isa(&job, scratch, item) };
        });
    }

    /// Runs one item with the driver and packers compiled for the kernel's ISA, so their
    /// copies use its vector width too.
    ///
    /// # Safety
    /// As [`Im2colGemm::run_item`], and the CPU must have the kernel's ISA.
    unsafe fn run_item_isa(&self, job: &Job, scratch: &mut [f32], item: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
            unsafe fn avx512(a: &Im2colGemm, job: &Job, scratch: &mut [f32], item: usize) {
                a.run_item(job, scratch, item)
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(a: &Im2colGemm, job: &Job, scratch: &mut [f32], item: usize) {
                a.run_item(job, scratch, item)
            }
            match self.kern.isa {
                Isa::Avx512 => return avx512(self, job, scratch, item),
                Isa::Avx2 => return avx2(self, job, scratch, item),
                _ => {}
            }
        }
        self.run_item(job, scratch, item)
    }

    /// One item: a block of rows and columns of one image/group.
    ///
    /// # Safety
    /// `job.out` must point to the whole output tensor, and no other thread may write this
    /// item's block during the call.
    #[inline(always)]
    unsafe fn run_item(&self, job: &Job, scratch: &mut [f32], item: usize) {
        let Job {
            plan,
            g,
            input,
            residual,
            out,
            bias,
            activation,
        } = *job;
        let outer = item / (plan.mchunks * plan.nchunks);
        let mi = item / plan.nchunks % plan.mchunks;
        let ni = item % plan.nchunks;
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
                    accumulate: false,
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
                    accumulate: false,
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

/// Floats of output one NCHW block may span (256 KiB: a quarter of Zen 4's L2).
const C_BLOCK_FLOATS: usize = 64 * 1024;

/// With several threads, each worker's even share is cut into up to this many items...
const CLAIM_SPREAD: usize = 4;
/// ...of at least this many output pixels. Cutting finer, across the channels too, cost small
/// layers up to 30% at two threads (resnet50_l4_3x3 0.70x, mobilenetv2_pw_expand 0.57x).
const CLAIM_MIN_PIXELS: usize = 256;

/// Packing one im2col element costs about as much as this many multiply-adds in the kernel
/// (a strided gather: about one cycle, while the kernel does 16 multiply-adds a cycle).
const PACK_COST: usize = 16;

/// Chooses the chunk sizes (rows, columns) of the work items: the split whose busiest worker
/// has the least to do, counting tile padding at the chunk edges and the im2col packing each
/// item repeats (`pack_cost` a packed element). With one worker that is one item per image and
/// group.
#[allow(clippy::too_many_arguments)]
fn split(
    m: usize,
    n: usize,
    k: usize,
    outer: usize,
    t: usize,
    (mgran, ngran): (usize, usize),
    layout: Layout,
    pack_cost: usize,
) -> (usize, usize) {
    let mut best = (usize::MAX, usize::MAX, m, n);
    for mch in 1..=m.div_ceil(mgran).min(8 * t) {
        for nch in 1..=n.div_ceil(ngran).min(8 * t) {
            let mchunk = m.div_ceil(mch).div_ceil(mgran) * mgran;
            let nchunk = n.div_ceil(nch).div_ceil(ngran) * ngran;
            let items = outer * m.div_ceil(mchunk) * n.div_ceil(nchunk);
            let packed = match layout {
                Layout::Nchw => nchunk,
                Layout::Nhwc => mchunk,
            };
            let item = mchunk * nchunk * k + pack_cost * packed * k;
            let cost = (items.div_ceil(t) * item, items);
            if cost < (best.0, best.1) {
                best = (cost.0, cost.1, mchunk, nchunk);
            }
        }
    }
    (best.2, best.3)
}

/// Everything one run shares between its items.
#[derive(Clone, Copy)]
struct Job<'a> {
    plan: &'a GemmPlan,
    g: &'a Geometry,
    input: &'a [f32],
    residual: Option<&'a [f32]>,
    out: SendPtr,
    bias: Option<&'a [f32]>,
    activation: Activation,
}

/// The NCHW im2col matrix of one image and group as the B operand: row k = (ci, ky, kx),
/// column = output pixel `col0 + j`.
///
/// With vertical stride 1, row (ci, ky, kx) is row (ci, 0, kx) shifted by `ky·dh` output rows.
/// So a K-block (whole input channels) is packed in two steps: one shifted copy of the input
/// per (ci, kx), with all the padding logic, then every micro-panel row is a plain fixed-size
/// copy out of it: `kh` times less work per element than im2col. A 1x1 stride-1 convolution
/// copies input rows straight into the panels. Other strides fill the panels directly.
struct Im2colNchw<'a> {
    /// The group's input channels of one image.
    input: &'a [f32],
    g: &'a Geometry,
    col0: usize,
}

/// Floats between two shifted copies: the pixels of the block plus `(kh-1)·dh` more output
/// rows, rounded to whole cache lines, and off any multiple of 4 KiB so that the rows one
/// micro-panel reads from several copies do not all fall on the same few L1 sets.
fn copy_len(g: &Geometry, padded: usize) -> usize {
    off_4k(padded + (g.kh - 1) * g.dh * g.ow)
}

/// `floats` rounded up to whole cache lines, moved off multiples of 4 KiB.
fn off_4k(floats: usize) -> usize {
    let len = floats.div_ceil(16) * 16;
    if len.is_multiple_of(1024) {
        len + 16
    } else {
        len
    }
}

impl Im2colNchw<'_> {
    /// True when K-blocks of `kc` rows from `k0` can use shifted copies (see the type's doc).
    fn shifted(g: &Geometry, k0: usize, kc: usize) -> bool {
        let taps = g.kh * g.kw;
        g.sh == 1 && g.kh > 1 && k0.is_multiple_of(taps) && kc.is_multiple_of(taps)
    }

    /// True for 1x1 stride-1 unpadded convolutions, whose B rows are the input channels.
    fn pointwise(g: &Geometry) -> bool {
        g.kh * g.kw == 1 && g.sh == 1 && g.sw == 1 && (g.oh, g.ow) == (g.h, g.w)
    }

    /// True for a single output row (1-D convolutions), where taps share copies along x.
    fn one_row(g: &Geometry) -> bool {
        g.kh == 1 && g.h == 1 && g.oh == 1 && g.pad_top == 0
    }

    /// Floats of scratch for a B block of `kc x nc` with micro-panels of `nr`: packed panels
    /// (and the shifted copies they are packed from), or the 1-D shifted copies, whichever the
    /// block uses.
    fn scratch(g: &Geometry, kc: usize, nc: usize, nr: usize) -> usize {
        let padded = nc.div_ceil(nr) * nr;
        let channels = kc / (g.kh * g.kw);
        // Panels, or im2col rows (see `block`).
        let mut floats = kc * off_4k(padded);
        if Self::shifted(g, 0, kc) {
            floats += channels * g.kw * copy_len(g, padded);
        }
        if Self::one_row(g) {
            floats = floats.max(channels * g.sw * one_row_copy_len(g, padded));
        }
        floats
    }

    /// The shifted copies of channels `ci0..ci0+nci` from output pixel `p0`: copy (i, kx) at
    /// `dst[(i·kw + kx)·lc..]` holds tap (ci0+i, 0, kx) for `lc` pixels; tap (ci, ky, kx) is the
    /// same copy `ky·dh` output rows further on.
    fn fill_copies(&self, dst: &mut [f32], ci0: usize, nci: usize, lc: usize, p0: usize) {
        let g = self.g;
        let same_width = g.sw == 1 && g.ow == g.w;
        for (j, copy) in dst.chunks_exact_mut(lc).take(nci * g.kw).enumerate() {
            let (ci, kx) = (ci0 + j / g.kw, j % g.kw);
            if same_width {
                self.fill_same_width(copy, ci, kx, p0);
            } else {
                self.fill(copy, ci, 0, kx, (p0 / g.ow, p0 % g.ow));
            }
        }
    }

    /// As `fill` for tap (ci, 0, kx) when the output rows are as wide as the input rows and
    /// the stride along x is 1 ("same" padding): the copy is then the channel's plane moved by
    /// a fixed offset, so it is one bulk copy, after which only the columns that the offset
    /// wraps around the row ends are zeroed. Row by row, `fill` spent about a cycle a float
    /// on 28-wide rows.
    #[inline(always)]
    fn fill_same_width(&self, dst: &mut [f32], ci: usize, kx: usize, p0: usize) {
        let g = self.g;
        let w = g.w as isize;
        let plane = &self.input[ci * g.h * g.w..][..g.h * g.w];
        // Pixel p0 + t reads plane[s0 + t], when that is inside the plane and its column is.
        let shift = (kx * g.dw) as isize - g.pad_left as isize;
        let s0 = p0 as isize - (g.pad_top * g.w) as isize + shift;
        let (len, n) = (dst.len() as isize, plane.len() as isize);
        let lo = (-s0).clamp(0, len);
        let hi = (n - s0).clamp(lo, len);
        let (lo, hi) = (lo as usize, hi as usize);
        // A copy that misses the plane entirely (a shift past its end, possible on tiny
        // images) has lo == hi and no valid `from`.
        if hi > lo {
            let from = (s0 + lo as isize) as usize;
            dst[lo..hi].copy_from_slice(&plane[from..from + (hi - lo)]);
        }
        dst[..lo].fill(0.0);
        dst[hi..].fill(0.0);
        // The columns whose shifted read falls off the row: the first -shift or the last shift.
        let cols = if shift < 0 {
            0..(-shift).min(w)
        } else {
            w - shift.min(w)..w
        };
        if cols.is_empty() {
            return;
        }
        let mut row = -((p0 % g.w) as isize);
        while row < len {
            for c in cols.clone() {
                if let Some(d) = usize::try_from(row + c).ok().and_then(|t| dst.get_mut(t)) {
                    *d = 0.0;
                }
            }
            row += w;
        }
    }

    /// `dst[t]` = row (ci, ky, kx) of the im2col matrix at the t-th output pixel from (oy, ox),
    /// for every t.
    /// Pixels past the last output row read below the image, which is zero padding.
    #[inline(always)]
    fn fill(&self, dst: &mut [f32], ci: usize, ky: usize, kx: usize, pix: (usize, usize)) {
        let sw = self.g.sw;
        for (run, row, ix0) in self.runs(dst.len(), (ci, ky, kx), pix) {
            fill_run(&mut dst[run], row, ix0, sw);
        }
    }

    /// The runs along one output row that `cnt` output pixels from (oy, ox) make: `run` the
    /// pixels' indices, `row` the input row tap row `ky` of channel `ci` reads there (`None`:
    /// padding), `ix0` the input column tap column `kx` reads at the run's first pixel. An
    /// iterator, not a closure taking the fill: a closure's body is compiled without the
    /// caller's target features where it is not inlined, and the de-interleave then ran
    /// scalar (the 4x4s4 stem 1.06-1.20x slower).
    #[inline(always)]
    fn runs(
        &self,
        cnt: usize,
        (ci, ky, kx): (usize, usize, usize),
        (oy, ox): (usize, usize),
    ) -> impl Iterator<Item = (std::ops::Range<usize>, Option<&[f32]>, isize)> + '_ {
        let g = self.g;
        let plane = &self.input[ci * g.h * g.w..][..g.h * g.w];
        let (mut oy, mut ox, mut j) = (oy, ox, 0);
        std::iter::from_fn(move || {
            if j >= cnt {
                return None;
            }
            let len = (cnt - j).min(g.ow - ox);
            let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
            let ix0 = (ox * g.sw + kx * g.dw) as isize - g.pad_left as isize;
            let row = (iy >= 0 && iy < g.h as isize).then(|| &plane[iy as usize * g.w..][..g.w]);
            let run = j..j + len;
            j += len;
            oy += 1;
            ox = 0;
            Some((run, row, ix0))
        })
    }

    /// Rows `k0..k0+kc` of the im2col matrix, `stride` floats apart in `dst`, each for the
    /// `cnt` output pixels from (oy, ox). Counters instead of divisions: in panels this runs
    /// once per 32 floats.
    #[inline(always)]
    fn fill_rows(
        &self,
        dst: &mut [f32],
        stride: usize,
        cnt: usize,
        k0: usize,
        kc: usize,
        pix: (usize, usize),
    ) {
        let g = self.g;
        let taps = g.kh * g.kw;
        let (mut ci, mut ky, mut kx) = (k0 / taps, k0 % taps / g.kw, k0 % g.kw);
        let mut kk = 0;
        while kk < kc {
            let row = &mut dst[kk * stride..];
            // Rows filled by this step: `sw` taps side by side read one span together.
            let together = g.dw == 1 && (2..=4).contains(&g.sw);
            let step = if together && kx + g.sw <= g.kw && kk + g.sw <= kc {
                let at = (ci, ky, kx);
                match g.sw {
                    2 => self.fill_taps::<2>(row, stride, cnt, at, pix),
                    3 => self.fill_taps::<3>(row, stride, cnt, at, pix),
                    _ => self.fill_taps::<4>(row, stride, cnt, at, pix),
                }
                g.sw
            } else {
                self.fill(&mut row[..cnt], ci, ky, kx, pix);
                1
            };
            kk += step;
            kx += step;
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

    /// Rows (ci, ky, kx + k) for every k < S of `dst` (rows of `r` floats; the first `cnt` of
    /// each), when the stride along x is S and the dilation 1: an output pixel's S taps are
    /// then S consecutive input floats, so one pass over each input span de-interleaves all S
    /// rows, where S separate gathers would each load the whole span.
    #[inline(always)]
    fn fill_taps<const S: usize>(
        &self,
        dst: &mut [f32],
        r: usize,
        cnt: usize,
        at: (usize, usize, usize),
        pix: (usize, usize),
    ) {
        let w = self.g.w as isize;
        let mut rows = dst.chunks_exact_mut(r);
        let mut rows: [&mut [f32]; S] = std::array::from_fn(|_| rows.next().unwrap_or_default());
        for (run, row, ix0) in self.runs(cnt, at, pix) {
            let len = run.len();
            let mut runs = rows.each_mut().map(|row| &mut row[run.clone()]);
            let Some(src) = row else {
                runs.into_iter().for_each(zero_run);
                continue;
            };
            let s = S as isize;
            // Pixels lo..hi read all S taps inside the row; the rest go one tap at a time.
            let lo = if ix0 >= 0 { 0 } else { (-ix0 + s - 1) / s }.min(len as isize);
            let hi = (w - ix0).div_euclid(s).clamp(lo, len as isize);
            let (lo, hi) = (lo as usize, hi as usize);
            let first = (ix0 + (lo * S) as isize) as usize;
            if hi > lo {
                deinterleave::<S>(&mut runs, lo, hi, &src[first..first + (hi - lo) * S]);
            }
            if lo > 0 || hi < len {
                for (k, run) in runs.into_iter().enumerate() {
                    let (head, tail) = run.split_at_mut(hi);
                    fill_run(&mut head[..lo], Some(src), ix0 + k as isize, S);
                    fill_run(tail, Some(src), ix0 + k as isize + (hi * S) as isize, S);
                }
            }
        }
    }
}

/// `runs[k][lo + t] = src[t·S + k]` for t < hi - lo: S interleaved rows pulled apart, 16
/// pixels at a time with sizes the compiler knows, so that it shuffles whole vectors (fewer
/// than 16 go through a block on the stack).
#[inline(always)]
fn deinterleave<const S: usize>(runs: &mut [&mut [f32]; S], lo: usize, hi: usize, src: &[f32]) {
    const T: usize = 16;
    /// Evens and odds of `N` floats: one two-source shuffle a vector.
    #[inline(always)]
    fn halves<const N: usize, const H: usize>(x: &[f32]) -> ([f32; H], [f32; H]) {
        let x: &[f32; N] = x.try_into().unwrap_or(&[0.0; N]);
        let (mut e, mut o) = ([0.0; H], [0.0; H]);
        for i in 0..H {
            (e[i], o[i]) = (x[2 * i], x[2 * i + 1]);
        }
        (e, o)
    }
    #[inline(always)]
    fn block<const S: usize>(src: &[f32]) -> [[f32; T]; S] {
        let mut x = [[0.0f32; T]; S];
        match S {
            // Two rounds of evens and odds: the compiler's own 4-way split is slower.
            4 => {
                let (e, o) = halves::<64, 32>(src);
                (x[0], x[2]) = halves::<32, 16>(&e);
                (x[1], x[3]) = halves::<32, 16>(&o);
            }
            _ => {
                for t in 0..T {
                    for k in 0..S {
                        x[k][t] = src[t * S + k];
                    }
                }
            }
        }
        x
    }
    let n = hi - lo;
    let mut outs = runs.each_mut().map(|run| &mut run[lo..hi]);
    if n >= T {
        // Whole blocks, the last one overlapping the one before where T does not divide n.
        let mut t0 = 0;
        loop {
            let x = block::<S>(&src[t0 * S..(t0 + T) * S]);
            for (out, xk) in outs.iter_mut().zip(&x) {
                out[t0..t0 + T].copy_from_slice(xk);
            }
            if t0 + T == n {
                break;
            }
            t0 = (t0 + T).min(n - T);
        }
    } else {
        let mut buf = [[0.0f32; T]; S];
        copy_run(&mut buf.as_flattened_mut()[..n * S], &src[..n * S]);
        for (out, xk) in outs.iter_mut().zip(&block::<S>(buf.as_flattened())) {
            copy_run(out, &xk[..n]);
        }
    }
}

/// `dst[t] = src[t·S]`: a strided gather with the stride known to the compiler, which then
/// vectorises it with shuffles instead of a scalar loop (5x faster for Whisper's stride 2).
#[inline(always)]
fn gather<const S: usize>(dst: &mut [f32], src: &[f32]) {
    let (chunks, rest) = src.as_chunks::<S>();
    let n = dst.len().min(chunks.len());
    for (d, c) in dst[..n].iter_mut().zip(chunks) {
        *d = c[0];
    }
    // The last element may sit in a partial chunk.
    if let (Some(d), Some(&x)) = (dst.get_mut(n), rest.first()) {
        *d = x;
    }
}

/// `run[t]` = `row[ix0 + t·sw]`, zero where that is outside the row (or there is no row: the
/// input row itself is padding).
#[inline(always)]
fn fill_run(run: &mut [f32], row: Option<&[f32]>, ix0: isize, sw: usize) {
    let Some(src) = row else {
        zero_run(run);
        return;
    };
    let (len, w, s) = (run.len() as isize, src.len() as isize, sw as isize);
    // Pixels lo..hi read inside the row; the rest is padding.
    let lo = if ix0 >= 0 {
        0
    } else {
        ((-ix0 + s - 1) / s).min(len) as usize
    };
    let hi = if ix0 >= w {
        lo
    } else {
        ((w - ix0 + s - 1) / s).clamp(lo as isize, len) as usize
    };
    if hi > lo {
        let first = (ix0 + lo as isize * s) as usize;
        if sw == 1 {
            copy_run(&mut run[lo..hi], &src[first..first + hi - lo]);
        } else {
            let (dst, src) = (&mut run[lo..hi], &src[first..]);
            match sw {
                2 => gather::<2>(dst, src),
                3 => gather::<3>(dst, src),
                4 => gather::<4>(dst, src),
                5 => gather::<5>(dst, src),
                _ => dst
                    .iter_mut()
                    .zip(src.chunks(sw))
                    .for_each(|(d, x)| *d = x[0]),
            }
        }
    }
    zero_run(&mut run[..lo]);
    zero_run(&mut run[hi..]);
}

/// Floats of one 1-D shifted copy: the block's pixels plus the largest tap shift, rounded to
/// whole cache lines (and off multiples of 4 KiB, as [`copy_len`]).
fn one_row_copy_len(g: &Geometry, padded: usize) -> usize {
    off_4k(padded + (g.kw - 1) * g.dw / g.sw)
}

impl BlockB for Im2colNchw<'_> {
    /// With vertical stride 1 and a row-pointer kernel, the shifted copies are the B block:
    /// row (ci, ky, kx) starts `ky·dh` output rows into copy (ci, kx), and no panel is packed.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        start: usize,
        len: usize,
        k0: usize,
        kc: usize,
        r: usize,
        dst: &mut [f32],
        rows: Option<&mut [*const f32]>,
    ) -> BBlock {
        let g = self.g;
        let taps = g.kh * g.kw;
        let aligned = k0.is_multiple_of(taps) && kc.is_multiple_of(taps);
        let p0 = self.col0 + start;
        let (ci0, nci) = (k0 / taps, kc / taps);
        match rows {
            Some(rows) if Self::shifted(g, k0, kc) => {
                let lc = copy_len(g, len.div_ceil(r) * r);
                self.fill_copies(dst, ci0, nci, lc, p0);
                for i in 0..nci {
                    for (tap, row) in rows[i * taps..(i + 1) * taps].iter_mut().enumerate() {
                        let (ky, kx) = (tap / g.kw, tap % g.kw);
                        *row = dst[(i * g.kw + kx) * lc + ky * g.dh * g.ow..].as_ptr();
                    }
                }
                BBlock::Rows { stride: r }
            }
            Some(rows)
                if Self::pointwise(g)
                    && (k0 + kc - 1) * g.h * g.w + p0 + len.div_ceil(r) * r <= self.input.len() =>
            {
                // 1x1, stride 1, no padding: the rows are the input channels themselves (the
                // columns past `len` read the next channel: they only feed columns never stored).
                for (kk, row) in rows[..kc].iter_mut().enumerate() {
                    *row = self.input[(k0 + kk) * g.h * g.w + p0..].as_ptr();
                }
                BBlock::Rows { stride: r }
            }
            Some(rows) if aligned && Self::one_row(g) => {
                // One output row (1-D): tap kx reads input x = p·sw + kx·dw, which is the copy
                // of phase (kx·dw mod sw) shifted by (kx·dw div sw) pixels, so taps that differ
                // by a multiple of the stride share one copy.
                let lc = one_row_copy_len(g, len.div_ceil(r) * r);
                let src = |ci: usize| &self.input[ci * g.w..][..g.w];
                for i in 0..nci {
                    for phase in 0..g.sw.min(g.kw * g.dw) {
                        let copy = &mut dst[(i * g.sw + phase) * lc..][..lc];
                        let ix0 = (p0 * g.sw + phase) as isize - g.pad_left as isize;
                        fill_run(copy, Some(src(ci0 + i)), ix0, g.sw);
                    }
                    for kx in 0..g.kw {
                        let (phase, shift) = (kx * g.dw % g.sw, kx * g.dw / g.sw);
                        rows[i * g.kw + kx] = dst[(i * g.sw + phase) * lc + shift..].as_ptr();
                    }
                }
                BBlock::Rows { stride: r }
            }
            Some(rows) if !Self::pointwise(g) => {
                // Every other shape: the im2col rows themselves, each filled in one pass over
                // the block's pixels (packing micro-panels cuts each row into runs of `r`).
                let lr = off_4k(len.div_ceil(r) * r);
                self.fill_rows(dst, lr, len, k0, kc, (p0 / g.ow, p0 % g.ow));
                for (kk, row) in rows[..kc].iter_mut().enumerate() {
                    *row = dst[kk * lr..].as_ptr();
                }
                BBlock::Rows { stride: r }
            }
            _ => {
                let (ptr, stride) = self.panels(start, len, k0, kc, r, dst);
                BBlock::Panels { ptr, stride }
            }
        }
    }
}

impl Panels for Im2colNchw<'_> {
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
        let g = self.g;
        let (taps, plane) = (g.kh * g.kw, g.h * g.w);
        let p0 = self.col0 + start;
        let padded = len.div_ceil(r) * r;
        let (panels, copies) = dst.split_at_mut(kc * padded);
        let pointwise = Self::pointwise(g);
        if Self::shifted(g, k0, kc) {
            let (ci0, nci, lc) = (k0 / taps, kc / taps, copy_len(g, padded));
            self.fill_copies(copies, ci0, nci, lc, p0);
            for (q, panel) in panels.chunks_exact_mut(kc * r).enumerate() {
                let mut rows = panel.chunks_exact_mut(r);
                for i in 0..nci {
                    for ky in 0..g.kh {
                        for kx in 0..g.kw {
                            let src =
                                &copies[(i * g.kw + kx) * lc + q * r + ky * g.dh * g.ow..][..r];
                            copy_run(rows.next().unwrap_or_default(), src);
                        }
                    }
                }
            }
        } else {
            let (mut oy, mut ox) = (p0 / g.ow, p0 % g.ow);
            for (q, panel) in panels.chunks_exact_mut(kc * r).enumerate() {
                let cnt = r.min(len - q * r);
                if pointwise {
                    // 1x1, stride 1, no padding: the rows of B are the input channels.
                    for (kk, row) in panel.chunks_exact_mut(r).enumerate() {
                        let src = &self.input[(k0 + kk) * plane + p0 + q * r..][..cnt];
                        copy_run(&mut row[..cnt], src);
                    }
                } else {
                    self.fill_rows(panel, r, cnt, k0, kc, (oy, ox));
                }
                if cnt < r {
                    panel
                        .chunks_exact_mut(r)
                        .for_each(|row| zero_run(&mut row[cnt..]));
                }
                ox += r;
                while ox >= g.ow {
                    ox -= g.ow;
                    oy += 1;
                }
            }
        }
        (panels.as_ptr(), kc * r)
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

#[cfg(test)]
mod tests {
    use super::Im2colGemm;
    use crate::{ConvParams, Isa, Layout, Padding};

    /// (items, pixel-direction chunk, pixels of the GEMM) of an 8->20 3x3 layer on two
    /// `hw`x`hw` images: NCHW runs a GEMM an image, NHWC one over both images.
    fn cut(layout: Layout, hw: usize, threads: usize) -> (usize, usize, usize) {
        let p = ConvParams::conv2d(8, 20, [3, 3])
            .with_padding(Padding::Same)
            .with_layout(layout);
        let conv = Im2colGemm::new(&p, &vec![0.0; 20 * 8 * 9], Isa::Scalar).unwrap();
        let g = p.geometry(2, hw, hw).unwrap();
        let plan = conv.plan(&g, threads);
        let items = plan.outer * plan.mchunks * plan.nchunks;
        match layout {
            Layout::Nchw => (items, plan.nchunk, plan.n),
            Layout::Nhwc => (items, plan.mchunk, plan.m),
        }
    }

    #[test]
    fn shares_are_cut_along_the_pixels_only_at_several_threads() {
        // One thread: one item per GEMM.
        assert_eq!(cut(Layout::Nchw, 45, 1).0, 2);
        assert_eq!(cut(Layout::Nhwc, 45, 1).0, 1);
        for layout in [Layout::Nchw, Layout::Nhwc] {
            // Two threads: each worker's 2025 pixels in four items of at least 256 pixels,
            // the last one ragged.
            let (items, chunk, pixels) = cut(layout, 45, 2);
            assert_eq!(items, 8, "{layout:?}");
            assert!(chunk >= 256 && pixels % chunk != 0, "{layout:?}: {chunk}");
            // 7x7 = 49 pixels a worker: too few to cut.
            assert_eq!(cut(layout, 7, 2).0, 2, "{layout:?}");
        }
    }
}
