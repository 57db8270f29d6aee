//! Backward passes and transposed convolution against the reference's gradients (f64), at
//! every ISA level, over random shapes; gradient checks by finite differences of the forward
//! reference; error cases.

mod common;

use common::{case, cases, Case, Rng};
use convkit::reference::{self, Reference};
use convkit::{
    Accumulate, Activation, ConvBackward, ConvParams, ConvTranspose1d, ConvTranspose2d, Error, Isa,
    Layout, Options, Padding, Precision, Workspace,
};
use proptest::prelude::*;

/// `r` shifted by `base` (what accumulation adds to): values + base, magnitudes + |base|.
fn plus(r: &Reference, base: &[f32]) -> Reference {
    Reference {
        values: r
            .values
            .iter()
            .zip(base)
            .map(|(v, &b)| v + b as f64)
            .collect(),
        magnitude: r
            .magnitude
            .iter()
            .zip(base)
            .map(|(m, &b)| m + (b as f64).abs())
            .collect(),
        k_len: r.k_len,
    }
}

fn assert_close(what: &str, r: &Reference, out: &[f32], factor: f64) -> Result<(), TestCaseError> {
    let c = r.compare_scaled(out, factor);
    prop_assert!(
        c.passed(),
        "{what}: worst error {:.3}x tolerance at {} (got {}, expected {}), {} non-finite",
        c.worst_ratio,
        c.worst_index,
        out[c.worst_index],
        r.values[c.worst_index],
        c.non_finite
    );
    Ok(())
}

/// Both passes of `case` (its activation dropped) at every ISA and 1 or 2 threads, overwriting
/// and accumulating, against the reference.
fn check_backward(case: &Case) -> Result<(), TestCaseError> {
    let p = ConvParams {
        activation: Activation::None,
        ..case.params
    };
    prop_assume!(p.geometry(case.batch, case.h, case.w).is_ok());
    let mut rng = Rng::new(case.seed);
    let weights = rng.vec(p.weights_len().unwrap());
    let g = p.geometry(case.batch, case.h, case.w).unwrap();
    let (x, dy) = (rng.vec(g.input_len()), rng.vec(g.output_len()));
    let data = reference::backward_data(&p, case.batch, case.h, case.w, &dy, &weights).unwrap();
    let (dw_ref, db_ref) =
        reference::backward_weights(&p, case.batch, case.h, case.w, &x, &dy).unwrap();
    let (dx0, dw0, db0) = (
        rng.vec(g.input_len()),
        rng.vec(weights.len()),
        rng.vec(p.out_channels),
    );
    let mut ws = Workspace::new();
    for &isa in Isa::available() {
        for threads in [1, 2] {
            let opts = Options {
                threads,
                isa: Some(isa),
                ..Options::default()
            };
            let conv = ConvBackward::new(p, &weights, opts).unwrap();
            let plan = conv.plan(case.batch, case.h, case.w).unwrap();
            let name = format!("{isa} {threads}t {}", plan.kernel_name());
            let factor = plan.error_factor();
            let wfactor = plan.weights_error_factor();

            let mut dx = vec![f32::NAN; g.input_len()];
            plan.backward_data(&dy, &mut dx, Accumulate::Overwrite, &mut ws)
                .unwrap();
            assert_close(&format!("data {name}"), &data, &dx, factor)?;
            let mut dx = dx0.clone();
            plan.backward_data(&dy, &mut dx, Accumulate::Add, &mut ws)
                .unwrap();
            assert_close(&format!("data += {name}"), &plus(&data, &dx0), &dx, factor)?;

            let (mut dw, mut db) = (
                vec![f32::NAN; weights.len()],
                vec![f32::NAN; p.out_channels],
            );
            plan.backward_weights(
                &x,
                &dy,
                &mut dw,
                Some(&mut db),
                Accumulate::Overwrite,
                &mut ws,
            )
            .unwrap();
            assert_close(&format!("weights {name}"), &dw_ref, &dw, wfactor)?;
            assert_close(&format!("bias {name}"), &db_ref, &db, 1.0)?;
            let (mut dw, mut db) = (dw0.clone(), db0.clone());
            plan.backward_weights(&x, &dy, &mut dw, Some(&mut db), Accumulate::Add, &mut ws)
                .unwrap();
            assert_close(
                &format!("weights += {name}"),
                &plus(&dw_ref, &dw0),
                &dw,
                wfactor,
            )?;
            assert_close(&format!("bias += {name}"), &plus(&db_ref, &db0), &db, 1.0)?;
        }
    }
    Ok(())
}

