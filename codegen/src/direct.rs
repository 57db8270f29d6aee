//! The direct NCHW kernel emitter: dense and grouped convolutions computed straight from the
//! input planes, without im2col.
//!
//! One call computes `ocb` output channels of a group over a band of output rows, summing
//! over the group's input channels. It keeps `ocb x rows` vectors of outputs in registers and
//! vectorises along the row, as the depthwise plane kernels do: each input vector loaded feeds
//! every output row and channel it reaches, and each weight is a broadcast operand of its
//! multiply-add. That suits what GEMM does badly: few input channels (stems, whose K is tiny)
//! and few channels per group (ResNeXt's 4).

use crate::depthwise::{edge_masks, epilogue, input_row, row_blocks, row_uses, tap_load, Dest};
use crate::simd::Simd;
use crate::{lit, registry_entry_with, DirectSpec, Isa};
use proc_macro2::{Ident, TokenStream};
use quote::{format_ident, quote};

/// Output channels one call computes (the weights are packed in blocks of this many).
/// Output rows kept in registers: `ocb x rows` accumulators must fit beside the loads (16
/// of 32 registers, 8 of 16).
fn rows(spec: &DirectSpec) -> usize {
    let accumulators = match spec.isa {
        Isa::Avx512 | Isa::Neon => 16,
        Isa::Avx2 | Isa::Scalar => 8,
    };
    (accumulators / spec.ocb).max(1)
}

