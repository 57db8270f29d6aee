//! Direct convolution (NCHW, dense or grouped) with the generated kernels of
//! `codegen/src/direct.rs`: for convolutions with few input channels per group, where im2col +
//! GEMM has too little to reuse — ResNeXt's grouped 3x3 (4 channels a group) and the stems
//! (3 input channels). Every group runs in one parallel loop over (image, group, block of
//! output channels, band of rows), with the weights packed per group and block at create time.

use super::{for_each_worker, SendPtr};
use crate::cpu::{self, Isa};
use crate::params::Geometry;
use crate::{Activation, ConvParams, Error, Layout, Result};

/// What one direct kernel call computes: output channels `0..noc` of a block (`output` at the
/// first of them) over output rows `oy0..oy1`, from the group's `cin` input planes (`input`
/// at the first).
pub struct DirectArgs {
    pub input: *const f32,
    pub output: *mut f32,
    /// Null, or a tensor shaped like the output, at the same offset, added before the
    /// activation.
    pub residual: *const f32,
    /// `[cin][kh*kw][ocb]` for this block.
    pub weights: *const f32,
    /// `ocb` values.
    pub bias: *const f32,
    pub cin: usize,
    pub noc: usize,
    pub in_h: usize,
    pub in_w: usize,
    pub oh: usize,
    pub ow: usize,
    pub oy0: usize,
    pub oy1: usize,
    pub pad_top: usize,
    pub pad_left: usize,
    pub min: f32,
    pub max: f32,
}

/// A generated direct kernel, as the generator's registry lists it.
pub struct DirectKernel {
    pub name: &'static str,
    pub isa: Isa,
    /// # Safety
    /// The CPU has `isa`, and the pointers of the arguments cover the sizes they give.
    pub func: unsafe fn(&DirectArgs),
    /// Square kernel and stride (dilation 1).
    pub fixed: (usize, usize),
    /// Output channels a call computes.
    pub ocb: usize,
    /// Output rows kept in registers.
    pub rows: usize,
}

pub(crate) struct Direct {
    kern: &'static DirectKernel,
    /// Blocks of `ocb` output channels in a group.
    blocks: usize,
    /// `[group][block][cin_g][kh*kw][ocb]`, zero past the group's channels.
    weights: Vec<f32>,
    /// `[group][block][ocb]`.
    bias: Vec<f32>,
}

pub(crate) struct DirectPlan {
    workers: usize,
    bands: usize,
    band_rows: usize,
    items: usize,
}

/// The kernel of `isa` for `p`, or why there is none: the one computing the most output
/// channels a call that the groups fill (8 for groups of 8 channels or more, else 4).
fn kernel_for(p: &ConvParams, isa: Isa) -> std::result::Result<&'static DirectKernel, String> {
    if p.layout != Layout::Nchw {
        return Err("direct kernels are NCHW".into());
    }
    let (k, s) = (p.kernel[0], p.stride[0]);
    if p.kernel[1] != k || p.stride[1] != s || p.dilation != [1, 1] {
        return Err(format!(
            "direct kernels take square kernels and strides, dilation 1; got kernel {:?}, stride {:?}, dilation {:?}",
            p.kernel, p.stride, p.dilation
        ));
    }
    let cout_g = p.out_channels_per_group();
    cpu::direct_f32()
        .iter()
        .filter(|d| d.isa == isa && d.fixed == (k, s))
        .max_by_key(|d| (d.ocb <= cout_g.max(4), d.ocb))
        .ok_or_else(|| format!("no direct kernel generated for {k}x{k} stride {s} at {isa}"))
}

impl Direct {
    /// Why the direct path cannot run `p` at `isa`, if it cannot.
    pub(crate) fn rejects(p: &ConvParams, isa: Isa) -> Option<String> {
        kernel_for(p, isa).err()
    }

