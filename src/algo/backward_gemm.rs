//! The GEMM formulations of the backward passes, for every shape that has no faster path.
//!
//! - **Backward data** (and transposed convolution): per image, group and block of input
//!   channels, `dcol = Wᵀ · dY` one tile of output pixels at a time, then col2im adds the tile
//!   into the input gradient. NCHW: `dcol[K_block x pixels]`, the weights are A (rows in
//!   (channel, tap) order); NHWC: `dcol[pixels x K_block]`, the weights are B (columns in
//!   (tap, channel) order, so col2im adds contiguous runs of channels). Both are packed at create
//!   time, a block of input channels at a time, so that a worker owns the input-gradient channels
//!   of its block and no two workers add into the same element. Scratch: one tile per worker.
//! - **Backward weights**: `dW_g[c_out/g x K] (+)= dY_g[c_out/g x (batch·pixels)] ·
//!   patches[(batch·pixels) x K]`. The patch matrix is never stored: the GEMM's B packer reads it
//!   straight from the input (im2col as the packing step), and the result lands in the OIHW
//!   gradient directly. Workers own blocks of K columns.

use super::{for_each_worker, SendPtr};
use crate::buffer::AlignedBuf;
use crate::cpu::{self, Isa};
use crate::gemm::pack::{prepack, prepacked_len, Prepacked, RowMajorA, RowMajorB};
use crate::gemm::{gemm, BlockB, Blocking, GemmKernel, Output, Panels, NC_MAX};
use crate::params::{mul, Geometry};
use crate::{Activation, ConvParams, Layout, Result};

/// Calls `f` in a function compiled for `isa`, so that the loops it inlines (packing, col2im)
/// use that ISA's vectors.
///
/// # Safety
/// The CPU must have `isa`.
#[inline(always)]
pub(crate) unsafe fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
        unsafe fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        match isa {
            Isa::Avx512 => return avx512(f),
            Isa::Avx2 => return avx2(f),
            _ => {}
        }
    }
    let _ = isa;
    f()
}

/// Rows (NCHW) or columns (NHWC) of `dcol` a block of input channels aims at: enough to keep
/// the kernel busy on a tile, few enough that blocks split the work between threads.
const BLOCK_ROWS: usize = 192;
/// Floats of one `dcol` tile (64 KiB: it is written by the GEMM and read back by col2im
/// while it is in L2).
const TILE_FLOATS: usize = 16 * 1024;

/// The weights of a backward-data GEMM, packed per group and block of input channels.
pub(crate) struct Col2imData {
    kern: &'static GemmKernel,
    packed: AlignedBuf,
    /// Input channels a block (the last one of a group may have fewer).
    chunk: usize,
    chunks: usize,
    chunk_len: usize,
    layout: Layout,
}

/// How a backward-data run splits: pixel tiles of `tile`, items (image, group, block).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Col2imPlan {
    blk: Blocking,
    tile: usize,
    workers: usize,
    scratch_per_worker: usize,
}

impl Col2imPlan {
    pub(crate) fn workspace_floats(&self) -> usize {
        self.workers * self.scratch_per_worker
    }
}

/// The epilogue a transposed convolution adds after col2im (empty for a gradient).
#[derive(Clone, Copy)]
pub(crate) struct Epilogue<'a> {
    pub bias: Option<&'a [f32]>,
    pub residual: Option<&'a [f32]>,
    pub activation: Activation,
}

impl Epilogue<'_> {
    pub(crate) fn is_empty(&self) -> bool {
        self.bias.is_none() && self.residual.is_none() && self.activation == Activation::None
    }

    /// Applies the epilogue to `values` (elements `start`, `start + step`, … of the tensor, all
    /// of channel `c`).
    #[inline(always)]
    pub(crate) fn apply(&self, values: &mut [f32], c: usize, start: usize) {
        if let Some(b) = self.bias {
            values.iter_mut().for_each(|v| *v += b[c]);
        }
        if let Some(r) = self.residual {
            values
                .iter_mut()
                .zip(&r[start..])
                .for_each(|(v, &r)| *v += r);
        }
        self.activation.apply_slice(values);
    }

    /// Applies the epilogue to channels `c0..c0 + values.len()` of one pixel (NHWC), elements
    /// `start..` of the tensor.
    #[inline(always)]
    pub(crate) fn apply_channels(&self, values: &mut [f32], c0: usize, start: usize) {
        if let Some(b) = self.bias {
            values.iter_mut().zip(&b[c0..]).for_each(|(v, &b)| *v += b);
        }
        if let Some(r) = self.residual {
            values
                .iter_mut()
                .zip(&r[start..])
                .for_each(|(v, &r)| *v += r);
        }
        self.activation.apply_slice(values);
    }
}

