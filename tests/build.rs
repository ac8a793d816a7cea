//! Builds the hostile guest helper `tests/guest/freeze.c` as a static binary that the tests put
//! into a guest: `freeze` for this host's architecture and `freeze-aarch64` with Debian's cross
//! compiler, for the aarch64 guest under emulation (`SANDBOX_HOST_ARCH=aarch64`). Without a C
//! compiler (or static libc) a file stays empty and the tests that need it say they were skipped
//! and why.

use std::path::PathBuf;
use std::process::Command;

const SRC: &str = "guest/freeze.c";

fn main() {
    println!("cargo:rerun-if-changed={SRC}");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    build(&cc, &out_dir.join("freeze"));
    let cross = if cfg!(target_arch = "aarch64") {
        cc
    } else {
        // Built again when the cross compiler appears (a path that does not exist reruns this).
        println!("cargo:rerun-if-changed=/usr/bin/aarch64-linux-gnu-gcc");
        "aarch64-linux-gnu-gcc".into()
    };
    build(&cross, &out_dir.join("freeze-aarch64"));
}

fn build(cc: &str, out: &std::path::Path) {
    let src = SRC;
    let built = Command::new(cc)
        .args(["-static", "-O2", "-Wall", "-o"])
        .arg(out)
        .arg(src)
        .status()
        .is_ok_and(|s| s.success());
    if !built {
        println!(
            "cargo:warning=could not build {src} with `{cc} -static`; the frozen-guest tests will skip"
        );
        std::fs::write(out, b"").expect("writing OUT_DIR");
    }
}
