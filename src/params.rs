//! Convolution parameters, their validation, and the output-shape arithmetic.

use crate::{Activation, Error, Result};

/// Memory layout of activations (weights are always OIHW).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Layout {
    /// batch, channels, height, width
    #[default]
    Nchw,
    /// batch, height, width, channels
    Nhwc,
}

impl std::str::FromStr for Layout {
    type Err = Error;
    fn from_str(s: &str) -> Result<Layout> {
        match s.trim().to_ascii_lowercase().as_str() {
            "nchw" => Ok(Layout::Nchw),
            "nhwc" => Ok(Layout::Nhwc),
            _ => Err(Error::InvalidParameter {
                what: "layout",
                detail: format!("{s:?} is not nchw or nhwc"),
            }),
        }
    }
}

/// Padding, with ONNX's `auto_pad` semantics for the automatic modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Padding {
    /// Zeros added on each side, in input pixels.
    Explicit {
        /// Rows of zeros above the input.
        top: usize,
        /// Rows of zeros below the input.
        bottom: usize,
        /// Columns of zeros left of the input.
        left: usize,
        /// Columns of zeros right of the input.
        right: usize,
    },
    /// `SAME_UPPER`: output = ceil(input / stride); an odd total puts the extra pixel at the end.
    Same,
    /// `SAME_LOWER`: as `Same`, with the extra pixel at the beginning.
    SameLower,
    /// No padding.
    Valid,
}

impl Default for Padding {
    fn default() -> Self {
        Padding::Explicit {
            top: 0,
            bottom: 0,
            left: 0,
            right: 0,
        }
    }
}

impl Padding {
    /// The same padding on all four sides.
    pub fn uniform(p: usize) -> Self {
        Padding::Explicit {
            top: p,
            bottom: p,
            left: p,
            right: p,
        }
    }

    /// Symmetric padding: `ph` above and below, `pw` left and right.
    pub fn symmetric(ph: usize, pw: usize) -> Self {
        Padding::Explicit {
            top: ph,
            bottom: ph,
            left: pw,
            right: pw,
        }
    }
}

/// A 1-D or 2-D convolution: PyTorch/ONNX semantics (cross-correlation, OIHW weights with
/// I = in_channels / groups). 1-D convolutions have height 1 (`kernel[0] == 1`).
///
/// ```
/// use convkit::{Activation, ConvParams, Error, Padding};
///
/// // ResNeXt's grouped 3x3: 128 channels in 32 groups, stride 2, explicit padding 1.
/// let p = ConvParams::conv2d(128, 128, [3, 3])
///     .with_groups(32)
///     .with_stride([2, 2])
///     .with_padding(Padding::uniform(1))
///     .with_activation(Activation::Relu);
/// assert_eq!(p.weights_len()?, 128 * 4 * 3 * 3);
/// let g = p.geometry(1, 56, 56)?;
/// assert_eq!((g.oh, g.ow), (28, 28));
/// // Bad parameters are typed errors, never panics.
/// assert!(matches!(
///     p.with_groups(3).validate(),
///     Err(Error::NotDivisibleByGroups { .. })
/// ));
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConvParams {
    /// Input channels.
    pub in_channels: usize,
    /// Output channels.
    pub out_channels: usize,
    /// 1 = dense; `in_channels` = depthwise (with multiplier out_channels / in_channels).
    pub groups: usize,
    /// [height, width]
    pub kernel: [usize; 2],
    /// [height, width]
    pub stride: [usize; 2],
    /// [height, width]
    pub dilation: [usize; 2],
    /// Padding: explicit or an ONNX `auto_pad` mode.
    pub padding: Padding,
    /// Memory layout of the input and output tensors.
    pub layout: Layout,
    /// Applied after bias and residual.
    pub activation: Activation,
}

impl ConvParams {
    /// A dense 2-D convolution with stride 1, dilation 1, no padding, NCHW, no activation.
    pub fn conv2d(in_channels: usize, out_channels: usize, kernel: [usize; 2]) -> Self {
        ConvParams {
            in_channels,
            out_channels,
            groups: 1,
            kernel,
            stride: [1, 1],
            dilation: [1, 1],
            padding: Padding::default(),
            layout: Layout::Nchw,
            activation: Activation::None,
        }
    }

