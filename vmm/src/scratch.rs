//! The sandbox's own writable disk: a sparse file the size of the run's disk limit, with an
//! empty ext4 file system made by the host, so it costs only what the guest writes.
//!
//! The host makes the file system (rather than the guest) so the guest's init needs no
//! `mke2fs`, and the file system is known-good before the guest sees it. The host never reads
//! the disk back as a file system: after boot it is guest-controlled bytes.

use std::path::{Path, PathBuf};
use std::process::Command;

use thiserror::Error;

/// The largest scratch disk accepted: 16 TiB, far above any run's limit, far below ext4's.
pub const MAX_MIB: u64 = 16 << 20;

/// Why a scratch disk could not be made.
#[derive(Debug, Error)]
pub enum ScratchError {
    /// The size is outside what a sandbox disk may be.
    #[error("a sandbox disk must be 64 MiB to {MAX_MIB} MiB, not {0} MiB")]
    Size(u64),
    /// The sparse file could not be created.
    #[error("creating the sandbox disk {path}: {source}")]
    Create {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// `mkfs.ext4` is missing.
    #[error(
        "mkfs.ext4 is not installed; install e2fsprogs (Debian: `bash scripts/install-deps.sh`; macOS: `brew install e2fsprogs`)"
    )]
    NoMkfs,
    /// `mkfs.ext4` failed.
    #[error("mkfs.ext4 failed on {path}: {output}")]
    Mkfs {
        /// The file.
        path: PathBuf,
        /// What it printed.
        output: String,
    },
}

/// Where `mkfs.ext4` is; sbin directories are often missing from a non-root PATH, and Homebrew
/// keeps e2fsprogs off it (keg-only, as macOS has no ext4 of its own).
fn mkfs() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            [
                "/usr/sbin",
                "/sbin",
                "/opt/homebrew/opt/e2fsprogs/sbin",
                "/usr/local/opt/e2fsprogs/sbin",
            ]
            .map(PathBuf::from),
        )
        .map(|d| d.join("mkfs.ext4"))
        .find(|p| p.is_file())
}

/// Makes `path` a sparse file of `size_mib` MiB holding an empty ext4 file system.
pub fn create(path: &Path, size_mib: u64) -> Result<(), ScratchError> {
    if !(64..=MAX_MIB).contains(&size_mib) {
        return Err(ScratchError::Size(size_mib));
    }
    let create = |source| ScratchError::Create {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(create)?;
    file.set_len(size_mib << 20).map_err(create)?;
    drop(file);
    let mkfs = mkfs().ok_or(ScratchError::NoMkfs)?;
    // lazy_*_init and nodiscard: write only the metadata that must exist; the guest mounts it
    // with noinit_itable, so nothing zeroes the inode tables later either. No reserved blocks:
    // the guest's user is root anyway.
    let out = Command::new(mkfs)
        .args(["-q", "-F", "-m", "0", "-L", "sandbox", "-E"])
        .arg("lazy_itable_init=1,lazy_journal_init=1,nodiscard")
        .arg(path)
        .output()
        .map_err(create)?;
    if !out.status.success() {
        return Err(ScratchError::Mkfs {
            path: path.to_owned(),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_large_disk_costs_a_few_megabytes() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("d");
        create(&p, 20480).unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 20480 << 20);
        // 512-byte blocks actually allocated: metadata only.
        assert!(
            m.blocks() * 512 < 64 << 20,
            "{} bytes allocated",
            m.blocks() * 512
        );
        // The ext2/3/4 superblock magic, 0xEF53 little-endian, at byte 1080.
        use std::os::unix::fs::FileExt;
        let mut magic = [0u8; 2];
        std::fs::File::open(&p)
            .unwrap()
            .read_exact_at(&mut magic, 1080)
            .unwrap();
        assert_eq!(magic, [0x53, 0xef]);
    }

    #[test]
    fn bad_sizes_and_existing_files_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("d");
        assert!(matches!(create(&p, 1), Err(ScratchError::Size(1))));
        std::fs::write(&p, b"x").unwrap();
        let e = create(&p, 128).unwrap_err().to_string();
        assert!(e.contains("creating the sandbox disk"), "{e}");
    }
}
