//! Request extractors answering bad input with the wire error body (shared with the server).

pub use sandman_http::extract::{
    ApiJson, ApiQuery, BadRequest, BodyStalled, MAX_JSON_BODY, is_length_limit, is_stalled, read_limited, unstalled,
};
