//! Starting the real `sandbox-host serve` on a loopback port and talking to it over HTTP.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub const TOKEN: &str = "test-token-0123456789abcdef-xyz";

/// The stock image is needed for anything that boots; CI builds it and requires these tests.
pub fn stock_image_missing() -> bool {
    let store = sandbox_vmm::config::image_dir();
    if store.join("stock/manifest.json").is_file() {
        return false;
    }
    let why = format!(
        "no stock image in {}; run `bash rootfs/build-stock.sh`",
        store.display()
    );
    assert!(
        std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() != Ok("1"),
        "{why}"
    );
    eprintln!("skipped: {why}");
    true
}

/// Whether the guest image is missing (then the test says "skipped"; under CI as root it is built,
/// so missing is a failure).
pub fn guest_image_missing() -> bool {
    let store = sandbox_vmm::config::image_dir();
    if sandbox_vmm::ImageStore::new(&store)
        .resolve("vantik-guest:latest")
        .is_ok()
    {
        return false;
    }
    let why = "no vantik-guest:latest in the image store; build it with `sudo python3 rootfs/build-guest.py`";
    assert!(
        !(running_as_root() && std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() == Ok("1")),
        "{why}"
    );
    eprintln!("skipped: {why}");
    true
}

/// An image store beside `state` holding only a link to the real stock image.
pub fn stock_only_store(state: &Path) -> PathBuf {
    let name = state.file_name().unwrap().to_string_lossy();
    let store = state.with_file_name(format!("{name}-images"));
    std::fs::create_dir_all(&store).unwrap();
    let link = store.join("stock");
    if let (false, Ok(real)) = (
        link.exists(),
        std::fs::canonicalize(image_store().join("stock")),
    ) {
        let _ = std::os::unix::fs::symlink(real, &link);
    }
    store
}

/// An image store beside `state` holding a copy of the aarch64 guests' stock image (root's build
/// of it is not published to the service's user; it is 9 MiB), for a host with
/// `SANDBOX_HOST_ARCH=aarch64`; `None` (with "skipped" and why) when it was not built.
pub fn aarch64_store(state: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let from = sandbox_vmm::config::image_dir_for(sandbox_vmm::arch::Arch::Aarch64).join("stock");
    if !from.join("manifest.json").is_file() {
        let why = format!(
            "no aarch64 stock image in {}; run `SANDBOX_HOST_ARCH=aarch64 bash rootfs/build-stock.sh`",
            from.display()
        );
        assert!(
            std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() != Ok("1"),
            "{why}"
        );
        eprintln!("skipped: {why}");
        return None;
    }
    let name = state.file_name().unwrap().to_string_lossy();
    let store = state.with_file_name(format!("{name}-images-aarch64"));
    let to = store.join("stock");
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(&from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        std::fs::copy(e.path(), &dest).unwrap();
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    for d in [&store, &to] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    Some(store)
}

/// The binary as whoever runs the tests, for the operator commands and `run`.
/// `SANDBOX_HOST_BIN` names it where the build's path is not this machine's (a test binary run
/// inside the nested test host, `nested_kvm.rs`).
pub fn bin() -> Command {
    let exe = std::env::var_os("SANDBOX_HOST_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_sandbox-host").into());
    let mut c = Command::new(exe);
    test_env(&mut c);
    c
}

fn test_env(c: &mut Command) {
    // Never read the developer's .env in tests.
    c.env("SANDBOX_HOST_DOTENV", "/nonexistent/.env")
        .env_remove("SANDBOX_HOST_TOKEN")
        .env_remove("SANDBOX_HOST_PORT");
}

/// The user the documented setup runs the service as.
pub const SERVICE_USER: &str = "sandbox-host";

/// What `scripts/service-user.sh` prepared for the service's user.
pub struct ServiceUser {
    /// `SANDBOX_HOST_CACHE`, `SANDBOX_HOST_CGROUP`, `SANDBOX_HOST_VM_BINARY`, ...
    env: Vec<(String, String)>,
    binary: PathBuf,
    images: PathBuf,
    /// On cgroup v2, the leaf the service is moved into before it drops to its user.
    procs: Option<PathBuf>,
    runtime: PathBuf,
}

