//! The fused epilogue's activation functions.

use crate::{Error, Result};

/// The activation applied after bias and residual, fused into the convolution's store.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Activation {
    #[default]
    None,
    /// max(x, 0)
    Relu,
    /// min(max(x, 0), 6)
    Relu6,
    /// min(max(x, min), max)
    Clamp { min: f32, max: f32 },
    /// x if x > 0 else alpha·x
    LeakyRelu { alpha: f32 },
    /// x·sigmoid(x)
    Silu,
    /// x·Φ(x) with the exact (erf) Gaussian CDF
    Gelu,
    /// x·relu6(x + 3)/6
    HardSwish,
    /// 1/(1 + e^-x)
    Sigmoid,
}

impl Activation {
    pub(crate) fn validate(self) -> Result<()> {
        match self {
            Activation::Clamp { min, max } if min.is_nan() || max.is_nan() || min > max => {
                Err(Error::InvalidParameter {
                    what: "clamp bounds",
                    detail: format!("need min <= max, neither NaN; got min {min}, max {max}"),
                })
            }
            Activation::LeakyRelu { alpha } if !alpha.is_finite() => Err(Error::InvalidParameter {
                what: "leaky ReLU alpha",
                detail: format!("must be finite, got {alpha}"),
            }),
            _ => Ok(()),
        }
    }

    /// The bounds the GEMM kernels apply in registers (identity bounds for the rest).
    pub(crate) fn clamp_bounds(self) -> (f32, f32) {
        match self {
            Activation::Relu => (0.0, f32::INFINITY),
            Activation::Relu6 => (0.0, 6.0),
            Activation::Clamp { min, max } => (min, max),
            _ => (f32::NEG_INFINITY, f32::INFINITY),
        }
    }

    /// True when the activation is not a clamp and so runs as a pass over the stored tile.
    pub(crate) fn needs_pass(self) -> bool {
        !matches!(
            self,
            Activation::None | Activation::Relu | Activation::Relu6 | Activation::Clamp { .. }
        )
    }

    /// The activation in f32, as the kernels compute it.
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            Activation::None => x,
            Activation::Relu => x.max(0.0),
            Activation::Relu6 => x.clamp(0.0, 6.0),
            Activation::Clamp { min, max } => x.max(min).min(max),
            Activation::LeakyRelu { alpha } => {
                if x > 0.0 {
                    x
                } else {
                    alpha * x
                }
            }
            Activation::Silu => x / (1.0 + libm::expf(-x)),
            Activation::Gelu => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
            Activation::HardSwish => x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
            Activation::Sigmoid => 1.0 / (1.0 + libm::expf(-x)),
        }
    }

    /// The activation in f64, for the reference.
    pub fn apply_f64(self, x: f64) -> f64 {
        match self {
            Activation::None => x,
            Activation::Relu => x.max(0.0),
            Activation::Relu6 => x.clamp(0.0, 6.0),
            Activation::Clamp { min, max } => x.max(min as f64).min(max as f64),
            Activation::LeakyRelu { alpha } => {
                if x > 0.0 {
                    x
                } else {
                    alpha as f64 * x
                }
            }
            Activation::Silu => x / (1.0 + (-x).exp()),
            Activation::Gelu => 0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2)),
            Activation::HardSwish => x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
            Activation::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        }
    }
}
