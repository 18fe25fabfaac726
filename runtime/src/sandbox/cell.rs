//! Module cells: where a module's code and its host calls run, away from the agent's workers.
//!
//! A [`Cell`] is one OS thread with a current-thread runtime of its own, owning one occupant (a
//! module instance) and fed by a bounded channel. Everything the occupant does, its host calls
//! included, runs on that thread, so a host call that blocks (a hung sysfs read, a vendor library
//! stuck on a sick device) blocks only that thread.
//!
//! A [`Lane`] is what callers hold: it sends each job to its current cell and waits for the
//! answer, never past the call's deadline: the time a job waits for the cell counts, so a caller
//! (the kubelet, through a gRPC server on the agent's runtime) always has its answer or its
//! error at the deadline. The cell cuts a running job off at that same end; the caller's own
//! wait is only a backstop. When a job overruns its end by [`STUCK_GRACE`] without the cell
//! noticing (the thread is blocked in a syscall that epoch interruption cannot stop), the cell is
//! abandoned: its thread is left to finish or die with the blocked call, and a fresh cell takes
//! the next job; a job merely queued behind a long one is not a sign of anything. Abandoned cells
//! are bounded per module ([`MAX_ABANDONED`]); past the bound the module is failed until it is
//! loaded again.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::engine::EPOCH_TICK;
use crate::device::PluginError;

pub type LocalBoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// Makes a fresh occupant inside the cell's thread (instantiates the module and calls `init`).
pub type Factory<S> = Arc<dyn Fn() -> LocalBoxFuture<'static, Result<S, Failure>> + Send + Sync>;

/// A unit of work for a cell. Returns whether the occupant must be discarded (it trapped).
pub type Work<S> = Box<dyn for<'a> FnOnce(&'a mut S) -> LocalBoxFuture<'a, bool> + Send>;

/// Jobs queued per cell before callers wait for room (within their own deadline).
const QUEUE: usize = 64;
/// How long past its budget a running job may go before its cell counts as stuck in a host call.
/// A guest that merely spins is stopped by the epoch within a tick of its budget, so anything far
/// past that is a thread the runtime cannot reach.
pub const STUCK_GRACE: Duration = Duration::from_millis(500);
/// Cells a module may leave stuck in host calls before it is failed for good (until reloaded).
pub const MAX_ABANDONED: u32 = 4;
/// How late past a job's own deadline its caller still waits for the cell's answer: the cell's
/// timer needs a tick to see the guest yield, and on a node whose CPUs are busy its thread may
/// wait that long again to run. Only a cell that cannot answer (a thread stuck in a host call)
/// costs its caller this much.
const ANSWER_SLACK: Duration = Duration::from_millis(10 * EPOCH_TICK.as_millis() as u64);

/// First wait before re-instantiating a crashed module; doubles on every crash in a row.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// How a job failed inside a cell.
#[derive(Debug, Clone)]
pub enum Failure {
    /// The module reported an error itself.
    Plugin(PluginError),
    /// The guest trapped (or its `init` did, making a fresh instance).
    Trap(String),
    /// Making a fresh instance failed; `init_error` keeps the module's own error, if any.
    Instantiate {
        message: String,
        init_error: Option<PluginError>,
    },
    /// The module answered, but its answer broke a rule (see `checks`).
    Violation(String),
    /// The job never reached the module (backing off after crashes, module failed).
    Unavailable(String),
    /// The job did not finish within its deadline (or waited too long to start).
    Deadline,
    /// A host call the job made stopped waiting at the deadline (a vendor library that did not
    /// answer, as NVML on a wedged driver): slow, not broken, so the instance is kept.
    Stalled(String),
    /// The cell did not cut the job off: the caller's backstop fired.
    Overran,
}

