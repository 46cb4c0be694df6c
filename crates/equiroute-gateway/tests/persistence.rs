//! Learning state survives a restart; an unusable state file is refused with the way out.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{http, serve_until as run};
use serde_json::{json, Value};
use std::fmt::Write as _;

fn config(path: &std::path::Path, providers: &[&str]) -> String {
    let mut s = format!(
        "[state]\npath = {:?}\nsnapshot_interval_s = 3600\n[interfaces.search]\nkind = \"tool\"\npolicy = {{ name = \"lqm\" }}\n",
        path.display().to_string()
    );
    for p in providers {
        let _ = write!(s, "[[interfaces.search.providers]]\nid = \"{p}\"\nkind = \"sim\"\nsim = {{ latency = {{ p50_ms = 2, p95_ms = 4 }} }}\n");
    }
    s
}

fn temp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("equiroute-state-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("state.redb")
}

async fn quality(addr: std::net::SocketAddr) -> f64 {
    let v = http(addr, "GET", "/v1/interfaces/search/state", &[], "")
        .await
        .json();
    v["candidates"][0]["estimates"]["quality"].as_f64().unwrap()
}

#[tokio::test]
async fn learned_state_and_pending_feedback_survive_a_restart() {
    let path = temp("restart");
    let text = config(&path, &["s1"]);
    let first = std::sync::Arc::new(std::sync::Mutex::new((0.0, String::new())));
    let out = first.clone();
    run(&text, |addr| async move {
        let r = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"rust"}"#).await;
        let id = r.header("x-equiroute-request-id").unwrap().to_owned();
        let fb = json!({"request_id": id, "quality": 1.0}).to_string();
        assert_eq!(
            http(addr, "POST", "/v1/feedback", &[], &fb).await.status,
            200
        );
        let learned = quality(addr).await;
        // A second answered request whose feedback arrives only after the restart.
        let r = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"rust"}"#).await;
        *out.lock().unwrap() = (
            learned,
            r.header("x-equiroute-request-id").unwrap().to_owned(),
        );
    })
    .await
    .unwrap();
    let (learned, pending_id) = first.lock().unwrap().clone();
    assert!(learned > 0.05, "the first run learnt something: {learned}");
    run(&text, |addr| async move {
        let restored = quality(addr).await;
        assert!(
            (restored - learned).abs() < 1e-9,
            "restored {restored} vs learned {learned}"
        );
        // The estimate and the scores behind it are restored; the traffic counts cover this
        // process only, and say so.
        let state = http(addr, "GET", "/v1/interfaces/search/state", &[], "")
            .await
            .json();
        assert_eq!(
            state["candidates"][0]["estimates"]["quality_observations"],
            1
        );
        assert_eq!(state["candidates"][0]["first_choices"], 0);
        assert_eq!(state["candidates"][0]["traffic_share"], Value::Null);
        assert_eq!(state["traffic_window"]["requests"], 0);
        assert_eq!(state["traffic_window"]["scope"], "process");
        let fb = json!({"request_id": pending_id, "quality": 1.0}).to_string();
        let r = http(addr, "POST", "/v1/feedback", &[], &fb).await;
        assert_eq!(
            (r.status, r.json()["status"].clone()),
            (200, json!("accepted")),
            "{}",
            r.body
        );
        assert!(
            quality(addr).await > restored,
            "the late feedback updated the same candidate"
        );
    })
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

