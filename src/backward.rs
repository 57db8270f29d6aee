//! Backward passes ([`ConvBackward`]) and transposed convolution ([`ConvTranspose2d`],
//! [`ConvTranspose1d`]), with the same create → plan → run shape as the forward pass.
//!
//! The backward-data pass and transposed convolution are the same arithmetic, and share one
//! engine, chosen at create time:
//! - stride 1 (with padding no wider than the kernel): a forward convolution of the output
//!   gradient with the weights flipped and transposed, so it runs on the forward kernels —
//!   Winograd, depthwise, direct or GEMM, whichever the forward choice picks for that shape;
//! - depthwise with any stride or multiplier: the dedicated depthwise backward kernels;
//! - everything else: GEMM + col2im a tile at a time.
//!
//! The backward-weights pass is a GEMM whose patch operand is packed straight from the input
//! (dense and grouped), or the depthwise kernels.

use crate::algo::backward_gemm::{
    self, Col2imData, Col2imPlan, Epilogue, WeightGrad, WeightGradPlan,
};
use crate::algo::depthwise_backward::{DwBackward, DwBackwardPlan};
use crate::algo::winograd_backward::{WinoWeightGrad, WinoWeightPlan};
use crate::params::Geometry;
use crate::{
    Activation, Conv2d, ConvParams, Error, Isa, Layout, Options, Padding, Plan, Result, Workspace,
};
use std::sync::Arc;

/// Whether a backward pass overwrites its gradient buffers or adds to them (training loops
/// that accumulate gradients over several batches).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Accumulate {
    /// `grad = result`.
    #[default]
    Overwrite,
    /// `grad += result`.
    Add,
}

/// How the backward-data pass (or transposed convolution) runs.
enum DataPath {
    /// A forward convolution of `dy` with the flipped, transposed weights.
    Forward(Conv2d),
    Depthwise,
    Col2im(Col2imData),
}

/// The backward-data engine: the weights packed for one of the paths, and the epilogue a
/// transposed convolution fuses (none for a gradient: the forward path's convolution then
/// carries none either).
struct DataPass {
    path: DataPath,
    depthwise: Option<DwBackward>,
    bias: Option<Vec<f32>>,
    activation: Activation,
    threads: usize,
}

enum DataPlan {
    /// `all`: the whole batch; `one`: one image, for accumulation through the workspace.
    Forward {
        all: Box<Plan>,
        one: Box<Plan>,
    },
    Depthwise(DwBackwardPlan),
    Col2im(Col2imPlan),
}

/// `Options` for the convolutions the backward passes build: threads, ISA, precision and
/// the input-size hint carry over (at stride 1 the gradient has the input's size), a forced
/// algorithm or kernel does not (it names a forward one).
fn inner_options(o: &Options) -> Options {
    Options {
        threads: o.threads,
        isa: o.isa,
        precision: o.precision,
        input_hint: o.input_hint,
        ..Options::default()
    }
}

