//! The usage meter: reads token counts and billed cost from a model provider's responses as the
//! bytes go to the guest (the response is never held back), for JSON bodies and server-sent event
//! streams, in the shapes of Anthropic, OpenAI and OpenRouter.

pub mod json_scan;
pub mod record;
pub mod sse;

pub use record::{Meter, UsageRecord};
