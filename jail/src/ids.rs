//! The user and group ids of jailed processes: one of each per VM, never shared by two live VMs
//! (as Firecracker's jailer asks of its operator), so one escaped VM cannot signal, trace or
//! open anything of another.
//!
//! Where the ids come from depends on who runs the service:
//! - as root, a range of its own (`SANDBOX_HOST_JAIL_IDS`, by default 65536 ids from
//!   1500000000, which no distribution hands out), written into each VM's user namespace
//!   directly;
//! - as an ordinary user, its subordinate ids from `/etc/subuid` and `/etc/subgid`, written by
//!   the set-uid helpers `newuidmap`/`newgidmap` (Debian's `uidmap` package), as rootless
//!   podman does;
//! - as an ordinary user without subordinate ids, the user's own id: the VM still has its own
//!   namespaces and no capabilities, but shares the service's uid. The service says so when it
//!   starts.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use thiserror::Error;

/// The first id of the range a root service gives its VMs by default.
pub const ROOT_RANGE_START: u32 = 1_500_000_000;
/// How many ids that range holds.
pub const ROOT_RANGE_LEN: u32 = 65_536;

/// Problems with the id settings.
#[derive(Debug, Error)]
pub enum IdError {
    /// `SANDBOX_HOST_JAIL_IDS` is not `START:COUNT`.
    #[error(
        "SANDBOX_HOST_JAIL_IDS={0:?} is not START:COUNT (for example 1500000000:65536); \
         fix it in .env or the environment and start the sandbox host again"
    )]
    BadRange(String),
    /// Every id of the range belongs to a live VM.
    #[error(
        "all {0} jail ids are in use by running VMs; stop sandboxes or give the sandbox host a \
         larger id range"
    )]
    Exhausted(u32),
}

/// How ids get into a VM's user namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdMode {
    /// The service is root: it writes any mapping itself.
    Root,
    /// The service is an ordinary user with subordinate ids; `newuidmap`/`newgidmap` write them.
    Subordinate {
        /// `newuidmap`.
        newuidmap: PathBuf,
        /// `newgidmap`.
        newgidmap: PathBuf,
    },
    /// The service is an ordinary user without subordinate ids: VMs map its own uid and gid.
    Shared,
}

/// The ids available to VMs and which of them live VMs hold.
#[derive(Debug)]
pub struct IdPool {
    mode: IdMode,
    uid_start: u32,
    gid_start: u32,
    len: u32,
    used: Mutex<BTreeSet<u32>>,
}

/// One VM's uid and gid (outside its namespace), returned to the pool when dropped.
#[derive(Debug)]
pub struct IdLease {
    pool: Arc<IdPool>,
    slot: u32,
    /// The VM's uid on the host.
    pub uid: u32,
    /// The VM's gid on the host.
    pub gid: u32,
}

impl Drop for IdLease {
    fn drop(&mut self) {
        if self.pool.mode != IdMode::Shared {
            self.pool
                .used
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&self.slot);
        }
    }
}

impl IdPool {
    /// The pool for this process: root's range, the user's subordinate ids, or the user's own.
    pub fn for_this_process(
        range_setting: Option<&str>,
    ) -> Result<(IdPool, Option<String>), IdError> {
        // SAFETY: getuid/getgid cannot fail and touch no memory.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        if uid == 0 {
            let (start, len) = match range_setting {
                Some(s) => parse_range(s).ok_or_else(|| IdError::BadRange(s.to_string()))?,
                None => (ROOT_RANGE_START, ROOT_RANGE_LEN),
            };
            return Ok((IdPool::new(IdMode::Root, start, start, len), None));
        }
        let name = user_name(uid);
        let subuid = subordinate("/etc/subuid", name.as_deref(), uid);
        let subgid = subordinate("/etc/subgid", name.as_deref(), uid);
        let helpers = (find_program("newuidmap"), find_program("newgidmap"));
        match (subuid, subgid, helpers) {
            (Some((us, ul)), Some((gs, gl)), (Some(newuidmap), Some(newgidmap))) => Ok((
                IdPool::new(
                    IdMode::Subordinate {
                        newuidmap,
                        newgidmap,
                    },
                    us,
                    gs,
                    ul.min(gl),
                ),
                None,
            )),
            (su, sg, helpers) => {
                let why = if su.is_none() || sg.is_none() {
                    format!(
                        "user {} has no subordinate ids in /etc/subuid and /etc/subgid",
                        name.clone().unwrap_or_else(|| uid.to_string())
                    )
                } else if helpers.0.is_none() || helpers.1.is_none() {
                    "newuidmap/newgidmap are not installed (Debian: apt-get install uidmap)".into()
                } else {
                    "subordinate ids are unusable".into()
                };
                Ok((
                    IdPool::new(IdMode::Shared, uid, gid, 1),
                    Some(format!(
                        "VMs share the sandbox host's own uid instead of one each, because {why}; \
                         see \"The jail\" in the operator guide"
                    )),
                ))
            }
        }
    }

    /// A pool over explicit ranges.
    pub fn new(mode: IdMode, uid_start: u32, gid_start: u32, len: u32) -> IdPool {
        IdPool {
            mode,
            uid_start,
            gid_start,
            len: len.max(1),
            used: Mutex::new(BTreeSet::new()),
        }
    }

    /// How ids are mapped.
    pub fn mode(&self) -> &IdMode {
        &self.mode
    }

    /// Takes the lowest free id pair.
    pub fn lease(self: &Arc<Self>) -> Result<IdLease, IdError> {
        if self.mode == IdMode::Shared {
            return Ok(IdLease {
                pool: self.clone(),
                slot: 0,
                uid: self.uid_start,
                gid: self.gid_start,
            });
        }
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        // Ids are handed out lowest first, so the set's holes are found in order.
        let mut slot = 0;
        for &u in used.iter() {
            if u != slot {
                break;
            }
            slot += 1;
        }
        if slot >= self.len {
            return Err(IdError::Exhausted(self.len));
        }
        used.insert(slot);
        Ok(IdLease {
            pool: self.clone(),
            slot,
            uid: self.uid_start + slot,
            gid: self.gid_start + slot,
        })
    }
}

