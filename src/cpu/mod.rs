//! ISA detection and the dispatch table of generated kernels.
//!
//! The ISA is detected once; `Options::isa` or the `CONVKIT_ISA` environment variable can
//! lower it (never raise it past what the CPU has), which is how per-ISA tests and benches run
//! every level on one machine. A kernel of an ISA the CPU lacks is never called.

use crate::{Error, Result};
use std::sync::OnceLock;

/// The generated kernels (see `codegen/`), compiled for this target.
#[allow(clippy::all)]
pub(crate) mod generated {
    include!(concat!(env!("OUT_DIR"), "/gemm_f32.rs"));
}

/// The generated layout kernels (transposes).
#[allow(clippy::all)]
pub(crate) mod generated_layout {
    include!(concat!(env!("OUT_DIR"), "/layout.rs"));
}

pub(crate) use generated_layout::{Transpose8x8, TransposeMasked16, TransposeRows8x8};

/// The generated Winograd transforms.
#[allow(clippy::all)]
pub(crate) mod generated_wino {
    include!(concat!(env!("OUT_DIR"), "/wino_f32.rs"));
}

/// The generated Winograd transforms compiled for this target.
pub(crate) fn wino_f32() -> &'static [crate::algo::winograd::WinoKernel] {
    generated_wino::WINO_F32_KERNELS
}

/// The filter transform `G` (t x 3) of F(m, 3) and its interpolation points.
pub(crate) fn wino_g(m: usize) -> &'static [[f64; 3]] {
    generated_wino::WINO_G
        .iter()
        .find(|g| g.0 == m)
        .map(|g| g.2)
        .expect("every tile size of the Winograd registry has its G")
}

/// The output transform `At` (m x t) of F(m, 3).
pub(crate) fn wino_at(m: usize) -> &'static [&'static [f64]] {
    generated_wino::WINO_AT
        .iter()
        .find(|a| a.0 == m)
        .map(|a| a.1)
        .expect("every tile size of the Winograd registry has its At")
}

/// The best 8x8 transpose kernel `isa` can run.
pub(crate) fn transpose_8x8(isa: Isa) -> generated_layout::Transpose8x8 {
    best_layout(generated_layout::TRANSPOSE_8X8, isa)
}

/// The best 8x8 transpose over row pointers `isa` can run.
pub(crate) fn transpose_rows_8x8(isa: Isa) -> generated_layout::TransposeRows8x8 {
    best_layout(generated_layout::TRANSPOSE_ROWS_8X8, isa)
}

/// The masked 16x16 transpose, where `isa` can run one.
pub(crate) fn transpose_masked_16(isa: Isa) -> Option<TransposeMasked16> {
    generated_layout::TRANSPOSE_MASKED_16
        .iter()
        .find(|(i, _)| *i <= isa && i.family() == isa.family())
        .map(|&(_, f)| f)
}

/// The entry of a layout registry for the highest ISA of `isa`'s family up to `isa` (every
/// registry starts with its scalar kernel).
fn best_layout<F: Copy>(table: &[(Isa, F)], isa: Isa) -> F {
    table
        .iter()
        .rev()
        .find(|(i, _)| *i <= isa && (*i == Isa::Scalar || i.family() == isa.family()))
        .map_or(table[0].1, |&(_, f)| f)
}

/// The generated int8 GEMM microkernels.
#[cfg(feature = "int8")]
#[allow(clippy::all)]
pub(crate) mod generated_q {
    include!(concat!(env!("OUT_DIR"), "/qgemm_i8.rs"));
}

/// The generated int8 depthwise kernels.
#[cfg(feature = "int8")]
#[allow(clippy::all)]
pub(crate) mod generated_qdw {
    include!(concat!(env!("OUT_DIR"), "/qdw_i8.rs"));
}

/// True if this CPU has AVX-512 VNNI and VBMI (the int8 depthwise kernels' byte gathers).
pub fn has_vnni_vbmi() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VBMI: OnceLock<bool> = OnceLock::new();
        *VBMI.get_or_init(|| has_vnni() && std::arch::is_x86_feature_detected!("avx512vbmi"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The generated int8 depthwise kernels this CPU can run, at ISA level `isa`.
#[cfg(feature = "int8")]
pub(crate) fn qdw(isa: Isa) -> &'static [crate::algo::qdepthwise::QDwKernel] {
    if isa == Isa::Avx512 && has_vnni_vbmi() {
        generated_qdw::QDW_KERNELS
    } else {
        &[]
    }
}

/// The small-plane int8 depthwise kernel, where this CPU can run it at ISA level `isa`.
#[cfg(feature = "int8")]
pub(crate) fn qdw_small(isa: Isa) -> Option<&'static crate::algo::qdepthwise::QDwSmallKernel> {
    generated_qdw::QDW_SMALL_KERNELS
        .first()
        .filter(|_| isa == Isa::Avx512 && has_vnni_vbmi())
}

