//! f16 and bf16 storage: every algorithm (the choice and each forced one), at every ISA level
//! this CPU has, both layouts, 16-bit and f32 outputs, against the reference and the f32 path,
//! with bounds made of the storage types' unit roundoff.
//!
//! - Against the reference on the rounded data (the inputs, weights, bias and residual the
//!   16-bit run sees, widened): the only errors left are the f32 arithmetic's (the f32
//!   tolerance, Winograd's factor included) and one rounding of the output, `u_O·|y|`.
//! - Against the f32 path on the data before rounding: inputs and weights carry one rounding
//!   each, so a sum of products moves by at most `(2u + u²)·Σ|x·w|` (bias and residual by `u`
//!   of themselves), the activation at most multiplies that by its slope (below 1.2), and the
//!   output store adds `u_O·|y|`.

mod common;

use common::{case, cases, Case, Rng};
use convkit::{
    bf16, f16, reference, Algorithm, Conv2d, Error, Isa, Options, Plan, Storage, StorageType,
    Workspace,
};
use proptest::prelude::*;

/// `xs` rounded to `T`.
fn round<T: Storage>(xs: &[f32]) -> Vec<T> {
    xs.iter().map(|&x| T::from_f32(x)).collect()
}

fn widen<T: Storage>(xs: &[T]) -> Vec<f32> {
    xs.iter().map(|x| x.to_f32()).collect()
}

/// The smallest normal number's rounding (absolute), for outputs near zero.
fn tiny(t: StorageType) -> f64 {
    match t {
        StorageType::F16 => (-25f64).exp2(),
        _ => 1e-30,
    }
}

fn run<I: Storage, O: Storage>(
    plan: &Plan,
    input: &[I],
    residual: Option<&[O]>,
    ws: &mut Workspace,
) -> Vec<f32> {
    let mut out = vec![O::from_f32(f32::NAN); plan.output_len()];
    match residual {
        Some(r) => plan.run_storage_with_residual(input, r, &mut out, ws),
        None => plan.run_storage(input, &mut out, ws),
    }
    .unwrap();
    widen(&out)
}

/// Runs `case` stored as `I` (input, weights, bias) and `O` (output, residual) with every
/// algorithm and ISA, and checks it against the reference on the rounded data.
fn check<I: Storage, O: Storage>(case: &Case) -> Result<(), TestCaseError> {
    let p = &case.params;
    prop_assume!(p.geometry(case.batch, case.h, case.w).is_ok());
    let mut rng = Rng::new(case.seed);
    let weights: Vec<I> = round(&rng.vec(p.weights_len().unwrap()));
    let bias: Option<Vec<I>> = case.bias.then(|| round(&rng.vec(p.out_channels)));
    let g = p.geometry(case.batch, case.h, case.w).unwrap();
    let input: Vec<I> = round(&rng.vec(g.input_len()));
    let residual: Option<Vec<O>> = case.residual.then(|| round(&rng.vec(g.output_len())));
    let reference = reference::conv(
        p,
        case.batch,
        case.h,
        case.w,
        &widen(&input),
        &widen(&weights),
        bias.as_ref().map(|b| widen(b)).as_deref(),
        residual.as_ref().map(|r| widen(r)).as_deref(),
    )
    .unwrap();
    let u = O::TYPE.unit_roundoff();
    let mut ws = Workspace::new();
    let algorithms = std::iter::once(None).chain(Algorithm::ALL.map(Some));
    for &isa in Isa::available() {
        for algorithm in algorithms.clone() {
            let threads = 1 + (case.seed % 2) as usize;
            let opts = Options {
                threads,
                isa: Some(isa),
                algorithm,
                input_hint: Some([case.h, case.w]),
                ..Options::default()
            };
            let conv = match Conv2d::from_storage(*p, &weights, bias.as_deref(), opts) {
                Err(Error::AlgorithmUnsupported { .. }) if algorithm.is_some() => continue,
                r => r.unwrap(),
            };
            let plan = conv.plan(case.batch, case.h, case.w).unwrap();
            let out = run(&plan, &input, residual.as_deref(), &mut ws);
            let f = plan.error_factor();
            // Winograd's error comes from its whole tile: at least an average output's.
            let floor = if f > 1.0 {
                let mean = reference.magnitude.iter().sum::<f64>() / out.len() as f64;
                8.0 * (f32::EPSILON as f64 / 2.0) * ((reference.k_len as f64).sqrt() + 2.0) * mean
            } else {
                0.0
            };
            for (i, (&y, &r)) in out.iter().zip(&reference.values).enumerate() {
                let arith = f * reference.tolerance(i).max(floor);
                let bound = arith * (1.0 + u) + u * r.abs() + tiny(O::TYPE);
                let err = (y as f64 - r).abs();
                prop_assert!(
                    err <= bound,
                    "{}->{} {} ({isa}, {threads} threads) on {p:?} batch {} {}x{}: output {i} \
                     is {y}, reference {r}, error {err:e} > bound {bound:e}",
                    I::TYPE.name(),
                    O::TYPE.name(),
                    plan.kernel_name(),
                    case.batch,
                    case.h,
                    case.w
                );
            }
        }
    }
    Ok(())
}

