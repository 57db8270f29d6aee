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

use super::{copy_run, for_each_worker, zero_run, SendPtr};
use crate::buffer::AlignedBuf;
use crate::cpu::generated_layout::Transpose8x8;
use crate::cpu::{self, Isa};
use crate::gemm::pack::{panel_row, prepack, prepacked_len, Prepacked, RowMajorA, RowMajorB};
use crate::gemm::{gemm, BlockB, Blocking, GemmKernel, Output, Panels, NC_MAX};
use crate::params::{mul, Geometry};
use crate::{Activation, ConvParams, Layout, Result};

/// Defines `unsafe fn $name(isa, args…)`: `$body::<FMA>(args…)` compiled for `isa` (AVX-512,
/// AVX2 + FMA, or the target's baseline), so that the loops `$body` inlines use that ISA's
/// vectors and, where `FMA`, fused multiply-adds. A wrapper per ISA with concrete types:
/// a generic closure would not be inlined into the `target_feature` function reliably.
///
/// The defined function's safety contract: the CPU must have `isa`.
macro_rules! isa_dispatch {
    ($vis:vis fn $name:ident = $body:ident ( $($arg:ident : $ty:ty),* $(,)? )) => {
        /// Runs the kernel of the same name compiled for `isa`.
        ///
        /// # Safety
        /// The CPU must have `isa`.
        #[allow(clippy::too_many_arguments)]
        $vis unsafe fn $name(isa: $crate::cpu::Isa, $($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512($($arg: $ty),*) {
                    $body::<true>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) {
                    $body::<true>($($arg),*)
                }
                match isa {
                    $crate::cpu::Isa::Avx512 => return avx512($($arg),*),
                    $crate::cpu::Isa::Avx2 => return avx2($($arg),*),
                    _ => {}
                }
            }
            if isa == $crate::cpu::Isa::Scalar {
                $body::<false>($($arg),*)
            } else {
                $body::<true>($($arg),*)
            }
        }
    };
}
pub(crate) use isa_dispatch;

/// `a·b + c`, fused where the ISA has FMA (`F`); a plain multiply-add in scalar code, where
/// `mul_add` would be a library call.
#[inline(always)]
pub(crate) fn madd<const F: bool>(a: f32, b: f32, c: f32) -> f32 {
    if F {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
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
    /// Transposes NHWC output-gradient tiles into A panels.
    transpose: Transpose8x8,
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
            transpose: cpu::transpose_8x8(isa),
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
                col2im_item(
                    self.kern.isa,
                    self,
                    plan,
                    g,
                    dy,
                    out,
                    accumulate,
                    &ep,
                    s,
                    item,
                )
            }
        });
    }
}

isa_dispatch!(fn col2im_item = col2im_item_body(
    a: &Col2imData,
    plan: &Col2imPlan,
    g: &Geometry,
    dy: &[f32],
    out: SendPtr,
    accumulate: bool,
    ep: &Epilogue,
    scratch: &mut [f32],
    item: usize,
));

impl Col2imData {
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
        ep: &Epilogue,
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
                        transpose: self.transpose,
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

/// [`Col2imData::run_item`] as a kernel body for [`isa_dispatch`].
///
/// # Safety
/// As [`Col2imData::run_item`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn col2im_item_body<const F: bool>(
    a: &Col2imData,
    plan: &Col2imPlan,
    g: &Geometry,
    dy: &[f32],
    out: SendPtr,
    accumulate: bool,
    ep: &Epilogue,
    scratch: &mut [f32],
    item: usize,
) {
    a.run_item(plan, g, dy, out, accumulate, ep, scratch, item)
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
pub(crate) fn inside(stride: usize, off: isize, len: usize, outs: usize) -> std::ops::Range<usize> {
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
    for (tap, iy, ix) in taps_inside(g, p / g.ow, p % g.ow) {
        let src = &t[tap * cc..][..cc];
        let dst = &mut img[(iy * g.w + ix) * g.c_in + cb..][..cc];
        dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
    }
}

/// The taps of output pixel (oy, ox) that read inside the input (not padding), as (tap,
/// input row, input column).
#[inline(always)]
pub(crate) fn taps_inside(
    g: &Geometry,
    oy: usize,
    ox: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let rows = (0..g.kh).filter_map(move |ky| {
        let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
        (iy >= 0 && (iy as usize) < g.h).then_some((ky, iy as usize))
    });
    rows.flat_map(move |(ky, iy)| {
        (0..g.kw).filter_map(move |kx| {
            let ix = (ox * g.sw + kx * g.dw) as isize - g.pad_left as isize;
            (ix >= 0 && (ix as usize) < g.w).then_some((ky * g.kw + kx, iy, ix as usize))
        })
    })
}

/// The backward-weights GEMMs: one per group and tap (no packed weights: both operands come
/// from the data).
pub(crate) struct WeightGrad {
    kern: &'static GemmKernel,
    transpose: Transpose8x8,
}

/// How a backward-weights run splits: `groups x taps x nchunks` items of `nchunk` input
/// channels, each its own GEMM.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WeightGradPlan {
    blk: Blocking,
    nchunk: usize,
    nchunks: usize,
    workers: usize,
    /// Compute `dW_tapᵀ = X_tapᵀ · dYᵀ` (input channels as rows) instead: for few input
    /// channels and many output channels, whose tiles fill the kernel's registers better.
    transposed: bool,
    /// One GEMM per group over the patch matrix instead of one per tap (see
    /// [`WeightGrad::run`]); chunks are then of `(channel, tap)` columns.
    patches: bool,
    /// The tap GEMMs' B operand is the NCHW input's planes ([`reads_planes`]).
    planes: bool,
    /// The GEMM kernel's panel width.
    nr: usize,
}

