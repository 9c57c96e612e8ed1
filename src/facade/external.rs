//! External models: a model that is not trained, served by any OpenAI-compatible endpoint
//! (`--external-model NAME=URL[#REMOTE]` on a client). The client's proxy forwards an
//! agent's calls of that model there as they are (streaming included), and records each
//! call (request, response, status, time) under the episode named by the bearer token. The
//! records go to the run directory; nothing of them is submitted or trained on.
//!
//! HTTP/1.1 over TCP, or TLS (rustls; the webpki roots plus `SSL_CERT_FILE` or the
//! system's CA bundle) for `https://`; one connection per call. The endpoint's API key comes from the environment (see [`ExternalModel::parse`]),
//! never from the command line, and is never recorded.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode, Uri};
use axum::response::Response;
use bytes::Bytes;
use futures_util::Stream;
use http_body_util::{BodyStream, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

use crate::base::lock;
use crate::base::stop::TaskTracker;

/// The most bytes of one response kept in its record (the agent gets all of it).
pub const MAX_RECORDED_BYTES: usize = 256 << 10;
/// The most external calls recorded per episode (later ones are forwarded, not recorded).
pub const MAX_RECORDED_CALLS: usize = 256;
/// Time to connect (and finish TLS) to an external endpoint.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// One external model of a client.
#[derive(Clone)]
pub struct ExternalModel {
    /// The name agents call it by.
    pub name: String,
    /// The endpoint's base URL, as OpenAI SDKs take it (`http://host:port/v1`).
    pub base_url: String,
    /// The model name sent to the endpoint (`#REMOTE`; default: `name`).
    pub remote_model: String,
    api_key: Option<String>,
    https: bool,
    host: String,
    port: u16,
    path: String,
}

impl std::fmt::Debug for ExternalModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalModel")
            .field("name", &self.name)
            .field("base_url", &self.base_url)
            .field("remote_model", &self.remote_model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// Why an external model cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExternalError {
    /// A `--external-model` argument that is not `NAME=URL[#REMOTE]`.
    #[error("{spec:?}: {problem}")]
    Spec { spec: String, problem: String },
    #[error("{0}")]
    Connect(String),
    #[error("{0}")]
    Tls(String),
    /// The request or its answer failed after the connection was made.
    #[error("{0}")]
    Http(String),
}

/// The environment variable holding the API key of external model `name`:
/// `AGENTJET_EXTERNAL_KEY_<NAME>` (upper case, other characters as `_`).
pub fn key_var(name: &str) -> String {
    let n: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("AGENTJET_EXTERNAL_KEY_{n}")
}

impl ExternalModel {
    /// Parses `NAME=URL` or `NAME=URL#REMOTE_MODEL`. The API key (sent as a bearer token)
    /// comes from `env(key_var(NAME))`, else `env("AGENTJET_EXTERNAL_KEY")`, else none.
    pub fn parse(spec: &str, env: impl Fn(&str) -> Option<String>) -> Result<Self, ExternalError> {
        let bad = |problem: String| ExternalError::Spec {
            spec: spec.to_string(),
            problem,
        };
        let (name, rest) = spec
            .split_once('=')
            .ok_or_else(|| bad("expected NAME=URL (e.g. judge=http://127.0.0.1:8000/v1)".into()))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(bad("the model name is empty".into()));
        }
        let (url, remote) = match rest.split_once('#') {
            Some((u, r)) if !r.trim().is_empty() => (u, r.trim().to_string()),
            Some(_) => return Err(bad("nothing after '#' (the remote model name)".into())),
            None => (rest, name.to_string()),
        };
        if !(url.trim().starts_with("http://") || url.trim().starts_with("https://")) {
            return Err(bad("the URL must start with http:// or https://".into()));
        }
        let uri: Uri = url
            .trim()
            .parse()
            .map_err(|e| bad(format!("{url:?} is not a URL: {e}")))?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(bad("the URL must start with http:// or https://".into())),
        };
        let host = uri
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| bad("the URL has no host".into()))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        if uri.query().is_some() {
            return Err(bad("the URL must not have a query".into()));
        }
        let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
        let path = uri.path().trim_end_matches('/').to_string();
        let api_key = env(&key_var(name))
            .or_else(|| env("AGENTJET_EXTERNAL_KEY"))
            .filter(|k| !k.is_empty());
        Ok(ExternalModel {
            name: name.to_string(),
            base_url: url.trim().trim_end_matches('/').to_string(),
            remote_model: remote,
            api_key,
            https,
            host,
            port,
            path,
        })
    }

    fn authority(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        match (self.https, self.port) {
            (true, 443) | (false, 80) => host,
            _ => format!("{host}:{}", self.port),
        }
    }
}

