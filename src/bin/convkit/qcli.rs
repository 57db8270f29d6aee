//! `--dtype u8|i8`: the quantized (int8) side of `bench`, `check` and `run`.
//!
//! The suite's layers are quantized as the peers' int8 script does it (`../shared/peers/`):
//! activations with scale 3.5/127 and zero point 128 (u8) or 0 (i8), symmetric weights with one
//! scale per output channel, an i32 bias, and an output scale that maps the largest output to
//! 127. Every result is compared with the exact integer reference before it is timed.

use crate::args::{CliError, CliResult, Flags};
use crate::bench::{time_median, Dtype, Measured};
use crate::layers::{Layer, Prepared};
use crate::setup_threads;
use convkit::reference::{qconv_sums, requantize};
use convkit::{
    Algorithm, Error, Isa, Options, QConv2d, QPlan, QuantOutput, QuantParams, QuantType, Workspace,
};

/// A layer quantized: parameters, integer tensors, and the expected outputs.
pub struct QPrepared {
    pub params: convkit::ConvParams,
    pub geometry: convkit::Geometry,
    pub quant: QuantParams,
    /// The input's bytes (u8, or i8 reinterpreted).
    pub input: Vec<u8>,
    pub weights: Vec<i8>,
    pub bias: Vec<i32>,
    /// The reference outputs (exact sums requantised as convkit specifies).
    pub expected: Vec<i32>,
}

impl QPrepared {
    pub fn new(layer: &Layer, dtype: Dtype) -> convkit::Result<QPrepared> {
        let p = Prepared::new(layer)?;
        let (params, g) = (p.params, p.geometry);
        let ty = match dtype {
            Dtype::I8 => QuantType::I8,
            _ => QuantType::U8,
        };
        let zp = if ty == QuantType::U8 { 128 } else { 0 };
        let x_scale = 3.5f32 / 127.0;
        let xq: Vec<i32> = p
            .input
            .iter()
            .map(|&v| {
                ((v / x_scale).round_ties_even() as i32 + zp).clamp(ty.range().0, ty.range().1)
            })
            .collect();
        let cout = params.out_channels;
        let k = params.weights_len()? / cout;
        let mut w_scales = Vec::with_capacity(cout);
        let mut weights = Vec::with_capacity(cout * k);
        for co in 0..cout {
            let w = &p.weights[co * k..(co + 1) * k];
            let amax = w.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
            let s = amax / 127.0;
            w_scales.push(s);
            weights.extend(
                w.iter()
                    .map(|v| (v / s).round_ties_even().clamp(-127.0, 127.0) as i8),
            );
        }
        let bias: Vec<i32> = (0..cout)
            .map(|co| {
                (p.bias[co] as f64 * 0.25 / (x_scale as f64 * w_scales[co] as f64)).round() as i32
            })
            .collect();
        let sums = qconv_sums(&params, g.batch, g.h, g.w, &xq, zp, &weights, Some(&bias))?;
        let co_of = |i: usize| match params.layout {
            convkit::Layout::Nchw => i / (g.oh * g.ow) % g.c_out,
            convkit::Layout::Nhwc => i % g.c_out,
        };
        let y_max = sums
            .iter()
            .enumerate()
            .map(|(i, &s)| (s as f64 * x_scale as f64 * w_scales[co_of(i)] as f64).abs())
            .fold(1e-6, f64::max);
        let y_scale = (y_max / 127.0) as f32;
        let (qlo, qhi) = ty.range();
        let expected = sums
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let m = (x_scale as f64 * w_scales[co_of(i)] as f64 / y_scale as f64) as f32;
                requantize(s, m, zp, qlo, qhi)
            })
            .collect();
        let input = xq.iter().map(|&v| v as u8).collect();
        Ok(QPrepared {
            params,
            geometry: g,
            quant: QuantParams {
                input_type: ty,
                input_scale: x_scale,
                input_zero_point: zp,
                weight_scales: w_scales,
                output: QuantOutput::Quantized {
                    ty,
                    scale: y_scale,
                    zero_point: zp,
                },
            },
            input,
            weights,
            bias,
            expected,
        })
    }

    pub fn conv(&self, options: Options) -> convkit::Result<QConv2d> {
        QConv2d::new(
            self.params,
            self.quant.clone(),
            &self.weights,
            Some(&self.bias),
            options,
        )
    }

    /// Runs `plan` on the input into `out` (bytes of the output type).
    pub fn run(&self, plan: &QPlan, out: &mut [u8], ws: &mut Workspace) -> convkit::Result<()> {
        match self.quant.input_type {
            QuantType::U8 => plan.run(&self.input, out, ws),
            QuantType::I8 => {
                let x: &[i8] = bytemuck::cast_slice(&self.input);
                plan.run(x, bytemuck::cast_slice_mut::<u8, i8>(out), ws)
            }
        }
    }

    /// The largest difference from the expected outputs, in output units.
    pub fn max_diff(&self, out: &[u8]) -> i32 {
        let signed = self.quant.input_type == QuantType::I8;
        out.iter()
            .zip(&self.expected)
            .map(|(&o, &e)| {
                let o = if signed { o as i8 as i32 } else { o as i32 };
                (o - e).abs()
            })
            .max()
            .unwrap_or(0)
    }
}

