//! Quantized (int8) convolution with ONNX QLinearConv's semantics: [`QConv2d`] / [`QConv1d`],
//! create → plan → run like the f32 ones.
//!
//! `y = requantize(Σ (x - x_zero_point) · w + bias)`: u8 or i8 input with a scale and zero
//! point; symmetric i8 weights with one scale per tensor or per output channel; an i32 bias in
//! units of `input_scale · weight_scale`. The sums are exact (i32, checked at create time not
//! to overflow). The output is one of:
//! - u8 / i8: `clamp(round_half_even(acc · M) + y_zero_point)` with
//!   `M = input_scale · weight_scale / output_scale` (computed in f64, rounded to f32 once),
//!   the product `acc · M` in f32. A fused ReLU, ReLU6 or clamp narrows the clamp;
//! - i32: the accumulators plus bias;
//! - f32: `(acc + bias) · input_scale · weight_scale`, then the f32 epilogue (any
//!   activation, a residual).
//!
//! The rounding of `acc · M` in f32 is the only difference from exact real arithmetic: an
//! output may differ by 1 from `round_half_even(acc · x_scale · w_scale / y_scale)` computed
//! exactly, where that product lies within f32 rounding of a half. ONNX Runtime does the same
//! (its multiplier is f32 too).

use crate::algo::qdepthwise::{QDepthwise, QDwPlan};
use crate::algo::qexact_f32::{QExactF32, QExactF32Plan};
use crate::algo::qgemm::{QGemm, QGemmPlan, QMode, QOut};
use crate::algo::Algorithm;
use crate::conv::Options;
use crate::cpu::{self, Isa};
use crate::params::Geometry;
use crate::{Activation, ConvParams, Error, Result, Workspace};
use std::sync::Arc;

/// The type of quantized 8-bit data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// Unsigned 8-bit, 0..=255.
    U8,
    /// Signed 8-bit, -128..=127.
    I8,
}

impl QuantType {
    /// The range of the type.
    pub fn range(self) -> (i32, i32) {
        match self {
            QuantType::U8 => (0, 255),
            QuantType::I8 => (-128, 127),
        }
    }

    /// `"u8"` or `"i8"`.
    pub fn name(self) -> &'static str {
        match self {
            QuantType::U8 => "u8",
            QuantType::I8 => "i8",
        }
    }
}

/// What a quantized convolution outputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum QuantOutput {
    /// u8 or i8, requantised with this scale and zero point.
    Quantized {
        /// u8 or i8.
        ty: QuantType,
        /// The output's scale.
        scale: f32,
        /// The output's zero point, in the type's range.
        zero_point: i32,
    },
    /// The i32 accumulators plus bias.
    I32,
    /// Dequantised f32, then the activation (and residual).
    F32,
}

/// The quantization of a convolution's input, weights and output.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantParams {
    /// u8 or i8 input.
    pub input_type: QuantType,
    /// The input's scale (finite, > 0).
    pub input_scale: f32,
    /// The input's zero point, in the type's range.
    pub input_zero_point: i32,
    /// One scale (per tensor) or one per output channel. Weights are symmetric (zero point 0).
    pub weight_scales: Vec<f32>,
    /// What the convolution outputs.
    pub output: QuantOutput,
}

impl QuantParams {
    /// u8 input and output, per-tensor weight scale: the usual QLinearConv.
    pub fn u8(
        input_scale: f32,
        input_zero_point: i32,
        weight_scale: f32,
        output_scale: f32,
        output_zero_point: i32,
    ) -> Self {
        QuantParams {
            input_type: QuantType::U8,
            input_scale,
            input_zero_point,
            weight_scales: vec![weight_scale],
            output: QuantOutput::Quantized {
                ty: QuantType::U8,
                scale: output_scale,
                zero_point: output_zero_point,
            },
        }
    }
}

