//! `convkit bench`: time every layer of the suite, after checking it once against the
//! reference.

use crate::args::{CliError, CliResult, Flags};
use crate::layers::{self, im2col_bytes, Layer, Prepared};
use crate::passes::Pass;
use crate::{peak, resolve_isa, setup_threads};
use convkit::{Algorithm, Conv2d, Error, Options, Workspace};
use std::time::{Duration, Instant};

/// Warm-up calls before timing: first-touch of the workspace and output, caches.
const WARMUP: usize = 2;
/// Each repetition loops the call for at least this long, so the clock's resolution and
/// the loop's overhead do not matter.
const MIN_REP: Duration = Duration::from_millis(20);

/// What happened to one layer.
enum Outcome {
    Ran(Measured),
    /// The forced `--algorithm` does not take this layer.
    Skipped(String),
    Error(String),
}

pub struct Measured {
    pub kernel: String,
    pub median_s: f64,
    /// GFLOP/s (f32) or GOP/s (int8).
    pub gflops: f64,
    pub workspace: usize,
    /// f32: the largest absolute error; int8: the largest difference in output units.
    pub max_abs: f64,
    pub passed: bool,
}

/// The element type `bench`, `check` and `run` work in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    /// Quantized, u8 activations (zero point 128) and outputs.
    U8,
    /// Quantized, i8 activations (zero point 0) and outputs.
    I8,
    /// Inputs, weights, bias and outputs stored in f16, arithmetic in f32.
    F16,
    /// Inputs, weights, bias and outputs stored in bf16, arithmetic in f32.
    Bf16,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::U8 => "u8",
            Dtype::I8 => "i8",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }

    /// True for the quantized types (int8 kernels and GOP/s).
    pub fn is_int8(self) -> bool {
        matches!(self, Dtype::U8 | Dtype::I8)
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Dtype::F32),
            "u8" => Ok(Dtype::U8),
            "i8" | "int8" => Ok(Dtype::I8),
            "f16" => Ok(Dtype::F16),
            "bf16" => Ok(Dtype::Bf16),
            _ => Err("not one of f32, f16, bf16, u8, i8".into()),
        }
    }
}

/// What the table's columns count.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Unit {
    F32,
    Int8,
}

/// Runs `call` for `reps` repetitions of at least `MIN_REP` each, after `WARMUP` calls;
/// returns the median seconds a call.
pub fn time_median(
    reps: usize,
    mut call: impl FnMut() -> convkit::Result<()> + Send,
) -> convkit::Result<f64> {
    // Timed from inside the pool, as the library's docs advise: the calling thread is then
    // one of the workers, and the others are woken by work-stealing, not by an injection.
    rayon::scope(|_| {
        for _ in 0..WARMUP {
            call()?;
        }
        let mut per_call = Vec::with_capacity(reps);
        for _ in 0..reps {
            let (start, mut calls) = (Instant::now(), 0u32);
            while start.elapsed() < MIN_REP {
                call()?;
                calls += 1;
            }
            per_call.push(start.elapsed().as_secs_f64() / calls as f64);
        }
        Ok(median(&mut per_call))
    })
}