impl DataPass {
    /// `fwd`: the forward convolution whose backward-data pass this is (its activation is
    /// ignored). `stride1_pads`: at stride 1, the padding (top, bottom, left, right) the
    /// forward convolution effectively has, a negative bottom/right meaning that many fewer
    /// rows/columns of the gradient than the padding gives.
    fn new(
        fwd: &ConvParams,
        stride1_pads: Option<[isize; 4]>,
        weights: &[f32],
        bias: Option<&[f32]>,
        activation: Activation,
        options: &Options,
    ) -> Result<Self> {
        let isa = match options.isa {
            Some(isa) => Isa::check(isa)?,
            None => Isa::default_level()?,
        };
        let depthwise = DwBackward::rejects(fwd)
            .is_none()
            .then(|| DwBackward::new(fwd, weights, isa));
        let multiplier = fwd.out_channels_per_group();
        let span = |i: usize| ((fwd.kernel[i] - 1) * fwd.dilation[i]) as isize;
        let forward_pads = stride1_pads
            .filter(|_| fwd.stride == [1, 1])
            .and_then(|[t, b, l, r]| {
                let (sh, sw) = (span(0), span(1));
                let pads = [sh - t, sh - b, sw - l, sw - r];
                pads.iter()
                    .all(|&p| p >= 0)
                    .then(|| pads.map(|p| p as usize))
            });
        let path = match forward_pads {
            Some([top, bottom, left, right]) if depthwise.is_none() || multiplier == 1 => {
                let (kh, kw) = (fwd.kernel[0], fwd.kernel[1]);
                let (cin_g, cout_g) = (fwd.in_channels_per_group(), multiplier);
                // W'[g·cin_g + ci][co][ky][kx] = W[g·cout_g + co][ci][kh-1-ky][kw-1-kx]
                let mut flipped = vec![0.0f32; weights.len()];
                for (i, v) in flipped.iter_mut().enumerate() {
                    let (kx, ky) = (i % kw, i / kw % kh);
                    let co = i / (kh * kw) % cout_g;
                    let cig = i / (kh * kw * cout_g);
                    let (grp, ci) = (cig / cin_g, cig % cin_g);
                    *v = weights[(((grp * cout_g + co) * cin_g + ci) * kh + kh - 1 - ky) * kw + kw
                        - 1
                        - kx];
                }
                let params = ConvParams {
                    in_channels: fwd.out_channels,
                    out_channels: fwd.in_channels,
                    stride: [1, 1],
                    padding: Padding::Explicit {
                        top,
                        bottom,
                        left,
                        right,
                    },
                    activation,
                    ..*fwd
                };
                DataPath::Forward(Conv2d::new(params, &flipped, bias, inner_options(options))?)
            }
            _ if depthwise.is_some() => DataPath::Depthwise,
            _ => DataPath::Col2im(Col2imData::new(fwd, weights, isa)?),
        };
        Ok(DataPass {
            path,
            depthwise,
            bias: bias.map(<[f32]>::to_vec),
            activation,
            threads: options.threads,
        })
    }

    fn kernel_name(&self) -> String {
        match &self.path {
            DataPath::Forward(c) => format!("forward/{}", c.algorithm()),
            DataPath::Depthwise => self
                .depthwise
                .as_ref()
                .map(|d| d.kernel_name())
                .unwrap_or_default(),
            DataPath::Col2im(c) => format!("col2im_gemm/{}", c.kernel_name()),
        }
    }

    /// `g`: the forward geometry (`h x w` the gradient's size, `oh x ow` the output's).
    fn plan(&self, g: &Geometry) -> Result<DataPlan> {
        let threads = crate::algo::workers(self.threads);
        Ok(match &self.path {
            DataPath::Forward(conv) => {
                let all = conv.plan(g.batch, g.oh, g.ow)?;
                let one = conv.plan(1, g.oh, g.ow)?;
                let [_, oh, ow] = match g.layout {
                    Layout::Nchw => [
                        all.output_shape()[1],
                        all.output_shape()[2],
                        all.output_shape()[3],
                    ],
                    Layout::Nhwc => [
                        all.output_shape()[3],
                        all.output_shape()[1],
                        all.output_shape()[2],
                    ],
                };
                if (oh, ow) != (g.h, g.w) {
                    return Err(Error::InvalidParameter {
                        what: "backward geometry",
                        detail: format!(
                            "the stride-1 backward convolution gives {oh}x{ow}, expected {}x{}",
                            g.h, g.w
                        ),
                    });
                }
                DataPlan::Forward {
                    all: Box::new(all),
                    one: Box::new(one),
                }
            }
            DataPath::Depthwise => match &self.depthwise {
                Some(d) => DataPlan::Depthwise(d.plan(g, threads)),
                None => unreachable!("the depthwise path is chosen only with depthwise weights"),
            },
            DataPath::Col2im(c) => DataPlan::Col2im(c.plan(g, threads)),
        })
    }

    /// The forward plan's error factor (Winograd's), else 1.
    fn error_factor(plan: &DataPlan) -> f64 {
        match plan {
            DataPlan::Forward { all, .. } => all.error_factor(),
            _ => 1.0,
        }
    }

    fn workspace_floats(plan: &DataPlan, g: &Geometry) -> usize {
        match plan {
            // Accumulation runs an image at a time into the workspace, then adds it.
            DataPlan::Forward { all, one } => {
                (all.workspace_bytes() / 4).max(one.workspace_bytes() / 4 + g.input_len() / g.batch)
            }
            DataPlan::Depthwise(p) => p.workspace_floats(),
            DataPlan::Col2im(p) => p.workspace_floats(),
        }
    }