/// An element type of quantized tensors: u8 and i8 (inputs and outputs), i32 and f32
/// (outputs).
pub trait QElement: bytemuck::Pod + sealed::Sealed {
    /// The type's name, for errors.
    const NAME: &'static str;
}
impl QElement for u8 {
    const NAME: &'static str = "u8";
}
impl QElement for i8 {
    const NAME: &'static str = "i8";
}
impl QElement for i32 {
    const NAME: &'static str = "i32";
}
impl QElement for f32 {
    const NAME: &'static str = "f32";
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for i8 {}
    impl Sealed for i32 {}
    impl Sealed for f32 {}
}

/// The packed weights of one int8 algorithm.
enum QAlgo {
    Gemm(QGemm),
    Depthwise(QDepthwise),
    ExactF32(QExactF32),
}

enum QAlgoPlan {
    Gemm(QGemmPlan),
    Depthwise(QDwPlan),
    ExactF32(QExactF32Plan),
}

pub(crate) struct QConvInner {
    params: ConvParams,
    quant: QuantParams,
    threads: usize,
    out: QOut,
    algo: QAlgo,
}

/// A quantized 2-D convolution with its weights packed: immutable, `Send + Sync`, cheap to
/// clone.
///
/// ```
/// use convkit::{ConvParams, Options, QConv2d, QuantParams, Workspace};
///
/// // u8 in and out: x = 0.5 · (q - 10), weights 1 · 0.25, y = 0.1 · (q - 3).
/// let params = ConvParams::conv2d(4, 2, [1, 1]);
/// let quant = QuantParams::u8(0.5, 10, 0.25, 0.1, 3);
/// let conv = QConv2d::new(params, quant, &[1i8; 8], None, Options::default())?;
/// let plan = conv.plan(1, 2, 2)?;
/// let x = vec![14u8; plan.input_len()]; // each input is 0.5 · 4 = 2.0
/// let mut y = vec![0u8; plan.output_len()];
/// plan.run(&x, &mut y, &mut Workspace::new())?;
/// // each output: 4 channels · 2.0 · 0.25 = 2.0, i.e. 3 + 2.0 / 0.1 = 23
/// assert!(y.iter().all(|&q| q == 23));
/// # Ok::<(), convkit::Error>(())
/// ```
#[derive(Clone)]
pub struct QConv2d {
    inner: Arc<QConvInner>,
}

fn invalid(what: &'static str, detail: String) -> Error {
    Error::InvalidParameter { what, detail }
}

fn check_scale(what: &'static str, s: f32) -> Result<()> {
    if s.is_finite() && s > 0.0 {
        Ok(())
    } else {
        Err(invalid(what, format!("must be finite and > 0, got {s}")))
    }
}

fn check_zero_point(what: &'static str, ty: QuantType, zp: i32) -> Result<()> {
    let (lo, hi) = ty.range();
    if (lo..=hi).contains(&zp) {
        Ok(())
    } else {
        Err(invalid(
            what,
            format!("{zp} is outside the {} range {lo}..={hi}", ty.name()),
        ))
    }
}

/// The quantized clamp of a fused activation: `zero_point + round(bound / scale)`, within
/// the type's range.
fn activation_bounds(
    activation: Activation,
    ty: QuantType,
    scale: f32,
    zero_point: i32,
) -> Result<(i32, i32)> {
    let (lo, hi) = ty.range();
    let q = |v: f32| {
        let r = (v as f64 / scale as f64).round_ties_even() + zero_point as f64;
        r.clamp(lo as f64, hi as f64) as i32
    };
    match activation {
        Activation::None => Ok((lo, hi)),
        Activation::Relu => Ok((zero_point.max(lo), hi)),
        Activation::Relu6 => Ok((zero_point.max(lo), q(6.0))),
        Activation::Clamp { min, max } => Ok((q(min), q(max))),
        other => Err(invalid(
            "activation of a quantized output",
            format!(
                "{other:?} cannot be fused into a u8/i8 output (only ReLU, ReLU6, clamp); \
                 use QuantOutput::F32 for it"
            ),
        )),
    }
}

