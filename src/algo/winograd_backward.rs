//! The weight gradient of 3x3 (and 1x3) stride-1 convolutions by Winograd F(3, m).
//!
//! Over one output tile of `m x m` pixels, the weight gradient is the correlation of the
//! `t x t` input tile `d` (`t = m + 2`) with the `m x m` output-gradient tile `e`, a 3x3
//! result: the convolution F(m, 3) with the roles of output and filter swapped. Differentiating
//! the forward identity `y = At[(G g) ⊙ (Bt d)]` with respect to `g` gives
//! `dW = Gt[(At^T e At) ⊙ (Bt d B)]G`: the same input transform as the forward pass, the output
//! gradient transformed by `At`'s transpose, and `G`'s transpose to come back to 3x3. Summing
//! over tiles and images makes the element-wise products one GEMM per position `ξ` of the
//! transformed tile: `Ŵ_ξ[cout x cin] = Ê_ξ[cout x tiles] · V_ξ[tiles x cin]`, `t²`
//! multiply-adds a tile where the direct formulation needs `9m²`: 4x fewer for F(4,3), 2.25x
//! for F(2,3).
//!
//! A run, per group: (1) every tile's input and output-gradient transforms, a block of `lanes`
//! channels an item, written straight into the GEMMs' packed panels; (2) the GEMMs and (3)
//! `Gt Ŵ G` per output channel, into the weight gradient (or added to it). One worker runs (2)
//! and (3) a block of output channels at a time, so that its Ŵ block stays in L2; several
//! split (2) by position (each then reads its own share of the transformed tiles once) into a
//! whole Ŵ, then (3) by output channel. Plans whose workspace (the transformed tiles, and Ŵ)
//! would pass [`MAX_FLOATS`] take the tap GEMMs instead.

use super::backward_gemm::{isa_dispatch, madd};
use super::winograd::{load_region, runs, Planes, WinoKernel};
use super::{for_each_worker, SendPtr};
use crate::cpu::{self, Isa, TransposeMasked16};
use crate::gemm::{Blocking, GemmEpilogue, GemmKernel};
use crate::params::Geometry;
use crate::{ConvParams, Layout, Precision};

/// The largest workspace (floats) a plan may take: 32 MiB.
const MAX_FLOATS: usize = 8 << 20;

/// Floats of products (Ŵ) one item of the GEMM phase keeps: 640 KiB, so they stay in L2 while
/// they are summed and transformed back.
const W_ITEM_FLOATS: usize = 160 * 1024;

/// The fewest tiles (the GEMMs' depth) a plan takes. At 16, resnet50_l3_3x3 took F(4,3) (16
/// tiles) and ran slower than under F(2,3) (49 tiles); 32 is a round bound above that, not a
/// measured crossover.
const MIN_TILES: usize = 32;

/// The fewest channels on either side: narrower layers keep the tap GEMMs, as the transforms'
/// share of the work grows when the GEMMs shrink (a choice, not measured).
const MIN_CHANNELS: usize = 16;

pub(crate) struct WinoWeightGrad {
    /// Tile sizes allowed, smallest first (F(2,3), then F(4,3) where the precision allows).
    kerns: Vec<&'static WinoKernel>,
    /// Per tile size: `m`, `At` (m x t) and `G` (t x 3), row-major, in f32.
    mats: Vec<(usize, Vec<f32>, Vec<f32>)>,
    gemm: &'static GemmKernel,
    transpose: cpu::Transpose8x8,
    /// Stores the collapsed gradients of 16 input channels (AVX-512).
    transpose16: Option<TransposeMasked16>,
    isa: Isa,
    layout: Layout,
    cin_g: usize,
    cout_g: usize,
}

/// One plan: the tile size and the split of the work.
#[derive(Clone, Copy)]
pub(crate) struct WinoWeightPlan {
    kern: &'static WinoKernel,
    tiles_y: usize,
    tiles_x: usize,
    /// Tiles over the batch: the GEMMs' depth.
    tiles: usize,
    ci_pad: usize,
    co_pad: usize,
    kc: usize,
    /// Output-channel panels (of the GEMM's `mr`) an item of the GEMM phase takes.
    panels: usize,
    workers: usize,
    per_worker: usize,
}

