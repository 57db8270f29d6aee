//! int8 convolution as im2col + GEMM, exact in i32: ONNX QLinearConv's arithmetic.
//!
//! Inside, everything is NHWC and u8: `C[pixels x c_out/g] = im2col[pixels x K] · W^T` per
//! image and group, K in (ky, kx, ci) order, so each tap of an im2col row is one contiguous
//! run of channels. The activations are the A operand, read by the microkernels through row
//! pointers: straight into the input for 1x1 convolutions (no im2col at all, padding rows
//! point at a row of zero points), else into im2col rows built a block of pixels at a time
//! in the worker's scratch. The weights are B, packed at create time in panels of `nr`
//! output channels, four K steps ("quads") at a time, with the i32 bias of each channel.
//!
//! The input zero point never enters the inner loop: `Σ (x - zx)·w = Σ x·w - zx·Σ w`, and
//! `zx·Σ w` is folded into the bias at create time (padding is filled with the zero point, so
//! it adds exactly nothing). i8 inputs are shifted into u8 (`x + 128`, one xor) on their way
//! in, with the zero point shifted alike.
//!
//! NCHW tensors go through an NHWC copy of the input (a byte transpose, in the workspace)
//! and an NHWC block of outputs per work item, transposed into place.

use super::{for_each_worker, SendPtr};
use crate::cpu::Isa;
use crate::params::Geometry;
use crate::{Activation, Layout};

/// What the microkernel's epilogue stores.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QMode {
    /// The i32 sums plus bias.
    I32,
    /// `(sum + bias) as f32 * scale`.
    F32,
    /// u8 or i8: `round_half_even(clamp((sum + bias) as f32 * scale, lo, hi)) + zero_point`,
    /// stored as its low byte (the clamp keeps it in the byte's range).
    Q8,
}

/// The epilogue of one microkernel call: the kernel contract's params struct.
#[repr(C)]
pub struct QEpilogue {
    pub mode: QMode,
    /// The i32 bias of this tile's columns (channels).
    pub bias: *const i32,
    /// The f32 scale (F32) or requantisation multiplier (Q8) of this tile's columns.
    pub scale: *const f32,
    pub zero_point: i32,
    /// Q8: bounds of the scaled value, relative to the zero point (the output type's range,
    /// narrowed by a fused ReLU or clamp).
    pub lo: f32,
    pub hi: f32,
}

/// The signature every int8 GEMM microkernel has (see `codegen/src/qgemm.rs`).
pub type QGemmFn =
    unsafe fn(usize, *const *const u8, *const u8, *mut u8, isize, usize, usize, &QEpilogue);

/// A generated int8 microkernel and its register tile.
pub struct QGemmKernel {
    pub name: &'static str,
    pub isa: Isa,
    /// Needs AVX-512 VNNI (on top of `isa`).
    pub vnni: bool,
    pub func: QGemmFn,
    /// Pixels (rows) of the tile.
    pub mr: usize,
    /// Output channels (columns) of the tile.
    pub nr: usize,
    /// Bytes of a packed weight: 1 (i8), or 2 for the kernels that widen to i16.
    pub b_bytes: usize,
}

/// Requantises one sum, exactly as the kernels do: f32 multiply, clamp, round half to even.
#[inline]
pub fn requantize(acc: i32, mult: f32, lo: f32, hi: f32, zero_point: i32) -> i32 {
    (acc as f32 * mult).max(lo).min(hi).round_ties_even() as i32 + zero_point
}

