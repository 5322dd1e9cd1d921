//! A job's KV runs asked for a few blocks ahead of the chunk kernel's
//! reads ([`Ahead`]), for both SIMD kernels: asking for a whole chunk's
//! values at once left each core waiting for free miss buffers, while a
//! rolling window keeps a steady number of lines in flight. How much of
//! each run is asked for, and into which cache, depends on the CPU's maker
//! ([`Plan`]): the two answer software prefetches differently.
//!
//! The prefetch intrinsic is `unsafe` only as every intrinsic is; it is
//! SSE's, which every x86-64 CPU has, and it never reads memory.

#![allow(unsafe_code)]

use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
use std::ops::Range;
use std::sync::OnceLock;

/// How far ahead of what the kernel reads a task's KV is asked for: four
/// 2 KB blocks of SmolLM2's shape. Asking for a whole chunk's values at
/// once (256 lines) left each core waiting for free miss buffers; a few
/// blocks ahead, issued as blocks are read, keeps a steady number of
/// lines in flight (`attention step`, see docs/performance.md). The same
/// distance serves the AVX2 kernel, which reads the same runs.
const AHEAD_BYTES: usize = 8 << 10;

/// Which part of each run is asked for, and into which cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// The run's first 1 KB (half of one head's 2 KB block) into L1; the
    /// L2 streamer fetches the lines after them on its own. On the Intel
    /// Xeon, asking for every line of the run into L1 held the core's fill
    /// buffers with requests the streamer would have made, and the
    /// kernel's loads waited for a free one (64–78 % of the value kernel's
    /// samples sat on its prefetches); the head only: `attention step`
    /// −12 % in ten alternated rounds (docs/performance.md, "Only the head
    /// of each run"). The whole block into L2 (AMD's plan) was 10–17 %
    /// slower there in four alternated rounds: an Intel `prefetcht1` holds
    /// a miss buffer too ("Blocks into L2 on AMD").
    HeadsToL1,
    /// The run's first 2 KB (a SmolLM2 block whole) into L2. On a Zen 4
    /// EPYC the head into L1 left 70 % of the value kernel's samples on its
    /// loads, and neither the whole block into L1 nor the head into L2
    /// helped; the whole block into L2 did: `attention step` −11 % (six
    /// alternated rounds, AVX-512; the AVX2 kernel likewise), the decode
    /// step after 4,096 positions −20 % (docs/performance.md, "Blocks into
    /// L2 on AMD").
    BlocksToL2,
}

impl Plan {
    /// The plan for a CPU of this maker (`cpuid`'s vendor string): AMD's
    /// measured on Zen 4, everyone else's on the Intel Xeon.
    fn for_vendor(vendor: &[u8; 12]) -> Plan {
        match vendor {
            b"AuthenticAMD" => Plan::BlocksToL2,
            _ => Plan::HeadsToL1,
        }
    }

    /// This CPU's plan, found once per process.
    fn of_this_cpu() -> Plan {
        static PLAN: OnceLock<Plan> = OnceLock::new();
        *PLAN.get_or_init(|| {
            // `__cpuid` is an unsafe function up to a Rust newer than this
            // crate's minimum and safe after it; called through an unsafe
            // function pointer it reads the same under both.
            let cpuid: unsafe fn(u32) -> std::arch::x86_64::CpuidResult =
                std::arch::x86_64::__cpuid;
            // SAFETY: leaf 0 (the vendor string) is defined on every
            // x86-64 CPU and reads no memory.
            let leaf = unsafe { cpuid(0) };
            let mut vendor = [0; 12];
            for (bytes, register) in vendor
                .chunks_exact_mut(4)
                .zip([leaf.ebx, leaf.edx, leaf.ecx])
            {
                bytes.copy_from_slice(&register.to_le_bytes());
            }
            Plan::for_vendor(&vendor)
        })
    }

    /// How much of each run is asked for.
    fn bytes(self) -> usize {
        match self {
            Plan::HeadsToL1 => 1 << 10,
            Plan::BlocksToL2 => 2 << 10,
        }
    }

    /// The addresses to prefetch for a run of `bytes` at `address`: one
    /// per 64-byte line of its first [`Plan::bytes`].
    fn lines(self, address: usize, bytes: usize) -> impl Iterator<Item = usize> {
        (0..bytes.min(self.bytes()))
            .step_by(64)
            .map(move |offset| address + offset)
    }

    /// Asks for the line at `address`.
    #[inline]
    fn prefetch(self, address: usize) {
        let line = address as *const i8;
        // SAFETY: every x86-64 CPU has SSE's prefetch; a prefetch has no
        // effect on memory.
        unsafe {
            match self {
                Plan::HeadsToL1 => _mm_prefetch::<_MM_HINT_T0>(line),
                Plan::BlocksToL2 => _mm_prefetch::<_MM_HINT_T1>(line),
            }
        }
    }
}

/// One task's KV runs in the order its kernel reads them (each chunk's key
/// blocks, then its value rows), asked for [`AHEAD_BYTES`] ahead of the
/// reads the kernel reports. Holds addresses only: a prefetch never reads
/// memory, so nothing here is dereferenced.
pub(crate) struct Ahead {
    /// What of each run is asked for, where.
    plan: Plan,
    /// `(address, bytes)` of each run, in read order.
    runs: Vec<(usize, usize)>,
    /// The first run not yet asked for.
    next: usize,
    /// Bytes of the runs pushed, asked for, and read, so far.
    pushed: usize,
    asked: usize,
    read: usize,
}