    /// `dx (+)= act(backward_data(dy) + bias + residual)`, lengths checked by the caller.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        plan: &DataPlan,
        g: &Geometry,
        dy: &[f32],
        residual: Option<&[f32]>,
        dx: &mut [f32],
        accumulate: bool,
        scratch: &mut [f32],
    ) {
        let ep = Epilogue {
            bias: self.bias.as_deref(),
            residual,
            activation: self.activation,
        };
        match (&self.path, plan) {
            (DataPath::Forward(_), DataPlan::Forward { all, .. }) if !accumulate => {
                all.run_scratch(dy, residual, dx, scratch)
            }
            (DataPath::Forward(_), DataPlan::Forward { one, .. }) => {
                // Only gradients accumulate, and they have no epilogue.
                let (img_in, img_out) = (dy.len() / g.batch, dx.len() / g.batch);
                let (tmp, rest) = scratch.split_at_mut(img_out);
                for (x, y) in dx.chunks_exact_mut(img_out).zip(dy.chunks_exact(img_in)) {
                    one.run_scratch(y, None, tmp, rest);
                    x.iter_mut().zip(&*tmp).for_each(|(d, &t)| *d += t);
                }
            }
            (DataPath::Depthwise, DataPlan::Depthwise(p)) => match &self.depthwise {
                Some(d) => d.run_data(p, g, dy, dx, accumulate, ep, scratch),
                None => unreachable!("the depthwise path is chosen only with depthwise weights"),
            },
            (DataPath::Col2im(c), DataPlan::Col2im(p)) => {
                c.run(p, g, dy, dx, accumulate, ep, scratch)
            }
            _ => unreachable!("a plan is made by its pass's path"),
        }
    }
}

/// The backward passes of a convolution: `backward_data` (the input's gradient) and
/// `backward_weights` (the weights' and bias's gradients), for every shape the forward pass
/// takes. The gradient is of the convolution alone: `params.activation` must be `None` (apply
/// the activation's derivative to the output gradient first).
///
/// ```
/// use convkit::{Accumulate, ConvBackward, ConvParams, Options, Padding, Workspace};
///
/// let params = ConvParams::conv2d(4, 8, [3, 3]).with_padding(Padding::Same);
/// let weights = vec![0.1f32; 8 * 4 * 3 * 3];
/// let conv = ConvBackward::new(params, &weights, Options::default())?;
/// let plan = conv.plan(2, 16, 16)?;
/// let (x, dy) = (vec![1.0f32; plan.input_len()], vec![1.0f32; plan.output_len()]);
/// let mut ws = Workspace::new();
///
/// let mut dx = vec![0.0f32; plan.input_len()];
/// plan.backward_data(&dy, &mut dx, Accumulate::Overwrite, &mut ws)?;
/// assert!((dx[5 * 16 + 5] - 8.0 * 9.0 * 0.1).abs() < 1e-4); // an interior pixel
///
/// let (mut dw, mut db) = (vec![0.0f32; weights.len()], vec![0.0f32; 8]);
/// plan.backward_weights(&x, &dy, &mut dw, Some(&mut db), Accumulate::Overwrite, &mut ws)?;
/// assert_eq!(db[0], 2.0 * 16.0 * 16.0);
/// # Ok::<(), convkit::Error>(())
/// ```
#[derive(Clone)]
pub struct ConvBackward {
    inner: Arc<BackwardInner>,
}

struct BackwardInner {
    params: ConvParams,
    data: DataPass,
    weights: WeightPath,
    threads: usize,
}

enum WeightPath {
    /// The tap GEMMs, and Winograd F(3, m) where it applies (3x3 stride 1) and its plan fits.
    Gemm(WeightGrad, Option<WinoWeightGrad>),
    /// The depthwise kernels, with the backward-data pass's `DwBackward`.
    Depthwise,
    /// The NCHW per-channel kernel for groups of few channels (ResNeXt's 4 a group), where a
    /// GEMM per tap would be a few rows and columns of a register tile.
    Direct(DwBackward),
}

/// The most input channels a group for which NCHW weight gradients at horizontal stride 1 or
/// 2 run the per-channel kernel instead of the GEMMs (`convkit bench --pass
/// backward-weights`, one thread, AVX-512, GFLOP/s GEMM / per-channel: ResNeXt's 4-channel
/// groups 1.4 / 16, the 7x7 stride-2 stem 5.8 / 18; strides 4 and 5 lose).
const DIRECT_MAX_CIN: usize = 8;

