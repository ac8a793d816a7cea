//! Operator subcommands (`health`, `ls`, `exec`, `rm`; `shell` is `shell.rs`): talk to a running sandbox host over HTTP
//! with the token from the environment or `.env`.

use std::io::Write;
use std::process::ExitCode;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

type HttpClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

/// Where the host is and how to authenticate.
pub struct Target {
    base: String,
    token: String,
    http: HttpClient,
}

impl Target {
    /// `SANDBOX_HOST_URL`, else `http://<SANDBOX_HOST_BIND>:<SANDBOX_HOST_PORT>` (loopback when
    /// bound to every address); the token from `SANDBOX_HOST_TOKEN`.
    pub fn from_env() -> Result<Target, String> {
        crate::config::load_dotenv().map_err(|e| e.to_string())?;
        let token = std::env::var("SANDBOX_HOST_TOKEN").ok().filter(|t| !t.is_empty()).ok_or(
            "SANDBOX_HOST_TOKEN is not set; the operator commands use the same token as the sandbox host (from the environment or .env)",
        )?;
        let base = match std::env::var("SANDBOX_HOST_URL")
            .ok()
            .filter(|u| !u.is_empty())
        {
            Some(u) => u.trim_end_matches('/').to_string(),
            None => {
                let bind = std::env::var("SANDBOX_HOST_BIND")
                    .ok()
                    .filter(|b| !b.is_empty() && b != "0.0.0.0" && b != "::");
                let port = std::env::var("SANDBOX_HOST_PORT")
                    .ok()
                    .filter(|p| !p.is_empty())
                    .unwrap_or_else(|| "3004".into());
                format!(
                    "http://{}:{port}",
                    bind.unwrap_or_else(|| "127.0.0.1".into())
                )
            }
        };
        if !base.starts_with("http://") && !base.starts_with("https://") {
            return Err(format!(
                "SANDBOX_HOST_URL must be an http:// or https:// address, not `{base}`"
            ));
        }
        // https: the host's (or gateway's) certificate checked against SANDBOX_HOST_CA_FILE,
        // else the system's authorities.
        let tls = if base.starts_with("https://") {
            crate::tls::client_config().map_err(|e| e.to_string())?
        } else {
            crate::tls::no_authorities().map_err(|e| e.to_string())?
        };
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.enforce_http(false);
        let builder = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        // The name the certificate is checked against, when the URL's is not it (a probe at
        // 127.0.0.1 of a host whose certificate names its Service).
        let builder = match std::env::var(crate::tls::NAME_VAR)
            .ok()
            .filter(|n| !n.trim().is_empty())
        {
            Some(n) => {
                let name = rustls::pki_types::ServerName::try_from(n.trim().to_string()).map_err(
                    |_| {
                        format!(
                            "{} is `{n}`, which is not a DNS name or an address",
                            crate::tls::NAME_VAR
                        )
                    },
                )?;
                builder.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name))
            }
            None => builder,
        };
        let connector = builder.enable_http1().wrap_connector(connector);
        let http = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Target {
            base,
            token: token.trim().to_string(),
            http,
        })
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, String> {
        self.request_with(method, path, &[], body).await
    }

    /// A request with `headers` besides the token's (a WebSocket's handshake).
    pub(crate) async fn request_with(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Option<Value>,
    ) -> Result<hyper::Response<hyper::body::Incoming>, String> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {}", self.token));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let body = match body {
            Some(v) => {
                req = req.header("content-type", "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let req = req.body(body).map_err(|e| format!("bad request: {e}"))?;
        self.http.request(req).await.map_err(|e| {
            format!(
                "The sandbox host at {} did not answer: {}. Start it, or check SANDBOX_HOST_URL \
                 (and, over https, SANDBOX_HOST_CA_FILE and the name the certificate is issued for)",
                self.base,
                crate::gateway::causes(&e)
            )
        })
    }

    async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(StatusCode, Value), String> {
        let resp = self.request(method, path, body).await?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?
            .to_bytes();
        let v = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()))
        };
        if status == StatusCode::UNAUTHORIZED {
            return Err(
                "The sandbox host refused the token: set the same SANDBOX_HOST_TOKEN for both"
                    .into(),
            );
        }
        Ok((status, v))
    }
}

