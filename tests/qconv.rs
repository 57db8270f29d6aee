//! Quantized convolutions against the exact integer reference: every int8 kernel this CPU
//! runs, forced by name, on random shapes, scales and zero points, including the extremes
//! (-128/127/0/255, zero points at both ends, inputs that saturate 16-bit pair sums).
//! i32 outputs must be equal; u8/i8 outputs equal to the reference's f32 requantisation and
//! within 1 of the exact (f64) one; f32 outputs equal to the sum times the f32 scale.

#![cfg(feature = "int8")]

mod common;

use common::{cases, Rng};
use convkit::cpu::{registry, Family};
use convkit::reference::{qconv_sums, requantize, requantize_f64};
use convkit::{
    Activation, ConvParams, Error, Isa, Layout, Options, Padding, QConv1d, QConv2d, QuantOutput,
    QuantParams, QuantType, Workspace,
};

fn int(rng: &mut Rng, lo: i64, hi: i64) -> i64 {
    lo + (rng.next_u64() % (hi - lo + 1) as u64) as i64
}

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[(rng.next_u64() % xs.len() as u64) as usize]
}

/// Data of one of four kinds: uniform over the whole range, only the two ends, mostly the
/// top end (the products that saturate `vpmaddubsw` pairs), or a narrow band.
fn bytes(rng: &mut Rng, n: usize, lo: i64, hi: i64, kind: u64) -> Vec<i64> {
    (0..n)
        .map(|_| match kind {
            0 => int(rng, lo, hi),
            1 => pick(rng, &[lo, hi]),
            2 => {
                if rng.next_u64().is_multiple_of(8) {
                    int(rng, lo, hi)
                } else {
                    hi
                }
            }
            _ => int(rng, (lo + hi) / 2 - 3, (lo + hi) / 2 + 3),
        })
        .collect()
}

struct Case {
    params: ConvParams,
    quant: QuantParams,
    batch: usize,
    h: usize,
    w: usize,
    x: Vec<i64>,
    weights: Vec<i8>,
    bias: Option<Vec<i32>>,
    threads: usize,
}

/// A random quantized convolution: any shape, or (`dw`) a depthwise one, of a fixed square
/// kernel and stride where `dw` says so.
fn random_case(rng: &mut Rng, dw: Option<Option<(usize, usize)>>) -> Case {
    random_case_with(rng, dw, None, false)
}