struct Job<S> {
    id: u64,
    /// When the caller's deadline is over: a job still queued then is dropped unrun, and a
    /// running one is cut off.
    end: Instant,
    /// Whether the caller still waits for the answer.
    wanted: Box<dyn Fn() -> bool + Send>,
    work: Work<S>,
    /// Answers the caller without running `work`.
    refuse: Box<dyn FnOnce(Failure) + Send>,
}

/// The job a cell is running: its id, by when it should have ended, and its claim on the epoch
/// ticker.
#[derive(Default)]
struct Running {
    now: Mutex<Option<(u64, Instant, Option<super::engine::Disarm>)>>,
}

impl Running {
    fn start(&self, id: u64, until: Instant, ticking: Option<super::engine::Disarm>) {
        *self.now.lock().unwrap_or_else(|p| p.into_inner()) = Some((id, until, ticking));
    }

    fn end(&self) {
        *self.now.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The cell is abandoned: its stuck job no longer keeps the ticker running.
    fn disarm(&self) {
        let now = self.now.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, _, Some(ticking))) = now.as_ref() {
            ticking.disarm();
        }
    }

    fn get(&self) -> Option<(u64, Instant)> {
        self.now
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|(id, until, _)| (*id, *until))
    }

    /// Whether the running job is past its end by more than [`STUCK_GRACE`]: its thread is
    /// blocked where the runtime cannot reach it.
    fn stuck(&self, id: Option<u64>) -> bool {
        self.get().is_some_and(|(running, until)| {
            id.is_none_or(|id| id == running) && Instant::now() > until + STUCK_GRACE
        })
    }
}

/// One thread and its channel. Dropping every sender ends the thread after its current job.
struct Cell<S> {
    jobs: mpsc::Sender<Job<S>>,
    running: Arc<Running>,
    generation: u64,
}

impl<S> Clone for Cell<S> {
    fn clone(&self) -> Self {
        Cell {
            jobs: self.jobs.clone(),
            running: self.running.clone(),
            generation: self.generation,
        }
    }
}

/// What all lanes of one module share: how many cells it left stuck, and whether it is failed.
#[derive(Default)]
pub struct Fate {
    abandoned: AtomicU32,
    /// Instances made again in a cell after the previous one trapped or failed.
    restarts: AtomicU64,
    failed: Mutex<Option<String>>,
}

impl Fate {
    /// Why the module no longer runs, once too many of its cells got stuck.
    pub fn failed(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn abandoned(&self) -> u32 {
        self.abandoned.load(Ordering::Relaxed)
    }

    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }
}

struct LaneState<S> {
    cell: Option<Cell<S>>,
    generation: u64,
}

struct LaneInner<S> {
    module: Arc<str>,
    label: &'static str,
    factory: Factory<S>,
    init_deadline: Duration,
    fate: Arc<Fate>,
    next_id: AtomicU64,
    state: Mutex<LaneState<S>>,
}

/// A stream of jobs for one module, served by one cell at a time. Clones share the lane.
pub struct Lane<S> {
    inner: Arc<LaneInner<S>>,
}

impl<S> Clone for Lane<S> {
    fn clone(&self) -> Self {
        Lane {
            inner: self.inner.clone(),
        }
    }
}

