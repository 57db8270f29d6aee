//! The layer suite of `convkit bench` (`bench/layers.csv`, built in) and its CSV format, shared
//! by the command-line tool and the criterion benches.
//!
//! Format: a header `name,n,c_in,h,w,c_out,kh,kw,stride_h,stride_w,pad_h,pad_w,dil_h,dil_w,groups`,
//! then one layer a line, NCHW, symmetric explicit padding (`pad_h` top and bottom, `pad_w`
//! left and right). `#` starts a comment line. Names are unique.

use crate::{ConvParams, Error, Padding, Result};

/// The built-in suite: convolution layers of real networks.
pub const LAYERS_CSV: &str = include_str!("../bench/layers.csv");

/// The CSV columns, in order.
pub const COLUMNS: [&str; 15] = [
    "name", "n", "c_in", "h", "w", "c_out", "kh", "kw", "stride_h", "stride_w", "pad_h", "pad_w",
    "dil_h", "dil_w", "groups",
];

/// One layer of a suite.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    /// The layer's name, e.g. `resnet50_l1_3x3`.
    pub name: String,
    /// Images in the batch.
    pub batch: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// The convolution's parameters.
    pub params: ConvParams,
}

impl Layer {
    /// Padding resolved and output size, or the reason the layer is invalid.
    pub fn geometry(&self) -> Result<crate::Geometry> {
        self.params.geometry(self.batch, self.h, self.w)
    }

    /// The kernel family the layer belongs to, for per-family benchmarks.
    pub fn family(&self) -> &'static str {
        let p = &self.params;
        if p.groups == p.in_channels && p.groups > 1 {
            "depthwise"
        } else if p.groups > 1 {
            "grouped"
        } else if p.in_channels <= 4 {
            "stem"
        } else if matches!(p.kernel, [3, 3] | [1, 3]) && p.stride == [1, 1] && p.dilation == [1, 1]
        {
            "winograd"
        } else {
            "dense"
        }
    }
}

fn invalid(detail: String) -> Error {
    Error::InvalidParameter {
        what: "layer",
        detail,
    }
}

/// Parses the 14 numbers `n,c_in,h,w,c_out,kh,kw,stride_h,stride_w,pad_h,pad_w,dil_h,dil_w,groups`
/// (the form `convkit run --layer` takes) into a layer called `name`.
pub fn parse_numbers(name: &str, fields: &[&str]) -> Result<Layer> {
    numbers(name, fields).map_err(invalid)
}

fn numbers(name: &str, fields: &[&str]) -> std::result::Result<Layer, String> {
    let names = &COLUMNS[1..];
    if fields.len() != names.len() {
        return Err(format!(
            "expected {} numbers ({}), got {}",
            names.len(),
            names.join(","),
            fields.len()
        ));
    }
    let mut v = [0usize; 14];
    for ((slot, field), col) in v.iter_mut().zip(fields).zip(names) {
        let field = field.trim();
        *slot = field
            .parse()
            .map_err(|_| format!("{col}: {field:?} is not a non-negative integer"))?;
    }
    let [n, c_in, h, w, c_out, kh, kw, sh, sw, ph, pw, dh, dw, groups] = v;
    let params = ConvParams::conv2d(c_in, c_out, [kh, kw])
        .with_groups(groups)
        .with_stride([sh, sw])
        .with_dilation([dh, dw])
        .with_padding(Padding::symmetric(ph, pw));
    Ok(Layer {
        name: name.to_string(),
        batch: n,
        h,
        w,
        params,
    })
}

/// Parses a suite CSV; `source` names it in errors, which also give the line number.
pub fn parse(text: &str, source: &str) -> Result<Vec<Layer>> {
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim()))
        .filter(|(_, l)| !l.is_empty() && !l.starts_with('#'));
    let header: Option<Vec<&str>> = lines
        .next()
        .map(|(_, l)| l.split(',').map(str::trim).collect());
    if header.as_deref() != Some(&COLUMNS[..]) {
        return Err(invalid(format!(
            "{source}: the first line must be the header {}",
            COLUMNS.join(",")
        )));
    }
    let mut layers: Vec<Layer> = Vec::new();
    for (lineno, line) in lines {
        let fields: Vec<&str> = line.split(',').collect();
        let name = fields[0].trim();
        if name.is_empty() {
            return Err(invalid(format!("{source}:{lineno}: empty layer name")));
        }
        if layers.iter().any(|l| l.name == name) {
            return Err(invalid(format!(
                "{source}:{lineno}: layer {name} appears twice"
            )));
        }
        let layer =
            numbers(name, &fields[1..]).map_err(|e| invalid(format!("{source}:{lineno}: {e}")))?;
        layers.push(layer);
    }
    if layers.is_empty() {
        return Err(invalid(format!("{source}: no layers")));
    }
    Ok(layers)
}

/// The built-in suite.
pub fn builtin() -> Result<Vec<Layer>> {
    parse(LAYERS_CSV, "bench/layers.csv")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_suite_parses_and_every_layer_is_valid() {
        let layers = builtin().unwrap();
        assert_eq!(layers.len(), 33);
        for l in &layers {
            l.geometry().unwrap();
        }
        let l = layers
            .iter()
            .find(|l| l.name == "wav2vec2_conv0_k10s5")
            .unwrap();
        assert_eq!(
            (l.params.kernel, l.params.stride, l.w),
            ([1, 10], [1, 5], 16000)
        );
    }

    #[test]
    fn bad_suites_are_errors_with_line_numbers() {
        let header = COLUMNS.join(",");
        assert!(parse("a,1,2\n", "x")
            .unwrap_err()
            .to_string()
            .contains("header"));
        let dup =
            format!("{header}\nl,1,3,8,8,4,3,3,1,1,1,1,1,1,1\nl,1,3,8,8,4,3,3,1,1,1,1,1,1,1\n");
        assert!(parse(&dup, "x")
            .unwrap_err()
            .to_string()
            .contains("x:3: layer l appears twice"));
        let bad = format!("{header}\n# comment\nl,1,3,8,8,4,3,3,1,1,1,1,1,1,-1\n");
        assert!(parse(&bad, "x")
            .unwrap_err()
            .to_string()
            .contains("x:3: groups"));
    }
}