impl QConv2d {
    /// Validates `params` and `quant`, checks `weights` (OIHW i8, `out x in/groups x kh x
    /// kw`) and `bias` (`out_channels` i32), and packs the weights. `options` as for
    /// [`Conv2d`](crate::Conv2d): threads, ISA cap, or a forced int8 kernel by name.
    pub fn new(
        params: ConvParams,
        quant: QuantParams,
        weights: &[i8],
        bias: Option<&[i32]>,
        options: Options,
    ) -> Result<Self> {
        params.validate()?;
        params.check_weights_and_bias(weights.len(), bias.map(|b| b.len()))?;
        let cout = params.out_channels;
        check_scale("input scale", quant.input_scale)?;
        check_zero_point("input zero point", quant.input_type, quant.input_zero_point)?;
        let ws = &quant.weight_scales;
        if ws.len() != 1 && ws.len() != cout {
            return Err(invalid(
                "weight scales",
                format!(
                    "need 1 (per tensor) or {cout} (per output channel), got {}",
                    ws.len()
                ),
            ));
        }
        for &s in ws {
            check_scale("weight scale", s)?;
        }
        let w_scale = |co: usize| ws[if ws.len() == 1 { 0 } else { co }] as f64;
        let x_scale = quant.input_scale as f64;
        let (mode, scale, zero_point, lo, hi) = match quant.output {
            QuantOutput::Quantized {
                ty,
                scale,
                zero_point,
            } => {
                check_scale("output scale", scale)?;
                check_zero_point("output zero point", ty, zero_point)?;
                let (qlo, qhi) = activation_bounds(params.activation, ty, scale, zero_point)?;
                let mult: Vec<f32> = (0..cout)
                    .map(|co| (x_scale * w_scale(co) / scale as f64) as f32)
                    .collect();
                if let Some(bad) = mult.iter().find(|m| !(m.is_finite() && **m > 0.0)) {
                    return Err(invalid(
                        "requantisation multiplier",
                        format!(
                            "input_scale · weight_scale / output_scale is {bad} in f32; it must \
                             be finite and > 0"
                        ),
                    ));
                }
                let (lo, hi) = ((qlo - zero_point) as f32, (qhi - zero_point) as f32);
                (QMode::Q8, mult, zero_point, lo, hi)
            }
            QuantOutput::I32 => {
                if params.activation != Activation::None {
                    return Err(invalid(
                        "activation of an i32 output",
                        format!("{:?}: i32 outputs are raw accumulators", params.activation),
                    ));
                }
                (QMode::I32, vec![1.0; cout], 0, 0.0, 0.0)
            }
            QuantOutput::F32 => {
                let s = (0..cout).map(|co| (x_scale * w_scale(co)) as f32).collect();
                (QMode::F32, s, 0, 0.0, 0.0)
            }
        };
        // The input zero point, in u8 (i8 inputs are shifted by 128 on the way in).
        let zu = match quant.input_type {
            QuantType::U8 => quant.input_zero_point,
            QuantType::I8 => quant.input_zero_point + 128,
        };
        // Fold `-zu · Σw` into the bias, and prove the i32 sums cannot overflow: the kernels
        // sum u8 · i8 products (each at most 255 · 128 in magnitude) and add this bias.
        let k = params.in_channels_per_group() * params.kernel[0] * params.kernel[1];
        let mut folded = Vec::with_capacity(cout);
        for co in 0..cout {
            let w = &weights[co * k..(co + 1) * k];
            let sum: i64 = w.iter().map(|&v| v as i64).sum();
            let b = bias.map_or(0, |b| b[co] as i64) - zu as i64 * sum;
            let bound = k as i64 * 255 * 128 + b.abs();
            if bound > i32::MAX as i64 {
                return Err(invalid(
                    "quantized convolution",
                    format!(
                        "output channel {co}: {k} products of up to 255·128 plus a bias of {b} \
                         could overflow the i32 accumulator"
                    ),
                ));
            }
            folded.push(b as i32);
        }
        let isa = match options.isa {
            Some(isa) => Isa::check(isa)?,
            None => Isa::default_level()?,
        };
        let out = QOut {
            mode,
            bias: folded,
            scale,
            zero_point,
            lo,
            hi,
            activation: if mode == QMode::F32 {
                params.activation
            } else {
                Activation::None
            },
        };
        let zu = zu as u8;
        // One input channel a group. By default only with several groups: a single input
        // channel with many outputs (wav2vec2's front end) is a dense GEMM with K = kernel.
        let depthwise = params.in_channels_per_group() == 1;
        let prefer_dw = depthwise && params.groups > 1;
        let unsupported = |reason: String| Error::AlgorithmUnsupported {
            algorithm: "int8 depthwise",
            reason,
        };
        let forced_dw = match options.kernel {
            Some(name) => cpu::qdw_by_name(name)?,
            None => None,
        };
        let algo = match (forced_dw, options.kernel, options.algorithm) {
            (Some(k), _, _) => {
                if !depthwise {
                    return Err(unsupported(format!(
                        "{} runs depthwise convolutions only",
                        k.name()
                    )));
                }
                match k {
                    cpu::QDwByName::Rows(k) => {
                        if let Some(why) = QDepthwise::rejects(&params, k) {
                            return Err(unsupported(why));
                        }
                        QAlgo::Depthwise(QDepthwise::new(&params, weights, zu, Some(k), None))
                    }
                    cpu::QDwByName::Small(k) => QAlgo::Depthwise(QDepthwise::new(
                        &params,
                        weights,
                        zu,
                        None,
                        Some((k, true)),
                    )),
                }
            }
            (None, Some(name), _) => {
                let kern = cpu::qgemm_by_name(name)?;
                QAlgo::Gemm(QGemm::new(&params, weights, &out, zu, kern)?)
            }
            (None, None, Some(Algorithm::Im2colGemm)) => {
                QAlgo::Gemm(QGemm::new(&params, weights, &out, zu, cpu::qgemm(isa))?)
            }
            (None, None, a @ Some(Algorithm::Depthwise | Algorithm::DepthwiseGeneric))
            | (None, None, a @ None)
                if prefer_dw || a.is_some() =>
            {
                if !depthwise {
                    return Err(unsupported(
                        "the convolution is not depthwise (one input channel a group)".into(),
                    ));
                }
                let (kern, small) = match a {
                    Some(Algorithm::DepthwiseGeneric) => (None, None),
                    _ => (
                        cpu::qdw(isa)
                            .iter()
                            .find(|k| QDepthwise::rejects(&params, k).is_none()),
                        cpu::qdw_small(isa).map(|k| (k, false)),
                    ),
                };
                QAlgo::Depthwise(QDepthwise::new(&params, weights, zu, kern, small))
            }
            (None, None, Some(Algorithm::Direct)) => {
                if let Some(why) = QExactF32::rejects(&params) {
                    return Err(Error::AlgorithmUnsupported {
                        algorithm: "direct",
                        reason: format!("int8 runs direct through the f32 kernels, but {why}"),
                    });
                }
                QAlgo::ExactF32(QExactF32::new(&params, weights, bias, zu, isa, &options)?)
            }
            (None, None, None) => {
                // Grouped, a few channels a group: the int8 GEMM's panels are mostly padding,
                // where the f32 direct kernels (NCHW, their sizes and strides) run near peak.
                let exact = (params.groups > 1 && QExactF32::rejects(&params).is_none())
                    .then(|| QExactF32::new(&params, weights, bias, zu, isa, &options))
                    .and_then(|r| r.ok());
                match exact {
                    Some(a) => QAlgo::ExactF32(a),
                    None => QAlgo::Gemm(QGemm::new(&params, weights, &out, zu, cpu::qgemm(isa))?),
                }
            }
            (None, None, Some(a)) => {
                return Err(Error::AlgorithmUnsupported {
                    algorithm: a.name(),
                    reason: "int8 convolutions run im2col_gemm, depthwise or direct".into(),
                })
            }
        };
        Ok(QConv2d {
            inner: Arc::new(QConvInner {
                params,
                quant,
                threads: options.threads,
                out,
                algo,
            }),
        })
    }

