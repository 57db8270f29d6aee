//! The obviously-correct convolution: nested loops straight from the definition, f64
//! accumulation, both layouts, every parameter. The ground truth of every test and of
//! `convkit bench`'s error column.

use crate::params::Geometry;
use crate::{ConvParams, Layout, Result};

/// The reference result, with what each output's rounding error can be measured against.
pub struct Reference {
    /// The exact-as-f64 outputs, in the convolution's layout.
    pub values: Vec<f64>,
    /// For each output, Σ|x·w| + |bias| + |residual|: the scale of its rounding error.
    pub magnitude: Vec<f64>,
    /// The reduction length (c_in/groups · kh · kw).
    pub k_len: usize,
}

/// Index of element (n, c, y, x) of a `c x h x w` tensor in `layout`.
fn at(
    layout: Layout,
    (c, h, w): (usize, usize, usize),
    n: usize,
    ch: usize,
    y: usize,
    x: usize,
) -> usize {
    match layout {
        Layout::Nchw => ((n * c + ch) * h + y) * w + x,
        Layout::Nhwc => ((n * h + y) * w + x) * c + ch,
    }
}

/// `act(conv(input, weights) + bias + residual)` computed from the definition.
#[allow(clippy::too_many_arguments)]
pub fn conv(
    params: &ConvParams,
    batch: usize,
    in_h: usize,
    in_w: usize,
    input: &[f32],
    weights: &[f32],
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
) -> Result<Reference> {
    let g: Geometry = params.geometry(batch, in_h, in_w)?;
    crate::error::check_lengths(&[
        ("input", g.input_len(), Some(input.len())),
        ("weights", params.weights_len()?, Some(weights.len())),
        ("bias", g.c_out, bias.map(|b| b.len())),
        ("residual", g.output_len(), residual.map(|r| r.len())),
    ])?;
    let (cin_g, cout_g) = (g.cin_g(), g.cout_g());
    let mut values = vec![0.0; g.output_len()];
    let mut magnitude = vec![0.0; g.output_len()];
    for n in 0..g.batch {
        for co in 0..g.c_out {
            let group = co / cout_g;
            for oy in 0..g.oh {
                for ox in 0..g.ow {
                    let (mut sum, mut mag) = (0.0f64, 0.0f64);
                    for ci in 0..cin_g {
                        for ky in 0..g.kh {
                            for kx in 0..g.kw {
                                // Input row/column, before removing the padding.
                                let y = oy * g.sh + ky * g.dh;
                                let x = ox * g.sw + kx * g.dw;
                                if y < g.pad_top
                                    || x < g.pad_left
                                    || y - g.pad_top >= g.h
                                    || x - g.pad_left >= g.w
                                {
                                    continue; // zero padding
                                }
                                let xi = at(
                                    g.layout,
                                    (g.c_in, g.h, g.w),
                                    n,
                                    group * cin_g + ci,
                                    y - g.pad_top,
                                    x - g.pad_left,
                                );
                                let wi = ((co * cin_g + ci) * g.kh + ky) * g.kw + kx;
                                let p = input[xi] as f64 * weights[wi] as f64;
                                sum += p;
                                mag += p.abs();
                            }
                        }
                    }
                    let o = at(g.layout, (g.c_out, g.oh, g.ow), n, co, oy, ox);
                    for extra in [bias.map(|b| b[co]), residual.map(|r| r[o])]
                        .into_iter()
                        .flatten()
                    {
                        sum += extra as f64;
                        mag += (extra as f64).abs();
                    }
                    values[o] = params.activation.apply_f64(sum);
                    magnitude[o] = mag;
                }
            }
        }
    }
    Ok(Reference {
        values,
        magnitude,
        k_len: g.k_len(),
    })
}

/// How far a result is from the reference.
#[derive(Clone, Copy, Debug, Default)]
pub struct Comparison {
    /// Largest |result - reference|.
    pub max_abs: f64,
    /// Largest error as a fraction of its tolerance (≤ 1 passes).
    pub worst_ratio: f64,
    /// Index of the worst element.
    pub worst_index: usize,
    /// Non-finite results where the reference is finite.
    pub non_finite: usize,
}

impl Comparison {
    /// True if every output is finite where the reference is, and within its tolerance.
    pub fn passed(&self) -> bool {
        self.non_finite == 0 && self.worst_ratio <= 1.0
    }
}

impl Reference {
    /// The tolerance of output `i` for an f32 computation: rounding grows like √K times the
    /// magnitude of the terms (errors of blocked f32 sums add like a random walk; 8 units of
    /// roundoff keeps false alarms out), plus a few ulp for the activation.
    pub fn tolerance(&self, i: usize) -> f64 {
        let u = f32::EPSILON as f64 / 2.0;
        8.0 * u * ((self.k_len as f64).sqrt() + 2.0) * self.magnitude[i]
            + 8.0 * u * self.values[i].abs()
            + 1e-30
    }

