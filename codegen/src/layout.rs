//! Layout kernels: the 8x8 transpose that moves blocks of channel planes into pixels of
//! channels and back (the blocked NCHW depthwise mode).

use crate::lit;
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

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
    let unpacks = (0..4).map(|i| {
        let (a, b) = (id("r", 2 * i), id("r", 2 * i + 1));
        let (lo, hi) = (id("t", 2 * i), id("t", 2 * i + 1));
        quote! {
            let #lo = _mm256_unpacklo_ps(#a, #b);
            let #hi = _mm256_unpackhi_ps(#a, #b);
        }
    });
    // u(4h + 2p + q) from t(4h + p) and t(4h + p + 2), low (q = 0) or high (q = 1) pairs.
    let shuffles = (0..8).map(|i| {
        let (h, p, q) = (i / 4, i / 2 % 2, i % 2);
        let (a, b) = (id("t", 4 * h + p), id("t", 4 * h + p + 2));
        let u = id("u", i);
        let imm = lit(if q == 0 { 0x44 } else { 0xEE });
        quote!(let #u = _mm256_shuffle_ps::<#imm>(#a, #b);)
    });
    let stores = (0..8).map(|j| {
        let (a, b) = (id("u", j % 4), id("u", j % 4 + 4));
        let imm = lit(if j < 4 { 0x20 } else { 0x31 });
        store(j, quote!(_mm256_permute2f128_ps::<#imm>(#a, #b)))
    });
    quote! {
        use core::arch::x86_64::*;
        #(#loads)*
        // Pairs of rows interleaved, then pairs of pairs, then 128-bit halves exchanged.
        #(#unpacks)*
        #(#shuffles)*
        #(#stores)*
    }
}

/// `transpose_8x8_<isa>` (rows `ss` and `ds` floats apart) and `transpose_rows_8x8_<isa>`
/// (rows anywhere, through two arrays of row pointers) for the ISAs that have a vector one
/// (AVX2, used at AVX-512 too), the scalar ones, and their registries.
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
