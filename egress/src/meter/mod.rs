//! The usage meter: makes sure a metered request asks for its usage (request.rs), then reads
//! token counts and billed cost from the provider's response as the bytes go to the guest (the
//! response is never held back), for JSON bodies and server-sent event streams, in the shapes of
//! Anthropic, OpenAI and OpenRouter.

pub mod json_scan;
pub mod record;
pub mod request;
pub mod sse;

pub use record::{Meter, UsageRecord};
pub use request::{Api, Unmetered};
