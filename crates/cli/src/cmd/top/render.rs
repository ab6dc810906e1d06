//! Drawing one `cairn top` frame (a [`View`]) with ratatui.

use std::time::Duration;

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Gauge, Paragraph, Row, Table};
use ratatui::Frame;

use super::view::View;

/// What to draw: a view, or why there is none yet.
pub enum Screen<'a> {
    View(&'a View),
    Waiting { cache: &'a str, why: &'a str },
}

pub fn draw(frame: &mut Frame, screen: &Screen) {
    let view = match screen {
        Screen::View(v) => *v,
        Screen::Waiting { cache, why } => {
            let p = Paragraph::new(vec![
                Line::from(format!("cairn top: {cache}")),
                Line::from(why.to_string()),
            ])
            .block(Block::default().borders(Borders::ALL).title(" cairn top "));
            frame.render_widget(p, frame.area());
            return;
        }
    };
    let [header, io, cache, writeback, latency, footer] = Layout::vertical([
        Constraint::Length(3),
        Constraint::Length(5),
        Constraint::Length(3),
        Constraint::Length(3),
        Constraint::Min(4),
        Constraint::Length(1),
    ])
    .areas(frame.area());

    draw_header(frame, view, header);
    draw_io(frame, view, io);
    draw_cache_and_writeback(frame, view, cache, writeback);
    draw_latency(frame, view, latency);
    frame.render_widget(Paragraph::new("q: quit"), footer);
}

fn draw_header(frame: &mut Frame, view: &View, header: Rect) {
    let state_style = |s: &str| {
        if s == "ok" {
            Style::default().fg(Color::Green)
        } else {
            Style::default().fg(Color::Red).add_modifier(Modifier::BOLD)
        }
    };
    let head = Paragraph::new(Line::from(vec![
        Span::raw(format!("{}  mode {}  cache ", view.cache, view.mode)),
        Span::styled(view.cache_state.clone(), state_style(&view.cache_state)),
        Span::raw("  origin "),
        Span::styled(view.origin_state.clone(), state_style(&view.origin_state)),
        Span::raw(format!("  clients {}", view.connections)),
    ]))
    .block(Block::default().borders(Borders::ALL).title(" cairn top "));
    frame.render_widget(head, header);
}

fn draw_io(frame: &mut Frame, view: &View, io: Rect) {
    let hit = view
        .hit_ratio
        .map(|r| format!("{:.1}%", r * 100.0))
        .unwrap_or_else(|| "-".into());
    let rows = vec![
        Row::new(vec![
            "read".to_string(),
            format!("{:.0}", view.read_iops),
            mb(view.read_bytes_per_sec),
            format!("hit ratio {hit}"),
        ]),
        Row::new(vec![
            "write".to_string(),
            format!("{:.0}", view.write_iops),
            mb(view.write_bytes_per_sec),
            format!("flushes {:.0}/s", view.flushes_per_sec),
        ]),
    ];
    let io_table = Table::new(
        rows,
        [
            Constraint::Length(8),
            Constraint::Length(10),
            Constraint::Length(12),
            Constraint::Min(10),
        ],
    )
    .header(
        Row::new(vec!["", "IOPS", "MB/s", ""]).style(Style::default().add_modifier(Modifier::BOLD)),
    )
    .block(Block::default().borders(Borders::ALL).title(" I/O "));
    frame.render_widget(io_table, io);
}

fn draw_cache_and_writeback(frame: &mut Frame, view: &View, cache: Rect, writeback: Rect) {
    let gauge = Gauge::default()
        .block(Block::default().borders(Borders::ALL).title(" cache "))
        .gauge_style(Style::default().fg(Color::Yellow))
        .ratio(view.dirty_share())
        .label(format!(
            "dirty {:.1}%  ({} dirty, {} clean, {} free of {} blocks)",
            view.dirty_share() * 100.0,
            view.dirty_blocks,
            view.clean_blocks,
            view.free_blocks,
            view.cache_blocks
        ));
    frame.render_widget(gauge, cache);

    let wb = super::plain::writeback_line(view);
    let wb = Paragraph::new(wb).block(Block::default().borders(Borders::ALL).title(" write-back "));
    frame.render_widget(wb, writeback);
}

fn draw_latency(frame: &mut Frame, view: &View, latency: Rect) {
    let lat_rows: Vec<Row> = view
        .latencies
        .iter()
        .map(|l| {
            Row::new(vec![
                l.op.clone(),
                l.requests.to_string(),
                bound(l.p50_le_us),
                bound(l.p99_le_us),
            ])
        })
        .collect();
    let lat = Table::new(
        lat_rows,
        [
            Constraint::Length(14),
            Constraint::Length(10),
            Constraint::Length(12),
            Constraint::Length(12),
        ],
    )
    .header(
        Row::new(vec!["operation", "requests", "p50", "p99"])
            .style(Style::default().add_modifier(Modifier::BOLD)),
    )
    .block(Block::default().borders(Borders::ALL).title(format!(
        " latency over the last {} ",
        duration(view.interval)
    )));
    frame.render_widget(lat, latency);
}

pub fn mb(bytes_per_sec: f64) -> String {
    format!("{:.1}", bytes_per_sec / 1e6)
}

pub fn bound(le_us: Option<u64>) -> String {
    match le_us {
        Some(us) if us >= 1000 => format!("<= {} ms", us / 1000),
        Some(us) => format!("<= {us} us"),
        None => "> 1 s".to_string(),
    }
}

pub fn duration(d: Duration) -> String {
    let secs = d.as_secs_f64();
    if secs < 1.0 {
        format!("{:.0} ms", secs * 1000.0)
    } else if secs < 120.0 {
        format!("{secs:.1} s")
    } else if secs < 7200.0 {
        format!("{:.0} min", secs / 60.0)
    } else {
        format!("{:.1} h", secs / 3600.0)
    }
}
