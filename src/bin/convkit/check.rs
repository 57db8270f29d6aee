//! `convkit check`: every layer x every algorithm x every ISA level of this CPU, against the
//! reference.

use crate::args::{CliResult, Flags};
use crate::bench::Dtype;
use crate::layers::{self, Prepared};
use crate::setup_threads;
use convkit::{Algorithm, Conv2d, Error, Isa, Options, Workspace};

pub fn main(args: &[String]) -> CliResult<bool> {
    let flags = Flags::parse(args, &["layers", "threads", "only", "layout", "dtype"], &[])?;
    let layers = layers::from_flags(&flags)?;

    let (threads, _) = setup_threads(flags.parsed("threads")?)?;
    let dtype: Dtype = flags.parsed("dtype")?.unwrap_or(Dtype::F32);
    if matches!(dtype, Dtype::F16 | Dtype::Bf16) {
        return Ok(crate::halfcli::check(&layers, threads, dtype));
    }
    if dtype != Dtype::F32 {
        return Ok(crate::qcli::check(&layers, threads, dtype));
    }
    let width = layers.iter().map(|l| l.name.len()).max().unwrap_or(0);
    let (mut passed, mut failed, mut skipped) = (0usize, 0usize, 0usize);

    for (i, layer) in layers.iter().enumerate() {
        eprintln!("[{}/{}] {} ...", i + 1, layers.len(), layer.name);
        let p = match Prepared::new(layer) {
            Ok(p) => p,
            Err(e) => {
                println!("{:<width$}  FAIL  {e}", layer.name);
                failed += 1;
                continue;
            }
        };
        // The reference is the slow part: once per layer, shared by every algorithm and ISA.
        let reference = match p.reference() {
            Ok(r) => r,
            Err(e) => {
                println!("{:<width$}  FAIL  reference: {e}", layer.name);
                failed += 1;
                continue;
            }
        };
        let mut ws = Workspace::new();
        for algorithm in Algorithm::ALL {
            for &isa in Isa::available() {
                let options = Options {
                    algorithm: Some(algorithm),
                    isa: Some(isa),
                    threads,
                    kernel: None,
                    precision: Default::default(),
                    input_hint: Some([p.geometry.h, p.geometry.w]),
                };
                let label = format!(
                    "{:<width$}  {:<12} {:<7}",
                    layer.name,
                    algorithm.name(),
                    isa.name()
                );
                let result =
                    Conv2d::new(p.params, &p.weights, Some(&p.bias), options).and_then(|conv| {
                        let g = &p.geometry;
                        let plan = conv.plan(g.batch, g.h, g.w)?;
                        let mut output = layers::zeros(plan.output_len(), "output")?;
                        plan.run(&p.input, &mut output, &mut ws)?;
                        Ok((
                            plan.kernel_name(),
                            reference.compare_scaled(&output, plan.error_factor()),
                        ))
                    });
                match result {
                    Err(Error::AlgorithmUnsupported { reason, .. }) => {
                        println!("{label}  SKIP  {reason}");
                        skipped += 1;
                    }
                    Err(e) => {
                        println!("{label}  FAIL  {e}");
                        failed += 1;
                    }
                    Ok((kernel, cmp)) => {
                        if cmp.passed() {
                            println!("{label}  PASS  max_abs_err {:.2e}  {kernel}", cmp.max_abs);
                            passed += 1;
                        } else {
                            println!(
                                "{label}  FAIL  max_abs_err {:.2e}  {kernel}  (worst error {:.1}x its tolerance, {} non-finite)",
                                cmp.max_abs, cmp.worst_ratio, cmp.non_finite
                            );
                            failed += 1;
                        }
                    }
                }
            }
        }
    }
    println!("{passed} passed, {failed} failed, {skipped} skipped");
    Ok(failed == 0)
}