/// An int8 depthwise kernel found by name: a row kernel of one shape, or the small-plane one.
#[cfg(feature = "int8")]
pub(crate) enum QDwByName {
    Rows(&'static crate::algo::qdepthwise::QDwKernel),
    Small(&'static crate::algo::qdepthwise::QDwSmallKernel),
}

#[cfg(feature = "int8")]
impl QDwByName {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            QDwByName::Rows(k) => k.name,
            QDwByName::Small(k) => k.name,
        }
    }
}

/// The int8 depthwise kernel named `name`, if there is one (None: not a depthwise name).
#[cfg(feature = "int8")]
pub(crate) fn qdw_by_name(name: &str) -> Result<Option<QDwByName>> {
    let name = name.trim();
    let rows = generated_qdw::QDW_KERNELS.iter().find(|k| k.name == name);
    let small = generated_qdw::QDW_SMALL_KERNELS
        .iter()
        .find(|k| k.name == name);
    let Some(k) = rows.map(QDwByName::Rows).or(small.map(QDwByName::Small)) else {
        return Ok(None);
    };
    if has_vnni_vbmi() {
        Ok(Some(k))
    } else {
        Err(Error::IsaUnavailable {
            requested: k.name().into(),
            available: "a CPU without AVX-512 VNNI and VBMI".into(),
        })
    }
}

/// True if this CPU has AVX-512 VNNI (the int8 dot products of the `avx512vnni` kernels).
pub fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: OnceLock<bool> = OnceLock::new();
        *VNNI.get_or_init(|| {
            Isa::available().contains(&Isa::Avx512)
                && std::arch::is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// True if this CPU can run `k`: its ISA, and VNNI where it needs it.
#[cfg(feature = "int8")]
fn runs(k: &crate::algo::qgemm::QGemmKernel) -> bool {
    Isa::available().contains(&k.isa) && (!k.vnni || has_vnni())
}

/// The best int8 GEMM microkernel at `isa`: VNNI where the CPU has it, else the ISA's own.
#[cfg(feature = "int8")]
pub(crate) fn qgemm(isa: Isa) -> &'static crate::algo::qgemm::QGemmKernel {
    let all = generated_q::QGEMM_KERNELS;
    all.iter()
        .filter(|k| k.isa == isa && runs(k))
        .max_by_key(|k| k.vnni)
        .or_else(|| all.iter().find(|k| k.isa == Isa::Scalar))
        .expect("the scalar int8 GEMM kernel is always generated")
}

/// The int8 GEMM microkernel named `name`, if this CPU can run it.
#[cfg(feature = "int8")]
pub(crate) fn qgemm_by_name(name: &str) -> Result<&'static crate::algo::qgemm::QGemmKernel> {
    let k = generated_q::QGEMM_KERNELS
        .iter()
        .find(|k| k.name == name.trim())
        .ok_or_else(|| Error::InvalidParameter {
            what: "int8 kernel name",
            detail: format!(
                "{name:?} is not an int8 kernel of this build (`convkit info` lists them)"
            ),
        })?;
    if runs(k) {
        Ok(k)
    } else {
        Err(Error::IsaUnavailable {
            requested: k.name.into(),
            available: Isa::available()
                .iter()
                .map(|i| i.name())
                .collect::<Vec<_>>()
                .join(", ")
                + if has_vnni() {
                    " (with VNNI)"
                } else {
                    " (without VNNI)"
                },
        })
    }
}

/// The generated depthwise kernels, one module per ISA.
#[allow(clippy::all)]
pub(crate) mod generated_dw {
    include!(concat!(env!("OUT_DIR"), "/dw_f32.rs"));
}