fn running_as_root() -> bool {
    // /proc/self belongs to the effective uid.
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

/// The service's user when these tests run as root (CI): then every `serve` runs as the user
/// `sandbox-host`, set up the way `bin/up` does it (`scripts/service-user.sh`, then `setpriv`).
/// `None` when the tests run as an ordinary user, who is then the service's user.
pub fn service_user() -> Option<&'static ServiceUser> {
    static USER: std::sync::OnceLock<Option<ServiceUser>> = std::sync::OnceLock::new();
    USER.get_or_init(|| {
        if !running_as_root() {
            return None;
        }
        let require = std::env::var("SANDBOX_HOST_REQUIRE_E2E").as_deref() == Ok("1");
        let known = Command::new("id")
            .arg(SERVICE_USER)
            .output()
            .is_ok_and(|o| o.status.success());
        if !known {
            let why = "no user sandbox-host (scripts/install-deps.sh adds it)";
            assert!(!require, "{why}: CI runs the service as that user");
            eprintln!("skipped: running the service as an ordinary user: {why}; it runs as root");
            return None;
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let out = Command::new("bash")
            .arg(root.join("scripts/service-user.sh"))
            .args([
                "--cgroup",
                "sandbox-host-tests",
                "/var/lib/sandbox-host-tests",
            ])
            .arg(env!("CARGO_BIN_EXE_sandbox-host"))
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        assert!(out.status.success(), "scripts/service-user.sh failed");
        let mut env = vec![];
        let (mut binary, mut images, mut procs) = (None, None, None);
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some((k, v)) = line.split_once('=') else {
                continue;
            };
            match k {
                "SERVICE_BINARY" => binary = Some(PathBuf::from(v)),
                "SERVICE_CGROUP_PROCS" => procs = Some(PathBuf::from(v)),
                "SANDBOX_HOST_IMAGE_DIR" => images = Some(PathBuf::from(v)),
                // Each test gives its host a state directory of its own.
                "SANDBOX_HOST_STATE_DIR" => {}
                _ => env.push((k.to_string(), v.to_string())),
            }
        }
        Some(ServiceUser {
            env,
            binary: binary.expect("SERVICE_BINARY from scripts/service-user.sh"),
            images: images.expect("SANDBOX_HOST_IMAGE_DIR from scripts/service-user.sh"),
            procs,
            runtime: PathBuf::from("/var/lib/sandbox-host-tests"),
        })
    })
    .as_ref()
}

/// The image store the service can read: the published copy when it runs as its own user.
pub fn image_store() -> PathBuf {
    match service_user() {
        Some(u) => u.images.clone(),
        None => sandbox_vmm::config::image_dir(),
    }
}

/// `sandbox-host` for `serve`: as the user `sandbox-host` when the tests run as root.
pub fn service() -> Command {
    service_wrapped(&[])
}

/// [`service`] started through `wrapper` (a command and its arguments that execs the rest, run
/// as root: `ip netns exec NS`, say).
pub fn service_wrapped(wrapper: &[&str]) -> Command {
    let Some(u) = service_user() else {
        if wrapper.is_empty() {
            return bin();
        }
        let exe = std::env::var_os("SANDBOX_HOST_BIN")
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_sandbox-host").into());
        let mut c = Command::new(wrapper[0]);
        c.args(&wrapper[1..]).arg(exe);
        test_env(&mut c);
        return c;
    };
    // By its path: a test's own PATH (`/nonexistent`) applies to the lookup too.
    let setpriv = ["/usr/bin/setpriv", "/bin/setpriv"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("setpriv (util-linux) to start the service as its user");
    // As bin/up starts it: on cgroup v2 moved into its leaf first (the pid stays: `exec`), then
    // the user's ids, then a session of its own with no terminal, and only its own settings
    // of the environment.
    let mut argv: Vec<std::ffi::OsString> = wrapper.iter().map(Into::into).collect();
    if let Some(p) = &u.procs {
        argv.extend(["/bin/sh", "-c", "echo $$ > \"$0\" && exec \"$@\""].map(Into::into));
        argv.push(p.into());
    }
    argv.push(setpriv.into());
    argv.extend(
        [
            "--reuid",
            SERVICE_USER,
            "--regid",
            SERVICE_USER,
            "--init-groups",
            "--",
            "/usr/bin/setsid",
        ]
        .map(Into::into),
    );
    argv.push(u.binary.clone().into());
    let mut c = Command::new(&argv[0]);
    c.args(&argv[1..]).stdin(Stdio::null()).env_clear();
    for (k, v) in std::env::vars() {
        let keep = k.starts_with("SANDBOX_HOST_")
            || ["PATH", "LANG", "LC_ALL", "TZ", "RUST_LOG", "RUST_BACKTRACE"].contains(&k.as_str());
        if keep {
            c.env(k, v);
        }
    }
    c.env("HOME", &u.runtime);
    test_env(&mut c);
    for (k, v) in &u.env {
        c.env(k, v);
    }
    c
}

/// Lets the service's user pass through `dir` (a temporary directory is its creator's alone) to
/// the files a test names to it, such as a CA certificate.
pub fn let_service_pass(dir: &Path) {
    if service_user().is_none() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir).unwrap().permissions().mode();
    if mode & 0o001 == 0 {
        std::fs::set_permissions(
            dir,
            std::fs::Permissions::from_mode((mode | 0o711) & 0o7777),
        )
        .unwrap();
    }
}

