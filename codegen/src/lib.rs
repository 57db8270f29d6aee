//! convkit's build-time kernel generator.
//!
//! Tables ([`GEMM_F32`], [`dw_f32`]) say which kernels exist for which ISA; one emitter per
//! kernel family turns a row of a table into readable Rust (`core::arch` intrinsics inside
//! `#[target_feature]` functions), built as token trees and formatted with prettyplease.
//! `build.rs` writes the result into `OUT_DIR`; `cargo run -p codegen -- --dump DIR` writes
//! it anywhere for reading.

use proc_macro2::{Ident, Literal, Span, TokenStream};
use quote::{format_ident, quote};

mod depthwise;
mod direct;
mod gemm;
mod layout;
mod qdw;
mod qgemm;
mod simd;
mod winograd;

pub use qdw::QDW_SHAPES;
pub use qgemm::{QGemmSpec, QMul, QGEMM};

/// An instruction-set level a kernel is generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// The suffix of kernel names and the variant name in `convkit::Isa`.
    pub fn suffix(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    fn variant(self) -> Ident {
        Ident::new(
            match self {
                Isa::Scalar => "Scalar",
                Isa::Avx2 => "Avx2",
                Isa::Avx512 => "Avx512",
                Isa::Neon => "Neon",
            },
            Span::call_site(),
        )
    }

    /// The `#[cfg]` under which kernels of this ISA can be compiled at all.
    fn cfg(self) -> TokenStream {
        match self {
            Isa::Scalar => quote!(),
            Isa::Avx2 | Isa::Avx512 => quote!(#[cfg(target_arch = "x86_64")]),
            Isa::Neon => quote!(#[cfg(target_arch = "aarch64")]),
        }
    }
}

/// One f32 GEMM microkernel: an `mr` x `nr` register tile.
#[derive(Clone, Copy, Debug)]
pub struct GemmSpec {
    pub isa: Isa,
    pub mr: usize,
    pub nr: usize,
}

impl GemmSpec {
    pub fn name(&self) -> String {
        format!("gemm_f32_{}x{}_{}", self.mr, self.nr, self.isa.suffix())
    }
}

/// The f32 GEMM microkernels, one per ISA. Register budgets:
/// AVX2 has 16 ymm: 6x16 keeps 12 accumulators + 2 B vectors + 1 broadcast A.
/// AVX-512 has 32 zmm: 8x32 keeps 16 accumulators (enough to hide the 4-cycle FMA latency on
/// two ports) and leaves room for the loads. NEON has 32 q registers: 8x12 keeps 24
/// accumulators + 3 B vectors + 1 broadcast. The scalar kernel is plain Rust that the compiler
/// may vectorise for the baseline target.
pub const GEMM_F32: &[GemmSpec] = &[
    GemmSpec {
        isa: Isa::Scalar,
        mr: 4,
        nr: 8,
    },
    GemmSpec {
        isa: Isa::Avx2,
        mr: 6,
        nr: 16,
    },
    GemmSpec {
        isa: Isa::Avx512,
        mr: 8,
        nr: 32,
    },
    GemmSpec {
        isa: Isa::Neon,
        mr: 8,
        nr: 12,
    },
];

/// The tensor layout a depthwise kernel works in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DwLayout {
    Nchw,
    Nhwc,
    /// NCHW planes as flat vectors of `oh * ow` outputs (stride 1, output as wide as the
    /// input): every tap a fixed offset, the padding a lane mask from the plan's table.
    Flat,
}

impl DwLayout {
    fn suffix(self) -> &'static str {
        match self {
            DwLayout::Nchw => "nchw",
            DwLayout::Nhwc => "nhwc",
            DwLayout::Flat => "flat_nchw",
        }
    }
}

/// The type a kernel's tensors are stored in (arithmetic is f32 in every one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dt {
    F32,
    /// IEEE half precision, widened and rounded in registers (F16C, AVX-512F, scalar).
    F16,
    /// bfloat16: widening is a 16-bit shift, rounding to nearest even is integer arithmetic.
    Bf16,
}

impl Dt {
    pub fn suffix(self) -> &'static str {
        match self {
            Dt::F32 => "f32",
            Dt::F16 => "f16",
            Dt::Bf16 => "bf16",
        }
    }

    fn variant(self) -> Ident {
        Ident::new(
            match self {
                Dt::F32 => "F32",
                Dt::F16 => "F16",
                Dt::Bf16 => "Bf16",
            },
            Span::call_site(),
        )
    }
}