    /// A dense 1-D convolution (height 1) of kernel length `kernel`.
    pub fn conv1d(in_channels: usize, out_channels: usize, kernel: usize) -> Self {
        Self::conv2d(in_channels, out_channels, [1, kernel])
    }

    /// Sets the group count (1 = dense; `in_channels` = depthwise).
    pub fn with_groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }
    /// Sets the stride, [height, width].
    pub fn with_stride(mut self, stride: [usize; 2]) -> Self {
        self.stride = stride;
        self
    }
    /// Sets the dilation, [height, width].
    pub fn with_dilation(mut self, dilation: [usize; 2]) -> Self {
        self.dilation = dilation;
        self
    }
    /// Sets the padding.
    pub fn with_padding(mut self, padding: Padding) -> Self {
        self.padding = padding;
        self
    }
    /// Sets the layout of the activations.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }
    /// Sets the fused activation.
    pub fn with_activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Input channels per group.
    pub fn in_channels_per_group(&self) -> usize {
        self.in_channels / self.groups.max(1)
    }

    /// Output channels per group.
    pub fn out_channels_per_group(&self) -> usize {
        self.out_channels / self.groups.max(1)
    }

    /// Number of weights: out_channels · in_channels/groups · kh · kw.
    pub fn weights_len(&self) -> Result<usize> {
        mul(
            &[
                self.out_channels,
                self.in_channels_per_group(),
                self.kernel[0],
                self.kernel[1],
            ],
            "weights",
        )
    }

    /// `WrongLength` unless `weights` is [`ConvParams::weights_len`] and `bias`, if given,
    /// `out_channels`.
    pub(crate) fn check_weights_and_bias(&self, weights: usize, bias: Option<usize>) -> Result<()> {
        crate::error::check_lengths(&[
            ("weights", self.weights_len()?, Some(weights)),
            ("bias", self.out_channels, bias),
        ])
    }

    /// Checks everything that does not depend on the input size.
    pub fn validate(&self) -> Result<()> {
        let nonzero = [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("groups", self.groups),
            ("kernel height", self.kernel[0]),
            ("kernel width", self.kernel[1]),
            ("stride height", self.stride[0]),
            ("stride width", self.stride[1]),
            ("dilation height", self.dilation[0]),
            ("dilation width", self.dilation[1]),
        ];
        for (what, v) in nonzero {
            if v == 0 {
                return Err(Error::Zero { what });
            }
        }
        for (what, channels) in [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
        ] {
            if channels % self.groups != 0 {
                return Err(Error::NotDivisibleByGroups {
                    what,
                    channels,
                    groups: self.groups,
                });
            }
        }
        for (what, k, d) in [
            ("kernel height x dilation", self.kernel[0], self.dilation[0]),
            ("kernel width x dilation", self.kernel[1], self.dilation[1]),
        ] {
            mul(&[k - 1, d], what)?
                .checked_add(1)
                .ok_or(Error::Overflow { what })?;
        }
        self.weights_len()?;
        self.activation.validate()
    }

    /// Resolves padding and output size for an input of `batch` x `in_h` x `in_w`.
    pub fn geometry(&self, batch: usize, in_h: usize, in_w: usize) -> Result<Geometry> {
        self.validate()?;
        for (what, v) in [
            ("batch", batch),
            ("input height", in_h),
            ("input width", in_w),
        ] {
            if v == 0 {
                return Err(Error::Zero { what });
            }
        }
        let (pt, pb, oh) = self.axis("height", in_h, 0)?;
        let (pl, pr, ow) = self.axis("width", in_w, 1)?;
        let g = Geometry {
            batch,
            c_in: self.in_channels,
            h: in_h,
            w: in_w,
            c_out: self.out_channels,
            groups: self.groups,
            kh: self.kernel[0],
            kw: self.kernel[1],
            sh: self.stride[0],
            sw: self.stride[1],
            dh: self.dilation[0],
            dw: self.dilation[1],
            pad_top: pt,
            pad_bottom: pb,
            pad_left: pl,
            pad_right: pr,
            oh,
            ow,
            layout: self.layout,
        };
        // Every tensor must be addressable with isize offsets in floats.
        let limit = isize::MAX as usize / 8;
        for (what, len) in [
            ("input", g.input_len_checked()),
            ("output", g.output_len_checked()),
            ("weights", self.weights_len().ok()),
        ] {
            match len {
                Some(l) if l <= limit => {}
                _ => return Err(Error::Overflow { what }),
            }
        }
        Ok(g)
    }

    /// (pad_begin, pad_end, output) along one axis.
    fn axis(&self, axis: &'static str, input: usize, i: usize) -> Result<(usize, usize, usize)> {
        let (k, s, d) = (self.kernel[i], self.stride[i], self.dilation[i]);
        let span = (k - 1) * d + 1;
        let (begin, end) = match self.padding {
            Padding::Explicit {
                top,
                bottom,
                left,
                right,
            } => {
                if i == 0 {
                    (top, bottom)
                } else {
                    (left, right)
                }
            }
            Padding::Valid => (0, 0),
            Padding::Same | Padding::SameLower => {
                let out = input.div_ceil(s);
                let needed = ((out - 1) * s + span).saturating_sub(input);
                let (small, large) = (needed / 2, needed - needed / 2);
                if self.padding == Padding::Same {
                    (small, large)
                } else {
                    (large, small)
                }
            }
        };
        let padded = input
            .checked_add(begin)
            .and_then(|x| x.checked_add(end))
            .ok_or(Error::Overflow {
                what: "padded input",
            })?;
        if span > padded {
            return Err(Error::KernelTooLarge {
                axis,
                kernel: k,
                dilation: d,
                span,
                padded,
                input,
                pad_begin: begin,
                pad_end: end,
            });
        }
        Ok((begin, end, (padded - span) / s + 1))
    }
}

