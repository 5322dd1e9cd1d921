//! Which hand-written instruction sets the kernels may use. Its own module,
//! beneath everything that dispatches on it (`kernels`, `qtile`,
//! `attention`), so none of them imports another to ask.

use std::sync::OnceLock;

/// The widest hand-written instruction set the kernels may use: what the
/// CPU has, unless `KVFENCE_MAX_ISA` (`avx512`, `avx2` or `portable`) caps
/// it. Capping never changes a bit of any result (every variant performs
/// the same operations); it exists so one machine can measure the paths
/// another machine would take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaCap {
    /// Only the portable code (itself compiled per instruction set).
    Portable,
    /// Hand-written AVX2 kernels at most.
    Avx2,
    /// Hand-written AVX-512 kernels where the CPU has them (the default).
    Avx512,
}

/// The cap set by `KVFENCE_MAX_ISA`, read once per process. An unknown
/// value is reported on stderr and ignored.
pub fn widest_isa() -> IsaCap {
    static CAP: OnceLock<IsaCap> = OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("KVFENCE_MAX_ISA").as_deref() {
        Err(_) | Ok("avx512") => IsaCap::Avx512,
        Ok("avx2") => IsaCap::Avx2,
        Ok("portable") => IsaCap::Portable,
        Ok(other) => {
            eprintln!("KVFENCE_MAX_ISA={other:?} is not one of avx512, avx2, portable: ignored");
            IsaCap::Avx512
        }
    })
}