/// One depthwise kernel: a fixed square `(kernel, stride)` with dilation 1, unrolled, or
/// (`shape: None`) the generic kernel that takes any kernel, stride and dilation.
#[derive(Clone, Copy, Debug)]
pub struct DwSpec {
    pub isa: Isa,
    pub layout: DwLayout,
    pub shape: Option<(usize, usize)>,
    /// AVX-512 NCHW only: 8-lane (ymm) vectors with AVX-512's 32 registers and masks, for
    /// images at most 8 wide, where 16 lanes would be half empty.
    pub ymm: bool,
    /// The type of the input, output and residual (weights and bias are f32).
    pub dtype: Dt,
}

impl DwSpec {
    pub fn name(&self) -> String {
        let shape = match (self.shape, self.layout) {
            (Some((k, s)), _) => format!("k{k}s{s}"),
            // Any kernel and dilation, so the name needs no "generic".
            (None, DwLayout::Flat) => String::new(),
            (None, _) => "generic".into(),
        };
        let ymm = if self.ymm { "_ymm" } else { "" };
        let sep = if shape.is_empty() { "" } else { "_" };
        format!(
            "dw_{}_{shape}{sep}{}{ymm}_{}",
            self.dtype.suffix(),
            self.layout.suffix(),
            self.isa.suffix()
        )
    }
}

/// The depthwise shapes that get an unrolled kernel: the 3x3, 5x5 and 7x7 of MobileNet,
/// EfficientNet and ConvNeXt, at strides 1 and 2. Everything else runs the generic kernel.
pub const DW_SHAPES: &[(usize, usize)] = &[(3, 1), (3, 2), (5, 1), (5, 2), (7, 1), (7, 2)];

/// The f32 depthwise kernels: every shape of [`DW_SHAPES`] and the generic kernel, in both
/// layouts, for every ISA; for AVX-512 NCHW, 8-lane variants too; and at AVX2 and AVX-512 the
/// flat-plane kernel (any kernel and dilation at stride 1), for small planes whose rows are
/// too short for the plane kernels' vectors.
pub fn dw_f32() -> Vec<DwSpec> {
    let shapes: Vec<Option<(usize, usize)>> =
        DW_SHAPES.iter().map(|&s| Some(s)).chain([None]).collect();
    let mut specs = Vec::new();
    for isa in Isa::ALL {
        for layout in [DwLayout::Nchw, DwLayout::Nhwc] {
            let ymm_too = isa == Isa::Avx512 && layout == DwLayout::Nchw;
            for ymm in [false, true] {
                if ymm && !ymm_too {
                    continue;
                }
                for &shape in &shapes {
                    specs.push(DwSpec {
                        isa,
                        layout,
                        shape,
                        ymm,
                        dtype: Dt::F32,
                    });
                }
            }
        }
        // AVX-512: 8-lane too (fewer loads split across cache lines).
        let ymms: &[bool] = match isa {
            Isa::Avx512 => &[false, true],
            Isa::Avx2 => &[false],
            _ => &[],
        };
        for &ymm in ymms {
            specs.push(DwSpec {
                isa,
                layout: DwLayout::Flat,
                shape: None,
                ymm,
                dtype: Dt::F32,
            });
        }
    }
    specs
}

/// The 16-bit depthwise kernels (f16 and bf16 tensors, f32 arithmetic), for the memory-bound
/// layers where half the bytes pay: the NHWC kernels of every shape of [`DW_SHAPES`] and the
/// generic NHWC kernel at AVX2 and AVX-512; the NCHW ones at AVX-512 only; at the scalar level
/// (the fallback everywhere), the generic kernels only. Other shapes and ISAs convert tiles of
/// rows around the f32 kernels.
///
/// No NCHW kernels at AVX2: it has no 16-bit masked loads, so every load at a row's edge goes
/// through a copy a value at a time, and edges are much of a plane's loads (one thread, Zen 4
/// at `--isa avx2`, f16 as a fraction of f32, 16-bit kernel against converted tiles:
/// mobilenetv2_dw3x3_28 0.16x, dw3x3_112 0.54x, convnext_t_dw7x7_28 0.18x / 0.92x,
/// efficientnet_dw5x5_28 0.17x / 0.85x). NHWC kernels mask only the channels' tail: 0.92-0.95x.
pub fn dw_half() -> Vec<DwSpec> {
    let mut specs = Vec::new();
    for dtype in [Dt::F16, Dt::Bf16] {
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512] {
            for layout in [DwLayout::Nchw, DwLayout::Nhwc] {
                if (isa, layout) == (Isa::Avx2, DwLayout::Nchw) {
                    continue;
                }
                let fixed: &[(usize, usize)] = match (isa, layout) {
                    (Isa::Scalar, _) => &[],
                    (_, DwLayout::Nchw | DwLayout::Nhwc) => DW_SHAPES,
                    (_, DwLayout::Flat) => unreachable!("no 16-bit flat kernels"),
                };
                for shape in fixed.iter().map(|&s| Some(s)).chain([None]) {
                    specs.push(DwSpec {
                        isa,
                        layout,
                        shape,
                        ymm: false,
                        dtype,
                    });
                }
            }
        }
    }
    specs
}

