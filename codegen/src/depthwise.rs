//! The depthwise kernel emitter: one output channel per input channel (times a channel
//! multiplier in NCHW), every tap a vector multiply-add.
//!
//! - **NCHW** kernels vectorise along the output row: each call runs one channel plane over a
//!   band of output rows, `ROWS` rows at a time, so each input row loaded feeds every output
//!   row of the block it reaches. Stride 2 loads two vectors and keeps the even lanes.
//! - **NHWC** kernels vectorise across channels and keep `pixels` outputs of a row in
//!   registers, so each weight vector loaded serves them all.
//!
//! Padding is never copied: output blocks whose taps all land inside the image run the plain
//! loop; the others load with lane masks (columns) and skip rows outside the image. A fixed
//! `(kernel, stride)` gets a fully unrolled kernel; the generic kernel takes any kernel,
//! stride and dilation at run time and is still vectorised.

use crate::simd::{helpers, simd, simd_half, simd_ymm, Simd};
use crate::{lit, registry_entry_with, DirectSpec, Dt, DwLayout, DwSpec, Isa};
use proc_macro2::{Ident, TokenStream};
use quote::{format_ident, quote};

/// Output rows an NCHW kernel keeps in registers: each input row loaded feeds up to this
/// many output rows, and as many multiply-add chains run side by side. Beside them sit one
/// tap column's weights (7 at most) and the input vector: 16 registers at AVX-512 (32 there),
/// 14 of AVX2's 16. A whole 7x7 plane is one block of the 8-lane AVX-512 kernels.
fn rows(spec: &DwSpec) -> usize {
    match spec.isa {
        Isa::Avx512 => 8,
        Isa::Avx2 => 6,
        _ => 4,
    }
}

/// Output rows the generic NCHW kernel keeps in registers.
const GENERIC_ROWS: usize = 4;

/// Output pixels an NHWC kernel keeps in registers per channel vector (registers allowing).
fn pixels(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 8,
        _ => 4,
    }
}

/// The module a kernel's ISA variant lives in (each has its own helpers).
fn module(spec: &DwSpec) -> Ident {
    let ymm = if spec.ymm { "_ymm" } else { "" };
    let dt = match spec.dtype {
        Dt::F32 => String::new(),
        dt => format!("_{}", dt.suffix()),
    };
    format_ident!("{}{ymm}{dt}", spec.isa.suffix())
}

/// The first statement of a 16-bit kernel: `a` seen through [`args16`], whose tensor pointers
/// are the 16-bit elements'.
fn prelude(v: &Simd) -> TokenStream {
    if v.dt == Dt::F32 {
        quote!()
    } else {
        quote!(let a = &Args16::new(a);)
    }
}

/// The view of `DwArgs` a 16-bit kernel works through: the same fields, with `input`,
/// `output` and `residual` pointing at 16-bit elements (the caller passes them cast).
fn args16() -> TokenStream {
    quote! {
        /// `DwArgs` with the tensor pointers cast to the 16-bit elements they point at.
        struct Args16<'a> {
            input: *const u16,
            output: *mut u16,
            residual: *const u16,
            args: &'a DwArgs,
        }

        impl<'a> Args16<'a> {
            #[inline(always)]
            fn new(args: &'a DwArgs) -> Self {
                Args16 {
                    input: args.input as *const u16,
                    output: args.output as *mut u16,
                    residual: args.residual as *const u16,
                    args,
                }
            }
        }

        impl core::ops::Deref for Args16<'_> {
            type Target = DwArgs;
            #[inline(always)]
            fn deref(&self) -> &DwArgs {
                self.args
            }
        }
    }
}

