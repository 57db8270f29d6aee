//! Winograd's accuracy and choice: the error table of every tile size on N(0,1) data (the
//! bounds `convkit::winograd::RELATIVE_ERROR` documents), and what each `Precision` allows.

mod common;

use common::Rng;
use convkit::winograd::RELATIVE_ERROR;
use convkit::{
    reference, Algorithm, Conv1d, Conv2d, ConvParams, Isa, Options, Padding, Precision, Workspace,
};

/// N(0,1) samples (Box–Muller).
fn normal(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect()
}

/// `max |result - reference| / rms(reference)` of tile `m` at `isa` on one 3x3 layer.
fn relative_error(m: usize, isa: Isa, cin: usize, seed: u64) -> f64 {
    let (cout, h, w) = (16, 14, 14);
    let p = ConvParams::conv2d(cin, cout, [3, 3]).with_padding(Padding::Same);
    let mut rng = Rng::new(seed);
    let weights = normal(&mut rng, p.weights_len().unwrap());
    let input = normal(&mut rng, cin * h * w);
    let r = reference::conv(&p, 1, h, w, &input, &weights, None, None).unwrap();
    let name = format!("wino_f32_f{m}_2d_{isa}");
    let kernel = convkit::cpu::find_kernel(&name).unwrap().name;
    let opts = Options {
        kernel: Some(kernel),
        threads: 1,
        ..Options::default()
    };
    let plan = Conv2d::new(p, &weights, None, opts)
        .unwrap()
        .plan(1, h, w)
        .unwrap();
    let mut out = vec![0.0; plan.output_len()];
    plan.run(&input, &mut out, &mut Workspace::new()).unwrap();
    let rms = (r.values.iter().map(|v| v * v).sum::<f64>() / r.values.len() as f64).sqrt();
    let c = r.compare(&out);
    c.max_abs / rms
}

#[test]
fn error_of_every_tile_stays_within_its_documented_bound() {
    let mut over = Vec::new();
    for &isa in Isa::available() {
        for (m, row) in RELATIVE_ERROR {
            for (cin, bound) in row {
                let err = relative_error(m, isa, cin, 7 + cin as u64);
                println!("F({m},3) {isa:<7} {cin:4} input channels: {err:.2e} (bound {bound:.0e})");
                if err > bound {
                    over.push(format!("F({m},3) {isa} {cin}: {err:e} > {bound:e}"));
                }
            }
        }
    }
    assert!(over.is_empty(), "errors over their bounds: {over:?}");
}

fn chosen(p: ConvParams, precision: Precision) -> String {
    let w = vec![0.1; p.weights_len().unwrap()];
    let opts = Options {
        precision,
        threads: 1,
        input_hint: Some([28, 28]),
        ..Options::default()
    };
    Conv2d::new(p, &w, None, opts)
        .unwrap()
        .plan(1, 28, 28)
        .unwrap()
        .kernel_name()
}

#[test]
fn precision_decides_whether_and_which_winograd_runs() {
    let p = ConvParams::conv2d(64, 64, [3, 3]).with_padding(Padding::Same);
    assert!(!chosen(p, Precision::Exact).contains("wino"));
    let accurate = chosen(p, Precision::Accurate);
    assert!(accurate.starts_with("winograd/wino_f32_f4"), "{accurate}");
    let balanced = chosen(p, Precision::Balanced);
    assert!(balanced.starts_with("winograd/wino_f32_f6"), "{balanced}");
    // Stride 2, dilation 2 and 5x5 kernels never take it.
    for q in [
        p.with_stride([2, 2]),
        p.with_dilation([2, 2]),
        ConvParams::conv2d(64, 64, [5, 5]),
    ] {
        assert!(!chosen(q, Precision::Balanced).contains("wino"), "{q:?}");
        let forced = Options {
            algorithm: Some(Algorithm::Winograd),
            ..Options::default()
        };
        let w = vec![0.1; q.weights_len().unwrap()];
        assert!(matches!(
            Conv2d::new(q, &w, None, forced),
            Err(convkit::Error::AlgorithmUnsupported { .. })
        ));
    }
}

