//! The operator subcommands against a running host: health, ls, exec, shell, rm.

mod common;

use common::{TOKEN, bin, start, stock_image_missing};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_ls_exec_rm() {
    if stock_image_missing() {
        return;
    }
    let h = start(&[]);
    let url = h.url("");
    let op = |args: &[&str]| {
        let mut c = bin();
        c.env("SANDBOX_HOST_TOKEN", TOKEN)
            .env("SANDBOX_HOST_URL", &url)
            .args(args);
        c.output().unwrap()
    };

    let out = op(&["health"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["available"], true);

    let id = h.create(json!({"run_id": "operator-run"})).await;
    let out = op(&["ls"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&id) && text.contains("operator-run") && text.contains("ready"),
        "{text}"
    );

    let out = op(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 9",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
    assert_eq!(out.status.code(), Some(9));

    // A terminal (`shell`): not a terminal here, so 24x80; the command's exit code is its own.
    let out = op(&["shell", &id, "--", "sh", "-c", "stty size; tty; exit 3"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("24 80\r\n/dev/pts/"), "{text}");
    // A login shell, typed into from a pipe.
    let mut c = bin();
    c.env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_URL", &url)
        .args(["shell", &id])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"echo piped-$((2+3)); exit 4\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(4),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("piped-5"), "{text}");
    let out = op(&["shell", "no-such-sandbox"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no sandbox with id"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = op(&["rm", &id]);
    assert_eq!(out.status.code(), Some(0));
    let out = op(&["rm", &id]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no sandbox with id"));

    // A wrong token and a host that is not there, in the guide's words.
    let out = bin()
        .env("SANDBOX_HOST_TOKEN", "wrong-token-wrong-token-wrong")
        .env("SANDBOX_HOST_URL", &url)
        .arg("ls")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("refused the token"));
    let out = bin()
        .env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_URL", "http://127.0.0.1:1")
        .arg("health")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("did not answer"));
    assert_eq!(out.status.code(), Some(1));
}

/// `sandbox-host shell` in a real local terminal (a pseudo terminal this test opens, the CLI
/// its session's leader, as in a person's terminal window): the guest's terminal has the local
/// window's size and follows it when the window is resized (SIGWINCH to the CLI); Ctrl-C reaches
/// the guest's foreground job instead of ending the CLI (raw mode); the guest's exit code is
/// the CLI's, and the local terminal's settings are restored at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shell_in_a_local_terminal() {
    use rustix::termios::{Winsize, tcgetattr, tcsetwinsize};
    use std::io::{Read, Write};
    if stock_image_missing() {
        return;
    }
    let h = start(&[]);
    let id = h.create(json!({})).await;

    let master =
        rustix::pty::openpt(rustix::pty::OpenptFlags::RDWR | rustix::pty::OpenptFlags::NOCTTY)
            .unwrap();
    rustix::pty::grantpt(&master).unwrap();
    rustix::pty::unlockpt(&master).unwrap();
    let name = rustix::pty::ptsname(&master, Vec::new()).unwrap();
    let slave = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(name.to_str().unwrap())
        .unwrap();
    let size = |rows, cols| Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    tcsetwinsize(&master, size(30, 100)).unwrap();
    let cooked = tcgetattr(&slave).unwrap();
    // setsid -c: a session of its own with this terminal as its controlling one.
    let mut child = std::process::Command::new("setsid")
        .arg("-c")
        .arg(env!("CARGO_BIN_EXE_sandbox-host"))
        .args(["shell", &id])
        .env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_URL", h.url(""))
        .stdin(slave.try_clone().unwrap())
        .stdout(slave.try_clone().unwrap())
        .stderr(slave.try_clone().unwrap())
        .spawn()
        .unwrap();
    let mut master = std::fs::File::from(master);
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let mut reader = master.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = reader.read(&mut buf) {
            if tx.send(buf[..n].to_vec()).is_err() {
                return;
            }
        }
    });
    let mut screen = String::new();
    let until = |screen: &mut String, want: &str| {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !screen.contains(want) {
            let left = end.saturating_duration_since(std::time::Instant::now());
            let b = rx
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no `{want}`; the terminal showed:\n{screen}"));
            screen.push_str(&String::from_utf8_lossy(&b));
        }
    };
    master.write_all(b"stty size; echo at-$((5*5))\r").unwrap();
    until(&mut screen, "at-25");
    assert!(screen.contains("30 100"), "{screen}");

    // The window is resized: the CLI hears SIGWINCH and passes the size on.
    tcsetwinsize(&master, size(41, 121)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    master.write_all(b"stty size; echo at-$((5*6))\r").unwrap();
    until(&mut screen, "at-30");
    assert!(screen.contains("41 121"), "{screen}");

    // Ctrl-C goes to the guest's foreground job; the CLI stays.
    master.write_all(b"sleep 100\r").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    master.write_all(b"\x03").unwrap();
    master.write_all(b"echo rc=$?\r").unwrap();
    until(&mut screen, "rc=130");
    assert!(child.try_wait().unwrap().is_none(), "Ctrl-C ended the CLI");

    master.write_all(b"exit 5\r").unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(5), "{screen}");
    // Raw mode is undone: the terminal's settings are what they were.
    let after = tcgetattr(&slave).unwrap();
    assert_eq!(after.local_modes, cooked.local_modes);
    assert_eq!(after.input_modes, cooked.input_modes);
}