impl WeightGradPlan {
    /// Per worker a GEMM's packing buffers; then the tap-major gradient (the weights' size)
    /// and, for NCHW, one image transposed to NHWC.
    pub(crate) fn workspace_floats(&self, g: &Geometry) -> usize {
        if self.patches {
            return self.workers * self.per_worker();
        }
        let image = match g.layout {
            Layout::Nchw if !self.planes => g.c_in * g.h * g.w,
            _ => 0,
        };
        self.workers * self.per_worker() + self.sums_floats(g) + image
    }

    /// Floats of the tap-major gradient the tap GEMMs sum into; none for a 1x1 layer whose
    /// tiles are not transposed, as its tiles are the OIHW gradient.
    fn sums_floats(&self, g: &Geometry) -> usize {
        match (g.kh * g.kw, self.transposed) {
            (1, false) => 0,
            _ => g.c_out * g.k_len(),
        }
    }

    /// A GEMM's packing buffers; for the patch GEMM, room past the B block for one panel's
    /// columns gathered as rows ([`PatchColsB`]).
    fn per_worker(&self) -> usize {
        let stage = if self.patches {
            self.blk.kc * self.nr
        } else {
            0
        };
        self.blk.a_scratch() + self.blk.b_scratch() + stage
    }

    /// Whether this plan runs the patch GEMM (else the tap GEMMs).
    pub(crate) fn patches(&self) -> bool {
        self.patches
    }
}

impl WeightGrad {
    pub(crate) fn new(isa: Isa) -> Self {
        WeightGrad {
            kern: cpu::gemm_f32(isa),
            transpose: cpu::transpose_8x8(isa),
        }
    }

    pub(crate) fn kernel_name(&self) -> &'static str {
        self.kern.name
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> WeightGradPlan {
        let (nr, cin_g, t) = (self.kern.nr, g.cin_g(), threads.max(1));
        if patch_gemm(g) {
            // Columns (channel, tap) split between the workers, whole panels each.
            let cols = g.k_len();
            let want = items_wanted(t).div_ceil(g.groups).min(cols.div_ceil(nr));
            let nchunk = cols.div_ceil(want.max(1)).div_ceil(nr) * nr;
            let nchunks = cols.div_ceil(nchunk);
            return WeightGradPlan {
                blk: Blocking::new(self.kern, g.oh * g.ow, nchunk.min(NC_MAX), 1),
                nchunk,
                nchunks,
                workers: t.min(g.groups * nchunks),
                transposed: false,
                patches: true,
                planes: false,
                nr,
            };
        }
        // Split the input channels too where groups and taps alone leave workers idle.
        let want = items_wanted(t)
            .div_ceil(g.groups * g.kh * g.kw)
            .min(cin_g.div_ceil(nr));
        let nchunk = cin_g.div_ceil(want.max(1)).div_ceil(nr) * nr;
        let nchunks = cin_g.div_ceil(nchunk);
        // The orientation whose register tiles waste the least on edges.
        let (mr, cout_g) = (self.kern.mr, g.cout_g());
        let fill = |rows: usize, cols: usize| {
            (rows * cols) as f64 / (rows.div_ceil(mr) * mr * cols.div_ceil(nr) * nr) as f64
        };
        let transposed = fill(nchunk.min(cin_g), cout_g) > fill(cout_g, nchunk.min(cin_g));
        let nc = if transposed { cout_g } else { nchunk };
        let blk = Blocking::new(self.kern, g.oh * g.ow, nc.min(NC_MAX), 1);
        WeightGradPlan {
            blk,
            nchunk,
            nchunks,
            workers: t.min(g.groups * g.kh * g.kw * nchunks),
            transposed,
            patches: false,
            planes: reads_planes(g),
            nr,
        }
    }