/// Stores the edge tile `tile` (rows `ld` apart) into the `m x n` corner of C with the
/// epilogue, in scalar code. Every generated kernel calls it for partial tiles.
///
/// # Safety
/// `c` must be valid for `m` rows `rs_c` elements apart of `n` elements of the type of
/// `ep.mode`; `ep.bias` and `ep.scale` must hold `n` values; `tile` `m` rows of `ld >= n`.
pub unsafe fn store_edge(
    tile: &[i32],
    ld: usize,
    c: *mut u8,
    rs_c: isize,
    m: usize,
    n: usize,
    ep: &QEpilogue,
) {
    for i in 0..m {
        for j in 0..n {
            let v = tile[i * ld + j].wrapping_add(*ep.bias.add(j));
            let at = i as isize * rs_c + j as isize;
            match ep.mode {
                QMode::I32 => *(c as *mut i32).offset(at) = v,
                QMode::F32 => *(c as *mut f32).offset(at) = v as f32 * *ep.scale.add(j),
                QMode::Q8 => {
                    let q = requantize(v, *ep.scale.add(j), ep.lo, ep.hi, ep.zero_point);
                    *c.offset(at) = q as u8;
                }
            }
        }
    }
}

/// The output side of a quantized convolution, fixed at create time.
#[derive(Clone, Debug)]
pub(crate) struct QOut {
    pub mode: QMode,
    /// Per output channel: the i32 bias with the input zero point folded in.
    pub bias: Vec<i32>,
    /// Per output channel: the f32 scale or requantisation multiplier.
    pub scale: Vec<f32>,
    pub zero_point: i32,
    pub lo: f32,
    pub hi: f32,
    /// F32 output: the activation after the scale (and residual).
    pub activation: Activation,
}

impl QOut {
    /// Bytes of one output element.
    pub(crate) fn elem_bytes(&self) -> usize {
        match self.mode {
            QMode::Q8 => 1,
            _ => 4,
        }
    }
}

/// Weights packed for one int8 GEMM kernel.
pub(crate) struct QGemm {
    kern: &'static QGemmKernel,
    /// Per group: panels of `nr` channels, each `kq` quads of `nr x 4` weights.
    packed: Vec<u8>,
    group_len: usize,
    /// Per group, padded to whole panels: bias and scale.
    bias: Vec<i32>,
    scale: Vec<f32>,
    cout_pad: usize,
    kq: usize,
    /// The input zero point in u8 (what padding is filled with).
    zu: u8,
}

/// How one plan splits the work.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QGemmPlan {
    /// Pixels an item covers (a multiple of `mr`), and how many such chunks an image has.
    pchunk: usize,
    pchunks: usize,
    /// Output channels an item covers (a multiple of `nr`), and how many chunks a group has.
    cchunk: usize,
    cchunks: usize,
    workers: usize,
    /// 1x1 with whole quads of channels: A rows point into the input, no im2col.
    direct_rows: bool,
    /// Bytes of the NHWC u8 copy of the input (0: the input is read as it is).
    input_copy: usize,
    /// Bytes of scratch each worker gets.
    per_worker: usize,
}

impl QGemmPlan {
    pub(crate) fn workspace_bytes(&self) -> usize {
        self.input_copy + self.workers * self.per_worker
    }
}

/// Bytes of the row pointers of an item's pixels, whole register blocks of them.
fn ptrs_bytes(pchunk: usize, mr: usize) -> usize {
    (pchunk.div_ceil(mr) * mr * std::mem::size_of::<usize>()).next_multiple_of(64)
}

/// Bytes of im2col rows an item may fill: with the weights panel, they stay in L2.
const ROWS_BYTES: usize = 192 * 1024;

