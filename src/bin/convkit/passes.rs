//! `--pass backward-data|backward-weights|transposed` for `bench` and `run`.

use crate::args::{CliError, CliResult, Flags};
use crate::bench::{time_median, Measured};
use crate::layers::{randn, zeros, Layer, Prepared};
use crate::run::{read_npy, write_npy};
use crate::{resolve_isa, setup_threads};
use convkit::reference;
use convkit::{
    Accumulate, Activation, ConvBackward, ConvParams, ConvTranspose2d, Geometry, Options, Padding,
    Workspace,
};
use std::time::Instant;

/// Which computation of a convolution layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    BackwardData,
    BackwardWeights,
    /// The transposed convolution of the layer (the suite's layers are read as the forward
    /// convolution whose adjoint it is: input channels and output channels swap).
    Transposed,
}

impl std::str::FromStr for Pass {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "forward" => Ok(Pass::Forward),
            "backward-data" => Ok(Pass::BackwardData),
            "backward-weights" => Ok(Pass::BackwardWeights),
            "transposed" => Ok(Pass::Transposed),
            _ => Err("not one of forward, backward-data, backward-weights, transposed".into()),
        }
    }
}

/// The forward layer's parameters without its activation, and its padding made explicit.
fn linear(params: &ConvParams, g: &Geometry) -> ConvParams {
    ConvParams {
        activation: Activation::None,
        padding: Padding::Explicit {
            top: g.pad_top,
            bottom: g.pad_bottom,
            left: g.pad_left,
            right: g.pad_right,
        },
        ..*params
    }
}

/// The transposed convolution that is the adjoint of forward layer `p`, with the output padding
/// that gives back the forward input size.
fn adjoint(p: &ConvParams, g: &Geometry) -> (ConvParams, [usize; 2]) {
    let t = ConvParams {
        in_channels: p.out_channels,
        out_channels: p.in_channels,
        ..linear(p, g)
    };
    let left = |i: usize, input: usize, pads: usize| {
        let span = (p.kernel[i] - 1) * p.dilation[i] + 1;
        (input + pads - span) % p.stride[i]
    };
    let op = [
        left(0, g.h, g.pad_top + g.pad_bottom),
        left(1, g.w, g.pad_left + g.pad_right),
    ];
    (t, op)
}

/// Create, plan, check once against the reference, then time one pass of `layer`.
pub fn bench_layer(
    layer: &Layer,
    options: Options,
    reps: usize,
    pass: Pass,
) -> convkit::Result<Measured> {
    let p = Prepared::new(layer)?;
    let g = &p.geometry;
    let params = linear(&p.params, g);
    let options = Options {
        input_hint: Some(match pass {
            Pass::Transposed => [g.oh, g.ow],
            _ => [g.h, g.w],
        }),
        ..options
    };
    let mut ws = Workspace::new();
    let (kernel, flops, cmp, median_s) = match pass {
        Pass::Forward => unreachable!("the forward pass is bench.rs's"),
        Pass::BackwardData | Pass::BackwardWeights => {
            let plan = ConvBackward::new(params, &p.weights, options)?.plan(g.batch, g.h, g.w)?;
            ws.reserve(plan.workspace_bytes())?;
            let dy = randn(&layer.name, "grad_output", plan.output_len())?;
            if pass == Pass::BackwardData {
                let mut dx = zeros(plan.input_len(), "grad_input")?;
                plan.backward_data(&dy, &mut dx, Accumulate::Overwrite, &mut ws)?;
                let want = reference::backward_data(&params, g.batch, g.h, g.w, &dy, &p.weights)?;
                let cmp = want.compare_scaled(&dx, plan.error_factor());
                let t = time_median(reps, || {
                    plan.backward_data(&dy, &mut dx, Accumulate::Overwrite, &mut ws)
                })?;
                (plan.kernel_name(), plan.flops(), cmp, t)
            } else {
                let (mut dw, mut db) = (
                    zeros(p.weights.len(), "grad_weights")?,
                    zeros(g.c_out, "grad_bias")?,
                );
                let mut call = |dw: &mut [f32], ws: &mut Workspace| {
                    let db = Some(&mut db[..]);
                    plan.backward_weights(&p.input, &dy, dw, db, Accumulate::Overwrite, ws)
                };
                call(&mut dw, &mut ws)?;
                let (want, _) =
                    reference::backward_weights(&params, g.batch, g.h, g.w, &p.input, &dy)?;
                let cmp = want.compare_scaled(&dw, plan.weights_error_factor());
                let t = time_median(reps, || call(&mut dw, &mut ws))?;
                (plan.kernel_name(), plan.flops(), cmp, t)
            }
        }
        Pass::Transposed => {
            let (t, op) = adjoint(&p.params, g);
            let bias = randn(&layer.name, "transposed bias", t.out_channels)?;
            let conv = ConvTranspose2d::new(t, op, &p.weights, Some(&bias), options)?;
            let plan = conv.plan(g.batch, g.oh, g.ow)?;
            ws.reserve(plan.workspace_bytes())?;
            let x = randn(&layer.name, "transposed input", plan.input_len())?;
            let mut y = zeros(plan.output_len(), "output")?;
            plan.run(&x, &mut y, &mut ws)?;
            let (want, _) = reference::conv_transpose(
                &t,
                op,
                g.batch,
                g.oh,
                g.ow,
                &x,
                &p.weights,
                Some(&bias),
                None,
            )?;
            let cmp = want.compare_scaled(&y, plan.error_factor());
            let time = time_median(reps, || plan.run(&x, &mut y, &mut ws))?;
            (plan.kernel_name(), plan.flops(), cmp, time)
        }
    };
    Ok(Measured {
        kernel,
        median_s,
        gflops: flops / median_s / 1e9,
        workspace: ws.bytes(),
        max_abs: cmp.max_abs,
        passed: cmp.passed(),
    })
}

