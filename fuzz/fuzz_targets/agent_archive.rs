//! The agent's tar import (`archive::unpack`, what an `ArchivePut` runs) fed a tar or tar.gz
//! stream made from the input: mostly real tar structure (headers with the input's paths, link
//! names, sizes, modes and entry types, GNU long names and pax records, valid checksums), raw
//! bytes otherwise. It unpacks into `d/out` under a fresh temporary directory `d` that also holds
//! bait (a file, a directory with a file, a symlink), on a thread chrooted into `d` when running
//! as root, so that an escape lands in `d`, never on the machine.
//!
//! Invariants, after every input: nothing in `d` outside `d/out` was created, removed or changed;
//! inside `d/out` no symlink resolves outside it (dangling ones followed as far as they go), there
//! is no device node, FIFO or socket, and no file shares an inode with one outside it; an entry
//! the agent refused (an error naming it) was not written; `Done` counts the entries the archive
//! has and the bytes of file content it holds (the files on disk hold no more than that, and
//! exactly that when no two entries can write the same file); what is on disk is bounded by the
//! (decompressed) stream. setuid and setgid bits are not checked: the agent keeps the archive's
//! permissions and promises nothing about them.
#![no_main]

use std::collections::{BTreeMap, HashSet};
use std::ffi::CString;
use std::fs;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use libfuzzer_sys::fuzz_target;
use sandbox_fuzz::Input;
use sandbox_protocol::message::{Done, code};
use tar::EntryType;

/// Entry types the builder picks from (the low four bits of an entry's first byte).
const TYPES: [u8; 16] = [
    b'0', b'0', b'5', b'2', b'2', b'1', b'1', b'3', b'4', b'6', b'7', b'L', b'K', b'x', b'S', 0,
];

/// Path components the builder picks from: names that collide, climb and alias.
const PARTS: [&str; 12] = [
    "a", "b", "c", ".", "..", "", "out", "bait", "a", "..", "baitdir", "f",
];

/// Entries per archive.
const MAX_ENTRIES: usize = 24;

/// A path (or link name) from the input: components from [`PARTS`] (maybe absolute, maybe with a
/// trailing slash or a long component), or raw bytes.
fn name(input: &mut Input) -> Vec<u8> {
    let b = input.byte().unwrap_or(1);
    if b & 0xc0 == 0xc0 {
        return input.bytes(usize::from(b & 0x3f)).to_vec();
    }
    let mut parts: Vec<Vec<u8>> = (0..(b & 7))
        .map(|_| PARTS[usize::from(input.byte().unwrap_or(0)) % PARTS.len()].into())
        .collect();
    if b & 0x20 != 0 {
        parts.push(vec![b'l'; 120]);
    }
    let mut n = if b & 8 != 0 { b"/".to_vec() } else { vec![] };
    n.extend(parts.join(&b'/'));
    if b & 0x10 != 0 {
        n.push(b'/');
    }
    n
}

fn put_raw(field: &mut [u8], v: &[u8]) {
    field.fill(0);
    let n = v.len().min(field.len());
    field[..n].copy_from_slice(&v[..n]);
}

/// One pax record, its length counting itself.
fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
    let body = 1 + key.len() + 1 + value.len() + 1;
    let mut len = body + 1;
    while len != body + len.to_string().len() {
        len = body + len.to_string().len();
    }
    let mut r = format!("{len} {key}=").into_bytes();
    r.extend_from_slice(value);
    r.push(b'\n');
    r
}

/// Paths and link names of the compact encoding: few enough that entries meet.
const PATHS: [&str; 16] = [
    "a", "b", "c", "a/b", "a/c", "b/a", "a/b/c", "c/a", "d", "a/b/d", "b/b", "c/c", "a/a", "e",
    "b/c", "f",
];
const LINKS: [&str; 16] = [
    ".", "..", "a", "b", "c", "a/b", "../a", "b/..", "a/..", "../..", "a/b/..", "c/../..", "b/c",
    "d", "..//c", "f",
];

/// The compact encoding: two bytes an entry (a file, directory, symlink or hard link of
/// [`PATHS`] and [`LINKS`]), so that the fuzzer combines links quickly.
fn build_compact(input: &mut Input, trailer: bool) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for _ in 0..MAX_ENTRIES {
        let (Some(x), Some(y)) = (input.byte(), input.byte()) else {
            break;
        };
        let kind = [
            EntryType::Regular,
            EntryType::Directory,
            EntryType::Symlink,
            EntryType::Link,
        ][usize::from(x & 3)];
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(if x & 0x40 != 0 { 0o6755 } else { 0o755 });
        let n = if kind == EntryType::Regular {
            usize::from(y >> 4)
        } else {
            0
        };
        let data = vec![b'x'; n];
        h.set_size(n as u64);
        let path = PATHS[usize::from((x >> 2) & 15)];
        let r = if matches!(kind, EntryType::Symlink | EntryType::Link) {
            put_raw(
                &mut h.as_old_mut().linkname,
                LINKS[usize::from(y & 15)].as_bytes(),
            );
            put_raw(&mut h.as_old_mut().name, path.as_bytes());
            h.set_cksum();
            b.append(&h, &[][..])
        } else {
            b.append_data(&mut h, path, &data[..])
        };
        r.unwrap();
    }
    // into_inner writes the two end blocks.
    let mut out = b.into_inner().unwrap();
    if !trailer {
        out.truncate(out.len() - 1024);
    }
    out
}

