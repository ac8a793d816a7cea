//! The network process's channel (issue 32): the service starts `sandbox-net` with one sandbox's
//! egress settings, its secrets among them, and from then on only asks it for a [`Report`] (its
//! counters, refusals and metered calls) and tells it to stop. The frames of the guest never come
//! this way: the VM process and the network process share a socket the service only hands over.
//!
//! The network process parses guest traffic, so once the guest may have taken it over it is as
//! hostile as the guest: the service reads this channel with a bound on each line
//! ([`MAX_REPORT`]) into the typed messages below, and a report that does not parse is an error
//! of that sandbox, never of the service. Everything a report holds is bounded by the process's
//! own bounds (events, calls) and checked again by [`Report::check`].
//!
//! The process has no network of its own (an empty network namespace): each upstream connection
//! it needs it asks the service for on a second socket, the dialer, which comes attached to
//! [`Request::Start`]. The service checks the name against the sandbox's allowlist and every
//! address it resolves to against the ranges no sandbox may reach, connects, and passes the
//! connected socket back ([`Dial`], [`Dialed`]). A process taken over by its guest can reach no
//! more than its guest may: never the host's loopback, a metadata service or the local network.
//!
//! The service may end (a crash, an upgrade) while its sandboxes run on. A network process that
//! was given a listening socket ([`ADOPT_FD`]) outlives it: when its channel ends it keeps moving
//! the guest's frames and waits there for the service to come back. The service's next run
//! connects, asks [`Request::Adopt`] with a new dialer's socket attached, and is answered
//! [`Event::Adopted`] with the sandbox's [`NetConfig::token`]: the process is the one the service
//! started for that sandbox (the service keeps the token with the sandbox's state). From then on
//! that connection is the channel, as the first one was:
//!
//! ```text
//! service                                   sandbox-net
//!    -- Start(NetConfig) + dialer (fd 0) -->
//!    <------------ Started / Refused -------
//!    -- Report | Counts | Relink + frames -->
//!    <------- Report | Relinked ------------
//!    ... the service ends: the channel's end (the dialer's too) ...
//!                                           frames still move; dials fail at once;
//!                                           accept on ADOPT_FD
//!    -- connect(ADOPT_FD's path) ---------->
//!    -- Adopt + new dialer ---------------->  (first line, within ADOPT_WITHIN)
//!    <------- Adopted { version, token } ---
//!    -- Report | Counts | Relink | Stop ---->  (as before; its end: wait again)
//! ```

use serde::{Deserialize, Serialize};

/// The channel's version: a `sandbox-net` built from another tree is not spoken to.
pub const VERSION: u32 = 3;

/// The descriptor of `sandbox-net` that, when the service passes one, is a listening Unix
/// socket: the process waits there for the service to come back after its channel ends, and is
/// adopted ([`Request::Adopt`]). Without one the process ends with its channel. (It is waited on
/// blocking: one left non-blocking is polled, ten times a second.)
pub const ADOPT_FD: std::os::fd::RawFd = 3;
/// How long a connection to the adoption socket may take to send its first line
/// ([`Request::Adopt`]): one that says nothing cannot keep the process from the next.
pub const ADOPT_WITHIN: std::time::Duration = std::time::Duration::from_secs(3);
/// The longest first line read on the adoption socket (an adoption is a dozen bytes).
pub const MAX_ADOPT_LINE: usize = 1024;
/// The longest token ([`NetConfig::token`]): 32 random bytes, in hex.
pub const MAX_TOKEN: usize = 64;

