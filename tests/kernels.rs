//! Every generated kernel of the registry that this CPU can run, forced with
//! `Options::kernel`, against the reference on random shapes it takes. A kernel added to the
//! generator's table is tested here without a test of its own; the shapes include ragged
//! widths and channel counts, tiny images, and padding wider than the kernel reaches.

mod common;

use common::{cases, Rng, ACTIVATIONS};
use convkit::cpu::{registry, Family, KernelInfo};
use convkit::{reference, Conv2d, ConvParams, Isa, Layout, Options, Padding, Workspace};

/// A uniform integer in `lo..hi`.
fn int(rng: &mut Rng, lo: usize, hi: usize) -> usize {
    lo + (rng.next_u64() % (hi - lo) as u64) as usize
}

fn padding(rng: &mut Rng, reach: usize) -> Padding {
    match int(rng, 0, 6) {
        0 => Padding::Same,
        1 => Padding::SameLower,
        2 => Padding::Valid,
        // Explicit, sometimes wider than the kernel reaches.
        _ => {
            let mut p = || int(rng, 0, reach + 3);
            Padding::Explicit {
                top: p(),
                bottom: p(),
                left: p(),
                right: p(),
            }
        }
    }
}

/// A random convolution `kernel` takes, with its batch and input size.
fn shape(k: &KernelInfo, rng: &mut Rng) -> (ConvParams, usize, usize, usize) {
    let k_is_1d = k.conv1d;
    let (kernel, stride, dilation) = match k.fixed {
        Some((k, s)) if k_is_1d => ([1, k], [1, s], [1, 1]),
        Some((k, s)) => ([k, k], [s, s], [1, 1]),
        None => (
            [int(rng, 1, 10), int(rng, 1, 10)],
            [int(rng, 1, 4), int(rng, 1, 4)],
            [int(rng, 1, 3), int(rng, 1, 3)],
        ),
    };
    // Mostly small images (every block an edge block), sometimes wide ones.
    let big = int(rng, 0, 4) == 0;
    let (h, w) = if k.conv1d && int(rng, 0, 2) == 0 {
        (1, int(rng, 1, 90))
    } else if big {
        (int(rng, 1, 40), int(rng, 1, 90))
    } else {
        (int(rng, 1, 14), int(rng, 1, 20))
    };
    let channels = int(rng, 1, 40);
    let (params, layout) = match k.family {
        Family::Depthwise => {
            let layout = match k.layout {
                // An NHWC kernel also runs NCHW convolutions (the blocked mode).
                Some(Layout::Nhwc) if int(rng, 0, 2) == 0 => Layout::Nchw,
                Some(l) => l,
                None => Layout::Nchw,
            };
            // Plane kernels take any channel multiplier; channel kernels only 1.
            let multiplier = if k.layout == Some(Layout::Nchw) {
                [1, 1, 2, 3][int(rng, 0, 4)]
            } else {
                1
            };
            (
                ConvParams::conv2d(channels, channels * multiplier, kernel).with_groups(channels),
                layout,
            )
        }
        _ => {
            let groups = int(rng, 1, 4);
            let (cin, cout) = (groups * int(rng, 1, 12), groups * int(rng, 1, 12));
            let layout = k
                .layout
                .unwrap_or([Layout::Nchw, Layout::Nhwc][int(rng, 0, 2)]);
            (
                ConvParams::conv2d(cin, cout, kernel).with_groups(groups),
                layout,
            )
        }
    };
    let reach = (kernel[0].max(kernel[1]) - 1) * dilation[0].max(dilation[1]);
    let mut pad = padding(rng, reach);
    let stride = if k.flat {
        // Flat kernels take stride 1 with an output as wide as the input: "same", or left
        // and right padding that add up to the kernel's reach (rows padded at random).
        let across = (kernel[1] - 1) * dilation[1];
        if let Padding::Explicit { left, right, .. } = &mut pad {
            *left = int(rng, 0, across + 1);
            *right = across - *left;
        } else {
            pad = [Padding::Same, Padding::SameLower][int(rng, 0, 2)];
        }
        [1, 1]
    } else {
        stride
    };
    let params = params
        .with_stride(stride)
        .with_dilation(dilation)
        .with_padding(pad)
        .with_layout(layout)
        .with_activation(ACTIVATIONS[int(rng, 0, ACTIVATIONS.len())]);
    (params, int(rng, 1, 3), h, w)
}