/// All depthwise kernels of the table and the direct kernels, one module per ISA variant
/// (the two families share its helpers), and their registries.
pub fn emit_all(specs: &[DwSpec], direct: &[DirectSpec]) -> TokenStream {
    let mut modules = TokenStream::new();
    for isa in Isa::ALL {
        for (ymm, dt) in [
            (false, Dt::F32),
            (true, Dt::F32),
            (false, Dt::F16),
            (false, Dt::Bf16),
        ] {
            let mine: Vec<&DwSpec> = specs
                .iter()
                .filter(|s| s.isa == isa && s.ymm == ymm && s.dtype == dt)
                .collect();
            let Some(first) = mine.first() else {
                continue;
            };
            let v = match (ymm, dt) {
                (true, _) => simd_ymm(),
                (false, Dt::F32) => simd(isa),
                (false, dt) => simd_half(isa, dt),
            };
            let module = module(first);
            let cfg = isa.cfg();
            let uses = v.uses();
            let helpers = helpers(&v);
            let strided = strided_helpers(&v);
            let args16 = (dt != Dt::F32).then(args16);
            let kernels = mine.iter().map(|s| match s.layout {
                DwLayout::Nchw => emit_nchw(&v, s),
                DwLayout::Nhwc => emit_nhwc(&v, s),
                DwLayout::Flat => emit_flat(&v, s),
            });
            let directs: Vec<TokenStream> = direct
                .iter()
                .filter(|d| d.isa == isa && !ymm && dt == Dt::F32)
                .map(|d| crate::direct::emit(&v, d))
                .collect();
            let direct_use = if directs.is_empty() {
                quote!()
            } else {
                quote!(
                    use crate::algo::direct::DirectArgs;
                )
            };
            modules.extend(quote! {
                #cfg
                pub mod #module {
                    // Helpers are emitted whole; a module's kernels need not use them all (the
                    // AVX2 16-bit module has NHWC kernels only).
                    #![allow(unused_unsafe, dead_code, clippy::all)]
                    use crate::algo::depthwise::DwArgs;
                    #direct_use
                    #uses
                    #args16
                    #helpers
                    #strided
                    #(#kernels)*
                    #(#directs)*
                }
            });
        }
    }
    let entries = |dt: Dt| {
        specs
            .iter()
            .filter(move |s| (s.dtype == Dt::F32) == (dt == Dt::F32))
            .map(registry_entry)
    };
    let (f32_entries, half_entries) = (entries(Dt::F32), entries(Dt::F16));
    let direct_entries = direct.iter().map(crate::direct::registry_entry);
    quote! {
        use crate::algo::depthwise::DwKernel;
        use crate::algo::direct::DirectKernel;

        #modules

        /// Every f32 depthwise kernel compiled for this target, from the generator's table.
        pub static DW_F32_KERNELS: &[DwKernel] = &[#(#f32_entries)*];

        /// Every 16-bit (f16, bf16) depthwise kernel compiled for this target.
        pub static DW_HALF_KERNELS: &[DwKernel] = &[#(#half_entries)*];

        /// Every f32 direct kernel compiled for this target, from the generator's table.
        pub static DIRECT_F32_KERNELS: &[DirectKernel] = &[#(#direct_entries)*];
    }
}

/// The registry entry of a depthwise kernel.
fn registry_entry(s: &DwSpec) -> TokenStream {
    {
        let layout = match s.layout {
            DwLayout::Nchw | DwLayout::Flat => quote!(crate::Layout::Nchw),
            DwLayout::Nhwc => quote!(crate::Layout::Nhwc),
        };
        let flat = s.layout == DwLayout::Flat;
        let fixed = match s.shape {
            Some((k, st)) => {
                let (k, st) = (lit(k), lit(st));
                quote!(Some((#k, #st)))
            }
            None => quote!(None),
        };
        let module = module(s);
        let path = format_ident!("{}", s.name());
        let block = lit(match s.layout {
            DwLayout::Nchw => rows(s),
            DwLayout::Nhwc => pixels(s.isa),
            DwLayout::Flat => FLAT_VECTORS,
        });
        let ymm = s.ymm;
        let dt = s.dtype.variant();
        registry_entry_with(
            "DwKernel",
            &s.name(),
            s.isa,
            quote!(#module::#path),
            quote!(layout: #layout, flat: #flat, fixed: #fixed, lanes: #module::LANES as usize, block: #block, ymm: #ymm, storage: crate::StorageType::#dt,),
        )
    }
}

/// Strided loads for the generic kernel, whose stride is known only at run time.
fn strided_helpers(v: &Simd) -> TokenStream {
    let attrs = v.attrs();
    let (ty, load) = (&v.ty, &v.load);
    let (elem, ez) = (&v.elem, &v.elem_zero);
    let lanes = lit(v.lanes);
    quote! {
        /// The floats `p[0], p[s], …, p[(lanes-1)s]`.
        ///
        /// # Safety
        /// Those floats (and, for `s == 2`, the whole `2 x lanes` run from `p`) must be readable.
        #[inline]
        #attrs
        unsafe fn load_strided(p: *const #elem, s: isize) -> #ty {
            if s == 1 {
                #load(p)
            } else if s == 2 && LANES > 1 {
                evens(#load(p), #load(p.add(#lanes)))
            } else {
                let mut t = [#ez; #lanes];
                for (i, t) in t.iter_mut().enumerate() {
                    *t = *p.offset(i as isize * s);
                }
                #load(t.as_ptr())
            }
        }

        /// As `load_strided`, reading only the floats `p[i]` with `lo <= i < hi` (zero for
        /// the others), so `p` may point partly outside the buffer.
        ///
        /// # Safety
        /// `p.wrapping_offset(i)` must be readable for every `i` in `lo..hi`.
        #[inline]
        #attrs
        unsafe fn load_strided_part(p: *const #elem, s: isize, lo: isize, hi: isize) -> #ty {
            if s == 1 {
                load_part(p, lo, hi)
            } else if s == 2 && LANES > 1 {
                evens(
                    load_part(p, lo, hi),
                    load_part(p.wrapping_add(#lanes), lo - LANES, hi - LANES),
                )
            } else {
                let mut t = [#ez; #lanes];
                for (i, t) in t.iter_mut().enumerate() {
                    let i = i as isize * s;
                    if lo <= i && i < hi {
                        *t = *p.wrapping_offset(i);
                    }
                }
                #load(t.as_ptr())
            }
        }
    }
}

/// The vector of input row `p` (`ix0` its first column, `in_w` its width) an NCHW kernel's
/// tap column `kx` multiplies: a plain load `inside` the image, else a masked one (masks from
/// [`edge_masks`]) that reads zero for the padding; `paired` (stride 2): the even lanes of two
/// vectors.
pub(crate) fn tap_load(v: &Simd, inside: bool, paired: bool, kx_n: usize) -> TokenStream {
    let (kx, load) = (lit(kx_n), &v.load);
    let (m, m2) = (format_ident!("m{}", kx_n), format_ident!("m{}_hi", kx_n));
    match (inside, paired) {
        (true, false) => quote!(#load(p.add(#kx))),
        (true, true) => {
            let kx2 = lit(kx_n + v.lanes);
            quote!(evens(#load(p.add(#kx)), #load(p.add(#kx2))))
        }
        (false, false) => quote!(load_masked(p.wrapping_add(#kx), #m)),
        (false, true) => {
            let kx2 = lit(kx_n + v.lanes);
            quote!(evens(
                load_masked(p.wrapping_add(#kx), #m),
                load_masked(p.wrapping_add(#kx2), #m2)
            ))
        }
    }
}

/// The (output row, kernel row) pairs that input row `j` of a block of `rows` output rows
/// feeds, at stride `s` with a kernel `k` tall.
pub(crate) fn row_uses(j: usize, rows: usize, s: usize, k: usize) -> Vec<(usize, usize)> {
    (0..rows)
        .filter(|&r| j >= r * s && j - r * s < k)
        .map(|r| (r, j - r * s))
        .collect()
}

/// Input row `j` of a block (`iy0 + j` in the image): `body` with `p` at its column `ix0` of
/// `plane`, or nothing when the row is padding.
pub(crate) fn input_row(j: usize, plane: TokenStream, body: TokenStream) -> TokenStream {
    let j = lit(j);
    quote! {
        let iy = iy0 + #j;
        if iy >= 0 && (iy as usize) < a.in_h {
            let p = #plane.wrapping_offset(iy * in_w + ix0);
            #body
        }
    }
}

/// The lane masks of an edge block's `k` tap columns, the same for every row it loads
/// (`m{kx}`, and `m{kx}_hi` for the second vector of a stride-2 pair).
pub(crate) fn edge_masks(v: &Simd, paired: bool, k: usize) -> TokenStream {
    let ms = (0..k).map(|kx_n| {
        let (kx, m, m2) = (
            lit(kx_n),
            format_ident!("m{}", kx_n),
            format_ident!("m{}_hi", kx_n),
        );
        let hi = paired.then(|| {
            let kx2 = lit(kx_n + v.lanes);
            quote!(let #m2 = part_mask(-(ix0 + #kx2), in_w - (ix0 + #kx2));)
        });
        quote! {
            let #m = part_mask(-(ix0 + #kx), in_w - (ix0 + #kx));
            #hi
        }
    });
    quote!(#(#ms)*)
}

/// Where an epilogue writes: the output offset (in floats), and `Some(n)` when only the first
/// `n` lanes are in the tensor.
pub(crate) struct Dest {
    pub offset: TokenStream,
    pub part: Option<TokenStream>,
}

/// bias, residual, clamp and store of one accumulator.
pub(crate) fn epilogue(v: &Simd, acc: &Ident, bias: TokenStream, dest: &Dest) -> TokenStream {
    let (add, min, max, load, store) = (&v.add, &v.min, &v.max, &v.load, &v.store);
    let off = &dest.offset;
    let (res, st) = match &dest.part {
        None => (
            quote!(#load(a.residual.add(#off))),
            quote!(#store(a.output.add(#off), #acc)),
        ),
        Some(n) => (
            quote!(load_part(a.residual.add(#off), 0, #n as isize)),
            quote!(store_part(a.output.add(#off), #acc, #n)),
        ),
    };
    quote! {
        #acc = #add(#acc, #bias);
        if !a.residual.is_null() {
            #acc = #add(#acc, #res);
        }
        #acc = #min(#max(#acc, lo), hi);
        #st;
    }
}

fn doc(spec: &DwSpec) -> String {
    let what = match spec.shape {
        Some((k, s)) => format!("{k}x{k} stride {s}"),
        None => "any kernel, stride and dilation".into(),
    };
    let how = match spec.layout {
        DwLayout::Nchw => {
            "NCHW: one channel plane (`input`, `output`, `residual` point at it; `weights` at its \
             kh*kw taps, `bias` at its value), output rows `oy0..oy1`"
        }
        DwLayout::Nhwc => {
            "NHWC: one image (`channels` per pixel; `weights` tap-major with `wstride` floats a \
             tap, `bias` padded to `wstride`), output rows `oy0..oy1`"
        }
        DwLayout::Flat => {
            "NCHW, stride 1 and `ow == in_w`: `planes` whole output planes of `oy1 * ow` floats \
             from `output` (and `residual`), plane `i` reading the input plane at `input + i * \
             in_step`, its taps at `weights + i * kh * kw`, its bias at `bias + i`; tap `t` of \
             output `o` is input `o + offsets[t]`, read where the lane masks \
             `masks[v * kh * kw + t * 4 + j]` of vector `v + j` (`v` a multiple of 4, below \
             `vectors`) allow"
        }
    };
    format!(
        " Depthwise {}, {what}, {} ({how}).\n\n # Safety\n The CPU must have the ISA, and \
         the pointers of `a` must cover the tensors its sizes describe{}.",
        spec.dtype.suffix(),
        spec.isa.suffix(),
        if spec.dtype == Dt::F32 {
            ""
        } else {
            " (`input`, `output` and `residual` point at 16-bit elements, cast)"
        }
    )
}

/// Output vectors of a plane a flat kernel keeps in flight, for each of its two planes: the
/// mask tables are padded to whole blocks of them.
pub const FLAT_VECTORS: usize = 4;

/// The flat-plane kernel: a small NCHW plane is one flat vector of outputs, so at stride 1 and
/// an output as wide as the input every tap is one offset (`(ky*dh - pad_top) * w + kx*dw -
/// pad_left`) and every lane does work, where the plane kernels would run 7-lane rows or
/// transpose the planes. Lanes whose tap falls in the padding are masked off by a table the
/// plan computes once. Two planes a step (8 chains of multiply-adds) share each mask.
fn emit_flat(v: &Simd, spec: &DwSpec) -> TokenStream {
    assert!(v.dt == Dt::F32, "flat kernels are f32");
    let name = format_ident!("{}", spec.name());
    let doc = doc(spec);
    let attrs = v.attrs();
    let (zero, splat, fma) = (&v.zero, &v.splat, v.fma);
    let ll = lit(v.lanes);
    let mask_of = match (v.isa, v.lanes) {
        (Isa::Avx512, 8) => quote!(bits as __mmask8),
        (Isa::Avx512, _) => quote!(bits as __mmask16),
        (Isa::Avx2, _) => quote! {
            let bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits as i32), bit), bit)
        },
        (isa, _) => panic!("no flat kernel at {isa:?}"),
    };
    let acc = |p: usize, q: usize| format_ident!("c{}_{}", p, q);
    let decls = (0..2)
        .flat_map(|p| (0..FLAT_VECTORS).map(move |q| (p, q)))
        .map(|(p, q)| {
            let c = acc(p, q);
            quote!(let mut #c = #zero;)
        });
    let steps = (0..FLAT_VECTORS).map(|q| {
        let (c0, c1, ql) = (acc(0, q), acc(1, q), lit(q));
        let off = lit(q * v.lanes);
        let f0 = fma(
            quote!(#c0),
            quote!(load_masked(x0.wrapping_offset(off + #off), m)),
            quote!(w0),
        );
        let f1 = fma(
            quote!(#c1),
            quote!(load_masked(x1.wrapping_offset(off + #off), m)),
            quote!(w1),
        );
        quote! {
            let m = mask_of(*mk.add(#ql));
            #c0 = #f0;
            #c1 = #f1;
        }
    });
    let stores = (0..2)
        .flat_map(|p| (0..FLAT_VECTORS).map(move |q| (p, q)))
        .map(|(p, q)| {
            let (c, plane) = (acc(p, q), if p == 0 { quote!(i) } else { quote!(j) });
            let dest = |part| Dest {
                offset: quote!(#plane * outputs + done),
                part,
            };
            let full = epilogue(v, &c, quote!(#splat(*a.bias.add(#plane))), &dest(None));
            let part = epilogue(
                v,
                &c,
                quote!(#splat(*a.bias.add(#plane))),
                &dest(Some(quote!(n))),
            );
            let (ql, second) = (lit(q * v.lanes), p == 1);
            let skip = if second { quote!(j == i ||) } else { quote!() };
            quote! {
                let done = v * #ll + #ql;
                if !(#skip done >= outputs) {
                    let n = outputs - done;
                    if n >= #ll { #full } else { #part }
                }
            }
        });
    let vl = lit(FLAT_VECTORS);
    quote! {
        /// The lane mask whose bits are `bits`.
        #[inline]
        #attrs
        unsafe fn mask_of(bits: u16) -> Mask {
            #mask_of
        }

        #[doc = #doc]
        #attrs
        pub unsafe fn #name(a: &DwArgs) {
            let (lo, hi) = (#splat(a.min), #splat(a.max));
            let (taps, outputs) = (a.kh * a.kw, a.oy1 * a.ow);
            let mut i = 0;
            while i < a.planes {
                // Planes go in pairs; a last one alone is its own pair, stored once.
                let j = if i + 1 < a.planes { i + 1 } else { i };
                let (x0, x1) = (a.input.add(i * a.in_step), a.input.add(j * a.in_step));
                let (wp0, wp1) = (a.weights.add(i * taps), a.weights.add(j * taps));
                let mut v = 0;
                while v < a.vectors {
                    #(#decls)*
                    let mut mk = a.masks.add(v * taps);
                    for t in 0..taps {
                        let off = (v * #ll) as isize + *a.offsets.add(t);
                        let (w0, w1) = (#splat(*wp0.add(t)), #splat(*wp1.add(t)));
                        #(#steps)*
                        mk = mk.add(#vl);
                    }
                    #(#stores)*
                    v += #vl;
                }
                i += 2;
            }
        }
    }
}

/// A fixed-shape NCHW kernel, or the generic one.
fn emit_nchw(v: &Simd, spec: &DwSpec) -> TokenStream {
    let name = format_ident!("{}", spec.name());
    let doc = doc(spec);
    let attrs = v.attrs();
    let (zero, splat, fma) = (&v.zero, &v.splat, v.fma);
    let l = v.lanes;
    let ll = lit(l);
    let prelude = prelude(v);
    let head = quote! {
        #prelude
        let (in_w, ow) = (a.in_w as isize, a.ow as isize);
        let (pt, pl) = (a.pad_top as isize, a.pad_left as isize);
        let bias = #splat(*a.bias);
        let (lo, hi) = (#splat(a.min), #splat(a.max));
    };
    let Some((k, s)) = spec.shape else {
        // The generic kernel keeps GENERIC_ROWS output rows in flight, so that as many chains
        // of multiply-adds run side by side (one row alone waits on each one's latency).
        let accs: Vec<Ident> = (0..GENERIC_ROWS)
            .map(|r| format_ident!("acc{}", r))
            .collect();
        let decls = accs.iter().map(|c| quote!(let mut #c = #zero;));
        let row_ptrs = (0..GENERIC_ROWS).map(|r| {
            let (ok, row, rl) = (format_ident!("ok{}", r), format_ident!("row{}", r), lit(r));
            quote! {
                let iy = (oy + #rl) as isize * sh + ky as isize * dh - pt;
                let #ok = iy >= 0 && (iy as usize) < a.in_h;
                let #row = a.input.wrapping_offset(iy * in_w);
            }
        });
        let taps = accs.iter().enumerate().map(|(r, c)| {
            let (ok, row) = (format_ident!("ok{}", r), format_ident!("row{}", r));
            let f = fma(quote!(#c), quote!(x), quote!(w));
            quote! {
                if #ok {
                    let x = if inside {
                        load_strided(#row.offset(start), sw)
                    } else {
                        load_strided_part(#row.wrapping_offset(start), sw, -start, in_w - start)
                    };
                    #c = #f;
                }
            }
        });
        let epi = |part: bool| -> Vec<TokenStream> {
            accs.iter()
                .enumerate()
                .map(|(r, c)| {
                    let rl = lit(r);
                    let e = epilogue(
                        v,
                        c,
                        quote!(bias),
                        &Dest {
                            offset: quote!((oy + #rl) * a.ow + ox as usize),
                            part: part.then(|| quote!(((ow - ox) as usize).min(#ll))),
                        },
                    );
                    quote!(if #rl < rows_left { #e })
                })
                .collect()
        };
        let (epi_full, epi_part) = (epi(false), epi(true));
        let rows = lit(GENERIC_ROWS);
        return quote! {
            #[doc = #doc]
            #attrs
            pub unsafe fn #name(a: &DwArgs) {
                #head
                let (sh, sw) = (a.sh as isize, a.sw as isize);
                let (dh, dw) = (a.dh as isize, a.dw as isize);
                // Floats one vector's strided load reads from its first tap.
                let span = if sw == 2 && LANES > 1 { 2 * LANES } else { (LANES - 1) * sw + 1 };
                let reach = (a.kw as isize - 1) * dw + span;
                let mut oy = a.oy0;
                while oy < a.oy1 {
                    let rows_left = a.oy1 - oy;
                    let mut ox = 0isize;
                    while ox < ow {
                        let ix0 = ox * sw - pl;
                        let inside = ox + LANES <= ow && ix0 >= 0 && ix0 + reach <= in_w;
                        #(#decls)*
                        for ky in 0..a.kh {
                            #(#row_ptrs)*
                            for kx in 0..a.kw {
                                let w = #splat(*a.weights.add(ky * a.kw + kx));
                                let start = ix0 + kx as isize * dw;
                                #(#taps)*
                            }
                        }
                        if inside {
                            #(#epi_full)*
                        } else {
                            #(#epi_part)*
                        }
                        ox += LANES;
                    }
                    oy += #rows;
                }
            }
        };
    };

    assert!(
        s <= 2,
        "{}: vector loads are strided by 1 or 2 only",
        spec.name()
    );
    let paired = s == 2 && l > 1;
    // Floats one tap's vector load reads, from its first.
    let span = if paired { 2 * l } else { (l - 1) * s + 1 };
    let block = |rows: usize, inside: bool| {
        let accs: Vec<Ident> = (0..rows).map(|r| format_ident!("acc{}", r)).collect();
        let decls = accs.iter().map(|c| quote!(let mut #c = #zero;));
        // Tap column outermost: its k weights stay in registers while every input row of the
        // block passes, instead of all k*k weights (49 for 7x7) spilling to memory operands.
        let in_rows = (0..k).map(|kx_n| {
            let rows_kx = (0..(rows - 1) * s + k).map(|j| {
                let load = tap_load(v, inside, paired, kx_n);
                let fmas = row_uses(j, rows, s, k).into_iter().map(|(r, ky)| {
                    let c = &accs[r];
                    let w = format_ident!("w{}", ky * k + kx_n);
                    let f = fma(quote!(#c), quote!(x), quote!(#w));
                    quote!(#c = #f;)
                });
                input_row(j, quote!(a.input), quote!(let x = #load; #(#fmas)*))
            });
            // Loaded here, not once per call: the compiler cannot hoist them past the
            // block's stores, so they are not kept in 49 spilled vectors.
            let ws = (0..k).map(|ky| {
                let w = format_ident!("w{}", ky * k + kx_n);
                let i = lit(ky * k + kx_n);
                quote!(let #w = #splat(*a.weights.add(#i));)
            });
            quote!(#(#ws)* #(#rows_kx)*)
        });
        // Rows past the band (its last block) are computed but not stored: one loop for
        // every block keeps the rows' chains of multiply-adds side by side.
        let epis = accs.iter().enumerate().map(|(r, c)| {
            let (first, r) = (r == 0, lit(r));
            let e = epilogue(
                v,
                c,
                quote!(bias),
                &Dest {
                    offset: quote!((oy + #r) * a.ow + ox as usize),
                    part: (!inside).then(|| quote!(((ow - ox) as usize).min(#ll))),
                },
            );
            if first {
                e
            } else {
                quote! {
                    if #r < rows_left {
                        #e
                    }
                }
            }
        });
        let masks = (!inside).then(|| edge_masks(v, paired, k));
        quote! {
            #(#decls)*
            #masks
            #(#in_rows)*
            #(#epis)*
        }
    };
    let rows_n = rows(spec);
    let body = row_blocks(
        rows_n,
        s,
        k - 1 + span,
        block(rows_n, true),
        block(rows_n, false),
    );
    quote! {
        #[doc = #doc]
        #attrs
        pub unsafe fn #name(a: &DwArgs) {
            #head
            #body
        }
    }
}

/// The loop of an NCHW kernel over blocks of `rows` output rows and one vector of columns:
/// `full` where every tap of the block lands inside the row (`reach` floats from the first),
/// `edge` elsewhere. Blocks see `oy`, `rows_left` (with more than one row), `iy0`, `ox` and
/// `ix0`.
pub(crate) fn row_blocks(
    rows: usize,
    stride: usize,
    reach: usize,
    full: TokenStream,
    edge: TokenStream,
) -> TokenStream {
    // One row a block never checks how many rows are left.
    let rows_left = (rows > 1).then(|| quote!(let rows_left = a.oy1 - oy;));
    let (rows, sl, reach) = (lit(rows), lit(stride), lit(reach));
    quote! {
            let mut oy = a.oy0;
            while oy < a.oy1 {
                #rows_left
                let iy0 = (oy * #sl) as isize - pt;
                let mut ox = 0isize;
                while ox < ow {
                    let ix0 = ox * #sl - pl;
                    if ox + LANES <= ow && ix0 >= 0 && ix0 + #reach <= in_w {
                        #full
                    } else {
                        #edge
                    }
                    ox += LANES;
                }
                oy += #rows;
            }
    }
}

/// A fixed-shape NHWC kernel, or the generic one.
///
/// Output pixels go `pixels` at a time, one vector of channels at a time, each weight vector
/// loaded once for all of them. A block whose taps all land inside the image runs without a
/// check; the others (image edges, the last block of a row, the last partial vector of
/// channels) check each tap column and pixel, and load and store only the channels left.
fn emit_nhwc(v: &Simd, spec: &DwSpec) -> TokenStream {
    let name = format_ident!("{}", spec.name());
    let doc = doc(spec);
    let attrs = v.attrs();
    let (zero, splat, load, fma) = (&v.zero, &v.splat, &v.load, v.fma);
    let wload = &v.wload;
    let prelude = prelude(v);
    let x = pixels(spec.isa);
    let xl = lit(x);
    let ll = lit(v.lanes);
    // Kernel size, stride and dilation: constants for a fixed shape.
    let (kh, kw, sh, sw, dh, dw) = match spec.shape {
        Some((k, s)) => {
            let (k, s) = (lit(k), lit(s));
            (
                quote!(#k),
                quote!(#k),
                quote!(#s),
                quote!(#s),
                quote!(1),
                quote!(1),
            )
        }
        None => (
            quote!(a.kh),
            quote!(a.kw),
            quote!(a.sh),
            quote!(a.sw),
            quote!(a.dh),
            quote!(a.dw),
        ),
    };
    let accs: Vec<Ident> = (0..x).map(|p| format_ident!("acc{}", p)).collect();
    // One block of `x` pixels at channel `c`. `inside`: every tap inside the image and every
    // pixel in the row; else pixel `p` exists only if `p < np`, and tap columns are checked.
    // `part`: only `n` channels are left.
    let block = |inside: bool, part: bool| {
        let decls = accs.iter().map(|c| quote!(let mut #c = #zero;));
        let fmas = accs.iter().enumerate().map(|(p, c)| {
            let pl = lit(p);
            let ptr = quote!(row.offset(ix * cs));
            let xload = if part {
                quote!(load_part(#ptr, 0, n as isize))
            } else {
                quote!(#load(#ptr))
            };
            let f = fma(quote!(#c), xload, quote!(w));
            if inside {
                quote! {
                    let ix = ix0 + (#pl * #sw + kx * #dw) as isize;
                    #c = #f;
                }
            } else {
                quote! {
                    let ix = ix0 + (#pl * #sw + kx * #dw) as isize;
                    if #pl < np && ix >= 0 && ix < in_w {
                        #c = #f;
                    }
                }
            }
        });
        let epis = accs.iter().enumerate().map(|(p, c)| {
            let pl = lit(p);
            let e = epilogue(
                v,
                c,
                quote!(b),
                &Dest {
                    offset: quote!((oy * a.ow + ox as usize + #pl) * chans + c),
                    part: part.then(|| quote!(n)),
                },
            );
            if inside {
                e
            } else {
                quote! {
                    if #pl < np {
                        #e
                    }
                }
            }
        });
        quote! {
            let b = #wload(a.bias.add(c));
            #(#decls)*
            for ky in 0..#kh {
                let iy = iy0 + (ky * #dh) as isize;
                if iy < 0 || iy >= in_h {
                    continue;
                }
                let row = a.input.add(iy as usize * a.in_w * chans + c);
                for kx in 0..#kw {
                    let w = #wload(a.weights.add((ky * #kw + kx) * a.wstride + c));
                    #(#fmas)*
                }
            }
            #(#epis)*
        }
    };
    // The unchecked block of a fixed shape goes row by row of the kernel: its weights in
    // registers, each input pixel of the row loaded once and multiplied into every output
    // pixel it reaches, so loads are a fraction of the multiply-adds.
    let inside = match spec.shape {
        None => block(true, false),
        Some((k, s)) => {
            let decls = accs.iter().map(|c| quote!(let mut #c = #zero;));
            let ws = (0..k).map(|kx| {
                let (w, kxl) = (format_ident!("w{}", kx), lit(kx));
                quote!(let #w = #wload(wrow.add(#kxl * a.wstride));)
            });
            let cols = (0..(x - 1) * s + k).map(|j| {
                let uses = (0..x).filter(|&p| j >= p * s && j - p * s < k).map(|p| {
                    let (c, w) = (&accs[p], format_ident!("w{}", j - p * s));
                    let f = fma(quote!(#c), quote!(xj), quote!(#w));
                    quote!(#c = #f;)
                });
                let jl = lit(j);
                quote! {
                    let xj = #load(row.offset((ix0 + #jl) * cs));
                    #(#uses)*
                }
            });
            let epis = accs.iter().enumerate().map(|(p, c)| {
                let pl = lit(p);
                epilogue(
                    v,
                    c,
                    quote!(b),
                    &Dest {
                        offset: quote!((oy * a.ow + ox as usize + #pl) * chans + c),
                        part: None,
                    },
                )
            });
            let kl = lit(k);
            quote! {
                let b = #wload(a.bias.add(c));
                #(#decls)*
                for ky in 0..#kl {
                    let iy = iy0 + ky as isize;
                    if iy < 0 || iy >= in_h {
                        continue;
                    }
                    let row = a.input.add(iy as usize * a.in_w * chans + c);
                    let wrow = a.weights.add(ky * #kl * a.wstride + c);
                    #(#ws)*
                    #(#cols)*
                }
                #(#epis)*
            }
        }
    };
    let (edge, part) = (block(false, false), block(false, true));
    let rows_loop = quote! {
        let cs = chans as isize;
            for oy in a.oy0..a.oy1 {
                let iy0 = (oy * #sh) as isize - pt;
                let mut ox = 0isize;
                while ox < ow {
                    let ix0 = ox * #sw as isize - pl;
                    let np = ((ow - ox) as usize).min(#xl);
                    let all_in = np == #xl && ix0 >= 0 && ix0 + reach <= in_w;
                    let mut c = 0;
                    while c + #ll <= chans {
                        if all_in {
                            #inside
                        } else {
                            #edge
                        }
                        c += #ll;
                    }
                    if c < chans {
                        let n = chans - c;
                        #part
                    }
                    ox += #xl as isize;
                }
            }
    };
    quote! {
        #[doc = #doc]
        #attrs
        pub unsafe fn #name(a: &DwArgs) {
            #prelude
            let (in_h, in_w, ow) = (a.in_h as isize, a.in_w as isize, a.ow as isize);
            let (pt, pl) = (a.pad_top as isize, a.pad_left as isize);
            let (lo, hi) = (#splat(a.min), #splat(a.max));
            // Input columns a block of pixels reads, from its first.
            let reach = ((#xl - 1) * #sw + (#kw - 1) * #dw + 1) as isize;
            // Pixels of 16 channels (the blocked NCHW mode's) get their own copy of the loop,
            // where every address is a constant offset from a row pointer.
            if a.channels == 16 {
                let chans = 16;
                #rows_loop
            } else {
                let chans = a.channels;
                #rows_loop
            }
        }
    }
}