    /// Compares `out` against the reference with [`Reference::tolerance`].
    pub fn compare(&self, out: &[f32]) -> Comparison {
        self.compare_scaled(out, 1.0)
    }

    /// Compares `out` against the reference with `factor` times [`Reference::tolerance`] (an
    /// algorithm's [`Plan::error_factor`](crate::Plan::error_factor)). With a factor above 1
    /// (Winograd) an output's error comes from its whole tile, not only its own terms, so the
    /// tolerance is at least that of an output of average magnitude.
    pub fn compare_scaled(&self, out: &[f32], factor: f64) -> Comparison {
        let mut c = Comparison::default();
        let floor = if factor > 1.0 && !self.magnitude.is_empty() {
            let mean = self.magnitude.iter().sum::<f64>() / self.magnitude.len() as f64;
            let u = f32::EPSILON as f64 / 2.0;
            8.0 * u * ((self.k_len as f64).sqrt() + 2.0) * mean
        } else {
            0.0
        };
        for (i, (&y, &r)) in out.iter().zip(&self.values).enumerate() {
            if !y.is_finite() && r.is_finite() {
                c.non_finite += 1;
                continue;
            }
            let err = (y as f64 - r).abs();
            let ratio = err / (factor * self.tolerance(i).max(floor));
            c.max_abs = c.max_abs.max(err);
            if ratio > c.worst_ratio {
                c.worst_ratio = ratio;
                c.worst_index = i;
            }
        }
        if out.len() != self.values.len() {
            c.non_finite += out.len().abs_diff(self.values.len());
        }
        c
    }
}

/// The exact integer sums of a quantized convolution, `Σ (x - zero_point)·w + bias` per
/// output (i64, in the convolution's layout), straight from the definition.
#[allow(clippy::too_many_arguments)]
pub fn qconv_sums<T: Copy + Into<i64>>(
    params: &ConvParams,
    batch: usize,
    in_h: usize,
    in_w: usize,
    input: &[T],
    zero_point: i32,
    weights: &[i8],
    bias: Option<&[i32]>,
) -> Result<Vec<i64>> {
    let g: Geometry = params.geometry(batch, in_h, in_w)?;
    crate::error::check_lengths(&[
        ("input", g.input_len(), Some(input.len())),
        ("weights", params.weights_len()?, Some(weights.len())),
        ("bias", g.c_out, bias.map(|b| b.len())),
    ])?;
    let (cin_g, cout_g) = (g.cin_g(), g.cout_g());
    let mut out = vec![0i64; g.output_len()];
    for n in 0..g.batch {
        for co in 0..g.c_out {
            let grp = co / cout_g;
            for oy in 0..g.oh {
                for ox in 0..g.ow {
                    let mut acc = bias.map_or(0, |b| b[co] as i64);
                    for ci in 0..cin_g {
                        let c = grp * cin_g + ci;
                        for ky in 0..g.kh {
                            let iy = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
                            for kx in 0..g.kw {
                                let ix = (ox * g.sw + kx * g.dw) as isize - g.pad_left as isize;
                                if iy < 0 || ix < 0 || iy >= g.h as isize || ix >= g.w as isize {
                                    continue;
                                }
                                let xi = at(
                                    g.layout,
                                    (g.c_in, g.h, g.w),
                                    n,
                                    c,
                                    iy as usize,
                                    ix as usize,
                                );
                                let w = weights[((co * cin_g + ci) * g.kh + ky) * g.kw + kx];
                                acc += (input[xi].into() - zero_point as i64) * w as i64;
                            }
                        }
                    }
                    out[at(g.layout, (g.c_out, g.oh, g.ow), n, co, oy, ox)] = acc;
                }
            }
        }
    }
    Ok(out)
}

/// Requantises an exact sum as convkit specifies it (see `QConv2d`): the
/// sum times the f32 multiplier `mult`, in f32, rounded half to even, plus the zero point,
/// clamped to `qlo..=qhi`.
pub fn requantize(sum: i64, mult: f32, zero_point: i32, qlo: i32, qhi: i32) -> i32 {
    let r = (sum as f32 * mult).round_ties_even() as i64 + zero_point as i64;
    r.clamp(qlo as i64, qhi as i64) as i32
}

/// Requantises an exact sum in f64 (`sum · x_scale · w_scale / y_scale`, one rounding of
/// each product): what [`requantize`] may differ from by 1, and only where the value lies
/// within f32 rounding of a half.
pub fn requantize_f64(
    sum: i64,
    x_scale: f32,
    w_scale: f32,
    y_scale: f32,
    zero_point: i32,
    qlo: i32,
    qhi: i32,
) -> i32 {
    let m = x_scale as f64 * w_scale as f64 / y_scale as f64;
    let r = (sum as f64 * m).round_ties_even() as i64 + zero_point as i64;
    r.clamp(qlo as i64, qhi as i64) as i32
}
