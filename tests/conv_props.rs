//! Property tests: every algorithm at every ISA level this CPU has, against the reference,
//! over random shapes, layouts, paddings, groups, strides, dilations and epilogues.

mod common;

use common::{case, cases, Case, Rng};
use convkit::{
    reference, Algorithm, Conv2d, ConvParams, Error, Isa, Layout, Options, Padding, Workspace,
};
use proptest::prelude::*;

/// Runs `case` with every algorithm, ISA and thread count and compares with the reference.
fn check(case: &Case) -> Result<(), TestCaseError> {
    let p = &case.params;
    // Shapes whose kernel does not fit the padded input are rejected by both; skip them.
    prop_assume!(p.geometry(case.batch, case.h, case.w).is_ok());
    let mut rng = Rng::new(case.seed);
    let weights = rng.vec(p.weights_len().unwrap());
    let bias = case.bias.then(|| rng.vec(p.out_channels));
    let g = p.geometry(case.batch, case.h, case.w).unwrap();
    let input = rng.vec(g.input_len());
    let residual = case.residual.then(|| rng.vec(g.output_len()));
    let reference = reference::conv(
        p,
        case.batch,
        case.h,
        case.w,
        &input,
        &weights,
        bias.as_deref(),
        residual.as_deref(),
    )
    .unwrap();
    let mut ws = Workspace::new();
    // The choice (None), then every algorithm that takes the shape.
    let algorithms = std::iter::once(None).chain(Algorithm::ALL.map(Some));
    for &isa in Isa::available() {
        for algorithm in algorithms.clone() {
            for threads in [1, 2] {
                let opts = Options {
                    threads,
                    isa: Some(isa),
                    algorithm,
                    kernel: None,
                    precision: convkit::Precision::Balanced,
                    input_hint: Some([case.h, case.w]),
                };
                let conv = match Conv2d::new(*p, &weights, bias.as_deref(), opts) {
                    Err(Error::AlgorithmUnsupported { .. }) if algorithm.is_some() => continue,
                    r => r.unwrap(),
                };
                let plan = conv.plan(case.batch, case.h, case.w).unwrap();
                let mut out = vec![f32::NAN; plan.output_len()];
                match &residual {
                    Some(r) => plan
                        .run_with_residual(&input, r, &mut out, &mut ws)
                        .unwrap(),
                    None => plan.run(&input, &mut out, &mut ws).unwrap(),
                }
                let c = reference.compare_scaled(&out, plan.error_factor());
                prop_assert!(
                    c.passed(),
                    "{} at {isa}, {threads} threads: error {:e} at {} is {:.2}x the tolerance {:e} ({} non-finite)",
                    plan.kernel_name(),
                    c.max_abs,
                    c.worst_index,
                    c.worst_ratio,
                    plan.error_factor() * reference.tolerance(c.worst_index),
                    c.non_finite
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(1000),
        // About one random shape in six has a kernel larger than its padded input.
        max_global_rejects: cases(1000).max(1024),
        ..ProptestConfig::default()
    })]
    #[test]
    fn small_shapes_match_reference(case in case(1)) {
        check(&case)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(1000) / 10, ..ProptestConfig::default() })]
    #[test]
    fn larger_shapes_match_reference(case in case(8)) {
        check(&case)?;
    }
}

/// 1-D convolutions of every stride/dilation/padding mix: taps share shifted copies along x.
fn case_1d() -> impl Strategy<Value = Case> {
    (
        1usize..3,
        1usize..12,
        1usize..40,
        1usize..11,
        1usize..6,
        1usize..4,
        0usize..6,
        0usize..6,
        1usize..300,
        any::<u64>(),
    )
        .prop_map(|(groups, cin_g, cout_g, k, s, d, left, right, len, seed)| {
            let params = ConvParams::conv1d(groups * cin_g, groups * cout_g, k)
                .with_groups(groups)
                .with_stride([1, s])
                .with_dilation([1, d])
                .with_padding(Padding::Explicit {
                    top: 0,
                    bottom: 0,
                    left,
                    right,
                });
            Case {
                params,
                batch: 1 + (seed % 2) as usize,
                h: 1,
                w: len,
                bias: seed % 3 == 0,
                residual: seed % 5 == 0,
                seed,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(1000) / 3, ..ProptestConfig::default() })]
    #[test]
    fn conv1d_shapes_match_reference(case in case_1d()) {
        check(&case)?;
    }
}

