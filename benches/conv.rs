//! Criterion benches over the layer suite, one thread: a group per kernel family (depthwise,
//! grouped, stem, winograd: dense 3x3 and 1x3 stride 1, dense: the rest), each layer at every
//! ISA level this CPU has, with the algorithm convkit chooses for the layer's size. Filter with criterion's own argument:
//! `cargo bench --bench conv -- depthwise/` or `-- resnet50_l2_3x3`.
//! GFLOP/s = elements/s reported by criterion x 2 (one element = one multiply-add).

use convkit::{suite, Conv2d, Isa, Options, Workspace};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn bench_suite(c: &mut Criterion) {
    let layers = suite::builtin().unwrap();
    for family in ["depthwise", "grouped", "stem", "winograd", "dense"] {
        let mut group = c.benchmark_group(family);
        group.sample_size(20);
        for layer in layers.iter().filter(|l| l.family() == family) {
            let p = layer.params;
            let weights: Vec<f32> = (0..p.weights_len().unwrap())
                .map(|i| ((i % 17) as f32 - 8.0) / 16.0)
                .collect();
            group.throughput(Throughput::Elements(
                (layer.geometry().unwrap().flops() / 2.0) as u64,
            ));
            for &isa in Isa::available() {
                let opts = Options {
                    threads: 1,
                    isa: Some(isa),
                    input_hint: Some([layer.h, layer.w]),
                    ..Options::default()
                };
                let plan = Conv2d::new(p, &weights, None, opts)
                    .unwrap()
                    .plan(layer.batch, layer.h, layer.w)
                    .unwrap();
                let input: Vec<f32> = (0..plan.input_len())
                    .map(|i| ((i % 13) as f32 - 6.0) / 8.0)
                    .collect();
                let mut out = vec![0.0; plan.output_len()];
                let mut ws = Workspace::new();
                group.bench_with_input(BenchmarkId::new(&layer.name, isa), &isa, |b, _| {
                    b.iter(|| plan.run(&input, &mut out, &mut ws).unwrap())
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, bench_suite);
criterion_main!(benches);
