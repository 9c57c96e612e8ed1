//! The study on a web page while its driver runs (`study run --dashboard HOST:PORT`):
//!
//! - `GET /`: the report as it is now (where the study is, the winner so far, the arms'
//!   table, every decision, the arms the policy started, the researcher's calls, the
//!   failures) and the arms' curves; the page reloads itself every 5 seconds;
//! - `GET /curves.svg`: the curves (the metric by step, one line per arm);
//! - `GET /api/study`: the journal's state as JSON (arms, phases, targets, scores,
//!   decisions, the researcher's calls, the end).
//!
//! Everything is read from the study's directory at each request (the journal and the
//! arms' `metrics.jsonl`): the page shows what a `study report` would write. Served
//! through `facade::http`, so a loopback listener answers loopback requests only.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::State as AxState;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::report;
use super::spec::Study;

struct Source {
    study: Study,
    dir: PathBuf,
}

/// The page's router for the study in `dir`.
pub fn router(study: Study, dir: PathBuf) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/curves.svg", get(curves))
        .route("/api/study", get(api))
        .with_state(Arc::new(Source { study, dir }))
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Runs `f` (file reads) off the async threads; an error is a 500 with its text.
async fn read<T: Send + 'static>(
    src: Arc<Source>,
    f: impl FnOnce(&Source) -> Result<T, String> + Send + 'static,
) -> Result<T, Response> {
    tokio::task::spawn_blocking(move || f(&src))
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r)
        .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e).into_response())
}

async fn page(AxState(src): AxState<Arc<Source>>) -> Response {
    let name = src.study.name.clone();
    match read(src, |s| {
        report::render(&s.study, &s.dir)
            .map(|(md, _)| md)
            .map_err(|e| e.to_string())
    })
    .await
    {
        Ok(md) => (
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            format!(
                "<!doctype html><html><head><meta charset=\"utf-8\">\
                 <meta http-equiv=\"refresh\" content=\"5\"><title>study {}</title>\
                 <style>body{{font-family:sans-serif;margin:2em}}pre{{white-space:pre-wrap}}</style>\
                 </head><body><img src=\"/curves.svg\" alt=\"curves\" style=\"max-width:100%\">\
                 <pre>{}</pre></body></html>",
                escape(&name),
                escape(&md)
            ),
        )
            .into_response(),
        Err(r) => r,
    }
}

async fn curves(AxState(src): AxState<Arc<Source>>) -> Response {
    match read(src, |s| {
        report::render(&s.study, &s.dir)
            .map(|(_, svg)| svg)
            .map_err(|e| e.to_string())
    })
    .await
    {
        Ok(svg) => ([(header::CONTENT_TYPE, "image/svg+xml")], svg).into_response(),
        Err(r) => r,
    }
}

async fn api(AxState(src): AxState<Arc<Source>>) -> Response {
    match read(src, |s| {
        report::load(&s.study, &s.dir)
            .map(|(_, state)| state)
            .map_err(|e| e.to_string())
    })
    .await
    {
        Ok(state) => axum::Json(state).into_response(),
        Err(r) => r,
    }
}
