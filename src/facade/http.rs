//! Serving the facade's router over HTTP until a stop: a drain stops taking connections
//! and lets the requests in flight (streams included) finish; an abort drops them.
//!
//! A listener on a loopback address answers only requests that name a loopback host
//! (DNS rebinding: a web page of another site can make the browser on this machine send
//! requests to a loopback port under the site's own name, which the `Host` header then
//! carries) and that come from no page, or from a loopback page (`Origin`). Everything
//! served here (the OpenAI-compatible APIs, a client's proxy, the dashboard) is reached
//! from this machine by `127.0.0.1`, `[::1]` or `localhost`.
//!
//! Owns: the listener's lifetime. Never decides when to stop (the caller's [`Stop`] does).

use std::net::IpAddr;

use axum::extract::Request;
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::net::TcpListener;

use crate::base::Stop;

/// Serves `app` on `listener` until `stop`; returns once the requests in flight have
/// finished (drain) or at once (abort). On a loopback listener, requests that name
/// another host or come from another site's page are refused (module docs).
pub async fn serve_until(listener: TcpListener, app: Router, stop: Stop) -> std::io::Result<()> {
    let app = if listener.local_addr()?.ip().is_loopback() {
        app.layer(axum::middleware::from_fn(loopback_only))
    } else {
        app
    };
    let drain = stop.drain_token();
    let server = axum::serve(listener, app)
        .with_graceful_shutdown(async move { drain.cancelled_owned().await });
    tokio::select! {
        r = std::future::IntoFuture::into_future(server) => r,
        _ = stop.aborted() => Ok(()),
    }
}

/// Binds `addr` and serves `app` on it until `stop`, as a task of `tasks`: the address
/// it answers at. `what` names the service in the error logged if it fails.
pub async fn spawn_serve(
    addr: &str,
    app: Router,
    stop: Stop,
    tasks: &crate::base::stop::TaskTracker,
    what: &'static str,
) -> std::io::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tasks.spawn(async move {
        if let Err(e) = serve_until(listener, app, stop).await {
            tracing::error!("the {what} stopped: {e}");
        }
    });
    Ok(local)
}

async fn loopback_only(req: Request, next: Next) -> Response {
    match loopback_request(req.headers()) {
        Ok(()) => next.run(req).await,
        Err(why) => {
            tracing::warn!("refused an HTTP request: {why}");
            (StatusCode::FORBIDDEN, why).into_response()
        }
    }
}

/// Whether a request to a loopback listener names a loopback host and comes from no page
/// or a loopback one.
fn loopback_request(h: &HeaderMap) -> Result<(), String> {
    if let Some(host) = h.get(header::HOST) {
        let host = host.to_str().unwrap_or("?");
        if !loopback_host(host) {
            return Err(format!(
                "Host {host:?} is not a loopback name on a loopback listener (DNS rebinding protection)"
            ));
        }
    }
    if let Some(origin) = h.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("?");
        let host = origin.split_once("://").map_or("", |(_, rest)| rest);
        if !loopback_host(host.split('/').next().unwrap_or("")) {
            return Err(format!(
                "a request from the page of {origin:?} to a loopback listener (cross-site)"
            ));
        }
    }
    Ok(())
}

/// `host[:port]` names this machine: `localhost` (or a name under it), or a loopback IP.
fn loopback_host(hostport: &str) -> bool {
    let host = match hostport.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => match hostport.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => hostport,
        },
    };
    let host = host.trim_end_matches('.');
    host.eq_ignore_ascii_case("localhost")
        || host.to_ascii_lowercase().ends_with(".localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(host: Option<&str>, origin: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(v) = host {
            h.insert(header::HOST, v.parse().unwrap());
        }
        if let Some(v) = origin {
            h.insert(header::ORIGIN, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_loopback_listener_answers_loopback_names_and_pages_only() {
        for ok in [
            (Some("127.0.0.1:8000"), None),
            (Some("localhost:8000"), None),
            (Some("LOCALHOST"), None),
            (Some("[::1]:9"), None),
            (Some("127.0.0.2"), None),
            (None, None),
            (Some("127.0.0.1:8000"), Some("http://127.0.0.1:8000")),
            (Some("localhost:1"), Some("http://localhost:3000")),
        ] {
            assert!(loopback_request(&headers(ok.0, ok.1)).is_ok(), "{ok:?}");
        }
        for bad in [
            (Some("evil.example:8000"), None),
            (Some("evil.example"), None),
            (Some("10.0.0.5:8000"), None),
            (Some("localhost.evil.example"), None),
            (Some("127.0.0.1:8000"), Some("https://evil.example")),
            (Some("127.0.0.1:8000"), Some("null")),
        ] {
            assert!(loopback_request(&headers(bad.0, bad.1)).is_err(), "{bad:?}");
        }
    }
}