    /// The parameters the convolution was created with.
    pub fn params(&self) -> &ConvParams {
        &self.inner.params
    }

    /// The quantization it was created with.
    pub fn quant(&self) -> &QuantParams {
        &self.inner.quant
    }

    /// Fixes the input size: output shape, tiling, workspace size.
    pub fn plan(&self, batch: usize, in_h: usize, in_w: usize) -> Result<QPlan> {
        let geometry = self.inner.params.geometry(batch, in_h, in_w)?;
        let threads = crate::algo::workers(self.inner.threads);
        let flip = self.inner.quant.input_type == QuantType::I8;
        let algo = match &self.inner.algo {
            QAlgo::Gemm(a) => QAlgoPlan::Gemm(a.plan(&geometry, threads, flip)),
            QAlgo::Depthwise(a) => QAlgoPlan::Depthwise(a.plan(&geometry, threads)?),
            QAlgo::ExactF32(a) => QAlgoPlan::ExactF32(a.plan(&geometry, threads)?),
        };
        Ok(QPlan {
            conv: self.inner.clone(),
            geometry,
            algo: Arc::new(algo),
        })
    }
}

/// A quantized convolution planned for one input size. Running it allocates nothing once the
/// workspace holds `workspace_bytes()`.
#[derive(Clone)]
pub struct QPlan {
    conv: Arc<QConvInner>,
    geometry: Geometry,
    algo: Arc<QAlgoPlan>,
}

