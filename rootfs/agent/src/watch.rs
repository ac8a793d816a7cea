//! File events of a directory (issue 35): inotify on it (and, recursive, on every directory
//! under it and each one made later), sent to the host as NDJSON lines on the stream's output:
//!
//! ```text
//! {"event":"ready","path":"/workspace","watches":12}
//! {"event":"create","path":"/workspace/a.txt","dir":false}
//! {"event":"modify","path":"/workspace/a.txt"}
//! {"event":"rename","from":"/workspace/a.txt","to":"/workspace/b.txt","dir":false}
//! {"event":"delete","path":"/workspace/b.txt","dir":false}
//! {"event":"overflow","reason":"queue","dropped":5231}
//! ```
//!
//! One file system: a recursive watch does not cross into another mounted under it. Bounded
//! everywhere: at most [`MAX_WATCHES`] directories, [`MAX_QUEUED`] events waiting for
//! the host's window (a `modify` of a path already waiting is folded into it), and what one
//! wake-up reads is one buffer of the kernel's. When the host reads more slowly than the guest
//! changes files, events past the queue are dropped and counted, and an `overflow` line says so
//! once there is room: a client then reads the tree again. The kernel's own queue overflowing
//! is said the same way (`"reason":"kernel"`), and so is a directory that could not be watched
//! (`"reason":"watches"`).

use std::collections::{HashMap, VecDeque};
use std::ffi::{CString, OsStr};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use sandbox_protocol::message::{WatchRequest, code};
use sandbox_protocol::{DATA_CHUNK, Kind};
use serde_json::json;

use crate::streams::StreamCtx;

/// The most directories watched by one stream.
pub const MAX_WATCHES: usize = 8192;
/// The most events waiting for the host's window.
pub const MAX_QUEUED: usize = 4096;
/// How far back a `modify` looks for one of the same path to fold into.
const FOLD_BACK: usize = 64;
/// How often the loop looks at its stream's state when nothing happens.
const TICK: Duration = Duration::from_millis(100);

/// One change, as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Create {
        path: PathBuf,
        dir: bool,
    },
    Modify {
        path: PathBuf,
    },
    Delete {
        path: PathBuf,
        dir: bool,
    },
    Rename {
        from: PathBuf,
        to: PathBuf,
        dir: bool,
    },
    Overflow {
        reason: &'static str,
        dropped: u64,
    },
}

impl Event {
    fn line(&self) -> Vec<u8> {
        let s = |p: &Path| p.to_string_lossy().into_owned();
        let v = match self {
            Event::Create { path, dir } => json!({"event": "create", "path": s(path), "dir": dir}),
            Event::Modify { path } => json!({"event": "modify", "path": s(path)}),
            Event::Delete { path, dir } => json!({"event": "delete", "path": s(path), "dir": dir}),
            Event::Rename { from, to, dir } => {
                json!({"event": "rename", "from": s(from), "to": s(to), "dir": dir})
            }
            Event::Overflow { reason, dropped } => {
                json!({"event": "overflow", "reason": reason, "dropped": dropped})
            }
        };
        let mut line = v.to_string().into_bytes();
        line.push(b'\n');
        line
    }
}

/// Events waiting to be sent, bounded, with `modify` folded and losses counted.
#[derive(Default)]
struct Queue {
    events: VecDeque<Event>,
    /// Events dropped since the last `overflow` line, and why (the first reason).
    dropped: u64,
    reason: Option<&'static str>,
}

impl Queue {
    fn push(&mut self, e: Event) {
        if let Event::Modify { path } = &e {
            let folded = self.events.iter().rev().take(FOLD_BACK).any(|q| {
                matches!(q, Event::Modify { path: p } | Event::Create { path: p, dir: false } if p == path)
            });
            if folded {
                return;
            }
        }
        if self.events.len() >= MAX_QUEUED {
            self.lost("queue", 1);
            return;
        }
        self.events.push_back(e);
    }

    fn lost(&mut self, reason: &'static str, n: u64) {
        self.dropped = self.dropped.saturating_add(n);
        self.reason.get_or_insert(reason);
    }

    /// The next line to send: a pending loss first, once the queue has room to say it.
    fn next(&mut self) -> Option<Event> {
        if let Some(reason) = self.reason.take() {
            let dropped = std::mem::take(&mut self.dropped);
            return Some(Event::Overflow { reason, dropped });
        }
        self.events.pop_front()
    }
}

/// An inotify instance and the directories it watches.
struct Watcher {
    fd: i32,
    dirs: HashMap<i32, PathBuf>,
    recursive: bool,
    /// A `moved from` waiting for its `moved to` (the cookie, the path, a directory).
    moved: Option<(u32, PathBuf, bool)>,
}

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_DELETE_SELF
    | libc::IN_ONLYDIR
    | libc::IN_DONT_FOLLOW
    | libc::IN_EXCL_UNLINK;