    /// `dw (+)= Σ over images, per group and tap, dy · (input shifted by the tap)`: for tap
    /// (ky, kx), `dW[:, :, ky, kx] = dY[c_out/g x pixels] · X_tap[pixels x c_in/g]`, where
    /// row p of `X_tap` is the input pixel that tap reads for output pixel p: a run of
    /// channels in NHWC, copied into the B panels without any gather (NCHW inputs are
    /// transposed an image at a time first).
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
        if plan.patches {
            return self.run_patches(plan, g, x, dy, dw, accumulate, scratch);
        }
        let (cin_g, cout_g, taps) = (g.cin_g(), g.cout_g(), g.kh * g.kw);
        let plane = g.h * g.w;
        let (gemm_bufs, rest) = scratch.split_at_mut(plan.workers * plan.per_worker());
        let (sums, image) = rest.split_at_mut(plan.sums_floats(g));
        let tile = cout_g * cin_g; // one tap's gradient of one group
                                   // Where the tiles are in OIHW order already, the GEMMs write the gradient itself.
        let direct = plan.sums_floats(g) == 0;
        assert!(dw.len() >= g.groups * tile * taps);
        let out = SendPtr(if direct {
            dw.as_mut_ptr()
        } else {
            sums.as_mut_ptr()
        });
        for n in 0..g.batch {
            let xn = match g.layout {
                Layout::Nhwc => &x[n * plane * g.c_in..][..plane * g.c_in],
                Layout::Nchw if plan.planes => &x[n * g.c_in * plane..][..g.c_in * plane],
                Layout::Nchw => {
                    let src = &x[n * g.c_in * plane..][..g.c_in * plane];
                    let img = &mut image[..plane * g.c_in];
                    planes_to_pixels(self.transpose, src, g.c_in, plane, img);
                    &*img
                }
            };
            let items = g.groups * taps * plan.nchunks;
            for_each_worker(plan.workers, items, gemm_bufs, |s, item| {
                let (grp, tap) = (item / (taps * plan.nchunks), item / plan.nchunks % taps);
                let col0 = item % plan.nchunks * plan.nchunk;
                let cols = plan.nchunk.min(cin_g - col0);
                let (a_buf, b_buf) = s.split_at_mut(plan.blk.a_scratch());
                let a = GradOutA {
                    dy,
                    g,
                    grp,
                    n,
                    t: self.transpose,
                };
                let b = TapRowsB {
                    x: xn,
                    g,
                    grp,
                    tap,
                    col0,
                    planes: plan.planes,
                    t: self.transpose,
                };
                // The tile of (group, tap): `cout_g x cin_g`, or its transpose.
                let (first, ld) = match plan.transposed {
                    false => ((grp * taps + tap) * tile + col0, cin_g),
                    true => ((grp * taps + tap) * tile + col0 * cout_g, cout_g),
                };
                let o = Output {
                    // SAFETY (of the offset): inside `sums` (or `dw`, of the same size, as
                    // asserted), which holds every tile.
                    c: unsafe { out.get().add(first) },
                    rs_c: ld as isize,
                    bias: None,
                    bias_per_row: false,
                    residual: std::ptr::null(),
                    activation: Activation::None,
                    accumulate: n > 0 || (direct && accumulate),
                };
                let (p, isa) = (g.oh * g.ow, self.kern.isa);
                // SAFETY: item (group, tap, chunk) writes only its channels of its tile of
                // `sums`; the operands read `dy` and the image, whose lengths were checked; the
                // ISA was checked at create.
                unsafe {
                    match plan.transposed {
                        false => weight_grad_gemm(
                            isa, self.kern, plan, cout_g, cols, p, &a, &b, &o, a_buf, b_buf,
                        ),
                        true => weight_grad_gemm_t(
                            isa, self.kern, plan, cols, cout_g, p, &b, &a, &o, a_buf, b_buf,
                        ),
                    }
                }
            });
        }
        if direct {
            return;
        }
        // Tap-major (group, tap, co, ci) to OIHW (co, ci, tap).
        for grp in 0..g.groups {
            for co in 0..cout_g {
                let dst = &mut dw[(grp * cout_g + co) * cin_g * taps..][..cin_g * taps];
                for tap in 0..taps {
                    let t = (grp * taps + tap) * tile;
                    let put = |(d, &v): (&mut f32, &f32)| *d = if accumulate { *d + v } else { v };
                    match plan.transposed {
                        false => {
                            let src = &sums[t + co * cin_g..][..cin_g];
                            dst.iter_mut()
                                .skip(tap)
                                .step_by(taps)
                                .zip(src)
                                .for_each(put)
                        }
                        true => {
                            let src = sums[t + co..].iter().step_by(cout_g);
                            dst.iter_mut()
                                .skip(tap)
                                .step_by(taps)
                                .zip(src)
                                .for_each(put)
                        }
                    }
                }
            }
        }
    }
}

