//! A worker's registered KV memory, mapped into the daemon, and the gather and scatter of
//! chunks over it.
//!
//! A registration is a list of regions (sealed memfds, or device allocations opened from CUDA IPC
//! handles, `cuda_ipc.rs`) and a [`KvLayout`]: segments of equal strided blocks (an engine's layers, or their
//! K and V planes), and how many engine blocks make one chunk. A chunk's object is its pieces in
//! segment-major, block-minor order, so one L1 slot holds a chunk of every layer and the engine
//! needs no staging copy.
//!
//! The worker keeps writing its memory while the daemon copies, so the daemon never forms
//! references into it: pieces are raw ranges, copied with `ptr::copy_nonoverlapping`. Every
//! segment is checked against its region once, at registration, and every block id against
//! `blocks` on each request, so no request can reach outside a mapping. A region is accepted
//! only when its memfd is sealed against shrinking; otherwise the worker could truncate the file
//! under the daemon's mapping and the next copy would be a `SIGBUS`. A memfd is mapped whole
//! and once, however many registrations name it on however many sessions ([`HostMaps`], keyed by
//! the file's device and inode): a worker registers its KV on two sessions, and a mapping per
//! registration would cost a populate of the whole memfd and its page tables each time. The
//! registrations share the mapping (each holds an `Arc` of it), and the last one dropped unmaps
//! it.
//!
//! A CUDA region is opened once, at registration, and closed when the registration is dropped
//! (the session ends). Its pieces move with the driver: device to device into an L1 slot on the
//! GPU, device to host into an emulated one. Segments at evenly spaced offsets of one region (an
//! engine's K and V planes, layers allocated back to back) form a run, found once at
//! registration: a block's pieces across a run are one strided copy. Device-to-device copies of a
//! whole request are collected in a [`DeviceCopies`] and enqueued together, then waited for once.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};
use parking_lot::Mutex;
use tierkv_l1::device::{At, MAX_PITCH};
use tierkv_proto::{KvLayout, RegionSource};

use crate::cuda_ipc::{CudaEvent, CudaIpcError, CudaRegion, Rows};

pub use tierkv_proto::MAX_REGIONS;

/// The most pieces (segments x blocks per chunk) a chunk of a layout has. Each is a copy
/// descriptor while a request runs; a large model's paged KV has a few thousand (Llama-3-70B:
/// 160 segments x 32 blocks), and a client naming millions would make the daemon allocate
/// descriptors many times the size of the data.
pub const MAX_PIECES_PER_CHUNK: u64 = 1 << 16;

/// Worker events a registration keeps open (a worker records the same one or two events again
/// and again; the oldest is closed past this).
pub const MAX_OPEN_EVENTS: usize = 8;

/// The first pause between two polls of a worker's event ([`RegisteredKv::await_event`]); the
/// pauses double from here to [`EVENT_POLL_MAX`], so an event that completes at once costs a few
/// tens of microseconds and one that takes a forward pass at most 100 µs past its end (the
/// store's reply, which the engine's step waits for, is that much later).
pub const EVENT_POLL_MIN: Duration = Duration::from_micros(20);

/// The longest pause between two polls of a worker's event.
pub const EVENT_POLL_MAX: Duration = Duration::from_micros(100);

/// Memfd regions one registration may carry (their descriptors ride on one `sendmsg`).
pub const MAX_MEMFD_REGIONS: usize = 8;

/// Why a registration or a copy was refused.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// A memfd region's descriptor did not arrive with the frame.
    #[error(
        "register_kv needs one file descriptor per memfd region attached (SCM_RIGHTS over the Unix socket); region {0} has none"
    )]
    NoDescriptor(usize),
    /// The layout does not fit the regions, or the session.
    #[error("{0}")]
    Shape(String),
    /// A region's memfd is not sealed against shrinking.
    #[error(
        "region {0}: the memfd must be sealed with F_SEAL_SHRINK (so it cannot be truncated under the daemon's mapping)"
    )]
    NotSealed(usize),
    /// A region's memfd has pages not allocated yet (a sparse file).
    #[error(
        "region {region}: its memfd has {size} bytes of which {allocated} are allocated; allocate \
         all of it (fallocate, or write every page) before registering it: the daemon's reads of \
         a hole would allocate the page, charged to the daemon"
    )]
    Sparse {
        /// The region.
        region: usize,
        /// The memfd's size.
        size: u64,
        /// Bytes of pages it has (`st_blocks` x 512).
        allocated: u64,
    },
    /// A request named blocks the layout does not have.
    #[error("{0}")]
    OutOfRange(String),
    /// fstat, fcntl or mmap failed.
    #[error("cannot map region {0}: {1}")]
    Io(usize, std::io::Error),
    /// A CUDA IPC region could not be opened (no driver or device here, a handle the driver
    /// refuses), or a copy over one failed.
    #[error("cuda_ipc region {0}: {1}")]
    Cuda(usize, CudaIpcError),
}

/// A region, mapped or opened.
enum Region {
    Host(Arc<HostMap>),
    Cuda(CudaRegion),
}

/// Bytes of workers' memfds the daemon maps at once, at most, over every session, each memfd
/// counted once however many registrations share its mapping ([`HostMaps`]): a client can send
/// many memfds, and a daemon out of address space cannot allocate (and aborts). Far above what a
/// node's engines hold, far below what a 47-bit address space has.
const MAX_MAPPED_BYTES: u64 = 16 << 40;

/// Bytes of memfds one session's registrations may reference at once, each memfd counted once
/// however many of them name it: a sixteenth of [`MAX_MAPPED_BYTES`], so that one client's
/// mistake is refused on its own and leaves the rest to the other sessions. Far above one engine
/// worker's KV.
pub const MAX_SESSION_MAPPED_BYTES: u64 = MAX_MAPPED_BYTES / 16;

/// A file's identity: the same memfd, however many times and on whichever session its
/// descriptor arrives, has one. A mapped file stays open (its mapping holds it), and since Linux
/// 5.9 the kernel numbers the inodes of its internal shared-memory mount (memfds) with a 64-bit
/// counter that never comes back to a live file's number, so no other file takes its identity
/// while it is mapped. Before 5.9 they came from `get_next_ino`, a 32-bit counter shared with
/// every socket and pipe, which a process could wrap in hours: there memfds are not shared
/// ([`inode_numbers_unique`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FileId {
    dev: u64,
    ino: u64,
}

/// Whether a live memfd's device and inode name it alone: on Linux 5.9 and later
/// ([`FileId`]). Read once.
fn inode_numbers_unique() -> bool {
    static UNIQUE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNIQUE.get_or_init(|| kernel_at_least(&kernel_release(), (5, 9)))
}

/// The running kernel's release (`uname -r`), or "" where it cannot be read.
fn kernel_release() -> String {
    // SAFETY: `utsname` is arrays of `c_char`, for which all zeroes is a valid value.
    let mut name: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `uname` fills the struct it is given, NUL-terminating each field.
    if unsafe { libc::uname(&mut name) } != 0 {
        return String::new();
    }
    // SAFETY: as above, `release` is NUL-terminated within its array.
    unsafe { std::ffi::CStr::from_ptr(name.release.as_ptr()) }.to_string_lossy().into_owned()
}

/// Whether kernel `release` ("6.18.0-1-amd64") is `major.minor` or later; `false` where it
/// cannot be read.
fn kernel_at_least(release: &str, (major, minor): (u32, u32)) -> bool {
    let mut numbers = release.split(|c: char| !c.is_ascii_digit()).map(str::parse::<u32>);
    match (numbers.next(), numbers.next()) {
        (Some(Ok(have_major)), Some(Ok(have_minor))) => (have_major, have_minor) >= (major, minor),
        _ => false,
    }
}

/// One file's place in [`HostMaps`]: its mapping while any registration holds it. A registration
/// holds the lock from looking the mapping up to making one, so two registrations of one file at
/// once map it once.
type Slot = Arc<Mutex<Weak<HostMap>>>;

