//! The wgpu path (feature `gpu`): the same convolutions as the CPU path, on a GPU, for parity.
//!
//! [`GpuContext`] picks an adapter; [`GpuConv2d`] (and [`GpuConv1d`]) are built from the same
//! [`ConvParams`], OIHW weights and bias as [`crate::Conv2d`] and upload the weights once;
//! [`GpuConv2d::plan`] fixes the input size and sizes the buffers; a plan runs on host slices
//! ([`GpuPlan::run`]: upload, dispatch, read back) or on [`GpuTensor`]s the caller keeps on
//! the device ([`GpuPlan::run_device`]: no copies between layers). Dense and grouped layers
//! run `implicit_gemm.wgsl` (a tiled GEMM over workgroup memory that gathers the input taps
//! itself, so no im2col buffer exists); depthwise layers run `depthwise.wgsl`. Both fuse the
//! CPU path's epilogue (bias, residual, activation).
//!
//! Errors are typed as on the CPU: sizes beyond the adapter's limits are refused at plan
//! time, and wgpu's validation and out-of-memory errors are caught in error scopes and
//! returned as [`Error::Gpu`], never a panic.

use crate::conv::check_1d;
use crate::error::check_lengths;
use crate::{Activation, ConvParams, Error, Geometry, Layout, Result};
use wgpu::util::DeviceExt;

/// Which adapter [`GpuContext::with_adapter`] takes.
#[derive(Clone, Debug, Default)]
pub enum AdapterChoice {
    /// wgpu's choice for high performance (a discrete GPU before an integrated one; a
    /// software driver when nothing else exists).
    #[default]
    Default,
    /// The first adapter of these backends (e.g. `wgpu::Backends::VULKAN`).
    Backend(wgpu::Backends),
    /// The first adapter whose name contains this text (case-insensitive), e.g. "llvmpipe".
    Name(String),
}

/// A GPU device and its queue. Cheap to clone (wgpu's handles are shared).
#[derive(Clone, Debug)]
pub struct GpuContext {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    timestamps: bool,
}

fn instance() -> wgpu::Instance {
    wgpu::Instance::new(&wgpu::InstanceDescriptor::from_env_or_default())
}

impl GpuContext {
    /// Every adapter wgpu finds on this machine, for `convkit info` and for choosing.
    pub fn adapters() -> Vec<wgpu::AdapterInfo> {
        instance()
            .enumerate_adapters(wgpu::Backends::all())
            .iter()
            .map(|a| a.get_info())
            .collect()
    }

    /// The default adapter ([`AdapterChoice::Default`]).
    pub fn new() -> Result<Self> {
        Self::with_adapter(AdapterChoice::Default)
    }