/// As [`random_case`]; `direct`: an NCHW convolution of this square kernel and stride,
/// dilation 1 (the shapes the f32 direct kernels take); `plane64`: a depthwise one whose
/// planes have at most 64 inputs and 64 outputs (the small-plane kernel's).
fn random_case_with(
    rng: &mut Rng,
    dw: Option<Option<(usize, usize)>>,
    direct: Option<(usize, usize)>,
    plane64: bool,
) -> Case {
    let dw = if plane64 { Some(None) } else { dw };
    let groups = pick(rng, &[1, 1, 1, 2, 3]) as usize;
    let depthwise = dw.is_some() || rng.next_u64().is_multiple_of(6);
    let (cin, cout) = if depthwise {
        let c = int(rng, 1, 9) as usize;
        (c, c * int(rng, 1, 2) as usize)
    } else {
        (
            groups * int(rng, 1, 20) as usize,
            groups * int(rng, 1, 40) as usize,
        )
    };
    let groups = if depthwise { cin } else { groups };
    let (kernel, stride, dilation) = match (dw, direct) {
        (Some(Some((k, s))), _) | (_, Some((k, s))) => ([k, k], [s, s], [1, 1]),
        // Up to 7x7 (the spans must fit a 64-byte plane).
        _ if plane64 => {
            let kernel = [int(rng, 1, 7) as usize, int(rng, 1, 7) as usize];
            let d = if kernel.iter().all(|&k| k <= 3) {
                [int(rng, 1, 2) as usize, int(rng, 1, 2) as usize]
            } else {
                [1, 1]
            };
            (
                kernel,
                [int(rng, 1, 3) as usize, int(rng, 1, 3) as usize],
                d,
            )
        }
        _ => (
            [int(rng, 1, 5) as usize, int(rng, 1, 5) as usize],
            [int(rng, 1, 3) as usize, int(rng, 1, 3) as usize],
            [int(rng, 1, 2) as usize, int(rng, 1, 2) as usize],
        ),
    };
    let padding = match rng.next_u64() % 4 {
        0 => Padding::Same,
        1 => Padding::Valid,
        _ => Padding::Explicit {
            top: int(rng, 0, 3) as usize,
            bottom: int(rng, 0, 3) as usize,
            left: int(rng, 0, 3) as usize,
            right: int(rng, 0, 3) as usize,
        },
    };
    let layout = match direct {
        Some(_) => Layout::Nchw,
        None => pick(rng, &[Layout::Nchw, Layout::Nhwc]),
    };
    let span = |k: usize, d: usize| (k - 1) * d + 1;
    // Depthwise: now and then a plane over 4 KiB (padded a row at a time, not gathered).
    let tall = dw.is_some() && rng.next_u64().is_multiple_of(4);
    let mut h = span(kernel[0], dilation[0]) + int(rng, 0, if tall { 60 } else { 12 }) as usize;
    let mut w =
        span(kernel[1], dilation[1]) + int(rng, 0, if dw.is_some() { 90 } else { 20 }) as usize;
    let mut padding = padding;
    if plane64 {
        // Planes of at most 64 inputs, drawn until the output fits 64 too (else no padding).
        let fits = |h: usize, w: usize, padding: Padding| {
            let p = ConvParams::conv2d(1, 1, kernel)
                .with_stride(stride)
                .with_dilation(dilation)
                .with_padding(padding);
            h * w <= 64 && p.geometry(1, h, w).is_ok_and(|g| g.oh * g.ow <= 64)
        };
        let (sh, sw) = (span(kernel[0], dilation[0]), span(kernel[1], dilation[1]));
        for attempt in 0..50 {
            h = sh + int(rng, 0, (64 / sw - sh) as i64) as usize;
            w = sw + int(rng, 0, (64 / h - sw) as i64) as usize;
            if attempt == 49 {
                padding = Padding::Valid;
            }
            if fits(h, w, padding) {
                break;
            }
        }
        assert!(fits(h, w, padding), "{kernel:?} {h}x{w} {padding:?}");
    }
    let input_type = pick(rng, &[QuantType::U8, QuantType::I8]);
    let (lo, hi) = input_type.range();
    let (lo, hi) = (lo as i64, hi as i64);
    let zp = match rng.next_u64() % 4 {
        0 => lo,
        1 => hi,
        _ => int(rng, lo, hi),
    } as i32;
    let out_ty = pick(rng, &[QuantType::U8, QuantType::I8]);
    let (olo, ohi) = out_ty.range();
    let output = match rng.next_u64() % 5 {
        0 => QuantOutput::I32,
        1 => QuantOutput::F32,
        _ => QuantOutput::Quantized {
            ty: out_ty,
            scale: 0.5 + rng.uniform().abs() * 40.0,
            zero_point: match rng.next_u64() % 3 {
                0 => olo,
                1 => ohi,
                _ => int(rng, olo as i64, ohi as i64) as i32,
            },
        },
    };
    let activation = match output {
        QuantOutput::I32 => Activation::None,
        QuantOutput::F32 => pick(rng, &[Activation::None, Activation::Relu, Activation::Silu]),
        QuantOutput::Quantized { .. } => pick(
            rng,
            &[
                Activation::None,
                Activation::Relu,
                Activation::Relu6,
                Activation::Clamp {
                    min: -300.0,
                    max: 500.0,
                },
            ],
        ),
    };
    let params = ConvParams::conv2d(cin, cout, kernel)
        .with_groups(groups)
        .with_stride(stride)
        .with_dilation(dilation)
        .with_padding(padding)
        .with_layout(layout)
        .with_activation(activation);
    let wlen = params.weights_len().unwrap();
    let wkind = rng.next_u64() % 4;
    let weights: Vec<i8> = bytes(rng, wlen, -128, 127, wkind)
        .into_iter()
        .map(|v| v as i8)
        .collect();
    let per_channel = rng.next_u64().is_multiple_of(2);
    let weight_scales = (0..if per_channel { cout } else { 1 })
        .map(|_| 0.01 + rng.uniform().abs() * 0.05)
        .collect();
    let bias = (!rng.next_u64().is_multiple_of(3)).then(|| {
        (0..cout)
            .map(|_| int(rng, -100_000, 100_000) as i32)
            .collect()
    });
    let batch = int(rng, 1, 2) as usize;
    let xkind = rng.next_u64() % 4;
    let x = bytes(rng, batch * cin * h * w, lo, hi, xkind);
    Case {
        params,
        quant: QuantParams {
            input_type,
            input_scale: 0.02 + rng.uniform().abs() * 0.1,
            input_zero_point: zp,
            weight_scales,
            output,
        },
        batch,
        h,
        w,
        x,
        weights,
        bias,
        threads: int(rng, 1, 3) as usize,
    }
}