impl Col2imData {
    /// Packs the forward convolution's OIHW `weights` transposed (`Wᵀ`, per group and block
    /// of input channels).
    pub(crate) fn new(p: &ConvParams, weights: &[f32], isa: Isa) -> Result<Self> {
        let kern = cpu::gemm_f32(isa);
        let (cin_g, cout_g) = (p.in_channels_per_group(), p.out_channels_per_group());
        let taps = p.kernel[0] * p.kernel[1];
        let chunk = (BLOCK_ROWS / taps).clamp(1, cin_g);
        let chunks = cin_g.div_ceil(chunk);
        let r = match p.layout {
            Layout::Nchw => kern.mr,
            Layout::Nhwc => kern.nr,
        };
        let chunk_len = prepacked_len(chunk * taps, cout_g, r);
        let total = mul(&[chunk_len, chunks, p.groups], "packed weights")?;
        let mut packed = AlignedBuf::zeroed(total, "packed weights")?;
        let k = cin_g * taps;
        for (i, dst) in packed
            .as_mut_slice()
            .chunks_exact_mut(chunk_len)
            .take(chunks * p.groups)
            .enumerate()
        {
            let (grp, c0) = (i / chunks, i % chunks * chunk);
            let cc = chunk.min(cin_g - c0);
            let w = |co: usize, ci: usize, tap: usize| {
                weights[(grp * cout_g + co) * k + (c0 + ci) * taps + tap]
            };
            match p.layout {
                Layout::Nchw => prepack(dst, cc * taps, cout_g, r, |row, co| {
                    w(co, row / taps, row % taps)
                }),
                Layout::Nhwc => prepack(dst, cc * taps, cout_g, r, |col, co| {
                    w(co, col % cc, col / cc)
                }),
            }
        }
        Ok(Col2imData {
            kern,
            packed,
            chunk,
            chunks,
            chunk_len,
            layout: p.layout,
        })
    }

    pub(crate) fn kernel_name(&self) -> &'static str {
        self.kern.name
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> Col2imPlan {
        let (mr, nr) = (self.kern.mr, self.kern.nr);
        let rows = self.chunk * g.kh * g.kw;
        let pixels = g.oh * g.ow;
        let (tile, blk) = match self.layout {
            Layout::Nchw => {
                let tile = (TILE_FLOATS / rows / nr * nr).clamp(nr, NC_MAX);
                (tile, Blocking::new(self.kern, g.cout_g(), tile, 1))
            }
            Layout::Nhwc => {
                let tile = (TILE_FLOATS / rows / mr * mr).max(mr);
                (tile, Blocking::new(self.kern, g.cout_g(), rows, 1))
            }
        };
        let tile = tile.min(pixels.div_ceil(nr) * nr);
        let items = g.batch * g.groups * self.chunks;
        let workers = threads.clamp(1, items);
        let scratch_per_worker = rows * tile + blk.a_scratch() + blk.b_scratch();
        Col2imPlan {
            blk,
            tile,
            workers,
            scratch_per_worker,
        }
    }

