//! The C ABI (feature `capi`): opaque handles for convolutions, plans and workspaces, the
//! same create → plan → run phases as the Rust API, and status codes. The header is
//! `include/convkit.h`, kept by hand beside this file; `tests/capi.rs` proves the two agree
//! (every function here is declared there, every struct's size and field offsets and every
//! constant match, checked by `_Static_assert`s the C test compiles) and runs
//! `tests/c/capi_test.c` against a convolution written in C from the definition.
//!
//! Rules every entry point keeps:
//! - it returns a [`convkit_status`] (queries that cannot fail return their value);
//! - it checks every pointer: NULL where a value is needed is `CONVKIT_ERROR_NULL_POINTER`, a
//!   misaligned or overlapping tensor `CONVKIT_ERROR_INVALID_PARAMETER`; a NULL pointer with
//!   length 0 is an empty tensor;
//! - no panic crosses the boundary: the body runs inside `catch_unwind`, and a panic (a bug)
//!   is `CONVKIT_ERROR_PANIC` with its message (a build with `panic = "abort"` aborts
//!   instead);
//! - on failure, [`convkit_last_error_message`] says what went wrong, with the values, for the
//!   calling thread; it is kept until that thread's next failing call.
//!
//! Thread safety: convolutions and plans are immutable and may be used from any number of
//! threads at once; a workspace is used by one run at a time.
//!
//! ```
//! use convkit::capi::*;
//! use std::ptr;
//!
//! // The C API from Rust: a 3x3 convolution, 2 -> 4 channels, on a 5x5 image.
//! let mut params = convkit_conv_params::default();
//! let mut conv = ptr::null_mut();
//! let mut plan = ptr::null_mut();
//! let weights = vec![0.5f32; 4 * 2 * 3 * 3];
//! let input = vec![1.0f32; 2 * 5 * 5];
//! let mut output = vec![0.0f32; 4 * 3 * 3];
//! // SAFETY: every pointer is valid for the lengths given, and the handles are destroyed once.
//! unsafe {
//!     assert_eq!(convkit_conv_params_init(&mut params, 2, 4, 3, 3), CONVKIT_OK);
//!     let status = convkit_conv_create(
//!         &params, weights.as_ptr(), weights.len(), ptr::null(), 0, ptr::null(), &mut conv,
//!     );
//!     assert_eq!(status, CONVKIT_OK);
//!     assert_eq!(convkit_conv_plan(conv, 1, 5, 5, &mut plan), CONVKIT_OK);
//!     let status = convkit_plan_run(
//!         plan, input.as_ptr(), input.len(), output.as_mut_ptr(), output.len(), ptr::null_mut(),
//!     );
//!     assert_eq!(status, CONVKIT_OK);
//!     convkit_plan_destroy(plan);
//!     convkit_conv_destroy(conv);
//! }
//! assert!(output.iter().all(|&y| (y - 9.0).abs() < 1e-5));
//! ```

// The C names are the ABI's: lower-case types, as C spells them.
#![allow(non_camel_case_types)]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

use crate::{Activation, Algorithm, Conv1d, Conv2d, ConvParams, Error, Isa, Layout, Options};
use crate::{Padding, Plan, Precision, Workspace};
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A status code: [`CONVKIT_OK`] or one of the `CONVKIT_ERROR_*` codes, which mirror
/// [`Error`]'s variants, plus the C side's own (NULL pointer, feature not built, panic).
pub type convkit_status = i32;

/// Success.
pub const CONVKIT_OK: convkit_status = 0;
/// [`Error::Zero`]: a size or step that must be at least 1 was 0.
pub const CONVKIT_ERROR_ZERO: convkit_status = 1;
/// [`Error::NotDivisibleByGroups`].
pub const CONVKIT_ERROR_NOT_DIVISIBLE_BY_GROUPS: convkit_status = 2;
/// [`Error::KernelTooLarge`]: the dilated kernel does not fit in the padded input.
pub const CONVKIT_ERROR_KERNEL_TOO_LARGE: convkit_status = 3;
/// [`Error::Overflow`]: a product of sizes does not fit in memory addresses.
pub const CONVKIT_ERROR_OVERFLOW: convkit_status = 4;
/// [`Error::WrongLength`]: a tensor has the wrong number of elements.
pub const CONVKIT_ERROR_WRONG_LENGTH: convkit_status = 5;
/// [`Error::InvalidParameter`] (also: an unknown enum value, a misaligned or overlapping
/// tensor).
pub const CONVKIT_ERROR_INVALID_PARAMETER: convkit_status = 6;
/// [`Error::OutOfMemory`].
pub const CONVKIT_ERROR_OUT_OF_MEMORY: convkit_status = 7;
/// [`Error::IsaUnavailable`]: the CPU lacks the ISA, or this build left it out.
pub const CONVKIT_ERROR_ISA_UNAVAILABLE: convkit_status = 8;
/// [`Error::AlgorithmUnsupported`]: the forced algorithm does not take the convolution.
pub const CONVKIT_ERROR_ALGORITHM_UNSUPPORTED: convkit_status = 9;
/// [`Error::NoGpu`] (not returned by the CPU functions of this ABI).
pub const CONVKIT_ERROR_NO_GPU: convkit_status = 10;
/// [`Error::Gpu`] (not returned by the CPU functions of this ABI).
pub const CONVKIT_ERROR_GPU: convkit_status = 11;
/// A pointer that must not be NULL was NULL.
pub const CONVKIT_ERROR_NULL_POINTER: convkit_status = 12;
/// The function needs a cargo feature this library was built without (`int8`).
pub const CONVKIT_ERROR_NOT_BUILT: convkit_status = 13;
/// convkit panicked (a bug; please report it). The handles passed in are still valid.
pub const CONVKIT_ERROR_PANIC: convkit_status = 14;

/// `convkit_conv_params::padding`: zeros given by `pad_top`, `pad_bottom`, `pad_left`,
/// `pad_right`.
pub const CONVKIT_PADDING_EXPLICIT: i32 = 0;
/// ONNX `SAME_UPPER`: output = ceil(input / stride), an odd total's extra pixel at the end.
pub const CONVKIT_PADDING_SAME: i32 = 1;
/// ONNX `SAME_LOWER`: as `SAME`, the extra pixel at the beginning.
pub const CONVKIT_PADDING_SAME_LOWER: i32 = 2;
/// No padding.
pub const CONVKIT_PADDING_VALID: i32 = 3;

/// `convkit_conv_params::layout`: batch, channels, height, width.
pub const CONVKIT_LAYOUT_NCHW: i32 = 0;
/// Batch, height, width, channels.
pub const CONVKIT_LAYOUT_NHWC: i32 = 1;

/// `convkit_conv_params::activation`: none.
pub const CONVKIT_ACTIVATION_NONE: i32 = 0;
/// max(x, 0).
pub const CONVKIT_ACTIVATION_RELU: i32 = 1;
/// min(max(x, 0), 6).
pub const CONVKIT_ACTIVATION_RELU6: i32 = 2;
/// min(max(x, `activation_min`), `activation_max`).
pub const CONVKIT_ACTIVATION_CLAMP: i32 = 3;
/// x if x > 0 else `activation_alpha`·x.
pub const CONVKIT_ACTIVATION_LEAKY_RELU: i32 = 4;
/// x·sigmoid(x).
pub const CONVKIT_ACTIVATION_SILU: i32 = 5;
/// x·Φ(x) with the exact (erf) Gaussian CDF.
pub const CONVKIT_ACTIVATION_GELU: i32 = 6;
/// x·relu6(x + 3)/6.
pub const CONVKIT_ACTIVATION_HARD_SWISH: i32 = 7;
/// 1/(1 + e^-x).
pub const CONVKIT_ACTIVATION_SIGMOID: i32 = 8;