impl QPlan {
    /// Input size, padding and output size.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Output shape in the convolution's layout order.
    pub fn output_shape(&self) -> [usize; 4] {
        let g = &self.geometry;
        match g.layout {
            crate::Layout::Nchw => [g.batch, g.c_out, g.oh, g.ow],
            crate::Layout::Nhwc => [g.batch, g.oh, g.ow, g.c_out],
        }
    }

    /// Elements the input slice must have.
    pub fn input_len(&self) -> usize {
        self.geometry.input_len()
    }

    /// Elements the output (and residual) slice must have.
    pub fn output_len(&self) -> usize {
        self.geometry.output_len()
    }

    /// Bytes of workspace `run` needs.
    pub fn workspace_bytes(&self) -> usize {
        match &*self.algo {
            QAlgoPlan::Gemm(p) => p.workspace_bytes(),
            QAlgoPlan::Depthwise(p) => p.workspace_bytes(),
            QAlgoPlan::ExactF32(p) => p.workspace_bytes(),
        }
    }

    /// The algorithm and kernel that run, e.g. `im2col_gemm/qgemm_u8i8_8x32_avx512vnni`.
    pub fn kernel_name(&self) -> String {
        match &self.conv.algo {
            QAlgo::Gemm(a) => format!("im2col_gemm/{}", a.kernel_name()),
            QAlgo::Depthwise(a) => match &*self.algo {
                QAlgoPlan::Depthwise(p) => format!("depthwise/{}", a.kernel_name(p)),
                _ => unreachable!("a plan is made by its convolution's algorithm"),
            },
            QAlgo::ExactF32(_) => match &*self.algo {
                QAlgoPlan::ExactF32(p) => format!("exact_f32/{}", QExactF32::kernel_name(p)),
                _ => unreachable!("a plan is made by its convolution's algorithm"),
            },
        }
    }

    /// Direct-convolution operations (2 per multiply-add), the convention of GOP/s figures.
    pub fn ops(&self) -> f64 {
        self.geometry.flops()
    }

