//! A create request naming the Vantik guest image gets it: its harness version is compared, the
//! root and /workspace grow to the run's disk limit, and the sandbox's disk goes with it. Needs
//! `vantik-guest:latest` in the image store (`bin/up` and `bin/test` build it as root).

mod common;

use std::time::Duration;

use common::{guest_image_missing, start, stock_image_missing};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_naming_the_guest_image_gets_its_disk_and_version_check() {
    if stock_image_missing() {
        return;
    }
    if guest_image_missing() {
        return;
    }
    let store = common::image_store();
    let image = sandbox_vmm::ImageStore::new(&store)
        .resolve("vantik-guest:latest")
        .expect("the guest image resolves");
    let pi = image
        .harness_version
        .clone()
        .expect("the image records its harness version");
    let h = start(&[("SANDBOX_HOST_IMAGE_DIR", store.to_str().unwrap())]);
    let (s, v) = h.json("GET", "/v1/health", None).await;
    assert_eq!(s, 200);
    assert_eq!(v["image"]["stock"], false, "{v}");

    let (s, created) = h
        .json(
            "POST",
            "/v1/sandboxes",
            Some(
                json!({"run_id": "guest", "time_limit_ms": 600000, "review": true,
                        "memory_mib": 1024, "vcpus": 1, "harness_version": pi}),
            ),
        )
        .await;
    assert_eq!(s, 201, "{created}");
    assert_eq!(created["image"], "vantik-guest:latest");
    assert_eq!(created["stock_image"], false);
    assert_eq!(created["harness_version_match"], true);
    assert_eq!(created["disk_limit_mib"], 30720);
    let id = created["id"].as_str().unwrap().to_string();
    let disk = h.state.join(&id).join("sandbox-disk.ext4");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 30720 << 20);

    let (out, _, end) = h
        .exec(
            &id,
            "df -m /workspace | tail -n 1; cat /opt/vantik/pi-version; node -e 'console.log(1+1)'",
        )
        .await;
    assert_eq!(end["exit_code"], 0, "{end}");
    let out = String::from_utf8_lossy(&out);
    let size: u64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(size > 29_000, "/workspace is on the 30 GiB disk: {out}");
    assert!(out.contains(&format!("{pi}\n2\n")), "{out}");

    let (s, _) = h.json("DELETE", &format!("/v1/sandboxes/{id}"), None).await;
    assert!(s == 200 || s == 204, "{s}");
    for _ in 0..100 {
        if !disk.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!disk.exists(), "the sandbox's disk is removed with it");

    // `sandbox-host run --image` boots it too.
    let out = common::bin()
        .env("SANDBOX_HOST_IMAGE_DIR", &store)
        .args([
            "run",
            "--image",
            "vantik-guest:latest",
            "--memory-mib",
            "1024",
            "--vcpus",
            "1",
            "--disk-mib",
            "2048",
            "--",
        ])
        .args([
            "sh",
            "-c",
            "cat /opt/vantik/pi-version; df -m / | tail -n 1",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.starts_with(&format!("{pi}\noverlay")), "{text}");
    let root_mib: u64 = text
        .lines()
        .nth(1)
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (1900..=2048).contains(&root_mib),
        "the root is the 2048 MiB disk: {text}"
    );

    // Another pinned Pi: the answer says it does not match.
    let (s, created) = h
        .json(
            "POST",
            "/v1/sandboxes",
            Some(
                json!({"run_id": "guest2", "time_limit_ms": 600000, "review": false,
                        "memory_mib": 1024, "vcpus": 1, "harness_version": "0.0.1"}),
            ),
        )
        .await;
    assert_eq!(s, 201, "{created}");
    assert_eq!(created["harness_version_match"], false);
    assert_eq!(created["disk_limit_mib"], 20480);
}