pub fn registry_entry(spec: &DirectSpec) -> TokenStream {
    let module = format_ident!("{}", spec.isa.suffix());
    let path = format_ident!("{}", spec.name());
    let (k, s) = (lit(spec.shape.0), lit(spec.shape.1));
    let (ocb, rows) = (lit(spec.ocb), lit(rows(spec)));
    registry_entry_with(
        "DirectKernel",
        &spec.name(),
        spec.isa,
        quote!(#module::#path),
        quote!(fixed: (#k, #s), ocb: #ocb, rows: #rows,),
    )
}

pub fn emit(v: &Simd, spec: &DirectSpec) -> TokenStream {
    let ocb_n = spec.ocb;
    let name = format_ident!("{}", spec.name());
    let (k, s) = spec.shape;
    let l = v.lanes;
    // Stride 4 with a 4-wide kernel (a patchify stem): each input row's four phases come from
    // four vectors by two rounds of even/odd lanes, shared by the four taps.
    let quad = s == 4 && k == 4 && l > 1;
    assert!(
        s <= 2 || quad || l == 1,
        "{}: vector loads are strided by 1 or 2, or 4 with a 4-wide kernel",
        spec.name()
    );
    let doc = format!(
        " Direct f32 convolution, {k}x{k} stride {s}, NCHW, {}: output channels `0..noc` \
         (at most {ocb_n}) of one group over output rows `oy0..oy1`, summed over the group's \
         `cin` input planes; `weights` packed `[cin][{k}x{k}][{ocb_n}]`, `bias` {ocb_n} values.\n\n \
         # Safety\n The CPU must have the ISA, and the pointers of `a` must cover the tensors \
         its sizes describe.",
        spec.isa.suffix()
    );
    let attrs = v.attrs();
    let (zero, splat, fma) = (&v.zero, &v.splat, v.fma);
    let ll = lit(l);
    let r_n = rows(spec);
    let paired = s == 2 && l > 1;
    // Floats of a row the block's loads reach, from its first column.
    let reach = match (paired, quad) {
        (_, true) => 4 * l,
        (true, _) => k - 1 + 2 * l,
        _ => k - 1 + (l - 1) * s + 1,
    };
    let accs: Vec<Vec<Ident>> = (0..ocb_n)
        .map(|o| (0..r_n).map(|r| format_ident!("acc{}_{}", o, r)).collect())
        .collect();
    let block = |inside: bool| {
        let decls = accs.iter().flatten().map(|c| quote!(let mut #c = #zero;));
        let in_rows = (0..(r_n - 1) * s + k).map(|j| {
            let uses = row_uses(j, r_n, s, k);
            let phases = quad.then(|| quad_phases(v, inside));
            let taps = (0..k).map(|kx| {
                let load = if quad {
                    let x = format_ident!("x{}", kx);
                    quote!(#x)
                } else {
                    tap_load(v, inside, paired, kx)
                };
                let fmas = uses
                    .iter()
                    .flat_map(|&(r, ky)| (0..ocb_n).map(move |o| (r, ky, o)))
                    .map(|(r, ky, o)| {
                        let c = &accs[o][r];
                        let w = lit((ky * k + kx) * ocb_n + o);
                        let f = fma(quote!(#c), quote!(x), quote!(#splat(*wi.add(#w))));
                        quote!(#c = #f;)
                    });
                quote! {
                    let x = #load;
                    #(#fmas)*
                }
            });
            input_row(j, quote!(plane), quote!(#phases #(#taps)*))
        });
        let epis = accs
            .iter()
            .enumerate()
            .flat_map(|(o, row)| row.iter().enumerate().map(move |(r, c)| (o, r, c)))
            .map(|(o, r, c)| {
                let (ol, rl, b) = (lit(o), lit(r), format_ident!("b{}", o));
                let e = epilogue(
                    v,
                    c,
                    quote!(#b),
                    &Dest {
                        offset: quote!(#ol * ohw + (oy + #rl) * a.ow + ox as usize),
                        part: (!inside).then(|| quote!(((ow - ox) as usize).min(#ll))),
                    },
                );
                // Channels past `noc` and rows past the band are computed but not stored.
                match (o, r) {
                    (0, 0) => e,
                    (0, _) => quote!(if #rl < rows_left { #e }),
                    (_, 0) => quote!(if #ol < a.noc { #e }),
                    _ => quote!(if #ol < a.noc && #rl < rows_left { #e }),
                }
            });
        let taps_per_channel = lit(k * k * ocb_n);
        let masks = match (inside, quad) {
            (true, _) => quote!(),
            (false, true) => quad_masks(v),
            (false, false) => edge_masks(v, paired, k),
        };
        quote! {
            #(#decls)*
            #masks
            for i in 0..a.cin {
                let plane = a.input.add(i * a.in_h * a.in_w);
                let wi = a.weights.add(i * #taps_per_channel);
                #(#in_rows)*
            }
            #(#epis)*
        }
    };
    let body = row_blocks(r_n, s, reach, block(true), block(false));
    let biases = (0..ocb_n).map(|o| {
        let (b, ol) = (format_ident!("b{}", o), lit(o));
        quote!(let #b = #splat(*a.bias.add(#ol));)
    });
    quote! {
        #[doc = #doc]
        #attrs
        pub unsafe fn #name(a: &DirectArgs) {
            let (in_w, ow) = (a.in_w as isize, a.ow as isize);
            let (pt, pl) = (a.pad_top as isize, a.pad_left as isize);
            let ohw = a.oh * a.ow;
            let (lo, hi) = (#splat(a.min), #splat(a.max));
            #(#biases)*
            #body
        }
    }
}

/// The four phases `x0..x3` of the `4 x lanes` floats of row `p`: `x{r}` holds every fourth
/// float from the `r`-th. Edge blocks load the four vectors under the masks of [`quad_masks`].
fn quad_phases(v: &Simd, inside: bool) -> TokenStream {
    let load = &v.load;
    let vs = (0..4).map(|q| {
        let (vq, off) = (format_ident!("v{}", q), lit(q * v.lanes));
        let mq = format_ident!("mq{}", q);
        if inside {
            quote!(let #vq = #load(p.add(#off));)
        } else {
            quote!(let #vq = load_masked(p.wrapping_add(#off), #mq);)
        }
    });
    quote! {
        #(#vs)*
        let (e01, o01) = (evens(v0, v1), odds(v0, v1));
        let (e23, o23) = (evens(v2, v3), odds(v2, v3));
        let (x0, x2) = (evens(e01, e23), odds(e01, e23));
        let (x1, x3) = (evens(o01, o23), odds(o01, o23));
    }
}

/// The lane masks of an edge block's four vectors of a row (see [`quad_phases`]).
fn quad_masks(v: &Simd) -> TokenStream {
    let ms = (0..4).map(|q| {
        let (mq, off) = (format_ident!("mq{}", q), lit(q * v.lanes));
        quote!(let #mq = part_mask(-(ix0 + #off), in_w - (ix0 + #off));)
    });
    quote!(#(#ms)*)
}