impl WinoWeightPlan {
    fn v_floats(&self) -> usize {
        self.kern.xis() * self.tiles * self.ci_pad
    }
    fn e_floats(&self) -> usize {
        self.kern.xis() * self.tiles * self.co_pad
    }
    /// Several workers share one whole Ŵ (`[co][ξ][ci]`); one worker makes it a block of
    /// output channels at a time, in its scratch.
    fn w_floats(&self) -> usize {
        if self.workers > 1 {
            self.kern.xis() * self.co_pad * self.ci_pad
        } else {
            0
        }
    }
    pub(crate) fn workspace_floats(&self) -> usize {
        self.v_floats() + self.e_floats() + self.w_floats() + self.workers * self.per_worker
    }
    pub(crate) fn error_factor(&self) -> f64 {
        super::winograd::error_factor(self.kern.m)
    }
    pub(crate) fn kernel_name(&self, gemm: &GemmKernel) -> String {
        format!("winograd/{}+{}", self.kern.name, gemm.name)
    }
}

impl WinoWeightGrad {
    /// The Winograd weight gradient for `p`, if it applies: 3x3 (or 1x3) at stride and
    /// dilation 1, enough channels, a precision that allows Winograd, and transforms whose
    /// vectors fill the GEMM's panels evenly.
    pub(crate) fn new(p: &ConvParams, isa: Isa, precision: Precision) -> Option<Self> {
        let gemm = cpu::gemm_f32(isa);
        let (cin_g, cout_g) = (p.in_channels_per_group(), p.out_channels_per_group());
        if cin_g < MIN_CHANNELS || cout_g < MIN_CHANNELS {
            return None;
        }
        // F(2,3) and F(4,3) only: F(6,3)'s larger error was not measured for gradients.
        let max = precision.max_tile().min(4);
        let kerns: Vec<_> = [2, 4]
            .into_iter()
            .filter(|&m| m <= max)
            .filter_map(|m| super::winograd::kernel_for(p, isa, m).ok())
            .filter(|k| gemm.nr.is_multiple_of(k.lanes))
            .collect();
        let f32s = |rows: &mut dyn Iterator<Item = &[f64]>| -> Vec<f32> {
            rows.flat_map(|r| r.iter().map(|&v| v as f32)).collect()
        };
        let mats = kerns
            .iter()
            .map(|k| {
                let at = f32s(&mut cpu::wino_at(k.m).iter().copied());
                let g = f32s(&mut cpu::wino_g(k.m).iter().map(|r| &r[..]));
                (k.m, at, g)
            })
            .collect();
        (!kerns.is_empty()).then(|| WinoWeightGrad {
            kerns,
            mats,
            gemm,
            transpose: cpu::transpose_8x8(isa),
            transpose16: cpu::transpose_masked_16(isa),
            isa,
            layout: p.layout,
            cin_g,
            cout_g,
        })
    }