/// Runs `case` on f32 data with the f32 path and stored as `I`/`O` with the same algorithm,
/// and checks that they differ by no more than the storage's roundings explain.
fn check_against_f32<I: Storage, O: Storage>(case: &Case) -> Result<(), TestCaseError> {
    let p = &case.params;
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
    let (ui, uo) = (I::TYPE.unit_roundoff(), O::TYPE.unit_roundoff());
    let mut ws = Workspace::new();
    let opts = Options {
        threads: 1,
        ..Options::default()
    };
    let f32_conv = Conv2d::new(*p, &weights, bias.as_deref(), opts).unwrap();
    let f32_plan = f32_conv.plan(case.batch, case.h, case.w).unwrap();
    let mut want = vec![0.0; f32_plan.output_len()];
    match &residual {
        Some(r) => f32_plan.run_with_residual(&input, r, &mut want, &mut ws),
        None => f32_plan.run(&input, &mut want, &mut ws),
    }
    .unwrap();
    let wh: Vec<I> = round(&weights);
    let bh: Option<Vec<I>> = bias.as_ref().map(|b| round(b));
    let conv = Conv2d::from_storage(*p, &wh, bh.as_deref(), opts).unwrap();
    let plan = conv.plan(case.batch, case.h, case.w).unwrap();
    let rh: Option<Vec<O>> = residual.as_ref().map(|r| round(r));
    let out = run(&plan, &round::<I>(&input), rh.as_deref(), &mut ws);
    let f = plan.error_factor();
    for (i, (&y, &w)) in out.iter().zip(&want).enumerate() {
        // Σ|x·w| + |bias| + |residual| bounds every term's rounding; the f32 runs on both
        // sides carry their own arithmetic error.
        let m = reference.magnitude[i];
        let moved = 1.2 * (2.0 * ui + ui * ui + uo) * m;
        let bound =
            moved + 2.0 * f * reference.tolerance(i) + uo * (w as f64).abs() + tiny(O::TYPE);
        let err = (y as f64 - w as f64).abs();
        prop_assert!(
            err <= bound,
            "{}->{} {} on {p:?}: output {i} is {y}, f32 path {w}, difference {err:e} > {bound:e}",
            I::TYPE.name(),
            O::TYPE.name(),
            plan.kernel_name()
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(24)))]

    #[test]
    fn f16_matches_reference(c in case(1)) {
        check::<f16, f16>(&c)?;
    }

    #[test]
    fn bf16_matches_reference(c in case(1)) {
        check::<bf16, bf16>(&c)?;
    }

    #[test]
    fn f16_in_f32_out_matches_reference(c in case(1)) {
        check::<f16, f32>(&c)?;
    }

    #[test]
    fn bf16_in_f32_out_matches_reference(c in case(1)) {
        check::<bf16, f32>(&c)?;
    }

    #[test]
    fn half_is_within_storage_rounding_of_f32(c in case(2)) {
        check_against_f32::<f16, f16>(&c)?;
        check_against_f32::<bf16, bf16>(&c)?;
        check_against_f32::<f16, f32>(&c)?;
    }
}

/// Small depthwise planes at stride 1 with "same" padding: the flat kernels (x86), on 16-bit
/// tensors converted a call's planes at a time; a channel multiplier, dilation, residuals and
/// an activation that runs as a pass.
#[test]
fn small_depthwise_planes_run_flat() {
    use convkit::{Activation, ConvParams, Padding};
    let shapes = [
        (24, 1, 3, 1, 7, 7),
        (8, 2, 3, 2, 9, 6),
        (5, 1, 5, 1, 4, 8),
        (3, 3, 4, 1, 3, 5),
    ];
    for (i, (cin, mult, k, dil, h, w)) in shapes.into_iter().enumerate() {
        let params = ConvParams::conv2d(cin, cin * mult, [k, k])
            .with_groups(cin)
            .with_dilation([dil, dil])
            .with_padding(Padding::Same)
            .with_activation(Activation::Silu);
        if matches!(Isa::default_level(), Ok(Isa::Avx2 | Isa::Avx512)) {
            let weights = vec![f16::ZERO; params.weights_len().unwrap()];
            let conv = Conv2d::from_storage(params, &weights, None, Options::default()).unwrap();
            let name = conv.plan(2, h, w).unwrap().kernel_name();
            assert!(
                name.contains("dw_f32_flat"),
                "{params:?} {h}x{w} ran {name}"
            );
        }
        let case = Case {
            params,
            batch: 2,
            h,
            w,
            bias: i != 2,
            residual: i != 1,
            seed: 0xF1A7 + i as u64,
        };
        check::<f16, f16>(&case).unwrap();
        check::<bf16, f32>(&case).unwrap();
        check_against_f32::<f16, f16>(&case).unwrap();
        check_against_f32::<bf16, bf16>(&case).unwrap();
    }
}

