//! Depthwise convolution (groups == input channels) with the generated kernels of
//! `codegen/src/depthwise.rs`: an unrolled kernel per (kernel, stride) of the generator's
//! table, and a generic kernel, still vectorised, for every other kernel, stride and dilation.
//!
//! NCHW runs one channel plane at a time (any channel multiplier: output channel `o` reads
//! input plane `o / multiplier`); NHWC vectorises across channels (multiplier 1; other
//! multipliers go to the grouped path). Small NCHW planes at stride 1 run whole as flat
//! vectors (the flat kernels, `Mode::Flat`), or 16 at a time transposed to pixels for
//! the NHWC kernels (the blocked mode). Weights are packed once: as they come (a plane's taps
//! are contiguous) for NCHW, tap-major with the channels padded to a whole vector for NHWC.

use super::{for_each_worker, SendPtr};
use crate::cpu::{self, Isa};
use crate::cpu::{TransposeMasked16, TransposeRows8x8};
use crate::params::Geometry;
use crate::storage::{narrow, widen, Storage, StorageType};
use crate::{Activation, ConvParams, Error, Layout, Padding, Result};

/// What one depthwise kernel call computes: output rows `oy0..oy1` of one channel plane
/// (NCHW) or of one image (NHWC). Which fields a kernel reads is in its documentation.
// The flat kernels' fields are read only where x86 kernels are built.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct DwArgs {
    pub input: *const f32,
    pub output: *mut f32,
    /// Null, or a tensor shaped like `output` that is added before the activation.
    pub residual: *const f32,
    pub weights: *const f32,
    pub bias: *const f32,
    pub in_h: usize,
    pub in_w: usize,
    pub ow: usize,
    /// NHWC: channels per pixel.
    pub channels: usize,
    /// NHWC: floats between two taps of the packed weights (channels rounded up to a vector).
    pub wstride: usize,
    pub oy0: usize,
    pub oy1: usize,
    pub pad_top: usize,
    pub pad_left: usize,
    /// Kernel, stride and dilation: read only by the generic kernels.
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub dh: usize,
    pub dw: usize,
    /// Clamp bounds of the activation (infinite when it has none).
    pub min: f32,
    pub max: f32,
    /// Flat kernels: output planes a call runs, floats between the input planes of two
    /// consecutive ones (0 where they read the same plane: a channel multiplier), the input
    /// offset of each tap, the lane masks of each (vector, tap) and the vectors a plane takes
    /// (a multiple of the kernel's `block`). Read by no other kernel.
    pub planes: usize,
    pub in_step: usize,
    pub offsets: *const isize,
    pub masks: *const u16,
    pub vectors: usize,
}

/// A generated depthwise kernel, as the generator's registry lists it.
pub struct DwKernel {
    pub name: &'static str,
    pub isa: Isa,
    /// # Safety
    /// The CPU has `isa`, and the pointers of the arguments cover the sizes they give.
    pub func: unsafe fn(&DwArgs),
    pub layout: Layout,
    /// A flat-plane kernel (NCHW, stride 1, output as wide as the input; any kernel and
    /// dilation): whole planes as flat vectors, with the plan's lane masks.
    pub flat: bool,
    /// `Some((kernel, stride))`: square kernel and stride, dilation 1. `None`: any shape.
    pub fixed: Option<(usize, usize)>,
    /// Floats per vector.
    pub lanes: usize,
    /// Outputs kept in registers: rows (NCHW) or pixels of a row (NHWC).
    pub block: usize,
    /// An 8-lane variant of a 16-lane ISA, for narrow images.
    pub ymm: bool,
    /// The type of `input`, `output` and `residual`: f32, or f16/bf16 (passed cast to
    /// `*const f32`; weights and bias are f32 in every kernel).
    pub storage: StorageType,
}

/// Channels the channel-major packing pads to, and the block of channels the blocked NCHW
/// mode transposes at a time: the widest vector of any ISA.
const BLOCK: usize = 16;

/// How a planned depthwise convolution runs.
#[derive(Clone, Copy)]
enum Mode {
    /// NCHW, one channel plane at a time, vectorised along the rows.
    Planes,
    /// NHWC, vectorised across channels.
    Channels,
    /// NCHW through the channel kernels: 16 planes at a time transposed into a scratch of
    /// 16-channel pixels, run, and transposed back. For small images, whose rows are too short
    /// for the plane kernels' vectors, that the flat kernels do not take.
    Blocked,
    /// NCHW, whole planes as flat vectors (stride 1, output as wide as the input), lane
    /// masks from the plan's [`FlatTable`]: small planes, without transposes or short rows.
    Flat,
}

/// What a flat kernel reads besides the tensors: the input offset of each tap and the lane
/// masks of each (vector, tap), vectors in blocks of the kernel's `block` (the last block
/// padded with empty masks).
struct FlatTable {
    offsets: Vec<isize>,
    masks: Vec<u16>,
    vectors: usize,
}

impl FlatTable {
    fn new(g: &Geometry, lanes: usize, block: usize) -> Self {
        let (n, w) = (g.oh * g.ow, g.w as isize);
        debug_assert!(g.sh == 1 && g.sw == 1 && g.ow == g.w);
        let taps: Vec<(isize, isize)> = (0..g.kh)
            .flat_map(|ky| (0..g.kw).map(move |kx| (ky, kx)))
            .map(|(ky, kx)| {
                (
                    (ky * g.dh) as isize - g.pad_top as isize,
                    (kx * g.dw) as isize - g.pad_left as isize,
                )
            })
            .collect();
        let vectors = n.div_ceil(lanes).next_multiple_of(block);
        let mut masks = vec![0u16; vectors * taps.len()];
        for (v, t) in (0..vectors).flat_map(|v| (0..taps.len()).map(move |t| (v, t))) {
            let (dy, dx) = taps[t];
            let mut bits = 0u16;
            for lane in 0..lanes {
                let o = v * lanes + lane;
                let (iy, ix) = ((o / g.ow) as isize + dy, (o % g.ow) as isize + dx);
                if o < n && (0..g.h as isize).contains(&iy) && (0..w).contains(&ix) {
                    bits |= 1 << lane;
                }
            }
            masks[(v / block * taps.len() + t) * block + v % block] = bits;
        }
        FlatTable {
            offsets: taps.iter().map(|&(dy, dx)| dy * w + dx).collect(),
            masks,
            vectors,
        }
    }
}

/// Whether `p` has a shape the flat kernels take: stride 1 and an output as wide as the input
/// (`Same`, or explicit left and right padding that add up to the kernel's reach).
fn flat_fits(p: &ConvParams) -> bool {
    let reach = (p.kernel[1] - 1) * p.dilation[1];
    p.layout == Layout::Nchw
        && p.stride == [1, 1]
        && match p.padding {
            Padding::Same | Padding::SameLower => true,
            Padding::Valid => reach == 0,
            Padding::Explicit { left, right, .. } => left + right == reach,
        }
}

