//! 64-byte aligned f32 storage that grows with `try_reserve`, so running out of memory is an
//! error instead of an abort. Built on `Vec` of cache lines: no unsafe code, and bytemuck views
//! the lines as floats.

use crate::{Error, Result};

/// One cache line of floats; a `Vec` of these is 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Line([f32; 16]);

const LINE_FLOATS: usize = 16;

#[derive(Default)]
pub(crate) struct AlignedBuf {
    lines: Vec<Line>,
}

impl AlignedBuf {
    /// A zero-filled buffer of at least `floats` floats.
    pub(crate) fn zeroed(floats: usize, what: &'static str) -> Result<Self> {
        let mut b = AlignedBuf::default();
        b.grow(floats, what)?;
        Ok(b)
    }

    /// Grows to hold at least `floats` floats (never shrinks). New space is zero-filled.
    pub(crate) fn grow(&mut self, floats: usize, what: &'static str) -> Result<()> {
        let lines = floats.div_ceil(LINE_FLOATS);
        if lines <= self.lines.len() {
            return Ok(());
        }
        let bytes = lines.saturating_mul(std::mem::size_of::<Line>());
        if bytes > isize::MAX as usize {
            return Err(Error::OutOfMemory { what, bytes });
        }
        self.lines
            .try_reserve_exact(lines - self.lines.len())
            .map_err(|_| Error::OutOfMemory { what, bytes })?;
        self.lines.resize(lines, Line([0.0; LINE_FLOATS]));
        Ok(())
    }

    pub(crate) fn len(&self) -> usize {
        self.lines.len() * LINE_FLOATS
    }

    pub(crate) fn as_slice(&self) -> &[f32] {
        bytemuck::cast_slice(&self.lines)
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [f32] {
        bytemuck::cast_slice_mut(&mut self.lines)
    }
}

/// Scratch memory for [`Plan::run`](crate::Plan::run): a 64-byte aligned arena that only
/// grows. Share one between every layer of a network: the scratch of one layer is the scratch
/// of the next, so a network costs its largest layer's workspace, not the sum.
///
/// ```
/// use convkit::{Conv2d, ConvParams, Options, Workspace};
///
/// let a = Conv2d::new(ConvParams::conv2d(8, 32, [1, 1]), &[0.1; 256], None, Options::default())?;
/// let b = Conv2d::new(ConvParams::conv2d(32, 8, [1, 1]), &[0.1; 256], None, Options::default())?;
/// let (pa, pb) = (a.plan(1, 14, 14)?, b.plan(1, 14, 14)?);
/// let mut ws = Workspace::new(); // one arena for both layers
/// let x = vec![1.0; pa.input_len()];
/// let (mut t, mut y) = (vec![0.0; pa.output_len()], vec![0.0; pb.output_len()]);
/// pa.run(&x, &mut t, &mut ws)?;
/// pb.run(&t, &mut y, &mut ws)?;
/// assert!(ws.bytes() >= pa.workspace_bytes().max(pb.workspace_bytes()));
/// # Ok::<(), convkit::Error>(())
/// ```
#[derive(Default)]
pub struct Workspace {
    buf: AlignedBuf,
}

impl Workspace {
    /// An empty workspace; the first `run` grows it to what its plan needs.
    pub fn new() -> Self {
        Self::default()
    }

    /// A workspace of at least `bytes` bytes, or `Error::OutOfMemory`.
    pub fn with_bytes(bytes: usize) -> Result<Self> {
        let mut w = Self::new();
        w.reserve(bytes)?;
        Ok(w)
    }

    /// Grows to at least `bytes` bytes (rounded up to 64). Never shrinks.
    pub fn reserve(&mut self, bytes: usize) -> Result<()> {
        self.buf.grow(bytes.div_ceil(4), "workspace")
    }

    /// Current size in bytes.
    pub fn bytes(&self) -> usize {
        self.buf.len() * 4
    }

    /// The first `floats` floats, growing the arena first if it is smaller.
    pub(crate) fn floats(&mut self, floats: usize) -> Result<&mut [f32]> {
        self.buf.grow(floats, "workspace")?;
        Ok(&mut self.buf.as_mut_slice()[..floats])
    }
}
