//! One request of the guest through the proxy, as steps a reviewer reads in order: check its
//! target, rewrite its credentials, plan its metering (reading its body where the meter must),
//! build the upstream request, forward it, and scan and meter the answer. Each step gives the
//! next what it needs, or stops the request: a refusal (counted once) or a bad gateway.

use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Request, Response};

use super::bodies::{MeteredBody, Pending, ProxyBody, ScannedBody, content_encoded, mask_headers};
use super::credentials::contains;
use super::pool::Sender;
use super::{Proxy, bad_gateway, refuse};
use crate::echo::EchoScanner;
use crate::idle::Idle;
use crate::memory::{self, Hold};
use crate::meter::record::Meter;
use crate::meter::request::{self as meter_request, Api, Unmetered};
use crate::policy::normalize;
use crate::refusal::Reason;
use crate::request_body::{self, BodyError, GuestBody, Read, Replay};
use crate::secrets::LeakScanner;
use crate::sniff::http::HOP;
use crate::sniff::http::split_authority;

/// Why a request goes no further.
enum Stop {
    /// Refused for this reason: counted among the sandbox's refusals, and answered with it.
    Refuse(Reason),
    /// Refused for a reason the request body's scanner has counted already.
    Counted(Reason),
    /// The upstream side failed: a 502 saying this.
    BadGateway(String),
}

/// What metering a request gets, decided from its method, its path and the sandbox's hosts.
struct Plan {
    /// A model call: recorded from the moment it goes upstream.
    call: bool,
    /// Recorded only if its answer reports usage (a request to no known model API on a host that
    /// is only a secret's).
    quiet: bool,
    /// The model API its path names.
    api: Option<Api>,
    /// It asks the server to take it for another method.
    overridden: bool,
}

/// What the meter did to a model call's request.
#[derive(Debug, Default)]
struct Asked {
    /// Why its usage cannot be read, known before it goes upstream.
    unmetered: Option<Unmetered>,
    /// Its body's share of the sandbox's budget, while it is held.
    hold: Option<Hold>,
}

/// Headers that ask a server to take a request for another method than its own.
const METHOD_OVERRIDES: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

impl Proxy {
    /// One request of the guest, answered: by the upstream, or by a refusal or a 502 here.
    pub(super) async fn handle(&self, req: Request<Incoming>) -> Response<ProxyBody> {
        let target = format!("{}:{}", self.name, self.port);
        match self.steps(req, &target).await {
            Ok(r) => r,
            Err(Stop::Refuse(why)) => {
                self.cx.stats.refuse(why, &target);
                refuse(why)
            }
            Err(Stop::Counted(why)) => refuse(why),
            Err(Stop::BadGateway(why)) => bad_gateway(&why),
        }
    }

    async fn steps(
        &self,
        req: Request<Incoming>,
        target: &str,
    ) -> Result<Response<ProxyBody>, Stop> {
        self.check_target(&req)?;
        // The request's worst case, held until its response has gone (or it failed).
        let memory = Hold::take(&self.cx.memory, memory::REQUEST_COST)
            .ok_or(Stop::Refuse(Reason::MemoryLimit))?;
        let (parts, body) = req.into_parts();
        let body = Idle::new(body, self.cx.body_idle_timeout, "the guest's request body");
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string();
        let mut headers = self.rewrite_credentials(&parts, &path, target)?;
        let plan = self.plan_metering(&parts.method, &path, &mut headers);
        let (body, asked) = self
            .read_for_meter(&plan, &mut headers, body, &path, target)
            .await?;
        let up = self.upstream_request(parts.method, &path, headers, body, target);
        let sender = self.sender().await.map_err(|e| match e {
            None => Stop::Refuse(Reason::MemoryLimit),
            Some(e) => {
                self.cx.log.log(|| tracing::warn!("egress: {target}: {e}"));
                Stop::BadGateway(e)
            }
        })?;
        // From here the provider may bill: the call is recorded even if the guest goes away (this
        // future dropped) or the connection fails before an answer.
        let mut pending = plan.call.then(|| Pending {
            stats: self.cx.stats.clone(),
            host: self.name.clone(),
            status: 0,
            missing: asked.unmetered,
            meter: None,
            quiet: plan.quiet,
            done: false,
        });
        let resp = self.forward(sender, up, target, &mut pending).await?;
        drop(asked.hold);
        self.answer(resp, pending, memory, target)
    }

