//! Tar archives into and out of a directory.
//!
//! Unpacking refuses, before writing anything for that entry: absolute paths, `..` components,
//! symlinks whose target leaves the directory, hard links to paths outside it or to symlinks,
//! device nodes and FIFOs, and more bytes or entries than the filesystem has room for. The tar
//! crate's own `unpack_in` check (no write through a symlink that leaves the directory) runs
//! under ours.
//!
//! A symlink's target is judged where the link really is and against what is on disk, not by
//! its spelling alone: its `..` components climb from the directory the link is created in (its
//! path may go through an earlier symlink), and may only follow components that are directories
//! already (a `..` after a symlink, or after a name a later entry could make a symlink, is
//! refused). Directories stay directories for the rest of the unpack (the tar crate never
//! replaces one), so every symlink an archive creates resolves inside the directory. A hard link
//! to a symlink would copy the symlink into another directory, where its target means something
//! else: refused.

use std::ffi::CString;
use std::fs;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use flate2::read::GzDecoder;
use sandbox_protocol::Kind;
use sandbox_protocol::message::{Done, PathRequest, code};
use tar::EntryType;

use crate::files::io_error;
use crate::streams::StreamCtx;
use crate::transfer::Download;

type Failure = (&'static str, String);

pub fn put(mut ctx: StreamCtx, req: PathRequest) {
    let Some(mut upload) = ctx.take_upload() else {
        return ctx.fail(code::BAD_STREAM, "archive put has no upload");
    };
    let result = unpack(&mut upload, Path::new(&req.path));
    // Whatever follows the end of the archive (padding, or the rest after an error) is read and
    // dropped so the host's upload always completes.
    let _ = upload.drain();
    match result {
        Ok(done) => {
            ctx.out.send_json(Kind::Done, ctx.id, &done);
        }
        Err((code, msg)) => ctx.fail(code, msg),
    }
}

pub fn get(ctx: StreamCtx, req: PathRequest) {
    let dir = Path::new(&req.path);
    let result = (|| -> Result<(), Failure> {
        if !dir.is_absolute() {
            return Err((
                code::BAD_REQUEST,
                format!("path `{}` is not absolute", dir.display()),
            ));
        }
        let meta = fs::symlink_metadata(dir).map_err(|e| io_error(dir, e))?;
        let dl = Download::new(ctx.out.clone(), ctx.id, Kind::Output, ctx.credit.clone());
        let mut b = tar::Builder::new(dl);
        b.follow_symlinks(false);
        b.mode(tar::HeaderMode::Complete);
        let add = if meta.is_dir() {
            b.append_dir_all(".", dir)
        } else {
            let name = dir
                .file_name()
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("file"));
            b.append_path_with_name(dir, name)
        };
        add.map_err(|e| (code::IO, format!("archiving {}: {e}", dir.display())))?;
        let dl = b.into_inner().map_err(|e| (code::IO, e.to_string()))?;
        dl.finish().map_err(|e| (code::IO, e.to_string()))?;
        Ok(())
    })();
    if let Err((code, msg)) = result {
        ctx.fail(code, msg);
    }
}

/// Unpacks a tar or gzip-compressed tar stream into `dst`, creating it if needed.
pub fn unpack(src: impl Read, dst: &Path) -> Result<Done, Failure> {
    if !dst.is_absolute() {
        return Err((
            code::BAD_REQUEST,
            format!("path `{}` is not absolute", dst.display()),
        ));
    }
    fs::create_dir_all(dst).map_err(|e| io_error(dst, e))?;
    let root = fs::canonicalize(dst).map_err(|e| io_error(dst, e))?;
    let mut src = BufReader::with_capacity(64 * 1024, src);
    let gz = src
        .fill_buf()
        .map(|b| b.starts_with(&[0x1f, 0x8b]))
        .map_err(|e| (code::IO, e.to_string()))?;
    let reader: Box<dyn Read> = if gz {
        Box::new(GzDecoder::new(src))
    } else {
        Box::new(src)
    };
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_mtime(true);
    ar.set_overwrite(true);
    ar.set_unpack_xattrs(false);

    let room = Room::of(dst)?;
    let mut done = Done::default();
    let entries = ar.entries().map_err(|e| bad_archive(&e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad_archive(&e))?;
        let path = entry.path().map_err(|e| bad_archive(&e))?.into_owned();
        check_entry(&entry, &path, &root)?;
        done.entries += 1;
        done.bytes = done.bytes.saturating_add(content_size(&entry, &path));
        if done.bytes > room.bytes || done.entries > room.inodes {
            return Err((
                code::NO_SPACE,
                format!(
                    "the archive needs more room than {} has ({} bytes and {} entries free)",
                    dst.display(),
                    room.bytes,
                    room.inodes
                ),
            ));
        }
        match entry.unpack_in(dst) {
            Ok(true) => {}
            Ok(false) => {
                return Err((
                    code::UNSAFE_ARCHIVE,
                    format!(
                        "entry `{}` would be written outside {}",
                        path.display(),
                        dst.display()
                    ),
                ));
            }
            Err(e) => {
                let (code, _) = io_error(dst, io::Error::new(e.kind(), ""));
                return Err((
                    code,
                    format!("unpacking `{}` into {}: {e}", path.display(), dst.display()),
                ));
            }
        }
    }
    Ok(done)
}

