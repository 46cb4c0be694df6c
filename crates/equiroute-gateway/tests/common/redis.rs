//! A `redis-server` of the test's own on a free loopback port, stopped by PID: plain, or over
//! TLS with an ACL user ([`RedisServer::start_tls`]). Without the binary (or, for TLS, without
//! its TLS support) the tests skip with a message.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` of the test's own, with an append-only file that is fsynced on every
/// write, so that a SIGKILL loses nothing and a restart on the same directory has it all.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    binary: PathBuf,
    tls: Option<RedisTls>,
}

/// A TLS server's files (PEM) and its one ACL user (the `default` user is off).
#[derive(Clone, Debug)]
pub struct RedisTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub ca_file: PathBuf,
    pub user: String,
    pub password: String,
}

fn redis_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("redis-server"))
            .find(|p| p.is_file())
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl RedisServer {
    /// A fresh server, or `None` (with a message) when `redis-server` is not installed.
    pub fn start(name: &str) -> Option<RedisServer> {
        let mut server = Self::new(name, None)?;
        server.spawn();
        Some(server)
    }

    /// A fresh server speaking TLS only (no plain port), with `tls`'s files and user; `None`
    /// (with a message) when `redis-server` is not installed or was built without TLS.
    pub fn start_tls(name: &str, tls: RedisTls) -> Option<RedisServer> {
        let mut server = Self::new(name, Some(tls))?;
        if let Err(why) = server.try_spawn() {
            eprintln!("skipping {name}: redis-server cannot serve TLS here ({why}); Debian's redis-server supports --tls-port");
            return None;
        }
        Some(server)
    }

    fn new(name: &str, tls: Option<RedisTls>) -> Option<RedisServer> {
        let Some(binary) = redis_binary() else {
            eprintln!(
                "skipping {name}: redis-server not found on PATH (install it, e.g. `apt-get install redis-server`, or set REDIS_SERVER)"
            );
            return None;
        };
        let dir =
            std::env::temp_dir().join(format!("equiroute-redis-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Some(RedisServer {
            child: None,
            port: free_port(),
            dir,
            binary,
            tls,
        })
    }

    /// Starts the server (again, after [`RedisServer::kill`]) and waits until it answers.
    pub fn spawn(&mut self) {
        if let Err(why) = self.try_spawn() {
            panic!("{why}");
        }
    }

    fn try_spawn(&mut self) -> Result<(), String> {
        let mut command = Command::new(&self.binary);
        command.args(["--bind", "127.0.0.1"]);
        match &self.tls {
            None => {
                command.args(["--port", &self.port.to_string()]);
            }
            Some(tls) => {
                command
                    .args(["--port", "0", "--tls-port", &self.port.to_string()])
                    .arg("--tls-cert-file")
                    .arg(&tls.cert_file)
                    .arg("--tls-key-file")
                    .arg(&tls.key_file)
                    .arg("--tls-ca-cert-file")
                    .arg(&tls.ca_file)
                    .args(["--tls-auth-clients", "no"])
                    .args(["--user", &tls.user, "on", &format!(">{}", tls.password)])
                    .args(["~*", "&*", "+@all"])
                    .args(["--user", "default", "off"]);
            }
        }
        let log = self.dir.join("redis.log");
        let child = command
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
            ])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .map_err(|e| format!("redis-server does not start: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                let said = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(format!("redis-server exited ({status}): {}", said.trim()));
            }
            if self.answers() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!("redis-server did not answer on port {}", self.port))
    }

    /// Whether the server answers: a PING on the plain port; over TLS, an open port (its
    /// listening socket is bound once it is ready to serve).
    fn answers(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        if self.tls.is_some() {
            return true;
        }
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 64];
        s.write_all(b"PING\r\n").is_ok()
            && s.read(&mut buf)
                .is_ok_and(|n| buf[..n].starts_with(b"+PONG"))
    }

    /// SIGKILL, by PID.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends one inline command (e.g. `FLUSHALL`) and returns the first line of the reply.
    pub fn command(&self, command: &str) -> String {
        use std::io::{BufRead, BufReader, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(format!("{command}\r\n").as_bytes()).unwrap();
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        line.trim_end().to_owned()
    }

    /// Sends one inline command and returns its reply's strings: a bulk string's value, or
    /// an array's bulk strings (for `HGET`, `HKEYS`).
    pub fn strings(&self, command: &str) -> Vec<String> {
        use std::io::{BufRead, BufReader, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(format!("{command}\r\n").as_bytes()).unwrap();
        let mut reader = BufReader::new(s);
        let mut line = || {
            let mut l = String::new();
            reader.read_line(&mut l).unwrap();
            l.trim_end().to_owned()
        };
        let head = line();
        let bulks = match head.chars().next() {
            Some('*') => head[1..].parse::<usize>().unwrap_or(0),
            Some('$') if head != "$-1" => return vec![line()],
            _ => return Vec::new(),
        };
        (0..bulks)
            .map(|_| {
                let _length = line();
                line()
            })
            .collect()
    }

    /// `redis://127.0.0.1:PORT`, or `rediss://127.0.0.1:PORT` over TLS.
    pub fn url(&self) -> String {
        match self.tls {
            None => format!("redis://127.0.0.1:{}", self.port),
            Some(_) => format!("rediss://127.0.0.1:{}", self.port),
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
