//! The device's connection to its server, re-established with exponential
//! backoff when it is lost.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::conn::Conn;
use super::options::NbdOptions;
use super::stats::Counters;
use super::uri::NbdUri;

struct LinkState {
    conn: Option<Arc<Conn>>,
    /// When the connection was lost; `None` while connected.
    down_since: Option<Instant>,
    next_attempt: Instant,
    backoff_ms: u64,
    last_error: String,
}

/// A connection that is there when asked for, within the reconnect policy
/// of [`NbdOptions`] (see the module documentation of `nbd`).
pub(super) struct Link {
    /// The device name, for logs.
    name: String,
    uri: NbdUri,
    options: NbdOptions,
    /// The export size seen at open; a reconnect to another size fails.
    size_bytes: u64,
    counters: Arc<Counters>,
    state: Mutex<LinkState>,
}

impl Link {
    /// A link that starts on `conn`, the connection made at open.
    pub fn new(
        name: String,
        uri: NbdUri,
        options: NbdOptions,
        counters: Arc<Counters>,
        conn: Arc<Conn>,
    ) -> Link {
        Link {
            name,
            uri,
            size_bytes: conn.info.size_bytes,
            counters,
            state: Mutex::new(LinkState {
                conn: Some(conn),
                down_since: None,
                next_attempt: Instant::now(),
                backoff_ms: options.backoff_initial_ms.max(1),
                last_error: String::new(),
            }),
            options,
        }
    }

    pub fn uri(&self) -> &NbdUri {
        &self.uri
    }

    fn lock(&self) -> MutexGuard<'_, LinkState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A live connection, reconnecting with backoff if needed.
    pub fn connection(&self) -> io::Result<Arc<Conn>> {
        let start = Instant::now();
        loop {
            let sleep_for = {
                let mut link = self.lock();
                if let Some(conn) = link.conn.clone() {
                    if conn.is_alive() {
                        return Ok(conn);
                    }
                    self.drop_dead(&mut link, &conn);
                }
                let now = Instant::now();
                let down_since = *link.down_since.get_or_insert(now);
                if now >= link.next_attempt {
                    if let Some(conn) = self.reconnect(&mut link, now, down_since) {
                        return Ok(conn);
                    }
                }
                let give_up_at = (down_since
                    + Duration::from_millis(self.options.reconnect_wait_ms))
                .min(start + Duration::from_millis(self.options.request_timeout_ms));
                if link.next_attempt > give_up_at {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        format!("the NBD server is unreachable: {}", link.last_error),
                    ));
                }
                link.next_attempt.saturating_duration_since(Instant::now())
            };
            std::thread::sleep(sleep_for);
        }
    }

    /// Forget a connection found dead.
    fn drop_dead(&self, link: &mut LinkState, conn: &Conn) {
        let reason = conn.dead_reason();
        tracing::warn!(device = %self.name, "NBD connection lost ({reason}); reconnecting");
        self.counters
            .connection_losses
            .fetch_add(1, Ordering::Relaxed);
        link.conn = None;
        link.last_error = reason;
        conn.close();
    }

    /// One reconnect attempt; on failure, schedule the next one.
    fn reconnect(
        &self,
        link: &mut LinkState,
        now: Instant,
        down_since: Instant,
    ) -> Option<Arc<Conn>> {
        match Conn::open(
            &self.uri,
            &self.options,
            &self.counters,
            Some(self.size_bytes),
        ) {
            Ok(conn) => {
                tracing::info!(
                    device = %self.name,
                    down_ms = now.duration_since(down_since).as_millis() as u64,
                    "NBD connection re-established"
                );
                self.counters.reconnects.fetch_add(1, Ordering::Relaxed);
                link.conn = Some(Arc::clone(&conn));
                link.down_since = None;
                link.backoff_ms = self.options.backoff_initial_ms.max(1);
                Some(conn)
            }
            Err(err) => {
                let now = Instant::now();
                link.last_error = err.to_string();
                link.next_attempt = now + Duration::from_millis(link.backoff_ms);
                link.backoff_ms = (link.backoff_ms * 2).min(self.options.backoff_max_ms.max(1));
                None
            }
        }
    }

    /// Close the connection, if any (the device is going away).
    pub fn close(&self) {
        if let Some(conn) = self.lock().conn.take() {
            conn.close();
        }
    }
}