impl QGemm {
    /// Packs `weights` (OIHW i8) for `kern`; `out.bias` and `out.scale` hold `c_out` values.
    pub(crate) fn new(
        g: &crate::ConvParams,
        weights: &[i8],
        out: &QOut,
        zu: u8,
        kern: &'static QGemmKernel,
    ) -> crate::Result<Self> {
        let (cin_g, cout_g, groups) = (
            g.in_channels_per_group(),
            g.out_channels_per_group(),
            g.groups,
        );
        let taps = g.kernel[0] * g.kernel[1];
        let k = cin_g * taps;
        let kq = k.div_ceil(4);
        let nr = kern.nr;
        let cout_pad = cout_g.div_ceil(nr) * nr;
        let group_len = crate::params::mul(&[cout_pad, kq, 4, kern.b_bytes], "packed weights")?;
        let total = crate::params::mul(&[group_len, groups], "packed weights")?;
        let mut packed = Vec::new();
        packed
            .try_reserve_exact(total)
            .map_err(|_| crate::Error::OutOfMemory {
                what: "packed weights",
                bytes: total,
            })?;
        packed.resize(total, 0u8);
        for grp in 0..groups {
            let dst = &mut packed[grp * group_len..(grp + 1) * group_len];
            for co in 0..cout_g {
                let (panel, j) = (co / nr, co % nr);
                let oc = grp * cout_g + co;
                for kk in 0..k {
                    let (tap, ci) = (kk / cin_g, kk % cin_g);
                    let w = weights[(oc * cin_g + ci) * taps + tap];
                    let (q, t) = (kk / 4, kk % 4);
                    let at = ((panel * kq + q) * nr + j) * 4 + t;
                    match kern.b_bytes {
                        1 => dst[at] = w as u8,
                        _ => dst[2 * at..2 * at + 2].copy_from_slice(&(w as i16).to_le_bytes()),
                    }
                }
            }
        }
        let mut bias = vec![0i32; groups * cout_pad];
        let mut scale = vec![0f32; groups * cout_pad];
        for grp in 0..groups {
            for co in 0..cout_g {
                bias[grp * cout_pad + co] = out.bias[grp * cout_g + co];
                scale[grp * cout_pad + co] = out.scale[grp * cout_g + co];
            }
        }
        Ok(QGemm {
            kern,
            packed,
            group_len,
            bias,
            scale,
            cout_pad,

            kq,
            zu,
        })
    }

