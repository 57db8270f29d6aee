//! The layer suite: its CSV format (shared by `bench` and `check`), the `--layer` string of
//! `run`, and the deterministic pseudo-random tensors the suite runs on.

use crate::args::{CliError, CliResult, Flags};
use convkit::{ConvParams, Geometry};

pub use convkit::suite::Layer;

/// Bytes a whole im2col matrix would take: every output pixel's receptive field, for every
/// image and group. u128: this is the number that does not fit in memory.
pub fn im2col_bytes(g: &Geometry) -> u128 {
    [4, g.batch, g.k_len(), g.oh, g.ow, g.groups]
        .iter()
        .map(|&x| x as u128)
        .product()
}

/// The suite from `--layers FILE` (or the built-in one), narrowed to `--only a,b,c`.
/// The suite is written NCHW; `layout` runs the same layers on NHWC tensors.
fn load(
    path: Option<&str>,
    only: Option<&str>,
    layout: Option<convkit::Layout>,
) -> CliResult<Vec<Layer>> {
    let layers = match path {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| CliError::Failed(format!("cannot read {p}: {e}")))?;
            convkit::suite::parse(&text, p)
        }
        None => convkit::suite::builtin(),
    }
    .map_err(|e| CliError::Failed(e.to_string()))?;
    let layers: Vec<Layer> = layers
        .into_iter()
        .map(|mut l| {
            l.params.layout = layout.unwrap_or_default();
            l
        })
        .collect();
    let Some(only) = only else { return Ok(layers) };
    let wanted: Vec<&str> = only
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(missing) = wanted
        .iter()
        .find(|w| !layers.iter().any(|l| l.name == **w))
    {
        let names: Vec<&str> = layers.iter().map(|l| l.name.as_str()).collect();
        return Err(CliError::Usage(format!(
            "--only: no layer named {missing:?} (layers: {})",
            names.join(", ")
        )));
    }
    if wanted.is_empty() {
        return Err(CliError::Usage("--only: no layer names given".into()));
    }
    // Keep the suite's order, not the order of --only.
    Ok(layers
        .into_iter()
        .filter(|l| wanted.contains(&l.name.as_str()))
        .collect())
}

/// The suite a subcommand's flags name: `--layers`, `--only`, `--layout`, and `--batch N`
/// (every layer at batch N instead of the suite's) where the subcommand takes it.
pub fn from_flags(flags: &Flags) -> CliResult<Vec<Layer>> {
    let mut layers = load(
        flags.get("layers"),
        flags.get("only"),
        flags.parsed("layout")?,
    )?;
    match flags.parsed::<usize>("batch")? {
        Some(0) => return Err(CliError::Usage("--batch must be at least 1".into())),
        Some(n) => layers.iter_mut().for_each(|l| l.batch = n),
        None => {}
    }
    Ok(layers)
}

/// splitmix64: tiny, fast and good enough for test data.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Roughly N(0, 1): the sum of 4 uniforms, centred and scaled to variance 1. Bounded
    /// (|x| < 3.5), which keeps the reference's tolerance meaningful.
    fn normal(&mut self) -> f32 {
        let s: f64 = (0..4).map(|_| self.uniform()).sum();
        ((s - 2.0) * 3f64.sqrt()) as f32
    }
}

/// An empty vector with room for `len` floats, or `Error::OutOfMemory` (where `vec!` would
/// abort the process on a layer too large for this machine).
pub fn with_capacity(len: usize, what: &'static str) -> convkit::Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| convkit::Error::OutOfMemory {
            what,
            bytes: len.saturating_mul(4),
        })?;
    Ok(v)
}

/// `len` zeros, or `Error::OutOfMemory`.
pub fn zeros(len: usize, what: &'static str) -> convkit::Result<Vec<f32>> {
    let mut v = with_capacity(len, what)?;
    v.resize(len, 0.0);
    Ok(v)
}

/// `len` pseudo-random values, the same on every run for the same (layer, tensor).
pub fn randn(layer: &str, tensor: &'static str, len: usize) -> convkit::Result<Vec<f32>> {
    // FNV-1a of the names: each layer and tensor gets its own stream.
    let seed = layer
        .bytes()
        .chain([0])
        .chain(tensor.bytes())
        .fold(0xCBF2_9CE4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01B3)
        });
    let mut rng = SplitMix64(seed);
    let mut v = with_capacity(len, tensor)?;
    v.extend((0..len).map(|_| rng.normal()));
    Ok(v)
}

/// A layer ready to run: parameters, geometry and its input, weights and bias.
pub struct Prepared {
    pub params: ConvParams,
    pub geometry: Geometry,
    pub input: Vec<f32>,
    pub weights: Vec<f32>,
    pub bias: Vec<f32>,
}

impl Prepared {
    pub fn new(layer: &Layer) -> convkit::Result<Prepared> {
        let params = layer.params;
        let geometry = layer.geometry()?;
        Ok(Prepared {
            params,
            input: randn(&layer.name, "input", geometry.input_len())?,
            weights: randn(&layer.name, "weights", params.weights_len()?)?,
            bias: randn(&layer.name, "bias", params.out_channels)?,
            geometry,
        })
    }

    /// The reference result (slow: nested loops in f64).
    pub fn reference(&self) -> convkit::Result<convkit::reference::Reference> {
        let g = &self.geometry;
        convkit::reference::conv(
            &self.params,
            g.batch,
            g.h,
            g.w,
            &self.input,
            &self.weights,
            Some(&self.bias),
            None,
        )
    }
}
