//! Winograd F(m, 3) for 3x3 (and 1x3) stride-1 convolutions, dense or grouped, both layouts.
//!
//! Each output tile of `m x m` pixels comes from a `t x t` input tile (`t = m + 2`): the input
//! tile is transformed (`Bt d B`), multiplied element-wise by the transformed filter
//! (`G g Gt`, computed once at create time), summed over input channels, and transformed back
//! (`At M A`). Summing over channels makes the element-wise products `t²` independent GEMMs,
//! one per position `ξ` of the transformed tile: `M_ξ[tiles x cout] = V_ξ[tiles x cin] ·
//! U_ξ[cin x cout]`, run with the generated GEMM microkernels. F(m,3) needs `t²/m²` products
//! an output pixel where direct convolution needs 9: 4 for F(2,3), 2.25 for F(4,3), 1.96 for
//! F(5,3), 1.78 for F(6,3).
//!
//! Work is split into items of `chunk` tiles of one group (in row-major tile order, image after
//! image), sized so their transformed tiles stay in L2. Per item:
//! 1. for each block of `lanes` input channels, the input rows under the item's tiles are
//!    copied into a small padded pixel scratch (NCHW: 8x8 transposes; padding and ragged
//!    edges are zeros there, so the whole input is never copied) and each tile transformed by
//!    the generated kernel straight into `V_ξ`, a row of channels a tile;
//! 2. for each GEMM panel of output channels, one GEMM per `ξ` (the transformed weights are
//!    the B operand, packed at create time), whose microkernels read A from `V_ξ`'s rows, so
//!    it needs no packing, into `M_ξ`, which holds that panel alone;
//! 3. then for each block of the panel's channels, each tile transformed back with the bias
//!    by the generated kernel into a pixel scratch, and stored (NCHW: transposed) with the
//!    residual and the activation.
//!
//! The transforms are generated from their interpolation points (`codegen/src/winograd.rs`).

use super::{for_each_worker, SendPtr};
use crate::buffer::AlignedBuf;
use crate::cpu::{self, Isa};
use crate::gemm::pack::{prepack, prepacked_len};
use crate::gemm::{Blocking, GemmEpilogue, GemmKernel};
use crate::params::{mul, Geometry};
use crate::{Activation, ConvParams, Layout, Result};

/// The input transform of one tile (see the generated kernels' docs).
pub type WinoInFn = unsafe fn(src: *const f32, row: usize, dst: *mut f32, xi: usize);
/// The output transform of one tile, with the bias.
pub type WinoOutFn =
    unsafe fn(src: *const f32, xi: usize, bias: *const f32, dst: *mut f32, row: usize);

/// The generated transforms of one tile size, as the generator's registry lists them.
pub struct WinoKernel {
    pub name: &'static str,
    pub isa: Isa,
    /// The input transform.
    pub func: WinoInFn,
    pub output: WinoOutFn,
    /// Output pixels a tile (per side).
    pub m: usize,
    /// 2: `m x m` tiles of a 3x3 convolution; 1: `m`-pixel tiles of a 1x3 one.
    pub dims: usize,
    /// Channels a vector.
    pub lanes: usize,
}

impl WinoKernel {
    /// Input pixels a tile, per side.
    pub(crate) fn t(&self) -> usize {
        self.m + 2
    }
    /// Positions of a transformed tile (`t²` or `t`): GEMMs per item.
    pub(crate) fn xis(&self) -> usize {
        self.t().pow(self.dims as u32)
    }
    /// Input rows of a tile.
    pub(crate) fn rows_in(&self) -> usize {
        if self.dims == 2 {
            self.t()
        } else {
            1
        }
    }
    /// Output rows of a tile.
    pub(crate) fn rows_out(&self) -> usize {
        if self.dims == 2 {
            self.m
        } else {
            1
        }
    }
}

/// How accurate a convolution must be; decides whether (and with which tiles) Winograd may
/// run. Errors are relative to the output's scale (`max |error| / rms(output)` on N(0,1)
/// data), measured per tile in [`RELATIVE_ERROR`](crate::winograd::RELATIVE_ERROR).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Never Winograd: every output a plain sum of products (about 1e-6).
    Exact,
    /// F(2,3) and F(4,3) only: within 4e-5.
    Accurate,
    /// Every tile, F(5,3) and F(6,3) included, where it is the fastest: within 1e-4 (at most
    /// 4.8e-5 measured at 8 to 2048 input channels, 7e-5 asserted).
    #[default]
    Balanced,
}

