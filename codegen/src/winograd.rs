//! Winograd F(m, 3): the Cook–Toom matrices, computed in exact rational arithmetic from a
//! table of interpolation points, and the input and output transform kernels emitted from
//! them, 2-D (`m x m` outputs from `t x t` inputs, `t = m + 2`) as the 1-D transform nested,
//! and 1-D.
//!
//! Construction (the transpose of Toom–Cook linear convolution): with finite points
//! `a_0 .. a_{t-2}` and the point at infinity,
//! - `G` (t x 3) evaluates the filter polynomial at each point (its leading coefficient at
//!   infinity), row `i` divided by `f_i = prod_{j != i} (a_i - a_j)`;
//! - `Bt` (t x t) row `i` holds the coefficients of `prod_{j != i} (x - a_j)` (Lagrange's
//!   numerator, so `Bt` stays integral for integral points), the last row those of
//!   `prod_j (x - a_j)`;
//! - `At` (m x t) column `i` holds the powers `a_i^0 .. a_i^{m-1}` (the last column `e_{m-1}`).
//!
//! Then `y = At [(G g) ⊙ (Bt d)]` is the correlation of `d` (t samples) with `g` (3 taps);
//! [`cook_toom`] checks that exactly before any kernel is emitted.
//!
//! Kernels vectorise across channels (one vector per pixel): each is a fixed sequence of
//! adds and multiply-adds by constants. Points come in pairs `±a`, which makes rows of `Bt`
//! (and columns of `At`) equal up to the sign of odd powers; the emitter computes the shared
//! even and odd parts once per pair, which halves the work.

use crate::simd::{simd, Simd};
use crate::{lit, registry_entry_with, Isa, WinoSpec};
use num_rational::Ratio;
use proc_macro2::{Ident, Literal, TokenStream};
use quote::{format_ident, quote};

/// Exact rationals.
pub type Q = Ratio<i128>;

/// Taps of the filter: every kernel here is F(m, 3).
pub const R: usize = 3;

/// The three matrices of one F(m, 3).
pub struct Matrices {
    /// `m x t`
    pub at: Vec<Vec<Q>>,
    /// `t x 3`
    pub g: Vec<Vec<Q>>,
    /// `t x t`
    pub bt: Vec<Vec<Q>>,
}

/// Coefficients (lowest power first) of `prod (x - roots)`.
fn poly_from_roots(roots: impl Iterator<Item = Q>) -> Vec<Q> {
    let mut p = vec![Q::from_integer(1)];
    for a in roots {
        // p(x) * (x - a)
        let mut next = vec![Q::from_integer(0); p.len() + 1];
        for (k, &c) in p.iter().enumerate() {
            next[k + 1] += c;
            next[k] -= c * a;
        }
        p = next;
    }
    p
}

/// The Cook–Toom matrices of F(m, 3) from `t - 1` distinct finite points, checked exactly.
pub fn cook_toom(spec: &WinoSpec) -> Matrices {
    let m = spec.m;
    let t = m + R - 1;
    let pts: Vec<Q> = spec
        .points
        .iter()
        .map(|&(n, d)| Q::new(n as i128, d as i128))
        .collect();
    assert_eq!(pts.len(), t - 1, "F({m},3) needs {} finite points", t - 1);
    let zero = Q::from_integer(0);
    let one = Q::from_integer(1);
    let pow = |a: Q, k: usize| (0..k).fold(one, |acc, _| acc * a);
    let mut at = vec![vec![zero; t]; m];
    let mut g = vec![vec![zero; R]; t];
    let mut bt = vec![vec![zero; t]; t];
    for (i, &a) in pts.iter().enumerate() {
        assert!(
            pts.iter().filter(|&&b| b == a).count() == 1,
            "points must be distinct"
        );
        for (k, row) in at.iter_mut().enumerate() {
            row[i] = pow(a, k);
        }
        let others = || pts.iter().enumerate().filter(move |&(j, _)| j != i);
        let f: Q = others().map(|(_, &b)| a - b).product();
        for (k, v) in g[i].iter_mut().enumerate() {
            *v = pow(a, k) / f;
        }
        let p = poly_from_roots(others().map(|(_, &b)| b));
        bt[i][..p.len()].copy_from_slice(&p);
    }
    at[m - 1][t - 1] = one;
    g[t - 1][R - 1] = one;
    bt[t - 1] = poly_from_roots(pts.iter().copied());
    let mats = Matrices { at, g, bt };
    verify(&mats, m);
    mats
}

