//! `convkit run`: one convolution on .npy files.

use crate::args::{CliError, CliResult, Flags};
use crate::bench::Dtype;
use crate::layers::zeros;
use crate::passes::Pass;
use crate::{resolve_isa, setup_threads};
use convkit::{Conv2d, Options, Workspace};
use npyz::WriterBuilder;
use std::io::{BufReader, BufWriter, Write};
use std::time::Instant;

pub fn main(args: &[String]) -> CliResult<bool> {
    let flags = Flags::parse(
        args,
        &[
            "layer",
            "input",
            "weight",
            "bias",
            "output",
            "threads",
            "isa",
            "precision",
            "dtype",
            "weight-scales",
            "weight-scale",
            "x-scale",
            "x-zero-point",
            "y-scale",
            "y-zero-point",
            "pass",
            "grad-output",
            "grad-bias",
            "output-padding",
        ],
        &[],
    )?;
    let dtype: Dtype = flags.parsed("dtype")?.unwrap_or(Dtype::F32);
    if matches!(dtype, Dtype::F16 | Dtype::Bf16) {
        return Err(CliError::Usage(
            "run takes --dtype f32, u8 or i8 (f16 and bf16: bench and check)".into(),
        ));
    }
    let pass: Pass = flags.parsed("pass")?.unwrap_or(Pass::Forward);
    if pass != Pass::Forward {
        if dtype != Dtype::F32 {
            return Err(CliError::Usage(
                "--pass other than forward runs --dtype f32 only".into(),
            ));
        }
        return crate::passes::run(&flags, pass);
    }
    if dtype != Dtype::F32 {
        return crate::qcli::run(&flags, dtype);
    }
    let layer = flags.required("layer")?;
    let fields: Vec<&str> = layer.split(',').collect();
    let s = convkit::suite::parse_numbers("--layer", &fields)
        .map_err(|e| CliError::Usage(format!("--layer {layer:?}: {e}")))?;
    let (input_path, weight_path, output_path) = (
        flags.required("input")?,
        flags.required("weight")?,
        flags.required("output")?,
    );
    let (threads, workers) = setup_threads(flags.parsed("threads")?)?;
    let isa = resolve_isa(flags.parsed("isa")?)?;
    let params = s.params;
    let g = s.geometry()?;
    let (c_in, c_out, [kh, kw]) = (params.in_channels, params.out_channels, params.kernel);

    // A 1-D convolution (h == 1, kh == 1) may drop the height axis of its tensors.
    let input = read_npy(input_path, "input", &[s.batch, c_in, s.h, s.w], s.h == 1)?;
    let weights = read_npy(
        weight_path,
        "weights",
        &[c_out, params.in_channels_per_group(), kh, kw],
        kh == 1,
    )?;
    let bias = flags
        .get("bias")
        .map(|path| read_npy(path, "bias", &[c_out], false))
        .transpose()?;

    let conv = Conv2d::new(
        params,
        &weights,
        bias.as_deref(),
        Options {
            threads,
            isa: Some(isa),
            algorithm: None,
            kernel: None,
            precision: flags.parsed("precision")?.unwrap_or_default(),
            input_hint: Some([s.h, s.w]),
        },
    )?;
    let plan = conv.plan(s.batch, s.h, s.w)?;
    let mut output = zeros(plan.output_len(), "output")?;
    let mut ws = Workspace::with_bytes(plan.workspace_bytes())?;
    let start = Instant::now();
    plan.run(&input, &mut output, &mut ws)?;
    let secs = start.elapsed().as_secs_f64();

    let shape = [g.batch, g.c_out, g.oh, g.ow];
    write_npy(output_path, &shape, &output)?;
    println!(
        "kernel: {} (isa {isa}, {workers} thread(s))",
        plan.kernel_name()
    );
    println!(
        "time: {:.3} ms ({:.2} GFLOP/s, one call)",
        secs * 1e3,
        plan.flops() / secs / 1e9
    );
    println!("output: {output_path} {shape:?}");
    Ok(true)
}

/// Reads a C-order .npy file of element type `T` and shape `expected` (or, when
/// `may_drop_h`, `expected` without its third axis: the height of a 1-D convolution). The
/// shape is checked before the data is read.
pub fn read_npy<T: npyz::Deserialize>(
    path: &str,
    what: &str,
    expected: &[usize],
    may_drop_h: bool,
) -> CliResult<Vec<T>> {
    let full: Vec<usize> = expected.to_vec();
    let mut accepted: Vec<Vec<usize>> = vec![full.clone()];
    if may_drop_h && full.len() == 4 {
        accepted.push(vec![full[0], full[1], full[3]]);
    }
    let shapes: Vec<&[usize]> = accepted.iter().map(|s| s.as_slice()).collect();
    read_npy_any(path, what, &shapes)
}

/// Reads a C-order .npy file of element type `T` whose shape is one of `accepted`.
pub fn read_npy_any<T: npyz::Deserialize>(
    path: &str,
    what: &str,
    accepted: &[&[usize]],
) -> CliResult<Vec<T>> {
    let fail = |e: String| CliError::Failed(format!("{what} {path}: {e}"));
    let file = std::fs::File::open(path).map_err(|e| fail(e.to_string()))?;
    let npy = npyz::NpyFile::new(BufReader::new(file))
        .map_err(|e| fail(format!("not a .npy file: {e}")))?;

    let accepted: Vec<Vec<u64>> = accepted
        .iter()
        .map(|s| s.iter().map(|&x| x as u64).collect())
        .collect();
    if !accepted.iter().any(|s| s.as_slice() == npy.shape()) {
        let alternatives: Vec<String> = accepted.iter().map(|s| format!("{s:?}")).collect();
        return Err(fail(format!(
            "shape {:?} does not match --layer: expected {}",
            npy.shape(),
            alternatives.join(" or ")
        )));
    }
    if npy.order() != npyz::Order::C {
        return Err(fail(
            "Fortran order; save a C-ordered array (np.ascontiguousarray)".into(),
        ));
    }
    let descr = npy.dtype().descr();
    let want = std::any::type_name::<T>();
    npy.into_vec::<T>().map_err(|e| {
        fail(format!(
            "cannot read dtype {descr} as {want} (convert it with .astype): {e}"
        ))
    })
}

pub fn write_npy<T: npyz::AutoSerialize + Copy>(
    path: &str,
    shape: &[usize],
    data: &[T],
) -> CliResult<()> {
    let fail = |e: std::io::Error| CliError::Failed(format!("cannot write {path}: {e}"));
    let mut file = BufWriter::new(std::fs::File::create(path).map_err(fail)?);
    let shape: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
    let mut writer = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&shape)
        .writer(&mut file)
        .begin_nd()
        .map_err(fail)?;
    writer.extend(data.iter().copied()).map_err(fail)?;
    writer.finish().map_err(fail)?;
    // Flush here: BufWriter's drop would swallow a write error.
    file.flush().map_err(fail)
}
