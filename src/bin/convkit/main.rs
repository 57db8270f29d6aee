//! `convkit`: information, benchmarks, correctness checks and one-off convolutions on .npy
//! files. Exit codes: 0 success, 1 failure (bad input, failed check), 2 bad arguments.

/// `println!` for this tool and its modules: a closed stdout (`convkit info | head`) ends the
/// process quietly, as Unix tools do, where std's `println!` would panic.
macro_rules! println {
    () => {
        $crate::print_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::print_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes to stdout; on a broken pipe exits with success (the reader has all it wanted), on
/// another error with failure.
fn print_out(args: std::fmt::Arguments) {
    use std::io::Write;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("convkit: cannot write to stdout: {e}");
            std::process::exit(1);
        }
        std::process::exit(0);
    }
}

mod args;
mod bench;
mod check;
#[cfg(feature = "gpu")]
mod gpu;
mod halfcli;
mod layers;
mod passes;
mod peak;
mod qcli;
mod run;

use args::{CliError, CliResult, Flags};
use convkit::{Algorithm, Isa};
use std::process::ExitCode;

const USAGE: &str = "\
convkit: specialised CPU convolution kernels

Usage:
  convkit info
      CPU, ISA levels, threads, kernels and algorithms.
  convkit bench [--layers FILE] [--only NAME,...] [--threads N] [--isa LEVEL]
                [--layout nchw|nhwc] [--algorithm NAME] [--kernel NAME] [--precision P] [--reps N]
                [--dtype f32|f16|bf16|u8|i8] [--batch N] [--peak GFLOPS] [--csv]
                [--pass forward|backward-data|backward-weights|transposed]
      Check each layer once against the reference, then time it (median of --reps,
      default 7, repetitions of >= 20 ms each). --dtype u8|i8: quantized (GOP/s).
      --batch N runs every layer at batch N instead of the suite's. --pass: the layer's
      input gradient, weight (and bias) gradient, or its transposed convolution (channels
      swapped, output padding to the layer's input size), f32.
  convkit bench --device gpu [--adapter NAME] [--batch N] [--layers FILE] [--only NAME,...]
                [--layout nchw|nhwc] [--reps N] [--csv]
      Each layer on the GPU (feature `gpu`): checked against the CPU path, then the median
      device time of --reps dispatches (timestamp queries, else wall time around
      submit-and-wait; the tool says which). --batch overrides the suite's batch.
  convkit check --device gpu [--adapter NAME] [--layers FILE] [--only NAME,...] [--layout L]
      Each layer on the GPU against the reference.
  convkit check [--layers FILE] [--only NAME,...] [--threads N] [--layout nchw|nhwc]
                [--dtype f32|f16|bf16|u8|i8]
      Every layer with every algorithm at every ISA level of this CPU (with --dtype u8|i8:
      every int8 kernel), against the reference.
  convkit run --layer N,C_IN,H,W,C_OUT,KH,KW,SH,SW,PH,PW,DH,DW,GROUPS
              --input X.npy --weight W.npy [--bias B.npy] --output Y.npy
              [--threads N] [--isa LEVEL] [--precision P]
      One NCHW float32 convolution: input [n,c_in,h,w], weights [c_out,c_in/groups,kh,kw],
      bias [c_out] (height axes may be left out when h == 1 / kh == 1); writes
      [n,c_out,out_h,out_w].
  convkit run --dtype u8|i8 --layer ... --input X.npy --weight W.npy [--bias B.npy]
              (--weight-scales S.npy | --weight-scale F) --x-scale F --x-zero-point Z
              --y-scale F --y-zero-point Z --output Y.npy [--threads N] [--isa LEVEL]
      One quantized convolution (ONNX QLinearConv): input uint8/int8 (as --dtype), weights
      int8, bias int32 [c_out], weight scales float32 [c_out] or [1]; writes --dtype.
  convkit run --pass backward-data --layer ... --grad-output DY.npy --weight W.npy --output DX.npy
  convkit run --pass backward-weights --layer ... --input X.npy --grad-output DY.npy
              --output DW.npy [--grad-bias DB.npy]
      The gradients of the --layer convolution (no activation), as PyTorch's autograd gives
      them: DY [n,c_out,out_h,out_w], DX like the input, DW like the weights, DB [c_out].
  convkit run --pass transposed --layer N,C_IN,H,W,C_OUT,KH,KW,SH,SW,PH,PW,DH,DW,GROUPS
              [--output-padding P | PH,PW] --input X.npy --weight W.npy [--bias B.npy]
              --output Y.npy
      A transposed convolution (PyTorch's ConvTranspose2d/1d): --layer describes it, input
      [n,c_in,h,w], weights [c_in,c_out/groups,kh,kw], bias [c_out].
  convkit help

Options:
  --layers FILE     suite CSV (header name,n,c_in,h,w,c_out,kh,kw,stride_h,stride_w,pad_h,pad_w,
                    dil_h,dil_w,groups; '#' comments); default: the built-in bench/layers.csv
  --only A,B        only these layers of the suite
  --threads N       worker threads (default 1; 0 = one per core)
  --isa LEVEL       scalar, avx2, avx512 or neon (default: the best, or CONVKIT_ISA)
  --layout L        run the suite's layers on nchw (default) or nhwc tensors
  --algorithm NAME  force an algorithm (see `convkit info`)
  --kernel NAME     force a generated kernel, at its ISA (see `convkit info`)
  --precision P     exact (never Winograd), accurate (F(2,3), F(4,3) only) or balanced
                    (default: F(5,3) and F(6,3) too)
  --dtype D         f32 (default); f16 or bf16 (tensors stored in 16 bits, arithmetic in
                    f32, GFLOP/s); or quantized: u8 (u8 in/out, zero point 128) or i8
  --peak GFLOPS     per-core peak for the %peak column (default: measured at start-up)
  --csv             CSV instead of a table on stdout

Exit status: 0 ok, 1 failure (bad input or a failed check), 2 bad arguments.";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    let Some((command, rest)) = args.split_first() else {
        println!("{USAGE}");
        return ExitCode::from(2);
    };
    let (on_gpu, rest) = match device(rest) {
        Ok(split) => split,
        Err(e) => return report(Err(e)),
    };
    let result = match command.as_str() {
        "bench" | "check" if on_gpu => gpu_command(command, &rest),
        _ if on_gpu => Err(CliError::Usage(
            "--device gpu applies to bench and check".into(),
        )),
        "info" => info(&rest),
        "bench" => bench::main(&rest),
        "check" => check::main(&rest),
        "run" => run::main(&rest),
        "help" => {
            println!("{USAGE}");
            Ok(true)
        }
        other => Err(CliError::Usage(format!("unknown command {other:?}"))),
    };
    report(result)
}