/// Asserts `At [(G g) ⊙ (Bt d)] = correlation(d, g)` exactly, for `t x 3` unit pairs (a
/// basis of the bilinear map, so this proves it for every input).
fn verify(mats: &Matrices, m: usize) {
    let t = m + R - 1;
    let zero = Q::from_integer(0);
    for dj in 0..t {
        for gk in 0..R {
            let gg: Vec<Q> = (0..t).map(|i| mats.g[i][gk]).collect();
            let bd: Vec<Q> = (0..t).map(|i| mats.bt[i][dj]).collect();
            for (y, row) in mats.at.iter().enumerate() {
                let got: Q = (0..t).map(|i| row[i] * gg[i] * bd[i]).sum();
                // d = e_dj, g = e_gk: y_i = [i + gk == dj]
                let want = if y + gk == dj {
                    Q::from_integer(1)
                } else {
                    zero
                };
                assert_eq!(got, want, "F({m},3) Cook-Toom matrices are wrong");
            }
        }
    }
}

fn to_f64(q: Q) -> f64 {
    *q.numer() as f64 / *q.denom() as f64
}

/// `c * x` terms summed: the shortest chain of adds, subtracts and multiply-adds.
fn comb(v: &Simd, terms: &[(Q, TokenStream)]) -> TokenStream {
    let (add, sub, mul, splat) = (&v.add, &v.sub, &v.mul, &v.splat);
    let one = Q::from_integer(1);
    let c = |q: Q| Literal::f32_suffixed(to_f64(q) as f32);
    let mut terms: Vec<&(Q, TokenStream)> = terms
        .iter()
        .filter(|(q, _)| *q != Q::from_integer(0))
        .collect();
    // Start from a term with coefficient 1 where there is one: no multiply.
    if let Some(i) = terms.iter().position(|(q, _)| *q == one) {
        terms.swap(0, i);
    }
    let Some(((q0, x0), rest)) = terms.split_first() else {
        return v.zero.clone();
    };
    let mut acc = if *q0 == one {
        quote!(#x0)
    } else {
        let k = c(*q0);
        quote!(#mul(#splat(#k), #x0))
    };
    for (q, x) in rest {
        acc = if *q == one {
            quote!(#add(#acc, #x))
        } else if *q == -one {
            quote!(#sub(#acc, #x))
        } else {
            let k = c(*q);
            (v.fma)(acc, quote!(#splat(#k)), quote!(#x))
        };
    }
    acc
}

/// If `b = a` up to the sign of some entries (same zeros, at least one equal and one
/// opposite), the split: `Some(same)` with `same[j]` true where `b[j] == a[j]`.
fn sign_split(a: &[Q], b: &[Q]) -> Option<Vec<bool>> {
    let zero = Q::from_integer(0);
    let mut same = Vec::with_capacity(a.len());
    for (&x, &y) in a.iter().zip(b) {
        if (x == zero) != (y == zero) || (x != y && x != -y) {
            return None;
        }
        same.push(x == y);
    }
    let nonzero = |want: bool| a.iter().zip(&same).any(|(&x, &s)| x != zero && s == want);
    (nonzero(true) && nonzero(false)).then_some(same)
}

/// `out[r] = sum_j mat[r][j] * inputs[j]` as `let` statements. Rows that are sign flips of
/// each other (points `±a`) share their even and odd parts: `e + o` and `e - o`.
fn apply_rows(
    v: &Simd,
    mat: &[Vec<Q>],
    inputs: &[TokenStream],
    out: &[Ident],
    tmp: &str,
) -> TokenStream {
    let (add, sub) = (&v.add, &v.sub);
    let mut done = vec![false; mat.len()];
    let mut code = TokenStream::new();
    for r1 in 0..mat.len() {
        if done[r1] {
            continue;
        }
        done[r1] = true;
        let pair = (r1 + 1..mat.len())
            .filter(|&r2| !done[r2])
            .find_map(|r2| sign_split(&mat[r1], &mat[r2]).map(|s| (r2, s)));
        let o1 = &out[r1];
        match pair {
            Some((r2, same)) => {
                done[r2] = true;
                let part = |want: bool| -> Vec<(Q, TokenStream)> {
                    (0..inputs.len())
                        .filter(|&j| same[j] == want)
                        .map(|j| (mat[r1][j], inputs[j].clone()))
                        .collect()
                };
                let (e, o) = (format_ident!("{tmp}e{r1}"), format_ident!("{tmp}o{r1}"));
                let (ce, co) = (comb(v, &part(true)), comb(v, &part(false)));
                let o2 = &out[r2];
                code.extend(quote! {
                    let #e = #ce;
                    let #o = #co;
                    let #o1 = #add(#e, #o);
                    let #o2 = #sub(#e, #o);
                });
            }
            None => {
                let terms: Vec<(Q, TokenStream)> = (0..inputs.len())
                    .map(|j| (mat[r1][j], inputs[j].clone()))
                    .collect();
                let c = comb(v, &terms);
                code.extend(quote!(let #o1 = #c;));
            }
        }
    }
    code
}

/// `out[r] = sum_j mat[r][j] * inputs[j]` where columns that are sign flips of each other
/// (points `±a` in `At`) first combine their inputs: `x_a + x_-a` and `x_a - x_-a`.
fn apply_cols(
    v: &Simd,
    mat: &[Vec<Q>],
    inputs: &[TokenStream],
    out: &[Ident],
    tmp: &str,
) -> TokenStream {
    let (add, sub) = (&v.add, &v.sub);
    let zero = Q::from_integer(0);
    let cols = inputs.len();
    let col = |j: usize| -> Vec<Q> { mat.iter().map(|r| r[j]).collect() };
    let mut done = vec![false; cols];
    let mut code = TokenStream::new();
    // New inputs and, per output row, their coefficients.
    let mut ins: Vec<TokenStream> = Vec::new();
    let mut coefs: Vec<Vec<Q>> = vec![Vec::new(); mat.len()];
    for c1 in 0..cols {
        if done[c1] {
            continue;
        }
        done[c1] = true;
        let a = col(c1);
        let pair = (c1 + 1..cols)
            .filter(|&c2| !done[c2])
            .find_map(|c2| sign_split(&a, &col(c2)).map(|s| (c2, s)));
        let x1 = &inputs[c1];
        match pair {
            Some((c2, same)) => {
                done[c2] = true;
                let x2 = &inputs[c2];
                let (p, q) = (format_ident!("{tmp}p{c1}"), format_ident!("{tmp}q{c1}"));
                code.extend(quote! {
                    let #p = #add(#x1, #x2);
                    let #q = #sub(#x1, #x2);
                });
                ins.push(quote!(#p));
                ins.push(quote!(#q));
                for (r, cf) in coefs.iter_mut().enumerate() {
                    cf.push(if same[r] { a[r] } else { zero });
                    cf.push(if same[r] { zero } else { a[r] });
                }
            }
            None => {
                ins.push(x1.clone());
                for (r, cf) in coefs.iter_mut().enumerate() {
                    cf.push(a[r]);
                }
            }
        }
    }
    for (r, o) in out.iter().enumerate() {
        let terms: Vec<(Q, TokenStream)> =
            coefs[r].iter().copied().zip(ins.iter().cloned()).collect();
        let c = comb(v, &terms);
        code.extend(quote!(let #o = #c;));
    }
    code
}

/// A 1-D transform's emitter ([`apply_rows`] or [`apply_cols`]).
type Apply = fn(&Simd, &[Vec<Q>], &[TokenStream], &[Ident], &str) -> TokenStream;

/// `mat` applied to `grid` (rows of vectors) along both axes when `dims` is 2 — down each
/// column first (results named `mid`), then along each row (named `out`) — or along its one
/// row when `dims` is 1. Returns the code and the result's rows.
fn nested(
    v: &Simd,
    mat: &[Vec<Q>],
    grid: Vec<Vec<Ident>>,
    dims: usize,
    apply: Apply,
    mid: &str,
    out: &str,
) -> (TokenStream, Vec<Vec<Ident>>) {
    let names = |p: &str, a: usize, n: usize| -> Vec<Ident> {
        (0..n).map(|b| format_ident!("{p}{a}_{b}")).collect()
    };
    let ts = |row: &[Ident]| -> Vec<TokenStream> { row.iter().map(|i| quote!(#i)).collect() };
    let mut code = TokenStream::new();
    let rows = if dims == 2 {
        let cols = grid[0].len();
        for j in 0..cols {
            let col: Vec<TokenStream> = grid
                .iter()
                .map(|r| {
                    let x = &r[j];
                    quote!(#x)
                })
                .collect();
            let outs: Vec<Ident> = (0..mat.len())
                .map(|k| format_ident!("{mid}{k}_{j}"))
                .collect();
            code.extend(apply(v, mat, &col, &outs, &format!("{mid}x{j}_")));
        }
        (0..mat.len()).map(|k| names(mid, k, cols)).collect()
    } else {
        grid
    };
    let results = rows
        .iter()
        .enumerate()
        .map(|(k, row)| {
            let outs = names(out, k, mat.len());
            code.extend(apply(v, mat, &ts(row), &outs, &format!("{out}x{k}_")));
            outs
        })
        .collect();
    (code, results)
}

/// Kernel name of one tile size, 2-D or 1-D, for one ISA.
pub fn name(spec: &WinoSpec, dims: usize, isa: Isa) -> String {
    format!("wino_f32_f{}_{}d_{}", spec.m, dims, isa.suffix())
}

/// The functions of the input and output transforms, named like the kernel with `in`/`out`
/// before the ISA.
fn fn_names(spec: &WinoSpec, dims: usize, isa: Isa) -> (Ident, Ident) {
    let f = |dir: &str| format_ident!("wino_f32_f{}_{dims}d_{dir}_{}", spec.m, isa.suffix());
    (f("in"), f("out"))
}

/// The input and output transform of one tile size and dimensionality for one ISA.
fn emit_kernels(v: &Simd, spec: &WinoSpec, mats: &Matrices, dims: usize) -> TokenStream {
    let (m, t) = (spec.m, spec.m + R - 1);
    let (fin, fout) = fn_names(spec, dims, v.isa);
    let (load, store) = (&v.load, &v.store);
    let lanes = lit(v.lanes);
    let attrs = v.attrs();
    let uses = v.uses();
    let id = |p: &str, a: usize, b: usize| format_ident!("{p}{a}_{b}");
    let ids = |p: &str, a: usize, n: usize| (0..n).map(|b| id(p, a, b)).collect::<Vec<_>>();
    let rows_in = if dims == 2 { t } else { 1 };

    // Input: d (rows_in x t pixels) -> V = Bt d Bt^T (2-D) or Bt d (1-D), t^dims vectors.
    let mut body_in = TokenStream::new();
    for i in 0..rows_in {
        for j in 0..t {
            let (d, il, jl) = (id("d", i, j), lit(i), lit(j));
            body_in.extend(quote!(let #d = #load(src.add(#il * row + #jl * #lanes));));
        }
    }
    let grid: Vec<Vec<Ident>> = (0..rows_in).map(|i| ids("d", i, t)).collect();
    let (code, v_out) = nested(v, &mats.bt, grid, dims, apply_rows, "c", "v");
    body_in.extend(code);
    for (k, row) in v_out.iter().enumerate() {
        for (l, o) in row.iter().enumerate() {
            let at = lit(k * t + l);
            body_in.extend(quote!(#store(dst.add(#at * xi), #o);));
        }
    }

    // Output: M (t^dims vectors) -> Y = At M At^T (+ bias), rows_out x m pixels.
    let mut body_out = quote!(let b = #load(bias););
    for k in 0..rows_in {
        for l in 0..t {
            let (x, at) = (id("m", k, l), lit(k * t + l));
            body_out.extend(quote!(let #x = #load(src.add(#at * xi));));
        }
    }
    let grid: Vec<Vec<Ident>> = (0..rows_in).map(|k| ids("m", k, t)).collect();
    let (code, y_out) = nested(v, &mats.at, grid, dims, apply_cols, "s", "y");
    body_out.extend(code);
    let add = &v.add;
    for (a, row) in y_out.iter().enumerate() {
        for (b, o) in row.iter().enumerate() {
            let (al, bl) = (lit(a), lit(b));
            body_out.extend(quote!(#store(dst.add(#al * row + #bl * #lanes), #add(#o, b));));
        }
    }
    let shape = if dims == 2 {
        format!("{t}x{t} pixels")
    } else {
        format!("{t} pixels")
    };
    let oshape = if dims == 2 {
        format!("{m}x{m} pixels")
    } else {
        format!("{m} pixels")
    };
    let doc_in = format!(
        " F({m},3) input transform of one {shape} tile, {} channels a vector: pixel (i, j) at \
         `src + i*row + j*{}`; the {} transformed vectors go to `dst + k*xi`.\n\n # Safety\n \
         The CPU has the ISA; every pixel vector read and transformed vector written lies in \
         its buffer.",
        v.lanes,
        v.lanes,
        t.pow(dims as u32)
    );
    let doc_out = format!(
        " F({m},3) output transform: the {} vectors at `src + k*xi` to one {oshape} tile, plus \
         the bias vector at `bias`; pixel (a, b) goes to `dst + a*row + b*{}`.\n\n # Safety\n \
         As the input transform.",
        t.pow(dims as u32),
        v.lanes
    );
    quote! {
        #[doc = #doc_in]
        #[allow(unused_variables)]
        #attrs
        pub unsafe fn #fin(src: *const f32, row: usize, dst: *mut f32, xi: usize) {
            #uses
            #body_in
        }

        #[doc = #doc_out]
        #[allow(unused_variables)]
        #attrs
        pub unsafe fn #fout(src: *const f32, xi: usize, bias: *const f32, dst: *mut f32, row: usize) {
            #uses
            #body_out
        }
    }
}

/// Every tile size of `specs`, 2-D and 1-D, for every ISA of `isas`; the registry
/// `WINO_F32_KERNELS`, the filter transforms `WINO_G` (applied at create time, in f64) and the
/// output transforms `WINO_AT`.
pub fn emit_all(specs: &[WinoSpec], isas: &[Isa]) -> TokenStream {
    let mats: Vec<Matrices> = specs.iter().map(cook_toom).collect();
    let mut modules = TokenStream::new();
    let mut entries = TokenStream::new();
    for &isa in isas {
        let v = simd(isa);
        let mut kernels = TokenStream::new();
        for (spec, mats) in specs.iter().zip(&mats) {
            for dims in [2, 1] {
                kernels.extend(emit_kernels(&v, spec, mats, dims));
                let n = name(spec, dims, isa);
                let module = format_ident!("{}", isa.suffix());
                let (fin, fout) = fn_names(spec, dims, isa);
                let (ml, dl, ll) = (lit(spec.m), lit(dims), lit(v.lanes));
                entries.extend(registry_entry_with(
                    "WinoKernel",
                    &n,
                    isa,
                    quote!(#module::#fin),
                    quote!(output: #module::#fout, m: #ml, dims: #dl, lanes: #ll,),
                ));
            }
        }
        let module = format_ident!("{}", isa.suffix());
        let cfg = isa.cfg();
        modules.extend(quote! {
            #cfg
            pub mod #module {
                #kernels
            }
        });
    }
    let gs = specs.iter().zip(&mats).map(|(spec, mats)| {
        let ml = lit(spec.m);
        let rows = mats.g.iter().map(|r| {
            let vals = r.iter().map(|&q| Literal::f64_unsuffixed(to_f64(q)));
            quote!([#(#vals),*])
        });
        let points = spec
            .points
            .iter()
            .map(|&(n, d)| {
                if d == 1 {
                    format!("{n}")
                } else {
                    format!("{n}/{d}")
                }
            })
            .collect::<Vec<_>>()
            .join(", ");
        quote!((#ml, #points, &[#(#rows),*]))
    });
    let ats = specs.iter().zip(&mats).map(|(spec, mats)| {
        let ml = lit(spec.m);
        let rows = mats.at.iter().map(|r| {
            let vals = r.iter().map(|&q| Literal::f64_unsuffixed(to_f64(q)));
            quote!(&[#(#vals),*])
        });
        quote!((#ml, &[#(#rows),*]))
    });
    quote! {
        use crate::algo::winograd::WinoKernel;
        #modules

        /// The transform kernels compiled for this target.
        pub static WINO_F32_KERNELS: &[WinoKernel] = &[#entries];

        /// Per tile size `m`: the interpolation points and the filter transform `G` (t x 3).
        pub static WINO_G: &[(usize, &str, &[[f64; 3]])] = &[#(#gs),*];

        /// Per tile size `m`: the output transform `At` (m x t), which the weight gradient's
        /// F(3, m) uses on the output gradient.
        pub static WINO_AT: &[(usize, &[&[f64]])] = &[#(#ats),*];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tile_of_the_table_is_exact() {
        for spec in crate::WINO_TILES {
            let mats = cook_toom(spec);
            assert_eq!(mats.bt.len(), spec.m + 2);
        }
    }

    #[test]
    #[should_panic(expected = "wrong")]
    fn a_wrong_matrix_is_caught() {
        let spec = &crate::WINO_TILES[0];
        let mut mats = cook_toom(spec);
        mats.bt[0][0] += Q::from_integer(1);
        verify(&mats, spec.m);
    }

    #[test]
    fn f2_matches_the_textbook() {
        // Lavin & Gray's F(2,3) with points 0, 1, -1: Bt rows [1 0 -1 0], [0 1 1 0],
        // [0 -1 1 0], [0 1 0 -1] up to row signs and scale.
        let mats = cook_toom(&crate::WINO_TILES[0]);
        let q = |x: i128| Q::from_integer(x);
        assert_eq!(mats.bt[0], vec![q(-1), q(0), q(1), q(0)]);
        assert_eq!(mats.at[1], vec![q(0), q(1), q(-1), q(1)]);
    }
}