impl WeightGrad {
    /// `dW_g (+)= Σ over images of dY_g[c_out/g x pixels] · P_g[pixels x (c_in/g · taps)]`,
    /// one GEMM per group whose B operand is the patch matrix, gathered from the input by the
    /// B packer ([`PatchColsB`]) a panel at a time. Its columns are in OIHW order, so the
    /// products land in the gradient itself: no tap-major scratch and no reordering pass,
    /// which for a layer with many output channels (a weight gradient of megabytes) cost as
    /// much memory traffic as the GEMM's own output.
    #[allow(clippy::too_many_arguments)]
    fn run_patches(
        &self,
        plan: &WeightGradPlan,
        g: &Geometry,
        x: &[f32],
        dy: &[f32],
        dw: &mut [f32],
        accumulate: bool,
        scratch: &mut [f32],
    ) {
        let (cout_g, cols) = (g.cout_g(), g.k_len());
        let image = g.c_in * g.h * g.w;
        assert!(dw.len() >= g.groups * cout_g * cols && x.len() >= g.batch * image);
        let out = SendPtr(dw.as_mut_ptr());
        let gemm_bufs = &mut scratch[..plan.workers * plan.per_worker()];
        for n in 0..g.batch {
            let items = g.groups * plan.nchunks;
            for_each_worker(plan.workers, items, gemm_bufs, |s, item| {
                let (grp, col0) = (item / plan.nchunks, item % plan.nchunks * plan.nchunk);
                let (a_buf, b_buf) = s.split_at_mut(plan.blk.a_scratch());
                let a = GradOutA {
                    dy,
                    g,
                    grp,
                    n,
                    t: self.transpose,
                };
                let b = PatchColsB {
                    x: &x[n * image..][..image],
                    g,
                    grp,
                    col0,
                    t: self.transpose,
                };
                let o = Output {
                    // SAFETY (of the offset): row 0 of the group's gradient, column col0 <
                    // cols, inside `dw` (asserted above).
                    c: unsafe { out.get().add(grp * cout_g * cols + col0) },
                    rs_c: cols as isize,
                    bias: None,
                    bias_per_row: false,
                    residual: std::ptr::null(),
                    activation: Activation::None,
                    accumulate: n > 0 || accumulate,
                };
                let width = plan.nchunk.min(cols - col0);
                // SAFETY: item (group, chunk) writes only the chunk's columns of its group's
                // rows of `dw` (rows `cols` apart, inside it as asserted); the operands read
                // `dy` and the image, whose lengths were checked; the ISA was checked at create.
                unsafe {
                    weight_grad_gemm_patches(
                        self.kern.isa,
                        self.kern,
                        plan,
                        cout_g,
                        width,
                        g.oh * g.ow,
                        &a,
                        &b,
                        &o,
                        a_buf,
                        b_buf,
                    )
                }
            });
        }
    }
}