/// One recorded call of an external model.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ExternalCall {
    pub model: String,
    pub url: String,
    /// The request as the agent sent it.
    pub request: Value,
    /// The endpoint's HTTP status (0 when it was not reached).
    pub status: u16,
    /// The response body (a JSON object, or the server-sent events as text when streamed).
    pub response: Value,
    /// The response was longer than [`MAX_RECORDED_BYTES`] and is cut in the record.
    pub truncated: bool,
    /// Why the call failed, when it did (not reached, or cut off mid-stream).
    pub error: Option<String>,
    pub seconds: f64,
}

impl ExternalCall {
    /// The text the model answered (the first choice), for transcripts.
    pub fn completion_text(&self) -> String {
        let from_choice = |c: &Value| -> String {
            c.pointer("/message/content")
                .or_else(|| c.pointer("/delta/content"))
                .or_else(|| c.get("text"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        match &self.response {
            Value::String(sse) => sse
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
                .filter_map(|v| v.pointer("/choices/0").map(from_choice))
                .collect(),
            v => v.pointer("/choices/0").map(from_choice).unwrap_or_default(),
        }
    }
}

/// The external calls of each episode, until its runner takes them.
#[derive(Default)]
pub struct ExternalLog {
    /// Per episode: the recorded calls, and how many more were not recorded.
    calls: Mutex<HashMap<String, (Vec<ExternalCall>, usize)>>,
}

impl ExternalLog {
    fn push(&self, episode: &str, call: ExternalCall) {
        let mut m = lock(&self.calls);
        // Bounded like the tracker: episodes nobody collects are forgotten.
        if m.len() >= 4096 && !m.contains_key(episode) {
            m.clear();
        }
        let (calls, unrecorded) = m.entry(episode.to_string()).or_default();
        if calls.len() < MAX_RECORDED_CALLS {
            calls.push(call);
        } else {
            *unrecorded += 1;
        }
    }
    /// The episode's calls so far, leaving them in place.
    pub fn peek(&self, episode: &str) -> Vec<ExternalCall> {
        lock(&self.calls)
            .get(episode)
            .map(|(c, _)| c.clone())
            .unwrap_or_default()
    }
    /// The episode's calls, forgetting them.
    pub fn take(&self, episode: &str) -> Vec<ExternalCall> {
        let (calls, unrecorded) = lock(&self.calls).remove(episode).unwrap_or_default();
        if unrecorded > 0 {
            tracing::warn!(
                episode,
                "{unrecorded} external calls past the first {MAX_RECORDED_CALLS} were not recorded"
            );
        }
        calls
    }
}

/// Why a forward failed before the endpoint answered: (HTTP status for the agent, message).
pub type ForwardError = (StatusCode, String);

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}

/// Where Linux distributions keep the system's CA bundle.
const SYSTEM_BUNDLES: [&str; 3] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
];

/// TLS roots: the webpki (Mozilla) roots, plus the PEM bundle in `SSL_CERT_FILE`, or else
/// the system's bundle (so a site's own CA works as it does for curl). Built once.
fn tls_config() -> Result<Arc<rustls::ClientConfig>, ExternalError> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    static CFG: std::sync::OnceLock<Result<Arc<rustls::ClientConfig>, ExternalError>> =
        std::sync::OnceLock::new();
    CFG.get_or_init(|| {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        let bundle = match std::env::var("SSL_CERT_FILE") {
            Ok(f) if !f.is_empty() => Some(f),
            _ => SYSTEM_BUNDLES
                .iter()
                .find(|p| std::path::Path::new(p).exists())
                .map(|p| p.to_string()),
        };
        if let Some(file) = bundle {
            let certs = CertificateDer::pem_file_iter(&file)
                .map_err(|e| ExternalError::Tls(format!("reading the CA bundle {file}: {e}")))?;
            let (added, _) = roots.add_parsable_certificates(certs.filter_map(Result::ok));
            tracing::debug!("{added} CA certificates from {file}");
        }
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ExternalError::Tls(format!("TLS setup: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Arc::new(cfg))
    })
    .clone()
}

async fn connect(m: &ExternalModel) -> Result<Box<dyn Io>, ExternalError> {
    let tcp = tokio::net::TcpStream::connect((m.host.as_str(), m.port))
        .await
        .map_err(|e| {
            ExternalError::Connect(format!("cannot connect to {}:{}: {e}", m.host, m.port))
        })?;
    let _ = tcp.set_nodelay(true);
    if !m.https {
        return Ok(Box::new(tcp));
    }
    let cfg = tls_config()?;
    let name = rustls::pki_types::ServerName::try_from(m.host.clone())
        .map_err(|e| ExternalError::Tls(format!("{:?} is not a TLS server name: {e}", m.host)))?;
    let tls = tokio_rustls::TlsConnector::from(cfg)
        .connect(name, tcp)
        .await
        .map_err(|e| ExternalError::Tls(format!("TLS with {}: {e}", m.host)))?;
    Ok(Box::new(tls))
}

/// A JSON POST of `payload` to `m`'s `path`, with its host, agent and API key.
fn json_post(
    m: &ExternalModel,
    path: &str,
    accept: &str,
    payload: Vec<u8>,
) -> Result<Request<Full<Bytes>>, axum::http::Error> {
    let mut req = Request::post(format!("{}/{path}", m.path))
        .header(header::HOST, m.authority())
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::ACCEPT, accept)
        .header(
            header::USER_AGENT,
            concat!("agentjet/", env!("CARGO_PKG_VERSION")),
        );
    if let Some(k) = &m.api_key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    req.body(Full::new(Bytes::from(payload)))
}

/// The most bytes of an answer [`post_json`] reads.
pub const MAX_ANSWER_BYTES: usize = 8 << 20;

/// Posts one JSON request (not streamed) to `m`'s `path` (`chat/completions`, ...), its
/// `model` set to `m`'s remote model, and returns the answer's HTTP status and JSON body;
/// everything within `timeout`. For a program of ours that calls a model itself (a
/// study's researcher), where [`forward`] passes an agent's call through.
pub async fn post_json(
    m: &ExternalModel,
    path: &str,
    body: &Value,
    timeout: Duration,
) -> Result<(u16, Value), ExternalError> {
    use http_body_util::BodyExt as _;
    let url = format!("{}/{path}", m.base_url);
    let call = async {
        let io = tokio::time::timeout(CONNECT_TIMEOUT, connect(m))
            .await
            .map_err(|_| {
                ExternalError::Connect(format!(
                    "{url}: no connection within {} s",
                    CONNECT_TIMEOUT.as_secs()
                ))
            })??;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| ExternalError::Http(format!("{url}: HTTP handshake: {e}")))?;
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut sent = body.clone();
        if let Some(o) = sent.as_object_mut() {
            o.insert("model".into(), Value::String(m.remote_model.clone()));
        }
        let payload = serde_json::to_vec(&sent).map_err(|e| ExternalError::Http(e.to_string()))?;
        let req = json_post(m, path, "application/json", payload)
            .map_err(|e| ExternalError::Http(format!("{url}: building the request: {e}")))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| ExternalError::Http(format!("{url}: sending the request: {e}")))?;
        let status = resp.status().as_u16();
        let bytes = http_body_util::Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| ExternalError::Http(format!("{url}: reading the answer: {e}")))?
            .to_bytes();
        conn.abort();
        let v = serde_json::from_slice(&bytes).map_err(|e| {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
            ExternalError::Http(format!(
                "{url}: HTTP {status}, the answer is not JSON ({e}): {text}"
            ))
        })?;
        Ok((status, v))
    };
    tokio::time::timeout(timeout, call).await.map_err(|_| {
        ExternalError::Http(format!(
            "{url}: no answer within {:.0} s",
            timeout.as_secs_f64()
        ))
    })?
}

