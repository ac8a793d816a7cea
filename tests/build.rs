//! Builds the guest helpers as static binaries that the tests put into a guest: `getrandom`
//! (`tests/guest/getrandom.c`, this host's architecture) and the hostile `tests/guest/freeze.c`: `freeze` for this host's architecture and `freeze-aarch64` with Debian's cross
//! compiler, for the aarch64 guest under emulation (`SANDBOX_HOST_ARCH=aarch64`). Without a C
//! compiler (or static libc) a file stays empty and the tests that need it say they were skipped
//! and why.

use std::path::PathBuf;
use std::process::Command;

const SRC: &str = "guest/freeze.c";
const GETRANDOM: &str = "guest/getrandom.c";

fn main() {
    println!("cargo:rerun-if-changed={SRC}");
    println!("cargo:rerun-if-changed={GETRANDOM}");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    build(&cc, GETRANDOM, &out_dir.join("getrandom"));
    build(&cc, SRC, &out_dir.join("freeze"));
    let cross = if cfg!(target_arch = "aarch64") {
        cc
    } else {
        // Built again when the cross compiler appears (a path that does not exist reruns this).
        println!("cargo:rerun-if-changed=/usr/bin/aarch64-linux-gnu-gcc");
        "aarch64-linux-gnu-gcc".into()
    };
    build(&cross, SRC, &out_dir.join("freeze-aarch64"));
}

fn build(cc: &str, src: &str, out: &std::path::Path) {
    let built = Command::new(cc)
        .args(["-static", "-O2", "-Wall", "-o"])
        .arg(out)
        .arg(src)
        .status()
        .is_ok_and(|s| s.success());
    if !built {
        println!(
            "cargo:warning=could not build {src} with `{cc} -static`; the tests that need it will skip"
        );
        std::fs::write(out, b"").expect("writing OUT_DIR");
    }
}
