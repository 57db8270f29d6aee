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

/// Calls `f(input_index, weight_index, output_index, output_channel)` for every product the
/// convolution of geometry `g` sums: each (output, tap) pair whose input pixel is not padding.
fn for_each_product(g: &Geometry, mut f: impl FnMut(usize, usize, usize, usize)) {
    let (cin_g, cout_g) = (g.cin_g(), g.cout_g());
    for n in 0..g.batch {
        for co in 0..g.c_out {
            let group = co / cout_g;
            for oy in 0..g.oh {
                for ox in 0..g.ow {
                    let o = at(g.layout, (g.c_out, g.oh, g.ow), n, co, oy, ox);
                    for ci in 0..cin_g {
                        for ky in 0..g.kh {
                            for kx in 0..g.kw {
                                let y = (oy * g.sh + ky * g.dh) as isize - g.pad_top as isize;
                                let x = (ox * g.sw + kx * g.dw) as isize - g.pad_left as isize;
                                if y < 0 || x < 0 || y as usize >= g.h || x as usize >= g.w {
                                    continue;
                                }
                                let c = group * cin_g + ci;
                                let i =
                                    at(g.layout, (g.c_in, g.h, g.w), n, c, y as usize, x as usize);
                                let wi = ((co * cin_g + ci) * g.kh + ky) * g.kw + kx;
                                f(i, wi, o, co);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The input's gradient `∂L/∂x = Σ ∂L/∂y · w` of the convolution alone (activation ignored),
/// from the definition in f64. `k_len` is the number of products a gradient element can sum at
/// most (`c_out/groups · kh · kw`).
pub fn backward_data(
    params: &ConvParams,
    batch: usize,
    in_h: usize,
    in_w: usize,
    grad_output: &[f32],
    weights: &[f32],
) -> Result<Reference> {
    let g: Geometry = params.geometry(batch, in_h, in_w)?;
    crate::error::check_lengths(&[
        ("grad_output", g.output_len(), Some(grad_output.len())),
        ("weights", params.weights_len()?, Some(weights.len())),
    ])?;
    let mut values = vec![0.0; g.input_len()];
    let mut magnitude = vec![0.0; g.input_len()];
    for_each_product(&g, |i, wi, o, _| {
        let p = grad_output[o] as f64 * weights[wi] as f64;
        values[i] += p;
        magnitude[i] += p.abs();
    });
    Ok(Reference {
        values,
        magnitude,
        k_len: g.cout_g() * g.kh * g.kw,
    })
}

/// The gradients of the weights (OIHW) and of the bias, `∂L/∂w = Σ ∂L/∂y · x` and `∂L/∂b =
/// Σ ∂L/∂y`, from the definition in f64.
pub fn backward_weights(
    params: &ConvParams,
    batch: usize,
    in_h: usize,
    in_w: usize,
    input: &[f32],
    grad_output: &[f32],
) -> Result<(Reference, Reference)> {
    let g: Geometry = params.geometry(batch, in_h, in_w)?;
    crate::error::check_lengths(&[
        ("input", g.input_len(), Some(input.len())),
        ("grad_output", g.output_len(), Some(grad_output.len())),
    ])?;
    let len = params.weights_len()?;
    let (mut values, mut magnitude) = (vec![0.0; len], vec![0.0; len]);
    for_each_product(&g, |i, wi, o, _| {
        let p = grad_output[o] as f64 * input[i] as f64;
        values[wi] += p;
        magnitude[wi] += p.abs();
    });
    let (mut bias, mut bias_mag) = (vec![0.0; g.c_out], vec![0.0; g.c_out]);
    for n in 0..g.batch {
        for co in 0..g.c_out {
            for oy in 0..g.oh {
                for ox in 0..g.ow {
                    let v = grad_output[at(g.layout, (g.c_out, g.oh, g.ow), n, co, oy, ox)] as f64;
                    bias[co] += v;
                    bias_mag[co] += v.abs();
                }
            }
        }
    }
    let k_len = g.batch * g.oh * g.ow;
    Ok((
        Reference {
            values,
            magnitude,
            k_len,
        },
        Reference {
            values: bias,
            magnitude: bias_mag,
            k_len,
        },
    ))
}

/// Transposed convolution (PyTorch's `ConvTranspose2d`) straight from its definition: every
/// input pixel `(iy, ix)` of channel `ci` adds `x · W[ci][co][ky][kx]` to output pixel
/// `(iy·s - pad_begin + ky·d, …)`; then bias, residual, activation. `params` describe the
/// transposed convolution (weights `in x out/groups x kh x kw`); explicit or valid padding.
/// Returns the output and its shape in the layout's order.
#[allow(clippy::too_many_arguments)]
pub fn conv_transpose(
    params: &ConvParams,
    output_padding: [usize; 2],
    batch: usize,
    in_h: usize,
    in_w: usize,
    input: &[f32],
    weights: &[f32],
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
) -> Result<(Reference, [usize; 4])> {
    params.validate()?;
    let [pt, pb, pl, pr] = match params.padding {
        crate::Padding::Explicit {
            top,
            bottom,
            left,
            right,
        } => [top, bottom, left, right],
        crate::Padding::Valid => [0; 4],
        _ => {
            return Err(crate::Error::InvalidParameter {
                what: "padding",
                detail: "the reference transposed convolution takes explicit padding".into(),
            })
        }
    };
    let size = |i: usize, input: usize, pads: usize| {
        ((input - 1) * params.stride[i]
            + (params.kernel[i] - 1) * params.dilation[i]
            + 1
            + output_padding[i]) as isize
            - pads as isize
    };
    let (oh, ow) = (size(0, in_h, pt + pb), size(1, in_w, pl + pr));
    if oh <= 0 || ow <= 0 {
        return Err(crate::Error::InvalidParameter {
            what: "output size",
            detail: format!("{oh}x{ow}"),
        });
    }
    let (oh, ow) = (oh as usize, ow as usize);
    let (cin, cout, groups) = (params.in_channels, params.out_channels, params.groups);
    let (cin_g, cout_g) = (cin / groups, cout / groups);
    let (kh, kw) = (params.kernel[0], params.kernel[1]);
    let out_len = batch * cout * oh * ow;
    crate::error::check_lengths(&[
        ("input", batch * cin * in_h * in_w, Some(input.len())),
        ("weights", cin * cout_g * kh * kw, Some(weights.len())),
        ("bias", cout, bias.map(|b| b.len())),
        ("residual", out_len, residual.map(|r| r.len())),
    ])?;
    let (mut values, mut magnitude) = (vec![0.0; out_len], vec![0.0; out_len]);
    for n in 0..batch {
        for ci in 0..cin {
            let group = ci / cin_g;
            for iy in 0..in_h {
                for ix in 0..in_w {
                    let x = input[at(params.layout, (cin, in_h, in_w), n, ci, iy, ix)] as f64;
                    for co in 0..cout_g {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let oy = (iy * params.stride[0] + ky * params.dilation[0]) as isize
                                    - pt as isize;
                                let ox = (ix * params.stride[1] + kx * params.dilation[1]) as isize
                                    - pl as isize;
                                if oy < 0 || ox < 0 || oy as usize >= oh || ox as usize >= ow {
                                    continue;
                                }
                                let c = group * cout_g + co;
                                let o = at(
                                    params.layout,
                                    (cout, oh, ow),
                                    n,
                                    c,
                                    oy as usize,
                                    ox as usize,
                                );
                                let p =
                                    x * weights[((ci * cout_g + co) * kh + ky) * kw + kx] as f64;
                                values[o] += p;
                                magnitude[o] += p.abs();
                            }
                        }
                    }
                }
            }
        }
    }
    for n in 0..batch {
        for c in 0..cout {
            for y in 0..oh {
                for x in 0..ow {
                    let o = at(params.layout, (cout, oh, ow), n, c, y, x);
                    for extra in [bias.map(|b| b[c]), residual.map(|r| r[o])]
                        .into_iter()
                        .flatten()
                    {
                        values[o] += extra as f64;
                        magnitude[o] += (extra as f64).abs();
                    }
                    values[o] = params.activation.apply_f64(values[o]);
                }
            }
        }
    }
    let shape = match params.layout {
        Layout::Nchw => [batch, cout, oh, ow],
        Layout::Nhwc => [batch, oh, ow, cout],
    };
    Ok((
        Reference {
            values,
            magnitude,
            k_len: cin_g * kh * kw,
        },
        shape,
    ))
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