    /// The adapter `choice` names; [`Error::NoGpu`] when there is none.
    pub fn with_adapter(choice: AdapterChoice) -> Result<Self> {
        let instance = instance();
        let adapter = match &choice {
            AdapterChoice::Default => {
                pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
                    power_preference: wgpu::PowerPreference::HighPerformance,
                    ..Default::default()
                }))
                .map_err(|e| Error::NoGpu {
                    detail: e.to_string(),
                })?
            }
            AdapterChoice::Backend(backends) => instance
                .enumerate_adapters(*backends)
                .into_iter()
                .next()
                .ok_or_else(|| Error::NoGpu {
                    detail: format!("no adapter for backends {backends:?}"),
                })?,
            AdapterChoice::Name(name) => {
                let all = instance.enumerate_adapters(wgpu::Backends::all());
                let names: Vec<String> = all.iter().map(|a| a.get_info().name).collect();
                let wanted = name.to_lowercase();
                all.into_iter()
                    .find(|a| a.get_info().name.to_lowercase().contains(&wanted))
                    .ok_or_else(|| Error::NoGpu {
                        detail: format!("no adapter named like {name:?} (found {names:?})"),
                    })?
            }
        };
        let info = adapter.get_info();
        // Everything the adapter allows: large layers need more than the default 128 MiB binding.
        let limits = adapter.limits();
        // Timestamp queries time the dispatch itself where the adapter has them.
        let timestamps = adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("convkit"),
            required_limits: limits.clone(),
            required_features: if timestamps {
                wgpu::Features::TIMESTAMP_QUERY
            } else {
                wgpu::Features::empty()
            },
            ..Default::default()
        }))
        .map_err(|e| Error::NoGpu {
            detail: format!("adapter {:?} refused a device: {e}", info.name),
        })?;
        Ok(GpuContext {
            device,
            queue,
            info,
            limits,
            timestamps,
        })
    }

    /// The adapter this context runs on (name, backend, driver).
    pub fn info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// How [`GpuPlan::time_device`] measures on this adapter.
    pub fn timing_source(&self) -> TimingSource {
        if self.timestamps {
            TimingSource::Timestamps
        } else {
            TimingSource::WallClock
        }
    }

    /// Blocks until the work queued so far has finished.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: None,
                timeout: None,
            })
            .map(|_| ())
            .map_err(|e| Error::Gpu {
                detail: format!("waiting for the device: {e}"),
            })
    }

    /// The wgpu device, for callers that bring their own buffers and passes.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The wgpu queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// Runs `f` inside out-of-memory and validation error scopes: what wgpu would report to
    /// its uncaptured-error handler (a panic by default) comes back as [`Error::Gpu`].
    fn scoped<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T> {
        self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let value = f();
        let validation = pollster::block_on(self.device.pop_error_scope());
        let memory = pollster::block_on(self.device.pop_error_scope());
        match validation.or(memory) {
            Some(e) => Err(Error::Gpu {
                detail: format!("{what}: {e}"),
            }),
            None => Ok(value),
        }
    }

    fn check_size(&self, what: &'static str, len: usize) -> Result<u64> {
        let bytes = (len as u64)
            .checked_mul(4)
            .ok_or(Error::Overflow { what })?;
        let max = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size.min(u32::MAX as u64) as u32) as u64;
        if bytes > max {
            return Err(Error::Gpu {
                detail: format!(
                    "{what} needs {bytes} bytes, more than the adapter's {max}-byte storage binding"
                ),
            });
        }
        Ok(bytes.max(4))
    }

    fn storage(
        &self,
        what: &'static str,
        len: usize,
        extra: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        let size = self.check_size(what, len)?;
        self.scoped(what, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(what),
                size,
                usage: wgpu::BufferUsages::STORAGE | extra,
                mapped_at_creation: false,
            })
        })
    }

    fn storage_init(&self, what: &'static str, data: &[f32]) -> Result<wgpu::Buffer> {
        self.check_size(what, data.len())?;
        let one = [0.0f32];
        let contents: &[f32] = if data.is_empty() { &one } else { data };
        self.scoped(what, || {
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(what),
                    contents: bytemuck::cast_slice(contents),
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                })
        })
    }

    /// A device tensor holding `data`.
    pub fn upload(&self, data: &[f32]) -> Result<GpuTensor> {
        let buffer = self.storage(
            "tensor",
            data.len(),
            wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        )?;
        self.queue
            .write_buffer(&buffer, 0, bytemuck::cast_slice(data));
        Ok(GpuTensor {
            buffer,
            len: data.len(),
        })
    }

    /// A device tensor of `len` elements (contents unspecified until written).
    pub fn tensor(&self, len: usize) -> Result<GpuTensor> {
        let buffer = self.storage(
            "tensor",
            len,
            wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
        )?;
        Ok(GpuTensor { buffer, len })
    }

    /// Copies `tensor` back into `out` (waits for the work queued before it).
    pub fn download(&self, tensor: &GpuTensor, out: &mut [f32]) -> Result<()> {
        check_lengths(&[("download destination", tensor.len, Some(out.len()))])?;
        let readback = self.readback(tensor.len)?;
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(&tensor.buffer, 0, &readback, 0, readback.size());
        self.queue.submit([encoder.finish()]);
        self.read(&readback, out)
    }

    fn readback(&self, len: usize) -> Result<wgpu::Buffer> {
        let size = self.check_size("readback", len)?;
        self.scoped("readback", || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
    }

    /// Maps `readback` (after the queued copy into it), copies it into `out`, unmaps.
    fn read(&self, readback: &wgpu::Buffer, out: &mut [f32]) -> Result<()> {
        let slice = readback.slice(..);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(Error::Gpu {
                    detail: format!("mapping the result: {e}"),
                })
            }
            Err(_) => {
                return Err(Error::Gpu {
                    detail: "the result was never mapped".into(),
                })
            }
        }
        {
            let view = slice.get_mapped_range();
            let data: &[f32] = bytemuck::cast_slice(&view);
            out.copy_from_slice(&data[..out.len()]);
        }
        readback.unmap();
        Ok(())
    }
}