/// `convkit_options::isa`: the best level (or `CONVKIT_ISA` from the environment).
pub const CONVKIT_ISA_AUTO: i32 = 0;
/// Plain code, no explicit SIMD.
pub const CONVKIT_ISA_SCALAR: i32 = 1;
/// x86-64 AVX2 + FMA.
pub const CONVKIT_ISA_AVX2: i32 = 2;
/// x86-64 AVX-512.
pub const CONVKIT_ISA_AVX512: i32 = 3;
/// aarch64 NEON.
pub const CONVKIT_ISA_NEON: i32 = 4;

/// `convkit_options::precision`: Winograd with every tile where fastest (within 1e-4).
pub const CONVKIT_PRECISION_BALANCED: i32 = 0;
/// Winograd F(2,3) and F(4,3) only (within 4e-5).
pub const CONVKIT_PRECISION_ACCURATE: i32 = 1;
/// Never Winograd: every output a plain sum of products.
pub const CONVKIT_PRECISION_EXACT: i32 = 2;

/// `convkit_options::algorithm`: convkit chooses.
pub const CONVKIT_ALGORITHM_AUTO: i32 = 0;
/// im2col + GEMM (takes every shape).
pub const CONVKIT_ALGORITHM_IM2COL_GEMM: i32 = 1;
/// The depthwise kernels.
pub const CONVKIT_ALGORITHM_DEPTHWISE: i32 = 2;
/// The generic depthwise kernel.
pub const CONVKIT_ALGORITHM_DEPTHWISE_GENERIC: i32 = 3;
/// Direct NCHW kernels.
pub const CONVKIT_ALGORITHM_DIRECT: i32 = 4;
/// Winograd F(m, 3).
pub const CONVKIT_ALGORITHM_WINOGRAD: i32 = 5;

/// `convkit_quant_params::input_type` and `output_type`: unsigned 8-bit.
pub const CONVKIT_QTYPE_U8: i32 = 0;
/// Signed 8-bit.
pub const CONVKIT_QTYPE_I8: i32 = 1;
/// `output_type` only: the i32 sums plus bias.
pub const CONVKIT_QTYPE_I32: i32 = 2;
/// `output_type` only: dequantised f32, then the activation (and a residual).
pub const CONVKIT_QTYPE_F32: i32 = 3;

/// The ABI's version: changes whenever a function, struct or constant changes incompatibly.
pub const CONVKIT_ABI_VERSION: u32 = 1;

/// The parameters of a convolution, as [`ConvParams`]: PyTorch/ONNX semantics
/// (cross-correlation, OIHW weights with I = in_channels / groups). Fill it with
/// [`convkit_conv_params_init`], then change what differs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct convkit_conv_params {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// 1 = dense; `in_channels` = depthwise.
    pub groups: usize,
    /// Kernel height (1 for a 1-D convolution).
    pub kernel_h: usize,
    /// Kernel width.
    pub kernel_w: usize,
    /// Vertical stride.
    pub stride_h: usize,
    /// Horizontal stride.
    pub stride_w: usize,
    /// Vertical dilation.
    pub dilation_h: usize,
    /// Horizontal dilation.
    pub dilation_w: usize,
    /// Zeros above the input (`CONVKIT_PADDING_EXPLICIT` only).
    pub pad_top: usize,
    /// Zeros below the input.
    pub pad_bottom: usize,
    /// Zeros left of the input.
    pub pad_left: usize,
    /// Zeros right of the input.
    pub pad_right: usize,
    /// A `CONVKIT_PADDING_*` value.
    pub padding: i32,
    /// A `CONVKIT_LAYOUT_*` value (weights are always OIHW).
    pub layout: i32,
    /// A `CONVKIT_ACTIVATION_*` value, applied after bias and residual.
    pub activation: i32,
    /// `CONVKIT_ACTIVATION_CLAMP`'s lower bound.
    pub activation_min: f32,
    /// `CONVKIT_ACTIVATION_CLAMP`'s upper bound.
    pub activation_max: f32,
    /// `CONVKIT_ACTIVATION_LEAKY_RELU`'s slope below 0.
    pub activation_alpha: f32,
}

/// How a convolution runs, as [`Options`]. All zeros (or a NULL pointer) is the default.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct convkit_options {
    /// 0: every thread of the pool (1 in a build without the `threads` feature); 1: the
    /// caller's thread only; n: at most n workers.
    pub threads: usize,
    /// A `CONVKIT_ISA_*` value: run at this level, never above what the CPU has.
    pub isa: i32,
    /// A `CONVKIT_PRECISION_*` value.
    pub precision: i32,
    /// A `CONVKIT_ALGORITHM_*` value: force one algorithm.
    pub algorithm: i32,
}

/// The quantization of an int8 convolution, as `convkit::QuantParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct convkit_quant_params {
    /// `CONVKIT_QTYPE_U8` or `CONVKIT_QTYPE_I8`.
    pub input_type: i32,
    /// The input's zero point, in its type's range.
    pub input_zero_point: i32,
    /// The input's scale (finite, > 0).
    pub input_scale: f32,
    /// One weight scale (per tensor) or `out_channels` (per output channel); weights are
    /// symmetric.
    pub weight_scales: *const f32,
    /// 1 or `out_channels`.
    pub weight_scales_len: usize,
    /// A `CONVKIT_QTYPE_*` value.
    pub output_type: i32,
    /// The output's zero point (u8 and i8 outputs).
    pub output_zero_point: i32,
    /// The output's scale (u8 and i8 outputs).
    pub output_scale: f32,
}

/// What a plan fixed: the output shape, tensor lengths in elements, workspace size, padding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct convkit_plan_info {
    /// The output shape in the layout's order (NCHW or NHWC).
    pub output_shape: [usize; 4],
    /// Elements of the input tensor.
    pub input_len: usize,
    /// Elements of the output (and residual) tensor.
    pub output_len: usize,
    /// Bytes of workspace a run needs.
    pub workspace_bytes: usize,
    /// The padding resolved for this input size: top, bottom, left, right.
    pub pads: [usize; 4],
    /// Direct-convolution operations (2 per multiply-add).
    pub flops: f64,
}

/// A created f32 convolution (an opaque handle in C).
pub struct convkit_conv {
    conv: Conv2d,
}

/// An f32 convolution planned for one input size (an opaque handle in C).
pub struct convkit_plan {
    plan: Plan,
    kernel: CString,
}

/// Scratch memory shared by runs (an opaque handle in C).
pub struct convkit_workspace {
    ws: Workspace,
}

/// A created int8 convolution (an opaque handle in C).
pub struct convkit_qconv {
    #[cfg(feature = "int8")]
    conv: crate::QConv2d,
}

/// An int8 convolution planned for one input size (an opaque handle in C).
pub struct convkit_qplan {
    #[cfg(feature = "int8")]
    plan: crate::QPlan,
    #[cfg(feature = "int8")]
    kernel: CString,
    #[cfg(feature = "int8")]
    quant: crate::QuantParams,
}