    pub(crate) fn kernel_name(&self) -> &'static str {
        self.kern.name
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize, flip: bool) -> QGemmPlan {
        let (mr, nr) = (self.kern.mr, self.kern.nr);
        let pixels = g.oh * g.ow;
        let direct_rows = g.kh == 1 && g.kw == 1 && g.cin_g().is_multiple_of(4);
        let k4 = 4 * self.kq;
        // Pixels an item: im2col rows within ROWS_BYTES, whole register blocks.
        let rows_fit = (ROWS_BYTES / k4.max(1)).max(mr) / mr;
        let blocks = pixels.div_ceil(mr).max(1);
        let panels = self.cout_pad / nr;
        let outer = g.batch * g.groups;
        let t = threads.max(1);
        let (pchunks, cchunks) = split(blocks, panels, outer, rows_fit, t);
        let pchunk = blocks.div_ceil(pchunks) * mr;
        let cchunk = panels.div_ceil(cchunks) * nr;
        let (pchunks, cchunks) = (pixels.div_ceil(pchunk), self.cout_pad.div_ceil(cchunk));
        let workers = t.min(outer * pchunks * cchunks).max(1);
        let input_copy = if g.layout == Layout::Nchw || flip {
            (g.batch * g.c_in * g.h * g.w).next_multiple_of(64)
        } else {
            0
        };
        let rows = if direct_rows { 0 } else { pchunk * k4 };
        // A row of zero points for padding (and rows past the end), K4 long.
        let zrow = k4.next_multiple_of(64);
        let cblock = if g.layout == Layout::Nchw {
            pchunk * cchunk * 4
        } else {
            0
        };
        QGemmPlan {
            pchunk,
            pchunks,
            cchunk,
            cchunks,
            workers,
            direct_rows,
            input_copy,
            per_worker: (rows.next_multiple_of(64) + zrow + cblock + ptrs_bytes(pchunk, mr))
                .next_multiple_of(64),
        }
    }

    /// Runs a planned convolution. `input` is u8 (i8 inputs come with `flip` = 0x80);
    /// `output` is the output tensor's bytes; slice lengths were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &QGemmPlan,
        g: &Geometry,
        out: &QOut,
        input: &[u8],
        flip: u8,
        residual: Option<&[f32]>,
        output: &mut [u8],
        scratch: &mut [u8],
    ) {
        let (copy, scratch) = scratch[..plan.workspace_bytes()].split_at_mut(plan.input_copy);
        let x: &[u8] = if plan.input_copy > 0 {
            to_nhwc_u8(input, copy, g, flip, plan.workers, self.kern.isa);
            copy
        } else {
            input
        };
        let job = Job {
            plan,
            g,
            out,
            x,
            residual,
            y: SendPtr(output.as_mut_ptr() as *mut f32),
        };
        let items = g.batch * g.groups * plan.pchunks * plan.cchunks;
        let scratch: &mut [f32] = bytemuck::cast_slice_mut(scratch);
        for_each_worker(plan.workers, items, scratch, |s, item| {
            // SAFETY: items write disjoint blocks of the output (distinct image, group,
            // pixels or channels), which `output` covers: its length was checked. The
            // kernel's ISA was checked at create.
            unsafe { self.run_item_isa(&job, bytemuck::cast_slice_mut(s), item) };
        });
    }

    /// Runs one item with the im2col and stores compiled for the kernel's ISA.
    ///
    /// # Safety
    /// As [`QGemm::run_item`], and the CPU must have the kernel's ISA.
    unsafe fn run_item_isa(&self, job: &Job, scratch: &mut [u8], item: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
            unsafe fn avx512(a: &QGemm, job: &Job, scratch: &mut [u8], item: usize) {
                a.run_item(job, scratch, item)
            }
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2(a: &QGemm, job: &Job, scratch: &mut [u8], item: usize) {
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

    /// One item: a block of pixels and channels of one image and group.
    ///
    /// # Safety
    /// `job.y` must point to the whole output tensor, and no other thread may write this
    /// item's block during the call.
    #[inline(always)]
    unsafe fn run_item(&self, job: &Job, scratch: &mut [u8], item: usize) {
        let Job {
            plan,
            g,
            out,
            x,
            residual,
            y,
        } = *job;
        let (mr, nr) = (self.kern.mr, self.kern.nr);
        let k4 = 4 * self.kq;
        let per_image = g.groups * plan.pchunks * plan.cchunks;
        let (img, rest) = (item / per_image, item % per_image);
        let grp = rest / (plan.pchunks * plan.cchunks);
        let pi = rest / plan.cchunks % plan.pchunks;
        let ci = rest % plan.cchunks;
        let pixels = g.oh * g.ow;
        let (p0, c0) = (pi * plan.pchunk, ci * plan.cchunk);
        let np = plan.pchunk.min(pixels - p0);
        let nc = plan.cchunk.min(g.cout_g().saturating_sub(c0));
        if nc == 0 {
            return;
        }
        let rows_len = if plan.direct_rows {
            0
        } else {
            (plan.pchunk * k4).next_multiple_of(64)
        };
        let (ptrs, rest) = scratch.split_at_mut(ptrs_bytes(plan.pchunk, mr));
        let (rows, rest) = rest.split_at_mut(rows_len);
        let (zrow, cblock) = rest.split_at_mut(k4.next_multiple_of(64));
        zrow.fill(self.zu);
        let cin_g = g.cin_g();
        let image = &x[img * g.h * g.w * g.c_in..(img + 1) * g.h * g.w * g.c_in];
        if !plan.direct_rows {
            im2col_rows(image, g, grp, p0, np, k4, self.zu, rows);
        }
        // Where each pixel's A row starts, once for every panel: an im2col row, the input
        // (1x1), or the zero-point row (padding, and the rows past the last pixel).
        let ptrs: &mut [usize] = bytemuck::cast_slice_mut(ptrs);
        let (mut oy, mut ox) = (p0 / g.ow, p0 % g.ow);
        for (p, slot) in ptrs.iter_mut().enumerate() {
            *slot = if p >= np {
                zrow.as_ptr() as usize
            } else if !plan.direct_rows {
                rows.as_ptr() as usize + p * k4
            } else {
                let iy = (oy * g.sh) as isize - g.pad_top as isize;
                let ix = (ox * g.sw) as isize - g.pad_left as isize;
                ox += 1;
                if ox == g.ow {
                    (ox, oy) = (0, oy + 1);
                }
                if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                    zrow.as_ptr() as usize
                } else {
                    let at = (iy as usize * g.w + ix as usize) * g.c_in + grp * cin_g;
                    image[at..].as_ptr() as usize
                }
            };
        }
        let eb = out.elem_bytes();
        // Where the tile of pixel p, channel c (within the item) goes, and the row stride.
        let (dst, rs): (*mut u8, usize) = match g.layout {
            Layout::Nhwc => (
                (y.get() as *mut u8)
                    .add(((img * pixels + p0) * g.c_out + grp * g.cout_g() + c0) * eb),
                g.c_out,
            ),
            Layout::Nchw => (cblock.as_mut_ptr(), plan.cchunk),
        };
        let weights = &self.packed[grp * self.group_len..];
        let wpanel = self.kq * nr * 4 * self.kern.b_bytes;
        let cbase = grp * self.cout_pad;
        for jc in (0..nc).step_by(nr) {
            let nn = nr.min(nc - jc);
            let col = c0 + jc;
            let b = weights.as_ptr().add(col / nr * wpanel);
            let ep = QEpilogue {
                mode: out.mode,
                bias: self.bias.as_ptr().add(cbase + col),
                scale: self.scale.as_ptr().add(cbase + col),
                zero_point: out.zero_point,
                lo: out.lo,
                hi: out.hi,
            };
            for ir in (0..np).step_by(mr) {
                let mm = mr.min(np - ir);
                let a_rows = ptrs[ir..].as_ptr() as *const *const u8;
                let c = dst.add((ir * rs + jc) * eb);
                // SAFETY: every row pointer is readable for k4 bytes (im2col rows, the zero
                // row, or a 1x1 input row of cin_g = k4 channels); the weights panel holds kq
                // quads of nr channels; the tile lies inside the output (or the C block);
                // bias and scale are padded to whole panels.
                (self.kern.func)(self.kq, a_rows, b, c, rs as isize, mm, nn, &ep);
            }
        }
        // NCHW: the block of pixels x channels into its channel planes.
        if g.layout == Layout::Nchw {
            let plane0 = (img * g.c_out + grp * g.cout_g() + c0) * pixels + p0;
            let base = (y.get() as *mut u8).add(plane0 * eb);
            transpose_block(cblock, plan.cchunk, np, nc, eb, base, pixels, self.kern.isa);
        }
        // F32 output: residual and activations over the finished block.
        if out.mode == QMode::F32 && (residual.is_some() || out.activation != Activation::None) {
            let yf = y.get();
            let pass = |at: usize, len: usize, step: usize| {
                for t in 0..len {
                    let v = yf.add(at + t * step);
                    let mut f = *v;
                    if let Some(r) = residual {
                        f += r[at + t * step];
                    }
                    *v = out.activation.apply(f);
                }
            };
            match g.layout {
                Layout::Nhwc => {
                    for p in 0..np {
                        let at = (img * pixels + p0 + p) * g.c_out + grp * g.cout_g() + c0;
                        pass(at, nc, 1);
                    }
                }
                Layout::Nchw => {
                    for c in 0..nc {
                        let at = (img * g.c_out + grp * g.cout_g() + c0 + c) * pixels + p0;
                        pass(at, np, 1);
                    }
                }
            }
        }
    }
}