    /// `dx (+)= col2im(Wᵀ · dy)`, then the epilogue. `accumulate`: add to what `dx` holds.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &Col2imPlan,
        g: &Geometry,
        dy: &[f32],
        dx: &mut [f32],
        accumulate: bool,
        ep: Epilogue,
        scratch: &mut [f32],
    ) {
        let items = g.batch * g.groups * self.chunks;
        let out = SendPtr(dx.as_mut_ptr());
        for_each_worker(plan.workers, items, scratch, |s, item| {
            // SAFETY: item (image, group, block) writes only the input-gradient channels of
            // its block of its image, which no other item writes; `dx` holds the whole tensor
            // (its length was checked). The kernel's ISA was checked at create.
            unsafe {
                with_isa(self.kern.isa, || {
                    self.run_item(plan, g, dy, out, accumulate, ep, s, item)
                })
            }
        });
    }

    /// # Safety
    /// `out` points to the whole input-gradient tensor, and no other thread writes this item's
    /// channels during the call.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn run_item(
        &self,
        plan: &Col2imPlan,
        g: &Geometry,
        dy: &[f32],
        out: SendPtr,
        accumulate: bool,
        ep: Epilogue,
        scratch: &mut [f32],
        item: usize,
    ) {
        let (cin_g, cout_g, taps) = (g.cin_g(), g.cout_g(), g.kh * g.kw);
        let n = item / (g.groups * self.chunks);
        let grp = item / self.chunks % g.groups;
        let c0 = item % self.chunks * self.chunk;
        let cc = self.chunk.min(cin_g - c0);
        let cb = grp * cin_g + c0; // first input channel of the block
        let rows = cc * taps;
        let (pixels, plane) = (g.oh * g.ow, g.h * g.w);
        let weights = &self.packed.as_slice()
            [(grp * self.chunks + c0 / self.chunk) * self.chunk_len..][..self.chunk_len];
        let (tile_buf, rest) = scratch.split_at_mut(rows * plan.tile);
        let (a_buf, b_buf) = rest.split_at_mut(plan.blk.a_scratch());
        // The block's channels of image n, as one slice (NCHW) or one run per pixel (NHWC).
        let dx = std::slice::from_raw_parts_mut(out.get(), g.input_len());
        if !accumulate {
            match self.layout {
                Layout::Nchw => dx[(n * g.c_in + cb) * plane..][..cc * plane].fill(0.0),
                Layout::Nhwc => {
                    (0..plane).for_each(|px| dx[(n * plane + px) * g.c_in + cb..][..cc].fill(0.0))
                }
            }
        }
        for p0 in (0..pixels).step_by(plan.tile) {
            let pt = plan.tile.min(pixels - p0);
            let tile = &mut tile_buf[..rows * pt];
            match self.layout {
                Layout::Nchw => {
                    let a = Prepacked {
                        data: weights,
                        k: cout_g,
                    };
                    let b = RowMajorB {
                        data: &dy[(n * g.c_out + grp * cout_g) * pixels + p0..],
                        ld: pixels,
                    };
                    let o = tile_output(tile, pt);
                    gemm(
                        self.kern, &plan.blk, rows, pt, cout_g, &a, &b, &o, a_buf, b_buf,
                    );
                    for (row, t) in tile.chunks_exact(pt).enumerate() {
                        let (ci, tap) = (row / taps, row % taps);
                        let dst = &mut dx[(n * g.c_in + cb + ci) * plane..][..plane];
                        col2im_nchw_row(g, tap, p0, t, dst);
                    }
                }
                Layout::Nhwc => {
                    let a = RowMajorA {
                        data: &dy[(n * pixels + p0) * g.c_out + grp * cout_g..],
                        ld: g.c_out,
                    };
                    let b = Prepacked {
                        data: weights,
                        k: cout_g,
                    };
                    let o = tile_output(tile, rows);
                    gemm(
                        self.kern, &plan.blk, pt, rows, cout_g, &a, &b, &o, a_buf, b_buf,
                    );
                    for (i, t) in tile.chunks_exact(rows).enumerate() {
                        let dst = &mut dx[n * plane * g.c_in..][..plane * g.c_in];
                        col2im_nhwc_pixel(g, p0 + i, cb, cc, t, dst);
                    }
                }
            }
        }
        if !ep.is_empty() {
            match self.layout {
                Layout::Nchw => (cb..cb + cc).for_each(|c| {
                    let start = (n * g.c_in + c) * plane;
                    ep.apply(&mut dx[start..][..plane], c, start);
                }),
                Layout::Nhwc => (0..plane).for_each(|px| {
                    let at = (n * plane + px) * g.c_in + cb;
                    ep.apply_channels(&mut dx[at..][..cc], cb, at);
                }),
            }
        }
    }
}