fn report(result: CliResult<bool>) -> ExitCode {
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(CliError::Usage(msg)) => {
            eprintln!("error: {msg}\n\n{USAGE}");
            ExitCode::from(2)
        }
        Err(CliError::Failed(msg)) => {
            eprintln!("error: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// Takes `--device cpu|gpu` out of the arguments: true for gpu.
fn device(args: &[String]) -> CliResult<(bool, Vec<String>)> {
    let mut rest = Vec::with_capacity(args.len());
    let mut device = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let value = if arg == "--device" {
            it.next()
                .cloned()
                .ok_or_else(|| CliError::Usage("--device needs a value".into()))?
        } else if let Some(v) = arg.strip_prefix("--device=") {
            v.to_string()
        } else {
            rest.push(arg.clone());
            continue;
        };
        if device.replace(value).is_some() {
            return Err(CliError::Usage("--device given twice".into()));
        }
    }
    match device.as_deref() {
        None | Some("cpu") => Ok((false, rest)),
        Some("gpu") => Ok((true, rest)),
        Some(other) => Err(CliError::Usage(format!(
            "--device {other:?}: expected cpu or gpu"
        ))),
    }
}

#[cfg(feature = "gpu")]
fn gpu_command(command: &str, args: &[String]) -> CliResult<bool> {
    if command == "bench" {
        gpu::bench(args)
    } else {
        gpu::check(args)
    }
}

#[cfg(not(feature = "gpu"))]
fn gpu_command(_: &str, _: &[String]) -> CliResult<bool> {
    Err(CliError::Failed(
        "this convkit was built without the GPU path: cargo run --release --features gpu -- ..."
            .into(),
    ))
}

/// Builds the global rayon pool: `None` means 1 thread, `Some(0)` one per core. Returns the
/// `Options::threads` to pass and the number of workers that will run.
fn setup_threads(requested: Option<usize>) -> CliResult<(usize, usize)> {
    let threads = requested.unwrap_or(1);
    let mut builder = rayon::ThreadPoolBuilder::new();
    if threads > 0 {
        builder = builder.num_threads(threads);
    }
    builder
        .build_global()
        .map_err(|e| CliError::Failed(format!("cannot start {threads} thread(s): {e}")))?;
    Ok((threads, rayon::current_num_threads()))
}

/// `--isa` if given and available, else the default level (which honours CONVKIT_ISA).
fn resolve_isa(requested: Option<Isa>) -> CliResult<Isa> {
    Ok(match requested {
        Some(isa) => Isa::check(isa)?,
        None => Isa::default_level()?,
    })
}

fn info(args: &[String]) -> CliResult<bool> {
    Flags::parse(args, &[], &[])?;
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let available: Vec<&str> = Isa::available().iter().map(|i| i.name()).collect();
    let default = match Isa::default_level() {
        Ok(isa) => isa.name().to_string(),
        Err(e) => format!("none: {e}"),
    };
    println!("cpu:          {model}");
    println!("isa levels:   {}", available.join(", "));
    println!("default isa:  {default}");
    let yes = |b: bool| if b { "yes" } else { "no" };
    println!(
        "int8:         AVX-512 VNNI {} (the avx512vnni GEMM kernel), VBMI {} (the qdw depthwise kernels)",
        yes(convkit::cpu::has_vnni()),
        yes(convkit::cpu::has_vnni_vbmi())
    );
    println!(
        "l2 cache:     {} KiB a core (sizes Winograd's blocks)",
        convkit::cpu::l2_bytes() >> 10
    );
    println!("threads:      {} (rayon)", rayon::current_num_threads());
    println!(
        "algorithms:   {}",
        Algorithm::ALL.map(|a| a.name()).join(", ")
    );
    #[cfg(feature = "gpu")]
    gpu::print_adapters();
    #[cfg(not(feature = "gpu"))]
    println!("gpu:          not built (feature `gpu`)");
    println!("kernels:");
    for isa in Isa::ALL {
        let names = convkit::cpu::kernel_names(isa);
        let note = if Isa::available().contains(&isa) {
            ""
        } else {
            " (not on this CPU)"
        };
        if !names.is_empty() {
            println!("  {:<7} {}{note}", isa.name(), names.join(", "));
        }
    }
    Ok(true)
}