/// The weights packed channel-major for the channel kernels: tap-major, `wstride` floats a
/// tap (the channels rounded up to [`BLOCK`]), and the bias padded the same way.
struct ChannelWeights {
    kern: &'static DwKernel,
    weights: Vec<f32>,
    bias: Vec<f32>,
    wstride: usize,
}

pub(crate) struct Depthwise {
    /// NCHW: the plane kernel, its weights as they come (a plane's taps are contiguous).
    planes: Option<(&'static DwKernel, Vec<f32>, Vec<f32>)>,
    /// NCHW at AVX-512 only: the 8-lane plane kernel of the same shape, for images at most 8
    /// wide, where a 16-lane vector would be half empty.
    narrow: Option<&'static DwKernel>,
    /// NHWC, or NCHW with channel multiplier 1 (the blocked mode).
    channels: Option<ChannelWeights>,
    /// NCHW shapes the flat kernels take: this ISA's flat kernel (weights as the planes'),
    /// and at AVX-512 its 8-lane twin for planes of at most 32 outputs.
    flat: Option<&'static DwKernel>,
    flat_narrow: Option<&'static DwKernel>,
    multiplier: usize,
    /// The blocked mode's transposes.
    transpose: BlockTranspose,
    /// The mode a forced kernel runs in.
    forced_mode: Option<Mode>,
    /// The ISA level the kernels were chosen for.
    isa: Isa,
    /// A 16-bit kernel was forced: 16-bit runs take it.
    forced_half: bool,
}

/// The ISA of the 16-bit kernels run at level `isa`, if there are any: AVX2 needs F16C (every
/// AVX2 CPU has it, and x86-64-v3 detection checks it), AVX-512 masks 16-bit lanes (BW + VL,
/// part of the level's detection); NEON runs the bands' conversions around its f32 kernels.
fn half_isa(isa: Isa) -> Option<Isa> {
    match isa {
        Isa::Scalar => Some(Isa::Scalar),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 if std::arch::is_x86_feature_detected!("f16c") => Some(isa),
        _ => None,
    }
}

pub(crate) struct DwPlan {
    mode: Mode,
    kern: &'static DwKernel,
    workers: usize,
    /// Units (Planes: `batch * c_out` planes; Channels: `batch` images; Blocked: `batch *
    /// ceil(c_out / 16)` blocks), each cut in `bands` bands of `band_rows` output rows.
    bands: usize,
    band_rows: usize,
    items: usize,
    /// Blocked: the padded input (`hp x wp`) and output (`oh x owp`) sizes of the scratch.
    padded: (usize, usize, usize),
    /// Blocked: scratch floats a worker needs (padded input pixels, output pixels of one
    /// block).
    scratch_per_worker: usize,
    /// 16-bit tensors through f32 kernels, scratch floats a worker needs besides: blocked,
    /// the f32 planes of one block's input where the output pixels cannot hold them (the f32
    /// output planes reuse the input pixels' space); planes and channels, a tile of
    /// `tile_rows` output rows and the input rows they read (`tile_in` floats, a whole
    /// number of cache lines).
    half_extra: usize,
    tile_rows: usize,
    tile_in: usize,
    /// Flat: output planes an item runs, and the kernel's offsets and masks.
    per_call: usize,
    flat: Option<FlatTable>,
}

impl DwPlan {
    pub(crate) fn workspace_floats(&self) -> usize {
        self.workers * self.scratch_per_worker
    }
}

impl Depthwise {
    /// Why the depthwise path cannot run `p`, if it cannot.
    pub(crate) fn rejects(p: &ConvParams) -> Option<String> {
        if p.groups != p.in_channels {
            return Some(format!(
                "not depthwise: groups {} != in_channels {}",
                p.groups, p.in_channels
            ));
        }
        if p.layout == Layout::Nhwc && p.out_channels != p.in_channels {
            return Some(format!(
                "NHWC depthwise needs channel multiplier 1, got {} -> {} channels",
                p.in_channels, p.out_channels
            ));
        }
        None
    }