/// Workers' memfds mapped into the daemon: one mapping per file, made (and populated) by the
/// first registration that names it, shared by every later one on any session, and unmapped
/// when the last registration holding it is dropped (its session ends). The daemon has one;
/// clones share it.
#[derive(Clone, Default)]
pub struct HostMaps(Arc<Files>);

#[derive(Default)]
struct Files {
    slots: Mutex<HashMap<FileId, Slot>>,
    /// Bytes of the files mapped now.
    bytes: AtomicU64,
    /// Files mapped now.
    count: AtomicU64,
}

impl HostMaps {
    /// Bytes of workers' memfds mapped now, each file once.
    pub fn mapped_bytes(&self) -> u64 {
        self.0.bytes.load(Ordering::Acquire)
    }

    /// Workers' memfds mapped now.
    pub fn mapped_files(&self) -> u64 {
        self.0.count.load(Ordering::Acquire)
    }

    /// The mapping of `memfd`: the one already made if there is one, else a new one, if the
    /// session (what it references already) may reference it.
    fn share(&self, memfd: &Memfd, session: &Referenced) -> Result<Arc<HostMap>, KvError> {
        if !inode_numbers_unique() {
            // A mapping of its own, which no later registration finds.
            return self.share_in(&Slot::default(), memfd, session);
        }
        let slot = Arc::clone(self.0.slots.lock().entry(memfd.id).or_default());
        let shared = self.share_in(&slot, memfd, session);
        if shared.is_err() {
            drop(slot);
            self.0.forget(memfd.id);
        }
        shared
    }

    fn share_in(
        &self,
        slot: &Slot,
        memfd: &Memfd,
        session: &Referenced,
    ) -> Result<Arc<HostMap>, KvError> {
        let Memfd { region: i, ref file, id, bytes, size } = *memfd;
        let mut mapped = slot.lock();
        if let Some(map) = mapped.upgrade() {
            if map.len() < bytes {
                // Only a memfd not sealed against growing can be longer than when it was mapped;
                // a mapping per length would let a client that grows one a page at a time have
                // it mapped over and over.
                return Err(KvError::Shape(format!(
                    "region {i} should have {bytes} bytes; its memfd has grown since the daemon \
                     mapped its {} bytes for a registration still open (seal it with \
                     F_SEAL_GROW before registering it)",
                    map.len()
                )));
            }
            session.admit(i, Some(&map), map.len())?;
            return Ok(map);
        }
        session.admit(i, None, size)?;
        let len = usize::try_from(size).map_err(|_| {
            KvError::Shape(format!("region {i}: {size} bytes do not fit the address space"))
        })?;
        let counted = self.0.bytes.fetch_add(size, Ordering::AcqRel);
        if counted.saturating_add(size) > MAX_MAPPED_BYTES {
            self.0.bytes.fetch_sub(size, Ordering::AcqRel);
            return Err(KvError::Shape(format!(
                "region {i}: its memfd's {size} bytes more would pass the {} TiB of workers' \
                 memory the daemon maps at most ({counted} bytes are mapped)",
                MAX_MAPPED_BYTES >> 40
            )));
        }
        // Populated, its pages all allocated (checked by the caller): mapping every page into
        // the daemon's page table now, once, keeps minor faults (about a third of a retrieve's
        // time when a load lands in blocks the daemon had not touched yet) off the copies. The
        // mapping keeps the file open; the descriptor is closed once the registration is done.
        match MmapOptions::new().len(len).populate().map_raw(file) {
            Ok(map) => {
                self.0.count.fetch_add(1, Ordering::AcqRel);
                let map = Arc::new(HostMap { map, id, files: Arc::clone(&self.0) });
                *mapped = Arc::downgrade(&map);
                Ok(map)
            }
            Err(e) => {
                self.0.bytes.fetch_sub(size, Ordering::AcqRel);
                Err(KvError::Io(i, e))
            }
        }
    }
}

impl Files {
    /// Removes file `id`'s slot if no mapping and no registration holds it.
    fn forget(&self, id: FileId) {
        let mut slots = self.slots.lock();
        // Held by the map alone, so no one can be holding its lock.
        if let Some(slot) = slots.get(&id)
            && Arc::strong_count(slot) == 1
            && slot.lock().strong_count() == 0
        {
            slots.remove(&id);
        }
    }
}

/// The memfd mappings one session's registrations reference, and their bytes, each counted
/// once however many registrations share it.
struct Referenced {
    maps: HashSet<*const HostMap>,
    bytes: u64,
}

impl Referenced {
    fn of(buffers: &[RegisteredKv]) -> Self {
        let mut referenced = Referenced { maps: HashSet::new(), bytes: 0 };
        for map in buffers.iter().flat_map(RegisteredKv::host_maps) {
            referenced.add(map);
        }
        referenced
    }

    /// Whether region `i` may reference `map` (`None`: a new mapping) of `len` bytes.
    fn admit(&self, i: usize, map: Option<&Arc<HostMap>>, len: u64) -> Result<(), KvError> {
        if map.is_some_and(|map| self.maps.contains(&Arc::as_ptr(map))) {
            return Ok(());
        }
        if self.bytes.saturating_add(len) > MAX_SESSION_MAPPED_BYTES {
            return Err(KvError::Shape(format!(
                "region {i}: its memfd's {len} bytes more would pass the {} TiB one session maps \
                 at most ({} bytes of memfds are mapped for it)",
                MAX_SESSION_MAPPED_BYTES >> 40,
                self.bytes
            )));
        }
        Ok(())
    }

    fn add(&mut self, map: &Arc<HostMap>) {
        if self.maps.insert(Arc::as_ptr(map)) {
            self.bytes += map.len();
        }
    }
}

/// A worker's memfd, mapped whole, shared by every registration of it; its bytes counted in
/// [`HostMaps`] while it is.
struct HostMap {
    map: MmapRaw,
    id: FileId,
    files: Arc<Files>,
}

impl HostMap {
    fn len(&self) -> u64 {
        self.map.len() as u64
    }
}

impl Drop for HostMap {
    fn drop(&mut self) {
        self.files.bytes.fetch_sub(self.len(), Ordering::AcqRel);
        self.files.count.fetch_sub(1, Ordering::AcqRel);
        // The file's slot goes with its last mapping, unless a registration holds it (it will
        // map the file again) or a later mapping of the file took its place.
        self.files.forget(self.id);
    }
}

/// A piece's place: the region's base pointer is added at copy time.
#[derive(Clone, Copy, Debug)]
struct SegmentAt {
    region: usize,
    offset: usize,
}

/// Consecutive segments in one region, `pitch` bytes apart: a block's pieces in them are `count`
/// rows of one strided copy. A segment on its own is a run of one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SegmentRun {
    region: usize,
    /// The run's first segment.
    first: usize,
    count: usize,
    /// The first segment's offset in the region.
    offset: usize,
    pitch: usize,
}

/// Splits `segments` into runs: each segment joins the run before it when it lies in the same
/// region exactly one pitch past the run's last, the pitch (the gap of the run's first two) at
/// least `block_bytes` (rows never overlap) and at most [`MAX_PITCH`].
fn segment_runs(segments: &[SegmentAt], block_bytes: usize) -> Vec<SegmentRun> {
    let mut runs: Vec<SegmentRun> = Vec::new();
    for (s, seg) in segments.iter().enumerate() {
        if let Some(run) = runs.last_mut()
            && run.region == seg.region
        {
            let gap = seg.offset.checked_sub(run.offset);
            if run.count == 1
                && let Some(gap) = gap
                && gap >= block_bytes
                && gap as u64 <= MAX_PITCH
            {
                run.pitch = gap;
                run.count = 2;
                continue;
            }
            if run.count > 1 && gap.is_some_and(|g| Some(g) == run.count.checked_mul(run.pitch)) {
                run.count += 1;
                continue;
            }
        }
        runs.push(SegmentRun {
            region: seg.region,
            first: s,
            count: 1,
            offset: seg.offset,
            pitch: 0,
        });
    }
    runs
}

