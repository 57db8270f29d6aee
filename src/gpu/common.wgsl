// Shared by both convolution shaders: the layer's dimensions and the fused epilogue.
// The Rust side (`src/gpu/mod.rs`, `Dims`) writes this struct; keep the two in step.

struct Dims {
    batch: u32, c_in: u32, h: u32, w: u32,
    c_out: u32, groups: u32, cin_g: u32, cout_g: u32,
    kh: u32, kw: u32, sh: u32, sw: u32,
    dh: u32, dw: u32, pad_top: u32, pad_left: u32,
    oh: u32, ow: u32, nhwc: u32, activation: u32,
    has_bias: u32, has_residual: u32, alpha: f32, lo: f32,
    hi: f32, _pad0: u32, _pad1: u32, _pad2: u32,
}

@group(0) @binding(0) var<uniform> d: Dims;
@group(0) @binding(1) var<storage, read> input: array<f32>;
@group(0) @binding(2) var<storage, read> weights: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read> residual: array<f32>;
@group(0) @binding(5) var<storage, read_write> output: array<f32>;

// The input element of image `b`, channel `c` at row `iy`, column `ix` (signed: padding reads 0).
fn load_input(b: u32, c: u32, iy: i32, ix: i32) -> f32 {
    if (iy < 0 || ix < 0 || iy >= i32(d.h) || ix >= i32(d.w)) {
        return 0.0;
    }
    let y = u32(iy);
    let x = u32(ix);
    if (d.nhwc == 1u) {
        return input[((b * d.h + y) * d.w + x) * d.c_in + c];
    }
    return input[((b * d.c_in + c) * d.h + y) * d.w + x];
}

fn output_index(b: u32, c: u32, oy: u32, ox: u32) -> u32 {
    if (d.nhwc == 1u) {
        return ((b * d.oh + oy) * d.ow + ox) * d.c_out + c;
    }
    return ((b * d.c_out + c) * d.oh + oy) * d.ow + ox;
}

// erf to within 1.5e-7 (Abramowitz and Stegun 7.1.26); WGSL has no erf.
fn erf_approx(x: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.3275911 * abs(x));
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    let y = 1.0 - poly * exp(-x * x);
    return select(-y, y, x >= 0.0);
}

// Activation codes: the order of `Activation` in src/epilogue.rs (see `activation_code`).
fn activate(x: f32) -> f32 {
    switch d.activation {
        case 1u: { return max(x, 0.0); }
        case 2u: { return min(max(x, 0.0), 6.0); }
        case 3u: { return min(max(x, d.lo), d.hi); }
        case 4u: { return select(d.alpha * x, x, x > 0.0); }
        case 5u: { return x / (1.0 + exp(-x)); }
        case 6u: { return 0.5 * x * (1.0 + erf_approx(x * 0.70710678118654752)); }
        case 7u: { return x * min(max(x + 3.0, 0.0), 6.0) / 6.0; }
        case 8u: { return 1.0 / (1.0 + exp(-x)); }
        default: { return x; }
    }
}

// Bias, residual and activation on one accumulated sum, then the store.
fn store(b: u32, c: u32, oy: u32, ox: u32, sum: f32) {
    var v = sum;
    if (d.has_bias == 1u) {
        v += bias[c];
    }
    let i = output_index(b, c, oy, ox);
    if (d.has_residual == 1u) {
        v += residual[i];
    }
    output[i] = activate(v);
}
