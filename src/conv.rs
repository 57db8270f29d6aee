//! `Conv2d` / `Conv1d`: create (validate, choose, pack) and plan. The choice of algorithm
//! lives here, in one place.

use crate::algo::depthwise::Depthwise;
use crate::algo::direct::Direct;
use crate::algo::im2col_gemm::Im2colGemm;
use crate::algo::winograd::{self, Winograd};
use crate::algo::Algorithm;
use crate::cpu::{Family, Isa};
use crate::params::Geometry;
use crate::plan::{AlgoPlan, Plan};
use crate::storage::{to_f32_vec, Bands, Storage};
use crate::{ConvParams, Error, Precision, Result};
use std::sync::Arc;

/// How a convolution runs: threads, ISA level, and (optionally) a forced algorithm.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// 0: every thread of the current rayon pool (install your own pool to choose);
    /// 1: the caller's thread only, no pool is touched; n: at most n workers. Call `run` from
    /// inside the pool (`pool.install`) so the calling thread is one of the workers: from
    /// outside, every run waits for sleeping workers to wake up.
    pub threads: usize,
    /// Run at this ISA level instead of the best one (or `CONVKIT_ISA`); never above what the
    /// CPU has (that is `Error::IsaUnavailable`).
    pub isa: Option<Isa>,
    /// Run this algorithm instead of the one convkit would choose.
    pub algorithm: Option<Algorithm>,
    /// Run this generated kernel (a name from [`cpu::registry`](crate::cpu::registry)), at its
    /// ISA level, wherever the rules would use another: how tests and benchmarks reach every
    /// kernel. An error if it does not take the convolution.
    pub kernel: Option<&'static str>,
    /// How exact the result must be: whether Winograd may run, and with which tiles.
    pub precision: Precision,
    /// The input size (height, width) plans will mostly use, if known: choices made at create
    /// time that depend on it (Winograd's tile) use it. Any size still plans and runs.
    pub input_hint: Option<[usize; 2]>,
}

impl Options {
    /// Options with `threads` workers.
    pub fn threads(threads: usize) -> Self {
        Options {
            threads,
            ..Default::default()
        }
    }
}

/// The packed weights of one algorithm.
pub(crate) enum Packed {
    Im2colGemm(Im2colGemm),
    Depthwise(Depthwise),
    Direct(Direct),
    Winograd(Winograd),
}

pub(crate) struct ConvInner {
    pub params: ConvParams,
    pub bias: Option<Vec<f32>>,
    pub isa: Isa,
    pub threads: usize,
    pub algorithm: Algorithm,
    pub packed: Packed,
}

/// A 2-D convolution with its weights packed: immutable, `Send + Sync`, cheap to clone.
///
/// ```
/// use convkit::{Conv2d, ConvParams, Layout, Options, Padding, Workspace};
///
/// // A depthwise 3x3 (groups == channels) on NHWC tensors.
/// let params = ConvParams::conv2d(32, 32, [3, 3])
///     .with_groups(32)
///     .with_padding(Padding::Same)
///     .with_layout(Layout::Nhwc);
/// let conv = Conv2d::new(params, &vec![1.0 / 9.0; 32 * 9], None, Options::default())?;
/// assert_eq!(conv.algorithm().name(), "depthwise");
/// let plan = conv.plan(1, 16, 16)?;
/// let mut out = vec![0.0; plan.output_len()];
/// plan.run(&vec![1.0; plan.input_len()], &mut out, &mut Workspace::new())?;
/// assert!((out[(8 * 16 + 8) * 32] - 1.0).abs() < 1e-6); // an inner pixel: the mean of ones
/// # Ok::<(), convkit::Error>(())
/// ```
#[derive(Clone)]
pub struct Conv2d {
    inner: Arc<ConvInner>,
}