impl Precision {
    /// Every level, most exact first.
    pub const ALL: [Precision; 3] = [Precision::Exact, Precision::Accurate, Precision::Balanced];

    /// The largest Winograd tile this precision allows (0: none).
    pub(crate) fn max_tile(self) -> usize {
        match self {
            Precision::Exact => 0,
            Precision::Accurate => 4,
            Precision::Balanced => 6,
        }
    }

    /// The lowercase name (`exact`, `accurate`, `balanced`) of `--precision`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Accurate => "accurate",
            Precision::Balanced => "balanced",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s.trim())
            .ok_or_else(|| crate::Error::InvalidParameter {
                what: "precision",
                detail: format!("{s:?} is not one of exact, accurate, balanced"),
            })
    }
}

/// Per tile size `m`: how many times a plain sum of products' rounding tolerance
/// ([`Reference::tolerance`](crate::reference::Reference::tolerance)) its results stay within,
/// about three times the worst seen on 300 random shapes per kernel (F(2,3) 0.46, F(4,3) 2.7,
/// F(5,3) 4.0, F(6,3) 5.3; 9.0 once for the 1-D F(6,3), 2026-12-07).
pub const ERROR_FACTOR: [(usize, f64); 4] = [(2, 2.0), (4, 8.0), (5, 12.0), (6, 16.0)];

/// Per tile size `m` and input channels: the largest `|result - reference| / rms(reference)`
/// on N(0,1) inputs and weights (3x3, 16 output channels, 14x14 image with "same" padding, so
/// tiles are ragged), measured by `tests/winograd.rs`, which asserts these bounds (each the
/// measurement rounded up). Plain sums of products stay within 2e-6 on the same data.
pub const RELATIVE_ERROR: [(usize, [(usize, f64); 4]); 4] = [
    (2, [(8, 1e-6), (64, 2e-6), (512, 4e-6), (2048, 4e-6)]),
    (4, [(8, 1.5e-5), (64, 2.5e-5), (512, 4e-5), (2048, 4e-5)]),
    (5, [(8, 2e-5), (64, 3e-5), (512, 7e-5), (2048, 5e-5)]),
    (6, [(8, 2e-5), (64, 4e-5), (512, 7e-5), (2048, 7e-5)]),
];

/// The dimensionality of the Winograd tiles that fit `p`, or why none does.
fn dims_for(p: &ConvParams) -> std::result::Result<usize, String> {
    if p.stride != [1, 1] || p.dilation != [1, 1] {
        return Err(format!(
            "Winograd takes stride 1 and dilation 1; got stride {:?}, dilation {:?}",
            p.stride, p.dilation
        ));
    }
    match p.kernel {
        [3, 3] => Ok(2),
        [1, 3] => Ok(1),
        k => Err(format!(
            "Winograd takes 3x3 and 1x3 kernels; got {}x{}",
            k[0], k[1]
        )),
    }
}

/// The transforms of tile `m` at `isa` for `p`, or why there are none.
pub(crate) fn kernel_for(
    p: &ConvParams,
    isa: Isa,
    m: usize,
) -> std::result::Result<&'static WinoKernel, String> {
    let dims = dims_for(p)?;
    cpu::wino_f32()
        .iter()
        .find(|k| k.isa == isa && k.m == m && k.dims == dims)
        .ok_or_else(|| format!("no F({m},3) {dims}-D transforms generated for {isa}"))
}

pub(crate) struct Winograd {
    kern: &'static WinoKernel,
    gemm: &'static GemmKernel,
    transpose: cpu::Transpose8x8,
    layout: Layout,
    cin_g: usize,
    cout_g: usize,
    /// Floats from one tile's row of `V_ξ` to the next: the input channels rounded up to the
    /// vector, and off a multiple of 4 KiB (the 8 rows a microkernel reads would share one
    /// set of the L1 cache).
    rs_v: usize,
    /// Output channels rounded up to the GEMM's `nr` (a multiple of the vector).
    cout_pad: usize,
    /// `[group][pass][ξ][panel]` of `prepack` of `nr` output channels x `cin_g`: the GEMMs' B
    /// operands, in the order a run reads them (a pass of [`PASS_CHANNELS`] at a time).
    u: AlignedBuf,
    /// `[group][cout_pad]`, zero past the group's channels.
    bias: Vec<f32>,
}

/// How one plan splits the work.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WinoPlan {
    tiles_y: usize,
    tiles_x: usize,
    /// Tiles an item.
    chunk: usize,
    chunks: usize,
    items: usize,
    workers: usize,
    /// K-block of the GEMMs.
    kc: usize,
    /// Longest run of an item's tiles in one tile row.
    run: usize,
    /// Floats from one position ξ of V (and of M) to the next, an odd number of cache lines
    /// ([`odd_lines`]).
    v_xi: usize,
    m_xi: usize,
    scratch_per_worker: usize,
}