/// Makes `dir` (a host's state directory) the service user's, and its parent passable.
pub fn give_to_service(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    if service_user().is_none() {
        return;
    }
    if let Some(parent) = dir.parent() {
        let_service_pass(parent);
    }
    // The directory alone: what is in it is the service's already (a restart), and root never
    // follows what the service user could have put there.
    let st = Command::new("chown")
        .arg(format!("{SERVICE_USER}:{SERVICE_USER}"))
        .arg(dir)
        .status()
        .unwrap();
    assert!(st.success(), "chown {}", dir.display());
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The body of a create of a small sandbox (256 MiB, one vCPU, ten minutes) for run `run_id`.
pub fn small_run(run_id: &str) -> Value {
    serde_json::json!({"run_id": run_id, "time_limit_ms": 600000, "review": false, "memory_mib": 256, "vcpus": 1})
}

/// A running sandbox host.
pub struct Host {
    pub child: Child,
    /// The port requests go to: the host's, or its gateway's when the suite runs through one.
    pub port: u16,
    /// The host's own port.
    pub service_port: u16,
    pub state: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    pub logs: Arc<Mutex<Vec<String>>>,
    /// The gateway in front of it ([`through_gateway`]), stopped after the host.
    pub front: Option<Box<Host>>,
}

/// The API's end-to-end tests run against a gateway as they run against a host (issue 33):
/// with `SANDBOX_HOST_TEST_THROUGH=gateway`, every host [`start`] and [`start_in`] make gets a
/// `sandbox-host gateway` of its own in front, and every request of the test goes through it;
/// what a test reads of the host itself (its log, its state, its signals) is the host's.
pub fn through_gateway() -> bool {
    std::env::var("SANDBOX_HOST_TEST_THROUGH").as_deref() == Ok("gateway")
}

/// Starts a host with a fresh state directory and `env`, and waits for its `Listening on` line.
pub fn start(env: &[(&str, &str)]) -> Host {
    let tmp = tempfile::Builder::new()
        .prefix("sbx-api")
        .tempdir_in("/tmp")
        .unwrap();
    let state = tmp.path().join("state");
    let mut h = start_in(&state, env);
    h._tmp = Some(tmp);
    h
}

/// Starts a host on a given state directory.
pub fn start_in(state: &Path, env: &[(&str, &str)]) -> Host {
    if !through_gateway() {
        return start_in_wrapped(state, env, &[]);
    }
    let name = format!("t{}", std::process::id() % 100_000);
    let mut with_name = env.to_vec();
    if !env.iter().any(|(k, _)| *k == "SANDBOX_HOST_NAME") {
        with_name.push(("SANDBOX_HOST_NAME", &name));
    }
    let mut h = start_in_wrapped(state, &with_name, &[]);
    let name = with_name
        .iter()
        .find(|(k, _)| *k == "SANDBOX_HOST_NAME")
        .map(|(_, v)| v.to_string())
        .unwrap_or(name);
    let hosts = format!("{name}=http://127.0.0.1:{}", h.service_port);
    let mut gw_env = vec![
        ("SANDBOX_HOST_GATEWAY_HOSTS", hosts.as_str()),
        ("SANDBOX_HOST_GATEWAY_POLL_MS", "200"),
    ];
    // The gateway has the host's body limit, as an operator sets both alike.
    gw_env.extend(
        env.iter()
            .filter(|(k, _)| *k == "SANDBOX_HOST_MAX_BODY_MB")
            .copied(),
    );
    let gw = start_gateway(&gw_env);
    // Until its first poll, the gateway knows the host by name only.
    let t = Instant::now();
    loop {
        let up = std::net::TcpStream::connect(("127.0.0.1", gw.port))
            .ok()
            .and_then(|_| {
                let out = Command::new("curl")
                    .args(["-s", "-m", "2", "-H"])
                    .arg(format!("Authorization: Bearer {TOKEN}"))
                    .arg(gw.url("/v1/health"))
                    .output()
                    .ok()?;
                serde_json::from_slice::<Value>(&out.stdout).ok()
            })
            .is_some_and(|v| v["hosts"][0]["up"] == true);
        if up {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the gateway in front of the host never saw it up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    h.port = gw.port;
    h.front = Some(Box::new(gw));
    h
}

/// [`start_in`] through `wrapper` (see [`service_wrapped`]).
pub fn start_in_wrapped(state: &Path, env: &[(&str, &str)], wrapper: &[&str]) -> Host {
    let port = free_port();
    give_to_service(state);
    let mut cmd = service_wrapped(wrapper);
    cmd.env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_PORT", port.to_string())
        .env("SANDBOX_HOST_STATE_DIR", state)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .arg("serve");
    // Unless a test names its store, it sees only the stock image: what these tests check must
    // not change with whether the operator built the full guest image.
    if !env.iter().any(|(k, _)| *k == "SANDBOX_HOST_IMAGE_DIR") {
        cmd.env("SANDBOX_HOST_IMAGE_DIR", stock_only_store(state));
    }
    // Templates are the service's default, but a template is one more boot beside the first
    // sandbox of a shape: most tests make one or two sandboxes per service and would pay for it
    // without using it. The tests of templates, and the load test, ask for them.
    if !env.iter().any(|(k, _)| *k == "SANDBOX_HOST_TEMPLATES") {
        cmd.env("SANDBOX_HOST_TEMPLATES", "off");
    }
    let (child, logs) = spawn_logged(&mut cmd, env);
    let h = Host {
        child,
        port,
        service_port: port,
        state: state.to_path_buf(),
        _tmp: None,
        logs,
        front: None,
    };
    h.wait_log("Listening on", Duration::from_secs(120));
    h
}

/// Spawns `cmd` with `env` added, its stderr's lines gathered as they come.
fn spawn_logged(cmd: &mut Command, env: &[(&str, &str)]) -> (Child, Arc<Mutex<Vec<String>>>) {
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let logs = Arc::new(Mutex::new(Vec::new()));
    let stderr = child.stderr.take().unwrap();
    let l = logs.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            l.lock().unwrap().push(line);
        }
    });
    (child, logs)
}

