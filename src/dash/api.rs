//! The dashboard's endpoints (see the module docs of [`super`]).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures_util::{Stream, StreamExt as _};
use serde::Deserialize;
use serde_json::{json, Value};

use super::assets;
use super::runs::{self, LogRefusal, RunRef};
use super::state::{DashState, MAX_EVENT_STREAMS, MAX_QUERY_BYTES};
use crate::base::prom::Prom;
use crate::swarm::Reachability;

/// Bytes of a points file one answer carries at most (a first read: its tail).
const MAX_POINTS_BYTES: usize = 4 << 20;
/// Bytes of an agent's log served (its end).
const MAX_LOG_BYTES: u64 = 256 << 10;
/// Between two events of a stream.
const EVENT_EVERY: Duration = Duration::from_secs(1);

type St = State<Arc<DashState>>;

pub(super) fn router(state: Arc<DashState>) -> Router {
    Router::new()
        .route("/", get(assets::index))
        .route("/dash.js", get(assets::script))
        .route("/dash.css", get(assets::style))
        .route("/boot.js", get(boot))
        .route("/api/live", get(live))
        .route("/api/events", get(events))
        .route("/api/runs", get(list_runs))
        .route("/api/runs/{run}/points", get(points))
        .route("/api/runs/{run}/logs/{file}", get(log))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), bounds))
        .with_state(state)
}

/// A JSON error answer.
fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": message.into()}))).into_response()
}

/// Counts every request, refuses an oversize query before any handler parses it, and
/// counts the refusals.
async fn bounds(State(st): St, req: Request, next: Next) -> Response {
    st.requests.fetch_add(1, Ordering::Relaxed);
    let query = req.uri().query().map_or(0, str::len);
    let res = if query > MAX_QUERY_BYTES {
        refuse(
            StatusCode::URI_TOO_LONG,
            format!("the query has {query} bytes; at most {MAX_QUERY_BYTES} are read"),
        )
    } else {
        next.run(req).await
    };
    if res.status().is_client_error() || res.status().is_server_error() {
        st.refused.fetch_add(1, Ordering::Relaxed);
    }
    res
}

async fn not_found() -> Response {
    refuse(StatusCode::NOT_FOUND, "no such page")
}

/// The run named `name`.
fn run_named(st: &DashState, name: &str) -> Option<RunRef> {
    st.source.runs().into_iter().find(|r| r.name == name)
}

fn no_run(name: &str) -> Response {
    refuse(StatusCode::NOT_FOUND, format!("no run named {name:?}"))
}

/// One peer of the view as the page shows it.
fn peer_json(e: &crate::swarm::ViewEntry) -> Value {
    let mut v = serde_json::to_value(&e.status).unwrap_or(Value::Null);
    v["role"] = json!(e.status.role.as_str());
    v["peer"] = json!(e.peer.to_string());
    v["self"] = json!(e.is_self);
    v["age_s"] = json!(e.age.as_secs_f64());
    // Whether the peer is certified by the run this peer trusts (see `swarm::trust`):
    // what its certificate grants, or why it is not certified (null: no run trusted).
    v["certified"] = match &e.cert {
        Some(c) => json!({
            "model": c.grant.model,
            "group": c.grant.group,
            "serve": c.grant.serve,
            "train": c.grant.train,
            "until_unix": c.not_after_unix,
        }),
        None => Value::Null,
    };
    v["cert_problem"] = json!(e.cert_problem);
    v
}

fn live_json(st: &DashState) -> Value {
    json!({
        "role": st.role,
        "peer": st.swarm.peer_id.to_string(),
        "trust": st.swarm.trust().describe(),
        "reach": st.swarm.reachability().as_str(),
        "addrs": st.swarm.offered_addrs().iter().map(ToString::to_string).collect::<Vec<_>>(),
        "links": {
            "direct": st.swarm.link_counts().0,
            "hole_punched": st.swarm.link_counts().1,
            "relayed": st.swarm.link_counts().2,
        },
        "view": st.swarm.view().iter().map(peer_json).collect::<Vec<_>>(),
        "live": st.source.live(),
        "runs": st.source.runs(),
    })
}

