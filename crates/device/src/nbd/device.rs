//! [`NbdDevice`]: the [`Device`] impl over a [`Link`], turning each call
//! into a batch of commands that is resent only when none of it reached the
//! server.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_nbd_proto::proto::{
    CMD_FLUSH, CMD_READ, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES, FLAG_CAN_MULTI_CONN,
    FLAG_READ_ONLY, FLAG_SEND_FLUSH, FLAG_SEND_TRIM, FLAG_SEND_WRITE_ZEROES,
};

use super::batch::Batch;
use super::command::{chunks, first_len, first_offset, write_commands, Command};
use super::conn::{Conn, SendError};
use super::extents::Extents;
use super::handshake::NegotiatedExport;
use super::link::Link;
use super::loop_conn::LoopConn;
use super::loop_dial::LoopDial;
use super::loop_read_error::LoopReadError;
use super::options::NbdOptions;
use super::reader::nbd_error;
use super::stats::{Counters, NbdStats};
use super::uri::NbdUri;
use cairn_io::Reactor;

use crate::flush_debt::FlushDebt;
use crate::{
    check_range, AllocationRun, BufSlice, Device, DeviceError, DeviceFuture, DeviceResult,
};

/// TRIM and WRITE_ZEROES carry no payload but a 32-bit length: split at 1 GiB
/// (a multiple of every legal minimum block size).
const MAX_EFFECT_BYTES: u64 = 1 << 30;
/// Zero-filled payload used when the server cannot WRITE_ZEROES.
const ZERO_CHUNK_BYTES: usize = 1 << 20;
/// Attempts at one batch when the connection breaks before any of it left.
const MAX_BATCH_ATTEMPTS: u32 = 3;

/// Tells devices apart as keys of their loops' own connections.
static NEXT_DEVICE_ID: AtomicU64 = AtomicU64::new(1);

/// How one attempt at a batch failed.
enum Attempt {
    /// It may be sent again on a new connection: nothing of it reached
    /// the server, or it only reads and its connection broke before all
    /// replies came (a read changes nothing, so asking again is safe).
    NotSent(DeviceError),
    Failed(DeviceError),
}

/// A remote export served by an NBD server (see the module documentation).
pub struct NbdDevice {
    name: String,
    size_bytes: u64,
    info: NegotiatedExport,
    link: Link,
    next_cookie: AtomicU64,
    counters: Arc<Counters>,
    zeroes: Vec<u8>,
    /// Block status on a side connection; `None` when the server does not
    /// promise that one connection sees another's flushed writes.
    extents: Option<Extents>,
    /// Block status flushes first when a write is not flushed yet, so the
    /// side connection sees every write; a read goes to a loop's own
    /// connection only when none is owed.
    flush_debt: FlushDebt,
    /// How a loop opens a connection of its own; `None` when reads must
    /// stay on the main connection (no multi-conn, or turned off).
    loop_dial: Option<LoopDial>,
    /// This device among the loops' connections.
    device_id: u64,
    /// A loop's connection failed to open and that was logged.
    loop_warned: Arc<AtomicBool>,
    request_timeout: Duration,
}

impl NbdDevice {
    /// Connect to `uri` with default options. Fails with a clear error
    /// naming the URI if the server is unreachable or refuses the export.
    pub fn open(uri: &str) -> DeviceResult<NbdDevice> {
        Self::open_with(uri, NbdOptions::default())
    }

    pub fn open_with(uri: &str, options: NbdOptions) -> DeviceResult<NbdDevice> {
        let parsed = NbdUri::parse(uri).map_err(|message| DeviceError::Open {
            device: uri.to_string(),
            source: io::Error::new(io::ErrorKind::InvalidInput, message),
        })?;
        let name = parsed.to_string();
        let counters = Arc::new(Counters::default());
        let conn =
            Conn::open(&parsed, &options, &counters, None).map_err(|err| DeviceError::Open {
                device: name.clone(),
                source: io::Error::new(
                    err.kind(),
                    format!("cannot connect to the NBD server at {name}: {err}"),
                ),
            })?;
        let info = conn.info;
        log_connected(&name, &info);
        let multi_conn = info.flags & FLAG_CAN_MULTI_CONN != 0;
        let extents = multi_conn.then(|| Extents::new(parsed.clone(), options, info.size_bytes));
        let loop_dial = (multi_conn && options.loop_connections).then(|| LoopDial {
            uri: parsed.clone(),
            options,
            expected: info,
        });
        Ok(NbdDevice {
            extents,
            loop_dial,
            device_id: NEXT_DEVICE_ID.fetch_add(1, Ordering::Relaxed),
            loop_warned: Arc::new(AtomicBool::new(false)),
            request_timeout: Duration::from_millis(options.request_timeout_ms.max(1)),
            flush_debt: FlushDebt::default(),
            link: Link::new(name.clone(), parsed, options, Arc::clone(&counters), conn),
            name,
            size_bytes: info.size_bytes,
            info,
            next_cookie: AtomicU64::new(1),
            counters,
            zeroes: vec![0u8; ZERO_CHUNK_BYTES.min(info.max_payload_bytes as usize)],
        })
    }