impl WinoPlan {
    pub(crate) fn workspace_floats(&self) -> usize {
        self.workers * self.scratch_per_worker
    }
}

/// Floats of transformed tiles (inputs and products) an item keeps: 5/8 of this core's L2
/// ([`cpu::l2_bytes`]), so they stay there beside a K-block of the weights (640 KiB of Zen 4's
/// 1 MiB). Bigger items stream the transformed weights fewer times: on Sapphire Rapids (2 MiB
/// L2) 1.25 MiB items instead of 640 KiB ran resnet50_l2_3x3 1.21x, l3_3x3 1.14x, l3_batch8
/// 1.27x, vgg16 1.11x, l1 and l4 level (median of 7 interleaved rounds' ratios, one thread).
fn item_floats() -> usize {
    cpu::l2_bytes() / 4 * 5 / 8
}

/// Transformed weights of a group past which an item takes all of an image's tiles (12 MiB, a
/// third of the L3 this machine's two cores share with the rest of the host). Measured on
/// resnet50_l4_3x3 (F(2,3), 512 channels, 16 MiB of weights, 16 tiles), one thread, three
/// interleaved rounds: AVX2 50 -> 71 GFLOP/s (im2col+GEMM 51-64), AVX-512 67 -> 110.
const U_STREAM_FLOATS: usize = 3 << 20;

/// Output channels the GEMMs of an item compute before their output transforms run: M holds
/// one pass, so an item's budget goes to its tiles rather than to all its products, and its
/// GEMMs accumulate K-blocks into a small M. Against passes of every channel, 5-7 interleaved
/// rounds, one thread: one 32-wide AVX-512 panel a pass ran resnet50_l2_3x3 1.04-1.06x,
/// vgg16 1.03-1.05x, l4_3x3 1.14-1.20x, l1/l3/batch8 0.96-1.02x (64 channels a pass lost the
/// l2 and vgg16 gains); at AVX2 two 16-wide panels ran l4 1.16x, l2 1.02x, l1 1.01x but l3
/// 0.95x (one panel: 0.84-0.95x, four 0.97x: its 16 or more passes each read V again).
const PASS_CHANNELS: usize = 32;

/// GEMM panels of `nr` output channels a pass.
fn pass_panels(nr: usize) -> usize {
    (PASS_CHANNELS / nr).max(1)
}

/// The passes over `panels` panels: (first panel, panels).
fn passes(panels: usize, nr: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = pass_panels(nr);
    (0..panels)
        .step_by(per)
        .map(move |j0| (j0, per.min(panels - j0)))
}

/// The item size, at most `max` tiles, whose items keep `threads` workers busiest: workers take
/// contiguous ranges of the `groups` x chunks items, and an item of n tiles costs n transforms,
/// a GEMM over n rows (a last block of fewer than `mr` costs its rows: there are edge kernels
/// for each count) and a pass over the weights, about a register block's GEMM. Ties go to the
/// bigger item (fewer passes over the weights); one thread takes `max`. (On two threads 100
/// tiles in items of 40 left one worker 40 tiles and the other 60; 8 images of 9 tiles in
/// items of 8, when padded blocks were the cost, left them 32 and 40: 1.03x ncnn at two
/// threads against 1.13x at one.)
fn balanced_chunk(max: usize, tiles: usize, mr: usize, groups: usize, threads: usize) -> usize {
    if threads == 1 {
        return max;
    }
    let cost = |n: usize| 2 * n + mr;
    let makespan = |c: usize| {
        let chunks = tiles.div_ceil(c);
        let items = groups * chunks;
        let (full, last) = (cost(c), cost(tiles - (chunks - 1) * c));
        (0..threads)
            .map(|w| {
                let (a, b) = (w * items / threads, (w + 1) * items / threads);
                // Items a..b, of which those at a group's last chunk hold the remainder.
                let lasts = b / chunks - a / chunks;
                (b - a - lasts) * full + lasts * last
            })
            .max()
            .unwrap_or(0)
    };
    (1..=max).rev().min_by_key(|&c| makespan(c)).unwrap_or(max)
}

impl Winograd {
    /// Why Winograd cannot run `p` at `isa`, if it cannot.
    pub(crate) fn rejects(p: &ConvParams, isa: Isa) -> Option<String> {
        kernel_for(p, isa, 2).err()
    }

