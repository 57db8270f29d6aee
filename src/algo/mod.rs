//! One file per algorithm. Each packs its weights at create time, plans a fixed input size,
//! and runs without allocating.

pub(crate) mod backward_gemm;
pub mod depthwise;
pub(crate) mod depthwise_backward;
pub mod direct;
pub(crate) mod im2col_gemm;
#[cfg(feature = "int8")]
pub mod qdepthwise;
#[cfg(feature = "int8")]
pub(crate) mod qexact_f32;
#[cfg(feature = "int8")]
pub mod qgemm;
#[cfg(feature = "int8")]
mod transpose_u8;
pub mod winograd;
pub(crate) mod winograd_backward;

/// The algorithms convkit can run a convolution with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// im2col (a block at a time, packed straight into GEMM panels) + the blocked GEMM. Takes
    /// every shape.
    Im2colGemm,
    /// Depthwise (groups == input channels): the generated kernel of the convolution's
    /// kernel size and stride, or the generic depthwise kernel where none is generated.
    Depthwise,
    /// Depthwise with the generic kernel (any kernel, stride, dilation), even where an
    /// unrolled one exists: for tests and benchmarks.
    DepthwiseGeneric,
    /// Direct NCHW convolution straight from the input planes (dense or grouped), for the
    /// kernel sizes and strides the generator made a kernel for.
    Direct,
    /// Winograd F(m, 3) for 3x3 and 1x3 stride-1 convolutions: transforms generated per tile
    /// size, products as batched GEMMs. Faster than any sum of products, less exact: see
    /// [`Precision`](crate::Precision) and the README's error table.
    Winograd,
}

impl Algorithm {
    /// Every algorithm, in the order `convkit check` tries them.
    pub const ALL: [Algorithm; 5] = [
        Algorithm::Im2colGemm,
        Algorithm::Depthwise,
        Algorithm::DepthwiseGeneric,
        Algorithm::Direct,
        Algorithm::Winograd,
    ];

    /// The name `Options::algorithm`, `--algorithm` and `Plan::kernel_name` use.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Im2colGemm => "im2col_gemm",
            Algorithm::Depthwise => "depthwise",
            Algorithm::DepthwiseGeneric => "depthwise_generic",
            Algorithm::Direct => "direct",
            Algorithm::Winograd => "winograd",
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s.trim())
            .ok_or_else(|| crate::Error::InvalidParameter {
                what: "algorithm name",
                detail: format!("{s:?} is not one of {:?}", Algorithm::ALL.map(|a| a.name())),
            })
    }
}

/// The output pointer, shared by the workers that write disjoint parts of it.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
// SAFETY: every user has its workers write disjoint parts only, so sharing the pointer is
// sound.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so that closures capture the whole `SendPtr`, not the field).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// `f(i, dst_i, src_i)` for the `i`-th chunks of `dst` and `src` (`dc` and `sc` elements):
/// on the caller's thread for one worker, else spread over the current rayon pool.
#[cfg(feature = "int8")]
pub(crate) fn zip_chunks<A: Send, B: Sync>(
    workers: usize,
    dst: &mut [A],
    dc: usize,
    src: &[B],
    sc: usize,
    f: impl Fn(usize, &mut [A], &[B]) + Sync,
) {
    #[cfg(feature = "threads")]
    if workers > 1 {
        use rayon::prelude::*;
        let n = dst.len().div_ceil(dc);
        // A few chunks a worker, for balance.
        let per = n.div_ceil(4 * workers).max(1);
        return dst
            .par_chunks_mut(dc)
            .zip(src.par_chunks(sc))
            .enumerate()
            .with_min_len(per)
            .for_each(|(i, (d, s))| f(i, d, s));
    }
    let _ = workers;
    for (i, (d, s)) in dst.chunks_mut(dc).zip(src.chunks(sc)).enumerate() {
        f(i, d, s);
    }
}

/// Copies `src` into `dst` (same length). For short runs (a micro-panel row, a small image's
/// row), where a `memcpy` call costs more than the copy: fixed-size copies become straight
/// vector moves, and a length between two sizes is two overlapping fixed copies.
#[inline(always)]
pub(crate) fn copy_run(dst: &mut [f32], src: &[f32]) {
    fn fixed<const N: usize>(dst: &mut [f32], src: &[f32]) {
        let n = dst.len();
        dst[..N].copy_from_slice(&src[..N]);
        dst[n - N..].copy_from_slice(&src[n - N..n]);
    }
    match dst.len() {
        0 => {}
        n @ 1..4 => dst.copy_from_slice(&src[..n]),
        4..8 => fixed::<4>(dst, src),
        8..16 => fixed::<8>(dst, src),
        16..32 => fixed::<16>(dst, src),
        32..=64 => fixed::<32>(dst, src),
        _ => dst.copy_from_slice(src),
    }
}