    /// Packs the weights for `p`; `generic` forces the generic kernels, `forced` one kernel
    /// (of `isa`): an NHWC kernel forced on NCHW runs the blocked mode. `forced_half`: the
    /// kernel forced was a 16-bit one (`forced` is its f32 twin), which 16-bit runs take.
    pub(crate) fn new(
        p: &ConvParams,
        weights: &[f32],
        bias: Option<&[f32]>,
        isa: Isa,
        generic: bool,
        forced: Option<&'static DwKernel>,
        forced_half: bool,
    ) -> Result<Self> {
        let name = if generic {
            "depthwise_generic"
        } else {
            "depthwise"
        };
        if let Some(reason) = Self::rejects(p) {
            return Err(Error::AlgorithmUnsupported {
                algorithm: name,
                reason,
            });
        }
        let shape =
            (p.kernel[0] == p.kernel[1] && p.stride[0] == p.stride[1] && p.dilation == [1, 1])
                .then_some((p.kernel[0], p.stride[0]));
        let find = |layout: Layout, ymm: bool, shape: Option<(usize, usize)>| {
            cpu::dw_f32().iter().find(|k| {
                k.isa == isa && k.layout == layout && k.ymm == ymm && k.fixed == shape && !k.flat
            })
        };
        // The forced kernel where it has the layout and width asked for, else the unrolled
        // kernel of the shape, else the generic one.
        let pick = |layout: Layout, ymm: bool| {
            let forced = forced.filter(|k| k.layout == layout && k.ymm == ymm);
            let fixed = if generic {
                None
            } else {
                shape.and_then(|s| find(layout, ymm, Some(s)))
            };
            forced.or(fixed).or_else(|| find(layout, ymm, None))
        };
        if let Some(k) = forced {
            let layout_ok = k.layout == p.layout
                || (k.layout == Layout::Nhwc && p.out_channels == p.in_channels);
            if !layout_ok || k.fixed.is_some_and(|f| Some(f) != shape) || (k.flat && !flat_fits(p))
            {
                return Err(Error::AlgorithmUnsupported {
                    algorithm: name,
                    reason: format!(
                        "kernel {} does not take {:?} kernel {:?} stride {:?} dilation {:?} with {} -> {} channels",
                        k.name, p.layout, p.kernel, p.stride, p.dilation, p.in_channels, p.out_channels
                    ),
                });
            }
        }
        let forced_mode = forced.map(|k| match (k.layout, p.layout) {
            (Layout::Nchw, _) if k.flat => Mode::Flat,
            (Layout::Nchw, _) => Mode::Planes,
            (Layout::Nhwc, Layout::Nchw) => Mode::Blocked,
            (Layout::Nhwc, Layout::Nhwc) => Mode::Channels,
        });
        let find_flat = |ymm: bool| {
            cpu::dw_f32()
                .iter()
                .find(|k| k.isa == isa && k.flat && k.ymm == ymm)
        };
        let missing = || Error::AlgorithmUnsupported {
            algorithm: name,
            reason: format!("no depthwise kernel generated for {isa}"),
        };
        let taps = p.kernel[0] * p.kernel[1];
        let c = p.out_channels;
        let bias_or_zero = || bias.map_or_else(|| vec![0.0; c], <[f32]>::to_vec);
        let planes = match p.layout {
            Layout::Nchw => Some((
                // A forced 8-lane kernel runs at every width.
                match forced {
                    Some(k) if k.layout == Layout::Nchw && !k.flat => k,
                    _ => pick(Layout::Nchw, false).ok_or_else(missing)?,
                },
                weights.to_vec(),
                bias_or_zero(),
            )),
            Layout::Nhwc => None,
        };
        let channels = if p.out_channels == p.in_channels {
            let cp = c.div_ceil(BLOCK) * BLOCK;
            let mut w = vec![0.0; taps * cp];
            for ch in 0..c {
                for t in 0..taps {
                    w[t * cp + ch] = weights[ch * taps + t];
                }
            }
            let mut b = bias_or_zero();
            b.resize(cp, 0.0);
            Some(ChannelWeights {
                kern: pick(Layout::Nhwc, false).ok_or_else(missing)?,
                weights: w,
                bias: b,
                wstride: cp,
            })
        } else {
            None
        };
        Ok(Depthwise {
            planes,
            narrow: match (p.layout, forced) {
                (Layout::Nchw, None) => pick(Layout::Nchw, true),
                _ => None,
            },
            channels,
            flat: match forced {
                Some(k) if k.flat => Some(k),
                Some(_) => None,
                None if generic || !flat_fits(p) => None,
                None => find_flat(false),
            },
            flat_narrow: match forced {
                None if !generic && flat_fits(p) => find_flat(true),
                _ => None,
            },
            multiplier: p.out_channels / p.in_channels,
            transpose: BlockTranspose {
                rows8: cpu::transpose_rows_8x8(isa),
                masked16: cpu::transpose_masked_16(isa),
            },
            forced_mode,
            isa,
            forced_half,
        })
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> DwPlan {
        let forced = self.forced_mode;
        let t = threads.max(1);
        // Flat items: a run of planes (of one input plane, with a channel multiplier).
        let per_call = match self.multiplier {
            1 => (g.batch * g.c_out).div_ceil(4 * t).clamp(2, FLAT_PLANES),
            m => m,
        };
        let flat = match forced {
            Some(m) => self.flat.filter(|_| matches!(m, Mode::Flat)),
            None => self
                .flat
                .filter(|_| {
                    let unrolled = self.planes.as_ref().and_then(|(k, ..)| k.fixed);
                    flat_wins(g, self.isa, unrolled)
                })
                .map(|k| match self.flat_narrow {
                    Some(n) if g.oh * g.ow <= FLAT_NARROW_MAX => n,
                    _ => k,
                }),
        };
        let (mode, kern, units) = match (flat, &self.planes, &self.channels) {
            (Some(k), ..) => (Mode::Flat, k, g.batch * g.c_out.div_ceil(per_call)),
            (None, None, Some(c)) => (Mode::Channels, c.kern, g.batch),
            (None, Some(_), Some(c))
                if forced.map_or_else(
                    || blocked_wins(g, c.kern) && blocked_scratch(g, c.kern) <= BLOCKED_SCRATCH_MAX,
                    |m| matches!(m, Mode::Blocked),
                ) =>
            {
                (Mode::Blocked, c.kern, g.batch * g.c_out.div_ceil(BLOCK))
            }
            (None, Some((k, ..)), _) => {
                let k = match self.narrow {
                    Some(n) if g.ow <= n.lanes => n,
                    _ => k,
                };
                (Mode::Planes, k, g.batch * g.c_out)
            }
            (None, None, None) => {
                unreachable!("every depthwise convolution has planes or channels")
            }
        };
        // Enough items that the workers finish together; bands of whole register blocks.
        // Blocked items are whole blocks: the transposes go plane by plane.
        let bands = match mode {
            Mode::Blocked | Mode::Flat => 1,
            _ if t == 1 => 1,
            _ => (4 * t).div_ceil(units).clamp(1, g.oh),
        };
        let band_rows = g.oh.div_ceil(bands).next_multiple_of(4).min(g.oh);
        let bands = g.oh.div_ceil(band_rows);
        let items = units * bands;
        let (hp, wp, owp) = blocked_sizes(g, kern);
        // 16-bit tensors through the f32 kernels: tiles of rows converted in L1.
        let (per_in_row, per_out_row) = match mode {
            Mode::Planes => (g.w, g.ow),
            _ => (g.w * g.c_in, g.ow * g.c_out),
        };
        let mut tile_rows = (TILE_FLOATS / (per_in_row * g.sh + per_out_row).max(1)).clamp(1, g.oh);
        if tile_rows > kern.block && matches!(mode, Mode::Planes) {
            tile_rows = tile_rows / kern.block * kern.block;
        }
        let span = (g.kh - 1) * g.dh + 1;
        let tile_in = (((tile_rows - 1) * g.sh + span).min(g.h) * per_in_row).next_multiple_of(16);
        DwPlan {
            mode,
            kern,
            workers: t.min(items),
            bands,
            band_rows,
            items,
            padded: (hp, wp, owp),
            scratch_per_worker: match mode {
                Mode::Blocked => blocked_scratch(g, kern),
                _ => 0,
            },
            half_extra: match mode {
                // Widened input planes that the output pixels' space cannot hold.
                Mode::Blocked if g.oh * owp >= g.h * g.w => 0,
                Mode::Blocked => BLOCK * g.h * g.w,
                // A call's input and output planes, converted.
                Mode::Flat => per_call * (g.h * g.w + g.oh * g.ow),
                _ => tile_in + tile_rows * per_out_row,
            },
            tile_rows,
            tile_in,
            per_call,
            flat: flat.map(|k| FlatTable::new(g, k.lanes, k.block)),
        }
    }

    /// The kernel that runs; blocked NCHW names the transpose around the channel kernel.
    pub(crate) fn kernel_name(plan: &DwPlan) -> String {
        match plan.mode {
            Mode::Blocked => format!("transpose{BLOCK}+{}", plan.kern.name),
            _ => plan.kern.name.to_string(),
        }
    }

    /// Runs a planned convolution. Slice lengths were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &DwPlan,
        g: &Geometry,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
        activation: Activation,
        scratch: &mut [f32],
    ) {
        let scratch = &mut scratch[..plan.workspace_floats()];
        self.run_typed(
            plan, plan.kern, g, input, residual, output, activation, scratch,
        );
    }