impl ConvBackward {
    /// Validates `params` (the forward convolution, activation `None`) and `weights` (OIHW) and
    /// packs the weights for the backward-data pass.
    pub fn new(params: ConvParams, weights: &[f32], options: Options) -> Result<Self> {
        params.validate()?;
        params.check_weights_and_bias(weights.len(), None)?;
        if params.activation != Activation::None {
            return Err(Error::InvalidParameter {
                what: "activation",
                detail: format!(
                    "{:?}: the backward passes are of the convolution alone; apply the \
                     activation's derivative to the output gradient first",
                    params.activation
                ),
            });
        }
        let isa = match options.isa {
            Some(isa) => Isa::check(isa)?,
            None => Isa::default_level()?,
        };
        // At stride 1 the padding does not depend on the input size: resolve it on any input.
        let stride1_pads = (params.stride == [1, 1])
            .then(|| {
                let span = |i: usize| (params.kernel[i] - 1) * params.dilation[i] + 1;
                params.geometry(1, span(0), span(1)).ok()
            })
            .flatten()
            .map(|g| [g.pad_top, g.pad_bottom, g.pad_left, g.pad_right].map(|p| p as isize));
        let data = DataPass::new(
            &params,
            stride1_pads,
            weights,
            None,
            Activation::None,
            &options,
        )?;
        let weights = match DwBackward::rejects(&params) {
            None => WeightPath::Depthwise,
            Some(_)
                if params.layout == Layout::Nchw
                    && params.in_channels_per_group() <= DIRECT_MAX_CIN
                    && params.stride[1] <= 2 =>
            {
                WeightPath::Direct(DwBackward::new(&params, weights, isa))
            }
            Some(_) => WeightPath::Gemm(
                WeightGrad::new(isa),
                WinoWeightGrad::new(&params, isa, options.precision),
            ),
        };
        Ok(ConvBackward {
            inner: Arc::new(BackwardInner {
                params,
                data,
                weights,
                threads: options.threads,
            }),
        })
    }

    /// The forward convolution's parameters.
    pub fn params(&self) -> &ConvParams {
        &self.inner.params
    }

    /// Fixes the (forward) input size.
    pub fn plan(&self, batch: usize, in_h: usize, in_w: usize) -> Result<BackwardPlan> {
        let inner = &self.inner;
        let geometry = inner.params.geometry(batch, in_h, in_w)?;
        let data = inner.data.plan(&geometry)?;
        let weights = match &inner.weights {
            WeightPath::Gemm(w, wino) => {
                let threads = crate::algo::workers(inner.threads);
                match wino.as_ref().and_then(|wg| wg.plan(&geometry, threads)) {
                    Some(p) => WeightPlan::Winograd(p),
                    None => WeightPlan::Gemm(w.plan(&geometry, threads)),
                }
            }
            WeightPath::Direct(d) => {
                WeightPlan::Depthwise(d.plan(&geometry, crate::algo::workers(inner.threads)))
            }
            WeightPath::Depthwise => match &inner.data.depthwise {
                Some(d) => {
                    WeightPlan::Depthwise(d.plan(&geometry, crate::algo::workers(inner.threads)))
                }
                None => unreachable!("depthwise weights are packed for depthwise convolutions"),
            },
        };
        Ok(BackwardPlan {
            inner: self.inner.clone(),
            geometry,
            data: Arc::new(data),
            weights,
        })
    }
}

#[derive(Clone)]
enum WeightPlan {
    Gemm(WeightGradPlan),
    Winograd(WinoWeightPlan),
    Depthwise(DwBackwardPlan),
}

/// The backward passes planned for one input size. Running them allocates nothing once the
/// workspace holds `workspace_bytes()`.
#[derive(Clone)]
pub struct BackwardPlan {
    inner: Arc<BackwardInner>,
    geometry: Geometry,
    data: Arc<DataPlan>,
    weights: WeightPlan,
}

impl BackwardPlan {
    /// The forward geometry: input size, padding, output size.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Elements of the input (and of its gradient).
    pub fn input_len(&self) -> usize {
        self.geometry.input_len()
    }

    /// Elements of the output gradient.
    pub fn output_len(&self) -> usize {
        self.geometry.output_len()
    }

    /// Bytes of workspace either pass needs.
    pub fn workspace_bytes(&self) -> usize {
        4 * DataPass::workspace_floats(&self.data, &self.geometry).max(self.weights_floats())
    }

