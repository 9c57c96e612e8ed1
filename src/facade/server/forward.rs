//! Requests that name an external model (`FacadeConfig::external`) are forwarded to its
//! OpenAI-compatible endpoint as they came (recorded per episode, never trained): shared by
//! the endpoints that accept them.

use super::*;

/// The external model a request names, if any.
pub(super) fn external_of(st: &AppState, body: &Bytes) -> Option<Arc<ExternalModel>> {
    if st.cfg.external.is_empty() {
        return None;
    }
    #[derive(serde::Deserialize)]
    struct ModelOnly {
        model: Option<String>,
    }
    let name = serde_json::from_slice::<ModelOnly>(body).ok()?.model?;
    st.cfg.external.iter().find(|m| m.name == name).cloned()
}

pub(super) async fn forward_external(
    st: &AppState,
    m: &ExternalModel,
    path: &str,
    body: &Bytes,
    episode: Option<String>,
) -> Result<Response, ApiError> {
    forward(m, path, body, episode, st.external.clone(), &st.cfg.tasks)
        .await
        .map_err(|(status, message)| ApiError {
            status,
            message,
            kind: if status == StatusCode::BAD_REQUEST {
                "invalid_request_error"
            } else {
                "api_error"
            },
            param: None,
            code: (status == StatusCode::BAD_GATEWAY).then_some("external_model_unreachable"),
        })
}