    /// The 16-bit kernel twin of `plan`'s f32 kernel (same shape, or both generic) for
    /// tensors of type `t`, if this build and CPU have one: plane and channel modes only (the
    /// blocked mode converts in its transposes).
    fn half_kernel(&self, plan: &DwPlan, t: StorageType) -> Option<&'static DwKernel> {
        if matches!(plan.mode, Mode::Blocked | Mode::Flat) {
            return None;
        }
        let isa = half_isa(self.isa)?;
        let k = plan.kern;
        let mine = |h: &&DwKernel| h.isa == isa && h.storage == t && h.layout == k.layout;
        let half = cpu::dw_half();
        // No generic 16-bit kernel in place of a fixed-shape f32 one: the f32 kernel on
        // converted tiles is 3-5x faster (7x7 on 28x28 at AVX-512: 14 GFLOP/s generic).
        half.iter().filter(mine).find(|h| h.fixed == k.fixed)
    }

    /// `Some(scratch floats)` when this plan reads `i` and writes `o` itself: a 16-bit kernel
    /// (`i == o`, an activation the kernel applies in registers), or the blocked mode, whose
    /// transposes convert (any types); `None`: the caller converts.
    pub(crate) fn half_workspace_floats(
        &self,
        plan: &DwPlan,
        i: StorageType,
        o: StorageType,
        activation: Activation,
    ) -> Option<usize> {
        match self.half_choice(plan, i, o, activation) {
            Some(_) => Some(0),
            None => Some(plan.workers * (plan.scratch_per_worker + plan.half_extra)),
        }
    }

