//! Layout kernels: the 8x8 transposes (GEMM packing, Winograd and the backward passes; over
//! row pointers, the blocked NCHW depthwise mode at AVX2) and the masked 16x16 one that moves
//! rows of channel planes into pixels of channels and back in the blocked mode at AVX-512.

use crate::lit;
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// The first two stages of both transpose networks, on `n` rows `r0..` of the vector type
/// whose intrinsics start with `prefix`: pairs of rows interleaved (`t`), then pairs of pairs
/// within each 128-bit lane (`u`).
fn pairs_in_lanes(n: usize, prefix: &str) -> (TokenStream, TokenStream) {
    let id = |p: &str, i: usize| format_ident!("{p}{i}");
    let op = |name: &str| format_ident!("{prefix}_{name}");
    let (lo_op, hi_op, shuf_op) = (op("unpacklo_ps"), op("unpackhi_ps"), op("shuffle_ps"));
    let unpacks = (0..n / 2).map(|i| {
        let (a, b) = (id("r", 2 * i), id("r", 2 * i + 1));
        let (lo, hi) = (id("t", 2 * i), id("t", 2 * i + 1));
        quote! {
            let #lo = #lo_op(#a, #b);
            let #hi = #hi_op(#a, #b);
        }
    });
    // u(4h + 2p + q) from t(4h + p) and t(4h + p + 2), low (q = 0) or high (q = 1) pairs.
    let shuffles = (0..n).map(|i| {
        let (h, p, q) = (i / 4, i / 2 % 2, i % 2);
        let (a, b) = (id("t", 4 * h + p), id("t", 4 * h + p + 2));
        let u = id("u", i);
        let imm = lit(if q == 0 { 0x44 } else { 0xEE });
        quote!(let #u = #shuf_op::<#imm>(#a, #b);)
    });
    (quote!(#(#unpacks)*), quote!(#(#shuffles)*))
}

/// The AVX2 8x8 transpose network: rows loaded with `load(i)`, row `j` of the transpose stored
/// with `store(j, value)`.
fn avx2_network(
    load: impl Fn(usize) -> TokenStream,
    store: impl Fn(usize, TokenStream) -> TokenStream,
) -> TokenStream {
    let id = |p: &str, i: usize| format_ident!("{p}{i}");
    let loads = (0..8).map(|i| {
        let (r, addr) = (id("r", i), load(i));
        quote!(let #r = _mm256_loadu_ps(#addr);)
    });
    let (unpacks, shuffles) = pairs_in_lanes(8, "_mm256");
    let stores = (0..8).map(|j| {
        let (a, b) = (id("u", j % 4), id("u", j % 4 + 4));
        let imm = lit(if j < 4 { 0x20 } else { 0x31 });
        store(j, quote!(_mm256_permute2f128_ps::<#imm>(#a, #b)))
    });
    quote! {
        use core::arch::x86_64::*;
        #(#loads)*
        // Pairs of rows interleaved, then pairs of pairs, then 128-bit halves exchanged.
        #unpacks
        #shuffles
        #(#stores)*
    }
}

/// The AVX-512 16x16 transpose network, as [`avx2_network`]: pairs of rows interleaved and pairs
/// of pairs within each 128-bit lane, which leaves lane `l` of `u(4h + m)` holding column
/// `4l + m` of rows `4h..4h+4`; two rounds of 128-bit lane shuffles then gather each column's
/// four lanes.
fn avx512_network(
    load: impl Fn(usize) -> TokenStream,
    store: impl Fn(usize, TokenStream) -> TokenStream,
) -> TokenStream {
    let id = |p: &str, i: usize| format_ident!("{p}{i}");
    let loads = (0..16).map(|i| {
        let (r, row) = (id("r", i), load(i));
        quote!(let #r = #row;)
    });
    let (unpacks, shuffles) = pairs_in_lanes(16, "_mm512");
    // v(4m + k): lanes (0, 1) or (2, 3) (k even or odd) of u(m + 8(k / 2)) and u(m + 8(k / 2) + 4).
    let halves = (0..16).map(|i| {
        let (m, k) = (i / 4, i % 4);
        let (a, b) = (id("u", m + 8 * (k / 2)), id("u", m + 8 * (k / 2) + 4));
        let v = id("v", i);
        let imm = lit(if k % 2 == 0 { 0x44 } else { 0xEE });
        quote!(let #v = _mm512_shuffle_f32x4::<#imm>(#a, #b);)
    });
    // Row 4l + m: lane l of u(m), u(4 + m), u(8 + m), u(12 + m), from the even (l = 0, 2) or
    // odd (l = 1, 3) lanes of v(4m + l / 2) and v(4m + 2 + l / 2).
    let stores = (0..16).map(|j| {
        let (l, m) = (j / 4, j % 4);
        let (a, b) = (id("v", 4 * m + l / 2), id("v", 4 * m + 2 + l / 2));
        let imm = lit(if l % 2 == 0 { 0x88 } else { 0xDD });
        store(j, quote!(_mm512_shuffle_f32x4::<#imm>(#a, #b)))
    });
    quote! {
        use core::arch::x86_64::*;
        #(#loads)*
        #unpacks
        #shuffles
        #(#halves)*
        #(#stores)*
    }
}

/// `transpose_8x8_<isa>` (rows `ss` and `ds` floats apart) and `transpose_rows_8x8_<isa>`
/// (rows anywhere, through two arrays of row pointers) for the ISAs that have a vector one
/// (AVX2, used at AVX-512 too), the scalar ones, the masked 16x16 transpose of AVX-512, and
/// their registries.
pub fn emit_all() -> TokenStream {
    let doc = " dst[j][i] = src[i][j] for an 8x8 block: rows of `src` are `ss` floats apart, rows \
               of `dst` `ds` floats apart.\n\n # Safety\n The CPU has the ISA; `src` holds 8 rows \
               of 8 readable floats, `dst` 8 rows of 8 writable ones, not overlapping them.";
    let rows_doc =
        " dst[j][i] = src[i][j] for an 8x8 block whose rows lie anywhere: row `i` of the \
               source at `src[i]`, row `j` of the transpose at `dst[j]`.\n\n # Safety\n The CPU \
               has the ISA; each `src[i]` holds 8 readable floats, each `dst[j]` 8 writable ones, \
               none overlapping a source row.";
    let strided = avx2_network(
        |i| {
            let i = lit(i);
            quote!(src.add(#i * ss))
        },
        |j, v| {
            let j = lit(j);
            quote!(_mm256_storeu_ps(dst.add(#j * ds), #v);)
        },
    );
    let rows = avx2_network(
        |i| {
            let i = lit(i);
            quote!(src[#i])
        },
        |j, v| {
            let j = lit(j);
            quote!(_mm256_storeu_ps(dst[#j], #v);)
        },
    );
    // Rows past `r` (`c`) get an empty mask: masked-off lanes neither load nor store and do
    // not fault, so their wrapping addresses are never touched.
    let masked16 = avx512_network(
        |i| {
            let i = lit(i);
            quote!(_mm512_maskz_loadu_ps(if #i < r { lanes_c } else { 0 }, src.wrapping_add(#i * ss)))
        },
        |j, v| {
            let j = lit(j);
            quote!(_mm512_mask_storeu_ps(dst.wrapping_add(#j * ds), if #j < c { lanes_r } else { 0 }, #v);)
        },
    );
    let masked_doc = " dst[j][i] = src[i][j] for i < r, j < c (r, c at most 16): rows of `src` \
                      are `ss` floats apart, rows of `dst` `ds` floats apart; nothing else is \
                      read or written.\n\n # Safety\n The CPU has AVX-512F; `src` holds `r` \
                      rows of `c` readable floats, `dst` `c` rows of `r` writable ones, not \
                      overlapping them.";
    quote! {
        /// An 8x8 transpose kernel.
        pub type Transpose8x8 = unsafe fn(src: *const f32, ss: usize, dst: *mut f32, ds: usize);
        /// An 8x8 transpose kernel over rows given by pointers.
        pub type TransposeRows8x8 = unsafe fn(src: &[*const f32; 8], dst: &[*mut f32; 8]);

        #[doc = #doc]
        pub unsafe fn transpose_8x8_scalar(src: *const f32, ss: usize, dst: *mut f32, ds: usize) {
            for i in 0..8 {
                for j in 0..8 {
                    *dst.add(j * ds + i) = *src.add(i * ss + j);
                }
            }
        }

        #[doc = #rows_doc]
        pub unsafe fn transpose_rows_8x8_scalar(src: &[*const f32; 8], dst: &[*mut f32; 8]) {
            for i in 0..8 {
                for j in 0..8 {
                    *dst[j].add(i) = *src[i].add(j);
                }
            }
        }

        #[doc = #doc]
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn transpose_8x8_avx2(src: *const f32, ss: usize, dst: *mut f32, ds: usize) {
            #strided
        }

        #[doc = #rows_doc]
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn transpose_rows_8x8_avx2(src: &[*const f32; 8], dst: &[*mut f32; 8]) {
            #rows
        }

        /// A masked transpose kernel of at most 16x16: `(src, ss, dst, ds, r, c)`.
        pub type TransposeMasked16 = unsafe fn(src: *const f32, ss: usize, dst: *mut f32, ds: usize, r: usize, c: usize);

        #[doc = #masked_doc]
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn transpose_16x16_masked_avx512(src: *const f32, ss: usize, dst: *mut f32, ds: usize, r: usize, c: usize) {
            let lanes_c = ((1u32 << c) - 1) as u16;
            let lanes_r = ((1u32 << r) - 1) as u16;
            #masked16
        }

        /// The masked 16x16 transposes compiled for this target, by the ISA each needs.
        pub static TRANSPOSE_MASKED_16: &[(crate::cpu::Isa, TransposeMasked16)] = &[
            #[cfg(target_arch = "x86_64")]
            (crate::cpu::Isa::Avx512, transpose_16x16_masked_avx512),
        ];

        /// The 8x8 transposes compiled for this target, by the lowest ISA each needs.
        pub static TRANSPOSE_8X8: &[(crate::cpu::Isa, Transpose8x8)] = &[
            (crate::cpu::Isa::Scalar, transpose_8x8_scalar),
            #[cfg(target_arch = "x86_64")]
            (crate::cpu::Isa::Avx2, transpose_8x8_avx2),
        ];

        /// The 8x8 transposes over row pointers compiled for this target, by the lowest ISA
        /// each needs.
        pub static TRANSPOSE_ROWS_8X8: &[(crate::cpu::Isa, TransposeRows8x8)] = &[
            (crate::cpu::Isa::Scalar, transpose_rows_8x8_scalar),
            #[cfg(target_arch = "x86_64")]
            (crate::cpu::Isa::Avx2, transpose_rows_8x8_avx2),
        ];
    }
}
