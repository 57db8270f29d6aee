//! Runs the kernel generator and writes its output into OUT_DIR, where `src/cpu/` includes it.
//! The cargo features `avx2`, `avx512`, `neon`, `int8` and `f16` choose what it emits.

fn main() {
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let feature = |name: &str| std::env::var_os(format!("CARGO_FEATURE_{name}")).is_some();
    let isas = [
        ("AVX2", codegen::Isa::Avx2),
        ("AVX512", codegen::Isa::Avx512),
        ("NEON", codegen::Isa::Neon),
    ]
    .into_iter()
    .filter(|(f, _)| feature(f))
    .map(|(_, isa)| isa)
    .collect();
    let selection = codegen::Selection {
        isas,
        int8: feature("INT8"),
        half: feature("F16"),
    };
    for g in codegen::generate_selected(&selection) {
        std::fs::write(out.join(g.file), g.source).expect("write generated kernels to OUT_DIR");
    }
    println!("cargo:rerun-if-changed=codegen/src");
    println!("cargo:rerun-if-changed=build.rs");
}