    /// The 16-bit kernel that runs `i` -> `o` tensors, or `None` where the f32 kernel runs on
    /// converted tiles (or blocks): a 16-bit kernel needs `i == o`, an activation it applies
    /// in registers, and `forced_half` or [`PREFER_HALF_KERNELS`].
    fn half_choice(
        &self,
        plan: &DwPlan,
        i: StorageType,
        o: StorageType,
        activation: Activation,
    ) -> Option<&'static DwKernel> {
        if i != o || activation.needs_pass() || !(self.forced_half || PREFER_HALF_KERNELS) {
            return None;
        }
        self.half_kernel(plan, i)
    }

    /// The kernel (and conversions) `run_half` runs.
    pub(crate) fn half_kernel_name(
        &self,
        plan: &DwPlan,
        i: StorageType,
        o: StorageType,
        activation: Activation,
    ) -> String {
        match self.half_choice(plan, i, o, activation) {
            Some(k) => k.name.to_string(),
            None => format!("convert+{}", Self::kernel_name(plan)),
        }
    }

    /// Runs a planned convolution on tensors of types `I` and `O`, where
    /// `half_workspace_floats` says it can. Slice lengths were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_half<I: Storage, O: Storage>(
        &self,
        plan: &DwPlan,
        g: &Geometry,
        input: &[I],
        residual: Option<&[O]>,
        output: &mut [O],
        activation: Activation,
        scratch: &mut [f32],
    ) {
        let floats = self
            .half_workspace_floats(plan, I::TYPE, O::TYPE, activation)
            .expect("run_half runs only what half_workspace_floats takes");
        let kern = self
            .half_choice(plan, I::TYPE, O::TYPE, activation)
            .unwrap_or(plan.kern);
        self.run_typed(
            plan,
            kern,
            g,
            input,
            residual,
            output,
            activation,
            &mut scratch[..floats],
        );
    }

    /// Runs `kern` (of `I` tensors, or f32 ones in the blocked mode) over `plan`'s items.
    #[allow(clippy::too_many_arguments)]
    fn run_typed<I: Storage, O: Storage>(
        &self,
        plan: &DwPlan,
        kern: &'static DwKernel,
        g: &Geometry,
        input: &[I],
        residual: Option<&[O]>,
        output: &mut [O],
        activation: Activation,
        scratch: &mut [f32],
    ) {
        let (min, max) = activation.clamp_bounds();
        let out = SendPtr(output.as_mut_ptr() as *mut f32);
        // Element `off` of the output (or the residual), as the kernels take it.
        let out_at = |off: usize| (out.get() as *mut O).wrapping_add(off) as *mut f32;
        let res_at = |off: usize| match residual {
            Some(r) => r.as_ptr().wrapping_add(off) as *const f32,
            None => std::ptr::null(),
        };
        let args = |input: *const f32, output: *mut f32, residual: *const f32| DwArgs {
            input,
            output,
            residual,
            weights: std::ptr::null(),
            bias: std::ptr::null(),
            in_h: g.h,
            in_w: g.w,
            ow: g.ow,
            channels: g.c_out,
            wstride: 0,
            oy0: 0,
            oy1: g.oh,
            pad_top: g.pad_top,
            pad_left: g.pad_left,
            kh: g.kh,
            kw: g.kw,
            sh: g.sh,
            sw: g.sw,
            dh: g.dh,
            dw: g.dw,
            min,
            max,
            planes: 0,
            in_step: 0,
            offsets: std::ptr::null(),
            masks: std::ptr::null(),
            vectors: 0,
        };
        let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
        // 16-bit tensors, f32 kernel: tiles of rows converted in the worker's scratch.
        let tiled = kern.storage == StorageType::F32
            && (I::TYPE != StorageType::F32 || O::TYPE != StorageType::F32);
        let has_res = residual.is_some();
        // Runs the f32 kernel `a` (at output row 0 of its tile) on output rows `oy0..oy1` of
        // a unit whose input is `x` (`per_in` floats a row) and output starts at `o`
        // (`per_out` floats a row), a tile of rows at a time, converting on the way in and out.
        let run_tiles = |s: &mut [f32],
                         a: DwArgs,
                         x: &[I],
                         per_in: usize,
                         per_out: usize,
                         o: usize,
                         oy0: usize,
                         oy1: usize| {
            let (tin, tout) = s.split_at_mut(plan.tile_in);
            let span = ((g.kh - 1) * g.dh + 1) as isize;
            let mut y0 = oy0;
            while y0 < oy1 {
                let y1 = (y0 + plan.tile_rows).min(oy1);
                let start = (y0 * g.sh) as isize - g.pad_top as isize;
                let end = ((y1 - 1) * g.sh) as isize + span - g.pad_top as isize;
                let lo = start.clamp(0, g.h as isize);
                let hi = end.clamp(lo, g.h as isize);
                let (lo, hi) = (lo as usize, hi as usize);
                widen(&x[lo * per_in..hi * per_in], &mut tin[..(hi - lo) * per_in]);
                let len = (y1 - y0) * per_out;
                let y = &mut tout[..len];
                let t = DwArgs {
                    input: tin.as_ptr(),
                    output: y.as_mut_ptr(),
                    residual: std::ptr::null(),
                    in_h: hi - lo,
                    pad_top: if hi > lo {
                        (lo as isize - start) as usize
                    } else {
                        0
                    },
                    oy0: 0,
                    oy1: y1 - y0,
                    // With a residual the clamp waits until it is added.
                    min: if has_res { f32::NEG_INFINITY } else { min },
                    max: if has_res { f32::INFINITY } else { max },
                    ..a
                };
                // SAFETY: the f32 kernel of the plan (its ISA checked at create), on the
                // tile's rows `lo..hi` of the unit's input (converted above, `in_h` of them)
                // and `y1 - y0` output rows of the scratch.
                unsafe { (kern.func)(&t) };
                let at = o + y0 * per_out;
                // SAFETY: this item's output rows, inside the output (length checked), written
                // by no other item.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut((out.get() as *mut O).add(at), len) };
                finish(
                    y,
                    residual.map(|r| &r[at..at + len]),
                    dst,
                    min,
                    max,
                    activation,
                );
                y0 = y1;
            }
        };
        for_each_worker(plan.workers, plan.items, scratch, |s, item| {
            let unit = item / plan.bands;
            let oy0 = item % plan.bands * plan.band_rows;
            let oy1 = (oy0 + plan.band_rows).min(g.oh);
            // f32 outputs this item writes: its activation pass runs over them.
            let written = match plan.mode {
                Mode::Planes => {
                    let (n, oc) = (unit / g.c_out, unit % g.c_out);
                    let Some((_, weights, bias)) = &self.planes else {
                        unreachable!("plane mode has plane weights")
                    };
                    let taps = g.kh * g.kw;
                    let o = unit * ohw;
                    if tiled {
                        let first = (n * g.c_in + oc / self.multiplier) * hw;
                        let a = DwArgs {
                            weights: weights[oc * taps..].as_ptr(),
                            bias: &bias[oc],
                            ..args(std::ptr::null(), std::ptr::null_mut(), std::ptr::null())
                        };
                        run_tiles(s, a, &input[first..first + hw], g.w, g.ow, o, oy0, oy1);
                        return;
                    }
                    let a = DwArgs {
                        weights: weights[oc * taps..].as_ptr(),
                        bias: &bias[oc],
                        oy0,
                        oy1,
                        ..args(
                            input[(n * g.c_in + oc / self.multiplier) * hw..].as_ptr()
                                as *const f32,
                            out_at(o),
                            res_at(o),
                        )
                    };
                    // SAFETY: the kernel's ISA was checked when the weights were packed (a
                    // 16-bit kernel's by `half_isa`) and it reads and writes `I` = `O`
                    // elements (`half_kernel`); the input, output and residual hold the
                    // geometry's tensors (lengths checked) and the weights and bias were
                    // packed for it; items write disjoint rows.
                    unsafe { (kern.func)(&a) };
                    o + oy0 * g.ow..o + oy1 * g.ow
                }
                Mode::Channels => {
                    let cw = self.channel_weights();
                    let row = g.ow * g.c_out;
                    let o = unit * g.oh * row;
                    if tiled {
                        let first = unit * hw * g.c_in;
                        let a = DwArgs {
                            weights: cw.weights.as_ptr(),
                            bias: cw.bias.as_ptr(),
                            wstride: cw.wstride,
                            ..args(std::ptr::null(), std::ptr::null_mut(), std::ptr::null())
                        };
                        let x = &input[first..first + hw * g.c_in];
                        run_tiles(s, a, x, g.w * g.c_in, row, o, oy0, oy1);
                        return;
                    }
                    let a = DwArgs {
                        weights: cw.weights.as_ptr(),
                        bias: cw.bias.as_ptr(),
                        wstride: cw.wstride,
                        oy0,
                        oy1,
                        ..args(
                            input[unit * hw * g.c_in..].as_ptr() as *const f32,
                            out_at(o),
                            res_at(o),
                        )
                    };
                    // SAFETY: as above.
                    unsafe { (kern.func)(&a) };
                    o + oy0 * row..o + oy1 * row
                }
                Mode::Flat => {
                    let (Some((_, weights, bias)), Some(table)) = (&self.planes, &plan.flat) else {
                        unreachable!("flat plans have plane weights and a table")
                    };
                    let chunks = g.c_out.div_ceil(plan.per_call);
                    let (n, oc) = (unit / chunks, unit % chunks * plan.per_call);
                    let planes = plan.per_call.min(g.c_out - oc);
                    // With a channel multiplier an item's planes read one input plane.
                    let in_step = if self.multiplier == 1 { hw } else { 0 };
                    let first = (n * g.c_in + oc / self.multiplier) * hw;
                    let ins = if in_step == 0 { hw } else { planes * hw };
                    let (o, outs) = ((n * g.c_out + oc) * ohw, planes * ohw);
                    let a = DwArgs {
                        weights: weights[oc * g.kh * g.kw..].as_ptr(),
                        bias: bias[oc..].as_ptr(),
                        planes,
                        in_step,
                        offsets: table.offsets.as_ptr(),
                        masks: table.masks.as_ptr(),
                        vectors: table.vectors,
                        ..args(std::ptr::null(), std::ptr::null_mut(), std::ptr::null())
                    };
                    if tiled {
                        let (tin, rest) = s.split_at_mut(ins);
                        let y = &mut rest[..outs];
                        widen(&input[first..first + ins], tin);
                        let t = DwArgs {
                            input: tin.as_ptr(),
                            output: y.as_mut_ptr(),
                            // With a residual the clamp waits until it is added.
                            min: if has_res { f32::NEG_INFINITY } else { min },
                            max: if has_res { f32::INFINITY } else { max },
                            ..a
                        };
                        // SAFETY: as below, on the item's planes converted into the worker's
                        // scratch (`ins` input and `outs` output floats).
                        unsafe { (kern.func)(&t) };
                        // SAFETY: this item's planes, inside the output (length checked),
                        // written by no other item.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut((out.get() as *mut O).add(o), outs)
                        };
                        finish(
                            y,
                            residual.map(|r| &r[o..o + outs]),
                            dst,
                            min,
                            max,
                            activation,
                        );
                        return;
                    }
                    let a = DwArgs {
                        input: input[first..first + ins].as_ptr() as *const f32,
                        output: out_at(o),
                        residual: res_at(o),
                        ..a
                    };
                    // SAFETY: the f32 flat kernel (ISA checked at create; `tiled` is false, so
                    // `I` and `O` are f32) on `planes` whole planes: the table was built for
                    // this geometry (stride 1, `ow == w`: tap `t` of output `o` is input `o +
                    // offsets[t]`) and masks every lane whose input lies outside its plane,
                    // so only the `ins` input floats are read; it writes the item's `outs`
                    // output floats, which no other item writes.
                    unsafe { (kern.func)(&a) };
                    o..o + outs
                }
                Mode::Blocked => {
                    let cw = self.channel_weights();
                    let blocks = g.c_out.div_ceil(BLOCK);
                    let (n, c0) = (unit / blocks, unit % blocks * BLOCK);
                    let cb = BLOCK.min(g.c_out - c0);
                    let (hp, wp, owp) = plan.padded;
                    let (pix_in, rest) = s.split_at_mut(BLOCK * hp * wp);
                    let (pix_out, extra) = rest.split_at_mut(BLOCK * g.oh * owp);
                    let first = (n * g.c_out + c0) * hw;
                    let src = &input[first..first + cb * hw];
                    let src: &[f32] = if I::TYPE == StorageType::F32 {
                        bytemuck::cast_slice(src)
                    } else {
                        // The widened planes go where the output pixels will (unused until
                        // the kernel runs), or past them where those are fewer.
                        let planes = if pix_out.len() >= cb * hw {
                            &mut pix_out[..cb * hw]
                        } else {
                            &mut extra[..cb * hw]
                        };
                        widen(src, planes);
                        planes
                    };
                    to_pixels(self.transpose, src, g, wp, cb, &mut pix_in[..cb * hp * wp]);
                    let o = (n * g.c_out + c0) * ohw;
                    let has_res = residual.is_some();
                    let a = DwArgs {
                        weights: cw.weights[c0..].as_ptr(),
                        bias: cw.bias[c0..].as_ptr(),
                        wstride: cw.wstride,
                        channels: cb,
                        in_h: hp,
                        in_w: wp,
                        ow: owp,
                        pad_top: 0,
                        pad_left: 0,
                        // With a residual the clamp waits until it is added, on the way back.
                        min: if has_res { f32::NEG_INFINITY } else { min },
                        max: if has_res { f32::INFINITY } else { max },
                        ..args(pix_in.as_ptr(), pix_out.as_mut_ptr(), std::ptr::null())
                    };
                    // SAFETY: as above; `kern` is the f32 channel kernel, reading and writing
                    // the worker's own scratch, which holds one block's padded input and
                    // output pixels.
                    unsafe { (kern.func)(&a) };
                    // SAFETY: this block's planes, inside the output (length checked), written
                    // by no other item.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut((out.get() as *mut O).add(o), cb * ohw)
                    };
                    let res = residual.map(|r| &r[o..o + cb * ohw]);
                    if O::TYPE == StorageType::F32 {
                        let dst: &mut [f32] = bytemuck::cast_slice_mut(dst);
                        let res: Option<&[f32]> = res.map(bytemuck::cast_slice);
                        to_planes(
                            self.transpose,
                            &pix_out[..cb * g.oh * owp],
                            g,
                            owp,
                            cb,
                            dst,
                            res,
                            min,
                            max,
                        );
                        o..o + cb * ohw
                    } else {
                        // Residual, clamp and activation in f32, then one rounding; the f32
                        // planes go where the input pixels were (no longer needed).
                        let y = &mut pix_in[..cb * ohw];
                        let pix = &pix_out[..cb * g.oh * owp];
                        to_planes(self.transpose, pix, g, owp, cb, y, None, min, max);
                        if let Some(r) = res {
                            for (v, r) in y.iter_mut().zip(r) {
                                *v = (*v + r.to_f32()).max(min).min(max);
                            }
                        }
                        if activation.needs_pass() {
                            activation.apply_slice(y);
                        }
                        narrow(y, dst);
                        o..o
                    }
                }
            };
            if activation.needs_pass() && !written.is_empty() {
                assert!(
                    O::TYPE == StorageType::F32,
                    "16-bit kernels apply clamps only"
                );
                // SAFETY: this item's outputs, inside the output (checked length), written by
                // no other item; `O` is f32.
                let rows = unsafe {
                    std::slice::from_raw_parts_mut(out.get().add(written.start), written.len())
                };
                activation.apply_slice(rows);
            }
        });
    }

    fn channel_weights(&self) -> &ChannelWeights {
        self.channels
            .as_ref()
            .expect("channel modes are planned only with channel weights")
    }
}

