//! The gateway's hosts: found (a static list, or a DNS name's addresses asked again at each
//! poll), and asked for their `/v1/health` every poll, which says each one's name, whether it
//! takes sandboxes, what it has room for, and which images it has.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::Uri;
use serde_json::Value;

use super::config::{GatewayConfig, Hosts};
use super::proxy::Client;

/// The longest a host's health answer may take, and the most of it that is read.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(3);
const HEALTH_MAX: usize = 256 << 10;

/// A sandbox host of the fleet.
pub struct Host {
    /// Its base URL.
    pub url: Uri,
    /// What its last health answer (or the failure to get one) said.
    seen: Mutex<Seen>,
}

/// What the gateway knows of a host.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Its name (configured, or from its health answer).
    pub name: Option<String>,
    /// It answered the last poll.
    pub up: bool,
    /// Why not, or why it takes no sandboxes.
    pub reason: Option<String>,
    /// It can start sandboxes (its `available`), and is not draining.
    pub takes_sandboxes: bool,
    /// Guest memory it has room for (its `capacity.memory_mib.free`).
    pub free_memory_mib: u64,
    /// Its memory limit.
    pub memory_limit_mib: u64,
    /// Its sandboxes.
    pub sandboxes: u64,
    /// The images it has.
    pub images: Vec<String>,
    /// Its guests' architecture.
    pub arch: String,
    /// Its whole health answer.
    pub health: Value,
    /// When it last answered.
    pub last_ok: Option<Instant>,
}

impl Host {
    /// What the gateway knows of it now.
    pub fn seen(&self) -> Seen {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Its name, if known.
    pub fn name(&self) -> Option<String> {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .name
            .clone()
    }

    /// Counts a sandbox placed on it until the next poll says the same.
    pub fn placed(&self, memory_mib: u64) {
        let mut s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        s.free_memory_mib = s.free_memory_mib.saturating_sub(memory_mib);
        s.sandboxes += 1;
    }

    /// Marks it draining at once (the next poll says the same).
    pub fn draining(&self) {
        let mut s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        s.takes_sandboxes = false;
        s.reason = Some("it is draining".into());
    }

    /// Marks it down after a request to it failed.
    pub fn failed(&self, why: String) {
        let mut s = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        s.up = false;
        s.takes_sandboxes = false;
        s.reason = Some(why);
    }
}

/// The hosts, as of the last poll.
pub struct Fleet {
    hosts: Mutex<Vec<Arc<Host>>>,
    source: Hosts,
    client: Client,
    host_token: String,
    /// Every poll so far (for the tests' waits and `/metrics`).
    pub polls: std::sync::atomic::AtomicU64,
    /// Polls asked for, started and done: one runner at a time, each request served by the
    /// first poll that starts after it (a burst shares one).
    rounds: Mutex<Rounds>,
    done: tokio::sync::Notify,
}

/// The generations of polls (see [`Fleet::poll_now`]).
#[derive(Default)]
struct Rounds {
    wanted: u64,
    started: u64,
    finished: u64,
    running: bool,
}

/// How long a request waits for its poll before it answers with what the last one saw.
const POLL_WAIT: Duration = Duration::from_secs(2);

impl Fleet {
    /// The fleet `config` names; nothing is asked yet.
    pub fn new(config: &GatewayConfig, client: Client) -> Arc<Fleet> {
        let hosts = match &config.hosts {
            Hosts::Static(list) => list
                .iter()
                .map(|(name, url)| {
                    Arc::new(Host {
                        url: url.clone(),
                        seen: Mutex::new(Seen {
                            name: Some(name.clone()),
                            reason: Some("not asked yet".into()),
                            ..Seen::default()
                        }),
                    })
                })
                .collect(),
            Hosts::Dns { .. } => vec![],
        };
        Arc::new(Fleet {
            hosts: Mutex::new(hosts),
            source: config.hosts.clone(),
            client,
            host_token: config.host_token.clone(),
            polls: Default::default(),
            rounds: Mutex::default(),
            done: tokio::sync::Notify::new(),
        })
    }