impl<S: 'static> Lane<S> {
    /// A lane whose first cell (a thread of its own) starts now; the cell instantiates on its
    /// first job, within `init_deadline`.
    pub fn new(
        module: Arc<str>,
        label: &'static str,
        factory: Factory<S>,
        init_deadline: Duration,
        fate: Arc<Fate>,
    ) -> std::io::Result<Lane<S>> {
        let cell = spawn_cell(&module, label, factory.clone(), (init_deadline, &fate), 0)?;
        Ok(Lane {
            inner: Arc::new(LaneInner {
                module,
                label,
                factory,
                init_deadline,
                fate,
                next_id: AtomicU64::new(1),
                state: Mutex::new(LaneState {
                    cell: Some(cell),
                    generation: 0,
                }),
            }),
        })
    }

    /// Runs `work` on the lane's cell and answers within `deadline` of now, whatever the cell
    /// does: the wait for the cell, a fresh instance's init (after a crash) and the run all
    /// count against it.
    pub async fn call<T, F>(&self, deadline: Duration, f: F) -> Result<T, Failure>
    where
        T: Send + 'static,
        F: for<'a> FnOnce(&'a mut S) -> LocalBoxFuture<'a, Result<T, Failure>> + Send + 'static,
    {
        if let Some(reason) = self.inner.fate.failed() {
            return Err(Failure::Unavailable(reason));
        }
        let cell = {
            let state = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
            state.cell.clone()
        };
        let Some(cell) = cell else {
            return Err(Failure::Unavailable(
                self.inner.fate.failed().unwrap_or_else(|| "stopped".into()),
            ));
        };
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let end = Instant::now() + deadline;
        let (reply_tx, mut reply) = oneshot::channel::<Result<T, Failure>>();
        // Whichever of `work` and `refuse` the cell runs answers the caller.
        let reply_tx = Arc::new(Mutex::new(Some(reply_tx)));
        let answer = move |tx: &Mutex<Option<oneshot::Sender<_>>>, r| {
            if let Some(tx) = tx.lock().ok().and_then(|mut tx| tx.take()) {
                let _ = tx.send(r);
            }
        };
        let refuse_tx = reply_tx.clone();
        let refuse = Box::new(move |f: Failure| answer(&refuse_tx, Err(f)));
        let wanted_tx = reply_tx.clone();
        let wanted = Box::new(move || {
            wanted_tx
                .lock()
                .ok()
                .is_some_and(|tx| tx.as_ref().is_some_and(|tx| !tx.is_closed()))
        });
        let work: Work<S> = Box::new(move |occupant| {
            Box::pin(async move {
                let result = f(occupant).await;
                let poisoned = matches!(result, Err(Failure::Trap(_)));
                answer(&reply_tx, result);
                poisoned
            })
        });
        let job = Job {
            id,
            end,
            wanted,
            work,
            refuse,
        };
        match tokio::time::timeout_at(end, cell.jobs.send(job)).await {
            Err(_) => return Err(self.start_timed_out(&cell)),
            Ok(Err(_)) => {
                // The cell's thread is gone (it panicked): a fresh cell takes the next call.
                self.abandon(cell.generation);
                return Err(Failure::Unavailable("its cell has stopped".into()));
            }
            Ok(Ok(())) => {}
        }
        // The cell itself cuts the job off at `end`, so this wait is only a backstop for a cell
        // that cannot (its thread blocked in a host call, or still busy with an earlier job).
        match tokio::time::timeout_at(end + ANSWER_SLACK, &mut reply).await {
            Ok(Ok(result)) => result,
            // Dropped unrun (too late to start), or cut off at its deadline.
            Ok(Err(_)) => Err(Failure::Deadline),
            Err(_) => {
                // Whatever holds the cell is past our end. If it is past its own by the grace,
                // the cell is stuck and is abandoned now; if it is still within it, it is looked
                // at again then.
                let running = cell.running.get();
                if cell.running.stuck(None) {
                    self.abandon(cell.generation);
                } else if let Some((job, until)) = running {
                    self.watch_for_stuck(cell, job, until + STUCK_GRACE);
                }
                // Ours, past its own end (not merely in a fresh instance's init): the cell did not
                // stop it.
                match running {
                    Some((job, until)) if job == id && Instant::now() > until => {
                        Err(Failure::Overran)
                    }
                    _ => Err(Failure::Deadline),
                }
            }
        }
    }

    /// After a caller gave up on job `id`: if the cell is still running it at `at`, its thread is
    /// blocked where the runtime cannot interrupt it, and the cell is abandoned.
    fn watch_for_stuck(&self, cell: Cell<S>, id: u64, at: Instant) {
        let lane = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            if cell.running.stuck(Some(id)) {
                lane.abandon(cell.generation);
            }
        });
    }

    /// A job waited its whole deadline to start. Whatever holds the cell may be a job nobody waits
    /// for any more (its caller was cancelled): if it is stuck past its own end, the cell is
    /// abandoned here, so a lane never stays blocked for want of a watching caller.
    fn start_timed_out(&self, cell: &Cell<S>) -> Failure {
        if cell.running.stuck(None) {
            self.abandon(cell.generation);
        }
        Failure::Deadline
    }

    /// Replaces the cell of `generation` (if still current) with a fresh one; it counts against
    /// the module.
    fn abandon(&self, generation: u64) {
        let inner = &self.inner;
        let mut state = inner.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.generation != generation {
            return;
        }
        let Some(stuck) = state.cell.take() else {
            return;
        };
        stuck.running.disarm();
        let abandoned = inner.fate.abandoned.fetch_add(1, Ordering::Relaxed) + 1;
        if abandoned > MAX_ABANDONED {
            let reason = format!(
                "failed: {abandoned} of its cells got stuck in host calls (at most {MAX_ABANDONED}); \
                 fix the module and replace its file or edit the registry to load it again"
            );
            tracing::error!(module = &*inner.module, "{reason}");
            *inner.fate.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
            return;
        }
        tracing::warn!(
            module = &*inner.module,
            lane = inner.label,
            "a call is stuck in a host call past its deadline; its cell is abandoned and a fresh \
             one takes the next call ({abandoned} of {MAX_ABANDONED} allowed)"
        );
        self.respawn(&mut state);
    }

    /// A fresh cell for the lane.
    fn respawn(&self, state: &mut LaneState<S>) {
        let inner = &self.inner;
        state.generation += 1;
        let spawned = spawn_cell(
            &inner.module,
            inner.label,
            inner.factory.clone(),
            (inner.init_deadline, &inner.fate),
            state.generation,
        );
        match spawned {
            Ok(cell) => state.cell = Some(cell),
            Err(e) => {
                let reason = format!("failed: cannot start a fresh cell: {e}");
                tracing::error!(module = &*inner.module, "{reason}");
                *inner.fate.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
            }
        }
    }
}