impl Watcher {
    fn new(recursive: bool) -> io::Result<Watcher> {
        // SAFETY: inotify_init1 takes flags only.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Watcher {
            fd,
            dirs: HashMap::new(),
            recursive,
            moved: None,
        })
    }

    /// Watches `dir`; `false` when the limit is reached or the kernel refuses.
    fn add(&mut self, dir: &Path) -> bool {
        if self.dirs.len() >= MAX_WATCHES {
            return false;
        }
        let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
            return false;
        };
        // SAFETY: the path is a valid C string for the call's duration.
        let wd = unsafe { libc::inotify_add_watch(self.fd, c.as_ptr(), MASK) };
        if wd < 0 {
            return false;
        }
        self.dirs.insert(wd, dir.to_path_buf());
        true
    }

    /// Watches `root` and, recursive, every directory under it (symbolic links not followed);
    /// with `report`, each entry found is also a `create` (a directory made while its parent's
    /// watch was being added may already hold files). Bounded by the watch limit.
    fn add_tree(&mut self, root: &Path, report: Option<&mut Queue>) -> bool {
        use std::os::unix::fs::MetadataExt;
        let mut all = self.add(root);
        let mut report = report;
        if !self.recursive {
            return all;
        }
        // One file system: a watch of `/` does not walk into /proc or a mounted disk.
        let Ok(dev) = std::fs::symlink_metadata(root).map(|m| m.dev()) else {
            return all;
        };
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten().take(MAX_QUEUED) {
                let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
                let path = e.path();
                if let Some(q) = report.as_deref_mut() {
                    q.push(Event::Create {
                        path: path.clone(),
                        dir: is_dir,
                    });
                }
                let same_fs = || std::fs::symlink_metadata(&path).is_ok_and(|m| m.dev() == dev);
                if is_dir && same_fs() {
                    if self.dirs.len() >= MAX_WATCHES || !self.add(&path) {
                        all = false;
                        continue;
                    }
                    stack.push(path);
                }
            }
        }
        all
    }

    /// Reads what the kernel has (one buffer), into `q`; `Ok(false)` when nothing was there.
    fn read(&mut self, q: &mut Queue) -> io::Result<bool> {
        let mut buf = vec![0u8; 64 * 1024];
        // SAFETY: the buffer is valid for its length.
        let n = unsafe { libc::read(self.fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(false),
                _ => Err(e),
            };
        }
        let n = n as usize;
        let head = std::mem::size_of::<libc::inotify_event>();
        let mut at = 0;
        while at + head <= n {
            // SAFETY: `head` bytes are in the buffer at `at`; read unaligned.
            let ev: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
            let len = ev.len as usize;
            let Some(end) = (at + head).checked_add(len).filter(|e| *e <= n) else {
                break;
            };
            let raw = &buf[at + head..end];
            let name = &raw[..raw.iter().position(|b| *b == 0).unwrap_or(raw.len())];
            self.one(ev.wd, ev.mask, ev.cookie, OsStr::from_bytes(name), q);
            at = end;
        }
        // A `moved from` with no `moved to` in the same read left the tree.
        self.flush_moved(q);
        Ok(true)
    }

    fn one(&mut self, wd: i32, mask: u32, cookie: u32, name: &OsStr, q: &mut Queue) {
        if mask & libc::IN_Q_OVERFLOW != 0 {
            q.lost("kernel", 1);
            return;
        }
        if mask & libc::IN_IGNORED != 0 {
            self.dirs.remove(&wd);
            return;
        }
        let Some(dir) = self.dirs.get(&wd) else {
            return;
        };
        let path = if name.is_empty() {
            dir.clone()
        } else {
            dir.join(name)
        };
        let is_dir = mask & libc::IN_ISDIR != 0;
        if mask & libc::IN_MOVED_TO == 0 {
            self.flush_moved(q);
        }
        if mask & libc::IN_CREATE != 0 {
            q.push(Event::Create {
                path: path.clone(),
                dir: is_dir,
            });
            if is_dir && self.recursive && !self.add_tree(&path, Some(q)) {
                q.lost("watches", 1);
            }
        } else if mask & libc::IN_MODIFY != 0 {
            q.push(Event::Modify { path });
        } else if mask & libc::IN_DELETE != 0 {
            q.push(Event::Delete { path, dir: is_dir });
        } else if mask & libc::IN_MOVED_FROM != 0 {
            self.moved = Some((cookie, path, is_dir));
        } else if mask & libc::IN_MOVED_TO != 0 {
            match self.moved.take() {
                Some((c, from, dir)) if c == cookie => {
                    if dir {
                        self.rename_dirs(&from, &path);
                    }
                    q.push(Event::Rename {
                        from,
                        to: path,
                        dir,
                    });
                }
                other => {
                    self.moved = other;
                    self.flush_moved(q);
                    q.push(Event::Create {
                        path: path.clone(),
                        dir: is_dir,
                    });
                    if is_dir && self.recursive && !self.add_tree(&path, Some(q)) {
                        q.lost("watches", 1);
                    }
                }
            }
        }
        // IN_DELETE_SELF: the directory's own `delete` came from its parent (or it is the root,
        // whose end ends nothing: the stream goes on until the host closes it).
    }

    /// A `moved from` whose `moved to` did not come: the entry left the watched tree.
    fn flush_moved(&mut self, q: &mut Queue) {
        if let Some((_, path, dir)) = self.moved.take() {
            if dir {
                self.forget_under(&path);
            }
            q.push(Event::Delete { path, dir });
        }
    }

    /// The watched directories under `from` are now under `to`.
    fn rename_dirs(&mut self, from: &Path, to: &Path) {
        for p in self.dirs.values_mut() {
            if let Ok(rest) = p.strip_prefix(from) {
                *p = if rest.as_os_str().is_empty() {
                    to.to_path_buf()
                } else {
                    to.join(rest)
                };
            }
        }
    }

    /// Stops watching what is under `gone` (moved out of the tree).
    fn forget_under(&mut self, gone: &Path) {
        let wds: Vec<i32> = self
            .dirs
            .iter()
            .filter(|(_, p)| p.starts_with(gone))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in wds {
            // SAFETY: removing a watch of our own descriptor.
            unsafe { libc::inotify_rm_watch(self.fd, wd) };
            self.dirs.remove(&wd);
        }
    }

    /// Waits up to `TICK` for the kernel to have events.
    fn wait(&self) {
        let mut pfd = libc::pollfd {
            fd: self.fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, TICK.as_millis() as i32) };
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(self.fd) };
    }
}

