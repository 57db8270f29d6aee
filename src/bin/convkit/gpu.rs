//! `convkit bench|check --device gpu` and the adapter list of `convkit info` (feature `gpu`).

use crate::args::{CliResult, Flags};
use crate::layers::{self, Prepared};
use crate::setup_threads;
use convkit::gpu::{AdapterChoice, GpuContext, GpuConv2d};
use convkit::{Conv2d, Options, Precision, Workspace};

/// The adapters wgpu finds, for `convkit info`.
pub fn print_adapters() {
    let adapters = GpuContext::adapters();
    if adapters.is_empty() {
        println!("gpu adapters: none found");
    }
    for (i, a) in adapters.iter().enumerate() {
        println!(
            "gpu adapter {i}: {} ({:?}, {:?}, driver {} {})",
            a.name, a.backend, a.device_type, a.driver, a.driver_info
        );
    }
}

fn context(flags: &Flags) -> CliResult<GpuContext> {
    let choice = match flags.get("adapter") {
        Some(name) => AdapterChoice::Name(name.to_string()),
        None => AdapterChoice::Default,
    };
    let ctx = GpuContext::with_adapter(choice)?;
    let info = ctx.info();
    eprintln!(
        "gpu: {} ({:?}, {:?}); timing by {}",
        info.name,
        info.backend,
        info.device_type,
        ctx.timing_source().name()
    );
    Ok(ctx)
}

/// Every layer on the GPU against the reference (f64 sums of products).
pub fn check(args: &[String]) -> CliResult<bool> {
    let flags = Flags::parse(args, &["layers", "only", "layout", "adapter"], &[])?;
    let layers = layers::from_flags(&flags)?;
    let ctx = context(&flags)?;
    let width = layers.iter().map(|l| l.name.len()).max().unwrap_or(0);
    let (mut passed, mut failed) = (0, 0);
    for layer in &layers {
        let result = Prepared::new(layer).and_then(|p| {
            let reference = p.reference()?;
            let conv = GpuConv2d::new(&ctx, p.params, &p.weights, Some(&p.bias))?;
            let g = &p.geometry;
            let mut plan = conv.plan(g.batch, g.h, g.w)?;
            let mut output = layers::zeros(g.output_len(), "output")?;
            plan.run(&p.input, &mut output)?;
            Ok((plan.kernel_name(), reference.compare_scaled(&output, 1.0)))
        });
        match result {
            Ok((kernel, cmp)) if cmp.passed() => {
                println!(
                    "{:<width$}  PASS  max_abs_err {:.2e}  {kernel}",
                    layer.name, cmp.max_abs
                );
                passed += 1;
            }
            Ok((kernel, cmp)) => {
                println!(
                    "{:<width$}  FAIL  max_abs_err {:.2e}  {kernel}  (worst error {:.1}x its tolerance, {} non-finite)",
                    layer.name, cmp.max_abs, cmp.worst_ratio, cmp.non_finite
                );
                failed += 1;
            }
            Err(e) => {
                println!("{:<width$}  FAIL  {e}", layer.name);
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    Ok(failed == 0)
}

/// Each layer on the GPU: checked once against the CPU path (every core, sums of products),
/// then timed on device tensors (median of --reps dispatches).
pub fn bench(args: &[String]) -> CliResult<bool> {
    let flags = Flags::parse(
        args,
        &["layers", "only", "layout", "adapter", "batch", "reps"],
        &["csv"],
    )?;
    let layers = layers::from_flags(&flags)?;
    let reps: usize = flags.parsed("reps")?.unwrap_or(7).max(1);
    let csv = flags.has("csv");
    let (threads, _) = setup_threads(Some(0))?;
    let ctx = context(&flags)?;
    if csv {
        println!("layer,batch,kernel,ms,gflops,nmse,timing");
    } else {
        println!(
            "{:<30} {:>5} {:<24} {:>10} {:>10} {:>9}",
            "layer", "batch", "kernel", "ms", "GFLOP/s", "nmse"
        );
    }
    let mut ok = true;
    let mut ws = Workspace::new();
    for layer in &layers {
        let result = Prepared::new(layer).and_then(|p| {
            let g = &p.geometry;
            let options = Options {
                threads,
                precision: Precision::Exact,
                ..Options::default()
            };
            let cpu = Conv2d::new(p.params, &p.weights, Some(&p.bias), options)?;
            let mut expected = layers::zeros(g.output_len(), "output")?;
            cpu.plan(g.batch, g.h, g.w)?
                .run(&p.input, &mut expected, &mut ws)?;

            let conv = GpuConv2d::new(&ctx, p.params, &p.weights, Some(&p.bias))?;
            let plan = conv.plan(g.batch, g.h, g.w)?;
            let input = ctx.upload(&p.input)?;
            let mut output = ctx.tensor(g.output_len())?;
            plan.run_device(&input, &mut output, None)?; // warm-up
            let mut times = Vec::with_capacity(reps);
            let mut source = ctx.timing_source();
            for _ in 0..reps {
                let (t, s) = plan.time_device(&input, &mut output, None)?;
                times.push(t);
                source = s;
            }
            times.sort_by(f64::total_cmp);
            let seconds = times[reps / 2];
            let mut got = layers::zeros(g.output_len(), "output")?;
            ctx.download(&output, &mut got)?;
            let (err, norm) = expected
                .iter()
                .zip(&got)
                .fold((0.0, 0.0), |(e, n), (&x, &y)| {
                    (e + ((x - y) as f64).powi(2), n + (x as f64).powi(2))
                });
            let nmse = err / f64::max(norm, f64::MIN_POSITIVE);
            Ok((
                plan.kernel_name(),
                seconds,
                g.flops() / seconds * 1e-9,
                nmse,
                source,
            ))
        });
        match result {
            Ok((kernel, seconds, gflops, nmse, source)) => {
                let good = nmse <= 1e-10;
                ok &= good;
                let flag = if good { "" } else { "  MISMATCH" };
                if csv {
                    println!(
                        "{},{},{kernel},{:.4},{gflops:.1},{nmse:.2e},{}",
                        layer.name,
                        layer.batch,
                        seconds * 1e3,
                        source.name()
                    );
                } else {
                    println!(
                        "{:<30} {:>5} {:<24} {:>10.4} {:>10.1} {:>9.1e}{flag}",
                        layer.name,
                        layer.batch,
                        kernel,
                        seconds * 1e3,
                        gflops,
                        nmse
                    );
                }
            }
            Err(e) => {
                println!("{:<30} FAIL {e}", layer.name);
                ok = false;
            }
        }
    }
    Ok(ok)
}
