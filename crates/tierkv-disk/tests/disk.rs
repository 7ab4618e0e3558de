//! The disk tier's own scenarios: CONFORMANCE C9-C12, a restart with thousands of records, a
//! reopen after corruption in several segments, real I/O failures, and concurrency.
//!
//! Failures are real where the machine allows: a tiny tmpfs for a full disk, a btrfs quota group
//! for a disk quota exceeded, a read-only remount for an unwritable directory, an ext4 image on a
//! loop device whose backing file is cut short for EIO. Tests that cannot mount (not root, no loop devices) say so and return.

#![allow(clippy::unwrap_used, reason = "test code: a failed unwrap is a failed test")]

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tierkv_core::policy::{PolicyKind, SegmentPolicy};
use tierkv_core::{StoreItem, TierAdapter, TierError};
use tierkv_disk::{BLOCK, DiskStore, DiskStoreConfig, FsyncPolicy, IoMode, ReadMode, record_bytes};
use tierkv_testkit::contract::{Harness, OpenTier, SharedTier, key, keys, payload};

const CHUNK: u64 = 64 << 10;

/// A store of `segments` segments of `per_segment` records, each segment in a file of its own
/// (so a test can find a segment by its file); `shared_files` puts several in one file.
fn config(dir: &Path, segments: u64, per_segment: u64) -> DiskStoreConfig {
    let segment_bytes = BLOCK + per_segment * record_bytes(CHUNK);
    DiskStoreConfig {
        segment_bytes,
        file_bytes: segment_bytes,
        io_threads: 2,
        ..DiskStoreConfig::new(dir, segments * segment_bytes, CHUNK)
    }
}

fn open(config: DiskStoreConfig) -> (Harness, Arc<DiskStore>) {
    let store = Arc::new(DiskStore::open(config).unwrap());
    let chunk_bytes = CHUNK;
    (Harness::new(OpenTier { tier: store.clone(), chunk_bytes, keep: Box::new(()) }), store)
}

/// Byte offset of record `n` (from 0) of a segment whose records are all `CHUNK` long.
fn record_offset(n: u64) -> u64 {
    BLOCK + n * record_bytes(CHUNK)
}

/// Stores `range` two keys to a task, so no task outgrows a segment of two records.
fn store_in_pairs(h: &mut Harness, range: std::ops::Range<u64>) {
    for first in range.step_by(2) {
        h.store(&keys(first..first + 2)).unwrap();
    }
}

fn segment(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("seg-{id:08}.tkv"))
}

fn flip(path: &Path, at: u64) {
    let file = OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
    file.sync_all().unwrap();
}

fn counter(snapshotter: &Snapshotter, name: &str, reason: Option<&str>) -> u64 {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == name)
        .filter(|(k, ..)| {
            reason.is_none_or(|r| k.key().labels().any(|l| l.key() == "reason" && l.value() == r))
        })
        .map(|(.., v)| if let DebugValue::Counter(n) = v { n } else { 0 })
        .sum()
}

#[test]
fn c9_a_restarted_store_serves_what_it_stored() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 8, 4));
        h.store(&keys(0..10)).unwrap();
    }
    let (mut h, store) = open(config(dir.path(), 8, 4));
    assert_eq!(store.recovered().records, 10);
    assert_eq!(h.present(&keys(0..10)).count_ones(), 10);
    h.assert_loads(&keys(0..10));
    h.store(&keys(10..12)).unwrap();
    h.assert_loads(&keys(0..12));
}

#[test]
fn restart_with_thousands_of_records_across_many_segments() {
    const SMALL: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let segment_bytes = BLOCK + 64 * record_bytes(SMALL);
    let config = DiskStoreConfig {
        segment_bytes,
        fsync: FsyncPolicy::Never,
        ..DiskStoreConfig::new(dir.path(), 64 * segment_bytes, SMALL)
    };
    let harness = |config: &DiskStoreConfig| {
        let store = Arc::new(DiskStore::open(config.clone()).unwrap());
        (
            Harness::new(OpenTier { tier: store.clone(), chunk_bytes: SMALL, keep: Box::new(()) }),
            store,
        )
    };
    {
        let (mut h, _) = harness(&config);
        for batch in 0..30 {
            h.store(&keys(batch * 100..batch * 100 + 100)).unwrap();
        }
        // Closing syncs, whatever the fsync policy.
    }
    let (mut h, store) = harness(&config);
    let recovered = store.recovered();
    assert_eq!(recovered.records, 3000);
    assert_eq!(recovered.segments, 47, "3,000 records of 64 per segment");
    assert_eq!((recovered.damaged_blocks, recovered.torn_records), (0, 0));
    for batch in 0..30 {
        h.assert_loads(&keys(batch * 100..batch * 100 + 100));
    }
}

/// A sink that, when the load first asks its length (after the load found the record and
/// before it reads it), deletes the key and damages the record's header, as a read that met the
/// delete's mark half written would see it.
struct DeletedUnderTheRead {
    store: Arc<DiskStore>,
    key: tierkv_core::ObjectKey,
    header: (PathBuf, u64),
    done: std::sync::atomic::AtomicBool,
    bytes: Vec<u8>,
}

impl tierkv_core::ChunkSink for DeletedUnderTheRead {
    fn len(&self) -> u64 {
        if !self.done.swap(true, std::sync::atomic::Ordering::SeqCst) {
            assert_eq!(self.store.delete(&[self.key]), 1);
            flip(&self.header.0, self.header.1 + 7);
        }
        self.bytes.len() as u64
    }

    fn copy_from_host(&mut self, src: &[u8]) -> Result<(), tierkv_core::BufferError> {
        self.bytes.copy_from_slice(src);
        Ok(())
    }
}

#[test]
fn a_record_deleted_under_its_load_is_a_plain_miss_not_a_checksum_failure() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = tempfile::tempdir().unwrap();
    let (mut h, store) = metrics::with_local_recorder(&recorder, || open(config(dir.path(), 4, 8)));
    h.store(&keys(0..3)).unwrap();
    let sink = DeletedUnderTheRead {
        store: Arc::clone(&store),
        key: key(1),
        header: (segment(dir.path(), 0), record_offset(1)),
        done: false.into(),
        bytes: vec![0; CHUNK as usize],
    };
    let completions = store.completions();
    let task = store.submit_load(vec![tierkv_core::LoadItem { key: key(1), sink: Box::new(sink) }]);
    let done = completions.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
    let tierkv_core::Completion::Loaded { task: answered, loaded, .. } = done else {
        panic!("not a load's answer")
    };
    assert_eq!(answered, task);
    assert!(!loaded.get(0), "a record deleted under its read is a miss");
    assert_eq!(
        counter(&snapshotter, "tierkv_checksum_failures_total", None),
        0,
        "a key deleted while it was read is not damage on disk"
    );
    h.assert_loads(&[key(0), key(2)]);
}

#[test]
fn c10_a_flipped_payload_byte_is_a_counted_miss_and_the_others_load() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        h.store(&keys(0..5)).unwrap();
    }
    flip(&segment(dir.path(), 0), record_offset(2) + BLOCK + 777);
    let (mut h, store) = metrics::with_local_recorder(&recorder, || open(config(dir.path(), 4, 8)));
    assert_eq!(store.recovered().records, 5, "payloads are verified on load, not at open");
    let (loaded, _) = h.load(&keys(0..5));
    assert_eq!(loaded, tierkv_core::Bitmap::from_bools([true, true, false, true, true]));
    h.assert_loads(&[key(0), key(1), key(3), key(4)]);
    assert_eq!(counter(&snapshotter, "tierkv_checksum_failures_total", None), 1);
    assert_eq!(h.tier.usage().objects, 4, "the damaged record left the index");
    assert!(!h.present(&[key(2)]).get(0));

    // The same while the store is open: the next load finds it.
    flip(&segment(dir.path(), 0), record_offset(4) + BLOCK + 5);
    assert!(!h.load(&[key(4)]).0.get(0));
    assert_eq!(
        counter(&snapshotter, "tierkv_checksum_failures_total", None),
        1,
        "a new snapshot counts anew"
    );
    // A good copy can be stored again.
    h.store(&[key(2), key(4)]).unwrap();
    h.assert_loads(&keys(0..5));
}

#[test]
fn c10_a_record_found_damaged_stays_gone_after_a_restart_and_its_good_copy_is_found() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        h.store(&keys(0..5)).unwrap();
    }
    flip(&segment(dir.path(), 0), record_offset(2) + BLOCK + 777);
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        assert!(!h.load(&[key(2)]).0.get(0), "the damage is found");
        // The good copy goes to another segment: the scan sealed segment 0.
        h.store(&[key(2)]).unwrap();
        h.assert_loads(&keys(0..5));
    }
    // The scan keeps a key's first record in segment order: the damaged one, unless the load
    // that found it marked it deleted.
    let (mut h, store) = open(config(dir.path(), 4, 8));
    assert_eq!(store.recovered().records, 5);
    assert_eq!(store.recovered().deleted_records, 1);
    h.assert_loads(&keys(0..5));
}

#[test]
fn a_record_whose_payload_a_crash_left_unwritten_is_written_again_by_a_store_of_its_key() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        h.store(&keys(0..5)).unwrap();
    }
    // A crash after key 2's header reached the disk but not its payload (zeros, as the
    // preallocated file reads there).
    let file = OpenOptions::new().write(true).open(segment(dir.path(), 0)).unwrap();
    file.write_all_at(&vec![0; CHUNK as usize], record_offset(2) + BLOCK).unwrap();
    file.sync_all().unwrap();
    drop(file);
    {
        let (mut h, store) = open(config(dir.path(), 4, 8));
        assert_eq!(store.recovered().records, 5, "only headers are checked at a restart");
        // Stored again with no load first: the store must not take the record for the key's.
        h.store(&[key(2)]).unwrap();
        h.assert_loads(&keys(0..5));
        assert_eq!(h.tier.usage().objects, 5, "the new record replaced the old");
    }
    let (mut h, store) = open(config(dir.path(), 4, 8));
    assert_eq!(store.recovered().records, 5);
    assert_eq!(store.recovered().deleted_records, 1, "the replaced record is marked deleted");
    h.assert_loads(&keys(0..5));
}

#[test]
fn a_record_a_load_has_verified_is_not_written_again() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        h.store(&keys(0..5)).unwrap();
    }
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        h.assert_loads(&[key(2)]);
        h.store(&keys(2..4)).unwrap();
    }
    // Key 2 was verified and kept; key 3 was not, and was written again.
    let (_, store) = open(config(dir.path(), 4, 8));
    assert_eq!(store.recovered().records, 5);
    assert_eq!(store.recovered().deleted_records, 1);
}

#[test]
fn c11_a_torn_last_record_is_absent_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        h.store(&keys(0..5)).unwrap();
    }
    // A crash in the middle of the fifth record's payload.
    let file = OpenOptions::new().write(true).open(segment(dir.path(), 0)).unwrap();
    file.set_len(record_offset(4) + BLOCK + 1000).unwrap();
    let (mut h, store) = open(config(dir.path(), 4, 8));
    assert_eq!(store.recovered().records, 4);
    assert_eq!(store.recovered().torn_records, 1);
    h.assert_loads(&keys(0..4));
    assert!(!h.present(&[key(4)]).get(0), "the torn record is absent");
    h.store(&keys(4..20)).unwrap();
    h.assert_loads(&keys(4..20));
}

