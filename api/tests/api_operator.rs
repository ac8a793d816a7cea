//! The operator subcommands against a running host: health, ls, exec, rm.

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