/// Floats of a 16-bit tile (input rows and output rows, converted): within L1.
const TILE_FLOATS: usize = 6 * 1024;

/// Whether 16-bit tensors run the generated 16-bit kernels (widening on every load) rather
/// than the f32 kernels on tiles converted in L1 (each element widened once, but a pass more
/// through L1). Measured with `convkit bench --dtype f16` (one thread, AMD EPYC Zen 4 with
/// AVX-512, a shared and noisy machine, three interleaved rounds, GFLOP/s f32 / tiles /
/// 16-bit kernel): mobilenetv2_dw3x3_112 31-39 / 23-33 / 35-36; dw3x3_28 21-22 / 18-21 /
/// 20-24. For 5x5 and 7x7 (three interleaved rounds, 16-bit kernel / tiles, as fractions of
/// f32, f16 then bf16): convnext_t_dw7x7_56 0.91 / 0.90 and 0.86 / 0.85, dw7x7_28 0.86 /
/// 0.89 and 0.84 / 0.82, dw7x7_14 0.87 / 0.79 and 0.85 / 0.75, efficientnet_dw5x5_28 0.87 /
/// 0.72 and 0.79 / 0.76: the tiles' two extra passes through L1 cost more than widening on
/// every load. The tiles serve what the 16-bit kernels do not take (f16 in, f32 out; SiLU and
/// the other activations that run as a pass; NCHW at AVX2, which has no such kernels (see
/// codegen's `dw_half`); NEON).
const PREFER_HALF_KERNELS: bool = true;

/// The f32 outputs `y` of a tile into `dst`: the residual added and the clamp applied (the
/// kernel left both to here when there is a residual), the other activations, one rounding.
fn finish<O: Storage>(
    y: &mut [f32],
    residual: Option<&[O]>,
    dst: &mut [O],
    min: f32,
    max: f32,
    activation: Activation,
) {
    if let Some(r) = residual {
        for (v, r) in y.iter_mut().zip(r) {
            *v = (*v + r.to_f32()).max(min).min(max);
        }
    }
    if activation.needs_pass() {
        activation.apply_slice(y);
    }
    narrow(y, dst);
}

/// Output planes a flat item runs at most (fewer where the workers need more items).
const FLAT_PLANES: usize = 16;

/// Planes of more outputs than this (32x32) keep the other modes: measured up to 28x28, and
/// the mask table (a mask per vector and tap) grows with the plane.
const FLAT_OUTPUTS_MAX: usize = 1024;

/// Planes of at most this many outputs run the 8-lane flat kernel at AVX-512: a 4x4 plane
/// is one 16-lane vector of the four a block computes, two of 8 lanes (3x3 on 4x4, two
/// rounds: 18-19 GFLOP/s against 12 through the 16-lane kernel and 17 through the blocked
/// mode; on 7x7 to 28x28 planes the two widths were within 0.87-1.16x of each other).
const FLAT_NARROW_MAX: usize = 32;