/// True where the weight gradient runs one GEMM per group over the patch matrix rather than
/// one per tap: kernels of several taps whose output channels outnumber the output pixels
/// (of the whole batch) several times over, such as resnet50_l4_3x3 (512 channels, 49
/// pixels: 1.7x faster). There the tap GEMMs' gradient is large and their reordering pass
/// misses the cache, while the patch gather is small; with more pixels the gather (a value
/// at a time) costs more than the reordering saves (resnet50_l3_3x3, 256 channels and 196
/// pixels: 0.87x; measured on Zen 4 with `--precision exact`).
fn patch_gemm(g: &Geometry) -> bool {
    let pixels = g.batch * g.oh * g.ow;
    g.kh * g.kw > 1 && g.cout_g() >= PATCH_GEMM_MIN_ROWS.max(4 * pixels)
}

/// Items a weight-gradient run wants for `threads` workers: two a worker to even out their
/// loads, but one on one thread, where splitting the input channels would pack the output
/// gradient (the GEMM's A operand) once more a chunk. One thread, three interleaved A/B runs
/// of 9 rounds: resnet50_l1_1x1_expand's weight gradient (256 output channels) 1.07-1.11x,
/// mobilenetv2_pw_project 1.02-1.18x, the other 1x1 layers 0.99-1.04x.
fn items_wanted(threads: usize) -> usize {
    if threads == 1 {
        1
    } else {
        2 * threads
    }
}

/// Output channels a group needs at least for [`patch_gemm`] (the rows that share each
/// gathered value).
const PATCH_GEMM_MIN_ROWS: usize = 64;

/// True where the weight gradient's B operand is the NCHW input itself: a 1x1, stride-1,
/// unpadded layer reads every input pixel as the output pixel of the same index, so its
/// planes are packed (transposed) straight into the panels, with no NHWC copy of the image.
fn reads_planes(g: &Geometry) -> bool {
    let unpadded = g.pad_top + g.pad_bottom + g.pad_left + g.pad_right == 0;
    g.layout == Layout::Nchw && g.kh * g.kw == 1 && g.sh * g.sw == 1 && unpadded
}

/// `c` planes of `plane` floats (`src`) as `plane` pixels of `c` channels (`dst`): 8x8 blocks
/// through the transpose kernel, the ragged edges element by element.
fn planes_to_pixels(t: Transpose8x8, src: &[f32], c: usize, plane: usize, dst: &mut [f32]) {
    assert!(src.len() >= c * plane && dst.len() >= c * plane);
    let (c8, p8) = (c / 8 * 8, plane / 8 * 8);
    for c0 in (0..c8).step_by(8) {
        for p0 in (0..p8).step_by(8) {
            // SAFETY: rows c0..c0+8 of `src` hold columns p0..p0+8, rows p0..p0+8 of `dst`
            // columns c0..c0+8 (both lengths asserted above); the kernel is one this CPU runs.
            unsafe {
                t(
                    src[c0 * plane + p0..].as_ptr(),
                    plane,
                    dst[p0 * c + c0..].as_mut_ptr(),
                    c,
                )
            }
        }
        for ch in c0..c0 + 8 {
            for p in p8..plane {
                dst[p * c + ch] = src[ch * plane + p];
            }
        }
    }
    for ch in c8..c {
        for p in 0..plane {
            dst[p * c + ch] = src[ch * plane + p];
        }
    }
}

isa_dispatch!(fn weight_grad_gemm = weight_grad_gemm_body(
    kern: &GemmKernel,
    plan: &WeightGradPlan,
    m: usize,
    n: usize,
    k: usize,
    a: &GradOutA,
    b: &TapRowsB,
    out: &Output,
    a_buf: &mut [f32],
    b_buf: &mut [f32],
));

isa_dispatch!(fn weight_grad_gemm_t = weight_grad_gemm_body(
    kern: &GemmKernel,
    plan: &WeightGradPlan,
    m: usize,
    n: usize,
    k: usize,
    a: &TapRowsB,
    b: &GradOutA,
    out: &Output,
    a_buf: &mut [f32],
    b_buf: &mut [f32],
));

isa_dispatch!(fn weight_grad_gemm_patches = weight_grad_gemm_body(
    kern: &GemmKernel,
    plan: &WeightGradPlan,
    m: usize,
    n: usize,
    k: usize,
    a: &GradOutA,
    b: &PatchColsB,
    out: &Output,
    a_buf: &mut [f32],
    b_buf: &mut [f32],
));

