//! Errors in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), the
//! one mapping from engine errors to HTTP statuses, and body parsing that names the field.

use super::*;

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    pub(super) kind: &'static str,
    pub(super) param: Option<String>,
    pub(super) code: Option<&'static str>,
}

impl ApiError {
    pub(super) fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }
    pub(super) fn server(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message,
                kind: self.kind,
                param: self.param,
                code: self.code,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

pub(super) fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::Overloaded(n) => ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("the server is overloaded ({n} requests waiting); retry later"),
            kind: "rate_limit_error",
            param: None,
            code: Some("overloaded"),
        },
        EngineError::Stopped => ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the model's engine has stopped".into(),
            kind: "server_error",
            param: None,
            code: Some("engine_stopped"),
        },
        other @ (EngineError::Failed(_)
        | EngineError::WeightUpdateBusy
        | EngineError::WeightsRejected(_)) => ApiError::server(other.to_string()),
    }
}

pub(super) fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::bad("body", format!("invalid JSON body: {inner}"))
        } else {
            ApiError::bad(&path, format!("invalid value for '{path}': {inner}"))
        }
    })
}