#[test]
fn damaged_records_in_several_segments_are_misses_and_everything_else_loads() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 6, 4));
        for first in [0, 4, 8, 12] {
            h.store(&keys(first..first + 4)).unwrap();
        }
    }
    flip(&segment(dir.path(), 1), record_offset(1) + BLOCK + 100); // key 5: payload
    flip(&segment(dir.path(), 2), record_offset(2) + 30); // key 10: header
    flip(&segment(dir.path(), 3), record_offset(3) + BLOCK + CHUNK - 1); // key 15: last payload byte
    let (mut h, store) = metrics::with_local_recorder(&recorder, || open(config(dir.path(), 6, 4)));
    let recovered = store.recovered();
    assert_eq!(recovered.records, 15, "only the record with a damaged header is not indexed");
    assert_eq!(
        recovered.damaged_blocks,
        1 + CHUNK / BLOCK,
        "its header and payload blocks were skipped"
    );
    assert_eq!(recovered.damaged_records, 1);
    let (loaded, _) = h.load(&keys(0..16));
    let missing: Vec<usize> = (0..16).filter(|i| !loaded.get(*i)).collect();
    assert_eq!(missing, vec![5, 10, 15]);
    assert_eq!(
        counter(&snapshotter, "tierkv_checksum_failures_total", None),
        3,
        "key 10's header when the store opened, keys 5 and 15's payloads when they were loaded"
    );
    let good: Vec<_> = (0..16).filter(|i| ![5, 10, 15].contains(i)).map(key).collect();
    h.assert_loads(&good);
}

#[test]
fn read_modes_agree_and_both_refuse_damage() {
    for mode in [ReadMode::Direct, ReadMode::Mmap] {
        let dir = tempfile::tempdir().unwrap();
        let (mut h, _) = open(DiskStoreConfig { read_mode: mode, ..config(dir.path(), 4, 8) });
        h.store(&keys(0..6)).unwrap();
        h.assert_loads(&keys(0..6));
        flip(&segment(dir.path(), 0), record_offset(3) + BLOCK + 9);
        let (loaded, _) = h.load(&keys(0..6));
        assert_eq!(loaded.count_ones(), 5, "{mode:?}");
        assert!(!loaded.get(3), "{mode:?} served a damaged record");
    }
}

#[test]
fn periodic_and_never_fsync_keep_everything_after_a_clean_close() {
    for fsync in [FsyncPolicy::Never, FsyncPolicy::Periodic(std::time::Duration::from_millis(5))] {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut h, _) = open(DiskStoreConfig { fsync, ..config(dir.path(), 4, 4) });
            h.store(&keys(0..6)).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let (mut h, _) = open(DiskStoreConfig { fsync, ..config(dir.path(), 4, 4) });
        h.assert_loads(&keys(0..6));
    }
}

#[test]
fn concurrent_stores_loads_locks_and_deletes_never_serve_wrong_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(
        DiskStore::open(DiskStoreConfig { io_threads: 4, ..config(dir.path(), 6, 4) }).unwrap(),
    );
    let shared = SharedTier::new(store.clone(), CHUNK);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (shared, store) = (&shared, &store);
            s.spawn(move || {
                let mut seed = t * 7919 + 3;
                for _ in 0..75 {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let k = key((seed >> 33) % 48);
                    match (seed >> 20) % 5 {
                        // On its way here (as the cascade hands L1's victims over without an
                        // L2), served from its copy until the write is answered.
                        4 => {
                            let departing = store.depart(k, payload(&k, CHUNK).into());
                            let item = StoreItem { key: k, source: Box::new(departing) };
                            drop(shared.call(|tier| tier.submit_store(vec![item])));
                        }
                        // Runs of one to three records: a task may span two segments.
                        0 => {
                            let first = (seed >> 33) % 48;
                            drop(shared.store(&keys(first..first + 1 + (seed >> 40) % 3)))
                        }
                        1 => drop(shared.load_verified(&[k])),
                        2 => {
                            if shared.lookup(&[k]).get(0) {
                                assert!(
                                    shared.load_verified(&[k]).get(0),
                                    "a locked key failed to load"
                                );
                                shared.tier.unlock(&[k]);
                            }
                        }
                        _ => drop(shared.tier.delete(&[k])),
                    }
                }
            });
        }
    });
    let usage = store.usage();
    assert_eq!(usage.locks, 0);
    assert_eq!(usage.used_bytes, usage.objects * record_bytes(CHUNK), "{usage:?}");
}