/// Serves one watch stream until the host cancels it (or goes away).
pub fn run(ctx: StreamCtx, req: WatchRequest) {
    let root = PathBuf::from(&req.path);
    if !root.is_absolute() {
        ctx.fail(
            code::BAD_REQUEST,
            format!("{} is not an absolute path", req.path),
        );
        return;
    }
    match std::fs::symlink_metadata(&root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            ctx.fail(
                code::BAD_REQUEST,
                format!("{} is not a directory", root.display()),
            );
            return;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            ctx.fail(
                code::NOT_FOUND,
                format!("{} does not exist", root.display()),
            );
            return;
        }
        Err(e) => {
            ctx.fail(code::IO, format!("{}: {e}", root.display()));
            return;
        }
    }
    let mut w = match Watcher::new(req.recursive) {
        Ok(w) => w,
        Err(e) => {
            ctx.fail(code::IO, format!("inotify: {e}"));
            return;
        }
    };
    let mut q = Queue::default();
    if !w.add_tree(&root, None) {
        if w.dirs.is_empty() {
            ctx.fail(code::IO, format!("{} could not be watched", root.display()));
            return;
        }
        q.lost("watches", 1);
    }
    let ready = json!({"event": "ready", "path": root.to_string_lossy(), "watches": w.dirs.len()});
    let mut out: VecDeque<u8> = VecDeque::new();
    out.extend(ready.to_string().into_bytes());
    out.push_back(b'\n');
    loop {
        if ctx.cancelled.load(Ordering::Relaxed) || ctx.abandoned.load(Ordering::Relaxed) {
            return;
        }
        // Lines into the outgoing bytes while they are few; the rest waits in the queue.
        while out.len() < DATA_CHUNK {
            let Some(e) = q.next() else { break };
            out.extend(e.line());
        }
        // What the window allows now, without waiting on it (the kernel's events keep coming).
        while !out.is_empty() {
            let Ok(n) = ctx.credit.try_take(out.len().min(DATA_CHUNK)) else {
                return;
            };
            if n == 0 {
                break;
            }
            let chunk: Vec<u8> = out.drain(..n).collect();
            if !ctx.out.send(Kind::Output, ctx.id, chunk) {
                return;
            }
        }
        match w.read(&mut q) {
            Ok(true) => continue,
            Ok(false) => w.wait(),
            Err(e) => {
                ctx.fail(code::IO, format!("reading inotify: {e}"));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_folds_modifies_bounds_itself_and_says_what_it_lost() {
        let mut q = Queue::default();
        let p = |s: &str| PathBuf::from(s);
        q.push(Event::Create {
            path: p("/w/a"),
            dir: false,
        });
        q.push(Event::Modify { path: p("/w/a") });
        q.push(Event::Modify { path: p("/w/b") });
        q.push(Event::Modify { path: p("/w/b") });
        assert_eq!(q.events.len(), 2);
        for i in 0..MAX_QUEUED + 10 {
            q.push(Event::Delete {
                path: p(&format!("/w/{i}")),
                dir: false,
            });
        }
        assert_eq!(q.events.len(), MAX_QUEUED);
        assert_eq!(
            q.next(),
            Some(Event::Overflow {
                reason: "queue",
                dropped: 12
            })
        );
        assert!(matches!(q.next(), Some(Event::Create { .. })));
        let line = String::from_utf8(
            Event::Rename {
                from: p("/w/a"),
                to: p("/w/b"),
                dir: false,
            }
            .line(),
        )
        .unwrap();
        assert_eq!(
            line,
            "{\"dir\":false,\"event\":\"rename\",\"from\":\"/w/a\",\"to\":\"/w/b\"}\n"
        );
    }
}