    /// The request may go to this connection's host and nowhere else: no CONNECT, its authority
    /// (HTTP/2) or Host (HTTP/1) the connection's name and port, given once, no upgrade to
    /// another protocol.
    fn check_target(&self, req: &Request<Incoming>) -> Result<(), Stop> {
        if req.method() == hyper::Method::CONNECT {
            return Err(Stop::Refuse(Reason::HttpConnect));
        }
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_string())
            .or_else(|| {
                req.headers()
                    .get(header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_string)
            });
        let ok = authority
            .as_deref()
            .and_then(split_authority)
            .is_some_and(|(h, p)| {
                normalize(h).as_deref() == Some(self.name.as_str())
                    && p.is_none_or(|p| p == self.port)
            });
        if !ok || req.headers().get_all(header::HOST).iter().count() > 1 {
            return Err(Stop::Refuse(Reason::SniHostMismatch));
        }
        if req.headers().contains_key(header::UPGRADE) {
            return Err(Stop::Refuse(Reason::Protocol));
        }
        Ok(())
    }

    /// The headers that go upstream: hop-by-hop ones dropped, and each placeholder replaced by
    /// the real value in its secret's credential headers to its own hosts and paths; a leak
    /// anywhere else (another header, so a provider cannot be made to echo the key, or the
    /// request's target), refused on a path the secret is not for.
    fn rewrite_credentials(
        &self,
        parts: &hyper::http::request::Parts,
        path: &str,
        target: &str,
    ) -> Result<HeaderMap, Stop> {
        // A placeholder in a header given more than once is a leak: an upstream that joins the
        // values (`junk, sk-...`) and quotes the result cut short would show where the guest
        // chose how much of the key (issue 29, review).
        let repeated = parts.headers.keys().any(|k| {
            let values = parts.headers.get_all(k);
            values.iter().nth(1).is_some()
                && values.iter().any(|v| {
                    self.secrets()
                        .iter()
                        .any(|s| contains(v.as_bytes(), s.placeholder.as_bytes()))
                })
        });
        if repeated {
            return Err(Stop::Refuse(Reason::PlaceholderLeak));
        }
        // The endpoint a key is judged for: its method, or none that a rule names when the
        // request asks the server to take it for another.
        let method = if METHOD_OVERRIDES
            .iter()
            .any(|h| parts.headers.contains_key(*h))
        {
            ""
        } else {
            parts.method.as_str()
        };
        let route = (method, path);
        let mut headers = HeaderMap::new();
        let secret_host = self.tls && self.secrets().iter().any(|s| s.applies_to(&self.name));
        for (k, v) in &parts.headers {
            if HOP.contains(&k.as_str()) || k == header::HOST {
                continue;
            }
            // A range of an echo could cut a key where the guest likes: whole bodies only.
            if secret_host && (k == header::RANGE || k == header::IF_RANGE) {
                continue;
            }
            let v = if k == header::AUTHORIZATION || k == header::PROXY_AUTHORIZATION {
                self.substitute_basic(k.as_str(), v, route)
                    .map_err(Stop::Refuse)?
            } else {
                v.clone()
            };
            match self.substitute(k.as_str(), &v, super::credentials::Shape::Header, route) {
                Ok(v) => {
                    headers.append(k.clone(), v);
                }
                Err(why) => {
                    if why == Reason::PathNotAllowed {
                        let shown: String = path
                            .split('?')
                            .next()
                            .unwrap_or("")
                            .chars()
                            .take(128)
                            .collect();
                        self.cx.log.log(|| {
                            tracing::info!(
                                "egress: {target}: a secret's key refused on {shown}: not among its paths"
                            )
                        });
                    }
                    return Err(Stop::Refuse(why));
                }
            }
        }
        // A target is never a credential: a placeholder there is a leak, to any host.
        if self.secrets().iter().any(|s| path.contains(&s.placeholder)) {
            return Err(Stop::Refuse(Reason::PlaceholderLeak));
        }
        Ok(headers)
    }

    /// Whether the request is a model call the meter records, and whether its answer must come
    /// readable (then it asks for no compression).
    fn plan_metering(&self, method: &hyper::Method, path: &str, headers: &mut HeaderMap) -> Plan {
        // A known model provider that is a secret's host is metered whether or not the run
        // named it in `meter` (issue 29, item 6).
        let meter_host = self.icp.as_ref().is_some_and(|i| {
            i.meter.iter().any(|p| p.matches(&self.name))
                || (crate::secrets::provider_paths(&self.name).is_some()
                    && i.secrets.iter().any(|s| s.applies_to(&self.name)))
        });
        let metered = meter_host
            || self
                .icp
                .as_ref()
                .is_some_and(|i| i.secrets.iter().any(|s| s.applies_to(&self.name)));
        // Every response of a sandbox with secrets is scanned for them (`answer`): none may come
        // compressed, where the scan cannot read it.
        let scanned = self.icp.as_ref().is_some_and(|i| i.echo.is_some());
        if metered || scanned {
            // Responses the meter and the scan can read.
            headers.insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
        }
        // A model call is any request to a meter or secret host that may do something (not
        // GET, HEAD or OPTIONS, which bill nothing: a GET of a stored response would count its
        // tokens twice; unless it asks the server to take it for another method). Token
        // counting bills nothing. On a host that is only a secret's, a request to no known
        // model API (a git push to a token's host) is recorded only if its answer reports
        // usage: it is neither unmeterable nor refused.
        let api = Api::of(path);
        let overridden = METHOD_OVERRIDES.iter().any(|h| headers.contains_key(*h));
        let acts = overridden
            || !matches!(
                *method,
                hyper::Method::GET | hyper::Method::HEAD | hyper::Method::OPTIONS
            );
        Plan {
            call: metered && acts && api != Some(Api::Count),
            quiet: !meter_host && api.is_none(),
            api,
            overridden,
        }
    }

    /// The request's body, read where the meter must see it (a model call's), and refused under
    /// `meter_strict` when its usage cannot be read.
    async fn read_for_meter(
        &self,
        plan: &Plan,
        headers: &mut HeaderMap,
        body: GuestBody,
        path: &str,
        target: &str,
    ) -> Result<(Replay, Asked), Stop> {
        let (body, asked) = if plan.call && !plan.quiet {
            self.ask_for_usage(plan.api, plan.overridden, headers, body)
                .await
                .map_err(|e| Stop::BadGateway(format!("reading the request to {target}: {e}")))?
        } else {
            (Replay::unread(body), Asked::default())
        };
        if let Some(why) = asked.unmetered
            && self.icp.as_ref().is_some_and(|i| i.policy.strict)
        {
            self.cx.log.log(|| {
                tracing::info!(
                    "egress: {target}{path}: refused under meter_strict: {}",
                    why.as_str()
                )
            });
            return Err(Stop::Refuse(Reason::Unmeterable));
        }
        Ok((body, asked))
    }

    /// Prepares a model call's request: its body read where the meter must see it, and
    /// `stream_options.include_usage` set where the provider would not report usage otherwise.
    async fn ask_for_usage(
        &self,
        api: Option<Api>,
        overridden: bool,
        headers: &mut HeaderMap,
        body: GuestBody,
    ) -> Result<(Replay, Asked), BodyError> {
        let unread = |body, why| {
            Ok((
                Replay::unread(body),
                Asked {
                    unmetered: why,
                    hold: None,
                },
            ))
        };
        let (Some(icp), Some(api), false) = (self.icp.as_ref(), api, overridden) else {
            return unread(body, Some(Unmetered::UnknownRequest));
        };
        if !api.reads_body() {
            return unread(body, None);
        }
        if content_encoded(headers) {
            return unread(body, Some(Unmetered::UnreadableBody));
        }
        let hold = Hold::new(&self.cx.memory);
        let (body, hold, unmetered) =
            match request_body::read(body, icp.policy.body_max, hold).await? {
                (Read::TooLarge(replay), hold) => (replay, hold, Some(Unmetered::BodyTooLarge)),
                (Read::Whole(data, trailers), hold) => {
                    let (data, hold, prepared) = prepare_off_loop(api, data, hold).await;
                    match prepared {
                        Ok(None) => (Replay::new(data, trailers, None), hold, None),
                        Ok(Some(new)) => {
                            // hyper gives the new length from the body, which it knows exactly.
                            headers.remove(header::CONTENT_LENGTH);
                            (Replay::new(new, trailers, None), hold, None)
                        }
                        Err(why) => (Replay::new(data, trailers, None), hold, Some(why)),
                    }
                }
            };
        Ok((
            body,
            Asked {
                unmetered,
                hold: Some(hold),
            },
        ))
    }

    /// The request as it goes upstream: to the connection's name (the `Host` the upstream
    /// expects), its body scanned for placeholders that do not belong to this host.
    fn upstream_request(
        &self,
        method: hyper::Method,
        path: &str,
        mut headers: HeaderMap,
        body: Replay,
        target: &str,
    ) -> Request<ProxyBody> {
        let leaks = if self.tls {
            LeakScanner::new(self.secrets(), &self.name)
        } else {
            LeakScanner::new(self.secrets(), "") // in cleartext every placeholder is a leak
        };
        let default_port = if self.tls { 443 } else { 80 };
        let host = if self.port == default_port {
            self.name.clone()
        } else {
            target.to_string()
        };
        headers.insert(
            header::HOST,
            HeaderValue::from_str(&host).unwrap_or(HeaderValue::from_static("invalid")),
        );
        let body = ScannedBody {
            inner: body,
            scanner: leaks,
            placeholders: self
                .secrets()
                .iter()
                .map(|s| s.placeholder.clone())
                .collect(),
            stats: self.cx.stats.clone(),
            target: target.to_string(),
        }
        .boxed();
        let mut up = Request::new(body);
        *up.method_mut() = method;
        *up.uri_mut() = path.parse().unwrap_or_else(|_| "/".parse().expect("valid"));
        *up.headers_mut() = headers;
        up
    }

    /// Sends the request on `sender`, which goes back to the pool once its response has been
    /// read to the end.
    async fn forward(
        &self,
        mut sender: Sender,
        up: Request<ProxyBody>,
        target: &str,
        pending: &mut Option<Pending>,
    ) -> Result<Response<Incoming>, Stop> {
        let resp = match sender.send.send_request(up).await {
            Ok(r) => r,
            Err(e) => {
                // A leak found in the body aborts the request (the scanner counted it).
                if self
                    .cx
                    .stats
                    .refusals()
                    .events()
                    .0
                    .last()
                    .is_some_and(|ev| ev.reason == Reason::PlaceholderLeak && ev.target == target)
                    && e.to_string().contains("placeholder")
                {
                    // Cut before its body ended: not a call the provider runs.
                    if let Some(p) = pending.as_mut() {
                        p.done = true;
                    }
                    return Err(Stop::Counted(Reason::PlaceholderLeak));
                }
                return Err(Stop::BadGateway(format!(
                    "the request to {target} failed: {e}"
                )));
            }
        };
        // The connection is free again once this response's body has been read to its end
        // (hyper's `ready`): the task that waits for that puts it back and wakes one waiter, so
        // a request waiting for a connection is woken by the release, never by a timer (issue
        // 29, item 7). A connection that closes instead (a body the guest abandoned) is dropped;
        // its places in the bounds come back with its connection task.
        let (pool, returned) = (self.pool.clone(), self.returned.clone());
        tokio::spawn(async move {
            let mut sender = sender;
            if sender.send.ready().await.is_ok() {
                pool.lock().await.push(sender);
                returned.notify_one();
            }
        });
        Ok(resp)
    }

    /// The upstream's answer on its way to the guest: hop-by-hop headers and the reason phrase
    /// dropped, secret values masked in its headers and body, its usage read by the meter as it
    /// passes; a compressed body the scan cannot read does not pass at all.
    fn answer(
        &self,
        resp: Response<Incoming>,
        mut pending: Option<Pending>,
        memory: Hold,
        target: &str,
    ) -> Result<Response<ProxyBody>, Stop> {
        let (mut parts, body) = resp.into_parts();
        // Read before the hop-by-hop headers go: `Transfer-Encoding: gzip, chunked` compresses
        // the body under hyper's de-chunking just as `Content-Encoding` does.
        let encoded = content_encoded(&parts.headers);
        for h in HOP {
            parts.headers.remove(h);
        }
        // The upstream's own reason phrase would be written back to an HTTP/1.1 guest as it is,
        // unscanned ("401 invalid key sk-..."): the guest gets the standard one.
        parts.extensions.remove::<hyper::ext::ReasonPhrase>();
        let echo = self.icp.as_ref().and_then(|i| i.echo.clone());
        // Asked for identity (every host is, in a sandbox with secrets), a host that compresses
        // anyway sends bytes the scan cannot read: they do not reach the guest (issue 29: on any
        // scanned host, a `Transfer-Encoding` other than chunked as a `Content-Encoding`).
        if let Some(p) = pending.as_mut() {
            p.status = parts.status.as_u16();
        }
        if echo.is_some() && encoded {
            self.cx.log.log(|| {
                tracing::warn!(
                    "egress: {target} answered with a compressed body although asked for identity"
                )
            });
            // It was billed all the same: `pending` records it as it goes.
            if let Some(p) = pending.as_mut() {
                p.missing.get_or_insert(Unmetered::EncodedResponse);
            }
            return Err(Stop::BadGateway(format!(
                "{target} sent a compressed response although asked not to; it cannot be checked for secrets"
            )));
        }
        if let Some(forms) = &echo {
            let echoed = mask_headers(forms, &mut parts.headers);
            for _ in 0..echoed {
                self.cx.stats.refuse(Reason::SecretEcho, target);
            }
        }
        if let Some(p) = pending.as_mut() {
            p.meter = if encoded {
                None
            } else {
                parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(Meter::for_content_type)
            };
            // What to say if the response reports no usage.
            p.missing.get_or_insert(if encoded {
                Unmetered::EncodedResponse
            } else if p.meter.is_none() {
                Unmetered::UnknownResponse
            } else {
                Unmetered::NoUsage
            });
        }
        // The upstream's own pace counts, not the guest's: a body whose bytes the scan holds back
        // (no barrier yet) still arrives, and is not cut as idle.
        let body = MeteredBody {
            inner: Idle::new(body, self.cx.idle_timeout, "the upstream's response body"),
            call: pending,
            echo: echo.map(EchoScanner::new),
            next: None,
            trailers: None,
            target: target.to_string(),
            stats: self.cx.stats.clone(),
            _memory: memory,
        }
        .boxed();
        Ok(Response::from_parts(parts, body))
    }
}

/// [`meter_request::prepare`], on a blocking thread for a body large enough to keep the
/// runtime's thread from every other connection for long (a 32 MiB body takes tens of ms).
/// The body and its share of the budget go along, so that a guest that goes away meanwhile does
/// not free the budget while the bytes are still held.
async fn prepare_off_loop(
    api: Api,
    data: Vec<u8>,
    hold: Hold,
) -> (Vec<u8>, Hold, Result<Option<Vec<u8>>, Unmetered>) {
    const INLINE: usize = 256 << 10;
    if data.len() <= INLINE {
        let r = meter_request::prepare(api, &data);
        return (data, hold, r);
    }
    let budget = hold.budget();
    tokio::task::spawn_blocking(move || {
        let r = meter_request::prepare(api, &data);
        (data, hold, r)
    })
    .await
    .unwrap_or_else(|_| {
        (
            Vec::new(),
            Hold::new(&budget),
            Err(Unmetered::UnreadableBody),
        )
    })
}
