//! [`Admission`]: who may hold a connection, so clients that misbehave
//! cannot lock the others out.
//!
//! Connections still in the handshake and established ones are limited
//! separately. Established connections (`max_connections`) are the ones
//! doing work; a connection that finishes its handshake when they are all
//! taken is closed. Connections in the handshake are cheap to open and
//! can be held open by anyone who can reach the socket, so their limit
//! does not refuse the newcomer: it closes the *oldest* handshake instead
//! (first of the same peer when that peer is at its own cap, else the
//! oldest of all). A real client finishes its handshake in a few round
//! trips, so it is never the oldest for long, while connections that never
//! finish are pushed out by each new arrival or by the handshake deadline,
//! whichever comes first. The peer is the IP address for TCP and the user
//! id (`SO_PEERCRED`) for the Unix socket.

use std::collections::{HashSet, VecDeque};
use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::listener::Stream;

/// Who is on the other end, for the per-peer cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PeerKey {
    Ip(IpAddr),
    Uid(u32),
    Unknown,
}

impl PeerKey {
    /// The peer of an accepted connection.
    pub fn of(stream: &Stream) -> PeerKey {
        match stream {
            Stream::Tcp(s) => s
                .peer_addr()
                .map_or(PeerKey::Unknown, |a| PeerKey::Ip(a.ip())),
            Stream::Unix(s) => peer_uid(s.as_raw_fd()).map_or(PeerKey::Unknown, PeerKey::Uid),
        }
    }
}

/// The user id of a Unix socket's peer.
fn peer_uid(fd: std::os::fd::RawFd) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a live
    // ucred of that size; `fd` is the accepted socket, open for the call.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    (rc == 0).then_some(cred.uid)
}

/// A connection in its handshake.
struct Handshake {
    id: u64,
    peer: PeerKey,
}

struct State {
    /// Oldest first.
    handshaking: VecDeque<Handshake>,
    established: HashSet<u64>,
}

/// The admission limits: the handshakes (total and per peer) and the
/// established connections.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdmissionLimits {
    pub max_handshakes: usize,
    pub max_handshakes_per_peer: usize,
    pub max_connections: usize,
}

pub(super) struct Admission {
    limits: AdmissionLimits,
    state: Mutex<State>,
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Admission {
        assert!(limits.max_handshakes >= 1 && limits.max_handshakes_per_peer >= 1);
        assert!(limits.max_connections >= 1);
        Admission {
            limits,
            state: Mutex::new(State {
                handshaking: VecDeque::new(),
                established: HashSet::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new connection starts its handshake. Always admitted; returns the
    /// ids of the handshakes it pushes out (the caller shuts them down).
    pub fn admit(&self, id: u64, peer: PeerKey) -> Vec<u64> {
        let mut state = self.lock();
        let mut evicted = Vec::new();
        let same_peer = state.handshaking.iter().filter(|h| h.peer == peer).count();
        if same_peer >= self.limits.max_handshakes_per_peer {
            if let Some(at) = state.handshaking.iter().position(|h| h.peer == peer) {
                evicted.extend(state.handshaking.remove(at).map(|h| h.id));
            }
        }
        while state.handshaking.len() >= self.limits.max_handshakes {
            match state.handshaking.pop_front() {
                Some(h) => evicted.push(h.id),
                None => break,
            }
        }
        debug_assert!(state.handshaking.len() < self.limits.max_handshakes);
        state.handshaking.push_back(Handshake { id, peer });
        evicted
    }

    /// The connection finished its handshake: `true` if it may serve,
    /// `false` if every established slot is taken (it is closed). Either
    /// way it no longer counts as a handshake.
    pub fn establish(&self, id: u64) -> bool {
        let mut state = self.lock();
        state.handshaking.retain(|h| h.id != id);
        debug_assert!(!state.established.contains(&id));
        if state.established.len() >= self.limits.max_connections {
            return false;
        }
        state.established.insert(id);
        true
    }

    /// The connection ended, wherever it was.
    pub fn finished(&self, id: u64) {
        let mut state = self.lock();
        state.handshaking.retain(|h| h.id != id);
        state.established.remove(&id);
    }

    /// (connections in the handshake, established connections).
    pub fn counts(&self) -> (usize, usize) {
        let state = self.lock();
        (state.handshaking.len(), state.established.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_unix_peer_is_its_user() {
        let (a, _b) = UnixStream::pair().unwrap();
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        assert_eq!(PeerKey::of(&Stream::Unix(a)), PeerKey::Uid(uid));
    }

    #[test]
    fn the_oldest_handshake_makes_room_and_established_ones_are_capped() {
        let admission = Admission::new(AdmissionLimits {
            max_handshakes: 4,
            max_handshakes_per_peer: 2,
            max_connections: 1,
        });
        let a = PeerKey::Uid(1);
        let b = PeerKey::Uid(2);
        for (id, peer) in [(1, a), (2, a), (3, b)] {
            assert!(admission.admit(id, peer).is_empty());
        }
        assert_eq!(admission.counts(), (3, 0));
        // Peer a is at its cap (the table is not full): its own oldest (1)
        // goes, not b's.
        assert_eq!(admission.admit(4, a), vec![1]);
        // Room for one more of another peer.
        assert!(admission.admit(5, PeerKey::Unknown).is_empty());
        // Full overall: the oldest of all (2) goes.
        assert_eq!(admission.admit(6, PeerKey::Unknown), vec![2]);
        assert_eq!(admission.counts(), (4, 0));
        // One established slot.
        assert!(admission.establish(3));
        assert!(!admission.establish(4), "the established slot is taken");
        assert_eq!(admission.counts(), (2, 1));
        admission.finished(4);
        admission.finished(3);
        assert_eq!(admission.counts(), (2, 0));
        assert!(admission.establish(5));
        assert_eq!(admission.counts(), (1, 1));
    }
}