/// `case` read as a transposed convolution (its in/out channels, kernel, stride, dilation,
/// groups, layout and epilogue; explicit padding), with an output padding, against the
/// definition.
fn check_transposed(case: &Case, op: [usize; 2]) -> Result<(), TestCaseError> {
    let mut p = case.params;
    if !matches!(p.padding, Padding::Explicit { .. } | Padding::Valid) {
        p.padding = Padding::uniform(1);
    }
    let op = [0, 1].map(|i| op[i] % p.stride[i].max(p.dilation[i]));
    let mut rng = Rng::new(case.seed);
    let weights = rng.vec(p.in_channels * p.out_channels_per_group() * p.kernel[0] * p.kernel[1]);
    let bias = case.bias.then(|| rng.vec(p.out_channels));
    let x = rng.vec(case.batch * p.in_channels * case.h * case.w);
    // The output shape comes from the reference (an error there must be an error here too).
    let probe =
        reference::conv_transpose(&p, op, case.batch, case.h, case.w, &x, &weights, None, None);
    let mut ws = Workspace::new();
    let Ok((_, shape)) = probe else {
        let conv = ConvTranspose2d::new(p, op, &weights, bias.as_deref(), Options::default());
        prop_assert!(conv
            .and_then(|c| c.plan(case.batch, case.h, case.w))
            .is_err());
        return Ok(());
    };
    let residual = case.residual.then(|| rng.vec(shape.iter().product()));
    let (want, _) = reference::conv_transpose(
        &p,
        op,
        case.batch,
        case.h,
        case.w,
        &x,
        &weights,
        bias.as_deref(),
        residual.as_deref(),
    )
    .unwrap();
    for &isa in Isa::available() {
        for threads in [1, 2] {
            let opts = Options {
                threads,
                isa: Some(isa),
                ..Options::default()
            };
            let conv = ConvTranspose2d::new(p, op, &weights, bias.as_deref(), opts).unwrap();
            let plan = conv.plan(case.batch, case.h, case.w).unwrap();
            prop_assert_eq!(plan.output_shape(), shape);
            let mut y = vec![f32::NAN; plan.output_len()];
            match &residual {
                Some(r) => plan.run_with_residual(&x, r, &mut y, &mut ws).unwrap(),
                None => plan.run(&x, &mut y, &mut ws).unwrap(),
            }
            let name = format!("transposed {isa} {threads}t {}", plan.kernel_name());
            assert_close(&name, &want, &y, plan.error_factor())?;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(120)))]

    #[test]
    fn backward_matches_reference(c in case(2)) {
        check_backward(&c)?;
    }

    /// Output channels outnumbering the pixels (the weight gradient's patch GEMM), with every
    /// padding, stride and dilation of `case`.
    #[test]
    fn wide_backward_matches_reference(c in case(1), extra in 0usize..9) {
        let cout_g = 64.max(4 * c.batch * c.h * c.w) + extra;
        let params = ConvParams { out_channels: c.params.groups * cout_g, ..c.params };
        check_backward(&Case { params, ..c })?;
    }

    #[test]
    fn transposed_matches_definition(c in case(2), op in (0usize..3, 0usize..3)) {
        check_transposed(&c, [op.0, op.1])?;
    }
}

