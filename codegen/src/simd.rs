//! How each ISA spells the vector operations the emitters need. The scalar ISA is a vector of
//! one lane (`f32` itself), so an emitter written against [`Simd`] yields its scalar kernel too.

use crate::{Dt, Isa};
use proc_macro2::TokenStream;
use quote::quote;

/// One ISA's vector type and operations, as tokens an emitter splices into its kernels.
pub struct Simd {
    pub isa: Isa,
    pub lanes: usize,
    /// The `core::arch` module to import (empty for scalar).
    pub arch: TokenStream,
    /// The `target_feature` a kernel needs (None for scalar).
    pub feature: Option<&'static str>,
    pub ty: TokenStream,
    pub zero: TokenStream,
    pub load: TokenStream,
    pub store: TokenStream,
    pub splat: TokenStream,
    pub add: TokenStream,
    pub sub: TokenStream,
    pub mul: TokenStream,
    pub min: TokenStream,
    pub max: TokenStream,
    /// `fma(acc, a, b)` = acc + a*b, whatever the argument order of the intrinsic.
    pub fma: fn(TokenStream, TokenStream, TokenStream) -> TokenStream,
    /// The type tensors (input, output, residual) are stored in: `load`, `store` and the
    /// helpers' partial loads and stores read and write it (f32, or the 16-bit types'
    /// bits, widened in registers on load and rounded on store).
    pub dt: Dt,
    /// The element type of those tensors (`f32` or `u16`) and its zero.
    pub elem: TokenStream,
    pub elem_zero: TokenStream,
    /// The load of an f32 vector (packed weights and bias), whatever `dt` is.
    pub wload: TokenStream,
}