/// Bytes of file content an entry writes: its size for a file, 0 for the rest (a directory's,
/// a link's or a symlink's size is skipped by the reader, never written).
fn content_size<R: Read>(entry: &tar::Entry<'_, R>, path: &Path) -> u64 {
    let h = entry.header();
    let file = matches!(h.entry_type(), EntryType::Regular | EntryType::Continuous);
    // The tar crate unpacks a non-ustar "file" whose name ends in `/` as a directory, and skips
    // an entry whose path names the target itself (empty, `.`, `/`).
    let dir_by_name = h.as_ustar().is_none() && entry.path_bytes().ends_with(b"/");
    let names_something = path.components().any(|c| matches!(c, Component::Normal(_)));
    if file && !dir_by_name && names_something {
        entry.size()
    } else {
        0
    }
}

fn bad_archive(e: &io::Error) -> Failure {
    (
        code::BAD_REQUEST,
        format!("the body is not a valid tar or tar.gz archive: {e}"),
    )
}

/// Refuses entries that could write outside the target (`root`, canonical) or create devices.
fn check_entry<R: Read>(
    entry: &tar::Entry<'_, R>,
    path: &Path,
    root: &Path,
) -> Result<(), Failure> {
    let unsafe_entry = |why: &str| {
        Err((
            code::UNSAFE_ARCHIVE,
            format!(
                "entry `{}` {why}; nothing of it was written",
                path.display()
            ),
        ))
    };
    if path.is_absolute() {
        return unsafe_entry("has an absolute path");
    }
    if path.components().any(|c| c == Component::ParentDir) {
        return unsafe_entry("has a `..` component");
    }
    let kind = entry.header().entry_type();
    match kind {
        EntryType::Regular | EntryType::Continuous | EntryType::Directory => Ok(()),
        EntryType::Symlink => {
            let target = link_target(entry, path)?;
            if target.is_absolute() {
                return unsafe_entry("is a symlink to an absolute path");
            }
            let base = path.parent().unwrap_or(Path::new(""));
            if escapes(&base.join(&target)) || !symlink_stays_inside(root, base, &target) {
                return unsafe_entry("is a symlink pointing outside the directory");
            }
            Ok(())
        }
        EntryType::Link => {
            let target = link_target(entry, path)?;
            if target.is_absolute() || escapes(&target) {
                return unsafe_entry("is a hard link to a path outside the directory");
            }
            // The tar crate links to `root/target` without following a final symlink.
            if fs::symlink_metadata(root.join(&target)).is_ok_and(|m| m.file_type().is_symlink()) {
                return unsafe_entry("is a hard link to a symlink");
            }
            Ok(())
        }
        EntryType::Char | EntryType::Block => unsafe_entry("is a device node"),
        EntryType::Fifo => unsafe_entry("is a FIFO"),
        other => unsafe_entry(&format!("has an unsupported type ({other:?})")),
    }
}

fn link_target<R: Read>(entry: &tar::Entry<'_, R>, path: &Path) -> Result<PathBuf, Failure> {
    match entry.link_name() {
        Ok(Some(t)) => Ok(t.into_owned()),
        Ok(None) => Err((
            code::BAD_REQUEST,
            format!("link entry `{}` has no target", path.display()),
        )),
        Err(e) => Err(bad_archive(&e)),
    }
}

/// Whether a relative path climbs above its starting directory at any point.
fn escapes(p: &Path) -> bool {
    let mut depth: i64 = 0;
    for c in p.components() {
        match c {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            Component::RootDir | Component::Prefix(_) => return true,
            Component::CurDir => {}
        }
        if depth < 0 {
            return true;
        }
    }
    false
}

