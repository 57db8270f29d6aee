//! The f32 GEMM microkernel emitter.
//!
//! A microkernel computes an `mr` x `nr` tile `C = A·B` over `kc` steps from packed panels
//! (A: `kc` columns of `mr` values, B: `kc` rows of `nr` values, both zero-padded), keeping
//! the whole tile in registers; variants read B through row pointers (im2col's shifted rows)
//! or A from strided rows (Winograd's transformed tiles), see [`Feed`]. Then, in registers: optional accumulation into C (K-blocks
//! after the first), and on the last K-block the fused epilogue (bias by row or by column,
//! residual, clamp). Partial tiles at the edges of C go through a stack tile and
//! `crate::gemm::store_edge`, so the kernel never touches memory outside `m` x `n`.

use crate::simd::Simd;
use crate::{lit, registry_entry, GemmSpec, Isa};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// The SIMD spelling of `isa`; None for scalar, whose GEMM kernel is plain loops.
fn simd(isa: Isa) -> Option<Simd> {
    (isa != Isa::Scalar).then(|| crate::simd::simd(isa))
}

/// All GEMM kernels of the table and their registry.
pub fn emit_all(specs: &[GemmSpec]) -> TokenStream {
    let kernels: Vec<TokenStream> = specs.iter().map(emit_kernel).collect();
    let entries: Vec<TokenStream> = specs
        .iter()
        .map(|s| {
            let (mr, nr) = (s.mr, s.nr);
            let some = |name: String| {
                let f = format_ident!("{}", name);
                quote!(Some(#f))
            };
            let simd = simd(s.isa).is_some();
            let half = half_width(s).map_or(quote!(None), |_| some(half_name(s)));
            let rows = if simd {
                some(format!("{}_rows", s.name()))
            } else {
                quote!(None)
            };
            let half_rows = match half_width(s) {
                Some(_) => some(format!("{}_rows", half_name(s))),
                None => quote!(None),
            };
            let short = if short_rows(s).is_some() {
                some(format!("{}_short", s.name()))
            } else {
                quote!(None)
            };
            let a_rows = format_ident!("{}_arows", s.name());
            let a_rows_edge = edge_rows(s).map(|r| format_ident!("{}", edge_name(s, r)));
            let narrow = narrow_cols(s).into_iter().map(|cols| {
                let name = narrow_name(s, cols);
                let (func, rows) = (format_ident!("{}", name), format_ident!("{}_rows", name));
                quote!(crate::gemm::NarrowGemm { cols: #cols, func: #func, rows: #rows },)
            });
            let fields = quote!(mr: #mr, nr: #nr, half: #half, short: #short, rows: #rows, half_rows: #half_rows, a_rows: #a_rows, a_rows_edge: &[#(#a_rows_edge),*], narrow: &[#(#narrow)*],);
            registry_entry(&s.name(), s.isa, fields)
        })
        .collect();
    quote! {
        use crate::gemm::{store_edge, GemmEpilogue, GemmKernel};

        #(#kernels)*

        /// Every f32 GEMM microkernel compiled for this target, from the generator's table.
        pub static GEMM_F32_KERNELS: &[GemmKernel] = &[#(#entries)*];
    }
}

/// Columns of the half-width edge kernel, where the ISA has one: a last micro-panel with at
/// most `nr/2` columns then costs half the products (196 pixels are 6 full 32-wide panels and
/// one half, not 7 full ones).
fn half_width(spec: &GemmSpec) -> Option<usize> {
    let lanes = simd(spec.isa)?.lanes;
    let half = spec.nr / 2;
    (half >= lanes && half.is_multiple_of(lanes)).then_some(half)
}

/// Rows of the short edge kernel: half the tile, where that still keeps enough accumulators
/// (8, two vectors a row) to hide the multiply-add latency. A last register block of at most
/// `mr/2` rows (a batch of Winograd tiles that does not fill the tile) then costs half.
fn short_rows(spec: &GemmSpec) -> Option<usize> {
    let v = simd(spec.isa)?;
    let rows = spec.mr / 2;
    (rows * spec.nr / v.lanes >= 8 && rows >= 2).then_some(rows)
}

/// The vectors a narrow kernel keeps a column of C in (`mr` rows as whole vectors), where the
/// ISA has a width that divides `mr`: AVX-512's 8-row panels in one ymm, NEON's in two.
fn narrow_simd(spec: &GemmSpec) -> Option<Simd> {
    let v = match spec.isa {
        Isa::Avx512 => crate::simd::simd_ymm(),
        Isa::Neon => crate::simd::simd(Isa::Neon),
        Isa::Scalar | Isa::Avx2 => return None,
    };
    spec.mr.is_multiple_of(v.lanes).then_some(v)
}

/// Columns of the narrow edge kernels (narrowest first), those below the half-width kernel's
/// or the full tile's width.
fn narrow_cols(spec: &GemmSpec) -> Vec<usize> {
    if narrow_simd(spec).is_none() {
        return Vec::new();
    }
    let widest = half_width(spec).unwrap_or(spec.nr);
    [4, 8].into_iter().filter(|&c| c < widest).collect()
}

/// Rows of the strided-A edge kernels: every count below `mr` (SIMD ISAs), so that a last
/// block of a few Winograd tiles costs its rows, not a whole register block's.
fn edge_rows(spec: &GemmSpec) -> impl Iterator<Item = usize> {
    let n = if simd(spec.isa).is_some() { spec.mr } else { 1 };
    1..n
}

fn edge_name(spec: &GemmSpec, rows: usize) -> String {
    format!("{}_arows{rows}", spec.name())
}

fn narrow_name(spec: &GemmSpec, cols: usize) -> String {
    format!("{}_narrow{cols}", spec.name())
}

fn half_name(spec: &GemmSpec) -> String {
    format!("{}_half", spec.name())
}

fn emit_kernel(spec: &GemmSpec) -> TokenStream {
    let Some(v) = simd(spec.isa) else {
        let mut out = emit_scalar(spec, Feed::Packed);
        out.extend(emit_scalar(spec, Feed::ARows));
        return out;
    };
    let mut out = TokenStream::new();
    for feed in [Feed::Packed, Feed::BRows] {
        let name = format!("{}{}", spec.name(), feed.suffix());
        out.extend(emit_simd(spec, &v, spec.nr, &name, feed, spec.mr));
        if let Some(cols) = half_width(spec) {
            let name = format!("{}{}", half_name(spec), feed.suffix());
            out.extend(emit_simd(spec, &v, cols, &name, feed, spec.mr));
        }
    }
    let name = format!("{}{}", spec.name(), Feed::ARows.suffix());
    out.extend(emit_simd(spec, &v, spec.nr, &name, Feed::ARows, spec.mr));
    for rows in edge_rows(spec) {
        out.extend(emit_simd(
            spec,
            &v,
            spec.nr,
            &edge_name(spec, rows),
            Feed::ARows,
            rows,
        ));
    }
    if let Some(m) = short_rows(spec) {
        let name = format!("{}_short", spec.name());
        out.extend(emit_simd(spec, &v, spec.nr, &name, Feed::Packed, m));
    }
    if let Some(nv) = narrow_simd(spec) {
        for cols in narrow_cols(spec) {
            for feed in [Feed::Packed, Feed::BRows] {
                let name = format!("{}{}", narrow_name(spec, cols), feed.suffix());
                out.extend(emit_narrow(spec, &nv, cols, &name, feed));
            }
        }
    }
    out
}

/// Where a kernel reads its operands from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Feed {
    /// Packed panels: A `kc` columns of `mr` values, B `kc` rows of `nr` values.
    Packed,
    /// A packed; B step `k` is the row at `b_rows[k] + b_off` (a shifted copy of the input,
    /// so the B panel needs no packing at all).
    BRows,
    /// B packed; A row `i` is `kc` contiguous floats at `a + i*rs_a` (Winograd's transformed
    /// tiles, written there by the input transform, so the A panel needs no transposing).
    ARows,
}

impl Feed {
    fn suffix(self) -> &'static str {
        match self {
            Feed::Packed => "",
            Feed::BRows => "_rows",
            Feed::ARows => "_arows",
        }
    }
}

/// The rustdoc of a kernel computing `rows` of the `mr` rows and `cols` of the `nr` columns.
fn doc(spec: &GemmSpec, rows: usize, cols: usize, feed: Feed) -> String {
    let what = if rows < spec.mr {
        format!(
            "{rows}x{} f32 GEMM edge microkernel: the first {rows} rows of {}-row A panels",
            spec.nr, spec.mr
        )
    } else if cols < spec.nr {
        format!(
            "{}x{} f32 GEMM edge microkernel: the first {cols} columns of {}-wide B panels",
            spec.mr, cols, spec.nr
        )
    } else {
        format!("{}x{} f32 GEMM microkernel", spec.mr, spec.nr)
    };
    let (mr, nr) = (spec.mr, spec.nr);
    let operands = match feed {
        Feed::Packed => format!("`a` holds `kc*{mr}` and `b` `kc*{nr}` readable floats"),
        Feed::BRows => {
            format!("`a` holds `kc*{mr}` readable floats and each `b_rows[k] + b_off` `{nr}`")
        }
        Feed::ARows => {
            format!("each `a + i*rs_a` (`i < {rows}`) holds `kc` readable floats and `b` `kc*{nr}`")
        }
    };
    format!(
        " {what} ({}): C[m x n] = A · B over `kc` steps, then the epilogue.\n\n \
         # Safety\n The CPU must have the ISA; {operands}; `c` (and the epilogue's bias and \
         residual) are valid for `m <= {rows}` rows of stride `rs_c` and `n <= {cols}` columns.",
        spec.isa.suffix(),
    )
}

/// A kernel computing `cols` of the `nr` columns of each B panel (`cols == nr`: the full one),
/// its operands read as `feed` says.
///
/// `m_rows` (at most `mr`) is the rows it computes: packed A panels still hold `mr` values a
/// step.
fn emit_simd(
    spec: &GemmSpec,
    v: &Simd,
    cols: usize,
    name: &str,
    feed: Feed,
    m_rows: usize,
) -> TokenStream {
    assert!(
        spec.nr.is_multiple_of(v.lanes) && cols.is_multiple_of(v.lanes),
        "{}: nr must be a multiple of the vector width",
        spec.name()
    );
    let (mr, nr, lanes) = (m_rows, spec.nr, v.lanes);
    let nv = cols / lanes;
    let name = format_ident!("{}", name);
    let doc = doc(spec, m_rows, cols, feed);
    let a_step = lit(if feed == Feed::ARows { 1 } else { spec.mr });
    let (attrs, uses) = (v.attrs(), v.uses());
    let (zero, load, store, splat, add, min, max) =
        (&v.zero, &v.load, &v.store, &v.splat, &v.add, &v.min, &v.max);

    // Fewer than 8 accumulators cannot hide the multiply-add latency (4 cycles on two
    // ports): a strided-A edge kernel of a few rows sends alternate K steps to separate sets
    // of accumulators, summed after the loop.
    let sets = if feed == Feed::ARows {
        8usize.div_ceil(mr * nv)
    } else {
        1
    };
    let acc = |i: usize, j: usize| format_ident!("c{}_{}", i, j);
    let acc_in = |s: usize, i: usize, j: usize| {
        if s == 0 {
            acc(i, j)
        } else {
            format_ident!("s{}_{}_{}", s, i, j)
        }
    };
    let all: Vec<(usize, usize)> = (0..mr).flat_map(|i| (0..nv).map(move |j| (i, j))).collect();
    let decls = (0..sets).flat_map(|s| {
        all.iter().map(move |&(i, j)| {
            let c = acc_in(s, i, j);
            quote!(let mut #c = #zero;)
        })
    });
    // One K step into set `s`: B's row at `b + s*nr`, A's column `s` on.
    let step = |s: usize| {
        let b_loads = (0..nv).map(|j| {
            let b = format_ident!("b{}", j);
            let off = lit(s * nr + j * lanes);
            quote!(let #b = #load(b.add(#off));)
        });
        let fmas = (0..mr).map(|i| {
            let body = (0..nv).map(|j| {
                let c = acc_in(s, i, j);
                let b = format_ident!("b{}", j);
                let f = (v.fma)(quote!(#c), quote!(a_i), quote!(#b));
                quote!(#c = #f;)
            });
            let a_i = if feed == Feed::ARows {
                let (i, s) = (lit(i), lit(s));
                quote!(*a.add(#i * rs_a + #s))
            } else {
                let i = lit(s * spec.mr + i);
                quote!(*a.add(#i))
            };
            quote! {
                let a_i = #splat(#a_i);
                #(#body)*
            }
        });
        quote! {
            #(#b_loads)*
            #(#fmas)*
        }
    };
    let sums = (1..sets).flat_map(|s| {
        all.iter().map(move |&(i, j)| {
            let (c0, c) = (acc(i, j), acc_in(s, i, j));
            quote!(#c0 = #add(#c0, #c);)
        })
    });
    let per_acc = |f: &dyn Fn(usize, usize, &proc_macro2::Ident) -> TokenStream| {
        all.iter()
            .map(|&(i, j)| f(i, j, &acc(i, j)))
            .collect::<Vec<_>>()
    };
    let accumulate = per_acc(&|i, j, c| {
        let (i, off) = (lit(i), lit(j * lanes));
        quote!(#c = #add(#c, #load(c.offset(#i * rs_c).add(#off)));)
    });
    let bias_row = (0..mr).map(|i| {
        let cs = (0..nv).map(|j| acc(i, j));
        let i = lit(i);
        quote! {
            let bi = #splat(*ep.bias.add(#i));
            #( #cs = #add(#cs, bi); )*
        }
    });
    let bias_col = (0..nv).map(|j| {
        let cs = (0..mr).map(|i| acc(i, j));
        let off = lit(j * lanes);
        quote! {
            let bj = #load(ep.bias.add(#off));
            #( #cs = #add(#cs, bj); )*
        }
    });
    let residual = per_acc(&|i, j, c| {
        let (i, off) = (lit(i), lit(j * lanes));
        quote!(#c = #add(#c, #load(ep.residual.offset(#i * ep.rs_residual).add(#off)));)
    });
    let clamp = per_acc(&|_, _, c| quote!(#c = #min(#max(#c, lo), hi);));
    let stores = per_acc(&|i, j, c| {
        let (i, off) = (lit(i), lit(j * lanes));
        quote!(#store(c.offset(#i * rs_c).add(#off), #c);)
    });
    let spills = per_acc(&|i, j, c| {
        let off = lit(i * cols + j * lanes);
        quote!(#store(tile.as_mut_ptr().add(#off), #c);)
    });
    let tile_len = lit(mr * cols);
    let (mr, nr, cols) = (lit(mr), lit(nr), lit(cols));
    let one_step = step(0);
    let b_loop = if feed == Feed::BRows {
        quote! {
            let mut a = a;
            for k in 0..kc {
                let b = (*b_rows.add(k)).add(b_off);
                #one_step
                a = a.add(#a_step);
            }
        }
    } else if sets == 1 {
        quote! {
            let (mut a, mut b) = (a, b);
            for _ in 0..kc {
                #one_step
                a = a.add(#a_step);
                b = b.add(#nr);
            }
        }
    } else {
        let unrolled = (0..sets).map(step);
        let sets = lit(sets);
        quote! {
            let (mut a, mut b, mut k) = (a, b, 0);
            while k + #sets <= kc {
                #(#unrolled)*
                a = a.add(#sets * #a_step);
                b = b.add(#sets * #nr);
                k += #sets;
            }
            while k < kc {
                #one_step
                a = a.add(#a_step);
                b = b.add(#nr);
                k += 1;
            }
            #(#sums)*
        }
    };

    let body = quote! {
            #uses
            #(#decls)*
            #b_loop
            if m == #mr && n == #cols {
                if ep.accumulate {
                    #(#accumulate)*
                }
                if ep.last {
                    if !ep.bias.is_null() {
                        if ep.bias_per_row {
                            #(#bias_row)*
                        } else {
                            #(#bias_col)*
                        }
                    }
                    if !ep.residual.is_null() {
                        #(#residual)*
                    }
                    let (lo, hi) = (#splat(ep.min), #splat(ep.max));
                    #(#clamp)*
                }
                #(#stores)*
            } else {
                let mut tile = [0.0f32; #tile_len];
                #(#spills)*
                store_edge(&tile, (#cols, 1), c, rs_c, m, n, ep);
            }
    };
    kernel_fn(&name, &doc, &attrs, feed, body)
}

/// A narrow edge kernel: all `mr` rows of the A panel by the first `cols` columns of B, with
/// one column of C in `mr / lanes` vectors. A step loads the A panel's column as vectors and
/// broadcasts each B value, so a B panel of a few columns costs `cols` vector multiply-adds a
/// step, not the `nr / 2`-wide half kernel's `mr`. With few columns the accumulators would be
/// too few to hide the multiply-add latency (8 chains: 4 cycles on two ports), so alternate
/// K steps go to separate sets of accumulators, summed at the end. The tile goes to C through
/// the stack and `store_edge` (a tile of columns); `feed` as for [`emit_simd`] (A packed).
fn emit_narrow(spec: &GemmSpec, v: &Simd, cols: usize, name: &str, feed: Feed) -> TokenStream {
    let (mr, nr, lanes) = (spec.mr, spec.nr, v.lanes);
    let rv = mr / lanes;
    let sets = 8usize.div_ceil(cols * rv).max(1);
    let name = format_ident!("{}", name);
    let (attrs, uses) = (v.attrs(), v.uses());
    let (zero, load, store, splat, add) = (&v.zero, &v.load, &v.store, &v.splat, &v.add);
    let acc = |s: usize, j: usize, r: usize| format_ident!("c{}_{}_{}", s, j, r);
    let all: Vec<(usize, usize, usize)> = (0..sets)
        .flat_map(|s| (0..cols).flat_map(move |j| (0..rv).map(move |r| (s, j, r))))
        .collect();
    let decls = all.iter().map(|&(s, j, r)| {
        let c = acc(s, j, r);
        quote!(let mut #c = #zero;)
    });
    // One K step into set `s`: A at `a + s*mr`, B's row at `bk`.
    let step = |s: usize, bk: TokenStream| {
        let a_loads = (0..rv).map(|r| {
            let (x, off) = (format_ident!("a{}", r), lit(s * mr + r * lanes));
            quote!(let #x = #load(a.add(#off));)
        });
        let fmas = (0..cols).map(|j| {
            let body = (0..rv).map(|r| {
                let (c, x) = (acc(s, j, r), format_ident!("a{}", r));
                let f = (v.fma)(quote!(#c), quote!(#x), quote!(bj));
                quote!(#c = #f;)
            });
            let j = lit(j);
            quote! {
                let bj = #splat(*bk.add(#j));
                #(#body)*
            }
        });
        quote! {
            let bk = #bk;
            #(#a_loads)*
            #(#fmas)*
        }
    };
    let row_at = |k: TokenStream| {
        if feed == Feed::BRows {
            quote!((*b_rows.add(#k)).add(b_off))
        } else {
            let nr = lit(nr);
            quote!(b.add((#k) * #nr))
        }
    };
    let unrolled = (0..sets).map(|s| {
        let s_lit = lit(s);
        step(s, row_at(quote!(k + #s_lit)))
    });
    let tail = step(0, row_at(quote!(k)));
    let sums = all.iter().filter(|&&(s, _, _)| s > 0).map(|&(s, j, r)| {
        let (c0, c) = (acc(0, j, r), acc(s, j, r));
        quote!(#c0 = #add(#c0, #c);)
    });
    let spills = (0..cols)
        .flat_map(|j| (0..rv).map(move |r| (j, r)))
        .map(|(j, r)| {
            let (c, off) = (acc(0, j, r), lit(j * mr + r * lanes));
            quote!(#store(tile.as_mut_ptr().add(#off), #c);)
        });
    let doc = format!(
        " {mr}x{cols} f32 GEMM edge microkernel ({}), vectorised along the rows: C[m x n] = \
         A-panel · the first {cols} columns of a {nr}-wide B panel over `kc` steps, then the \
         epilogue.\n\n # Safety\n As the {mr}x{nr} kernel, with `n <= {cols}`.",
        spec.isa.suffix()
    );
    let (mr_lit, sets_lit, tile_len) = (lit(mr), lit(sets), lit(mr * cols));
    let body = quote! {
            #uses
            #(#decls)*
            let (mut a, mut k) = (a, 0);
            while k + #sets_lit <= kc {
                #(#unrolled)*
                a = a.add(#sets_lit * #mr_lit);
                k += #sets_lit;
            }
            while k < kc {
                #tail
                a = a.add(#mr_lit);
                k += 1;
            }
            #(#sums)*
            let mut tile = [0.0f32; #tile_len];
            #(#spills)*
            store_edge(&tile, (1, #mr_lit), c, rs_c, m, n, ep);
    };
    kernel_fn(&name, &doc, &attrs, feed, body)
}

fn emit_scalar(spec: &GemmSpec, feed: Feed) -> TokenStream {
    let name = format_ident!("{}{}", spec.name(), feed.suffix());
    let doc = doc(spec, spec.mr, spec.nr, feed);
    let tile_len = lit(spec.mr * spec.nr);
    let (mr, nr) = (lit(spec.mr), lit(spec.nr));
    let a_ip = if feed == Feed::ARows {
        quote!(*a.add(i * rs_a + p))
    } else {
        quote!(*a.add(p * #mr + i))
    };
    let body = quote! {
            let mut tile = [0.0f32; #tile_len];
            for p in 0..kc {
                let bp = b.add(p * #nr);
                for i in 0..#mr {
                    let ai = #a_ip;
                    for j in 0..#nr {
                        tile[i * #nr + j] += ai * *bp.add(j);
                    }
                }
            }
            store_edge(&tile, (#nr, 1), c, rs_c, m, n, ep);
    };
    kernel_fn(&name, &doc, &TokenStream::new(), feed, body)
}

/// A microkernel with the contract's signature around `body`: `GemmKernelFn` over packed
/// panels, `GemmRowsFn` over B row pointers, `GemmARowsFn` over strided A rows
/// (`crate::gemm`'s types).
fn kernel_fn(
    name: &proc_macro2::Ident,
    doc: &str,
    attrs: &TokenStream,
    feed: Feed,
    body: TokenStream,
) -> TokenStream {
    let ab_params = match feed {
        Feed::Packed => quote!(a: *const f32, b: *const f32,),
        Feed::BRows => quote!(a: *const f32, b_rows: *const *const f32, b_off: usize,),
        Feed::ARows => quote!(a: *const f32, rs_a: usize, b: *const f32,),
    };
    quote! {
        #[doc = #doc]
        #attrs
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn #name(
            kc: usize,
            #ab_params
            c: *mut f32,
            rs_c: isize,
            m: usize,
            n: usize,
            ep: &GemmEpilogue,
        ) {
            #body
        }
    }
}