    /// How many times a plain sum of products' rounding error `backward_data` may carry (see
    /// [`Plan::error_factor`]).
    pub fn error_factor(&self) -> f64 {
        DataPass::error_factor(&self.data)
    }

    /// The same for `backward_weights`: 1 where it sums plainly, more where it runs Winograd
    /// (as [`Plan::error_factor`] for the tile size; [`Precision::Exact`](crate::Precision)
    /// in the options never does).
    pub fn weights_error_factor(&self) -> f64 {
        match &self.weights {
            WeightPlan::Winograd(p) => p.error_factor(),
            _ => 1.0,
        }
    }

    fn weights_floats(&self) -> usize {
        match &self.weights {
            WeightPlan::Gemm(p) => p.workspace_floats(&self.geometry),
            WeightPlan::Winograd(p) => p.workspace_floats(),
            WeightPlan::Depthwise(p) => p.workspace_floats(),
        }
    }

    /// Which path and kernel each pass runs, e.g. `data: forward/winograd; weights:
    /// tap_gemm/gemm_f32_6x16_avx2`.
    pub fn kernel_name(&self) -> String {
        let inner = &self.inner;
        let weights = match (&inner.weights, &self.weights) {
            (WeightPath::Gemm(_, Some(wg)), WeightPlan::Winograd(p)) => p.kernel_name(wg.gemm()),
            (WeightPath::Gemm(w, _), WeightPlan::Gemm(p)) if p.patches() => {
                format!("patch_gemm/{}", w.kernel_name())
            }
            (WeightPath::Gemm(w, _), _) => format!("tap_gemm/{}", w.kernel_name()),
            (WeightPath::Direct(d), _) => d.kernel_name(),
            (WeightPath::Depthwise, _) => inner
                .data
                .depthwise
                .as_ref()
                .map(|d| d.kernel_name())
                .unwrap_or_default(),
        };
        format!("data: {}; weights: {weights}", inner.data.kernel_name())
    }

    /// Flops of either pass (2 per multiply-add, as for the forward pass).
    pub fn flops(&self) -> f64 {
        self.geometry.flops()
    }

    /// The input's gradient: `grad_input (+)= convᵀ(grad_output)`.
    pub fn backward_data(
        &self,
        grad_output: &[f32],
        grad_input: &mut [f32],
        accumulate: Accumulate,
        ws: &mut Workspace,
    ) -> Result<()> {
        crate::error::check_lengths(&[
            ("grad_output", self.output_len(), Some(grad_output.len())),
            ("grad_input", self.input_len(), Some(grad_input.len())),
        ])?;
        let scratch = ws.floats(self.workspace_bytes() / 4)?;
        self.inner.data.run(
            &self.data,
            &self.geometry,
            grad_output,
            None,
            grad_input,
            accumulate == Accumulate::Add,
            scratch,
        );
        Ok(())
    }

    /// The weights' gradient (OIHW, like the weights) and, if asked, the bias's:
    /// `grad_weights (+)= Σ grad_output ⊗ patches(input)`, `grad_bias (+)= Σ grad_output`.
    pub fn backward_weights(
        &self,
        input: &[f32],
        grad_output: &[f32],
        grad_weights: &mut [f32],
        grad_bias: Option<&mut [f32]>,
        accumulate: Accumulate,
        ws: &mut Workspace,
    ) -> Result<()> {
        let g = &self.geometry;
        crate::error::check_lengths(&[
            ("input", self.input_len(), Some(input.len())),
            ("grad_output", self.output_len(), Some(grad_output.len())),
            (
                "grad_weights",
                self.inner.params.weights_len()?,
                Some(grad_weights.len()),
            ),
            ("grad_bias", g.c_out, grad_bias.as_ref().map(|b| b.len())),
        ])?;
        let scratch = ws.floats(self.workspace_bytes() / 4)?;
        let add = accumulate == Accumulate::Add;
        let (x, dy, dw, db) = (input, grad_output, grad_weights, grad_bias);
        // The depthwise kernels sum the bias gradient themselves (from output-gradient planes
        // they read anyway, where they can); the others leave it to one pass at the end.
        let db = match (&self.inner.weights, &self.weights) {
            (WeightPath::Direct(d), WeightPlan::Depthwise(p)) => {
                d.run_weights(p, g, x, dy, dw, db, add, scratch);
                return Ok(());
            }
            (WeightPath::Depthwise, WeightPlan::Depthwise(p)) => {
                let Some(d) = &self.inner.data.depthwise else {
                    unreachable!("depthwise weights are packed for depthwise convolutions")
                };
                d.run_weights(p, g, x, dy, dw, db, add, scratch);
                return Ok(());
            }
            (WeightPath::Gemm(w, _), WeightPlan::Gemm(p)) => {
                w.run(p, g, x, dy, dw, add, scratch);
                db
            }
            (WeightPath::Gemm(_, Some(wg)), WeightPlan::Winograd(p)) => {
                wg.run(p, g, x, dy, dw, add, scratch);
                db
            }
            _ => unreachable!("a plan is made by its pass's path"),
        };
        if let Some(db) = db {
            backward_gemm::grad_bias(g, dy, db, add);
        }
        Ok(())
    }
}