/// An instruction-set level. Levels of one architecture are ordered: a CPU that has one has
/// every lower one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, no explicit SIMD.
    Scalar,
    /// x86-64 AVX2 + FMA (x86-64-v3).
    Avx2,
    /// x86-64 AVX-512F (and the rest of x86-64-v4).
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// The lowercase name used in kernel names, `CONVKIT_ISA` and `--isa`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// The levels this CPU can run and this build has kernels for, lowest first (always starts
    /// with `Scalar`). A level the CPU has but the build left out (cargo features `avx2`,
    /// `avx512`, `neon`) is not here: it is never chosen, and asking for it (`Options::isa`,
    /// `CONVKIT_ISA`) is `Error::IsaUnavailable`.
    pub fn available() -> &'static [Isa] {
        static AVAILABLE: OnceLock<Vec<Isa>> = OnceLock::new();
        AVAILABLE.get_or_init(|| detect().into_iter().filter(|i| i.built()).collect())
    }

    /// True if this build has the kernels of this level (its cargo feature is on; scalar
    /// always).
    pub fn built(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => cfg!(feature = "avx2"),
            Isa::Avx512 => cfg!(feature = "avx512"),
            Isa::Neon => cfg!(feature = "neon"),
        }
    }

    /// The best level of this CPU.
    pub fn best() -> Isa {
        *Isa::available().last().unwrap_or(&Isa::Scalar)
    }

    /// The level convkit uses by default: `CONVKIT_ISA` if set, else the best one.
    pub fn default_level() -> Result<Isa> {
        match std::env::var("CONVKIT_ISA") {
            Ok(s) if !s.is_empty() => Isa::check(s.parse()?),
            _ => Ok(Isa::best()),
        }
    }

    /// `Ok(isa)` if this CPU can run it, else `Error::IsaUnavailable`.
    pub fn check(isa: Isa) -> Result<Isa> {
        if Isa::available().contains(&isa) {
            Ok(isa)
        } else {
            let available: Vec<&str> = Isa::available().iter().map(|i| i.name()).collect();
            Err(Error::IsaUnavailable {
                requested: isa.name().into(),
                available: available.join(", "),
            })
        }
    }
}

impl Isa {
    /// The architecture a level belongs to (levels compare only within one).
    fn family(self) -> &'static str {
        match self {
            Isa::Scalar => "any",
            Isa::Avx2 | Isa::Avx512 => "x86_64",
            Isa::Neon => "aarch64",
        }
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Isa {
    type Err = Error;
    fn from_str(s: &str) -> Result<Isa> {
        Isa::ALL
            .into_iter()
            .find(|i| i.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| Error::InvalidParameter {
                what: "ISA name",
                detail: format!("{s:?} is not one of scalar, avx2, avx512, neon"),
            })
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    // x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE — and the OS saves the ymm state.
    if pulp::x86::V3::try_new().is_some() {
        v.push(Isa::Avx2);
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl")
        {
            v.push(Isa::Avx512);
        }
    }
    v
}

#[cfg(target_arch = "aarch64")]
fn detect() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    if std::arch::is_aarch64_feature_detected!("neon") {
        v.push(Isa::Neon);
    }
    v
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn detect() -> Vec<Isa> {
    vec![Isa::Scalar]
}

/// Bytes of the L2 cache one core has (the level-2 data or unified cache CPUID describes),
/// read once; 1 MiB (Zen 4's, on which the L2-sized blocks were first measured) where the
/// CPU does not say or is not x86-64.
pub fn l2_bytes() -> usize {
    static L2: OnceLock<usize> = OnceLock::new();
    *L2.get_or_init(|| detect_l2().unwrap_or(1 << 20))
}

#[cfg(target_arch = "x86_64")]
fn detect_l2() -> Option<usize> {
    use raw_cpuid::{CacheType, CpuId};
    let cpuid = CpuId::new();
    let leaf4 = cpuid.get_cache_parameters().and_then(|mut caches| {
        caches.find_map(|c| {
            let data = matches!(c.cache_type(), CacheType::Data | CacheType::Unified);
            (c.level() == 2 && data).then(|| {
                c.associativity()
                    * c.physical_line_partitions()
                    * c.coherency_line_size()
                    * c.sets()
            })
        })
    });
    // AMD parts without the cache-parameters leaf give the L2 size (KiB) in 0x8000_0006.
    let size = leaf4.or_else(|| {
        let kib = cpuid.get_l2_l3_cache_and_tlb_info()?.l2cache_size() as usize;
        Some(kib * 1024)
    })?;
    // A size below any real L2 (or absurdly large) is a hypervisor's invention: ignore it.
    (256 << 10..=64 << 20).contains(&size).then_some(size)
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_l2() -> Option<usize> {
    None
}

/// True on an AMD CPU, whose row-pointer GEMM blocks were measured to want other sizes than
/// Intel's (see `gemm::row_panel_bytes`); read once.
pub(crate) fn is_amd() -> bool {
    static AMD: OnceLock<bool> = OnceLock::new();
    *AMD.get_or_init(detect_amd)
}

#[cfg(target_arch = "x86_64")]
fn detect_amd() -> bool {
    raw_cpuid::CpuId::new()
        .get_vendor_info()
        .is_some_and(|v| v.as_str() == "AuthenticAMD")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_amd() -> bool {
    false
}

/// The f32 GEMM microkernel for `isa` (every ISA has one: the generator's table says so, and a
/// test checks it).
pub(crate) fn gemm_f32(isa: Isa) -> &'static crate::gemm::GemmKernel {
    generated::GEMM_F32_KERNELS
        .iter()
        .find(|k| k.isa == isa)
        .or_else(|| {
            generated::GEMM_F32_KERNELS
                .iter()
                .find(|k| k.isa == Isa::Scalar)
        })
        .expect("the scalar GEMM kernel is always generated")
}

/// The generated depthwise kernels compiled for this target.
pub(crate) fn dw_f32() -> &'static [crate::algo::depthwise::DwKernel] {
    generated_dw::DW_F32_KERNELS
}

/// The generated 16-bit (f16, bf16) depthwise kernels compiled for this target.
pub(crate) fn dw_half() -> &'static [crate::algo::depthwise::DwKernel] {
    generated_dw::DW_HALF_KERNELS
}

/// The generated direct kernels compiled for this target.
pub(crate) fn direct_f32() -> &'static [crate::algo::direct::DirectKernel] {
    generated_dw::DIRECT_F32_KERNELS
}