/// A tar stream from the input.
fn build(input: &mut Input, trailer: bool) -> Vec<u8> {
    let mut out = vec![];
    for _ in 0..MAX_ENTRIES {
        let Some(t) = input.byte() else { break };
        let kind = TYPES[usize::from(t & 15)];
        let mut h = match (t >> 4) & 3 {
            0 | 1 => tar::Header::new_gnu(),
            2 => tar::Header::new_ustar(),
            _ => tar::Header::new_old(),
        };
        h.as_old_mut().linkflag = [kind];
        let path = name(input);
        put_raw(&mut h.as_old_mut().name, &path);
        if path.len() > 100 {
            if let Some(u) = h.as_ustar_mut() {
                put_raw(&mut u.prefix, &path[100..]);
            }
        }
        if matches!(kind, b'1' | b'2') {
            put_raw(&mut h.as_old_mut().linkname, &name(input));
        }
        h.set_mode(u32::from(input.u16_le().unwrap_or(0o644)));
        h.set_mtime(u64::from(input.byte().unwrap_or(0)) << 20);
        let data: Vec<u8> = match kind {
            // A long name or link, or pax records naming a path and a link.
            b'L' | b'K' => {
                let mut n = name(input);
                n.push(0);
                n
            }
            b'x' => {
                let mut r = pax_record("path", &name(input));
                if input.byte().unwrap_or(0) & 1 == 1 {
                    r.extend(pax_record("linkpath", &name(input)));
                }
                r
            }
            _ => {
                let n = usize::from(input.byte().unwrap_or(0));
                input.bytes(n).to_vec()
            }
        };
        // The size the header claims: the data's, or a lie (bigger, huge, octal overflow).
        let size = if t & 0x80 != 0 {
            match input.byte().unwrap_or(0) % 6 {
                0 => data.len() as u64 + 1,
                1 => data.len().saturating_sub(1) as u64,
                2 => 1 << 33,
                3 => 1 << 40,
                4 => u64::MAX >> 1,
                _ => 0,
            }
        } else {
            data.len() as u64
        };
        h.set_size(size);
        h.set_cksum();
        if t & 0x40 != 0 {
            // A checksum that does not match.
            h.as_old_mut().cksum[0] ^= 1;
        }
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(&data);
        out.resize(out.len().next_multiple_of(512), 0);
    }
    if trailer {
        out.resize(out.len() + 1024, 0);
    }
    out
}

/// What the walk records of one path.
#[derive(Debug, PartialEq, Eq)]
struct Node {
    kind: &'static str,
    mode: u32,
    size: u64,
    mtime: (i64, i64),
    ino: (u64, u64),
    content: Vec<u8>,
}

fn node(p: &Path, m: &fs::Metadata) -> Node {
    let ft = m.file_type();
    let (kind, content) = if ft.is_symlink() {
        (
            "symlink",
            fs::read_link(p).unwrap().as_os_str().as_bytes().to_vec(),
        )
    } else if ft.is_dir() {
        ("dir", vec![])
    } else if ft.is_file() {
        ("file", fs::read(p).unwrap())
    } else {
        ("other", vec![])
    };
    Node {
        kind,
        mode: m.mode(),
        size: m.size(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ino: (m.dev(), m.ino()),
        content,
    }
}

/// Every path under `root` (not following symlinks) with its metadata, `skip` excluded.
fn walk(root: &Path, skip: Option<&Path>, into: &mut Vec<(PathBuf, fs::Metadata)>) {
    for e in fs::read_dir(root).unwrap() {
        let p = e.unwrap().path();
        if Some(p.as_path()) == skip {
            continue;
        }
        let m = fs::symlink_metadata(&p).unwrap();
        let dir = m.is_dir();
        into.push((p.clone(), m));
        if dir {
            walk(&p, skip, into);
        }
    }
}

/// The state of `d` outside `d/out`.
fn outside(d: &Path, out: &Path) -> BTreeMap<PathBuf, Node> {
    let mut all = vec![];
    walk(d, Some(out), &mut all);
    let mut map: BTreeMap<_, _> = all.iter().map(|(p, m)| (p.clone(), node(p, m))).collect();
    // `d` itself: its mode (its times change as `out` is created in it).
    let m = fs::symlink_metadata(d).unwrap();
    map.insert(
        d.to_path_buf(),
        Node {
            kind: "dir",
            mode: m.mode(),
            size: 0,
            mtime: (0, 0),
            ino: (m.dev(), m.ino()),
            content: vec![],
        },
    );
    map
}

/// Where `p` (absolute) leads: symlinks followed as the kernel would (at most 40), components
/// that do not exist taken as they are. `None` for a loop.
fn resolve(p: &Path, hops: &mut u32) -> Option<PathBuf> {
    let mut cur = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::RootDir | Component::Prefix(_) => cur = PathBuf::from("/"),
            Component::CurDir => {}
            Component::ParentDir => {
                cur.pop();
            }
            Component::Normal(x) => {
                let next = cur.join(x);
                match fs::symlink_metadata(&next) {
                    Ok(m) if m.file_type().is_symlink() => {
                        *hops += 1;
                        if *hops > 40 {
                            return None;
                        }
                        let t = fs::read_link(&next).unwrap();
                        cur = resolve(&cur.join(t), hops)?;
                    }
                    _ => cur = next,
                }
            }
        }
    }
    Some(cur)
}