/// A transposed convolution (PyTorch's `ConvTranspose2d`, ONNX's `ConvTranspose`): the
/// backward-data pass of the convolution with the channels swapped, plus output padding and the
/// fused epilogue (bias, residual, activation).
///
/// `params` describe the transposed convolution itself: `in_channels` are its input's,
/// `out_channels` its output's; weights are `in_channels x out_channels/groups x kh x kw`
/// (PyTorch's layout). Output size per axis: `(in - 1)·stride - pad_begin - pad_end +
/// dilation·(k - 1) + output_padding + 1`; `Padding::Same`/`SameLower` make it `in·stride`
/// as ONNX's auto_pad does.
///
/// ```
/// use convkit::{ConvParams, ConvTranspose2d, Options, Padding, Workspace};
///
/// // A 2x upsampling decoder layer: 8 -> 4 channels, 4x4 kernel, stride 2, padding 1.
/// let params = ConvParams::conv2d(8, 4, [4, 4]).with_stride([2, 2]).with_padding(Padding::uniform(1));
/// let weights = vec![0.05f32; 8 * 4 * 4 * 4];
/// let up = ConvTranspose2d::new(params, [0, 0], &weights, None, Options::default())?;
/// let plan = up.plan(1, 10, 10)?;
/// assert_eq!(plan.output_shape(), [1, 4, 20, 20]);
/// let x = vec![1.0f32; plan.input_len()];
/// let mut y = vec![0.0f32; plan.output_len()];
/// plan.run(&x, &mut y, &mut Workspace::new())?;
/// # Ok::<(), convkit::Error>(())
/// ```
#[derive(Clone)]
pub struct ConvTranspose2d {
    inner: Arc<TransposeInner>,
}

struct TransposeInner {
    params: ConvParams,
    output_padding: [usize; 2],
    /// The convolution whose backward-data pass this is.
    fwd: ConvParams,
    data: DataPass,
}

impl ConvTranspose2d {
    /// Validates `params`, `output_padding` (each below the stride or the dilation, as PyTorch
    /// requires), `weights` and `bias`, and packs the weights.
    pub fn new(
        params: ConvParams,
        output_padding: [usize; 2],
        weights: &[f32],
        bias: Option<&[f32]>,
        options: Options,
    ) -> Result<Self> {
        params.validate()?;
        for (i, axis) in ["height", "width"].into_iter().enumerate() {
            if output_padding[i] >= params.stride[i].max(params.dilation[i]) {
                return Err(Error::InvalidParameter {
                    what: "output padding",
                    detail: format!(
                        "{axis} {} must be less than the stride ({}) or the dilation ({})",
                        output_padding[i], params.stride[i], params.dilation[i]
                    ),
                });
            }
        }
        let fwd = ConvParams {
            in_channels: params.out_channels,
            out_channels: params.in_channels,
            padding: Padding::Valid,
            activation: Activation::None,
            ..params
        };
        fwd.check_weights_and_bias(weights.len(), None)?;
        crate::error::check_lengths(&[("bias", params.out_channels, bias.map(<[f32]>::len))])?;
        // At stride 1 the padding is known now: resolve it for any input length.
        let stride1_pads = (params.stride == [1, 1]).then(|| {
            let [t, b] = transpose_pads(&params, output_padding, 0, 1).unwrap_or([0, 0]);
            let [l, r] = transpose_pads(&params, output_padding, 1, 1).unwrap_or([0, 0]);
            [
                t,
                b - output_padding[0] as isize,
                l,
                r - output_padding[1] as isize,
            ]
        });
        let data = DataPass::new(
            &fwd,
            stride1_pads,
            weights,
            bias,
            params.activation,
            &options,
        )?;
        Ok(ConvTranspose2d {
            inner: Arc::new(TransposeInner {
                params,
                output_padding,
                fwd,
                data,
            }),
        })
    }

