//! The BLIS-style blocked GEMM driver. Microkernels come from the generator (`codegen/`);
//! everything ISA-free — blocking, packing, the loops, edge handling — lives here, once.
//!
//! Loop order (BLIS): `jc` over N in blocks of `nc`, `pc` over K in blocks of `kc` (pack the B
//! block, `kc x nc`, into the workspace), `ic` over M in blocks of `mc` (pack the A block,
//! `mc x kc`, unless it was packed at create time), then `jr` over the B micro-panels (one
//! stays in L1) and `ir` over the A micro-panels (streamed from L2). The epilogue (bias,
//! residual, clamp) runs in the kernel's registers on the last K-block; other activations run
//! over the tile right after its store, while it is still in L1.

pub(crate) mod pack;

use crate::cpu::Isa;
use crate::{Activation, Error, Result};

/// The signature every f32 GEMM microkernel has (see `codegen/src/gemm.rs`).
pub type GemmKernelFn =
    unsafe fn(usize, *const f32, *const f32, *mut f32, isize, usize, usize, &GemmEpilogue);

/// The signature of the row-pointer variants: B step `k` is `nr` floats at `b_rows[k] + b_off`.
pub type GemmRowsFn = unsafe fn(
    usize,
    *const f32,
    *const *const f32,
    usize,
    *mut f32,
    isize,
    usize,
    usize,
    &GemmEpilogue,
);

/// The signature of the strided-A variants: A row `i` is `kc` floats at `a + i*rs_a`.
pub type GemmARowsFn =
    unsafe fn(usize, *const f32, usize, *const f32, *mut f32, isize, usize, usize, &GemmEpilogue);

/// A generated microkernel and its register tile.
pub struct GemmKernel {
    /// The kernel's name, e.g. `gemm_f32_6x16_avx2`.
    pub name: &'static str,
    /// The ISA level the kernel needs.
    pub isa: Isa,
    /// The microkernel.
    pub func: GemmKernelFn,
    /// Rows of the register tile.
    pub mr: usize,
    /// Columns of the register tile.
    pub nr: usize,
    /// The same kernel over only the first `nr/2` columns, for a last micro-panel that narrow.
    pub half: Option<GemmKernelFn>,
    /// The same kernel over only the first `mr/2` rows (A panels still `mr` wide), for a last
    /// register block of rows that short.
    pub short: Option<GemmKernelFn>,
    /// Variants that read B through row pointers (SIMD ISAs).
    pub rows: Option<GemmRowsFn>,
    /// A variant that takes `mr / 2` rows (for ragged edges), where the ISA has one.
    pub half_rows: Option<GemmRowsFn>,
    /// The kernel over strided A rows (Winograd's transformed tiles, no A panel to pack).
    pub a_rows: GemmARowsFn,
    /// Its edge variants over the first `r` rows, `a_rows_edge[r - 1]` for `r < mr` (SIMD
    /// ISAs; empty elsewhere, where `a_rows` serves every count, reading all `mr` rows).
    pub a_rows_edge: &'static [GemmARowsFn],
    /// Kernels for a last micro-panel of only a few columns, narrowest first (may be empty).
    pub narrow: &'static [NarrowGemm],
}

/// A narrow edge kernel: the `mr` rows of an A panel by at most `cols` columns of a B panel,
/// vectorised along the rows, so that a micro-panel of a few columns (196 pixels are six
/// 32-wide panels and 4 columns) costs `cols` multiply-adds a step instead of a half panel's
/// `nr / 2`.
pub struct NarrowGemm {
    /// Columns it computes at most.
    pub cols: usize,
    /// The kernel over packed B panels.
    pub func: GemmKernelFn,
    /// The kernel over B row pointers.
    pub rows: GemmRowsFn,
}