/// The backward-weights GEMM (either orientation: a `Panels` packer serves either side) as a
/// kernel body for [`isa_dispatch`].
///
/// # Safety
/// As [`gemm`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn weight_grad_gemm_body<const F: bool>(
    kern: &GemmKernel,
    plan: &WeightGradPlan,
    m: usize,
    n: usize,
    k: usize,
    a: &impl Panels,
    b: &impl BlockB,
    out: &Output,
    a_buf: &mut [f32],
    b_buf: &mut [f32],
) {
    gemm(kern, &plan.blk, m, n, k, a, b, out, a_buf, b_buf)
}

/// A: the output gradient of image `n` and one group as `c_out/g x pixels`.
struct GradOutA<'a> {
    dy: &'a [f32],
    g: &'a Geometry,
    grp: usize,
    n: usize,
    /// Transposes NCHW planes into panels.
    t: Transpose8x8,
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
        match g.layout {
            // Rows are the channels' planes: the row-major packer.
            Layout::Nchw => RowMajorA {
                data: &self.dy[(self.n * g.c_out + c0) * pixels..],
                ld: pixels,
                transpose: self.t,
            }
            .panels(0, len, k0, kc, r, dst),
            // Column-major: each pixel's channels are a panel step.
            Layout::Nhwc => {
                for q in 0..len.div_ceil(r) {
                    let rows = r.min(len - q * r);
                    for kk in 0..kc {
                        let d = &mut dst[(q * kc + kk) * r..][..r];
                        let px = self.n * pixels + k0 + kk;
                        panel_row(d, &self.dy[px * g.c_out + c0 + q * r..][..rows]);
                    }
                }
                (dst.as_ptr(), kc * r)
            }
        }
    }
}

/// B: `pixels x c_in/g` for one group and tap of one NHWC image: row p is the input pixel
/// tap (ky, kx) reads for output pixel p (zeros where that is padding). With `planes`
/// ([`reads_planes`]), the image is the NCHW input, and row p is its pixel p.
struct TapRowsB<'a> {
    x: &'a [f32],
    g: &'a Geometry,
    grp: usize,
    tap: usize,
    /// First input channel (of the group) of column 0.
    col0: usize,
    /// `x` is the NCHW image, packed from its planes.
    planes: bool,
    /// Transposes NCHW planes into panels.
    t: Transpose8x8,
}

impl Panels for TapRowsB<'_> {
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
        let (ky, kx) = (self.tap / g.kw, self.tap % g.kw);
        let c0 = self.grp * g.cin_g() + self.col0 + start;
        if self.planes {
            let plane = g.h * g.w;
            let planes = RowMajorA {
                data: &self.x[c0 * plane..],
                ld: plane,
                transpose: self.t,
            };
            return planes.panels(0, len, k0, kc, r, dst);
        }
        let (mut oy, mut ox) = (k0 / g.ow, k0 % g.ow);
        for kk in 0..kc {
            let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
            let ix = (ox * g.sw + kx * g.dw) as isize - g.pad_left as isize;
            let inside = iy >= 0 && ix >= 0 && (iy as usize) < g.h && (ix as usize) < g.w;
            let px = if inside {
                iy as usize * g.w + ix as usize
            } else {
                0
            };
            for q in 0..len.div_ceil(r) {
                let cols = r.min(len - q * r);
                let d = &mut dst[(q * kc + kk) * r..][..r];
                if inside {
                    panel_row(d, &self.x[px * g.c_in + c0 + q * r..][..cols]);
                } else {
                    d.fill(0.0);
                }
            }
            ox += 1;
            if ox == g.ow {
                (oy, ox) = (oy + 1, 0);
            }
        }
        (dst.as_ptr(), kc * r)
    }
}

/// B: the patch matrix `pixels x (c_in/g · taps)` of one group of one image (either layout):
/// column (ci, tap) at row p is the input value tap reads for output pixel p (zero where that
/// is padding), the columns in the weights' OIHW order.
struct PatchColsB<'a> {
    x: &'a [f32],
    g: &'a Geometry,
    grp: usize,
    /// First column (of the group) of the chunk.
    col0: usize,
    /// Transposes the gathered rows into panels.
    t: Transpose8x8,
}

