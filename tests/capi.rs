//! The C ABI against its header and from C (feature `capi`):
//! - `include/convkit.h` declares exactly the functions `src/capi.rs` exports, and the C
//!   test calls every one of them;
//! - every constant of either side is in the other with the same value, and every struct
//!   has the same size, alignment and field offsets in C as in Rust: `_Static_assert`s
//!   generated here from `size_of`/`offset_of!`, compiled into the C test;
//! - `tests/c/capi_test.c` (C11, `-Wall -Wextra -Werror`), linked against `libconvkit.a`,
//!   runs 3x3, depthwise, grouped, 1-D and int8 convolutions checked against the definition
//!   computed in C, and the error cases;
//! - `examples/c/mobilenet_block.c` builds and runs;
//! - the header compiles as C++ too (where a C++ compiler exists).
//!
//! The C compiler is `$CC`, else `cc`.
#![cfg(feature = "capi")]

use convkit::capi::*;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"))
}

/// The target profile directory this test runs from (`target/debug`), where cargo put the
/// `libconvkit.a` this test's build made.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// A scratch directory for the C builds.
fn scratch() -> PathBuf {
    let dir = profile_dir().join("capi-test");
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

/// The words `name(` in `text` that start with `prefix`.
fn called(text: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices(prefix) {
        if i > 0 {
            let before = text.as_bytes()[i - 1];
            if before.is_ascii_alphanumeric() || before == b'_' {
                continue;
            }
        }
        let word: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if text[i + word.len()..].starts_with('(') {
            out.insert(word);
        }
    }
    out
}

/// The functions `src/capi.rs` exports.
fn exported() -> BTreeSet<String> {
    let src = read("src/capi.rs");
    let mut out = BTreeSet::new();
    for line in src.lines() {
        if let Some(rest) = line
            .strip_prefix("pub unsafe extern \"C\" fn ")
            .or_else(|| line.strip_prefix("pub extern \"C\" fn "))
        {
            out.insert(rest.split('(').next().unwrap().to_string());
        }
    }
    assert!(out.len() > 20, "found only {out:?} in src/capi.rs");
    out
}

/// `(name, value)` of the constants `src/capi.rs` defines (`pub const CONVKIT_…: T = v;`).
fn rust_constants() -> Vec<(String, i64)> {
    read("src/capi.rs")
        .lines()
        .filter_map(|l| l.strip_prefix("pub const CONVKIT_"))
        .map(|rest| {
            let (name, value) = rest.split_once(':').expect("pub const NAME: T = v;");
            let value = value
                .split('=')
                .nth(1)
                .expect("= v")
                .trim()
                .trim_end_matches(';');
            (
                format!("CONVKIT_{name}"),
                value.parse().expect("an integer"),
            )
        })
        .collect()
}

/// `(name, value)` of the header's enum constants and `#define CONVKIT_… n`.
fn header_constants() -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for line in read("include/convkit.h").lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("#define CONVKIT_") {
            if let Some((name, v)) = rest.split_once(' ') {
                if let Ok(v) = v.trim().parse() {
                    out.push((format!("CONVKIT_{name}"), v));
                }
            }
        } else if line.starts_with("CONVKIT_") && line.contains(" = ") {
            let (name, v) = line.split_once(" = ").unwrap();
            let v: String = v.chars().take_while(|c| c.is_ascii_digit()).collect();
            out.push((name.to_string(), v.parse().expect("an enum value")));
        }
    }
    out
}

#[test]
fn header_declares_every_exported_function_and_the_c_test_calls_each() {
    let header = called(&read("include/convkit.h"), "convkit_");
    let rust = exported();
    assert_eq!(header, rust, "include/convkit.h and src/capi.rs differ");
    let test = called(&read("tests/c/capi_test.c"), "convkit_");
    let missing: Vec<_> = rust.difference(&test).collect();
    assert!(
        missing.is_empty(),
        "tests/c/capi_test.c never calls {missing:?}"
    );
}

#[test]
fn header_and_rust_have_the_same_constants() {
    let rust = rust_constants();
    let header = header_constants();
    let (r, h): (BTreeSet<_>, BTreeSet<_>) =
        (rust.into_iter().collect(), header.into_iter().collect());
    assert_eq!(
        r, h,
        "constants differ between src/capi.rs and include/convkit.h"
    );
}

