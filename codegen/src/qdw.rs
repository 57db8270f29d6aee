//! The int8 depthwise kernel emitter: one output row of one channel plane, unrolled for a
//! square kernel size and stride, AVX-512 VNNI + VBMI.
//!
//! Sixteen outputs a vector. For each kernel row and each group of four taps, one `vpermb`
//! gathers, for every output, the four input bytes under those taps from one 64-byte load of
//! the (zero-point padded) input row, and one `vpdpbusd` multiplies them by the four weights
//! and adds them to the output's i32 sum: a 3x3 kernel is 3 multiply instructions for 16
//! outputs, a 7x7 one 14. Exact, as the GEMM kernels (no 16-bit intermediate). The
//! epilogue is the GEMM kernels' one: bias, then i32, f32 or requantised u8/i8.
//!
//! Beside them, one small-plane kernel (`emit_small`) for planes of at most 64 bytes, any
//! kernel size, stride and dilation: the whole plane in one register, no padded copy.

use crate::lit;
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// The shapes (kernel, stride) that get a VNNI depthwise kernel.
pub const QDW_SHAPES: &[(usize, usize)] = &[(3, 1), (3, 2), (5, 1), (5, 2), (7, 1), (7, 2)];

pub fn name(k: usize, s: usize) -> String {
    format!("qdw_u8i8_k{k}s{s}_avx512vnni")
}

/// Outputs a vector.
const LANES: usize = 16;

/// Vectors a step keeps in flight (independent sums hide the multiply-add latency): four for
/// 3x3, two for the larger kernels, whose weights take more registers.
fn unroll(k: usize) -> usize {
    if k <= 3 {
        4
    } else {
        2
    }
}