impl Panels for PatchColsB<'_> {
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
        let (taps, (h, w)) = (g.kh * g.kw, (g.h, g.w));
        // Where input value (c, iy, ix) lies, and the step between the values read for
        // horizontally adjacent output pixels.
        let at = |c: usize, iy: usize, ix: usize| match g.layout {
            Layout::Nchw => (c * h + iy) * w + ix,
            Layout::Nhwc => (iy * w + ix) * g.c_in + c,
        };
        let step = match g.layout {
            Layout::Nchw => g.sw,
            Layout::Nhwc => g.sw * g.c_in,
        };
        // Each panel's columns are first gathered as rows of `kc` pixels (runs of the input
        // rows, zeros where the taps read padding) into the scratch past the panels, then
        // transposed into the panel by 8x8 blocks: writing a column straight into a panel is
        // a store every `r` floats, one value at a time.
        let (dst, stage) = dst.split_at_mut(len.div_ceil(r) * kc * r);
        let stage = &mut stage[..r * kc];
        // The first output pixel's row and column.
        let (oy0, ox0) = (k0 / g.ow, k0 % g.ow);
        for q in 0..len.div_ceil(r) {
            let cols = r.min(len - q * r);
            // Column (channel, tap): counted up column by column, not divided out each time.
            let col = self.col0 + start + q * r;
            let (mut c, tap) = (self.grp * g.cin_g() + col / taps, col % taps);
            let (mut ky, mut kx) = (tap / g.kw, tap % g.kw);
            for row in stage.chunks_exact_mut(kc).take(cols) {
                let off = (kx * g.dw) as isize - g.pad_left as isize;
                let xs = inside(g.sw, off, w, g.ow);
                // Output pixels k0..k0+kc, a run of one output row at a time: zeros left of
                // the inside columns, the values read `step` apart, zeros right of them.
                let (mut oy, mut ox, mut kk) = (oy0, ox0, 0);
                while kk < kc {
                    let run = (g.ow - ox).min(kc - kk);
                    let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
                    let (lo, hi) = if iy < 0 || iy as usize >= h {
                        (ox + run, ox + run)
                    } else {
                        let lo = xs.start.clamp(ox, ox + run);
                        (lo, xs.end.clamp(lo, ox + run))
                    };
                    let seg = &mut row[kk..][..run];
                    let (zeros, rest) = seg.split_at_mut(lo - ox);
                    let (vals, tail) = rest.split_at_mut(hi - lo);
                    zero_run(zeros);
                    zero_run(tail);
                    if hi > lo {
                        let ix = (lo as isize * g.sw as isize + off) as usize;
                        let src = &self.x[at(c, iy as usize, ix)..];
                        if step == 1 {
                            copy_run(vals, &src[..vals.len()]);
                        } else {
                            vals.iter_mut()
                                .zip(src.iter().step_by(step))
                                .for_each(|(v, &x)| *v = x);
                        }
                    }
                    (kk, ox, oy) = (kk + run, 0, oy + 1);
                }
                kx += 1;
                if kx == g.kw {
                    (kx, ky) = (0, ky + 1);
                    if ky == g.kh {
                        (ky, c) = (0, c + 1);
                    }
                }
            }
            let rows = RowMajorA {
                data: stage,
                ld: kc,
                transpose: self.t,
            };
            rows.panels(0, cols, 0, kc, r, &mut dst[q * kc * r..][..kc * r]);
        }
        (dst.as_ptr(), kc * r)
    }
}

impl BlockB for PatchColsB<'_> {}
impl BlockB for TapRowsB<'_> {}
impl BlockB for GradOutA<'_> {}

/// The sum of an output-gradient plane: 16 f32 lanes, summed in f64.
#[inline(always)]
pub(crate) fn plane_sum(plane: &[f32]) -> f64 {
    let mut lanes = [0.0f32; 16];
    let chunks = plane.chunks_exact(16);
    let rest = chunks.remainder().iter().map(|&v| v as f64).sum::<f64>();
    for ch in chunks {
        lanes.iter_mut().zip(ch).for_each(|(l, &v)| *l += v);
    }
    rest + lanes.iter().map(|&v| v as f64).sum::<f64>()
}

/// `db (+)= Σ over images and pixels of dy`, per output channel.
pub(crate) fn grad_bias(g: &Geometry, dy: &[f32], db: &mut [f32], accumulate: bool) {
    if !accumulate {
        db.fill(0.0);
    }
    let pixels = g.oh * g.ow;
    match g.layout {
        // A plane at a time in 16 f32 lanes, the lanes and planes summed in f64.
        Layout::Nchw => {
            for (c, d) in db.iter_mut().enumerate() {
                let s: f64 = (0..g.batch)
                    .map(|n| plane_sum(&dy[(n * g.c_out + c) * pixels..][..pixels]))
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