/// The quantized bounds of a fused activation, from its definition.
fn bounds(act: Activation, ty: QuantType, scale: f32, zp: i32) -> (i32, i32) {
    let (lo, hi) = ty.range();
    let q = |v: f32| ((v as f64 / scale as f64).round_ties_even() as i32 + zp).clamp(lo, hi);
    match act {
        Activation::Relu => (zp.max(lo), hi),
        Activation::Relu6 => (zp.max(lo), q(6.0)),
        Activation::Clamp { min, max } => (q(min), q(max)),
        _ => (lo, hi),
    }
}

fn run_case(c: &Case, kernel: &'static str) -> Result<(), String> {
    run_with(
        c,
        Options {
            kernel: Some(kernel),
            ..Options::default()
        },
    )
}

fn run_with(c: &Case, opts: Options) -> Result<(), String> {
    let opts = Options {
        threads: c.threads,
        ..opts
    };
    let conv = QConv2d::new(
        c.params,
        c.quant.clone(),
        &c.weights,
        c.bias.as_deref(),
        opts,
    )
    .map_err(|e| format!("create: {e}"))?;
    let plan = conv.plan(c.batch, c.h, c.w).map_err(|e| e.to_string())?;
    let sums = qconv_sums(
        &c.params,
        c.batch,
        c.h,
        c.w,
        &c.x,
        c.quant.input_zero_point,
        &c.weights,
        c.bias.as_deref(),
    )
    .unwrap();
    let mut ws = Workspace::new();
    let g = plan.geometry();
    let co_of = |i: usize| match c.params.layout {
        Layout::Nchw => i / (g.oh * g.ow) % g.c_out,
        Layout::Nhwc => i % g.c_out,
    };
    let ws_of = |co: usize| {
        let s = &c.quant.weight_scales;
        s[if s.len() == 1 { 0 } else { co }]
    };
    let n = plan.output_len();
    // Runs with the input as the declared type and output O.
    macro_rules! run {
        ($o:ty) => {{
            let mut out = vec![<$o>::default(); n];
            match c.quant.input_type {
                QuantType::U8 => {
                    let x: Vec<u8> = c.x.iter().map(|&v| v as u8).collect();
                    plan.run(&x, &mut out, &mut ws)
                }
                QuantType::I8 => {
                    let x: Vec<i8> = c.x.iter().map(|&v| v as i8).collect();
                    plan.run(&x, &mut out, &mut ws)
                }
            }
            .map_err(|e| format!("run: {e}"))?;
            out
        }};
    }
    match c.quant.output {
        QuantOutput::I32 => {
            let out = run!(i32);
            for (i, (&o, &s)) in out.iter().zip(&sums).enumerate() {
                if o as i64 != s {
                    return Err(format!("i32 output {i}: {o}, exact sum {s}"));
                }
            }
        }
        QuantOutput::F32 => {
            let out = run!(f32);
            for (i, (&o, &s)) in out.iter().zip(&sums).enumerate() {
                let scale = (c.quant.input_scale as f64 * ws_of(co_of(i)) as f64) as f32;
                let want = c.params.activation.apply(s as f32 * scale);
                if o.to_bits() != want.to_bits() {
                    return Err(format!("f32 output {i}: {o}, want {want} (sum {s})"));
                }
            }
        }
        QuantOutput::Quantized {
            ty,
            scale,
            zero_point,
        } => {
            let out: Vec<i32> = match ty {
                QuantType::U8 => run!(u8).into_iter().map(i32::from).collect(),
                QuantType::I8 => run!(i8).into_iter().map(i32::from).collect(),
            };
            let (qlo, qhi) = bounds(c.params.activation, ty, scale, zero_point);
            for (i, (&o, &s)) in out.iter().zip(&sums).enumerate() {
                let w_scale = ws_of(co_of(i));
                let mult = (c.quant.input_scale as f64 * w_scale as f64 / scale as f64) as f32;
                let want = requantize(s, mult, zero_point, qlo, qhi);
                if o != want {
                    return Err(format!("q output {i}: {o}, want {want} (sum {s})"));
                }
                let exact =
                    requantize_f64(s, c.quant.input_scale, w_scale, scale, zero_point, qlo, qhi);
                if (o - exact).abs() > 1 {
                    return Err(format!("q output {i}: {o}, exact {exact} (sum {s})"));
                }
            }
        }
    }
    Ok(())
}