    /// Every host known now.
    pub fn all(&self) -> Vec<Arc<Host>> {
        self.hosts.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The host named `name`.
    pub fn by_name(&self, name: &str) -> Option<Arc<Host>> {
        self.all()
            .into_iter()
            .find(|h| h.name().as_deref() == Some(name))
    }

    /// The token the gateway sends to hosts.
    pub fn host_token(&self) -> &str {
        &self.host_token
    }

    /// The client requests to hosts go through.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Asks every host for its health every `every`, for as long as the process runs.
    pub fn watch(self: &Arc<Self>, every: Duration) {
        let fleet = self.clone();
        tokio::spawn(async move {
            loop {
                fleet.poll_now().await;
                tokio::time::sleep(every).await;
            }
        });
    }

    /// Waits (at most [`POLL_WAIT`]) for a poll that starts after this call: what it then knows
    /// is the hosts' own figures of now. Polls run one at a time, in a task of their own (a
    /// request that goes away cancels none), and the requests that come while one waits to
    /// start share it: a burst of health requests asks each host once or twice, not once each.
    pub async fn poll_now(self: &Arc<Self>) {
        let want = {
            let mut r = self.rounds.lock().unwrap_or_else(|e| e.into_inner());
            r.wanted = r.started + 1;
            let want = r.wanted;
            if !r.running {
                r.running = true;
                let fleet = self.clone();
                tokio::spawn(async move { fleet.run_polls().await });
            }
            want
        };
        let _ = tokio::time::timeout(POLL_WAIT, async {
            loop {
                let notified = self.done.notified();
                if self
                    .rounds
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .finished
                    >= want
                {
                    return;
                }
                notified.await;
            }
        })
        .await;
    }

    async fn run_polls(&self) {
        loop {
            let round = {
                let mut r = self.rounds.lock().unwrap_or_else(|e| e.into_inner());
                if r.started >= r.wanted {
                    r.running = false;
                    return;
                }
                r.started += 1;
                r.started
            };
            self.poll().await;
            self.rounds
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .finished = round;
            self.done.notify_waiters();
        }
    }

    /// One poll: the DNS name looked up again (its addresses are the hosts), then every host
    /// asked at once.
    pub async fn poll(&self) {
        if let Hosts::Dns {
            scheme,
            name,
            port,
            srv,
        } = &self.source
        {
            let urls = if *srv {
                srv_urls(scheme, name).await
            } else {
                address_urls(scheme, name, *port).await
            };
            if let Some(urls) = urls {
                self.replace(urls);
            }
        }
        let named = matches!(self.source, Hosts::Static(_));
        let mut asks = tokio::task::JoinSet::new();
        for h in self.all() {
            let (client, token) = (self.client.clone(), self.host_token.clone());
            asks.spawn(async move {
                let answer = health(&client, &h.url, &token).await;
                update(&h, answer, named);
            });
        }
        while asks.join_next().await.is_some() {}
        self.polls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The hosts become those at `urls` (a DNS server's hiccup never gets here: the fleet keeps
    /// what it had); the ones still there keep what the gateway knows of them.
    fn replace(&self, mut urls: Vec<Uri>) {
        urls.sort_by_key(|u| u.to_string());
        urls.dedup();
        let mut hosts = self.hosts.lock().unwrap_or_else(|e| e.into_inner());
        hosts.retain(|h| urls.contains(&h.url));
        for url in urls {
            if !hosts.iter().any(|h| h.url == url) {
                hosts.push(Arc::new(Host {
                    url,
                    seen: Mutex::new(Seen {
                        reason: Some("not asked yet".into()),
                        ..Seen::default()
                    }),
                }));
            }
        }
    }
}

/// The hosts at the addresses of `name`; `None` when it does not resolve now (a DNS server's
/// hiccup must not take the fleet away).
async fn address_urls(scheme: &str, name: &str, port: u16) -> Option<Vec<Uri>> {
    let Ok(Ok(addrs)) =
        tokio::time::timeout(HEALTH_TIMEOUT, tokio::net::lookup_host((name, port))).await
    else {
        tracing::warn!(
            name,
            "the hosts' DNS name did not resolve; keeping the hosts known"
        );
        return None;
    };
    let urls: Vec<Uri> = addrs
        .take(256)
        .filter_map(|a| format!("{scheme}://{a}").parse().ok())
        .collect();
    (!urls.is_empty()).then_some(urls)
}

/// The hosts the SRV records of `name` name; `None` when they cannot be had now.
async fn srv_urls(scheme: &str, name: &str) -> Option<Vec<Uri>> {
    match tokio::time::timeout(HEALTH_TIMEOUT * 2, super::srv::lookup(name)).await {
        Ok(Ok(targets)) if targets.is_empty() => {
            tracing::warn!(
                name,
                "the hosts' SRV records name no host of their zone; keeping the hosts known"
            );
            None
        }
        Ok(Ok(targets)) => Some(
            targets
                .iter()
                .filter_map(|t| format!("{scheme}://{}:{}", t.host, t.port).parse().ok())
                .collect(),
        ),
        Ok(Err(e)) => {
            tracing::warn!(
                name,
                "the hosts' SRV records could not be had ({e}); keeping the hosts known"
            );
            None
        }
        Err(_) => {
            tracing::warn!(
                name,
                "the hosts' SRV records did not come in time; keeping the hosts known"
            );
            None
        }
    }
}

/// `GET /v1/health` of the host at `url`, bounded in time and size.
async fn health(client: &Client, url: &Uri, token: &str) -> Result<Value, String> {
    let uri: Uri = format!(
        "{}://{}/v1/health",
        url.scheme_str().unwrap_or("http"),
        url.authority().map_or("", |a| a.as_str())
    )
    .parse()
    .map_err(|e| format!("{e}"))?;
    let req = hyper::Request::get(uri)
        .header("authorization", format!("Bearer {token}"))
        .body(axum::body::Body::empty())
        .map_err(|e| e.to_string())?;
    let answer = tokio::time::timeout(HEALTH_TIMEOUT, async {
        let res = client.request(req).await.map_err(|e| {
            let why = super::proxy::causes(&e);
            let hint = if why.contains("certificate") {
                "; the gateway checks it against SANDBOX_HOST_CA_FILE's authorities (else \
                     the system's) and SANDBOX_HOST_TLS_NAME (else the URL's or the DNS \
                     name)"
            } else {
                ""
            };
            format!("did not answer ({why}){hint}")
        })?;
        let status = res.status();
        let body = http_body_util::Limited::new(res.into_body(), HEALTH_MAX)
            .collect()
            .await
            .map_err(|e| format!("its health answer could not be read ({e})"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "its health answered {status} ({})",
                String::from_utf8_lossy(&body)
                    .chars()
                    .take(200)
                    .collect::<String>()
            ));
        }
        serde_json::from_slice::<Value>(&body)
            .map_err(|e| format!("its health answer is not JSON ({e})"))
    })
    .await;
    answer.unwrap_or_else(|_| Err(format!("did not answer within {HEALTH_TIMEOUT:?}")))
}

/// Records a health answer (or its failure) of `h`. A named host must say the name it was
/// given: another name is a misconfiguration, and the host gets no sandboxes (their ids would
/// lead elsewhere).
fn update(h: &Host, answer: Result<Value, String>, named: bool) {
    let mut s = h.seen.lock().unwrap_or_else(|e| e.into_inner());
    let v = match answer {
        Ok(v) => v,
        Err(why) => {
            s.up = false;
            s.takes_sandboxes = false;
            s.reason = Some(why);
            return;
        }
    };
    let said = v["name"].as_str().map(str::to_string);
    s.up = true;
    s.last_ok = Some(Instant::now());
    s.reason = None;
    match (&s.name, &said) {
        (_, None) => {
            s.reason = Some(
                "it has no SANDBOX_HOST_NAME: its sandboxes could not be found from their ids"
                    .into(),
            );
        }
        (Some(n), Some(m)) if named && n != m => {
            s.reason = Some(format!(
                "it says its name is `{m}`, and SANDBOX_HOST_GATEWAY_HOSTS names it `{n}`"
            ));
        }
        _ => s.name = said,
    }
    let available = v["available"].as_bool() == Some(true);
    let draining = v["draining"].as_bool() == Some(true);
    if s.reason.is_none() && !available {
        s.reason = Some(format!(
            "it cannot start sandboxes: {}",
            v["reason"].as_str().unwrap_or("unknown")
        ));
    }
    if s.reason.is_none() && draining {
        s.reason = Some("it is draining".into());
    }
    s.takes_sandboxes = s.reason.is_none();
    let mem = &v["capacity"]["memory_mib"];
    s.free_memory_mib = mem["free"].as_u64().unwrap_or(0);
    s.memory_limit_mib = mem["limit"].as_u64().unwrap_or(0);
    s.sandboxes = v["sandboxes"].as_u64().unwrap_or(0);
    s.images = v["images"]
        .as_array()
        .map(|a| {
            a.iter()
                .take(256)
                .filter_map(|i| i.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    s.arch = v["arch"].as_str().unwrap_or_default().to_string();
    s.health = v;
}