/// How many chunks of pixel blocks and of channel panels the items take: the split whose
/// busiest worker has the least work (in block x panel products), chunks of at most
/// `rows_fit` blocks (the im2col rows stay in L2), fewest items among equals. A 7x7 layer on
/// two threads splits its 16 panels 8:8 rather than its 7 pixel blocks 4:3: each worker then
/// also streams only half the weights (measured, resnet50_l4_3x3 on two threads: 390 -> 720
/// GOP/s).
fn split(blocks: usize, panels: usize, outer: usize, rows_fit: usize, t: usize) -> (usize, usize) {
    let p_min = blocks.div_ceil(rows_fit.max(1));
    let mut best = (usize::MAX, usize::MAX, (p_min, 1));
    for p in p_min..=blocks.min(p_min + 4 * t) {
        for c in 1..=panels.min(4 * t) {
            let items = outer * p * c;
            let per_item = blocks.div_ceil(p) * panels.div_ceil(c);
            let busiest = items.div_ceil(t) * per_item;
            if (busiest, items) < (best.0, best.1) {
                best = (busiest, items, (p, c));
            }
        }
    }
    best.2
}

/// Everything an item needs, shared by the workers.
#[derive(Clone, Copy)]
struct Job<'a> {
    plan: &'a QGemmPlan,
    g: &'a Geometry,
    out: &'a QOut,
    /// The NHWC u8 input.
    x: &'a [u8],
    residual: Option<&'a [f32]>,
    y: SendPtr,
}

