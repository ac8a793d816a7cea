//! The image store: named guest images, each a directory with a manifest, looked up at every
//! start so a newly built image applies to the next sandbox without a restart.
//!
//! Layout: `<store>/<name>` is a symlink to a build directory (`.<name>-<key>`) holding
//! `manifest.json` and the files it names. A rebuild swaps the symlink with one rename, so a
//! reader sees the old image or the new one, never a half-written one.

use std::path::{Path, PathBuf};

use serde::Deserialize;
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
        hint: &'static str,
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
    /// The name cannot be an image name.
    #[error(
        "`{0}` is not a valid image name (letters, digits, `.`, `_`, `-` and one `:` for a tag)"
    )]
    BadName(String),
}

#[derive(Debug, Deserialize)]
struct Manifest {
    kind: String,
    kernel: String,
    initrd: Option<String>,
    agent_version: Option<String>,
    harness_version: Option<String>,
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
    /// `initramfs` for the stock image.
    pub kind: String,
    /// Version of the agent inside.
    pub agent_version: Option<String>,
    /// Version of the Pi harness the image carries (full images only).
    pub harness_version: Option<String>,
}

/// A directory of images.
#[derive(Debug, Clone)]
pub struct ImageStore {
    dir: PathBuf,
}

impl ImageStore {
    /// The store at `dir` (it need not exist yet).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ImageStore { dir: dir.into() }
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
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
        let link = self.dir.join(name.replace(':', "/"));
        let dir = match std::fs::canonicalize(&link) {
            Ok(d) => d,
            Err(_) => {
                let hint = if name == STOCK {
                    ": build it with `bash rootfs/build-stock.sh` (bin/sandbox-host does this on first use)"
                } else {
                    ""
                };
                return Err(ImageError::Missing {
                    name: name.into(),
                    store: self.dir.clone(),
                    hint,
                });
            }
        };
        let path = dir.join("manifest.json");
        let bad = |why: String| ImageError::BadManifest {
            name: name.into(),
            path: path.clone(),
            why,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
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
    fn resolves_through_the_tag_link() {
        let t = tempfile::tempdir().unwrap();
        make(
            t.path(),
            "stock",
            r#"{"kind":"initramfs","kernel":"vmlinux","initrd":"initramfs.cpio","agent_version":"0.1.0"}"#,
        );
        let img = ImageStore::new(t.path()).resolve("stock").unwrap();
        assert!(img.dir.ends_with(".stock-1"));
        assert_eq!(img.initrd.unwrap().file_name().unwrap(), "initramfs.cpio");
    }

    #[test]
    fn missing_and_bad_images_say_what_to_do() {
        let t = tempfile::tempdir().unwrap();
        let store = ImageStore::new(t.path());
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
}