/// Starts `sandbox-host gateway` (issue 33) with `env` (its hosts among them), as the service's
/// user, and waits for its `Listening on` line.
pub fn start_gateway(env: &[(&str, &str)]) -> Host {
    start_gateway_wrapped(env, &[])
}

/// [`start_gateway`] through `wrapper` (see [`service_wrapped`]).
pub fn start_gateway_wrapped(env: &[(&str, &str)], wrapper: &[&str]) -> Host {
    let tmp = tempfile::Builder::new()
        .prefix("sbx-gw")
        .tempdir_in("/tmp")
        .unwrap();
    let port = free_port();
    let mut cmd = service_wrapped(wrapper);
    cmd.env("SANDBOX_HOST_TOKEN", TOKEN)
        .env("SANDBOX_HOST_PORT", port.to_string())
        .env("SANDBOX_HOST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .arg("gateway");
    let (child, logs) = spawn_logged(&mut cmd, env);
    let h = Host {
        child,
        port,
        service_port: port,
        state: tmp.path().join("none"),
        _tmp: Some(tmp),
        logs,
        front: None,
    };
    h.wait_log("Listening on", Duration::from_secs(30));
    h
}

impl Host {
    pub fn url(&self, path: &str) -> String {
        // Each host is scraped on its own (a gateway's `/metrics` are its own counters): what a
        // test reads of `/metrics` is the host's, with or without a gateway in front.
        if path.starts_with("/metrics") {
            return self.service_url(path);
        }
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The host's own URL for `path`, past any gateway (its `/metrics`, for one).
    pub fn service_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.service_port)
    }

    /// Waits for a log line containing `needle` and returns it parsed.
    pub fn wait_log(&self, needle: &str, timeout: Duration) -> Value {
        let t = Instant::now();
        loop {
            if let Some(l) = self
                .logs
                .lock()
                .unwrap()
                .iter()
                .find(|l| l.contains(needle))
            {
                return serde_json::from_str(l).unwrap_or(Value::String(l.clone()));
            }
            assert!(
                t.elapsed() < timeout,
                "no log line with `{needle}`; logs: {:?}",
                self.logs.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub async fn req(
        &self,
        method: &str,
        path: &str,
        body: Vec<u8>,
        headers: &[(&str, &str)],
    ) -> (u16, Bytes) {
        request(method, &self.url(path), body, headers).await
    }

    /// A request to the host itself, past any gateway: what only a host says (its jail, for one).
    pub async fn service_json(&self, method: &str, path: &str) -> (u16, Value) {
        let (s, b) = request(method, &self.service_url(path), vec![], &[]).await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    pub async fn json(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let (body, headers): (Vec<u8>, &[(&str, &str)]) = match body {
            Some(v) => (
                v.to_string().into_bytes(),
                &[("content-type", "application/json")],
            ),
            None => (vec![], &[]),
        };
        let (s, b) = self.req(method, path, body, headers).await;
        (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    /// Creates a small sandbox and returns its id.
    pub async fn create(&self, extra: Value) -> String {
        let mut body = small_run("run-test");
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                b.insert(k.clone(), v.clone());
            }
        }
        let (s, v) = self.json("POST", "/v1/sandboxes", Some(body)).await;
        assert_eq!(s, 201, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    /// Runs a shell command through the exec route; returns (stdout, stderr, final line).
    pub async fn exec(&self, id: &str, command: &str) -> (Vec<u8>, Vec<u8>, Value) {
        let (s, body) = self
            .req(
                "POST",
                &format!("/v1/sandboxes/{id}/exec"),
                serde_json::json!({"command": command})
                    .to_string()
                    .into_bytes(),
                &[("content-type", "application/json")],
            )
            .await;
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
        parse_ndjson(&body)
    }

    pub fn signal(&self, sig: &str) {
        Command::new("kill")
            .args(["-s", sig, &self.child.id().to_string()])
            .status()
            .unwrap();
    }

    /// Waits for the process to exit, returning its status code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            assert!(t.elapsed() < timeout, "the host did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // SIGTERM disposes of every sandbox. A SIGKILL would leave them running for a next
        // service (issue 32), which a test never starts: whatever is left in the instance's
        // cgroups after is killed.
        if matches!(self.child.try_wait(), Ok(None)) {
            self.signal("TERM");
            let t = Instant::now();
            while matches!(self.child.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(60)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in instance_pids(&self.state) {
            // SAFETY: kill has no memory arguments; the pid was read from the instance's cgroup.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        // A failed test shows what the service said about it.
        if std::thread::panicking() {
            let logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
            let tail: Vec<&String> = logs
                .iter()
                .filter(|l| !l.contains("\"level\":\"DEBUG\""))
                .rev()
                .take(40)
                .collect();
            eprintln!("the service's last log lines:");
            for l in tail.into_iter().rev() {
                eprintln!("  {l}");
            }
        }
    }
}

/// One request with the test token to `url`; the status and the whole body.
pub async fn request(
    method: &str,
    url: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (u16, Bytes) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("authorization", format!("Bearer {TOKEN}"));
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = client
        .request(b.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (status, bytes)
}

pub fn parse_ndjson(body: &[u8]) -> (Vec<u8>, Vec<u8>, Value) {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let (mut out, mut err, mut last) = (vec![], vec![], Value::Null);
    for line in body.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let v: Value = serde_json::from_slice(line).unwrap();
        if let Some(s) = v["stdout"].as_str() {
            out.extend(b64.decode(s).unwrap());
        } else if let Some(s) = v["stderr"].as_str() {
            err.extend(b64.decode(s).unwrap());
        } else {
            last = v;
        }
    }
    (out, err, last)
}

/// Pids of QEMU processes whose command line mentions `dir` (the state directory of a test).
pub fn qemu_pids_under(dir: &Path) -> Vec<u32> {
    instance_pids(dir)
        .into_iter()
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains("qemu-system")
        })
        .collect()
}

/// Every process in the cgroups of the service on state directory `dir`: its VMs' and network
/// processes'.
pub fn instance_pids(dir: &Path) -> Vec<u32> {
    // The jailed processes have no host path on their command lines: find them by their cgroup,
    // which the service names after its state directory (as `jail_instance` in serve.rs does),
    // so this finds processes that outlived the service too.
    use sha2::Digest;
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let digest = sha2::Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    let instance = format!(
        "/i-{}/vm-",
        digest[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            cgroup.contains(&instance)
        })
        .collect()
}

/// Entries in a state directory other than the lock file.
pub fn state_entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                // The service's templates stay until it stops (api_load checks what they hold).
                .filter(|n| n != ".lock" && n != "templates")
                .collect()
        })
        .unwrap_or_default()
}

/// Sends a raw HTTP/1.1 request (head as given, then `body` pieces, written by a separate thread
/// so a server that answers early is seen) and returns the response text (head and body).
pub fn raw_http(port: u16, head: &str, body: Vec<Vec<u8>>) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let mut w = s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for piece in body {
            if w.write_all(&piece).is_err() {
                return;
            }
        }
    });
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                out.extend_from_slice(&buf[..n]);
                // One response is enough: stop once its JSON body is complete.
                if out.windows(4).any(|w| w == b"\r\n\r\n") && out.ends_with(b"}") {
                    break;
                }
            }
        }
    }
    let _ = s.shutdown(std::net::Shutdown::Both);
    let _ = writer.join();
    String::from_utf8_lossy(&out).into_owned()
}