/// The longest line the service reads from a network process: a report with every metered call
/// it keeps ([`MAX_CALLS`] of them, each under 2 KiB as JSON).
pub const MAX_REPORT: usize = 24 << 20;
/// The most metered calls a report lists (the totals count every call).
pub const MAX_CALLS: usize = 10_000;
/// The most refusal events a report lists.
pub const MAX_EVENTS: usize = 256;
/// The longest CA certificate a start's answer carries (one certificate is about 1 KiB).
pub const MAX_PEM: usize = 16 * 1024;
/// The most variables a start's answer gives the guest (a placeholder per secret, the CA's
/// paths).
pub const MAX_VARS: usize = 256;
/// The longest reason a refused start gives.
pub const MAX_MESSAGE: usize = 4096;
/// The longest answer to [`Request::Counts`] the service reads (a report without its lists).
pub const MAX_COUNTS: usize = 64 * 1024;
/// The most labels a count by label lists (the service's own lists are shorter).
pub const MAX_LABELS: usize = 64;
/// The most server-side tools a call lists.
pub const MAX_TOOLS: usize = 16;
/// The longest string a report holds in bytes (a target, a host, a model name: the egress keeps
/// at most 256 characters of what a provider says, up to four bytes each).
pub const MAX_STRING: usize = 1024;

/// A sandbox's egress, as the create request set it (the service validated it) and as the host
/// configures it.
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetConfig {
    /// The channel's version ([`VERSION`]) the service speaks.
    pub version: u32,
    /// The sandbox's id: it names the sandbox's CA.
    pub sandbox: String,
    /// The guest's MAC address.
    pub mac: [u8; 6],
    /// Host patterns the guest may reach.
    pub allow: Vec<String>,
    /// Host patterns whose model calls are metered.
    pub meter: Vec<String>,
    /// Whether every allowed TLS name is intercepted (`intercept: "all"`).
    pub intercept_all: bool,
    /// Whether a metered call whose usage cannot be read is refused.
    pub meter_strict: bool,
    /// The largest request body the meter reads.
    pub meter_body_max: u64,
    /// The secrets, each with where its value may go.
    pub secrets: Vec<SecretConfig>,
    /// The memory the stack's buffers may hold.
    pub memory_bytes: u64,
    /// `SANDBOX_HOST_EGRESS_RESOLVE`, as the operator wrote it (empty: none).
    pub resolve: String,
    /// The CA bundle upstream certificates are checked against (`SANDBOX_HOST_EGRESS_CA_FILE`,
    /// read by the service: the network process opens no file); `None`: the system's roots.
    pub upstream_ca_pem: Option<String>,
    /// The sandbox's secret of adoption, which the service made for it ([`MAX_TOKEN`] bytes at
    /// most): the process answers [`Request::Adopt`] with it, so a service that came back knows
    /// the process on the other end is the one it started for that sandbox. The guest may learn
    /// it by taking the process over, and gains nothing by it; it is kept out of logs all the
    /// same. Missing from a service of an older version, whose settings are then refused for
    /// their version, not for a field.
    #[serde(default, deserialize_with = "bounded::text::<_, MAX_TOKEN>")]
    pub token: String,
}

impl std::fmt::Debug for NetConfig {
    /// Never the token, nor (through [`SecretConfig`]'s) a secret's value: a debug print of a
    /// config lands in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetConfig")
            .field("version", &self.version)
            .field("sandbox", &self.sandbox)
            .field("mac", &self.mac)
            .field("allow", &self.allow)
            .field("meter", &self.meter)
            .field("intercept_all", &self.intercept_all)
            .field("meter_strict", &self.meter_strict)
            .field("meter_body_max", &self.meter_body_max)
            .field("secrets", &self.secrets)
            .field("memory_bytes", &self.memory_bytes)
            .field("resolve", &self.resolve)
            .field("upstream_ca_pem", &self.upstream_ca_pem)
            .finish_non_exhaustive()
    }
}

/// The longest line on the dialer's socket, either way (a name is at most 253 bytes; an error
/// says a little more).
pub const MAX_DIAL_LINE: usize = 2048;

/// From the network process to the service, on the dialer's socket: connect to `port` of `name`
/// for the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dial {
    /// Names the answer ([`Dialed`]): answers come in the order connections are made, not asked.
    pub id: u64,
    /// The name as the guest asked for it (the service checks it against the allowlist again).
    pub name: String,
    /// The port.
    pub port: u16,
}

