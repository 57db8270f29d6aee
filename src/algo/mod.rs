//! One file per algorithm. Each packs its weights at create time, plans a fixed input size,
//! and runs without allocating.

pub(crate) mod im2col_gemm;

/// The algorithms convkit can run a convolution with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Algorithm {
    /// im2col (a block at a time, packed straight into GEMM panels) + the blocked GEMM. Takes
    /// every shape.
    Im2colGemm,
}

impl Algorithm {
    /// Every algorithm, in the order `convkit check` tries them.
    pub const ALL: [Algorithm; 1] = [Algorithm::Im2colGemm];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Im2colGemm => "im2col_gemm",
        }
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name() == s.trim())
            .ok_or_else(|| crate::Error::InvalidParameter {
                what: "algorithm name",
                detail: format!("{s:?} is not one of {:?}", Algorithm::ALL.map(|a| a.name())),
            })
    }
}