/// A tensor of f32 on the device. Not `Clone`: a plan's output is borrowed mutably, so it
/// can never alias the input of the same dispatch.
#[derive(Debug)]
pub struct GpuTensor {
    buffer: wgpu::Buffer,
    len: usize,
}

impl GpuTensor {
    /// Its number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The wgpu buffer underneath.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }
}

/// The layer as the shaders read it (`Dims` in common.wgsl, field for field).
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Dims {
    batch: u32,
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    groups: u32,
    cin_g: u32,
    cout_g: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    dh: u32,
    dw: u32,
    pad_top: u32,
    pad_left: u32,
    oh: u32,
    ow: u32,
    nhwc: u32,
    activation: u32,
    has_bias: u32,
    has_residual: u32,
    alpha: f32,
    lo: f32,
    hi: f32,
    pad: [u32; 3],
}

/// The activation's code in common.wgsl's `activate`, and its parameters (alpha, lo, hi).
fn activation_code(a: Activation) -> (u32, f32, f32, f32) {
    match a {
        Activation::None => (0, 0.0, 0.0, 0.0),
        Activation::Relu => (1, 0.0, 0.0, 0.0),
        Activation::Relu6 => (2, 0.0, 0.0, 0.0),
        Activation::Clamp { min, max } => (3, 0.0, min, max),
        Activation::LeakyRelu { alpha } => (4, alpha, 0.0, 0.0),
        Activation::Silu => (5, 0.0, 0.0, 0.0),
        Activation::Gelu => (6, 0.0, 0.0, 0.0),
        Activation::HardSwish => (7, 0.0, 0.0, 0.0),
        Activation::Sigmoid => (8, 0.0, 0.0, 0.0),
    }
}

/// Which shader runs a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shader {
    ImplicitGemm,
    Depthwise,
}

impl Shader {
    fn source(self) -> String {
        let body = match self {
            Shader::ImplicitGemm => include_str!("implicit_gemm.wgsl"),
            Shader::Depthwise => include_str!("depthwise.wgsl"),
        };
        format!("{}\n{}", include_str!("common.wgsl"), body)
    }

    fn name(self) -> &'static str {
        match self {
            Shader::ImplicitGemm => "gpu/implicit_gemm_64x64",
            Shader::Depthwise => "gpu/depthwise",
        }
    }
}

/// A 2-D convolution on the GPU: the weights uploaded once, the shader compiled once.
#[derive(Debug)]
pub struct GpuConv2d {
    ctx: GpuContext,
    params: ConvParams,
    shader: Shader,
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    weights: wgpu::Buffer,
    bias: Option<wgpu::Buffer>,
    /// Bound where the bias or the residual is absent (a binding cannot be empty).
    dummy: wgpu::Buffer,
}