fn spawn_cell<S: 'static>(
    module: &Arc<str>,
    label: &'static str,
    factory: Factory<S>,
    (init_deadline, fate): (Duration, &Arc<Fate>),
    generation: u64,
) -> std::io::Result<Cell<S>> {
    let (jobs, rx) = mpsc::channel(QUEUE);
    let fate = fate.clone();
    let running = Arc::new(Running::default());
    // Time only: a cell does no socket I/O (WASI sockets are off), and without an I/O driver
    // the thread parks on a futex, the cheapest wake-up per call.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let (name, marker) = (module.clone(), running.clone());
    std::thread::Builder::new()
        .name(format!("cell-{label}-{module}"))
        .spawn(move || {
            runtime.block_on(serve(name, factory, (init_deadline, fate), rx, marker));
        })?;
    Ok(Cell {
        jobs,
        running,
        generation,
    })
}

/// When a crashed module may be instantiated again, and how long the next wait will be.
struct Backoff {
    retry_at: Option<Instant>,
    waits: crate::backoff::Backoff,
}

impl Backoff {
    fn crashed(&mut self) {
        self.retry_at = Some(Instant::now() + self.waits.failed());
    }

    fn succeeded(&mut self) {
        self.retry_at = None;
        self.waits.reset();
    }
}