/// A filesystem mounted for one test, unmounted (and its loop device detached) on drop.
///
/// Tests with a mount run one at a time: a child process that another test forks (`mount`,
/// `mkfs.ext4`, ...) holds copies of this process's descriptors until it execs, and on a loaded
/// machine that window is long enough for a segment file's descriptor to make a remount
/// read-only fail with "mount point is busy".
struct Mounted {
    dir: tempfile::TempDir,
    loop_device: Option<String>,
    image: Option<tempfile::NamedTempFile>,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

/// Whether the kernel can mount btrfs: built in or loaded, or loaded now (as root).
fn kernel_has_btrfs() -> bool {
    let listed = || {
        std::fs::read_to_string("/proc/filesystems")
            .is_ok_and(|all| all.lines().any(|line| line.split_whitespace().any(|w| w == "btrfs")))
    };
    listed() || (run("modprobe", &["btrfs"]).is_ok() && listed())
}

/// The subvolume of a [`Mounted::btrfs_with_quota`] mount that the quota limits.
const QUOTA_DIR: &str = "tier";

static MOUNTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The mount tests' turn; a test that failed while holding it does not block the others.
fn mount_turn() -> std::sync::MutexGuard<'static, ()> {
    MOUNTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn run(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program).args(args).output().map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!("{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Mounted {
    fn tmpfs(size: &str) -> Option<Self> {
        let turn = mount_turn();
        let dir = tempfile::tempdir().ok()?;
        let path = dir.path().to_str()?.to_string();
        match run("mount", &["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs", &path]) {
            Ok(_) => Some(Mounted { dir, loop_device: None, image: None, _one_at_a_time: turn }),
            Err(why) => {
                tierkv_testkit::cannot_mount(&format!("cannot mount a tmpfs here ({why})"));
                None
            }
        }
    }

    fn ext4_on_loop(mebibytes: u64) -> Option<Self> {
        Self::ext4_on_loop_with(mebibytes, "defaults")
    }

    /// An ext4 image on a loop device, mounted with `options`.
    fn ext4_on_loop_with(mebibytes: u64, options: &str) -> Option<Self> {
        Self::on_loop(mebibytes, &["mkfs.ext4", "-q", "-F"], options, |_| Ok(()))
            .map_err(|why| {
                tierkv_testkit::cannot_mount(&format!(
                    "cannot mount an ext4 image on a loop device here ({why})"
                ))
            })
            .ok()
    }

    /// A btrfs image on a loop device whose subvolume `tier` (see [`Mounted::quota_dir`]) may
    /// hold `quota` bytes at most (a size as `btrfs qgroup limit` reads it): a write past it fails
    /// with `EDQUOT`, as a write by a user over an ext4 or XFS user quota does. A btrfs quota
    /// group binds root too, where a user quota lets root (`CAP_SYS_RESOURCE`) through, and needs
    /// no quota format in the kernel (ext4's quotas need `CONFIG_QFMT_V2`). Files made in `tier`
    /// are copied on write, btrfs's default: the store turns that off for its segment files.
    /// A kernel without btrfs skips these tests, saying so, even under `TIERKV_MOUNTS=1`
    /// (`.ci/run` does not ask for btrfs there either): mounts work, this filesystem is not in it.
    fn btrfs_with_quota(mebibytes: u64, quota: &str) -> Option<Self> {
        if !kernel_has_btrfs() {
            eprintln!(
                "SKIPPED: the kernel has no btrfs (not in /proc/filesystems, and `modprobe btrfs` \
                 failed): the btrfs quota tests cannot run here"
            );
            return None;
        }
        let limit = |mounted: &str| {
            let tier = format!("{mounted}/{QUOTA_DIR}");
            run("btrfs", &["quota", "enable", mounted])?;
            run("btrfs", &["subvolume", "create", &tier])?;
            run("btrfs", &["qgroup", "limit", quota, &tier]).map(drop)
        };
        Self::on_loop(mebibytes, &["mkfs.btrfs", "-q", "-f"], "defaults", limit)
            .map_err(|why| {
                tierkv_testkit::cannot_mount(&format!(
                    "cannot mount a btrfs image with a quota on a loop device here ({why})"
                ))
            })
            .ok()
    }

    /// An image of `mebibytes` made by `mkfs` (the program and its arguments, the image's path
    /// last), on a loop device, mounted with `options`, then given to `prepare` (the mount
    /// point).
    fn on_loop(
        mebibytes: u64,
        mkfs: &[&str],
        options: &str,
        prepare: impl FnOnce(&str) -> Result<(), String>,
    ) -> Result<Self, String> {
        let turn = mount_turn();
        let made = |e: std::io::Error| e.to_string();
        let image = tempfile::NamedTempFile::new().map_err(made)?;
        image.as_file().set_len(mebibytes << 20).map_err(made)?;
        let image_path = image.path().to_str().ok_or("a temporary path that is not UTF-8")?;
        let dir = tempfile::tempdir().map_err(made)?;
        let path = dir.path().to_str().ok_or("a temporary path that is not UTF-8")?.to_string();
        let (program, args) = mkfs.split_first().ok_or("no mkfs")?;
        run(program, &[args, &[image_path]].concat())?;
        let device = run("losetup", &["-f", "--show", image_path])?;
        let mounted = Mounted {
            dir,
            loop_device: Some(device.clone()),
            image: Some(image),
            _one_at_a_time: turn,
        };
        run("mount", &["-o", options, &device, &path])?;
        prepare(&path)?;
        Ok(mounted)
    }

    /// The directory of [`Mounted::btrfs_with_quota`]'s mount that its quota limits.
    fn quota_dir(&self) -> PathBuf {
        self.path().join(QUOTA_DIR)
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes a file at the mount's root until the filesystem is full (to the last byte root
    /// may take); returns its path.
    fn fill(&self) -> PathBuf {
        fill(self.path())
    }

    fn remount_read_only(&self) -> Result<String, String> {
        run("mount", &["-o", "remount,ro", self.path().to_str().unwrap_or_default()])
    }

    /// Makes ext4 report an error (its sysfs `trigger_fs_error`), as a corrupted block found
    /// while running does: mounted `errors=remount-ro`, the filesystem turns read-only at once,
    /// files open for writing included (a remount read-only is refused while any is open).
    /// Returns false, having said why, where it cannot.
    fn trigger_ext4_error(&self) -> bool {
        let device = self.loop_device.as_deref().unwrap_or_default();
        let name = Path::new(device).file_name().unwrap_or_default();
        let trigger = Path::new("/sys/fs/ext4").join(name).join("trigger_fs_error");
        if let Err(e) = std::fs::write(&trigger, "1") {
            tierkv_testkit::cannot_mount(&format!("cannot write {}: {e}", trigger.display()));
            return false;
        }
        true
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = run("umount", &["-l", self.path().to_str().unwrap_or_default()]);
        if let Some(device) = &self.loop_device {
            let _ = run("losetup", &["-d", device]);
        }
        drop(self.image.take());
    }
}

#[test]
fn c12_an_unwritable_directory_opens_read_only_and_still_loads() {
    let Some(mount) = Mounted::tmpfs("8m") else {
        return;
    };
    let dir = mount.path().join("tier");
    {
        let (mut h, _) = open(config(&dir, 4, 4));
        h.store(&keys(0..6)).unwrap();
    }
    mount.remount_read_only().unwrap();
    let (mut h, store) = open(config(&dir, 4, 4));
    let why = store.read_only().expect("a read-only directory must be reported").to_string();
    assert!(why.contains("not writable"), "{why}");
    h.assert_loads(&keys(0..6));
    match h.store(&[key(9)]) {
        Err(TierError::Io(message)) => assert!(message.contains("not writable"), "{message}"),
        other => panic!("a store into a read-only directory answered {other:?}"),
    }
    assert!(h.lookup(&keys(0..2)).get(1), "lookups still work");
    h.tier.unlock(&keys(0..2));
}

#[test]
fn c12_a_full_disk_fails_stores_cleanly_and_keeps_loading() {
    let Some(mount) = Mounted::tmpfs("1m") else {
        return;
    };
    // Twenty segments configured, room for four on the filesystem: in a file each, and all
    // in one file (which grows a segment at a time).
    for per_file in [1, 20] {
        let dir = mount.path().join(format!("per-file-{per_file}"));
        let (mut h, store) = open(shared_files(&dir, 20, 3, per_file));
        for first in (0..12).step_by(3) {
            h.store(&keys(first..first + 3)).unwrap();
        }
        assert_eq!(h.lookup(&keys(0..12)).count_ones(), 12);
        match h.store(&[key(12)]) {
            Err(TierError::NoSpace(message)) => {
                assert!(message.contains("No space left"), "{message}")
            }
            other => {
                panic!("a store into a full disk with every segment locked answered {other:?}")
            }
        }
        h.assert_loads(&keys(0..12));
        h.tier.unlock(&keys(0..12));
        // With segments to reuse, the full disk behaves as a smaller cache.
        h.store(&keys(12..15)).unwrap();
        h.assert_loads(&keys(12..15));
        drop(h);
        store.close();
        drop(store);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn c12_a_disk_quota_exceeded_reuses_segments_like_a_full_disk() {
    // Twenty segments configured, room for about four under the quota (the subvolume's metadata
    // counts too) on a filesystem with room to spare: in a file each (creating a file fails),
    // and all in one file (growing it fails).
    for per_file in [1, 20] {
        let Some(mount) = Mounted::btrfs_with_quota(128, "1m") else {
            return;
        };
        let dir = mount.quota_dir();
        let (mut h, store) = open(shared_files(&dir, 20, 3, per_file));
        for first in (0..60).step_by(3) {
            let stored = h.store(&keys(first..first + 3));
            assert_eq!(store.read_only(), None, "the quota turned the store read-only");
            assert!(stored.is_ok(), "a store past the quota was refused: {stored:?}");
        }
        // The store outgrew the quota by evicting, as on a full disk: it holds the newest keys.
        let held = h.lookup(&keys(0..60));
        let held_keys: Vec<_> = held.iter_ones().map(|i| key(i as u64)).collect();
        assert!((3..20).contains(&held_keys.len()), "{} keys held", held_keys.len());
        assert!(held.get(59), "the newest key is held: {held:?}");
        h.assert_loads(&held_keys);
        // With every segment locked, a store has nowhere to go and says why.
        match h.store(&[key(60)]) {
            Err(TierError::NoSpace(message)) => {
                assert!(message.contains("quota exceeded"), "{message}")
            }
            other => panic!("a store past the quota with every segment locked answered {other:?}"),
        }
        assert_eq!(store.read_only(), None, "the quota turned the store read-only");
        h.tier.unlock(&held_keys);
        h.store(&keys(60..63)).unwrap();
        h.assert_loads(&keys(60..63));
        drop(h);
        store.close();
    }
}

#[test]
fn c12_a_quota_exceeded_with_copy_on_write_segments_turns_read_only_and_keeps_loading() {
    // Segment files that copy on write: written elsewhere and copied into the quota's subvolume
    // (as a restored backup is, or files made before the store turned copy-on-write off), so
    // the store finds them made and cannot turn it off. A segment written over there needs new
    // room, which a full quota does not have.
    let Some(mount) = Mounted::btrfs_with_quota(128, "4m") else {
        return;
    };
    let dir = mount.quota_dir();
    let elsewhere = tempfile::tempdir().unwrap();
    let (mut h, store) = open(config(elsewhere.path(), 4, 3));
    for first in (0..12).step_by(3) {
        h.store(&keys(first..first + 3)).unwrap();
    }
    drop(h);
    store.close();
    drop(store);
    for id in 0..4 {
        std::fs::copy(segment(elsewhere.path(), id), segment(&dir, id)).unwrap();
        let attributes = run("lsattr", &[segment(&dir, id).to_str().unwrap()]).unwrap();
        let flags = attributes.split_whitespace().next().unwrap_or_default();
        assert!(!flags.contains('C'), "the copy does not copy on write: {attributes}");
    }
    let (mut h, store) = open(config(&dir, 4, 3));
    assert_eq!(h.present(&keys(0..12)).count_ones(), 12);
    let filler = fill(&dir);

    // The store evicts a segment to reuse it; writing over it fails: the store turns read-only
    // instead of evicting another segment for every store.
    // That store and the stores after it fail for the same cause, and say so alike.
    let no_space = |stored: Result<(), TierError>| match stored {
        Err(TierError::NoSpace(message)) => {
            assert!(message.contains("quota exceeded"), "{message}")
        }
        other => panic!("a store over copy-on-write segments past the quota answered {other:?}"),
    };
    no_space(h.store(&keys(12..15)));
    let why = store.read_only().expect("the store stays writable where reuse makes no room");
    assert!(why.contains("copies on write"), "{why}");
    let held = h.present(&keys(0..12));
    let held_keys: Vec<_> = held.iter_ones().map(|i| key(i as u64)).collect();
    assert_eq!(held_keys.len(), 9, "more than the one segment reused was lost: {held:?}");
    h.assert_loads(&held_keys);
    no_space(h.store(&keys(15..18)));
    // The retry, while the quota is still full, stays read-only: becoming writable would lose
    // one more segment to the next store, every retry.
    assert!(!store.retry_writable(), "writable again on a full quota");
    no_space(h.store(&keys(18..21)));
    assert_eq!(h.present(&held_keys).count_ones(), 9, "a refused store evicted a segment");
    h.assert_loads(&held_keys);

    // Room again: the retry makes it writable, and stores resume.
    std::fs::remove_file(filler).unwrap();
    run("btrfs", &["filesystem", "sync", dir.to_str().unwrap()]).unwrap();
    assert!(store.retry_writable(), "still read-only with room: {:?}", store.read_only());
    h.store(&keys(21..24)).unwrap();
    h.assert_loads(&keys(21..24));
    drop(h);
    store.close();
}

/// Writes a file in `dir` until its filesystem, or its quota, refuses more; returns its path.
fn fill(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path).unwrap();
    let chunk = vec![1u8; 64 << 10];
    while std::io::Write::write_all(&mut file, &chunk).is_ok() {}
    while std::io::Write::write_all(&mut file, &chunk[..512]).is_ok() {}
    // Blocks the kernel only reserved for the write become the file's for good.
    let _ = file.sync_all();
    path
}

/// The physical byte offset of a file's first extent, from `filefrag`.
fn physical_start(path: &Path) -> Option<u64> {
    let out = run("filefrag", &["-e", "-b4096", path.to_str()?]).ok()?;
    // Extent lines look like: "   0:        0..      63:      34816..     34879:     64: ..."
    let line = out.lines().find(|l| l.trim_start().starts_with("0:"))?;
    let physical = line.split(':').nth(2)?.split("..").next()?.trim();
    physical.parse::<u64>().ok().map(|block| block * 4096)
}

#[test]
fn c12_eio_on_read_is_a_counted_miss_and_other_keys_keep_loading() {
    let Some(mount) = Mounted::ext4_on_loop(48) else {
        return;
    };
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (mut h, store) =
        metrics::with_local_recorder(&recorder, || open(config(mount.path(), 8, 3)));
    assert_eq!(store.io_mode(), Some(IoMode::Direct));
    h.store(&keys(0..3)).unwrap(); // segment 0
    h.store(&keys(3..6)).unwrap(); // segment 1
    let (Some(first), Some(second)) =
        (physical_start(&segment(mount.path(), 0)), physical_start(&segment(mount.path(), 1)))
    else {
        tierkv_testkit::cannot_mount("filefrag could not locate the segments");
        return;
    };
    if second <= first {
        tierkv_testkit::cannot_mount("the filesystem placed segment 1 before segment 0");
        return;
    }
    // Cut the device short inside segment 1's first record (two blocks in: its superblock and
    // the record's header stay, the payload goes): reads of keys 3-5 now fail with EIO below the
    // filesystem. (A cut exactly at a read's end also fails that read on this kernel.)
    mount.image.as_ref().unwrap().as_file().set_len(second + 2 * BLOCK).unwrap();
    let (loaded, _) = h.load(&keys(0..6));
    assert_eq!(loaded, tierkv_core::Bitmap::from_bools([true, true, true, false, false, false]));
    h.assert_loads(&keys(0..3));
    assert_eq!(
        counter(&snapshotter, "tierkv_errors_total", Some("io")),
        3,
        "each failed read is counted"
    );
    assert_eq!(h.tier.usage().objects, 3, "unreadable records left the index");
    // The store keeps running: lookups answer, and another load of the lost keys is a plain miss.
    assert_eq!(h.present(&keys(0..6)).count_ones(), 3);
    assert_eq!(h.load(&keys(3..6)).0.count_ones(), 0);
}

#[test]
fn a_reused_segment_forgets_its_earlier_records_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        // Three segments of four: storing 22 keys reuses segments several times, and the last
        // life of the last segment is half written over records of an earlier life.
        let (mut h, _) = open(config(dir.path(), 3, 4));
        store_in_pairs(&mut h, 0..22);
    }
    let (mut h, store) = open(config(dir.path(), 3, 4));
    let found = h.present(&keys(0..22));
    let present: Vec<usize> = found.iter_ones().collect();
    assert_eq!(store.recovered().records as usize, present.len());
    assert!(present.iter().all(|i| *i >= 12), "records of an earlier life came back: {present:?}");
    assert!(present.len() >= 8, "the last two segments' records survive: {present:?}");
    let survivors: Vec<_> = present.iter().map(|i| key(*i as u64)).collect();
    h.assert_loads(&survivors);
}

#[test]
fn a_reused_segment_is_a_new_life_to_the_policy_not_its_own_ghost_returning() {
    // Four segments of one record, evicted by S3-FIFO with nothing read until the end: each
    // segment goes in the order it was sealed. S3-FIFO remembers what it evicted (its ghosts)
    // and puts a returning key straight into its main queue; were a reused segment that key
    // again, it would jump the queue and be evicted before older ones (after seven stores,
    // keys 2, 3, 5 and 6 instead of 3 to 6).
    for last in 3..12u64 {
        let dir = tempfile::tempdir().unwrap();
        let config = DiskStoreConfig { policy: PolicyKind::S3Fifo, ..config(dir.path(), 4, 1) };
        let (mut h, _) = open(config);
        for n in 0..=last {
            h.store(&keys(n..n + 1)).unwrap();
        }
        // A lookup is a use, so only now, once: the active segment holds the last key, the
        // sealed ones the three before it.
        let present: Vec<u64> =
            h.present(&keys(0..last + 1)).iter_ones().map(|i| i as u64).collect();
        assert_eq!(present, (last - 3..=last).collect::<Vec<_>>(), "{} stores", last + 1);
    }
}

#[test]
fn segment_eviction_follows_the_policy_fed_one_use_per_hit() {
    // The disk against its policy run by hand as the reference: one record per segment, so the
    // n-th key stored opens the n-th segment life, which the policy knows by its serial n + 1
    // (and samples by it, in the disk as here). A seal seals the sealed life, a store that finds
    // no free segment evicts the policy's victim, and a hit, its lookup and its load together,
    // is one use. (S3-FIFO counts uses: a hit counted twice keeps a segment a round longer.)
    // With 96 segments the adaptive policy's shadow logs judge its order too.
    let chunks: Vec<u64> = (0..1500).collect();
    for (segments, ops) in [(4u64, 400), (96, 1500)] {
        for kind in PolicyKind::ALL {
            let dir = tempfile::tempdir().unwrap();
            let config = config(dir.path(), segments, 1);
            let (mut h, _) = open(DiskStoreConfig { policy: kind, ..config });
            let mut model: Box<dyn SegmentPolicy<u64, u64>> = kind.build_for_segments();
            let life = |n: u64| n + 1;
            let chunks_of = |s: &u64| &chunks[(*s - 1) as usize..*s as usize];
            let (mut active, mut free, mut stored) = (None::<u64>, segments, 0u64);
            let mut x = 0x2545_f491_4f6c_dd1du64;
            for _ in 0..ops {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if stored == 0 || x.is_multiple_of(3) {
                    h.store(&keys(stored..stored + 1)).unwrap();
                    if let Some(sealed) = active {
                        model.seal(life(sealed));
                    }
                    if free > 0 {
                        free -= 1;
                    } else {
                        assert!(model.evict(&mut |_| true, &chunks_of).is_some());
                    }
                    model.written(&life(stored), &stored);
                    active = Some(stored);
                    stored += 1;
                } else {
                    // Recent keys more often than old ones, so hits and ghosts both come up.
                    let n = stored - 1 - (x >> 8) % stored.min(1 + (x >> 40) % (2 * segments));
                    let hit = h.lookup(&keys(n..n + 1)).count_ones() == 1;
                    let expected = active == Some(n) || model.contains(&life(n));
                    assert_eq!(hit, expected, "key {n}, {kind:?}, {segments} segments");
                    if hit {
                        h.assert_loads(&keys(n..n + 1));
                        h.tier.unlock(&keys(n..n + 1));
                        model.hit(&life(n), &n);
                    } else {
                        model.missed(&n);
                    }
                }
            }
        }
    }
}

#[test]
fn c5_a_store_task_never_evicts_its_own_keys_already_here() {
    // One record per segment, LRU, the disk full: key 0's segment is the least recently used.
    // A task of keys 0 (here already) and 10 (new) must make room for 10 without taking 0,
    // which it reports stored: every key of a completed task is retrievable.
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 4, 1);
    let (mut h, _) = open(DiskStoreConfig { policy: PolicyKind::Lru, ..config });
    for n in 0..4 {
        h.store(&keys(n..n + 1)).unwrap();
    }
    let task = [key(0), key(10)];
    h.store(&task).unwrap();
    assert_eq!(h.lookup(&task).count_ones(), 2, "a key of the completed task was evicted");
    h.assert_loads(&task);
    h.tier.unlock(&task);
    assert_eq!(h.lookup(&keys(1..2)).count_ones(), 0, "the next least recently used went");
}