/// A kernel family of the registry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Family {
    /// GEMM microkernels (the im2col+GEMM path).
    Gemm,
    /// Depthwise kernels.
    Depthwise,
    /// Direct (dense or grouped) NCHW kernels.
    Direct,
    /// Winograd input and output transforms (the products run on the GEMM microkernels).
    Winograd,
    /// int8 GEMM microkernels (quantized convolutions, `QConv2d`; feature `int8`).
    QGemm,
    /// int8 depthwise kernels (quantized depthwise convolutions).
    QDepthwise,
}

impl Family {
    /// True for the int8 kernels, which run quantized convolutions, not f32 ones.
    pub fn is_int8(self) -> bool {
        matches!(self, Family::QGemm | Family::QDepthwise)
    }
}

/// One generated kernel, as the registry describes it: what tests and benchmarks iterate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// The kernel's name: family, data type, shape and ISA.
    pub name: &'static str,
    /// The ISA level the kernel needs.
    pub isa: Isa,
    /// The kernel family (which algorithm runs it).
    pub family: Family,
    /// The layout the kernel works in, where it has one.
    pub layout: Option<crate::Layout>,
    /// `Some((kernel, stride))` for a kernel unrolled for one square kernel and stride
    /// (dilation 1); `None` for one that takes any.
    pub fixed: Option<(usize, usize)>,
    /// The kernel takes only 1-D convolutions (kernel height 1; `fixed` is then its width).
    pub conv1d: bool,
    /// A flat-plane depthwise kernel: the f32 ones take stride 1 with an output as wide as
    /// the input only ("same" padding, or explicit left and right padding adding up to the
    /// kernel's reach), any kernel and dilation; the int8 one (`qdw_u8i8_plane64_*`) planes of
    /// at most 64 inputs and outputs, any kernel, stride, dilation and padding.
    pub flat: bool,
    /// The type the kernel reads and writes tensors in: f32 for all but the 16-bit depthwise
    /// kernels (`dw_f16_*`, `dw_bf16_*`, run by [`Plan::run_storage`](crate::Plan::run_storage)).
    pub storage: crate::StorageType,
}