/// The device-to-device copies of one request, all gathers or all scatters, per region:
/// collected by [`RegisteredKv::gather_device`] or [`RegisteredKv::scatter_device`], enqueued and
/// waited for by [`RegisteredKv::run_device`]. Dropped without a run, none of them happens.
#[derive(Debug)]
pub struct DeviceCopies {
    to_region: bool,
    rows: Vec<Vec<Rows>>,
}

impl DeviceCopies {
    /// Copies out of the registration (a store).
    pub fn gathers() -> Self {
        DeviceCopies { to_region: false, rows: Vec::new() }
    }

    /// Copies into the registration (a retrieve).
    pub fn scatters() -> Self {
        DeviceCopies { to_region: true, rows: Vec::new() }
    }

    /// Whether nothing was collected.
    pub fn is_empty(&self) -> bool {
        self.rows.iter().all(Vec::is_empty)
    }
}

/// A registered KV buffer: mapped regions and the layout over them.
pub struct RegisteredKv {
    regions: Vec<Region>,
    segments: Vec<SegmentAt>,
    runs: Vec<SegmentRun>,
    /// The worker's CUDA events opened so far, by IPC handle, newest last.
    events: Mutex<Vec<(Vec<u8>, CudaEvent)>>,
    blocks: u64,
    block_bytes: usize,
    block_stride: usize,
    blocks_per_chunk: usize,
}

impl RegisteredKv {
    /// The memfd mappings this registration holds.
    fn host_maps(&self) -> impl Iterator<Item = &Arc<HostMap>> {
        self.regions.iter().filter_map(|region| match region {
            Region::Host(map) => Some(map),
            Region::Cuda(_) => None,
        })
    }

    /// Takes the descriptors a registration's memfd regions need, one per memfd region, in
    /// order, from those that arrived on the connection. The session takes them before it checks
    /// anything else, so a refused registration leaves none queued for the next one to pick up.
    pub fn take_descriptors(
        regions: &[RegionSource],
        descriptor: &mut dyn FnMut() -> Option<OwnedFd>,
    ) -> Vec<Option<OwnedFd>> {
        let mut memfds = 0;
        regions
            .iter()
            .take(MAX_REGIONS)
            .map(|region| match region {
                RegionSource::Memfd { .. } if memfds < MAX_MEMFD_REGIONS => {
                    memfds += 1;
                    descriptor()
                }
                RegionSource::Memfd { .. } | RegionSource::CudaIpc { .. } => None,
            })
            .collect()
    }

    /// Checks the layout against the regions and maps them. `fds` are the regions' descriptors
    /// ([`RegisteredKv::take_descriptors`]); `chunk_bytes` is the session's chunk size, which a
    /// chunk of this layout must equal. A memfd already mapped (`maps`) is shared, not mapped
    /// again; the memfds the session's registrations (`session`) and this one reference count
    /// once each against `MAX_SESSION_MAPPED_BYTES` (1 TiB).
    pub fn map(
        regions: &[RegionSource],
        fds: Vec<Option<OwnedFd>>,
        layout: &KvLayout,
        chunk_bytes: u64,
        maps: &HostMaps,
        session: &[RegisteredKv],
    ) -> Result<Self, KvError> {
        let shape = |why: String| Err(KvError::Shape(why));
        if regions.is_empty() || regions.len() > MAX_REGIONS {
            return shape(format!(
                "a registration has 1..={MAX_REGIONS} regions, not {}",
                regions.len()
            ));
        }
        let memfds = regions.iter().filter(|r| matches!(r, RegionSource::Memfd { .. })).count();
        if memfds > MAX_MEMFD_REGIONS {
            return shape(format!(
                "a registration has at most {MAX_MEMFD_REGIONS} memfd regions (their descriptors \
                 ride on one sendmsg), not {memfds}"
            ));
        }
        if layout.segments.is_empty() || layout.blocks == 0 || layout.blocks_per_chunk == 0 {
            return shape(
                "a layout needs segments, blocks and blocks_per_chunk, all non-zero".into(),
            );
        }
        if layout.block_bytes == 0 || layout.block_stride < layout.block_bytes {
            return shape(format!(
                "block_bytes ({}) must be positive and at most block_stride ({})",
                layout.block_bytes, layout.block_stride
            ));
        }
        let pieces =
            (layout.segments.len() as u64).saturating_mul(u64::from(layout.blocks_per_chunk));
        if pieces > MAX_PIECES_PER_CHUNK {
            return shape(format!(
                "{} segments x {} blocks per chunk is {pieces} pieces a chunk, more than \
                 {MAX_PIECES_PER_CHUNK}",
                layout.segments.len(),
                layout.blocks_per_chunk
            ));
        }
        let chunk = pieces.checked_mul(layout.block_bytes);
        if chunk != Some(chunk_bytes) {
            return shape(format!(
                "{} segments x {} blocks per chunk x {} bytes is not the session's chunk_bytes ({chunk_bytes})",
                layout.segments.len(),
                layout.blocks_per_chunk,
                layout.block_bytes
            ));
        }
        let mut referenced = Referenced::of(session);
        let mut sizes = Vec::with_capacity(regions.len());
        let mut mapped = Vec::with_capacity(regions.len());
        for (i, (region, fd)) in regions.iter().zip(fds).enumerate() {
            match (region, fd) {
                (RegionSource::Memfd { bytes }, Some(fd)) => {
                    let map = maps.share(&check_memfd(i, fd, *bytes)?, &referenced)?;
                    referenced.add(&map);
                    mapped.push(Region::Host(map));
                    sizes.push(*bytes);
                }
                (RegionSource::Memfd { .. }, None) => return Err(KvError::NoDescriptor(i)),
                (RegionSource::CudaIpc { handle, device, bytes }, _) => {
                    if *bytes == 0 {
                        return Err(KvError::Shape(format!("region {i} has 0 bytes")));
                    }
                    let region = CudaRegion::open(handle, device, *bytes)
                        .map_err(|e| KvError::Cuda(i, e))?;
                    mapped.push(Region::Cuda(region));
                    sizes.push(*bytes);
                }
            }
        }
        // The last byte any block of a segment reaches, checked once for every segment.
        let span = (layout.blocks - 1)
            .checked_mul(layout.block_stride)
            .and_then(|n| n.checked_add(layout.block_bytes));
        let mut segments = Vec::with_capacity(layout.segments.len());
        for (s, segment) in layout.segments.iter().enumerate() {
            let Some(&size) = sizes.get(segment.region as usize) else {
                return shape(format!(
                    "segment {s} names region {}, of {}",
                    segment.region,
                    sizes.len()
                ));
            };
            let end = span.and_then(|n| n.checked_add(segment.offset));
            if end.is_none_or(|end| end > size) {
                return shape(format!(
                    "segment {s} ({} blocks of {} bytes, {} apart, from offset {}) does not fit region {} of {size} bytes",
                    layout.blocks,
                    layout.block_bytes,
                    layout.block_stride,
                    segment.offset,
                    segment.region
                ));
            }
            // Inside a region, which lies in this address space (mapped or opened).
            let offset = usize::try_from(segment.offset).map_err(|_| {
                KvError::Shape(format!("segment {s}'s offset does not fit the address space"))
            })?;
            segments.push(SegmentAt { region: segment.region as usize, offset });
        }
        let runs = segment_runs(&segments, layout.block_bytes as usize);
        Ok(RegisteredKv {
            regions: mapped,
            segments,
            runs,
            events: Mutex::new(Vec::new()),
            blocks: layout.blocks,
            block_bytes: layout.block_bytes as usize,
            block_stride: layout.block_stride as usize,
            blocks_per_chunk: layout.blocks_per_chunk as usize,
        })
    }

    /// Bytes of one chunk.
    pub fn chunk_bytes(&self) -> u64 {
        (self.segments.len() * self.blocks_per_chunk * self.block_bytes) as u64
    }

    /// Checks that `blocks` names one chunk's blocks of this layout.
    pub fn check(&self, blocks: &[u64]) -> Result<(), KvError> {
        if blocks.len() != self.blocks_per_chunk {
            return Err(KvError::OutOfRange(format!(
                "a chunk names {} blocks, not {}",
                self.blocks_per_chunk,
                blocks.len()
            )));
        }
        match blocks.iter().find(|&&b| b >= self.blocks) {
            Some(b) => Err(KvError::OutOfRange(format!(
                "block {b} is outside a layout of {} blocks",
                self.blocks
            ))),
            None => Ok(()),
        }
    }