    /// `output = requantize(conv(input))`. `I` must be the input type and `O` the output
    /// type of the convolution's [`QuantParams`] (u8/i8, i32 or f32).
    pub fn run<I: QElement, O: QElement>(
        &self,
        input: &[I],
        output: &mut [O],
        workspace: &mut Workspace,
    ) -> Result<()> {
        self.run_inner(input, None, output, workspace)
    }

    /// F32 output only: `output = act(dequantize(conv(input)) + residual)`.
    pub fn run_with_residual<I: QElement>(
        &self,
        input: &[I],
        residual: &[f32],
        output: &mut [f32],
        workspace: &mut Workspace,
    ) -> Result<()> {
        if self.conv.quant.output != QuantOutput::F32 {
            return Err(invalid(
                "residual",
                "a residual is added to f32 outputs only".into(),
            ));
        }
        self.run_inner(input, Some(residual), output, workspace)
    }

    fn run_inner<I: QElement, O: QElement>(
        &self,
        input: &[I],
        residual: Option<&[f32]>,
        output: &mut [O],
        ws: &mut Workspace,
    ) -> Result<()> {
        let q = &self.conv.quant;
        let want_in = q.input_type.name();
        let want_out = match q.output {
            QuantOutput::Quantized { ty, .. } => ty.name(),
            QuantOutput::I32 => "i32",
            QuantOutput::F32 => "f32",
        };
        if I::NAME != want_in || O::NAME != want_out {
            return Err(invalid(
                "element types",
                format!(
                    "this convolution takes {want_in} input and gives {want_out} output, not {} \
                     and {}",
                    I::NAME,
                    O::NAME
                ),
            ));
        }
        let checks = [
            ("input", self.input_len(), Some(input.len())),
            ("output", self.output_len(), Some(output.len())),
            ("residual", self.output_len(), residual.map(|r| r.len())),
        ];
        crate::error::check_lengths(&checks)?;
        let scratch = ws.floats(self.workspace_bytes().div_ceil(4))?;
        let flip = if q.input_type == QuantType::I8 {
            0x80
        } else {
            0
        };
        let (x, y, s) = (
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
            bytemuck::cast_slice_mut(scratch),
        );
        let (g, out) = (&self.geometry, &self.conv.out);
        match (&self.conv.algo, &*self.algo) {
            (QAlgo::Gemm(a), QAlgoPlan::Gemm(p)) => a.run(p, g, out, x, flip, residual, y, s),
            (QAlgo::Depthwise(a), QAlgoPlan::Depthwise(p)) => {
                a.run(p, g, out, x, flip, residual, y, s)
            }
            (QAlgo::ExactF32(a), QAlgoPlan::ExactF32(p)) => {
                a.run(p, g, out, x, flip, residual, y, bytemuck::cast_slice_mut(s))
            }
            _ => unreachable!("a plan is made by its convolution's algorithm"),
        }
        Ok(())
    }
}

/// A quantized 1-D convolution: a thin front over [`QConv2d`] with height 1.
#[derive(Clone)]
pub struct QConv1d {
    conv: QConv2d,
}

impl QConv1d {
    /// As [`QConv2d::new`]; `params` must be a 1-D convolution (`ConvParams::conv1d`).
    pub fn new(
        params: ConvParams,
        quant: QuantParams,
        weights: &[i8],
        bias: Option<&[i32]>,
        options: Options,
    ) -> Result<Self> {
        crate::conv::check_1d(&params)?;
        Ok(QConv1d {
            conv: QConv2d::new(params, quant, weights, bias, options)?,
        })
    }

    /// Fixes the input length.
    pub fn plan(&self, batch: usize, length: usize) -> Result<QPlan> {
        self.conv.plan(batch, 1, length)
    }

    /// The 2-D convolution underneath.
    pub fn as_qconv2d(&self) -> &QConv2d {
        &self.conv
    }
}
