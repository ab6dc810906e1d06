//! The NBD commands one device call turns into: one request each, split
//! at the server's limits.

use cairn_nbd_proto::codec::wire::COMPACT_REQUEST_BYTES;
use cairn_nbd_proto::codec::RequestHeader;
use cairn_nbd_proto::proto::CMD_WRITE;

/// One request of a batch.
pub(super) struct Command<'a> {
    pub command: u16,
    pub offset: u64,
    pub len: u32,
    /// The WRITE payload, sent from the caller's buffers; empty otherwise.
    pub payload: Vec<&'a [u8]>,
}

impl<'a> Command<'a> {
    /// A request without payload (READ, FLUSH, TRIM, WRITE_ZEROES).
    pub fn bare(command: u16, offset: u64, len: u32) -> Command<'a> {
        Command {
            command,
            offset,
            len,
            payload: Vec::new(),
        }
    }

    /// The request's header on the wire, under `cookie`.
    pub fn header(&self, cookie: u64) -> [u8; COMPACT_REQUEST_BYTES] {
        RequestHeader {
            flags: 0,
            command: self.command,
            cookie,
            offset: self.offset,
            length_bytes: self.len as u64,
        }
        .to_compact()
    }
}

pub(super) fn first_offset(commands: &[Command<'_>]) -> u64 {
    commands.first().map_or(0, |c| c.offset)
}

pub(super) fn first_len(commands: &[Command<'_>]) -> u64 {
    commands.first().map_or(0, |c| c.len as u64)
}

/// Split `[offset, offset + len)` at `limit` bytes.
pub(super) fn chunks(offset: u64, len: u64, limit: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = offset + len;
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let n = (end - at).min(limit);
        let chunk = (at, n);
        at += n;
        Some(chunk)
    })
}

/// WRITE commands for `bufs` written back to back from `offset`, each
/// carrying at most `limit` bytes taken straight from the buffers.
pub(super) fn write_commands<'a>(
    offset: u64,
    bufs: &[&'a [u8]],
    limit: usize,
    commands: &mut Vec<Command<'a>>,
) {
    let mut current: Vec<&'a [u8]> = Vec::new();
    let mut current_len = 0usize;
    let mut at = offset;
    for buf in bufs {
        let mut rest: &'a [u8] = buf;
        while !rest.is_empty() {
            let n = (limit - current_len).min(rest.len());
            current.push(&rest[..n]);
            current_len += n;
            rest = &rest[n..];
            if current_len == limit {
                commands.push(Command {
                    command: CMD_WRITE,
                    offset: at,
                    len: current_len as u32,
                    payload: std::mem::take(&mut current),
                });
                at += current_len as u64;
                current_len = 0;
            }
        }
    }
    if current_len > 0 {
        commands.push(Command {
            command: CMD_WRITE,
            offset: at,
            len: current_len as u32,
            payload: current,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_split_at_the_limit() {
        let got: Vec<(u64, u64)> = chunks(100, 250, 100).collect();
        assert_eq!(got, [(100, 100), (200, 100), (300, 50)]);
        assert_eq!(chunks(0, 0, 100).count(), 0);
    }

    #[test]
    fn writes_split_across_buffers_without_copying() {
        let (a, b) = ([1u8; 6], [2u8; 5]);
        let mut commands = Vec::new();
        write_commands(4096, &[&a, &b], 4, &mut commands);
        let shape: Vec<(u64, u32, usize)> = commands
            .iter()
            .map(|c| (c.offset, c.len, c.payload.len()))
            .collect();
        assert_eq!(shape, [(4096, 4, 1), (4100, 4, 2), (4104, 3, 1)]);
        assert!(commands.iter().all(|c| c.command == CMD_WRITE));
    }
}
