//! The public SGEMM (the blocked driver and every microkernel variant it picks: full tiles,
//! half-width, short and narrow edge kernels) against an f64 product, at every ISA level.

mod common;

use common::{cases, Rng};
use convkit::{gemm, Isa, Workspace};
use proptest::prelude::*;

/// `C = A·B` in f64 over row-major matrices with leading dimensions.
#[allow(clippy::too_many_arguments)]
fn product(m: usize, n: usize, k: usize, a: &[f32], lda: usize, b: &[f32], ldb: usize) -> Vec<f64> {
    let mut c = vec![0.0f64; m * n];
    for i in 0..m {
        for p in 0..k {
            let aip = a[i * lda + p] as f64;
            for j in 0..n {
                c[i * n + j] += aip * b[p * ldb + j] as f64;
            }
        }
    }
    c
}

/// Runs `m x n x k` with row padding `pad` at every ISA level; each element within the
/// rounding of a length-`k` sum of products of values in [-1, 1); the padding of C untouched.
fn check(m: usize, n: usize, k: usize, pad: usize, seed: u64) {
    let (lda, ldb, ldc) = (k + pad, n + 2 * pad, n + pad);
    let mut rng = Rng::new(seed);
    let a = rng.vec((m - 1) * lda + k);
    let b = rng.vec((k - 1) * ldb + n);
    let want = product(m, n, k, &a, lda, &b, ldb);
    let tol = 4.0 * k as f64 * f32::EPSILON as f64;
    let mut ws = Workspace::new();
    for &isa in Isa::available() {
        let mut c = vec![f32::NAN; (m - 1) * ldc + n + pad];
        gemm::sgemm_with(isa, m, n, k, &a, lda, &b, ldb, &mut c, ldc, &mut ws).unwrap();
        for i in 0..m {
            for j in 0..n {
                let (got, w) = (c[i * ldc + j] as f64, want[i * n + j]);
                assert!(
                    (got - w).abs() <= tol,
                    "{isa:?} {m}x{n}x{k} pad {pad}: C[{i}][{j}] = {got}, want {w}"
                );
            }
            let gap = if i + 1 < m { ldc - n } else { pad };
            let after = &c[i * ldc + n..][..gap];
            assert!(
                after.iter().all(|v| v.is_nan()),
                "{isa:?} {m}x{n}x{k}: row {i} written past its {n} columns"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(200), ..ProptestConfig::default() })]

    /// Widths around every panel edge (a few columns, half panels, full ones) and depths up
    /// to a few K-blocks, so C is accumulated across blocks.
    #[test]
    fn sgemm_matches_f64_product(
        m in 1usize..40,
        n in 1usize..100,
        k in 1usize..700,
        pad in 0usize..3,
        seed in any::<u64>(),
    ) {
        check(m, n, k, pad, seed);
    }
}

/// Every narrow tail past whole 32-wide panels (1..=8 columns alone, 17..=24 as a half panel
/// and a narrow one) with a K that is not a multiple of the kernels' K unrolling, and a depth
/// of several K-blocks.
#[test]
fn narrow_tails_match_f64_product() {
    for tail in (1..=8).chain(17..=24) {
        for (m, k) in [(8, 3), (13, 257), (17, 601)] {
            check(m, 32 + tail, k, 1, tail as u64);
        }
    }
}
