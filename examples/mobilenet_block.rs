//! A MobileNetV2 inverted-residual block (1x1 expand + ReLU6, 3x3 depthwise + ReLU6, 1x1
//! project, residual add) on one shared [`Workspace`], checked against the reference.
//!
//! `cargo run --release --example mobilenet_block [CHANNELS SIZE]` (default: 24 channels,
//! 56x56, expansion 6: the block of MobileNetV2's third stage). Prints each layer's
//! algorithm and scratch, and the workspace's peak against the sum of the layers' scratch:
//! one arena serves all three layers, so the block costs its largest layer's scratch.

use convkit::{reference, Activation, Conv2d, ConvParams, Options, Padding, Workspace};

/// Uniform values in [-0.5, 0.5) from a fixed seed (splitmix64).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn main() -> Result<(), convkit::Error> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (c, size) = (*args.first().unwrap_or(&24), *args.get(1).unwrap_or(&56));
    let hidden = 6 * c;

    // The three layers: weights OIHW, a bias each (batch norm folded in).
    let expand_p = ConvParams::conv2d(c, hidden, [1, 1]).with_activation(Activation::Relu6);
    let dw_p = ConvParams::conv2d(hidden, hidden, [3, 3])
        .with_groups(hidden)
        .with_padding(Padding::Same)
        .with_activation(Activation::Relu6);
    let project_p = ConvParams::conv2d(hidden, c, [1, 1]);
    let layers = [
        ("expand 1x1", expand_p),
        ("depthwise 3x3", dw_p),
        ("project 1x1", project_p),
    ];
    let weights: Vec<Vec<f32>> = layers
        .iter()
        .enumerate()
        .map(|(i, (_, p))| values(p.weights_len().expect("small"), 10 + i as u64))
        .collect();
    let biases: Vec<Vec<f32>> = layers
        .iter()
        .enumerate()
        .map(|(i, (_, p))| values(p.out_channels, 20 + i as u64))
        .collect();
    let convs = layers
        .iter()
        .zip(&weights)
        .zip(&biases)
        .map(|(((_, p), w), b)| Conv2d::new(*p, w, Some(b), Options::default()))
        .collect::<Result<Vec<_>, _>>()?;
    let plans = convs
        .iter()
        .map(|conv| conv.plan(1, size, size))
        .collect::<Result<Vec<_>, _>>()?;

    // One workspace for the whole block; tensors between the layers.
    let mut ws = Workspace::new();
    let x = values(plans[0].input_len(), 1);
    let mut expanded = vec![0.0; plans[0].output_len()];
    let mut dw = vec![0.0; plans[1].output_len()];
    let mut y = vec![0.0; plans[2].output_len()];
    plans[0].run(&x, &mut expanded, &mut ws)?;
    plans[1].run(&expanded, &mut dw, &mut ws)?;
    plans[2].run_with_residual(&dw, &x, &mut y, &mut ws)?; // y = project(dw) + x

    println!("MobileNetV2 inverted residual block: {c} -> {hidden} -> {c} channels, {size}x{size}");
    let mut sum = 0;
    for ((name, _), plan) in layers.iter().zip(&plans) {
        println!(
            "  {name:<14} {:<44} scratch {:>9} bytes",
            plan.kernel_name(),
            plan.workspace_bytes()
        );
        sum += plan.workspace_bytes();
    }
    println!(
        "peak workspace {} bytes (one shared Workspace) vs {} bytes summed over the layers",
        ws.bytes(),
        sum
    );

    // The same block from the definition.
    let r0 = reference::conv(
        &expand_p,
        1,
        size,
        size,
        &x,
        &weights[0],
        Some(&biases[0]),
        None,
    )?;
    let e: Vec<f32> = r0.values.iter().map(|&v| v as f32).collect();
    let r1 = reference::conv(
        &dw_p,
        1,
        size,
        size,
        &e,
        &weights[1],
        Some(&biases[1]),
        None,
    )?;
    let d: Vec<f32> = r1.values.iter().map(|&v| v as f32).collect();
    let r2 = reference::conv(
        &project_p,
        1,
        size,
        size,
        &d,
        &weights[2],
        Some(&biases[2]),
        Some(&x),
    )?;
    let max_err = y
        .iter()
        .zip(&r2.values)
        .map(|(&a, &b)| (a as f64 - b).abs())
        .fold(0.0, f64::max);
    println!("max |block - reference| = {max_err:.2e}");
    assert!(
        max_err < 1e-3,
        "the block differs from the reference by {max_err}"
    );
    Ok(())
}