#[test]
fn a_chain_looked_up_root_first_loses_its_tail_segment_before_its_root() {
    // One record per segment, LRU over segments: keys 0, 1 and 2 (a chain, root first) fill
    // three sealed segments, 3 the open one. A lookup names the chain root first and touches it
    // leaf first, so the root's segment is the most recent of the three and the next store,
    // which finds no free segment, takes the tail's.
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), 4, 1);
    let (mut h, _) = open(DiskStoreConfig { policy: PolicyKind::Lru, ..config });
    for n in 0..4 {
        h.store(&keys(n..n + 1)).unwrap();
    }
    assert_eq!(h.lookup(&keys(0..3)).count_ones(), 3);
    h.tier.unlock(&keys(0..3));
    h.store(&keys(4..5)).unwrap();
    let held: Vec<u64> = (0..5).filter(|n| h.lookup(&keys(*n..n + 1)).count_ones() == 1).collect();
    assert_eq!(held, [0, 1, 3, 4], "the tail (2) goes first, never the root");
}

#[test]
fn smaller_segments_configured_later_cut_the_old_files_to_size() {
    // Two segments of eight records, then the same capacity as eight of two (a new default
    // segment size, say): each old file is cut to the new size when the store opens, so the
    // directory never holds more than the capacity. What the old layout left in a new
    // segment's first bytes is not served: its superblock names the old size.
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 2, 8));
        h.store(&keys(0..16)).unwrap();
    }
    let small = config(dir.path(), 8, 2);
    let capacity = small.capacity_bytes;
    let (mut h, store) = open(small);
    assert_eq!(store.recovered().records, 0, "no segment of the old size is read");
    assert_eq!(h.present(&keys(0..16)).count_ones(), 0);
    store_in_pairs(&mut h, 100..140);
    let sizes: u64 = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("seg-"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(sizes <= capacity, "segment files hold {sizes} bytes, the capacity is {capacity}");
    h.assert_loads(&keys(134..140));
}

#[test]
fn a_segment_whose_superblock_names_another_segment_size_is_empty() {
    // Segments of two records, then of four, each in a file of its own: every file kept starts
    // with a valid superblock of its segment's id, of the old size. A new layout's superblock
    // can lie anywhere in what an old one wrote (inside a payload a client chose), so a segment
    // whose superblock names another size holds nothing.
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 2));
        store_in_pairs(&mut h, 0..8);
    }
    let (mut h, store) = open(config(dir.path(), 2, 4));
    let recovered = store.recovered();
    assert_eq!((recovered.segments, recovered.records), (0, 0), "{recovered:?}");
    assert_eq!(h.present(&keys(0..8)).count_ones(), 0);
    h.store(&keys(10..14)).unwrap();
    h.store(&keys(14..18)).unwrap();
    h.assert_loads(&keys(10..18));
}

#[test]
fn segment_files_past_a_smaller_capacity_are_removed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 6, 2));
        store_in_pairs(&mut h, 0..12);
    }
    assert!(segment(dir.path(), 5).exists());
    // Half the capacity: segments 3, 4 and 5 are past it. A directory and another file named
    // like a segment are not the store's own and stay.
    std::fs::create_dir(segment(dir.path(), 7)).unwrap();
    let (mut h, store) = open(config(dir.path(), 3, 2));
    assert_eq!(store.recovered().removed_files, 3);
    assert!((3..6).all(|id| !segment(dir.path(), id).exists()));
    assert!(segment(dir.path(), 7).is_dir(), "not the store's own: left alone");
    // The first three segments' records still load.
    h.assert_loads(&keys(0..6));
    assert_eq!(h.present(&keys(6..12)).count_ones(), 0);
}

/// `config`, with `per_file` segments to a file.
fn shared_files(dir: &Path, segments: u64, per_segment: u64, per_file: u64) -> DiskStoreConfig {
    let config = config(dir, segments, per_segment);
    DiskStoreConfig { file_bytes: per_file * config.segment_bytes, ..config }
}

/// The lengths of the segment files in `dir`, by file number.
fn file_lengths(dir: &Path) -> Vec<(String, u64)> {
    let mut files: Vec<(String, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("seg-"))
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().len()))
        .collect();
    files.sort();
    files
}

#[test]
fn segments_share_files_and_a_restart_finds_each_in_its_place() {
    // Seven segments of two records, three to a file: files of 3, 3 and 1 segments. The store
    // goes round the disk more than once (evicting), a record in the middle segment of the
    // second file is damaged, and a restart finds every other record where it was written.
    let dir = tempfile::tempdir().unwrap();
    let config = shared_files(dir.path(), 7, 2, 3);
    let segment = config.segment_bytes;
    {
        let (mut h, _) = open(DiskStoreConfig { policy: PolicyKind::Lru, ..config.clone() });
        store_in_pairs(&mut h, 0..26);
        // 26 records in segments of two: the last 12 fill six sealed segments and the open one.
        h.assert_loads(&keys(12..26));
        assert_eq!(h.present(&keys(0..12)).count_ones(), 0, "evicted, two at a time");
    }
    let names: Vec<(String, u64)> = file_lengths(dir.path());
    let expected = [
        ("seg-00000000.tkv".to_string(), 3 * segment),
        ("seg-00000001.tkv".to_string(), 3 * segment),
        ("seg-00000002.tkv".to_string(), segment),
    ];
    assert_eq!(names, expected);
    // Damage the first record of file 1's first segment (segment 3), at its place in the file.
    flip(&dir.path().join("seg-00000001.tkv"), record_offset(0) + BLOCK + 7);
    let (mut h, store) = open(config);
    assert_eq!(store.recovered().records, 14);
    assert_eq!(store.recovered().segments, 7);
    let (loaded, _) = h.load(&keys(12..26));
    assert_eq!(loaded.count_ones(), 13, "the damaged record alone is a miss");
    let missed: Vec<u64> = (12..26).filter(|n| !loaded.get((n - 12) as usize)).collect();
    assert_eq!(h.present(&keys(missed[0]..missed[0] + 1)).count_ones(), 0, "and forgotten");
    let survivors: Vec<_> = (12..26).filter(|n| *n != missed[0]).map(key).collect();
    h.assert_loads(&survivors);
}

