//! The per-core f32 peak, measured with a tight loop of independent FMA chains, so that
//! `bench` can say how close each kernel gets to what the core can do.

#[cfg(target_arch = "x86_64")]
use convkit::Isa;
use std::hint::black_box;
use std::time::{Duration, Instant};

/// Independent accumulator chains: more than FMA latency x FMA ports (4 x 2 on current
/// cores), so the loop is bound by throughput, not latency.
const CHAINS: usize = 12;

/// Iterations of one timed chunk (a few milliseconds).
const CHUNK: u64 = 1 << 18;

/// Per-core peak in GFLOP/s, and how it was measured.
pub fn measure() -> (f64, &'static str) {
    let budget = Duration::from_millis(300);
    let start = Instant::now();
    let (flops_per_iter, how, run): (f64, &'static str, fn(u64)) = pick();
    // The best chunk: the first ones may run before the clock has ramped up.
    let mut best = 0.0f64;
    while start.elapsed() < budget {
        let t = Instant::now();
        run(CHUNK);
        let secs = t.elapsed().as_secs_f64().max(1e-9);
        best = best.max(flops_per_iter * CHUNK as f64 / secs / 1e9);
    }
    (best, how)
}

/// The widest FMA loop this CPU can run: (flops per iteration, description, loop).
#[cfg(target_arch = "x86_64")]
fn pick() -> (f64, &'static str, fn(u64)) {
    let available = Isa::available();
    if available.contains(&Isa::Avx512) {
        // SAFETY: `Isa::available()` lists Avx512 only when the CPU (and OS) support AVX-512F,
        // the only feature `fma_avx512` is compiled for.
        (CHAINS as f64 * 16.0 * 2.0, "avx512 FMA loop", |n| unsafe {
            fma_avx512(n)
        })
    } else if available.contains(&Isa::Avx2) {
        // SAFETY: `Isa::available()` lists Avx2 only for x86-64-v3 CPUs, which have AVX2 and FMA,
        // the features `fma_avx2` is compiled for.
        (CHAINS as f64 * 8.0 * 2.0, "avx2 FMA loop", |n| unsafe {
            fma_avx2(n)
        })
    } else {
        (CHAINS as f64 * 2.0, "scalar estimate", fma_scalar)
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn pick() -> (f64, &'static str, fn(u64)) {
    (CHAINS as f64 * 2.0, "scalar estimate", fma_scalar)
}

/// `acc = acc * m + a` converges to 1: no overflow, no denormals, whatever `iters` is. The
/// loops take every value through `black_box`: 1 is a fixed point, so with constants the
/// compiler could fold the whole loop away.
const M: f32 = 0.999_9;
const A: f32 = 1e-4;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64) {
    use core::arch::x86_64::*;
    let (m, a) = (_mm256_set1_ps(black_box(M)), _mm256_set1_ps(black_box(A)));
    let mut acc = [_mm256_set1_ps(black_box(1.0)); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, m, a);
        }
    }
    black_box(acc);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_avx512(iters: u64) {
    use core::arch::x86_64::*;
    let (m, a) = (_mm512_set1_ps(black_box(M)), _mm512_set1_ps(black_box(A)));
    let mut acc = [_mm512_set1_ps(black_box(1.0)); CHAINS];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, m, a);
        }
    }
    black_box(acc);
}

/// Two flops per chain and iteration, whatever the compiler makes of it: an estimate only
/// (pass `--peak` for a real figure on such machines).
fn fma_scalar(iters: u64) {
    let (m, a) = (black_box(M), black_box(A));
    let mut acc = black_box([1.0f32; CHAINS]);
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = *x * m + a;
        }
    }
    black_box(acc);
}