/// Layers of the suite's kinds at sizes where the GEMM blocks and every path are crossed:
/// Winograd through the stride-1 forward path, strided col2im, depthwise with and without
/// stride, grouped.
#[test]
fn backward_on_layer_shapes() {
    let shapes = [
        // (c_in, c_out, k, stride, pad, groups, h)
        (32, 48, 3, 1, 1, 1, 12),
        (24, 40, 3, 2, 1, 1, 15),
        (40, 24, 1, 2, 0, 1, 14),
        // 1x1 stride 1, unpadded: NCHW weight gradients pack the input planes directly, in
        // either orientation of the GEMM (many inputs / many outputs), and grouped.
        (72, 12, 1, 1, 0, 1, 14),
        (12, 72, 1, 1, 0, 1, 11),
        (48, 40, 1, 1, 0, 2, 13),
        // At least 64 output channels a group and 4x the pixels: the weight gradients'
        // patch GEMM (and a layer of as many channels and more pixels, for the tap GEMMs).
        (12, 72, 3, 2, 1, 1, 3),
        (12, 72, 3, 2, 1, 1, 11),
        (20, 260, 3, 1, 1, 2, 2),
        (48, 48, 3, 1, 1, 48, 20),
        (48, 48, 3, 2, 1, 48, 21),
        (40, 40, 7, 1, 3, 40, 10),
        // Depthwise weight gradients over images large enough for several bands of rows.
        (16, 16, 3, 1, 1, 16, 50),
        (24, 24, 3, 2, 1, 24, 75),
        // The 3x3 stride-2 depthwise backward-data path: an even height and an odd width;
        // with a channel multiplier of 2, the general stride-phase path.
        (16, 16, 3, 2, 1, 16, 10),
        (16, 32, 3, 2, 1, 16, 11),
        (64, 64, 3, 1, 1, 8, 10),
        (3, 16, 7, 2, 3, 1, 23),
        // NCHW 3x3 stride-1 depthwise weight gradients on wide images: the plane path's
        // passes of four output rows (with one and two rows left over), its output gradient
        // read in place (64 wide) or copied into whole lanes (65 wide).
        (8, 8, 3, 1, 1, 8, 61),
        (8, 8, 3, 1, 1, 8, 62),
        // Winograd weight gradients (`winograd_weight_tiles` checks which tile each takes):
        // F(4,3) with ragged tiles, F(4,3) unpadded, grouped, and F(2,3).
        (20, 36, 3, 1, 1, 1, 23),
        (16, 24, 3, 1, 0, 1, 17),
        (32, 40, 3, 1, 1, 2, 13),
        (16, 24, 3, 1, 1, 1, 9),
    ];
    for (i, &(ci, co, k, s, pad, groups, h)) in shapes.iter().enumerate() {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let case = Case {
                params: ConvParams::conv2d(ci, co, [k, k])
                    .with_stride([s, s])
                    .with_padding(Padding::uniform(pad))
                    .with_groups(groups)
                    .with_layout(layout),
                batch: 2,
                h,
                w: h + 3,
                bias: true,
                residual: true,
                seed: i as u64,
            };
            check_backward(&case).unwrap();
            check_transposed(&case, [s - 1, 0]).unwrap();
        }
    }
    // A 5x3 depthwise kernel on a wide image: the plane path's passes of three tap rows
    // and then two.
    let case = Case {
        params: ConvParams::conv2d(8, 8, [5, 3])
            .with_padding(Padding::symmetric(2, 1))
            .with_groups(8),
        batch: 2,
        h: 9,
        w: 70,
        bias: true,
        residual: false,
        seed: 98,
    };
    check_backward(&case).unwrap();
    // The 3x3 stride-2 depthwise backward-data path with bottom and right padding beyond the
    // kernel's reach (more output-gradient columns than it reads).
    let case = Case {
        params: ConvParams::conv2d(8, 8, [3, 3])
            .with_stride([2, 2])
            .with_padding(Padding::Explicit {
                top: 1,
                bottom: 5,
                left: 1,
                right: 6,
            })
            .with_groups(8),
        batch: 2,
        h: 9,
        w: 20,
        bias: true,
        residual: true,
        seed: 97,
    };
    check_backward(&case).unwrap();
    // A 1-D 3-tap layer long enough for Winograd weight gradients.
    let case = Case {
        params: ConvParams::conv2d(24, 16, [1, 3]).with_padding(Padding::symmetric(0, 1)),
        batch: 2,
        h: 1,
        w: 77,
        bias: true,
        residual: false,
        seed: 99,
    };
    check_backward(&case).unwrap();
}

/// The weight-gradient path `backward_on_layer_shapes` relies on, at the best ISA level:
/// F(4,3) where it has 32 tiles, F(2,3) where only that does, the tap GEMMs under
/// `Precision::Exact`, and no Winograd on too few channels.
#[test]
fn winograd_weight_tiles() {
    let name = |params: ConvParams, h: usize, options: Options| {
        let weights = vec![0.1; params.weights_len().unwrap()];
        let plan = ConvBackward::new(params, &weights, options)
            .unwrap()
            .plan(2, h, h + 3)
            .unwrap();
        plan.kernel_name()
    };
    let p = |ci, co, pad, groups| {
        ConvParams::conv2d(ci, co, [3, 3])
            .with_padding(Padding::uniform(pad))
            .with_groups(groups)
    };
    let best = Options::default();
    for (params, h, tile) in [
        (p(20, 36, 1, 1), 23, "f4_2d"),
        (p(16, 24, 0, 1), 17, "f4_2d"),
        (p(32, 40, 1, 2), 13, "f4_2d"),
        (p(16, 24, 1, 1), 9, "f2_2d"),
    ] {
        let k = name(params, h, best);
        // The SIMD levels' GEMM panels hold whole transform vectors; a build whose best level
        // is scalar is not asserted on the tile.
        if Isa::default_level().unwrap() != Isa::Scalar {
            assert!(
                k.contains(&format!("weights: winograd/wino_f32_{tile}")),
                "{k}"
            );
        }
        let exact = Options {
            precision: Precision::Exact,
            ..best
        };
        assert!(
            name(params, h, exact).contains("weights: tap_gemm"),
            "exact: {k}"
        );
    }
    let narrow = name(p(8, 24, 1, 1), 23, best);
    assert!(!narrow.contains("weights: winograd"), "{narrow}");
    // Output channels outnumbering the pixels and no Winograd: one GEMM over the patch matrix.
    let wide = name(p(12, 72, 1, 1).with_stride([2, 2]), 3, best);
    assert!(wide.contains("weights: patch_gemm"), "{wide}");
    let exact = Options {
        precision: Precision::Exact,
        ..best
    };
    let wide = name(p(16, 64, 1, 1), 1, exact);
    assert!(wide.contains("weights: patch_gemm"), "{wide}");
    let large = name(p(16, 64, 1, 1), 9, exact);
    assert!(large.contains("weights: tap_gemm"), "{large}");
}