    pub(crate) fn new(
        p: &ConvParams,
        weights: &[f32],
        bias: Option<&[f32]>,
        isa: Isa,
        forced: Option<&'static DirectKernel>,
    ) -> Result<Self> {
        let unsupported = |reason| Error::AlgorithmUnsupported {
            algorithm: "direct",
            reason,
        };
        let chosen = kernel_for(p, isa).map_err(unsupported)?;
        let kern = match forced {
            Some(f) if f.fixed != chosen.fixed || f.isa != isa => {
                return Err(unsupported(format!(
                    "kernel {} does not take kernel {:?} stride {:?}",
                    f.name, p.kernel, p.stride
                )))
            }
            Some(f) => f,
            None => chosen,
        };
        let (cin_g, cout_g) = (p.in_channels_per_group(), p.out_channels_per_group());
        let taps = p.kernel[0] * p.kernel[1];
        let ocb = kern.ocb;
        let blocks = cout_g.div_ceil(ocb);
        let mut w = vec![0.0; p.groups * blocks * cin_g * taps * ocb];
        let mut b = vec![0.0; p.groups * blocks * ocb];
        for g in 0..p.groups {
            for blk in 0..blocks {
                let unit = g * blocks + blk;
                for o in 0..ocb.min(cout_g - blk * ocb) {
                    let oc = g * cout_g + blk * ocb + o;
                    for i in 0..cin_g {
                        for t in 0..taps {
                            w[((unit * cin_g + i) * taps + t) * ocb + o] =
                                weights[(oc * cin_g + i) * taps + t];
                        }
                    }
                    b[unit * ocb + o] = bias.map_or(0.0, |bias| bias[oc]);
                }
            }
        }
        Ok(Direct {
            kern,
            blocks,
            weights: w,
            bias: b,
        })
    }

    pub(crate) fn kernel_name(&self) -> &'static str {
        self.kern.name
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> DirectPlan {
        let units = g.batch * g.groups * self.blocks;
        let t = threads.max(1);
        let bands = if t == 1 {
            1
        } else {
            (4 * t).div_ceil(units).clamp(1, g.oh)
        };
        let band_rows =
            g.oh.div_ceil(bands)
                .next_multiple_of(self.kern.rows)
                .min(g.oh);
        let bands = g.oh.div_ceil(band_rows);
        let items = units * bands;
        DirectPlan {
            workers: t.min(items),
            bands,
            band_rows,
            items,
        }
    }

    /// Runs a planned convolution. Slice lengths were checked by the caller.
    pub(crate) fn run(
        &self,
        plan: &DirectPlan,
        g: &Geometry,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
        activation: Activation,
    ) {
        let (min, max) = activation.clamp_bounds();
        let out = SendPtr(output.as_mut_ptr());
        let res = SendPtr(residual.map_or(std::ptr::null_mut(), |r| r.as_ptr() as *mut f32));
        let (hw, ohw) = (g.h * g.w, g.oh * g.ow);
        let (cin_g, cout_g) = (g.cin_g(), g.cout_g());
        let ocb = self.kern.ocb;
        let taps = g.kh * g.kw;
        for_each_worker(plan.workers, plan.items, &mut [], |_, item| {
            let unit = item / plan.bands;
            let oy0 = item % plan.bands * plan.band_rows;
            let oy1 = (oy0 + plan.band_rows).min(g.oh);
            let (n, gu) = (
                unit / (g.groups * self.blocks),
                unit % (g.groups * self.blocks),
            );
            let (grp, blk) = (gu / self.blocks, gu % self.blocks);
            let oc0 = grp * cout_g + blk * ocb;
            let noc = ocb.min(cout_g - blk * ocb);
            let o = (n * g.c_out + oc0) * ohw;
            let a = DirectArgs {
                input: input[(n * g.c_in + grp * cin_g) * hw..].as_ptr(),
                output: out.get().wrapping_add(o),
                residual: if res.get().is_null() {
                    std::ptr::null()
                } else {
                    res.get().wrapping_add(o)
                },
                weights: self.weights[gu * cin_g * taps * ocb..].as_ptr(),
                bias: self.bias[gu * ocb..].as_ptr(),
                cin: cin_g,
                noc,
                in_h: g.h,
                in_w: g.w,
                oh: g.oh,
                ow: g.ow,
                oy0,
                oy1,
                pad_top: g.pad_top,
                pad_left: g.pad_left,
                min,
                max,
            };
            // SAFETY: the kernel's ISA was checked at creation; the input, output and
            // residual hold the geometry's tensors (lengths checked), the group's `cin_g`
            // planes start at `input` and the block's `noc` planes at `output`; the weights
            // and bias were packed for this block; items write disjoint rows of disjoint
            // planes.
            unsafe { (self.kern.func)(&a) };
            if activation.needs_pass() {
                for c in 0..noc {
                    let rows = o + c * ohw + oy0 * g.ow..o + c * ohw + oy1 * g.ow;
                    // SAFETY: this item's rows of its planes, inside the output (checked
                    // length), written by no other item.
                    let rows = unsafe {
                        std::slice::from_raw_parts_mut(out.get().add(rows.start), rows.len())
                    };
                    activation.apply_slice(rows);
                }
            }
        });
    }
}