/// A failure on its way to C: the status and the message.
struct Failure {
    status: convkit_status,
    message: String,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure {
            status: status_of(&e),
            message: e.to_string(),
        }
    }
}

fn null(what: &str) -> Failure {
    Failure {
        status: CONVKIT_ERROR_NULL_POINTER,
        message: format!("{what} is NULL"),
    }
}

fn invalid(what: &'static str, detail: String) -> Failure {
    Error::InvalidParameter { what, detail }.into()
}

/// The status of each [`Error`] variant (an exhaustive match: a new variant must get one).
fn status_of(e: &Error) -> convkit_status {
    match e {
        Error::Zero { .. } => CONVKIT_ERROR_ZERO,
        Error::NotDivisibleByGroups { .. } => CONVKIT_ERROR_NOT_DIVISIBLE_BY_GROUPS,
        Error::KernelTooLarge { .. } => CONVKIT_ERROR_KERNEL_TOO_LARGE,
        Error::Overflow { .. } => CONVKIT_ERROR_OVERFLOW,
        Error::WrongLength { .. } => CONVKIT_ERROR_WRONG_LENGTH,
        Error::InvalidParameter { .. } => CONVKIT_ERROR_INVALID_PARAMETER,
        Error::OutOfMemory { .. } => CONVKIT_ERROR_OUT_OF_MEMORY,
        Error::IsaUnavailable { .. } => CONVKIT_ERROR_ISA_UNAVAILABLE,
        Error::AlgorithmUnsupported { .. } => CONVKIT_ERROR_ALGORITHM_UNSUPPORTED,
        Error::NoGpu { .. } => CONVKIT_ERROR_NO_GPU,
        Error::Gpu { .. } => CONVKIT_ERROR_GPU,
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|m| *m.borrow_mut() = message);
}

/// Runs `body` with panics caught: its status, the message of a failure kept for
/// [`convkit_last_error_message`].
fn call(body: impl FnOnce() -> Result<(), Failure>) -> convkit_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => CONVKIT_OK,
        Ok(Err(f)) => {
            set_last_error(&f.message);
            f.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            set_last_error(&format!("convkit panicked (a bug): {what}"));
            CONVKIT_ERROR_PANIC
        }
    }
}

/// Runs a query that cannot fail with panics caught: `fallback` if it panics.
fn query<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(fallback)
}

/// The `T` behind `p`, or a NULL-pointer failure naming `what`.
///
/// # Safety
/// `p` is NULL or points to a live `T` that nothing writes for `'a`.
unsafe fn get<'a, T>(p: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: the caller guarantees `p` is NULL or valid for reads for 'a; `as_ref` maps NULL
    // to None.
    unsafe { p.as_ref() }.ok_or_else(|| null(what))
}

/// A slice of `len` elements at `p`: empty for `len == 0` (even with NULL), a failure for
/// NULL or a pointer misaligned for `T`.
///
/// # Safety
/// Unless NULL, `p` points to `len` initialised `T`s that nothing writes for `'a`.
unsafe fn slice<'a, T>(p: *const T, len: usize, what: &str) -> Result<&'a [T], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(null(what));
    }
    if !p.is_aligned() {
        return Err(invalid(
            "tensor pointer",
            format!(
                "{what} is not aligned to {} bytes",
                std::mem::align_of::<T>()
            ),
        ));
    }
    // SAFETY: non-NULL, aligned, and the caller guarantees `len` readable elements, not
    // written while the slice lives.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// As [`slice`], mutable.
///
/// # Safety
/// Unless NULL, `p` points to `len` writable `T`s that nothing else reads or writes for `'a`
/// (the functions check that the tensors they take do not overlap each other).
unsafe fn slice_mut<'a, T>(p: *mut T, len: usize, what: &str) -> Result<&'a mut [T], Failure> {
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(null(what));
    }
    if !p.is_aligned() {
        return Err(invalid(
            "tensor pointer",
            format!(
                "{what} is not aligned to {} bytes",
                std::mem::align_of::<T>()
            ),
        ));
    }
    // SAFETY: non-NULL, aligned, and the caller guarantees `len` writable elements that
    // nothing else accesses while the slice lives.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// A failure if the output's bytes overlap the input's (Rust's aliasing rules, and the
/// kernels, need them apart).
fn check_apart(
    out: (*const u8, usize),
    out_what: &str,
    inputs: &[(*const u8, usize, &str)],
) -> Result<(), Failure> {
    let (o, on) = (out.0 as usize, out.1);
    for &(p, n, what) in inputs {
        let p = p as usize;
        if on > 0 && n > 0 && p < o.saturating_add(on) && o < p.saturating_add(n) {
            return Err(invalid(
                "tensors",
                format!("{out_what} overlaps {what}: convkit does not run in place"),
            ));
        }
    }
    Ok(())
}

/// Writes `value` to `*out`, or a NULL-pointer failure.
///
/// # Safety
/// `out` is NULL or valid for a write of a `T`.
unsafe fn put<T>(out: *mut T, value: T, what: &str) -> Result<(), Failure> {
    if out.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-NULL, and the caller guarantees it is valid for writes; `write` does not
    // drop the (possibly uninitialised) old value.
    unsafe { out.write(value) };
    Ok(())
}

fn params_of(p: &convkit_conv_params) -> Result<ConvParams, Failure> {
    let padding = match p.padding {
        CONVKIT_PADDING_EXPLICIT => Padding::Explicit {
            top: p.pad_top,
            bottom: p.pad_bottom,
            left: p.pad_left,
            right: p.pad_right,
        },
        CONVKIT_PADDING_SAME => Padding::Same,
        CONVKIT_PADDING_SAME_LOWER => Padding::SameLower,
        CONVKIT_PADDING_VALID => Padding::Valid,
        v => {
            return Err(invalid(
                "padding",
                format!("{v} is not a CONVKIT_PADDING_*"),
            ))
        }
    };
    let layout = match p.layout {
        CONVKIT_LAYOUT_NCHW => Layout::Nchw,
        CONVKIT_LAYOUT_NHWC => Layout::Nhwc,
        v => return Err(invalid("layout", format!("{v} is not a CONVKIT_LAYOUT_*"))),
    };
    let activation = match p.activation {
        CONVKIT_ACTIVATION_NONE => Activation::None,
        CONVKIT_ACTIVATION_RELU => Activation::Relu,
        CONVKIT_ACTIVATION_RELU6 => Activation::Relu6,
        CONVKIT_ACTIVATION_CLAMP => Activation::Clamp {
            min: p.activation_min,
            max: p.activation_max,
        },
        CONVKIT_ACTIVATION_LEAKY_RELU => Activation::LeakyRelu {
            alpha: p.activation_alpha,
        },
        CONVKIT_ACTIVATION_SILU => Activation::Silu,
        CONVKIT_ACTIVATION_GELU => Activation::Gelu,
        CONVKIT_ACTIVATION_HARD_SWISH => Activation::HardSwish,
        CONVKIT_ACTIVATION_SIGMOID => Activation::Sigmoid,
        v => {
            return Err(invalid(
                "activation",
                format!("{v} is not a CONVKIT_ACTIVATION_*"),
            ))
        }
    };
    Ok(ConvParams {
        in_channels: p.in_channels,
        out_channels: p.out_channels,
        groups: p.groups,
        kernel: [p.kernel_h, p.kernel_w],
        stride: [p.stride_h, p.stride_w],
        dilation: [p.dilation_h, p.dilation_w],
        padding,
        layout,
        activation,
    })
}

