//! int8 depthwise convolution (one input channel a group, any channel multiplier), exact in
//! i32, on zero-point padded channel planes.
//!
//! Each worker takes an input channel: it copies the plane into its scratch with a border of
//! the input zero point (and the i8 -> u8 shift), then computes every output row of the
//! channel's outputs from the padded rows, with no bounds checks: the generated AVX-512
//! VNNI kernel of the kernel size and stride where there is one (3, 5, 7; strides 1, 2), else
//! the generic kernel (any size, stride, dilation, every ISA). Planes of at most 64 inputs
//! and outputs (7x7, 8x8 images) skip the padded copy: the small-plane kernel holds a whole
//! plane in one register and gathers every tap from it, the zero point where a tap falls in
//! the padding, a block of channels a call. NHWC tensors are transposed to channel planes and
//! back, in the workspace. The zero point is folded into the bias at create time, as for the
//! GEMM path.

use super::qgemm::{requantize, transpose_block, QMode, QOut};
use super::{for_each_item_claimed, SendPtr};
use crate::cpu::Isa;
use crate::params::Geometry;
use crate::{Activation, ConvParams, Error, Layout, Result};

/// The epilogue of one output row: the channel's bias, scale (or requantisation multiplier),
/// zero point and clamp, as [`QEpilogue`](super::qgemm::QEpilogue) has them per column.
#[repr(C)]
pub struct QDwEpilogue {
    pub mode: QMode,
    /// Bytes of an output element (1 for u8/i8, 4 for i32/f32).
    pub elem_bytes: usize,
    pub bias: i32,
    pub scale: f32,
    pub zero_point: i32,
    pub lo: f32,
    pub hi: f32,
}

/// The signature of the generated int8 depthwise kernels (see `codegen/src/qdw.rs`).
/// Arguments: the padded plane, its row length, the output height and width, the flat
/// mode's gather table (or null), the weights, the output plane, the epilogue.
pub type QDwFn =
    unsafe fn(*const u8, usize, usize, usize, *const u8, *const i32, *mut u8, &QDwEpilogue);

/// A generated int8 depthwise kernel: a `k x k` kernel at stride `s`, dilation 1.
pub struct QDwKernel {
    pub name: &'static str,
    pub func: QDwFn,
    pub k: usize,
    pub s: usize,
}

/// The arguments of the small-plane kernel (see `codegen/src/qdw.rs`): a block of `planes`
/// input channel planes of at most 64 bytes, each with `mult` output channels of at most 64
/// outputs, in place (no padded copy).
#[repr(C)]
pub struct QDwSmallArgs {
    /// The block's first input plane; `x_len` bytes are readable from it, more than
    /// `(planes - 1) · in_step` (a plane is loaded 64 bytes at a time where that many remain).
    pub x: *const u8,
    pub x_len: usize,
    /// Bytes between input planes.
    pub in_step: usize,
    pub planes: usize,
    /// Output channels an input channel.
    pub mult: usize,
    /// Per tap quad `q` and output vector `v` (16 outputs): at `idx[(4q + v) · 64]` the
    /// `vpermb` indices into the plane of every output's four inputs, and `masks[4q + v]` the
    /// bytes that are in the image (the others are the zero point).
    pub idx: *const u8,
    pub masks: *const u64,
    /// Tap quads (`⌈kh·kw / 4⌉`).
    pub nq: usize,
    /// Per output channel of the block: `nq` quads of i8 weights (taps in `ky·kw + kx` order),
    /// the bias and the scale.
    pub w: *const i32,
    pub bias: *const i32,
    pub scale: *const f32,
    /// The first output plane, bytes between output planes, outputs a plane (at most 64).
    pub out: *mut u8,
    pub out_step: usize,
    pub ohw: usize,
    pub mode: QMode,
    pub zero_point: i32,
    pub lo: f32,
    pub hi: f32,
    /// The input zero point as u8, and the i8 -> u8 shift.
    pub zu: u8,
    pub flip: u8,
}

