//! Knowing when the kubelet has let go of a resource's socket: every accepted connection is
//! counted until it closes.
//!
//! When a resource must register again with other options, the kubelet has to finish with the
//! old registration first: once its ListAndWatch stream ends, the kubelet disconnects that
//! client, and on kubelets before kubernetes#135437 that disconnect, if processed after a new
//! `Register`, leaves the new registration at allocatable 0. Waiting for the connection count
//! to reach zero is waiting for that disconnect.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};

/// A connection that counts itself open until dropped.
pub struct Counted {
    stream: UnixStream,
    open: watch::Sender<usize>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.open.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// `incoming` with every connection counted in `open`.
pub fn counted(
    incoming: impl Stream<Item = io::Result<UnixStream>>,
    open: watch::Sender<usize>,
) -> impl Stream<Item = io::Result<Counted>> {
    incoming.map(move |accepted| {
        accepted.map(|stream| {
            open.send_modify(|n| *n += 1);
            Counted {
                stream,
                open: open.clone(),
            }
        })
    })
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}
