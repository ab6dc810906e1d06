//! The running daemon's settings, shared by the write-back loop (which
//! reads them every step), the admin socket (`cairn set` changes them while
//! serving) and status.

use std::sync::{Arc, Mutex, MutexGuard};

use super::effective::EffectiveSettings;

#[derive(Clone)]
pub struct SharedSettings(Arc<Mutex<EffectiveSettings>>);

impl SharedSettings {
    pub fn new(settings: EffectiveSettings) -> SharedSettings {
        SharedSettings(Arc::new(Mutex::new(settings)))
    }

    fn lock(&self) -> MutexGuard<'_, EffectiveSettings> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self) -> EffectiveSettings {
        self.lock().clone()
    }

    pub fn set(&self, settings: EffectiveSettings) {
        *self.lock() = settings;
    }
}