    /// The transposed convolution's parameters.
    pub fn params(&self) -> &ConvParams {
        &self.inner.params
    }

    /// Fixes the input size: output shape and workspace.
    pub fn plan(&self, batch: usize, in_h: usize, in_w: usize) -> Result<TransposePlan> {
        let inner = &self.inner;
        let (p, op) = (&inner.params, inner.output_padding);
        for (what, v) in [
            ("batch", batch),
            ("input height", in_h),
            ("input width", in_w),
        ] {
            if v == 0 {
                return Err(Error::Zero { what });
            }
        }
        let [pt, pb] = transpose_pads(p, op, 0, in_h)?;
        let [pl, pr] = transpose_pads(p, op, 1, in_w)?;
        let out = |i: usize, input: usize, pads: isize| -> Result<usize> {
            let span = (p.kernel[i] - 1) * p.dilation[i] + 1;
            let what = if i == 0 {
                "output height"
            } else {
                "output width"
            };
            let full = (input - 1)
                .checked_mul(p.stride[i])
                .and_then(|v| v.checked_add(span + op[i]))
                .filter(|&v| v <= isize::MAX as usize / 2)
                .ok_or(Error::Overflow { what })?;
            match usize::try_from(full as isize - pads) {
                Ok(v) if v > 0 => Ok(v),
                _ => Err(Error::InvalidParameter {
                    what,
                    detail: format!("padding {pads} leaves nothing of {full}"),
                }),
            }
        };
        let (h, w) = (out(0, in_h, pt + pb)?, out(1, in_w, pl + pr)?);
        // The forward convolution that maps the output back to the input: its geometry.
        let fwd = &inner.fwd;
        let g = Geometry {
            batch,
            c_in: fwd.in_channels,
            h,
            w,
            c_out: fwd.out_channels,
            groups: fwd.groups,
            kh: fwd.kernel[0],
            kw: fwd.kernel[1],
            sh: fwd.stride[0],
            sw: fwd.stride[1],
            dh: fwd.dilation[0],
            dw: fwd.dilation[1],
            pad_top: pt as usize,
            pad_bottom: pb.max(0) as usize,
            pad_left: pl as usize,
            pad_right: pr.max(0) as usize,
            oh: in_h,
            ow: in_w,
            layout: fwd.layout,
        };
        let limit = isize::MAX as usize / 8;
        for (what, len) in [
            (
                "input",
                batch
                    .checked_mul(p.in_channels)
                    .and_then(|v| v.checked_mul(in_h * in_w)),
            ),
            (
                "output",
                batch
                    .checked_mul(p.out_channels)
                    .and_then(|v| v.checked_mul(h))
                    .and_then(|v| v.checked_mul(w)),
            ),
        ] {
            match len {
                Some(l) if l <= limit => {}
                _ => return Err(Error::Overflow { what }),
            }
        }
        let data = inner.data.plan(&g)?;
        Ok(TransposePlan {
            inner: self.inner.clone(),
            geometry: g,
            data: Arc::new(data),
        })
    }
}

/// The padding (begin, end) of axis `i` for an input of `input`: explicit, or ONNX's auto_pad
/// for `ConvTranspose` (output `input·stride`; `Same` puts the odd pixel at the end).
fn transpose_pads(p: &ConvParams, op: [usize; 2], i: usize, input: usize) -> Result<[isize; 2]> {
    let pads = match p.padding {
        Padding::Explicit {
            top,
            bottom,
            left,
            right,
        } => {
            if i == 0 {
                [top, bottom]
            } else {
                [left, right]
            }
        }
        Padding::Valid => [0, 0],
        Padding::Same | Padding::SameLower => {
            let span = (p.kernel[i] - 1) * p.dilation[i] + 1;
            let overflow = Error::Overflow {
                what: "output size",
            };
            let target = input.checked_mul(p.stride[i]).ok_or(overflow.clone())?;
            let full = (target - p.stride[i])
                .checked_add(op[i] + span)
                .ok_or(overflow)?;
            let total = full
                .checked_sub(target)
                .ok_or_else(|| Error::InvalidParameter {
                    what: "padding",
                    detail: format!(
                        "auto padding cannot make the output {target} (stride x input) from {full}"
                    ),
                })?;
            let (small, large) = (total / 2, total - total / 2);
            if p.padding == Padding::Same {
                [small, large]
            } else {
                [large, small]
            }
        }
    };
    if pads.iter().any(|&v| v > isize::MAX as usize / 2) {
        return Err(Error::Overflow { what: "padding" });
    }
    Ok(pads.map(|v| v as isize))
}