    pub(crate) fn gemm(&self) -> &'static GemmKernel {
        self.gemm
    }

    /// `At` and `G` of tile size `m`, in f32.
    fn mats(&self, m: usize) -> (&[f32], &[f32]) {
        let (_, at, g) = self
            .mats
            .iter()
            .find(|e| e.0 == m)
            .expect("a plan's tile size is one of the path's");
        (at, g)
    }

    /// The plan with the fewest GEMM multiply-adds, or `None` where every tile size gives too
    /// shallow GEMMs or too large a workspace.
    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> Option<WinoWeightPlan> {
        let (mr, nr) = (self.gemm.mr, self.gemm.nr);
        let (ci_pad, co_pad) = (
            self.cin_g.next_multiple_of(nr),
            self.cout_g.next_multiple_of(mr),
        );
        self.kerns
            .iter()
            .filter_map(|&kern| {
                let tiles_y = g.oh.div_ceil(kern.rows_out());
                let tiles_x = g.ow.div_ceil(kern.m);
                let tiles = g.batch.checked_mul(tiles_y)?.checked_mul(tiles_x)?;
                let (lanes, t, xis) = (kern.lanes, kern.t(), kern.xis());
                // The transforms' scratch: a run of input rows, a transformed tile, and the
                // half-transformed output-gradient tile.
                let scratch =
                    kern.rows_in() * (tiles_x * kern.m + 2) * lanes + xis * lanes + t * t * lanes;
                // The GEMM phase's items: as many panels of output channels as keep their
                // products (Ŵ) within W_ITEM_FLOATS, and at least one item a worker.
                let (co_panels, workers) = (co_pad / mr, threads.max(1));
                let per_panel = mr * kern.xis() * ci_pad;
                let panels =
                    (W_ITEM_FLOATS / per_panel).clamp(1, co_panels.div_ceil(workers).max(1));
                let plan = WinoWeightPlan {
                    kern,
                    tiles_y,
                    tiles_x,
                    tiles,
                    ci_pad,
                    co_pad,
                    kc: Blocking::new(self.gemm, tiles, nr, 1).kc,
                    panels,
                    workers,
                    per_worker: scratch.max(panels * per_panel),
                };
                // Checked here, so the unchecked sizes of the plan's methods cannot overflow.
                let tiled = crate::params::mul(&[xis, tiles, ci_pad + co_pad], "tiles").ok()?;
                let products = crate::params::mul(&[xis, co_pad, ci_pad], "products").ok()?;
                let fits = tiled.saturating_add(products) <= MAX_FLOATS
                    && plan.workspace_floats() <= MAX_FLOATS;
                (tiles >= MIN_TILES && fits).then_some(plan)
            })
            .min_by_key(|p| p.kern.xis() * p.tiles)
    }

    /// `dW (+)= Σ dY ⊗ patches(X)` for every group.
    ///
    /// Slice lengths were checked by the caller; `scratch` holds the plan's workspace.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &WinoWeightPlan,
        g: &Geometry,
        input: &[f32],
        grad_output: &[f32],
        grad_weights: &mut [f32],
        add: bool,
        scratch: &mut [f32],
    ) {
        let (v, rest) = scratch.split_at_mut(plan.v_floats());
        let (e, rest) = rest.split_at_mut(plan.e_floats());
        let (v, e) = (SendPtr(v.as_mut_ptr()), SendPtr(e.as_mut_ptr()));
        let dw = SendPtr(grad_weights.as_mut_ptr());
        let kern = plan.kern;
        let lanes = kern.lanes;
        let (ci_blocks, co_blocks) = (plan.ci_pad.div_ceil(lanes), plan.co_pad.div_ceil(lanes));
        for grp in 0..g.groups {
            // 1. Transforms: items are blocks of input channels, then of output channels.
            let items = ci_blocks + co_blocks;
            let workers = plan.workers.min(items);
            for_each_worker(
                workers,
                items,
                &mut rest[..workers * plan.per_worker],
                |s, item| {
                    // SAFETY: item `i` writes channels `i·lanes..` of V (or of Ê) alone.
                    unsafe {
                        if item < ci_blocks {
                            self.transform_input(plan, g, input, grp, item * lanes, v, s);
                        } else {
                            self.transform_grad(
                                plan,
                                g,
                                grad_output,
                                grp,
                                (item - ci_blocks) * lanes,
                                e,
                                s,
                            );
                        }
                    }
                },
            );
            let (mr, co_panels, xis) = (self.gemm.mr, plan.co_pad / self.gemm.mr, kern.xis());
            if plan.workers == 1 {
                // 2. A block of output channels at a time: one GEMM per position ξ into a Ŵ
                // block, then back to 3x3 while it is in cache.
                let w = SendPtr(rest.as_mut_ptr());
                for q0 in (0..co_panels).step_by(plan.panels) {
                    let qs = q0..(q0 + plan.panels).min(co_panels);
                    let cos = q0 * mr..(qs.end * mr).min(self.cout_g);
                    // SAFETY: `rest` holds a Ŵ block (per_worker floats); V and Ê are complete.
                    unsafe {
                        self.gemms(plan, 0..xis, qs, q0, v, e, w);
                        self.to_weights(plan, grp, cos.clone(), w, cos.start, dw, add);
                    }
                }
            } else {
                // 2. Workers split the positions ξ, each GEMM into the whole Ŵ (every worker
                // then reads its own share of V and Ê once) ...
                let w = SendPtr(rest.as_mut_ptr());
                let workers = plan.workers.min(xis);
                for_each_worker(workers, xis, &mut [], |_, xi| {
                    // SAFETY: position `xi` writes its own rows of Ŵ alone.
                    unsafe { self.gemms(plan, xi..xi + 1, 0..co_panels, 0, v, e, w) };
                });
                // 3. ... and then the output channels, back to 3x3.
                let items = (plan.workers * 4).min(self.cout_g);
                let workers = plan.workers.min(items);
                for_each_worker(workers, items, &mut [], |_, item| {
                    let cos = item * self.cout_g / items..(item + 1) * self.cout_g / items;
                    // SAFETY: the item writes the gradients of its output channels alone; Ŵ
                    // is complete.
                    unsafe { self.to_weights(plan, grp, cos, w, 0, dw, add) };
                });
            }
        }
    }

    /// Input channels `c0..c0+lanes` of group `grp`: every tile's `Bt d B` into V, laid out as
    /// the GEMMs' B panels `[ξ][ci / nr][tile][nr]`.
    ///
    /// # Safety
    /// No one else writes these channels of V; the kernel's ISA is this CPU's.
    #[allow(clippy::too_many_arguments)]
    unsafe fn transform_input(
        &self,
        plan: &WinoWeightPlan,
        g: &Geometry,
        input: &[f32],
        grp: usize,
        c0: usize,
        v: SendPtr,
        scratch: &mut [f32],
    ) {
        let (k, nr) = (plan.kern, self.gemm.nr);
        let lanes = k.lanes;
        let planes = Planes {
            layout: self.layout,
            channels: g.c_in,
            h: g.h,
            w: g.w,
        };
        // Channel `c0` of position ξ, tile p: V[((ξ·panels + c0/nr)·tiles + p)·nr + c0%nr].
        let xi_stride = plan.ci_pad * plan.tiles;
        let base = v.get().add((c0 / nr * plan.tiles) * nr + c0 % nr);
        let chans = (
            grp * self.cin_g + c0,
            self.cin_g.saturating_sub(c0).min(lanes),
        );
        let origin = (g.pad_top as isize, g.pad_left as isize, k.rows_in(), 2);
        self.each_tile(
            plan,
            &planes,
            input,
            chans,
            origin,
            scratch,
            |tile, row, p| {
                // SAFETY: the tile's pixels lie in the region; its xis vectors of `lanes` floats go
                // to V at `xi_stride` apart, inside V (p < tiles, c0 + lanes <= ci_pad).
                unsafe { (k.func)(tile.as_ptr(), row, base.add(p * nr), xi_stride) };
            },
        );
    }

    /// Calls `tile(region, row, p)` for every tile `p` of the plan, with `region` at the tile's
    /// first pixel (rows `row` floats apart) of `t`'s channels `cfirst..cfirst+cb` (zero
    /// outside the image and past `cb`), `rows` rows from `-pad_top` on and `m` columns a tile
    /// plus `halo`.
    #[allow(clippy::too_many_arguments)]
    fn each_tile(
        &self,
        plan: &WinoWeightPlan,
        t: &Planes,
        src: &[f32],
        (cfirst, cb): (usize, usize),
        (pad_top, pad_left, rows, halo): (isize, isize, usize, usize),
        scratch: &mut [f32],
        mut tile: impl FnMut(&[f32], usize, usize),
    ) {
        let (k, lanes) = (plan.kern, plan.kern.lanes);
        for run in runs(0, plan.tiles, (plan.tiles_y, plan.tiles_x)) {
            let cols = run.len * k.m + halo;
            let y0 = (run.ty * k.rows_out()) as isize - pad_top;
            let x0 = (run.tx0 * k.m) as isize - pad_left;
            if cb == 0 {
                scratch[..rows * cols * lanes].fill(0.0);
            } else {
                let rect = (y0, x0, rows, cols, lanes);
                load_region(t, self.transpose, src, (run.n, cfirst, cb), rect, scratch);
            }
            for i in 0..run.len {
                tile(&scratch[i * k.m * lanes..], cols * lanes, run.p + i);
            }
        }
    }

    /// Output channels `c0..c0+lanes` of group `grp`: every tile's `At^T e At` into Ê, laid
    /// out as the GEMMs' A panels `[ξ][co / mr][tile][mr]`.
    ///
    /// # Safety
    /// No one else writes these channels of Ê.
    #[allow(clippy::too_many_arguments)]
    unsafe fn transform_grad(
        &self,
        plan: &WinoWeightPlan,
        g: &Geometry,
        grad_output: &[f32],
        grp: usize,
        c0: usize,
        e: SendPtr,
        scratch: &mut [f32],
    ) {
        let (k, mr) = (plan.kern, self.gemm.mr);
        let (m, t, lanes, xis) = (k.m, k.t(), k.lanes, k.xis());
        // Channels of this block inside the padded A panels.
        let cpad = plan.co_pad.saturating_sub(c0).min(lanes);
        let planes = Planes {
            layout: self.layout,
            channels: g.c_out,
            h: g.oh,
            w: g.ow,
        };
        let (at, _) = self.mats(m);
        let (region, rest) = scratch.split_at_mut(k.rows_out() * plan.tiles_x * m * lanes);
        let (half, out) = rest.split_at_mut(t * t * lanes);
        let out = &mut out[..xis * lanes];
        let panels = plan.co_pad / mr;
        let chans = (
            grp * self.cout_g + c0,
            self.cout_g.saturating_sub(c0).min(lanes),
        );
        self.each_tile(
            plan,
            &planes,
            grad_output,
            chans,
            (0, 0, k.rows_out(), 0),
            region,
            |tile, row, p| {
                // SAFETY: the tile's m x m pixels lie in the region; the ISA is this CPU's.
                grad_tile_at(self.isa, at, (m, t, k.dims, lanes), tile, row, half, out);
                // Into the A panels, a run of channels within one panel at a time.
                let mut c = 0;
                while c < cpad {
                    let (q, r) = ((c0 + c) / mr, (c0 + c) % mr);
                    let len = (mr - r).min(cpad - c);
                    for xi in 0..xis {
                        let src = &out[xi * lanes + c..][..len];
                        // SAFETY: channels c0+c.. of panel q (len <= mr - r), tile p < tiles:
                        // inside Ê.
                        let dst = e.get().add(((xi * panels + q) * plan.tiles + p) * mr + r);
                        if let Ok(v) = <[f32; 8]>::try_from(src) {
                            // A whole AVX-512 panel row: one store, not a call to memcpy.
                            dst.cast::<[f32; 8]>().write_unaligned(v);
                        } else {
                            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, len);
                        }
                    }
                    c += len;
                }
            },
        );
    }

    /// `Ŵ_ξ = Ê_ξ · V_ξ` for the positions `xis` and the output-channel panels `qs`, into `w`
    /// laid out `[co - q_base·mr][ξ][ci_pad]`, so that each output channel's rows are together.
    ///
    /// # Safety
    /// `w` holds those rows, which no one else writes; V and Ê are complete; the kernel's ISA
    /// is this CPU's.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemms(
        &self,
        plan: &WinoWeightPlan,
        xis: std::ops::Range<usize>,
        qs: std::ops::Range<usize>,
        q_base: usize,
        v: SendPtr,
        e: SendPtr,
        w: SendPtr,
    ) {
        let (mr, nr, all) = (self.gemm.mr, self.gemm.nr, plan.kern.xis());
        let (ci_panels, co_panels) = (plan.ci_pad / nr, plan.co_pad / mr);
        for xi in xis {
            for k0 in (0..plan.tiles).step_by(plan.kc) {
                let kc = plan.kc.min(plan.tiles - k0);
                let ep = GemmEpilogue::plain(k0 > 0);
                for j in 0..ci_panels {
                    let b = v.get().add(((xi * ci_panels + j) * plan.tiles + k0) * nr);
                    for q in qs.clone() {
                        let a = e.get().add(((xi * co_panels + q) * plan.tiles + k0) * mr);
                        let c = w
                            .get()
                            .add(((q - q_base) * mr * all + xi) * plan.ci_pad + j * nr);
                        // SAFETY: A and B panels hold kc steps of mr and nr floats from k0; C is
                        // mr rows of nr floats, all·ci_pad apart, inside `w`.
                        (self.gemm.func)(kc, a, b, c, (all * plan.ci_pad) as isize, mr, nr, &ep);
                    }
                }
            }
        }
    }

    /// `dW[co] (+)= Gt Ŵ[co] G` for the output channels `cos` of group `grp`, whose Ŵ rows
    /// `w` holds from channel `co_base` on.
    ///
    /// # Safety
    /// No one else writes these channels' gradients; their Ŵ is complete.
    #[allow(clippy::too_many_arguments)]
    unsafe fn to_weights(
        &self,
        plan: &WinoWeightPlan,
        grp: usize,
        cos: std::ops::Range<usize>,
        w: SendPtr,
        co_base: usize,
        dw: SendPtr,
        add: bool,
    ) {
        let k = plan.kern;
        let (ci, ci_pad) = (self.cin_g, plan.ci_pad);
        let (_, gm) = self.mats(k.m);
        let taps = if k.dims == 2 { 9 } else { 3 };
        // SAFETY: `w` holds the complete Ŵ rows of channels co_base..cos.end.
        let w = std::slice::from_raw_parts(w.get(), (cos.end - co_base) * k.xis() * ci_pad);
        for co in cos {
            // SAFETY: the gradient of channel co (of this group) is ci x taps floats, inside
            // grad_weights (length checked by the caller), and only this item writes it.
            let dst = std::slice::from_raw_parts_mut(
                dw.get().add((grp * self.cout_g + co) * ci * taps),
                ci * taps,
            );
            let dims = (k.t(), k.dims, ci_pad);
            // SAFETY: the ISA is this CPU's.
            collapse_at(
                self.isa,
                gm,
                dims,
                &w[(co - co_base) * k.xis() * ci_pad..],
                dst,
                add,
                self.transpose16,
            );
        }
    }
}