impl GpuConv2d {
    /// Validates as [`crate::Conv2d::new`] does, uploads the OIHW `weights` and the `bias`,
    /// and compiles the shader for this kind of layer.
    pub fn new(
        ctx: &GpuContext,
        params: ConvParams,
        weights: &[f32],
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        params.validate()?;
        params.check_weights_and_bias(weights.len(), bias.map(|b| b.len()))?;
        let shader = if params.in_channels_per_group() == 1 && params.groups > 1 {
            Shader::Depthwise
        } else {
            Shader::ImplicitGemm
        };
        let module = ctx.scoped("compiling the shader", || {
            ctx.device
                .create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(shader.name()),
                    source: wgpu::ShaderSource::Wgsl(shader.source().into()),
                })
        })?;
        let pipeline = ctx.scoped("creating the pipeline", || {
            ctx.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(shader.name()),
                    layout: None,
                    module: &module,
                    entry_point: Some("main"),
                    compilation_options: Default::default(),
                    cache: None,
                })
        })?;
        Ok(GpuConv2d {
            ctx: ctx.clone(),
            params,
            shader,
            layout: pipeline.get_bind_group_layout(0),
            pipeline,
            weights: ctx.storage_init("weights", weights)?,
            bias: bias.map(|b| ctx.storage_init("bias", b)).transpose()?,
            dummy: ctx.storage_init("unused binding", &[])?,
        })
    }

    /// The parameters it was built with.
    pub fn params(&self) -> &ConvParams {
        &self.params
    }

    /// The shader that runs it (`gpu/implicit_gemm_64x64` or `gpu/depthwise`).
    pub fn kernel_name(&self) -> &'static str {
        self.shader.name()
    }

    /// Fixes the batch and input size: checks them against the adapter's limits and creates
    /// the layer's uniform buffers. The host staging buffers come with the first host run.
    pub fn plan(&self, batch: usize, in_h: usize, in_w: usize) -> Result<GpuPlan<'_>> {
        let g = self.params.geometry(batch, in_h, in_w)?;
        let ctx = &self.ctx;
        ctx.check_size("input", g.input_len())?;
        ctx.check_size("output", g.output_len())?;
        let max_groups = ctx.limits.max_compute_workgroups_per_dimension as usize;
        let workgroups = match self.shader {
            Shader::ImplicitGemm => [
                (g.batch * g.oh * g.ow).div_ceil(64),
                g.cout_g().div_ceil(64),
                g.groups,
            ],
            Shader::Depthwise => {
                let n = g.output_len().div_ceil(256);
                let x = n.min(max_groups);
                [x, n.div_ceil(x), 1]
            }
        };
        if let Some(&over) = workgroups.iter().find(|&&n| n > max_groups) {
            return Err(Error::Gpu {
                detail: format!(
                    "the layer needs {over} workgroups along one axis, more than the adapter's {max_groups}"
                ),
            });
        }
        // The shaders index in u32 and place taps in the padded input as i32: every size,
        // the padded extents included, must fit in i32 (huge strides or paddings can, with a
        // small output, pass the buffer checks above).
        let fields = [
            g.batch, g.c_in, g.h, g.w, g.c_out, g.groups, g.kh, g.kw, g.sh, g.sw, g.dh, g.dw,
            g.pad_top, g.pad_left, g.oh, g.ow,
        ];
        let padded = [
            g.h.checked_add(g.pad_top)
                .and_then(|v| v.checked_add(g.pad_bottom)),
            g.w.checked_add(g.pad_left)
                .and_then(|v| v.checked_add(g.pad_right)),
            g.oh.checked_mul(g.sh),
            g.ow.checked_mul(g.sw),
        ];
        let limit = i32::MAX as usize;
        if fields.iter().any(|&v| v > limit) || padded.iter().any(|v| v.is_none_or(|v| v > limit)) {
            return Err(Error::Overflow {
                what: "a GPU layer's size, stride, dilation or padding (the shaders need i32)",
            });
        }
        let [batch, c_in, h, w, c_out, groups, kh, kw, sh, sw, dh, dw, pad_top, pad_left, oh, ow] =
            fields.map(|v| v as u32); // checked just above
        let (activation, alpha, lo, hi) = activation_code(self.params.activation);
        let dims = |has_residual: bool| Dims {
            batch,
            c_in,
            h,
            w,
            c_out,
            groups,
            cin_g: c_in / groups,
            cout_g: c_out / groups,
            kh,
            kw,
            sh,
            sw,
            dh,
            dw,
            pad_top,
            pad_left,
            oh,
            ow,
            nhwc: u32::from(g.layout == Layout::Nhwc),
            activation,
            has_bias: u32::from(self.bias.is_some()),
            has_residual: u32::from(has_residual),
            alpha,
            lo,
            hi,
            pad: [0; 3],
        };
        let uniform = |d: Dims| {
            ctx.scoped("uniforms", || {
                ctx.device
                    .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                        label: Some("dims"),
                        contents: bytemuck::bytes_of(&d),
                        usage: wgpu::BufferUsages::UNIFORM,
                    })
            })
        };
        let timer = if ctx.timestamps {
            Some(ctx.scoped("timestamp queries", || Timer::new(&ctx.device))?)
        } else {
            None
        };
        Ok(GpuPlan {
            conv: self,
            geometry: g,
            workgroups: workgroups.map(|n| n as u32),
            dims: uniform(dims(false))?,
            dims_residual: uniform(dims(true))?,
            timer,
            host: None,
        })
    }
}