/// The cell's thread: runs jobs one at a time, instantiating when it has no occupant.
async fn serve<S>(
    module: Arc<str>,
    factory: Factory<S>,
    (init_deadline, fate): (Duration, Arc<Fate>),
    mut jobs: mpsc::Receiver<Job<S>>,
    running: Arc<Running>,
) {
    let mut occupant: Option<S> = None;
    let mut backoff = Backoff {
        retry_at: None,
        waits: crate::backoff::Backoff::new(FIRST_BACKOFF, MAX_BACKOFF),
    };
    let mut instantiated_before = false;
    while let Some(job) = jobs.recv().await {
        if Instant::now() >= job.end || !(job.wanted)() {
            continue;
        }
        if occupant.is_none()
            && let Some(at) = backoff.retry_at.filter(|at| Instant::now() < *at)
        {
            (job.refuse)(Failure::Unavailable(format!(
                "restarting after a crash; next attempt in {:?}",
                at - Instant::now()
            )));
            continue;
        }
        let fresh = occupant.is_none();
        // A fresh instance's init may outlast the caller's end (it serves the calls to come).
        let until = if fresh {
            job.end.max(Instant::now() + init_deadline)
        } else {
            job.end
        };
        // Guest code runs from here to `running.end()` (init, then the job): the epoch must
        // advance meanwhile so the guest yields and its deadline can fire.
        let ticking = super::engine::ticking();
        running.start(job.id, until, ticking.as_ref().map(|t| t.disarmer()));
        if fresh {
            match tokio::time::timeout(init_deadline, factory()).await {
                Ok(Ok(made)) => {
                    if instantiated_before {
                        fate.restarts.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(module = &*module, "module re-instantiated");
                    }
                    instantiated_before = true;
                    occupant = Some(made);
                }
                Ok(Err(failure)) => {
                    backoff.crashed();
                    (job.refuse)(failure);
                    running.end();
                    continue;
                }
                Err(_) => {
                    backoff.crashed();
                    (job.refuse)(Failure::Instantiate {
                        message: format!("init missed its {init_deadline:?} deadline"),
                        init_error: None,
                    });
                    running.end();
                    continue;
                }
            }
        }
        let Some(current) = occupant.as_mut() else {
            running.end();
            continue;
        };
        if Instant::now() >= job.end {
            (job.refuse)(Failure::Deadline);
            running.end();
            continue;
        }
        let poisoned = match tokio::time::timeout_at(job.end, (job.work)(current)).await {
            Ok(poisoned) => poisoned,
            Err(_) => {
                tracing::warn!(
                    module = &*module,
                    "call missed its deadline; instance discarded"
                );
                true
            }
        };
        if poisoned {
            occupant = None;
            backoff.crashed();
        } else {
            backoff.succeeded();
        }
        running.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A stand-in occupant whose "host call" can block its thread for real.
    struct Blocker {
        made: usize,
    }

    fn lane(fate: Arc<Fate>) -> (Lane<Blocker>, Arc<AtomicUsize>) {
        let made = Arc::new(AtomicUsize::new(0));
        let counter = made.clone();
        let factory: Factory<Blocker> = Arc::new(move || {
            let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
            Box::pin(async move { Ok(Blocker { made: n }) })
        });
        let lane = Lane::new("m".into(), "test", factory, Duration::from_secs(1), fate).unwrap();
        (lane, made)
    }

    async fn which(lane: &Lane<Blocker>) -> Result<usize, Failure> {
        lane.call(Duration::from_millis(200), |b| {
            Box::pin(async move { Ok(b.made) })
        })
        .await
    }

    /// Blocks the cell's thread (not just the task) until `release` is dropped or sent to.
    async fn block(lane: &Lane<Blocker>, release: std::sync::mpsc::Receiver<()>) -> Failure {
        let r = lane
            .call(Duration::from_millis(100), move |_| {
                Box::pin(async move {
                    let _ = release.recv();
                    Ok(())
                })
            })
            .await;
        r.expect_err("a blocked call cannot answer")
    }

    /// Waits (boundedly) for the watchdog to act; the watchdog fires `STUCK_GRACE` after the
    /// deadline, so this never depends on the machine being fast.
    async fn until_abandoned(fate: &Fate, n: u32) {
        let give_up = Instant::now() + Duration::from_secs(10);
        while fate.abandoned() < n && fate.failed().is_none() && Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn a_cell_blocked_in_a_host_call_is_abandoned_and_replaced() {
        let fate = Arc::new(Fate::default());
        let (lane, made) = lane(fate.clone());
        assert_eq!(which(&lane).await.unwrap(), 1);
        let (release, blocked) = std::sync::mpsc::channel();
        assert!(matches!(block(&lane, blocked).await, Failure::Overran));
        until_abandoned(&fate, 1).await;
        assert_eq!(fate.abandoned(), 1, "the stuck cell was abandoned");
        assert_eq!(which(&lane).await.unwrap(), 2, "a fresh cell answers");
        assert_eq!(made.load(Ordering::SeqCst), 2);
        drop(release);
    }

    #[tokio::test]
    async fn past_the_bound_the_module_is_failed() {
        let fate = Arc::new(Fate::default());
        let (lane, _) = lane(fate.clone());
        let mut releases = Vec::new();
        for n in 1..=MAX_ABANDONED + 1 {
            assert!(fate.failed().is_none(), "failed after only {} cells", n - 1);
            let (release, blocked) = std::sync::mpsc::channel();
            releases.push(release);
            block(&lane, blocked).await;
            until_abandoned(&fate, n).await;
        }
        assert!(fate.failed().is_some());
        assert!(matches!(which(&lane).await, Err(Failure::Unavailable(_))));
    }

    #[tokio::test]
    async fn a_busy_cell_is_not_abandoned() {
        let fate = Arc::new(Fate::default());
        let (lane, _) = lane(fate.clone());
        // A job well within its 2 s budget holds the cell for 1.5 s; a call queued behind it
        // with a 100 ms deadline gets its error at that deadline (never started), and the stuck
        // check runs when the slow job's budget plus the grace is over. The cell is busy, not
        // stuck: it is kept, and answers once the slow job is done.
        let started = Instant::now();
        let slow = lane.call(Duration::from_secs(2), |_| {
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                Ok(1)
            })
        });
        let impatient = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            lane.call(Duration::from_millis(100), |b| {
                Box::pin(async move { Ok(b.made) })
            })
            .await
        };
        let slow = async { (slow.await, Instant::now()) };
        let impatient = async { (impatient.await, Instant::now()) };
        let ((a, slow_done), (b, impatient_done)) = tokio::join!(slow, impatient);
        assert_eq!(a.unwrap(), 1);
        assert!(
            matches!(b, Err(Failure::Deadline)),
            "the impatient caller had its deadline error: {b:?}"
        );
        assert!(
            impatient_done < slow_done,
            "the impatient caller was answered while the slow job still ran"
        );
        // Past the moment the stuck check looks (the slow job's end plus the grace).
        tokio::time::sleep_until(started + Duration::from_secs(2) + STUCK_GRACE * 2).await;
        assert_eq!(fate.abandoned(), 0);
        assert_eq!(which(&lane).await.unwrap(), 1, "the same instance answers");
    }

    #[tokio::test]
    async fn a_stuck_job_whose_caller_went_away_does_not_block_the_lane() {
        let fate = Arc::new(Fate::default());
        let (lane, _) = lane(fate.clone());
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        // The caller is cancelled (as tonic cancels a handler when the kubelet hangs up) while
        // its job blocks the cell's thread: no caller is left to notice the overrun.
        let cancelled = tokio::time::timeout(Duration::from_millis(20), block(&lane, blocked));
        assert!(cancelled.await.is_err(), "the caller was cancelled");
        // Later callers find the cell stuck past its job's end and replace it.
        let give_up = Instant::now() + Duration::from_secs(10);
        let mut answer = which(&lane).await;
        while answer.is_err() && Instant::now() < give_up {
            answer = which(&lane).await;
        }
        assert_eq!(answer.unwrap(), 2, "a fresh cell answers");
        assert_eq!(fate.abandoned(), 1);
        drop(release);
    }
}
