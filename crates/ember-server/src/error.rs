//! Errors as OpenAI sends them: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status. 4xx say exactly what is wrong; 5xx say little (the log has the rest).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error response.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// `Retry-After` seconds (503 only).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 about one request field.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_string()), ..Self::invalid(message) }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400 for a field we understand but do not implement.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self::param(param, message).with_code("unsupported_parameter")
    }

    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist or you do not have access to it."),
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::invalid("")
        }
    }

    pub fn unauthorized(message: &str) -> Self {
        ApiError { status: StatusCode::UNAUTHORIZED, message: message.into(), code: Some("invalid_api_key"), ..Self::invalid("") }
    }

    /// 503: every slot is busy and the queue is full.
    pub fn busy(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            code: Some("server_busy"),
            retry_after: Some(1),
            ..Self::invalid("")
        }
    }

    /// 500; `message` is for the client, so keep details in the log.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", ..Self::invalid("") }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, message: message.into(), code: Some("not_found"), ..Self::invalid("") }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = self.status.as_u16(), "{}", self.message);
        } else {
            tracing::debug!(status = self.status.as_u16(), "{}", self.message);
        }
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}