/// How a GPU time was measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimingSource {
    /// Timestamp queries around the compute pass: the device's own time for the dispatch.
    Timestamps,
    /// Wall time around submit-and-wait (the adapter has no timestamp queries): includes the
    /// submission's overhead.
    WallClock,
}

impl TimingSource {
    /// How it reads in a report.
    pub fn name(self) -> &'static str {
        match self {
            TimingSource::Timestamps => "timestamp queries",
            TimingSource::WallClock => "wall time around submit and wait",
        }
    }
}

/// The query set and buffers that read a dispatch's two timestamps back.
#[derive(Debug)]
struct Timer {
    queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    readback: wgpu::Buffer,
}

impl Timer {
    fn new(device: &wgpu::Device) -> Timer {
        let buffer = |usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps"),
                size: 16,
                usage,
                mapped_at_creation: false,
            })
        };
        Timer {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("dispatch time"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            }),
            resolved: buffer(wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC),
            readback: buffer(wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST),
        }
    }
}

/// Buffers for runs on host slices, made at the first such run and kept.
#[derive(Debug)]
struct HostBuffers {
    input: GpuTensor,
    output: GpuTensor,
    residual: Option<GpuTensor>,
    readback: wgpu::Buffer,
}

/// A [`GpuConv2d`] at one input size.
#[derive(Debug)]
pub struct GpuPlan<'a> {
    conv: &'a GpuConv2d,
    geometry: Geometry,
    workgroups: [u32; 3],
    dims: wgpu::Buffer,
    dims_residual: wgpu::Buffer,
    /// Made at plan time where the adapter has timestamp queries.
    timer: Option<Timer>,
    host: Option<HostBuffers>,
}

