//! How each volume's origin fares under write-back: failing or not, the
//! last error (for status), and a backoff. A volume whose origin fails is
//! left out of the next background steps, twice as many after each new
//! failure (counted in steps: the engine has no clock), so the other
//! volumes' write-back is not slowed by retries against a dead origin.
//! Foreground callers (a drain, write-through, a writer out of space)
//! ignore the backoff: they need that volume now and get its error.

use std::sync::Mutex;

use cairn_format::VOLUMES_MAX;

use crate::volume_set::VolumeSet;

/// The longest backoff, in background steps (the daemon idles 20 ms
/// between empty steps: about 5 s).
const BACKOFF_STEPS_MAX: u32 = 256;

#[derive(Debug, Clone, Default)]
struct VolumeHealth {
    failing: bool,
    last_error: Option<String>,
    /// Background steps still to leave this volume out of.
    skip_steps: u32,
    /// The backoff after the next failure.
    backoff_steps: u32,
}

#[derive(Debug, Default)]
pub(crate) struct OriginHealth {
    volumes: Mutex<[VolumeHealth; VOLUMES_MAX]>,
}

impl OriginHealth {
    fn volumes(&self) -> std::sync::MutexGuard<'_, [VolumeHealth; VOLUMES_MAX]> {
        self.volumes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The volumes a background step leaves out, counting the step.
    pub(crate) fn backing_off(&self) -> VolumeSet {
        let mut set = VolumeSet::EMPTY;
        for (id, v) in self.volumes().iter_mut().enumerate() {
            if v.skip_steps > 0 {
                v.skip_steps -= 1;
                set.insert(id as u16);
            }
        }
        set
    }

    /// Volume `id`'s origin failed a write-back step.
    pub(crate) fn failed(&self, id: u16, volume_name: &str, error: &str) {
        let mut volumes = self.volumes();
        let v = &mut volumes[id as usize];
        if !v.failing {
            tracing::error!(
                volume = volume_name,
                id,
                "origin is failing; its dirty data stays on the cache, the other volumes keep writing back: {error}"
            );
        }
        v.failing = true;
        v.last_error = Some(error.to_string());
        v.backoff_steps = (v.backoff_steps * 2).clamp(1, BACKOFF_STEPS_MAX);
        v.skip_steps = v.backoff_steps;
    }

    /// Volume `id`'s part of a group reached its origin.
    pub(crate) fn succeeded(&self, id: u16, volume_name: &str) {
        let mut volumes = self.volumes();
        let v = &mut volumes[id as usize];
        if v.failing {
            tracing::info!(
                volume = volume_name,
                id,
                "origin recovered; write-back resumed"
            );
        }
        *v = VolumeHealth::default();
    }

    /// A volume was removed or added: its id starts afresh.
    pub(crate) fn forget(&self, id: u16) {
        self.volumes()[id as usize] = VolumeHealth::default();
    }

    pub(crate) fn failing(&self) -> VolumeSet {
        let mut set = VolumeSet::EMPTY;
        for (id, v) in self.volumes().iter().enumerate() {
            if v.failing {
                set.insert(id as u16);
            }
        }
        set
    }

    /// The last error of volume `id`'s origin, while it is failing.
    pub(crate) fn error_of(&self, id: u16) -> Option<String> {
        let volumes = self.volumes();
        let v = &volumes[id as usize];
        if v.failing {
            v.last_error.clone()
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OriginHealth;
    use crate::volume_set::VolumeSet;

    #[test]
    fn a_failing_origin_is_left_out_of_twice_as_many_steps_each_time() {
        let h = OriginHealth::default();
        h.failed(2, "b", "EIO");
        assert_eq!(h.failing(), VolumeSet::single(2));
        assert_eq!(h.error_of(2).as_deref(), Some("EIO"));
        assert_eq!(h.backing_off(), VolumeSet::single(2));
        assert_eq!(h.backing_off(), VolumeSet::EMPTY);
        h.failed(2, "b", "EIO");
        assert_eq!(h.backing_off(), VolumeSet::single(2));
        assert_eq!(h.backing_off(), VolumeSet::single(2));
        assert_eq!(h.backing_off(), VolumeSet::EMPTY);
        for _ in 0..20 {
            h.failed(2, "b", "EIO");
        }
        let skipped = (0..1000)
            .take_while(|_| !h.backing_off().is_empty())
            .count();
        assert_eq!(skipped, super::BACKOFF_STEPS_MAX as usize);
        h.succeeded(2, "b");
        assert_eq!(h.failing(), VolumeSet::EMPTY);
        assert_eq!(h.error_of(2), None);
        h.failed(3, "c", "EIO");
        h.forget(3);
        assert_eq!(h.failing(), VolumeSet::EMPTY);
    }
}