/// A GEMM output that overwrites a row-major tile with `ld` floats a row.
fn tile_output(tile: &mut [f32], ld: usize) -> Output<'static> {
    Output {
        c: tile.as_mut_ptr(),
        rs_c: ld as isize,
        bias: None,
        bias_per_row: false,
        residual: std::ptr::null(),
        activation: Activation::None,
        accumulate: false,
    }
}

/// The output columns `ox` whose tap at offset `off` (`ox·stride + off`) lands inside
/// `0..len`, as a range.
#[inline(always)]
fn inside(stride: usize, off: isize, len: usize, outs: usize) -> std::ops::Range<usize> {
    let s = stride as isize;
    // ox·s + off >= 0  and  ox·s + off <= len - 1
    let lo = if off >= 0 { 0 } else { (-off + s - 1) / s };
    let hi = (len as isize - 1 - off).div_euclid(s) + 1;
    (lo.max(0) as usize)..(hi.clamp(0, outs as isize) as usize).max(lo.max(0) as usize)
}

/// Adds one `dcol` row (channel fixed, tap `tap`) over output pixels `p0..p0 + t.len()` into
/// the channel's input-gradient plane.
#[inline(always)]
fn col2im_nchw_row(g: &Geometry, tap: usize, p0: usize, t: &[f32], plane: &mut [f32]) {
    let (ky, kx) = (tap / g.kw, tap % g.kw);
    let off_y = (ky * g.dh) as isize - g.pad_top as isize;
    let off_x = (kx * g.dw) as isize - g.pad_left as isize;
    let xs = inside(g.sw, off_x, g.w, g.ow);
    let mut p = p0;
    let end = p0 + t.len();
    while p < end {
        let (oy, ox0) = (p / g.ow, p % g.ow);
        let ox1 = g.ow.min(ox0 + end - p);
        let iy = (oy * g.sh) as isize + off_y;
        if iy >= 0 && (iy as usize) < g.h {
            let (a, b) = (xs.start.max(ox0), xs.end.min(ox1));
            if a < b {
                let src = &t[p - p0 + a - ox0..][..b - a];
                let x0 = (a * g.sw) as isize + off_x;
                let row = &mut plane[iy as usize * g.w..][..g.w];
                if g.sw == 1 {
                    let dst = &mut row[x0 as usize..][..b - a];
                    dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
                } else {
                    for (i, &s) in src.iter().enumerate() {
                        row[x0 as usize + i * g.sw] += s;
                    }
                }
            }
        }
        p += ox1 - ox0;
    }
}

/// Adds one `dcol` row of an NHWC tile (output pixel `p`, columns (tap, channel) of a block of
/// `cc` channels from `cb`) into the image's input gradient.
#[inline(always)]
fn col2im_nhwc_pixel(g: &Geometry, p: usize, cb: usize, cc: usize, t: &[f32], img: &mut [f32]) {
    let (oy, ox) = (p / g.ow, p % g.ow);
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
            let src = &t[(ky * g.kw + kx) * cc..][..cc];
            let dst = &mut img[(iy as usize * g.w + ix as usize) * g.c_in + cb..][..cc];
            dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
        }
    }
}

/// The backward-weights GEMM (no packed weights: both operands come from the data).
pub(crate) struct WeightGrad {
    kern: &'static GemmKernel,
}

/// How a backward-weights run splits: `groups x nchunks` items of `nchunk` columns.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WeightGradPlan {
    blk: Blocking,
    nchunk: usize,
    nchunks: usize,
    workers: usize,
}

impl WeightGradPlan {
    pub(crate) fn workspace_floats(&self) -> usize {
        self.workers * (self.blk.a_scratch() + self.blk.b_scratch())
    }
}