impl Conv2d {
    /// Validates `params`, checks `weights` (OIHW, `out x in/groups x kh x kw`) and `bias`
    /// (`out_channels`), chooses the algorithm and packs the weights for it.
    pub fn new(
        params: ConvParams,
        weights: &[f32],
        bias: Option<&[f32]>,
        options: Options,
    ) -> Result<Self> {
        params.validate()?;
        params.check_weights_and_bias(weights.len(), bias.map(|b| b.len()))?;
        let forced = options.kernel.map(crate::cpu::find_kernel).transpose()?;
        let isa = match (options.isa, forced) {
            (Some(isa), Some(k)) if isa != k.isa => {
                return Err(Error::InvalidParameter {
                    what: "kernel and ISA",
                    detail: format!("kernel {} is {}, not {isa}", k.name, k.isa),
                })
            }
            (_, Some(k)) => Isa::check(k.isa)?,
            (Some(isa), None) => Isa::check(isa)?,
            (None, None) => Isa::default_level()?,
        };
        // Workers that run together: the choices of algorithm and tile depend on them.
        let parallel = crate::algo::parallel_workers(options.threads);
        let algorithm = match (forced.map(|k| k.family), options.algorithm) {
            (Some(Family::QGemm | Family::QDepthwise), _) => {
                return Err(Error::InvalidParameter {
                    what: "kernel",
                    detail: format!(
                        "{} is an int8 kernel: it runs quantized convolutions (QConv2d)",
                        options.kernel.unwrap_or_default()
                    ),
                })
            }
            (Some(Family::Gemm), None | Some(Algorithm::Im2colGemm)) => Algorithm::Im2colGemm,
            (Some(Family::Depthwise), None | Some(Algorithm::Depthwise)) => Algorithm::Depthwise,
            (Some(Family::Direct), None | Some(Algorithm::Direct)) => Algorithm::Direct,
            (Some(Family::Winograd), None | Some(Algorithm::Winograd)) => Algorithm::Winograd,
            (Some(family), Some(a)) => {
                return Err(Error::InvalidParameter {
                    what: "kernel and algorithm",
                    detail: format!("a {family:?} kernel does not run algorithm {a}"),
                })
            }
            (None, a) => a.unwrap_or_else(|| choose(&params, isa, options.precision, parallel)),
        };
        // A forced 16-bit depthwise kernel forces its f32 twin (same ISA, layout and shape):
        // 16-bit runs take the twin's 16-bit kernel, which is the forced one.
        let dw_kernel = match forced {
            Some(k) if k.family == Family::Depthwise => crate::cpu::dw_f32().iter().find(|d| {
                d.name == k.name
                    || (k.storage != crate::StorageType::F32
                        && (d.isa, Some(d.layout), d.fixed, d.ymm)
                            == (k.isa, k.layout, k.fixed, false))
            }),
            _ => None,
        };
        let direct_kernel = match forced {
            Some(k) if k.family == Family::Direct => {
                crate::cpu::direct_f32().iter().find(|d| d.name == k.name)
            }
            _ => None,
        };
        let wino_kernel = match forced {
            Some(k) if k.family == Family::Winograd => {
                crate::cpu::wino_f32().iter().find(|w| w.name == k.name)
            }
            _ => None,
        };
        let packed = match algorithm {
            Algorithm::Winograd => {
                let m = match wino_kernel {
                    Some(k) => k.m,
                    None => winograd_tile(
                        &params,
                        isa,
                        options.precision,
                        options.input_hint,
                        parallel,
                    ),
                };
                // The kernel of that tile for this shape: a forced one must be it (2-D or 1-D).
                let kern = winograd::kernel_for(&params, isa, m)
                    .and_then(|found| match wino_kernel {
                        Some(k) if k.name != found.name => Err(format!(
                            "kernel {} does not take {}-D convolutions",
                            k.name, found.dims
                        )),
                        _ => Ok(found),
                    })
                    .map_err(|reason| Error::AlgorithmUnsupported {
                        algorithm: "winograd",
                        reason,
                    })?;
                Packed::Winograd(Winograd::new(&params, weights, bias, isa, kern)?)
            }
            Algorithm::Direct => {
                Packed::Direct(Direct::new(&params, weights, bias, isa, direct_kernel)?)
            }
            Algorithm::Im2colGemm => Packed::Im2colGemm(Im2colGemm::new(&params, weights, isa)?),
            Algorithm::Depthwise | Algorithm::DepthwiseGeneric => {
                Packed::Depthwise(Depthwise::new(
                    &params,
                    weights,
                    bias,
                    isa,
                    algorithm == Algorithm::DepthwiseGeneric,
                    dw_kernel,
                    forced.is_some_and(|k| k.storage != crate::StorageType::F32),
                )?)
            }
        };
        let bias = bias.map(|b| b.to_vec());
        Ok(Conv2d {
            inner: Arc::new(ConvInner {
                params,
                bias,
                isa,
                threads: options.threads,
                algorithm,
                packed,
            }),
        })
    }