/// The signature of the small-plane kernel.
pub type QDwSmallFn = unsafe fn(&QDwSmallArgs);

/// A generated small-plane kernel: any kernel size, stride and dilation.
#[derive(Debug)]
pub struct QDwSmallKernel {
    pub name: &'static str,
    pub func: QDwSmallFn,
}

/// The largest input plane, and output plane, the small-plane kernel takes: one register.
const SMALL_PLANE: usize = 64;

/// Bytes every padded plane has after its last row, for the kernels' 64-byte loads.
const SLACK: usize = 128;

/// The padded planes a work item writes before it runs their kernels: small planes come in
/// blocks of up to this many bytes (in L1), large ones one at a time.
const BLOCK_BYTES: usize = 16 * 1024;

/// Planes up to this many bytes are padded by gathers (one load and one `vpermb` a 64 bytes)
/// rather than row by row (two loads a row of a 7x7 image, where most bytes are padding).
const GATHER_PLANE: usize = 4096;

/// How one 64-byte chunk of a padded plane is made: byte `i` is byte `idx[i]` of the 64
/// image bytes from `src` where bit `i` of `mask` is set, else the zero point.
#[derive(Clone, Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // generated kernels are x86 only
struct Gather {
    src: usize,
    mask: u64,
    idx: [u8; 64],
}

pub(crate) struct QDepthwise {
    kern: Option<&'static QDwKernel>,
    /// The generated kernel's weights: per output channel, `kh` rows of i32 quads.
    quads: Vec<i32>,
    /// The small-plane kernel, for the planes it takes, and whether it was forced (then it
    /// must take them).
    small: Option<&'static QDwSmallKernel>,
    small_only: bool,
    /// Its weights: per output channel, the taps in quads (`small_nq` of them).
    small_quads: Vec<i32>,
    small_nq: usize,
    /// OIHW weights (the generic kernel).
    weights: Vec<i8>,
    zu: u8,
}

/// The small-plane kernel's gather tables (see [`QDwSmallArgs`]).
#[derive(Clone, Debug)]
struct SmallTable {
    idx: Vec<u8>,
    masks: Vec<u64>,
}

#[derive(Clone, Debug)]
pub(crate) struct QDwPlan {
    /// The small-plane kernel and its tables, where it runs (then there are no padded planes).
    small: Option<(&'static QDwSmallKernel, SmallTable)>,
    /// The flat mode's `vpermb` indices (see `codegen/src/qdw.rs`): for each column a vector
    /// of 16 consecutive outputs may start at, where each output's four bytes are relative to
    /// the first output's; empty where they do not fit one 64-byte load (row mode).
    table: Vec<u8>,
    /// Small planes: how each 64 bytes of the padded plane gather from the image (see
    /// [`gather_chunks`]); empty for large planes, which are copied a row at a time.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    gathers: Vec<Gather>,
    workers: usize,
    /// Padded plane: row length, bytes.
    wp: usize,
    plane: usize,
    /// Channels a work item (planes a worker's scratch holds).
    block: usize,
    /// NHWC: the CHW copies of input and output.
    in_copy: usize,
    out_copy: usize,
}

impl QDwPlan {
    pub(crate) fn workspace_bytes(&self) -> usize {
        self.in_copy + self.out_copy + self.workers * self.block * self.plane
    }
}

impl QDepthwise {
    /// Why the generated kernel `k` does not take `p` (None: it does).
    pub(crate) fn rejects(p: &ConvParams, k: &QDwKernel) -> Option<String> {
        if p.kernel == [k.k, k.k] && p.stride == [k.s, k.s] && p.dilation == [1, 1] {
            return None;
        }
        Some(format!(
            "{} takes {}x{} kernels at stride {} and dilation 1, not kernel {:?}, stride {:?}, \
             dilation {:?}",
            k.name, k.k, k.k, k.s, p.kernel, p.stride, p.dilation
        ))
    }