fn options_of(o: Option<&convkit_options>) -> Result<Options, Failure> {
    let o = o.copied().unwrap_or_default();
    let isa = match o.isa {
        CONVKIT_ISA_AUTO => None,
        CONVKIT_ISA_SCALAR => Some(Isa::Scalar),
        CONVKIT_ISA_AVX2 => Some(Isa::Avx2),
        CONVKIT_ISA_AVX512 => Some(Isa::Avx512),
        CONVKIT_ISA_NEON => Some(Isa::Neon),
        v => return Err(invalid("isa", format!("{v} is not a CONVKIT_ISA_*"))),
    };
    let precision = match o.precision {
        CONVKIT_PRECISION_BALANCED => Precision::Balanced,
        CONVKIT_PRECISION_ACCURATE => Precision::Accurate,
        CONVKIT_PRECISION_EXACT => Precision::Exact,
        v => {
            return Err(invalid(
                "precision",
                format!("{v} is not a CONVKIT_PRECISION_*"),
            ))
        }
    };
    let algorithm = match o.algorithm {
        CONVKIT_ALGORITHM_AUTO => None,
        CONVKIT_ALGORITHM_IM2COL_GEMM => Some(Algorithm::Im2colGemm),
        CONVKIT_ALGORITHM_DEPTHWISE => Some(Algorithm::Depthwise),
        CONVKIT_ALGORITHM_DEPTHWISE_GENERIC => Some(Algorithm::DepthwiseGeneric),
        CONVKIT_ALGORITHM_DIRECT => Some(Algorithm::Direct),
        CONVKIT_ALGORITHM_WINOGRAD => Some(Algorithm::Winograd),
        v => {
            return Err(invalid(
                "algorithm",
                format!("{v} is not a CONVKIT_ALGORITHM_*"),
            ))
        }
    };
    Ok(Options {
        threads: o.threads,
        isa,
        algorithm,
        precision,
        ..Options::default()
    })
}

fn algorithm_name(a: Algorithm) -> &'static CStr {
    match a {
        Algorithm::Im2colGemm => c"im2col_gemm",
        Algorithm::Depthwise => c"depthwise",
        Algorithm::DepthwiseGeneric => c"depthwise_generic",
        Algorithm::Direct => c"direct",
        Algorithm::Winograd => c"winograd",
    }
}

fn kernel_cstring(name: String) -> CString {
    CString::new(name.replace('\0', " ")).unwrap_or_default()
}

fn info_of(g: &crate::Geometry, shape: [usize; 4], workspace_bytes: usize) -> convkit_plan_info {
    convkit_plan_info {
        output_shape: shape,
        input_len: g.input_len(),
        output_len: g.output_len(),
        workspace_bytes,
        pads: [g.pad_top, g.pad_bottom, g.pad_left, g.pad_right],
        flops: g.flops(),
    }
}

// ---------------------------------------------------------------------------------------------
// Library

/// The library's version, e.g. `"0.1.0"` (a static string).
#[no_mangle]
pub extern "C" fn convkit_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// [`CONVKIT_ABI_VERSION`] of the library (compare it with the header's).
#[no_mangle]
pub extern "C" fn convkit_abi_version() -> u32 {
    CONVKIT_ABI_VERSION
}

/// The message of the calling thread's last failing call ("" if none): what is wrong, with
/// the values. Valid until that thread's next failing call.
#[no_mangle]
pub extern "C" fn convkit_last_error_message() -> *const c_char {
    query(c"".as_ptr(), || {
        // The CString lives in the thread-local until it is replaced by the next failure.
        LAST_ERROR.with(|m| m.borrow().as_ptr())
    })
}

/// The name of a status code, e.g. `"CONVKIT_ERROR_WRONG_LENGTH"` (a static string;
/// `"CONVKIT_UNKNOWN_STATUS"` for a value that is none).
#[no_mangle]
pub extern "C" fn convkit_status_name(status: convkit_status) -> *const c_char {
    let name = match status {
        CONVKIT_OK => c"CONVKIT_OK",
        CONVKIT_ERROR_ZERO => c"CONVKIT_ERROR_ZERO",
        CONVKIT_ERROR_NOT_DIVISIBLE_BY_GROUPS => c"CONVKIT_ERROR_NOT_DIVISIBLE_BY_GROUPS",
        CONVKIT_ERROR_KERNEL_TOO_LARGE => c"CONVKIT_ERROR_KERNEL_TOO_LARGE",
        CONVKIT_ERROR_OVERFLOW => c"CONVKIT_ERROR_OVERFLOW",
        CONVKIT_ERROR_WRONG_LENGTH => c"CONVKIT_ERROR_WRONG_LENGTH",
        CONVKIT_ERROR_INVALID_PARAMETER => c"CONVKIT_ERROR_INVALID_PARAMETER",
        CONVKIT_ERROR_OUT_OF_MEMORY => c"CONVKIT_ERROR_OUT_OF_MEMORY",
        CONVKIT_ERROR_ISA_UNAVAILABLE => c"CONVKIT_ERROR_ISA_UNAVAILABLE",
        CONVKIT_ERROR_ALGORITHM_UNSUPPORTED => c"CONVKIT_ERROR_ALGORITHM_UNSUPPORTED",
        CONVKIT_ERROR_NO_GPU => c"CONVKIT_ERROR_NO_GPU",
        CONVKIT_ERROR_GPU => c"CONVKIT_ERROR_GPU",
        CONVKIT_ERROR_NULL_POINTER => c"CONVKIT_ERROR_NULL_POINTER",
        CONVKIT_ERROR_NOT_BUILT => c"CONVKIT_ERROR_NOT_BUILT",
        CONVKIT_ERROR_PANIC => c"CONVKIT_ERROR_PANIC",
        _ => c"CONVKIT_UNKNOWN_STATUS",
    };
    name.as_ptr()
}

/// The best ISA level this CPU has and this build has kernels for (a `CONVKIT_ISA_*`).
#[no_mangle]
pub extern "C" fn convkit_best_isa() -> i32 {
    query(CONVKIT_ISA_SCALAR, || match Isa::best() {
        Isa::Scalar => CONVKIT_ISA_SCALAR,
        Isa::Avx2 => CONVKIT_ISA_AVX2,
        Isa::Avx512 => CONVKIT_ISA_AVX512,
        Isa::Neon => CONVKIT_ISA_NEON,
    })
}

/// Fills `*params` for a dense convolution `in_channels -> out_channels` with a
/// `kernel_h x kernel_w` kernel: groups 1, stride 1, dilation 1, explicit zero padding, NCHW,
/// no activation.
///
/// # Safety
/// `params` is NULL or valid for a write of a `convkit_conv_params`.
#[no_mangle]
pub unsafe extern "C" fn convkit_conv_params_init(
    params: *mut convkit_conv_params,
    in_channels: usize,
    out_channels: usize,
    kernel_h: usize,
    kernel_w: usize,
) -> convkit_status {
    call(|| {
        let p = convkit_conv_params {
            in_channels,
            out_channels,
            groups: 1,
            kernel_h,
            kernel_w,
            stride_h: 1,
            stride_w: 1,
            dilation_h: 1,
            dilation_w: 1,
            ..Default::default()
        };
        // SAFETY: the caller guarantees `params` is NULL or writable.
        unsafe { put(params, p, "params") }
    })
}