/// The im2col rows of pixels `p0..p0+np` of one image and group: row `p` is `k4` bytes, the
/// taps in (ky, kx) order, each `cin_g` channels, padding filled with `zu`, the tail of the
/// last quad with 0.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn im2col_rows(
    image: &[u8],
    g: &Geometry,
    grp: usize,
    p0: usize,
    np: usize,
    k4: usize,
    zu: u8,
    rows: &mut [u8],
) {
    let cin_g = g.cin_g();
    let k = cin_g * g.kh * g.kw;
    // Taps along a kernel row are one contiguous run of the input at dilation 1.
    let run = g.kw * cin_g;
    let (mut oy, mut ox) = (p0 / g.ow, p0 % g.ow);
    // Per kernel row of the current output row: where its input line starts, if inside.
    let lines = |oy: usize| {
        let mut at = [None; 16];
        for (ky, a) in at.iter_mut().enumerate().take(g.kh.min(16)) {
            let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
            if iy >= 0 && iy < g.h as isize {
                *a = Some(iy as usize * g.w * g.c_in);
            }
        }
        at
    };
    let mut line_at = lines(oy);
    for row in rows.chunks_exact_mut(k4).take(np) {
        let ix0 = (ox * g.sw) as isize - g.pad_left as isize;
        let inside_x = ix0 >= 0 && ix0 as usize + (g.kw - 1) * g.dw < g.w;
        for ky in 0..g.kh {
            let dst = &mut row[ky * run..(ky + 1) * run];
            let line = match if ky < 16 { line_at[ky] } else { None } {
                Some(at) => &image[at..at + g.w * g.c_in],
                None if ky < 16 => {
                    dst.fill(zu);
                    continue;
                }
                None => {
                    // Kernels taller than 16 rows: the row's line, computed here.
                    let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
                    if iy < 0 || iy >= g.h as isize {
                        dst.fill(zu);
                        continue;
                    }
                    &image[iy as usize * g.w * g.c_in..(iy as usize + 1) * g.w * g.c_in]
                }
            };
            if inside_x && g.dw == 1 {
                let from = ix0 as usize * g.c_in + grp * cin_g;
                if cin_g == g.c_in {
                    copy_small(dst, &line[from..from + run]);
                } else {
                    for (kx, d) in dst.chunks_exact_mut(cin_g).enumerate() {
                        let at = from + kx * g.c_in;
                        copy_small(d, &line[at..at + cin_g]);
                    }
                }
                continue;
            }
            for (kx, d) in dst.chunks_exact_mut(cin_g).enumerate() {
                let ix = ix0 + (kx * g.dw) as isize;
                if ix < 0 || ix >= g.w as isize {
                    d.fill(zu);
                } else {
                    let at = ix as usize * g.c_in + grp * cin_g;
                    copy_small(d, &line[at..at + cin_g]);
                }
            }
        }
        row[k..].fill(0);
        ox += 1;
        if ox == g.ow {
            (ox, oy) = (0, oy + 1);
            line_at = lines(oy);
        }
    }
}