    pub(crate) fn new(
        p: &ConvParams,
        weights: &[f32],
        bias: Option<&[f32]>,
        isa: Isa,
        kern: &'static WinoKernel,
    ) -> Result<Self> {
        let gemm = cpu::gemm_f32(isa);
        let (cin_g, cout_g, groups) = (
            p.in_channels_per_group(),
            p.out_channels_per_group(),
            p.groups,
        );
        let (t, xis, nr) = (kern.t(), kern.xis(), gemm.nr);
        let g_mat = cpu::wino_g(kern.m);
        let cout_pad = cout_g.next_multiple_of(nr);
        let per_xi = prepacked_len(cout_g, cin_g, nr);
        let mut u = AlignedBuf::zeroed(
            mul(&[groups, xis, per_xi], "Winograd weights")?,
            "Winograd weights",
        )?;
        // The filter transform in f64, rounded once: G g Gt (2-D) or G g (1-D).
        let taps = if kern.dims == 2 { 9 } else { 3 };
        let n = mul(&[xis, cout_g, cin_g], "Winograd weights")?;
        let mut ut: Vec<f64> = Vec::new();
        ut.try_reserve_exact(n)
            .map_err(|_| crate::Error::OutOfMemory {
                what: "Winograd weights",
                bytes: n.saturating_mul(8),
            })?;
        ut.resize(n, 0.0);
        for g in 0..groups {
            for co in 0..cout_g {
                for ci in 0..cin_g {
                    let w = &weights[((g * cout_g + co) * cin_g + ci) * taps..][..taps];
                    for xi in 0..xis {
                        let (k, l) = (xi / t, xi % t);
                        let v: f64 = if kern.dims == 2 {
                            (0..3)
                                .map(|i| {
                                    g_mat[k][i]
                                        * (0..3)
                                            .map(|j| w[i * 3 + j] as f64 * g_mat[l][j])
                                            .sum::<f64>()
                                })
                                .sum()
                        } else {
                            (0..3).map(|j| w[j] as f64 * g_mat[xi][j]).sum()
                        };
                        ut[(xi * cout_g + co) * cin_g + ci] = v;
                    }
                }
            }
            let (block, panels) = (cin_g * nr, cout_pad / nr);
            for (j0, gp) in passes(panels, nr) {
                for xi in 0..xis {
                    for j in j0..j0 + gp {
                        let at = ((g * panels + j0) * xis + xi * gp + j - j0) * block;
                        let dst = &mut u.as_mut_slice()[at..][..block];
                        let rows = nr.min(cout_g - j * nr);
                        let src = &ut[(xi * cout_g + j * nr) * cin_g..][..rows * cin_g];
                        prepack(dst, rows, cin_g, nr, |co, ci| src[co * cin_g + ci] as f32);
                    }
                }
            }
        }
        let mut rs_v = cin_g.next_multiple_of(kern.lanes);
        if rs_v.is_multiple_of(1024) {
            rs_v += kern.lanes;
        }
        let mut padded = vec![0.0; groups * cout_pad];
        if let Some(b) = bias {
            for g in 0..groups {
                padded[g * cout_pad..][..cout_g].copy_from_slice(&b[g * cout_g..][..cout_g]);
            }
        }
        Ok(Winograd {
            kern,
            gemm,
            transpose: cpu::transpose_8x8(isa),
            layout: p.layout,
            cin_g,
            cout_g,
            rs_v,
            cout_pad,
            u,
            bias: padded,
        })
    }

    pub(crate) fn error_factor(&self) -> f64 {
        error_factor(self.kern.m)
    }

