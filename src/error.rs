//! Typed errors: every bad input says what is wrong and with which values.

/// Everything that can go wrong in convkit. Nothing panics on bad input; it returns one of these.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A size or step that must be at least 1 was 0.
    #[error("{what} must be at least 1, got 0")]
    Zero {
        /// Which size or step.
        what: &'static str,
    },
    /// Channels are not a multiple of the group count.
    #[error("{what} ({channels}) is not divisible by groups ({groups})")]
    NotDivisibleByGroups {
        /// Which channel count.
        what: &'static str,
        /// The channel count.
        channels: usize,
        /// The group count.
        groups: usize,
    },
    /// The dilated kernel does not fit in the padded input.
    #[error(
        "kernel {axis} {kernel} with dilation {dilation} spans {span}, larger than the padded input \
         {padded} (input {input} + padding {pad_begin}+{pad_end})"
    )]
    KernelTooLarge {
        /// `"height"` or `"width"`.
        axis: &'static str,
        /// The kernel size along the axis.
        kernel: usize,
        /// The dilation along the axis.
        dilation: usize,
        /// The dilated kernel's extent, `(kernel - 1) · dilation + 1`.
        span: usize,
        /// The padded input's size.
        padded: usize,
        /// The input's size.
        input: usize,
        /// Padding before the input.
        pad_begin: usize,
        /// Padding after the input.
        pad_end: usize,
    },
    /// A product of sizes does not fit in memory addresses.
    #[error("size overflow: {what} does not fit in usize/isize")]
    Overflow {
        /// Which product.
        what: &'static str,
    },
    /// A slice has the wrong number of elements.
    #[error("{what} has {got} elements, expected {expected}")]
    WrongLength {
        /// Which tensor.
        what: &'static str,
        /// The length it must have.
        expected: usize,
        /// The length it has.
        got: usize,
    },
    /// A parameter value that is out of its domain (NaN bounds, min > max, …).
    #[error("invalid {what}: {detail}")]
    InvalidParameter {
        /// Which parameter.
        what: &'static str,
        /// What is wrong with it, with the values.
        detail: String,
    },
    /// An allocation failed (or would exceed the address space).
    #[error("out of memory: cannot allocate {bytes} bytes for {what}")]
    OutOfMemory {
        /// What the memory was for.
        what: &'static str,
        /// How many bytes were asked for.
        bytes: usize,
    },
    /// The requested ISA is not available on this CPU.
    #[error("ISA {requested} is not available on this CPU (available: {available})")]
    IsaUnavailable {
        /// The ISA asked for.
        requested: String,
        /// The ISA levels this CPU and build have.
        available: String,
    },
    /// The forced algorithm does not accept this convolution.
    #[error("algorithm {algorithm} cannot run this convolution: {reason}")]
    AlgorithmUnsupported {
        /// The forced algorithm.
        algorithm: &'static str,
        /// Why it does not take the convolution.
        reason: String,
    },
    /// No GPU adapter matches the request (or none exists at all).
    #[error("no GPU adapter: {detail}")]
    NoGpu {
        /// What was looked for, and what was found.
        detail: String,
    },
    /// The GPU device refused or failed an operation (limits, device loss, mapping).
    #[error("GPU error: {detail}")]
    Gpu {
        /// What the device said.
        detail: String,
    },
}

/// `Ok` when every `(what, expected, got)` matches; a `got` of `None` (an absent optional
/// tensor) is not checked. Else `WrongLength` for the first that does not.
pub(crate) fn check_lengths(checks: &[(&'static str, usize, Option<usize>)]) -> Result<()> {
    for &(what, expected, got) in checks {
        if let Some(got) = got.filter(|&g| g != expected) {
            return Err(Error::WrongLength {
                what,
                expected,
                got,
            });
        }
    }
    Ok(())
}

/// `Result` with convkit's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
