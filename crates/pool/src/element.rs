//! Element types a pool can store, and the bit patterns used to scrub them.

/// Element type of the K and V values stored in pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ElemType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
}

impl ElemType {
    /// The lower-case name used on command lines and in peer greetings.
    pub fn name(self) -> &'static str {
        match self {
            ElemType::F32 => "f32",
            ElemType::F16 => "f16",
            ElemType::BF16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            ElemType::F32 => 4,
            ElemType::F16 | ElemType::BF16 => 2,
        }
    }
}

/// A K/V element type. Implemented for `f32`, `half::f16` and `half::bf16`.
pub trait KvElement: bytemuck::Pod + Send + Sync + 'static {
    /// The matching runtime tag.
    const ELEM: ElemType;
}

impl KvElement for f32 {
    const ELEM: ElemType = ElemType::F32;
}

impl KvElement for half::f16 {
    const ELEM: ElemType = ElemType::F16;
}

impl KvElement for half::bf16 {
    const ELEM: ElemType = ElemType::BF16;
}

/// A 64-bit word filled with a quiet-NaN pattern of `elem`, for poisoning
/// storage. Distinct payloads make poison recognisable in a debugger.
pub(crate) fn poison_word(elem: ElemType) -> u64 {
    match elem {
        ElemType::F32 => {
            let nan = u64::from(0x7FC0_DEADu32);
            nan << 32 | nan
        }
        ElemType::F16 => 0x7E0D_7E0D_7E0D_7E0D,
        ElemType::BF16 => 0x7FC1_7FC1_7FC1_7FC1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_reads_as_nan_in_every_element_type() {
        let words = [
            poison_word(ElemType::F32),
            poison_word(ElemType::F16),
            poison_word(ElemType::BF16),
        ];
        let f32s: &[f32] = bytemuck::cast_slice(&words[0..1]);
        assert!(f32s.iter().all(|x| x.is_nan()));
        let f16s: &[half::f16] = bytemuck::cast_slice(&words[1..2]);
        assert!(f16s.iter().all(|x| x.is_nan()));
        let bf16s: &[half::bf16] = bytemuck::cast_slice(&words[2..3]);
        assert!(bf16s.iter().all(|x| x.is_nan()));
    }
}