/// `dst.copy_from_slice(src)`, without a call to `memcpy` for the few bytes of a stem's taps.
#[inline(always)]
fn copy_small(dst: &mut [u8], src: &[u8]) {
    if dst.len() <= 16 {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = *s;
        }
    } else {
        dst.copy_from_slice(src);
    }
}

/// The input as NHWC u8: NCHW transposed, i8 shifted by 128 (`flip` = 0x80), by `workers`
/// workers, each a range of pixels of every image.
fn to_nhwc_u8(input: &[u8], dst: &mut [u8], g: &Geometry, flip: u8, workers: usize, isa: Isa) {
    let (c, hw) = (g.c_in, g.h * g.w);
    let pixels = g.batch * hw;
    let per = pixels.div_ceil(workers.max(1)).max(1);
    assert!(dst.len() >= pixels * c, "the input copy holds every pixel");
    let out = SendPtr(dst.as_mut_ptr() as *mut f32);
    for_each_worker(workers, pixels.div_ceil(per), &mut [], |_, item| {
        let (p0, p1) = (item * per, ((item + 1) * per).min(pixels));
        // SAFETY: pixels p0..p1 of the copy (c bytes each, inside it: asserted above) are
        // this item's alone.
        let dst = unsafe {
            std::slice::from_raw_parts_mut((out.get() as *mut u8).add(p0 * c), (p1 - p0) * c)
        };
        match g.layout {
            Layout::Nhwc => {
                for (d, s) in dst.iter_mut().zip(&input[p0 * c..p1 * c]) {
                    *d = s ^ flip;
                }
            }
            Layout::Nchw => {
                // Pixel ranges split at image boundaries.
                let mut p = p0;
                while p < p1 {
                    let (b, q) = (p / hw, p % hw);
                    let n = (hw - q).min(p1 - p);
                    let src = &input[b * c * hw + q..];
                    let d = &mut dst[(p - p0) * c..(p - p0 + n) * c];
                    super::transpose_u8::transpose(src, hw, c, n, d, c, flip, isa);
                    p += n;
                }
            }
        }
    });
}

/// Writes the `np x nc` block (`ld` elements a row, `eb` bytes each) transposed: channel `c`
/// of pixel `p` to `base + (c * plane + p) * eb` (bytes with `isa`'s transpose).
///
/// # Safety
/// `base` must be valid for `nc` planes of `np` elements, `plane` apart.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn transpose_block(
    block: &[u8],
    ld: usize,
    np: usize,
    nc: usize,
    eb: usize,
    base: *mut u8,
    plane: usize,
    isa: Isa,
) {
    match eb {
        1 => {
            // SAFETY: the caller guarantees nc planes of np bytes, `plane` apart.
            let dst = std::slice::from_raw_parts_mut(base, (nc - 1) * plane + np);
            super::transpose_u8::transpose(block, ld, np, nc, dst, plane, 0, isa);
        }
        _ => {
            let src: &[u32] = bytemuck::cast_slice(&block[..(np * ld * 4).next_multiple_of(4)]);
            let base = base as *mut u32;
            for c in 0..nc {
                let d = base.add(c * plane);
                for p in 0..np {
                    *d.add(p) = src[p * ld + c];
                }
            }
        }
    }
}