/// A convolution with its input size fixed: padding resolved, output size known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Images in the batch.
    pub batch: usize,
    /// Input channels.
    pub c_in: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub c_out: usize,
    /// Groups.
    pub groups: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Vertical stride.
    pub sh: usize,
    /// Horizontal stride.
    pub sw: usize,
    /// Vertical dilation.
    pub dh: usize,
    /// Horizontal dilation.
    pub dw: usize,
    /// Padding above, resolved.
    pub pad_top: usize,
    /// Padding below, resolved.
    pub pad_bottom: usize,
    /// Padding left, resolved.
    pub pad_left: usize,
    /// Padding right, resolved.
    pub pad_right: usize,
    /// Output height.
    pub oh: usize,
    /// Output width.
    pub ow: usize,
    /// Layout of input and output.
    pub layout: Layout,
}

impl Geometry {
    /// Input channels per group.
    pub fn cin_g(&self) -> usize {
        self.c_in / self.groups
    }
    /// Output channels per group.
    pub fn cout_g(&self) -> usize {
        self.c_out / self.groups
    }
    /// The reduction length of one output: c_in/groups · kh · kw.
    pub fn k_len(&self) -> usize {
        self.cin_g() * self.kh * self.kw
    }
    fn input_len_checked(&self) -> Option<usize> {
        self.batch
            .checked_mul(self.c_in)?
            .checked_mul(self.h)?
            .checked_mul(self.w)
    }
    fn output_len_checked(&self) -> Option<usize> {
        self.batch
            .checked_mul(self.c_out)?
            .checked_mul(self.oh)?
            .checked_mul(self.ow)
    }
    /// Elements of the input tensor (checked at creation: never overflows).
    pub fn input_len(&self) -> usize {
        self.batch * self.c_in * self.h * self.w
    }
    /// Elements of the output tensor (checked at creation: never overflows).
    pub fn output_len(&self) -> usize {
        self.batch * self.c_out * self.oh * self.ow
    }
    /// Multiply-adds of the direct convolution, times two.
    pub fn flops(&self) -> f64 {
        2.0 * self.output_len() as f64 * self.k_len() as f64
    }
}

/// Checked product of sizes.
pub(crate) fn mul(xs: &[usize], what: &'static str) -> Result<usize> {
    xs.iter()
        .try_fold(1usize, |acc, &x| acc.checked_mul(x))
        .ok_or(Error::Overflow { what })
}