isa_dispatch!(fn grad_tile_at = grad_tile(
    at: &[f32],
    dims: (usize, usize, usize, usize),
    tile: &[f32],
    row: usize,
    half: &mut [f32],
    out: &mut [f32],
));

/// One output-gradient tile (`m x m` pixels of `lanes` channels, rows `row` apart) into
/// `out[ξ][lanes] = (At^T e At)[ξ]` (2-D) or `At^T e` (1-D); `half` is scratch (`m x t x
/// lanes`).
#[inline(always)]
fn grad_tile<const FMA: bool>(
    at: &[f32],
    dims: (usize, usize, usize, usize),
    tile: &[f32],
    row: usize,
    half: &mut [f32],
    out: &mut [f32],
) {
    // The widest chunk of channels that divides the vector: 16 at AVX-512, 8 at AVX2.
    let chunk = [16, 8, 4]
        .into_iter()
        .find(|c| dims.3.is_multiple_of(*c))
        .unwrap_or(1);
    match (dims.0, chunk) {
        (2, 16) => grad_tile_by::<FMA, 16, 2, 4>(at, dims, tile, row, half, out),
        (2, 8) => grad_tile_by::<FMA, 8, 2, 4>(at, dims, tile, row, half, out),
        (2, 4) => grad_tile_by::<FMA, 4, 2, 4>(at, dims, tile, row, half, out),
        (2, _) => grad_tile_by::<FMA, 1, 2, 4>(at, dims, tile, row, half, out),
        (4, 16) => grad_tile_by::<FMA, 16, 4, 6>(at, dims, tile, row, half, out),
        (4, 8) => grad_tile_by::<FMA, 8, 4, 6>(at, dims, tile, row, half, out),
        (4, 4) => grad_tile_by::<FMA, 4, 4, 6>(at, dims, tile, row, half, out),
        (4, _) => grad_tile_by::<FMA, 1, 4, 6>(at, dims, tile, row, half, out),
        _ => unreachable!("the weight gradient runs F(2,3) and F(4,3) only"),
    }
}