/// Runs `k` on `cases` random shapes (shapes the kernel does not fit are drawn again) and
/// compares each with the reference.
fn check_kernel(k: &KernelInfo, cases: usize, seed: u64) {
    let mut rng = Rng::new(seed);
    let mut ws = Workspace::new();
    let mut ran = 0;
    let mut tries = 0;
    while ran < cases {
        tries += 1;
        assert!(tries < 100 * cases, "{}: no shape fits", k.name);
        let (p, batch, h, w) = shape(k, &mut rng);
        let Ok(g) = p.geometry(batch, h, w) else {
            continue;
        };
        let weights = rng.vec(p.weights_len().unwrap());
        let bias = (int(&mut rng, 0, 2) == 0).then(|| rng.vec(p.out_channels));
        let input = rng.vec(g.input_len());
        let residual = (int(&mut rng, 0, 3) == 0).then(|| rng.vec(g.output_len()));
        let threads = int(&mut rng, 1, 3);
        let opts = Options {
            threads,
            kernel: Some(k.name),
            ..Options::default()
        };
        let conv = Conv2d::new(p, &weights, bias.as_deref(), opts)
            .unwrap_or_else(|e| panic!("{}: {p:?}: {e}", k.name));
        let plan = conv.plan(batch, h, w).unwrap();
        assert!(
            plan.kernel_name().contains(k.name),
            "forced {} but {} ran",
            k.name,
            plan.kernel_name()
        );
        let mut out = vec![f32::NAN; plan.output_len()];
        match &residual {
            Some(r) => plan.run_with_residual(&input, r, &mut out, &mut ws),
            None => plan.run(&input, &mut out, &mut ws),
        }
        .unwrap();
        let want = reference::conv(
            &p,
            batch,
            h,
            w,
            &input,
            &weights,
            bias.as_deref(),
            residual.as_deref(),
        )
        .unwrap();
        let c = want.compare_scaled(&out, plan.error_factor());
        assert!(
            c.passed(),
            "{} ({threads} threads) on {p:?}, batch {batch}, {h}x{w}: error {:e} at {} is {:.2}x the tolerance ({} non-finite)",
            plan.kernel_name(),
            c.max_abs,
            c.worst_index,
            c.worst_ratio,
            c.non_finite
        );
        ran += 1;
    }
}

#[test]
fn every_generated_kernel_matches_reference() {
    let kernels: Vec<KernelInfo> = registry()
        .into_iter()
        .filter(|k| {
            Isa::available().contains(&k.isa)
                && !k.family.is_int8()
                && k.storage == convkit::StorageType::F32
        })
        .collect();
    assert!(
        kernels.iter().any(|k| k.family == Family::Depthwise),
        "no depthwise kernel in the registry"
    );
    let n = cases(60) as usize;
    for (i, k) in kernels.iter().enumerate() {
        check_kernel(k, n, 0xC0FFEE + i as u64);
    }
}

#[test]
fn a_kernel_that_does_not_take_the_shape_is_an_error() {
    let dw3 = registry()
        .into_iter()
        .find(|k| k.fixed == Some((3, 1)) && k.isa == Isa::Scalar)
        .expect("a scalar 3x3 depthwise kernel");
    let p = ConvParams::conv2d(8, 8, [5, 5]).with_groups(8);
    let opts = Options {
        kernel: Some(dw3.name),
        ..Options::default()
    };
    let e = Conv2d::new(p, &[0.0; 200], None, opts).err().unwrap();
    assert!(
        matches!(e, convkit::Error::AlgorithmUnsupported { .. }),
        "{e:?}"
    );
    let opts = Options {
        kernel: Some("no_such_kernel"),
        ..Options::default()
    };
    let e = Conv2d::new(p, &[0.0; 200], None, opts).err().unwrap();
    assert!(
        matches!(e, convkit::Error::InvalidParameter { .. }),
        "{e:?}"
    );
}
