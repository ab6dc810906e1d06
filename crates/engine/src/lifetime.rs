//! Lifetime counters: each counter's total over every run of the cache.
//! The checkpoint stores the totals (see `cairn_format::encode_lifetime`);
//! at open they become this run's base, and a total is base plus the count
//! since start. Counts since the last checkpoint are lost in a crash: a
//! lifetime total is a lower bound, exact after a clean stop.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cairn_format::lifetime_key;

#[derive(Default)]
pub(crate) struct LifetimeBase {
    /// By counter key; keys of counters this build does not have are kept,
    /// so a newer build's counters survive a run of an older one.
    base: Mutex<BTreeMap<u32, u64>>,
}

impl LifetimeBase {
    fn base(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, u64>> {
        self.base.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The totals stored by the last checkpoint.
    pub(crate) fn load(&self, pairs: Vec<(u32, u64)>) {
        let mut base = self.base();
        base.clear();
        base.extend(pairs);
    }

    /// Each counter's lifetime total, given its count since start.
    pub(crate) fn totals(&self, since_start: &[(&'static str, u64)]) -> Vec<(&'static str, u64)> {
        let base = self.base();
        since_start
            .iter()
            .map(|&(name, n)| {
                let was = base.get(&lifetime_key(name)).copied().unwrap_or(0);
                (name, was.saturating_add(n))
            })
            .collect()
    }

    /// What a checkpoint stores: every known counter's total, and the base
    /// of every unknown one.
    pub(crate) fn keyed_totals(&self, since_start: &[(&'static str, u64)]) -> Vec<(u32, u64)> {
        let mut all = self.base().clone();
        for &(name, n) in since_start {
            let total = all.entry(lifetime_key(name)).or_insert(0);
            *total = total.saturating_add(n);
        }
        all.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_the_stored_base_and_keep_unknown_counters() {
        let l = LifetimeBase::default();
        l.load(vec![(lifetime_key("reads"), 10), (12345, 7)]);
        assert_eq!(
            l.totals(&[("reads", 5), ("writes", 2)]),
            vec![("reads", 15), ("writes", 2)]
        );
        let stored = l.keyed_totals(&[("reads", 5)]);
        assert!(stored.contains(&(lifetime_key("reads"), 15)));
        assert!(
            stored.contains(&(12345, 7)),
            "a counter of another build survives"
        );
    }
}