#[test]
fn a_disk_of_one_record_segments_evicts_one_chunk_and_keeps_the_used_one() {
    // The default layout: a segment is one record, so eviction frees one chunk; with LRU the
    // chunk a lookup just used stays and the least recent one goes, alone.
    let dir = tempfile::tempdir().unwrap();
    let config = DiskStoreConfig {
        policy: PolicyKind::Lru,
        io_threads: 2,
        ..DiskStoreConfig::new(dir.path(), 4 * tierkv_disk::auto_segment_bytes(CHUNK), CHUNK)
    };
    assert_eq!(config.segment_bytes, BLOCK + record_bytes(CHUNK));
    let (mut h, _) = open(config);
    for n in 0..4 {
        h.store(&keys(n..n + 1)).unwrap();
    }
    assert!(h.lookup(&keys(0..1)).get(0));
    h.tier.unlock(&keys(0..1));
    h.store(&keys(4..5)).unwrap();
    let held: Vec<u64> = (0..5).filter(|n| h.present(&keys(*n..n + 1)).get(0)).collect();
    assert_eq!(held, [0, 2, 3, 4], "only key 1, the least recent, went");
    h.assert_loads(&[key(0), key(2), key(3), key(4)]);
    assert_eq!(file_lengths(dir.path()).len(), 1, "four segments, one file");
}

#[test]
fn a_reused_segment_whose_first_write_did_not_land_whole_serves_no_wrong_bytes() {
    // One-record segments share a file. A reused segment's superblock goes down in one write
    // with its first record: a crash may leave all of that write, none of it, or a part. Each
    // case, made by putting back the bytes the segment held before, reopens to records that are
    // their keys' bytes: the old life whole, or nothing of the segment.
    let segment = tierkv_disk::auto_segment_bytes(CHUNK);
    let file = |dir: &Path| dir.join("seg-00000000.tkv");
    // (what is put back of the old bytes, keys the reopened store holds of 0 and 4)
    let cases: [(std::ops::Range<u64>, &[u64]); 4] = [
        (0..0, &[4]),          // the write landed
        (0..segment, &[0]),    // it did not: the previous life, key 0, whole
        (0..BLOCK, &[]),       // the record landed, not the superblock
        (BLOCK..segment, &[]), // the superblock landed, not the record
    ];
    for (restored, held) in cases {
        let dir = tempfile::tempdir().unwrap();
        let config = DiskStoreConfig {
            policy: PolicyKind::Lru,
            io_threads: 2,
            ..DiskStoreConfig::new(dir.path(), 4 * segment, CHUNK)
        };
        let old = {
            let (mut h, _) = open(config.clone());
            for n in 0..4 {
                h.store(&keys(n..n + 1)).unwrap();
            }
            h.tier.close();
            std::fs::read(file(dir.path())).unwrap()
        };
        {
            let (mut h, _) = open(config.clone());
            // Key 3's segment, open when the store closed, was sealed at the reopen: the next
            // store evicts the least recent sealed one, key 0's (segment 0).
            h.store(&keys(4..5)).unwrap();
            assert_eq!(h.present(&keys(0..1)).count_ones(), 0);
        }
        let f = OpenOptions::new().write(true).open(file(dir.path())).unwrap();
        let range = restored.start as usize..restored.end as usize;
        f.write_all_at(&old[range], restored.start).unwrap();
        let (mut h, store) = open(config);
        assert_eq!(store.recovered().damaged_records + store.recovered().torn_records, 0);
        let found: Vec<u64> =
            [0, 4].into_iter().filter(|n| h.present(&keys(*n..n + 1)).get(0)).collect();
        assert_eq!(found, held, "putting back bytes {restored:?}");
        h.assert_loads(&keys(1..4));
        for n in held {
            h.assert_loads(&keys(*n..n + 1));
        }
    }
}

#[test]
fn a_smaller_capacity_cuts_the_last_shared_file_and_removes_the_ones_past_it() {
    let dir = tempfile::tempdir().unwrap();
    let big = shared_files(dir.path(), 7, 2, 3);
    let segment = big.segment_bytes;
    {
        let (mut h, _) = open(big);
        store_in_pairs(&mut h, 0..14);
    }
    // Four segments: file 0 keeps its three, file 1 is cut to one, file 2 is removed.
    let small = shared_files(dir.path(), 4, 2, 3);
    let (mut h, store) = open(small);
    assert_eq!(store.recovered().removed_files, 1);
    let expected =
        [("seg-00000000.tkv".to_string(), 3 * segment), ("seg-00000001.tkv".to_string(), segment)];
    assert_eq!(file_lengths(dir.path()), expected);
    h.assert_loads(&keys(0..8));
    assert_eq!(h.present(&keys(8..14)).count_ones(), 0);
    // Larger again: file 1 grows back a segment at a time as its segments are used; the
    // records kept stay.
    drop(h);
    drop(store);
    let (mut h, _) = open(shared_files(dir.path(), 7, 2, 3));
    assert_eq!(file_lengths(dir.path())[1].1, segment, "not grown before it is needed");
    h.assert_loads(&keys(0..8));
    store_in_pairs(&mut h, 100..106);
    let lengths: Vec<u64> = file_lengths(dir.path()).into_iter().map(|(_, len)| len).collect();
    assert_eq!(lengths, [3 * segment, 3 * segment, segment]);
    h.assert_loads(&keys(0..8));
    h.assert_loads(&keys(100..106));
}

/// A sink that signals when its copy starts and waits (at most ten seconds) to be let go.
struct GatedSink {
    started: crossbeam_channel::Sender<()>,
    proceed: crossbeam_channel::Receiver<()>,
    bytes: Vec<u8>,
}

impl tierkv_core::ChunkSink for GatedSink {
    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn copy_from_host(&mut self, src: &[u8]) -> Result<(), tierkv_core::BufferError> {
        let _ = self.started.send(());
        let _ = self.proceed.recv_timeout(std::time::Duration::from_secs(10));
        self.bytes.copy_from_slice(src);
        Ok(())
    }
}

#[test]
fn a_segment_being_read_is_never_evicted_under_the_load() {
    let dir = tempfile::tempdir().unwrap();
    let (mut h, _) = open(config(dir.path(), 2, 2));
    h.store(&keys(0..2)).unwrap(); // segment 0
    h.store(&keys(2..4)).unwrap(); // segment 1
    assert!(h.lookup(&[key(2)]).get(0), "segment 1 is locked from here on");
    // Load keys 0 and 1 (both in segment 0), held after the first copy.
    let (started, is_started) = crossbeam_channel::bounded(1);
    let (let_go, proceed) = crossbeam_channel::bounded(1);
    let gated = GatedSink { started, proceed, bytes: vec![0; CHUNK as usize] };
    let items = vec![
        tierkv_core::LoadItem { key: key(0), sink: Box::new(gated) },
        tierkv_core::LoadItem {
            key: key(1),
            sink: Box::new(tierkv_core::VecChunk(vec![0; CHUNK as usize])),
        },
    ];
    let load = h.tier.submit_load(items);
    is_started.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
    // The only other segment is locked, segment 0 is pinned by the load: nothing may be evicted.
    let refused = h.store(&[key(4)]);
    let_go.send(()).unwrap();
    let loaded = match h.wait(load) {
        tierkv_core::Completion::Loaded { loaded, .. } => loaded,
        _ => panic!("not a load completion"),
    };
    assert!(
        matches!(refused, Err(TierError::NoSpace(_))),
        "a pinned segment was evicted: {refused:?}"
    );
    assert_eq!(loaded.count_ones(), 2, "the load was cut short");
    h.tier.unlock(&[key(2)]);
}

#[test]
fn a_segment_with_records_not_yet_published_is_never_evicted_under_its_store() {
    // Two segments of two records; segment 0 is locked. One store of three records fills
    // segment 1 and needs another segment for its third: the only candidate is segment 1, whose
    // two records are written but not published until the whole store is. Evicting it would
    // reuse their space for the third record, and publishing would then map the first key onto
    // the third's bytes (found by the cascade stress test as a locked record that failed its
    // check).
    let dir = tempfile::tempdir().unwrap();
    let (mut h, _) = open(config(dir.path(), 2, 2));
    h.store(&keys(0..2)).unwrap(); // segment 0
    assert!(h.lookup(&[key(0)]).get(0), "segment 0 is locked from here on");
    let stored = h.store(&keys(2..5));
    assert!(matches!(stored, Err(TierError::NoSpace(_))), "no segment was free: {stored:?}");
    assert_eq!(h.present(&keys(2..5)).count_ones(), 0, "a failed store published a record");
    // The records published before are untouched, and the room comes back with the lock.
    h.assert_loads(&keys(0..2));
    h.tier.unlock(&[key(0)]);
    h.store(&keys(2..4)).unwrap();
    h.assert_loads(&keys(2..4));
}

#[test]
fn a_load_in_progress_does_not_stop_deletes_in_its_segment() {
    let dir = tempfile::tempdir().unwrap();
    let (mut h, _) = open(config(dir.path(), 4, 4));
    h.store(&keys(0..3)).unwrap(); // all in segment 0
    let (started, is_started) = crossbeam_channel::bounded(1);
    let (let_go, proceed) = crossbeam_channel::bounded(1);
    let gated = GatedSink { started, proceed, bytes: vec![0; CHUNK as usize] };
    let load =
        h.tier.submit_load(vec![tierkv_core::LoadItem { key: key(0), sink: Box::new(gated) }]);
    is_started.recv_timeout(std::time::Duration::from_secs(10)).unwrap();
    // Segment 0 is pinned by the load; neither key 1 nor key 2 is locked.
    assert_eq!(h.tier.delete(&[key(1)]), 1, "an unlocked key was not deleted");
    // The key being loaded is not locked either: it goes too, and its load still completes
    // (the pin keeps the segment from reuse, not the key in the index).
    assert_eq!(h.tier.clear(), 2, "clear skipped an unlocked key");
    let_go.send(()).unwrap();
    match h.wait(load) {
        tierkv_core::Completion::Loaded { loaded, .. } => {
            assert!(loaded.get(0), "the pinned record was still readable")
        }
        _ => panic!("not a load completion"),
    }
    assert_eq!(h.present(&keys(0..3)).count_ones(), 0);
    assert_eq!(h.tier.usage().objects, 0);
}

#[test]
fn a_record_that_is_not_the_key_asked_for_is_a_miss() {
    let dir = tempfile::tempdir().unwrap();
    let (mut h, _) = open(config(dir.path(), 4, 4));
    h.store(&keys(0..2)).unwrap();
    // A misdirected write: record 1, valid in every byte, lands where record 0 lives.
    let path = segment(dir.path(), 0);
    let file = OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut record = vec![0; record_bytes(CHUNK) as usize];
    file.read_exact_at(&mut record, record_offset(1)).unwrap();
    file.write_all_at(&record, record_offset(0)).unwrap();
    file.sync_all().unwrap();
    assert!(!h.load(&[key(0)]).0.get(0), "the bytes of key 1 were served as key 0");
    h.assert_loads(&[key(1)]);
}

#[test]
fn the_scan_finds_records_after_a_damaged_header_even_past_zero_payload_blocks() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 4));
        h.store(&[key(0)]).unwrap();
        // A chunk of zeros (KV caches have them: padding, masked positions).
        let zeros = tierkv_core::StoreItem {
            key: key(1),
            source: Box::new(tierkv_core::VecChunk(vec![0; CHUNK as usize])),
        };
        let task = h.tier.submit_store(vec![zeros]);
        assert!(matches!(h.wait(task), tierkv_core::Completion::Stored { result: Ok(()), .. }));
        h.store(&keys(2..4)).unwrap();
    }
    flip(&segment(dir.path(), 0), record_offset(1) + 20);
    let (mut h, store) = open(config(dir.path(), 4, 4));
    assert_eq!(store.recovered().records, 3);
    h.assert_loads(&[key(0), key(2), key(3)]);
}

