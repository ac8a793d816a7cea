//! The agent in a real guest gets bad input on its channel (garbage, truncated frames, a length
//! of 4 GiB, unknown kinds, bad requests, stdin after close), answers each with an error frame,
//! and keeps serving.

use std::time::Duration;

use sandbox_e2e::{boot_stock, pseudo_random, sh};
use sandbox_protocol::client::Client;
use sandbox_protocol::message::ErrorMessage;
use sandbox_protocol::{Frame, Kind};
use tokio::sync::broadcast;

/// Pings until the agent answers (a ping can be swallowed by the bytes of a lying frame).
async fn still_serving(c: &Client) {
    for _ in 0..20 {
        if let Ok(Ok(r)) = tokio::time::timeout(Duration::from_secs(3), c.ping()).await {
            assert_eq!(r.protocol, sandbox_protocol::PROTOCOL_VERSION);
            return;
        }
    }
    panic!("the agent stopped answering pings");
}

async fn next_error(rx: &mut broadcast::Receiver<(u32, ErrorMessage)>) -> (u32, ErrorMessage) {
    tokio::time::timeout(Duration::from_secs(20), rx.recv())
        .await
        .expect("an error frame within 20 s")
        .expect("error stream")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_errors_and_the_agent_keeps_serving() {
    let Some(vm) = boot_stock(512, 1).await else {
        return;
    };
    let c = &vm.sandbox.client;
    let mut errors = c.subscribe_stray_errors();

    // Garbage.
    c.send_raw(pseudo_random(10_000, 11)).await.unwrap();
    let (_, e) = next_error(&mut errors).await;
    assert_eq!(e.code, "bad_frame");
    still_serving(c).await;
    while errors.try_recv().is_ok() {}

    // A length of 4 GiB.
    let mut huge = Frame::new(Kind::Exec, 77, vec![]).encode();
    huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    c.send_raw(huge).await.unwrap();
    let (stream, e) = next_error(&mut errors).await;
    assert_eq!((stream, e.code.as_str()), (77, "bad_frame"));
    assert!(
        e.message.contains("4294967295") && e.message.contains("limit"),
        "{}",
        e.message
    );
    still_serving(c).await;
    while errors.try_recv().is_ok() {}

    // A truncated frame: a header promising 100 bytes, then only 30 of them.
    let whole = Frame::new(Kind::Exec, 78, vec![b'{'; 100]).encode();
    c.send_raw(whole[..50].to_vec()).await.unwrap();
    still_serving(c).await;
    let (stream, e) = next_error(&mut errors).await;
    assert_eq!(
        (stream, e.code.as_str()),
        (78, "bad_frame"),
        "{}",
        e.message
    );
    while errors.try_recv().is_ok() {}

    // An unknown kind, a kind only the agent sends, a bad request, a bad window.
    c.send_frame(Frame::new(0x42u8, 79, vec![])).await.unwrap();
    assert_eq!(next_error(&mut errors).await.1.code, "unknown_kind");
    c.send_frame(Frame::new(Kind::Stdout, 80, b"x".to_vec()))
        .await
        .unwrap();
    assert_eq!(next_error(&mut errors).await.1.code, "unknown_kind");
    c.send_frame(Frame::new(Kind::Exec, 81, b"{not json".to_vec()))
        .await
        .unwrap();
    let (stream, e) = next_error(&mut errors).await;
    assert_eq!((stream, e.code.as_str()), (81, "bad_request"));
    c.send_frame(Frame::new(
        Kind::Exec,
        82,
        br#"{"argv":["true"],"shell":true}"#.to_vec(),
    ))
    .await
    .unwrap();
    let (_, e) = next_error(&mut errors).await;
    assert!(e.message.contains("unknown field `shell`"), "{}", e.message);
    c.send_frame(Frame::new(Kind::Window, 0, b"abc".to_vec()))
        .await
        .unwrap();
    assert_eq!(next_error(&mut errors).await.1.code, "bad_request");

    // A half-closed stream: stdin written after it was closed.
    c.send_frame(Frame::new(
        Kind::Exec,
        90,
        br#"{"command":"sleep 2","stdin":true,"cwd":"/"}"#.to_vec(),
    ))
    .await
    .unwrap();
    c.send_frame(Frame::new(Kind::Stdin, 90, vec![]))
        .await
        .unwrap();
    c.send_frame(Frame::new(Kind::Stdin, 90, b"late".to_vec()))
        .await
        .unwrap();
    let (stream, e) = next_error(&mut errors).await;
    assert_eq!(
        (stream, e.code.as_str()),
        (90, "bad_stream"),
        "{}",
        e.message
    );
    assert!(e.message.contains("already closed"));
    c.send_frame(Frame::new(Kind::Cancel, 90, vec![]))
        .await
        .unwrap();

    // More upload than the window allows.
    c.send_frame(Frame::new(
        Kind::Exec,
        91,
        br#"{"command":"sleep 5","stdin":true,"cwd":"/"}"#.to_vec(),
    ))
    .await
    .unwrap();
    for _ in 0..20 {
        c.send_frame(Frame::new(Kind::Stdin, 91, vec![0u8; 64 * 1024]))
            .await
            .unwrap();
    }
    let (stream, e) = next_error(&mut errors).await;
    assert_eq!((stream, e.code.as_str()), (91, "window_exceeded"));

    // After all of it, real work still works.
    still_serving(c).await;
    assert_eq!(sh(c, "echo still here").await.stdout, b"still here\n");
    vm.sandbox.stop().await;
}