/// From the service to the network process, on the dialer's socket: the answer to [`Dial`]
/// `id`. A connected answer carries the socket (`SCM_RIGHTS`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Dialed {
    /// The request's.
    pub id: u64,
    /// What came of it.
    pub result: DialResult,
}

/// What came of a [`Dial`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DialResult {
    /// Connected to `addr`; the socket is attached.
    Connected {
        /// The address connected to.
        addr: std::net::SocketAddr,
    },
    /// The name did not resolve.
    Resolve {
        /// What the resolver said.
        message: String,
    },
    /// The name resolves to an address no sandbox may reach.
    Internal {
        /// That address.
        addr: std::net::SocketAddr,
        /// Its range's label (`loopback`, `link_local`, …).
        why: String,
    },
    /// No address accepted the connection.
    Connect {
        /// The last error.
        message: String,
    },
    /// The sandbox may not reach this name or port: only a network process that no longer
    /// follows its own allowlist asks for one.
    NotAllowed,
    /// More connections are being made for the sandbox at once than the service makes.
    Busy,
}

/// One secret of [`NetConfig`].
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretConfig {
    /// The variable the guest sees its placeholder in.
    pub env: String,
    /// The real value.
    pub value: String,
    /// The hosts it may go to.
    pub hosts: Vec<String>,
    /// The headers it may go in (`None`: the provider's usual ones).
    pub headers: Option<Vec<String>>,
    /// The paths it may go to.
    pub paths: Option<Vec<String>>,
    /// Whether it may go anywhere in a request to its hosts.
    pub wildcard: bool,
}

impl Drop for SecretConfig {
    /// The value is overwritten wherever a copy of the settings ends, on every path (a start
    /// that failed, a create cancelled by its client going away).
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.value);
    }
}

impl std::fmt::Debug for SecretConfig {
    /// Never the value: a debug print of a config lands in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretConfig")
            .field("env", &self.env)
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

/// From the service to the network process: on descriptor 0 first, on a connection to the
/// adoption socket ([`ADOPT_FD`]) after the service came back. Each request has one answer, sent
/// before the next request is read.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Start the sandbox's egress (the first message on descriptor 0, once), with the dialer's
    /// socket attached; the answer is [`Event::Started`] or [`Event::Refused`].
    Start(NetConfig),
    /// Take this connection as the channel (the first message on a connection to the adoption
    /// socket, within [`ADOPT_WITHIN`], and only there), with a new dialer's socket attached:
    /// the process's upstream connections are made over it from now on. The answer is
    /// [`Event::Adopted`]; the service sends nothing more before it has read it. A first message
    /// of anything else, or an adoption without its socket, gets no answer: the connection is
    /// closed, and the process waits for the next. Anywhere else an adoption is an error that
    /// ends the process, as a second start is.
    Adopt,
    /// Answer with [`Event::Report`].
    Report,
    /// Answer with [`Event::Report`] without its lists (no refusal events, no calls): the counts
    /// `/metrics` reads of every sandbox on each scrape.
    Counts,
    /// The guest's frames come on the attached socket from now on (a resumed VM's: each VM
    /// process of a sandbox gets a socket pair of its own, so the service keeps no end of one);
    /// the answer is [`Event::Relinked`].
    Relink,
    /// Stop: the process ends. (The channel's end, without it, ends the process too when it has
    /// no adoption socket; with one, it waits there.)
    Stop,
}