    pub(crate) fn kernel_name(&self) -> String {
        format!("{}+{}", self.kern.name, self.gemm.name)
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> WinoPlan {
        let (m, mr) = (self.kern.m, self.gemm.mr);
        let tiles_y = g.oh.div_ceil(self.kern.rows_out());
        let tiles_x = g.ow.div_ceil(m);
        let tiles = tiles_y * tiles_x;
        // Items take tiles of every image of the batch (of one group): more tiles an item
        // means more reuse of each block of transformed weights.
        let tiles = tiles * g.batch;
        // A tile keeps its transformed input and one pass of its products (M holds one pass
        // of output channels at a time).
        let pass = pass_panels(self.gemm.nr) * self.gemm.nr;
        let per_tile = self.kern.xis() * (self.rs_v + pass);
        // As many tiles as fit the budget, at least one register block of the GEMM; then the
        // size at most that which splits evenly between the threads (`balanced_chunk`).
        let mut chunk = (item_floats() / per_tile / mr).max(1) * mr;
        // Every item streams the group's transformed weights once; where they are too big for
        // the caches, an item takes a whole image's tiles so they stream once an image (not
        // rounded up to the register block: F(5,3) on 14x14 has 9 tiles an image, and 16 would
        // push the item out of L2).
        let u_floats = self.kern.xis() * self.cin_g * self.cout_pad;
        if u_floats > U_STREAM_FLOATS {
            chunk = chunk.max(tiles / g.batch);
        }
        let t = threads.max(1);
        let chunk = balanced_chunk(chunk.min(tiles), tiles, mr, g.groups, t);
        let chunk_pad = chunk.next_multiple_of(mr);
        let chunks = tiles.div_ceil(chunk);
        let items = g.groups * chunks;
        let workers = t.min(items);
        let kc = Blocking::new(self.gemm, self.cin_g, self.gemm.nr, 1).kc;
        let run = chunk.min(tiles_x);
        let lanes = self.kern.lanes;
        let xis = self.kern.xis();
        let rin = self.kern.rows_in() * (run * m + 2) * lanes;
        let rout = self.kern.rows_out() * run * m * lanes;
        // V and M hold a position's tiles up to a whole register block.
        let (v_xi, m_xi) = (
            odd_lines(chunk_pad * self.rs_v),
            odd_lines(chunk_pad * pass),
        );
        let scratch_per_worker = xis * (v_xi + m_xi) + rin + rout;
        WinoPlan {
            tiles_y,
            tiles_x,
            chunk,
            chunks,
            items,
            workers,
            kc,
            run,
            v_xi,
            m_xi,
            scratch_per_worker,
        }
    }

    /// Runs a planned convolution. Slice lengths were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &WinoPlan,
        g: &Geometry,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
        activation: Activation,
        scratch: &mut [f32],
    ) {
        let out = SendPtr(output.as_mut_ptr());
        let scratch = &mut scratch[..plan.workspace_floats()];
        let tiles = plan.tiles_y * plan.tiles_x * g.batch;
        for_each_worker(plan.workers, plan.items, scratch, |s, item| {
            let p0 = item % plan.chunks * plan.chunk;
            let job = Item {
                grp: item / plan.chunks,
                p0,
                p1: (p0 + plan.chunk).min(tiles),
            };
            // SAFETY: items write disjoint tiles of the output (distinct group or tiles),
            // which `output` covers: its length was checked. The kernels' ISA was checked at
            // create time.
            unsafe { self.run_item(plan, g, input, residual, out, activation, s, &job) };
        });
    }