/// Whether the flat kernel beats the plane and blocked modes on `g` (which it takes), from
/// `convkit bench` with the kernels forced (one thread, AMD EPYC Zen 4, two rounds, GFLOP/s
/// flat vs the mode chosen before; layers of the suite and made-up ones with "same" padding).
/// Every tap of a flat kernel is a masked load at an offset no row structure aligns, so on
/// planes wide enough for the plane kernels' rows it loses (AVX-512: 3x3 on 28x28 32-42 vs
/// 51-52, 5x5 on 28x28 46-48 vs 72, 7x7 on 14x14 and 7x7 40-46 and 39-40 vs 72-75 and 52-55;
/// 3x3 on 14x14 33-35 vs 25-41, a tie). It wins where rows are shorter than a vector (3x3:
/// on 7x7 31-33 vs 21-23, on 8x8 44 vs 19-24, AVX2 26 vs 12-13 and 33 vs 18-23; 5x5 on 7x7,
/// AVX-512 34-38 vs 24-35, AVX2 31 vs 18-24), and on the shapes without an unrolled kernel,
/// which went through the blocked mode's transposes (3x3 dilation 2 on 28x28 and 14x14:
/// AVX-512 34-40 vs 14-18, AVX2 21-29 vs 12-19; 9x9 on 28x28 45-52 vs 40-49, on 7x7 41 vs
/// 37-47, but AVX2 34 vs 43-45).
/// `unrolled`: the (kernel, stride) of the plane kernel the layer has, if it has an unrolled
/// one.
fn flat_wins(g: &Geometry, isa: Isa, unrolled: Option<(usize, usize)>) -> bool {
    if g.oh * g.ow > FLAT_OUTPUTS_MAX {
        return false;
    }
    match unrolled {
        Some((k, _)) => k <= 5 && g.ow <= 8,
        None => isa == Isa::Avx512 || g.kh * g.kw <= 25,
    }
}

/// The most scratch floats a worker of the blocked mode may take (4 MiB) before the choice
/// falls back to the plane kernels: the workspace stays bounded whatever the image size.
const BLOCKED_SCRATCH_MAX: usize = 1 << 20;

/// The blocked mode's padded input (`hp x wp`) and output (`oh x owp`) sizes in pixels. The
/// scratch input carries the padding (the transpose writes it at no extra cost) and the
/// scratch output rows are whole register blocks, so every block of the channel kernel runs
/// its unchecked loop.
fn blocked_sizes(g: &Geometry, kern: &DwKernel) -> (usize, usize, usize) {
    let owp = g.ow.next_multiple_of(kern.block);
    let hp = g.pad_top + g.h + g.pad_bottom;
    let wp = (g.pad_left + g.w + g.pad_right).max((owp - 1) * g.sw + (g.kw - 1) * g.dw + 1);
    (hp, wp, owp)
}

/// Scratch floats a worker of the blocked mode needs.
fn blocked_scratch(g: &Geometry, kern: &DwKernel) -> usize {
    let (hp, wp, owp) = blocked_sizes(g, kern);
    BLOCK.saturating_mul(
        hp.saturating_mul(wp)
            .saturating_add(g.oh.saturating_mul(owp)),
    )
}

/// The rule between the NCHW modes, from `convkit bench` on the suite's depthwise layers (one
/// thread, AMD EPYC Zen 4, three to five interleaved rounds, GFLOP/s planes vs blocked): since
/// the plane kernels keep one tap column's weights in registers (8 output rows at AVX-512, 6
/// at AVX2), planes win at every size for 5x5 and 7x7 (AVX-512: 7x7 on 56x56 85 vs 72, on
/// 14x14 64 vs 51, on 7x7 49 vs 41 through the 8-lane kernel; 5x5 on 28x28 60 vs 45; AVX2:
/// 7x7 on 56x56 69 vs 41, on 28x28 46 vs 50, on 7x7 34 vs 30; 5x5 53 vs 34), and 3x3
/// everywhere but on images at most 8 wide (7x7: 16 vs 17 at AVX-512, 11 vs 12 at AVX2;
/// 28x28: 40 vs 26). Measured again with the row-pointer transposes (3x3, AVX-512, three
/// rounds, ms planes vs blocked): 14x14 0.051-0.082 vs 0.087-0.137, 28x28 0.053-0.059 vs
/// 0.106-0.161, 10x10 a tie (0.045-0.073 vs 0.047-0.052).
///
/// On Intel Sapphire/Emerald Rapids (2026-12-06, five interleaved rounds, medians, GFLOP/s
/// planes vs blocked; flat-kernel shapes aside) blocked wins at every kernel size once the
/// output is at most 8 wide: AVX-512 7x7 on 7x7 46 vs 58, on 8x8 32 vs 37, 7x7 stride 2 on
/// 14x14 13.5 vs 19.6, 5x5 stride 2 on 14x14 9.6 vs 12.3; 5x5 on 10x10 a tie (20.2 vs 20.3);
/// AVX2 28 vs 33, 19 vs 23, 6.8 vs 14.5, 5.7 vs 10.4, 13 vs 16 (the 10-wide 5x5 is the one
/// case past 8 wide, for the boundary). Zen 4 showed the opposite on 7x7 (49 vs 41 above; its
/// strided cases were not measured). So images at most 8 wide go blocked for every kernel,
/// wider ones by the Zen 4 rule.
fn blocked_wins(g: &Geometry, channel_kernel: &DwKernel) -> bool {
    match channel_kernel.fixed {
        Some(_) => g.ow <= 8,
        // The generic kernels, planes vs blocked: 4x4 on 56x56 10-11 vs 24-31; 9x9 on 28x28
        // 16 vs 41-46; 3x3 dilation 2 on 28x28 13 vs 16; 3x3 stride 3 on 56x56 1.9 vs 6.
        None => true,
    }
}

/// `cb` planes of the input (`src`) into pixels of `cb` channels (`dst`: rows `wp` pixels
/// wide, the padding of `g` around the image zeroed), through `t`.
fn to_pixels(t: BlockTranspose, src: &[f32], g: &Geometry, wp: usize, cb: usize, dst: &mut [f32]) {
    let (w, hw) = (g.w, g.h * g.w);
    let hp = dst.len() / (wp * cb);
    // Only the padding needs zeros: the image's pixels are all written below.
    for y in 0..hp {
        let row = &mut dst[y * wp * cb..(y + 1) * wp * cb];
        if y < g.pad_top || y >= g.pad_top + g.h {
            row.fill(0.0);
        } else {
            row[..g.pad_left * cb].fill(0.0);
            row[(g.pad_left + w) * cb..].fill(0.0);
        }
    }
    let grid = PixelGrid {
        w,
        stride: wp,
        origin: g.pad_top * wp + g.pad_left,
    };
    t.run(src, hw, cb, grid, dst, Direction::ToPixels);
}

