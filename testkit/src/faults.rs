//! Faults. On the OpenAI side they are chosen by the request's `model` field (the gateway
//! forwards bodies unchanged, so a test picks a fault by the model it asks for): `fault-500`,
//! `fault-garbage`, `fault-reset`, `fault-slow`, `fault-hang`. On the SGLang side (no model
//! field) a script rule's `fault` picks one (see [`crate::Rule::fault`]).

use http::{Response, header};

use crate::answer::{RespBody, full};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// HTTP 500 with an OpenAI error body.
    Status500,
    /// 200 with a body that is not JSON (or, streaming, not SSE).
    Garbage,
    /// Streaming: two valid chunks, then the connection is aborted. JSON: aborted before any response.
    Reset,
    /// 200 ms between SSE chunks (and before a JSON answer).
    Slow,
    /// Never answers.
    Hang,
}

impl Fault {
    pub(crate) fn from_model(model: &str) -> Option<Self> {
        match model {
            "fault-500" => Some(Fault::Status500),
            "fault-garbage" => Some(Fault::Garbage),
            "fault-reset" => Some(Fault::Reset),
            "fault-slow" => Some(Fault::Slow),
            "fault-hang" => Some(Fault::Hang),
            _ => None,
        }
    }
    pub(crate) const MODELS: [&'static str; 5] = [
        "fault-500",
        "fault-garbage",
        "fault-reset",
        "fault-slow",
        "fault-hang",
    ];
}

pub(crate) fn garbage(stream: bool) -> Response<RespBody> {
    let (body, ctype) = if stream {
        (
            "this is not server-sent events\n{{{ garbage ]]]\n<html>502 bad gateway</html>\n",
            "text/event-stream",
        )
    } else {
        (
            "<html><body>this is not JSON {\"choices\": [</body></html>\n",
            "application/json",
        )
    };
    let mut resp = Response::new(full(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(ctype),
    );
    resp
}