    /// Whether every region is GPU memory: a chunk can then move device to device, straight
    /// between the regions and an L1 slot on the GPU ([`RegisteredKv::gather_device`]).
    pub fn on_device(&self) -> bool {
        self.regions.iter().all(|r| matches!(r, Region::Cuda(_)))
    }

    /// Copies a chunk's pieces from `blocks` into `dst` (one chunk's bytes).
    pub fn gather(&self, blocks: &[u64], dst: &mut [u8]) -> Result<(), KvError> {
        self.check_copy(blocks, dst.len())?;
        // SAFETY: `dst` is one chunk's bytes (checked), exclusively borrowed.
        unsafe { self.transfer(blocks, At::Host(dst.as_mut_ptr() as u64), false, true) }
    }

    /// Copies a chunk's bytes `src` out to its pieces at `blocks`.
    pub fn scatter(&self, blocks: &[u64], src: &[u8]) -> Result<(), KvError> {
        self.check_copy(blocks, src.len())?;
        // SAFETY: `src` is one chunk's bytes (checked); nothing writes through the pointer when
        // the copy goes out to the regions.
        unsafe { self.transfer(blocks, At::Host(src.as_ptr() as u64), true, true) }
    }

    /// The worker's CUDA event `handle` (an IPC event handle), opened once and kept while the
    /// registration lives (the [`MAX_OPEN_EVENTS`] latest), given to `f` with the CUDA regions.
    /// Only for a registration [`on_device`](Self::on_device).
    fn with_event<R>(
        &self,
        handle: &[u8],
        f: impl FnOnce(&CudaEvent, &[(usize, &CudaRegion)]) -> Result<R, KvError>,
    ) -> Result<R, KvError> {
        let cuda: Vec<(usize, &CudaRegion)> = self
            .regions
            .iter()
            .enumerate()
            .filter_map(|(i, r)| match r {
                Region::Cuda(cuda) => Some((i, cuda)),
                Region::Host(_) => None,
            })
            .collect();
        let (Some(&(first, opener)), true) = (cuda.first(), self.on_device()) else {
            return Err(KvError::Shape(
                "a CUDA event needs a registration in GPU memory (cuda_ipc regions)".into(),
            ));
        };
        let mut events = self.events.lock();
        let at = match events.iter().position(|(h, _)| h == handle) {
            Some(at) => at,
            None => {
                let event = opener.open_event(handle).map_err(|e| KvError::Cuda(first, e))?;
                if events.len() >= MAX_OPEN_EVENTS {
                    events.remove(0);
                }
                events.push((handle.to_vec(), event));
                events.len() - 1
            }
        };
        f(&events[at].1, &cuda)
    }

    /// Checks that `handle` names a CUDA event this registration can wait for or record
    /// (opening it now, once).
    pub fn check_event(&self, handle: &[u8]) -> Result<(), KvError> {
        self.with_event(handle, |_, _| Ok(()))
    }

    /// Waits, on the host, until the worker's CUDA event `handle` (recorded on the stream that
    /// wrote the blocks) has completed: polled, from `EVENT_POLL_MIN` apart to
    /// `EVENT_POLL_MAX`, until `deadline` or until `stop` says to (the client gave up).
    /// Nothing is enqueued behind the event, so a worker whose kernels never finish (a hung
    /// collective, a process killed before its record ran) costs the request its deadline, and
    /// leaves no daemon stream waiting on the GPU for ever. `Ok(false)` if it did not complete.
    pub fn await_event(
        &self,
        handle: &[u8],
        deadline: Instant,
        stop: impl Fn() -> bool,
    ) -> Result<bool, KvError> {
        self.with_event(handle, |event, cuda| {
            let region = cuda.first().map_or(0, |&(i, _)| i);
            let mut pause = EVENT_POLL_MIN;
            loop {
                if event.is_complete().map_err(|e| KvError::Cuda(region, e))? {
                    return Ok(true);
                }
                let now = Instant::now();
                if now >= deadline || stop() {
                    return Ok(false);
                }
                std::thread::sleep(pause.min(deadline - now));
                pause = (pause * 2).min(EVENT_POLL_MAX);
            }
        })
    }

    /// Records the worker's CUDA event `handle` after everything enqueued on every region's
    /// stream so far (they are joined into the first region's stream, where it is recorded).
    pub fn signal_event(&self, handle: &[u8]) -> Result<(), KvError> {
        self.with_event(handle, |event, cuda| Self::record_after_all(event, cuda).map(|_| ()))
    }

    /// Enqueues `copies` (a retrieve's scatters), records the worker's CUDA event `handle`
    /// after them, and returns without waiting: a completion thread drops `keep` (the guards
    /// of the slots the copies read) once they are done. If a copy cannot be enqueued, waits
    /// for what was, drops `keep`, and returns the error.
    pub fn run_device_signalled(
        &self,
        copies: DeviceCopies,
        handle: &[u8],
        keep: Box<dyn Send>,
    ) -> Result<(), KvError> {
        self.with_event(handle, move |event, cuda| {
            let head = self.enqueue(&copies).and_then(|()| Self::record_after_all(event, cuda));
            match head {
                Ok(head) => {
                    head.drop_when_done(keep);
                    Ok(())
                }
                Err(e) => {
                    let _ = self.sync_all();
                    drop(keep);
                    Err(e)
                }
            }
        })
    }

    /// Joins every CUDA region's stream into the first's and records `event` there; the
    /// first region.
    fn record_after_all<'a>(
        event: &CudaEvent,
        cuda: &[(usize, &'a CudaRegion)],
    ) -> Result<&'a CudaRegion, KvError> {
        let Some(&(first, head)) = cuda.first() else {
            return Err(KvError::Shape("no CUDA region to record an event on".into()));
        };
        for &(i, region) in &cuda[1..] {
            head.join(region).map_err(|e| KvError::Cuda(i, e))?;
        }
        head.record(event).map_err(|e| KvError::Cuda(first, e))?;
        Ok(head)
    }

    /// Adds to `copies` (gathers) those of a chunk's pieces from `blocks` into device memory at
    /// `dst` (an L1 slot on the GPU). Only for a registration [`on_device`](Self::on_device). The
    /// bytes are there only after [`run_device`](Self::run_device) returned `Ok`: a request
    /// collects every chunk, then runs them all and waits once.
    ///
    /// # Safety
    /// `dst..dst + len` is device memory this request may write, used by nothing else until
    /// `run_device` returned or `copies` is dropped (an L1 write reservation's slot, pinned that
    /// long).
    pub unsafe fn gather_device(
        &self,
        copies: &mut DeviceCopies,
        blocks: &[u64],
        dst: u64,
        len: u64,
    ) -> Result<(), KvError> {
        self.check_device(copies, false, blocks, len)?;
        self.collect_rows(blocks, At::Device(dst), &mut copies.rows);
        Ok(())
    }

    /// Adds to `copies` (scatters) those of a chunk's bytes in device memory at `src` (a leased
    /// L1 slot on the GPU) out to its pieces at `blocks`; done after
    /// [`run_device`](Self::run_device).
    ///
    /// # Safety
    /// `src..src + len` is device memory nobody writes until `run_device` returned or `copies`
    /// is dropped (a leased slot, pinned that long).
    pub unsafe fn scatter_device(
        &self,
        copies: &mut DeviceCopies,
        blocks: &[u64],
        src: u64,
        len: u64,
    ) -> Result<(), KvError> {
        self.check_device(copies, true, blocks, len)?;
        self.collect_rows(blocks, At::Device(src), &mut copies.rows);
        Ok(())
    }

    /// Enqueues `copies` on their regions' streams and waits for all of them; the first
    /// failure if any (then some bytes may have landed and others not).
    pub fn run_device(&self, copies: DeviceCopies) -> Result<(), KvError> {
        let enqueued = self.enqueue(&copies);
        let synced = self.sync_all();
        enqueued.and(synced)
    }

