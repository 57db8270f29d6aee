//! Parity of the wgpu path with the CPU path (feature `gpu`): the same random layers, and
//! every layer of the suite, run on both and compared by normalised mean square error and a
//! max-abs bound scaled to the reduction length. Runs on any adapter, a software Vulkan
//! driver included; without any adapter the tests say so and pass, unless
//! `CONVKIT_REQUIRE_GPU=1` (set by `.ci/run`, which installs one) makes that a failure.
#![cfg(feature = "gpu")]

mod common;

use common::{case, cases, Case, Rng};
use convkit::gpu::{AdapterChoice, GpuContext, GpuConv1d, GpuConv2d};
use convkit::{
    suite, Activation, Conv2d, ConvParams, Error, Layout, Options, Padding, Precision, Workspace,
};
use proptest::prelude::*;
use std::sync::OnceLock;

/// One device for every test (making one per case would dominate on a software driver).
fn context() -> Option<&'static GpuContext> {
    static CONTEXT: OnceLock<Option<GpuContext>> = OnceLock::new();
    CONTEXT
        .get_or_init(|| match GpuContext::new() {
            Ok(ctx) => {
                eprintln!("GPU adapter: {:?}", ctx.info());
                Some(ctx)
            }
            Err(e) if std::env::var("CONVKIT_REQUIRE_GPU").as_deref() != Ok("1") => {
                eprintln!("GPU tests skipped: {e}");
                None
            }
            Err(e) => panic!("CONVKIT_REQUIRE_GPU=1 but {e}"),
        })
        .as_ref()
}

/// The CPU's result (sums of products: `Precision::Exact` keeps Winograd out, whose own
/// error is documented separately) and the GPU's, on the same data.
fn both(ctx: &GpuContext, l: &Case) -> (Vec<f32>, Vec<f32>, usize) {
    let mut rng = Rng::new(l.seed);
    let weights = rng.vec(l.params.weights_len().unwrap());
    let bias = l.bias.then(|| rng.vec(l.params.out_channels));
    let options = Options {
        precision: Precision::Exact,
        ..Options::default()
    };
    let cpu = Conv2d::new(l.params, &weights, bias.as_deref(), options).unwrap();
    let plan = cpu.plan(l.batch, l.h, l.w).unwrap();
    let input = rng.vec(plan.input_len());
    let residual = l.residual.then(|| rng.vec(plan.output_len()));
    let mut expected = vec![0.0; plan.output_len()];
    let mut ws = Workspace::new();
    match &residual {
        Some(r) => plan.run_with_residual(&input, r, &mut expected, &mut ws),
        None => plan.run(&input, &mut expected, &mut ws),
    }
    .unwrap();

    let gpu = GpuConv2d::new(ctx, l.params, &weights, bias.as_deref()).unwrap();
    let mut gplan = gpu.plan(l.batch, l.h, l.w).unwrap();
    let mut got = vec![f32::NAN; plan.output_len()];
    match &residual {
        Some(r) => gplan.run_with_residual(&input, r, &mut got),
        None => gplan.run(&input, &mut got),
    }
    .unwrap();
    (expected, got, plan.geometry().k_len())
}

/// NMSE ≤ 1e-10, and every output within 4·√K·ε of the data's scale.
fn assert_parity(expected: &[f32], got: &[f32], k: usize, what: &str) {
    let (mut err, mut norm, mut worst, mut scale) = (0.0f64, 0.0f64, 0.0f32, 1.0f32);
    for (&e, &g) in expected.iter().zip(got) {
        err += ((e - g) as f64).powi(2);
        norm += (e as f64).powi(2);
        worst = worst.max((e - g).abs());
        scale = scale.max(e.abs());
        assert!(
            g.is_finite(),
            "{what}: GPU output {g} where the CPU has {e}"
        );
    }
    let nmse = err / norm.max(f64::MIN_POSITIVE);
    let bound = 4.0 * (k as f32).sqrt() * f32::EPSILON * scale;
    assert!(
        nmse <= 1e-10 && worst <= bound,
        "{what}: nmse {nmse:.3e} (bound 1e-10), max |diff| {worst:.3e} (bound {bound:.3e})"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(60), ..ProptestConfig::default() })]
    /// The property tests' shapes (dense, grouped, depthwise with multipliers, every padding,
    /// stride, dilation, layout and activation, bias and residual or not).
    #[test]
    fn random_layers_match_the_cpu(l in case(3)) {
        let Some(ctx) = context() else { return Ok(()) };
        prop_assume!(l.params.geometry(l.batch, l.h, l.w).is_ok());
        let (expected, got, k) = both(ctx, &l);
        assert_parity(&expected, &got, k, &format!("{l:?}"));
    }
}

#[test]
fn every_suite_layer_matches_the_cpu() {
    let Some(ctx) = context() else { return };
    for (i, layer) in suite::builtin().unwrap().into_iter().enumerate() {
        let l = Case {
            params: layer.params.with_activation(Activation::Relu),
            batch: 1,
            h: layer.h,
            w: layer.w,
            bias: true,
            residual: i % 2 == 0,
            seed: i as u64,
        };
        let (expected, got, k) = both(ctx, &l);
        assert_parity(&expected, &got, k, &layer.name);
    }
}

