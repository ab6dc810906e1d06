//! `cairn top`: a live view of one daemon, refreshed from its admin socket
//! (`status`, every second by default): IOPS and MB/s, hit ratio, dirty
//! share, write-back rate and the time to clean at that rate, latency p50
//! and p99 per operation, cache and origin state. `--once` prints one frame
//! as plain text (two samples an interval apart) and exits; when stdout is
//! not a terminal, a plain-text frame is printed every interval instead of
//! the drawn view (`plain`).

mod plain;
mod render;
mod view;

use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use serde_json::Value;

use crate::admin::{client, AdminReply, AdminRequest};
use render::{draw, Screen};
use view::View;

/// The daemon's status, or `None` if no daemon answers for `cache`.
fn sample(cache: &Path) -> Option<Result<Value>> {
    let mut status = None;
    let answer = client::ask_daemon(cache, &AdminRequest::Status, &mut |reply| {
        if let AdminReply::Status { status: s } = reply {
            status = Some(s);
        }
    })?;
    Some(match (answer, status) {
        (Ok(()), Some(s)) => Ok(s),
        (Ok(()), None) => Err(anyhow::anyhow!("the daemon answered without a status")),
        (Err(e), _) => Err(e.into()),
    })
}

fn require_sample(cache: &Path) -> Result<Value> {
    match sample(cache) {
        Some(s) => s,
        None => bail!(
            "no daemon serves {}: cairn top watches a running `cairn serve --cache {}` (status works offline)",
            cache.display(),
            cache.display()
        ),
    }
}

pub fn run(cache: &Path, once: bool, interval_ms: u64) -> Result<()> {
    let interval = Duration::from_millis(interval_ms.max(100));
    let name = cache.display().to_string();
    if once {
        let before = require_sample(cache)?;
        let started = Instant::now();
        std::thread::sleep(interval);
        let now = require_sample(cache)?;
        let view = View::between(&name, &before, &now, started.elapsed());
        say!("{}", plain::frame(&view).trim_end())?;
        return Ok(());
    }
    if !std::io::stdout().is_terminal() {
        return run_plain(cache, &name, interval);
    }
    // Fail before taking over the terminal if there is nothing to watch.
    let mut before = require_sample(cache)?;
    let mut taken = Instant::now();
    let mut terminal = ratatui::init();
    let result = (|| -> Result<()> {
        let mut view: Option<View> = None;
        let mut why = String::from("waiting for the first interval");
        loop {
            terminal.draw(|f| match &view {
                Some(v) => draw(f, &Screen::View(v)),
                None => draw(
                    f,
                    &Screen::Waiting {
                        cache: &name,
                        why: &why,
                    },
                ),
            })?;
            // Keys until the next sample is due.
            let due = taken + interval;
            while let Some(left) = due.checked_duration_since(Instant::now()) {
                if event::poll(left)? {
                    if let Event::Key(k) = event::read()? {
                        let ctrl_c = k.code == KeyCode::Char('c')
                            && k.modifiers.contains(KeyModifiers::CONTROL);
                        if k.kind == KeyEventKind::Press
                            && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc) || ctrl_c)
                        {
                            return Ok(());
                        }
                    }
                }
            }
            match sample(cache) {
                Some(Ok(now)) => {
                    view = Some(View::between(&name, &before, &now, taken.elapsed()));
                    before = now;
                    taken = Instant::now();
                }
                Some(Err(e)) => {
                    view = None;
                    why = format!("the daemon did not answer: {e:#}");
                    taken = Instant::now();
                }
                None => {
                    view = None;
                    why = "no daemon serves this cache (stopped?); retrying every interval".into();
                    taken = Instant::now();
                }
            }
        }
    })();
    ratatui::restore();
    result
}

/// Without a terminal: a plain-text frame every interval, a blank line
/// between frames, until stopped (or stdout closes); a daemon that does
/// not answer is said on a line of its own and asked again, as the live
/// view does.
fn run_plain(cache: &Path, name: &str, interval: Duration) -> Result<()> {
    let mut before = require_sample(cache)?;
    let mut taken = Instant::now();
    loop {
        std::thread::sleep(interval.saturating_sub(taken.elapsed()));
        let elapsed = taken.elapsed();
        taken = Instant::now();
        match sample(cache) {
            Some(Ok(now)) => {
                let view = View::between(name, &before, &now, elapsed);
                say!("{}", plain::frame(&view))?;
                before = now;
            }
            Some(Err(e)) => say!("cairn top: {name}: the daemon did not answer: {e:#}\n")?,
            None => say!("cairn top: {name}: no daemon serves this cache (stopped?); retrying every interval\n")?,
        }
    }
}