    /// The level of the NHWC transposes: the generated kernels are all AVX-512 (VNNI).
    fn transpose_isa(&self) -> Isa {
        if self.kern.is_some() {
            Isa::Avx512
        } else {
            Isa::Scalar
        }
    }

    /// `kern`: the generated row kernel for the shape, if any; `small`: the small-plane
    /// kernel where the CPU has it, and whether it was forced (then no other kernel runs).
    pub(crate) fn new(
        p: &ConvParams,
        weights: &[i8],
        zu: u8,
        kern: Option<&'static QDwKernel>,
        small: Option<(&'static QDwSmallKernel, bool)>,
    ) -> Self {
        let (kh, kw) = (p.kernel[0], p.kernel[1]);
        // The row kernels read each kernel row's taps in quads; the small-plane kernel the
        // whole kernel's, as one row.
        let taps = kh * kw;
        let quads = match kern {
            Some(_) => tap_quads(weights, kw),
            None => Vec::new(),
        };
        let small_nq = taps.div_ceil(4);
        let small_quads = match small {
            Some(_) => tap_quads(weights, taps),
            None => Vec::new(),
        };
        QDepthwise {
            kern: if small.is_some_and(|s| s.1) {
                None
            } else {
                kern
            },
            quads,
            small: small.map(|s| s.0),
            small_only: small.is_some_and(|s| s.1),
            small_quads,
            small_nq,
            weights: weights.to_vec(),
            zu,
        }
    }

    /// Whether the small-plane kernel takes `g`: every plane in one register.
    fn small_fits(g: &Geometry) -> bool {
        g.h * g.w <= SMALL_PLANE && g.oh * g.ow <= SMALL_PLANE
    }

    /// The small-plane kernel's tables for `g` (see [`QDwSmallArgs`]): for tap quad `q` and
    /// output vector `v`, lane `j`'s byte `t` reads tap `4q + t` of output `16v + j`.
    fn small_table(g: &Geometry) -> SmallTable {
        let nq = (g.kh * g.kw).div_ceil(4);
        let mut idx = vec![0u8; nq * 4 * 64];
        let mut masks = vec![0u64; nq * 4];
        for q in 0..nq {
            for v in 0..4 {
                for j in 0..16 {
                    let o = 16 * v + j;
                    for t in 0..4 {
                        let tap = 4 * q + t;
                        if o >= g.oh * g.ow || tap >= g.kh * g.kw {
                            continue;
                        }
                        let (oy, ox, ky, kx) = (o / g.ow, o % g.ow, tap / g.kw, tap % g.kw);
                        let iy = (oy * g.sh + ky * g.dh).wrapping_sub(g.pad_top);
                        let ix = (ox * g.sw + kx * g.dw).wrapping_sub(g.pad_left);
                        if iy < g.h && ix < g.w {
                            let lane = 4 * j + t;
                            idx[(4 * q + v) * 64 + lane] = (iy * g.w + ix) as u8;
                            masks[4 * q + v] |= 1 << lane;
                        }
                    }
                }
            }
        }
        SmallTable { idx, masks }
    }

    /// The kernel a plan runs.
    pub(crate) fn kernel_name(&self, plan: &QDwPlan) -> &'static str {
        match (&plan.small, self.kern) {
            (Some((k, _)), _) => k.name,
            (None, Some(k)) => k.name,
            (None, None) => "qdw_u8i8_generic",
        }
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> Result<QDwPlan> {
        if let Some(k) = self
            .small
            .filter(|_| self.small_only && !Self::small_fits(g))
        {
            return Err(Error::AlgorithmUnsupported {
                algorithm: "int8 depthwise",
                reason: format!(
                    "{} takes planes of at most {SMALL_PLANE} inputs and outputs, not {}x{} -> \
                     {}x{}",
                    k.name, g.h, g.w, g.oh, g.ow
                ),
            });
        }
        let small = self
            .small
            .filter(|_| Self::small_fits(g))
            .map(|k| (k, Self::small_table(g)));
        let hp = g.pad_top + g.h + g.pad_bottom;
        let wp = g.pad_left + g.w + g.pad_right;
        let nhwc = g.layout == Layout::Nhwc;
        let eb = 4; // the largest output element; planes of bytes are smaller

        // Flat-mode vectors past the last output read up to two output rows further. The
        // small-plane kernel reads the planes in place.
        let plane = match small {
            Some(_) => 0,
            None => ((hp + 2 * g.sh + 2) * wp + SLACK).next_multiple_of(64),
        };
        // At least four items a thread, for balance.
        let block = (BLOCK_BYTES / plane.max(1))
            .min((g.batch * g.c_in).div_ceil(4 * threads.max(1)))
            .clamp(1, g.c_in);
        let table = match self.kern {
            Some(_) if small.is_none() => flat_table(g, wp),
            _ => Vec::new(),
        };
        let gathers = match self.kern {
            Some(_) if small.is_none() && plane <= GATHER_PLANE => gather_chunks(g, wp, plane),
            _ => Vec::new(),
        };
        Ok(QDwPlan {
            small,
            table,
            gathers,
            workers: threads.max(1).min(g.batch * g.c_in.div_ceil(block)).max(1),
            wp,
            plane,
            block,
            in_copy: if nhwc {
                (g.batch * g.c_in * g.h * g.w).next_multiple_of(64)
            } else {
                0
            },
            out_copy: if nhwc {
                (g.batch * g.c_out * g.oh * g.ow * eb).next_multiple_of(64)
            } else {
                0
            },
        })
    }

    /// Runs a planned convolution (see [`QGemm::run`](super::qgemm::QGemm::run) for the
    /// arguments).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &QDwPlan,
        g: &Geometry,
        out: &QOut,
        input: &[u8],
        flip: u8,
        residual: Option<&[f32]>,
        output: &mut [u8],
        scratch: &mut [u8],
    ) {
        let eb = out.elem_bytes();
        let (in_copy, rest) = scratch[..plan.workspace_bytes()].split_at_mut(plan.in_copy);
        let (out_copy, planes) = rest.split_at_mut(plan.out_copy);
        let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
        // Channel planes: the input as it is (NCHW), or transposed (NHWC, flipped on the way).
        let (x, flip) = if g.layout == Layout::Nhwc {
            for b in 0..g.batch {
                let n = g.c_in * hw;
                let src = &input[b * n..(b + 1) * n];
                super::transpose_u8::transpose(
                    src,
                    g.c_in,
                    hw,
                    g.c_in,
                    &mut in_copy[b * n..(b + 1) * n],
                    hw,
                    flip,
                    self.transpose_isa(),
                );
            }
            (&in_copy[..], 0)
        } else {
            (input, flip)
        };
        let y = SendPtr(if g.layout == Layout::Nhwc {
            out_copy.as_mut_ptr()
        } else {
            output.as_mut_ptr()
        } as *mut f32);
        let planes: &mut [f32] = bytemuck::cast_slice_mut(planes);
        let mult = g.c_out / g.c_in;
        let blocks = g.c_in.div_ceil(plan.block);
        if let Some((k, table)) = &plan.small {
            self.run_small(plan, k, table, g, out, x, flip, y);
        } else {
            for_each_item_claimed(plan.workers, g.batch * blocks, planes, |scratch, item| {
                let scratch: &mut [u8] = bytemuck::cast_slice_mut(scratch);
                let (b, c0) = (item / blocks, item % blocks * plan.block);
                let cs = plan.block.min(g.c_in - c0);
                // Every plane of the block first: the kernels then read planes whose stores have
                // long retired (a load over several just-issued stores waits for them).
                for (i, plane) in scratch.chunks_exact_mut(plan.plane).take(cs).enumerate() {
                    let ci = c0 + i;
                    // The channel's image and whatever follows it (read, never used, by loads
                    // that run past its end).
                    let src = &x[(b * g.c_in + ci) * hw..];
                    match self.kern {
                        // SAFETY: a generated kernel was chosen, so the CPU has AVX-512BW and VBMI
                        // (checked at create); `src` holds the h x w image, and the plane (a
                        // multiple of 64 bytes) holds the padded rows and every gather's chunk,
                        // since `plan.plane` counts them.
                        #[cfg(target_arch = "x86_64")]
                        Some(_) if !plan.gathers.is_empty() => unsafe {
                            gather_plane_avx512(src, &plan.gathers, plane, self.zu, flip)
                        },
                        // SAFETY: as above.
                        #[cfg(target_arch = "x86_64")]
                        Some(_) => unsafe {
                            pad_plane_avx512(src, g, plan.wp, plane, self.zu, flip)
                        },
                        _ => pad_plane(src, g, plan.wp, plane, self.zu, flip),
                    }
                }
                for (i, plane) in scratch.chunks_exact(plan.plane).take(cs).enumerate() {
                    let ci = c0 + i;
                    for co in ci * mult..(ci + 1) * mult {
                        let ep = QDwEpilogue {
                            mode: out.mode,
                            elem_bytes: eb,
                            bias: out.bias[co],
                            scale: out.scale[co],
                            zero_point: out.zero_point,
                            lo: out.lo,
                            hi: out.hi,
                        };
                        // SAFETY: the output plane (b, co) is this item's alone, inside the output
                        // (or its CHW copy), whose length was checked.
                        let yplane =
                            unsafe { (y.get() as *mut u8).add((b * g.c_out + co) * ohw * eb) };
                        match self.kern {
                            Some(k) => {
                                let w = self.quads[co * g.kh * g.kw.div_ceil(4)..].as_ptr();
                                // SAFETY: the output rows read the plane's rows (oy*s + ky), all
                                // inside the padded plane, which has SLACK bytes after its last row
                                // for the 64-byte loads; the CPU has VNNI and VBMI (checked at
                                // create); yplane holds oh*ow elements.
                                let table = if plan.table.is_empty() {
                                    std::ptr::null()
                                } else {
                                    plan.table.as_ptr()
                                };
                                unsafe {
                                    (k.func)(
                                        plane.as_ptr(),
                                        plan.wp,
                                        g.oh,
                                        g.ow,
                                        table,
                                        w,
                                        yplane,
                                        &ep,
                                    )
                                };
                            }
                            None => {
                                let w = &self.weights[co * g.kh * g.kw..(co + 1) * g.kh * g.kw];
                                for oy in 0..g.oh {
                                    // SAFETY: as above, row oy of the output plane.
                                    unsafe {
                                        generic_row(
                                            plane,
                                            plan.wp,
                                            g,
                                            oy,
                                            w,
                                            yplane.add(oy * g.ow * eb),
                                            &ep,
                                        )
                                    };
                                }
                            }
                        }
                    }
                }
            });
        }
        if g.layout == Layout::Nhwc {
            for b in 0..g.batch {
                let n = g.c_out * ohw * eb;
                let src = &out_copy[b * n..(b + 1) * n];
                // SAFETY: image b of the output holds ohw pixels of c_out elements.
                unsafe {
                    transpose_block(
                        src,
                        ohw,
                        g.c_out,
                        ohw,
                        eb,
                        output.as_mut_ptr().add(b * n),
                        g.c_out,
                        self.transpose_isa(),
                    )
                };
            }
        }
        if out.mode == QMode::F32 && (residual.is_some() || out.activation != Activation::None) {
            let y: &mut [f32] = bytemuck::cast_slice_mut(output);
            for (i, v) in y.iter_mut().enumerate() {
                *v = out.activation.apply(*v + residual.map_or(0.0, |r| r[i]));
            }
        }
    }