impl WeightGrad {
    pub(crate) fn new(isa: Isa) -> Self {
        WeightGrad {
            kern: cpu::gemm_f32(isa),
        }
    }

    pub(crate) fn kernel_name(&self) -> &'static str {
        self.kern.name
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> WeightGradPlan {
        let nr = self.kern.nr;
        let k = g.k_len();
        let t = threads.max(1);
        // Enough column chunks that every worker has work, each at least two panels wide.
        let want = t.div_ceil(g.groups);
        let nchunk = k.div_ceil(want).div_ceil(nr).max(2) * nr;
        let nchunk = nchunk.min(k.div_ceil(nr) * nr);
        let nchunks = k.div_ceil(nchunk);
        let q = g.batch * g.oh * g.ow;
        let blk = Blocking::new(self.kern, q, nchunk.min(NC_MAX), 1);
        WeightGradPlan {
            blk,
            nchunk,
            nchunks,
            workers: t.min(g.groups * nchunks),
        }
    }

    /// `dw (+)= dyᵀ-by-patches` for every group.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &WeightGradPlan,
        g: &Geometry,
        x: &[f32],
        dy: &[f32],
        dw: &mut [f32],
        accumulate: bool,
        scratch: &mut [f32],
    ) {
        let out = SendPtr(dw.as_mut_ptr());
        let k = g.k_len();
        let q = g.batch * g.oh * g.ow;
        let items = g.groups * plan.nchunks;
        for_each_worker(plan.workers, items, scratch, |s, item| {
            let (grp, n0) = (item / plan.nchunks, item % plan.nchunks * plan.nchunk);
            let nlen = plan.nchunk.min(k - n0);
            let (a_buf, b_buf) = s.split_at_mut(plan.blk.a_scratch());
            let a = GradOutA { dy, g, grp };
            let b = PatchesB {
                x,
                g,
                grp,
                col0: n0,
            };
            let o = Output {
                // SAFETY (of the offset): rows grp·c_out/g.. of `dw`, columns n0..n0+nlen.
                c: unsafe { out.get().add(grp * g.cout_g() * k + n0) },
                rs_c: k as isize,
                bias: None,
                bias_per_row: false,
                residual: std::ptr::null(),
                activation: Activation::None,
                accumulate,
            };
            // SAFETY: item (group, column chunk) writes only its rows and columns of `dw`,
            // which holds every group's weights (its length was checked); the operands pack
            // from `x` and `dy`, whose lengths were checked; the ISA was checked at create.
            unsafe {
                with_isa(self.kern.isa, || {
                    gemm(
                        self.kern,
                        &plan.blk,
                        g.cout_g(),
                        nlen,
                        q,
                        &a,
                        &b,
                        &o,
                        a_buf,
                        b_buf,
                    )
                })
            }
        });
    }
}

/// A: the output gradient of one group as `c_out/g x (batch·pixels)`.
struct GradOutA<'a> {
    dy: &'a [f32],
    g: &'a Geometry,
    grp: usize,
}

impl Panels for GradOutA<'_> {
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
        let pixels = g.oh * g.ow;
        let c0 = self.grp * g.cout_g() + start;
        for q in 0..len.div_ceil(r) {
            let panel = &mut dst[q * kc * r..][..kc * r];
            let rows = r.min(len - q * r);
            match g.layout {
                Layout::Nchw => {
                    for i in 0..r {
                        if i >= rows {
                            (0..kc).for_each(|kk| panel[kk * r + i] = 0.0);
                            continue;
                        }
                        let c = c0 + q * r + i;
                        // K runs over (image, pixel): copy it a run of one image at a time.
                        let mut kk = 0;
                        while kk < kc {
                            let (n, p) = ((k0 + kk) / pixels, (k0 + kk) % pixels);
                            let run = (pixels - p).min(kc - kk);
                            let src = &self.dy[(n * g.c_out + c) * pixels + p..][..run];
                            for (j, &v) in src.iter().enumerate() {
                                panel[(kk + j) * r + i] = v;
                            }
                            kk += run;
                        }
                    }
                }
                Layout::Nhwc => {
                    for kk in 0..kc {
                        let d = &mut panel[kk * r..][..r];
                        let src = &self.dy[(k0 + kk) * g.c_out + c0 + q * r..][..rows];
                        d[..rows].copy_from_slice(src);
                        d[rows..].fill(0.0);
                    }
                }
            }
        }
        (dst.as_ptr(), kc * r)
    }
}

