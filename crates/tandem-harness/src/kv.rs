//! A small RESP (Redis protocol) client and a load generator for the `kv` workload: the host
//! drives the redis-server inside the guest over the guest's network.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Errors talking to redis.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// Socket failure.
    #[error("redis connection")]
    Io(#[from] std::io::Error),
    /// Unexpected reply.
    #[error("unexpected redis reply {0:?}")]
    Reply(String),
}

/// A blocking RESP client.
pub struct KvClient {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl KvClient {
    /// Connects to `127.0.0.1:port`.
    pub fn connect(port: u16, timeout: Duration) -> Result<Self, KvError> {
        Self::connect_addr(([127, 0, 0, 1], port).into(), timeout)
    }

    /// Connects to `addr`; `timeout` also bounds each reply.
    pub fn connect_addr(addr: std::net::SocketAddr, timeout: Duration) -> Result<Self, KvError> {
        Self::from_stream(TcpStream::connect_timeout(&addr, timeout)?, timeout)
    }

    /// Uses a connected stream (e.g. one opened inside another network namespace).
    pub fn from_stream(s: TcpStream, timeout: Duration) -> Result<Self, KvError> {
        s.set_read_timeout(Some(timeout))?;
        s.set_nodelay(true)?;
        Ok(KvClient {
            r: BufReader::new(s.try_clone()?),
            w: s,
        })
    }

    fn command(&mut self, args: &[&[u8]]) -> Result<Option<Vec<u8>>, KvError> {
        let mut buf = Vec::new();
        encode_command(&mut buf, args);
        self.w.write_all(&buf)?;
        self.reply()
    }

    /// Sends every command at once (one write), then reads one reply per command.
    pub fn pipeline(&mut self, cmds: &[Vec<&[u8]>]) -> Result<Vec<Option<Vec<u8>>>, KvError> {
        self.send_pipeline(cmds)?;
        cmds.iter().map(|_| self.reply()).collect()
    }

    /// Sends commands without reading replies (read them with [`KvClient::read_reply`]).
    pub fn send_pipeline(&mut self, cmds: &[Vec<&[u8]>]) -> Result<(), KvError> {
        let mut buf = Vec::new();
        for c in cmds {
            encode_command(&mut buf, c);
        }
        self.w.write_all(&buf)?;
        Ok(())
    }

    /// Reads one reply (simple string, integer or bulk string; `None` for a nil bulk).
    pub fn read_reply(&mut self) -> Result<Option<Vec<u8>>, KvError> {
        self.reply()
    }

    /// `INFO section` as text.
    pub fn info(&mut self, section: &str) -> Result<String, KvError> {
        let r = self
            .command(&[b"INFO", section.as_bytes()])?
            .unwrap_or_default();
        Ok(String::from_utf8_lossy(&r).into_owned())
    }

    fn reply(&mut self) -> Result<Option<Vec<u8>>, KvError> {
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            return Err(KvError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let line = line.trim_end();
        match line.as_bytes().first() {
            Some(b'+') | Some(b':') => Ok(Some(line.as_bytes()[1..].to_vec())),
            Some(b'$') => {
                let n: i64 = line[1..].parse().map_err(|_| KvError::Reply(line.into()))?;
                if n < 0 {
                    return Ok(None);
                }
                let mut data = vec![0u8; n as usize + 2];
                std::io::Read::read_exact(&mut self.r, &mut data)?;
                data.truncate(n as usize);
                Ok(Some(data))
            }
            _ => Err(KvError::Reply(line.into())),
        }
    }

    /// `PING`.
    pub fn ping(&mut self) -> Result<(), KvError> {
        self.command(&[b"PING"]).map(|_| ())
    }
    /// `SET key value`.
    pub fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), KvError> {
        match self.command(&[b"SET", key, value])? {
            Some(r) if r == b"OK" => Ok(()),
            r => Err(KvError::Reply(format!("{r:?}"))),
        }
    }
    /// `GET key`.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.command(&[b"GET", key])
    }

    /// `LRANGE key 0 -1`: the whole list.
    pub fn lrange(&mut self, key: &[u8]) -> Result<Vec<Vec<u8>>, KvError> {
        let mut buf = Vec::new();
        encode_command(&mut buf, &[b"LRANGE", key, b"0", b"-1"]);
        self.w.write_all(&buf)?;
        let mut line = String::new();
        if self.r.read_line(&mut line)? == 0 {
            return Err(KvError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        let line = line.trim_end();
        let n: i64 = line
            .strip_prefix('*')
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| KvError::Reply(line.into()))?;
        (0..n.max(0))
            .map(|_| self.reply().map(Option::unwrap_or_default))
            .collect()
    }
}

fn encode_command(buf: &mut Vec<u8>, args: &[&[u8]]) {
    buf.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        buf.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        buf.extend_from_slice(a);
        buf.extend_from_slice(b"\r\n");
    }
}

/// Waits until redis answers `PING` on `port`.
pub fn wait_for_server(port: u16, timeout: Duration) -> Result<KvClient, KvError> {
    let deadline = Instant::now() + timeout;
    loop {
        let attempt = KvClient::connect(port, Duration::from_secs(2)).and_then(|mut c| {
            c.ping()?;
            Ok(c)
        });
        match attempt {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// A background load: SET of 512-byte values over a rotating key space, with a GET every
/// fourth operation. Counts completed operations.
pub struct KvLoad {
    stop: Arc<AtomicBool>,
    /// Completed operations.
    pub ops: Arc<AtomicU64>,
    handle: Option<std::thread::JoinHandle<Result<(), KvError>>>,
}

impl KvLoad {
    /// Starts the load against `port` with `keys` distinct keys.
    pub fn start(port: u16, keys: u64) -> Result<Self, KvError> {
        let mut c = KvClient::connect(port, Duration::from_secs(10))?;
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let (s, o) = (stop.clone(), ops.clone());
        let handle = std::thread::spawn(move || {
            let mut i: u64 = 0;
            let mut value = vec![0u8; 512];
            while !s.load(Ordering::Relaxed) {
                let key = format!("key:{}", i.wrapping_mul(2654435761) % keys);
                if i % 4 == 3 {
                    c.get(key.as_bytes())?;
                } else {
                    for (j, b) in value.iter_mut().enumerate() {
                        *b = b'a' + ((i as usize + j * 7) % 26) as u8;
                    }
                    c.set(key.as_bytes(), &value)?;
                }
                i += 1;
                o.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        });
        Ok(KvLoad {
            stop,
            ops,
            handle: Some(handle),
        })
    }

    /// Stops the load and returns its result.
    pub fn stop(mut self) -> Result<u64, KvError> {
        self.stop.store(true, Ordering::Relaxed);
        let r = self
            .handle
            .take()
            .map(|h| h.join().unwrap_or(Ok(())))
            .unwrap_or(Ok(()));
        r.map(|_| self.ops.load(Ordering::Relaxed))
    }
}

impl Drop for KvLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
