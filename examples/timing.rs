use convkit::*;
use std::time::Instant;
fn main() {
    let t: usize = std::env::args().nth(1).unwrap().parse().unwrap();
    let name = std::env::args().nth(2).unwrap();
    rayon::ThreadPoolBuilder::new()
        .num_threads(t)
        .build_global()
        .unwrap();
    let layer = suite::builtin()
        .unwrap()
        .into_iter()
        .find(|l| l.name == name)
        .unwrap();
    let p = layer.params;
    let w = vec![0.01f32; p.weights_len().unwrap()];
    let conv = Conv2d::new(p, &w, None, Options::threads(t)).unwrap();
    let plan = conv.plan(layer.batch, layer.h, layer.w).unwrap();
    let x = vec![0.5f32; plan.input_len()];
    let mut y = vec![0.0f32; plan.output_len()];
    let mut ws = Workspace::new();
    let mut ts = vec![];
    for _ in 0..400 {
        let s = Instant::now();
        plan.run(&x, &mut y, &mut ws).unwrap();
        ts.push(s.elapsed().as_secs_f64());
    }
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let f = plan.flops() / 1e9;
    println!(
        "t={t} {name}: best {:.1} p10 {:.1} median {:.1} p90 {:.1} GFLOP/s",
        f / ts[0],
        f / ts[40],
        f / ts[200],
        f / ts[360]
    );
}