    /// One item: transform its tiles' inputs, the GEMMs, transform back and store.
    ///
    /// # Safety
    /// No other item writes the item's output tiles; the kernels' ISA is this CPU's.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run_item(
        &self,
        plan: &WinoPlan,
        g: &Geometry,
        input: &[f32],
        residual: Option<&[f32]>,
        out: SendPtr,
        activation: Activation,
        scratch: &mut [f32],
        it: &Item,
    ) {
        let k = self.kern;
        let (m, lanes, xis, mr) = (k.m, k.lanes, k.xis(), self.gemm.mr);
        let (cin_g, rs_v, cout_pad) = (self.cin_g, self.rs_v, self.cout_pad);
        let (v_xi, m_xi) = (plan.v_xi, plan.m_xi);
        let (v, rest) = scratch.split_at_mut(xis * v_xi);
        let (mm, rest) = rest.split_at_mut(xis * m_xi);
        let cols_in = plan.run * m + 2;
        let (rin, rout) = rest.split_at_mut(k.rows_in() * cols_in * lanes);
        // Blocks of `mr` tiles (the item's last may hold fewer than the plan's chunk); tiles
        // past the item's last, up to a whole block, multiply zeros.
        let (tiles, blocks) = (it.p1 - it.p0, (it.p1 - it.p0).div_ceil(mr));
        for xi in 0..xis {
            v[xi * v_xi + tiles * rs_v..xi * v_xi + blocks * mr * rs_v].fill(0.0);
        }
        // 1. Input transforms, a block of `lanes` input channels at a time, into V[ξ][tile].
        for c0 in (0..cin_g).step_by(lanes) {
            let cb = lanes.min(cin_g - c0);
            for run in runs(it.p0, it.p1, (plan.tiles_y, plan.tiles_x)) {
                let y0 = (run.ty * k.rows_out()) as isize - g.pad_top as isize;
                let x0 = (run.tx0 * m) as isize - g.pad_left as isize;
                let cols = run.len * m + 2;
                self.load_region(g, input, run.n, it.grp, c0, cb, y0, x0, cols, rin);
                for i in 0..run.len {
                    let p = run.p - it.p0 + i;
                    // SAFETY: the tile's rows_in x t pixels lie in the region (cols = len*m +
                    // 2 wide); its xis vectors go to V[xi][p][c0..c0 + lanes], inside V (p is
                    // below the item's tiles rounded up to mr, c0 + lanes <= rs_v).
                    (k.func)(
                        rin[i * m * lanes..].as_ptr(),
                        cols * lanes,
                        v[p * rs_v + c0..].as_mut_ptr(),
                        v_xi,
                    );
                }
            }
        }
        // 2. and 3., a pass of output channels at a time: one GEMM per position of the
        // transformed tile into M (which holds one pass, so the budget of an item goes to its
        // tiles), then the output transforms of those channels.
        let ep = GemmEpilogue::plain(false);
        let (nr, panels) = (self.gemm.nr, cout_pad / self.gemm.nr);
        // The last block of tiles runs the edge kernel of its rows, where there is one; else
        // the rows past the item's tiles are computed (from zeros) and stored like the
        // others: M has room for them, and whole tiles take the kernels' fast store.
        let last = blocks - 1;
        let last_rows = tiles - last * mr;
        let (last_func, last_rows) = match self.gemm.a_rows_edge.get(last_rows - 1) {
            Some(&f) => (f, last_rows),
            None => (self.gemm.a_rows, mr),
        };
        let u = self.u.as_slice();
        let cols_out = plan.run * m;
        for (j0, gp) in passes(panels, nr) {
            // M's rows: the pass's channels.
            let rs_m = gp * nr;
            for xi in 0..xis {
                let block = gp * cin_g * nr;
                let ub = &u[((it.grp * panels + j0) * xis + xi * gp) * cin_g * nr..][..block];
                for k0 in (0..cin_g).step_by(plan.kc) {
                    let kc = plan.kc.min(cin_g - k0);
                    let ep = GemmEpilogue {
                        accumulate: k0 > 0,
                        ..ep
                    };
                    for j in 0..gp {
                        let b = ub[(j * cin_g + k0) * nr..].as_ptr();
                        for q in 0..blocks {
                            let a = v[xi * v_xi + q * mr * rs_v + k0..].as_ptr();
                            let c = mm[xi * m_xi + q * mr * rs_m + j * nr..].as_mut_ptr();
                            // SAFETY: V holds mr rows of rs_v >= k0 + kc floats from `a` (V_ξ
                            // has room for whole blocks); the B panel kc steps of nr; C is mr
                            // rows of nr floats rs_m apart inside M_ξ (room for whole blocks).
                            let (func, rows) = if q == last {
                                (last_func, last_rows)
                            } else {
                                (self.gemm.a_rows, mr)
                            };
                            func(kc, a, rs_v, b, c, rs_m as isize, rows, nr, &ep);
                        }
                    }
                }
            }
            // Output transforms, a block of `lanes` of the pass's channels at a time.
            let first = j0 * nr;
            for co in (first..self.cout_g.min(first + rs_m)).step_by(lanes) {
                let cb = lanes.min(self.cout_g - co);
                let bias = self.bias[it.grp * cout_pad + co..].as_ptr();
                for run in runs(it.p0, it.p1, (plan.tiles_y, plan.tiles_x)) {
                    for i in 0..run.len {
                        let p = run.p - it.p0 + i;
                        // SAFETY: M_ξ holds the tile's row of rs_m floats, co - first + lanes
                        // <= rs_m (lanes divides nr); the tile's rows_out x m pixels lie in
                        // rout.
                        (k.output)(
                            mm[p * rs_m + co - first..].as_ptr(),
                            m_xi,
                            bias,
                            rout[i * m * lanes..].as_mut_ptr(),
                            cols_out * lanes,
                        );
                    }
                    self.store_region(
                        g, &run, it, co, cb, cols_out, rout, residual, out, activation,
                    );
                }
            }
        }
    }

    /// Input channels `c0..c0+cb` of the group, rows `y0..` and columns `x0..x0+cols` (zero
    /// outside the image), into `rin` as `[row][col][lanes]`.
    #[allow(clippy::too_many_arguments)]
    fn load_region(
        &self,
        g: &Geometry,
        input: &[f32],
        n: usize,
        grp: usize,
        c0: usize,
        cb: usize,
        y0: isize,
        x0: isize,
        cols: usize,
        rin: &mut [f32],
    ) {
        let planes = Planes {
            layout: self.layout,
            channels: g.c_in,
            h: g.h,
            w: g.w,
        };
        let first = (n, grp * self.cin_g + c0, cb);
        let region = (y0, x0, self.kern.rows_in(), cols, self.kern.lanes);
        load_region(&planes, self.transpose, input, first, region, rin);
    }

    /// Output channels `co..co+cb` of the group for a run of tiles, from `rout`
    /// (`[row][col][lanes]`, `cols` wide), into the output with the residual and activation.
    #[allow(clippy::too_many_arguments)]
    unsafe fn store_region(
        &self,
        g: &Geometry,
        run: &Run,
        it: &Item,
        co: usize,
        cb: usize,
        cols: usize,
        rout: &[f32],
        residual: Option<&[f32]>,
        out: SendPtr,
        activation: Activation,
    ) {
        let (m, lanes) = (self.kern.m, self.kern.lanes);
        let ox0 = run.tx0 * m;
        let n = (run.len * m).min(g.ow - ox0);
        let cfirst = it.grp * self.cout_g + co;
        let ohw = g.oh * g.ow;
        let finish = |seg: &mut [f32], at: usize| {
            if let Some(r) = residual {
                let len = seg.len();
                for (v, r) in seg.iter_mut().zip(&r[at..at + len]) {
                    *v += r;
                }
            }
            if activation != Activation::None {
                activation.apply_slice(seg);
            }
        };
        for a in 0..self.kern.rows_out() {
            let y = run.ty * self.kern.rows_out() + a;
            if y >= g.oh {
                break;
            }
            let row = &rout[a * cols * lanes..][..cols * lanes];
            match self.layout {
                Layout::Nchw => {
                    let plane0 = (run.n * g.c_out + cfirst) * ohw + y * g.ow + ox0;
                    let (c8, n8) = (cb / 8 * 8, n / 8 * 8);
                    for c in (0..c8).step_by(8) {
                        for x in (0..n8).step_by(8) {
                            // SAFETY: 8 pixels x 8 channels of rout (rows `lanes` apart) into
                            // 8 planes' runs of 8 (rows `ohw` apart), all inside this item's
                            // output tiles and channels.
                            (self.transpose)(
                                row[x * lanes + c..].as_ptr(),
                                lanes,
                                out.get().add(plane0 + c * ohw + x),
                                ohw,
                            );
                        }
                    }
                    for c in 0..cb {
                        let xs = if c < c8 { n8..n } else { 0..n };
                        for x in xs {
                            *out.get().add(plane0 + c * ohw + x) = row[x * lanes + c];
                        }
                        let at = plane0 + c * ohw;
                        // SAFETY: this channel's `n` pixels of output row `y`, written above
                        // by this item alone, inside the output (length checked).
                        finish(std::slice::from_raw_parts_mut(out.get().add(at), n), at);
                    }
                }
                Layout::Nhwc => {
                    let first = ((run.n * g.oh + y) * g.ow + ox0) * g.c_out + cfirst;
                    for x in 0..n {
                        let at = first + x * g.c_out;
                        // SAFETY: this pixel's `cb` channels of the group, which only this
                        // item writes, inside the output (length checked).
                        let seg = std::slice::from_raw_parts_mut(out.get().add(at), cb);
                        seg.copy_from_slice(&row[x * lanes..][..cb]);
                        finish(seg, at);
                    }
                }
            }
        }
    }
}