/// Images large enough that the conversions run in several bands of rows (a band holds at
/// most 2^18 floats of input, output and residual): top, middle and bottom bands, strides,
/// dilations and padding that only some bands see, both layouts.
#[test]
fn large_images_cross_bands() {
    use convkit::{Activation, ConvParams, Layout, Padding};
    // Wide rows of many input channels and few outputs: several bands at little arithmetic
    // (the test runs under emulation too).
    let shapes = [
        // (params, h, w)
        (
            ConvParams::conv2d(64, 4, [3, 3]).with_padding(Padding::Same),
            40,
            160,
        ),
        (
            ConvParams::conv2d(40, 4, [5, 3])
                .with_stride([2, 1])
                .with_dilation([2, 1])
                .with_padding(Padding::Explicit {
                    top: 7,
                    bottom: 1,
                    left: 2,
                    right: 0,
                }),
            101,
            80,
        ),
        (
            ConvParams::conv2d(64, 64, [3, 3])
                .with_groups(64)
                .with_stride([2, 2])
                .with_padding(Padding::Same),
            120,
            90,
        ),
        (
            ConvParams::conv2d(64, 8, [1, 1]).with_activation(Activation::Silu),
            60,
            70,
        ),
    ];
    for (i, (p, h, w)) in shapes.into_iter().enumerate() {
        for layout in [Layout::Nchw, Layout::Nhwc] {
            let case = Case {
                params: p.with_layout(layout),
                batch: 1 + i % 2,
                h,
                w,
                bias: true,
                residual: i % 2 == 0,
                seed: 77 + i as u64,
            };
            check::<f16, f16>(&case).unwrap();
            check::<bf16, f32>(&case).unwrap();
        }
    }
}

/// A uniform integer in `lo..hi`.
fn int(rng: &mut Rng, lo: usize, hi: usize) -> usize {
    lo + (rng.next_u64() % (hi - lo) as u64) as usize
}

/// Runs the 16-bit kernel `k` (forced with `Options::kernel`) on `n` random shapes it takes,
/// with tensors of its type `T`, against the reference on the rounded data.
fn check_half_kernel<T: Storage>(k: &convkit::cpu::KernelInfo, n: usize, seed: u64) {
    use convkit::{Activation, ConvParams, Layout, Padding};
    let mut rng = Rng::new(seed);
    let mut ws = Workspace::new();
    let mut ran = 0;
    while ran < n {
        let (kernel, stride, dilation) = match k.fixed {
            Some((kk, s)) => ([kk, kk], [s, s], [1, 1]),
            None => (
                [int(&mut rng, 1, 8), int(&mut rng, 1, 8)],
                [int(&mut rng, 1, 4), int(&mut rng, 1, 4)],
                [int(&mut rng, 1, 3), int(&mut rng, 1, 3)],
            ),
        };
        let layout = k.layout.unwrap_or(Layout::Nchw);
        let channels = int(&mut rng, 1, 40);
        // Plane kernels take any channel multiplier; channel kernels only 1.
        let multiplier = match layout {
            Layout::Nchw => [1, 1, 2][int(&mut rng, 0, 3)],
            Layout::Nhwc => 1,
        };
        let (h, w) = if int(&mut rng, 0, 3) == 0 {
            (int(&mut rng, 1, 40), int(&mut rng, 1, 90))
        } else {
            (int(&mut rng, 1, 14), int(&mut rng, 1, 20))
        };
        let pad = || int(&mut Rng::new(seed ^ ran as u64), 0, 4);
        let act = [
            Activation::None,
            Activation::Relu,
            Activation::Relu6,
            Activation::Clamp {
                min: -0.5,
                max: 0.25,
            },
        ][int(&mut rng, 0, 4)];
        let p = ConvParams::conv2d(channels, channels * multiplier, kernel)
            .with_groups(channels)
            .with_stride(stride)
            .with_dilation(dilation)
            .with_padding(if int(&mut rng, 0, 2) == 0 {
                Padding::Same
            } else {
                Padding::Explicit {
                    top: pad(),
                    bottom: pad(),
                    left: pad(),
                    right: pad(),
                }
            })
            .with_layout(layout)
            .with_activation(act);
        let batch = int(&mut rng, 1, 3);
        let Ok(g) = p.geometry(batch, h, w) else {
            continue;
        };
        let weights: Vec<T> = round(&rng.vec(p.weights_len().unwrap()));
        let bias: Option<Vec<T>> =
            (int(&mut rng, 0, 2) == 0).then(|| round(&rng.vec(p.out_channels)));
        let input: Vec<T> = round(&rng.vec(g.input_len()));
        let residual: Option<Vec<T>> =
            (int(&mut rng, 0, 3) == 0).then(|| round(&rng.vec(g.output_len())));
        let opts = Options {
            threads: int(&mut rng, 1, 3),
            kernel: Some(k.name),
            ..Options::default()
        };
        let conv = Conv2d::from_storage(p, &weights, bias.as_deref(), opts)
            .unwrap_or_else(|e| panic!("{}: {p:?}: {e}", k.name));
        let plan = conv.plan(batch, h, w).unwrap();
        let name = plan.storage_kernel_name::<T, T>();
        assert!(name.contains(k.name), "forced {} but {name} ran", k.name);
        let out = run(&plan, &input, residual.as_deref(), &mut ws);
        let want = reference::conv(
            &p,
            batch,
            h,
            w,
            &widen(&input),
            &widen(&weights),
            bias.as_ref().map(|b| widen(b)).as_deref(),
            residual.as_ref().map(|r| widen(r)).as_deref(),
        )
        .unwrap();
        let u = T::TYPE.unit_roundoff();
        for (i, (&y, &r)) in out.iter().zip(&want.values).enumerate() {
            let bound = want.tolerance(i) * (1.0 + u) + u * r.abs() + tiny(T::TYPE);
            let err = (y as f64 - r).abs();
            assert!(
                err <= bound,
                "{name} on {p:?} batch {batch} {h}x{w}: output {i} is {y}, reference {r}, error {err:e} > {bound:e}"
            );
        }
        ran += 1;
    }
}