    /// The small-plane kernel's run: blocks of channels, each plane read in place.
    #[allow(clippy::too_many_arguments)]
    fn run_small(
        &self,
        plan: &QDwPlan,
        k: &QDwSmallKernel,
        table: &SmallTable,
        g: &Geometry,
        out: &QOut,
        x: &[u8],
        flip: u8,
        y: SendPtr,
    ) {
        let (hw, ohw, eb) = (g.h * g.w, g.oh * g.ow, out.elem_bytes());
        let mult = g.c_out / g.c_in;
        let blocks = g.c_in.div_ceil(plan.block);
        for_each_item_claimed(plan.workers, g.batch * blocks, &mut [], |_, item| {
            let (b, c0) = (item / blocks, item % blocks * plan.block);
            let (first, co) = ((b * g.c_in + c0) * hw, c0 * mult);
            let a = QDwSmallArgs {
                x: x[first..].as_ptr(),
                x_len: x.len() - first,
                in_step: hw,
                planes: plan.block.min(g.c_in - c0),
                mult,
                idx: table.idx.as_ptr(),
                masks: table.masks.as_ptr(),
                nq: self.small_nq,
                w: self.small_quads[co * self.small_nq..].as_ptr(),
                bias: out.bias[co..].as_ptr(),
                scale: out.scale[co..].as_ptr(),
                // SAFETY: the block's output planes are this item's alone, inside the
                // output (or its CHW copy), whose length was checked.
                out: unsafe { (y.get() as *mut u8).add((b * g.c_out + co) * ohw * eb) },
                out_step: ohw * eb,
                ohw,
                mode: out.mode,
                zero_point: out.zero_point,
                lo: out.lo,
                hi: out.hi,
                zu: self.zu,
                flip,
            };
            // SAFETY: the small-plane kernel was chosen, so the CPU has AVX-512 VNNI and
            // VBMI (checked at create); the block's planes are in `x` (the last one starts
            // before its end), the tables are the plan's for this geometry, the weights,
            // bias and scale cover the block's output channels, and every plane holds
            // `ohw <= 64` outputs (`small_fits`).
            unsafe { (k.func)(&a) };
        });
    }
}

/// The weights (OIHW, one input channel) as i32 quads of i8 taps: each run of `row` taps
/// (a kernel row, or the whole kernel) in `⌈row / 4⌉` quads, the last one zero-padded.
fn tap_quads(weights: &[i8], row: usize) -> Vec<i32> {
    weights
        .chunks_exact(row)
        .flat_map(|r| {
            r.chunks(4).map(|q| {
                let mut b = [0u8; 4];
                for (byte, &w) in b.iter_mut().zip(q) {
                    *byte = w as u8;
                }
                i32::from_le_bytes(b)
            })
        })
        .collect()
}

/// Copies the `h x w` image `src` into `plane` with rows `wp` bytes apart, `pad_top` rows and
/// `pad_left` columns of the zero point `zu` before it and zero points everywhere else, each
/// byte xor `flip` (the i8 -> u8 shift).
fn pad_plane(src: &[u8], g: &Geometry, wp: usize, plane: &mut [u8], zu: u8, flip: u8) {
    plane.fill(zu);
    for (iy, row) in src.chunks_exact(g.w).take(g.h).enumerate() {
        let at = (g.pad_top + iy) * wp + g.pad_left;
        for (d, s) in plane[at..at + g.w].iter_mut().zip(row) {
            *d = s ^ flip;
        }
    }
}

/// [`pad_plane`] in 64-byte stores: the padded rows filled whole, then the image rows laid
/// over them with masked loads (no byte loops, no call a row).
///
/// # Safety
/// The CPU must have AVX-512F/BW; `plane.len()` must be a multiple of 64, at least
/// `(pad_top + h) * wp + 64`; `src` must hold at least `h * w` bytes (the image; loads read
/// up to 64 bytes past it where `src` has them).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pad_plane_avx512(
    src: &[u8],
    g: &Geometry,
    wp: usize,
    plane: &mut [u8],
    zu: u8,
    flip: u8,
) {
    use std::arch::x86_64::*;
    assert!(plane.len().is_multiple_of(64) && plane.len() >= (g.pad_top + g.h) * wp + 64);
    assert!(src.len() >= g.h * g.w);
    let z = _mm512_set1_epi8(zu as i8);
    let f = _mm512_set1_epi8(flip as i8);
    let p = plane.as_mut_ptr();
    // A row's stores (whole vectors) run past its image bytes; where they reach the next
    // row's first image byte, they store all of the padding between rows, and only the
    // padding before the first row and after the last needs filling first.
    let span = g.w.next_multiple_of(64);
    let first = g.pad_top * wp + g.pad_left;
    let end = (g.pad_top + g.h).saturating_sub(1) * wp + g.pad_left + span;
    let (head, tail) = if g.h > 0 && span - g.w >= wp - g.w && end + 64 <= plane.len() {
        (first, end)
    } else {
        (plane.len(), plane.len())
    };
    for at in (0..head).step_by(64) {
        _mm512_storeu_si512(p.add(at) as *mut __m512i, z);
    }
    // Zero points where a row's last load ends, flipped twice.
    let zf = _mm512_xor_si512(z, f);
    for iy in 0..g.h {
        let s = src.as_ptr().add(iy * g.w);
        let d = p.add((g.pad_top + iy) * wp + g.pad_left);
        for x in (0..g.w).step_by(64) {
            let m: __mmask64 = if g.w - x >= 64 {
                !0
            } else {
                (1u64 << (g.w - x)) - 1
            };
            // A plain load where 64 bytes remain in `src` (masked loads are slow), masked
            // at its end.
            let v = if iy * g.w + x + 64 <= src.len() {
                _mm512_mask_blend_epi8(m, zf, _mm512_loadu_si512(s.add(x) as *const __m512i))
            } else {
                _mm512_mask_loadu_epi8(zf, m, s.add(x) as *const i8)
            };
            let v = _mm512_xor_si512(v, f);
            // Whole stores, in address order: the zero points a row's last store writes past
            // its end are the padding there, or bytes the next row's stores write again.
            _mm512_storeu_si512(d.add(x) as *mut __m512i, v);
        }
    }
    for at in (tail..plane.len() - 64).step_by(64) {
        _mm512_storeu_si512(p.add(at) as *mut __m512i, z);
    }
    if tail < plane.len() {
        _mm512_storeu_si512(p.add(plane.len() - 64) as *mut __m512i, z);
    }
}