/// Shapes that cross every blocking boundary of the GEMM driver: K > 256 (several K-blocks of
/// packed panels) and K > 512 (several K-blocks read through row pointers, as AMD CPUs block
/// them), M > 144 (several M-blocks), more than 512 pixels (several N-blocks), both layouts; and
/// 45x45 images, whose im2col items at two threads are cut four ways along the pixels with a
/// ragged last piece (the unit test in `im2col_gemm.rs` pins that cut).
#[test]
fn blocking_boundaries_match_reference() {
    for (layout, cin, cout, hw, k) in [
        (Layout::Nchw, 40, 150, 27, 3),
        (Layout::Nhwc, 40, 150, 27, 3),
        (Layout::Nchw, 8, 20, 45, 3),
        (Layout::Nhwc, 8, 20, 45, 3),
        (Layout::Nchw, 300, 20, 24, 1),
        (Layout::Nhwc, 300, 20, 24, 1),
        (Layout::Nchw, 72, 20, 14, 3),
        (Layout::Nchw, 600, 20, 12, 1),
    ] {
        let p = ConvParams::conv2d(cin, cout, [k, k])
            .with_padding(Padding::Same)
            .with_layout(layout);
        let case = Case {
            params: p,
            batch: 2,
            h: hw,
            w: hw,
            bias: true,
            residual: true,
            seed: 7,
        };
        check(&case).unwrap();
    }
}

/// Strides 2-4 along x with kernels at least as wide (the random shapes stop at stride 3):
/// the im2col fill that de-interleaves the taps side by side, with runs shorter than 16
/// pixels, of whole 16s and with a ragged rest, padded on either side or not, the 4x4
/// stride-4 patchify stem among them.
#[test]
fn strided_taps_match_reference() {
    for (cin, cout, h, w, k, s, pad) in [
        (3, 10, 12, 148, 4, 4, 0),
        (2, 9, 9, 71, 3, 2, 1),
        (2, 7, 7, 50, 5, 3, 2),
        (3, 8, 8, 22, 4, 4, 1),
        (2, 6, 9, 90, 7, 4, 3),
        (1, 5, 6, 64, 4, 4, 0),
    ] {
        let p = ConvParams::conv2d(cin, cout, [k, k])
            .with_stride([s, s])
            .with_padding(Padding::Explicit {
                top: pad,
                bottom: pad,
                left: pad,
                right: pad,
            });
        let case = Case {
            params: p,
            batch: 2,
            h,
            w,
            bias: true,
            residual: false,
            seed: 11,
        };
        check(&case).unwrap();
    }
}

/// 1-D convolutions through `Conv1d`, with the strided 3-tap shape of Whisper's front end.
#[test]
fn conv1d_matches_reference() {
    for (cin, cout, len, k, s, pad) in [
        (8, 12, 101, 3, 2, 1),
        (1, 16, 400, 10, 5, 0),
        (20, 20, 37, 3, 1, 1),
        (200, 24, 300, 3, 2, 1),
    ] {
        let p = ConvParams::conv1d(cin, cout, k)
            .with_stride([1, s])
            .with_padding(Padding::Explicit {
                top: 0,
                bottom: 0,
                left: pad,
                right: pad,
            });
        let mut rng = Rng::new(3);
        let weights = rng.vec(p.weights_len().unwrap());
        let input = rng.vec(2 * cin * len);
        let conv = convkit::Conv1d::new(p, &weights, None, Options::threads(1)).unwrap();
        let plan = conv.plan(2, len).unwrap();
        let mut out = vec![0.0; plan.output_len()];
        plan.run(&input, &mut out, &mut Workspace::new()).unwrap();
        let r = reference::conv(&p, 2, 1, len, &input, &weights, None, None).unwrap();
        let c = r.compare_scaled(&out, plan.error_factor());
        assert!(c.passed(), "{} {c:?}", plan.kernel_name());
    }
}

/// The NEON kernels must actually be exercised when the tests run on aarch64 (under qemu in CI).
#[cfg(target_arch = "aarch64")]
#[test]
fn neon_is_detected_on_aarch64() {
    assert!(
        Isa::available().contains(&Isa::Neon),
        "{:?}",
        Isa::available()
    );
}

/// Images narrower than the kernel with 'same' output width: im2col's shifted copies move the
/// plane by more than its length (the 9x1 image with a 2x4 kernel once read out of bounds).
#[test]
fn copies_shifted_past_tiny_planes_match_reference() {
    for (h, w, k, padding) in [
        (9, 1, [2, 4], Padding::Same),
        (1, 1, [3, 7], Padding::Same),
        (3, 2, [3, 5], Padding::SameLower),
        (
            2,
            1,
            [1, 7],
            Padding::Explicit {
                top: 0,
                bottom: 0,
                left: 6,
                right: 0,
            },
        ),
        (
            4,
            2,
            [2, 6],
            Padding::Explicit {
                top: 1,
                bottom: 0,
                left: 0,
                right: 5,
            },
        ),
    ] {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let p = ConvParams::conv2d(2, 3, k)
                .with_padding(padding)
                .with_layout(layout);
            let case = Case {
                params: p,
                batch: 2,
                h,
                w,
                bias: true,
                residual: false,
                seed: 3,
            };
            check(&case).unwrap();
        }
    }
}