    /// Enqueues `copies` on their regions' streams; the first failure, after trying every
    /// region.
    fn enqueue(&self, copies: &DeviceCopies) -> Result<(), KvError> {
        let mut first = Ok(());
        for (i, rows) in copies.rows.iter().enumerate() {
            if let (Some(Region::Cuda(cuda)), false) = (self.regions.get(i), rows.is_empty()) {
                // SAFETY: the rows were planned from checked segments and block ids; the other
                // ends are the callers' (their contracts on `gather_device`/`scatter_device`).
                let enqueued =
                    unsafe { cuda.copy(rows, self.block_bytes, copies.to_region, false) };
                if let Err(e) = enqueued
                    && first.is_ok()
                {
                    first = Err(KvError::Cuda(i, e));
                }
            }
        }
        first
    }

    /// Waits for every copy enqueued on every region's stream; the first failure if any.
    /// Nothing to wait for in a registration of host memory, whose copies are done when they
    /// return.
    pub fn sync_all(&self) -> Result<(), KvError> {
        let mut first = Ok(());
        for (i, region) in self.regions.iter().enumerate() {
            if let Region::Cuda(cuda) = region
                && let Err(e) = cuda.sync()
                && first.is_ok()
            {
                first = Err(KvError::Cuda(i, e));
            }
        }
        first
    }

    fn check_device(
        &self,
        copies: &DeviceCopies,
        to_region: bool,
        blocks: &[u64],
        len: u64,
    ) -> Result<(), KvError> {
        if copies.to_region != to_region {
            return Err(KvError::Shape(
                "a request's device copies are all gathers or all scatters".into(),
            ));
        }
        if !self.on_device() {
            return Err(KvError::Shape(
                "a device-to-device copy needs every region in GPU memory".into(),
            ));
        }
        self.check_copy(blocks, usize::try_from(len).unwrap_or(usize::MAX))
    }

    /// Moves every piece of the chunk at `blocks` between the regions and the chunk's bytes at
    /// `other` (piece `i` at `i * block_bytes`): into the regions when `to_region`. CUDA
    /// regions' copies are waited for when `then_sync`.
    ///
    /// # Safety
    /// `other` is valid for one chunk's bytes, checked by the caller, and not used concurrently.
    unsafe fn transfer(
        &self,
        blocks: &[u64],
        other: At,
        to_region: bool,
        then_sync: bool,
    ) -> Result<(), KvError> {
        for (piece, (region, offset)) in self.pieces(blocks).enumerate() {
            let Region::Host(map) = &self.regions[region] else { continue };
            let At::Host(p) = other else {
                return Err(KvError::Shape(
                    "a memfd region cannot copy to or from device memory".into(),
                ));
            };
            // SAFETY: `offset` lies inside the mapping (segments checked at registration, block
            // ids on each request), which stays mapped while `self` holds it (shared, it is
            // unmapped when its last holder is dropped) and cannot shrink (sealed); `p` has room
            // for the chunk, so for the piece. The worker may write its memory concurrently; the
            // copy then holds whatever bytes were there, which is the worker's own business.
            unsafe {
                let p = (p as usize as *mut u8).add(piece * self.block_bytes);
                let here = map.map.as_mut_ptr().add(offset);
                if to_region {
                    std::ptr::copy_nonoverlapping(p, here, self.block_bytes)
                } else {
                    std::ptr::copy_nonoverlapping(here, p, self.block_bytes)
                }
            }
        }
        let mut device = Vec::new();
        self.collect_rows(blocks, other, &mut device);
        for (region, rows) in device.iter().enumerate() {
            if let (Region::Cuda(cuda), false) = (&self.regions[region], rows.is_empty()) {
                // SAFETY: rows inside the region (checked as above), `other` the caller's.
                unsafe { cuda.copy(rows, self.block_bytes, to_region, then_sync) }
                    .map_err(|e| KvError::Cuda(region, e))?;
            }
        }
        Ok(())
    }

    /// Adds to `out` (one list per region) the copies of the chunk at `blocks` in the CUDA
    /// regions, between them and the chunk's bytes at `other`.
    fn collect_rows(&self, blocks: &[u64], other: At, out: &mut Vec<Vec<Rows>>) {
        for (region, rows) in self.rows(blocks, other) {
            if !matches!(self.regions[region], Region::Cuda(_)) {
                continue;
            }
            if out.len() <= region {
                out.resize_with(region + 1, Vec::new);
            }
            out[region].push(rows);
        }
    }

    /// The chunk at `blocks` as strided copies between its regions and its bytes at `other`: for
    /// each run of segments and each block, one row per segment of the run. Row for row, the
    /// same places as [`pieces`](Self::pieces).
    fn rows<'a>(
        &'a self,
        blocks: &'a [u64],
        other: At,
    ) -> impl Iterator<Item = (usize, Rows)> + 'a {
        let per_chunk = self.blocks_per_chunk;
        self.runs.iter().flat_map(move |run| {
            blocks.iter().enumerate().map(move |(j, &b)| {
                // Within the region (segments and block ids checked); the chunk's piece
                // `segment * per_chunk + j` sits at that many `block_bytes`.
                let piece = (run.first * per_chunk + j) * self.block_bytes;
                let rows = Rows {
                    offset: (run.offset + b as usize * self.block_stride) as u64,
                    pitch: run.pitch as u64,
                    other: other.offset(piece as u64),
                    other_pitch: (per_chunk * self.block_bytes) as u64,
                    rows: run.count,
                };
                (run.region, rows)
            })
        })
    }

    fn check_copy(&self, blocks: &[u64], len: usize) -> Result<(), KvError> {
        self.check(blocks)?;
        if len as u64 != self.chunk_bytes() {
            return Err(KvError::Shape(format!(
                "a chunk of this layout has {} bytes, the copy {len}",
                self.chunk_bytes()
            )));
        }
        Ok(())
    }

    /// The pieces of a chunk, segment-major: each one's region and offset in it.
    fn pieces<'a>(&'a self, blocks: &'a [u64]) -> impl Iterator<Item = (usize, usize)> + 'a {
        self.segments.iter().flat_map(move |seg| {
            // Within the region: `b < blocks` and the segment's span was checked.
            blocks.iter().map(move |&b| (seg.region, seg.offset + b as usize * self.block_stride))
        })
    }
}

/// A registration's memfd region, checked.
struct Memfd {
    region: usize,
    file: File,
    id: FileId,
    /// The region's bytes.
    bytes: u64,
    /// The file's.
    size: u64,
}