impl GpuPlan<'_> {
    /// The convolution's geometry (output size, lengths, FLOPs).
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The shader that runs.
    pub fn kernel_name(&self) -> &'static str {
        self.conv.kernel_name()
    }

    /// Queues the convolution of device tensors (no copies, no waiting): `output` =
    /// epilogue(conv(`input`) + bias (+ `residual`)). Lengths as on the CPU.
    pub fn run_device(
        &self,
        input: &GpuTensor,
        output: &mut GpuTensor,
        residual: Option<&GpuTensor>,
    ) -> Result<()> {
        let encoder = self.encode(input, output, residual, None)?;
        self.conv.ctx.queue.submit([encoder.finish()]);
        Ok(())
    }

    /// Runs once on device tensors and returns the seconds the dispatch took, measured as
    /// [`GpuContext::timing_source`] says.
    pub fn time_device(
        &self,
        input: &GpuTensor,
        output: &mut GpuTensor,
        residual: Option<&GpuTensor>,
    ) -> Result<(f64, TimingSource)> {
        let ctx = &self.conv.ctx;
        ctx.wait()?;
        let Some(timer) = &self.timer else {
            let start = std::time::Instant::now();
            self.run_device(input, output, residual)?;
            ctx.wait()?;
            return Ok((start.elapsed().as_secs_f64(), TimingSource::WallClock));
        };
        let mut encoder = self.encode(input, output, residual, Some(&timer.queries))?;
        encoder.resolve_query_set(&timer.queries, 0..2, &timer.resolved, 0);
        encoder.copy_buffer_to_buffer(&timer.resolved, 0, &timer.readback, 0, 16);
        ctx.queue.submit([encoder.finish()]);
        let mut ticks = [0.0f32; 4];
        ctx.read(&timer.readback, &mut ticks)?;
        let [begin, end]: [u64; 2] = bytemuck::cast(ticks);
        let ns = end.saturating_sub(begin) as f64 * ctx.queue.get_timestamp_period() as f64;
        Ok((ns * 1e-9, TimingSource::Timestamps))
    }

    fn check_lengths(&self, input: usize, output: usize, residual: Option<usize>) -> Result<()> {
        let g = &self.geometry;
        check_lengths(&[
            ("input", g.input_len(), Some(input)),
            ("output", g.output_len(), Some(output)),
            ("residual", g.output_len(), residual),
        ])
    }

    fn encode(
        &self,
        input: &GpuTensor,
        output: &GpuTensor,
        residual: Option<&GpuTensor>,
        timestamps: Option<&wgpu::QuerySet>,
    ) -> Result<wgpu::CommandEncoder> {
        self.check_lengths(input.len, output.len, residual.map(|r| r.len))?;
        let conv = self.conv;
        let ctx = &conv.ctx;
        let dims = if residual.is_some() {
            &self.dims_residual
        } else {
            &self.dims
        };
        let entries = [
            dims,
            &input.buffer,
            &conv.weights,
            conv.bias.as_ref().unwrap_or(&conv.dummy),
            residual.map_or(&conv.dummy, |r| &r.buffer),
            &output.buffer,
        ];
        let entries: Vec<wgpu::BindGroupEntry> = entries
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        ctx.scoped("encoding the dispatch", || {
            let bind_group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("convolution"),
                layout: &conv.layout,
                entries: &entries,
            });
            let mut encoder = ctx.device.create_command_encoder(&Default::default());
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("convolution"),
                    timestamp_writes: timestamps.map(|query_set| {
                        wgpu::ComputePassTimestampWrites {
                            query_set,
                            beginning_of_pass_write_index: Some(0),
                            end_of_pass_write_index: Some(1),
                        }
                    }),
                });
                pass.set_pipeline(&conv.pipeline);
                pass.set_bind_group(0, &bind_group, &[]);
                let [x, y, z] = self.workgroups;
                pass.dispatch_workgroups(x, y, z);
            }
            encoder
        })
    }

    /// Runs on host slices: uploads `input`, dispatches, waits, reads back into `output`.
    pub fn run(&mut self, input: &[f32], output: &mut [f32]) -> Result<()> {
        self.run_host(input, None, output)
    }

    /// As [`GpuPlan::run`], with `residual` (the output's shape) added before the activation.
    pub fn run_with_residual(
        &mut self,
        input: &[f32],
        residual: &[f32],
        output: &mut [f32],
    ) -> Result<()> {
        self.run_host(input, Some(residual), output)
    }

    fn run_host(
        &mut self,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
    ) -> Result<()> {
        // Checked before the uploads: a write past a buffer's end is a wgpu panic.
        self.check_lengths(input.len(), output.len(), residual.map(|r| r.len()))?;
        let g = &self.geometry;
        let ctx = self.conv.ctx.clone();
        let mut host = match self.host.take() {
            Some(host) => host,
            None => HostBuffers {
                input: ctx.tensor(g.input_len())?,
                output: ctx.tensor(g.output_len())?,
                residual: None,
                readback: ctx.readback(g.output_len())?,
            },
        };
        if residual.is_some() && host.residual.is_none() {
            host.residual = Some(ctx.tensor(g.output_len())?);
        }
        ctx.queue
            .write_buffer(&host.input.buffer, 0, bytemuck::cast_slice(input));
        if let (Some(r), Some(buf)) = (residual, &host.residual) {
            ctx.queue
                .write_buffer(&buf.buffer, 0, bytemuck::cast_slice(r));
        }
        let result = self
            .encode(
                &host.input,
                &host.output,
                residual.and(host.residual.as_ref()),
                None,
            )
            .and_then(|mut encoder| {
                encoder.copy_buffer_to_buffer(
                    &host.output.buffer,
                    0,
                    &host.readback,
                    0,
                    host.readback.size(),
                );
                ctx.queue.submit([encoder.finish()]);
                ctx.read(&host.readback, output)
            });
        self.host = Some(host);
        result
    }
}

/// A 1-D convolution on the GPU: [`GpuConv2d`] with height 1, as [`crate::Conv1d`].
#[derive(Debug)]
pub struct GpuConv1d {
    conv: GpuConv2d,
}

impl GpuConv1d {
    /// `params` must describe a 1-D convolution (`ConvParams::conv1d`).
    pub fn new(
        ctx: &GpuContext,
        params: ConvParams,
        weights: &[f32],
        bias: Option<&[f32]>,
    ) -> Result<Self> {
        check_1d(&params)?;
        Ok(GpuConv1d {
            conv: GpuConv2d::new(ctx, params, weights, bias)?,
        })
    }

    /// Fixes the input length.
    pub fn plan(&self, batch: usize, length: usize) -> Result<GpuPlan<'_>> {
        self.conv.plan(batch, 1, length)
    }

    /// The 2-D convolution underneath.
    pub fn as_conv2d(&self) -> &GpuConv2d {
        &self.conv
    }
}