/// `n` floats rounded up to whole cache lines, and to an odd number of them: the transforms
/// read or write a tile's `t²` vectors one position ξ apart, which at an even number of lines
/// (40 tiles of 64 channels: 160 lines) fall into a few sets of the L1 cache and evict each
/// other.
fn odd_lines(n: usize) -> usize {
    let lines = n.div_ceil(16);
    (lines | 1) * 16
}

/// [`ERROR_FACTOR`] of tile size `m`.
pub(crate) fn error_factor(m: usize) -> f64 {
    ERROR_FACTOR
        .iter()
        .find(|e| e.0 == m)
        .map_or(f64::INFINITY, |e| e.1)
}

/// The tensor a region is read from: its layout and the sizes of one image.
pub(crate) struct Planes {
    pub layout: Layout,
    pub channels: usize,
    pub h: usize,
    pub w: usize,
}

/// Channels `c0..c0+cb` of image `n` of `t`, rows `y0..y0+rows` and columns `x0..x0+cols`
/// (zero outside the image, and in the channels past `cb`), into `rin` as
/// `[row][col][lanes]`.
pub(crate) fn load_region(
    t: &Planes,
    transpose: cpu::Transpose8x8,
    input: &[f32],
    (n, cfirst, cb): (usize, usize, usize),
    (y0, x0, rows, cols, lanes): (isize, isize, usize, usize, usize),
    rin: &mut [f32],
) {
    let rin = &mut rin[..rows * cols * lanes];
    let xa = (-x0).clamp(0, cols as isize) as usize;
    let xb = (t.w as isize - x0).clamp(xa as isize, cols as isize) as usize;
    for r in 0..rows {
        let y = y0 + r as isize;
        let row = &mut rin[r * cols * lanes..][..cols * lanes];
        if y < 0 || y >= t.h as isize || xa == xb {
            row.fill(0.0);
            continue;
        }
        row[..xa * lanes].fill(0.0);
        row[xb * lanes..].fill(0.0);
        let (y, xs) = (y as usize, (x0 + xa as isize) as usize);
        match t.layout {
            Layout::Nchw => {
                let hw = t.h * t.w;
                let plane0 = (n * t.channels + cfirst) * hw + y * t.w + xs;
                let n = xb - xa;
                let (c8, n8) = (cb / 8 * 8, n / 8 * 8);
                for c in (0..c8).step_by(8) {
                    for x in (0..n8).step_by(8) {
                        let src = &input[plane0 + c * hw + x..][..7 * hw + 8];
                        let dst = &mut row[(xa + x) * lanes + c..][..7 * lanes + 8];
                        // SAFETY: 8 rows of 8 floats, `hw` apart in `src` and `lanes` apart in
                        // `dst`, lie in the two slices (their lengths); the transpose's ISA is
                        // this CPU's.
                        unsafe { transpose(src.as_ptr(), hw, dst.as_mut_ptr(), lanes) };
                    }
                }
                for x in 0..n {
                    let px = &mut row[(xa + x) * lanes..][..lanes];
                    let chans = if x < n8 { c8..cb } else { 0..cb };
                    for c in chans {
                        px[c] = input[plane0 + c * hw + x];
                    }
                    px[cb..].fill(0.0);
                }
            }
            Layout::Nhwc => {
                let first = ((n * t.h + y) * t.w + xs) * t.channels + cfirst;
                for x in 0..xb - xa {
                    let px = &mut row[(xa + x) * lanes..][..lanes];
                    px[..cb].copy_from_slice(&input[first + x * t.channels..][..cb]);
                    px[cb..].fill(0.0);
                }
            }
        }
    }
}