/// What a microkernel does after the products: the kernel contract's params struct.
#[repr(C)]
pub struct GemmEpilogue {
    /// Add the product to what C holds (K-blocks after the first). Otherwise C is not read.
    pub accumulate: bool,
    /// This is the last K-block: apply bias, residual and clamp.
    pub last: bool,
    /// Null, or the bias of this tile: indexed by row if `bias_per_row`, else by column.
    pub bias: *const f32,
    /// True: the bias is per row of C (else per column).
    pub bias_per_row: bool,
    /// Null, or the residual at this tile's position (rows `rs_residual` apart).
    pub residual: *const f32,
    /// Row stride of the residual, in floats.
    pub rs_residual: isize,
    /// Lower clamp of the fused activation.
    pub min: f32,
    /// Upper clamp of the fused activation.
    pub max: f32,
}

impl GemmEpilogue {
    /// No epilogue: the product alone, added to C where `accumulate`.
    pub(crate) fn plain(accumulate: bool) -> Self {
        GemmEpilogue {
            accumulate,
            last: false,
            bias: std::ptr::null(),
            bias_per_row: false,
            residual: std::ptr::null(),
            rs_residual: 0,
            min: f32::NEG_INFINITY,
            max: f32::INFINITY,
        }
    }
}

/// Stores the edge tile `tile`, element (i, j) at `tile[i·rs + j·cs]` (`(rs, 1)` for a
/// register tile held by rows, `(1, cs)` for one held by columns, as the narrow kernels keep
/// it), into the `m x n` corner of C with the epilogue, in scalar code. Every generated kernel
/// calls it for partial tiles.
///
/// # Safety
/// `c` (and the epilogue's bias and residual) must be valid for `m` rows of stride `rs_c` and
/// `n` columns, as for the kernel that calls it; `tile` must hold every element of that corner.
pub unsafe fn store_edge(
    tile: &[f32],
    (rs, cs): (usize, usize),
    c: *mut f32,
    rs_c: isize,
    m: usize,
    n: usize,
    ep: &GemmEpilogue,
) {
    for i in 0..m {
        let row = c.offset(i as isize * rs_c);
        for j in 0..n {
            let mut v = tile[i * rs + j * cs];
            if ep.accumulate {
                v += *row.add(j);
            }
            if ep.last {
                if !ep.bias.is_null() {
                    v += *ep.bias.add(if ep.bias_per_row { i } else { j });
                }
                if !ep.residual.is_null() {
                    v += *ep.residual.offset(i as isize * ep.rs_residual).add(j);
                }
                v = v.max(ep.min).min(ep.max);
            }
            *row.add(j) = v;
        }
    }
}

/// Block sizes of the driver, in elements. `mc` is a multiple of the kernel's `mr`, `nc` of
/// its `nr`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Blocking {
    pub mc: usize,
    pub kc: usize,
    pub nc: usize,
}

/// Bytes of L1 a `kc x nr` B micro-panel may fill while the A micro-panels stream past it.
/// BLIS's rule of thumb is half of L1; measured on Zen 4 (32 KiB L1), AVX-512's 32-wide panels
/// do a little better with K-blocks of 256 (the whole L1) than of 128, as fewer K-blocks mean
/// fewer passes over C. Capped by `KC_MAX`.
const L1_PANEL_BYTES: usize = 32 * 1024;
/// As [`L1_PANEL_BYTES`] for a B block read through row pointers (im2col's shifted copies,
/// a 1x1 convolution's input channels), where the CPU was measured to want it
/// ([`row_panel_bytes`]). Its rows are not packed side by side, so a K-step spans two or
/// three cache lines where a packed panel's spans two. On Sapphire Rapids (48 KiB L1,
/// `convkit bench --algorithm im2col_gemm`, 1 thread, 9 interleaved rounds) K-blocks of 192
/// steps (24 KiB) ran the 1x1 and strided layers 1.07-1.2x faster than 256, and
/// resnet50_l2_3x3 1.02x.
const ROW_PANEL_BYTES: usize = 24 * 1024;
/// The same on AMD: Zen 4 (32 KiB L1, 1 MiB L2) ran K-blocks of up to 512 steps (64 KiB, so
/// the B rows come from L2, whose latency the out-of-order window hides, and C is read and
/// written in fewer passes) faster than 171-256: forced im2col, one thread, 5 interleaved
/// rounds in the sweep: resnet50_l1/l2/l3_3x3 1.02-1.03x, inception_5x5 1.03x,
/// whisper_tiny_conv2_s2 1.04x, the 1x1 layers 0.99-1.04x; 7 rounds, final binary against
/// the one before: l2_3x3 1.02x, inception 1.02x, whisper 1.015x, l1_1x1_reduce 1.025x,
/// l4_3x3 and yolo_3x3s2_160 1.00x; two threads 0.97-1.16x (noisy). The price: each register
/// sums up to 512 products before adding into C, and a sequential sum's rounding grows with
/// its length, so the results carry about √(kc ratio) more of it (the largest errors of six
/// suite layers on this path went from 4-10e-5 to 6-12e-5: 1.2-1.7x, still within the tests'
/// √K tolerance). The same depth for the Winograd GEMMs (resnet50_l4_3x3
/// 1.12x) was left out: it took F(4,3) and F(6,3) over their documented bounds at 512
/// channels.
const ROW_PANEL_BYTES_AMD: usize = 64 * 1024;
/// Longest K-block of packed panels: 256 steps (AVX2's 6x16 panel then fills half of L1).
const KC_MAX: usize = 256;
/// Longest K-block read through row pointers; the driver keeps one pointer per step on the
/// stack.
const ROWS_KC_MAX: usize = 512;