/// Whether a symlink created in `root/base` with relative `target` resolves inside `root` (which
/// is canonical), however later entries fill the tree: see the module documentation.
fn symlink_stays_inside(root: &Path, base: &Path, target: &Path) -> bool {
    // Where the link will really be: the existing part of `base` resolved, the rest the
    // directories the tar crate will create.
    let mut existing = root.to_path_buf();
    let mut missing = vec![];
    for c in base.components() {
        match c {
            Component::Normal(x)
                if missing.is_empty() && fs::symlink_metadata(existing.join(x)).is_ok() =>
            {
                existing.push(x)
            }
            Component::Normal(x) => missing.push(x),
            Component::CurDir => {}
            _ => return false,
        }
    }
    let Ok(real) = fs::canonicalize(&existing) else {
        return false;
    };
    let Ok(inside) = real.strip_prefix(root) else {
        return false;
    };
    let mut depth = inside.components().count() + missing.len();
    let mut at = real.clone();
    at.extend(missing);
    // Whether every component so far is a directory (so `..` means its parent, for good).
    let mut directories = true;
    for c in target.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                if !directories || depth == 0 {
                    return false;
                }
                depth -= 1;
                at.pop();
            }
            Component::Normal(x) => {
                depth += 1;
                at.push(x);
                directories = directories && fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir());
            }
            Component::RootDir | Component::Prefix(_) => return false,
        }
    }
    true
}

/// Free bytes and inodes of the filesystem holding a directory.
struct Room {
    bytes: u64,
    inodes: u64,
}

