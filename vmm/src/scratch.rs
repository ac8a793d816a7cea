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

/// Copies the sandbox disk `from` to `to` (created, not there before) with its holes: a disk
/// of 20 GiB that holds a few megabytes costs a few megabytes. Data runs are found with
/// SEEK_DATA/SEEK_HOLE and copied with copy_file_range (shared extents where the file system
/// can). `from` must not change meanwhile (the guest that writes it is paused or gone).
#[cfg(target_os = "linux")]
pub fn copy_sparse(from: &Path, to: &Path) -> Result<u64, ScratchError> {
    use std::os::fd::AsRawFd;
    let create = |source| ScratchError::Create {
        path: to.to_owned(),
        source,
    };
    let src = std::fs::File::open(from).map_err(|source| ScratchError::Create {
        path: from.to_owned(),
        source,
    })?;
    let len = src.metadata().map_err(create)?.len();
    let dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)
        .map_err(create)?;
    dst.set_len(len).map_err(create)?;
    let (s, d) = (src.as_raw_fd(), dst.as_raw_fd());
    let mut copied = 0u64;
    let mut at: libc::off_t = 0;
    // Each turn moves past one data run (or ends): bounded by the file's extents.
    while (at as u64) < len {
        // SAFETY: lseek on our own descriptor.
        let data = unsafe { libc::lseek(s, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after `at`
            }
            return Err(create(e));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(s, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(create(std::io::Error::last_os_error()));
        }
        let (mut off_in, mut off_out) = (data, data);
        while off_in < hole {
            // SAFETY: copy_file_range between our two descriptors with offsets it updates.
            let n = unsafe {
                libc::copy_file_range(s, &mut off_in, d, &mut off_out, (hole - off_in) as usize, 0)
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(create(e));
            }
            if n == 0 {
                break; // the file shrank under us: what is left reads as zeros
            }
            copied += n as u64;
        }
        at = hole;
    }
    dst.sync_data().map_err(create)?;
    Ok(copied)
}

/// macOS has no snapshots (no KVM backend); its copy clones on APFS.
#[cfg(not(target_os = "linux"))]
pub fn copy_sparse(from: &Path, to: &Path) -> Result<u64, ScratchError> {
    if to.exists() {
        return Err(ScratchError::Create {
            path: to.to_owned(),
            source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
        });
    }
    std::fs::copy(from, to).map_err(|source| ScratchError::Create {
        path: to.to_owned(),
        source,
    })
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
    fn a_copy_keeps_the_data_and_the_holes() {
        use std::os::unix::fs::FileExt;
        let t = tempfile::tempdir().unwrap();
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        create(&a, 20480).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&a).unwrap();
        f.write_all_at(b"written by the guest", 7 << 30).unwrap();
        f.write_all_at(b"end", (20480 << 20) - 3).unwrap();
        drop(f);
        copy_sparse(&a, &b).unwrap();
        let (ma, mb) = (
            std::fs::metadata(&a).unwrap(),
            std::fs::metadata(&b).unwrap(),
        );
        assert_eq!(mb.len(), ma.len());
        assert!(
            mb.blocks() * 512 < 64 << 20,
            "{} bytes allocated",
            mb.blocks() * 512
        );
        let g = std::fs::File::open(&b).unwrap();
        let mut buf = [0u8; 20];
        g.read_exact_at(&mut buf, 7 << 30).unwrap();
        assert_eq!(&buf, b"written by the guest");
        let mut end = [0u8; 3];
        g.read_exact_at(&mut end, (20480 << 20) - 3).unwrap();
        assert_eq!(&end, b"end");
        let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
        std::fs::File::open(&a)
            .unwrap()
            .read_exact_at(&mut x, 0)
            .unwrap();
        g.read_exact_at(&mut y, 0).unwrap();
        assert_eq!(x, y, "the file system's metadata");
        assert!(
            copy_sparse(&a, &b).is_err(),
            "an existing target is never overwritten"
        );
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