impl Ahead {
    /// An empty plan reusing `runs`' allocation.
    pub(crate) fn new(mut runs: Vec<(usize, usize)>) -> Ahead {
        runs.clear();
        Ahead {
            plan: Plan::of_this_cpu(),
            runs,
            next: 0,
            pushed: 0,
            asked: 0,
            read: 0,
        }
    }

    /// Appends the run `data` (read after every run pushed before it).
    pub(crate) fn push<E>(&mut self, data: &[E]) {
        self.add(data.as_ptr() as usize, std::mem::size_of_val(data));
    }

    /// Appends the key columns of `slots` of one page's block: from the
    /// first column's first slot to the last column's last, the span the
    /// score loop walks.
    pub(crate) fn push_keys<E: Copy>(
        &mut self,
        keys: kvfence_pool::Keys<'_, E>,
        slots: Range<usize>,
    ) {
        let hd = keys.head_dim();
        if hd == 0 || slots.is_empty() {
            return;
        }
        let first = keys.column(0)[slots.start..].as_ptr() as usize;
        let elements = (hd - 1) * keys.stride() + slots.len();
        self.add(first, elements * std::mem::size_of::<E>());
    }

    fn add(&mut self, address: usize, bytes: usize) {
        self.runs.push((address, bytes));
        self.pushed += bytes;
    }

    /// Bytes pushed so far: where the next run starts in read order.
    pub(crate) fn len(&self) -> usize {
        self.pushed
    }

    /// The kernel is about to read the next `bytes`.
    #[inline]
    pub(crate) fn reading(&mut self, bytes: usize) {
        self.read += bytes;
        self.ask();
    }

    /// Reads have reached at least `offset` bytes (a chunk's start: the
    /// kernel's reports are per block and may fall short of a partial one).
    pub(crate) fn reached(&mut self, offset: usize) {
        self.read = self.read.max(offset);
        self.ask();
    }

    fn ask(&mut self) {
        while self.next < self.runs.len() && self.asked < self.read + AHEAD_BYTES {
            let (address, bytes) = self.runs[self.next];
            for line in self.plan.lines(address, bytes) {
                self.plan.prefetch(line);
            }
            self.asked += bytes;
            self.next += 1;
        }
    }

    /// The runs' allocation, for the next task.
    pub(crate) fn into_runs(self) -> Vec<(usize, usize)> {
        self.runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan asks for every run once, in order, and never more than
    /// [`AHEAD_BYTES`] (plus the run that crosses it) past what was read.
    #[test]
    fn ahead_asks_each_run_once_a_few_blocks_before_it_is_read() {
        let data = vec![0u8; 64 << 10];
        let mut ahead = Ahead::new(vec![(1, 1)]);
        assert_eq!(ahead.len(), 0, "a new plan starts empty");
        for run in data.chunks(2 << 10) {
            ahead.push(run);
        }
        assert_eq!(ahead.len(), data.len());
        ahead.reached(0);
        assert_eq!(
            ahead.asked, AHEAD_BYTES,
            "the first blocks are asked for up front"
        );
        let mut read = 0;
        while read < data.len() {
            ahead.reading(2 << 10);
            read += 2 << 10;
            assert!(ahead.asked >= (read + AHEAD_BYTES).min(data.len()));
            assert!(ahead.asked < read + AHEAD_BYTES + (2 << 10));
        }
        assert_eq!((ahead.next, ahead.asked), (ahead.runs.len(), data.len()));
        ahead.reached(data.len());
        assert_eq!(ahead.asked, data.len(), "nothing is asked for twice");
    }

    /// A run is asked for from its first line through the plan's first
    /// bytes, one address per line; a short run, whole.
    #[test]
    fn only_the_head_of_a_long_run_is_asked_for() {
        for plan in [Plan::HeadsToL1, Plan::BlocksToL2] {
            let long: Vec<usize> = plan.lines(4096, 4 << 10).collect();
            assert_eq!(long.len(), plan.bytes() / 64, "one prefetch per line");
            assert_eq!(long.first(), Some(&4096), "from the run's first line");
            assert!(long.windows(2).all(|pair| pair[1] - pair[0] == 64));
            assert_eq!(long.last(), Some(&(4096 + plan.bytes() - 64)));
            let short: Vec<usize> = plan.lines(100, 200).collect();
            assert_eq!(
                short,
                [100, 164, 228, 292],
                "a short run is asked for whole"
            );
            assert_eq!(plan.lines(0, 0).count(), 0, "an empty run asks for nothing");
        }
        // SmolLM2's 2 KB blocks: half of each into L1, or all into L2.
        assert_eq!(Plan::HeadsToL1.lines(0, 2 << 10).count(), 16);
        assert_eq!(Plan::BlocksToL2.lines(0, 2 << 10).count(), 32);
    }

    /// AMD's CPUs take the plan measured on Zen 4; every other maker's,
    /// the one measured on the Intel Xeon.
    #[test]
    fn the_plan_follows_the_cpus_maker() {
        assert_eq!(Plan::for_vendor(b"AuthenticAMD"), Plan::BlocksToL2);
        assert_eq!(Plan::for_vendor(b"GenuineIntel"), Plan::HeadsToL1);
    }
}
