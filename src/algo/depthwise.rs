//! Depthwise convolution (groups == input channels) with the generated kernels of
//! `codegen/src/depthwise.rs`: an unrolled kernel per (kernel, stride) of the generator's
//! table, and a generic kernel, still vectorised, for every other kernel, stride and dilation.
//!
//! NCHW runs one channel plane at a time (any channel multiplier: output channel `o` reads
//! input plane `o / multiplier`); NHWC vectorises across channels (multiplier 1; other
//! multipliers go to the grouped path). Weights are packed once: as they come (a plane's taps
//! are contiguous) for NCHW, tap-major with the channels padded to a whole vector for NHWC.

use super::{for_each_worker, SendPtr};
use crate::cpu::{self, Isa};
use crate::params::Geometry;
use crate::{Activation, ConvParams, Error, Layout, Result};

/// What one depthwise kernel call computes: output rows `oy0..oy1` of one channel plane
/// (NCHW) or of one image (NHWC). Which fields a kernel reads is in its documentation.
pub struct DwArgs {
    pub input: *const f32,
    pub output: *mut f32,
    /// Null, or a tensor shaped like `output` that is added before the activation.
    pub residual: *const f32,
    pub weights: *const f32,
    pub bias: *const f32,
    pub in_h: usize,
    pub in_w: usize,
    pub ow: usize,
    /// NHWC: channels per pixel.
    pub channels: usize,
    /// NHWC: floats between two taps of the packed weights (channels rounded up to a vector).
    pub wstride: usize,
    pub oy0: usize,
    pub oy1: usize,
    pub pad_top: usize,
    pub pad_left: usize,
    /// Kernel, stride and dilation: read only by the generic kernels.
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub dh: usize,
    pub dw: usize,
    /// Clamp bounds of the activation (infinite when it has none).
    pub min: f32,
    pub max: f32,
}

/// A generated depthwise kernel, as the generator's registry lists it.
pub struct DwKernel {
    pub name: &'static str,
    pub isa: Isa,
    /// # Safety
    /// The CPU has `isa`, and the pointers of the arguments cover the sizes they give.
    pub func: unsafe fn(&DwArgs),
    pub layout: Layout,
    /// `Some((kernel, stride))`: square kernel and stride, dilation 1. `None`: any shape.
    pub fixed: Option<(usize, usize)>,
    /// Floats per vector.
    pub lanes: usize,
}

/// Lanes the NHWC packing pads channels to: the widest vector of any ISA.
const PAD_LANES: usize = 16;

pub(crate) struct Depthwise {
    kern: &'static DwKernel,
    /// NCHW at AVX-512 only: the AVX2 kernel of the same shape, for images at most 8 wide,
    /// where a 16-lane vector would be half empty.
    narrow: Option<&'static DwKernel>,
    multiplier: usize,
    weights: Vec<f32>,
    bias: Vec<f32>,
    wstride: usize,
}

pub(crate) struct DwPlan {
    kern: &'static DwKernel,
    workers: usize,
    /// Items: NCHW `batch * c_out` planes, NHWC `batch` images, each cut in `bands` bands of
    /// `band_rows` output rows.
    bands: usize,
    band_rows: usize,
    items: usize,
}

impl Depthwise {
    /// Why the depthwise path cannot run `p`, if it cannot.
    pub(crate) fn rejects(p: &ConvParams) -> Option<String> {
        if p.groups != p.in_channels {
            return Some(format!(
                "not depthwise: groups {} != in_channels {}",
                p.groups, p.in_channels
            ));
        }
        if p.layout == Layout::Nhwc && p.out_channels != p.in_channels {
            return Some(format!(
                "NHWC depthwise needs channel multiplier 1, got {} -> {} channels",
                p.in_channels, p.out_channels
            ));
        }
        None
    }

    /// Packs the weights for `p`; `generic` forces the generic kernel.
    pub(crate) fn new(
        p: &ConvParams,
        weights: &[f32],
        bias: Option<&[f32]>,
        isa: Isa,
        generic: bool,
    ) -> Result<Self> {
        if let Some(reason) = Self::rejects(p) {
            return Err(Error::AlgorithmUnsupported {
                algorithm: if generic {
                    "depthwise_generic"
                } else {
                    "depthwise"
                },
                reason,
            });
        }
        let shape =
            (p.kernel[0] == p.kernel[1] && p.stride[0] == p.stride[1] && p.dilation == [1, 1])
                .then_some((p.kernel[0], p.stride[0]));
        let find = |isa: Isa, shape: Option<(usize, usize)>| {
            cpu::dw_f32()
                .iter()
                .find(|k| k.isa == isa && k.layout == p.layout && k.fixed == shape)
        };
        let pick = |isa: Isa| {
            let fixed = if generic {
                None
            } else {
                shape.and_then(|s| find(isa, Some(s)))
            };
            fixed.or_else(|| find(isa, None))
        };
        let kern = pick(isa).ok_or_else(|| Error::AlgorithmUnsupported {
            algorithm: "depthwise",
            reason: format!("no depthwise kernel generated for {isa}"),
        })?;
        let narrow = (isa == Isa::Avx512 && p.layout == Layout::Nchw)
            .then(|| pick(Isa::Avx2))
            .flatten();
        let taps = p.kernel[0] * p.kernel[1];
        let channels = p.out_channels;
        let (weights, bias, wstride) = match p.layout {
            Layout::Nchw => (
                weights.to_vec(),
                bias.map_or_else(|| vec![0.0; channels], <[f32]>::to_vec),
                0,
            ),
            Layout::Nhwc => {
                let cp = channels.div_ceil(PAD_LANES) * PAD_LANES;
                let mut w = vec![0.0; taps * cp];
                for c in 0..channels {
                    for t in 0..taps {
                        w[t * cp + c] = weights[c * taps + t];
                    }
                }
                let mut b = vec![0.0; cp];
                if let Some(bias) = bias {
                    b[..channels].copy_from_slice(bias);
                }
                (w, b, cp)
            }
        };
        Ok(Depthwise {
            kern,
            narrow,
            multiplier: p.out_channels / p.in_channels,
            weights,
            bias,
            wstride,
        })
    }