/// The tiles of one work item: group `grp`, tiles `p0..p1` in row-major order over the
/// batch's images.
struct Item {
    grp: usize,
    p0: usize,
    p1: usize,
}

/// Tiles `p..p+len` of an item that lie in one tile row: image `n`, row `ty`, columns
/// `tx0..tx0+len`.
pub(crate) struct Run {
    pub p: usize,
    pub n: usize,
    pub ty: usize,
    pub tx0: usize,
    pub len: usize,
}

/// The runs of tiles `p0..p1` (row-major over rows of `tiles_x` tiles, `tiles_y` rows an
/// image, image after image).
pub(crate) fn runs(
    p0: usize,
    p1: usize,
    (tiles_y, tiles_x): (usize, usize),
) -> impl Iterator<Item = Run> {
    let mut p = p0;
    std::iter::from_fn(move || {
        (p < p1).then(|| {
            let (row, tx0) = (p / tiles_x, p % tiles_x);
            let len = (tiles_x - tx0).min(p1 - p);
            let run = Run {
                p,
                n: row / tiles_y,
                ty: row % tiles_y,
                tx0,
                len,
            };
            p += len;
            run
        })
    })
}

#[cfg(test)]
mod tests {
    use super::balanced_chunk;

    #[test]
    fn items_split_the_tiles_evenly_between_threads() {
        // 100 tiles, items of up to 40, register blocks of 8: 40+40+20 leaves one of two
        // workers 60 tiles; 25-tile items give them 50 each.
        assert_eq!(balanced_chunk(40, 100, 8, 1, 2), 25);
        // 25 tiles: 13 + 12 beats 16 + 9.
        assert_eq!(balanced_chunk(16, 25, 8, 1, 2), 13);
        // 8 images of 9 tiles (F(5,3) on 14x14): an image an item, four a worker.
        assert_eq!(balanced_chunk(9, 72, 8, 1, 2), 9);
        // One thread takes the biggest item; two groups on two threads need no split.
        assert_eq!(balanced_chunk(40, 100, 8, 1, 1), 40);
        assert_eq!(balanced_chunk(16, 16, 8, 2, 2), 16);
    }
}