/// The int8 peak as a multiple of the f32 FMA peak, for the kernel that will run.
pub fn peak_factor(isa: Isa, kernel: Option<&str>) -> (f64, &'static str) {
    let vnni = match kernel {
        Some(k) => k.contains("vnni"),
        None => isa == Isa::Avx512 && convkit::cpu::has_vnni(),
    };
    if vnni {
        (4.0, "VNNI: 4 multiply-adds a lane where FMA does 1")
    } else if isa == Isa::Scalar {
        (1.0, "scalar")
    } else {
        (2.0, "i16 pairs: 2 multiply-adds a lane where FMA does 1")
    }
}

/// Create, plan, check once against the reference, then time.
pub fn bench_layer(
    layer: &Layer,
    options: Options,
    reps: usize,
    dtype: Dtype,
) -> convkit::Result<Measured> {
    let q = QPrepared::new(layer, dtype)?;
    let conv = q.conv(options)?;
    let g = &q.geometry;
    let plan = conv.plan(g.batch, g.h, g.w)?;
    let mut out = vec![0u8; plan.output_len()];
    let mut ws = Workspace::with_bytes(plan.workspace_bytes())?;
    q.run(&plan, &mut out, &mut ws)?;
    let diff = q.max_diff(&out);
    let median_s = time_median(reps, || q.run(&plan, &mut out, &mut ws))?;
    Ok(Measured {
        kernel: plan.kernel_name(),
        median_s,
        gflops: plan.ops() / median_s / 1e9,
        workspace: plan.workspace_bytes(),
        max_abs: diff as f64,
        passed: diff == 0,
    })
}

/// `check --dtype`: every layer with every int8 kernel this CPU runs, and through the f32
/// direct kernels (`--algorithm direct`), where they take it.
pub fn check(args_layers: &[Layer], threads: usize, dtype: Dtype) -> bool {
    let kernels: Vec<&'static str> = convkit::cpu::registry()
        .into_iter()
        .filter(|k| k.family.is_int8() && Isa::available().contains(&k.isa))
        .filter(|k| !k.name.contains("vnni") || convkit::cpu::has_vnni())
        .map(|k| k.name)
        .collect();
    let forced = |kernel: &'static str| Options {
        threads,
        kernel: Some(kernel),
        ..Options::default()
    };
    let runs: Vec<(&str, Options)> = kernels
        .iter()
        .map(|&k| (k, forced(k)))
        .chain([(
            "exact_f32 (--algorithm direct)",
            Options {
                threads,
                algorithm: Some(Algorithm::Direct),
                ..Options::default()
            },
        )])
        .collect();
    let width = args_layers.iter().map(|l| l.name.len()).max().unwrap_or(0);
    let (mut passed, mut failed, mut skipped) = (0usize, 0usize, 0usize);
    for (i, layer) in args_layers.iter().enumerate() {
        eprintln!("[{}/{}] {} ...", i + 1, args_layers.len(), layer.name);
        let q = match QPrepared::new(layer, dtype) {
            Ok(q) => q,
            Err(e) => {
                println!("{:<width$}  FAIL  {e}", layer.name);
                failed += 1;
                continue;
            }
        };
        let mut ws = Workspace::new();
        for (kernel, options) in &runs {
            let result = q.conv(*options).and_then(|conv| {
                let g = &q.geometry;
                let plan = conv.plan(g.batch, g.h, g.w)?;
                let mut out = vec![0u8; plan.output_len()];
                q.run(&plan, &mut out, &mut ws)?;
                Ok(q.max_diff(&out))
            });
            let label = format!("{:<width$}  {:<28}", layer.name, kernel);
            match result {
                Ok(0) => {
                    println!("{label}  PASS  exact");
                    passed += 1;
                }
                Ok(d) => {
                    println!("{label}  FAIL  max difference {d}");
                    failed += 1;
                }
                Err(Error::AlgorithmUnsupported { reason, .. }) => {
                    println!("{label}  SKIP  {reason}");
                    skipped += 1;
                }
                Err(e) => {
                    println!("{label}  FAIL  {e}");
                    failed += 1;
                }
            }
        }
    }
    println!("{passed} passed, {failed} failed, {skipped} skipped");
    failed == 0
}