/// Every 16-bit kernel of the registry this CPU runs, on random shapes it takes: a kernel the
/// generator's table adds is tested here without a test of its own.
#[test]
fn every_half_kernel_matches_reference() {
    let kernels: Vec<_> = convkit::cpu::registry()
        .into_iter()
        .filter(|k| k.storage != StorageType::F32 && Isa::available().contains(&k.isa))
        .collect();
    // A build without the `f16` feature has none (the conversions around f32 kernels are
    // tested above); with it, both types.
    assert_eq!(
        cfg!(feature = "f16"),
        kernels.iter().any(|k| k.storage == StorageType::F16)
            && kernels.iter().any(|k| k.storage == StorageType::Bf16),
        "16-bit depthwise kernels in the registry, with the f16 feature {}",
        if cfg!(feature = "f16") { "on" } else { "off" }
    );
    let n = cases(12) as usize;
    for (i, k) in kernels.iter().enumerate() {
        match k.storage {
            StorageType::F16 => check_half_kernel::<f16>(k, n, 0xF16 + i as u64),
            _ => check_half_kernel::<bf16>(k, n, 0xBF16 + i as u64),
        }
    }
}

/// Wrong lengths are errors naming the tensor, never panics: weights and bias at create,
/// input, output and residual at run, whatever the types.
#[test]
fn wrong_lengths_are_errors() {
    use convkit::{ConvParams, Padding};
    let p = ConvParams::conv2d(4, 8, [3, 3]).with_padding(Padding::Same);
    let w = vec![f16::ZERO; 8 * 4 * 9];
    let e = Conv2d::from_storage(p, &w[1..], None, Options::default()).err();
    assert!(matches!(e, Some(Error::WrongLength { .. })), "{e:?}");
    let e = Conv2d::from_storage(p, &w, Some(&w[..7]), Options::default()).err();
    assert!(matches!(e, Some(Error::WrongLength { .. })), "{e:?}");
    let plan = Conv2d::from_storage(p, &w, None, Options::default())
        .unwrap()
        .plan(1, 5, 5)
        .unwrap();
    let mut ws = Workspace::new();
    let (x, mut y) = (vec![f16::ZERO; 100], vec![bf16::ZERO; 200]);
    let mut y32 = vec![0f32; 200];
    let wrong = |r: convkit::Result<()>, what: &str| match r {
        Err(Error::WrongLength { what: w, .. }) => assert_eq!(w, what),
        other => panic!("expected a wrong {what} length, got {other:?}"),
    };
    wrong(plan.run_storage(&x[1..], &mut y32, &mut ws), "input");
    wrong(plan.run_storage(&x, &mut y32[1..], &mut ws), "output");
    wrong(
        plan.run_storage_with_residual(&x, &y32[..3], &mut vec![0f32; 200], &mut ws),
        "residual",
    );
    wrong(plan.run_storage(&x, &mut y[..10], &mut ws), "output");
    plan.run_storage(&x, &mut y, &mut ws).unwrap();
    plan.run_storage(&x, &mut y32, &mut ws).unwrap();
}