/// Zeroes a short run, without a `memset` call (see [`copy_run`]).
#[inline(always)]
pub(crate) fn zero_run(dst: &mut [f32]) {
    fn fixed<const N: usize>(dst: &mut [f32]) {
        let n = dst.len();
        dst[..N].copy_from_slice(&[0.0; N]);
        dst[n - N..].copy_from_slice(&[0.0; N]);
    }
    match dst.len() {
        0 => {}
        1..4 => dst.iter_mut().for_each(|d| *d = 0.0),
        4..8 => fixed::<4>(dst),
        8..16 => fixed::<8>(dst),
        16..32 => fixed::<16>(dst),
        32..=64 => fixed::<32>(dst),
        _ => dst.fill(0.0),
    }
}

/// The number of workers `Options::threads == 0` means: the current rayon pool's threads,
/// or 1 in a build without the `threads` feature (no rayon).
pub(crate) fn current_num_threads() -> usize {
    #[cfg(feature = "threads")]
    {
        rayon::current_num_threads()
    }
    #[cfg(not(feature = "threads"))]
    {
        1
    }
}

/// The workers `Options::threads` asks for: `threads`, or [`current_num_threads`] for 0.
pub(crate) fn workers(threads: usize) -> usize {
    match threads {
        0 => current_num_threads(),
        t => t,
    }
}

/// The workers that run at the same time for `Options::threads`: [`workers`], or 1 in a build
/// without the `threads` feature, whose work shares run one after another.
pub(crate) fn parallel_workers(threads: usize) -> usize {
    if cfg!(feature = "threads") {
        workers(threads)
    } else {
        1
    }
}

/// Runs `items` numbered work items on `workers` workers, each a contiguous range of them: on
/// the caller's thread alone for one worker, else on the current rayon pool (or, in a build
/// without the `threads` feature, one worker after another on the caller's thread). Each
/// worker owns an equal share of `scratch` (empty when there is none), which `item` gets with
/// the item's number.
pub(crate) fn for_each_worker(
    workers: usize,
    items: usize,
    scratch: &mut [f32],
    item: impl Fn(&mut [f32], usize) + Sync,
) {
    workers_run(workers, items, scratch, false, item)
}

/// As [`for_each_worker`], but each worker claims the next item not yet taken when it is done
/// with one, instead of a fixed range: for independent items of about the same cost, where a
/// worker slowed down (another process on its core) should not hold up the run. Items a worker
/// runs are then not contiguous, so not for items that share data in cache with their
/// neighbours.
pub(crate) fn for_each_item_claimed(
    workers: usize,
    items: usize,
    scratch: &mut [f32],
    item: impl Fn(&mut [f32], usize) + Sync,
) {
    workers_run(workers, items, scratch, true, item)
}

fn workers_run(
    workers: usize,
    items: usize,
    scratch: &mut [f32],
    claim: bool,
    item: impl Fn(&mut [f32], usize) + Sync,
) {
    let workers = workers.max(1);
    let range = |w: usize| w * items / workers..(w + 1) * items / workers;
    let share = scratch.len() / workers;
    if workers == 1 {
        range(0).for_each(|i| item(scratch, i));
        return;
    }
    #[cfg(feature = "threads")]
    {
        use rayon::prelude::*;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let next = AtomicUsize::new(0);
        let run = |w: usize, s: &mut [f32]| {
            if claim {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= items {
                        break;
                    }
                    item(s, i);
                }
            } else {
                range(w).for_each(|i| item(s, i))
            }
        };
        if share == 0 {
            (0..workers)
                .into_par_iter()
                .with_max_len(1)
                .for_each(|w| run(w, &mut []));
        } else {
            scratch[..share * workers]
                .par_chunks_mut(share)
                .with_max_len(1)
                .enumerate()
                .for_each(|(w, s)| run(w, s));
        }
    }
    #[cfg(not(feature = "threads"))]
    {
        let _ = claim; // one thread: the order does not matter
        if share == 0 {
            (0..workers).for_each(|w| range(w).for_each(|i| item(&mut [], i)));
        } else {
            scratch[..share * workers]
                .chunks_mut(share)
                .enumerate()
                .for_each(|(w, s)| range(w).for_each(|i| item(s, i)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The choice of algorithm counts only workers that run together: none beyond the caller
    /// in a build without rayon, however many shares a plan makes.
    #[test]
    fn parallel_workers_are_the_threads_that_run_together() {
        assert_eq!(workers(3), 3);
        assert_eq!(workers(0), current_num_threads());
        let expected = if cfg!(feature = "threads") { 3 } else { 1 };
        assert_eq!(parallel_workers(3), expected);
    }
}
