//! A module's kubelet home: one thread, with a current-thread runtime, on which the module's
//! kubelet cell and the gRPC servers of its resources run together.
//!
//! A kubelet call then reaches the module and comes back without a hop between threads: on a
//! busy or virtualised machine every hop is a thread woken on another CPU, and two of them cost
//! more than the module's own work. The home outlives module versions (an upgrade's new cell
//! moves in beside the servers, which keep their sockets and streams); only a cell stuck in a
//! host call takes its home down with it, and then the lane opens a new home and the servers
//! move (see `Lane::moved`).

use std::sync::Arc;

use tokio::runtime::Handle;
use tokio::sync::{mpsc, watch};

use super::cell::LocalBoxFuture;

/// Work that must run on the home's thread (it is not `Send`): a cell's job loop.
pub type LocalTask = Box<dyn FnOnce() -> LocalBoxFuture<'static, ()> + Send>;

pub struct Home {
    handle: Handle,
    local: mpsc::UnboundedSender<LocalTask>,
    /// Set once a cell here got stuck in a host call: the thread may never run again, so every
    /// lane and server living here moves to a new home.
    lost: watch::Sender<bool>,
}

impl Home {
    /// Starts the thread. It ends once every `Arc<Home>` is gone (and with it every task
    /// still running there).
    pub fn start(name: String) -> std::io::Result<Arc<Home>> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (local, mut tasks) = mpsc::unbounded_channel::<LocalTask>();
        std::thread::Builder::new().name(name).spawn(move || {
            let set = tokio::task::LocalSet::new();
            set.block_on(&runtime, async move {
                while let Some(task) = tasks.recv().await {
                    tokio::task::spawn_local(task());
                }
            });
        })?;
        Ok(Arc::new(Home {
            handle,
            local,
            lost: watch::Sender::new(false),
        }))
    }

    /// Marks the home lost (a cell here is stuck).
    pub fn lose(&self) {
        self.lost.send_replace(true);
    }

    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Flips to true when the home is lost.
    pub fn lost(&self) -> watch::Receiver<bool> {
        self.lost.subscribe()
    }

    /// Where `Send` work (a gRPC server) is spawned to run on this home's thread.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Runs `task` on this home's thread; false if the thread is gone.
    pub fn spawn_local(&self, task: LocalTask) -> bool {
        self.local.send(task).is_ok()
    }
}