/// The chunks of a padded plane of `plane` bytes, rows `wp` apart. The image bytes a chunk
/// holds are consecutive in the image (its rows are contiguous, the padding only adds
/// bytes), so one 64-byte load from the first of them holds all.
fn gather_chunks(g: &Geometry, wp: usize, plane: usize) -> Vec<Gather> {
    (0..plane / 64)
        .map(|c| {
            let mut at = Vec::new();
            for i in 0..64 {
                let (r, col) = ((64 * c + i) / wp, (64 * c + i) % wp);
                let (iy, ix) = (r.wrapping_sub(g.pad_top), col.wrapping_sub(g.pad_left));
                if iy < g.h && ix < g.w {
                    at.push((i, iy * g.w + ix));
                }
            }
            let src = at.first().map_or(0, |a| a.1);
            let (mut mask, mut idx) = (0u64, [0u8; 64]);
            for (i, s) in at {
                mask |= 1 << i;
                idx[i] = (s - src) as u8;
            }
            Gather { src, mask, idx }
        })
        .collect()
}

/// [`pad_plane`] through the plan's [`Gather`]s: per 64 bytes of the plane, one load, one
/// `vpermb`, one blend with the zero point.
///
/// # Safety
/// The CPU must have AVX-512F/BW and VBMI; `plane` must hold `64 * gathers.len()` bytes;
/// `src` the image (each gather's bytes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
unsafe fn gather_plane_avx512(src: &[u8], gathers: &[Gather], plane: &mut [u8], zu: u8, flip: u8) {
    use std::arch::x86_64::*;
    assert!(plane.len() >= 64 * gathers.len());
    let z = _mm512_set1_epi8(zu as i8);
    let f = _mm512_set1_epi8(flip as i8);
    for (c, ch) in gathers.iter().enumerate() {
        let v = if ch.mask == 0 {
            z
        } else {
            assert!(ch.src < src.len());
            // A plain load where 64 bytes remain (masked loads are slow), masked at the end.
            let left = src.len() - ch.src;
            let raw = if left >= 64 {
                _mm512_loadu_si512(src.as_ptr().add(ch.src) as *const __m512i)
            } else {
                _mm512_maskz_loadu_epi8((1u64 << left) - 1, src.as_ptr().add(ch.src) as *const i8)
            };
            let g = _mm512_xor_si512(
                _mm512_permutexvar_epi8(_mm512_loadu_si512(ch.idx.as_ptr() as *const __m512i), raw),
                f,
            );
            _mm512_mask_blend_epi8(ch.mask, z, g)
        };
        _mm512_storeu_si512(plane.as_mut_ptr().add(64 * c) as *mut __m512i, v);
    }
}

