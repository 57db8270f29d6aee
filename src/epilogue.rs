//! The fused epilogue's activation functions.

use crate::{Error, Result};

/// The activation applied after bias and residual, fused into the convolution's store.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Activation {
    /// No activation: the identity.
    #[default]
    None,
    /// max(x, 0)
    Relu,
    /// min(max(x, 0), 6)
    Relu6,
    /// min(max(x, min), max)
    Clamp {
        /// The lower bound.
        min: f32,
        /// The upper bound.
        max: f32,
    },
    /// x if x > 0 else alpha·x
    LeakyRelu {
        /// The slope below 0.
        alpha: f32,
    },
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
            Activation::Silu => x / (1.0 + exp(-x)),
            Activation::Gelu => 0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2)),
            Activation::HardSwish => x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
            Activation::Sigmoid => 1.0 / (1.0 + exp(-x)),
        }
    }

    /// The activation over a row of outputs: one loop per activation, so the compiler can
    /// vectorise each (the GEMM driver calls it right after a tile's store, compiled for the
    /// kernel's ISA).
    #[inline(always)]
    pub(crate) fn apply_slice(self, xs: &mut [f32]) {
        match self {
            Activation::Silu => xs.iter_mut().for_each(|x| *x /= 1.0 + exp(-*x)),
            Activation::Sigmoid => xs.iter_mut().for_each(|x| *x = 1.0 / (1.0 + exp(-*x))),
            Activation::HardSwish => xs
                .iter_mut()
                .for_each(|x| *x *= (*x + 3.0).clamp(0.0, 6.0) / 6.0),
            Activation::LeakyRelu { alpha } => xs
                .iter_mut()
                .for_each(|x| *x = if *x > 0.0 { *x } else { alpha * *x }),
            other => xs.iter_mut().for_each(|x| *x = other.apply(*x)),
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

/// e^x in f32 without branches or calls, so that loops over it vectorise: x = n·ln2 + r with
/// |r| <= ln2/2, e^r by a degree-6 polynomial (Taylor coefficients; the truncation error is
/// below 2e-8 relative on that interval, under one ulp), and 2^n put straight into the exponent
/// bits. Inputs are clamped to where the result is a normal f32; NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n·ln2 is exact in the first part (Cody–Waite).
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E).round();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n: n is in [-126, 127] after the clamp, so the exponent field is in range.
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_37;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert_eq!(exp(f32::NEG_INFINITY), exp(-87.0));
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(1000.0).is_finite());
    }
}
