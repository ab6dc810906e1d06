//! Policy settings: stored in the cache (`cairn set`), overridden for one
//! run by `serve`'s flags, defaults otherwise; `status` shows each with its
//! source.

mod effective;
mod shared;

pub use effective::EffectiveSettings;
pub use shared::SharedSettings;
