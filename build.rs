//! Runs the kernel generator and writes its output into OUT_DIR, where `src/cpu/` includes it.

fn main() {
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for g in codegen::generate() {
        std::fs::write(out.join(g.file), g.source).expect("write generated kernels to OUT_DIR");
    }
    println!("cargo:rerun-if-changed=codegen/src");
    println!("cargo:rerun-if-changed=build.rs");
}