// ---------------------------------------------------------------------------------------------
// Workspaces

/// Creates a workspace of at least `bytes` bytes (0: empty; runs grow it to what they need).
/// One workspace serves every layer of a network, one run at a time.
///
/// # Safety
/// `out` is NULL or valid for a write of a pointer.
#[no_mangle]
pub unsafe extern "C" fn convkit_workspace_create(
    bytes: usize,
    out: *mut *mut convkit_workspace,
) -> convkit_status {
    call(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let ws = Box::new(convkit_workspace {
            ws: Workspace::with_bytes(bytes)?,
        });
        // SAFETY: `out` is non-NULL and the caller guarantees it is writable.
        unsafe { put(out, Box::into_raw(ws), "out") }
    })
}

/// Grows `workspace` to at least `bytes` bytes (never shrinks).
///
/// # Safety
/// `workspace` is NULL or a live handle from [`convkit_workspace_create`], not used by a run
/// at the same time.
#[no_mangle]
pub unsafe extern "C" fn convkit_workspace_reserve(
    workspace: *mut convkit_workspace,
    bytes: usize,
) -> convkit_status {
    call(|| {
        // SAFETY: the caller guarantees a live handle with no other user now.
        let ws = unsafe { workspace.as_mut() }.ok_or_else(|| null("workspace"))?;
        Ok(ws.ws.reserve(bytes)?)
    })
}

/// The workspace's size in bytes (0 for NULL).
///
/// # Safety
/// `workspace` is NULL or a live handle, not used by a run at the same time.
#[no_mangle]
pub unsafe extern "C" fn convkit_workspace_bytes(workspace: *const convkit_workspace) -> usize {
    query(0, || {
        // SAFETY: the caller guarantees NULL or a live handle that no one writes now.
        let w = unsafe { workspace.as_ref() };
        w.map_or(0, |w| w.ws.bytes())
    })
}

/// Frees a workspace (NULL: nothing).
///
/// # Safety
/// `workspace` is NULL or a live handle from [`convkit_workspace_create`], not used after.
#[no_mangle]
pub unsafe extern "C" fn convkit_workspace_destroy(workspace: *mut convkit_workspace) {
    if !workspace.is_null() {
        // SAFETY: the handle came from Box::into_raw in convkit_workspace_create and the
        // caller gives it up.
        let boxed = unsafe { Box::from_raw(workspace) };
        let _ = catch_unwind(AssertUnwindSafe(|| drop(boxed)));
    }
}

// ---------------------------------------------------------------------------------------------
// f32 convolutions

/// Shared by the 2-D and 1-D creates.
///
/// # Safety
/// As [`convkit_conv_create`].
#[allow(clippy::too_many_arguments)]
unsafe fn conv_create(
    params: *const convkit_conv_params,
    weights: *const f32,
    weights_len: usize,
    bias: *const f32,
    bias_len: usize,
    options: *const convkit_options,
    out: *mut *mut convkit_conv,
    one_d: bool,
) -> convkit_status {
    call(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: the caller guarantees each pointer is NULL or valid for its length.
        let (params, weights, options) = unsafe {
            (
                get(params, "params")?,
                slice(weights, weights_len, "weights")?,
                options.as_ref(),
            )
        };
        // SAFETY: as above; a NULL bias with length 0 is no bias.
        let bias = (!bias.is_null() || bias_len > 0)
            .then(|| unsafe { slice(bias, bias_len, "bias") })
            .transpose()?;
        let params = params_of(params)?;
        let options = options_of(options)?;
        let conv = if one_d {
            Conv1d::new(params, weights, bias, options)?
                .as_conv2d()
                .clone()
        } else {
            Conv2d::new(params, weights, bias, options)?
        };
        let handle = Box::into_raw(Box::new(convkit_conv { conv }));
        // SAFETY: `out` is non-NULL and the caller guarantees it is writable.
        unsafe { put(out, handle, "out") }
    })
}

/// Creates an f32 convolution: validates `params`, checks `weights` (OIHW, `out_channels x
/// in_channels/groups x kernel_h x kernel_w` floats) and `bias` (`out_channels` floats, or
/// NULL and 0 for none), chooses the algorithm and packs the weights (copied: the caller's
/// arrays may be freed after). `options` may be NULL. On success `*out` is the handle.
///
/// # Safety
/// `params` and `options` are NULL or valid; `weights` and `bias` are NULL or hold their
/// lengths in floats; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn convkit_conv_create(
    params: *const convkit_conv_params,
    weights: *const f32,
    weights_len: usize,
    bias: *const f32,
    bias_len: usize,
    options: *const convkit_options,
    out: *mut *mut convkit_conv,
) -> convkit_status {
    // SAFETY: the caller's guarantees are conv_create's.
    unsafe {
        conv_create(
            params,
            weights,
            weights_len,
            bias,
            bias_len,
            options,
            out,
            false,
        )
    }
}

/// As [`convkit_conv_create`] for a 1-D convolution: `kernel_h`, `stride_h` and `dilation_h`
/// must be 1 and the vertical padding 0 (else `CONVKIT_ERROR_INVALID_PARAMETER`); weights are
/// `out x in/groups x kernel_w`. Plan it with `in_h = 1` and `in_w` the length (NCW, or NWC
/// with `CONVKIT_LAYOUT_NHWC`).
///
/// # Safety
/// As [`convkit_conv_create`].
#[no_mangle]
pub unsafe extern "C" fn convkit_conv1d_create(
    params: *const convkit_conv_params,
    weights: *const f32,
    weights_len: usize,
    bias: *const f32,
    bias_len: usize,
    options: *const convkit_options,
    out: *mut *mut convkit_conv,
) -> convkit_status {
    // SAFETY: the caller's guarantees are conv_create's.
    unsafe {
        conv_create(
            params,
            weights,
            weights_len,
            bias,
            bias_len,
            options,
            out,
            true,
        )
    }
}

/// The algorithm the convolution runs (a static string such as `"winograd"`; "" for NULL).
///
/// # Safety
/// `conv` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn convkit_conv_algorithm(conv: *const convkit_conv) -> *const c_char {
    query(c"".as_ptr(), || {
        // SAFETY: the caller guarantees NULL or a live handle.
        let c = unsafe { conv.as_ref() };
        c.map_or(c"".as_ptr(), |c| {
            algorithm_name(c.conv.algorithm()).as_ptr()
        })
    })
}

/// Frees a convolution (NULL: nothing). Plans made from it stay valid.
///
/// # Safety
/// `conv` is NULL or a live handle from a create, not used after.
#[no_mangle]
pub unsafe extern "C" fn convkit_conv_destroy(conv: *mut convkit_conv) {
    if !conv.is_null() {
        // SAFETY: the handle came from Box::into_raw in a create and the caller gives it up.
        let boxed = unsafe { Box::from_raw(conv) };
        let _ = catch_unwind(AssertUnwindSafe(|| drop(boxed)));
    }
}