/// `p` with only its normal components (what it names under the target).
fn normal(p: &Path) -> Option<PathBuf> {
    let mut n = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(x) => n.push(x),
            Component::ParentDir => return None,
            _ => {}
        }
    }
    Some(n)
}

/// The archive as the agent's tar reader sees it: each entry's path, type and size, until the
/// end or the first error (then `false`).
struct Scan {
    entries: Vec<(String, Option<PathBuf>, EntryType, u64, bool)>,
    complete: bool,
}

fn scan(tar_bytes: &[u8]) -> Scan {
    let mut entries = vec![];
    let mut ar = tar::Archive::new(tar_bytes);
    let Ok(it) = ar.entries() else {
        return Scan {
            entries,
            complete: false,
        };
    };
    for e in it {
        let Ok(e) = e else {
            return Scan {
                entries,
                complete: false,
            };
        };
        let Ok(p) = e.path() else {
            return Scan {
                entries,
                complete: false,
            };
        };
        // An old header whose name ends in `/` is unpacked as a directory.
        let slash_dir = e.header().as_ustar().is_none() && e.path_bytes().ends_with(b"/");
        entries.push((
            p.display().to_string(),
            normal(&p),
            e.header().entry_type(),
            e.size(),
            slash_dir,
        ));
    }
    Scan {
        entries,
        complete: true,
    }
}

/// Unpacks on a thread whose root is `d` (as root) or straight into `d/out` (otherwise).
fn unpack(d: &Path, stream: Vec<u8>) -> Result<Done, (&'static str, String)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let out = d.join("out");
        return sandbox_agent::unpack(&stream[..], &out);
    }
    let root = CString::new(d.as_os_str().as_bytes()).unwrap();
    std::thread::spawn(move || {
        // SAFETY: plain system calls on this thread's own filesystem context (unshared first, so
        // the chroot is this thread's alone) with a valid C string.
        unsafe {
            assert_eq!(libc::unshare(libc::CLONE_FS), 0, "unshare(CLONE_FS)");
            assert_eq!(libc::chroot(root.as_ptr()), 0, "chroot");
            assert_eq!(libc::chdir(c"/".as_ptr()), 0, "chdir");
        }
        sandbox_agent::unpack(&stream[..], Path::new("/out"))
    })
    .join()
    .unwrap_or_else(|e| std::panic::resume_unwind(e))
}