async fn live(State(st): St) -> Response {
    Json(live_json(&st)).into_response()
}

/// Bytes of a run's points the page's first render gets (its tail).
const BOOT_POINTS_BYTES: usize = 1 << 20;

/// `/boot.js`: the state the page renders first, as a script the page loads before its
/// own (so the first render is done when the page has loaded; the event stream follows).
async fn boot(State(st): St) -> Response {
    let live = live_json(&st);
    let runs = st.source.runs();
    let points = tokio::task::spawn_blocking(move || {
        let mut out = serde_json::Map::new();
        for r in runs {
            if let Ok(l) = runs::read_lines(&r.points_path(), 0, BOOT_POINTS_BYTES) {
                out.insert(
                    r.name.clone(),
                    json!({"kind": r.kind, "points": l.points, "reset": true}),
                );
            }
        }
        Value::Object(out)
    })
    .await
    .unwrap_or(Value::Null);
    let body = format!(
        "window.AGENTJET_BOOT = {};\n",
        json!({"live": live, "points": points})
    );
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

async fn list_runs(State(st): St) -> Response {
    let runs: Vec<Value> = st.source.runs().iter().map(runs::summary).collect();
    Json(json!({"runs": runs})).into_response()
}

#[derive(Deserialize)]
struct PointsQuery {
    from: Option<u64>,
}

async fn points(
    State(st): St,
    Path(run): Path<String>,
    q: Result<Query<PointsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Some(run) = run_named(&st, &run) else {
        return no_run(&run);
    };
    let from = match q {
        Ok(Query(q)) => q.from.unwrap_or(0),
        Err(e) => return refuse(StatusCode::BAD_REQUEST, e.body_text()),
    };
    match runs::read_lines(&run.points_path(), from, MAX_POINTS_BYTES) {
        Ok(lines) => Json(lines).into_response(),
        Err(e) => refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading {}: {e}", run.kind.points_file()),
        ),
    }
}

async fn log(State(st): St, Path((run, file)): Path<(String, String)>) -> Response {
    let Some(run) = run_named(&st, &run) else {
        return no_run(&run);
    };
    let path = match runs::log_path(&run, &file) {
        Ok(p) => p,
        Err(LogRefusal::BadName) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!("{file:?} is not a log's file name"),
            )
        }
        Err(LogRefusal::Missing) => {
            return refuse(
                StatusCode::NOT_FOUND,
                format!("run {:?} has no log {file:?}", run.name),
            )
        }
    };
    match runs::tail_text(&path, MAX_LOG_BYTES) {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response(),
        Err(e) => refuse(StatusCode::NOT_FOUND, format!("{file:?}: {e}")),
    }
}