/// Plans `conv` for `batch` images of `in_h x in_w`: output shape, algorithm tiling and
/// workspace size are fixed. On success `*out` is the plan's handle.
///
/// # Safety
/// `conv` is NULL or a live handle; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn convkit_conv_plan(
    conv: *const convkit_conv,
    batch: usize,
    in_h: usize,
    in_w: usize,
    out: *mut *mut convkit_plan,
) -> convkit_status {
    call(|| {
        // SAFETY: the caller guarantees NULL or a live handle.
        let conv = unsafe { get(conv, "conv") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        let plan = conv.conv.plan(batch, in_h, in_w)?;
        let kernel = kernel_cstring(plan.kernel_name());
        let handle = Box::into_raw(Box::new(convkit_plan { plan, kernel }));
        // SAFETY: `out` is non-NULL and the caller guarantees it is writable.
        unsafe { put(out, handle, "out") }
    })
}

/// What the plan fixed: output shape, lengths, workspace bytes, padding.
///
/// # Safety
/// `plan` is NULL or a live handle; `info` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn convkit_plan_get_info(
    plan: *const convkit_plan,
    info: *mut convkit_plan_info,
) -> convkit_status {
    call(|| {
        // SAFETY: the caller guarantees NULL or a live handle.
        let p = &unsafe { get(plan, "plan") }?.plan;
        let i = info_of(p.geometry(), p.output_shape(), p.workspace_bytes());
        // SAFETY: the caller guarantees `info` is NULL or writable.
        unsafe { put(info, i, "info") }
    })
}

/// The algorithm and kernel that run, e.g. `"im2col_gemm/gemm_f32_6x16_avx2"` (valid while
/// the plan lives; "" for NULL).
///
/// # Safety
/// `plan` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn convkit_plan_kernel_name(plan: *const convkit_plan) -> *const c_char {
    query(c"".as_ptr(), || {
        // SAFETY: the caller guarantees NULL or a live handle; the string lives in it.
        let p = unsafe { plan.as_ref() };
        p.map_or(c"".as_ptr(), |p| p.kernel.as_ptr())
    })
}

/// Shared by the runs with and without residual.
///
/// # Safety
/// As [`convkit_plan_run_residual`].
#[allow(clippy::too_many_arguments)]
unsafe fn plan_run(
    plan: *const convkit_plan,
    input: *const f32,
    input_len: usize,
    residual: Option<(*const f32, usize)>,
    output: *mut f32,
    output_len: usize,
    workspace: *mut convkit_workspace,
) -> convkit_status {
    call(|| {
        // SAFETY: the caller guarantees NULL or a live handle.
        let plan = &unsafe { get(plan, "plan") }?.plan;
        let bytes = |n: usize| n.saturating_mul(4);
        let mut others = vec![(input.cast::<u8>(), bytes(input_len), "input")];
        if let Some((r, n)) = residual {
            others.push((r.cast::<u8>(), bytes(n), "residual"));
        }
        check_apart((output.cast(), bytes(output_len)), "output", &others)?;
        // SAFETY: the caller guarantees each tensor is NULL or holds its length; the output
        // overlaps neither input (checked above), so the mutable slice is unaliased.
        let (x, y) = unsafe {
            (
                slice(input, input_len, "input")?,
                slice_mut(output, output_len, "output")?,
            )
        };
        let mut temporary = Workspace::new();
        // SAFETY: the caller guarantees NULL or a live workspace no other run uses now.
        let ws = match unsafe { workspace.as_mut() } {
            Some(w) => &mut w.ws,
            None => &mut temporary,
        };
        match residual {
            None => plan.run(x, y, ws)?,
            Some((r, n)) => {
                // SAFETY: as the input.
                let r = unsafe { slice(r, n, "residual") }?;
                plan.run_with_residual(x, r, y, ws)?
            }
        }
        Ok(())
    })
}

/// `output = act(conv(input) + bias)`. Lengths are in floats and must be the plan's
/// (`CONVKIT_ERROR_WRONG_LENGTH` else); `output` must not overlap `input`. `workspace` may be
/// NULL: the run then allocates its scratch (else it allocates nothing once the workspace
/// holds the plan's `workspace_bytes`).
///
/// # Safety
/// `plan` is NULL or a live handle; `input` and `output` are NULL or hold their lengths;
/// `workspace` is NULL or a live handle no other run uses at the same time.
#[no_mangle]
pub unsafe extern "C" fn convkit_plan_run(
    plan: *const convkit_plan,
    input: *const f32,
    input_len: usize,
    output: *mut f32,
    output_len: usize,
    workspace: *mut convkit_workspace,
) -> convkit_status {
    // SAFETY: the caller's guarantees are plan_run's.
    unsafe { plan_run(plan, input, input_len, None, output, output_len, workspace) }
}

/// `output = act(conv(input) + bias + residual)`, `residual` of the output's shape (it must
/// not overlap `output`).
///
/// # Safety
/// As [`convkit_plan_run`], and `residual` is NULL or holds `residual_len` floats.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn convkit_plan_run_residual(
    plan: *const convkit_plan,
    input: *const f32,
    input_len: usize,
    residual: *const f32,
    residual_len: usize,
    output: *mut f32,
    output_len: usize,
    workspace: *mut convkit_workspace,
) -> convkit_status {
    // SAFETY: the caller's guarantees are plan_run's.
    unsafe {
        plan_run(
            plan,
            input,
            input_len,
            Some((residual, residual_len)),
            output,
            output_len,
            workspace,
        )
    }
}

/// Frees a plan (NULL: nothing).
///
/// # Safety
/// `plan` is NULL or a live handle from [`convkit_conv_plan`], not used after.
#[no_mangle]
pub unsafe extern "C" fn convkit_plan_destroy(plan: *mut convkit_plan) {
    if !plan.is_null() {
        // SAFETY: the handle came from Box::into_raw in convkit_conv_plan and the caller
        // gives it up.
        let boxed = unsafe { Box::from_raw(plan) };
        let _ = catch_unwind(AssertUnwindSafe(|| drop(boxed)));
    }
}

// ---------------------------------------------------------------------------------------------
// int8 convolutions

#[cfg(not(feature = "int8"))]
fn not_built() -> Failure {
    Failure {
        status: CONVKIT_ERROR_NOT_BUILT,
        message: "this convkit was built without the int8 feature".into(),
    }
}

#[cfg(feature = "int8")]
fn quant_of(q: &convkit_quant_params) -> Result<crate::QuantParams, Failure> {
    use crate::{QuantOutput, QuantType};
    let ty = |v: i32, what: &'static str| match v {
        CONVKIT_QTYPE_U8 => Ok(QuantType::U8),
        CONVKIT_QTYPE_I8 => Ok(QuantType::I8),
        v => Err(invalid(what, format!("{v} is not CONVKIT_QTYPE_U8 or _I8"))),
    };
    // SAFETY: the caller of the create guarantees the scales hold their length.
    let scales = unsafe { slice(q.weight_scales, q.weight_scales_len, "weight_scales") }?;
    let output = match q.output_type {
        CONVKIT_QTYPE_I32 => QuantOutput::I32,
        CONVKIT_QTYPE_F32 => QuantOutput::F32,
        v => QuantOutput::Quantized {
            ty: ty(v, "output type")?,
            scale: q.output_scale,
            zero_point: q.output_zero_point,
        },
    };
    Ok(crate::QuantParams {
        input_type: ty(q.input_type, "input type")?,
        input_scale: q.input_scale,
        input_zero_point: q.input_zero_point,
        weight_scales: scales.to_vec(),
        output,
    })
}

