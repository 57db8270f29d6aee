//! Per-call timings of one suite layer: best, 10th percentile, median and 90th percentile
//! GFLOP/s over 400 runs, to see the spread that `convkit bench`'s medians hide.
//!
//! `cargo run --release --example timing -- THREADS LAYER [inside] [silu]`:
//! `inside` runs from inside the rayon pool, `silu` adds a fused SiLU.

use convkit::{suite, Activation, Conv2d, Options, Workspace};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(threads), Some(name)) = (args.first().and_then(|t| t.parse().ok()), args.get(1))
    else {
        eprintln!("usage: timing THREADS LAYER [inside] [silu]");
        std::process::exit(2);
    };
    let flag = |f: &str| args.iter().skip(2).any(|a| a == f);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .expect("a thread pool");
    let Some(layer) = suite::builtin()
        .expect("the built-in suite")
        .into_iter()
        .find(|l| &l.name == name)
    else {
        eprintln!("no layer {name} in the suite");
        std::process::exit(2);
    };
    let mut params = layer.params;
    if flag("silu") {
        params.activation = Activation::Silu;
    }
    let weights = vec![0.01f32; params.weights_len().expect("valid layer")];
    let conv = Conv2d::new(params, &weights, None, Options::threads(threads)).expect("valid layer");
    let plan = conv
        .plan(layer.batch, layer.h, layer.w)
        .expect("valid layer");
    let input = vec![0.5f32; plan.input_len()];
    let mut output = vec![0.0f32; plan.output_len()];
    let mut ws = Workspace::new();
    let mut secs = Vec::with_capacity(400);
    let mut body = || {
        for _ in 0..400 {
            let start = Instant::now();
            plan.run(&input, &mut output, &mut ws).expect("run");
            secs.push(start.elapsed().as_secs_f64());
        }
    };
    if flag("inside") {
        rayon::scope(|_| body());
    } else {
        body();
    }
    secs.sort_by(f64::total_cmp);
    let gflop = plan.flops() / 1e9;
    println!(
        "{threads} thread(s) {name}: best {:.1} p10 {:.1} median {:.1} p90 {:.1} GFLOP/s",
        gflop / secs[0],
        gflop / secs[40],
        gflop / secs[200],
        gflop / secs[360]
    );
}