/// A CA made for the test and a server certificate for `names` signed by it (openssl), in `dir`:
/// `ca.pem`, `srv.pem`, `srv.key`.
pub fn make_certs(dir: &std::path::Path, names: &[&str]) {
    // The service reads ca.pem (SANDBOX_HOST_EGRESS_CA_FILE) as its own user.
    let_service_pass(dir);
    let run = |args: &[&str]| {
        let st = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl runs");
        assert!(st.success(), "openssl {args:?}");
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=egress test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        &format!("/CN={}", names[0]),
    ]);
    let sans: Vec<String> = names.iter().map(|n| format!("DNS:{n}")).collect();
    std::fs::write(
        dir.join("ext.cnf"),
        format!("subjectAltName={}\n", sans.join(",")),
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
}

/// A TLS server configuration (rustls on ring) with the certificate `make_certs` put in `dir`.
pub fn tls_acceptor(dir: &std::path::Path) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(dir.join("srv.pem"))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("srv.key")).unwrap();
    let cfg = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg))
}

/// Resident memory of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The pid of the `sandbox-host` process under `h` (its wrappers exec into it, or fork it last).
pub fn service_pid(h: &Host) -> u32 {
    let mut pid = h.child.id();
    for _ in 0..8 {
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() == "sandbox-host" {
            return pid;
        }
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        match children
            .split_whitespace()
            .next()
            .and_then(|c| c.parse().ok())
        {
            Some(c) => pid = c,
            None => break,
        }
    }
    pid
}

/// The resident memory of a process sampled every 50 ms while something runs: what it had
/// before, and the most it had since.
pub struct PeakRss {
    before: u64,
    peak: Arc<std::sync::atomic::AtomicU64>,
    watching: Arc<std::sync::atomic::AtomicBool>,
    sampler: std::thread::JoinHandle<()>,
}

impl PeakRss {
    /// Starts sampling `pid`.
    pub fn watch(pid: u32) -> PeakRss {
        use std::sync::atomic::Ordering::SeqCst;
        let before = rss_kib(pid);
        let peak = Arc::new(std::sync::atomic::AtomicU64::new(before));
        let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (p, w) = (peak.clone(), watching.clone());
        let sampler = std::thread::spawn(move || {
            while w.load(SeqCst) {
                p.fetch_max(rss_kib(pid), SeqCst);
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        PeakRss {
            before,
            peak,
            watching,
            sampler,
        }
    }

    /// Stops; (before, peak) in KiB.
    pub fn stop(self) -> (u64, u64) {
        use std::sync::atomic::Ordering::SeqCst;
        self.watching.store(false, SeqCst);
        let _ = self.sampler.join();
        (self.before, self.peak.load(SeqCst))
    }
}