/// `Σ r · conv(x, w, b)` from the forward reference (f64 accumulation).
#[allow(clippy::too_many_arguments)]
fn loss(
    p: &ConvParams,
    n: usize,
    h: usize,
    w: usize,
    x: &[f32],
    wt: &[f32],
    b: &[f32],
    r: &[f32],
) -> f64 {
    let y = reference::conv(p, n, h, w, x, wt, Some(b), None).unwrap();
    y.values.iter().zip(r).map(|(y, &r)| y * r as f64).sum()
}

/// Values on a grid of 1/64 in [-1, 1]: `v ± 1/16` is exact in f32, so the central difference
/// of the (linear) loss is exact up to the f64 sums.
fn grid(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.uniform() * 64.0).round() / 64.0)
        .collect()
}

/// Finite differences of the forward reference agree with the backward passes, for every
/// element of small dense, grouped, strided, dilated and depthwise convolutions.
#[test]
fn gradients_match_finite_differences() {
    let shapes = [
        ConvParams::conv2d(3, 4, [3, 3]).with_padding(Padding::Same),
        ConvParams::conv2d(4, 6, [3, 2])
            .with_groups(2)
            .with_stride([2, 1])
            .with_padding(Padding::Explicit {
                top: 1,
                bottom: 0,
                left: 2,
                right: 1,
            }),
        ConvParams::conv2d(2, 4, [3, 3])
            .with_groups(2)
            .with_dilation([2, 1])
            .with_layout(Layout::Nhwc),
        ConvParams::conv2d(3, 3, [5, 5])
            .with_groups(3)
            .with_stride([2, 2])
            .with_padding(Padding::uniform(2)),
        ConvParams::conv1d(2, 3, 4)
            .with_stride([1, 3])
            .with_padding(Padding::SameLower),
    ];
    let h_step = 1.0f32 / 16.0;
    let mut ws = Workspace::new();
    for (i, p) in shapes.iter().enumerate() {
        let (n, h, w) = (2, if p.kernel[0] == 1 { 1 } else { 7 }, 6);
        let g = p.geometry(n, h, w).unwrap();
        let mut rng = Rng::new(100 + i as u64);
        let (x, wt, b, r) = (
            grid(&mut rng, g.input_len()),
            grid(&mut rng, p.weights_len().unwrap()),
            grid(&mut rng, p.out_channels),
            grid(&mut rng, g.output_len()),
        );
        let plan = ConvBackward::new(*p, &wt, Options::default())
            .unwrap()
            .plan(n, h, w)
            .unwrap();
        let mut dx = vec![0.0; x.len()];
        plan.backward_data(&r, &mut dx, Accumulate::Overwrite, &mut ws)
            .unwrap();
        let (mut dw, mut db) = (vec![0.0; wt.len()], vec![0.0; b.len()]);
        plan.backward_weights(
            &x,
            &r,
            &mut dw,
            Some(&mut db),
            Accumulate::Overwrite,
            &mut ws,
        )
        .unwrap();
        let diff = |f: &dyn Fn(f32) -> f64| (f(h_step) - f(-h_step)) / (2.0 * h_step as f64);
        let check = |what: &str, j: usize, fd: f64, got: f32| {
            assert!(
                (fd - got as f64).abs() <= 1e-5 * (1.0 + fd.abs()),
                "shape {i} {what}[{j}]: finite difference {fd}, backward pass {got}"
            );
        };
        for j in 0..x.len() {
            let fd = diff(&|e| {
                let mut x = x.clone();
                x[j] += e;
                loss(p, n, h, w, &x, &wt, &b, &r)
            });
            check("dx", j, fd, dx[j]);
        }
        for j in 0..wt.len() {
            let fd = diff(&|e| {
                let mut wt = wt.clone();
                wt[j] += e;
                loss(p, n, h, w, &x, &wt, &b, &r)
            });
            check("dw", j, fd, dw[j]);
        }
        for j in 0..b.len() {
            let fd = diff(&|e| {
                let mut b = b.clone();
                b[j] += e;
                loss(p, n, h, w, &x, &wt, &b, &r)
            });
            check("db", j, fd, db[j]);
        }
    }
}

