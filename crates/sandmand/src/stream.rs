//! NDJSON streams of events (shared with the server).

pub use sandman_http::ndjson::{CONTENT_TYPE as NDJSON, KEEPALIVE_EVERY, line, response as ndjson};
