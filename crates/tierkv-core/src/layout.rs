//! The byte layout of one chunk, agreed when a worker registers.

/// The element type of one tensor of a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 8-bit float, e4m3.
    F8E4M3,
    /// 8-bit float, e5m2.
    F8E5M2,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// 32-bit IEEE float.
    F32,
    /// Signed bytes (quantised caches).
    I8,
    /// Unsigned bytes (opaque payloads).
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size_bytes(self) -> u64 {
        match self {
            DType::F8E4M3 | DType::F8E5M2 | DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
        }
    }
}

/// One tensor of a chunk: its element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    /// Element type.
    pub dtype: DType,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
}

/// The shape and dtype list of one chunk; every object of one layout has the same size.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    tensors: Vec<TensorSpec>,
    size_bytes: u64,
}

/// A layout that cannot describe a chunk.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// No tensors at all.
    #[error("a layout needs at least one tensor")]
    Empty,
    /// A tensor with no dimensions or a zero-length dimension.
    #[error("tensor {tensor} has an empty shape or a zero dimension")]
    EmptyTensor {
        /// Index of the tensor in the layout.
        tensor: usize,
    },
    /// The size does not fit in 64 bits.
    #[error("layout size overflows 64 bits")]
    Overflow,
}

impl Layout {
    /// Validates the tensors and computes the chunk size once.
    pub fn new(tensors: Vec<TensorSpec>) -> Result<Self, LayoutError> {
        if tensors.is_empty() {
            return Err(LayoutError::Empty);
        }
        let mut size_bytes: u64 = 0;
        for (index, tensor) in tensors.iter().enumerate() {
            if tensor.shape.is_empty() || tensor.shape.contains(&0) {
                return Err(LayoutError::EmptyTensor { tensor: index });
            }
            let elements = tensor
                .shape
                .iter()
                .try_fold(1u64, |acc, dim| acc.checked_mul(*dim))
                .ok_or(LayoutError::Overflow)?;
            let bytes =
                elements.checked_mul(tensor.dtype.size_bytes()).ok_or(LayoutError::Overflow)?;
            size_bytes = size_bytes.checked_add(bytes).ok_or(LayoutError::Overflow)?;
        }
        Ok(Layout { tensors, size_bytes })
    }

    /// An opaque layout of `size_bytes` bytes (one `U8` tensor).
    pub fn bytes(size_bytes: u64) -> Result<Self, LayoutError> {
        Self::new(vec![TensorSpec { dtype: DType::U8, shape: vec![size_bytes] }])
    }

    /// The tensors, in order.
    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Bytes of one chunk of this layout.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_sums_every_tensor() {
        // K and V of 2 layers x 256 tokens x 8 heads x 128 dims in bf16.
        let kv = TensorSpec { dtype: DType::BF16, shape: vec![2, 2, 256, 8, 128] };
        let scales = TensorSpec { dtype: DType::F32, shape: vec![2, 256] };
        let layout = Layout::new(vec![kv, scales]).unwrap();
        assert_eq!(layout.size_bytes(), 2 * 2 * 256 * 8 * 128 * 2 + 2 * 256 * 4);
        assert_eq!(Layout::bytes(4096).unwrap().size_bytes(), 4096);
    }

    #[test]
    fn bad_layouts_are_typed_errors() {
        assert_eq!(Layout::new(vec![]), Err(LayoutError::Empty));
        let zero = TensorSpec { dtype: DType::F16, shape: vec![4, 0] };
        assert_eq!(Layout::new(vec![zero]), Err(LayoutError::EmptyTensor { tensor: 0 }));
        let none = TensorSpec { dtype: DType::F16, shape: vec![] };
        assert_eq!(Layout::new(vec![none]), Err(LayoutError::EmptyTensor { tensor: 0 }));
        let huge = TensorSpec { dtype: DType::F32, shape: vec![u64::MAX / 2, 3] };
        assert_eq!(Layout::new(vec![huge]), Err(LayoutError::Overflow));
    }
}