/// The `_Static_assert`s that pin the header's layout to Rust's.
fn abi_checks() -> String {
    let mut s = String::from("/* Generated by tests/capi.rs from the Rust side. */\n");
    macro_rules! layout {
        ($t:ty, $c:literal, [$($f:ident),* $(,)?]) => {
            writeln!(s, "_Static_assert(sizeof({0}) == {1}, \"sizeof({0}) is {1} in Rust\");",
                $c, size_of::<$t>()).unwrap();
            writeln!(s, "_Static_assert(_Alignof({0}) == {1}, \"_Alignof({0}) is {1} in Rust\");",
                $c, align_of::<$t>()).unwrap();
            $(
                writeln!(s, "_Static_assert(offsetof({0}, {1}) == {2}, \"{0}.{1} is at {2} in Rust\");",
                    $c, stringify!($f), offset_of!($t, $f)).unwrap();
            )*
        };
    }
    layout!(
        convkit_conv_params,
        "convkit_conv_params",
        [
            in_channels,
            out_channels,
            groups,
            kernel_h,
            kernel_w,
            stride_h,
            stride_w,
            dilation_h,
            dilation_w,
            pad_top,
            pad_bottom,
            pad_left,
            pad_right,
            padding,
            layout,
            activation,
            activation_min,
            activation_max,
            activation_alpha,
        ]
    );
    layout!(
        convkit_options,
        "convkit_options",
        [threads, isa, precision, algorithm]
    );
    layout!(
        convkit_quant_params,
        "convkit_quant_params",
        [
            input_type,
            input_zero_point,
            input_scale,
            weight_scales,
            weight_scales_len,
            output_type,
            output_zero_point,
            output_scale,
        ]
    );
    layout!(
        convkit_plan_info,
        "convkit_plan_info",
        [
            output_shape,
            input_len,
            output_len,
            workspace_bytes,
            pads,
            flops,
        ]
    );
    writeln!(
        s,
        "_Static_assert(sizeof(convkit_status) == {}, \"convkit_status\");",
        size_of::<convkit_status>()
    )
    .unwrap();
    for (name, value) in rust_constants() {
        writeln!(
            s,
            "_Static_assert({name} == {value}, \"{name} is {value} in Rust\");"
        )
        .unwrap();
    }
    s
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// Compiles `source` against the header and `libconvkit.a` into `exe`, with `extra` flags.
fn build_c(source: &str, exe: &Path, extra: &[String]) {
    // Cargo writes the staticlib of a test build beside the tests (`deps/`), of a plain build
    // in the profile directory. Its name has no hash: a build with other features overwrites
    // it, so a stale one fails to link (undefined `convkit_*`): rebuild it with
    // `touch src/lib.rs`.
    let lib = [profile_dir().join("deps"), profile_dir()]
        .into_iter()
        .map(|d| d.join("libconvkit.a"))
        .find(|l| l.exists())
        .expect("libconvkit.a: the staticlib was not built");
    let mut cmd = Command::new(cc());
    cmd.args([
        "-std=c11",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-pedantic",
    ])
    .arg("-I")
    .arg(root().join("include"))
    .args(extra)
    .arg(root().join(source))
    .arg("-o")
    .arg(exe)
    .arg(&lib)
    // What a Rust staticlib needs from the system on Linux (`--print native-static-libs`).
    .args([
        "-lgcc_s",
        "-lutil",
        "-lrt",
        "-lpthread",
        "-lm",
        "-ldl",
        "-lc",
    ]);
    let out = cmd.output().unwrap_or_else(|e| panic!("run {}: {e}", cc()));
    assert!(
        out.status.success(),
        "{:?} failed:\n{}{}",
        cmd,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn run(exe: &Path) -> String {
    let out = Command::new(exe)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "{} failed: {:?}",
        exe.display(),
        out.status
    );
    stdout
}

#[test]
fn c_test_passes_against_the_definition() {
    let dir = scratch();
    let checks = dir.join("abi_check.h");
    std::fs::write(&checks, abi_checks()).unwrap();
    let exe = dir.join("capi_test");
    build_c(
        "tests/c/capi_test.c",
        &exe,
        &[
            format!("-DCONVKIT_ABI_CHECK=\"{}\"", checks.display()),
            format!(
                "-DCONVKIT_EXPECTED_VERSION=\"{}\"",
                env!("CARGO_PKG_VERSION")
            ),
        ],
    );
    let out = run(&exe);
    assert!(out.contains("all checks passed"), "{out}");
}

#[test]
fn c_example_runs() {
    let exe = scratch().join("mobilenet_block_c");
    build_c("examples/c/mobilenet_block.c", &exe, &[]);
    let out = run(&exe);
    assert!(out.contains("peak workspace"), "{out}");
}

#[test]
fn header_compiles_as_cpp() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let src = scratch().join("header.cpp");
    std::fs::write(&src, "#include \"convkit.h\"\nint main() { return convkit_abi_version() == CONVKIT_ABI_VERSION ? 0 : 1; }\n").unwrap();
    let out = match Command::new(&cxx)
        .args(["-fsyntax-only", "-Wall", "-Werror", "-I"])
        .arg(root().join("include"))
        .arg(&src)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("no C++ compiler ({cxx}: {e}); skipped");
            return;
        }
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn rust_side_of_the_abi_catches_panics_and_nulls() {
    // A NULL everywhere a value is needed is a status, never a crash.
    // SAFETY: NULL pointers are what is being tested; no pointer is dereferenced by us.
    unsafe {
        assert_eq!(
            convkit_conv_create(
                std::ptr::null(),
                std::ptr::null(),
                0,
                std::ptr::null(),
                0,
                std::ptr::null(),
                std::ptr::null_mut()
            ),
            CONVKIT_ERROR_NULL_POINTER
        );
    }
    let msg = convkit_last_error_message();
    // SAFETY: the message is a NUL-terminated string owned by this thread.
    let msg = unsafe { std::ffi::CStr::from_ptr(msg) }.to_string_lossy();
    assert!(msg.contains("NULL"), "{msg}");
}
