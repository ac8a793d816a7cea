//! What the jail costs a VM's start, measured natively on this machine (the jail is kernel work
//! (namespaces, mounts, a cgroup, id maps, seccomp) and needs no KVM, so unlike a guest's boot
//! it runs here at full speed, not under the nested host's emulation).
//!
//! Rows: `/usr/bin/true` started and waited for as a plain child (fork and exec, the reference),
//! and the same program started through the jail every VM process gets (new namespaces, its own
//! uid, an empty read-only root with /usr, a cgroup, rlimits, no capabilities, the seccomp
//! filter), interleaved. The difference is the jail's share of a sandbox's start.
//! `BENCH_RUNS` sets the number of runs (default 50).

use std::time::Instant;

use sandbox_benches::{header, row, stats};

fn main() {
    let runs = sandbox_benches::runs(50);
    let jailer = sandbox_jail::Jailer::new(&sandbox_jail::Settings {
        mode: sandbox_jail::Mode::Auto,
        ids: None,
        cgroup_parent: "sandbox-host-bench".into(),
        instance: format!("pid-{}", std::process::id()),
    });
    let status = jailer.status().clone();
    if !status.namespaces {
        println!(
            "skipped: the jail cannot be applied here: {:?}",
            status.missing
        );
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (mut plain, mut jailed) = (Vec::new(), Vec::new());
    for i in 0..runs {
        let t = Instant::now();
        let st = std::process::Command::new("/usr/bin/true")
            .status()
            .expect("true");
        assert!(st.success());
        plain.push(t.elapsed());

        let staging = tempfile::tempdir().expect("tempdir");
        let null = std::fs::File::open("/dev/null").expect("/dev/null");
        let t = Instant::now();
        let j = jailer
            .spawn(sandbox_jail::Command {
                name: format!("bench-{i}"),
                program: Some("/usr/bin/true".into()),
                args: vec![],
                fds: vec![
                    null.try_clone().expect("dup").into(),
                    null.try_clone().expect("dup").into(),
                    null.into(),
                ],
                root: Some(sandbox_jail::Root {
                    staging: staging.path().to_path_buf(),
                    system: true,
                    ..Default::default()
                }),
                limits: sandbox_jail::Limits {
                    memory_bytes: 64 << 20,
                    pids: 16,
                    cpu_weight: 100,
                    cpus: 1,
                },
                nofile: 128,
                fsize: Some(1 << 20),
                keep_groups: vec![],
                seccomp: true,
                host_network: false,
                outlive: false,
            })
            .expect("jailed spawn");
        let exit = rt.block_on(j.wait());
        assert_eq!(exit.code(), Some(0), "{exit:?}");
        jailed.push(t.elapsed());
    }
    println!(
        "\nThe jail's cost: /usr/bin/true started and waited for, {runs} runs each, interleaved \
         (ids: {}, cgroup: {})\n",
        status.ids,
        status.cgroup.unwrap_or("none")
    );
    header();
    let reference = stats(&plain).0;
    row(
        "plain child: fork, exec, exit (reference)",
        &plain,
        Some(reference),
    );
    row(
        "jailed: namespaces, ids, root, cgroup, seccomp, exec, exit",
        &jailed,
        Some(reference),
    );
    let extra = stats(&jailed).0 - reference;
    println!(
        "\nthe jail adds {extra:.1} ms (median) to a VM process's start; the spawn runs on one \
         thread, so concurrent creates queue behind it ({:.0} jails per second)",
        1000.0 / stats(&jailed).0
    );
}