/// The flat mode's gather table for `g` on planes `wp` wide: for each
/// starting column `x0`, output `j` of the vector (`x0 + j` in plane order) reads bytes
/// `rel + t` of the load at the first output's input, `rel` its offset. Empty if some `rel`
/// does not fit one 64-byte load (wide rows at stride 2), or the image is wide enough for
/// rows of whole vectors.
fn flat_table(g: &Geometry, wp: usize) -> Vec<u8> {
    const LANES: usize = 16;
    if g.ow >= 4 * LANES {
        return Vec::new();
    }
    let mut table = vec![0u8; g.ow * 64];
    for x0 in 0..g.ow {
        for j in 0..LANES {
            let (dy, x) = ((x0 + j) / g.ow, (x0 + j) % g.ow);
            let rel = (dy * g.sh * wp + x * g.sw) as isize - (x0 * g.sw) as isize;
            if !(0..=60).contains(&rel) {
                return Vec::new();
            }
            for t in 0..4 {
                table[x0 * 64 + 4 * j + t] = (rel + t as isize) as u8;
            }
        }
    }
    table
}

/// One output row of one channel, any kernel, stride and dilation, in scalar code.
///
/// # Safety
/// `yrow` must be writable for `g.ow` elements of the type of `ep.mode`.
unsafe fn generic_row(
    plane: &[u8],
    wp: usize,
    g: &Geometry,
    oy: usize,
    w: &[i8],
    yrow: *mut u8,
    ep: &QDwEpilogue,
) {
    for ox in 0..g.ow {
        let mut acc = 0i32;
        for ky in 0..g.kh {
            let row = &plane[(oy * g.sh + ky * g.dh) * wp..];
            for kx in 0..g.kw {
                acc += row[ox * g.sw + kx * g.dw] as i32 * w[ky * g.kw + kx] as i32;
            }
        }
        let v = acc.wrapping_add(ep.bias);
        match ep.mode {
            QMode::I32 => *(yrow as *mut i32).add(ox) = v,
            QMode::F32 => *(yrow as *mut f32).add(ox) = v as f32 * ep.scale,
            QMode::Q8 => *yrow.add(ox) = requantize(v, ep.scale, ep.lo, ep.hi, ep.zero_point) as u8,
        }
    }
}