/// Shared by the 2-D and 1-D int8 creates.
///
/// # Safety
/// As [`convkit_qconv_create`].
#[allow(clippy::too_many_arguments)]
unsafe fn qconv_create(
    params: *const convkit_conv_params,
    quant: *const convkit_quant_params,
    weights: *const i8,
    weights_len: usize,
    bias: *const i32,
    bias_len: usize,
    options: *const convkit_options,
    out: *mut *mut convkit_qconv,
    one_d: bool,
) -> convkit_status {
    call(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: the caller guarantees each pointer is NULL or valid for its length.
        let (params, quant, weights, options) = unsafe {
            (
                get(params, "params")?,
                get(quant, "quant")?,
                slice(weights, weights_len, "weights")?,
                options.as_ref(),
            )
        };
        // SAFETY: as above; a NULL bias with length 0 is no bias.
        let bias = (!bias.is_null() || bias_len > 0)
            .then(|| unsafe { slice(bias, bias_len, "bias") })
            .transpose()?;
        let params = params_of(params)?;
        let options = options_of(options)?;
        #[cfg(feature = "int8")]
        {
            let quant = quant_of(quant)?;
            let conv = if one_d {
                crate::QConv1d::new(params, quant, weights, bias, options)?
                    .as_qconv2d()
                    .clone()
            } else {
                crate::QConv2d::new(params, quant, weights, bias, options)?
            };
            let handle = Box::into_raw(Box::new(convkit_qconv { conv }));
            // SAFETY: `out` is non-NULL and the caller guarantees it is writable.
            unsafe { put(out, handle, "out") }
        }
        #[cfg(not(feature = "int8"))]
        {
            let _ = (params, quant, weights, bias, options, one_d);
            Err(not_built())
        }
    })
}

/// Creates an int8 convolution with ONNX QLinearConv's arithmetic (see the README): `params`
/// as for f32 (a fused activation other than ReLU, ReLU6 or clamp needs an f32 output),
/// `quant` the types, scales and zero points, `weights` OIHW int8 (symmetric), `bias`
/// `out_channels` int32 in units of `input_scale · weight_scale` (or NULL and 0).
/// `CONVKIT_ERROR_NOT_BUILT` in a build without the `int8` feature.
///
/// # Safety
/// As [`convkit_conv_create`]; `quant` is NULL or valid, its `weight_scales` holding
/// `weight_scales_len` floats.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn convkit_qconv_create(
    params: *const convkit_conv_params,
    quant: *const convkit_quant_params,
    weights: *const i8,
    weights_len: usize,
    bias: *const i32,
    bias_len: usize,
    options: *const convkit_options,
    out: *mut *mut convkit_qconv,
) -> convkit_status {
    // SAFETY: the caller's guarantees are qconv_create's.
    unsafe {
        qconv_create(
            params,
            quant,
            weights,
            weights_len,
            bias,
            bias_len,
            options,
            out,
            false,
        )
    }
}

/// As [`convkit_qconv_create`] for a 1-D convolution (see [`convkit_conv1d_create`]).
///
/// # Safety
/// As [`convkit_qconv_create`].
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn convkit_qconv1d_create(
    params: *const convkit_conv_params,
    quant: *const convkit_quant_params,
    weights: *const i8,
    weights_len: usize,
    bias: *const i32,
    bias_len: usize,
    options: *const convkit_options,
    out: *mut *mut convkit_qconv,
) -> convkit_status {
    // SAFETY: the caller's guarantees are qconv_create's.
    unsafe {
        qconv_create(
            params,
            quant,
            weights,
            weights_len,
            bias,
            bias_len,
            options,
            out,
            true,
        )
    }
}

/// Frees an int8 convolution (NULL: nothing). Plans made from it stay valid.
///
/// # Safety
/// `conv` is NULL or a live handle from an int8 create, not used after.
#[no_mangle]
pub unsafe extern "C" fn convkit_qconv_destroy(conv: *mut convkit_qconv) {
    if !conv.is_null() {
        // SAFETY: the handle came from Box::into_raw in a create and the caller gives it up.
        let boxed = unsafe { Box::from_raw(conv) };
        let _ = catch_unwind(AssertUnwindSafe(|| drop(boxed)));
    }
}

/// Plans an int8 convolution for `batch` images of `in_h x in_w`.
///
/// # Safety
/// `conv` is NULL or a live handle; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn convkit_qconv_plan(
    conv: *const convkit_qconv,
    batch: usize,
    in_h: usize,
    in_w: usize,
    out: *mut *mut convkit_qplan,
) -> convkit_status {
    call(|| {
        // SAFETY: the caller guarantees NULL or a live handle.
        let conv = unsafe { get(conv, "conv") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        #[cfg(feature = "int8")]
        {
            let plan = conv.conv.plan(batch, in_h, in_w)?;
            let kernel = kernel_cstring(plan.kernel_name());
            let quant = conv.conv.quant().clone();
            let handle = Box::into_raw(Box::new(convkit_qplan {
                plan,
                kernel,
                quant,
            }));
            // SAFETY: `out` is non-NULL and the caller guarantees it is writable.
            unsafe { put(out, handle, "out") }
        }
        #[cfg(not(feature = "int8"))]
        {
            let _ = (conv, batch, in_h, in_w);
            Err(not_built())
        }
    })
}

/// What the int8 plan fixed (lengths in elements).
///
/// # Safety
/// `plan` is NULL or a live handle; `info` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn convkit_qplan_get_info(
    plan: *const convkit_qplan,
    info: *mut convkit_plan_info,
) -> convkit_status {
    call(|| {
        // SAFETY: the caller guarantees NULL or a live handle.
        let plan = unsafe { get(plan, "plan") }?;
        #[cfg(feature = "int8")]
        {
            let p = &plan.plan;
            let i = info_of(p.geometry(), p.output_shape(), p.workspace_bytes());
            // SAFETY: the caller guarantees `info` is NULL or writable.
            unsafe { put(info, i, "info") }
        }
        #[cfg(not(feature = "int8"))]
        {
            let _ = (plan, info);
            Err(not_built())
        }
    })
}

/// The algorithm and kernel the int8 plan runs (valid while the plan lives; "" for NULL).
///
/// # Safety
/// `plan` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn convkit_qplan_kernel_name(plan: *const convkit_qplan) -> *const c_char {
    query(c"".as_ptr(), || {
        // SAFETY: the caller guarantees NULL or a live handle; the string lives in it.
        let p = unsafe { plan.as_ref() };
        #[cfg(feature = "int8")]
        let name = p.map_or(c"".as_ptr(), |p| p.kernel.as_ptr());
        #[cfg(not(feature = "int8"))]
        let name = p.map_or(c"".as_ptr(), |_| c"".as_ptr());
        name
    })
}