pub(crate) fn error_text(v: &Value) -> String {
    v.get("error")
        .and_then(Value::as_str)
        .map_or_else(|| v.to_string(), str::to_owned)
}

pub(crate) fn fail(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("sandbox-host: {msg}");
    ExitCode::from(1)
}

/// `sandbox-host health`: prints the health answer; exits 0 only when microVMs can start.
pub async fn health() -> ExitCode {
    let t = match Target::from_env() {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    match t.json(Method::GET, "/v1/health", None).await {
        Ok((s, v)) if s.is_success() => {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            if v["available"] == Value::Bool(true) {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Ok((_, v)) => fail(error_text(&v)),
        Err(e) => fail(e),
    }
}

/// `sandbox-host ls`: one line per sandbox.
pub async fn ls() -> ExitCode {
    let t = match Target::from_env() {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let v = match t.json(Method::GET, "/v1/sandboxes", None).await {
        Ok((s, v)) if s.is_success() => v,
        Ok((_, v)) => return fail(error_text(&v)),
        Err(e) => return fail(e),
    };
    println!(
        "{:<22} {:<24} {:<6} {:<22} {:>6} EXPIRES",
        "ID", "RUN", "STATE", "IMAGE", "EXECS"
    );
    for s in v["sandboxes"].as_array().into_iter().flatten() {
        println!(
            "{:<22} {:<24} {:<6} {:<22} {:>6} {}",
            s["id"].as_str().unwrap_or(""),
            s["run_id"].as_str().unwrap_or(""),
            s["state"].as_str().unwrap_or(""),
            s["image"].as_str().unwrap_or(""),
            s["execs"].as_u64().unwrap_or(0),
            s["expires_at"].as_str().unwrap_or("")
        );
    }
    ExitCode::SUCCESS
}

/// `sandbox-host rm ID...`.
pub async fn rm(ids: Vec<String>) -> ExitCode {
    let t = match Target::from_env() {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    let mut code = ExitCode::SUCCESS;
    for id in ids {
        match t
            .json(Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await
        {
            Ok((s, _)) if s.is_success() => println!("{id}"),
            Ok((_, v)) => code = fail(error_text(&v)),
            Err(e) => return fail(e),
        }
    }
    code
}

/// `sandbox-host exec ID -- CMD...`: streams the output and exits with the command's code.
pub async fn exec(id: String, argv: Vec<String>, timeout_ms: Option<u64>) -> ExitCode {
    let t = match Target::from_env() {
        Ok(t) => t,
        Err(e) => return fail(e),
    };
    // Without a timeout the field is left out: the API refuses `null` for it.
    let mut body = serde_json::json!({ "argv": argv });
    if let Some(t) = timeout_ms {
        body["timeout_ms"] = t.into();
    }
    let resp = match t
        .request(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(body),
        )
        .await
    {
        Ok(r) => r,
        Err(e) => return fail(e),
    };
    if !resp.status().is_success() {
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        return fail(error_text(&v));
    }
    let mut body = resp.into_body();
    let mut pending: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return fail("the exec stream broke off");
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        pending.extend_from_slice(&data);
        while let Some(nl) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=nl).collect();
            let Ok(v) = serde_json::from_slice::<Value>(&line) else {
                continue;
            };
            if let Some(s) = v["stdout"].as_str() {
                let _ = std::io::stdout().write_all(&B64.decode(s).unwrap_or_default());
                let _ = std::io::stdout().flush();
            } else if let Some(s) = v["stderr"].as_str() {
                let _ = std::io::stderr().write_all(&B64.decode(s).unwrap_or_default());
            } else if v.get("error").is_some() {
                return fail(error_text(&v));
            } else if v.get("duration_ms").is_some() {
                if v["timed_out"] == Value::Bool(true) {
                    eprintln!("sandbox-host: the command timed out and was killed");
                    return ExitCode::from(124);
                }
                if let Some(c) = v["exit_code"].as_i64() {
                    return ExitCode::from(c.clamp(0, 255) as u8);
                }
                return ExitCode::from(
                    (128 + v["signal"].as_i64().unwrap_or(0)).clamp(0, 255) as u8
                );
            }
        }
    }
    fail("the exec stream ended without an exit status")
}