/// From the network process to the service.
#[derive(Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// The egress runs.
    Started {
        /// The sandbox CA's certificate, when it intercepts anything (the guest must trust it).
        #[serde(deserialize_with = "bounded::opt_text::<_, MAX_PEM>")]
        ca_pem: Option<String>,
        /// Variables every command of the sandbox gets (each secret's placeholder, where the CA
        /// is).
        #[serde(deserialize_with = "bounded::vars::<_, MAX_VARS>")]
        env: Vec<(String, String)>,
    },
    /// The egress could not start.
    Refused {
        /// Whether the request's settings were at fault (a 400), not the host (a 500).
        bad_request: bool,
        /// Why, for a person.
        #[serde(deserialize_with = "bounded::text::<_, MAX_MESSAGE>")]
        message: String,
    },
    /// What the egress has done so far.
    Report(Box<Report>),
    /// The frames now come on the socket [`Request::Relink`] carried.
    Relinked,
    /// The answer to [`Request::Adopt`]: this connection is the channel now, and the dials go
    /// over the socket the adoption carried.
    Adopted {
        /// The channel's version ([`VERSION`]) the process speaks: a service of another (an
        /// upgrade that changed this channel) does not take it on, as a start of another version
        /// is refused.
        version: u32,
        /// The [`NetConfig::token`] the process was started with: the service checks it against
        /// the sandbox's own before it takes the process for that sandbox's.
        #[serde(deserialize_with = "bounded::text::<_, MAX_TOKEN>")]
        token: String,
    },
}

impl std::fmt::Debug for Event {
    /// Never an adoption's token: a debug print of an unexpected answer lands in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Started { ca_pem, env } => f
                .debug_struct("Started")
                .field("ca_pem", ca_pem)
                .field("env", env)
                .finish(),
            Event::Refused {
                bad_request,
                message,
            } => f
                .debug_struct("Refused")
                .field("bad_request", bad_request)
                .field("message", message)
                .finish(),
            Event::Report(r) => f.debug_tuple("Report").field(r).finish(),
            Event::Relinked => f.write_str("Relinked"),
            Event::Adopted { .. } => f.debug_struct("Adopted").finish_non_exhaustive(),
        }
    }
}

/// What one sandbox's egress has done: `GET /v1/sandboxes/{id}/egress` and `…/usage`, and the
/// sandbox's lines of `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// Refusals by reason label, every reason the process knows (zeros included).
    #[serde(deserialize_with = "bounded::counts::<_, MAX_LABELS>")]
    pub refusals: Vec<(String, u64)>,
    /// The most recent refusals, oldest first.
    #[serde(deserialize_with = "bounded::list::<_, _, MAX_EVENTS>")]
    pub events: Vec<Refusal>,
    /// Refusals let go from `events`.
    pub events_dropped: u64,
    /// Connections open now.
    pub open: u64,
    /// Connections, ever.
    pub connections: u64,
    /// Of which spliced (TLS passed through unread).
    pub spliced: u64,
    /// Of which intercepted.
    pub intercepted: u64,
    /// Of which plain HTTP.
    pub http: u64,
    /// Upstreams that could not be reached.
    pub upstream_failures: u64,
    /// Bytes to upstreams.
    pub to_upstream: u64,
    /// Bytes to the guest.
    pub to_guest: u64,
    /// Frames dropped from the guest (a full stack).
    pub frames_dropped_from_guest: u64,
    /// Frames dropped to the guest (a full link).
    pub frames_dropped_to_guest: u64,
    /// Bytes the stack's buffers hold now, and may hold.
    pub memory_held: u64,
    /// The bound of `memory_held`.
    pub memory_limit: u64,
    /// The metered calls.
    pub usage: Usage,
}

/// One refused request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Refusal {
    /// When, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Why (a reason label).
    #[serde(deserialize_with = "bounded::string")]
    pub reason: String,
    /// What the guest asked for.
    #[serde(deserialize_with = "bounded::string")]
    pub target: String,
}

