//! Builds the hostile guest helper `tests/guest/freeze.c` as a static binary that the tests put
//! into a guest. Without a C compiler (or static libc) the file stays empty and the tests that
//! need it say they were skipped and why.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "guest/freeze.c";
    println!("cargo:rerun-if-changed={src}");
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("freeze");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-static", "-O2", "-Wall", "-o"])
        .arg(&out)
        .arg(src)
        .status()
        .is_ok_and(|s| s.success());
    if !built {
        println!(
            "cargo:warning=could not build {src} with `{cc} -static`; the frozen-guest tests will skip"
        );
        std::fs::write(&out, b"").expect("writing OUT_DIR");
    }
}