/// [`grad_tile`] for `M x M` tiles (`T = M + 2`), `L` channels at a time: each row of `At`'s
/// products accumulates in `T` independent registers.
#[inline(always)]
fn grad_tile_by<const FMA: bool, const L: usize, const M: usize, const T: usize>(
    at: &[f32],
    (_, _, dims, lanes): (usize, usize, usize, usize),
    tile: &[f32],
    row: usize,
    half: &mut [f32],
    out: &mut [f32],
) {
    let at = &at[..M * T];
    let load = |s: &[f32], i: usize| -> [f32; L] { s[i..i + L].try_into().expect("L floats") };
    for c in (0..lanes).step_by(L) {
        if dims == 2 {
            // Rows first (half[a][l] = Σ_b e[a][b]·At[b][l]), then columns.
            for a in 0..M {
                let acc = at_rows::<FMA, L, M, T>(at, |b| load(tile, a * row + b * lanes + c));
                for (l, v) in acc.iter().enumerate() {
                    half[(a * T + l) * lanes + c..][..L].copy_from_slice(v);
                }
            }
            for l in 0..T {
                let acc = at_rows::<FMA, L, M, T>(at, |a| load(half, (a * T + l) * lanes + c));
                for (kk, v) in acc.iter().enumerate() {
                    out[(kk * T + l) * lanes + c..][..L].copy_from_slice(v);
                }
            }
        } else {
            let acc = at_rows::<FMA, L, M, T>(at, |b| load(tile, b * lanes + c));
            for (l, v) in acc.iter().enumerate() {
                out[l * lanes + c..][..L].copy_from_slice(v);
            }
        }
    }
}