/// The bytes a B block read through row pointers may span per micro-panel on this CPU (see
/// [`ROW_PANEL_BYTES`] and [`ROW_PANEL_BYTES_AMD`]).
pub(crate) fn row_panel_bytes() -> usize {
    if crate::cpu::is_amd() {
        ROW_PANEL_BYTES_AMD
    } else {
        ROW_PANEL_BYTES
    }
}

/// A block `mc x kc` stays in L2 (512 KiB on Zen 3, 1 MiB on Zen 4, 1–2 MiB on recent Intel).
const MC_TARGET: usize = 144;

/// The deepest product (K steps, in one block) whose micro-panels run row block by row block
/// rather than column by column. With so few steps a tile, storing C is a large share of
/// the work, and a column of tiles stores to rows far apart: resnet50_l4_3x3's weight
/// gradient (`512 x 4608 x 49`, C rows 18 KiB apart) ran 1.18x faster by rows (one thread,
/// nine interleaved rounds); at 196 steps (the 14x14 layers) the order made no difference.
const SHALLOW_K: usize = 64;
/// B block `kc x nc` lives in L2/L3 and bounds the workspace: 256 x 512 floats = 512 KiB.
pub(crate) const NC_MAX: usize = 512;

impl Blocking {
    /// Blocks for a GEMM of depth `k`: K split into equal blocks that fit L1, so no block is a
    /// short remainder, and each a multiple of `align` where that fits (im2col blocks that
    /// hold whole input channels).
    pub(crate) fn new(kern: &GemmKernel, k: usize, nc: usize, align: usize) -> Blocking {
        Self::with_panel_bytes(kern, k, nc, align, L1_PANEL_BYTES, KC_MAX)
    }

    /// As [`Blocking::new`] for a B operand read through row pointers (see
    /// [`row_panel_bytes`]).
    pub(crate) fn for_rows(kern: &GemmKernel, k: usize, nc: usize, align: usize) -> Blocking {
        Self::with_panel_bytes(kern, k, nc, align, row_panel_bytes(), ROWS_KC_MAX)
    }

    /// As [`Blocking::new`], with K-blocks whose `kc x nr` B micro-panel fills at most
    /// `panel_bytes`, and at most `kc_max` steps.
    fn with_panel_bytes(
        kern: &GemmKernel,
        k: usize,
        nc: usize,
        align: usize,
        panel_bytes: usize,
        kc_max: usize,
    ) -> Blocking {
        let kc_max = (panel_bytes / (4 * kern.nr)).clamp(64, kc_max);
        let kc = if align > 1 && align <= kc_max && k.is_multiple_of(align) {
            let units = k / align;
            units.div_ceil(units.div_ceil(kc_max / align)) * align
        } else {
            k.div_ceil(k.div_ceil(kc_max).max(1))
        };
        let mc = (MC_TARGET / kern.mr).max(1) * kern.mr;
        Blocking {
            mc,
            kc,
            nc: nc.div_ceil(kern.nr).max(1) * kern.nr,
        }
    }

