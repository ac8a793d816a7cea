//! The image store: named guest images, each a directory with a manifest, looked up at every
//! start so a newly built image applies to the next sandbox without a restart.
//!
//! Layout: `<store>/<name>` is a symlink to a build directory (`.<name>-<key>`) holding
//! `manifest.json` and the files it names. A rebuild swaps the symlink with one rename, so a
//! reader sees the old image or the new one, never a half-written one.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::arch::Arch;
use crate::backend::{Disk, VmSpec};
use thiserror::Error;

/// The image every host has once `rootfs/build-stock.sh` ran: kernel plus initramfs.
pub const STOCK: &str = "stock";

/// Why an image cannot be used.
#[derive(Debug, Error)]
pub enum ImageError {
    /// No image of that name in the store.
    #[error("no image `{name}` in the image store {store}{hint}")]
    Missing {
        /// The image asked for.
        name: String,
        /// The store.
        store: PathBuf,
        /// What to do about it.
        hint: String,
    },
    /// The manifest could not be read.
    #[error("the manifest of image `{name}` ({path}) is unreadable: {why}; build the image again")]
    BadManifest {
        /// The image.
        name: String,
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The image was built for another architecture than the guests this host runs.
    #[error(
        "image `{name}` is built for {image_arch}, but this sandbox host runs {guest_arch} guests \
         (SANDBOX_HOST_ARCH); {}, or point SANDBOX_HOST_IMAGE_DIR at a store of {guest_arch} images",
        build_hint(*.guest_arch)
    )]
    WrongArch {
        /// The image.
        name: String,
        /// What its manifest says.
        image_arch: String,
        /// What the host runs.
        guest_arch: Arch,
    },
    /// The name cannot be an image name.
    #[error(
        "`{0}` is not a valid image name (letters, digits, `.`, `_`, `-` and one `:` for a tag)"
    )]
    BadName(String),
}

#[derive(Debug, Deserialize)]
struct Manifest {
    /// Absent in manifests written before aarch64 images existed, which are all x86_64.
    #[serde(default = "x86_64")]
    arch: String,
    kind: String,
    kernel: String,
    initrd: Option<String>,
    rootfs: Option<String>,
    agent_version: Option<String>,
    harness_version: Option<String>,
}

/// How this host builds the images of guests of `arch`, in the operator's words.
fn build_hint(arch: Arch) -> String {
    match (arch.is_native(), arch, cfg!(target_os = "macos")) {
        (true, _, true) => {
            "build the images in a Linux container with `bash scripts/build-images-in-container.sh`"
                .into()
        }
        (true, _, false) => {
            "build it with `bash rootfs/build-stock.sh` (bin/sandbox-host does this on first use; \
             the guest image: `sudo python3 rootfs/build-guest.py`)"
                .into()
        }
        (false, Arch::Aarch64, _) => "build the aarch64 images with \
             `SANDBOX_HOST_ARCH=aarch64 bash rootfs/build-stock.sh` and \
             `sudo python3 rootfs/build-guest.py --arch aarch64`"
            .into(),
        (false, other, _) => format!(
            "{other} images are built on an {other} host: build them there and copy them into \
             this host's image store"
        ),
    }
}

fn x86_64() -> String {
    Arch::X86_64.as_str().into()
}

/// A resolved image: absolute paths of what to boot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// The name it was looked up by.
    pub name: String,
    /// Its build directory (the target of the tag), fixed for the life of a VM.
    pub dir: PathBuf,
    /// The guest kernel.
    pub kernel: PathBuf,
    /// The initramfs, for images that have one.
    pub initrd: Option<PathBuf>,
    /// The read-only ext4 root file system of a disk image, shared by every sandbox.
    pub rootfs: Option<PathBuf>,
    /// `initramfs` for the stock image, `disk` for an image with a root file system.
    pub kind: String,
    /// Version of the agent inside.
    pub agent_version: Option<String>,
    /// Version of the Pi harness the image carries (full images only).
    pub harness_version: Option<String>,
}