fn int8_kernels() -> Vec<&'static str> {
    registry()
        .into_iter()
        .filter(|k| k.family == Family::QGemm && Isa::available().contains(&k.isa))
        .filter(|k| !k.name.contains("vnni") || convkit::cpu::has_vnni())
        .map(|k| k.name)
        .collect()
}

#[test]
fn every_int8_kernel_is_exact_on_random_cases() {
    let kernels = int8_kernels();
    assert!(kernels.iter().any(|k| k.contains("scalar")));
    let n = cases(150);
    for (ki, &kernel) in kernels.iter().enumerate() {
        let mut rng = Rng::new(0x51ab + ki as u64);
        for i in 0..n {
            let c = random_case(&mut rng, None);
            if let Err(e) = run_case(&c, kernel) {
                panic!(
                    "{kernel}, case {i}: {e}\n{:?} batch {} {}x{} quant {:?} threads {}",
                    c.params, c.batch, c.h, c.w, c.quant, c.threads
                );
            }
        }
    }
}

#[test]
fn every_int8_depthwise_kernel_is_exact_on_random_cases() {
    let kernels: Vec<_> = registry()
        .into_iter()
        .filter(|k| k.family == Family::QDepthwise && convkit::cpu::has_vnni_vbmi())
        .collect();
    let n = cases(150);
    for (ki, k) in kernels.iter().enumerate() {
        let mut rng = Rng::new(0xd3 + ki as u64);
        for i in 0..n {
            let c = random_case_with(&mut rng, Some(k.fixed), None, k.flat);
            if let Err(e) = run_case(&c, k.name) {
                panic!(
                    "{}, case {i}: {e}\n{:?} {}x{} {:?}",
                    k.name, c.params, c.h, c.w, c.quant
                );
            }
        }
    }
    // The small-plane kernel, forced, refuses planes over 64 bytes at plan time.
    if let Some(k) = kernels.iter().find(|k| k.flat) {
        let params = ConvParams::conv2d(4, 4, [3, 3]).with_groups(4);
        let quant = QuantParams::u8(0.02, 128, 0.01, 0.05, 128);
        let opts = Options {
            kernel: Some(k.name),
            ..Options::default()
        };
        let conv = QConv2d::new(params, quant, &[1; 36], None, opts).unwrap();
        assert!(conv.plan(1, 8, 8).is_ok());
        match conv.plan(1, 9, 8) {
            Err(convkit::Error::AlgorithmUnsupported { reason, .. }) => {
                assert!(reason.contains("9x8"), "{reason}")
            }
            other => panic!(
                "{} on a 9x8 plane: {:?}",
                k.name,
                other.map(|p| p.kernel_name())
            ),
        }
    }
    // The generic kernel, at every ISA level, on any depthwise shape.
    let mut rng = Rng::new(0xd0);
    for i in 0..n {
        let c = random_case(&mut rng, Some(None));
        let opts = Options {
            algorithm: Some(convkit::Algorithm::DepthwiseGeneric),
            ..Options::default()
        };
        if let Err(e) = run_with(&c, opts) {
            panic!(
                "generic depthwise, case {i}: {e}\n{:?} {}x{} {:?}",
                c.params, c.h, c.w, c.quant
            );
        }
    }
}