    /// Floats of scratch one worker needs to pack an A block (`mc x kc`).
    pub(crate) fn a_scratch(&self) -> usize {
        self.mc * self.kc
    }
    /// Floats of scratch one worker needs to pack a B block (`kc x nc`).
    pub(crate) fn b_scratch(&self) -> usize {
        self.kc * self.nc
    }
}

/// Where a GEMM operand's micro-panels come from: packed at create time, or packed per block
/// into the workspace (plain matrices, im2col tiles).
pub(crate) trait Panels {
    /// True if `panels` never writes `dst` (the data was packed at create time).
    const PREPACKED: bool;
    /// Makes the micro-panels (width `r`, zero-padded) of rows/columns `start..start+len` over
    /// K `k0..k0+kc` available; returns a pointer to the first and the distance in floats
    /// between consecutive micro-panels.
    fn panels(
        &self,
        start: usize,
        len: usize,
        k0: usize,
        kc: usize,
        r: usize,
        dst: &mut [f32],
    ) -> (*const f32, usize);
}

/// A block of B as the kernels read it.
pub(crate) enum BBlock {
    /// Packed micro-panels: the first at `ptr`, each next one `stride` floats further.
    Panels { ptr: *const f32, stride: usize },
    /// Row pointers to the first micro-panel's rows (in the array the driver offered); each
    /// next micro-panel is `stride` floats further along every row.
    Rows { stride: usize },
}

/// The B operand: packed panels, or row pointers where the kernel has a row-pointer variant.
pub(crate) trait BlockB: Panels {
    /// As [`Panels::panels`] for columns `start..start+len`, or, when `rows` is offered and
    /// the rows already lie contiguous somewhere (each readable for `len` rounded up to `r`
    /// floats), their pointers instead of a packed copy.
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
        _rows: Option<&mut [*const f32]>,
    ) -> BBlock {
        let (ptr, stride) = self.panels(start, len, k0, kc, r, dst);
        BBlock::Panels { ptr, stride }
    }
}

/// Output tile and epilogue of one GEMM call: C is `m x n`, rows `rs_c` apart.
pub(crate) struct Output<'a> {
    pub c: *mut f32,
    pub rs_c: isize,
    /// Bias indexed by row (NCHW: output channel) or column (NHWC).
    pub bias: Option<&'a [f32]>,
    pub bias_per_row: bool,
    /// Residual with the same layout as C.
    pub residual: *const f32,
    pub activation: Activation,
    /// Add the product to what C holds (`C += A·B`) instead of overwriting it.
    pub accumulate: bool,
}