#[test]
fn layers_chain_on_the_device_without_copies() {
    let Some(ctx) = context() else { return };
    let mut rng = Rng::new(7);
    // A MobileNetV2 block in NHWC: 1x1 expand, 3x3 depthwise, 1x1 project, on device tensors.
    let p1 = ConvParams::conv2d(8, 24, [1, 1])
        .with_layout(Layout::Nhwc)
        .with_activation(Activation::Relu6);
    let p2 = ConvParams::conv2d(24, 24, [3, 3])
        .with_groups(24)
        .with_padding(Padding::Same)
        .with_layout(Layout::Nhwc)
        .with_activation(Activation::Relu6);
    let p3 = ConvParams::conv2d(24, 8, [1, 1]).with_layout(Layout::Nhwc);
    let ws: Vec<Vec<f32>> = [p1, p2, p3]
        .iter()
        .map(|p| rng.vec(p.weights_len().unwrap()))
        .collect();
    let input = rng.vec(2 * 9 * 11 * 8);

    let mut cpu_x = input.clone();
    let mut workspace = Workspace::new();
    for (p, w) in [p1, p2, p3].iter().zip(&ws) {
        let conv = Conv2d::new(*p, w, None, Options::default()).unwrap();
        let plan = conv.plan(2, 9, 11).unwrap();
        let mut y = vec![0.0; plan.output_len()];
        plan.run(&cpu_x, &mut y, &mut workspace).unwrap();
        cpu_x = y;
    }

    let convs: Vec<GpuConv2d> = [p1, p2, p3]
        .iter()
        .zip(&ws)
        .map(|(p, w)| GpuConv2d::new(ctx, *p, w, None).unwrap())
        .collect();
    let mut x = ctx.upload(&input).unwrap();
    for conv in &convs {
        let plan = conv.plan(2, 9, 11).unwrap();
        let mut y = ctx.tensor(plan.geometry().output_len()).unwrap();
        plan.run_device(&x, &mut y, None).unwrap();
        x = y;
    }
    let mut got = vec![0.0; x.len()];
    ctx.download(&x, &mut got).unwrap();
    assert_eq!(convs[1].kernel_name(), "gpu/depthwise");
    assert_eq!(convs[0].kernel_name(), "gpu/implicit_gemm_64x64");
    assert_parity(&cpu_x, &got, 24 * 9, "inverted residual block");
}

#[test]
fn conv1d_and_bad_input_are_typed() {
    let Some(ctx) = context() else { return };
    let params = ConvParams::conv1d(4, 6, 5).with_stride([1, 2]);
    let w = Rng::new(3).vec(params.weights_len().unwrap());
    let conv = GpuConv1d::new(ctx, params, &w, None).unwrap();
    let mut plan = conv.plan(1, 40).unwrap();
    let mut out = vec![0.0; plan.geometry().output_len()];
    assert!(matches!(
        plan.run(&[0.0; 3], &mut out),
        Err(Error::WrongLength { what: "input", .. })
    ));
    let input = vec![1.0; plan.geometry().input_len()];
    assert!(matches!(
        plan.run(&input, &mut out[1..]),
        Err(Error::WrongLength { what: "output", .. })
    ));
    plan.run(&input, &mut out).unwrap();
    // All ones in, so each output is the sum of its channel's taps.
    for (o, &v) in out.iter().enumerate() {
        let c = o / plan.geometry().ow;
        let sum: f32 = w[c * 20..(c + 1) * 20].iter().sum();
        assert!((v - sum).abs() < 1e-5, "output {o}: {v} vs {sum}");
    }
    assert!(matches!(
        GpuConv1d::new(ctx, ConvParams::conv2d(4, 6, [3, 3]), &[0.0; 216], None),
        Err(Error::InvalidParameter { .. })
    ));
    assert!(matches!(
        GpuConv2d::new(ctx, ConvParams::conv2d(4, 6, [3, 3]), &[0.0; 7], None),
        Err(Error::WrongLength {
            what: "weights",
            ..
        })
    ));
    assert!(matches!(
        plan.run_with_residual(&input, &[0.0; 2], &mut out),
        Err(Error::WrongLength {
            what: "residual",
            ..
        })
    ));
    // Larger than any storage binding: refused at plan time, before any buffer exists.
    let big = GpuConv2d::new(ctx, ConvParams::conv2d(64, 8, [1, 1]), &[0.0; 512], None).unwrap();
    assert!(matches!(big.plan(1024, 1024, 1024), Err(Error::Gpu { .. })));
    // A stride past i32 with a one-column output passes the buffer checks, not the shaders' i32.
    let strided = ConvParams::conv2d(1, 1, [1, 1]).with_stride([1, 1 << 33]);
    let conv = GpuConv2d::new(ctx, strided, &[1.0], None).unwrap();
    assert_eq!(strided.geometry(1, 1, 10).unwrap().ow, 1);
    assert!(matches!(conv.plan(1, 1, 10), Err(Error::Overflow { .. })));
    assert!(matches!(
        GpuContext::with_adapter(AdapterChoice::Name("no such adapter".into())),
        Err(Error::NoGpu { .. })
    ));
}