/// One f32 direct (dense or grouped) NCHW kernel: a fixed square `(kernel, stride)`,
/// dilation 1, summing over any number of input channels.
#[derive(Clone, Copy, Debug)]
pub struct DirectSpec {
    pub isa: Isa,
    pub shape: (usize, usize),
    /// Output channels a call computes.
    pub ocb: usize,
}

impl DirectSpec {
    pub fn name(&self) -> String {
        let (k, s) = self.shape;
        format!(
            "direct_f32_k{k}s{s}_oc{}_nchw_{}",
            self.ocb,
            self.isa.suffix()
        )
    }
}

/// The shapes that get a direct kernel: the grouped 3x3 of ResNeXt, the stride-2 stems of
/// MobileNet (3x3) and ResNet (7x7), ConvNeXt's 4x4 stride-4 patchify stem. Other
/// convolutions take im2col + GEMM.
pub const DIRECT_SHAPES: &[(usize, usize)] = &[(3, 1), (3, 2), (7, 2), (4, 4)];

/// The f32 direct kernels: every shape of [`DIRECT_SHAPES`] for every ISA, computing 4 output
/// channels a call (for groups of 4, as ResNeXt's) and, with 32 registers, 8 (2 rows) and 16
/// (1 row): for wider groups and stems that divides the loads and the stride-2 and stride-4
/// shuffles a multiply-add by 2 and 4 (stems 1.0-1.1x over 8 channels at AVX-512; NEON's
/// choice of 16 is not measured).
pub fn direct_f32() -> Vec<DirectSpec> {
    let mut specs = Vec::new();
    for isa in Isa::ALL {
        let blocks: &[usize] = match isa {
            Isa::Avx512 | Isa::Neon => &[4, 8, 16],
            Isa::Avx2 | Isa::Scalar => &[4],
        };
        for &shape in DIRECT_SHAPES {
            for &ocb in blocks {
                specs.push(DirectSpec { isa, shape, ocb });
            }
        }
    }
    specs
}

/// One Winograd tile size F(m, 3) and the finite interpolation points its Cook–Toom
/// matrices are built from (`(numerator, denominator)`; infinity is always the last point).
#[derive(Clone, Copy, Debug)]
pub struct WinoSpec {
    pub m: usize,
    pub points: &'static [(i64, i64)],
}

/// The Winograd tile sizes. Points are the smallest magnitudes there are, in `±a` pairs (which
/// halves the transforms' work, see `winograd.rs`) and, for F(6,3), with `±1/2` beside `±2`:
/// reciprocal pairs keep the powers in `At` and `G` balanced (Barabasz et al., "Error analysis
/// and improving the accuracy of Winograd convolution", 2020), so the error grows the least
/// with the tile. Integral points keep `Bt` integral. F(5,3) has room for one point past
/// `0, ±1, ±2`: `1/2` (in a float32 model of the 2-D transform at 64 input channels its error
/// was 8e-6, against 1.4e-5 for `-1/2` and 1.9e-5 to 2.8e-5 for `±1/2` with `2` or `-2`).
pub const WINO_TILES: &[WinoSpec] = &[
    WinoSpec {
        m: 2,
        points: &[(0, 1), (1, 1), (-1, 1)],
    },
    WinoSpec {
        m: 4,
        points: &[(0, 1), (1, 1), (-1, 1), (2, 1), (-2, 1)],
    },
    WinoSpec {
        m: 5,
        points: &[(0, 1), (1, 1), (-1, 1), (2, 1), (-2, 1), (1, 2)],
    },
    WinoSpec {
        m: 6,
        points: &[(0, 1), (1, 1), (-1, 1), (2, 1), (-2, 1), (1, 2), (-1, 2)],
    },
];