/// `C = A·B` (+ epilogue) for `m x n x k`, single-threaded; the caller splits work between
/// threads.
///
/// # Safety
/// `out.c` (and `out.residual` if not null) must be valid for `m` rows of `n` floats, rows
/// `out.rs_c` apart, and not be written by anyone else during the call; `out.bias` must hold
/// `m` (by row) or `n` (by column) values. The kernel's ISA must be available.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn gemm<A: Panels, B: BlockB>(
    kern: &GemmKernel,
    blk: &Blocking,
    m: usize,
    n: usize,
    k: usize,
    a: &A,
    b: &B,
    out: &Output,
    a_buf: &mut [f32],
    b_buf: &mut [f32],
) {
    let (mr, nr) = (kern.mr, kern.nr);
    let (min, max) = out.activation.clamp_bounds();
    let pass = out.activation.needs_pass();
    let nc = if B::PREPACKED {
        n.div_ceil(nr) * nr
    } else {
        blk.nc
    };
    let mut rows = [std::ptr::null::<f32>(); ROWS_KC_MAX];
    // The row variants (full, half-width); B rows are offered to `block` only when they exist.
    let row_fns = kern.rows.map(|full| (full, kern.half_rows.unwrap_or(full)));
    for jc in (0..n).step_by(nc) {
        let ncur = nc.min(n - jc);
        let mut pc = 0;
        while pc < k {
            let kc = blk.kc.min(k - pc);
            let last = pc + kc == k;
            let offer = row_fns.is_some() && kc <= ROWS_KC_MAX;
            let b_block = b.block(jc, ncur, pc, kc, nr, b_buf, offer.then_some(&mut rows[..]));
            for ic in (0..m).step_by(blk.mc) {
                let mcur = blk.mc.min(m - ic);
                let (ap, a_stride) = a.panels(ic, mcur, pc, kc, mr, a_buf);
                // Micro-panels column by column (each B panel stays in L1 while the A panels
                // stream), or, for a shallow product, row by row, so that C is written in
                // sweeps along its rows (see `SHALLOW_K`).
                let (np, mp) = (ncur.div_ceil(nr), mcur.div_ceil(mr));
                let by_rows = kc == k && k <= SHALLOW_K;
                let (outer, inner) = if by_rows { (mp, np) } else { (np, mp) };
                for o in 0..outer {
                    for i in 0..inner {
                        let (jp, ip) = if by_rows { (i, o) } else { (o, i) };
                        let (jr, ir) = (jp * nr, ip * mr);
                        let (pieces, count) = panel_pieces(kern, nr.min(ncur - jr));
                        let row = ic + ir;
                        let mm = mr.min(mcur - ir);
                        let a_panel = ap.add(ip * a_stride);
                        for &(off, nn, pick) in &pieces[..count] {
                            let col = jc + jr + off;
                            let c = out.c.offset(row as isize * out.rs_c).add(col);
                            let ep = GemmEpilogue {
                                accumulate: pc > 0 || out.accumulate,
                                last,
                                bias: match out.bias {
                                    Some(bias) if out.bias_per_row => bias.as_ptr().add(row),
                                    Some(bias) => bias.as_ptr().add(col),
                                    None => std::ptr::null(),
                                },
                                bias_per_row: out.bias_per_row,
                                residual: if out.residual.is_null() {
                                    out.residual
                                } else {
                                    out.residual.offset(row as isize * out.rs_c).add(col)
                                },
                                rs_residual: out.rs_c,
                                min,
                                max,
                            };
                            // SAFETY: the A panel holds kc steps of mr floats and the B panel
                            // (or each B row at its offset) nr floats (packers zero-pad, `block`
                            // keeps rows readable past `len`), of which a piece reads columns
                            // `off..off + its width <= nr`; c is inside the caller's m x n
                            // output; the ISA was checked at create.
                            match b_block {
                                BBlock::Panels { ptr, stride } => {
                                    let func = match (pick, kern.half, kern.short) {
                                        (Pick::Narrow(nk), _, _) => nk.func,
                                        (Pick::Half, Some(half), _) => half,
                                        (_, _, Some(short)) if mm <= mr / 2 => short,
                                        _ => kern.func,
                                    };
                                    let b_panel = ptr.add(jp * stride + off);
                                    func(kc, a_panel, b_panel, c, out.rs_c, mm, nn, &ep);
                                }
                                BBlock::Rows { stride } => {
                                    let Some((full, half)) = row_fns else {
                                        unreachable!("B rows are offered only to row kernels")
                                    };
                                    let func = match pick {
                                        Pick::Narrow(nk) => nk.rows,
                                        Pick::Half => half,
                                        Pick::Full => full,
                                    };
                                    let (b_rows, b_off) = (rows.as_ptr(), jp * stride + off);
                                    func(kc, a_panel, b_rows, b_off, c, out.rs_c, mm, nn, &ep);
                                }
                            }
                            if last && pass {
                                for i in 0..mm {
                                    let r = std::slice::from_raw_parts_mut(
                                        c.offset(i as isize * out.rs_c),
                                        nn,
                                    );
                                    out.activation.apply_slice(r);
                                }
                            }
                        }
                    }
                }
            }
            pc += kc;
        }
    }
}