    /// As [`new`](Self::new), with weights and bias stored as `T` (`f32`, [`half::f16`] or
    /// [`half::bf16`]): they are widened to f32 once, here, and packed as f32 weights are.
    /// Plans run on 16-bit tensors with [`Plan::run_storage`].
    pub fn from_storage<T: Storage>(
        params: ConvParams,
        weights: &[T],
        bias: Option<&[T]>,
        options: Options,
    ) -> Result<Self> {
        params.validate()?;
        params.check_weights_and_bias(weights.len(), bias.map(|b| b.len()))?;
        let bias = bias.map(to_f32_vec);
        Self::new(params, &to_f32_vec(weights), bias.as_deref(), options)
    }

    /// The parameters the convolution was created with.
    pub fn params(&self) -> &ConvParams {
        &self.inner.params
    }

    /// The ISA level the packed weights and kernels are for.
    pub fn isa(&self) -> Isa {
        self.inner.isa
    }

    /// The algorithm the convolution runs (chosen at create time).
    pub fn algorithm(&self) -> Algorithm {
        self.inner.algorithm
    }

    /// Fixes the input size: output shape, tiling, workspace size.
    pub fn plan(&self, batch: usize, in_h: usize, in_w: usize) -> Result<Plan> {
        let geometry = self.inner.params.geometry(batch, in_h, in_w)?;
        let threads = crate::algo::workers(self.inner.threads);
        let plan_algo = |g: &Geometry| match &self.inner.packed {
            Packed::Im2colGemm(a) => AlgoPlan::Im2colGemm(a.plan(g, threads)),
            Packed::Depthwise(a) => AlgoPlan::Depthwise(a.plan(g, threads)),
            Packed::Direct(a) => AlgoPlan::Direct(a.plan(g, threads)),
            Packed::Winograd(a) => AlgoPlan::Winograd(a.plan(g, threads)),
        };
        let bands = Bands::new(&geometry, |g| {
            let p = plan_algo(g);
            let floats = p.workspace_floats();
            (p, floats)
        });
        Ok(Plan::new(
            self.inner.clone(),
            geometry,
            plan_algo(&geometry),
            bands,
        ))
    }
}

/// The choice of algorithm, in one place:
/// - depthwise convolutions run the depthwise kernels (an unrolled kernel where the generator
///   made one for the kernel size and stride, else the generic one): they beat im2col + GEMM
///   by 5-15x on every depthwise layer of the suite, because a GEMM with one input channel
///   per group has nothing to reuse;
/// - NCHW grouped convolutions with few channels a group, and stems with at most 4 input
///   channels, run the direct kernels where the generator made one for their shape: GEMM
///   reuses too little there (measured in `convkit bench`, see the README's table); stride-4
///   stems only on several threads at AVX-512 (see `direct_stride4`);
/// - 3x3 and 1x3 stride-1 convolutions with at least 16 input channels a group run Winograd
///   (unless `Precision::Exact`): 1.7-3.3x GEMM's speed on the suite's 3x3 layers;
/// - everything else runs im2col + GEMM, which takes every shape.
///
/// `threads` is how many workers run at the same time.
fn choose(params: &ConvParams, isa: Isa, precision: Precision, threads: usize) -> Algorithm {
    let grouped = params.groups > 1 && params.groups < params.in_channels;
    let few_channels = params.in_channels_per_group() <= DIRECT_MAX_CIN;
    // One input channel is "depthwise" too, but with many outputs per channel (wav2vec2's
    // 1 -> 512 front end) it is a dense GEMM with K = kernel size, which GEMM does better.
    if params.groups > 1 && Depthwise::rejects(params).is_none() {
        Algorithm::Depthwise
    } else if precision != Precision::Exact
        && params.in_channels_per_group() >= WINOGRAD_MIN_CHANNELS
        && params.out_channels_per_group() >= crate::cpu::gemm_f32(isa).nr
        && Winograd::rejects(params, isa).is_none()
    {
        Algorithm::Winograd
    } else if (grouped || params.groups == 1)
        && few_channels
        && (params.stride[0] <= 2 || direct_stride4(isa, threads))
        && Direct::rejects(params, isa).is_none()
    {
        Algorithm::Direct
    } else {
        Algorithm::Im2colGemm
    }
}