/// `convkit run --pass …`: one backward pass or transposed convolution on .npy files.
pub fn run(flags: &Flags, pass: Pass) -> CliResult<bool> {
    let layer = flags.required("layer")?;
    let fields: Vec<&str> = layer.split(',').collect();
    let s = convkit::suite::parse_numbers("--layer", &fields)
        .map_err(|e| CliError::Usage(format!("--layer {layer:?}: {e}")))?;
    let (threads, workers) = setup_threads(flags.parsed("threads")?)?;
    let options = Options {
        threads,
        isa: Some(resolve_isa(flags.parsed("isa")?)?),
        precision: flags.parsed("precision")?.unwrap_or_default(),
        ..Options::default()
    };
    let p = s.params;
    let (c_in, c_out, [kh, kw]) = (p.in_channels, p.out_channels, p.kernel);
    let one_d = s.h == 1;
    let out_path = flags.required("output")?;
    let mut ws = Workspace::new();
    let start = Instant::now();
    let (kernel, flops, written) = match pass {
        Pass::Forward => unreachable!("the forward pass is run.rs's"),
        Pass::BackwardData | Pass::BackwardWeights => {
            let g = s.geometry()?;
            let dy = read_npy(
                flags.required("grad-output")?,
                "grad_output",
                &[s.batch, c_out, g.oh, g.ow],
                one_d,
            )?;
            let wshape = [c_out, p.in_channels_per_group(), kh, kw];
            let weights = match (pass, flags.get("weight")) {
                (Pass::BackwardData, _) => {
                    read_npy(flags.required("weight")?, "weights", &wshape, kh == 1)?
                }
                (_, Some(path)) => read_npy(path, "weights", &wshape, kh == 1)?,
                (_, None) => zeros(p.weights_len()?, "weights")?,
            };
            let plan = ConvBackward::new(p, &weights, options)?.plan(s.batch, s.h, s.w)?;
            if pass == Pass::BackwardData {
                let mut dx = zeros(plan.input_len(), "grad_input")?;
                plan.backward_data(&dy, &mut dx, Accumulate::Overwrite, &mut ws)?;
                write_npy(out_path, &[s.batch, c_in, s.h, s.w], &dx)?;
                (
                    plan.kernel_name(),
                    plan.flops(),
                    format!("{out_path} (grad_input)"),
                )
            } else {
                let x = read_npy(
                    flags.required("input")?,
                    "input",
                    &[s.batch, c_in, s.h, s.w],
                    one_d,
                )?;
                let (mut dw, mut db) = (
                    zeros(weights.len(), "grad_weights")?,
                    zeros(c_out, "grad_bias")?,
                );
                plan.backward_weights(
                    &x,
                    &dy,
                    &mut dw,
                    Some(&mut db),
                    Accumulate::Overwrite,
                    &mut ws,
                )?;
                write_npy(out_path, &wshape, &dw)?;
                let mut written = format!("{out_path} (grad_weights)");
                if let Some(path) = flags.get("grad-bias") {
                    write_npy(path, &[c_out], &db)?;
                    written += &format!(", {path} (grad_bias)");
                }
                (plan.kernel_name(), plan.flops(), written)
            }
        }
        Pass::Transposed => {
            let op: Vec<usize> = match flags.get("output-padding") {
                None => vec![0, 0],
                Some(v) => v
                    .split(',')
                    .map(|f| f.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| CliError::Usage(format!("--output-padding {v:?}: {e}")))?,
            };
            let op = match op[..] {
                [o] if one_d => [0, o],
                [o] => [o, o],
                [a, b] => [a, b],
                _ => {
                    return Err(CliError::Usage(
                        "--output-padding takes 1 or 2 numbers".into(),
                    ))
                }
            };
            let x = read_npy(
                flags.required("input")?,
                "input",
                &[s.batch, c_in, s.h, s.w],
                one_d,
            )?;
            let weights = read_npy(
                flags.required("weight")?,
                "weights",
                &[c_in, c_out / p.groups.max(1), kh, kw],
                kh == 1,
            )?;
            let bias = flags
                .get("bias")
                .map(|path| read_npy(path, "bias", &[c_out], false))
                .transpose()?;
            let plan = ConvTranspose2d::new(p, op, &weights, bias.as_deref(), options)?
                .plan(s.batch, s.h, s.w)?;
            let mut y = zeros(plan.output_len(), "output")?;
            plan.run(&x, &mut y, &mut ws)?;
            write_npy(out_path, &plan.output_shape(), &y)?;
            (
                plan.kernel_name(),
                plan.flops(),
                format!("{out_path} {:?}", plan.output_shape()),
            )
        }
    };
    let secs = start.elapsed().as_secs_f64();
    println!("kernel: {kernel} ({workers} thread(s))");
    println!(
        "time: {:.3} ms ({:.2} GFLOP/s, one call with its set-up)",
        secs * 1e3,
        flops / secs / 1e9
    );
    println!("output: {written}");
    Ok(true)
}