/// `acc[l] = Σ_j At[j][l]·src(j)` over `j < M`, `T` independent sums of `L` lanes.
#[inline(always)]
fn at_rows<const FMA: bool, const L: usize, const M: usize, const T: usize>(
    at: &[f32],
    src: impl Fn(usize) -> [f32; L],
) -> [[f32; L]; T] {
    let mut acc = [[0.0f32; L]; T];
    for j in 0..M {
        let x = src(j);
        for (l, a) in acc.iter_mut().enumerate() {
            madd_lanes::<FMA, L>(a, at[j * T + l], &x);
        }
    }
    acc
}

/// `acc += k·x`, lane by lane.
#[inline(always)]
fn madd_lanes<const FMA: bool, const L: usize>(acc: &mut [f32; L], k: f32, x: &[f32; L]) {
    for i in 0..L {
        acc[i] = madd::<FMA>(x[i], k, acc[i]);
    }
}

isa_dispatch!(fn collapse_at = collapse(
    gm: &[f32],
    dims: (usize, usize, usize),
    w: &[f32],
    dw: &mut [f32],
    add: bool,
    tr: Option<TransposeMasked16>,
));

/// One output channel's `Gt Ŵ G` (its Ŵ rows at `w[ξ·xi_stride..]`) into (or added to) its
/// gradient `dw` (`ci x taps`, OIHW).
#[inline(always)]
fn collapse<const FMA: bool>(
    gm: &[f32],
    dims: (usize, usize, usize),
    w: &[f32],
    dw: &mut [f32],
    add: bool,
    tr: Option<TransposeMasked16>,
) {
    match dims.0 {
        4 => collapse_t::<FMA, 4>(gm, dims, w, dw, add, tr),
        6 => collapse_t::<FMA, 6>(gm, dims, w, dw, add, tr),
        _ => unreachable!("the weight gradient runs F(2,3) and F(4,3) only"),
    }
}