impl IdPool {
    /// The id pair of an adopted process (its uid as recorded), taken from the pool so no new
    /// process gets it while the adopted one lives: it must be one of the pool's and free.
    pub fn adopt(self: &Arc<Self>, uid: u32) -> Result<IdLease, String> {
        if self.mode == IdMode::Shared {
            return match uid == self.uid_start {
                true => self.lease().map_err(|e| e.to_string()),
                false => Err(format!("uid {uid} is not the service's own")),
            };
        }
        let slot = uid
            .checked_sub(self.uid_start)
            .filter(|s| *s < self.len)
            .ok_or_else(|| format!("uid {uid} is not one of the jail's ids"))?;
        let mut used = self.used.lock().unwrap_or_else(|e| e.into_inner());
        if !used.insert(slot) {
            return Err(format!("uid {uid} belongs to another live process"));
        }
        Ok(IdLease {
            pool: self.clone(),
            slot,
            uid,
            gid: self.gid_start + slot,
        })
    }
}

fn parse_range(s: &str) -> Option<(u32, u32)> {
    let (a, b) = s.trim().split_once(':')?;
    let start: u32 = a.trim().parse().ok()?;
    let len: u32 = b.trim().parse().ok()?;
    (start > 0 && len > 0 && start.checked_add(len).is_some()).then_some((start, len))
}

/// The user's name from `/etc/passwd`, which `/etc/subuid` usually names.
fn user_name(uid: u32) -> Option<String> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|l| {
        let mut f = l.split(':');
        let name = f.next()?;
        let _ = f.next();
        (f.next()?.parse::<u32>().ok()? == uid).then(|| name.to_string())
    })
}

/// The first range of at least 2 ids listed for the user (by name or number).
fn subordinate(file: &str, name: Option<&str>, id: u32) -> Option<(u32, u32)> {
    let text = std::fs::read_to_string(file).ok()?;
    parse_subordinate(&text, name, id)
}

fn parse_subordinate(text: &str, name: Option<&str>, id: u32) -> Option<(u32, u32)> {
    text.lines().find_map(|l| {
        let mut f = l.trim().split(':');
        let who = f.next()?;
        let start: u32 = f.next()?.parse().ok()?;
        let len: u32 = f.next()?.parse().ok()?;
        let mine = Some(who) == name || who.parse::<u32>().ok() == Some(id);
        (mine && len >= 2 && start.checked_add(len).is_some()).then_some((start, len))
    })
}

pub(crate) fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/bin".into(), "/usr/sbin".into()])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_unique_and_come_back() {
        let pool = Arc::new(IdPool::new(IdMode::Root, 1000, 2000, 3));
        let a = pool.lease().unwrap();
        let b = pool.lease().unwrap();
        let c = pool.lease().unwrap();
        assert_eq!((a.uid, b.uid, c.uid), (1000, 1001, 1002));
        assert_eq!((a.gid, b.gid, c.gid), (2000, 2001, 2002));
        assert!(matches!(pool.lease(), Err(IdError::Exhausted(3))));
        drop(b);
        assert_eq!(pool.lease().unwrap().uid, 1001);
    }

    #[test]
    fn an_adopted_id_is_taken_once_and_only_from_the_range() {
        let pool = Arc::new(IdPool::new(IdMode::Root, 1000, 2000, 3));
        let a = pool.adopt(1001).unwrap();
        assert_eq!((a.uid, a.gid), (1001, 2001));
        assert!(pool.adopt(1001).is_err(), "held by a live process");
        assert!(pool.adopt(999).is_err() && pool.adopt(1003).is_err());
        let b = pool.lease().unwrap();
        let c = pool.lease().unwrap();
        assert_eq!((b.uid, c.uid), (1000, 1002), "the adopted id is skipped");
        drop(a);
        assert_eq!(pool.adopt(1001).unwrap().uid, 1001);
    }

    #[test]
    fn subordinate_ranges_by_name_or_number() {
        let text = "alice:100000:65536\n1001:200000:65536\nbob:300000:1\n";
        assert_eq!(
            parse_subordinate(text, Some("alice"), 1000),
            Some((100000, 65536))
        );
        assert_eq!(
            parse_subordinate(text, Some("carol"), 1001),
            Some((200000, 65536))
        );
        assert_eq!(
            parse_subordinate(text, Some("bob"), 1002),
            None,
            "one id is not a range"
        );
    }

    #[test]
    fn range_setting() {
        assert_eq!(
            parse_range("1500000000:65536"),
            Some((1_500_000_000, 65_536))
        );
        assert_eq!(parse_range("0:10"), None);
        assert_eq!(parse_range("4294967295:2"), None);
        assert_eq!(parse_range("nonsense"), None);
    }
}