/// Forwards one call (`path`: `chat/completions` or `completions`) to `m` and streams the
/// answer back; the call is recorded under `episode` (when given) once its answer has
/// been read to the end, or the agent went away.
pub async fn forward(
    m: &ExternalModel,
    path: &str,
    body: &Bytes,
    episode: Option<String>,
    log: Arc<ExternalLog>,
    tasks: &TaskTracker,
) -> Result<Response, ForwardError> {
    let t0 = Instant::now();
    let request: Value = serde_json::from_slice(body)
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("invalid JSON body: {e}")))?;
    let mut sent = request.clone();
    if let Some(o) = sent.as_object_mut() {
        o.insert("model".into(), Value::String(m.remote_model.clone()));
    }
    let url = format!("{}/{path}", m.base_url);
    let record = |status: u16, response: Value, truncated: bool, error: Option<String>| {
        if let Some(ep) = &episode {
            log.push(
                ep,
                ExternalCall {
                    model: m.name.clone(),
                    url: url.clone(),
                    request: request.clone(),
                    status,
                    response,
                    truncated,
                    error,
                    seconds: t0.elapsed().as_secs_f64(),
                },
            );
        }
    };
    let fail = |msg: String| {
        let msg = format!("external model '{}' at {url}: {msg}", m.name);
        record(0, Value::Null, false, Some(msg.clone()));
        (StatusCode::BAD_GATEWAY, msg)
    };
    let io = match tokio::time::timeout(CONNECT_TIMEOUT, connect(m)).await {
        Ok(Ok(io)) => io,
        Ok(Err(e)) => return Err(fail(e.to_string())),
        Err(_) => {
            return Err(fail(format!(
                "no connection within {} s",
                CONNECT_TIMEOUT.as_secs()
            )))
        }
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| fail(format!("HTTP handshake: {e}")))?;
    tasks.spawn(async move {
        let _ = conn.await;
    });
    let payload = serde_json::to_vec(&sent).map_err(|e| fail(e.to_string()))?;
    let req = json_post(m, path, "application/json, text/event-stream", payload)
        .map_err(|e| fail(format!("building the request: {e}")))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| fail(format!("sending the request: {e}")))?;
    let status = resp.status();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    let streamed = content_type
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let tee = Tee {
        inner: BodyStream::new(resp.into_body()),
        kept: Vec::new(),
        truncated: false,
        error: None,
        done: false,
        finish: Some(Box::new({
            let (name, url, request, episode, log) = (
                m.name.clone(),
                url.clone(),
                request.clone(),
                episode.clone(),
                log.clone(),
            );
            move |kept: Vec<u8>, truncated: bool, error: Option<String>| {
                let Some(ep) = episode else { return };
                let text = String::from_utf8_lossy(&kept).into_owned();
                let response = if streamed || truncated {
                    Value::String(text)
                } else {
                    serde_json::from_str(&text).unwrap_or(Value::String(text))
                };
                log.push(
                    &ep,
                    ExternalCall {
                        model: name,
                        url,
                        request,
                        status: status.as_u16(),
                        response,
                        truncated,
                        error,
                        seconds: t0.elapsed().as_secs_f64(),
                    },
                );
            }
        })),
    };
    let mut out = Response::builder().status(status);
    if let Some(ct) = content_type {
        out = out.header(header::CONTENT_TYPE, ct);
    }
    out.body(Body::from_stream(tee))
        .map_err(|e| (StatusCode::BAD_GATEWAY, e.to_string()))
}