    pub(crate) fn plan(&self, g: &Geometry, threads: usize) -> DwPlan {
        let kern = match self.narrow {
            Some(k) if g.ow <= k.lanes => k,
            _ => self.kern,
        };
        let units = match g.layout {
            Layout::Nchw => g.batch * g.c_out,
            Layout::Nhwc => g.batch,
        };
        // Enough items that the workers finish together; bands of whole register blocks.
        let t = threads.max(1);
        let bands = if t == 1 {
            1
        } else {
            (4 * t).div_ceil(units).clamp(1, g.oh)
        };
        let band_rows = g.oh.div_ceil(bands).next_multiple_of(4).min(g.oh);
        let bands = g.oh.div_ceil(band_rows);
        let items = units * bands;
        DwPlan {
            kern,
            workers: t.min(items),
            bands,
            band_rows,
            items,
        }
    }

    pub(crate) fn kernel_name(plan: &DwPlan) -> &'static str {
        plan.kern.name
    }

    /// Runs a planned convolution. Slice lengths were checked by the caller.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        plan: &DwPlan,
        g: &Geometry,
        input: &[f32],
        residual: Option<&[f32]>,
        output: &mut [f32],
        activation: Activation,
    ) {
        let (min, max) = activation.clamp_bounds();
        let out = SendPtr(output.as_mut_ptr());
        let residual = residual.map_or(std::ptr::null(), <[f32]>::as_ptr);
        let res = SendPtr(residual as *mut f32);
        for_each_worker(plan.workers, plan.items, |item| {
            let unit = item / plan.bands;
            let oy0 = item % plan.bands * plan.band_rows;
            let oy1 = (oy0 + plan.band_rows).min(g.oh);
            let (in_off, out_off, w_off, b_off) = match g.layout {
                Layout::Nchw => {
                    let (n, oc) = (unit / g.c_out, unit % g.c_out);
                    let ic = oc / self.multiplier;
                    let taps = g.kh * g.kw;
                    (
                        (n * g.c_in + ic) * g.h * g.w,
                        unit * g.oh * g.ow,
                        oc * taps,
                        oc,
                    )
                }
                Layout::Nhwc => (
                    unit * g.h * g.w * g.c_in,
                    unit * g.oh * g.ow * g.c_out,
                    0,
                    0,
                ),
            };
            let row_len = match g.layout {
                Layout::Nchw => g.ow,
                Layout::Nhwc => g.ow * g.c_out,
            };
            let rows = out_off + oy0 * row_len..out_off + oy1 * row_len;
            let args = DwArgs {
                input: input[in_off..].as_ptr(),
                output: out.get().wrapping_add(out_off),
                residual: if res.get().is_null() {
                    std::ptr::null()
                } else {
                    res.get().wrapping_add(out_off)
                },
                weights: self.weights[w_off..].as_ptr(),
                bias: self.bias[b_off..].as_ptr(),
                in_h: g.h,
                in_w: g.w,
                ow: g.ow,
                channels: g.c_out,
                wstride: self.wstride,
                oy0,
                oy1,
                pad_top: g.pad_top,
                pad_left: g.pad_left,
                kh: g.kh,
                kw: g.kw,
                sh: g.sh,
                sw: g.sw,
                dh: g.dh,
                dw: g.dw,
                min,
                max,
            };
            // SAFETY: the kernel's ISA was checked when the weights were packed; the input,
            // output and residual were checked to hold the geometry's tensors, the weights and
            // bias were packed for it; items write disjoint rows of the output.
            unsafe { (plan.kern.func)(&args) };
            if activation.needs_pass() {
                // SAFETY: this item's rows, inside the output (checked length), written by no
                // other item.
                let rows = unsafe {
                    std::slice::from_raw_parts_mut(out.get().add(rows.start), rows.len())
                };
                activation.apply_slice(rows);
            }
        });
    }
}