async fn metrics(State(st): St) -> Response {
    let mut p = Prom::new();
    p.counter(
        "agentjet_dashboard_requests_total",
        "Requests to this peer's dashboard.",
        &[],
        st.requests.load(Ordering::Relaxed) as f64,
    );
    p.counter(
        "agentjet_dashboard_refused_total",
        "Dashboard requests answered with an error status.",
        &[],
        st.refused.load(Ordering::Relaxed) as f64,
    );
    let view = st.swarm.view();
    let mut roles: HashMap<&str, usize> = ["server", "client", "peer"]
        .into_iter()
        .map(|r| (r, 0))
        .collect();
    for e in &view {
        *roles.entry(e.status.role.as_str()).or_default() += 1;
    }
    let mut roles: Vec<_> = roles.into_iter().collect();
    roles.sort();
    for (role, n) in roles {
        p.gauge(
            "agentjet_swarm_peers",
            "Peers in this peer's gossip view (itself included), by role.",
            &[("role", role)],
            n as f64,
        );
    }
    // This peer's reachability (1 for the one it has) and its connections by kind.
    let reach = st.swarm.reachability();
    for r in [
        Reachability::Public,
        Reachability::Relayed,
        Reachability::Unreachable,
        Reachability::Local,
        Reachability::Unknown,
    ] {
        p.gauge(
            "agentjet_swarm_reachability",
            "1 for this peer's reachability: public, relayed (behind NAT, through a relay), unreachable (behind NAT, no relay yet), local (loopback only) or unknown.",
            &[("reach", r.as_str())],
            f64::from(u8::from(r == reach)),
        );
    }
    let (direct, punched, relayed) = st.swarm.link_counts();
    for (kind, n) in [
        ("direct", direct),
        ("hole_punched", punched),
        ("relayed", relayed),
    ] {
        p.gauge(
            "agentjet_swarm_connected_peers",
            "Connected peers by their best connection: direct, hole-punched (DCUtR) or relayed.",
            &[("kind", kind)],
            n as f64,
        );
    }
    let load = st.swarm.relay_load();
    p.gauge(
        "agentjet_relay_reservations",
        "Peers behind NAT holding a reservation on this peer's relay service.",
        &[],
        load.reservations as f64,
    );
    p.gauge(
        "agentjet_relay_circuits",
        "Connections this peer relays now.",
        &[],
        load.circuits as f64,
    );
    p.counter(
        "agentjet_relay_circuits_total",
        "Connections this peer has relayed.",
        &[],
        load.circuits_total as f64,
    );
    p.counter(
        "agentjet_relay_refused_total",
        "Reservations and circuits this peer's relay service refused (limits).",
        &[],
        load.refused as f64,
    );
    st.source.metrics(&mut p);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        p.render(),
    )
        .into_response()
}

/// An event stream's slot: released when the stream is dropped.
struct StreamSlot(Arc<DashState>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn events(State(st): St) -> Response {
    if st.streams.fetch_add(1, Ordering::Relaxed) >= MAX_EVENT_STREAMS {
        st.streams.fetch_sub(1, Ordering::Relaxed);
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{MAX_EVENT_STREAMS} event streams are open already"),
        );
    }
    let slot = StreamSlot(st.clone());
    Sse::new(event_stream(slot))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// Every second, the live state and each run's new lines; ends when the peer stops.
fn event_stream(slot: StreamSlot) -> impl Stream<Item = Result<Event, Infallible>> {
    let offsets: HashMap<String, u64> = HashMap::new();
    futures_util::stream::unfold(
        (slot, offsets, true),
        |(slot, mut offsets, first)| async move {
            let st = slot.0.clone();
            if !first {
                tokio::select! {
                    _ = tokio::time::sleep(EVENT_EVERY) => {}
                    _ = st.stop.requested() => return None,
                }
            }
            if st.stop.mode().is_some() {
                return None;
            }
            let mut batch = serde_json::Map::new();
            for run in st.source.runs() {
                let from = offsets.get(&run.name).copied().unwrap_or(0);
                let path = run.points_path();
                let Ok(lines) =
                    tokio::task::spawn_blocking(move || {
                        runs::read_lines(&path, from, MAX_POINTS_BYTES)
                    })
                    .await
                else {
                    continue;
                };
                let Ok(lines) = lines else { continue };
                offsets.insert(run.name.clone(), lines.next);
                if !lines.points.is_empty() || lines.reset {
                    batch.insert(
                        run.name.clone(),
                        json!({"kind": run.kind, "points": lines.points, "reset": lines.reset || from == 0}),
                    );
                }
            }
            let live = Event::default().event("live").data(live_json(&st).to_string());
            let points = Event::default()
                .event("points")
                .data(Value::Object(batch).to_string());
            let items = futures_util::stream::iter([Ok(live), Ok(points)]);
            Some((items, (slot, offsets, false)))
        },
    )
    .flat_map(|s| s)
}