fn check(data: &[u8]) {
    let mut input = Input(data);
    let mode = input.byte().unwrap_or(0);
    let tar_bytes = if mode & 3 == 3 {
        input.0.to_vec()
    } else if mode & 0x40 != 0 {
        build_compact(&mut input, mode & 0x10 == 0)
    } else {
        build(&mut input, mode & 0x10 == 0)
    };
    let stream = if mode & 4 != 0 {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&tar_bytes).unwrap();
        let mut z = gz.finish().unwrap();
        if mode & 8 != 0 {
            // Cut short.
            z.truncate(z.len() / 2);
        }
        z
    } else {
        tar_bytes
    };
    // What the agent's reader gets out of the stream (gzip sniffed as it does).
    let plain = if stream.starts_with(&[0x1f, 0x8b]) {
        let mut v = vec![];
        let _ = flate2::read::GzDecoder::new(&stream[..])
            .take(64 << 20)
            .read_to_end(&mut v);
        v
    } else {
        stream.clone()
    };
    let scanned = scan(&plain);

    let dir = sandbox_fuzz::scratch_dir("agent-archive");
    let d = dir.path().canonicalize().unwrap();
    let out = d.join("out");
    fs::write(d.join("bait"), b"bait\n").unwrap();
    fs::create_dir(d.join("baitdir")).unwrap();
    fs::write(d.join("baitdir/f"), b"f\n").unwrap();
    std::os::unix::fs::symlink("bait", d.join("baitlink")).unwrap();
    if mode & 0x20 != 0 {
        fs::create_dir(&out).unwrap();
    }
    let before = outside(&d, &out);
    let outside_inodes: HashSet<(u64, u64)> = before
        .iter()
        .filter(|(_, n)| n.kind != "dir")
        .map(|(_, n)| n.ino)
        .collect();

    let result = unpack(&d, stream);
    if std::env::var_os("AGENT_ARCHIVE_DEBUG").is_some() {
        eprintln!("{result:?}");
    }

    assert_eq!(
        outside(&d, &out),
        before,
        "something outside the target changed ({result:?})"
    );
    let mut inside = vec![];
    if out.is_dir() {
        walk(&out, None, &mut inside);
    }
    let mut files = HashSet::new();
    let mut disk = 0u64;
    for (p, m) in &inside {
        let ft = m.file_type();
        assert!(
            !(ft.is_block_device() || ft.is_char_device() || ft.is_fifo() || ft.is_socket()),
            "{} is a device node, FIFO or socket ({result:?})",
            p.display()
        );
        if ft.is_symlink() {
            if let Some(to) = resolve(p, &mut 0) {
                assert!(
                    to.starts_with(&out),
                    "the symlink {} -> {} leads to {}, outside the target ({result:?})",
                    p.display(),
                    fs::read_link(p).unwrap().display(),
                    to.display()
                );
            }
        }
        assert!(
            ft.is_dir() || !outside_inodes.contains(&(m.dev(), m.ino())),
            "{} is a hard link to a file outside the target ({result:?})",
            p.display()
        );
        if ft.is_file() && files.insert((m.dev(), m.ino())) {
            disk += m.size();
        }
    }
    assert!(
        disk <= plain.len() as u64,
        "{disk} bytes of files on disk from a {}-byte archive",
        plain.len()
    );

    match &result {
        Ok(done) => {
            assert!(
                scanned.complete,
                "the agent accepted an archive its tar reader refuses: {done:?}"
            );
            assert_eq!(
                done.entries,
                scanned.entries.len() as u64,
                "Done counts other entries than the archive has"
            );
            let content: u64 = scanned
                .entries
                .iter()
                .filter(|e| {
                    matches!(e.2, EntryType::Regular | EntryType::Continuous)
                        && !e.4
                        && e.1.as_ref().is_some_and(|n| !n.as_os_str().is_empty())
                })
                .fold(0u64, |a, e| a.saturating_add(e.3));
            assert_eq!(
                done.bytes, content,
                "Done counts other bytes than the archive's file content"
            );
            assert!(
                disk <= done.bytes,
                "{disk} bytes on disk, Done says {}",
                done.bytes
            );
            let links = scanned
                .entries
                .iter()
                .any(|e| matches!(e.2, EntryType::Symlink | EntryType::Link));
            let mut seen = HashSet::new();
            let distinct = scanned
                .entries
                .iter()
                .all(|e| e.1.as_ref().is_some_and(|n| seen.insert(n.clone())));
            if !links && distinct {
                assert_eq!(
                    disk, done.bytes,
                    "the files on disk hold other bytes than Done says"
                );
            }
        }
        Err((c, msg)) => {
            // An entry refused by name was not written: when nothing before it in the archive
            // names the same path (or a path under it) and no link before it can alias it.
            let named = msg
                .strip_prefix("entry `")
                .or_else(|| msg.strip_prefix("link entry `"));
            if let (true, Some(rest)) =
                ([code::UNSAFE_ARCHIVE, code::BAD_REQUEST].contains(c), named)
            {
                let shown = &rest[..rest.find('`').unwrap_or(rest.len())];
                let at: Vec<usize> = (0..scanned.entries.len())
                    .filter(|&i| scanned.entries[i].0 == shown)
                    .collect();
                if let [i] = at[..] {
                    if let Some(n) = scanned.entries[i]
                        .1
                        .clone()
                        .filter(|n| !n.as_os_str().is_empty())
                    {
                        let earlier = &scanned.entries[..i];
                        let aliased = earlier.iter().any(|e| {
                            matches!(e.2, EntryType::Symlink | EntryType::Link)
                                || e.1.as_ref().is_none_or(|m| m.starts_with(&n))
                        });
                        if !aliased {
                            assert!(
                                fs::symlink_metadata(out.join(&n)).is_err(),
                                "the refused entry `{shown}` was written: {msg}"
                            );
                        }
                    }
                }
            }
        }
    }
    drop(dir);
}

fuzz_target!(|data: &[u8]| check(data));
