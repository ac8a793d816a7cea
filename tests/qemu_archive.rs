//! A directory tree goes into a real guest as a tar stream and comes back identical: 1,000
//! files, a symlink, an empty directory, modes, and a 50 MB file.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use sandbox_e2e::{boot_stock, pseudo_random, sh, sha256_hex};

/// What a tree holds, path by path: type, mode and content hash or link target.
fn snapshot(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            let mode = meta.permissions().mode() & 0o7777;
            let what = if meta.file_type().is_symlink() {
                format!("link -> {}", std::fs::read_link(&p).unwrap().display())
            } else if meta.is_dir() {
                stack.push(p.clone());
                format!("dir {mode:o}")
            } else {
                format!("file {mode:o} {}", sha256_hex(&std::fs::read(&p).unwrap()))
            };
            out.insert(rel, what);
        }
    }
    out
}

fn make_tree(root: &Path) {
    for i in 0..1000 {
        let dir = root
            .join(format!("d{:02}", i % 20))
            .join(format!("e{}", i % 3));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join(format!("file-{i}.txt"));
        std::fs::write(&f, format!("content of file {i}\n").repeat(i % 7 + 1)).unwrap();
        let mode = [0o644, 0o755, 0o600, 0o640][i % 4];
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    std::fs::write(root.join("big.bin"), pseudo_random(50 << 20, 3)).unwrap();
    std::os::unix::fs::symlink("d00/e0/file-0.txt", root.join("link")).unwrap();
    std::fs::create_dir(root.join("empty")).unwrap();
    std::fs::set_permissions(root.join("empty"), std::fs::Permissions::from_mode(0o700)).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tree_round_trip() {
    let Some(vm) = boot_stock(1024, 2).await else {
        return;
    };
    let c = &vm.sandbox.client;
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    make_tree(&src);

    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", &src).unwrap();
    let archive = b.into_inner().unwrap();
    let done = c
        .put_archive("/workspace/tree", &archive[..])
        .await
        .unwrap();
    assert!(done.entries >= 1000 + 60 + 3, "{done:?}");
    assert!(done.bytes >= 50 << 20);

    // The guest sees it as the host wrote it.
    let ls = sh(c, "readlink /workspace/tree/link; stat -c %a /workspace/tree/empty /workspace/tree/d01/e1/file-1.txt").await;
    assert_eq!(ls.stdout_str(), "d00/e0/file-0.txt\n700\n755\n");

    let back = c
        .get_archive("/workspace/tree")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let dst = tmp.path().join("dst");
    std::fs::create_dir(&dst).unwrap();
    let mut ar = tar::Archive::new(&back[..]);
    ar.set_preserve_permissions(true);
    ar.unpack(&dst).unwrap();

    let (a, b) = (snapshot(&src), snapshot(&dst));
    assert_eq!(a.len(), b.len());
    assert_eq!(a, b);

    // Unsafe entries are refused and nothing lands outside the target.
    let mut h = tar::Header::new_gnu();
    h.set_size(1);
    h.set_mode(0o644);
    h.as_old_mut().name[..12].copy_from_slice(b"../escaped-1");
    h.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&h, &b"x"[..]).unwrap();
    let err = c
        .put_archive("/workspace/tree", &b.into_inner().unwrap()[..])
        .await
        .unwrap_err();
    assert_eq!(err.agent_code(), Some("unsafe_archive"), "{err}");
    assert_eq!(
        sh(c, "ls /workspace/escaped-1 2>&1 >/dev/null; echo $?")
            .await
            .stdout_str()
            .trim_end()
            .lines()
            .last(),
        Some("1")
    );

    // Garbage is not an archive, and the agent keeps serving.
    let err = c
        .put_archive("/workspace/x", &pseudo_random(100_000, 5)[..])
        .await
        .unwrap_err();
    assert_eq!(err.agent_code(), Some("bad_request"), "{err}");
    assert_eq!(sh(c, "echo alive").await.stdout, b"alive\n");

    // A FIFO with no writer would block a reader forever: it is refused, not read.
    assert_eq!(sh(c, "mkfifo /tmp/fifo && echo ok").await.stdout, b"ok\n");
    let read = sandbox_e2e::bounded("reading a FIFO as a file", async {
        c.get_file("/tmp/fifo").await?.collect().await
    })
    .await;
    let err = read.unwrap_err();
    assert_eq!(err.agent_code(), Some("bad_request"), "{err}");
    assert!(err.to_string().contains("not a regular file"), "{err}");
    // A character device never ends either.
    let read = sandbox_e2e::bounded("reading /dev/zero as a file", async {
        c.get_file("/dev/zero").await?.collect().await
    })
    .await;
    assert!(
        read.is_err_and(|e| e.to_string().contains("not a regular file")),
        "/dev/zero was read"
    );

    vm.sandbox.stop().await;
}