/// Stores one `len`-byte chunk of `k` and waits for the outcome.
fn store_sized(h: &mut Harness, k: tierkv_core::ObjectKey, len: u64) {
    let item = tierkv_core::StoreItem {
        key: k,
        source: Box::new(tierkv_core::VecChunk(payload(&k, len))),
    };
    let task = h.tier.submit_store(vec![item]);
    match h.wait(task) {
        tierkv_core::Completion::Stored { result, .. } => result.unwrap(),
        _ => panic!("not a store completion"),
    }
}

/// Loads one `len`-byte chunk of `k` and returns its bytes, if it loaded.
fn load_sized(h: &mut Harness, k: tierkv_core::ObjectKey, len: u64) -> Option<Vec<u8>> {
    let item = tierkv_core::LoadItem {
        key: k,
        sink: Box::new(tierkv_core::VecChunk(vec![0; len as usize])),
    };
    let task = h.tier.submit_load(vec![item]);
    match h.wait(task) {
        tierkv_core::Completion::Loaded { loaded, mut sinks, .. } => {
            loaded.get(0).then(|| sinks[0].sink.host_bytes_mut().unwrap().to_vec())
        }
        _ => panic!("not a load completion"),
    }
}

#[test]
fn a_reused_segment_that_ends_inside_an_older_payload_reopens_without_damage() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 2, 4));
        h.store(&keys(0..8)).unwrap(); // both segments full of 64 KiB records
        // Segment 0 is reused for two 4 KiB chunks: its new life ends in the middle of the
        // payload of its earlier life's first record, which is neither a header nor zeros.
        store_sized(&mut h, key(100), BLOCK);
        store_sized(&mut h, key(101), BLOCK);
    }
    let (mut h, store) = metrics::with_local_recorder(&recorder, || open(config(dir.path(), 2, 4)));
    let recovered = store.recovered();
    assert_eq!(recovered.records, 6, "keys 100, 101 and segment 1's four");
    assert_eq!(
        (recovered.damaged_blocks, recovered.torn_records),
        (0, 0),
        "the end of a life over older bytes is not damage: {recovered:?}"
    );
    assert_eq!(counter(&snapshotter, "tierkv_checksum_failures_total", None), 0);
    for k in [key(100), key(101)] {
        assert_eq!(load_sized(&mut h, k, BLOCK), Some(payload(&k, BLOCK)));
    }
    h.assert_loads(&keys(4..8));
}

#[test]
fn records_damaged_or_torn_before_a_restart_are_counted_when_it_opens() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        h.store(&keys(0..5)).unwrap();
    }
    flip(&segment(dir.path(), 0), record_offset(1) + 40); // key 1: header
    let file = OpenOptions::new().write(true).open(segment(dir.path(), 0)).unwrap();
    file.set_len(record_offset(4) + BLOCK + 1000).unwrap(); // key 4: torn
    let (mut h, store) = metrics::with_local_recorder(&recorder, || open(config(dir.path(), 4, 8)));
    assert_eq!(store.recovered().records, 3);
    assert_eq!(store.recovered().torn_records, 1);
    assert_eq!(
        counter(&snapshotter, "tierkv_checksum_failures_total", None),
        2,
        "one damaged header and one torn record"
    );
    assert_eq!(h.present(&keys(0..5)).count_ones(), 3);
    h.assert_loads(&[key(0), key(2), key(3)]);
}

#[test]
fn a_lock_follows_its_key_to_the_record_that_replaced_a_damaged_one() {
    // Segments of one record. A lookup holds key 0 (a hit held below L1) when a load finds its
    // record damaged and drops it; the engine recomputes and stores the key again, into another
    // segment, and a second lookup locks it. That segment must stay while the locks do, however
    // full the disk gets; the damaged one may go.
    let dir = tempfile::tempdir().unwrap();
    let (mut h, _store) = open(config(dir.path(), 4, 1));
    h.store(&[key(0)]).unwrap();
    assert!(h.lookup(&[key(0)]).get(0));
    flip(&segment(dir.path(), 0), record_offset(0) + BLOCK + 5);
    assert!(!h.load(&[key(0)]).0.get(0), "the damage is found, the record dropped");
    h.store(&[key(0)]).unwrap();
    assert!(h.lookup(&[key(0)]).get(0));
    for k in 1..12 {
        h.store(&[key(k)]).unwrap();
    }
    h.assert_loads(&[key(0)]);
    h.tier.unlock(&[key(0), key(0)]);
    assert_eq!(h.tier.usage().locks, 0);
}

#[test]
fn a_damaged_first_header_read_with_the_superblock_loses_only_its_record() {
    // The restart reads a segment's superblock and first header in one read. Segments of four
    // records: key 0's header damaged, the scan finds key 1's after it. Segments of one record,
    // three to a file: the middle one's header damaged, that record alone is lost.
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        h.store(&keys(0..4)).unwrap();
    }
    flip(&segment(dir.path(), 0), record_offset(0) + 40);
    let (mut h, store) = open(config(dir.path(), 4, 8));
    assert_eq!((store.recovered().records, store.recovered().damaged_records), (3, 1));
    assert_eq!(h.present(&keys(0..4)).iter_ones().collect::<Vec<_>>(), [1, 2, 3]);
    h.assert_loads(&keys(1..4));

    let dir = tempfile::tempdir().unwrap();
    let config = shared_files(dir.path(), 3, 1, 3);
    {
        let (mut h, _) = open(config.clone());
        for k in 0..3 {
            h.store(&keys(k..k + 1)).unwrap();
        }
    }
    flip(&segment(dir.path(), 0), config.segment_bytes + record_offset(0) + 40);
    let (mut h, store) = open(config);
    assert_eq!(store.recovered().records, 2);
    assert_eq!(h.present(&keys(0..3)).iter_ones().collect::<Vec<_>>(), [0, 2]);
    h.assert_loads(&[key(0), key(2)]);
}

/// A sink whose `len` panics: a bug in the caller's buffer type.
struct PanickingSink;

impl tierkv_core::ChunkSink for PanickingSink {
    fn len(&self) -> u64 {
        panic!("a sink that cannot say its length")
    }

    fn copy_from_host(&mut self, _: &[u8]) -> Result<(), tierkv_core::BufferError> {
        Ok(())
    }
}

/// A source whose `len` panics from its second call on.
struct FlakySource {
    calls: std::sync::atomic::AtomicU32,
}

impl tierkv_core::ChunkSource for FlakySource {
    fn len(&self) -> u64 {
        let calls = self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(calls == 0, "a source that cannot say its length twice");
        CHUNK
    }

    fn copy_to_host(&self, dst: &mut [u8]) -> Result<(), tierkv_core::BufferError> {
        dst.fill(1);
        Ok(())
    }
}

#[test]
fn a_panic_inside_a_task_fails_it_and_leaves_no_pin_and_no_stuck_key_behind() {
    let dir = tempfile::tempdir().unwrap();
    let (mut h, _) = open(config(dir.path(), 2, 2));
    h.store(&keys(0..2)).unwrap(); // segment 0
    h.store(&keys(2..4)).unwrap(); // segment 1

    // A load that panics after segment 0 was pinned for it.
    let items = vec![
        tierkv_core::LoadItem { key: key(0), sink: Box::new(PanickingSink) },
        tierkv_core::LoadItem {
            key: key(1),
            sink: Box::new(tierkv_core::VecChunk(vec![0; CHUNK as usize])),
        },
    ];
    let task = h.tier.submit_load(items);
    match h.wait(task) {
        tierkv_core::Completion::Loaded { loaded, sinks, .. } => {
            assert_eq!(loaded.len(), 2, "one bit per key, even after a panic");
            assert_eq!(loaded.count_ones(), 0);
            assert_eq!(sinks.len(), 2, "the sinks are handed back");
        }
        _ => panic!("not a load completion"),
    }
    // Segment 0 (touched by the load) is evicted second: only if the panic left it unpinned.
    h.store(&keys(4..6)).unwrap();
    h.store(&keys(6..8)).unwrap();
    assert_eq!(h.present(&keys(0..2)).count_ones(), 0, "segment 0 stayed pinned");
    h.assert_loads(&keys(4..8));

    // A store whose source cannot say its length twice, after another record of the task was
    // handed over: its length is asked once, so the task stores both. (Asked again, it panicked
    // with the first record handed over and never published, and that record's segment could
    // never be evicted again.)
    let good = tierkv_core::StoreItem {
        key: key(8),
        source: Box::new(tierkv_core::VecChunk(payload(&key(8), CHUNK))),
    };
    let flaky = tierkv_core::StoreItem {
        key: key(9),
        source: Box::new(FlakySource { calls: std::sync::atomic::AtomicU32::new(0) }),
    };
    let task = h.tier.submit_store(vec![good, flaky]);
    match h.wait(task) {
        tierkv_core::Completion::Stored { result, sources, .. } => {
            assert_eq!(result, Ok(()), "the length was asked again");
            assert_eq!(sources.len(), 2, "the sources are handed back");
        }
        _ => panic!("not a store completion"),
    }
    h.assert_loads(&[key(8)]);
    assert_eq!(h.present(&[key(9)]).count_ones(), 1);
    // Both segments can still be evicted: each store below needs one.
    for first in (10..18).step_by(2) {
        h.store(&keys(first..first + 2)).unwrap();
    }
    h.assert_loads(&keys(14..18));
}

// ----- issue 16: hardening -----

#[test]
fn h16_4_a_second_store_on_a_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let (mut h, first) = open(config(dir.path(), 4, 4));
    h.store(&keys(0..3)).unwrap();
    let pid = std::process::id();
    match DiskStore::open(config(dir.path(), 4, 4)) {
        Err(e @ tierkv_disk::DiskError::Locked { .. }) => {
            let message = e.to_string();
            assert!(message.contains(&format!("pid {pid}")), "{message}");
            assert!(message.contains(&dir.path().display().to_string()), "{message}");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("two stores opened the same directory"),
    }
    // The first store is untouched by the refused open, and its lock goes with it.
    h.assert_loads(&keys(0..3));
    drop(h);
    drop(first);
    let (mut h, _) = open(config(dir.path(), 4, 4));
    h.assert_loads(&keys(0..3));
}

