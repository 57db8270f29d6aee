//! `Plan`: a convolution with its input size fixed; `run` checks lengths and runs.

use crate::algo::depthwise::{Depthwise, DwPlan};
use crate::algo::direct::DirectPlan;
use crate::algo::im2col_gemm::GemmPlan;
use crate::algo::winograd::WinoPlan;
use crate::algo::Algorithm;
use crate::conv::{ConvInner, Packed};
use crate::params::Geometry;
use crate::storage::{Bands, Storage, StorageType};
use crate::{Layout, Result, Workspace};
use std::sync::Arc;

pub(crate) enum AlgoPlan {
    Im2colGemm(GemmPlan),
    Depthwise(DwPlan),
    Direct(DirectPlan),
    Winograd(WinoPlan),
}

impl AlgoPlan {
    /// Scratch floats the f32 run needs.
    pub(crate) fn workspace_floats(&self) -> usize {
        match self {
            AlgoPlan::Im2colGemm(p) => p.workspace_floats(),
            AlgoPlan::Depthwise(p) => p.workspace_floats(),
            AlgoPlan::Direct(_) => 0,
            AlgoPlan::Winograd(p) => p.workspace_floats(),
        }
    }
}

/// A convolution planned for one input size. Running it allocates nothing once the
/// workspace holds `workspace_bytes()`.
///
/// ```
/// use convkit::{Conv2d, ConvParams, Options, Padding, Workspace};
///
/// let conv = Conv2d::new(
///     ConvParams::conv2d(16, 16, [3, 3]).with_padding(Padding::Same),
///     &vec![0.0; 16 * 16 * 9],
///     None,
///     Options::default(),
/// )?;
/// // One plan per input size; plans are cheap to clone and share between threads.
/// let plan = conv.plan(2, 20, 30)?;
/// assert_eq!(plan.output_shape(), [2, 16, 20, 30]);
/// println!("{} needs {} bytes of scratch", plan.kernel_name(), plan.workspace_bytes());
/// let mut ws = Workspace::with_bytes(plan.workspace_bytes())?; // no allocation in run
/// let (x, residual) = (vec![1.0; plan.input_len()], vec![2.0; plan.output_len()]);
/// let mut y = vec![0.0; plan.output_len()];
/// plan.run_with_residual(&x, &residual, &mut y, &mut ws)?; // zero weights: y = residual
/// assert!(y.iter().all(|&v| v == 2.0));
/// # Ok::<(), convkit::Error>(())
/// ```
#[derive(Clone)]
pub struct Plan {
    conv: Arc<ConvInner>,
    geometry: Geometry,
    algo: Arc<AlgoPlan>,
    /// How 16-bit tensors run where the algorithm does not read them itself.
    bands: Arc<Bands<AlgoPlan>>,
}

impl Plan {
    pub(crate) fn new(
        conv: Arc<ConvInner>,
        geometry: Geometry,
        algo: AlgoPlan,
        bands: Bands<AlgoPlan>,
    ) -> Self {
        Plan {
            conv,
            geometry,
            algo: Arc::new(algo),
            bands: Arc::new(bands),
        }
    }

