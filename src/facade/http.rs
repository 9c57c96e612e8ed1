//! Serving the facade's router over HTTP until a stop: a drain stops taking connections
//! and lets the requests in flight (streams included) finish; an abort drops them.
//!
//! Owns: the listener's lifetime. Never decides when to stop (the caller's [`Stop`] does).

use axum::Router;
use tokio::net::TcpListener;

use crate::base::Stop;

/// Serves `app` on `listener` until `stop`; returns once the requests in flight have
/// finished (drain) or at once (abort).
pub async fn serve_until(listener: TcpListener, app: Router, stop: Stop) -> std::io::Result<()> {
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