#[tokio::test]
async fn an_incompatible_or_corrupt_state_file_is_refused_with_the_way_out() {
    let path = temp("refuse");
    run(&config(&path, &["s1"]), |addr| async move {
        let _ = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"x"}"#).await;
    })
    .await
    .unwrap();
    let e = run(&config(&path, &["s1", "s2"]), |_| async {})
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("had providers") && e.contains("--reset-state"),
        "{e}"
    );
    assert!(path.exists(), "never wiped silently");
    std::fs::write(&path, b"this is not a database").unwrap();
    let e = run(&config(&path, &["s1"]), |_| async {})
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cannot be opened") && e.contains("--reset-state"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// redb's locks belong to an open of the file, not to the process: a second open in the same
/// process is told the file is held (by this process), never that it is damaged; nor can it
/// be removed or exported meanwhile. Once the first open is dropped, all three work.
#[test]
fn a_second_open_in_the_same_process_is_told_the_file_is_held() {
    use equiroute_gateway::store::{Store, StoreError};
    let path = temp("held-in-process");
    let first = Store::open(&path).unwrap();
    let held = |e: StoreError| {
        let text = e.to_string();
        assert!(matches!(e, StoreError::Locked { .. }), "{e:?}");
        assert!(
            text.contains(&format!("this process (pid {})", std::process::id())),
            "{text}"
        );
        assert!(!text.contains("--reset-state"), "{text}");
    };
    held(Store::open(&path).unwrap_err());
    held(Store::export_file(&path).unwrap_err());
    held(Store::remove(&path).unwrap_err());
    assert!(path.exists());
    drop(first);
    assert!(matches!(
        Store::export_file(&path),
        Err(StoreError::NothingSaved { .. })
    ));
    drop(Store::open(&path).unwrap());
    assert!(Store::remove(&path).unwrap(), "there was a file to remove");
    assert!(!path.exists());
    assert!(!Store::remove(&path).unwrap(), "nothing left to remove");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// The file's bytes and modification time: what "untouched" means.
fn fingerprint(path: &std::path::Path) -> (Vec<u8>, std::time::SystemTime) {
    let meta = std::fs::metadata(path).unwrap();
    (std::fs::read(path).unwrap(), meta.modified().unwrap())
}

/// A state file of another configuration is refused without a write: same bytes, same
/// modification time (a refused file used to be rewritten by the open that preceded the check).
#[tokio::test]
async fn a_state_file_of_another_configuration_is_refused_untouched() {
    let path = temp("refused-untouched");
    run(&config(&path, &["s1"]), |addr| async move {
        for _ in 0..20 {
            let _ = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"x"}"#).await;
        }
    })
    .await
    .unwrap();
    let before = fingerprint(&path);
    let e = run(&config(&path, &["s1", "s2"]), |_| async {})
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("had providers"), "{e}");
    let after = fingerprint(&path);
    assert!(before.0 == after.0, "the refused file's bytes changed");
    assert_eq!(
        before.1, after.1,
        "the refused file's modification time changed"
    );
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}

/// A small tmpfs mounted for one test, unmounted when dropped (a failed assertion included);
/// `None`, with the reason on stderr, where this process cannot mount one (not root).
struct Tmpfs {
    dir: std::path::PathBuf,
}