pub fn main(args: &[String]) -> CliResult<bool> {
    let flags = Flags::parse(
        args,
        &[
            "layers",
            "threads",
            "isa",
            "algorithm",
            "kernel",
            "precision",
            "reps",
            "only",
            "layout",
            "peak",
            "dtype",
            "batch",
            "pass",
        ],
        &["csv"],
    )?;
    let layers = layers::from_flags(&flags)?;

    let reps: usize = flags.parsed("reps")?.unwrap_or(7);
    if reps == 0 {
        return Err(CliError::Usage("--reps must be at least 1".into()));
    }
    let algorithm: Option<Algorithm> = flags.parsed("algorithm")?;
    let csv = flags.has("csv");
    let requested_peak: Option<f64> = flags.parsed("peak")?;
    if requested_peak.is_some_and(|p| !(p > 0.0 && p.is_finite())) {
        return Err(CliError::Usage(
            "--peak must be a positive number of GFLOP/s".into(),
        ));
    }
    let dtype: Dtype = flags.parsed("dtype")?.unwrap_or(Dtype::F32);
    let pass: Pass = flags.parsed("pass")?.unwrap_or(Pass::Forward);
    if pass != Pass::Forward
        && (dtype != Dtype::F32
            || flags.get("algorithm").is_some()
            || flags.get("kernel").is_some())
    {
        return Err(CliError::Usage(
            "--pass other than forward runs --dtype f32 with convkit's own choice (no --algorithm or --kernel)".into(),
        ));
    }
    let (threads, workers) = setup_threads(flags.parsed("threads")?)?;
    let kernel = match flags.get("kernel") {
        Some(name) => Some(convkit::cpu::find_kernel(name)?),
        None => None,
    };
    if let Some(k) = kernel {
        let storage = match dtype {
            Dtype::F16 => convkit::StorageType::F16,
            Dtype::Bf16 => convkit::StorageType::Bf16,
            _ => convkit::StorageType::F32,
        };
        if k.family.is_int8() != dtype.is_int8() || (!dtype.is_int8() && k.storage != storage) {
            return Err(CliError::Usage(format!(
                "--kernel {} does not run --dtype {}",
                k.name,
                dtype.name()
            )));
        }
    }
    // A forced kernel brings its own ISA; an `--isa` that says otherwise is an error.
    let requested: Option<convkit::Isa> = flags.parsed("isa")?;
    let isa = match kernel {
        Some(k) if requested.is_some_and(|i| i != k.isa) => {
            return Err(CliError::Usage(format!(
                "--kernel {} is {}, not --isa {}",
                k.name,
                k.isa,
                requested.map_or("", |i| i.name())
            )))
        }
        Some(k) => convkit::Isa::check(k.isa)?,
        None => resolve_isa(requested)?,
    };
    let options = Options {
        threads,
        isa: Some(isa),
        algorithm,
        kernel: kernel.map(|k| k.name),
        precision: flags.parsed("precision")?.unwrap_or_default(),
        input_hint: None,
    };

    // Notes go to stdout with the table, or to stderr when stdout is CSV.
    let note = |s: String| {
        if csv {
            eprintln!("{s}")
        } else {
            println!("{s}")
        }
    };
    let (per_core, how) = match requested_peak {
        Some(p) => (p, "--peak"),
        None => peak::measure(),
    };
    let peak = per_core * workers as f64;
    note(format!(
        "isa {isa}, {workers} thread(s); peak {per_core:.1} GFLOP/s per core ({how}) x {workers} = {peak:.1} GFLOP/s"
    ));
    // int8: the peak of the kernel's multiply-adds, a multiple of the f32 FMA peak.
    let (peak, unit) = match dtype {
        Dtype::F32 | Dtype::F16 | Dtype::Bf16 => (peak, Unit::F32),
        _ => {
            let (factor, why) = crate::qcli::peak_factor(isa, kernel.map(|k| k.name));
            note(format!(
                "int8 peak: {factor} x the f32 peak ({why}) = {:.1} GOP/s",
                factor * peak
            ));
            (factor * peak, Unit::Int8)
        }
    };

    let mut rows = Vec::new();
    for (i, layer) in layers.iter().enumerate() {
        eprintln!("[{}/{}] {} ...", i + 1, layers.len(), layer.name);
        // Timed from inside the pool, as an engine that embeds convkit runs it: the calling
        // thread is one of the workers instead of waking all of them on every run.
        let run = || match dtype {
            Dtype::F32 if pass != Pass::Forward => {
                crate::passes::bench_layer(layer, options, reps, pass)
            }
            Dtype::F32 => bench_layer(layer, options, reps),
            Dtype::F16 | Dtype::Bf16 => crate::halfcli::bench_layer(layer, options, reps, dtype),
            q => crate::qcli::bench_layer(layer, options, reps, q),
        };
        let outcome = match rayon::scope(|_| run()) {
            Ok(m) => Outcome::Ran(m),
            Err(e @ Error::AlgorithmUnsupported { .. }) => Outcome::Skipped(e.to_string()),
            Err(e) => Outcome::Error(e.to_string()),
        };
        match &outcome {
            Outcome::Skipped(why) => eprintln!("  skipped: {why}"),
            Outcome::Error(why) => eprintln!("  error: {why}"),
            Outcome::Ran(m) if !m.passed => {
                eprintln!("  MISMATCH: max error {:.3e}", m.max_abs)
            }
            Outcome::Ran(_) => {}
        }
        rows.push((layer, outcome));
    }

    print_table(&rows, peak, csv, unit);
    summary(&layers, &rows, note, unit);
    Ok(rows.iter().all(|(_, o)| {
        matches!(
            o,
            Outcome::Skipped(_) | Outcome::Ran(Measured { passed: true, .. })
        )
    }))
}

