//! Helpers shared by the integration tests.
#![allow(dead_code)]

use convkit::{Activation, ConvParams, Layout, Padding};
use proptest::prelude::*;

/// A small deterministic generator (splitmix64): tests need reproducible data, not a crate.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// Proptest cases: `PROPTEST_CASES` if set, else `default` (smaller under emulation).
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Every activation, with parameters that bend inside the data's range.
pub const ACTIVATIONS: [Activation; 9] = [
    Activation::None,
    Activation::Relu,
    Activation::Relu6,
    Activation::Clamp {
        min: -0.5,
        max: 0.25,
    },
    Activation::LeakyRelu { alpha: 0.1 },
    Activation::Silu,
    Activation::Gelu,
    Activation::HardSwish,
    Activation::Sigmoid,
];

/// A random convolution and the data it runs on (`seed` for `Rng`).
#[derive(Clone, Debug)]
pub struct Case {
    pub params: ConvParams,
    pub batch: usize,
    pub h: usize,
    pub w: usize,
    pub bias: bool,
    pub residual: bool,
    pub seed: u64,
}

pub fn activation() -> impl Strategy<Value = Activation> {
    prop::sample::select(ACTIVATIONS.to_vec())
}

pub fn padding() -> impl Strategy<Value = Padding> {
    prop_oneof![
        (0usize..4, 0usize..4, 0usize..4, 0usize..4).prop_map(|(top, bottom, left, right)| {
            Padding::Explicit {
                top,
                bottom,
                left,
                right,
            }
        }),
        Just(Padding::Same),
        Just(Padding::SameLower),
        Just(Padding::Valid),
    ]
}

/// Small shapes of every kind; `scale` widens channels and images so that K-blocks, M-blocks
/// and N-blocks of the GEMM are crossed too.
pub fn case(scale: usize) -> impl Strategy<Value = Case> {
    (
        (1usize..4, 1usize..6 * scale, 1usize..6 * scale, 0usize..3),
        (
            1usize..5,
            1usize..5,
            1usize..4,
            1usize..4,
            1usize..3,
            1usize..3,
        ),
        (
            padding(),
            prop_oneof![Just(Layout::Nchw), Just(Layout::Nhwc)],
            activation(),
        ),
        (
            1usize..3,
            1usize..10 * scale,
            1usize..10 * scale,
            any::<bool>(),
            any::<bool>(),
            any::<u64>(),
        ),
    )
        .prop_map(
            |(
                (groups, cin_g, cout_g, mult),
                (kh, kw, sh, sw, dh, dw),
                (padding, layout, act),
                (batch, h, w, bias, residual, seed),
            )| {
                // One in three cases is depthwise (groups == in_channels) with a multiplier.
                let (groups, cin_g, cout_g) = if mult > 0 {
                    (groups * cin_g, 1, mult)
                } else {
                    (groups, cin_g, cout_g)
                };
                let params = ConvParams::conv2d(groups * cin_g, groups * cout_g, [kh, kw])
                    .with_groups(groups)
                    .with_stride([sh, sw])
                    .with_dilation([dh, dw])
                    .with_padding(padding)
                    .with_layout(layout)
                    .with_activation(act);
                Case {
                    params,
                    batch,
                    h,
                    w,
                    bias,
                    residual,
                    seed,
                }
            },
        )
}