/// Which kernel computes a piece of a B micro-panel's columns.
#[derive(Clone, Copy)]
enum Pick {
    Full,
    Half,
    Narrow(&'static NarrowGemm),
}

/// The pieces (column offset, width, kernel) a micro-panel of `nn` columns is computed in: one
/// kernel as narrow as fits, or, for a last panel a few columns wider than half (49 pixels are
/// a 32-wide panel and 17 columns), the half-width kernel and a narrow one beside it, which
/// together cost less than the full tile.
fn panel_pieces(kern: &GemmKernel, nn: usize) -> ([(usize, usize, Pick); 2], usize) {
    let narrow = |n: usize| kern.narrow.iter().find(|nk| n <= nk.cols);
    let half = kern.nr / 2;
    let halves = kern.half.is_some() && kern.half_rows.is_some();
    let one = |pick| ([(0, nn, pick), (0, 0, Pick::Full)], 1);
    if let Some(nk) = narrow(nn) {
        one(Pick::Narrow(nk))
    } else if nn <= half && kern.half.is_some() {
        one(Pick::Half)
    } else if let Some(nk) = narrow(nn.saturating_sub(half)).filter(|_| halves && nn > half) {
        (
            [(0, half, Pick::Half), (half, nn - half, Pick::Narrow(nk))],
            2,
        )
    } else {
        one(Pick::Full)
    }
}

/// `C = A·B` for row-major matrices (`m x k`, `k x n`, `m x n`, with leading dimensions), on
/// the caller's thread with the best ISA (or `CONVKIT_ISA`). The blocked GEMM that the
/// convolutions use, exposed for benchmarks and for users who need a plain SGEMM.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
) -> Result<()> {
    let mut ws = crate::Workspace::new();
    sgemm_with(
        Isa::default_level()?,
        m,
        n,
        k,
        a,
        lda,
        b,
        ldb,
        c,
        ldc,
        &mut ws,
    )
}

/// [`sgemm`] at a given ISA level with a caller-kept workspace (no allocation once it is large
/// enough).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_with(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    ws: &mut crate::Workspace,
) -> Result<()> {
    let isa = Isa::check(isa)?;
    for (what, v) in [("m", m), ("n", n), ("k", k)] {
        if v == 0 {
            return Err(Error::Zero { what });
        }
    }
    for (what, ld, cols) in [("lda", lda, k), ("ldb", ldb, n), ("ldc", ldc, n)] {
        if ld < cols {
            return Err(Error::InvalidParameter {
                what,
                detail: format!("{ld} is less than the row length {cols}"),
            });
        }
    }
    for (what, slice, rows, ld, cols) in [
        ("a", a.len(), m, lda, k),
        ("b", b.len(), k, ldb, n),
        ("c", c.len(), m, ldc, n),
    ] {
        let need = crate::params::mul(&[rows - 1, ld], what)?
            .checked_add(cols)
            .ok_or(Error::Overflow { what })?;
        if slice < need {
            return Err(Error::WrongLength {
                what,
                expected: need,
                got: slice,
            });
        }
    }
    if ldc > isize::MAX as usize / 4 {
        return Err(Error::Overflow { what: "ldc" });
    }
    let kern = crate::cpu::gemm_f32(isa);
    let blk = Blocking::new(kern, k, NC_MAX, 1);
    let scratch = ws.floats(blk.a_scratch() + blk.b_scratch())?;
    let (a_buf, b_buf) = scratch.split_at_mut(blk.a_scratch());
    let out = Output {
        c: c.as_mut_ptr(),
        rs_c: ldc as isize,
        bias: None,
        bias_per_row: false,
        residual: std::ptr::null(),
        activation: Activation::None,
        accumulate: false,
    };
    let (pa, pb) = (
        pack::RowMajorA {
            data: a,
            ld: lda,
            transpose: crate::cpu::transpose_8x8(isa),
        },
        pack::RowMajorB { data: b, ld: ldb },
    );
    // SAFETY: c was checked to hold m rows of n floats ldc apart and is borrowed mutably; the
    // ISA was checked above.
    unsafe { gemm(kern, &blk, m, n, k, &pa, &pb, &out, a_buf, b_buf) };
    Ok(())
}