/// Short sums through the f32 direct kernels, at every ISA level: the default choice (grouped
/// NCHW layers a direct kernel takes), and the direct kernels forced. Exact, as the int8
/// kernels.
#[test]
fn short_sums_through_f32_are_exact() {
    let n = cases(150);
    for &isa in Isa::available() {
        let mut rng = Rng::new(0xf32 + isa as u64);
        let (mut default, mut direct) = (0, 0);
        for i in 0..n {
            let (k, s) = pick(&mut rng, &[(3, 1), (3, 2), (4, 4), (7, 2), (2, 1)]);
            let c = random_case_with(&mut rng, None, Some((k, s)), false);
            for algorithm in [None, Some(convkit::Algorithm::Direct)] {
                let opts = Options {
                    isa: Some(isa),
                    algorithm,
                    ..Options::default()
                };
                match run_with(&c, opts) {
                    Ok(()) if algorithm.is_none() => default += (c.params.groups > 1) as usize,
                    Ok(()) => direct += 1,
                    // Direct takes the kernel sizes and strides it was generated for.
                    Err(e) if algorithm.is_some() && e.contains("cannot run") => {}
                    Err(e) => panic!(
                        "{isa:?} {algorithm:?}, case {i}: {e}\n{:?} batch {} {}x{} quant {:?}",
                        c.params, c.batch, c.h, c.w, c.quant
                    ),
                }
            }
        }
        // The direct kernels are generated for AVX2 and AVX-512.
        let has_direct = matches!(isa, Isa::Avx2 | Isa::Avx512);
        assert!(
            default >= n as usize / 10 && (direct >= n as usize / 10 || !has_direct),
            "{isa:?}: {default} grouped, {direct} direct"
        );
    }
    // The default route for ResNeXt's groups, and its bound.
    let q = QuantParams::u8(0.02, 128, 0.01, 0.05, 128);
    let grouped = ConvParams::conv2d(128, 128, [3, 3]).with_groups(32);
    let conv = QConv2d::new(
        grouped,
        q.clone(),
        &vec![1; 128 * 4 * 9],
        None,
        Options::default(),
    );
    let name = conv.unwrap().plan(1, 8, 8).unwrap().kernel_name();
    assert!(name.starts_with("exact_f32/"), "{name}");
    let long = ConvParams::conv2d(1030, 64, [1, 1]).with_groups(2);
    let forced = Options {
        algorithm: Some(convkit::Algorithm::Direct),
        ..Options::default()
    };
    let e = QConv2d::new(long, q, &vec![1; 64 * 515], None, forced).err();
    assert!(e.is_some_and(|e| e.to_string().contains("2^24")));
}

/// The worst case of AVX2's `vpmaddubsw`: 255 x 127 (and 255 x -128) everywhere, which a
/// 16-bit pair sum cannot hold. Every kernel must still be exact.
#[test]
fn saturating_pairs_are_exact() {
    for &kernel in &int8_kernels() {
        for (xv, wv) in [(255, 127), (255, -128), (0, -128), (255, -1)] {
            let params = ConvParams::conv2d(64, 40, [3, 3]).with_padding(Padding::Same);
            let c = Case {
                params,
                quant: QuantParams {
                    input_type: QuantType::U8,
                    input_scale: 0.01,
                    input_zero_point: 0,
                    weight_scales: vec![0.01],
                    output: QuantOutput::I32,
                },
                batch: 1,
                h: 9,
                w: 11,
                x: vec![xv; 64 * 9 * 11],
                weights: vec![wv; params.weights_len().unwrap()],
                bias: None,
                threads: 1,
            };
            run_case(&c, kernel).unwrap_or_else(|e| panic!("{kernel} x={xv} w={wv}: {e}"));
        }
    }
}

