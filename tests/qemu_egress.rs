//! The guest's network through the egress stack, on whichever backend is selected (QEMU's
//! `-netdev stream` here; the KVM backend's virtio-net when this runs in the nested test host):
//! the guest resolves an allowed name through the stack's DNS, fetches from a server on loopback
//! byte for byte (100 KiB), and a name outside the allowlist and an IP literal are refused and
//! counted. The API-level suite (`api/tests/api_egress.rs`) covers every refusal class.

use std::sync::Arc;
use std::time::Duration;

use sandbox_e2e::{boot_stock_with_net, sh};
use sandbox_egress::policy::Allowlist;
use sandbox_egress::refusal::Reason;
use sandbox_egress::resolve::ResolveOverrides;
use sandbox_egress::stats::Stats;
use sandbox_egress::{Egress, EgressConfig};
use sandbox_vmm::NetAttachment;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An HTTP/1.0 server on loopback answering every request with `body`.
async fn serve(body: Arc<Vec<u8>>) -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 512];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&b[..n]),
                    }
                }
                let h = format!("HTTP/1.0 200 OK\r\ncontent-length: {}\r\n\r\n", body.len());
                let _ = s.write_all(h.as_bytes()).await;
                let _ = s.write_all(&body).await;
                let _ = s.shutdown().await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guest_reaches_an_allowed_name_and_nothing_else() {
    let body: Vec<u8> = (0..100 * 1024u32).map(|i| (i * 7 % 251) as u8).collect();
    let want = sandbox_e2e::sha256_hex(&body);
    let port = serve(Arc::new(body)).await;
    let mac = sandbox_egress::net::guest_mac("e2e-egress");
    let mut config = EgressConfig::new(mac, Allowlist::parse(["allowed.test"]).unwrap());
    config.overrides =
        Arc::new(ResolveOverrides::parse(&format!("allowed.test:{port}:127.0.0.1")).unwrap());
    let (egress, guest) = Egress::start(config);
    let net = NetAttachment {
        mac,
        link: sandbox_vmm::NetLink::Frames(Arc::new(sandbox_net::GuestLink(guest))),
    };
    let Some(vm) = boot_stock_with_net(256, 1, net).await else {
        return;
    };
    let c = &vm.sandbox.client;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let out = sh(
        c,
        &sandbox_egress::net::guest_setup_script(mac, Some(now), None),
    )
    .await;
    assert_eq!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");

    let fetch = format!(
        "printf 'GET /data HTTP/1.0\\r\\nHost: allowed.test\\r\\n\\r\\n' | nc -w 10 allowed.test {port} | sed '1,/^\\r$/d' | sha256sum"
    );
    let out = sh(c, &fetch).await;
    assert_eq!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");
    assert_eq!(
        out.stdout_str().split_whitespace().next(),
        Some(want.as_str())
    );

    let t = std::time::Instant::now();
    let out = sh(
        c,
        "nc -w 5 other.test 80 </dev/null; nc -w 5 1.1.1.1 443 </dev/null",
    )
    .await;
    assert_ne!(out.status.and_then(|s| s.exit_code), Some(0), "{out:?}");
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "refusals took {:?}",
        t.elapsed()
    );
    let s: &Stats = egress.stats();
    assert!(s.refusals().count(Reason::NameNotAllowed) >= 1);
    assert_eq!(s.refusals().count(Reason::IpLiteral), 1);
    assert_eq!(Stats::get(&s.http), 1);
    assert_eq!(
        Stats::get(&s.to_guest),
        100 * 1024,
        "body bytes to the guest"
    );
    vm.sandbox.stop().await;
}
