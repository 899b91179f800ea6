//! Reading the HTTP/2 settings a peer advertises, off a raw socket: what a test checks to
//! know which transport settings a server or client really applies (tonic does not show them).

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// The client connection preface (RFC 9113 §3.4).
pub const CLIENT_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// SETTINGS_MAX_FRAME_SIZE's identifier.
pub const SETTINGS_MAX_FRAME_SIZE: u16 = 0x5;
/// The SETTINGS frame type.
const SETTINGS: u8 = 0x4;

/// Connects to an HTTP/2 server as a client would (preface, empty SETTINGS) and returns the
/// settings of the server's first frame, which the protocol requires to be its SETTINGS.
pub fn server_settings(stream: &mut TcpStream) -> io::Result<Vec<(u16, u32)>> {
    stream.write_all(CLIENT_PREFACE)?;
    // An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
    stream.write_all(&[0, 0, 0, SETTINGS, 0, 0, 0, 0, 0])?;
    first_settings(stream)
}

/// How long [`accept_client_settings`] waits for the client, and then for its settings.
const WAIT: Duration = Duration::from_secs(10);

/// Accepts one connection on `listener` and returns what its client advertises (see
/// [`client_settings`]); a client that does not connect, or says nothing, within 10 s each is
/// a `TimedOut` error, not a hung test.
pub fn accept_client_settings(listener: &TcpListener) -> io::Result<Vec<(u16, u32)>> {
    listener.set_nonblocking(true)?;
    let started = std::time::Instant::now();
    let mut stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => {
                if started.elapsed() > WAIT {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no client connected",
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(err) => return Err(err),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(WAIT))?;
    client_settings(&mut stream)
}

/// The value of setting `id` among `settings`, if advertised.
pub fn setting(settings: &[(u16, u32)], id: u16) -> Option<u32> {
    settings
        .iter()
        .find(|(got, _)| *got == id)
        .map(|(_, value)| *value)
}

/// Reads a client's connection preface and returns the settings of its first frame, which the
/// protocol requires to be its SETTINGS.
pub fn client_settings(stream: &mut TcpStream) -> io::Result<Vec<(u16, u32)>> {
    let mut preface = [0; CLIENT_PREFACE.len()];
    stream.read_exact(&mut preface)?;
    if preface != CLIENT_PREFACE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an HTTP/2 client preface",
        ));
    }
    first_settings(stream)
}

/// The settings in the frame read next, which must be a SETTINGS frame.
fn first_settings(stream: &mut TcpStream) -> io::Result<Vec<(u16, u32)>> {
    let mut header = [0u8; 9];
    stream.read_exact(&mut header)?;
    let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    if header[3] != SETTINGS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("first frame is of type {}, not SETTINGS", header[3]),
        ));
    }
    let mut payload = vec![0u8; length];
    stream.read_exact(&mut payload)?;
    Ok(payload
        .chunks_exact(6)
        .map(|setting| {
            (
                u16::from_be_bytes([setting[0], setting[1]]),
                u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]),
            )
        })
        .collect())
}