/// A transposed convolution planned for one input size.
#[derive(Clone)]
pub struct TransposePlan {
    inner: Arc<TransposeInner>,
    /// The geometry of the forward convolution this is the backward of (its `h x w` is the
    /// output here, its `oh x ow` the input).
    geometry: Geometry,
    data: Arc<DataPlan>,
}

impl TransposePlan {
    /// Output shape in the layout's order (NCHW or NHWC).
    pub fn output_shape(&self) -> [usize; 4] {
        let g = &self.geometry;
        match g.layout {
            Layout::Nchw => [g.batch, g.c_in, g.h, g.w],
            Layout::Nhwc => [g.batch, g.h, g.w, g.c_in],
        }
    }

    /// Elements of the input.
    pub fn input_len(&self) -> usize {
        self.geometry.output_len()
    }

    /// Elements of the output (and residual).
    pub fn output_len(&self) -> usize {
        self.geometry.input_len()
    }

    /// Bytes of workspace `run` needs.
    pub fn workspace_bytes(&self) -> usize {
        4 * DataPass::workspace_floats(&self.data, &self.geometry)
    }

    /// The path and kernel that run, e.g. `col2im_gemm/gemm_f32_6x16_avx2`.
    pub fn kernel_name(&self) -> String {
        self.inner.data.kernel_name()
    }

    /// Flops (2 per multiply-add of the definition).
    pub fn flops(&self) -> f64 {
        self.geometry.flops()
    }

    /// How many times a plain sum of products' rounding error the result may carry (see
    /// [`Plan::error_factor`]).
    pub fn error_factor(&self) -> f64 {
        DataPass::error_factor(&self.data)
    }

    /// `output = act(convᵀ(input) + bias)`.
    pub fn run(&self, input: &[f32], output: &mut [f32], ws: &mut Workspace) -> Result<()> {
        self.run_inner(input, None, output, ws)
    }

    /// `output = act(convᵀ(input) + bias + residual)`; `residual` has the output's shape.
    pub fn run_with_residual(
        &self,
        input: &[f32],
        residual: &[f32],
        output: &mut [f32],
        ws: &mut Workspace,
    ) -> Result<()> {
        self.run_inner(input, Some(residual), output, ws)
    }

    fn run_inner(
        &self,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
        ws: &mut Workspace,
    ) -> Result<()> {
        crate::error::check_lengths(&[
            ("input", self.input_len(), Some(input.len())),
            ("output", self.output_len(), Some(output.len())),
            ("residual", self.output_len(), residual.map(<[f32]>::len)),
        ])?;
        let scratch = ws.floats(self.workspace_bytes() / 4)?;
        self.inner.data.run(
            &self.data,
            &self.geometry,
            input,
            residual,
            output,
            false,
            scratch,
        );
        Ok(())
    }
}

/// A 1-D transposed convolution: a thin front over [`ConvTranspose2d`] with height 1.
/// Weights are `in x out/groups x kernel`; tensors are NCW (or NWC with `Layout::Nhwc`).
#[derive(Clone)]
pub struct ConvTranspose1d {
    conv: ConvTranspose2d,
}

impl ConvTranspose1d {
    /// `params` must describe a 1-D convolution (`ConvParams::conv1d`).
    pub fn new(
        params: ConvParams,
        output_padding: usize,
        weights: &[f32],
        bias: Option<&[f32]>,
        options: Options,
    ) -> Result<Self> {
        crate::conv::check_1d(&params)?;
        Ok(ConvTranspose1d {
            conv: ConvTranspose2d::new(params, [0, output_padding], weights, bias, options)?,
        })
    }

    /// Fixes the input length.
    pub fn plan(&self, batch: usize, length: usize) -> Result<TransposePlan> {
        self.conv.plan(batch, 1, length)
    }
}
