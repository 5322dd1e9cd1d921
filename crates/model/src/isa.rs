//! Which instruction sets the kernels may use. Its own module, beneath
//! everything that dispatches on it (`kernels`, `qtile`, `attention`,
//! `quant`), so none of them imports another to ask.
//!
//! Two kinds of code take an instruction set: the hand-written kernels
//! (`qtile`'s and `attention`'s AVX2 and AVX-512 tiles), which ask
//! [`widest_isa`], and plain Rust compiled once per instruction set and
//! picked at run time ([`per_isa!`], which asks [`Compiled::current`]).
//! `KVFENCE_MAX_ISA` caps both, so a capped run executes the code a
//! machine of that kind would.

use std::sync::OnceLock;

/// The widest instruction set the kernels may use: what the CPU has,
/// unless `KVFENCE_MAX_ISA` (`avx512`, `avx2` or `portable`) caps it.
/// Capping never changes a bit of any result (every variant performs
/// the same operations); it exists so one machine can measure the paths
/// another machine would take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaCap {
    /// Only the portable code: no hand-written kernels, the compiled code
    /// as the CPU allows (so the portable kernels are tested and measured
    /// at full speed; without FMA instructions every `mul_add` would be a
    /// library call).
    Portable,
    /// Hand-written AVX2 kernels at most, and the compiled code's AVX2
    /// variant: what a CPU without AVX-512 runs.
    Avx2,
    /// Hand-written AVX-512 kernels where the CPU has them (the default).
    Avx512,
}

/// The cap set by `KVFENCE_MAX_ISA`, read once per process. An empty
/// value is no cap; an unknown one is reported on stderr and ignored.
pub fn widest_isa() -> IsaCap {
    static CAP: OnceLock<IsaCap> = OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("KVFENCE_MAX_ISA").as_deref() {
        // Set but empty, as a manifest's blank value leaves it: no cap.
        Err(_) | Ok("" | "avx512") => IsaCap::Avx512,
        Ok("avx2") => IsaCap::Avx2,
        Ok("portable") => IsaCap::Portable,
        Ok(other) => {
            eprintln!("KVFENCE_MAX_ISA={other:?} is not one of avx512, avx2, portable: ignored");
            IsaCap::Avx512
        }
    })
}

/// The variant of the code compiled per instruction set ([`per_isa!`]) a
/// process runs. Off x86-64 there is only the baseline (which is NEON's
/// on AArch64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Compiled {
    /// The target's baseline (SSE2 on x86-64; every other target's default).
    Baseline,
    /// AVX2 with FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 (F and VL) on top of those.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Compiled {
    /// What this CPU has within [`widest_isa`], decided once per process.
    pub(crate) fn current() -> Compiled {
        static LEVEL: OnceLock<Compiled> = OnceLock::new();
        *LEVEL.get_or_init(|| Compiled::of_this_cpu().within(widest_isa()))
    }

    /// The widest variant this CPU can run.
    fn of_this_cpu() -> Compiled {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            if avx2
                && std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512vl")
            {
                return Compiled::Avx512;
            }
            if avx2 {
                return Compiled::Avx2;
            }
        }
        Compiled::Baseline
    }

    /// This CPU's variant under `cap`: the AVX2 cap stands for a CPU
    /// without AVX-512, so the compiled code is held to AVX2 as well; the
    /// portable cap turns only the hand-written kernels off.
    fn within(self, cap: IsaCap) -> Compiled {
        match cap {
            #[cfg(target_arch = "x86_64")]
            IsaCap::Avx2 => self.min(Compiled::Avx2),
            _ => self,
        }
    }
}

/// How a process's start-up log names its kernels: the hand-written ones
/// it runs (`hand_written`, `Portable` for none), the variant of the
/// compiled code, and the cap when one is set.
pub(crate) fn describe(hand_written: IsaCap, compiled: Compiled, cap: IsaCap) -> String {
    let hand_written = match hand_written {
        IsaCap::Avx512 => "hand-written AVX-512 kernels",
        IsaCap::Avx2 => "hand-written AVX2 kernels",
        IsaCap::Portable => "no hand-written kernels",
    };
    let compiled = match compiled {
        #[cfg(target_arch = "x86_64")]
        Compiled::Avx512 => "AVX-512",
        #[cfg(target_arch = "x86_64")]
        Compiled::Avx2 => "AVX2",
        Compiled::Baseline => "the baseline",
    };
    let cap = match cap {
        IsaCap::Avx512 => "",
        IsaCap::Avx2 => " (KVFENCE_MAX_ISA=avx2)",
        IsaCap::Portable => " (KVFENCE_MAX_ISA=portable)",
    };
    format!("{hand_written}, the rest compiled for {compiled}{cap}")
}