#[test]
fn h16_5_odd_files_named_like_segments_are_skipped_and_never_used() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 2));
        h.store(&keys(0..2)).unwrap();
    }
    // Segment 0 holds the records; 1, 2 and 3 are a directory, a FIFO and a symlink.
    std::fs::create_dir(segment(dir.path(), 1)).unwrap();
    let fifo = std::ffi::CString::new(segment(dir.path(), 2).to_str().unwrap()).unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let elsewhere = tempfile::NamedTempFile::new().unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), segment(dir.path(), 3)).unwrap();

    let (mut h, store) = open(config(dir.path(), 4, 2));
    assert_eq!(store.recovered().skipped_files, 3);
    assert_eq!(store.recovered().records, 2);
    h.assert_loads(&keys(0..2));
    // With the other three ids unusable, a store evicts segment 0 and reuses its file; the odd
    // entries stay as they were.
    h.store(&keys(2..4)).unwrap();
    h.assert_loads(&keys(2..4));
    assert!(segment(dir.path(), 1).is_dir());
    assert!(std::fs::symlink_metadata(segment(dir.path(), 3)).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::metadata(elsewhere.path()).unwrap().len(), 0, "a symlink is not followed");
}

#[test]
fn h16_6_the_directory_and_segment_files_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("tier");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    {
        let (mut h, _) = open(config(&dir, 4, 2));
        h.store(&keys(0..3)).unwrap();
    }
    assert_eq!(mode(&dir), 0o700);
    for id in 0..2 {
        assert_eq!(mode(&segment(&dir, id)), 0o600, "segment {id}");
    }
    // A directory and files left readable by an earlier version are tightened at open.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(segment(&dir, 0), std::fs::Permissions::from_mode(0o644)).unwrap();
    {
        let (mut h, _) = open(config(&dir, 4, 2));
        h.assert_loads(&keys(0..3));
    }
    assert_eq!((mode(&dir), mode(&segment(&dir, 0))), (0o700, 0o600));
    // With a group, the group may read.
    // SAFETY: getegid cannot fail.
    let gid = unsafe { libc::getegid() };
    {
        let (mut h, _) = open(DiskStoreConfig { group: Some(gid), ..config(&dir, 4, 2) });
        h.assert_loads(&keys(0..3));
    }
    assert_eq!((mode(&dir), mode(&segment(&dir, 0))), (0o750, 0o640));
}

/// Whether a probe file (`.tierkv-probe-PID`) was left in `dir`.
fn probe_left(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .any(|entry| entry.file_name().to_string_lossy().starts_with(".tierkv-probe-"))
}

#[test]
fn h16_3_a_store_opened_on_a_full_filesystem_reuses_its_segments() {
    // A tmpfs, and ext4 on a loop device (direct I/O over `fallocate`d extents).
    let mounts: [fn() -> Option<Mounted>; 2] =
        [|| Mounted::tmpfs("2m"), || Mounted::ext4_on_loop(48)];
    for mount in mounts {
        let Some(mount) = mount() else {
            return;
        };
        // Two of four segments written, then the store stops (a daemon restarted) and something
        // else takes the rest of the filesystem.
        let dir = mount.path().join("tier");
        let empty = mount.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let writable_mode = {
            let (mut h, store) = open(config(&dir, 4, 2));
            store_in_pairs(&mut h, 0..4);
            store.io_mode()
        };
        let filler = mount.fill();

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let (mut h, store) = metrics::with_local_recorder(&recorder, || open(config(&dir, 4, 2)));
        assert_eq!(store.read_only(), None, "a full filesystem turned the store read-only");
        assert_eq!(read_only_gauge(&snapshotter), Some(0.0));
        assert!(!probe_left(&dir), "the probe left its file on the full filesystem");
        h.assert_loads(&keys(0..4));
        // No segment file can be made or grown: stores reuse the two segments, as when the
        // store fills the disk while running, and the newest keys load as stored.
        for first in (10..16).step_by(2) {
            let stored = h.store(&keys(first..first + 2));
            assert!(stored.is_ok(), "a store into the full filesystem failed: {stored:?}");
        }
        assert_eq!(store.read_only(), None);
        assert_eq!(h.present(&keys(0..16)).count_ones(), 4, "more than the two segments hold");
        h.assert_loads(&keys(14..16));

        // An empty store on the full filesystem has nothing to reuse: its stores say so.
        let (mut e, empty_store) = open(config(&empty, 4, 2));
        assert_eq!(empty_store.read_only(), None, "a full filesystem turned the store read-only");
        match e.store(&keys(0..2)) {
            Err(TierError::NoSpace(message)) => {
                assert!(message.contains("No space left"), "{message}")
            }
            other => panic!("a store into an empty store on a full disk answered {other:?}"),
        }

        // Space back: the store grows into its other segments again.
        std::fs::remove_file(&filler).unwrap();
        store_in_pairs(&mut h, 20..28);
        assert_eq!(h.present(&keys(0..28)).count_ones(), 8, "the store did not grow again");
        h.assert_loads(&keys(26..28));
        // The empty store found no segment file to tell its I/O mode from: its first segment
        // file is made in the mode a store opened with room has (direct I/O on ext4), not in
        // buffered I/O for the rest of the process.
        e.store(&keys(0..2)).unwrap();
        e.assert_loads(&keys(0..2));
        assert_eq!(empty_store.io_mode(), writable_mode, "the empty store's first segment");
        drop((e, empty_store));
        drop(h);
        store.close();
    }
}

#[test]
fn h16_3_a_read_only_store_becomes_writable_on_a_full_filesystem() {
    let Some(mount) = Mounted::ext4_on_loop(48) else {
        return;
    };
    let dir = mount.path().join("tier");
    let (mut h, store) = open(config(&dir, 4, 2));
    store_in_pairs(&mut h, 0..4);
    // Read-only for a while; meanwhile something else fills the filesystem.
    immutable(&dir, true);
    assert!(h.store(&keys(4..6)).is_err(), "a store into an unwritable directory succeeded");
    assert!(store.read_only().is_some());
    mount.fill();
    immutable(&dir, false);
    // Writable, though full: stores reuse the segments.
    assert!(store.retry_writable(), "still read-only: {:?}", store.read_only());
    assert!(!probe_left(&dir), "the probe left its file on the full filesystem");
    for first in (10..16).step_by(2) {
        let stored = h.store(&keys(first..first + 2));
        assert!(stored.is_ok(), "a store into the full filesystem failed: {stored:?}");
    }
    assert_eq!(store.read_only(), None);
    h.assert_loads(&keys(14..16));
}

fn read_only_gauge(snapshotter: &Snapshotter) -> Option<f64> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(k, ..)| k.key().name() == "tierkv_disk_read_only")
        .map(|(.., v)| if let DebugValue::Gauge(g) = v { g.into_inner() } else { -1.0 })
}

#[test]
fn c12_a_filesystem_that_turns_read_only_while_running_refuses_stores_and_keeps_its_chunks() {
    let Some(mount) = Mounted::ext4_on_loop_with(48, "errors=remount-ro") else {
        return;
    };
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Eight segments of one record, all used: a store must reuse one.
    let (mut h, store) =
        metrics::with_local_recorder(&recorder, || open(config(mount.path(), 8, 1)));
    h.store(&keys(0..8)).unwrap();
    if !mount.trigger_ext4_error() {
        return;
    }
    // The first store evicts the policy's victim and then fails to write over it; that failure
    // turns the store read-only, so the stores after it are refused before they evict anything.
    for n in 100..110 {
        assert!(h.store(&[key(n)]).is_err(), "a store into a read-only filesystem succeeded");
    }
    assert_eq!(h.tier.usage().objects, 7, "only the first failed store's victim is gone");
    assert_eq!(h.load(&keys(0..8)).0.count_ones(), 7, "the chunks kept all load");
    let why = store.read_only().expect("a filesystem turned read-only must be reported");
    assert!(why.contains("Read-only file system"), "{why}");
    assert_eq!(read_only_gauge(&snapshotter), Some(1.0));
    match h.store(&[key(200)]) {
        Err(TierError::Io(message)) => assert!(message.contains("refused"), "{message}"),
        other => panic!("a store into a read-only store answered {other:?}"),
    }
    assert!(!store.retry_writable(), "ext4 stays read-only until it is mounted again");
}

/// Sets or clears the immutable attribute of `dir` and everything in it: even root can then
/// neither create files there nor write to those it holds open.
fn immutable(dir: &Path, on: bool) {
    run("chattr", &["-R", if on { "+i" } else { "-i" }, dir.to_str().unwrap()]).unwrap();
}

#[test]
fn c12_a_directory_made_unwritable_while_running_turns_read_only_and_recovers() {
    let Some(mount) = Mounted::ext4_on_loop(48) else {
        return;
    };
    let dir = mount.path().join("tier");
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (mut h, store) = metrics::with_local_recorder(&recorder, || open(config(&dir, 8, 1)));
    h.store(&keys(0..4)).unwrap();
    immutable(&dir, true);
    for n in 100..106 {
        assert!(h.store(&[key(n)]).is_err(), "a store into an unwritable directory succeeded");
    }
    h.assert_loads(&keys(0..4));
    let why = store.read_only().expect("a directory made unwritable must be reported");
    assert!(why.contains("not writable") && why.contains("not permitted"), "{why}");
    assert_eq!(read_only_gauge(&snapshotter), Some(1.0));
    assert!(!store.retry_writable(), "still unwritable");

    immutable(&dir, false);
    assert!(metrics::with_local_recorder(&recorder, || store.retry_writable()));
    assert_eq!(store.read_only(), None);
    assert_eq!(read_only_gauge(&snapshotter), Some(0.0));
    // Writable again in every segment: eight more keys fill the free segments (new files) and
    // reuse the four the store wrote before (files it held open across the read-only time).
    h.store(&keys(10..18)).unwrap();
    h.assert_loads(&keys(10..18));
    drop((h, store));
    let (mut h, _) = open(config(&dir, 8, 1));
    h.assert_loads(&keys(10..18));
}

#[test]
fn h16_15_deletes_and_clears_are_persistent_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 8, 4));
        h.store(&keys(0..10)).unwrap();
        assert_eq!(h.tier.delete(&[key(2), key(7)]), 2);
    }
    {
        let (mut h, store) = open(config(dir.path(), 8, 4));
        assert_eq!(store.recovered().records, 8);
        assert_eq!(store.recovered().deleted_records, 2);
        let present = h.present(&keys(0..10));
        assert!(!present.get(2) && !present.get(7), "deleted records came back");
        assert_eq!(present.count_ones(), 8);
        let kept: Vec<u64> = (0..10).filter(|i| *i != 2 && *i != 7).collect();
        h.assert_loads(&kept.iter().map(|&i| key(i)).collect::<Vec<_>>());
        // A key stored again after its delete is a new record, found after a restart.
        h.store(&[key(2)]).unwrap();
        assert_eq!(h.tier.clear(), 9);
    }
    let (mut h, store) = open(config(dir.path(), 8, 4));
    assert_eq!(store.recovered().records, 0, "a cleared store comes back empty");
    assert_eq!(h.present(&keys(0..10)).count_ones(), 0);
    h.store(&keys(0..3)).unwrap();
    h.assert_loads(&keys(0..3));
}

// ----- issue 13: split loads and pipelined writes -----

/// A source whose copy fails: the device refused it.
struct RefusingSource;

impl tierkv_core::ChunkSource for RefusingSource {
    fn len(&self) -> u64 {
        CHUNK
    }

    fn copy_to_host(&self, _: &mut [u8]) -> Result<(), tierkv_core::BufferError> {
        Err(tierkv_core::BufferError::Device("refused".into()))
    }
}