/// A 1-D transposed convolution is the 2-D one with height 1.
#[test]
fn transposed_1d_front() {
    let p = ConvParams::conv1d(6, 4, 5)
        .with_stride([1, 3])
        .with_padding(Padding::symmetric(0, 2));
    let mut rng = Rng::new(7);
    let (wt, x) = (rng.vec(6 * 4 * 5), rng.vec(2 * 6 * 9));
    let conv = ConvTranspose1d::new(p, 2, &wt, None, Options::default()).unwrap();
    let plan = conv.plan(2, 9).unwrap();
    assert_eq!(plan.output_shape(), [2, 4, 1, (9 - 1) * 3 - 4 + 5 + 2]);
    let mut y = vec![0.0; plan.output_len()];
    plan.run(&x, &mut y, &mut Workspace::new()).unwrap();
    let (want, _) = reference::conv_transpose(&p, [0, 2], 2, 1, 9, &x, &wt, None, None).unwrap();
    assert!(want.compare(&y).passed());
}

#[test]
fn bad_input_is_an_error() {
    let p = ConvParams::conv2d(4, 8, [3, 3]);
    let w = vec![0.0; 8 * 4 * 9];
    let relu = p.with_activation(Activation::Relu);
    assert!(matches!(
        ConvBackward::new(relu, &w, Options::default()),
        Err(Error::InvalidParameter {
            what: "activation",
            ..
        })
    ));
    assert!(matches!(
        ConvBackward::new(p, &w[1..], Options::default()),
        Err(Error::WrongLength {
            what: "weights",
            ..
        })
    ));
    let plan = ConvBackward::new(p, &w, Options::default())
        .unwrap()
        .plan(1, 8, 8)
        .unwrap();
    let mut ws = Workspace::new();
    let (dy, mut dx) = (vec![0.0; plan.output_len()], vec![0.0; plan.input_len()]);
    assert!(matches!(
        plan.backward_data(&dy[1..], &mut dx, Accumulate::Overwrite, &mut ws),
        Err(Error::WrongLength {
            what: "grad_output",
            ..
        })
    ));
    let mut dw = vec![0.0; w.len()];
    let mut db = vec![0.0; 7];
    assert!(matches!(
        plan.backward_weights(&dx, &dy, &mut dw, Some(&mut db), Accumulate::Add, &mut ws),
        Err(Error::WrongLength {
            what: "grad_bias",
            ..
        })
    ));
    assert!(matches!(
        ConvBackward::new(p, &w, Options::default())
            .unwrap()
            .plan(1, 2, 8),
        Err(Error::KernelTooLarge { .. })
    ));

    // Transposed: output padding at or past both stride and dilation, padding that leaves
    // nothing, a bias of the wrong length.
    let t = ConvParams::conv2d(8, 4, [3, 3]).with_stride([2, 2]);
    assert!(matches!(
        ConvTranspose2d::new(t, [2, 0], &w, None, Options::default()),
        Err(Error::InvalidParameter {
            what: "output padding",
            ..
        })
    ));
    assert!(matches!(
        ConvTranspose2d::new(t, [0, 0], &w, Some(&[0.0; 8]), Options::default()),
        Err(Error::WrongLength { what: "bias", .. })
    ));
    let wide = t.with_padding(Padding::uniform(3));
    let conv = ConvTranspose2d::new(wide, [0, 0], &w, None, Options::default()).unwrap();
    assert!(conv.plan(1, 1, 4).is_err());
    assert!(matches!(
        conv.plan(0, 4, 4),
        Err(Error::Zero { what: "batch" })
    ));
    assert!(matches!(
        conv.plan(1, usize::MAX / 2, 4),
        Err(Error::Overflow { .. })
    ));
    // ONNX auto padding (output = input x stride), and an input whose output overflows.
    let same = t.with_padding(Padding::Same);
    let same = ConvTranspose2d::new(same, [1, 1], &w, None, Options::default()).unwrap();
    assert_eq!(same.plan(1, 5, 6).unwrap().output_shape(), [1, 4, 10, 12]);
    assert!(matches!(
        same.plan(1, usize::MAX / 2 + 1, 4),
        Err(Error::Overflow { .. })
    ));
}