/// The metered calls of a sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Usage {
    /// The most recent calls, oldest first.
    #[serde(deserialize_with = "bounded::list::<_, _, MAX_CALLS>")]
    pub calls: Vec<Call>,
    /// Calls let go from `calls`.
    pub calls_dropped: u64,
    /// Calls, ever.
    pub total_calls: u64,
    /// Sums over every call.
    pub input_tokens: u64,
    /// Output tokens, over every call.
    pub output_tokens: u64,
    /// Cache reads, over every call.
    pub cache_read_tokens: u64,
    /// Cache writes, over every call.
    pub cache_write_tokens: u64,
    /// Billed cost in USD, when any call reported one.
    pub billed_cost_usd: Option<f64>,
    /// Calls whose usage could not be read, by reason label (every reason, zeros included).
    #[serde(deserialize_with = "bounded::counts::<_, MAX_LABELS>")]
    pub unmetered: Vec<(String, u64)>,
}

/// One metered response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Call {
    /// When its body ended, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// The host that answered.
    #[serde(deserialize_with = "bounded::string")]
    pub host: String,
    /// Its HTTP status.
    pub status: u16,
    /// Whether the body ended normally.
    pub complete: bool,
    /// Why a successful call's usage could not be read (a label).
    #[serde(deserialize_with = "bounded::opt_string")]
    pub unmetered: Option<String>,
    /// The usage it reported, if it did.
    pub usage: Option<CallUsage>,
}

/// What a metered response reported.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallUsage {
    /// `anthropic`, `openai`, `openrouter` or `google`.
    #[serde(deserialize_with = "bounded::string")]
    pub provider: String,
    /// Whether the output tokens are the host's own lower bound.
    pub estimated: bool,
    /// The provider's response id.
    #[serde(deserialize_with = "bounded::opt_string")]
    pub response_id: Option<String>,
    /// The model that answered.
    #[serde(deserialize_with = "bounded::opt_string")]
    pub model: Option<String>,
    /// Input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Cache reads.
    pub cache_read_tokens: u64,
    /// Cache writes.
    pub cache_write_tokens: u64,
    /// The billed cost, when reported.
    pub cost: Option<f64>,
    /// The service tier.
    #[serde(deserialize_with = "bounded::opt_string")]
    pub service_tier: Option<String>,
    /// Server-side tools run, each with its count.
    #[serde(deserialize_with = "bounded::counts::<_, MAX_TOOLS>")]
    pub server_tool_use: Vec<(String, u64)>,
    /// Cache writes of five minutes.
    pub cache_write_5m_tokens: Option<u64>,
    /// Cache writes of an hour.
    pub cache_write_1h_tokens: Option<u64>,
    /// Audio tokens of the input.
    pub input_audio_tokens: Option<u64>,
    /// Audio tokens of the output.
    pub output_audio_tokens: Option<u64>,
    /// Image tokens of the input.
    pub input_image_tokens: Option<u64>,
    /// Image tokens of the output.
    pub output_image_tokens: Option<u64>,
    /// Reasoning tokens.
    pub reasoning_tokens: Option<u64>,
}

/// Why a report was refused.
#[derive(Debug, thiserror::Error)]
#[error("the network process's report {0}")]
pub struct ReportError(String);

