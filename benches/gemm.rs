//! The blocked GEMM at M = N = K = 512 (and a conv-shaped GEMM), one thread, per ISA level.
//! GFLOP/s = elements/s reported by criterion x 2 (one element = one multiply-add).

use convkit::{gemm, Isa, Workspace};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

fn bench_gemm(c: &mut Criterion) {
    let mut group = c.benchmark_group("sgemm");
    for &(m, n, k) in &[(512usize, 512usize, 512usize), (128, 784, 1152)] {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) / 8.0)
            .collect();
        let mut out = vec![0.0f32; m * n];
        let mut ws = Workspace::new();
        group.throughput(Throughput::Elements((m * n * k) as u64));
        for &isa in Isa::available() {
            group.bench_with_input(
                BenchmarkId::new(format!("{m}x{n}x{k}"), isa),
                &isa,
                |bench, &isa| {
                    bench.iter(|| {
                        gemm::sgemm_with(isa, m, n, k, &a, k, &b, n, &mut out, n, &mut ws).unwrap()
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, bench_gemm);
criterion_main!(benches);