/// Defines a function whose body is compiled three times — for the
/// baseline, for AVX2 (with FMA and F16C) and for AVX-512 — and runs the
/// variant [`Compiled::current`] names. The body is plain Rust that the
/// compiler vectorises; Rust never fuses a multiply and an add unless
/// `mul_add` asks, so every variant rounds alike: the choice changes speed,
/// never bits. (The `multiversion` crate did this before, but picked by
/// the CPU alone, so a capped run still took the AVX-512 variant.)
///
/// Takes a function with plain parameters (`name: Type`) and either
/// lifetimes or bounded type parameters (`<W: Trait>`).
macro_rules! per_isa {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident
        $(< $($lt:lifetime),* $($param:ident : $bound:path),* >)?
        ($($arg:ident : $ty:ty),* $(,)?) $(-> $ret:ty)?
        $body:block
    ) => {
        $(#[$attr])*
        $vis fn $name $(< $($lt,)* $($param: $bound),* >)? ($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
                fn avx512 $(< $($lt,)* $($param: $bound),* >)? ($($arg: $ty),*) $(-> $ret)?
                    $body
                #[target_feature(enable = "avx2,fma,f16c")]
                fn avx2 $(< $($lt,)* $($param: $bound),* >)? ($($arg: $ty),*) $(-> $ret)?
                    $body
                // Calling a variant is unsafe only in that the CPU must have
                // its instructions, which `Compiled::current` checked.
                #[allow(unsafe_code)]
                match $crate::isa::Compiled::current() {
                    // SAFETY: `Compiled::current` names only a variant
                    // whose instructions this CPU has.
                    $crate::isa::Compiled::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::isa::Compiled::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::isa::Compiled::Baseline => {}
                }
            }
            $body
        }
    };
}
pub(crate) use per_isa;

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 cap holds the compiled code to AVX2 on an AVX-512 CPU, as
    /// it holds the hand-written kernels; no cap lends a CPU what it lacks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_cap_holds_the_compiled_code_to_what_a_capped_cpu_runs() {
        use Compiled::{Avx2, Avx512, Baseline};
        let cases = [
            (Avx512, IsaCap::Avx512, Avx512),
            (Avx512, IsaCap::Avx2, Avx2),
            (Avx512, IsaCap::Portable, Avx512),
            (Avx2, IsaCap::Avx512, Avx2),
            (Avx2, IsaCap::Avx2, Avx2),
            (Avx2, IsaCap::Portable, Avx2),
            (Baseline, IsaCap::Avx512, Baseline),
            (Baseline, IsaCap::Avx2, Baseline),
        ];
        for (cpu, cap, runs) in cases {
            assert_eq!(cpu.within(cap), runs, "{cpu:?} capped at {cap:?}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_log_names_the_kernels_and_the_cap() {
        assert_eq!(
            describe(IsaCap::Avx512, Compiled::Avx512, IsaCap::Avx512),
            "hand-written AVX-512 kernels, the rest compiled for AVX-512"
        );
        assert_eq!(
            describe(IsaCap::Avx2, Compiled::Avx2, IsaCap::Avx2),
            "hand-written AVX2 kernels, the rest compiled for AVX2 (KVFENCE_MAX_ISA=avx2)"
        );
        assert_eq!(
            describe(IsaCap::Portable, Compiled::Baseline, IsaCap::Portable),
            "no hand-written kernels, the rest compiled for the baseline (KVFENCE_MAX_ISA=portable)"
        );
    }

    per_isa! {
        /// A sum of products that rounds each product-and-add once.
        fn fused_sum(a: &[f32], b: &[f32]) -> f32 {
            a.iter().zip(b).fold(0.0f32, |acc, (&x, &y)| x.mul_add(y, acc))
        }
    }

    per_isa! {
        fn first_of<'a>(a: &'a [f32]) -> Option<&'a f32> {
            a.first()
        }
    }

    per_isa! {
        fn apply<F: Fn(f32) -> f32>(a: &mut [f32], f: F) {
            a.iter_mut().for_each(|x| *x = f(*x));
        }
    }

    /// A function defined through the macro behaves as its body says,
    /// whichever variant this CPU runs.
    #[test]
    fn a_function_compiled_per_instruction_set_is_its_body() {
        let a: Vec<f32> = (0..100).map(|i| i as f32 * 0.37 - 11.0).collect();
        let b: Vec<f32> = (0..100).map(|i| 1.0 / (i as f32 + 1.5)).collect();
        let expected = a
            .iter()
            .zip(&b)
            .fold(0.0f32, |acc, (&x, &y)| x.mul_add(y, acc));
        assert_eq!(fused_sum(&a, &b).to_bits(), expected.to_bits());
        assert_eq!(first_of(&a), Some(&-11.0));
        let mut c = a.clone();
        apply(&mut c, |x| x * 2.0);
        assert!(c.iter().zip(&a).all(|(c, a)| *c == a * 2.0));
    }
}