impl Report {
    /// Checks what parsing cannot: the bounds on lists and strings, and that each label is one of
    /// `reasons` or `unmetered` (the service's own lists), so a report from a network process
    /// taken over by its guest can say wrong numbers about its own sandbox, but nothing the
    /// service or its readers could take for something else.
    pub fn check(&self, reasons: &[&str], unmetered: &[&str]) -> Result<(), ReportError> {
        let fail = |what: String| Err(ReportError(what));
        if self.events.len() > MAX_EVENTS {
            return fail(format!("lists {} refusals", self.events.len()));
        }
        if self.usage.calls.len() > MAX_CALLS {
            return fail(format!("lists {} calls", self.usage.calls.len()));
        }
        let labels = |list: &[(String, u64)], known: &[&str], what: &str| {
            if list.len() > known.len() || list.iter().any(|(l, _)| !known.contains(&l.as_str())) {
                return Err(ReportError(format!("has an unknown {what}")));
            }
            Ok(())
        };
        labels(&self.refusals, reasons, "refusal reason")?;
        labels(&self.usage.unmetered, unmetered, "unmetered reason")?;
        let mut strings = self
            .events
            .iter()
            .flat_map(|e| [&e.reason, &e.target])
            .chain(self.usage.calls.iter().flat_map(|c| {
                [Some(&c.host), c.unmetered.as_ref()]
                    .into_iter()
                    .flatten()
                    .chain(c.usage.iter().flat_map(|u| {
                        [Some(&u.provider), u.response_id.as_ref(), u.model.as_ref()]
                            .into_iter()
                            .flatten()
                            .chain(u.service_tier.as_ref())
                            .chain(u.server_tool_use.iter().map(|(k, _)| k))
                    }))
            }));
        if strings.any(|s| s.len() > MAX_STRING) {
            return fail(format!("has a string longer than {MAX_STRING} bytes"));
        }
        if self
            .events
            .iter()
            .any(|e| !reasons.contains(&e.reason.as_str()))
            || self.usage.calls.iter().any(|c| {
                c.unmetered
                    .as_deref()
                    .is_some_and(|u| !unmetered.contains(&u))
                    || c.usage
                        .as_ref()
                        .is_some_and(|u| u.server_tool_use.len() > MAX_TOOLS)
            })
        {
            return fail("has an unknown label".into());
        }
        Ok(())
    }
}

/// Deserializers that refuse a list or a string over its bound while the report is parsed,
/// before anything is allocated for it: a report line of [`MAX_REPORT`] bytes from a network
/// process taken over by its guest cannot become more memory in the service than its own length.
mod bounded {
    use std::marker::PhantomData;

    use serde::de::{Deserialize, Deserializer, Error, SeqAccess, Visitor};

    use super::MAX_STRING;

    /// A string of at most [`MAX_STRING`] bytes.
    pub(super) struct Str(pub(super) String);