/// [`collapse`] for tiles of `T` positions a side: 16 input channels at a time, then one.
#[inline(always)]
fn collapse_t<const FMA: bool, const T: usize>(
    gm: &[f32],
    dims: (usize, usize, usize),
    w: &[f32],
    dw: &mut [f32],
    add: bool,
    tr: Option<TransposeMasked16>,
) {
    let taps = if dims.1 == 2 { 9 } else { 3 };
    let ci = dw.len() / taps;
    let full = ci / 16 * 16;
    for c in (0..full).step_by(16) {
        collapse_by::<FMA, T, 16>(gm, dims, w, c, dw, add, tr);
    }
    for c in full..ci {
        collapse_by::<FMA, T, 1>(gm, dims, w, c, dw, add, None);
    }
}

/// [`collapse`] for input channels `c..c+L`, every sum in registers.
#[inline(always)]
fn collapse_by<const FMA: bool, const T: usize, const L: usize>(
    gm: &[f32],
    (_, dims, xi_stride): (usize, usize, usize),
    w: &[f32],
    c: usize,
    dw: &mut [f32],
    add: bool,
    tr: Option<TransposeMasked16>,
) {
    let load =
        |xi: usize| -> [f32; L] { w[xi * xi_stride + c..][..L].try_into().expect("L floats") };
    let fma = madd_lanes::<FMA, L>;
    // Aligned to whole cache lines: where the compiler spills the sums, a vector store and
    // reload that straddle two lines miss store forwarding (a third of this function's time
    // at AVX-512).
    let mut sums = Aligned([[0.0f32; L]; 9]);
    let res = &mut sums.0;
    let taps = if dims == 2 {
        // Per row kk of Ŵ: s[kx] = Σ_l Ŵ[kk][l]·G[l][kx], then res[ky][kx] += G[kk][ky]·s[kx].
        for kk in 0..T {
            let (mut s0, mut s1, mut s2) = ([0.0f32; L], [0.0f32; L], [0.0f32; L]);
            for l in 0..T {
                let x = load(kk * T + l);
                fma(&mut s0, gm[l * 3], &x);
                fma(&mut s1, gm[l * 3 + 1], &x);
                fma(&mut s2, gm[l * 3 + 2], &x);
            }
            for ky in 0..3 {
                let g = gm[kk * 3 + ky];
                fma(&mut res[ky * 3], g, &s0);
                fma(&mut res[ky * 3 + 1], g, &s1);
                fma(&mut res[ky * 3 + 2], g, &s2);
            }
        }
        9
    } else {
        for l in 0..T {
            let x = load(l);
            for (kx, r) in res.iter_mut().take(3).enumerate() {
                fma(r, gm[l * 3 + kx], &x);
            }
        }
        3
    };
    // OIHW: channel c+i's taps are contiguous.
    let dst = &mut dw[c * taps..][..L * taps];
    if let Some(tr) = tr.filter(|_| L == 16) {
        // The sums as `taps` rows of 16 channels, transposed into 16 rows of `taps`: one masked
        // 16x16 transpose instead of a value at a time.
        let transpose = |to: &mut [f32]| {
            assert!(to.len() >= L * taps && taps <= 9);
            // SAFETY: `res` is `taps <= 9` rows of L = 16 floats, 16 apart; `to` holds 16 rows
            // of `taps` floats, `taps` apart (checked above); the caller passes a transpose
            // only where the CPU has its ISA.
            unsafe { tr(res.as_ptr().cast(), L, to.as_mut_ptr(), taps, taps, L) }
        };
        if add {
            let mut rows = [0.0f32; 16 * 9];
            transpose(&mut rows);
            dst.iter_mut().zip(&rows).for_each(|(d, &v)| *d += v);
        } else {
            transpose(dst);
        }
        return;
    }
    // Constant trip counts, `add` hoisted: the compiler unrolls this transpose into moves.
    match (taps, add) {
        (9, false) => store_taps::<L, 9, false>(res, dst),
        (9, true) => store_taps::<L, 9, true>(res, dst),
        (_, false) => store_taps::<L, 3, false>(res, dst),
        (_, true) => store_taps::<L, 3, true>(res, dst),
    }
}

/// A value on whole cache lines.
#[repr(C, align(64))]
struct Aligned<T>(T);

/// `dst[i][tap] (+)= res[tap][i]` for `L` channels of `TAPS` taps.
#[inline(always)]
fn store_taps<const L: usize, const TAPS: usize, const ADD: bool>(
    res: &[[f32; L]; 9],
    dst: &mut [f32],
) {
    let dst: &mut [[f32; TAPS]] = dst.as_chunks_mut::<TAPS>().0;
    for (i, d) in dst.iter_mut().enumerate().take(L) {
        for (tap, d) in d.iter_mut().enumerate() {
            *d = if ADD { *d + res[tap][i] } else { res[tap][i] };
        }
    }
}
