//! The int8 GEMM microkernel emitter.
//!
//! A microkernel computes an `mr` x `nr` tile of `C = A·B` in i32, exactly: A is the
//! activations (u8), `mr` pixels read through row pointers (im2col rows, or the input itself
//! for 1x1 NHWC), B the weights (i8, or i16 for the widening kernels), packed at create time
//! in panels of `nr` output channels; K goes in groups of 4 ("quads"): a B panel holds, per
//! quad, `nr` channels of 4 weights. Then the epilogue, in registers: the channel's i32 bias
//! (which also folds out the input zero point), and one of three outputs: the i32 sums; f32
//! (times a per-channel scale); or u8/i8 requantised (times a per-channel multiplier,
//! clamped, rounded half to even, plus the zero point). Partial tiles go through a stack tile
//! and `crate::algo::qgemm::store_edge`, which does the same arithmetic in scalar code.
//!
//! # Exactness: how no kernel saturates
//!
//! Every product `u8 x i8` is at most `255 * 128 = 32640` in magnitude. The kernels never
//! let two of them meet in 16 bits, which is where AVX2's `vpmaddubsw` saturates (two
//! products of `255 * 127` sum to 64770 > 32767):
//! - **VNNI** (`vpdpbusd`) multiplies u8 by i8 and sums four products straight into i32;
//! - **the widening kernels** (AVX2, AVX-512BW, NEON) widen both operands to i16 first and
//!   sum pairs into i32 (`vpmaddwd`, `smlal`), where a pair is at most 65280;
//! - **scalar** multiplies in i32.
//!
//! So the i32 sums are exact as long as they fit in i32, which `QConv2d::new` checks for
//! every channel from K, the bias and the zero point before it accepts the weights.

use crate::simd::Simd;
use crate::{lit, Isa};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// How a kernel multiplies: the instruction family of its inner loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QMul {
    /// Plain i32 multiply-adds (scalar).
    Scalar,
    /// Both operands widened to i16, pairs summed into i32 (`vpmaddwd`, NEON `smlal`).
    Widen16,
    /// AVX-512 VNNI `vpdpbusd`: four u8 x i8 products summed into i32.
    Vnni,
}

/// One int8 GEMM microkernel: an `mr` x `nr` tile.
#[derive(Clone, Copy, Debug)]
pub struct QGemmSpec {
    pub isa: Isa,
    pub mul: QMul,
    pub mr: usize,
    pub nr: usize,
}

impl QGemmSpec {
    pub fn name(&self) -> String {
        let isa = match self.mul {
            QMul::Vnni => "avx512vnni",
            _ => self.isa.suffix(),
        };
        format!("qgemm_u8i8_{}x{}_{isa}", self.mr, self.nr)
    }

    /// Bytes of one B element: the widening kernels take their weights as i16.
    pub fn b_bytes(&self) -> usize {
        match self.mul {
            QMul::Widen16 => 2,
            _ => 1,
        }
    }
}

/// The int8 GEMM microkernels (`mr` pixels x `nr` output channels). Register budgets:
/// AVX2 6x8: 12 ymm of (channel, pair) sums + 2 B + 1 broadcast A + 1 product = 16.
/// AVX-512BW 8x16: 16 zmm accumulators. VNNI 8x32: 16 zmm accumulators of 16 channels each;
/// a quad costs two 64-byte B loads and eight broadcasts for sixteen `vpdpbusd`.
/// NEON 4x4: 16 q accumulators of one channel's four products each.
pub const QGEMM: &[QGemmSpec] = &[
    QGemmSpec {
        isa: Isa::Scalar,
        mul: QMul::Scalar,
        mr: 4,
        nr: 8,
    },
    QGemmSpec {
        isa: Isa::Avx2,
        mul: QMul::Widen16,
        mr: 6,
        nr: 8,
    },
    QGemmSpec {
        isa: Isa::Avx512,
        mul: QMul::Widen16,
        mr: 8,
        nr: 16,
    },
    QGemmSpec {
        isa: Isa::Avx512,
        mul: QMul::Vnni,
        mr: 8,
        nr: 32,
    },
    QGemmSpec {
        isa: Isa::Neon,
        mul: QMul::Widen16,
        mr: 4,
        nr: 4,
    },
];

