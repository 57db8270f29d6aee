//! `convkit bench --dtype f16|bf16` (and `check`): the suite with inputs, weights, bias and
//! outputs stored in 16 bits, arithmetic in f32, checked against the reference on the rounded
//! data.

use crate::bench::{time_median, Dtype, Measured};
use crate::layers::{Layer, Prepared};
use convkit::{bf16, f16, Algorithm, Conv2d, Error, Isa, Options, Storage, Workspace};

/// The layer's tensors rounded to `T`, and the reference on the rounded data.
struct Rounded<T> {
    input: Vec<T>,
    weights: Vec<T>,
    bias: Vec<T>,
}

fn round<T: Storage>(xs: &[f32]) -> Vec<T> {
    xs.iter().map(|&x| T::from_f32(x)).collect()
}

fn widen<T: Storage>(xs: &[T]) -> Vec<f32> {
    xs.iter().map(|x| x.to_f32()).collect()
}

impl<T: Storage> Rounded<T> {
    fn new(p: &Prepared) -> Self {
        Rounded {
            input: round(&p.input),
            weights: round(&p.weights),
            bias: round(&p.bias),
        }
    }

    /// The reference on the rounded data, the same tensors the 16-bit run sees.
    fn reference(&self, p: &Prepared) -> convkit::Result<convkit::reference::Reference> {
        let g = &p.geometry;
        convkit::reference::conv(
            &p.params,
            g.batch,
            g.h,
            g.w,
            &widen(&self.input),
            &widen(&self.weights),
            Some(&widen(&self.bias)),
            None,
        )
    }
}

/// (max |error|, passed): within the f32 tolerance (times the plan's factor) plus one
/// rounding of each output to `T`.
fn compare<T: Storage>(
    reference: &convkit::reference::Reference,
    out: &[T],
    factor: f64,
) -> (f64, bool) {
    let u = T::TYPE.unit_roundoff();
    let mut worst = 0.0f64;
    let mut passed = true;
    for (i, (y, &r)) in out.iter().zip(&reference.values).enumerate() {
        let err = (y.to_f32() as f64 - r).abs();
        worst = worst.max(err);
        // The suite's data is O(1): f16's subnormals do not arise, 2^-25 covers them anyway.
        let bound = factor * reference.tolerance(i) * (1.0 + u) + u * r.abs() + 3e-8;
        passed &= err <= bound;
    }
    (worst, passed)
}

/// Create, plan, check once against the reference, then time, with `dtype` storage.
pub fn bench_layer(
    layer: &Layer,
    options: Options,
    reps: usize,
    dtype: Dtype,
) -> convkit::Result<Measured> {
    match dtype {
        Dtype::F16 => bench_typed::<f16>(layer, options, reps),
        _ => bench_typed::<bf16>(layer, options, reps),
    }
}

fn bench_typed<T: Storage>(
    layer: &Layer,
    options: Options,
    reps: usize,
) -> convkit::Result<Measured> {
    let p = Prepared::new(layer)?;
    let r = Rounded::<T>::new(&p);
    let options = Options {
        input_hint: Some([p.geometry.h, p.geometry.w]),
        ..options
    };
    let conv = Conv2d::from_storage(p.params, &r.weights, Some(&r.bias), options)?;
    let g = &p.geometry;
    let plan = conv.plan(g.batch, g.h, g.w)?;
    let mut output = vec![T::from_f32(0.0); plan.output_len()];
    let bytes = plan.storage_workspace_bytes::<T, T>();
    let mut ws = Workspace::with_bytes(bytes)?;
    plan.run_storage(&r.input, &mut output, &mut ws)?;
    let (max_abs, passed) = compare(&r.reference(&p)?, &output, plan.error_factor());
    let median_s = time_median(reps, || plan.run_storage(&r.input, &mut output, &mut ws))?;
    Ok(Measured {
        kernel: plan.storage_kernel_name::<T, T>(),
        median_s,
        gflops: plan.flops() / median_s / 1e9,
        workspace: bytes,
        max_abs,
        passed,
    })
}

/// `convkit check --dtype f16|bf16`: every layer x algorithm x ISA level, 16-bit in and out.
pub fn check(layers: &[Layer], threads: usize, dtype: Dtype) -> bool {
    match dtype {
        Dtype::F16 => check_typed::<f16>(layers, threads),
        _ => check_typed::<bf16>(layers, threads),
    }
}

fn check_typed<T: Storage>(layers: &[Layer], threads: usize) -> bool {
    let width = layers.iter().map(|l| l.name.len()).max().unwrap_or(0);
    let (mut passed, mut failed, mut skipped) = (0usize, 0usize, 0usize);
    for (i, layer) in layers.iter().enumerate() {
        eprintln!("[{}/{}] {} ...", i + 1, layers.len(), layer.name);
        let prepared = Prepared::new(layer).and_then(|p| {
            let r = Rounded::<T>::new(&p);
            let reference = r.reference(&p)?;
            Ok((p, r, reference))
        });
        let (p, r, reference) = match prepared {
            Ok(x) => x,
            Err(e) => {
                println!("{:<width$}  FAIL  {e}", layer.name);
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
                    input_hint: Some([p.geometry.h, p.geometry.w]),
                    ..Options::default()
                };
                let label = format!(
                    "{:<width$}  {:<12} {:<7} {}",
                    layer.name,
                    algorithm.name(),
                    isa.name(),
                    T::TYPE.name()
                );
                let result = Conv2d::from_storage(p.params, &r.weights, Some(&r.bias), options)
                    .and_then(|conv| {
                        let g = &p.geometry;
                        let plan = conv.plan(g.batch, g.h, g.w)?;
                        let mut output = vec![T::from_f32(f32::NAN); plan.output_len()];
                        plan.run_storage(&r.input, &mut output, &mut ws)?;
                        Ok((
                            plan.storage_kernel_name::<T, T>(),
                            compare(&reference, &output, plan.error_factor()),
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
                    Ok((kernel, (max_abs, true))) => {
                        println!("{label}  PASS  max_abs_err {max_abs:.2e}  {kernel}");
                        passed += 1;
                    }
                    Ok((kernel, (max_abs, false))) => {
                        println!("{label}  FAIL  max_abs_err {max_abs:.2e}  {kernel}");
                        failed += 1;
                    }
                }
            }
        }
    }
    println!("{passed} passed, {failed} failed, {skipped} skipped");
    failed == 0
}
