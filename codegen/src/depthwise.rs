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

use crate::simd::{helpers, simd, Simd};
use crate::{lit, registry_entry_with, DwLayout, DwSpec, Isa};
use proc_macro2::{Ident, TokenStream};
use quote::{format_ident, quote};

/// Output rows an NCHW kernel keeps in registers: each input row loaded feeds up to this
/// many output rows.
const ROWS: usize = 4;

/// Output pixels an NHWC kernel keeps in registers per channel vector (registers allowing).
fn pixels(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 => 8,
        _ => 4,
    }
}

/// All depthwise kernels of the table, one module per ISA, and their registry.
pub fn emit_all(specs: &[DwSpec]) -> TokenStream {
    let mut modules = TokenStream::new();
    for isa in Isa::ALL {
        let mine: Vec<&DwSpec> = specs.iter().filter(|s| s.isa == isa).collect();
        if mine.is_empty() {
            continue;
        }
        let v = simd(isa);
        let module = format_ident!("{}", isa.suffix());
        let cfg = isa.cfg();
        let uses = v.uses();
        let helpers = helpers(&v);
        let strided = strided_helpers(&v);
        let kernels = mine.iter().map(|s| match s.layout {
            DwLayout::Nchw => emit_nchw(&v, s),
            DwLayout::Nhwc => emit_nhwc(&v, s),
        });
        modules.extend(quote! {
            #cfg
            pub mod #module {
                #![allow(unused_unsafe, clippy::all)]
                use crate::algo::depthwise::DwArgs;
                #uses
                #helpers
                #strided
                #(#kernels)*
            }
        });
    }
    let entries = specs.iter().map(|s| {
        let layout = match s.layout {
            DwLayout::Nchw => quote!(crate::Layout::Nchw),
            DwLayout::Nhwc => quote!(crate::Layout::Nhwc),
        };
        let fixed = match s.shape {
            Some((k, st)) => {
                let (k, st) = (lit(k), lit(st));
                quote!(Some((#k, #st)))
            }
            None => quote!(None),
        };
        let module = format_ident!("{}", s.isa.suffix());
        let path = format_ident!("{}", s.name());
        registry_entry_with(
            "DwKernel",
            &s.name(),
            s.isa,
            quote!(#module::#path),
            quote!(layout: #layout, fixed: #fixed, lanes: #module::LANES as usize,),
        )
    });
    quote! {
        use crate::algo::depthwise::DwKernel;

        #modules

        /// Every f32 depthwise kernel compiled for this target, from the generator's table.
        pub static DW_F32_KERNELS: &[DwKernel] = &[#(#entries)*];
    }
}

/// Strided loads for the generic kernel, whose stride is known only at run time.
fn strided_helpers(v: &Simd) -> TokenStream {
    let attrs = v.attrs();
    let (ty, load) = (&v.ty, &v.load);
    let lanes = lit(v.lanes);
    quote! {
        /// The floats `p[0], p[s], …, p[(lanes-1)s]`.
        ///
        /// # Safety
        /// Those floats (and, for `s == 2`, the whole `2 x lanes` run from `p`) must be readable.
        #[inline]
        #attrs
        unsafe fn load_strided(p: *const f32, s: isize) -> #ty {
            if s == 1 {
                #load(p)
            } else if s == 2 && LANES > 1 {
                evens(#load(p), #load(p.add(#lanes)))
            } else {
                let mut t = [0.0f32; #lanes];
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
        unsafe fn load_strided_part(p: *const f32, s: isize, lo: isize, hi: isize) -> #ty {
            if s == 1 {
                load_part(p, lo, hi)
            } else if s == 2 && LANES > 1 {
                evens(
                    load_part(p, lo, hi),
                    load_part(p.wrapping_add(#lanes), lo - LANES, hi - LANES),
                )
            } else {
                let mut t = [0.0f32; #lanes];
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

/// Where an epilogue writes: the output offset (in floats), and `Some(n)` when only the first
/// `n` lanes are in the tensor.
struct Dest {
    offset: TokenStream,
    part: Option<TokenStream>,
}

/// bias, residual, clamp and store of one accumulator.
fn epilogue(v: &Simd, acc: &Ident, bias: TokenStream, dest: &Dest) -> TokenStream {
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
    };
    format!(
        " Depthwise f32, {what}, {} ({how}).\n\n # Safety\n The CPU must have the ISA, and \
         the pointers of `a` must cover the tensors its sizes describe.",
        spec.isa.suffix()
    )
}

/// A fixed-shape NCHW kernel, or the generic one.
fn emit_nchw(v: &Simd, spec: &DwSpec) -> TokenStream {
    let name = format_ident!("{}", spec.name());
    let doc = doc(spec);
    let attrs = v.attrs();
    let (zero, splat, fma) = (&v.zero, &v.splat, v.fma);
    let l = v.lanes;
    let ll = lit(l);
    let head = quote! {
        let (in_w, ow) = (a.in_w as isize, a.ow as isize);
        let (pt, pl) = (a.pad_top as isize, a.pad_left as isize);
        let bias = #splat(*a.bias);
        let (lo, hi) = (#splat(a.min), #splat(a.max));
    };
    let Some((k, s)) = spec.shape else {
        let acc = format_ident!("acc");
        let epi = |part: bool| {
            epilogue(
                v,
                &acc,
                quote!(bias),
                &Dest {
                    offset: quote!(oy * a.ow + ox as usize),
                    part: part.then(|| quote!(((ow - ox) as usize).min(#ll))),
                },
            )
        };
        let (epi_full, epi_part) = (epi(false), epi(true));
        let fma_tap = fma(
            quote!(acc),
            quote!(x),
            quote!(#splat(*a.weights.add(ky * a.kw + kx))),
        );
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
                for oy in a.oy0..a.oy1 {
                    let iy0 = oy as isize * sh - pt;
                    let mut ox = 0isize;
                    while ox < ow {
                        let ix0 = ox * sw - pl;
                        let inside = ox + LANES <= ow && ix0 >= 0 && ix0 + reach <= in_w;
                        let mut acc = #zero;
                        for ky in 0..a.kh {
                            let iy = iy0 + ky as isize * dh;
                            if iy < 0 || iy as usize >= a.in_h {
                                continue;
                            }
                            let row = a.input.add(iy as usize * a.in_w);
                            for kx in 0..a.kw {
                                let start = ix0 + kx as isize * dw;
                                let x = if inside {
                                    load_strided(row.offset(start), sw)
                                } else {
                                    load_strided_part(row.wrapping_offset(start), sw, -start, in_w - start)
                                };
                                acc = #fma_tap;
                            }
                        }
                        if inside {
                            #epi_full
                        } else {
                            #epi_part
                        }
                        ox += LANES;
                    }
                }
            }
        };
    };

    let paired = s == 2 && l > 1;
    // Floats one tap's vector load reads, from its first.
    let span = if paired { 2 * l } else { (l - 1) * s + 1 };
    let reach = lit(k - 1 + span);
    let weights = (0..k * k).map(|i| {
        let w = format_ident!("w{}", i);
        let i = lit(i);
        quote!(let #w = #splat(*a.weights.add(#i));)
    });
    let block = |rows: usize, inside: bool| {
        let accs: Vec<Ident> = (0..rows).map(|r| format_ident!("acc{}", r)).collect();
        let decls = accs.iter().map(|c| quote!(let mut #c = #zero;));
        let in_rows = (0..(rows - 1) * s + k).map(|j| {
            // (output row, kernel row) pairs this input row feeds.
            let uses: Vec<(usize, usize)> = (0..rows)
                .filter(|&r| j >= r * s && j - r * s < k)
                .map(|r| (r, j - r * s))
                .collect();
            let taps = (0..k).map(|kx_n| {
                let kx = lit(kx_n);
                let load = match (inside, paired) {
                    (true, false) => {
                        let load = &v.load;
                        quote!(#load(p.add(#kx)))
                    }
                    (true, true) => {
                        let (load, kx2) = (&v.load, lit(kx_n + l));
                        quote!(evens(#load(p.add(#kx)), #load(p.add(#kx2))))
                    }
                    (false, false) => {
                        quote!(load_part(p.wrapping_add(#kx), -(ix0 + #kx), in_w - (ix0 + #kx)))
                    }
                    (false, true) => quote! {
                        evens(
                            load_part(p.wrapping_add(#kx), -(ix0 + #kx), in_w - (ix0 + #kx)),
                            load_part(p.wrapping_add(#kx + #ll), -(ix0 + #kx + #ll), in_w - (ix0 + #kx + #ll)),
                        )
                    },
                };
                let fmas = uses.iter().map(|&(r, ky)| {
                    let c = &accs[r];
                    let w = format_ident!("w{}", ky * k + kx_n);
                    let f = fma(quote!(#c), quote!(x), quote!(#w));
                    quote!(#c = #f;)
                });
                quote! {
                    let x = #load;
                    #(#fmas)*
                }
            });
            let j = lit(j);
            quote! {
                let iy = iy0 + #j;
                if iy >= 0 && (iy as usize) < a.in_h {
                    let p = a.input.wrapping_offset(iy * in_w + ix0);
                    #(#taps)*
                }
            }
        });
        let epis = accs.iter().enumerate().map(|(r, c)| {
            let r = lit(r);
            epilogue(
                v,
                c,
                quote!(bias),
                &Dest {
                    offset: quote!((oy + #r) * a.ow + ox as usize),
                    part: (!inside).then(|| quote!(((ow - ox) as usize).min(#ll))),
                },
            )
        });
        quote! {
            #(#decls)*
            #(#in_rows)*
            #(#epis)*
        }
    };
    let row_loop = |rows: usize| {
        let (full, edge) = (block(rows, true), block(rows, false));
        let (rows, s) = (lit(rows), lit(s));
        quote! {
            let iy0 = (oy * #s) as isize - pt;
            let mut ox = 0isize;
            while ox < ow {
                let ix0 = ox * #s - pl;
                if ox + LANES <= ow && ix0 >= 0 && ix0 + #reach <= in_w {
                    #full
                } else {
                    #edge
                }
                ox += LANES;
            }
            oy += #rows;
        }
    };
    let (many, one) = (row_loop(ROWS), row_loop(1));
    let rows = lit(ROWS);
    quote! {
        #[doc = #doc]
        #attrs
        pub unsafe fn #name(a: &DwArgs) {
            #head
            #(#weights)*
            let mut oy = a.oy0;
            while oy + #rows <= a.oy1 {
                #many
            }
            while oy < a.oy1 {
                #one
            }
        }
    }
}

/// A fixed-shape NHWC kernel, or the generic one, with its one-pixel helpers.
fn emit_nhwc(v: &Simd, spec: &DwSpec) -> TokenStream {
    let name = format_ident!("{}", spec.name());
    let (pixel, pixel_part) = (
        format_ident!("{}_pixel", spec.name()),
        format_ident!("{}_pixel_part", spec.name()),
    );
    let doc = doc(spec);
    let attrs = v.attrs();
    let (zero, splat, load, fma) = (&v.zero, &v.splat, &v.load, v.fma);
    let x = pixels(spec.isa);
    let xl = lit(x);
    let ll = lit(v.lanes);

    // Taps of one output pixel at channel `c`, each column and row checked; `part`: only
    // `n` channels are left.
    let one_pixel = |part: bool| {
        let xload = if part {
            quote!(load_part(row.add(ix as usize * a.channels), 0, n as isize))
        } else {
            quote!(#load(row.add(ix as usize * a.channels)))
        };
        let f = fma(quote!(acc), quote!(x), quote!(w));
        let tap = quote! {
            let x = #xload;
            let w = #load(a.weights.add(tap * a.wstride + c));
            acc = #f;
        };
        let acc = format_ident!("acc");
        let epi = epilogue(
            v,
            &acc,
            quote!(#load(a.bias.add(c))),
            &Dest {
                offset: quote!((oy * a.ow + ox as usize) * a.channels + c),
                part: part.then(|| quote!(n)),
            },
        );
        let taps = match spec.shape {
            Some((k, s)) => {
                let (k, s) = (lit(k), lit(s));
                quote! {
                    let (iy0, ix0) = ((oy * #s) as isize - pt, ox * #s - pl);
                    for ky in 0..#k {
                        let iy = iy0 + ky as isize;
                        if iy < 0 || iy as usize >= a.in_h {
                            continue;
                        }
                        let row = a.input.add(iy as usize * a.in_w * a.channels + c);
                        for kx in 0..#k {
                            let ix = ix0 + kx as isize;
                            if ix < 0 || ix as usize >= a.in_w {
                                continue;
                            }
                            let tap = ky * #k + kx;
                            #tap
                        }
                    }
                }
            }
            None => quote! {
                let (iy0, ix0) = (oy as isize * a.sh as isize - pt, ox * a.sw as isize - pl);
                for ky in 0..a.kh {
                    let iy = iy0 + (ky * a.dh) as isize;
                    if iy < 0 || iy as usize >= a.in_h {
                        continue;
                    }
                    let row = a.input.add(iy as usize * a.in_w * a.channels + c);
                    for kx in 0..a.kw {
                        let ix = ix0 + (kx * a.dw) as isize;
                        if ix < 0 || ix as usize >= a.in_w {
                            continue;
                        }
                        let tap = ky * a.kw + kx;
                        #tap
                    }
                }
            },
        };
        quote! {
            let (pt, pl) = (a.pad_top as isize, a.pad_left as isize);
            let (lo, hi) = (#splat(a.min), #splat(a.max));
            let mut acc = #zero;
            #taps
            #epi
        }
    };
    let (body_full, body_part) = (one_pixel(false), one_pixel(true));

    // `x` pixels of a row at channel `c`, every tap column inside the image.
    let accs: Vec<Ident> = (0..x).map(|p| format_ident!("acc{}", p)).collect();
    let decls = accs.iter().map(|c| quote!(let mut #c = #zero;));
    let epis = accs.iter().enumerate().map(|(p, c)| {
        let p = lit(p);
        epilogue(
            v,
            c,
            quote!(b),
            &Dest {
                offset: quote!((oy * a.ow + ox as usize + #p) * a.channels + c),
                part: None,
            },
        )
    });
    let (block_taps, reach, sx) = match spec.shape {
        Some((k, s)) => {
            let fmas = (0..x).map(|p| {
                let c = &accs[p];
                let off = lit(p * s);
                let f = fma(
                    quote!(#c),
                    quote!(#load(row.offset((ix0 + #off + kx as isize) * cs))),
                    quote!(w),
                );
                quote!(#c = #f;)
            });
            let taps = quote! {
                for ky in 0..#k {
                    let iy = iy0 + ky as isize;
                    if iy < 0 || iy as usize >= a.in_h {
                        continue;
                    }
                    let row = a.input.add(iy as usize * a.in_w * a.channels + c);
                    for kx in 0..#k {
                        let w = #load(a.weights.add((ky * #k + kx) * a.wstride + c));
                        #(#fmas)*
                    }
                }
            };
            let (k, s) = (lit(k), lit(s));
            (
                taps,
                quote!(((#xl - 1) * #s + #k) as isize),
                quote!(#s as isize),
            )
        }
        None => {
            let fmas = (0..x).map(|p| {
                let c = &accs[p];
                let p = lit(p);
                let f = fma(
                    quote!(#c),
                    quote!(#load(row.offset((ix0 + #p * sw + (kx * a.dw) as isize) * cs))),
                    quote!(w),
                );
                quote!(#c = #f;)
            });
            let taps = quote! {
                for ky in 0..a.kh {
                    let iy = iy0 + (ky * a.dh) as isize;
                    if iy < 0 || iy as usize >= a.in_h {
                        continue;
                    }
                    let row = a.input.add(iy as usize * a.in_w * a.channels + c);
                    for kx in 0..a.kw {
                        let w = #load(a.weights.add((ky * a.kw + kx) * a.wstride + c));
                        #(#fmas)*
                    }
                }
            };
            (
                taps,
                quote!((#xl - 1) * sw + ((a.kw - 1) * a.dw) as isize + 1),
                quote!(a.sw as isize),
            )
        }
    };
    let sh = match spec.shape {
        Some((_, s)) => {
            let s = lit(s);
            quote!(#s as isize)
        }
        None => quote!(a.sh as isize),
    };
    quote! {
        /// One output pixel at channel `c` (a whole vector of channels).
        #[inline]
        #attrs
        unsafe fn #pixel(a: &DwArgs, oy: usize, ox: isize, c: usize) {
            #body_full
        }

        /// One output pixel at channel `c`, where only `n < lanes` channels are left.
        #[inline]
        #attrs
        unsafe fn #pixel_part(a: &DwArgs, oy: usize, ox: isize, c: usize, n: usize) {
            #body_part
        }

        #[doc = #doc]
        #attrs
        pub unsafe fn #name(a: &DwArgs) {
            let (in_w, ow) = (a.in_w as isize, a.ow as isize);
            let (pt, pl) = (a.pad_top as isize, a.pad_left as isize);
            let cs = a.channels as isize;
            let (lo, hi) = (#splat(a.min), #splat(a.max));
            let sw = #sx;
            let reach = #reach;
            for oy in a.oy0..a.oy1 {
                let iy0 = oy as isize * #sh - pt;
                let mut ox = 0isize;
                while ox < ow {
                    let ix0 = ox * sw - pl;
                    if ox + #xl <= ow && ix0 >= 0 && ix0 + reach <= in_w {
                        let mut c = 0;
                        while c + #ll <= a.channels {
                            let b = #load(a.bias.add(c));
                            #(#decls)*
                            #block_taps
                            #(#epis)*
                            c += #ll;
                        }
                        if c < a.channels {
                            for p in 0..#xl {
                                #pixel_part(a, oy, ox + p, c, a.channels - c);
                            }
                        }
                        ox += #xl;
                    } else {
                        let mut c = 0;
                        while c + #ll <= a.channels {
                            #pixel(a, oy, ox, c);
                            c += #ll;
                        }
                        if c < a.channels {
                            #pixel_part(a, oy, ox, c, a.channels - c);
                        }
                        ox += 1;
                    }
                }
            }
        }
    }
}