    impl<'de> Deserialize<'de> for Str {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Str, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Str;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    write!(f, "a string of at most {MAX_STRING} bytes")
                }
                fn visit_str<E: Error>(self, v: &str) -> Result<Str, E> {
                    if v.len() > MAX_STRING {
                        return Err(E::custom(format!(
                            "a string longer than {MAX_STRING} bytes"
                        )));
                    }
                    Ok(Str(v.to_string()))
                }
            }
            d.deserialize_str(V)
        }
    }

    /// A list of at most `N` items.
    pub(super) fn list<'de, D, T, const N: usize>(d: D) -> Result<Vec<T>, D::Error>
    where
        D: Deserializer<'de>,
        T: Deserialize<'de>,
    {
        struct V<T, const N: usize>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>, const N: usize> Visitor<'de> for V<T, N> {
            type Value = Vec<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "a list of at most {N} items")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
                let mut v = Vec::new();
                while let Some(x) = seq.next_element()? {
                    if v.len() == N {
                        return Err(A::Error::custom(format!("a list longer than {N} items")));
                    }
                    v.push(x);
                }
                Ok(v)
            }
        }
        d.deserialize_seq(V::<T, N>(PhantomData))
    }

    /// A string of at most [`MAX_STRING`] bytes.
    pub(super) fn string<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
        Ok(Str::deserialize(d)?.0)
    }

    /// An optional string of at most [`MAX_STRING`] bytes.
    pub(super) fn opt_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
        Ok(Option::<Str>::deserialize(d)?.map(|s| s.0))
    }

    /// A string of at most `N` bytes.
    pub(super) struct Text<const N: usize>(pub(super) String);

    impl<'de, const N: usize> Deserialize<'de> for Text<N> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Text<N>, D::Error> {
            struct V<const N: usize>;
            impl<const N: usize> Visitor<'_> for V<N> {
                type Value = Text<N>;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    write!(f, "a string of at most {N} bytes")
                }
                fn visit_str<E: Error>(self, v: &str) -> Result<Text<N>, E> {
                    if v.len() > N {
                        return Err(E::custom(format!("a string longer than {N} bytes")));
                    }
                    Ok(Text(v.to_string()))
                }
            }
            d.deserialize_str(V::<N>)
        }
    }

    /// A string of at most `N` bytes.
    pub(super) fn text<'de, D: Deserializer<'de>, const N: usize>(
        d: D,
    ) -> Result<String, D::Error> {
        Ok(Text::<N>::deserialize(d)?.0)
    }

    /// An optional string of at most `N` bytes.
    pub(super) fn opt_text<'de, D: Deserializer<'de>, const N: usize>(
        d: D,
    ) -> Result<Option<String>, D::Error> {
        Ok(Option::<Text<N>>::deserialize(d)?.map(|s| s.0))
    }

    /// Variables: at most `N`, each name and value at most [`MAX_STRING`] bytes.
    pub(super) fn vars<'de, D, const N: usize>(d: D) -> Result<Vec<(String, String)>, D::Error>
    where
        D: Deserializer<'de>,
    {
        Ok(list::<D, (Str, Str), N>(d)?
            .into_iter()
            .map(|(k, v)| (k.0, v.0))
            .collect())
    }

    /// Counts by label: at most `N`, each label at most [`MAX_STRING`] bytes.
    pub(super) fn counts<'de, D, const N: usize>(d: D) -> Result<Vec<(String, u64)>, D::Error>
    where
        D: Deserializer<'de>,
    {
        Ok(list::<D, (Str, u64), N>(d)?
            .into_iter()
            .map(|(l, n)| (l.0, n))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_outside_its_bounds_is_refused() {
        let reasons = ["udp", "not_allowed"];
        let unmetered = ["no_usage"];
        let mut r = Report {
            refusals: vec![("udp".into(), 3)],
            events: vec![Refusal {
                at_ms: 1,
                reason: "udp".into(),
                target: "10.0.0.1:53".into(),
            }],
            ..Default::default()
        };
        r.check(&reasons, &unmetered).expect("a good report");
        let line = serde_json::to_string(&r).unwrap();
        let back: Report = serde_json::from_str(&line).unwrap();
        assert_eq!(back, r);
        // An unknown field is no report.
        let extra = line.replacen('{', "{\"admin\":true,", 1);
        assert!(serde_json::from_str::<Report>(&extra).is_err());
        let mut bad = r.clone();
        bad.refusals.push(("root".into(), 1));
        assert!(bad.check(&reasons, &unmetered).is_err(), "unknown reason");
        let mut bad = r.clone();
        bad.events[0].target = "x".repeat(MAX_STRING + 1);
        assert!(bad.check(&reasons, &unmetered).is_err(), "long string");
        let mut bad = r.clone();
        bad.events = vec![bad.events[0].clone(); MAX_EVENTS + 1];
        assert!(bad.check(&reasons, &unmetered).is_err(), "too many events");
        r.usage.calls.push(Call {
            unmetered: Some("made_up".into()),
            ..Default::default()
        });
        assert!(r.check(&reasons, &unmetered).is_err(), "unknown unmetered");
    }

    #[test]
    fn a_report_over_its_bounds_is_refused_while_it_is_parsed() {
        let parse = |r: &Report| serde_json::from_str::<Report>(&serde_json::to_string(r)?);
        let event = Refusal {
            at_ms: 1,
            reason: "udp".into(),
            target: "x".into(),
        };
        let ok = Report {
            events: vec![event.clone(); MAX_EVENTS],
            refusals: vec![("udp".into(), 1); MAX_LABELS],
            ..Default::default()
        };
        assert_eq!(parse(&ok).unwrap(), ok, "at the bounds");
        let cases: Vec<(Report, &str)> = vec![
            (
                Report {
                    events: vec![event.clone(); MAX_EVENTS + 1],
                    ..Default::default()
                },
                "a list longer than 256",
            ),
            (
                Report {
                    refusals: vec![("udp".into(), 1); MAX_LABELS + 1],
                    ..Default::default()
                },
                "a list longer than 64",
            ),
            (
                Report {
                    refusals: vec![("u".repeat(MAX_STRING + 1), 1)],
                    ..Default::default()
                },
                "a string longer than",
            ),
            (
                Report {
                    events: vec![Refusal {
                        target: "\\u{e9}".repeat(MAX_STRING),
                        ..event.clone()
                    }],
                    ..Default::default()
                },
                "a string longer than",
            ),
            (
                Report {
                    usage: Usage {
                        calls: vec![Call::default(); MAX_CALLS + 1],
                        ..Default::default()
                    },
                    ..Default::default()
                },
                "a list longer than 10000",
            ),
            (
                Report {
                    usage: Usage {
                        calls: vec![Call {
                            usage: Some(CallUsage {
                                model: Some("m".repeat(MAX_STRING + 1)),
                                ..Default::default()
                            }),
                            ..Default::default()
                        }],
                        ..Default::default()
                    },
                    ..Default::default()
                },
                "a string longer than",
            ),
        ];
        for (r, says) in cases {
            let e = parse(&r).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }

    fn config(token: &str) -> NetConfig {
        NetConfig {
            version: VERSION,
            sandbox: "s".into(),
            mac: [2, 0, 0, 0, 0, 1],
            allow: vec![],
            meter: vec![],
            intercept_all: false,
            meter_strict: false,
            meter_body_max: 1,
            secrets: vec![],
            memory_bytes: 1,
            resolve: String::new(),
            upstream_ca_pem: None,
            token: token.into(),
        }
    }

    /// The token is bounded where it is read, on either side, and printed nowhere.
    #[test]
    fn a_token_is_bounded_and_never_in_a_debug_print() {
        let token = "ab".repeat(MAX_TOKEN / 2);
        let line = serde_json::to_string(&Request::Start(config(&token))).unwrap();
        match serde_json::from_str::<Request>(&line).unwrap() {
            Request::Start(c) => assert_eq!(c.token, token),
            other => panic!("{other:?}"),
        }
        let long = serde_json::to_string(&Request::Start(config(&format!("{token}0")))).unwrap();
        let e = serde_json::from_str::<Request>(&long).unwrap_err();
        assert!(e.to_string().contains("longer than"), "{e}");
        let adopted = Event::Adopted {
            version: VERSION,
            token: token.clone(),
        };
        let line = serde_json::to_string(&adopted).unwrap();
        assert!(matches!(
            serde_json::from_str::<Event>(&line).unwrap(),
            Event::Adopted { token: t, .. } if t == token
        ));
        let long = line.replace(&token, &format!("{token}0"));
        assert!(serde_json::from_str::<Event>(&long).is_err());
        for print in [
            format!("{:?}", config(&token)),
            format!("{:?}", Request::Start(config(&token))),
            format!("{adopted:?}"),
        ] {
            assert!(!print.contains(&token), "{print}");
        }
        // An older service's settings have no token: they parse, and are refused for their
        // version.
        let old = serde_json::to_string(&config(""))
            .unwrap()
            .replace(",\"token\":\"\"", "");
        assert!(!old.contains("token"), "{old}");
        assert!(
            serde_json::from_str::<NetConfig>(&old)
                .unwrap()
                .token
                .is_empty()
        );
        assert_eq!(serde_json::to_string(&Request::Adopt).unwrap(), "\"adopt\"");
    }

    #[test]
    fn a_secret_is_never_in_a_debug_print() {
        let s = SecretConfig {
            env: "KEY".into(),
            value: "sk-real".into(),
            hosts: vec!["api.test".into()],
            headers: None,
            paths: None,
            wildcard: false,
        };
        assert!(!format!("{s:?}").contains("sk-real"));
    }
}