type Finish = Box<dyn FnOnce(Vec<u8>, bool, Option<String>) + Send>;

/// The endpoint's body on its way to the agent, kept (up to a bound) for the record,
/// which is written when the body ends, fails, or is dropped (the agent went away).
struct Tee {
    inner: BodyStream<hyper::body::Incoming>,
    kept: Vec<u8>,
    truncated: bool,
    error: Option<String>,
    done: bool,
    finish: Option<Finish>,
}

impl Tee {
    fn finish(&mut self) {
        if let Some(f) = self.finish.take() {
            if !self.done && self.error.is_none() {
                self.error = Some("the agent stopped reading before the end".into());
            }
            f(
                std::mem::take(&mut self.kept),
                self.truncated,
                self.error.take(),
            );
        }
    }
}

impl Stream for Tee {
    type Item = Result<Bytes, std::io::Error>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            match Pin::new(&mut self.inner).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.done = true;
                    self.finish();
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    let msg = format!("the endpoint's answer broke off: {e}");
                    self.error = Some(msg.clone());
                    self.done = true;
                    self.finish();
                    return Poll::Ready(Some(Err(std::io::Error::other(msg))));
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers
                    };
                    let room = MAX_RECORDED_BYTES.saturating_sub(self.kept.len());
                    if data.len() > room {
                        self.truncated = true;
                    }
                    let n = data.len().min(room);
                    self.kept.extend_from_slice(&data[..n]);
                    return Poll::Ready(Some(Ok(data)));
                }
            }
        }
    }
}