/// B: the patch matrix of one group, `(batch·pixels) x K` with K in OIHW order (channel, ky,
/// kx), gathered from the input as it is packed; columns from `col0`.
struct PatchesB<'a> {
    x: &'a [f32],
    g: &'a Geometry,
    grp: usize,
    col0: usize,
}

impl Panels for PatchesB<'_> {
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
        let (pixels, plane, taps) = (g.oh * g.ow, g.h * g.w, g.kh * g.kw);
        for q in 0..len.div_ceil(r) {
            let panel = &mut dst[q * kc * r..][..kc * r];
            let cols = r.min(len - q * r);
            for j in 0..r {
                if j >= cols {
                    (0..kc).for_each(|kk| panel[kk * r + j] = 0.0);
                    continue;
                }
                let col = self.col0 + start + q * r + j;
                let (c, tap) = (self.grp * g.cin_g() + col / taps, col % taps);
                let (ky, kx) = (tap / g.kw, tap % g.kw);
                let off_y = (ky * g.dh) as isize - g.pad_top as isize;
                let off_x = (kx * g.dw) as isize - g.pad_left as isize;
                let xs = inside(g.sw, off_x, g.w, g.ow);
                // K runs over (image, output row, output column): one output row at a time.
                let mut kk = 0;
                while kk < kc {
                    let (n, p) = ((k0 + kk) / pixels, (k0 + kk) % pixels);
                    let (oy, ox0) = (p / g.ow, p % g.ow);
                    let run = (g.ow - ox0).min(kc - kk);
                    let iy = (oy * g.sh) as isize + off_y;
                    let (a, b) = if iy >= 0 && (iy as usize) < g.h {
                        (xs.start.clamp(ox0, ox0 + run), xs.end.clamp(ox0, ox0 + run))
                    } else {
                        (ox0, ox0)
                    };
                    for ox in ox0..a.max(ox0) {
                        panel[(kk + ox - ox0) * r + j] = 0.0;
                    }
                    if a < b {
                        // Element (iy, ix) of channel c of image n, and the step along ox.
                        let px = iy as usize * g.w + ((a * g.sw) as isize + off_x) as usize;
                        let (at0, step) = match g.layout {
                            Layout::Nchw => ((n * g.c_in + c) * plane + px, g.sw),
                            Layout::Nhwc => ((n * plane + px) * g.c_in + c, g.sw * g.c_in),
                        };
                        for ox in a..b {
                            panel[(kk + ox - ox0) * r + j] = self.x[at0 + (ox - a) * step];
                        }
                    }
                    for ox in b.max(a)..ox0 + run {
                        panel[(kk + ox - ox0) * r + j] = 0.0;
                    }
                    kk += run;
                }
            }
        }
        (dst.as_ptr(), kc * r)
    }
}

impl BlockB for PatchesB<'_> {}

/// `db (+)= Σ over images and pixels of dy`, per output channel.
pub(crate) fn grad_bias(g: &Geometry, dy: &[f32], db: &mut [f32], accumulate: bool) {
    if !accumulate {
        db.fill(0.0);
    }
    let pixels = g.oh * g.ow;
    match g.layout {
        // A plane at a time, summed in f64: a long f32 sum would lose digits.
        Layout::Nchw => {
            for (c, d) in db.iter_mut().enumerate() {
                let s: f64 = (0..g.batch)
                    .flat_map(|n| &dy[(n * g.c_out + c) * pixels..][..pixels])
                    .map(|&v| v as f64)
                    .sum();
                *d += s as f32;
            }
        }
        // A pixel at a time, every channel at once.
        Layout::Nhwc => {
            for px in dy.chunks_exact(g.c_out) {
                db.iter_mut().zip(px).for_each(|(d, &v)| *d += v);
            }
        }
    }
}
