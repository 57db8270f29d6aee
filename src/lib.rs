//! # convkit
//!
//! Specialised CPU convolution kernels, chosen at run time for the CPU at hand, with a
//! generic im2col+GEMM path that takes every shape.
//!
//! Three phases, as in XNNPACK: **create** ([`Conv2d::new`]: validate, choose, pack the
//! weights once), **plan** ([`Conv2d::plan`]: fix the input size, output shape and workspace),
//! **run** ([`Plan::run`]: no allocation once the [`Workspace`] is large enough).
//!
//! ```
//! use convkit::{Activation, Conv2d, ConvParams, Options, Padding, Workspace};
//!
//! // 3x3 convolution, 8 -> 16 channels, "same" padding, fused ReLU.
//! let params = ConvParams::conv2d(8, 16, [3, 3])
//!     .with_padding(Padding::Same)
//!     .with_activation(Activation::Relu);
//! let weights = vec![0.01f32; 16 * 8 * 3 * 3];
//! let bias = vec![0.5f32; 16];
//! let conv = Conv2d::new(params, &weights, Some(&bias), Options::default())?;
//!
//! let plan = conv.plan(1, 32, 32)?;
//! assert_eq!(plan.output_shape(), [1, 16, 32, 32]);
//! let input = vec![1.0f32; plan.input_len()];
//! let mut output = vec![0.0f32; plan.output_len()];
//! let mut workspace = Workspace::new(); // share one across every layer of a network
//! plan.run(&input, &mut output, &mut workspace)?;
//! assert!((output[16 * 32 + 16] - (0.5 + 8.0 * 9.0 * 0.01)).abs() < 1e-5);
//! # Ok::<(), convkit::Error>(())
//! ```

#![warn(missing_docs)]

mod algo;
mod backward;
mod buffer;
#[cfg(feature = "capi")]
pub mod capi;
mod conv;
pub mod cpu;
mod epilogue;
mod error;
pub mod gemm;
#[cfg(feature = "gpu")]
pub mod gpu;
mod params;
mod plan;
#[cfg(feature = "int8")]
mod quant;
pub mod reference;
mod storage;
pub mod suite;

pub use algo::winograd::Precision;
/// Winograd's accuracy: the error tables the tests assert.
pub mod winograd {
    pub use crate::algo::winograd::{ERROR_FACTOR, RELATIVE_ERROR};
}
pub use algo::Algorithm;
pub use backward::{
    Accumulate, BackwardPlan, ConvBackward, ConvTranspose1d, ConvTranspose2d, TransposePlan,
};
pub use buffer::Workspace;
pub use conv::{Conv1d, Conv2d, Options};
pub use cpu::Isa;
pub use epilogue::Activation;
pub use error::{Error, Result};
/// The 16-bit float types of [`Storage`]: re-exported from the `half` crate.
pub use half::{bf16, f16};
pub use params::{ConvParams, Geometry, Layout, Padding};
pub use plan::Plan;
#[cfg(feature = "int8")]
pub use quant::{QConv1d, QConv2d, QElement, QPlan, QuantOutput, QuantParams, QuantType};
pub use storage::{Storage, StorageType};

/// The README's examples, compiled and run as doctests so that they stay true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