#[test]
fn the_tile_follows_the_image_size() {
    let p = ConvParams::conv2d(64, 64, [3, 3]).with_padding(Padding::Same);
    let w = vec![0.1; p.weights_len().unwrap()];
    for (hint, tile) in [
        (None, "f4"),
        (Some([7, 7]), "f4"),
        (Some([14, 14]), "f5"),
        (Some([28, 28]), "f6"),
        (Some([56, 56]), "f6"),
    ] {
        let opts = Options {
            input_hint: hint,
            ..Options::default()
        };
        let name = Conv2d::new(p, &w, None, opts)
            .unwrap()
            .plan(1, 20, 20)
            .unwrap()
            .kernel_name();
        assert!(
            name.contains(&format!("wino_f32_{tile}_")),
            "{hint:?}: {name}"
        );
    }
}

#[test]
fn any_hint_plans_and_forced_winograd_at_exact_runs_the_most_accurate_tile() {
    let p = ConvParams::conv2d(32, 32, [3, 3]).with_padding(Padding::Same);
    let w = vec![0.1; p.weights_len().unwrap()];
    for (hint, precision, tile) in [
        (Some([usize::MAX, usize::MAX]), Precision::Balanced, "f6"),
        (Some([0, 0]), Precision::Balanced, "f2"),
        (None, Precision::Exact, "f2"),
        (Some([56, 56]), Precision::Exact, "f2"),
    ] {
        let opts = Options {
            algorithm: Some(Algorithm::Winograd),
            precision,
            input_hint: hint,
            ..Options::default()
        };
        let name = Conv2d::new(p, &w, None, opts)
            .unwrap()
            .plan(1, 9, 9)
            .unwrap()
            .kernel_name();
        assert!(
            name.contains(&format!("wino_f32_{tile}_")),
            "{hint:?} {precision:?}: {name}"
        );
    }
}

#[test]
fn conv1d_with_three_taps_runs_one_dimensional_winograd() {
    // Whisper's front end: 80 mel channels -> 384, 3 taps, padding 1.
    let (cin, cout, len) = (80, 384, 300);
    let p = ConvParams::conv1d(cin, cout, 3).with_padding(Padding::Explicit {
        top: 0,
        bottom: 0,
        left: 1,
        right: 1,
    });
    let mut rng = Rng::new(11);
    let weights = rng.vec(p.weights_len().unwrap());
    let input = rng.vec(cin * len);
    let opts = Options {
        algorithm: Some(Algorithm::Winograd),
        threads: 2,
        ..Options::default()
    };
    let plan = Conv1d::new(p, &weights, None, opts)
        .unwrap()
        .plan(1, len)
        .unwrap();
    assert!(
        plan.kernel_name().contains("_1d_"),
        "{}",
        plan.kernel_name()
    );
    let mut out = vec![0.0; plan.output_len()];
    plan.run(&input, &mut out, &mut Workspace::new()).unwrap();
    let r = reference::conv(&p, 1, 1, len, &input, &weights, None, None).unwrap();
    let c = r.compare_scaled(&out, plan.error_factor());
    assert!(c.passed(), "{c:?}");
}

/// Items whose last register block of tiles holds every count of rows (1 to 17 tiles of
/// F(2,3) in one row of tiles, so the strided-A edge kernel of each count runs), with more
/// input channels than one vector and a ragged last one, at every ISA level, one thread.
#[test]
fn every_count_of_tiles_in_the_last_block_matches_the_reference() {
    let (cin, cout) = (21, 40);
    let p = ConvParams::conv2d(cin, cout, [3, 3]).with_padding(Padding::Same);
    let mut rng = Rng::new(5);
    let weights = rng.vec(p.weights_len().unwrap());
    for &isa in Isa::available() {
        let name = format!("wino_f32_f2_2d_{isa}");
        let kernel = convkit::cpu::find_kernel(&name).unwrap().name;
        let opts = Options {
            kernel: Some(kernel),
            threads: 1,
            ..Options::default()
        };
        let conv = Conv2d::new(p, &weights, None, opts).unwrap();
        for tiles in 1..=17 {
            let (h, w) = (2, 2 * tiles);
            let input = rng.vec(cin * h * w);
            let plan = conv.plan(1, h, w).unwrap();
            let mut out = vec![0.0; plan.output_len()];
            plan.run(&input, &mut out, &mut Workspace::new()).unwrap();
            let r = reference::conv(&p, 1, h, w, &input, &weights, None, None).unwrap();
            let c = r.compare_scaled(&out, plan.error_factor());
            assert!(c.passed(), "{isa} {tiles} tiles: {c:?}");
        }
    }
}
