//! The thread NVML queries run on, so that whoever asks can stop waiting.
//!
//! A sick GPU or a wedged driver can make an NVML call block for seconds or forever, and no
//! signal can interrupt it. Each query is therefore handed to this thread and waited for only
//! until the asking call's deadline: past it the asker gets [`NvmlError::Stalled`] and its module
//! call ends on time, its instance intact, while the query finishes here whenever NVML lets it.
//! Queries queued behind a stuck one are skipped once nobody waits for them. One thread serves
//! every module of the node: NVML serialises much of its work internally anyway, and a driver
//! stuck for one caller is stuck for all.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::NvmlError;

type Query = Box<dyn FnOnce() + Send>;

/// Queries waiting for the thread at most: while NVML is stuck, later ones fail at once rather
/// than pile up.
const QUEUE: usize = 64;

struct Asked {
    /// Nobody waits for the answer past this: a query still queued then is dropped.
    until: Instant,
    query: Query,
}

/// Where queries go, and what the thread is doing now (for the stall message).
pub struct Asker {
    queries: Mutex<Option<mpsc::SyncSender<Asked>>>,
    busy: Arc<Mutex<Option<Instant>>>,
    /// Counts the queries NVML answered (whatever it answered).
    answered: Arc<tokio::sync::watch::Sender<u64>>,
}

impl Asker {
    pub fn new() -> Asker {
        Asker {
            queries: Mutex::new(None),
            busy: Arc::default(),
            answered: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// Changes whenever NVML answers a query: it is not (or no longer) stuck.
    pub fn answered(&self) -> tokio::sync::watch::Receiver<u64> {
        self.answered.subscribe()
    }

    /// Runs `query` on the NVML thread and returns its answer, or [`NvmlError::Stalled`] at
    /// `until` if NVML has not answered by then.
    pub fn ask<T, F>(&self, until: Instant, query: F) -> Result<T, NvmlError>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, NvmlError> + Send + 'static,
    {
        let now = Instant::now();
        if now >= until {
            // The call spent its time before asking: not NVML's doing.
            return Err(NvmlError::Failed(
                "the call's deadline passed before NVML was asked".into(),
            ));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let asked = Asked {
            until,
            query: Box::new(move || {
                let _ = tx.send(query());
            }),
        };
        self.send(asked)?;
        match rx.recv_timeout(until - now) {
            Ok(answer) => answer,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(self.stalled(until - now)),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(NvmlError::Failed(
                "the NVML thread dropped the query (it panicked)".into(),
            )),
        }
    }

    fn send(&self, asked: Asked) -> Result<(), NvmlError> {
        let mut queries = self.queries.lock().unwrap_or_else(|p| p.into_inner());
        let asked = match queries.as_ref() {
            Some(tx) => match tx.try_send(asked) {
                Ok(()) => return Ok(()),
                Err(mpsc::TrySendError::Full(_)) => return Err(self.stalled(Duration::ZERO)),
                // The thread is gone (a query panicked): start another.
                Err(mpsc::TrySendError::Disconnected(asked)) => asked,
            },
            None => asked,
        };
        let (tx, rx) = mpsc::sync_channel::<Asked>(QUEUE);
        let (busy, answered) = (self.busy.clone(), self.answered.clone());
        std::thread::Builder::new()
            .name("nvml-query".into())
            .spawn(move || serve(rx, &busy, &answered))
            .map_err(|e| NvmlError::Failed(format!("cannot start the NVML thread: {e}")))?;
        let sent = tx.try_send(asked).is_ok();
        *queries = Some(tx);
        if sent {
            Ok(())
        } else {
            Err(NvmlError::Failed("the NVML thread ended at once".into()))
        }
    }

    fn stalled(&self, waited: Duration) -> NvmlError {
        let busy = *self.busy.lock().unwrap_or_else(|p| p.into_inner());
        NvmlError::Stalled {
            waited,
            stuck_for: busy.map(|since| since.elapsed()),
        }
    }
}

fn serve(
    queries: mpsc::Receiver<Asked>,
    busy: &Mutex<Option<Instant>>,
    answered: &tokio::sync::watch::Sender<u64>,
) {
    while let Ok(asked) = queries.recv() {
        let now = Instant::now();
        if now >= asked.until {
            continue;
        }
        *busy.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
        (asked.query)();
        *busy.lock().unwrap_or_else(|p| p.into_inner()) = None;
        answered.send_modify(|n| *n += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_comes_back() {
        let asker = Asker::new();
        let until = Instant::now() + Duration::from_secs(10);
        assert_eq!(asker.ask(until, || Ok(7)), Ok(7));
        assert_eq!(
            asker.ask(until, || Err::<u32, _>(NvmlError::GpuLost)),
            Err(NvmlError::GpuLost)
        );
    }

    #[test]
    fn a_stuck_query_ends_the_wait_at_the_deadline_and_later_ones_are_skipped_then_served() {
        let asker = Asker::new();
        let (release, blocked) = mpsc::channel::<()>();
        let far = Instant::now() + Duration::from_secs(60);
        let first = asker.ask(Instant::now() + Duration::from_millis(50), move || {
            let _ = blocked.recv();
            Ok(1)
        });
        assert!(matches!(first, Err(NvmlError::Stalled { .. })), "{first:?}");
        // Queued behind the stuck query: its wait ends at its own deadline too, and the
        // message says how long NVML has been stuck.
        let ran = Arc::new(Mutex::new(false));
        let flag = ran.clone();
        let second = asker.ask(Instant::now() + Duration::from_millis(50), move || {
            *flag.lock().unwrap() = true;
            Ok(2)
        });
        let Err(NvmlError::Stalled { stuck_for, .. }) = second else {
            panic!("{second:?}");
        };
        assert!(stuck_for.is_some(), "the thread is known to be busy");
        release.send(()).unwrap();
        // Once NVML answers again, queries are served, and the one nobody waited for any more
        // was never run.
        assert_eq!(asker.ask(far, || Ok(3)), Ok(3));
        assert!(
            !*ran.lock().unwrap(),
            "a query past its deadline is not run"
        );
    }

    #[test]
    fn a_deadline_already_past_asks_nothing_and_is_no_stall() {
        let asker = Asker::new();
        let r = asker.ask(Instant::now(), || -> Result<u32, _> {
            panic!("must not run")
        });
        assert!(matches!(r, Err(NvmlError::Failed(_))), "{r:?}");
    }

    #[test]
    fn while_nvml_is_stuck_queries_do_not_pile_up() {
        let asker = Asker::new();
        let (release, blocked) = mpsc::channel::<()>();
        let soon = || Instant::now() + Duration::from_millis(20);
        let _ = asker.ask(soon(), move || {
            let _ = blocked.recv();
            Ok(0)
        });
        // Each waits its 20 ms and leaves its query queued; past the queue's bound they fail at
        // once.
        for _ in 0..QUEUE {
            let _ = asker.ask(soon(), || Ok(1));
        }
        let started = Instant::now();
        let r = asker.ask(Instant::now() + Duration::from_secs(60), || Ok(2));
        assert!(matches!(r, Err(NvmlError::Stalled { .. })), "{r:?}");
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "answered without waiting"
        );
        release.send(()).unwrap();
    }
}