#[test]
fn conv1d_matches_the_2d_reference() {
    let p = ConvParams::conv1d(24, 32, 3)
        .with_stride([1, 2])
        .with_padding(Padding::Same);
    let mut rng = Rng::new(7);
    let w: Vec<i8> = (0..p.weights_len().unwrap())
        .map(|_| int(&mut rng, -128, 127) as i8)
        .collect();
    let q = QuantParams::u8(0.05, 128, 0.01, 0.5, 120);
    let conv = QConv1d::new(p, q.clone(), &w, None, Options::threads(1)).unwrap();
    let plan = conv.plan(1, 101).unwrap();
    let x: Vec<u8> = (0..plan.input_len())
        .map(|_| int(&mut rng, 0, 255) as u8)
        .collect();
    let mut y = vec![0u8; plan.output_len()];
    plan.run(&x, &mut y, &mut Workspace::new()).unwrap();
    let sums = qconv_sums(&p, 1, 1, 101, &x, 128, &w, None).unwrap();
    let mult = (0.05f64 * 0.01 / 0.5) as f32;
    for (o, s) in y.iter().zip(&sums) {
        assert_eq!(*o as i32, requantize(*s, mult, 120, 0, 255));
    }
}

#[test]
fn bad_quantization_is_a_clear_error() {
    let p = ConvParams::conv2d(4, 4, [3, 3]);
    let w = vec![1i8; 144];
    let ok = QuantParams::u8(0.1, 10, 0.1, 0.1, 10);
    let new = |p: ConvParams, q: QuantParams| QConv2d::new(p, q, &w, None, Options::default());
    let invalid = |r: convkit::Result<QConv2d>| {
        assert!(
            matches!(r, Err(Error::InvalidParameter { .. })),
            "{:?}",
            r.err()
        )
    };
    invalid(new(
        p,
        QuantParams {
            input_scale: 0.0,
            ..ok.clone()
        },
    ));
    invalid(new(
        p,
        QuantParams {
            input_scale: f32::NAN,
            ..ok.clone()
        },
    ));
    invalid(new(
        p,
        QuantParams {
            input_zero_point: 256,
            ..ok.clone()
        },
    ));
    invalid(new(
        p,
        QuantParams {
            input_type: QuantType::I8,
            input_zero_point: 128,
            ..ok.clone()
        },
    ));
    invalid(new(
        p,
        QuantParams {
            weight_scales: vec![0.1; 3],
            ..ok.clone()
        },
    ));
    invalid(new(
        p,
        QuantParams {
            weight_scales: vec![-1.0],
            ..ok.clone()
        },
    ));
    invalid(new(p.with_activation(Activation::Silu), ok.clone()));
    invalid(new(
        p.with_activation(Activation::Relu),
        QuantParams {
            output: QuantOutput::I32,
            ..ok.clone()
        },
    ));
    // A bias that could overflow the i32 sums.
    let r = QConv2d::new(p, ok.clone(), &w, Some(&[i32::MAX; 4]), Options::default());
    invalid(r);
    // Wrong lengths and element types at run time.
    let conv = new(p, ok.clone()).unwrap();
    let plan = conv.plan(1, 5, 5).unwrap();
    let mut ws = Workspace::new();
    let e = plan.run(&[0u8; 10], &mut [0u8; 36], &mut ws).unwrap_err();
    assert!(matches!(e, Error::WrongLength { .. }), "{e:?}");
    let e = plan.run(&[0i8; 100], &mut [0u8; 36], &mut ws).unwrap_err();
    assert!(matches!(e, Error::InvalidParameter { .. }), "{e:?}");
    let e = plan.run(&[0u8; 100], &mut [0f32; 36], &mut ws).unwrap_err();
    assert!(matches!(e, Error::InvalidParameter { .. }), "{e:?}");
    let e = QConv2d::new(
        p,
        ok,
        &w,
        None,
        Options {
            kernel: Some("no_such_kernel"),
            ..Options::default()
        },
    )
    .err()
    .unwrap();
    assert!(matches!(e, Error::InvalidParameter { .. }), "{e:?}");
}