/// Create, plan, check once against the reference, then time.
fn bench_layer(layer: &Layer, options: Options, reps: usize) -> convkit::Result<Measured> {
    let p = Prepared::new(layer)?;
    let options = Options {
        input_hint: Some([p.geometry.h, p.geometry.w]),
        ..options
    };
    let conv = Conv2d::new(p.params, &p.weights, Some(&p.bias), options)?;
    let g = &p.geometry;
    let plan = conv.plan(g.batch, g.h, g.w)?;
    let mut output = layers::zeros(plan.output_len(), "output")?;
    let mut ws = Workspace::with_bytes(plan.workspace_bytes())?;

    plan.run(&p.input, &mut output, &mut ws)?;
    let cmp = p.reference()?.compare_scaled(&output, plan.error_factor());

    let median_s = time_median(reps, || plan.run(&p.input, &mut output, &mut ws))?;
    Ok(Measured {
        kernel: plan.kernel_name(),
        median_s,
        gflops: plan.flops() / median_s / 1e9,
        workspace: plan.workspace_bytes(),
        max_abs: cmp.max_abs,
        passed: cmp.passed(),
    })
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn print_table(rows: &[(&Layer, Outcome)], peak: f64, csv: bool, unit: Unit) {
    let (rate, err) = match unit {
        Unit::F32 => ("GFLOP/s", "max_abs_err"),
        Unit::Int8 => ("GOP/s", "max_diff"),
    };
    let header = [
        "layer",
        "kernel",
        "median_ms",
        rate,
        "%peak",
        "workspace_B",
        err,
        "ok",
    ];
    let cells: Vec<[String; 8]> = rows
        .iter()
        .map(|(layer, o)| {
            let name = layer.name.clone();
            match o {
                Outcome::Ran(m) => [
                    name,
                    m.kernel.clone(),
                    format!("{:.4}", m.median_s * 1e3),
                    format!("{:.2}", m.gflops),
                    format!("{:.1}", 100.0 * m.gflops / peak),
                    m.workspace.to_string(),
                    match unit {
                        Unit::F32 => format!("{:.2e}", m.max_abs),
                        Unit::Int8 => format!("{}", m.max_abs),
                    },
                    if m.passed { "ok" } else { "FAIL" }.to_string(),
                ],
                Outcome::Skipped(_) | Outcome::Error(_) => {
                    let status = if matches!(o, Outcome::Skipped(_)) {
                        "skip"
                    } else {
                        "ERROR"
                    };
                    let mut row: [String; 8] = std::array::from_fn(|_| "-".to_string());
                    (row[0], row[7]) = (name, status.into());
                    row
                }
            }
        })
        .collect();
    if csv {
        let (rate, err) = match unit {
            Unit::F32 => ("gflops", "max_abs_err"),
            Unit::Int8 => ("gops", "max_diff"),
        };
        println!("layer,kernel,median_ms,{rate},pct_peak,workspace_bytes,{err},ok");
        for row in &cells {
            println!("{}", row.join(","));
        }
        return;
    }
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    // Text columns left-aligned, numbers right-aligned.
    let line = |row: &[String]| {
        let parts: Vec<String> = row
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (c, w))| {
                if i < 2 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(&header.map(String::from));
    for row in &cells {
        line(row);
    }
}

fn summary(layers: &[Layer], rows: &[(&Layer, Outcome)], note: impl Fn(String), unit: Unit) {
    let ran: Vec<(&Layer, &Measured)> = rows
        .iter()
        .filter_map(|(l, o)| match o {
            Outcome::Ran(m) => Some((*l, m)),
            _ => None,
        })
        .collect();
    if let Some((l, m)) = ran.iter().max_by_key(|(_, m)| m.workspace) {
        let im2col = layers
            .iter()
            // im2col_bytes counts f32 elements; int8 ones are a quarter of that.
            .filter_map(|l| {
                let per = if unit == Unit::F32 { 1 } else { 4 };
                l.geometry().ok().map(|g| (im2col_bytes(&g) / per, l))
            })
            .max_by_key(|(b, _)| *b);
        let im2col = match im2col {
            Some((b, il)) => format!("; a whole im2col matrix would take {b} bytes ({})", il.name),
            None => String::new(),
        };
        note(format!(
            "largest workspace: {} bytes ({}){im2col}",
            m.workspace, l.name
        ));
    }
    if !ran.is_empty() {
        let mean_log = ran.iter().map(|(_, m)| m.gflops.ln()).sum::<f64>() / ran.len() as f64;
        note(format!(
            "geometric mean: {:.2} {} over {} layer(s)",
            mean_log.exp(),
            if unit == Unit::F32 {
                "GFLOP/s"
            } else {
                "GOP/s"
            },
            ran.len()
        ));
    }
    let failed: Vec<&str> = rows
        .iter()
        .filter(|(_, o)| {
            matches!(
                o,
                Outcome::Error(_) | Outcome::Ran(Measured { passed: false, .. })
            )
        })
        .map(|(l, _)| l.name.as_str())
        .collect();
    if !failed.is_empty() {
        note(format!("FAILED: {}", failed.join(", ")));
    }
}
