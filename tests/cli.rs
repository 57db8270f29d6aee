//! The command-line tool as a user runs it. x86-64 only: CI cross-builds the aarch64 tests
//! and runs them under qemu, where the test could not execute the aarch64 tool it spawns.
#![cfg(target_arch = "x86_64")]

use std::process::{Command, Stdio};

/// `convkit info | head -1`: a reader that closes the pipe early ends the tool quietly and
/// successfully, not with a panic about printing to stdout.
#[test]
fn closed_stdout_ends_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_convkit"))
        .arg("info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the read end closes before the first line is written
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `convkit info` prints the ISA levels it found.
#[test]
fn info_lists_isa_levels() {
    let out = Command::new(env!("CARGO_BIN_EXE_convkit"))
        .arg("info")
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("isa levels:") && stdout.contains("scalar"),
        "{stdout}"
    );
}