/// Whether stride-4 stems (ConvNeXt's 4x4 patchify) run the direct kernel. Measured on
/// convnext_t_stem_4x4s4 (`convkit bench`, 7-9 interleaved rounds, GFLOP/s im2col+GEMM /
/// direct): AVX-512, one thread 89.5 / 85.3, so GEMM keeps it; two threads 145 / 170 (direct
/// 1.15-1.17x in three of four A/B runs, 2.2x in the other), as GEMM's items of a few hundred
/// pixels, 48 steps deep, scale only 1.6x. AVX2: GEMM wins at both, 50.5 / 46.4 and 105 / 62.
fn direct_stride4(isa: Isa, threads: usize) -> bool {
    isa == Isa::Avx512 && threads > 1
}

/// The most input channels per group the choice sends to the direct kernels. Measured with
/// `convkit bench` (one thread, AVX-512, three rounds, GFLOP/s direct vs GEMM): 3x3 on 8
/// channels 112x112 101-110 vs 65-97; stride 2 on 16 channels 83-94 vs 49-71; groups of 8
/// channels 93-99 vs 41-60; 16 channels 56x56 95-100 vs 72-102, a tie, so no more than 16.
const DIRECT_MAX_CIN: usize = 16;

/// The fewest input channels a group for which the choice runs Winograd; it also wants a
/// whole GEMM panel of output channels (`nr`: 32 at AVX-512, 16 at AVX2). Measured with
/// `convkit bench` (one thread, AVX-512, three rounds, GFLOP/s GEMM / direct / Winograd) on
/// 3x3 layers: 8 -> 8 channels 56x56 57 / 93 / 31; 16 -> 16 74 / 99 / 90; 16 -> 32 112x112
/// 87 / 114 / 208; 32 -> 32 56x56 86 / 102 / 225; 2 groups of 64 28x28 94 / 103 / 248;
/// 1024 -> 1024 7x7 69 / 52 / 96.
const WINOGRAD_MIN_CHANNELS: usize = 16;