/// A generated source file: its name and its formatted text.
pub struct Generated {
    pub file: &'static str,
    pub source: String,
}

/// What to generate: the ISAs (scalar is always in) and whether the int8 family is built.
/// `build.rs` makes it from convkit's cargo features (`avx2`, `avx512`, `neon`, `int8`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The ISA levels to emit kernels for; `Isa::Scalar` is added if missing.
    pub isas: Vec<Isa>,
    /// Emit the int8 GEMM and depthwise kernels.
    pub int8: bool,
    /// Emit the 16-bit (f16, bf16) depthwise kernels.
    pub half: bool,
}

impl Selection {
    /// Everything: every ISA and every family.
    pub fn all() -> Self {
        Selection {
            isas: Isa::ALL.to_vec(),
            int8: true,
            half: true,
        }
    }

    /// True if kernels of `isa` are emitted.
    pub fn has(&self, isa: Isa) -> bool {
        isa == Isa::Scalar || self.isas.contains(&isa)
    }
}

/// Every generated file, for every ISA and family.
pub fn generate() -> Vec<Generated> {
    generate_selected(&Selection::all())
}

/// The generated files for `sel`: the kernels of its ISAs and families only. The int8 files
/// are left out when `sel.int8` is false (convkit then compiles without its int8 module).
pub fn generate_selected(sel: &Selection) -> Vec<Generated> {
    let gemm: Vec<GemmSpec> = GEMM_F32
        .iter()
        .copied()
        .filter(|s| sel.has(s.isa))
        .collect();
    let half = if sel.half { dw_half() } else { Vec::new() };
    let dw: Vec<DwSpec> = [dw_f32(), half]
        .concat()
        .into_iter()
        .filter(|s| sel.has(s.isa))
        .collect();
    let direct: Vec<DirectSpec> = direct_f32()
        .into_iter()
        .filter(|s| sel.has(s.isa))
        .collect();
    let isas: Vec<Isa> = Isa::ALL.into_iter().filter(|&i| sel.has(i)).collect();
    let mut files = vec![
        Generated {
            file: "gemm_f32.rs",
            source: format_file(gemm::emit_all(&gemm)),
        },
        Generated {
            file: "dw_f32.rs",
            source: format_file(depthwise::emit_all(&dw, &direct)),
        },
        Generated {
            file: "wino_f32.rs",
            source: format_file(winograd::emit_all(WINO_TILES, &isas)),
        },
        Generated {
            file: "layout.rs",
            source: format_file(layout::emit_all()),
        },
    ];
    if sel.int8 {
        let q: Vec<QGemmSpec> = QGEMM.iter().copied().filter(|s| sel.has(s.isa)).collect();
        let qdw: &[(usize, usize)] = if sel.has(Isa::Avx512) {
            QDW_SHAPES
        } else {
            &[]
        };
        files.push(Generated {
            file: "qgemm_i8.rs",
            source: format_file(qgemm::emit_all(&q)),
        });
        files.push(Generated {
            file: "qdw_i8.rs",
            source: format_file(qdw::emit_all(qdw)),
        });
    }
    files
}

fn format_file(tokens: TokenStream) -> String {
    let file: syn::File = syn::parse2(tokens).expect("generated code parses");
    let header = "// @generated by convkit's codegen crate from its kernel table. Do not edit.\n\n";
    format!("{header}{}", prettyplease::unparse(&file))
}

/// An integer literal without a type suffix, so the generated code reads like hand-written code.
fn lit(x: usize) -> Literal {
    Literal::usize_unsuffixed(x)
}

/// The registry entry of a GEMM kernel.
fn registry_entry(name: &str, isa: Isa, fields: TokenStream) -> TokenStream {
    let ident = format_ident!("{}", name);
    registry_entry_with("GemmKernel", name, isa, quote!(#ident), fields)
}

/// The registry entry a generated kernel gets (a `ty` struct literal): `src/cpu/` turns these
/// into its dispatch table.
fn registry_entry_with(
    ty: &str,
    name: &str,
    isa: Isa,
    func: TokenStream,
    fields: TokenStream,
) -> TokenStream {
    let cfg = isa.cfg();
    let ty = format_ident!("{}", ty);
    let variant = isa.variant();
    quote! {
        #cfg
        #ty {
            name: #name,
            isa: crate::cpu::Isa::#variant,
            func: #func,
            #fields
        },
    }
}