    /// Input size, padding and output size.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Output shape in the convolution's layout order (NCHW or NHWC).
    pub fn output_shape(&self) -> [usize; 4] {
        let g = &self.geometry;
        match g.layout {
            Layout::Nchw => [g.batch, g.c_out, g.oh, g.ow],
            Layout::Nhwc => [g.batch, g.oh, g.ow, g.c_out],
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
        4 * self.algo.workspace_floats()
    }

    /// Bytes of workspace [`run_storage`](Self::run_storage) needs with input type `I` and
    /// output type `O` (`workspace_bytes()` when both are f32).
    pub fn storage_workspace_bytes<I: Storage, O: Storage>(&self) -> usize {
        4 * self.storage_workspace_floats(I::TYPE, O::TYPE)
    }

    fn storage_workspace_floats(&self, i: StorageType, o: StorageType) -> usize {
        match self.native(i, o) {
            Some(floats) => floats,
            None => self.bands.workspace_floats(),
        }
    }

    /// `Some(scratch floats)` when the algorithm reads and writes tensors of types `i` and `o`
    /// itself (f32, and the depthwise kernels' 16-bit types); `None`: the bands convert.
    fn native(&self, i: StorageType, o: StorageType) -> Option<usize> {
        match (&self.conv.packed, &*self.algo) {
            _ if i == StorageType::F32 && o == StorageType::F32 => {
                Some(self.algo.workspace_floats())
            }
            (Packed::Depthwise(a), AlgoPlan::Depthwise(p)) => {
                a.half_workspace_floats(p, i, o, self.conv.params.activation)
            }
            _ => None,
        }
    }

    /// The algorithm that runs.
    pub fn algorithm(&self) -> Algorithm {
        self.conv.algorithm
    }

    /// The algorithm and the kernel that runs, e.g. `im2col_gemm/gemm_f32_6x16_avx2`.
    pub fn kernel_name(&self) -> String {
        let kernel = match (&self.conv.packed, &*self.algo) {
            (Packed::Depthwise(_), AlgoPlan::Depthwise(p)) => Depthwise::kernel_name(p),
            (Packed::Im2colGemm(a), _) => a.kernel_name().to_string(),
            (Packed::Direct(a), _) => a.kernel_name().to_string(),
            (Packed::Winograd(a), _) => a.kernel_name(),
            (Packed::Depthwise(_), _) => unreachable!("a depthwise convolution plans a DwPlan"),
        };
        format!("{}/{}", self.conv.algorithm, kernel)
    }

    /// The kernel that runs [`run_storage`](Self::run_storage) with input type `I` and output
    /// type `O`: `kernel_name()` where the algorithm reads those types itself, else
    /// `bands+` and the f32 kernel that runs on the converted bands.
    pub fn storage_kernel_name<I: Storage, O: Storage>(&self) -> String {
        match (&self.conv.packed, &*self.algo) {
            (Packed::Depthwise(a), AlgoPlan::Depthwise(p))
                if self.native(I::TYPE, O::TYPE).is_some() =>
            {
                format!(
                    "{}/{}",
                    self.conv.algorithm,
                    a.half_kernel_name(p, I::TYPE, O::TYPE, self.conv.params.activation)
                )
            }
            _ if self.native(I::TYPE, O::TYPE).is_some() => self.kernel_name(),
            _ => format!("bands+{}", self.kernel_name()),
        }
    }

    /// How many times a plain sum of products' rounding error this plan's results may carry:
    /// 1, except for Winograd, whose transforms amplify rounding
    /// ([`winograd::ERROR_FACTOR`](crate::winograd::ERROR_FACTOR)). Tests scale
    /// [`Reference::tolerance`](crate::reference::Reference::tolerance) by it.
    pub fn error_factor(&self) -> f64 {
        match &self.conv.packed {
            Packed::Winograd(a) => a.error_factor(),
            _ => 1.0,
        }
    }

    /// Direct-convolution flops (2 per multiply-add), the convention of GFLOP/s figures.
    pub fn flops(&self) -> f64 {
        self.geometry.flops()
    }

    /// `output = act(conv(input) + bias)`.
    pub fn run(&self, input: &[f32], output: &mut [f32], workspace: &mut Workspace) -> Result<()> {
        self.run_inner(input, None, output, workspace)
    }

    /// `output = act(conv(input) + bias + residual)`; `residual` has the output's shape.
    pub fn run_with_residual(
        &self,
        input: &[f32],
        residual: &[f32],
        output: &mut [f32],
        workspace: &mut Workspace,
    ) -> Result<()> {
        self.run_inner(input, Some(residual), output, workspace)
    }

    /// `output = act(conv(input) + bias)` on tensors stored as `I` and `O`: any of `f32`,
    /// [`half::f16`], [`half::bf16`] (typically `O` is `I`, or f32). Arithmetic is f32: inputs
    /// are widened exactly where the kernels read them, outputs rounded (to nearest, ties to
    /// even) where they are stored. Allocates nothing once `workspace` holds
    /// [`storage_workspace_bytes::<I, O>()`](Self::storage_workspace_bytes).
    pub fn run_storage<I: Storage, O: Storage>(
        &self,
        input: &[I],
        output: &mut [O],
        workspace: &mut Workspace,
    ) -> Result<()> {
        self.run_storage_inner(input, None, output, workspace)
    }

    /// As [`run_storage`](Self::run_storage), with `residual` (the output's shape and type)
    /// added before the activation.
    pub fn run_storage_with_residual<I: Storage, O: Storage>(
        &self,
        input: &[I],
        residual: &[O],
        output: &mut [O],
        workspace: &mut Workspace,
    ) -> Result<()> {
        self.run_storage_inner(input, Some(residual), output, workspace)
    }

    fn run_storage_inner<I: Storage, O: Storage>(
        &self,
        input: &[I],
        residual: Option<&[O]>,
        output: &mut [O],
        ws: &mut Workspace,
    ) -> Result<()> {
        if I::TYPE == StorageType::F32 && O::TYPE == StorageType::F32 {
            return self.run_inner(
                bytemuck::cast_slice(input),
                residual.map(bytemuck::cast_slice),
                bytemuck::cast_slice_mut(output),
                ws,
            );
        }
        let checks = [
            ("input", self.input_len(), Some(input.len())),
            ("output", self.output_len(), Some(output.len())),
            ("residual", self.output_len(), residual.map(|r| r.len())),
        ];
        crate::error::check_lengths(&checks)?;
        let scratch = ws.floats(self.storage_workspace_floats(I::TYPE, O::TYPE))?;
        let c = &*self.conv;
        let g = &self.geometry;
        if self.native(I::TYPE, O::TYPE).is_some() {
            if let (Packed::Depthwise(a), AlgoPlan::Depthwise(p)) = (&c.packed, &*self.algo) {
                a.run_half(p, g, input, residual, output, c.params.activation, scratch);
                return Ok(());
            }
        }
        self.bands.run(
            g,
            input,
            residual,
            output,
            c.bias.as_deref(),
            c.params.activation,
            scratch,
            |p, gb, x, r, y, s| run_algo(c, p, gb, x, r, y, s),
        );
        Ok(())
    }

    fn run_inner(
        &self,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
        ws: &mut Workspace,
    ) -> Result<()> {
        let checks = [
            ("input", self.input_len(), Some(input.len())),
            ("output", self.output_len(), Some(output.len())),
            ("residual", self.output_len(), residual.map(|r| r.len())),
        ];
        crate::error::check_lengths(&checks)?;
        let scratch = ws.floats(self.workspace_bytes() / 4)?;
        self.run_scratch(input, residual, output, scratch);
        Ok(())
    }

    /// Runs with `scratch` (at least `workspace_bytes() / 4` floats) on slices whose lengths
    /// were checked.
    pub(crate) fn run_scratch(
        &self,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
        scratch: &mut [f32],
    ) {
        run_algo(
            &self.conv,
            &self.algo,
            &self.geometry,
            input,
            residual,
            output,
            scratch,
        );
    }
}

/// Runs the f32 algorithm of `c`, planned as `algo`, on tensors of geometry `g`.
fn run_algo(
    c: &ConvInner,
    algo: &AlgoPlan,
    g: &Geometry,
    input: &[f32],
    residual: Option<&[f32]>,
    output: &mut [f32],
    scratch: &mut [f32],
) {
    let bias = c.bias.as_deref();
    let act = c.params.activation;
    match (&c.packed, algo) {
        (Packed::Im2colGemm(a), AlgoPlan::Im2colGemm(p)) => {
            a.run(p, g, input, residual, output, bias, act, scratch)
        }
        (Packed::Depthwise(a), AlgoPlan::Depthwise(p)) => {
            a.run(p, g, input, residual, output, act, scratch)
        }
        (Packed::Direct(a), AlgoPlan::Direct(p)) => a.run(p, g, input, residual, output, act),
        (Packed::Winograd(a), AlgoPlan::Winograd(p)) => {
            a.run(p, g, input, residual, output, act, scratch)
        }
        _ => unreachable!("a plan is made by its convolution's algorithm"),
    }
}