/// `run --dtype u8|i8`: one quantized convolution on .npy files.
pub fn run(flags: &Flags, dtype: Dtype) -> CliResult<bool> {
    let layer = flags.required("layer")?;
    let fields: Vec<&str> = layer.split(',').collect();
    let s = convkit::suite::parse_numbers("--layer", &fields)
        .map_err(|e| CliError::Usage(format!("--layer {layer:?}: {e}")))?;
    let (threads, workers) = setup_threads(flags.parsed("threads")?)?;
    let isa = crate::resolve_isa(flags.parsed("isa")?)?;
    let params = s.params;
    let g = s.geometry()?;
    let (c_in, c_out, [kh, kw]) = (params.in_channels, params.out_channels, params.kernel);
    let ty = if dtype == Dtype::I8 {
        QuantType::I8
    } else {
        QuantType::U8
    };
    let num = |name: &str| -> CliResult<f32> {
        flags
            .parsed::<f32>(name)?
            .ok_or_else(|| CliError::Usage(format!("--{name} is required with --dtype")))
    };
    let int = |name: &str| -> CliResult<i32> {
        flags
            .parsed::<i32>(name)?
            .ok_or_else(|| CliError::Usage(format!("--{name} is required with --dtype")))
    };
    let (x_scale, x_zp, y_scale, y_zp) = (
        num("x-scale")?,
        int("x-zero-point")?,
        num("y-scale")?,
        int("y-zero-point")?,
    );
    let weights: Vec<i8> = crate::run::read_npy(
        flags.required("weight")?,
        "weights",
        &[c_out, params.in_channels_per_group(), kh, kw],
        kh == 1,
    )?;
    let w_scales: Vec<f32> = match (
        flags.get("weight-scales"),
        flags.parsed::<f32>("weight-scale")?,
    ) {
        (Some(path), None) => crate::run::read_npy_any(path, "weight scales", &[&[c_out], &[1]])?,
        (None, Some(s)) => vec![s],
        _ => {
            return Err(CliError::Usage(
                "--dtype needs one of --weight-scales S.npy (per channel) or --weight-scale F"
                    .into(),
            ))
        }
    };
    let bias: Option<Vec<i32>> = flags
        .get("bias")
        .map(|path| crate::run::read_npy(path, "bias", &[c_out], false))
        .transpose()?;
    let quant = QuantParams {
        input_type: ty,
        input_scale: x_scale,
        input_zero_point: x_zp,
        weight_scales: w_scales,
        output: QuantOutput::Quantized {
            ty,
            scale: y_scale,
            zero_point: y_zp,
        },
    };
    let options = Options {
        threads,
        isa: Some(isa),
        ..Options::default()
    };
    let conv = QConv2d::new(params, quant, &weights, bias.as_deref(), options)?;
    let plan = conv.plan(s.batch, s.h, s.w)?;
    let mut ws = Workspace::with_bytes(plan.workspace_bytes())?;
    let shape = [g.batch, g.c_out, g.oh, g.ow];
    let (input_path, output_path) = (flags.required("input")?, flags.required("output")?);
    let in_shape = [s.batch, c_in, s.h, s.w];
    let secs = match ty {
        QuantType::U8 => {
            let x: Vec<u8> = crate::run::read_npy(input_path, "input", &in_shape, s.h == 1)?;
            let mut y = vec![0u8; plan.output_len()];
            let start = std::time::Instant::now();
            plan.run(&x, &mut y, &mut ws)?;
            let secs = start.elapsed().as_secs_f64();
            crate::run::write_npy(output_path, &shape, &y)?;
            secs
        }
        QuantType::I8 => {
            let x: Vec<i8> = crate::run::read_npy(input_path, "input", &in_shape, s.h == 1)?;
            let mut y = vec![0i8; plan.output_len()];
            let start = std::time::Instant::now();
            plan.run(&x, &mut y, &mut ws)?;
            let secs = start.elapsed().as_secs_f64();
            crate::run::write_npy(output_path, &shape, &y)?;
            secs
        }
    };
    println!(
        "kernel: {} (isa {isa}, {workers} thread(s))",
        plan.kernel_name()
    );
    println!(
        "time: {:.3} ms ({:.2} GOP/s, one call)",
        secs * 1e3,
        plan.ops() / secs / 1e9
    );
    println!("output: {output_path} {shape:?} {}", ty.name());
    Ok(true)
}
