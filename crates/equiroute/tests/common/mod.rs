//! Helpers shared by the binary's integration tests.

#![allow(clippy::unwrap_used, dead_code)]

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus};

/// Sends SIGTERM and waits (20 s at most) for the gateway to drain and save its last snapshot.
pub fn terminate(child: &mut Child) -> ExitStatus {
    let termed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    if !termed {
        let _ = child.kill();
        let _ = child.wait();
        panic!("could not send SIGTERM (is `kill` on PATH?)");
    }
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("the gateway did not stop within 20 s of SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `GET path`: the whole answer, head and body.
pub fn get(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

pub fn post(addr: &str, path: &str, body: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}