/// Checks region `i`'s memfd, which the registration says has `bytes` bytes.
fn check_memfd(i: usize, fd: OwnedFd, bytes: u64) -> Result<Memfd, KvError> {
    if bytes == 0 {
        return Err(KvError::Shape(format!("region {i} has 0 bytes")));
    }
    if bytes > MAX_SESSION_MAPPED_BYTES {
        return Err(KvError::Shape(format!(
            "region {i}: {bytes} bytes are more than the {} TiB one session maps at most",
            MAX_SESSION_MAPPED_BYTES >> 40
        )));
    }
    // SAFETY: fcntl on a descriptor we own.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(KvError::NotSealed(i));
    }
    // Ordinary shared memory only: a hugetlbfs memfd's hole, punched after it is mapped, takes
    // its page reservation with it, and the daemon's next copy there dies of SIGBUS.
    // SAFETY: statfs is plain data; zeroed is a valid value to be overwritten.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes into the struct we pass, for a descriptor we own.
    let statted = unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } == 0;
    if !statted || fs.f_type as i64 != libc::TMPFS_MAGIC {
        return Err(KvError::Shape(format!(
            "region {i} is not in ordinary shared memory: a memfd made without MFD_HUGETLB is"
        )));
    }
    let file = File::from(fd);
    let metadata = file.metadata().map_err(|e| KvError::Io(i, e))?;
    let size = metadata.len();
    if size < bytes {
        return Err(KvError::Shape(format!(
            "region {i} should have {bytes} bytes; its memfd has {size}"
        )));
    }
    // Every page allocated, by the client and charged to it: a read through a shared mapping of
    // a shmem hole allocates the page, charged to the reader, so the daemon's gathers from a
    // sparse memfd (a terabyte costs its client nothing) would grow the daemon's memory without
    // bound. A tmpfs file of `size` bytes has at most `size` rounded up to a page in pages, so
    // `st_blocks` (512-byte units, swapped-out pages included) reaching `size` means no hole
    // anywhere, in the region or past it. A memfd larger than its region is checked whole: where
    // its holes are cannot be told from the count (and it is mapped whole).
    let allocated = metadata.blocks().saturating_mul(512);
    if allocated < size {
        return Err(KvError::Sparse { region: i, size, allocated });
    }
    let id = FileId { dev: metadata.dev(), ino: metadata.ino() };
    Ok(Memfd { region: i, file, id, bytes, size })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn a_kernel_release_is_compared_by_its_major_and_minor_numbers() {
        assert!(kernel_at_least("6.18.0-1-amd64", (5, 9)));
        assert!(kernel_at_least("5.9.0", (5, 9)));
        assert!(!kernel_at_least("5.4.0-150-generic", (5, 9)));
        assert!(!kernel_at_least("4.18.0-513.el8.x86_64", (5, 9)));
        assert!(!kernel_at_least("", (5, 9)), "unreadable: not shared");
        assert!(!kernel_at_least("garbage", (5, 9)));
    }
    use std::os::fd::AsFd;
    use tierkv_client::{SharedBuffer, memfd};
    use tierkv_proto::Segment;

    fn owned(buffer: &SharedBuffer) -> OwnedFd {
        buffer.fd().try_clone_to_owned().unwrap()
    }

    fn layout(
        blocks: u64,
        block_bytes: u64,
        stride: u64,
        per_chunk: u32,
        offsets: &[u64],
    ) -> KvLayout {
        KvLayout {
            blocks,
            block_bytes,
            block_stride: stride,
            blocks_per_chunk: per_chunk,
            segments: offsets.iter().map(|&offset| Segment { region: 0, offset }).collect(),
        }
    }

    fn register(
        buffer: &SharedBuffer,
        layout: &KvLayout,
        chunk: u64,
    ) -> Result<RegisteredKv, KvError> {
        let bytes = buffer.block_bytes() * buffer.blocks();
        RegisteredKv::map(
            &[RegionSource::Memfd { bytes }],
            vec![Some(owned(buffer))],
            layout,
            chunk,
            &HostMaps::default(),
            &[],
        )
    }

    #[test]
    fn one_block_chunks_round_trip_and_out_of_range_is_refused() {
        let mut shared = SharedBuffer::new(64, 4).unwrap();
        shared.block_mut(2).unwrap().fill(7);
        let kv = register(&shared, &layout(4, 64, 64, 1, &[0]), 64).unwrap();
        let mut got = [0u8; 64];
        kv.gather(&[2], &mut got).unwrap();
        assert_eq!(got, [7u8; 64]);
        kv.scatter(&[3], &[9u8; 64]).unwrap();
        assert_eq!(shared.block(3).unwrap(), &[9u8; 64]);
        assert!(kv.gather(&[4], &mut got).is_err());
        assert!(kv.gather(&[0, 1], &mut got).is_err(), "two blocks for a one-block chunk");
        assert!(kv.scatter(&[0], &[0u8; 65]).is_err());
    }

    #[test]
    fn a_chunk_gathers_every_segment_block_by_block_and_scatters_back() {
        // Two "layers" of 8 blocks of 16 bytes, 32 bytes apart (a gap between blocks), chunks of
        // 2 blocks: a chunk is layer 0 block a, layer 0 block b, layer 1 block a, layer 1 block b.
        let mut shared = SharedBuffer::new(512, 1).unwrap();
        let bytes = shared.block_mut(0).unwrap();
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i / 16) as u8;
        }
        let kv = register(&shared, &layout(8, 16, 32, 2, &[0, 256]), 64).unwrap();
        let mut chunk = [0u8; 64];
        kv.gather(&[5, 1], &mut chunk).unwrap();
        let piece = |i: usize| chunk[i * 16..(i + 1) * 16].to_vec();
        assert_eq!(piece(0), vec![10u8; 16], "layer 0, block 5 (offset 160)");
        assert_eq!(piece(1), vec![2u8; 16], "layer 0, block 1 (offset 32)");
        assert_eq!(piece(2), vec![26u8; 16], "layer 1, block 5 (offset 416)");
        assert_eq!(piece(3), vec![18u8; 16], "layer 1, block 1 (offset 288)");
        // Scatter into other blocks and read them back; the gaps between blocks stay untouched.
        kv.scatter(&[0, 7], &chunk).unwrap();
        let mut again = [0u8; 64];
        kv.gather(&[0, 7], &mut again).unwrap();
        assert_eq!(again, chunk);
        let bytes = shared.block(0).unwrap();
        assert_eq!(bytes[16..32], [1u8; 16], "the gap after block 0 of layer 0 is untouched");
    }

    #[test]
    fn a_memfd_registration_refuses_device_copies() {
        let shared = SharedBuffer::new(64, 4).unwrap();
        let kv = register(&shared, &layout(4, 64, 64, 1, &[0]), 64).unwrap();
        assert!(!kv.on_device());
        let mut copies = DeviceCopies::gathers();
        // SAFETY: refused before any copy (the regions are not on a device).
        let err = unsafe { kv.gather_device(&mut copies, &[0], 0x1000, 64) }.err().unwrap();
        assert!(err.to_string().contains("every region in GPU memory"), "{err}");
        let mut copies = DeviceCopies::scatters();
        // SAFETY: as above.
        let err = unsafe { kv.scatter_device(&mut copies, &[0], 0x1000, 64) }.err().unwrap();
        assert!(err.to_string().contains("every region in GPU memory"), "{err}");
        // SAFETY: refused first of all: a scatter among gathers.
        let err = unsafe { kv.scatter_device(&mut DeviceCopies::gathers(), &[0], 0x1000, 64) }
            .err()
            .unwrap();
        assert!(err.to_string().contains("all gathers or all scatters"), "{err}");
        assert!(copies.is_empty());
    }

    fn at(offsets: &[(usize, usize)]) -> Vec<SegmentAt> {
        offsets.iter().map(|&(region, offset)| SegmentAt { region, offset }).collect()
    }

    fn run(region: usize, first: usize, count: usize, offset: usize, pitch: usize) -> SegmentRun {
        SegmentRun { region, first, count, offset, pitch }
    }

    #[test]
    fn evenly_spaced_segments_of_one_region_form_runs() {
        // K and V planes of three layers, 1,000 apart, in one region: one run of six.
        let planes = at(&[(0, 0), (0, 1000), (0, 2000), (0, 3000), (0, 4000), (0, 5000)]);
        assert_eq!(segment_runs(&planes, 100), vec![run(0, 0, 6, 0, 1000)]);
        // One layer per region (K and V 500 apart in each): a run of two per region.
        let per_region = at(&[(0, 0), (0, 500), (1, 0), (1, 500)]);
        assert_eq!(
            segment_runs(&per_region, 100),
            vec![run(0, 0, 2, 0, 500), run(1, 2, 2, 0, 500)]
        );
        // A gap that breaks the pitch starts a new run; so does an offset going back.
        let broken = at(&[(0, 0), (0, 100), (0, 250), (0, 350), (0, 0)]);
        assert_eq!(
            segment_runs(&broken, 100),
            vec![run(0, 0, 2, 0, 100), run(0, 2, 2, 250, 100), run(0, 4, 1, 0, 0)]
        );
        // Segments closer than a block (rows would overlap), or further apart than a 2D copy's
        // pitch can say, stay on their own.
        assert_eq!(segment_runs(&at(&[(0, 0), (0, 50)]), 100).len(), 2);
        let far = MAX_PITCH as usize + 1;
        assert_eq!(segment_runs(&at(&[(0, 0), (0, far)]), 100).len(), 2);
        assert_eq!(segment_runs(&at(&[(0, 0)]), 100), vec![run(0, 0, 1, 0, 0)]);
    }

    proptest::proptest! {
        /// Whatever the layout, a chunk's rows name exactly its pieces: the same place in the
        /// same region for the same byte of the chunk, each once.
        #[test]
        fn a_chunks_rows_are_its_pieces(
            offsets in proptest::collection::vec(0u64..6, 1..8),
            spacing in proptest::sample::select(vec![64u64, 96, 128, 512]),
            block_ids in proptest::collection::vec(0u64..4, 1..4),
        ) {
            let shared = SharedBuffer::new(4096, 1).unwrap();
            // Offsets on a grid, so some runs are evenly spaced and some are not.
            let offsets: Vec<u64> = offsets.iter().map(|o| o * spacing).collect();
            let per_chunk = block_ids.len() as u32;
            let chunk = offsets.len() as u64 * u64::from(per_chunk) * 32;
            let kv = register(&shared, &layout(4, 32, 64, per_chunk, &offsets), chunk).unwrap();
            let base = 1u64 << 40;
            let mut from_rows: Vec<(usize, u64, u64)> = kv
                .rows(&block_ids, At::Device(base))
                .flat_map(|(region, r)| {
                    (0..r.rows as u64).map(move |i| {
                        let At::Device(other) = r.other.offset(i * r.other_pitch) else {
                            unreachable!()
                        };
                        (region, r.offset + i * r.pitch, other - base)
                    })
                })
                .collect();
            let mut from_pieces: Vec<(usize, u64, u64)> = kv
                .pieces(&block_ids)
                .enumerate()
                .map(|(i, (region, offset))| (region, offset as u64, i as u64 * 32))
                .collect();
            from_rows.sort_unstable();
            from_pieces.sort_unstable();
            proptest::prop_assert_eq!(from_rows, from_pieces);
        }
    }

    #[test]
    fn layouts_that_do_not_fit_are_refused() {
        let shared = SharedBuffer::new(64, 4).unwrap();
        let cases = [
            (layout(5, 64, 64, 1, &[0]), 64, "does not fit region 0"),
            (layout(4, 64, 64, 1, &[64]), 64, "does not fit region 0"),
            (layout(4, 64, 64, 1, &[0]), 128, "not the session's chunk_bytes"),
            (layout(4, 64, 32, 1, &[0]), 64, "at most block_stride"),
            (layout(u64::MAX, 64, 64, 1, &[0]), 64, "does not fit"),
            (layout(4, 16, 16, 1, &[u64::MAX]), 16, "does not fit"),
            (layout(4, 64, 64, 0, &[0]), 0, "non-zero"),
            // 2 segments x 2^16 blocks a chunk: more copy descriptors than data.
            (layout(1 << 17, 1, 1, 1 << 16, &[0, 0]), 1 << 17, "pieces a chunk"),
        ];
        for (layout, chunk, why) in cases {
            let err = register(&shared, &layout, chunk).err().unwrap();
            assert!(err.to_string().contains(why), "{layout:?}: {err}");
        }
        let mut bad_region = layout(4, 64, 64, 1, &[0]);
        bad_region.segments[0].region = 1;
        let err = register(&shared, &bad_region, 64).err().unwrap();
        assert!(err.to_string().contains("names region 1"), "{err}");
    }

    #[test]
    fn a_memfd_with_a_hole_is_refused_and_an_allocated_one_mapped() {
        // Sealed against shrinking, 4 pages long, none of them allocated yet.
        let file = memfd(c"t", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING).unwrap();
        file.set_len(4 * 4096).unwrap();
        // SAFETY: fcntl on a descriptor we own.
        let sealed =
            unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) };
        assert_eq!(sealed, 0);
        let l = layout(4, 64, 64, 1, &[0]);
        let region = [RegionSource::Memfd { bytes: 256 }];
        let maps = HostMaps::default();
        let map = |file: &File| {
            let fd = file.as_fd().try_clone_to_owned().unwrap();
            RegisteredKv::map(&region, vec![Some(fd)], &l, 64, &maps, &[])
        };
        let allocate = |offset: i64, len: i64| {
            // SAFETY: fallocate on a descriptor we own, within its length.
            assert_eq!(unsafe { libc::fallocate(file.as_raw_fd(), 0, offset, len) }, 0);
        };
        let err = map(&file).err().unwrap();
        assert!(matches!(err, KvError::Sparse { region: 0, size: 16384, allocated: 0 }), "{err}");
        assert!(err.to_string().contains("fallocate"), "{err}");
        // The pages the region spans allocated, a page past them not: a hole is a hole wherever
        // it is (its place cannot be told from the count).
        allocate(0, 3 * 4096);
        let err = map(&file).err().unwrap();
        assert!(matches!(err, KvError::Sparse { allocated: 12288, .. }), "{err}");
        allocate(3 * 4096, 4096);
        let kv = map(&file).unwrap();
        // The memfd is mapped whole, past the region it holds.
        assert_eq!(maps.mapped_bytes(), 4 * 4096);
        drop(kv);
        assert_eq!(maps.mapped_bytes(), 0);
    }

    #[test]
    fn a_registration_takes_many_device_regions_but_few_memfds() {
        let cuda = RegionSource::CudaIpc {
            handle: vec![0; 64],
            device: "0000:00:00.0".into(),
            bytes: 256,
        };
        let memfd_region = RegionSource::Memfd { bytes: 256 };
        let l = layout(4, 64, 64, 1, &[0]);
        let refusal = |regions: &[RegionSource]| {
            let mut one = || None;
            let fds = RegisteredKv::take_descriptors(regions, &mut one);
            RegisteredKv::map(regions, fds, &l, 64, &HostMaps::default(), &[])
                .err()
                .unwrap()
                .to_string()
        };
        // Nine memfds do not ride on one sendmsg; 257 regions of any kind are too many.
        let nine = vec![memfd_region; MAX_MEMFD_REGIONS + 1];
        assert!(refusal(&nine).contains("at most 8 memfd regions"), "{}", refusal(&nine));
        let too_many = vec![cuda.clone(); MAX_REGIONS + 1];
        assert!(refusal(&too_many).contains("1..=256 regions"), "{}", refusal(&too_many));
        // A layer per region, as vLLM allocates KV on a GPU: past the count check, refused only
        // where no CUDA driver is (here) or for the handles of this test.
        let per_layer = vec![cuda; 64];
        assert!(refusal(&per_layer).contains("cuda_ipc region 0"), "{}", refusal(&per_layer));
        // Descriptors are taken for the memfd regions only, at most eight.
        let mut taken = 0;
        let mut count = || {
            taken += 1;
            None
        };
        RegisteredKv::take_descriptors(&nine, &mut count);
        assert_eq!(taken, MAX_MEMFD_REGIONS);
    }

    #[test]
    fn unsealed_short_missing_and_cuda_regions_are_refused() {
        let unsealed = memfd(c"t", libc::MFD_CLOEXEC).unwrap();
        unsealed.set_len(4096).unwrap();
        let l = layout(4, 64, 64, 1, &[0]);
        let memfd_region = [RegionSource::Memfd { bytes: 256 }];
        let maps = HostMaps::default();
        let map =
            |regions: &[RegionSource], fds| RegisteredKv::map(regions, fds, &l, 64, &maps, &[]);
        let err = map(&memfd_region, vec![Some(OwnedFd::from(unsealed))]).err().unwrap();
        assert!(matches!(err, KvError::NotSealed(0)), "{err}");
        let shared = SharedBuffer::new(64, 4).unwrap();
        let big = [RegionSource::Memfd { bytes: 512 }];
        let err = map(&big, vec![Some(owned(&shared))]).err().unwrap();
        assert!(err.to_string().contains("its memfd has 256"), "{err}");
        let mut none = || None;
        let fds = RegisteredKv::take_descriptors(&memfd_region, &mut none);
        let err = map(&memfd_region, fds).err().unwrap();
        assert!(matches!(err, KvError::NoDescriptor(0)), "{err}");
        let cuda = RegionSource::CudaIpc {
            handle: vec![0; 64],
            device: "0000:00:00.0".into(),
            bytes: 256,
        };
        if tierkv_l1::device::cuda_available().is_ok() {
            eprintln!("SKIPPED: the refusal without a CUDA driver (a device is present)");
            return;
        }
        let err = map(&[cuda], vec![None]).err().unwrap();
        assert!(matches!(err, KvError::Cuda(0, CudaIpcError::Unavailable(_))), "{err}");
        assert!(err.to_string().contains("cuda_ipc region 0: CUDA is unavailable"), "{err}");
    }

    /// Registrations of 256-byte memfds (four blocks of 64 bytes, a block a chunk) whole, in
    /// maps of their own.
    struct Memfds {
        maps: HostMaps,
        layout: KvLayout,
    }

    impl Memfds {
        fn new() -> Self {
            Memfds { maps: HostMaps::default(), layout: layout(4, 64, 64, 1, &[0]) }
        }

        fn register(
            &self,
            buffer: &SharedBuffer,
            session: &[RegisteredKv],
        ) -> Result<RegisteredKv, KvError> {
            let region = [RegionSource::Memfd { bytes: 256 }];
            let fd = vec![Some(owned(buffer))];
            RegisteredKv::map(&region, fd, &self.layout, 64, &self.maps, session)
        }
    }

    #[test]
    fn one_memfd_registered_on_two_sessions_and_twice_on_one_is_mapped_once() {
        let memfds = Memfds::new();
        let (maps, shared) = (&memfds.maps, SharedBuffer::new(64, 4).unwrap());
        let map = |session: &[RegisteredKv]| memfds.register(&shared, session);
        let first = vec![map(&[]).unwrap()];
        let second = map(&[]).unwrap();
        let again = map(&first).unwrap();
        assert_eq!((maps.mapped_files(), maps.mapped_bytes()), (1, 256));
        // One mapping: what one registration scatters, another gathers.
        let chunk: Vec<u8> = (0..64).collect();
        first[0].scatter(&[2], &chunk).unwrap();
        let mut out = vec![0; 64];
        second.gather(&[2], &mut out).unwrap();
        assert_eq!(out, chunk);
        // A session counts the memfd once against its cap, however many of its buffers name it.
        let both = [first.into_iter().next().unwrap(), again];
        assert_eq!(Referenced::of(&both).bytes, 256);
        // The first session ends: the other's registration still reads and writes the memfd.
        drop(both);
        assert_eq!((maps.mapped_files(), maps.mapped_bytes()), (1, 256));
        second.scatter(&[3], &chunk).unwrap();
        second.gather(&[3], &mut out).unwrap();
        assert_eq!(out, chunk);
        drop(second);
        assert_eq!((maps.mapped_files(), maps.mapped_bytes()), (0, 0));
        assert!(maps.0.slots.lock().is_empty(), "no slot outlives its file's mapping");
        // Registered again, it is mapped again.
        let kv = map(&[]).unwrap();
        assert_eq!(maps.mapped_files(), 1);
        drop(kv);
        assert_eq!(maps.mapped_bytes(), 0);
    }

    #[test]
    fn a_memfd_a_session_already_maps_costs_its_cap_nothing_and_a_new_one_its_whole_size() {
        let memfds = Memfds::new();
        let maps = &memfds.maps;
        let shared = SharedBuffer::new(64, 4).unwrap();
        let other = SharedBuffer::new(64, 4).unwrap();
        let map =
            |buffer: &SharedBuffer, session: &[RegisteredKv]| memfds.register(buffer, session);
        let session = vec![map(&shared, &[]).unwrap()];
        let mut referenced = Referenced::of(&session);
        // A session just short of its cap: the memfd it maps already is admitted, another not.
        referenced.bytes = MAX_SESSION_MAPPED_BYTES - 100;
        let mapped = session[0].host_maps().next();
        assert!(referenced.admit(0, mapped, 256).is_ok());
        let err = referenced.admit(1, None, 256).err().unwrap();
        assert!(err.to_string().contains("one session maps at most"), "{err}");
        // Two distinct memfds are two mappings, counted apart.
        let apart = map(&other, &session).unwrap();
        assert_eq!((maps.mapped_files(), maps.mapped_bytes()), (2, 512));
        assert_eq!(Referenced::of(&[apart]).bytes, 256);
    }

    /// A memfd is mapped whole: a new one costs a session's cap its file's size, however few
    /// of its bytes the region names.
    #[test]
    fn a_new_memfd_costs_a_session_its_whole_size_not_its_regions_bytes() {
        let file = memfd(c"t", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING).unwrap();
        // SAFETY: fallocate and fcntl on a descriptor we own.
        unsafe {
            assert_eq!(libc::fallocate(file.as_raw_fd(), 0, 0, 4096), 0);
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
            assert_eq!(libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
        }
        let maps = HostMaps::default();
        let memfd = check_memfd(0, OwnedFd::from(file), 256).unwrap();
        let mut referenced =
            Referenced { maps: HashSet::new(), bytes: MAX_SESSION_MAPPED_BYTES - 300 };
        let err = maps.share(&memfd, &referenced).err().unwrap();
        assert!(err.to_string().contains("one session maps at most"), "{err}");
        referenced.bytes = MAX_SESSION_MAPPED_BYTES - 4096;
        let map = maps.share(&memfd, &referenced).unwrap();
        assert_eq!(map.len(), 4096);
    }

    #[test]
    fn a_memfd_grown_since_it_was_mapped_is_refused_past_its_mapping() {
        // Sealed against shrinking only: it can grow after the daemon mapped it.
        let file = memfd(c"t", libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING).unwrap();
        // SAFETY: fallocate and fcntl on a descriptor we own.
        unsafe {
            assert_eq!(libc::fallocate(file.as_raw_fd(), 0, 0, 4096), 0);
            assert_eq!(libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
        }
        let maps = HostMaps::default();
        let map = |bytes: u64| {
            let fd = file.as_fd().try_clone_to_owned().unwrap();
            let l = layout(bytes / 64, 64, 64, 1, &[0]);
            RegisteredKv::map(&[RegionSource::Memfd { bytes }], vec![Some(fd)], &l, 64, &maps, &[])
        };
        let small = map(4096).unwrap();
        // SAFETY: fallocate on a descriptor we own.
        assert_eq!(unsafe { libc::fallocate(file.as_raw_fd(), 0, 4096, 4096) }, 0);
        let err = map(8192).err().unwrap();
        assert!(err.to_string().contains("F_SEAL_GROW"), "{err}");
        // A region within the mapping shares it; once no registration holds it, the grown
        // memfd is mapped anew, whole.
        let within = map(4096).unwrap();
        assert_eq!(maps.mapped_bytes(), 4096);
        drop((small, within));
        let grown = map(8192).unwrap();
        assert_eq!((maps.mapped_files(), maps.mapped_bytes()), (1, 8192));
        drop(grown);
    }

    #[test]
    fn registrations_of_one_memfd_made_and_dropped_at_once_share_a_live_mapping() {
        // Each thread's registrations are made while others' are dropped, the mapping's last
        // holder going and a new one coming at any moment: each copies through a live mapping,
        // none waits forever, and the file is unmapped once all are gone.
        let memfds = Memfds::new();
        let shared = SharedBuffer::new(64, 4).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let (memfds, shared) = (&memfds, &shared);
                s.spawn(move || {
                    let chunk = vec![t; 64];
                    let mut out = vec![0; 64];
                    for _ in 0..200 {
                        let kv = memfds.register(shared, &[]).unwrap();
                        kv.scatter(&[u64::from(t)], &chunk).unwrap();
                        kv.gather(&[u64::from(t)], &mut out).unwrap();
                        assert_eq!(out, chunk);
                    }
                });
            }
        });
        let maps = &memfds.maps;
        assert_eq!((maps.mapped_files(), maps.mapped_bytes()), (0, 0));
        assert!(maps.0.slots.lock().is_empty());
    }
}