impl Drop for Tee {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The `/v1/models` entry of an external model.
pub fn model_entry(m: &ExternalModel) -> Value {
    json!({"id": m.name, "object": "model", "created": 0, "owned_by": "external",
           "agentjet": {"external": true, "url": m.base_url, "remote_model": m.remote_model}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn specs_parse_with_their_defaults_and_bad_ones_say_why() {
        let m = ExternalModel::parse("judge=http://127.0.0.1:8000/v1/", no_env).unwrap();
        assert_eq!(m.name, "judge");
        assert_eq!(m.remote_model, "judge");
        assert_eq!(m.base_url, "http://127.0.0.1:8000/v1");
        assert_eq!(
            (m.host.as_str(), m.port, m.path.as_str()),
            ("127.0.0.1", 8000, "/v1")
        );
        assert_eq!(m.authority(), "127.0.0.1:8000");
        let m = ExternalModel::parse("j=https://api.example.org/v1#gpt-4o-mini", |k| {
            (k == "AGENTJET_EXTERNAL_KEY_J").then(|| "sk-1".to_string())
        })
        .unwrap();
        assert_eq!(
            (m.port, m.https, m.remote_model.as_str()),
            (443, true, "gpt-4o-mini")
        );
        assert_eq!(m.authority(), "api.example.org");
        assert_eq!(m.api_key.as_deref(), Some("sk-1"));
        assert!(
            !format!("{m:?}").contains("sk-1"),
            "the key is never printed"
        );
        let m = ExternalModel::parse("my-judge=http://[::1]:9/v1", |k| {
            (k == "AGENTJET_EXTERNAL_KEY").then(|| "shared".to_string())
        })
        .unwrap();
        assert_eq!(
            (m.host.as_str(), m.authority().as_str()),
            ("::1", "[::1]:9")
        );
        assert_eq!(m.api_key.as_deref(), Some("shared"));
        assert_eq!(key_var("my-judge"), "AGENTJET_EXTERNAL_KEY_MY_JUDGE");
        for (bad, why) in [
            ("judge", "expected NAME=URL"),
            ("=http://x/v1", "name is empty"),
            ("j=ftp://x/v1", "http:// or https://"),
            ("j=x/v1", "http:// or https://"),
            ("j=http://x/v1#", "nothing after '#'"),
            ("j=http://x/v1?a=1", "query"),
        ] {
            let e = ExternalModel::parse(bad, no_env).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn transcripts_read_plain_and_streamed_answers() {
        let call = |response: Value| ExternalCall {
            model: "j".into(),
            url: String::new(),
            request: Value::Null,
            status: 200,
            response,
            truncated: false,
            error: None,
            seconds: 0.0,
        };
        let plain = call(json!({"choices": [{"message": {"content": "yes"}}]}));
        assert_eq!(plain.completion_text(), "yes");
        let sse = call(Value::String(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n\
             data: {\"choices\":[{\"delta\":{\"content\":\"ye\"}}]}\n\n\
             data: {\"choices\":[{\"delta\":{\"content\":\"s\"}}]}\n\ndata: [DONE]\n\n"
                .into(),
        ));
        assert_eq!(sse.completion_text(), "yes");
        let text = call(json!({"choices": [{"text": "42"}]}));
        assert_eq!(text.completion_text(), "42");
    }
}