impl Image {
    /// A VM spec booting this image. A disk image's root file system is the first disk (read
    /// only, shared) and the sandbox gets a scratch disk of `disk_mib` as its writable layer;
    /// the stock image keeps everything in memory and ignores `disk_mib`.
    pub fn vm_spec(
        &self,
        id: String,
        memory_mib: u32,
        vcpus: u8,
        disk_mib: u64,
        state_dir: PathBuf,
    ) -> VmSpec {
        let (disks, scratch_disk_mib, cmdline) = match &self.rootfs {
            Some(rootfs) => (
                vec![Disk {
                    path: rootfs.clone(),
                    read_only: true,
                }],
                Some(disk_mib),
                vec!["sandbox.root=disk0".to_string()],
            ),
            None => (vec![], None, vec![]),
        };
        VmSpec {
            id,
            memory_mib,
            vcpus,
            kernel: self.kernel.clone(),
            initrd: self.initrd.clone(),
            disks,
            scratch_disk_mib,
            cmdline,
            state_dir,
            net: None,
            start_timeout: None,
            snapshot_to: None,
            restore_from: None,
            outlive: false,
        }
    }
}

/// A directory of images, for guests of one architecture.
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
    arch: Arch,
}

impl ImageStore {
    /// The store at `dir` (it need not exist yet), for the guest architecture of
    /// `SANDBOX_HOST_ARCH`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self::with_arch(dir, Arch::guest())
    }

    /// The store at `dir`, for guests of `arch`.
    pub fn with_arch(dir: impl Into<PathBuf>, arch: Arch) -> Self {
        ImageStore {
            dir: dir.into(),
            arch,
        }
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The names that resolve now to an image of this store's architecture: `name` for an image
    /// directly under the store, `name:tag` for each tag (and `name` too where there is a
    /// `latest`). At most 256, sorted: what `/v1/health` tells a gateway placing a create.
    pub fn names(&self) -> Vec<String> {
        let mut names = vec![];
        let entries = |d: &Path| -> Vec<String> {
            std::fs::read_dir(d)
                .map(|rd| {
                    rd.flatten()
                        .take(256)
                        .filter_map(|e| e.file_name().to_str().map(str::to_string))
                        .filter(|n| !n.starts_with('.'))
                        .collect()
                })
                .unwrap_or_default()
        };
        for name in entries(&self.dir) {
            let dir = self.dir.join(&name);
            if dir.join("manifest.json").exists() {
                names.push(name);
                continue;
            }
            for tag in entries(&dir) {
                if tag == "latest" {
                    names.push(name.clone());
                }
                names.push(format!("{name}:{tag}"));
            }
        }
        names.retain(|n| self.resolve(n).is_ok());
        names.sort();
        names.dedup();
        names.truncate(256);
        names
    }

    /// Image `name` as it was when it resolved to the (canonical) directory `dir`: what a paused
    /// sandbox's snapshot was taken on, named by a record the service's next run reads. The name
    /// is looked up again; if it now leads elsewhere (a newer build of the image), `dir` itself
    /// is read if it is still in the store (an image's builds are directories of the store the
    /// name links to). Any other directory (outside the store, reached through a link, gone) is
    /// `Missing`.
    pub fn resolve_at(&self, name: &str, dir: &Path) -> Result<Image, ImageError> {
        let missing = || ImageError::Missing {
            name: format!("{name} (at {})", dir.display()),
            store: self.dir.clone(),
            hint: String::new(),
        };
        if let Ok(image) = self.resolve(name)
            && image.dir == dir
        {
            return Ok(image);
        }
        let store = std::fs::canonicalize(&self.dir).map_err(|_| missing())?;
        let canonical = std::fs::canonicalize(dir).map_err(|_| missing())?;
        if canonical != dir || !dir.starts_with(&store) || dir == store {
            return Err(missing());
        }
        self.load(name, canonical)
    }

    /// Looks an image up now. `name:tag` maps to `<store>/<name>/<tag>`.
    pub fn resolve(&self, name: &str) -> Result<Image, ImageError> {
        let valid = !name.is_empty()
            && name.matches(':').count() <= 1
            && !name.starts_with('.')
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-:".contains(c))
            && !name.split(':').any(|p| p.is_empty() || p.starts_with('.'));
        if !valid {
            return Err(ImageError::BadName(name.into()));
        }
        let mut link = self.dir.join(name.replace(':', "/"));
        // `name` without a tag means `name:latest`, as with container images.
        if !name.contains(':') && link.is_dir() && !link.join("manifest.json").exists() {
            link = link.join("latest");
        }
        let dir = match std::fs::canonicalize(&link) {
            Ok(d) => d,
            Err(_) => {
                let hint = if name == STOCK {
                    format!(": {}", build_hint(self.arch))
                } else {
                    String::new()
                };
                return Err(ImageError::Missing {
                    name: name.into(),
                    store: self.dir.clone(),
                    hint,
                });
            }
        };
        self.load(name, dir)
    }

    /// The image in the (canonical) directory `dir`, by the name it was asked for.
    fn load(&self, name: &str, dir: PathBuf) -> Result<Image, ImageError> {
        let path = dir.join("manifest.json");
        let bad = |why: String| ImageError::BadManifest {
            name: name.into(),
            path: path.clone(),
            why,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if m.arch != self.arch.as_str() {
            return Err(ImageError::WrongArch {
                name: name.into(),
                image_arch: m.arch,
                guest_arch: self.arch,
            });
        }
        let file = |rel: &str| -> Result<PathBuf, ImageError> {
            if rel.contains('/') {
                return Err(bad(format!("file name `{rel}` must be a plain name")));
            }
            let p = dir.join(rel);
            if !p.is_file() {
                return Err(bad(format!("{} is missing", p.display())));
            }
            Ok(p)
        };
        Ok(Image {
            name: name.into(),
            kernel: file(&m.kernel)?,
            initrd: m.initrd.as_deref().map(file).transpose()?,
            rootfs: m.rootfs.as_deref().map(file).transpose()?,
            kind: m.kind,
            agent_version: m.agent_version,
            harness_version: m.harness_version,
            dir,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(store: &Path, name: &str, manifest: &str) {
        let d = store.join(format!(".{name}-1"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("manifest.json"), manifest).unwrap();
        std::fs::write(d.join("vmlinux"), b"k").unwrap();
        std::fs::write(d.join("initramfs.cpio"), b"i").unwrap();
        std::os::unix::fs::symlink(format!(".{name}-1"), store.join(name)).unwrap();
    }

    #[test]
    fn a_build_an_image_name_no_longer_leads_to_is_found_while_it_is_in_the_store() {
        let t = tempfile::tempdir().unwrap();
        let manifest = r#"{"kind":"initramfs","kernel":"vmlinux","initrd":"initramfs.cpio"}"#;
        make(t.path(), "stock", manifest);
        let store = ImageStore::with_arch(t.path(), Arch::X86_64);
        let first = store.resolve("stock").unwrap().dir;
        assert_eq!(store.resolve_at("stock", &first).unwrap().dir, first);
        // A newer build: the name leads to it, and the first build is still read by its directory.
        let d = t.path().join(".stock-2");
        std::fs::create_dir_all(&d).unwrap();
        for f in ["vmlinux", "initramfs.cpio"] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        std::fs::write(d.join("manifest.json"), manifest).unwrap();
        std::fs::remove_file(t.path().join("stock")).unwrap();
        std::os::unix::fs::symlink(".stock-2", t.path().join("stock")).unwrap();
        assert_ne!(store.resolve("stock").unwrap().dir, first);
        assert_eq!(store.resolve_at("stock", &first).unwrap().dir, first);
        // Gone, outside the store, the store itself, or through a link: missing.
        let outside = tempfile::tempdir().unwrap();
        for dir in [
            t.path().join(".stock-9"),
            outside.path().to_path_buf(),
            std::fs::canonicalize(t.path()).unwrap(),
            std::fs::canonicalize(t.path()).unwrap().join("stock"),
        ] {
            assert!(
                matches!(
                    store.resolve_at("other", &dir),
                    Err(ImageError::Missing { .. })
                ),
                "{}",
                dir.display()
            );
        }
    }

    #[test]
    fn names_are_what_resolves() {
        let t = tempfile::tempdir().unwrap();
        let manifest = r#"{"kind":"initramfs","kernel":"vmlinux","initrd":"initramfs.cpio"}"#;
        make(t.path(), "stock", manifest);
        let tagged = t.path().join("guest");
        std::fs::create_dir_all(&tagged).unwrap();
        std::os::unix::fs::symlink("../.stock-1", tagged.join("latest")).unwrap();
        std::os::unix::fs::symlink("../.stock-1", tagged.join("v2")).unwrap();
        std::os::unix::fs::symlink("../.missing", tagged.join("gone")).unwrap();
        let store = ImageStore::with_arch(t.path(), Arch::X86_64);
        assert_eq!(
            store.names(),
            ["guest", "guest:latest", "guest:v2", "stock"]
        );
        assert_eq!(
            ImageStore::with_arch(t.path(), Arch::Aarch64).names(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn resolves_through_the_tag_link() {
        let t = tempfile::tempdir().unwrap();
        make(
            t.path(),
            "stock",
            r#"{"kind":"initramfs","kernel":"vmlinux","initrd":"initramfs.cpio","agent_version":"0.1.0"}"#,
        );
        let img = ImageStore::with_arch(t.path(), Arch::X86_64)
            .resolve("stock")
            .unwrap();
        assert!(img.dir.ends_with(".stock-1"));
        assert_eq!(img.initrd.unwrap().file_name().unwrap(), "initramfs.cpio");
    }

    #[test]
    fn a_disk_image_boots_its_root_from_a_shared_disk_and_gets_a_scratch_disk() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join(".vantik-guest-latest-1");
        std::fs::create_dir_all(&d).unwrap();
        for f in ["vmlinux", "initramfs.cpio", "rootfs.ext4"] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        std::fs::write(
            d.join("manifest.json"),
            r#"{"kind":"disk","kernel":"vmlinux","initrd":"initramfs.cpio","rootfs":"rootfs.ext4","harness_version":"0.73.1"}"#,
        )
        .unwrap();
        std::fs::create_dir(t.path().join("vantik-guest")).unwrap();
        std::os::unix::fs::symlink(
            "../.vantik-guest-latest-1",
            t.path().join("vantik-guest/latest"),
        )
        .unwrap();
        let store = ImageStore::with_arch(t.path(), Arch::X86_64);
        let img = store.resolve("vantik-guest:latest").unwrap();
        assert_eq!(store.resolve("vantik-guest").unwrap().dir, img.dir);
        assert_eq!(img.harness_version.as_deref(), Some("0.73.1"));
        let spec = img.vm_spec("s".into(), 4096, 2, 20480, "/state/s".into());
        assert_eq!(spec.disks.len(), 1);
        assert!(spec.disks[0].read_only);
        assert!(spec.disks[0].path.ends_with("rootfs.ext4"));
        assert_eq!(spec.scratch_disk_mib, Some(20480));
        assert_eq!(spec.cmdline, ["sandbox.root=disk0"]);

        make(
            t.path(),
            "stock",
            r#"{"kind":"initramfs","kernel":"vmlinux","initrd":"initramfs.cpio"}"#,
        );
        let stock = store.resolve("stock").unwrap();
        let spec = stock.vm_spec("s".into(), 4096, 2, 20480, "/state/s".into());
        assert!(
            spec.disks.is_empty() && spec.scratch_disk_mib.is_none() && spec.cmdline.is_empty()
        );
    }

    #[test]
    fn missing_and_bad_images_say_what_to_do() {
        let t = tempfile::tempdir().unwrap();
        let store = ImageStore::with_arch(t.path(), Arch::X86_64);
        let e = store.resolve("stock").unwrap_err().to_string();
        assert!(e.contains("build-stock.sh"), "{e}");
        assert!(matches!(
            store.resolve("../etc"),
            Err(ImageError::BadName(_))
        ));
        assert!(matches!(store.resolve("a:.."), Err(ImageError::BadName(_))));
        make(
            t.path(),
            "broken",
            r#"{"kind":"initramfs","kernel":"../vmlinux"}"#,
        );
        assert!(
            store
                .resolve("broken")
                .unwrap_err()
                .to_string()
                .contains("plain name")
        );
    }

    #[test]
    fn an_image_of_another_architecture_is_refused_by_name() {
        let t = tempfile::tempdir().unwrap();
        make(
            t.path(),
            "stock",
            r#"{"arch":"aarch64","kind":"initramfs","kernel":"vmlinux","initrd":"initramfs.cpio"}"#,
        );
        let e = ImageStore::with_arch(t.path(), Arch::X86_64)
            .resolve("stock")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("built for aarch64") && e.contains("runs x86_64 guests"),
            "{e}"
        );
        assert!(
            ImageStore::with_arch(t.path(), Arch::Aarch64)
                .resolve("stock")
                .is_ok()
        );
        // A manifest from before aarch64 images is x86_64.
        make(
            t.path(),
            "old",
            r#"{"kind":"initramfs","kernel":"vmlinux","initrd":"initramfs.cpio"}"#,
        );
        let e = ImageStore::with_arch(t.path(), Arch::Aarch64)
            .resolve("old")
            .unwrap_err()
            .to_string();
        assert!(e.contains("built for x86_64"), "{e}");
    }
}