impl Tmpfs {
    fn mount(name: &str, size: &str) -> Option<Tmpfs> {
        let dir =
            std::env::temp_dir().join(format!("equiroute-tmpfs-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output();
        match mounted {
            Ok(out) if out.status.success() => Some(Tmpfs { dir }),
            other => {
                let why = match other {
                    Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                    Err(e) => e.to_string(),
                };
                eprintln!("SKIPPED: this test needs a tmpfs of its own and cannot mount one ({why}); run it as root");
                let _ = std::fs::remove_dir(&dir);
                None
            }
        }
    }

    fn remount_read_only(&self) {
        let status = std::process::Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&self.dir)
            .status()
            .unwrap();
        assert!(
            status.success(),
            "cannot remount {} read-only",
            self.dir.display()
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazily (`-l`): after a failed assertion a gateway task may still hold a file there.
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The count of `equiroute_state_snapshots_total{outcome="…"}` in `/metrics`.
async fn snapshots(addr: std::net::SocketAddr, outcome: &str) -> u64 {
    let text = http(addr, "GET", "/metrics", &[], "").await.body;
    let series = format!("equiroute_state_snapshots_total{{outcome=\"{outcome}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// Waits (20 s at most) until `/metrics` counts more than `after` snapshots of `outcome`.
async fn wait_snapshots(addr: std::net::SocketAddr, outcome: &str, after: u64) -> u64 {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let n = snapshots(addr, outcome).await;
        if n > after {
            return n;
        }
        assert!(
            std::time::Instant::now() < until,
            "no snapshot `{outcome}` after {after} within 20 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Fills the file system holding `path` with the file `path`.
fn fill(path: &std::path::Path) {
    use std::io::Write as _;
    let mut f = std::fs::File::create(path).unwrap();
    let block = vec![0xa5u8; 64 * 1024];
    loop {
        if let Err(e) = f.write_all(&block).and_then(|()| f.sync_data()) {
            assert_eq!(e.kind(), std::io::ErrorKind::StorageFull, "{e}");
            return;
        }
    }
}

/// Bar 4 of issue 43: a full disk stops snapshots only while it is full. The failures are
/// counted by cause, snapshots resume once space is freed (redb refuses every write after an
/// I/O error until the file is opened again), and the last snapshot at shutdown is saved
/// with what was learnt during the outage.
#[tokio::test]
async fn snapshots_resume_once_a_full_disk_has_room_again() {
    let Some(fs) = Tmpfs::mount("full", "8m") else {
        return;
    };
    let path = fs.dir.join("state.redb");
    let filler = fs.dir.join("filler");
    let text =
        config(&path, &["s1"]).replace("snapshot_interval_s = 3600", "snapshot_interval_s = 0.1");
    run(&text, |addr| async move {
        let _ = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"x"}"#).await;
        wait_snapshots(addr, "saved", 0).await;
        fill(&filler);
        // Learning during the outage: contexts waiting for feedback make the snapshot grow.
        for _ in 0..400 {
            let _ = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"y"}"#).await;
        }
        let failed = wait_snapshots(addr, "no_space", 0).await;
        // Still failing while the disk is full: several failures, no success.
        wait_snapshots(addr, "no_space", failed).await;
        let saved = snapshots(addr, "saved").await;
        std::fs::remove_file(&filler).unwrap();
        wait_snapshots(addr, "saved", saved).await;
    })
    .await
    .expect("the last snapshot at shutdown is saved");
    let json = equiroute_gateway::store::Store::export_file(&path).unwrap();
    let pending = json["pending"].as_array().unwrap().len();
    assert!(
        pending >= 400,
        "the snapshot holds what was learnt during the outage: {pending}"
    );
}

/// A state file on a read-only mount: the gateway's open is told why, with advice that keeps
/// the file (never "cannot be opened as an Equiroute state file … --reset-state", which a
/// file not created yet used to get), and `state export` reads it as it is.
#[test]
fn a_read_only_state_file_is_reported_as_such_and_still_exports() {
    use equiroute_gateway::store::{Store, StoreError};
    let Some(fs) = Tmpfs::mount("ro", "8m") else {
        return;
    };
    let path = fs.dir.join("state.redb");
    let cfg =
        equiroute_gateway::config::load(&config(&path, &["s1"]), "ro.toml", &|_| None).unwrap();
    let state = equiroute_gateway::server::state::AppState::new(&cfg, 1).unwrap();
    Store::open(&path).unwrap().save(&state).unwrap();
    fs.remount_read_only();
    let e = Store::open(&path).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, StoreError::Io { .. }), "{e:?}");
    assert!(
        !text.contains("--reset-state") && !text.contains("damaged:"),
        "{text}"
    );
    assert!(
        text.contains("Read-only file system") && text.contains("writable"),
        "{text}"
    );
    let json = Store::export_file(&path).unwrap();
    assert_eq!(json["schema"], 1, "{json}");
    // A state file not created yet, where nothing can be created.
    let e = Store::open(&fs.dir.join("new.redb")).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, StoreError::Io { .. }), "{e:?}");
    assert!(
        !text.contains("--reset-state") && text.contains("writable"),
        "{text}"
    );
}

/// The operations view's request count over `horizon` (`5m`, `1h`, `24h`) for interface
/// `search`, and its last hour's.
async fn ops_requests(addr: std::net::SocketAddr, horizon: &str) -> (u64, u64) {
    let v = http(
        addr,
        "GET",
        &format!("/dashboard/ops?horizon={horizon}"),
        &[],
        "",
    )
    .await
    .json();
    let search = &v["interfaces"][0];
    assert_eq!(search["name"], "search", "{v}");
    (
        search["total"]["requests"].as_u64().unwrap(),
        search["last_hour"]["total"]["requests"].as_u64().unwrap(),
    )
}

#[tokio::test]
async fn the_minute_ring_of_the_operations_view_survives_a_restart_and_a_bad_record_starts_it_empty(
) {
    let path = temp("ops-minutes");
    let text = config(&path, &["s1"]);
    run(&text, |addr| async move {
        for _ in 0..3 {
            let r = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"rust"}"#).await;
            assert_eq!(r.status, 200);
        }
        assert_eq!(ops_requests(addr, "1h").await, (3, 3));
    })
    .await
    .unwrap();
    run(&text, |addr| async move {
        // The minute ring was saved with the snapshot; the one-second ring is this process's.
        assert_eq!(ops_requests(addr, "24h").await, (3, 3));
        assert_eq!(ops_requests(addr, "5m").await, (0, 3));
        let r = http(addr, "POST", "/v1/tools/search", &[], r#"{"query":"go"}"#).await;
        assert_eq!(r.status, 200);
        assert_eq!(ops_requests(addr, "1h").await, (4, 4));
    })
    .await
    .unwrap();
    // A record this build cannot read (another version, or damaged) starts the view empty: the
    // file, and the learning in it, is still taken.
    for record in [&b"not json"[..], br#"{"version": 99, "interfaces": {}}"#] {
        {
            let db = redb::Database::open(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn
                    .open_table(redb::TableDefinition::<&str, &[u8]>::new("snapshots"))
                    .unwrap();
                table.insert("operations-minutes", record).unwrap();
            }
            txn.commit().unwrap();
        }
        // A refused file would end the gateway at start: `run` returns the refusal.
        run(&text, |addr| async move {
            assert_eq!(ops_requests(addr, "24h").await, (0, 0));
        })
        .await
        .expect("the state file is taken");
    }
}