/// The Winograd tile (`m` of F(m,3)) for `params`: of those `precision` allows, the one with
/// the least work on an image of `hint`'s size, or F(4,3) without a hint (on the suite it is
/// never the slowest, and within 10% of the best on 14x14 to 224x224 images).
///
/// Work: the GEMMs do `(m+2)^2` products a tile (a last block of a few tiles costs its rows:
/// there are edge kernels for every row count), and each bigger tile does less transform work
/// an output (weighted by `1 - m/20`). Where a group's transformed weights outgrow the caches
/// (`(m+2)^2 x cin x cout` floats over 16 MiB), each of the `workers` streams them from memory
/// at least once, at the cost of [`WINOGRAD_STREAM_TILES`] tiles' GEMMs.
///
/// Measured (`convkit bench --kernel`, AVX-512, 2026-12-07, F(2,3) / F(4,3) / F(5,3) / F(6,3)
/// against F(4,3), medians of 7 interleaved rounds' ratios, one thread): 7x7 (512 channels)
/// 0.92 / 1 / 0.61 / 0.45 (at two threads F(2,3) 2.6x F(4,3)); 14x14 (256) 0.78 / 1 / 1.13 /
/// 0.82; 8 images of 14x14 0.77 / 1 / 1.12 / 0.85; and three rounds' medians, GFLOP/s: 28x28
/// 198 / 328 / 331 / 388, 56x56 185 / 298 / 267 / 306, 224x224 184 / 294 / 294 / 331.
/// F(5,3) covers 14 pixels with 3 tiles where F(4,3) needs 4 and F(6,3) wastes 4 of 18.
fn winograd_tile(
    params: &ConvParams,
    isa: Isa,
    precision: Precision,
    hint: Option<[usize; 2]>,
    workers: usize,
) -> usize {
    // Winograd forced at `Precision::Exact` runs the most accurate tile.
    let max = precision.max_tile().max(2);
    let Some([h, w]) = hint else {
        return max.min(4);
    };
    // In f64: any hint, however large, is a cost, never an overflow.
    let one_d = params.kernel[0] == 1;
    let cost = |m: usize| {
        let mf = m as f64;
        let tiles_y = if one_d {
            h.max(1) as f64
        } else {
            (h as f64 / mf).ceil()
        };
        let tiles = tiles_y * (w as f64 / mf).ceil();
        let side = (mf + 2.0) * if one_d { 1.0 } else { mf + 2.0 };
        let weights =
            side * params.in_channels_per_group() as f64 * params.out_channels_per_group() as f64;
        let streams = if weights > WINOGRAD_CACHED_WEIGHTS {
            workers.clamp(1, tiles.max(1.0) as usize) as f64 * WINOGRAD_STREAM_TILES
        } else {
            0.0
        };
        side * (tiles * (1.0 - mf / 20.0) + streams)
    };
    // The tiles the generator emitted for this ISA; of equal costs the smaller (more accurate).
    crate::cpu::wino_f32()
        .iter()
        .filter(|k| k.isa == isa && k.m <= max)
        .map(|k| k.m)
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)).then(a.cmp(&b)))
        .unwrap_or(2)
}

/// Transformed weights of a group (floats) that the tile choice takes to stay in the caches
/// (16 MiB: F(6,3) at 256 channels, half the L3 of a Zen 4 chiplet). The plan's own line for
/// taking a whole image's tiles an item is lower (12 MiB, `U_STREAM_FLOATS` in
/// `algo/winograd.rs`); at 12 MiB here F(5,3)'s 12.25 MiB on 256 channels would lose 14x14
/// images to F(4,3), against the 1.13x it measured.
const WINOGRAD_CACHED_WEIGHTS: f64 = (4u64 << 20) as f64;

/// A stream of a group's transformed weights from memory, in tiles' GEMMs, fitted to
/// resnet50_l4_3x3 (7x7, 512 channels: F(2,3)'s weights take 16 MiB, F(4,3)'s 36 MiB for 4
/// tiles) so that it keeps F(2,3): against it F(4,3) ran 1.02-1.08x on one thread at AVX-512
/// but 0.88x at AVX2 and 0.38x on two threads (each worker streams the weights for 2 tiles).
const WINOGRAD_STREAM_TILES: f64 = 4.0;

/// `Ok` if `params` describes a 1-D convolution: kernel, stride and dilation height 1, no
/// vertical padding.
pub(crate) fn check_1d(params: &ConvParams) -> Result<()> {
    let vertical_pad = match params.padding {
        crate::Padding::Explicit { top, bottom, .. } => top + bottom,
        _ => 0,
    };
    if params.kernel[0] != 1
        || params.stride[0] != 1
        || params.dilation[0] != 1
        || vertical_pad != 0
    {
        return Err(Error::InvalidParameter {
                what: "1-D convolution",
                detail: format!(
                    "kernel, stride and dilation height must be 1 and vertical padding 0; got kernel {:?}, stride {:?}, dilation {:?}, padding {:?}",
                    params.kernel, params.stride, params.dilation, params.padding
                ),
            });
    }
    Ok(())
}

/// A 1-D convolution: a thin front over [`Conv2d`] with height 1. Weights are
/// `out x in/groups x kernel`; tensors are NCW (or NWC with `Layout::Nhwc`).
///
/// ```
/// use convkit::{Conv1d, ConvParams, Options, Padding, Workspace};
///
/// // Whisper's first layer: 80 mel channels -> 384, kernel 3, "same" padding.
/// let params = ConvParams::conv1d(80, 384, 3).with_padding(Padding::Same);
/// let conv = Conv1d::new(params, &vec![0.001; 384 * 80 * 3], None, Options::default())?;
/// let plan = conv.plan(1, 3000)?; // batch 1, 3000 frames
/// assert_eq!(plan.output_shape(), [1, 384, 1, 3000]);
/// let mut out = vec![0.0; plan.output_len()];
/// plan.run(&vec![1.0; plan.input_len()], &mut out, &mut Workspace::new())?;
/// assert!((out[1500] - 80.0 * 3.0 * 0.001).abs() < 1e-4);
/// # Ok::<(), convkit::Error>(())
/// ```
#[derive(Clone)]
pub struct Conv1d {
    conv: Conv2d,
}

