//! A loopback TCP proxy a test can hold and cut, for what a client does while its server's
//! answers are late or its connection breaks.
//!
//! Everything the client sends goes through at once. What the server sends goes through
//! unless [`Proxy::hold_answers`] is in force: it is then read and kept, in order, until
//! [`Proxy::release_answers`]. [`Proxy::sever`] closes every connection made so far (both
//! sides see the socket close); later connections are served as usual.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A proxy on `127.0.0.1` to one upstream address; it stops when dropped.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    hold: watch::Sender<bool>,
    severed: watch::Sender<u64>,
    accepting: JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy to `upstream` on a free loopback port, its tasks on the current runtime.
    ///
    /// # Errors
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (hold, _) = watch::channel(false);
        let (severed, _) = watch::channel(0u64);
        let accepting = tokio::spawn(accept(listener, upstream, hold.clone(), severed.clone()));
        Ok(Proxy {
            addr,
            hold,
            severed,
            accepting,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// From now on, what the server sends is kept instead of forwarded.
    pub fn hold_answers(&self) {
        self.hold.send_replace(true);
    }

    /// Forwards what was kept, and everything after it.
    pub fn release_answers(&self) {
        self.hold.send_replace(false);
    }

    /// Closes every connection made so far.
    pub fn sever(&self) {
        self.severed.send_modify(|generation| *generation += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accepting.abort();
        self.sever();
    }
}

async fn accept(
    listener: TcpListener,
    upstream: SocketAddr,
    hold: watch::Sender<bool>,
    severed: watch::Sender<u64>,
) {
    while let Ok((client, _)) = listener.accept().await {
        let Ok(server) = TcpStream::connect(upstream).await else {
            continue; // the client sees its connection close
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (client_read, client_write) = client.into_split();
        let (server_read, server_write) = server.into_split();
        let mut cut = severed.subscribe();
        cut.mark_unchanged();
        tokio::spawn(until_severed(
            cut.clone(),
            forward(client_read, server_write, None),
        ));
        tokio::spawn(until_severed(
            cut,
            forward(server_read, client_write, Some(hold.subscribe())),
        ));
    }
}

/// Runs `work` until the proxy severs the connections it had when `cut` was taken.
async fn until_severed(mut cut: watch::Receiver<u64>, work: impl Future<Output = ()>) {
    tokio::select! {
        _ = cut.changed() => {}
        () = work => {}
    }
}

/// Copies `from` into `to` until either closes; with `hold`, each chunk waits while it is set.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut hold: Option<watch::Receiver<bool>>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if let Some(hold) = &mut hold
            && hold.wait_for(|held| !*held).await.is_err()
        {
            break;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
