//! A module's stdout and stderr: each line becomes a tracing event tagged with the module's name,
//! rate-limited so a module printing in a loop cannot flood the node's log or slow the agent.
//! Output past the limit is dropped (and counted), never an error the guest could trap on.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Lines a module may log in a burst, and how fast the allowance refills.
const BURST: f64 = 50.0;
const PER_SECOND: f64 = 5.0;
/// Longest line kept; longer ones are cut.
const MAX_LINE: usize = 4096;

struct Limiter {
    tokens: f64,
    at: Instant,
    suppressed: u64,
}

/// A module's log allowance, shared by all its instances (both cells, and every instance made
/// after a crash), so neither a second cell nor trapping on purpose buys more lines.
pub struct OutputAllowance {
    limiter: Mutex<Limiter>,
    dropped: std::sync::atomic::AtomicU64,
}

impl Default for OutputAllowance {
    fn default() -> Self {
        OutputAllowance {
            limiter: Mutex::new(Limiter {
                tokens: BURST,
                at: Instant::now(),
                suppressed: 0,
            }),
            dropped: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

impl OutputAllowance {
    /// Lines dropped over the rate since the module was loaded.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// One module's output, shared by its stdout and stderr.
#[derive(Clone)]
pub struct ModuleOutput {
    module: Arc<str>,
    stream: &'static str,
    budget: Arc<OutputAllowance>,
}

impl ModuleOutput {
    /// The stdout and stderr of `module`, drawing on its one allowance.
    pub fn pair(module: Arc<str>, budget: Arc<OutputAllowance>) -> (ModuleOutput, ModuleOutput) {
        let limiter = budget;
        let out = ModuleOutput {
            module,
            stream: "stdout",
            budget: limiter,
        };
        let err = ModuleOutput {
            stream: "stderr",
            ..out.clone()
        };
        (out, err)
    }

    /// Takes one line's worth of allowance; false when the module is over its rate.
    pub(super) fn admit(&self) -> bool {
        let mut limiter = self
            .budget
            .limiter
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(limiter.at).as_secs_f64() * PER_SECOND;
        limiter.tokens = (limiter.tokens + refill).min(BURST);
        limiter.at = now;
        if limiter.tokens < 1.0 {
            limiter.suppressed += 1;
            self.budget
                .dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return false;
        }
        limiter.tokens -= 1.0;
        if limiter.suppressed > 0 {
            tracing::warn!(
                module = &*self.module,
                "{} log line(s) suppressed (rate limit)",
                limiter.suppressed
            );
            limiter.suppressed = 0;
        }
        true
    }

    fn emit(&self, line: &[u8]) {
        if !self.admit() {
            return;
        }
        let module = &*self.module;
        let text = String::from_utf8_lossy(&line[..line.len().min(MAX_LINE)]);
        tracing::info!(module, stream = self.stream, "{}", escape(text.trim_end()));
    }
}

/// A module's text with every control character (newlines, carriage returns, ANSI escapes)
/// written out as an escape, so one module line is one log line and cannot pose as the host's.
pub(super) fn escape(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return text.into();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

impl IsTerminal for ModuleOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for ModuleOutput {
    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.writer())
    }

    /// A synchronous stream: a guest's line-buffered `println!` becomes one cheap host call
    /// instead of a hand-off to an async writer task per line.
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.writer())
    }
}

impl ModuleOutput {
    fn writer(&self) -> LineWriter {
        LineWriter {
            output: self.clone(),
            line: Vec::new(),
        }
    }
}

struct LineWriter {
    output: ModuleOutput,
    line: Vec<u8>,
}

impl LineWriter {
    fn push(&mut self, buf: &[u8]) {
        for &b in buf {
            if b == b'\n' {
                let line = std::mem::take(&mut self.line);
                self.output.emit(&line);
            } else if self.line.len() < MAX_LINE {
                self.line.push(b);
            }
        }
    }
}

#[wasmtime_wasi::async_trait]
impl OutputStream for LineWriter {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 * 1024)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for LineWriter {
    async fn ready(&mut self) {}
}

impl AsyncWrite for LineWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.output.emit(&line);
        }
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn control_characters_cannot_forge_lines() {
        let forged = "ok\n2026-01-01T00:00:00Z ERROR devicelet: agent stopping\x1b[2J\r";
        let escaped = escape(forged);
        assert!(!escaped.chars().any(char::is_control), "{escaped}");
        assert!(escaped.contains("\\n2026") && escaped.contains("\\u{1b}"));
        assert_eq!(escape("plain text"), "plain text");
    }

    #[test]
    fn a_flood_is_cut_to_the_burst_and_counted() {
        let (out, _) = ModuleOutput::pair("m".into(), Arc::default());
        for _ in 0..1000 {
            out.emit(b"spam");
        }
        let limiter = out.budget.limiter.lock().unwrap();
        assert!(
            limiter.suppressed >= 1000 - BURST as u64 - 1,
            "{}",
            limiter.suppressed
        );
    }

    #[test]
    fn the_allowance_refills_over_time() {
        let (out, _) = ModuleOutput::pair("m".into(), Arc::default());
        for _ in 0..100 {
            out.emit(b"spam");
        }
        out.budget.limiter.lock().unwrap().at -= Duration::from_secs(2);
        out.emit(b"after a pause");
        assert_eq!(
            out.budget.limiter.lock().unwrap().suppressed,
            0,
            "the pause let a line through"
        );
    }
}