/// The kernels of `shapes` (a subset of [`QDW_SHAPES`], empty when AVX-512 is not built) and
/// their registry.
pub fn emit_all(shapes: &[(usize, usize)]) -> TokenStream {
    let kernels = shapes.iter().map(|&(k, s)| emit(k, s));
    let entries = shapes.iter().map(|&(k, s)| {
        let n = name(k, s);
        let f = format_ident!("{}", n);
        quote! {
            #[cfg(target_arch = "x86_64")]
            QDwKernel { name: #n, func: #f, k: #k, s: #s },
        }
    });
    let kernel_uses = if shapes.is_empty() {
        quote!()
    } else {
        quote! {
            #[cfg(target_arch = "x86_64")]
            use crate::algo::{qdepthwise::{QDwEpilogue, QDwSmallArgs}, qgemm::QMode};
        }
    };
    // The small-plane kernel takes any kernel size, stride and dilation: one, where the
    // others are built.
    let (small, small_entry) = if shapes.is_empty() {
        (quote!(), quote!())
    } else {
        let n = SMALL_NAME;
        let f = format_ident!("{}", n);
        (
            emit_small(),
            quote! {
                #[cfg(target_arch = "x86_64")]
                QDwSmallKernel { name: #n, func: #f },
            },
        )
    };
    quote! {
        use crate::algo::qdepthwise::{QDwKernel, QDwSmallKernel};
        #kernel_uses

        #(#kernels)*
        #small

        /// Every int8 depthwise kernel compiled for this target, from the generator's table.
        pub static QDW_KERNELS: &[QDwKernel] = &[#(#entries)*];

        /// The small-plane kernel, where it is compiled.
        pub static QDW_SMALL_KERNELS: &[QDwSmallKernel] = &[#small_entry];
    }
}

/// The name of the small-plane kernel.
pub const SMALL_NAME: &str = "qdw_u8i8_plane64_avx512vnni";

/// The small-plane kernel: for channel planes of at most 64 bytes (7x7, 8x8 images) with at
/// most 64 outputs, any kernel size, stride, dilation and padding.
///
/// One 64-byte load holds the whole input plane, so no zero-point padded copy is made and no
/// plane is read twice: the kernel's taps, flattened (`ky·kw + kx`), go in quads, and for
/// each quad and each of the four output vectors one merge-masked `vpermb` gathers every
/// output's four inputs from that register, the zero point where a tap falls in the padding
/// (a mask and an index table per quad and vector, made once by the plan). One `vpdpbusd` a
/// quad and vector: a 3x3 kernel is 3 (9 taps in 3 quads), 7x7 is 13. A call runs a block of
/// channels, so the per-plane set-up of the row kernels (a padded copy, a call) is gone.
fn emit_small() -> TokenStream {
    let name = format_ident!("{}", SMALL_NAME);
    let doc = " int8 depthwise convolution of a block of small channel planes (AVX-512 VNNI + \
        VBMI): see `QDwSmallArgs`.\n\n # Safety\n The CPU must have AVX-512F/BW/VL, VNNI and \
        VBMI, and `a` must describe valid memory as `QDwSmallArgs` says.";
    let packed = pack_store(|u, j| LANES * u + j, quote!(y), quote!(a.ohw));
    let requant = (0..4usize).map(|u| {
        let (acc, p) = (format_ident!("acc{}", u), format_ident!("p{}", u));
        let q = requantize(&acc);
        quote!(let #p = #q;)
    });
    let wide_stores = (0..4usize).map(|u| {
        let acc = format_ident!("acc{}", u);
        let at = lit(LANES * u);
        quote! {
            if a.ohw > #at {
                let left = a.ohw - #at;
                let mask = if left >= 16 { 0xFFFF } else { ((1u32 << left) - 1) as __mmask16 };
                if matches!(a.mode, QMode::I32) {
                    _mm512_mask_storeu_epi32((y as *mut i32).add(#at) as *mut _, mask, #acc);
                } else {
                    _mm512_mask_storeu_ps((y as *mut f32).add(#at) as *mut _, mask, _mm512_mul_ps(_mm512_cvtepi32_ps(#acc), scale));
                }
            }
        }
    });
    let gathers = (0..4usize).map(|u| {
        let acc = format_ident!("acc{}", u);
        let (at, byte) = (lit(u), lit(64 * u));
        quote! {
            let v = _mm512_mask_permutexvar_epi8(zu, *k.add(#at), _mm512_loadu_si512(t.add(#byte) as *const __m512i), raw);
            #acc = _mm512_dpbusd_epi32(#acc, v, wq);
        }
    });
    quote! {
        #[doc = #doc]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
        #[cfg(target_arch = "x86_64")]
        pub unsafe fn #name(a: &QDwSmallArgs) {
            use core::arch::x86_64::*;
            let zu = _mm512_set1_epi8(a.zu as i8);
            let flip = _mm512_set1_epi8(a.flip as i8);
            let (lo, hi, zp) = (_mm512_set1_ps(a.lo), _mm512_set1_ps(a.hi), _mm512_set1_epi32(a.zero_point));
            for c in 0..a.planes {
                let left = a.x_len - c * a.in_step;
                let src = a.x.add(c * a.in_step);
                // A plain load where 64 bytes remain (masked loads are slow), else masked.
                let raw = if left >= 64 {
                    _mm512_loadu_si512(src as *const __m512i)
                } else {
                    _mm512_maskz_loadu_epi8((1u64 << left) - 1, src as *const i8)
                };
                let raw = _mm512_xor_si512(raw, flip);
                for m in 0..a.mult {
                    let co = c * a.mult + m;
                    let w = a.w.add(co * a.nq);
                    let bias = _mm512_set1_epi32(*a.bias.add(co));
                    let scale = _mm512_set1_ps(*a.scale.add(co));
                    let (mut acc0, mut acc1, mut acc2, mut acc3) = (bias, bias, bias, bias);
                    for q in 0..a.nq {
                        let wq = _mm512_set1_epi32(*w.add(q));
                        let (t, k) = (a.idx.add(q * 256), a.masks.add(q * 4));
                        #(#gathers)*
                    }
                    let y = a.out.add(co * a.out_step);
                    if matches!(a.mode, QMode::Q8) {
                        #(#requant)*
                        #packed
                    } else {
                        #(#wide_stores)*
                    }
                }
            }
        }
    }
}

fn emit(k: usize, s: usize) -> TokenStream {
    let name = format_ident!("{}", name(k, s));
    let nq = k.div_ceil(4);
    let doc = format!(
        " int8 depthwise {k}x{k} stride {s}, one channel (AVX-512 VNNI + VBMI): the `oh x ow` \
         outputs from the zero-point padded input plane `plane` (rows `wp` bytes apart), weights \
         `w` as {k}x{nq} i32 quads of i8 taps (zero-padded). With `table` null, vectors are 16 \
         outputs of a row; else 16 consecutive outputs of the plane, `table[64 * x]` the \
         `vpermb` indices of a vector starting at column `x`.\n\n \
         # Safety\n The CPU must have AVX-512F/BW/VL, VNNI and VBMI; the plane must be readable \
         for 64 + {last} bytes from every row and column a vector (of any mode, whole) \
         starts its reads at (in packed row mode, up to {packed} bytes past a step's first \
         output's input); the table must hold `ow` rows of 64 indices below 64; `out` \
         writable for `oh * ow` elements of the type of `ep.mode`.",
        last = 4 * (nq - 1),
        packed = packed_offset(s, 3)
    );
    // vpermb indices: output j of a vector takes bytes j*s + t, t = 0..4, of the load.
    let idx: Vec<i8> = (0..LANES)
        .flat_map(|j| (0..4).map(move |t| (j * s + t) as i8))
        .collect();
    let (s_l, lanes_l) = (lit(s), lit(LANES));
    let weights = (0..k).flat_map(|ky| {
        (0..nq).map(move |q| {
            let wn = format_ident!("w{}_{}", ky, q);
            let at = lit(ky * nq + q);
            quote!(let #wn = _mm512_set1_epi32(*w.add(#at));)
        })
    });
    // The sum of one vector over every tap: `base` its first output's input, `idx` its gather.
    // Two vectors a step leave the multiply-adds' latency exposed where a vector has 10 or
    // 14 of them (5x5, 7x7): there the kernel rows alternate between two sums, added at the
    // end.
    let chains = if unroll(k) == 4 { 1 } else { 2 };
    let terms = |acc: &proc_macro2::Ident, idx: &proc_macro2::Ident, base: &proc_macro2::Ident| {
        let odd = format_ident!("{}_odd", acc);
        let t = (0..k).flat_map(|ky| {
            let sum = if ky % chains == 1 { odd.clone() } else { acc.clone() };
            (0..nq).map(move |q| {
                let wn = format_ident!("w{}_{}", ky, q);
                let off = lit(4 * q);
                let ky = lit(ky);
                quote! {
                    let v = _mm512_permutexvar_epi8(#idx, _mm512_loadu_si512(#base.add(#ky * wp + #off) as *const __m512i));
                    #sum = _mm512_dpbusd_epi32(#sum, v, #wn);
                }
            })
        });
        if chains == 1 {
            quote! {
                let mut #acc = bias;
                #(#t)*
            }
        } else {
            quote! {
                let (mut #acc, mut #odd) = (bias, _mm512_setzero_si512());
                #(#t)*
                let #acc = _mm512_add_epi32(#acc, #odd);
            }
        }
    };
    let names = |u: usize| {
        (
            format_ident!("acc{}", u),
            format_ident!("oy{}", u),
            format_ident!("x{}", u),
            format_ident!("ok{}", u),
            format_ident!("base{}", u),
            format_ident!("idx{}", u),
        )
    };
    // Row mode: vector u of a step is 16 outputs of one row. Past the last output, a vector
    // recomputes the step's first one (reads stay inside the plane) and stores nothing.
    let row_steps = (0..unroll(k)).map(|u| {
        let (acc, oy, x, ok, base, _) = names(u);
        let idx = format_ident!("idx");
        let sum = terms(&acc, &idx, &base);
        quote! {
            let (#oy, #x, #ok) = (oy, x, oy < oh);
            let #base = if #ok { plane.add(#oy * #s_l * wp + #x * #s_l) } else { plane };
            #sum
            if #ok {
                x += #lanes_l;
                if x >= ow {
                    x = 0;
                    oy += 1;
                }
            }
        }
    });
    let row_stores = (0..unroll(k)).map(|u| {
        let (acc, oy, x, ok, _, _) = names(u);
        quote! {
            if #ok {
                store(#acc, #oy * ow + #x, ow - #x);
            }
        }
    });
    // Flat mode: vector u is the next 16 outputs in plane order, across rows, gathered with
    // the table's indices for the column it starts at.
    let flat_steps: Vec<_> = (0..unroll(k))
        .map(|u| {
            let (acc, oy, x, ok, base, idx) = names(u);
            let sum = terms(&acc, &idx, &base);
            quote! {
                let (#oy, #x, #ok) = (oy, x, oy < oh);
                let (#base, #idx) = if #ok {
                    (
                        plane.add(#oy * #s_l * wp + #x * #s_l),
                        _mm512_loadu_si512(table.add(#x * 64) as *const __m512i),
                    )
                } else {
                    (plane, idx)
                };
                #sum
                if #ok {
                    x += #lanes_l;
                    while x >= ow {
                        x -= ow;
                        oy += 1;
                    }
                }
            }
        })
        .collect();
    let flat_stores = (0..unroll(k)).map(|u| {
        let (acc, oy, x, ok, _, _) = names(u);
        quote! {
            if #ok {
                let at = #oy * ow + #x;
                store(#acc, at, oh * ow - at);
            }
        }
    });
    // Packed row mode (u8/i8 outputs, row mode): four vectors of 64 bytes loaded at the input
    // offsets `packed_offset` of one step need no gather: dword `j` of vector `r` is already
    // the four inputs under the taps of output `packed_output(s, r, j)`. The four sums are
    // requantised, packed to bytes (`vpackssdw`, `vpackuswb` on the low bytes: the truncation
    // `vpmovdb` does) and put in output order by one `vpermb`: 64 outputs a step.
    let packed_store = pack_store(
        |r, j| packed_output(s, r, j),
        quote!(y.add(x)),
        quote!(ow - x),
    );
    let raw_sums: Vec<_> = (0..4)
        .map(|r| {
            let acc = format_ident!("n{}", r);
            let t = (0..k).flat_map(|ky| {
                let acc = acc.clone();
                (0..nq).map(move |q| {
                    let wn = format_ident!("w{}_{}", ky, q);
                    let (ky, q4, off) = (lit(ky), lit(4 * q), lit(packed_offset(s, r)));
                    quote! {
                        #acc = _mm512_dpbusd_epi32(#acc, _mm512_loadu_si512(b.add(#ky * wp + #off + #q4) as *const __m512i), #wn);
                    }
                })
            });
            quote! {
                let mut #acc = bias;
                #(#t)*
            }
        })
        .collect();
    let requant_c = (0..4usize).map(|r| {
        let (c, p) = (format_ident!("c{}", r), format_ident!("p{}", r));
        let q = requantize(&c);
        quote!(let #p = #q;)
    });
    // 3x3: each step's sums are made one step ahead of its epilogue: a step's chain (loads,
    // multiply-adds, requantisation, packing) is longer than the core's schedulers can
    // overlap with the next step's, so its epilogue waits on nothing this way. (The larger
    // kernels' steps have more multiply-adds to overlap the epilogue with, and measured
    // slower so.)
    let requant_n = (0..4usize).map(|r| {
        let (n, p) = (format_ident!("n{}", r), format_ident!("p{}", r));
        let q = requantize(&n);
        quote!(let #p = #q;)
    });
    let packed_rows = if unroll(k) != 4 {
        quote! {
            for oy in 0..oh {
                let row = plane.add(oy * #s_l * wp);
                let y = out.add(oy * ow);
                let mut x = 0usize;
                while x < ow {
                    let b = row.add(x * #s_l);
                    #(#raw_sums)*
                    #(#requant_n)*
                    #packed_store
                    x += 64;
                }
            }
        }
    } else {
        quote! {
            let (mut oy, mut x) = (0usize, 0usize);
            let (mut ny, mut nx) = (0usize, 0usize);
            let b = plane;
            #(#raw_sums)*
            let (mut c0, mut c1, mut c2, mut c3) = (n0, n1, n2, n3);
            while oy < oh {
                // The next step (the last one again at the end: its reads stay in the plane).
                nx += 64;
                if nx >= ow {
                    nx = 0;
                    ny += 1;
                }
                if ny == oh {
                    (ny, nx) = (oy, x);
                }
                let b = plane.add(ny * #s_l * wp + nx * #s_l);
                #(#raw_sums)*
                let y = out.add(oy * ow);
                #(#requant_c)*
                #packed_store
                (c0, c1, c2, c3) = (n0, n1, n2, n3);
                x += 64;
                if x >= ow {
                    x = 0;
                    oy += 1;
                }
            }
        }
    };
    // Flat mode's four vectors are 64 consecutive outputs: with u8/i8 outputs, they are packed
    // and stored as the packed row mode's are (3x3, the one size with four), each step's sums
    // made one step ahead of its epilogue as there.
    let flat_q8 = if unroll(k) == 4 {
        let store = pack_store(
            |u, j| 16 * u + j,
            quote!(out.add(first)),
            quote!(oh * ow - first),
        );
        let requant = (0..4usize).map(|u| {
            let (c, p) = (format_ident!("c{}", u), format_ident!("p{}", u));
            let q = requantize(&c);
            quote!(let #p = #q;)
        });
        quote! {
            else if matches!(ep.mode, QMode::Q8) {
            let mut first = 0usize;
            #(#flat_steps)*
            let (mut c0, mut c1, mut c2, mut c3) = (acc0, acc1, acc2, acc3);
            while first < oh * ow {
                // The next step (past the last output: plane reads, stored nowhere).
                #(#flat_steps)*
                #(#requant)*
                #store
                (c0, c1, c2, c3) = (acc0, acc1, acc2, acc3);
                first += 64;
            }
            }
        }
    } else {
        quote!()
    };
    quote! {
        #[doc = #doc]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
        #[cfg(target_arch = "x86_64")]
        pub unsafe fn #name(plane: *const u8, wp: usize, oh: usize, ow: usize, table: *const u8, w: *const i32, out: *mut u8, ep: &QDwEpilogue) {
            use core::arch::x86_64::*;
            let idx = _mm512_loadu_si512([#(#idx),*].as_ptr() as *const __m512i);
            #(#weights)*
            let bias = _mm512_set1_epi32(ep.bias);
            let scale = _mm512_set1_ps(ep.scale);
            let (lo, hi, zp) = (_mm512_set1_ps(ep.lo), _mm512_set1_ps(ep.hi), _mm512_set1_epi32(ep.zero_point));
            // The epilogue of one vector: outputs `at..`, of which `left` remain to store.
            let store = |acc: __m512i, at: usize, left: usize| {
                let v = acc;
                let full = left >= #lanes_l;
                let mask = if full { 0xFFFF } else { ((1u32 << left) - 1) as __mmask16 };
                match ep.mode {
                    QMode::I32 => _mm512_mask_storeu_epi32((out as *mut i32).add(at) as *mut _, mask, v),
                    QMode::F32 => _mm512_mask_storeu_ps((out as *mut f32).add(at) as *mut _, mask, _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale)),
                    QMode::Q8 => {
                        let f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale);
                        let q = _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(f, lo), hi)), zp));
                        if full {
                            _mm_storeu_si128(out.add(at) as *mut __m128i, q);
                        } else {
                            _mm_mask_storeu_epi8(out.add(at) as *mut _, mask, q);
                        }
                    }
                }
            };
            // Steps of a few vectors of 16 outputs: independent sums hide the multiply-add
            // latency.
            let (mut oy, mut x) = (0usize, 0usize);
            if table.is_null() && matches!(ep.mode, QMode::Q8) {
                #packed_rows
            } else if table.is_null() {
                while oy < oh {
                    #(#row_steps)*
                    #(#row_stores)*
                }
            } #flat_q8 else {
                while oy < oh {
                    #(#flat_steps)*
                    #(#flat_stores)*
                }
            }
        }
    }
}

/// Packed row mode: the input offset (from a step's first output's input) of vector `r`'s
/// loads at stride `s`.
fn packed_offset(s: usize, r: usize) -> usize {
    match s {
        1 => r,
        _ => 2 * (r % 2) + 64 * (r / 2),
    }
}

/// Packed row mode: the output (from a step's first) whose taps dword `j` of vector `r` holds:
/// its input `s * out` is `packed_offset(s, r) + 4 j`.
fn packed_output(s: usize, r: usize, j: usize) -> usize {
    let out = (packed_offset(s, r) + 4 * j) / s;
    debug_assert_eq!(out * s, packed_offset(s, r) + 4 * j);
    out
}

/// The packed modes' requantisation of the i32 sums `acc` (as the store's Q8 arm, before its
/// narrowing): scaled, clamped, rounded, the zero point added.
fn requantize(acc: &proc_macro2::Ident) -> TokenStream {
    quote!(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(#acc), scale), lo), hi)), zp))
}

/// Packs the requantised sums `p0..p3` to bytes (`vpackssdw`, then `vpackuswb` of the low
/// bytes: the truncation `vpmovdb` does), puts them in output order and stores the first
/// `left` (at most 64) at `dst`. `output(r, j)`: the output (of 64) lane `j` of `p{r}` is.
fn pack_store(
    output: impl Fn(usize, usize) -> usize,
    dst: TokenStream,
    left: TokenStream,
) -> TokenStream {
    let mut perm = vec![0i8; 64];
    for r in 0..4 {
        for j in 0..LANES {
            // After the packs, lane j of p{r} is byte 16 (j / 4) + 4 r + j % 4.
            perm[output(r, j)] = (16 * (j / 4) + 4 * r + j % 4) as i8;
        }
    }
    quote! {
        let low = _mm512_set1_epi16(0xFF);
        let p01 = _mm512_and_si512(_mm512_packs_epi32(p0, p1), low);
        let p23 = _mm512_and_si512(_mm512_packs_epi32(p2, p3), low);
        let perm = _mm512_loadu_si512([#(#perm),*].as_ptr() as *const __m512i);
        let v = _mm512_permutexvar_epi8(perm, _mm512_packus_epi16(p01, p23));
        let (dst, left) = (#dst, #left);
        if left >= 64 {
            _mm512_storeu_si512(dst as *mut __m512i, v);
        } else {
            _mm512_mask_storeu_epi8(dst as *mut i8, (1u64 << left) - 1, v);
        }
    }
}