/// Runs an int8 plan on typed slices made from the C pointers.
///
/// # Safety
/// As [`convkit_qplan_run_residual`].
#[cfg(feature = "int8")]
#[allow(clippy::too_many_arguments)]
unsafe fn qrun_typed<I: crate::QElement, O: crate::QElement>(
    plan: &crate::QPlan,
    input: *const I,
    input_len: usize,
    residual: Option<(*const f32, usize)>,
    output: *mut O,
    output_len: usize,
    ws: &mut Workspace,
) -> Result<(), Failure> {
    let size = |n: usize, t: usize| n.saturating_mul(t);
    let mut others = vec![(
        input.cast::<u8>(),
        size(input_len, std::mem::size_of::<I>()),
        "input",
    )];
    if let Some((r, n)) = residual {
        others.push((r.cast::<u8>(), size(n, 4), "residual"));
    }
    check_apart(
        (output.cast(), size(output_len, std::mem::size_of::<O>())),
        "output",
        &others,
    )?;
    // SAFETY: the caller guarantees each tensor is NULL or holds its length in its element
    // type; the output overlaps no input (checked above).
    let (x, y) = unsafe {
        (
            slice(input, input_len, "input")?,
            slice_mut(output, output_len, "output")?,
        )
    };
    match residual {
        None => plan.run(x, y, ws)?,
        Some((r, n)) => {
            // SAFETY: as the input.
            let r = unsafe { slice(r, n, "residual") }?;
            // The residual takes f32 outputs only (else an error, before any cast matters).
            let y: &mut [f32] = bytemuck::try_cast_slice_mut(y).map_err(|_| {
                invalid(
                    "residual",
                    "a residual is added to f32 outputs only".to_string(),
                )
            })?;
            plan.run_with_residual(x, r, y, ws)?
        }
    }
    Ok(())
}

/// Shared by the int8 runs.
///
/// # Safety
/// As [`convkit_qplan_run_residual`].
#[allow(clippy::too_many_arguments)]
unsafe fn qplan_run(
    plan: *const convkit_qplan,
    input: *const std::ffi::c_void,
    input_len: usize,
    residual: Option<(*const f32, usize)>,
    output: *mut std::ffi::c_void,
    output_len: usize,
    workspace: *mut convkit_workspace,
) -> convkit_status {
    call(|| {
        // SAFETY: the caller guarantees NULL or a live handle.
        let plan = unsafe { get(plan, "plan") }?;
        #[cfg(feature = "int8")]
        {
            use crate::{QuantOutput, QuantType};
            let (p, q) = (&plan.plan, &plan.quant);
            let mut temporary = Workspace::new();
            // SAFETY: the caller guarantees NULL or a live workspace no other run uses now.
            let ws = match unsafe { workspace.as_mut() } {
                Some(w) => &mut w.ws,
                None => &mut temporary,
            };
            macro_rules! run_as {
                ($i:ty, $o:ty) => {{
                    // SAFETY: the caller guarantees the tensors hold their lengths in the
                    // convolution's element types, which chose `$i` and `$o`.
                    unsafe {
                        qrun_typed(
                            p,
                            input.cast::<$i>(),
                            input_len,
                            residual,
                            output.cast::<$o>(),
                            output_len,
                            ws,
                        )
                    }
                }};
            }
            match (q.input_type, q.output) {
                (
                    QuantType::U8,
                    QuantOutput::Quantized {
                        ty: QuantType::U8, ..
                    },
                ) => run_as!(u8, u8),
                (
                    QuantType::U8,
                    QuantOutput::Quantized {
                        ty: QuantType::I8, ..
                    },
                ) => run_as!(u8, i8),
                (QuantType::U8, QuantOutput::I32) => run_as!(u8, i32),
                (QuantType::U8, QuantOutput::F32) => run_as!(u8, f32),
                (
                    QuantType::I8,
                    QuantOutput::Quantized {
                        ty: QuantType::U8, ..
                    },
                ) => run_as!(i8, u8),
                (
                    QuantType::I8,
                    QuantOutput::Quantized {
                        ty: QuantType::I8, ..
                    },
                ) => run_as!(i8, i8),
                (QuantType::I8, QuantOutput::I32) => run_as!(i8, i32),
                (QuantType::I8, QuantOutput::F32) => run_as!(i8, f32),
            }
        }
        #[cfg(not(feature = "int8"))]
        {
            let _ = (
                plan, input, input_len, residual, output, output_len, workspace,
            );
            Err(not_built())
        }
    })
}

/// Runs an int8 plan: `input` holds `input_len` elements of the convolution's input type
/// (`uint8_t` or `int8_t`), `output` `output_len` of its output type (`uint8_t`, `int8_t`,
/// `int32_t` or `float`). `workspace` may be NULL, as for [`convkit_plan_run`].
///
/// # Safety
/// `plan` is NULL or a live handle; `input` and `output` are NULL or hold their lengths in
/// the convolution's element types; `workspace` is NULL or a live handle no other run uses at
/// the same time.
#[no_mangle]
pub unsafe extern "C" fn convkit_qplan_run(
    plan: *const convkit_qplan,
    input: *const std::ffi::c_void,
    input_len: usize,
    output: *mut std::ffi::c_void,
    output_len: usize,
    workspace: *mut convkit_workspace,
) -> convkit_status {
    // SAFETY: the caller's guarantees are qplan_run's.
    unsafe { qplan_run(plan, input, input_len, None, output, output_len, workspace) }
}

/// As [`convkit_qplan_run`] with a residual added, for `CONVKIT_QTYPE_F32` outputs only
/// (`float` output and residual).
///
/// # Safety
/// As [`convkit_qplan_run`], and `residual` is NULL or holds `residual_len` floats.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn convkit_qplan_run_residual(
    plan: *const convkit_qplan,
    input: *const std::ffi::c_void,
    input_len: usize,
    residual: *const f32,
    residual_len: usize,
    output: *mut f32,
    output_len: usize,
    workspace: *mut convkit_workspace,
) -> convkit_status {
    // SAFETY: the caller's guarantees are qplan_run's.
    unsafe {
        qplan_run(
            plan,
            input,
            input_len,
            Some((residual, residual_len)),
            output.cast(),
            output_len,
            workspace,
        )
    }
}

/// Frees an int8 plan (NULL: nothing).
///
/// # Safety
/// `plan` is NULL or a live handle from [`convkit_qconv_plan`], not used after.
#[no_mangle]
pub unsafe extern "C" fn convkit_qplan_destroy(plan: *mut convkit_qplan) {
    if !plan.is_null() {
        // SAFETY: the handle came from Box::into_raw in convkit_qconv_plan and the caller
        // gives it up.
        let boxed = unsafe { Box::from_raw(plan) };
        let _ = catch_unwind(AssertUnwindSafe(|| drop(boxed)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: the message is a NUL-terminated string owned by this thread, read at once.
        unsafe { CStr::from_ptr(convkit_last_error_message()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_is_a_status_with_its_message() {
        assert_eq!(call(|| panic!("boom {}", 7)), CONVKIT_ERROR_PANIC);
        assert!(last().contains("boom 7"), "{}", last());
        assert_eq!(call(|| Ok(())), CONVKIT_OK);
        assert!(last().contains("boom 7"), "kept until the next failure");
        assert_eq!(query(5, || panic!("in a query")), 5);
    }

    #[test]
    fn every_error_has_its_status_and_name() {
        let e = Error::WrongLength {
            what: "input",
            expected: 3,
            got: 2,
        };
        assert_eq!(call(|| Err(e.into())), CONVKIT_ERROR_WRONG_LENGTH);
        assert_eq!(last(), "input has 2 elements, expected 3");
        for status in CONVKIT_OK..=CONVKIT_ERROR_PANIC {
            // SAFETY: status names are static NUL-terminated strings.
            let name = unsafe { CStr::from_ptr(convkit_status_name(status)) };
            assert!(name.to_str().unwrap().starts_with("CONVKIT_"), "{status}");
            assert_ne!(name.to_str().unwrap(), "CONVKIT_UNKNOWN_STATUS", "{status}");
        }
    }

    #[test]
    fn messages_with_nul_bytes_survive() {
        set_last_error("a\0b");
        assert_eq!(last(), "a b");
    }
}