/// Every generated kernel compiled for this target (whether or not this CPU can run it).
pub fn registry() -> Vec<KernelInfo> {
    let gemm = generated::GEMM_F32_KERNELS.iter().map(|k| KernelInfo {
        name: k.name,
        isa: k.isa,
        family: Family::Gemm,
        layout: None,
        fixed: None,
        conv1d: false,
        flat: false,
        storage: crate::StorageType::F32,
    });
    let dw = dw_f32().iter().chain(dw_half()).map(|k| KernelInfo {
        name: k.name,
        isa: k.isa,
        family: Family::Depthwise,
        layout: Some(k.layout),
        fixed: k.fixed,
        conv1d: false,
        flat: k.flat,
        storage: k.storage,
    });
    let direct = direct_f32().iter().map(|k| KernelInfo {
        name: k.name,
        isa: k.isa,
        family: Family::Direct,
        layout: Some(crate::Layout::Nchw),
        fixed: Some(k.fixed),
        conv1d: false,
        flat: false,
        storage: crate::StorageType::F32,
    });
    let wino = wino_f32().iter().map(|k| KernelInfo {
        name: k.name,
        isa: k.isa,
        family: Family::Winograd,
        layout: None,
        fixed: Some((3, 1)),
        conv1d: k.dims == 1,
        flat: false,
        storage: crate::StorageType::F32,
    });
    #[cfg(feature = "int8")]
    let q = generated_q::QGEMM_KERNELS.iter().map(|k| KernelInfo {
        name: k.name,
        isa: k.isa,
        family: Family::QGemm,
        layout: None,
        fixed: None,
        conv1d: false,
        flat: false,
        storage: crate::StorageType::F32,
    });
    #[cfg(feature = "int8")]
    let qdw = generated_qdw::QDW_KERNELS.iter().map(|k| KernelInfo {
        name: k.name,
        isa: Isa::Avx512,
        family: Family::QDepthwise,
        layout: None,
        fixed: Some((k.k, k.s)),
        conv1d: false,
        flat: false,
        storage: crate::StorageType::F32,
    });
    // The small-plane kernel takes any kernel size and stride (`flat`: planes of at most 64).
    #[cfg(feature = "int8")]
    let qdw_small = generated_qdw::QDW_SMALL_KERNELS.iter().map(|k| KernelInfo {
        name: k.name,
        isa: Isa::Avx512,
        family: Family::QDepthwise,
        layout: None,
        fixed: None,
        conv1d: false,
        flat: true,
        storage: crate::StorageType::F32,
    });
    let all = gemm.chain(dw).chain(direct).chain(wino);
    #[cfg(feature = "int8")]
    let all = all.chain(q).chain(qdw).chain(qdw_small);
    all.collect()
}

/// The registry entry named `name`, or `Error::InvalidParameter` listing what there is.
pub fn find_kernel(name: &str) -> Result<KernelInfo> {
    let all = registry();
    all.iter()
        .find(|k| k.name == name.trim())
        .copied()
        .ok_or_else(|| Error::InvalidParameter {
            what: "kernel name",
            detail: format!(
                "{name:?} is not a kernel of this build (`convkit info` lists them; {} in all)",
                all.len()
            ),
        })
}

/// Names of the generated kernels available at each ISA level, for `convkit info`.
pub fn kernel_names(isa: Isa) -> Vec<&'static str> {
    registry()
        .into_iter()
        .filter(|k| k.isa == isa)
        .map(|k| k.name)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_available_isa_has_its_own_gemm_kernel() {
        for &isa in Isa::available() {
            assert_eq!(gemm_f32(isa).isa, isa, "no GEMM kernel generated for {isa}");
        }
    }

    /// Every block size the masked transpose takes, against the definition, with rows apart by
    /// more than 16 floats: each element of the block lands transposed and nothing outside the
    /// `r x c` source rows is read into it, nor anything outside the `c x r` destination rows
    /// written (a NaN sentinel around both).
    #[test]
    fn masked_16_transpose_moves_exactly_its_block() {
        let Some(t) = Isa::available()
            .iter()
            .find_map(|&isa| transpose_masked_16(isa))
        else {
            assert!(
                !Isa::available().contains(&Isa::Avx512),
                "AVX-512 without the transpose"
            );
            return;
        };
        let (ss, ds) = (19, 21);
        for r in 1..=16 {
            for c in 1..=16 {
                let src: Vec<f32> = (0..16 * ss)
                    .map(|i| {
                        if i % ss < c && i / ss < r {
                            i as f32
                        } else {
                            f32::NAN
                        }
                    })
                    .collect();
                let mut dst = vec![-1.0f32; 16 * ds];
                // SAFETY: AVX-512 is available (the transpose was found for an available
                // ISA); src holds r rows of c floats ss apart, dst c rows of r floats ds apart.
                unsafe { t(src.as_ptr(), ss, dst.as_mut_ptr(), ds, r, c) };
                for (k, &v) in dst.iter().enumerate() {
                    let (j, i) = (k / ds, k % ds);
                    let want = if j < c && i < r {
                        (i * ss + j) as f32
                    } else {
                        -1.0
                    };
                    assert_eq!(v, want, "r {r} c {c}: dst[{j}][{i}]");
                }
            }
        }
    }

    #[test]
    fn isa_names_round_trip() {
        for isa in Isa::ALL {
            assert_eq!(isa.name().parse::<Isa>().unwrap(), isa);
        }
    }
}