impl Conv1d {
    /// `params` must describe a 1-D convolution (`ConvParams::conv1d`): kernel height,
    /// stride height and dilation height 1, no vertical padding.
    pub fn new(
        params: ConvParams,
        weights: &[f32],
        bias: Option<&[f32]>,
        options: Options,
    ) -> Result<Self> {
        check_1d(&params)?;
        Ok(Conv1d {
            conv: Conv2d::new(params, weights, bias, options)?,
        })
    }

    /// As [`new`](Self::new), with weights and bias stored as `T` (`f32`, [`half::f16`] or
    /// [`half::bf16`]), widened to f32 once, here.
    pub fn from_storage<T: Storage>(
        params: ConvParams,
        weights: &[T],
        bias: Option<&[T]>,
        options: Options,
    ) -> Result<Self> {
        check_1d(&params)?;
        Ok(Conv1d {
            conv: Conv2d::from_storage(params, weights, bias, options)?,
        })
    }

    /// Fixes the input length.
    pub fn plan(&self, batch: usize, length: usize) -> Result<Plan> {
        self.conv.plan(batch, 1, length)
    }

    /// The 2-D convolution underneath.
    pub fn as_conv2d(&self) -> &Conv2d {
        &self.conv
    }
}

#[cfg(all(test, target_arch = "x86_64", feature = "avx512"))]
mod tests {
    use super::*;

    /// The patchify stem's choice depends on the thread count at AVX-512 only.
    #[test]
    fn stride4_stem_runs_direct_on_several_threads_at_avx512() {
        let stem = ConvParams::conv2d(3, 96, [4, 4]).with_stride([4, 4]);
        let pick = |isa, threads| choose(&stem, isa, Precision::default(), threads);
        assert_eq!(pick(Isa::Avx512, 1), Algorithm::Im2colGemm);
        assert_eq!(pick(Isa::Avx512, 2), Algorithm::Direct);
        assert_eq!(pick(Isa::Avx2, 2), Algorithm::Im2colGemm);
    }

    /// Where the transformed weights outgrow the caches, each worker's stream of them counts:
    /// 512 channels on 12x12 take F(4,3) (36 MiB of weights, 9 tiles) on one worker and F(2,3)
    /// (16 MiB, cached; 36 tiles) on two; on 7x7 F(2,3) on both. 64 channels (small weights)
    /// take F(6,3) on 12x12 either way, F(5,3) on 14x14.
    #[test]
    fn winograd_tile_counts_weight_streams_per_worker() {
        let isa = Isa::Scalar;
        let tile = |c, hw, workers| {
            let p = ConvParams::conv2d(c, c, [3, 3]);
            winograd_tile(&p, isa, Precision::Balanced, Some([hw, hw]), workers)
        };
        assert_eq!(tile(512, 12, 1), 4);
        assert_eq!(tile(512, 12, 2), 2);
        assert_eq!(tile(512, 7, 1), 2);
        assert_eq!(tile(512, 7, 2), 2);
        assert_eq!(tile(64, 12, 1), 6);
        assert_eq!(tile(64, 12, 2), 6);
        assert_eq!(tile(64, 14, 2), 5);
        // Accurate stops at F(4,3); equal costs (an empty image) take the smallest tile.
        let p = ConvParams::conv2d(64, 64, [3, 3]);
        assert_eq!(
            winograd_tile(&p, isa, Precision::Accurate, Some([28, 28]), 1),
            4
        );
        assert_eq!(
            winograd_tile(&p, isa, Precision::Balanced, Some([0, 0]), 1),
            2
        );
    }
}