/// All int8 GEMM kernels and their registry.
pub fn emit_all(specs: &[QGemmSpec]) -> TokenStream {
    let kernels = specs.iter().map(|s| match s.mul {
        QMul::Scalar => emit_scalar(s),
        _ => emit_simd(s),
    });
    let entries = specs.iter().map(|s| {
        let name = s.name();
        let f = format_ident!("{}", name);
        let cfg = s.isa.cfg();
        let variant = s.isa.variant();
        let (mr, nr, b_bytes) = (s.mr, s.nr, s.b_bytes());
        let vnni = s.mul == QMul::Vnni;
        quote! {
            #cfg
            QGemmKernel {
                name: #name,
                isa: crate::cpu::Isa::#variant,
                vnni: #vnni,
                func: #f,
                mr: #mr,
                nr: #nr,
                b_bytes: #b_bytes,
            },
        }
    });
    quote! {
        // QMode is used by the SIMD kernels only (absent in a scalar-only build).
        #[allow(unused_imports)]
        use crate::algo::qgemm::{store_edge, QEpilogue, QGemmKernel, QMode};

        #(#kernels)*

        /// Every int8 GEMM microkernel compiled for this target, from the generator's table.
        pub static QGEMM_KERNELS: &[QGemmKernel] = &[#(#entries)*];
    }
}

fn doc(spec: &QGemmSpec) -> String {
    format!(
        " {}x{} int8 GEMM microkernel: C[m x n] = A (u8 rows) · B-panel (i{}) over `kq` quads \
         of K, exact in i32, then the epilogue.\n\n # Safety\n The CPU must have the ISA \
         (`{}`); `a_rows` holds {} row pointers, each readable for `4*kq` bytes; `b` holds \
         `kq*{}` readable bytes; `c` is valid for `m <= {}` rows `rs_c` elements apart and \
         `n <= {}` contiguous columns, of the element type of `ep.mode`; on a full tile \
         `ep.bias` and `ep.scale` hold {} values, else `n`.",
        spec.mr,
        spec.nr,
        8 * spec.b_bytes(),
        spec.name(),
        spec.mr,
        4 * spec.nr * spec.b_bytes(),
        spec.mr,
        spec.nr,
        spec.nr,
    )
}

/// The pieces of a SIMD kernel that differ by ISA and multiply.
struct QOps {
    v: Simd,
    /// i32 lanes of a vector.
    lanes: usize,
    ity: TokenStream,
    /// Output channels one B load covers.
    ch_per_load: usize,
    /// Accumulators one B load feeds (NEON: one a channel).
    accs_per_load: usize,
    /// Statements loading B vector `j` from `b` as `b{j}` (or its parts `b{j}_{t}`).
    load_b: fn(usize) -> TokenStream,
    /// `bcast_a(ptr)`: one pixel's quad of activations in every lane (widened where the
    /// kernel widens).
    bcast_a: fn(TokenStream) -> TokenStream,
    /// The B operand of accumulator `j` of a row.
    b_of: fn(usize) -> TokenStream,
    /// `dot(acc, a, b)`.
    dot: fn(TokenStream, TokenStream, TokenStream) -> TokenStream,
    /// Reduces one row's accumulators to vectors of one i32 sum a channel, `lanes` each.
    reduce: fn(&[TokenStream]) -> Vec<TokenStream>,
    set1_i32: TokenStream,
    set1_f32: TokenStream,
    load_i32: fn(TokenStream) -> TokenStream,
    load_f32: TokenStream,
    add_i32: TokenStream,
    cvt_f32: TokenStream,
    mul_f32: TokenStream,
    min_f32: TokenStream,
    max_f32: TokenStream,
    cvt_round_i32: TokenStream,
    store_i32: fn(TokenStream, TokenStream) -> TokenStream,
    store_f32: fn(TokenStream, TokenStream) -> TokenStream,
    /// Stores the low byte of every i32 lane (values already clamped to the byte's range).
    store_bytes: fn(TokenStream, TokenStream) -> TokenStream,
}

fn ident_b(j: usize) -> TokenStream {
    let b = format_ident!("b{}", j);
    quote!(#b)
}

fn ops(spec: &QGemmSpec) -> QOps {
    let v = crate::simd::simd(spec.isa);
    match (spec.isa, spec.mul) {
        (Isa::Avx2, QMul::Widen16) => QOps {
            v,
            lanes: 8,
            ity: quote!(__m256i),
            ch_per_load: 4,
            accs_per_load: 1,
            // Four channels' quads of i16 weights.
            load_b: |j| {
                let (b, off) = (format_ident!("b{}", j), lit(32 * j));
                quote!(let #b = _mm256_loadu_si256(b.add(#off) as *const __m256i);)
            },
            // The pixel's four bytes, widened to i16 and repeated across the vector.
            bcast_a: |p| quote!(_mm256_cvtepu8_epi16(_mm_set1_epi32((#p as *const i32).read_unaligned()))),
            b_of: ident_b,
            dot: |acc, a, b| quote!(_mm256_add_epi32(#acc, _mm256_madd_epi16(#a, #b))),
            // Lanes hold (channel, pair) sums: [c0 c0 c1 c1 | c2 c2 c3 c3] a load. hadd gives
            // [c0 c1 d0 d1 | c2 c3 d2 d3]; the permute puts the 64-bit halves in order.
            reduce: |accs| {
                accs.chunks(2)
                    .map(|c| {
                        let (x, y) = (&c[0], &c[1]);
                        quote!(_mm256_permute4x64_epi64(_mm256_hadd_epi32(#x, #y), 0xD8))
                    })
                    .collect()
            },
            set1_i32: quote!(_mm256_set1_epi32),
            set1_f32: quote!(_mm256_set1_ps),
            load_i32: |p| quote!(_mm256_loadu_si256(#p as *const __m256i)),
            load_f32: quote!(_mm256_loadu_ps),
            add_i32: quote!(_mm256_add_epi32),
            cvt_f32: quote!(_mm256_cvtepi32_ps),
            mul_f32: quote!(_mm256_mul_ps),
            min_f32: quote!(_mm256_min_ps),
            max_f32: quote!(_mm256_max_ps),
            cvt_round_i32: quote!(_mm256_cvtps_epi32),
            store_i32: |p, x| quote!(_mm256_storeu_si256(#p as *mut __m256i, #x)),
            store_f32: |p, x| quote!(_mm256_storeu_ps(#p, #x)),
            store_bytes: |p, x| {
                quote! {{
                    let lo = _mm256_shuffle_epi8(#x, _mm256_setr_epi8(
                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
                    let packed = _mm256_permutevar8x32_epi32(lo, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
                    _mm_storel_epi64(#p as *mut __m128i, _mm256_castsi256_si128(packed));
                }}
            },
        },
        (Isa::Avx512, QMul::Widen16) | (Isa::Avx512, QMul::Vnni) => {
            let vnni = spec.mul == QMul::Vnni;
            QOps {
                v: Simd {
                    feature: Some(if vnni {
                        "avx512f,avx512bw,avx512vnni"
                    } else {
                        "avx512f,avx512bw"
                    }),
                    ..v
                },
                lanes: 16,
                ity: quote!(__m512i),
                ch_per_load: if vnni { 16 } else { 8 },
                accs_per_load: 1,
                load_b: |j| {
                    let (b, off) = (format_ident!("b{}", j), lit(64 * j));
                    quote!(let #b = _mm512_loadu_si512(b.add(#off) as *const __m512i);)
                },
                bcast_a: if vnni {
                    |p| quote!(_mm512_set1_epi32((#p as *const i32).read_unaligned()))
                } else {
                    |p| quote!(_mm512_cvtepu8_epi16(_mm256_set1_epi32((#p as *const i32).read_unaligned())))
                },
                b_of: ident_b,
                // vpdpbusd: the first operand is the unsigned one (A, the activations).
                dot: if vnni {
                    |acc, a, b| quote!(_mm512_dpbusd_epi32(#acc, #a, #b))
                } else {
                    |acc, a, b| quote!(_mm512_add_epi32(#acc, _mm512_madd_epi16(#a, #b)))
                },
                reduce: if vnni {
                    |accs| accs.to_vec()
                } else {
                    // Each 64-bit lane holds one channel's two pair sums: add them into its
                    // low half, then gather the low halves of two vectors.
                    |accs| {
                        accs.chunks(2)
                            .map(|c| {
                                let (x, y) = (&c[0], &c[1]);
                                quote!(_mm512_permutex2var_epi32(
                                    _mm512_add_epi32(#x, _mm512_srli_epi64(#x, 32)),
                                    _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                                    _mm512_add_epi32(#y, _mm512_srli_epi64(#y, 32)),
                                ))
                            })
                            .collect()
                    }
                },
                set1_i32: quote!(_mm512_set1_epi32),
                set1_f32: quote!(_mm512_set1_ps),
                load_i32: |p| quote!(_mm512_loadu_si512(#p as *const __m512i)),
                load_f32: quote!(_mm512_loadu_ps),
                add_i32: quote!(_mm512_add_epi32),
                cvt_f32: quote!(_mm512_cvtepi32_ps),
                mul_f32: quote!(_mm512_mul_ps),
                min_f32: quote!(_mm512_min_ps),
                max_f32: quote!(_mm512_max_ps),
                cvt_round_i32: quote!(_mm512_cvtps_epi32),
                store_i32: |p, x| quote!(_mm512_storeu_si512(#p as *mut __m512i, #x)),
                store_f32: |p, x| quote!(_mm512_storeu_ps(#p, #x)),
                store_bytes: |p, x| quote!(_mm_storeu_si128(#p as *mut __m128i, _mm512_cvtepi32_epi8(#x))),
            }
        }
        (Isa::Neon, QMul::Widen16) => QOps {
            v,
            lanes: 4,
            ity: quote!(int32x4_t),
            ch_per_load: 2,
            accs_per_load: 2,
            // Two channels' quads of i16 weights, one half each.
            load_b: |j| {
                let (b, off) = (format_ident!("b{}", j), lit(16 * j));
                let (lo, hi) = (format_ident!("b{}_0", j), format_ident!("b{}_1", j));
                quote! {
                    let #b = vld1q_s16(b.add(#off) as *const i16);
                    let (#lo, #hi) = (vget_low_s16(#b), vget_high_s16(#b));
                }
            },
            bcast_a: |p| {
                quote!(vget_low_s16(vreinterpretq_s16_u16(vmovl_u8(vreinterpret_u8_u32(
                    vdup_n_u32((#p as *const u32).read_unaligned())
                )))))
            },
            b_of: |j| {
                let b = format_ident!("b{}_{}", j / 2, j % 2);
                quote!(#b)
            },
            dot: |acc, a, b| quote!(vmlal_s16(#acc, #b, #a)),
            // Each accumulator holds one channel's four products: pairwise adds, twice.
            reduce: |accs| {
                accs.chunks(4)
                    .map(|c| {
                        let (w, x, y, z) = (&c[0], &c[1], &c[2], &c[3]);
                        quote!(vpaddq_s32(vpaddq_s32(#w, #x), vpaddq_s32(#y, #z)))
                    })
                    .collect()
            },
            set1_i32: quote!(vdupq_n_s32),
            set1_f32: quote!(vdupq_n_f32),
            load_i32: |p| quote!(vld1q_s32(#p)),
            load_f32: quote!(vld1q_f32),
            add_i32: quote!(vaddq_s32),
            cvt_f32: quote!(vcvtq_f32_s32),
            mul_f32: quote!(vmulq_f32),
            min_f32: quote!(vminq_f32),
            max_f32: quote!(vmaxq_f32),
            cvt_round_i32: quote!(vcvtnq_s32_f32),
            store_i32: |p, x| quote!(vst1q_s32(#p, #x)),
            store_f32: |p, x| quote!(vst1q_f32(#p, #x)),
            store_bytes: |p, x| {
                quote! {{
                    let h = vmovn_s32(#x);
                    let b = vmovn_s16(vcombine_s16(h, h));
                    vst1_lane_u32::<0>(#p as *mut u32, vreinterpret_u32_s8(b));
                }}
            },
        },
        _ => unreachable!("no SIMD int8 kernel for {:?}", spec),
    }
}

/// The kernel's parameters (the same for every ISA).
fn params() -> TokenStream {
    quote! {
        kq: usize,
        a_rows: *const *const u8,
        b: *const u8,
        c: *mut u8,
        rs_c: isize,
        m: usize,
        n: usize,
        ep: &QEpilogue,
    }
}

fn emit_simd(spec: &QGemmSpec) -> TokenStream {
    let o = ops(spec);
    let (mr, nr) = (spec.mr, spec.nr);
    let loads = nr / o.ch_per_load;
    let accs_per_row = loads * o.accs_per_load;
    let name = format_ident!("{}", spec.name());
    let doc = doc(spec);
    let (attrs, uses) = (o.v.attrs(), o.v.uses());
    let ity = &o.ity;
    let params = params();
    let acc = |i: usize, j: usize| format_ident!("c{}_{}", i, j);
    let decls = (0..mr).flat_map(|i| {
        (0..accs_per_row).map(move |j| {
            let c = acc(i, j);
            quote!(let mut #c: #ity = core::mem::zeroed();)
        })
    });
    let rows = (0..mr).map(|i| {
        let (a, il) = (format_ident!("a{}", i), lit(i));
        quote!(let #a = *a_rows.add(#il);)
    });
    let b_loads = (0..loads).map(|j| (o.load_b)(j));
    let dots = (0..mr).map(|i| {
        let ai = format_ident!("a{}", i);
        let a = (o.bcast_a)(quote!(#ai.add(off)));
        let body = (0..accs_per_row).map(|j| {
            let c = acc(i, j);
            let d = (o.dot)(quote!(#c), quote!(a_i), (o.b_of)(j));
            quote!(#c = #d;)
        });
        quote! {
            let a_i = #a;
            #(#body)*
        }
    });
    // Per row, the reduced vectors: `lanes` channels each.
    let nv = nr / o.lanes;
    let red = |i: usize, v: usize| format_ident!("r{}_{}", i, v);
    let reduces = (0..mr).map(|i| {
        let accs: Vec<TokenStream> = (0..accs_per_row)
            .map(|j| {
                let c = acc(i, j);
                quote!(#c)
            })
            .collect();
        let exprs = (o.reduce)(&accs);
        assert_eq!(
            exprs.len(),
            nv,
            "{}: reduce yields whole vectors",
            spec.name()
        );
        let names = (0..nv).map(|v| red(i, v));
        quote!(#(let #names = #exprs;)*)
    });
    let (set1_i32, set1_f32, load_f32, add_i32, cvt_f32, mul_f32, min_f32, max_f32, cvt_round) = (
        &o.set1_i32,
        &o.set1_f32,
        &o.load_f32,
        &o.add_i32,
        &o.cvt_f32,
        &o.mul_f32,
        &o.min_f32,
        &o.max_f32,
        &o.cvt_round_i32,
    );
    let lanes = o.lanes;
    // The bias and scale of each vector of columns, loaded once for all rows.
    let col_consts = (0..nv).map(|v| {
        let (bv, sv, off) = (
            format_ident!("bias{}", v),
            format_ident!("scale{}", v),
            lit(v * lanes),
        );
        let load_bias = (o.load_i32)(quote!(ep.bias.add(#off)));
        quote! {
            let #bv = #load_bias;
            let #sv = #load_f32(ep.scale.add(#off));
        }
    });
    let consts = |v: usize| (format_ident!("bias{}", v), format_ident!("scale{}", v));
    // One row of the tile in one output mode: `row` is where the row's first column goes.
    let row_store = |i: usize, mode: &str| -> TokenStream {
        let body = (0..nv).map(|v| {
            let r = red(i, v);
            let off = lit(v * lanes);
            let (bv, sv) = consts(v);
            match mode {
                "i32" => {
                    let s = (o.store_i32)(
                        quote!((row as *mut i32).add(#off)),
                        quote!(#add_i32(#r, #bv)),
                    );
                    quote!(#s;)
                }
                "f32" => {
                    let s = (o.store_f32)(
                        quote!((row as *mut f32).add(#off)),
                        quote!(#mul_f32(#cvt_f32(#add_i32(#r, #bv)), #sv)),
                    );
                    quote!(#s;)
                }
                _ => {
                    let s = (o.store_bytes)(quote!(row.add(#off)), quote!(q));
                    quote! {
                        let f = #mul_f32(#cvt_f32(#add_i32(#r, #bv)), #sv);
                        let q = #add_i32(#cvt_round(#min_f32(#max_f32(f, lo), hi)), zp);
                        #s;
                    }
                }
            }
        });
        quote!(#(#body)*)
    };
    // Rows past `m` are not stored; a partial panel (`n < nr`) goes through a row buffer.
    let rows_of = |mode: &'static str, eb: usize| -> Vec<TokenStream> {
        let eb = lit(eb);
        (0..mr)
            .map(|i| {
                let il = lit(i);
                let body = row_store(i, mode);
                quote! {
                    if #il < m {
                        let dst = c.offset(#il * rs_c * #eb);
                        let row = if full { dst } else { buf.as_mut_ptr() as *mut u8 };
                        #body
                        if !full {
                            core::ptr::copy_nonoverlapping(row, dst, n * #eb);
                        }
                    }
                }
            })
            .collect()
    };
    let (rows_i32, rows_f32, rows_q8) = (rows_of("i32", 4), rows_of("f32", 4), rows_of("q8", 1));
    let nr_l = lit(nr);
    let b_step = lit(4 * nr * spec.b_bytes());
    quote! {
        #[doc = #doc]
        #attrs
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn #name(#params) {
            #uses
            #(#decls)*
            #(#rows)*
            let mut b = b;
            for q in 0..kq {
                let off = 4 * q;
                #(#b_loads)*
                #(#dots)*
                b = b.add(#b_step);
            }
            #(#reduces)*
            #(#col_consts)*
            let full = n == #nr_l;
            let mut buf = [0i32; #nr_l];
            match ep.mode {
                QMode::I32 => { #(#rows_i32)* }
                QMode::F32 => { #(#rows_f32)* }
                QMode::Q8 => {
                    let (lo, hi, zp) = (#set1_f32(ep.lo), #set1_f32(ep.hi), #set1_i32(ep.zero_point));
                    #(#rows_q8)*
                }
            }
        }
    }
}

fn emit_scalar(spec: &QGemmSpec) -> TokenStream {
    let name = format_ident!("{}", spec.name());
    let doc = doc(spec);
    let params = params();
    let tile_len = lit(spec.mr * spec.nr);
    let (mr, nr) = (lit(spec.mr), lit(spec.nr));
    quote! {
        #[doc = #doc]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn #name(#params) {
            let mut tile = [0i32; #tile_len];
            for i in 0..#mr {
                let a = *a_rows.add(i);
                for q in 0..kq {
                    let bp = b.add(q * 4 * #nr);
                    for j in 0..#nr {
                        let mut s = 0i32;
                        for t in 0..4 {
                            s += (*a.add(4 * q + t) as i32) * (*bp.add(4 * j + t) as i8 as i32);
                        }
                        tile[i * #nr + j] = tile[i * #nr + j].wrapping_add(s);
                    }
                }
            }
            store_edge(&tile, #nr, c, rs_c, m, n, ep);
        }
    }
}