/// Pixels of `cb` channels (`src`, rows `owp` pixels wide) back into `cb` output planes
/// (`dst`), through `t`, then the residual (shaped like `dst`) added and
/// the clamp applied when there is one.
#[allow(clippy::too_many_arguments)]
fn to_planes(
    t: BlockTranspose,
    src: &[f32],
    g: &Geometry,
    owp: usize,
    cb: usize,
    dst: &mut [f32],
    residual: Option<&[f32]>,
    min: f32,
    max: f32,
) {
    let grid = PixelGrid {
        w: g.ow,
        stride: owp,
        origin: 0,
    };
    t.run(src, g.oh * g.ow, cb, grid, dst, Direction::ToPlanes);
    if let Some(r) = residual {
        for (v, &r) in dst.iter_mut().zip(r) {
            *v = (*v + r).max(min).min(max);
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Direction {
    ToPixels,
    ToPlanes,
}

impl Direction {
    /// The lengths of the planes and of the pixels among a move's `src` and `dst`.
    fn planes_and_pixels(self, src: &[f32], dst: &[f32]) -> (usize, usize) {
        match self {
            Direction::ToPixels => (src.len(), dst.len()),
            Direction::ToPlanes => (dst.len(), src.len()),
        }
    }
}

/// Where an image's pixels lie in a buffer of `cb`-channel pixels: pixel (y, x) of a `w`-wide
/// image at pixel `origin + y·stride + x` of the buffer.
#[derive(Clone, Copy)]
struct PixelGrid {
    w: usize,
    stride: usize,
    origin: usize,
}

/// The blocked mode's transposes: the masked 16x16 one a row of pixels at a time where the
/// ISA has it, else 8x8 blocks over row pointers.
#[derive(Clone, Copy)]
struct BlockTranspose {
    rows8: TransposeRows8x8,
    masked16: Option<TransposeMasked16>,
}

impl BlockTranspose {
    /// Moves `cb` planes of `n` pixels (plane-major) to or from pixels of `cb` channels laid
    /// out as `grid` says (`src` to `dst` in the direction `dir`).
    fn run(
        self,
        src: &[f32],
        n: usize,
        cb: usize,
        grid: PixelGrid,
        dst: &mut [f32],
        dir: Direction,
    ) {
        let Some(t) = self.masked16 else {
            return blocks(self.rows8, src, n, cb, grid, dst, dir);
        };
        let (planes_len, pixels_len) = dir.planes_and_pixels(src, dst);
        let (w, h) = (grid.w, n / grid.w.max(1));
        assert!(
            w * h == n
                && planes_len >= cb * n
                && (n == 0 || (grid.origin + (h - 1) * grid.stride + w) * cb <= pixels_len)
        );
        let (src_ptr, dst_ptr) = (src.as_ptr(), dst.as_mut_ptr());
        // A call moves up to 16 pixels of an image row by up to 16 channels: no pointer per
        // row, no remainder outside the kernel.
        for y in 0..h {
            for x0 in (0..w).step_by(16) {
                let nx = 16.min(w - x0);
                let (plane, pixel) = (y * w + x0, (grid.origin + y * grid.stride + x0) * cb);
                for c0 in (0..cb).step_by(16) {
                    let nc = 16.min(cb - c0);
                    let (planes, pixels) = (plane + c0 * n, pixel + c0);
                    // SAFETY: planes `c0..c0+nc` hold this row's pixels `x0..x0+nx` (`n`
                    // floats apart; planes length asserted) and the row's pixels lie `cb`
                    // floats apart below the last pixel's end (asserted), `nc` channels from
                    // `c0` each; the kernel reads and writes only those; `src` and `dst` are
                    // distinct slices; the ISA is this CPU's (chosen at create).
                    unsafe {
                        match dir {
                            Direction::ToPixels => {
                                t(src_ptr.add(planes), n, dst_ptr.add(pixels), cb, nc, nx)
                            }
                            Direction::ToPlanes => {
                                t(src_ptr.add(pixels), cb, dst_ptr.add(planes), n, nx, nc)
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Moves `cb` planes of `n` pixels (plane-major, `planes`) to or from pixels of `cb` channels
/// laid out as `grid` says. 8x8 blocks go through the transpose kernel with each pixel's row
/// addressed on its own (8 pixels may wrap onto the next image row: a 7-wide image has no 8
/// contiguous ones); the ragged rest element by element.
fn blocks(
    t: TransposeRows8x8,
    src: &[f32],
    n: usize,
    cb: usize,
    grid: PixelGrid,
    dst: &mut [f32],
    dir: Direction,
) {
    let at = |p: usize| (grid.origin + p / grid.w * grid.stride + p % grid.w) * cb;
    let (planes_len, pixels_len) = dir.planes_and_pixels(src, dst);
    assert!(planes_len >= cb * n && (n == 0 || at(n - 1) + cb <= pixels_len));
    let (c8, n8) = (cb / 8 * 8, n / 8 * 8);
    let (src_ptr, dst_ptr) = (src.as_ptr(), dst.as_mut_ptr());
    // Pixel offsets walked along the rows: no division per pixel.
    let (mut y, mut x) = (0, 0);
    for p0 in (0..n8).step_by(8) {
        let mut px = [0usize; 8];
        for o in &mut px {
            *o = (grid.origin + y * grid.stride + x) * cb;
            x += 1;
            if x == grid.w {
                (x, y) = (0, y + 1);
            }
        }
        for c0 in (0..c8).step_by(8) {
            let plane = c0 * n + p0;
            // SAFETY: every pointer addresses 8 floats inside its slice: planes `c0..c0+8`
            // hold pixels `p0..p0+8` (planes length asserted), and pixel `p`'s channels
            // `c0..c0+8` sit at `at(p) + c0`, below the last pixel's end (asserted); `src` and
            // `dst` are distinct slices. The kernel's ISA is this CPU's.
            unsafe {
                match dir {
                    Direction::ToPixels => t(
                        &std::array::from_fn(|i| src_ptr.add(plane + i * n)),
                        &px.map(|o| dst_ptr.add(o + c0)),
                    ),
                    Direction::ToPlanes => t(
                        &px.map(|o| src_ptr.add(o + c0)),
                        &std::array::from_fn(|j| dst_ptr.add(plane + j * n)),
                    ),
                }
            }
        }
    }
    // The ragged rest: pixels past the last whole 8 (every channel), and the channels past
    // the last whole 8 of the other pixels; each pixel's offset computed once.
    for p in 0..n {
        let channels = if p < n8 { c8..cb } else { 0..cb };
        if channels.is_empty() {
            continue;
        }
        let px = at(p);
        for c in channels {
            match dir {
                Direction::ToPixels => dst[px + c] = src[c * n + p],
                Direction::ToPlanes => dst[c * n + p] = src[px + c],
            }
        }
    }
}