impl Simd {
    /// `#[cfg]` and `#[target_feature]` of a kernel of this ISA.
    pub fn attrs(&self) -> TokenStream {
        let cfg = self.isa.cfg();
        match self.feature {
            Some(f) => quote!(#cfg #[target_feature(enable = #f)]),
            None => cfg,
        }
    }

    /// The `use` that brings the intrinsics into scope.
    pub fn uses(&self) -> TokenStream {
        let arch = &self.arch;
        if arch.is_empty() {
            quote!()
        } else {
            quote!(use #arch::*;)
        }
    }
}

pub fn simd(isa: Isa) -> Simd {
    let mut v = simd_f32(isa);
    v.wload = v.load.clone();
    v
}

/// The ISA's vectors over tensors stored as `dt` (f16 or bf16): `load` and `store` widen and
/// round in registers (`xload`, `xstore`, emitted by [`helpers`]); weights stay f32.
pub fn simd_half(isa: Isa, dt: Dt) -> Simd {
    let mut v = simd(isa);
    match isa {
        Isa::Avx2 => v.feature = Some("avx2,fma,f16c"),
        // 16-bit masked loads and stores.
        Isa::Avx512 => v.feature = Some("avx512f,avx512bw,avx512vl"),
        _ => {}
    }
    v.dt = dt;
    v.elem = quote!(u16);
    v.elem_zero = quote!(0u16);
    v.load = quote!(xload);
    v.store = quote!(xstore);
    v
}

fn simd_f32(isa: Isa) -> Simd {
    match isa {
        Isa::Scalar => Simd {
            isa,
            lanes: 1,
            arch: quote!(),
            feature: None,
            ty: quote!(f32),
            zero: quote!(0.0f32),
            load: quote!(core::ptr::read),
            store: quote!(core::ptr::write),
            splat: quote!(core::convert::identity),
            add: quote!(core::ops::Add::add),
            sub: quote!(core::ops::Sub::sub),
            mul: quote!(core::ops::Mul::mul),
            min: quote!(f32::min),
            max: quote!(f32::max),
            // Not `mul_add`: without FMA hardware that is a libm call.
            fma: |acc, a, b| quote!(#acc + #a * #b),
            dt: Dt::F32,
            elem: quote!(f32),
            elem_zero: quote!(0.0f32),
            wload: quote!(),
        },
        Isa::Avx2 => Simd {
            isa,
            lanes: 8,
            arch: quote!(core::arch::x86_64),
            feature: Some("avx2,fma"),
            ty: quote!(__m256),
            zero: quote!(_mm256_setzero_ps()),
            load: quote!(_mm256_loadu_ps),
            store: quote!(_mm256_storeu_ps),
            splat: quote!(_mm256_set1_ps),
            add: quote!(_mm256_add_ps),
            sub: quote!(_mm256_sub_ps),
            mul: quote!(_mm256_mul_ps),
            min: quote!(_mm256_min_ps),
            max: quote!(_mm256_max_ps),
            fma: |acc, a, b| quote!(_mm256_fmadd_ps(#a, #b, #acc)),
            dt: Dt::F32,
            elem: quote!(f32),
            elem_zero: quote!(0.0f32),
            wload: quote!(),
        },
        Isa::Avx512 => Simd {
            isa,
            lanes: 16,
            arch: quote!(core::arch::x86_64),
            feature: Some("avx512f"),
            ty: quote!(__m512),
            zero: quote!(_mm512_setzero_ps()),
            load: quote!(_mm512_loadu_ps),
            store: quote!(_mm512_storeu_ps),
            splat: quote!(_mm512_set1_ps),
            add: quote!(_mm512_add_ps),
            sub: quote!(_mm512_sub_ps),
            mul: quote!(_mm512_mul_ps),
            min: quote!(_mm512_min_ps),
            max: quote!(_mm512_max_ps),
            fma: |acc, a, b| quote!(_mm512_fmadd_ps(#a, #b, #acc)),
            dt: Dt::F32,
            elem: quote!(f32),
            elem_zero: quote!(0.0f32),
            wload: quote!(),
        },
        Isa::Neon => Simd {
            isa,
            lanes: 4,
            arch: quote!(core::arch::aarch64),
            feature: Some("neon"),
            ty: quote!(float32x4_t),
            zero: quote!(vdupq_n_f32(0.0)),
            load: quote!(vld1q_f32),
            store: quote!(vst1q_f32),
            splat: quote!(vdupq_n_f32),
            add: quote!(vaddq_f32),
            sub: quote!(vsubq_f32),
            mul: quote!(vmulq_f32),
            min: quote!(vminq_f32),
            max: quote!(vmaxq_f32),
            fma: |acc, a, b| quote!(vfmaq_f32(#acc, #a, #b)),
            dt: Dt::F32,
            elem: quote!(f32),
            elem_zero: quote!(0.0f32),
            wload: quote!(),
        },
    }
}

/// AVX-512 with 8-lane (ymm) vectors: AVX2's operations with AVX-512's 32 registers, masked
/// loads and stores, and broadcasts folded into the multiply-adds.
pub fn simd_ymm() -> Simd {
    Simd {
        feature: Some("avx512f,avx512vl,avx2,fma"),
        isa: Isa::Avx512,
        ..simd(Isa::Avx2)
    }
}

/// Helpers every kernel module of an ISA shares: loads and stores of part of a vector (for
/// the edges of an image, where whole vectors would read padding or write past a row), and the
/// even lanes of two vectors (stride-2 kernels). They go inside the ISA's module, after its
/// `use`; each is inlined into the kernels, which have the same target features.
pub fn helpers(v: &Simd) -> TokenStream {
    let attrs = v.attrs();
    let ty = &v.ty;
    let lanes = proc_macro2::Literal::isize_unsuffixed(v.lanes as isize);
    // Per ISA: the mask type, the mask of lanes `lo..hi`, a load under a mask, a store of the
    // first `n` lanes, and the even lanes of two vectors.
    let (mask_ty, part_mask, load_masked, store_part, evens) = match (v.isa, v.lanes) {
        (Isa::Scalar, _) => (
            quote!(bool),
            quote!(lo <= 0 && 0 < hi),
            quote!(if m { *p } else { 0.0 }),
            quote!(if n > 0 {
                *p = x;
            }),
            quote!({
                let _ = b;
                a
            }),
        ),
        (Isa::Avx512, 8) => (
            quote!(__mmask8),
            quote! {
                let (lo, hi) = (lo.clamp(0, 8) as u32, hi.clamp(0, 8) as u32);
                (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as __mmask8
            },
            // Lanes outside the mask are not read (fault suppression).
            quote!(_mm256_maskz_loadu_ps(m, p)),
            quote! {
                let m = ((1u32 << n.min(8)) - 1) as __mmask8;
                _mm256_mask_storeu_ps(p, m, x)
            },
            quote!(_mm256_permutex2var_ps(
                a,
                _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
                b
            )),
        ),
        (Isa::Avx512, _) => (
            quote!(__mmask16),
            quote! {
                let (lo, hi) = (lo.clamp(0, 16) as u32, hi.clamp(0, 16) as u32);
                (((1u32 << hi) - 1) & !((1u32 << lo) - 1)) as __mmask16
            },
            // Lanes outside the mask are not read (fault suppression).
            quote!(_mm512_maskz_loadu_ps(m, p)),
            quote! {
                let m = ((1u32 << n.min(16)) - 1) as __mmask16;
                _mm512_mask_storeu_ps(p, m, x)
            },
            quote!(_mm512_permutex2var_ps(
                a,
                _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                b
            )),
        ),
        (Isa::Avx2, _) => (
            quote!(__m256i),
            quote! {
                let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let (lo, hi) = (lo.clamp(0, 8) as i32, hi.clamp(0, 8) as i32);
                _mm256_and_si256(
                    _mm256_cmpgt_epi32(iota, _mm256_set1_epi32(lo - 1)),
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), iota),
                )
            },
            // Lanes outside the mask are not read (fault suppression).
            quote!(_mm256_maskload_ps(p, m)),
            // Not `vmaskmovps` to memory: AMD cores microcode it (over ten cycles a store).
            // Halves, then quarters, then one float.
            quote! {
                if n >= 8 {
                    return _mm256_storeu_ps(p, x);
                }
                let (mut p, mut n) = (p, n);
                let mut v = _mm256_castps256_ps128(x);
                if n >= 4 {
                    _mm_storeu_ps(p, v);
                    v = _mm256_extractf128_ps::<1>(x);
                    p = p.add(4);
                    n -= 4;
                }
                if n >= 2 {
                    _mm_store_sd(p as *mut f64, _mm_castps_pd(v));
                    v = _mm_movehl_ps(v, v);
                    p = p.add(2);
                    n -= 2;
                }
                if n >= 1 {
                    _mm_store_ss(p, v);
                }
            },
            quote!(_mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(
                _mm256_castps_pd(_mm256_shuffle_ps::<0x88>(a, b))
            ))),
        ),
        (Isa::Neon, _) => (
            quote!((isize, isize)),
            quote!((lo, hi)),
            quote! {
                let mut t = [0.0f32; 4];
                for (i, t) in t.iter_mut().enumerate() {
                    let i = i as isize;
                    if m.0 <= i && i < m.1 {
                        *t = *p.wrapping_offset(i);
                    }
                }
                vld1q_f32(t.as_ptr())
            },
            quote! {
                let mut t = [0.0f32; 4];
                vst1q_f32(t.as_mut_ptr(), x);
                core::ptr::copy_nonoverlapping(t.as_ptr(), p, n.min(4));
            },
            quote!(vuzp1q_f32(a, b)),
        ),
    };
    let odds = match (v.isa, v.lanes) {
        (Isa::Scalar, _) => quote!({
            let _ = a;
            b
        }),
        (Isa::Avx512, 8) => quote!(_mm256_permutex2var_ps(
            a,
            _mm256_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15),
            b
        )),
        (Isa::Avx512, _) => quote!(_mm512_permutex2var_ps(
            a,
            _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31),
            b
        )),
        (Isa::Avx2, _) => quote!(_mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(
            _mm256_castps_pd(_mm256_shuffle_ps::<0xDD>(a, b))
        ))),
        (Isa::Neon, _) => quote!(vuzp2q_f32(a, b)),
    };
    let (mask_ty, part_mask, load_masked, store_part, convert) = if v.dt == Dt::F32 {
        (mask_ty, part_mask, load_masked, store_part, quote!())
    } else {
        half_helpers(v, mask_ty, part_mask)
    };
    let elem = &v.elem;
    quote! {
        #convert

        /// The odd lanes of the `2 x lanes` floats `a ++ b`.
        #[allow(dead_code)]
        #[inline]
        #attrs
        unsafe fn odds(a: #ty, b: #ty) -> #ty {
            #odds
        }

        /// The lanes `lo..hi` of the vector at `p`, zero elsewhere; only those lanes are read,
        /// so `p` may point partly outside the buffer.
        ///
        /// # Safety
        /// `p.wrapping_offset(i)` must be readable for every lane `i` in `lo..hi`.
        #[inline]
        #attrs
        unsafe fn load_part(p: *const #elem, lo: isize, hi: isize) -> #ty {
            load_masked(p, part_mask(lo, hi))
        }

        /// What selects lanes of a vector.
        type Mask = #mask_ty;

        /// The mask of lanes `lo..hi` (clamped to the vector): computed once where many loads
        /// share it.
        #[inline]
        #attrs
        unsafe fn part_mask(lo: isize, hi: isize) -> Mask {
            #part_mask
        }

        /// The lanes of the vector at `p` that `m` selects, zero elsewhere; only those are read.
        ///
        /// # Safety
        /// `p.wrapping_offset(i)` must be readable for every lane `i` that `m` selects.
        #[inline]
        #attrs
        unsafe fn load_masked(p: *const #elem, m: Mask) -> #ty {
            #load_masked
        }

        /// Stores the first `n` lanes of `x` at `p`.
        ///
        /// # Safety
        /// `p` must be writable for `min(n, lanes)` floats.
        #[inline]
        #attrs
        unsafe fn store_part(p: *mut #elem, x: #ty, n: usize) {
            #store_part
        }

        /// The even lanes of the `2 x lanes` floats `a ++ b`: a stride-2 load.
        #[inline]
        #attrs
        unsafe fn evens(a: #ty, b: #ty) -> #ty {
            #evens
        }

        /// Lanes of this ISA's vector.
        pub const LANES: isize = #lanes;
    }
}

/// A 16-bit type's `xload` and `xstore` (a whole vector widened from, or rounded to nearest
/// even into, 16-bit elements), and its masks, masked load and partial store (replacing the
/// f32 ones): AVX-512 masks 16-bit lanes itself (BW + VL); AVX2 goes through a small array at
/// the edges; scalar converts one element.
fn half_helpers(
    v: &Simd,
    mask_ty: TokenStream,
    part_mask: TokenStream,
) -> (
    TokenStream,
    TokenStream,
    TokenStream,
    TokenStream,
    TokenStream,
) {
    let attrs = v.attrs();
    let ty = &v.ty;
    let f16 = v.dt == Dt::F16;
    match (v.isa, v.lanes) {
        (Isa::Scalar, _) => {
            let (load, store) = if f16 {
                (
                    quote!(half::f16::from_bits(*p).to_f32()),
                    quote!(*p = half::f16::from_f32(x).to_bits();),
                )
            } else {
                (
                    quote!(f32::from_bits((*p as u32) << 16)),
                    quote!(*p = crate::storage::bf16_bits(x);),
                )
            };
            (
                mask_ty,
                part_mask,
                quote!(if m { xload(p) } else { 0.0 }),
                quote!(if n > 0 {
                    xstore(p, x);
                }),
                quote! {
                    /// The element at `p`, widened.
                    #[inline]
                    #attrs
                    unsafe fn xload(p: *const u16) -> #ty {
                        #load
                    }
                    /// `x` rounded into the element at `p`.
                    #[inline]
                    #attrs
                    unsafe fn xstore(p: *mut u16, x: #ty) {
                        #store
                    }
                },
            )
        }
        (Isa::Avx2, 8) => {
            // The library's own 8-wide conversions (`src/storage.rs`), as the scalar level
            // calls its `bf16_bits`: one round-to-nearest-even for bf16, not two.
            let (load, bits) = (
                quote!(crate::storage::x86::widen8(#f16, _mm_loadu_si128(p as *const __m128i))),
                quote!(crate::storage::x86::narrow8(#f16, x)),
            );
            (
                quote!((isize, isize)),
                quote!((lo, hi)),
                quote! {
                    let (lo, hi) = (m.0.clamp(0, 8), m.1.clamp(0, 8));
                    if lo == 0 && hi == 8 {
                        return xload(p);
                    }
                    let mut t = [0u16; 8];
                    let mut i = lo;
                    while i < hi {
                        t[i as usize] = *p.offset(i);
                        i += 1;
                    }
                    xload(t.as_ptr())
                },
                quote! {
                    if n >= 8 {
                        return xstore(p, x);
                    }
                    let mut t = [0u16; 8];
                    xstore(t.as_mut_ptr(), x);
                    core::ptr::copy_nonoverlapping(t.as_ptr(), p, n);
                },
                quote! {
                    /// The 8 elements at `p`, widened.
                    #[inline]
                    #attrs
                    unsafe fn xload(p: *const u16) -> #ty {
                        #load
                    }
                    /// `x` rounded to nearest even, as 8 16-bit elements.
                    #[inline]
                    #attrs
                    unsafe fn xbits(x: #ty) -> __m128i {
                        #bits
                    }
                    /// `x` rounded into the 8 elements at `p`.
                    #[inline]
                    #attrs
                    unsafe fn xstore(p: *mut u16, x: #ty) {
                        _mm_storeu_si128(p as *mut __m128i, xbits(x))
                    }
                },
            )
        }
        (Isa::Avx512, 16) => {
            let widen = |words: TokenStream| {
                if f16 {
                    quote!(_mm512_cvtph_ps(#words))
                } else {
                    quote!(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(#words))))
                }
            };
            let (load, load_m) = (
                widen(quote!(_mm256_loadu_si256(p as *const __m256i))),
                widen(quote!(_mm256_maskz_loadu_epi16(m, p as *const i16))),
            );
            let bits = if f16 {
                quote!(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
            } else {
                quote! {
                    // Round to nearest even: add 0x7fff and the lowest kept bit; NaN keeps its
                    // sign and becomes quiet.
                    let b = _mm512_castps_si512(x);
                    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
                    let r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
                    let q = _mm512_or_si512(b, _mm512_set1_epi32(0x40_0000));
                    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
                    _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(_mm512_mask_blend_epi32(nan, r, q)))
                }
            };
            (
                mask_ty,
                part_mask,
                // Lanes outside the mask are not read (fault suppression).
                load_m,
                quote! {
                    let m = ((1u32 << n.min(16)) - 1) as __mmask16;
                    _mm256_mask_storeu_epi16(p as *mut i16, m, xbits(x))
                },
                quote! {
                    /// The 16 elements at `p`, widened.
                    #[inline]
                    #attrs
                    unsafe fn xload(p: *const u16) -> #ty {
                        #load
                    }
                    /// `x` rounded to nearest even, as 16 16-bit elements.
                    #[inline]
                    #attrs
                    unsafe fn xbits(x: #ty) -> __m256i {
                        #bits
                    }
                    /// `x` rounded into the 16 elements at `p`.
                    #[inline]
                    #attrs
                    unsafe fn xstore(p: *mut u16, x: #ty) {
                        _mm256_storeu_si256(p as *mut __m256i, xbits(x))
                    }
                },
            )
        }
        (isa, lanes) => panic!("no 16-bit helpers for {isa:?} with {lanes} lanes"),
    }
}