#[test]
fn a_load_split_over_the_io_threads_answers_every_key_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let (mut h, _) = open(config(dir.path(), 16, 4));
    h.store(&keys(0..40)).unwrap();
    // Present and absent keys interleaved, over several segments: one task, split in parts.
    let asked: Vec<_> = (0..40).flat_map(|i| [key(i), key(1000 + i)]).collect();
    let (loaded, bytes) = h.load(&asked);
    for (i, (k, b)) in asked.iter().zip(&bytes).enumerate() {
        let present = i % 2 == 0;
        assert_eq!(loaded.get(i), present, "bit {i} of the split load");
        if present {
            assert!(*b == tierkv_core_payload(k), "key {i} loaded other bytes");
        }
    }
    assert_eq!(h.locks(), 0);

    // A sink that panics fails its own part only; the task still completes once, every sink
    // handed back, and pins nothing (segment eviction below needs every segment unpinned).
    let mut items: Vec<tierkv_core::LoadItem> = keys(0..12)
        .into_iter()
        .map(|key| tierkv_core::LoadItem {
            key,
            sink: Box::new(tierkv_core::VecChunk(vec![0; CHUNK as usize])),
        })
        .collect();
    items[0].sink = Box::new(PanickingSink);
    let task = h.tier.submit_load(items);
    match h.wait(task) {
        tierkv_core::Completion::Loaded { loaded, sinks, .. } => {
            assert_eq!((loaded.len(), sinks.len()), (12, 12));
            assert!(!loaded.get(0));
            assert!((6..12).all(|i| loaded.get(i)), "a part without the panic failed: {loaded:?}");
            assert!(sinks.iter().zip(keys(0..12)).all(|(s, k)| s.key == k), "sinks out of order");
        }
        _ => panic!("not a load completion"),
    }
    h.store(&keys(100..164)).unwrap();
    h.assert_loads(&keys(100..164));
}

fn tierkv_core_payload(k: &tierkv_core::ObjectKey) -> Vec<u8> {
    tierkv_testkit::contract::payload(k, CHUNK)
}

#[test]
fn a_source_that_fails_mid_task_leaves_no_hole_before_later_records() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut h, _) = open(config(dir.path(), 4, 8));
        let mut items: Vec<tierkv_core::StoreItem> = keys(0..4)
            .into_iter()
            .map(|key| tierkv_core::StoreItem {
                key,
                source: Box::new(tierkv_core::VecChunk(tierkv_core_payload(&key))),
            })
            .collect();
        items[2].source = Box::new(RefusingSource);
        let task = h.tier.submit_store(items);
        match h.wait(task) {
            tierkv_core::Completion::Stored { result, sources, .. } => {
                assert!(result.is_err(), "a store whose source failed reported success");
                assert_eq!(sources.len(), 4);
            }
            _ => panic!("not a store completion"),
        }
        assert_eq!(h.present(&keys(0..4)).count_ones(), 0, "a failed task published records");
        h.store(&keys(4..6)).unwrap();
        h.assert_loads(&keys(4..6));
    }
    // After a restart the scan reads on past the records of the failed task (written whole, so
    // valid) to the later ones: the failed copy left no gap in the segment.
    let (mut h, store) = open(config(dir.path(), 4, 8));
    let recovered = store.recovered();
    assert_eq!((recovered.damaged_records, recovered.torn_records), (0, 0), "{recovered:?}");
    h.assert_loads(&keys(4..6));
    assert_eq!(h.present(&keys(2..4)).count_ones(), 0, "records after the failed copy");
}

#[test]
fn a_key_deleted_or_cleared_after_its_failed_store_wrote_it_stays_gone_across_a_restart() {
    // A task whose second source fails writes the first record and publishes nothing: the key
    // is not indexed, so a delete or a clear finds nothing of it to mark. The record must not
    // come back with a restart all the same.
    for clear in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut h, _) = open(config(dir.path(), 4, 8));
            let items = vec![
                tierkv_core::StoreItem {
                    key: key(0),
                    source: Box::new(tierkv_core::VecChunk(tierkv_core_payload(&key(0)))),
                },
                tierkv_core::StoreItem { key: key(1), source: Box::new(RefusingSource) },
            ];
            let task = h.tier.submit_store(items);
            match h.wait(task) {
                tierkv_core::Completion::Stored { result, .. } => assert!(result.is_err()),
                _ => panic!("not a store completion"),
            }
            let deleted = if clear { h.tier.clear() } else { h.tier.delete(&[key(0)]) };
            assert_eq!(deleted, 0, "nothing indexed to delete");
        }
        let (mut h, _) = open(config(dir.path(), 4, 8));
        assert_eq!(h.present(&keys(0..2)).count_ones(), 0, "back after a restart (clear: {clear})");
    }
}

#[test]
fn pipelined_stores_of_many_tasks_survive_a_restart_byte_exact() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (h, store) = open(config(dir.path(), 8, 8));
        // Many tasks in flight at once, each of several records, filling several segments.
        let tasks: Vec<_> = (0..8).map(|t| h.submit_store(&keys(t * 6..t * 6 + 6))).collect();
        let mut h = h;
        for task in tasks {
            match h.wait(task) {
                tierkv_core::Completion::Stored { result, .. } => result.unwrap(),
                _ => panic!("not a store completion"),
            }
        }
        h.assert_loads(&keys(0..48));
        drop(store);
    }
    let (mut h, store) = open(config(dir.path(), 8, 8));
    assert_eq!(store.recovered().records, 48);
    h.assert_loads(&keys(0..48));
}

#[test]
fn a_key_stored_by_two_tasks_in_flight_at_once_is_indexed_once() {
    let dir = tempfile::tempdir().unwrap();
    let (mut h, store) = open(config(dir.path(), 8, 8));
    for round in 0..20u64 {
        let base = round * 10;
        // Both tasks may be written before either is published: the second writes the shared
        // keys again, and publishing keeps the first record of each.
        let a = h.submit_store(&keys(base..base + 4));
        let b = h.submit_store(&keys(base + 2..base + 6));
        for task in [a, b] {
            match h.wait(task) {
                tierkv_core::Completion::Stored { result, .. } => result.unwrap(),
                _ => panic!("not a store completion"),
            }
        }
        h.assert_loads(&keys(base..base + 6));
        let usage = store.usage();
        assert_eq!(usage.objects, 6, "round {round}: {usage:?}");
        assert_eq!(usage.used_bytes, 6 * record_bytes(CHUNK), "round {round}: {usage:?}");
        assert_eq!(h.tier.delete(&keys(base..base + 6)), 6);
        assert_eq!((store.usage().objects, store.usage().used_bytes), (0, 0));
    }
    // The second record of a key was marked deleted when publishing refused it: a restart does
    // not bring back what was deleted.
    drop((h, store));
    let (mut h, store) = open(config(dir.path(), 8, 8));
    assert_eq!(store.recovered().records, 0, "{:?}", store.recovered());
    assert_eq!(h.present(&keys(0..200)).count_ones(), 0);
}

#[test]
fn a_closed_store_frees_its_directory_at_once_while_the_process_starts_children() {
    // A child started by another thread holds a copy of every descriptor until it execs; a
    // lock taken with `flock` stays while any copy is open. Closing the store must unlock the
    // directory itself, or a reopen right after a close is refused as "in use".
    let dir = tempfile::tempdir().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spawner = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = Command::new("true").status();
            }
        })
    };
    let mut refused = Vec::new();
    for _ in 0..300 {
        match DiskStore::open(config(dir.path(), 8, 4)) {
            Ok(store) => drop(store),
            Err(e) => refused.push(e.to_string()),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spawner.join().unwrap();
    assert!(refused.is_empty(), "{} reopens refused, first: {:?}", refused.len(), refused.first());
}

/// A lookup that locked a chunk on its way here holds it after its write lands too: a delete
/// skips it (C3) rather than drop the record its lock is on.
#[test]
fn a_key_locked_on_its_way_here_is_not_deleted_once_it_landed() {
    let dir = tempfile::tempdir().unwrap();
    let (mut h, store) = open(config(dir.path(), 4, 2));
    let on_its_way = store.depart(key(0), payload(&key(0), CHUNK).into());
    assert_eq!(h.lookup(&[key(0)]).count_ones(), 1, "locked on its way");
    let task = store.submit_store(vec![StoreItem { key: key(0), source: Box::new(on_its_way) }]);
    drop(h.wait(task));
    assert_eq!(store.usage().objects, 1, "landed");
    assert_eq!(store.delete(&[key(0)]), 0, "a locked key is not deleted");
    store.unlock(&[key(0)]);
    assert_eq!(h.locks(), 0);
    assert_eq!(h.present(&[key(0)]).count_ones(), 1);
    h.assert_loads(&[key(0)]);
    // Unlocked, it goes, and stays gone across a restart.
    assert_eq!(store.delete(&[key(0)]), 1);
    drop((h, store));
    let (mut h, _store) = open(config(dir.path(), 4, 2));
    assert_eq!(h.present(&[key(0)]).count_ones(), 0);
}

/// A chunk on its way to the disk (the cascade without an L2) is found, locked and loaded from
/// its copy until the write's answer drops it, and after that from its record; a delete or a
/// clear withdraws one still on its way, so its writer takes the record back.
#[test]
fn a_chunk_on_its_way_here_is_served_from_its_copy_until_its_write_is_answered() {
    use tierkv_core::ChunkSource;
    let dir = tempfile::tempdir().unwrap();
    let (mut h, store) = open(config(dir.path(), 4, 2));
    let bytes = |i: u64| -> Arc<[u8]> { payload(&key(i), CHUNK).into() };
    let on_its_way = store.depart(key(0), bytes(0));
    assert_eq!(h.lookup(&[key(0)]).count_ones(), 1, "found on its way");
    assert_eq!(h.locks(), 1);
    h.assert_loads(&[key(0)]);
    assert_eq!(store.usage().objects, 0, "not a record yet");
    // Written, and its answer dropped the copy: served from the record; the lock taken on the
    // copy is still returned.
    let task = store.submit_store(vec![StoreItem { key: key(0), source: Box::new(on_its_way) }]);
    drop(h.wait(task));
    assert_eq!(store.usage().objects, 1);
    store.unlock(&[key(0)]);
    assert_eq!(h.locks(), 0);
    h.assert_loads(&[key(0)]);
    // A delete withdraws a chunk on its way, and counts it once.
    let deleted = store.depart(key(1), bytes(1));
    assert_eq!(store.delete(&[key(1)]), 1);
    assert!(deleted.withdrawn());
    assert_eq!(h.present(&[key(1)]).count_ones(), 0);
    // So does a clear, with every record.
    let cleared = store.depart(key(2), bytes(2));
    assert_eq!(store.clear(), 2);
    assert!(cleared.withdrawn());
    assert_eq!(h.present(&keys(0..3)).count_ones(), 0);
    // Given up (dropped unwritten): a miss at once.
    drop(store.depart(key(3), bytes(3)));
    assert_eq!(h.present(&[key(3)]).count_ones(), 0);
}