    /// The parsed URI.
    pub fn uri(&self) -> &NbdUri {
        self.link.uri()
    }

    pub fn stats(&self) -> NbdStats {
        self.counters.snapshot()
    }

    /// Whether the server advertised the export as read-only.
    pub fn is_read_only(&self) -> bool {
        self.info.flags & FLAG_READ_ONLY != 0
    }

    fn io_error(&self, offset: u64, len: u64, source: io::Error) -> DeviceError {
        DeviceError::Io {
            device: self.name.clone(),
            offset,
            len,
            source,
        }
    }

    fn check_aligned(&self, op: &'static str, offset: u64, len: u64) -> DeviceResult<()> {
        let min = self.info.min_block_bytes as u64;
        if offset.is_multiple_of(min) && len.is_multiple_of(min) {
            return Ok(());
        }
        Err(DeviceError::Unsupported {
            device: self.name.clone(),
            message: format!(
                "{op} at offset {offset} length {len} is not aligned to the server's minimum block size of {min} bytes"
            ),
        })
    }

    fn check_writable(&self) -> DeviceResult<()> {
        if self.is_read_only() {
            return Err(DeviceError::Unsupported {
                device: self.name.clone(),
                message: "the export is read-only".into(),
            });
        }
        Ok(())
    }

    /// Send every command, then wait for every reply. Returns the data of
    /// each read, or the first error.
    fn execute(&self, commands: &[Command<'_>]) -> DeviceResult<Vec<Option<Vec<u8>>>> {
        if commands.is_empty() {
            return Ok(Vec::new());
        }
        let first = &commands[0];
        let mut attempt = 1;
        loop {
            let conn = self
                .link
                .connection()
                .map_err(|err| self.io_error(first.offset, first.len as u64, err))?;
            match self.execute_on(&conn, commands) {
                Ok(results) => return Ok(results),
                // The connection died before the first request fully left
                // (the server cannot have run any of the batch), or under a
                // batch of reads: resending it on a new connection is safe.
                // (A write that was sent and then lost is ambiguous and
                // fails; the engine decides.)
                Err(Attempt::NotSent(err)) if attempt < MAX_BATCH_ATTEMPTS => {
                    tracing::debug!(device = %self.name, "resending a batch on a new connection: {err}");
                    attempt += 1;
                }
                Err(Attempt::NotSent(err) | Attempt::Failed(err)) => return Err(err),
            }
        }
    }

    fn execute_on(
        &self,
        conn: &Conn,
        commands: &[Command<'_>],
    ) -> Result<Vec<Option<Vec<u8>>>, Attempt> {
        let batch = Arc::new(Batch::new(commands.len()));
        let mut sent_at: Vec<Instant> = Vec::with_capacity(commands.len());
        let mut send_error: Option<(usize, SendError)> = None;
        for (index, command) in commands.iter().enumerate() {
            let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
            if let Err(err) = conn.send(&batch, index, command, cookie) {
                send_error = Some((index, err));
                break;
            }
            sent_at.push(Instant::now());
        }
        conn.wait(&batch, &sent_at);
        if let Some((
            0,
            SendError {
                error,
                retryable: true,
            },
        )) = send_error
        {
            return Err(Attempt::NotSent(self.io_error(
                first_offset(commands),
                first_len(commands),
                error,
            )));
        }
        self.collect(&batch, commands, send_error)
    }

    /// [`NbdDevice::execute`] as a task on `reactor`: the commands are
    /// pipelined on the connection and the task sleeps until their replies
    /// are in (the reader thread wakes it), so many reads of many tasks
    /// are in flight at once, up to the connection's window.
    async fn execute_async(
        &self,
        reactor: &Reactor,
        commands: &[Command<'_>],
    ) -> DeviceResult<Vec<Option<Vec<u8>>>> {
        if commands.is_empty() {
            return Ok(Vec::new());
        }
        let first = &commands[0];
        let mut attempt = 1;
        loop {
            // A reconnect runs on a thread of its own; this task waits.
            let conn = self
                .link
                .connection_async(reactor)
                .await
                .map_err(|err| self.io_error(first.offset, first.len as u64, err))?;
            match self.execute_on_async(reactor, &conn, commands).await {
                Ok(results) => return Ok(results),
                Err(Attempt::NotSent(err)) if attempt < MAX_BATCH_ATTEMPTS => {
                    tracing::debug!(device = %self.name, "resending a batch on a new connection: {err}");
                    attempt += 1;
                }
                Err(Attempt::NotSent(err) | Attempt::Failed(err)) => return Err(err),
            }
        }
    }

    async fn execute_on_async(
        &self,
        reactor: &Reactor,
        conn: &Conn,
        commands: &[Command<'_>],
    ) -> Result<Vec<Option<Vec<u8>>>, Attempt> {
        let batch = Arc::new(Batch::new(commands.len()));
        let mut sent_at: Vec<Instant> = Vec::with_capacity(commands.len());
        let mut send_error: Option<(usize, SendError)> = None;
        for (index, command) in commands.iter().enumerate() {
            let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
            if let Err(err) = conn
                .send_async(reactor, &batch, index, command, cookie)
                .await
            {
                send_error = Some((index, err));
                break;
            }
            sent_at.push(Instant::now());
        }
        conn.wait_async(reactor, &batch, &sent_at).await;
        if let Some((
            0,
            SendError {
                error,
                retryable: true,
            },
        )) = send_error
        {
            return Err(Attempt::NotSent(self.io_error(
                first_offset(commands),
                first_len(commands),
                error,
            )));
        }
        self.collect(&batch, commands, send_error)
    }

    /// The READ commands for `len` bytes at `offset`, after the checks.
    fn read_commands(&self, offset: u64, len: u64) -> DeviceResult<Vec<Command<'static>>> {
        check_range(&self.name, "read", offset, len, self.size_bytes)?;
        self.check_aligned("read", offset, len)?;
        let limit = self.info.max_payload_bytes as u64;
        Ok(chunks(offset, len, limit)
            .map(|(at, n)| Command::bare(CMD_READ, at, n as u32))
            .collect())
    }

    /// Copy the replies of a read's commands into `buf`, in order.
    fn fill_from_replies(
        &self,
        buf: &mut [u8],
        replies: &mut impl Iterator<Item = Option<Vec<u8>>>,
    ) -> DeviceResult<()> {
        let mut filled = 0usize;
        while filled < buf.len() {
            let data = replies.next().flatten().ok_or_else(|| {
                self.io_error(
                    0,
                    buf.len() as u64,
                    io::Error::new(io::ErrorKind::InvalidData, "missing read reply"),
                )
            })?;
            buf[filled..filled + data.len()].copy_from_slice(&data);
            filled += data.len();
        }
        Ok(())
    }

    pub(super) async fn read_async(
        &self,
        reactor: &Reactor,
        offset: u64,
        buf: &mut [u8],
    ) -> DeviceResult<()> {
        let commands = self.read_commands(offset, buf.len() as u64)?;
        if let [only] = commands.as_slice() {
            if let Some(done) = self.read_on_loop(reactor, only.offset, buf).await {
                return done;
            }
        }
        let results = self.execute_async(reactor, &commands).await?;
        self.fill_from_replies(buf, &mut results.into_iter())
    }

    /// Read on the loop's own connection when one is open and may be
    /// used: `None` to use the main connection instead (none open, or it
    /// broke before the reply came, which a read may simply redo).
    ///
    /// Only for a server that promises multi-conn consistency, and only
    /// when every write that finished has been flushed: the promise is
    /// that a FLUSH makes completed writes visible on every connection.
    /// A write finishing after this check was not finished when the read
    /// was asked for, so the read need not see it.
    async fn read_on_loop(
        &self,
        reactor: &Reactor,
        offset: u64,
        buf: &mut [u8],
    ) -> Option<DeviceResult<()>> {
        let dial = self.loop_dial.as_ref()?;
        if self.flush_debt.owed() {
            return None;
        }
        let conn = reactor.local(self.device_id, LoopConn::new);
        let channel = LoopConn::channel(&conn, reactor, dial, &self.counters, &self.loop_warned)?;
        let len = buf.len() as u64;
        let outcome = channel
            .read(reactor, offset, buf.len() as u32, self.request_timeout)
            .await;
        Some(match outcome {
            Ok(data) if data.len() == buf.len() => {
                buf.copy_from_slice(&data);
                self.counters.loop_reads.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Ok(data) => Err(self.io_error(
                offset,
                len,
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("a read reply carried {} bytes, not {len}", data.len()),
                ),
            )),
            Err(LoopReadError::Server(error)) => Err(self.io_error(offset, len, nbd_error(error))),
            Err(LoopReadError::TimedOut(message)) => Err(self.io_error(
                offset,
                len,
                io::Error::new(io::ErrorKind::TimedOut, message),
            )),
            Err(LoopReadError::Lost(reason)) => {
                tracing::debug!(device = %self.name, "a loop's own connection broke ({reason}); the read goes to the main connection");
                return None;
            }
        })
    }

    /// The results of a finished batch, or its first error.
    fn collect(
        &self,
        batch: &Batch,
        commands: &[Command<'_>],
        send_error: Option<(usize, SendError)>,
    ) -> Result<Vec<Option<Vec<u8>>>, Attempt> {
        let mut state = batch.lock();
        let mut results = Vec::with_capacity(commands.len());
        let mut first_error: Option<DeviceError> = None;
        for (index, slot) in state.results.iter_mut().enumerate() {
            match slot.take() {
                Some(Ok(data)) => results.push(data),
                Some(Err(err)) => {
                    let command = &commands[index];
                    first_error.get_or_insert_with(|| {
                        self.io_error(command.offset, command.len as u64, err)
                    });
                    results.push(None);
                }
                None => results.push(None),
            }
        }
        if let Some(err) = first_error {
            let lost = matches!(&err, DeviceError::Io { source, .. }
                if source.kind() == io::ErrorKind::ConnectionAborted);
            if lost && commands.iter().all(|c| c.command == CMD_READ) {
                return Err(Attempt::NotSent(err));
            }
            return Err(Attempt::Failed(err));
        }
        if let Some((index, err)) = send_error {
            let command = &commands[index];
            return Err(Attempt::Failed(self.io_error(
                command.offset,
                command.len as u64,
                err.error,
            )));
        }
        Ok(results)
    }

    fn flags(&self) -> u16 {
        self.info.flags
    }

    /// Run a write-type batch, counting it finished whatever its outcome
    /// (a failed write may still have reached the disk).
    fn execute_write(&self, commands: &[Command<'_>]) -> DeviceResult<()> {
        let result = self.execute(commands).map(drop);
        self.flush_debt.write_finished();
        result
    }
}

fn log_connected(name: &str, info: &NegotiatedExport) {
    if info.flags & FLAG_SEND_FLUSH == 0 {
        tracing::debug!(device = %name, "the server does not take FLUSH; flush is a no-op");
    }
    if info.flags & FLAG_READ_ONLY != 0 {
        tracing::warn!(device = %name, "the export is read-only; writes will fail");
    }
    tracing::debug!(
        device = %name,
        size_bytes = info.size_bytes,
        flags = info.flags,
        min_block_bytes = info.min_block_bytes,
        max_payload_bytes = info.max_payload_bytes,
        multi_conn = info.flags & FLAG_CAN_MULTI_CONN != 0,
        "connected"
    );
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        if let Some(extents) = &self.extents {
            extents.close();
        }
        self.link.close();
    }
}

impl Device for NbdDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> &'static str {
        "nbd"
    }

    fn identity(&self) -> String {
        self.name.clone()
    }

    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn alignment_bytes(&self) -> u32 {
        self.info.min_block_bytes.max(512)
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> DeviceResult<()> {
        self.read_many(&mut [(offset, buf)])
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> DeviceResult<()> {
        self.write_vectored_at(offset, &[buf])
    }

    fn write_vectored_at(&self, offset: u64, bufs: &[&[u8]]) -> DeviceResult<()> {
        self.write_many_vectored(&[(offset, bufs)])
    }

    /// Inside a reactor task, a pipelined command and a task that sleeps
    /// until its reply is in; elsewhere, [`Device::read_at`].
    fn read_into<'a>(
        &'a self,
        offset: u64,
        mut slice: BufSlice,
    ) -> DeviceFuture<'a, (DeviceResult<()>, BufSlice)> {
        let Some(reactor) = Reactor::current() else {
            let result = self.read_at(offset, slice.as_mut_slice());
            return Box::pin(std::future::ready((result, slice)));
        };
        Box::pin(async move {
            let result = self
                .read_async(&reactor, offset, slice.as_mut_slice())
                .await;
            (result, slice)
        })
    }

    fn read_many(&self, requests: &mut [(u64, &mut [u8])]) -> DeviceResult<()> {
        let mut commands = Vec::new();
        for (offset, buf) in requests.iter() {
            commands.extend(self.read_commands(*offset, buf.len() as u64)?);
        }
        let results = self.execute(&commands)?;
        let mut replies = results.into_iter();
        for (_, buf) in requests.iter_mut() {
            self.fill_from_replies(buf, &mut replies)?;
        }
        Ok(())
    }

    fn write_many(&self, requests: &[(u64, &[u8])]) -> DeviceResult<()> {
        crate::as_single_buffer_runs(requests, |runs| self.write_many_vectored(runs))
    }

    /// Every run pipelined on the connection, each sent from the caller's
    /// buffers (one command per run, split at the export's payload limit).
    fn write_many_vectored(&self, requests: &[(u64, &[&[u8]])]) -> DeviceResult<()> {
        for (offset, bufs) in requests {
            let total: u64 = bufs.iter().map(|b| b.len() as u64).sum();
            check_range(&self.name, "write", *offset, total, self.size_bytes)?;
            self.check_aligned("write", *offset, total)?;
        }
        if !requests.is_empty() {
            self.check_writable()?;
        }
        let limit = self.info.max_payload_bytes as usize;
        let mut commands = Vec::new();
        for (offset, bufs) in requests {
            write_commands(*offset, bufs, limit, &mut commands);
        }
        self.execute_write(&commands)
    }

    fn flush(&self) -> DeviceResult<()> {
        // FLUSH covers every write already replied to, and every write call
        // returns only after its replies: nothing else to wait for.
        let covers = self.flush_debt.flush_starts();
        if self.flags() & FLAG_SEND_FLUSH != 0 {
            self.execute(&[Command::bare(CMD_FLUSH, 0, 0)])?;
        }
        self.flush_debt.flushed(covers);
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "discard", offset, len, self.size_bytes)?;
        self.check_aligned("discard", offset, len)?;
        if len == 0 || self.flags() & FLAG_SEND_TRIM == 0 || self.is_read_only() {
            // Discard is a hint.
            return Ok(());
        }
        let commands: Vec<Command<'_>> = chunks(offset, len, MAX_EFFECT_BYTES)
            .map(|(at, n)| Command::bare(CMD_TRIM, at, n as u32))
            .collect();
        self.execute_write(&commands)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> DeviceResult<()> {
        check_range(&self.name, "write_zeroes", offset, len, self.size_bytes)?;
        self.check_aligned("write_zeroes", offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.check_writable()?;
        let commands: Vec<Command<'_>> = if self.flags() & FLAG_SEND_WRITE_ZEROES != 0 {
            chunks(offset, len, MAX_EFFECT_BYTES)
                .map(|(at, n)| Command::bare(CMD_WRITE_ZEROES, at, n as u32))
                .collect()
        } else {
            chunks(offset, len, self.zeroes.len() as u64)
                .map(|(at, n)| Command {
                    command: CMD_WRITE,
                    offset: at,
                    len: n as u32,
                    payload: vec![&self.zeroes[..n as usize]],
                })
                .collect()
        };
        self.execute_write(&commands)
    }

    /// The export's `base:allocation` block status, asked on a side
    /// connection (see [`super::extents`]). Anything it cannot tell, or a
    /// failure to ask, is data.
    /// A question to the server, over the network.
    fn allocation_may_wait(&self) -> bool {
        true
    }

    fn allocation(&self, offset: u64, len: u64) -> DeviceResult<Vec<AllocationRun>> {
        check_range(&self.name, "allocation", offset, len, self.size_bytes)?;
        let all_data = || AllocationRun::all_data(len);
        let Some(extents) = &self.extents else {
            return Ok(all_data());
        };
        if len == 0 {
            return Ok(all_data());
        }
        // The side connection sees only flushed writes (multi-conn's promise).
        if self.flush_debt.owed() {
            self.flush()?;
        }
        match extents.query(offset, len) {
            Ok(Some(runs)) => Ok(runs),
            Ok(None) => Ok(all_data()),
            Err(err) => {
                tracing::debug!(device = %self.name, "block status of {offset}+{len} failed: {err}");
                Ok(all_data())
            }
        }
    }
}