impl Room {
    fn of(dir: &Path) -> Result<Room, Failure> {
        let c = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| (code::BAD_REQUEST, "path contains NUL".to_string()))?;
        // SAFETY: statvfs is plain data; zeroed is a valid value to be overwritten.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a valid C string and `st` a valid out-pointer for the call.
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return Err(io_error(dir, io::Error::last_os_error()));
        }
        let inodes = if st.f_files == 0 {
            u64::MAX
        } else {
            st.f_favail
        };
        Ok(Room {
            bytes: st.f_bavail.saturating_mul(st.f_frsize),
            inodes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_with(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().unwrap()
    }

    fn header(kind: EntryType, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o644);
        h
    }

    fn raw_path(h: &mut tar::Header, p: &str) {
        // set_path refuses `..`; write the name bytes directly as an attacker would.
        let name = &mut h.as_old_mut().name;
        name.fill(0);
        name[..p.len()].copy_from_slice(p.as_bytes());
        h.set_cksum();
    }

    #[test]
    fn refuses_parent_components_and_absolute_paths() {
        for bad in ["../evil", "a/../../evil", "/etc/evil"] {
            let dir = tempfile::tempdir().unwrap();
            let dst = dir.path().join("in");
            let data = tar_with(|b| {
                let mut h = header(EntryType::Regular, 1);
                raw_path(&mut h, bad);
                b.append(&h, &b"x"[..]).unwrap();
            });
            let err = unpack(&data[..], &dst).unwrap_err();
            assert_eq!(err.0, code::UNSAFE_ARCHIVE, "{bad}: {err:?}");
            assert!(!dir.path().join("evil").exists());
        }
    }

    #[test]
    fn refuses_escaping_symlinks_and_devices() {
        let cases: Vec<(EntryType, &str)> = vec![
            (EntryType::Symlink, "../../etc"),
            (EntryType::Symlink, "/etc"),
            (EntryType::Link, "../x"),
            (EntryType::Char, ""),
        ];
        for (kind, target) in cases {
            let dir = tempfile::tempdir().unwrap();
            let data = tar_with(|b| {
                let mut h = header(kind, 0);
                if !target.is_empty() {
                    h.set_link_name(target).unwrap_or_else(|_| {
                        let l = &mut h.as_old_mut().linkname;
                        l[..target.len()].copy_from_slice(target.as_bytes());
                    });
                }
                raw_path(&mut h, "sub/link");
                b.append(&h, &[][..]).unwrap();
            });
            let err = unpack(&data[..], dir.path()).unwrap_err();
            assert_eq!(err.0, code::UNSAFE_ARCHIVE, "{kind:?} {target}: {err:?}");
        }
    }

    #[test]
    fn accepts_inner_symlinks_and_gzip() {
        let dir = tempfile::tempdir().unwrap();
        let data = tar_with(|b| {
            let mut h = header(EntryType::Regular, 5);
            b.append_data(&mut h, "d/file", &b"hello"[..]).unwrap();
            let mut h = header(EntryType::Symlink, 0);
            b.append_link(&mut h, "d/link", "file").unwrap();
            let mut h = header(EntryType::Symlink, 0);
            b.append_link(&mut h, "up", "d/../d/file").unwrap();
        });
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        io::Write::write_all(&mut gz, &data).unwrap();
        let done = unpack(&gz.finish().unwrap()[..], dir.path()).unwrap();
        assert_eq!(done.entries, 3);
        assert_eq!(fs::read(dir.path().join("d/link")).unwrap(), b"hello");
    }

    /// Found by the agent_archive fuzz target: a symlink header claiming a size counted that
    /// size as file content written (Done says "bytes of file content written").
    #[test]
    fn fuzz_agent_archive_done_counts_only_file_content() {
        let dir = tempfile::tempdir().unwrap();
        let data = tar_with(|b| {
            let mut h = header(EntryType::Symlink, 0);
            h.set_link_name("target").unwrap();
            raw_path(&mut h, "link");
            h.set_size(1);
            h.set_cksum();
            b.append(&h, &b"x"[..]).unwrap();
            let mut h = header(EntryType::Directory, 0);
            raw_path(&mut h, "d");
            h.set_size(3);
            h.set_cksum();
            b.append(&h, &b"abc"[..]).unwrap();
            let mut h = header(EntryType::Regular, 5);
            raw_path(&mut h, "dir-by-name/");
            b.append(&h, &b"hello"[..]).unwrap();
            let mut h = header(EntryType::Regular, 4);
            b.append_data(&mut h, "f", &b"file"[..]).unwrap();
            // Found next: a file with an empty name, which the tar crate skips.
            let mut h = tar::Header::new_ustar();
            h.set_entry_type(EntryType::Regular);
            h.set_size(1);
            h.set_cksum();
            b.append(&h, &b"y"[..]).unwrap();
        });
        let done = unpack(&data[..], dir.path()).unwrap();
        assert_eq!(
            done,
            Done {
                entries: 5,
                bytes: 4
            }
        );
        assert!(dir.path().join("dir-by-name").is_dir());
    }

    /// Found by the agent_archive fuzz target: a symlink's `..` judged by its spelling, not
    /// where it lands. `c/c -> .` made `c/a -> c/../..` (lexically inside) lead to the parent of
    /// the target; so did `a -> .` then `a/b -> ..` (the link is really in the target itself),
    /// `s -> q/..` before `q -> .` was created, and a hard link copying `a/s -> ..` to the top.
    #[test]
    fn fuzz_agent_archive_symlink_dotdot_after_symlink() {
        let sym = |b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str| {
            let mut h = header(EntryType::Symlink, 0);
            h.set_link_name(target).unwrap();
            raw_path(&mut h, path);
            b.append(&h, &[][..]).unwrap();
        };
        let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
            (vec![("c/c", "."), ("c/a", "c/../..")], "c/a"),
            (vec![("a", "."), ("a/b", "..")], "a/b"),
            (vec![("s", "q/.."), ("q", ".")], "s"),
            (vec![("s", "a/b/.."), ("a", ".")], "s"),
        ];
        for (links, refused) in cases {
            let dir = tempfile::tempdir().unwrap();
            let dst = dir.path().join("in");
            let data = tar_with(|b| {
                let mut h = header(EntryType::Directory, 0);
                b.append_data(&mut h, "c", &[][..]).unwrap();
                for (p, t) in &links {
                    sym(b, p, t);
                }
            });
            let err = unpack(&data[..], &dst).unwrap_err();
            assert_eq!(err.0, code::UNSAFE_ARCHIVE, "{links:?}: {err:?}");
            assert!(
                err.1.contains(&format!("`{refused}`")),
                "{links:?}: {err:?}"
            );
        }
        // A hard link to a symlink.
        let dir = tempfile::tempdir().unwrap();
        let data = tar_with(|b| {
            sym(b, "a/s", "..");
            let mut h = header(EntryType::Link, 0);
            h.set_link_name("a/s").unwrap();
            raw_path(&mut h, "t");
            b.append(&h, &[][..]).unwrap();
        });
        let err = unpack(&data[..], dir.path()).unwrap_err();
        assert_eq!(err.0, code::UNSAFE_ARCHIVE, "{err:?}");
        assert!(fs::symlink_metadata(dir.path().join("t")).is_err());
        // What stays allowed: `..` through directories, also from where a symlinked path lands
        // (the spelling must stay inside too).
        let dir = tempfile::tempdir().unwrap();
        let data = tar_with(|b| {
            let mut h = header(EntryType::Directory, 0);
            b.append_data(&mut h, "x/y/z", &[][..]).unwrap();
            sym(b, "p", "x/y/z");
            sym(b, "p/up", "../z");
            sym(b, "x/side", "../x/y/../y");
        });
        assert_eq!(unpack(&data[..], dir.path()).unwrap().entries, 4);
        assert!(dir.path().join("x/y/z/up").is_dir());
    }

    #[test]
    fn escapes_counts_depth() {
        assert!(!escapes(Path::new("a/b/../c")));
        assert!(escapes(Path::new("a/../../c")));
        assert!(!escapes(Path::new("a/./b")));
    }
}
